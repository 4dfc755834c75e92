"""Cluster topology: YAML description -> networkx graph -> routed paths between GPUs.

The graph holds every GPU, NVSwitch, NIC and fabric switch as a node and every cable as a
pair of directed edges (one per direction, each with its own bandwidth)::

      n0.gpu0 ─┐            ┌─ n0.nic0 ── leaf0.0 ──┐
      n0.gpu1 ─┼─ n0.nvsw   │  (PCIe)     (rail 0)  ├── spine0 ...          [── core0.0 ...]
        ...   ─┘            └─ n0.nic1 ── leaf0.1 ──┘   (pod0.spine0 ... in 3 tiers)
                 NVLink        one NIC per GPU      leaf/spine (rail-optimised: one leaf
                                                    per rail per group of nodes)

Fabric kinds (``fabric.kind``): ``none`` (one node), ``leaf_spine`` (two tiers, switch counts
given) and ``fat_tree`` (two or three tiers, switch counts derived from the switch radix, see
:func:`plan_fabric`). Switch vertices carry ``tier``: 1 leaf, 2 spine, 3 core.

Edge attributes: ``line_bw_Bps`` (line rate), ``efficiency`` (fraction a long transfer
reaches), ``bw_Bps`` = line × efficiency (what transfers see), ``latency_s``; a NIC that
several GPUs share (``node.nics`` below ``node.gpus``) also ``cap_Bps``, its one PCIe link
to the host (``node.pcie_GBps``), and ``bw_Bps`` = min(line × efficiency, cap): each GPU's
PCIe link into the NIC's PCIe switch is its own edge, the NIC's link out of it is not.

Routing: inside a node GPU → NVSwitch → GPU; across nodes GPU → NIC → leaf → [spine → [core →
spine] →] leaf → NIC → GPU, never through another GPU. Between two leaves the routes are the
shortest up-down (valley-free) paths, as a Clos fabric's routing gives them; where several are
equal each switch picks one of its links by a CRC32 hash of the endpoints (static ECMP), so
two flows may collide on a spine link as they do in real fabrics.

Fault what-ifs (``what_if``) degrade or remove cables and switches of the built graph; routes
are then computed on what remains (see :func:`_apply_what_ifs`).
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from operator import itemgetter
from pathlib import Path
from typing import Literal

import networkx as nx
import numpy as np
import pydantic

from ..errors import ConfigError
from ..floats import sum_left
from ..trace import first_and_inverse
from ..yamlio import Strict, read_yaml, refused_alone, short_repr, validate
from .ecmp import Continuations
from .gpus import GpuSpec, lookup_gpu

# Switch vertex kinds of the scale-out fabric and their tier (height above the NICs)
TIERS = {"leaf": 1, "spine": 2, "core": 3}

# Size caps, checked from the config before any graph is built (see :func:`check_size`)
MAX_GPUS = 131_072  # the cluster graph and its routes are built in memory (5-10 s at this size)
MAX_FABRIC_CABLES = 200_000  # switch-to-switch cables (~2 s to build); dgx-a100.yaml at MAX_GPUS has 131,200
MAX_SLOWDOWN = 1000.0  # a straggler's compute time factor (its what_if entries multiplied)
MAX_PORTS = 65_536  # fabric.radix, .spines, .nodes_per_leaf, .leaves_per_pod: more than any switch


class LinkCfg(Strict):
    """One kind of link. Bandwidth per direction."""

    # bounds keep bytes/s and seconds finite and positive (1e300 GB/s would overflow to inf)
    bw_GBps: float | None = pydantic.Field(default=None, ge=1e-3, le=1e6)
    latency_us: float = pydantic.Field(default=1.0, ge=0, le=1e6)
    efficiency: float = pydantic.Field(default=1.0, ge=0.01, le=1)
    # NVLS moves at its own share of the line rate, not at ``efficiency``'s: an H100 node's
    # all-reduce busbw (NVLS) fits this, its all-gather's (a ring) fits ``efficiency``
    nvls_efficiency: float | None = pydantic.Field(
        default=None, ge=0.01, le=1, description="NVLink: the share of the line rate NVLS all-reduces sustain; "
        "default the GPU catalogue's (H100 0.608); only on GPUs whose NVSwitch reduces")


class NicCfg(Strict):
    bw_Gbps: float = pydantic.Field(default=200, ge=1e-2, le=1e7)
    latency_us: float = pydantic.Field(default=1.0, ge=0, le=1e6)
    efficiency: float = pydantic.Field(default=1.0, ge=0.01, le=1)


class HostCfg(Strict):
    """A node's host: the CPUs' memory and each GPU's copies to it, which optimizer offload
    (``training.optimizer_offload``) uses. Bandwidths per direction."""

    memory_GB: float = pydantic.Field(ge=1e-3, le=1e9, description="the node's host memory (DRAM)")
    memory_GBps: float = pydantic.Field(
        ge=1e-3, le=1e7, description="the bandwidth the node's host memory sustains (STREAM-like), shared by its "
        "GPUs' ranks when they step their offloaded optimizer states at once")
    copy_GBps: float = pydantic.Field(
        ge=1e-3, le=1e7, description="what each GPU's copies to or from pinned host memory reach while every GPU "
        "of the node copies, per direction (a PCIe switch's uplink shared by two GPUs halves it)")


class NodeCfg(Strict):
    gpus: int = pydantic.Field(default=8, ge=1, le=MAX_GPUS)
    nvlink: LinkCfg = LinkCfg()
    nics: int | None = pydantic.Field(default=None, ge=1, description="NICs per node; default one per GPU")
    nic: NicCfg = NicCfg()
    pcie_GBps: float = pydantic.Field(default=32, ge=1e-3, le=1e6, description="GPU <-> NIC, per direction")
    host: HostCfg | None = pydantic.Field(default=None, description="host memory and copies; needed by optimizer "
                                          "offload only")

    @pydantic.model_validator(mode="after")
    def _nics_divide(self):
        if self.nics is not None and self.gpus % self.nics:
            raise ValueError(f"node.nics={self.nics} does not divide node.gpus={self.gpus}")
        return self


# fields that only one fabric kind reads; giving one to another kind is an error, not a no-op
_KIND_ONLY = {"spines": "leaf_spine", "radix": "fat_tree", "tiers": "fat_tree",
              "pod_oversubscription": "fat_tree", "leaves_per_pod": "fat_tree"}


class FabricCfg(Strict):
    kind: Literal["leaf_spine", "fat_tree", "none"] = "leaf_spine"
    rail_optimized: bool = True
    nodes_per_leaf: int | None = pydantic.Field(
        default=None, ge=1, le=MAX_PORTS, description="leaf_spine: default 16; fat_tree: default from radix")
    spines: int | None = pydantic.Field(default=None, ge=1, le=MAX_PORTS, description="leaf_spine; default: one per leaf")
    # null where not given, so that a field the kind does not read is refused even at its
    # default (a leaf_spine with radix: 64 would read as bounded by it); a fat tree fills them in
    radix: int | None = pydantic.Field(default=None, ge=2, le=MAX_PORTS,
                                       description="fat_tree: ports per switch; default 64")
    tiers: Literal[2, 3] | None = pydantic.Field(default=None, description="fat_tree: 2 or 3; default 2")
    oversubscription: float = pydantic.Field(default=1.0, ge=1.0, le=1000.0)
    pod_oversubscription: float | None = pydantic.Field(default=None, ge=1.0, le=1000.0,
                                                        description="fat_tree, 3 tiers; default 1")
    leaves_per_pod: int | None = pydantic.Field(default=None, ge=1, le=MAX_PORTS, description="fat_tree, 3 tiers")
    latency_us: float = pydantic.Field(default=0.6, ge=0, le=1e6, description="per switch-to-switch hop")
    efficiency: float = pydantic.Field(default=1.0, ge=0.01, le=1)
    routing: Literal["hash", "destination"] = pydantic.Field(
        default="hash", description="how a switch picks among equal-cost uplinks: hash (ECMP on the endpoints, as "
        "Ethernet/RoCE fabrics do) or destination (by the destination NIC's port on its leaf, D-mod-k, as an "
        "InfiniBand subnet manager's fat-tree routing does)")

    @pydantic.model_validator(mode="before")
    @classmethod
    def _fat_tree_defaults(cls, data):
        """A fat tree's radix, tiers and (3 tiers) pod oversubscription where not given."""
        if not isinstance(data, dict) or data.get("kind") != "fat_tree":
            return data
        data = dict(data)
        for name, default in (("radix", 64), ("tiers", 2)):
            if data.get(name) is None:
                data[name] = default
        if data["tiers"] == 3 and data.get("pod_oversubscription") is None:
            data["pod_oversubscription"] = 1.0
        return data

    @pydantic.model_validator(mode="after")
    def _fields_of_kind(self):
        # given: not null (a dumped config, whose every field is written, reloads); kind none
        # reads none of them
        for name, kind in _KIND_ONLY.items():
            if getattr(self, name) is not None and kind != self.kind:
                raise ValueError(f"fabric.{name} is read by kind {kind} only (kind is {self.kind}); "
                                 "leave it out or set it to null")
        if self.kind == "fat_tree" and self.tiers == 2:
            for name in ("pod_oversubscription", "leaves_per_pod"):
                if getattr(self, name) is not None:
                    raise ValueError(f"fabric.{name} is read by a 3-tier fat tree only (tiers is 2); "
                                     "leave it out or set it to null")
        return self


class WhatIfCfg(Strict):
    """One fault what-if; exactly one of the shapes in ``WHAT_IF_SHAPES``."""

    link: str | None = pydantic.Field(default=None, description='a cable "u-v" to degrade (with bw_factor)')
    bw_factor: float | None = pydantic.Field(default=None, ge=1e-6, description="its bandwidth x this, both ways")
    remove_link: str | None = pydantic.Field(default=None, description='a network cable "u-v" to take out')
    remove_switch: str | None = pydantic.Field(default=None, description="a leaf, spine or core to take out")
    gpu: int | None = pydantic.Field(default=None, ge=0, description="a GPU (global index) that runs slow")
    slowdown: float | None = pydantic.Field(default=None, ge=1, le=MAX_SLOWDOWN, description="its compute time x this")

    @pydantic.model_validator(mode="after")
    def _one_shape(self):
        given = frozenset(k for k in type(self).model_fields if getattr(self, k) is not None)
        if given not in WHAT_IF_SHAPES:
            shapes = ", ".join("{" + ", ".join(sorted(s, key=list(type(self).model_fields).index)) + "}"
                               for s in WHAT_IF_SHAPES)
            raise ValueError(f"a what_if entry is one of {shapes}; got {{{', '.join(sorted(given))}}}")
        return self


WHAT_IF_SHAPES = (frozenset({"link", "bw_factor"}), frozenset({"remove_link"}),
                  frozenset({"remove_switch"}), frozenset({"gpu", "slowdown"}))


