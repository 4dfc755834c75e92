"""``clustersim advise``: the search around the parallelism guide's options, the guide's rule
for each case, the scenario's own plan among those ranked, coarse to fine against every plan,
and bad input refused."""

from __future__ import annotations

import html
import json
import shlex

import pytest
import yaml

import clustersim
from clustersim.advise import (check_plan_keys, guide_rule, memory_settings, own_values, plan_of, run_advise,
                               search_space, values_of)
from clustersim.output.plans_page import compare_command, run_command, scatter_figure
from clustersim.overrides import load_variant, parse_changes
from clustersim.sweep import DP
from clustersim.yamlio import read_yaml

from .test_cli import run_cli

SMALL = "scenarios/llama3_8b_8gpu.yaml"  # Llama-3 8B on one DGX H100 node: the guide's small-model case


@pytest.mark.parametrize("params, gpus, first", [
    (8e9, 8, "TP=8"),
    (8e9, 16, "TP=8 and PP"),
    (70e9, 64, "TP=8 and PP"),
    (70e9, 768, "TP=8 and PP"),
    (70e9, 2048, "TP=8 and PP"),
    (13e9, 8, "TP=8 and PP"),
    (175e9, 512, "DP with TP=8"),
    (175e9, 1024, "DP with TP=8"),  # 513-1024: no rule of its own, both neighbours' options
    (671e9, 2048, "TP=8 with ZeRO2 and PP"),
])
def test_guide_rule_by_case(params, gpus, first):
    rule = guide_rule(params, gpus, 8)
    assert rule.options[0].name == first
    names = [o.name for o in rule.options]
    if 512 < gpus <= 1024 and params > 100e9:
        assert names == ["DP with TP=8", "DP with PP", "TP=8 with ZeRO2 and PP"]
    # up to 100B beyond 8 GPUs, the GPU-count rule that applies stands beside the model-size one
    # (docs/parallelism.md checks the 512-GPU rule on Llama-2 70B over 64 GPUs)
    if 10e9 <= params <= 100e9 or (params <= 100e9 and gpus > 8):
        size = ["TP=8 and PP", "TP=8 with DP+ZeRO3", "only ZeRO3"]
        assert names == size + (["DP with TP=8", "DP with PP"] if gpus <= 512 else
                                ["TP=8 with ZeRO2 and PP"] if gpus > 1024 else [])
    v = {"tp": 8, "pp": 4, "dp": 2, "cp": 1, "ep": 1, "zero": 1, "recompute": "full"}
    assert guide_rule(70e9, 64, 8).options[0].test(v) and not guide_rule(70e9, 64, 8).options[2].test(v)
    assert guide_rule(8e9, 8, 4).options[0].name == "TP=4"  # a node of 4 GPUs: TP over the node
    # "If your model is MoE, use EP in addition": every option then asks EP of its plans
    moe = guide_rule(671e9, 2048, 8, moe=True)
    assert moe.options[0].name == "TP=8 with ZeRO2 and PP + EP" and moe.says[-1].startswith("If your model is MoE")
    tp8 = {"tp": 8, "pp": 16, "dp": 16, "cp": 1, "ep": 1, "zero": 2, "recompute": "full"}
    assert not moe.options[0].test(tp8) and moe.options[0].test({**tp8, "ep": 8})


def test_memory_settings_most_saving_first():
    space = {"parallel.zero": [1, 2, 3], "training.recompute": ["none", "selective", "full"]}
    assert memory_settings(space, 1)[0] == {"parallel.zero": 3, "training.recompute": "full"}
    with_pp = memory_settings(space, 4)
    assert with_pp[0] == {"parallel.zero": 2, "training.recompute": "full"} and len(with_pp) == 6
    assert all(x["parallel.zero"] != 3 for x in with_pp)  # no ZeRO-3 under a pipeline unless asked alone
    assert memory_settings({"parallel.zero": [3]}, 4) == [{"parallel.zero": 3}]


def test_plans_keep_what_they_can_of_the_file(root):
    path = root / "scenarios" / "moe_1024gpu.yaml"
    sc, data = clustersim.load_scenario(path), read_yaml(path, what="scenario")
    space = search_space(sc, data)
    assert space["parallel.schedule"] == ["1f1b", "interleaved"] and space["training.recompute"] == ["none", "full"]
    assert own_values(sc, space)["parallel.pp"] == 8 and own_values(sc, space)["parallel.schedule"] == "interleaved"
    varied = set(space)
    same = dict(plan_of(sc, data, {"parallel.pp": 8, "parallel.schedule": "interleaved", "parallel.tp": 1}, 1,
                        varied).changes)
    assert same[DP] == 128 and "parallel.vpp" not in same and "parallel.layers_per_stage" not in same
    other = dict(plan_of(sc, data, {"parallel.pp": 4, "parallel.schedule": "1f1b", "parallel.tp": 2}, 2,
                         varied).changes)
    assert other[DP] == 128 and other["parallel.vpp"] is None and other["parallel.sp"] is True
    assert plan_of(sc, data, {"parallel.pp": 1, "parallel.schedule": "interleaved"}, 3, varied) is None
    assert plan_of(sc, data, {"parallel.pp": 3}, 4, varied) is None  # 1,024 GPUs are not a multiple of 3
    # a file's layer split stays with its own pipeline only (sweep.with_split)
    path = root / "scenarios" / "deepseek_v3_2048gpu.yaml"
    sc, data = clustersim.load_scenario(path), read_yaml(path, what="scenario")
    varied = {"parallel.pp", "parallel.schedule"}
    own = dict(plan_of(sc, data, {"parallel.pp": 16, "parallel.schedule": "dualpipe"}, 1, varied).changes)
    other = dict(plan_of(sc, data, {"parallel.pp": 8, "parallel.schedule": "dualpipe"}, 2, varied).changes)
    assert "parallel.layers_per_stage" not in own and other["parallel.layers_per_stage"] is None


