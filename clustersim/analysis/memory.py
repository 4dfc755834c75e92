"""Memory per pipeline stage: static states by dtype, activations following the schedule.

Static, per GPU, for Ψ local parameters with mixed-precision Adam (Rajbhandari et al. 2020,
Sec 3.1; Megatron keeps fp32 gradients, hence 4 bytes not 2 by default)::

    params 2Ψ  +  grads (4 or 2)Ψ  +  optimizer 12Ψ (fp32 master, m, v)

Ψ counts every model part the GPU holds (v chunks under interleaved 1F1B; two parts, i.e.
the parameters twice over the pipeline, under DualPipe).

Activations: a microbatch's activations on a part are allocated when its forward on that
part starts and freed when its last backward piece on that part ends (the W of a split
backward: the weight gradient still reads the layer inputs). A GPU's activation memory is,
at every instant, the sum over its parts of (live microbatches) x (bytes per microbatch of
that part); its peak is the peak of that sum. p microbatches on the first 1F1B stage, m under
GPipe (Narayanan et al. SC'21, Sec 2.2); p+1 under DualPipe (DeepSeek-V3 report, Table 2)::

    part 0  |F0......................B0|        alive: F start -> B (or W) end
    part 4       |F0.......B0|                  (interleaved rank 0: chunks 0 and 4)
    sum        1  2        1           0
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..trace import Span, Trace


@dataclass(frozen=True)
class PartStatic:
    """One model part held by a GPU, and how to recognise its spans in the trace.

    The engine stamps every span with its rank's pipeline stage, not the virtual stage, so a
    compute span's part is told by its layer (parts hold disjoint layers), or, for a block
    without a layer, by the block's name (``embedding`` on the first part, ``head`` on the last).
    """

    part: int
    params: float
    activation_bytes_per_mb: float
    layers: tuple[int, ...] = ()
    blocks: tuple[str, ...] = ()  # names of its blocks with layer -1


@dataclass(frozen=True)
class StageStatic:
    stage: int
    params: float  # local parameters on one GPU of the stage (all its parts)
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes_per_mb: float  # of its part (the largest part's when it holds several)
    transient_bytes: float = 0.0  # held for a moment (a recomputed layer, gathered ZeRO-3 units)
    parts: tuple[PartStatic, ...] = ()  # empty: one part, every span belongs to it


def part_classifier(parts: tuple[PartStatic, ...]) -> Callable[[Span], int] | None:
    """Span -> index into ``parts``; None when there is at most one part (nothing to tell apart)."""
    if len(parts) <= 1:
        return None
    by_layer: dict[int, int] = {}
    by_block: dict[str, int] = {}
    for i, p in enumerate(parts):
        for layer in p.layers:
            if by_layer.setdefault(layer, i) != i:
                raise ValueError(f"layer {layer} is in parts {parts[by_layer[layer]].part} and {p.part} of one GPU")
        for name in p.blocks:
            if by_block.setdefault(name, i) != i:
                raise ValueError(f"block {name!r} is in parts {parts[by_block[name]].part} and {p.part} of one GPU")

    def classify(s: Span) -> int:
        if s.layer >= 0:
            return by_layer[s.layer]
        return by_block[s.name.split(" ", 1)[-1]]  # span names are "<phase> <block name>"

    return classify


def live_intervals(trace: Trace, rank: int, part_of: Callable[[Span], int] | None = None
                   ) -> dict[tuple[int, int], tuple[float, float]]:
    """(part index, microbatch) -> (first forward start, last backward or W end) on ``rank``."""
    first_f: dict[tuple[int, int], float] = {}
    last_b: dict[tuple[int, int], float] = {}
    for s in trace.spans:
        if s.rank != rank or s.kind != "compute" or s.mb < 0:
            continue
        key = (part_of(s) if part_of else 0, s.mb)
        if s.phase == "F":
            first_f[key] = min(first_f.get(key, s.start_s), s.start_s)
        elif s.phase in ("B", "W"):
            last_b[key] = max(last_b.get(key, s.end_s), s.end_s)
    return {k: (t, last_b[k]) for k, t in first_f.items() if k in last_b}


def peak_live(intervals: dict[tuple[int, int], tuple[float, float]], bytes_per_mb: list[float]
              ) -> tuple[int, float, list[int]]:
    """(most (part, microbatch) sets alive at once, peak of the summed bytes, peak per part).

    Frees sort before allocations at the same instant: a slot reused back to back is one slot.
    """
    events = sorted([(t0, 1, part) for (part, _), (t0, _) in intervals.items()]
                    + [(t1, -1, part) for (part, _), (_, t1) in intervals.items()])
    live = [0] * len(bytes_per_mb)
    per_part = [0] * len(bytes_per_mb)
    count = peak_count = 0
    peak_bytes = 0.0
    for _, d, part in events:
        live[part] += d
        count += d
        per_part[part] = max(per_part[part], live[part])
        peak_count = max(peak_count, count)
        if d > 0:
            now = sum(n * b for n, b in zip(live, bytes_per_mb))
            peak_bytes = max(peak_bytes, now)
    return peak_count, peak_bytes, per_part


def inflight_peak(trace: Trace, rank: int, parts: tuple[PartStatic, ...] = ()) -> int:
    """Most (part, microbatch) activation sets alive at once on ``rank`` (microbatches when it
    holds one part)."""
    n = max(len(parts), 1)
    return peak_live(live_intervals(trace, rank, part_classifier(parts)), [0.0] * n)[0]


def memory_report(trace: Trace, statics: list[StageStatic], capacity_bytes: float) -> dict:
    """Per-stage memory (bytes) with its peak against the GPU's capacity."""
    stages = []
    rank_of_stage = {}
    for r in trace.ranks:
        rank_of_stage.setdefault(trace.stage_of.get(r, 0), r)
    for st in statics:
        parts = st.parts or (PartStatic(0, st.params, st.activation_bytes_per_mb),)
        intervals = live_intervals(trace, rank_of_stage[st.stage], part_classifier(parts))
        n, act, per_part = peak_live(intervals, [p.activation_bytes_per_mb for p in parts])
        if len(parts) == 1:
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
            "parts": [{"part": p.part, "params": p.params, "activation_bytes_per_microbatch": p.activation_bytes_per_mb,
                       "inflight_microbatches": k} for p, k in zip(parts, per_part)],
        })
    return {
        "capacity_bytes": capacity_bytes,
        "peak_bytes": max(s["peak_bytes"] for s in stages),
        "fits": all(s["fits"] for s in stages),
        "stages": stages,
    }
