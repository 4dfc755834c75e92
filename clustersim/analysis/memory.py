"""Memory per pipeline stage over the step: static states by dtype, activations following the
schedule, communication buffers while their transfers run.

Static, per GPU, for Ψ local parameters with mixed-precision Adam (Rajbhandari et al. 2020,
Sec 3.1; Megatron keeps fp32 gradients, hence 4 bytes not 2 by default)::

    params 2Ψ  +  grads (4 or 2)Ψ  +  optimizer 12Ψ (fp32 master, m, v; 8Ψ with bf16 moments)

Ψ counts every model part the GPU holds (v chunks under interleaved 1F1B; two parts, i.e.
the parameters twice over the pipeline, under DualPipe).

Activations: a microbatch's activations on a part are allocated when its forward on that
part starts and freed when its last backward piece on that part ends. A GPU's activation
memory is, at every instant, the sum over its parts of (live microbatches) x (bytes per
microbatch of that part); its peak is the peak of that sum. p microbatches on the first 1F1B
stage, m under GPipe (Narayanan et al. SC'21, Sec 2.2); p+1 under DualPipe (DeepSeek-V3
report, Table 2)::

    part 0  |F0......................B0|        alive: F start -> B (or W) end
    part 4       |F0.......B0|                  (interleaved rank 0: chunks 0 and 4)
    sum        1  2        1           0

A split backward (ZB-H1 and ZB-V every one, DualPipe those it queues for its zero-bubble
steps, a custom schedule each W not written right after its B: schedule.core
``split_weight_passes``) changes what is held after B: B frees the activations and keeps,
until W, what W reads, each linear layer's input and output gradient (``wgrad_bytes_per_mb``,
M_W; Qi et al. 2023, arXiv:2401.10241, Sec 2.3 and Appendix G: F adds M_B, B adds M_W - M_B,
W frees M_W). Recompute does not shrink M_W: B recomputes the inputs W keeps. On ZB-H1's
rank r (of p, equal stages) the peak is (p-r) M_B + r M_W while M_W < M_B, the paper's
figure, and (p-r-1) M_B + (r+1) M_W otherwise (full recompute), the moment a B ends before
the oldest held-back W runs::

    rank 1, mb 1  |F1 ........ B1| W0 | F4 | B2 |W1|
    held for mb 1  M_B ..........|M_W ............|

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
  also count (the dispatched states kept for the weight gradients; under FP8 training their
  FP8 copy, half of it, is kept instead): while that transfer runs those bytes are counted
  twice, at most one buffer's worth, against the whole-microbatch allocation at its first
  forward, which already counts every layer not yet run.
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
    rec(t) = sum over parts of B(part, t) x recompute_bytes_per_mb of the part
             (B: microbatches between their first B start and their last B end)
    peak   = params + grads + optimizer + max_t (act(t) + buf(t) + rec(t)) + transient

    compute  |F0|F1|F2|F3|B0|F4|B1| ...
    pp          [s0][s1][s2]  [r0][s3]          s: send act, r: recv grad
    act         1  2  3  4  3 4   3
    buf          +m  +m  +m    +m +m             m = message bytes while a transfer runs

Allocations and frees at the same instant are applied frees first (a slot reused back to back
is one slot). Without buffer-holding communications and recompute, buf(t) = rec(t) = 0 and
the peak is the activation peak. ``transient_bytes`` (ZeRO-3 gathered layers, CP K/V) stays a constant added
at the peak: it is held for moments the trace does not resolve. What a recomputing backward
holds (``PartStatic.recompute_bytes_per_mb``) is placed while its B runs, so a peak that comes while
no B runs (a split backward's, W's inputs held) does not count it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..floats import sum_left
from ..trace import Span, Trace, span_times
from .columns import SpanColumns
from .intervals import instants, rows_sum

TIMELINE_POINTS = 120  # most samples a stage's reported timeline keeps
# a stage that fits with less than this share of the GPU's capacity spare is "tight": what the
# model does not count (the CUDA context, about 0.5-1 GiB; NCCL's and cuBLAS's buffers, 1-3
# GiB; the caching allocator's fragmentation, often 5-10 % of what it holds) can take that much
TIGHT_SHARE = 0.05


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
    wgrad_bytes_per_mb: float = 0.0  # held from B to W under a split backward (transformer.layer_wgrad_bytes)
    recomputed_layers: tuple[int, ...] = ()  # whose forward full recompute runs again (work.recompute_groups)
    expert_params: float = 0.0  # the routed experts' local parameters, apart from ``params``
    recompute_bytes_per_mb: float = 0.0  # held while a B of the part recomputes (work.recompute_held_bytes)


@dataclass(frozen=True)
class StageStatic:
    stage: int
    params: float  # local parameters on one GPU of the stage (all its parts)
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes_per_mb: float  # of its part (the largest part's when it holds several)
    transient_bytes: float = 0.0  # held for a moment (gathered ZeRO-3 units, CP's K/V), added at the peak
    parts: tuple[PartStatic, ...] = ()  # empty: one part, every span belongs to it
    split_w: frozenset = frozenset()  # (index into parts, mb) of each split backward: W's inputs held from B to W
    host_bytes: float = 0.0  # in the host's memory for one GPU of the stage: its offloaded optimizer states and activations


def _part_maps(parts: tuple[PartStatic, ...]) -> tuple[dict[int, int], dict[str, int]]:
    """(layer -> part index, block name -> part index); a layer or block in two parts is an error."""
    by_layer: dict[int, int] = {}
    by_block: dict[str, int] = {}
    for i, p in enumerate(parts):
        for layer in p.layers:
            if by_layer.setdefault(layer, i) != i:
                raise ValueError(f"layer {layer} is in parts {parts[by_layer[layer]].part} and {p.part} of one GPU")
        for name in p.blocks:
            if by_block.setdefault(name, i) != i:
                raise ValueError(f"block {name!r} is in parts {parts[by_block[name]].part} and {p.part} of one GPU")
    return by_layer, by_block


def part_classifier(parts: tuple[PartStatic, ...]) -> Callable[[Span], int] | None:
    """Span -> index into ``parts``; None when there is at most one part (nothing to tell apart)."""
    if len(parts) <= 1:
        return None
    by_layer, by_block = _part_maps(parts)

    def classify(s: Span) -> int:
        if s.layer >= 0:
            return by_layer[s.layer]
        return by_block[s.name.split(" ", 1)[-1]]  # span names are "<phase> <block name>"

    return classify


def _part_index(comp: SpanColumns, pos: np.ndarray, parts: tuple[PartStatic, ...]) -> np.ndarray:
    """:func:`part_classifier` for the compute spans ``pos`` of the view ``comp``, at once (0
    with one part)."""
    if len(parts) <= 1:
        return np.zeros(len(pos), dtype=np.int64)
    by_layer, by_block = _part_maps(parts)
    layer = comp.layer[pos]
    out = np.empty(len(pos), dtype=np.int64)
    has = layer >= 0
    if has.any():
        lut = np.full(max(max(by_layer, default=0), int(layer.max())) + 1, -1, dtype=np.int64)
        for k, i in by_layer.items():
            lut[k] = i
        out[has] = lut[layer[has]]
        if (out[has] < 0).any():
            raise KeyError(int(layer[has][out[has] < 0][0]))  # a layer no part holds
    for i in np.flatnonzero(~has):  # blocks without a layer (embedding, head): a few per microbatch
        out[i] = by_block[comp.spans[pos[i]].name.split(" ", 1)[-1]]  # names are "<phase> <block name>"
    return out


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

    Frees sort before allocations at the same instant (times within INSTANT_S): a slot reused
    back to back is one slot.
    """
    times = [t0 for t0, _ in intervals.values()] + [t1 for _, t1 in intervals.values()]
    at = instants(np.array(times, dtype=float)).tolist()
    n = len(intervals)
    events = sorted([(at[i], 1, part) for i, (part, _) in enumerate(intervals)]
                    + [(at[n + i], -1, part) for i, (part, _) in enumerate(intervals)])
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
            now = sum_left(n * b for n, b in zip(live, bytes_per_mb))
            peak_bytes = max(peak_bytes, now)
    return peak_count, peak_bytes, per_part


