"""Flow-level network: transfers that share a link share its bandwidth (max-min fair).

Rates are recomputed only when a flow starts or ends (fluid model; Bertsekas & Gallager,
"Data Networks", Sec 6.5.2, progressive filling)::

    every unfrozen flow grows at the same rate until some link is full;
    freeze the flows on that link; repeat.

A representative flow that stands for symmetric twins weighs, on each link the simulated
flows cross, how many of its twins cross it (:func:`_images_on`): k twins there, weight k.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, partial
from itertools import chain, islice
from operator import itemgetter

import numpy as np
import simpy

from ..collectives.algorithms import ALGORITHMS, DEEPEP, DEEPEP_NVLINK_SHARE, phases
from ..floats import sum_left
from ..hardware.topology import Cluster
from ..program.tasks import Comm
from ..trace import index_ranges, stable_argsort, unique


class _At:
    """A triggered event for the engine's own callbacks: what ``Environment.step`` reads of an
    event (its callbacks, then ``_ok``; simpy/core.py), without ``simpy.Event``'s constructor.
    Nothing yields it or adds callbacks to it later: :func:`_call_at` is its only maker."""

    __slots__ = ("callbacks",)
    _ok = True
    _value = None


def _call_at(env: simpy.Environment, at_s: float, callback) -> None:
    """Run ``callback`` when the clock reaches exactly ``at_s`` (>= now). ``env.timeout(at_s -
    now)`` would land on ``now + (at_s - now)``, which can miss ``at_s`` by an ulp; this queues
    a triggered event at ``at_s`` itself, as ``Environment.schedule`` does (simpy/core.py): at
    normal priority, numbered by the environment's event counter, so events at one instant
    run in the order they were queued."""
    at = _new(_At)  # its one field set here: no __init__ frame (two events per flow-timed send)
    at.callbacks = [callback]
    heapq.heappush(env._queue, (at_s, _NORMAL, next(env._eid), at))


_new = object.__new__
_NORMAL = simpy.events.NORMAL
# the live flows of a transfer with none left (shared: index arrays are replaced, never edited)
_NO_FLOWS = np.zeros(0, dtype=np.int64)


# an array's max, min and any as the ufuncs' reductions, called directly: ndarray.max() and
# the others go through a Python wrapper (numpy/_core/_methods.py) that costs more than the
# reduction itself on the few links or flows of a transfer (the same reduction, the same result)
_max, _min, _any = np.maximum.reduce, np.minimum.reduce, np.logical_or.reduce


def _finished(env: simpy.Environment, done) -> None:
    """Fire ``done`` (a transfer's event), or call it (a transfer's callback) by an event now."""
    if isinstance(done, simpy.Event):
        done.succeed()
    else:
        _call_at(env, env.now, lambda _e: done())


@dataclass(frozen=True)
class FlowPlan:
    """A communication's simulated flows: per flow its edge weights and share of the size."""

    weights: tuple[tuple[tuple[int, float], ...], ...]  # per flow: ((edge, weight), ...)
    fractions: tuple[float, ...]  # per flow: bytes / size_bytes, times its wire scale (wire_scales)
    latency_s: float
    # a flow's fraction is its bytes times this: > 1 where an algorithm sustains less of a
    # link's bandwidth than the link's own efficiency allows (NVLS; DeepEP over NVLink)
    wire_scale: float = 1.0
    # where not None, the wire scale of the flows that cross a scale-out link (a NIC), the
    # others' being ``wire_scale``: DeepEP moves a different share of NVLink's and the NICs'
    # bandwidth (:func:`wire_scales`)
    wire_scale_out: float | None = None
    # the links where a real flow of the orbit, or of its siblings, crosses, as sorted link ids:
    # where twins can meet another communication's unseen (Engine._meetings) or the link use
    # counts them (Engine._twins_links). Not part of the plan's value; None where not known
    meet_real: np.ndarray | None = field(default=None, compare=False)
    # False where the orbit's instances meet links of different signatures (plan_phases: the
    # slowest twin sets the pace); an orbit of one instance, which its siblings' make
    # asymmetric, is constrained on its own links only: True. Not part of the plan's value
    orbit_symmetric: bool = field(default=True, compare=False)

    @cached_property  # (a frozen dataclass keeps it in its __dict__; fields alone compare and hash)
    def edges(self) -> frozenset[int]:
        pairs = self.__dict__.get("pairs")
        if pairs is not None:  # read off the arrays when they are there (a plan made on arrays):
            edge = pairs[1]  # each link once (an orbit's flows share most of theirs), by a count
            return frozenset((np.flatnonzero(np.bincount(edge)) if len(edge) > 1024 else edge).tolist())
        return frozenset(map(itemgetter(0), chain.from_iterable(self.weights)))

    @property
    def pairs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``weights`` as arrays (:func:`_pairs`): links per flow, then every (link, weight)
        pair's link and weight, flow by flow. A plan worked out on arrays is given them as it
        is made (:func:`with_pairs`; an all-to-all over 16,384 GPUs has 10⁶ pairs, which cost
        a second to read back out of the tuples); another has them read off its tuples at
        each ask, not kept (a step's plans would hold them all for the whole run)."""
        got = self.__dict__.get("pairs")
        return got if got is not None else _pairs(self.weights)


def with_pairs(plan: FlowPlan, pairs: tuple[np.ndarray, np.ndarray, np.ndarray] | None) -> FlowPlan:
    """``plan`` with its :attr:`FlowPlan.pairs` given (None: left to be read off its weights),
    kept in its ``__dict__`` as a cached property's value is (a frozen dataclass's fields alone
    compare and hash)."""
    if pairs is not None:
        plan.__dict__["pairs"] = pairs
    return plan


def _scaled(plan: FlowPlan, scale: float, scale_out: float | None = None) -> FlowPlan:
    """``plan`` with ``wire_scale`` ``scale`` (and ``wire_scale_out``), its weights and their
    arrays as they are."""
    return with_pairs(dataclasses.replace(plan, wire_scale=scale, wire_scale_out=scale_out),
                       plan.__dict__.get("pairs"))


def wire_scales(plan: FlowPlan, nvlink_mask: np.ndarray) -> float | np.ndarray:
    """What a flow's fraction is over the bytes it puts on each link it crosses, per (flow,
    link) pair in :attr:`FlowPlan.pairs` order: ``wire_scale``, or, where ``wire_scale_out``
    is set, ``wire_scale`` on NVLink (``nvlink_mask``, over the cluster's links) and
    ``wire_scale_out`` elsewhere. By link, not by flow: a pipeline made one flow
    (:func:`_in_lockstep`) joins hops of both kinds (NVLSTree: its NVLS loops, at NVLS's
    share of NVLink's rate, and its trees' hops over the NICs, at theirs); DeepEP's flows
    are each of one kind (to a node-mate over NVLink, to another node over its NICs)."""
    if plan.wire_scale_out is None:
        return plan.wire_scale
    _, edge, _ = plan.pairs
    return np.where(nvlink_mask[edge], plan.wire_scale, plan.wire_scale_out)


def plan_flows(cluster: Cluster, comm: Comm) -> FlowPlan:
    """The single phase of ``comm`` by its default algorithm (ring, pairwise); see :func:`plan_phases`."""
    (plan,) = plan_phases(cluster, comm, ALGORITHMS[comm.op][0])
    return plan


def plan_phases(cluster: Cluster, comm: Comm, algo: str = "ring", siblings: tuple = (),
                shared: dict | None = None, kept: dict | None = None,
                route: tuple = ()) -> tuple[FlowPlan, ...]:
    """Expand ``comm`` (and its twins) by ``algo`` into phases of weighted flows on graph paths.

    Flow i of the simulated instance stands for flow i of every twin instance (its orbit).
    When every twin's flow i meets the same links (bandwidth, latency, how many of this
    communication's flows share each) the orbit is symmetric: every flow i moves at one rate,
    and each link the simulated flows cross holds them as it holds the real flows, flow i
    weighing how many instances' flow i cross it, whether or not the simulated flow i does
    (:func:`_images_on`), which is exact. Otherwise (a twin crosses a spine
    the simulated one does not, say) the orbit's members are assumed to move at one rate and
    the simulated flow is constrained on every link any member crosses, with weight = members
    crossing it, and the orbit's worst latency: the slowest twin sets the pace.

    ``siblings``: the other orbits of the same communication where the symmetry classes split
    it (lower.Symmetry.siblings; each orbit's simulated instance first). Their flows count as
    the communication's: the test is then over every instance of every orbit, and a
    symmetric orbit weighs its own instances' flows on every link the simulated flows of all
    of them cross (each orbit its own, so that a link holds every real flow once). A twin
    that meets a sibling's twin on a spine neither simulated instance crosses makes the
    orbits asymmetric, so that both are constrained there::

        EP index 0's orbit   dp0 ->  (spine 3)      dp2 -> (spine 7)
        EP index 1's orbit   dp1 ->  (spine 5)      dp3 -> (spine 7)     spine 7 carries two

    What every orbit of the communication shares (the routes of all its instances, the real
    and the simulated flows on each link, whether they are symmetric: :func:`_coarse_rows`)
    is worked out once into ``shared`` (the engine's), not once per orbit: a stage-to-stage
    send at 16,384 GPUs with a slow GPU is 1,024 instances in 16 orbits.

    ``kept``: where each phase crosses a link, it keeps its maker (phase -> (make, wire
    scale)), from which :func:`with_meetings` makes it again with the links, none of them on the simulated
    instance's paths, where its twins meet another communication's (Engine._meetings),
    routing nothing again. A symmetric orbit's simulated
    flow k is then also constrained there, weighing how many instances' flow k cross each:
    the other communication's flows are constrained there too, and the two share the link
    as those twins do (the orbit moves at the pace of its twin slowed there)::

        simulated flow k   own links (its images there)   + spine3 (2: twins a', a'' cross it)

    ``route``: a deduplicating dispatch's routing (``algo`` deepep; the program's ``routing``).
    """
    node_of = cluster.node_of
    own_groups = (comm.group, *comm.twins)
    sibling_groups = tuple(g for orbit in siblings for g in orbit)
    per_group = {g: phases(comm.op, algo, g, node_of, route) for g in own_groups}
    n_phases = len(per_group[comm.group])
    keys: list = [None] * n_phases  # per phase, where it is kept in ``shared``
    if siblings and shared is not None:
        everyone = tuple(sorted(own_groups + sibling_groups))
        keys = [(comm.op, algo, k, comm.load, everyone) for k in range(n_phases)]
    if siblings and (shared is None or any(key not in shared for key in keys)):
        per_group.update((g, phases(comm.op, algo, g, node_of, route)) for g in sibling_groups)
    scale, scale_out = 1.0, None
    if algo == "nvls":
        scale = cluster.nvls_wire_scale
    if algo == "nvls_tree":  # NVLS's share of NVLink's rate for the loops, the NICs' own across nodes
        scale, scale_out = cluster.nvls_wire_scale, 1.0
    if algo == DEEPEP:  # DeepEP's kernels: their own share of NVLink's, the NICs' own across nodes
        scale, scale_out = 1.0 / DEEPEP_NVLINK_SHARE, 1.0
    out = []
    for k in range(n_phases):
        if comm.load:  # (the dedup chances of a skewed dispatch saturate: _loaded)
            flows_of = {g: _loaded(tuple(ph[k].flows), g, *comm.load, node_of if algo == DEEPEP else None,
                                   route[1] if algo == DEEPEP else 0) for g, ph in per_group.items()}
        else:
            flows_of = {g: tuple(ph[k].flows) for g, ph in per_group.items()}
        if scale_out is not None:
            flows_of = {g: tuple((a, b, x * (scale if node_of(a) == node_of(b) else scale_out)) for a, b, x in flows)
                        for g, flows in flows_of.items()}
        elif scale != 1.0:  # (the flows' shares are floats: x * 1.0 is x)
            flows_of = {g: tuple((a, b, x * scale) for a, b, x in flows) for g, flows in flows_of.items()}
        keep = None if kept is None else partial(_keep, kept, k, scale, scale_out)
        plan = _plan_phase(cluster, comm, flows_of, per_group[comm.group][k].steps, (comm.op, algo) in MEMBER_SYMMETRIC,
                           direct=algo == "pairwise", siblings=siblings, shared=shared, key=keys[k], keep=keep,
                           lockstep=per_group[comm.group][k].lockstep)
        out.append(_merged(_scaled(plan, scale, scale_out)))
    return tuple(out)


def _merged(plan: FlowPlan) -> FlowPlan:
    """``plan`` with the flows that cross the same links with the same weights and carry the
    same share merged into one, its weights times their count: max-min cannot tell such flows
    apart, so they get one rate and end together, and one flow of weight m stands for m of
    them as a simulated flow stands for its twins. Hop by hop, a tree all-reduce over the GPUs
    of many 72-GPU racks ran g - 1 of its g chains over every NVLink hop inside a rack (9,504
    flows, of which 1,404 differed); its pipelines, each one flow in lock-step
    (:func:`_in_lockstep`), merge the same way where they cross the same links (its two trees
    over two nodes)."""
    first: dict[tuple, list[int]] = {}
    for i, key in enumerate(zip(plan.weights, plan.fractions)):
        first.setdefault(key, []).append(i)
    if len(first) == len(plan.weights):
        return plan
    weights = tuple(ws if len(at) == 1 else tuple((e, w * len(at)) for e, w in ws) for (ws, _), at in first.items())
    return dataclasses.replace(plan, weights=weights, fractions=tuple(f for _, f in first))


def _keep(kept: dict, k: int, scale: float, scale_out: float | None, make: Callable) -> None:
    kept[k] = (make, scale, scale_out)


def with_meetings(kept: tuple, links: np.ndarray) -> FlowPlan:
    """The phase kept by :func:`plan_phases`, its simulated flows also constrained on the
    links ``links`` where its twins meet another communication's."""
    make, scale, scale_out = kept
    return _merged(_scaled(make(links), scale, scale_out))


def _loaded(flows: tuple, group: tuple[int, ...], by_src: bool, factors: tuple[float, ...], node_of=None,
            top_k: int = 0) -> tuple:
    """A skewed all-to-all's flows (``Comm.load``): the flow from group position i to j carries
    its balanced bytes times ``factors[j]`` (tokens to the experts of j), or ``factors[i]``
    when ``by_src`` (tokens coming back from the experts of i).

    ``node_of`` (a deduplicating dispatch, ``top_k`` experts a token): a flow carries the
    share ``P`` of tokens that reach a node or GPU (``collectives.algorithms.deepep_flows``),
    and ``f`` times the balanced copies reach it at ``1 - (1 - P)^f`` (each token's chance to
    miss it raised to ``f``, as for Poisson copies; never past every token once): ``f`` the
    end's GPU's factor for a flow inside a node (its own tokens and the ``N`` forwarded:
    ``N P / k``), the mean of its node's GPUs' for a flow between nodes (``P / k``)."""
    pos = {x: i for i, x in enumerate(group)}
    if node_of is None:
        return tuple((a, b, x * factors[pos[a] if by_src else pos[b]]) for a, b, x in flows)
    on: dict[int, list[float]] = {}
    for x, f in zip(group, factors):
        on.setdefault(node_of(x), []).append(f)
    mean = {k: sum_left(v) / len(v) for k, v in on.items()}
    nodes = len(on)

    def loaded(a: int, b: int, x: float) -> float:
        end = a if by_src else b
        inside = node_of(a) == node_of(b)
        f, per = (factors[pos[end]], nodes) if inside else (mean[node_of(end)], 1)
        reach = x * top_k / per  # the chance a token reaches the end, balanced
        return (1.0 - (1.0 - reach) ** f) * per / top_k

    return tuple((a, b, loaded(a, b, x)) for a, b, x in flows)


def _route(cluster: Cluster, direct: bool = False):
    """Edge ids from GPU to GPU; a flow from a GPU to itself is its loop through its NVSwitch
    (NVLS). NCCL forwards a transfer between GPUs on different rails through the sender's
    node-mate on the receiver's rail (PXN): a ring channel then enters and leaves every node
    through one NIC."""
    def route(src: int, dst: int) -> tuple[int, ...]:
        if src == dst:
            return _loop_edges(cluster, src)
        return cluster.path(src, dst) if direct else cluster.pxn_path(src, dst)

    return route


def _loop_edges(cluster: Cluster, gpu: int) -> tuple[int, int]:
    """A GPU's loop through its NVSwitch (an NVLS flow from the GPU to itself)."""
    names, index = cluster.gpu_names, cluster.edge_index
    sw = cluster.graph.nodes[names[gpu]]["switch"]
    return (index[(names[gpu], sw)], index[(sw, names[gpu])])


def _route_rows(cluster: Cluster, src: np.ndarray, dst: np.ndarray, direct: bool) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_route` of every pair ``(src[i], dst[i])`` (distinct pairs), as rows of edge ids
    padded with -1, and their lengths. A PXN route is two legs, to the proxy and from it,
    and many pairs share each leg (the proxy depends on the source's node, not the source):
    each distinct leg is routed once, by the cluster's ``paths`` (``path`` on arrays)::

        n0.gpu2 -> n1.gpu5:   path(n0.gpu2, n0.gpu5) + path(n0.gpu5, n1.gpu5)
        n0.gpu3 -> n1.gpu5:   path(n0.gpu3, n0.gpu5) + (the same second leg)
    """
    n_gpu = len(cluster.gpu_names)  # pair keys: src * n_gpu + dst
    via = np.full(len(src), -1, dtype=np.int64) if direct else cluster.pxn_proxies(src, dst)
    two = via >= 0
    legs1, inv1 = np.unique(src * n_gpu + np.where(two, via, dst), return_inverse=True)
    m1, l1 = cluster.paths(legs1 // n_gpu, legs1 % n_gpu)
    loops = np.flatnonzero(legs1 // n_gpu == legs1 % n_gpu)  # a GPU to itself: its NVSwitch loop (NVLS)
    if len(loops):
        if m1.shape[1] < 2:
            m1 = np.hstack([m1, np.full((len(m1), 2 - m1.shape[1]), -1, dtype=np.int64)])
        m1[loops, :2] = [_loop_edges(cluster, g) for g in (legs1[loops] // n_gpu).tolist()]
        l1[loops] = 2
    rows1, lens = m1[inv1.ravel()], l1[inv1.ravel()]
    if not two.any():
        return rows1, lens
    legs2, inv2 = np.unique(via[two] * n_gpu + dst[two], return_inverse=True)
    m2, l2 = cluster.paths(legs2 // n_gpu, legs2 % n_gpu)
    out = np.full((len(src), rows1.shape[1] + m2.shape[1]), -1, dtype=np.int64)
    out[:, :rows1.shape[1]] = rows1
    at = np.flatnonzero(two)
    out[at[:, None], lens[at][:, None] + np.arange(m2.shape[1])] = m2[inv2.ravel()]
    lens = lens.copy()
    lens[at] += l2[inv2.ravel()]
    return out, lens


# the most pairs fault_crossers routes (about 0.2 s); past that, faults keep every GPU they
# marked (a what-if list of hundreds of faulty nodes)
FAULT_PAIRS_ROUTED = 250_000
# the most pairs fault_reach routes (every pair of every kind of group, reach_pairs:
# moe_1024gpu's 164,864 in 0.08 s); past that (deepseek_v3_2048gpu's 432,128,
# llama3_405b_16k's 2.5 million), only the GPUs the faults marked are asked
REACH_PAIRS_ROUTED = 250_000


def fault_crossers(cluster: Cluster, groups: list[np.ndarray], faults: list) -> set[int]:
    """Of the GPUs ``faults`` marked (``cluster.fault_cables`` or ``fabric_fault_cables``:
    (u, v, removed, GPUs) each), those whose traffic the faults touch under a plan whose
    communication groups are ``groups`` (rows of ranks; rank r runs on GPU r): a flow of
    theirs crosses a degraded cable or shares a link with a flow that does. Every ordered
    pair of a group's members with a marked GPU in it is routed as any algorithm may route
    it (directly, through a PXN proxy, a GPU's NVLS loop), a removed fault's GPUs' pairs too
    (after a removal a route may go down through a third leaf and cross a degraded cable
    that neither end is below). A removed cable or switch keeps all the GPUs it marked: its
    flows took other paths, which no route now shows; so do faults whose GPUs have more than
    ``FAULT_PAIRS_ROUTED`` pairs to route. The other GPUs the faults marked take the links
    their twins' take and meet no slowed flow there (GPUs the faults did not mark are not
    asked, as before: docs/architecture.md, Known limitations)::

        n0.nic5-leaf0.5 at half bandwidth, TP8 x PP x DP on rails (NIC k to the rail-k leaf):
          n0.gpu5 -> n8.gpu5          nic5, then rail 5          crosses: marked
          n0.gpu4 -> n8.gpu4          nic4, then rail 4          apart from it: not marked
        the same cable where all 8 NICs share one leaf (Llama 3's Clos):
          n0.gpu4 -> n8.gpu4          nic4, leaf, spine          beside n0.gpu5's flows on
                                                                 the leaf's uplinks: marked
        an NVLink cable, n0.gpu5-n0.nvsw: every TP peer of GPU 5 crosses it
        leaf0.5-spine3 at half bandwidth, the same plan: the rail-5 GPUs below leaf0.5 whose
        flows ECMP hashes onto it or beside those
    """
    out = set().union(*(gpus for _, _, removed, gpus in faults if removed))
    asked = set().union(*(gpus for *_, removed, gpus in faults if not removed)) - out
    if not asked:
        return out
    routed = np.fromiter(sorted(g for g in asked | out if g < cluster.num_gpus), dtype=np.int64)
    bad = _degraded_edges(cluster, faults)
    keys = _pairs_with(groups, routed, cluster.num_gpus)
    if keys is None:
        return out | asked  # (hundreds of faulty nodes: all they marked)
    keys.append(routed * (cluster.num_gpus + 1))
    src, dst = _pair_ends(cluster, keys)
    routes = _pair_routes(cluster, src, dst)
    slowed = _links_of(routes, [np.isin(rows, bad).any(axis=1) for rows, _ in routes])  # every link a crossing flow takes
    ends = _meeting_ends(routes, slowed, src, dst)
    return out | (asked & set(ends))


def straggler_mates(cluster: Cluster, groups: list[np.ndarray], slow: list[int]) -> dict[int, list[int]]:
    """Per slow GPU of ``slow``, the other GPUs of its node whose own traffic meets the slow
    GPU's on their node's shared links, under a plan whose communication groups are
    ``groups`` (rows of ranks; rank r runs on GPU r): a flow of theirs to a GPU other than
    the slow one crosses the NIC's cable to its leaf that a flow to or from the slow GPU
    crosses. Pairs are routed directly, as a flow of a GPU's own leaves by its own NIC
    (PXN proxies carry other GPUs' flows over every NIC of a node alike; a flow to the slow
    GPU is in one of its groups, which the classes split around it anyway); past
    ``FAULT_PAIRS_ROUTED`` pairs, every other GPU on its NIC. The slow GPU's flows start
    and end later than its twins' elsewhere, so a GPU whose flows share such a link with
    them runs beside a flow its twins on other nodes do not meet
    (config.Scenario.straggler_mates)::

        one NIC a node, TP1 x PP2 x DP32, n4.gpu6 slow (stage 1):
          n4.gpu0 -> n0.gpu0          n4.nic0 and its cable          beside n4.gpu6 -> n0.gpu6,
                                                                     which leaves late: a mate
          n5.gpu0 -> n1.gpu0          n5.nic0 and its cable          its twin: beside eight
                                                                     flows that leave together
        eight NICs a node: each GPU's flows leave by its own NIC, and no GPU meets the slow
        one's on its node's links: none
    """
    out: dict[int, list[int]] = {}
    per, n_gpu = cluster.gpus_per_node, cluster.num_gpus
    nodes = cluster.graph.nodes
    # per link, the node whose link several of its GPUs' flows share (a NIC's cable to its
    # leaf), else -1: the fabric's, and a GPU's own (its NVLink port, its PCIe lane to its
    # NIC), which carry no flow of a mate but those to or from that GPU, in groups the
    # classes split around the slow GPU as they need (program/lower.py)
    edge_node = np.array([-1 if "gpu" in (nodes[u].get("kind"), nodes[v].get("kind"))
                          else nodes[u].get("node", nodes[v].get("node", -1)) for u, v in cluster.edges], dtype=np.int64)
    names = cluster.gpu_names
    for g in slow:
        node = np.arange(g // per * per, min((g // per + 1) * per, n_gpu), dtype=np.int64)
        # the node's GPUs on the slow one's NIC: none of the others' own flows leave by it
        on_nic = [x for x in node.tolist() if x != g and nodes[names[x]].get("nic") == nodes[names[g]].get("nic")]
        if not on_nic:
            out[g] = []
            continue
        keys = _pairs_with(groups, node, n_gpu)
        if keys is None:
            out[g] = on_nic  # (too many pairs to route: those its NIC carries)
            continue
        if not keys:
            out[g] = []
            continue
        src, dst = _pair_ends(cluster, keys)  # (a GPU's pair with itself, an NVLS loop, crosses no NIC cable)
        rows = _route_rows(cluster, src, dst, True)[0]
        its = (src == g) | (dst == g)
        links = np.unique(rows[its].ravel())
        links = links[links >= 0]
        links = links[edge_node[links] == g // per]
        meets = ~its & np.isin(rows, links).any(axis=1)
        ends = np.concatenate([src[meets], dst[meets]])
        out[g] = sorted(set(ends[np.isin(ends, node)].tolist()) - {g})
    return out


def _pairs_with(groups: list[np.ndarray], gpus: np.ndarray, n_gpu: int) -> list[np.ndarray] | None:
    """The keys (``src * n_gpu + dst``) of every ordered pair of a group's members with one of
    ``gpus`` in it, both ways (:func:`fault_crossers`, :func:`straggler_mates`); None past
    ``FAULT_PAIRS_ROUTED`` pairs."""
    marked = [np.isin(rows, gpus) for rows in groups]
    if sum(2 * int(m.sum()) * m.shape[1] for m in marked) > FAULT_PAIRS_ROUTED:
        return None
    keys = []
    for rows, m in zip(groups, marked):
        for i in np.flatnonzero(m.any(axis=1)).tolist():  # its marked members with every member, both ways
            f = rows[i][m[i]][:, None]
            keys += [(f * n_gpu + rows[i]).ravel(), (rows[i] * n_gpu + f).ravel()]
    return keys


def _degraded_edges(cluster: Cluster, faults: list) -> np.ndarray:
    """The edge ids of ``faults``' degraded cables, both ways (a degraded cable a later entry
    removed is gone)."""
    index = cluster.edge_index
    return np.fromiter((index[e] for u, v, removed, _ in faults if not removed for e in ((u, v), (v, u))
                        if e in index), dtype=np.int64)


def _pair_ends(cluster: Cluster, keys: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(sources, destinations) of the distinct pair keys ``src * GPUs + dst`` in ``keys``,
    without a GPU's pair with itself where it has no NVSwitch to loop through (a node of one
    GPU): its NVLS loop is the only route such a pair has."""
    n_gpu = cluster.num_gpus
    keys = np.unique(np.concatenate(keys))
    src, dst = keys // n_gpu, keys % n_gpu
    names, nodes = cluster.gpu_names, cluster.graph.nodes
    switched = np.fromiter((nodes[g].get("switch") is not None for g in names), bool, n_gpu)
    keep = (src != dst) | switched[src]
    return src[keep], dst[keep]


def _pair_routes(cluster: Cluster, src: np.ndarray, dst: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each pair ``(src[i], dst[i])`` as PXN routes it, and directly where a proxy makes the
    two differ (elsewhere the direct route is the same one): (rows of edge ids, the pairs
    they route) twice."""
    proxied = np.flatnonzero(cluster.pxn_proxies(src, dst) >= 0)
    return [(_route_rows(cluster, src, dst, False)[0], np.arange(len(src))),
            (_route_rows(cluster, src[proxied], dst[proxied], True)[0], proxied)]


def _links_of(routes: list[tuple[np.ndarray, np.ndarray]], chosen: list[np.ndarray]) -> np.ndarray:
    """Every link the routes ``chosen`` (a mask of each set of :func:`_pair_routes`) take."""
    links = np.unique(np.concatenate([rows[m].ravel() for (rows, _), m in zip(routes, chosen)]))
    return links[links >= 0]


def _meeting_ends(routes: list[tuple[np.ndarray, np.ndarray]], links: np.ndarray, src: np.ndarray,
                  dst: np.ndarray) -> list[int]:
    """The GPUs at either end of a pair some route of which takes one of ``links``."""
    touched = np.concatenate([pair[np.isin(rows, links).any(axis=1)] for rows, pair in routes])
    return np.unique(np.concatenate([src[touched], dst[touched]])).tolist()


def distinct_groups(groups: list[np.ndarray]) -> list[np.ndarray]:
    """Each kind of group once, its rows sorted (edp is cp+dp where no expert splits them)."""
    return list({(rows.shape, rows.tobytes()): rows for rows in (np.sort(r, axis=1) for r in groups)}.values())


def reach_pairs(groups: list[np.ndarray]) -> int:
    """The ordered pairs :func:`fault_reach` routes for ``groups`` (:func:`distinct_groups`),
    each GPU with itself included: what ``REACH_PAIRS_ROUTED`` bounds."""
    return _pair_count(distinct_groups(groups))


def _pair_count(distinct: list[np.ndarray]) -> int:
    return sum(rows.shape[0] * rows.shape[1] ** 2 for rows in distinct)


def fault_reach(cluster: Cluster, groups: list[np.ndarray], faults: list) -> set[int] | None:
    """Every GPU whose traffic ``faults`` (node and fabric ones: (u, v, removed, GPUs) each)
    touch under a plan whose communication groups are ``groups``, on any node: a flow of
    theirs crosses a degraded cable, or shares a link with a flow that does or with a flow
    of a GPU a removed cable or switch marked (its flows took other paths, which now load
    the links they take). Every ordered pair of every group is routed as any algorithm may
    route it, as in :func:`fault_crossers`, which asks only the GPUs the faults marked; None
    past ``REACH_PAIRS_ROUTED`` pairs. What it adds to those: on Llama 3's Clos, where a
    node's eight NICs share a leaf, a NIC cable at half bandwidth slows flows on the leaf's
    uplinks and on the spines' downlinks to it, which flows of the leaf's other node and of
    GPUs on other leaves take too::

        n7.nic7-leaf3.0 at half bandwidth, TP2 x PP2 x DP16 on 8 nodes (2 a leaf):
          n7.gpu7 -> n4.gpu7        nic7, leaf3, spine s, leaf2     crosses it
          n6.gpu3 -> n5.gpu3        nic3, leaf3, spine s, leaf2     meets it where ECMP picks s too
          n3.gpu7 -> n7.gpu7        leaf1, spine t, leaf3, nic7     crosses it
          n2.gpu1 -> n6.gpu1        leaf1, spine t, leaf3           meets it where ECMP picks t too
    """
    n_gpu = cluster.num_gpus
    groups = distinct_groups(groups)
    if _pair_count(groups) > REACH_PAIRS_ROUTED:
        return None
    bad = _degraded_edges(cluster, faults)
    moved = np.fromiter(sorted(set().union(*(gpus for *_, removed, gpus in faults if removed))), dtype=np.int64)
    keys = [np.arange(n_gpu) * (n_gpu + 1)]  # (each GPU to itself: its NVLS loop)
    for rows in groups:
        keys.append((rows[:, :, None] * n_gpu + rows[:, None, :]).ravel())
    src, dst = _pair_ends(cluster, keys)
    routes = _pair_routes(cluster, src, dst)
    changed = [np.isin(rows, bad).any(axis=1) | np.isin(src[pair], moved) | np.isin(dst[pair], moved)
               for rows, pair in routes]
    return set(_meeting_ends(routes, _links_of(routes, changed), src, dst)) | set(moved.tolist())


def _plan_phase(cluster: Cluster, comm: Comm, flows_of: dict, steps: int, member_symmetric: bool,
                direct: bool = False, siblings: tuple = (), shared: dict | None = None, key=None,
                keep: Callable | None = None, lockstep: int = 0) -> FlowPlan:
    """One phase's plan, from each instance's flows (``flows_of[group]``); ``direct``: no PXN;
    ``siblings``: see :func:`plan_phases`, with ``shared[key]`` what all their orbits share
    (:func:`_coarse_rows`), read if there, else kept there when the plan is made on arrays;
    ``keep(make)``: called with the plan's maker, ``make(links)`` being the plan with its
    twins' meetings on those links, made from what it was weighed from (nothing
    routed again); ``lockstep``: its pipelines
    (``Expansion.lockstep``), each made one flow by :func:`_in_lockstep`. A plan of whole
    instances has the simulated instance's flows in order, pipeline after pipeline; one of a
    member's flows (symmetric member by member) stands for every member's, so the pipelines,
    rotations of one another there, are one."""
    whole = len(flows_of[comm.group]) // lockstep if lockstep else 0
    member = ALL_ONE if lockstep else 0
    keep_whole, keep_member = _keep_in_lockstep(keep, whole), _keep_in_lockstep(keep, member)
    node_of = cluster.node_of
    route = _route(cluster, direct)
    # whole instances: the simulated one and its twins
    instances = [flows_of[g] for g in (comm.group, *comm.twins)]
    real_flows = [f for inst in instances for f in inst]
    if siblings:  # then the siblings' instances after them, each orbit's simulated one first
        own = len(instances)
        co = shared.get(key) if key is not None else None
        if co is not None:
            return _in_lockstep(_weigh_sibling_rows(cluster, instances, steps, co, keep=keep_whole), whole)
        sims = [0]
        for orbit in siblings:
            sims.append(len(instances))
            instances += [flows_of[g] for g in orbit]
        real_flows = [f for inst in instances for f in inst]
        # on arrays from fewer flows than alone: what they work out is kept for every orbit
        if len(real_flows) >= ROWS_MIN_FLOWS // 16 and len({len(inst) for inst in instances}) == 1:
            src, dst = _flow_ends(real_flows)
            rows = np.arange(len(real_flows)).reshape(len(instances), -1)
            co, _ = _coarse_rows(cluster, src, dst, rows, sims, direct)
            if key is not None:
                shared[key] = co
            return _in_lockstep(_weigh_sibling_rows(cluster, instances[:own], steps, co, keep=keep_whole), whole)
        return _in_lockstep(_weigh(cluster, route, instances, real_flows, steps, own=own, sims=sims, keep=keep_whole),
                            whole)
    symmetric_members = member_symmetric and len(comm.members) == 1 and comm.members[0] in comm.group \
        and _regular(comm.group, node_of)
    if len(real_flows) >= ROWS_MIN_FLOWS:  # the same on arrays
        # every real flow's ends, read once for the member sort and the orbit check
        src, dst = _flow_ends(real_flows)
        rows = _by_member_rows(comm, node_of, flows_of, src, dst) if symmetric_members else None
        if rows is not None:
            plan = _weigh_rows(cluster, real_flows, src, dst, rows, steps, require_symmetric=True, direct=direct,
                               keep=keep_member)
            if plan is not None:
                return _in_lockstep(plan, member)
            symmetric_members = False  # not symmetric member by member: as whole instances
        if not symmetric_members and len({len(inst) for inst in instances}) == 1:
            rows = np.arange(len(real_flows)).reshape(len(instances), -1)
            return _in_lockstep(_weigh_rows(cluster, real_flows, src, dst, rows, steps, direct=direct, keep=keep_whole),
                                whole)
    if symmetric_members:
        # one member's flows stand for all (much smaller), when that symmetry holds
        plan = _weigh(cluster, route, _by_member(comm, node_of, flows_of), real_flows, steps, require_symmetric=True,
                      keep=keep_member)
        if plan is not None:
            return _in_lockstep(plan, member)
    return _in_lockstep(_weigh(cluster, route, instances, real_flows, steps, keep=keep_whole), whole)


# :func:`_in_lockstep`'s size for every flow of a plan in one pipeline
ALL_ONE = -1


def _in_lockstep(plan: FlowPlan, size: int) -> FlowPlan:
    """``plan`` with each run of ``size`` flows (0: none; ALL_ONE: all of them) made one flow:
    a pipeline whose hops move in lock-step (``Expansion.lockstep``), as one flow crossing
    all their links. Per unit of progress a hop moves its own share, so each link weighs the
    hop's weight times its share over the pipeline's largest, which the flow carries; a link
    two hops cross weighs both. Every link carries the bytes it did, and alone the pipeline
    takes what its busiest link needs: the closed form (Engine._closed_form_s) is then what
    the flow network gives it alone. (Hop by hop it was the slowest hop's time at its first
    fair share, which the network's re-shares could beat where hops of different shares met
    on a link: a tree or hierarchical all-reduce over GPUs at different positions in their
    nodes, a PXN hop through a node-mate beside a chain, was up to 21 % apart.)::

        ring channel   a -> b -> c -> a      each hop x S, on its links   ab   bc   ca
        hop by hop     three flows           ab shared with 2 others:    C/3  C    C
        in lock-step   one flow over ab bc ca                            C/3  C/3  C/3
                       bc and ca left to others: no hop forwards a chunk it has not had

    Hop by hop, a hop on a free link ran ahead and ended early; a ring (NCCL's few slots of
    buffering) cannot, and its other hops' bandwidth goes to whatever else shares them.
    """
    n = len(plan.weights)
    size = n if size == ALL_ONE else size
    if size <= 1 or n <= 1:
        return plan
    fractions = tuple(max(plan.fractions[at:at + size]) for at in range(0, n, size))
    given = plan.__dict__.get("pairs")
    if given is not None and len(given[1]) >= LOCKSTEP_ARRAY_PAIRS:
        weights, pairs = _lockstep_pairs(given, plan.fractions, fractions, size)
        return with_pairs(FlowPlan(weights=weights, fractions=fractions, latency_s=plan.latency_s,
                                    wire_scale=plan.wire_scale, wire_scale_out=plan.wire_scale_out,
                                    meet_real=plan.meet_real, orbit_symmetric=plan.orbit_symmetric), pairs)
    weights = []
    for at, top in zip(range(0, n, size), fractions):
        on: dict[int, float] = {}
        for ws, x in zip(plan.weights[at:at + size], plan.fractions[at:at + size]):
            scale = x / top if top > 0 else 1.0
            for e, w in ws:
                on[e] = on.get(e, 0.0) + w * scale
        weights.append(tuple(sorted(on.items())))
    return FlowPlan(weights=tuple(weights), fractions=fractions, latency_s=plan.latency_s,
                    wire_scale=plan.wire_scale, wire_scale_out=plan.wire_scale_out, meet_real=plan.meet_real,
                    orbit_symmetric=plan.orbit_symmetric)


# pairs from which :func:`_in_lockstep` sums a plan's weights on its arrays: the DP trees
# over 2,048 replicas of the dense plan at 65,536 GPUs, whose twins cross every spine, took
# 0.5 s in the loop
LOCKSTEP_ARRAY_PAIRS = 4096


def _lockstep_pairs(pairs: tuple[np.ndarray, np.ndarray, np.ndarray], shares: tuple, tops: tuple, size: int
                    ) -> tuple[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """:func:`_in_lockstep`'s weights from the plan's (flow, link) pairs (:attr:`FlowPlan.pairs`):
    the same products, summed per (pipeline, link) in the same order (``np.bincount`` adds its
    weights in input order, flow by flow as the loop does), so the same bits; and the new
    plan's pairs."""
    sizes, edge, w = pairs
    n = len(sizes)
    flow = np.repeat(np.arange(n), sizes)
    top = np.repeat(np.asarray(tops, dtype=np.float64), size)[:n]
    x = np.asarray(shares, dtype=np.float64)
    scale = np.ones(n)
    np.divide(x, top, out=scale, where=top > 0)
    n_links = int(edge.max()) + 1 if len(edge) else 1
    key = (flow // size) * n_links + edge
    cells, at = np.unique(key, return_inverse=True)  # by pipeline, then by link
    summed = np.bincount(at, weights=w * scale[flow], minlength=len(cells))
    run, link = np.divmod(cells, n_links)
    per_run = np.bincount(run, minlength=len(tops))
    return _per_flow(link.tolist(), summed.tolist(), per_run), (per_run, link, summed)


def _keep_in_lockstep(keep: Callable | None, size: int) -> Callable | None:
    """``keep`` (see :func:`_plan_phase`) given a maker whose plans are made in lock-step."""
    if keep is None or not size:
        return keep
    return lambda make: keep(partial(_made_in_lockstep, make, size))


def _made_in_lockstep(make: Callable, size: int, links: np.ndarray) -> FlowPlan:
    return _in_lockstep(make(links), size)


def _flow_ends(flows: list) -> tuple[np.ndarray, np.ndarray]:
    """The (src, dst) GPUs of ``flows`` ((src, dst, share) each), as two arrays."""
    return (np.fromiter(map(itemgetter(0), flows), np.int64, len(flows)),
            np.fromiter(map(itemgetter(1), flows), np.int64, len(flows)))


# real flows from which the orbit check runs on arrays (:func:`_weigh_rows`): below, the
# dictionaries of :func:`_weigh` are faster than numpy's per-call costs
ROWS_MIN_FLOWS = 512


def _weigh(cluster: Cluster, route, instances, real_flows, steps: int, require_symmetric: bool = False,
           own: int | None = None, sims: list[int] | tuple[int, ...] = (0,), keep: Callable | None = None):
    """The plan of ``instances[0]`` standing for all ``instances`` (see :func:`plan_flows`);
    None if ``require_symmetric`` and the orbits are not symmetric. With siblings
    (:func:`plan_phases`), only the first ``own`` instances are its orbit, and ``sims`` are
    the simulated instances of every orbit; ``keep``: see :func:`_plan_phase`."""
    own = len(instances) if own is None else own
    bw, lat = cluster.edge_bw_Bps, cluster.edge_latency_s
    # each (src, dst) routed once; every instance's flows are real flows
    path_of = {(src, dst): route(src, dst) for src, dst, _ in real_flows}
    paths = [[path_of[(src, dst)] for src, dst, _ in flows] for flows in instances]
    # real flows on each link, each counted once
    real = Counter(chain.from_iterable(path_of[(src, dst)] for src, dst, _ in real_flows))
    path_lat: dict[tuple[int, ...], float] = {}
    # what a flow meets on a link: bandwidth, latency, real flows; a path's signature is its links'
    edge_sig = {e: (bw[e], lat[e], n) for e, n in real.items()}
    sigs = {p: tuple(map(edge_sig.__getitem__, p)) for p in path_of.values()}

    rep_paths = paths[0]
    rep_sigs = [sigs[p] for p in rep_paths]
    symmetric = all([sigs[p] for p in inst] == rep_sigs for inst in paths[1:])
    if require_symmetric and not symmetric:
        return None
    if symmetric:
        simulated = {e for i in sims for p in paths[i] for e in p}
        weights = _images_on(instances[:own], paths[:own], simulated, require_symmetric)
        latency = max((cluster.path_latency_s(p) for p in rep_paths), default=0.0)
    else:
        orbit_weights = []
        for i in range(len(rep_paths)):
            n: dict[int, int] = {}
            for inst in paths[:own]:
                for e in inst[i]:
                    n[e] = n.get(e, 0) + 1
            orbit_weights.append(tuple(sorted(n.items())))
        weights = tuple(orbit_weights)
        for inst in paths[:own]:
            for p in inst:
                if p not in path_lat:
                    path_lat[p] = cluster.path_latency_s(p)
        latency = max(path_lat.values(), default=0.0)
    crossed = np.fromiter(real, np.int64, len(real))
    plan = FlowPlan(weights=weights, fractions=tuple(b for _, _, b in instances[0]), latency_s=steps * latency,
                    meet_real=np.sort(crossed), orbit_symmetric=symmetric or own == 1)
    if not symmetric:  # (an asymmetric orbit is constrained wherever its members go: no meeting to add)
        make = partial(_as_is, plan)
    else:  # member by member (require_symmetric), a flow is its sender's and its receiver's: once
        make = partial(_met_on, plan, instances[:own], paths[:own], require_symmetric)
    if keep is not None and len(plan.meet_real):  # (no link to meet on: no meeting to look for)
        keep(make)
    return plan


def _images_on(instances: list, paths: list, links: set, once: bool) -> tuple:
    """A symmetric orbit's weights (:attr:`FlowPlan.weights`): per flow k, each of ``links``
    (those its simulated flows cross) that flow k of some instance crosses, and how many do;
    flow k's own links first, in path order, then the others by id. ``once``: a flow in two
    instances (one object: a member's and another's) counts in the first.

    The flows of an orbit's instances that cross a link need not be images of the simulated
    flows that cross it. An all-to-all over two nodes, member 0 simulated, rails, PXN::

        nvsw->gpu0 carries  2->0  4->0  6->0       member 0's own incoming flows (NVLink)
                            2->8  4->8  6->8       node-mates' legs to gpu0's NIC: images of
                                                   member 0's 0->10 via 2, 0->12 via 4, ...
        weights there       incoming k: 1 each, and each PXN flow: 1 (its own legs cross
                            nvsw->gpu2, ...): the legs move at the NIC's pace, as they do

    Weighed real / simulated flows (6 / 3) instead, the three incoming flows stood for the
    legs too and moved them at NVLink's pace: a TP reduce-scatter beside it on that port was
    20 % slower than rank by rank (bench/fuzz_fabrics.py 244, plan 23). Since every flow k
    moves at one rate, this is the rank-by-rank constraint on each such link; the twins'
    links are copies of these."""
    out = []
    for p, n in zip(paths[0], _counted_on(instances, paths, links, once)):
        mine = set(p)
        out.append(tuple((e, float(n[e])) for e in p) + tuple((e, float(n[e])) for e in sorted(n) if e not in mine))
    return tuple(out)


def _images_at(paths: np.ndarray, at: np.ndarray, once: np.ndarray | None, links: np.ndarray) -> tuple:
    """:func:`_images_on` on arrays, for the orbit ``at`` (``paths[at[i, k]]``: instance i's
    flow k's path, -1 padded; counted only where ``once[i, k]`` if given) and the mask of
    ``links``: (pairs per flow, their links, their counts), flow by flow in that order."""
    n_links = len(links)
    crossed = paths[at]
    where = np.zeros(n_links + 1, dtype=bool)
    where[:n_links] = links
    hit = where[crossed]
    if once is not None:
        hit &= once[:, :, None]
    i, k, hop = np.nonzero(hit)
    codes, counts = np.unique(k * n_links + crossed[i, k, hop], return_counts=True)
    flow_of, link = np.divmod(codes, n_links)
    rep = paths[at[0]]
    width = rep.shape[1]
    # each pair's place: its hop on flow k's own path, else width + link id
    place = width + link
    own_k, own_h = np.nonzero(rep >= 0)
    own_codes = own_k * n_links + rep[own_k, own_h]
    j = np.searchsorted(codes, own_codes)
    place[j] = own_h
    order = np.lexsort((place, flow_of))
    return (np.bincount(flow_of, minlength=len(rep)).astype(np.int64), link[order], counts[order].astype(float))


def _as_is(plan: FlowPlan, _links) -> FlowPlan:
    return plan


def _counted_on(instances: list, paths: list, where: set, once: bool) -> list[Counter]:
    """Per flow position k, how many instances' flow k cross each link of ``where``
    (``paths``: the instances' flows' paths); ``once``: a flow in two instances (one object)
    counts in the first."""
    hits: dict[tuple, tuple] = {}  # per distinct path, its links in ``where``
    met: list[Counter] = [Counter() for _ in paths[0]]
    seen: set[int] = set()
    for flows, inst in zip(instances, paths):
        for k, (f, p) in enumerate(zip(flows, inst)):
            if once:
                if id(f) in seen:
                    continue
                seen.add(id(f))
            on = hits.get(p)
            if on is None:
                on = hits[p] = tuple(e for e in p if e in where)
            if on:
                met[k].update(on)
    return met


def _met_on(plan: FlowPlan, instances: list, paths: list, once: bool, links: np.ndarray) -> FlowPlan:
    """:func:`_weigh`'s symmetric ``plan`` with, per flow k, each of ``links`` that flow k of
    some instance crosses and how many do (:func:`_met_at` on dictionaries); ``once``:
    a flow in two instances (one object: a member's and another's) counts in the first."""
    if len(links) == 0:
        return plan
    met = _counted_on(instances, paths, set(links.tolist()), once)
    return dataclasses.replace(plan, weights=tuple(w + tuple(sorted(n.items())) for w, n in zip(plan.weights, met)))


def _weigh_rows(cluster: Cluster, real_flows: list, src: np.ndarray, dst: np.ndarray, rows: np.ndarray, steps: int,
                require_symmetric: bool = False, direct: bool = False,
                keep: Callable | None = None) -> FlowPlan | None:
    """:func:`_weigh` on arrays, for communications with many real flows (an all-to-all over
    64 GPUs and its 15 twins: 64,512): the same plan, bit for bit. ``src``, ``dst``: the real
    flows' ends; ``rows[i, k]``: the index in ``real_flows`` of flow k of instance i. Each distinct (src, dst) is routed once
    (:func:`_route_rows`); a link's signature (bandwidth, latency, real flows) becomes one
    code, a path the row of its links' codes, and the orbit test compares those rows instance
    by instance (:func:`_coarse_rows`)::

        instance 0   [c3 c7 c7 c3 -1]  [c3 c1 c3 -1 -1] ...    (flow k: its path's codes)
        instance 1   [c3 c7 c7 c3 -1]  [c3 c1 c3 -1 -1] ...    == instance 0's: symmetric
    """
    co, at = _coarse_rows(cluster, src, dst, rows, (0,), direct)
    if require_symmetric and not co.symmetric:
        return None
    fractions = tuple(real_flows[i][2] for i in rows[0].tolist())
    once = None  # whole instances: each real flow is in one row
    if require_symmetric:
        # member by member, a flow is its sender's and its receiver's: count it in one row
        flat = rows.ravel()
        order = np.argsort(flat, kind="stable")
        ordered = flat[order]
        once = np.zeros(len(flat), dtype=bool)
        once[order[np.r_[True, ordered[1:] != ordered[:-1]]]] = True
        once = once.reshape(rows.shape)
    return _weigh_at(cluster, co, at, fractions, steps, once, keep)


@dataclasses.dataclass(frozen=True)
class _Coarse:
    """The counts and the orbit test of :func:`_coarse_rows`, over every instance of a
    communication (and of its siblings): its distinct (src, dst) pairs (``keys``: src * GPUs
    + dst, sorted), each pair's route (rows of edge ids, -1 after its ``lens``), the real
    flows on each link, the links the simulated flows cross, and whether every instance meets
    links of the same signatures. None of it depends on which orbit asks."""

    keys: np.ndarray
    paths: np.ndarray
    lens: np.ndarray
    real: np.ndarray
    simulated: np.ndarray | None  # a mask over the links; None where not symmetric
    symmetric: bool
    meet_real: np.ndarray  # FlowPlan.meet_real


def _coarse_rows(cluster: Cluster, src: np.ndarray, dst: np.ndarray, rows: np.ndarray, sims,
                 direct: bool) -> tuple[_Coarse, np.ndarray]:
    """(:class:`_Coarse` of the instances ``rows``, each instance flow's pair: ``at[i, k]``);
    ``rows[i, k]``: the index in ``src``, ``dst`` of flow k of instance i; ``sims``: the
    simulated instances' rows."""
    n_gpu = max(len(cluster.gpu_names), 1)
    keys, inv_real = np.unique(src * n_gpu + dst, return_inverse=True)
    inv_real = inv_real.ravel()
    paths, lens = _route_rows(cluster, keys // n_gpu, keys % n_gpu, direct)
    # real flows on each link, each counted once (a pair twice in real_flows counts twice)
    per_pair = np.bincount(inv_real, minlength=len(keys))
    used = paths >= 0
    real = np.bincount(paths[used], weights=np.broadcast_to(per_pair[:, None], paths.shape)[used])
    at = inv_real[rows]  # each instance flow's pair
    # what a flow meets on a link, as one code per distinct (bandwidth, latency, real flows)
    bw_a, lat_a = cluster.edge_columns
    edges = np.flatnonzero(real)
    codes = np.full(len(real) + 1, -1, dtype=np.int64)  # index -1 (padding) stays -1
    codes[edges] = _row_codes(bw_a[edges], lat_a[edges], real[edges])
    sig = codes[paths]  # per pair, its path's codes, -1 after its end
    symmetric = bool((sig[at[1:]] == sig[at[0]][None]).all()) if len(at) > 1 else True
    simulated = None  # (read by symmetric orbits only)
    if symmetric:
        sim_paths = paths[at[list(sims)]]
        simulated = np.zeros(len(real), dtype=bool)
        simulated[sim_paths[sim_paths >= 0]] = True
    return _Coarse(keys, paths, lens, real, simulated, symmetric, edges), at


def _weigh_sibling_rows(cluster: Cluster, own: list, steps: int, co: _Coarse,
                        keep: Callable | None = None) -> FlowPlan:
    """The plan of ``own[0]`` standing for its orbit ``own`` (its instances' flows), from what
    it and its siblings share (``co``); ``keep``: see :func:`_plan_phase`."""
    n_gpu = max(len(cluster.gpu_names), 1)
    src, dst = _flow_ends([f for inst in own for f in inst])
    at = np.searchsorted(co.keys, src * n_gpu + dst).reshape(len(own), -1)  # each flow's pair
    fractions = tuple(f[2] for f in own[0])
    return _weigh_at(cluster, co, at, fractions, steps, keep=keep)


def _weigh_at(cluster: Cluster, co: _Coarse, at: np.ndarray, fractions: tuple, steps: int,
              once: np.ndarray | None = None, keep: Callable | None = None) -> FlowPlan:
    """The plan of instance ``at[0]`` standing for the orbit ``at`` (each flow's pair in
    ``co``): per flow position k, how many instances' flow k cross each link, symmetric on
    the links the simulated flows cross (:func:`_images_at`), else on every link, links in
    order. ``keep``: see
    :func:`_plan_phase`; a symmetric plan's maker (:func:`_met_at`) adds its meetings, counting
    a flow where ``once[i, k]`` when given (the rows of members hold each flow twice); what
    it keeps is the plan, the routes and ``at``, not ``co``'s per-link columns."""
    paths, real, lat_a = co.paths, co.real, cluster.edge_columns[1]
    met = co.meet_real
    if co.symmetric:
        rep = paths[at[0]]
        sizes, pair_edge, pair_w = _images_at(paths, at, once, co.simulated)
        weights = _per_flow(pair_edge.tolist(), pair_w.tolist(), sizes)
        latency = _longest_s(rep, lat_a)
        plan = with_pairs(FlowPlan(weights=weights, fractions=fractions, latency_s=steps * latency, meet_real=met),
                           (sizes, pair_edge, pair_w))
        make = partial(_met_at, plan, paths, at, once, len(cluster.edges))
        if keep is not None and len(met):  # (no link to meet on: no meeting to look for)
            keep(make)
        return plan
    else:
        width, n_edges = at.shape[1], len(real)
        crossed = paths[at]  # instance x flow x hop
        k_of = np.broadcast_to(np.arange(width)[None, :, None], crossed.shape)
        on = crossed >= 0
        pos_link, counts = np.unique(k_of[on] * n_edges + crossed[on], return_counts=True)
        k_at = pos_link // n_edges
        bounds = np.searchsorted(k_at, np.arange(width + 1))
        pair_edge = pos_link % n_edges
        weights = _per_flow(pair_edge.tolist(), counts.tolist(), np.diff(bounds))
        latency = _longest_s(paths[unique(at)], lat_a)
        pairs = (np.diff(bounds).astype(np.int64), pair_edge, counts.astype(float))
    plan = with_pairs(FlowPlan(weights=weights, fractions=fractions, latency_s=steps * latency, meet_real=met,
                               orbit_symmetric=len(at) == 1), pairs)
    if keep is not None and len(met):  # (asymmetric: constrained wherever its members go, no meeting to add)
        keep(partial(_as_is, plan))
    return plan


def _per_flow(links: list[int], weights: list, sizes: np.ndarray) -> tuple[tuple[tuple[int, float], ...], ...]:
    """:attr:`FlowPlan.weights` from its pairs, flow by flow (``sizes``: each flow's count),
    in one pass over them (an all-to-all over 64 GPUs with its twins: 4,032 flows a plan)."""
    pairs = zip(links, weights)
    return tuple(tuple(islice(pairs, n)) for n in sizes.tolist())


def _met_at(plan: FlowPlan, paths: np.ndarray, at: np.ndarray, once: np.ndarray | None, n_links: int,
            links: np.ndarray) -> FlowPlan:
    """A symmetric ``plan`` (:func:`_weigh_at`) with, for each of ``links`` that flow k of some
    instance crosses (``paths[at[i, k]]``: instance i's flow k's path, -1 padded; only where
    ``once[i, k]`` if given), that link and how many instances' flow k cross it, links in
    order, after flow k's own."""
    if len(links) == 0:
        return plan
    crossed = paths[at]
    where = np.zeros(n_links + 1, dtype=bool)  # (the last stands for the padding, -1)
    where[links] = True
    hit = where[crossed]
    if once is not None:
        hit &= once[:, :, None]
    i, k, hop = np.nonzero(hit)
    codes = np.sort(k * n_links + crossed[i, k, hop])
    if len(codes) == 0:
        return plan
    first = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1]])
    counts = np.diff(np.r_[first, len(codes)])
    flow_of, met = np.divmod(codes[first], n_links)  # by flow, then by link
    # flow k's meetings are met[bounds[k]:bounds[k + 1]], put after its own pairs
    bounds = np.searchsorted(flow_of, np.arange(len(plan.weights) + 1)).tolist()
    met_l, counts_l = met.tolist(), counts.tolist()
    out = dataclasses.replace(plan, weights=tuple(
        w + tuple(zip(met_l[lo:hi], counts_l[lo:hi])) if hi > lo else w
        for w, lo, hi in zip(plan.weights, bounds, bounds[1:])))
    own = plan.__dict__.get("pairs")
    if own is None:
        return out
    # the arrays too: each flow's own pairs, then its meetings (a stable sort by flow keeps
    # both orders)
    sizes, edge, w = own
    by_flow = stable_argsort(np.concatenate([np.repeat(np.arange(len(sizes)), sizes), flow_of]))
    return with_pairs(out, (sizes + np.bincount(flow_of, minlength=len(sizes)),
                             np.concatenate([edge, met])[by_flow],
                             np.concatenate([w, counts.astype(float)])[by_flow]))


def _row_codes(*cols: np.ndarray) -> np.ndarray:
    """One int per row of ``cols``, equal where the rows' values are equal (as ``==`` compares
    them): the rank of the row among the distinct rows, in sorted order."""
    n = len(cols[0])
    if not n:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort(cols[::-1])
    new = np.zeros(n, dtype=bool)  # a row that differs from the one before it in sorted order
    new[0] = True
    for c in cols:
        sorted_c = c[order]
        new[1:] |= sorted_c[1:] != sorted_c[:-1]
    out = np.empty(n, dtype=np.int64)
    out[order] = np.cumsum(new) - 1
    return out


def _longest_s(paths: np.ndarray, lat_s: np.ndarray) -> float:
    """The largest latency of ``paths`` (rows of edge ids, -1 after the end), each summed hop
    by hop in order as ``Cluster.path_latency_s`` sums it (the same float)."""
    if not len(paths):
        return 0.0
    lat_pad = np.append(lat_s, 0.0)  # padding (-1) adds nothing
    total = np.zeros(len(paths))
    for h in range(paths.shape[1]):
        total = total + lat_pad[paths[:, h]]
    return float(total.max())


# Collectives in which every member does the same, so that one member's flows stand for all:
# an all-to-all, and rings whose channels rotate every node's members (collectives/ring.py) on
# groups with the same number of members on every node. Not a ring shift (CP): its single
# ring mixes NVLink and NIC hops, so members differ.
MEMBER_SYMMETRIC = frozenset({("all_to_all", "pxn"), ("all_to_all", "pairwise"), ("all_to_all", DEEPEP),
                              ("all_reduce", "ring"), ("reduce_scatter", "ring"), ("all_gather", "ring"),
                              ("all_reduce", "hierarchical"), ("all_reduce", "nvls")})


def _regular(group: tuple[int, ...], node_of) -> bool:
    counts: dict[int, int] = {}
    for x in group:
        counts[node_of(x)] = counts.get(node_of(x), 0) + 1
    return len(set(counts.values())) == 1


def _by_member(comm: Comm, node_of, flows_of: dict) -> list[tuple]:
    """A communication with one simulated member, as one instance per member GPU.

    An instance is what one GPU sends and what it receives: its outgoing flows sorted by where
    they go relative to it (node offset, then offset among the group's members on that node,
    both cyclic), then its incoming flows sorted by where they come from. So flow k of every
    member is the same kind of transfer, and the orbit test of :func:`plan_flows` checks that
    symmetry flow by flow. The simulated member's instance stands for all: an all-to-all costs
    2(n-1) flows instead of n(n-1), a ring with c channels 2c instead of c*n. Keeping the
    incoming flows makes the simulated GPU's ingress links, where its other receptions (PP
    sends) arrive, part of the constraints::

        ring, 2 nodes x 4, channel c rotated by c:   a1 sends to a2 (channels 0, 2, 3) and to
                                                     b2 (channel 1, via its NIC); a1 receives
                                                     from a0 (0, 2, 3) and from b0 (channel 1)
    """
    instances = []
    for k, g in enumerate((comm.group, *comm.twins)):
        flows = flows_of[g]
        nodes: dict[int, list[int]] = {}
        for x in g:
            nodes.setdefault(node_of(x), []).append(x)
        regular = len({len(v) for v in nodes.values()}) == 1
        n_nodes, per = len(nodes), len(next(iter(nodes.values())))
        # where b is, seen from a, as one number: regular, (node offset, offset on the node),
        # both cyclic, = node_off * per + local_off; else the cyclic offset in the group
        if regular:
            node_at = {x: i for i, members in enumerate(nodes.values()) for x in members}
            local_at = {x: j for members in nodes.values() for j, x in enumerate(members)}
        else:
            node_at, local_at, n_nodes, per = dict.fromkeys(g, 0), {x: i for i, x in enumerate(g)}, 1, len(g)

        out: dict[int, list] = {x: [] for x in g}
        into: dict[int, list] = {x: [] for x in g}
        for f in flows:
            out[f[0]].append(f)
            if f[1] != f[0]:  # an NVLS loop is its GPU's own, once
                into[f[1]].append(f)
        members = list(g)
        if k == 0:  # the simulated member first: its instance is the one simulated
            root = g.index(comm.members[0])
            members = members[root:] + members[:root]
        for x in members:
            na, ia = node_at[x], local_at[x]

            # worked out for the flows' ends only, not for every member (a DP group has 512)
            def off(y: int, na: int = na, ia: int = ia) -> int:
                return (node_at[y] - na) % n_nodes * per + (local_at[y] - ia) % per

            instances.append(tuple(sorted(out[x], key=lambda f: off(f[1])))
                             + tuple(sorted(into[x], key=lambda f: off(f[0]))))
    return instances


def _by_member_rows(comm: Comm, node_of, flows_of: dict, src: np.ndarray, dst: np.ndarray) -> np.ndarray | None:
    """:func:`_by_member`'s instances as rows of indices into the real flows (the groups'
    flows one after the other, ``comm.group`` first; ``src``, ``dst``: their ends), sorted on arrays: per member, its
    outgoing flows by (offset of where they go, order given), then its incoming flows by
    (offset of where they come from, order given), as Python's stable sort leaves them. None
    when members have different numbers of flows (the rows would be ragged)."""
    groups = (comm.group, *comm.twins)
    member_at, part, offset, given = [], [], [], []
    base = base_member = 0
    for k, g in enumerate(groups):
        flows = flows_of[g]
        members = list(g)
        if k == 0:  # the simulated member first
            root = g.index(comm.members[0])
            members = members[root:] + members[:root]
        node_list = [node_of(x) for x in g]
        nodes: dict[int, int] = {}
        for n in node_list:
            nodes[n] = nodes.get(n, 0) + 1
        gpus = np.asarray(g, dtype=np.int64)
        sorter = np.argsort(gpus, kind="stable")
        if len(set(nodes.values())) == 1:  # regular: (node offset, offset on the node), both cyclic
            order = {n: i for i, n in enumerate(nodes)}
            node_at = np.array([order[n] for n in node_list], dtype=np.int64)
            seen: dict[int, int] = {}
            local_at = np.empty(len(g), dtype=np.int64)
            for i, n in enumerate(node_list):
                local_at[i] = seen[n] = seen.get(n, -1) + 1
            n_nodes, per = len(nodes), next(iter(nodes.values()))
        else:  # the cyclic offset in the group
            node_at, local_at, n_nodes, per = np.zeros(len(g), dtype=np.int64), np.arange(len(g)), 1, len(g)
        pos_in_members = {x: i for i, x in enumerate(members)}
        rank_of = np.array([pos_in_members[x] for x in g], dtype=np.int64)  # position in g -> in members
        f_src, f_dst = src[base:base + len(flows)], dst[base:base + len(flows)]
        at_s = sorter[np.searchsorted(gpus, f_src, sorter=sorter)]  # positions in g
        at_d = sorter[np.searchsorted(gpus, f_dst, sorter=sorter)]

        def off(a: np.ndarray, b: np.ndarray) -> np.ndarray:  # where b is, seen from a
            return (node_at[b] - node_at[a]) % n_nodes * per + (local_at[b] - local_at[a]) % per

        idx = np.arange(base, base + len(flows))
        into = f_src != f_dst  # an NVLS loop is its GPU's own, once
        member_at += [base_member + rank_of[at_s], base_member + rank_of[at_d[into]]]
        part += [np.zeros(len(flows), dtype=np.int64), np.ones(int(into.sum()), dtype=np.int64)]
        offset += [off(at_s, at_d), off(at_d[into], at_s[into])]
        given += [idx, idx[into]]
        base += len(flows)
        base_member += len(g)
    member_at, part, offset, given = map(np.concatenate, (member_at, part, offset, given))
    counts = np.bincount(member_at, minlength=base_member)
    if len(counts) == 0 or (counts != counts[0]).any():
        return None
    return given[np.lexsort((given, offset, part, member_at))].reshape(base_member, int(counts[0]))


NUMPY_MIN_CELLS = 4096  # flows x links from which the numpy version is the faster one
# (flow, link) pairs up to which a round of the numpy version reads masks over every pair
# rather than the rows of the links that fill and of the flows that freeze (_max_min_pairs)
MASK_PAIRS = 8192


def max_min_rates(weights: list[tuple[tuple[int, float], ...]], bw_Bps: list[float]) -> list[float]:
    """Weighted max-min fair rates (bytes/s) of flows with the given per-edge weights: in
    numpy for a large mix, else in plain loops (:func:`_max_min_loops`)."""
    n = len(weights)
    pairs = sum(map(len, weights))
    # flows x links >= pairs: only a small mix needs its links counted
    if pairs >= 64 and (pairs >= NUMPY_MIN_CELLS
                        or n * len(set(map(itemgetter(0), chain.from_iterable(weights)))) >= NUMPY_MIN_CELLS):
        rates = _max_min_numpy(weights, bw_Bps)
        if rates is not None:
            return rates
    return _max_min_loops(weights, bw_Bps)


def _max_min_loops(weights: list[tuple[tuple[int, float], ...]], bw_Bps: list[float]) -> list[float]:
    """Progressive filling: every unfrozen flow's rate rises together until a link fills; the
    flows on it freeze at that rate; repeat (Bertsekas & Gallager, Data Networks, Sec 6.5.2)::

        level r = min over live links of  capacity left / weight of the unfrozen flows on it
        freeze the unfrozen flows on every link at level r; take w * r off each of their links
    """
    n = len(weights)
    rates = [float("inf")] * n
    load: dict[int, float] = {}
    on_edge: dict[int, list[int]] = {}
    for i, ws in enumerate(weights):
        for e, w in ws:
            if e in load:
                load[e] += w
                on_edge[e].append(i)
            else:
                load[e] = w
                on_edge[e] = [i]
    cap = {e: float(bw_Bps[e]) for e in load}  # (Python floats: capacities left may come as an array)
    frozen = [not ws for ws in weights]
    left = n - sum(frozen)
    live = [e for e in sorted(load) if load[e] > 1e-12]
    while left and live:  # flows left on no live link (weights ~0) keep an infinite rate
        ratio = [(cap[e] if cap[e] > 0.0 else 0.0) / load[e] for e in live]
        r = min(ratio)
        # every link at the bottleneck level fills at once (symmetric flows tie exactly);
        # freezing them together gives the same rates in far fewer rounds. Which links are
        # full is decided on the ratios before any of them freezes.
        full_s = r * (1 + 1e-12)
        kept = []
        for e_star, x in zip(live, ratio):
            if x > full_s:
                kept.append(e_star)
                continue
            for i in on_edge[e_star]:
                if frozen[i]:
                    continue
                frozen[i], rates[i] = True, r
                left -= 1
                for e, w in weights[i]:
                    cap[e] -= w * r
                    load[e] -= w
        live = [e for e in kept if load[e] > 1e-12]
    return rates


def _max_min_numpy(weights, bw_Bps) -> list[float] | None:
    """:func:`max_min_rates` in numpy, for many flows over many links: the same progressive
    filling, each round touching only the links at the bottleneck, the flows they freeze and
    those flows' links (a DP ring over thousands of GPUs has flows crossing thousands of links
    and hundreds of fill levels; a dense flows x links matrix cost a second per mix there).

    The (flow, link) pairs are kept twice: flow by flow (as given) and link by link. Per link,
    the weights of the flows frozen in a round are summed in flow order and then taken off, as
    the flows x links matrix this replaces summed its rows, so its rates come out bit for bit the
    same. The loop version takes each flow off in turn: the same rates within rounding, for
    positive weights (a flow of weight 0 on a full link freezes there in the loop version, not
    here). None when a flow lists a link twice (the loop version adds those up as it goes).
    Flows left with no live link (all their weights ~0) keep an infinite rate, in both.
    """
    sizes, pair_edge, pair_w = _pairs(weights)
    return _max_min_pairs(sizes, pair_edge, pair_w, bw_Bps)


def _pairs(weights) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flows' ((edge, weight), ...) as arrays: links per flow, then every pair's edge and
    weight, flow by flow."""
    sizes = np.fromiter(map(len, weights), dtype=np.int64, count=len(weights))
    flat = np.fromiter(chain.from_iterable(chain.from_iterable(weights)), dtype=float, count=2 * int(sizes.sum()))
    return sizes, flat[0::2].astype(np.int64), flat[1::2]


def _max_min_pairs(sizes: np.ndarray, pair_edge: np.ndarray, pair_w: np.ndarray, bw_Bps: list[float]
                   ) -> list[float] | None:
    """:func:`_max_min_numpy` on flows given as (flow, link) pairs (see :func:`_pairs`)."""
    n = len(sizes)
    # the links crossed, numbered 0.. in edge order: by a mark per link of the cluster when
    # the pairs are many (no sort), by sorting them when they are few (a 16K-GPU cluster has
    # 136,000 links)
    if 16 * len(pair_edge) >= len(bw_Bps):
        used = np.zeros(len(bw_Bps), dtype=bool)
        used[pair_edge] = True
        links = np.flatnonzero(used)
        pair_link = (np.cumsum(used) - 1)[pair_edge]
    else:
        links, pair_link = np.unique(pair_edge, return_inverse=True)
    n_links = len(links)
    pair_flow = np.repeat(np.arange(n), sizes)
    by_link = stable_argsort(pair_link)  # the pairs link by link, flows in order
    in_link_order = pair_link[by_link]
    if ((in_link_order[1:] == in_link_order[:-1]) & (np.diff(pair_flow[by_link]) == 0)).any():
        return None
    # which pairs a round touches: by masks over every pair where they are few (a few calls a
    # round), by the rows of the full links and the frozen flows where they are many (a DP
    # ring over 16,384 GPUs hop by hop: 98,000 pairs and 250 rounds)
    few = len(pair_w) <= MASK_PAIRS
    if not few:
        link_ptr = np.searchsorted(in_link_order, np.arange(n_links + 1))
        flow_ptr = np.concatenate(([0], np.cumsum(sizes)))
    cap = bw_Bps[links] if isinstance(bw_Bps, np.ndarray) else np.array([bw_Bps[e] for e in links.tolist()], dtype=float)
    load = np.bincount(pair_link, weights=pair_w, minlength=n_links)
    rates = np.full(n, np.inf)
    open_ = sizes > 0
    n_open = int(open_.sum())
    live = load > 1e-12
    ratio = np.full(n_links, np.inf)  # cap / load of the live links, inf for the others
    ratio[live] = np.maximum(cap[live], 0.0) / load[live]
    weighs = pair_w > 0
    while n_open:
        r = ratio.min()
        if r == np.inf:  # open flows on no live link (weights ~0): no constraint left
            break
        # every link at the bottleneck level fills at once (see _max_min_loops); the flows
        # with weight on one of them freeze
        full = ratio <= r * (1 + 1e-12)
        hit = np.zeros(n, dtype=bool)
        if few:
            hit[pair_flow[full[pair_link] & weighs]] = True
        else:
            on_full = by_link[index_ranges(link_ptr, full.nonzero()[0])]
            hit[pair_flow[on_full[weighs[on_full]]]] = True
        hit &= open_
        newly = hit.nonzero()[0]  # ascending
        rates[newly] = r
        open_[newly] = False
        n_open -= len(newly)
        # their pairs, flow by flow (as the pairs are laid out)
        moved = hit[pair_flow].nonzero()[0] if few else index_ranges(flow_ptr, newly)
        s = np.bincount(pair_link[moved], weights=pair_w[moved], minlength=n_links)
        touched = s.nonzero()[0]  # a link whose sum is 0 keeps its cap and load exactly
        s = s[touched]
        cap[touched] -= s * r
        load[touched] -= s
        live[full] = False
        live[touched] &= load[touched] > 1e-12
        ratio[full] = np.inf
        ratio[touched] = np.inf
        still = touched[live[touched]]
        ratio[still] = np.maximum(cap[still], 0.0) / load[still]
    return rates.tolist()


@dataclass(eq=False, slots=True)
class _Transfer:
    """The flows of one transfer (one phase of one communication), moved as one unit in the
    bookkeeping: they start together and the transfer ends when its last flow does."""

    weights: tuple[tuple[tuple[int, float], ...], ...]  # per flow of the plan
    edges: np.ndarray  # every link of its flows, ascending, kept until the whole transfer ends
    size: np.ndarray  # bytes per flow
    rem: np.ndarray | None  # bytes left per flow at ``at_s``
    live: tuple[int, ...]  # flows still running
    idx: np.ndarray  # the same, as an index array
    done: simpy.Event | Callable[[], None]  # fired, or called, when its last flow ends
    tag: object  # what the caller needs to know when it ends (link accounting)
    at_s: float = 0.0
    rate: np.ndarray | None = None  # bytes/s per flow (0 once finished)
    # when its rates changed, to these rates (one array per change); None while it replays a
    # kept course (FlowNetwork._replay_alone)
    times: list | None = None
    rows: list | None = None
    end: np.ndarray | None = None  # when each flow finished
    next_s: float = float("inf")  # when its next flow ends at its current rates
    # alone in its component, worked out to its end ahead of the clock: (the states before
    # each of its flow-end instants, its start, its flows' ends relative to it), to go back to
    # if another transfer joins (FlowNetwork._back_to)
    ahead: tuple | None = None
    course: tuple | None = None  # (course, start) while it follows a kept course exactly
    size_bytes: float = 0.0  # the transfer's size (its flows carry fractions of it)
    # since its rates were worked out, only flows of its mix have ended, none at a rate below
    # this (inf: none ended); 0: not known (new, or gone back): FlowNetwork._rates_above
    below: float = 0.0
    _key: tuple = ()  # :attr:`key`, and the ``live`` it was made for
    _key_live: tuple | None = None

    @property
    def key(self) -> tuple:
        """Its identity in a mix of flows: transfers of the same plan with the same flows
        running are interchangeable in max-min and get the same rates. The flows as bytes,
        made once per set of live flows: the rates cache keeps thousands of keys, and a tuple
        of 9,504 flows costs 36 bytes a flow and its hash again at every look-up."""
        if self._key_live is not self.live:
            self._key_live = self.live
            self._key = (id(self.weights), self.idx.tobytes())
        return self._key


class _Instants:
    """The states of a transfer worked out ahead (:meth:`FlowNetwork._run_ahead`) before each
    of its flow-end instants, to go back to (:meth:`FlowNetwork._back_to`). A transfer of few
    flows keeps its live flows and their bytes left at each instant; one of many
    (AHEAD_COLUMNS_FROM) keeps columns: the bytes left once, before the first instant, with the
    step each instant brought them on by, and the instant each flow ended at. A DP ring over
    2,048 replicas, hop by hop (before its channels moved in lock-step), had 8,000 flows and
    2,500 instants, whose arrays copied at every instant took 7 GB; an all-to-all standing
    for thousands of twins still has thousands of flows::

        instant k      0        1        2   ...
        at_rel         3.1      3.4      5.0       from the start
        dt             3.1      0.3      1.6       bytes left: rem(k+1) = rem(k) - rate(k) * dt(k)
        ended_at[f] = 1: flow f live before instants 0 and 1
    """

    __slots__ = ("at_rel", "dt", "rate", "at_s_rel", "n_rates", "idx0", "rem0", "ended_at", "idx", "rem")

    def __init__(self, at_rel: list[float], dt: list[float] | None, rate: list[np.ndarray], at_s_rel: list[float],
                 n_rates: list[int], idx0: np.ndarray, rem0: np.ndarray | None, ended_at: np.ndarray | None,
                 idx: list[np.ndarray] | None, rem: list[np.ndarray] | None):
        self.at_rel = at_rel  # each instant, from the transfer's start (ascending)
        # columns: what its bytes left were brought on by there (at - at_s; 0.0: not moved)
        self.dt = dt
        self.rate = rate  # the rates before it
        self.at_s_rel = at_s_rel  # since when those rates ran, from the start
        self.n_rates = n_rates  # rate changes before it
        # columns: the live flows before the first instant, their bytes left, and per flow of
        # the transfer the instant it ended at (the number of instants: not ended)
        self.idx0 = idx0
        self.rem0 = rem0
        self.ended_at = ended_at
        # few flows: the live flows before each instant and their bytes left (an MoE step's
        # sends go back 600 times, each cheaply so)
        self.idx = idx
        self.rem = rem

    def state(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(live flows, their bytes left) before instant ``k``; from the columns, by the same
        operations on the same values as the transfer's own bytes left took
        (``FlowNetwork._catch_up``), on its live flows only."""
        if self.rem is not None:
            return self.idx[k], self.rem[k]
        live = self.ended_at[self.idx0] >= k
        idx, rem = self.idx0[live], self.rem0[live]
        for j in range(k):
            if self.dt[j] != 0.0:
                rem = rem - self.rate[j][idx] * self.dt[j]
        return idx, rem


def _shifted(course: tuple, t0: float) -> tuple[list, list, np.ndarray]:
    """A kept course's rate-change times, rates and flow ends, for a transfer started at ``t0``
    (see :meth:`FlowNetwork._run_ahead`)."""
    _, times, rows, end = course
    return [t0 + x for x in times], list(rows), end + t0


# flows from which a transfer worked out ahead keeps its instants' bytes left as steps from the
# first instant's (_Instants), not copied at each (their copies grow as flows x instants)
AHEAD_COLUMNS_FROM = 256

# entries a cache of the flow network keeps before it starts afresh: a run meets a few thousand
# mixes and courses; a bound keeps a pathological one (every mix new) from growing without end
CACHE_ENTRIES = 100_000


def _remember(cache: dict, key, value) -> None:
    """``cache[key] = value``, emptying ``cache`` first when it holds CACHE_ENTRIES already."""
    if len(cache) >= CACHE_ENTRIES:
        cache.clear()
    cache[key] = value


# live flows up to which a transfer's bookkeeping loops over Python floats instead of calling
# numpy (its per-call costs outweigh the loop below about this many elements)
FEW_FLOWS = 16


def _set_next_end(t: _Transfer, now: float) -> None:
    """``t.next_s``: when its first live flow ends at its current rates (``t.rem`` is at
    ``now``); a flow squeezed to 0 by rounding waits for the next re-share::

        next_s = now + min over live flows with rate > 0 of  rem / rate     (inf if none)

    A transfer with up to FEW_FLOWS live flows is worked out on Python floats, element by
    element (the same IEEE divisions and minimum as numpy's, so the same bits): numpy's
    per-call costs are most of the time on arrays this small (a pipeline's sends: one flow)."""
    live = t.live
    if len(live) <= FEW_FLOWS:
        rate, rem = t.rate, t.rem
        if len(live) > 4:  # read out whole (an all-to-all's 15 flows: half the time of .item each)
            rate, rem = rate.tolist(), rem.tolist()
            at = list.__getitem__
        else:
            at = np.ndarray.item
        first = float("inf")
        for i in live:
            r = at(rate, i)
            if r > 0.0:
                x = at(rem, i) / r
                if x < first:
                    first = x
        t.next_s = now + first
        return
    rl = t.rate[t.idx]
    if _min(rl) > 0:
        t.next_s = now + float(_min(t.rem[t.idx] / rl))
    elif _max(rl) > 0:
        pos = rl > 0
        t.next_s = now + float(_min(t.rem[t.idx][pos] / rl[pos]))
    else:
        t.next_s = float("inf")


@dataclass
class FlowNetwork:
    """Active flows on the cluster's links; a start or finish re-shares bandwidth where it
    changed, and only there.

    Transfers are kept in *components*: groups that share no link with each other, directly
    or through other transfers. Max-min fairness decomposes over components, so a start
    re-shares the component it joins (merging those it connects) and a finish the one it
    leaves (which may split); the others keep their rates and their finish times::

        stage 0   [a2a flows ......][DP ring .....]        one component per stage, mostly:
        stage 1        [a2a flows .......]                 a stage's mix recurs every
        stage 0->1            [PP send]  (joins both)      microbatch, so its rates are cached

    A transfer's flows move as one unit of bookkeeping (one join, one split, numpy arrays of
    bytes and rates); the rates are still each flow's own max-min share. A transfer keeps all
    its links until its last flow ends, so a component may stay joined a little longer than
    its flows need: the rates are the same (max-min of independent parts is their union).
    """

    env: simpy.Environment
    bw_Bps: list[float]
    _comps: dict = field(default_factory=dict)  # component id -> its transfers
    # link -> component id of the transfers on it, -1: none. An array, not a dict: a transfer
    # reads and marks its links in one go (an all-to-all of 4,032 flows standing for a 16K-GPU
    # MoE's twins holds 5,000 links; a dict took 0.9 ms a transfer for what takes 0.04 ms)
    _edge_comp: np.ndarray = field(init=False)
    _finish_s: dict = field(default_factory=dict)  # component id -> when its next flow ends
    _next_id: int = 0
    _ticks: list = field(default_factory=list)  # heap of the times of the ticks queued
    # rates depend only on which flows are active (their weights), and a pipeline repeats the
    # same mixes of flows many times: remember them. Keys are ids of the plans' weight tuples,
    # which the engine keeps alive for the whole run.
    _rates_cache: dict = field(default_factory=dict)
    _plan_info: dict = field(default_factory=dict)  # id(weights) -> (links, fractions array)
    _pairs_cache: dict = field(default_factory=dict)  # id(weights) -> its flows as pairs (_plan_pairs)
    _live_pairs: dict = field(default_factory=dict)  # a transfer's key -> its live flows' pairs (_pairs_of)
    # (id(weights), live flows, size) -> the course of such a transfer alone (_run_ahead)
    _alone: dict = field(default_factory=dict)
    # every transfer as it ends: (tag, bytes per flow, [rate change times], [rates], end per flow,
    # (course, start) if it followed a kept course: its times are the course's shifted)
    finished: list = field(default_factory=list)

    def __post_init__(self):
        self._edge_comp = np.full(len(self.bw_Bps), -1, dtype=np.int64)

    def transfer(self, plan: FlowPlan, size_bytes: float, tag=None, at_s: float | None = None,
                 on_done: Callable[[], None] | None = None) -> simpy.Event | None:
        """Start ``plan``'s flows at ``at_s`` (default: now; not before now) after its latency;
        the event returned fires when all are done. With ``on_done``, no event: it is called
        then instead (directly when the transfer ends alone, by an event at that instant
        otherwise), and None is returned."""
        info = self._plan_info.get(id(plan.weights))
        if info is None:
            moving = tuple(i for i, (ws, f) in enumerate(zip(plan.weights, plan.fractions)) if ws and f > 0)
            info = self._plan_info[id(plan.weights)] = (
                np.asarray(sorted(plan.edges), dtype=np.int64), np.asarray(plan.fractions, dtype=float),
                moving, np.asarray(moving, dtype=np.int64), {})
            given = plan.__dict__.get("pairs")
            if given is not None:  # the fair shares' arrays start from the plan's own
                self._plan_pairs(plan.weights, given)
        edges, fractions, moving, moving_idx, sizes = info  # moving: flows with links and bytes to carry
        done = self.env.event() if on_done is None else on_done
        if size_bytes <= 0 or not moving:
            _finished(self.env, done)
            return None if on_done is not None else done
        size = sizes.get(size_bytes)  # bytes per flow: read only, shared by the transfers of a size
        if size is None:
            size = sizes[size_bytes] = fractions * size_bytes
        # bytes left and flow ends are set when it begins (a replayed course needs neither)
        t = _Transfer(plan.weights, edges, size, None, moving, moving_idx, done, tag, size_bytes=size_bytes)

        def begin(_=None):
            t.at_s = self.env._now  # (Environment.now is a property around it)
            if _max(self._edge_comp[edges], initial=-1) < 0:  # alone on its links: maybe a kept course
                course = self._alone.get((id(t.weights), moving, size_bytes))
                if course is not None and course[0].at_rel:  # (instants: a list, read in C)
                    self._replay_alone(t, course)
                    return
            t.rem, t.end, t.times, t.rows = size.copy(), np.full(len(size), np.nan), [], []
            dirty: set[int] = set()
            self._join(t, dirty)
            self._reshare(dirty)

        now = self.env._now
        begin_s = (now if at_s is None or at_s < now else at_s) + plan.latency_s
        if begin_s > now:
            _call_at(self.env, begin_s, begin)
        else:
            begin()
        return None if on_done is not None else done

    def _replay_alone(self, t: _Transfer, course: tuple) -> None:
        """Start ``t``, alone on its links, on the kept course of its plan, flows and size: what
        :meth:`_join`, :meth:`_reshare` and :meth:`_run_ahead` would do for it, without working
        out its rates (the course's first row is its mix's cached rates). Its rate changes and
        flow ends are the course's, shifted: written out only if it has to go back
        (:meth:`_back_to`); link accounting reads the course."""
        t0 = t.at_s
        before = course[0]
        t.rate = course[2][0]
        t.idx, t.live = _NO_FLOWS, ()
        t.ahead = (before, t0, course[3])
        t.course = (course, t0)
        t.next_s = t0 + before.at_rel[-1]
        cid = self._next_id
        self._next_id += 1
        self._comps[cid] = [t]
        self._edge_comp[t.edges] = cid
        self._end_ahead(cid, t)

    def _end_ahead(self, cid: int, t: _Transfer) -> None:
        """Queue the end of ``t``, alone in component ``cid`` and worked out to its last flow:
        an event of its own at that instant, outside the ticks. If another transfer joins first,
        ``t`` goes back (:meth:`_back_to`), the component is timed by ticks again and this
        event finds ``t.ahead`` changed and does nothing."""
        self._finish_s.pop(cid, None)
        _call_at(self.env, t.next_s, partial(self._ended_ahead, cid, t, t.ahead))

    def _ended_ahead(self, cid: int, t: _Transfer, ahead: tuple, _event=None) -> None:
        if t.ahead is not ahead:
            return  # it went back since: see _end_ahead
        t.ahead = None
        del self._comps[cid]
        self._free_links(t.edges)
        self.finished.append((t.tag, t.size, t.times, t.rows, t.end, t.course))
        if isinstance(t.done, simpy.Event):
            t.done.succeed()
        else:  # the network is settled: whoever waits goes on in this event, not in another
            t.done()

    def _free_links(self, edges: np.ndarray) -> None:
        """No component holds ``edges`` any more."""
        self._edge_comp[edges] = -1

    def _catch_up(self, t: _Transfer, now: float) -> None:
        """Bring ``t``'s remaining bytes to ``now``, at the rates it had since ``at_s``. Only
        transfers whose rates change or whose flows may be due are brought up to date: the
        others' bytes follow from ``at_s`` and their rates whenever asked."""
        if t.at_s != now:
            if t.rate is not None:
                t.rem -= t.rate * (now - t.at_s)
            t.at_s = now

    def _join(self, t: _Transfer, dirty: set[int]) -> None:
        """Add ``t`` to the component of its links, merging the components it connects."""
        edge_comp = self._edge_comp
        held = edge_comp[t.edges]
        met = set(held[held >= 0].tolist()) if _max(held, initial=-1) >= 0 else set()
        for c in met:
            comp = self._comps[c]
            if len(comp) == 1 and comp[0].ahead is not None:
                self._back_to(comp[0], self.env.now)
        if met:
            target = max(met, key=lambda c: (len(self._comps[c]), -c))
            for c in sorted(met - {target}):
                moved = self._comps.pop(c)
                self._finish_s.pop(c, None)
                dirty.discard(c)
                self._comps[target].extend(moved)
                for g in moved:
                    edge_comp[g.edges] = target
        else:
            target = self._next_id
            self._next_id += 1
            self._comps[target] = []
        self._comps[target].append(t)
        edge_comp[t.edges] = target
        dirty.add(target)

    def _finish_due(self, t: _Transfer, now: float, tick_s: float) -> float:
        """End ``t``'s flows due at ``now`` (or left with float crumbs of a flow due now); the
        lowest rate among them (inf: none ended)."""
        self._catch_up(t, now)
        live = t.live
        lowest = math.inf
        if len(live) <= FEW_FLOWS:  # on Python floats, the same comparisons (see _set_next_end)
            rem, size, rate = t.rem, t.size, t.rate
            due = [i for i in live if rem.item(i) <= max(size.item(i) * 1e-9, rate.item(i) * tick_s)]
            if due:
                t.end[due] = now
                t.live = tuple(i for i in live if i not in due)
                t.idx = np.array(t.live, dtype=np.int64)
                lowest = min(map(rate.item, due))
        else:
            idx = t.idx
            due = t.rem[idx] <= np.maximum(t.size[idx] * 1e-9, t.rate[idx] * tick_s)
            if _any(due):
                t.end[idx[due]] = now
                lowest = float(_min(t.rate[idx[due]]))
                t.idx = idx[~due]
                t.live = tuple(t.idx.tolist())
        if t.live:  # its first flow may have been just short of due: when it ends now
            _set_next_end(t, now)
        return lowest

    def _run_ahead(self, t: _Transfer) -> None:
        """Work out the rest of ``t``, alone in its component, instant by instant as the clock
        would (each flow-end instant: the due flows end, the rest get the mix's rates), without
        an event per instant; the clock then only needs its last instant. Before each instant
        its state is kept, to resume from the right one if another transfer joins first::

            t alone   [flows a b c ......|a ends ....|b ends ...|c ends]   one event, at c's end
            joined                  x starts: back to the state after a's end, then as usual

        A transfer that starts alone repeats, shifted in time, what the last one of its plan,
        flows and size did alone (the pipeline's all-to-alls, microbatch after microbatch):
        that course is kept relative to the start and replayed.
        """
        t0 = t.at_s
        fresh = len(t.times) == 1 and t0 == t.times[0]  # nothing moved yet
        key = (id(t.weights), t.live, t.size_bytes)
        course = self._alone.get(key) if fresh else None
        if course is None:
            ats, rates, at_ss, n_rates = [], [], [], []
            idx0 = t.idx
            if len(idx0) < AHEAD_COLUMNS_FROM:  # rows: each instant's live flows and bytes left
                idxs, rems, dts, rem0, ended_at = [], [], None, None, None
            else:  # columns: the bytes left once, each instant's step, each flow's last instant
                idxs, rems, dts, rem0 = None, None, [], t.rem[idx0]
                ended_at = np.full(len(t.size), np.iinfo(np.int64).max)
            while t.live and t.next_s < float("inf"):
                at = t.next_s
                was = t.idx
                ats.append(at - t0)
                rates.append(t.rate)
                at_ss.append(t.at_s - t0)
                n_rates.append(len(t.times))
                if rems is not None:
                    idxs.append(was)
                    rems.append(t.rem[was])
                else:
                    dts.append(at - t.at_s if t.at_s != at and t.rate is not None else 0.0)  # as _catch_up
                self._finish_due(t, at, 4 * math.ulp(at))
                if ended_at is not None and len(t.idx) < len(was):  # the flows that ended here
                    ended_at[was[t.end[was] == at]] = len(ats) - 1
                if t.live:
                    r = self._rates_left(t, was)
                    t.below = math.inf
                    if r is not t.rate:
                        self._catch_up(t, at)
                        t.times.append(at)
                        t.rows.append(r)
                        t.rate = r
                        _set_next_end(t, at)
            course = (_Instants(ats, dts, rates, at_ss, n_rates, idx0, rem0, ended_at, idxs, rems),
                      [x - t0 for x in t.times], list(t.rows), t.end - t0)
            if fresh and not t.live:
                _remember(self._alone, key, course)
        else:  # replay: the end state, shifted
            t.times, t.rows, t.end = _shifted(course, t0)
            t.idx, t.live = t.idx[:0], ()
        t.ahead = (course[0], t0, course[3])
        if fresh and not t.live:
            t.course = (course, t0)
        if not t.live and course[0].at_rel:
            t.next_s = t0 + course[0].at_rel[-1]

    def _back_to(self, t: _Transfer, now: float) -> None:
        """Undo ``t``'s instants after ``now`` (see :meth:`_run_ahead`)."""
        (before, t0, end_rel), t.ahead = t.ahead, None
        t.below = 0.0  # (its rates go back to an earlier instant's)
        if t.times is None:  # a replayed course: its rate changes and ends, written out
            t.times, t.rows, t.end = _shifted(t.course[0], t0)
        t.course = None
        # the first instant after now; if its last instant is now, that one (it ends at the tick)
        k = next((k for k, x in enumerate(before.at_rel) if t0 + x > now), None)
        if k is None and not t.live and before.at_rel:
            k = len(before.at_rel) - 1
        if k is not None:
            idx, rem_live = before.state(k)
            t.rem = np.zeros(len(t.size))  # (the ended flows' bytes left are never read)
            t.rem[idx] = rem_live
            end = end_rel + t0
            end[idx] = np.nan  # the flows ended by then have their ends, the others none yet
            t.end, t.idx, t.live = end, idx, tuple(idx.tolist())
            t.rate, t.at_s, n_rates = before.rate[k], t0 + before.at_s_rel[k], before.n_rates[k]
            del t.times[n_rates:], t.rows[n_rates:]
            _set_next_end(t, t.at_s)

    def _split(self, cid: int, dirty: set[int]) -> None:
        """Finish the due flows of component ``cid``. While all its transfers go on, it keeps
        its links and stays one component; when some end, the rest regroup by shared links."""
        transfers = self._comps[cid]
        now = self.env.now
        # the clock cannot resolve less than a few ulps: a flow due within them is due now
        tick_s = 4 * math.ulp(now)
        due_by_s = now * (1 + 1e-12) + 1e-15  # as :meth:`_tick` picks the components due
        ended = []
        lowest = math.inf  # the lowest rate among the flows that end now
        for t in transfers:
            if t.ahead is not None:  # worked out ahead: its last flow ends now
                t.ahead = None
                lowest = 0.0  # (its rates were its own course's)
                if not t.live:
                    ended.append(t)
                    continue
            if t.next_s > due_by_s:
                continue  # none of its flows ends now
            lowest = min(lowest, self._finish_due(t, now, tick_s))
            if not t.live:
                ended.append(t)
        for t in transfers:
            t.below = min(t.below, lowest)
        dirty.add(cid)
        if not ended:
            return
        del self._comps[cid]
        self._finish_s.pop(cid, None)
        dirty.discard(cid)
        for t in transfers:
            self._free_links(t.edges)
        for t in ended:
            _finished(self.env, t.done)  # not called here: the component is being split
            self.finished.append((t.tag, t.size, t.times, t.rows, t.end, t.course))
        for t in transfers:
            if t.live:
                self._join(t, dirty)

    def _rates_left(self, t: _Transfer, was: np.ndarray) -> np.ndarray:
        """The rates of ``t`` alone once some of its flows (``was``: those live before) have
        ended. When the flows that ended are exactly those of the top fill level, the others
        keep their rates, bit for bit, and no fair share is worked out::

            levels   r1 < r2 < ... < rK      progressive filling (_max_min_pairs)
            a flow frozen at rK crosses no link full below rK (it would have frozen there),
            so without it every link full below rK fills as before, from the same sums:
            the flows of levels r1 .. rK-1 get the same rates from the same operations

        This is how a transfer alone usually goes on: flows of one size end fastest first, a
        whole level at a time (a DP ring over 512 replicas whose twins meet different links, hop
        by hop: 2,000 flows, 250 levels, one fair share instead of 250). Otherwise, or when some flow
        rises without bound, :meth:`_rates_of` works them out."""
        key = t.key
        if len(t.idx) < len(was) and (key,) not in self._rates_cache:
            rate = t.rate
            gone = np.setdiff1d(was, t.idx, assume_unique=True)
            top = rate[gone]
            r_top = top.max()
            if r_top < np.inf and top.min() == r_top and rate[t.idx].max() < r_top:
                r = rate.copy()
                r[gone] = 0.0
                _remember(self._rates_cache, (key,), {key: r})
                return r
            t.below = min(t.below, float(top.min()))
        return self._rates_of([t])[key]

    def _rates_of(self, comp: list[_Transfer]) -> dict:
        """Rates per flow of each transfer of ``comp`` (full-length arrays, 0 for finished
        flows), by transfer key; cached per mix."""
        keys = [t.key for t in comp]
        mix = tuple(sorted(keys))
        by_key = self._rates_cache.get(mix)
        if by_key is None:
            below = min(t.below for t in comp)
            by_key = self._rates_above(comp, keys, below) if 0.0 < below < math.inf else self._solved(comp, keys)
            _remember(self._rates_cache, mix, by_key)
        return by_key

    def _solved(self, comp: list[_Transfer], keys: list) -> dict:
        """:meth:`_rates_of` worked out afresh: the max-min shares of every live flow."""
        flat = np.asarray(self._max_min_of(comp), dtype=np.float64)  # (one conversion, not one per transfer)
        by_key, k = {}, 0
        for t, key in zip(comp, keys):
            n = len(t.live)
            if key not in by_key:
                r = np.zeros(len(t.size))
                r[t.idx] = flat[k:k + n]
                by_key[key] = r
            k += n
        return by_key

    def _rates_above(self, comp: list[_Transfer], keys: list, below: float) -> dict:
        """:meth:`_rates_of` once flows of the mix last worked out have ended, none at a rate
        under ``below``: the flows that ran slower keep their rates, the others share what
        those leave (:meth:`_max_min_of` on the capacity left)::

            levels   r1 < r2 < ... < rK            progressive filling of the last mix
            flows ending at rates >= r*  cross no link that fills below r* (they would have
            frozen there): without them every level below r* fills as before, with the same
            flows; the flows at r* and above rise from there as from 0 on the capacity left
        """
        fixed, rest = [], []
        for t in comp:
            lo = t.rate[t.idx] < below
            fixed.append(t.idx[lo])
            rest.append(t.idx[~lo])
        out: dict = {}
        rates: list[float] = []
        if any(len(x) for x in rest):
            # the capacity left, in a scratch copy of every link's bandwidth put back link by
            # link afterwards: a fresh copy of 500,000 links (65,536 GPUs) cost more than the
            # fair share it served
            cap, taken = self._cap_scratch, []
            try:
                for t, idx in zip(comp, fixed):
                    if len(idx):  # what the flows that keep their rates take off their links
                        ptr, edge, w, sizes = self._plan_pairs(t.weights)
                        k = index_ranges(ptr, idx)
                        taken.append(edge[k])
                        np.subtract.at(cap, taken[-1], w[k] * np.repeat(t.rate[idx], sizes[idx]))
                rates = self._max_min_of(comp, rest, cap)
            finally:
                for edges in taken:
                    cap[edges] = self._bw_array[edges]
        k = 0
        for t, key, lo, hi in zip(comp, keys, fixed, rest):
            if key not in out:
                r = np.zeros(len(t.size))
                r[lo] = t.rate[lo]
                r[hi] = rates[k:k + len(hi)]
                out[key] = r
            k += len(hi)
        return out

    @cached_property
    def _bw_array(self) -> np.ndarray:
        return np.asarray(self.bw_Bps, dtype=np.float64)

    @cached_property
    def _cap_scratch(self) -> np.ndarray:
        """Every link's bandwidth, for :meth:`_rates_above` to take from and put back."""
        return self._bw_array.copy()

    def _max_min_of(self, comp: list[_Transfer], flows: list[np.ndarray] | None = None,
                    bw_Bps: list[float] | np.ndarray | None = None) -> list[float]:
        """:func:`max_min_rates` of the live flows of ``comp`` (``flows``: per transfer, which
        of its flows instead), in order, on the links' bandwidths (``bw_Bps``: capacities per
        link instead). A large mix is put together from each plan's (flow, link) pairs,
        flattened once per plan, not from the flows' tuples at every mix (a ring over 512
        replicas hop by hop: 98,000 pairs per mix)."""
        live = flows is None  # each transfer's live flows: their pairs are kept by its key
        flows = [t.idx for t in comp] if live else flows
        parts = [self._pairs_of(t.weights, idx, t.key if live else None) for t, idx in zip(comp, flows) if len(idx)]
        sizes = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
        pairs = int(sizes.sum())
        if pairs >= 64:  # max_min_rates' choice, on the arrays (it would read them out of the tuples)
            edge = np.concatenate([p[1] for p in parts])
            if pairs >= NUMPY_MIN_CELLS or len(sizes) * len(unique(edge)) >= NUMPY_MIN_CELLS:
                rates = _max_min_pairs(sizes, edge, np.concatenate([p[2] for p in parts]),
                                       self._bw_array if bw_Bps is None else bw_Bps)
                if rates is not None:
                    return rates
        # a small mix, or a flow that lists a link twice (what max_min_rates falls back to)
        return _max_min_loops([t.weights[i] for t, idx in zip(comp, flows) for i in idx.tolist()],
                              self.bw_Bps if bw_Bps is None else bw_Bps)

    def _pairs_of(self, weights: tuple, idx: np.ndarray, key: tuple | None) -> tuple[np.ndarray, ...]:
        """(links per flow, every pair's edge, its weight) of the flows ``idx`` of a plan, flow
        by flow, read off the plan's pairs (:meth:`_plan_pairs`); kept by ``key`` (a transfer's
        :attr:`~_Transfer.key`: its plan and live flows) where given: a mix is worked out
        afresh thousands of times from the same few transfers (a degraded NIC cable's MoE
        step: 5,955 fair shares of about 10 transfers), and gathering each one's pairs cost as
        much as the fair share itself."""
        got = self._live_pairs.get(key) if key is not None else None
        if got is None:
            ptr, edge, w, sizes = self._plan_pairs(weights)
            k = index_ranges(ptr, idx)
            got = (sizes[idx], edge[k], w[k])
            if key is not None:
                _remember(self._live_pairs, key, got)
        return got

    def _plan_pairs(self, weights: tuple, given: tuple | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """A plan's flows as (flow pointer, pair edges, pair weights, links per flow), once
        per plan (keyed by the identity of its weights, which the engine keeps alive), from
        its :attr:`FlowPlan.pairs` when ``given``, else read off ``weights``."""
        got = self._pairs_cache.get(id(weights))
        if got is None:
            sizes, edge, w = given if given is not None else _pairs(weights)
            got = self._pairs_cache[id(weights)] = (np.concatenate(([0], np.cumsum(sizes))), edge, w, sizes)
        return got

    def _reshare(self, dirty: set[int]) -> None:
        """New rates and finish times for the components in ``dirty``; schedule the next end."""
        now = self.env.now
        for cid in sorted(dirty):
            comp = self._comps[cid]
            by_key = self._rates_of(comp)
            soonest_s = float("inf")
            for t in comp:
                t.below = math.inf
                r = by_key[t.key]
                if r is not t.rate:  # same flows in the same mix keep their rates and end time
                    self._catch_up(t, now)
                    t.times.append(now)
                    t.rows.append(r)
                    t.rate = r
                    _set_next_end(t, now)
                soonest_s = min(soonest_s, t.next_s)
            if len(comp) == 1 and comp[0].ahead is None:  # alone: to its end at once
                self._run_ahead(comp[0])
                if not comp[0].live:
                    self._end_ahead(cid, comp[0])
                    continue
                soonest_s = comp[0].next_s
            self._finish_s[cid] = soonest_s
        self._plan_tick()

    def _plan_tick(self) -> None:
        """Make sure a tick is queued at or before the next flow end. A queued tick stays even
        if the flows it was for are slowed down by a transfer that joins: it then finds nothing
        due and plans the next one (cheaper than a fresh event per start or finish)."""
        if self._finish_s:
            at_s = min(self._finish_s.values())
            ticks = self._ticks
            if not ticks or at_s < ticks[0]:
                at_s = max(at_s, self.env.now)
                heapq.heappush(ticks, at_s)
                _call_at(self.env, at_s, self._tick)

    def _tick(self, _event=None) -> None:
        """Finish the flows due now, re-share where they ended."""
        heapq.heappop(self._ticks)  # this one: ticks fire in time order
        now = self.env.now
        dirty: set[int] = set()
        for cid in [c for c, t in self._finish_s.items() if t <= now * (1 + 1e-12) + 1e-15]:
            self._split(cid, dirty)
        self._reshare(dirty)
