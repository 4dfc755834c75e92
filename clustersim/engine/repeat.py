"""A long 1F1B step's repeating microbatches simulated once: fewer microbatches run, the steady
cycle copied in (1F1B, interleaved 1F1B, ZB-H1, ZB-V, DualPipeV and DualPipe).

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
          window) starting and ending within float rounding of each other (ROUNDING), and nothing
          that started before W3 still runs at the start of W1 (the state at T is the state
          at T - Q, shifted: the simulation is deterministic, so what follows repeats too)

Why it is exact: both programs are the same up to where the m' step runs out of forwards
(T lies a step of microbatches before that, :func:`step_mb`), the cycle repeats (checked over two), and the simulation does
not depend on absolute time. Times differ from a full simulation in their last bits (a copy
adds kQ once where the full step sums k cycles: about 1e-11 s on Megatron-1T's 98 s step).
Where the flow network's shares amplify such bits, as the whole step amplifies its own, they
grow to a nanosecond or more (moe_1024gpu's former PP16 plan at 512 microbatches: 6e-14 s at the cut, at
most 2.2e-7 s on its 253 s step; the step simulated whole with its clock started 1 s later
differs from itself by up to 1.4e-7 s).
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
# how far a window's times may stand from the next one's, per second of time (at least 1 s):
# float rounding, a few hundred ulps at most on the plans measured (Megatron-1T: 6e-14 s at
# 22 s), a quarter of the invariant checks' slack (1e-12 of the time, analysis.invariants),
# which the seam where the copies meet the simulated spans must keep to. A steady state that
# drifts (1.7e-11 s a cycle on one random plan; gpt3_175b_1024gpu's, converging, still 3.8e-12 s
# a cycle at microbatch 230) does not repeat
ROUNDING = 2.5e-13
SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zbv", "dualpipev", "dualpipe")
# simulated with as many microbatches as a third allows, up to SETTLE_WITHIN times the fewest
# (simulated_microbatches): the slowest transients measured end within twice the fewest
# (llama2_70b_64gpu under ZB-V at microbatch 76 of 60, an earlier interleaved plan of
# moe_1024gpu at 73 of 112), and three cycles and a step follow them before the cut; a step of thousands of
# microbatches then simulates a few hundred, not a third of them
SLOW_TO_SETTLE = ("interleaved", "zbv", "dualpipev", "dualpipe")
SETTLE_WITHIN = 3
# fed from both ends: microbatches 0 .. m/2 - 1 enter at the first stage, m/2 .. m - 1 at the
# last (schedule.dualpipe); each half is left out and copied in as a step of its own
TWO_WAYS = ("dualpipe",)


def step_mb(schedule: str, pp: int, group: int | None = None) -> int:
    """Microbatches are left out in multiples of this: 12 (a multiple of the cycles 1F1B
    shows, 1, 2, 4 or 6), and for interleaved 1F1B, which runs microbatches ``group`` (pp by
    default) at a time, two groups: its steady state repeats every group, or every two where
    the groups alternate (an earlier interleaved plan of moe_1024gpu: its first stage's forwards
    came 123.67 and 122.84 ms apart in alternate groups of 8), and m' keeps m's last group."""
    if schedule in TWO_WAYS:
        return 2 * STEP_MB  # 12 of each half
    return 2 * group_mb(schedule, pp, group) if schedule == "interleaved" else STEP_MB


def group_mb(schedule: str, pp: int, group: int | None = None) -> int:
    """What a cycle must be a multiple of for a shorter step to keep the whole step's last
    group: interleaved 1F1B's group (``group``, pp by default), else 1."""
    return (pp if group is None else group) if schedule == "interleaved" else 1


def ways(schedule: str) -> int:
    """2 where microbatches enter the pipeline at both ends (DualPipe: :data:`TWO_WAYS`), else 1."""
    return 2 if schedule in TWO_WAYS else 1


def cycles_mb(step: int) -> list[int]:
    """The cycle lengths tried, shortest first: every divisor of ``step``."""
    return [c for c in range(1, step + 1) if step % c == 0]


