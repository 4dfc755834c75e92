"""Collective algorithms and the collective benchmark against published nccl-tests busbw and
closed forms."""

from __future__ import annotations

import subprocess
import sys

import pytest

from clustersim.netbench import benchmark, format_table, parse_sizes

GiB = 1 << 30
NIC_Bps = 400e9 / 8 * 0.9  # NDR at the topology's efficiency
NVLINK_H100_Bps = 450e9 * 0.81


@pytest.mark.parametrize("topology, algo, size, published_GBps", [
    # nccl-tests all-reduce busbw as published for one node (docs/network.md's table)
    ("dgx-a100", "ring", 8 * GiB, 231.6),
    ("dgx-a100", "auto", 1 * GiB, 228),
    ("dgx-h100", "ring", 8 * GiB, 365),
    ("dgx-h100", "nvls", 8 * GiB, 478.9),
    ("dgx-h100", "auto", 8 * GiB, 478.9),  # the tuner picks NVLS on H100
])
def test_one_node_all_reduce_busbw_matches_nccl_tests(root, topology, algo, size, published_GBps):
    _, (row,) = benchmark(root / f"topologies/{topology}.yaml", "all_reduce", 8, [size], algo)
    assert row.busbw_Bps("all_reduce", 8) / 1e9 == pytest.approx(published_GBps, rel=0.10)


@pytest.mark.parametrize("topology, size, published_GBps, shown", [
    # docs/network.md's table: A100's 1 MiB, where its NVLink hop latency was fitted, and the
    # mid-size rows not fitted (NCCL's protocols and per-operation overheads not modelled):
    # clustersim optimistic there, as the page says, by the figures it prints
    ("dgx-a100", 1 << 20, 36, "36.7"),
    ("dgx-a100", 16 << 20, 109, "173.6"),
    ("dgx-h100", 128 << 20, 401, "473.1"),
    ("dgx-h100", 16 << 20, 234, "436.2"),
    ("dgx-h100", 1 << 20, 44, "186.6"),
])
def test_smaller_all_reduces_against_nccl_tests(root, topology, size, published_GBps, shown):
    _, (row,) = benchmark(root / f"topologies/{topology}.yaml", "all_reduce", 8, [size], "auto")
    busbw = row.busbw_Bps("all_reduce", 8) / 1e9
    assert f"{busbw:.1f}" == shown
    if size == 1 << 20 and topology == "dgx-a100":
        assert busbw == pytest.approx(published_GBps, rel=0.10)
    else:
        assert busbw > published_GBps
    page = " ".join((root / "docs/network.md").read_text().split())
    assert shown in page


def test_nvls_needs_a_switch_that_reduces(root):
    """A100's NVSwitch has no NVLink SHARP: asking for NVLS falls back to the ring."""
    cluster, (row,) = benchmark(root / "topologies/dgx-a100.yaml", "all_reduce", 8, [GiB], "nvls")
    assert row.algorithm == "ring"
    # the command's table says so (no note where the algorithm asked for ran)
    assert format_table(cluster, "all_reduce", 8, [row], "nvls").splitlines()[-1] == (
        "note: nvls cannot run all_reduce over these 8 GPUs; ring ran instead (docs/reference.md, simulation.collectives)")
    assert not format_table(cluster, "all_reduce", 8, [row], "ring").splitlines()[-1].startswith("note")


