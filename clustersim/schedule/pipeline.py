"""Pipeline schedules as data: for every pipeline rank, the ordered list of actions.

An action is ``F`` (forward) or ``B`` (backward, input and weight gradients) of one
microbatch. GPipe and 1F1B with p=4 stages and m=8 microbatches, in unit time (F = B = 1)::

    gpipe                                          1f1b
    rank 0  F0 F1 F2 F3 F4 F5 F6 F7 .  .  ...      rank 0  F0 F1 F2 F3 .  .  .  B0 F4 B1 ...
    rank 3  .  .  .  F0 F1 F2 F3 F4 ...            rank 3  .  .  .  F0 B0 F1 B1 F2 B2 ...

Both leave (p-1)(F+B) idle per rank, a fraction (p-1)/(m+p-1) of the step
(Narayanan et al. SC'21, Sec 2.2); 1F1B holds at most p microbatches of activations where
GPipe holds m (Fan et al. 2021 "DAPPLE"; Narayanan et al. 2019 "PipeDream-Flush").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True, order=True)
class Action:
    kind: str  # "F" | "B"
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}"


Schedule = list[list[Action]]  # schedule[pp_rank] -> actions in issue order


def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all backwards in microbatch order (torch ScheduleGPipe order)."""
    return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(p)]


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush): p-s-1 warm-up forwards, then alternate, then drain backwards."""
    out = []
    for s in range(p):
        warm = min(p - s - 1, m)
        acts = [Action("F", i) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action("F", warm + i), Action("B", i)]
        acts += [Action("B", i) for i in range(m - warm, m)]
        out.append(acts)
    return out


def build_schedule(name: str, p: int, m: int) -> Schedule:
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    raise KeyError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")


def unit_time_grid(schedule: Schedule) -> list[list[Action | None]]:
    """Place every action in unit-time slots (F = B = 1, free communication).

    F(s, i) needs F(s-1, i) done; B(s, i) needs B(s+1, i) and F(s, i) done. Each rank issues
    its actions strictly in list order, so the grid shows exactly the schedule's bubbles.
    """
    p = len(schedule)
    done: dict[tuple[int, str, int], int] = {}  # (stage, kind, mb) -> slot it finished in
    pos = [0] * p
    grid: list[list[Action | None]] = [[] for _ in range(p)]
    slot = 0
    total = sum(len(a) for a in schedule)
    placed = 0
    while placed < total:
        fired = []
        for s in range(p):
            if pos[s] >= len(schedule[s]):
                grid[s].append(None)
                continue
            a = schedule[s][pos[s]]
            deps = [(s - 1, "F", a.mb)] if a.kind == "F" and s > 0 else []
            if a.kind == "B":
                deps = [(s, "F", a.mb)] + ([(s + 1, "B", a.mb)] if s < p - 1 else [])
            if all(done.get(d, slot) < slot for d in deps):
                grid[s].append(a)
                fired.append((s, a))
            else:
                grid[s].append(None)
        if not fired:
            raise ValueError("schedule deadlocks")
        for s, a in fired:
            done[(s, a.kind, a.mb)] = slot
            pos[s] += 1
        placed += len(fired)
        slot += 1
    return grid


def format_grid(schedule: Schedule) -> str:
    """The step x rank grid: one row per pipeline rank, ``.`` for an idle slot."""
    grid = unit_time_grid(schedule)
    width = max(len(str(a)) for row in grid for a in row if a is not None)
    lines = []
    for s, row in enumerate(grid):
        cells = " ".join((str(a) if a else ".").ljust(width) for a in row)
        lines.append(f"rank {s:<3}| {cells}".rstrip())
    return "\n".join(lines)


_TOKEN = re.compile(r"^([FB])(\d+)$")


def parse_grid(text: str) -> Schedule:
    """Inverse of :func:`format_grid`: per-rank action lists (idle slots dropped)."""
    out = []
    for line in text.strip().splitlines():
        _, _, cells = line.partition("|")
        acts = []
        for tok in cells.split():
            if tok == ".":
                continue
            mt = _TOKEN.match(tok)
            if not mt:
                raise ValueError(f"bad action {tok!r}")
            acts.append(Action(mt.group(1), int(mt.group(2))))
        out.append(acts)
    return out
