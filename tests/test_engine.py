"""Engine against closed forms: pipeline bubble, ring all-reduce, op sums, symmetry collapse."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest

import clustersim
from clustersim.analysis.metrics import step_metrics
from clustersim.collectives import ring_allreduce_time_s
from clustersim.engine import Engine, run_program
from clustersim.hardware.topology import TopologyCfg, build_cluster
from clustersim.model import transformer as tf
from clustersim.plan.mesh import Mesh
from clustersim.program.costs import adam_step_time_s, ops_time_s
from clustersim.program.lower import Lowering, Symmetry, run_passes
from clustersim.program.tasks import Comm, Program
from clustersim.program.work import Block, StageWork
from clustersim.schedule import build_schedule

from .conftest import scenario_dict


def node_cluster(gpus: int, gpu: str = "A100-SXM4-80GB", **nvlink):
    cfg = TopologyCfg.model_validate({"gpu": gpu, "nodes": 1, "node": {"gpus": gpus, "nvlink": nvlink},
                                      "fabric": {"kind": "none"}})
    return build_cluster(cfg)


def uniform_pipeline_trace(schedule: str, p: int, m: int, f_s: float, b_s: float, layers: int = 1):
    """p equal stages of ``layers`` blocks, free communication, no optimizer time."""
    mesh = Mesh(tp=1, dp=1, pp=p)
    fwd = tuple(Block("f", i, f_s / layers, 0.0, 0.0, 0.0) for i in range(layers))
    bwd = tuple(Block("b", i, b_s / layers, 0.0, 0.0, 0.0) for i in range(layers))
    work = [StageWork(fwd, bwd, optimizer_s=0.0, local_params=0.0, activation_bytes_per_mb=0.0,
                      pp_send_bytes=1e6)] * p
    low = Lowering(mesh=mesh, schedule=build_schedule(schedule, p, m), work=work, sym=Symmetry(mesh, True))
    return run_program(run_passes(low), node_cluster(p), network="ideal")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 8), (4, 4), (3, 7), (8, 16), (8, 3)])
def test_bubble_matches_closed_form(schedule, p, m):
    trace = uniform_pipeline_trace(schedule, p, m, f_s=1.0, b_s=2.0, layers=3)
    metrics = step_metrics(trace, world_size=p, peak_flops=1.0, tokens_per_step=1)
    expected = (p - 1) / (m + p - 1)
    assert metrics["bubble_fraction"] == pytest.approx(expected, rel=1e-6, abs=1e-12)
    assert metrics["step_time_s"] == pytest.approx((m + p - 1) * 3.0, rel=1e-9)


def test_1f1b_holds_at_most_p_microbatches_gpipe_m():
    from clustersim.analysis.memory import inflight_peak

    p, m = 4, 8
    one = uniform_pipeline_trace("1f1b", p, m, 1.0, 2.0)
    gp = uniform_pipeline_trace("gpipe", p, m, 1.0, 2.0)
    assert [inflight_peak(one, r) for r in one.ranks] == [4, 3, 2, 1]
    assert [inflight_peak(gp, r) for r in gp.ranks] == [m] * p


RING = {"all_reduce": "ring"}  # these tests hold the ring itself to its closed form


def _one_allreduce(cluster, size_bytes: float, key=("tp", (0,), 0)):
    n = cluster.num_gpus
    prog = Program(ranks=[0], weight={0: n})
    prog.add(rank=0, stream="tp", name="AR", kind="tp",
             comm=Comm("all_reduce", size_bytes, tuple(range(n)), (), (0,), key))
    return prog


@pytest.mark.parametrize("size_bytes", [1 << 20, 64 << 20, 1 << 30])
def test_ring_allreduce_on_one_node_matches_alpha_beta(size_bytes):
    cl = node_cluster(8, bw_GBps=300, efficiency=0.77, latency_us=1.5)
    trace = run_program(_one_allreduce(cl, size_bytes), cl, algorithms=RING)
    (span,) = trace.spans
    bw_Bps = 300e9 * 0.77
    alpha_s = 2 * 1.5e-6  # GPU -> NVSwitch -> GPU
    assert span.dur_s == pytest.approx(ring_allreduce_time_s(size_bytes, 8, bw_Bps, alpha_s), rel=0.01)


def test_flow_network_gives_same_time_alone_and_halves_bandwidth_when_shared():
    """Two all-reduces of different channels over the same NVLinks: alone each takes T;
    at the same time they share every link and both take ~2T minus one latency."""
    cl = node_cluster(4, bw_GBps=100, efficiency=1.0, latency_us=0.0)
    size = 100e6
    t_alone = ring_allreduce_time_s(size, 4, 100e9, 0.0)
    prog = Program(ranks=[0], weight={0: 4})
    group = (0, 1, 2, 3)
    a = prog.add(rank=0, stream="s1", name="a", kind="tp", comm=Comm("all_reduce", size, group, (), (0,), ("x", 1, 0)))
    prog.add(rank=0, stream="s2", name="b", kind="dp", comm=Comm("all_reduce", size, group, (), (0,), ("y", 1, 0)))
    trace = run_program(prog, cl, algorithms=RING)
    assert [s.dur_s for s in trace.spans] == pytest.approx([2 * t_alone, 2 * t_alone], rel=1e-9)
    # sequential (b waits for a): each alone, though the engine had to use the flow model
    prog.tasks[1].deps = (a.tid,)
    trace = run_program(prog, cl, algorithms=RING)
    assert sorted(s.dur_s for s in trace.spans) == pytest.approx([t_alone, t_alone], rel=1e-9)


def test_single_gpu_step_is_the_sum_of_op_times(root):
    d = scenario_dict(cluster={"topology": "topologies/single-h100.yaml", "nodes": 1},
                      parallel={"tp": 1, "pp": 1, "dp": 1}, training={"global_batch_size": 3})
    sc = clustersim.load_scenario(d, base_dir=root)
    m, gpu, prec = sc.model, sc.cluster.gpu, "bf16"
    layer_ops = tf.attn_block_fwd(m, 1, 1, True) + tf.mlp_block_fwd(m, 1, 1)
    bwd_ops = tf.block_bwd(tf.attn_block_fwd(m, 1, 1, True), True) + tf.block_bwd(tf.mlp_block_fwd(m, 1, 1), True)
    head, emb = tf.head_fwd(m, 1, 1), tf.embedding_fwd(m, 1, 1)
    per_mb = (m.layers * (ops_time_s(layer_ops, gpu, prec) + ops_time_s(bwd_ops, gpu, prec))
              + ops_time_s(head + emb, gpu, prec) + ops_time_s(tf.block_bwd(head + emb, True), gpu, prec))
    expected = 3 * per_mb + adam_step_time_s(tf.total_params(m), gpu)
    result = clustersim.simulate(sc)
    assert result.summary["step_time_s"] == pytest.approx(expected, rel=1e-9)
    assert result.summary["bubble_fraction"] == pytest.approx(0.0, abs=1e-12)
    assert result.summary["exposed_comm_s"]["total"] == 0.0


@pytest.mark.parametrize("parallel, rel", [
    ({"tp": 4, "pp": 2, "dp": 2}, 1e-9),
    ({"tp": 2, "pp": 2, "dp": 4}, 1e-9),
    ({"tp": 2, "pp": 2, "dp": 4, "order": "tp-pp-dp"}, 1e-9),
    ({"tp": 1, "pp": 4, "dp": 4, "order": "tp-pp-dp"}, 1e-9),
    # stage 1 (GPUs 4-7) sends to stage 2 (GPUs 8-11) across rails: PXN forwards through GPUs
    # 0-3 of stage 0, whose DP ring the collapsed run sees only on its simulated member
    ({"tp": 1, "pp": 4, "dp": 4, "schedule": "gpipe"}, 1e-3),
])
def test_collapsed_symmetric_ranks_give_the_same_numbers_as_all_ranks(root, parallel, rel):
    sc = clustersim.load_scenario(scenario_dict(parallel=parallel, training={"global_batch_size": 32}), base_dir=root)
    full = clustersim.simulate(sc, collapse=False).summary
    rep = clustersim.simulate(sc, collapse=True).summary
    assert rep["simulation"]["simulated_ranks"] == parallel["pp"]
    assert full["simulation"]["simulated_ranks"] == 16
    for key in ("step_time_s", "bubble_fraction", "mfu", "hfu", "compute_s"):
        assert rep[key] == pytest.approx(full[key], rel=rel), key
    for kind, v in full["exposed_comm_s"].items():
        assert rep["exposed_comm_s"][kind] == pytest.approx(v, rel=rel, abs=1e-15), kind
    assert rep["memory"] == full["memory"]


def test_model_flops_per_step_match_6N_plus_attention(root):
    d = scenario_dict(parallel={"tp": 4, "pp": 2, "dp": 2}, training={"global_batch_size": 16})
    sc = clustersim.load_scenario(d, base_dir=root)
    s = clustersim.simulate(sc).summary
    expected = tf.model_flops_per_token_closed_form(sc.model) * sc.tokens_per_step
    assert s["model_flops_per_step"] == pytest.approx(expected, rel=0.01)
    assert s["mfu"] == pytest.approx(expected / (s["step_time_s"] * 16 * 312e12), rel=0.01)


def test_collapse_on_an_asymmetric_fabric_is_conservative(root, tmp_path):
    """Stage 1 spans two leaf groups, so some twins cross a spine and the simulated rank's
    transfers do not: the orbit moves at its slowest member's pace (an upper bound that
    stays close), where the all-ranks run lets each replica go at its own."""
    import yaml

    topo = yaml.safe_load((root / "topologies/dgx-a100.yaml").read_text())
    topo["node"]["gpus"] = 4
    topo["node"]["nics"] = 4
    topo["fabric"]["nodes_per_leaf"] = 3
    topo["fabric"]["spines"] = 2
    topo["fabric"]["oversubscription"] = 4  # the spine is the bottleneck of the twins that cross it
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(topo))
    d = scenario_dict(cluster={"topology": str(tmp_path / "t.yaml"), "nodes": 4},
                      parallel={"tp": 4, "pp": 2, "dp": 2}, training={"global_batch_size": 16})
    sc = clustersim.load_scenario(d, base_dir=root)
    full = clustersim.simulate(sc, collapse=False).summary["step_time_s"]
    rep = clustersim.simulate(sc, collapse=True).summary["step_time_s"]
    assert full <= rep <= 1.10 * full


def test_all_to_all_inside_a_node_is_bound_by_each_gpus_nvlink():
    cl = node_cluster(8, bw_GBps=100, efficiency=1.0, latency_us=0.0)
    size = 64e6  # each rank's buffer
    prog = Program(ranks=[0], weight={0: 8})
    prog.add(rank=0, stream="ep", name="a2a", kind="ep",
             comm=Comm("all_to_all", size, tuple(range(8)), (), (0,), ("ep", (0,), 0)))
    (span,) = run_program(prog, cl, algorithms=RING).spans
    assert span.dur_s == pytest.approx(7 / 8 * size / 100e9, rel=1e-9)


def test_all_to_all_across_nodes_is_bound_by_the_nics(root):
    from clustersim.hardware import load_topology_cfg

    cl = build_cluster(load_topology_cfg(root / "topologies/dgx-h100.yaml", {"nodes": 2}))
    group = (0, 8)  # GPU 0 of each node: one NIC each way
    size = 100e6
    prog = Program(ranks=[0], weight={0: 2})
    prog.add(rank=0, stream="ep", name="a2a", kind="ep",
             comm=Comm("all_to_all", size, group, (), (0,), ("ep", (0,), 0)))
    (span,) = run_program(prog, cl, algorithms=RING).spans
    nic_Bps = 400e9 / 8 * 0.9
    lat = cl.path_latency_s(cl.path(0, 8))
    assert span.dur_s == pytest.approx(lat + size / 2 / nic_Bps, rel=1e-9)


def test_ring_across_nodes_uses_every_nic(root):
    """16 GPUs on 2 nodes: 8 channels, each leaving a node through a different NIC, so the
    all-reduce runs at 8 NICs' bandwidth, not one (NCCL's multi-ring behaviour)."""
    from clustersim.hardware import load_topology_cfg

    cl = build_cluster(load_topology_cfg(root / "topologies/dgx-h100.yaml", {"nodes": 2}))
    size = 1 << 30
    prog = Program(ranks=[0], weight={0: 16})
    prog.add(rank=0, stream="dp", name="AR", kind="dp",
             comm=Comm("all_reduce", size, tuple(range(16)), (), (0,), ("dp", (0,), 0)))
    (span,) = run_program(prog, cl, algorithms=RING).spans
    nic_Bps = 400e9 / 8 * 0.9
    alpha_s = cl.path_latency_s(cl.path(7, 8))  # the slowest hop sets a ring step's latency
    expected = ring_allreduce_time_s(size / 8, 16, nic_Bps, alpha_s)
    assert span.dur_s == pytest.approx(expected, rel=0.01)


def test_same_group_on_two_streams_shares_the_links():
    """ZeRO-3 gathers (stream zero) and gradient reductions (stream dp) of one DP group can
    run at once: they are separate channels and must share bandwidth, not each get it all."""
    cl = node_cluster(4, bw_GBps=100, efficiency=1.0, latency_us=0.0)
    size = 100e6
    t_alone = ring_allreduce_time_s(size, 4, 100e9, 0.0)
    prog = Program(ranks=[0], weight={0: 4})
    group = (0, 1, 2, 3)
    for i, stream in enumerate(("zero", "dp")):
        prog.add(rank=0, stream=stream, name=stream, kind="dp",
                 comm=Comm("all_reduce", size, group, (), (0,), ("dp", (0,), i)))
    trace = run_program(prog, cl, algorithms=RING)
    assert [s.dur_s for s in trace.spans] == pytest.approx([2 * t_alone, 2 * t_alone], rel=1e-9)


@pytest.mark.parametrize("first_s,second_s", [(1.0, 3.0), (3.0, 1.0)])
def test_a_flow_timed_collective_of_two_members_starts_at_the_later_arrival(first_s, second_s):
    """Two simulated ranks reach one all-reduce after computing for different times; another
    channel later on the same links makes the flow network time it. Whichever member the
    engine reaches first, and however far ahead of the clock, the collective runs from the
    later arrival on both, for its time alone, and what follows it on each rank starts at
    its end."""
    cl = node_cluster(4, bw_GBps=100, efficiency=1.0, latency_us=0.0)
    size = 100e6
    t_alone = ring_allreduce_time_s(size, 4, 100e9, 0.0)
    prog = Program(ranks=[0, 1], weight={0: 2, 1: 2})
    group = (0, 1, 2, 3)
    ar = []
    for rank, compute_s in ((0, first_s), (1, second_s)):
        c = prog.add(rank=rank, stream="compute", name="F", kind="compute", duration_s=compute_s)
        ar.append(prog.add(rank=rank, stream="tp", name="AR", kind="tp", deps=(c.tid,),
                           comm=Comm("all_reduce", size, group, (), (0, 1), ("tp", (0,), 0))))
        prog.add(rank=rank, stream="compute", name="after", kind="compute", duration_s=0.5, deps=(ar[-1].tid,))
    prog.add(rank=0, stream="dp", name="later", kind="dp", deps=(ar[0].tid,),
             comm=Comm("all_reduce", size, group, (), (0,), ("dp", (0,), 0)))
    engine = Engine(prog, cl, algorithms=RING)
    assert engine.fixed_comm_s(ar[0].comm, "tp") < 0  # the flow network times it
    trace = engine.run()
    by_name = {}
    for s in trace.spans:
        by_name.setdefault(s.name, []).append(s)
    late = max(first_s, second_s)
    for s in by_name["AR"]:
        assert (s.start_s, s.end_s) == pytest.approx((late, late + t_alone), rel=1e-12)
    for s in by_name["after"]:
        assert s.start_s == pytest.approx(late + t_alone, rel=1e-12)


def _h100(root, nodes=2):
    from clustersim.hardware import load_topology_cfg

    return build_cluster(load_topology_cfg(root / "topologies/dgx-h100.yaml", {"nodes": nodes}))


def test_flows_no_fair_share_can_tell_apart_are_merged_into_one_standing_for_all(root):
    """A tree all-reduce over 4 nodes x 8 GPUs, one flow per hop, runs 7 of its 8 channels'
    chains, each twice (half the data for each tree), over every NVLink hop of a node (its 8
    ring hops, both ways), and its two trees over the 4 nodes (NCCL's: 1-2, 2-0, 3-2 and,
    mirrored, 2-1, 1-3, 0-1) share one of their three edges (heads 1-2, both ways): flows on
    the same links, of the same share. network._merged keeps one of each, its weights times
    their count: 4 x 8 x 2 x 14 chain flows and 8 x 2 x 3 x 2 tree flows become 4 x 16 and
    8 x 10, of weights 14, 1 and 2. It
    ends when the unmerged plan ends, and puts the same bytes on every link. (The engine's
    tree moves each tree of a channel in lock-step, one flow each: 16, nothing to merge.)"""
    import simpy

    from clustersim.collectives.algorithms import phases
    from clustersim.engine.network import FlowNetwork, _merged, plan_phases
    from clustersim.program.tasks import Comm

    cl = _h100(root, 4)
    group = tuple(range(32))
    comm = Comm("all_reduce", 2.0 ** 30, group, (), (0,), ("c", (0,), 0))
    (planned,) = plan_phases(cl, comm, "tree")
    assert len(planned.weights) == 16 and _merged(planned) is planned
    (expansion,) = phases("all_reduce", "tree", group, cl.node_of)
    assert len(expansion.flows) == 4 * 8 * 2 * 14 + 8 * 2 * 3 * 2
    # one flow per chain and tree edge, as the expansion lists them
    unmerged = dataclasses.replace(planned, weights=tuple(tuple((e, 1.0) for e in cl.pxn_path(a, b))
                                                          for a, b, _ in expansion.flows),
                                   fractions=tuple(x for _, _, x in expansion.flows))
    merged = _merged(unmerged)
    assert len(merged.weights) == 4 * 16 + 8 * 10
    assert _merged(merged) is merged  # nothing left to merge
    assert sorted({w for ws in merged.weights for _, w in ws}) == [1.0, 2.0, 14.0]

    def run(plan):
        env = simpy.Environment()
        net = FlowNetwork(env, cl.edge_bw_Bps)
        net.transfer(plan, comm.size_bytes)
        env.run()
        (_, size, _, _, end, _), = net.finished
        on_links = np.zeros(len(cl.edges))
        for ws, b in zip(plan.weights, size):
            for e, w in ws:
                on_links[e] += w * b
        return float(np.nanmax(end)), on_links

    end, on_links = run(merged)
    end2, on_links2 = run(unmerged)
    assert end == pytest.approx(end2, rel=1e-12)
    assert np.allclose(on_links, on_links2, rtol=1e-12, atol=0)


def _link_bytes(plan) -> Counter:
    """Per link, the bytes ``plan`` puts on it per byte of the buffer: weight x share."""
    out = Counter()
    for ws, x in zip(plan.weights, plan.fractions):
        for e, w in ws:
            out[e] += w * x
    return out


@pytest.mark.parametrize("op, algo, one_member, flows", [
    ("all_reduce", "ring", False, 8),  # 2 nodes x 8 GPUs: a channel per member of a node
    ("all_reduce", "ring", True, 1),  # one member's hops stand for all: one pipeline
    ("all_gather", "ring", False, 8),
    # per position, each tree with its half of the chains; over two nodes the two trees
    # cross the same links and are merged (network._merged)
    ("all_reduce", "tree", False, 8),
    ("all_reduce", "hierarchical", False, 1),
    ("all_reduce", "hierarchical", True, 1),
    ("all_to_all", "pxn", False, 16 * 15),  # every pair on its own
])
def test_each_pipeline_of_a_plan_is_one_flow_with_the_hops_bytes(root, op, algo, one_member, flows):
    """plan_phases makes each pipeline of the expansion (Expansion.lockstep) one flow, for
    whole instances and for one member standing for all, and so does the maker kept for the
    twins' meetings (with_meetings); every link carries per byte of the buffer what the
    expansion's hops put on it, routed one by one."""
    from clustersim.collectives.algorithms import phases
    from clustersim.engine.network import plan_phases, with_meetings
    from clustersim.program.tasks import Comm

    cl = _h100(root, 2)
    group = tuple(range(16))
    comm = Comm(op, 2.0 ** 30, group, (), (0,) if one_member else group, ("c", (0,), 0))
    kept: dict = {}
    (plan,) = plan_phases(cl, comm, algo, kept=kept)
    assert len(plan.weights) == flows
    assert len(with_meetings(kept[0], np.zeros(0, dtype=np.int64)).weights) == flows
    (expansion,) = phases(op, algo, group, cl.node_of)
    if one_member:
        return  # (its weights are per member: every member's hops stand on the simulated one's)
    hops = Counter()
    for a, b, x in expansion.flows:
        for e in (cl.pxn_path(a, b) if a != b else ()):
            hops[e] += x
    planned = _link_bytes(plan)
    assert sorted(planned) == sorted(hops)
    assert all(planned[e] == pytest.approx(hops[e], rel=1e-12) for e in hops)


