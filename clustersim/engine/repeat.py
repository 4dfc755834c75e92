"""A long 1F1B step's repeating microbatches simulated once: fewer microbatches run, the steady
cycle copied in (1F1B, interleaved 1F1B and ZB-H1).

After its warm-up, a 1F1B pipeline settles into a cycle: every C microbatches each stage runs
the same forwards, backwards, TP all-reduces and PP sends, a period Q later, on the same links
(bench/steady_state.py measures it: Megatron-1T's 512 microbatches repeat every 6, 0.986 s).
A step of m microbatches is then the step of m' = m - n C microbatches with n more cycles in
its middle. clustersim simulates the m' step (warm-up, a few cycles, cool-down), finds its
cycle, checks it, and copies it in::

    simulated (m')   [warm-up ........ |W3|W2|W1| post: last cycles, cool-down, optimizer]
                                                 T
    the step (m)     [warm-up ........ |W3|W2|W1|W1+Q|W1+2Q| ... |W1+nQ| post + nQ        ]
                                                  microbatches + C, + 2C, ... ;  post: + nC

    W_k   the spans that start in [T - kQ, T - (k-1)Q)
    kept  only if W3 + 2Q, W2 + Q and W1 are the same spans (rank, form, microbatch + C per
          window) starting and ending within INSTANT_S (1 ns) of each other, and nothing
          that started before W3 still runs at the start of W1 (the state at T is the state
          at T - Q, shifted: the simulation is deterministic, so what follows repeats too)

Why it is exact: both programs are the same up to where the m' step runs out of forwards
(T lies a step of microbatches before that, :func:`step_mb`), the cycle repeats (checked over two), and the simulation does
not depend on absolute time. Times differ from a full simulation in their last bits (a copy
adds kQ once where the full step sums k cycles: about 1e-11 s on Megatron-1T's 95 s step).
The spans then take the full program's task ids: a stream runs its tasks in list order, so
the i-th span on a (rank, stream) is that stream's i-th task; each one's microbatch is
checked against its task's. Anything that does not hold gives None, and the caller simulates
every microbatch instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ..trace import INSTANT_S, SpanBase, stable_argsort, unique

STEP_MB = 12  # 1F1B leaves microbatches out in multiples of this: every cycle tried divides it
WINDOWS = 3  # cycles compared: the last one before T and the two before it
SCHEDULES = ("1f1b", "interleaved", "zb-h1")  # DualPipe: see simulated_microbatches


def step_mb(schedule: str, pp: int) -> int:
    """Microbatches are left out in multiples of this: 12 (a multiple of the cycles 1F1B
    shows, 1, 2, 4 or 6), and for interleaved 1F1B, which runs microbatches pp at a time and
    repeats every pp, the least multiple of 12 and pp (so m' stays a multiple of pp too)."""
    return math.lcm(STEP_MB, pp) if schedule == "interleaved" else STEP_MB


def cycles_mb(step: int) -> list[int]:
    """The cycle lengths tried, shortest first: every divisor of ``step``."""
    return [c for c in range(1, step + 1) if step % c == 0]


@dataclass(frozen=True)
class Repeat:
    """Where the simulated step is cut and how often its cycle is copied in."""

    simulated_mb: int  # microbatches simulated (m')
    cycle_mb: int  # C: microbatches per cycle
    period_s: float  # Q: seconds per cycle
    cut_s: float  # T: the simulated step's spans that start before it are kept as they are
    copies: int  # n: cycles copied in after T

    def summary(self) -> dict:
        return {"simulated_microbatches": self.simulated_mb, "cycle_microbatches": self.cycle_mb,
                "cycle_s": self.period_s, "cut_s": self.cut_s, "cycles_copied": self.copies}


def simulated_microbatches(schedule: str, pp: int, m: int, vpp: int = 1) -> int | None:
    """How many of a step's ``m`` microbatches to simulate, or None to simulate them all::

        m' = m - n * step  >=  3/2 pp vpp + (WINDOWS + 1) * step,   n as large as that allows,
        tried only where m' <= m / 3

    (``step``: :func:`step_mb`). 3/2 pp vpp microbatches cover the warm-up and the transient
    after it (Megatron-1T's 64 stages repeat from about microbatch 110, and its cut falls at
    121), then the compared cycles and a step of margin before the cut. A step whose cycle
    does not hold is simulated again whole: at m' <= m / 3 a cycle found saves at least two
    thirds of the engine's work and one not found costs at most a third more
    (gpt3_175b_1024gpu's steady state drifts by 2e-5 s a cycle and never repeats: at 192
    microbatches it is not tried). Only 1F1B, interleaved 1F1B and ZB-H1: DualPipe feeds
    microbatches from both ends, and its first stage's forwards, which set the cut, cover
    half of them; no cycle is found there, so it is not tried."""
    if schedule not in SCHEDULES or pp < 2:
        return None
    step = step_mb(schedule, pp)
    floor = (3 * pp * vpp + 1) // 2 + (WINDOWS + 1) * step
    n = (m - floor) // step
    short = m - n * step
    return short if n > 0 and 3 * short <= m else None


def first_forwards(base: SpanBase, rank: int) -> np.ndarray:
    """Start of each microbatch's first forward compute span on ``rank`` (inf: none)."""
    fwd = np.array([f.stream == "compute" and f.phase == "F" for f in base.forms], dtype=bool)
    sel = fwd[base.form] & (base.rank == rank) & (base.mb >= 0)
    mb, start = base.mb[sel], base.start_s[sel]
    out = np.full(int(mb.max()) + 1 if len(mb) else 0, np.inf)
    order = np.lexsort((start, mb))  # per microbatch, the earliest first
    mb, start = mb[order], start[order]
    first = np.ones(len(mb), dtype=bool)
    first[1:] = mb[1:] != mb[:-1]
    out[mb[first]] = start[first]
    return out


def _quiet_cut(starts: np.ndarray, lo: float, hi: float, period_s: float) -> float | None:
    """A cut in [lo, hi] as far from every span start as can be, at the cut and at the window
    edges below it (T - kQ): a start a rounding error away from an edge would fall in one
    window in one cycle and in the next in another."""
    inside = starts[(starts >= lo) & (starts <= hi)]
    if len(inside) < 2:
        return None
    cand = (inside[:-1] + inside[1:]) / 2
    ext = np.concatenate([[-np.inf], starts, [np.inf]])
    gap = np.full(len(cand), np.inf)
    for k in range(WINDOWS + 1):
        at = cand - k * period_s
        i = np.searchsorted(starts, at)
        gap = np.minimum(gap, np.minimum(at - ext[i], ext[i + 1] - at))
    best = int(np.argmax(gap))
    return float(cand[best]) if gap[best] > 2 * INSTANT_S else None


def _window(base: SpanBase, lo: float, hi: float, shift_s: float, shift_mb: int) -> tuple[np.ndarray, ...]:
    """The spans that start in [lo, hi), moved by ``shift_s`` and ``shift_mb``, in a canonical
    order: (rank, form, mb, start, end)."""
    sel = np.flatnonzero((base.start_s >= lo) & (base.start_s < hi))
    rank, form = base.rank[sel], base.form[sel]
    mb = base.mb[sel]
    mb = np.where(mb >= 0, mb + shift_mb, mb)
    start, end = base.start_s[sel] + shift_s, base.end_s[sel] + shift_s
    order = np.lexsort((start, mb, form, rank))
    return rank[order], form[order], mb[order], start[order], end[order]


def _same(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> bool:
    if len(a[0]) != len(b[0]) or not len(a[0]):
        return False
    return (all(np.array_equal(x, y) for x, y in zip(a[:3], b[:3]))
            and float(np.abs(a[3] - b[3]).max()) <= INSTANT_S and float(np.abs(a[4] - b[4]).max()) <= INSTANT_S)


def find_cycle(base: SpanBase, anchor_rank: int, simulated_mb: int, full_mb: int,
               other_starts: np.ndarray = np.zeros(0), step: int = STEP_MB) -> Repeat | None:
    """The cycle of the simulated step (spans ``base`` of ``simulated_mb`` microbatches) and
    where to cut it, checked as the module docstring says; None if no cycle tried holds.
    ``anchor_rank`` is the first stage's rank: its forwards set the cut, a cycle and a
    margin before its last forward (after which the m' program and the m one differ).
    ``other_starts``: when the run's other records start (``Engine.record_starts``: a
    transfer may start a latency after its span), kept as far from the cut as the spans.
    ``step``: what ``full_mb - simulated_mb`` is a multiple of (:func:`step_mb`); the cycles
    tried divide it, and it is the margin before the last forward."""
    first = first_forwards(base, anchor_rank)
    if len(first) != simulated_mb or not np.isfinite(first).all():
        return None
    starts = unique(np.concatenate([base.start_s, other_starts]))
    j = simulated_mb - 1 - step  # a margin of a step before the last forward
    for c in cycles_mb(step):
        if (full_mb - simulated_mb) % c:
            continue
        if j - WINDOWS * c < 0:
            continue
        q = float(first[j] - first[j - c])
        if not q > 0:
            continue
        cut = _quiet_cut(starts, float(first[j]) - q, float(first[j]), q)
        if cut is None:
            continue
        w1 = _window(base, cut - q, cut, 0.0, 0)
        if not all(_same(w1, _window(base, cut - k * q, cut - (k - 1) * q, (k - 1) * q, (k - 1) * c))
                   for k in range(2, WINDOWS + 1)):
            continue
        before = base.start_s < cut - WINDOWS * q
        if before.any() and float(base.end_s[before].max()) > cut - q:
            continue  # something older than the windows runs into the last: state not seen
        return Repeat(simulated_mb, c, q, cut, (full_mb - simulated_mb) // c)
    return None


def spliced_times(times: np.ndarray, rep: Repeat) -> tuple[np.ndarray, np.ndarray]:
    """(rows, copy): which of ``times`` (starts, cut as the spans are) make the step, in the
    order before the cut, the last window ``n`` times, after the cut; and how many periods
    each moves (the k-th copy of the window by k, the rows after the cut by n)."""
    cut, q, n = rep.cut_s, rep.period_s, rep.copies
    pre = np.flatnonzero(times < cut)
    win = np.flatnonzero((times >= cut - q) & (times < cut))
    post = np.flatnonzero(times >= cut)
    rows = np.concatenate([pre, np.tile(win, n), post])
    copy = np.concatenate([np.zeros(len(pre), np.int64), np.repeat(np.arange(1, n + 1), len(win)),
                           np.full(len(post), n, np.int64)])
    return rows, copy


def _rank_major(base: SpanBase, rep: Repeat) -> tuple[np.ndarray, np.ndarray]:
    """(rows, segment) of the step's spans rank by rank, in the order the sorted simulated
    spans give (a rank's spans before the cut, its window's copies, its spans after): segment
    0 before the cut, k for the k-th copy, n + 1 after (moved by n periods)."""
    rank = base.rank
    bounds = np.flatnonzero(np.diff(rank)) + 1
    rows, segs = [], []
    for lo, hi in zip([0, *bounds.tolist()], [*bounds.tolist(), len(rank)]):
        r, sg = spliced_times(base.start_s[lo:hi], rep)
        sg[len(r) - int((base.start_s[lo:hi] >= rep.cut_s).sum()):] = rep.copies + 1
        rows.append(r + lo)
        segs.append(sg)
    return np.concatenate(rows), np.concatenate(segs)


def _in_order(b: SpanBase) -> bool:
    """Whether ``b``'s rows are in :meth:`SpanBase.sorted`'s order (rank, start, end, stream)."""
    r, s, e, st = b.rank, b.start_s, b.end_s, b.stream
    later = (r[1:] > r[:-1]) | ((r[1:] == r[:-1]) & ((s[1:] > s[:-1]) | ((s[1:] == s[:-1]) & (
        (e[1:] > e[:-1]) | ((e[1:] == e[:-1]) & (st[1:] >= st[:-1]))))))
    return bool(later.all())


def _lanes_in_order(lane: np.ndarray, seg: np.ndarray, tid: np.ndarray) -> np.ndarray | None:
    """The order that sorts spans by (lane, segment, task id), found by sorting the lanes
    alone, where that is enough, else None. The spans come rank by rank, segment by segment,
    each in start order (:func:`_rank_major`), and a stream starts its tasks in id order, so
    within a lane they are mostly in (segment, id) order already: a stable sort of the lanes
    (a radix sort in numpy, as int16) keeps it, and is checked to have (a zero-length span
    tied with the next on its stream may not)."""
    if not len(lane) or int(lane.max()) >= 2**15:
        return None
    order = np.argsort(lane.astype(np.int16), kind="stable")
    ln, sg, t = lane[order], seg[order], tid[order]
    same = ln[1:] == ln[:-1]
    up = (sg[1:] > sg[:-1]) | ((sg[1:] == sg[:-1]) & (t[1:] > t[:-1]))
    return order if bool((up | ~same).all()) else None


def splice(base: SpanBase, rep: Repeat, short_tasks, full_tasks) -> SpanBase | None:
    """The full step's spans from the simulated step's ``base`` (module docstring), with the
    full program's task ids; ``short_tasks`` and ``full_tasks`` are the two programs'
    :class:`~clustersim.analysis.columns.TaskColumns`. None where a span does not land on a
    task of its rank, stream and microbatch."""
    q, c = rep.period_s, rep.cycle_mb
    rows, seg = _rank_major(base, rep)
    copy = np.minimum(seg, rep.copies)
    rank, form, old_tid = base.rank[rows], base.form[rows], base.tid[rows]
    mb = base.mb[rows]
    np.add(mb, copy * c, out=mb, where=mb >= 0)
    start, end = base.start_s[rows], base.end_s[rows]
    shift = copy * q
    start += shift
    end += shift
    stream = base.stream[rows]
    # the span's stream as the task columns number it
    names = list(full_tasks.stream_names)
    code_in_full = np.array([names.index(s) if s in names else -1 for s in base.stream_names], dtype=np.int64)
    short_names = list(short_tasks.stream_names)
    code_in_short = np.array([short_names.index(s) if s in short_names else -1 for s in base.stream_names],
                             dtype=np.int64)
    # per simulated span, once: whether it is its task's own (on the task's rank and stream;
    # else a receive, placed by its send below) and its (rank, stream) lane
    own = ((base.rank == short_tasks.rank[base.tid]) & (code_in_short[base.stream] == short_tasks.stream[base.tid]))[rows]
    mine = np.flatnonzero(own)
    # i-th span of a (rank, stream) = its i-th task: spans in (segment, old id) order there
    n_streams = len(names) + 1
    lane = ((base.rank - int(base.rank.min())) * n_streams + code_in_full[base.stream])[rows[mine]]
    o_sp = _lanes_in_order(lane, seg[mine], old_tid[mine])
    if o_sp is not None:
        o_sp = mine[o_sp]
    elif (int(lane.max(initial=0)) + 1) * (rep.copies + 2) * (int(old_tid.max(initial=0)) + 1) < 2**62:
        o_sp = mine[np.argsort((lane * (rep.copies + 2) + seg[mine]) * (int(old_tid.max()) + 1) + old_tid[mine])]
    else:  # (one key would not fit in 64 bits)
        o_sp = mine[np.lexsort((old_tid[mine], seg[mine], lane))]
    o_full = full_tasks.stream_order  # (rank, stream) in the order of the names: as lane orders
    if len(o_sp) != len(o_full) or not (np.array_equal(rank[o_sp], full_tasks.rank[o_full])
                                        and np.array_equal(code_in_full[stream[o_sp]], full_tasks.stream[o_full])):
        return None
    tid = np.full(len(rows), -1, dtype=np.int64)
    tid[o_sp] = o_full
    if not np.array_equal(full_tasks.mb[tid[mine]], mb[mine]):
        return None
    # a send's receive carries the send's id: the one its send got in the same segment
    others = np.flatnonzero(~own)
    if len(others):
        width = rep.copies + 2
        key = old_tid[mine] * width + seg[mine]
        order = stable_argsort(key)  # (by radix: a million keys below 2**32)
        want = old_tid[others] * width + seg[others]
        at = np.searchsorted(key[order], want)
        at = np.minimum(at, len(order) - 1)
        if not np.array_equal(key[order][at], want):
            return None
        tid[others] = tid[mine][order][at]
    out = replace(base, spans=None, rank=rank, stream=stream, start_s=start, end_s=end, tid=tid, mb=mb, form=form)
    return out if _in_order(out) else out.sorted()  # (a copy's starts, rounded, may tie)
