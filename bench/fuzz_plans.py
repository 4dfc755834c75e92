"""Random plans on every shipped topology: the engine's communication plans with the orbit
check on arrays (every communication, ``network.ROWS_MIN_FLOWS = 0``) are those of the
dictionaries (none), bit for bit. tests/test_orbit_rows.py checks the shipped scenarios and a
few variants; this draws many more (topology, size, TP/PP/DP/EP, ZeRO, algorithms, a removed
spine cable)::

    python bench/fuzz_plans.py [seed] [plans]      (default 0 and 40)
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

from fuzz_args import two_counts  # a sibling script (bench/ is on the path)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import clustersim  # noqa: E402
from clustersim.engine import Engine, network  # noqa: E402
from clustersim.program.lower import lower  # noqa: E402
from tests.conftest import scenario_dict  # noqa: E402

MOE = {"name": "tiny-moe", "layers": 4, "hidden": 1024, "heads": 8, "vocab": 32000, "seq_len": 512, "mlp": "swiglu",
       "bias": False, "moe": {"experts": 16, "top_k": 2, "expert_ffn": 1024}}
TOPOLOGIES = {  # file -> (GPUs per node, node counts to draw from)
    "dgx-a100.yaml": (8, [2, 4, 24, 30]), "dgx-h100.yaml": (8, [2, 4, 8, 40, 64]),
    "h800-cluster.yaml": (8, [2, 3, 8, 16]), "fat-tree.yaml": (8, [4, 8, 16, 40]),
    "gb200-nvl72.yaml": (72, [1, 2]), "roce-clos-llama3.yaml": (8, [4, 16, 48]),
}


def plans(sc: clustersim.Scenario, rows_from: int) -> tuple:
    """The engine's plans, full plans and algorithms with the orbit check on arrays from
    ``rows_from`` real flows on."""
    kept = network.ROWS_MIN_FLOWS
    network.ROWS_MIN_FLOWS = rows_from
    try:
        prog, _ = lower(sc)
        eng = Engine(prog, sc.cluster, sc.cfg.simulation.network, sc.cfg.simulation.collectives.model_dump())
    finally:
        network.ROWS_MIN_FLOWS = kept
    return eng._plans, eng._full_plans, eng._algos


def draw(rng: random.Random) -> dict:
    """One random scenario document."""
    topology = rng.choice(sorted(TOPOLOGIES))
    per, node_counts = TOPOLOGIES[topology]
    nodes = rng.choice(node_counts)
    tp = rng.choice([t for t in (1, 2, 4, 8) if per % t == 0])
    pp = rng.choice([p for p in (1, 2, 4) if (per * nodes // tp) % p == 0])
    dp = per * nodes // tp // pp
    parallel = {"tp": tp, "pp": pp, "dp": dp, "zero": rng.choice([0, 1, 2])}
    moe = rng.random() < 0.5
    if moe:
        parallel["ep"] = rng.choice([e for e in (1, 2, 4, 8, 16) if dp % e == 0])
        parallel["sp"] = tp > 1 and parallel["ep"] > 1  # EP with TP needs SP (no draw: seeds keep their plans)
    parallel["tp_comm_overlap"] = bool(parallel.get("sp")) and parallel["zero"] % 2 == 1  # about half the SP plans (no draw)
    # about half the others' PP sends scattered over TP (no draw; a no-op without TP or PP)
    parallel["pp_scatter_gather"] = not parallel.get("sp") and parallel["zero"] % 2 == 1
    if parallel["zero"] and parallel.get("ep", 1) == 1 and dp >= 4 and dp % 2 == 0 and tp != 2:
        parallel["zero_shard"] = dp // 2  # hybrid sharding, two replicas (no draw)
    collectives = {"all_to_all": rng.choice(["auto", "pxn", "pairwise"]),
                   "all_reduce": rng.choice(["auto", "ring", "tree", "hierarchical", "nvls"])}
    d = scenario_dict(cluster={"topology": f"topologies/{topology}", "nodes": nodes}, parallel=parallel,
                      training={"global_batch_size": dp * 2 * pp}, simulation={"collectives": collectives},
                      **({"model": MOE} if moe else {}))
    if topology == "dgx-a100.yaml" and nodes > 20 and rng.random() < 0.3:  # two leaf groups: a spine cable out
        d["cluster"]["what_if"] = [{"remove_link": "leaf0.0-spine0"}]
    return d


def main() -> int:
    seed, n = two_counts(__doc__, ("seed", 0, "seed of the random plans"), ("plans", 40, "how many plans to draw"))
    rng = random.Random(seed)
    t0 = time.perf_counter()
    refused = 0
    for i in range(n):
        d = draw(rng)
        try:
            sc = clustersim.load_scenario(d, base_dir=ROOT)
        except clustersim.ConfigError as exc:  # a draw the rules refuse compares nothing: counted, not a failure
            print(f"plan {i}: refused ({exc.message})", flush=True)
            refused += 1
            continue
        if plans(sc, 10**12) != plans(sc, 0):
            print(f"plan {i}: the arrays' plans differ from the dictionaries': {d['cluster']} {d['parallel']} "
                  f"{d['simulation']}")
            return 1
    print(f"{n - refused} random plans (seed {seed}; {refused} refused): the orbit check on arrays gave the "
          f"dictionaries' plans, bit for bit; {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
