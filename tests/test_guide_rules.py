"""The parallelism guide's rules of thumb (docs/parallelism.md states them), checked
by simulation on DGX H100 nodes with NDR InfiniBand: each test compares the rule's choice with
its alternatives and asserts what the simulation says, where it agrees with the rule and where
it does not (docs/parallelism.md, "The guide's rules of thumb, by simulation", has the figures
and the reasons)."""

from __future__ import annotations

import copy

import yaml

import clustersim

from .conftest import ROOT

H100 = "../topologies/dgx-h100.yaml"
# GPT-3-like layers of Korthikanti et al.'s 22B (hidden 6144, 48 heads), 8 of its 48
GPT_22B_8_LAYERS = {"name": "gpt-22b-8-layers", "layers": 8, "hidden": 6144, "heads": 48, "kv_heads": 48,
                    "ffn_hidden": 16384, "vocab": 51200, "seq_len": 2048}
LLAMA2_13B = {"name": "llama2-13b", "layers": 40, "hidden": 5120, "heads": 40, "kv_heads": 40, "ffn_hidden": 13824,
              "vocab": 32000, "seq_len": 4096}
MIXTRAL_LIKE = {"name": "mixtral-like", "layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn_hidden": 14336,
                "vocab": 32000, "seq_len": 4096, "moe": {"experts": 8, "top_k": 2, "expert_ffn": 14336}}


def step(base: str, nodes: int, parallel: dict, training: dict | None = None, model: dict | None = None) -> dict:
    """The summary of scenarios/``base``.yaml on ``nodes`` DGX H100 nodes with this plan (the
    parallel section replaced, the others updated)."""
    d = copy.deepcopy(yaml.safe_load((ROOT / "scenarios" / f"{base}.yaml").read_text()))
    d["cluster"] = {"topology": H100, "nodes": nodes}
    d["parallel"] = parallel
    d["training"].update(training or {})
    d["model"].update(model or {})
    return clustersim.simulate(clustersim.load_scenario(d, base_dir=ROOT / "scenarios")).summary


def fits(s: dict) -> bool:
    return s["memory"]["fits"]


def test_tp_inside_a_node_pp_across():
    # "TP limited to intra-node communication (high speed) and PP/ZeRO-3 for inter-node"
    t = {"global_batch_size": 64, "recompute": "none"}
    tp_pp = step("llama3_8b_8gpu", 2, {"tp": 8, "pp": 2}, t, GPT_22B_8_LAYERS)
    tp16 = step("llama3_8b_8gpu", 2, {"tp": 16}, t, GPT_22B_8_LAYERS)
    assert tp16["step_time_s"] > 1.2 * tp_pp["step_time_s"]
    # (across the two nodes TP16's all-reduces run NVLSTree: 2.8x TP8's exposure, 5.2x as trees)
    assert tp16["exposed_comm_s"]["tp"] > 2.5 * tp_pp["exposed_comm_s"]["tp"]
    # TP8 x DP2: TP inside each node, or each TP group split 4 + 4 over the two (DP inside)
    inside = step("llama3_8b_8gpu", 2, {"tp": 8, "dp": 2, "zero": 1}, t, GPT_22B_8_LAYERS)
    split = step("llama3_8b_8gpu", 2, {"tp": 8, "dp": 2, "zero": 1, "order": "dp-tp-pp"}, t, GPT_22B_8_LAYERS)
    assert split["exposed_comm_s"]["tp"] > 1.6 * inside["exposed_comm_s"]["tp"]
    assert inside["step_time_s"] < split["step_time_s"]
    # with few tokens a step the once-a-step DP reduction outweighs TP's: there the split wins
    t8 = {"global_batch_size": 8, "recompute": "none"}
    inside8 = step("llama3_8b_8gpu", 2, {"tp": 8, "dp": 2, "zero": 1}, t8, GPT_22B_8_LAYERS)
    split8 = step("llama3_8b_8gpu", 2, {"tp": 8, "dp": 2, "zero": 1, "order": "dp-tp-pp"}, t8, GPT_22B_8_LAYERS)
    assert split8["step_time_s"] < inside8["step_time_s"]
    assert inside8["exposed_comm_s"]["dp"] > 5 * split8["exposed_comm_s"]["dp"]