def test_plans_keep_combined_1f1b_where_they_can_run_it(root):
    """A file's ep_comm_overlap stays with the plans that can run combined 1F1B (EP over
    experts, interleaving with a pipeline or 1F1B without, no full recompute) and is dropped
    from the others, as tp_comm_overlap is at tp=1, so that advise does not refuse them."""
    path = root / "scenarios" / "moe_1024gpu.yaml"
    sc, data = clustersim.load_scenario(path), read_yaml(path, what="scenario")
    data["parallel"]["ep_comm_overlap"] = True
    data["training"]["recompute"] = "selective"
    varied = {"parallel.pp", "parallel.schedule", "parallel.ep", "training.recompute"}

    def kept(**values) -> bool:
        changes = dict(plan_of(sc, data, {f"parallel.{k}" if k != "recompute" else "training.recompute": v
                                          for k, v in values.items()}, 1, varied).changes)
        return changes.get("parallel.ep_comm_overlap", True) is not None

    assert kept(pp=8, schedule="interleaved", ep=16, recompute="none")
    assert kept(pp=1, schedule="1f1b", ep=16, recompute="selective")
    assert not kept(pp=8, schedule="1f1b", ep=16, recompute="none")
    assert not kept(pp=8, schedule="interleaved", ep=1, recompute="none")
    assert not kept(pp=8, schedule="interleaved", ep=16, recompute="full")


def test_advise_small_model(tmp_path, root):
    out = tmp_path / "adv"
    r = run_cli("advise", SMALL, "--jobs", 2, "--out", out, cwd=root)
    assert r.returncode == 0, r.stderr
    adv = json.loads((out / "advise.json").read_text())
    rows = {x["plan"]: x for x in adv["plans"]}
    assert not adv["coarse_to_fine"] and adv["guide"][0].startswith("For small models (< 10B parameters)")
    # plan 1 is the scenario's own, as run simulates it
    direct = clustersim.simulate(clustersim.load_scenario(root / SMALL)).summary
    assert rows[1]["step_time_s"] == direct["step_time_s"]
    ok = [x for x in adv["plans"] if x["status"] == "ok"]
    par = read_yaml(root / SMALL, what="scenario")["parallel"]
    tr = read_yaml(root / SMALL, what="scenario")["training"]
    for x in ok:
        v = values_of(x, par, tr)
        assert v["dp"] * v["tp"] * v["pp"] == 8
    # ranked: those that fit by tokens/s; each option's best is the first of its plans that fits
    ranked = [rows[n] for n in adv["ranking"]]
    fitting = [x for x in ranked if x["fits"]]
    assert [x["tokens_per_s"] for x in fitting] == sorted((x["tokens_per_s"] for x in fitting), reverse=True)
    for o in adv["options"]:
        mine = [x for x in fitting if o["option"] in x["guide_options"]]
        assert o["best"] == (mine[0]["plan"] if mine else None)
    zero3_full = next(o for o in adv["options"] if o["option"] == "ZeRO-3 with DP and full recompute")
    best = rows[zero3_full["best"]]
    assert best["changes"]["parallel.zero"] == 3 and best["changes"]["training.recompute"] == "full"
    # the terminal says the same
    assert "the guide   \"For small models" in r.stdout
    assert f"your plan   #1: {rows[1]['tokens_per_s_per_gpu']:,.1f} tokens/s per GPU" in r.stdout
    assert f"the best plan found, #{adv['ranking'][0]}" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == ["advise.csv", "advise.html", "advise.json"]
    # advise.html marks each option at its best and the scenario's plan, and gives the command
    # that compares the best plans with it: each variant there is the plan it stands for
    traces = {t["name"]: t for t in scatter_figure(adv)["data"]}
    for o in adv["options"]:
        if o["best"] is not None:
            assert traces[f"the guide's \u201c{o['option']}\u201d"]["y"] == [rows[o["best"]]["tokens_per_s_per_gpu"]]
    assert traces["the scenario's plan"]["y"] == [rows[1]["tokens_per_s_per_gpu"]]
    # the capacity line the page's caption reads the points against is drawn, though the plan
    # that cannot fit was left out and every point lies well left of it
    layout = scatter_figure(adv)["layout"]
    cap = rows[1]["capacity_bytes"] / 2**30
    assert max(r["peak_bytes"] for r in adv["plans"] if r["status"] == "ok") / 2**30 < cap
    assert [sh["x0"] for sh in layout["shapes"]] == [cap] and layout["xaxis"]["range"][1] > cap
    cmd = compare_command(adv)
    assert html.escape(cmd) in (out / "advise.html").read_text()
    words = shlex.split(cmd)
    variants = [words[i + 1] for i, w in enumerate(words) if w == "--variant"]
    best = [n for n in adv["ranking"] if rows[n]["fits"] and n != 1][:len(variants)]
    assert len(variants) == 3 and words[4] == SMALL and words[-2:] == ["--out", "out/compare_best"]
    for text, n in zip(variants, best):
        s = clustersim.simulate(load_variant(root / SMALL, parse_changes(text, source="s", field="f"))).summary
        assert s["step_time_s"] == rows[n]["step_time_s"], (text, n)
        assert "null" not in text and "sp=false" not in text  # only what changes the scenario
    # and the command that runs the best plan that fits
    words = shlex.split(run_command(adv))
    top = next(n for n in adv["ranking"] if rows[n]["fits"])
    assert words[3:5] == ["run", SMALL] and words[-2:] == ["--out", f"out/best_plan_{top}"]
    s = clustersim.simulate(load_variant(root / SMALL, parse_changes(words[6], source="s", field="f"))).summary
    assert words[5] == "--set" and s["step_time_s"] == rows[top]["step_time_s"]
    # coarse to fine simulates fewer plans and finds the same best plan here
    coarse = run_advise(str(root / SMALL), budget=0)
    assert coarse["coarse_to_fine"] and len(coarse["plans"]) < len(adv["plans"])
    crow = {x["plan"]: x for x in coarse["plans"]}
    assert crow[coarse["ranking"][0]]["changes"] == best_changes(adv)