class TopologyCfg(Strict):
    name: str = "cluster"
    gpu: str
    nodes: int = pydantic.Field(default=1, ge=1)
    node: NodeCfg = NodeCfg()
    fabric: FabricCfg = FabricCfg()
    what_if: list[WhatIfCfg] = pydantic.Field(default_factory=list)
    # the file it was read from, for error lines raised when the graph is built
    _source: str | None = pydantic.PrivateAttr(default=None)
    # the file's own fields as read, before the scenario's changes ({}: not read from a file)
    _file_data: dict = pydantic.PrivateAttr(default_factory=dict)

    @pydantic.field_validator("fabric")
    @classmethod
    def _fabric_joins_nodes(cls, v: FabricCfg, info: pydantic.ValidationInfo) -> FabricCfg:
        nodes = info.data.get("nodes", 1)  # absent when nodes itself is invalid (reported)
        if nodes > 1 and v.kind == "none":
            raise ValueError(f"fabric.kind is 'none' but the cluster has {nodes} nodes; "
                             "use leaf_spine or fat_tree to join them")
        return v

    @pydantic.field_validator("node")
    @classmethod
    def _nvls_where_the_switch_reduces(cls, v: NodeCfg, info: pydantic.ValidationInfo) -> NodeCfg:
        gpu = info.data.get("gpu")  # (absent where the GPU is unknown, reported)
        if v.nvlink.nvls_efficiency is not None and gpu is not None and lookup_gpu(gpu).nvls_efficiency is None:
            raise ValueError(f"node.nvlink.nvls_efficiency is read only where the NVSwitch reduces (NVLS: H100, "
                             f"H800, H200, B200); {lookup_gpu(gpu).name}'s does not")
        return v

    @pydantic.field_validator("gpu")
    @classmethod
    def _known_gpu(cls, v: str) -> str:
        try:
            lookup_gpu(v)
        except KeyError as exc:  # (a name the catalogue lacks, whatever the rest: refused alone)
            if len(v) > 40:  # the catalogue's message quotes the name whole
                raise refused_alone(f"unknown GPU {short_repr(v)} (see the GPU catalogue in docs/reference.md)") \
                    from None
            raise refused_alone(exc.args[0]) from None
        return v


def _merged(data: dict, overrides: dict) -> dict:
    """``data`` with ``overrides`` in: a mapping given for a mapping merged into it key by key
    (``{"node": {"nic": {"bw_Gbps": 800}}}`` keeps the node's other fields), anything else
    replacing what is there."""
    out = dict(data)
    for k, v in overrides.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_topology_cfg(path: Path, overrides: dict | None = None, *, build: bool = True) -> TopologyCfg:
    """Read a topology YAML; ``overrides`` (e.g. ``{"nodes": 128}`` or ``{"node": {"nic":
    {"bw_Gbps": 800}}}`` from a scenario's cluster section) win, merged key by key.

    Also checks what the fields imply together (fat-tree switch counts against the radix, the
    size caps of :func:`check_size`) and, with ``build``, checks ``what_if`` (see
    :func:`check_what_ifs`) so that a misspelt name or a partitioning fault is reported now,
    naming the file and the entry. ``load_scenario`` passes ``build=False`` and checks the
    what-ifs after its own, cheaper checks, with the scenario's what-ifs merged in.
    """
    data = read_yaml(path, what="topology")
    if "gpu" not in data and {"cluster", "model"} & data.keys():
        has = " and ".join(k for k in ("cluster", "model") if k in data)
        raise ConfigError(f"this is a scenario file (it has {has}, not gpu); give a topology file, "
                          "such as topologies/dgx-h100.yaml", source=str(path))
    cfg = validate(TopologyCfg, _merged(data, overrides or {}), source=str(path))
    cfg._source = str(path)
    cfg._file_data = data  # (_merged copies what it changes: the file's own stays as read)
    check_size(cfg)
    if build:
        check_what_ifs(cfg)
    return cfg


def check_what_ifs(cfg: TopologyCfg) -> Cluster | None:
    """Check ``cfg.what_if`` without simulating: GPU indices in range and, when an entry
    degrades or removes a cable or switch, the names and the reach of every GPU, on the built
    graph, which is returned (None when no graph was needed)."""
    gpus = cfg.nodes * cfg.node.gpus
    slow: dict[int, float] = {}
    for i, w in enumerate(cfg.what_if):
        if w.gpu is not None and w.gpu >= gpus:
            raise _fail(cfg, f"what_if[{i}]", f"GPU {w.gpu} does not exist; the cluster has GPUs 0-{gpus - 1}")
        if w.gpu is not None and (f := slow.setdefault(w.gpu, 1.0) * w.slowdown) > MAX_SLOWDOWN:
            # each entry's own bound, for the entries of one GPU together (they multiply)
            raise _fail(cfg, f"what_if[{i}]", f"GPU {w.gpu}'s slowdowns multiply to {f:.3g}, more than "
                                              f"{MAX_SLOWDOWN:g}")
        elif w.gpu is not None:
            slow[w.gpu] = f
    if all(w.gpu is not None for w in cfg.what_if):
        return None
    return cluster_of(cfg)


def check_size(cfg: TopologyCfg) -> FabricPlan | None:
    """Refuse, before anything is built, a cluster too large to build in seconds: more than
    ``MAX_GPUS`` GPUs, or a fabric of more than ``MAX_FABRIC_CABLES`` switch-to-switch cables
    (e.g. ``leaf_spine`` without ``spines``, one per leaf, on thousands of leaves, or a
    fat tree whose huge radix derives tens of thousands of spines). Returns the fabric plan."""
    world = cfg.nodes * cfg.node.gpus
    if world > MAX_GPUS:
        raise _fail(cfg, "nodes", f"{short_repr(cfg.nodes)} nodes x {cfg.node.gpus} GPUs = "
                                  f"{f'{world:,}' if world < 10**30 else short_repr(world)} "
                                  f"GPUs; clustersim builds the cluster graph in memory and takes at most "
                                  f"{MAX_GPUS:,} GPUs: use fewer nodes")
    plan = plan_fabric(cfg)
    if plan is None or cfg.nodes < 2 or plan.leaves < 2:
        return plan
    fab = cfg.fabric
    switches = plan.leaves + plan.spines * max(plan.pods, 1)
    cables = plan.leaves * plan.spines
    if plan.pods > 1:
        switches += plan.spines * plan.cores_per_plane
        cables += plan.spines * plan.cores_per_plane * plan.pods
    if cables <= MAX_FABRIC_CABLES:
        return plan
    what = f"{switches:,} switches joined by {cables:,} cables; clustersim builds fabrics of at most " \
           f"{MAX_FABRIC_CABLES:,} switch-to-switch cables"
    if fab.kind == "leaf_spine":
        if fab.spines is None:
            raise _fail(cfg, "fabric.spines", f"not set, so one spine per leaf: {plan.leaves:,} leaves x "
                                              f"{plan.spines:,} spines = {what}; set fabric.spines (e.g. 16 or 32)")
        raise _fail(cfg, "fabric.spines", f"{plan.leaves:,} leaves x {plan.spines:,} spines = {what}; "
                                          f"use fewer spines")
    field_ = "fabric.radix" if fab.nodes_per_leaf is None else "fabric.nodes_per_leaf"
    raise _fail(cfg, field_, f"the fat tree of radix {fab.radix} ({plan.nodes_per_leaf:,} nodes per leaf, "
                             f"{plan.spines:,} spines{' per pod' if fab.tiers == 3 else ''}) has {what}; "
                             f"use a smaller radix")


# ---------------------------------------------------------------------------------------------
# Fabric plan: switch counts and uplink rates, from the config alone


@dataclass(frozen=True)
class FabricPlan:
    """Switch counts and cable rates of the scale-out fabric (see :func:`plan_fabric`)."""

    rails: int  # leaves per group of nodes
    nodes_per_leaf: int  # nodes per group
    groups: int
    leaf_up_Bps: float  # line rate of one leaf -> spine cable
    spines: int  # leaf_spine and 2-tier fat tree: all spines; 3 tiers: spines per pod
    leaves_per_pod: int = 0  # 3 tiers
    pods: int = 0  # 3 tiers
    cores_per_plane: int = 0  # 3 tiers: core plane j joins spine j of every pod
    spine_up_Bps: float = 0.0  # 3 tiers: line rate of one spine -> core cable

    @property
    def leaves(self) -> int:
        return self.groups * self.rails


def _fail(cfg: TopologyCfg, field_: str, message: str) -> ConfigError:
    return ConfigError(message, source=cfg._source, field=field_)


