"""A corpus of bad scenarios (tests/data/bad/): each ends in one line naming the file and the
field, exit code 2, no traceback, nothing written."""

from __future__ import annotations

import re
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


def test_exponent_numbers_are_numbers_as_yaml_1_2_reads_them(tmp_path):
    """PyYAML (YAML 1.1) reads ``4e7`` and ``15e-1`` as strings, which the check of quoted
    numbers then refused as quoted (a user's ``slowdown: 15e-1`` ran before it): they load as
    the numbers they are, in scenario and topology files alike, while a quoted ``'4e7'`` stays
    a string and is refused."""
    import clustersim
    from clustersim.yamlio import load_unique

    assert load_unique("a: 4e7\nb: 1.5e3\nc: .5E-2\nd: '4e7'\ne: 42\nf: e7\ng: -3e2\n", "t") == {
        "a": 4e7, "b": 1500.0, "c": 0.005, "d": "4e7", "e": 42, "f": "e7", "g": -300.0}
    root = Path(__file__).resolve().parents[1]
    topo = (root / "topologies" / "dgx-h100.yaml").read_text().replace("latency_us: 0.6", "latency_us: 6e-1")
    assert "6e-1" in topo
    (tmp_path / "t.yaml").write_text(topo)
    scenario = (tmp_path / "s.yaml")
    scenario.write_text("name: x\ncluster: {topology: t.yaml, nodes: 2, what_if: [{gpu: 0, slowdown: 15e-1}]}\n"
                        "model: {name: m, layers: 4, hidden: 1024, heads: 16, vocab: 32000, seq_len: 1024}\n"
                        "parallel: {tp: 8, dp: 2}\n"
                        "training: {micro_batch_size: 1, global_batch_size: 2, dp_bucket_params: 4e7}\n")
    sc = clustersim.load_scenario(scenario)
    assert sc.training.dp_bucket_params == 40_000_000 and sc.topology.fabric.latency_us == 0.6
    assert sc.topology.what_if[0].slowdown == 1.5
    scenario.write_text(scenario.read_text().replace("dp_bucket_params: 4e7", "dp_bucket_params: '4e7'"))
    with pytest.raises(ConfigError, match=r"training.dp_bucket_params: a number, not a string \('4e7': quoted, or "
                                          r"tagged !!str\)"):
        clustersim.load_scenario(scenario)


def test_a_surrogate_pair_is_joined_into_its_character(tmp_path):
    """JSON writers escape an emoji as two surrogates ("\\ud83d\\ude80"); YAML keeps them apart,
    and the report and trace writers then failed with a UnicodeEncodeError traceback. The pair
    is joined into its character (a lone half is refused: lone_surrogate.yaml)."""
    from clustersim.yamlio import load_unique

    assert load_unique('name: "rocket \\ud83d\\ude80"\n', "t") == {"name": "rocket \U0001F680"}
    assert load_unique('"x\\ud83d\\ude80": 1\n', "t") == {"x\U0001F680": 1}  # (in a key too)
    assert load_unique("name: rocket \U0001F680\n", "t") == {"name": "rocket \U0001F680"}


def test_text_that_loads_as_written_is_not_taken_for_a_yaml_1_1_number(tmp_path):
    """Only scalars YAML 1.1 turns into other numbers are refused (010 octal, 1:30 base 60):
    0800, 08:30 and !!str 0800 load as the text written and pass; 08192 where a number goes
    is named for its leading zero, not said to be quoted."""
    import clustersim
    from clustersim.yamlio import load_unique

    for text in ("0800", "08:30", "!!str 0800", "0:30", "'010'"):
        assert load_unique(f"name: {text}\n", "t") == {"name": text.removeprefix("!!str ").strip("'")}
    for text, why in (("010", "leading zero, which YAML 1.1 reads as an octal number"),
                      ("12:00", "base-60 number in YAML 1.1 (720)")):
        with pytest.raises(clustersim.ConfigError, match=re.escape(why)):
            load_unique(f"name: {text}\n", "t")
    root = Path(__file__).resolve().parents[1]
    scenario = (root / "scenarios" / "llama3_8b_8gpu.yaml").read_text().replace("seq_len: 8192", "seq_len: 08192")
    (tmp_path / "s.yaml").write_text(scenario.replace("../topologies", str(root / "topologies")))
    with pytest.raises(clustersim.ConfigError, match=r"model\.seq_len: a number, not a string \('08192': a leading "
                                                     r"zero, which YAML 1.1 reads as text"):
        clustersim.load_scenario(tmp_path / "s.yaml")


