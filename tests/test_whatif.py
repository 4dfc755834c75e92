"""What-ifs in a scenario: a straggler GPU, a degraded or removed link."""

from __future__ import annotations

import html

import pytest
import yaml

import clustersim
from clustersim.errors import ConfigError
from clustersim.output.summary import format_summary

from .conftest import scenario_dict
from .test_cli import run_cli


def _run(root, what_if, **parallel):
    d = scenario_dict(parallel={"tp": 4, "pp": 2, "dp": 2, **parallel}, training={"global_batch_size": 16})
    d["cluster"]["what_if"] = what_if
    return clustersim.simulate(clustersim.load_scenario(d, base_dir=root))


def test_a_straggler_slows_its_replicas_and_splits_the_classes(root):
    """GPU 5 computes 1.5x slower: its compute takes 1.5x as long, the rest wait for it at
    their collectives. The classes split around it, four a stage: GPU 5's pipeline chain, its
    TP peers' chains, and in the other DP replica GPU 5's TP index and the rest
    (tests/test_symmetry.py has the larger cases)."""
    base = _run(root, [])
    slow = _run(root, [{"gpu": 5, "slowdown": 1.5}])
    assert slow.summary["simulation"]["simulated_ranks"] == 8
    assert base.summary["simulation"]["simulated_ranks"] == 2
    compute_of = lambda r, rank: sum(s.end_s - s.start_s for s in r.trace.spans  # noqa: E731
                                     if s.rank == rank and s.stream == "compute")
    assert compute_of(slow, 5) == pytest.approx(1.5 * compute_of(slow, 4), rel=1e-9)
    # every chain of dependencies crosses each of GPU 5's compute spans at most once: the step
    # grows, and by at most the half of GPU 5's compute that the slowdown adds
    extra = 0.5 * compute_of(slow, 4)
    assert base.summary["step_time_s"] < slow.summary["step_time_s"] <= base.summary["step_time_s"] + extra * (1 + 1e-9)


def test_the_what_ifs_are_named_in_the_summary_and_its_cluster_line(root):
    """A run under faults says which, beside the cluster it ran on: ``hardware.what_if`` as
    given, and the terminal's cluster line; none, and it says nothing."""
    from clustersim.output.report import header_html

    s = _run(root, [{"link": "n0.nic0->leaf0.0", "bw_factor": 0.5}, {"gpu": 5, "slowdown": 1.5}]).summary
    assert s["hardware"]["what_if"] == [{"link": "n0.nic0->leaf0.0", "bw_factor": 0.5}, {"gpu": 5, "slowdown": 1.5}]
    line = next(x for x in format_summary(s).splitlines() if x.startswith("cluster "))
    said = " · what-if: n0.nic0->leaf0.0 x0.5 bandwidth, GPU 5 1.5x slower"
    assert line.endswith(said) and html.escape(said) in header_html(s)
    base = _run(root, []).summary
    assert base["hardware"]["what_if"] is None and "what-if" not in format_summary(base) + header_html(base)


def test_a_degraded_nic_slows_the_step(root):
    base = _run(root, [])
    half = _run(root, [{"link": "n0.nic0-leaf0.0", "bw_factor": 0.25}])
    assert half.summary["step_time_s"] > base.summary["step_time_s"]
    assert half.summary["exposed_comm_s"]["dp"] + half.summary["exposed_comm_s"]["pp"] > \
        base.summary["exposed_comm_s"]["dp"] + base.summary["exposed_comm_s"]["pp"]


def test_a_misspelt_what_if_names_the_scenario_entry(root):
    d = scenario_dict(parallel={"tp": 4, "pp": 2, "dp": 2})
    d["cluster"]["what_if"] = [{"gpu": 3, "slowdown": 1.2}, {"remove_switch": "spine99"}]
    with pytest.raises(ConfigError, match=r"cluster\.what_if\[1\]"):
        clustersim.load_scenario(d, base_dir=root)


def test_what_if_in_the_topology_file_applies_too(root, tmp_path):
    topo = yaml.safe_load((root / "topologies/dgx-a100.yaml").read_text())
    topo["what_if"] = [{"gpu": 0, "slowdown": 2.0}]
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(topo))
    d = scenario_dict(cluster={"topology": str(tmp_path / "t.yaml"), "nodes": 2},
                      parallel={"tp": 4, "pp": 2, "dp": 2}, training={"global_batch_size": 16})
    r = clustersim.simulate(clustersim.load_scenario(d, base_dir=root))
    assert r.summary["simulation"]["simulated_ranks"] == 8  # split around GPU 0: four classes a stage


