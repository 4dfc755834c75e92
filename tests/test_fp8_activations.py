"""FP8 training as Transformer Engine runs it (``precision: fp8``): a Linear layer keeps its
input as its FP8 copy (the activation terms against closed forms, what a split backward holds
for W, whole stages against their bf16 twins, DeepSeek-V3's published run against the 80 GB it
fit in) and gathers FP8 under sequence parallelism (each block's collectives against its bf16
twin's)."""

from __future__ import annotations

import pytest

import clustersim
from clustersim.model import transformer as tf
from clustersim.program.work import stage_work

from .conftest import scenario_dict

EXACT = 1e-12
DENSE = tf.DenseModelCfg(name="d", layers=2, hidden=1024, heads=16, vocab=32000, seq_len=2048, dropout=False)


@pytest.mark.parametrize("recipe,flash_sbh,standard_sbh", [("delayed", 27, 25), ("blockwise", 26, 26)])
def test_a_dense_layer_under_fp8(recipe, flash_sbh, standard_sbh):
    """Korthikanti et al.'s 34sbh without dropout's 2sbh of masks, term by term, with each
    Linear input at one byte: norm inputs 4, QKV input 2 -> 1, Q/K/V 6, MLP input 2 -> 1, GELU
    input 8, GELU output 8 -> 4 (t = 1), and the context: under delayed scaling the out
    projection's FP8 copy, 1, beside flash attention's own 16-bit output, 2 (standard attention
    keeps none: its backward reads the scores and V); under the other recipes the projection
    keeps the 16-bit input itself, 2."""
    s, b, h = 2048, 2, 1024
    sbh = s * b * h
    assert tf.layer_activation_bytes(DENSE, b, 1, True) == pytest.approx(32 * sbh, rel=EXACT)
    assert tf.layer_activation_bytes(DENSE, b, 1, True, fp8=recipe) == pytest.approx(flash_sbh * sbh, rel=EXACT)
    scores = tf.attention_scores_bytes(DENSE, b, 1)
    assert tf.layer_activation_bytes(DENSE, b, 1, False, fp8=recipe) == pytest.approx(
        standard_sbh * sbh + scores, rel=EXACT)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
@pytest.mark.parametrize("sp", [False, True])
def test_only_linear_inputs_shrink(sp, recipe):
    """Each term of FP8_LINEAR_INPUTS read by one layer halves; MLA's normed input, read by both
    down projections, keeps two FP8 copies (unchanged); the context is 3/2 under delayed
    scaling with flash attention; the rest (norm inputs, Q/K/V, activation inputs, MLA latents
    before their norms) is unchanged."""
    m = tf.DenseModelCfg(name="m", layers=2, hidden=1024, heads=16, vocab=32000, seq_len=2048, mlp="swiglu",
                         ffn_hidden=2816, bias=False, mla={"q_lora_rank": 256, "kv_lora_rank": 128, "qk_head_dim": 64,
                                                           "qk_rope_head_dim": 32, "v_head_dim": 64})
    bf16, fp8 = (tf.layer_activation_terms(m, 1, 4, True, sp, fp8=x) for x in ("", recipe))
    assert bf16.keys() == fp8.keys() >= {"qkv_input", "mlp_input", "mla_normed", "mlp_act"}
    for term, x in bf16.items():
        halved = term in tf.FP8_LINEAR_INPUTS and term != "qkv_input"
        want = x / 2 if halved else 1.5 * x if term == "context" and recipe == "delayed" else x
        assert fp8[term] == pytest.approx(want, rel=EXACT), term


