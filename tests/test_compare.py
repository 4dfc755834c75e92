"""``clustersim compare``: plans side by side, each simulated as ``run`` simulates it, the
step split into parts whose differences add up to the steps', and bad input refused."""

from __future__ import annotations

import json
import math
import re

import pytest

import clustersim
from clustersim.errors import ConfigError
from clustersim.output.compare import KINDS, config_differences, differences_line, fastest, labels, step_split
from clustersim.output.compare_page import compare_html, kinds_figure, memory_figure, split_figure
from clustersim.output.zoom import DETAIL_IN_VIEW
from clustersim.overrides import apply_changes, changes_text, parse_changes

from .conftest import ROOT, offline_page
from .test_cli import run_cli

ZERO3 = "scenarios/zero3_llama3_8b_16gpu.yaml"
# the trade the scenario's comment names: ZeRO-3's gathers against a pipeline's bubble
PIPELINE = "parallel.zero=1 parallel.pp=4 parallel.dp=4"


def test_parse_changes_reads_yaml_values():
    got = parse_changes("parallel.pp=2 'parallel.layers_per_stage=[10, 22]' training.recompute=full "
                        "parallel.vpp_group=null model.moe.top_k=4 x.y=", source="s", field="f")
    assert got == [("parallel.pp", 2), ("parallel.layers_per_stage", [10, 22]), ("training.recompute", "full"),
                   ("parallel.vpp_group", None), ("model.moe.top_k", 4), ("x.y", "")]
    assert parse_changes(changes_text(got), source="s", field="f") == got
    # exponent numbers as a scenario file reads them (YAML 1.2), an empty value said as one
    assert parse_changes("a.b=1e0 c.d=", source="s", field="f") == [("a.b", 1.0), ("c.d", "")]
    assert changes_text([("name", ""), ("a.b", None)]) == "'name=\"\"' a.b=null"


@pytest.mark.parametrize("text, says", [
    ("", "is empty"),
    ("parallel.pp", "is not KEY=VALUE"),
    ("=3", "is not KEY=VALUE"),
    ("parallel..pp=3", "is not KEY=VALUE"),
    ("parallel.pp=[1", "is not a YAML value"),
    ("parallel.pp=1 parallel.pp=2", "changed twice"),
    ("'parallel.pp=1", "quotation"),
])
def test_parse_changes_refuses(text, says):
    with pytest.raises(ConfigError) as e:
        parse_changes(text, source="command line", field="--variant")
    assert e.value.source == "command line" and e.value.field == "--variant" and says in e.value.message


def test_apply_changes_sets_removes_and_makes_sections():
    data = {"parallel": {"tp": 8, "pp": 4, "vpp_group": 6}, "model": {"name": "m"}}
    out = apply_changes(data, [("parallel.pp", 1), ("parallel.vpp_group", None), ("model.moe.top_k", 2),
                               ("training.zz.q", None)], source="s")
    assert out == {"parallel": {"tp": 8, "pp": 1}, "model": {"name": "m", "moe": {"top_k": 2}}}
    assert data["parallel"] == {"tp": 8, "pp": 4, "vpp_group": 6}  # the original left as it was
    with pytest.raises(ConfigError) as e:
        apply_changes(data, [("parallel.tp.x", 1)], source="s")
    assert e.value.field == "parallel.tp.x" and "parallel.tp is 8" in e.value.message


def test_differences_said_as_yaml():
    entry = {"gpu": 3, "slowdown": 1.1, "link": None, "bw_factor": None}
    assert differences_line([("cluster.what_if", [], [entry]), ("training.recompute_layers", None, 2)]) == \
        "cluster.what_if [] -> [{gpu: 3, slowdown: 1.1}] · training.recompute_layers null -> 2"
    # a value with spaces left unquoted inside the changes: how to keep it whole
    with pytest.raises(ConfigError) as e:
        parse_changes("cluster.what_if=[{gpu: 3, slowdown: 1.1}]", source="s", field="f")
    assert "quote a value with spaces inside the changes" in e.value.message


