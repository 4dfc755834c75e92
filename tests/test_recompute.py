"""Full recompute of some layers only (Megatron-LM's --recompute-method uniform or block with
--recompute-num-layers): which layers recompute, in what order, what each layer keeps and
what the recompute costs, against the closed forms."""

from __future__ import annotations

import functools
import math

import pytest

import clustersim
from clustersim.api import lower_step
from clustersim.model import transformer as tf
from clustersim.output.summary import plan_options
from clustersim.program.costs import ops_time_s
from clustersim.model.moe import SHARED_EXPERT_OPS
from clustersim.program.work import RECOMPUTED_OPS, MoeBlocks, recompute_groups

from .conftest import ROOT, scenario_dict

# 12 layers on 2 pipeline ranks: 6 a stage, 3 a chunk under interleaving
MODEL = {"layers": 12}
PLAN = {"tp": 2, "pp": 2, "dp": 2, "sp": True}


def scenario(training: dict, parallel: dict | None = None):
    d = scenario_dict(cluster={"nodes": 1}, model=MODEL, parallel={**PLAN, **(parallel or {})},
                      training={"global_batch_size": 8, **training})
    return clustersim.load_scenario(d, base_dir=ROOT)


@functools.cache
def without_recompute():
    return lower_step(scenario({"recompute": "none"}))[1]


def full(method: str | None = None, n: int | None = None) -> dict:
    return {"recompute": "full", "recompute_method": method, "recompute_layers": n}


def layer_bytes(sc, mode: str) -> float:
    """What one layer of the dense test model keeps under ``mode`` (all layers alike)."""
    m, tr, p = sc.model, sc.training, sc.parallel
    return tf.layer_activation_bytes(m, tr.micro_batch_size, p.tp, True, p.sp, mode, False, p.cp)


def extra_flops(work) -> float:
    """Executed FLOPs a part's backward adds over the model's."""
    return sum(b.flops - b.model_flops for b in work.bwd)


def recompute_flops(work, j: int) -> float:
    """What part ``j``'s backward adds over the same part's without recompute (which adds
    flash attention's recomputed scores already): its recomputed forwards."""
    return extra_flops(work) - extra_flops(without_recompute().work[j])


def forward_flops(work, layers) -> float:
    return sum(b.flops for b in work.fwd if b.layer in layers)


def test_groups_follow_megatron():
    layers = range(6, 12)
    assert recompute_groups(layers, "full") == [range(ly, ly + 1) for ly in layers]
    assert recompute_groups(layers, "full", "uniform", 1) == recompute_groups(layers, "full")
    assert recompute_groups(layers, "full", "uniform", 4) == [range(6, 10), range(10, 12)]
    assert recompute_groups(layers, "full", "uniform", 9) == [layers]
    assert recompute_groups(layers, "full", "block", 2) == [range(6, 7), range(7, 8)]
    assert recompute_groups(layers, "full", "block", 9) == recompute_groups(layers, "full")
    assert recompute_groups(layers, "none") == recompute_groups(layers, "selective") == []


@pytest.mark.parametrize("same", [full("uniform", 1), full("block", 6), full("block", 12)])
def test_settings_that_recompute_every_layer_alone_are_plain_full(same):
    plain = clustersim.simulate(scenario(full())).summary
    other = clustersim.simulate(scenario(same)).summary
    assert other["step_time_s"] == plain["step_time_s"]
    for key in plain.keys() - {"plan", "simulation"}:
        assert other[key] == plain[key], key


@pytest.mark.parametrize("n", [1, 2, 4])
def test_block_recomputes_the_first_layers_and_keeps_the_rest_whole(n):
    sc = scenario(full("block", n))
    _, low = lower_step(sc)
    keep, full_in = layer_bytes(sc, "none"), layer_bytes(sc, "full")
    for j, work in enumerate(low.work):
        first = 6 * j
        assert work.recomputed_layers == tuple(range(first, first + n))
        head = tf.head_activation_bytes(sc.model, 1, 2, 1) if j == 1 else 0.0
        assert work.activation_bytes_per_mb == pytest.approx(n * full_in + (6 - n) * keep + head, rel=1e-12)
        # a recomputed layer is whole for a moment, but by then the backward has freed the
        # layers after it, which kept more
        assert work.recompute_bytes_per_mb == 0.0
        assert recompute_flops(work, j) == pytest.approx(forward_flops(work, work.recomputed_layers), rel=1e-12)