def test_nvls_moves_at_the_topology_s_nvls_efficiency(root, tmp_path):
    """``node.nvlink.nvls_efficiency`` replaces the catalogue's 0.608 for NVLS alone: at 0.4 an
    8 GiB all-reduce's busbw is 2 (n-1)/n x 0.4 x 450 GB/s = 315 GB/s (its 2 alpha aside),
    while a ring's, at ``efficiency``, is unchanged; an A100 node, whose NVSwitch does not
    reduce, refuses it."""
    import yaml

    from clustersim.errors import ConfigError
    from clustersim.hardware import load_topology_cfg

    topo = yaml.safe_load((root / "topologies/dgx-h100.yaml").read_text())
    topo["node"]["nvlink"]["nvls_efficiency"] = 0.4
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(topo))
    rows = {}
    for name in ("dgx-h100.yaml", "t.yaml"):
        for algo in ("nvls", "ring"):
            path = root / "topologies" / name if name.startswith("dgx") else tmp_path / name
            _, (row,) = benchmark(path, "all_reduce", 8, [8 * GiB], algo)
            assert row.algorithm == algo
            rows[name, algo] = row.busbw_Bps("all_reduce", 8)
    assert rows["t.yaml", "nvls"] == pytest.approx(2 * 7 / 8 * 0.4 * 450e9, rel=1e-3)
    assert rows["dgx-h100.yaml", "nvls"] == pytest.approx(478.9e9, rel=1e-3)
    assert rows["t.yaml", "ring"] == rows["dgx-h100.yaml", "ring"]
    a100 = {"gpu": "A100", "nodes": 1, "node": {"nvlink": {"nvls_efficiency": 0.5}}}
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(a100))
    with pytest.raises(ConfigError, match="nvls_efficiency is read only where the NVSwitch reduces") as err:
        load_topology_cfg(tmp_path / "a.yaml")
    assert err.value.field == "node"


def test_hierarchical_beats_the_flat_ring_across_nodes_by_the_expected_amount(root):
    """4 nodes x 8 GPUs, 8 GiB. Flat ring, 8 channels: each NIC carries 2(n-1)/n * S/8.
    Hierarchical (pipelined): each NIC carries 2(N-1)/N * S/8 across nodes while NVLink
    carries the in-node reduce-scatter and all-gather, 2(g-1)/g * S per GPU; the slower sets
    the time."""
    n, nodes, g, size = 32, 4, 8, 8 * GiB
    _, (ring,) = benchmark(root / "topologies/dgx-h100.yaml", "all_reduce", n, [size], "ring")
    _, (hier,) = benchmark(root / "topologies/dgx-h100.yaml", "all_reduce", n, [size], "hierarchical")
    ring_s = 2 * (n - 1) / n * size / g / NIC_Bps
    hier_s = max(2 * (g - 1) / g * size / NVLINK_H100_Bps, 2 * (nodes - 1) / nodes * size / g / NIC_Bps)
    assert ring.time_s == pytest.approx(ring_s, rel=0.01)
    assert hier.time_s == pytest.approx(hier_s, rel=0.01)
    assert ring.time_s / hier.time_s == pytest.approx(ring_s / hier_s, rel=0.02)
    assert hier.time_s < ring.time_s


def test_a_ring_uneven_over_nodes_crosses_by_the_smaller_side_s_nics(root):
    """12 GPUs on nodes of 8: 8 + 4. The ring runs 4 channels, each rotated so that it enters
    and leaves both nodes by GPUs of its own: each of the 4 NICs of the smaller side carries
    2(n-1)/n * S/4, where one ring carried it all through one NIC (8 times the 16-GPU ring's
    time, found by a user comparing DP12 with DP16)."""
    n, g, size = 12, 4, 8 * GiB
    _, (ring,) = benchmark(root / "topologies/dgx-h100.yaml", "all_reduce", n, [size], "ring")
    assert ring.time_s == pytest.approx(2 * (n - 1) / n * size / g / NIC_Bps, rel=0.01)


def test_collective_says_where_it_grew_the_fabric(root):
    """More GPUs than the topology file's nodes hold: the fabric is grown as a scenario's
    cluster.nodes grows it, and the table says so."""
    topo = root / "topologies/dgx-h100.yaml"  # 32 nodes
    cluster, rows = benchmark(topo, "all_reduce", 264, [GiB])
    assert format_table(cluster, "all_reduce", 264, rows, "auto", 32).splitlines()[-1] == (
        "note: the topology file describes 32 nodes; its fabric was grown to 33, as a scenario's cluster.nodes "
        "grows it")
    cluster, rows = benchmark(topo, "all_reduce", 256, [GiB])
    assert not format_table(cluster, "all_reduce", 256, rows, "auto", 32).splitlines()[-1].startswith("note")


