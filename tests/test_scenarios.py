"""Every scenario in scenarios/ (but a user's own my_*.yaml) runs, passes sanity invariants and matches its reviewed summary.

The reviewed summaries live in tests/golden/<scenario>.json. After a deliberate modelling
change, regenerate them with ``CLUSTERSIM_UPDATE_GOLDEN=1 python -m pytest tests/test_scenarios.py``
and review the diff like code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import clustersim

from .conftest import shipped_scenarios

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = shipped_scenarios()
GOLDEN = ROOT / "tests" / "golden"
KEYS = ("step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "hfu", "bubble_fraction")


def headline(s: dict) -> dict:
    return {
        **{k: s[k] for k in KEYS},
        "exposed_comm_s": s["exposed_comm_s"],
        "memory_peak_bytes": [st["peak_bytes"] for st in s["memory"]["stages"]],
        "fits": s["memory"]["fits"],
    }


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_scenario_runs_and_matches_reviewed_summary(path):
    s = clustersim.simulate(path).summary
    # invariants any run must hold
    assert s["step_time_s"] > 0
    assert 0 < s["mfu"] <= s["hfu"] < 1
    assert 0 <= s["bubble_fraction"] < 1
    assert s["exposed_comm_s"]["total"] <= sum(s["comm_s"].values()) + 1e-12
    assert s["compute_s"] + s["exposed_comm_s"]["total"] <= s["step_time_s"] * (1 + 1e-9)
    assert s["world_size"] == s["plan"]["tp"] * s["plan"]["cp"] * s["plan"]["pp"] * s["plan"]["dp"]

    golden = GOLDEN / f"{path.stem}.json"
    got = headline(s)
    if os.environ.get("CLUSTERSIM_UPDATE_GOLDEN"):
        golden.write_text(json.dumps(got, indent=2) + "\n")
    assert golden.exists(), f"no reviewed summary for {path.name}; see this module's docstring"
    want = json.loads(golden.read_text())
    assert got.keys() == want.keys()
    for k in KEYS:
        assert got[k] == pytest.approx(want[k], rel=1e-6), k
    assert got["exposed_comm_s"] == pytest.approx(want["exposed_comm_s"], rel=1e-6, abs=1e-12)
    assert got["memory_peak_bytes"] == pytest.approx(want["memory_peak_bytes"], rel=1e-9)
    assert got["fits"] == want["fits"]


BENCH = sorted((ROOT / "bench" / "scenarios").glob("*.yaml"))


@pytest.mark.parametrize("path", BENCH, ids=[p.stem for p in BENCH])
def test_bench_scenario_is_valid(path):
    """The speed benchmarks' scenarios (not simulated here: seconds each) load and check."""
    sc = clustersim.load_scenario(path)
    assert sc.mesh.world_size == sc.cfg.cluster.nodes * sc.cluster.cfg.node.gpus
    assert sc.microbatches >= 1