@pytest.mark.parametrize("n", [2, 4])
def test_uniform_keeps_each_groups_input_and_recomputes_every_layer(n):
    sc = scenario(full("uniform", n))
    _, low = lower_step(sc)
    groups = math.ceil(6 / n)
    for j, work in enumerate(low.work):
        head = tf.head_activation_bytes(sc.model, 1, 2, 1) if j == 1 else 0.0
        assert work.activation_bytes_per_mb == pytest.approx(groups * layer_bytes(sc, "full") + head, rel=1e-12)
        # a whole group's activations while it recomputes, less its input, kept already, and
        # the inputs of the groups after it, freed by then: the last (n = 2: three groups of 2)
        # or the first (n = 4: 4 layers, then 2)
        whole, kept_input = layer_bytes(sc, "none"), layer_bytes(sc, "full")
        most = {2: 2 * whole - kept_input, 4: 4 * whole - 2 * kept_input}[n]
        assert work.recompute_bytes_per_mb == pytest.approx(most, rel=1e-12)
        assert recompute_flops(work, j) == pytest.approx(forward_flops(work, range(6 * j, 6 * j + 6)), rel=1e-12)


def test_a_uniform_group_recomputes_whole_before_its_last_layers_backward():
    _, low = lower_step(scenario(full("uniform", 2)))
    b = low.work[0].bwd_input
    heads = [(blk.name, blk.layer) for blk in b[:6]]
    assert heads == [("recompute attn", 4), ("recompute mlp", 4), ("recompute attn", 5), ("recompute mlp", 5),
                     ("mlp", 5), ("attn", 5)][:len(heads)]
    recomputes = [blk.layer for blk in b if blk.name.startswith("recompute ")]
    assert recomputes == [4, 4, 5, 5, 2, 2, 3, 3, 0, 0, 1, 1]


def test_fewer_recomputed_layers_trade_memory_for_time():
    runs = {n: clustersim.simulate(scenario(full("block", n) if n else {"recompute": "none"})).summary
            for n in (0, 2, 4, 6)}
    steps = [runs[n]["step_time_s"] for n in (0, 2, 4, 6)]
    peaks = [runs[n]["memory"]["peak_bytes"] for n in (0, 2, 4, 6)]
    assert steps == sorted(steps) and len(set(steps)) == 4
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4
    # on every stage, even the last, which holds one microbatch: a recomputed layer is whole
    # again only after the backward has freed the layers after it
    runs[1] = clustersim.simulate(scenario(full("block", 1))).summary
    for n, more in ((0, 1), (1, 2), (2, 4), (4, 6)):
        for a, b in zip(runs[n]["memory"]["stages"], runs[more]["memory"]["stages"]):
            assert b["peak_bytes"] < a["peak_bytes"]


def test_block_counts_each_model_chunk():
    sc = scenario(full("block", 1), parallel={"schedule": "interleaved", "vpp": 2})
    summary = clustersim.simulate(sc).summary
    parts = [p for st in summary["memory"]["stages"] for p in st["parts"]]
    assert {p["part"]: p["recomputed_layers"] for p in parts} == {0: [0], 1: [3], 2: [6], 3: [9]}
    assert summary["plan"]["recompute_method"] == "block" and summary["plan"]["recompute_layers"] == 1