def test_tree_wins_small_messages_across_many_nodes(root):
    """A ring's latency grows with 2(n-1) hops, a tree's with its depth: at 64 KiB over 8
    nodes the tree is faster, at 1 GiB it is not faster than the ring's bandwidth bound."""
    _, rows_ring = benchmark(root / "topologies/dgx-h100.yaml", "all_reduce", 64, [64 << 10, GiB], "ring")
    _, rows_tree = benchmark(root / "topologies/dgx-h100.yaml", "all_reduce", 64, [64 << 10, GiB], "tree")
    assert rows_tree[0].time_s < rows_ring[0].time_s / 5
    assert rows_tree[1].busbw_Bps("all_reduce", 64) < 1.2 * rows_ring[1].busbw_Bps("all_reduce", 64)


def test_auto_picks_the_fastest_applicable_algorithm_per_size(root):
    sizes = [64 << 10, GiB]
    _, auto = benchmark(root / "topologies/dgx-h100.yaml", "all_reduce", 64, sizes, "auto")
    for algo in ("ring", "tree", "hierarchical", "nvls_tree"):
        _, rows = benchmark(root / "topologies/dgx-h100.yaml", "all_reduce", 64, sizes, algo)
        for a, r in zip(auto, rows):
            assert a.time_s <= r.time_s * (1 + 1e-9)


def test_nvls_tree_across_two_nodes_is_its_closed_form(root):
    """NVLSTree over 2 DGX H100 nodes, 8 GiB: each GPU's loop through its switch carries S up
    and down at NVLS's share of the line rate, as NVLS's in one node (NCCL's two kernels move
    the same over NVLink); each node is a tree's root and the other's leaf, so a NIC carries
    S/g each way. 4 latency rounds (NVLS up and down, the tree up and down). On 2 nodes
    NVLink binds: algbw 0.608 x 450 = 273.6 GB/s, one node's NVLS, busbw 1.875 x that = 513
    GB/s; auto picks it over the hierarchical ring (its in-node rings at 0.81 of the line
    rate carry 2 (g-1)/g S: 208 GB/s of algbw)."""
    from clustersim.collectives.algorithms import applicable

    n, g, size = 16, 8, 8 * GiB
    cluster, (row,) = benchmark(root / "topologies/dgx-h100.yaml", "all_reduce", n, [size], "nvls_tree")
    assert row.algorithm == "nvls_tree"
    nvls_Bps = 450e9 * cluster.nvls_efficiency
    alpha_s = max(cluster.path_latency_s(cluster.path(0, b)) for b in (1, 8))
    want_s = 4 * alpha_s + max(size / nvls_Bps, size / g / NIC_Bps)
    assert row.time_s == pytest.approx(want_s, rel=1e-6)
    _, (auto,) = benchmark(root / "topologies/dgx-h100.yaml", "all_reduce", n, [size], "auto")
    assert auto.algorithm == "nvls_tree"
    node_of = cluster.node_of
    assert not applicable("all_reduce", "nvls_tree", tuple(range(8)), node_of, True)  # one node: NVLS
    assert not applicable("all_reduce", "nvls_tree", tuple(range(0, 16, 8)), node_of, True)  # one GPU a node
    assert not applicable("all_reduce", "nvls_tree", tuple(range(16)), node_of, False)  # A100's switch
    a100, (ring,) = benchmark(root / "topologies/dgx-a100.yaml", "all_reduce", n, [size], "nvls_tree")
    assert ring.algorithm == "ring"


