"""Topology graph: structure, bandwidths, routes."""

from __future__ import annotations

import inspect

import pytest
import yaml

from clustersim.errors import ConfigError
from clustersim.hardware import GPUS, build_cluster, load_topology_cfg, lookup_gpu
from clustersim.hardware.topology import TopologyCfg, plan_fabric

from .conftest import shipped_topologies


@pytest.fixture
def a100(root):
    return build_cluster(load_topology_cfg(root / "topologies/dgx-a100.yaml", {"nodes": 64}))


def test_catalogue_has_the_required_gpus():
    for name in ("A100-SXM4-40GB", "A100-SXM4-80GB", "H100-SXM5-80GB", "H800-SXM-80GB", "H200-SXM-141GB", "B200"):
        g = GPUS[name]
        assert g.bf16_flops > 0 and g.hbm_bw_Bps > 0 and g.hbm_capacity_bytes > 0 and g.nvlink_bw_Bps > 0
        assert 0 < g.matmul_efficiency <= 1 and 0 < g.memory_efficiency <= 1
    assert lookup_gpu("H100").bf16_flops == 989e12 and lookup_gpu("H100").fp8_flops == 1979e12
    assert lookup_gpu("H800").nvlink_bw_Bps == 200e9
    with pytest.raises(KeyError, match="unknown GPU"):
        lookup_gpu("V100")


def test_graph_structure(a100):
    g = a100.graph
    kinds = {}
    for _, k in g.nodes(data="kind"):
        kinds[k] = kinds.get(k, 0) + 1
    # 64 nodes x 8 GPUs, 8 NICs, 1 NVSwitch; 20 nodes per leaf group -> 4 groups x 8 rails; 20 spines
    assert kinds == {"gpu": 512, "nic": 512, "nvswitch": 64, "leaf": 32, "spine": 20}
    assert a100.num_gpus == 512
    # every cable is two directed edges with the same bandwidth
    for u, v, d in g.edges(data=True):
        assert g.edges[v, u]["line_bw_Bps"] == d["line_bw_Bps"]
    e = g.edges["n0.gpu0", "n0.nvsw"]
    assert e["line_bw_Bps"] == 300e9 and e["bw_Bps"] == pytest.approx(300e9 * 0.77)
    assert g.edges["n0.nic0", "leaf0.0"]["line_bw_Bps"] == 25e9  # HDR 200 Gb/s


def test_link_columns_are_each_links_attributes(root):
    """Bandwidth, latency and kind per link in ``edges`` order: read in one pass over the
    graph, or link by link where ``edges`` lists the links in another order."""
    for listed in ("built", "reversed"):
        c = build_cluster(load_topology_cfg(root / "topologies/dgx-a100.yaml", {"nodes": 8}))
        if listed == "reversed":
            c.edges = c.edges[::-1]
        g = c.graph
        assert c.edge_bw_Bps == [g.edges[e]["bw_Bps"] for e in c.edges], listed
        assert c.edge_latency_s == [g.edges[e]["latency_s"] for e in c.edges], listed
        assert c.edge_kind == [g.edges[e].get("kind", "") for e in c.edges], listed
        assert {"nvlink", "pcie", "nic", "fabric"} <= set(c.edge_kind)


def test_rail_optimised_leaves(a100):
    g = a100.graph
    assert g.nodes["n3.nic5"]["leaf"] == "leaf0.5"
    assert g.nodes["n21.nic5"]["leaf"] == "leaf1.5"
    # non-blocking: a leaf's uplinks carry what its downlinks do
    down = sum(d["line_bw_Bps"] for u, v, d in g.in_edges("leaf0.0", data=True) if g.nodes[u]["kind"] == "nic")
    up = sum(d["line_bw_Bps"] for u, v, d in g.out_edges("leaf0.0", data=True) if g.nodes[v]["kind"] == "spine")
    assert up == pytest.approx(down)


def test_routes(a100):
    names = lambda p: [a100.edges[e] for e in p]  # noqa: E731
    assert names(a100.path(0, 3)) == [("n0.gpu0", "n0.nvsw"), ("n0.nvsw", "n0.gpu3")]
    same_leaf = names(a100.path(0, 8))  # n0.gpu0 -> n1.gpu0, same rail leaf
    assert same_leaf == [("n0.gpu0", "n0.nic0"), ("n0.nic0", "leaf0.0"), ("leaf0.0", "n1.nic0"), ("n1.nic0", "n1.gpu0")]
    far = names(a100.path(0, 8 * 25))  # node 25 is in the second leaf group: up to a spine and down
    assert len(far) == 6 and far[2][1].startswith("spine") and far[3][1] == "leaf1.0"
    assert a100.path(0, 200) == a100.path(0, 200)
    # static ECMP spreads different pairs over different spines
    spines = {names(a100.path(src, 8 * 25 + src % 8))[2][1] for src in range(0, 160, 8)}
    assert len(spines) > 1
    assert a100.path_latency_s(a100.path(0, 3)) == pytest.approx(3e-6)


@pytest.mark.parametrize("nics, nodes", [(8, 4), (4, 4), (8, 1)])
def test_each_gpus_own_links_as_edge_ids_are_its_named_ones(nics, nodes):
    """The link use reads every GPU's own links by edge id (Cluster.owned_edges,
    own_nic_edges: its lane to a NIC of its own and that NIC's cable to the leaf, both ways),
    the summary by name (owned_links, own_nic_links): the same links, those of the graph's
    GPU and NIC. A NIC shared by GPUs, or one without a leaf (one node), has no such row (-1)."""
    c = build_cluster(TopologyCfg.model_validate({"gpu": "H100", "nodes": nodes, "node": {"gpus": 8, "nics": nics}}))
    name = "{}->{}".format
    assert [[name(*c.edges[e]) for e in row] for row in c.owned_edges.tolist()] == [list(x) for x in c.owned_links]
    codes, kinds = c.edge_kind_codes
    assert [kinds[k] for k in codes.tolist()] == c.edge_kind
    rows = c.own_nic_edges.tolist()
    assert len(rows) == c.num_gpus
    g = c.graph
    for gpu, row, hit in zip(c.gpu_names, rows, c.own_nic_links):
        nic = g.nodes[gpu]["nic"]
        leaf = g.nodes[nic]["leaf"]
        own = nics == 8 and leaf is not None
        assert (hit is not None) == own and (row == [-1] * 4) == (not own)
        if own:
            assert [name(*c.edges[e]) for e in row] == [hit[0], hit[1], hit[3], hit[4]] == [
                f"{gpu}->{nic}", f"{nic}->{gpu}", f"{nic}->{leaf}", f"{leaf}->{nic}"]
            assert hit[2] == g.edges[gpu, nic]["bw_Bps"]
    assert any(hit is not None for hit in c.own_nic_links) == (nics == 8 and nodes > 1)


