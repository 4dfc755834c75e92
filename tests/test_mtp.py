"""Multi-token prediction (``model.mtp_layers``): parameters against DeepSeek-V3's checkpoint,
FLOPs and memory against closed forms, where its blocks run, the embedding it shares with
the first stage, and the collapse."""

from __future__ import annotations

import pytest

import clustersim
from clustersim.model import transformer as tf
from clustersim.program.work import stage_work

from .conftest import scenario_dict

EXACT = 1e-12
MODEL = {"name": "mtp", "layers": 4, "hidden": 1024, "heads": 16, "ffn_hidden": 2816, "mlp": "swiglu",
         "norm": "rmsnorm", "bias": False, "dropout": False, "position_embedding": "rope", "tied_embeddings": False,
         "vocab": 32000, "seq_len": 1024, "mtp_layers": 1}


def run(root, collapse=None, model=None, training=None, **parallel):
    d = scenario_dict(model={**MODEL, **(model or {})}, parallel={"tp": 1, "pp": 2, "dp": 8, **parallel},
                      training={"global_batch_size": 32, "attention": "flash", **(training or {})})
    return clustersim.simulate(clustersim.load_scenario(d, base_dir=root), collapse=collapse)


def test_deepseek_v3_with_its_mtp_module_is_its_685b_checkpoint(root):
    """DeepSeek-V3's checkpoint: 685B parameters, 671B of the model and 14B of its MTP module,
    which stores its own copies of the embedding and the output head (the model shares them
    in training; clustersim counts them once): one MoE layer, its 2h x h projection, norms."""
    import yaml

    d = yaml.safe_load((root / "scenarios/deepseek_v3_2048gpu.yaml").read_text())["model"]
    with_mtp = tf.DenseModelCfg(**{**d, "mtp_layers": 1})
    copies = 2 * 129280 * 7168
    assert (tf.total_params(with_mtp) + copies) / 1e9 == pytest.approx(685, rel=1e-3)
    module = tf.total_params(with_mtp) - tf.total_params(tf.DenseModelCfg(**{**d, "mtp_layers": 0}))
    assert (module + copies) / 1e9 == pytest.approx(14, rel=0.05)


@pytest.mark.parametrize("mtp", [1, 2])
def test_model_flops_per_token(root, mtp):
    """Per token forward: each module a layer of its own, its 2h -> h projection (4h^2) and the
    head again (2hV); backward twice the forward."""
    r = run(root, model={"mtp_layers": mtp})
    s, l, h, a, f, V = 1024, 4, 1024, 16, 2816, 32000
    layer = 2 * h * 3 * h + s * h * 2 / 2 * 2 + 2 * h * h + 2 * 3 * h * f  # QKV, QK^T + PV (causal), proj, SwiGLU
    per_token_fwd = (l + mtp) * layer + (1 + mtp) * 2 * h * V + mtp * 4 * h * h
    assert r.summary["model_flops_per_step"] == pytest.approx(3 * 32 * s * per_token_fwd, rel=EXACT)
    assert r.summary["model_flops_per_step"] == pytest.approx(
        tf.model_flops_per_token_closed_form(r.scenario.model) * 32 * s, rel=1e-3)  # (the norms' weights in N)
    assert a == 16


def test_the_modules_run_on_the_last_part_only(root):
    """The last part runs each module's projection and layer after the model's layers and the
    head again after its own; the others are as without MTP."""
    sc = run(root, model={"mtp_layers": 2}).scenario
    plain = run(root, model={"mtp_layers": 0}).scenario
    first, last = (stage_work(sc, j, sc.cluster.gpu) for j in (0, 1))
    assert first == stage_work(plain, 0, plain.cluster.gpu)
    names = [(blk.name, blk.layer) for blk in last.fwd]
    assert [n for n in names if n[0] == "mtp proj"] == [("mtp proj", 4), ("mtp proj", 5)]
    assert [n for n in names if "head" in n[0]] == [("head", -1), ("head mtp", -1), ("head mtp", -1)]
    assert sorted({ly for _, ly in names if ly >= 0}) == [2, 3, 4, 5]
    # the heads share the model's weights: the modules add their layers and projections alone
    base_last = stage_work(plain, 1, plain.cluster.gpu)
    module = tf.layer_params(sc.model) + tf.mtp_proj_params(sc.model)
    copy = sc.model.vocab * sc.model.hidden  # the embedding the modules read (below)
    assert last.local_params - base_last.local_params == pytest.approx(2 * module + copy, rel=EXACT)


