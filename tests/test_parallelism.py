"""Tensor and sequence parallelism, activation recompute and ZeRO against their closed forms."""

from __future__ import annotations

import pytest

import clustersim
from clustersim.collectives.ring import RING_STEPS
from clustersim.model import transformer as tf
from clustersim.output.summary import plan_line
from clustersim.program.costs import ops_time_s

from .conftest import scenario_dict

GiB = 1024**3


def run(root, **sections):
    return clustersim.simulate(clustersim.load_scenario(scenario_dict(**sections), base_dir=root))


def dp_wire_bytes(trace, dp: int) -> float:
    """Bytes one GPU sends over DP in a step: a ring moves steps/n of each buffer."""
    out = 0.0
    for s in trace.spans:
        if s.kind == "dp" and s.op in RING_STEPS:
            out += RING_STEPS[s.op](dp) / dp * s.size_bytes
    return out


# ---------------------------------------------------------------- ZeRO
ONE_STAGE = dict(cluster={"topology": "topologies/dgx-a100.yaml", "nodes": 1},
                 parallel={"tp": 1, "pp": 1, "dp": 8}, training={"global_batch_size": 8, "grad_dtype": "bf16"})


@pytest.mark.parametrize("zero,per_param", [
    (0, lambda n: 16), (1, lambda n: 4 + 12 / n), (2, lambda n: 2 + 14 / n), (3, lambda n: 16 / n)])
def test_zero_memory_matches_the_paper(root, zero, per_param):
    # Rajbhandari et al. 2020, Fig. 1: 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N with fp16 gradients
    d = dict(ONE_STAGE)
    d["parallel"] = {**ONE_STAGE["parallel"], "zero": zero}
    st = run(root, **d).summary["memory"]["stages"][0]
    psi = st["params"]
    static = st["params_bytes"] + st["grads_bytes"] + st["optimizer_bytes"]
    assert static == pytest.approx(per_param(8) * psi, rel=1e-12)


@pytest.mark.parametrize("zero,per_param", [
    (1, lambda n: 4 + 12 / n), (2, lambda n: 2 + 14 / n), (3, lambda n: 16 / n)])
def test_hybrid_sharding_memory_is_zero_over_the_shard_group(root, zero, per_param):
    # HSDP (parallel.zero_shard): the same formulas with N the shard group, 4 of the 8 ranks
    d = dict(ONE_STAGE)
    d["parallel"] = {**ONE_STAGE["parallel"], "zero": zero, "zero_shard": 4}
    st = run(root, **d).summary["memory"]["stages"][0]
    static = st["params_bytes"] + st["grads_bytes"] + st["optimizer_bytes"]
    assert static == pytest.approx(per_param(4) * st["params"], rel=1e-12)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_hybrid_sharding_reduces_in_the_shard_group_then_all_reduces_the_shard(root, zero):
    """HSDP: gathers and reduce-scatters inside each shard group of 4 consecutive DP ranks;
    once a step, after the last microbatch's reduce-scatter, each shard (a quarter of the
    gradients) all-reduced over its 2 replicas; the optimizer updates a quarter."""
    d = dict(ONE_STAGE)
    d["training"] = {**ONE_STAGE["training"], "global_batch_size": 16}  # 2 microbatches
    d["parallel"] = {**ONE_STAGE["parallel"], "zero": zero, "zero_shard": 4}
    r = run(root, **d)
    dp = [s for s in r.trace.spans if s.kind == "dp"]
    reduced = [s for s in dp if s.op == "reduce_scatter"]
    shards = [s for s in dp if s.op == "all_reduce"]
    assert reduced and shards and {s.op for s in dp} <= {"reduce_scatter", "all_reduce", "all_gather"}
    last = max(s.mb for s in reduced)
    assert {s.mb for s in shards} == {last}  # once a step
    final = [s for s in reduced if s.mb == last]
    assert sum(s.size_bytes for s in shards) == pytest.approx(sum(s.size_bytes for s in final) / 4, rel=1e-12)
    assert all(s.name.endswith("(replicas)") for s in shards)
    # each shard's all-reduce follows its reduce-scatter; the optimizer waits for every one
    opt = min(s.start_s for s in r.trace.spans if s.name == "optimizer step")
    assert max(s.end_s for s in shards) <= opt + 1e-12
    assert min(s.start_s for s in shards) >= min(s.end_s for s in final) - 1e-12
    sc = r.scenario
    assert sc.mesh.group(0, "zs") == (0, 1, 2, 3) and sc.mesh.group(0, "zr") == (0, 4)
    from clustersim.output.summary import plan_options
    assert f" · ZeRO-{zero} (hybrid: shards over 4, 2 replicas)" in plan_options(r.summary["plan"])


