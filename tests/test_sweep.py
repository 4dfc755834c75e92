"""``clustersim sweep``: every combination of the values given, simulated as ``run`` would,
ranked, the same whatever the number of processes, and bad input refused."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

import pytest

import clustersim
from clustersim.errors import ConfigError
from clustersim.output.plans_page import lines_figure, scatter_figure, split_figure
from clustersim.overrides import load_variant
from clustersim.sweep import Plan, parse_vary, plans_of, ranking, split_values, with_dp

from .conftest import offline_page
from .test_cli import run_cli

ZERO3 = "scenarios/zero3_llama3_8b_16gpu.yaml"


def test_split_and_parse_values():
    assert split_values("1,2,[4, 4],'a,b',{x: 1, y: 2}") == ["1", "2", "[4, 4]", "'a,b'", "{x: 1, y: 2}"]
    assert parse_vary("parallel.layers_per_stage=[10,22],[16,16]") == (
        "parallel.layers_per_stage", [[10, 22], [16, 16]])
    assert parse_vary("training.recompute=selective, full") == ("training.recompute", ["selective", "full"])
    for text, says in [("parallel.tp", "is not KEY=V1,V2"), ("parallel.tp=1,,2", "an empty value"),
                       ("parallel.tp=1,1", "given twice"), ("p..tp=1", "dotted key"),
                       ("parallel.tp=[1", "is not a YAML value")]:
        with pytest.raises(ConfigError) as e:
            parse_vary(text)
        assert says in e.value.message and e.value.field == f"--vary {text!r}"


def test_plans_are_the_product_first_key_slowest():
    got = plans_of([("a", [1, 2]), ("b", ["x", "y", "z"])])
    assert [p.number for p in got] == list(range(1, 7))
    assert [p.changes for p in got[:4]] == [[("a", 1), ("b", "x")], [("a", 1), ("b", "y")], [("a", 1), ("b", "z")],
                                             [("a", 2), ("b", "x")]]


def test_dp_follows_the_other_degrees():
    data = {"cluster": {"nodes": 2}, "parallel": {"tp": 1, "pp": 1, "dp": 16}}
    plan, why = with_dp(data, Plan(1, [("parallel.pp", 4)]), 8, 2)
    assert why is None and plan.changes == [("parallel.pp", 4), ("parallel.dp", 4)]
    plan, why = with_dp(data, Plan(2, [("parallel.tp", 2), ("cluster.nodes", 4)]), 8, 2)
    assert plan.changes[-1] == ("parallel.dp", 16)
    _, why = with_dp(data, Plan(3, [("parallel.pp", 3)]), 8, 2)
    assert why == "parallel: tp x pp x cp = 1 x 3 x 1 = 3 does not divide the 16 GPUs"


def test_ranking_fits_first_then_tokens():
    rows = [{"plan": 1, "status": "ok", "fits": False, "tokens_per_s": 9.0},
            {"plan": 2, "status": "ok", "fits": True, "tokens_per_s": 1.0},
            {"plan": 3, "status": "refused"},
            {"plan": 4, "status": "ok", "fits": True, "tokens_per_s": 2.0},
            {"plan": 5, "status": "ok", "fits": True, "tokens_per_s": 2.0}]
    assert ranking(rows) == [4, 5, 2, 1]


def test_sweep_zero3_against_a_pipeline(tmp_path, root):
    outs = []
    for jobs in (1, 2):
        out = tmp_path / f"j{jobs}"
        r = run_cli("sweep", ZERO3, "--vary", "parallel.pp=1,2,3,4", "--vary", "parallel.zero=1,3", "--jobs", jobs,
                    "--out", out, cwd=root)
        assert r.returncode == 0, r.stderr
        outs.append((out, r.stdout))
    (out, stdout), (out2, _) = outs
    # the files do not depend on the processes
    for name in ("sweep.json", "sweep.csv", "sweep.html"):
        assert (out / name).read_bytes() == (out2 / name).read_bytes()
    sweep = json.loads((out / "sweep.json").read_text())
    assert sweep["dp_follows"] and sweep["vary"] == {"parallel.pp": [1, 2, 3, 4], "parallel.zero": [1, 3]}
    rows = {r["plan"]: r for r in sweep["plans"]}
    assert sorted(rows) == list(range(1, 9))
    refused = [r for r in sweep["plans"] if r["status"] == "refused"]
    assert [r["changes"]["parallel.pp"] for r in refused] == [3, 3]
    assert all("does not divide the 16 GPUs" in r["reason"] for r in refused)
    ok = [r for r in sweep["plans"] if r["status"] == "ok"]
    assert all(r["changes"]["parallel.dp"] == 16 // r["changes"]["parallel.pp"] for r in ok)
    # ranked: those that fit by tokens/s, then the others
    ranked = [rows[n] for n in sweep["ranking"]]
    assert sorted(n for n in sweep["ranking"]) == sorted(r["plan"] for r in ok)
    fits = [r["fits"] for r in ranked]
    assert fits == sorted(fits, reverse=True)
    for a, b in zip(ranked, ranked[1:]):
        assert a["fits"] != b["fits"] or a["tokens_per_s"] >= b["tokens_per_s"]
    # each row is what simulating that variant gives
    pick = rows[4]  # pp 2, ZeRO-3
    s = clustersim.simulate(load_variant(root / ZERO3, list(pick["changes"].items()))).summary
    assert pick["step_time_s"] == s["step_time_s"] and pick["peak_bytes"] == s["memory"]["peak_bytes"]
    assert pick["estimate"] is (s["simulation"]["asymmetric_orbits"] is not None)  # (a row of its own summary)
    assert all(isinstance(r["estimate"], bool) for r in ok) and not any("estimate" in r for r in refused)
    assert pick["changes"] == {"parallel.pp": 2, "parallel.zero": 3, "parallel.dp": 8}
    # a pipeline's bubble grows with pp at the same batch; ZeRO-3 saves memory over ZeRO-1
    z1 = {r["changes"]["parallel.pp"]: r for r in ok if r["changes"]["parallel.zero"] == 1}
    assert z1[1]["bubble_fraction"] < z1[2]["bubble_fraction"] < z1[4]["bubble_fraction"]
    z3 = {r["changes"]["parallel.pp"]: r for r in ok if r["changes"]["parallel.zero"] == 3}
    assert all(z3[p]["peak_bytes"] < z1[p]["peak_bytes"] for p in (1, 2, 4))
    # the csv has a line per plan, the terminal the ranking
    lines = list(csv.DictReader(io.StringIO((out / "sweep.csv").read_text())))
    assert [int(x["plan"]) for x in lines] == list(range(1, 9))
    assert lines[3]["parallel.dp"] == "8" and float(lines[3]["step_time_s"]) == pick["step_time_s"]
    assert lines[3]["estimate"] == str(pick["estimate"]) and list(lines[3])[-1] == "estimate"  # (the last column)
    assert all(x["estimate"] == "" for x in lines if x["status"] == "refused")
    table = stdout.splitlines()
    first = table.index(next(x for x in table if x.lstrip().startswith("#")))
    assert [int(x.split()[0]) for x in table[first + 1:first + 1 + len(ok)]] == sweep["ranking"]
    assert "refused by the scenario's rules: 2 of 8" in stdout
    # sweep.html: every plan simulated a point, the best plans' steps split, each refused plan's rule
    scatter = scatter_figure(sweep)
    assert [t["name"] for t in scatter["data"] if t.get("showlegend", True)] == ["fits", "does not fit"] or all(
        r["fits"] for r in ok)
    points = {(x, y) for t in scatter["data"] if t["name"] in ("fits", "does not fit") for x, y in zip(t["x"], t["y"])}
    assert points == {(r["peak_bytes"] / 2**30, r["tokens_per_s_per_gpu"]) for r in ok}
    key, lines = lines_figure(sweep)  # along pp (the first numeric key), a line per ZeRO stage
    drawn = _lines_drawn(lines)
    assert key == "parallel.pp" and sorted(t["name"] for t in drawn) == ["zero=1", "zero=3"]
    for t in drawn:
        zero = int(t["name"].split("=")[1])
        mine = sorted((r for r in ok if r["changes"]["parallel.zero"] == zero), key=lambda r: r["changes"]["parallel.pp"])
        assert t["x"] == [r["changes"]["parallel.pp"] for r in mine]
        assert t["y"] == [r["tokens_per_s_per_gpu"] for r in mine]
        # the plans that do not fit are drawn hollow over the line, in its colour, out of the legend
        hollow = [h for h in lines["data"] if h["legendgroup"] == t["name"] and h is not t]
        unfit = [r for r in mine if not r["fits"]]
        assert [(x, y) for h in hollow for x, y in zip(h["x"], h["y"])] == \
            [(r["changes"]["parallel.pp"], r["tokens_per_s_per_gpu"]) for r in unfit]
        assert all(h["marker"]["line"]["color"] == t["line"]["color"] and not h["showlegend"] for h in hollow)
    split = split_figure(sweep)
    for i, n in enumerate(sweep["ranking"]):
        assert sum(t["x"][i] for t in split["data"]) == pytest.approx(rows[n]["step_time_s"], rel=1e-9)
        assert split["data"][0]["y"][i].startswith(f"#{n} ")
    page = (out / "sweep.html").read_text()
    assert page.count("does not divide the 16 GPUs") == 2 + stdout.count("does not divide the 16 GPUs")
    # the plan that is the file as it is (pp 1, ZeRO-3, dp 16) is starred and noted
    own = next(r for r in ok if r["changes"] == {"parallel.pp": 1, "parallel.zero": 3, "parallel.dp": 16})
    star = next(t for t in scatter["data"] if t["name"] == "the scenario's plan")
    assert star["y"] == [own["tokens_per_s_per_gpu"]] and "the star is the scenario as its file has it" in page
    # its number stands clear of the star, twice as far as the other points' numbers
    label = next(a for a in scatter["layout"]["annotations"] if a.get("text") == f"#{own['plan']}")
    others = [a for a in scatter["layout"]["annotations"] if a.get("text", "").startswith("#") and a is not label]
    assert abs(label.get("xshift", 0)) + label.get("yshift", 0) == 12
    assert all(abs(a.get("xshift", 0)) + a.get("yshift", 0) == 6 for a in others)
    ranked_table = page.split("Every plan simulated")[1].split("Refused by")[0]
    assert f"<td>{own['plan']}</td>" in ranked_table and "the scenario&#x27;s plan" in ranked_table
    assert stdout.strip().splitlines()[0] in page
    assert [int(x) for x in re.findall(r"<tr(?: class=\"nofit\")?><td>(\d+)</td>", ranked_table)] == sweep["ranking"]
    with offline_page(out / "sweep.html", "#plans-split .main-svg") as (browser_page, errors):
        drawn = browser_page.evaluate("document.getElementById('plans-scatter').data"
                                      ".filter(t => t.name !== \"the scenario's plan\").map(t => t.x.length)")
    assert errors == [] and sum(drawn) == len(ok)


def test_the_scatter_numbers_plans_faster_than_any_that_fits(tmp_path, root):
    """Plain DP and TP2 on Llama-3 8B run faster than TP4 and TP8 but do not fit: their points,
    past the capacity line (plain DP's at the plot's edge, drawn whole), are numbered too, as
    the best plans that fit are: which plan is the fast point a user sees there?"""
    from clustersim.output.plans_page import scatter_figure

    r = run_cli("sweep", "scenarios/llama3_8b_8gpu.yaml", "--vary", "parallel.tp=1,2,4,8", "--out", tmp_path, cwd=root)
    assert r.returncode == 0, r.stderr
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    ok = [p for p in sweep["plans"] if p["status"] == "ok"]
    top = max(p["tokens_per_s_per_gpu"] for p in ok if p["fits"])
    faster = [p for p in ok if not p["fits"] and p["tokens_per_s_per_gpu"] > top]
    scatter = scatter_figure(sweep)
    numbered = {a["text"] for a in scatter["layout"]["annotations"] if a.get("text", "").startswith("#")}
    assert len(faster) == 2 and {f"#{p['plan']}" for p in ok} <= numbered
    edge = [t for t in scatter["data"] if t.get("marker", {}).get("symbol") == "triangle-right"]
    assert edge and all(t["cliponaxis"] is False for t in edge)


@pytest.mark.parametrize("name", ["llama3_8b_8gpu", "zero3_llama3_8b_16gpu", "dualpipe", "interleaved_1f1b",
                                  "long_context_cp_128k"])
def test_a_brief_summary_has_every_figure_of_the_whole_one(root, name):
    """simulate(brief=True), as a sweep's plans are simulated: the summary less the critical
    path, the causes of exposed communication and the link use, everything else equal."""
    path = root / "scenarios" / f"{name}.yaml"
    whole = clustersim.simulate(clustersim.load_scenario(path)).summary
    brief = clustersim.simulate(clustersim.load_scenario(path), brief=True).summary
    left_out = ("critical_path", "exposed_comm_causes", "links")
    assert all(brief[k] is None for k in left_out) and all(whole[k] for k in ("critical_path", "links"))
    assert {k: v for k, v in brief.items() if k not in left_out} == {k: v for k, v in whole.items() if k not in left_out}


def test_sweep_bad_input_writes_nothing(tmp_path, root):
    out = tmp_path / "x" / "y"
    for args, says in [
        ((), "give what to vary"),
        (("--vary", "parallel.pp=1,2", "--vary", "parallel.pp=4"), "parallel.pp is varied twice"),
        (("--vary", "parallel.ppp=1,2"), "parallel.ppp: unknown key"),
        # a value the field never takes, among good ones: refused before any plan runs, not a row
        (("--vary", "parallel.pp=1,x"), "with parallel.pp=x: parallel.pp: Input should be a valid integer"),
        (("--vary", "parallel.schedule=1f1b,gpipee"), "with parallel.schedule=gpipee: parallel.schedule: Input should be"),
        (("--vary", "parallel.pp=0,2"), "with parallel.pp=0: parallel.pp: Input should be greater than or equal to 1"),
        (("--vary", "parallel.pp=1,'2'"), "parallel.pp: a number, not a string ('2': quoted, or tagged !!str)"),
        # under the cluster section, a topology field's (the node's GPUs once crashed dp's division)
        (("--vary", "cluster.node.gpus=8,x"), "with cluster.node.gpus=x: cluster.node.gpus: Input should be a valid integer"),
        (("--vary", "cluster.node.nic.bw_Gbps=400,fast"), "cluster.node.nic.bw_Gbps: Input should be a valid number"),
        # a GPU the catalogue lacks, a file that is not there: whatever the other fields (they were rows)
        (("--vary", "cluster.gpu=H100,X999"), "with cluster.gpu=X999: cluster.gpu: unknown GPU 'X999'"),
        (("--vary", "cluster.topology=../topologies/dgx-h100.yaml,../topologies/nope.yaml"),
         "cluster.topology: topology file not found: ../topologies/nope.yaml"),
        (("--vary", "parallel.pp=1", "--jobs", "0"), "--jobs: must be at least 1"),
        (("--vary", "parallel.pp=3,5"), "no plan of the sweep could be simulated"),
    ]:
        r = run_cli("sweep", ZERO3, *args, "--out", out, cwd=root)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert not (tmp_path / "x").exists()


def test_a_varied_key_naming_no_field_is_refused_up_front(tmp_path, root):
    """``--vary modelx.a=1,2`` (a key under a section the format does not have) listed every
    plan as refused by the rules; refused before any plan runs instead, as ``run --set`` says
    an unknown key (the nearest field), naming --vary and the key; so is a key inside a value
    the field never takes. Nothing written."""
    out = tmp_path / "x"
    for args, said in [
        (("--vary", "modelx.a=1,2"), "error: command line: --vary modelx.a: modelx: unknown key (did you mean 'model'? "
                                     "see docs/reference.md)\n"),
        (("--vary", "parallel.pp=1,2", "--vary", "simulation.collectivs.all_reduce=ring"),
         "error: command line: --vary simulation.collectivs.all_reduce: simulation.collectivs: unknown key (did you "
         "mean 'collectives'? see docs/reference.md)\n"),
        (("--vary", "parallel.ppp=1,2"), "error: command line: --vary parallel.ppp: unknown key (did you mean 'pp'? "
                                         "see docs/reference.md)\n"),
        (("--vary", "cluster.what_if=[{gpu: 1, slowdon: 2}]"),
         f"error: {ZERO3} with 'cluster.what_if=[{{gpu: 1, slowdon: 2}}]': cluster.what_if[0].slowdon: unknown key "
         "(did you mean 'slowdown'? see docs/reference.md)\n"),
    ]:
        r = run_cli("sweep", ZERO3, *args, "--out", out, cwd=root)
        assert (r.returncode, r.stdout, r.stderr) == (2, "", said), (args, r.stderr)
        assert not out.exists()
    from clustersim.sweep import run_sweep

    with pytest.raises(ConfigError, match="--vary modelx.a: modelx: unknown key"):
        run_sweep(str(root / ZERO3), [("parallel.pp", [1, 2]), ("modelx.a", [1])])


def test_sweep_csv_gives_every_plan_s_dp_and_vpp(root):
    """sweep.csv wrote dp only where it followed, and from the plan's changes: a plan whose
    degrees do not divide the GPUs read ``null``, and an interleaved plan's virtual stages were
    nowhere. Every line now has the plan's dp and vpp (its own, varied or not, a refused plan's
    as it asks them), empty where it has none, as a cell that does not apply is."""
    from clustersim.sweep import run_sweep, sweep_csv

    def lines(path: str, vary) -> list[dict[str, str]]:
        return list(csv.DictReader(io.StringIO(sweep_csv(run_sweep(str(root / path), vary)))))

    got = lines("scenarios/llama3_8b_8gpu.yaml",
                [("parallel.tp", [1, 3]), ("parallel.pp", [2]), ("parallel.schedule", ["1f1b", "interleaved"])])
    assert list(got[0])[:6] == ["plan", "parallel.tp", "parallel.pp", "parallel.schedule", "parallel.dp", "parallel.vpp"]
    assert [(x["parallel.tp"], x["parallel.schedule"], x["status"], x["parallel.dp"], x["parallel.vpp"]) for x in got] == [
        ("1", "1f1b", "ok", "4", ""), ("1", "interleaved", "ok", "4", "2"),
        # (3 x 2 does not divide 8 GPUs: no dp; the interleaved plan asks 2 chunks a rank all the same)
        ("3", "1f1b", "refused", "", ""), ("3", "interleaved", "refused", "", "2")]
    # dp not following (no degree varied): the file's, on every line, a refused plan's too
    got = lines("scenarios/interleaved_1f1b.yaml", [("parallel.zero", [0]), ("training.micro_batch_size", [1, 3])])
    assert [(x["status"], x["parallel.dp"], x["parallel.vpp"]) for x in got] == [("ok", "2", "2"), ("refused", "2", "2")]
    # dp and vpp varied: their columns are the varied ones, once
    got = lines("scenarios/interleaved_1f1b.yaml", [("parallel.vpp", [2, 3]), ("parallel.dp", [2])])
    assert list(got[0]).count("parallel.vpp") == list(got[0]).count("parallel.dp") == 1
    assert [(x["parallel.vpp"], x["parallel.dp"]) for x in got] == [("2", "2"), ("3", "2")]


def test_dp_follows_another_topology(root):
    """A varied topology brings its own GPUs a node: one H100 alone runs dp 1."""
    r = run_cli("sweep", "scenarios/llama3_8b_8gpu.yaml", "--vary",
                "cluster.topology=../topologies/dgx-h100.yaml,../topologies/single-h100.yaml", "--vary",
                "parallel.tp=1,4", "--top", 10, cwd=root)
    assert r.returncode == 0, r.stderr
    assert "4 x 1 x 1 = 4 does not divide the 1 GPUs" in r.stdout
    row = next(x for x in r.stdout.splitlines() if "single-h100" in x and x.split()[0] == "3")
    assert row.split()[2:4] == ["1", "1"]  # tp 1, dp 1


def test_dp_follows_the_gpus_a_node_the_scenario_gives_its_topology(root):
    """cluster.node.gpus varied (a change of the topology from the scenario): dp follows it."""
    from clustersim.sweep import run_sweep

    sweep = run_sweep(str(root / "scenarios/llama3_8b_8gpu.yaml"),
                      [("cluster.node.gpus", [4, 8]), ("cluster.node.nics", [4])])
    assert sweep["dp_follows"]
    assert [(r["status"], r["changes"]["parallel.dp"]) for r in sweep["plans"]] == [("ok", 1), ("ok", 2)]


def test_the_scaling_the_docs_quote(root):
    """getting-started's sweep of cluster.nodes: tokens/s over the GPUs, and the bubble
    against 1F1B's (p-1)/(m+p-1) as each replica's microbatches fall from 128 to 16."""
    from clustersim.sweep import run_sweep

    sweep = run_sweep(str(root / "scenarios/llama2_70b_64gpu.yaml"), [("cluster.nodes", [4, 8, 16, 32])])
    rows = {r["changes"]["cluster.nodes"]: r for r in sweep["plans"]}
    gain = rows[32]["tokens_per_s"] / rows[4]["tokens_per_s"]
    text = " ".join((root / "docs" / "getting-started.md").read_text().split())
    assert f"Eight times the GPUs give {gain:.1f} times the tokens/s ({100 * gain / 8:.0f} % scaling)" in text
    closed = [3 / (128 // dp + 3) for dp in (1, 8)]  # p = 4, m = 128 / dp
    assert (f"({100 * closed[0]:.1f} % to {100 * closed[1]:.1f} % of the step for `p = 4`; simulated "
            f"{100 * rows[4]['bubble_fraction']:.1f} % to {100 * rows[32]['bubble_fraction']:.1f} %)") in text
    assert rows[32]["bubble_fraction"] <= closed[1] and rows[4]["bubble_fraction"] == pytest.approx(closed[0], rel=0.1)


def test_paired_values_are_one_plan_each(root):
    """sweep --zip: the n-th values of each --vary together (weak scaling: nodes and batch),
    the docs' figures; lists of different lengths refused."""
    from clustersim.sweep import run_sweep

    assert [p.changes for p in plans_of([("a", [1, 2]), ("b", ["x", "y"])], paired=True)] == [
        [("a", 1), ("b", "x")], [("a", 2), ("b", "y")]]
    sweep = run_sweep(str(root / "scenarios/llama2_70b_64gpu.yaml"),
                      [("cluster.nodes", [4, 32]), ("training.global_batch_size", [64, 512])], paired=True)
    assert sweep["paired"] and [r["changes"] for r in sweep["plans"]] == [
        {"cluster.nodes": 4, "training.global_batch_size": 64, "parallel.dp": 1},
        {"cluster.nodes": 32, "training.global_batch_size": 512, "parallel.dp": 8}]
    small, large = sweep["plans"]
    text = " ".join((root / "docs" / "getting-started.md").read_text().split())
    kept = large["tokens_per_s_per_gpu"] / small["tokens_per_s_per_gpu"]
    assert f"32 nodes keep {100 * kept:.0f} % of 4 nodes' tokens/s per GPU" in text
    assert f"{large['exposed_comm_s']['dp']:.2f} s of it exposed a step on 32" in text and small["exposed_comm_s"]["dp"] == 0
    key, lines = lines_figure(sweep)
    drawn = _lines_drawn(lines)  # (hollow points of plans that do not fit apart)
    assert key == "cluster.nodes" and len(drawn) == 1 and drawn[0]["x"] == [4, 32]
    r = run_cli("sweep", "scenarios/llama2_70b_64gpu.yaml", "--vary", "cluster.nodes=4,8", "--vary",
                "training.global_batch_size=64", "--zip", cwd=root)
    assert r.returncode == 2 and "--zip: pairs the --vary lists value by value" in r.stderr and r.stdout == ""