def best_changes(adv: dict) -> dict:
    return {x["plan"]: x for x in adv["plans"]}[adv["ranking"][0]]["changes"]


def test_advise_vary_and_bad_input(tmp_path, root):
    r = run_cli("advise", SMALL, "--vary", "parallel.tp=2,4", "--vary", "training.recompute=none", cwd=root)
    assert r.returncode == 0, r.stderr
    assert "searched    tp 2,4 · pp 1,2,4,8 · zero 1,2,3 · recompute none;" in r.stdout
    # every plan searched sets SP with its TP, which no column shows: its row says so, so that it can be
    # run again as printed (the scenario's own plan keeps the file's settings)
    rows = [ln for ln in r.stdout.splitlines() if ln.split() and ln.split()[0].isdigit()]
    assert len(rows) == 10 and all(ln.endswith("also parallel.sp=true") for ln in rows if "scenario's plan" not in ln)
    out = tmp_path / "x" / "y"
    for args, says in [
        (("--vary", "parallel.tpp=2"), "parallel.tpp: unknown key"),
        (("--vary", "training.recompute=none,ful"), "with training.recompute=ful: training.recompute: Input should be"),
        (("--vary", "parallel.tp=3"), "no plan of the search has degrees that multiply"),
        # every plan refused by a rule: said as such, not searched again with the optimizer offloaded
        # (the scenario's own plan aside, which keeps the file's microbatches)
        (("--vary", "training.micro_batch_size=3"), "--vary: the scenario's rules refuse every plan of the search ("),
        (("--vary", "training.micro_batch_size=3"), "training.global_batch_size: global_batch_size=32 is not a "
                                                    "multiple of dp*micro_batch_size"),
        (("--jobs", "0"), "--jobs: must be at least 1"),
    ]:
        r = run_cli("advise", SMALL, *args, "--out", out, cwd=root)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert not (tmp_path / "x").exists()


def test_advise_refuses_to_vary_the_model_the_cluster_or_the_batch(root):
    """``--vary model.layers=3,4`` (or cluster.gpu, the batch) ranked plans of different models
    or GPUs against each other ("the best plan gives 657 % more tokens/s"): refused by name,
    before any plan runs, from Python too; the plan's keys are still varied."""
    for v, what in (("model.layers=3,4", "the model"), ("cluster.gpu=H100,B200", "the cluster"),
                    ("cluster.nodes=1,2", "the cluster"), ("training.global_batch_size=32,64", "the batch"),
                    ("model=null", "the model")):
        r = run_cli("advise", SMALL, "--vary", v, cwd=root)
        key = v.split("=")[0]
        assert r.returncode == 2 and r.stderr == (
            f"error: command line: --vary: {key} changes {what}: advise ranks plans for the scenario's model, cluster "
            "and batch, which it keeps (sweep varies any key)\n"), r.stderr
    with pytest.raises(clustersim.ConfigError, match="model.hidden changes the model"):
        run_advise(str(root / SMALL), [("parallel.tp", [4]), ("model.hidden", [2048, 4096])])
    # a key that only begins as one of those is not one of them
    check_plan_keys([("modelx.a", [1]), ("training.global_batch_sizes", [1]), ("training.micro_batch_size", [1, 2])])


def test_advise_refuses_a_key_naming_no_field_up_front(root):
    """``--vary modelx.a=1,2`` is refused before the search, naming --vary, the key and the
    section the format does not have, with the nearest one (as sweep refuses it)."""
    r = run_cli("advise", SMALL, "--vary", "modelx.a=1,2", cwd=root)
    assert (r.returncode, r.stdout, r.stderr) == (
        2, "", "error: command line: --vary modelx.a: modelx: unknown key (did you mean 'model'? see docs/reference.md)\n")


def test_advise_refuses_to_vary_how_the_plans_are_simulated(root, tmp_path):
    """``--vary simulation.network=ideal`` (any simulation.* key) ranked the scenario's own
    plan, #1, simulated on the file's network against the others on another: refused by name,
    before any plan runs, from Python too, with what to do instead; nothing written."""
    for v in ("simulation.network=ideal", "simulation.network=flow,ideal", "simulation.collapse_symmetric=false",
              "simulation.repeat=true", "simulation.collectives.all_reduce=ring", "simulation={network: ideal}"):
        r = run_cli("advise", SMALL, "--vary", v, "--out", tmp_path / "x", cwd=root)
        key = v.split("=")[0]
        assert r.returncode == 2 and r.stderr == (
            f"error: command line: --vary: {key} changes how the plans are simulated, not the plan: advise ranks "
            "plans simulated alike (its plan #1 keeps the file's setting); set it in the scenario file for every "
            "plan (sweep --vary compares settings)\n"), r.stderr
        assert not (tmp_path / "x").exists()
    with pytest.raises(clustersim.ConfigError, match="simulation.network changes how the plans are simulated"):
        run_advise(str(root / SMALL), [("parallel.tp", [4]), ("simulation.network", ["ideal"])])
    check_plan_keys([("simulationx.a", [1])])  # (only begins as one: left to the unknown-key check)


