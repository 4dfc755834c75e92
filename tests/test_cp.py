"""Context parallelism: the ring, all-gather and all-to-all variants against their closed forms."""

from __future__ import annotations

import pytest

import clustersim
from clustersim.errors import ConfigError
from clustersim.model import transformer as tf
from clustersim.output.summary import plan_line
from clustersim.program.lower import lower
from clustersim.program.work import cp_attention_shares

from .conftest import scenario_dict

SEQ = 8192


def _sc(root, model=None, **parallel):
    par = {"tp": 2, "pp": 2, "dp": 2, "cp": 2, **parallel}
    d = scenario_dict(model={"seq_len": SEQ, "layers": 4, **(model or {})}, parallel=par,
                      training={"global_batch_size": 8, "attention": "flash"})
    return clustersim.load_scenario(d, base_dir=root)


def _kv_bytes(sc) -> float:
    """K and V of one rank's s/cp tokens, 16-bit, per TP rank."""
    m, p = sc.model, sc.parallel
    return 2 * sc.training.micro_batch_size * (m.seq_len / p.cp) * 2 * m.n_kv_heads * m.head_dim / p.tp


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_attention_shares_follow_the_causal_mask(cp):
    """Balanced: every step 1/cp. Contiguous: rank i does (2i+1)/cp of the balanced work, and
    all ranks together do exactly the balanced total."""
    for i in range(cp):
        assert cp_attention_shares(cp, i, True) == [1 / cp] * cp
        assert sum(cp_attention_shares(cp, i, False)) == pytest.approx((2 * i + 1) / cp)
    assert sum(sum(cp_attention_shares(cp, i, False)) for i in range(cp)) == pytest.approx(cp)
    # rank 0 only sees its own chunk (the diagonal, at step 0)
    assert cp_attention_shares(cp, 0, False) == [1 / cp] + [0.0] * (cp - 1)