@pytest.mark.parametrize("algo", ["ring", "tree", "hierarchical"])
@pytest.mark.parametrize("group", [(0, 1, 2, 3, 4, 9, 10, 11, 12, 13), (0, 2, 4, 5, 6, 9, 11, 12, 14, 15),
                                   (0, 1, 2, 9, 10, 12), tuple(range(16))])
def test_a_collective_alone_takes_its_closed_form_in_the_flow_network(root, algo, group):
    """Alone, a pipeline takes its busiest link's time, which is the closed form the tuner and
    the "alone" shortcut use. Hop by hop, a tree or hierarchical all-reduce over GPUs at
    different positions in their nodes (a PXN hop through a node-mate beside a chain's hop on
    one NVLink) took up to 21 % less in the network than its closed form said."""
    import simpy

    from clustersim.engine.network import FlowNetwork, max_min_rates, plan_phases
    from clustersim.program.tasks import Comm

    cl = _h100(root, 2)
    size = 2.0 ** 28
    comm = Comm("all_reduce", size, group, (), tuple(sorted(group)), ("c", (0,), 0))
    (plan,) = plan_phases(cl, comm, algo)
    rates = max_min_rates(list(plan.weights), cl.edge_bw_Bps)
    closed_s = plan.latency_s + max(f * size / r for f, r in zip(plan.fractions, rates))
    env = simpy.Environment()
    net = FlowNetwork(env, list(cl.edge_bw_Bps))
    ends = []
    net.transfer(plan, size, on_done=lambda: ends.append(env.now))
    env.run()
    assert ends == [pytest.approx(closed_s, rel=1e-12)]