def test_plans_of_other_schedules_and_dispatchers(root):
    """A custom schedule's file is not kept for another pipeline (1F1B instead); interleaving
    asked of a plain scenario gets vpp 2; DeepEP's plans with TP keep whole experts (etp 1); DeepEP and
    an FP8 dispatch leave EP 1 out."""
    path = root / "scenarios" / "custom_schedule.yaml"
    sc, data = clustersim.load_scenario(path), read_yaml(path, what="scenario")
    space = search_space(sc, data)
    assert space["parallel.schedule"] == ["1f1b"]
    plan = dict(plan_of(sc, data, {"parallel.pp": 1}, 1, set(space) - {"parallel.schedule"}).changes)
    assert plan["parallel.schedule"] == "1f1b" and plan["parallel.schedule_file"] is None
    path = root / SMALL
    sc, data = clustersim.load_scenario(path), read_yaml(path, what="scenario")
    plan = plan_of(sc, data, {"parallel.pp": 2, "parallel.schedule": "interleaved"}, 1, {"parallel.schedule"})
    assert dict(plan.changes)["parallel.vpp"] == 2
    from clustersim.overrides import load_variant

    assert load_variant(path, plan.changes).parallel.vpp == 2
    path = root / "scenarios" / "deepseek_v3_2048gpu.yaml"
    sc, data = clustersim.load_scenario(path), read_yaml(path, what="scenario")
    space = search_space(sc, data)
    assert 1 not in space["parallel.ep"]  # DeepEP dispatches over an EP group
    plan = plan_of(sc, data, {"parallel.tp": 2, "parallel.pp": 16, "parallel.ep": 64, "parallel.schedule": "dualpipe"},
                   1, set(space))
    assert dict(plan.changes)["parallel.etp"] == 1
    assert load_variant(path, plan.changes).parallel.expert_tp == 1
    # an FP8 dispatch over NCCL's all-to-all needs an EP group too; without it EP 1 is searched
    for fp8, ep1 in ((True, False), (False, True)):
        d = yaml.safe_load(path.read_text())
        d["model"]["moe"].update(dispatcher="alltoall", fp8_dispatch=fp8)
        d["model"]["moe"].pop("deepep_sms", None)
        assert (1 in search_space(clustersim.load_scenario(d, base_dir=path.parent), d)["parallel.ep"]) == ep1


def test_advise_odd_values_are_refused_by_name(root):
    """A degree that is no positive integer, or no integer, is refused before the search,
    naming the value and its field (as sweep does: sweep.check_keys); dp cannot be varied (it
    follows)."""
    for v, says in (("parallel.tp=0", "with parallel.tp=0: parallel.tp: Input should be greater than or equal to 1"),
                    ("parallel.zero=a,b", "with parallel.zero=a: parallel.zero: Input should be"),
                    ("parallel.cp=[1]", "with 'parallel.cp=[1]': parallel.cp: Input should be a valid integer")):
        r = run_cli("advise", SMALL, "--vary", v, cwd=root)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (v, r.stderr)
    r = run_cli("advise", SMALL, "--vary", "parallel.dp=1,2", cwd=root)
    assert r.returncode == 2 and "advise lets dp follow the other degrees" in r.stderr


def test_a_scenario_reducing_after_the_backward_keeps_its_zero3_plans(root, tmp_path):
    """ZeRO-3 reduce-scatters beside the backward: a scenario with overlap_grad_reduce false
    has its ZeRO-3 plans searched without it (refused, they hid every shape's other plans)."""
    data = read_yaml(root / SMALL, what="scenario")
    data["parallel"]["overlap_grad_reduce"] = False
    data["cluster"]["topology"] = str(root / "topologies" / "dgx-h100.yaml")
    path = tmp_path / "after.yaml"
    path.write_text(yaml.safe_dump(data))
    adv = run_advise(str(path), [("parallel.tp", [1]), ("parallel.pp", [1])])
    zero3 = [r for r in adv["plans"] if r["changes"].get("parallel.zero") == 3]
    assert zero3 and all(r["status"] == "ok" and r["changes"]["parallel.overlap_grad_reduce"] is None for r in zero3)
    others = [r for r in adv["plans"] if r["changes"].get("parallel.zero") in (1, 2)]
    assert others and all("parallel.overlap_grad_reduce" not in r["changes"] for r in others)


def test_plans_certain_not_to_fit_are_listed_not_simulated(root, tmp_path):
    """A plan whose memory floor (weights, gradients, optimizer states and the activations
    its schedule holds) exceeds the GPU is left out of the simulation and listed with its
    floor; simulated anyway (``--simulate-unfit``), it does not fit and peaks above the floor,
    and the plans that fit come out the same."""
    vary = [("parallel.tp", [1, 2]), ("parallel.pp", [1])]
    pruned = run_advise(str(root / SMALL), vary)
    whole = run_advise(str(root / SMALL), vary, prune=False)
    assert pruned["pruned"] and not whole["pruned"]
    unfit = [r for r in pruned["plans"] if r["status"] == "unfit"]
    assert unfit and all(r["plan"] != 1 for r in unfit)
    rows = {r["plan"]: r for r in whole["plans"]}
    for r in unfit:
        sim = rows[r["plan"]]
        assert r["changes"] == sim["changes"] and r["fits"] is False and sim["fits"] is False
        assert sim["capacity_bytes"] == r["capacity_bytes"] < r["floor_bytes"] <= sim["peak_bytes"]
        assert f"needs at least {r['floor_bytes'] / 2**30:.1f} GiB a GPU" in r["reason"]
        assert "step_time_s" not in r and "peak_bytes" not in r
    # the plans that fit: the same rows, the same ranking
    assert [n for n in whole["ranking"] if rows[n]["fits"]] == pruned["ranking"]
    for r in pruned["plans"]:
        if r["status"] == "ok":
            assert r == rows[r["plan"]]
    # an option whose plans are all left out is said not to fit, not to be missing
    for o, w in zip(pruned["options"], whole["options"]):
        assert (o["option"], o["best"], o["plans"]) == (w["option"], w["best"], w["plans"])
    out = tmp_path / "adv"
    r = run_cli("advise", SMALL, "--vary", "parallel.tp=1,2", "--vary", "parallel.pp=1", "--out", out, cwd=root)
    assert r.returncode == 0, r.stderr
    assert f"certain not to fit in memory, not simulated: {len(unfit)} of {len(pruned['plans'])}" in r.stdout
    assert unfit[0]["reason"] in r.stdout
    page = (out / "advise.html").read_text()
    assert "Certain not to fit in memory, not simulated" in page and html.escape(unfit[0]["reason"]) in page
    assert "unfit" in (out / "advise.csv").read_text()