def test_a_files_layer_split_is_dropped_where_a_plan_changes_its_pipeline(root, tmp_path):
    """The file's ``parallel.layers_per_stage`` counts its own pipeline's parts: a plan with
    another pp (or vpp, or schedule) splits the layers evenly, as advise's plans do, where it
    was refused for the entries' count; a plan with the file's pp keeps the file's split."""
    import yaml

    from clustersim.sweep import format_sweep, run_sweep

    d = yaml.safe_load((root / "scenarios/llama2_70b_64gpu.yaml").read_text())
    d["cluster"]["topology"] = str(root / "topologies" / Path(d["cluster"]["topology"]).name)
    d["parallel"]["layers_per_stage"] = [22, 20, 20, 18]
    path = tmp_path / "split.yaml"
    path.write_text(yaml.safe_dump(d))
    sweep = run_sweep(str(path), [("parallel.pp", [2, 4])])
    rows = {r["changes"]["parallel.pp"]: r for r in sweep["plans"]}
    assert all(r["status"] == "ok" for r in rows.values()) and sweep["split_follows"]
    assert rows[2]["changes"]["parallel.layers_per_stage"] is None and "parallel.layers_per_stage" not in rows[4]["changes"]
    own = clustersim.simulate(path).summary
    assert rows[4]["step_time_s"] == own["step_time_s"] and own["plan"]["layers_per_stage"] == [22, 20, 20, 18]
    assert "the layers split evenly where pp or the schedule is not the file's" in format_sweep(sweep)
    # varied itself, or not set in the file: nothing follows
    assert not run_sweep(str(path), [
        ("parallel.pp", [4]), ("parallel.layers_per_stage", [[20, 20, 20, 20]])])["split_follows"]
    # a key the file leaves unset is its default: 1F1B is the file's schedule, vpp 1 its vpp
    from clustersim.sweep import SPLIT, with_split

    bare = {"parallel": {"pp": 4, "layers_per_stage": [22, 20, 20, 18]}}
    assert with_split(bare, Plan(1, [("parallel.schedule", "1f1b"), ("parallel.vpp", None)])).changes == [
        ("parallel.schedule", "1f1b"), ("parallel.vpp", None)]
    assert with_split(bare, Plan(2, [("parallel.schedule", "interleaved")])).changes[-1] == (SPLIT, None)


