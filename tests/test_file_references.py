"""Files a scenario names (``cluster.topology``, ``parallel.schedule_file``) resolve against the
scenario's own folder (or ``base_dir`` for a dict), whatever the current folder; a missing one
is a ConfigError naming the scenario, the field and the resolved path. Topologies and schedule
files name no other file, so references cannot form a cycle. Plus the size guards on the files
themselves (tests/fuzz_topologies.py found or motivated each)."""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import yaml

import clustersim
from clustersim.cli import main
from clustersim.config import MAX_SCHEDULE_FILE_BYTES, MAX_STAGE_PASSES
from clustersim.errors import ConfigError
from clustersim.hardware import topology
from clustersim.hardware.topology import MAX_FABRIC_CABLES, MAX_GPUS, TopologyCfg, check_size
from clustersim.yamlio import MAX_YAML_BYTES

from .conftest import ROOT, SMALL


@pytest.fixture
def tree(tmp_path):
    """tmp/topologies/x.yaml, tmp/runs/s.yaml (naming ../topologies/x.yaml) and
    tmp/runs/schedules/c.txt with tmp/runs/c.yaml naming it; tmp/elsewhere to stand in."""
    (tmp_path / "topologies").mkdir()
    shutil.copy(ROOT / "topologies/dgx-h100.yaml", tmp_path / "topologies/x.yaml")
    runs = tmp_path / "runs"
    (runs / "schedules").mkdir(parents=True)
    shutil.copy(ROOT / "scenarios/schedules/custom_1f1b_4x8.txt", runs / "schedules/c.txt")
    s = copy.deepcopy(SMALL)
    s["cluster"] = {"topology": "../topologies/x.yaml", "nodes": 2}
    (runs / "s.yaml").write_text(yaml.safe_dump(s))
    c = yaml.safe_load((ROOT / "scenarios/custom_schedule.yaml").read_text())
    c["cluster"]["topology"] = "../topologies/x.yaml"
    c["parallel"]["schedule_file"] = "schedules/c.txt"
    (runs / "c.yaml").write_text(yaml.safe_dump(c))
    (tmp_path / "elsewhere").mkdir()
    return tmp_path


@pytest.mark.parametrize("cwd", ["elsewhere", "topologies", "runs/schedules", "/"])
def test_references_resolve_against_the_scenario_folder_from_any_cwd(tree, monkeypatch, cwd):
    monkeypatch.chdir(tree / cwd)
    sc = clustersim.load_scenario(tree / "runs/s.yaml")
    assert sc.mesh.world_size == 16 and sc.topology.name == "DGX-H100 SuperPOD"
    custom = clustersim.load_scenario(tree / "runs/c.yaml")
    assert custom.schedule_path == str(tree / "runs/schedules/c.txt")
    assert custom.n_parts == 4 and custom.schedule_text.startswith("#")


def test_a_relative_scenario_path_is_taken_from_the_cwd_and_its_references_from_its_folder(tree, monkeypatch):
    monkeypatch.chdir(tree / "elsewhere")
    assert clustersim.load_scenario("../runs/c.yaml").schedule_path == os.path.join("..", "runs", "schedules",
                                                                                   "c.txt")


def test_cli_validate_and_run_work_from_another_folder(tree, monkeypatch, capsys):
    monkeypatch.chdir(tree / "elsewhere")
    assert main(["validate", str(tree / "runs/s.yaml"), "../runs/c.yaml"]) == 0
    assert capsys.readouterr().out.count(": ok (16 GPUs") == 2
    assert main(["run", "../runs/s.yaml", "--out", "out", "--no-report", "--no-trace"]) == 0
    assert (tree / "elsewhere/out/summary.json").is_file()