def test_links_order_by_their_names_as_by_their_pairs_of_ends(root):
    """The link use picks links tied on their use by their pair of ends, the summary by their
    names "u->v" (analysis.links.first_by_use): the same order, as no GPU's or switch's name
    holds a character below "-" (a prefix's "->" then sorts first, as a shorter name does)."""
    for path, nodes in (("dgx-h100.yaml", 40), ("gb200-nvl72.yaml", 2), ("roce-clos-llama3.yaml", 24)):
        c = build_cluster(load_topology_cfg(root / "topologies" / path, {"nodes": nodes}))
        assert all(ch > "-" for u in c.graph.nodes for ch in u), path
        assert sorted(c.edges) == sorted(c.edges, key=lambda e: f"{e[0]}->{e[1]}"), path


def test_non_rail_fabric_and_shared_nic():
    cfg = TopologyCfg.model_validate({"gpu": "H100", "nodes": 4, "node": {"gpus": 8, "nics": 4},
                                      "fabric": {"rail_optimized": False, "nodes_per_leaf": 2, "spines": 2}})
    c = build_cluster(cfg)
    g = c.graph
    assert g.nodes["n0.gpu0"]["nic"] == g.nodes["n0.gpu1"]["nic"] == "n0.nic0"
    assert {g.nodes[f"n1.nic{k}"]["leaf"] for k in range(4)} == {"leaf0.0"}
    assert len(c.path(0, 8 * 3)) == 6


def test_nics_must_divide_gpus():
    with pytest.raises(ValueError, match="node.nics=3 does not divide node.gpus=8"):
        TopologyCfg.model_validate({"gpu": "H100", "node": {"gpus": 8, "nics": 3}})


def test_every_topology_file_builds(root):
    for path in shipped_topologies(root):
        c = build_cluster(load_topology_cfg(path))
        assert c.num_gpus == c.cfg.nodes * c.cfg.node.gpus


# --- rails, fat trees, the Llama 3 Clos, fault what-ifs -----------------------------------------


def _cluster(fabric: dict, nodes: int, node: dict | None = None, what_if=None, gpu: str = "H100"):
    cfg = {"gpu": gpu, "nodes": nodes, "node": node or {"gpus": 8}, "fabric": fabric}
    if what_if is not None:
        cfg["what_if"] = what_if
    return build_cluster(TopologyCfg.model_validate(cfg))


@pytest.mark.parametrize("nics, what_if, nic_GBps", [
    (1, None, 64.0),  # eight GPUs share the NIC: its one PCIe x16 caps its 90 GB/s
    (8, None, 90.0),  # a NIC a GPU: each GPU's own 64 GB/s edge caps its flows, not the NIC's cable
    (1, 0.5, 45.0),   # the cable at half its rate, below the PCIe link
    (1, 0.8, 64.0),   # 72 GB/s, still above it
    (8, 0.5, 45.0),   # a NIC a GPU: its cable at 45 GB/s, below its GPU's own PCIe edge
])
def test_a_shared_nic_is_capped_by_its_one_pcie_link(nics, what_if, nic_GBps):
    """A NIC that several GPUs share has one PCIe link to the host, below an 800 Gb/s NIC's
    90 GB/s at gen5's 64 GB/s; link_ceilings names it, and the transfers see it."""
    node = {"gpus": 8, "nics": nics, "nic": {"bw_Gbps": 800, "efficiency": 0.9}, "pcie_GBps": 64}
    fabric = {"kind": "leaf_spine", "nodes_per_leaf": 2, "spines": 1}
    wi = None if what_if is None else [{"link": "n0.nic0-leaf0.0", "bw_factor": what_if}]
    c = _cluster(fabric, 2, node, wi)
    for u, v in (("n0.nic0", "leaf0.0"), ("leaf0.0", "n0.nic0")):
        assert c.graph.edges[u, v]["bw_Bps"] == pytest.approx(nic_GBps * 1e9)
    assert c.path_bw_Bps(c.path(0, 8)) == pytest.approx(min(nic_GBps, 64.0) * 1e9)
    # a cable its PCIe cap still holds changes nothing: no fault, its twins stay twins
    assert bool(c.fault_cables) == (what_if is not None and (nics > 1 or nic_GBps < 64.0))
    from clustersim.hardware.topology import link_ceilings
    assert [x["link"] for x in link_ceilings(c.cfg)] == ["pcie"]


def _count(c, what="kind"):
    out = {}
    for _, k in c.graph.nodes(data=what):
        out[k] = out.get(k, 0) + 1
    return out


def _cables(c):
    """Cables (each once) by edge kind, e.g. {"nic": 24, "fabric": 32}."""
    out = {}
    for u, v, k in c.graph.edges(data="kind"):
        if u < v:
            out[k] = out.get(k, 0) + 1
    return out


def _hops(c, path):
    return [c.edges[e] for e in path]


def test_nics_carry_their_rail(a100):
    g = a100.graph
    assert g.nodes["n3.nic5"]["rail"] == 5 and g.nodes["n21.nic0"]["rail"] == 0
    flat = _cluster({"rail_optimized": False, "nodes_per_leaf": 2, "spines": 2}, 4, {"gpus": 8, "nics": 4})
    assert {flat.graph.nodes[f"n{i}.nic{k}"]["rail"] for i in range(4) for k in range(4)} == {None}
    assert flat.pxn_proxy(2, 8 + 5) is None
    one = _cluster({"kind": "none"}, 1)
    assert one.graph.nodes["n0.nic3"]["rail"] is None


def test_pxn_works_on_a_rail_optimised_fat_tree(root):
    h800 = build_cluster(load_topology_cfg(root / "topologies/h800-cluster.yaml", {"nodes": 4}))
    assert h800.cfg.fabric.kind == "fat_tree"
    assert h800.pxn_proxy(2, 8 + 5) == 5  # n0.gpu2 -> n1.gpu5 goes through n0.gpu5 on rail 5
    assert h800.pxn_proxy(5, 8 + 5) is None
    hops = _hops(h800, h800.pxn_path(2, 8 + 5))
    assert hops[0] == ("n0.gpu2", "n0.nvsw") and ("n0.nic5", "leaf0.5") in hops


