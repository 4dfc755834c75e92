"""A corpus of bad scenarios (tests/data/bad/): each ends in one line naming the file and the
field, exit code 2, no traceback, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from clustersim.cli import main

BAD = Path(__file__).resolve().parent / "data" / "bad"
EXPECTED = yaml.safe_load((BAD / "expected.yaml").read_text())
FILES = sorted(p.name for p in BAD.glob("*.yaml") if p.name != "expected.yaml")


def test_every_bad_file_has_an_expected_message():
    assert sorted(EXPECTED) == FILES


@pytest.mark.parametrize("name", FILES)
def test_bad_scenario_gives_its_message(name, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["run", str(BAD / name), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"error: {BAD / name}: ")
    assert EXPECTED[name] in err
    assert not out.exists()
