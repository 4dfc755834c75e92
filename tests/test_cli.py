"""The command line as a user meets it: outputs, schedule grid, and bad input."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import files_of, scenario_dict, shipped_scenarios, shipped_topologies


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
    for cmd in ("run", "compare", "sweep", "advise", "schedule", "validate", "schema", "collective"):
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
    assert f"step time       {s['step_time_s']:#.4g} s" in r.stdout  # (four digits, trailing zeros kept)
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
        outs.append(files_of(tmp_path / f"o{i}"))
    assert outs[0] == outs[1]


def test_run_with_changes(tmp_path, root):
    """run --set: the file with the changes, as a variant of compare or sweep simulates it;
    the summary's description names them; bad changes refused like bad files, nothing written."""
    import clustersim
    from clustersim.overrides import load_variant

    path = "scenarios/llama3_8b_8gpu.yaml"
    r = run_cli("run", path, "--set", "parallel.tp=2 parallel.dp=4", "--set", "training.recompute=selective",
                "--no-trace", "--out", tmp_path / "o", cwd=root)
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    changes = [("parallel.tp", 2), ("parallel.dp", 4), ("training.recompute", "selective")]
    direct = clustersim.simulate(load_variant(root / path, changes)).summary
    assert s["step_time_s"] == direct["step_time_s"] and s["plan"]["tp"] == 2
    assert s["description"] == f"{path} with parallel.tp=2 parallel.dp=4 training.recompute=selective"
    assert s["description"] in r.stdout and s["scenario"] == "llama3-8b-8gpu"
    for given, says in [("parallel.tp=3", f"error: {path} with parallel.tp=3: parallel: tp*pp*dp"),
                        # (the dp that fills the GPUs, where one does: what sweep and advise let follow)
                        ("parallel.tp=8", "= 16 does not equal the world size 8 (cluster: 1 node x 8 GPUs); "
                                          "parallel.dp=1 fills them"),
                        ("parallel.tp", "error: command line: --set 'parallel.tp': 'parallel.tp' is not KEY=VALUE"),
                        ("parallel.tpp=2", "parallel.tpp: unknown key")]:
        r = run_cli("run", path, "--set", given, "--out", tmp_path / "bad", cwd=root)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not (tmp_path / "bad").exists()


def test_run_with_changes_writes_beside_the_files_own_outputs(tmp_path, root):
    """Without --out, run --set writes to out/<stem>+<key>=<value>+..., not over the file's
    own out/<stem>: a baseline and its variant side by side. Characters a folder name should
    not hold become _ and a checksum of the changes ends the name; so does it a name cut at
    OUT_NAME_MAX."""
    from clustersim.cli import OUT_NAME_MAX, _default_out

    path = root / "scenarios/llama3_8b_8gpu.yaml"
    assert run_cli("run", path, "--no-trace", "--no-report", cwd=tmp_path).returncode == 0
    r = run_cli("run", path, "--set", "parallel.tp=2 parallel.dp=4", "--no-trace", "--no-report", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    base = json.loads((tmp_path / "out" / "llama3_8b_8gpu" / "summary.json").read_text())
    changed = json.loads((tmp_path / "out" / "llama3_8b_8gpu+parallel.tp=2+parallel.dp=4" / "summary.json").read_text())
    assert base["plan"]["tp"] != 2 and changed["plan"]["tp"] == 2
    assert "out/llama3_8b_8gpu+parallel.tp=2+parallel.dp=4/summary.json" in r.stdout
    what_if = _default_out("x.yaml", [("cluster.what_if", [{"gpu": 5, "slowdown": 1.2}])])
    assert re.fullmatch(r"x\+cluster\.what_if=_gpu_5_slowdown_1\.2_~[0-9a-f]{8}", what_if.name), what_if
    # cleaned alike, told apart by the checksum; a value YAML reads as bytes named too
    names = {_default_out("x.yaml", [("description", d)]).name for d in ("run A", "run/A", "run_A", "run A.")}
    assert len(names) == 4 and "x+description=run_A" in names
    assert not any(n.endswith(".") for n in names)
    assert _default_out("x.yaml", [("name", b"hello")]).name.startswith("x+name=_binary_aGVsbG8=~")
    long = [_default_out("x.yaml", [("name", "n" * 200 + tail)]) for tail in "ab"]
    assert len(long[0].name) == OUT_NAME_MAX and long[0] != long[1]


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
    for name in ("zb-h1", "dualpipe", "dualpipev"):
        r = run_cli("schedule", "--pp", 4, "-m", 8, "--schedule", name)
        assert r.returncode == 0 and len(r.stdout.splitlines()) == 4, r.stderr
    f = root / "scenarios" / "schedules" / "custom_1f1b_4x8.txt"
    custom = run_cli("schedule", "--schedule", "custom", "--file", f)
    assert custom.returncode == 0, custom.stderr
    assert custom.stdout == run_cli("schedule", "--pp", 4, "-m", 8).stdout
    bad = run_cli("schedule", "--pp", 4, "-m", 6, "--schedule", "interleaved")
    assert bad.returncode == 2 and bad.stderr.startswith("error: command line: --microbatches: interleaved: ")
    assert "m=6 microbatches in groups of 4" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    # a grid too large to build is refused at once, as a scenario's is (it ran for minutes)
    big = run_cli("schedule", "--pp", 100_000, "-m", 100_000)
    assert big.returncode == 2 and big.stderr == ("error: command line: --pp x --microbatches = 10,000,000,000 "
                                                  "stage passes; clustersim takes at most 65,536\n")


def test_schedule_grid_combined():
    """--combined prints combined 1F1B's chunks (the backward marked &) and is refused where the
    schedule has no steady 1F1B pairs to combine."""
    r = run_cli("schedule", "--pp", 1, "-m", 4, "--combined")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "rank 0  | 0F0  0F1  &0B0 0F2  &0B1 0F3  &0B2 0B3\n"
    r = run_cli("schedule", "--pp", 4, "-m", 8, "--schedule", "interleaved", "--combined")
    assert r.returncode == 0 and r.stdout.count("&") == sum(
        8 * 2 - min(2 * (4 - k - 1) + 4 + 1, 16) for k in range(4)), r.stderr  # the steady pairs
    bad = run_cli("schedule", "--pp", 4, "-m", 8, "--combined")  # (1f1b)
    assert bad.returncode == 2 and bad.stderr == ("error: command line: --combined: with --pp 4 Megatron-LM combines "
                                                  "the interleaved schedule only (1f1b without a pipeline)\n")
    bad = run_cli("schedule", "--pp", 4, "-m", 8, "--schedule", "zb-h1", "--combined")
    assert bad.returncode == 2 and bad.stderr == ("error: command line: --combined pairs the forwards and backwards "
                                                  "of 1f1b or interleaved (schedule is zb-h1)\n")


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


def test_an_out_through_a_folder_not_there_makes_no_folder(tmp_path, root):
    """``--out o2/..`` with no o2 is the folder itself: the files go there, and no empty o2
    is left behind (mkdir made it on the way)."""
    r = run_cli("run", root / "scenarios/llama3_8b_8gpu.yaml", "--out", "o2/..", "--no-trace", "--no-report",
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


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


def test_validate_checks_every_file_after_a_bad_one(tmp_path, root):
    """A glob's later files are still checked: a line per file, an error line per bad one, exit 2."""
    typo = tmp_path / "typo.yaml"
    typo.write_text("paralel: {}\n")
    missing = tmp_path / "missing.yaml"
    good = shipped_scenarios(root)[:2]
    r = run_cli("validate", good[0], typo, good[1], missing)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert [ln.split(": ok")[0] for ln in r.stdout.splitlines()] == [str(good[0]), str(good[1])]
    errors = r.stderr.splitlines()
    assert len(errors) == 3 and str(typo) in errors[0] and str(missing) in errors[1]
    assert errors[2] == "error: 2 of 4 files are not valid"


def test_validate_with_changes(tmp_path, root):
    """``validate --set`` checks the scenario as ``run --set`` would make it: a good change is
    named on its ok line (with the changed plan's floor), a bad one refused as run refuses it,
    and a topology file with changes refused (they are a scenario's), exit 2."""
    path = "scenarios/llama2_70b_64gpu.yaml"
    r = run_cli("validate", path, "--set", "parallel.pp=8 parallel.dp=1", cwd=root)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"{path} with parallel.pp=8 parallel.dp=1: ok (64 GPUs, TP8 x PP8 x DP1, "
                               "128 microbatches")
    plain = run_cli("validate", path, cwd=root).stdout
    assert plain.split("memory at least")[1] != r.stdout.split("memory at least")[1]
    bad = run_cli("validate", path, "--set", "parallel.pp=3", cwd=root)
    ran = run_cli("run", path, "--set", "parallel.pp=3", "--out", tmp_path / "x", cwd=root)
    assert bad.returncode == ran.returncode == 2 and bad.stderr == ran.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "x").exists()
    topo = run_cli("validate", "topologies/dgx-h100.yaml", "--set", "parallel.pp=3", cwd=root)
    assert topo.returncode == 2 and "is a topology file" in topo.stderr and topo.stdout == ""
    # a link that caps the NICs is said on the ok line, as run's cluster line says it
    r = run_cli("validate", path, "--set", "cluster.node.nic.bw_Gbps=800", cwd=root)
    assert r.stdout.rstrip().endswith("; PCIe at 64 GB/s caps the NICs' 90 GB/s between nodes; node.pcie_GBps "
                                      "raises it)")
    assert "caps" not in run_cli("validate", path, "topologies/dgx-h100.yaml", cwd=root).stdout


