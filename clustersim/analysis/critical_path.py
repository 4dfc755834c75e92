"""The critical path: the chain of tasks that sets the step time.

A task starts when its stream is free and its dependencies are done; a communication also
waits for the last member of its group to reach it. So every task has a *binding*
predecessor: whichever of (the previous task on its stream, its dependencies, and, for a
communication, those of every member) finished last. Walking binding predecessors back from
the task that ends the step gives a chain whose durations add up to the step time (each task
starts exactly when its binding predecessor ends)::

    rank 0 compute  [F0][F1][F2][F3]            [B0]...
    rank 0 pp send                  [act3]
    rank 1 compute                        [F3][B3] ──┐
                         ^^^^^^^^^^^^^^^^^^^^^^^^^^^ │  path: F0 F1 F2 F3 -> send act3
                                                     │        -> F3 B3 (rank 1) -> ... -> end

Communication on the path is communication that delayed the step: making it free would move
the end by up to its duration (the critical-path method on a task graph, Kelley & Walker
1959).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..floats import sum_left
from ..program.tasks import Program
from ..trace import COMM_KINDS, Trace, span_times
from .intervals import INSTANT_S



class PathTask(NamedTuple):
    tid: int
    rank: int
    stream: str
    name: str
    kind: str
    start_s: float
    end_s: float
    stage: int
    mb: int
    layer: int


def critical_path(prog: Program, trace: Trace) -> list[PathTask]:
    """The tasks that set the step time, first to last (see the module docstring)."""
    items = prog.items  # a run's tasks are made only for the path (Program.task)
    if not items or not trace.n_spans:
        return []
    cols, tc = trace.columns(), trace.task_columns(items, prog.runs, prog)
    own = cols.own_index(items, tc)
    end_a = np.where(own >= 0, cols.end_s[own], -1.0)  # -1: no span
    # read element by element, for the few tasks the walk visits: memoryviews give Python
    # numbers without turning every task's entry into one first (Megatron-1T: 854,340 tasks,
    # 13,937 on the path)
    end = memoryview(np.ascontiguousarray(end_a, dtype=np.float64))
    prev = memoryview(np.ascontiguousarray(tc.prev, dtype=np.int64))
    # members of each rendezvous that has more than one task, in task order (a communication
    # with one simulated member waits for nobody in the engine, whatever its key)
    group = tc.rendezvous
    shared = np.flatnonzero(group >= 0)
    shared = shared[np.bincount(group[shared])[group[shared]] > 1] if len(shared) else shared
    members: dict[int, list[int]] = {}
    for g, tid in zip(group[shared].tolist(), shared.tolist()):
        members.setdefault(g, []).append(tid)
    group_of = memoryview(np.ascontiguousarray(group, dtype=np.int64))

    task = prog.task

    def cands_of(tid: int, t) -> list[int]:
        """Task ``tid`` (``t``)'s own candidates: its dependencies, its stream's previous task."""
        p = prev[tid]
        return [*t.deps, p] if p >= 0 else list(t.deps)

    # the latest end binds; ends within INSTANT_S of it are ties, which go to the lowest id
    # (deterministic, and the same whether an instant's last bits came from one sum or another)
    cur = int(np.flatnonzero(end_a >= end_a.max() - INSTANT_S)[0])
    path = [cur]
    while True:
        t = items[cur] or task(cur)
        cands = cands_of(cur, t)
        if t.comm is not None:
            for u in members.get(group_of[cur], ()):
                if u != cur:
                    cands += cands_of(u, items[u] or task(u))
        if len(cands) == 1:  # most tasks: one predecessor binds
            cur = cands[0]
        elif cands:
            least = max(map(end.__getitem__, cands)) - INSTANT_S
            cur = min([i for i in cands if end[i] >= least])
        else:
            break
        path.append(cur)
    path.reverse()
    stage_of = trace.stage_of
    rows = own[path].tolist()
    starts, ends = span_times(trace.span_rows(), [j for j in rows if j >= 0])  # the path's spans only
    found = zip(starts, ends)
    out = []
    for i, j in zip(path, rows):
        t = items[i] or task(i)
        start_s, end_s = next(found) if j >= 0 else (0.0, -1.0)
        out.append(PathTask(i, t.rank, t.stream, t.name, t.kind, start_s, end_s, stage_of.get(t.rank, t.stage), t.mb,
                            t.layer))
    return out


def path_report(path: list[PathTask], step_s: float) -> dict[str, Any]:
    """summary.json ``critical_path``: seconds per kind, waits, and the path by rank segments.

    A segment is a run of consecutive path tasks on one rank; the path moves to another rank
    through a pipeline transfer or a collective whose last member came from there.
    """
    by_kind = {"compute": 0.0, **{k: 0.0 for k in COMM_KINDS}}
    wait_s = tie_s = 0.0
    t = 0.0
    segments: list[dict[str, Any]] = []
    for p in path:
        gap = p.start_s - t
        if gap > INSTANT_S:  # time no path task covered (none in this engine)
            wait_s += gap
        elif gap > 0:  # a tie's last bits: a predecessor within INSTANT_S of the latest binds; a
            tie_s += gap  # few of them on one path add up past the check's 1e-9 s, so the length
            # keeps them (an overlap, gap < 0, counts twice and the check sees it)
        t = max(t, p.end_s)
        by_kind[p.kind] = by_kind.get(p.kind, 0.0) + (p.end_s - p.start_s)
        if segments and segments[-1]["rank"] == p.rank:
            seg = segments[-1]
        else:
            seg = {"rank": p.rank, "stage": p.stage, "start_s": p.start_s, "end_s": p.end_s, "tasks": 0,
                   "first": p.name, "last": p.name, "compute_s": 0.0, "comm_s": 0.0}
            segments.append(seg)
        seg["end_s"] = p.end_s
        seg["tasks"] += 1
        seg["last"] = p.name
        seg["compute_s" if p.kind == "compute" else "comm_s"] += p.end_s - p.start_s
    comm = sum_left(v for k, v in by_kind.items() if k != "compute")
    return {
        "length_s": sum_left(by_kind.values()) + wait_s + tie_s,
        "step_time_s": step_s,
        "tasks": len(path),
        "compute_s": by_kind["compute"],
        "comm_s": comm,
        "by_kind_s": by_kind,
        "wait_s": wait_s,
        "ranks_visited": len({p.rank for p in path}),
        "segments": segments,
    }
