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
    ({"ep": 2, "zero": 3}, "parallel.zero", "not modelled yet"),
])
def test_impossible_expert_plans(root, parallel, field, words):
    d = scenario_dict(model=MOE, parallel={"tp": 1, "pp": 2, "dp": 8, **parallel}, training={"global_batch_size": 16})
    with pytest.raises(clustersim.ConfigError, match=field) as exc:
        clustersim.load_scenario(d, base_dir=root)
    assert words in str(exc.value)


def test_ep_needs_a_moe_model(root):
    with pytest.raises(clustersim.ConfigError, match="needs a mixture-of-experts model"):
        clustersim.load_scenario(scenario_dict(parallel={"tp": 1, "pp": 2, "dp": 8, "ep": 2}), base_dir=root)