def test_validate_and_schema(root):
    r = run_cli("validate", *shipped_scenarios(root))
    assert r.returncode == 0, r.stderr
    r = run_cli("schema")
    assert r.returncode == 0
    schema = json.loads(r.stdout)
    assert {"cluster", "model", "parallel", "training"} <= set(schema["properties"])


def _schema_paths(schema: dict, node: dict, prefix: str = "") -> set[str]:
    """Every dotted field path a JSON schema object ``node`` admits (references followed)."""
    if len(node.get("allOf", ())) == 1:  # (older pydantic, 2.5 among them, wraps a reference so)
        node = node["allOf"][0]
    if "$ref" in node:
        node = schema["$defs"][node["$ref"].rsplit("/", 1)[1]]
    out = set()
    for name, sub in node.get("properties", {}).items():
        out.add(prefix + name)
        for option in sub.get("anyOf", [sub]):
            out |= _schema_paths(schema, option, f"{prefix}{name}.")
    return out


def test_the_scenario_schema_describes_the_topology_overrides(root):
    """``cluster.node`` and ``cluster.fabric`` are overrides of the topology's sections, merged
    key by key: the schema gives them the topology's fields, nested ones too, none required
    and none with a default (a key left out keeps the topology file's value), where it had a
    free mapping; the rest of the scenario schema is the pydantic model's."""
    from clustersim.config import ScenarioCfg
    from clustersim.hardware.topology import TopologyCfg

    schema = json.loads(run_cli("schema").stdout)
    topo = TopologyCfg.model_json_schema()
    for key in ("node", "fabric"):
        field = schema["$defs"]["ClusterRef"]["properties"][key]
        assert field["anyOf"][1] == {"type": "null"}
        assert _schema_paths(schema, field["anyOf"][0]) == _schema_paths(topo, topo["properties"][key])
    overrides = {k: v for k, v in schema["$defs"].items() if k.endswith("Override")}
    assert sorted(overrides) == ["FabricCfgOverride", "HostCfgOverride", "LinkCfgOverride", "NicCfgOverride",
                                 "NodeCfgOverride"]
    assert not {"required", "default"} & _keys_anywhere(overrides)
    assert overrides["FabricCfgOverride"]["properties"]["kind"]["enum"] == ["leaf_spine", "fat_tree", "none"]
    # every key the shipped topologies write in those sections is one the schema names
    written = set()
    for path in shipped_topologies(root):
        doc = yaml.safe_load(path.read_text())
        for key in ("node", "fabric"):
            written |= {f"{key}.{p}" for p in _key_paths(doc.get(key) or {})}
    named = {f"{k}.{p}" for k in ("node", "fabric")
             for p in _schema_paths(schema, schema["$defs"]["ClusterRef"]["properties"][k]["anyOf"][0])}
    assert written and written <= named
    # and nothing else changed
    plain = ScenarioCfg.model_json_schema()
    for key in ("node", "fabric"):
        del schema["$defs"]["ClusterRef"]["properties"][key]["anyOf"]
        del plain["$defs"]["ClusterRef"]["properties"][key]["anyOf"]
    assert {k: v for k, v in schema["$defs"].items() if k not in overrides} == plain["$defs"]
    assert {k: v for k, v in schema.items() if k != "$defs"} == {k: v for k, v in plain.items() if k != "$defs"}


def _keys_anywhere(obj) -> set[str]:
    """Every key of every dict in a JSON-like value."""
    if isinstance(obj, dict):
        return set(obj).union(*(_keys_anywhere(v) for v in obj.values()))
    if isinstance(obj, list):
        return set().union(*(_keys_anywhere(v) for v in obj))
    return set()


def _key_paths(d: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in d.items():
        out.add(prefix + k)
        if isinstance(v, dict):
            out |= _key_paths(v, f"{prefix}{k}.")
    return out


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
    assert re.match(rf"error: {re.escape(str(scenario))}: model: the simulated step lasts \d+\.\d\d s, more than "
                    r"1e-03 s", err), err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


def one_line_exit_2(r, start: str) -> None:
    """Bad input on the command line: exit code 2, one line beginning ``start``, no traceback."""
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(start) and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout == ""


def test_schedule_file_is_read_as_a_scenarios_is(tmp_path, root):
    """``schedule --file`` reads the file as a scenario's schedule_file: a file not UTF-8 or
    past 2 MiB is refused by name (it was a UnicodeDecodeError traceback, and no size limit);
    so is a file that cannot be read."""
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe0F0 0B0\n")
    r = run_cli("schedule", "--schedule", "custom", "--file", binary)
    one_line_exit_2(r, f"error: command line: --file: {binary} is not a text file (byte 0 is not UTF-8)")
    big = tmp_path / "big.txt"
    big.write_text("0F0 0B0 " * 300_000 + "\n")
    r = run_cli("schedule", "--schedule", "custom", "--file", big)
    one_line_exit_2(r, f"error: command line: --file: {big} is 2,400,001 bytes; a custom schedule is parsed whole")
    if os.geteuid() != 0:  # root reads anything
        locked = tmp_path / "locked.txt"
        locked.write_text("0F0 0B0\n")
        locked.chmod(0)
        r = run_cli("schedule", "--schedule", "custom", "--file", locked)
        one_line_exit_2(r, f"error: command line: --file: cannot read {locked}: Permission denied")


def test_schedule_custom_refuses_vpp(root):
    """--vpp with a custom schedule is refused as with the other non-interleaved ones (it was
    ignored without a word)."""
    f = root / "scenarios" / "schedules" / "custom_1f1b_4x8.txt"
    r = run_cli("schedule", "--schedule", "custom", "--file", f, "--vpp", 2)
    one_line_exit_2(r, "error: command line: --vpp is used by --schedule interleaved only (schedule is custom")


def test_schedule_prints_interleaved_groups(root):
    """``schedule --vpp-group``: 6 microbatches on 4 ranks in one group of 6 (each chunk runs
    all six before the next); the default group of 4 is refused, and so is the flag elsewhere."""
    r = run_cli("schedule", "--pp", 4, "-m", 6, "--schedule", "interleaved", "--vpp-group", 6)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].split()[3:15] == [f"{s}F{mb}" for s in (0, 4) for mb in range(6)]
    r = run_cli("schedule", "--pp", 4, "-m", 6, "--schedule", "interleaved")
    one_line_exit_2(r, "error: command line: --microbatches: interleaved: m=6 microbatches in groups of 4 leave a "
                       "last group of 2, fewer than p=4")
    # each refusal names the flag it is about
    for args, flag in ((("--pp", 4, "-m", 8, "--vpp", 0), "--vpp"), (("--pp", 4, "-m", 10, "--vpp-group", 3), "--vpp-group"),
                       (("--pp", 1, "-m", 4), "--pp"), (("--pp", 8, "-m", 4), "--microbatches")):
        r = run_cli("schedule", "--schedule", "interleaved", *args)
        one_line_exit_2(r, f"error: command line: {flag}: interleaved: ")
    r = run_cli("schedule", "--schedule", "dualpipe", "--pp", 3, "-m", 8)
    one_line_exit_2(r, "error: command line: --pp: dualpipe: ")
    # the default of two chunks counts in the grid's size, as --vpp 2 does
    r = run_cli("schedule", "--schedule", "interleaved", "--pp", 256, "-m", 256)
    one_line_exit_2(r, "error: command line: --pp x --microbatches x --vpp = 131,072 stage passes")
    r = run_cli("schedule", "--schedule", "zbv", "--pp", 128, "-m", 512)  # its two chunks a rank count too
    one_line_exit_2(r, "error: command line: --pp x --microbatches x 2 = 131,072 stage passes")
    r = run_cli("schedule", "--pp", 4, "-m", 6, "--schedule", "1f1b", "--vpp-group", 6)
    one_line_exit_2(r, "error: command line: --vpp-group is used by --schedule interleaved only (schedule is 1f1b)")


def test_collective_says_where_it_grew_the_fabric_past_the_file(root):
    """264 GPUs of a 32-node topology file: the command's last line says it grew the fabric."""
    r = run_cli("collective", "--topology", root / "topologies" / "dgx-h100.yaml", "--gpus", 264, "--sizes", "1M")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == ("note: the topology file describes 32 nodes; its fabric was grown to 33, "
                                         "as a scenario's cluster.nodes grows it")