def test_config_differences_in_field_order():
    a = {"name": "a", "parallel": {"tp": 8, "pp": 4, "dp": 2}, "training": {"recompute": "none"}}
    b = {"name": "b", "parallel": {"tp": 8, "pp": 1, "dp": 8}, "training": {"recompute": "none", "x": 1}}
    assert config_differences(a, b) == [("parallel.pp", 4, 1), ("parallel.dp", 2, 8), ("training.x", None, 1)]
    assert config_differences(a, a) == []


def test_fastest_skips_plans_that_do_not_fit():
    s = lambda t, fits: {"tokens_per_s": t, "memory": {"fits": fits}}  # noqa: E731
    assert fastest([s(1.0, True), s(3.0, False), s(2.0, True)]) == 2
    assert fastest([s(2.0, True), s(2.0, True)]) == 0
    assert fastest([s(1.0, False)]) is None
    assert labels(3) == ["A", "B", "C"] and labels(28)[26:] == ["P27", "P28"]


def test_a_close_lead_over_an_estimated_step_is_said():
    """Where the fastest plan leads the next by less than CLOSE_LEAD and either's step is an
    estimate (simulation.asymmetric_orbits), the verdict says the lead may not hold, naming
    them in the plans' order and offering run --all-ranks up to 4,096 GPUs; a wider lead,
    exact steps, or a close plan that does not fit say nothing more."""
    from clustersim.output.compare import verdict_lines
    from clustersim.output.summary import CLOSE_LEAD

    def s(t: float, flagged: bool, fits: bool = True, gpus: int = 1024) -> dict:
        return {"tokens_per_s": t, "tokens_per_s_per_gpu": t, "memory": {"fits": fits}, "world_size": gpus,
                "simulation": {"asymmetric_orbits": {"pp": 2} if flagged else None}}

    close = 100 * (1 + CLOSE_LEAD / 2)
    lines = verdict_lines(["A", "B", "C"], [s(100, True), s(close, False), s(50, True)])
    assert lines[0].startswith("fastest                 B (") and len(lines) == 2
    assert lines[1].strip() == ("the lead may not hold: A's step is an estimate (some communications at their slowest "
                                "twin's pace); run --all-ranks checks it")
    both = verdict_lines(["A", "B"], [s(100, True), s(close, True)])
    assert "may not hold: A's and B's steps are estimates" in both[1] and both[1].endswith("checks them")
    big = verdict_lines(["A", "B"], [s(100, True, gpus=8192), s(close, True, gpus=8192)])
    assert big[1].endswith("slowest twin's pace)")  # (--all-ranks is refused past 4,096 GPUs)
    assert len(verdict_lines(["A", "B"], [s(100, True), s(100 * (1 + 2 * CLOSE_LEAD), True)])) == 1
    assert len(verdict_lines(["A", "B"], [s(100, False), s(close, False)])) == 1
    assert len(verdict_lines(["A", "B", "C"], [s(close, True, fits=False), s(100, True), s(10, False)])) == 2  # (no fit)
    assert verdict_lines(["A"], [s(100, True)]) == ["fastest                 A (most tokens/s of those that fit)"]


