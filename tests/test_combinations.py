"""Many plans on a small cluster: every combination runs and keeps the invariants of a step."""

from __future__ import annotations

import itertools

import pytest

import clustersim

from .conftest import scenario_dict

MOE = {"moe": {"experts": 8, "top_k": 2, "expert_ffn": 512, "shared_experts": 1}, "mlp": "swiglu", "bias": False}

PLANS = []
for (tp, pp, dp), sp, zero, recompute, schedule in itertools.product(
        [(4, 2, 2), (2, 2, 4), (1, 4, 4), (2, 4, 2)], [False, True], [0, 1, 2, 3],
        ["none", "selective", "full"], ["1f1b", "gpipe", "interleaved", "zb-h1", "zbv", "dualpipe"]):
    if sp and tp == 1:
        continue
    # keep the grid affordable: vary recompute and SP only on the 1F1B plans
    if schedule != "1f1b" and (recompute != "none" or sp):
        continue
    PLANS.append(dict(tp=tp, pp=pp, dp=dp, sp=sp, zero=zero, recompute=recompute, schedule=schedule))
for ep, zero in itertools.product([1, 2, 4], [0, 1, 2, 3]):
    PLANS.append(dict(tp=1, pp=2, dp=8, sp=False, zero=zero, recompute="none", schedule="1f1b", ep=ep, moe=True))
for ep, zero in itertools.product([2, 8], [0, 1, 3]):  # DualPipe holds every expert twice
    PLANS.append(dict(tp=1, pp=2, dp=8, sp=False, zero=zero, recompute="none", schedule="dualpipe", ep=ep, moe=True))


# context parallelism: both variants, balanced or not, with ZeRO, a split backward, interleaving and EP
for cp, cp_comm, balance, zero, schedule in itertools.product(
        [2, 4], ["ring", "all_gather"], [True, False], [0, 1, 3], ["1f1b", "zb-h1", "interleaved"]):
    if schedule != "1f1b" and (zero != 1 or not balance):
        continue
    tp = 4 // cp
    PLANS.append(dict(tp=tp, pp=2, dp=2, cp=cp, cp_comm=cp_comm, cp_load_balance=balance, sp=tp > 1 and zero == 1,
                      zero=zero, recompute="full" if zero == 3 else "none", schedule=schedule))
# all-to-all CP (Ulysses; balanced only: an unbalanced split changes nothing and is refused)
for cp, zero, schedule in itertools.product([2, 4], [0, 1, 3], ["1f1b", "zb-h1", "interleaved", "zbv"]):
    if schedule != "1f1b" and zero != 1:
        continue
    tp = 4 // cp
    PLANS.append(dict(tp=tp, pp=2, dp=2, cp=cp, cp_comm="all_to_all", sp=tp > 1 and zero == 1, zero=zero,
                      recompute={0: "selective", 1: "none", 3: "full"}[zero], schedule=schedule))
# hierarchical CP (all-to-all inside pairs, a ring across them): ZeRO, schedules, TP with SP
for zero, schedule, more in [(0, "1f1b", {}), (3, "1f1b", dict(recompute="full")), (1, "interleaved", {}),
                             (1, "zbv", {}), (1, "dualpipe", {}), (2, "1f1b", dict(tp=2, cp=4, dp=1, sp=True))]:
    PLANS.append({**dict(tp=1, pp=2, dp=2, cp=4, cp_comm="all_to_all+ring", cp_a2a=2, zero=zero, recompute="none",
                         schedule=schedule), **more})
for ep, cp_comm in itertools.product([2, 4], ["ring", "all_gather", "all_to_all"]):
    PLANS.append(dict(tp=1, pp=2, dp=4, cp=2, cp_comm=cp_comm, sp=False, zero=1, recompute="none", schedule="1f1b",
                      ep=ep, moe=True))

# TP communication overlap: every schedule, recompute, ZeRO-3, CP of both kinds and EP
for schedule, recompute, zero in [("1f1b", "full", 3), ("gpipe", "selective", 1), ("interleaved", "none", 2),
                                  ("zb-h1", "full", 1), ("dualpipe", "none", 0)]:
    PLANS.append(dict(tp=4, pp=2, dp=2, sp=True, tp_comm_overlap=True, zero=zero, recompute=recompute,
                      schedule=schedule))