def test_two_tier_fat_tree_counts_from_the_radix():
    # radix 8 at 1:1: 4 ports down, 4 up -> 4 nodes per rail leaf, 4 spines;
    # 6 nodes -> 2 groups x 4 rails = 8 leaves, each cabled to every spine
    c = _cluster({"kind": "fat_tree", "radix": 8}, 6, {"gpus": 4})
    assert _count(c) == {"nvswitch": 6, "nic": 24, "gpu": 24, "leaf": 8, "spine": 4}
    assert _cables(c) == {"nvlink": 24, "pcie": 24, "nic": 24, "fabric": 8 * 4}
    assert c.graph.nodes["n5.nic3"]["leaf"] == "leaf1.3"
    assert c.graph.edges["leaf0.0", "spine3"]["line_bw_Bps"] == 25e9  # 4 x 200 Gb/s over 4 uplinks
    # 9 nodes would need 3 groups x 4 rails = 12 leaves: more than a radix-8 spine has ports
    with pytest.raises(ConfigError, match="12 leaves") as err:
        _cluster({"kind": "fat_tree", "radix": 8}, 9, {"gpus": 4})
    assert err.value.field == "fabric.tiers"


def test_three_tier_fat_tree_is_the_k4_fat_tree_of_al_fares():
    # k = 4: 2 hosts per edge switch, 2 edge + 2 aggregation switches per pod, 4 pods, 4 cores
    c = _cluster({"kind": "fat_tree", "radix": 4, "tiers": 3, "rail_optimized": False}, 16, {"gpus": 1})
    assert _count(c) == {"nic": 16, "gpu": 16, "leaf": 8, "spine": 8, "core": 4}
    assert _cables(c) == {"pcie": 16, "nic": 16, "fabric": 8 * 2 + 8 * 2}
    g = c.graph
    for core in ("core0.0", "core0.1", "core1.0", "core1.1"):
        # core j.c joins spine j of each of the 4 pods
        j = core[4]
        assert sorted(g.successors(core)) == [f"pod{p}.spine{j}" for p in range(4)]
    assert sorted(g.successors("pod1.spine0")) == ["core0.0", "core0.1", "leaf2.0", "leaf3.0"]
    p = plan_fabric(c.cfg)
    assert (p.nodes_per_leaf, p.spines, p.leaves_per_pod, p.pods, p.cores_per_plane) == (2, 2, 2, 4, 2)
    # a fifth pod would need a fifth port on every core
    with pytest.raises(ConfigError, match="5 pods") as err:
        _cluster({"kind": "fat_tree", "radix": 4, "tiers": 3, "rail_optimized": False}, 20, {"gpus": 1})
    assert err.value.field == "nodes"


@pytest.mark.parametrize("o, up_ports, down_ports", [(1, 8, 8), (3, 4, 12), (4, 3, 12), (2.5, 4, 10)])
def test_leaf_uplinks_reflect_oversubscription(o, up_ports, down_ports):
    # radix 16: u1 = floor(16 / (1 + o)) ports up, d1 = floor(o u1) down; one-GPU nodes, 200 Gb/s
    c = _cluster({"kind": "fat_tree", "radix": 16, "rail_optimized": False, "oversubscription": o},
                 2 * down_ports, {"gpus": 1})
    g = c.graph
    down = [d["line_bw_Bps"] for u, _, d in g.in_edges("leaf0.0", data=True) if g.nodes[u]["kind"] == "nic"]
    up = [d["line_bw_Bps"] for _, v, d in g.out_edges("leaf0.0", data=True) if g.nodes[v]["kind"] == "spine"]
    assert len(down) == down_ports and len(up) == up_ports
    assert sum(down) / sum(up) == pytest.approx(o)
    assert up[0] == pytest.approx(down_ports * 25e9 / (o * up_ports))  # = 25e9 when o divides d1


def test_llama3_clos_shape_and_pod_oversubscription(root):
    c = build_cluster(load_topology_cfg(root / "topologies/roce-clos-llama3.yaml"))
    assert c.num_gpus == 6144 and c.gpu.name == "H100-SXM5-80GB"
    # 768 nodes / 2 per rack = 384 ToRs; 192 per pod -> 2 pods x 16 cluster switches; 16 x 28 aggregation
    assert _count(c) == {"nvswitch": 768, "nic": 6144, "gpu": 6144, "leaf": 384, "spine": 32, "core": 448}
    g = c.graph
    assert {g.nodes[f"n{i}.nic{k}"]["leaf"] for i in (0, 1) for k in range(8)} == {"leaf0.0"}  # 16 GPUs per rack
    assert g.nodes["n2.nic0"]["leaf"] == "leaf1.0"
    tor_down = sum(d["line_bw_Bps"] for u, _, d in g.in_edges("leaf0.0", data=True) if g.nodes[u]["kind"] == "nic")
    tor_up = sum(d["line_bw_Bps"] for _, v, d in g.out_edges("leaf0.0", data=True) if g.nodes[v]["kind"] == "spine")
    assert tor_down == tor_up == 16 * 50e9  # full bisection inside the pod
    spine = g.out_edges("pod0.spine3", data=True)
    spine_down = sum(d["line_bw_Bps"] for _, v, d in spine if g.nodes[v]["kind"] == "leaf")
    spine_up = [d["line_bw_Bps"] for _, v, d in spine if g.nodes[v]["kind"] == "core"]
    assert spine_down == 192 * 50e9 and len(spine_up) == 28
    assert spine_down / sum(spine_up) == pytest.approx(7)  # 1:7 above the pod


def test_cross_pod_path_crosses_the_aggregation_layer_and_in_pod_path_does_not(root):
    c = build_cluster(load_topology_cfg(root / "topologies/roce-clos-llama3.yaml"))
    same_rack = _hops(c, c.path(0, 8))  # n0 -> n1, one ToR
    assert [v for _, v in same_rack] == ["n0.nic0", "leaf0.0", "n1.nic0", "n1.gpu0"]
    in_pod = _hops(c, c.path(0, 8 * 380))  # rack 190, pod 0
    assert len(in_pod) == 6 and in_pod[2][1].startswith("pod0.spine")
    assert not any(v.startswith("core") for _, v in in_pod)
    cross = _hops(c, c.path(0, 8 * 384))  # node 384: first rack of pod 1
    tiers = [v.split(".")[0].rstrip("0123456789") for _, v in cross]
    assert tiers == ["n", "leaf", "pod", "core", "pod", "leaf", "n", "n"]
    spine_a, core, spine_b = cross[2][1], cross[3][1], cross[4][1]
    j = spine_a.split("spine")[1]
    assert spine_a == f"pod0.spine{j}" and spine_b == f"pod1.spine{j}" and core.startswith(f"core{j}.")
    assert c.path_latency_s(c.path(0, 8 * 380)) == pytest.approx(2 * 1e-6 + 2 * 0.6e-6)
    assert c.path_latency_s(c.path(0, 8 * 384)) == pytest.approx(2 * 1e-6 + 4 * 0.6e-6)
    # ECMP spreads cross-pod pairs over planes and cores
    tops = {_hops(c, c.path(8 * i, 8 * (384 + i)))[3][1] for i in range(0, 64, 2)}
    assert len(tops) > 8