def test_a_straggler_simulates_four_classes_a_stage(root):
    """DP 4: GPU 5 (stage 0, TP 1, DP 1), its TP peers, TP index 1 of the three other
    replicas, and the rest: 8 of 32 simulated, and the all-ranks numbers."""
    d = scenario_dict(cluster={"nodes": 4}, parallel={"tp": 4, "pp": 2, "dp": 4}, training={"global_batch_size": 16})
    d["cluster"]["what_if"] = [{"gpu": 5, "slowdown": 1.5}]
    sc = clustersim.load_scenario(d, base_dir=root)
    split = clustersim.simulate(sc).summary
    full = clustersim.simulate(sc, collapse=False).summary
    assert split["simulation"]["simulated_ranks"] == 8 and full["simulation"]["simulated_ranks"] == 32
    for key in ("step_time_s", "mfu", "bubble_fraction", "compute_s"):
        assert split[key] == pytest.approx(full[key], rel=1e-9), key


def test_a_spine_cut_off_from_every_core_is_routed_around():
    """A three-tier fat tree whose pod spine lost all its core cables (or whose core plane is
    removed) is still connected through the other spines: routes across pods avoid the
    dead-end spine, pair by pair and on arrays (it was an IndexError at the first route)."""
    import numpy as np

    from clustersim.hardware.topology import TopologyCfg, build_cluster

    base = {"gpu": "H100", "nodes": 16, "node": {"gpus": 2, "nics": 2},
            "fabric": {"kind": "fat_tree", "radix": 8, "tiers": 3, "rail_optimized": False}}
    for wi in ([{"remove_link": f"pod0.spine3-core3.{c}"} for c in range(4)],
               [{"remove_switch": f"core3.{c}"} for c in range(4)]):
        cl = build_cluster(TopologyCfg.model_validate(dict(base, what_if=wi)))
        src, dst = np.arange(16).repeat(16), np.tile(np.arange(16, 32), 16)
        rows, lens = cl.paths(src, dst)
        for k in range(len(src)):
            ids = cl.path(int(src[k]), int(dst[k]))
            assert list(rows[k, :lens[k]]) == list(ids)
            hops = [cl.edges[e] for e in ids]
            assert all(not v.startswith("core3.") for _, v in hops)  # no route climbs to the lost plane
            assert any(v.startswith("core") for _, v in hops)  # across pods: through a core


def test_a_topology_s_own_what_if_that_only_the_scenario_s_node_count_breaks_names_cluster_nodes(tmp_path):
    """A topology file with 2 nodes and a straggler on GPU 15 is sound; a scenario that takes
    1 node of it leaves GPU 15 out: the error names the scenario's ``cluster.nodes``, not the
    topology's entry (which was blamed before)."""
    topo = tmp_path / "two.yaml"
    topo.write_text("gpu: H100-SXM5-80GB\nnodes: 2\nnode: {gpus: 8, nics: 8}\n"
                    "fabric: {kind: leaf_spine}\nwhat_if:\n  - {gpu: 15, slowdown: 1.5}\n")
    from clustersim.hardware.topology import load_topology_cfg

    load_topology_cfg(topo)  # sound alone
    d = scenario_dict(cluster={"topology": str(topo), "nodes": 1}, parallel={"tp": 8, "pp": 1, "dp": 1},
                      training={"global_batch_size": 1})
    with pytest.raises(ConfigError) as got:
        clustersim.load_scenario(d, base_dir=tmp_path)
    assert got.value.field == "cluster.nodes"
    assert got.value.message.startswith("what_if[0]: GPU 15 does not exist; the cluster has GPUs 0-7 (topology ")


# ------------------------------------------------------------------ the topology changed from the scenario
TWO_NODES = dict(cluster={"topology": "topologies/dgx-h100.yaml", "nodes": 2},
                 parallel={"tp": 4, "pp": 1, "dp": 4}, training={"global_batch_size": 16})


