"""Flow-level network: transfers that share a link share its bandwidth (max-min fair).

Rates are recomputed only when a flow starts or ends (fluid model; Bertsekas & Gallager,
"Data Networks", Sec 6.5.2, progressive filling)::

    every unfrozen flow grows at the same rate until some link is full;
    freeze the flows on that link; repeat.

A representative flow that stands for k symmetric twins crossing the same link weighs k
there (weight = real flows / simulated flows on that link).
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass, field

import simpy

from ..collectives.algorithms import ALGORITHMS, phases
from ..hardware.topology import Cluster
from ..program.tasks import Comm


@dataclass(frozen=True)
class FlowPlan:
    """A communication's simulated flows: per flow its edge weights and share of the size."""

    weights: tuple[tuple[tuple[int, float], ...], ...]  # per flow: ((edge, weight), ...)
    fractions: tuple[float, ...]  # per flow: bytes / size_bytes, times ``wire_scale``
    latency_s: float
    # a flow's fraction is its bytes times this: > 1 where an algorithm sustains less of a
    # link's bandwidth than the link's own efficiency allows (NVLS)
    wire_scale: float = 1.0

    @property
    def edges(self) -> frozenset[int]:
        return frozenset(e for w in self.weights for e, _ in w)


def plan_flows(cluster: Cluster, comm: Comm) -> FlowPlan:
    """The single phase of ``comm`` by its default algorithm (ring, pairwise); see :func:`plan_phases`."""
    (plan,) = plan_phases(cluster, comm, ALGORITHMS[comm.op][0])
    return plan


def plan_phases(cluster: Cluster, comm: Comm, algo: str = "ring") -> tuple[FlowPlan, ...]:
    """Expand ``comm`` (and its twins) by ``algo`` into phases of weighted flows on graph paths.

    Flow i of the simulated instance stands for flow i of every twin instance (its orbit).
    When every twin's flow i meets the same links (bandwidth, latency, how many of this
    communication's flows share each) the orbit is symmetric: the simulated flow carries
    weight real/simulated on its own links, which is exact. Otherwise (a twin crosses a spine
    the simulated one does not, say) the orbit's members are assumed to move at one rate and
    the simulated flow is constrained on every link any member crosses, with weight = members
    crossing it, and the orbit's worst latency: the slowest twin sets the pace.
    """
    node_of = cluster.node_of
    per_group = {g: phases(comm.op, algo, g, node_of) for g in (comm.group, *comm.twins)}
    scale = 1.0
    if algo == "nvls":  # NVLS sustains its own, calibrated, share of the NVLink line rate
        scale = cluster.cfg.node.nvlink.efficiency / cluster.gpu.nvls_efficiency
    out = []
    for k in range(len(per_group[comm.group])):
        flows_of = {g: tuple((a, b, x * scale) for a, b, x in ph[k].flows) for g, ph in per_group.items()}
        plan = _plan_phase(cluster, comm, flows_of, per_group[comm.group][k].steps, (comm.op, algo) in MEMBER_SYMMETRIC,
                           direct=algo == "pairwise")
        out.append(dataclasses.replace(plan, wire_scale=scale))
    return tuple(out)


def _route(cluster: Cluster, direct: bool = False):
    """Edge ids from GPU to GPU; a flow from a GPU to itself is its loop through its NVSwitch
    (NVLS). NCCL forwards a transfer between GPUs on different rails through the sender's
    node-mate on the receiver's rail (PXN): a ring channel then enters and leaves every node
    through one NIC."""
    names, g, index = cluster.gpu_names, cluster.graph, cluster.edge_index

    def route(src: int, dst: int) -> tuple[int, ...]:
        if src == dst:
            sw = g.nodes[names[src]]["switch"]
            return (index[(names[src], sw)], index[(sw, names[src])])
        return cluster.path(src, dst) if direct else cluster.pxn_path(src, dst)

    return route