def test_hybrid_sharding_shards_experts_as_the_dense_weights(root):
    """With ep=1 a MoE layer's routed experts shard over the same groups as the dense
    weights: ZeRO-1 memory 4Ψ + 12Ψ/4 over every parameter, expert gradients reduce-scattered
    over the shard group and all-reduced over its replicas."""
    from .test_combinations import MOE

    d = dict(ONE_STAGE)
    d["parallel"] = {**ONE_STAGE["parallel"], "zero": 1, "zero_shard": 4}
    r = run(root, model={**MOE, "layers": 2}, **{k: v for k, v in d.items()})
    st = r.summary["memory"]["stages"][0]
    assert st["params_bytes"] + st["grads_bytes"] + st["optimizer_bytes"] == pytest.approx(
        (4 + 12 / 4) * st["params"], rel=1e-12)
    experts = [s for s in r.trace.spans if s.kind == "dp" and "expert" in s.name]
    assert {s.op for s in experts} == {"reduce_scatter", "all_reduce", "all_gather"}


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_hybrid_sharding_with_ep_shards_the_experts_over_their_own_groups(root, zero):
    """Hybrid sharding with EP (Megatron-LM's distributed-optimizer instances): the dense
    weights shard over 8 consecutive DP ranks with 2 replicas; the routed experts, held by an
    expert-DP group of dp / ep = 4 ranks, shard over its halves (ezs, 2 ranks) and all-reduce
    each shard over the same 2 replicas (ezr). ZeRO's formulas with N = 8 for the dense
    parameters and N_e = 2 for the experts; each replica all-reduce moves its shard."""
    from .test_combinations import MOE

    r = run(root, cluster={"topology": "topologies/dgx-a100.yaml", "nodes": 2}, model={**MOE, "layers": 2},
            parallel={"tp": 1, "pp": 1, "dp": 16, "ep": 4, "zero": zero, "zero_shard": 8},
            training={"global_batch_size": 32, "grad_dtype": "bf16"})
    mesh = r.scenario.mesh
    assert mesh.group(0, "edp") == (0, 4, 8, 12) and mesh.group(0, "ezs") == (0, 4) and mesh.group(0, "ezr") == (0, 8)
    from clustersim.output.summary import plan_options
    assert f" · ZeRO-{zero} (hybrid: shards over 8, experts over 2, 2 replicas)" in plan_options(r.summary["plan"])
    assert mesh.group(5, "zs") == tuple(range(8)) and mesh.group(5, "ezs") == (1, 5) and mesh.group(5, "ezr") == (5, 13)
    for rank in range(16):  # group() and groups() agree
        assert mesh.group(rank, "ezs") in mesh.groups("ezs") and mesh.group(rank, "ezr") in mesh.groups("ezr")
    from clustersim.program.lower import lowering

    low = lowering(r.scenario, collapse=True)
    psi_e = low.work[0].local_expert_params
    st = r.summary["memory"]["stages"][0]
    psi_d = st["params"] - psi_e
    assert psi_e > 0 and psi_d > 0
    sharded = psi_d / 8 + psi_e / 2
    assert st["optimizer_bytes"] == pytest.approx(12 * sharded, rel=1e-12)
    assert st["grads_bytes"] == pytest.approx(2 * (sharded if zero >= 2 else psi_d + psi_e), rel=1e-12)
    assert st["params_bytes"] == pytest.approx(2 * (sharded if zero == 3 else psi_d + psi_e), rel=1e-12)
    rank0 = [s for s in r.trace.spans if s.rank == r.trace.ranks[0] and s.kind == "dp"]
    for label, shards in (("expert ", 2), ("", 8)):
        reduced = [s for s in rank0 if s.op == "reduce_scatter" and s.name.startswith(f"RS {label}grads")]
        replicas = [s for s in rank0 if s.op == "all_reduce" and s.name.startswith(f"AR {label}grads shard")]
        last = max(s.mb for s in reduced)
        assert replicas and {s.mb for s in replicas} == {last}
        assert sum(s.size_bytes for s in replicas) == pytest.approx(
            sum(s.size_bytes for s in reduced if s.mb == last) / shards, rel=1e-12)
    # 4 replicas would leave the experts' DP group of 4 one rank a shard: refused, by name
    with pytest.raises(clustersim.ConfigError, match="parallel.zero_shard") as err:
        run(root, cluster={"topology": "topologies/dgx-a100.yaml", "nodes": 2}, model={**MOE, "layers": 2},
            parallel={"tp": 1, "pp": 1, "dp": 16, "ep": 4, "zero": zero, "zero_shard": 4})
    assert "experts' DP group (dp=16 / ep=4 = 4 ranks) must split into 4 shard groups of 2 or more" in err.value.message


@pytest.mark.parametrize("zero", [2, 3])
def test_hybrid_sharding_under_dualpipe_reduces_the_holders_copies_after_the_replicas(root, zero):
    """DualPipe's two holders of a part all-reduce its gradients after the DP reduction: under
    hybrid sharding after the replicas' all-reduce of the same shard, not beside it."""
    r = run(root, cluster={"topology": "topologies/dgx-a100.yaml", "nodes": 1}, model={"layers": 4},
            parallel={"tp": 1, "pp": 2, "dp": 4, "zero": zero, "zero_shard": 2, "schedule": "dualpipe"},
            training={"global_batch_size": 16})
    for rank in r.trace.ranks:
        spans = sorted((s for s in r.trace.spans if s.rank == rank and s.kind == "dp"), key=lambda s: s.start_s)
        holders = [s for s in spans if s.name.startswith("AR part")]
        assert holders
        for h in holders:  # each after the replicas' all-reduce of the shards before it
            shards = [s for s in spans if "shard" in s.name and s.start_s < h.start_s]
            assert shards and h.start_s >= max(s.end_s for s in shards) - 1e-12


def test_hybrid_shard_groups_are_consecutive_ranks_whichever_of_cp_and_dp_is_inner(root):
    """A shard group of 8 is the 8 GPUs of a node with CP inside DP or outside it."""
    from clustersim.plan.mesh import Mesh

    for order in (("tp", "cp", "dp", "pp"), ("tp", "dp", "cp", "pp")):
        mesh = Mesh(tp=1, dp=8, pp=1, cp=2, order=order, zero_shard=8)
        assert mesh.groups("zs") == [tuple(range(8)), tuple(range(8, 16))], order
        assert mesh.groups("zr") == [(i, i + 8) for i in range(8)], order


def test_a_shard_group_of_every_rank_is_plain_zero(root):
    """zero_shard = cp*dp: one group, no replicas: the plain ZeRO step, and the plan line
    says plain ZeRO."""
    from clustersim.output.summary import plan_options

    d = dict(ONE_STAGE)
    d["parallel"] = {**ONE_STAGE["parallel"], "zero": 3}
    plain = run(root, **d)
    d["parallel"] = {**d["parallel"], "zero_shard": 8}
    whole = run(root, **d)
    assert whole.summary["step_time_s"] == plain.summary["step_time_s"]
    assert whole.summary["memory"] == plain.summary["memory"]
    assert plan_options(whole.summary["plan"]) == plan_options(plain.summary["plan"])
    assert not any(s.op == "all_reduce" for s in whole.trace.spans if s.kind == "dp")


def test_hybrid_sharding_needs_zero_and_a_divisor(root):
    for parallel, words in (({"zero": 0, "zero_shard": 4}, "zero=0 shards nothing"),
                            ({"zero": 3, "zero_shard": 3}, "must be at least 2 and divide dp=8"),
                            ({"zero": 3, "zero_shard": 1}, "greater than or equal to 2")):
        d = dict(ONE_STAGE)
        d["parallel"] = {**ONE_STAGE["parallel"], **parallel}
        with pytest.raises(clustersim.ConfigError, match="parallel.zero_shard") as err:
            clustersim.load_scenario(scenario_dict(**d), base_dir=root)
        assert words in err.value.message


def test_zero3_moves_one_and_a_half_times_the_bytes_of_dp(root):
    # no PP, one microbatch: DP all-reduces 2Ψ; ZeRO-3 gathers Ψ twice and reduce-scatters Ψ,
    # but for the unit the forward ends with, still gathered when the backward starts
    d = dict(ONE_STAGE)
    base = run(root, **d)
    d["parallel"] = {**ONE_STAGE["parallel"], "zero": 3}
    z3 = run(root, **d)
    gathers = sorted((s for s in z3.trace.spans if s.op == "all_gather"), key=lambda s: s.start_s)
    fwd = [s.size_bytes for s in gathers if s.phase == "F"]
    bwd = [s.size_bytes for s in gathers if s.phase == "B"]
    assert sorted(bwd + fwd[-1:]) == sorted(fwd) and len(bwd) == len(fwd) - 1
    assert dp_wire_bytes(z3.trace, 8) == pytest.approx(1.5 * dp_wire_bytes(base.trace, 8) - 7 / 8 * fwd[-1],
                                                        rel=1e-9)