def test_the_plan_line_says_which_layers():
    assert plan_options({"recompute": "full", "recompute_method": "block", "recompute_layers": 2}) == (
        " · recompute full (first 2 layers of each model chunk)")
    assert plan_options({"recompute": "full", "recompute_method": "uniform", "recompute_layers": 3}) == (
        " · recompute full (groups of 3 layers)")
    assert plan_options({"recompute": "full", "recompute_method": "uniform", "recompute_layers": 1}) == (
        " · recompute full")
    assert plan_options({"recompute": "selective", "recompute_modules": ["layernorm", "moe"], "attention": "flash"}) == (
        " · recompute selective (layernorm, moe)")
    assert plan_options({"recompute": "selective", "recompute_modules": ["core_attn", "layernorm"],
                         "attention": "flash"}) == (
        " · recompute selective (core_attn, layernorm; core_attn a no-op under flash attention)")
    # one part a stage (1F1B): a stage; one layer: the first
    assert plan_options({"recompute": "full", "recompute_method": "block", "recompute_layers": 1,
                         "layers_per_stage": [3, 3], "parts_per_stage": [[0], [1]]}) == (
        " · recompute full (first layer of each stage)")
    # a count past every model chunk's layers says what it comes to
    assert plan_options({"recompute": "full", "recompute_method": "block", "recompute_layers": 6,
                         "layers_per_stage": [2, 2, 2]}) == " · recompute full (every layer: no model chunk has more than 2)"
    assert plan_options({"recompute": "full", "recompute_method": "uniform", "recompute_layers": 3,
                         "layers_per_stage": [2, 3]}) == " · recompute full (each model chunk one group of at most 3)"
    assert plan_options({"recompute": "full", "recompute_method": "uniform", "recompute_layers": 2,
                         "layers_per_stage": [2, 3]}) == " · recompute full (groups of 2 layers)"


def test_zero3_reduces_each_layer_once_after_its_last_backward_block():
    """A uniform group's forwards come before its layers' backwards: ZeRO-3 reduce-scatters a
    layer's gradients after its own backward, once, not after its recomputed forward."""
    prog, _ = lower_step(scenario(full("uniform", 2), parallel={"zero": 3}))
    tasks = prog.tasks
    rank = tasks[0].rank
    for mb in range(2):
        mine = [t for t in tasks if t.rank == rank and t.mb == mb and t.phase == "B"]
        reduced = [t for t in mine if t.name == "RS grads" and t.layer >= 0]
        assert sorted(t.layer for t in reduced) == list(range(6))
        for rs in reduced:
            (dep,) = rs.deps
            computes = [t for t in mine if t.kind == "compute" and t.layer == rs.layer]
            assert dep == computes[-1].tid and not computes[-1].name.startswith("recompute ")


def test_zero3_holds_a_uniform_groups_layers_gathered():
    """ZeRO-3 gathers a uniform group's layers for its forwards and holds them through their
    backwards: 4 units in flight where plain full recompute has 2 (one prefetched)."""
    plain = clustersim.simulate(scenario(full(), parallel={"zero": 3})).summary["memory"]["stages"][0]
    sc = scenario(full("uniform", 4), parallel={"zero": 3})
    group = clustersim.simulate(sc).summary["memory"]["stages"][0]
    _, low = lower_step(sc)
    biggest = max(sum(n for _, n in shards) for (j, _), shards in low.unit_shards.items() if j == 0)
    assert group["transient_bytes"] - plain["transient_bytes"] == pytest.approx((4 - 2) * biggest * 2, rel=1e-9)


# --- selective recompute by module (Megatron-LM's --recompute-modules) ---

MOE = {"moe": {"experts": 8, "top_k": 2, "expert_ffn": 512, "shared_experts": 1, "dense_layers_first": 1},
       "mlp": "swiglu", "bias": False}


def selective(*modules, **more) -> dict:
    return {"recompute": "selective", "recompute_modules": list(modules), **more}


def moe_scenario(training: dict, sp: bool = False):
    d = scenario_dict(cluster={"nodes": 1}, model={**MODEL, **MOE},
                      parallel={"tp": 2 if sp else 1, "pp": 2, "dp": 2 if sp else 4, "ep": 2, "sp": sp},
                      training={"global_batch_size": 8, **training})
    return clustersim.load_scenario(d, base_dir=ROOT)


