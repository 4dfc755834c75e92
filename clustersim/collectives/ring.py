"""Ring collectives expanded into concurrent flows between ring neighbours.

Ring reduce-scatter and all-gather take n-1 steps; all-reduce is one then the other,
2(n-1) steps, each GPU sending
S/n bytes to its successor per step (Patarasuk & Yuan 2009; NCCL)::

    step:     1      2     ...   n-1  |  n    ...  2(n-1)
    gpu i -> gpu i+1: chunk (i-k) mod n, S/n bytes each step

Each hop, GPU to ring successor, carries 2(n-1)/n * S bytes after a latency of
2(n-1) * alpha. Ring steps are lock-step: a GPU sends chunk k on only once it has received
it, so the slowest hop sets alpha and, with NCCL's few buffered steps, the pace of every hop
of the channel; the engine moves a channel's flows as one (``Expansion.lockstep``). Alone
on its links this is exactly the closed form

    T = 2(n-1) * alpha + 2(n-1)/n * S / B          (nccl-tests doc/PERFORMANCE.md)

and when flows share a link they share its bandwidth.

A ring shift (context parallelism's K/V exchange, ``size_bytes`` = what each rank holds) is
n concurrent flows, each GPU to its ring successor, one latency round: S / B alone.

All-to-all (``size_bytes`` = the buffer each rank hands in) is n(n-1) concurrent flows of S/n
bytes, one latency round: bounded by each GPU's egress, (n-1)/n * S / B alone on its links.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Expansion:
    flows: tuple[tuple[int, int, float], ...]  # (src GPU, dst GPU, bytes)
    steps: int  # latency-bound rounds
    # the flows as this many equal runs, one after the other, each a pipeline whose hops move
    # in lock-step (a ring channel: a GPU forwards a chunk only once it has it, so every hop
    # goes at the slowest hop's pace); 0: every flow on its own (all-to-all pairs, sends)
    lockstep: int = 0


def all_to_all_sources(group: tuple[int, ...], root: int = 0, node_of=None) -> list[tuple[int, list[int]]]:
    """Per source member of an all-to-all, its destinations, in an order that symmetry maps
    onto itself: member ``(node a, local l)`` sends its k-th flow to ``(a + dn, l + dl)``
    (offsets modulo the group's nodes and members per node), so flow k of every source is the
    same kind of transfer (same node or not, same rail offset). Sources start at ``root``.
    Nodes holding different numbers of members fall back to offsets in group order.
    """
    n = len(group)
    by_node: dict[int, list[int]] = {}
    for g in group:
        by_node.setdefault(node_of(g) if node_of else 0, []).append(g)
    nodes = list(by_node.values())
    sizes = {len(v) for v in nodes}
    out = []
    if len(sizes) == 1:
        per = sizes.pop()
        where = {g: (a, i) for a, members in enumerate(nodes) for i, g in enumerate(members)}
        offsets = [(dn, dl) for dn in range(len(nodes)) for dl in range(per) if (dn, dl) != (0, 0)]
        for src in group:
            a, i = where[src]
            out.append((src, [nodes[(a + dn) % len(nodes)][(i + dl) % per] for dn, dl in offsets]))
    else:
        for i, src in enumerate(group):
            out.append((src, [group[(i + k) % n] for k in range(1, n)]))
    return out[root:] + out[:root]


def ring_channels(group: tuple[int, ...], node_of=None) -> list[tuple[int, ...]]:
    """Ring orders, one per channel, so that a ring spanning nodes leaves each node through
    every NIC rather than one.

    NCCL runs several rings (channels) at once, each entering and leaving a node through a
    different GPU and so a different NIC. With g group members per node, channel c rotates
    each node's members by c::

        nodes A = [a0 a1 a2 a3], B = [b0 b1 b2 b3]
        channel 0: a0 a1 a2 a3 | b0 b1 b2 b3 |   A leaves via a3, enters via a0
        channel 1: a1 a2 a3 a0 | b1 b2 b3 b0 |   A leaves via a0, enters via a1 ...

    Each channel carries 1/g of the data. Where nodes hold different numbers of members
    (a group of 12 over nodes of 8: 8 + 4), g is the fewest a node holds: channel c still
    enters and leaves every node by GPUs of its own, so the node of 4 sends through 4 NICs
    and the ring's bandwidth is 4 NICs', not one's (NCCL's ring search likewise finds as many
    rings as the smaller side has GPUs to cross by). One ring when the group lives on one
    node, or some node holds one member.
    """
    if node_of is None:
        return [group]
    by_node: dict[int, list[int]] = {}
    for g in group:
        by_node.setdefault(node_of(g), []).append(g)
    channels = min(len(v) for v in by_node.values())
    if len(by_node) == 1 or channels == 1:
        return [group]
    return [tuple(g for members in by_node.values() for g in members[c:] + members[:c]) for c in range(channels)]


def expand(op: str, group: tuple[int, ...], size_bytes: float, node_of=None) -> Expansion:
    """Flows and latency rounds of ``op`` over ``group`` (GPUs in ring order).

    ``node_of`` (GPU -> node) lets ring collectives use one channel per member per node.
    """
    n = len(group)
    if op == "send":
        src, dst = group
        return Expansion(((src, dst, size_bytes),), 1)
    if n == 1:
        return Expansion((), 0)
    if op == "shift":
        # every member passes its buffer to its successor at once (ring attention's K/V step)
        return Expansion(tuple((group[i], group[(i + 1) % n], size_bytes) for i in range(n)), 1)
    if op == "all_to_all":
        # pairwise exchange, all peers at once (NCCL grouped send/recv): S/n to each other rank
        per = size_bytes / n
        return Expansion(tuple((a, b, per) for a in group for b in group if a != b), 1)
    if op in RING_STEPS:
        steps = RING_STEPS[op](n)
        rings = ring_channels(group, node_of)
        per = steps / n * size_bytes / len(rings)
        return Expansion(tuple((ring[i], ring[(i + 1) % n], per) for ring in rings for i in range(n)), steps,
                         lockstep=len(rings))
    raise KeyError(f"unknown collective {op!r}")


# Ring rounds per collective; each round moves S/n bytes per GPU (nccl-tests PERFORMANCE.md:
# all-reduce 2(n-1)/n S, reduce-scatter and all-gather (n-1)/n S, S the whole buffer).
RING_STEPS = {
    "all_reduce": lambda n: 2 * (n - 1),
    "reduce_scatter": lambda n: n - 1,
    "all_gather": lambda n: n - 1,
}


def ring_allreduce_time_s(size_bytes: float, n: int, bw_Bps: float, alpha_s: float) -> float:
    """Closed form of a ring all-reduce alone on links of bandwidth ``bw_Bps``."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * alpha_s + 2 * (n - 1) / n * size_bytes / bw_Bps