for cp_comm in ("ring", "all_gather", "all_to_all"):
    PLANS.append(dict(tp=2, pp=2, dp=2, cp=2, cp_comm=cp_comm, sp=True, tp_comm_overlap=True, zero=1,
                      recompute="none", schedule="zb-h1"))
PLANS.append(dict(tp=2, pp=2, dp=4, sp=True, tp_comm_overlap=True, zero=1, recompute="none", schedule="1f1b", ep=2,
                  moe=True))

# hybrid sharding (HSDP): ZeRO 1-3 over half the DP ranks, with each schedule family and CP
for schedule, zero in [("1f1b", 3), ("interleaved", 1), ("zb-h1", 2), ("dualpipe", 1), ("zbv", 3)]:
    PLANS.append(dict(tp=2, pp=2, dp=4, zero=zero, zero_shard=2, recompute="none", schedule=schedule))
PLANS.append(dict(tp=1, pp=2, dp=4, cp=2, zero=3, zero_shard=4, recompute="full", schedule="1f1b"))

# full recompute of some layers or by groups, with each schedule family, ZeRO-3, SP, CP and EP
for schedule, zero, method, n, more in [
        ("1f1b", 3, "uniform", 2, dict(sp=True, tp_comm_overlap=True)), ("interleaved", 3, "block", 1, {}),
        ("zb-h1", 1, "uniform", 3, dict(sp=True)), ("zbv", 2, "block", 1, {}), ("gpipe", 1, "block", 2, dict(cp=2)),
        ("dualpipe", 1, "uniform", 2, dict(tp=1, dp=8, ep=2, moe=True))]:
    PLANS.append({**dict(tp=4 // more.get("cp", 1), pp=2, dp=2, zero=zero, recompute="full", recompute_method=method,
                         recompute_layers=n, schedule=schedule), **more})
# selective recompute by module: dense and MoE modules, with SP, TP overlap, ZeRO-3 and split backwards
for schedule, zero, modules, more in [
        ("1f1b", 3, ["layernorm", "mlp"], dict(sp=True, tp_comm_overlap=True)),
        ("zb-h1", 1, ["moe", "layernorm"], dict(tp=1, dp=8, ep=2, moe=True)),
        ("dualpipe", 1, ["moe_act", "shared_experts", "core_attn"], dict(tp=1, dp=8, ep=2, moe=True)),
        ("interleaved", 2, ["moe", "core_attn"], dict(tp=2, dp=4, ep=2, sp=True, moe=True))]:
    PLANS.append({**dict(tp=4, pp=2, dp=2, zero=zero, recompute="selective", recompute_modules=modules,
                         schedule=schedule), **more})

# expert tensor parallelism below TP (MoE parallel folding): whole or half-split experts, with
# each schedule family, ZeRO 1-3, CP, recompute and TP overlap
for schedule, zero, etp, ep, more in [
        ("1f1b", 1, 1, 8, {}), ("interleaved", 3, 2, 2, dict(recompute="full")),
        ("zb-h1", 2, 1, 4, dict(tp_comm_overlap=True)), ("dualpipe", 1, 1, 2, {}),
        ("1f1b", 0, 1, 2, dict(tp=2, dp=2, cp=2)), ("gpipe", 3, 2, 1, dict(recompute="selective",
                                                                           recompute_modules=["moe"]))]:
    PLANS.append({**dict(tp=4, pp=2, dp=2, sp=True, zero=zero, recompute="none", schedule=schedule, ep=ep, etp=etp,
                         moe=True), **more})

# DualPipeV: dense and MoE (EP, experts whole below TP), ZeRO 1-3, recompute, SP, CP
for zero, more in [(1, {}), (3, dict(recompute="full", sp=True)), (2, dict(tp=1, dp=8, ep=4, moe=True)),
                   (1, dict(tp=4, dp=2, sp=True, ep=2, etp=1, moe=True, recompute="selective")),
                   (0, dict(tp=2, dp=2, cp=2, sp=True))]:
    PLANS.append({**dict(tp=4, pp=2, dp=2, zero=zero, recompute="none", schedule="dualpipev"), **more})

