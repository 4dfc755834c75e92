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
right after it on the same rank; a split one whose W follows at once is written ``I`` (torch's
backward-input; grid.py), and so is read back.

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
from itertools import chain
from operator import attrgetter, itemgetter

import numpy as np

from ..errors import ConfigError

KINDS = ("F", "B", "W")
DEFAULT_DURATIONS = {"F": 1, "B": 1, "W": 1}
FB = "F&B"  # durations key: one overlapped forward + full backward chunk

Key = tuple[int, str, int]  # (stage, kind, mb)


class ScheduleError(ConfigError, ValueError):
    """A schedule that cannot run (bad parameters, malformed custom text, deadlock).

    A ConfigError so the command line prints it as one line; a ValueError for library users.
    ``about``: the parameter a refusal of the parameters is about ("p", "m", "v", "group"), for
    the command line to name its flag; None otherwise.
    """

    def __init__(self, message: str, *, about: str | None = None, **where):
        super().__init__(message, **where)
        self.about = about


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
    # per rank: (stage, mb) of each W that is the second half of a full backward, written right
    # after its B; None: every W written right after its B (grid.py passes what it read:
    # those after a B, not after an I)
    fused_w: tuple[frozenset, ...] | None = field(default=None, compare=False)
    stage_rank: tuple[int, ...] = field(init=False)
    paths: tuple[tuple[int, ...], ...] = field(init=False)  # paths[mb]: stages in forward order

    def __post_init__(self):
        rows = tuple(tuple(r) for r in self.actions)
        object.__setattr__(self, "actions", rows)
        flat = _action_arrays(rows)
        stage_rank = _stage_ranks(rows, flat)
        n_stages = len(stage_rank)
        part = tuple(range(n_stages)) if self.stage_part is None else tuple(self.stage_part)
        if len(part) != n_stages:
            raise ScheduleError(f"stage_part has {len(part)} entries but the schedule has {n_stages} stages")
        if sorted(set(part)) != list(range(len(set(part)))):
            raise ScheduleError(f"stage_part {list(part)} must use parts 0..n-1 with none skipped")
        object.__setattr__(self, "stage_part", part)
        object.__setattr__(self, "stage_rank", stage_rank)
        split = _check_rows(rows, flat)
        object.__setattr__(self, "_flat", flat)  # (stage, kind, mb) per action, for the placement
        paths = _paths_on_arrays(flat, part)
        object.__setattr__(self, "paths", _paths(rows, part, stage_rank) if paths is None else paths)
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
        if self.fused_w is not None:
            fused = tuple(frozenset(f) for f in self.fused_w)
            if len(fused) != len(rows):
                raise ScheduleError(f"fused_w has {len(fused)} rows but the schedule has {len(rows)} ranks")
            for r, f in enumerate(fused):
                after = fused_after_b(rows[r])
                if not f <= after:
                    stage, mb = min(f - after)
                    raise ScheduleError(f"rank {r}: {stage}W{mb} is marked as a full backward's but does not "
                                        f"follow {stage}B{mb} directly")
            object.__setattr__(self, "fused_w", fused)
        object.__setattr__(self, "_split", split)
        # each microbatch's neighbours on its path, by (stage, mb): path by path, in path order
        n_mb = len(self.paths)
        here = np.array(self.paths, dtype=np.int64).reshape(n_mb, -1)
        mbs = np.repeat(np.arange(n_mb), here.shape[1] - 1).tolist()
        a, b = here[:, :-1].ravel().tolist(), here[:, 1:].ravel().tolist()
        object.__setattr__(self, "_next", dict(zip(zip(a, mbs), b)))
        object.__setattr__(self, "_prev", dict(zip(zip(b, mbs), a)))

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
                  fb_pairs: Sequence[Sequence[tuple[Action, Action]]] = (),
                  fused_w: Sequence[frozenset] | None = None) -> PipelineSchedule:
    """Build, check the structure, and check it runs to the end (raises on deadlock)."""
    s = PipelineSchedule(name, tuple(tuple(r) for r in rows), None if stage_part is None else tuple(stage_part),
                         tuple(tuple(p) for p in fb_pairs), None if fused_w is None else tuple(fused_w))
    timeline(s)
    return s


# --- structure checks ---------------------------------------------------------------------