def test_a_verdict_over_a_close_estimated_step_says_it_may_not_hold(root):
    """Where a plan that would turn the verdict (any outside the guide's option the best plan
    is, or any of the guide's options where it is none) gives less than CLOSE_LEAD fewer
    tokens/s than the best plan, and its step or the best plan's is an estimate, the verdict
    says it may not hold, naming the nearest such plan; a wider gap, exact steps, or a close
    plan of the same option say nothing more."""
    import copy

    from clustersim.advise import format_advice
    from clustersim.output.summary import CLOSE_LEAD

    adv = run_advise(str(root / SMALL), [("parallel.tp", [2, 4, 8]), ("parallel.pp", [1])])
    rows = {r["plan"]: r for r in adv["plans"]}
    fit = [rows[n]["plan"] for n in adv["ranking"] if rows[n]["fits"]]
    best = fit[0]
    assert len(fit) > 3 and not any(rows[n].get("estimate") for n in fit)  # (one node: every step exact)
    # as it is, the best plan is none of the guide's options: any option's plan turns it
    assert all(o["best"] != best for o in adv["options"]) and not rows[best]["guide_options"]
    guides = [n for n in fit if rows[n]["guide_options"]]
    # and made the guide's first option, with the next plan: the one after that turns it
    as_option = copy.deepcopy(adv)
    name = as_option["options"][0]["option"]
    as_option["options"][0]["best"] = best
    made = {r["plan"]: r for r in as_option["plans"]}
    for n in fit:
        made[n]["guide_options"] = [name] if n in fit[:2] else []
    tail = "(some communications at their slowest twin's pace); run --set with"

    def told(a: dict, gaps: dict[int, float], flagged: tuple[int, ...]) -> list[str]:
        a = copy.deepcopy(a)
        r = {x["plan"]: x for x in a["plans"]}
        for n, gap in gaps.items():  # (in the ranking's order, as a ranking would put them)
            r[n]["tokens_per_s"] = r[best]["tokens_per_s"] * (1 - gap)
        for n in flagged:
            r[n]["estimate"] = True
        return [x.strip() for x in format_advice(a).splitlines() if "may not hold" in x]

    near, far = CLOSE_LEAD / 4, CLOSE_LEAD / 2
    for a, (rival, other) in ((adv, guides[:2]), (as_option, fit[2:4])):
        assert told(a, {rival: near}, (best,)) == [
            f"the verdict may not hold: #{rival} gives {100 * near:.1f} % fewer tokens/s than #{best}, and #{best}'s "
            f"step is an estimate {tail} its settings and --all-ranks checks it"]
        assert told(a, {rival: near}, (rival, best))[0].endswith(
            f"and #{best}'s and #{rival}'s steps are estimates {tail} their settings and --all-ranks checks them")
        assert told(a, {rival: 0.0}, (rival,))[0].startswith(f"the verdict may not hold: #{rival} is level with #{best}")
        # the nearest plan exact, the next close one an estimate: that one may turn it
        assert told(a, {rival: near, other: far}, (other,)) == [
            f"the verdict may not hold: #{other} gives {100 * far:.1f} % fewer tokens/s than #{best}, and #{other}'s "
            f"step is an estimate {tail} its settings and --all-ranks checks it"]
        assert told(a, {rival: 2 * CLOSE_LEAD, other: 3 * CLOSE_LEAD}, (best, rival, other)) == []  # wide gaps
        assert told(a, {rival: near}, ()) == []  # exact steps
    assert told(as_option, {fit[1]: near}, (best, fit[1])) == []  # the same option's: the verdict holds


def test_the_scenarios_plan_is_simulated_once(root, tmp_path):
    """Where the search holds the scenario's own plan (the file's values of every dimension
    and the settings a plan of that shape takes), #1 stands for it: no other plan makes the
    same scenario, in either round of coarse to fine (advise listed it twice, #1 and #16,
    the same figures on two rows)."""
    from clustersim.config import ScenarioCfg
    from clustersim.overrides import apply_changes

    data = read_yaml(root / SMALL, what="scenario")
    data["cluster"]["topology"] = str(root / "topologies" / "dgx-h100.yaml")
    # only ZeRO-3: TP 1, PP 1, recompute none, all in the search; SP off as a plan without TP
    # has it, spelt out (a plan removes the key: the same setting)
    data["parallel"] = {"dp": 8, "zero": 3, "sp": False}
    path = tmp_path / "zero3.yaml"
    path.write_text(yaml.safe_dump(data))
    for budget in (200, 0):
        adv = run_advise(str(path), [("parallel.tp", [1, 2]), ("parallel.pp", [1, 2])], budget=budget)
        made = [ScenarioCfg.model_validate(apply_changes(data, list(r["changes"].items()), source="s")).model_dump()
                for r in adv["plans"]]
        assert all(made.count(m) == 1 for m in made), budget
        assert [r["plan"] for r in adv["plans"]] == list(range(1, len(adv["plans"]) + 1))
        if budget:
            assert adv["searched"] == len(adv["plans"])  # (every plan searched, #1 counted once)
        # the shape of #1 searched with its other settings all the same
        assert sum(r["changes"].get("parallel.tp") == 1 and r["changes"].get("parallel.pp") == 1
                   for r in adv["plans"]) == 6, budget  # zero 1-3 x recompute none, full


