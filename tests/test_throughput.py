"""Throughput figures against closed forms written from the scenario's numbers (docs/metrics.md).

The closed forms here are worked out from the model's shape, not by calling clustersim's
per-op code: Megatron-LM's FLOPs per step (Narayanan et al. SC'21, Sec 5.1; Korthikanti et al.
2022), without recompute and with full recompute, flash attention's extra QK^T, a general
per-layer count (GQA, SwiGLU, any MLP width) and the MoE layer's router and top-k experts.
Model FLOPs count the causal half of the attention square (Megatron-LM's count today); standard
attention executes the whole square (Narayanan's forms), flash attention the causal half.
clustersim's counts match these exactly (to float rounding) on every plan tried, so the
tolerance is 1e-12 relative.

B = global batch (sequences), s = sequence length, l = layers, h = hidden, V = vocabulary.
"""

from __future__ import annotations

import pytest

import clustersim

from .conftest import scenario_dict

EXACT = 1e-12
A100_BF16 = 312e12  # dense bf16 peak (NVIDIA's A100 data sheet)
H100_FP8 = 1979e12


def simulate(root, collapse=None, **sections):
    sc = clustersim.load_scenario(scenario_dict(**sections), base_dir=root)
    return clustersim.simulate(sc, collapse=collapse)


def square_72(B, s, l, h, V) -> float:
    """FLOPs per step with the whole attention square, no recompute (Narayanan et al.): fwd
    24Bslh^2 + 4Bs^2lh + 2BshV, backward twice that. What standard attention executes."""
    return 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))


def square_96(B, s, l, h, V) -> float:
    """Executed FLOPs with full recompute and the whole square: every layer's forward runs
    twice (the head's once)."""
    return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))


def causal_72(B, s, l, h, V) -> float:
    """Model FLOPs per step: the 72 form with the causal half of QK^T and PV, 2Bs^2lh forward
    (Megatron-LM's num_floating_point_operations: "only half of the mask is non-zero")."""
    return 72 * B * s * l * h**2 * (1 + s / (12 * h) + V / (12 * l * h))


def causal_96(B, s, l, h, V) -> float:
    """The 96 form with the causal half: full recompute under flash attention, before the
    kernel's own recomputed QK^T."""
    return 96 * B * s * l * h**2 * (1 + s / (12 * h) + V / (16 * l * h))


def shape(m):
    return m.seq_len, m.layers, m.hidden, m.vocab


# SMALL (tests/conftest.py) is a GPT layer: gelu, ffn = 4h, kv_heads = heads, which is the
# shape Megatron's formula assumes. The plans cover TP, SP, PP schedules, CP, ZeRO-3.
PLANS = {
    "tp4-pp2-dp2": {"tp": 4, "pp": 2, "dp": 2},
    "tp2-pp2-dp4-sp": {"tp": 2, "pp": 2, "dp": 4, "sp": True},
    "interleaved": {"tp": 4, "pp": 2, "dp": 2, "schedule": "interleaved", "vpp": 2},
    "zb-h1": {"tp": 4, "pp": 2, "dp": 2, "schedule": "zb-h1"},
    "dualpipe": {"tp": 4, "pp": 2, "dp": 2, "schedule": "dualpipe"},
    "dp16-zero3": {"tp": 1, "pp": 1, "dp": 16, "zero": 3},
}
B = 16


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_model_flops_count_the_causal_half_and_standard_attention_executes_the_square_72_form(root, plan):
    r = simulate(root, parallel=PLANS[plan], training={"global_batch_size": B, "attention": "standard"})
    s, l, h, V = shape(r.scenario.model)
    assert r.summary["model_flops_per_step"] == pytest.approx(causal_72(B, s, l, h, V), rel=EXACT)
    # standard attention recomputes nothing but computes the masked half of the square too
    want = square_72(B, s, l, h, V)
    assert r.summary["hardware_flops_per_step"] == pytest.approx(want, rel=EXACT)
    assert r.summary["hfu"] / r.summary["mfu"] == pytest.approx(want / causal_72(B, s, l, h, V), rel=EXACT)


