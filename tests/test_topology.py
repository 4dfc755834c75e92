"""Topology graph: structure, bandwidths, routes."""

from __future__ import annotations

import pytest

from clustersim.hardware import GPUS, build_cluster, load_topology_cfg, lookup_gpu
from clustersim.hardware.topology import TopologyCfg


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
    for path in sorted((root / "topologies").glob("*.yaml")):
        c = build_cluster(load_topology_cfg(path))
        assert c.num_gpus == c.cfg.nodes * c.cfg.node.gpus
