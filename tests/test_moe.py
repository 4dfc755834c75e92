"""Mixture of experts: parameter counts, expert parallelism's all-to-all, expert gradients."""

from __future__ import annotations

import pytest

import clustersim
from clustersim.model.moe import MoeCfg
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
    per_a2a = tokens * m.moe.top_k * m.moe.capacity_factor * m.hidden * 2
    moe_layers_stage0 = sum(1 for ly in range(sc.layers_per_stage[0]) if m.is_moe_layer(ly))
    a2a = [s for s in r.trace.spans if s.op == "all_to_all" and s.stage == 0]
    # dispatch + combine, forward and backward, per MoE layer per microbatch
    assert len(a2a) == 4 * moe_layers_stage0 * sc.microbatches
    assert all(s.size_bytes == pytest.approx(per_a2a) for s in a2a)
    assert {s.kind for s in a2a} == {"ep"}
    assert r.summary["exposed_comm_s"]["ep"] > 0


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