def test_zero3_keeps_the_last_unit_gathered_at_the_forward_to_backward_turn(root):
    # FSDP2 leaves the root's parameters (embedding, head) unsharded after forward, DeepSpeed
    # keeps what is reused at once: the head's backward starts as its forward ends. After the
    # backward they are sharded again: the next microbatch's forward gathers its first unit
    d = dict(ONE_STAGE)
    d["parallel"] = {**ONE_STAGE["parallel"], "zero": 3}
    d["training"] = {**ONE_STAGE["training"], "global_batch_size": 16}  # 2 microbatches
    spans = run(root, **d).trace.spans
    for mb in (0, 1):
        f_head = next(s for s in spans if s.name.startswith("F head") and s.mb == mb)
        b_head = next(s for s in spans if s.name.startswith("B head") and s.mb == mb)
        assert b_head.start_s == f_head.end_s
        assert not [s for s in spans if s.op == "all_gather" and s.phase == "B" and s.mb == mb
                    and s.layer == f_head.layer and s.size_bytes < 1e6]  # the head's (norm) gather
    first_f1 = min((s for s in spans if s.op == "all_gather" and s.mb == 1), key=lambda s: s.start_s)
    last_b0 = max((s for s in spans if s.stream == "compute" and s.mb == 0), key=lambda s: s.end_s)
    assert first_f1.phase == "F" and first_f1.start_s >= last_b0.end_s and first_f1.end_s > first_f1.start_s
    # the held unit counts among those in flight: without prefetch the next unit's gather
    # starts when the head's backward ends, not beside it
    d["parallel"] = {**d["parallel"], "zero_prefetch_layers": 0}
    spans = run(root, **d).trace.spans
    b_head = next(s for s in spans if s.name.startswith("B head") and s.mb == 0)
    first_b_ag = min((s for s in spans if s.op == "all_gather" and s.phase == "B" and s.mb == 0),
                     key=lambda s: s.start_s)
    assert first_b_ag.start_s >= b_head.end_s > b_head.start_s


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_grad_reduce_dtype_sets_the_wire_size_and_grad_dtype_the_memory(root, zero):
    # DeepSpeed and FSDP reduce 16-bit gradients into fp32 shards: the reductions move what
    # bf16 gradients move, the memory holds fp32 ones
    d = dict(ONE_STAGE)
    d["parallel"] = {**ONE_STAGE["parallel"], "zero": zero}
    got = {}
    for grad, wire in (("bf16", None), ("fp32", None), ("fp32", "bf16")):
        d["training"] = {**ONE_STAGE["training"], "grad_dtype": grad, "grad_reduce_dtype": wire}
        r = run(root, **d)
        grads = [s.size_bytes for s in r.trace.spans if s.kind == "dp" and s.op in ("all_reduce", "reduce_scatter")]
        got[grad, wire] = (sum(grads), r.summary["memory"]["stages"][0]["grads_bytes"])
    assert got["bf16", None][0] > 0
    assert got["fp32", None][0] == pytest.approx(2 * got["bf16", None][0], rel=1e-12)
    assert got["fp32", "bf16"][0] == pytest.approx(got["bf16", None][0], rel=1e-12)
    assert got["fp32", "bf16"][1] == got["fp32", None][1] == pytest.approx(2 * got["bf16", None][1], rel=1e-12)


@pytest.mark.parametrize("parallel", [{"pp": 1}, {"pp": 2, "dp": 4, "schedule": "interleaved", "vpp": 2},
                                      {"pp": 2, "dp": 4, "zero": 2}])
def test_overlap_param_gather_gathers_in_the_first_forward(root, parallel):
    # Megatron's --overlap-param-gather: the parameters the optimizer step updated are gathered
    # unit by unit in the next step's first forward, each unit's compute waiting for its own
    # gather, instead of all at once after the step: the same bytes, less of them exposed
    d = dict(ONE_STAGE)
    d["training"] = {**ONE_STAGE["training"], "global_batch_size": 32}
    # layers whose compute outlasts a layer's gather (on a 1,024-wide model the gathers'
    # latencies, one per unit, cost more than the one gather after the step saves)
    d["model"] = {"name": "wide", "layers": 4, "hidden": 4096, "heads": 32, "vocab": 32000, "seq_len": 2048}
    got = {}
    for overlap in (False, True):
        d["parallel"] = {**ONE_STAGE["parallel"], "zero": 1, **parallel, "overlap_param_gather": overlap}
        r = run(root, **d)
        spans = r.trace.spans
        ags = [s for s in spans if s.op == "all_gather" and s.kind == "dp"]
        got[overlap] = r.summary, ags, spans
    (s0, ag0, _), (s1, ag1, spans) = got[False], got[True]
    from clustersim.output.summary import plan_options
    assert s1["plan"]["overlap_param_gather"] and not s0["plan"]["overlap_param_gather"]
    assert "(gathers overlapped)" in plan_options(s1["plan"]) and "(" not in plan_options(s0["plan"])
    for rank in {s.rank for s in spans}:
        before = sum(s.size_bytes for s in ag0 if s.rank == rank)
        assert before > 0 and sum(s.size_bytes for s in ag1 if s.rank == rank) == pytest.approx(before, rel=1e-12)
    assert {s.phase for s in ag0} == {"opt"} and {s.phase for s in ag1} == {"F"} and len(ag1) > len(ag0)
    opt_end = max(s.end_s for s in spans if s.phase == "opt")
    assert opt_end == pytest.approx(s1["step_time_s"], rel=1e-12)
    for a in (a for a in ag1 if a.layer >= 0):  # in the part's first forward, before its unit's compute
        first_mb = min(s.mb for s in spans if s.rank == a.rank and s.stage == a.stage and s.phase == "F"
                       and s.layer == a.layer and s.stream == "compute")
        assert a.mb == first_mb
        unit = [s for s in spans if s.rank == a.rank and s.mb == a.mb and s.phase == "F" and s.stream == "compute"
                and s.layer == a.layer and s.stage == a.stage]
        assert unit and min(s.start_s for s in unit) >= a.end_s
    first = min(spans, key=lambda s: (s.rank, s.start_s) if s.stream == "compute" else (s.rank, 1e9))
    assert first.phase == "F" and first.start_s >= min(a.end_s for a in ag1 if a.rank == first.rank)
    assert s1["exposed_comm_s"]["dp"] < s0["exposed_comm_s"]["dp"]
    assert s1["step_time_s"] < s0["step_time_s"]


@pytest.mark.parametrize("zero", [0, 3])
def test_overlap_param_gather_needs_zero_1_or_2(root, zero):
    d = dict(ONE_STAGE)
    d["parallel"] = {**ONE_STAGE["parallel"], "zero": zero, "overlap_param_gather": True}
    with pytest.raises(clustersim.ConfigError) as err:
        run(root, **d)
    assert err.value.field == "parallel.overlap_param_gather"


