"""Expert tensor parallelism (``parallel.etp``) and MoE parallel folding: the expert groups'
layout, what a rank dispatches and computes, its expert memory, and the collapse."""

from __future__ import annotations

import itertools

import pytest

import clustersim
from clustersim.model import transformer as tf
from clustersim.model.moe import expert_params
from clustersim.plan.mesh import Mesh, parse_order
from clustersim.program.lower import lower

from .conftest import scenario_dict

MOE = {"layers": 4, "moe": {"experts": 16, "top_k": 2, "expert_ffn": 1024, "shared_experts": 1,
                            "dense_layers_first": 1}, "mlp": "swiglu", "bias": False}
H100 = {"topology": "topologies/dgx-h100.yaml", "nodes": 4}  # 32 GPUs, 8 a node


def etp_dict(moe=None, cluster=None, **parallel) -> dict:
    model = {**MOE, "moe": {**MOE["moe"], **(moe or {})}}
    return scenario_dict(cluster={**H100, **(cluster or {})}, model=model,
                         parallel={"tp": 2, "pp": 1, "dp": 16, "ep": 8, "sp": True, **parallel},
                         training={"global_batch_size": 32})


def run(root, collapse=None, **kw):
    return clustersim.simulate(clustersim.load_scenario(etp_dict(**kw), base_dir=root), collapse=collapse)


# --- the groups ---------------------------------------------------------------------------------