@pytest.mark.parametrize("sp", [False, True])
def test_each_module_drops_its_terms(sp):
    """What each module leaves unstored, term by term (s b h: tokens x width, t = 2)."""
    sc = moe_scenario({"recompute": "none"}, sp)
    m, t = sc.model, sc.parallel.tp
    e = m.moe
    s, b, h = m.seq_len, 1, m.hidden
    rep = 1 / t if sp else 1.0
    routed = 2 * s * b * e.top_k * e.padded * e.expert_ffn / t
    drops = {  # module -> (bytes a dense layer drops, bytes a MoE layer drops)
        "layernorm": (4 * s * b * h * rep,) * 2,
        "mlp": (2 * s * b * m.ffn * 3 / t, 0.0),
        "moe": (0.0, routed * e.mats + 2 * s * b * e.expert_ffn * e.mats / t + 2 * s * b * e.top_k * h),
        "moe_act": (0.0, routed),
        "shared_experts": (0.0, 2 * s * b * e.expert_ffn * e.mats / t),
        "core_attn": (0.0, 0.0),  # flash attention keeps no scores
    }
    for module, (dense, moe) in drops.items():
        for moe_layer, drop in ((False, dense), (True, moe)):
            none = tf.layer_activation_bytes(m, b, t, True, sp, "none", moe_layer)
            kept = tf.layer_activation_bytes(m, b, t, True, sp, "selective", moe_layer, modules=(module,))
            assert none - kept == pytest.approx(drop, rel=1e-12), (module, moe_layer)
    # without flash attention core_attn drops the scores, as selective recompute always did
    standard = tf.layer_activation_bytes(m, b, t, False, sp, "selective", False)
    assert standard == tf.layer_activation_bytes(m, b, t, False, sp, "selective", False, modules=("core_attn",))
    assert tf.layer_activation_bytes(m, b, t, False, sp, "none") - standard == tf.attention_scores_bytes(m, b, t)


def test_a_layer_holds_its_attention_or_its_mlp_recomputed_not_both():
    """The attention's dropped terms are recomputed and freed in its backward, the MLP's in its
    own: one layer holds the larger of the two at once."""
    m = moe_scenario({"recompute": "none"}).model
    s, b, h, t = m.seq_len, 1, m.hidden, 2
    norm_out = 2 * s * b * h
    mlp = 2 * s * b * m.ffn * 3 / t
    scores = tf.attention_scores_bytes(m, b, t)
    assert tf.recomputed_bytes(m, b, t, True, False, False, 1, ("layernorm",)) == norm_out
    assert tf.recomputed_bytes(m, b, t, True, True, False, 1, ("layernorm",)) == norm_out / t
    assert tf.recomputed_bytes(m, b, t, True, False, False, 1, ("layernorm", "mlp")) == pytest.approx(norm_out + mlp)
    assert tf.recomputed_bytes(m, b, t, False, False, False, 1, ("layernorm", "core_attn")) == pytest.approx(
        max(norm_out + scores, norm_out))
    assert tf.recomputed_bytes(m, b, t, True, False, False, 1, ("core_attn",)) == 0.0


def test_core_attn_is_the_default_module():
    sc = scenario({"recompute": "selective", "attention": "standard"})
    plain = clustersim.simulate(sc).summary
    named = clustersim.simulate(scenario(selective("core_attn", attention="standard"))).summary
    for key in plain.keys() - {"simulation"}:
        assert named[key] == plain[key], key


def _forward_ops(sc, layer: int) -> tuple[list, list]:
    """(attention ops, MLP or MoE ops) of one layer's forward, as the lowering builds them."""
    m, t = sc.model, sc.parallel.tp
    attn = tf.attn_block_fwd(m, 1, t, True, sc.parallel.sp)
    if m.is_moe_layer(layer):
        moe = MoeBlocks.build(sc, (), (), (), ())
        return attn, [o for spec in moe.fwd_specs for o in spec.ops]
    return attn, tf.mlp_block_fwd(m, 1, t, sc.parallel.sp)


