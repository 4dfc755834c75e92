"""Memory per pipeline stage: static states by dtype, activations following the schedule.

Static, per GPU, for Ψ local parameters with mixed-precision Adam (Rajbhandari et al. 2020,
Sec 3.1; Megatron keeps fp32 gradients, hence 4 bytes not 2 by default)::

    params 2Ψ  +  grads (4 or 2)Ψ  +  optimizer 12Ψ (fp32 master, m, v)

Activations: a microbatch's activations are allocated when its forward starts and freed when
its backward ends, so the peak is (max microbatches in flight) x (bytes per microbatch):
p on the first 1F1B stage, m under GPipe (Narayanan et al. SC'21, Sec 2.2).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..trace import Trace


@dataclass(frozen=True)
class StageStatic:
    stage: int
    params: float  # local parameters on one GPU of the stage
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes_per_mb: float
    transient_bytes: float = 0.0  # held for a moment (a recomputed layer, gathered ZeRO-3 units)


def inflight_peak(trace: Trace, rank: int) -> int:
    """Most microbatches whose forward has started and backward not yet ended, on ``rank``."""
    first_f: dict[int, float] = {}
    last_b: dict[int, float] = {}
    for s in trace.spans:
        if s.rank != rank or s.kind != "compute" or s.mb < 0:
            continue
        if s.phase == "F":
            first_f[s.mb] = min(first_f.get(s.mb, s.start_s), s.start_s)
        elif s.phase == "B":
            last_b[s.mb] = max(last_b.get(s.mb, s.end_s), s.end_s)
    # frees sort before allocations at the same instant: a slot reused back to back is one slot
    events = sorted([(t, 1) for t in first_f.values()] + [(t, -1) for t in last_b.values()])
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    return peak


def memory_report(trace: Trace, statics: list[StageStatic], capacity_bytes: float) -> dict:
    """Per-stage memory (bytes) with its peak against the GPU's capacity."""
    stages = []
    rank_of_stage = {}
    for r in trace.ranks:
        rank_of_stage.setdefault(trace.stage_of.get(r, 0), r)
    for st in statics:
        n = inflight_peak(trace, rank_of_stage[st.stage])
        act = n * st.activation_bytes_per_mb
        static = st.param_bytes + st.grad_bytes + st.optimizer_bytes
        peak = static + act + st.transient_bytes
        stages.append({
            "stage": st.stage,
            "params": st.params,
            "params_bytes": st.param_bytes,
            "grads_bytes": st.grad_bytes,
            "optimizer_bytes": st.optimizer_bytes,
            "activations_bytes": act,
            "activation_bytes_per_microbatch": st.activation_bytes_per_mb,
            "inflight_microbatches": n,
            "transient_bytes": st.transient_bytes,
            "peak_bytes": peak,
            "capacity_bytes": capacity_bytes,
            "fits": peak <= capacity_bytes,
        })
    return {
        "capacity_bytes": capacity_bytes,
        "peak_bytes": max(s["peak_bytes"] for s in stages),
        "fits": all(s["fits"] for s in stages),
        "stages": stages,
    }
