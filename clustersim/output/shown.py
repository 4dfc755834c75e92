"""Which ranks the report's timeline draws when the trace holds more than it can show.

A browser draws each row's label once per layout pass, and each pass is as slow as the
page is large: 1,152 rows (128 ranks) over 27,000 bars took 80 s to appear in Chromium,
2,592 rows (288 ranks) 343 s, 576 rows (64 ranks) 26 s; without the labels, 11 s for the
1,152. A run of every rank of 1,024 GPUs (9,216 rows) never appeared. So past
MAX_TIMELINE_RANKS ranks the timeline shows a choice of them, and trace.json.gz all::

    stage 0   ranks alike -> one shown        ranks that differ -> the latest and the
    stage 1   (same streams, spans, busy      earliest to finish first, then the next
    ...        time and end on each row)      ones, stage after stage in turn

Ranks whose every row has the same span count, busy time and end are one kind: its first
rank is drawn and the others are its *aliases*, on whose rows the critical path is drawn
where it crosses them (an every-rank run's path hops between DP peers that behave the
same). Kinds are taken from each stage in turn, the one that ends last first, then the one
that ends first, the second last, the second first..., until MAX_TIMELINE_RANKS are shown.
The stages take their turns spread over the pipeline (first, last, middle, quarters...), so
that past MAX_TIMELINE_RANKS stages those drawn still span it. Ranks without spans have no
rows and are not drawn.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import zip_longest

import numpy as np

from .perfetto import SpanOrder

# ranks the timeline draws at most: 64 ranks of 9 streams drew in 26 s where 128 took 80 s
# (above); Megatron-1T's 64 stages of one rank each (443 rows) draw in 14 s
MAX_TIMELINE_RANKS = 64
# times within this share of the step are taken as equal when telling kinds of rank apart
ALIKE_SHARE = 1e-9


@dataclass(frozen=True)
class Shown:
    """The timeline's choice: ``ranks`` drawn (display order), of ``of`` in the trace;
    ``alias``: hidden rank -> the drawn rank of its kind; ``kinds``: how many kinds the ranks
    with spans make; ``stages``: how many stages have a rank drawn, of ``of_stages``."""

    ranks: list[int]
    of: int
    alias: dict[int, int]
    kinds: int = 0
    stages: int = 0
    of_stages: int = 0


def _row_stats(order: SpanOrder) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of ``order``: its spans, their busy time (the sum of durations) and the
    latest end (0.0 for a row without spans)."""
    bounds = np.asarray(order.bounds, dtype=np.int64)
    n_spans = np.diff(bounds)
    busy = np.concatenate(([0.0], np.cumsum(order.end_s - order.start_s)))
    busy_s = busy[bounds[1:]] - busy[bounds[:-1]]
    last_s = np.zeros(len(n_spans))
    full = n_spans > 0
    if full.any():
        last_s[full] = np.maximum.reduceat(order.end_s, bounds[:-1][full])
    return n_spans, busy_s, last_s


def _extremes_first(kinds: list[tuple[float, int]]) -> list[int]:
    """Kinds ``(end_s, rank)`` as latest, earliest, second latest, second earliest..."""
    latest = sorted(kinds, key=lambda k: (-k[0], k[1]))
    out: list[int] = []
    for a, b in zip_longest(latest, latest[::-1]):
        for k in (a, b):
            if k is not None and k[1] not in out:
                out.append(k[1])
        if len(out) == len(latest):
            break
    return out


def spread(n: int) -> list[int]:
    """0 .. n-1 in an order that covers the range evenly at every length: the ends, the
    middle, the quarters...: ``spread(9) == [0, 8, 4, 2, 6, 1, 3, 5, 7]``."""
    if n <= 2:
        return list(range(n))
    out, spans = [0, n - 1], [(0, n - 1)]
    while spans:
        nxt = []
        for a, b in spans:
            if b - a > 1:
                mid = (a + b) // 2
                out.append(mid)
                nxt += [(a, mid), (mid, b)]
        spans = nxt
    return out


def shown_ranks(order: SpanOrder, stage_of: dict[int, int], most: int = MAX_TIMELINE_RANKS) -> Shown:
    """The ranks the timeline draws (see the module docstring); every rank while there
    are no more than ``most``."""
    ranks = list(order.by_rank)
    if len(ranks) <= most:
        n_stages = len({stage_of.get(r, 0) for r in ranks})
        return Shown(ranks, len(ranks), {}, len(ranks), n_stages, n_stages)
    n_spans, busy_s, last_s = _row_stats(order)
    quantum_s = max(order.last_end_s, 1e-30) * ALIKE_SHARE
    busy_q = np.rint(busy_s / quantum_s).tolist()
    last_q = np.rint(last_s / quantum_s).tolist()
    n_list = n_spans.tolist()
    kind_of: dict[tuple, int] = {}  # kind -> its first rank
    first_of: dict[int, int] = {}  # rank -> its kind's first rank
    end_of: dict[int, float] = {}
    i = 0
    for r in ranks:
        streams = order.by_rank[r]
        rows = range(i, i + len(streams))
        i += len(streams)
        if not streams:  # no spans: no rows to draw
            continue
        key = (stage_of.get(r, 0), *((st, n_list[j], busy_q[j], last_q[j]) for st, j in zip(streams, rows)))
        first_of[r] = kind_of.setdefault(key, r)
        end_of[r] = max((float(last_s[j]) for j in rows), default=0.0)
    by_stage: dict[int, list[tuple[float, int]]] = {}
    for first in kind_of.values():
        by_stage.setdefault(stage_of.get(first, 0), []).append((end_of[first], first))
    stages = sorted(by_stage)
    turns = [_extremes_first(by_stage[stages[k]]) for k in spread(len(stages))]
    picked: set[int] = set()
    for round_ in zip_longest(*turns):
        for r in round_:
            if r is not None and len(picked) < most:
                picked.add(r)
    shown = [r for r in ranks if r in picked]
    alias = {r: f for r, f in first_of.items() if r not in picked and f in picked}
    n_stages = len({stage_of.get(r, 0) for r in ranks})
    return Shown(shown, len(ranks), alias, len(kind_of), len({stage_of.get(r, 0) for r in shown}), n_stages)


def only_ranks(order: SpanOrder, ranks: list[int]) -> SpanOrder:
    """``order`` cut to the rows of ``ranks`` (a subsequence of its ranks), the step's end
    kept."""
    keep = set(ranks)
    rows, pieces, bounds = [], [], [0]
    for i, row in enumerate(order.rows):
        if row[0] in keep:
            rows.append(row)
            lo, hi = order.bounds[i], order.bounds[i + 1]
            pieces.append(np.arange(lo, hi, dtype=np.int64))
            bounds.append(bounds[-1] + hi - lo)
    at = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    return SpanOrder(rows=rows, by_rank={r: order.by_rank[r] for r in ranks}, index_array=order.index_array[at],
                     bounds=bounds, start_s=order.start_s[at], end_s=order.end_s[at], last_end_s=order.last_end_s)
