"""Interval arithmetic on [start, end) spans: union length, difference length."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, merged, non-overlapping intervals (touching ones merge; empty ones drop).

    Sorted by start, an interval opens a new run when it starts after the running maximum of
    the ends before it (numpy: one sort and one cumulative maximum)."""
    arr = np.array(intervals if isinstance(intervals, list) else list(intervals), dtype=float).reshape(-1, 2)
    arr = arr[arr[:, 1] > arr[:, 0]]
    if len(arr) == 0:
        return []
    arr = arr[np.lexsort((arr[:, 1], arr[:, 0]))]
    ends = np.maximum.accumulate(arr[:, 1])
    opens = np.empty(len(arr), dtype=bool)
    opens[0] = True
    opens[1:] = arr[1:, 0] > ends[:-1]
    first = np.nonzero(opens)[0]
    last = np.append(first[1:] - 1, len(arr) - 1)
    return list(zip(arr[first, 0].tolist(), ends[last].tolist()))


def length(merged: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in merged)


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