def _stage_ranks(rows, flat: tuple[np.ndarray, np.ndarray, np.ndarray] | None) -> tuple[int, ...]:
    """The rank whose row holds each stage; ``flat``: :func:`_action_arrays`, None where the
    rows hold something else than actions. Judged on those arrays; where they show a fault,
    the rows are walked to name the first one."""
    if flat is not None and len(flat[0]) and int(flat[0].min()) >= 0 and int(flat[2].min()) >= 0:
        stage = flat[0]
        row = np.repeat(np.arange(len(rows)), list(map(len, rows)))
        n_stages = int(stage.max()) + 1
        lo, hi = np.full(n_stages, len(rows)), np.full(n_stages, -1)
        np.minimum.at(lo, stage, row)
        np.maximum.at(hi, stage, row)
        if (lo == hi).all():  # every stage on one row, none missing
            return tuple(lo.tolist())
    where: dict[int, int] = {}
    first: dict[int, Action] = {}  # (each stage's first token, named beside the one that clashes)
    for r, acts in enumerate(rows):
        for a in acts:
            if not isinstance(a, Action) or a.kind not in KINDS or a.stage < 0 or a.mb < 0:
                raise ScheduleError(f"rank {r}: {a!r} is not an action {{stage}}{{F|B|W}}{{mb}}")
            if where.setdefault(a.stage, r) != r:
                raise ScheduleError(f"stage {a.stage} appears on rank {where[a.stage]} (token {first[a.stage]}) "
                                    f"and on rank {r} (token {a}); a stage runs on exactly one rank")
            first.setdefault(a.stage, a)
    if not where:
        raise ScheduleError("schedule has no actions")
    missing = [k for k in range(max(where) + 1) if k not in where]
    if missing:
        raise ScheduleError(f"stages must be numbered 0..{max(where)}; stage {missing[0]} never appears")
    return tuple(where[k] for k in range(len(where)))


def _check_rows(rows, flat: tuple[np.ndarray, np.ndarray, np.ndarray]) -> bool:
    """Every (stage, mb) has F, B and (if any W exists) W once each, in that order on its row.

    Checked on arrays (``flat``: :func:`_action_arrays`, :func:`_rows_sound`); where they find
    a fault, :func:`_row_faults` walks the rows to name the first one (a built-in 1F1B of 64
    stages and 512 microbatches has 65,536 actions, and the walk cost its load a fifth of its
    time)."""
    split = bool((flat[1] == 2).any())
    if _rows_sound(flat, split):
        return split
    return _row_faults(rows, split)


_KIND_CODE = {"F": 0, "B": 1, "W": 2}