def test_a_removed_spine_link_reroutes_through_another_spine(root):
    def cluster(what_if=None):
        overrides = {"nodes": 64} if what_if is None else {"nodes": 64, "what_if": what_if}
        return build_cluster(load_topology_cfg(root / "topologies/dgx-a100.yaml", overrides))

    intact = cluster()
    before = _hops(intact, intact.path(0, 8 * 25))
    spine = before[2][1]
    assert spine.startswith("spine") and before[2][0] == "leaf0.0"
    cut = cluster([{"remove_link": f"leaf0.0-{spine}"}])
    after = _hops(cut, cut.path(0, 8 * 25))
    assert len(after) == len(before) == 6
    assert after[2][0] == "leaf0.0" and after[2][1].startswith("spine") and after[2][1] != spine
    assert not cut.graph.has_edge("leaf0.0", spine) and not cut.graph.has_edge(spine, "leaf0.0")
    assert len(cut.edges) == len(intact.edges) - 2
    # the other leaves keep that spine
    assert cut.graph.has_edge("leaf1.0", spine)


def test_a_removed_core_link_reroutes_across_pods(root):
    llama = root / "topologies/roce-clos-llama3.yaml"
    intact = build_cluster(load_topology_cfg(llama, {"nodes": 400}))  # pod 1 holds nodes 384-399
    before = _hops(intact, intact.path(0, 8 * 384))
    spine, core = before[3]
    cut = build_cluster(load_topology_cfg(llama, {"nodes": 400, "what_if": [{"remove_link": f"{core}-{spine}"}]}))
    after = _hops(cut, cut.path(0, 8 * 384))
    assert len(after) == 8 and (spine, core) not in after
    assert after[3][0].startswith("pod0.spine") and after[4][0].startswith("core")


def test_removing_every_uplink_of_a_leaf_is_a_clear_partition_error(root, tmp_path):
    import yaml

    topo = yaml.safe_load((root / "topologies/dgx-a100.yaml").read_text())
    topo["nodes"] = 64
    topo["what_if"] = [{"remove_link": f"leaf0.0-spine{s}"} for s in range(19)]
    path = tmp_path / "cut.yaml"
    path.write_text(yaml.safe_dump(topo))
    c = build_cluster(load_topology_cfg(path))  # 19 of 20 uplinks gone: every route goes via spine19
    assert {_hops(c, c.path(0, 8 * 25))[2][1]} == {"spine19"}
    topo["what_if"].append({"remove_link": "spine19-leaf0.0"})
    path.write_text(yaml.safe_dump(topo))
    with pytest.raises(ConfigError) as err:
        load_topology_cfg(path)
    assert err.value.field == "what_if[19]" and err.value.source == str(path)
    # leaf0.0 serves NIC 0 of nodes 0-19: GPUs 0, 8, ..., 152
    assert "cuts GPUs 0, 8, ..., 152 (20 GPUs) off from the other 492 GPUs" in err.value.message
    assert str(err.value).startswith(f"{path}: what_if[19]: removing cable spine19-leaf0.0")


def test_removing_a_leaf_cuts_off_its_gpus():
    fabric = {"kind": "fat_tree", "radix": 8, "rail_optimized": False}
    with pytest.raises(ConfigError, match=r"switch leaf1\.0 cuts GPUs 32-63 off from the other 32 GPUs") as err:
        _cluster(fabric, 8, {"gpus": 8, "nics": 1}, what_if=[{"remove_switch": "spine0"}, {"remove_switch": "leaf1.0"}])
    assert err.value.field == "what_if[1]"


def test_cutting_one_gpu_off_says_gpu():
    """One GPU cut off is "GPU 8", not "GPUs 8" (a rail-optimised leaf per node, one spine:
    removing leaf1.0's uplink cuts off node 1's GPU 8 alone)."""
    fabric = {"kind": "leaf_spine", "rail_optimized": True, "nodes_per_leaf": 1, "spines": 1}
    with pytest.raises(ConfigError, match=r"cuts GPU 8 off from the other 15 GPUs;"):
        _cluster(fabric, 2, {"gpus": 8, "nics": 8}, what_if=[{"remove_link": "leaf1.0-spine0"}])


def test_degraded_link_shows_on_both_directions(a100):
    c = build_cluster(TopologyCfg.model_validate({**a100.cfg.model_dump(), "what_if": [
        {"link": "n0.nic0-leaf0.0", "bw_factor": 0.5}, {"link": "spine3-leaf0.0", "bw_factor": 0.25}]}))
    g = c.graph
    for u, v in (("n0.nic0", "leaf0.0"), ("leaf0.0", "n0.nic0")):
        assert g.edges[u, v]["line_bw_Bps"] == 12.5e9
        assert c.edge_bw_Bps[c.edge_index[(u, v)]] == pytest.approx(12.5e9 * 0.9)
    for u, v in (("leaf0.0", "spine3"), ("spine3", "leaf0.0")):
        assert g.edges[u, v]["line_bw_Bps"] == pytest.approx(a100.graph.edges[u, v]["line_bw_Bps"] / 4)
    assert g.edges["n1.nic0", "leaf0.0"]["line_bw_Bps"] == 25e9  # the neighbour is untouched
    assert c.path_bw_Bps(c.path(0, 8)) == pytest.approx(12.5e9 * 0.9)


def test_a_link_as_the_outputs_name_it_is_its_cable(a100):
    """The terminal and the report name a link by its direction, ``n0.nic0->leaf0.0``; copied
    into a what-if it names the cable, degraded both ways as ``n0.nic0-leaf0.0`` is."""
    cfg = a100.cfg.model_dump()
    arrow, dash = (build_cluster(TopologyCfg.model_validate({**cfg, "what_if": [{"link": name, "bw_factor": 0.5}]}))
                   for name in ("n0.nic0->leaf0.0", "n0.nic0-leaf0.0"))
    for u, v in (("n0.nic0", "leaf0.0"), ("leaf0.0", "n0.nic0")):
        assert arrow.graph.edges[u, v]["line_bw_Bps"] == dash.graph.edges[u, v]["line_bw_Bps"] == 12.5e9
    assert arrow.fault_cables == dash.fault_cables


def test_gpu_slowdown_is_validated_and_stored():
    c = _cluster({"kind": "none"}, 1, what_if=[{"gpu": 5, "slowdown": 1.3}, {"gpu": 2, "slowdown": 2.0},
                                               {"gpu": 5, "slowdown": 2.0}])
    assert c.gpu_slowdown == {5: pytest.approx(2.6), 2: 2.0}
    assert _cluster({"kind": "none"}, 1).gpu_slowdown == {}
    with pytest.raises(ConfigError, match="GPU 8 does not exist") as err:
        _cluster({"kind": "none"}, 1, what_if=[{"gpu": 8, "slowdown": 1.5}])
    assert err.value.field == "what_if[0]"