def test_collective_sizes_past_1_pib_are_refused(root):
    """``collective``: a size past 1 PiB (a 401-digit one was an OverflowError traceback, and
    99999999999999999999T was taken, rounded through a float) is refused naming --sizes."""
    from clustersim.netbench import parse_sizes

    topo = root / "topologies" / "dgx-h100.yaml"
    for size in ("1" + "0" * 400, "99999999999999999999T", "1025T"):
        r = run_cli("collective", "--topology", topo, "--sizes", size)
        one_line_exit_2(r, "error: command line: --sizes: size ")
        assert "more than 1024 TiB" in r.stderr and len(r.stderr) < 200
    assert parse_sizes("1024T,1.5M,0.3K,7") == [1 << 50, 3 << 19, 307, 7]
    assert parse_sizes("1." + "0" * 5000 + "1K") == [1024]  # (no 5,000-digit number made of it)


def test_collective_gpus_errors_name_gpus(root):
    """A --gpus the topology cannot hold names --gpus, not the topology file's nodes or fabric
    (past the GPUs clustersim builds, the line ended "use fewer nodes" and said the count three
    times; a count past 1e308 was an OverflowError traceback)."""
    from clustersim.hardware.topology import MAX_GPUS

    topo = root / "topologies" / "dgx-h100.yaml"
    r = run_cli("collective", "--topology", topo, "--gpus", 2_000_000, "--sizes", "1M")
    one_line_exit_2(r, f"error: command line: --gpus: 2,000,000 GPUs; clustersim builds the cluster graph in memory "
                       f"and takes at most {MAX_GPUS:,} GPUs\n")
    r = run_cli("collective", "--topology", topo, "--gpus", "1" + "0" * 400, "--sizes", "1M")
    one_line_exit_2(r, "error: command line: --gpus: 1000")
    assert len(r.stderr) < 200 and "nodes" not in r.stderr
    r = run_cli("collective", "--topology", root / "topologies" / "gb200-nvl72.yaml", "--gpus", MAX_GPUS - 2,
                "--sizes", "1M")  # (whole nodes of 72: past the most)
    one_line_exit_2(r, f"error: command line: --gpus: {MAX_GPUS - 2:,} GPUs take 1,821 nodes of 72 (131,112 GPUs); ")
    single = root / "topologies" / "single-h100.yaml"
    r = run_cli("collective", "--topology", single, "--gpus", 2, "--sizes", "1M")
    one_line_exit_2(r, f"error: command line: --gpus: 2 GPUs take 2 nodes of {single}: fabric.kind is 'none'")


def test_collective_all_to_all_past_1024_gpus_is_refused_before_any_work(root):
    """An all-to-all is a flow per ordered pair: 100,000 GPUs were killed for memory at 24 GB
    after 110 s. Refused at once, naming --gpus; 1,024 is the most."""
    from clustersim.netbench import MAX_ALL_TO_ALL_GPUS

    topo = root / "topologies" / "dgx-h100.yaml"
    r = run_cli("collective", "--topology", topo, "--op", "all_to_all", "--gpus", 100_000, "--sizes", "1M")
    one_line_exit_2(r, "error: command line: --gpus: all_to_all over 100,000 GPUs is 9,999,900,000 flows")
    assert MAX_ALL_TO_ALL_GPUS == 1024 and "at most 1,024 GPUs" in r.stderr


def test_an_empty_out_is_refused(tmp_path, root):
    """An empty --out was taken as no --out (the files went to ./out/<name>)."""
    r = run_cli("run", root / "scenarios/llama3_8b_8gpu.yaml", "--out", "", cwd=tmp_path)
    one_line_exit_2(r, "error: command line: --out: the output folder's path is empty")
    assert list(tmp_path.iterdir()) == []


def test_empty_paths_devices_and_symlink_loops_are_named_so(tmp_path, root):
    """An empty scenario, topology or schedule path, /dev/null and a symlink loop are said to
    be that, not "not found" or "is a folder"."""
    scenario = root / "scenarios/llama3_8b_8gpu.yaml"
    r = run_cli("run", "", cwd=tmp_path)
    one_line_exit_2(r, "error: command line: scenario: the scenario file's path is empty")
    r = run_cli("validate", "/dev/null")
    one_line_exit_2(r, "error: /dev/null: this is a character device, not a regular file; give the scenario or "
                       "topology file")
    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "loop")
    r = run_cli("validate", loop)
    one_line_exit_2(r, f"error: {loop}: this is a symlink loop; give the scenario or topology file")
    d = yaml.safe_load(scenario.read_text())
    d["cluster"]["topology"] = str(loop)
    sc = tmp_path / "s.yaml"
    sc.write_text(yaml.safe_dump(d))
    r = run_cli("run", sc, "--out", tmp_path / "out")
    one_line_exit_2(r, f"error: {sc}: cluster.topology: topology file {loop} is a symlink loop")  # (absolute)
    for args, option, what in ((("collective", "--topology"), "--topology", "topology"),
                               (("schedule", "--schedule", "custom", "--file"), "--file", "schedule")):
        r = run_cli(*args, "")
        one_line_exit_2(r, f"error: command line: {option}: the {what} file's path is empty")
        r = run_cli(*args, loop)
        one_line_exit_2(r, f"error: command line: {option}: {what} file {loop} is a symlink loop")
        r = run_cli(*args, "/dev/null")
        one_line_exit_2(r, f"error: command line: {option}: {what} file /dev/null is a character device, not a "
                           "regular file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop", "s.yaml"]


def test_the_terminal_summary_escapes_control_characters(tmp_path, root):
    """The scenario's name and description are printed with control characters escaped: an
    escape sequence cleared the screen, a carriage return overwrote the line, a newline broke
    the description's line (report.html escapes them as HTML)."""
    d = scenario_dict(name="a\x1b[2Jb\rc", description="line1\nline2\x1b[31mred \u202e é")
    sc = write_scenario(tmp_path, root, d)
    r = run_cli("run", sc, "--out", tmp_path / "out", "--no-report", "--no-trace")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[:2] == ["clustersim · a\\x1b[2Jb\\rc", "line1\\nline2\\x1b[31mred \\u202e é"]
    assert "\x1b" not in r.stdout and "\r" not in r.stdout


def _staging_folders(out: Path) -> list[Path]:
    from clustersim.cli import STAGING_PREFIX

    return [p for p in out.iterdir() if p.name.startswith(STAGING_PREFIX)] if out.is_dir() else []


def _run_until_staged(root: Path, out: Path, **pipes) -> subprocess.Popen:
    """moe_1024gpu's run into ``out``, in a session of its own, once the writer's files are in
    its temp folder (or it ended: the caller asserts it did not)."""
    import time

    p = subprocess.Popen([sys.executable, "-m", "clustersim", "run", str(root / "scenarios/moe_1024gpu.yaml"),
                          "--out", str(out)], text=True, start_new_session=True, **pipes)
    deadline = time.monotonic() + 60
    while p.poll() is None and time.monotonic() < deadline:
        if any(any(True for _ in d.iterdir()) for d in _staging_folders(out)):
            break
        time.sleep(0.002)
    return p