@pytest.mark.parametrize("recipe,shared_input", [("delayed", 3), ("blockwise", 2)])
def test_a_moe_layer_keeps_its_dispatched_tokens_and_fc2_inputs_in_fp8(recipe, shared_input):
    """The routed experts' first GEMM reads the dispatched tokens and their second the
    activation's output (one byte each under FP8); a SwiGLU shared expert keeps its first
    GEMM's 2f output in 16 bits and its activation's f output in 8: 5sbf where bf16 keeps 6sbf.
    The MLP's input (the norm's output) stays 16-bit for the router, plus the shared expert's
    FP8 copy under delayed scaling (Megatron-LM: 'the output of pre_mlp_layernorm is saved by
    router, and the shared expert linear_fc1 also saves the quantized tensor')."""
    m = tf.DenseModelCfg(name="moe", layers=2, hidden=1024, heads=16, vocab=32000, seq_len=2048, mlp="swiglu",
                         ffn_hidden=2816, moe={"experts": 16, "top_k": 4, "expert_ffn": 512, "shared_experts": 1})
    s, k, h, f = 2048, 4, 1024, 512
    bf16, fp8 = (tf.layer_activation_terms(m, 1, 1, True, moe_layer=True, fp8=x) for x in ("", recipe))
    assert fp8["dispatched"] == pytest.approx(s * k * h, rel=EXACT) == bf16["dispatched"] / 2
    assert fp8["experts_act"] == pytest.approx(s * k * f, rel=EXACT)
    assert fp8["experts_fc1"] == bf16["experts_fc1"] == pytest.approx(2 * s * k * 2 * f, rel=EXACT)
    assert fp8["shared"] == pytest.approx(5 * s * f, rel=EXACT) and bf16["shared"] == pytest.approx(6 * s * f)
    assert fp8["mlp_input"] + fp8.get("shared_input_fp8", 0) == pytest.approx(shared_input * s * h, rel=EXACT)
    alone = m.model_copy(update={"moe": m.moe.model_copy(update={"shared_experts": 0})})
    terms = tf.layer_activation_terms(alone, 1, 1, True, moe_layer=True, fp8=recipe)
    assert terms["mlp_input"] == 2 * s * h and "shared_input_fp8" not in terms
    # recomputing the shared experts (or the whole MoE layer) keeps no FP8 copy of their input
    for module in ("shared_experts", "moe"):
        kept = tf.layer_activation_bytes(m, 1, 1, True, recompute="selective", moe_layer=True, modules=(module,),
                                         fp8=recipe)
        left = tf.layer_activation_terms(m, 1, 1, True, moe_layer=True, fp8=recipe)
        assert kept == pytest.approx(sum(v for k, v in left.items() if k not in tf.RECOMPUTE_MODULES[module]))
        assert "shared_input_fp8" in tf.RECOMPUTE_MODULES[module]


@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
def test_w_holds_fp8_inputs_and_16_bit_gradients(recipe):
    """A delayed weight gradient reads each GEMM's input as an FP8 copy (where the forward kept
    the 16-bit input, B quantizes it before storing it), and keeps the output gradient's FP8
    data and its transpose, two bytes a value: of the zero-bubble paper's 32sbh, the inputs'
    14 become 7, the gradients' 18 stay: 25sbh under every recipe."""
    s, b, h = 2048, 1, 1024
    gelu = tf.DenseModelCfg(name="g", layers=2, hidden=h, heads=16, vocab=32000, seq_len=s)
    assert tf.layer_wgrad_bytes(gelu, b, 1) == pytest.approx(32 * s * b * h, rel=EXACT)
    assert tf.layer_wgrad_bytes(gelu, b, 1, fp8=recipe) == pytest.approx(25 * s * b * h, rel=EXACT)


def stages(root, precision, model=None, parallel=None, **training):
    d = scenario_dict(cluster={"topology": "topologies/dgx-h100.yaml", "nodes": 1},
                      model={"layers": 4, "hidden": 1024, "heads": 16, "seq_len": 2048, "dropout": False, **(model or {})},
                      parallel={"tp": 2, "pp": 2, "dp": 2, "sp": True, "schedule": "zb-h1", **(parallel or {})},
                      training={"precision": precision, "attention": "flash", **training})
    sc = clustersim.load_scenario(d, base_dir=root)
    return sc, [stage_work(sc, j, sc.cluster.gpu) for j in range(2)]


def test_a_stage_keeps_the_closed_form_less_under_fp8(root):
    """Two layers a stage, TP2 with SP, delayed scaling: each layer keeps 5sbh/2 less (QKV and
    MLP inputs sbh/2 each under SP, the GELU output 2sbh, the context sbh/2 more), W holds 7sbh/2
    less (the four inputs halved: sbh/2, sbh/2, sbh/2, 2sbh); the last stage's fp32 logits stay;
    full recompute keeps the 16-bit layer inputs as before."""
    s, h, t = 2048, 1024, 2
    sbh = s * h
    sc, bf16 = stages(root, "bf16")
    _, fp8 = stages(root, "fp8")
    per_layer = (1 + 1 + 4 - 1) / t * sbh  # qkv_input, mlp_input, mlp_act halved; the context x 1.5
    for a, b in zip(bf16, fp8):
        assert a.activation_bytes_per_mb - b.activation_bytes_per_mb == pytest.approx(2 * per_layer, rel=EXACT)
    assert bf16[0].wgrad_bytes_per_mb - fp8[0].wgrad_bytes_per_mb == pytest.approx(2 * 7 / t * sbh, rel=EXACT)
    full = [stages(root, p, recompute="full")[1][0].activation_bytes_per_mb for p in ("bf16", "fp8")]
    assert full[0] == full[1] == pytest.approx(2 * 2 * sbh / t, rel=EXACT)


