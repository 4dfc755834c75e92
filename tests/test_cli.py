"""The command line as a user meets it: outputs, schedule grid, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import scenario_dict


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "clustersim", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd)


def write_scenario(tmp_path: Path, root: Path, d: dict, name="s.yaml") -> Path:
    d = dict(d)
    d["cluster"] = {**d["cluster"], "topology": str(root / d["cluster"]["topology"])}
    p = tmp_path / name
    p.write_text(yaml.safe_dump(d, sort_keys=False))
    return p


def test_help():
    r = run_cli("--help")
    assert r.returncode == 0
    for cmd in ("run", "schedule", "validate", "schema"):
        assert cmd in r.stdout


def test_run_writes_summary_report_and_trace(tmp_path, root):
    sc = write_scenario(tmp_path, root, scenario_dict())
    out = tmp_path / "out"
    r = run_cli("run", sc, "--out", out)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["report.html", "summary.json", "trace.json.gz"]
    s = json.loads((out / "summary.json").read_text())
    for key in ("step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "hfu", "bubble_fraction",
                "exposed_comm_s", "memory", "world_size", "plan"):
        assert key in s
    assert s["world_size"] == 16
    assert f"{s['step_time_s']:.4g} s" in r.stdout
    assert "MFU" in r.stdout and "bubble" in r.stdout and "fits" in r.stdout
    # the process ends by os._exit (cli.main, fast_exit): its buffered output is flushed first
    assert r.stdout.splitlines()[-1].startswith("wrote ") and r.stderr == ""
    # nothing left behind but the three outputs
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_run_is_deterministic(tmp_path, root):
    sc = write_scenario(tmp_path, root, scenario_dict())
    outs = []
    for i in range(2):
        assert run_cli("run", sc, "--out", tmp_path / f"o{i}").returncode == 0
        outs.append({p.name: p.read_bytes() for p in (tmp_path / f"o{i}").iterdir()})
    assert outs[0] == outs[1]


def test_schedule_grid():
    r = run_cli("schedule", "--pp", 4, "--microbatches", 8, "--schedule", "1f1b")
    assert r.returncode == 0
    assert r.stdout.splitlines()[0] == "rank 0  | 0F0 0F1 0F2 0F3 .   .   .   0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 .   0B5 .   0B6 .   0B7"


def test_schedule_grid_of_every_schedule_and_a_custom_file(root):
    from clustersim.schedule import SCHEDULE_NAMES

    r = run_cli("schedule", "--help")
    assert all(name in r.stdout for name in SCHEDULE_NAMES)
    r = run_cli("schedule", "--pp", 4, "-m", 8, "--schedule", "interleaved", "--vpp", 2)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith("rank 0  | 0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4")
    for name in ("zb-h1", "dualpipe"):
        r = run_cli("schedule", "--pp", 4, "-m", 8, "--schedule", name)
        assert r.returncode == 0 and len(r.stdout.splitlines()) == 4, r.stderr
    f = root / "scenarios" / "schedules" / "custom_1f1b_4x8.txt"
    custom = run_cli("schedule", "--schedule", "custom", "--file", f)
    assert custom.returncode == 0, custom.stderr
    assert custom.stdout == run_cli("schedule", "--pp", 4, "-m", 8).stdout
    bad = run_cli("schedule", "--pp", 4, "-m", 6, "--schedule", "interleaved")
    assert bad.returncode == 2 and bad.stderr.startswith("error: command line: --schedule: interleaved: ")
    assert "m=6, p=4" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    # a grid too large to build is refused at once, as a scenario's is (it ran for minutes)
    big = run_cli("schedule", "--pp", 100_000, "-m", 100_000)
    assert big.returncode == 2 and big.stderr == ("error: command line: --pp x --microbatches = 10,000,000,000 "
                                                  "stage passes; clustersim takes at most 65,536\n")


BAD = [
    # (what, change to the scenario dict, expected field, expected words)
    ("world size", {"parallel": {"tp": 4, "pp": 2, "dp": 4}}, "parallel", "does not equal the world size 16"),
    ("tp vs heads", {"parallel": {"tp": 16, "pp": 1, "dp": 1}, "model": {"heads": 8}}, "parallel.tp",
     "tp=16 does not divide model.heads=8"),
    ("typo", {"training": {"global_batch_sise": 8}}, "training.global_batch_sise", "unknown key"),
    ("batch", {"training": {"global_batch_size": 7}}, "training.global_batch_size", "not a multiple"),
    ("missing topology", {"cluster": {"topology": "topologies/nope.yaml"}}, "cluster.topology",
     "topology file not found"),
    ("bad schedule", {"parallel": {"schedule": "zigzag"}}, "parallel.schedule", "1f1b"),
    ("interleaved m % pp", {"parallel": {"tp": 2, "pp": 4, "dp": 2, "schedule": "interleaved", "vpp": 2},
                            "training": {"global_batch_size": 12}}, "parallel.schedule",
     "interleaved needs m=6 microbatches"),
    ("negative", {"model": {"layers": -1}}, "model.layers", "greater than or equal to 1"),
]


@pytest.mark.parametrize("what,change,field,words", BAD, ids=[b[0] for b in BAD])
def test_bad_scenario_one_line_exit_2_no_output(tmp_path, root, what, change, field, words):
    d = scenario_dict(**change)
    if what == "missing topology":
        p = tmp_path / "s.yaml"
        p.write_text(yaml.safe_dump(d))
    else:
        p = write_scenario(tmp_path, root, d)
    out = tmp_path / "out"
    r = run_cli("run", p, "--out", out)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert lines[0].startswith(f"error: {p}: {field}: "), lines[0]
    assert words in lines[0]
    assert not out.exists()


def scenario_on_changed_topology(tmp_path: Path, root: Path, **changes) -> tuple[Path, Path]:
    """(topology path, scenario path): the DGX-A100 topology with ``changes``, and SMALL on it."""
    topo = yaml.safe_load((root / "topologies/dgx-a100.yaml").read_text())
    topo.update(changes)
    tp = tmp_path / "topo.yaml"
    tp.write_text(yaml.safe_dump(topo))
    d = scenario_dict()
    d["cluster"]["topology"] = str(tp)
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(d))
    return tp, p


def test_unknown_gpu_names_the_topology_file(tmp_path, root):
    tp, p = scenario_on_changed_topology(tmp_path, root, gpu="Z9000")
    r = run_cli("run", p, "--out", tmp_path / "out")
    assert r.returncode == 2
    assert r.stderr.startswith(f"error: {tp}: gpu: unknown GPU 'Z9000'")
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_folder_given_for_a_file_is_named_a_folder(tmp_path, root):
    """A folder where a file belongs (the scenario, the topology it names) is said to be one,
    not "not found", with exit code 2 and nothing written."""
    r = run_cli("run", tmp_path, "--out", tmp_path / "out")
    assert r.returncode == 2
    assert r.stderr == f"error: {tmp_path}: this is a folder; give the scenario file in it\n"
    d = scenario_dict()
    d["cluster"]["topology"] = str(root / "topologies")
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(d))
    r = run_cli("run", p, "--out", tmp_path / "out")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"error: {p}: cluster.topology: topology file ") and "is a folder" in r.stderr
    assert not (tmp_path / "out").exists()


def test_an_out_folder_that_cannot_be_one_is_refused_before_the_run(tmp_path, root):
    """``--out`` naming a file, or a folder under a file, is bad input: one line, exit code 2,
    the file as it was and nothing written (it was a traceback from the move into place)."""
    f = tmp_path / "f"
    f.write_text("keep")
    scenario = root / "scenarios/llama3_8b_8gpu.yaml"
    for out, said in ((f, f"--out: {f} is a file; give a folder for summary.json, report.html, trace.json.gz"),
                      (f / "sub", f"--out: {f} is a file, not a folder")):
        r = run_cli("run", scenario, "--out", out)
        assert r.returncode == 2 and r.stderr == f"error: command line: {said}\n"
        assert f.read_text() == "keep" and sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_out_folders_the_files_cannot_go_into_are_refused_before_the_run(tmp_path, root):
    """A folder already holding a folder where an output file goes (os.replace would fail
    after two files moved in: half-written), a link to nothing, a name past 255 bytes and,
    for a user who cannot write there, a read-only folder: one line, exit code 2, nothing
    written, before the step is simulated."""
    scenario = root / "scenarios/llama3_8b_8gpu.yaml"
    held = tmp_path / "held"
    (held / "trace.json.gz").mkdir(parents=True)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    long = tmp_path / ("x" * 300)
    cases = [(held, f"--out: {held / 'trace.json.gz'} is a folder; the run writes a file of that name"),
             (dangling, f"--out: {dangling} is a link to nothing; give a folder for summary.json, report.html, "
                        "trace.json.gz"),
             (long, f"--out: a folder name in {str(long)[:48]}... is longer than 255 bytes")]
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        cases.append((ro, f"--out: cannot write in {ro} (permission denied)"))
    for out, said in cases:
        r = run_cli("run", scenario, "--out", out)
        assert r.returncode == 2 and r.stderr == f"error: command line: {said}\n"
    assert sorted(p.name for p in held.iterdir()) == ["trace.json.gz"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["held", "dangling"] + (["ro"] if len(cases) > 3 else []))


def test_missing_scenario_and_invalid_yaml(tmp_path):
    r = run_cli("run", tmp_path / "none.yaml")
    assert r.returncode == 2 and "scenario file not found" in r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    r = run_cli("validate", bad)
    assert r.returncode == 2 and "invalid YAML" in r.stderr and "Traceback" not in r.stderr


def test_validate_and_schema(root):
    r = run_cli("validate", *sorted((root / "scenarios").glob("*.yaml")))
    assert r.returncode == 0, r.stderr
    r = run_cli("schema")
    assert r.returncode == 0
    schema = json.loads(r.stdout)
    assert {"cluster", "model", "parallel", "training"} <= set(schema["properties"])


def test_stale_outputs_of_an_earlier_run_are_removed(tmp_path, root):
    sc = write_scenario(tmp_path, root, scenario_dict())
    out = tmp_path / "out"
    assert run_cli("run", sc, "--out", out).returncode == 0
    assert run_cli("run", sc, "--out", out, "--no-report", "--no-trace").returncode == 0
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]


def test_multi_node_topology_without_fabric_is_refused(tmp_path, root):
    tp, p = scenario_on_changed_topology(tmp_path, root, fabric={"kind": "none"})
    r = run_cli("validate", p)
    assert r.returncode == 2
    assert r.stderr.startswith(f"error: {tp}: ") and "fabric.kind is 'none'" in r.stderr


def test_an_interrupt_after_the_files_are_in_place_says_so(tmp_path, root, monkeypatch, capsys):
    """Ctrl-C while the summary is printed: the files are already in place, so clustersim run
    says they are (exit 130) rather than that nothing was written."""
    from clustersim.cli import EXIT_INTERRUPTED, main
    from clustersim.output import summary

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(summary, "format_summary", interrupted)
    sc = write_scenario(tmp_path, root, scenario_dict())
    out = tmp_path / "out"
    try:
        code = main(["run", str(sc), "--out", str(out)])
    except KeyboardInterrupt:  # (not let through to pytest, which would stop the session)
        pytest.fail("the interrupt went through clustersim run")
    assert code == EXIT_INTERRUPTED
    assert capsys.readouterr().err.strip() == f"interrupted: the outputs are written, in {out}"
    assert sorted(p.name for p in out.iterdir()) == ["report.html", "summary.json", "trace.json.gz"]


def test_a_step_past_what_the_trace_file_holds_is_refused(monkeypatch, root, tmp_path, capsys):
    """A step longer than ``api.MAX_STEP_S`` (inputs within their bounds can still multiply to
    one: a huge model on a slow, degraded cluster) is refused after the run, in one line, exit
    code 2 and nothing written: its nanoseconds would overflow the trace file's 64 bits past 292
    years (a corrupt trace.json.gz before). Lowered here to a millisecond."""
    from clustersim import api
    from clustersim.cli import main

    monkeypatch.setattr(api, "MAX_STEP_S", 1e-3)
    scenario = root / "scenarios/llama3_8b_8gpu.yaml"
    out = tmp_path / "out"
    rc = main(["run", str(scenario), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"error: {scenario}: model: the simulated step lasts 3.44 s, more than 1e-03 s")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []
