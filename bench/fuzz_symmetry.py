"""Random plans simulated collapsed (one rank per symmetry class) and rank by rank, to measure
how far the collapse is from the all-ranks step where the twins' model is not exact.
tests/test_symmetry.py holds fixed plans where it is exact to 1e-9; this draws many more
(topology, 16-256 GPUs, TP, PP and its schedules, DP, CP ring or all-gather, balanced or
not, over 2 ranks or, since 2026-12-07, 4 or 8 whose rings cross nodes, some hierarchical, SP, EP over DP or CP ranks with skewed expert load and experts whole or split over
fewer TP ranks, DeepEP's dispatch with and without router groups, latent attention,
multi-token prediction, FP8, ZeRO 0-3, recompute, slow GPUs, degraded NVLink, NIC and leaf-spine
cables),
and docs/architecture.md ("Known limitations") quotes what it measures::

    python bench/fuzz_symmetry.py [seed] [plans] [--classes replica]     (default 0, 20, stage)

Per plan, how the collapsed step compares with the all-ranks one:

    exact      every figure within 1e-9 relative, memory included
    within 1%  the step within 1 % either way (the other figures as printed)
    above      the step more than 1 % longer: twins whose paths ECMP spreads differently, the
               orbit moving at its slowest member's pace (an upper bound)
    BELOW      the step more than 1 % shorter: twins meeting other traffic on links their
               simulated rank does not cross (not an upper bound)

What must hold whatever the network does, since it does not depend on timing: the compute
time per GPU and the memory's static parts (parameters, gradients, optimizer, activation
bytes per microbatch, microbatches in flight, transient buffers). A plan where they differ
is BROKEN, and the script exits 1. It ends with the count of each verdict, the verdicts of
the plans whose summary flags communications that moved at their slowest twin's pace
(``simulation.asymmetric_orbits``, at the end of their lines) and of the others, how many
plans' links differ in count or bytes, how many exact plans differ in any other figure of
summary.json (:func:`other_figures`: the critical path, the exposed causes and what shared
their bottlenecks, ...; the first such figure at the end of the plan's line), the spread of
the step and how far one kind's exposed time (a mean over GPUs) is apart at most.
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections import Counter
from pathlib import Path

from fuzz_args import (CLASSES, two_counts, with_classes, with_deepep, with_dualpipev,  # sibling scripts
                       with_ep_over_cp, with_etp, with_fp8, with_mla, with_mtp, with_wide_cp,
                       with_recompute_layers)  # (bench/ is on the path)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import clustersim  # noqa: E402
from tests.test_symmetry import of_the_step  # noqa: E402

TOPOLOGIES = {  # file -> (GPUs per node, node counts to draw from: 16-256 GPUs)
    "dgx-a100.yaml": (8, [2, 4, 8, 16, 32]), "dgx-h100.yaml": (8, [2, 4, 8, 16, 32]),
    "h800-cluster.yaml": (8, [2, 4, 8, 16]), "fat-tree.yaml": (8, [2, 4, 8, 16, 32]),
    "gb200-nvl72.yaml": (72, [1, 2, 3]), "roce-clos-llama3.yaml": (8, [4, 8, 16, 32]),
}
SCHEDULES = ["1f1b", "1f1b", "gpipe", "interleaved", "zb-h1", "dualpipe"]
FIGURES = ("step_time_s", "mfu", "hfu", "bubble_fraction", "compute_s", "exposed_comm_s", "comm_s")
EXACT = 1e-9  # relative
WITHIN = 0.01  # the step's relative difference that counts as close either way


def _divisors(n: int, of: tuple[int, ...]) -> list[int]:
    return [x for x in of if n % x == 0]


def draw(rng: random.Random) -> dict:
    """One random plan of 16-256 GPUs with a few microbatches (the rank-by-rank run must stay
    short)."""
    topo = rng.choice(sorted(TOPOLOGIES))
    per, node_counts = TOPOLOGIES[topo]
    nodes = rng.choice(node_counts)
    world = per * nodes
    tp = rng.choice(_divisors(per, (1, 2, 4, 8)))
    cp = rng.choice([1, 1, 1, 2]) if world // tp % 2 == 0 else 1  # (72 / 8 is odd)
    pp = rng.choice(_divisors(world // (tp * cp), (1, 2, 4, 8)) or [1])
    dp = world // (tp * cp * pp)
    schedule = rng.choice(SCHEDULES) if pp > 1 else "1f1b"
    if schedule == "dualpipe" and pp % 2:
        schedule = "1f1b"
    if schedule == "zb-h1" and tp in (2, 8):  # ZB-V for about half of them (no draw: seeds keep their plans)
        schedule = "zbv"
    vpp = 2 if schedule in ("interleaved", "zbv") else 1  # (zbv: 2 pp parts, a layer each at least)
    m = {"dualpipe": 2 * pp, "interleaved": pp}.get(schedule, rng.choice([pp, 2 * pp]))
    model = {"name": "fuzz", "layers": pp * vpp * rng.choice([1, 2]), "hidden": 1024, "heads": 16,
             "vocab": 32000, "seq_len": 1024 * rng.choice([1, 2])}
    parallel = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "schedule": schedule, "zero": rng.choice([0, 1, 2, 3]),
                "sp": tp > 1 and rng.random() < 0.5}
    if schedule == "interleaved":
        parallel["vpp"] = vpp
    if cp > 1:
        parallel["cp_comm"] = rng.choice(["ring", "all_gather"])
        parallel["cp_load_balance"] = rng.random() < 0.6
        if parallel["cp_comm"] == "all_gather" and model["seq_len"] == 2048 and parallel["cp_load_balance"] \
                and (16 // tp) % cp == 0:  # all-to-all CP for some (no draw: seeds keep their streams)
            parallel["cp_comm"] = "all_to_all"
    eps = _divisors(dp, (2, 4, 8))
    if eps and rng.random() < 0.35:
        ep = rng.choice(eps)
        model["moe"] = {"experts": 8, "top_k": 2, "expert_ffn": 1024}
        parallel["ep"] = ep
        parallel["sp"] = parallel["sp"] or tp > 1  # EP with TP needs SP (no draw: seeds keep their plans)
        if rng.random() < 0.4:  # skewed expert load: EP index 0 takes more tokens
            load = [1.0] * ep
            load[0], load[-1] = 1.5, 0.5
            model["moe"]["ep_load"] = load
            if parallel["zero"]:  # a capacity cuts EP index 0 to 1.25 shares, ZeRO-2 plans padding to it (no draw)
                model["moe"].update(capacity_factor=1.25, pad_to_capacity=parallel["zero"] == 2)
    parallel["tp_comm_overlap"] = bool(parallel.get("sp")) and parallel["zero"] % 2 == 1  # about half the SP plans (no draw)
    # about half the others' PP sends scattered over TP (no draw; a no-op without TP or PP)
    parallel["pp_scatter_gather"] = not parallel.get("sp") and parallel["zero"] % 2 == 1
    edp = cp * dp // parallel.get("ep", 1)  # (the experts' DP group, before fuzz_args.with_etp)
    if parallel["zero"] and cp * dp >= 4 and (cp * dp) % 2 == 0 and tp != 2 and edp % 2 == 0 and edp >= 4:
        parallel["zero_shard"] = cp * dp // 2  # hybrid sharding, two replicas, the experts' too (no draw)
    what_if = []
    if rng.random() < 0.3:
        what_if.append({"gpu": rng.randrange(world), "slowdown": rng.choice([1.1, 1.3])})
    if per == 8 and rng.random() < 0.15:  # a degraded cable of one node: its NIC's or a GPU's NVLink
        node = rng.randrange(nodes)
        link = rng.choice([f"n{node}.gpu{rng.randrange(8)}-n{node}.nvsw", None])
        if link is not None:
            what_if.append({"link": link, "bw_factor": 0.5})
    training = with_recompute_layers({"micro_batch_size": 1, "global_batch_size": m * dp,
                                      "recompute": rng.choice(["none", "selective", "full"])}, rng, model["layers"])
    if parallel.get("ep", 1) > 1 and parallel["zero"] % 2 == 0 and training["recompute"] != "full" \
            and "moe" not in training.get("recompute_modules", ()) \
            and (schedule == "interleaved" or (pp == 1 and schedule == "1f1b")):
        parallel["ep_comm_overlap"] = True  # combined 1F1B for about half those that can (no draw)
    moe = model.get("moe")
    if moe is not None and not parallel.get("ep_comm_overlap") and parallel["zero"] >= 1:
        # a shared expert beside the all-to-alls (no draw: ZeRO plans not combined)
        moe.update(shared_experts=1, shared_expert_overlap=parallel["zero"] != 2 or pp > 1)
    if moe is not None and model["layers"] >= 4 and model["layers"] % 2 == 0 and tp == 1:
        moe["layer_freq"] = 2 if cp == 1 else [0, 1] * (model["layers"] // 2)  # MoE every second layer (no draw)
    if parallel["zero"] and topo in ("dgx-a100.yaml", "dgx-h100.yaml") and training["recompute"] != "selective":
        # the optimizer offloaded where the topology has a host: all of ZeRO-3's, half of ZeRO-1/2's,
        # the copies pipelined on even TP (no draw)
        training.update(optimizer_offload=1.0 if parallel["zero"] == 3 else 0.5, overlap_offload_copies=tp % 2 == 0)
    return {"name": "fuzz-symmetry", "cluster": {"topology": f"topologies/{topo}", "nodes": nodes,
                                                 "what_if": what_if},
            "model": model, "parallel": parallel, "training": training}


def _numbers(x, path: str = ""):
    """(path, number) of every number in a summary part, dicts and lists walked."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _numbers(v, f"{path}[{i}]")
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield path, float(x)
    else:
        yield path, x


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b), 1e-300)


# memory figures that do not depend on timing (what is held at the peak does: the
# communication buffers in flight then, and so the peak, its margin and its instant)
STATIC_MEMORY = ("params", "params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes_per_microbatch",
                 "inflight_microbatches", "transient_bytes", "recompute_bytes_per_microbatch", "capacity_bytes")


def _memory(summary: dict, static: bool) -> list:
    """(path, value) of the memory report: its static parts only, or all but the timelines."""
    return [(p, x) for p, x in _numbers(summary["memory"], "memory")
            if (p.rsplit(".", 1)[-1] in STATIC_MEMORY if static else ".timeline." not in p)]


def _differing(a: list, b: list) -> list[str]:
    """The paths whose values differ (numbers beyond EXACT), or the parts if they do not match."""
    if [p for p, _ in a] != [p for p, _ in b]:
        return ["memory's parts"]
    return [p for (p, x), (_, y) in zip(a, b)
            if not (x == y or (isinstance(x, float) and math.isclose(x, y, rel_tol=EXACT, abs_tol=1e-15)))]


def exposed_gap(collapsed: dict, full: dict) -> float:
    """The largest relative difference of one kind's exposed time (a mean over GPUs)."""
    return max((_rel(x, y) for (_, x), (_, y) in zip(_numbers(collapsed["exposed_comm_s"]),
                                                     _numbers(full["exposed_comm_s"]))), default=0.0)


def compare(collapsed: dict, full: dict) -> tuple[str, float, str]:
    """(verdict, the collapsed step's relative difference, what differs) of the two
    summaries (module docstring)."""
    worst: dict[str, float] = {}
    for key in FIGURES:  # the kinds' times one by one: the worst of each figure
        for (path, x), (_, y) in zip(_numbers(collapsed[key], key), _numbers(full[key], key)):
            worst[key] = max(worst.get(key, 0.0), _rel(x, y))
    broken = _differing(_memory(collapsed, True), _memory(full, True))
    if worst["compute_s"] > EXACT:
        broken.append("compute_s")
    step = collapsed["step_time_s"] / full["step_time_s"] - 1.0
    said = f"step {step:+.3%}" + "".join(f", {k} {v:.2%}" for k, v in worst.items()
                                          if k != "step_time_s" and v > EXACT)
    links = links_differ(collapsed, full)
    if links:
        said += f", links: {links}"
    if broken:
        return "BROKEN", step, said + f"; differ: {', '.join(broken[:4])}"
    mem_same = not _differing(_memory(collapsed, False), _memory(full, False))
    if max(worst.values()) <= EXACT and mem_same:
        return "exact", step, f"links: {links}" if links else ""
    if not mem_same:
        said += ", memory at the peak"
    if abs(step) <= WITHIN:
        return "within 1%", step, said
    return ("above" if step > 0 else "BELOW"), step, said


def links_differ(collapsed: dict, full: dict) -> str:
    """What of ``links.by_kind`` differs, "" where nothing does that cannot depend on the
    network's timing: how many links of each kind carried traffic and their bytes (collapsed,
    every GPU's links: engine.sim.Engine._twins_links, analysis.links.every_gpu; where GPUs
    share a NIC, their PCIe lanes miss the twins' flows PXN forwards)."""
    mine, every = collapsed["links"]["by_kind"], full["links"]["by_kind"]
    out = []
    for k in sorted(set(mine) | set(every)):
        a, b = mine.get(k, {}), every.get(k, {})
        if a.get("links") != b.get("links"):
            out.append(f"{k} {a.get('links', 0)} of {b.get('links', 0)}")
        elif _rel(a.get("bytes", 0.0), b.get("bytes", 0.0)) > EXACT:
            out.append(f"{k} bytes {a['bytes'] / b['bytes'] - 1:+.2e}")
    return ", ".join(out)


def other_figures(collapsed: dict, full: dict) -> str:
    """The first figure of the rest of summary.json (but the run's own description) that
    differs, "" where none does: the critical path, the bubble's parts, the stages, the
    exposed causes, every GPU's links (a cause's bottleneck, what shared it and whether it ran
    alone left out where the two name another link or load it otherwise: by design, where
    twins share links; docs/architecture.md, "Known limitations", Symmetry). The run's own
    description is left out as tests/test_symmetry.py leaves it (``of_the_step``)."""
    a, b = of_the_step(collapsed), of_the_step(full)
    for x, y in zip(a.get("exposed_comm_causes", []), b.get("exposed_comm_causes", [])):
        bx, by = x.get("bottleneck") or {}, y.get("bottleneck") or {}
        if bx.get("link") != by.get("link") or _rel(bx.get("busy_s", 0.0), by.get("busy_s", 0.0)) > EXACT:
            for c in (x, y):  # (twins on the link: in its load collapsed, instances of their own rank by rank,
                # which also share its links with it: not alone)
                for key in ("bottleneck", "shared_with", "alone"):
                    c.pop(key, None)
    got, want = list(_numbers(a)), list(_numbers(b))
    if [p for p, _ in got] != [p for p, _ in want]:
        return next((f"{p} against {q}" for (p, _), (q, _) in zip(got, want) if p != q), "the parts")
    return next((p for (p, x), (_, y) in zip(got, want)
                 if not (x == y or (isinstance(x, float) and isinstance(y, float) and _rel(x, y) <= EXACT))), "")


VERDICTS = ("exact", "within 1%", "above", "BELOW", "BROKEN")  # (compare's, in the order they are counted)


def flagged(summary: dict) -> str:
    """What the collapsed run's summary flags (``simulation.asymmetric_orbits``: the
    communications that moved at their slowest twin's pace), as the plan's line ends it; ""
    where none did."""
    orbits = summary["simulation"].get("asymmetric_orbits")
    return f" [slowest twin: {', '.join(f'{k} {n}' for k, n in orbits.items())}]" if orbits else ""


def flagged_counts(flags: Counter) -> str:
    """The verdicts of the plans the summary flagged, and of the others (``flags``:
    (flagged, verdict) -> plans), for the closing lines."""
    def line(on: bool) -> str:
        return ", ".join(f"{n} {v}" for (f, v), n in sorted(flags.items(), key=lambda x: VERDICTS.index(x[0][1]))
                         if f == on) or "none"
    return f"flagged (simulation.asymmetric_orbits): {line(True)}; not flagged: {line(False)}"