def test_nvls_tree_s_links_carry_its_bytes(root):
    """The bytes a step's NVLSTree all-reduces put on each link (summary ``links.by_kind``):
    over 2 nodes each GPU's NVLink carries S each way, each NIC S/g, a ratio of g = 8. Its
    NVLS loops move at NVLS's share of NVLink (a wire scale of 1.33) and its tree hops at the
    NICs' own; made one pipeline, each hop's bytes are still counted at its own scale (they
    were counted at the NICs', 12x instead of 8x)."""
    import clustersim

    from .conftest import scenario_dict

    d = scenario_dict(training={"global_batch_size": 16})
    d["cluster"].update(topology=str(root / "topologies/dgx-h100.yaml"), nodes=2)
    d["parallel"].update(tp=1, pp=1, dp=16, zero=0)
    d["simulation"] = {"collectives": {"all_reduce": "nvls_tree"}}
    s = clustersim.simulate(clustersim.load_scenario(d, base_dir=root)).summary
    assert set(s["simulation"]["collective_algorithms"]["all_reduce"]) == {"nvls_tree"}
    kinds = s["links"]["by_kind"]
    per = {k: kinds[k]["bytes"] / kinds[k]["links"] for k in ("nvlink", "nic", "pcie")}
    assert per["nvlink"] / per["nic"] == pytest.approx(8, rel=1e-9)
    assert per["pcie"] == pytest.approx(per["nic"], rel=1e-9)


def test_the_table_says_what_bounds_each_row(root, tmp_path):
    """``bound by``: latency where the latency rounds outweigh the bytes, else the kind of the
    busiest link; fabric- and PCIe-bound rows get a note. One DGX H100 node: 64 KiB latency,
    8 GiB NVLink; an all-to-all over two nodes its NICs; a leaf-spine at 4:1 above its leaves
    the fabric; 400 Gb/s NICs behind PCIe gen4 (32 GB/s) PCIe, a shared NIC's too."""
    import yaml

    from clustersim.netbench import format_table

    def bound(topology, op, gpus, sizes, algo="auto"):
        cluster, rows = benchmark(topology, op, gpus, sizes, algo)
        return [r.bound for r in rows], format_table(cluster, op, gpus, rows, algo)

    h100 = root / "topologies/dgx-h100.yaml"
    assert bound(h100, "all_reduce", 8, [64 << 10, 8 * GiB])[0] == ["latency", "NVLink"]
    assert bound(h100, "all_to_all", 16, [GiB])[0] == ["NIC"]
    for name, topo in (("over.yaml", {"gpu": "H100", "nodes": 4, "node": {"pcie_GBps": 64},
                                      "fabric": {"nodes_per_leaf": 2, "spines": 1, "oversubscription": 4}}),
                       ("pcie.yaml", {"gpu": "A100", "nodes": 2, "node": {"nic": {"bw_Gbps": 400}, "pcie_GBps": 32}}),
                       ("shared.yaml", {"gpu": "H100", "nodes": 2, "node": {"nics": 1, "nic": {"bw_Gbps": 800},
                                                                            "pcie_GBps": 64}})):
        (tmp_path / name).write_text(yaml.safe_dump(topo))
    said, table = bound(tmp_path / "over.yaml", "all_gather", 32, [GiB], "ring")
    assert said == ["fabric"] and "note: 1 GiB is bound by the switches above the NICs" in table
    for name in ("pcie.yaml", "shared.yaml"):
        said, table = bound(tmp_path / name, "all_gather", 16, [8 * GiB], "ring")
        assert said == ["PCIe"] and table.splitlines()[-1].startswith("note: 8 GiB is bound by PCIe"), name


def test_cross_node_all_to_all_is_nic_bound(root):
    """16 GPUs on 2 nodes: half of each GPU's buffer leaves the node through one NIC (PXN)."""
    _, (row,) = benchmark(root / "topologies/dgx-h100.yaml", "all_to_all", 16, [GiB])
    assert row.time_s == pytest.approx(GiB / 2 / NIC_Bps, rel=0.01)
    assert row.busbw_Bps("all_to_all", 16) == pytest.approx(GiB / row.time_s * 15 / 16)