@pytest.mark.parametrize("entry, message", [
    ({"remove_switch": "spine99"}, "no switch named 'spine99'"),
    ({"remove_link": "leaf0.0-spine99"}, "no vertex named 'spine99'"),
    # a misspelt vertex inside a node: the message names node 0's, as the graph spells them
    ({"link": "n0.gpu0-n0.nvswitch", "bw_factor": 0.5},
     r"no vertex named 'n0.nvswitch' in this topology \(node 0's: n0.gpu0 \.\.\. n0.gpu7; n0.nvsw; "
     r"n0.nic0 \.\.\. n0.nic7; switches: "),
    ({"link": "leaf0.0-leaf0.1", "bw_factor": 0.5}, "leaf0.0 and leaf0.1 are not joined by a cable"),
    ({"link": "leaf0.0", "bw_factor": 0.5}, "is not a cable"),
    ({"remove_link": "n0.gpu0-n0.nvsw"}, "is an NVLink cable"),
    ({"remove_switch": "n0.nvsw"}, "is an NVSwitch, not a fabric switch"),
    ({"remove_switch": "n0.nic0"}, "is a nic, not a fabric switch"),
])
def test_what_if_names_are_checked(a100, entry, message):
    cfg = TopologyCfg.model_validate({**a100.cfg.model_dump(), "what_if": [{"gpu": 0, "slowdown": 1.0}, entry]})
    with pytest.raises(ConfigError, match=message) as err:
        build_cluster(cfg)
    assert err.value.field == "what_if[1]"


@pytest.mark.parametrize("entry, message", [
    ({"link": "n0.nic0-leaf0.0"}, r"one of \{link, bw_factor\}.*got \{link\}"),
    ({"remove_link": "a-b", "remove_switch": "c"}, "a what_if entry is one of"),
    ({"gpu": 1, "slowdown": 0.5}, "greater than or equal to 1"),
    ({"link": "a-b", "bw_factor": 0}, "greater than or equal to 0.000001"),
    ({"remove_spine": "spine0"}, "unknown key"),
])
def test_what_if_entry_shapes_are_checked_on_load(root, tmp_path, entry, message):
    import yaml

    topo = yaml.safe_load((root / "topologies/dgx-h100.yaml").read_text())
    topo["what_if"] = [{"gpu": 0, "slowdown": 1.1}, entry]
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(topo))
    with pytest.raises(ConfigError, match=message) as err:
        load_topology_cfg(tmp_path / "t.yaml")
    assert err.value.field.startswith("what_if[1]")


@pytest.mark.parametrize("fabric, field_, message", [
    ({"kind": "leaf_spine", "radix": 32}, None, "fabric.radix is read by kind fat_tree only"),
    ({"kind": "fat_tree", "spines": 4}, None, "fabric.spines is read by kind leaf_spine only"),
    # at the fat tree's defaults too: a leaf_spine given radix 64 reads as bounded by it
    ({"kind": "leaf_spine", "radix": 64}, None, "fabric.radix is read by kind fat_tree only"),
    ({"kind": "leaf_spine", "tiers": 2}, None, "fabric.tiers is read by kind fat_tree only"),
    ({"kind": "fat_tree", "pod_oversubscription": 1.0}, None, "read by a 3-tier fat tree only"),
    ({"kind": "fat_tree", "leaves_per_pod": 4}, None, "read by a 3-tier fat tree only"),
    ({"kind": "fat_tree", "radix": 8, "nodes_per_leaf": 5}, "fabric.nodes_per_leaf", "more than the radix 8"),
    ({"kind": "fat_tree", "radix": 4, "rail_optimized": False}, "fabric.radix", "fewer than the 8 NICs"),
    ({"kind": "fat_tree", "radix": 64, "tiers": 3, "leaves_per_pod": 12}, "fabric.leaves_per_pod",
     "not a whole number of groups of 8"),
])
def test_fabric_fields_are_checked(fabric, field_, message):
    with pytest.raises((ConfigError, ValueError), match=message) as err:
        _cluster(fabric, 4)
    if field_:
        assert err.value.field == field_


def test_a_fat_tree_fills_in_its_defaults_and_a_dumped_fabric_reloads():
    """radix, tiers and (3 tiers) pod_oversubscription are null where not given, a fat tree
    taking 64, 2 and 1; every fabric's dump, with each field written, validates again."""
    from clustersim.hardware.topology import FabricCfg

    ls, ft, ft3 = (FabricCfg(**f) for f in ({}, {"kind": "fat_tree"}, {"kind": "fat_tree", "tiers": 3}))
    assert (ls.radix, ls.tiers, ls.pod_oversubscription) == (None, None, None)
    assert (ft.radix, ft.tiers, ft.pod_oversubscription) == (64, 2, None)
    assert (ft3.radix, ft3.tiers, ft3.pod_oversubscription) == (64, 3, 1.0)
    for f in (ls, ft, ft3):
        assert FabricCfg(**f.model_dump()) == f


def _ring_time_s(cluster, group, size_bytes):
    """Duration of one ring all-reduce of ``size_bytes`` over ``group`` on an idle cluster."""
    from clustersim.engine import run_program
    from clustersim.program.tasks import Comm, Program

    n = len(group)
    prog = Program(ranks=[group[0]], weight={group[0]: n})
    prog.add(rank=group[0], stream="dp", name="AR", kind="dp",
             comm=Comm("all_reduce", size_bytes, tuple(group), (), (group[0],), ("dp", (0,), 0)))
    # hold the engine to the ring (it may choose another algorithm where it can)
    kw = {"algorithms": {"all_reduce": "ring"}} if "algorithms" in inspect.signature(run_program).parameters else {}
    (span,) = run_program(prog, cluster, **kw).spans
    return span.dur_s


def _oversubscribed(o):
    """8 nodes of 8 GPUs sharing one 400 Gb/s NIC (its PCIe gen5 above it); radix 8 fat tree: 4 nodes per leaf, 2 leaves;
    1:1 gives 4 spines, 4:1 one spine (u1 = floor(8 / 5) = 1), each uplink at the NIC rate."""
    return _cluster({"kind": "fat_tree", "radix": 8, "rail_optimized": False, "oversubscription": o,
                     "latency_us": 0.6}, 8,
                    {"gpus": 8, "nics": 1, "nvlink": {"bw_GBps": 450, "latency_us": 1.0},
                     "nic": {"bw_Gbps": 400, "latency_us": 1.0}, "pcie_GBps": 64})