def test_model_flops_do_not_depend_on_the_symmetric_collapse(root):
    """The sum over simulated ranks, each weighed by the GPUs it stands for, is the world's."""
    d = {"parallel": PLANS["tp4-pp2-dp2"], "training": {"global_batch_size": B}}
    rep = simulate(root, collapse=True, **d).summary
    full = simulate(root, collapse=False, **d).summary
    assert rep["simulation"]["simulated_ranks"] == 2 and full["simulation"]["simulated_ranks"] == 16
    for key in ("model_flops_per_step", "hardware_flops_per_step"):
        assert rep[key] == pytest.approx(full[key], rel=EXACT)


def test_6N_plus_12lsh_per_token_is_the_square_72_form():
    """6 N_matmul + 12 l s h per token, N_matmul = l * 12h^2 + V h (LM head), times B s tokens;
    with the causal half, 6 N_matmul + 6 l s h."""
    Bq, s, l, h, V = 8, 2048, 24, 2304, 51200
    n_matmul = l * 12 * h * h + V * h
    assert (6 * n_matmul + 12 * l * s * h) * Bq * s == pytest.approx(square_72(Bq, s, l, h, V), rel=EXACT)
    assert (6 * n_matmul + 6 * l * s * h) * Bq * s == pytest.approx(causal_72(Bq, s, l, h, V), rel=EXACT)


def test_general_layer_count_gqa_swiglu(root):
    """Per token per layer forward: QKV 2h(a + 2a_kv)d, QK^T and PV 4sh halved by the causal
    mask, projection 2h^2, SwiGLU 2 * 3hf; LM head 2hV once. Backward 2x. No biases or norms
    in the count."""
    model = {"name": "gqa", "layers": 4, "hidden": 1024, "heads": 16, "kv_heads": 4, "ffn_hidden": 2816,
             "mlp": "swiglu", "norm": "rmsnorm", "bias": False, "position_embedding": "rope",
             "tied_embeddings": False, "vocab": 32000, "seq_len": 1024}
    r = simulate(root, model=model, parallel={"tp": 4, "pp": 2, "dp": 2},
                 training={"global_batch_size": 8, "attention": "standard"})
    a, kv, d, f = 16, 4, 1024 // 16, 2816
    s, l, h, V = 1024, 4, 1024, 32000
    per_token_fwd = l * (2 * h * (a + 2 * kv) * d + 4 * s * h / 2 + 2 * h * h + 2 * 3 * h * f) + 2 * h * V
    want = 3 * 8 * s * per_token_fwd
    assert r.summary["model_flops_per_step"] == pytest.approx(want, rel=EXACT)
    n_matmul = l * (h * (a + 2 * kv) * d + h * h + 3 * h * f) + V * h
    assert want == pytest.approx((6 * n_matmul + 6 * l * s * h) * 8 * s, rel=EXACT)
    # standard attention executes the whole square: the other 2sh forward, 3x over the step
    executed = r.summary["hardware_flops_per_step"]
    assert executed - want == pytest.approx(3 * 8 * s * l * 2 * s * h, rel=EXACT)


# ---------------------------------------------------------------- recompute
@pytest.mark.parametrize("plan", ["tp4-pp2-dp2", "tp2-pp2-dp4-sp", "zb-h1"])
def test_full_recompute_executes_the_square_96_form_and_keeps_model_flops(root, plan):
    base = simulate(root, parallel=PLANS[plan], training={"global_batch_size": B, "attention": "standard"})
    full = simulate(root, parallel=PLANS[plan],
                    training={"global_batch_size": B, "attention": "standard", "recompute": "full"})
    s, l, h, V = shape(full.scenario.model)
    fs = full.summary
    assert fs["model_flops_per_step"] == pytest.approx(causal_72(B, s, l, h, V), rel=EXACT)
    assert fs["model_flops_per_step"] == pytest.approx(base.summary["model_flops_per_step"], rel=EXACT)
    assert fs["hardware_flops_per_step"] == pytest.approx(square_96(B, s, l, h, V), rel=EXACT)
    # HFU / MFU = 96(1 + s/6h + V/16lh) / 72(1 + s/12h + V/12lh): the recomputed forward
    # (4/3 without the LM head, less with it: the head runs once) and the masked half that
    # standard attention computes
    ratio = (4 / 3) * (1 + s / (6 * h) + V / (16 * l * h)) / (1 + s / (12 * h) + V / (12 * l * h))
    assert fs["hfu"] / fs["mfu"] == pytest.approx(ratio, rel=EXACT)
    assert ratio > 1
    assert fs["hw_tflops_per_gpu"] / fs["tflops_per_gpu"] == pytest.approx(ratio, rel=EXACT)
    # recompute costs time, so MFU drops
    assert fs["step_time_s"] > base.summary["step_time_s"] and fs["mfu"] < base.summary["mfu"]


