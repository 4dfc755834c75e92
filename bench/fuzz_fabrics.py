"""Random plans on random fabrics: the shipped topologies with another fabric (leaf-spine or a
2- or 3-tier fat tree, rails or none, leaf and spine counts, oversubscription), fewer NICs a
node, a degraded or removed fabric cable and a slow GPU. bench/fuzz_symmetry.py draws its
plans on the shipped fabrics only; this varies the fabric under them. Each plan is simulated
with the invariant checks, collapsed and rank by rank (fuzz_symmetry's verdicts: exact,
within 1 %, above, BELOW, BROKEN), and with and without its cycle copied in (the steps must
agree to 1e-9)::

    python bench/fuzz_fabrics.py [seed] [plans] [--routing destination] [--classes replica]
                                                                   (default 0, 40, hash, stage)

It prints one line per plan (its verdict, the ranks the collapsed run simulated of all of
them, and the communications its summary says moved at their slowest twin's pace), the
count of each verdict and the verdicts of the flagged plans and of the others, how many
exact plans differ in another figure of summary.json (fuzz_symmetry.other_figures), and exits 1
where a plan is BROKEN, fails (an invariant, an exception) or gives another step with its
cycle copied in.
docs/architecture.md ("Known limitations") quotes what it measures.
"""

from __future__ import annotations

import random
import sys
import tempfile
from collections import Counter
from pathlib import Path

import yaml
from fuzz_args import CLASSES, two_counts, with_classes  # a sibling script (bench/ is on the path)
from fuzz_symmetry import (VERDICTS, compare, flagged, flagged_counts,  # (the same verdicts; what the summary flags)
                           other_figures)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import clustersim  # noqa: E402

BASES = ["dgx-h100.yaml", "dgx-a100.yaml", "h800-cluster.yaml", "fat-tree.yaml", "roce-clos-llama3.yaml",
         "gb200-nvl72.yaml"]
SCHEDULES = ["1f1b", "gpipe", "interleaved", "zb-h1", "dualpipe"]
REPEAT_REL = 1e-9  # the step with its cycle copied in against the step simulated whole


def draw_topology(rng: random.Random) -> tuple[str, dict]:
    """(base file, topology document): a shipped topology, its node count drawn (GB200 racks: 1-3),
    its fabric replaced seven times in ten, its NICs a node cut one time in two."""
    base = rng.choice(BASES)
    d = yaml.safe_load((ROOT / "topologies" / base).read_text())
    per = d["node"]["gpus"]
    d["nodes"] = rng.choice([1, 2, 3]) if per > 8 else rng.choice([2, 3, 4, 6, 8, 12, 16, 32])
    if d["nodes"] > 1 and rng.random() < 0.7:
        kind = rng.choice(["leaf_spine", "fat_tree"])
        fab = {"kind": kind, "rail_optimized": rng.random() < 0.5, "latency_us": 0.6, "efficiency": 0.9}
        if kind == "leaf_spine":
            fab.update(nodes_per_leaf=rng.choice([1, 2, 3, 4, 8, 16]), spines=rng.choice([1, 2, 3, 4, 8, 16]),
                       oversubscription=rng.choice([1.0, 1.0, 2.0, 3.0]))
        else:
            fab.update(radix=rng.choice([8, 16, 32, 64]), tiers=rng.choice([2, 3]), oversubscription=rng.choice([1.0, 2.0]))
            if fab["tiers"] == 3:
                fab["pod_oversubscription"] = rng.choice([1.0, 2.0])
        d["fabric"] = fab
    if d["nodes"] > 1 and rng.random() < 0.5:
        d["node"]["nics"] = rng.choice([x for x in (1, 2, 4, 8) if x <= per and per % x == 0])
    return base, d