def megatron_expert_groups(tp: int, cp: int, dp: int, pp: int, ep: int, etp: int, dim: str,
                           ep_inner: bool = True) -> set[tuple[int, ...]]:
    """The expert groups as Megatron-Core's expert rank generator lays them out (order
    tp-ep-dp-pp, or tp-dp-ep-pp for strided EP, with tp = etp and cp = 1 over the world): a
    stage's ranks in rank order, etp innermost, then ep and the expert-DP index."""
    out: dict[tuple, list[int]] = {}
    per_stage = tp * cp * dp
    edp = per_stage // (etp * ep)
    for r in range(per_stage * pp):
        i = r % per_stage
        if ep_inner:
            coords = {"etp": i % etp, "ep": i // etp % ep, "edp": i // (etp * ep)}
        else:
            coords = {"etp": i % etp, "edp": i // etp % edp, "ep": i // (etp * edp)}
        key = (r // per_stage,) + tuple(v for k, v in coords.items() if k != dim)
        out.setdefault(key, []).append(r)
    return {tuple(g) for g in out.values()}


@pytest.mark.parametrize("ep_inner", [True, False], ids=["ep-dp", "dp-ep"])
@pytest.mark.parametrize("tp,cp,dp,ep,etp", [
    (2, 1, 4, 4, 1), (2, 1, 4, 8, 1), (2, 1, 4, 2, 1), (4, 1, 2, 2, 2), (4, 1, 2, 8, 1), (4, 1, 4, 4, 2),
    (8, 1, 2, 16, 1), (4, 1, 2, 2, 4), (2, 2, 2, 4, 2), (2, 2, 2, 8, 1), (4, 2, 4, 4, 2), (1, 2, 4, 4, 1)])
def test_expert_groups_are_megatrons_folded_layout(tp, cp, dp, ep, etp, ep_inner):
    """EP folds over the TP ranks the experts leave whole and the CP ranks: with tp innermost
    (the default order) every EP, expert-DP and expert-TP group is the one Megatron-Core
    builds."""
    order, _ = parse_order("tp-cp-ep-dp-pp" if ep_inner else "tp-cp-dp-ep-pp")
    mesh = Mesh(tp=tp, cp=cp, dp=dp, pp=2, ep=ep, etp=etp, order=order, ep_inner=ep_inner)
    for dim in ("ep", "edp", "etp"):
        groups = set(mesh.groups(dim))
        assert groups == megatron_expert_groups(tp, cp, dp, 2, ep, etp, dim, ep_inner), dim
        assert all(mesh.group(r, dim) in groups and r in mesh.group(r, dim) for r in range(mesh.world_size))
    assert mesh.size("edp") == tp // etp * cp * dp // ep


def test_etp_equal_to_tp_keeps_ep_inside_dp():
    """etp = tp (the default): an EP group is ep DP indices at one TP index, as before folding."""
    for tp, dp, ep in itertools.product((1, 2, 4), (4, 8), (2, 4)):
        mesh = Mesh(tp=tp, dp=dp, pp=1, ep=ep)
        for g in mesh.groups("ep"):
            coords = [mesh.coords(r) for r in g]
            assert len({c["tp"] for c in coords}) == 1
            assert [c["dp"] for c in coords] == list(range(coords[0]["dp"], coords[0]["dp"] + ep))


# --- what runs ----------------------------------------------------------------------------------

def test_etp1_dispatches_own_tokens_and_gathers_nothing(root):
    """TP2, SP, EP8, etp 1: each TP rank dispatches its own s/t tokens over an EP group that
    holds both TP ranks of 4 DP indices (one node), and its whole experts compute what the
    dispatch brought: no expert gather or reduce-scatter, where etp = tp gathers the TP group's
    tokens before the experts and reduce-scatters after."""
    folded, split = run(root, etp=1), run(root)
    m = folded.scenario.model
    whole = m.seq_len * m.moe.top_k * m.hidden * 2  # one microbatch's dispatched copies, 16-bit
    for r, gathers in ((folded, False), (split, True)):
        spans = [s for s in r.trace.spans if s.rank == r.trace.ranks[0]]
        a2a = [s for s in spans if s.op == "all_to_all"]
        assert a2a and all(s.size_bytes == pytest.approx(whole / 2) for s in a2a)
        regroup = [s for s in spans if s.name.endswith(("AG experts in", "RS experts out"))]
        assert bool(regroup) == gathers
    prog, _ = lower(folded.scenario)
    groups = {t.comm.group for t in prog.tasks if t.comm is not None and t.comm.op == "all_to_all"}
    mesh = folded.scenario.mesh
    for g in groups:
        assert {mesh.coords(r)["tp"] for r in g} == {0, 1} and len({r // 8 for r in g}) == 1
    assert folded.summary["plan"]["ep_nodes"] == 1 and split.summary["plan"]["ep_nodes"] == 2
    # the same all-to-all bytes within a node, not half of them over the NICs
    assert folded.summary["exposed_comm_s"]["ep"] < split.summary["exposed_comm_s"]["ep"]


def test_etp_between_gathers_over_the_expert_tp_group(root):
    """TP4, etp 2: the experts' gather and reduce-scatter run over the 2 ranks of the
    expert-TP group, on 2/4 of the TP group's tokens, as TP communication."""
    r = run(root, tp=4, dp=8, ep=4, etp=2)
    m = r.scenario.model
    whole = m.seq_len * m.moe.top_k * m.hidden * 2
    prog, _ = lower(r.scenario)
    rank = r.trace.ranks[0]
    regroup = [t for t in prog.tasks if t.rank == rank and t.name.endswith(("AG experts in", "RS experts out"))]
    assert regroup and all(len(t.comm.group) == 2 and t.kind == "tp" and t.stream == "tp" for t in regroup)
    assert all(t.comm.size_bytes == pytest.approx(whole * 2 / 4) for t in regroup)
    assert all(t.comm.group == r.scenario.mesh.group(rank, "etp") for t in regroup)


@pytest.mark.parametrize("parallel", [{"etp": 1}, {"etp": 1, "ep": 1}, {"tp": 4, "dp": 8, "ep": 4, "etp": 2}])
def test_the_experts_do_the_same_work_split_either_way(root, parallel):
    """A rank's experts compute etp/t of the tokens at 1/etp of their width: the same FLOPs
    per rank as split over TP (routed and shared experts' blocks)."""
    folded = lower(clustersim.load_scenario(etp_dict(**parallel), base_dir=root))[1]
    split = lower(clustersim.load_scenario(etp_dict(**{**parallel, "etp": None}), base_dir=root))[1]
    for a, b in ((folded.work[0].fwd, split.work[0].fwd), (folded.work[0].bwd, split.work[0].bwd)):
        flops = [sum(blk.flops for blk in x if blk.name == "experts") for x in (a, b)]
        assert flops[0] > 0 and flops[0] == pytest.approx(flops[1], rel=1e-12)


def test_expert_memory_closed_form(root):
    """A rank holds E/ep experts at 1/etp of their size; ZeRO-1 shards their optimizer states
    over the expert-DP group of (tp / etp) x dp / ep ranks (Rajbhandari et al. 2020, 12 bytes a
    parameter)."""
    for parallel in ({"etp": 1}, {"etp": 1, "ep": 16}, {"tp": 4, "dp": 8, "ep": 4, "etp": 2}, {}):
        r = run(root, zero=1, **parallel)
        sc = r.scenario
        m, p = sc.model, sc.parallel
        _, low = lower(sc)
        moe_layers = sum(m.is_moe_layer(ly) for ly in range(m.layers))
        psi_e = moe_layers * (m.moe.experts // p.ep) * expert_params(m.moe, m.hidden) / p.expert_tp
        assert low.work[0].local_expert_params == pytest.approx(psi_e)
        n_e = p.tp // p.expert_tp * p.dp // p.ep
        assert sc.mesh.size("edp") == n_e
        psi = low.work[0].local_params
        st = r.summary["memory"]["stages"][0]
        assert st["optimizer_bytes"] == pytest.approx(12 * (psi / p.dp + psi_e / n_e))
        assert st["params_bytes"] == pytest.approx(2 * (psi + psi_e))


def test_dispatched_states_kept_are_the_expert_tp_groups_tokens():
    """A MoE layer keeps the dispatched hidden states its experts read: the TP group's tokens
    (2 s b k h) split as TP, etp/t of them with etp < t; the rest is unchanged."""
    m = clustersim.config.DenseModelCfg(**{**MOE, "hidden": 1024, "heads": 16, "vocab": 32000, "seq_len": 2048})
    s, b, h, k = m.seq_len, 1, m.hidden, m.moe.top_k
    split = tf.layer_activation_bytes(m, b, 4, True, True, moe_layer=True)
    for etp in (1, 2):
        folded = tf.layer_activation_bytes(m, b, 4, True, True, moe_layer=True, etp=etp)
        assert split - folded == pytest.approx(2 * s * b * k * h * (1 - etp / 4))
        w = tf.layer_wgrad_bytes(m, b, 4, True, True, etp=etp)
        assert tf.layer_wgrad_bytes(m, b, 4, True, True) - w == pytest.approx(2 * 2 * s * b * k * h * (1 - etp / 4))


# --- the collapse -------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    {"etp": 1},
    {"etp": 1, "moe": {"ep_load": [1.6, 0.4, 1.0, 1.0, 1.2, 0.8, 1.0, 1.0]}},
    {"tp": 4, "dp": 8, "ep": 4, "etp": 2, "zero": 3},
    {"etp": 1, "cp": 2, "dp": 8, "order": "tp-cp-dp-ep-pp"},
    {"etp": 1, "pp": 2, "dp": 8, "cluster": {"what_if": [{"gpu": 5, "slowdown": 1.25}]}},
], ids=["etp1", "etp1-skewed", "tp4-etp2-zero3", "etp1-cp2-strided", "etp1-pp2-slow-gpu"])
def test_collapse_equals_every_rank(root, kw):
    """The collapsed run gives the all-ranks figures; a skewed load splits the classes by EP
    index (refined, as around stragglers), which now differs between TP peers."""
    rep, full = run(root, **kw), run(root, collapse=False, **kw)
    for key in ("step_time_s", "mfu", "bubble_fraction"):
        assert rep.summary[key] == pytest.approx(full.summary[key], rel=1e-9), key
    for kind, x in full.summary["exposed_comm_s"].items():
        assert rep.summary["exposed_comm_s"][kind] == pytest.approx(x, rel=1e-9, abs=1e-15), kind
    assert [s["peak_bytes"] for s in rep.summary["memory"]["stages"]] == \
        pytest.approx([s["peak_bytes"] for s in full.summary["memory"]["stages"]], rel=1e-9)
    assert rep.summary["simulation"]["simulated_ranks"] < full.summary["simulation"]["simulated_ranks"]


def test_a_skewed_load_splits_tp_groups_that_mix_ep_indices(root):
    """TP8 with etp 4 and strided EP2 over DP9: some TP groups hold EP indices [0 0 0 0 1 1 1 1],
    others one index alone, so one class per (stage, EP index) would make twins of ranks whose
    TP groups differ, and their collectives would never meet (the run deadlocked); the classes
    are refined instead, and the collapse is exact."""
    d = {"name": "x", "cluster": {"topology": "topologies/gb200-nvl72.yaml", "nodes": 1},
         "model": {"name": "x", "layers": 2, "hidden": 1024, "heads": 16, "vocab": 32000, "seq_len": 1024,
                   "moe": {"experts": 16, "top_k": 2, "expert_ffn": 1024, "ep_load": [1.5, 0.5]}},
         "parallel": {"tp": 8, "pp": 1, "dp": 9, "ep": 2, "etp": 4, "sp": True, "order": "tp-cp-dp-ep-pp"},
         "training": {"micro_batch_size": 1, "global_batch_size": 9}}
    sc = clustersim.load_scenario(d, base_dir=root)
    mixed = {tuple(sc.mesh.expert_coords["ep"][list(g)]) for g in sc.mesh.groups("tp")}
    assert (0, 0, 0, 0, 1, 1, 1, 1) in mixed and (0,) * 8 in mixed
    rep, full = clustersim.simulate(sc), clustersim.simulate(sc, collapse=False)
    assert rep.summary["step_time_s"] == pytest.approx(full.summary["step_time_s"], rel=1e-9)
    assert 2 < rep.summary["simulation"]["simulated_ranks"] < 72


# --- bad plans ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,field,words", [
    ({"tp": 4, "dp": 8, "etp": 3}, "parallel.etp", "etp=3 does not divide tp=4"),
    ({"etp": 1, "ep": 3, "moe": {"experts": 24}}, "parallel.ep", "does not divide (tp / etp) x dp = 2 x 16 = 32"),
    ({"tp": 1, "sp": False, "cp": 2, "dp": 4, "ep": 16, "cluster": {"nodes": 1}}, "parallel.ep",
     "ep=16 does not divide cp x dp = 2 x 4 = 8"),
    ({"tp": 4, "dp": 8, "etp": 1, "moe": {"expert_ffn": 1026}}, "parallel.tp",
     "tp=4 does not divide model.moe.expert_ffn=1026, which the shared experts split over TP"),
    ({"etp": 1, "ep": 1, "sp": False}, "parallel.sp", "experts split over fewer ranks (etp=1) with tensor parallelism"),
    ({"etp": 1, "zero": 1, "zero_shard": 2}, "parallel.zero_shard",
     "the experts' DP group ((tp/etp) x dp=16 / ep = 2 x 16 / 8 = 4 ranks) must split into 8 shard groups"),
])
def test_impossible_etp_plans(root, kw, field, words):
    d = etp_dict(**kw)
    with pytest.raises(clustersim.ConfigError, match=field) as exc:
        clustersim.load_scenario(d, base_dir=root)
    assert words in str(exc.value)


def test_etp_needs_a_moe_model(root):
    d = scenario_dict(parallel={"tp": 2, "pp": 1, "dp": 8, "sp": True, "etp": 1})
    with pytest.raises(clustersim.ConfigError, match=r"parallel\.etp: etp=1 splits routed experts; it needs"):
        clustersim.load_scenario(d, base_dir=root)


def test_the_plan_line_says_etp_and_ep_nodes(root):
    from clustersim.output.summary import plan_dims

    assert plan_dims(run(root, etp=1).summary["plan"], " x ") == "TP2 x PP1 x DP16 (EP8, ETP1)"
    assert plan_dims(run(root).summary["plan"], " x ") == "TP2 x PP1 x DP16 (EP8 over 2 nodes)"


def test_hybrid_sharding_with_experts_split_over_fewer_ranks_than_tp(root):
    """etp=1 under TP2 with hybrid sharding: the experts' DP group is carved out of TP x DP
    ((tp/etp) x dp / ep = 4 ranks), and the experts shard over its halves (2 replicas, as the
    dense weights over 8 of DP 16): ZeRO-1's 12 Ψe / 2 for them, 12 Ψd / 8 for the rest."""
    from clustersim.program.lower import lowering

    r = run(root, etp=1, zero=1, zero_shard=8)
    mesh = r.scenario.mesh
    for rank in (0, 1, 29):
        edp, ezs, ezr = (mesh.group(rank, d) for d in ("edp", "ezs", "ezr"))
        assert len(edp) == 4 and len(ezs) == 2 and len(ezr) == 2 and set(ezs) <= set(edp) and set(ezr) <= set(edp)
    psi_e = lowering(r.scenario, collapse=True).work[0].local_expert_params
    st = r.summary["memory"]["stages"][0]
    assert st["optimizer_bytes"] == pytest.approx(12 * ((st["params"] - psi_e) / 8 + psi_e / 2), rel=1e-12)
    from clustersim.output.summary import plan_options
    assert "(hybrid: shards over 8, experts over 2, 2 replicas)" in plan_options(r.summary["plan"])
