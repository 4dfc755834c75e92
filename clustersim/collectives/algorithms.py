"""Collective algorithms as phases of concurrent flows, and which one a collective uses.

An algorithm turns one collective over a group into phases that run one after the other
(all of today's algorithms need one); each phase is an :class:`Expansion`, flows that run at
once after ``steps`` latency rounds.
Sizes are fractions of the collective's buffer ``S`` (flows carry ``bytes * S``)::

    ring          1 phase   ring/multi-channel flows (collectives/ring.py)
    tree          1 phase   per channel (member position in a node, S/g each): two binary
                            trees over the nodes, each reducing half up and broadcasting it
                            down through a chain inside every node, pipelined (NCCL's double
                            binary tree, in order over the nodes, the second mirrored or
                            shifted; Sanders et al. 2009); 2 (depth + g - 1) latency
                            rounds; each tree with its chains moves in lock-step.
    hierarchical  1 phase   reduce-scatter inside each node (ring over its g members),
                            all-reduce of S/g per rail across nodes (ring over the N members
                            with the same position), all-gather inside each node; chunks are
                            pipelined through the three (NCCL), so their flows run together
                            and the slowest sets the time:
                              T = max(2 (g-1)/g S/B_nv, 2(N-1)/N (S/g)/B_nic) + latency of all three
    nvls          1 phase   NVLink SHARP (H100 and later): each GPU sends S to the NVSwitch,
                            which reduces, and receives S back (multicast): S up and S down
                            per GPU instead of 2(n-1)/n S through the ring. A flow (g, g) is
                            GPU g's loop through its switch.
    nvls_tree     1 phase   NCCL's NVLSTree (2.18 and later), across nodes: NVLS inside each
                            node, and per member position l (a channel of S/g) the tree's two
                            binary trees over the nodes' position-l GPUs, which carry the
                            node's reduced S/g to the other nodes and the result back. Each
                            GPU's loop through its switch is NVLS's, S up and S down: NCCL's
                            NVLS and NVLSTree kernels scatter, reduce, broadcast and gather
                            alike (the reduced S/g goes to the trees instead of back to the
                            switch), and NVLS's calibrated share of the line rate covers what
                            they move besides S. 2 + 2 depth latency rounds, pipelined as one.
    pxn           1 phase   all-to-all, every pair at once (collectives/ring.py), a transfer to
                            another rail forwarded over NVLink to the sender's node-mate on the
                            receiver's rail (NCCL's PXN, its default)
    pairwise      1 phase   the same pairs, each on its own direct route (PXN off)
    deepep        1 phase   a MoE dispatch or combine sending each token once per node and GPU
                            its experts are on (DeepEP; not an NCCL algorithm: the scenario's
                            ``model.moe.dispatcher`` picks it, :func:`deepep_flows`)

Ring, tree, hierarchical, NVLS and NVLSTree flows are pipelines (``Expansion.lockstep``): a chunk
passes every hop in turn, so a pipeline's hops (a ring channel, one tree of a channel with
its chains) move at its slowest hop's pace, as one flow crossing all their links; all-to-all
pairs and sends move on their own.

Choice ("auto"): the algorithm with the least time alone on its links, as NCCL's tuner picks
from its cost model per size and topology (NCCL src/graph/tuning.cc); a scenario may fix one
per collective instead.
"""

from __future__ import annotations

from functools import lru_cache

from ..model.moe import token_reach
from .ring import Expansion, expand

# algorithms each collective may use, the default (ring) first
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("ring", "tree", "hierarchical", "nvls", "nvls_tree"),
    "reduce_scatter": ("ring",),
    "all_gather": ("ring",),
    "all_to_all": ("pxn", "pairwise"),
    "shift": ("ring",),
    "send": ("ring",),
}
# what "auto" chooses among, where not every algorithm: NCCL does not tune PXN by size, it is on
AUTO: dict[str, tuple[str, ...]] = {"all_to_all": ("pxn",)}


# the deduplicating MoE dispatch: no NCCL collective, so not among ALGORITHMS (which a scenario's
# simulation.collectives and netbench choose from); model.moe.dispatcher asks for it
DEEPEP = "deepep"
# the share of NCCL's NVLink bandwidth (the topology's calibrated efficiency) DeepEP's normal
# kernels move: intranode EP8 dispatch on H800, 153 GB/s "bottleneck bandwidth", which counts
# the bytes a GPU receives from itself too (DeepEP's tests/test_intranode.py: recv_x), so
# 153 x 7/8 = 134 GB/s over NVLink, of the 160 NCCL reaches there (the DeepSeek-V3 report).
# Over RDMA its internode figures (58 and 51 GB/s at EP32 and EP64, own node counted too) are
# 43.5 and 44.6 GB/s a NIC, NCCL's 0.9 of 400 Gb/s: the NICs' own efficiency serves.
DEEPEP_NVLINK_SHARE = 153 * 7 / 8 / 160


