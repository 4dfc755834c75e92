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

from ..trace import Trace
from .bubble import BubbleSplit, split_bubble
from .intervals import length, minus_length, union

COMM_KINDS = ("tp", "cp", "ep", "pp", "dp")


@dataclass(frozen=True)
class RankTimes:
    compute_s: float
    comm_s: dict[str, float]  # busy time per kind (union of its spans)
    comm_total_s: float  # union of all kinds' spans
    exposed_s: dict[str, float]  # per kind, not hidden behind compute
    exposed_total_s: float  # union of all kinds, not hidden behind compute
    bubble_s: float
    busy: list[tuple[float, float]]  # when compute or any of its communication runs, merged


def rank_times(spans, step_s: float) -> RankTimes:
    """Split one rank's step into compute, exposed communication and bubble."""
    compute = union((s.start_s, s.end_s) for s in spans if s.kind == "compute")
    by_kind = {k: union((s.start_s, s.end_s) for s in spans if s.kind == k) for k in COMM_KINDS}
    all_comm = union(iv for k in COMM_KINDS for iv in by_kind[k])
    exposed = {k: minus_length(by_kind[k], compute) for k in COMM_KINDS}
    exposed_total = minus_length(all_comm, compute)
    busy = union(compute + all_comm)
    return RankTimes(
        compute_s=length(compute), comm_s={k: length(v) for k, v in by_kind.items()}, comm_total_s=length(all_comm),
        exposed_s=exposed, exposed_total_s=exposed_total, bubble_s=max(step_s - length(busy), 0.0), busy=busy,
    )


def _split_dict(b: BubbleSplit) -> dict:
    return {"warm_up_s": b.warm_up_s, "cool_down_s": b.cool_down_s, "dependency_s": b.dependency_s,
            "imbalance_s": b.imbalance_s}


def step_metrics(trace: Trace, *, world_size: int, peak_flops: float, tokens_per_step: int) -> dict:
    """The headline numbers of one step, averaged over GPUs (simulated ranks weighed)."""
    step = trace.end_s
    rank_spans = trace.by_rank()
    per_rank = {r: rank_times(spans, step) for r, spans in rank_spans.items()}
    max_compute = max((t.compute_s for t in per_rank.values()), default=0.0)
    pipelined = len(set(trace.stage_of.values())) > 1
    splits = {r: split_bubble(rank_spans[r], per_rank[r].busy, step, per_rank[r].compute_s, max_compute,
                                pipelined) for r in per_rank}
    w = trace.weight
    total_w = sum(w.values())

    def mean(f):
        return sum(w[r] * f(t) for r, t in per_rank.items()) / total_w

    model_flops = sum(w[s.rank] * s.model_flops for s in trace.spans)
    hw_flops = sum(w[s.rank] * s.flops for s in trace.spans)
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
        "hidden_comm_s": {**{k: comm[k] - exposed[k] for k in COMM_KINDS},
                          "total": mean(lambda t: t.comm_total_s) - exposed["total"]},
        "per_stage": _per_stage(trace, per_rank, step, splits),
    }


def _bubble_report(trace: Trace, per_rank: dict, splits: dict[int, BubbleSplit], step: float) -> dict:
    """summary.json ``bubble``: the GPU-weighted mean split, and each simulated rank's."""
    w = trace.weight
    total_w = sum(w.values()) or 1

    def mean(f):
        return sum(w[r] * f(b) for r, b in splits.items()) / total_w

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
    """The same split for each pipeline stage (all ranks of a stage behave alike)."""
    out: dict[int, dict] = {}
    for r, t in per_rank.items():
        st = trace.stage_of.get(r, 0)
        if st in out:
            continue
        out[st] = {
            "stage": st,
            "compute_s": t.compute_s,
            "exposed_comm_s": {**{k: t.exposed_s[k] for k in COMM_KINDS}, "total": t.exposed_total_s},
            "bubble_s": t.bubble_s,
            "bubble_fraction": t.bubble_s / step if step else 0.0,
            **_split_dict(splits[r]),
        }
    return [out[k] for k in sorted(out)]
