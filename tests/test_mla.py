"""Multi-head latent attention (``model.mla``): parameters against DeepSeek-V3's published
count, FLOPs and activation memory against closed forms written here from the shapes, the
latents TP gathers and CP passes round, MLA's up-projection recompute, the collapse, bad plans."""

from __future__ import annotations

import pytest

import clustersim
from clustersim.model import transformer as tf

from .conftest import ROOT as ROOT_DIR
from .conftest import scenario_dict

EXACT = 1e-12
V3_MLA = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
# a small MLA model: hidden 1024, 16 heads, latents 384 / 128, heads 64 + 32 wide for Q/K, 64 for V
SMALL_MLA = {"q_lora_rank": 384, "kv_lora_rank": 128, "qk_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64}
MODEL = {"name": "mla", "layers": 4, "hidden": 1024, "heads": 16, "ffn_hidden": 2816, "mlp": "swiglu",
         "norm": "rmsnorm", "bias": False, "dropout": False, "position_embedding": "rope", "tied_embeddings": False,
         "vocab": 32000, "seq_len": 1024, "mla": SMALL_MLA}


def run(root, collapse=None, model=None, training=None, **parallel):
    d = scenario_dict(model={**MODEL, **(model or {})}, parallel={"tp": 1, "pp": 2, "dp": 8, **parallel},
                      training={"global_batch_size": 16, "attention": "flash", **(training or {})})
    return clustersim.simulate(clustersim.load_scenario(d, base_dir=root), collapse=collapse)


def test_deepseek_v3_has_671b_parameters_37b_active(root):
    """DeepSeek-V3's report (arXiv:2412.19437, Sec 1 and 4.2): 671B parameters, 37B activated
    per token (the MTP module's 14B aside). Its attention, by the shapes: q 7168 x 1536 + 1536 x
    128 x 192, kv 7168 x 576 + 512 x 128 x 256, out 128 x 128 x 7168, and the latents' norms."""
    import yaml

    d = yaml.safe_load((root / "scenarios/deepseek_v3_2048gpu.yaml").read_text())["model"]
    m = tf.DenseModelCfg(**{**d, "mla": V3_MLA, "mtp_layers": 0})  # (the report's count leaves its MTP module out)
    attn = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168 + 1536 + 512
    assert tf.mla_attention_params(m)[0] == attn == 187_107_328
    assert tf.total_params(m) / 1e9 == pytest.approx(671, rel=0.001)
    assert tf.active_params(m) / 1e9 == pytest.approx(37, rel=0.02)


def test_model_flops_per_token(root):
    """Per token per layer forward: q down 2h q_r and up 2 q_r a(d+r), kv down 2h(kv_r + r) and
    up 2 kv_r a(d + v), QK^T over d + r and PV over v, causal half: 2 s a (d + r + v) / 2,
    out 2 a v h, SwiGLU 2 x 3hf; the head 2hV once; backward twice the forward."""
    r = run(root)
    q_r, kv_r, d, rope, v = 384, 128, 64, 32, 64
    s, l, h, a, f, V = 1024, 4, 1024, 16, 2816, 32000
    attn = 2 * h * q_r + 2 * q_r * a * (d + rope) + 2 * h * (kv_r + rope) + 2 * kv_r * a * (d + v) \
        + s * a * (d + rope + v) + 2 * a * v * h
    per_token_fwd = l * (attn + 2 * 3 * h * f) + 2 * h * V
    want = 3 * 16 * s * per_token_fwd
    assert r.summary["model_flops_per_step"] == pytest.approx(want, rel=EXACT)
    # the 6N + attention form, N with the norms' weights (1e-4 of it here)
    assert want == pytest.approx(tf.model_flops_per_token_closed_form(r.scenario.model) * 16 * s, rel=2e-4)


def test_model_flops_are_the_same_split_over_tp_with_or_without_sp(root):
    """The down projections are whole on every TP rank: without SP each runs them on every
    token and holds 1/t of their model FLOPs; with SP each runs its own tokens."""
    base = run(root, dp=8).summary["model_flops_per_step"]
    for kw in ({"tp": 2, "dp": 4}, {"tp": 2, "dp": 4, "sp": True}):
        assert run(root, **kw).summary["model_flops_per_step"] == pytest.approx(base, rel=EXACT)


@pytest.mark.parametrize("t, sp", [(1, False), (2, False), (2, True)])
def test_activation_terms(t, sp):
    """What a layer keeps, term by term, in bytes (16-bit): the norm's output (the down
    projections' input), the latents before their norms and after (the up projections'
    inputs; the rotary key part keeps nothing), Q and K over d + r and V over v per head, the
    context over v; sharded over t, the latents and norm output /t only under SP."""
    m = tf.DenseModelCfg(**MODEL)
    s, b, h, a = 1024, 1, 1024, 16
    rep = 1 / t if sp else 1
    terms = tf.layer_activation_terms(m, b, t, True, sp)
    assert terms["qkv_input"] == 2 * s * b * h * rep
    assert terms["mla_latents"] == terms["mla_normed"] == pytest.approx(2 * s * b * (384 + 128) * rep, rel=EXACT)
    assert terms["qkv"] == pytest.approx(2 * s * b * a * (2 * (64 + 32) + 64) / t, rel=EXACT)
    assert terms["context"] == pytest.approx(2 * s * b * a * 64 / t, rel=EXACT)


def test_up_projection_recompute_drops_q_k_v_and_runs_the_up_projections_again(root):
    """``recompute_modules: [mla_up_proj]`` (Megatron-LM's, with Transformer Engine's norms
    fused into the up projections): what a layer keeps loses its Q, K and V and the normed
    latents; each layer's backward runs both latent norms and up projections again (executed,
    not model, FLOPs)."""
    base, rc = run(root), run(root, training={"recompute": "selective", "recompute_modules": ["mla_up_proj"]})
    m, s = rc.scenario.model, 1024
    terms = tf.layer_activation_terms(m, 1, 1, True)
    qkv = terms["qkv"] + terms["mla_normed"]
    per_layer = tf.layer_activation_bytes(m, 1, 1, True) - tf.layer_activation_bytes(
        m, 1, 1, True, recompute="selective", modules=("mla_up_proj",))
    assert per_layer == pytest.approx(qkv, rel=EXACT)
    # a microbatch of a stage (2 layers; the head's or embedding's terms alike in both runs)
    for st, st_rc in zip(base.summary["memory"]["stages"], rc.summary["memory"]["stages"]):
        dropped = st["activation_bytes_per_microbatch"] - st_rc["activation_bytes_per_microbatch"]
        assert dropped == pytest.approx(2 * qkv, rel=1e-9)
    ups = 2 * 384 * 16 * 96 + 2 * 128 * 16 * 128  # q_up, kv_up forward FLOPs a token
    extra = rc.summary["hardware_flops_per_step"] - base.summary["hardware_flops_per_step"]
    assert extra == pytest.approx(4 * 16 * s * ups, rel=EXACT)
    assert rc.summary["model_flops_per_step"] == pytest.approx(base.summary["model_flops_per_step"], rel=EXACT)


def test_flash_backward_runs_the_wider_qk_again():
    """Flash attention's backward executes dQ, dK and QK^T again over the query/key width and
    dP, dV over the value width: (3 (d + r) + 2 v) / (d + r + v) of the forward, 2.6 for
    DeepSeek-V3's 192 and 128 (2.5 where the widths agree); the model counts 2x."""
    import yaml

    d = yaml.safe_load((ROOT_DIR / "scenarios/deepseek_v3_2048gpu.yaml").read_text())["model"]
    m = tf.DenseModelCfg(**d)
    (core,) = [o for o in tf.attn_block_fwd(m, 1, 1, True) if o.name == "core_attn"]
    (back,) = [o for o in tf.block_bwd([core], True)]
    assert back.flops / core.flops == pytest.approx((3 * 192 + 2 * 128) / (192 + 128), rel=EXACT) == 2.6
    assert back.model_flops == 2 * core.model_flops


def test_split_backward_gathers_the_latents_again_for_both_up_projections(root):
    """Zero bubble under SP: a layer's W gathers the up projections' inputs again (the latents,
    without the rotary part) and only then computes both up projections' weight gradients;
    the out and down projections' run beside the gather."""
    from clustersim.program.work import stage_work

    sc = run(root, tp=2, dp=4, sp=True, schedule="zb-h1").scenario
    work = stage_work(sc, 0, sc.cluster.gpu)
    w = [blk for blk in work.bwd_weight if blk.layer == 0 and blk.name.startswith("attn")]
    beside, after = w
    assert [c.size_bytes for c in beside.overlap] == [2 * 1024 * (384 + 128)]
    m = sc.model
    ups = (2 * 1024 * 384 * 8 * 96 + 2 * 1024 * 128 * 8 * 128)  # q_up, kv_up forward FLOPs on a rank (8 heads)
    assert after.flops == pytest.approx(ups, rel=EXACT)  # their weight gradients: one forward's worth
    assert m.mla.qk_rope_head_dim == 32


def test_up_projection_recompute_gathers_the_latents_under_sp(root):
    """Under SP the up projections' recompute needs the whole sequence of latents: the
    attention's backward gathers them first (2 s (q_r + kv_r) bytes), beside its output
    gradient's gather."""
    rc = run(root, tp=2, dp=4, sp=True, training={"recompute": "selective", "recompute_modules": ["mla_up_proj"]})
    base = run(root, tp=2, dp=4, sp=True)

    def gathers(r):
        return sorted(round(x.size_bytes) for x in r.trace.spans
                      if x.kind == "tp" and x.op == "all_gather" and x.phase == "B" and x.rank == 0 and x.mb == 0)

    extra = list(gathers(rc))
    for x in gathers(base):
        extra.remove(x)
    assert extra == [2 * 1024 * (384 + 128)] * 2  # one per layer of the stage


def test_sequence_parallel_gathers_the_latents_not_the_hidden_state(root):
    """Under SP the up projections gather what the down projections made on each rank's own
    tokens: (q_r + kv_r + r) per token, against h for the MLP; the out projection's
    reduce-scatter is the hidden state's."""
    r = run(root, tp=2, dp=4, sp=True)
    s = 1024
    gathers = {round(x.size_bytes) for x in r.trace.spans if x.kind == "tp" and x.op == "all_gather" and x.phase == "F"}
    assert gathers == {2 * s * (384 + 128 + 32), 2 * s * 1024}
    scatters = {round(x.size_bytes) for x in r.trace.spans if x.kind == "tp" and x.op == "reduce_scatter"}
    assert 2 * s * 1024 in scatters and 2 * s * (384 + 128 + 32) in scatters  # B reduces the latents' gradient


def test_context_parallelism_passes_keys_and_values_of_every_head(root):
    """Ring attention passes each rank's K (d + r per head) and V (v per head), all heads."""
    r = run(root, cp=2, dp=4)
    shifts = {round(x.size_bytes) for x in r.trace.spans if x.kind == "cp" and x.op == "shift" and x.phase == "F"}
    assert shifts == {2 * 1024 / 2 * 16 * (64 + 32 + 64)}


@pytest.mark.parametrize("kw", [
    {"tp": 2, "dp": 4, "sp": True},
    {"tp": 2, "dp": 4},
    {"cp": 2, "dp": 4, "schedule": "zb-h1"},
    {"tp": 2, "dp": 4, "sp": True, "training": {"recompute": "selective", "recompute_modules": ["mla_up_proj"]}},
], ids=["tp2-sp", "tp2", "cp2-zb", "tp2-sp-up-proj-recompute"])
def test_collapse_equals_every_rank(root, kw):
    rep, full = run(root, **kw), run(root, collapse=False, **kw)
    for key in ("step_time_s", "mfu", "bubble_fraction"):
        assert rep.summary[key] == pytest.approx(full.summary[key], rel=1e-9), key
    assert rep.summary["simulation"]["simulated_ranks"] < full.summary["simulation"]["simulated_ranks"]


@pytest.mark.parametrize("model, training, parallel, field, words", [
    ({"kv_heads": 4}, {}, {}, "model", "latent attention (model.mla) gives every head its own keys"),
    ({"bias": True}, {}, {}, "model.bias", "latent attention (model.mla) is modelled without biases"),
    ({"mla": None}, {"recompute": "selective", "recompute_modules": ["mla_up_proj"]}, {},
     "training.recompute_modules", "mla_up_proj recomputes latent attention's up projections"),
    ({}, {}, {"tp": 2, "dp": 4, "sp": True, "tp_comm_overlap": True}, "parallel.tp_comm_overlap",
     "latent attention's projections (model.mla) is not modelled"),
])
def test_impossible_mla_plans(root, model, training, parallel, field, words):
    d = scenario_dict(model={**MODEL, **model}, parallel={"tp": 1, "pp": 2, "dp": 8, **parallel},
                      training={"global_batch_size": 16, **training})
    with pytest.raises(clustersim.ConfigError, match=field.replace(".", r"\.")) as exc:
        clustersim.load_scenario(d, base_dir=root)
    assert words in str(exc.value)


def test_a_latent_as_wide_as_the_hidden_state_leaves_the_mlp_s_gather_alone(root):
    """Latents q 512 + kv 448 + rope 64 = the hidden state's 1,024: the attention's reduction is
    then as large as the MLP's, and the MLP's W still gathers the hidden state again (2sh), the
    attention's its latents without the rotary part (2s (q_r + kv_r))."""
    from clustersim.program.work import stage_work

    mla = {"q_lora_rank": 512, "kv_lora_rank": 448, "qk_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64}
    sc = run(root, model={"mla": mla}, tp=2, dp=4, sp=True, schedule="zb-h1").scenario
    w = stage_work(sc, 0, sc.cluster.gpu).bwd_weight
    gathers = {blk.name: [c.size_bytes for c in blk.pre + blk.overlap] for blk in w if blk.layer == 0}
    assert gathers["mlp"] == [2 * 1024 * 1024]
    assert gathers["attn"] == [2 * 1024 * (512 + 448)]