def _action_arrays(rows) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Every action's stage, kind (F 0, B 1, W 2) and microbatch, the rows laid end to end;
    None where a row holds something else than an action (:func:`_stage_ranks` names it)."""
    if not all(issubclass(t, Action) for t in set(map(type, chain.from_iterable(rows)))):
        return None
    if not set(map(_KIND, chain.from_iterable(rows))) <= _KIND_CODE.keys():
        return None
    n = sum(map(len, rows))
    stage = np.fromiter(map(_STAGE, chain.from_iterable(rows)), np.int64, n)
    kind = np.fromiter(map(_KIND_CODE.__getitem__, map(_KIND, chain.from_iterable(rows))), np.int64, n)
    mb = np.fromiter(map(_MB, chain.from_iterable(rows)), np.int64, n)
    return stage, kind, mb


_STAGE, _KIND, _MB = attrgetter("stage"), attrgetter("kind"), attrgetter("mb")


def _rows_sound(flat: tuple[np.ndarray, np.ndarray, np.ndarray], split: bool) -> bool:
    """Whether :func:`_check_rows` passes, on arrays: microbatches 0..n-1, each action once,
    each B after its F and each W after its B on the same row, and every (stage, mb) with
    actions has all of F, B (and W when ``split``). Each stage is on one row
    (:func:`_stage_ranks` checked it), so "once" and "after" can be judged over all the rows
    laid end to end::

        code = (stage * 3 + kind) * n_mb + mb        kind: F 0, B 1, W 2
        need = code - n_mb                           B needs F, W needs B: one kind down
    """
    stage, kind, mb = flat
    n = len(stage)
    if n == 0:
        return False
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


def _paths_on_arrays(flat: tuple[np.ndarray, np.ndarray, np.ndarray], part: tuple[int, ...]
                     ) -> tuple[tuple[int, ...], ...] | None:
    """:func:`_paths` on the actions' arrays: each microbatch's forward stages ordered by
    (part, stage); None where a microbatch does not pass through each part once (:func:`_paths`
    names it)."""
    stage, kind, mb = flat
    fwd = kind == 0
    stage, mb = stage[fwd], mb[fwd]
    if not len(stage):
        return None
    part_of = np.asarray(part, dtype=np.int64)
    n_mb, n_parts = int(mb.max()) + 1, int(part_of.max()) + 1
    order = np.lexsort((stage, part_of[stage], mb))
    if len(order) != n_mb * n_parts:
        return None
    paths = stage[order].reshape(n_mb, n_parts)
    if not (part_of[paths] == np.arange(n_parts)).all():
        return None
    return tuple(map(tuple, paths.tolist()))


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


def fused_weight_passes(s: PipelineSchedule, rank: int) -> set[tuple[int, int]]:
    """(stage, mb) of every W on ``rank`` that is the second half of a full backward, written
    right after its B: ``fused_w``, or where the schedule does not say every W written so (a
    file read by grid.py says: those after a ``B``, not after an ``I``). Empty without W
    actions."""
    return set(s.fused_w[rank]) if s.fused_w is not None else fused_after_b(s.actions[rank])


def fused_after_b(acts: Sequence[Action]) -> set[tuple[int, int]]:
    """(stage, mb) of each W in a rank's ``acts`` written right after its own B: what a file
    that does not say otherwise (grid.py's ``I``) means by a full backward."""
    return {(a.stage, a.mb) for i, a in enumerate(acts)
            if a.kind == "W" and i > 0 and acts[i - 1] == Action(a.stage, "B", a.mb)}


def split_weight_passes(s: PipelineSchedule, rank: int) -> set[tuple[int, int]]:
    """(stage, mb) of every W on ``rank`` whose backward is split: B computes the input
    gradient alone and leaves what W reads (each linear layer's input and output gradient)
    held until W, whenever W runs. The others are the second halves of full backwards
    (``fused_w``; module docstring), which hold nothing apart. ZB-H1 and ZB-V split every
    backward, DualPipe those it queues for its zero-bubble steps (the reference's
    ``enable_zb``), even where the W then runs at once; a custom file every W not written right
    after its B, or written after an I::

        custom  rank 1  | 1F0 1F1 1B0 1W0 1F2 1I1 1W1 1B2 1F3 1W2 ...     split: {(1, 1), (1, 2)}
    """
    return {(a.stage, a.mb) for a in s.actions[rank] if a.kind == "W"} - fused_weight_passes(s, rank)


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


def _plan(s: PipelineSchedule) -> tuple[list[list[tuple[int, int, int, int]]], list[tuple]]:
    """The placement's plan, every action as a number (:func:`_codes`): per rank, per issued
    unit, ``(code, first dependency, second dependency, kind)`` (-1: no such dependency), or
    for an overlapped chunk ``(-1 - j, 0, 0, 0)`` with ``chunks[j] = (its codes, their kinds,
    the codes it waits for outside itself)``; and ``chunks``. The dependencies, worked out on
    arrays for every action at once, are :meth:`PipelineSchedule.deps`'s::

        F (k, mb)   F (prev[k, mb], mb)                        prev, next: mb's path
        B (k, mb)   F (k, mb),  B (next[k, mb], mb)
        W (k, mb)   B (k, mb)

    A full backward written B then W (:func:`fused_weight_passes`) releases its B's output
    when its W ends, as DeepSeek's DualPipe sends a backward's gradient after the backward
    without its weight gradients split off has run whole (``_backward_chunk(enable_zb=False)``
    runs ``run_backward`` with the weight gradients inline, then ``_send_backward``): its B
    is kind :data:`_HELD_B` (not released at its end), its W :data:`_RELEASING_W` (releases
    the B too; no dependency, the B runs right before it on the rank)::

        rank r   [B (k, mb)][W (k, mb)]
                                       -> B (k, mb)'s gradient to the previous stage
    """
    plan = s.__dict__.get("_plan")
    if plan is not None:
        return plan
    stage, kind, mb = s._flat
    n_mb, n_stages = s.n_microbatches, s.n_stages
    paths = np.array(s.paths, dtype=np.int64).reshape(n_mb, -1)
    prev = np.full((n_stages, n_mb), -1, dtype=np.int64)
    nxt = np.full((n_stages, n_mb), -1, dtype=np.int64)
    mbs = np.broadcast_to(np.arange(n_mb)[:, None], (n_mb, paths.shape[1] - 1))
    prev[paths[:, 1:], mbs] = paths[:, :-1]
    nxt[paths[:, :-1], mbs] = paths[:, 1:]
    code = (stage * 3 + kind) * n_mb + mb
    own_f, own_b = (stage * 3) * n_mb + mb, (stage * 3 + 1) * n_mb + mb
    before, after = prev[stage, mb], nxt[stage, mb]
    dep_a = np.where(kind == 0, np.where(before >= 0, (before * 3) * n_mb + mb, -1), np.where(kind == 1, own_f, own_b))
    dep_b = np.where((kind == 1) & (after >= 0), (after * 3 + 1) * n_mb + mb, -1)
    entries = list(zip(code.tolist(), dep_a.tolist(), dep_b.tolist(), kind.tolist()))
    if s.split_backward:
        lo = 0
        for r, acts in enumerate(s.actions):
            held = {(st * 3 + 1) * n_mb + m for st, m in fused_weight_passes(s, r)}  # the full backwards' B
            if held:
                for i in range(lo, lo + len(acts)):
                    c, d1, d2, kd = entries[i]
                    if c in held:
                        entries[i] = (c, d1, d2, _HELD_B)
                    elif kd == 2 and c - n_mb in held:  # (its B's code)
                        entries[i] = (c, -1, -1, _RELEASING_W)
            lo += len(acts)
    rows, chunks, lo = [], [], 0
    for r, acts in enumerate(s.actions):
        hi = lo + len(acts)
        if not s.fb_pairs[r]:  # one action per unit (most schedules)
            rows.append(entries[lo:hi])
        else:
            row, i = [], lo
            for unit in issue_units(s, r):
                if len(unit) == 1:
                    row.append(entries[i])
                else:
                    mine = entries[i:i + len(unit)]
                    codes = tuple(e[0] for e in mine)
                    waits = tuple(d for e in mine for d in e[1:3] if d >= 0 and d not in codes)
                    row.append((-1 - len(chunks), 0, 0, 0))
                    chunks.append((codes, tuple(e[3] for e in mine), waits))
                i += len(unit)
            rows.append(row)
        lo = hi
    plan = (rows, chunks)
    object.__setattr__(s, "_plan", plan)
    return plan


# the placement's kinds beyond F 0, B 1, W 2: a full backward's halves (:func:`_plan`)
_HELD_B, _RELEASING_W = 3, 4


def _deps_of(s: PipelineSchedule, stage: int, kind: str, mb: int) -> tuple[Key, ...]:
    """:meth:`PipelineSchedule.deps` of the action (stage, kind, mb), as a tuple."""
    if kind == "F":
        prev = s._prev.get((stage, mb))
        return () if prev is None else ((prev, "F", mb),)
    if kind == "B":
        nxt = s._next.get((stage, mb))
        return ((stage, "F", mb),) if nxt is None else ((stage, "F", mb), (nxt, "B", mb))
    return ((stage, "B", mb),)


def _codes(s: PipelineSchedule) -> int:
    """How many action numbers there are: an action (stage, kind, mb) is numbered
    ``(stage * 3 + kind) * n_microbatches + mb``, kind F 0, B 1, W 2."""
    return s.n_stages * 3 * s.n_microbatches


def _key_of(code: int, n_mb: int) -> Key:
    """The action key numbered ``code`` (:func:`_codes`)."""
    sk, mb = divmod(code, n_mb)
    return (sk // 3, KINDS[sk % 3], mb)


class _ByKey(Mapping):
    """Times of a placement by action key (``Timeline.start``, ``end``, ``release``), kept as
    a list by action number (:func:`_codes`); -1 where no action has that number (times are
    never negative)."""

    __slots__ = ("times", "_n_mb")

    def __init__(self, times: list[float], n_mb: int):
        self.times, self._n_mb = times, n_mb

    def __getitem__(self, key: Key) -> float:
        try:
            stage, kind, mb = key
            k = _KIND_CODE.get(kind)
            n_mb = self._n_mb
            c = (stage * 3 + k) * n_mb + mb if k is not None and 0 <= mb < n_mb and stage >= 0 else -1
            v = self.times[c] if 0 <= c < len(self.times) else -1.0
        except (TypeError, ValueError):  # not a (stage, kind, mb) of ints
            raise KeyError(key) from None
        if v < 0:
            raise KeyError(key)
        return v

    def __iter__(self):
        n_mb = self._n_mb
        return (_key_of(c, n_mb) for c, v in enumerate(self.times) if v >= 0)

    def __len__(self) -> int:
        return sum(v >= 0 for v in self.times)


def _place(s: PipelineSchedule, dur: Mapping[str, float]) -> Timeline:
    rows, chunks = _plan(s)
    per_kind = [dur["F"], dur["B"], dur["W"], dur["B"], dur["W"]]  # (_HELD_B, _RELEASING_W)
    n_mb = s.n_microbatches
    fb = dur.get(FB)
    n = _codes(s)
    start, end = [-1.0] * n, [-1.0] * n  # negative: not placed (yet)
    release = [-1.0] * n + [0.0]  # and a last slot for "no dependency" (-1) to read
    pos = [0] * s.ranks
    free = [0.0] * s.ranks
    busy = [0.0] * s.ranks
    # Event-driven: a rank blocked on an unfinished dependency sleeps until that action is
    # placed. Start times do not depend on the order ranks are tried in: each is
    # max(rank free, dependencies released), fixed once the dependencies are placed.
    waiting: dict[int, list[int]] = {}
    todo = deque(range(s.ranks))
    while todo:
        r = todo.popleft()
        row = rows[r]
        i, t1, b, n_units = pos[r], free[r], busy[r], len(row)
        while i < n_units:
            k, d1, d2, kind = row[i]
            t0 = t1
            if k >= 0:
                at, at2 = release[d1], release[d2]  # (-1, no dependency: the last slot, 0.0)
                if at < 0 or at2 < 0:  # the first dependency not placed yet blocks
                    waiting.setdefault(d1 if at < 0 else d2, []).append(r)
                    break
                if at > t0:
                    t0 = at
                if at2 > t0:
                    t0 = at2
                t1 = t0 + per_kind[kind]
                start[k] = t0
                end[k] = t1
                if kind != _HELD_B:
                    release[k] = t1
                    if k in waiting:
                        todo.extend(waiting.pop(k))
                if kind == _RELEASING_W:  # its B's output goes now
                    release[k - n_mb] = t1
                    if k - n_mb in waiting:
                        todo.extend(waiting.pop(k - n_mb))
            else:  # an overlapped chunk: one unit, outputs released at its end
                codes, kinds, waits = chunks[-1 - k]
                blocker = next((d for d in waits if release[d] < 0), None)
                if blocker is not None:
                    waiting.setdefault(blocker, []).append(r)
                    break
                t0 = max((t0, *(release[d] for d in waits)))
                t = t0
                for c, kd in zip(codes, kinds):
                    start[c], t = t, t + per_kind[kd]
                    end[c] = t
                t1 = t0 + fb if fb is not None else t
                for c in codes:
                    release[c] = t1
                    if fb is not None:  # no inner order to draw
                        start[c], end[c] = t0, t1
                for c in codes:
                    if c in waiting:
                        todo.extend(waiting.pop(c))
            b += t1 - t0
            i += 1
        pos[r], free[r], busy[r] = i, t1, b
    stuck = [r for r in range(s.ranks) if pos[r] < len(rows[r])]
    if stuck:
        waits = []
        for r in stuck:
            k, d1, d2, _ = rows[r][pos[r]]
            codes, deps = ((k,), (d1, d2)) if k >= 0 else (chunks[-1 - k][0], chunks[-1 - k][2])
            missing = [_key_of(d, n_mb) for d in deps if d >= 0 and release[d] < 0]
            waits.append(f"rank {r} waits at {' '.join(_tok(_key_of(c, n_mb)) for c in codes)} "
                         f"for {', '.join(map(_tok, missing))}")
        raise ScheduleError("schedule deadlocks, no rank can issue its next action: " + "; ".join(waits))
    return Timeline(_ByKey(start, n_mb), _ByKey(end, n_mb), _ByKey(release[:n], n_mb), tuple(busy),
                    max(free) if free else 0.0)


def units_by_start(s: PipelineSchedule) -> list[tuple[int, tuple[Action, ...]]]:
    """(rank, issue unit) of all ranks, by unit-time start (F = B = W = 1), then rank, then
    issue order: the placement's start of each unit's first action, sorted on arrays."""
    rows, chunks = _plan(s)
    start = np.array(timeline(s).start.times)
    units: list[tuple[Action, ...]] = []
    ranks: list[int] = []
    firsts: list[int] = []
    for r, row in enumerate(rows):
        units += issue_units(s, r)
        ranks += [r] * len(row)
        firsts += [k if k >= 0 else chunks[-1 - k][0][0] for k in map(_FIRST, row)]
    order = np.lexsort((np.array(ranks, dtype=np.int64), start[np.array(firsts, dtype=np.int64)]))  # (stable)
    return [(ranks[i], units[i]) for i in order.tolist()]


_FIRST = itemgetter(0)


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
