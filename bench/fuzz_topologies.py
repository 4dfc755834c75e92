"""Long fuzz run of topology documents (the CI test runs a few hundred; run this before a
release): every mutated topology, named by a scenario, must load (and its cluster build) or
fail with one ConfigError naming the file and the field, each within tests/fuzz_topologies.py's
BOUND_S, with no hang and no MemoryError (the address space is capped at 8 GiB here, so that
a runaway allocation fails fast instead of swapping).

    python bench/fuzz_topologies.py [examples] [seed]      (default 10000, 20261130)
"""

from __future__ import annotations

import resource
import sys
import tempfile
import time
from pathlib import Path

from fuzz_args import two_counts  # a sibling script (bench/ is on the path)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402

from tests.fuzz_topologies import BOUND_S, check_one, examples  # noqa: E402


def describe(ex: dict) -> str:
    """One line about an example: its base, its changes and the first characters of the rest."""
    parts = [ex["base"]] + [f"{p}={v!r:.40}" for p, v in ex["changes"]]
    parts += [f"{k}={ex[k]!r:.60}" for k in ("fabric", "nodes", "raw") if k in ex]
    parts += [f"{k}: {len(ex[k])} entries" for k in ("what_if", "scenario_what_if") if k in ex]
    if "edit" in ex:
        parts.append(f"edit: {ex['edit'][0]}")
    return ", ".join(parts)


def main() -> int:
    n, seed_ = two_counts(__doc__, ("examples", 10_000, "documents to fuzz"), ("seed", 20261130, "hypothesis seed"))
    limit = 8 << 30
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    stats = {"examples": 0, "ok": 0, "error": 0, "slowest": (0.0, "")}
    workdir = Path(tempfile.mkdtemp(prefix="fuzz-topologies-"))

    @seed(seed_)
    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(examples())
    def run(ex):
        outcome, wall = check_one(ex, workdir)
        stats["examples"] += 1
        stats[outcome] += 1
        if wall > stats["slowest"][0]:
            stats["slowest"] = (wall, describe(ex))

    t0 = time.perf_counter()
    try:
        run()
    except BaseException:
        print(f"FAILED after {stats['examples']:,} examples ({time.perf_counter() - t0:.0f} s); "
              "hypothesis shows the falsifying example above", file=sys.stderr)
        raise
    wall = time.perf_counter() - t0
    slow_s, slow_ex = stats["slowest"]
    print(f"{stats['examples']:,} fuzzed topology documents, 0 failures: {stats['ok']:,} loaded, "
          f"{stats['error']:,} refused with one clear ConfigError; {wall:.0f} s "
          f"({1e3 * wall / max(stats['examples'], 1):.1f} ms each); slowest {slow_s:.2f} s "
          f"(bound {BOUND_S:g} s): {slow_ex}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