# FP8 training (H100s): FP8 GEMMs and their inputs kept as FP8 copies, under delayed scaling and
# blockwise, with each schedule family, ZeRO 0-3, SP and its overlap, CP, selective and full
# recompute, EP with DeepEP, MLA and MTP
for schedule, zero, more in [
        ("1f1b", 1, dict(sp=True, recompute="full")), ("zbv", 2, dict(sp=True, tp_comm_overlap=True)),
        ("zb-h1", 2, dict(tp=1, dp=8, ep=2, moe=True, recompute="selective", recompute_modules=["layernorm", "moe_act"],
                          fp8="blockwise")),
        ("dualpipe", 1, dict(tp=1, dp=8, ep=4, moe=True, deepep="groups", mla=True, mtp=True, fp8="blockwise")),
        ("interleaved", 3, dict(tp=2, cp=2)), ("1f1b", 1, dict(sp=True, ep=2, moe=True, fp8="tensorwise"))]:
    PLANS.append({**dict(tp=4, pp=2, dp=2, zero=zero, recompute="none", schedule=schedule, fp8="delayed"), **more})

# the deduplicated dispatch (DeepEP), with and without group-limited routing: each schedule
# family, ZeRO 0-3, whole experts below TP, CP, and EP across the two nodes
for schedule, zero, deepep, more in [
        ("1f1b", 1, "deepep", dict(tp=1, dp=8, ep=4)), ("interleaved", 3, "groups", dict(tp=1, dp=8, ep=8)),
        ("dualpipe", 1, "deepep", dict(tp=1, dp=8, ep=2)), ("zb-h1", 2, "groups", dict(tp=4, dp=2, sp=True, ep=2, etp=1)),
        ("1f1b", 0, "deepep", dict(tp=1, dp=4, cp=2, ep=4)),
        ("1f1b", 1, "groups", dict(tp=1, pp=1, dp=16, ep=8))]:
    PLANS.append({**dict(pp=2, zero=zero, recompute="none", schedule=schedule, moe=True, deepep=deepep), **more})

# multi-head latent attention: each schedule family, TP with and without SP, ZeRO 0-3, CP,
# its up projections recomputed, with experts and the deduplicated dispatch
for schedule, zero, more in [
        ("1f1b", 3, dict(sp=True)), ("interleaved", 1, {}), ("zb-h1", 2, dict(tp=2, dp=2, cp=2)),
        ("zbv", 0, dict(tp=2, dp=4)), ("gpipe", 1, dict(sp=True, recompute="selective",
                                                         recompute_modules=["mla_up_proj", "layernorm"])),
        ("dualpipe", 1, dict(tp=1, dp=8, ep=4, moe=True, deepep="deepep")),
        ("1f1b", 1, dict(tp=2, dp=2, cp=2, recompute="selective", recompute_modules=["core_attn", "mla_up_proj"]))]:
    PLANS.append({**dict(tp=4, pp=2, dp=2, zero=zero, recompute="none", schedule=schedule, mla=True), **more})

# combined 1F1B (ep_comm_overlap): without a pipeline and interleaved, ZeRO 0-3, selective
# recompute, TP with SP, DeepEP, latent attention, multi-token prediction, CP
for schedule, zero, more in [
        ("1f1b", 1, dict(pp=1, dp=16)), ("interleaved", 0, {}), ("interleaved", 3, dict(recompute="selective")),
        ("interleaved", 1, dict(tp=2, dp=4, sp=True)), ("1f1b", 2, dict(pp=1, dp=16, deepep="deepep")),
        ("interleaved", 1, dict(mla=True)), ("interleaved", 2, dict(mtp=True)), ("interleaved", 1, dict(cp=2, dp=4))]:
    PLANS.append({**dict(tp=1, pp=2, dp=8, ep=4, zero=zero, recompute="none", schedule=schedule, moe=True,
                         ep_comm_overlap=True), **more})

# multi-token prediction: each schedule family, ZeRO-3, recompute, SP, CP and experts
for schedule, zero, more in [
        ("1f1b", 3, dict(sp=True, recompute="full")), ("interleaved", 1, {}), ("zbv", 2, {}),
        ("dualpipev", 1, dict(tp=1, dp=8, ep=4, moe=True, mla=True)), ("zb-h1", 0, dict(tp=2, dp=2, cp=2))]:
    PLANS.append({**dict(tp=4, pp=2, dp=2, zero=zero, recompute="none", schedule=schedule, mtp=True), **more})