@pytest.mark.parametrize("cp_comm", ["ring", "all_gather", "all_to_all"])
def test_cp_conserves_the_work_of_the_step(root, cp_comm):
    """Splitting sequences over cp ranks instead of batches over dp ranks moves no FLOPs:
    (tp 2, cp 2, dp 2) and (tp 2, cp 1, dp 4) execute the same model FLOPs in total."""
    with_cp = clustersim.simulate(_sc(root, cp_comm=cp_comm)).summary
    without = clustersim.simulate(_sc(root, cp=1, dp=4)).summary
    assert with_cp["model_flops_per_step"] == pytest.approx(without["model_flops_per_step"], rel=1e-9)
    assert with_cp["world_size"] == without["world_size"] == 16


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_bytes_per_layer(root, cp):
    """Ring attention, per layer and microbatch on each rank: forward cp-1 shifts of K/V,
    backward (Transformer Engine's order) K/V alone, cp-2 shifts of K/V plus dK/dV and the
    dK/dV alone: 3 (cp-1) x KV."""
    sc = _sc(root, tp=1, cp=cp, dp=8 // cp)
    prog, low = lower(sc)
    kv = _kv_bytes(sc)
    r = low.sym.ranks[0]
    cp_tasks = [t for t in prog.tasks if t.rank == r and t.kind == "cp"]
    assert {t.comm.op for t in cp_tasks} == {"shift"}
    layers, mbs = sc.layers_per_part[0], sc.microbatches
    assert sum(t.comm.size_bytes for t in cp_tasks) == pytest.approx(layers * mbs * 3 * (cp - 1) * kv)
    assert all(len(t.comm.group) == cp for t in cp_tasks)


def test_all_gather_bytes_per_layer(root):
    """All-gather CP: forward gathers every rank's K/V (cp x KV); backward gathers again and
    reduce-scatters dK/dV."""
    sc = _sc(root, cp_comm="all_gather")
    prog, low = lower(sc)
    kv, cp = _kv_bytes(sc), sc.parallel.cp
    r = low.sym.ranks[0]
    by_op: dict = {}
    for t in prog.tasks:
        if t.rank == r and t.kind == "cp":
            by_op[(t.phase, t.comm.op)] = by_op.get((t.phase, t.comm.op), 0.0) + t.comm.size_bytes
    n = sc.layers_per_part[0] * sc.microbatches
    assert by_op == pytest.approx({("F", "all_gather"): n * cp * kv, ("B", "all_gather"): n * cp * kv,
                                   ("B", "reduce_scatter"): n * cp * kv})


def _a2a_bytes(sc) -> tuple[float, float]:
    """(Q, K, V; context) of one rank's s/cp tokens for the heads one TP rank holds, 16-bit."""
    m, p = sc.model, sc.parallel
    tok = sc.training.micro_batch_size * m.seq_len / p.cp
    return 2 * tok * (m.heads + 2 * m.n_kv_heads) * m.head_dim / p.tp, 2 * tok * m.heads * m.head_dim / p.tp


@pytest.mark.parametrize("model", [{}, {"kv_heads": 4}])
def test_all_to_all_bytes_per_layer(root, model):
    """All-to-all CP (Ulysses): forward trades Q, K, V for heads, then the context back;
    backward trades the output with its gradient, then dQ, dK, dV back."""
    sc = _sc(root, model, cp_comm="all_to_all")
    prog, low = lower(sc)
    qkv, ctx = _a2a_bytes(sc)
    r = low.sym.ranks[0]
    by_op: dict = {}
    for t in prog.tasks:
        if t.rank == r and t.kind == "cp":
            assert len(t.comm.group) == sc.parallel.cp
            by_op[(t.phase, t.comm.op)] = by_op.get((t.phase, t.comm.op), 0.0) + t.comm.size_bytes
    n = sc.layers_per_part[0] * sc.microbatches
    assert by_op == pytest.approx({("F", "all_to_all"): n * (qkv + ctx), ("B", "all_to_all"): n * (2 * ctx + qkv)})


@pytest.mark.parametrize("cp, a2a", [(4, 2), (8, 2), (8, 4)])
def test_all_to_all_and_ring_bytes_per_layer(root, cp, a2a):
    """Hierarchical CP: the all-to-alls of all-to-all CP inside each slice of cp_a2a ranks, and
    the ring's shifts of KV across the cp/cp_a2a slices: forward QKV + C and (r-1) KV, backward
    2C + QKV and 2 (r-1) KV, r = cp/cp_a2a."""
    sc = _sc(root, tp=1, cp=cp, dp=8 // cp, cp_comm="all_to_all+ring", cp_a2a=a2a)
    prog, low = lower(sc)
    qkv, ctx = _a2a_bytes(sc)
    kv, r = _kv_bytes(sc), cp // a2a
    rank = low.sym.ranks[0]
    by: dict = {}
    for t in prog.tasks:
        if t.rank == rank and t.kind == "cp":
            by[(t.phase, t.comm.op, len(t.comm.group))] = by.get((t.phase, t.comm.op, len(t.comm.group)), 0.0) \
                + t.comm.size_bytes
    n = sc.layers_per_part[0] * sc.microbatches
    assert by == pytest.approx({("F", "all_to_all", a2a): n * (qkv + ctx), ("B", "all_to_all", a2a): n * (2 * ctx + qkv),
                                ("F", "shift", r): n * (r - 1) * kv, ("B", "shift", r): n * 2 * (r - 1) * kv})


def test_all_to_all_attention_is_whole_for_heads_over_cp(root):
    """Each rank attends all s tokens for heads/(tp cp) heads: the core attention of TP over
    tp*cp ranks without CP, and the same FLOPs as the ring's cp steps together."""
    a2a, ring = _sc(root, cp_comm="all_to_all"), _sc(root)
    m, b, t, cp = a2a.model, 1, a2a.parallel.tp, a2a.parallel.cp
    whole = next(o for o in tf.attn_block_fwd(m, b, t * cp, True) if o.name == "core_attn")
    # QK^T and PV, 4 s^2 d a head, of which the causal half
    assert whole.flops == pytest.approx(4 * b * m.heads / (t * cp) * SEQ * SEQ * m.head_dim / 2)

    def attention_flops(sc):
        prog, low = lower(sc)
        r = low.sym.ranks[0]
        return sum(t.flops for t in prog.tasks if t.rank == r and t.kind == "compute" and "attn" in t.name)

    assert attention_flops(a2a) == pytest.approx(attention_flops(ring), rel=1e-12)
    both = _sc(root, tp=1, cp=4, dp=2, cp_comm="all_to_all+ring", cp_a2a=2)
    assert attention_flops(both) == pytest.approx(attention_flops(_sc(root, tp=1, cp=4, dp=2)), rel=1e-12)


def test_all_to_all_inside_a_node_takes_its_closed_form(root):
    """CP8 inside one A100 node, no other traffic: every all-to-all sends (cp-1)/cp of its
    buffer through the GPU's NVLink at the topology's rate, after one latency round, and
    blocks; the step's CP time is the sum of those."""
    d = scenario_dict(cluster={"topology": "topologies/dgx-a100.yaml", "nodes": 1},
                      model={"seq_len": SEQ, "layers": 2},
                      parallel={"tp": 1, "pp": 1, "dp": 1, "cp": 8, "cp_comm": "all_to_all"},
                      training={"global_batch_size": 2, "attention": "flash"})
    sc = clustersim.load_scenario(d, base_dir=root)
    res = clustersim.simulate(sc)
    qkv, ctx = _a2a_bytes(sc)
    bw, hop_s = 300e9 * 0.77, 1.5e-6  # dgx-a100.yaml's NVLink
    moved = sc.model.layers * sc.microbatches * (2 * qkv + 3 * ctx) * 7 / 8
    per_a2a_s = 2 * hop_s  # GPU -> NVSwitch -> GPU
    expected = moved / bw + 4 * sc.model.layers * sc.microbatches * per_a2a_s
    assert res.summary["comm_s"]["cp"] == pytest.approx(expected, rel=1e-6)
    assert res.summary["exposed_comm_s"]["cp"] == pytest.approx(expected, rel=1e-6)  # blocking


def test_ring_hides_its_shifts_under_attention(root):
    """At 8K tokens each ring step's attention outlasts the K/V shift on NVLink, and the
    backward's last dK/dV hop runs beside its last step (Transformer Engine's order): almost
    none of the ring's time is exposed (it was a third, the last hop blocking, before)."""
    s = clustersim.simulate(_sc(root, tp=1, cp=4, dp=2, pp=2)).summary
    assert s["comm_s"]["cp"] > 0
    assert s["exposed_comm_s"]["cp"] < 0.05 * s["comm_s"]["cp"]


def test_unbalanced_cp_is_slower_by_the_causal_skew(root):
    """Without load balancing the last CP rank does (2cp-1)/cp of the balanced attention, the
    first 1/cp: their compute differs by exactly 2(cp-1)/cp of a rank's balanced attention."""
    cp = 4
    bal = clustersim.simulate(_sc(root, tp=1, cp=cp, dp=2, cp_load_balance=True), collapse=False)
    unb = clustersim.simulate(_sc(root, tp=1, cp=cp, dp=2, cp_load_balance=False), collapse=False)
    assert unb.summary["step_time_s"] > bal.summary["step_time_s"]
    sc = unb.scenario

    def busy(trace, rank, name_part=""):
        return sum(s.end_s - s.start_s for s in trace.spans
                   if s.rank == rank and s.stream == "compute" and name_part in s.name)

    first, last = sc.mesh.rank(cp=0), sc.mesh.rank(cp=cp - 1)
    attn = busy(bal.trace, first, "attn ring")
    assert attn > 0 and busy(bal.trace, last, "attn ring") == pytest.approx(attn, rel=1e-9)
    assert busy(unb.trace, last, "attn ring") - busy(unb.trace, first, "attn ring") == \
        pytest.approx(2 * (cp - 1) / cp * attn, rel=1e-9)


@pytest.mark.parametrize("parallel", [
    {"cp_comm": "ring"}, {"cp_comm": "all_gather"}, {"cp_comm": "all_to_all"}, {"cp_load_balance": False},
    {"tp": 1, "cp": 4, "cp_comm": "all_to_all+ring", "cp_a2a": 2},
    {"tp": 1, "cp": 4, "cp_comm": "all_to_all+ring", "cp_a2a": 2, "cp_load_balance": False},
    {"tp": 1, "cp": 4, "zero": 3}, {"tp": 1, "cp": 4, "zero": 1, "schedule": "zb-h1"},
])
def test_collapsed_equals_every_rank(root, parallel):
    sc = _sc(root, **parallel)
    a = clustersim.simulate(sc, collapse=True).summary
    b = clustersim.simulate(sc, collapse=False).summary
    assert a["step_time_s"] == pytest.approx(b["step_time_s"], rel=1e-9)
    for k in ("tp", "cp", "pp", "dp"):
        assert a["exposed_comm_s"][k] == pytest.approx(b["exposed_comm_s"][k], rel=1e-9, abs=1e-15)


def test_gradients_and_zero_shards_span_dp_times_cp(root):
    """CP ranks hold the same weights: gradients reduce over dp x cp, and ZeRO shards the
    optimizer state over dp x cp (12 Psi / (dp cp) bytes)."""
    sc = _sc(root, zero=1)
    prog, low = lower(sc)
    groups = {len(t.comm.group) for t in prog.tasks if t.kind == "dp" and "tied" not in t.name}
    assert groups == {sc.parallel.dp * sc.parallel.cp}
    s = clustersim.simulate(sc).summary
    for st in s["memory"]["stages"]:
        psi = low.work[st["stage"]].local_params
        assert st["optimizer_bytes"] == pytest.approx(12 * psi / 4)


def test_activations_split_by_cp(root):
    """Each CP rank keeps the activations of its s/cp tokens: half of cp=1 at cp=2 (flash)."""
    m = _sc(root).model
    for recompute in ("none", "full"):
        one = tf.layer_activation_bytes(m, 1, 2, True, False, recompute)
        two = tf.layer_activation_bytes(m, 1, 2, True, False, recompute, cp=2)
        assert two == pytest.approx(one / 2)


@pytest.mark.parametrize("parallel, training, message", [
    ({"cp": 3}, {}, "parallel: tp\\*cp\\*pp\\*dp = 2\\*3\\*2\\*2 = 24 does not equal the world size 16"),
    ({"cp": 2, "tp": 2}, {"attention": "standard"}, "parallel.cp: cp_comm ring runs blockwise .*flash"),
    ({"cp": 2, "tp": 2, "cp_comm": "all_to_all", "cp_load_balance": False}, {},
     "parallel.cp_load_balance: false changes nothing under cp_comm all_to_all"),
])
def test_bad_cp_plans_say_why(root, parallel, training, message):
    d = scenario_dict(model={"seq_len": SEQ}, parallel={"tp": 2, "pp": 2, "dp": 2, **parallel},
                      training={"global_batch_size": 8, **training})
    with pytest.raises(ConfigError, match=message):
        clustersim.load_scenario(d, base_dir=root)


def test_seq_len_must_split_into_2cp_chunks(root):
    d = scenario_dict(model={"seq_len": 8190}, parallel={"tp": 2, "pp": 2, "dp": 2, "cp": 2},
                      training={"global_batch_size": 8})
    with pytest.raises(ConfigError, match="parallel.cp: model.seq_len=8190 does not split into 2\\*cp = 4 chunks"):
        clustersim.load_scenario(d, base_dir=root)
    d["parallel"]["cp_load_balance"] = False
    clustersim.load_scenario(d, base_dir=root)  # 2 contiguous chunks of 4095 are fine


@pytest.mark.parametrize("model, tp, cp, field, held", [
    ({"heads": 8}, 4, 4, "heads", 2),  # 8/4 = 2 heads a TP rank, over 4 CP ranks
    ({"heads": 16, "kv_heads": 4}, 2, 4, "kv_heads", 2),
])
def test_all_to_all_needs_cp_to_divide_the_heads(root, model, tp, cp, field, held):
    d = scenario_dict(model={"seq_len": SEQ, **model}, parallel={"tp": tp, "pp": 1, "dp": 16 // (tp * cp), "cp": cp,
                                                                  "cp_comm": "all_to_all"},
                      training={"global_batch_size": 8})
    with pytest.raises(ConfigError, match=f"parallel.cp: .*model.{field}=.* = {held} heads each TP rank holds; "
                                          f"cp does not divide them"):
        clustersim.load_scenario(d, base_dir=root)


def test_all_to_all_runs_standard_attention_too(root):
    """Ulysses attends whole sequences, so any attention kernel serves (ring and all-gather CP
    need flash's blockwise one); standard attention executes the whole square."""
    d = scenario_dict(model={"seq_len": SEQ}, parallel={"tp": 2, "pp": 2, "dp": 2, "cp": 2, "cp_comm": "all_to_all"},
                      training={"global_batch_size": 8, "attention": "standard"})
    std = clustersim.simulate(clustersim.load_scenario(d, base_dir=root)).summary
    flash = clustersim.simulate(_sc(root, cp_comm="all_to_all")).summary
    assert std["model_flops_per_step"] == pytest.approx(flash["model_flops_per_step"], rel=1e-12)
    assert std["hardware_flops_per_step"] > flash["hardware_flops_per_step"]


@pytest.mark.parametrize("cp_comm", ["all_gather", "all_to_all"])
def test_latent_attention_runs_ring_cp_only(root, cp_comm):
    """Transformer Engine refuses all-gather and all-to-all CP where keys are wider than values
    (MLA's 96 + 32 against 128 here would pass; DeepSeek's 128 + 64 against 128 not)."""
    mla = {"q_lora_rank": 384, "kv_lora_rank": 128, "qk_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
    d = scenario_dict(model={"seq_len": SEQ, "bias": False, "mla": mla},
                      parallel={"tp": 2, "pp": 2, "dp": 2, "cp": 2, "cp_comm": cp_comm},
                      training={"global_batch_size": 8, "attention": "flash"})
    with pytest.raises(ConfigError, match=f"parallel.cp_comm: {cp_comm} context parallelism does not run latent "
                                          "attention, whose keys \\(192 wide a head\\) are wider than its values "
                                          "\\(128\\)"):
        clustersim.load_scenario(d, base_dir=root)
    d["parallel"]["cp_comm"] = "ring"
    clustersim.load_scenario(d, base_dir=root)
    d["parallel"]["cp_comm"], d["model"]["mla"] = cp_comm, {**mla, "qk_head_dim": 96, "qk_rope_head_dim": 32}
    clustersim.load_scenario(d, base_dir=root)  # keys as wide as values


@pytest.mark.parametrize("parallel, field, message", [
    ({"cp_comm": "all_to_all+ring"}, "parallel.cp_a2a", "cp_a2a must divide cp=4 and be below it"),
    ({"cp_comm": "all_to_all+ring", "cp_a2a": 4}, "parallel.cp_a2a",
     "below it \\(got 4; cp_a2a = cp is cp_comm all_to_all\\)"),
    ({"cp_comm": "all_to_all+ring", "cp_a2a": 3}, "parallel.cp_a2a", "must divide cp=4"),
    ({"cp_comm": "ring", "cp_a2a": 2}, "parallel.cp_a2a", "sets the all-to-all groups of cp_comm all_to_all.ring "
                                                          "\\(cp_comm is ring\\)"),
    ({"cp_comm": "all_to_all+ring", "cp_a2a": 2, "tp": 4, "pp": 1, "dp": 1}, "parallel.cp_a2a",
     "model.kv_heads=4 / tp=4 = 1 heads each TP rank holds; cp_a2a does not divide them"),
])
def test_bad_hierarchical_cp_says_why(root, parallel, field, message):
    d = scenario_dict(model={"seq_len": SEQ, "heads": 8, "kv_heads": 4},
                      parallel={"tp": 1, "pp": 2, "dp": 2, "cp": 4, **parallel},
                      training={"global_batch_size": 8, "attention": "flash"})
    with pytest.raises(ConfigError, match=f"{field}: .*{message}"):
        clustersim.load_scenario(d, base_dir=root)


def test_latent_attention_runs_hierarchical_cp(root):
    """Transformer Engine runs latent attention with a2a+p2p as with p2p."""
    mla = {"q_lora_rank": 384, "kv_lora_rank": 128, "qk_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
    d = scenario_dict(model={"seq_len": SEQ, "bias": False, "mla": mla},
                      parallel={"tp": 1, "pp": 2, "dp": 2, "cp": 4, "cp_comm": "all_to_all+ring", "cp_a2a": 2},
                      training={"global_batch_size": 8, "attention": "flash"})
    s = clustersim.simulate(clustersim.load_scenario(d, base_dir=root)).summary
    assert s["comm_s"]["cp"] > 0 and s["plan"]["cp_a2a"] == 2
    assert "CP4 (all_to_all+ring, 2 x 2)" in plan_line(s)


def test_cp_a2a_at_cp_1_chooses_nothing(root):
    """At cp=1 cp_comm and cp_a2a choose nothing (a sweep over cp leaves them set): the plan
    runs as without them."""
    d = scenario_dict(model={"seq_len": SEQ}, parallel={"tp": 2, "pp": 2, "dp": 4, "cp": 1,
                                                          "cp_comm": "all_to_all+ring", "cp_a2a": 8},
                      training={"global_batch_size": 8, "attention": "flash"})
    with_them = clustersim.simulate(clustersim.load_scenario(d, base_dir=root)).summary
    for k in ("cp_comm", "cp_a2a"):
        del d["parallel"][k]
    assert with_them["step_time_s"] == clustersim.simulate(clustersim.load_scenario(d, base_dir=root)).summary[
        "step_time_s"]