def test_an_oversubscription_written_as_a_ratio_says_to_write_its_number(tmp_path):
    """``oversubscription: 2:1`` (base 60 to YAML 1.1) and ``"2:1"`` (text) each say that the
    field takes one number, 2; another base-60 value (1:30) does not call itself a ratio."""
    import clustersim
    from clustersim.yamlio import load_unique

    with pytest.raises(clustersim.ConfigError, match=re.escape("(121); quote it for text, or write the number itself "
                                                               "(a ratio such as an oversubscription is one number: "
                                                               "2:1 is 2)")):
        load_unique("oversubscription: 2:1\n", "t")
    with pytest.raises(clustersim.ConfigError) as got:
        load_unique("at: 1:30\n", "t")
    assert "ratio" not in str(got.value)
    import yaml

    from clustersim.hardware.topology import load_topology_cfg

    root = Path(__file__).resolve().parents[1]
    d = yaml.safe_load((root / "topologies" / "dgx-h100.yaml").read_text())
    d["fabric"]["oversubscription"] = "2:1"
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(clustersim.ConfigError, match=re.escape("fabric.oversubscription: Input should be a valid "
                                                               "number, unable to parse string as a number (got "
                                                               "'2:1': a ratio is one number, 2 for 2:1)")):
        load_topology_cfg(tmp_path / "t.yaml", build=False)


def test_a_topology_path_from_home_is_read_and_an_absolute_one_shown_once(tmp_path, monkeypatch):
    """``~/...`` reads from the home folder, as a shell would (it was taken as a folder named
    ``~`` beside the scenario); an absolute path missing is shown once, without a "relative to"
    of itself. A section given a value says so without naming the model's class."""
    import clustersim

    root = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "topos").mkdir()
    (tmp_path / "topos" / "t.yaml").write_text((root / "topologies" / "dgx-h100.yaml").read_text())
    text = (root / "scenarios" / "llama3_8b_8gpu.yaml").read_text()
    scenario = tmp_path / "s.yaml"
    scenario.write_text(text.replace("../topologies/dgx-h100.yaml", "~/topos/t.yaml"))
    assert clustersim.load_scenario(scenario).topology.node.gpus == 8
    scenario.write_text(text.replace("../topologies/dgx-h100.yaml", "/nonexistent/t.yaml"))
    with pytest.raises(ConfigError) as err:
        clustersim.load_scenario(scenario)
    assert err.value.message == "topology file not found: /nonexistent/t.yaml"
    scenario.write_text(text.replace("../topologies/dgx-h100.yaml", str(tmp_path / "topos" / "t.yaml"))
                        .replace("model:\n", "model: 5\nunused:\n"))
    with pytest.raises(ConfigError, match=r"model: should be keys and values \(a mapping\), not a number \(got 5\)"):
        clustersim.load_scenario(scenario)


def test_every_field_refused_is_named_on_the_one_line(tmp_path, capsys, root):
    """A file with several mistakes names the first with its message and the others after it,
    on the same line, so that it is not mended one run at a time; a required key missing beside
    an unknown key of its section (``hiden`` for ``hidden``) is the misspelling, said once."""
    src = (root / "scenarios" / "llama3_8b_8gpu.yaml").read_text().replace("../topologies", str(root / "topologies"))
    bad = tmp_path / "several.yaml"
    bad.write_text(src.replace("heads: 32", "heads: 3x").replace("tp: 4", "tp: -1")
                   .replace("micro_batch_size: 1", "micro_batch_size: 0"))
    out = tmp_path / "out"
    rc = main(["run", str(bad), "--out", str(out)])
    assert_refused(capsys.readouterr().err, rc, bad, "model.heads: Input should be a valid integer", out)
    rc = main(["run", str(bad), "--out", str(out)])
    err = capsys.readouterr().err
    assert err.rstrip().endswith("(got '3x'); also refused: parallel.tp, training.micro_batch_size"), err
    bad.write_text(src.replace("hidden: 4096", "hiden: 4096"))
    rc = main(["run", str(bad), "--out", str(out)])
    err = capsys.readouterr().err
    assert_refused(err, rc, bad, "model.hiden: unknown key (did you mean 'hidden'?", out)
    assert "also refused" not in err
    # past four, the rest are counted
    many = src.replace("heads: 32", "heads: x").replace("tp: 4", "tp: x").replace("pp: 1", "pp: x") \
        .replace("dp: 2", "dp: x").replace("layers: 32", "layers: x").replace("vocab: 128256", "vocab: x")
    bad.write_text(many)
    rc = main(["run", str(bad), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert err.rstrip().endswith("also refused: model.heads, model.vocab, parallel.tp, parallel.pp and 1 more"), err