def test_double_binary_tree_is_nccl_s_in_order_tree():
    """NCCL's trees (src/graph/trees.cc, ncclGetBtree and its illustration over 14 ranks):
    rooted at 0 with the one child 8, parents by clearing a position's lowest set bit and
    setting the next; the second tree mirrored (even counts) or shifted by one (odd)."""
    from clustersim.collectives.algorithms import _btree_parent, _second_tree, _tree_depth

    assert {i: _btree_parent(i, 14) for i in range(1, 14)} == {
        1: 2, 3: 2, 5: 6, 7: 6, 9: 10, 11: 10, 2: 4, 6: 4, 10: 12, 13: 12, 4: 8, 12: 8, 8: 0}
    assert _tree_depth(14) == 4 and _tree_depth(2) == 1 and _tree_depth(128) == 7
    assert _second_tree(list(range(4))) == [3, 2, 1, 0] and _second_tree(list(range(5))) == [1, 2, 3, 4, 0]


def test_tree_over_many_nodes_is_nic_bound(root):
    """128 DGX H100 nodes (four leaf groups of 32): an in-order tree's edges stay inside a
    leaf group but for a few, so the tree all-reduce of 8 GiB is bound by the NICs: an
    inner node's NIC carries three edges of one tree and one of the other, each half of the
    channel's S/g, each way: 2 (S/g) / B_nic, plus 2 (depth + g - 1) latencies. (Laid out as
    a heap over the nodes, 96 of a tree's 127 edges crossed leaf groups and it took 2.1x.)"""
    size = 8 * GiB
    _, (row,) = benchmark(root / "topologies/dgx-h100.yaml", "all_reduce", 1024, [size], "tree")
    assert row.time_s == pytest.approx(2 * size / 8 / NIC_Bps, rel=0.005)


def test_tree_over_two_nodes_moves_half_of_the_many_node_bound(root, tmp_path):
    """Over two nodes each node is the root of one tree and the leaf of the other: its NIC
    carries one edge of each, half the channel's S/g up and half down, each way: (S/g) / B_nic
    (docs/reference.md; half of test_tree_over_many_nodes_is_nic_bound's). NICs at 100 Gb/s
    make them the bound (at 400 Gb/s two nodes are bound by the chains on NVLink)."""
    text = (root / "topologies/dgx-h100.yaml").read_text()
    assert "bw_Gbps: 400" in text
    slow = tmp_path / "dgx-h100-100g.yaml"
    slow.write_text(text.replace("bw_Gbps: 400", "bw_Gbps: 100"))
    size = 8 * GiB
    _, (row,) = benchmark(slow, "all_reduce", 16, [size], "tree")
    assert row.time_s == pytest.approx(size / 8 / (NIC_Bps / 4), rel=0.005)


def test_sizes_parse_like_nccl_tests():
    assert parse_sizes("1M,16M,1G,8G") == [1 << 20, 16 << 20, 1 << 30, 8 << 30]
    assert parse_sizes("512, 64K") == [512, 64 << 10]


def test_collective_command_prints_algbw_and_busbw(root):
    out = subprocess.run([sys.executable, "-m", "clustersim", "collective", "--topology",
                          str(root / "topologies/dgx-a100.yaml"), "--op", "all_reduce", "--gpus", "8",
                          "--sizes", "1M,8G"], capture_output=True, text=True, cwd=root)
    assert out.returncode == 0, out.stderr
    assert "algbw (GB/s)" in out.stdout and "busbw (GB/s)" in out.stdout
    last = out.stdout.strip().splitlines()[-1].split()
    assert last[:2] == ["8", "GiB"] and float(last[-2]) == pytest.approx(231.6, rel=0.10) and last[-1] == "NVLink"


