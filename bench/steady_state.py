"""How periodic a step's steady state is, stage by stage: the intervals between the starts of
consecutive microbatches' first forward compute, the shortest cycle they repeat with, and the
period per microbatch over that cycle.

    python bench/steady_state.py bench/scenarios/megatron_1t_3072.yaml
    python bench/steady_state.py scenarios/llama2_70b_64gpu.yaml --every 1

Every microbatch is simulated (``repeat=False``: a step whose cycle was copied in would repeat
by construction); under DualPipe each half of the microbatches, fed from its own end, is
measured apart (``rank/half``).

A simulator that repeated a steady pattern of microbatches, instead of simulating, analysing
and writing every one, would rest on such a cycle (docs/performance.md, "Targets and where they
stand": what 3 s for Megatron-1T would take). This measures whether clustersim's own timeline
has one and how long it is::

    interval(mb) = start of mb's first forward compute - start of mb-1's       (one stage)
    cycle        = the smallest c with interval(mb + c) == interval(mb) over the steady window
    period       = mean interval over one cycle

Per stage it prints the cycle that covers the longest stretch of microbatches (the warm-up and
cool-down of the pipeline, and any transient, fall outside it). Intervals are compared rounded
to a nanosecond: the same pattern lands on sums whose last bits differ from one cycle to the
next.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clustersim.api import simulate  # noqa: E402
from clustersim.engine.repeat import first_forwards, ways  # noqa: E402

MAX_CYCLE = 64


def first_forward_starts(trace) -> dict[int, np.ndarray]:
    """Per simulated rank, the start of each microbatch's first forward compute span, by
    microbatch (NaN where a microbatch has none on that rank): what the repeat's cycle finder
    reads on the first stage (clustersim.engine.repeat.first_forwards), for every rank."""
    base = trace.current_base()
    found = {r: first_forwards(base, r) for r in sorted(set(base.rank.tolist()))}
    found = {r: f for r, f in found.items() if len(f)}  # ranks with a forward compute span
    n_mb = max(map(len, found.values()), default=0)
    out = {}
    for r, f in found.items():
        first = np.full(n_mb, np.nan)
        first[:len(f)] = np.where(np.isinf(f), np.nan, f)
        out[r] = first
    return out


def cycle_of(intervals: np.ndarray) -> tuple[int, int, int] | None:
    """The cycle that covers the longest stretch of ``intervals``: (c, first, last) with
    intervals[i + c] == intervals[i] for first <= i < last - c, the stretch [first, last) as
    long as any c <= MAX_CYCLE gives (the smallest such c), or None when none covers two cycles."""
    best = None
    for c in range(1, min(MAX_CYCLE, len(intervals) // 2) + 1):
        same = np.concatenate([[False], intervals[c:] == intervals[:-c], [False]])
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        if not len(edges):
            continue
        runs = edges[1::2] - edges[::2]  # lengths of the stretches where i + c repeats i
        k = int(np.argmax(runs))
        first, length = int(edges[2 * k]), int(runs[k]) + c
        if length >= 2 * c and (best is None or length > best[2] - best[1]):
            best = (c, first, first + length)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenario")
    ap.add_argument("--every", type=int, default=8, help="print every k-th stage (default 8); all are counted")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    # every microbatch simulated: a step whose cycle was copied in repeats by construction
    result = simulate(args.scenario, check=False, repeat=False)
    trace = result.trace
    starts = first_forward_starts(trace)
    m = result.summary["plan"]["microbatches"]
    rows = sorted(starts.items())
    if ways(result.summary["plan"]["schedule"]) == 2:
        # fed from both ends: each half of the microbatches is a pipeline of its own, whose
        # forwards on a rank interleave with the other's (engine.repeat.TWO_WAYS)
        rows = [(f"{r}/{h}", first[h * (m // 2):(h + 1) * (m // 2)]) for r, first in rows for h in (0, 1)]
    p = len(rows)
    halves = " (each half of the microbatches apart: rank/half)" if p > len(trace.ranks) else ""
    print(f"{Path(args.scenario).name}: {len(trace.ranks)} simulated ranks{halves}, simulated in "
          f"{time.perf_counter() - t0:.1f} s")
    print(f"{'rank':>6} {'mbs':>5} {'cycle':>6} {'repeats over mbs':>17} {'period s':>10}  intervals (s) of one cycle")
    found = []
    for k, (r, first) in enumerate(rows):
        first = first[~np.isnan(first)]
        intervals = np.round(np.diff(first), 9)  # intervals[i]: microbatch i + 1 after i
        hit = cycle_of(intervals)
        if hit is not None:
            found.append((hit[0], hit[2] - hit[1]))
        if k % max(args.every, 1) == 0 or k == p - 1:
            if hit is None:
                print(f"{r:>6} {len(first):>5} {'none':>6}")
                continue
            c, lo, hi = hit
            one = intervals[lo:lo + c]
            shown = " ".join(f"{x:.4f}" for x in one[:8]) + (" ..." if c > 8 else "")
            print(f"{r:>6} {len(first):>5} {c:>6} {f'{lo + 1}-{hi}':>17} {one.mean():>10.6f}  {shown}")
    if not found:
        print("no stage repeats a cycle: the step is too short or its timeline does not repeat")
        return 0
    cycles = sorted({c for c, _ in found})
    covered = [n for _, n in found]
    print(f"stages that repeat a cycle: {len(found)} of {p}; cycle lengths {cycles} microbatches "
          f"(all stages together: every {math.lcm(*cycles)}); a stage repeats over "
          f"{min(covered)}-{max(covered)} of its intervals (median {int(np.median(covered))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