def test_a_pipelines_hops_move_as_one_flow_carrying_each_links_bytes():
    """network._in_lockstep: each run of flows becomes one flow over all their links, each
    link weighing its hop's weight times its share over the largest, a link two hops cross
    both; every link carries the bytes it did per unit of progress."""
    from clustersim.engine.network import ALL_ONE, FlowPlan, _in_lockstep

    plan = FlowPlan(weights=(((0, 1.0), (1, 2.0)), ((1, 1.0),), ((2, 1.0),), ((3, 4.0), (0, 1.0))),
                    fractions=(0.5, 0.25, 0.5, 0.5), latency_s=1e-6)
    two = _in_lockstep(plan, 2)
    assert two.fractions == (0.5, 0.5) and two.latency_s == plan.latency_s
    assert two.weights == (((0, 1.0), (1, 2.5)), ((0, 1.0), (2, 1.0), (3, 4.0)))
    one = _in_lockstep(plan, ALL_ONE)
    assert one.weights == (((0, 2.0), (1, 2.5), (2, 1.0), (3, 4.0)),)

    assert _link_bytes(two) == _link_bytes(plan) == _link_bytes(one)
    assert _in_lockstep(plan, 0) is plan and _in_lockstep(plan, 1) is plan


@pytest.mark.parametrize("size", [3, 40, -1])
def test_a_plans_pipelines_summed_on_its_arrays_are_the_loops_bit_for_bit(size):
    """A large plan (its pairs as arrays, LOCKSTEP_ARRAY_PAIRS or more) is made one flow per
    pipeline on its arrays: the same weights, bit for bit, as the loop over its tuples, and
    the arrays of the new plan are those its tuples give."""
    from clustersim.engine.network import LOCKSTEP_ARRAY_PAIRS, FlowPlan, _in_lockstep, _pairs, with_pairs

    rng = np.random.default_rng(7)
    weights = tuple(tuple((int(e), float(w)) for e, w in zip(rng.choice(3000, k, replace=False), rng.random(k) * 3))
                    for k in rng.integers(1, 80, 120))
    fractions = tuple(float(x) for x in rng.choice([0.0, 0.25, 0.5, 1 / 3], 120))
    plan = FlowPlan(weights=weights, fractions=fractions, latency_s=0.0)
    assert len(_pairs(weights)[1]) >= LOCKSTEP_ARRAY_PAIRS
    looped = _in_lockstep(plan, size)
    on_arrays = _in_lockstep(with_pairs(FlowPlan(weights=weights, fractions=fractions, latency_s=0.0),
                                         _pairs(weights)), size)
    assert "pairs" in on_arrays.__dict__ and "pairs" not in looped.__dict__
    assert on_arrays.weights == looped.weights and on_arrays.fractions == looped.fractions
    for got, want in zip(on_arrays.pairs, _pairs(looped.weights)):
        assert np.array_equal(got, want)


def test_a_ring_in_lock_step_leaves_what_its_slowest_hop_holds_it_to():
    """A ring channel of three hops, each on its own link of bandwidth C; two flows share
    hop 1's link, one flow Y hop 2's. All of size B. Hop by hop, hop 2 and Y share their
    link evenly and Y ends at 2B/C. In lock-step the ring moves at its slowest hop's pace,
    C/3 (three flows on hop 1's link), so Y gets 2C/3 and ends at 1.5B/C; the ring and the
    two flows end at 3B/C either way, every hop at once in lock-step."""
    import simpy

    from clustersim.engine.network import FlowNetwork, FlowPlan, _in_lockstep

    c_Bps, b = 100e9, 1e9
    ring = FlowPlan(weights=(((0, 1.0),), ((1, 1.0),), ((2, 1.0),)), fractions=(1.0, 1.0, 1.0), latency_s=0.0)

    def run(ring_plan):
        env = simpy.Environment()
        net = FlowNetwork(env, [c_Bps] * 3)
        ends = {}
        for tag, plan in [("ring", ring_plan), ("x1", FlowPlan((((0, 1.0),),), (1.0,), 0.0)),
                          ("x2", FlowPlan((((0, 1.0),),), (1.0,), 0.0)), ("y", FlowPlan((((1, 1.0),),), (1.0,), 0.0))]:
            net.transfer(plan, b, tag=tag, on_done=lambda tag=tag: ends.__setitem__(tag, env.now))
        env.run()
        hops = {tag: end for tag, _, _, _, end, _ in net.finished}
        return ends, hops["ring"]

    ends, hops = run(ring)
    assert ends["y"] == pytest.approx(2 * b / c_Bps, rel=1e-12)
    assert ends["ring"] == pytest.approx(3 * b / c_Bps, rel=1e-12)
    ends, hops = run(_in_lockstep(ring, 3))
    assert ends["y"] == pytest.approx(1.5 * b / c_Bps, rel=1e-12)
    assert ends["ring"] == ends["x1"] == pytest.approx(3 * b / c_Bps, rel=1e-12)
    assert len(hops) == 1


def test_cross_rail_transfers_go_through_the_pxn_proxy(root):
    """GPU 2 of node 0 to GPU 5 of node 1: NVLink to GPU 5 of node 0, then rail 5 only."""
    cl = _h100(root)
    assert cl.pxn_proxy(2, 13) == 5
    assert cl.pxn_proxy(5, 13) is None and cl.pxn_proxy(2, 5) is None  # same rail; same node
    hops = [cl.edges[e] for e in cl.pxn_path(2, 13)]
    assert hops[0] == ("n0.gpu2", "n0.nvsw") and ("n0.nic5", "leaf0.5") in hops
    assert not any("spine" in u or "spine" in v for u, v in hops)


def _time(cl, comm):
    prog = Program(ranks=list(comm.members), weight={m: 1 for m in comm.members})
    for m in comm.members:
        prog.add(rank=m, stream="x", name="c", kind="ep", comm=comm)
    return max(s.dur_s for s in run_program(prog, cl, algorithms=RING).spans)


