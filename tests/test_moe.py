"""Mixture of experts: parameter counts, expert parallelism's all-to-all, expert gradients."""

from __future__ import annotations

import pytest

import clustersim
from clustersim.model.moe import MoeCfg
from clustersim.output.summary import plan_line
from clustersim.model.transformer import DenseModelCfg, active_params, total_params

from .conftest import scenario_dict

MIXTRAL = DenseModelCfg(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, mlp="swiglu",
                        norm="rmsnorm", bias=False, vocab=32000, seq_len=4096, tied_embeddings=False,
                        position_embedding="rope", moe=MoeCfg(experts=8, top_k=2, expert_ffn=14336))


def test_mixtral_8x7b_parameters():
    # Jiang et al. 2024: 46.7B parameters, 12.9B active per token
    assert total_params(MIXTRAL) == pytest.approx(46.7e9, rel=2e-3)
    assert active_params(MIXTRAL) == pytest.approx(12.9e9, rel=5e-3)


MOE = {"moe": {"experts": 16, "top_k": 2, "expert_ffn": 1024, "shared_experts": 1, "dense_layers_first": 1},
       "mlp": "swiglu", "bias": False}


def moe_run(root, collapse=None, **parallel):
    d = scenario_dict(model=MOE, parallel={"tp": 1, "pp": 2, "dp": 8, **parallel}, training={"global_batch_size": 16})
    return clustersim.simulate(clustersim.load_scenario(d, base_dir=root), collapse=collapse)


def test_all_to_all_bytes_per_step(root):
    r = moe_run(root, ep=4)
    sc = r.scenario
    m = sc.model
    tokens = sc.training.micro_batch_size * m.seq_len
    per_a2a = tokens * m.moe.top_k * m.hidden * 2
    moe_layers_stage0 = sum(1 for ly in range(sc.layers_per_stage[0]) if m.is_moe_layer(ly))
    a2a = [s for s in r.trace.spans if s.op == "all_to_all" and s.stage == 0]
    # dispatch + combine, forward and backward, per MoE layer per microbatch
    assert len(a2a) == 4 * moe_layers_stage0 * sc.microbatches
    assert all(s.size_bytes == pytest.approx(per_a2a) for s in a2a)
    assert {s.kind for s in a2a} == {"ep"}
    assert r.summary["exposed_comm_s"]["ep"] > 0


def fp8_moe_run(root, fp8_dispatch: bool, **parallel):
    moe = {**MOE, "moe": {**MOE["moe"], "fp8_dispatch": fp8_dispatch}}
    d = scenario_dict(cluster={"topology": "topologies/dgx-h100.yaml", "nodes": 2}, model=moe,
                      parallel={"tp": 1, "pp": 2, "dp": 8, **parallel}, training={"global_batch_size": 16, "precision": "fp8"})
    return clustersim.simulate(clustersim.load_scenario(d, base_dir=root))


def test_fp8_dispatch_sends_the_experts_inputs_in_fp8(root):
    """DeepSeek-V3's FP8 dispatch (report Sec 3.3.2): the all-to-alls to the experts (the forward
    dispatch, the backward's gradient of the combine) carry one FP8 byte a value and an fp32
    scale per 128 values, those from the experts 16 bits::

        to the experts     tokens * top_k * hidden * (1 + 4/128)
        from the experts   tokens * top_k * hidden * 2
    """
    r, plain = fp8_moe_run(root, True, ep=4), fp8_moe_run(root, False, ep=4)
    sc, m = r.scenario, r.scenario.model
    values = sc.training.micro_batch_size * m.seq_len * m.moe.top_k * m.hidden
    sizes = {}
    for s in r.trace.spans:
        if s.op == "all_to_all" and s.stage == 0:
            sizes.setdefault((s.phase, s.name.split()[-1]), set()).add(s.size_bytes)
    # forward: dispatch after the router, combine after the experts; backward: the experts'
    # input gradient first (the combine's gradient, to the experts: "B A2A experts"), then the
    # dispatch's ("B A2A router", named for the dispatch it undoes)
    assert sizes == {("F", "router"): {values * (1 + 4 / 128)}, ("F", "experts"): {values * 2},
                     ("B", "experts"): {values * (1 + 4 / 128)}, ("B", "router"): {values * 2}}
    assert r.summary["plan"]["fp8_dispatch"] is True and plain.summary["plan"]["fp8_dispatch"] is False
    assert "(EP4, FP8 dispatch)" in plan_line(r.summary) and "FP8 dispatch" not in plan_line(plain.summary)
    assert r.summary["comm_s"]["ep"] < plain.summary["comm_s"]["ep"]
    assert r.summary["compute_s"] == pytest.approx(plain.summary["compute_s"], rel=1e-12)  # the same GEMMs


def test_fp8_dispatch_gathers_over_the_experts_tp_ranks_in_fp8(root):
    """Experts split over TP ranks (etp 2): what the FP8 dispatch brought is all-gathered over
    them as it came, the experts' output reduce-scattered as 16-bit sums."""
    r, plain = (fp8_moe_run(root, f, tp=2, dp=4, ep=4, etp=2, sp=True) for f in (True, False))
    def sizes(x):
        return {(sp.phase, sp.name.split(" ", 1)[1]): sp.size_bytes for sp in x.trace.spans
                if sp.stage == 0 and sp.name.endswith(("experts in", "experts out"))}
    fp8, bf16 = sizes(r), sizes(plain)
    assert set(fp8) == {(ph, n) for ph in "FB" for n in ("AG experts in", "RS experts out")}
    for key, size in fp8.items():
        assert size == pytest.approx(bf16[key] * ((1 + 4 / 128) / 2 if "AG" in key[1] else 1.0))