@pytest.mark.parametrize("to_group", [False, True], ids=["kill", "timeout"])
def test_sigterm_cleans_up_as_ctrl_c_does(tmp_path, root, to_group):
    """SIGTERM (kill; timeout and Slurm send it to the process group too, the forked processes
    with it) while the step is simulated or its files written: the temp folder and the forked
    processes are gone, one line, exit code 143 (it left the temp folder with partial files)."""
    import signal
    import time

    out = tmp_path / "out"
    p = _run_until_staged(root, out, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.poll() is None, "the run ended before it could be stopped"
        (os.killpg if to_group else os.kill)(p.pid, signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 143 and err == "terminated: no outputs written\n", (p.returncode, err)
    assert list(tmp_path.iterdir()) == []
    for _ in range(500):  # no process of the run left (a forked one dies with its parent)
        try:
            os.killpg(p.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.01)
    else:
        pytest.fail("a process of the run is left")


# sends ``signal`` to itself as the module ``at`` begins to load, then runs python -m clustersim
_SIGNAL_AT_IMPORT = """
import importlib.abc, os, runpy, signal, sys
# Python turns SIGINT into KeyboardInterrupt unless it started with SIGINT ignored, as a
# background job of a shell starts (a CI run launched with &): start as from a terminal
signal.signal(signal.SIGINT, signal.default_int_handler)
at, sig = sys.argv[1], getattr(signal, sys.argv[2])
class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == at:
            os.kill(os.getpid(), sig)
        return None
sys.meta_path.insert(0, Hook())
sys.argv = ["clustersim", *sys.argv[3:]]
runpy.run_module("clustersim", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("at,sig", [("clustersim.cli", "SIGINT"), ("clustersim.schedule", "SIGINT"),
                                    ("clustersim.analysis.invariants", "SIGINT"), ("clustersim.cli", "SIGTERM"),
                                    ("clustersim.api", "SIGTERM")])
def test_a_stop_while_clustersim_loads_says_one_line(tmp_path, root, at, sig):
    """Ctrl-C in the first fraction of a second (the imports: clustersim.cli in __main__, the
    parser's, the command's) gave a KeyboardInterrupt traceback and exit code -2, not the one
    line and 130 of later; SIGTERM the same with 143."""
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-c", _SIGNAL_AT_IMPORT, at, sig, "run",
                        str(root / "scenarios/llama3_8b_8gpu.yaml"), "--out", str(out)],
                       capture_output=True, text=True, cwd=tmp_path)
    word, code = ("interrupted", 130) if sig == "SIGINT" else ("terminated", 143)
    assert (r.returncode, r.stderr) == (code, f"{word}: no outputs written\n")
    assert list(tmp_path.iterdir()) == []


def test_an_out_folder_on_another_file_system_gets_the_files(tmp_path, root):
    """``--out`` a link into another file system (/dev/shm here): the files are staged inside
    the folder, so they move in on its file system (staged next to the link, the move failed
    with "Invalid cross-device link" after the whole run)."""
    import tempfile

    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second file system to link to")
    with tempfile.TemporaryDirectory(dir=shm) as far:
        link = tmp_path / "out"
        link.symlink_to(far)
        r = run_cli("run", root / "scenarios/llama3_8b_8gpu.yaml", "--out", link, "--no-trace")
        assert r.returncode == 0, r.stderr
        assert sorted(p.name for p in Path(far).iterdir()) == ["report.html", "summary.json"]


def test_an_unknown_key_names_the_field_it_is_closest_to(tmp_path, root):
    """A misspelt key is refused with the field of its section nearest in spelling, at any depth
    (a list's items too); a key near none gets no guess."""
    from clustersim import ConfigError, load_scenario

    base = yaml.safe_load((root / "scenarios" / "llama3_8b_8gpu.yaml").read_text())
    base["cluster"]["topology"] = str(root / "topologies" / "dgx-h100.yaml")
    cases = [(lambda d: d.update(paralel=d.pop("parallel")), "paralel", "'parallel'"),
             (lambda d: d["training"].update(micro_batch=2), "training.micro_batch", "'micro_batch_size'"),
             (lambda d: d["cluster"].update(what_if=[{"gpu": 1, "slowdon": 1.2}]), "cluster.what_if[0].slowdon",
              "'slowdown'"),
             (lambda d: d["parallel"].update(xyzzy=1), "parallel.xyzzy", None)]
    for change, field, near in cases:
        d = copy.deepcopy(base)
        change(d)
        with pytest.raises(ConfigError) as exc:
            load_scenario(d, base_dir=root)
        assert exc.value.field == field
        assert exc.value.message == (f"unknown key (did you mean {near}? see docs/reference.md)" if near
                                     else "unknown key (check the spelling; see docs/reference.md)")
    # a list's section is its items' model on every Python (3.10 takes list[X] for a type)
    from clustersim.hardware.topology import WhatIfCfg
    from clustersim.yamlio import _section_in

    assert _section_in(list[WhatIfCfg] | None) is WhatIfCfg and _section_in(list[int]) is None


def test_trace_gpus_writes_each_gpu_named_as_the_run_of_every_rank_records_it(tmp_path, root):
    """``--trace-gpus``: the GPUs named, one process each, whose events are those the run of
    every rank (``--all-ranks``) writes for them (TP4 x PP2 x DP2: the collapse is exact),
    but that a GPU holding another rank's spans (labelled so) names that rank's group and
    peer; the summary is the collapsed run's."""
    import gzip

    sc = write_scenario(tmp_path, root, scenario_dict())
    whose = ("group", "peer_rank", "peer_stage")  # the simulated rank's, on another GPU's row

    def events(out: Path, but: tuple = ()) -> dict[int, list]:
        doc = json.loads(gzip.decompress((out / "trace.json.gz").read_bytes()))
        by_pid: dict[int, list] = {}
        for e in doc["traceEvents"]:
            if e["ph"] == "X":
                args = {k: v for k, v in e.get("args", {}).items() if k not in but} if "args" in e else None
                by_pid.setdefault(e["pid"], []).append((e["tid"], e["name"], e["ts"], e["dur"], args))
        names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
        return {pid: (names[pid], sorted(evs, key=repr)) for pid, evs in by_pid.items()}

    r = run_cli("run", sc, "--out", tmp_path / "some", "--trace-gpus", "9,0-1", "--no-report")
    assert r.returncode == 0, r.stderr
    some = events(tmp_path / "some")
    r = run_cli("run", sc, "--out", tmp_path / "all", "--all-ranks", "--no-report")
    assert r.returncode == 0, r.stderr
    every = events(tmp_path / "all")
    assert sorted(some) == [1, 2, 10]  # pid = GPU + 1
    doc = json.loads(gzip.decompress((tmp_path / "some" / "trace.json.gz").read_bytes()))
    labels = {e["pid"]: e["args"]["labels"] for e in doc["traceEvents"] if e["name"] == "process_labels"}
    assert labels == {2: "the spans of simulated rank 0", 10: "the spans of simulated rank 8"}  # GPU 0 is rank 0
    assert doc["metadata"]["simulation"]["trace_gpus"] == "0, 1, 9"
    assert doc["metadata"]["simulation"]["spans"] == sum(len(evs) for _, evs in some.values())
    assert all(some[pid][1] for pid in some)
    assert every[1] == some[1]  # GPU 0 is rank 0: its own spans, group and peer
    assert {pid: every[pid] for pid in some} != some  # GPU 1 sends to GPU 9, rank 0 to GPU 8
    but = events(tmp_path / "some", whose)
    assert {pid: events(tmp_path / "all", whose)[pid] for pid in but} == but
    # GPU 1's row is rank 0's: its group and its peer, rank 0's; no flow leaves it
    assert [e for e in some[2][1] if e[4] and e[4].get("op") == "send"][0][4]["peer_rank"] == 8
    # nor one from GPU 0 (rank 0): its receiver, GPU 8, is not written, and GPU 9 holds rank 8's
    assert not [e for e in doc["traceEvents"] if e["ph"] in ("s", "f")]
    r = run_cli("run", sc, "--out", tmp_path / "collapsed", "--no-report", "--no-trace")
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "some" / "summary.json").read_text())
    assert summary == json.loads((tmp_path / "collapsed" / "summary.json").read_text())
    assert summary["simulation"]["simulated_ranks"] == 2


@pytest.mark.parametrize("spec, words", [
    ("5-2", "'5-2' runs downwards; write 2-5"), ("\uff11", "is not a GPU"), ("0,16", "GPU 16 is not in this cluster of 16 GPUs (0-15)"),
    ("x", "'x' is not a GPU"), ("", "is empty"), ("1,,2", "'' is not a GPU"),
])
def test_trace_gpus_refuses_what_names_no_gpu(tmp_path, root, spec, words):
    sc = write_scenario(tmp_path, root, scenario_dict())
    out = tmp_path / "out"
    r = run_cli("run", sc, "--out", out, "--trace-gpus", spec)
    one_line_exit_2(r, "error: command line: --trace-gpus: ")
    assert words in r.stderr and not out.exists()
    r = run_cli("run", sc, "--out", out, "--trace-gpus", "0", "--no-trace")
    one_line_exit_2(r, "error: command line: --trace-gpus: names the GPUs of trace.json.gz, which --no-trace")


def test_trace_gpus_past_the_spans_a_trace_holds_is_refused_after_the_run(monkeypatch, root, tmp_path, capsys):
    from clustersim import cli

    monkeypatch.setattr(cli, "TRACE_GPUS_MAX_SPANS", 1000)
    out = tmp_path / "out"
    rc = cli.main(["run", str(root / "scenarios/llama3_8b_8gpu.yaml"), "--out", str(out), "--trace-gpus", "0-1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: command line: --trace-gpus: the 2 GPUs named would put ") and "more than 1,000" in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_named_algorithm_that_cannot_run_some_groups_is_said_to_have_fallen_back(tmp_path, root):
    """``simulation.collectives.all_reduce: tree``: the TP all-reduces inside a node cannot run
    it and ran the ring; the terminal, the report and summary.json say so (DP's run tree)."""
    d = scenario_dict(parallel={"tp": 4, "pp": 1, "dp": 4}, simulation={"collectives": {"all_reduce": "tree"}})
    out = tmp_path / "out"
    r = run_cli("run", write_scenario(tmp_path, root, d), "--out", out, "--no-trace")
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    used = s["simulation"]["collective_algorithms"]["all_reduce"]
    assert used["tree"] > 0 and used["ring"] > 0
    f = s["simulation"]["collective_fallbacks"]
    assert f == {"all_reduce": {"asked": "tree", "ran": {"ring": used["ring"]}, "of": used["ring"] + used["tree"]}}
    line = (f"all_reduce: tree cannot run {used['ring']:,} of the {used['ring'] + used['tree']:,} communications "
            "simulated (groups "
            "inside one node, or uneven over nodes); ring ("f"{used['ring']:,}) ran those (simulation.collectives)")
    assert " " * 16 + line in r.stdout.splitlines()
    assert f'<p class="meta">simulated: {line}</p>' in (out / "report.html").read_text()
    r = run_cli("run", write_scenario(tmp_path, root, scenario_dict(parallel={"tp": 4, "pp": 1, "dp": 4})),
                "--out", out, "--no-trace", "--no-report")
    assert json.loads((out / "summary.json").read_text())["simulation"]["collective_fallbacks"] is None
    assert "cannot run" not in r.stdout


def test_an_empty_optional_section_takes_its_defaults(tmp_path, root):
    """``parallel:`` or ``simulation:`` with nothing under it (null in YAML) is the section's
    defaults, as leaving it out is, and ``what_if:`` an empty list; a required one left empty
    is named (tests/data/bad)."""
    import clustersim

    d = scenario_dict(cluster={"topology": "topologies/single-h100.yaml", "nodes": 1})
    want = clustersim.load_scenario(write_scenario(tmp_path, root, {**d, "parallel": {}}))
    got = clustersim.load_scenario(write_scenario(tmp_path, root, {**d, "parallel": None, "simulation": None}, "n.yaml"))
    assert got.cfg.parallel == want.cfg.parallel and got.cfg.simulation == want.cfg.simulation
    assert got.mesh.world_size == 1 and got.cfg.parallel.schedule == "1f1b"
    # a list with nothing under it (cluster.what_if:) is an empty one, as left out
    empty = {**d, "parallel": None, "cluster": {**d["cluster"], "what_if": None}}
    assert clustersim.load_scenario(write_scenario(tmp_path, root, empty, "w.yaml")).cfg.cluster.what_if == []


def test_version_and_a_schedule_file_alone_is_custom(root):
    import clustersim

    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"clustersim {clustersim.__version__}"
    f = root / "scenarios" / "schedules" / "custom_1f1b_4x8.txt"
    alone, named = run_cli("schedule", "--file", f), run_cli("schedule", "--schedule", "custom", "--file", f)
    assert alone.returncode == named.returncode == 0 and alone.stdout == named.stdout and "rank 3" in alone.stdout
    one_line_exit_2(run_cli("schedule", "--schedule", "1f1b", "--file", f),
                    "error: command line: --file is read by --schedule custom only")


def test_a_topology_given_for_a_scenario_and_the_other_way_round_are_named_so(root, tmp_path):
    """``run`` names a topology given as its scenario; ``validate`` checks a topology as one;
    ``collective --topology`` names a scenario given as its topology."""
    one_line_exit_2(run_cli("run", root / "topologies" / "dgx-h100.yaml", "--out", tmp_path / "o"),
                    f"error: {root / 'topologies' / 'dgx-h100.yaml'}: this is a topology file (it has gpu and node")
    gpipe = root / "scenarios" / "llama2_70b_64gpu_gpipe.yaml"
    r = run_cli("validate", root / "topologies" / "dgx-h100.yaml", root / "scenarios" / "llama3_8b_8gpu.yaml", gpipe)
    assert r.returncode == 0 and r.stdout.splitlines()[0] == (
        f"{root / 'topologies' / 'dgx-h100.yaml'}: ok (topology: 32 nodes x 8 H100-SXM5-80GB; host 2,048 GB a node)"), r.stderr
    # a scenario's line gives its memory floor, and says where no run of it can fit (GPipe holds all 64 microbatches)
    import clustersim
    from clustersim.api import memory_floor

    for line, path in zip(r.stdout.splitlines()[1:], (root / "scenarios" / "llama3_8b_8gpu.yaml", gpipe)):
        floor = memory_floor(clustersim.load_scenario(path))
        assert f"; memory at least {floor['peak_bytes'] / 2**30:.1f} of 80 GiB a GPU" in line
        assert line.endswith(")" if floor["fits"] else f", over on stage {floor['stage']})")
        # ("ok" where it fits; a plan that cannot is valid still, exit code 0, but not "ok")
        assert line.startswith(f"{path}: {'ok' if floor['fits'] else 'valid, but cannot fit'} (")
    assert not floor["fits"]
    bad = tmp_path / "t.yaml"
    bad.write_text((root / "topologies" / "dgx-h100.yaml").read_text() + "\nwhat_iff: []\n")
    one_line_exit_2(run_cli("validate", bad), f"error: {bad}: what_iff: unknown key (did you mean 'what_if'?")
    one_line_exit_2(run_cli("collective", "--topology", root / "scenarios" / "llama3_8b_8gpu.yaml"),
                    f"error: {root / 'scenarios' / 'llama3_8b_8gpu.yaml'}: this is a scenario file")


def test_summary_json_writes_the_map_of_every_gpu_on_one_line(tmp_path, root):
    out = tmp_path / "out"
    assert run_cli("run", write_scenario(tmp_path, root, scenario_dict()), "--out", out, "--no-report",
                   "--no-trace").returncode == 0
    text = (out / "summary.json").read_text()
    line = next(x for x in text.splitlines() if '"simulated_rank_of_gpu"' in x)
    s = json.loads(text)
    assert line.strip() == '"simulated_rank_of_gpu": ' + json.dumps(s["simulation"]["simulated_rank_of_gpu"])
    assert s["simulation"]["simulated_rank_of_gpu"] == [0] * 8 + [8] * 8  # TP4 x PP2 x DP2: a stage a node


def test_a_schedule_file_with_a_byte_order_mark_reads_as_without(tmp_path):
    """Spreadsheets export UTF-8 with a byte-order mark; it was read into the first cell
    ('\\ufeff0F0' is not an action). YAML files with one were already read."""
    f = tmp_path / "s.txt"
    f.write_bytes(b"\xef\xbb\xbf0F0 0B0 0F1 0B1\n")
    r = run_cli("schedule", "--file", f)
    assert r.returncode == 0 and r.stdout.splitlines() == ["rank 0  | 0F0 0B0 0F1 0B1"], r.stderr


def test_a_file_name_with_a_newline_is_one_line(tmp_path):
    """The error line quotes the file's name; a newline in it (or an escape sequence) is
    escaped, so the message stays one line a terminal does not act on."""
    bad = tmp_path / "new\nline.yaml"
    bad.write_text("name: x\nmodel: 5\n")
    r = run_cli("validate", bad)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "new\\nline.yaml" in r.stderr, r.stderr


def test_a_step_too_long_under_a_what_if_names_the_what_if(monkeypatch, root, tmp_path, capsys):
    """Tiny bw_factors or large slowdowns can stretch a step past ``api.MAX_STEP_S``: the
    refusal then names cluster.what_if (it named the model), and says to ease them first."""
    import yaml

    from clustersim import api
    from clustersim.cli import main

    monkeypatch.setattr(api, "MAX_STEP_S", 1e-3)
    d = yaml.safe_load((root / "scenarios/llama3_8b_8gpu.yaml").read_text())
    d["cluster"].update(topology=str(root / "topologies/dgx-h100.yaml"), what_if=[{"gpu": 0, "slowdown": 3}])
    scenario = tmp_path / "s.yaml"
    scenario.write_text(yaml.safe_dump(d))
    rc = main(["run", str(scenario), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: {scenario}: cluster.what_if: the simulated step lasts ")
    assert "ease the what-ifs' slowdowns and bw_factors" in err and not (tmp_path / "out").exists()


def test_run_with_each_replica_apart_says_so(tmp_path, root):
    """run --set simulation.split_replicas=true: the "simulated" lines, the report's header
    and its timeline note say that each DP replica ran apart; the default run says nothing."""
    path = "scenarios/llama3_8b_8gpu.yaml"
    said = "each DP replica apart, twins only among its TP and CP peers (simulation.split_replicas)"
    r = run_cli("run", path, "--set", "parallel.tp=2 parallel.dp=4", "--set", "simulation.split_replicas=true",
                "--no-trace", "--out", tmp_path / "o", cwd=root)
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert s["simulation"]["split_replicas"] and s["simulation"]["simulated_ranks"] == 4
    assert said in r.stdout
    page = (tmp_path / "o" / "report.html").read_text()
    assert f"simulated: {said}" in page and "(its peers in its DP replica's TP, CP and EP groups placed alike)" in page
    r = run_cli("run", path, "--set", "parallel.tp=2 parallel.dp=4", "--no-trace", "--out", tmp_path / "d", cwd=root)
    assert r.returncode == 0 and said not in r.stdout
    page = (tmp_path / "d" / "report.html").read_text()
    assert said not in page and "(its peers in its TP, CP, DP and EP groups placed alike on the cluster)" in page


def test_each_replica_apart_past_the_all_ranks_limit_is_refused_on_the_command_line(tmp_path, root):
    """PP1 x DP8192 one rank per replica would simulate 8,192 ranks: exit 2, one line naming
    the file and the field, no traceback, nothing written."""
    d = scenario_dict()
    d["cluster"] = {**d["cluster"], "nodes": 1024}
    d["parallel"] = {"tp": 1, "pp": 1, "dp": 8192}
    d["training"] = {**d["training"], "micro_batch_size": 1, "global_batch_size": 8192}
    path = write_scenario(tmp_path, root, d)
    r = run_cli("run", path, "--set", "simulation.split_replicas=true", "--out", tmp_path / "out")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert str(path) in r.stderr and "simulation.split_replicas" in r.stderr and "8,192 simulated ranks" in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_search_that_splits_replicas_says_so_before_the_plans_run(tmp_path, root):
    """sweep (and advise, through the same path) with simulation.split_replicas, set in the
    file or varied true: a note on stderr that each plan simulates pp x dp ranks; stdout and
    the plans are as without the note; none where nothing sets it."""
    note = "note: simulation.split_replicas: each plan simulates each DP replica apart"
    path = "scenarios/llama3_8b_8gpu.yaml"
    r = run_cli("sweep", path, "--vary", "parallel.tp=2,4", "--vary", "simulation.split_replicas=false,true",
                cwd=root)
    assert r.returncode == 0 and r.stderr.startswith(note), r.stderr
    d = yaml.safe_load((root / path).read_text())
    d["simulation"] = {"split_replicas": True}
    own = write_scenario(tmp_path, root, {**d, "cluster": {**d["cluster"], "topology": "topologies/dgx-h100.yaml"}})
    r = run_cli("sweep", own, "--vary", "parallel.tp=2,4", cwd=root)
    assert r.returncode == 0 and r.stderr.startswith(note), r.stderr
    r = run_cli("sweep", path, "--vary", "parallel.tp=2,4", cwd=root)
    assert r.returncode == 0 and note not in r.stderr


def test_a_change_given_as_two_words_is_shown_as_one(root):
    """``--vary parallel.tp 4,8``: argparse finds ``4,8`` unrecognized; the error says how to
    write the change, as one word."""
    for args, hint in [(("sweep", "scenarios/llama2_70b_64gpu.yaml", "--vary", "parallel.tp", "4,8"),
                        "(--vary takes KEY=VALUE as one word: --vary parallel.tp=4,8)"),
                       (("run", "scenarios/llama2_70b_64gpu.yaml", "--set", "parallel.pp", "8"),
                        "(--set takes KEY=VALUE as one word: --set parallel.pp=8)")]:
        r = run_cli(*args, cwd=root)
        assert r.returncode == 2 and r.stderr.rstrip().endswith(f"unrecognized arguments: {args[-1]} {hint}"), r.stderr
    assert run_cli("run", "scenarios/llama2_70b_64gpu.yaml", "--set", "model.name", "my model", cwd=root).stderr.rstrip(
    ).endswith("(--set takes KEY=VALUE as one word: --set 'model.name=my model')")  # (as a shell reads it back)
    # no hint where it would mislead: another command's option, an unknown one, a file where the value is missing
    for args in [("run", "scenarios/llama2_70b_64gpu.yaml", "--vary", "parallel.tp", "4,8"),
                 ("run", "scenarios/llama2_70b_64gpu.yaml", "--bogus"),
                 ("sweep", "scenarios/llama2_70b_64gpu.yaml", "--vary", "parallel.tp", "=4,8"),
                 ("compare", "scenarios/llama2_70b_64gpu.yaml", "--variant", "parallel.tp", "scenarios/llama3_8b_8gpu.yaml")]:
        r = run_cli(*args, cwd=root)
        assert r.returncode == 2 and "unrecognized arguments" in r.stderr and "takes KEY=VALUE" not in r.stderr, args


@pytest.mark.parametrize("argv, said", [
    (["run", "s.yaml", "--output", "x"], "run: unrecognized arguments: --output x (did you mean --out? "
                                         "python -m clustersim run --help lists the options)"),
    (["run", "s.yaml", "--all-rank"], "run: unrecognized arguments: --all-rank (did you mean --all-ranks? "),
    (["run", "s.yaml", "--vary", "parallel.tp=2"], "(--vary is an option of sweep and advise; python -m clustersim"),
    (["runn", "s.yaml"], "'runn' is not a command (did you mean run? the commands: run, compare, sweep, advise,"),
    (["schedule", "--schedule", "1F1B", "--pp", "4", "-m", "8"],
     "schedule: argument --schedule: invalid choice: '1F1B' (choose from "),
    (["run"], "run: the following arguments are required: scenario (python -m clustersim run --help)"),
])
def test_a_command_line_argparse_refuses_is_one_line(argv, said, capsys):
    """Mistakes argparse finds (an unknown or misspelt option, a command that is not one, a
    choice not offered, a missing argument) are refused as bad input is: one line, exit code
    2, the command named, its nearest option where one is close; a long option's prefix is
    not taken for it (``--all-rank`` is not ``--all-ranks``)."""
    from clustersim.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("error: command line: ")
    assert said in err, err


def test_a_search_s_progress_line_guesses_the_time_left():
    """sweep and advise on a terminal: rows so far, and once five plans have run for five
    seconds, the time the rest would take at that pace (refused rows do not count as run)."""
    from clustersim.cli import progress_line

    assert progress_line(3, 100, 3, 60.0) == "simulated 3 of 100 plans"  # too few plans run
    assert progress_line(10, 100, 10, 2.0) == "simulated 10 of 100 plans"  # too soon
    assert progress_line(30, 100, 10, 10.0) == "simulated 30 of 100 plans, about 70 s left"
    assert progress_line(412, 1536, 400, 100.0) == "simulated 412 of 1,536 plans, about 5 min left"
    assert progress_line(100, 5000, 100, 300.0) == "simulated 100 of 5,000 plans, about 4.1 h left"
    assert progress_line(100, 100, 100, 300.0) == "simulated 100 of 100 plans"


def test_a_file_a_change_names_is_read_as_a_shell_reads_it(tmp_path, root):
    """A path given with --set (cluster.topology, parallel.schedule_file) names a file from the
    working folder, as the shell it was typed in reads it, where there is none beside the
    scenario; one beside the scenario, as the file's own paths are, still does; where there
    is neither, the error says where it looked, in the reader's words."""
    import clustersim
    from clustersim.overrides import load_variant

    path = "scenarios/llama3_8b_8gpu.yaml"
    a100 = clustersim.simulate(load_variant(root / path, [("cluster.topology", "../topologies/dgx-a100.yaml")]))
    for given, cwd in (("topologies/dgx-a100.yaml", root), ("../topologies/dgx-a100.yaml", root),
                       ("dgx-a100.yaml", root / "topologies")):
        r = run_cli("run", root / path if cwd != root else path, "--set", f"cluster.topology={given}", "--no-trace",
                    "--no-report", "--out", tmp_path / given.replace("/", "_"), cwd=cwd)
        assert r.returncode == 0, (given, r.stderr)
        s = json.loads((tmp_path / given.replace("/", "_") / "summary.json").read_text())
        assert s["hardware"]["gpu"] == "A100-SXM4-80GB" and s["step_time_s"] == a100.summary["step_time_s"]
    r = run_cli("run", path, "--set", "cluster.topology=topologies/nope.yaml", cwd=root)
    assert r.returncode == 2 and "topology file not found: topologies/nope.yaml (relative to the scenario's folder: " \
        in r.stderr and "base_dir" not in r.stderr, r.stderr
    assert r.stderr.rstrip().endswith(f", nor from the working folder ({root / 'topologies' / 'nope.yaml'})")
    r = run_cli("run", path, "--set", "cluster.topology=topologies", cwd=root)  # a folder: not "not found" there
    assert r.returncode == 2 and r.stderr.rstrip().endswith(
        f"; from the working folder it is a folder ({root / 'topologies'}): give the file in it"), r.stderr
    # a file of that name in both places: the one beside the scenario, as the file's own paths are read
    (tmp_path / "s").mkdir()
    shutil.copy(root / path, tmp_path / "s" / "x.yaml")
    shutil.copy(root / "topologies" / "dgx-a100.yaml", tmp_path / "s" / "t.yaml")
    shutil.copy(root / "topologies" / "single-h100.yaml", tmp_path / "t.yaml")
    r = run_cli("run", "s/x.yaml", "--set", "cluster.topology=t.yaml", "--no-trace", "--no-report", "--out",
                tmp_path / "both", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "both" / "summary.json").read_text())["hardware"]["gpu"] == "A100-SXM4-80GB"


def test_a_key_without_a_space_after_its_colon_says_so(root, tmp_path):
    """``{gpu:3}`` is one YAML key, "gpu:3": the error says what YAML needs, and names the
    change as a shell would read it back, in double quotes rather than '"'"'."""
    from clustersim.overrides import changes_text, parse_changes

    r = run_cli("run", "scenarios/llama3_8b_8gpu.yaml", "--set", "cluster.what_if=[{gpu:3,slowdown:1.5}]",
                "--out", tmp_path / "o", cwd=root)
    assert r.returncode == 2 and "Traceback" not in r.stderr and not (tmp_path / "o").exists()
    assert r.stderr.strip() == (
        "error: scenarios/llama3_8b_8gpu.yaml with \"cluster.what_if=[{'gpu:3': null, 'slowdown:1.5': null}]\": "
        "cluster.what_if[0].gpu:3: unknown key (did you mean 'gpu'? see docs/reference.md); YAML needs a space after "
        "a key's colon: gpu: 3; also refused: cluster.what_if[0].slowdown:1.5")
    for changes in ([("cluster.what_if", [{"gpu:3": None}])], [("model.name", "it's")], [("model.name", "a $b 'c'")]):
        assert parse_changes(changes_text(changes), source="s", field="f") == changes


def test_a_block_key_without_a_space_after_its_colon_says_so(root, tmp_path):
    """``  tp:4`` in a block section is YAML text, not a key: where the entries after it fail
    to parse, or the section is that text alone, the error says what YAML needs (a URL's
    "http://" is no such key)."""
    from clustersim.yamlio import _colon_hint

    text = (root / "scenarios/llama3_8b_8gpu.yaml").read_text().replace("../topologies", str(root / "topologies"))
    lines = text.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("parallel:"))
    cases = [("  tp:4", "invalid YAML: mapping values are not allowed here; line {n} 'tp:4': YAML needs a space after "
                        "a key's colon (tp: 4)"),
             (None, "parallel: should be keys and values (a mapping), not text; YAML needs a space after a key's colon "
                    "(tp: 4) (got 'tp:4')")]
    for tp, says in cases:
        edited = list(lines)
        if tp is None:  # the section is that text alone
            end = next(i for i in range(at + 1, len(edited)) if edited[i] and not edited[i].startswith(" "))
            edited[at + 1:end] = ["  tp:4"]
        else:
            edited[at + 1] = tp
        path = tmp_path / f"x{tp is None}.yaml"
        path.write_text("\n".join(edited) + "\n")
        r = run_cli("run", path, "--out", tmp_path / "o", cwd=root)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert says.format(n=at + 2) in r.stderr, r.stderr

    class Mark:
        line = 1
    assert _colon_hint("a:\n  http://x\n", Mark) == "" and _colon_hint("a:\n  b:2\n", Mark).endswith("(b: 2)")


@pytest.mark.parametrize("edit, says", [
    ((" tp: 4", None), "line {b}: invalid YAML: mapping values are not allowed here; line {b} 'pp: 1' is indented "
                       "deeper than line {a} 'tp: 4', which holds its value: the keys of one section line up"),
    (("  tp: 4", "    pp: 1"), "line {b} 'pp: 1' is indented deeper than line {a} 'tp: 4', which holds its value"),
    (("  tp 4", None), "line {b}: invalid YAML: mapping values are not allowed here; line {a} 'tp 4' has no colon: "
                       "a key and its value are written tp: 4"),
])
def test_a_misindented_key_or_a_missing_colon_is_named_on_its_own_line(root, tmp_path, edit, says):
    """YAML reports a key indented one space off, or a key without its colon, on the line
    after the mistake ("mapping values are not allowed here"); the error names the line to
    fix and what is wrong with it."""
    from clustersim.errors import ConfigError
    from clustersim.yamlio import read_yaml

    lines = (root / "scenarios/llama3_8b_8gpu.yaml").read_text().splitlines()
    at = lines.index("parallel:")
    assert lines[at + 1:at + 3] == ["  tp: 4", "  pp: 1"]
    lines[at + 1] = edit[0]
    if edit[1] is not None:
        lines[at + 2] = edit[1]
    path = tmp_path / "x.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as err:
        read_yaml(path, what="scenario")
    assert says.format(a=at + 2, b=at + 3) in err.value.line(), err.value.line()


def test_the_report_links_the_files_beside_it(tmp_path, root):
    """run's report.html links summary.json and, where it was written, trace.json.gz (which
    Perfetto opens, op by op); compare's reports of each plan link compare.html."""
    for args, linked in ((("--no-trace",), ["summary.json"]), ((), ["summary.json", "trace.json.gz"])):
        out = tmp_path / f"r{len(args)}"
        r = run_cli("run", "scenarios/llama3_8b_8gpu.yaml", *args, "--out", out, cwd=root)
        assert r.returncode == 0, r.stderr
        page = (out / "report.html").read_text()
        line = page[page.index('<p class="meta">files: '):].split("</p>")[0]
        assert re.findall(r'<a href="([^"]+)">', line) == linked and all((out / f).is_file() for f in linked)
        assert ("ui.perfetto.dev" in line) == ("trace.json.gz" in linked)
    r = run_cli("compare", "scenarios/llama3_8b_8gpu.yaml", "--variant", "parallel.zero=1", "--out", tmp_path / "c",
                cwd=root)
    assert r.returncode == 0, r.stderr
    page = (tmp_path / "c" / "report_B.html").read_text()
    assert '<p class="meta">files: <a href="compare.html">compare.html</a>' in page
    assert (tmp_path / "c" / "compare.html").is_file()


def _full_disk_in_staging(monkeypatch) -> None:
    """Every write into a temp folder of the outputs fails as on a full disk (ENOSPC), in this
    process and in those it forks (the writer of report.html and trace.json.gz)."""
    import errno

    from clustersim.cli import STAGING_PREFIX

    for name in ("write_text", "write_bytes"):
        real = getattr(Path, name)

        def full(self, *a, _real=real, **k):
            if any(part.startswith(STAGING_PREFIX) for part in self.parts):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return _real(self, *a, **k)

        monkeypatch.setattr(Path, name, full)


@pytest.mark.parametrize("command", ["run", "compare", "sweep", "advise"])
def test_a_full_disk_while_the_outputs_are_written_is_said_as_bad_input(tmp_path, root, monkeypatch, capsys,
                                                                         command):
    """A full disk while the files are written into the temp folder (not only while they move
    in) is said as --out's: one line, exit code 2, no traceback, nothing left (it was an
    OSError traceback and exit code 1)."""
    import errno

    from clustersim.cli import main

    _full_disk_in_staging(monkeypatch)
    scenario = str(root / "scenarios/llama3_8b_8gpu.yaml")
    out = tmp_path / "full" / "out"
    args = {"run": ["run", scenario],
            "compare": ["compare", scenario, "--variant", "parallel.zero=1"],
            "sweep": ["sweep", scenario, "--vary", "parallel.zero=0,1", "--jobs", "1"],
            "advise": ["advise", scenario, "--vary", "parallel.tp=4", "--vary", "parallel.pp=1", "--vary",
                       "parallel.zero=1", "--vary", "training.recompute=none", "--jobs", "1"]}[command]
    rc = main([*args, "--out", str(out)])
    err = capsys.readouterr().err
    assert (rc, err) == (2, f"error: command line: --out: cannot write the outputs into {out}: "
                            f"{os.strerror(errno.ENOSPC)}\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("when", ["writer", "summary"])
def test_the_out_folder_deleted_while_the_outputs_are_written_is_said_as_bad_input(tmp_path, root, monkeypatch,
                                                                                    capsys, when):
    """--out deleted while the run writes (as the writer of the files starts, or before
    summary.json is written): one line naming --out, exit code 2 (it was a FileNotFoundError
    traceback from the writer's counters' file, or from summary.json, and exit code 1)."""
    from clustersim.cli import main
    from clustersim.output import background, summary

    out = tmp_path / "out"
    if when == "writer":
        start = background.start

        def deleted_first(folder, *a, **k):
            shutil.rmtree(out)
            return start(folder, *a, **k)

        monkeypatch.setattr(background, "start", deleted_first)
    else:
        to_json = summary.to_json

        def deleted_first(*a, **k):
            shutil.rmtree(out)
            return to_json(*a, **k)

        monkeypatch.setattr(summary, "to_json", deleted_first)
    rc = main(["run", str(root / "scenarios/llama3_8b_8gpu.yaml"), "--out", str(out)])
    err = capsys.readouterr().err
    assert (rc, err) == (2, f"error: command line: --out: cannot write the outputs into {out}: "
                            "No such file or directory\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["run", "sweep"])
def test_an_interrupt_while_the_files_move_in_lets_them_all_move_in(tmp_path, root, monkeypatch, capsys, command):
    """Ctrl-C right after the first file moved in (each moves by an os.replace of its own):
    held back until every file is in place, then said as an interrupt after the files were
    written (exit code 130). It left the folder with one file of this run and the others of
    the run before, while it said "no outputs written"."""
    import signal

    from clustersim.cli import EXIT_INTERRUPTED, OUTPUT_FILES, main
    from clustersim.sweep import SWEEP_FILES

    files = OUTPUT_FILES if command == "run" else SWEEP_FILES
    out = tmp_path / "out"
    out.mkdir()
    for name in files:  # the files of the run before
        (out / name).write_text("old")
    replace = os.replace
    moved = []
    me = os.getpid()

    def replaced(a, b):
        replace(a, b)
        moved.append(b)
        if len(moved) == 1 and os.getpid() == me:  # (to this thread, as Ctrl-C reaches clustersim, which
            signal.raise_signal(signal.SIGINT)  # starts no other: a test runner's thread would take one sent to all)

    monkeypatch.setattr(os, "replace", replaced)
    scenario = str(root / "scenarios/llama3_8b_8gpu.yaml")
    args = ["run", scenario] if command == "run" else ["sweep", scenario, "--vary", "parallel.zero=0,1", "--jobs", "1"]
    # Ctrl-C's handler as a Python program starts with it, whatever the test process was left with
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        rc = main([*args, "--out", str(out)])
    except KeyboardInterrupt:  # (not let through to pytest, which would stop the session)
        pytest.fail("the interrupt went through clustersim")
    finally:
        signal.signal(signal.SIGINT, before)
    assert rc == EXIT_INTERRUPTED and len(moved) == len(files), (rc, before)
    assert capsys.readouterr().err.splitlines()[-1] == f"interrupted: the outputs are written, in {out}"
    assert sorted(p.name for p in out.iterdir()) == sorted(files)
    assert all((out / name).read_bytes() != b"old" for name in files)


class _Full:
    """A standard stream on a full disk (``> /dev/full``): every write fails with ENOSPC."""

    def write(self, text):
        import errno

        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def flush(self):
        pass

    def isatty(self):
        return False


@pytest.mark.parametrize("args", [("schema",), ("validate", "scenarios/llama3_8b_8gpu.yaml"),
                                  ("schedule", "--pp", "2", "-m", "2")])
def test_a_standard_output_that_cannot_be_written_is_one_line(root, monkeypatch, capsys, args):
    """``schema > /dev/full`` (and validate, schedule): one line on stderr, exit code 2 (it
    was an OSError traceback and exit code 1)."""
    from clustersim.cli import main

    monkeypatch.chdir(root)
    monkeypatch.setattr(sys, "stdout", _Full())
    rc = main(list(args))
    assert (rc, capsys.readouterr().err) == (2, "error: cannot write the standard output: No space left on device\n")


def test_a_run_whose_summary_cannot_be_printed_says_its_files_are_written(tmp_path, root, monkeypatch, capsys):
    """run with stdout on a full disk: the files are in place already, and the line says so."""
    from clustersim.cli import main

    out = tmp_path / "out"
    monkeypatch.setattr(sys, "stdout", _Full())
    rc = main(["run", str(root / "scenarios/llama3_8b_8gpu.yaml"), "--no-trace", "--no-report", "--out", str(out)])
    assert (rc, capsys.readouterr().err) == (2, "error: cannot write the standard output: No space left on device; "
                                                f"the outputs are written, in {out}\n")
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]


def test_an_error_that_cannot_be_said_keeps_its_exit_code(root, monkeypatch, capsys):
    """Bad input with stderr on a full disk (``2> /dev/full``): exit code 2 still, no traceback
    (which could not be written either: it was exit code 1)."""
    from clustersim.cli import main

    monkeypatch.setattr(sys, "stderr", _Full())
    assert main(["schedule", "--pp", "0", "-m", "2"]) == 2
    assert main(["validate", str(root / "no such file.yaml")]) == 2
    assert capsys.readouterr().out == ""


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_dev_full_as_stdout_is_one_line(root):
    """``python -m clustersim schema > /dev/full``, as a user's shell runs it."""
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "clustersim", "schema"], stdout=full, stderr=subprocess.PIPE,
                           text=True)
    assert (r.returncode, r.stderr) == (2, "error: cannot write the standard output: No space left on device\n")


@pytest.mark.parametrize("args", [("--help",), ("run", "--help"), ("--version",)])
def test_help_that_cannot_be_written_is_one_line(monkeypatch, capsys, args):
    """``--help > /dev/full`` (a command's too, and --version): one line on stderr, exit code
    2, as for a command's output (argparse dropped the OSError and exited 0)."""
    from clustersim.cli import main

    monkeypatch.setattr(sys, "stdout", _Full())
    rc = main(list(args))
    assert (rc, capsys.readouterr().err) == (2, "error: cannot write the standard output: No space left on device\n")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_dev_full_as_the_help_s_stdout_is_one_line(root, unbuffered):
    """``python -m clustersim --help > /dev/full`` (and ``run --help``), as a user's shell runs
    it, with stdout buffered or not (PYTHONUNBUFFERED): exit code 2 and one line, not 0 (or
    120 and a traceback of the flush at the exit)."""
    env = {**os.environ, "PYTHONUNBUFFERED": unbuffered}
    for args in (["--help"], ["run", "--help"]):
        with open("/dev/full", "w") as full:
            r = subprocess.run([sys.executable, "-m", "clustersim", *args], stdout=full, stderr=subprocess.PIPE,
                               text=True, cwd=root, env=env)
        assert (r.returncode, r.stderr) == (2, "error: cannot write the standard output: No space left on device\n")


def test_an_out_on_a_read_only_file_system_says_so(tmp_path, monkeypatch):
    """A folder that cannot be written because its file system is mounted read-only is said to
    be that, not "permission denied" (which no chmod would mend)."""
    from types import SimpleNamespace

    from clustersim.cli import _out_problem

    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    assert _out_problem(tmp_path) == f"cannot write in {tmp_path} (permission denied)"
    monkeypatch.setattr(os, "statvfs", lambda p: SimpleNamespace(f_flag=os.ST_RDONLY))
    assert _out_problem(tmp_path) == f"cannot write in {tmp_path} (read-only file system)"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="flock, and the test's SIGKILL of a group")
