"""Random long pipeline steps simulated whole and with their steady cycle copied in
(clustersim.engine.repeat): where a cycle is found, the spans must be the same (rank, task,
microbatch, form; start and end within 1 ns), every figure of the summary within 1e-9 (or
1 ns; the figures it bins or rounds within their slack, tests/test_repeat.LOOSE) and the
links' bytes too (tests/test_repeat.differences, what the tests hold a dozen fixed plans to);
this draws many more (topology, TP, PP, DP, EP, CP, SP, ZeRO, recompute, schedule, a slow
GPU; since 2026-12-06 one plan in three turned into ZB-V or DualPipeV, from a random stream
of its own: :func:`with_v_schedule`, and one in five of the rest into DualPipe:
:func:`with_dualpipe`). Each plan also runs as ``clustersim run`` runs it, its shorter step simulated by a
forked process (clustersim.engine.ahead): that must give the same bits as one process::

    python bench/fuzz_repeat.py [seed] [plans]      (default 0 and 20)

It prints, per plan, whether a cycle was found and how much faster the step was, and exits 1
on any difference. A plan drawn smaller than a node fills the node with DP (such plans were
refused before, a quarter of the draws; every other plan of a seed is the one it always drew).
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import numpy as np

from fuzz_args import two_counts, with_etp, with_recompute_layers  # a sibling script (bench/ is on the path)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import clustersim  # noqa: E402
from clustersim.engine import repeat  # noqa: E402
from clustersim.schedule.pipeline import chunks_per_rank  # noqa: E402
from tests.test_repeat import differences  # noqa: E402

TOPOLOGIES = {"dgx-a100.yaml": 8, "dgx-h100.yaml": 8, "h800-cluster.yaml": 8, "fat-tree.yaml": 8}
MOE = {"experts": 8, "top_k": 2, "expert_ffn": 1024}


def draw(rng: random.Random) -> dict:
    """One random plan whose shorter step is a third of it or less."""
    topo = rng.choice(sorted(TOPOLOGIES))
    tp = rng.choice([1, 2, 4, 8])
    pp = rng.choice([2, 4, 8])
    dp = rng.choice([1, 2, 4])
    cp = rng.choice([1, 1, 2])
    schedule = rng.choice(["1f1b", "1f1b", "interleaved", "zb-h1"])
    vpp = 2 if schedule == "interleaved" else 1
    layers = pp * vpp * rng.choice([1, 2])
    nodes = max(1, tp * pp * dp * cp // TOPOLOGIES[topo])
    step = repeat.step_mb(schedule, pp)
    floor = repeat.fewest_simulated(pp, vpp, step)
    # (the fewest a shorter step holds is below floor + step; interleaved simulates the most a
    # third allows; its steps of two groups, since 2026-12-06, draw other m than before)
    m = 3 * (floor + step) + step * rng.choice([0, 1, 3])
    model = {"name": "fuzz", "layers": layers, "hidden": 1024 * rng.choice([1, 2]), "heads": 16, "vocab": 32000,
             "seq_len": 1024 * rng.choice([1, 2])}
    parallel = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "schedule": schedule, "zero": rng.choice([0, 1, 2, 3]),
                "sp": tp > 1 and rng.random() < 0.5}
    if schedule == "interleaved":
        parallel["vpp"] = vpp
    if dp >= 2 and rng.random() < 0.3:
        model["moe"] = MOE
        parallel["ep"] = 2
        parallel["sp"] = parallel["sp"] or tp > 1  # EP with TP needs SP (no draw: seeds keep their plans)
    parallel["tp_comm_overlap"] = bool(parallel.get("sp")) and parallel["zero"] % 2 == 1  # about half the SP plans (no draw)
    # about half the others' PP sends scattered over TP (no draw; a no-op without TP or PP)
    parallel["pp_scatter_gather"] = not parallel.get("sp") and parallel["zero"] % 2 == 1
    cluster = {"topology": f"topologies/{topo}", "nodes": nodes}
    if rng.random() < 0.2:
        cluster["what_if"] = [{"gpu": rng.randrange(tp * pp * dp * cp), "slowdown": 1.25}]
    # a plan smaller than a node fills it with DP (the cluster is whole nodes); only now, after
    # every draw, so that a seed draws what it drew before for every other plan
    per_node = TOPOLOGIES[topo]
    if tp * pp * dp * cp < per_node:
        dp = parallel["dp"] = per_node // (tp * pp * cp)
    training = with_recompute_layers({"micro_batch_size": 1, "global_batch_size": m * dp,
                                      "recompute": rng.choice(["none", "selective", "full"])}, rng, model["layers"])
    if "ep" in parallel and schedule == "interleaved" and training["recompute"] != "full" \
            and "moe" not in training.get("recompute_modules", ()):
        parallel["ep_comm_overlap"] = True  # combined 1F1B wherever it can (no draw: seeds keep their streams)
    if parallel["zero"] and topo in ("dgx-a100.yaml", "dgx-h100.yaml") and training["recompute"] != "selective":
        # the optimizer offloaded where the topology has a host (no draw): after the repeated
        # microbatches, its chains copy nothing the cycle holds
        training.update(optimizer_offload=0.5 if parallel["zero"] < 3 else 1.0, overlap_offload_copies=tp % 2 == 0)
    return {"name": "fuzz-repeat", "cluster": cluster, "model": model, "parallel": parallel, "training": training}


def with_v_schedule(d: dict, rng: random.Random) -> dict:
    """One plan in three turned into ZB-V or DualPipeV (two model chunks a rank: layers a
    multiple of 2 pp, the microbatches drawn again for their longer warm-up), from ``rng``,
    a stream of its own, so that a seed draws every plan's other fields as it did before."""
    if rng.random() >= 1 / 3:
        return d
    return _two_parts_a_rank(d, rng.choice(["zbv", "dualpipev"]), rng)


