"""Sums of floats that come out the same on every Python the project runs on.

From Python 3.12, ``sum()`` of floats compensates rounding (Neumaier's method; "What's New
In Python 3.12"), so the same floats in the same order can add to a last bit apart from
3.10's and 3.11's. A task's duration a bit apart moves an event by 1e-16 s, and where two
events are due at the same instant that is enough to swap them: the DeepSeek-V3 scenario's
step came out 0.56 ms (3.6e-5 of it) longer under 3.11 than under 3.13. Every sum of floats
that feeds the simulated timeline or the summary adds left to right with :func:`sum_left`
(the analysis's vectorised sums the same way: analysis.intervals), so the timeline and
summary.json are the same bit for bit on each of them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import reduce
from operator import add


def sum_left(xs: Iterable, start=0):
    """``((start + x0) + x1) + ...``, each addition rounded as it comes: Python's ``sum()``
    up to 3.11, on every version (ints stay ints)."""
    return reduce(add, xs, start)


def digits(x: float) -> float:
    """``x`` to nine significant digits: what ranks equal figures as equal where their last
    bits differ (summed in another order, by a collapsed run's twins or a copied-in cycle)."""
    return float(f"{x:.8e}")


def three_digits(x: float) -> str:
    """``x`` to three significant digits, its trailing zeros kept so that figures side by side
    read to the same precision: "1.00", "3.60", "812", "0.500" (``f"{x:.3g}"`` writes "1",
    "3.6"); as ``.3g`` gives it where it writes an exponent."""
    text = f"{x:.3g}"
    if x == 0 or not math.isfinite(x) or "e" in text:
        return text
    shown = len(text.lstrip("-").replace(".", "").lstrip("0"))
    if shown >= 3:
        return text
    return text + ("" if "." in text else ".") + "0" * (3 - shown)
