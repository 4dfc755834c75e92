"""One collective on an idle cluster, timed like nccl-tests: algbw and busbw per size.

    python -m clustersim collective --topology topologies/dgx-h100.yaml --op all_reduce \\
        --gpus 8 --sizes 1M,16M,1G,8G

The group is GPUs 0..n-1 (whole nodes first), the network otherwise idle. Definitions from
nccl-tests doc/PERFORMANCE.md, S the whole buffer, t the time::

    algbw = S / t          busbw = algbw * f,   f = 2(n-1)/n  all-reduce
                                                    (n-1)/n   reduce-scatter, all-gather, all-to-all

so that busbw of a ring tends to the bottleneck link's bandwidth, and can be held next to a
user's own nccl-tests output.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from .collectives.algorithms import ALGORITHMS
from .engine.network import plan_phases
from .engine.sim import Engine
from .errors import ConfigError
from .hardware.topology import MAX_GPUS, build_cluster, load_topology_cfg
from .yamlio import given_file, short_repr
from .program.tasks import Comm, Program

BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
MAX_SIZE = 1 << 50  # 1 PiB a buffer: a thousand times a GPU's memory


@dataclass(frozen=True)
class Row:
    size_bytes: int
    algorithm: str
    time_s: float
    bound: str = ""  # what sets the time alone (:func:`bound_by`)

    def algbw_Bps(self) -> float:
        return self.size_bytes / self.time_s

    def busbw_Bps(self, op: str, n: int) -> float:
        return self.algbw_Bps() * BUS_FACTOR[op](n)


def parse_sizes(text: str) -> list[int]:
    """"1M,16M,1G,8G" -> bytes, with binary multipliers as nccl-tests reads them (8G = 8 GiB)."""
    out = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", item, flags=re.IGNORECASE)
        if not m:
            raise ConfigError(f"cannot read size {short_repr(item.strip())}; use e.g. 1M,16M,1G,8G",
                              source="command line", field="--sizes")
        whole, _, part = m.group(1).partition(".")
        whole = whole.lstrip("0") or "0"
        # exact, where a float would round or overflow (the fraction's 40 digits tell the bytes apart)
        value = MAX_SIZE + 1 if len(whole) > 40 else int(Fraction(f"{whole}.{part[:40] or 0}") *
                                                         _UNITS[m.group(2).upper()])
        if value <= 0:
            what = "0 bytes" if m.group(1).strip("0.") == "" else "less than a byte"
            raise ConfigError(f"size {short_repr(item.strip())} is {what}; sizes are whole bytes, at least 1",
                              source="command line", field="--sizes")
        if value > MAX_SIZE:
            raise ConfigError(f"size {short_repr(item.strip())} is more than {_size_label(MAX_SIZE)}, the largest "
                              f"clustersim times", source="command line", field="--sizes")
        out.append(value)
    return out


# an all-to-all is a flow per ordered pair of GPUs: memory and time grow with the square (1,024
# GPUs: 1,047,552 flows, 2.2 GB, 12 s; 100,000 GPUs were killed for memory at 24 GB)
MAX_ALL_TO_ALL_GPUS = 1024


def benchmark(topology: str | Path, op: str, gpus: int, sizes: list[int], algorithm: str = "auto"):
    """(cluster, rows): ``op`` over GPUs 0..gpus-1 of ``topology``, one row per size."""
    path = given_file(str(topology), what="topology", source="command line", field="--topology")
    if op not in BUS_FACTOR:
        raise ConfigError(f"unknown collective {op!r}; one of {', '.join(BUS_FACTOR)}", source="command line",
                          field="--op")
    if algorithm != "auto" and algorithm not in ALGORITHMS[op]:
        raise ConfigError(f"{op} has no algorithm {algorithm!r}; one of auto, {', '.join(ALGORITHMS[op])}",
                          source="command line", field="--algo")
    per_node = load_topology_cfg(path).node.gpus
    if gpus < 2:
        raise ConfigError("a collective needs at least 2 GPUs", source="command line", field="--gpus")
    if op == "all_to_all" and gpus > MAX_ALL_TO_ALL_GPUS:
        raise ConfigError(f"all_to_all over {_count(gpus)} GPUs is {_count(gpus * (gpus - 1))} flows, one per "
                          f"ordered pair; clustersim times it over at most {MAX_ALL_TO_ALL_GPUS:,} GPUs (about a "
                          f"million flows, 2 GB and some seconds)", source="command line", field="--gpus")
    nodes = -(-gpus // per_node)  # (whole nodes, in integers: a float overflows past 1e308 GPUs)
    if nodes * per_node > MAX_GPUS:  # (said here: the topology's own check would say it of nodes, three numbers again)
        whole = f" take {nodes:,} nodes of {per_node} ({nodes * per_node:,} GPUs)" if nodes * per_node != gpus else ""
        raise ConfigError(f"{_count(gpus)} GPUs{whole}; clustersim builds the cluster graph in memory and takes at "
                          f"most {MAX_GPUS:,} GPUs", source="command line", field="--gpus")
    try:  # the topology checked out with its own node count: what fails now is the count --gpus asks for
        cluster = build_cluster(load_topology_cfg(path, {"nodes": nodes}))
    except ConfigError as exc:
        raise ConfigError(f"{gpus:,} GPUs take {nodes:,} node{'s' if nodes != 1 else ''} of {path}: {exc.message}",
                          source="command line", field="--gpus") from None
    group = tuple(range(gpus))
    rows = []
    for size in sizes:
        prog = Program(ranks=[0], weight={0: gpus})
        prog.add(rank=0, stream="c", name=op, kind="dp", comm=Comm(op, float(size), group, (), (0,), ("c", (0,), 0)))
        engine = Engine(prog, cluster, "flow", {op: algorithm})
        (span,) = engine.run().spans
        comm = prog.tasks[0].comm
        algo = engine.algorithm(comm)
        rows.append(Row(size, algo, span.dur_s, bound_by(cluster, plan_phases(cluster, comm, algo), size)))
    return cluster, rows


# how the table names a link kind (Cluster.edge_kind)
LINK_NAMES = {"nvlink": "NVLink", "pcie": "PCIe", "nic": "NIC", "fabric": "fabric"}


def bound_by(cluster, phases, size_bytes: float) -> str:
    """What sets the time of a collective's ``phases`` alone: ``latency`` where their latency
    rounds take longer than their bytes, else the kind of their busiest link, the one whose
    bytes take the most time at its bandwidth::

        busy(e) = sum over flows f of weight(f, e) x fraction(f) x S / bw(e)

    (a pipeline's hops weigh their own share of its bytes). ``fabric`` says the switches above
    the NICs bind: oversubscription, or ECMP hashing flows onto the same cables."""
    bw = cluster.edge_bw_Bps
    latency_s = busiest_s = 0.0
    busiest = ""
    for plan in phases:
        busy: dict[int, float] = {}
        for f, ws in zip(plan.fractions, plan.weights):
            for e, w in ws:
                busy[e] = busy.get(e, 0.0) + w * f * size_bytes / bw[e]
        latency_s += plan.latency_s
        if busy:
            e = max(busy, key=lambda k: (busy[k], -k))
            if busy[e] > busiest_s:
                kind = cluster.binding_kind(e)  # (a shared NIC's cable held to its PCIe: pcie)
                busiest_s, busiest = busy[e], LINK_NAMES.get(kind, kind)
    return "latency" if latency_s >= busiest_s else busiest


def fabric_why(cfg) -> str:
    """Why a collective is bound by the switches above the NICs, as far as the topology ``cfg``
    says: leaf-spine cables slower than a NIC (``link_ceilings``), the oversubscription, and
    flows sharing uplinks, by hash or by destination (``fabric.routing``)."""
    from .hardware.topology import link_ceilings
    from .output.summary import link_ceiling_said

    fab = cfg.fabric
    causes = [link_ceiling_said(c) for c in link_ceilings(cfg) or () if c["link"] == "leaf_spine"]
    over = [x for x in (fab.oversubscription, fab.pod_oversubscription or 1.0) if x > 1]
    if over:
        causes.append(f"oversubscription {' and '.join(f'{x:g}:1' for x in over)}")
    causes.append("ECMP hashing flows onto the same cables (fabric.routing: destination spreads them)"
                  if fab.routing == "hash" else "flows to destinations that share an uplink (fabric.routing: "
                  "destination)")
    return f"the switches above the NICs: {', or '.join(causes)}; docs/network.md"


def _count(n: int) -> str:
    """``n`` with thousands separators, cut as :func:`short_repr` cuts it where it runs past 30
    digits (``--gpus`` is any integer argparse reads: thousands of digits)."""
    return f"{n:,}" if n < 10**30 else short_repr(n)


def _size_label(b: int) -> str:
    for unit in ("T", "G", "M", "K"):
        if b >= _UNITS[unit] and b % _UNITS[unit] == 0:
            return f"{b // _UNITS[unit]} {unit}iB"
    return f"{b} B"


def format_table(cluster, op: str, gpus: int, rows: list[Row], asked: str = "auto",
                 topology_nodes: int | None = None) -> str:
    """The table ``collective`` prints; where ``asked`` (an algorithm named with --algo) cannot
    run these GPUs, a last line says which one ran instead (a scenario falls back alike); where
    the GPUs take more nodes than the topology file's own ``topology_nodes``, a line says the
    fabric was grown to hold them."""
    nodes = math.ceil(gpus / cluster.cfg.node.gpus)
    lines = [f"clustersim collective · {op} over {gpus} GPUs ({nodes} node{'s' if nodes > 1 else ''} of "
             f"{cluster.cfg.name}, {cluster.gpu.name})",
             f"{'size':>10}  {'algorithm':<12} {'time (us)':>11} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}  bound by"]
    for r in rows:
        lines.append(f"{_size_label(r.size_bytes):>10}  {r.algorithm:<12} {r.time_s * 1e6:>11.1f} "
                     f"{r.algbw_Bps() / 1e9:>13.1f} {r.busbw_Bps(op, gpus) / 1e9:>13.1f}  {r.bound}".rstrip())
    ran = sorted({r.algorithm for r in rows} - {asked})
    if asked != "auto" and ran:
        lines.append(f"note: {asked} cannot run {op} over these {gpus} GPUs; {' and '.join(ran)} ran instead "
                     "(docs/reference.md, simulation.collectives)")
    for kind, why in (("fabric", fabric_why(cluster.cfg)),
                      ("PCIe", "PCIe between the GPUs and their NICs, below the NICs' rate (node.pcie_GBps)")):
        bound = [_size_label(r.size_bytes) for r in rows if r.bound == kind]
        if bound:
            lines.append(f"note: {', '.join(bound)} {'is' if len(bound) == 1 else 'are'} bound by {why}")
    if topology_nodes is not None and nodes > topology_nodes:
        lines.append(f"note: the topology file describes {topology_nodes:,} node{'s' if topology_nodes != 1 else ''}; "
                     f"its fabric was grown to {nodes:,}, as a scenario's cluster.nodes grows it")
    return "\n".join(lines)
