"""Exposed communication traced to its cause: which collective, which link bounded it, and
what else was on that link at the time.

A communication span is exposed where its rank's compute stream is idle (:mod:`.metrics`).
Spans are grouped by collective (kind, op and name, with numbers such as bucket indices
folded), weighted by the GPUs each simulated rank stands for, and ranked by exposed time per
GPU. Concurrent communications of one rank each count their own exposed time, so the groups
can add up to more than ``exposed_comm_s.total``; within a group, a rank's spans count as
their union (DualPipe's two model parts reduce their gradients at once, and two spans of one
group added up to more than the kind's own exposed time)::

    rank 0 dp   [AR part 0 ......]
                     [AR part 1 ......]
    group       [....................]      exposed, busy: the union, less the compute inside

For the top groups, the span with the most exposed time is explained::

    bottleneck  the link whose traffic from this collective (twins included) takes longest
                at that link's bandwidth: sum over flows of weight * bytes / bw — the link
                that bounds the collective alone (its alpha-beta time)
    shared_with other communications whose flows cross that link while the span runs, with
                how long they overlapped it, the union of their spans' overlaps (a
                collective's members count once); none when the collective was alone on
                its links, which the engine then timed in closed form
"""

from __future__ import annotations

import re
from typing import Any, Protocol

import numpy as np

from ..collectives.algorithms import at_nvls_share
from ..floats import digits, sum_left
from ..program.tasks import Comm, Program, Task
from ..trace import Trace, first_and_inverse, stable_argsort
from .intervals import INSTANT_S, Arrays, length, merged, seq_sum, union

_NUM = re.compile(r"\b\d+\b")  # bucket and part numbers, not "A2A"


class Explainer(Protocol):
    """What the engine tells about one communication (see :class:`clustersim.engine.sim.Engine`)."""

    def algorithm(self, c: Comm) -> str: ...
    def link_loads(self, c: Comm) -> Any: ...  # engine.sim.LinkLoads: ``e in``, ``busiest()``
    def timed_alone(self, t: Task) -> bool: ...


def collective_name(kind: str, op: str, name: str) -> str:
    """``dp all_reduce: AR grads bucket #``: a group of spans that are the same collective
    (``offload: grads to host``: a task with no op, optimizer offload's)."""
    return f"{kind} {op}: {_NUM.sub('#', name)}" if op else f"{kind}: {_NUM.sub('#', name)}"


def covered_s(t: np.ndarray, merged: list[tuple[float, float]] | Arrays) -> np.ndarray:
    """Time in [0, t] covered by ``merged`` (sorted, disjoint intervals: a list of pairs, or
    arrays of starts and ends), for every t at once: the whole intervals before t plus the part
    of the one t falls in."""
    if isinstance(merged, tuple):
        lo, hi = merged
    else:
        iv = np.asarray(merged).reshape(-1, 2)
        lo, hi = iv[:, 0], iv[:, 1]
    if not len(lo):
        return np.zeros(len(t))
    before = np.concatenate([[0.0], np.cumsum(hi - lo)])
    k = np.searchsorted(lo, t, side="right") - 1  # the last interval starting at or before t
    inside = np.where(k >= 0, np.clip(t - lo[np.maximum(k, 0)], 0.0, (hi - lo)[np.maximum(k, 0)]), 0.0)
    return np.where(k >= 0, before[np.maximum(k, 0)], 0.0) + inside


def _comm_rows(cols) -> tuple[np.ndarray, np.ndarray, dict[int, Arrays]]:
    """(rows, exposed seconds) of every communication span with a length, rank by rank in the
    trace's rank order, in span order within a rank: the span minus its rank's compute; and
    each such rank's compute, merged (by the rank's place in ``cols.ranks``)."""
    order, bounds = cols.rank_groups
    by_start, start_bounds = cols.time_groups  # (the metrics' too) the compute spans' union needs no sort
    compute = cols.kind == cols.code("kind", "compute")
    timed = ~compute & (cols.end_s > cols.start_s)
    rows, exposed, computes = [], [], {}
    for i in range(len(cols.ranks)):
        mine = order[bounds[i]:bounds[i + 1]]
        comm = mine[timed[mine]]
        if not len(comm):
            continue
        busy = by_start[start_bounds[i]:start_bounds[i + 1]]
        busy = busy[compute[busy]]
        merged_iv = computes[i] = merged(cols.start_s[busy], cols.end_s[busy], presorted=True)
        a, b = cols.start_s[comm], cols.end_s[comm]
        # exposed: the span's length minus the compute inside it (span minus compute)
        rows.append(comm)
        exposed.append((b - a) - (covered_s(b, merged_iv) - covered_s(a, merged_iv)))
    if not rows:
        return np.zeros(0, dtype=np.int64), np.zeros(0), computes
    return np.concatenate(rows), np.concatenate(exposed), computes