@pytest.mark.parametrize("training,parallel,words", [
    ({"precision": "bf16"}, {"ep": 4}, "training.precision is bf16: set it to fp8 or drop fp8_dispatch"),
    ({"precision": "fp8"}, {"ep": 1}, "with parallel.ep=1 no all-to-all carries tokens to the experts"),
])
def test_fp8_dispatch_needs_fp8_training_and_ep(root, training, parallel, words):
    moe = {**MOE, "moe": {**MOE["moe"], "fp8_dispatch": True}}
    d = scenario_dict(cluster={"topology": "topologies/dgx-h100.yaml", "nodes": 2}, model=moe,
                      parallel={"tp": 1, "pp": 2, "dp": 8, **parallel}, training={"global_batch_size": 16, **training})
    with pytest.raises(clustersim.ConfigError, match="model.moe.fp8_dispatch") as exc:
        clustersim.load_scenario(d, base_dir=root)
    assert words in str(exc.value)


def test_sequence_parallel_dispatches_each_tp_rank_s_own_tokens(root):
    """TP2 with SP (Megatron-LM requires SP of MoE with TP and EP, and so does clustersim): each
    TP rank dispatches its s/t tokens, so the all-to-all carries 1/t of the microbatch's k * s
    hidden vectors; the TP group then gathers the dispatched tokens before the experts and
    reduce-scatters their output before the combine, the whole k * s hidden vectors each, once
    per direction and pass (Megatron-LM's all-to-all dispatcher, expert-tensor-parallel = tp)."""
    d = scenario_dict(cluster={"topology": "topologies/dgx-h100.yaml", "nodes": 4}, model=MOE,
                      parallel={"tp": 2, "pp": 1, "dp": 16, "ep": 8, "sp": True}, training={"global_batch_size": 32})
    runs = {True: clustersim.simulate(clustersim.load_scenario(d, base_dir=root))}
    sc = runs[True].scenario
    m = sc.model
    whole = sc.training.micro_batch_size * m.seq_len * m.moe.top_k * m.hidden * 2
    moe_layers = sum(1 for ly in range(m.layers) if m.is_moe_layer(ly))
    spans = [s for s in runs[True].trace.spans if s.rank == 0]
    a2a = [s for s in spans if s.op == "all_to_all"]
    assert len(a2a) == 4 * moe_layers * sc.microbatches
    assert all(s.size_bytes == pytest.approx(whole / 2) for s in a2a)
    regroup = [s for s in spans if s.name.endswith(("AG experts in", "RS experts out"))]
    assert len(regroup) == 4 * moe_layers * sc.microbatches
    assert all(s.size_bytes == pytest.approx(whole) and s.kind == "tp" for s in regroup)
    # without SP every TP rank would hold, and dispatch, every token: refused, as Megatron-LM does
    with pytest.raises(clustersim.ConfigError, match=r"parallel\.sp: expert parallelism \(ep=8\) with tensor "
                                                     r"parallelism \(tp=2\) needs sequence parallelism"):
        clustersim.load_scenario({**d, "parallel": {**d["parallel"], "sp": False}}, base_dir=root)
    # the router routes the rank's own tokens and the combine returns them sequence-sharded: only
    # a shared expert gathers its input and reduce-scatters its output (MOE has one)
    d["parallel"]["sp"] = True
    d["model"] = {**d["model"], "moe": {**MOE["moe"], "shared_experts": 0}}
    alone = clustersim.simulate(clustersim.load_scenario(d, base_dir=root))
    for r, gathers in ((runs[True], True), (alone, False)):
        names = {s.name for s in r.trace.spans if s.layer >= 1}  # (layer 0 is dense)
        assert {"F AG router", "F RS experts", "B AG experts", "B RS router"} <= names if gathers else \
            not names & {"F AG router", "F RS experts", "B AG experts", "B RS router"}


def test_expert_gradients_reduce_over_the_expert_dp_group(root):
    r = moe_run(root, ep=4)
    expert = [s for s in r.trace.spans if "expert grads" in s.name]
    assert expert and all(s.kind == "dp" for s in expert)
    mesh = r.scenario.mesh
    assert mesh.size("edp") == 2


def test_more_ep_means_fewer_experts_per_gpu(root):
    a = moe_run(root, ep=2).summary["memory"]["stages"][1]["params"]
    b = moe_run(root, ep=8).summary["memory"]["stages"][1]["params"]
    assert b < a


def test_collapse_is_exact_with_expert_parallelism(root):
    full = moe_run(root, collapse=False, ep=4).summary
    rep = moe_run(root, collapse=True, ep=4).summary
    assert rep["step_time_s"] == pytest.approx(full["step_time_s"], rel=1e-9)
    assert rep["exposed_comm_s"]["ep"] == pytest.approx(full["exposed_comm_s"]["ep"], rel=1e-9)


@pytest.mark.parametrize("parallel,field,words", [
    ({"ep": 3}, "parallel.ep", "does not divide model.moe.experts=16"),
    ({"ep": 16, "dp": 8}, "parallel.ep", "does not divide dp=8"),
])
def test_impossible_expert_plans(root, parallel, field, words):
    d = scenario_dict(model=MOE, parallel={"tp": 1, "pp": 2, "dp": 8, **parallel}, training={"global_batch_size": 16})
    with pytest.raises(clustersim.ConfigError, match=field) as exc:
        clustersim.load_scenario(d, base_dir=root)
    assert words in str(exc.value)


@pytest.mark.parametrize("dense_first", [4, 9])
def test_a_moe_model_needs_a_moe_layer(root, dense_first):
    """dense_layers_first at or past model.layers leaves every layer dense: refused by name
    (EP would be taken with no all-to-all to run)."""
    model = {**MOE, "layers": 4, "moe": {**MOE["moe"], "dense_layers_first": dense_first}}
    d = scenario_dict(model=model, parallel={"tp": 1, "pp": 1, "dp": 16, "ep": 2}, training={"global_batch_size": 16})
    with pytest.raises(clustersim.ConfigError, match="model.moe.dense_layers_first") as exc:
        clustersim.load_scenario(d, base_dir=root)
    assert "leaves no MoE layer of model.layers=4" in str(exc.value)