def inflight_peak(trace: Trace, rank: int, parts: tuple[PartStatic, ...] = ()) -> int:
    """Most (part, microbatch) activation sets alive at once on ``rank`` (microbatches when it
    holds one part)."""
    n = max(len(parts), 1)
    return peak_live(live_intervals(trace, rank, part_classifier(parts)), [0.0] * n)[0]


def activation_floor_bytes(actions, part_of: Callable[[int], int], bytes_per_mb: list[float],
                           wgrad_bytes_per_mb: list[float] | None = None, split_w: frozenset = frozenset()) -> float:
    """The least activation peak a pipeline rank can have, from its issue order alone, before
    anything is simulated (``actions``: the rank's schedule row; ``part_of``: a virtual
    stage's index into the rank's parts; ``bytes_per_mb``: each part's bytes a microbatch;
    ``split_w`` and ``wgrad_bytes_per_mb``: as :class:`StageStatic` and :class:`PartStatic`
    have them): a microbatch's activations counted from its F to its B, and where its
    backward is split, W's inputs from its B to its W; the most, after each F and each split
    B, of what the parts hold::

        live_j   =  F's of part j issued so far  -  B's of part j issued so far
        held_j   =  split B's of part j issued so far  -  their W's issued so far
        floor    =  max over those points of  sum_j live_j x bytes_j  +  sum_j held_j x wgrad_bytes_j

        1F1B stage 0 of p, m microbatches:  F0 F1 .. F(p-1) B0 F(p) B1 ...  ->  min(p, m) x bytes

    A lower bound of the simulated peak's activations (``_samples``): one compute stream runs
    the row in order, so when an F starts or a B ends every earlier F has started and no later
    B or W has ended. What it leaves out only adds to the peak: a fused W's inputs until its
    end, the buffers of communications in flight, what a recomputing backward holds, an
    overlapped chunk's backward freeing only when the chunk ends."""
    n = len(bytes_per_mb)
    wgrad = wgrad_bytes_per_mb or [0.0] * n
    live, held = [0] * n, [0] * n
    best = 0.0
    for a in actions:
        j = part_of(a.stage)
        if a.kind == "F":
            live[j] += 1
        elif a.kind == "B":
            live[j] -= 1
            if (j, a.mb) not in split_w:
                continue
            held[j] += 1
        elif a.kind == "W" and (j, a.mb) in split_w:
            held[j] -= 1
            continue
        else:
            continue
        # (summed afresh in the memory timeline's order: no drift from running sums)
        total = 0.0
        for k in range(n):
            total += live[k] * bytes_per_mb[k]
        for k in range(n):
            total += held[k] * wgrad[k]
        best = max(best, total)
    return best


