"""A corpus of bad topology files (tests/data/bad/topologies/), each named by a valid scenario:
one line naming the topology file and the field, exit code 2, no traceback, nothing written,
in well under a second (several of them hung or took seconds before their guard)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from clustersim.cli import main

from .conftest import SMALL, assert_refused, bad_corpus

BAD = Path(__file__).resolve().parent / "data" / "bad" / "topologies"
EXPECTED, FILES = bad_corpus(BAD)


def test_every_bad_topology_has_an_expected_message():
    assert sorted(EXPECTED) == FILES


@pytest.mark.parametrize("name", FILES)
def test_bad_topology_gives_its_message(name, tmp_path, capsys):
    scenario = copy.deepcopy(SMALL)  # 16 GPUs: the size of the topologies that get that far
    scenario["cluster"] = {"topology": str(BAD / name)}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(scenario))
    out = tmp_path / "out"
    rc = main(["run", str(tmp_path / "s.yaml"), "--out", str(out)])
    err = capsys.readouterr().err
    assert_refused(err, rc, BAD / name, EXPECTED[name], out)
    assert len(err) < 600  # (an alias bomb quoted whole was hundreds of MB)