def with_cable(sc: clustersim.Scenario, d: dict, rng: random.Random) -> dict:
    """``d`` with, one time in five, a degraded fabric cable (leaf to spine: the collapse
    keeps its classes, the orbits through it move at their slowest twin's pace) or a node's
    NIC cable (its node's GPUs whose traffic it touches split the classes), picked among ``sc``'s cluster's links. Its
    own generator, so that the plans ``draw`` makes do not change with it."""
    x = rng.random()
    names = sorted(f"{a}-{b}" for a, b in sc.cluster.graph.edges)
    fabric = [n for n in names if "spine" in n and n.startswith("leaf")]
    nic = [n for n in names if ".nic" in n and n.startswith("leaf")]
    pick = rng.choice(fabric) if x < 0.1 and fabric else rng.choice(nic) if 0.1 <= x < 0.2 and nic else None
    if pick is None:
        return d
    return {**d, "cluster": {**d["cluster"], "what_if": [*d["cluster"]["what_if"], {"link": pick, "bw_factor": 0.5}]}}


def label(i: int, d: dict) -> str:
    p, c = d["parallel"], d["cluster"]
    gpus = TOPOLOGIES[c["topology"].split("/")[-1]][0] * c["nodes"]
    bits = [f"{i:3d} {c['topology'].split('/')[-1]:<21} {gpus:>3} GPUs {p['schedule']:<11}",
            f"tp{p['tp']} pp{p['pp']} dp{p['dp']} cp{p['cp']} z{p['zero']}" + (" mla" if "mla" in d["model"] else "")
            + (" mtp" if d["model"].get("mtp_layers") else "")
            + (f" fp8 {d['training']['fp8_recipe']}" if d["training"].get("precision") == "fp8" else "")]
    if p["cp"] > 1:
        bits.append(f"{p['cp_comm']}{' ' + str(p['cp_a2a']) if p.get('cp_a2a') else ''}"
                    f"{'' if p['cp_load_balance'] else ' unbalanced'}")
    if p.get("sp"):
        bits.append("sp overlapped" if p.get("tp_comm_overlap") else "sp")
    elif p.get("pp_scatter_gather") and p.get("tp", 1) > 1 and p.get("pp", 1) > 1:
        bits.append("pp scattered")
    if p.get("zero_shard"):
        bits.append(f"hsdp/{p['zero_shard']}")
    if "ep" in p:
        cap = d["model"]["moe"].get("capacity_factor")
        bits.append(f"ep{p['ep']}{' skewed' if 'ep_load' in d['model']['moe'] else ''}"
                    + ((" padded" if d["model"]["moe"].get("pad_to_capacity") else " capped") if cap else "")
                    + (f" etp{p['etp']}" if "etp" in p else "")
                    + (" deepep" if d["model"]["moe"].get("dispatcher") == "deepep" else "")
                    + (" groups" if "router_groups" in d["model"]["moe"] else "")
                    + (" combined" if p.get("ep_comm_overlap") else "")
                    + (" shared beside" if d["model"]["moe"].get("shared_expert_overlap") else
                       " shared" if d["model"]["moe"].get("shared_experts") else "")
                    + (" every 2nd" if d["model"]["moe"].get("layer_freq", 1) != 1 else ""))
    if d["training"].get("optimizer_offload"):
        bits.append(f"offload {d['training']['optimizer_offload']:g}"
                    + (" pipelined" if d["training"].get("overlap_offload_copies") else ""))
    bits += ["slow" if "gpu" in w else "spine cable" if "spine" in w["link"] else "nic cable" if ".nic" in w["link"]
             else "nvlink cable" for w in c["what_if"]]
    return " ".join(bits)