def test_temp_folders_a_killed_run_left_are_removed_by_the_next(tmp_path, root):
    """A run killed by SIGKILL leaves its temp folder (megabytes of partial files): the next
    command writing into the same folder removes it. One another process holds (a run still
    running) stays, and so does whatever is not such a folder."""
    import fcntl
    import signal
    import time

    out = tmp_path / "out"
    p = _run_until_staged(root, out, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert p.poll() is None, "the run ended before it could be killed"
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    (killed,) = _staging_folders(out)
    time.sleep(0.2)  # (the forked writer, killed with the group, gone: it held the lock too)
    held = out / ".clustersim-heldhe1d"
    held.mkdir()
    others = [out / ".clustersim-notours", out / ".clustersim-12345678.txt"]
    others[0].mkdir()
    others[1].write_text("a file")
    (out / ".clustersim-linkto00").symlink_to(held)
    fd = os.open(held, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        r = run_cli("run", root / "scenarios/llama3_8b_8gpu.yaml", "--no-trace", "--no-report", "--out", out)
        assert r.returncode == 0, r.stderr
    finally:
        os.close(fd)
    assert not killed.exists()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [".clustersim-heldhe1d", ".clustersim-linkto00", *(p.name for p in others), "summary.json"])


def test_changes_joined_or_split_wrongly_say_how_to_write_them(root):
    """``--set "parallel.tp=4,parallel.dp=2"`` (or with ``;``) said only that tp cannot be
    '4,parallel.dp=2'; ``--set "parallel.tp= 4"`` that '4' is not KEY=VALUE: each says how to
    write the changes now."""
    path = "scenarios/llama3_8b_8gpu.yaml"
    for given, says in [
        ("parallel.tp=4,parallel.dp=2", "(got '4,parallel.dp=2'); changes are separated by spaces, not commas or "
                                        "semicolons: 'parallel.tp=4 parallel.dp=2'"),
        ("parallel.tp=4;parallel.dp=2", "changes are separated by spaces, not commas or semicolons: "
                                        "'parallel.tp=4 parallel.dp=2'"),
        ("parallel.tp=4; parallel.dp=2", "(got '4;'); changes are separated by spaces, not commas or semicolons: "
                                         "drop the ';' after parallel.tp=4"),
        ("parallel.tp= 4", "--set 'parallel.tp= 4': '4' is not KEY=VALUE with a dotted key (e.g. parallel.zero=3); "
                           "a space beside the = splits a change in two: write parallel.tp=4"),
        ("parallel.tp =4", "'parallel.tp' is not KEY=VALUE with a dotted key (e.g. parallel.zero=3); a space beside "
                           "the = splits a change in two: write parallel.tp=4"),
        ("parallel.tp = 4", "write parallel.tp=4"),
    ]:
        r = run_cli("validate", path, "--set", given, cwd=root)
        one_line_exit_2(r, "error: ")
        assert says in r.stderr, r.stderr
    # a value that is not a change keeps its plain refusal
    r = run_cli("validate", path, "--set", "parallel.tp=4,2", cwd=root)
    assert r.returncode == 2 and "separated by spaces" not in r.stderr