@pytest.mark.parametrize("change, in_file, listed", [
    ({"node": {"nic": {"bw_Gbps": 800}}}, lambda t: t["node"]["nic"].update(bw_Gbps=800), {"node.nic.bw_Gbps": 800}),
    ({"node": {"nvlink": {"bw_GBps": 900}, "nics": 4}},
     lambda t: (t["node"]["nvlink"].update(bw_GBps=900), t["node"].update(nics=4)),
     {"node.nvlink.bw_GBps": 900, "node.nics": 4}),
    ({"gpu": "B200"}, lambda t: t.update(gpu="B200"), {"gpu": "B200"}),
    # (one node a leaf: the two nodes' traffic crosses the spines)
    ({"fabric": {"oversubscription": 4, "nodes_per_leaf": 1}},
     lambda t: t["fabric"].update(oversubscription=4, nodes_per_leaf=1),
     {"fabric.oversubscription": 4, "fabric.nodes_per_leaf": 1}),
])
def test_a_scenario_changes_its_topology_as_an_edited_file_would(root, tmp_path, change, in_file, listed):
    """cluster.gpu / node / fabric merged into the topology key by key: the same step as the
    topology file edited so, the file's other fields kept, the changes listed in the summary."""
    topo = yaml.safe_load((root / "topologies/dgx-h100.yaml").read_text())
    in_file(topo)
    edited = tmp_path / "edited.yaml"
    edited.write_text(yaml.safe_dump(topo))
    base = scenario_dict(**TWO_NODES)
    changed = scenario_dict(**{**TWO_NODES, "cluster": {**TWO_NODES["cluster"], **change}})
    by_file = scenario_dict(**{**TWO_NODES, "cluster": {**TWO_NODES["cluster"], "topology": str(edited)}})
    s0, s1, s2 = (clustersim.simulate(clustersim.load_scenario(d, base_dir=root)).summary
                  for d in (base, changed, by_file))
    assert s1["step_time_s"] == s2["step_time_s"] != s0["step_time_s"]
    assert s1["hardware"]["gpu"] == s2["hardware"]["gpu"] and s0["hardware"]["changes"] is None
    assert s1["hardware"]["changes"] == listed and s2["hardware"]["changes"] is None
    assert "· changed: " + " ".join(f"{k}={v}" for k, v in listed.items()) in format_summary(s1)


@pytest.mark.parametrize("change, field, says", [
    ({"node": {"nic": {"bw_Gbps": -5}}}, "cluster.node.nic.bw_Gbps", "greater than or equal to 0.01"),
    ({"node": {"nic": {"bw_gbps": 800}}}, "cluster.node.nic.bw_gbps", "did you mean 'bw_Gbps'"),
    ({"node": {"nics": 3}}, "cluster.node", "node.nics=3 does not divide node.gpus=8"),
    ({"gpu": "Z100"}, "cluster.gpu", "unknown GPU 'Z100'"),
    ({"fabric": {"radix": 8}}, "cluster.fabric", "read by kind fat_tree only"),
    ({"node": 5}, "cluster.node", "a mapping"),
])
def test_a_bad_topology_change_names_the_scenario_s_field(root, change, field, says):
    d = scenario_dict(**{**TWO_NODES, "cluster": {**TWO_NODES["cluster"], **change}})
    with pytest.raises(ConfigError) as err:
        clustersim.load_scenario(d, base_dir=root)
    assert err.value.field == field and says in err.value.message and err.value.source == "<dict>"


