"""A corpus of bad topology files (tests/data/bad/topologies/), each named by a valid scenario:
one line naming the topology file and the field, exit code 2, no traceback, nothing written,
in well under a second (several of them hung or took seconds before their guard)."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import yaml

from clustersim.cli import main

from .conftest import SMALL

BAD = Path(__file__).resolve().parent / "data" / "bad" / "topologies"
EXPECTED = yaml.safe_load((BAD / "expected.yaml").read_text())
FILES = sorted(p.name for p in BAD.glob("*.yaml") if p.name != "expected.yaml")


def test_every_bad_topology_has_an_expected_message():
    assert sorted(EXPECTED) == FILES


@pytest.mark.parametrize("name", FILES)
def test_bad_topology_gives_its_message(name, tmp_path, capsys):
    scenario = copy.deepcopy(SMALL)  # 16 GPUs: the size of the topologies that get that far
    scenario["cluster"] = {"topology": str(BAD / name)}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(scenario))
    out = tmp_path / "out"
    t0 = time.perf_counter()
    rc = main(["run", str(tmp_path / "s.yaml"), "--out", str(out)])
    wall = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and "Traceback" not in err and len(err) < 600
    assert err.startswith(f"error: {BAD / name}: ")
    assert EXPECTED[name] in err
    assert not out.exists()
    assert wall < 2.0
