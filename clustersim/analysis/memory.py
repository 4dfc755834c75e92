"""Memory per pipeline stage over the step: static states by dtype, activations following the
schedule, communication buffers while their transfers run.

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

Communication buffers: a communication holds a buffer on its rank from its span's start to
its end when it needs memory that nothing else here counts (``comm_buffer_bytes``):

* pipeline send and receive (kind ``pp``): the message, ``size_bytes`` (``2bsh``, ``/t``
  with sequence parallelism). The receiver allocates the tensor it receives into before the
  transfer; it becomes the layer input, counted with the activations, only when its forward
  (or, for a gradient, its backward) starts. The sender's message is the stage's output,
  which no layer of the stage stores (a layer keeps its input); Megatron-LM frees it once
  sent (``deallocate_output_tensor``). Both ends therefore hold it while it travels.
* all-to-all (EP dispatch and combine, kind ``ep``): the receive buffer, ``size_bytes`` (the
  tokens x top-k x capacity hidden vectors a rank hands over; balanced routing receives as
  much). In the forward, the dispatch buffer becomes the expert input that the activations
  also count (the dispatched states kept for the weight gradients): while that transfer runs
  those bytes are counted twice, at most one buffer's worth, against the whole-microbatch
  allocation at its first forward, which already counts every layer not yet run.
* nothing for the others: all-reduce runs in place on the tensor it reduces (NCCL's fixed
  staging buffers are a workspace, not counted); reduce-scatter writes a 1/n shard of a
  tensor already allocated; the TP all-gather under sequence parallelism gathers into
  Megatron-LM's persistent global buffer (a workspace); DP gradient reduction and ZeRO-1/2
  parameter gathers run on the gradient and parameter buffers counted in the static bytes;
  ZeRO-3's gathered layers (dp all-gathers on the ``zero`` stream) and context parallelism's
  K/V buffers (ring shifts, all-gathered K/V) are already a fixed term of ``transient_bytes``.

Timeline and peak, per stage (its representative simulated rank)::

    act(t) = sum over parts of live(part, t) x bytes per microbatch of the part
    buf(t) = sum of comm_buffer_bytes(span) over this rank's spans with start <= t < end
    peak   = params + grads + optimizer + max_t (act(t) + buf(t)) + transient

    compute  |F0|F1|F2|F3|B0|F4|B1| ...
    pp          [s0][s1][s2]  [r0][s3]          s: send act, r: recv grad
    act         1  2  3  4  3 4   3
    buf          +m  +m  +m    +m +m             m = message bytes while a transfer runs

Allocations and frees at the same instant are applied frees first (a slot reused back to back
is one slot). Without buffer-holding communications buf(t) = 0 and the peak is the
activation peak. ``transient_bytes`` (a layer recomputed, ZeRO-3 gathered layers, CP K/V)
stays a constant added at the peak: it is held for moments the trace does not resolve.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..trace import Span, Trace

TIMELINE_POINTS = 120  # most samples a stage's reported timeline keeps


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


def comm_buffer_bytes(s: Span) -> float:
    """Bytes the communication ``s`` holds on its rank while it runs (module docstring):
    a pipeline message at both ends, an all-to-all's receive buffer; 0 for anything else."""
    if s.kind == "pp" or (s.kind == "ep" and s.op == "all_to_all"):
        return s.size_bytes
    return 0.0


def _live_intervals(spans: list[Span], part_of: Callable[[Span], int] | None
                    ) -> dict[tuple[int, int], tuple[float, float]]:
    first_f: dict[tuple[int, int], float] = {}
    last_b: dict[tuple[int, int], float] = {}
    for s in spans:
        if s.kind != "compute" or s.mb < 0:
            continue
        key = (part_of(s) if part_of else 0, s.mb)
        if s.phase == "F":
            first_f[key] = min(first_f.get(key, s.start_s), s.start_s)
        elif s.phase in ("B", "W"):
            last_b[key] = max(last_b.get(key, s.end_s), s.end_s)
    return {k: (t, last_b[k]) for k, t in first_f.items() if k in last_b}


def live_intervals(trace: Trace, rank: int, part_of: Callable[[Span], int] | None = None
                   ) -> dict[tuple[int, int], tuple[float, float]]:
    """(part index, microbatch) -> (first forward start, last backward or W end) on ``rank``."""
    return _live_intervals([s for s in trace.spans if s.rank == rank], part_of)


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


@dataclass
class StageTimeline:
    """A rank's memory over the step, as steps: from ``t_s[i]`` until ``t_s[i+1]`` it holds
    ``activations[i]`` + ``buffers[i]`` bytes (after every allocation and free at ``t_s[i]``)."""

    t_s: list[float]
    activations: list[float]
    buffers: list[float]
    inflight: int  # most (part, microbatch) sets alive at once
    per_part: list[int]  # most microbatches alive at once on each part

    def peak_index(self) -> int:
        """The first sample with the highest activations + buffers (0 when empty)."""
        best, at = -1.0, 0
        for i, (a, b) in enumerate(zip(self.activations, self.buffers)):
            if a + b > best:
                best, at = a + b, i
        return at

    def downsampled(self, points: int = TIMELINE_POINTS) -> "StageTimeline":
        """At most ``points`` samples: the first and the last, and between them the time from
        the second to the next-to-last cut into ``points - 2`` equal bins, each keeping its
        sample with the highest total (the first on ties), so the peak sample survives."""
        n = len(self.t_s)
        if n <= points:
            return self
        bins = points - 2
        t0, span = self.t_s[1], self.t_s[n - 2] - self.t_s[1]
        keep: dict[int, int] = {}
        for i in range(1, n - 1):
            k = min(int((self.t_s[i] - t0) / span * bins), bins - 1) if span > 0 else 0
            j = keep.get(k)
            if j is None or self.activations[i] + self.buffers[i] > self.activations[j] + self.buffers[j]:
                keep[k] = i
        idx = [0, *sorted(keep.values()), n - 1]
        return StageTimeline([self.t_s[i] for i in idx], [self.activations[i] for i in idx],
                             [self.buffers[i] for i in idx], self.inflight, self.per_part)