def test_a_close_call_between_exact_steps_names_the_nearest_plan_and_both_peaks(root):
    """Where the steps are exact but a plan that would turn the verdict gives less than
    CLOSE_LEAD fewer tokens/s than the best plan, the verdict says so, with both plans' peak
    memory; nothing where the gap is wider, and the estimates' line where a step is one."""
    import copy

    from clustersim.advise import format_advice
    from clustersim.output.summary import CLOSE_LEAD

    adv = run_advise(str(root / SMALL), [("parallel.tp", [2, 4, 8]), ("parallel.pp", [1])])
    rows = {r["plan"]: r for r in adv["plans"]}
    fit = [n for n in adv["ranking"] if rows[n]["fits"]]
    best, rival = fit[0], next(n for n in fit if rows[n]["guide_options"])  # (the best plan is none of them)

    def said(gap: float, estimate: bool = False) -> list[str]:
        a = copy.deepcopy(adv)
        r = {x["plan"]: x for x in a["plans"]}
        r[rival]["tokens_per_s"] = r[best]["tokens_per_s"] * (1 - gap)
        r[best]["estimate"] = estimate
        lines = format_advice(a).splitlines()
        return [x.strip() for x in lines[next(i for i, x in enumerate(lines) if x.startswith("verdict")) + 1:]
                if not x.startswith("simulated")]

    gib = 2 ** 30
    assert said(CLOSE_LEAD / 4) == [
        f"a close call: #{rival} gives {100 * CLOSE_LEAD / 4:.1f} % fewer tokens/s than #{best}, less than what the "
        f"simulation leaves out (kernel launches, the framework) may move; #{rival} peaks at "
        f"{rows[rival]['peak_bytes'] / gib:.1f} GiB, #{best} at {rows[best]['peak_bytes'] / gib:.1f} of "
        f"{rows[best]['capacity_bytes'] / gib:.0f} GiB"]
    assert said(0.0)[0].startswith(f"a close call: #{rival} is level with #{best}, ")
    assert said(2 * CLOSE_LEAD) == []
    assert said(CLOSE_LEAD / 4, estimate=True)[0].startswith(f"the verdict may not hold: #{rival} ")


def test_zero_stages_with_nothing_to_shard_are_one_plan_without_zero(root):
    """Where a plan's ZeRO shard groups are one GPU each (DP x CP 1, the experts' DP group 1),
    every ZeRO stage is the plan without ZeRO: it is searched once, as zero 0 (advise listed
    TP8 x DP1 as ZeRO-3 beside the scenario's own TP8 x DP1, the same figures on two rows).
    Where folded experts still shard (expert TP under TP: their DP group spans the TP ranks),
    the stages stay apart."""
    from clustersim.advise import _shards_nothing
    from clustersim.sweep import Plan

    path = root / "scenarios" / "korthikanti_22b_seqsel.yaml"  # TP8 x DP1, selective recompute
    data = read_yaml(path, what="scenario")
    for budget in (200, 0):
        adv = run_advise(str(path), [("parallel.tp", [8]), ("parallel.pp", [1])], budget=budget)
        zeros = [values_of(r, data["parallel"], data["training"])["zero"] for r in adv["plans"]]
        assert zeros == [0] * len(adv["plans"]), budget
        # one plan a recompute setting (none, selective: the scenario's own, full), none twice
        recomputes = sorted(values_of(r, data["parallel"], data["training"])["recompute"] for r in adv["plans"])
        assert recomputes == ["full", "none", "selective"], budget
    moe = root / "scenarios" / "moe_1024gpu.yaml"
    moe_data = read_yaml(moe, what="scenario")
    one_node = [("cluster.nodes", 1), ("parallel.tp", 8), ("parallel.pp", 1), (DP, 1), ("parallel.ep", 1),
                ("parallel.schedule", "1f1b"), ("parallel.vpp", None), ("parallel.overlap_param_gather", None)]
    assert _shards_nothing(str(moe), moe_data, Plan(0, one_node))
    # experts split over single GPUs (etp 1) under TP 8: their DP group is the 8 TP ranks
    assert not _shards_nothing(str(moe), moe_data, Plan(0, one_node + [("parallel.etp", 1)]))


def test_a_zero3_option_says_its_microbatches_gather_again():
    """Where an option's best plan runs ZeRO-3 in several microbatches and the micro batch
    size is not searched, advise's line says each gathers every layer again (the option
    stands at the scenario's micro batch size: docs/parallelism.md, Llama-2 70B's TP8 x DP8
    ZeRO-3 2.4x faster in microbatches of 8); not for one microbatch, another ZeRO stage, a
    searched micro batch size or weights kept gathered."""
    from clustersim.advise import _zero3_microbatches

    row = {"changes": {"parallel.tp": 8, "parallel.pp": 1, "parallel.zero": 3, "parallel.dp": 8}}
    space = {"parallel.tp": [1, 8]}
    assert _zero3_microbatches(row, {}, {}, 1, 128, space) == 16
    assert _zero3_microbatches(row, {}, {}, 16, 128, space) is None  # one microbatch a step
    assert _zero3_microbatches({"changes": {**row["changes"], "parallel.zero": 1}}, {}, {}, 1, 128, space) is None
    assert _zero3_microbatches(row, {}, {}, 1, 128, {**space, "training.micro_batch_size": [1, 4]}) is None
    assert _zero3_microbatches(row, {"zero3_keep_gathered": True}, {}, 1, 128, space) is None
    assert _zero3_microbatches({"changes": {**row["changes"], "training.global_batch_size": 256}}, {}, {}, 1, 128,
                               space) == 32