def test_a_dict_scenario_resolves_against_base_dir(tree, monkeypatch):
    monkeypatch.chdir(tree / "elsewhere")
    d = yaml.safe_load((tree / "runs/c.yaml").read_text())
    sc = clustersim.load_scenario(d, base_dir=tree / "runs")
    assert sc.schedule_path == str(tree / "runs/schedules/c.txt") and sc.topology.name == "DGX-H100 SuperPOD"
    monkeypatch.chdir(tree / "runs/schedules")
    with pytest.raises(ConfigError) as err:  # no base_dir: the current folder, where it is not
        clustersim.load_scenario(d)
    assert err.value.source == "<dict>" and err.value.field == "cluster.topology"
    assert "relative to the current folder (a dict without base_dir)" in err.value.message
    assert str(tree / "runs/topologies/x.yaml") in err.value.message


@pytest.mark.parametrize("field, value, what", [
    ("cluster.topology", "../topologies/gone.yaml", "topology"),
    ("parallel.schedule_file", "schedules/gone.txt", "schedule"),
])
def test_a_missing_reference_names_the_scenario_the_field_and_the_resolved_path(tree, monkeypatch, field, value,
                                                                                what):
    d = yaml.safe_load((tree / "runs/c.yaml").read_text())
    section, key = field.split(".")
    d[section][key] = value
    (tree / "runs/c.yaml").write_text(yaml.safe_dump(d))
    monkeypatch.chdir(tree / "elsewhere")
    with pytest.raises(ConfigError) as err:
        clustersim.load_scenario(tree / "runs/c.yaml")
    resolved = os.path.abspath(tree / "runs" / value)
    assert err.value.source == str(tree / "runs/c.yaml") and err.value.field == field
    assert err.value.message == f"{what} file not found: {value} (relative to the scenario's folder: {resolved})"


def test_a_topology_names_no_other_file(tree):
    """No include or reference key: a topology that tries is refused, so no reference cycle
    can form (nor through a schedule file, which holds actions only)."""
    t = yaml.safe_load((tree / "topologies/x.yaml").read_text())
    t["include"] = "x.yaml"
    (tree / "topologies/x.yaml").write_text(yaml.safe_dump(t))
    with pytest.raises(ConfigError, match="include: unknown key"):
        clustersim.load_scenario(tree / "runs/s.yaml")