def test_a_topology_file_s_own_error_is_not_blamed_on_a_change_beside_it(tmp_path):
    """A topology file that is broken alone names itself, whatever the scenario changes;
    a topology what-if that only a scenario's change breaks names the scenario's cluster."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpu: H100-SXM5-80GB\nnodes: 1\nnode: {gpus: 8, nics: 3}\nfabric: {kind: none}\n")
    d = scenario_dict(cluster={"topology": str(bad), "node": {"nic": {"bw_Gbps": 800}}},
                      parallel={"tp": 8, "pp": 1, "dp": 1}, training={"global_batch_size": 1})
    with pytest.raises(ConfigError) as got:
        clustersim.load_scenario(d, base_dir=tmp_path)
    assert got.value.source == str(bad) and "node.nics=3 does not divide node.gpus=8" in got.value.message
    cut = tmp_path / "cut.yaml"  # sound alone: 16 leaves (one node each) and 4 spines, one taken out
    cut.write_text("gpu: H100-SXM5-80GB\nnodes: 16\nnode: {gpus: 8}\nfabric: {kind: leaf_spine, nodes_per_leaf: 1, "
                   "spines: 4}\nwhat_if:\n  - {remove_switch: spine3}\n")
    d = scenario_dict(cluster={"topology": str(cut), "nodes": None, "fabric": {"spines": 2}},
                      parallel={"tp": 8, "pp": 1, "dp": 16},
                      training={"global_batch_size": 16})
    with pytest.raises(ConfigError) as got:
        clustersim.load_scenario(d, base_dir=tmp_path)
    assert got.value.source == "<dict>" and got.value.field == "cluster"
    assert "with cluster.fabric.spines=2" in got.value.message


def test_null_resets_a_topology_field_from_the_command_line(root):
    """--set cluster.fabric.spines=null sets the topology's field to null (its default), as
    null in the scenario file does, so a fabric's kind can change from the command line."""
    from clustersim.overrides import apply_changes, load_variant

    path = root / "scenarios/llama2_70b_64gpu.yaml"
    assert apply_changes({"cluster": {}}, [("cluster.fabric.spines", None)], source="s") == {
        "cluster": {"fabric": {"spines": None}}}
    assert apply_changes({"parallel": {"sp": True}}, [("parallel.sp", None)], source="s") == {"parallel": {}}
    sc = load_variant(path, [("cluster.fabric.kind", "fat_tree"), ("cluster.fabric.spines", None)])
    assert sc.topology.fabric.kind == "fat_tree" and sc.topology.fabric.spines is None
    with pytest.raises(ConfigError) as got:
        load_variant(path, [("cluster.fabric.kind", "fat_tree")])  # the file's 16 spines are leaf-spine's
    assert got.value.field == "cluster.fabric" and "fabric.spines is read by kind leaf_spine only" in got.value.message


def test_a_swapped_gpu_says_the_nvlink_rate_its_node_kept(root):
    """``cluster.gpu`` swaps the topology's GPUs, not its node: where the topology file sets
    an NVLink rate that is not the new GPU's own, the step runs at the topology's and the
    summary and the cluster line say so (compare's differences too: getting-started's example,
    tests/test_doc_examples.py) (B200s in a DGX H100 node:
    450 GB/s, not 900; here B200s in a DGX A100 node: 300); not where the scenario sets the
    rate too, nor without a swap."""

    def summary(**cluster) -> dict:
        d = scenario_dict(training={"global_batch_size": 16})
        d["cluster"].update(cluster)
        return clustersim.simulate(clustersim.load_scenario(d, base_dir=root)).summary

    b200 = summary(gpu="B200")
    assert b200["hardware"]["nvlink_kept"] == {"bw_GBps": 300, "gpu_bw_GBps": 900}
    line = next(x for x in format_summary(b200).splitlines() if x.startswith("cluster "))
    assert line.endswith("changed: gpu=B200 (NVLink kept at the topology's 300 GB/s, not B200's 900: "
                         "cluster.node.nvlink.bw_GBps=900 gives it)")
    own = summary(gpu="B200", node={"nvlink": {"bw_GBps": 900}})
    assert own["hardware"]["nvlink_kept"] is None and own["step_time_s"] < b200["step_time_s"]
    assert summary()["hardware"]["nvlink_kept"] is None
    assert summary(gpu="A100")["hardware"]["nvlink_kept"] is None  # (the topology's own GPU, by its alias)


@pytest.mark.parametrize("cluster, listed", [
    ({"gpu": "A100"}, None),  # the file's own GPU, by its alias
    ({"gpu": "A100-SXM4-80GB", "node": {"nic": {"bw_Gbps": 200.0}}}, None),  # the file's 200 Gb/s, as a float
    ({"gpu": "A100", "node": {"nic": {"bw_Gbps": 400}, "gpus": 8}}, {"node.nic.bw_Gbps": 400}),
    ({"gpu": "H100"}, {"gpu": "H100"}),
])
def test_only_what_differs_from_the_topology_file_is_listed_as_changed(root, cluster, listed):
    """``hardware.changes`` and the cluster line's "changed:" list a field the scenario sets to
    what its topology file already has (dgx-a100.yaml: A100-SXM4-80GB, 200 Gb/s NICs, 8 GPUs)
    as no change: the GPU by any of its names, a number as int or float."""
    d = scenario_dict(training={"global_batch_size": 16})
    d["cluster"].update(cluster)
    s = clustersim.simulate(clustersim.load_scenario(d, base_dir=root), brief=True).summary
    assert s["hardware"]["changes"] == listed
    line = next(x for x in format_summary(s).splitlines() if x.startswith("cluster "))
    assert ("changed:" in line) == (listed is not None)


