"""How fast clustersim goes through a sweep of plans: every plan of one model on one cluster.

    python bench/bench_sweep.py                     # Llama-2 70B on 64 H100s: 64 plans
    python bench/bench_sweep.py --all               # 192 plans: every ZeRO stage and recompute
    python bench/bench_sweep.py x.yaml --gpus 128   # another scenario's model and cluster
    python bench/bench_sweep.py --limit 5           # the first 5 plans only
    python bench/bench_sweep.py --jobs 2            # two worker processes (the plans are independent)
    python bench/bench_sweep.py --whole             # each plan's whole summary, not the brief one
    python bench/bench_sweep.py --fresh-cluster     # each plan builds its own cluster graph

A user choosing a plan simulates many: every way to split the GPUs into TP x PP x DP, each
with the memory savers (ZeRO stage, activation recompute). This bench does that in one Python
process through the API, as a script or a notebook would (``load_scenario`` on a dict, then
``simulate`` with its checks, its summary brief as ``clustersim sweep`` makes it: without the
critical path, the causes of exposed communication and the link use; no files written), and
prints per plan its wall time, step time,
MFU and whether it fits, then the distribution of the wall times, how long the sweep took and
what a thousand plans would take at that pace (``--jobs N``: in N forked worker processes). The plans::

    tp in {1, 2, 4, 8} dividing the heads, pp in {1, 2, 4, 8} dividing the layers,
    dp = GPUs / (tp pp), ZeRO in {1, 3} (--all: {0, 1, 2, 3}),
    recompute in {selective, full} (--all: {none, selective, full}); the scenario's batch and
    micro-batch size; its schedule if 1F1B, GPipe or ZB-H1, else 1F1B (printed); its SP where
    tp > 1 (always with EP) and its EP as far as DP allows; no CP, interleaving or layer split
    of its own

Plans the scenario's rules refuse (a global batch DP does not divide, say) are counted and
named, not timed. Each plan's seconds include its validation; its plans share one cluster
graph, as ``clustersim sweep``'s do (``reused_clusters``: built once, before the workers
fork), or with ``--fresh-cluster`` each builds its own, as a script calling ``simulate`` plan
by plan does. Peak RSS is the largest of this process's and its workers' (each plan's objects
are freed before the next).

Example (2 cores, 2026-12-03, bare simpy timeout about 1.1 us, a slow stretch)::

    (see docs/performance.md, "Sweeps of plans")
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import math
import multiprocessing
import resource
import statistics
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "scenarios" / "llama2_70b_64gpu.yaml"


def plans(model: dict, gpus: int, every: bool) -> list[tuple[int, int, int, int, str]]:
    """(tp, pp, dp, zero, recompute) of every plan swept (see the module docstring)."""
    zeros = (0, 1, 2, 3) if every else (1, 3)
    recomputes = ("none", "selective", "full") if every else ("selective", "full")
    out = []
    for tp, pp in itertools.product((1, 2, 4, 8), (1, 2, 4, 8)):
        if model["heads"] % tp or model["layers"] % pp or gpus % (tp * pp):
            continue
        for zero, rc in itertools.product(zeros, recomputes):
            out.append((tp, pp, gpus // (tp * pp), zero, rc))
    return out


# schedules a plan keeps from its scenario at any pp > 1; the others (interleaved, DualPipe, a
# schedule file) depend on a layer split or a pp of their own: those plans run 1F1B
KEPT_SCHEDULES = ("1f1b", "gpipe", "zb-h1")


def variant(base: dict, gpus_per_node: int, gpus: int, tp: int, pp: int, dp: int, zero: int, rc: str) -> dict:
    """``base`` (a scenario as read from YAML) with this plan on ``gpus`` GPUs: the scenario's
    schedule where it is one of KEPT_SCHEDULES, else 1F1B; its sequence parallelism where
    tp > 1, and always where tp > 1 and ep > 1 (the pair needs it); its EP as far as DP allows
    (the largest divisor of its ``ep`` that divides dp); no CP, no interleaving and no layer
    split of its own; ZeRO-1/2's overlapped parameter gathers where the plan's ZeRO stage has
    them."""
    d = copy.deepcopy(base)
    d["cluster"]["nodes"] = gpus // gpus_per_node
    par = d["parallel"]
    ep = par.get("ep", 1)
    for k in ("cp", "ep", "vpp", "schedule_file", "layers_per_stage"):
        par.pop(k, None)
    par.update(tp=tp, pp=pp, dp=dp, zero=zero)
    if ep > 1:
        par["ep"] = math.gcd(ep, dp)
    if tp == 1:
        par.pop("sp", None)
    elif par.get("ep", 1) > 1:
        par["sp"] = True  # (EP with TP needs SP)
    if pp == 1 or par.get("schedule") not in KEPT_SCHEDULES:
        par["schedule"] = "1f1b"
    if zero not in (1, 2):
        par.pop("overlap_param_gather", None)
    d["training"]["recompute"] = rc
    return d


def one(job: tuple) -> tuple:
    """Simulate one plan: (label, wall s, step s, MFU, fits, spans), or (label, refusal)."""
    from clustersim import ConfigError, load_scenario, simulate
    label, d, base_dir, brief = job
    t = time.perf_counter()
    try:
        s = simulate(load_scenario(d, base_dir=base_dir), brief=brief).summary
    except ConfigError as exc:
        return label, str(exc)
    return label, time.perf_counter() - t, s["step_time_s"], s["mfu"], s["memory"]["fits"], s["simulation"]["spans"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenario", nargs="?", default=str(DEFAULT), help="the model, cluster and batch to sweep")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs (default: the scenario's)")
    ap.add_argument("--all", action="store_true", help="every ZeRO stage and recompute choice")
    ap.add_argument("--limit", type=int, default=None, help="only the first N plans")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (forked; default 1: this one)")
    ap.add_argument("--whole", action="store_true", help="each plan's whole summary (critical path, causes of "
                                                         "exposed communication, link use), not the brief one")
    ap.add_argument("--fresh-cluster", action="store_true", help="each plan builds its own cluster graph (default: "
                                                                 "one for every plan, as clustersim sweep)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    import clustersim  # noqa: F401  (what the import takes: the package, then the one name used here)
    from clustersim.hardware.topology import reused_clusters
    import_s = time.perf_counter() - t0
    with contextlib.nullcontext() if args.fresh_cluster else reused_clusters():
        return sweep(args, import_s)


def sweep(args: argparse.Namespace, import_s: float) -> int:
    """The sweep :func:`main` asks for (``import_s``: clustersim's import)."""
    from clustersim import load_scenario

    path = Path(args.scenario)
    base = yaml.safe_load(path.read_text())
    sc0 = load_scenario(path)
    per_node = sc0.cluster.gpus_per_node  # (built here, and kept for the plans on this cluster)
    gpus = args.gpus or sc0.mesh.world_size
    todo = plans(base["model"], gpus, args.all)[:args.limit]
    schedule = sc0.parallel.schedule if sc0.parallel.schedule in KEPT_SCHEDULES else "1f1b"
    print(f"{sc0.cfg.model.name} on {gpus} GPUs ({per_node} a node): {len(todo)} plans, {schedule} where pp > 1; "
          f"import {import_s:.2f} s; {args.jobs} process{'es' if args.jobs > 1 else ''}")
    print(f"{'plan':28s} {'wall s':>7s} {'step s':>8s} {'MFU':>6s}  fits  spans")
    jobs = [(f"tp{tp} pp{pp} dp{dp} zero{zero} {rc}", variant(base, per_node, gpus, tp, pp, dp, zero, rc), path.parent,
             not args.whole) for tp, pp, dp, zero, rc in todo]
    walls: list[float] = []
    refused: list[str] = []
    t_all = time.perf_counter()
    pool = multiprocessing.get_context("fork").Pool(args.jobs) if args.jobs > 1 else None
    try:
        for got in (pool.imap(one, jobs) if pool else map(one, jobs)):  # in the plans' order
            if len(got) == 2:
                refused.append(f"{got[0]}: {got[1]}")
                continue
            label, wall, step_s, mfu, fits, spans = got
            walls.append(wall)
            print(f"{label:28s} {wall:7.2f} {step_s:8.3f} {mfu:6.1%}  {'yes' if fits else 'no ':4s}  {spans:,}",
                  flush=True)
    finally:
        if pool:
            pool.close()
            pool.join()
    elapsed_s = time.perf_counter() - t_all
    if refused:
        print(f"refused by the scenario's rules ({len(refused)}):")
        for line in refused:
            print("  " + line)
    if not walls:
        return 1
    q = statistics.quantiles(walls, n=10, method="inclusive") if len(walls) > 1 else walls * 9
    total = sum(walls)
    print(f"plans timed {len(walls)}  total {total:.1f} s  median {statistics.median(walls):.2f} s  "
          f"p90 {q[8]:.2f} s  max {max(walls):.2f} s")
    # a worker's peak is its own: RUSAGE_CHILDREN gives the largest child's
    rss = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    print(f"the sweep took {elapsed_s:.1f} s with {args.jobs} process{'es' if args.jobs > 1 else ''}: a thousand "
          f"such plans {1000 * elapsed_s / len(jobs) / 60:.1f} min; peak RSS {rss // 1024} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