def test_a_scenario_naming_itself_as_its_topology_is_a_clear_error(tree):
    d = yaml.safe_load((tree / "runs/s.yaml").read_text())
    d["cluster"]["topology"] = "s.yaml"
    (tree / "runs/s.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(ConfigError) as err:
        clustersim.load_scenario(tree / "runs/s.yaml")
    assert err.value.source == str(tree / "runs/s.yaml")  # read as a topology, it is named a scenario
    assert "this is a scenario file (it has cluster and model, not gpu)" in err.value.message


def test_a_file_name_too_long_for_the_file_system_is_a_config_error(tree):
    d = yaml.safe_load((tree / "runs/s.yaml").read_text())
    d["cluster"]["topology"] = "x" * 5000 + ".yaml"
    with pytest.raises(ConfigError, match="cannot read topology file 'xxx") as err:
        clustersim.load_scenario(d, base_dir=tree / "runs")
    assert err.value.field == "cluster.topology" and len(err.value.line()) < 400


# ---------------------------------------------------------------------------------------------
# size guards


def test_yaml_files_over_the_size_cap_are_refused_before_parsing(tree):
    for path in (tree / "runs/s.yaml", tree / "topologies/x.yaml"):
        original = path.read_text()
        path.write_text(original + "# " + "x" * MAX_YAML_BYTES + "\n")
        with pytest.raises(ConfigError, match=f"bytes; clustersim reads .* files of at most {MAX_YAML_BYTES:,}") \
                as err:
            clustersim.load_scenario(tree / "runs/s.yaml")
        assert err.value.source == str(path) or err.value.source.endswith("../topologies/x.yaml")
        path.write_text(original)


def test_a_schedule_file_over_the_size_cap_is_refused(tree):
    with open(tree / "runs/schedules/c.txt", "a") as f:
        f.write("#" * MAX_SCHEDULE_FILE_BYTES)
    with pytest.raises(ConfigError, match="a custom schedule is parsed whole") as err:
        clustersim.load_scenario(tree / "runs/c.yaml")
    assert err.value.field == "parallel.schedule_file"


def test_stage_passes_are_capped_where_the_microbatches_are():
    # pp = 1 with the most microbatches is exactly the cap: one does not refuse what the other takes
    assert MAX_STAGE_PASSES == 65_536
    d = copy.deepcopy(SMALL)
    d["parallel"] = {"tp": 1, "pp": 8, "dp": 2}
    d["model"]["layers"] = 8
    d["training"]["global_batch_size"] = 2 * 8193  # 8 x 8193 passes
    with pytest.raises(ConfigError, match="pp\\*vpp\\*m = 8\\*1\\*8193 = 65,544 stage passes") as err:
        clustersim.load_scenario(d, base_dir=ROOT)
    assert err.value.field == "training.global_batch_size"


def _nothing_built(monkeypatch):
    """Make building a cluster's graph fail the test: a refusal must come from the plan."""
    def built(*_a, **_k):
        raise AssertionError("the cluster graph was built before the refusal")

    monkeypatch.setattr(topology, "build_cluster", built)
    monkeypatch.setattr(topology, "_build_fabric", built)


def test_a_scenario_node_count_too_large_names_the_scenario(tmp_path, monkeypatch):
    d = copy.deepcopy(SMALL)
    d["cluster"]["nodes"] = 10**7
    d["cluster"]["what_if"] = [{"remove_switch": "spine0"}]
    _nothing_built(monkeypatch)
    with pytest.raises(ConfigError) as err:
        clustersim.load_scenario(d, base_dir=ROOT)
    assert err.value.source == "<dict>" and err.value.field == "cluster.nodes"
    assert err.value.message.startswith(f"10000000 nodes x 8 GPUs = 80,000,000 GPUs; clustersim builds the "
                                        f"cluster graph in memory and takes at most {MAX_GPUS:,} GPUs")
    assert "topologies/dgx-a100.yaml" in err.value.message


@pytest.mark.parametrize("fabric, nodes, field", [
    ({"kind": "leaf_spine"}, 4096, "fabric.spines"),  # 2,048 leaves x 2,048 spines by default
    ({"kind": "leaf_spine", "spines": 30000, "nodes_per_leaf": 1}, 2, "fabric.spines"),
    ({"kind": "fat_tree", "radix": 60000}, 2, "fabric.radix"),
    ({"kind": "fat_tree", "radix": 256, "tiers": 3, "rail_optimized": False}, 16384, "fabric.radix"),  # 8 pods
])
def test_fabrics_too_large_to_build_are_refused_from_the_plan(fabric, nodes, field, monkeypatch):
    cfg = TopologyCfg.model_validate({"gpu": "H100", "nodes": nodes, "fabric": fabric})
    _nothing_built(monkeypatch)
    with pytest.raises(ConfigError, match=f"at most {MAX_FABRIC_CABLES:,} switch-to-switch cables") as err:
        check_size(cfg)
    assert err.value.field == field


def test_shipped_topologies_fit_the_fabric_cap_at_the_gpu_cap():
    for name, nodes in [("dgx-a100", 16384), ("dgx-h100", 16384), ("fat-tree", 8192),
                        ("roce-clos-llama3", 16384), ("h800-cluster", 256), ("gb200-nvl72", 144)]:
        d = yaml.safe_load((ROOT / f"topologies/{name}.yaml").read_text())
        check_size(TopologyCfg.model_validate({**d, "nodes": nodes}))


def test_a_long_what_if_list_is_checked_in_one_pass(tmp_path, monkeypatch):
    """Each removal used to walk every GPU (seconds per entry on large clusters); the reach
    check now runs once, and bisects only when something is cut off: counted in walks of the
    switch graph (``_Reach._cut_off``)."""
    walks = []
    cut_off = topology._Reach._cut_off

    def counted(self, k):
        walks.append(k)
        return cut_off(self, k)

    monkeypatch.setattr(topology._Reach, "_cut_off", counted)
    t = yaml.safe_load((ROOT / "topologies/dgx-h100.yaml").read_text())
    t["nodes"] = 512  # 4,096 GPUs, 128 leaves, 16 spines
    t["what_if"] = [{"remove_link": f"leaf{g}.{r}-spine{s}"} for g in range(16) for r in range(8) for s in range(2)]
    t["what_if"] += [{"link": f"n{i}.nic0-leaf{i // 32}.0", "bw_factor": 0.5} for i in range(256)]
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(t))
    d = copy.deepcopy(SMALL)
    d["cluster"] = {"topology": str(tmp_path / "t.yaml")}
    d["parallel"] = {"tp": 8, "pp": 1, "dp": 512}
    d["training"]["global_batch_size"] = 512
    sc = clustersim.load_scenario(d)
    assert len(sc.topology.what_if) == 512 and walks == [256]  # its 256 removals, walked once
    walks.clear()
    t["what_if"] += [{"remove_switch": f"spine{s}"} for s in range(16)]  # the last one cuts every rail off
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(t))
    with pytest.raises(ConfigError, match="removing switch spine15 cuts GPUs") as err:
        clustersim.load_scenario(d)
    assert err.value.field == "what_if[527]"
    # the whole list, a bisection over its 272 removals (at most 9 halvings), the message's
    assert walks[0] == walks[-1] == 272 and len(walks) <= 1 + 9 + 1


