"""The deduplicating MoE dispatch (``model.moe.dispatcher: deepep``) and group-limited routing
(``router_groups``, ``router_group_top_k``): the chance a token reaches a GPU or node, the
flows, their time alone, the published DeepEP figures, the collapse and bad plans."""

from __future__ import annotations

from math import comb

import numpy as np
import pytest

import clustersim
from clustersim.collectives.algorithms import DEEPEP, DEEPEP_NVLINK_SHARE, deepep_flows, phases
from clustersim.model.moe import token_reach

from .conftest import scenario_dict

GiB = float(1 << 30)
MOE = {"layers": 4, "moe": {"experts": 64, "top_k": 4, "expert_ffn": 1024, "shared_experts": 1,
                            "dense_layers_first": 1, "dispatcher": "deepep"}, "mlp": "swiglu", "bias": False}
H100 = {"topology": "topologies/dgx-h100.yaml", "nodes": 4}  # 32 GPUs, 8 a node


def deepep_dict(moe=None, cluster=None, microbatches=2, simulation=None, **parallel) -> dict:
    model = {**MOE, "moe": {**MOE["moe"], **(moe or {})}}
    p = {"tp": 1, "pp": 1, "dp": 32, "ep": 16, **parallel}
    return scenario_dict(cluster={**H100, **(cluster or {})}, model=model, parallel=p,
                         training={"global_batch_size": microbatches * p["dp"]}, **({"simulation": simulation} if simulation else {}))


def run(root, collapse=None, **kw):
    return clustersim.simulate(clustersim.load_scenario(deepep_dict(**kw), base_dir=root), collapse=collapse)


# --- the routing ---------------------------------------------------------------------------------

@pytest.mark.parametrize("experts, top_k, groups, group_top_k, held", [
    (256, 8, 8, 4, range(32)),        # DeepSeek-V3: a node holding one group
    (256, 8, 8, 4, range(16, 48)),    # half of two groups
    (256, 8, 8, 4, range(4)),         # one GPU of EP64
    (256, 8, 1, 1, range(16)),        # no group limit
    (64, 6, 8, 3, (0, 9, 18, 27, 36)),  # scattered over five groups
])
def test_token_reach_matches_sampled_routing(experts, top_k, groups, group_top_k, held):
    """Tokens routed at random as the model says (groups first, then experts among theirs)
    reach ``held`` as often as the formula says, within four standard errors."""
    rng = np.random.default_rng(7)
    n, size = 100_000, experts // groups
    picked_groups = np.argsort(rng.random((n, groups)), axis=1)[:, :group_top_k]
    candidates = (picked_groups[:, :, None] * size + np.arange(size)).reshape(n, -1)
    picks = np.take_along_axis(candidates, np.argsort(rng.random(candidates.shape), axis=1)[:, :top_k], axis=1)
    sampled = np.isin(picks, list(held)).any(axis=1).mean()
    p = token_reach(experts, top_k, groups, group_top_k, tuple(held))
    assert abs(sampled - p) < 4 * (p * (1 - p) / n) ** 0.5


def test_token_reach_closed_forms():
    # no group limit: one minus the chance that all k picks miss h experts
    assert token_reach(256, 8, 1, 1, tuple(range(32))) == pytest.approx(1 - comb(224, 8) / comb(256, 8), rel=1e-12)
    # a whole group: its group picked (M/G), then at least one of its experts among the M E/G
    p = 4 / 8 * (1 - comb(96, 8) / comb(128, 8))
    assert token_reach(256, 8, 8, 4, tuple(range(32))) == pytest.approx(p, rel=1e-12)
    # every expert, or one expert alone (k/E of the tokens, whatever the groups)
    assert token_reach(64, 4, 8, 2, tuple(range(64))) == pytest.approx(1.0)
    assert token_reach(64, 4, 8, 2, (5,)) == pytest.approx(4 / 64, rel=1e-12)


# --- the flows -----------------------------------------------------------------------------------

def _by_pair(expansion) -> dict:
    out: dict = {}
    for a, b, x in expansion.flows:
        out[(a, b)] = out.get((a, b), 0.0) + x
    return out


