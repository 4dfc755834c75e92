"""The bubble taken apart: warm-up, cool-down, waiting on a dependency, and imbalance.

A rank's bubble is the time its compute stream idles with none of its own communication in
flight (:mod:`.metrics`). Each idle gap is placed by where it falls in the rank's schedule::

    stage 1 of 1F1B   idle   F F F  idle  B F B F B F  idle  B  idle  B   idle
                     |<-- warm-up (before the first B) -->|<- steady ->|<-- cool-down -->|
                                                          (after the last F, and the first B)

    warm-up     gaps before the rank's first backward starts (the pipeline filling)
    cool-down   gaps after its last forward ends and its first backward started (draining),
                and the idle tail before the step ends
    dependency  gaps in between: waiting on another rank, told apart by what ends the gap
                (a pipeline transfer arriving: ``pp``; a collective whose last member
                arrives: ``tp``/``cp``/``ep``/``dp``; a compute task: ``compute``)
    imbalance   min(bubble, W_max - W_r): the idle time rank r cannot avoid because the
                busiest rank computes W_max - W_r longer than it does (uneven stages, the
                embedding and LM head, a straggler, unbalanced CP). It is counted first out
                of the steady-state gaps, then out of warm-up and cool-down in proportion.

Without pipeline parallelism there is no fill or drain: warm-up is idle before the rank's
first task, cool-down its idle tail. With free communication and equal stages under 1F1B,
stage s has warm-up s·F + (p-1-s)·B and cool-down (p-1-s)·F + s·B, together the textbook
(p-1)(F+B) (Narayanan et al. SC'21, Sec 2.2); under GPipe warm-up s·F + (p-1-s)(F+B) and
cool-down s·B.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from ..trace import Span

DEP_KINDS = ("pp", "tp", "cp", "ep", "dp", "compute")


@dataclass(frozen=True)
class BubbleSplit:
    bubble_s: float
    warm_up_s: float
    cool_down_s: float
    imbalance_s: float
    dependency_s: dict[str, float] = field(default_factory=dict)  # per DEP_KINDS, plus "total"


def _overlap(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


def split_bubble(spans: list[Span], busy: list[tuple[float, float]], step_s: float, compute_s: float,
                 max_compute_s: float, pipelined: bool) -> BubbleSplit:
    """Split one rank's bubble (see the module docstring); ``busy``: the merged intervals of
    all its spans, ``compute_s`` its compute busy time, ``max_compute_s`` the busiest rank's."""
    gaps, t = [], 0.0
    for a, b in busy:
        if a > t:
            gaps.append((t, a))
        t = max(t, b)
    if step_s > t:
        gaps.append((t, step_s))
    bubble = sum(b - a for a, b in gaps)
    comp = [s for s in spans if s.kind == "compute"]
    first_b = min((s.start_s for s in comp if s.phase == "B"), default=None)
    last_f = max((s.end_s for s in comp if s.phase == "F"), default=None)
    if pipelined and first_b is not None and last_f is not None:
        warm_end, cool_start = first_b, max(last_f, first_b)
    else:
        warm_end = busy[0][0] if busy else step_s
        cool_start = busy[-1][1] if busy else step_s
    starts = sorted((s.start_s, s.kind) for s in spans)
    keys = [x for x, _ in starts]
    warm = cool = 0.0
    dep = dict.fromkeys(DEP_KINDS, 0.0)
    for a, b in gaps:
        w = _overlap(a, b, 0.0, warm_end)
        c = _overlap(a, b, max(cool_start, warm_end), step_s)
        warm += w
        cool += c
        mid = (b - a) - w - c
        if mid > 0:
            i = bisect_left(keys, b)
            kinds = {k for x, k in starts[i:i + 8] if x == b}  # what ends the gap
            cause = next((k for k in DEP_KINDS if k in kinds and k != "compute"), "compute")
            dep[cause] += mid
    steady = sum(dep.values())
    imb = min(bubble, max(0.0, max_compute_s - compute_s))
    take_steady = min(imb, steady)
    if steady > 0:
        dep = {k: v * (1 - take_steady / steady) for k, v in dep.items()}
    rest = imb - take_steady
    ends = warm + cool
    if rest > 0 and ends > 0:
        warm, cool = warm * (1 - rest / ends), cool * (1 - rest / ends)
    return BubbleSplit(bubble_s=bubble, warm_up_s=warm, cool_down_s=cool, imbalance_s=imb,
                       dependency_s={**dep, "total": sum(dep.values())})
