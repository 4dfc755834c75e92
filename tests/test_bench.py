"""bench/bench_scale.py still measures what it says: run on a small scenario, it prints every
row, and its sizes are those of the program the lowering makes (the benchmark imports the
engine, the lowering and the writers phase by phase, so an API change would break it silently)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

from clustersim.config import load_scenario
from clustersim.program.lower import lower

from .conftest import ROOT

SCENARIO = ROOT / "scenarios" / "llama3_8b_8gpu.yaml"


def _rows() -> list[str]:
    spec = importlib.util.spec_from_file_location("bench_scale", ROOT / "bench" / "bench_scale.py")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return [label for label, _, _ in mod.ROWS]


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
    assert values["GPUs"] == 8 and values["simulated ranks"] == len(prog.ranks)
    assert values["simpy events"] > 0 and values["peak RSS MiB"] > 0
    assert values["total s"] >= values["engine s"] > 0


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
    says whether they agree (seed 0's first plan: ZB-H1 with EP, a cycle of 2)."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "fuzz_repeat.py"), "0", "1"], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "simulated, cycle" in r.stdout and "0 plan(s) differ" in r.stdout
