"""The memory `clustersim run` takes per task of its step and per GPU, against what it expects before it
runs (clustersim.host_memory): the summed PSS of its processes (the parent, the writer it
forks, the shorter step's process), sampled every 50 ms.

    python bench/bench_memory.py                        # four shipped scenarios, every rank
    python bench/bench_memory.py X.yaml --collapsed     # X as the default runs it

PSS counts a page two processes share half to each, so the sum is what the run takes of the
machine. The default scenarios simulate every rank (--all-ranks), where the memory grows to
GB: gpt3_175b_1024gpu's 9.9 M tasks take about 13 GB and two minutes (`--large` adds it).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from clustersim.config import load_scenario
from clustersim.host_memory import RUN_BASE_BYTES, rank_by_rank_tasks, run_bytes
from clustersim.program.lower import lower

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ["zero3_llama3_8b_16gpu", "long_context_cp_128k", "llama2_70b_64gpu", "moe_1024gpu"]
LARGE = ["gpt3_175b_1024gpu"]
MiB = 2**20


def tasks_of(path: Path, every_rank: bool) -> tuple[int, int]:
    """(The step's tasks as clustersim.api counts them before it simulates, its GPUs.)"""
    sc = load_scenario(path)
    prog, _ = lower(sc, collapse=True if every_rank else None)
    return (rank_by_rank_tasks(prog) if every_rank else len(prog.items)), sc.mesh.world_size


def peak_pss(cmd: list[str]) -> tuple[int, float]:
    """(the largest summed PSS of ``cmd``'s process tree, its wall seconds)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, cwd=ROOT)
    root = psutil.Process(proc.pid)
    peak, t0 = 0, time.perf_counter()
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_full_info().pss for p in tree))
        except psutil.Error:  # a process ended between the listing and the reading
            pass
        time.sleep(0.05)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} exited with {proc.returncode}")
    return peak, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("scenarios", nargs="*", type=Path, help="scenario files (default: four shipped ones)")
    ap.add_argument("--collapsed", action="store_true", help="run them as the default does, not every rank")
    ap.add_argument("--large", action="store_true", help="add gpt3_175b_1024gpu (about 13 GB, two minutes)")
    args = ap.parse_args()
    paths = args.scenarios or [ROOT / "scenarios" / f"{n}.yaml" for n in DEFAULT + (LARGE if args.large else [])]
    every = not args.collapsed
    print(f"{'scenario':<28} {'tasks':>11} {'GPUs':>7} {'peak MiB':>9} {'expected':>9} {'B/task':>7} {'B/GPU':>7} "
          f"{'wall s':>7}")
    for path in paths:
        tasks, gpus = tasks_of(path, every)
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, "-m", "clustersim", "run", str(path), "--out", out, *(["--all-ranks"] if every else [])]
            peak, wall_s = peak_pss(cmd)
        per_task = (peak - RUN_BASE_BYTES) / tasks  # (all of it, as if the GPUs took none)
        per_gpu = (peak - run_bytes(tasks)) / gpus  # (what the tasks do not explain)
        print(f"{path.stem:<28} {tasks:>11,} {gpus:>7,} {peak / MiB:>9,.0f} {run_bytes(tasks, gpus) / MiB:>9,.0f} "
              f"{per_task:>7,.0f} {per_gpu:>7,.0f} {wall_s:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