def test_a_model_under_10b_fits_8_gpus_with_tp8_or_zero3():
    # "For small models (< 10B parameters), use TP (TP=8) or ZeRO-3 with DP and full recompute in 8 GPUs"
    t = {"global_batch_size": 16, "recompute": "none"}
    assert not fits(step("llama3_8b_8gpu", 1, {"dp": 8}, t))  # plain DP: 18 bytes a parameter of model states (fp32 grads)
    tp8 = step("llama3_8b_8gpu", 1, {"tp": 8}, t)
    zero3 = step("llama3_8b_8gpu", 1, {"dp": 8, "zero": 3}, {**t, "recompute": "full"})
    assert fits(tp8) and fits(zero3)
    # on NVSwitch ZeRO-3's gathers hide behind whole sequences; TP8's all-reduces on 1/8 of
    # each layer's work do not
    assert zero3["step_time_s"] < tp8["step_time_s"]


def test_zero3_beside_tp8_is_slow_at_64_gpus_but_not_alone():
    # "If you have up to 512 GPUs, use DP with TP=8 or PP. (ZeRO3 is inefficient)". Each plan
    # is given its best setting that fits, as a user would tune it: the pipeline its
    # recompute, ZeRO-3 its microbatch size (every microbatch gathers every layer again)
    t = {"global_batch_size": 64}

    def best(parallel, settings):
        runs = [step("llama2_70b_64gpu", 8, parallel, {**t, **x}) for x in settings]
        return min((s for s in runs if fits(s)), key=lambda s: s["step_time_s"]), runs

    tp_pp, _ = best({"tp": 8, "pp": 4, "dp": 2, "zero": 1}, [{"recompute": "full"}, {"recompute": "none"}])
    tp_zero3, runs = best({"tp": 8, "dp": 8, "zero": 3},
                          [{"recompute": "full", "micro_batch_size": b} for b in (1, 4, 8)])
    assert tp_pp["plan"]["recompute"] == "none" and tp_zero3["plan"]["micro_batch_size"] > 1
    assert tp_zero3["step_time_s"] > 1.1 * tp_pp["step_time_s"]
    # untuned, microbatches of one sequence, it is far slower: 8 microbatches' gathers, one NIC each
    one = runs[0]
    assert one["step_time_s"] > 2 * tp_pp["step_time_s"] and one["exposed_comm_s"]["dp"] > 0.5 * one["step_time_s"]
    # with SP and TP communication overlap on both (as Megatron users at this size run them),
    # TP's exposed share shrinks on both sides and the verdict holds
    over = {"sp": True, "tp_comm_overlap": True}
    tp_pp_over = step("llama2_70b_64gpu", 8, {"tp": 8, "pp": 4, "dp": 2, "zero": 1, **over}, {**t, "recompute": "none"})
    tp_zero3_over = step("llama2_70b_64gpu", 8, {"tp": 8, "dp": 8, "zero": 3, **over},
                         {**t, "recompute": "full", "micro_batch_size": 8})
    assert fits(tp_pp_over) and fits(tp_zero3_over)
    assert tp_pp_over["step_time_s"] < tp_pp["step_time_s"] and tp_zero3_over["step_time_s"] < tp_zero3["step_time_s"]
    assert tp_zero3_over["step_time_s"] > 1.05 * tp_pp_over["step_time_s"]
    # ZeRO-3 alone over all 64 GPUs, one microbatch each: every NIC of a node carries the
    # rings, and a whole sequence of compute hides them
    zero3 = step("llama2_70b_64gpu", 8, {"dp": 64, "zero": 3}, {**t, "recompute": "full"})
    assert fits(zero3) and zero3["step_time_s"] < tp_pp["step_time_s"]


