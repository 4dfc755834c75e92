"""Step metrics from the trace: step time, throughput, MFU/HFU, bubble, exposed communication.

Per rank, the step [0, T] splits into three disjoint parts::

    compute       the compute stream is busy
    exposed comm  compute idle while this rank's communication runs (per kind: tp, pp, dp, ...)
    bubble        compute idle and no communication of this rank in flight (waiting on others)

    bubble_fraction = mean over GPUs of bubble / T
    bubble = warm-up + cool-down + dependency + imbalance      (:mod:`.bubble`)
    With free communication and equal stages, GPipe and 1F1B give (p-1)/(m+p-1)
    (Narayanan et al. SC'21, Sec 2.2).

    MFU = model FLOPs per step / (T * world * peak)     (Chowdhery et al. 2022, App. B)
    HFU = executed FLOPs (incl. recompute) / (T * world * peak)
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import mul

import numpy as np

from ..floats import sum_left
from ..trace import COMM_KINDS, INSTANT_S, Trace
from .bubble import DEP_KINDS, SAME_SHARE, BubbleSplit, split_bubble
from .columns import SpanColumns
from .intervals import Arrays, merged, merged_length, minus_length_arrays


@dataclass(frozen=True)
class RankTimes:
    compute_s: float
    comm_s: dict[str, float]  # busy time per kind (union of its spans)
    comm_total_s: float  # union of all kinds' spans
    exposed_s: dict[str, float]  # per kind, not hidden behind compute
    exposed_total_s: float  # union of all kinds, not hidden behind compute
    bubble_s: float
    busy: Arrays  # when compute or any of its communication runs, merged: (starts, ends)


def rank_times(spans, step_s: float) -> RankTimes:
    """Split one rank's step into compute, exposed communication and bubble."""
    cols = SpanColumns(spans)
    order = np.argsort(cols.start_s, kind="stable")
    codes = {k: cols.code("kind", k) for k in ("compute", *COMM_KINDS)}
    return _rank_times(cols.start_s[order], cols.end_s[order], cols.kind[order], codes, step_s)


def _rank_times(start: np.ndarray, end: np.ndarray, kind: np.ndarray, codes: dict[str, int],
                step_s: float) -> RankTimes:
    """:func:`rank_times` on one rank's spans as arrays sorted by start; ``codes``: the kind
    codes of compute and of ``COMM_KINDS`` (-1: no such span)::

        compute   = union(compute spans)          comm[k] = union(spans of kind k)
        exposed_k = |comm[k] minus compute|       all     = union(spans of all COMM_KINDS)
        bubble    = max(T - |compute u all|, 0)       (spans within INSTANT_S of each other joined)
    """
    def iv(mask: np.ndarray, join_s: float = 0.0) -> Arrays:
        return merged(start[mask], end[mask], presorted=True, join_s=join_s)

    is_compute = kind == codes["compute"]
    # each kind's mask once, for its own union and for all communication's (a kind the trace
    # lacks, code -1, has no spans: its union is the empty one)
    masks = {k: kind == codes[k] for k in COMM_KINDS if codes[k] >= 0}
    is_comm = np.logical_or.reduce(list(masks.values())) if masks else np.zeros(len(kind), dtype=bool)
    compute = iv(is_compute)
    none = merged(start[:0], end[:0], presorted=True)
    by_kind = {k: iv(masks[k]) if k in masks else none for k in COMM_KINDS}
    all_comm = iv(is_comm)
    # (spans a rounding apart, which a collapsed run and every rank's sum along other paths,
    # leave no gap: times within INSTANT_S are one instant)
    busy = iv(is_compute | is_comm, INSTANT_S)
    comm_s = {k: merged_length(v) for k, v in by_kind.items()}
    comm_total_s = merged_length(all_comm)
    # |A minus B| <= |A|: the pieces of a union that compute cuts add up in another order
    # than the union's own intervals, a few ulps apart, and never more than the union
    return RankTimes(
        compute_s=merged_length(compute), comm_s=comm_s, comm_total_s=comm_total_s,
        exposed_s={k: min(minus_length_arrays(by_kind[k], compute), comm_s[k]) for k in COMM_KINDS},
        exposed_total_s=min(minus_length_arrays(all_comm, compute), comm_total_s),
        bubble_s=max(step_s - merged_length(busy), 0.0), busy=busy,
    )