@pytest.mark.parametrize("modules", [("layernorm",), ("mlp",), ("moe",), ("moe_act", "shared_experts"),
                                     ("layernorm", "moe", "mlp")])
def test_a_module_runs_its_forward_again_and_keeps_less(modules):
    """Each module's forward runs again in the backward: the backward's time and executed FLOPs
    grow by the forward ops it recomputes (a whole MLP or MoE layer but its norm and residual;
    the named ops otherwise), the model FLOPs do not; the activations kept shrink by the terms
    dropped, and the last layer's dropped terms, the first recomputed, are transient."""
    sc = moe_scenario(selective(*modules))
    _, low = lower_step(sc)
    _, plain_low = lower_step(moe_scenario({"recompute": "none"}))
    m, gpu = sc.model, sc.cluster.gpu
    named = {n for mod in modules for n in RECOMPUTED_OPS.get(mod, ())} - {"core_attn"}
    for j, (work, plain) in enumerate(zip(low.work, plain_low.work)):
        layers = range(6 * j, 6 * j + 6)
        again = []
        for ly in layers:
            attn, mlp = _forward_ops(sc, ly)
            whole = ("moe" if m.is_moe_layer(ly) else "mlp") in modules
            shared = SHARED_EXPERT_OPS if "shared_experts" in modules and m.is_moe_layer(ly) and not whole else ()
            again += [o for o in attn + mlp if o.name in named or o.name in shared]
            again += [o for o in mlp if whole and not o.name.startswith(("norm", "residual"))
                      and o.name not in named]
        assert extra_flops(work) - extra_flops(plain) == pytest.approx(sum(o.flops for o in again), rel=1e-9)
        took = sum(b.duration_s for b in work.bwd) - sum(b.duration_s for b in plain.bwd)
        assert took == pytest.approx(ops_time_s(again, gpu, "bf16"), rel=1e-9)
        assert (took > 0) == bool(again)  # (mlp: part 1 holds MoE layers only)
        assert sum(b.model_flops for b in work.bwd) == pytest.approx(sum(b.model_flops for b in plain.bwd), rel=1e-12)
        dropped = [tf.layer_activation_bytes(m, 1, 1, True, False, "none", m.is_moe_layer(ly))
                   - tf.layer_activation_bytes(m, 1, 1, True, False, "selective", m.is_moe_layer(ly), modules=modules)
                   for ly in layers]
        assert plain.activation_bytes_per_mb - work.activation_bytes_per_mb == pytest.approx(sum(dropped), rel=1e-9)
        last = layers[-1]  # the first recomputed; nothing freed before it
        assert work.recompute_bytes_per_mb == pytest.approx(
            tf.recomputed_bytes(m, 1, 1, True, False, m.is_moe_layer(last), 1, modules), rel=1e-9)


def test_moe_recompute_runs_the_all_to_alls_again():
    """Recomputing the MoE layer dispatches and combines its tokens again: four all-to-alls in
    each MoE layer's backward where there were two."""
    def a2a_in_backward(sc):
        prog, _ = lower_step(sc)
        tasks = [t for t in prog.tasks if t.mb == 0 and t.phase == "B" and t.kind == "ep"]
        rank = tasks[0].rank
        return {ly: sum(1 for t in tasks if t.rank == rank and t.layer == ly and "A2A" in t.name)
                for ly in {t.layer for t in tasks if t.rank == rank and t.layer >= 0}}
    plain = a2a_in_backward(moe_scenario({"recompute": "none"}))
    again = a2a_in_backward(moe_scenario(selective("moe")))
    sc = moe_scenario({"recompute": "none"})
    for ly, n in plain.items():
        assert again[ly] == (2 * n if sc.model.is_moe_layer(ly) else n)
    assert any(sc.model.is_moe_layer(ly) and n == 2 for ly, n in plain.items())