@dataclass
class StageTimeline:
    """A rank's memory over the step, as steps: from ``t_s[i]`` until ``t_s[i+1]`` it holds
    ``activations[i]`` + ``buffers[i]`` + ``recomputing[i]`` bytes (after every allocation and
    free at ``t_s[i]``)."""

    t_s: list[float]
    activations: list[float]
    buffers: list[float]
    inflight: int  # most (part, microbatch) sets alive at once
    per_part: list[int]  # most microbatches alive at once on each part
    recomputing: list[float]  # what recomputing backwards hold

    def downsampled(self, points: int = TIMELINE_POINTS) -> "StageTimeline":
        """At most ``points`` samples: the first and the last, and between them the time from
        the second to the next-to-last cut into ``points - 2`` equal bins, each keeping its
        sample with the highest total (the first on ties), so the peak sample survives."""
        total = np.add(np.add(self.activations, self.buffers), self.recomputing)
        idx = _thinned(np.asarray(self.t_s, dtype=float), total, points)
        if idx is None:
            return self
        return StageTimeline([self.t_s[i] for i in idx], [self.activations[i] for i in idx],
                             [self.buffers[i] for i in idx], self.inflight, self.per_part,
                             [self.recomputing[i] for i in idx])


def _peak_index(total: np.ndarray) -> int:
    """The first index of the highest total (0 when empty or when none is above -1)."""
    if not len(total):
        return 0
    i = int(np.argmax(total))  # the first of equal maxima
    return i if total[i] > -1.0 else 0


