"""The timeline at a coarser level of detail, for steps whose bars a browser cannot draw quickly.

A 1T-parameter step (Narayanan et al. 2021: 3,072 GPUs, 64 stages, 512 microbatches) has
~900k spans that merge into ~260k bars. Chromium takes minutes to lay that many SVG bars out,
and at full width a bar is under a pixel anyway. Past BAR_BUDGET bars, each row is cut into
bins of equal length (TIMELINE_BINS across the step: about a pixel of the full-width view),
and runs of bins are drawn::

    spans of one row   FFF BBBBBB FFF BBBBBB FFF BBBBBB     F 34 ms, B 70 ms each
    bins of 95 ms     |F 33 B 62 |F 34 B 61 |F 33 B 62 |    busy ms per group, exact overlap
    dominant group     B          B          B              most busy time in the bin
    bar                [============ B, 99 % busy ======]   one run of bins, one bar

A bar is a run of adjacent bins of one row with the same dominant group. It is coloured by
that group, faded by its busy share like a merged bar (time where spans of a row overlap,
as on a receive stream, counts once), and its hover gives the mix
("backward compute 65 % · forward compute 35 %"), the microbatches and the span count. Busy
time is kept: a row's bars add up to the length of the union of its spans, and a bar's group
is the one with the most busy time inside it (it has the most in every one of its bins).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

BAR_BUDGET = 30_000  # bars drawn at most: ~24k draw in seconds, 260k (Megatron-1T) in minutes
TIMELINE_BINS = 1_000  # bins per row across the step, before coarsening to fit BAR_BUDGET
CHUNK_SPANS = 65_536  # spans binned at once (whole rows): see binned_bars
MB_LISTED = 4  # a bar's microbatches named one by one up to this many; past it, how many and their range


def covered_before(row: np.ndarray, end_s: np.ndarray) -> np.ndarray:
    """Per span (by row, then start): the latest end of the spans before it in its row, -inf
    for a row's first span."""
    out = np.full(len(row), -np.inf)
    firsts = np.flatnonzero(np.diff(row, prepend=-1)) if len(row) else np.zeros(0, dtype=np.int64)
    for lo, hi in zip(firsts.tolist(), [*firsts[1:].tolist(), len(row)]):
        out[lo + 1:hi] = np.maximum.accumulate(end_s[lo:hi - 1])
    return out


def bar_count(row: np.ndarray, key: np.ndarray, start_s: np.ndarray, end_s: np.ndarray, max_gap_s: float) -> int:
    """How many bars merging spans gives, at least (all arrays in display order: by row, then
    start)::

        a bar starts at a row's first span, where the key (kind, phase, microbatch) changes,
        or after an idle gap > max_gap_s behind the latest end so far in the row

    The latest end is taken over the whole row, not the open bar, so where spans of one
    stream overlap this may count fewer bars than merging makes, never more.
    """
    n = len(row)
    if n == 0:
        return 0
    new = np.ones(n, dtype=bool)
    new[1:] = (row[1:] != row[:-1]) | (key[1:] != key[:-1]) | (start_s[1:] - covered_before(row, end_s)[1:] > max_gap_s)
    return int(new.sum())


@dataclass(frozen=True)
class BinnedBars:
    """Runs of bins, one entry per bar, by row and by time within a row."""

    row: np.ndarray  # int64
    group: np.ndarray  # int64: the dominant group, an index into the caller's groups
    start_s: np.ndarray  # float64: earliest span time inside the run
    end_s: np.ndarray  # latest span time inside the run
    busy_s: np.ndarray  # time inside the run when the row has a span (overlaps once)
    group_busy_s: np.ndarray  # (bars, groups): busy_s split by group
    n_spans: np.ndarray  # int64: spans starting inside the run
    mb_lo: np.ndarray  # int64: smallest microbatch of a span inside, -1 if none has one
    mb_hi: np.ndarray
    n_mbs: np.ndarray  # int64: how many microbatches the spans inside belong to (0: none has one)
    mbs: np.ndarray  # int64 (bars, MB_LISTED): the first MB_LISTED of those microbatches, ascending, -1 past them
    bin_s: float  # length of one bin

    @property
    def dur_s(self) -> np.ndarray:
        return self.end_s - self.start_s