def test_selective_recompute_executes_one_more_core_attention_forward(root):
    """QK^T and PV again, the whole square under standard attention: 2 * 2 * s^2 * h per
    sequence and layer, 4 B s^2 l h per step, on top of the 72 form."""
    r = simulate(root, parallel=PLANS["tp4-pp2-dp2"],
                 training={"global_batch_size": B, "attention": "standard", "recompute": "selective"})
    s, l, h, V = shape(r.scenario.model)
    assert r.summary["model_flops_per_step"] == pytest.approx(causal_72(B, s, l, h, V), rel=EXACT)
    extra = r.summary["hardware_flops_per_step"] - square_72(B, s, l, h, V)
    assert extra == pytest.approx(4 * B * s * s * l * h, rel=EXACT)


# ---------------------------------------------------------------- flash attention
@pytest.mark.parametrize("plan", ["tp4-pp2-dp2", "cp2-ring", "cp2-unbalanced", "cp2-all-gather"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_flash_attention_executes_one_extra_QKt_per_layer_and_sequence(root, plan, recompute):
    """It skips the blocks the causal mask hides, so it executes the causal half the model
    counts, and its backward recomputes S = QK^T: 5 matmuls of s^2 d per head where the model
    needs 4 (2.5x the forward's QK^T + PV, counted 2x in model FLOPs). The extra is one causal
    QK^T, s^2 h per sequence and layer: B s^2 l h per step, with or without context
    parallelism, balanced or not. Selective recompute adds nothing (flash already recomputes);
    full recompute adds the 96 form's forward, causal too."""
    parallel = {"tp4-pp2-dp2": PLANS["tp4-pp2-dp2"],
                "cp2-ring": {"tp": 2, "cp": 2, "pp": 2, "dp": 2},
                "cp2-unbalanced": {"tp": 2, "cp": 2, "pp": 2, "dp": 2, "cp_load_balance": False},
                "cp2-all-gather": {"tp": 2, "cp": 2, "pp": 2, "dp": 2, "cp_comm": "all_gather"}}[plan]
    r = simulate(root, parallel=parallel,
                 training={"global_batch_size": B, "attention": "flash", "recompute": recompute})
    s, l, h, V = shape(r.scenario.model)
    qkt = B * s * s * l * h
    assert r.summary["model_flops_per_step"] == pytest.approx(causal_72(B, s, l, h, V), rel=EXACT)
    executed = causal_96(B, s, l, h, V) if recompute == "full" else causal_72(B, s, l, h, V)
    assert r.summary["hardware_flops_per_step"] == pytest.approx(executed + qkt, rel=EXACT)


# ---------------------------------------------------------------- rates
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_mfu_hfu_tflops_and_tokens_per_s_from_their_definitions(root, recompute):
    r = simulate(root, parallel=PLANS["tp4-pp2-dp2"], training={"global_batch_size": B, "recompute": recompute})
    sm = r.summary
    T, world, peak = sm["step_time_s"], sm["world_size"], sm["hardware"]["peak_flops"]
    assert world == 16 and peak == A100_BF16
    model, hw = sm["model_flops_per_step"], sm["hardware_flops_per_step"]
    assert sm["mfu"] == pytest.approx(model / (T * world * peak), rel=EXACT)
    assert sm["hfu"] == pytest.approx(hw / (T * world * peak), rel=EXACT)
    assert sm["tflops_per_gpu"] == pytest.approx(model / (T * world) / 1e12, rel=EXACT)
    assert sm["hw_tflops_per_gpu"] == pytest.approx(hw / (T * world) / 1e12, rel=EXACT)
    assert sm["tflops_per_gpu"] * 1e12 == pytest.approx(sm["mfu"] * peak, rel=EXACT)
    tokens = B * r.scenario.model.seq_len
    assert sm["tokens_per_step"] == tokens
    assert sm["tokens_per_s"] == pytest.approx(tokens / T, rel=EXACT)
    assert sm["tokens_per_s_per_gpu"] == pytest.approx(tokens / T / world, rel=EXACT)
    # model FLOPs per token times tokens per second is the cluster's model FLOP rate
    assert model / tokens * sm["tokens_per_s"] == pytest.approx(sm["tflops_per_gpu"] * 1e12 * world, rel=EXACT)
    assert 0 < sm["mfu"] <= sm["hfu"] < 1


def test_fp8_divides_by_the_fp8_peak(root):
    r = simulate(root, cluster={"topology": "topologies/single-h100.yaml", "nodes": 1},
                 parallel={"tp": 1, "pp": 1, "dp": 1}, training={"global_batch_size": 2, "precision": "fp8"})
    sm = r.summary
    assert sm["hardware"]["peak_flops"] == H100_FP8
    assert sm["mfu"] == pytest.approx(sm["model_flops_per_step"] / (sm["step_time_s"] * H100_FP8), rel=EXACT)


def test_fp8_runs_the_linear_layers_in_fp8_and_attention_head_and_router_in_bf16():
    """Transformer Engine's FP8 casts its Linear layers' GEMMs (QKV, projections, MLP, experts);
    core attention (fp8_dpa off by default), Megatron-LM's output layer and the MoE router stay
    BF16: at H100's peaks (1979 against 989 TFLOP/s) a projection takes half the time, the others
    the same."""
    from clustersim.hardware import lookup_gpu
    from clustersim.model.transformer import Op
    from clustersim.program.costs import op_time_s

    gpu = lookup_gpu("H100")
    for name, ratio in (("qkv", 989 / 1979), ("down", 989 / 1979), ("core_attn", 1.0), ("lm_head", 1.0),
                        ("router", 1.0)):
        op = Op(name, 1e12, 0.0)
        assert op_time_s(op, gpu, "fp8") == pytest.approx(ratio * op_time_s(op, gpu, "bf16"), rel=EXACT), name


def test_fp8_gemms_pay_the_cast_of_their_operand():
    """Under FP8 a GEMM first casts one operand to FP8 with its transpose, a memory-bound pass of
    4 bytes a value (read 2, write 1 and 1): its input (m x k) forward, its output gradient
    (m x n) backward, whose dgrad and wgrad halves share it; the experts' grouped GEMMs too. Under
    BF16, and for the ops FP8 training leaves in BF16, nothing is added."""
    from clustersim.hardware import lookup_gpu
    from clustersim.model.moe import MoeCfg, routed_experts_fwd
    from clustersim.model.transformer import _backward, matmul_op
    from clustersim.program.costs import gemm_efficiency, op_time_s
    from clustersim.program.work import split_backward_ops

    gpu = lookup_gpu("H100")
    bw = gpu.hbm_bw_Bps * gpu.memory_efficiency
    m, k, n = 8192, 4096, 6144
    fwd = matmul_op("qkv", m, k, n)
    bwd = _backward(fwd)
    for op, cast in ((fwd, m * k), (bwd, m * n)):
        assert op_time_s(op, gpu, "fp8") == pytest.approx(
            max(op.flops / (gpu.fp8_flops * gemm_efficiency(op, gpu, "fp8")), op.bytes / bw) + 4 * cast / bw, rel=EXACT)
        assert op_time_s(op, gpu, "bf16") == pytest.approx(
            max(op.flops / (gpu.bf16_flops * gemm_efficiency(op, gpu, "bf16")), op.bytes / bw), rel=EXACT)
    b_half, w_half = split_backward_ops([bwd])
    assert sum(op_time_s(o, gpu, "fp8") for o in b_half + w_half) == pytest.approx(op_time_s(bwd, gpu, "fp8"), rel=EXACT)
    head = matmul_op("lm_head", m, k, 50000)  # left in BF16: no cast
    assert op_time_s(head, gpu, "fp8") == op_time_s(head, gpu, "bf16")
    up = routed_experts_fwd(MoeCfg(experts=8, top_k=2, expert_ffn=2048, capacity_factor=1.25,
                                    pad_to_capacity=True), 4096, 1024, 1)[0]
    assert up.fp8_cast_elems == 4096 * 2 * 1.25 * 1024 and up.fp8_grad_elems == 4096 * 2 * 1.25 * 2 * 2048


def test_a_dense_fp8_step_pays_its_casts_in_full(root):
    """A dense layer under FP8, one GPU, no recompute: the compute differs from what it is with
    free casts by 4 bytes a value of every GEMM's input forward (QKV h, out projection h, MLP up
    h, down f) and output gradient backward (QKV h + 2 h_kv, projection h, up 2f for SwiGLU, down
    h), per token and layer, at the HBM rate."""
    from clustersim.program import costs

    model = {"layers": 2, "hidden": 1024, "heads": 8, "kv_heads": 2, "ffn_hidden": 2816, "mlp": "swiglu",
             "vocab": 32000, "seq_len": 2048}
    d = dict(cluster={"topology": "topologies/dgx-h100.yaml", "nodes": 1}, model=model,
             parallel={"tp": 1, "pp": 1, "dp": 8}, training={"global_batch_size": 16, "precision": "fp8"})

    def compute_s() -> float:
        return clustersim.simulate(clustersim.load_scenario(scenario_dict(**d), base_dir=root), brief=True).summary[
            "compute_s"]

    paid = compute_s()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(costs, "FP8_CAST_BYTES_PER_ELEM", 0)
        free = compute_s()
    h, f, kv = 1024, 2816, 2 * 1024 // 8
    per_token_layer = (h + h + h + f) + (h + 2 * kv + h + 2 * f + h)
    tokens = 16 // 8 * 2048
    gpu = clustersim.hardware.lookup_gpu("H100")
    assert paid - free == pytest.approx(4 * per_token_layer * tokens * 2 / (gpu.hbm_bw_Bps * gpu.memory_efficiency),
                                        rel=1e-9)


@pytest.mark.parametrize("gpu_name, fwd_bwd", [("A100", (200 / 312, 196 / 312)), ("H100", (616 / 989, 561 / 989))])
def test_flash_attention_runs_at_its_kernels_published_efficiency(gpu_name, fwd_bwd):
    """Flash attention's fused kernels reach less of the peak than a large GEMM: core attention
    under flash runs at FlashAttention-2's published A100 rates (Dao 2023: about 200 TFLOP/s
    forward with the causal mask, 196 backward, of 312) and FlashAttention-3's H100 ones (Shah et
    al. 2024: 616 and 561 of 989), each op's FLOPs as clustersim counts them; standard attention
    (batched GEMMs) and the other GEMMs run at their shapes' efficiency (costs.gemm_efficiency),
    and flash attention's kernels at the matmul efficiency on a GPU without a published
    attention figure of its own."""
    from dataclasses import replace

    from clustersim.hardware import lookup_gpu
    from clustersim.model.transformer import DenseModelCfg, attn_block_fwd, block_bwd
    from clustersim.program.costs import gemm_efficiency, op_time_s

    gpu = lookup_gpu(gpu_name)
    m = DenseModelCfg(layers=2, hidden=1024, heads=8, ffn_hidden=4096, vocab=1000, seq_len=4096)
    for flash in (True, False):
        fwd = next(op for op in attn_block_fwd(m, 1, 1, flash) if op.name == "core_attn")
        bwd = next(op for op in block_bwd([fwd], flash) if op.name == "core_attn")
        for op, want in ((fwd, fwd_bwd[0]), (bwd, fwd_bwd[1])):
            eff = want if flash else gemm_efficiency(op, gpu, "bf16")  # (standard: its batched GEMMs' shapes)
            compute_s = op.flops / (gpu.bf16_flops * eff)
            memory_s = op.bytes / (gpu.hbm_bw_Bps * gpu.memory_efficiency)
            assert op_time_s(op, gpu, "bf16") == pytest.approx(max(compute_s, memory_s), rel=EXACT), (flash, op)
    flash_fwd = next(op for op in attn_block_fwd(m, 1, 1, True) if op.name == "core_attn")
    assert op_time_s(flash_fwd, replace(gpu, attention_efficiency=None), "bf16") == pytest.approx(
        flash_fwd.flops / (gpu.bf16_flops * gpu.matmul_efficiency), rel=EXACT)
    qkv = next(op for op in attn_block_fwd(m, 1, 1, True) if op.name == "qkv")
    assert op_time_s(qkv, gpu, "bf16") == pytest.approx(
        max(qkv.flops / (gpu.bf16_flops * gemm_efficiency(qkv, gpu, "bf16")),
            qkv.bytes / (gpu.hbm_bw_Bps * gpu.memory_efficiency)),
        rel=EXACT)


# ---------------------------------------------------------------- mixture of experts
MOE = {"experts": 16, "top_k": 2, "expert_ffn": 1024, "shared_experts": 1, "dense_layers_first": 1}


def moe_closed_form(Bq, s, l, h, V, experts, top_k, f_e, shared, dense_first, mats=3):
    """Model FLOPs per step of the SMALL model with MoE MLPs (SwiGLU experts, no biases):
    attention as in the causal 72 form; the first ``dense_first`` layers keep a dense 4h SwiGLU MLP;
    every other layer: router 2hE, top_k routed experts and the shared experts,
    2 * mats * h * f_e each, per token forward. Backward 2x."""
    attn = 2 * 3 * h * h + 4 * s * h / 2 + 2 * h * h
    dense = 2 * 3 * h * (4 * h)
    moe = 2 * h * experts + (top_k + shared) * 2 * mats * h * f_e  # capacity padding is not model work
    per_token_fwd = l * attn + dense_first * dense + (l - dense_first) * moe + 2 * h * V
    return 3 * Bq * s * per_token_fwd


def moe_run(root, tp=1, **moe):
    model = {"moe": {**MOE, **moe}, "mlp": "swiglu", "bias": False}
    return simulate(root, model=model, parallel={"tp": tp, "pp": 2, "dp": 16 // (2 * tp), "ep": 4, "sp": tp > 1},
                    training={"global_batch_size": B})


@pytest.mark.parametrize("moe", [{}, {"experts": 32}, {"top_k": 4}, {"shared_experts": 0},
                                 {"capacity_factor": 1.25}, {"capacity_factor": 1.25, "pad_to_capacity": True},
                                 {"mlp": "gelu"}])
def test_moe_model_flops_count_the_top_k_experts_only(root, moe):
    r = moe_run(root, **moe)
    cfg = {**MOE, **moe}
    s, l, h, V = shape(r.scenario.model)
    want = moe_closed_form(B, s, l, h, V, cfg["experts"], cfg["top_k"], cfg["expert_ffn"], cfg["shared_experts"],
                           cfg["dense_layers_first"], mats=2 if cfg.get("mlp") == "gelu" else 3)
    assert r.summary["model_flops_per_step"] == pytest.approx(want, rel=EXACT)


def test_moe_more_experts_at_the_same_top_k_add_router_flops_only(root):
    base, wide = moe_run(root), moe_run(root, experts=32)
    s, l, h = base.scenario.model.seq_len, base.scenario.model.layers, base.scenario.model.hidden
    moe_layers = l - MOE["dense_layers_first"]
    router = 3 * B * s * moe_layers * 2 * h * (32 - 16)
    diff = wide.summary["model_flops_per_step"] - base.summary["model_flops_per_step"]
    assert diff == pytest.approx(router, rel=EXACT)


@pytest.mark.parametrize("tp", [2])  # 16 GPUs, pp 2, ep 4: tp 2 is the largest that leaves dp >= ep
def test_moe_router_counted_once_under_tensor_parallelism(root, tp):
    """Each TP rank executes the whole router (it is replicated) but the model needs it once."""
    r = moe_run(root, tp=tp)
    s, l, h, V = shape(r.scenario.model)
    want = moe_closed_form(B, s, l, h, V, MOE["experts"], MOE["top_k"], MOE["expert_ffn"],
                           MOE["shared_experts"], MOE["dense_layers_first"])
    assert r.summary["model_flops_per_step"] == pytest.approx(want, rel=EXACT)


def test_weighted_flop_totals_are_pythons_left_to_right_sum():
    """The step's FLOP totals weigh each span by its rank's weight and add them left to right,
    as ``sum`` does: in numpy when the values are floats (an integer 0 among them), in Python
    otherwise; the same number and the same type either way."""
    from operator import mul

    from clustersim.analysis.columns import SpanColumns
    from clustersim.analysis.metrics import _weighted_total
    from clustersim.trace import Span, SpanForm

    def spans(values):
        forms = [SpanForm("compute", f"op{i}", "compute", "F", 0, 0, 0.0, "", v, v) for i, v in enumerate(values)]
        return [Span.of_form(k % 3, forms[k % len(forms)], 0.0, 1.0, 0, k) for k in range(40)]

    weight = {0: 8, 1: 3, 2: 48}
    cases = [[1e15 / 3, 2.5e14, 0, 7.1e13], [0.1, 0.2, 0.3], [0, 0], [3, 5, 0.5], [-0.0, 0.0]]
    for values in cases:
        s = spans(values)
        cols = SpanColumns(s, ranks=[0, 1, 2])
        want = sum(map(mul, (weight[x.rank] for x in s), (x.flops for x in s)))
        got = _weighted_total(cols, weight, "flops")
        assert got == want and type(got) is type(want) and str(got) == str(want), values
