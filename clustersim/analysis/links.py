"""Link utilisation: how much of each link's bandwidth the step used, per kind and at worst.

    utilisation       = bytes / (bw * T)          mean over the step, T the step time
    peak_utilisation  = peak rate / bw            the busiest 1/100 of the step
    utilisation_over_time                          the rate / bw in each 1/100 of the step

``bw`` is the link's usable bandwidth (line rate x efficiency). Collapsed simulation works
out the links of the simulated ranks' communications and every scale-out link a twin crosses,
and every PCIe lane to a NIC that GPUs share (engine.sim.Engine._twins_links); the report
then gives every GPU the use of its other links inside its node (:func:`every_gpu_rows`), as its
class's simulated rank's, so that every GPU's links are listed, as rank by rank.
"""

from __future__ import annotations

import heapq
from itertools import chain, compress, repeat
from operator import attrgetter

import numpy as np

from ..floats import digits
from ..trace import LinkUse, Trace

BUSIEST = 10


def every_gpu_rows(links: list[LinkUse], owned: tuple[tuple[str, ...], ...], rep,
                   nic_links: tuple | None = None) -> tuple[np.ndarray, list[str], dict[int, float]] | None:
    """Every GPU's links as rows that each take a link of ``links``'s use under a name of
    their own, without making a LinkUse for each (at 65,536 GPUs, 528,000 of them): (per
    row, the index in ``links`` whose bytes, peak and rate over time it takes; its name; the
    rows that are PCIe lanes taking their NIC's cable's use, with the lane's bandwidth, kind
    "pcie"), in this order: the links that are no GPU's own, each GPU's own links in GPU
    order, then the lanes; None where every rank was simulated (``links`` as they are).

    Every GPU's own links inside its node (``owned``: per GPU, its NVLink ports and PCIe
    lane, hardware.topology Cluster.owned_links) take the use of those of the simulated rank
    its class runs on (``rep``, per GPU): a class's members run the same communications at
    the same times, each over its own ports, so theirs carry the same::

        collapsed         n0.gpu0->n0.nvsw  (simulated rank 0)  x bytes
        every GPU         n0.gpu0->n0.nvsw, n1.gpu0->n1.nvsw, ...  x bytes each (their class's)

    The use worked out for a GPU's own link that is not its class's simulated rank's (a
    flow of a simulated communication crossed it, beside none of that GPU's other traffic)
    is replaced. The NICs' cables and the fabric's links count every twin already (engine.sim
    Engine._twins_links), and so does every link where GPUs share a NIC, which ``owned``
    leaves out (Cluster.twins_cross_mask). A GPU's PCIe lane to a NIC of its own
    (``nic_links``: per GPU, Cluster.own_nic_links) carries what the NIC's cable does, by
    conservation at the NIC, PXN's flows forwarded from node-mates included (which its
    class's simulated rank's lane, as the collapse counts it, misses: the twins' forwarded
    flows cross no simulated link there)::

        n0.gpu2 -NVLink- n0.gpu5 -PCIe- n0.nic5 -cable- leaf.5        the lane = the cable
    """
    if rep is None or all(r == g for g, r in enumerate(rep)):
        return None
    link_names = list(map(attrgetter("name"), links))
    at = dict(zip(link_names, range(len(links))))  # (the last of a name, as a dict of them keeps)
    flat = list(chain.from_iterable(owned))  # every GPU's own links' names, GPU by GPU
    mine = set(flat)
    others = ~np.fromiter(map(mine.__contains__, link_names), bool, len(links))  # no GPU's own
    src = np.flatnonzero(others)
    names = list(compress(link_names, others.tolist()))
    if flat:  # every GPU has as many (Cluster.owned_edges); GPU g's j-th takes rep[g]'s j-th's use
        idx = np.fromiter(map(at.get, flat, repeat(-1)), np.int64, len(flat)).reshape(len(owned), -1)
        theirs = idx[np.asarray(rep, dtype=np.int64)].ravel()
        found = theirs >= 0
        src = np.concatenate([src, theirs[found]])
        names += compress(flat, found.tolist())
    lane_use: dict[str, tuple[int, float]] = {}  # lane -> (its cable's index, the lane's bandwidth)
    for hit in nic_links or ():
        if hit is not None:
            up, down, bw, cable_up, cable_down = hit
            for lane, cable in ((up, cable_up), (down, cable_down)):
                i = at.get(cable)
                if i is not None:
                    lane_use[lane] = (i, bw)
    lanes: dict[int, float] = {}
    if lane_use:
        keep = ~np.fromiter(map(lane_use.__contains__, names), bool, len(names))
        src, names = src[keep], list(compress(names, keep.tolist()))
        first = len(src)
        lanes = {first + k: bw for k, (_, bw) in enumerate(lane_use.values())}
        src = np.concatenate([src, np.fromiter((i for i, _ in lane_use.values()), np.int64, len(lane_use))])
        names += lane_use
    return src.astype(np.int64, copy=False), names, lanes


# links whose means lie within this of each other may be equal to nine digits (floats.digits)
NEAR = 2e-8


def _near_the_top(use: np.ndarray, among: np.ndarray, n: int) -> np.ndarray:
    """The links of ``among`` (indices into ``use``) whose use lies within :data:`NEAR` of
    their ``n``-th highest or above: every one that could rank among the first ``n`` to nine
    digits (a larger gap is a smaller ninth digit)."""
    if len(among) <= n:
        return among
    u = use[among]
    nth = np.partition(u, len(u) - n)[len(u) - n]
    return among[u >= nth * (1.0 - NEAR)]