def at_nvls_share(algo: str, link_kind: str) -> bool:
    """Whether ``algo``'s traffic on a link of ``link_kind`` moves at NVLS's own share of the
    NVLink rate (its wire scale): every link of NVLS's, NVLSTree's NVLink links (its loops;
    its trees' hops move at the NICs' own)."""
    return algo == "nvls" or (algo == "nvls_tree" and link_kind == "nvlink")


def _by_node(group: tuple[int, ...], node_of) -> list[list[int]]:
    nodes: dict[int, list[int]] = {}
    for g in group:
        nodes.setdefault(node_of(g) if node_of else 0, []).append(g)
    return list(nodes.values())


def applicable(op: str, algo: str, group: tuple[int, ...], node_of, nvls: bool) -> bool:
    """Whether ``algo`` can run ``op`` over ``group``: hierarchical needs several nodes with the
    same number (> 1) of members each, and NVLSTree those too on switches that can reduce
    (``nvls``); NVLS a group inside one NVSwitch node whose switch can reduce; tree several
    nodes with the same number of members each."""
    if algo not in ALGORITHMS.get(op, ()):
        return False
    nodes = _by_node(group, node_of)
    if algo in ("hierarchical", "nvls_tree"):
        return (nvls or algo == "hierarchical") and len(nodes) > 1 and len({len(v) for v in nodes}) == 1 \
            and len(nodes[0]) > 1
    if algo == "nvls":
        return nvls and len(nodes) == 1 and len(group) > 1
    if algo == "tree":  # NCCL's trees join nodes; inside one it runs rings and chains
        return len(nodes) > 1 and len({len(v) for v in nodes}) == 1
    return True


def _btree_parent(i: int, n: int) -> int:
    """The parent of position ``i`` in NCCL's binary tree over ``n`` positions (ncclGetBtree,
    src/graph/trees.cc): an in-order tree rooted at 0, whose one child is the highest power
    of two below n; a position's parent clears its lowest set bit and sets the next one up,
    or only clears it where that is past the end. Neighbouring positions stay close in the
    tree, so over nodes in order most of its edges join nearby nodes (the same leaf)::

        n = 14:   0 - 8          parent(1) = 2, parent(3) = 2, parent(2) = 4, parent(6) = 4,
                  8 - 4, 12      parent(4) = 8, parent(12) = 8, parent(13) = 12 (14 is past
                  4 - 2, 6 ...   the end), parent(8) = 0
    """
    low = i & -i  # the lowest set bit
    up = (i ^ low) | (low << 1)
    return up if up < n else i ^ low


def _tree_edges(order: list[int]) -> list[tuple[int, int]]:
    """(child, parent) of NCCL's binary tree (:func:`_btree_parent`) laid over ``order``."""
    n = len(order)
    return [(order[i], order[_btree_parent(i, n)]) for i in range(1, n)]


def _second_tree(order: list[int]) -> list[int]:
    """The order NCCL's second tree is laid over (ncclGetDtree): the first one mirrored
    (position i holds what n-1-i held) where n is even, shifted by one where n is odd, so
    that a node inner in one tree is a leaf in the other."""
    return order[::-1] if len(order) % 2 == 0 else order[1:] + order[:1]


@lru_cache(maxsize=None)
def _tree_depth(n: int) -> int:
    """The most edges from a position to the root of NCCL's tree over ``n`` positions."""
    deepest = 0
    for i in range(1, n):
        d = 0
        while i:
            i, d = _btree_parent(i, n), d + 1
        deepest = max(deepest, d)
    return deepest