def test_naming_the_topologys_own_gpu_keeps_no_nvlink_rate(root, tmp_path):
    """A custom topology may set an NVLink rate of its own (200 GB/s for A100s): a scenario
    whose ``cluster.gpu`` names that topology's GPU (by an alias too) swaps nothing, so no
    rate was kept in place of the GPU's own and nothing says one was; another GPU still does."""
    from clustersim.output.report import header_html

    topo = yaml.safe_load((root / "topologies" / "dgx-a100.yaml").read_text())
    topo["node"]["nvlink"]["bw_GBps"] = 200
    (tmp_path / "slow-nvlink.yaml").write_text(yaml.safe_dump(topo))

    def summary(gpu: str) -> dict:
        d = scenario_dict(training={"global_batch_size": 16})
        d["cluster"].update(topology="slow-nvlink.yaml", gpu=gpu)
        return clustersim.simulate(clustersim.load_scenario(d, base_dir=tmp_path)).summary

    for own in ("A100-SXM4-80GB", "A100"):
        s = summary(own)
        assert s["hardware"]["gpu"] == topo["gpu"] and s["hardware"]["nvlink_kept"] is None, own
        assert "NVLink kept" not in format_summary(s) + header_html(s)
    h100 = summary("H100")
    assert h100["hardware"]["nvlink_kept"] == {"bw_GBps": 200, "gpu_bw_GBps": 450}
    assert "NVLink kept at the topology's 200 GB/s" in format_summary(h100)