def _bin_range(start_s: np.ndarray, end_s: np.ndarray, bin_s: float, n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Each span's first and last bin (the bins its pieces may fall in)."""
    first = np.clip(np.floor(start_s / bin_s), 0, n_bins - 1).astype(np.int64)
    last = np.maximum(np.clip(np.floor(end_s / bin_s), 0, n_bins - 1).astype(np.int64), first)
    return first, last


def _pieces(start_s: np.ndarray, end_s: np.ndarray, bin_s: float, n_bins: int
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each span cut at the bin edges: (span index, bin, lo, hi) per piece. Pieces of no
    length are dropped, except a span of no length (it stays as a piece in its bin)."""
    first, last = _bin_range(start_s, end_s, bin_s, n_bins)
    count = last - first + 1
    span = np.repeat(np.arange(len(start_s)), count)
    k = first[span] + np.arange(len(span)) - np.repeat(np.cumsum(count) - count, count)
    # the outer bins reach to +-inf, so no span time is lost to the edges' rounding
    edge_lo = np.where(k == 0, -np.inf, k * bin_s)
    edge_hi = np.where(k == n_bins - 1, np.inf, (k + 1) * bin_s)
    lo = np.maximum(start_s[span], edge_lo)
    hi = np.minimum(end_s[span], edge_hi)
    keep = (hi > lo) | (count == 1)[span]
    return span[keep], k[keep], lo[keep], hi[keep]


def _cells(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``np.unique(ids, return_inverse=True)``, and where each cell's pieces begin when
    ``ids`` is already in order (pieces of a row whose spans do not reach back into an
    earlier bin, as in most rows): then without a sort, and the per-cell minima and maxima
    are ``reduceat`` over those runs instead of ``ufunc.at`` (0.1 s a call on Megatron-1T's
    980,000 pieces, whose times rise within a cell; 0.005 s on random values over the same
    cells), with the same results (a minimum or a maximum is exact in any order). ``None``:
    not in order."""
    if len(ids) and bool((ids[1:] >= ids[:-1]).all()):
        new = np.ones(len(ids), dtype=bool)
        new[1:] = ids[1:] != ids[:-1]
        firsts = np.flatnonzero(new)
        return ids[firsts], np.cumsum(new) - 1, firsts
    cells, cell = np.unique(ids, return_inverse=True)
    return cells, cell, None


def _per_cell(op: np.ufunc, values: np.ndarray, cell: np.ndarray, firsts: np.ndarray | None, initial, m: int
              ) -> np.ndarray:
    """``op`` (np.minimum or np.maximum) of each cell's ``values`` (every cell has pieces;
    ``initial``: the identity of ``op`` on them, for ``ufunc.at``)."""
    if firsts is not None:
        return op.reduceat(values, firsts)
    out = np.full(m, initial, dtype=values.dtype)
    op.at(out, cell, values)
    return out


def binned_bars(row: np.ndarray, group: np.ndarray, mb: np.ndarray, start_s: np.ndarray, end_s: np.ndarray,
                n_groups: int, t_end_s: float, n_bins: int, chunk: int = CHUNK_SPANS) -> BinnedBars:
    """Bin every row into ``n_bins`` bins over [0, t_end_s] and join runs of bins (see the
    module's docstring). Arrays are per span, in display order (by row, then start).

    Rows are binned apart from each other, so they are binned in chunks of whole rows of
    about ``chunk`` spans and the chunks' bars put end to end: the same bars, with working
    arrays small enough to be reused from one chunk to the next (Megatron-1T's 918,852 spans
    at once made 980,000 pieces and a dozen arrays of them, each new memory: its first
    binning took 0.35 s, 0.18 s in chunks)."""
    n = len(row)
    if n <= chunk:
        return _binned_rows(row, group, mb, start_s, end_s, n_groups, t_end_s, n_bins)
    ends = np.flatnonzero(row[1:] != row[:-1]) + 1  # where each row but the first begins
    cuts = [0]
    while cuts[-1] < n:  # a chunk ends at the first row start at least ``chunk`` spans on
        i = int(np.searchsorted(ends, cuts[-1] + chunk))
        cuts.append(int(ends[i]) if i < len(ends) else n)
    parts = [_binned_rows(row[a:b], group[a:b], mb[a:b], start_s[a:b], end_s[a:b], n_groups, t_end_s, n_bins)
             for a, b in zip(cuts, cuts[1:])]
    joined = {f.name: np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(BinnedBars)
              if f.name != "bin_s"}
    return BinnedBars(**joined, bin_s=parts[0].bin_s)


def _binned_rows(row: np.ndarray, group: np.ndarray, mb: np.ndarray, start_s: np.ndarray, end_s: np.ndarray,
                 n_groups: int, t_end_s: float, n_bins: int) -> BinnedBars:
    """:func:`binned_bars` of whole rows at once."""
    bin_s = t_end_s / n_bins if t_end_s > 0 else 1.0
    span, k, lo, hi = _pieces(start_s, end_s, bin_s, n_bins)
    # busy time counts a stretch of a row once, as merging does: a span is busy only from the
    # latest end before it on (spans of a receive stream overlap), in its own group
    busy_from = np.maximum(start_s, covered_before(row, end_s))[span]
    piece_busy = np.maximum(hi - np.maximum(lo, busy_from), 0.0)
    cells, cell, firsts = _cells(row[span] * n_bins + k)  # cells sorted: by row, then bin
    m = len(cells)
    if not m:
        none_f, none_i = np.zeros(0), np.zeros(0, dtype=np.int64)
        return BinnedBars(none_i, none_i, none_f, none_f, none_f, np.zeros((0, n_groups)), none_i, none_i, none_i,
                          none_i, np.zeros((0, MB_LISTED), dtype=np.int64), bin_s)
    cg = cell * n_groups + group[span]
    busy_cg = np.bincount(cg, weights=piece_busy, minlength=m * n_groups).reshape(m, n_groups)
    count_cg = np.bincount(cg, minlength=m * n_groups).reshape(m, n_groups)
    busy = busy_cg.sum(axis=1)
    # a bin holding only spans of no length is shown in the group of most of them
    dominant = np.where(busy > 0, busy_cg.argmax(axis=1), count_cg.argmax(axis=1))
    first_piece = np.flatnonzero(np.diff(span, prepend=-1))  # pieces come span by span
    n_spans = np.bincount(cell[first_piece], minlength=m)
    span_mb = mb[span]
    no_mb = np.iinfo(np.int64).max
    cell_lo = _per_cell(np.minimum, lo, cell, firsts, np.inf, m)
    cell_hi = _per_cell(np.maximum, hi, cell, firsts, -np.inf, m)
    mb_lo = _per_cell(np.minimum, np.where(span_mb >= 0, span_mb, no_mb), cell, firsts, no_mb, m)
    mb_hi = _per_cell(np.maximum, np.where(span_mb >= 0, span_mb, -1), cell, firsts, -1, m)

    cell_row, cell_bin = np.divmod(cells, n_bins)
    new = np.ones(m, dtype=bool)
    new[1:] = (cell_row[1:] != cell_row[:-1]) | (cell_bin[1:] != cell_bin[:-1] + 1) | (dominant[1:] != dominant[:-1])
    runs = np.flatnonzero(new)
    run_mb_lo = np.minimum.reduceat(mb_lo, runs)
    run_mb_lo[run_mb_lo == no_mb] = -1
    n_mbs, mbs = _microbatches_of_runs(np.cumsum(new)[cell] - 1, span_mb, len(runs))
    return BinnedBars(
        row=cell_row[runs], group=dominant[runs], start_s=cell_lo[runs], end_s=np.maximum.reduceat(cell_hi, runs),
        busy_s=np.add.reduceat(busy, runs), group_busy_s=np.add.reduceat(busy_cg, runs, axis=0),
        n_spans=np.add.reduceat(n_spans, runs), mb_lo=run_mb_lo, mb_hi=np.maximum.reduceat(mb_hi, runs),
        n_mbs=n_mbs, mbs=mbs, bin_s=bin_s)


def _microbatches_of_runs(run: np.ndarray, mb: np.ndarray, n_runs: int) -> tuple[np.ndarray, np.ndarray]:
    """Per run of bins, how many microbatches its pieces (``run``, ``mb`` per piece; -1: none)
    belong to, and the first MB_LISTED of them, ascending (-1 past them): a bar of
    microbatches 0 and 68 is not one of 0 to 68 (the smallest and largest alone said so)."""
    has = mb >= 0
    width = int(mb.max(initial=0)) + 1
    keys = run[has] * width + mb[has]
    # neighbouring pieces are mostly of one span or microbatch: their repeats go before the sort
    # (a tenth of the pieces left on GPT-3's step)
    keys = keys[np.r_[True, keys[1:] != keys[:-1]]] if len(keys) else keys
    pairs = np.unique(keys)  # each (run, microbatch) once, by run then microbatch
    pair_run, pair_mb = np.divmod(pairs, width)
    n_mbs = np.bincount(pair_run, minlength=n_runs)
    nth = np.arange(len(pairs)) - (np.cumsum(n_mbs) - n_mbs)[pair_run]  # its place among its run's
    mbs = np.full((n_runs, MB_LISTED), -1, dtype=np.int64)
    listed = nth < MB_LISTED
    mbs[pair_run[listed], nth[listed]] = pair_mb[listed]
    return n_mbs, mbs


def runs_at_least(row: np.ndarray, start_s: np.ndarray, end_s: np.ndarray, t_end_s: float, n_bins: int) -> int:
    """A lower bound on the bars :func:`binned_bars` makes with ``n_bins`` bins, without cutting
    the spans: the runs of adjacent bins that spans reach, row by row (arrays in display
    order: by row, then start)::

        bins        0  1  2  3  4  5  6  7
        spans      [--)  [-----)        [-)      each from its first bin to its last
        runs       [-----------)        [-)      2: a run opens past an empty bin

    A bar is a run of adjacent bins of one row with the same dominant group, so there are at
    least as many bars as runs of bins with pieces in them. A span's pieces fill its bins
    from first to last but for the first or the last where its piece there has no length;
    counting those bins too can only join two runs (they touch the span's other bins),
    never open one, so the count stays a lower bound. Megatron-1T at 1,000 bins: 82,000
    runs for 83,221 bars, in a tenth of the time the bars take."""
    if not len(row):
        return 0
    bin_s = t_end_s / n_bins if t_end_s > 0 else 1.0  # as binned_bars
    first, last = _bin_range(start_s, end_s, bin_s, n_bins)
    reach = covered_before(row, last)  # the last bin reached so far in the row (-inf: its first span)
    return int((first > reach + 1).sum())  # (first bins ascend in a row: spans come by start)


def binned_within(row: np.ndarray, group: np.ndarray, mb: np.ndarray, start_s: np.ndarray, end_s: np.ndarray,
                  n_groups: int, t_end_s: float, budget: int = BAR_BUDGET, n_bins: int = TIMELINE_BINS
                  ) -> BinnedBars:
    """:func:`binned_bars` with ``n_bins`` halved until at most ``budget`` bars come out
    (rows x bins bounds the bars, so this ends; one bin per row is the coarsest). A number of
    bins whose runs alone are more than ``budget`` (:func:`runs_at_least`) is passed over
    without making its bars: the same bars come out."""
    while True:
        if n_bins > 1 and runs_at_least(row, start_s, end_s, t_end_s, n_bins) > budget:
            n_bins = max(1, n_bins // 2)
            continue
        bars = binned_bars(row, group, mb, start_s, end_s, n_groups, t_end_s, n_bins)
        if len(bars.row) <= budget or n_bins == 1:
            return bars
        n_bins = max(1, n_bins // 2)