def test_skip_unfit_lists_the_plans_that_cannot_fit(root, tmp_path):
    """``--skip-unfit``: a plan whose memory floor exceeds the GPU is listed with it, not
    simulated; simulated, it does not fit and peaks above it. The rest is the same sweep."""
    from clustersim.sweep import run_sweep

    vary = [("parallel.zero", [1, 2, 3]), ("training.recompute", ["none", "full"])]
    whole = run_sweep(str(root / ZERO3), vary)
    pruned = run_sweep(str(root / ZERO3), vary, prune=True)
    rows = {r["plan"]: r for r in whole["plans"]}
    unfit = [r for r in pruned["plans"] if r["status"] == "unfit"]
    assert [r["changes"] for r in unfit] == [{"parallel.zero": 1, "training.recompute": "none"}]
    (r,) = unfit
    assert rows[r["plan"]]["fits"] is False and r["capacity_bytes"] < r["floor_bytes"] <= rows[r["plan"]]["peak_bytes"]
    assert pruned["ranking"] == [n for n in whole["ranking"] if n != r["plan"]]
    assert all(x == rows[x["plan"]] for x in pruned["plans"] if x["status"] == "ok")
    out = tmp_path / "sw"
    cli = run_cli("sweep", ZERO3, "--vary", "parallel.zero=1,2,3", "--vary", "training.recompute=none,full",
                  "--skip-unfit", "--out", out, cwd=root)
    assert cli.returncode == 0, cli.stderr
    assert "certain not to fit in memory, not simulated: 1 of 6" in cli.stdout and r["reason"] in cli.stdout
    assert json.loads((out / "sweep.json").read_text())["plans"] == pruned["plans"]
    got = list(csv.DictReader(io.StringIO((out / "sweep.csv").read_text())))
    assert [(x["status"], x["fits"], x["step_time_s"], x["peak_bytes"], float(x["floor_bytes"]))
            for x in got if x["plan"] == str(r["plan"])] == [("unfit", "False", "", "", r["floor_bytes"])]
    # every plan certain not to fit is an answer (none fits), written as any other
    out = tmp_path / "none"
    cli = run_cli("sweep", ZERO3, "--vary", "parallel.zero=0,1", "--vary", "training.recompute=none", "--skip-unfit",
                  "--out", out, cwd=root)
    assert cli.returncode == 0, cli.stderr
    assert "none fits in memory: every plan is certain not to fit" in cli.stdout and "2 certain not to fit" in cli.stdout
    page = (out / "sweep.html").read_text()
    assert "None of the 2 plans can fit in 80 GiB" in page and "Every plan simulated" not in page