@dataclass(frozen=True)
class Repeat:
    """Where the simulated step is cut and how often its cycle is copied in."""

    simulated_mb: int  # microbatches simulated (m')
    cycle_mb: int  # C: microbatches per cycle (of each half, where they enter at both ends)
    period_s: float  # Q: seconds per cycle
    cut_s: float  # T: the simulated step's spans that start before it are kept as they are
    copies: int  # n: cycles copied in after T
    ways: int = 1  # 2: microbatches enter at both ends (:func:`ways`), the second half from m' / 2

    def summary(self) -> dict:
        return {"simulated_microbatches": self.simulated_mb, "cycle_microbatches": self.ways * self.cycle_mb,
                "cycle_s": self.period_s, "cut_s": self.cut_s, "cycles_copied": self.copies}


def fewest_simulated(pp: int, chunks: int, step: int) -> int:
    """The fewest microbatches a shorter step may hold (:func:`simulated_microbatches`)::

        3/2 pp v + (WINDOWS + 1) * step"""
    return (3 * pp * chunks + 1) // 2 + (WINDOWS + 1) * step


def simulated_microbatches(schedule: str, pp: int, m: int, chunks: int = 1, group: int | None = None) -> int | None:
    """How many of a step's ``m`` microbatches to simulate, or None to simulate them all::

        m' = m - n * step  >=  3/2 pp v + (WINDOWS + 1) * step,   n as large as that allows,
        tried only where m' <= m / 3

    (``step``: :func:`step_mb`; ``chunks``, v: the model chunks of a rank a microbatch passes,
    schedule.pipeline.chunks_per_rank: interleaved's vpp, the V schedules' 2, else 1).
    3/2 pp v microbatches cover the warm-up and the transient after it (Megatron-1T's 64
    stages repeat from about microbatch 110, and its cut falls at 121), then the compared
    cycles and a step of margin before the cut. A step whose cycle does not hold is simulated
    again whole: at m' <= m / 3 a cycle found saves at least two thirds of the engine's work
    and one not found costs at most a third more (gpt3_175b_1024gpu's steady state settles to
    within rounding only past about microbatch 250: at 192 microbatches it is not tried, at
    768 its 72 show no cycle), or where a longer cycle held two windows and a second shorter
    step tried it in vain (:func:`longer_cycle`; tried only where the two together hold
    fewer microbatches than the step), less than the whole step more. 1F1B, interleaved
    1F1B, ZB-H1, ZB-V, DualPipeV and DualPipe. DualPipe feeds microbatches from both ends, the
    first half at the first stage, the second at the last: each half is a step of its own, so
    ``step``, the warm-up (3/2 pp for each) and the margin count for both (:data:`TWO_WAYS`;
    :func:`find_cycle` sets the cut on the first half's forwards).

    Interleaved 1F1B, the V schedules and DualPipe (:data:`SLOW_TO_SETTLE`) simulate the most
    microbatches a third allows, up to :data:`SETTLE_WITHIN` times the fewest, instead of the
    fewest: their steady phases repeat every group
    or every microbatch on the plans measured (bench/fuzz_repeat.py), but their transients can
    outlast 3/2 pp v, by as long as a stage takes to work off the backlog the warm-up left it
    (llama2_70b_64gpu under ZB-V: its later stages' forwards come 2.3 ms a microbatch sooner
    than the first stage's until microbatch 52 to 76 of pp=4, so no cycle in 68 microbatches,
    one in 164; an earlier interleaved plan of moe_1024gpu, whose stages were uneven, repeated
    from microbatch 73, past 3/2 pp v = 48, with a cycle of two groups; its PP8 interleaved plan
    of 2026-12-07 never settles to within rounding at 512 microbatches)."""
    if schedule not in SCHEDULES or pp < 2:
        return None
    chunks = max(chunks, ways(schedule))  # (DualPipe: 3/2 pp for each half)
    step = step_mb(schedule, pp, group)
    fewest = fewest_simulated(pp, chunks, step)
    n = (m - fewest) // step
    if schedule in SLOW_TO_SETTLE:
        # the fewest steps left out that keep m' <= m / 3 and m' <= SETTLE_WITHIN x the fewest
        most_x3 = min(m, 3 * SETTLE_WITHIN * fewest)  # (three times the most)
        n = min(n, -(-(3 * m - most_x3) // (3 * step)))
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
            and bool((np.abs(a[3] - b[3]) <= ROUNDING * np.maximum(np.abs(a[3]), 1.0)).all())
            and bool((np.abs(a[4] - b[4]) <= ROUNDING * np.maximum(np.abs(a[4]), 1.0)).all()))


def find_cycle(base: SpanBase, anchor_rank: int, simulated_mb: int, full_mb: int,
               other_starts: np.ndarray = np.zeros(0), step: int = STEP_MB, halves: int = 1,
               tried: list[int] | None = None) -> Repeat | None:
    """The cycle of the simulated step (spans ``base`` of ``simulated_mb`` microbatches) and
    where to cut it, checked as the module docstring says; None if no cycle tried holds.
    ``anchor_rank`` is the first stage's rank: its forwards set the cut, a cycle and a
    margin before its last forward (after which the m' program and the m one differ).
    ``other_starts``: when the run's other records start (``Engine.record_starts``: a
    transfer may start a latency after its span), kept as far from the cut as the spans.
    ``step``: what ``full_mb - simulated_mb`` is a multiple of (:func:`step_mb`); the cycles
    tried divide it, and it is the margin before the last forward.
    ``halves``: 2 where microbatches enter at both ends (DualPipe: :func:`ways`), the first
    half at the anchor's stage: ``step``, the cycles and the margin count each half's
    microbatches (half of ``step``), the cut is set by the first half's forwards, and a
    window's spans move by C microbatches in both halves (the copies hold C of each). The margin is taken on the first
    half only; the second's holds by DualPipe's symmetry (rank r's two parts are r and p-1-r,
    and every rank leaves its steady loop right after its own side's last forward). Were it
    short, the windows or the splice's check of every span's microbatch against its task's
    would refuse the cycle, and the step would be simulated whole.
    ``tried``: the cycle lengths to try instead of ``step``'s divisors (a second shorter
    step's, :func:`longer_cycle`)."""
    anchored = _anchored(base, anchor_rank, simulated_mb, other_starts)
    if anchored is None:
        return None
    first, starts = anchored
    step //= halves
    first = first[:simulated_mb // halves]  # (the second half's forwards follow their own path)
    j = len(first) - 1 - step  # a margin of a step before the last forward
    for c in cycles_mb(step) if tried is None else tried:
        if (full_mb - simulated_mb) % (halves * c):
            continue
        held = _holds(base, first, starts, j, c)
        if held is not None:
            q, cut = held
            return Repeat(simulated_mb, c, q, cut, (full_mb - simulated_mb) // (halves * c), halves)
    return None


def _anchored(base: SpanBase, anchor_rank: int, simulated_mb: int,
              other_starts: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(the starts of the anchor's first forward of each microbatch, every start a cut keeps
    away from: the spans' and ``other_starts``), or None where the anchor did not run every
    microbatch's forward."""
    first = first_forwards(base, anchor_rank)
    if len(first) != simulated_mb or not np.isfinite(first).all():
        return None
    return first, unique(np.concatenate([base.start_s, other_starts]))


def _holds(base: SpanBase, first: np.ndarray, starts: np.ndarray, j: int, c: int,
           windows: int = WINDOWS) -> tuple[float, float] | None:
    """(the period Q, the cut T) where the spans repeat every ``c`` microbatches over
    ``windows`` windows before the anchor's forward ``j`` (``first``: its forwards' starts)
    and nothing older runs into the last, else None (:func:`find_cycle`)."""
    if j - windows * c < 0:
        return None
    q = float(first[j] - first[j - c])
    if not q > 0:
        return None
    cut = _quiet_cut(starts, float(first[j]) - q, float(first[j]), q)
    if cut is None:
        return None
    w1 = _window(base, cut - q, cut, 0.0, 0)
    if not all(_same(w1, _window(base, cut - k * q, cut - (k - 1) * q, (k - 1) * q, (k - 1) * c))
               for k in range(2, windows + 1)):
        return None
    before = base.start_s < cut - windows * q
    if before.any() and float(base.end_s[before].max()) > cut - q:
        return None  # something older than the windows runs into the last: state not seen
    return q, cut


# how long a cycle :func:`longer_cycle` looks for, in steps (:func:`step_mb`)
LONGEST_CYCLE_STEPS = 4


def longer_cycle(base: SpanBase, anchor_rank: int, simulated_mb: int, other_starts: np.ndarray = np.zeros(0),
                 step: int = STEP_MB, halves: int = 1, unit: int = 1) -> int | None:
    """Where :func:`find_cycle` found no cycle among ``step``'s divisors: the shortest cycle,
    up to :data:`LONGEST_CYCLE_STEPS` steps, that the simulated step's last two windows
    hold (:func:`find_cycle` checks three; the microbatches left out need not be a multiple
    of it), else None. A second shorter step, one cycle longer at least and whose left-out
    microbatches are a multiple of it, then checks it over three windows and copies it in
    (Megatron-1T's first stage repeats every 14 microbatches, which 12 does not divide, from
    about microbatch 90: its shorter step of 152 holds two such windows, not three). Only
    lengths whose last two periods of the anchor's forwards agree are checked span by span.
    ``unit``: what a cycle must be a multiple of for the shorter step to keep the whole
    step's last group (interleaved 1F1B's group); DualPipe's two ways (``halves``) are not
    tried."""
    anchored = _anchored(base, anchor_rank, simulated_mb, other_starts) if halves == 1 else None
    if anchored is None:
        return None
    first, starts = anchored
    j = len(first) - 1 - step
    for c in range(unit, LONGEST_CYCLE_STEPS * step + 1, unit):
        if step % c == 0 or j - 2 * c < 0:
            continue  # (tried already)
        periods = first[j - np.arange(2) * c] - first[j - np.arange(1, 3) * c]
        if float(np.ptp(periods)) > ROUNDING * max(1.0, float(first[j])):
            continue
        if _holds(base, first, starts, j, c, windows=2) is not None:
            return c
    return None


def again_microbatches(full_mb: int, simulated_mb: int, cycle_mb: int) -> int | None:
    """The microbatches of a second shorter step for a cycle of ``cycle_mb`` the first one
    (``simulated_mb``) held over two windows but could not copy in: as few as leave out a
    multiple of the cycle and hold a cycle more than the first (room for the third window),
    or None where that leaves nothing out::

        m'' = m - n C,   n = floor((m - m' - C) / C)"""
    n = (full_mb - simulated_mb - cycle_mb) // cycle_mb
    return full_mb - n * cycle_mb if n > 0 else None


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


def spliced_end_s(base: SpanBase, rep: Repeat) -> float:
    """The last end of the spans :func:`splice` makes of ``base`` (where it makes them), from
    the simulated spans alone: a span that starts before the last window keeps its end, one in
    the window (its n-th copy) or after the cut moves by n periods::

        step_s = max( max end over starts < T - Q,  max (end + n Q) over starts >= T - Q )

    the same float operations as the splice's, so the same bits as the spliced spans' last end
    (clustersim.engine.ahead works out the link use over it before the splice is done)."""
    start, end = base.start_s, base.end_s
    if not len(end):
        return 0.0
    stays = start < rep.cut_s - rep.period_s
    moved = end[~stays] + rep.copies * rep.period_s  # (the splice: end + copy * Q, copy = n)
    kept = end[stays]
    return max(float(kept.max()) if len(kept) else -math.inf, float(moved.max()) if len(moved) else -math.inf)


def _in_order(b: SpanBase) -> bool:
    """Whether ``b``'s rows are in :meth:`SpanBase.sorted`'s order (rank, start, end, stream)."""
    r, s, e, st = b.rank, b.start_s, b.end_s, b.stream
    later = (r[1:] > r[:-1]) | ((r[1:] == r[:-1]) & ((s[1:] > s[:-1]) | ((s[1:] == s[:-1]) & (
        (e[1:] > e[:-1]) | ((e[1:] == e[:-1]) & (st[1:] >= st[:-1]))))))
    return bool(later.all())


def _places(base: SpanBase, rep: Repeat) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Where the copies of each simulated span stand among the spliced spans (rank by rank,
    :func:`_rank_major`), from the simulated spans alone: (``p0``, ``w``, ``pre``,
    ``win``) per simulated span, its place before the cut (after it: less ``n w``), its rank's
    window length, whether it starts before the cut and whether in the last window::

        a rank's places   [pre: P spans | window: W spans x n copies | post]   window: pre's last W
        span x            p0(x) = the rank's first place + x's place in its rank
        copy k of x       p0(x) + k W        (after the cut: p0(x) + n W)

    None where the spans are not by rank, then start (the window is then not pre's end), or
    one has no task id (a receive finds its send by id)."""
    rank, start = base.rank, base.start_s
    n = len(rank)
    if not n or int(base.tid.min()) < 0:
        return None
    if not bool(((rank[1:] > rank[:-1]) | ((rank[1:] == rank[:-1]) & (start[1:] >= start[:-1]))).all()):
        return None
    copies = rep.copies
    pre = start < rep.cut_s
    win = pre & (start >= rep.cut_s - rep.period_s)
    lo = np.flatnonzero(np.concatenate(([True], rank[1:] != rank[:-1])))
    size = np.diff(np.append(lo, n))
    n_win = np.add.reduceat(win, lo)
    first = np.concatenate(([0], np.cumsum(size + copies * n_win)[:-1]))  # each rank's first place
    of_rank = np.repeat(np.arange(len(lo)), size)
    return first[of_rank] + np.arange(n) - lo[of_rank], n_win[of_rank], pre, win


def _rank_major(rep: Repeat, places: tuple) -> tuple[np.ndarray, np.ndarray]:
    """(rows, segment) of the step's spans in the order of their places (:func:`_places`):
    rank by rank, a rank's spans before the cut, its window's copies, its spans after;
    segment 0 before the cut, k for the k-th copy, n + 1 after (moved by n periods)."""
    p0, w, pre, win = places
    n = rep.copies
    x = np.arange(len(p0))
    rows = np.empty(len(p0) + n * int(win.sum()), dtype=np.int64)
    seg = np.empty(len(rows), dtype=np.int64)
    at = np.where(pre, p0, p0 + n * w)  # each simulated span once, before the cut or after it
    rows[at] = x
    seg[at] = np.where(pre, 0, n + 1)
    wx = np.flatnonzero(win)
    k = np.arange(1, n + 1)
    at_k = p0[wx][None, :] + k[:, None] * w[wx][None, :]  # the window's k-th copy (copy by copy: in place order)
    rows[at_k] = wx[None, :]
    seg[at_k] = k[:, None]
    return rows, seg


def _lane_order(base: SpanBase, rep: Repeat, places: tuple, own: np.ndarray, lane: np.ndarray) -> np.ndarray | None:
    """The places (:func:`_places`) of the spliced spans of the simulated spans ``own`` (a
    mask), ordered by (``lane``, segment, task id), without sorting the spliced spans. Within a
    lane (one rank's stream) the simulated spans come in start order, which is their tasks'
    id order, so a lane's order is its spans before the cut, its window's n copies, its spans
    after the cut. None where a lane's spans are not in id order (a span of no length tied
    with the next on its stream may not be): the caller sorts them."""
    p0, w, pre, win = places
    copies = rep.copies
    rows = np.flatnonzero(own)
    rows = rows[stable_argsort(lane[rows])]  # by lane, then in start order
    ln, t = lane[rows], base.tid[rows]
    new = np.concatenate(([True], ln[1:] != ln[:-1]))
    if not bool((new[1:] | (t[1:] > t[:-1])).all()):
        return None
    starts = np.flatnonzero(new)
    length = np.diff(np.append(starts, len(rows)))
    b = np.add.reduceat(win[rows], starts)  # per lane: spans in the window
    block = length + copies * b
    out0 = np.concatenate(([0], np.cumsum(block)[:-1]))  # each lane's first place in the order
    of_lane = np.repeat(np.arange(len(starts)), length)
    i = np.arange(len(rows)) - starts[of_lane]  # place in the lane
    is_pre = pre[rows]
    order = np.empty(int(block.sum()), dtype=np.int64)
    order[out0[of_lane] + i + np.where(is_pre, 0, copies * b[of_lane])] = p0[rows] + np.where(is_pre, 0, copies * w[rows])
    wr = np.flatnonzero(win[rows])  # the window's copies, k = 1 .. n, after the lane's spans before the cut
    k = np.arange(1, copies + 1)
    lw = of_lane[wr]
    at = (out0[lw] + b[lw] + i[wr])[:, None] + (k - 1)[None, :] * b[lw][:, None]  # a + (k - 1) b + (i - (a - b))
    order[at.ravel()] = (p0[rows[wr]][:, None] + k[None, :] * w[rows[wr]][:, None]).ravel()
    return order


def splice(base: SpanBase, rep: Repeat, short_tasks, full_tasks) -> SpanBase | None:
    """The full step's spans from the simulated step's ``base`` (module docstring), with the
    full program's task ids; ``short_tasks`` and ``full_tasks`` are the two programs'
    :class:`~clustersim.analysis.columns.TaskColumns`. None where a span does not land on a
    task of its rank, stream and microbatch."""
    q, c = rep.period_s, rep.cycle_mb
    places = _places(base, rep)
    if places is None:
        return None
    rows, seg = _rank_major(rep, places)
    copy = np.minimum(seg, rep.copies)
    rank, form, old_tid = base.rank[rows], base.form[rows], base.tid[rows]
    mb = base.mb[rows]
    # the second half's ids start n C later in the step than in the shorter one (m / 2 =
    # m' / 2 + n C; its copies also move by k C, as the first half's do)
    second = mb >= rep.simulated_mb // 2 if rep.ways == 2 else None
    np.add(mb, copy * c, out=mb, where=mb >= 0)
    if second is not None:
        mb[second] += rep.copies * c
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
    own_s = (base.rank == short_tasks.rank[base.tid]) & (code_in_short[base.stream] == short_tasks.stream[base.tid])
    own = own_s[rows]
    mine = np.flatnonzero(own)
    # i-th span of a (rank, stream) = its i-th task: spans in (segment, old id) order there
    n_streams = len(names) + 1
    lanes = (base.rank - int(base.rank.min())) * n_streams + code_in_full[base.stream]
    o_sp = _lane_order(base, rep, places, own_s, lanes)
    if o_sp is None:
        o_sp = mine[np.lexsort((old_tid[mine], seg[mine], lanes[rows[mine]]))]
    o_full = full_tasks.stream_order  # (rank, stream) in the order of the names: as lane orders
    if len(o_sp) != len(o_full) or not (np.array_equal(rank[o_sp], full_tasks.rank[o_full])
                                        and np.array_equal(code_in_full[stream[o_sp]], full_tasks.stream[o_full])):
        return None
    tid = np.full(len(rows), -1, dtype=np.int64)
    tid[o_sp] = o_full
    if not np.array_equal(full_tasks.mb[tid[mine]], mb[mine]):
        return None
    # a send's receive carries the send's id: the one its send got in the same segment (the
    # send before the cut, in the window or after it as the receive is)
    others = np.flatnonzero(~own)
    if len(others):
        p0, w, pre, win = places
        own_rows = np.flatnonzero(own_s)
        send = np.full(int(base.tid.max()) + 1, -1, dtype=np.int64)
        send[base.tid[own_rows]] = own_rows
        if not np.array_equal(send[base.tid[own_rows]], own_rows):
            return None  # (two spans of one task on its own rank and stream)
        x, sg = send[old_tid[others]], seg[others]
        k = np.minimum(sg, rep.copies)
        if not bool((x >= 0).all()):
            return None
        same = np.where(sg == 0, pre[x], np.where(sg > rep.copies, ~pre[x], win[x]))
        if not bool(same.all()):
            return None
        tid[others] = tid[p0[x] + k * w[x]]
    out = replace(base, spans=None, rank=rank, stream=stream, start_s=start, end_s=end, tid=tid, mb=mb, form=form)
    return out if _in_order(out) else out.sorted()  # (a copy's starts, rounded, may tie)
