"""The command line the fuzz scripts share: up to two counts after the script's name, each
with its default (``python bench/fuzz_plans.py 3 100``: seed 3, 100 plans); and draws two of
them share."""

from __future__ import annotations

import argparse


def at_least(low: int):
    """An argparse type: a whole number ``low`` or more (a seed may be 0; a count of plans or
    documents 1 or more: none would check nothing and say it passed)."""
    def whole(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"{n} is less than {low}")
        return n
    return whole


def two_counts(doc: str, first: tuple[str, int, str], second: tuple[str, int, str],
               *options: tuple[str, tuple[str, ...], str]) -> tuple:
    """The two counts given on the command line; ``first`` and ``second`` are (name, default,
    what it is), and the script's ``doc`` is the help's description, whole (its verdicts and
    exit codes). A seed is 0 or more, any other count 1 or more. Each of ``options``
    (``--name``, its choices, the first the default, what it is) adds that option's value
    after them, in order."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default, what in (first, second):
        ap.add_argument(name, nargs="?", type=at_least(0 if name == "seed" else 1), default=default,
                        help=f"{what} (default {default})")
    for flag, choices, what in options:
        ap.add_argument(flag, choices=choices, default=choices[0], help=f"{what} (default {choices[0]})")
    args = ap.parse_args()
    return (getattr(args, first[0]), getattr(args, second[0]), *(getattr(args, o[0].lstrip("-")) for o in options))


# ``--classes``, which the collapsed runs of fuzz_fabrics.py and fuzz_symmetry.py take: one class
# a stage (the default collapse) or each DP replica apart (simulation.split_replicas)
CLASSES = ("--classes", ("stage", "replica"), "the collapsed run's classes: one a stage, as by default, or each DP "
           "replica apart (simulation.split_replicas)")


def with_classes(d: dict, classes: str) -> dict:
    """Scenario dict ``d`` whose collapsed run has ``classes`` (:data:`CLASSES`)."""
    if classes == "stage":
        return d
    return {**d, "simulation": {**d.get("simulation", {}), "split_replicas": True}}


def with_recompute_layers(training: dict, rng, layers: int) -> dict:
    """``training`` with, under full recompute and one draw in two, which layers recompute
    (``recompute_method`` uniform or block, ``recompute_layers`` 1-3, at most ``layers``):
    drawn after every other field, so that a seed draws those as it did before."""
    if training.get("recompute") == "full" and rng.random() < 0.5:
        training = {**training, "recompute_method": rng.choice(["uniform", "block"]),
                    "recompute_layers": min(rng.randint(1, 3), layers)}
    return training


def with_etp(plan: dict, rng) -> dict:
    """``plan`` (a scenario dict) with, where it has experts, TP and SP, and one draw in two,
    the experts split over fewer TP ranks (``parallel.etp``, a smaller divisor of tp: EP folds
    over the other TP ranks). ``rng`` is the script's second generator, which only
    such later draws use, so that a seed draws every plan's other fields as it did before."""
    p = plan["parallel"]
    if "moe" in plan["model"] and p.get("tp", 1) > 1 and p.get("sp") and rng.random() < 0.5:
        smaller = [x for x in (1, 2, 4) if x < p["tp"] and p["tp"] % x == 0]
        plan = {**plan, "parallel": {**p, "etp": rng.choice(smaller)}}
    return plan


def with_ep_over_cp(plan: dict, rng) -> dict:
    """``plan`` with, where it has experts and CP and one draw in two, EP doubled past the DP
    ranks onto the CP ranks (EP folds over CP, as Megatron-Core's expert groups do), where
    the experts and the ranks holding different ones allow; a skewed load keeps its shape
    (the first EP index 1.5x, the last 0.5x); ``rng`` as :func:`with_etp`'s."""
    p, model = plan["parallel"], plan["model"]
    moe, ep = model.get("moe"), p.get("ep", 1)
    ranks = p["tp"] // p.get("etp", p["tp"]) * p.get("cp", 1) * p["dp"]
    if moe is None or p.get("cp", 1) < 2 or ranks % (2 * ep) or moe["experts"] % (2 * ep) or rng.random() >= 0.5:
        return plan
    moe = dict(moe)
    if "ep_load" in moe:
        moe["ep_load"] = [1.5] + [1.0] * (2 * ep - 2) + [0.5]
    return {**plan, "parallel": {**p, "ep": 2 * ep}, "model": {**model, "moe": moe}}