@pytest.mark.parametrize("schedule, copies", [("1f1b", True), ("dualpipe", False)])
def test_the_last_stage_reads_the_embedding(root, schedule, copies):
    """The modules embed the next tokens on the last part: where it is not on the first part's
    ranks (1F1B), the last stage keeps a copy of the word embedding and all-reduces its
    gradient with the first stage's, as a tied head does; under DualPipe rank 0 holds both."""
    r = run(root, schedule=schedule)
    emb = [x for x in r.trace.spans if x.op == "all_reduce" and "emb" in x.name]
    assert bool(emb) == copies
    if copies:
        assert {round(x.size_bytes) for x in emb} == {4 * 32000 * 1024}  # fp32 gradients of V x h
        stages = r.summary["memory"]["stages"]
        plain = run(root, schedule=schedule, model={"mtp_layers": 0}).summary["memory"]["stages"]
        module = tf.layer_params(r.scenario.model) + tf.mtp_proj_params(r.scenario.model)
        assert stages[-1]["params"] - plain[-1]["params"] == pytest.approx(module + 32000 * 1024, rel=EXACT)


def test_the_last_stage_keeps_a_module_s_activations(root):
    """A microbatch on the last stage keeps, per module, its layer's activations, what its
    projection keeps (the norms' inputs and the concatenation, 8sbh) and the head's logits."""
    r, plain = run(root), run(root, model={"mtp_layers": 0})
    m, s, h = r.scenario.model, 1024, 1024
    got = r.summary["memory"]["stages"][-1]["activation_bytes_per_microbatch"] \
        - plain.summary["memory"]["stages"][-1]["activation_bytes_per_microbatch"]
    want = tf.layer_activation_bytes(m, 1, 1, True) + 8 * s * h + tf.head_activation_bytes(m, 1, 1)
    assert got == pytest.approx(want, rel=EXACT)


@pytest.mark.parametrize("kw", [
    {"tp": 2, "dp": 4, "sp": True},
    {"schedule": "interleaved", "vpp": 2, "model": {"layers": 8}},
    {"schedule": "zb-h1", "tp": 2, "dp": 4},
    {"schedule": "dualpipe", "model": {"mtp_layers": 2}, "training": {"recompute": "full"}},
    {"tp": 2, "dp": 4, "ep": 2, "sp": True, "etp": 1,
     "model": {"moe": {"experts": 8, "top_k": 2, "expert_ffn": 512, "dispatcher": "deepep"}}},
], ids=["tp2-sp", "interleaved", "zb-h1", "dualpipe-full-recompute", "moe-deepep"])
def test_collapse_equals_every_rank(root, kw):
    rep, full = run(root, **kw), run(root, collapse=False, **kw)
    for key in ("step_time_s", "mfu", "bubble_fraction"):
        assert rep.summary[key] == pytest.approx(full.summary[key], rel=1e-9), key
    assert rep.summary["simulation"]["simulated_ranks"] < full.summary["simulation"]["simulated_ranks"]


@pytest.mark.parametrize("sp", [False, True])
def test_the_projection_s_tp_communication(root, sp):
    """TP2: the next tokens' lookup is reduced over TP (scattered under SP) as the first part's
    embedding is; the 2h input is gathered over the sequence under SP; the column-parallel
    output gathered over TP. Backward: the output's gradient gathered (SP), the 2h input's
    reduced (reduce-scattered under SP, beside the projection's weight gradient), the lookup's
    gradient gathered (SP); a split W gathers the 2h input again under SP."""
    sc = run(root, tp=2, dp=4, sp=sp, schedule="zb-h1").scenario
    act = 2.0 * 1024 * 1024  # a 16-bit [s, h] activation
    work = stage_work(sc, 1, sc.cluster.gpu)
    (lookup,) = [blk for blk in work.fwd if blk.name == "mtp embedding"]
    (fwd,) = [blk for blk in work.fwd if blk.name == "mtp proj"]
    ops = lambda comms: [(c.op, c.size_bytes) for c in comms]  # noqa: E731
    assert ops(lookup.post) == [("reduce_scatter" if sp else "all_reduce", act)]
    assert ops(fwd.pre) == ([("all_gather", 2 * act)] if sp else [])
    assert ops(fwd.post) == [("all_gather", act)]
    bwd = [blk for blk in work.bwd if blk.name.startswith("mtp proj")]
    assert ops(bwd[0].pre) == ([("all_gather", act)] if sp else [])
    reduced = [ops(blk.overlap) for blk in bwd if blk.name == "mtp proj wgrad"]
    assert reduced == [[("reduce_scatter", 2 * act)] if sp else [("all_reduce", 2 * act)]]
    (lookup_b,) = [blk for blk in work.bwd if blk.name == "mtp embedding"]
    assert ops(lookup_b.pre) == ([("all_gather", act)] if sp else [])
    w = [blk for blk in work.bwd_weight if blk.name.startswith("mtp proj")]
    assert [ops(blk.pre + blk.overlap) for blk in w if blk.pre or blk.overlap] == \
        ([[("all_gather", 2 * act)]] if sp else [])