def phases(op: str, algo: str, group: tuple[int, ...], node_of=None, route: tuple = ()) -> list[Expansion]:
    """The phases of ``op`` over ``group`` (GPUs in ring order) by ``algo``, sizes per unit buffer;
    ``route``: a deduplicating dispatch's routing (``deepep``: model.moe.routing)."""
    n = len(group)
    if algo == DEEPEP:
        return [deepep_flows(group, node_of, route)]
    if algo in ("ring", "pxn", "pairwise") or n == 1:
        return [expand(op, group, 1.0, node_of)]
    if algo == "tree":
        # NCCL: one channel per member position l carries S/g; inside a node a chain starting at
        # position l, across nodes two binary trees over the nodes' position-l GPUs, each
        # reducing half of the channel's data up and broadcasting it down. The second tree is
        # the first mirrored or shifted, so a node inner in one is a leaf in the other
        # (Sanders et al. 2009; NCCL's ncclGetDtree).
        nodes = _by_node(group, node_of)
        g = len(nodes[0])
        flows = []
        for pos in range(g):
            # each tree its own pipeline (NCCL gives each tree its own channels): half of the
            # channel's data through the chains inside the nodes, then up and down the tree
            for order, edges in _double_tree(nodes, pos, g):
                for members in nodes:
                    chain = members[pos:] + members[:pos]
                    for a, b in zip(chain, chain[1:]):
                        flows += [(b, a, 0.5 / g), (a, b, 0.5 / g)]
                flows += edges
        depth = _tree_depth(len(nodes))
        # a tree's chains and edges are one pipeline: its chunks pass every hop in turn
        return [Expansion(tuple(flows), 2 * (max(depth, 1) + g - 1), lockstep=2 * g)]
    if algo == "hierarchical":
        nodes = _by_node(group, node_of)
        g = len(nodes[0])
        inside = [expand("reduce_scatter", tuple(m), 1.0, node_of) for m in nodes]
        rails = [expand("all_reduce", tuple(m[i] for m in nodes), 1.0 / g, node_of) for i in range(g)]
        gather = [expand("all_gather", tuple(m), 1.0, node_of) for m in nodes]

        flows = tuple(f for part in (inside, rails, gather) for e in part for f in e.flows)
        return [Expansion(flows, sum(max(e.steps for e in part) for part in (inside, rails, gather)), lockstep=1)]
    if algo == "nvls":  # the switch reduces what every GPU has sent before it multicasts
        return [Expansion(tuple((x, x, 1.0) for x in group), 2, lockstep=1)]
    if algo == "nvls_tree":
        # each node's switch reduces its members' S; channel l's S/g of it goes to the node's
        # position-l GPU, through the trees and back for the switch to multicast
        nodes = _by_node(group, node_of)
        g = len(nodes[0])
        flows = [(x, x, 1.0) for x in group]
        for pos in range(g):
            for _, edges in _double_tree(nodes, pos, g):
                flows += edges
        return [Expansion(tuple(flows), 2 + 2 * max(_tree_depth(len(nodes)), 1), lockstep=1)]
    raise KeyError(f"unknown algorithm {algo!r} for {op}")


def _double_tree(nodes: list[list[int]], pos: int, g: int) -> list[tuple[list[int], list[tuple[int, int, float]]]]:
    """NCCL's two binary trees over the nodes' position-``pos`` GPUs (the second the first
    mirrored or shifted, so that a node inner in one is a leaf in the other), each with its
    edges' flows: half of a channel's ``S/g``, up and down every edge."""
    heads = [members[pos] for members in nodes]
    out = []
    for order in (heads, _second_tree(heads)):
        edges = []
        for child, parent in _tree_edges(order):
            edges += [(child, parent, 0.5 / g), (parent, child, 0.5 / g)]
        out.append((order, edges))
    return out


def deepep_flows(group: tuple[int, ...], node_of, route: tuple) -> Expansion:
    """A MoE dispatch over the EP ``group`` (GPUs in EP rank order) sending each token once
    per node and once per GPU its experts are on, as DeepEP's normal kernels do; sizes are
    shares of the buffer a rank hands in, ``S = T k h`` bytes (one copy per token and expert).

    EP rank ``j`` holds experts ``j E/n .. (j+1) E/n - 1``; a token reaches GPU ``j`` with
    chance ``p_j`` and node ``b`` with chance ``P_b`` (:func:`model.moe.token_reach`). Across
    nodes a token goes once over RDMA to the GPU of the same local index on each node it
    reaches, which forwards it over NVLink to each node-mate whose experts it reaches, as it
    does its own tokens::

        GPU (a, l) -> (b, l)    P_b / k  x S     every other node b (RDMA, same rail)
        GPU (a, l) -> (a, l')   N p / k  x S     every node-mate l': its own tokens and those
                                                 of the N - 1 GPUs (b, l) it forwards

    NCCL's all-to-all sends S/n to each GPU instead (one copy per token and expert), so node b
    gets g k / n copies a token where this sends ``P_b`` <= 1. The forwarding runs with the
    sends, pipelined as DeepEP's chunks are: one phase, two latency rounds. The combine
    returns the same bytes the other way, and where every node and GPU is reached alike (as
    the configuration's checks make sure) its flows are these. A group inside one node, or
    whose nodes hold different numbers of its GPUs (refused by the checks), sends each GPU's
    tokens to it directly (``p_j / k`` x S), deduplicated per GPU only.
    """
    n = len(group)
    experts, top_k, groups, group_top_k = route
    per_gpu = experts // n
    nodes = _by_node(group, node_of)
    at = {g: j for j, g in enumerate(group)}

    def reach(members) -> float:
        held = tuple(e for g in members for e in range(at[g] * per_gpu, (at[g] + 1) * per_gpu))
        return token_reach(experts, top_k, groups, group_top_k, held)

    p_gpu = {g: reach((g,)) for g in group}
    if len(nodes) == 1 or len({len(v) for v in nodes}) > 1:
        flows = tuple((a, b, p_gpu[b] / top_k) for a in group for b in group if a != b)
        return Expansion(flows, 1)
    p_node = [reach(v) for v in nodes]
    flows = []
    for a, members in enumerate(nodes):
        for l, x in enumerate(members):
            flows += [(x, nodes[b][l], p_node[b] / top_k) for b in range(len(nodes)) if b != a]
            flows += [(x, y, len(nodes) * p_gpu[y] / top_k) for y in members if y != x]
    return Expansion(tuple(flows), 2)
