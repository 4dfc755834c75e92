"""The orbit check on arrays (engine.network._weigh_rows, _by_member_rows, _route_rows): the
same plans as the dictionaries of _weigh and _by_member, bit for bit.

A communication with many real flows (its own and its twins') is planned on arrays; a small
one with dictionaries. Both ways are run here on every shipped scenario and on variants that
reach the other branches (pairwise all-to-all without PXN, a skewed all-to-all, a removed
cable, oversubscribed and NVLink-domain topologies, twins meeting another communication's),
with the threshold moved so that each
communication goes one way and then the other.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest

import clustersim
from clustersim.engine import Engine
from clustersim.engine import network
from clustersim.hardware.topology import build_cluster, load_topology_cfg
from clustersim.program.lower import lower

from .conftest import ROOT, scenario_dict, shipped_scenarios

MOE = {"name": "tiny-moe", "layers": 4, "hidden": 1024, "heads": 8, "vocab": 32000, "seq_len": 512, "mlp": "swiglu",
       "bias": False, "moe": {"experts": 16, "top_k": 2, "expert_ffn": 1024, "shared_experts": 1,
                              "dense_layers_first": 1}}
SHIPPED = [p.name for p in shipped_scenarios()]
VARIANTS = {
    # EP 8 across nodes of the H800 cluster (its NICs' rails): PXN proxies; pairwise: none
    "moe-pxn": dict(cluster={"topology": "topologies/dgx-h100.yaml", "nodes": 4}, model=MOE,
                    parallel={"tp": 1, "pp": 2, "dp": 16, "ep": 16}, training={"global_batch_size": 32}),
    "moe-pairwise": dict(cluster={"topology": "topologies/dgx-h100.yaml", "nodes": 4}, model=MOE,
                         parallel={"tp": 1, "pp": 2, "dp": 16, "ep": 16}, training={"global_batch_size": 32},
                         simulation={"collectives": {"all_to_all": "pairwise"}}),
    "moe-skewed": dict(cluster={"topology": "topologies/dgx-h100.yaml", "nodes": 4},
                       model={**MOE, "moe": {**MOE["moe"], "ep_load": [2.0] + [14 / 15] * 15}},
                       parallel={"tp": 1, "pp": 2, "dp": 16, "ep": 16}, training={"global_batch_size": 32}),
    # two leaf groups, one spine cable out: DP rings cross spines, some twins on other ones
    "removed-cable": dict(cluster={"topology": "topologies/dgx-a100.yaml", "nodes": 24,
                                   "what_if": [{"remove_link": "leaf0.0-spine0"}]},
                          parallel={"tp": 8, "pp": 2, "dp": 12}, training={"global_batch_size": 24}),
    "fat-tree": dict(cluster={"topology": "topologies/fat-tree.yaml", "nodes": 8},
                     parallel={"tp": 2, "pp": 2, "dp": 16}, training={"global_batch_size": 32}),
    "nvl72": dict(cluster={"topology": "topologies/gb200-nvl72.yaml", "nodes": 2}, model=MOE,
                  parallel={"tp": 1, "pp": 2, "dp": 72, "ep": 8}, training={"global_batch_size": 144}),
    # classes split: every send between stages is several orbits, each planned with its
    # siblings' flows (lower.Symmetry.siblings); symmetric ones on a Clos without rails, orbit
    # weights across two GB200 racks
    "siblings-ep-skewed": dict(cluster={"topology": "topologies/roce-clos-llama3.yaml", "nodes": 4},
                               model={**MOE, "moe": {**MOE["moe"], "ep_load": [1.5, 0.5]}},
                               parallel={"tp": 4, "pp": 4, "dp": 2, "ep": 2, "sp": True}, training={"global_batch_size": 8}),
    "siblings-straggler": dict(cluster={"topology": "topologies/gb200-nvl72.yaml", "nodes": 2,
                                        "what_if": [{"gpu": 31, "slowdown": 1.3}]}, model={"layers": 8},
                               parallel={"tp": 2, "pp": 8, "dp": 9, "schedule": "zb-h1"},
                               training={"global_batch_size": 144}),
    # twins of different communications meeting on spines neither simulated instance crosses
    # (Engine._meetings): ZeRO-3 gathers and reductions (member by member) beside all-to-alls
    "meetings": dict(cluster={"topology": "topologies/roce-clos-llama3.yaml", "nodes": 8},
                     model={**MOE, "layers": 2, "heads": 16, "moe": {"experts": 8, "top_k": 2, "expert_ffn": 1024}},
                     parallel={"tp": 2, "pp": 1, "dp": 16, "cp": 2, "zero": 3, "sp": True, "cp_comm": "all_gather",
                               "ep": 8}, training={"global_batch_size": 32}),
}


def _scenario(name: str) -> clustersim.Scenario:
    if name in VARIANTS:
        return clustersim.load_scenario(scenario_dict(**VARIANTS[name]), base_dir=ROOT)
    return clustersim.load_scenario(ROOT / "scenarios" / name)


@contextmanager
def _rows_from(n: int):
    """Plan on arrays every communication with at least ``n`` real flows; count the calls."""
    kept, weigh_rows = network.ROWS_MIN_FLOWS, network._weigh_rows
    calls = {"rows": 0, "orbit": 0}

    def counted(*args, **kw):
        plan = weigh_rows(*args, **kw)
        calls["rows"] += 1
        if plan is not None and any(isinstance(w, int) for ws in plan.weights for _, w in ws):
            calls["orbit"] += 1  # orbit weights count members (int); symmetric ones divide (float)
            assert not plan.orbit_symmetric  # (what simulation.asymmetric_orbits counts)
        return plan

    network.ROWS_MIN_FLOWS, network._weigh_rows = n, counted
    try:
        yield calls
    finally:
        network.ROWS_MIN_FLOWS, network._weigh_rows = kept, weigh_rows


def _plans(sc: clustersim.Scenario, n: int) -> tuple[dict, dict]:
    prog, _ = lower(sc)
    with _rows_from(n) as calls:
        eng = Engine(prog, sc.cluster, sc.cfg.simulation.network, sc.cfg.simulation.collectives.model_dump())
    flags = {k: tuple(p.orbit_symmetric for p in v) for k, v in (*eng._plans.items(), *eng._full_plans.items())}
    return {"plans": eng._plans, "full": eng._full_plans, "algorithms": eng._algos, "symmetric": flags,
            "asymmetric_orbits": eng.asymmetric_orbits}, calls


ORBITS: dict[str, int] = {}


@pytest.mark.parametrize("name", SHIPPED + sorted(VARIANTS))
def test_arrays_give_the_plans_of_the_dictionaries(name):
    sc = _scenario(name)
    by_dicts, none = _plans(sc, 10**12)
    by_rows, calls = _plans(sc, 0)
    assert none["rows"] == 0
    if sc.cfg.simulation.network == "flow":
        assert calls["rows"] > 0
    ORBITS[name] = calls["orbit"]
    assert by_rows == by_dicts  # (the plans' orbit_symmetric and the engine's count of them too)


def test_the_orbit_weights_branch_was_compared():
    """Not vacuous: some of the scenarios above have twins that cross different links."""
    if len(ORBITS) < len(SHIPPED) + len(VARIANTS):
        pytest.skip("runs after the comparisons above")
    assert sum(ORBITS.values()) > 0


def test_plans_of_asymmetric_orbits_stay_flagged_made_either_way():
    """An orbit whose twins cross other links is flagged (FlowPlan.orbit_symmetric false)
    whether its plan is weighed on arrays or with dictionaries, alone (two GB200 racks, whose
    sends and DP all-reduce cross spines the hash picks per pair) or with its siblings (the
    straggler's split classes there), after its pipelines are made one flow and its links
    merged; the engine counts the same communications either way."""
    for name, alone in (("nvl72", True), ("siblings-straggler", False)):
        sc = _scenario(name)
        by_dicts, _ = _plans(sc, 10**12)
        by_rows, calls = _plans(sc, 0)
        assert (calls["orbit"] > 0) == alone  # (siblings: _weigh_sibling_rows, not _weigh_rows)
        assert by_rows["asymmetric_orbits"] == by_dicts["asymmetric_orbits"]
        assert set(by_rows["asymmetric_orbits"]) == {"dp", "pp"}
        assert by_rows["symmetric"] == by_dicts["symmetric"]
        assert any(False in flags for flags in by_rows["symmetric"].values())


@pytest.mark.parametrize("topology,nodes", [("h800-cluster.yaml", 3), ("dgx-a100.yaml", 24), ("gb200-nvl72.yaml", 1)])
@pytest.mark.parametrize("direct", [False, True])
def test_rows_route_every_pair_as_route_does(topology, nodes, direct):
    """Every (src, dst), loops included, routed in rows is the route of the pair."""
    cl = build_cluster(load_topology_cfg(ROOT / "topologies" / topology, {"nodes": nodes}))
    n = len(cl.gpu_names)
    src, dst = np.divmod(np.arange(n * n), n)
    keep = (src == dst) | (np.arange(n * n) % 3 == 0)  # every loop and a third of the pairs
    src, dst = src[keep], dst[keep]
    route = network._route(cl, direct)
    # all of them; and from GPU 0 only, whose proxies are none of the pairs' GPUs
    for s_of, d_of in ((src, dst), (np.zeros(n - 1, dtype=np.int64), np.arange(1, n))):
        rows, lens = network._route_rows(cl, s_of, d_of, direct)
        assert [tuple(r[:k]) for r, k in zip(rows.tolist(), lens.tolist())] == [
            route(s, d) for s, d in zip(s_of.tolist(), d_of.tolist())]


SEEDED: dict[str, tuple[int, int]] = {}


@pytest.mark.parametrize("name", ["moe_1024gpu.yaml"] + sorted(VARIANTS))
def test_plans_made_on_arrays_carry_the_arrays_of_their_weights(name):
    """A plan worked out on arrays is given its (link, weight) pairs as arrays as it is made
    (network._weigh_at, _met_at; sim._on_links where the dominated links are cut): they are
    those read off its weights (network._pairs), and so is its set of links."""
    plans, _ = _plans(_scenario(name), 0)
    seeded = orbit = 0
    for phases in (*plans["plans"].values(), *plans["full"].values()):
        for plan in phases:
            got = plan.__dict__.get("pairs")
            if got is None:
                continue
            seeded += 1
            orbit += any(isinstance(w, int) for ws in plan.weights for _, w in ws)
            want = network._pairs(plan.weights)
            assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(got, want))
            assert plan.edges == frozenset(e for ws in plan.weights for e, _ in ws)
    SEEDED[name] = (seeded, orbit)
    assert seeded > 0  # every scenario here has plans on arrays (at least its cut ones)


def test_plans_with_orbit_weights_carried_arrays_too():
    """Not vacuous: orbit weights (member counts) were among the plans checked above."""
    if len(SEEDED) < len(VARIANTS) + 1:
        pytest.skip("runs after the test above, in the same session")
    assert sum(orbit for _, orbit in SEEDED.values()) > 0
