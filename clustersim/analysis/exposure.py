"""Exposed communication traced to its cause: which collective, which link bounded it, and
what else was on that link at the time.

A communication span is exposed where its rank's compute stream is idle (:mod:`.metrics`).
Spans are grouped by collective (kind, op and name, with numbers such as bucket indices
folded), weighted by the GPUs each simulated rank stands for, and ranked by exposed time per
GPU. Concurrent communications of one rank each count their own exposed time, so the groups
can add up to more than ``exposed_comm_s.total``.

For the top groups, the span with the most exposed time is explained::

    bottleneck  the link whose traffic from this collective (twins included) takes longest
                at that link's bandwidth: sum over flows of weight * bytes / bw — the link
                that bounds the collective alone (its alpha-beta time)
    shared_with other communications whose flows cross that link while the span runs, with
                how long they overlapped it (none when the collective was alone on its
                links, which the engine then timed in closed form)
"""

from __future__ import annotations

import re
from typing import Any, Protocol

import numpy as np

from ..program.tasks import Comm, Program, Task
from ..trace import Trace
from .intervals import union

_NUM = re.compile(r"\b\d+\b")  # bucket and part numbers, not "A2A"


class Explainer(Protocol):
    """What the engine tells about one communication (see :class:`clustersim.engine.sim.Engine`)."""

    def algorithm(self, c: Comm) -> str: ...
    def link_loads(self, c: Comm) -> dict[int, tuple[float, float]]: ...
    def timed_alone(self, t: Task) -> bool: ...


def collective_name(kind: str, op: str, name: str) -> str:
    """``dp all_reduce: AR grads bucket #``: a group of spans that are the same collective."""
    return f"{kind} {op}: {_NUM.sub('#', name)}"


def covered_s(t: np.ndarray, merged: list[tuple[float, float]]) -> np.ndarray:
    """Time in [0, t] covered by ``merged`` (sorted, disjoint intervals), for every t at once:
    the whole intervals before t plus the part of the one t falls in."""
    if not merged:
        return np.zeros(len(t))
    iv = np.asarray(merged)
    lo, hi = iv[:, 0], iv[:, 1]
    before = np.concatenate([[0.0], np.cumsum(hi - lo)])
    k = np.searchsorted(lo, t, side="right") - 1  # the last interval starting at or before t
    inside = np.where(k >= 0, np.clip(t - lo[np.maximum(k, 0)], 0.0, (hi - lo)[np.maximum(k, 0)]), 0.0)
    return np.where(k >= 0, before[np.maximum(k, 0)], 0.0) + inside


def exposed_collectives(prog: Program, trace: Trace, explainer: Explainer | None = None,
                        cluster=None, top: int = 8) -> list[dict[str, Any]]:
    """summary.json ``exposed_comm_causes``: the collectives with the most exposed time per GPU."""
    tasks, w = prog.tasks, trace.weight
    world = sum(w.values()) or 1
    groups: dict[str, dict[str, Any]] = {}
    group_of: dict[tuple[str, str, str], dict[str, Any]] = {}  # (kind, op, name) -> its group
    for rank, spans in trace.by_rank().items():
        merged = union([(s.start_s, s.end_s) for s in spans if s.kind == "compute"])
        comm = [s for s in spans if s.kind != "compute" and s.end_s > s.start_s]
        if not comm:
            continue
        a = np.array([s.start_s for s in comm])
        b = np.array([s.end_s for s in comm])
        # exposed: the span's length minus the compute inside it (span minus compute)
        exposed = ((b - a) - (covered_s(b, merged) - covered_s(a, merged))).tolist()
        for s, x in zip(comm, exposed):
            g = group_of.get((s.kind, s.op, s.name))
            if g is None:
                key = collective_name(s.kind, s.op, s.name)
                g = groups.get(key)
                if g is None:
                    g = groups[key] = {"collective": key, "kind": s.kind, "op": s.op, "exposed_s": 0.0,
                                       "comm_s": 0.0, "count_per_gpu": 0.0, "size_bytes": 0.0,
                                       "_best": (-1.0, 0, 0, 0.0, 0.0)}
                group_of[(s.kind, s.op, s.name)] = g
            g["exposed_s"] += w[rank] * x
            g["comm_s"] += w[rank] * (s.end_s - s.start_s)
            g["count_per_gpu"] += w[rank]
            if s.size_bytes > g["size_bytes"]:
                g["size_bytes"] = s.size_bytes
            if x > g["_best"][0]:
                g["_best"] = (x, s.tid, rank, s.start_s, s.end_s)
    ranked = sorted((g for g in groups.values() if g["exposed_s"] > 0), key=lambda g: (-g["exposed_s"], g["collective"]))
    out = []
    comm_spans = [s for s in trace.spans if s.kind != "compute" and s.tid >= 0 and tasks[s.tid].rank == s.rank]
    s_start = np.array([s.start_s for s in comm_spans])
    s_end = np.array([s.end_s for s in comm_spans])
    for g in ranked[:top]:
        x, tid, rank, a, b = g.pop("_best")
        entry = {**g, "exposed_s": g["exposed_s"] / world, "comm_s": g["comm_s"] / world,
                 "count_per_gpu": g["count_per_gpu"] / world,
                 "example": {"rank": rank, "start_s": a, "end_s": b, "exposed_s": x}}
        t = tasks[tid]
        if explainer is not None and cluster is not None and t.comm is not None:
            entry.update(_explain(t, explainer, cluster, comm_spans, s_start, s_end, a, b, tasks))
        out.append(entry)
    return out


def _explain(t: Task, ex: Explainer, cluster, comm_spans, s_start, s_end, a: float, b: float, tasks) -> dict:
    c = t.comm
    loads = ex.link_loads(c)
    algo = "point-to-point" if c.op == "send" else ex.algorithm(c)
    info: dict[str, Any] = {"algorithm": algo, "group_size": len(c.group), "bottleneck": None,
                            "alone": ex.timed_alone(t), "shared_with": []}
    if not loads:
        return info
    e = max(loads, key=lambda k: (loads[k][0], -k))
    u, v = cluster.edges[e]
    info["bottleneck"] = {"link": f"{u}->{v}", "kind": cluster.graph.edges[u, v].get("kind", ""),
                          "bw_Bps": cluster.edge_bw_Bps[e], "busy_s": loads[e][0], "flows": loads[e][1]}
    crosses: dict[tuple, bool] = {}
    shared: dict[str, float] = {}
    for i in np.nonzero((s_start < b) & (s_end > a))[0]:
        s = comm_spans[int(i)]
        o = tasks[s.tid].comm
        if o is None or o.key == c.key:
            continue
        shape = (o.op, o.group, o.twins, o.size_bytes)
        if shape not in crosses:
            crosses[shape] = e in ex.link_loads(o)
        if crosses[shape]:
            name = collective_name(s.kind, s.op, s.name)
            shared[name] = shared.get(name, 0.0) + min(b, s.end_s) - max(a, s.start_s)
    info["shared_with"] = [{"collective": k, "overlap_s": v}
                           for k, v in sorted(shared.items(), key=lambda kv: (-kv[1], kv[0]))[:5]]
    return info
