"""Model layer against published parameter counts and closed forms."""

from __future__ import annotations

import pytest

from clustersim.model.transformer import (
    DenseModelCfg, attn_block_fwd, block_bwd, layer_activation_bytes, mlp_block_fwd,
    model_flops_per_token_closed_form, total_params,
)

GPT3 = DenseModelCfg(layers=96, hidden=12288, heads=96, vocab=50257, seq_len=2048)
LLAMA2_70B = DenseModelCfg(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, mlp="swiglu",
                           norm="rmsnorm", bias=False, vocab=32000, seq_len=4096, tied_embeddings=False,
                           position_embedding="rope")


def test_gpt3_175b_parameter_count():
    # Brown et al. 2020 report 175B; the exact count of this architecture is 174.6B.
    assert total_params(GPT3) == pytest.approx(174.6e9, rel=2e-3)


def test_llama2_70b_parameter_count():
    # Touvron et al. 2023: 69B (68.98B with untied embeddings, GQA with 8 KV heads).
    assert total_params(LLAMA2_70B) == pytest.approx(68.98e9, rel=2e-3)


@pytest.mark.parametrize("t", [1, 2, 8])
def test_activation_bytes_match_korthikanti_table2(t):
    # s*b*h*(10 + 24/t + 5*a*s/(h*t)) for TP without SP, standard attention.
    m, b = GPT3, 2
    s, h, a = m.seq_len, m.hidden, m.heads
    expected = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert layer_activation_bytes(m, b, t, flash=False) == pytest.approx(expected, rel=1e-12)
    # flash attention drops exactly the score term
    assert layer_activation_bytes(m, b, t, flash=True) == pytest.approx(s * b * h * (10 + 24 / t), rel=1e-12)


@pytest.mark.parametrize("model", [GPT3, LLAMA2_70B])
def test_layer_flops_are_three_times_forward_and_match_6N(model):
    b, t = 1, 1
    fwd = attn_block_fwd(model, b, t, flash=True) + mlp_block_fwd(model, b, t)
    bwd = block_bwd(attn_block_fwd(model, b, t, True), True) + block_bwd(mlp_block_fwd(model, b, t), True)
    fwd_mf = sum(o.model_flops for o in fwd)
    bwd_mf = sum(o.model_flops for o in bwd)
    assert bwd_mf == pytest.approx(2 * fwd_mf, rel=1e-12)
    # per token per layer: 6 * matmul params + 6 * s * h (forward+backward; the causal half of 12 s h)
    per_token = (fwd_mf + bwd_mf) / (b * model.seq_len)
    matmul_params = model.hidden * ((model.heads + 2 * model.n_kv_heads) * model.head_dim + model.hidden) \
        + model.hidden * model.ffn * (3 if model.mlp == "swiglu" else 2)
    assert per_token == pytest.approx(6 * matmul_params + 6 * model.seq_len * model.hidden, rel=1e-12)
    # flash attention re-executes QK^T in backward: hardware FLOPs exceed model FLOPs
    assert sum(o.flops for o in bwd) > bwd_mf


def test_heads_must_divide_hidden():
    with pytest.raises(ValueError, match="heads=7 does not divide"):
        DenseModelCfg(layers=1, hidden=1024, heads=7, vocab=10, seq_len=8)


def test_closed_form_flops_per_token_gpt3():
    # 6N + 6*L*s*h with N = 174.6B (175B rounding of Kaplan's 6N)
    f = model_flops_per_token_closed_form(GPT3)
    assert f == pytest.approx(6 * 174.56e9 + 6 * 96 * 2048 * 12288, rel=2e-3)
