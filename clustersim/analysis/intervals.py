"""Interval arithmetic on [start, end) spans: union length, difference length."""

from __future__ import annotations

from collections.abc import Iterable


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, merged, non-overlapping intervals."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


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