def first_by_use(use: np.ndarray, among: np.ndarray, n: int, name) -> list[int]:
    """The first ``n`` of ``among`` by use to nine digits, highest first, then by ``name(i)``:
    the links whose rate over time the engine works out (engine.sim.Engine._link_use: the
    step's ``n`` busiest, and each kind's busiest) and the summary reads its peaks from. To
    nine digits, so that last bits (twins' bytes added in another order, collapsed) do not
    pick other links. The engine names a link by its pair of ends, the summary by "u->v":
    the two order alike, since no GPU's or switch's name holds a character below "-"
    (tests/test_topology.py)."""
    near = _near_the_top(use, among, n)
    if len(near) <= n:
        return near.tolist()
    # nine digits once per value, names only where they decide: links alike (every GPU's
    # NVLink ports) share their values, thousands of them
    values = use[near].tolist()
    said = {v: digits(v) for v in set(values)}
    d = np.fromiter(map(said.__getitem__, values), float, len(values))
    last = np.partition(d, len(d) - n)[len(d) - n]  # the n-th highest
    above = near[d > last].tolist()
    return above + heapq.nsmallest(n - len(above), near[d == last].tolist(), key=name)


def link_report(trace: Trace, step_s: float, owned: tuple[tuple[str, ...], ...] | None = None,
                nic_links: tuple | None = None) -> dict:
    """``links`` of summary.json: per kind of link, and the busiest links; with ``owned``
    (Cluster.owned_links) and ``nic_links`` (Cluster.own_nic_links), every GPU's own links
    (:func:`every_gpu_rows`). On arrays, one row a link: a
    kind's bytes summed in the links' order (a cumulative sum, as a loop adds them), so the
    figures are those of a loop over the links, bit for bit."""
    if step_s <= 0 or not trace.links:
        return {"by_kind": {}, "busiest": []}
    links = trace.links
    rows = None if owned is None else every_gpu_rows(links, owned, trace.rep, nic_links)
    base_kinds = sorted({u.kind for u in links} | ({"pcie"} if rows is not None and rows[2] else set()))
    code_of = {k: c for c, k in enumerate(base_kinds)}
    kind = np.fromiter((code_of[u.kind] for u in links), np.int64, len(links))
    nbytes = np.fromiter((u.bytes for u in links), float, len(links))
    bw = np.fromiter((u.bw_Bps for u in links), float, len(links))
    peak = np.fromiter((u.peak_Bps for u in links), float, len(links))
    if rows is None:
        src, names, lanes = np.arange(len(links)), [u.name for u in links], {}
    else:
        src, names, lanes = rows
    kind, nbytes, bw, peak = kind[src], nbytes[src], bw[src], peak[src]
    if lanes:
        at = np.fromiter(lanes, np.int64, len(lanes))
        kind[at] = code_of["pcie"]
        bw[at] = np.fromiter(lanes.values(), float, len(lanes))
    util = nbytes / (bw * step_s)
    use = nbytes / bw
    by_kind: dict[str, dict] = {}
    of_kind: dict[str, np.ndarray] = {}
    for c, k in enumerate(base_kinds):
        at = np.flatnonzero(kind == c)
        if not len(at):
            continue
        of_kind[k] = at
        by_kind[k] = {"links": len(at), "bytes": float(np.cumsum(nbytes[at])[-1]),
                      "max_utilisation": max(0.0, float(util[at].max())), "max_peak_utilisation": 0.0}
    # peaks are worked out for the links the engine picks: the kind's highest among them (not
    # among every link with a series: collapsed, a PCIe lane's comes from its NIC's cable)
    picked = set(first_by_use(use, np.arange(len(src)), BUSIEST, names.__getitem__))
    for k, at in of_kind.items():
        picked.update(first_by_use(use, at, 1, names.__getitem__))
    for i in picked:
        k = by_kind[base_kinds[kind[i]]]
        k["max_peak_utilisation"] = max(k["max_peak_utilisation"], float(peak[i] / bw[i]))
    # ranked by bytes / bw, as the engine picks the links it works the rate over time out for
    # (engine.sim.Engine._link_use): by the mean, a last-bit difference in the bytes of two
    # links tied there could put links without a series among the busiest (DeepSeek-V3's NIC
    # cables: a peak of 0 under a mean of 55 %). Among links tied, those with a series first.
    # The mean to nine digits: a collapsed run's twins add a link's bytes in another order than
    # every rank's run, and two links' last bits swapped them
    near = _near_the_top(use, np.arange(len(src)), BUSIEST).tolist()
    said = {v: digits(v) for v in set(use[near].tolist())}
    series = lambda i: links[src[i]].series_Bps  # noqa: E731
    busiest = heapq.nsmallest(BUSIEST, near, key=lambda i: (-said[use[i]], not series(i), names[i]))
    return {
        "by_kind": dict(sorted(by_kind.items())),
        "busiest": [{"link": names[i], "kind": base_kinds[kind[i]], "bytes": float(nbytes[i]), "bw_Bps": float(bw[i]),
                     "utilisation": float(util[i]), "peak_utilisation": float(peak[i] / bw[i]),
                     "utilisation_over_time": [round(x / float(bw[i]), 6) for x in series(i)]} for i in busiest],
    }