def _union_times(rank: np.ndarray, start: np.ndarray, end: np.ndarray, weight: np.ndarray,
                 computes: dict[int, Arrays]) -> tuple[float, float] | None:
    """(exposed, busy seconds), weighted, of spans (``rank``: each one's place in the trace's
    ranks, ascending) counted per rank as their union, less the rank's compute ``computes``
    for the exposed; None where no two spans of one rank overlap (each span counts alone, as
    it is)."""
    order = np.lexsort((start, rank))
    r, a, b = rank[order], start[order], end[order]
    # how far the spans before each reach, its rank's alone: each rank's times shifted past the
    # last one's, so one running maximum serves them all (an overlap under INSTANT_S is none)
    off = r * (float(np.max(b)) - min(float(np.min(a)), 0.0) + 1.0)
    reach = np.maximum.accumulate(np.r_[-np.inf, (b + off)[:-1]])
    if not (a + off < reach - INSTANT_S).any():
        return None
    w = weight[order]
    exposed = busy = 0.0
    cuts = np.flatnonzero(np.r_[True, r[1:] != r[:-1], True]).tolist()
    for k0, k1 in zip(cuts[:-1], cuts[1:]):  # each rank's spans, by start
        lo, hi = merged(a[k0:k1], b[k0:k1], presorted=True)
        c = computes[int(r[k0])]  # (every rank with a communication span has its compute merged)
        ex = (hi - lo) - (covered_s(hi, c) - covered_s(lo, c))
        exposed += float(w[k0]) * seq_sum(ex, 0.0)
        busy += float(w[k0]) * seq_sum(hi - lo, 0.0)
    return exposed, busy


def exposed_collectives(prog: Program, trace: Trace, explainer: Explainer | None = None,
                        cluster=None, top: int = 8) -> list[dict[str, Any]]:
    """summary.json ``exposed_comm_causes``: the collectives with the most exposed time per GPU.

    Per group, sums run over its spans in the order rank by rank, span by span (left to right,
    as adding them one at a time); its example span and size are the first of the largest
    (the example's to within ``INSTANT_S``)."""
    tasks, w = prog.items, trace.weight  # a run's tasks are made only where read (Program.task)
    world = sum_left(w.values()) or 1
    cols = trace.columns()
    spans = cols.spans
    rows, exposed, computes = _comm_rows(cols)
    # a group per collective name: (kind, op, name) triples numbered first, then named
    other = cols.other  # the communications' view: their op, bytes and name
    pos = np.searchsorted(other.rows, rows)
    triple = ((cols.kind[rows].astype(np.int64) * (len(other.op_names) + 1) + other.op[pos])
              * (len(other.name_names) + 1) + other.name[pos])
    first, which = first_and_inverse(triple)
    label = [collective_name(spans[r].kind, spans[r].op, spans[r].name) for r in rows[first].tolist()]
    label_code = {v: i for i, v in enumerate(dict.fromkeys(label))}
    group = np.array([label_code[v] for v in label], dtype=np.int64)[which]
    weight = np.array([w[r] for r in cols.ranks], dtype=float)[cols.rank_pos[rows]]
    start, end, size = cols.start_s[rows], cols.end_s[rows], other.size_bytes[pos]
    by_group = stable_argsort(group)  # each group's spans in the order above
    ranked = []
    rank_pos = cols.rank_pos[rows]
    # a group's spans of one rank can overlap only on several streams (one stream runs one
    # span at a time): the groups on one stream alone skip the check (Megatron-1T: all of them)
    n_streams = max(len(cols.stream_names), 1)
    on_streams = np.bincount(group * n_streams + cols.stream[rows],
                             minlength=(int(group.max(initial=0)) + 1) * n_streams)
    several = (on_streams.reshape(-1, n_streams) > 0).sum(axis=1) > 1
    for sel in np.split(by_group, np.flatnonzero(np.diff(group[by_group])) + 1) if len(rows) else ():
        ex_s = seq_sum(weight[sel] * exposed[sel], 0.0)
        comm_s = seq_sum(weight[sel] * (end[sel] - start[sel]), 0.0)
        union = (_union_times(rank_pos[sel], start[sel], end[sel], weight[sel], computes) if several[group[sel[0]]]
                 else None)
        if union is not None:  # spans of one rank at once: counted once
            ex_s, comm_s = union
        # a span's exposed time is its length less the compute inside it: rounding leaves
        # dust where the two are equal (8e-17 s per GPU on a step whose cycle was copied in,
        # 0 on the same step simulated whole); a nanosecond per GPU is the least that counts
        if not ex_s > INSTANT_S * world:
            continue
        s0 = spans[int(rows[sel[0]])]
        g = {"collective": collective_name(s0.kind, s0.op, s0.name), "kind": s0.kind, "op": s0.op,
             "exposed_s": ex_s, "comm_s": comm_s,
             "count_per_gpu": seq_sum(weight[sel], 0.0), "size_bytes": 0.0, "_best": (-1.0, 0, 0, 0.0, 0.0)}
        big = int(np.argmax(size[sel]))  # the first of the largest
        if size[sel][big] > 0.0:
            g["size_bytes"] = spans[int(rows[sel[big]])].size_bytes
        # the first span with the most exposed time, to a nanosecond: which of a steady
        # state's equal spans is named must not hang on the last bits of their sums (nor
        # differ between a step simulated whole and one whose cycle was copied in)
        ex = exposed[sel]
        best = int(np.argmax(ex >= ex.max() - INSTANT_S))
        if ex[best] > -1.0:
            s = spans[int(rows[sel[best]])]
            g["_best"] = (float(ex[best]), s.tid, s.rank, s.start_s, s.end_s)
        ranked.append(g)
    # largest first, to nine digits, then by name: equal sums (the same cost in two groups,
    # added in another order) differ in their last bits
    ranked.sort(key=lambda g: (-digits(g["exposed_s"]), g["collective"]))
    out = []
    if not ranked:
        return out
    # the communications on their own rank (a send, not its receive), for what shared a link
    tid = cols.tid
    mine = np.flatnonzero((cols.kind != cols.code("kind", "compute")) & (tid >= 0))
    task_rank = trace.task_columns(tasks, prog.runs, prog).rank
    mine = mine[task_rank[tid[mine]] == cols.rank[mine]]  # an id past the tasks fails here
    mine_start, mine_end = cols.start_s[mine], cols.end_s[mine]  # read once for every example
    for g in ranked[:top]:
        x, tid_, rank, a, b = g.pop("_best")
        entry = {**g, "exposed_s": g["exposed_s"] / world, "comm_s": g["comm_s"] / world,
                 "count_per_gpu": g["count_per_gpu"] / world,
                 "example": {"rank": rank, "start_s": a, "end_s": b, "exposed_s": x}}
        t = prog.task(tid_)
        if explainer is not None and cluster is not None and t.comm is not None:
            during = mine[(mine_start < b) & (mine_end > a)]
            entry.update(_explain(t, explainer, cluster, [spans[i] for i in during.tolist()], a, b, prog.task))
        out.append(entry)
    return out