@pytest.mark.parametrize("args, words", [
    (["--sizes", "1X"], "--sizes: cannot read size '1X'"),
    (["--sizes", "-1M"], "--sizes: cannot read size '-1M'"),  # (argparse would take it for an option)
    (["--op", "broadcast"], "--op: unknown collective 'broadcast'"),
    (["--algo", "nvls", "--op", "all_gather"], "--algo: all_gather has no algorithm 'nvls'"),
    (["--gpus", "1"], "--gpus: a collective needs at least 2 GPUs"),
])
def test_collective_command_bad_input(root, args, words):
    out = subprocess.run([sys.executable, "-m", "clustersim", "collective", "--topology",
                          str(root / "topologies/dgx-h100.yaml"), *args], capture_output=True, text=True, cwd=root)
    assert out.returncode == 2 and words in out.stderr and "Traceback" not in out.stderr


def test_link_bytes_of_a_ring_all_reduce(root):
    """Ring all-reduce of S over one node of 8: every GPU's NVLink carries 2(n-1)/n * S each
    way; NVLS instead carries S each way."""
    from clustersim.engine.sim import Engine
    from clustersim.hardware.topology import build_cluster, load_topology_cfg
    from clustersim.program.tasks import Comm, Program

    cl = build_cluster(load_topology_cfg(root / "topologies/dgx-h100.yaml", {"nodes": 1}))
    size = float(GiB)
    for algo, per_gpu in (("ring", 2 * 7 / 8 * size), ("nvls", size)):
        prog = Program(ranks=[0], weight={0: 8})
        prog.add(rank=0, stream="c", name="AR", kind="tp", comm=Comm("all_reduce", size, tuple(range(8)), (), (0,),
                                                                      ("tp", (0,), 0)))
        trace = Engine(prog, cl, "flow", {"all_reduce": algo}).run()
        used = {u.name: u for u in trace.links}
        assert used["n0.gpu0->n0.nvsw"].bytes == pytest.approx(per_gpu)
        assert used["n0.nvsw->n0.gpu0"].bytes == pytest.approx(per_gpu)
        (span,) = trace.spans
        link = used["n0.gpu0->n0.nvsw"]
        # the flow runs at its rate after the latency: no faster than the link, no slower than the span allows
        assert per_gpu / span.dur_s < link.peak_Bps <= cl.edge_bw_Bps[cl.edge_index[("n0.gpu0", "n0.nvsw")]] * (1 + 1e-9)
        assert sum(link.series_Bps) * span.dur_s / len(link.series_Bps) == pytest.approx(per_gpu, rel=1e-9)


def test_a_fabric_bound_note_names_the_topologys_own_causes(root, tmp_path):
    """``collective``'s note on a fabric-bound size says what this topology has: leaf-spine
    cables slower than a NIC (with the spine count that keeps them at line rate), its
    oversubscription, and ECMP hashing only where routes hash (it told a fabric routed by
    destination to route by destination, and blamed oversubscription at 1:1)."""
    import yaml

    from clustersim.hardware import load_topology_cfg
    from clustersim.netbench import fabric_why

    d = yaml.safe_load((root / "topologies/dgx-h100.yaml").read_text())
    d["fabric"].update(nodes_per_leaf=4, spines=8)
    (tmp_path / "slow.yaml").write_text(yaml.safe_dump(d))
    said = fabric_why(load_topology_cfg(tmp_path / "slow.yaml"))
    assert "a leaf's 4 NIC ports spread over 8 spines" in said and "fabric.spines=4 keeps them at line rate" in said
    assert "oversubscription" not in said and "ECMP hashing" in said
    d["fabric"].update(nodes_per_leaf=32, spines=16, oversubscription=2.0, routing="destination")
    (tmp_path / "dest.yaml").write_text(yaml.safe_dump(d))
    said = fabric_why(load_topology_cfg(tmp_path / "dest.yaml"))
    assert "oversubscription 2:1" in said and "ECMP" not in said and "spreads them" not in said