@pytest.mark.parametrize("wrong", [123, None, b"runs/s.yaml", ["runs/s.yaml"]], ids=repr)
def test_a_scenario_that_is_neither_a_path_nor_a_dict_is_a_type_error_naming_the_type(wrong):
    """From Python, a scenario of another type is the caller's mistake: a TypeError naming the
    type (it was pathlib's "expected str, bytes or os.PathLike object"), never a
    ConfigError, which is for bad input."""
    with pytest.raises(TypeError, match=f"a scenario is a YAML file's path or a dict, not {type(wrong).__name__}$"):
        clustersim.simulate(wrong)


@pytest.mark.parametrize("mistake", ["typo", "scenario", "what_if"])
def test_a_topology_files_own_mistake_names_that_file_then_the_scenario_that_reads_it(tree, mistake, capsys):
    """The file and the field to mend come first (the topology's); the scenario that led there
    follows, so that a run of a scenario whose topology is broken, or is another scenario,
    says which of the user's files points at it."""
    x = tree / "topologies/x.yaml"
    if mistake == "typo":
        x.write_text(x.read_text().replace("bw_Gbps: 400", "bw_Gbs: 400"))
        field = "node.nic.bw_Gbs"
    elif mistake == "scenario":
        x.write_text((tree / "runs/s.yaml").read_text())
        field = None
    else:
        d = yaml.safe_load(x.read_text())
        d["what_if"] = [{"gpu": 999, "slowdown": 1.2}]
        x.write_text(yaml.safe_dump(d))
        field = "what_if[0]"
    with pytest.raises(ConfigError) as err:
        clustersim.load_scenario(tree / "runs/s.yaml")
    assert err.value.source == str(tree / "runs/../topologies/x.yaml") and err.value.field == field
    assert err.value.message.endswith(f"(the topology of {tree / 'runs/s.yaml'}, cluster.topology)")
    # read alone, the topology file's error names no scenario (one holding a scenario is read
    # as one, and names itself as its topology's reader)
    if mistake != "scenario":
        assert main(["validate", str(x)]) == 2
        assert "the topology of" not in capsys.readouterr().err