def test_options_this_gpu_count_cannot_hold_are_said_so(root, tmp_path):
    """On 8 GPUs a 13B model's rule ("use more than 8 GPUs") lists TP=8 with PP and with DP,
    which need 16 GPUs: the options' lines say so, not "not among the plans simulated", and
    the guide's line says the case has 8 GPUs; plans of TP=8 with several stages or replicas
    need twice a node's GPUs (a node of 4: 8)."""
    from clustersim.advise import format_advice

    rule = guide_rule(13e9, 8, 8)
    assert [o.least_gpus for o in rule.options] == [16, 16, 1, 16, 4]
    assert [o.least_gpus for o in guide_rule(13e9, 8, 4).options][:2] == [8, 8]
    d = read_yaml(root / SMALL, what="scenario")
    d["cluster"]["topology"] = str(root / "topologies/dgx-h100.yaml")
    d["model"].update(layers=40, hidden=5120, heads=40, ffn_hidden=13824)  # 13B
    d["model"].pop("n_kv_heads", None)
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(d))
    advice = run_advise(str(tmp_path / "s.yaml"), [("parallel.tp", [1, 2]), ("parallel.pp", [1, 2]),
                                                   ("parallel.zero", [3]), ("training.recompute", ["full"])])
    text = format_advice(advice)
    assert "  TP=8 and PP         needs 16 GPUs or more, the case has 8" in text
    assert "not among the plans simulated" not in text.split("the guide's options")[1].split("TP=8 with DP")[0]
    assert "(the case has 8 GPUs, not more than 8" in text


def test_where_nothing_fits_the_optimizer_goes_to_the_host(root, tmp_path):
    """Llama-2 70B on one DGX H100: no plan of the search fits with Adam's states on the GPUs,
    so advise searches again with them in host memory (the topology has a host), says so, and
    ranks plans that fit; where the topology has no host, it stops at "no plan fits"."""
    doc = read_yaml(root / "scenarios/offload_llama2_70b_8gpu.yaml", what="scenario")
    for key in ("optimizer_offload", "overlap_offload_copies"):
        del doc["training"][key]
    doc["cluster"]["topology"] = str(root / "topologies/dgx-h100.yaml")
    path = tmp_path / "70b.yaml"
    path.write_text(yaml.safe_dump(doc))
    vary = [("parallel.tp", [1, 8]), ("parallel.pp", [1])]
    advice = run_advise(str(path), vary)
    fb = advice["offload_fallback"]
    assert fb is not None and fb["searched"] > 0
    rows = {r["plan"]: r for r in advice["plans"]}
    best = rows[advice["ranking"][0]]
    assert best["fits"] and dict(best["changes"])["training.optimizer_offload"] == 1.0
    assert not rows[advice["own_plan"]]["fits"]  # the file's plan, as it is
    assert all(dict(r["changes"]).get("training.optimizer_offload") == 1.0 for n, r in rows.items()
               if n != advice["own_plan"])
    text = clustersim.advise.format_advice(advice)
    assert "searched again with the optimizer states in host memory" in text
    assert "gives" in text and "fewer tokens/s, and fits" in text  # (the file's faster plan does not fit)
    for change in ({"cluster": {**doc["cluster"], "node": {"host": None}}},  # no host to offload to
                   {"training": {**doc["training"], "optimizer_moments_dtype": "bf16"}}):  # moments it refuses
        path.write_text(yaml.safe_dump({**doc, **change}))
        plain = run_advise(str(path), vary)
        assert plain["offload_fallback"] is None and not any(r.get("fits") for r in plain["plans"])
        assert "no plan searched fits in memory" in clustersim.advise.format_advice(plain)


def test_a_scenario_that_offloads_keeps_its_plans_without_dp(root):
    """A file that offloads its optimizer already: a plan whose ZeRO shards nothing (DP 1) is
    searched with ZeRO-1 (Megatron-LM's distributed optimizer, which the offload needs), not
    refused as ZeRO-0; no second search."""
    advice = run_advise(str(root / "scenarios/offload_llama2_70b_8gpu.yaml"),
                        [("parallel.tp", [4, 8]), ("parallel.pp", [1, 2])])
    assert advice["offload_fallback"] is None
    assert not [r for r in advice["plans"] if r["status"] == "refused"]
    dp1 = [r for r in advice["plans"] if dict(r["changes"]).get("parallel.dp") == 1]
    assert dp1 and all(dict(r["changes"]).get("parallel.zero") == 1 for r in dp1 if r["plan"] != advice["own_plan"])
    assert any(r.get("fits") for r in dp1)


def test_a_scenario_offloading_activations_drops_it_where_a_plan_cannot(root, tmp_path):
    """A file with activation offload (one stage, no recompute only): advise keeps it on the
    plans that can run it and drops it from the others (a pipeline, recompute) instead of
    counting them refused."""
    doc = read_yaml(root / SMALL, what="scenario")
    doc["cluster"]["topology"] = str(root / "topologies/dgx-h100.yaml")
    doc["parallel"] = {"tp": 4, "pp": 1, "dp": 2, "sp": True}
    doc["training"]["activation_offload_layers"] = 8
    path = tmp_path / "acts.yaml"
    path.write_text(yaml.safe_dump(doc))
    advice = run_advise(str(path), [("parallel.tp", [4]), ("parallel.pp", [1, 2])])
    assert not [r for r in advice["plans"] if r["status"] == "refused"]
    kept = {r["plan"]: dict(r["changes"]) for r in advice["plans"]}
    for n, ch in kept.items():
        dropped = ch.get("training.activation_offload_layers", "kept") is None
        assert dropped == (ch.get("parallel.pp", 1) != 1 or ch.get("training.recompute", "none") != "none"), ch