def test_compare_a_pipeline_with_zero3(tmp_path, root):
    out = tmp_path / "cmp"
    r = run_cli("compare", ZERO3, "--variant", PIPELINE, "--variant", "parallel.zero=0", "--out", out, cwd=root)
    assert r.returncode == 0, r.stderr
    doc = json.loads((out / "compare.json").read_text())
    a, b, c = doc["plans"]
    assert [p["label"] for p in doc["plans"]] == ["A", "B", "C"] and doc["baseline"] == "A"
    assert b["differences"] == {"parallel.pp": [1, 4], "parallel.dp": [16, 4], "parallel.zero": [3, 1]}
    assert c["differences"] == {"parallel.zero": [3, 0]} and a["differences"] == {}
    assert b["changes"] == {"parallel.zero": 1, "parallel.pp": 4, "parallel.dp": 4} and a["changes"] is None
    # each plan is simulated as run simulates it
    direct = clustersim.simulate(clustersim.load_scenario(root / ZERO3)).summary
    assert a["summary"]["step_time_s"] == direct["step_time_s"]
    assert a["summary"]["memory"]["peak_bytes"] == direct["memory"]["peak_bytes"]
    # a variant's summary (and report) names it, not the file's own plan; the file's plan its label
    assert b["summary"]["scenario"] == f"{direct['scenario']} (B)" and b["summary"]["description"] == b["source"]
    assert a["summary"]["scenario"] == f"{direct['scenario']} (A)"
    # the step splits into parts that add up to it, so their differences add up to the steps'
    for p in doc["plans"]:
        sp = p["step_split"]
        assert math.isclose(sp["compute_s"] + sp["exposed_comm_s"] + sp["bubble_s"], sp["step_time_s"],
                            rel_tol=1e-9)
        assert sp == step_split(p["summary"])
    # the trade: ZeRO-3 gathers over DP (exposed dp, no bubble); the pipeline idles, at least
    # 1F1B's (p-1)/(m+p-1) = 3/19 of its step, more as its last stage also runs the 128K-token
    # vocabulary's head (imbalance), and its DP reduces a quarter as often
    assert a["step_split"]["bubble_s"] == 0 < a["step_split"]["exposed_dp_s"]
    bubble = b["summary"]["bubble"]
    assert 0.95 * 3 / 19 < b["summary"]["bubble_fraction"] < 0.5 and bubble["imbalance_s"] > 0
    stages = [s["compute_s"] for s in b["summary"]["per_stage"]]
    assert stages.index(max(stages)) == 3
    assert b["step_split"]["exposed_dp_s"] < a["step_split"]["exposed_dp_s"]
    # without ZeRO the 8B model's states (18 bytes a parameter, fp32 grads) do not fit in 80 GB
    assert not c["summary"]["memory"]["fits"] and a["summary"]["memory"]["fits"]
    best = max((p for p in doc["plans"] if p["summary"]["memory"]["fits"]), key=lambda p: p["summary"]["tokens_per_s"])
    assert doc["fastest_fitting"] == best["label"]
    # the terminal says the same
    lines = r.stdout.splitlines()
    assert lines[0] == "clustersim · compare 3 plans"
    assert "B vs A" in r.stdout and "parallel.pp 1 -> 4 · parallel.dp 16 -> 4 · parallel.zero 3 -> 1" in r.stdout
    step_row = next(x for x in lines if x.startswith("step time"))
    assert f"{a['summary']['step_time_s']:.3f} s" in step_row and f"{b['summary']['step_time_s']:.3f} s" in step_row
    rel = 100 * (b["summary"]["step_time_s"] / a["summary"]["step_time_s"] - 1)
    assert f"{rel:+.1f} %" in step_row
    assert any(x.startswith("fastest") and x.split()[1] == doc["fastest_fitting"] for x in lines)
    assert "C does not fit" in r.stdout
    assert "note" not in r.stdout  # the same model, batch and GPUs
    assert sorted(p.name for p in out.iterdir()) == ["compare.html", "compare.json", "report_A.html", "report_B.html",
                                                     "report_C.html"]
    # each plan's report is the one run writes
    r = run_cli("run", ZERO3, "--no-trace", "--out", tmp_path / "run", cwd=root)
    assert r.returncode == 0, r.stderr
    report = (tmp_path / "run" / "report.html").read_text()

    def but_files(page: str) -> str:  # (run's links summary.json beside it, compare's compare.html)
        return re.sub(r'<p class="meta">files: .*?</p>', "", page, count=1)
    # (its title names its label, as a variant's does)
    name = direct["scenario"]
    titled = but_files(report).replace(f"clustersim · {name}<", f"clustersim · {name} (A)<")
    assert but_files((out / "report_A.html").read_text()) == titled != but_files(report)
    # compare.html draws each plan's timeline as its report does (the same bars), on one axis
    page = (out / "compare.html").read_text()
    bars = re.search(r'Plotly\.newPlot\("clustersim-timeline", (\[.*?\]), \{"template"', report).group(1)
    assert page.count(bars) == 1 and all(f'"clustersim-timeline-{x}"' in page for x in "ABC")
    end_ms = 1e3 * max(p["summary"]["step_time_s"] for p in doc["plans"]) * 1.005
    assert page.count(f'"range":[0,{json.dumps(end_ms)}]') == 3
    # again without reports: those of the earlier compare are stale, and go
    r = run_cli("compare", ZERO3, "--variant", PIPELINE, "--no-report", "--out", out, cwd=root)
    assert r.returncode == 0, r.stderr
    assert [p.name for p in out.iterdir()] == ["compare.json"]


