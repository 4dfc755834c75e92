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

from dataclasses import dataclass, field

import numpy as np

from ..floats import sum_left
from .intervals import Arrays, seq_sum

DEP_KINDS = ("pp", "tp", "cp", "ep", "dp", "offload", "compute")
WINDOW = 8  # spans starting exactly when a gap ends that are looked at to tell its cause
# two times of one step that lie within this share of the step of each other are equal but
# for rounding: GPUs of equal work whose spans' times were summed in other orders (a
# collapsed run's twins against every rank's), as metrics._per_stage picks a stage's GPU
SAME_SHARE = 1e-9


@dataclass(frozen=True)
class BubbleSplit:
    bubble_s: float
    warm_up_s: float
    cool_down_s: float
    imbalance_s: float
    dependency_s: dict[str, float] = field(default_factory=dict)  # per DEP_KINDS, plus "total"


def _overlap(a: np.ndarray, b: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Length of each [a, b) inside [lo, hi): max(0, min(b, hi) - max(a, lo))."""
    x = np.minimum(b, hi) - np.maximum(a, lo)
    return np.where(x > 0.0, x, 0.0)


def gaps(busy: Arrays, step_s: float) -> Arrays:
    """The idle gaps in [0, step] around the merged ``busy`` intervals, as (starts, ends)::

        busy     [--)    [---)  [-)
        gaps  [--)  [----)   [--) [----)   (the first from 0, the last to the step's end)
    """
    lo, hi = busy
    t = np.maximum.accumulate(np.concatenate(([0.0], hi)))  # t[i]: the latest end before busy[i]
    before = lo > t[:-1]
    tail = step_s > t[-1]
    return (np.concatenate((t[:-1][before], t[-1:] if tail else [])),
            np.concatenate((lo[before], [step_s] if tail else [])))


def split_bubble(starts: np.ndarray, kinds: np.ndarray, kind_codes: dict[str, int], busy: Arrays, step_s: float,
                 compute_s: float, max_compute_s: float, pipelined: bool, first_b: float | None,
                 last_f: float | None) -> BubbleSplit:
    """Split one rank's bubble (see the module docstring).

    ``starts``/``kinds``: the starts and kind codes of all the rank's spans, sorted by start,
    then kind (in the text order of the kind names); ``kind_codes``: the code of each of
    ``DEP_KINDS`` (-1: none). ``busy``: the merged intervals of its compute and communication;
    ``compute_s`` its compute busy time, ``max_compute_s`` the busiest rank's. ``first_b``: its
    first backward's start, ``last_f`` its last forward's end (None: none)."""
    ga, gb = gaps(busy, step_s)
    bubble = seq_sum(gb - ga, 0)
    if pipelined and first_b is not None and last_f is not None:
        warm_end, cool_start = first_b, max(last_f, first_b)
    else:
        warm_end = float(busy[0][0]) if len(busy[0]) else step_s
        cool_start = float(busy[1][-1]) if len(busy[1]) else step_s
    w = _overlap(ga, gb, 0.0, warm_end)
    c = _overlap(ga, gb, max(cool_start, warm_end), step_s)
    warm, cool = seq_sum(w, 0.0), seq_sum(c, 0.0)
    mid = (gb - ga) - w - c
    steady = mid > 0
    dep = dict.fromkeys(DEP_KINDS, 0.0)
    if steady.any():
        ends, mid = gb[steady], mid[steady]
        # what ends the gap: the kinds among the first WINDOW spans (by start, then kind) that
        # start exactly then; a communication kind, in DEP_KINDS order, else compute
        at = np.searchsorted(starts, ends, side="left")
        cause = np.full(len(ends), len(DEP_KINDS) - 1)
        for j in range(len(DEP_KINDS) - 2, -1, -1):  # the earliest in DEP_KINDS wins: written last
            code = kind_codes[DEP_KINDS[j]]
            if code < 0:
                continue
            seen = np.zeros(len(ends), dtype=bool)
            for off in range(WINDOW):
                pos = np.minimum(at + off, len(starts) - 1)
                seen |= (at + off < len(starts)) & (starts[pos] == ends) & (kinds[pos] == code)
            cause[seen] = j
        for j, k in enumerate(DEP_KINDS):
            dep[k] = seq_sum(mid[cause == j], 0.0)
    steady_s = sum_left(dep.values())
    # (the busiest rank's compute less this one's: none where the two are equal but for rounding)
    short_s = max_compute_s - compute_s
    imb = min(bubble, short_s) if short_s > SAME_SHARE * step_s else 0.0
    take_steady = min(imb, steady_s)
    if steady_s > 0:
        dep = {k: v * (1 - take_steady / steady_s) for k, v in dep.items()}
    rest = imb - take_steady
    ends_s = warm + cool
    if rest > 0 and ends_s > 0:
        left = max(0.0, 1 - rest / ends_s)  # (rest may pass ends_s by a rounding: no -1e-17 s)
        warm, cool = warm * left, cool * left
    return BubbleSplit(bubble_s=bubble, warm_up_s=warm, cool_down_s=cool, imbalance_s=imb,
                       dependency_s={**dep, "total": sum_left(dep.values())})