def _weighted_total(cols: SpanColumns, weight: dict[int, int], attr: str):
    """``sum(weight[s.rank] * s.<attr> for s in spans)``, left to right, on the values as the
    spans hold them (ints included), so the total is that of Python's sum up to 3.11
    (:func:`~clustersim.floats.sum_left`) on every version.

    When every value is a float (or the integer 0, which adds as 0.0 does), one at least a
    float, and every weight an int, each product is the float Python makes (``float(w) * x``)
    and ``np.cumsum`` adds them one after the other as ``sum`` does (from 0: ``0 + -0.0`` is
    ``0.0``), bit for bit, in C; otherwise Python's sum runs."""
    codes, values = cols.form_table(attr)
    weights = [weight[r] for r in cols.ranks]
    kinds = set(map(type, values))
    if (float in kinds and kinds <= {float, int} and all(v == 0 for v in values if type(v) is int)
            and all(type(w) is int for w in weights)):
        products = np.asarray(weights, dtype=np.float64)[cols.rank_pos] * np.asarray(values)[codes]
        return float(np.cumsum(np.concatenate(([0.0], products)))[-1])
    w = np.array(weights, dtype=object)[cols.rank_pos].tolist()
    return sum_left(map(mul, w, cols.form_values(attr)))


def _pipeline_marks(cols: SpanColumns) -> tuple[list[float | None], list[float | None]]:
    """Per rank (in ``cols.ranks`` order): its first backward compute span's start and its last
    forward compute span's end (None: none)."""
    comp = cols.compute
    rank = cols.rank_pos[comp.rows]
    out = []
    for phase, pick, times in (("B", np.minimum, cols.start_s), ("F", np.maximum, cols.end_s)):
        sel = comp.phase == comp.code("phase", phase)
        mark = np.full(len(cols.ranks), np.inf if pick is np.minimum else -np.inf)
        pick.at(mark, rank[sel], times[comp.rows[sel]])
        has = np.bincount(rank[sel], minlength=len(cols.ranks)) > 0
        out.append([float(x) if h else None for x, h in zip(mark.tolist(), has.tolist())])
    return out[0], out[1]


def _split_dict(b: BubbleSplit) -> dict:
    return {"warm_up_s": b.warm_up_s, "cool_down_s": b.cool_down_s, "dependency_s": b.dependency_s,
            "imbalance_s": b.imbalance_s}


def step_metrics(trace: Trace, *, world_size: int, peak_flops: float, tokens_per_step: int) -> dict:
    """The headline numbers of one step, averaged over GPUs (simulated ranks weighed)."""
    cols = trace.columns()
    step = cols.end_s_max()
    order, bounds = cols.time_groups  # each rank's spans by start: unions need no sort
    start, end, kind = cols.start_s[order], cols.end_s[order], cols.kind[order]
    codes = {k: cols.code("kind", k) for k in ("compute", *COMM_KINDS)}
    per_rank: dict[int, RankTimes] = {}
    for i, r in enumerate(cols.ranks):
        sl = slice(bounds[i], bounds[i + 1])
        per_rank[r] = _rank_times(start[sl], end[sl], kind[sl], codes, step)
    max_compute = max((t.compute_s for t in per_rank.values()), default=0.0)
    pipelined = len(set(trace.stage_of.values())) > 1
    first_b, last_f = _pipeline_marks(cols)
    dep_codes = {k: cols.code("kind", k) for k in DEP_KINDS}
    splits = {}
    for i, r in enumerate(cols.ranks):
        sl = slice(bounds[i], bounds[i + 1])
        splits[r] = split_bubble(start[sl], kind[sl], dep_codes, per_rank[r].busy, step, per_rank[r].compute_s,
                                 max_compute, pipelined, first_b[i], last_f[i])
    w = trace.weight
    total_w = sum_left(w.values())

    def mean(f):
        return sum_left(w[r] * f(t) for r, t in per_rank.items()) / total_w

    model_flops = _weighted_total(cols, w, "model_flops")
    hw_flops = _weighted_total(cols, w, "flops")
    per_gpu = step * world_size
    exposed = {k: mean(lambda t, k=k: t.exposed_s[k]) for k in COMM_KINDS}
    exposed["total"] = mean(lambda t: t.exposed_total_s)
    comm = {k: mean(lambda t, k=k: t.comm_s[k]) for k in COMM_KINDS}
    return {
        "step_time_s": step,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_step / step if step else 0.0,
        "tokens_per_s_per_gpu": tokens_per_step / step / world_size if step else 0.0,
        "model_flops_per_step": model_flops,
        "hardware_flops_per_step": hw_flops,
        "tflops_per_gpu": model_flops / per_gpu / 1e12 if step else 0.0,
        "hw_tflops_per_gpu": hw_flops / per_gpu / 1e12 if step else 0.0,
        "mfu": model_flops / (per_gpu * peak_flops) if step else 0.0,
        "hfu": hw_flops / (per_gpu * peak_flops) if step else 0.0,
        "bubble_fraction": mean(lambda t: t.bubble_s) / step if step else 0.0,
        "bubble": _bubble_report(trace, per_rank, splits, step),
        "compute_s": mean(lambda t: t.compute_s),
        "comm_s": comm,
        "exposed_comm_s": exposed,
        # per rank, then averaged: the difference of the two means would leave the rounding of
        # two sums over other ranks (a collapsed run's weighted few, every rank's one by one)
        "hidden_comm_s": {**{k: mean(lambda t, k=k: t.comm_s[k] - t.exposed_s[k]) for k in COMM_KINDS},
                          "total": mean(lambda t: t.comm_total_s - t.exposed_total_s)},
        "per_stage": _per_stage(trace, per_rank, step, splits),
    }


