"""Pipeline schedules as data: for every pipeline rank, the ordered list of actions.

An action is ``F`` (forward) or ``B`` (backward, input and weight gradients) of one
microbatch on one stage, written ``{stage}{kind}{microbatch}`` as torch.distributed.pipelining
does (``0F0``, ``3B7``). GPipe and 1F1B with p=4 stages and m=8 microbatches, in unit time
(F = B = 1)::

    gpipe                                       1f1b
    rank 0 | 0F0 0F1 0F2 0F3 0F4 0F5 ...        rank 0 | 0F0 0F1 0F2 0F3 .   .   .   0B0 0F4 ...
    rank 3 | .   .   .   3F0 3F1 3F2 ...        rank 3 | .   .   .   3F0 3B0 3F1 3B1 3F2 ...

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
    stage: int  # pipeline stage the action computes (its rank runs it)
    kind: str  # "F" | "B"
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


Schedule = list[list[Action]]  # schedule[pp_rank] -> actions in issue order


def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all backwards in microbatch order (torch ScheduleGPipe order)."""
    return [[Action(s, "F", i) for i in range(m)] + [Action(s, "B", i) for i in range(m)] for s in range(p)]


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush): p-s-1 warm-up forwards, then alternate, then drain backwards."""
    out = []
    for s in range(p):
        warm = min(p - s - 1, m)
        acts = [Action(s, "F", i) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action(s, "F", warm + i), Action(s, "B", i)]
        acts += [Action(s, "B", i) for i in range(m - warm, m)]
        out.append(acts)
    return out


def build_schedule(name: str, p: int, m: int) -> Schedule:
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    raise KeyError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")


def action_deps(a: Action, last_stage: int) -> list[tuple[int, str, int]]:
    """(stage, kind, mb) that must finish before ``a``: the previous stage's forward, the
    next stage's backward, and this stage's own forward."""
    if a.kind == "F":
        return [(a.stage - 1, "F", a.mb)] if a.stage > 0 else []
    deps = [(a.stage, "F", a.mb)]
    if a.stage < last_stage:
        deps.append((a.stage + 1, "B", a.mb))
    return deps


def unit_time_grid(schedule: Schedule) -> list[list[Action | None]]:
    """Place every action in unit-time slots (F = B = 1, free communication).

    Each rank issues its actions strictly in list order, an action waiting for
    :func:`action_deps` to finish in an earlier slot, so the grid shows the schedule's bubbles.
    """
    last_stage = max(a.stage for acts in schedule for a in acts)
    done: dict[tuple[int, str, int], int] = {}  # (stage, kind, mb) -> slot it ran in
    pos = [0] * len(schedule)
    grid: list[list[Action | None]] = [[] for _ in schedule]
    slot, placed, total = 0, 0, sum(len(a) for a in schedule)
    while placed < total:
        fired = []
        for r, acts in enumerate(schedule):
            a = acts[pos[r]] if pos[r] < len(acts) else None
            ready = a is not None and all(done.get(d, slot) < slot for d in action_deps(a, last_stage))
            grid[r].append(a if ready else None)
            if ready:
                fired.append((r, a))
        if not fired:
            raise ValueError("schedule deadlocks: no rank can issue its next action")
        for r, a in fired:
            done[(a.stage, a.kind, a.mb)] = slot
            pos[r] += 1
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


_TOKEN = re.compile(r"^(\d+)([FB])(\d+)$")


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
            acts.append(Action(int(mt.group(1)), mt.group(2), int(mt.group(3))))
        out.append(acts)
    return out
