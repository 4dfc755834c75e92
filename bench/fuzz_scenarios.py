"""Long fuzz run of scenario documents (the CI test runs 300 examples; run this before a
release): every mutated document must load or fail with one ConfigError naming file and field.

    python bench/fuzz_scenarios.py [examples]      (default 10000)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hypothesis import HealthCheck, given, settings  # noqa: E402

from fuzz_args import at_least  # noqa: E402  (a sibling script: bench/ is on the path)
from tests.fuzz_scenarios import check_one, mutations  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("examples", nargs="?", type=at_least(1), default=10_000, help="documents to fuzz (default 10000)")
    n = ap.parse_args().examples
    count = {"examples": 0}

    @settings(max_examples=n, deadline=5000, database=None, suppress_health_check=list(HealthCheck))
    @given(mutations)
    def run(changes):
        count["examples"] += 1
        check_one(changes, ROOT)

    t0 = time.perf_counter()
    run()
    wall = time.perf_counter() - t0
    print(f"{count['examples']:,} fuzzed scenario documents: every one loaded or failed with one clear "
          f"ConfigError; {wall:.1f} s ({1e3 * wall / max(count['examples'], 1):.2f} ms each)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