def main() -> int:
    seed, plans, classes = two_counts(__doc__, ("seed", 0, "seed of the random plans"),
                                      ("plans", 20, "how many plans to draw"), CLASSES)
    rng = random.Random(seed)
    cables = random.Random(seed + 1_000_003)  # (with_cable's own)
    later = random.Random(seed + 2_000_003)  # draws added since (fuzz_args.with_etp), apart from the plans
    dispatch = random.Random(seed + 3_000_003)  # (fuzz_args.with_deepep's, apart from both)
    latent = random.Random(seed + 4_000_003)  # (fuzz_args.with_mla's, apart from all three)
    predict = random.Random(seed + 5_000_003)  # (fuzz_args.with_mtp's)
    fp8 = random.Random(seed + 6_000_003)  # (fuzz_args.with_fp8's)
    wide = random.Random(seed + 7_000_003)  # (fuzz_args.with_wide_cp's)
    counts = dict.fromkeys((*VERDICTS, "refused"), 0)
    steps: list[tuple[float, int]] = []
    gaps: list[tuple[float, int]] = []
    flags: Counter = Counter()  # (flagged, verdict) -> plans
    linked = 0  # plans whose links differ (links_differ)
    others: list[tuple[int, str]] = []  # exact plans with another figure (other_figures)
    for i in range(plans):
        d = with_fp8(with_mtp(with_mla(with_deepep(with_dualpipev(with_ep_over_cp(with_etp(draw(rng), later), later),
                                                                    later), dispatch), latent), predict), fp8, ROOT)
        d = with_wide_cp(d, wide)
        try:
            sc = clustersim.load_scenario(d, base_dir=ROOT)
            cabled = with_cable(sc, d, cables)
            if cabled is not d:
                d, sc = cabled, clustersim.load_scenario(cabled, base_dir=ROOT)
        except clustersim.ConfigError as exc:
            print(f"{label(i, d)}: refused ({exc.message})", flush=True)
            counts["refused"] += 1
            continue
        t = time.perf_counter()
        split = sc if classes == "stage" else clustersim.load_scenario(with_classes(d, classes), base_dir=ROOT)
        collapsed = clustersim.simulate(split)
        tc = time.perf_counter() - t
        full = clustersim.simulate(sc, collapse=False)
        tf = time.perf_counter() - t - tc
        verdict, step, said = compare(collapsed.summary, full.summary)
        counts[verdict] += 1
        flags[(bool(flagged(collapsed.summary)), verdict)] += 1
        steps.append((step, i))
        gaps.append((exposed_gap(collapsed.summary, full.summary), i))
        linked += bool(links_differ(collapsed.summary, full.summary))
        odd = other_figures(collapsed.summary, full.summary) if verdict == "exact" else ""
        if odd:
            others.append((i, odd))
        ranks = (collapsed.summary["simulation"]["simulated_ranks"], full.summary["simulation"]["simulated_ranks"])
        print(f"{label(i, d)}: {verdict} ({ranks[0]} of {ranks[1]} ranks, {tc:.2f} s against {tf:.2f} s)"
              + (f": {said}" if said else "") + flagged(collapsed.summary)
              + (f" [another figure: {odd}]" if odd else ""), flush=True)
    print(", ".join(f"{v} {k}" for k, v in counts.items()))
    print(flagged_counts(flags))
    print(f"every GPU's links: {linked} plan(s) with other link counts or bytes than rank by rank's")
    print(f"every other figure: {len(others)} exact plan(s) with another than rank by rank's"
          + (f" (plan {others[0][0]}: {others[0][1]})" if others else ""))
    if steps:
        lo, hi = min(steps), max(steps)
        print(f"the collapsed step against the all-ranks one: {lo[0]:+.3%} (plan {lo[1]}) to {hi[0]:+.3%} (plan {hi[1]})")
        top = max(gaps)
        print(f"one kind's exposed time: {sum(g > 0.1 for g, _ in gaps)} plan(s) more than 10 % apart, at most "
              f"{top[0]:.1%} of the larger (plan {top[1]})")
    return 1 if counts["BROKEN"] else 0


if __name__ == "__main__":
    sys.exit(main())