def test_links_slower_than_the_nics_are_named(root, tmp_path):
    """A link below the rate of the NIC that feeds it caps every transfer between nodes, and
    the summary, the cluster line, the report's header and compare's differences say so
    (``hardware.link_ceilings``): PCIe below a faster NIC (dgx-a100.yaml's 32 GB/s under 400
    Gb/s NICs at 0.9: 45 GB/s), and leaf-spine cables below a NIC's line rate where a leaf
    has fewer NIC ports than spines (one node a leaf, the file's 20 spines: 1/20 of a NIC
    each). The routes between nodes move at the rate named; the shipped topologies have no such
    link, nor does a leaf with as many ports as spines."""
    from clustersim.hardware.topology import link_ceilings, load_topology_cfg
    from clustersim.output.report import header_html
    from clustersim.output.summary import link_ceilings_said

    from .conftest import shipped_topologies

    for path in shipped_topologies(root):
        assert link_ceilings(load_topology_cfg(path, build=False)) is None, path.name

    def run(cluster: dict):
        d = scenario_dict(training={"global_batch_size": 16})
        d["cluster"].update(cluster)
        sc = clustersim.load_scenario(d, base_dir=root)
        return sc, clustersim.simulate(sc, brief=True).summary

    sc, s = run({"node": {"nic": {"bw_Gbps": 400}}})
    assert s["hardware"]["link_ceilings"] == [{"link": "pcie", "bw_GBps": 32, "nic_GBps": pytest.approx(45)}]
    assert sc.cluster.path_bw_Bps(sc.cluster.path(0, 8)) == 32e9  # (GPU 0 to GPU 8, on the other node)
    said = "PCIe at 32 GB/s caps the NICs' 45 GB/s between nodes; node.pcie_GBps raises it"
    assert link_ceilings_said(s["hardware"]) == [said]
    assert f"\n{'':<16}{said}\n" in format_summary(s) and said in html.unescape(header_html(s))
    assert run({"node": {"nic": {"bw_Gbps": 400}, "pcie_GBps": 64}})[1]["hardware"]["link_ceilings"] is None

    sc, s = run({"fabric": {"nodes_per_leaf": 1}})
    (c,) = s["hardware"]["link_ceilings"]
    cable = sc.cluster.graph.edges["leaf0.0", "spine0"]["bw_Bps"]
    assert c == {"link": "leaf_spine", "bw_GBps": pytest.approx(cable / 1e9), "nic_GBps": pytest.approx(22.5),
                 "nic_ports_per_leaf": 1, "spines": 20, "spines_at_line_rate": 1}
    assert cable == pytest.approx(25e9 / 20 * sc.topology.fabric.efficiency)
    assert "a leaf's 1 NIC port spread over 20 spines" in format_summary(s)
    assert run({"fabric": {"nodes_per_leaf": 1, "spines": 1}})[1]["hardware"]["link_ceilings"] is None
    # a leaf's one port at 2:1: no spine count keeps its cables at line rate, one spine included
    sc, s = run({"fabric": {"nodes_per_leaf": 1, "spines": 1, "oversubscription": 2}})
    (c,) = s["hardware"]["link_ceilings"]
    assert c["spines_at_line_rate"] == 0 and c["bw_GBps"] == pytest.approx(c["nic_GBps"] / 2)
    assert ("a leaf's 1 NIC port spread over 1 spine, each flow on one cable; no spine count keeps them at line "
            "rate: the oversubscription is above the leaf's 1 port") in format_summary(s)
    # the two nodes under one rail-optimised leaf group at 4:1: the cables are slow, but the
    # step's traffic stays on its rails, and the sentence says so (where a summary has its links)
    d = scenario_dict(training={"global_batch_size": 16})
    d["cluster"]["fabric"] = {"oversubscription": 4}
    s = clustersim.simulate(clustersim.load_scenario(d, base_dir=root)).summary
    assert s["hardware"]["link_ceilings"][0]["spines_at_line_rate"] == 5 and "fabric" not in s["links"]["by_kind"]
    assert "fabric.spines=5 keeps them at line rate; this step sends nothing over them" in format_summary(s)
    d["cluster"]["fabric"] = {"nodes_per_leaf": 1}  # (a leaf a node: the traffic between them crosses a spine)
    s = clustersim.simulate(clustersim.load_scenario(d, base_dir=root)).summary
    assert s["links"]["by_kind"]["fabric"]["bytes"] > 0 and s["hardware"]["link_ceilings"]
    assert "each flow on one cable; fabric.spines=1 keeps them at line rate\n" in format_summary(s)
    assert run({})[1]["hardware"]["link_ceilings"] is None

    # compare: said on the variant that has the link and the first plan does not
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({**scenario_dict(training={"global_batch_size": 16}),
                                                     "cluster": {"topology": str(root / "topologies/dgx-a100.yaml"),
                                                                 "nodes": 2}}))
    r = run_cli("compare", tmp_path / "s.yaml", "--variant", "cluster.node.nic.bw_Gbps=400", "--out",
                tmp_path / "cmp", "--no-report")
    assert r.returncode == 0, r.stderr
    vs = next(x for x in r.stdout.splitlines() if x.startswith("B vs A"))
    assert vs.endswith(f"200.0 -> 400.0 ({said})")


