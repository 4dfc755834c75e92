"""A corpus of bad scenarios (tests/data/bad/): each ends in one line naming the file and the
field, exit code 2, no traceback, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from clustersim.cli import main

from .conftest import assert_refused, bad_corpus

BAD = Path(__file__).resolve().parent / "data" / "bad"
EXPECTED, FILES = bad_corpus(BAD)


def test_every_bad_file_has_an_expected_message():
    assert sorted(EXPECTED) == FILES


@pytest.mark.parametrize("name", FILES)
def test_bad_scenario_gives_its_message(name, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["run", str(BAD / name), "--out", str(out)])
    assert_refused(capsys.readouterr().err, rc, BAD / name, EXPECTED[name], out)