def test_long_sequences_fit_with_cp():
    # "For large sequence length (128K+), use CP"
    t = {"global_batch_size": 4, "recompute": "none"}
    m = {"seq_len": 131072}
    without = step("llama3_8b_8gpu", 4, {"tp": 8, "sp": True, "dp": 4}, t, m)
    with_cp = step("llama3_8b_8gpu", 4, {"tp": 4, "sp": True, "cp": 8}, t, m)
    assert not fits(without) and fits(with_cp)
    assert with_cp["step_time_s"] < without["step_time_s"]


def test_zero3_with_pp_regathers_every_microbatch():
    # "For combining ZeRO3 with PP, additional communication is needed as parameters are split.
    # Global batch size should be large to hide the communication cost": gathered again for
    # every microbatch, the cost grows with the batch; kept gathered through the step
    # (zero3_keep_gathered) it is paid once and ZeRO-3 runs as fast as ZeRO-1
    over = {}
    for gbs in (16, 64):
        t = {"global_batch_size": gbs, "recompute": "full"}
        z1, z3, kept = (step("llama2_70b_64gpu", 8, {"tp": 8, "pp": 2, "dp": 4, **z}, t)
                        for z in ({"zero": 1}, {"zero": 3}, {"zero": 3, "zero3_keep_gathered": True}))
        over[gbs] = z3["step_time_s"] / z1["step_time_s"] - 1
        assert abs(kept["step_time_s"] / z1["step_time_s"] - 1) < 0.02
        assert z3["memory"]["peak_bytes"] < kept["memory"]["peak_bytes"]  # what re-gathering buys
    assert over[64] >= over[16] > 0.3


def test_few_gpus_fit_with_full_recompute_and_accumulation():
    # "If you have few GPUs, try full activation re-computation, increase gradient
    # accumulation to process larger batch size"
    m = {**LLAMA2_13B, "seq_len": 16384}
    t = {"global_batch_size": 32, "micro_batch_size": 1}
    assert not fits(step("llama3_8b_8gpu", 1, {"dp": 8, "zero": 3}, {**t, "recompute": "none"}, m))
    assert not fits(step("llama3_8b_8gpu", 1, {"dp": 8, "zero": 3}, {**t, "recompute": "selective"}, m))  # flash
    full = step("llama3_8b_8gpu", 1, {"dp": 8, "zero": 3}, {**t, "recompute": "full"}, m)
    assert fits(full) and full["plan"]["microbatches"] == 4  # the batch of 32 in 4 microbatches a GPU


def test_moe_fits_with_ep():
    # "If your model is MoE, use EP in addition"
    t = {"global_batch_size": 64, "recompute": "full"}
    no_ep = step("llama3_8b_8gpu", 4, {"tp": 2, "dp": 16, "zero": 1}, t, MIXTRAL_LIKE)
    ep8 = step("llama3_8b_8gpu", 4, {"dp": 32, "ep": 8, "zero": 1}, t, MIXTRAL_LIKE)
    assert not fits(no_ep) and fits(ep8)
    assert ep8["step_time_s"] < no_ep["step_time_s"]


def test_when_nothing_else_fits_the_optimizer_goes_to_the_host():
    # "If still does not work, sorry. Get a job, save some money and buy more GPUs": Llama-2
    # 70B on one DGX H100 fits with none of the guide's levers (ZeRO-3 with full recompute and
    # accumulation, TP8), and fits with Adam's states in the host's memory
    t = {"global_batch_size": 64, "micro_batch_size": 1}
    zero3 = step("llama2_70b_64gpu", 1, {"dp": 8, "zero": 3}, {**t, "recompute": "full"})
    tp8 = step("llama2_70b_64gpu", 1, {"tp": 8, "dp": 1, "sp": True, "zero": 1}, {**t, "recompute": "full"})
    assert not fits(zero3) and not fits(tp8)
    offloaded = step("llama2_70b_64gpu", 1, {"tp": 4, "pp": 2, "dp": 1, "sp": True, "zero": 1},
                     {**t, "recompute": "none", "optimizer_offload": 1.0, "overlap_offload_copies": True})
    assert fits(offloaded) and offloaded["memory"]["host"]["fits"]
    # the host's Adam is the price: a fifth of the step or more, exposed
    assert offloaded["exposed_comm_s"]["offload"] > 0.19 * offloaded["step_time_s"]