def _b_blocks(sc, part: int, layer: int) -> list:
    _, low = lower_step(sc)
    return [blk for blk in low.work[part].bwd_input if blk.layer == layer]


def test_a_norm_runs_again_before_the_module_that_reads_it():
    """layernorm's norm2 is recomputed first: at the head of the MLP's (MoE layer's) backward,
    and before a recomputed module, in its first block; norm1 at the head of the attention's."""
    sc = moe_scenario(selective("layernorm", "moe"))
    gpu = sc.cluster.gpu
    layer = 7  # a MoE layer of part 1
    both, moe = _b_blocks(sc, 1, layer), _b_blocks(moe_scenario(selective("moe")), 1, layer)
    assert [b.name for b in both] == [b.name for b in moe]
    assert [b.name for b in both[:2]] == ["recompute router", "recompute experts"]
    norm2 = next(o for o in _forward_ops(sc, layer)[1] if o.name == "norm2")
    norm1 = next(o for o in _forward_ops(sc, layer)[0] if o.name == "norm1")
    extra = [x.duration_s - y.duration_s for x, y in zip(both, moe)]
    first_attn = next(i for i, b in enumerate(both) if b.name.startswith("attn"))
    assert extra[0] == pytest.approx(ops_time_s([norm2], gpu, "bf16"), rel=1e-9)
    assert extra[first_attn] == pytest.approx(ops_time_s([norm1], gpu, "bf16"), rel=1e-9)
    assert sum(extra) == pytest.approx(extra[0] + extra[first_attn], rel=1e-9)


@pytest.mark.parametrize("sp", [False, True])
def test_shared_experts_run_again_with_their_communication(sp):
    """Recomputing the shared experts (a checkpoint of their MLP) runs their TP communication
    again under SP: the gather of their input and the reduce-scatter of their output."""
    blocks = _b_blocks(moe_scenario(selective("shared_experts"), sp), 1, 7)
    assert blocks[0].name == "recompute shared experts"
    assert [c.op for c in blocks[0].pre] == (["all_gather"] if sp else [])
    assert [c.op for c in blocks[0].post] == (["reduce_scatter"] if sp else [])


@pytest.mark.parametrize("schedule, training", [
    ("1f1b", full()), ("zb-h1", full()), ("interleaved", full()), ("zbv", full("uniform", 2)),
    ("dualpipe", selective("layernorm", "mlp"))])
def test_a_recompute_is_held_while_its_backward_runs(schedule, training):
    """What a B holds recomputing is on the memory timeline from the (part, microbatch)'s
    first B block to its last, nowhere else (so a split backward's W, holding its inputs, adds
    none), on every part of a rank."""
    from clustersim.analysis.memory import part_classifier, stage_timeline
    from clustersim.api import _statics

    sc = scenario(training, parallel={"schedule": schedule, "vpp": 2 if schedule == "interleaved" else 1})
    r = clustersim.simulate(sc)
    _, low = lower_step(sc)
    for st in _statics(low):
        rank = next(k for k in r.trace.ranks if r.trace.stage_of.get(k, 0) == st.stage)
        spans = [s for s in r.trace.spans if s.rank == rank]
        tl = stage_timeline(spans, st.parts, st.split_w)
        part_of = part_classifier(st.parts) or (lambda s: 0)
        b = {}
        for s in spans:
            if s.kind == "compute" and s.phase == "B" and s.mb >= 0:
                key = (part_of(s), s.mb)
                lo, hi = b.get(key, (s.start_s, s.end_s))
                b[key] = (min(lo, s.start_s), max(hi, s.end_s))
        for t, held in zip(tl.t_s, tl.recomputing):
            want = sum(st.parts[p].recompute_bytes_per_mb for (p, _), (lo, hi) in b.items() if lo <= t < hi)
            assert held == pytest.approx(want, rel=1e-12, abs=1e-6), t
        assert max(tl.recomputing) > 0
