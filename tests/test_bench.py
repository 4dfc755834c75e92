"""bench/bench_scale.py still measures what it says: run on a small scenario, it prints every
row, and its sizes are those of the program the lowering makes (the benchmark imports the
engine, the lowering and the writers phase by phase, so an API change would break it silently)."""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys

import pytest
from clustersim.config import load_scenario
from clustersim.program.lower import lower

from .conftest import ROOT

SCENARIO = ROOT / "scenarios" / "llama3_8b_8gpu.yaml"
# a line of bench_sweep.py: the plan (tp, pp, dp, zero, recompute) and its step
SWEEP_LINE = re.compile(r"^tp(\d) pp(\d) dp(\d+) zero(\d) (\w+)\s+[\d.]+\s+([\d.]+)\s", re.M)


def _bench(name: str):
    """The module of bench/``name``.py, loaded as its scripts run (bench/ on the path)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return mod


def _rows() -> list[str]:
    return [label for label, _, _ in _bench("bench_scale").ROWS]


def test_bench_scale_prints_every_row_with_the_program_s_sizes():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_scale.py"), "--only", str(SCENARIO)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    values = {}
    for label in _rows():
        m = re.search(rf"^{re.escape(label)}\s+([\d,.]+)\s*$", run.stdout, re.M)
        assert m, f"row {label!r} missing from:\n{run.stdout}"
        values[label] = float(m[1].replace(",", ""))
    prog, _ = lower(load_scenario(SCENARIO))
    assert values["tasks"] == len(prog.items)
    # the tasks of every GPU the results describe: those the all-ranks program holds
    assert values["every GPU's tasks"] == len(lower(load_scenario(SCENARIO), collapse=False)[0].items) > len(prog.items)
    assert values["GPUs"] == 8 and values["simulated ranks"] == len(prog.ranks)
    assert values["simpy events"] > 0 and values["peak RSS MiB"] > 0
    assert values["total s"] >= values["engine s"] > 0


def test_bench_scale_measures_the_moe_plan_with_other_microbatches():
    """``moe:M``, the --sweep's points of moe_1024gpu's plan: that scenario with M microbatches
    (its global batch M x DP), the program the lowering makes of it."""
    import json

    from clustersim.api import with_microbatches

    run = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_scale.py"), "--child", "moe:8"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.splitlines()[-1])
    prog, _ = lower(with_microbatches(load_scenario(ROOT / "scenarios" / "moe_1024gpu.yaml"), 8))
    assert (got["gpus"], got["microbatches"], got["tasks"]) == (1024, 8, len(prog.items))


def test_after_fork_shows_both_processes_and_every_trace_piece():
    # bench/after_fork.py wraps the writer's and the summary's functions by name: a renamed
    # one would leave its phase out of the timeline, or fail
    import sys as _sys

    import clustersim
    from clustersim.output import perfetto

    run = subprocess.run([_sys.executable, str(ROOT / "bench" / "after_fork.py"), str(SCENARIO)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    for who, what in [("parent", "fork done"), ("parent", "summary done"), ("parent", "checks done"),
                      ("writer", "report bars done"), ("writer", "report page done"),
                      ("writer", "trace file put together done"), ("parent", "files in place")]:
        assert re.search(rf"^\s+[\d.]+\s+{who}\s+{what}$", out, re.M), f"{who} {what!r} missing from:\n{out}"
    assert re.search(r"^\s+[\d.]+\s+(parent|writer)\s+link use done$", out, re.M), out
    m = re.search(r"pieces of the trace file: parent (\d+), writer (\d+) \((\d+) in all\)", out)
    count = perfetto.piece_count(clustersim.simulate(SCENARIO).trace)
    assert m and int(m[1]) + int(m[2]) == int(m[3]) == count, out
    assert float(re.search(r"in place ([\d.]+) s after", out)[1]) > 0


def test_fuzz_repeat_compares_a_drawn_plan():
    """bench/fuzz_repeat.py draws a plan, simulates it whole and with its cycle copied in, and
    says whether they agree (seed 0's first plan: DualPipeV with EP, a cycle of 1)."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "fuzz_repeat.py"), "0", "1"], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "simulated, cycle" in r.stdout and "0 plan(s) differ" in r.stdout


def test_fuzz_symmetry_says_how_far_the_collapse_is():
    """bench/fuzz_symmetry.py's verdicts: the step's relative difference sorts a plan; the
    compute time and the memory's static parts must not differ at all (BROKEN); what the
    memory holds at its peak may (the buffers in flight then depend on timing)."""
    import copy

    import clustersim

    fz = _bench("fuzz_symmetry")
    base = clustersim.simulate(SCENARIO).summary

    def changed(edit) -> dict:
        s = copy.deepcopy(base)
        edit(s)
        return s

    def times(k: float):
        return lambda s: s.update(step_time_s=s["step_time_s"] * k)

    assert fz.compare(base, base)[0] == "exact"
    verdict, step, _ = fz.compare(changed(times(0.98)), base)
    assert verdict == "BELOW" and abs(step + 0.02) < 1e-12
    assert fz.compare(changed(times(1.02)), base)[0] == "above"
    assert fz.compare(changed(times(1.005)), base)[0] == "within 1%"
    assert fz.compare(changed(lambda s: s.update(compute_s=s["compute_s"] * 1.001)), base)[0] == "BROKEN"
    stage = ("memory", "stages", 0)
    for key, verdict in (("params_bytes", "BROKEN"), ("inflight_microbatches", "BROKEN"),
                         ("comm_buffers_bytes", "within 1%"), ("peak_bytes", "within 1%")):
        def edit(s, key=key):
            s[stage[0]][stage[1]][stage[2]][key] = s[stage[0]][stage[1]][stage[2]][key] * 1.001 + 1
        got, _, said = fz.compare(changed(edit), base)
        assert got == verdict, key
        assert verdict == "BROKEN" or "memory at the peak" in said


def test_fuzz_symmetry_finds_any_other_figure_that_differs():
    """Past the headline figures, the rest of summary.json but the run's own description: a
    critical-path figure or what shared a cause's bottleneck is named; a bottleneck that names
    another link (twins sharing it: by design) leaves that cause's bottleneck and sharers out,
    and the run's own figures (simulation, the simulated ranks) never count."""
    import copy

    import clustersim

    fz = _bench("fuzz_symmetry")
    base = clustersim.simulate(ROOT / "scenarios" / "dualpipe.yaml").summary
    assert base["exposed_comm_causes"][0]["shared_with"]
    assert fz.other_figures(base, base) == ""
    s = copy.deepcopy(base)
    s["critical_path"]["length_s"] *= 1.001
    assert fz.other_figures(s, base) == ".critical_path.length_s"
    s = copy.deepcopy(base)
    s["exposed_comm_causes"][0]["shared_with"][0]["overlap_s"] *= 2
    assert fz.other_figures(s, base) == ".exposed_comm_causes[0].shared_with[0].overlap_s"
    s["exposed_comm_causes"][0]["bottleneck"]["link"] = "leaf0.0->spine0"
    s["simulation"]["simulated_ranks"] += 1
    assert fz.other_figures(s, base) == ""
    s = copy.deepcopy(base)  # the same link, loaded by twins collapsed: not alone rank by rank
    s["exposed_comm_causes"][0]["bottleneck"]["busy_s"] *= 8
    s["exposed_comm_causes"][0]["alone"] = not s["exposed_comm_causes"][0]["alone"]
    assert fz.other_figures(s, base) == ""
    s["exposed_comm_causes"].pop()  # a cause less: both paths said
    assert fz.other_figures(s, base).endswith(" against .exposed_comm_causes[7].collective")


def test_fuzz_symmetry_compares_drawn_plans():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "fuzz_symmetry.py"), "0", "2"], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 8 and all(re.search(r"\d+ of \d+ ranks, [\d.]+ s against [\d.]+ s", x) for x in lines[:2])
    assert re.fullmatch(r"(\d+ [\w% ]+, ){5}\d+ refused", lines[2]) and " 0 BROKEN" in lines[2]
    assert lines[3].startswith("flagged (simulation.asymmetric_orbits): ")
    # every GPU's links, collapsed, as rank by rank's (engine.sim.Engine._twins_links, analysis.links.every_gpu_rows)
    assert lines[4] == "every GPU's links: 0 plan(s) with other link counts or bytes than rank by rank's"
    # every other figure of summary.json, on the plans exact on the headline ones
    assert lines[5] == "every other figure: 0 exact plan(s) with another than rank by rank's"
    assert lines[6].startswith("the collapsed step against the all-ranks one: ")
    assert re.fullmatch(r"one kind's exposed time: \d plan\(s\) more than 10 % apart, at most [\d.]+% of the larger "
                        r"\(plan \d\)", lines[7])