def stage_timeline(spans: list[Span], parts: tuple[PartStatic, ...]) -> StageTimeline:
    """Activations and communication buffers over time on one rank, from its spans (module
    docstring). Starts with a zero sample at t = 0 when nothing is held then."""
    bytes_per_mb = [p.activation_bytes_per_mb for p in parts]
    intervals = _live_intervals(spans, part_classifier(parts))
    # (time, +1 alloc / -1 free, 0 activation | 1 buffer, part index | buffer bytes)
    events: list[tuple[float, int, int, float]] = []
    for (part, _), (t0, t1) in intervals.items():
        events.append((t0, 1, 0, part))
        events.append((t1, -1, 0, part))
    for s in spans:
        if s.kind == "compute" or s.end_s <= s.start_s:
            continue
        nbytes = comm_buffer_bytes(s)
        if nbytes > 0:
            events.append((s.start_s, 1, 1, nbytes))
            events.append((s.end_s, -1, 1, nbytes))
    events.sort()
    live = [0] * len(parts)
    per_part = [0] * len(parts)
    held: dict[float, int] = {}  # buffer size -> how many held: sums stay exact, 0 when none
    count = peak_count = 0
    t_s: list[float] = []
    act: list[float] = []
    buf: list[float] = []
    if not events or events[0][0] > 0:
        t_s.append(0.0)
        act.append(0.0)
        buf.append(0.0)
    i, n = 0, len(events)
    while i < n:
        t = events[i][0]
        while i < n and events[i][0] == t:
            _, d, what, x = events[i]
            if what == 0:
                p = int(x)
                live[p] += d
                count += d
                per_part[p] = max(per_part[p], live[p])
                peak_count = max(peak_count, count)
            else:
                held[x] = held.get(x, 0) + d
            i += 1
        t_s.append(t)
        act.append(sum((k * b for k, b in zip(live, bytes_per_mb)), 0.0))
        buf.append(sum((size * k for size, k in sorted(held.items()) if k), 0.0))
    return StageTimeline(t_s, act, buf, peak_count, per_part)


def memory_report(trace: Trace, statics: list[StageStatic], capacity_bytes: float) -> dict:
    """Per-stage memory (bytes): its peak over the step against the GPU's capacity, and the
    timeline of activations and communication buffers that the peak comes from."""
    stages = []
    rank_of_stage: dict[int, int] = {}
    for r in trace.ranks:
        rank_of_stage.setdefault(trace.stage_of.get(r, 0), r)
    wanted = set(rank_of_stage.values())
    spans_of: dict[int, list[Span]] = {r: [] for r in wanted}
    for s in trace.spans:  # one pass: the representative ranks' spans
        if s.rank in wanted:
            spans_of[s.rank].append(s)
    for st in statics:
        parts = st.parts or (PartStatic(0, st.params, st.activation_bytes_per_mb),)
        tl = stage_timeline(spans_of[rank_of_stage[st.stage]], parts)
        act = max(tl.activations)
        at = tl.peak_index()
        static = st.param_bytes + st.grad_bytes + st.optimizer_bytes
        peak = static + (tl.activations[at] + tl.buffers[at]) + st.transient_bytes
        shown = tl.downsampled()
        stages.append({
            "stage": st.stage,
            "params": st.params,
            "params_bytes": st.param_bytes,
            "grads_bytes": st.grad_bytes,
            "optimizer_bytes": st.optimizer_bytes,
            "activations_bytes": act,
            "activation_bytes_per_microbatch": st.activation_bytes_per_mb,
            "inflight_microbatches": tl.inflight,
            "comm_buffers_bytes": tl.buffers[at],
            "transient_bytes": st.transient_bytes,
            "peak_bytes": peak,
            "peak_t_s": tl.t_s[at],
            "capacity_bytes": capacity_bytes,
            "margin_bytes": capacity_bytes - peak,
            "fits": peak <= capacity_bytes,
            "parts": [{"part": p.part, "params": p.params, "activation_bytes_per_microbatch": p.activation_bytes_per_mb,
                       "inflight_microbatches": k} for p, k in zip(parts, tl.per_part)],
            "timeline": {"t_s": shown.t_s, "activations_bytes": shown.activations,
                         "comm_buffers_bytes": shown.buffers},
        })
    tightest = min(stages, key=lambda s: s["margin_bytes"])  # the first on ties
    return {
        "capacity_bytes": capacity_bytes,
        "peak_bytes": max(s["peak_bytes"] for s in stages),
        "margin_bytes": tightest["margin_bytes"],
        "tightest_stage": tightest["stage"],
        "fits": all(s["fits"] for s in stages),
        "stages": stages,
    }