def test_a_floor_just_above_the_capacity_says_so():
    from clustersim.sweep import unfit_reason

    GiB = 2**30
    assert unfit_reason({"peak_bytes": 80.04 * GiB, "capacity_bytes": 80 * GiB, "stage": 2}) == (
        "needs at least 80.04 GiB a GPU (stage 2), more than the GPU's 80.00 GiB")
    assert unfit_reason({"peak_bytes": 94 * GiB, "capacity_bytes": 80 * GiB, "stage": 0}).startswith(
        "needs at least 94.0 GiB a GPU (stage 0)")


def test_a_sweeps_plans_share_one_cluster_per_topology(tmp_path, root):
    """Inside ``reused_clusters`` a plan on the last plan's topology gets its cluster (its
    routes asked again from scratch: the pair memos dropped), another topology a new one, and
    the plans simulate as they do alone; outside it every scenario builds its own."""
    from clustersim.api import simulate
    from clustersim.hardware.topology import PAIR_MEMOS, reused_clusters

    path = root / "scenarios/llama2_70b_64gpu.yaml"
    alone = [simulate(load_variant(path, ch), brief=True).summary
             for ch in ([], [("parallel.zero", 3)], [("cluster.node.nic.bw_Gbps", 200)])]
    assert load_variant(path, []).cluster is not load_variant(path, []).cluster
    with reused_clusters():
        first = load_variant(path, [])
        s1 = simulate(first, brief=True).summary
        assert any(m in first.cluster.__dict__ for m in PAIR_MEMOS)
        second = load_variant(path, [("parallel.zero", 3)])
        assert second.cluster is first.cluster
        assert not any(m in first.cluster.__dict__ for m in PAIR_MEMOS)
        s2 = simulate(second, brief=True).summary
        with reused_clusters():  # (an inner block is the outer one's: advise's two rounds)
            assert load_variant(path, []).cluster is first.cluster
        assert load_variant(path, []).cluster is first.cluster
        other = load_variant(path, [("cluster.node.nic.bw_Gbps", 200)])
        assert other.cluster is not first.cluster
        s3 = simulate(other, brief=True).summary
    for a, b in zip(alone, (s1, s2, s3)):
        assert {k: a[k] for k in ("step_time_s", "exposed_comm_s", "memory")} == \
            {k: b[k] for k in ("step_time_s", "exposed_comm_s", "memory")}
    assert s3["step_time_s"] != s1["step_time_s"]