def _explain(t: Task, ex: Explainer, cluster, during: list, a: float, b: float, task) -> dict:
    """Algorithm, bottleneck link and what shared it; ``during``: the communications (on their
    own ranks) that overlap the example span [a, b], in span order; ``task``: task by id."""
    c = t.comm
    busiest = ex.link_loads(c).busiest()
    algo = "point-to-point" if c.op == "send" else ex.algorithm(c)
    info: dict[str, Any] = {"algorithm": algo, "group_size": len(c.group), "bottleneck": None,
                            "alone": ex.timed_alone(t), "shared_with": []}
    if busiest is None:
        return info
    # the busiest to nine digits, then the first: twins' loads summed in another order (a
    # collapsed run's) differ in their last bits, which named another of equal links
    e, busy_s, flows = busiest
    u, v = cluster.edges[e]
    # NVLS moves at its own share of the NVLink rate, which busy_s is worked out at: the rate
    # shown is that share, so that the traffic over it is busy_s
    kind = cluster.binding_kind(e)  # (a shared NIC's cable held to its one PCIe link: pcie)
    bw_Bps = cluster.edge_bw_Bps[e] / (cluster.nvls_wire_scale if at_nvls_share(algo, kind) else 1.0)
    info["bottleneck"] = {"link": f"{u}->{v}", "kind": kind,
                          "bw_Bps": bw_Bps, "busy_s": busy_s, "flows": flows}
    crosses: dict[tuple, bool] = {}
    overlaps: dict[str, list[tuple[float, float]]] = {}
    for s in during:
        o = task(s.tid).comm
        if o is None or o.key == c.key:
            continue
        shape = (o.op, o.group, o.twins, o.size_bytes)
        if shape not in crosses:
            crosses[shape] = e in ex.link_loads(o)
        if crosses[shape]:
            overlaps.setdefault(collective_name(s.kind, s.op, s.name), []).append((max(a, s.start_s), min(b, s.end_s)))
    # how long each overlapped the example: the union of its spans' overlaps, so that a
    # collective's members (one span each, at the same times) count once, as its twins do in a
    # collapsed run, and no overlap outlasts the example
    shared = {k: length(union(v)) for k, v in overlaps.items()}
    # the longest overlaps first, to nine digits, then by name, as the causes are ranked: a
    # copied-in cycle (engine.repeat) moves span times by float crumbs, which reordered two
    # communications that overlap alike (an MoE layer's two recomputed all-to-alls)
    info["shared_with"] = [{"collective": k, "overlap_s": v}
                           for k, v in sorted(shared.items(), key=lambda kv: (-digits(kv[1]), kv[0]))[:5]]
    return info