def test_the_weight_gradient_bytes_a_module_holds(root):
    """A split backward's W of a module reads what a layer's does, the head's again, and its
    projection's: the 2h input (/t under SP) and the output's gradient, h/t (column-parallel)."""
    kw = dict(tp=2, dp=4, sp=True, schedule="zb-h1")
    r, plain = run(root, **kw), run(root, model={"mtp_layers": 0}, **kw)
    m, t, s, h = r.scenario.model, 2, 1024, 1024
    got = stage_work(r.scenario, 1, r.scenario.cluster.gpu).wgrad_bytes_per_mb \
        - stage_work(plain.scenario, 1, plain.scenario.cluster.gpu).wgrad_bytes_per_mb
    want = tf.layer_wgrad_bytes(m, 1, t, True) + tf.head_wgrad_bytes(m, 1, t, True) + 2 * 2 * s * h / t + 2 * s * h / t
    assert got == pytest.approx(want, rel=EXACT)


def test_full_recompute_gives_each_module_s_layer_a_group_of_its_own(root):
    """Uniform groups over the model's layers; each MTP layer alone; block recomputes none."""
    uni = run(root, model={"layers": 8}, training={"recompute": "full", "recompute_method": "uniform",
                                                    "recompute_layers": 3}).scenario
    blk = run(root, model={"layers": 8}, training={"recompute": "full", "recompute_method": "block",
                                                    "recompute_layers": 8}).scenario
    assert stage_work(uni, 1, uni.cluster.gpu).recompute_groups == ((4, 5, 6), (7,), (8,))
    assert stage_work(blk, 1, blk.cluster.gpu).recompute_groups == ((4,), (5,), (6,), (7,))


def test_zero3_reduces_the_head_s_gradient_after_the_modules_have_added_to_it(root):
    """ZeRO-3 gathers and reduces the head as one unit with its runs for the modules ("head
    mtp"): its gradient's reduce-scatter starts once the last module's head backward is done."""
    r = run(root, zero=3)
    rank = r.trace.ranks[-1]
    spans = [s for s in r.trace.spans if s.rank == rank]
    head_grads = 4 * 32000 * 1024  # the head's fp32 gradient, V x h (with its norm's, a little more)
    rs = [s for s in spans if s.op == "reduce_scatter" and s.layer < 0 and s.size_bytes >= head_grads]
    assert len(rs) == len({s.mb for s in rs}) == r.scenario.microbatches  # every microbatch, under ZeRO-3
    for x in rs:
        assert x.start_s >= max(s.end_s for s in spans if s.name == "B head mtp" and s.mb == x.mb)


def test_full_recompute_checkpoints_a_module_whole(root):
    """Under full recompute a module is checkpointed whole, as Megatron-Core's
    MultiTokenPredictionLayer does: it keeps its two inputs (the hidden state and the next
    tokens' embedding, 4sbh) where the projection kept 8sbh and its layer its input 2sbh, and
    its backward runs the norms and the projection again before the layer."""
    kw = {"training": {"recompute": "full"}}
    r, plain = run(root, **kw), run(root, model={"mtp_layers": 0}, **kw)
    m, s, h = r.scenario.model, 1024, 1024
    got = r.summary["memory"]["stages"][-1]["activation_bytes_per_microbatch"] \
        - plain.summary["memory"]["stages"][-1]["activation_bytes_per_microbatch"]
    assert got == pytest.approx(tf.mtp_checkpoint_bytes(m, 1, 1) + tf.head_activation_bytes(m, 1, 1), rel=EXACT)
    assert tf.mtp_checkpoint_bytes(m, 1, 1) == 4 * s * h
    sc = r.scenario
    work = stage_work(sc, 1, sc.cluster.gpu)
    names = [(blk.name, blk.layer) for blk in work.bwd]
    at = names.index(("recompute mtp proj", 4))
    assert names[at + 1] == ("recompute attn", 4)
    proj = next(blk for blk in work.fwd if blk.name == "mtp proj")
    assert work.bwd[at].flops == pytest.approx(proj.flops, rel=EXACT)
    # block recomputes no MTP layer: the module keeps what it keeps without recompute
    blk = run(root, training={"recompute": "full", "recompute_method": "block", "recompute_layers": 1}).scenario
    assert not any(b.name == "recompute mtp proj" for b in stage_work(blk, 1, blk.cluster.gpu).bwd)