def _plans(doc: dict) -> list[dict]:
    """compare.json's plans as the page is given them (differences as tuples)."""
    return [{**p, "differences": [(k, a, b) for k, (a, b) in p["differences"].items()]} for p in doc["plans"]]


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> dict:
    """compare.json and compare.html of ZeRO-3 against its pipeline variant."""
    out = tmp_path_factory.mktemp("compared")
    r = run_cli("compare", ZERO3, "--variant", PIPELINE, "--out", out, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return {"doc": json.loads((out / "compare.json").read_text()), "page": out / "compare.html"}


def test_compare_page_figures(compared):
    """compare.html's charts: each plan's bar as long as its step, split as step_split splits
    it; exposed time per kind; each stage's peak against the capacity; the fields that differ."""
    plans = _plans(compared["doc"])
    split = split_figure(plans)
    assert [t["name"] for t in split["data"]] == ["compute", "exposed communication", "bubble (idle)"]
    for i, p in enumerate(plans):
        sp = step_split(p["summary"])
        parts = [t["x"][i] for t in split["data"]]
        assert parts == [sp["compute_s"], sp["exposed_comm_s"], sp["bubble_s"]]
        assert math.isclose(sum(parts), p["summary"]["step_time_s"], rel_tol=1e-9)
        assert split["layout"]["annotations"][i]["x"] == p["summary"]["step_time_s"]
    kinds = kinds_figure(plans)
    assert kinds["data"][0]["x"] == [k for k in KINDS if any(p["summary"]["exposed_comm_s"][k] > 0 for p in plans)]
    for t, p in zip(kinds["data"], plans):
        assert t["y"] == [p["summary"]["exposed_comm_s"][k] for k in t["x"]]
        # (each bar labelled with its seconds: a plan's large bar makes another's a sliver)
        assert t["texttemplate"] == "%{y:.3g} s" and t["textposition"] == "outside"
    mem = memory_figure(plans)
    b = mem["data"][1]
    assert b["x"] == ["stage 0", "stage 1", "stage 2", "stage 3"]
    assert b["y"] == [st["peak_bytes"] / 2**30 for st in plans[1]["summary"]["memory"]["stages"]]
    cap = plans[0]["summary"]["memory"]["capacity_bytes"]  # the same GPUs: one line
    assert [s["y0"] for s in mem["layout"]["shapes"]] == [cap / 2**30]
    # named in the legend (a label on the plot covered the last stage's bars)
    assert [t["name"] for t in mem["data"][len(plans):]] == [f"capacity {cap / 2**30:.0f} GiB"]
    assert not mem["layout"].get("annotations")
    page = compare_html(plans, [None, None], reports=False)
    assert "Timelines" not in page and "report_A.html" not in page
    rows = re.findall(r"<tr><td class=\"l\"><code>(.*?)</code></td>(.*?)</tr>", page)
    assert [k for k, _ in rows] == ["parallel.pp", "parallel.dp", "parallel.zero"]
    assert re.findall(r"<td class=\"l\">(.*?)</td>", rows[2][1]) == ["3", "1"]


def test_compare_page_draws_the_baseline_and_the_fastest_past_its_limit():
    """Past MAX_TIMELINES plans the page draws the first plan's timeline, the fastest that
    fits, then the fastest others, on the axis of the slowest drawn; it names those left out."""
    from clustersim.output.compare_page import _timelines_html, drawn_timelines

    def plan(label: str, tokens: float, fits: bool = True) -> dict:
        return {"label": label, "summary": {"step_time_s": 1e3 / tokens, "tokens_per_s": tokens, "plan": {},
                                            "memory": {"fits": fits}}}

    plans = [plan("A", 10), plan("B", 50, fits=False), plan("C", 20), plan("D", 40), plan("E", 5)]
    assert drawn_timelines(plans, most=3) == [0, 2, 3]  # A; D, the fastest that fits; then C
    assert drawn_timelines(plans, most=5) == [0, 1, 2, 3, 4]
    layout = {"xaxis": {"range": [0, 1]}, "height": 200}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("clustersim.output.compare_page.MAX_TIMELINES", 3)
        mp.setattr("clustersim.output.compare_page.plan_line", lambda s: "plan")
        text = _timelines_html(plans, [("[]", layout, "caption", None)] * 5)
    assert text.count("Plotly.newPlot") == 3 and "3 of the 5 plans are drawn" in text and "B, E are in" in text
    assert text.count(f'"range":[0,{json.dumps(1e3 * 100.0 * 1.005)}]') == 3  # A's step, the slowest drawn
    assert '"modeBarButtonsToRemove":["autoScale2d"]' in text
    # a plan whose spans past the limit are carried in part says how far, in its caption
    cut = {"until_ms": 2740.0, "carried": 60_000, "of": 468_904, "bounds": [0, 0], "start_ms": "", "dur_ms": "",
           "form": "", "mb": "", "forms": [], "max_dur_ms": [0.0], "labels": ["r"], "in_view": 3000}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("clustersim.output.compare_page.plan_line", lambda s: "plan")
        text = _timelines_html(plans[:1], [("[]", layout, "caption.", cut)])
    assert "caption. Zoomed in, its spans are drawn in the step&#x27;s first 2.74 s (60,000 of 468,904)." in text


def test_compare_page_in_chromium(compared, tmp_path):
    """The page renders offline without an error, and zooming one timeline zooms the others."""
    with offline_page(compared["page"], "#clustersim-timeline-B .main-svg") as (page, errors):
        page.evaluate("Plotly.relayout('clustersim-timeline-A', {'xaxis.range': [100, 250]})")
        page.wait_for_timeout(300)
        ranges = page.evaluate("['A','B'].map(x => document.getElementById('clustersim-timeline-' + x)"
                               ".layout.xaxis.range)")
        bars = page.evaluate("document.getElementById('compare-split').data.map(t => t.x)")
        # zoomed in, each timeline draws the spans in view one by one (clustersim.output.zoom)
        spans = page.evaluate("['A','B'].map(x => document.querySelectorAll("
                              "'#clustersim-timeline-' + x + ' g.clustersim-spans rect').length)")
        # each timeline's plot area: the same left edge and width, so that t = 0 lines up
        areas = page.evaluate("['A','B'].map(x => {const r = document.querySelector("
                              "'#clustersim-timeline-' + x + ' .nsewdrag').getBoundingClientRect();"
                              " return [Math.round(r.left), Math.round(r.width)]})")
        # A zoomed on its rows, then B reset with a double click: both show the whole step, A its rows again
        rows_a = page.evaluate("document.getElementById('clustersim-timeline-A').layout.yaxis.range.slice()")
        page.evaluate("Plotly.relayout('clustersim-timeline-A', {'yaxis.range': [0.6, -0.4]})")
        page.locator("#clustersim-timeline-B .nsewdrag").scroll_into_view_if_needed()
        box = page.locator("#clustersim-timeline-B .nsewdrag").bounding_box()
        page.mouse.dblclick(box["x"] + box["width"] / 2, box["y"] + 10)
        page.wait_for_timeout(800)
        reset = page.evaluate("['A','B'].map(x => document.getElementById('clustersim-timeline-' + x).layout)"
                              ".map(l => [l.xaxis.range, l.yaxis.range])")
        page.screenshot(path=str(tmp_path / "compare.png"), full_page=True)
    assert errors == []
    assert reset[0][1] == rows_a and reset[0][0] == reset[1][0]
    assert ranges == [[100, 250], [100, 250]]
    assert areas[0] == areas[1]
    assert all(0 < n <= DETAIL_IN_VIEW for n in spans), spans
    assert f"Zoomed in to {DETAIL_IN_VIEW:,} spans or fewer in view, a timeline draws each span" in \
        compared["page"].read_text(encoding="utf-8")
    steps = [p["summary"]["step_time_s"] for p in compared["doc"]["plans"]]
    assert [math.fsum(x[i] for x in bars) for i in range(2)] == pytest.approx(steps, rel=1e-9)


def test_an_alias_of_the_same_gpu_is_no_difference(root):
    """compare reads the topology's values: cluster.gpu=H100 on an H100 topology changes
    nothing; 800 Gb/s NICs read against the file's 400."""
    from clustersim.output.compare import effective_config
    from clustersim.overrides import load_variant

    path = root / ZERO3
    base = effective_config(clustersim.load_scenario(path))
    assert config_differences(base, effective_config(load_variant(path, [("cluster.gpu", "H100")]))) == []
    nic = config_differences(base, effective_config(load_variant(path, [("cluster.node.nic.bw_Gbps", 800)])))
    assert nic == [("cluster.node.nic.bw_Gbps", 400.0, 800.0)]


def test_the_fabric_what_if_the_docs_quote(root):
    """getting-started's faster NICs: past 800 Gb/s the PCIe link to the NIC is the narrowest,
    and doubling it too takes the step down by the share the docs give."""
    from clustersim.overrides import load_variant

    path = root / "scenarios" / "moe_1024gpu.yaml"
    steps = {}
    for name, changes in [("base", []), ("800", [("cluster.node.nic.bw_Gbps", 800)]),
                          ("1600", [("cluster.node.nic.bw_Gbps", 1600)]),
                          ("pcie", [("cluster.node.nic.bw_Gbps", 800), ("cluster.node.pcie_GBps", 128)])]:
        steps[name] = clustersim.simulate(load_variant(path, changes), brief=True).summary["step_time_s"]
    assert steps["1600"] == pytest.approx(steps["800"], rel=1e-3) and steps["800"] < steps["base"]
    text = " ".join((root / "docs" / "getting-started.md").read_text().split())
    assert f"cluster.node.pcie_GBps=128` too, {100 * (steps['pcie'] / steps['base'] - 1):.1f} %" in text


def test_twenty_plans_before_a_colour_repeats():
    """compare.html's charts by kind and by stage tell up to twenty plans apart by colour,
    none of them the exposed part's red."""
    from clustersim.output.compare_page import _PARTS, _plan_colour

    colours = [_plan_colour(i) for i in range(20)]
    assert len(set(colours)) == 20 and _plan_colour(20) == colours[0]
    assert dict((label, c) for _, label, c in _PARTS)["exposed communication"] not in colours


def test_a_what_if_variants_timeline_heading_names_it(tmp_path, root):
    """compare.html heads each plan's timeline with its plan line, and with the cluster's
    what-ifs and changes, which the plan line does not show: a variant whose only change is a
    straggler reads differently from the file's own plan."""
    import re

    out = tmp_path / "cmp"
    r = run_cli("compare", "scenarios/llama3_8b_8gpu.yaml", "--variant", "'cluster.what_if=[{gpu: 3, slowdown: 1.2}]'",
                "--out", out, cwd=root)
    assert r.returncode == 0, r.stderr
    heads = re.findall(r"<h3>(.*?)</h3>", (out / "compare.html").read_text())
    assert len(heads) == 2 and "what-if" not in heads[0] and "what-if: GPU 3 1.2x slower" in heads[1]


def test_kinds_that_add_up_past_the_exposed_time_are_explained():
    """Where a plan's "of which" rows add up to more than its exposed communication (a wait on
    two kinds at once counts in both), a line under the table says so; not where they add up."""
    from clustersim.output.compare import overlap_note
    from clustersim.trace import COMM_KINDS

    def summary(tp, dp, total):
        ex = {**{k: 0.0 for k in COMM_KINDS}, "tp": tp, "dp": dp, "total": total}
        return {"exposed_comm_s": ex, "compute_s": 1.0, "bubble": {"bubble_s": 0.0}, "step_time_s": 1.0 + total}

    assert overlap_note([summary(0.3, 0.2, 0.5)]) == []
    said = overlap_note([summary(0.3, 0.2, 0.5), summary(0.4, 0.4, 0.6)])
    assert len(said) == 1 and "counts in both kinds' rows" in said[0]


def test_the_page_s_plans_table_has_hfu_where_a_plan_recomputes(compared):
    """compare.html's table of plans gives HFU beside MFU where a plan recomputes, as the
    terminal's does, and not otherwise."""
    import copy

    from clustersim.output.compare_page import _plans_table

    plans = _plans(compared["doc"])
    for p in plans:
        p["summary"]["plan"]["recompute"] = "none"
    assert "<th>HFU</th>" not in _plans_table(plans, False)
    again = copy.deepcopy(plans)
    again[-1]["summary"]["plan"]["recompute"] = "full"
    page = _plans_table(again, False)
    assert "<th>MFU</th><th>HFU</th>" in page
    assert page.count(f'<td>{100 * again[-1]["summary"]["hfu"]:.1f} %</td>') >= 1
