"""Cluster topology: YAML description -> networkx graph -> routed paths between GPUs.

The graph holds every GPU, NVSwitch, NIC and fabric switch as a node and every cable as a
pair of directed edges (one per direction, each with its own bandwidth)::

      n0.gpu0 ─┐            ┌─ n0.nic0 ── leaf0.0 ──┐
      n0.gpu1 ─┼─ n0.nvsw   │  (PCIe)     (rail 0)  ├── spine0 ...
        ...   ─┘            └─ n0.nic1 ── leaf0.1 ──┘
                 NVLink        one NIC per GPU      leaf/spine (rail-optimised: one leaf
                                                    per rail per group of nodes)

Edge attributes: ``line_bw_Bps`` (line rate), ``efficiency`` (fraction a long transfer
reaches), ``bw_Bps`` = line × efficiency (what transfers see), ``latency_s``.

Routing: inside a node GPU → NVSwitch → GPU; across nodes GPU → NIC → leaf → [spine →
leaf] → NIC → GPU. Among equal-cost spine paths one is picked by a stable hash of the
endpoints (static ECMP), so two flows may collide on a spine link as they do in real fabrics.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Literal

import networkx as nx
import pydantic

from ..errors import ConfigError
from ..yamlio import Strict, read_yaml, validate
from .gpus import GpuSpec, lookup_gpu


class LinkCfg(Strict):
    """One kind of link. Bandwidth per direction."""

    bw_GBps: float | None = pydantic.Field(default=None, gt=0)
    latency_us: float = pydantic.Field(default=1.0, ge=0)
    efficiency: float = pydantic.Field(default=1.0, gt=0, le=1)


class NicCfg(Strict):
    bw_Gbps: float = pydantic.Field(default=200, gt=0)
    latency_us: float = pydantic.Field(default=1.0, ge=0)
    efficiency: float = pydantic.Field(default=1.0, gt=0, le=1)


class NodeCfg(Strict):
    gpus: int = pydantic.Field(default=8, ge=1)
    nvlink: LinkCfg = LinkCfg()
    nics: int | None = pydantic.Field(default=None, ge=1, description="NICs per node; default one per GPU")
    nic: NicCfg = NicCfg()
    pcie_GBps: float = pydantic.Field(default=32, gt=0, description="GPU <-> NIC, per direction")

    @pydantic.model_validator(mode="after")
    def _nics_divide(self):
        if self.nics is not None and self.gpus % self.nics:
            raise ValueError(f"node.nics={self.nics} does not divide node.gpus={self.gpus}")
        return self


class FabricCfg(Strict):
    kind: Literal["leaf_spine", "none"] = "leaf_spine"
    rail_optimized: bool = True
    nodes_per_leaf: int = pydantic.Field(default=16, ge=1)
    spines: int | None = pydantic.Field(default=None, ge=1, description="default: one per leaf")
    oversubscription: float = pydantic.Field(default=1.0, ge=1.0)
    latency_us: float = pydantic.Field(default=0.6, ge=0, description="per switch-to-switch hop")
    efficiency: float = pydantic.Field(default=1.0, gt=0, le=1)


class TopologyCfg(Strict):
    name: str = "cluster"
    gpu: str
    nodes: int = pydantic.Field(default=1, ge=1)
    node: NodeCfg = NodeCfg()
    fabric: FabricCfg = FabricCfg()

    @pydantic.model_validator(mode="after")
    def _fabric_joins_nodes(self):
        if self.nodes > 1 and self.fabric.kind == "none":
            raise ValueError(f"fabric.kind is 'none' but the cluster has {self.nodes} nodes; "
                             "use leaf_spine to join them")
        return self

    @pydantic.field_validator("gpu")
    @classmethod
    def _known_gpu(cls, v: str) -> str:
        try:
            lookup_gpu(v)
        except KeyError as exc:
            raise ValueError(exc.args[0]) from None
        return v


def load_topology_cfg(path: Path, overrides: dict | None = None) -> TopologyCfg:
    """Read a topology YAML; ``overrides`` (e.g. ``{"nodes": 128}`` from a scenario) win."""
    data = read_yaml(path, what="topology")
    data.update(overrides or {})
    return validate(TopologyCfg, data, source=str(path))


@dataclass
class Cluster:
    """The built cluster: the graph, the GPU spec, and indexed links for the network model."""

    cfg: TopologyCfg
    gpu: GpuSpec
    graph: nx.DiGraph
    gpu_names: list[str]  # global GPU index -> graph node
    edges: list[tuple[str, str]] = field(default_factory=list)  # edge id -> (u, v)

    @property
    def gpus_per_node(self) -> int:
        return self.cfg.node.gpus

    @property
    def num_gpus(self) -> int:
        return len(self.gpu_names)

    @cached_property
    def edge_index(self) -> dict[tuple[str, str], int]:
        return {e: i for i, e in enumerate(self.edges)}

    @cached_property
    def edge_bw_Bps(self) -> list[float]:
        return [self.graph.edges[e]["bw_Bps"] for e in self.edges]

    @cached_property
    def edge_latency_s(self) -> list[float]:
        return [self.graph.edges[e]["latency_s"] for e in self.edges]

    @cached_property
    def _fabric(self) -> nx.Graph:
        keep = [n for n, k in self.graph.nodes(data="kind") if k in ("leaf", "spine")]
        return self.graph.subgraph(keep)

    def _leaf_route(self, a: str, b: str, salt: str) -> list[str]:
        key = (a, b)
        cache = self.__dict__.setdefault("_leaf_routes", {})
        if key not in cache:
            cache[key] = sorted(nx.all_shortest_paths(self._fabric, a, b))
        routes = cache[key]
        return routes[zlib.crc32(salt.encode()) % len(routes)]

    def node_of(self, gpu: int) -> int:
        """The node (server) GPU ``gpu`` sits in."""
        return gpu // self.cfg.node.gpus

    def path(self, src: int, dst: int) -> tuple[int, ...]:
        """Edge ids from GPU ``src`` to GPU ``dst`` (global indices); empty when src == dst."""
        cache = self.__dict__.setdefault("_paths", {})
        key = (src, dst)
        if key in cache:
            return cache[key]
        g = self.graph
        s, d = self.gpu_names[src], self.gpu_names[dst]
        if s == d:
            hops: list[str] = [s]
        elif g.nodes[s]["node"] == g.nodes[d]["node"]:
            hops = [s, g.nodes[s]["switch"], d]
        else:
            nic_s, nic_d = g.nodes[s]["nic"], g.nodes[d]["nic"]
            leaf_s, leaf_d = g.nodes[nic_s]["leaf"], g.nodes[nic_d]["leaf"]
            if leaf_s is None or leaf_d is None:
                raise ConfigError("GPUs on different nodes but the topology has no fabric",
                                  field="fabric.kind")
            mid = [leaf_s] if leaf_s == leaf_d else self._leaf_route(leaf_s, leaf_d, f"{s}>{d}")
            hops = [s, nic_s, *mid, nic_d, d]
        ids = tuple(self.edge_index[(u, v)] for u, v in zip(hops, hops[1:]))
        cache[key] = ids
        return ids

    def pxn_proxy(self, src: int, dst: int) -> int | None:
        """The GPU on ``src``'s node that forwards to ``dst`` over its own rail (NCCL's PXN),
        or None when ``src`` reaches ``dst`` without crossing rails (same node, same rail, or a
        fabric that is not rail-optimised)::

            n0.gpu2 ─NVLink─ n0.gpu5 ─nic5─ leaf.5 ─nic5─ n1.gpu5     instead of
            n0.gpu2 ─nic2─ leaf.2 ─ spine ─ leaf.5 ─nic5─ n1.gpu5

        The proxy is the GPU with ``dst``'s local index (it shares dst's rail when every GPU has
        its own NIC), else the first GPU behind a NIC of dst's rail.
        """
        g = self.graph
        s, d = g.nodes[self.gpu_names[src]], g.nodes[self.gpu_names[dst]]
        if s["node"] == d["node"] or not self.cfg.fabric.rail_optimized:
            return None
        rail = g.nodes[d["nic"]]["leaf"].split(".")[-1] if g.nodes[d["nic"]]["leaf"] else None
        if rail is None or g.nodes[s["nic"]]["leaf"].split(".")[-1] == rail:
            return None
        per_node = self.cfg.node.gpus
        first = s["node"] * per_node
        candidates = [first + d["local"]] + list(range(first, first + per_node))
        for c in candidates:
            if g.nodes[g.nodes[self.gpu_names[c]]["nic"]]["leaf"].split(".")[-1] == rail:
                return c
        return None

    def pxn_path(self, src: int, dst: int) -> tuple[int, ...]:
        """Edge ids from ``src`` to ``dst`` through the PXN proxy when there is one."""
        via = self.pxn_proxy(src, dst)
        return self.path(src, dst) if via is None else self.path(src, via) + self.path(via, dst)

    def path_latency_s(self, path: tuple[int, ...]) -> float:
        lat = self.edge_latency_s
        return sum(lat[e] for e in path)

    def path_bw_Bps(self, path: tuple[int, ...]) -> float:
        bw = self.edge_bw_Bps
        return min((bw[e] for e in path), default=math.inf)


def _link(g: nx.DiGraph, u: str, v: str, line_bw_Bps: float, eff: float, latency_s: float, kind: str):
    """Add a full-duplex cable: two directed edges with the same figures."""
    for a, b in ((u, v), (v, u)):
        g.add_edge(a, b, line_bw_Bps=line_bw_Bps, efficiency=eff,
                   bw_Bps=line_bw_Bps * eff, latency_s=latency_s, kind=kind)


def build_cluster(cfg: TopologyCfg) -> Cluster:
    """Build the graph described by ``cfg`` (pure; same cfg -> same graph, same edge order)."""
    gpu = lookup_gpu(cfg.gpu)
    n = cfg.node
    nics = n.nics or n.gpus
    nvl_bw = (n.nvlink.bw_GBps * 1e9) if n.nvlink.bw_GBps else gpu.nvlink_bw_Bps
    nic_bw = n.nic.bw_Gbps * 1e9 / 8
    g = nx.DiGraph(name=cfg.name)
    gpu_names: list[str] = []
    fab = cfg.fabric
    rails = nics if fab.rail_optimized else 1
    groups = math.ceil(cfg.nodes / fab.nodes_per_leaf)
    has_fabric = fab.kind == "leaf_spine" and cfg.nodes > 1

    for i in range(cfg.nodes):
        sw = f"n{i}.nvsw" if n.gpus > 1 else None
        if sw:
            g.add_node(sw, kind="nvswitch", node=i)
        for k in range(nics):
            leaf = f"leaf{i // fab.nodes_per_leaf}.{k % rails}" if has_fabric else None
            g.add_node(f"n{i}.nic{k}", kind="nic", node=i, leaf=leaf)
        for j in range(n.gpus):
            name = f"n{i}.gpu{j}"
            nic = f"n{i}.nic{j // (n.gpus // nics)}"
            g.add_node(name, kind="gpu", node=i, local=j, switch=sw, nic=nic)
            gpu_names.append(name)
            if sw:
                _link(g, name, sw, nvl_bw, n.nvlink.efficiency, n.nvlink.latency_us * 1e-6, "nvlink")
            _link(g, name, nic, n.pcie_GBps * 1e9, 1.0, 0.0, "pcie")

    if has_fabric:
        leaves = [f"leaf{gi}.{r}" for gi in range(groups) for r in range(rails)]
        for leaf in leaves:
            g.add_node(leaf, kind="leaf")
        for i in range(cfg.nodes):
            for k in range(nics):
                nic = f"n{i}.nic{k}"
                _link(g, nic, g.nodes[nic]["leaf"], nic_bw, n.nic.efficiency, n.nic.latency_us * 1e-6, "nic")
        if len(leaves) > 1:
            spines = fab.spines or len(leaves)
            down_per_leaf = fab.nodes_per_leaf * nics // rails
            up_bw = down_per_leaf * nic_bw / (spines * fab.oversubscription)
            for s in range(spines):
                g.add_node(f"spine{s}", kind="spine")
                for leaf in leaves:
                    _link(g, leaf, f"spine{s}", up_bw, fab.efficiency, fab.latency_us * 1e-6, "fabric")
    return Cluster(cfg=cfg, gpu=gpu, graph=g, gpu_names=gpu_names, edges=list(g.edges()))