def test_the_network_line_echoes_the_links_as_read(root):
    """``hardware.network`` and the terminal's and report's "network" line give the figures the
    cluster was built with, in the topology file's units, so that a rate typed in the wrong
    unit shows; an NVLink rate above the GPU's own (an H100's 450 GB/s typed as 3600, its
    Gb/s) is said to be so. One node: NVLink alone; one GPU: nothing."""
    from clustersim.hardware.topology import load_topology_cfg, network_figures, plan_fabric
    from clustersim.output.report import header_html
    from clustersim.output.summary import network_said

    net = network_figures(load_topology_cfg(root / "topologies/dgx-h100.yaml", {"nodes": 4}, build=False))
    assert net == {"nvlink_GBps": 450, "nvlink_efficiency": 0.81, "nvls_efficiency": pytest.approx(0.608, abs=5e-4),
                   "nvlink_above_gpu_GBps": None, "nics_per_node": 8, "nic_Gbps": 400, "nic_efficiency": 0.9,
                   "pcie_GBps": 64, "fabric": {"kind": "leaf_spine", "tiers": 2, "rail_optimized": True,
                                               "leaves": 8, "spines": 16, "cores": 0, "oversubscription": 1.0,
                                               "oversubscription_unused": False,
                                               "pod_oversubscription": None, "efficiency": 0.9}}
    hw = {"gpu": "H100-SXM5-80GB", "network": net}
    assert network_said(hw) == ("NVLink 450 GB/s x 0.81 (NVLS 0.608) · 8 NICs of 400 Gb/s x 0.9, PCIe 64 GB/s · "
                                "rail-optimised leaf-spine, 8 leaves, 16 spines, 1:1, x 0.9")
    d = scenario_dict(training={"global_batch_size": 16})
    d["cluster"].update({"node": {"nvlink": {"bw_GBps": 3600}}})
    s = clustersim.simulate(clustersim.load_scenario(d, base_dir=root), brief=True).summary
    assert s["hardware"]["network"]["nvlink_above_gpu_GBps"] == 300  # (an A100 node)
    said = network_said(s["hardware"])
    assert said.startswith("NVLink 3600 GB/s x 0.77, above A100-SXM4-80GB's own 300 GB/s a direction "
                           "(node.nvlink.bw_GBps is in GB/s, not Gb/s) · 8 NICs of 200 Gb/s")
    assert f"\n{'network':<16}{said}\n" in format_summary(s) and f"network: {said}" in html.unescape(header_html(s))
    one = network_figures(load_topology_cfg(root / "topologies/single-h100.yaml", build=False))
    assert network_said({"gpu": "H100", "network": one}) == "" and one["nvlink_GBps"] is None
    node = network_figures(load_topology_cfg(root / "topologies/dgx-a100.yaml", {"nodes": 1}, build=False))
    assert network_said({"gpu": "A100", "network": node}) == "NVLink 300 GB/s x 0.77"
    # three tiers: the cores, and the oversubscription above the pods only where there are pods to join
    ft = load_topology_cfg(root / "topologies/fat-tree.yaml", build=False)
    plan = plan_fabric(ft)
    net = network_figures(ft)["fabric"]
    assert plan.pods > 1 and net["cores"] == plan.spines * plan.cores_per_plane > 0
    cores = network_said({"gpu": "H100", "network": network_figures(ft)})
    assert f"{net['cores']:,} cores" in cores
    one_pod = network_figures(load_topology_cfg(root / "topologies/fat-tree.yaml", {"nodes": 8}, build=False))
    assert one_pod["fabric"]["cores"] == 0 and one_pod["fabric"]["pod_oversubscription"] is None


def test_the_projection_says_the_pue_it_counts():
    """The energy is at the GPUs' board power times the PUE; the projection line says the PUE
    where it is not 1."""
    from clustersim.output.summary import _projection_line, wall_said

    pj = {"tokens": 1e12, "days": 1.0, "gpu_hours": 24.0, "cost_usd": None, "energy_MWh": 19.0, "pue": 1.0}
    assert _projection_line(pj)[0].endswith("19 MWh at GPU TDP")
    assert _projection_line({**pj, "energy_MWh": 22.8, "pue": 1.2})[0].endswith("23 MWh at GPU TDP x PUE 1.2")
    # (and a wall time below a tenth of a second has two decimals, not 0.0)
    assert [wall_said(x) for x in (0.04, 0.094, 0.096, 1.44, 0.0)] == ["0.04 s", "0.09 s", "0.1 s", "1.4 s", "0.00 s"]


def test_a_stages_row_is_its_busiest_gpu(root):
    """per_stage describes one GPU a stage, its busiest (least bubble): a straggler's stage
    reads the straggler, computing 1.3x its stage-mates, and the report's stage table names
    the GPU; without a what-if the stage's representative, the same GPU and figures rank by
    rank (ties within rounding go to the lowest-numbered), and the table has no GPU column."""
    from clustersim.output.report import stages_html

    def summary(what_if, collapse=None):
        d = scenario_dict(parallel={"tp": 4, "pp": 2, "dp": 2}, training={"global_batch_size": 16})
        d["cluster"]["what_if"] = what_if
        return clustersim.simulate(clustersim.load_scenario(d, base_dir=root), collapse=collapse, brief=True).summary

    slow = summary([{"gpu": 5, "slowdown": 1.3}])
    st0 = slow["per_stage"][0]
    assert st0["gpu"] == 5 and st0["ranks_simulated"] > 1
    base = summary([])
    assert st0["compute_s"] == pytest.approx(1.3 * base["per_stage"][0]["compute_s"], rel=1e-9)
    assert "<th>GPU</th>" in stages_html(slow) and "<td>5</td>" in stages_html(slow)
    every = summary([], collapse=False)
    for a, b in zip(base["per_stage"], every["per_stage"]):
        assert a["gpu"] == b["gpu"] and a["ranks_simulated"] == 1 < b["ranks_simulated"]
        assert a["bubble_s"] == pytest.approx(b["bubble_s"], rel=1e-9, abs=1e-12)
    assert "<th>GPU</th>" not in stages_html(base)