def _thinned(t: np.ndarray, total: np.ndarray, points: int) -> list[int] | None:
    """Indices :meth:`StageTimeline.downsampled` keeps; None when all are kept. Bin of sample i
    (1 <= i <= n-2), for ``bins = points - 2``::

        k(i) = min(int((t[i] - t[1]) / (t[n-2] - t[1]) * bins), bins - 1)     (0 if t[n-2] == t[1])
    """
    n = len(t)
    if n <= points:
        return None
    bins = points - 2
    inner = np.arange(1, n - 1)
    t0, span = t[1], t[n - 2] - t[1]
    if span > 0:
        k = np.minimum(((t[inner] - t0) / span * bins).astype(np.int64), bins - 1)
    else:
        k = np.zeros(len(inner), dtype=np.int64)
    order = np.lexsort((inner, -total[inner], k))  # per bin: highest total first, then the earliest
    first = np.ones(len(order), dtype=bool)
    first[1:] = k[order[1:]] != k[order[:-1]]
    return [0, *sorted(inner[order[first]].tolist()), n - 1]


@dataclass
class _Samples:
    """A rank's memory timeline as arrays (:class:`StageTimeline`); ``t_raw(i)``: sample i's
    time as the spans hold it (an ``int`` 0 stays one)."""

    t: np.ndarray
    activations: np.ndarray
    buffers: np.ndarray
    inflight: int
    per_part: list[int]
    _src_row: np.ndarray  # per sample: the span whose start or end it is (-1: the added t = 0)
    _src_end: np.ndarray  # per sample: True for the span's end
    _spans: list
    recomputing: np.ndarray  # what backwards recomputing hold (PartStatic.recompute_bytes_per_mb)

    @property
    def total(self) -> np.ndarray:
        return self.activations + self.buffers + self.recomputing

    def t_raw(self, i: int):
        return self.t_raws([i])[0]

    def t_raws(self, samples: list[int]) -> list:
        """:meth:`t_raw` of each of ``samples``, read at once."""
        rows = self._src_row[samples].tolist()
        starts, ends = span_times(self._spans, [max(r, 0) for r in rows])
        return [0.0 if r < 0 else e if at_end else s
                for r, s, e, at_end in zip(rows, starts, ends, self._src_end[samples].tolist())]