def test_oversubscription_above_the_leaf_slows_a_cross_leaf_all_reduce_by_the_expected_factor():
    """Ring over nodes 0, 4, 1, 5 (leaves 0, 1, 0, 1): 8 channels (one per GPU of a node), each
    crossing between the leaves at every node boundary. Per direction 16 flows leave a leaf,
    8 through each of its 2 NICs. 1:1: four uplinks of P; a NIC is shared by 8 flows, so each
    gets P/8 (the hashing puts at most 8 on one spine). 4:1: one uplink of P for all 16: P/16.
    Closed form per channel (S/8 each): T = 2(n-1) a + 2(n-1)/n (S/8) / B."""
    P = 400e9 / 8
    size = 1 << 30
    group = [*range(8), *range(32, 40), *range(8, 16), *range(40, 48)]
    n = len(group)
    alpha_s = 2 * 1.0e-6 + 2 * 0.6e-6  # NIC, leaf-spine, spine-leaf, NIC (PCIe has none)

    def closed_form(bw_Bps):
        return 2 * (n - 1) * alpha_s + 2 * (n - 1) / n * (size / 8) / bw_Bps

    full, over = _oversubscribed(1), _oversubscribed(4)
    assert _count(full)["spine"] == 4 and _count(over)["spine"] == 1
    assert full.graph.edges["leaf0.0", "spine0"]["line_bw_Bps"] == P
    assert over.graph.edges["leaf0.0", "spine0"]["line_bw_Bps"] == P
    # precondition of the 1:1 figure: no spine carries more than 8 of one direction's 16 flows
    node_first = [0, 32, 8, 40]
    crossings = [(node_first[x] + (c + 7) % 8, node_first[(x + 1) % 4] + c) for c in range(8) for x in range(4)]
    load = {}
    for src, dst in crossings:
        up = _hops(full, full.path(src, dst))[2]
        load[up] = load.get(up, 0) + 1
    assert sum(load.values()) == 32 and max(load.values()) <= 8

    t_full = _ring_time_s(full, group, size)
    t_over = _ring_time_s(over, group, size)
    assert t_full == pytest.approx(closed_form(P / 8), rel=1e-6)
    assert t_over == pytest.approx(closed_form(P / 16), rel=1e-6)
    assert t_over / t_full == pytest.approx(closed_form(P / 16) / closed_form(P / 8), rel=1e-6)
    assert 1.9 < t_over / t_full < 2.0  # twice the bandwidth term, the same latency


def test_oversubscription_does_not_touch_a_ring_inside_one_leaf():
    """16 GPUs on nodes 0 and 1, both under leaf 0: traffic never goes up, so 1:1 and 4:1 agree
    with the closed form at the NIC's share P/8 (8 channels through each node's one NIC)."""
    P = 400e9 / 8
    size = 1 << 30
    group = list(range(16))
    alpha_s = 2 * 1.0e-6  # NIC, NIC (NVLink hops: 2 x 1.0 too)
    expected = 2 * 15 * alpha_s + 2 * 15 / 16 * (size / 8) / (P / 8)
    t_full = _ring_time_s(_oversubscribed(1), group, size)
    t_over = _ring_time_s(_oversubscribed(4), group, size)
    assert t_full == pytest.approx(expected, rel=1e-6)
    assert t_over == pytest.approx(t_full, rel=1e-12)


def test_pod_oversubscription_slows_a_cross_pod_all_reduce_by_the_expected_factor():
    """Three-tier fat tree, radix 8, one node per leaf (8 GPUs on one 400 Gb/s NIC, P = 50 GB/s),
    8 nodes: leaves per pod Lp = d2 = 4 at both 1:1 (u2 = 4) and 4:1 (u2 = floor(8 / 5) = 1), so
    2 pods (nodes 0-3, 4-7) of one spine each; every leaf uplink is c1 = P and every spine uplink
    c2 = Lp c1 / (o2 U2) = P: 1:1 has U2 = 4 cores, 4:1 has U2 = ceil(4 / 4) = 1.

    Ring over nodes 0, 4, 1, 5 (pods 0, 1, 0, 1), n = 32: 8 channels (one per GPU of a node),
    each crossing between the pods at every node boundary, so per direction 16 flows leave a
    pod, 8 through each node's NIC and its leaf's one uplink. 1:1: a NIC is shared by 8 flows,
    P/8 each, as long as the hashing at the spine puts at most 8 of them on one of its 4 core
    uplinks of P. 4:1: all 16 share the one spine-core cable of P: P/16. Per channel (S/8 each)
    with alpha = 2 x 1.0 us (NICs) + 4 x 0.6 us (leaf-spine-core-spine-leaf):
        T = 2(n-1) alpha + 2(n-1)/n (S/8) / B,   B = P/8 (1:1) or P/16 (4:1).
    Ring over nodes 0-3 (one pod, n = 32): it turns at the pod's spine and never reaches a core,
    so 1:1 and 4:1 agree, at P/8 with alpha = 2 x 1.0 us + 2 x 0.6 us."""
    P = 400e9 / 8
    size = 1 << 30

    def tree(o2):
        return _cluster({"kind": "fat_tree", "tiers": 3, "radix": 8, "rail_optimized": False, "nodes_per_leaf": 1,
                         "pod_oversubscription": o2, "latency_us": 0.6}, 8,
                        {"gpus": 8, "nics": 1, "nvlink": {"bw_GBps": 450, "latency_us": 1.0},
                         "nic": {"bw_Gbps": 400, "latency_us": 1.0}, "pcie_GBps": 64})

    def closed_form(n, alpha_s, bw_Bps):
        return 2 * (n - 1) * alpha_s + 2 * (n - 1) / n * (size / 8) / bw_Bps

    full, over = tree(1), tree(4)
    for c, cores in ((full, 4), (over, 1)):
        p = plan_fabric(c.cfg)
        assert (p.nodes_per_leaf, p.spines, p.leaves_per_pod, p.pods, p.cores_per_plane) == (1, 1, 4, 2, cores)
        assert _count(c) == {"nvswitch": 8, "nic": 8, "gpu": 64, "leaf": 8, "spine": 2, "core": cores}
        assert c.graph.edges["leaf0.0", "pod0.spine0"]["line_bw_Bps"] == P
        assert c.graph.edges["pod0.spine0", "core0.0"]["line_bw_Bps"] == P

    cross = [*range(0, 8), *range(32, 40), *range(8, 16), *range(40, 48)]  # nodes 0, 4, 1, 5
    cross_alpha_s = 2 * 1.0e-6 + 4 * 0.6e-6
    # precondition of the 1:1 figure: no spine-core cable (either way) carries more than 8 flows
    node_first = [0, 32, 8, 40]
    crossings = [(node_first[x] + (ch + 7) % 8, node_first[(x + 1) % 4] + ch) for ch in range(8) for x in range(4)]
    load = {}
    for src, dst in crossings:
        hops = _hops(full, full.path(src, dst))
        assert hops[3][1].startswith("core0.") and hops[4][0] == hops[3][1]
        for hop in (hops[3], hops[4]):
            load[hop] = load.get(hop, 0) + 1
    assert sum(load.values()) == 64 and max(load.values()) <= 8

    t_full = _ring_time_s(full, cross, size)
    t_over = _ring_time_s(over, cross, size)
    assert t_full == pytest.approx(closed_form(32, cross_alpha_s, P / 8), rel=1e-6)
    assert t_over == pytest.approx(closed_form(32, cross_alpha_s, P / 16), rel=1e-6)
    expected_ratio = closed_form(32, cross_alpha_s, P / 16) / closed_form(32, cross_alpha_s, P / 8)
    assert t_over / t_full == pytest.approx(expected_ratio, rel=1e-6)
    assert 1.99 < t_over / t_full < 2.0  # twice the bandwidth term, the same latency

    in_pod = list(range(32))  # nodes 0-3
    t_in_full = _ring_time_s(full, in_pod, size)
    t_in_over = _ring_time_s(over, in_pod, size)
    assert t_in_full == pytest.approx(closed_form(32, 2 * 1.0e-6 + 2 * 0.6e-6, P / 8), rel=1e-6)
    assert t_in_over == pytest.approx(t_in_full, rel=1e-12)


