"""Link utilisation: how much of each link's bandwidth the step used, per kind and at worst.

    utilisation       = bytes / (bw * T)          mean over the step, T the step time
    peak_utilisation  = peak rate / bw            the busiest 1/100 of the step
    utilisation_over_time                          the rate / bw in each 1/100 of the step

``bw`` is the link's usable bandwidth (line rate x efficiency). Collapsed simulation reports
the links of the simulated ranks' communications, and the scale-out links where their twins
meet another communication's (engine.sim.Engine._meetings; every communication crossing
such a link counts there): their twins' other links carry the same.
"""

from __future__ import annotations

from ..trace import Trace

BUSIEST = 10


def link_report(trace: Trace, step_s: float) -> dict:
    """``links`` of summary.json: per kind of link, and the busiest links."""
    if step_s <= 0 or not trace.links:
        return {"by_kind": {}, "busiest": []}

    def util(u) -> float:
        return u.bytes / (u.bw_Bps * step_s)

    by_kind: dict[str, dict] = {}
    for u in trace.links:
        k = by_kind.setdefault(u.kind, {"links": 0, "bytes": 0.0, "max_utilisation": 0.0,
                                        "max_peak_utilisation": 0.0})
        k["links"] += 1
        k["bytes"] += u.bytes
        k["max_utilisation"] = max(k["max_utilisation"], util(u))
        # peaks are worked out for the busiest links, the kind's busiest among them
        k["max_peak_utilisation"] = max(k["max_peak_utilisation"], u.peak_Bps / u.bw_Bps)
    # ranked by bytes / bw, as the engine picks the links it works the rate over time out for
    # (engine.sim.Engine._link_use): by the mean, a last-bit difference in the bytes of two
    # links tied there could put links without a series among the busiest (DeepSeek-V3's NIC
    # cables: a peak of 0 under a mean of 55 %)
    busiest = sorted(trace.links, key=lambda u: (-(u.bytes / u.bw_Bps), u.name))[:BUSIEST]
    return {
        "by_kind": dict(sorted(by_kind.items())),
        "busiest": [{"link": u.name, "kind": u.kind, "bytes": u.bytes, "bw_Bps": u.bw_Bps,
                     "utilisation": util(u), "peak_utilisation": u.peak_Bps / u.bw_Bps,
                     "utilisation_over_time": [round(x / u.bw_Bps, 6) for x in u.series_Bps]} for u in busiest],
    }