def plan_fabric(cfg: TopologyCfg) -> FabricPlan | None:
    """Switch counts and uplink rates of ``cfg``'s fabric; None for kind ``none``.

    ``leaf_spine`` (counts given): groups G = ceil(nodes / nodes_per_leaf), leaves G·R (R rails:
    NICs per node when rail-optimised, else 1), ``spines`` (default: one per leaf), and one cable
    from every leaf to every spine of line rate ``nodes_per_leaf · nics / R · P / (spines · o)``.

    ``fat_tree`` (counts derived from the radix k; every port runs at the NIC rate P; q = NICs a
    node puts on one leaf = nics / R; o1 = ``oversubscription``, o2 = ``pod_oversubscription``)::

        leaf ports      u1 = floor(k / (1 + o1)) up, d1 = floor(o1 · u1) down      (k=64, o1=1: 32/32)
        nodes per leaf  n = floor(d1 / q)                  (unless fabric.nodes_per_leaf is given)
        leaf uplinks    U1 = ceil(n·q / o1): one cable to each of U1 spines (of its pod),
                        line rate c1 = n·q·P / (o1·U1)           (= P when o1 divides n·q)
        groups, leaves  G = ceil(nodes / n), L = G·R
        2 tiers         spines = U1; each has a port per leaf: L <= k
        3 tiers         spine ports u2 = floor(k / (1 + o2)), d2 = floor(o2 · u2)
                        leaves per pod Lp = floor(d2 / R)·R         (unless fabric.leaves_per_pod)
                        pods = ceil(G / (Lp / R)); each has U1 spines "pod{p}.spine{j}"
                        spine uplinks U2 = ceil(Lp / o2), line rate c2 = Lp·c1 / (o2·U2)
                        cores: U1 planes x U2; spine j of every pod joins the U2 cores of
                        plane j ("core{j}.{c}"); each core has a port per pod: pods <= k

    With R = q = 1 and o1 = o2 = 1 this is the k-ary fat tree of Al-Fares, Loukissas and Vahdat,
    "A Scalable, Commodity Data Center Network Architecture" (SIGCOMM 2008): k/2 hosts per edge
    switch, k/2 edge and k/2 aggregation switches per pod, (k/2)^2 cores, k pods, k^3/4 hosts.
    Spines are built only with more than one leaf, cores only with more than one pod.
    """
    fab, n = cfg.fabric, cfg.node
    if fab.kind == "none":
        return None
    nics = n.nics or n.gpus
    rails = nics if fab.rail_optimized else 1
    q = nics // rails
    P = n.nic.bw_Gbps * 1e9 / 8
    if fab.kind == "leaf_spine":
        per_leaf = fab.nodes_per_leaf or 16
        groups = math.ceil(cfg.nodes / per_leaf)
        spines = fab.spines or groups * rails
        down_per_leaf = per_leaf * nics // rails
        up_bw = down_per_leaf * P / (spines * fab.oversubscription)
        return FabricPlan(rails=rails, nodes_per_leaf=per_leaf, groups=groups, leaf_up_Bps=up_bw, spines=spines)

    k = fab.radix
    o1, o2 = fab.oversubscription, fab.pod_oversubscription
    u1 = math.floor(k / (1 + o1))
    d1 = math.floor(o1 * u1)
    if u1 < 1:  # (no port left up: the ratio, not the radix, is what is off)
        raise _fail(cfg, "fabric.oversubscription", f"a leaf of radix {k} at {o1:g}:1 keeps no port up "
                                                    f"(radix / (1 + oversubscription) < 1); at most {k - 1:g}:1")
    if fab.nodes_per_leaf is None:
        per_leaf = d1 // q
        if per_leaf < 1:
            raise _fail(cfg, "fabric.radix", f"a leaf of radix {k} at {o1:g}:1 has {d1} ports down, fewer than "
                                             f"the {q} NICs a node puts on one leaf; raise the radix")
    else:
        per_leaf = fab.nodes_per_leaf
    down1 = per_leaf * q
    up1 = math.ceil(down1 / o1)
    if down1 + up1 > k:
        raise _fail(cfg, "fabric.nodes_per_leaf", f"{per_leaf} nodes per leaf need {down1} ports down and "
                                                  f"{up1} up at {o1:g}:1, more than the radix {k}")
    c1 = down1 * P / (o1 * up1)
    groups = math.ceil(cfg.nodes / per_leaf)
    leaves = groups * rails
    if fab.tiers == 2:
        if leaves > 1 and leaves > k:
            raise _fail(cfg, "fabric.tiers", f"{cfg.nodes} nodes need {leaves} leaves, but a 2-tier fat tree of "
                                             f"radix {k} joins at most {k}; use tiers: 3 or a larger radix")
        return FabricPlan(rails=rails, nodes_per_leaf=per_leaf, groups=groups, leaf_up_Bps=c1, spines=up1)

    u2 = math.floor(k / (1 + o2))
    d2 = math.floor(o2 * u2)
    if u2 < 1:
        raise _fail(cfg, "fabric.pod_oversubscription", f"a spine of radix {k} at {o2:g}:1 keeps no port up "
                                                        f"(radix / (1 + pod_oversubscription) < 1); at most {k - 1:g}:1")
    if fab.leaves_per_pod is None:
        per_pod = d2 // rails * rails
        if per_pod < 1:
            raise _fail(cfg, "fabric.radix", f"a spine of radix {k} at {o2:g}:1 has {d2} ports down, fewer than "
                                             f"the {rails} rail leaves of one group; raise the radix")
    else:
        per_pod = fab.leaves_per_pod
        if per_pod % rails:
            raise _fail(cfg, "fabric.leaves_per_pod", f"{per_pod} is not a whole number of groups of "
                                                      f"{rails} rail leaves")
    up2 = math.ceil(per_pod / o2)
    if per_pod + up2 > k:
        raise _fail(cfg, "fabric.leaves_per_pod", f"{per_pod} leaves per pod need {per_pod} spine ports down "
                                                  f"and {up2} up at {o2:g}:1, more than the radix {k}")
    pods = math.ceil(groups / (per_pod // rails))
    if pods > k:
        raise _fail(cfg, "nodes", f"{cfg.nodes} nodes need {pods} pods, but a core of radix {k} joins at most {k}")
    return FabricPlan(rails=rails, nodes_per_leaf=per_leaf, groups=groups, leaf_up_Bps=c1, spines=up1,
                      leaves_per_pod=per_pod, pods=pods, cores_per_plane=up2,
                      spine_up_Bps=per_pod * c1 / (o2 * up2))


def link_ceilings(cfg: TopologyCfg) -> list[dict] | None:
    """The links of ``cfg`` slower than the NIC that feeds them, which cap every transfer
    between nodes below the NIC's rate (None where none is)::

        pcie        node.pcie_GBps  <  NIC bw_Gbps / 8 x efficiency     (what transfers see;
                    a GPU's own link to its NIC, or a shared NIC's one link to its GPUs)
        leaf_spine  leaf -> spine cable below the NIC's line rate P:
                    K P / (spines o) < P, i.e. spines o > K   (K: NIC ports below a leaf,
                    nodes_per_leaf x nics / R; o: fabric.oversubscription; plan_fabric)

    A leaf-spine cable's rate splits a leaf's ports over every spine, so a leaf with fewer
    ports than spines gets cables slower than one port, and ECMP puts each flow on one of
    them: one NIC under a leaf of a 16-spine fabric moves a flow at 1/16 of its rate. Real
    cables run at the port's rate; ``spines_at_line_rate`` (K / o, rounded down) is the most
    spines that keep them there, 0 where the oversubscription is above the ports (a leaf's
    one NIC port at 2:1: no spine count does). A fat tree's cables are derived from its ports
    (at most a rounding below P where o does not divide them) and are not listed.
    Each entry gives its rate and the NIC's as transfers see them (line x efficiency), in GB/s."""
    n, fab = cfg.node, cfg.fabric
    nic_Bps = n.nic.bw_Gbps * 1e9 / 8
    out = []
    if cfg.nodes > 1 and n.pcie_GBps * 1e9 < nic_Bps * n.nic.efficiency:
        out.append({"link": "pcie", "bw_GBps": n.pcie_GBps, "nic_GBps": nic_Bps * n.nic.efficiency / 1e9})
    plan = plan_fabric(cfg)
    if plan is not None and fab.kind == "leaf_spine" and plan.leaves > 1 and plan.leaf_up_Bps < nic_Bps * (1 - 1e-12):
        ports = plan.nodes_per_leaf * (n.nics or n.gpus) // plan.rails
        out.append({"link": "leaf_spine", "bw_GBps": plan.leaf_up_Bps * fab.efficiency / 1e9,
                    "nic_GBps": nic_Bps * n.nic.efficiency / 1e9, "nic_ports_per_leaf": ports,
                    "spines": plan.spines, "spines_at_line_rate": math.floor(ports / fab.oversubscription)})
    return out or None


def gpus_per_nic(node) -> int:
    """GPUs sharing each NIC of a node of ``node`` (its ``NodeCfg``)."""
    return node.gpus // (node.nics or node.gpus)


def nvls_share(node: NodeCfg, gpu: GpuSpec) -> float | None:
    """The share of the NVLink line rate NVLS sustains: the topology's
    ``node.nvlink.nvls_efficiency``, else the GPU catalogue's (None: no NVLS)."""
    return node.nvlink.nvls_efficiency or gpu.nvls_efficiency


def network_figures(cfg: TopologyCfg) -> dict:
    """The link figures the cluster was built with, as the outputs echo them (so that a rate
    typed in the wrong unit shows): NVLink's line rate (GB/s per direction, the GPU
    catalogue's where the topology gives none) and efficiencies, the NICs, PCIe and the
    fabric's shape; NVLink and NVLS null on one-GPU nodes, NICs, PCIe and the fabric on one
    node. ``nvlink_above_gpu_GBps``: the GPU's own NVLink rate where the topology's is above
    it, which no NVSwitch node of that GPU reaches (3600 on an H100: its 450 GB/s in Gb/s)."""
    gpu, n, fab = lookup_gpu(cfg.gpu), cfg.node, cfg.fabric
    own = gpu.nvlink_bw_Bps / 1e9
    nvlink = (n.nvlink.bw_GBps or own) if n.gpus > 1 else None
    out: dict = {"nvlink_GBps": nvlink, "nvlink_efficiency": n.nvlink.efficiency if nvlink else None,
                 "nvls_efficiency": nvls_share(n, gpu) if nvlink else None,
                 "nvlink_above_gpu_GBps": own if nvlink and nvlink > own * (1 + 1e-9) else None,
                 "nics_per_node": None, "nic_Gbps": None, "nic_efficiency": None, "pcie_GBps": None, "fabric": None}
    plan = plan_fabric(cfg) if cfg.nodes > 1 else None
    if plan is None:
        return out
    out.update(nics_per_node=n.nics or n.gpus, nic_Gbps=n.nic.bw_Gbps, nic_efficiency=n.nic.efficiency,
               pcie_GBps=n.pcie_GBps)
    out["fabric"] = {"kind": fab.kind, "tiers": 2 if fab.kind == "leaf_spine" else fab.tiers,
                     "rail_optimized": fab.rail_optimized, "leaves": plan.leaves,
                     # (no spine is built above a single leaf, no core above a single pod)
                     "spines": plan.spines * (plan.pods or 1) if plan.leaves > 1 else 0,
                     "cores": plan.spines * plan.cores_per_plane if plan.pods > 1 else 0,
                     "oversubscription": fab.oversubscription,
                     # (one leaf holds every node: no link above it, whatever the file's ratio)
                     "oversubscription_unused": plan.leaves == 1 and fab.oversubscription != 1,
                     "pod_oversubscription": fab.pod_oversubscription if plan.pods > 1 else None,
                     "efficiency": fab.efficiency}
    return out


# ---------------------------------------------------------------------------------------------
# The built cluster


@dataclass
class Cluster:
    """The built cluster: the graph, the GPU spec, and indexed links for the network model."""

    cfg: TopologyCfg
    gpu: GpuSpec
    graph: nx.DiGraph
    gpu_names: list[str]  # global GPU index -> graph node
    edges: list[tuple[str, str]] = field(default_factory=list)  # edge id -> (u, v)
    # what_if GPU slow-downs: global GPU index -> factor on its compute time (>= 1)
    gpu_slowdown: dict[int, float] = field(default_factory=dict)
    # the faults of what_if cables and switches (:func:`_mark_fault`), one entry each: (u, v,
    # removed, the GPUs it marked; u == v a removed switch): a node's own cables (NVLink,
    # PCIe, NIC-leaf) and the fabric's; which of those GPUs' flows a fault touches depends on
    # the plan's groups (config.Scenario.node_touched_gpus, fabric_touched_gpus), and those
    # split the symmetric classes as stragglers do (program/lower.py Symmetry)
    fault_cables: list[tuple[str, str, bool, frozenset[int]]] = field(default_factory=list)
    fabric_fault_cables: list[tuple[str, str, bool, frozenset[int]]] = field(default_factory=list)

    @property
    def fault_gpus(self) -> frozenset[int]:
        """The GPUs of the nodes where a what_if degrades or removes one of the node's own cables."""
        return frozenset().union(*(gpus for *_, gpus in self.fault_cables))

    @property
    def fabric_fault_gpus(self) -> frozenset[int]:
        """The GPUs of the nodes with a NIC below a fabric cable or switch a what_if degrades
        or removes."""
        return frozenset().union(*(gpus for *_, gpus in self.fabric_fault_cables))

    @property
    def gpus_per_node(self) -> int:
        return self.cfg.node.gpus

    @cached_property
    def owned_links(self) -> tuple[tuple[str, ...], ...]:
        """Per GPU, the names of the links inside its node that carry its traffic, in one order
        for every GPU: to and from its NVSwitch and its NIC over PCIe; none where GPUs share a
        NIC. A symmetric class's members load theirs alike (analysis.links.every_gpu_rows); the
        NICs' cables and the fabric's are scale-out links, where the link use counts every twin
        already (engine.sim.Engine._twins_links), as on every link where GPUs share a NIC
        (:attr:`twins_cross_mask`)."""
        return tuple(tuple(f"{u}->{v}" for u, v in ends) for ends in self._owned_ends)

    @cached_property
    def _owned_ends(self) -> tuple[tuple[tuple[str, str], ...], ...]:
        """:attr:`owned_links` as (from, to) pairs."""
        nodes, out = self.graph.nodes, []
        if self.gpus_per_nic > 1:  # every link counts every twin (twins_cross_mask)
            return tuple(() for _ in self.gpu_names)
        for name in self.gpu_names:
            at = nodes[name]
            ends = ((name, at["switch"]), (at["switch"], name)) if at["switch"] else ()
            out.append((*ends, (name, at["nic"]), (at["nic"], name)))
        return tuple(out)

    @cached_property
    def own_nic_links(self) -> tuple[tuple[str, str, float, str, str] | None, ...]:
        """Per GPU whose NIC is its own and cabled to a leaf: (its PCIe lane to the NIC, back,
        that lane's bandwidth, the NIC's cable to the leaf, back), names; else None
        (:attr:`own_nic_edges`, named). What crosses the cable crosses the lane (the NIC has no
        other link: analysis.links.every_gpu_rows)."""
        edges, bw = self.edges, self.edge_bw_Bps
        return tuple(None if row[0] < 0 else ("{}->{}".format(*edges[row[0]]), "{}->{}".format(*edges[row[1]]),
                                              bw[row[0]], "{}->{}".format(*edges[row[2]]),
                                              "{}->{}".format(*edges[row[3]]))
                     for row in self.own_nic_edges.tolist())

    @cached_property
    def owned_edges(self) -> np.ndarray:
        """:attr:`owned_links` as edge ids, GPUs x links: every GPU has as many (every node of
        a cluster has the same GPUs, its NVSwitch or none, and their NICs)."""
        ends = self._owned_ends
        width = len(ends[0]) if ends else 0
        flat = np.fromiter(map(self.edge_index.__getitem__, itertools.chain.from_iterable(ends)), np.int64,
                           width * len(ends))  # (one array from the pairs: not a list per GPU)
        return flat.reshape(len(ends), width)

    @cached_property
    def own_nic_edges(self) -> np.ndarray:
        """Per GPU whose NIC is its own and cabled to a leaf, edge ids: GPUs x (its PCIe lane to
        the NIC, back, the NIC's cable to the leaf, back); rows of -1 for the others."""
        out = np.full((len(self.gpu_names), 4), -1, dtype=np.int64)
        if self.gpus_per_nic != 1:
            return out
        edges, (codes, kinds) = self.edges, self.edge_kind_codes
        lanes = self.owned_edges[:, -2:].tolist()  # (to its NIC, back: owned_links' last two)
        nic_of = [edges[lane[0]][1] for lane in lanes]
        nics = set(nic_of)
        up, down = {}, {}  # NIC -> its cable to the leaf, back (the links of kind "nic")
        for e in (np.flatnonzero(codes == kinds.index("nic")).tolist() if "nic" in kinds else ()):
            u, v = edges[e]
            if u in nics:
                up[u] = e
            elif v in nics:
                down[v] = e
        for g, (nic, lane) in enumerate(zip(nic_of, lanes)):
            if nic in up and nic in down:
                out[g] = lane[0], lane[1], up[nic], down[nic]
        return out

    @property
    def gpus_per_nic(self) -> int:
        """GPUs sharing each NIC of a node (``node.nics`` below ``node.gpus``; GPU j's is j // this)."""
        return gpus_per_nic(self.cfg.node)

    @property
    def nvls_efficiency(self) -> float | None:
        """The share of the NVLink line rate NVLS sustains (:func:`nvls_share`)."""
        return nvls_share(self.cfg.node, self.gpu)

    @property
    def nvls_wire_scale(self) -> float:
        """How much longer NVLS traffic holds an NVLink link than the link's usable bandwidth
        gives: NVLS sustains its own, calibrated, share of the line rate (hardware/gpus.py)::

            scale = nvlink.efficiency / nvls_efficiency        H100: 0.81 / 0.608 = 1.33
        """
        return self.cfg.node.nvlink.efficiency / self.nvls_efficiency

    @property
    def num_gpus(self) -> int:
        return len(self.gpu_names)

    @cached_property
    def gpu_units(self) -> np.ndarray | None:
        """Per GPU (rows), the group of nodes its node sits in under one set of leaves and,
        where the fabric has several pods, the pod of that group; None where the fabric has a
        single group or none: every node then sits under the same leaves. A plan's groups
        and pipeline routes cut differently by these edges run on routes of different shapes
        (program/lower.py Symmetry, its split by units)::

            leaf_spine, 4 nodes a leaf               nodes 0-3 | 4-7 | 8-11    groups 0 | 1 | 2
            fat tree of 3 tiers, 2 groups a pod      groups 0 1 | 2 3          pods   0 | 1
        """
        plan = plan_fabric(self.cfg)
        if plan is None or plan.groups < 2:
            return None
        group = np.arange(self.cfg.nodes) // plan.nodes_per_leaf
        levels = [group, group // (plan.leaves_per_pod // plan.rails)] if plan.pods > 1 else [group]
        return np.repeat(np.stack(levels, axis=1), self.gpus_per_node, axis=0)

    @cached_property
    def edge_index(self) -> dict[tuple[str, str], int]:
        return {e: i for i, e in enumerate(self.edges)}

    @cached_property
    def _edge_data(self) -> tuple[list[float], list[float], list[str]]:
        """(bandwidth, latency, kind) of each link in ``edges`` order: read in one pass over the
        graph's edges where ``edges`` lists them in the graph's own order (as the cluster is
        built), else one by one (a pass reads 136,448 links in a third of the time)."""
        rows = list(self.graph.edges(data=True))
        if [(u, v) for u, v, _ in rows] != self.edges:  # edges listed otherwise: one by one
            rows = [(u, v, self.graph.edges[u, v]) for u, v in self.edges]
        data = list(map(itemgetter(2), rows))
        return (list(map(itemgetter("bw_Bps"), data)), list(map(itemgetter("latency_s"), data)),
                [d.get("kind", "") for d in data])

    @cached_property
    def edge_bw_Bps(self) -> list[float]:
        return self._edge_data[0]

    @cached_property
    def edge_kind(self) -> list[str]:
        """Each link's kind ("nvlink", "pcie", "nic", "fabric"; "" where unset), in ``edges``
        order (the graph's own order, which ``edges`` lists)."""
        return self._edge_data[2]

    @cached_property
    def edge_kind_codes(self) -> tuple[np.ndarray, list[str]]:
        """(per link, the index of its kind in the list, the kinds in first use): :attr:`edge_kind`
        as integers, to select links by kind at once."""
        kinds = list(dict.fromkeys(self.edge_kind))
        code = {k: i for i, k in enumerate(kinds)}
        return np.fromiter(map(code.__getitem__, self.edge_kind), np.int64, len(self.edge_kind)), kinds

    def binding_kind(self, e: int) -> str:
        """The kind of link ``e`` as what binds a transfer on it: its own (:attr:`edge_kind`),
        but ``pcie`` for the cable of a NIC several GPUs share where its one PCIe link holds it
        below the NIC's rate (its ``cap_Bps``)."""
        cap = self.graph.edges[self.edges[e]].get("cap_Bps")
        return "pcie" if cap is not None and self.edge_bw_Bps[e] >= cap else self.edge_kind[e]

    @cached_property
    def scale_out_mask(self) -> np.ndarray:
        """Per link (in ``edges`` order), whether it is a link of the scale-out network: a NIC's
        cable to its leaf, or one between fabric switches (leaf, spine, core). There the
        twins of two communications can meet where their simulated instances do not (ECMP
        picks spines per flow; a ToR without rails takes several nodes' NICs):
        engine.sim.Engine._meetings."""
        return np.array([k in ("fabric", "nic") for k in self.edge_kind], dtype=bool)

    @cached_property
    def twins_cross_mask(self) -> np.ndarray:
        """Per link (in ``edges`` order), whether the link use counts every real flow that
        crosses it, twins' included (engine.sim.Engine._twins_links), rather than giving a
        GPU its class's simulated rank's figure (:attr:`owned_links`): the scale-out links
        (:attr:`scale_out_mask`), and every link where GPUs share a NIC. A GPU's links there
        carry more than its own traffic, and not as its class's simulated rank's do: PXN's
        flows that node-mates forward through it to its NIC's rail (its NVLink port in, its
        lane), and where the collapse simulates a transfer at its receiver alone, a twin's
        send in place of its own (a DP ring of two across nodes: the simulated rank's receive
        crosses its peer's lane, its send no simulated lane)::

            n0.gpu1 -NVLink- n0.gpu5 -PCIe- n0.nic1 -cable- leaf.1     gpu5's lane: its own and gpu1's

        Copied from the class's simulated rank, every lane toward a NIC said a quarter of its
        bytes on a plan of four GPUs a NIC, and the NVLink ports 3.4 % more bytes than every
        rank's on DP32 over four nodes of two NICs (bench/fuzz_fabrics.py 232 and 246, plan 28)."""
        if self.gpus_per_nic > 1:
            return np.ones(len(self.edges), dtype=bool)
        return self.scale_out_mask.copy()

    @cached_property
    def nvlink_mask(self) -> np.ndarray:
        """Per link (in ``edges`` order), whether it is an NVLink (a GPU's link to its NVSwitch)."""
        return np.array([k == "nvlink" for k in self.edge_kind], dtype=bool)

    @cached_property
    def tuner_sees(self) -> list[bool]:
        """Per link (in ``edges`` order), whether the algorithm tuner weighs it: a GPU's own
        links and its NIC's cable, not the fabric's switches beyond, which NCCL's topology
        search does not see (engine.sim.Engine.algorithm)."""
        return [k != "fabric" for k in self.edge_kind]

    @cached_property
    def edge_latency_s(self) -> list[float]:
        return self._edge_data[1]

    @cached_property
    def edge_columns(self) -> tuple[np.ndarray, np.ndarray]:
        """``edge_bw_Bps`` and ``edge_latency_s`` as float64 arrays (the same values)."""
        return np.asarray(self.edge_bw_Bps, dtype=np.float64), np.asarray(self.edge_latency_s, dtype=np.float64)

    @cached_property
    def _fabric(self) -> nx.DiGraph:
        keep = [n for n, k in self.graph.nodes(data="kind") if k in TIERS]
        return self.graph.subgraph(keep)

    @cached_property
    def _up(self) -> dict[str, list[str]]:
        """Per fabric switch, the switches one tier up it has a cable to, sorted."""
        g = self.graph
        out = {}
        for v in self._fabric:
            t = g.nodes[v]["tier"]
            out[v] = sorted(w for w in g.successors(v) if g.nodes[w].get("tier") == t + 1)
        return out

    @cached_property
    def _cabled(self) -> dict[str, frozenset[str]]:
        """Per fabric switch, every node it has a cable to (a set, to intersect in C)."""
        g = self.graph
        return {v: frozenset(g.successors(v)) for v in self._fabric}

    def _above(self, v: str) -> list[frozenset[str]]:
        """The switches ``v`` reaches going up: index 0 is ``{v}``, index t those t tiers higher."""
        cache = self.__dict__.setdefault("_above_cache", {})
        if v not in cache:
            up, levels = self._up, [frozenset((v,))]
            while nxt := frozenset().union(*map(up.__getitem__, levels[-1])):  # (in C: a level has hundreds)
                levels.append(nxt)
            cache[v] = levels
        return cache[v]

    def _meeting(self, a: str, b: str) -> tuple[int, frozenset[str]] | list[list[str]]:
        """Where up-down routes from leaf ``a`` to leaf ``b`` turn: (tiers up, the switches
        there that both reach), the lowest such tier; or, when there is none, every shortest
        path through the remaining switches, sorted.

        In an intact Clos the up-down paths are exactly the shortest paths::

            leaf a ─ spine j ─ leaf b                                   turn 1 tier up
            leaf a ─ pod0.spine j ─ core j.c ─ pod1.spine j ─ leaf b    turn 2 tiers up

        A fault can leave two leaves with no up-down path (a and b each lost the spine the other
        kept); then traffic takes the shortest paths of any shape, down through a third leaf.
        """
        above_a, above_b = self._above(a), self._above(b)
        for t in range(1, min(len(above_a), len(above_b))):
            tops = above_a[t] & above_b[t]
            if tops:
                return t, tops
        try:
            return sorted(nx.all_shortest_paths(self._fabric, a, b))
        except nx.NetworkXNoPath:
            raise ConfigError(f"no route from {a} to {b} through the fabric", source=self.cfg._source,
                              field="what_if") from None

    def _meeting_of(self, a: str, b: str) -> tuple[int, frozenset[str]] | list[list[str]]:
        """:meth:`_meeting` of leaves ``a`` and ``b``, remembered."""
        cache = self.__dict__.setdefault("_meeting_cache", {})
        meet = cache.get((a, b))
        if meet is None:
            meet = cache[(a, b)] = self._meeting(a, b)
        return meet

    def _up_choices(self, v: str, below: int, tops: frozenset[str]) -> list[str]:
        """The switches one tier above ``v`` that still lead to one of ``tops`` (``below``
        tiers under them), sorted. The choices at a switch depend on the switch and where the
        route turns, not on the endpoints: remembered by :meth:`_step` (a 16K-GPU step routes
        ~10^5 pairs)."""
        up = self._up[v]
        if below == 0:
            return [w for w in up if w in tops]
        # (a spine whose core cables a what-if removed reaches no tier above: not a choice)
        return [w for w in up if len(self._above(w)) > below and not self._above(w)[below].isdisjoint(tops)]

    def _down_choices(self, v: str, b: str, i: int) -> list[str]:
        """The switches below ``v`` that are ``i`` tiers above leaf ``b`` on its way down
        (``i`` = 0: ``b`` itself), sorted; remembered as :meth:`_up_choices`."""
        return sorted(self._above(b)[i] & self._cabled[v])

    @cached_property
    def dest_ports(self) -> np.ndarray:
        """Per GPU, its NIC's index across the fabric, what ``fabric.routing: destination``
        picks uplinks by, digit by digit (-1: no leaf)::

            index = leaf's number x NICs a leaf holds (the most any holds) + port on the leaf

        leaves numbered in order of their first NIC, ports in node, then NIC order. The first
        switch up takes ``index`` mod its uplinks, which is the port's own digit wherever a
        leaf's NICs are a multiple of its uplinks; the digits above carry the leaf, so that
        destinations on different leaves climb to different cores (D-mod-k, Zahavi 2010;
        OpenSM's fat-tree routing). The port alone left every cross-pod route of a plane on
        one core."""
        g = self.graph
        seen: dict[str, int] = {}
        port: dict[str, tuple[str, int]] = {}
        for v, attrs in g.nodes(data=True):  # insertion order: node by node, NIC by NIC
            if attrs.get("kind") == "nic" and attrs.get("leaf") is not None:
                port[v] = (attrs["leaf"], seen.setdefault(attrs["leaf"], -1) + 1)
                seen[attrs["leaf"]] += 1
        width = max(seen.values(), default=-1) + 1
        number = {leaf: k for k, leaf in enumerate(seen)}
        index = {v: number[leaf] * width + p for v, (leaf, p) in port.items()}
        return np.array([index.get(g.nodes[x].get("nic"), -1) for x in self.gpu_names], dtype=np.int64)

    @cached_property
    def _by_port(self) -> bool:
        """Whether routes pick uplinks by the destination's port (``fabric.routing``), not by hash."""
        return self.cfg.fabric.routing == "destination"

    def _port(self, gpu: int) -> int:
        """:attr:`dest_ports` of ``gpu`` where routes pick by it, else 0 (not worked out)."""
        return int(self.dest_ports[gpu]) if self._by_port else 0

    def _leaf_route(self, a: str, b: str, salt: str, port: int = 0) -> list[str]:
        """A shortest route from leaf ``a`` to leaf ``b``, chosen hop by hop as ECMP does: the
        switches of :meth:`_leaf_edges`.

        Each switch on the way up picks among its sorted up-links that still lead to a turning
        switch, by ``zlib.crc32`` of ``salt`` (the endpoint names; never Python's hash, which
        changes between runs) modulo their number; on the way down, among its sorted down-links
        toward ``b``. The first switch hashes ``salt`` itself; the others hash ``salt|switch``,
        a seed per switch as real fabrics use to avoid hash polarisation. In a two-tier fabric
        the only choice is the first (the spine), so this is the same as picking one of all the
        sorted shortest routes. With ``fabric.routing: destination`` each switch picks by the
        destination NIC's ``port`` on its leaf instead (D-mod-k: the first switch ``port`` mod
        its choices, the next ``port // (choices before)`` mod its own), so that the NICs of a
        leaf reach it over distinct uplinks wherever there are as many.
        """
        edges = self.edges
        return [a, *(edges[e][1] for e in self._leaf_edges(a, b, salt.encode(), port))]

    def _leaf_edges(self, a: str, b: str, salt: bytes, port: int = 0) -> tuple[int, ...]:
        """The edge ids of :meth:`_leaf_route` (``salt`` encoded), per pair as cheaply as can
        be: each switch's choices toward a turn, the edges to them and its ``|switch`` bytes
        are looked up once per (switch, turn) (:meth:`_step`), and a seed ``salt|switch`` is
        hashed on from ``salt``'s CRC (crc32(x + y) = crc32(y, crc32(x))), not from the start.
        A 16,384-GPU MoE's all-to-alls route 836,000 pairs across leaves."""
        by_port = self._by_port
        crc = None if by_port else zlib.crc32(salt)
        meet = self._meeting_of(a, b)
        if isinstance(meet, list):
            hops = meet[(port if by_port else crc) % len(meet)]
            index = self.edge_index
            return tuple(index[(u, v)] for u, v in zip(hops, hops[1:]))
        t, tops = meet
        steps = self.__dict__.setdefault("_step_cache", {})
        out, v, div = [], a, 1
        for i in range(1, 2 * t + 1):  # up t tiers (t - i below the turn), then down toward b
            key = ("up", v, t - i, tops) if i <= t else ("down", v, b, 2 * t - i)
            choices, ids, bar = steps.get(key) or self._step(key)
            n = len(choices)
            if by_port:
                j, div = port // div % n, div * n
            else:
                j = 0 if n == 1 else (crc if i == 1 else zlib.crc32(bar, crc)) % n
            out.append(ids[j])
            v = choices[j]
        return tuple(out)

    def _step(self, key: tuple) -> tuple[list[str], list[int], bytes]:
        """(the choices at switch ``v``, the edge ids from ``v`` to each, ``|v`` as bytes) for
        ``key`` = ("up", v, tiers below the turn, turning switches) or ("down", v, leaf b, tier
        above b): :meth:`_up_choices` or :meth:`_down_choices`, remembered."""
        way, v, x, y = key
        choices = self._up_choices(v, x, y) if way == "up" else self._down_choices(v, x, y)
        index = self.edge_index
        step = self.__dict__.setdefault("_step_cache", {})[key] = (choices, [index[(v, w)] for w in choices],
                                                                   f"|{v}".encode())
        return step

    def node_of(self, gpu: int) -> int:
        """The node (server) GPU ``gpu`` sits in."""
        return gpu // self.cfg.node.gpus

    def pair_tiers(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """How far apart each pair of GPUs ``(src[i], dst[i])`` sits, as the shape of the route
        between them::

            0  the same GPU           2  other nodes, one leaf          2 + t  leaves whose routes
            1  the same node          99 no leaf (no fabric)                   turn t tiers up

        (100 + hops where a fault leaves two leaves no up-down route.) Two pairs with the same
        tier take routes of the same shape, though not the same links."""
        c = self._gpu_columns
        src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        node, leaf = c["node"], c["leaf"]
        out = np.where(src == dst, 0, np.where(node[src] == node[dst], 1, -1))
        out[(out < 0) & (leaf[src] >= 0) & (leaf[src] == leaf[dst])] = 2
        out[(out < 0) & ((leaf[src] < 0) | (leaf[dst] < 0))] = 99
        rest = np.flatnonzero(out < 0)
        if len(rest):  # pairs of leaves: few, each met once (_meeting_of remembers them)
            s, d = src[rest], dst[rest]
            first, back = first_and_inverse(leaf[s] * (int(leaf.max()) + 1) + leaf[d])  # a GPU pair a leaf pair
            tier = np.empty(len(first), dtype=np.int64)
            for k, i in enumerate(first.tolist()):
                meet = self._meeting_of(self._gpu_route(int(s[i]))[2], self._gpu_route(int(d[i]))[2])
                tier[k] = 2 + meet[0] if isinstance(meet, tuple) else 100 + len(meet[0]) - 1
            out[rest] = tier[back]
        return out

    def path(self, src: int, dst: int) -> tuple[int, ...]:
        """Edge ids from GPU ``src`` to GPU ``dst`` (global indices); empty when src == dst."""
        cache = self.__dict__.setdefault("_paths", {})
        key = (src, dst)
        if key in cache:
            return cache[key]
        s, d = self.gpu_names[src], self.gpu_names[dst]
        if s == d:
            cache[key] = ()
            return ()
        a, b = self._gpu_route(src), self._gpu_route(dst)
        index = self.edge_index
        if a[0] == b[0]:  # same node: through its NVSwitch
            ids = (index[(s, a[1])], index[(a[1], d)])
        else:
            leaf_s, leaf_d = a[2], b[2]
            if leaf_s is None or leaf_d is None:
                raise ConfigError("GPUs on different nodes but the topology has no fabric",
                                  field="fabric.kind")
            if a[3] is None or b[4] is None:  # a NIC cable taken out (what_if): name the missing link
                mid = [leaf_s] if leaf_s == leaf_d else self._leaf_route(leaf_s, leaf_d, f"{s}>{d}",
                                                                           self._port(dst))
                hops = [s, self.graph.nodes[s]["nic"], *mid, self.graph.nodes[d]["nic"], d]
                ids = tuple(index[(u, v)] for u, v in zip(hops, hops[1:]))
            else:  # GPU -> NIC -> leaf, across the fabric, leaf -> NIC -> GPU
                ids = a[3] + (() if leaf_s == leaf_d else
                              self._leaf_edges(leaf_s, leaf_d, f"{s}>{d}".encode(), self._port(dst))) + b[4]
        cache[key] = ids
        return ids

    def _gpu_route(self, gpu: int) -> tuple:
        """(node, NVSwitch, leaf, edge ids GPU -> NIC -> leaf, edge ids leaf -> NIC -> GPU) of
        ``gpu``, looked up in the graph once (its node views are slow to ask per route)."""
        memo = self.__dict__.setdefault("_gpu_routes", {})
        hit = memo.get(gpu)
        if hit is None:
            g, index, name = self.graph, self.edge_index, self.gpu_names[gpu]
            attrs = g.nodes[name]
            nic = attrs.get("nic")
            leaf = g.nodes[nic]["leaf"] if nic is not None else None
            has = (leaf is not None and (name, nic) in index and (nic, leaf) in index and (leaf, nic) in index
                   and (nic, name) in index)
            up = (index[(name, nic)], index[(nic, leaf)]) if has else None
            down = (index[(leaf, nic)], index[(nic, name)]) if has else None
            hit = memo[gpu] = (attrs["node"], attrs.get("switch"), leaf, up, down)
        return hit

    def pxn_proxy(self, src: int, dst: int) -> int | None:
        """The GPU on ``src``'s node that forwards to ``dst`` over its own rail (NCCL's PXN),
        or None when ``src`` reaches ``dst`` without crossing rails (same node, same rail, or a
        fabric that is not rail-optimised)::

            n0.gpu2 ─NVLink─ n0.gpu5 ─nic5─ leaf.5 ─nic5─ n1.gpu5     instead of
            n0.gpu2 ─nic2─ leaf.2 ─ spine ─ leaf.5 ─nic5─ n1.gpu5

        The proxy is the GPU with ``dst``'s local index (it shares dst's rail when every GPU has
        its own NIC), else the first GPU behind a NIC of dst's rail. Rails are the NICs' ``rail``
        attribute, None when the fabric is not rail-optimised.
        """
        node_s, rail_s, _ = self._gpu_rail(src)
        node_d, rail, local_d = self._gpu_rail(dst)
        if node_s == node_d or rail is None or rail_s == rail:
            return None
        per_node = self.cfg.node.gpus
        first = node_s * per_node
        for c in (first + local_d, *range(first, first + per_node)):
            if self._gpu_rail(c)[1] == rail:
                return c
        return None

    def _gpu_rail(self, gpu: int) -> tuple:
        """(node, rail of its NIC or None, index in its node) of ``gpu``, looked up in the
        graph once (PXN asks for every pair of an all-to-all)."""
        memo = self.__dict__.setdefault("_gpu_rails", {})
        hit = memo.get(gpu)
        if hit is None:
            g = self.graph
            attrs = g.nodes[self.gpu_names[gpu]]
            nic = attrs.get("nic")
            hit = memo[gpu] = (attrs["node"], g.nodes[nic]["rail"] if nic is not None else None, attrs.get("local"))
        return hit

    def pxn_path(self, src: int, dst: int) -> tuple[int, ...]:
        """Edge ids from ``src`` to ``dst`` through the PXN proxy when there is one."""
        cache = self.__dict__.setdefault("_pxn_paths", {})
        key = (src, dst)
        hit = cache.get(key)
        if hit is None:
            via = self.pxn_proxy(src, dst)
            hit = cache[key] = self.path(src, dst) if via is None else self.path(src, via) + self.path(via, dst)
        return hit

    @cached_property
    def _gpu_columns(self) -> dict[str, np.ndarray]:
        """What :meth:`path` and :meth:`pxn_proxy` read per GPU, as arrays by global GPU id:
        node, local index, codes of its NVSwitch, leaf and rail (-1: none), and the edge ids
        GPU -> NVSwitch, NVSwitch -> GPU, GPU -> NIC -> leaf (two) and leaf -> NIC -> GPU (two),
        -1 where the graph lacks them (those pairs are left to :meth:`path`)."""
        n = len(self.gpu_names)
        cols = {k: np.full(n, -1, dtype=np.int64) for k in ("node", "local", "switch", "leaf", "rail", "to_sw",
                                                               "from_sw", "up0", "up1", "down0", "down1")}
        codes: dict = {None: -1}
        index, g = self.edge_index, self.graph
        for gpu, name in enumerate(self.gpu_names):
            node, switch, leaf, up, down = self._gpu_route(gpu)
            _, rail, local = self._gpu_rail(gpu)
            cols["node"][gpu], cols["local"][gpu] = node, local if local is not None else -1
            for k, v in (("switch", switch), ("leaf", leaf), ("rail", ("rail", rail) if rail is not None else None)):
                cols[k][gpu] = codes.setdefault(v, len(codes) - 1)
            if switch is not None and g.has_node(switch):
                cols["to_sw"][gpu] = index.get((name, switch), -1)
                cols["from_sw"][gpu] = index.get((switch, name), -1)
            if up is not None:
                cols["up0"][gpu], cols["up1"][gpu] = up
            if down is not None:
                cols["down0"][gpu], cols["down1"][gpu] = down
        return cols

    def paths(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`path` of every pair ``(src[i], dst[i])``, as rows of edge ids padded with -1,
        and their lengths. The two common shapes are read off per-GPU arrays, the rest (across
        leaves, a missing cable) asked of :meth:`path` pair by pair::

            same node:               GPU -> NVSwitch -> GPU                          2 edges
            other node, same leaf:   GPU -> NIC -> leaf -> NIC -> GPU                4 edges
        """
        c = self._gpu_columns
        rows = np.full((len(src), 4), -1, dtype=np.int64)
        lens = np.zeros(len(src), dtype=np.int64)
        other = src != dst  # to itself: no edge
        same_node = other & (c["node"][src] == c["node"][dst])
        nvlink = same_node & (c["switch"][src] == c["switch"][dst]) & (c["to_sw"][src] >= 0) & (c["from_sw"][dst] >= 0)
        rows[nvlink, 0], rows[nvlink, 1], lens[nvlink] = c["to_sw"][src[nvlink]], c["from_sw"][dst[nvlink]], 2
        leaf = other & ~same_node & (c["leaf"][src] >= 0) & (c["leaf"][src] == c["leaf"][dst]) \
            & (c["up0"][src] >= 0) & (c["down0"][dst] >= 0)
        for k, col in enumerate((c["up0"][src], c["up1"][src], c["down0"][dst], c["down1"][dst])):
            rows[leaf, k] = col[leaf]
        lens[leaf] = 4
        rest = np.flatnonzero(other & ~nvlink & ~leaf)
        if len(rest):
            far, n = self._across_leaves(src[rest], dst[rest])
            if far.shape[1] > rows.shape[1]:
                rows = np.hstack([rows, np.full((len(src), far.shape[1] - rows.shape[1]), -1, dtype=np.int64)])
            rows[rest, :far.shape[1]] = far
            lens[rest] = n
        return rows, lens

    @cached_property
    def _ecmp_columns(self) -> dict:
        """What :meth:`_across_leaves` reads: the fabric switches' names and codes (their
        order), their ``|switch`` seeds as :class:`~clustersim.hardware.ecmp.Continuations`
        codes, and per GPU the code of its leaf (-1: none), ``crc32(name)`` and the code of
        ``>name`` (a pair's salt ``src>dst`` is ``crc32(">" + dst, crc32(src))``)."""
        hashes = Continuations()
        names = sorted(self._fabric)
        code = {v: i for i, v in enumerate(names)}
        seed = np.array([hashes.code(f"|{v}".encode()) for v in names], dtype=np.int64)
        leaf = np.array([code.get(self._gpu_route(g)[2], -1) for g in range(len(self.gpu_names))], dtype=np.int64)
        head = np.array([zlib.crc32(x.encode()) for x in self.gpu_names], dtype=np.int64)
        tail = np.array([hashes.code(f">{x}".encode()) for x in self.gpu_names], dtype=np.int64)
        return {"hashes": hashes, "names": names, "code": code, "seed": seed, "leaf": leaf, "head": head,
                "tail": tail}

    def _across_leaves(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`path` of each pair, as :meth:`paths` gives them, for pairs mostly on
        different leaves: the DP rings over 512 replicas of a 16K-GPU step route about 86,000
        such pairs, a 16K-GPU MoE's all-to-alls 836,000. The route between the leaves is
        :meth:`_leaf_edges`', hop by hop for every pair at once: the pairs of each (switch,
        turn) share its choices (:meth:`_step`, once per distinct one), and each pair's hash
        there is its salt's CRC continued by ``|switch`` on arrays (:mod:`.ecmp`). A pair
        :meth:`path` handles otherwise (same node, no fabric, a NIC cable cut, leaves joined
        only through a third one) is asked of it::

            GPU -> NIC -> leaf a ─ up t tiers ─ down t tiers ─ leaf b -> NIC -> GPU
        """
        memo = self.__dict__.setdefault("_across_memo", {})  # a step routes the same groups' pairs again
        asked = (src.tobytes(), dst.tobytes())
        if asked in memo:
            return memo[asked]
        c, e = self._gpu_columns, self._ecmp_columns
        hashes, names, seed = e["hashes"], e["names"], e["seed"]
        leaf_s, leaf_d = e["leaf"][src], e["leaf"][dst]
        far = (c["node"][src] != c["node"][dst]) & (leaf_s >= 0) & (leaf_d >= 0) & (leaf_s != leaf_d) \
            & (c["up0"][src] >= 0) & (c["down0"][dst] >= 0)
        turns = np.zeros(len(src), dtype=np.int64)  # tiers up to the turn; 0: not routed here
        tops_of = np.zeros(len(src), dtype=np.int64)
        tops_seen: dict[frozenset, int] = {}
        at = np.flatnonzero(far)
        if len(at):
            pair_keys, inv = np.unique(leaf_s[at] * len(names) + leaf_d[at], return_inverse=True)
            t_of, top_of = np.zeros(len(pair_keys), dtype=np.int64), np.zeros(len(pair_keys), dtype=np.int64)
            for k, key in enumerate(pair_keys.tolist()):
                meet = self._meeting_of(names[key // len(names)], names[key % len(names)])
                if not isinstance(meet, list):  # else through a third leaf: path() picks among every route
                    t_of[k], top_of[k] = meet[0], tops_seen.setdefault(meet[1], len(tops_seen))
            turns[at], tops_of[at] = t_of[inv.ravel()], top_of[inv.ravel()]
        tops_list = list(tops_seen)
        width = 4 + 2 * int(turns.max(initial=0))
        rows = np.full((len(src), width), -1, dtype=np.int64)
        lens = np.zeros(len(src), dtype=np.int64)
        by_port = self._by_port
        crc = None if by_port else hashes.apply(e["tail"][dst], e["head"][src])  # crc32(b"src>dst")
        for t in np.unique(turns[turns > 0]).tolist():
            sel = np.flatnonzero(turns == t)
            h0, v = (None if by_port else crc[sel]), leaf_s[sel]
            if by_port:
                port, div = self.dest_ports[dst[sel]], np.ones(len(sel), dtype=np.int64)
            hops = []
            for i in range(1, 2 * t + 1):  # up t tiers, then down t tiers toward leaf b
                up = i <= t
                if up:
                    key = (v * len(tops_list) + tops_of[sel]) * (t + 1) + (t - i)
                else:
                    key = (v * len(names) + leaf_d[sel]) * (t + 1) + (2 * t - i)
                keys, inv = np.unique(key, return_inverse=True)
                inv = inv.ravel()
                count, ids, nxt = self._hop_table(keys.tolist(), t + 1, tops_list if up else None)
                first = np.cumsum(count) - count
                n = count[inv]
                if by_port:  # D-mod-k: the next digit of the destination's port
                    pick, div = first[inv] + port // div % n, div * n
                else:
                    h = h0 if i == 1 else hashes.apply(seed[v], h0)  # the first switch hashes the salt itself
                    pick = first[inv] + np.where(n == 1, 0, h % n)
                hops.append(ids[pick])
                v = nxt[pick]
            s, d = src[sel], dst[sel]
            rows[sel, :2 * t + 4] = np.column_stack([c["up0"][s], c["up1"][s], *hops, c["down0"][d], c["down1"][d]])
            lens[sel] = 2 * t + 4
        for k in np.flatnonzero(turns == 0).tolist():  # the rest, pair by pair
            ids = self.path(int(src[k]), int(dst[k]))
            if len(ids) > rows.shape[1]:
                rows = np.hstack([rows, np.full((len(src), len(ids) - rows.shape[1]), -1, dtype=np.int64)])
            rows[k, :len(ids)], lens[k] = ids, len(ids)
        memo[asked] = rows, lens
        return rows, lens

    def _hop_table(self, keys: list[int], base: int, tops: list | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(number of choices, their edge ids, the codes of the switches they lead to), the
        choices of each key one after another, for the (switch, turn) ``keys`` of one hop of
        :meth:`_across_leaves`: going up (``tops``: the turning sets by index) a key is
        ``(switch * len(tops) + turning set) * base + tiers below the turn``; going down
        (``tops`` None) ``(switch * switches + leaf b) * base + tiers above b``."""
        if tops is None:
            return self._down_table(np.asarray(keys, dtype=np.int64), base)
        e = self._ecmp_columns
        names, code = e["names"], e["code"]
        steps = self.__dict__.get("_step_cache", {})
        count, ids, nxt = [], [], []
        for k in keys:
            x, at = divmod(k, base)
            w, y = divmod(x, len(tops) if tops is not None else len(names))
            step = ("up", names[w], at, tops[y]) if tops is not None else ("down", names[w], names[y], at)
            choices, edge_ids, _ = steps.get(step) or self._step(step)
            count.append(len(choices))
            ids += edge_ids
            nxt += [code[u] for u in choices]
        return np.asarray(count, dtype=np.int64), np.asarray(ids, dtype=np.int64), np.asarray(nxt, dtype=np.int64)

    def _down_table(self, keys: np.ndarray, base: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`_hop_table` going down, on arrays: for key ``(switch v * switches + leaf b) *
        base + i``, the switches below ``v`` that are ``i`` tiers above ``b``
        (:meth:`_down_choices`, sorted, which are sorted by name as the codes are). One tier
        above ``b`` that is ``b`` itself where ``v`` has a cable to it; higher, the choices
        depend on ``b`` only through the switches ``i`` tiers above it, which every leaf of
        its pod shares: worked out once per (``v``, those switches), not per leaf (a DP ring
        over 65,536 GPUs met 122,000 (core, leaf) keys and 1,900 (core, pod) ones)."""
        e = self._ecmp_columns
        names, n = e["names"], len(e["names"])
        x, tier = np.divmod(keys, base)
        v, b = np.divmod(x, n)
        pair, edge = self._fabric_cables
        count = np.zeros(len(keys), dtype=np.int64)
        start = np.zeros(len(keys), dtype=np.int64)
        # (a) down to b itself: the cable v -> b
        low = np.flatnonzero(tier == 0)
        j = np.minimum(np.searchsorted(pair, v[low] * n + b[low]), max(len(pair) - 1, 0))
        cabled = (pair[j] == v[low] * n + b[low]) if len(pair) else np.zeros(len(low), dtype=bool)
        count[low], start[low] = cabled, np.arange(len(low))
        ids_a, nxt_a = np.where(cabled, edge[j] if len(pair) else -1, -1), b[low]
        # (b) higher: per (v, the switches i tiers above b)
        high = np.flatnonzero(tier > 0)
        ids_b, nxt_b = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        if len(high):
            leaf_tier, inv = np.unique(b[high] * base + tier[high], return_inverse=True)
            set_ids: dict[frozenset, int] = {}
            set_of = np.array([set_ids.setdefault(self._above(names[lt // base])[lt % base], len(set_ids))
                               for lt in leaf_tier.tolist()], dtype=np.int64)
            sets = list(set_ids)
            pairs, back = np.unique(v[high] * len(sets) + set_of[inv.ravel()], return_inverse=True)
            code, cabled_to = e["code"], self._cabled
            lists = [sorted(code[w] for w in sets[p % len(sets)] & cabled_to[names[p // len(sets)]])
                     for p in pairs.tolist()]
            sizes = np.fromiter(map(len, lists), np.int64, len(lists))
            nxt_b = np.fromiter(itertools.chain.from_iterable(lists), np.int64, int(sizes.sum()))
            from_v = np.repeat(pairs // len(sets), sizes)
            ids_b = edge[np.searchsorted(pair, from_v * n + nxt_b)]
            back = back.ravel()
            count[high] = sizes[back]
            start[high] = len(low) + (np.cumsum(sizes) - sizes)[back]
        flat_ids, flat_nxt = np.concatenate([ids_a, ids_b]), np.concatenate([nxt_a, nxt_b])
        take = np.repeat(start - (np.cumsum(count) - count), count) + np.arange(int(count.sum()))
        return count, flat_ids[take], flat_nxt[take]

    @cached_property
    def _fabric_cables(self) -> tuple[np.ndarray, np.ndarray]:
        """(``code u * switches + code w`` of every cable between two fabric switches, sorted;
        its edge id), codes as :attr:`_ecmp_columns` numbers the switches."""
        e = self._ecmp_columns
        code, n, index = e["code"], len(e["names"]), self.edge_index
        got = [(code[u] * n + code[w], index[(u, w)]) for u, w in self._fabric.edges() if (u, w) in index]
        pair = np.array([p for p, _ in got], dtype=np.int64)
        edge = np.array([i for _, i in got], dtype=np.int64)
        order = np.argsort(pair, kind="stable")
        return pair[order], edge[order]

    def pxn_proxies(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """:meth:`pxn_proxy` of every pair, -1 for None: the GPU of ``dst``'s local index on
        ``src``'s node where it is on ``dst``'s rail, else asked of :meth:`pxn_proxy`."""
        c = self._gpu_columns
        rail_d = c["rail"][dst]
        cross = (c["node"][src] != c["node"][dst]) & (rail_d >= 0) & (c["rail"][src] != rail_d)
        out = np.full(len(src), -1, dtype=np.int64)
        guess = c["node"][src] * self.cfg.node.gpus + c["local"][dst]
        ok = cross & (c["local"][dst] >= 0) & (guess >= 0) & (guess < len(self.gpu_names))
        ok[ok] &= c["rail"][guess[ok]] == rail_d[ok]
        out[ok] = guess[ok]
        for i in np.flatnonzero(cross & ~ok).tolist():
            p = self.pxn_proxy(int(src[i]), int(dst[i]))
            out[i] = -1 if p is None else p
        return out

    def path_latency_s(self, path: tuple[int, ...]) -> float:
        lat = self.edge_latency_s
        return sum_left(lat[e] for e in path)

    def path_bw_Bps(self, path: tuple[int, ...]) -> float:
        bw = self.edge_bw_Bps
        return min((bw[e] for e in path), default=math.inf)


def _link(g: nx.DiGraph, u: str, v: str, line_bw_Bps: float, eff: float, latency_s: float, kind: str,
          cap_Bps: float | None = None):
    """Add a full-duplex cable: two directed edges with the same figures (``cap_Bps``: a
    slower link in series that the graph has no edge for, a shared NIC's PCIe)."""
    for a, b in ((u, v), (v, u)):
        g.add_edge(a, b, line_bw_Bps=line_bw_Bps, efficiency=eff,
                   bw_Bps=_capped(line_bw_Bps * eff, cap_Bps), latency_s=latency_s, kind=kind)
        if cap_Bps is not None:
            g.edges[a, b]["cap_Bps"] = cap_Bps


def _capped(bw_Bps: float, cap_Bps: float | None) -> float:
    return bw_Bps if cap_Bps is None else min(bw_Bps, cap_Bps)


def build_cluster(cfg: TopologyCfg) -> Cluster:
    """Build the graph described by ``cfg`` (pure; same cfg -> same graph, same edge order)."""
    gpu = lookup_gpu(cfg.gpu)
    plan = check_size(cfg)
    n = cfg.node
    nics = n.nics or n.gpus
    nvl_bw = (n.nvlink.bw_GBps * 1e9) if n.nvlink.bw_GBps else gpu.nvlink_bw_Bps
    nic_bw = n.nic.bw_Gbps * 1e9 / 8
    g = nx.DiGraph(name=cfg.name)
    gpu_names: list[str] = []
    has_fabric = plan is not None and cfg.nodes > 1
    rails = plan.rails if plan else 1
    rail_optimized = has_fabric and cfg.fabric.rail_optimized

    for i in range(cfg.nodes):
        sw = f"n{i}.nvsw" if n.gpus > 1 else None
        if sw:
            g.add_node(sw, kind="nvswitch", node=i)
        for k in range(nics):
            leaf = f"leaf{i // plan.nodes_per_leaf}.{k % rails}" if has_fabric else None
            g.add_node(f"n{i}.nic{k}", kind="nic", node=i, leaf=leaf, rail=k % rails if rail_optimized else None)
        for j in range(n.gpus):
            name = f"n{i}.gpu{j}"
            nic = f"n{i}.nic{j // (n.gpus // nics)}"
            g.add_node(name, kind="gpu", node=i, local=j, switch=sw, nic=nic)
            gpu_names.append(name)
            if sw:
                _link(g, name, sw, nvl_bw, n.nvlink.efficiency, n.nvlink.latency_us * 1e-6, "nvlink")
            _link(g, name, nic, n.pcie_GBps * 1e9, 1.0, 0.0, "pcie")

    if has_fabric:
        _build_fabric(g, cfg, plan, nics, nic_bw)
    cluster = Cluster(cfg=cfg, gpu=gpu, graph=g, gpu_names=gpu_names)
    if cfg.what_if:
        _apply_what_ifs(cluster)
    cluster.edges = list(g.edges())
    return cluster


# the last cluster built while :func:`reused_clusters` holds, by its topology's file and JSON;
# None: not held
_REUSED: dict[str, Cluster] | None = None
# a cluster's memos of the pairs one plan asked routes for (its structure's caches are kept)
PAIR_MEMOS = ("_paths", "_pxn_paths", "_across_memo")


@contextmanager
def reused_clusters() -> Iterator[None]:
    """Inside the block, a scenario whose topology is the last one's (the same document, what-ifs
    included) gets that cluster again (:func:`cluster_of`), not one built anew: the plans of a
    sweep share one cluster, and a process forked inside the block inherits it. A cluster is
    read-only once built (its caches are of the topology alone), so what it gives a plan is
    the same either way; what a plan saves is the graph and its tables (Llama 3 405B on
    16,384 GPUs: a plan 1.8 s built anew, 1.2 s sharing). Inside another such block it is
    that block's (advise's two rounds of plans share it)."""
    global _REUSED
    if _REUSED is not None:
        yield
        return
    _REUSED = {}
    try:
        yield
    finally:
        _REUSED = None


def cluster_of(cfg: TopologyCfg) -> Cluster:
    """:func:`build_cluster` of ``cfg``, or inside :func:`reused_clusters` the last one built
    of the same topology, its pair memos dropped (they grow with the pairs each plan routes)."""
    if _REUSED is None:
        return build_cluster(cfg)
    key = f"{cfg._source}\n{cfg.model_dump_json()}"  # (its file too: a refusal names it)
    cluster = _REUSED.get(key)
    if cluster is None:
        _REUSED.clear()  # (one at a time: a sweep over cluster sizes would hold them all)
        cluster = _REUSED[key] = build_cluster(cfg)
    for memo in PAIR_MEMOS:
        cluster.__dict__.pop(memo, None)
    return cluster


def _build_fabric(g: nx.DiGraph, cfg: TopologyCfg, plan: FabricPlan, nics: int, nic_bw: float):
    """Leaves, NIC cables and the switches above the leaves (see :func:`plan_fabric`)."""
    fab, n = cfg.fabric, cfg.node
    lat_s = fab.latency_us * 1e-6
    leaves = [f"leaf{gi}.{r}" for gi in range(plan.groups) for r in range(plan.rails)]
    for leaf in leaves:
        g.add_node(leaf, kind="leaf", tier=1)
    # a NIC that several GPUs share has one PCIe link to them all (x16 into the PCIe switch
    # they hang off): each GPU's own link is its gpu-nic edge, that one caps the NIC's cable
    host_Bps = n.pcie_GBps * 1e9 if nics < n.gpus else None
    for i in range(cfg.nodes):
        for k in range(nics):
            nic = f"n{i}.nic{k}"
            _link(g, nic, g.nodes[nic]["leaf"], nic_bw, n.nic.efficiency, n.nic.latency_us * 1e-6, "nic", host_Bps)
    if len(leaves) == 1:
        return
    if fab.kind == "leaf_spine" or fab.tiers == 2:
        for s in range(plan.spines):
            g.add_node(f"spine{s}", kind="spine", tier=2)
            for leaf in leaves:
                _link(g, leaf, f"spine{s}", plan.leaf_up_Bps, fab.efficiency, lat_s, "fabric")
        return
    # three tiers: leaves of pod p are groups [p*Gp, (p+1)*Gp) with all their rails
    per_pod = plan.leaves_per_pod
    for p in range(plan.pods):
        for j in range(plan.spines):
            spine = f"pod{p}.spine{j}"
            g.add_node(spine, kind="spine", tier=2, pod=p)
            for leaf in leaves[p * per_pod:(p + 1) * per_pod]:
                _link(g, leaf, spine, plan.leaf_up_Bps, fab.efficiency, lat_s, "fabric")
    if plan.pods == 1:
        return
    for j in range(plan.spines):
        for c in range(plan.cores_per_plane):
            core = f"core{j}.{c}"
            g.add_node(core, kind="core", tier=3)
            for p in range(plan.pods):
                _link(g, f"pod{p}.spine{j}", core, plan.spine_up_Bps, fab.efficiency, lat_s, "fabric")


# ---------------------------------------------------------------------------------------------
# Fault what-ifs


def _apply_what_ifs(cluster: Cluster) -> None:
    """Apply ``cfg.what_if`` in order to the built graph.

    ``{link: "u-v", bw_factor: f}``   both directions of the cable: line rate and bw x f
    ``{remove_link: "u-v"}``          a network cable (NIC-leaf, leaf-spine, spine-core) is gone
    ``{remove_switch: "s"}``          a leaf, spine or core and all its cables are gone
    ``{gpu: i, slowdown: f}``         stored in ``cluster.gpu_slowdown`` (factors multiply)

    Routes are computed later on the graph that remains (``Cluster.path``). GPUs never forward
    for each other across the fabric, so a removal that leaves some GPU without a route to a
    GPU of another node partitions the cluster: a ConfigError naming the first entry that did
    and the GPUs cut off (see :class:`_Reach`). NVLink and PCIe cables and NVSwitches can be
    degraded but not removed (a node with a broken NVSwitch is drained, not run).
    """
    cfg = cluster.cfg
    removes = any(w.remove_link is not None or w.remove_switch is not None for w in cfg.what_if)
    reach = _Reach(cluster) if removes else None
    for i, w in enumerate(cfg.what_if):
        try:
            _apply_what_if(cluster, i, w, reach)
        except ConfigError:
            if reach is not None:  # an earlier entry that cut GPUs off is the first error
                reach.check()
            raise
    if reach is not None:
        reach.check()


def _mark_fault(cluster: Cluster, u: str, v: str, removed: bool = False) -> None:
    """Record the faulty cable ``u-v`` (or the removed switch ``u == v``) with the GPUs whose
    traffic may cross it where their twins' does not (which of them its flows touch depends
    on the plan: config.Scenario.node_touched_gpus and fabric_touched_gpus). A cable inside
    a node or from its NIC: that node's GPUs, in ``cluster.fault_cables``. A fabric cable:
    the GPUs of every node with a NIC below its lower end, in ``cluster.fabric_fault_cables``;
    a removed switch: those below it,
    unless that is every GPU (a spine of two tiers, a core: every leaf or pod loses the same
    uplinks, and the fabric stays as symmetric as it was). Up-down routes cross a switch's
    uplinks only from and to NICs below it, and a GPU's PXN leg leaves by a NIC of its own
    node, so no other GPU's flow reaches the fault::

        core
          |   <- a spine-core cable: the pod's nodes' GPUs (fabric)
        spine <- a pod's spine removed: the pod's nodes' GPUs (fabric)
          |   <- a leaf-spine cable: the leaf's nodes' GPUs (fabric)
        leaf      (a leaf removed cuts its NICs' GPUs off: an error, _Reach)
        /  \\
      n0    n1   <- a cable inside a node or from its NIC: that node's GPUs
    """
    g = cluster.graph
    nodes = {g.nodes[x].get("node") for x in (u, v)} - {None}
    faults = cluster.fault_cables
    if not nodes:
        lower = min({u, v}, key=lambda x: TIERS[g.nodes[x]["kind"]])
        leaves = [lower] if g.nodes[lower]["kind"] == "leaf" else \
            [x for x in g.predecessors(lower) if g.nodes[x]["kind"] == "leaf"]
        nodes = {g.nodes[x]["node"] for leaf in leaves for x in g.predecessors(leaf) if g.nodes[x]["kind"] == "nic"}
        if u == v and len(nodes) == cluster.cfg.nodes:
            return
        faults = cluster.fabric_fault_cables
    per = cluster.gpus_per_node
    faults.append((u, v, removed, frozenset(g for node in nodes for g in range(node * per, (node + 1) * per))))


def _apply_what_if(cluster: Cluster, i: int, w: WhatIfCfg, reach: _Reach | None) -> None:
    cfg, g = cluster.cfg, cluster.graph
    where = f"what_if[{i}]"
    if w.gpu is not None:
        if w.gpu >= cluster.num_gpus:
            raise _fail(cfg, where, f"GPU {w.gpu} does not exist; the cluster has GPUs 0-{cluster.num_gpus - 1}")
        cluster.gpu_slowdown[w.gpu] = cluster.gpu_slowdown.get(w.gpu, 1.0) * w.slowdown
    elif w.link is not None:
        u, v = _cable(cluster, w.link, where, "link")
        changed = False
        for a, b in ((u, v), (v, u)):
            e = g.edges[a, b]
            e["line_bw_Bps"] *= w.bw_factor
            was, e["bw_Bps"] = e["bw_Bps"], _capped(e["line_bw_Bps"] * e["efficiency"], e.get("cap_Bps"))
            changed |= e["bw_Bps"] != was
        if changed:  # (a factor of 1, or a cable its PCIe cap still holds: its twins stay its twins)
            _mark_fault(cluster, u, v)
    elif w.remove_link is not None:
        u, v = _cable(cluster, w.remove_link, where, "remove_link")
        _mark_fault(cluster, u, v, removed=True)
        kinds = (g.nodes[u]["kind"], g.nodes[v]["kind"])
        if not all(k in TIERS or k == "nic" for k in kinds):
            kind = {"nvlink": "an NVLink", "pcie": "a PCIe"}.get(g.edges[u, v]["kind"], "a")
            raise _fail(cfg, where, f"{u}-{v} is {kind} cable; only network cables "
                                    "(NIC-leaf, leaf-spine, spine-core) can be removed; degrade it with "
                                    "link and bw_factor instead")
        g.remove_edge(u, v)
        g.remove_edge(v, u)
        nics = [x for x in (u, v) if g.nodes[x]["kind"] == "nic"]
        for nic in nics:
            g.nodes[nic]["leaf"] = None
        reach.removed(i, f"removing cable {u}-{v}", edge=(u, v), nics=nics)
    else:
        s = w.remove_switch.strip()
        if s not in g:
            raise _fail(cfg, where, f"no switch named {short_repr(s)} in this topology{_names_hint(g)}")
        if g.nodes[s]["kind"] not in TIERS:
            kind = "an NVSwitch" if g.nodes[s]["kind"] == "nvswitch" else f"a {g.nodes[s]['kind']}"
            raise _fail(cfg, where, f"{s} is {kind}, not a fabric switch (leaf, spine or core); "
                                    "only those can be removed")
        nics = [x for x in g.predecessors(s) if g.nodes[x]["kind"] == "nic"]
        _mark_fault(cluster, s, s, removed=True)
        for nic in nics:
            g.nodes[nic]["leaf"] = None
        g.remove_node(s)
        reach.removed(i, f"removing switch {s}", switch=s, nics=nics)


def _cable(cluster: Cluster, spec: str, where: str, key: str) -> tuple[str, str]:
    """The two ends of cable ``"u-v"`` (vertex names hold no '-'), or a ConfigError. ``"u->v"``,
    as the terminal and the report name a link (one direction of a cable), names the same
    cable: a what-if takes the cable, both ways."""
    g, cfg = cluster.graph, cluster.cfg
    ends = [p.strip() for p in spec.replace("->", "-").split("-")]
    quoted = short_repr(spec)
    if len(ends) != 2 or not all(ends):
        raise _fail(cfg, where, f"{key} {quoted} is not a cable; write its two ends as \"u-v\", "
                                "e.g. \"n0.nic0-leaf0.0\"")
    for end in ends:
        if end not in g:
            raise _fail(cfg, where, f"{key} {quoted}: no vertex named {short_repr(end)} in this "
                                    f"topology{_names_hint(g, node=True)}")
    u, v = ends
    if not g.has_edge(u, v):
        raise _fail(cfg, where, f"{key} {quoted}: {u} and {v} are not joined by a cable")
    return u, v


def _names_hint(g: nx.DiGraph, node: bool = False) -> str:
    """Examples of switch names, for an error about a misspelt one; with ``node``, node 0's
    vertices too (a cable's end is as often a GPU, its NVSwitch or a NIC: ``n0.nvsw``)."""
    first: dict[str, list[str]] = {}
    inside: dict[str, list[str]] = {}
    for v, k in g.nodes(data="kind"):
        if k in TIERS:
            first.setdefault(k, []).append(v)
        elif node and v.startswith("n0."):
            inside.setdefault(k, []).append(v)

    def listed(groups: dict[str, list[str]]) -> str:
        return "; ".join(f"{vs[0]} ... {vs[-1]}" if len(vs) > 1 else vs[0] for vs in groups.values())

    order = {"gpu": 0, "nvswitch": 1, "nic": 2}  # (a GPU's cables first, as they run)
    inside = dict(sorted(inside.items(), key=lambda kind: order.get(kind[0], 3)))
    said = [f"node 0's: {listed(inside)}"] if inside else []
    said.append(f"switches: {listed(first)}" if first else
                f"{'the topology' if inside else 'it'} has no network switches")
    return " (" + "; ".join(said) + ")"


class _Reach:
    """Whether every GPU still reaches the GPUs of other nodes after the what-if removals.

    Across nodes a GPU reaches another only through its own NIC, its leaf and the switches
    (GPUs do not forward), so two GPUs of different nodes are joined exactly when their NICs'
    leaves lie in one connected part of the switch graph. In the intact fabric every leaf is in
    one part; after the removals every GPU must still be.

    Checked once, after the last removal, not after each: a check walks the whole fabric, and
    a long what_if list on a large cluster took minutes. Removals only take away, so when the
    end state is whole every state before it was; when it is not, the first entry that cut
    GPUs off is found by bisection over the removals, replayed on the intact switch graph.
    """

    def __init__(self, cluster: Cluster):
        g = cluster.graph
        self.cluster = cluster
        self.switches = nx.Graph()  # intact, before any removal
        self.switches.add_nodes_from(v for v, k in g.nodes(data="kind") if k in TIERS)
        self.switches.add_edges_from((u, v) for u in self.switches for v in g.successors(u) if v in self.switches)
        self.nic_gpus: dict[str, list[int]] = {}  # NIC -> the GPUs behind it
        for x, name in enumerate(cluster.gpu_names):
            self.nic_gpus.setdefault(g.nodes[name]["nic"], []).append(x)
        self.nic_leaf = {nic: g.nodes[nic]["leaf"] for nic in self.nic_gpus}
        # per removal: (entry index, what it did, cable or None, switch or None, NICs it detached)
        self.removals: list[tuple[int, str, tuple[str, str] | None, str | None, list[str]]] = []

    def removed(self, i: int, what: str, *, edge: tuple[str, str] | None = None, switch: str | None = None,
                nics: list[str]) -> None:
        self.removals.append((i, what, edge, switch, nics))

    def check(self) -> None:
        """ConfigError naming the first removal that cut a GPU off, if one did."""
        n = len(self.removals)
        if self.cluster.cfg.nodes < 2 or n == 0 or self._cut_off(n) is None:
            return
        lo, hi = 1, n  # the fewest removals, from the first, that cut a GPU off
        while lo < hi:
            mid = (lo + hi) // 2
            if self._cut_off(mid) is None:
                lo = mid + 1
            else:
                hi = mid
        i, what = self.removals[lo - 1][:2]
        raise _fail(self.cluster.cfg, f"what_if[{i}]", f"{what} {self._cut_off(lo)}")

    def _cut_off(self, k: int) -> str | None:
        """After the first ``k`` removals: None if every GPU reaches the others, else why not."""
        switches, detached = self.switches.copy(), set()
        for _, _, edge, switch, nics in self.removals[:k]:
            if edge is not None and switches.has_edge(*edge):
                switches.remove_edge(*edge)
            if switch is not None:
                switches.remove_node(switch)
            detached.update(nics)
        part = {v: j for j, comp in enumerate(nx.connected_components(switches)) for v in comp}
        groups: dict[int | None, list[int]] = {}
        for nic, gpus in self.nic_gpus.items():
            leaf = None if nic in detached else self.nic_leaf[nic]
            groups.setdefault(part[leaf] if leaf is not None else None, []).extend(gpus)
        if len(groups) == 1 and None not in groups:
            return None
        # the largest part is "the rest"; every other part, and every GPU whose NIC lost its leaf, is cut off
        main = max((j for j in groups if j is not None), key=lambda j: (len(groups[j]), -min(groups[j])),
                   default=None)
        cut = sorted(x for j, xs in groups.items() if j != main for x in xs)
        rest = self.cluster.num_gpus - len(cut)
        others = "the other GPU" if rest == 1 else f"the other {rest} GPUs"
        msg = (f"cuts GPU{'s' if len(cut) != 1 else ''} {_gpu_list(cut)} off from {others}"
               if main is not None else "leaves no GPU connected to the fabric")
        if len(groups) > 2 and None not in groups:
            msg += f" (the fabric falls into {len(groups)} parts)"
        # (a GPU reaches other nodes through its own NIC here: NCCL's PXN detour over a
        # node-mate's NIC, which a real DGX could take, is not modelled)
        return msg + ("; no route is left between them through the network (a GPU sends across nodes through its "
                      "own NIC here)")


def _gpu_list(ids: list[int], most: int = 6) -> str:
    """Sorted GPU indices, compactly: "0-7", "0, 8, ..., 152", "3, 17-20"."""
    if not ids:
        return "none"
    if len(ids) >= 3 and len({b - a for a, b in itertools.pairwise(ids)}) == 1 and ids[1] - ids[0] > 1:
        return f"{ids[0]}, {ids[1]}, ..., {ids[-1]} ({len(ids)} GPUs)"
    runs: list[str] = []
    start = prev = ids[0]
    for x in [*ids[1:], None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        runs.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    if len(runs) > most:
        return ", ".join(runs[:most]) + f", ... ({len(ids)} GPUs)"
    return ", ".join(runs)