@pytest.mark.parametrize("routing", ["hash", "destination"])
@pytest.mark.parametrize("case", ["llama3 Clos", "llama3 Clos, a core link removed", "dgx-a100, a spine link removed",
                                  "3-tier fat tree"])
def test_routes_of_many_pairs_at_once_are_path_s_routes(root, case, routing):
    """``Cluster.paths`` routes pairs across leaves in one loop (``_across_leaves``, the DP
    rings of a 16K-GPU step: ~86,000 pairs); each route is :meth:`Cluster.path`'s, the same
    ECMP hashes (or destination ports) up and down, on fabrics of two and three tiers, intact
    and with a link cut (a route that turns through a third leaf, or has a choice on the way
    down). Going down, the choices are worked out per (switch, the switches above the
    destination leaf) on arrays (``_down_table``), where ``path`` asks per (switch, leaf)."""
    import random

    import numpy as np

    llama = root / "topologies/roce-clos-llama3.yaml"
    a100 = root / "topologies/dgx-a100.yaml"

    def fabric(path) -> dict:
        return {**yaml.safe_load(path.read_text())["fabric"], "routing": routing}

    if case == "llama3 Clos":
        make = lambda: build_cluster(load_topology_cfg(llama, {"nodes": 400, "fabric": fabric(llama)}))  # noqa: E731
    elif case == "llama3 Clos, a core link removed":
        intact = build_cluster(load_topology_cfg(llama, {"nodes": 400}))
        core = min(v for v in intact.graph.successors("pod1.spine0") if v.startswith("core"))
        make = lambda: build_cluster(load_topology_cfg(llama, {"nodes": 400, "fabric": fabric(llama),  # noqa: E731
                                                               "what_if": [{"remove_link": f"{core}-pod1.spine0"}]}))
    elif case == "dgx-a100, a spine link removed":
        intact = build_cluster(load_topology_cfg(a100, {"nodes": 64}))
        spine = min(v for v in intact.graph.successors("leaf0.0") if v.startswith("spine"))
        make = lambda: build_cluster(load_topology_cfg(a100, {"nodes": 64, "fabric": fabric(a100),  # noqa: E731
                                                              "what_if": [{"remove_link": f"leaf0.0-{spine}"}]}))
    else:
        make = lambda: _cluster({"kind": "fat_tree", "radix": 8, "tiers": 3, "rail_optimized": False,  # noqa: E731
                                 "routing": routing}, 64, {"gpus": 2})
    one_by_one, at_once = make(), make()
    rng = random.Random(7)
    n = one_by_one.num_gpus
    pairs = [(rng.randrange(n), rng.randrange(n)) for _ in range(3000)]
    expected = [one_by_one.path(s, d) for s, d in pairs]
    rows, lens = at_once.paths(np.array([s for s, _ in pairs]), np.array([d for _, d in pairs]))
    got = [tuple(r[:k]) for r, k in zip(rows.tolist(), lens.tolist())]
    assert got == expected
    rows, lens = make()._across_leaves(np.array([s for s, _ in pairs]), np.array([d for _, d in pairs]))
    assert [tuple(r[:k]) for r, k in zip(rows.tolist(), lens.tolist())] == expected


def test_routing_by_destination_spreads_a_leaf_s_destinations_over_the_spines(root):
    """D-mod-k (``fabric.routing: destination``): the 20 NICs of a DGX A100 leaf are reached
    over the 20 spines one each, so a stage boundary's sends from one scalable unit to the
    next meet on no spine; hashed (ECMP), 20 such flows take 15 spines (5 collide)."""
    path = root / "topologies/dgx-a100.yaml"
    fab = yaml.safe_load(path.read_text())["fabric"]
    spread = {}
    for routing in ("hash", "destination"):
        c = build_cluster(load_topology_cfg(path, {"nodes": 64, "fabric": {**fab, "routing": routing}}))
        spread[routing] = {c.edges[c.path(8 * i, 8 * (i + 20))[2]][1] for i in range(20)}  # node i -> i + 20, rail 0
        assert all(c.edges[c.path(8 * i, 8 * (i + 20))[2]][1].startswith("spine") for i in range(20))
    assert len(spread["destination"]) == 20 and len(spread["hash"]) == 15
    # the fabric-wide index: leaf number x 20 + port; node 20 opens the second unit, whose
    # rail-0 leaf is the ninth leaf met (the first unit's eight rails first)
    assert c.dest_ports[[0, 8, 152, 160]].tolist() == [0, 1, 19, 8 * 20]
    assert (c.dest_ports[[0, 8, 152, 160]] % 20).tolist() == [0, 1, 19, 0]  # the leaf's own digit: its port


def test_crcs_continued_on_arrays_are_zlib_s():
    """``ecmp.Continuations.apply`` gives ``zlib.crc32(data, crc)`` for every row, for strings
    of any length (the empty one too) and any 32-bit CRC to continue from, so that a pair's
    salt ``src>dst`` hashes as ``crc32(">" + dst, crc32(src))``."""
    import random
    import zlib

    import numpy as np

    from clustersim.hardware.ecmp import Continuations

    rng = random.Random(3)
    hashes = Continuations()
    strings = [bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40))) for _ in range(60)] + [b""]
    codes = [hashes.code(s) for s in strings]
    assert hashes.code(strings[5]) == codes[5]  # registered once
    rows = [rng.randrange(len(strings)) for _ in range(3000)]
    crc = [rng.choice([0, 2**32 - 1, rng.randrange(2**32)]) for _ in rows]
    got = hashes.apply(np.array([codes[i] for i in rows]), np.array(crc, dtype=np.int64))
    assert got.tolist() == [zlib.crc32(strings[i], c) for i, c in zip(rows, crc)]
    salt = hashes.apply(np.array([hashes.code(b">n7.gpu3")]), np.array([zlib.crc32(b"n12.gpu0")]))
    assert salt.tolist() == [zlib.crc32(b"n12.gpu0>n7.gpu3")]