def _plan_phase(cluster: Cluster, comm: Comm, flows_of: dict, steps: int, member_symmetric: bool,
                direct: bool = False) -> FlowPlan:
    """One phase's plan, from each instance's flows (``flows_of[group]``); ``direct``: no PXN."""
    node_of = cluster.node_of
    route = _route(cluster, direct)
    # whole instances: the simulated one and its twins
    instances = [flows_of[g] for g in (comm.group, *comm.twins)]
    real_flows = [f for inst in instances for f in inst]
    if member_symmetric and len(comm.members) == 1 and comm.members[0] in comm.group \
            and _regular(comm.group, node_of):
        # one member's flows stand for all (much smaller), when that symmetry holds
        plan = _weigh(cluster, route, _by_member(comm, node_of, flows_of), real_flows, steps, require_symmetric=True)
        if plan is not None:
            return plan
    return _weigh(cluster, route, instances, real_flows, steps)


def _weigh(cluster: Cluster, route, instances, real_flows, steps: int, require_symmetric: bool = False):
    """The plan of ``instances[0]`` standing for all ``instances`` (see :func:`plan_flows`);
    None if ``require_symmetric`` and the orbits are not symmetric."""
    bw, lat = cluster.edge_bw_Bps, cluster.edge_latency_s
    paths = [[route(src, dst) for src, dst, _ in flows] for flows in instances]
    real: dict[int, int] = {}  # real flows on each link, each counted once
    for src, dst, _ in real_flows:
        for e in route(src, dst):
            real[e] = real.get(e, 0) + 1

    def signature(p):
        return tuple((bw[e], lat[e], real[e]) for e in p)

    rep_paths = paths[0]
    symmetric = all(signature(inst[i]) == signature(rep_paths[i]) for inst in paths[1:] for i in range(len(inst)))
    if require_symmetric and not symmetric:
        return None
    if symmetric:
        simulated: dict[int, int] = {}
        for p in rep_paths:
            for e in p:
                simulated[e] = simulated.get(e, 0) + 1
        weights = tuple(tuple((e, real[e] / simulated[e]) for e in p) for p in rep_paths)
        latency = max((cluster.path_latency_s(p) for p in rep_paths), default=0.0)
    else:
        orbit_weights = []
        for i in range(len(rep_paths)):
            n: dict[int, int] = {}
            for inst in paths:
                for e in inst[i]:
                    n[e] = n.get(e, 0) + 1
            orbit_weights.append(tuple(sorted(n.items())))
        weights = tuple(orbit_weights)
        latency = max((cluster.path_latency_s(p) for inst in paths for p in inst), default=0.0)
    return FlowPlan(weights=weights, fractions=tuple(b for _, _, b in instances[0]), latency_s=steps * latency)


# Collectives in which every member does the same, so that one member's flows stand for all:
# an all-to-all, and rings whose channels rotate every node's members (collectives/ring.py) on
# groups with the same number of members on every node. Not a ring shift (CP): its single
# ring mixes NVLink and NIC hops, so members differ.
MEMBER_SYMMETRIC = frozenset({("all_to_all", "pxn"), ("all_to_all", "pairwise"), ("all_reduce", "ring"), ("reduce_scatter", "ring"),
                              ("all_gather", "ring"), ("all_reduce", "hierarchical"), ("all_reduce", "nvls")})


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
        node_pos = {nd: i for i, nd in enumerate(nodes)}
        where = {x: (node_pos[node_of(x)], members.index(x)) for members in nodes.values() for x in members}
        regular = len({len(v) for v in nodes.values()}) == 1
        n_nodes, per, pos = len(nodes), len(next(iter(nodes.values()))), {x: i for i, x in enumerate(g)}

        def offset(a, b):
            """Where b is, seen from a."""
            if regular:
                (na, ia), (nb, ib) = where[a], where[b]
                return ((nb - na) % n_nodes, (ib - ia) % per)
            return (0, (pos[b] - pos[a]) % len(g))

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
            instances.append(tuple(sorted(out[x], key=lambda f: offset(x, f[1])))
                             + tuple(sorted(into[x], key=lambda f: offset(x, f[0]))))
    return instances