KILLS_ZERO3 = """
import json, os, signal, sys, time
from clustersim import api, sweep
from clustersim.errors import ConfigError

sweep.LOST_POLL_S = 0.05

def simulate(sc, **_):  # (in a worker: the ZeRO-3 plan's process is killed, as the OOM killer does)
    if sc.parallel.zero == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)
    raise ConfigError("timed")

api.simulate = simulate
found = sweep.run_sweep(sys.argv[1], [("parallel.zero", [1, 3, 2, 0])], jobs=2)
print(json.dumps({"rows": found["plans"], "table": sweep.format_sweep(found)}))
"""


def test_a_sweep_whose_worker_is_killed_lists_its_plan_and_goes_on(tmp_path, root):
    """A worker killed mid-plan (the out-of-memory killer) never returns its row, and the pool
    waited for it for ever: its plan is now listed as ended without a result, and every other
    plan has its row."""
    import subprocess
    import sys

    from clustersim.sweep import KILLED_WHY

    from .conftest import scenario_dict
    from .test_cli import write_scenario

    path = write_scenario(tmp_path, root, scenario_dict())
    r = subprocess.run([sys.executable, "-c", KILLS_ZERO3, str(path)], capture_output=True, text=True, timeout=60,
                       cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    assert [(row["plan"], row["status"], row["reason"]) for row in got["rows"]] == [
        (1, "refused", "timed"), (2, "failed", KILLED_WHY), (3, "refused", "timed"), (4, "refused", "timed")]
    assert f"ended without a result: 1 of 4\n  #2 zero=3: {KILLED_WHY}" in got["table"]


def test_a_sweep_leaves_no_cyclic_garbage_where_the_collector_is_off(root):
    """``python -m clustersim`` turns the cyclic garbage collector off; a sweep of thousands of
    plans in one process collects what each plan leaves in cycles (refusals' tracebacks among
    it), so that nothing piles up: after the plans, a collection finds nothing left, and the
    objects frozen for the plans' collections are given back."""
    import gc

    from clustersim.hardware.topology import reused_clusters
    from clustersim.sweep import simulate_plans
    from clustersim.yamlio import read_yaml

    path = root / ZERO3
    data = read_yaml(path, what="scenario")
    plans = [Plan(i + 1, [("parallel.zero", z), ("training.recompute", r), ("parallel.tp", 3 if i == 0 else 1)])
             for i, (z, r) in enumerate([(3, "full"), (1, "full"), (2, "selective"), (3, "none")])]
    was = gc.isenabled()
    # a plan first, collected: what the modules a plan imports leave in cycles as they load
    # (dataclasses' slotted classes, importlib.metadata's entry points) is not the plans'
    simulate_plans(str(path), data, plans[1:2], {})
    gc.collect()
    gc.disable()
    try:
        rows: dict = {}
        with reused_clusters():  # (the cluster kept past the collection below: it is not the plans')
            simulate_plans(str(path), data, plans, rows)
            # (counted before the collection: after one, CPython 3.12 counts objects as frozen
            # that it collects with the rest, gc.unfreeze having returned them)
            frozen, left = gc.get_freeze_count(), gc.collect()
    finally:
        gc.unfreeze()
        if was:
            gc.enable()
    assert [rows[n]["status"] for n in sorted(rows)] == ["refused", "ok", "ok", "ok"]
    assert left == 0
    assert frozen == 0  # what was frozen for the plans is the caller's again


def _lines_drawn(fig: dict) -> list[dict]:
    """The lines of a lines figure: its legend's entries but the hollow marker's."""
    return [t for t in fig["data"] if t.get("showlegend", True) and t["name"] != "does not fit (hollow)"]


def test_the_lines_drawn_are_those_whose_best_plan_that_fits_is_fastest():
    """A line per setting of the other keys, at most ``most``: ranked by the tokens/s per GPU
    of their best plan that fits, lines where none fits after them (however fast)."""
    def row(n, pp, zero, tokens, fits):
        return {"plan": n, "status": "ok", "changes": {"parallel.pp": pp, "parallel.zero": zero},
                "tokens_per_s_per_gpu": tokens, "tokens_per_s": 16 * tokens, "fits": fits, "step_time_s": 1.0,
                "mfu": 0.5, "bubble_fraction": 0.1, "exposed_comm_s": {"total": 0.1}, "peak_bytes": 1e9}

    plans = [row(1, 1, 3, 900.0, False), row(2, 2, 3, 950.0, False),  # fastest, never fits
             row(3, 1, 1, 500.0, True), row(4, 2, 1, 800.0, False),  # fits at 500 only
             row(5, 1, 2, 600.0, True), row(6, 2, 2, 700.0, True)]  # fits at 700
    sweep = {"vary": {"parallel.pp": [1, 2], "parallel.zero": [1, 2, 3]}, "plans": plans,
             "ranking": ranking(plans), "dp_follows": False, "split_follows": False, "paired": False}
    for most, names in [(2, ["zero=2", "zero=1"]), (3, ["zero=2", "zero=1", "zero=3"])]:
        _, fig = lines_figure(sweep, most)
        assert [t["name"] for t in _lines_drawn(fig)] == names
        assert fig["layout"]["legend"]["title"]["text"] == "best first:"  # (ranked, not sorted: the legend says so)


def test_estimated_steps_are_marked_where_a_row_shown_has_one():
    """A plan whose step is an estimate (its summary's ``simulation.asymmetric_orbits``: the
    row's ``estimate``) shows ESTIMATE_MARK after its step, the others NO_MARK in its place,
    and a legend follows the table; where no row shown is one (none at all, or past --top),
    the column is as before and no legend. sweep.html's table says the same."""
    from clustersim.output.plans_page import _table_html
    from clustersim.sweep import ESTIMATE_MARK, NO_MARK, table_lines

    def row(n: int, step_s: float, estimate: bool) -> dict:
        return {"plan": n, "changes": {"parallel.zero": n}, "status": "ok", "step_time_s": step_s,
                "tokens_per_s": 1 / step_s, "tokens_per_s_per_gpu": 1 / step_s, "mfu": 0.5, "bubble_fraction": 0.1,
                "exposed_comm_s": {"total": 0.1}, "peak_bytes": 2**30, "capacity_bytes": 2**36, "fits": True,
                "estimate": estimate}

    def sweep(*rows) -> dict:
        return {"plans": list(rows), "ranking": [r["plan"] for r in rows], "vary": {"parallel.zero": [1, 2, 3]},
                "dp_follows": False}

    lines = table_lines(sweep(row(1, 1.5, True), row(2, 2.5, False)), 20)
    assert f"1.500{ESTIMATE_MARK}" in lines[1] and f"2.500{NO_MARK}" in lines[2]
    assert lines[1].index("1.500") == lines[2].index("2.500")  # (aligned)
    assert lines[3].startswith(f"{ESTIMATE_MARK} an estimated step, some communications at their slowest twin's")
    assert lines[4].endswith("run --all-ranks checks one (up to 4,096 GPUs)")
    for plain in (table_lines(sweep(row(1, 1.5, False), row(2, 2.5, False)), 20),
                  table_lines(sweep(row(1, 1.5, False), row(2, 2.5, False), row(3, 3.5, True)), 2)):
        assert all(ESTIMATE_MARK not in x and NO_MARK not in x for x in plain)
        assert plain[1].index("1.500") + len("1.500") == plain[0].index("step s") + len("step s")  # (no room kept)
    page = _table_html(sweep(row(1, 1.5, True), row(2, 2.5, False)), None)
    assert f"1.500{ESTIMATE_MARK}" in page and f"2.500{NO_MARK}" in page and "an estimated step" in page
    assert "estimated" not in _table_html(sweep(row(1, 1.5, False)), None)


def test_plans_on_different_gpu_counts_show_the_tokens_per_s_they_are_ranked_by():
    """The ranking is by the tokens/s of all a plan's GPUs; where the plans shown run on
    different GPU counts, that column is shown beside tokens/s per GPU (alone, per GPU read
    in the wrong order: 901.5 first, 1,205.9 last); on one GPU count, per GPU alone."""
    from clustersim.sweep import table_columns

    def row(plan: int, gpus: int, per_gpu: float) -> dict:
        return {"plan": plan, "changes": {"cluster.nodes": gpus // 8}, "step_time_s": 1.0, "tokens_per_s": gpus * per_gpu,
                "tokens_per_s_per_gpu": per_gpu, "mfu": 0.5, "bubble_fraction": 0.0, "exposed_comm_s": {"total": 0.0},
                "peak_bytes": 2 ** 30, "fits": True}

    sweep = {"vary": {"cluster.nodes": [4, 32]}, "dp_follows": False}
    shown = [row(2, 256, 901.5), row(1, 32, 1205.9)]
    cols = dict(table_columns(sweep, shown))
    assert [cols["tokens/s"](r) for r in shown] == ["230,784", "38,589"]
    assert [h for h, _ in table_columns(sweep, shown)].index("tokens/s") == 3  # after the step
    assert "tokens/s" not in dict(table_columns(sweep, [row(2, 32, 901.5), row(1, 32, 1205.9)]))


def test_a_varied_schedule_takes_the_model_chunks_it_needs(root):
    """Varying the schedule and not vpp, each plan takes the chunks its schedule needs, as
    advise's do: interleaved 2 where the file has 1 (the interleaved plans were all refused,
    "needs vpp >= 2"), the others 1 where the file interleaves (1F1B refuses vpp=2); with vpp
    varied too, the plans are as asked."""
    from clustersim.sweep import run_sweep

    for path, own in (("scenarios/llama2_70b_64gpu.yaml", "1f1b"), ("scenarios/interleaved_1f1b.yaml", "interleaved")):
        sweep = run_sweep(str(root / path), [("parallel.schedule", ["1f1b", "interleaved"])])
        rows = {r["changes"]["parallel.schedule"]: r for r in sweep["plans"]}
        assert sweep["chunks_follow"] and all(r["status"] == "ok" for r in rows.values()), path
        assert rows["interleaved"]["changes"].get("parallel.vpp", 2) == 2
        assert ("parallel.vpp" in rows["interleaved"]["changes"]) == (own == "1f1b")
        assert ("parallel.vpp" in rows["1f1b"]["changes"]) == (own == "interleaved")
    asked = run_sweep(str(root / "scenarios/llama2_70b_64gpu.yaml"),
                      [("parallel.schedule", ["1f1b", "interleaved"]), ("parallel.vpp", [1, 2])])
    assert not asked["chunks_follow"] and sum(r["status"] == "refused" for r in asked["plans"]) == 2


def test_plans_that_do_not_fit_are_named_in_both_charts_legends():
    """The hollow points of the lines chart (plans that do not fit) have a legend entry of
    their own, drawing no point, only where some are drawn; the scatter's "does not fit"
    entry shows its "x" though its fastest plan lies past the memory axis's edge (a triangle
    there: the legend drew the first point's symbol), the triangles in its legend group."""
    def row(n, pp, zero, tokens, peak_gib, fits):
        return {"plan": n, "status": "ok", "changes": {"parallel.pp": pp, "parallel.zero": zero},
                "tokens_per_s_per_gpu": tokens, "tokens_per_s": 16 * tokens, "fits": fits, "step_time_s": 1.0,
                "mfu": 0.5, "bubble_fraction": 0.1, "exposed_comm_s": {"total": 0.1},
                "peak_bytes": peak_gib * 2**30, "capacity_bytes": 80 * 2**30}

    plans = [row(1, 1, 1, 900.0, 400, False), row(2, 2, 1, 800.0, 90, False),
             row(3, 1, 3, 500.0, 40, True), row(4, 2, 3, 600.0, 50, True)]
    sweep = {"vary": {"parallel.pp": [1, 2], "parallel.zero": [1, 3]}, "plans": plans, "ranking": ranking(plans),
             "dp_follows": False, "split_follows": False, "paired": False}
    _, fig = lines_figure(sweep)
    legend = [t for t in fig["data"] if t["name"] == "does not fit (hollow)"]
    assert len(legend) == 1 and legend[0]["showlegend"] and legend[0]["x"] == [None]
    assert legend[0]["marker"]["color"] == "white"  # hollow, as the points it names
    _, fig = lines_figure({**sweep, "plans": plans[2:], "ranking": ranking(plans[2:]),
                           "vary": {"parallel.pp": [1, 2], "parallel.zero": [3]}})
    assert all(t["name"] != "does not fit (hollow)" for t in fig["data"])
    unfit = [t for t in scatter_figure(sweep, own=None)["data"] if t["name"] == "does not fit"]
    shown = [t for t in unfit if t["showlegend"]]
    assert len(shown) == 1 and shown[0]["marker"]["symbol"] == "x" and shown[0]["y"] == [800.0]
    assert [(t["marker"]["symbol"], t["y"]) for t in unfit if not t["showlegend"]] == [("triangle-right", [900.0])]
    assert {t["legendgroup"] for t in unfit} == {"does not fit"}


def test_a_plan_that_fits_with_little_spare_reads_tight():
    """A plan that fits with less than TIGHT_SHARE of the GPU's memory spare (analysis.memory)
    reads "tight" in the fits column, as run's memory table says it, with what that means
    below the table; where the best plan that fits is tight, a line names the best with room
    and how many fewer tokens/s it gives (none with room: said so). sweep.csv has the flag."""
    from clustersim.analysis.memory import TIGHT_SHARE
    from clustersim.sweep import sweep_csv, table_lines

    cap = 80 * 2**30

    def row(n: int, tokens: float, peak_gib: float) -> dict:
        peak = peak_gib * 2**30
        return {"plan": n, "changes": {"parallel.zero": n}, "status": "ok", "step_time_s": 1 / tokens,
                "tokens_per_s": tokens, "tokens_per_s_per_gpu": tokens, "mfu": 0.5, "bubble_fraction": 0.1,
                "exposed_comm_s": {"total": 0.1}, "peak_bytes": peak, "capacity_bytes": cap, "fits": peak <= cap,
                "tight": peak <= cap < peak + TIGHT_SHARE * cap, "estimate": False}

    def lines(*rows) -> list[str]:
        ranked = sorted(rows, key=lambda r: (not r["fits"], -r["tokens_per_s"]))
        return table_lines({"plans": list(rows), "ranking": [r["plan"] for r in ranked],
                            "vary": {"parallel.zero": [1, 2, 3]}, "dp_follows": False}, 20)

    got = lines(row(1, 1000.0, 79.5), row(2, 800.0, 60.0), row(3, 1200.0, 90.0))
    assert [x.split()[-1] for x in got[1:4]] == ["tight", "yes", "NO"]
    assert got[4].startswith("steps are lower bounds, tokens/s and MFU upper ones: published runs took")
    assert got[5].startswith("tight: fits with less than 4.0 GiB spare (5 % of the GPU)")
    assert got[6] == "  the best that fits, #1, is tight; the best with room, #2, gives 20.0 % fewer tokens/s"
    assert lines(row(1, 1000.0, 79.5))[-1].endswith("#1, is tight; none that fits has room")
    roomy = lines(row(1, 1000.0, 60.0), row(2, 800.0, 79.5))  # the best has room: the legend alone
    assert roomy[-1].startswith("tight: fits with less than") and "is tight" not in "\n".join(roomy)
    assert not any(x.startswith("tight") for x in lines(row(1, 1000.0, 60.0)))
    csv = sweep_csv({"plans": [row(1, 1000.0, 79.5), row(2, 800.0, 60.0)], "vary": {"parallel.zero": [1, 2]},
                     "dp_follows": False}).splitlines()
    head = csv[0].split(",")
    assert [x.split(",")[head.index("tight")] for x in csv[1:]] == ["True", "False"]


def test_a_sweep_says_which_plans_recompute_nothing(root, tmp_path):
    """A selective recompute of core_attn under flash attention keeps nothing to recompute: its
    row ties with no recompute's, and a line under the table says why, naming the plan (only
    where the plan's own changes made it: a file's own setting is said by run's plan line)."""
    from clustersim.sweep import format_sweep, run_sweep

    sweep = run_sweep(str(root / "scenarios/llama3_8b_8gpu.yaml"),
                      [("training.recompute", ["none", "selective"]), ("training.attention", ["flash", "standard"])],
                      jobs=1)
    rows = {tuple(r["changes"].values()): r for r in sweep["plans"]}
    noop = rows[("selective", "flash")]
    assert noop["recomputes_nothing"] and not rows[("selective", "standard")]["recomputes_nothing"]
    assert noop["step_time_s"] == rows[("none", "flash")]["step_time_s"]
    assert noop["peak_bytes"] == rows[("none", "flash")]["peak_bytes"]
    assert rows[("selective", "standard")]["peak_bytes"] < rows[("none", "standard")]["peak_bytes"]
    assert (f"recompute=selective recomputes nothing under flash attention (#{noop['plan']}): flash keeps no "
            "scores for core_attn to recompute, so it is the plan without recompute") in format_sweep(sweep).splitlines()
    own = tmp_path / "selective.yaml"
    own.write_text((root / "scenarios/llama3_8b_8gpu.yaml").read_text()
                   .replace("../topologies/", f"{root}/topologies/").replace("\ntraining:\n", "\ntraining:\n  recompute: selective\n"))
    tp = run_sweep(str(own), [("parallel.tp", [4, 8])], jobs=1)
    assert all(r["recomputes_nothing"] for r in tp["plans"])
    assert "recomputes nothing" not in format_sweep(tp)


def test_a_sweep_says_which_plans_a_slower_link_caps(root):
    """A sweep of NIC rates goes flat where PCIe (64 GB/s on DGX H100) caps them: the rows of
    800 and 1600 Gb/s are alike, and a line under the table names them, as run's cluster line
    says it of each (summary.json's hardware.link_ceilings)."""
    from clustersim.sweep import format_sweep, run_sweep

    sweep = run_sweep(str(root / "scenarios/interleaved_1f1b.yaml"),
                      [("cluster.node.nic.bw_Gbps", [400, 800, 1600])], jobs=1)
    rows = {r["changes"]["cluster.node.nic.bw_Gbps"]: r for r in sweep["plans"]}
    assert rows[400]["link_ceilings"] is None
    assert rows[800]["step_time_s"] == rows[1600]["step_time_s"] < rows[400]["step_time_s"]
    assert [c["nic_GBps"] for r in (rows[800], rows[1600]) for c in r["link_ceilings"]] == \
        pytest.approx([90, 180])
    assert (f"PCIe at 64 GB/s caps the NICs' 90/180 GB/s between nodes on #{rows[800]['plan']}, "
            f"#{rows[1600]['plan']}; node.pcie_GBps raises it") in format_sweep(sweep).splitlines()


def test_lines_past_the_colours_are_dashed_and_wide_tables_scroll():
    """Past the palette's colours a line takes a dash (12 lines over 10 colours drew pairs that
    read as one), so no two lines drawn share colour and dash; the plans' table sits in a box
    that scrolls sideways rather than clipping its last columns at the page's edge."""
    from clustersim.output.plans_page import LINES_SHOWN, _table_html

    def row(n, pp, zero, tokens):
        return {"plan": n, "status": "ok", "changes": {"parallel.pp": pp, "parallel.zero": zero},
                "tokens_per_s_per_gpu": tokens, "tokens_per_s": 16 * tokens, "fits": True, "step_time_s": 1.0,
                "mfu": 0.5, "bubble_fraction": 0.1, "exposed_comm_s": {"total": 0.1}, "peak_bytes": 1e9,
                "capacity_bytes": 2**36}

    plans = [row(2 * z + p, p, z, 100.0 + 7 * z + p) for z in range(LINES_SHOWN) for p in (1, 2)]
    sweep = {"vary": {"parallel.pp": [1, 2], "parallel.zero": list(range(LINES_SHOWN))}, "plans": plans,
             "ranking": ranking(plans), "dp_follows": False, "split_follows": False, "paired": False}
    _, fig = lines_figure(sweep)
    styles = [(t["line"]["color"], t["line"]["dash"]) for t in _lines_drawn(fig)]
    assert len(styles) == LINES_SHOWN == len(set(styles))
    assert styles[0][1] == "solid" and styles[-1][1] == "dash"
    page = _table_html(sweep, None)
    assert '<div class="wide"><table>' in page and "</table></div>" in page