def test_the_files_own_degrees_are_searched_and_its_plan_listed_once(root, tmp_path):
    """A file's CP 2 at 8K tokens (CP 1 alone is searched there) is tried on every shape beside
    CP 1, not kept silently in every plan; its selective recompute, which recomputes nothing
    under flash attention, makes the plan without recompute, listed once (as #1); its ``sp:
    true`` is not shown as a change a plan makes."""
    from clustersim.sweep import also_set

    d = read_yaml(root / SMALL, what="scenario")
    d["cluster"]["topology"] = str(root / "topologies/dgx-h100.yaml")
    d["parallel"].update(cp=2, dp=1, sp=True, zero=1)
    d["training"]["recompute"] = "selective"
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(d))
    sc = clustersim.load_scenario(tmp_path / "s.yaml")
    assert search_space(sc, d)["parallel.cp"] == [1, 2]
    advice = run_advise(str(tmp_path / "s.yaml"), [("parallel.tp", [4]), ("parallel.pp", [1])])
    assert advice["vary"]["parallel.cp"] == [1, 2]
    rows = [r for r in advice["plans"] if r["status"] == "ok"]
    cps = {dict(r["changes"])["parallel.cp"] for r in rows}
    assert cps == {1, 2}
    same = [r["plan"] for r in rows if {k: v for k, v in dict(r["changes"]).items() if k != DP} ==
            {"parallel.tp": 4, "parallel.pp": 1, "parallel.cp": 2, "parallel.zero": 1, "training.recompute": "none"}]
    assert same == [], same  # (the file's plan, #1, stands for it)
    own = next(r for r in rows if r["plan"] == advice["own_plan"])
    alike = [r["plan"] for r in rows if r["plan"] != own["plan"] and r["step_time_s"] == own["step_time_s"]
             and r["peak_bytes"] == own["peak_bytes"]]
    assert alike == []
    assert not any("parallel.sp" in also_set(advice, r) for r in rows)


def test_a_best_plan_running_zero2_under_a_pipeline_says_who_does_not_run_it():
    """ZeRO-2 with PP is simulated (gradients reduce-scattered every microbatch) and may come out
    best, but DeepSpeed's pipeline engine refuses it and Megatron-LM's distributed optimizer is
    ZeRO-1: the advice says so and names the best plan without it; nothing for other plans."""
    from clustersim.advise import zero2_under_pp

    def row(n, zero, pp, tps, fits=True):
        return {"plan": n, "changes": {"parallel.zero": zero, "parallel.pp": pp}, "fits": fits, "tokens_per_s": tps}

    best, unfit, alt = row(61, 2, 2, 1000.0), row(3, 1, 2, 990.0, fits=False), row(66, 1, 4, 971.0)
    said = zero2_under_pp(best, [best, unfit, row(7, 2, 4, 980.0), alt])
    assert said.startswith("#61 runs ZeRO-2 under a pipeline") and "DeepSpeed's pipeline engine refuses" in said
    assert said.endswith("the best plan without it, #66, gives 2.9 % fewer tokens/s than #61"), said
    assert zero2_under_pp(best, [best]).endswith("no plan without it fits")
    assert zero2_under_pp(row(5, 2, 1, 1000.0), []) == ""  # no pipeline: ZeRO-2 as everyone runs it
    assert zero2_under_pp(row(5, 1, 4, 1000.0), []) == ""


def test_an_unfit_plan_of_the_scenario_is_compared_as_if_it_fit(root):
    """The scenario's own plan that does not fit has the tokens/s it would give if it did: the
    best plan's gain over it says so ("would still give"), not as over a plan that runs; the
    searched line writes values as --vary does (true, not True)."""
    import copy

    from clustersim.advise import format_advice

    adv = run_advise(str(root / SMALL), [("parallel.tp", [2, 4]), ("parallel.pp", [1]),
                                         ("parallel.tp_comm_overlap", [False, True])])
    assert "tp_comm_overlap false,true" in format_advice(adv)
    a = copy.deepcopy(adv)
    rows = {r["plan"]: r for r in a["plans"]}
    best = next(n for n in a["ranking"] if rows[n]["fits"])
    assert best != 1
    rows[1]["fits"] = False
    line = next(x for x in format_advice(a).splitlines() if x.startswith("your plan"))
    gain = rows[best]["tokens_per_s"] / rows[1]["tokens_per_s"] - 1
    assert line.endswith(f"(does not fit); if it did, the best plan found, #{best}, would still give "
                         f"{100 * gain:.1f} % more tokens/s"), line
    rows[1]["fits"] = True
    line = next(x for x in format_advice(a).splitlines() if x.startswith("your plan"))
    assert line.endswith(f"; the best plan found, #{best}, gives {100 * gain:.1f} % more tokens/s"), line


def test_the_levers_left_out_of_the_search_are_said_with_their_values(root):
    """The schedule, CP, TP communication overlap and the micro batch size, where the search
    keeps them at the scenario's values, are listed as kept (advise.json's ``kept``); a lever
    --vary searches is not."""
    from clustersim.advise import LEVERS, format_advice

    adv = run_advise(str(root / SMALL), [("parallel.tp", [4]), ("parallel.pp", [1]),
                                         ("training.micro_batch_size", [1, 2])])
    assert adv["kept"] == {"parallel.schedule": "1f1b", "parallel.cp": 1, "parallel.tp_comm_overlap": False}
    assert set(adv["kept"]) < set(LEVERS)
    line = next(x for x in format_advice(adv).splitlines() if x.startswith("kept"))
    assert line == "kept        schedule 1f1b · cp 1 · tp_comm_overlap false as the scenario has them (--vary searches them)"
