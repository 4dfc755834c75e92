"""A pipeline schedule as pure data: per-rank action lists over virtual stages.

An action is a forward ``F``, a backward ``B`` or a weight-gradient ``W`` of one microbatch
on one *virtual stage*, written ``{stage}{kind}{mb}`` as torch.distributed.pipelining does
(``0F0``, ``5B3``, ``2W7``). A virtual stage is one contiguous slice of layers (a *part* of
the model) placed on one rank; a rank may run several (interleaved 1F1B runs ``v`` chunks per
rank, DualPipe two parts, one per direction). Every microbatch walks a *path* of virtual
stages whose parts are 0, 1, ..., n_parts-1 in model order; dependencies follow the path::

    F(k, mb)  after  F(previous stage on mb's path, mb)
    B(k, mb)  after  F(k, mb) and B(next stage on mb's path, mb)
    W(k, mb)  after  B(k, mb)

With W actions present (``split_backward``) B is the input gradient only and W the weight
gradient (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv:2401.10241); without, B is
the whole backward. A full backward inside a split schedule is written ``B`` then its ``W``
right after it on the same rank.

Overlapped chunks (DualPipe's F&B, DeepSeek-V3 report arXiv:2412.19437 Sec 3.2.1): a rank may
run a forward and the backward listed right after it as one overlapped chunk (``fb_pairs``).
The chunk starts when the inputs of both have arrived and releases its outputs when it ends;
printed grids mark the backward with ``&`` (``4F5 &7B1 7W1``). The W of that backward, if it
follows immediately, belongs to the chunk (the chunk's backward is a full backward).

Time is modelled by list scheduling with free communication: each rank issues its actions
strictly in list order, each as early as its rank is free and its dependencies have ended.
With F = B = W = 1 this is the "unit-time" grid the golden tests review; it also gives the
closed-form bubbles ((p-1)(F+B) for 1F1B, etc.) for other durations.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from ..errors import ConfigError

KINDS = ("F", "B", "W")
DEFAULT_DURATIONS = {"F": 1, "B": 1, "W": 1}
FB = "F&B"  # durations key: one overlapped forward + full backward chunk

Key = tuple[int, str, int]  # (stage, kind, mb)


class ScheduleError(ConfigError, ValueError):
    """A schedule that cannot run (bad parameters, malformed custom text, deadlock).

    A ConfigError so the command line prints it as one line; a ValueError for library users.
    """


@dataclass(frozen=True, order=True)
class Action:
    stage: int  # virtual stage the action computes (PipelineSchedule.stage_rank says where)
    kind: str  # "F" | "B" | "W"
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    @property
    def key(self) -> Key:
        return (self.stage, self.kind, self.mb)


@dataclass(frozen=True)
class PipelineSchedule:
    """Per-rank action lists plus where each virtual stage runs and what it computes.

    ``actions[r]`` is rank r's issue order. ``stage_part[k]`` is the model part (contiguous
    slice of layers, 0..n_parts-1 in model order) virtual stage k computes; it defaults to
    ``k``. ``stage_rank`` and ``paths`` are derived: the rank whose row holds stage k, and for
    each microbatch the stages it visits ordered by part (its forward order).

    It also reads as the old ``list[list[Action]]``: ``sched[r]``, ``len(sched)``, iteration.
    Construction checks the structure (every microbatch F, B and, if split, W exactly once per
    stage, in that order on the stage's row; every microbatch through every part once);
    :func:`make_schedule` also checks that it runs to the end.
    """

    name: str = field(compare=False)
    actions: tuple[tuple[Action, ...], ...]
    stage_part: tuple[int, ...] | None = None
    fb_pairs: tuple[tuple[tuple[Action, Action], ...], ...] = ()  # per rank: overlapped (F, B)
    stage_rank: tuple[int, ...] = field(init=False)
    paths: tuple[tuple[int, ...], ...] = field(init=False)  # paths[mb]: stages in forward order

    def __post_init__(self):
        rows = tuple(tuple(r) for r in self.actions)
        object.__setattr__(self, "actions", rows)
        stage_rank = _stage_ranks(rows)
        n_stages = len(stage_rank)
        part = tuple(range(n_stages)) if self.stage_part is None else tuple(self.stage_part)
        if len(part) != n_stages:
            raise ScheduleError(f"stage_part has {len(part)} entries but the schedule has {n_stages} stages")
        if sorted(set(part)) != list(range(len(set(part)))):
            raise ScheduleError(f"stage_part {list(part)} must use parts 0..n-1 with none skipped")
        object.__setattr__(self, "stage_part", part)
        object.__setattr__(self, "stage_rank", stage_rank)
        split = _check_rows(rows)
        object.__setattr__(self, "paths", _paths(rows, part, stage_rank))
        pairs = tuple(tuple(p) for p in self.fb_pairs) or tuple(() for _ in rows)
        if len(pairs) != len(rows):
            raise ScheduleError(f"fb_pairs has {len(pairs)} rows but the schedule has {len(rows)} ranks")
        for r, rp in enumerate(pairs):
            if not rp:
                continue
            acts = rows[r]
            at = {a: i for i, a in enumerate(acts)}
            for f, b in rp:
                i = at.get(f, -1)
                if f.kind != "F" or b.kind != "B" or i < 0 or i + 1 >= len(acts) or acts[i + 1] != b:
                    raise ScheduleError(f"rank {r}: overlapped pair ({f}, {b}) must be a forward followed "
                                        f"directly by a backward on that rank")
                if (b.stage, b.mb) == (f.stage, f.mb):  # a backward waits for its own forward
                    raise ScheduleError(f"rank {r}: {b} cannot overlap {f}: it needs that forward's result")
        object.__setattr__(self, "fb_pairs", pairs)
        object.__setattr__(self, "_split", split)
        nxt, prv = {}, {}
        for mb, path in enumerate(self.paths):
            for a, b in zip(path, path[1:]):
                nxt[(a, mb)], prv[(b, mb)] = b, a
        object.__setattr__(self, "_next", nxt)
        object.__setattr__(self, "_prev", prv)

    # --- read as the old list-of-lists Schedule -------------------------------------------
    def __getitem__(self, rank: int) -> tuple[Action, ...]:
        return self.actions[rank]

    def __len__(self) -> int:
        return len(self.actions)

    def __iter__(self):
        return iter(self.actions)

    # --- shape ------------------------------------------------------------------------------
    @property
    def ranks(self) -> int:
        return len(self.actions)

    @property
    def n_stages(self) -> int:
        return len(self.stage_rank)

    @property
    def n_parts(self) -> int:
        return len(set(self.stage_part))

    @property
    def n_microbatches(self) -> int:
        return len(self.paths)

    @property
    def split_backward(self) -> bool:
        """True when the schedule has W actions: B is then the input gradient only."""
        return self._split

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """Virtual stages rank ``rank`` runs, ascending."""
        return tuple(k for k, r in enumerate(self.stage_rank) if r == rank)

    def next_stage(self, stage: int, mb: int) -> int | None:
        """Stage that receives ``stage``'s forward output for ``mb`` (None at the path's end)."""
        return self._next.get((stage, mb))

    def prev_stage(self, stage: int, mb: int) -> int | None:
        """Stage whose output ``stage`` consumes for ``mb`` (None at the path's start)."""
        return self._prev.get((stage, mb))

    def deps(self, a: Action) -> list[Key]:
        """(stage, kind, mb) that must finish before ``a`` can start."""
        return list(_deps_of(self, a.stage, a.kind, a.mb))

    def overlapped_with(self, rank: int) -> dict[Action, Action]:
        """rank's overlapped chunks as {backward: forward}."""
        return {b: f for f, b in self.fb_pairs[rank]}


Schedule = PipelineSchedule  # the old name; plain list[list[Action]] is still accepted


def dependencies(schedule: PipelineSchedule | Sequence[Sequence[Action]], a: Action) -> list[Key]:
    """(stage, kind, mb) that must finish before ``a``: see :meth:`PipelineSchedule.deps`."""
    return as_schedule(schedule).deps(a)


def as_schedule(s: PipelineSchedule | Sequence[Sequence[Action]], name: str = "custom") -> PipelineSchedule:
    """Accept the old ``list[list[Action]]`` form: row r is rank r, stage k computes part k."""
    return s if isinstance(s, PipelineSchedule) else PipelineSchedule(name, tuple(tuple(r) for r in s))


def make_schedule(name: str, rows: Sequence[Sequence[Action]], *, stage_part: Sequence[int] | None = None,
                  fb_pairs: Sequence[Sequence[tuple[Action, Action]]] = ()) -> PipelineSchedule:
    """Build, check the structure, and check it runs to the end (raises on deadlock)."""
    s = PipelineSchedule(name, tuple(tuple(r) for r in rows), None if stage_part is None else tuple(stage_part),
                         tuple(tuple(p) for p in fb_pairs))
    timeline(s)
    return s


# --- structure checks ---------------------------------------------------------------------

def _stage_ranks(rows) -> tuple[int, ...]:
    where: dict[int, int] = {}
    for r, acts in enumerate(rows):
        for a in acts:
            if not isinstance(a, Action) or a.kind not in KINDS or a.stage < 0 or a.mb < 0:
                raise ScheduleError(f"rank {r}: {a!r} is not an action {{stage}}{{F|B|W}}{{mb}}")
            if where.setdefault(a.stage, r) != r:
                raise ScheduleError(f"stage {a.stage} appears on rank {where[a.stage]} and on rank {r} "
                                    f"(token {a}); a stage runs on exactly one rank")
    if not where:
        raise ScheduleError("schedule has no actions")
    missing = [k for k in range(max(where) + 1) if k not in where]
    if missing:
        raise ScheduleError(f"stages must be numbered 0..{max(where)}; stage {missing[0]} never appears")
    return tuple(where[k] for k in range(len(where)))


def _check_rows(rows) -> bool:
    """Every (stage, mb) has F, B and (if any W exists) W once each, in that order on its row.

    Checked on arrays (:func:`_rows_sound`); where they find a fault, :func:`_row_faults`
    walks the rows to name the first one (a built-in 1F1B of 64 stages and 512 microbatches
    has 65,536 actions, and the walk cost its load a fifth of its time)."""
    split = any(a.kind == "W" for acts in rows for a in acts)
    if _rows_sound(rows, split):
        return split
    return _row_faults(rows, split)


_KIND_CODE = {"F": 0, "B": 1, "W": 2}


def _rows_sound(rows, split: bool) -> bool:
    """Whether :func:`_check_rows` passes, on arrays: microbatches 0..n-1, each action once,
    each B after its F and each W after its B on the same row, and every (stage, mb) with
    actions has all of F, B (and W when ``split``). Each stage is on one row
    (:func:`_stage_ranks` checked it), so "once" and "after" can be judged over all the rows
    laid end to end::

        code = (stage * 3 + kind) * n_mb + mb        kind: F 0, B 1, W 2
        need = code - n_mb                           B needs F, W needs B: one kind down
    """
    n = sum(map(len, rows))
    if n == 0:
        return False
    stage = np.fromiter((a.stage for acts in rows for a in acts), np.int64, n)
    kind = np.fromiter((_KIND_CODE[a.kind] for acts in rows for a in acts), np.int64, n)
    mb = np.fromiter((a.mb for acts in rows for a in acts), np.int64, n)
    n_mb = int(mb.max()) + 1
    # a microbatch never appears (counted, not np.unique: its first call imports numpy.ma, 10 ms)
    if int(mb.min()) < 0 or not np.bincount(mb, minlength=n_mb).all():
        return False
    code = (stage * 3 + kind) * n_mb + mb
    order = np.argsort(code, kind="stable")
    ranked = code[order]
    if (ranked[1:] == ranked[:-1]).any():  # an action twice
        return False
    later = np.flatnonzero(kind > 0)
    need = code[later] - n_mb
    at = np.minimum(np.searchsorted(ranked, need), n - 1)
    if (ranked[at] != need).any() or (order[at] >= later).any():  # missing, or after it
        return False
    # no action twice and every B has its F (every W its B): each (stage, mb) has F and B, and
    # W too if it has as many actions as kinds
    per = np.unique(stage * n_mb + mb, return_counts=True)[1]
    return bool((per == (3 if split else 2)).all())


def _row_faults(rows, split: bool) -> bool:
    """:func:`_check_rows` action by action: raises ScheduleError naming the first fault."""
    mbs = sorted({a.mb for acts in rows for a in acts})
    if mbs != list(range(len(mbs))):
        gap = next(i for i in range(len(mbs) + 1) if i >= len(mbs) or mbs[i] != i)
        raise ScheduleError(f"microbatches must be numbered 0..{mbs[-1]}; microbatch {gap} never appears")
    for r, acts in enumerate(rows):
        seen: dict[Key, int] = {}
        for i, a in enumerate(acts):
            k = a.key
            if k in seen:
                raise ScheduleError(f"rank {r}: {a} appears twice (actions {seen[k]} and {i} of that rank)")
            seen[k] = i
            if a.kind != "F":
                before = "F" if a.kind == "B" else "B"
                j = seen.get((a.stage, before, a.mb))
                if j is None:
                    where = "is missing" if (a.stage, before, a.mb) not in _keys(acts) else "comes after it"
                    raise ScheduleError(f"rank {r}, action {i}: {a} needs {a.stage}{before}{a.mb} before it on "
                                        f"the same rank, but {a.stage}{before}{a.mb} {where}")
        need = ("F", "B", "W") if split else ("F", "B")
        for (stage, kind, mb) in sorted(seen):
            for k in need:
                if (stage, k, mb) not in seen:
                    what = "weight-gradient W" if k == "W" else ("backward B" if k == "B" else "forward F")
                    why = " (the schedule has W actions, so every backward needs one)" if k == "W" else ""
                    raise ScheduleError(f"rank {r}: stage {stage} has {stage}{kind}{mb} but no {what} for "
                                        f"microbatch {mb}{why}")
    return split


def _keys(acts) -> set[Key]:
    return {a.key for a in acts}


def _paths(rows, part, stage_rank) -> tuple[tuple[int, ...], ...]:
    stages_of_mb: dict[int, list[int]] = {}
    for acts in rows:
        for a in acts:
            if a.kind == "F":
                stages_of_mb.setdefault(a.mb, []).append(a.stage)
    n_parts = len(set(part))
    out = []
    for mb in range(len(stages_of_mb)):
        path = tuple(sorted(stages_of_mb[mb], key=lambda k: (part[k], k)))
        parts = [part[k] for k in path]
        if parts != list(range(n_parts)):
            rule = f"every microbatch must pass through each of parts 0..{n_parts - 1} exactly once"
            twice = next((q for q in parts if parts.count(q) > 1), None)
            if twice is not None:
                on = [k for k in path if part[k] == twice]
                raise ScheduleError(f"microbatch {mb} computes part {twice} twice (stages {on}); {rule}")
            q = next(q for q in range(n_parts) if q not in parts)
            where = ", ".join(f"stage {k} on rank {stage_rank[k]}" for k in range(len(part)) if part[k] == q)
            raise ScheduleError(f"microbatch {mb} runs on stages {list(path)} but never on part {q} ({where}); {rule}")
        out.append(path)
    return tuple(out)


# --- time ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Timeline:
    """When every action runs under list scheduling with free communication.

    ``start``/``end`` are where an action is drawn (inside an overlapped chunk without an
    ``F&B`` duration its parts are drawn one after another); ``release`` is when its output
    can be used by other actions (an overlapped chunk releases everything at its end).
    """

    start: Mapping[Key, float]
    end: Mapping[Key, float]
    release: Mapping[Key, float]
    busy: tuple[float, ...]  # compute time per rank
    makespan: float

    def idle(self) -> list[float]:
        """Idle time per rank inside [0, makespan]: the schedule's bubble on that rank."""
        return [self.makespan - b for b in self.busy]


def issue_units(s: PipelineSchedule, rank: int) -> list[tuple[Action, ...]]:
    """Rank ``rank``'s actions as issued one after another: single actions, or an overlapped
    chunk (F, its overlapped B, and that B's W when it follows directly)."""
    acts, pairs = s.actions[rank], set(s.fb_pairs[rank])
    if not pairs:  # most schedules: every action issued on its own
        return [(a,) for a in acts]
    out, i = [], 0
    while i < len(acts):
        a = acts[i]
        if i + 1 < len(acts) and (a, acts[i + 1]) in pairs:
            b = acts[i + 1]
            grp = [a, b]
            if i + 2 < len(acts) and acts[i + 2] == Action(b.stage, "W", b.mb):
                grp.append(acts[i + 2])
            out.append(tuple(grp))
        else:
            out.append((a,))
        i += len(out[-1])
    return out


def timeline(schedule: PipelineSchedule | Sequence[Sequence[Action]],
             durations: Mapping[str, float] | None = None) -> Timeline:
    """Place every action: each rank in list order, each as early as deps and rank allow.

    ``durations`` maps ``F``, ``B``, ``W`` (default 1 each) and optionally ``F&B``, the length
    of one overlapped forward + full-backward chunk (default: the sum of its parts, i.e. no
    gain from overlapping). Raises ScheduleError naming the stuck actions if a rank can never
    issue its next action (deadlock).
    """
    s = as_schedule(schedule)
    dur = {**DEFAULT_DURATIONS, **(durations or {})}
    for k, v in dur.items():
        if k not in (*KINDS, FB) or not v > 0:
            raise ScheduleError(f"durations: {k}={v!r}; expected positive F, B, W and optional {FB}")
    cache = s.__dict__.setdefault("_timelines", {})  # the schedule is immutable: same input, same answer
    ckey = tuple(sorted(dur.items()))
    if ckey not in cache:
        cache[ckey] = _place(s, dur)
    return cache[ckey]


def _plan(s: PipelineSchedule) -> list[list[tuple[tuple[Key, ...], tuple[Key, ...]]]]:
    """Per rank, per issued unit: (its action keys, the keys it waits for outside itself)."""
    plan = s.__dict__.get("_plan")
    if plan is None:
        plan = []
        prev, nxt = s._prev.get, s._next.get
        for r, acts in enumerate(s.actions):
            if not s.fb_pairs[r]:  # one action per unit (most schedules): _deps_of, inline
                row = []
                for a in acts:
                    stage, kind, mb = key = (a.stage, a.kind, a.mb)
                    if kind == "F":
                        k = prev((stage, mb))
                        row.append(((key,), () if k is None else ((k, "F", mb),)))
                    elif kind == "B":
                        k = nxt((stage, mb))
                        row.append(((key,), ((stage, "F", mb),) if k is None else ((stage, "F", mb), (k, "B", mb))))
                    else:
                        row.append(((key,), ((stage, "B", mb),)))
                plan.append(row)
                continue
            row = []
            for op in issue_units(s, r):
                keys = tuple(a.key for a in op)
                row.append((keys, tuple(d for a in op for d in s.deps(a) if d not in keys)))
            plan.append(row)
        object.__setattr__(s, "_plan", plan)
    return plan


def _deps_of(s: PipelineSchedule, stage: int, kind: str, mb: int) -> tuple[Key, ...]:
    """:meth:`PipelineSchedule.deps` of the action (stage, kind, mb), as a tuple."""
    if kind == "F":
        prev = s._prev.get((stage, mb))
        return () if prev is None else ((prev, "F", mb),)
    if kind == "B":
        nxt = s._next.get((stage, mb))
        return ((stage, "F", mb),) if nxt is None else ((stage, "F", mb), (nxt, "B", mb))
    return ((stage, "B", mb),)


def _place(s: PipelineSchedule, dur: Mapping[str, float]) -> Timeline:
    plan = _plan(s)
    fb = dur.get(FB)
    pos = [0] * s.ranks
    free = [0.0] * s.ranks
    busy = [0.0] * s.ranks
    start: dict[Key, float] = {}
    end: dict[Key, float] = {}
    release: dict[Key, float] = {}
    # Event-driven: a rank blocked on an unfinished dependency sleeps until that action is
    # placed. Start times do not depend on the order ranks are tried in: each is
    # max(rank free, dependencies released), fixed once the dependencies are placed.
    waiting: dict[Key, list[int]] = {}
    todo = deque(range(s.ranks))
    released = release.get
    while todo:
        r = todo.popleft()
        row = plan[r]
        i, t1, b, n = pos[r], free[r], busy[r], len(row)
        while i < n:
            keys, deps = row[i]
            t0 = t1
            blocker = None
            for d in deps:  # the first dependency not placed yet, else the latest release
                at = released(d)
                if at is None:
                    blocker = d
                    break
                if at > t0:
                    t0 = at
            if blocker is not None:
                waiting.setdefault(blocker, []).append(r)
                break
            if len(keys) == 1:
                k = keys[0]
                t1 = t0 + dur[k[1]]
                start[k] = t0
                end[k] = release[k] = t1
            else:  # an overlapped chunk: one unit, outputs released at its end
                t = t0
                for k in keys:
                    start[k], t = t, t + dur[k[1]]
                    end[k] = t
                t1 = t0 + fb if fb is not None else t
                for k in keys:
                    release[k] = t1
                    if fb is not None:  # no inner order to draw
                        start[k], end[k] = t0, t1
            for k in keys:
                if k in waiting:
                    todo.extend(waiting.pop(k))
            b += t1 - t0
            i += 1
        pos[r], free[r], busy[r] = i, t1, b
    stuck = [r for r in range(s.ranks) if pos[r] < len(plan[r])]
    if stuck:
        waits = []
        for r in stuck:
            keys, deps = plan[r][pos[r]]
            missing = [d for d in deps if d not in release]
            waits.append(f"rank {r} waits at {' '.join(_tok(k) for k in keys)} for {', '.join(map(_tok, missing))}")
        raise ScheduleError("schedule deadlocks, no rank can issue its next action: " + "; ".join(waits))
    return Timeline(MappingProxyType(start), MappingProxyType(end), MappingProxyType(release), tuple(busy),
                    max(free) if free else 0.0)


def _tok(k: Key) -> str:
    return f"{k[0]}{k[1]}{k[2]}"


def unit_time_grid(schedule: PipelineSchedule | Sequence[Sequence[Action]],
                   durations: Mapping[str, int] | None = None) -> list[list[Action | None]]:
    """The schedule on a slot grid: ``grid[rank][slot]`` is the action running or None (idle).

    Unit time (F = B = W = 1) unless ``durations`` gives whole-slot lengths; an action lasting
    d slots fills d consecutive cells. Overlapped chunks are drawn part after part, so an
    ``F&B`` duration (which has no per-part cells) is refused here: use :func:`timeline`.
    """
    s = as_schedule(schedule)
    if durations and FB in durations:
        raise ScheduleError(f"unit_time_grid draws every action in its own cells; for an {FB} duration use timeline()")
    for k, v in (durations or {}).items():
        if v != int(v):
            raise ScheduleError(f"unit_time_grid needs whole-slot durations; got {k}={v}")
    tl = timeline(s, durations)
    n = int(tl.makespan)
    grid: list[list[Action | None]] = [[None] * n for _ in range(s.ranks)]
    for r, acts in enumerate(s.actions):
        for a in acts:
            for t in range(int(tl.start[a.key]), int(tl.end[a.key])):
                grid[r][t] = a
    return grid


def idle_per_rank(schedule: PipelineSchedule | Sequence[Sequence[Action]],
                  durations: Mapping[str, float] | None = None) -> list[float]:
    """Bubble per rank: step time minus the rank's compute time."""
    return timeline(schedule, durations).idle()


def peak_in_flight(schedule: PipelineSchedule | Sequence[Sequence[Action]]) -> list[int]:
    """Most (stage, microbatch) activations a rank holds at once, per rank.

    A microbatch's activations on a stage live from the start of its F to the end of its last
    backward piece (W when the schedule is split: the weight gradient still reads the layer
    inputs). Counted in issue order; an overlapped chunk holds its forward's and its
    backward's activations together, since the backward frees only when the chunk ends.
    """
    s = as_schedule(schedule)
    last = "W" if s.split_backward else "B"
    out = []
    for acts in s.actions:
        live = peak = 0
        for a in acts:
            if a.kind == "F":
                live += 1
                peak = max(peak, live)
            elif a.kind == last:
                live -= 1
        out.append(peak)
    return out