def test_routing_by_destination_is_non_blocking_for_a_shift_across_pods():
    """D-mod-k on a three-tier fat tree (Zahavi 2010): each GPU sends to the one half the
    cluster away, every flow crossing pods. Picking each tier's uplink by a digit of the
    destination's fabric-wide index spreads them over every core, each at its NIC's full rate;
    by the port on the leaf alone, a plane's cross-pod routes all climbed to one core (1/4 of
    the rate here). Hashing collides."""
    from clustersim.engine.network import max_min_rates
    from clustersim.hardware.topology import TopologyCfg, build_cluster

    got = {}
    for routing in ("hash", "destination"):
        cl = build_cluster(TopologyCfg.model_validate(
            {"gpu": "H100", "nodes": 16, "node": {"gpus": 2, "nics": 2},
             "fabric": {"kind": "fat_tree", "radix": 8, "tiers": 3, "rail_optimized": False, "routing": routing}}))
        n = cl.num_gpus
        pairs = [(s, (s + n // 2) % n) for s in range(n)]
        rates = max_min_rates([tuple((e, 1.0) for e in cl.path(s, t)) for s, t in pairs], cl.edge_bw_Bps)
        nic = cl.edge_bw_Bps[cl.path(0, n // 2)[1]]  # the GPU's NIC cable to its leaf
        cores = {v for s, t in pairs for u, v in map(cl.edges.__getitem__, cl.path(s, t)) if v.startswith("core")}
        got[routing] = (min(rates) / nic, len(cores))
    assert got["destination"] == (pytest.approx(1.0, rel=1e-12), 16)
    assert got["hash"][0] < 1.0


@pytest.mark.parametrize("section, given, value, says", [
    ("nic", "bw_GBps", 50, "did you mean 'bw_Gbps'? it is in gigabits per second: bw_GBps: 50 is bw_Gbps: 400;"),
    ("nvlink", "bw_Gbps", 3600, "did you mean 'bw_GBps'? it is in gigabytes per second: bw_Gbps: 3600 is bw_GBps: 450;"),
])
def test_a_rate_under_the_other_units_key_is_named_converted(root, tmp_path, section, given, value, says):
    """A NIC's rate is in Gb/s, NVLink's in GB/s: a rate typed under the other unit's key is
    refused as unknown, and the message gives the value converted (renamed alone, it was 8x off)."""
    d = yaml.safe_load((root / "topologies/dgx-h100.yaml").read_text())
    d["node"][section].pop("bw_GBps" if given == "bw_Gbps" else "bw_Gbps", None)
    d["node"][section][given] = value
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(ConfigError) as err:
        load_topology_cfg(tmp_path / "t.yaml")
    assert err.value.field == f"node.{section}.{given}" and says in err.value.message


def test_an_oversubscription_that_keeps_no_port_up_is_named(root, tmp_path):
    """A fat tree's leaf of radix 64 at 64:1 keeps no uplink: the ratio is what is off (it
    said "raise the radix", naming fabric.radix)."""
    d = yaml.safe_load((root / "topologies/fat-tree.yaml").read_text())
    d["fabric"].update(oversubscription=64)
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(ConfigError) as err:
        load_topology_cfg(tmp_path / "t.yaml")
    assert err.value.field == "fabric.oversubscription" and "keeps no port up" in err.value.message
    assert "at most 63:1" in err.value.message


def test_an_efficiency_given_as_a_percent_is_read_back_as_a_share(root, tmp_path):
    """``efficiency: 90`` said only "less than or equal to 1"; a whole percent now reads as the
    share it would be (1.2, no percent, is left as it is)."""
    for given, says in ((90, "(got 90: a share, 0.9 for 90 %)"), (1.2, "(got 1.2)")):
        d = yaml.safe_load((root / "topologies/dgx-h100.yaml").read_text())
        d["node"]["nic"]["efficiency"] = given
        (tmp_path / "t.yaml").write_text(yaml.safe_dump(d))
        with pytest.raises(ConfigError) as err:
            load_topology_cfg(tmp_path / "t.yaml")
        assert err.value.field == "node.nic.efficiency" and err.value.message.endswith(says)


def test_an_oversubscription_over_one_leaf_is_said_unused(root, tmp_path):
    """An oversubscribed fabric whose nodes one leaf holds (16 nodes, ``nodes_per_leaf`` 16 by
    default) has no link above that leaf: the ratio changes nothing, and ``validate`` and the
    network line say so rather than echo "2:1" as if it held; spread over leaves, it holds."""
    import yaml

    from clustersim.cli import main
    from clustersim.hardware.topology import load_topology_cfg, network_figures
    from clustersim.output.summary import network_said

    d = yaml.safe_load((root / "topologies" / "dgx-h100.yaml").read_text())
    d.update(nodes=16, fabric={**d["fabric"], "oversubscription": 2.0, "rail_optimized": False})
    d["fabric"].pop("nodes_per_leaf", None)
    path = tmp_path / "one_leaf.yaml"
    path.write_text(yaml.safe_dump(d))
    net = network_figures(load_topology_cfg(path, build=False))
    assert net["fabric"]["leaves"] == 1 and net["fabric"]["oversubscription_unused"]
    assert network_said({"gpu": "H100", "network": net}).endswith("leaf-spine, 1 leaf, its 2:1 unused (every node "
                                                                   "under one leaf), x 0.9")
    assert main(["validate", str(path)]) == 0
    d["fabric"]["nodes_per_leaf"] = 4
    path.write_text(yaml.safe_dump(d))
    net = network_figures(load_topology_cfg(path, build=False))
    assert net["fabric"]["leaves"] == 4 and not net["fabric"]["oversubscription_unused"]
    assert network_said({"gpu": "H100", "network": net}).endswith(", 2:1, x 0.9")


def test_validate_says_an_oversubscription_over_one_leaf_is_unused(root, tmp_path, capsys):
    import yaml

    from clustersim.cli import main

    d = yaml.safe_load((root / "topologies" / "dgx-h100.yaml").read_text())
    d.update(nodes=16, fabric={**d["fabric"], "oversubscription": 2.0, "rail_optimized": False})
    d["fabric"].pop("nodes_per_leaf", None)
    path = tmp_path / "one_leaf.yaml"
    path.write_text(yaml.safe_dump(d))
    assert main(["validate", str(path)]) == 0
    assert ("its 2:1 oversubscription is unused: one leaf holds all 16 nodes, fabric.nodes_per_leaf being 16 by "
            "default: lower it to spread them over leaves)") in capsys.readouterr().out
