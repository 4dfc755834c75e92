"""Wall time of lowering and simulating each scenario; prints one line per scenario.

    python bench/bench_simulate.py [scenario.yaml ...]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from clustersim.api import summarize
from clustersim.config import load_scenario
from clustersim.engine import Engine
from clustersim.program.lower import lower


def bench(path: Path) -> str:
    sc = load_scenario(path)
    t0 = time.perf_counter()
    prog, low = lower(sc)
    t1 = time.perf_counter()
    engine = Engine(prog, sc.cluster, sc.cfg.simulation.network, sc.cfg.simulation.collectives.model_dump())
    trace = engine.run()
    t2 = time.perf_counter()
    summary = summarize(sc, low, trace, prog, engine)
    t3 = time.perf_counter()
    return (f"{path.stem:<28} {sc.mesh.world_size:>5} GPUs {len(prog.ranks):>3} sim ranks "
            f"{len(prog.items):>8,} tasks  lower {t1 - t0:6.2f} s  engine {t2 - t1:6.2f} s "
            f"({len(prog.items) / (t2 - t1):>8,.0f} tasks/s)  analysis {t3 - t2:5.2f} s  "
            f"step {summary['step_time_s']:.4g} s")


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("scenarios", nargs="*", type=Path, help="scenario YAML files (default: every shipped one)")
    shipped = sorted(p for p in (root / "scenarios").glob("*.yaml") if not p.name.startswith("my_"))  # not a user's
    paths = ap.parse_args().scenarios or shipped
    for p in paths:
        print(bench(p), flush=True)
