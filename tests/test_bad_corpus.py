"""A corpus of bad scenarios (tests/data/bad/): each ends in one line naming the file and the
field, exit code 2, no traceback, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from clustersim.cli import main
from clustersim.errors import ConfigError

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


def test_keys_merged_in_with_yaml_merge_keys_may_be_overridden(tmp_path):
    """``<<: *base`` then a key of the base again is YAML's way to override: not a duplicate.
    An alias met twice is walked once (an alias bomb stays small)."""
    from clustersim.yamlio import read_yaml

    path = tmp_path / "merge.yaml"
    path.write_text("base: &b {tp: 2, pp: 1}\nparallel:\n  <<: *b\n  tp: 4\nagain: [*b, *b, *b]\n")
    data = read_yaml(path, what="scenario")
    assert data["parallel"] == {"tp": 4, "pp": 1}
    path.write_text("a:\n  - x: 1\n  - {y: 2, y: 3}\n")
    with pytest.raises(ConfigError, match=r"a\[1\]\.y: key given twice \(line 3, first on line 3\)"):
        read_yaml(path, what="scenario")
    # the first duplicate in the document is named; keys are compared as loaded
    path.write_text("a:\n  x: 1\n  x: 2\nb: 1\nb: 2\n")
    with pytest.raises(ConfigError, match=r"a\.x: key given twice \(line 3, first on line 2\)"):
        read_yaml(path, what="scenario")
    path.write_text("m:\n  1: a\n  0x1: b\n")
    with pytest.raises(ConfigError, match=r"m\.0x1: key given twice \(line 3, first on line 2\)"):
        read_yaml(path, what="scenario")