def test_parts_of_a_step_print_without_rounding_residue():
    """The terminal's parts of the step: three digits, thousands whole with separators (a
    1,000x straggler's imbalance), and a residue below a nanosecond's share of the step as 0."""
    from clustersim.output.summary import secs

    assert [secs(x, 8.0) for x in (0.178, 0.0, 3e-8, 12.345)] == ["0.178 s", "0 s", "3e-08 s", "12.3 s"]
    assert [secs(x, 5811.0) for x in (5.31e-15, 5710.4, 4.2e-6)] == ["0 s", "5,710 s", "0 s"]


def test_the_step_time_prints_four_digits_with_its_zeros():
    """The terminal's and the report card's step time: four significant digits, trailing zeros
    kept (4.300057 s beside compare's 4.300 s read "4.3 s"), whole seconds from 1,000 s on."""
    from clustersim.output.summary import step_text

    assert [step_text(x) for x in (4.300057, 98.15, 8.9721, 0.0123, 20.0)] == \
        ["4.300 s", "98.15 s", "8.972 s", "0.01230 s", "20.00 s"]
    assert [step_text(x) for x in (999.94, 999.96, 5811.2)] == ["999.9 s", "1,000 s", "5,811 s"]


def test_a_pipeline_with_fewer_microbatches_than_stages_says_it_never_fills():
    """PP4 with 2 microbatches (1F1B's closed form idles (p - 1) / (m + p - 1) = 3/5 of the
    forwards' and backwards' time): the terminal says so under its bubble line, with what gives
    more, and the report's bubble card says so; 4 microbatches on 4 stages say nothing."""
    import clustersim
    from clustersim.output.report import cards_html
    from clustersim.output.summary import format_summary

    from .conftest import scenario_dict

    def summary(batch: int, micro: int = 1) -> dict:
        d = scenario_dict(parallel={"tp": 2, "pp": 4, "dp": 2}, training={"global_batch_size": batch,
                                                                            "micro_batch_size": micro})
        return clustersim.simulate(clustersim.load_scenario(d)).summary

    said = "fewer microbatches (2) than stages (4): the pipeline never fills"
    few = summary(4)
    lines = format_summary(few).splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("bubble"))
    assert lines[at + 1] == f"{'':<16}{said}; a larger training.global_batch_size gives more"
    assert few["bubble_fraction"] > 0.5 and said.replace(": ", ":<br>") in cards_html(few)
    assert "or a smaller micro_batch_size gives more" in format_summary(summary(8, micro=2))
    filled = summary(8)
    assert filled["plan"]["microbatches"] == 4 and "never fills" not in format_summary(filled) + cards_html(filled)


def test_without_a_pipeline_the_bubble_line_says_what_idles():
    """No pipeline fills or drains: a GPU idles waiting on others (here a 1.5x slower one at
    the gradients' all-reduce), which the terminal's bubble line says, as the report's card does."""
    import clustersim
    from clustersim.output.summary import format_summary

    from .conftest import ROOT, scenario_dict

    d = scenario_dict(parallel={"tp": 4, "pp": 1, "dp": 4}, cluster={"what_if": [{"gpu": 5, "slowdown": 1.5}]})
    s = clustersim.simulate(clustersim.load_scenario(d, base_dir=ROOT)).summary
    line = next(x for x in format_summary(s).splitlines() if x.startswith("bubble"))
    assert s["bubble"]["bubble_s"] > 0 and " % of the step (no pipeline: idle, waiting on other GPUs): warm-up" in line
    d = scenario_dict(cluster={"what_if": [{"gpu": 5, "slowdown": 1.5}]})  # (PP2: its bubble is the pipeline's)
    s = clustersim.simulate(clustersim.load_scenario(d, base_dir=ROOT)).summary
    assert "no pipeline" not in format_summary(s)
