"""Link utilisation: how much of each link's bandwidth the step used, per kind and at worst.

    utilisation       = bytes / (bw * T)          mean over the step, T the step time
    peak_utilisation  = peak rate / bw            the busiest 1/100 of the step
    utilisation_over_time                          the rate / bw in each 1/100 of the step

``bw`` is the link's usable bandwidth (line rate x efficiency). Collapsed simulation works
out the links of the simulated ranks' communications and every scale-out link a twin crosses,
and every PCIe lane to a NIC that GPUs share (engine.sim.Engine._twins_links); the report
then gives every GPU the use of its other links inside its node (:func:`every_gpu`), as its
class's simulated rank's, so that every GPU's links are listed, as rank by rank.
"""

from __future__ import annotations

import heapq

import numpy as np

from ..floats import digits
from ..trace import LinkUse, Trace

BUSIEST = 10


def every_gpu(links: list[LinkUse], owned: tuple[tuple[str, ...], ...], rep,
              nic_links: tuple | None = None) -> list[LinkUse]:
    """``links`` with every GPU's own links inside its node (``owned``: per GPU, its NVLink
    ports and PCIe lane, hardware.topology Cluster.owned_links) as those of the simulated rank
    its class runs on (``rep``, per GPU; None: every rank simulated): a class's members run
    the same communications at the same times, each over its own ports, so theirs carry the
    same::

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
        return links
    mine = {name for names in owned for name in names}
    by_name = {u.name: u for u in links}
    out = [u for u in links if u.name not in mine]
    for names, r in zip(owned, rep):
        for name, theirs in zip(names, owned[r]):
            u = by_name.get(theirs)
            if u is not None:
                out.append(u if name == theirs else LinkUse(name, u.kind, u.bw_Bps, u.bytes, u.peak_Bps, u.series_Bps))
    if nic_links:
        lanes = {}
        for hit in nic_links:
            if hit is not None:
                up, down, bw, cable_up, cable_down = hit
                for lane, cable in ((up, cable_up), (down, cable_down)):
                    c = by_name.get(cable)
                    if c is not None:
                        lanes[lane] = LinkUse(lane, "pcie", bw, c.bytes, c.peak_Bps, c.series_Bps)
        if lanes:
            out = [u for u in out if u.name not in lanes] + list(lanes.values())
    return out


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
    (:func:`every_gpu`)."""
    if step_s <= 0 or not trace.links:
        return {"by_kind": {}, "busiest": []}
    links = trace.links if owned is None else every_gpu(trace.links, owned, trace.rep, nic_links)

    def util(u) -> float:
        return u.bytes / (u.bw_Bps * step_s)

    by_kind: dict[str, dict] = {}
    of_kind: dict[str, list[int]] = {}
    for i, u in enumerate(links):
        k = by_kind.setdefault(u.kind, {"links": 0, "bytes": 0.0, "max_utilisation": 0.0,
                                        "max_peak_utilisation": 0.0})
        k["links"] += 1
        k["bytes"] += u.bytes
        k["max_utilisation"] = max(k["max_utilisation"], util(u))
        of_kind.setdefault(u.kind, []).append(i)
    # peaks are worked out for the links the engine picks: the kind's highest among them (not
    # among every link with a series: collapsed, a PCIe lane's comes from its NIC's cable)
    use = np.fromiter((u.bytes / u.bw_Bps for u in links), float, len(links))
    names = [u.name for u in links]
    picked = set(first_by_use(use, np.arange(len(links)), BUSIEST, names.__getitem__))
    for k, at in of_kind.items():
        picked.update(first_by_use(use, np.asarray(at), 1, names.__getitem__))
    for i in picked:
        k = by_kind[links[i].kind]
        k["max_peak_utilisation"] = max(k["max_peak_utilisation"], links[i].peak_Bps / links[i].bw_Bps)
    # ranked by bytes / bw, as the engine picks the links it works the rate over time out for
    # (engine.sim.Engine._link_use): by the mean, a last-bit difference in the bytes of two
    # links tied there could put links without a series among the busiest (DeepSeek-V3's NIC
    # cables: a peak of 0 under a mean of 55 %). Among links tied, those with a series first.
    # The mean to nine digits: a collapsed run's twins add a link's bytes in another order than
    # every rank's run, and two links' last bits swapped them
    near = _near_the_top(use, np.arange(len(links)), BUSIEST).tolist()
    said = {v: digits(v) for v in set(use[near].tolist())}
    busiest = [links[i] for i in heapq.nsmallest(BUSIEST, near, key=lambda i: (
        -said[use[i]], not links[i].series_Bps, links[i].name))]
    return {
        "by_kind": dict(sorted(by_kind.items())),
        "busiest": [{"link": u.name, "kind": u.kind, "bytes": u.bytes, "bw_Bps": u.bw_Bps,
                     "utilisation": util(u), "peak_utilisation": u.peak_Bps / u.bw_Bps,
                     "utilisation_over_time": [round(x / u.bw_Bps, 6) for x in u.series_Bps]} for u in busiest],
    }