def draw_plan(rng: random.Random, world: int, per: int) -> tuple[dict, dict, dict]:
    """(model, parallel, training) of a small random plan over ``world`` GPUs, ``per`` a node."""
    tp = rng.choice([x for x in (1, 2, 4, 8) if per % x == 0 and world % x == 0] or [1])
    pp = rng.choice([x for x in (1, 2, 4) if world // tp % x == 0])
    dp, cp = world // (tp * pp), 1
    if dp % 2 == 0 and rng.random() < 0.2:
        cp, dp = 2, dp // 2
    schedule = rng.choice(SCHEDULES) if pp > 1 else "1f1b"
    if schedule == "dualpipe" and pp % 2:
        schedule = "1f1b"
    if schedule == "zb-h1" and tp in (2, 8):  # ZB-V for about half of them (no draw: seeds keep their plans)
        schedule = "zbv"
    vpp = 2 if schedule in ("interleaved", "zbv") else 1  # (zbv: 2 pp parts, a layer each at least)
    m = {"dualpipe": 2 * pp, "interleaved": pp}.get(schedule, rng.choice([pp, 2 * pp, 4 * pp]))
    model = {"name": "fuzz", "layers": pp * vpp * rng.choice([1, 2]), "hidden": 1024, "heads": 16, "vocab": 32000,
             "seq_len": 2048}
    parallel = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "schedule": schedule, "zero": rng.choice([0, 1, 2, 3]),
                "sp": tp > 1 and rng.random() < 0.5}
    if schedule == "interleaved":
        parallel["vpp"] = vpp
    eps = [x for x in (2, 4, 8) if dp % x == 0]
    if eps and rng.random() < 0.3:
        parallel["ep"] = rng.choice(eps)
        parallel["sp"] = parallel["sp"] or tp > 1  # EP with TP needs SP (no draw: seeds keep their plans)
        model["moe"] = {"experts": 8, "top_k": 2, "expert_ffn": 1024}
    parallel["tp_comm_overlap"] = bool(parallel.get("sp")) and parallel["zero"] % 2 == 1  # about half the SP plans (no draw)
    # about half the others' PP sends scattered over TP (no draw; a no-op without TP or PP)
    parallel["pp_scatter_gather"] = not parallel.get("sp") and parallel["zero"] % 2 == 1
    training = {"micro_batch_size": 1, "global_batch_size": m * dp,
                "recompute": rng.choice(["none", "selective", "full"])}
    return model, parallel, training


def fabric_fault(rng: random.Random, sc: clustersim.Scenario) -> dict | None:
    """Three times in ten, a fabric cable (a switch to a switch above it) at half bandwidth
    or taken out, picked among ``sc``'s cluster's."""
    if rng.random() >= 0.3:
        return None
    names = sorted(f"{a}-{b}" for a, b in sc.cluster.graph.edges
                   if a < b and any(t in a or t in b for t in ("spine", "core")))
    if not names:
        return None
    pick = rng.choice(names)
    return {"remove_link": pick} if rng.random() < 0.5 else {"link": pick, "bw_factor": 0.5}


def label(i: int, base: str, topo: dict, p: dict, what_if: list) -> str:
    fab = topo.get("fabric", {})
    bits = [f"{i:3d} {base:<21} {topo['nodes']:>2} nodes", fab.get("kind", "?"),
            "rails" if fab.get("rail_optimized", True) else "no rails", f"{topo['node'].get('nics', '?')} nics",
            f"{p['schedule']} tp{p['tp']} pp{p['pp']} dp{p['dp']} cp{p['cp']} z{p['zero']}"]
    if "ep" in p:
        bits.append(f"ep{p['ep']}")
    bits += ["slow gpu" if "gpu" in w else "cable out" if "remove_link" in w else "cable half" for w in what_if]
    return " ".join(bits)


def main() -> int:
    seed, plans, routing, classes = two_counts(__doc__, ("seed", 0, "seed of the random plans"),
                                      ("plans", 40, "how many plans to draw"),
                                      ("--routing", ("hash", "destination"), "how every fabric's switches pick uplinks "
                                       "(fabric.routing); the same plans either way"), CLASSES)
    rng = random.Random(seed)
    folder = Path(tempfile.mkdtemp(prefix="fuzz-fabrics-"))
    counts = dict.fromkeys((*VERDICTS, "failed", "refused"), 0)
    steps: list[tuple[float, int]] = []
    flags: Counter = Counter()  # (flagged, verdict) -> plans
    others: list[tuple[int, str]] = []  # exact plans with another figure (fuzz_symmetry.other_figures)
    bad = 0
    for i in range(plans):
        base, topo = draw_topology(rng)
        if routing != "hash":  # (no draw: a seed's plans are the same either way)
            topo.setdefault("fabric", {})["routing"] = routing
        world = topo["nodes"] * topo["node"]["gpus"]
        model, parallel, training = draw_plan(rng, world, topo["node"]["gpus"])
        what_if = [{"gpu": rng.randrange(world), "slowdown": 1.3}] if rng.random() < 0.25 else []
        path = folder / f"topology_{i}.yaml"
        path.write_text(yaml.safe_dump(topo))
        d = {"name": "fuzz-fabrics", "cluster": {"topology": str(path), "what_if": what_if}, "model": model,
             "parallel": parallel, "training": training}
        try:
            sc = clustersim.load_scenario(d)
            fault = fabric_fault(rng, sc)
            if fault is not None:
                what_if = [*what_if, fault]
                d["cluster"]["what_if"] = what_if
                sc = clustersim.load_scenario(d)
            split = sc if classes == "stage" else clustersim.load_scenario(with_classes(d, classes))
        except clustersim.ConfigError as exc:
            print(f"{label(i, base, topo, parallel, what_if)}: refused ({exc.message})", flush=True)
            counts["refused"] += 1
            continue
        try:
            collapsed = clustersim.simulate(split)
            full = clustersim.simulate(sc, collapse=False)
            whole = clustersim.simulate(split, repeat=False)
        except Exception as exc:  # an invariant the step broke, or a crash: what this looks for
            print(f"{label(i, base, topo, parallel, what_if)}: FAILED ({type(exc).__name__}: {str(exc)[:300]})",
                  flush=True)
            counts["failed"] += 1
            bad += 1
            continue
        verdict, step, said = compare(collapsed.summary, full.summary)
        other = other_figures(collapsed.summary, full.summary) if verdict == "exact" else ""
        if other:
            others.append((i, other))
        counts[verdict] += 1
        flags[(bool(flagged(collapsed.summary)), verdict)] += 1
        steps.append((step, i))
        repeat_rel = whole.summary["step_time_s"] / collapsed.summary["step_time_s"] - 1.0
        odd = abs(repeat_rel) > REPEAT_REL
        bad += verdict == "BROKEN" or odd
        ranks = (collapsed.summary["simulation"]["simulated_ranks"], full.summary["simulation"]["simulated_ranks"])
        print(f"{label(i, base, topo, parallel, what_if)}: {verdict} ({ranks[0]} of {ranks[1]} ranks)"
              + (f": {said}" if said else "") + flagged(collapsed.summary)
              + (f"; with its cycle copied in {repeat_rel:+.2e} (DIFFERS)" if odd else "")
              + (f" [another figure: {other}]" if other else ""), flush=True)
    print(", ".join(f"{v} {k}" for k, v in counts.items()))
    print(flagged_counts(flags))
    print(f"every other figure: {len(others)} exact plan(s) with another than rank by rank's"
          + (f" (plan {others[0][0]}: {others[0][1]})" if others else ""))
    if steps:
        lo, hi = min(steps), max(steps)
        print(f"the collapsed step against the all-ranks one: {lo[0]:+.3%} (plan {lo[1]}) to {hi[0]:+.3%} (plan {hi[1]})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