@pytest.mark.parametrize("zero,pp", [(0, 1), (1, 1), (2, 1), (0, 2), (2, 2)])
def test_gradients_reduced_after_the_backward_without_overlap(root, zero, pp):
    """overlap_grad_reduce: false: every bucket's reduction starts once the rank's last backward
    (under ZeRO-2, its microbatch's) has ended; beside it, some bucket starts earlier. Without
    it ZeRO 0/1 reduce the whole gradient as one bucket (Megatron-LM's bucket size None),
    ZeRO-2 keeps its buckets; the same bytes either way, before the optimizer step."""
    d = dict(ONE_STAGE)
    d["training"] = {**ONE_STAGE["training"], "global_batch_size": 32 // pp, "dp_bucket_params": 2_000_000}
    spans = {}
    for overlap in (True, False):
        d["parallel"] = {**ONE_STAGE["parallel"], "zero": zero, "pp": pp, "dp": 8 // pp, "overlap_grad_reduce": overlap}
        result = run(root, **d)
        tr = result.trace
        early = 0
        for r in tr.ranks:
            grads = [s for s in tr.spans if s.rank == r and s.kind == "dp" and "grads bucket" in s.name]
            assert len({s.mb for s in grads}) == (4 if zero == 2 else 1)
            assert len(grads) > len({s.mb for s in grads}) if overlap or zero == 2 else len(grads) == 1
            for g in grads:
                backward_end = max(s.end_s for s in tr.spans if s.rank == r and s.stream == "compute"
                                   and s.phase == "B" and (s.mb == g.mb if zero == 2 else True))
                early += g.start_s < backward_end - 1e-12
            opt = min(s.start_s for s in tr.spans if s.rank == r and s.phase == "opt")
            assert opt >= max(g.end_s for g in grads) - 1e-12
        assert (early > 0) == overlap
        assert ("grads reduced after the backward" in plan_line(result.summary)) != overlap
        spans[overlap] = result
    on, off = spans[True].summary, spans[False].summary
    assert off["step_time_s"] > on["step_time_s"] and off["exposed_comm_s"]["dp"] > on["exposed_comm_s"]["dp"]
    assert off["plan"]["overlap_grad_reduce"] is False and on["plan"]["overlap_grad_reduce"] is True
    moved = {k: sum(s.size_bytes for s in v.trace.spans if s.kind == "dp") for k, v in spans.items()}
    assert moved[True] == pytest.approx(moved[False], rel=1e-12)
    if pp == 1 and zero == 2:  # the same buckets, alone on their links either way: the same durations
        dur = {k: sorted(s.end_s - s.start_s for s in v.trace.spans if s.kind == "dp") for k, v in spans.items()}
        assert dur[True] == pytest.approx(dur[False], rel=1e-9)


@pytest.mark.parametrize("zero, more, says", [(3, {}, "ZeRO-3"),
                                             (1, {"overlap_param_gather": True}, "overlap_param_gather: true")])
def test_gradients_reduced_after_the_backward_refused_where_they_cannot_be(root, zero, more, says):
    d = dict(ONE_STAGE)
    d["parallel"] = {**ONE_STAGE["parallel"], "zero": zero, "overlap_grad_reduce": False, **more}
    with pytest.raises(clustersim.ConfigError) as err:
        run(root, **d)
    assert err.value.field == "parallel.overlap_grad_reduce" and says in err.value.message


def test_zero1_reduce_scatter_then_all_gather_moves_what_all_reduce_does(root):
    d = dict(ONE_STAGE)
    base = run(root, **d)
    d["parallel"] = {**ONE_STAGE["parallel"], "zero": 1}
    z1 = run(root, **d)
    # grads reduce-scattered (2 bytes) + params gathered (2 bytes) = one all-reduce of 2-byte grads
    assert dp_wire_bytes(z1.trace, 8) == pytest.approx(dp_wire_bytes(base.trace, 8), rel=1e-9)
    ops = {s.op for s in z1.trace.spans if s.kind == "dp"}
    assert ops == {"reduce_scatter", "all_gather"}


def test_zero2_reduces_every_microbatch_and_zero1_once(root):
    d = dict(ONE_STAGE)
    d["training"] = {**ONE_STAGE["training"], "global_batch_size": 32}  # 4 microbatches
    counts = {}
    for zero in (1, 2):
        d["parallel"] = {**ONE_STAGE["parallel"], "zero": zero}
        tr = run(root, **d).trace
        counts[zero] = {s.mb for s in tr.spans if s.op == "reduce_scatter"}
    assert counts[1] == {3} and counts[2] == {0, 1, 2, 3}


@pytest.mark.parametrize("zero,pp", [(2, 1), (3, 1), (2, 2), (3, 2)])
def test_the_action_after_a_backward_waits_for_its_reduce_scatters(root, zero, pp):
    # DeepSpeed's ZeRO-2/3 and FSDP wait for the gradient reductions at the end of every
    # backward: the rank's next compute starts after its microbatch's last reduce-scatter
    d = dict(ONE_STAGE)
    d["parallel"] = {**ONE_STAGE["parallel"], "zero": zero, "pp": pp, "dp": 8 // pp}
    d["training"] = {**ONE_STAGE["training"], "global_batch_size": 32 // pp}  # 4 microbatches
    tr = run(root, **d).trace
    waited = 0
    for r in tr.ranks:
        compute = sorted((s for s in tr.spans if s.rank == r and s.stream == "compute"), key=lambda s: s.start_s)
        for mb in range(3):
            rs_end = max(s.end_s for s in tr.spans if s.rank == r and s.op == "reduce_scatter" and s.mb == mb)
            last_b = max(i for i, s in enumerate(compute) if s.mb == mb and s.phase == "B")
            nxt = compute[last_b + 1]
            assert nxt.start_s >= rs_end - 1e-12, (r, mb, nxt.name)
            waited += nxt.start_s > compute[last_b].end_s + 1e-9  # the reductions outlast the backward
    assert waited  # (else the test shows nothing)


def test_zero2_holds_two_buckets_whole_gradients_at_once_or_every_one_without_overlap(root):
    # one bucket reduce-scatters while the next fills: the largest adjacent pair counts, whole
    d = dict(ONE_STAGE)
    d["training"] = {**ONE_STAGE["training"], "dp_bucket_params": 20e6}
    transient = {}
    for zero in (1, 2):
        d["parallel"] = {**ONE_STAGE["parallel"], "zero": zero}
        res = run(root, **d)
        transient[zero] = res.summary["memory"]["stages"][0]["transient_bytes"]
        if zero == 2:
            sizes = [s.size_bytes for s in sorted((s for s in res.trace.spans if s.op == "reduce_scatter"
                                                   and s.rank == 0), key=lambda s: s.start_s)]
    assert len(sizes) >= 3
    assert transient[2] - transient[1] == pytest.approx(max(a + b for a, b in zip(sizes, sizes[1:])), rel=1e-12)
    # without overlap every bucket waits for the microbatch's last backward: when the first
    # reduce-scatter starts, the stage's whole gradient is held, every bucket's
    d["parallel"] = {**ONE_STAGE["parallel"], "zero": 2, "overlap_grad_reduce": False}
    res = run(root, **d)
    rs = sorted((s for s in res.trace.spans if s.op == "reduce_scatter" and s.rank == 0), key=lambda s: s.start_s)
    last_b = max(s.end_s for s in res.trace.spans if s.rank == 0 and s.kind == "compute" and s.mb == rs[0].mb
                 and s.phase == "B")
    assert rs[0].start_s >= last_b  # (what makes it so)
    first_mb = [s.size_bytes for s in rs if s.mb == rs[0].mb]
    assert len(first_mb) == len(sizes)
    whole = res.summary["memory"]["stages"][0]["transient_bytes"] - transient[1]
    assert whole == pytest.approx(sum(first_mb), rel=1e-12)
    assert whole > max(a + b for a, b in zip(sizes, sizes[1:]))


def test_zero3_with_pp_regathers_per_microbatch_unless_kept(root):
    d = scenario_dict(cluster={"nodes": 2}, parallel={"tp": 2, "pp": 2, "dp": 4, "zero": 3},
                      training={"global_batch_size": 16})
    sc = clustersim.load_scenario(d, base_dir=root)
    tr = clustersim.simulate(sc).trace
    gathers = [s for s in tr.spans if s.name.endswith("AG params") and s.stage == 0]
    m, layers = sc.microbatches, sc.layers_per_stage[0]
    assert len(gathers) == m * 2 * (layers + 1)  # each layer + the embedding, forward and backward
    d["parallel"]["zero3_keep_gathered"] = True
    kept = clustersim.simulate(clustersim.load_scenario(d, base_dir=root))
    gathers = [s for s in kept.trace.spans if s.name.endswith("AG params") and s.stage == 0]
    assert len(gathers) == layers + 1
    assert kept.summary["step_time_s"] < clustersim.simulate(sc).summary["step_time_s"]


def test_zero3_prefetch_overlaps_gathers_with_compute(root):
    """Prefetching k units ahead (Rajbhandari et al. 2020, Sec 5.3): the gathers of an action's
    first k + 1 units start when the action does, each later one when the unit k before it
    begins; going deeper hides more and never delays the step."""
    d = dict(ONE_STAGE)
    hidden, step = {}, {}
    for depth in (0, 1, 2, 3):
        d["parallel"] = {**ONE_STAGE["parallel"], "zero": 3, "zero_prefetch_layers": depth}
        r = run(root, **d)
        hidden[depth], step[depth] = r.summary["hidden_comm_s"]["dp"], r.summary["step_time_s"]
        spans = [s for s in r.trace.spans if s.rank == 0 and s.mb == 0 and s.phase == "F"]
        gathers = [s for s in spans if s.name.endswith("AG params")]
        unit_end: dict = {}  # unit (a layer, the embedding, the head) -> its last compute's end, in order
        for c in (s for s in spans if s.kind == "compute"):
            unit_end[c.layer if c.layer >= 0 else c.name] = c.end_s
        ends = list(unit_end.values())
        assert len(gathers) == len(ends)
        for u, g in enumerate(gathers):
            # after unit u - depth - 1 (none: the action's start), once the zero stream is free
            lead = ends[u - depth - 1] if u - depth >= 1 else 0.0
            assert g.start_s == pytest.approx(max(lead, gathers[u - 1].end_s if u else 0.0), abs=1e-12), (depth, u)
    assert hidden[1] > hidden[0]
    assert step[0] > step[1] >= step[2] >= step[3]


# ---------------------------------------------------------------- TP
def test_tensor_parallel_two_all_reduces_per_layer_each_way(root):
    """Megatron TP (Shoeybi et al. 2019, Fig. 3): per layer and microbatch, one all-reduce of
    the [b, s, h] activation after attention and one after the MLP, forward, and the same
    two backward, each 2bsh bytes; plus one after the vocab-parallel embedding (stage 0)."""
    r = run(root, parallel={"tp": 4, "pp": 2, "dp": 2})
    sc = r.scenario
    m, b = sc.model, sc.training.micro_batch_size
    stage0 = [s for s in r.trace.spans if s.kind == "tp" and s.stage == 0]
    assert {s.op for s in stage0} == {"all_reduce"}
    assert all(s.size_bytes == 2 * b * m.seq_len * m.hidden for s in stage0)
    layers = sc.layers_per_stage[0]
    for phase, extra in (("F", 1), ("B", 0)):  # the embedding's all-reduce is forward only
        per_mb = [s for s in stage0 if s.phase == phase and s.mb == 0]
        assert len(per_mb) == 2 * layers + extra, phase


def test_tensor_parallel_backward_all_reduce_runs_beside_the_weight_gradient(root):
    """Megatron's column-parallel linear starts its input gradient's all-reduce and computes
    its weight gradient meanwhile: each backward all-reduce starts when the block's dgrad ends,
    with the QKV (MLP up, LM head) wgrad, and the norm's backward starts when both are done.
    One node, TP 8: the all-reduces are NVLink's alone, nothing else delays them."""
    r = run(root, cluster={"nodes": 1}, parallel={"tp": 8, "pp": 1, "dp": 1}, training={"global_batch_size": 2})
    spans = [s for s in r.trace.spans if s.rank == 0 and s.phase == "B"]
    comp = {(s.mb, s.layer, s.name): s for s in spans if s.kind == "compute"}
    ars = [s for s in spans if s.kind == "tp"]
    sc = r.scenario
    assert len(ars) == (2 * sc.model.layers + 1) * sc.microbatches and {s.op for s in ars} == {"all_reduce"}
    for ar in ars:
        block = ar.name.removeprefix("B AR ").removesuffix(" dgrad")  # named for the gradient it reduces
        wgrad, norm = comp[(ar.mb, ar.layer, f"B {block} wgrad")], comp[(ar.mb, ar.layer, f"B {block} norm")]
        assert ar.start_s == wgrad.start_s == comp[(ar.mb, ar.layer, f"B {block}")].end_s
        assert norm.start_s == max(wgrad.end_s, ar.end_s)
    # at this size the all-reduces outlast the wgrads: the overlap hides the wgrads' time
    assert any(ar.end_s > comp[(ar.mb, ar.layer, ar.name.replace(" AR ", " ").replace(" dgrad", " wgrad"))].end_s
               for ar in ars)


# ---------------------------------------------------------------- SP
def test_sequence_parallel_same_tp_bytes_less_memory_and_compute(root):
    """Korthikanti et al. 2022, Sec 4.2.2: SP turns each TP all-reduce into an all-gather and a
    reduce-scatter, the same bytes, and gathers the input of each column-parallel GEMM again
    in backward for its weight gradient (it keeps that input sequence-sharded): two more
    all-gathers a layer and one for the LM head, each 2bsh bytes."""
    base = run(root, parallel={"tp": 4, "pp": 2, "dp": 2})
    sp = run(root, parallel={"tp": 4, "pp": 2, "dp": 2, "sp": True})
    tp_bytes = lambda spans: sum(RING_STEPS[s.op](4) / 4 * s.size_bytes for s in spans if s.kind == "tp")  # noqa: E731
    # the re-gathers overlap the dgrad pieces; the reductions beside the wgrads are named for the dgrad too
    regather = [s for s in sp.trace.spans if s.kind == "tp" and s.name.startswith("B AG ") and s.name.endswith(" dgrad")]
    sc = sp.scenario
    assert {s.op for s in regather} == {"all_gather"} and {s.phase for s in regather} == {"B"}
    assert {s.size_bytes for s in regather} == {2 * sc.training.micro_batch_size * sc.model.seq_len * sc.model.hidden}
    per_rank = len(regather) / len({s.rank for s in regather}) / sc.microbatches
    assert per_rank == 2 * sc.model.layers / 2 + 0.5  # two a layer on both stages, the head's on the last
    rest = [s for s in sp.trace.spans if not (s.name.startswith("B AG ") and s.name.endswith(" dgrad"))]
    assert tp_bytes(rest) == pytest.approx(tp_bytes(base.trace.spans), rel=1e-12)
    assert {s.op for s in sp.trace.spans if s.kind == "tp"} == {"reduce_scatter", "all_gather"}
    assert sp.summary["compute_s"] < base.summary["compute_s"]
    a_sp = sp.summary["memory"]["stages"][0]["activation_bytes_per_microbatch"]
    a = base.summary["memory"]["stages"][0]["activation_bytes_per_microbatch"]
    assert a_sp < a


def test_sequence_parallel_needs_tp(root):
    with pytest.raises(clustersim.ConfigError, match="parallel.sp"):
        clustersim.load_scenario(scenario_dict(parallel={"tp": 1, "pp": 2, "dp": 8, "sp": True}), base_dir=root)


@pytest.mark.parametrize("sp,recompute,published_GiB", [
    (False, "none", 59.25),  # Korthikanti et al. 2022 Table 3/5, 22B: "activations_tp_only"
    (True, "selective", 9.56),  # "activations_sp_selective"
])
def test_activation_memory_matches_korthikanti_22b(root, sp, recompute, published_GiB):
    d = scenario_dict(cluster={"nodes": 1},
                      model={"layers": 48, "hidden": 6144, "heads": 64, "vocab": 51200, "seq_len": 2048},
                      parallel={"tp": 8, "pp": 1, "dp": 1, "sp": sp},
                      training={"micro_batch_size": 4, "global_batch_size": 4, "attention": "standard",
                                "recompute": recompute})
    st = run(root, **d).summary["memory"]["stages"][0]
    model = clustersim.load_scenario(scenario_dict(**d), base_dir=root).model
    layers_only = st["activations_bytes"] - tf.head_activation_bytes(model, 4, 8)
    assert layers_only / GiB == pytest.approx(published_GiB, rel=0.05)


# ---------------------------------------------------------------- recompute
def one_gpu(root, **training):
    return run(root, cluster={"topology": "topologies/single-h100.yaml", "nodes": 1},
               parallel={"tp": 1, "pp": 1, "dp": 1},
               training={"global_batch_size": 2, "attention": "standard", **training})


def test_full_recompute_adds_one_forward_per_layer(root):
    base, full = one_gpu(root), one_gpu(root, recompute="full")
    sc = base.scenario
    m, gpu = sc.model, sc.cluster.gpu
    fwd_layer = ops_time_s(tf.attn_block_fwd(m, 1, 1, False) + tf.mlp_block_fwd(m, 1, 1), gpu, "bf16")
    expected = base.summary["step_time_s"] + sc.microbatches * m.layers * fwd_layer
    assert full.summary["step_time_s"] == pytest.approx(expected, rel=1e-9)
    assert full.summary["model_flops_per_step"] == pytest.approx(base.summary["model_flops_per_step"], rel=1e-12)
    assert full.summary["hfu"] > full.summary["mfu"]
    st = full.summary["memory"]["stages"][0]
    s, h = m.seq_len, m.hidden
    assert st["activation_bytes_per_microbatch"] == pytest.approx(
        m.layers * 2 * s * h + tf.head_activation_bytes(m, 1, 1), rel=1e-12)
    # one layer whole while it recomputes, less its input, kept already
    assert st["recomputing_bytes"] == pytest.approx(tf.layer_activation_bytes(m, 1, 1, False) - 2 * s * h, rel=1e-12)


def test_selective_recompute_reruns_core_attention_only(root):
    base, sel = one_gpu(root), one_gpu(root, recompute="selective")
    sc = base.scenario
    m, gpu = sc.model, sc.cluster.gpu
    core = [o for o in tf.attn_block_fwd(m, 1, 1, False) if o.name == "core_attn"]
    expected = base.summary["step_time_s"] + sc.microbatches * m.layers * ops_time_s(core, gpu, "bf16")
    assert sel.summary["step_time_s"] == pytest.approx(expected, rel=1e-9)
    a = base.summary["memory"]["stages"][0]["activation_bytes_per_microbatch"]
    a_sel = sel.summary["memory"]["stages"][0]["activation_bytes_per_microbatch"]
    s, b, heads = m.seq_len, 1, m.heads
    assert a - a_sel == pytest.approx(m.layers * 5 * heads * s * s * b, rel=1e-12)


def test_zero3_reduces_a_unit_s_gradients_after_its_whole_backward(root):
    """ZeRO-3 reduce-scatters a unit's gradients (a layer, the embedding, the head) once its
    backward is done: after the last of the pieces a TP backward is cut into (the head's
    "head wgrad" and "head norm" too; each was a unit of its own, and the head's gradient was
    reduced before its wgrad was computed). One microbatch: the head's reduction is the
    backward's first without a layer, the embedding's its last."""
    r = run(root, cluster={"nodes": 2}, parallel={"tp": 2, "pp": 1, "dp": 8, "zero": 3},
            training={"global_batch_size": 8})
    spans = [s for s in r.trace.spans if s.rank == 0 and s.phase == "B"]
    computes = [s for s in spans if s.kind == "compute"]
    reduces = sorted((s for s in spans if s.name == "RS grads"), key=lambda s: s.start_s)
    assert len(reduces) == r.scenario.model.layers + 2
    head, emb = [s for s in reduces if s.layer < 0][0], [s for s in reduces if s.layer < 0][-1]
    pieces = [c for c in computes if c.name.split(" ")[1] == "head"]
    assert {c.name for c in pieces} == {"B head", "B head wgrad", "B head norm"}
    done = {id(head): max(c.end_s for c in pieces),
            id(emb): max(c.end_s for c in computes if c.name == "B embedding")}
    for rs in reduces:
        if rs.layer >= 0:
            done[id(rs)] = max(c.end_s for c in computes if c.layer == rs.layer)
    for k, rs in enumerate(reduces):  # when its unit is done, once the dp stream is free
        assert rs.start_s == max(done[id(rs)], reduces[k - 1].end_s if k else 0.0)


def test_sequence_parallel_w_gathers_the_input_beside_the_other_weight_gradients(root):
    """Split backward (zb-h1) under SP: W gathers the QKV's (MLP up's) sequence-sharded input
    beside the out projection's (MLP down's) weight gradient, which needs none, and the QKV
    (up) weight gradient starts when both are done."""
    r = run(root, cluster={"nodes": 1}, parallel={"tp": 4, "pp": 2, "dp": 1, "sp": True, "schedule": "zb-h1"},
            training={"global_batch_size": 4})
    spans = [s for s in r.trace.spans if s.rank == r.trace.spans[0].rank and s.phase == "W"]
    comp = {(s.mb, s.layer, s.name): s for s in spans if s.kind == "compute"}
    gathers = [s for s in spans if s.kind == "tp"]
    assert gathers and {s.op for s in gathers} == {"all_gather"}
    for g in gathers:
        block = g.name.removeprefix("W AG ")
        if block == "head":  # the LM head's is its only GEMM: it gathers first
            continue
        beside, after = comp[(g.mb, g.layer, f"W {block}")], comp[(g.mb, g.layer, f"W {block} wgrad")]
        assert g.start_s == beside.start_s
        assert after.start_s == max(beside.end_s, g.end_s)


# ---------------------------------------------------------------- TP communication overlap
# a 22B-like layer (Korthikanti et al. 2022) on one DGX-A100, TP8 with SP: GEMMs large enough
# for their chunks to hide the all-gather's shifts
TP_OVERLAP = dict(cluster={"nodes": 1}, model={"layers": 2, "hidden": 6144, "heads": 64, "vocab": 51200,
                                               "seq_len": 2048, "mlp": "gelu"},
                  training={"micro_batch_size": 4, "global_batch_size": 8})


def _tp_overlap_runs(root, **parallel):
    p = {"tp": 8, "pp": 1, "dp": 1, "sp": True, **parallel}
    return (run(root, parallel={**p, "tp_comm_overlap": False}, **TP_OVERLAP),
            run(root, parallel={**p, "tp_comm_overlap": True}, **TP_OVERLAP))


def tp_wire_bytes(spans, t: int) -> float:
    """Bytes one GPU sends over TP: a ring moves steps/n of each buffer, a shift the whole of its own."""
    return sum(s.size_bytes if s.op == "shift" else RING_STEPS[s.op](t) / t * s.size_bytes
               for s in spans if s.kind == "tp")


def test_tp_comm_overlap_moves_the_same_bytes_and_work_and_hides_the_collectives(root):
    """Megatron-LM's --tp-comm-overlap (Transformer Engine's userbuffers) pipelines SP's
    collectives with the GEMMs beside them: the forward all-gather becomes t-1 shifts of the
    whole / t (a ring exchange), the reduce-scatter 4 reduce-scatters of a quarter, the
    backward's gather of the output gradient t-1 shifts again; the weight gradients' gathers
    and reductions stay as they were. The same bytes cross the wire, the same FLOPs run, and
    less of the communication is exposed."""
    plain, over = _tp_overlap_runs(root)
    sc, t = over.scenario, 8
    assert tp_wire_bytes(over.trace.spans, t) == pytest.approx(tp_wire_bytes(plain.trace.spans, t), rel=1e-12)
    # the same work; the pieces' GEMMs, 1/t or 1/4 of the rows each, fill the SMs no better
    # than whole (costs.gemm_efficiency): as long at one efficiency, longer by their shapes
    assert over.summary["model_flops_per_step"] == pytest.approx(plain.summary["model_flops_per_step"], rel=1e-9)
    assert plain.summary["compute_s"] * (1 - 1e-12) <= over.summary["compute_s"]
    flat = [run(root, parallel={"tp": 8, "pp": 1, "dp": 1, "sp": True, "tp_comm_overlap": o},
                **TP_OVERLAP, simulation={"gemm_efficiency": "flat"}).summary["compute_s"] for o in (False, True)]
    assert flat[1] == pytest.approx(flat[0], rel=1e-9)
    per_mb = [s for s in over.trace.spans if s.kind == "tp" and s.rank == 0 and s.mb == 0 and s.layer == 0]
    count = lambda phase, op: sum(1 for s in per_mb if s.phase == phase and s.op == op)  # noqa: E731
    assert count("F", "shift") == 2 * (t - 1) and count("F", "reduce_scatter") == 2 * 4
    assert count("F", "all_gather") == 0
    assert count("B", "shift") == 2 * (t - 1)
    assert count("B", "all_gather") == 2 and count("B", "reduce_scatter") == 2  # beside the wgrads, as before
    act = 2 * sc.training.micro_batch_size * sc.model.seq_len * sc.model.hidden
    assert {s.size_bytes for s in per_mb if s.op == "shift"} == {act / t}
    assert over.summary["exposed_comm_s"]["tp"] < 0.5 * plain.summary["exposed_comm_s"]["tp"]
    assert over.summary["step_time_s"] < plain.summary["step_time_s"]
    from clustersim.output.summary import plan_options
    assert plan_options(over.summary["plan"]).startswith(" · SP (TP comm overlap)")
    assert plan_options(plain.summary["plan"]).startswith(" · SP") and "overlap" not in plan_options(plain.summary["plan"])


def test_tp_comm_overlap_ring_exchange_and_pipelined_reduce_scatter(root):
    """The forward's ring exchange: chunk k's shift starts with chunk k's GEMM and chunk k+1
    starts when both are done; the pipelined reduce-scatter: chunk k's starts when its GEMM
    ends, beside the next chunk, and the residual waits for the last."""
    _, over = _tp_overlap_runs(root)
    spans = [s for s in over.trace.spans if s.rank == 0 and s.phase == "F" and s.layer >= 0]
    comp = {(s.mb, s.layer, s.name): s for s in spans if s.kind == "compute"}
    comm = {(s.mb, s.layer, s.name): s for s in spans if s.kind == "tp"}
    for mb, layer in {(s.mb, s.layer) for s in spans}:
        for gemm in ("attn qkv", "mlp up"):
            for k in range(7):
                here, nxt = comp[(mb, layer, f"F {gemm} {k}")], comp[(mb, layer, f"F {gemm} {k + 1}")]
                shift = comm[(mb, layer, f"F shift {gemm} {k}")]
                assert shift.start_s == here.start_s
                assert nxt.start_s == max(here.end_s, shift.end_s)
        for gemm in ("attn proj", "mlp down"):
            for k in range(4):
                rs, done = comm[(mb, layer, f"F RS {gemm} {k}")], comp[(mb, layer, f"F {gemm} {k}")]
                assert rs.start_s >= done.end_s
                if k < 3:
                    assert rs.start_s == comp[(mb, layer, f"F {gemm} {k + 1}")].start_s
            residual = comp[(mb, layer, f"F {gemm.split()[0]} residual")]  # the block's last piece
            assert residual.start_s == pytest.approx(max(rs.end_s, done.end_s), abs=1e-15)
    # each piece of a block by its own name (the norm, the core or activation, the residual),
    # in the backward too: a name summed over a trace is one thing
    every = [s for s in over.trace.spans if s.rank == 0 and s.layer >= 0 and s.kind == "compute"]
    assert len({(s.mb, s.layer, s.phase, s.name) for s in every}) == len(every)
    assert {"F attn norm", "F attn core_attn", "F attn residual", "F mlp norm", "F mlp act", "F mlp residual",
            "B attn residual", "B mlp residual"} <= {s.name for s in every}


@pytest.mark.parametrize("schedule, recompute", [("zb-h1", "none"), ("1f1b", "full")])
def test_tp_comm_overlap_with_a_split_backward_and_recompute(root, schedule, recompute):
    """Under a split backward the ring-exchanged input gradients are B's and the weight
    gradients W's; full recompute runs the forward's ring again. Same bytes and work."""
    p = {"tp": 4, "pp": 2, "dp": 1, "sp": True, "schedule": schedule}
    base = dict(cluster={"nodes": 1}, training={"global_batch_size": 4, "recompute": recompute})
    plain = run(root, parallel=p, **base)
    over = run(root, parallel={**p, "tp_comm_overlap": True}, **base)
    assert tp_wire_bytes(over.trace.spans, 4) == pytest.approx(tp_wire_bytes(plain.trace.spans, 4), rel=1e-12)
    # the same work; the ring's GEMMs, 1/t of the rows each, fill the SMs no better than whole
    assert over.summary["model_flops_per_step"] == pytest.approx(plain.summary["model_flops_per_step"], rel=1e-12)
    assert over.summary["compute_s"] >= plain.summary["compute_s"] * (1 - 1e-12)
    dgrads = {s.phase for s in over.trace.spans if s.kind == "compute" and " dgrad " in s.name}
    assert dgrads == {"B"}
    if schedule == "zb-h1":  # the out projection's and MLP down's weight gradients are W's
        flops = lambda r, ph: sum(s.flops for s in r.trace.spans if s.phase == ph)  # noqa: E731
        assert flops(over, "W") == pytest.approx(flops(plain, "W"), rel=1e-9)
    else:
        shifts = [s for s in over.trace.spans if s.op == "shift" and s.phase == "B" and " up " in s.name]
        assert shifts, "the recomputed forward's ring exchange"


@pytest.mark.parametrize("cp_comm", ["ring", "all_gather"])
def test_tp_comm_overlap_with_context_parallelism(root, cp_comm):
    """With CP the attention is cut around its K/V exchange; the TP rings are the same: per
    layer and microbatch 2(t-1) shifts forward and 2(t-1) backward (the out projection's
    input gradient ring also where the backward gathers K/V first, ``all_gather``), and no
    empty block is left where the QKV ring ends the forward's piece."""
    p = {"tp": 4, "cp": 2, "pp": 1, "dp": 1, "sp": True, "cp_comm": cp_comm}
    base = dict(cluster={"nodes": 1}, training={"global_batch_size": 2, "attention": "flash"})
    plain = run(root, parallel=p, **base)
    over = run(root, parallel={**p, "tp_comm_overlap": True}, **base)
    spans = [s for s in over.trace.spans if s.rank == 0 and s.mb == 0 and s.layer == 0]
    for phase in ("F", "B"):
        assert sum(1 for s in spans if s.phase == phase and s.op == "shift" and s.kind == "tp") == 2 * 3, phase
    assert not any(s.kind == "tp" and s.op == "all_gather" and s.phase == "B" and "dgrad" not in s.name
                   for s in spans)  # the gradient's gathers are all rings now
    assert all(s.end_s > s.start_s for s in spans if s.kind == "compute")
    assert tp_wire_bytes(over.trace.spans, 4) == pytest.approx(tp_wire_bytes(plain.trace.spans, 4), rel=1e-12)


def test_tp_comm_overlap_needs_sp(root):
    with pytest.raises(clustersim.ConfigError, match="parallel.tp_comm_overlap.*needs sp: true"):
        clustersim.load_scenario(scenario_dict(parallel={"tp": 2, "pp": 2, "dp": 4, "tp_comm_overlap": True}),
                                 base_dir=root)


@pytest.mark.parametrize("parallel, spans", [({"tp": 16, "pp": 1, "dp": 1}, 2),
                                             ({"tp": 8, "pp": 1, "dp": 2, "order": "dp-tp-pp"}, 2)])
def test_tp_comm_overlap_needs_tp_inside_a_node(root, parallel, spans):
    """Transformer Engine's userbuffers map the TP peers' buffers over NVLink: a TP group
    across nodes (TP16 on 8-GPU nodes, or TP8 laid out across two by the order) is refused."""
    d = scenario_dict(model={"heads": 16}, parallel={**parallel, "sp": True, "tp_comm_overlap": True})
    with pytest.raises(clustersim.ConfigError, match=f"parallel.tp_comm_overlap.*spans {spans} nodes"):
        clustersim.load_scenario(d, base_dir=root)


# ---------------------------------------------------------------- PP scatter/gather
def test_pp_scatter_gather_sends_a_tp_share_and_the_receiver_gathers_it(root):
    """Megatron-LM's scatter/gather of PP sends (Narayanan et al. 2021, section 4.1): without
    SP each TP rank sends 1/t of the [b, s, h] activation (gradient) to its peer in the next
    (previous) stage, which all-gathers the whole over its TP group before the action that reads
    it; without it each rank sends the whole. Over the nodes' NICs (PP across nodes here) the
    step is shorter; under SP, whose sends are sharded already, it changes nothing."""
    act_bytes = 2.0 * 1 * 512 * 1024  # 16-bit [b, s, h]
    plain = run(root)
    scattered = run(root, parallel={"pp_scatter_gather": True})
    sends = [s for s in plain.trace.spans if s.kind == "pp" and s.name in ("send act", "send grad")]
    assert sends and {s.size_bytes for s in sends} == {act_bytes}
    spans = scattered.trace.spans
    sent = {(s.phase, s.mb, s.rank): s for s in spans if s.kind == "pp" and s.name in ("send act", "send grad")}
    assert len(sent) == len(sends) and {s.size_bytes for s in sent.values()} == {act_bytes / 4}
    gathers = [s for s in spans if s.name in ("F AG act", "B AG grad")]
    assert len(gathers) == len(sends)  # one a received input, each
    assert {(s.kind, s.op, s.size_bytes, s.stream) for s in gathers} == {("pp", "all_gather", act_bytes, "tp")}
    computes = [s for s in spans if s.kind == "compute"]
    for g in gathers:
        send = next(s for (phase, mb, _), s in sent.items() if phase == g.phase and mb == g.mb and s.stage != g.stage)
        assert g.start_s >= send.end_s - 1e-12
        first = min((c for c in computes if c.rank == g.rank and c.mb == g.mb and c.phase == g.phase),
                    key=lambda c: c.start_s)
        assert first.start_s >= g.end_s - 1e-12
    assert scattered.summary["step_time_s"] < plain.summary["step_time_s"]
    assert scattered.summary["exposed_comm_s"]["pp"] < plain.summary["exposed_comm_s"]["pp"]
    sp = {"sp": True}
    assert run(root, parallel={**sp, "pp_scatter_gather": True}).summary["step_time_s"] == \
        run(root, parallel=sp).summary["step_time_s"]