def _first_per_key(key: np.ndarray, value: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct keys, for each the position of its smallest value, the earliest on ties)."""
    order = np.lexsort((pos, value, key))
    first = np.ones(len(order), dtype=bool)
    first[1:] = key[order[1:]] != key[order[:-1]]
    return key[order[first]], pos[order[first]]


def _samples(cols: SpanColumns, rows: np.ndarray, parts: tuple[PartStatic, ...],
             split_w: frozenset = frozenset()) -> _Samples:
    """The memory timeline of the spans ``rows`` of ``cols`` (one rank's, in span order).

    Events, sorted as tuples (time, +1 alloc / -1 free, 0 activation / 1 buffer, column /
    buffer bytes), ties in the order they were made: each (part, microbatch)'s allocation at its
    first forward start and free at its last backward or W end (the earliest span on ties), in
    the order of the first forward of each, then each buffer-holding communication's allocation
    and free, in span order. A (part index, microbatch) in ``split_w`` (a split backward:
    schedule ``split_weight_passes``) frees its activations at its last B end instead, where its
    weight-gradient inputs take their place (column ``n_parts + part``) until its last W end::

        part p, mb 3   |F3 ....... B3|   ...   |W3|
        held            activations   wgrad_bytes      (column p, then n_parts + p)

    Where a part recomputes (``recompute_bytes_per_mb``), each (part, microbatch) also holds that
    from its first B start to its last B end (column 2 n_parts + p), summed apart into
    ``recomputing``.

    After all events at one time, a sample::

        activations = 0.0 + live[0] * bytes_per_mb[0] + live[1] * bytes_per_mb[1] + ...
                          (+ live[n_parts + p] * wgrad_bytes_per_mb[p] ..., with split backwards)
        buffers     = 0.0 + size_a * held[size_a] + size_b * held[size_b] + ...  (sizes ascending)
        recomputing = 0.0 + live[2 n_parts] * recompute_bytes_per_mb[0] + ...              (where parts recompute)

    in that order of additions, so every sample is the same float as adding them one by one.
    """
    spans = cols.spans
    nparts = len(parts)
    start, end = cols.start_s[rows], cols.end_s[rows]
    compute = cols.kind[rows] == cols.code("kind", "compute")
    # --- activations: (part, microbatch) alive from its first F start to its last B/W end
    comp = cols.compute
    pos = np.searchsorted(comp.rows, rows[compute])  # the rank's compute spans in that view
    mbs = comp.mb[pos]
    act = np.flatnonzero(compute)[mbs >= 0]  # places in ``rows``
    pos = pos[mbs >= 0]
    part = _part_index(comp, pos, parts)
    mb = comp.mb[pos]
    phase = comp.phase[pos]
    key = part * (int(mb.max(initial=0)) + 1) + mb
    is_f = phase == comp.code("phase", "F")
    is_bw = np.isin(phase, [c for c in (comp.code("phase", "B"), comp.code("phase", "W")) if c >= 0])
    f_key, f_pos = _first_per_key(key[is_f], start[act][is_f], act[is_f])  # earliest start
    b_key, b_pos = _first_per_key(key[is_bw], -end[act][is_bw], act[is_bw])  # latest end
    first_seen = np.full(len(f_key), len(rows), dtype=np.int64)  # a key's first F span: its place in the dict
    np.minimum.at(first_seen, np.searchsorted(f_key, key[is_f]), act[is_f])
    _, fi, bi = np.intersect1d(f_key, b_key, assume_unique=True, return_indices=True)
    seq = np.argsort(first_seen[fi], kind="stable")
    fi, bi = fi[seq], bi[seq]
    n_live = len(fi)
    stride = int(mb.max(initial=0)) + 1
    live_part = f_key[fi] // stride
    free_pos = b_pos[bi]  # where each (part, mb)'s activations go: its last B or W end
    recomputes = np.array([p.recompute_bytes_per_mb for p in parts], dtype=float)
    if n_live and (split_w or recomputes.any()):  # each (part, mb)'s B: where W's inputs or a recompute go
        is_b = phase == comp.code("phase", "B")
        bk, bp = _first_per_key(key[is_b], -end[act][is_b], act[is_b])  # its last B end
    w_col = w_end = w_start = np.zeros(0, dtype=np.int64)
    if split_w and n_live:
        held = np.isin(f_key[fi], [p * stride + m for p, m in split_w if m < stride])  # (others not on this rank)
        held &= np.isin(f_key[fi], bk)
        w_start = bp[np.searchsorted(bk, f_key[fi][held])]
        w_end, w_col = free_pos[held], nparts + live_part[held]
        free_pos = free_pos.copy()
        free_pos[held] = w_start
    n_w = len(w_col)
    # a backward recomputing: from a (part, mb)'s first B start to its last B end, the part's
    # recompute_bytes_per_mb held beside its activations (column 2 * n_parts + part)
    r_col = r_start = r_end = np.zeros(0, dtype=np.int64)
    if n_live and recomputes.any():
        rk, r_start = _first_per_key(key[is_b], start[act][is_b], act[is_b])  # its first B start (keys: bk's)
        held = recomputes[rk // stride] > 0
        r_start, r_end, r_col = r_start[held], bp[held], 2 * nparts + rk[held] // stride
    n_r = len(r_col)
    # --- communication buffers: a pipeline message, an all-to-all's receive buffer
    other = cols.other
    comm = np.flatnonzero(~compute)
    opos = np.searchsorted(other.rows, rows[comm])
    kind = cols.kind[rows[comm]]
    holds = (kind == cols.code("kind", "pp")) | ((kind == cols.code("kind", "ep"))
                                               & (other.op[opos] == other.code("op", "all_to_all")))
    nbytes = np.where(holds, other.size_bytes[opos], 0.0)
    timed = (end[comm] > start[comm]) & (nbytes > 0)
    buf, nbytes = comm[timed], nbytes[timed]
    n_buf = len(buf)
    # --- events, as columns
    n_act = n_live + n_w + n_r
    t = np.concatenate((start[f_pos[fi]], end[w_start], start[r_start], end[free_pos], end[w_end], end[r_end],
                        start[buf], end[buf]))
    d = np.concatenate((np.ones(n_act), -np.ones(n_act), np.ones(n_buf), -np.ones(n_buf))).astype(np.int64)
    what = np.concatenate((np.zeros(2 * n_act, dtype=np.int64), np.ones(2 * n_buf, dtype=np.int64)))
    x = np.concatenate((live_part, w_col, r_col, live_part, w_col, r_col, nbytes, nbytes)).astype(float)
    made = np.concatenate((2 * np.arange(n_act), 2 * np.arange(n_act) + 1,
                           2 * n_act + 2 * np.arange(n_buf), 2 * n_act + 2 * np.arange(n_buf) + 1))
    src_row = rows[np.concatenate((f_pos[fi], w_start, r_start, free_pos, w_end, r_end, buf, buf))]
    src_end = np.concatenate((np.zeros(n_live, bool), np.ones(n_w, bool), np.zeros(n_r, bool), np.ones(n_act, bool),
                              np.zeros(n_buf, bool), np.ones(n_buf, bool)))
    at = instants(t)  # times within INSTANT_S are one instant: frees first there
    order = np.lexsort((made, x, what, d, at))
    t, d, x, src_row, src_end, at = t[order], d[order], x[order], src_row[order], src_end[order], at[order]
    is_act = what[order] == 0
    # --- one sample per instant, after all its events (at the time of its first)
    new = np.ones(len(t), dtype=bool)
    new[1:] = at[1:] != at[:-1]
    first = np.flatnonzero(new)
    g = np.cumsum(new) - 1  # each event's sample
    n = len(first)
    cols_n = 3 * nparts if n_r else 2 * nparts if n_w else max(nparts, 1)
    live = np.zeros((n, cols_n), dtype=np.int64)
    np.add.at(live, (g[is_act], x[is_act].astype(np.int64)), d[is_act])
    live = np.cumsum(live, axis=0)
    terms = [live[:, p] * parts[p].activation_bytes_per_mb for p in range(nparts)]
    if n_w:
        terms += [live[:, nparts + p] * parts[p].wgrad_bytes_per_mb for p in range(nparts)]
    recomputing = rows_sum([live[:, 2 * nparts + p] * parts[p].recompute_bytes_per_mb for p in range(nparts)] if n_r
                           else [], n, 0.0)
    if n_w:
        live = live[:, :nparts] + live[:, nparts:2 * nparts]  # sets alive per part: one from its F to its W
    elif n_r:
        live = live[:, :nparts]
    activations = rows_sum(terms, n, 0.0)
    sizes, which = np.unique(x[~is_act], return_inverse=True)
    held = np.zeros((n, len(sizes)), dtype=np.int64)
    np.add.at(held, (g[~is_act], which), d[~is_act])
    held = np.cumsum(held, axis=0)
    # Python skipped the sizes none held; adding their 0.0 changes no sum, compensated or not
    buffers = rows_sum([size * held[:, j] for j, size in enumerate(sizes.tolist())], n, 0.0)
    inflight = max(int(live.sum(axis=1).max(initial=0)), 0)
    per_part = [max(int(live[:, p].max(initial=0)), 0) for p in range(nparts)]
    src_row, src_end, t = src_row[first], src_end[first], t[first]
    if not n or t[0] > 0:  # nothing held at 0 either: a zero sample first
        t, activations, buffers, recomputing = (np.concatenate(([0.0], a))
                                                for a in (t, activations, buffers, recomputing))
        src_row, src_end = np.concatenate(([-1], src_row)), np.concatenate(([False], src_end))
    return _Samples(t, activations, buffers, inflight, per_part, src_row, src_end, spans, recomputing)


def stage_timeline(spans: list[Span], parts: tuple[PartStatic, ...], split_w: frozenset = frozenset()
                   ) -> StageTimeline:
    """Activations, communication buffers and what recomputing backwards hold over time on one
    rank, from its spans (module docstring), ``split_w`` as :class:`StageStatic`'s. Starts with
    a zero sample at t = 0 when nothing is held then."""
    sm = _samples(SpanColumns(spans), np.arange(len(spans)), parts, split_w)
    return StageTimeline(sm.t_raws(list(range(len(sm.t)))), sm.activations.tolist(), sm.buffers.tolist(),
                         sm.inflight, sm.per_part, sm.recomputing.tolist())


def host_report(statics: list[StageStatic], stage_of_gpu: np.ndarray, gpus_per_node: int,
                capacity_bytes: float) -> dict:
    """Host memory per node under offload: what its GPUs' offloaded states and activations take (each
    GPU its stage's ``host_bytes``; rank g runs on GPU g) against the node's host memory::

        node_bytes = sum over the node's GPUs of host_bytes(stage of the GPU)    fits: max <= capacity

    ``gpu_bytes``: the most one GPU offloads (its stage's ``host_bytes``)."""
    per_stage = np.array([st.host_bytes for st in sorted(statics, key=lambda st: st.stage)])
    nodes = np.bincount(np.arange(len(stage_of_gpu)) // gpus_per_node, weights=per_stage[stage_of_gpu])
    node = int(np.argmax(nodes))
    peak = float(nodes[node])
    return {"capacity_bytes": capacity_bytes, "peak_bytes": peak, "node": node, "margin_bytes": capacity_bytes - peak,
            "fits": peak <= capacity_bytes, "gpu_bytes": float(per_stage.max())}


def memory_report(trace: Trace, statics: list[StageStatic], capacity_bytes: float, host: dict | None = None) -> dict:
    """Per-stage memory (bytes): its peak over the step against the GPU's capacity, and the
    timeline of activations, communication buffers and recomputing that the peak comes from,
    those of the stage's simulated rank whose peak is highest (the first on ties): where a straggler or a
    fault splits a stage's classes, their timings, hence their peaks, differ. ``host``: the
    nodes' host memory under offload (:func:`host_report`), else None; the plan fits
    where every stage and the host fit."""
    stages = []
    ranks_of_stage: dict[int, list[int]] = {}
    for r in trace.ranks:
        ranks_of_stage.setdefault(trace.stage_of.get(r, 0), []).append(r)
    cols = trace.columns()
    order, bounds = cols.rank_groups
    place = {r: i for i, r in enumerate(cols.ranks)}
    for st in statics:
        parts = st.parts or (PartStatic(0, st.params, st.activation_bytes_per_mb),)
        best = None
        for r in ranks_of_stage[st.stage]:
            i = place[r]
            got = _samples(cols, order[bounds[i]:bounds[i + 1]], parts, st.split_w)
            total = got.total
            at = _peak_index(total)
            if best is None or total[at] > best[2][best[3]]:
                best = (r, got, total, at)
        rank, tl, total, at = best
        act = float(tl.activations.max())
        static = st.param_bytes + st.grad_bytes + st.optimizer_bytes
        peak = static + float(total[at]) + st.transient_bytes
        shown = _thinned(tl.t, total, TIMELINE_POINTS)
        if shown is None:
            shown = range(len(tl.t))
        stages.append({
            "stage": st.stage,
            "rank": rank,
            "params": st.params,
            "params_bytes": st.param_bytes,
            "grads_bytes": st.grad_bytes,
            "optimizer_bytes": st.optimizer_bytes,
            "host_bytes": st.host_bytes,
            "activations_bytes": act,
            "activation_bytes_per_microbatch": st.activation_bytes_per_mb,
            "inflight_microbatches": tl.inflight,
            "comm_buffers_bytes": float(tl.buffers[at]),
            "transient_bytes": st.transient_bytes,
            "recomputing_bytes": float(tl.recomputing[at]),
            "peak_bytes": peak,
            "peak_t_s": tl.t_raw(at),
            "capacity_bytes": capacity_bytes,
            "margin_bytes": capacity_bytes - peak,
            "fits": peak <= capacity_bytes,
            "tight": peak <= capacity_bytes < peak + TIGHT_SHARE * capacity_bytes,
            "parts": [{"part": p.part, "params": p.params, "expert_params": p.expert_params,
                       "activation_bytes_per_microbatch": p.activation_bytes_per_mb,
                       "wgrad_bytes_per_microbatch": p.wgrad_bytes_per_mb,
                       "recomputed_layers": list(p.recomputed_layers), "recompute_bytes_per_microbatch": p.recompute_bytes_per_mb,
                       "split_w": sum(1 for i, _ in st.split_w if i == j),
                       "inflight_microbatches": k} for j, (p, k) in enumerate(zip(parts, tl.per_part))],
            "timeline": {"t_s": tl.t_raws(list(shown)), "activations_bytes": tl.activations[shown].tolist(),
                         "comm_buffers_bytes": tl.buffers[shown].tolist(),
                         "recomputing_bytes": tl.recomputing[shown].tolist()},
        })
    tightest = min(stages, key=lambda s: s["margin_bytes"])  # the first on ties
    return {
        "capacity_bytes": capacity_bytes,
        "peak_bytes": max(s["peak_bytes"] for s in stages),
        "margin_bytes": tightest["margin_bytes"],
        "tightest_stage": tightest["stage"],
        "fits": all(s["fits"] for s in stages) and (host is None or host["fits"]),
        "tight": any(s["tight"] for s in stages),
        "tight_below_bytes": TIGHT_SHARE * capacity_bytes,
        "host": host,
        "stages": stages,
    }