def with_dualpipe(d: dict, rng: random.Random) -> dict:
    """One plan in five of those left 1F1B-like turned into DualPipe (fed from both ends: each
    half of the microbatches repeats on its own, engine.repeat.TWO_WAYS; layers a multiple of
    pp, the microbatches drawn again for both halves' warm-ups), from ``rng``, a stream of its
    own, so that a seed draws every other plan as it did before."""
    if d["parallel"]["schedule"] in ("zbv", "dualpipev") or rng.random() >= 1 / 5:
        return d
    return _two_parts_a_rank(d, "dualpipe", rng)


def _two_parts_a_rank(d: dict, schedule: str, rng: random.Random) -> dict:
    """``d`` under ``schedule``, whose ranks hold two model parts each (the V schedules, DualPipe):
    layers a multiple of 2 pp, the microbatches drawn again for its warm-up (two chunks, or two
    halves), from ``rng``."""
    p, m = dict(d["parallel"]), d["model"]
    p["schedule"] = schedule
    p.pop("vpp", None)
    p.pop("ep_comm_overlap", None)  # (their own chunks overlap)
    step = repeat.step_mb(schedule, p["pp"])
    floor = repeat.fewest_simulated(p["pp"], 2, step)
    mb = 3 * (floor + step) + step * rng.choice([0, 1, 3])
    return {**d, "model": {**m, "layers": 2 * p["pp"] * rng.choice([1, 2])}, "parallel": p,
            "training": {**d["training"], "global_batch_size": mb * p["dp"]}}


def compare(d: dict) -> tuple[str, list[str]]:
    results = []
    for copy_in in (False, True):
        sc = clustersim.load_scenario({**d, "simulation": {"repeat": copy_in}}, base_dir=ROOT)
        t = time.perf_counter()
        results.append((clustersim.simulate(sc), time.perf_counter() - t))
    (whole, tw), (copied, tc) = results
    # the same step with its shorter step simulated by a forked process (clustersim run's
    # way, clustersim.engine.ahead): the same bits as one process
    sc = clustersim.load_scenario({**d, "simulation": {"repeat": True}}, base_dir=ROOT)
    forked = clustersim.simulate(sc, fork=True)
    same = json.dumps(forked.summary, sort_keys=True) == json.dumps(copied.summary, sort_keys=True) and all(
        np.array_equal(getattr(forked.trace.base, f), getattr(copied.trace.base, f))
        for f in ("rank", "stream", "start_s", "end_s", "tid", "mb", "form")) and forked.trace.links == copied.trace.links
    fork_diff = [] if same else ["the forked run differs from one process's"]
    rep = copied.summary["simulation"]["repeat"]
    if rep is None:
        p = d["parallel"]
        tried = repeat.simulated_microbatches(p["schedule"], p["pp"], whole.summary["plan"]["microbatches"],
                                              chunks_per_rank(p["schedule"], p.get("vpp", 1)))
        return (f"no cycle found ({tw:.2f} s whole, {tc:.2f} s with the attempt)" if tried else "not tried"), fork_diff
    out = differences(whole, copied, links=None) + fork_diff
    return (f"{rep['simulated_microbatches']} of {whole.summary['plan']['microbatches']} simulated, cycle "
            f"{rep['cycle_microbatches']}: {tw:.2f} s whole, {tc:.2f} s copied"), out


def main() -> int:
    seed, plans = two_counts(__doc__, ("seed", 0, "seed of the random plans"), ("plans", 20, "how many plans to draw"))
    rng = random.Random(seed)
    later = random.Random(seed + 2_000_003)  # draws added since (fuzz_args.with_etp), apart from the plans
    v_later = random.Random(seed + 3_000_017)  # and the V schedules' (with_v_schedule), apart from both
    two_ways = random.Random(seed + 4_000_037)  # and DualPipe's (with_dualpipe), apart from all three
    bad = 0
    for i in range(plans):
        d = with_dualpipe(with_v_schedule(with_etp(draw(rng), later), v_later), two_ways)
        p = d["parallel"]
        label = (f"{i:3d} {d['cluster']['topology'].split('/')[-1]:<18} {p['schedule']:<11} tp{p['tp']} pp{p['pp']} "
                 f"dp{p['dp']} cp{p['cp']} z{p['zero']}{' ep2' if 'ep' in p else ''}{' etp' + str(p['etp']) if 'etp' in p else ''}"
                 f"{' combined' if p.get('ep_comm_overlap') else ''}"
                 f"{' slow' if 'what_if' in d['cluster'] else ''}"
                 + (f" offload {d['training']['optimizer_offload']:g}" if d["training"].get("optimizer_offload") else ""))
        try:
            said, diffs = compare(d)
        except clustersim.ConfigError as exc:
            print(f"{label}: refused ({exc.message[:80]})")
            continue
        print(f"{label}: {said}" + (f"  DIFFERS: {diffs[:3]}" if diffs else ""), flush=True)
        bad += bool(diffs)
    print(f"{bad} plan(s) differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