def test_ep_needs_a_moe_model(root):
    with pytest.raises(clustersim.ConfigError, match="needs a mixture-of-experts model"):
        clustersim.load_scenario(scenario_dict(parallel={"tp": 1, "pp": 2, "dp": 8, "ep": 2}), base_dir=root)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_memory_shards_experts_over_the_expert_dp_group(root, zero):
    """ZeRO's formulas twice: dense parameters over N = dp, routed experts over N_e = dp/ep
    (Rajbhandari et al. 2020, Fig. 1, with fp32 gradients g = 4)."""
    r = moe_run(root, ep=4, zero=zero)
    from clustersim.program.lower import lower

    _, low = lower(r.scenario)
    n, n_e = 8, 2
    for st in r.summary["memory"]["stages"]:
        parts = low.parts_of[st["stage"]]
        psi = sum(low.work[j].local_params for j in parts)
        psi_e = sum(low.work[j].local_expert_params for j in parts)
        assert psi_e > 0 or st["stage"] == 0
        want = {0: (2, 4, 12, 1, 1, 1), 1: (2, 4, 12, 1, 1, n), 2: (2, 4, 12, 1, n, n), 3: (2, 4, 12, n, n, n)}[zero]
        p, g, o, sp, sg, so = want
        sp_e, sg_e, so_e = (x if x == 1 else n_e for x in (sp, sg, so))
        assert st["params_bytes"] == pytest.approx(p * (psi / sp + psi_e / sp_e))
        assert st["grads_bytes"] == pytest.approx(g * (psi / sg + psi_e / sg_e))
        assert st["optimizer_bytes"] == pytest.approx(o * (psi / so + psi_e / so_e))