def test_fuzz_symmetry_says_which_plans_the_summary_flagged():
    """A plan's line ends with the communications its collapsed summary says moved at their
    slowest twin's pace, and the closing line counts the verdicts of the flagged plans apart."""
    from collections import Counter

    fz = _bench("fuzz_symmetry")
    assert fz.flagged({"simulation": {"asymmetric_orbits": None}}) == ""
    assert fz.flagged({"simulation": {"asymmetric_orbits": {"dp": 1, "pp": 4}}}) == " [slowest twin: dp 1, pp 4]"
    flags = Counter({(True, "above"): 2, (True, "exact"): 3, (False, "exact"): 7, (False, "BELOW"): 1})
    assert fz.flagged_counts(flags) == ("flagged (simulation.asymmetric_orbits): 3 exact, 2 above; "
                                        "not flagged: 7 exact, 1 BELOW")
    assert fz.flagged_counts(Counter({(False, "exact"): 2})).endswith(": none; not flagged: 2 exact")


def test_fuzz_fabrics_draws_a_fabric_and_a_plan_and_compares_them():
    """bench/fuzz_fabrics.py varies the fabric under a drawn plan and gives fuzz_symmetry's
    verdict (seed 0's first plan: a 3-tier fat tree, TP4 x DP32, exact)."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "fuzz_fabrics.py"), "0", "1"], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 5 and re.fullmatch(r"\s+0 \S+\s+\d+ nodes (leaf_spine|fat_tree) .*: exact "
                                            r"\(1 of 128 ranks\)", lines[0]), lines
    assert lines[1] == "1 exact, 0 within 1%, 0 above, 0 BELOW, 0 BROKEN, 0 failed, 0 refused"
    assert lines[2] == "flagged (simulation.asymmetric_orbits): none; not flagged: 1 exact"
    assert lines[3] == "every other figure: 0 exact plan(s) with another than rank by rank's"
    # each DP replica apart (--classes replica): the same plan, exact too, one rank per replica
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "fuzz_fabrics.py"), "0", "1", "--classes", "replica"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == [lines[0].replace("(1 of 128 ranks)", "(32 of 128 ranks)"), *lines[1:]]
    args = _bench("fuzz_args")
    assert args.with_classes({"simulation": {"repeat": False}}, "replica") == {
        "simulation": {"repeat": False, "split_replicas": True}}
    assert args.with_classes({"name": "x"}, "stage") == {"name": "x"}


def test_scale_scan_plans_are_valid_scenarios_and_the_smallest_runs(tmp_path):
    # bench/scale_scan.py makes its plans itself: a config change that refuses one would only
    # show when someone runs the scan
    from clustersim.config import load_scenario as load

    scan = _bench("scale_scan")
    for name in scan.PLANS:
        sc = load(scan.scenario(name))
        assert sc.mesh.world_size == scan.scenario(name)["cluster"]["nodes"] * sc.topology.node.gpus, name
    got = scan.run("gb200_144_zero3", tmp_path)
    assert (got["gpus"], got["ranks"]) == (144, 1) and got["spans"] > 0 and got["wall_s"] > 0 and got["rss_MiB"] > 0


def test_bench_sweep_times_the_plans_it_names():
    # each line's step time is that of the plan it names, simulated alone: the sweep's
    # variants are the plans they say (a field dropped or renamed would sweep one plan)
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_sweep.py"), str(SCENARIO), "--limit", "4",
                          "--fresh-cluster"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = SWEEP_LINE.findall(run.stdout)
    assert len(lines) == 4 and "plans timed 4" in run.stdout
    # two worker processes sharing one cluster: the same plans in the same order, the same steps
    two = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_sweep.py"), str(SCENARIO), "--limit", "4",
                          "--jobs", "2"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    assert SWEEP_LINE.findall(two.stdout) == lines
    assert "with 2 processes" in two.stdout
    mod = _bench("bench_sweep")
    import yaml

    from clustersim import simulate
    base = yaml.safe_load(SCENARIO.read_text())
    steps = set()
    for tp, pp, dp, zero, rc, step in lines[::3]:
        d = mod.variant(base, 8, 8, int(tp), int(pp), int(dp), int(zero), rc)
        got = simulate(load_scenario(d, base_dir=SCENARIO.parent)).summary["step_time_s"]
        assert f"{got:.3f}" == step
        steps.add(step)
    assert len(steps) == 2  # the plans differ


@pytest.mark.parametrize("name", ["korthikanti_22b_seqsel", "moe_1024gpu", "dualpipe", "long_context_cp_128k"])
def test_bench_sweep_variants_are_valid_plans_of_their_scenario(name):
    # SP only where tp > 1, EP as far as DP allows, no layer split or schedule of another pp:
    # a variant the sweep made invalid would be reported as refused by the scenario's rules
    mod = _bench("bench_sweep")
    import yaml

    path = ROOT / "scenarios" / f"{name}.yaml"
    base = yaml.safe_load(path.read_text())
    sc0 = load_scenario(path)
    gpus, per_node = sc0.mesh.world_size, sc0.cluster.gpus_per_node
    for tp, pp, dp, zero, rc in mod.plans(base["model"], gpus, every=False)[::3]:
        d = mod.variant(base, per_node, gpus, tp, pp, dp, zero, rc)
        d["training"]["global_batch_size"] = dp * d["training"].get("micro_batch_size", 1) * max(pp, 1)
        sc = load_scenario(d, base_dir=path.parent)
        p = sc.parallel
        assert (p.tp, p.pp, p.dp, p.zero) == (tp, pp, dp, zero) and sc.cfg.training.recompute == rc
        assert p.sp == (tp > 1 and (bool(base["parallel"].get("sp")) or p.ep > 1))  # (EP with TP needs SP)
        assert p.ep == math.gcd(base["parallel"].get("ep", 1), dp)


@pytest.mark.parametrize("script, args", [("fuzz_plans.py", ["400", "0"]), ("fuzz_symmetry.py", ["1", "-3"]),
                                          ("fuzz_scenarios.py", ["0"]), ("fuzz_topologies.py", ["0"])])
def test_fuzz_scripts_refuse_a_count_that_would_check_nothing(script, args):
    """Zero plans or documents would check nothing and say it passed; a negative count too."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True)
    assert r.returncode == 2 and "is less than 1" in r.stderr and "Traceback" not in r.stderr, r.stderr