def max_min_rates(weights: list[tuple[tuple[int, float], ...]], bw_Bps: list[float]) -> list[float]:
    """Weighted max-min fair rates (bytes/s) of flows with the given per-edge weights."""
    n = len(weights)
    rates = [float("inf")] * n
    cap: dict[int, float] = {}
    load: dict[int, float] = {}
    on_edge: dict[int, list[int]] = {}
    for i, ws in enumerate(weights):
        for e, w in ws:
            cap[e] = bw_Bps[e]
            load[e] = load.get(e, 0.0) + w
            on_edge.setdefault(e, []).append(i)
    frozen = [not ws for ws in weights]
    left = n - sum(frozen)
    live = [e for e in sorted(load) if load[e] > 1e-12]
    while left:
        ratio = {e: max(cap[e], 0.0) / load[e] for e in live}
        r = min(ratio.values())
        # every link at the bottleneck level fills at once (symmetric flows tie exactly);
        # freezing them together gives the same rates in far fewer rounds
        full = [e for e in live if ratio[e] <= r * (1 + 1e-12)]
        for e_star in full:
            for i in on_edge[e_star]:
                if frozen[i]:
                    continue
                frozen[i], rates[i] = True, r
                left -= 1
                for e, w in weights[i]:
                    cap[e] -= w * r
                    load[e] -= w
        live = [e for e in live if load[e] > 1e-12 and ratio[e] > r * (1 + 1e-12)]
    return rates


@dataclass
class _Flow:
    weights: tuple[tuple[int, float], ...]
    remaining: float  # bytes left at time ``at_s``
    size: float
    done: simpy.Event
    rate: float = 0.0
    at_s: float = 0.0
    tag: object = None  # what the caller needs to know about it when it ends (link accounting)
    start_s: float = 0.0
    rates: list = field(default_factory=list)  # (from time, rate) each time its rate changed