def _id(p):
    return "-".join(f"{k}{'+'.join(v) if isinstance(v, list) else v}" for k, v in p.items()
                    if v not in (False, None) and k != "cp_load_balance") + \
        ("-unbalanced" if p.get("cp_load_balance") is False else "")


@pytest.mark.parametrize("plan", PLANS, ids=[_id(p) for p in PLANS])
def test_plan_runs_and_holds_invariants(root, plan):
    plan = dict(plan)
    recompute, moe, deepep = plan.pop("recompute"), plan.pop("moe", False), plan.pop("deepep", None)
    mla, mtp, fp8 = plan.pop("mla", False), plan.pop("mtp", False), plan.pop("fp8", False)
    layers = {k: plan.pop(k) for k in ("recompute_method", "recompute_layers", "recompute_modules") if k in plan}
    parallel = {**plan}
    if plan["schedule"] == "interleaved":
        parallel["vpp"] = 2
    model = {"layers": 8, **(MOE if moe else {})}
    if deepep:
        groups = dict(router_groups=4, router_group_top_k=2) if deepep == "groups" else {}
        model["moe"] = {**model["moe"], "dispatcher": "deepep", **groups}
    if mtp:
        model["mtp_layers"] = 1
    if mla:  # latents a third of the 1,024 hidden state, 8 heads of 96 + 32 (Q, K) and 128 (V)
        model |= {"bias": False, "mla": {"q_lora_rank": 384, "kv_lora_rank": 128, "qk_head_dim": 96,
                                         "qk_rope_head_dim": 32, "v_head_dim": 128}}
    d = scenario_dict(model=model, parallel=parallel,
                      training={"global_batch_size": 8 * plan["dp"], "recompute": recompute, "attention": "flash",
                                **layers})
    if fp8:
        d["cluster"]["topology"] = "topologies/dgx-h100.yaml"
        d["training"] |= {"precision": "fp8", "fp8_recipe": fp8}
    sc = clustersim.load_scenario(d, base_dir=root)
    s = clustersim.simulate(sc).summary
    if fp8:  # the same plan in bf16 computes no shorter than fp8 with free casts (its GEMMs at the bf16 peak,
        # where not memory-bound), at one GEMM efficiency: by their shapes FP8's GEMMs pay more for a short
        # reduction (hardware.gpus.K0_HOPPER_FP8), and on layers this small can be the slower, casts or not
        from clustersim.program import costs

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(costs, "FP8_CAST_BYTES_PER_ELEM", 0)
            free = clustersim.simulate(clustersim.load_scenario(d, base_dir=root), brief=True).summary["compute_s"]
        assert free < s["compute_s"]
        d["simulation"] = {**d.get("simulation", {}), "gemm_efficiency": "flat"}
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(costs, "FP8_CAST_BYTES_PER_ELEM", 0)
            free = clustersim.simulate(clustersim.load_scenario(d, base_dir=root), brief=True).summary["compute_s"]
        d["training"] = {k: v for k, v in d["training"].items() if k != "fp8_recipe"} | {"precision": "bf16"}
        assert free <= clustersim.simulate(clustersim.load_scenario(d, base_dir=root)).summary["compute_s"]
    step = s["step_time_s"]
    assert step > 0
    assert 0 < s["mfu"] <= s["hfu"] < 1
    assert 0 <= s["bubble_fraction"] < 1
    # compute, exposed communication and bubble partition each GPU's step
    assert s["compute_s"] + s["exposed_comm_s"]["total"] + s["bubble_fraction"] * step == pytest.approx(step, rel=1e-6)
    for k in ("tp", "cp", "ep", "pp", "dp"):
        assert 0 <= s["exposed_comm_s"][k] <= s["comm_s"][k] + 1e-12
    assert s["model_flops_per_step"] > 0
    for st in s["memory"]["stages"]:
        assert st["peak_bytes"] >= st["params_bytes"] + st["grads_bytes"] + st["optimizer_bytes"] > 0
    if plan["tp"] == 1:
        assert s["comm_s"]["tp"] == 0
    if plan.get("ep", 1) > 1:
        assert s["comm_s"]["ep"] > 0
    assert (s["comm_s"]["cp"] > 0) == (plan.get("cp", 1) > 1)
