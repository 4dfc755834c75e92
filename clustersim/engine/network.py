"""Flow-level network: transfers that share a link share its bandwidth (max-min fair).

Rates are recomputed only when a flow starts or ends (fluid model; Bertsekas & Gallager,
"Data Networks", Sec 6.5.2, progressive filling)::

    every unfrozen flow grows at the same rate until some link is full;
    freeze the flows on that link; repeat.

A representative flow that stands for k symmetric twins crossing the same link weighs k
there (weight = real flows / simulated flows on that link).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import simpy

from ..collectives import expand
from ..hardware.topology import Cluster
from ..program.tasks import Comm


@dataclass(frozen=True)
class FlowPlan:
    """A communication's simulated flows: per flow its edge weights and share of the size."""

    weights: tuple[tuple[tuple[int, float], ...], ...]  # per flow: ((edge, weight), ...)
    fractions: tuple[float, ...]  # per flow: bytes / size_bytes
    latency_s: float

    @property
    def edges(self) -> frozenset[int]:
        return frozenset(e for w in self.weights for e, _ in w)


def plan_flows(cluster: Cluster, comm: Comm) -> FlowPlan:
    """Expand ``comm`` (and its twins) into weighted flows on graph paths.

    Flow i of the simulated instance stands for flow i of every twin instance (its orbit).
    When every twin's flow i meets the same links (bandwidth, latency, how many of this
    communication's flows share each) the orbit is symmetric: the simulated flow carries
    weight real/simulated on its own links, which is exact. Otherwise (a twin crosses a spine
    the simulated one does not, say) the orbit's members are assumed to move at one rate and
    the simulated flow is constrained on every link any member crosses, with weight = members
    crossing it, and the orbit's worst latency: the slowest twin sets the pace.
    """
    node_of = cluster.node_of
    instances = [expand(comm.op, inst, 1.0, node_of).flows for inst in (comm.group, *comm.twins)]
    steps = expand(comm.op, comm.group, 1.0, node_of).steps
    paths = [[cluster.path(src, dst) for src, dst, _ in flows] for flows in instances]
    real: dict[int, int] = {}
    for inst in paths:
        for p in inst:
            for e in p:
                real[e] = real.get(e, 0) + 1
    bw, lat = cluster.edge_bw_Bps, cluster.edge_latency_s

    def signature(p):
        return tuple((bw[e], lat[e], real[e]) for e in p)

    rep_paths = paths[0]
    symmetric = all(signature(inst[i]) == signature(rep_paths[i]) for inst in paths[1:] for i in range(len(inst)))
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
    remaining: float
    size: float
    done: simpy.Event
    rate: float = 0.0


@dataclass
class FlowNetwork:
    """Active flows on the cluster's links; each start or finish re-shares bandwidth."""

    env: simpy.Environment
    bw_Bps: list[float]
    flows: list[_Flow] = field(default_factory=list)
    _last_s: float = 0.0
    _gen: int = 0
    # rates depend only on which flows are active (their weights), and a pipeline repeats the
    # same mixes of flows many times: remember them. Keys are ids of the plans' weight tuples,
    # which the engine keeps alive for the whole run.
    _rates_cache: dict = field(default_factory=dict)

    def transfer(self, plan: FlowPlan, size_bytes: float) -> simpy.Event:
        """Start ``plan``'s flows now (after its latency); the event fires when all are done."""
        done = [self.env.event() for _ in plan.fractions]
        start = self.env.timeout(plan.latency_s) if plan.latency_s > 0 else None

        def begin(_=None):
            self._advance()
            for ev, ws, frac in zip(done, plan.weights, plan.fractions):
                b = frac * size_bytes
                if not ws or b <= 0:
                    ev.succeed()
                else:
                    self.flows.append(_Flow(ws, b, b, ev))
            self._reshare()

        if start is None:
            begin()
        else:
            start.callbacks.append(begin)
        return self.env.all_of(done)

    def _advance(self) -> None:
        dt = self.env.now - self._last_s
        if dt > 0:
            for f in self.flows:
                f.remaining -= f.rate * dt
        self._last_s = self.env.now

    def _reshare(self) -> None:
        finished = [f for f in self.flows if f.remaining <= f.size * 1e-12]
        if finished:
            self.flows = [f for f in self.flows if f.remaining > f.size * 1e-12]
            for f in finished:
                f.done.succeed()
        self._gen += 1
        if not self.flows:
            return
        key = tuple(id(f.weights) for f in self.flows)
        rates = self._rates_cache.get(key)
        if rates is None:
            if len(self._rates_cache) > 100_000:
                self._rates_cache.clear()
            rates = self._rates_cache[key] = max_min_rates([f.weights for f in self.flows], self.bw_Bps)
        for f, r in zip(self.flows, rates):
            f.rate = r
        # a flow squeezed to 0 by rounding waits for the next re-share
        dt = min(f.remaining / f.rate for f in self.flows if f.rate > 0)
        gen = self._gen
        self.env.timeout(dt).callbacks.append(lambda _e: self._tick(gen))

    def _tick(self, gen: int) -> None:
        if gen != self._gen:
            return  # superseded by a later start or finish
        self._advance()
        # the flow(s) that were due now are done, even if float rounding leaves crumbs
        for f in self.flows:
            if f.remaining <= f.size * 1e-9:
                f.remaining = 0.0
        self._reshare()
