"""Interval arithmetic on [start, end) spans: union length, difference length.

Two forms: lists of (start, end) tuples (``union``, ``length``, ``minus_length``), and pairs
of numpy arrays ``(lo, hi)`` for the large traces (``merged``, ``seq_sum``, ``minus_pieces``).
Both give the same numbers to the last bit: a merged set of intervals has one form (its
endpoints are endpoints of the inputs), and every sum adds the same floats in the same order
the same way: left to right, one rounding per addition, as ``floats.sum_left`` adds (Python's
``sum`` up to 3.11, on every version): ``seq_sum`` for an array, ``rows_sum`` for rows of them.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ..floats import sum_left
from ..trace import INSTANT_S

Arrays = tuple[np.ndarray, np.ndarray]


def instants(t: np.ndarray) -> np.ndarray:
    """Each time's instant, numbered in time order: sorted, a time within INSTANT_S of the one
    before it is that one's instant (a chain of such times is one)."""
    order = np.argsort(t, kind="stable")
    new = np.ones(len(t), dtype=np.int64)
    new[1:] = np.diff(t[order]) > INSTANT_S
    out = np.empty(len(t), dtype=np.int64)
    out[order] = np.cumsum(new) - 1
    return out


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, merged, non-overlapping intervals (touching ones merge; empty ones drop).

    Sorted by start, an interval opens a new run when it starts after the running maximum of
    the ends before it (numpy: one sort and one cumulative maximum)."""
    arr = np.array(intervals if isinstance(intervals, list) else list(intervals), dtype=float).reshape(-1, 2)
    lo, hi = merged(arr[:, 0], arr[:, 1])
    return list(zip(lo.tolist(), hi.tolist()))


def merged(lo: np.ndarray, hi: np.ndarray, presorted: bool = False, join_s: float = 0.0) -> Arrays:
    """``union`` on arrays: the merged intervals as (starts, ends). ``presorted``: ``lo``
    already ascends (any order among equal starts gives the same result). ``join_s``: an
    interval that starts at most this long after the ones before it end joins them (a gap
    that short is none)::

        sorted by start   [0,2) [1,3) [5,6) [6,7)
        running max end     2     3     6     7
        opens a run         y     n     y     n      (start > running max before it)
        merged            [0,3)       [5,7)
    """
    keep = hi > lo
    lo, hi = lo[keep], hi[keep]
    if not len(lo):
        return lo, hi
    if not presorted:
        order = np.argsort(lo, kind="stable")
        lo, hi = lo[order], hi[order]
    ends = np.maximum.accumulate(hi)
    opens = np.empty(len(lo), dtype=bool)
    opens[0] = True
    np.greater(lo[1:], ends[:-1] + join_s if join_s else ends[:-1], out=opens[1:])
    first = np.flatnonzero(opens)
    return lo[first], ends[np.append(first[1:] - 1, len(lo) - 1)]


def seq_sum(x: np.ndarray, start=0.0):
    """``total = start; for v in x: total += v``: left to right, one rounding per addition
    (numpy's ``sum`` adds pairwise and may differ in the last bit; a cumulative sum runs left
    to right). Empty: ``start`` itself."""
    if not len(x):
        return start
    acc = np.empty(len(x) + 1)
    acc[0] = start
    acc[1:] = x
    return float(np.cumsum(acc)[-1])


def rows_sum(terms: list[np.ndarray], n: int, start: float = 0.0) -> np.ndarray:
    """``sum_left(t[i] for t in terms)`` from ``start``, for every i < n at once: left to
    right, one rounding per addition."""
    f = np.full(n, float(start))
    for x in terms:
        f = f + x
    return f


def length(merged: list[tuple[float, float]]) -> float:
    return sum_left(b - a for a, b in merged)


def merged_length(iv: Arrays):
    """``length`` of merged arrays: ``sum(end - start)`` in order (the int 0 when empty, as
    ``length`` gives)."""
    return seq_sum(iv[1] - iv[0], 0)


def minus_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of (union a) minus (union b); both already merged and sorted."""
    total, j = 0.0, 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                total += b[k][0] - cur
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            total += e - cur
    return total


def minus_pieces(a: Arrays, b: Arrays) -> np.ndarray:
    """Lengths of the pieces of ``a`` not covered by ``b`` (both merged), in time order: the
    pieces ``minus_length`` adds up. Each piece is an ``a`` interval cut to a gap of ``b``::

        a        [--------)      [----)
        b           [--)   [--------)
        gaps of b  )   [---)          [---...
        pieces   [--)  [--)           [-)
    """
    (alo, ahi), (blo, bhi) = a, b
    glo = np.concatenate(([-np.inf], bhi))  # gap k runs from the end of b[k-1] to the start of b[k]
    ghi = np.concatenate((blo, [np.inf]))
    first = np.searchsorted(ghi, alo, side="right")  # the first gap ending after a starts
    last = np.searchsorted(glo, ahi, side="left")  # past the last gap starting before a ends
    count = np.maximum(last - first, 0)
    ia = np.repeat(np.arange(len(alo)), count)
    ig = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count) + np.repeat(first, count)
    lo = np.maximum(alo[ia], glo[ig])
    hi = np.minimum(ahi[ia], ghi[ig])
    return (hi - lo)[hi > lo]


def minus_length_arrays(a: Arrays, b: Arrays) -> float:
    """``minus_length`` on merged arrays, to the same bit."""
    if not len(a[0]):  # (nothing to take from: what seq_sum gives an empty piece list)
        return 0.0
    return seq_sum(minus_pieces(a, b), 0.0)