def with_deepep(plan: dict, rng) -> dict:
    """``plan`` with, where its experts can take it (EP, whole experts on a rank, no padding to
    capacity) and one draw in two, the deduplicating dispatch (``model.moe.dispatcher: deepep``),
    half of those with group-limited routing (two of four groups of experts); ``rng``: the
    script's third generator, apart from the plans and from :func:`with_etp`'s draws."""
    p, model = plan["parallel"], plan["model"]
    moe = model.get("moe")
    whole = p.get("etp", p.get("tp", 1)) == 1
    if moe is None or p.get("ep", 1) < 2 or not whole or moe.get("pad_to_capacity") or rng.random() >= 0.5:
        return plan
    moe = {**moe, "dispatcher": "deepep"}
    if rng.random() < 0.5 and moe["experts"] % 4 == 0 and moe["top_k"] <= moe["experts"] // 2:
        moe.update(router_groups=4, router_group_top_k=2)
    return {**plan, "model": {**model, "moe": moe}}


MLA = {"q_lora_rank": 384, "kv_lora_rank": 128, "qk_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64}


def with_mla(plan: dict, rng) -> dict:
    """``plan`` with, one draw in three, multi-head latent attention (``model.mla``, latents a
    third of a 1,024 hidden state; no biases; not beside TP communication overlap; its CP a
    ring, as Transformer Engine runs MLA's); ``rng``: the script's fourth generator, apart
    from every other draw."""
    if plan["parallel"].get("tp_comm_overlap") or "kv_heads" in plan["model"] or rng.random() >= 1 / 3:
        return plan
    p = plan["parallel"]
    if p.get("cp_comm") in ("all_gather", "all_to_all"):  # Transformer Engine runs MLA with ring CP only
        p = {**p, "cp_comm": "ring"}
    return {**plan, "model": {**plan["model"], "mla": dict(MLA), "bias": False}, "parallel": p}


def with_mtp(plan: dict, rng) -> dict:
    """``plan`` with, one draw in four, a multi-token prediction module on its last part
    (``model.mtp_layers: 1``); ``rng``: the script's fifth generator, apart from every other draw."""
    if rng.random() >= 0.25:
        return plan
    return {**plan, "model": {**plan["model"], "mtp_layers": 1}}


def with_dualpipev(plan: dict, rng) -> dict:
    """``plan`` with, where it runs DualPipe and one draw in two, DualPipeV instead (the same
    microbatches, 2 x pp model chunks: at least 2 x pp layers); ``rng`` as
    :func:`with_etp`'s."""
    p, model = plan["parallel"], plan["model"]
    if p.get("schedule") == "dualpipe" and rng.random() < 0.5:
        plan = {**plan, "parallel": {**p, "schedule": "dualpipev"},
                "model": {**model, "layers": max(model["layers"], 2 * p["pp"])}}
    return plan


def with_fp8(plan: dict, rng, root) -> dict:
    """``plan`` with, one draw in three where its topology's GPU has FP8 tensor cores, FP8
    training (``training.precision: fp8``: FP8 GEMMs, their inputs kept as FP8 copies), half
    of those under blockwise scaling (``fp8_recipe``; always where layernorm or moe_act is
    recomputed, which delayed scaling refuses); ``rng``: the script's sixth generator, apart
    from every other draw (drawn before the GPU is read, so the draws stay in step whatever
    the topology); ``root``: where the plan's topology path starts."""
    import yaml

    from clustersim.hardware.gpus import lookup_gpu

    if rng.random() >= 1 / 3:
        return plan
    recipe = rng.choice(["delayed", "blockwise"])
    if {"layernorm", "moe_act"} & set(plan["training"].get("recompute_modules") or ()):
        recipe = "blockwise"
    gpu = yaml.safe_load((root / plan["cluster"]["topology"]).read_text())["gpu"]
    if lookup_gpu(gpu).fp8_flops is None:
        return plan
    return {**plan, "training": {**plan["training"], "precision": "fp8", "fp8_recipe": recipe}}


def with_wide_cp(plan: dict, rng) -> dict:
    """``plan`` with, where it runs ring or all-gather CP over 2 ranks and one draw in two, CP
    over 4 or 8 (taken from DP, so that every group of DP and CP ranks keeps its size): rings
    that cross nodes where their members' roles differ (program/lower.py ``_shift_roles``:
    some enter their node, some leave it, some do neither), a third of the rings made
    hierarchical (``all_to_all+ring`` over slices of 2) where the heads a TP rank holds allow;
    ``rng``: the script's seventh generator, apart from every other draw."""
    p = plan["parallel"]
    if p.get("cp", 1) != 2 or p.get("cp_comm") not in ("ring", "all_gather") or rng.random() >= 0.5:
        return plan
    grow = rng.choice([2, 4])
    hierarchical = rng.random() < 1 / 3
    if p["dp"] % grow:
        return plan
    wide = {**p, "cp": 2 * grow, "dp": p["dp"] // grow}
    if "zero_shard" in p:
        wide["zero_shard"] = wide["cp"] * wide["dp"] // 2
    heads = plan["model"]["heads"] // p["tp"]
    if hierarchical and p["cp_comm"] == "ring" and heads % 2 == 0:
        wide.update(cp_comm="all_to_all+ring", cp_a2a=2)
    return {**plan, "parallel": wide}