@dataclass
class FlowNetwork:
    """Active flows on the cluster's links; a start or finish re-shares bandwidth where it
    changed, and only there.

    Flows are kept in *components*: groups that share no link with each other, directly or
    through other flows. Max-min fairness decomposes over components, so a start re-shares
    the component it joins (merging those it connects) and a finish the one it leaves (which
    may split); the others keep their rates and their finish times::

        stage 0   [a2a flows ......][DP ring .....]        one component per stage, mostly:
        stage 1        [a2a flows .......]                 a stage's mix recurs every
        stage 0->1            [PP send]  (joins both)      microbatch, so its rates are cached
    """

    env: simpy.Environment
    bw_Bps: list[float]
    _comps: dict = field(default_factory=dict)  # component id -> its flows
    _edge_comp: dict = field(default_factory=dict)  # link -> component id of the flows on it
    _finish_s: dict = field(default_factory=dict)  # component id -> when its next flow ends
    _next_id: int = 0
    _gen: int = 0
    # rates depend only on which flows are active (their weights), and a pipeline repeats the
    # same mixes of flows many times: remember them. Keys are ids of the plans' weight tuples,
    # which the engine keeps alive for the whole run.
    _rates_cache: dict = field(default_factory=dict)
    finished: list = field(default_factory=list)  # (tag, bytes, [(from time, rate)], end) of every flow, as it ends

    @property
    def flows(self) -> list[_Flow]:
        return [f for comp in self._comps.values() for f in comp]

    def transfer(self, plan: FlowPlan, size_bytes: float, tag=None) -> simpy.Event:
        """Start ``plan``'s flows now (after its latency); the event fires when all are done."""
        done = [self.env.event() for _ in plan.fractions]
        start = self.env.timeout(plan.latency_s) if plan.latency_s > 0 else None

        def begin(_=None):
            dirty: set[int] = set()
            for i, (ev, ws, frac) in enumerate(zip(done, plan.weights, plan.fractions)):
                b = frac * size_bytes
                if not ws or b <= 0:
                    ev.succeed()
                else:
                    now = self.env.now
                    self._join(_Flow(ws, b, b, ev, at_s=now, tag=(tag, i), start_s=now), dirty)
            if dirty:
                self._reshare(dirty)

        if start is None:
            begin()
        else:
            start.callbacks.append(begin)
        return self.env.all_of(done)

    def _catch_up(self, flows) -> None:
        """Bring ``flows``' remaining bytes to now, at the rates they had."""
        now = self.env.now
        for f in flows:
            if f.at_s != now:
                f.remaining -= f.rate * (now - f.at_s)
                f.at_s = now

    def _join(self, flow: _Flow, dirty: set[int]) -> None:
        """Add ``flow`` to the component of its links, merging the components it connects."""
        met = {self._edge_comp[e] for e, _ in flow.weights if e in self._edge_comp}
        if met:
            target = max(met, key=lambda c: (len(self._comps[c]), -c))
            for c in sorted(met - {target}):
                moved = self._comps.pop(c)
                self._finish_s.pop(c, None)
                dirty.discard(c)
                self._comps[target].extend(moved)
                for g in moved:
                    for e, _ in g.weights:
                        self._edge_comp[e] = target
        else:
            target = self._next_id
            self._next_id += 1
            self._comps[target] = []
        self._comps[target].append(flow)
        for e, _ in flow.weights:
            self._edge_comp[e] = target
        dirty.add(target)

    def _split(self, cid: int, dirty: set[int]) -> None:
        """Finish the due flows of component ``cid``; the rest regroup by shared links."""
        flows = self._comps.pop(cid)
        self._finish_s.pop(cid, None)
        dirty.discard(cid)
        self._catch_up(flows)
        for f in flows:
            for e, _ in f.weights:
                self._edge_comp.pop(e, None)
        rest = []
        # the clock cannot resolve less than a few ulps: a flow due within them is due now
        tick_s = 4 * math.ulp(self.env.now)
        for f in flows:
            # due now, or left with float crumbs of a transfer that was due now
            if f.remaining <= max(f.size * 1e-9, f.rate * tick_s):
                f.done.succeed()
                self.finished.append((f.tag, f.size, f.rates, self.env.now))
            else:
                rest.append(f)
        for f in rest:
            self._join(f, dirty)

    def _reshare(self, dirty: set[int]) -> None:
        """New rates and finish times for the components in ``dirty``; schedule the next end."""
        now = self.env.now
        for cid in sorted(dirty):
            comp = self._comps[cid]
            self._catch_up(comp)
            # flows with the same weights (the same flow of the same plan) are interchangeable
            # in max-min and get the same rate, so a mix is a sorted multiset, whatever the order
            ids = [id(f.weights) for f in comp]
            key = tuple(sorted(ids))
            by_id = self._rates_cache.get(key)
            if by_id is None:
                if len(self._rates_cache) > 100_000:
                    self._rates_cache.clear()
                by_id = self._rates_cache[key] = dict(zip(ids, max_min_rates([f.weights for f in comp],
                                                                             self.bw_Bps)))
            for f, i in zip(comp, ids):
                if by_id[i] != f.rate:
                    f.rates.append((now, by_id[i]))
                f.rate = by_id[i]
            # a flow squeezed to 0 by rounding waits for the next re-share
            self._finish_s[cid] = now + min((f.remaining / f.rate for f in comp if f.rate > 0), default=float("inf"))
        self._gen += 1
        if self._finish_s:
            gen = self._gen
            self.env.timeout(max(0.0, min(self._finish_s.values()) - now)).callbacks.append(
                lambda _e: self._tick(gen))

    def _tick(self, gen: int) -> None:
        if gen != self._gen:
            return  # superseded by a later start or finish
        now = self.env.now
        dirty: set[int] = set()
        for cid in [c for c, t in self._finish_s.items() if t <= now * (1 + 1e-12) + 1e-15]:
            self._split(cid, dirty)
        self._reshare(dirty)