def test_deepseek_v3_against_its_80_gb(root):
    """DeepSeek-V3's run fit in 80 GB (H800). With its blockwise recipe's FP8 copies every rank
    peaks below that, within 3 GiB of it (left out, DeepSeek's own storage of SwiGLU inputs in
    FP8 and of the attention output in E5M6, which would leave more);
    with 16-bit activations above it."""
    import yaml

    path = root / "scenarios/deepseek_v3_2048gpu.yaml"
    s = clustersim.simulate(path).summary["memory"]
    cap, GiB = s["capacity_bytes"], 1024**3
    assert cap - 3 * GiB < s["peak_bytes"] < cap and s["fits"]
    d = yaml.safe_load(path.read_text())
    d["training"]["precision"] = "bf16"  # 16-bit activations, the same memory otherwise
    d["model"]["moe"]["fp8_dispatch"] = False  # (which needs FP8 training: 16-bit receive buffers too)
    del d["training"]["fp8_recipe"]
    bf16 = clustersim.simulate(clustersim.load_scenario(d, base_dir=path.parent)).summary["memory"]
    assert bf16["peak_bytes"] > cap
    text = " ".join((root / "docs/parallelism.md").read_text().split())
    assert f"needs {s['peak_bytes'] / GiB:.1f} GiB at most with FP8 copies" in text
    assert f"(`precision: bf16`, whose memory is otherwise the same) {bf16['peak_bytes'] / GiB:.1f} GiB at most" in text


def collectives(work) -> list[tuple]:
    """Every TP collective of a stage's blocks, in order: (list, block, where, op, label, bytes)."""
    return [(which, blk.name, where, c.op, c.label, c.size_bytes)
            for which in ("fwd", "bwd", "bwd_input", "bwd_weight") for blk in getattr(work, which)
            for where in ("pre", "post", "overlap") for c in getattr(blk, where) if c.dim == "tp"]


MOE = {"moe": {"experts": 8, "top_k": 2, "expert_ffn": 512, "shared_experts": 1}, "mlp": "swiglu", "bias": False}


def transformer_engine_gather(which: str, name: str, where: str, op: str, label: str) -> bool:
    """Whether a collective is a Transformer Engine layer's gather: the attention's, the dense
    MLP's and the shared experts' all-gathers and shifts, not the routed experts' gather of what
    the dispatch brought; of the MTP projection, its input's gather and W's re-gather, not its
    output's (Megatron-LM's own)."""
    if op not in ("all_gather", "shift"):
        return False
    if name.startswith("mtp proj"):
        return (which, where) in (("fwd", "pre"), ("bwd_weight", "pre")) or where == "overlap"
    return name.split(" ")[0] in ("attn", "mlp", "router", "experts") and label != "experts in"


@pytest.mark.parametrize("model,plan", [({}, {}), ({}, {"tp_comm_overlap": True}), (MOE, {"ep": 2}),
                                        ({"mtp_layers": 1}, {})], ids=["sp", "overlapped", "moe", "mtp"])
def test_transformer_engine_layers_gather_fp8(root, model, plan):
    """Under SP the attention's and the dense MLP's all-gathers (the column-parallel input, the
    row-parallel output's gradient, W's re-gather, or the ring exchange's shifts that replace
    them) move half the bytes under FP8, as do the shared experts' beside EP and an MTP
    projection's input gathers; their reduce-scatters, the head's and the embedding's gathers
    and the routed experts' (Megatron-LM's own, not Transformer Engine's) do not."""
    _, bf16 = stages(root, "bf16", model, plan)
    _, fp8 = stages(root, "fp8", model, plan)
    halved = 0
    for a, b in zip(bf16, fp8):
        ca, cb = collectives(a), collectives(b)
        assert [x[:5] for x in ca] == [x[:5] for x in cb]
        for (*key, x), (*_, y) in zip(ca, cb):
            te = transformer_engine_gather(*key)
            assert y == pytest.approx(x / 2 if te else x, rel=EXACT), key
            halved += te
    assert halved >= 8


def test_mla_gathers_its_latents_fp8_and_its_rotary_key_16_bit(root):
    """MLA under SP gathers the latents as FP8 and the rotary key part (Megatron-LM's own
    gather) in 16 bits: per token (q_r + kv_r) one byte and d_rope two, where bf16 moves two
    each; W's re-gather (the latents alone) moves one."""
    mla = {"q_lora_rank": 384, "kv_lora_rank": 128, "qk_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64}
    model = {"mla": mla, "bias": False}
    sc, bf16 = stages(root, "bf16", model)
    _, fp8 = stages(root, "fp8", model)
    tokens = sc.model.seq_len  # a microbatch of one sequence
    gathers = {prec: {(w, n, where): x for w, n, where, op, _, x in collectives(work[0]) if op == "all_gather"}
               for prec, work in (("bf16", bf16), ("fp8", fp8))}
    fwd = ("fwd", "attn", "pre")
    assert gathers["bf16"][fwd] == pytest.approx(2 * tokens * (384 + 128 + 32), rel=EXACT)
    assert gathers["fp8"][fwd] == pytest.approx(tokens * (384 + 128 + 2 * 32), rel=EXACT)
    regather = ("bwd_weight", "attn", "overlap")
    assert gathers["fp8"][regather] == pytest.approx(tokens * (384 + 128), rel=EXACT) == gathers["bf16"][regather] / 2