def test_zero3_gathers_and_scatters_experts_over_the_expert_dp_group(root):
    """ZeRO-3 with experts, no PP and one microbatch: each layer's experts are all-gathered
    before its forward and again before its backward (2 bytes per parameter each) and their
    gradients reduce-scattered (4 bytes), all over the expert-DP group of dp/ep ranks."""
    d = scenario_dict(model=MOE, parallel={"tp": 1, "pp": 1, "dp": 16, "ep": 4, "zero": 3},
                      training={"global_batch_size": 16})
    r = clustersim.simulate(clustersim.load_scenario(d, base_dir=root))
    from clustersim.program.lower import lower

    prog, low = lower(r.scenario)
    rank = low.sym.ranks[0]
    expert_psi = low.work[0].local_expert_params
    ag = [t for t in prog.tasks if t.rank == rank and t.name.endswith("AG expert params")]
    rs = [t for t in prog.tasks if t.rank == rank and t.name == "RS expert grads"]
    assert {len(t.comm.group) for t in ag + rs} == {16 // 4}
    assert sum(t.comm.size_bytes for t in ag) == pytest.approx(2 * 2 * expert_psi)
    assert sum(t.comm.size_bytes for t in rs) == pytest.approx(4 * expert_psi)


def test_zero1_all_gathers_updated_experts_after_the_step(root):
    r = moe_run(root, ep=4, zero=1)
    spans = [s for s in r.trace.spans if s.name == "AG expert params"]
    assert spans and all(s.phase == "opt" and s.kind == "dp" for s in spans)


def test_dualpipe_sums_both_copies_of_the_experts(root):
    """DualPipe holds every part on two pipeline ranks: the copies' expert gradients are
    all-reduced between them (on the expert shard under ZeRO-1), like the dense buckets."""
    d = scenario_dict(model=MOE, parallel={"tp": 1, "pp": 2, "dp": 8, "ep": 4, "zero": 1, "schedule": "dualpipe"},
                      training={"global_batch_size": 32})
    r = clustersim.simulate(clustersim.load_scenario(d, base_dir=root))
    from clustersim.program.lower import lower

    prog, low = lower(r.scenario)
    reps = [t for t in prog.tasks if "expert grads" in t.name and "(replicas)" in t.name]
    assert reps and all(len(t.comm.group) == 2 for t in reps)
    for q in range(2):
        r0 = low.sym.ranks[q]
        mine = sum(t.comm.size_bytes for t in reps if t.rank == r0)
        held = sum(low.work[j].local_expert_params for j in low.parts_of[q])
        assert mine == pytest.approx(held / 2 * 4)  # fp32 gradients of the 1/(dp/ep) shard


# --- skewed expert load (model.moe.ep_load) ---------------------------------------------------

HOT = [2.0, 2 / 3, 2 / 3, 2 / 3]  # EP index 0 receives twice the balanced share; mean 1


def skewed_run(root, load, collapse=None, network="flow", moe=None, **parallel):
    model = {**MOE, "moe": {**MOE["moe"], **({"ep_load": load} if load else {}), **(moe or {})}}
    p = {"tp": 1, "pp": 1, "dp": 16, "ep": 4, **parallel}  # 16 GPUs: 2 nodes of 8
    # (every GEMM at one efficiency: the closed forms below take expert compute in proportion
    # to the load, where by shape a hot rank's fuller GEMMs would also fill the SMs better)
    d = scenario_dict(model=model, parallel=p, training={"global_batch_size": 2 * p["dp"]},
                      simulation={"network": network, "gemm_efficiency": "flat"})
    return clustersim.simulate(clustersim.load_scenario(d, base_dir=root), collapse=collapse)


def test_skewed_all_to_all_is_bound_by_the_hot_ranks_ingress(root):
    """A dispatch all-to-all inside one NVSwitch node, alone: each GPU's ingress bounds it.
    Balanced, a GPU receives (n-1)/n S; skewed, the hot one receives (n-1)/n S x 2, so the
    transfer takes twice as long (egress: S/n (2 + 2 x 2/3) < that)."""
    from clustersim.engine.sim import Engine
    from clustersim.hardware.topology import build_cluster, load_topology_cfg
    from clustersim.program.tasks import Comm, Program

    cluster = build_cluster(load_topology_cfg(root / "topologies/dgx-h100.yaml", {"nodes": 1}))
    group = (0, 1, 2, 3)

    def time_s(size, load):
        prog = Program(ranks=list(group), weight=dict.fromkeys(group, 1))
        for r in group:
            prog.add(rank=r, stream="ep", name="a2a", kind="ep",
                     comm=Comm("all_to_all", size, group, (), group, ("ep", group, 0), load=load))
        return max(s.end_s for s in Engine(prog, cluster).run().spans)

    def per_byte_s(load):  # two sizes: the latency round cancels
        return (time_s(2.0 * (1 << 30), load) - time_s(1.0 * (1 << 30), load)) / (1 << 30)

    balanced = per_byte_s(())
    assert per_byte_s((False, tuple(HOT))) == pytest.approx(2 * balanced, rel=1e-9)  # dispatch: into the hot GPU
    assert per_byte_s((True, tuple(HOT))) == pytest.approx(2 * balanced, rel=1e-9)  # combine: out of it


def test_skewed_expert_compute_delays_every_ep_rank(root):
    """Free network: every MoE layer's combine waits for the hot rank's experts, so the step
    grows by exactly the hot rank's extra expert compute (forward and backward)."""
    balanced = skewed_run(root, None, network="ideal")
    skewed = skewed_run(root, HOT, network="ideal")

    def experts_s(run, rank):
        return sum(s.dur_s for s in run.trace.spans
                   if s.rank == rank and s.kind == "compute" and s.name.endswith(" experts"))

    hot = skewed.trace.ranks[0]
    extra = experts_s(skewed, hot) - experts_s(balanced, balanced.trace.ranks[0])
    assert extra > 0
    assert skewed.summary["step_time_s"] == pytest.approx(balanced.summary["step_time_s"] + extra, rel=1e-12)
    # a cold rank's experts get 2/3 of the balanced pairs, the hot one's 2x: in proportion where
    # compute-bound, hot - cold = 4 (balanced - cold); a grouped GEMM reads every local expert's
    # weights whatever its load, so a cold rank's may be memory-bound, its time above the
    # proportion, the ratio above 4
    cold = skewed.trace.ranks[1]
    routed = experts_s(balanced, balanced.trace.ranks[0]) - experts_s(skewed, cold)
    assert routed > 0 and experts_s(skewed, hot) - experts_s(skewed, cold) >= routed * 4 * (1 - 1e-9)


@pytest.mark.parametrize("parallel,moe", [
    ({}, None), ({"tp": 2, "pp": 2, "dp": 4, "sp": True, "order": "tp-cp-dp-ep-pp"}, None),
    ({}, {"capacity_factor": 1.25}), ({}, {"capacity_factor": 1.25, "pad_to_capacity": True})],
    ids=["consecutive", "strided-tp-pp", "dropped", "padded"])
def test_skewed_load_splits_classes_by_ep_index_and_equals_all_ranks(root, parallel, moe):
    """The EP ranks run different programs: one class per (stage, EP index), exact. Padded to
    capacity they compute alike, and each counts the mean of the real tokens among its pairs:
    one class per stage, the step's model FLOPs exact."""
    rep = skewed_run(root, HOT, moe=moe, **parallel)
    full = skewed_run(root, HOT, collapse=False, moe=moe, **parallel)
    mesh = rep.scenario.mesh
    padded = bool(moe and moe.get("pad_to_capacity"))
    assert rep.summary["simulation"]["simulated_ranks"] == mesh.pp * (1 if padded else mesh.ep) < mesh.world_size
    for key in ("step_time_s", "mfu", "bubble_fraction", "model_flops_per_step"):
        assert rep.summary[key] == pytest.approx(full.summary[key], rel=1e-9), key
    assert rep.summary["exposed_comm_s"]["ep"] == pytest.approx(full.summary["exposed_comm_s"]["ep"], rel=1e-9)
    balanced = skewed_run(root, None, **parallel)
    assert rep.summary["step_time_s"] > balanced.summary["step_time_s"]


# --- capacity: tokens beyond it dropped, or batches padded to it ---------------------------------

def test_expert_loads_are_cut_at_capacity_or_padded_to_it():
    from clustersim.model.moe import MoeCfg, expert_loads

    hot = dict(experts=16, top_k=2, expert_ffn=1024, ep_load=[1.6, 0.8, 0.8, 0.8])
    assert expert_loads(MoeCfg(**hot), 4) == ((1.6, 0.8, 0.8, 0.8),) * 2
    assert expert_loads(MoeCfg(**hot, capacity_factor=1.25), 4) == ((1.25, 0.8, 0.8, 0.8),) * 2
    assert expert_loads(MoeCfg(**hot, capacity_factor=1.25, pad_to_capacity=True), 4) == (
        (1.25,) * 4, (1.25, 0.8, 0.8, 0.8))
    balanced = dict(experts=16, top_k=2, expert_ffn=1024, capacity_factor=1.5)
    assert expert_loads(MoeCfg(**balanced), 4) == ((1.0,) * 4,) * 2  # nothing beyond capacity
    assert expert_loads(MoeCfg(**balanced, pad_to_capacity=True), 4) == ((1.5,) * 4, (1.0,) * 4)


def _routed_model_flops(r) -> float:
    """The routed experts' model FLOPs in a step under balanced dropless routing: per token and
    MoE layer, top_k experts of mats GEMMs of 2 h f_e each, forward and twice that backward."""
    m, tr = r.scenario.model, r.scenario.training
    layers = sum(1 for ly in range(m.layers) if m.is_moe_layer(ly))
    return 3 * tr.global_batch_size * m.seq_len * layers * m.moe.top_k * 2 * m.moe.mats * m.hidden * m.moe.expert_ffn


def _permuting_s(r, sent: float) -> float:
    """What a step's token permutations take on the path of a free network's step (every
    rank's blocks in lock-step with the hot one's): ``permute`` in each router block and
    ``unpermute`` in each experts block, forward and backward alike, over the tokens and the
    ``sent`` x k copies a rank sends (model/moe.py ``permutations``)."""
    from clustersim.model.moe import permutations
    from clustersim.program.costs import op_time_s

    sc = r.scenario
    tokens = sc.training.micro_batch_size * sc.model.seq_len
    one = sum(op_time_s(op, sc.cluster.gpu, sc.training.precision)
              for op in permutations(sc.model.moe, tokens, sc.model.hidden, sent)) / 2
    blocks = sum(1 for s in r.trace.spans if s.rank == r.trace.ranks[0] and s.kind == "compute"
                 and s.name.endswith((" router", " experts")))
    return blocks * one


@pytest.mark.parametrize("pad", [False, True], ids=["dropped", "padded"])
def test_a_capacity_caps_the_hot_ranks_experts(root, pad):
    """Free network, HOT's rank 0 routed twice its share: at capacity 1.25 its experts compute
    1.25 times the balanced share, so the step exceeds the balanced one by a quarter of what
    the dropless skew adds (expert time is linear in the pairs: closed form), and by what the
    permutations of the copies every rank sends gain or lose (dropped: 0.8125 of the balanced
    copies on average; padded: 1.25; dropless: 1). Dropped or padded, the hot rank sets the
    pace alike. The model FLOPs lose the dropped tokens, (2 - 1.25) / 4 of the routed ones, in
    both: padding is not model work."""
    cap = {"capacity_factor": 1.25, "pad_to_capacity": pad}
    balanced, dropless = skewed_run(root, None, network="ideal"), skewed_run(root, HOT, network="ideal")
    capped = skewed_run(root, HOT, network="ideal", moe=cap)
    step = {k: r.summary["step_time_s"] for k, r in (("b", balanced), ("d", dropless), ("c", capped))}
    assert step["d"] > step["b"]
    sent = 1.25 if pad else (1.25 + 3 * 2 / 3) / 4
    permuted = _permuting_s(capped, sent) - _permuting_s(balanced, 1.0)
    assert (permuted > 0) == pad and permuted != 0
    assert step["c"] - step["b"] == pytest.approx(0.25 * (step["d"] - step["b"]) + permuted, rel=1e-9)
    assert dropless.summary["model_flops_per_step"] == pytest.approx(balanced.summary["model_flops_per_step"], rel=1e-12)
    lost = (2.0 - 1.25) / 4 * _routed_model_flops(balanced)
    assert capped.summary["model_flops_per_step"] == pytest.approx(
        balanced.summary["model_flops_per_step"] - lost, rel=1e-12)


def test_a_capacity_above_a_balanced_load_drops_nothing_and_padding_costs_it(root):
    """Balanced routing at capacity 1.5: dropping leaves the plan as it is, to the bit; padding
    makes every expert compute and every all-to-all carry 1.5 times the balanced share, with
    the same model FLOPs (free network: the step grows by half the routed experts' time, and
    by what the permutations of 1.5 times the copies add)."""
    balanced = skewed_run(root, None)
    dropped = skewed_run(root, None, moe={"capacity_factor": 1.5})
    padded = skewed_run(root, None, moe={"capacity_factor": 1.5, "pad_to_capacity": True})
    for key in ("step_time_s", "model_flops_per_step", "exposed_comm_s", "memory"):
        assert dropped.summary[key] == balanced.summary[key], key
    assert padded.summary["model_flops_per_step"] == pytest.approx(balanced.summary["model_flops_per_step"], rel=1e-12)
    a2a = [{s.size_bytes for s in r.trace.spans if s.op == "all_to_all"} for r in (balanced, padded)]
    (size,), (size_padded,) = a2a
    assert size_padded == pytest.approx(1.5 * size, rel=1e-12)
    assert padded.summary["memory"]["stages"][0]["peak_bytes"] > balanced.summary["memory"]["stages"][0]["peak_bytes"]
    free = {k: skewed_run(root, None, network="ideal", moe=v)
            for k, v in (("b", None), ("p", {"capacity_factor": 1.5, "pad_to_capacity": True}))}
    hot = skewed_run(root, HOT, network="ideal")  # the hot rank's routed experts twice: one share more
    one_share = hot.summary["step_time_s"] - free["b"].summary["step_time_s"]
    permuted = _permuting_s(free["p"], 1.5) - _permuting_s(free["b"], 1.0)
    assert free["p"].summary["step_time_s"] - free["b"].summary["step_time_s"] == pytest.approx(
        0.5 * one_share + permuted, rel=1e-9)


@pytest.mark.parametrize("moe,field,words", [
    ({"pad_to_capacity": True}, "model.moe", "pad_to_capacity pads each expert's batch to its capacity; it needs"),
    ({"capacity_factor": 0.5}, "model.moe.capacity_factor", "greater than or equal to 1"),
])
def test_bad_capacity(root, moe, field, words):
    d = scenario_dict(model={**MOE, "moe": {**MOE["moe"], **moe}}, parallel={"tp": 1, "pp": 1, "dp": 16, "ep": 4},
                      training={"global_batch_size": 32})
    with pytest.raises(clustersim.ConfigError, match=field.replace(".", r"\.")) as exc:
        clustersim.load_scenario(d, base_dir=root)
    assert words in str(exc.value)


@pytest.mark.parametrize("training", [{}, {"recompute": "full"}, {"recompute": "selective", "recompute_modules": ["moe"]}],
                         ids=["kept", "full", "selective-moe"])
def test_a_skewed_load_counts_the_busiest_ranks_memory(root, training):
    """A stage's memory is its busiest GPU's: under a skewed load the hot EP rank's experts
    keep the intermediates and dispatched states of the tokens they receive, twice the
    balanced share at HOT[0] = 2 (work.memory_model), exactly what a capacity factor of 2 pads
    every expert to; the weights and optimizer are the balanced plan's. What a recomputing
    backward holds grows the same way, and so does the memory floor advise prunes with (where
    microbatches keep the experts' terms)."""
    from clustersim.api import memory_floor

    def summary_of(moe: dict, simulate: bool = True):
        model = {**MOE, "moe": {**MOE["moe"], **moe}}
        d = scenario_dict(model=model, parallel={"tp": 1, "pp": 2, "dp": 8, "ep": 4},
                          training={"global_batch_size": 16, **training})
        sc = clustersim.load_scenario(d, base_dir=root)
        return clustersim.simulate(sc, brief=True).summary["memory"] if simulate else memory_floor(sc)

    skewed, padded, balanced = (summary_of({"ep_load": HOT}), summary_of({"capacity_factor": 2.0, "pad_to_capacity": True}),
                                summary_of({}))
    for s, p, b in zip(skewed["stages"], padded["stages"], balanced["stages"]):
        for key in ("activations_bytes", "recomputing_bytes", "params_bytes", "optimizer_bytes"):
            assert s[key] == p[key], key
        assert [x["activation_bytes_per_microbatch"] for x in s["parts"]] == [
            x["activation_bytes_per_microbatch"] for x in p["parts"]]
        assert s["params_bytes"] == b["params_bytes"]
        assert s["activations_bytes"] + s["recomputing_bytes"] > b["activations_bytes"] + b["recomputing_bytes"]
    floors = [summary_of(moe, simulate=False)["peak_bytes"]
              for moe in ({"ep_load": HOT}, {"capacity_factor": 2.0, "pad_to_capacity": True}, {})]
    # (the floor counts what microbatches keep: under recompute a layer's input, the same)
    assert floors[0] == floors[1] >= floors[2] and (floors[0] > floors[2] or training)


def test_an_even_load_is_the_balanced_plan(root):
    even, balanced = skewed_run(root, [1.0] * 4), skewed_run(root, None)
    assert even.summary["step_time_s"] == balanced.summary["step_time_s"]
    assert even.summary["simulation"]["simulated_ranks"] == 1


@pytest.mark.parametrize("moe,words", [
    ({"ep_load": [1.5, 0.5]}, "2 entries for parallel.ep=4"),
    ({"ep_load": [2.0, 1.0, 1.0, 1.0]}, "average 1.25, not 1"),
])
def test_bad_ep_load(root, moe, words):
    d = scenario_dict(model={**MOE, "moe": {**MOE["moe"], **moe}}, parallel={"tp": 1, "pp": 1, "dp": 16, "ep": 4},
                      training={"global_batch_size": 32})
    with pytest.raises(clustersim.ConfigError, match="model.moe.ep_load") as exc:
        clustersim.load_scenario(d, base_dir=root)
    assert words in str(exc.value)


# --- the flow network's shortcuts for lone transfers ---------------------------------------------

def test_lone_transfer_shortcuts_change_no_span(root, monkeypatch):
    """A transfer alone on its links is worked out to its end ahead of the clock, ended by an
    event of its own, and replayed from the kept course of its plan, flows and size when it
    starts alone again; it goes back when another transfer joins (docs/architecture.md,
    "Flow-level network"). Without any of it, instant by instant, the spans and the link
    bytes are the same, on a DualPipe MoE step where all-to-alls, PP sends and expert
    gradients meet on two nodes' NICs."""
    from collections import Counter

    from clustersim.engine.network import FlowNetwork

    d = scenario_dict(model=MOE, parallel={"tp": 1, "pp": 2, "dp": 8, "ep": 8, "schedule": "dualpipe"},
                      training={"global_batch_size": 32})
    calls: Counter = Counter()
    for name in ("_replay_alone", "_end_ahead", "_back_to"):
        def counted(self, *args, _f=getattr(FlowNetwork, name), _name=name):
            calls[_name] += 1
            return _f(self, *args)
        monkeypatch.setattr(FlowNetwork, name, counted)
    fast = clustersim.simulate(clustersim.load_scenario(d, base_dir=root))
    assert calls["_replay_alone"] > 10 and calls["_end_ahead"] > 10 and calls["_back_to"] > 0
    monkeypatch.setattr(FlowNetwork, "_run_ahead", lambda self, t: None)  # no run-ahead: no course kept
    calls.clear()
    slow = clustersim.simulate(clustersim.load_scenario(d, base_dir=root))
    assert calls["_replay_alone"] == calls["_end_ahead"] == 0

    def spans(r):
        return sorted((s.rank, s.stream, s.tid, s.name, s.start_s, s.end_s) for s in r.trace.spans)

    a, b = spans(fast), spans(slow)
    assert [x[:4] for x in a] == [x[:4] for x in b]
    assert [t for x in a for t in x[4:]] == pytest.approx([t for x in b for t in x[4:]], rel=1e-12, abs=1e-12)
    assert fast.summary["step_time_s"] == pytest.approx(slow.summary["step_time_s"], rel=1e-12)
    assert [u.bytes for u in fast.trace.links] == pytest.approx([u.bytes for u in slow.trace.links], rel=1e-9)


def test_a_parts_params_and_expert_params_add_up_to_its_stage(root):
    """memory.stages[].parts[]: ``params`` holds every weight but the routed experts',
    ``expert_params`` those (split over EP), together the stage's ``params``; a dense model's
    parts have none."""
    for model, ep in ((MOE, 4), ({k: v for k, v in MOE.items() if k != "moe"}, 1)):
        d = scenario_dict(model=model, parallel={"tp": 1, "pp": 2, "dp": 8, "ep": ep}, training={"global_batch_size": 16})
        mem = clustersim.simulate(clustersim.load_scenario(d, base_dir=root), brief=True).summary["memory"]
        for st in mem["stages"]:
            assert sum(p["params"] + p["expert_params"] for p in st["parts"]) == st["params"]
            assert all((p["expert_params"] > 0) == (ep > 1) for p in st["parts"])


# --- the tokens' permutations around the all-to-alls ---------------------------------------------

@pytest.mark.parametrize("ep,experts,sorted_", [(4, 16, True), (4, 4, False), (1, 16, False)],
                         ids=["4-local-experts", "1-local-expert", "no-ep"])
def test_a_moe_layer_permutes_its_tokens_as_megatrons_all_to_all_dispatcher(root, ep, experts, sorted_):
    """Megatron-LM's all-to-all dispatcher: ``permute`` before the dispatch (read T h, write T
    k h), ``unpermute`` after the combine (the reverse), and where a rank holds more than one
    expert of an EP group a sort by local expert after the dispatch and back before the
    combine (read and write T k h each); the gradient of each is the inverse permutation, one
    pass again."""
    from clustersim.model import transformer as tf
    from clustersim.program.work import MoeBlocks

    d = scenario_dict(model={**MOE, "moe": {**MOE["moe"], "experts": experts}},
                      parallel={"tp": 1, "pp": 1, "dp": 16, "ep": ep}, training={"global_batch_size": 16})
    sc = clustersim.load_scenario(d, base_dir=root)
    m = sc.model
    T, k, h = m.seq_len, m.moe.top_k, m.hidden
    blocks = MoeBlocks.build(sc, (), (), (), ())
    router, experts_spec = blocks.fwd_specs
    ops = {op.name: op for spec in blocks.fwd_specs for op in spec.ops}
    assert ops["permute"] in router.ops and ops["unpermute"] in experts_spec.ops
    assert ops["permute"].bytes == ops["unpermute"].bytes == 2 * T * h * (1 + k)
    assert ("sort_in" in ops and "sort_out" in ops) == sorted_
    if sorted_:
        assert ops["sort_in"].bytes == ops["sort_out"].bytes == 2 * 2 * T * k * h
    backward = {op.name: op for spec in blocks.bwd_specs for op in spec.ops}
    for name in tf.PERMUTATIONS & set(ops):
        assert backward[name].bytes == ops[name].bytes, name
    assert backward["experts_act"].bytes == 2 * ops["experts_act"].bytes  # (an elementwise op's: twice)


# --- the shared experts beside the all-to-alls ---------------------------------------------------

def _shared_beside(root, overlap: bool, network: str = "flow", collapse=None, training=None, **parallel):
    model = {**MOE, "moe": {**MOE["moe"], "shared_expert_overlap": overlap}}
    p = {"tp": 1, "pp": 2, "dp": 8, "ep": 4, **parallel}
    d = scenario_dict(model=model, parallel=p, training={"global_batch_size": 16, **(training or {})},
                      simulation={"network": network})
    return clustersim.simulate(clustersim.load_scenario(d, base_dir=root), collapse=collapse)


@pytest.mark.parametrize("parallel", [{}, {"tp": 2, "dp": 4, "sp": True}, {"tp": 2, "dp": 4, "sp": True, "etp": 1}],
                         ids=["tp1", "tp2-sp", "tp2-sp-etp1"])
def test_shared_experts_beside_the_all_to_alls_hide_them_and_change_nothing_else(root, parallel):
    """Megatron-LM's --moe-shared-expert-overlap: the same compute, the same collectives (names
    and bytes), the same model FLOPs and memory; on a free network the same step (nothing to
    hide); on the flow network less exposed EP time and a shorter step."""
    runs = {(o, n): _shared_beside(root, o, n, **parallel) for o in (False, True) for n in ("ideal", "flow")}
    plain, beside = runs[(False, "flow")], runs[(True, "flow")]
    for net in ("ideal", "flow"):
        a, b = runs[(False, net)].summary, runs[(True, net)].summary
        assert b["model_flops_per_step"] == pytest.approx(a["model_flops_per_step"], rel=1e-12)
        assert b["compute_s"] == pytest.approx(a["compute_s"], rel=1e-9)
        assert b["memory"]["stages"][0]["activations_bytes"] == a["memory"]["stages"][0]["activations_bytes"]
    assert runs[(True, "ideal")].summary["step_time_s"] == pytest.approx(runs[(False, "ideal")].summary["step_time_s"],
                                                                          rel=1e-9)

    def comms(r):
        return sorted((s.name, s.size_bytes) for s in r.trace.spans if s.rank == 0 and s.kind != "compute"
                      and s.op in ("all_to_all", "all_gather", "reduce_scatter"))

    assert comms(beside) == comms(plain)
    a, b = plain.summary, beside.summary
    from clustersim.output.summary import plan_line

    assert b["plan"]["shared_expert_overlap"] and "shared experts beside)" in plan_line(b)
    assert not a["plan"]["shared_expert_overlap"] and "shared experts beside" not in plan_line(a)
    assert b["exposed_comm_s"]["ep"] < a["exposed_comm_s"]["ep"]
    assert b["step_time_s"] < a["step_time_s"]


def test_beside_the_shared_experts_the_experts_tp_collectives_wait_for_their_all_to_alls(root):
    """With the experts split over TP (etp 2), what the dispatch brought is gathered after it,
    and the experts' output reduce-scattered before the combine, as without the overlap: only
    the all-to-alls run beside the shared experts' GEMMs."""
    r = _shared_beside(root, True, tp=2, dp=4, sp=True)
    rank = r.trace.ranks[0]

    def spans(name):
        return sorted((s for s in r.trace.spans if s.rank == rank and s.name == name), key=lambda s: s.start_s)

    for first, then in (("F A2A router", "F AG experts in"), ("F RS experts out", "F A2A experts"),
                        ("B A2A experts", "B AG experts in"), ("B RS experts out", "B A2A router")):
        a, b = spans(first), spans(then)
        assert len(a) == len(b) > 0, (first, then)
        assert all(y.start_s >= x.end_s - 1e-15 for x, y in zip(a, b)), (first, then)


@pytest.mark.parametrize("parallel,training", [
    ({}, {}), ({"schedule": "zb-h1", "tp": 2, "dp": 4, "sp": True}, {"recompute": "full"}),
    ({}, {"recompute": "selective", "recompute_modules": ["moe"]})], ids=["1f1b", "zb-h1-sp-full", "selective-moe"])
def test_shared_experts_beside_the_all_to_alls_collapse_exactly(root, parallel, training):
    """Collapsed as every rank, with split backwards and recomputes too; a recompute's
    all-to-alls are named for it ("recompute router", "recompute experts"), as without the
    overlap."""
    rep = _shared_beside(root, True, training=training, **parallel)
    full = _shared_beside(root, True, collapse=False, training=training, **parallel)
    assert rep.summary["simulation"]["simulated_ranks"] < full.summary["simulation"]["simulated_ranks"]
    for key in ("step_time_s", "mfu", "bubble_fraction", "exposed_comm_s"):
        assert rep.summary[key] == pytest.approx(full.summary[key], rel=1e-9), key
    plain = _shared_beside(root, False, training=training, **parallel)
    names = [{s.name for s in r.trace.spans if s.op == "all_to_all"} for r in (rep, plain)]
    assert names[0] == names[1] and (any("recompute" in n for n in names[0]) == bool(training))


@pytest.mark.parametrize("moe,parallel,field,words", [
    ({"shared_experts": 0}, {}, "model.moe", "shared_expert_overlap runs the shared experts beside the dispatch"),
    ({}, {"pp": 2, "dp": 8, "schedule": "interleaved", "vpp": 2, "ep_comm_overlap": True}, "parallel.ep_comm_overlap",
     "does not go with model.moe.shared_expert_overlap"),
])
def test_impossible_shared_expert_overlaps(root, moe, parallel, field, words):
    d = scenario_dict(model={**MOE, "moe": {**MOE["moe"], "shared_expert_overlap": True, **moe}},
                      parallel={"tp": 1, "pp": 1, "dp": 16, "ep": 4, **parallel}, training={"global_batch_size": 32})
    with pytest.raises(clustersim.ConfigError, match=field.replace(".", r"\.")) as exc:
        clustersim.load_scenario(d, base_dir=root)
    assert words in str(exc.value)


# --- which layers are MoE ----------------------------------------------------------------------

def test_layer_freq_places_the_moe_layers_as_megatron_does():
    from clustersim.model.moe import MoeCfg

    base = dict(experts=8, top_k=2, expert_ffn=64)
    assert [MoeCfg(**base, layer_freq=2).is_moe(ly) for ly in range(6)] == [True, False] * 3
    assert [MoeCfg(**base, layer_freq=[0, 1] * 3).is_moe(ly) for ly in range(6)] == [False, True] * 3
    assert [MoeCfg(**base, layer_freq=3, dense_layers_first=1).is_moe(ly) for ly in range(7)] == [
        False, False, False, True, False, False, True]
    assert all(MoeCfg(**base).is_moe(ly) for ly in range(6))


@pytest.mark.parametrize("freq,mtp_moe", [(2, False), ([0, 1, 0, 1], True)])
def test_a_multi_token_prediction_layer_is_moe_where_the_last_layer_is(freq, mtp_moe):
    """Megatron-LM builds the MTP module's layer from the last decoder layer's spec."""
    from clustersim.model.moe import MoeCfg
    from clustersim.model.transformer import DenseModelCfg

    m = DenseModelCfg(layers=4, hidden=1024, heads=8, vocab=32000, seq_len=512, mtp_layers=1,
                      moe=MoeCfg(experts=8, top_k=2, expert_ffn=512, layer_freq=freq))
    assert m.is_moe_layer(4) == m.is_moe_layer(3) == mtp_moe


def test_llama4_maverick_has_its_published_parameters(root):
    """Llama 4 Maverick (Meta's model card: 400B parameters in all, 128 routed experts and one
    shared, top-1, a MoE MLP in every second layer; its configuration: 48 layers, hidden 5120,
    40 heads of 128 with 8 K/V heads, expert width 8192, dense MLP width 16384, vocabulary
    202,048): the interleaving halves the MoE layers, without which it would hold about 780B."""
    from clustersim.model.transformer import total_params

    moe = {"experts": 128, "top_k": 1, "expert_ffn": 8192, "shared_experts": 1, "layer_freq": [0, 1] * 24}
    model = {"name": "maverick", "layers": 48, "hidden": 5120, "heads": 40, "kv_heads": 8, "ffn_hidden": 16384,
             "vocab": 202048, "seq_len": 8192, "mlp": "swiglu", "norm": "rmsnorm", "bias": False, "moe": moe}
    d = scenario_dict(model=model, parallel={"tp": 8, "pp": 1, "dp": 2, "ep": 2, "sp": True, "etp": 1},
                      training={"global_batch_size": 2})
    m = clustersim.load_scenario(d, base_dir=root).model
    assert total_params(m) == pytest.approx(400e9, rel=0.01)
    every = m.model_copy(update={"moe": m.moe.model_copy(update={"layer_freq": 1})})
    assert total_params(every) > 1.9 * total_params(m)


def test_interleaved_moe_layers_run_where_layer_freq_puts_them(root):
    """MoE every second layer from layer 0: router and experts blocks in layers 0, 2, 4, 6 of 8,
    dense MLPs in the others; a selective recompute of ``mlp`` is then a module the model has;
    collapsed as every rank."""
    model = {**MOE, "layers": 8, "moe": {**MOE["moe"], "dense_layers_first": 0, "layer_freq": 2}}
    d = scenario_dict(model=model, parallel={"tp": 1, "pp": 2, "dp": 8, "ep": 4},
                      training={"global_batch_size": 16, "recompute": "selective", "recompute_modules": ["mlp"]})
    sc = clustersim.load_scenario(d, base_dir=root)
    rep, full = clustersim.simulate(sc), clustersim.simulate(sc, collapse=False)
    moe_layers = {s.layer for s in rep.trace.spans if s.kind == "compute" and s.name.endswith(" router")}
    assert moe_layers == {0, 2, 4, 6}
    assert {s.layer for s in rep.trace.spans if s.op == "all_to_all"} == moe_layers
    for key in ("step_time_s", "mfu", "exposed_comm_s"):
        assert rep.summary[key] == pytest.approx(full.summary[key], rel=1e-9), key


@pytest.mark.parametrize("moe,words", [
    ({"layer_freq": [0, 1, 0]}, "model.moe.layer_freq has 3 entries for model.layers=4"),
    ({"layer_freq": [0, 0, 0, 0]}, "model.moe.layer_freq: no layer is MoE"),
    ({"layer_freq": 4, "dense_layers_first": 1}, "model.moe.layer_freq: no layer is MoE"),
    ({"layer_freq": 0}, "model.moe.layer_freq: a positive integer N (every Nth layer MoE) or a list of 0 and 1"),
    ({"layer_freq": [0, 2, 0, 1]}, "model.moe.layer_freq: a list of 0 (a dense layer) and 1 (a MoE layer); entry 1 is 2"),
])
def test_bad_layer_freq(root, moe, words):
    model = {**MOE, "layers": 4, "moe": {**MOE["moe"], "dense_layers_first": 0, **moe}}
    d = scenario_dict(model=model, parallel={"tp": 1, "pp": 1, "dp": 16, "ep": 4}, training={"global_batch_size": 16})
    with pytest.raises(clustersim.ConfigError) as exc:
        clustersim.load_scenario(d, base_dir=root)
    assert words in str(exc.value)