@pytest.mark.parametrize("group, node_of", [
    (tuple(range(8)), lambda g: 0),            # one node
    (tuple(range(0, 64, 8)), lambda g: g // 8),  # one GPU on each of 8 nodes
])
def test_one_expert_per_gpu_sends_what_nccl_sends(group, node_of):
    """With one expert a GPU and one GPU a node there is nothing to deduplicate: each pair
    carries S/n, as NCCL's all-to-all."""
    n = len(group)
    (ours,) = phases("all_to_all", DEEPEP, group, node_of, (n, 2, 1, 1))
    (nccl,) = phases("all_to_all", "pxn", group, node_of)
    assert _by_pair(ours) == pytest.approx(_by_pair(nccl), rel=1e-12)


def test_tokens_cross_to_a_node_once():
    """EP16 over 2 nodes, 64 experts, top-4: each GPU sends a node P_N/k of its buffer over
    RDMA, to the GPU on its own rail there, and each node-mate N p/k over NVLink (its own
    tokens and those it forwards); NCCL sends (n - g)/n of it across nodes."""
    group = tuple(range(16))
    node_of = lambda g: g // 8  # noqa: E731
    e = deepep_flows(group, node_of, (64, 4, 1, 1))
    pairs = _by_pair(e)
    p_node = 1 - comb(32, 4) / comb(64, 4)  # a node holds 32 experts
    p_gpu = 1 - comb(60, 4) / comb(64, 4)
    for x in group:
        out = {b: s for (a, b), s in pairs.items() if a == x}
        remote = {b: s for b, s in out.items() if node_of(b) != node_of(x)}
        assert remote == pytest.approx({(x + 8) % 16: p_node / 4})  # same rail, the other node
        local = {b: s for b, s in out.items() if node_of(b) == node_of(x)}
        assert sorted(local) == [b for b in range(8 * node_of(x), 8 * node_of(x) + 8) if b != x]
        assert list(local.values()) == pytest.approx([2 * p_gpu / 4] * 7)
    assert p_node / 4 < 0.25  # NCCL: half the buffer crosses (8 of 16 GPUs remote), 0.96 of a copy vs 2
    assert e.steps == 2


def test_dispatch_time_alone_is_the_busier_of_rdma_and_nvlink(root):
    """Alone on 2 DGX-H100 nodes, a deduplicated dispatch takes, per byte of buffer, the longer
    of its RDMA share over a NIC's rate and its NVLink share over what DeepEP moves through an
    NVLink port: the two legs run at once (DeepEP pipelines the forwarding), on different
    links. What the links carry is the bytes themselves, whatever share of them DeepEP gets."""
    from clustersim.engine.sim import Engine
    from clustersim.hardware.topology import build_cluster, load_topology_cfg
    from clustersim.program.tasks import Comm, Program

    cl = build_cluster(load_topology_cfg(root / "topologies/dgx-h100.yaml", {"nodes": 2}))
    group, route = tuple(range(16)), (64, 4, 1, 1)

    def time_s(size, routing=route):
        prog = Program(ranks=list(group), weight=dict.fromkeys(group, 1), routing=routing)
        for r in group:
            prog.add(rank=r, stream="ep", name="a2a", kind="ep",
                     comm=Comm("all_to_all", size, group, (), group, ("ep", group, 0)))
        trace = Engine(prog, cl).run()
        assert set(trace.algorithms["all_to_all"]) == ({DEEPEP} if routing else {"pxn"})
        return max(s.end_s for s in trace.spans)

    per_byte_s = (time_s(2 * GiB) - time_s(GiB)) / GiB  # the latency rounds cancel
    bw = cl.edge_bw_Bps
    nic_Bps = min(bw[e] for e in cl.path(0, 8))
    nvlink_Bps = bw[cl.edge_index[("n0.gpu0", "n0.nvsw")]] * DEEPEP_NVLINK_SHARE  # DeepEP's share of NCCL's
    p_node, p_gpu = 1 - comb(32, 4) / comb(64, 4), 1 - comb(60, 4) / comb(64, 4)
    rdma, nvlink = p_node / 4, 7 * 2 * p_gpu / 4
    assert per_byte_s == pytest.approx(max(rdma / nic_Bps, nvlink / nvlink_Bps), rel=1e-9)
    nccl_per_byte_s = (time_s(2 * GiB, ()) - time_s(GiB, ())) / GiB
    assert per_byte_s < nccl_per_byte_s / 2
    # the links carry the bytes, not DeepEP's slower share of them: GPU 0's NIC and NVLink port
    prog = Program(ranks=list(group), weight=dict.fromkeys(group, 1), routing=route)
    for r in group:
        prog.add(rank=r, stream="ep", name="a2a", kind="ep", comm=Comm("all_to_all", GiB, group, (), group, ("ep", group, 0)))
    used = {u.name: u.bytes for u in Engine(prog, cl).run().links}
    nic = next(name for name in used if name.startswith("n0.nic0->"))
    assert used[nic] == pytest.approx(rdma * GiB, rel=1e-9)
    assert used["n0.gpu0->n0.nvsw"] == pytest.approx(nvlink * GiB, rel=1e-9)


def test_a_skewed_dispatch_crosses_nodes_at_its_node_s_load(root):
    """``ep_load`` on a deduplicated dispatch: tokens cross to a node for all its GPUs, so an
    RDMA flow follows the mean load of its node, an NVLink flow its GPU's, each saturating (a
    token crosses to a node once at most). On 2 nodes, RDMA-bound: one node hot as a whole (1.5,
    the other 0.5) slows it by what its extra tokens add; a hot GPU whose node is on average
    balanced (1.8 and 0.2 beside 1s) leaves it as it was."""
    from clustersim.engine.sim import Engine
    from clustersim.hardware.topology import build_cluster, load_topology_cfg
    from clustersim.program.tasks import Comm, Program

    cl = build_cluster(load_topology_cfg(root / "topologies/dgx-h100.yaml", {"nodes": 2}))
    group = tuple(range(16))

    def per_byte_s(load):
        def time_s(size):
            prog = Program(ranks=list(group), weight=dict.fromkeys(group, 1), routing=(64, 4, 1, 1))
            for r in group:
                prog.add(rank=r, stream="ep", name="a2a", kind="ep",
                         comm=Comm("all_to_all", size, group, (), group, ("ep", group, 0), load=load))
            return max(s.end_s for s in Engine(prog, cl).run().spans)
        return (time_s(2 * GiB) - time_s(GiB)) / GiB

    balanced = per_byte_s(())
    hot_node = (1.5,) * 8 + (0.5,) * 8
    hot_gpu = (1.8, 0.2) + (1.0,) * 14
    p_node = 1 - comb(32, 4) / comb(64, 4)
    for by_src in (False, True):  # dispatch (to the experts), combine (from them)
        # RDMA-bound: the hot node's tokens reach it at 1 - (1 - P)^1.5, not 1.5 x P (past every token once)
        assert per_byte_s((by_src, hot_node)) == pytest.approx((1 - (1 - p_node) ** 1.5) / p_node * balanced, rel=1e-9)
        assert per_byte_s((by_src, hot_gpu)) == pytest.approx(balanced, rel=1e-9)


@pytest.mark.parametrize("gpus, published_GBps, rel", [
    (8, 153, 0.01),    # intranode: what fits DEEPEP_NVLINK_SHARE
    (16, 43, 0.10),    # 2 nodes: bound by the NVLink forwarding, not fitted
    (32, 58, 0.05),    # 4 nodes: RDMA at the NICs' 0.9
    (64, 51, 0.05),    # 8 nodes, 4 node groups of 8: RDMA
])
def test_dispatch_matches_deepeps_published_bandwidth(root, gpus, published_GBps, rel):
    """DeepEP's normal kernels on H800 + 400 Gb/s IB (its README), as its
    tests count them: 4,096 tokens a GPU, hidden 7,168, top-8 of 256 experts, tokens limited to
    min(nodes, 4) node groups; the bandwidth is the bytes of every (token, GPU) pair a GPU
    receives, its own included, intranode, and of every (token, node) pair a GPU sends, its own
    node included, internode, over the dispatch's time. EP8 fits DeepEP's NVLink share; the
    others are predicted (EP16, bound by the forwarding over NVLink, 8 % fast)."""
    from clustersim.engine.sim import Engine
    from clustersim.hardware.topology import build_cluster, load_topology_cfg
    from clustersim.program.tasks import Comm, Program

    nodes = gpus // 8
    cl = build_cluster(load_topology_cfg(root / "topologies/h800-cluster.yaml", {"nodes": nodes}))
    group, route = tuple(range(gpus)), (256, 8, nodes, min(nodes, 4))
    tokens, hidden_bytes = 4096, 7168 * 2
    size = tokens * 8 * hidden_bytes  # one copy per (token, expert)
    prog = Program(ranks=[0], weight={0: gpus}, routing=route)
    prog.add(rank=0, stream="ep", name="a2a", kind="ep", comm=Comm("all_to_all", size, group, (), (0,), ("ep", (0,), 0)))
    time_s = Engine(prog, cl).run().spans[0].dur_s
    if nodes == 1:
        pairs = gpus * token_reach(*route, tuple(range(256 // gpus)))  # (token, GPU) pairs a GPU receives, a token
    else:
        pairs = nodes * token_reach(*route, tuple(range(256 // nodes)))  # (token, node) pairs a GPU sends
    got_GBps = pairs * tokens * hidden_bytes / time_s / 1e9
    assert got_GBps == pytest.approx(published_GBps, rel=rel)
    row = next(line for line in (root / "docs/network.md").read_text().splitlines() if f"DeepEP, EP{gpus} " in line)
    assert f"{got_GBps:.1f} GB/s" in row.split("|")[3]  # docs/network.md's calibration table quotes it


# --- end to end ----------------------------------------------------------------------------------

def test_deepep_shortens_a_cross_node_step_and_nothing_else(root):
    """EP16 over 2 nodes: the same memory, less exposed EP time; what changes is what the
    all-to-alls move, and that the sending rank permutes nothing: NCCL's all-to-all takes each
    token's copies in order of their experts (``permute``) and sums them back after the
    combine (``unpermute``), once in every router and experts block, forward or backward (a
    permutation's gradient is one pass too), where DeepEP's receiver does that work (the
    experts' own sorts, as NCCL's receiver sorts by local expert)."""
    ours, nccl = run(root), run(root, moe={"dispatcher": "alltoall"})
    assert ours.summary["step_time_s"] < nccl.summary["step_time_s"]
    assert ours.summary["exposed_comm_s"]["ep"] < nccl.summary["exposed_comm_s"]["ep"]
    assert ours.summary["memory"]["stages"][0]["peak_bytes"] == nccl.summary["memory"]["stages"][0]["peak_bytes"]

    def compute_s(r):
        return sum(s.dur_s for s in r.trace.spans if s.kind == "compute")

    from clustersim.model.moe import permutations
    from clustersim.program.costs import op_time_s

    sc = nccl.scenario
    tokens = sc.training.micro_batch_size * sc.model.seq_len
    (one,) = {op_time_s(op, sc.cluster.gpu, sc.training.precision) for op in permutations(sc.model.moe, tokens, sc.model.hidden,
                                                                                  1.0)}
    blocks = sum(1 for s in nccl.trace.spans if s.kind == "compute" and s.name.endswith((" router", " experts")))
    assert blocks > 0 and compute_s(nccl) - compute_s(ours) == pytest.approx(blocks * one, rel=1e-9)
    assert ours.summary["simulation"]["collective_algorithms"]["all_to_all"] == {
        DEEPEP: sum(nccl.summary["simulation"]["collective_algorithms"]["all_to_all"].values())}


@pytest.mark.parametrize("kw", [
    {},
    {"moe": {"router_groups": 4, "router_group_top_k": 2}},
    {"moe": {"ep_load": [1.6, 0.4] + [1.0] * 14}},
    {"tp": 2, "dp": 16, "ep": 8, "etp": 1, "sp": True},
    {"ep": 8, "moe": {"router_groups": 16, "router_group_top_k": 4}},
    {"pp": 2, "dp": 16, "ep": 16, "cluster": {"what_if": [{"gpu": 3, "slowdown": 1.2}]}},
], ids=["balanced", "groups", "skewed", "tp2-etp1", "in-node-groups", "pp2-slow-gpu"])
def test_collapse_equals_every_rank(root, kw):
    rep, full = run(root, **kw), run(root, collapse=False, **kw)
    for key in ("step_time_s", "mfu", "bubble_fraction"):
        assert rep.summary[key] == pytest.approx(full.summary[key], rel=1e-9), key
    for kind, x in full.summary["exposed_comm_s"].items():
        assert rep.summary["exposed_comm_s"][kind] == pytest.approx(x, rel=1e-9, abs=1e-15), kind
    assert rep.summary["simulation"]["simulated_ranks"] < full.summary["simulation"]["simulated_ranks"]


def test_node_limited_routing_sends_less_across_nodes(root):
    """EP32 over 4 nodes: tokens limited to 2 of 4 node-sized groups reach fewer nodes, so the
    step is shorter than with unlimited routing, which is shorter than NCCL's copies."""
    kw = {"ep": 32}
    limited = run(root, moe={"router_groups": 4, "router_group_top_k": 2}, **kw).summary["step_time_s"]
    free = run(root, **kw).summary["step_time_s"]
    nccl = run(root, moe={"dispatcher": "alltoall"}, **kw).summary["step_time_s"]
    assert limited < free < nccl


def test_the_plan_says_deepep(root):
    from clustersim.output.summary import plan_dims

    r = run(root)
    assert r.summary["plan"]["dispatcher"] == DEEPEP
    assert plan_dims(r.summary["plan"], " x ") == "TP1 x PP1 x DP32 (EP16 over 2 nodes, DeepEP)"
    assert plan_dims(run(root, moe={"dispatcher": "alltoall"}).summary["plan"], " x ") == \
        "TP1 x PP1 x DP32 (EP16 over 2 nodes)"


# --- the SMs DeepEP's kernels hold ------------------------------------------------------------------

def test_an_op_on_a_share_of_the_sms():
    """The tensor-core peak scales with the SMs an op gets; HBM bandwidth does not."""
    from clustersim.hardware.gpus import lookup_gpu
    from clustersim.model.transformer import Op
    from clustersim.program.costs import op_time_s

    gpu, share = lookup_gpu("H800"), (132 - 20) / 132
    gemm = Op("expert_up", flops=4e12, bytes=1e6)
    copy = Op("permute", flops=1e6, bytes=4e9)
    assert op_time_s(gemm, gpu, "bf16", share) == pytest.approx(op_time_s(gemm, gpu, "bf16") / share, rel=1e-12)
    assert op_time_s(copy, gpu, "bf16", share) == op_time_s(copy, gpu, "bf16")
    assert gpu.sms == 132 and lookup_gpu("A100").sms == 108 and lookup_gpu("B200").sms == 148


def _compute_by_tid(r) -> dict[int, tuple[float, float]]:
    return {s.tid: (s.end_s - s.start_s, s.flops) for s in r.trace.spans if s.kind == "compute"}


def test_dualpipe_chunks_compute_on_the_sms_deepep_leaves(root):
    """Under DualPipe one half of an overlapped F&B chunk dispatches or combines while the
    other computes, so the chunk's GEMMs run on the 112 of 132 SMs DeepEP's 20 leave; outside
    the chunks, and with deepep_sms 0, the compute is what it was. (Every GEMM at one efficiency,
    so that a chunk's GEMMs take 132/112 as long at most; by their shapes the waves over 112 SMs
    fill differently too: tests/test_gemm_shapes.py.)"""
    kw = {"pp": 2, "dp": 16, "ep": 16, "schedule": "dualpipe", "microbatches": 8, "simulation": {"gemm_efficiency": "flat"}}
    ours, free = run(root, **kw), run(root, moe={"deepep_sms": 0}, **kw)
    a, b = _compute_by_tid(ours), _compute_by_tid(free)
    assert a.keys() == b.keys()
    ratios = [a[t][0] / b[t][0] for t in a if b[t][0] > 0]
    most = 132 / 112
    assert all(1 - 1e-12 <= x <= most * (1 + 1e-12) for x in ratios)
    assert max(ratios) > 1.1  # the expert blocks, mostly GEMMs (the op-level closed form: above)
    assert sum(abs(x - 1) < 1e-12 for x in ratios) > 0  # the warm-up's forwards: outside the chunks
    assert all(a[t][1] == b[t][1] for t in a)  # the same FLOPs, more time
    assert ours.summary["step_time_s"] > free.summary["step_time_s"]
    assert ours.summary["mfu"] < free.summary["mfu"]
    every = run(root, collapse=False, **kw).summary  # the collapse still stands for every rank
    assert every["step_time_s"] == pytest.approx(ours.summary["step_time_s"], rel=1e-9)
    # without overlapped chunks (1F1B) the kernels take nothing from a GEMM
    plain = {"pp": 2, "dp": 16, "ep": 16}
    assert _compute_by_tid(run(root, **plain)) == _compute_by_tid(run(root, moe={"deepep_sms": 0}, **plain))


# --- bad plans -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, field, words", [
    ({"ep": 1}, "model.moe.dispatcher", "needs parallel.ep > 1"),
    ({"tp": 2, "dp": 16, "ep": 8, "sp": True}, "model.moe.dispatcher", "etp (as tp)=2"),
    ({"moe": {"capacity_factor": 1.25, "pad_to_capacity": True}}, "model.moe.dispatcher",
         "deepep does not pad expert batches to capacity"),
    ({"order": "tp-cp-dp-ep-pp"}, "model.moe.dispatcher", "an EP group of 16 holds 4 of a node's 8"),
    ({"dp": 24, "ep": 12, "moe": {"experts": 48}, "cluster": {"nodes": 3}}, "model.moe.dispatcher",
     "an EP group of 12 holds 4 or 8 of a node's 8"),
    ({"moe": {"router_groups": 6, "router_group_top_k": 2, "experts": 48}}, "model.moe.router_groups",
     "groups of 8 experts straddle the EP ranks' 3"),
    ({"moe": {"router_groups": 8}}, "model.moe", "router_groups needs model.moe.router_group_top_k"),
    ({"moe": {"router_groups": 5, "router_group_top_k": 2}}, "model.moe", "router_groups=5 does not divide"),
    ({"moe": {"router_groups": 4, "router_group_top_k": 5}}, "model.moe", "router_group_top_k=5 exceeds"),
    ({"moe": {"router_groups": 32, "router_group_top_k": 1}}, "model.moe", "top_k=4 exceeds the 2 experts"),
    ({"moe": {"deepep_sms": 132}}, "model.moe.deepep_sms", "would hold 132 of the H100-SXM5-80GB's 132 SMs"),
    ({"moe": {"deepep_sms": 24, "dispatcher": "alltoall"}}, "model.moe.deepep_sms", "the dispatcher is alltoall"),
    ({"moe": {"deepep_sms": 21}}, "model.moe.deepep_sms", "21 is odd"),
])
def test_impossible_deepep_plans(root, kw, field, words):
    with pytest.raises(clustersim.ConfigError, match=field.replace(".", r"\.")) as exc:
        clustersim.load_scenario(deepep_dict(**kw), base_dir=root)
    assert words in str(exc.value)


def test_deepep_refuses_an_nccl_algorithm(root):
    d = deepep_dict()
    d["simulation"] = {"collectives": {"all_to_all": "pairwise"}}
    with pytest.raises(clustersim.ConfigError, match=r"simulation\.collectives\.all_to_all: pairwise is an NCCL"):
        clustersim.load_scenario(d, base_dir=root)