@pytest.mark.parametrize("op, group", [
    ("all_to_all", tuple(range(16))),
    ("all_to_all", tuple(range(0, 16, 2))),
    ("all_reduce", tuple(range(16))),
    ("reduce_scatter", tuple(range(0, 16, 2))),
])
def test_one_members_flows_stand_for_the_whole_collective(root, op, group):
    """A symmetric collective with one simulated member is planned from that member's flows
    (2(n-1) for an all-to-all instead of n(n-1)) and takes exactly the time of all its flows.
    (A ring's channels that take the same links with the same share are one flow of their
    count's weight: network._merged; an all-to-all's flows all differ.)"""
    from clustersim.engine.network import plan_flows

    cl = _h100(root)
    size = 256e6
    one = Comm(op, size, group, (), (group[0],), ("ep", (0,), 0))
    every = Comm(op, size, group, (), group, ("ep", group, 0))
    n = len(group)
    flows_one, flows_every = len(plan_flows(cl, one).weights), len(plan_flows(cl, every).weights)
    if op == "all_to_all":
        assert (flows_one, flows_every) == (2 * (n - 1), n * (n - 1))
    else:
        assert flows_one <= 2 * (n // 2) and flows_one < flows_every <= n * (n // 2)
    assert _time(cl, one) == pytest.approx(_time(cl, every), rel=1e-9)


def test_cross_node_all_to_all_is_bound_by_the_nics_through_pxn(root):
    """16 GPUs on 2 nodes: each GPU's 8/16 of its buffer leaves the node; PXN puts all of it
    on the NIC of the destination's rail, one NIC per GPU, so the NICs bound the time."""
    cl = _h100(root)
    size = 512e6
    group = tuple(range(16))
    t = _time(cl, Comm("all_to_all", size, group, (), (0,), ("ep", (0,), 0)))
    nic_Bps = 400e9 / 8 * 0.9
    assert t == pytest.approx(size / 2 / nic_Bps, rel=0.01)


def test_dominated_links_with_a_flow_listed_twice_on_a_link_keep_its_last_weight(monkeypatch):
    """The arrays cannot tell two entries of one flow on one link apart: the loop decides, with
    the flow's last weight there (as a dict of the flow's weights keeps it)."""
    from clustersim.engine import sim as engine_sim
    from clustersim.engine.sim import _dominated_links

    on_edge = {0: [(0, 0, 1.0)], 1: [(0, 0, 0.5), (0, 0, 2.0), (0, 1, 1.0)]}
    for rows_from in (0, 10**9):
        monkeypatch.setattr(engine_sim, "DOMINATED_ROWS_FROM", rows_from)
        assert _dominated_links(on_edge, [10.0, 10.0]) == {0}  # link 1 carries flow 0 at 2.0 >= 1.0


def test_dominated_links_are_dropped_and_equivalent_ones_kept():
    """Flow 0 crosses links 0 and 1, flow 1 crosses link 1 only: link 0's constraint
    (flow 0 alone) is implied by link 1's when link 1 is no wider, and not when it is wider."""
    from clustersim.engine.sim import _dominated_links

    on_edge = {0: [(0, 0, 1.0)], 1: [(0, 0, 1.0), (0, 1, 1.0)]}
    assert _dominated_links(on_edge, [10.0, 10.0]) == {0}
    assert _dominated_links(on_edge, [5.0, 10.0]) == set()  # link 0 is the narrower


@pytest.mark.parametrize("seed", range(6))
def test_dropping_dominated_links_keeps_every_max_min_rate(seed, monkeypatch):
    """Random flows over random links, some crossing hundreds (a flow standing for many twins):
    the fair shares with the dominated links dropped are those with every link, in every mix.
    The links dropped are the same with the implying links found on arrays or by the loop
    (DOMINATED_ROWS_FROM), and without the filter by weight per capacity that candidate sets of
    the big flows go through first (LOAD_FILTER_FROM)."""
    from clustersim.engine import sim as engine_sim
    from clustersim.engine.network import max_min_rates
    from clustersim.engine.sim import _dominated_links

    rng = np.random.default_rng(seed)
    n_links = 300
    bw = rng.choice([25e9, 50e9, 100e9, 400e9], size=n_links).tolist()
    flows = []
    for k in range(40):
        n = int(rng.integers(200, 300)) if k < 3 else int(rng.integers(1, 8))
        links = rng.choice(n_links, size=n, replace=False).tolist()
        flows.append(tuple((e, float(rng.choice([0.5, 1.0, 2.0, 3.0]))) for e in sorted(links)))
    on_edge: dict[int, list] = {}
    for fi, ws in enumerate(flows):
        for e, w in ws:
            on_edge.setdefault(e, []).append((0, fi, w))
    dropped = _dominated_links({e: on_edge[e] for e in sorted(on_edge)}, bw)
    assert dropped  # the big flows' links imply many of their own
    monkeypatch.setattr(engine_sim, "DOMINATED_ROWS_FROM", 10**9)  # the loop alone
    assert _dominated_links({e: on_edge[e] for e in sorted(on_edge)}, bw) == dropped
    monkeypatch.setattr(engine_sim, "LOAD_FILTER_FROM", 10**9)
    assert _dominated_links({e: on_edge[e] for e in sorted(on_edge)}, bw) == dropped
    monkeypatch.setattr(engine_sim, "DOMINATED_ROWS_FROM", 0)  # implying links on arrays, every size
    assert _dominated_links({e: on_edge[e] for e in sorted(on_edge)}, bw) == dropped
    kept = [tuple((e, w) for e, w in ws if e not in dropped) for ws in flows]
    for mix in (range(40), range(0, 40, 2), range(3, 40), [0, 5, 6, 7]):
        full = max_min_rates([flows[i] for i in mix], bw)
        less = max_min_rates([kept[i] for i in mix], bw)
        np.testing.assert_allclose(less, full, rtol=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_implying_links_on_arrays_check_crowded_links_flow_by_flow(seed, monkeypatch):
    """Links that carry dozens of flows: the arrays check each (implied, implying) pair in
    rounds of 2, 4, 8, ... of its flows and drop it at its first failing flow; the links
    dropped are the loop's, given as a dict or as arrays (``_LinkFlows``, its flows numbered
    by rank or with gaps), and some are dropped only after several rounds."""
    from clustersim.engine import sim as engine_sim
    from clustersim.engine.sim import _dominated_links, _LinkFlows

    rng = np.random.default_rng(100 + seed)
    n_links = 30
    bw = rng.choice([50e9, 100e9], size=n_links).tolist()
    on_edge: dict[int, list] = {}
    for fi in range(120):
        links = rng.choice(n_links, size=int(rng.integers(2, 7)), replace=False)
        w = float(rng.choice([1.0, 2.0]))
        for e in sorted(links.tolist()):
            on_edge.setdefault(e, []).append((fi % 3, fi, w * float(rng.choice([1.0, 1.0, 0.5]))))
    # a link every flow of link 0 crosses too, more heavily: it implies link 0 only after all of them
    on_edge[n_links] = [(p, f, 2 * w) for p, f, w in on_edge[0]]
    bw.append(bw[0])
    on_edge = {e: sorted(on_edge[e]) for e in sorted(on_edge)}
    assert max(map(len, on_edge.values())) > 16  # several rounds
    monkeypatch.setattr(engine_sim, "DOMINATED_ROWS_FROM", 10**9)
    by_loop = _dominated_links(on_edge, bw)
    assert 0 in by_loop
    monkeypatch.setattr(engine_sim, "DOMINATED_ROWS_FROM", 0)
    assert _dominated_links(on_edge, bw) == by_loop
    arrays = _LinkFlows.of(on_edge)
    assert _dominated_links(arrays, bw) == by_loop
    numbered = _LinkFlows(arrays.links, arrays.ptr, arrays.plan, arrays.flow, arrays.weight,
                          arrays.plan * 1000 + arrays.flow)  # ids with gaps, in (plan, flow) order
    assert _dominated_links(numbered, bw) == by_loop
    assert numbered.as_dict() == on_edge
    # flows numbered against their order on each link (the entries' keys unsorted: sorted first)
    backwards = _LinkFlows(arrays.links, arrays.ptr, arrays.plan, arrays.flow, arrays.weight,
                           arrays.flow_id.max() - arrays.flow_id)
    assert _dominated_links(backwards, bw) == by_loop


@pytest.mark.parametrize("collide", [False, True])
def test_links_with_the_same_flows_are_merged_as_tuples_would_merge_them(collide, monkeypatch):
    """``_LinkFlows.distinct`` keeps the first link of each set with the same bandwidth and
    the same (plan, flow, weight) entries in the same order, found by hashing and checked entry
    by entry: the links a dict of tuples keeps, also when every hash is the same (collisions,
    the check fails and the tuples decide)."""
    from clustersim.engine import sim as engine_sim
    from clustersim.engine.sim import _LinkFlows

    if collide:
        monkeypatch.setattr(engine_sim, "_mix64", lambda x: x * np.uint64(0))
    rng = np.random.default_rng(5)
    bw = [100e9, 100e9, 50e9] * 40
    base = [[(0, 1, 1.0), (0, 2, 0.5)], [(0, 1, 1.0)], [(1, 0, 2.0), (0, 1, 1.0)], [(0, 2, 0.5), (0, 1, 1.0)],
            [(0, 1, 1.0), (0, 2, -0.0)], [(0, 1, 1.0), (0, 2, 0.0)]]
    on_edge = {e: list(base[int(rng.integers(len(base)))]) for e in range(120)}
    canon: dict = {}
    expected = [e for e, sig in on_edge.items() if canon.setdefault((bw[e], tuple(sig)), e) == e]
    arrays = _LinkFlows.of(on_edge)
    kept = arrays.distinct(bw)
    assert arrays.links[kept].tolist() == expected
    assert 6 < len(expected) < 120
    assert arrays.subset(kept).as_dict() == {e: on_edge[e] for e in expected}


def _max_min_matrix(weights, bw_Bps) -> list[float]:
    """The progressive filling the numpy version replaced, on a dense flows x links matrix (a
    reference for its bit-for-bit claim)."""
    sizes = [len(ws) for ws in weights]
    rows = np.repeat(np.arange(len(weights)), sizes)
    edges = np.array([e for ws in weights for e, _ in ws], dtype=np.int64)
    xs = np.array([x for ws in weights for _, x in ws], dtype=float)
    links, cols = np.unique(edges, return_inverse=True)
    w = np.zeros((len(weights), len(links)))
    np.add.at(w, (rows, cols), xs)
    cap = np.array([bw_Bps[e] for e in links.tolist()], dtype=float)
    load = w.sum(axis=0)
    rates = np.full(len(weights), np.inf)
    open_ = np.asarray([bool(ws) for ws in weights])
    live = load > 1e-12
    while open_.any():
        ratio = np.full(len(links), np.inf)
        ratio[live] = np.maximum(cap[live], 0.0) / load[live]
        r = ratio.min()
        full = live & (ratio <= r * (1 + 1e-12))
        newly = open_ & (w[:, full] > 0).any(axis=1)
        rates[newly] = r
        open_ &= ~newly
        moved = w[newly]
        cap -= moved.sum(axis=0) * r
        load -= moved.sum(axis=0)
        live &= (load > 1e-12) & ~full
    return rates.tolist()


def _fair_share_mix(seed: int) -> tuple[list, list[float]]:
    """A random mix: most flows cross a few links, some (flows standing for many twins) hundreds,
    with weights of 1 to 4 (real flows a simulated one stands for)."""
    rng = np.random.default_rng(seed)
    n_links = 400
    bw = rng.choice([25e9, 50e9, 100e9, 450e9], size=n_links).tolist()
    flows = []
    for k in range(int(rng.integers(60, 200))):
        n = int(rng.integers(100, 300)) if k % 25 == 0 else int(rng.integers(1, 10))
        links = sorted(rng.choice(n_links, size=n, replace=False).tolist())
        flows.append(tuple((e, float(rng.integers(1, 5))) for e in links))
    return flows, bw


@pytest.mark.parametrize("rounds", ["masks", "rows"])
@pytest.mark.parametrize("seed", range(8))
def test_max_min_rates_are_fair_and_the_same_in_numpy_and_in_loops(seed, rounds, monkeypatch):
    """Max-min fairness, checked from its definition: no link carries more than its bandwidth,
    and every flow crosses a full link on which no flow gets more (so no flow can go faster
    without slowing one that is no faster). The numpy version (large mixes) and the loop
    version give the same rates; the numpy version's rounds find the pairs they touch by
    masks over every pair (up to MASK_PAIRS pairs) or by the rows of the links and flows, to
    the same bits."""
    from clustersim.engine import network
    from clustersim.engine.network import _max_min_loops, _max_min_numpy, max_min_rates

    monkeypatch.setattr(network, "MASK_PAIRS", 10**9 if rounds == "masks" else 0)
    flows, bw = _fair_share_mix(seed)
    rates = max_min_rates(flows, bw)
    assert rates == _max_min_numpy(flows, bw)  # a mix this large takes the numpy version
    assert rates == _max_min_matrix(flows, bw)  # bit for bit what the flows x links matrix gave
    np.testing.assert_allclose(rates, _max_min_loops(flows, bw), rtol=1e-12)
    load: dict[int, float] = {}
    on: dict[int, list[int]] = {}
    for i, ws in enumerate(flows):
        for e, w in ws:
            load[e] = load.get(e, 0.0) + w * rates[i]
            on.setdefault(e, []).append(i)
    assert all(load[e] <= bw[e] * (1 + 1e-9) for e in load)
    for i, ws in enumerate(flows):
        assert any(load[e] >= bw[e] * (1 - 1e-9) and rates[i] >= max(rates[j] for j in on[e]) * (1 - 1e-9)
                   for e, _ in ws), f"flow {i} has no bottleneck link"


@pytest.mark.parametrize("seed", range(6))
def test_without_the_flows_of_the_top_fill_level_the_others_keep_their_rates_bit_for_bit(seed):
    """What FlowNetwork._rates_left relies on: a flow frozen at the top fill level crosses no
    link that filled below it, so removing every flow of that level leaves the other flows'
    rates exactly as they were, in the numpy version and in the loop version. Removing only
    some of them does not (the rest of the level rises)."""
    from clustersim.engine.network import _max_min_loops, max_min_rates

    flows, bw = _fair_share_mix(seed)
    if seed % 2:  # a small mix: max_min_rates takes the loop version
        flows = [ws[:3] for ws in flows[:40]]
    for solve in (max_min_rates, _max_min_loops):
        rates = solve(flows, bw)
        for _ in range(4):  # peel the levels off one after another, as a transfer alone ends
            top = max(rates)
            rest = [i for i, r in enumerate(rates) if r < top]
            if not rest:
                break
            again = solve([flows[i] for i in rest], bw)
            assert again == [rates[i] for i in rest]
            flows, rates = [flows[i] for i in rest], again
    flows, bw = _fair_share_mix(seed)
    rates = max_min_rates(flows, bw)
    top_level = [i for i, r in enumerate(rates) if r == max(rates)]
    shared = [i for i in range(len(flows)) if i != top_level[0] and set(dict(flows[i])) & set(dict(flows[top_level[0]]))]
    if len(top_level) == 1 and shared:  # the flow set free was a constraint on some other one
        again = max_min_rates([f for i, f in enumerate(flows) if i != top_level[0]], bw)
        assert again == [r for i, r in enumerate(rates) if i != top_level[0]]


def _course_ends(plan, bw, size_bytes, shortcut: bool):
    """Flow ends and rate rows of ``plan`` moving ``size_bytes`` alone, with or without
    FlowNetwork._rates_left's shortcut; how many fair shares were worked out."""
    import simpy

    from clustersim.engine.network import FlowNetwork

    env = simpy.Environment()
    net = FlowNetwork(env, bw)
    worked = []  # how many flows each fair share was worked out for
    solve = net._max_min_of

    def counted(comp, flows=None, bw_Bps=None):
        worked.append(sum(map(len, flows)) if flows is not None else sum(len(t.idx) for t in comp))
        return solve(comp, flows, bw_Bps)

    net._max_min_of = counted
    if not shortcut:
        net._rates_left = lambda t, was: net._rates_of([t])[t.key]
    net.transfer(plan, size_bytes)
    env.run()
    (_, _, times, rows, end, _), = net.finished
    return end.tolist(), [r.tolist() for r in rows], times, worked


@pytest.mark.parametrize("fractions", [(1.0, 1.0, 1.0, 1.0, 1.0), (1.0, 1.0, 0.5, 1.0, 1.0)])
def test_a_transfer_alone_ends_level_by_level_without_working_its_shares_out_again(fractions):
    """A transfer alone whose flows end a whole fill level at a time keeps the other flows'
    rates without a fair share per level, and ends exactly as when each one is worked out.
    Flows 0-3 share link 0 (100 B/s) and each has a link of its own (10, 20, 200, 200 B/s);
    flow 4 only has its own (5 B/s). Shares: 10, 20, 35, 35, 5. With equal sizes, flows 2
    and 3 (the top level) end together, then 1, then 0, then 4: one fair share in all. With
    flow 2 half as large, flow 3 is left alone at the top level and rises to 70 B/s: only
    its share is worked out again (FlowNetwork._rates_above)."""
    from clustersim.engine.network import FlowPlan

    bw = [100.0, 10.0, 20.0, 200.0, 200.0, 5.0]
    weights = tuple(((0, 1.0), (1 + i, 1.0)) for i in range(4)) + (((5, 1.0),),)
    plan = FlowPlan(weights=weights, fractions=fractions, latency_s=0.0)
    fast = _course_ends(plan, bw, 700.0, shortcut=True)
    slow = _course_ends(plan, bw, 700.0, shortcut=False)
    assert fast[:3] == slow[:3]  # the same ends, rate rows and times of change
    assert fast[1][0] == [10.0, 20.0, 35.0, 35.0, 5.0]
    if fractions[2] == 1.0:
        assert (fast[3], slow[3]) == ([5], [5, 3, 2, 1])
        assert fast[0] == [70.0, 35.0, 20.0, 20.0, 140.0]
    else:  # flow 3 is worked out again, alone, on what the three slower flows leave of its links
        assert (fast[3], slow[3]) == ([5, 1], [5, 4, 3, 2, 1])
        assert fast[1][1] == [10.0, 20.0, 0.0, 70.0, 5.0]  # flow 3, alone at the top, takes what link 0 has left


@pytest.mark.parametrize("columns", [False, True])
@pytest.mark.parametrize("join_s", [5.0, 25.0, 45.0])
def test_a_transfer_that_goes_back_has_the_state_it_has_instant_by_instant(join_s, columns, monkeypatch):
    """A transfer worked out ahead keeps, before each of its flow-end instants, its live flows
    and their bytes left (``columns``: as many flows as a DP ring over thousands of replicas,
    network.AHEAD_COLUMNS_FROM: the bytes left as steps from the first instant's, the live
    flows from their ends). When another transfer joins at ``join_s``
    it goes back to the first instant after it: bytes left of its live flows, ends (none yet
    for the live ones), live flows, rates, since when and rate changes are what the
    instant-by-instant network (no run-ahead) has at that moment. The flows of
    test_a_transfer_alone_ends_level_by_level_without_working_its_shares_out_again, flow 2
    half as large, alone: instants at 10 s (flow 2), 15 s (flow 3), 35 s (flow 1), 70 s
    (flow 0) and 140 s (flow 4)."""
    import simpy

    from clustersim.engine import network
    from clustersim.engine.network import FlowNetwork, FlowPlan

    if columns:
        monkeypatch.setattr(network, "AHEAD_COLUMNS_FROM", 2)
    bw = [100.0, 10.0, 20.0, 200.0, 200.0, 5.0, 50.0]
    weights = tuple(((0, 1.0), (1 + i, 1.0)) for i in range(4)) + (((5, 1.0),),)
    first = FlowPlan(weights=weights, fractions=(1.0, 1.0, 0.5, 1.0, 1.0), latency_s=0.0)
    joins = FlowPlan(weights=(((0, 1.0), (6, 1.0)),), fractions=(1.0,), latency_s=0.0)

    def state(t):
        return (t.rem[t.idx].tolist(), t.end.tolist(), t.idx.tolist(), t.live, t.rate.tolist(), t.at_s, len(t.times))

    def run(ahead: bool):
        env = simpy.Environment()
        net = FlowNetwork(env, bw)
        seen = []
        if ahead:
            back = net._back_to

            def went_back(t, now):
                back(t, now)
                seen.append(state(t))
            net._back_to = went_back
        else:
            net._run_ahead = lambda t: None
            join = net._join

            def joined(t, dirty):
                if t.weights is joins.weights:
                    seen.extend(state(g) for comp in net._comps.values() for g in comp)
                join(t, dirty)
            net._join = joined
        net.transfer(first, 700.0)
        net.transfer(joins, 500.0, at_s=join_s)
        env.run()
        return seen, [x for _, _, times, _, end, _ in net.finished for x in end.tolist() + times]

    (back,), ends_fast = run(True)
    (slow,), ends_slow = run(False)
    assert back[0] == slow[0] and back[2:] == slow[2:]
    np.testing.assert_array_equal(back[1], slow[1])  # (nan for the live flows)
    assert len(back[2]) == {5.0: 5, 25.0: 3, 45.0: 2}[join_s]
    assert ends_fast == pytest.approx(ends_slow, rel=1e-12)  # and both go on to the same ends


@pytest.mark.parametrize("same_time", [False, True])
def test_a_transfers_instants_give_back_each_state_it_passed_through(same_time):
    """The columns a transfer of many flows worked out ahead keeps (``network._Instants``:
    bytes left once, the step of each instant, the instant each flow ended at) give back,
    before each instant, the live flows and the bytes left that stepping the whole array gave,
    bit for bit, also where two instants fall at one time."""
    from clustersim.engine.network import _Instants

    rng = np.random.default_rng(3)
    n, t0 = 40, 7.3
    rem = rng.uniform(1e3, 1e6, n)
    idx, at_s, at = np.arange(0, n, 2), t0, t0
    ats, dts, rates, at_ss, n_rates, states = [], [], [], [], [], []
    ended_at = np.full(n, np.iinfo(np.int64).max)
    rate = rng.uniform(1.0, 1e3, n)
    for k in range(12):
        at = at if (same_time and k == 6) else at + float(rng.uniform(0.01, 2.0))
        ats.append(at - t0)
        moved = at != at_s
        dts.append(at - at_s if moved else 0.0)
        rates.append(rate)
        at_ss.append(at_s - t0)
        n_rates.append(k)
        states.append((idx.copy(), rem[idx].copy()))
        if moved:
            rem -= rate * (at - at_s)  # as FlowNetwork._catch_up
            at_s = at
        gone = idx[rng.random(len(idx)) < 0.2]
        ended_at[gone] = k
        idx = np.setdiff1d(idx, gone)
        if rng.random() < 0.5:
            rate = rate.copy()
            rate[idx] *= rng.uniform(0.5, 2.0, len(idx))
    got = _Instants(ats, dts, rates, at_ss, n_rates, states[0][0], states[0][1], ended_at, None, None)
    assert len(got.at_rel) == 12
    for k, (live, left) in enumerate(states):
        idx_k, rem_k = got.state(k)
        assert idx_k.tolist() == live.tolist()
        assert rem_k.tolist() == left.tolist()  # bit for bit


def _mix_finished(plans, sizes, bw, fresh: bool):
    """``net.finished`` of ``plans`` started together (``sizes`` bytes each) on links ``bw``;
    ``fresh``: every fair share worked out afresh (FlowNetwork._rates_above bypassed). Also
    how many flows the kept-rates path worked out again, and for how many it kept rates."""
    import simpy

    from clustersim.engine.network import FlowNetwork

    env = simpy.Environment()
    net = FlowNetwork(env, bw)
    seen = [0, 0]
    above = net._rates_above

    def counted(comp, keys, below):
        for t in comp:
            r = t.rate[t.idx]
            seen[0] += int((r >= below).sum())
            seen[1] += int((r < below).sum())
        return net._solved(comp, keys) if fresh else above(comp, keys, below)

    net._rates_above = counted
    for plan, size in zip(plans, sizes):
        net.transfer(plan, size)
    env.run()
    return [(end.tolist(), times, [r.tolist() for r in rows]) for _, _, times, rows, end, _ in net.finished], seen


@pytest.mark.parametrize("seed", range(8))
def test_when_flows_end_the_slower_ones_keep_their_rates_and_the_rest_share_what_they_leave(seed):
    """FlowNetwork._rates_above: once flows of a mix end, the flows that ran slower than the
    slowest of them keep their rates, and the others share what those leave. Max-min says so
    (a flow that ends at rate r* crosses no link that filled below r*), and the transfers
    end as when every share is worked out afresh, up to rounding. Random mixes of three
    transfers on shared links, flows of several sizes ending at many instants."""
    from clustersim.engine.network import FlowPlan

    rng = np.random.default_rng(seed)
    flows, bw = _fair_share_mix(seed)
    cut = sorted(rng.choice(np.arange(1, len(flows)), size=2, replace=False).tolist())
    groups = [flows[:cut[0]], flows[cut[0]:cut[1]], flows[cut[1]:]]
    plans = [FlowPlan(weights=tuple(g), fractions=tuple(rng.choice([0.25, 0.5, 1.0], size=len(g)).tolist()),
                      latency_s=0.0) for g in groups]
    sizes = rng.uniform(1e9, 4e9, size=3).tolist()
    kept, seen = _mix_finished(plans, sizes, bw, fresh=False)
    again, _ = _mix_finished(plans, sizes, bw, fresh=True)
    assert seen[0] > 0 and seen[1] > 0  # flows worked out again and flows that kept their rates
    for (end, times, rows), (end2, times2, rows2) in zip(kept, again):
        assert np.allclose(end, end2, rtol=1e-9, atol=0) and len(times) == len(times2)
        assert np.allclose(np.array(rows), np.array(rows2), rtol=1e-9, atol=0)


@pytest.mark.parametrize("rounds", ["masks", "rows"])
def test_a_flow_of_weight_0_on_a_full_link_does_not_freeze_there_in_numpy(rounds, monkeypatch):
    """The numpy version freezes the flows with weight on a link that fills, as the flows x
    links matrix did: a flow that crosses it with weight 0 rises on (here to its other link's
    10), by masks or by rows."""
    from clustersim.engine import network

    monkeypatch.setattr(network, "MASK_PAIRS", 10**9 if rounds == "masks" else 0)
    flows = [((0, 1.0),), ((0, 0.0), (1, 1.0))]
    assert network._max_min_numpy(flows, [1.0, 10.0]) == _max_min_matrix(flows, [1.0, 10.0]) == [1.0, 10.0]


def test_max_min_numpy_leaves_a_flow_listing_a_link_twice_to_the_loops():
    from clustersim.engine.network import _max_min_loops, _max_min_numpy, max_min_rates

    flows, bw = _fair_share_mix(0)
    flows[3] = flows[3] + (flows[3][0],)  # its first link twice: twice the weight there
    assert _max_min_numpy(flows, bw) is None
    assert max_min_rates(flows, bw) == _max_min_loops(flows, bw)


def test_span_base_sorts_as_pythons_stable_sort_and_keeps_the_columns():
    """The engine sorts the spans through their columns (SpanBase): the order of
    ``sorted(spans, key=(rank, start, end, stream))``, ties in the given order (spans of no
    length and equal times abound), and each row's columns still those of its span."""
    from operator import attrgetter

    from clustersim.trace import Span, SpanBase

    rng = np.random.default_rng(7)
    spans = []
    for i in range(3000):
        start = float(rng.integers(0, 20)) / 4 if i % 3 else int(rng.integers(0, 5))  # ints, as simpy's clock at 0
        end = start + float(rng.choice([0.0, 0.25, 0.5]))
        spans.append(Span(int(rng.integers(0, 4)), str(rng.choice(["tp", "compute", "pp_fwd_recv", "dp"])), "x",
                          "compute", start, end, tid=i))
    base = SpanBase.of(spans).sorted()
    expect = sorted(spans, key=attrgetter("rank", "start_s", "end_s", "stream"))
    assert [s.tid for s in base.spans] == [s.tid for s in expect]
    assert base.describes(base.spans) and not base.describes(spans)
    assert base.tid.tolist() == [s.tid for s in expect] and base.rank.tolist() == [s.rank for s in expect]
    assert base.start_s.tolist() == [s.start_s for s in expect] and base.end_s.tolist() == [s.end_s for s in expect]
    assert [base.stream_names[c] for c in base.stream.tolist()] == [s.stream for s in expect]
    assert base.stream_names == sorted(base.stream_names)


def _log_of_runs(seed: int) -> list:
    """A random engine log: spans and run records (SpanBase.of_log) over a few shared forms,
    runs of three templates whose forms the spans also use, first appearances interleaved."""
    from clustersim.trace import Span, SpanForm

    rng = np.random.default_rng(seed)
    forms = [SpanForm(st, f"t{k}", "compute" if st == "compute" else "tp", layer=k)
             for k, st in enumerate(["compute", "tp", "compute", "pp_fwd_send", "tp", "compute"])]
    templates = [tuple(forms[i] for i in idx) for idx in ([2, 1, 2], [5, 0], [4, 3, 4, 1])]
    log, tid = [], 0
    for _ in range(400):
        rank, mb = int(rng.integers(0, 3)), int(rng.integers(-1, 4))
        start = float(rng.integers(0, 40)) / 8
        if rng.random() < 0.4:
            log.append(Span.of_form(rank, forms[int(rng.integers(0, len(forms)))], start,
                                    start + float(rng.choice([0.0, 0.125])), mb, tid))
            tid += 1
        else:
            fs = templates[int(rng.integers(0, len(templates)))]
            starts = [start + i / 8 for i in range(len(fs))]
            ends = [s + float(rng.choice([0.0, 0.25])) for s in starts]
            log.append((tid, rank, mb, fs, starts, ends))
            tid += len(fs)
    return log


@pytest.mark.parametrize("seed", range(3))
def test_a_log_of_runs_reads_as_its_spans_written_out(seed):
    """SpanBase.of_log gives the columns of the spans the log stands for, forms numbered in
    order of first appearance as form_codes numbers them, without making the spans; made,
    they are those spans; sorted, the same order as the spans sorted."""
    from clustersim.trace import SpanBase, _written_out

    log = _log_of_runs(seed)
    spans = [s for x in log for s in _written_out(x)]
    got, want = SpanBase.of_log(log), SpanBase.of(spans)
    assert got.spans is None
    for attr in ("rank", "stream", "start_s", "end_s", "tid", "mb", "form"):
        a, b = getattr(got, attr), getattr(want, attr)
        assert a.dtype == b.dtype and np.array_equal(a, b), attr
    assert got.stream_names == want.stream_names and all(f is g for f, g in zip(got.forms, want.forms))
    assert len(got.forms) == len(want.forms)
    assert got.make_spans() == spans and got.spans is got.make_spans()
    g, w = SpanBase.of_log(log).sorted(), want.sorted()
    assert g.spans is None and np.array_equal(g.tid, w.tid) and np.array_equal(g.start_s, w.start_s)
    assert g.make_spans() == w.spans


def test_a_log_holding_an_int_time_keeps_it():
    """simpy's clock is the int 0 until it moves: a log holding such a time is written out as
    spans, which keep the int (a float column would not)."""
    from clustersim.trace import SpanBase

    log = _log_of_runs(0)
    k = next(i for i, x in enumerate(log) if type(x) is tuple)
    first, rank, mb, fs, starts, ends = log[k]
    log[k] = (first, rank, mb, fs, [0, *starts[1:]], ends)
    base = SpanBase.of_log(log)
    assert base.spans is not None
    held = [s for s in base.spans if s.tid == first]
    assert type(held[0].start_s) is int and held[0].start_s == 0


def test_a_trace_of_columns_makes_its_spans_once_read():
    """A trace handed the engine's columns only counts, views and reads a few spans without
    making them; reading ``spans`` makes them once, and so does dropping the columns."""
    from clustersim.trace import SpanBase, SpanRows, Trace, _written_out

    log = _log_of_runs(1)
    spans = [s for x in log for s in _written_out(x)]
    base = SpanBase.of_log(log)
    trace = Trace(spans=None, ranks=[0, 1, 2], weight={0: 1, 1: 1, 2: 1}, base=base)
    rows = trace.span_rows()
    assert isinstance(rows, SpanRows) and trace.span_rows() is rows and trace.n_spans == len(spans)
    assert rows[3] == spans[3] and rows[-1] == spans[-1] and rows[2:5] == spans[2:5]
    assert rows[3] is not rows[3]  # made when read, not kept
    part = rows.take(np.array([7, 1, 4]))
    assert list(part) == [spans[7], spans[1], spans[4]] and list(part.take(np.array([2, 0]))) == [spans[4], spans[7]]
    with pytest.raises(IndexError):
        rows[len(spans)]
    assert trace.columns().spans is rows and trace.end_s == max(s.end_s for s in spans)
    assert base.spans is None  # nothing made so far
    made = trace.spans
    assert made == spans and trace.spans is made and base.spans is made and trace.span_rows() is made
    again = Trace(spans=None, ranks=[0, 1, 2], weight={0: 1, 1: 1, 2: 1}, base=SpanBase.of_log(log))
    again.base = None  # the columns were the spans: made before they go
    assert again.spans == spans


def test_a_step_and_its_files_leave_the_spans_unmade(tmp_path):
    """The summary, the checks, the report and the trace file read the engine's columns: a
    step whose runs are recorded as such makes no span object (a 1T-parameter step would make
    918,852)."""
    from clustersim import codegen
    from clustersim.output.perfetto import write_trace
    from clustersim.output.report import write_report

    kept, after, look = dict(codegen._STRUCTURES), codegen.COMPILE_AFTER, codegen.LOOK_AFTER
    codegen._STRUCTURES.clear()
    codegen.COMPILE_AFTER = codegen.LOOK_AFTER = 1  # every template written out: runs recorded whole
    try:
        r = clustersim.simulate(scenario_dict(parallel={"tp": 8, "pp": 2, "dp": 1}))  # TP in a node: segments
    finally:
        codegen.COMPILE_AFTER, codegen.LOOK_AFTER = after, look
        codegen._STRUCTURES.clear()
        codegen._STRUCTURES.update(kept)
    base = r.trace.base
    write_report(tmp_path / "report.html", r.trace, r.summary)
    write_trace(tmp_path / "trace.json.gz", r.trace, r.summary)
    assert base.spans is None and r.summary["simulation"]["spans"] == len(base.rank) > 0
    assert (tmp_path / "report.html").stat().st_size > 0 and (tmp_path / "trace.json.gz").stat().st_size > 0


def test_a_trace_reads_its_engine_columns_once():
    """The summary's view and the display order reuse the columns the engine sorted by, and
    they are what reading the spans gives."""
    from clustersim.analysis.columns import SpanColumns
    from clustersim.output.perfetto import _span_order, span_order

    r = clustersim.simulate(scenario_dict(), check=False)
    trace = r.trace
    assert trace.base is not None and trace.base.describes(trace.spans)
    seeded, fresh = trace.columns(), SpanColumns(trace.spans, trace.ranks)
    for attr in ("rank", "tid", "start_s", "end_s", "stream"):
        got, want = getattr(seeded, attr), getattr(fresh, attr)
        assert got.dtype == want.dtype and np.array_equal(got, want), attr
    assert seeded.stream_names == fresh.stream_names
    order = span_order(trace)
    trace.base = None
    plain = _span_order(trace)
    assert order.rows == plain.rows and np.array_equal(order.index_array, plain.index_array) and order.bounds == plain.bounds
    assert np.array_equal(order.start_s, plain.start_s) and np.array_equal(order.end_s, plain.end_s)


def test_a_trace_edited_in_place_is_read_afresh_once_said():
    """The views of a trace are snapshots; after ``spans_edited`` every reader sees the edit."""
    from clustersim.output.perfetto import span_order

    trace = clustersim.simulate(scenario_dict(), check=False).trace
    before = float(trace.columns().start_s[5])
    span_order(trace)
    trace.spans[5].start_s += 0.5
    trace.spans_edited()
    assert trace.base is None
    assert float(trace.columns().start_s[5]) == before + 0.5
    assert 5 in [int(i) for i in span_order(trace).index_array]
    assert float(span_order(trace).start_s[span_order(trace).index_array.tolist().index(5)]) == before + 0.5


@pytest.mark.parametrize("seed", range(3))
def test_a_mix_put_together_from_plan_pairs_gets_the_same_rates(seed):
    """The flow network builds a large mix from each plan's (flow, link) pairs, kept per plan;
    the rates are bit for bit those of the flows' tuples, whichever flows are still live."""
    import simpy

    from clustersim.engine.network import FlowNetwork, _Transfer, max_min_rates

    from clustersim.engine.network import NUMPY_MIN_CELLS

    flows, bw = _fair_share_mix(seed)
    rng = np.random.default_rng(seed)
    for _ in range(80):  # flows standing for many twins: enough pairs for the numpy version
        links = sorted(rng.choice(len(bw), size=int(rng.integers(100, 300)), replace=False).tolist())
        flows.append(tuple((e, float(rng.integers(1, 5))) for e in links))
    cut = sorted(rng.choice(range(1, len(flows)), size=2, replace=False).tolist())
    plans = [tuple(flows[:cut[0]]), tuple(flows[cut[0]:cut[1]]), tuple(flows[cut[1]:])]
    net = FlowNetwork(simpy.Environment(), bw)
    for trial in range(3):
        comp = []
        for weights in plans:
            live = tuple(sorted(rng.choice(len(weights), size=max(1, len(weights) * (4 - trial) // 4),
                                           replace=False).tolist()))
            comp.append(_Transfer(weights, (), np.ones(len(weights)), None, live, np.asarray(live, dtype=np.int64),
                                  None, None))
        mix = [t.weights[i] for t in comp for i in t.live]
        assert sum(map(len, mix)) >= NUMPY_MIN_CELLS  # the pairs path, not the loops
        assert net._max_min_of(comp) == max_min_rates(mix, bw)
        # again, each transfer's live pairs now read from what the network kept by its key
        assert net._max_min_of(comp[::-1]) == max_min_rates([t.weights[i] for t in comp[::-1] for i in t.live], bw)


@pytest.mark.parametrize("seed", range(4))
def test_a_small_mix_gets_the_rates_max_min_rates_gives(seed):
    """Below NUMPY_MIN_CELLS pairs the flow network makes max_min_rates' choice (loops, or
    numpy where flows x links is large) on the plans' pairs, not on the flows' tuples: the
    rates are bit for bit max_min_rates' on the tuples, in each of its three cases."""
    import simpy

    from clustersim.engine import network
    from clustersim.engine.network import NUMPY_MIN_CELLS, FlowNetwork, _Transfer, max_min_rates

    rng = np.random.default_rng(seed)
    bw = [float(rng.integers(1, 9)) * 1e9 for _ in range(400)]
    net = FlowNetwork(simpy.Environment(), bw)
    seen = set()
    for n_flows, per_flow in ((3, 4), (6, 20), (40, 60), (30, 3)):  # < 64 pairs; loops; numpy; loops
        flows = tuple(tuple((int(e), float(rng.integers(1, 5)))
                            for e in sorted(rng.choice(len(bw), size=per_flow, replace=False).tolist()))
                      for _ in range(n_flows))
        cut = n_flows // 2
        comp = [_Transfer(w, (), np.ones(len(w)), None, tuple(range(len(w))), np.arange(len(w)), None, None)
                for w in (flows[:cut], flows[cut:])]
        mix = [f for t in comp for f in t.weights]
        pairs = sum(map(len, mix))
        links = len({e for f in mix for e, _ in f})
        assert pairs < NUMPY_MIN_CELLS
        seen.add("few" if pairs < 64 else "numpy" if len(mix) * links >= NUMPY_MIN_CELLS else "loops")
        calls = []
        pairs_fn = network._max_min_pairs
        network._max_min_pairs = lambda *a: calls.append(1) or pairs_fn(*a)
        try:
            got = net._max_min_of(comp)
        finally:
            network._max_min_pairs = pairs_fn
        assert got == max_min_rates(mix, bw)
        assert bool(calls) == (pairs >= 64 and len(mix) * links >= NUMPY_MIN_CELLS)
    assert seen == {"few", "numpy", "loops"}  # not vacuous


def test_spans_share_forms_and_read_as_before():
    # a span keeps its own fields and reads the shared ones from its form; setting a shared
    # field on one span must not change the others that share the form
    import copy
    import pickle

    from clustersim.trace import SPAN_FIELDS, Span, SpanForm

    form = SpanForm("compute", "F attn", "compute", "F", 2, 5, 0.0, "", 3e12, 2e12)
    a = Span.of_form(0, form, 0.5, 0.75, 3, 17)
    b = Span.of_form(8, form, 0.5, 0.75, 4, 18)
    assert a.form is b.form and isinstance(a, Span)
    assert (a.name, a.stream, a.stage, a.layer, a.flops, a.model_flops, a.dur_s) == ("F attn", "compute", 2, 5,
                                                                                     3e12, 2e12, 0.25)
    made = Span(0, "compute", "F attn", "compute", 0.5, 0.75, mb=3, phase="F", stage=2, layer=5, flops=3e12,
                model_flops=2e12, tid=17)
    assert made == a and made.form is not a.form and repr(made) == repr(a)
    assert list(a.as_dict()) == list(SPAN_FIELDS) and a.as_dict()["flops"] == 3e12
    b.name = "F mlp"
    assert (b.name, a.name, form.name) == ("F mlp", "F attn", "F attn") and b.form is not form
    assert b.form.values()[2:] == form.values()[2:]
    with pytest.raises(AttributeError):
        form.name = "x"
    assert pickle.loads(pickle.dumps(a)) == a and copy.deepcopy(a) == a and a != b


def test_rate_segments_of_a_plan_at_once_are_those_transfer_by_transfer(root):
    # the link-rate series stack every transfer of a plan (Engine._rate_segments): on the MoE
    # step's transfers timed in the network (all-to-alls sharing links, rates changing as
    # flows join and leave), every link's pieces must be those worked out transfer by
    # transfer, value for value and in the same order
    from clustersim.engine import Engine
    from clustersim.program.lower import lower

    sc = clustersim.load_scenario(root / "scenarios/moe_1024gpu.yaml")
    prog, _ = lower(sc)
    eng = Engine(prog, sc.cluster, "flow")
    eng.run()
    by_plan: dict[int, list] = {}
    for j, (whole, _, times, rates, ends, course) in enumerate(eng.net.finished):
        if course is None:
            by_plan.setdefault(id(whole), (whole, []))[1].append((j, times, rates, ends))
    changing = 0
    for whole, transfers in by_plan.values():
        cols = sorted(whole.edges)
        x = np.zeros((len(whole.weights), len(cols)))
        for i, ws in enumerate(whole.weights):
            for e, w in ws:
                x[i, cols.index(e)] = w
        one: dict[int, list] = {e: [] for e in cols}
        for _, times, rates, ends in transfers:  # transfer by transfer, written out
            t0 = np.asarray(times)[:, None]
            r = np.vstack(rates)
            t1 = np.minimum(np.append(t0[1:, 0], np.inf)[:, None], ends[None, :])
            k_idx, i_idx = np.nonzero((t1 > t0) & (r > 0))
            start, stop = t0[k_idx, 0], t1[k_idx, i_idx]
            moved = r[k_idx, i_idx] * (stop - start)
            for c, e in enumerate(cols):
                sel = x[i_idx, c] > 0
                if sel.any():
                    one[e].append((start[sel], stop[sel], moved[sel] * x[i_idx, c][sel]))
            changing += len(times) > 1
        at_once: dict[int, list] = {e: [] for e in cols}
        Engine._rate_segments((cols, x), transfers, at_once)
        for e in cols:
            if not one[e]:
                assert not at_once[e]
                continue
            _, start, stop, moved = map(np.concatenate, zip(*at_once[e]))
            for a, b in zip((start, stop, moved), map(np.concatenate, zip(*one[e]))):
                assert np.array_equal(a, b)
    assert len(by_plan) > 20 and changing > 100  # many plans, many transfers whose rates changed


def test_the_flow_network_caches_start_afresh_at_their_bound(monkeypatch):
    """A run meets a few thousand mixes of flows; a pathological one meeting a new mix at every
    event must not grow the caches without end: at CACHE_ENTRIES they start afresh."""
    from clustersim.engine import network

    monkeypatch.setattr(network, "CACHE_ENTRIES", 3)
    cache: dict = {}
    for k in range(3):
        network._remember(cache, k, k)
    assert cache == {0: 0, 1: 1, 2: 2}
    network._remember(cache, 3, "x")
    assert cache == {3: "x"}


@pytest.mark.parametrize("seed", range(4))
def test_few_flows_are_timed_on_python_floats_to_the_same_bits(seed, monkeypatch):
    """A transfer with few live flows finds its next flow end and its flows due on Python
    floats (network.FEW_FLOWS), more with numpy: both give the same instants and the same
    flows, bit for bit, including rates of 0, ties, and flows within a tick of their end."""
    import simpy

    from clustersim.engine import network

    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(300):
        n = int(rng.integers(1, 24))
        size = rng.choice([1e3, 1e6, rng.uniform(1e3, 1e9)], n)
        rate = np.where(rng.random(n) < 0.2, 0.0, rng.choice([2.5e10, rng.uniform(1e9, 5e10)], n))
        # some exactly at the due threshold (size * 1e-9, where that beats rate * tick), some just under
        rem = np.where(rng.random(n) < 0.4, size * rng.choice([0.0, 1e-9, 1e-10, 0.5], n), rng.uniform(0, 1, n) * size)
        live = tuple(sorted(rng.choice(n, int(rng.integers(1, n + 1)), replace=False).tolist()))
        cases.append((size, rate, rem, live, float(rng.uniform(0, 10)), float(rng.choice([0.0, 1e-9, 1e-6]))))

    def run() -> list:
        out = []
        for size, rate, rem, live, now, tick_s in cases:
            t = network._Transfer((), (), size, rem.copy(), live, np.array(live, dtype=np.int64), None, None,
                                  at_s=now, rate=rate, end=np.full(len(size), np.nan))
            network._set_next_end(t, now)
            first = t.next_s
            network.FlowNetwork(simpy.Environment(), [])._finish_due(t, now, tick_s)
            out.append((first, t.next_s, t.live, t.idx.tolist(), t.idx.dtype, t.end.tobytes()))
        return out

    monkeypatch.setattr(network, "FEW_FLOWS", 64)
    on_floats = run()
    monkeypatch.setattr(network, "FEW_FLOWS", 0)
    on_arrays = run()
    assert on_floats == on_arrays
    assert any(not a[2] for a in on_arrays) and any(len(a[2]) < len(c[3]) for a, c in zip(on_arrays, cases))


def test_stable_argsort_is_numpys_stable_sort():
    """trace.stable_argsort (16-bit radix passes) gives numpy's stable order, ties in place,
    below 2**16, below 2**32 and beyond (numpy's own), empty included."""
    from clustersim.trace import stable_argsort

    rng = np.random.default_rng(0)
    for high in (1, 300, 0xFFFF, 0x10000, 136_000, 1 << 31, 1 << 40):
        values = rng.integers(0, high + 1, size=5000).astype(np.int64)
        values[::7] = values[0]  # many ties
        assert np.array_equal(stable_argsort(values), np.argsort(values, kind="stable")), high
    assert np.array_equal(stable_argsort(np.array([3, -1, 3, 0])), [1, 3, 0, 2])
    assert np.array_equal(stable_argsort(np.array([0.5, 0.1, 0.5, 7.0])), [1, 0, 2, 3])  # floats: numpy's own
    assert len(stable_argsort(np.zeros(0, dtype=np.int64))) == 0


@pytest.mark.parametrize("n,high", [(0, 1), (1, 5), (500, 3), (20_000, 2**20), (3_000, 2**40)])
def test_first_and_inverse_is_what_np_unique_gives(n, high):
    """trace.first_and_inverse (and unique_inverse, its second half): each distinct value's
    first place and each value's rank, as np.unique gives them, below and above the radix
    sort's limits."""
    from clustersim.trace import first_and_inverse, unique_inverse

    values = np.random.default_rng(n).integers(0, high, n)
    _, want_first, want_inverse = np.unique(values, return_index=True, return_inverse=True)
    first, inverse = first_and_inverse(values)
    assert first.tolist() == want_first.tolist() and inverse.tolist() == want_inverse.reshape(-1).tolist()
    assert unique_inverse(values).tolist() == inverse.tolist()


def test_bytes_per_slice_of_the_step_are_never_negative():
    """A link's rate over the step (summary.json ``utilisation_over_time``) bins transfers by
    differences of cumulative sums; a slice where nothing ran came out a few bytes below zero
    (``-0.0`` once rounded), on most random draws of 50 short transfers over 10 s."""
    from clustersim.engine.sim import _binned

    rng = np.random.default_rng(1)
    for _ in range(50):
        start = np.sort(rng.uniform(0, 10, 50))
        end = start + rng.uniform(1e-4, 0.05, 50)
        size = rng.uniform(1e6, 1e9, 50)
        got = _binned([(start, end, size)], 10.0, 100)
        assert got.min() >= 0.0
        assert got.sum() == pytest.approx(size.sum(), rel=1e-9)


def test_bytes_per_slice_of_the_step_are_each_transfers_bytes_in_it():
    """Each slice of the step gets every transfer's bytes times the share of its time in the
    slice (a transfer spread evenly over [start, end]); one of no length lands whole in the
    slice of its start, and the last slice takes what runs past the step. Starts on the
    slices' edges included (the slices' running sums place a start at an edge in the slice
    it opens)."""
    from clustersim.engine.sim import _binned

    rng = np.random.default_rng(7)
    step_s, bins = 8.0, 40
    width = step_s / bins
    for _ in range(20):
        start = np.concatenate([rng.uniform(0, step_s, 200), rng.integers(0, bins, 50) * width])
        end = start + np.where(rng.random(250) < 0.1, 0.0, rng.uniform(0, 1.5, 250))
        size = rng.uniform(1e6, 1e9, 250)
        edges = np.arange(bins + 1) * width
        edges[-1] = max(step_s, float(end.max()))
        want = np.zeros(bins)
        for s, e, b in zip(start, end, size):
            if e <= s:
                want[min(int(s / width), bins - 1)] += b
                continue
            overlap = np.clip(np.minimum(edges[1:], e) - np.maximum(edges[:-1], s), 0.0, None)
            want += b * overlap / (e - s)
        got = _binned([(start[:100], end[:100], size[:100]), (start[100:], end[100:], size[100:])], step_s, bins)
        assert got == pytest.approx(want, rel=1e-9, abs=1e-6 * size.max())


def test_the_busiest_links_are_those_whose_rate_over_time_was_worked_out():
    """The engine works the rate over time out for the links of most bytes / bw, ties by name
    (Engine._link_use); the summary's busiest are the same links. Ranked by the mean (bytes /
    (bw x T)) instead, a last-bit difference in the bytes of links tied in bytes / bw put
    links without a series among them: DeepSeek-V3's NIC cables read a peak of 0 % under a
    mean of 55 % (these are its figures)."""
    from types import SimpleNamespace

    from clustersim.analysis.links import BUSIEST, link_report
    from clustersim.trace import LinkUse

    a, b, bw, step = 380586637687.244, 380586637687.24396, 45e9, 15.404269161898544
    assert a / bw == b / bw and a / (bw * step) != b / (bw * step)  # (tied for the engine, not by the mean)
    links = [LinkUse(f"leaf0.0->n{16 + i}.nic0", "nic", bw, a if i in (0, 8, 9) or i > 9 else b, 0.0)
             for i in range(2 * BUSIEST)]
    picked = sorted(links, key=lambda u: (-(u.bytes / u.bw_Bps), u.name))[:BUSIEST]  # (the engine's choice)
    for u in picked:
        u.peak_Bps, u.series_Bps = 1.27 * u.bytes / step, (u.bytes / step,) * 100
    busiest = link_report(SimpleNamespace(links=links), step)["busiest"]
    assert [x["link"] for x in busiest] == [u.name for u in picked]
    assert all(x["peak_utilisation"] >= x["utilisation"] and len(x["utilisation_over_time"]) == 100 for x in busiest)