def _bubble_report(trace: Trace, per_rank: dict, splits: dict[int, BubbleSplit], step: float) -> dict:
    """summary.json ``bubble``: the GPU-weighted mean split, and each simulated rank's."""
    w = trace.weight
    total_w = sum_left(w.values()) or 1

    def mean(f):
        return sum_left(w[r] * f(b) for r, b in splits.items()) / total_w

    dep_keys = next(iter(splits.values())).dependency_s.keys() if splits else ()
    return {
        "fraction": mean(lambda b: b.bubble_s) / step if step else 0.0,
        "bubble_s": mean(lambda b: b.bubble_s),
        "warm_up_s": mean(lambda b: b.warm_up_s),
        "cool_down_s": mean(lambda b: b.cool_down_s),
        "dependency_s": {k: mean(lambda b, k=k: b.dependency_s[k]) for k in dep_keys},
        "imbalance_s": mean(lambda b: b.imbalance_s),
        "per_rank": [{"rank": r, "stage": trace.stage_of.get(r, 0), "weight": w[r], "bubble_s": b.bubble_s,
                      **_split_dict(b)} for r, b in splits.items()],
    }


def _per_stage(trace: Trace, per_rank: dict, step: float, splits: dict[int, BubbleSplit]) -> list[dict]:
    """The same split for one GPU of each pipeline stage: its busiest, the one with the least
    bubble (the lowest-numbered of those within 1e-9 of the step of it, bubble.SAME_SHARE, so
    that GPUs equal but for rounding, as every rank simulated gives them, read as the
    collapsed run's representative), where the stage's simulated ranks differ (classes split
    around a straggler, a fault, a skewed load); its rank and the ranks simulated for the
    stage besides::

        straggler GPU 5 at 1.3x on stage 0:   stage 0's row is GPU 5's (it computes 1.3x and
        waits least), not GPU 0's, whose figures the stage's first rank would give
    """
    ranks: dict[int, list[int]] = {}
    for r in per_rank:
        ranks.setdefault(trace.stage_of.get(r, 0), []).append(r)
    out: dict[int, dict] = {}
    for st, rs in ranks.items():
        least = min(per_rank[x].bubble_s for x in rs)
        r = min(x for x in rs if per_rank[x].bubble_s <= least + SAME_SHARE * step)
        t = per_rank[r]
        out[st] = {
            "stage": st, "gpu": r, "ranks_simulated": len(rs),
            "compute_s": t.compute_s,
            "exposed_comm_s": {**{k: t.exposed_s[k] for k in COMM_KINDS}, "total": t.exposed_total_s},
            "bubble_s": t.bubble_s,
            "bubble_fraction": t.bubble_s / step if step else 0.0,
            **_split_dict(splits[r]),
        }
    return [out[k] for k in sorted(out)]
