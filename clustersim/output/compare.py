"""Plans side by side: what ``clustersim compare`` prints and writes into compare.json.

    clustersim · compare 2 plans
    A   scenarios/llama2_70b_64gpu.yaml
        TP8 x PP4 x DP2 · fp32 grads · 1f1b · 64 microbatches x 1 x 4096 tokens
    B   scenarios/llama2_70b_64gpu.yaml with parallel.pp=1 parallel.dp=8 parallel.zero=3
        ...
    B vs A          parallel.pp 4 -> 1 · parallel.dp 2 -> 8 · parallel.zero 0 -> 3
                                       A                  B
    step time                    7.097 s     7.442 s  +4.9 %
    ...
    where a GPU's step goes (s, mean over GPUs)
      compute                      5.683       5.601  -0.082
      exposed comm                 1.100       ...
      bubble                       0.314       ...

The step splits on every GPU into compute, exposed communication and bubble, which add up to
the step (docs/metrics.md, "How a GPU's step splits"); so do their means over GPUs, and the
rows' differences add up to the difference of the steps: where one plan's time goes that the
other's does not.
"""

from __future__ import annotations

from typing import Any

import yaml

from ..errors import printable
from ..trace import COMM_KINDS as KINDS
from .summary import GiB, host_only_unfit, link_ceilings_said, nvlink_kept_note, plan_line

COMPARE_FILE = "compare.json"
# config fields that name or describe a plan rather than change it
_NOT_COMPARED = ("name", "description")


def report_name(label: str) -> str:
    """A plan's report.html, as ``compare --out`` names it: report_A.html."""
    return f"report_{label}.html"


REPORT_NAMES = r"report_([A-Z]|P[0-9]+)\.html"  # every name report_name gives (labels)


def labels(n: int) -> list[str]:
    """A, B, ... Z, then P27, P28, ...: short column heads."""
    return [chr(ord("A") + i) if i < 26 else f"P{i + 1}" for i in range(n)]


def flat(data: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{"parallel.zero": 3, ...}``; lists stay whole (a value)."""
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for k, v in data.items():
        out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def effective_config(sc) -> dict[str, Any]:
    """A scenario's config as compared: its cluster section with what the topology file holds
    (node count, GPU, node and fabric, the section's changes merged in), so that a change
    reads ``cluster.node.nic.bw_Gbps 400.0 -> 800.0``, and two topology files differ field by field."""
    from ..hardware.gpus import lookup_gpu

    cfg = sc.cfg.model_dump(mode="json")
    topo = sc.topology.model_dump(mode="json")
    cfg["cluster"] = {**cfg["cluster"], **{k: topo[k] for k in ("nodes", "node", "fabric")},
                      "gpu": lookup_gpu(topo["gpu"]).name}  # (an alias, H100, is the GPU it names)
    return cfg


def config_differences(base: dict[str, Any], other: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """The fields where two validated scenario configs differ, each ``(key, base's, other's)``,
    in the order of ``base``'s fields, then ``other``'s own; a plan's name and description are
    left out."""
    a, b = flat(base), flat(other)
    keys = list(a) + [k for k in b if k not in a]
    return [(k, a.get(k), b.get(k)) for k in keys
            if k.split(".")[0] not in _NOT_COMPARED and a.get(k) != b.get(k)]


def step_split(s: dict[str, Any]) -> dict[str, float]:
    """A GPU's step split into compute, exposed communication (and per kind, which may overlap)
    and bubble, means over GPUs, with the step itself: ``compute + exposed + bubble = step``."""
    ex = s["exposed_comm_s"]
    return {"compute_s": s["compute_s"], "exposed_comm_s": ex["total"],
            **{f"exposed_{k}_s": ex[k] for k in KINDS}, "bubble_s": s["bubble"]["bubble_s"],
            "step_time_s": s["step_time_s"]}


def shows_hfu(summaries: list[dict[str, Any]]) -> bool:
    """Whether the comparison gives HFU beside MFU (the terminal's table and compare.html's):
    where a plan recomputes, what that costs in compute time shows as HFU above MFU (the FLOPs
    executed again), and its compute row grows by it, which no other row says."""
    return any(s["plan"]["recompute"] not in (None, "none") for s in summaries)


def fastest(summaries: list[dict[str, Any]], key: str = "tokens_per_s") -> int | None:
    """The index of the plan with the most ``key`` among those that fit (None if none fits);
    the first on a tie."""
    fit = [i for i, s in enumerate(summaries) if s["memory"]["fits"]]
    return max(fit, key=lambda i: (summaries[i][key], -i)) if fit else None


def config_value_text(v: Any) -> str:
    """A config value as the YAML would write it (a list or mapping in flow style, the fields
    it leaves unset left out), cut to 60 characters."""
    if v is None:
        text = "null"
    elif isinstance(v, bool):
        text = "true" if v else "false"
    elif isinstance(v, (list, dict)):
        text = printable(yaml.safe_dump(_set_only(v), default_flow_style=True, width=10**6).strip())
    else:
        text = printable(repr(v) if isinstance(v, str) and not v.strip() else v)
    return text if len(text) <= 60 else text[:57] + "..."


def _set_only(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _set_only(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_set_only(x) for x in v]
    return v


def differences_line(diffs: list[tuple[str, Any, Any]], most: int = 8) -> str:
    if not diffs:
        return "the same scenario"
    parts = [f"{k} {config_value_text(a)} -> {config_value_text(b)}" for k, a, b in diffs[:most]]
    more = f" · and {len(diffs) - most} more (compare.json)" if len(diffs) > most else ""
    return " · ".join(parts) + more


def _rel(base: float, x: float) -> str:
    if base == 0:
        return "" if x == 0 else "new"
    return f"{100 * (x - base) / base:+.1f} %"


def _rows(summaries: list[dict[str, Any]]) -> list[tuple[str, list[str], list[str]]]:
    """The table's rows: a label, each plan's value, each plan's difference from the first
    ("" for the first)."""
    base = summaries[0]
    rows: list[tuple[str, list[str], list[str]]] = []

    def row(label: str, fmt, get, diff) -> None:
        vals = [get(s) for s in summaries]
        rows.append((label, [fmt(v) for v in vals], [""] + [diff(vals[0], v) for v in vals[1:]]))

    def head(label: str) -> None:
        rows.append((label, [""] * len(summaries), [""] * len(summaries)))

    secs = lambda v: f"{v:.3f} s"  # noqa: E731
    same_world = all(s["world_size"] == base["world_size"] for s in summaries)
    if not same_world:
        row("GPUs", lambda v: f"{v:,}", lambda s: s["world_size"], _rel)
    if any(s["tokens_per_step"] != base["tokens_per_step"] for s in summaries):
        row("tokens a step", lambda v: f"{v:,}", lambda s: s["tokens_per_step"], _rel)
    row("step time", secs, lambda s: s["step_time_s"], _rel)
    row("tokens/s", lambda v: f"{v:,.0f}", lambda s: s["tokens_per_s"], _rel)
    row("tokens/s per GPU", lambda v: f"{v:,.1f}", lambda s: s["tokens_per_s_per_gpu"], _rel)
    row("MFU", lambda v: f"{100 * v:.1f} %", lambda s: s["mfu"], lambda a, b: f"{100 * (b - a):+.1f} pts")
    if shows_hfu(summaries):
        row("HFU", lambda v: f"{100 * v:.1f} %", lambda s: s["hfu"],
            lambda a, b: f"{100 * (b - a):+.1f} pts")
    head("where a GPU's step goes (s, mean over GPUs)")
    splits = [step_split(s) for s in summaries]
    kinds = [k for k in KINDS if any(sp[f"exposed_{k}_s"] > 0 for sp in splits)]
    num = lambda v: f"{v:.3f}"  # noqa: E731
    dif = lambda a, b: f"{b - a:+.3f}"  # noqa: E731
    by = {id(s): sp for s, sp in zip(summaries, splits)}
    row("  compute", num, lambda s: by[id(s)]["compute_s"], dif)
    row("  exposed comm", num, lambda s: by[id(s)]["exposed_comm_s"], dif)
    for k in kinds:
        row(f"    of which {k}", num, lambda s, k=k: by[id(s)][f"exposed_{k}_s"], dif)
    row("  bubble", num, lambda s: by[id(s)]["bubble_s"], dif)
    row("peak memory (GiB)", lambda v: f"{v / GiB:.1f}", lambda s: s["memory"]["peak_bytes"],
        lambda a, b: f"{(b - a) / GiB:+.1f}")
    row("  fits", lambda v: v, _fits_text, lambda a, b: "")
    if any(s["memory"].get("host") for s in summaries):  # optimizer offload: what a node's host holds
        row("host memory (GiB a node)", lambda v: "" if v is None else f"{v / GiB:,.1f}",
            lambda s: (s["memory"].get("host") or {}).get("peak_bytes"),
            lambda a, b: "" if a is None or b is None else f"{(b - a) / GiB:+,.1f}")
    return rows


def _fits_text(s: dict[str, Any]) -> str:
    """"yes in 80", "NO in 80" (a GPU's memory; "NO in 80, host too" where the hosts' is short
    as well), "NO: host 1,907" (a node's host memory under offload, every GPU fitting)."""
    mem = s["memory"]
    if host_only_unfit(mem):
        return f"NO: host {mem['host']['capacity_bytes'] / GiB:,.0f}"
    host_too = ", host too" if not mem["fits"] and mem.get("host") and not mem["host"]["fits"] else ""
    return (("yes" if mem["fits"] else "NO") + (f" in {mem['capacity_bytes'] / GiB:.0f}" if mem["capacity_bytes"] else "")
            + host_too)


def other_jobs(names: list[str], summaries: list[dict[str, Any]]) -> list[str]:
    """A note where the plans do not train the same job (another model, batch or GPU count):
    their tokens/s then compare throughput, not the time to the same result."""
    base = summaries[0]
    what = [w for w, key in (("models", lambda s: (s["model"]["name"], s["model"]["params"])),
                             ("tokens a step", lambda s: s["tokens_per_step"]),
                             ("GPU counts", lambda s: s["world_size"]))
            if any(key(s) != key(base) for s in summaries)]
    if not what:
        return []
    return [f"{'note':<24}the plans differ in {' and '.join(what)}: tokens/s compares their throughput, not the time "
            "of one job"]


def close_lead_line(names: list[str], summaries: list[dict[str, Any]], pair: tuple[int, int], gain: float) -> str:
    """The line under "fastest" where the fastest plan's lead ``gain`` over the next (``pair``:
    their indices) is under CLOSE_LEAD and either's step is an estimate; "" otherwise. Named in
    the plans' order; ``--all-ranks`` offered where every one of them may run it."""
    from .summary import CLOSE_LEAD, estimates_clause

    flagged = sorted(i for i in pair if summaries[i]["simulation"].get("asymmetric_orbits"))
    if gain >= CLOSE_LEAD or not flagged:
        return ""
    return (f"{'':<24}the lead may not hold: "
            + estimates_clause([names[i] for i in flagged], [summaries[i]["world_size"] for i in flagged]))


def verdict_lines(names: list[str], summaries: list[dict[str, Any]]) -> list[str]:
    """compare's verdict: the fastest plan that fits and its lead over the next (and where that
    lead may not hold, :func:`close_lead_line`), the plans that do not fit, and the plan with
    the most tokens/s per GPU where another."""
    best = fastest(summaries)
    if best is None:
        return [f"{'fastest':<24}none fits in memory: each step is what it would take if it did"]
    lines = []
    others = [i for i in range(len(summaries)) if i != best and summaries[i]["memory"]["fits"]]
    text = f"{names[best]} (most tokens/s of those that fit"
    close = ""
    if others:
        nxt = max(others, key=lambda i: summaries[i]["tokens_per_s"])
        gain = summaries[best]["tokens_per_s"] / summaries[nxt]["tokens_per_s"] - 1
        text += f"; {100 * gain:.1f} % more than {names[nxt]}" if gain >= 5e-4 else f"; level with {names[nxt]}"
        close = close_lead_line(names, summaries, (best, nxt), gain)
    lines.append(f"{'fastest':<24}{text})")
    if close:
        lines.append(close)
    unfit = [names[i] for i, s in enumerate(summaries) if not s["memory"]["fits"]]
    if unfit:
        lines.append(f"{'':<24}{', '.join(unfit)} {'does' if len(unfit) == 1 else 'do'} not fit: "
                     "the step shown is what it would take if it did")
    per_gpu = fastest(summaries, "tokens_per_s_per_gpu")
    if per_gpu is not None and per_gpu != best:
        lines.append(f"{'most tokens/s per GPU':<24}{names[per_gpu]}")
    return lines


def format_compare(plans: list[dict[str, Any]]) -> str:
    """The terminal's comparison of ``plans`` (each: ``label``, ``source`` (what it was made
    of, as the command line gave it), ``summary``, ``differences`` from the first plan)."""
    names = [p["label"] for p in plans]
    summaries = [p["summary"] for p in plans]
    lines = [f"clustersim · compare {len(plans)} plans"]
    for p in plans:
        lines.append(f"{p['label']:<4}{printable(p['source'])}")
        lines.append(f"{'':<4}{plan_line(p['summary'])}")
    first = summaries[0]["hardware"]
    first_ceilings = link_ceilings_said(first, summaries[0].get("links"))
    for p in plans[1:]:
        hw = p["summary"]["hardware"]  # (the NVLink kept, where this plan's GPUs are not the first's)
        lines.append(f"{p['label'] + ' vs ' + names[0]:<24}{differences_line(p['differences'])}"
                     + (nvlink_kept_note(hw) if hw["gpu"] != first["gpu"] else "")
                     # (a link that caps this plan's NICs and not the first's: what its change bought)
                     + "".join(f" ({c})" for c in link_ceilings_said(hw, p["summary"].get("links"))
                               if c not in first_ceilings))
    rows = _rows(summaries)
    w_val = [max([len(names[j])] + [len(r[1][j]) for r in rows]) for j in range(len(plans))]
    w_dif = [max([0] + [len(r[2][j]) for r in rows]) for j in range(len(plans))]
    cell = lambda j, v, d: f"{v:>{w_val[j]}}" + (f"  {d:<{w_dif[j]}}" if w_dif[j] else "")  # noqa: E731
    lines.append(f"{'':<24}" + "  ".join(cell(j, names[j], "") for j in range(len(plans))).rstrip())
    for label, vals, difs in rows:
        if not any(vals):
            lines.append(label)
            continue
        lines.append(f"{label:<24}" + "  ".join(cell(j, vals[j], difs[j]) for j in range(len(plans))).rstrip())
    lines += overlap_note(summaries) + other_jobs(names, summaries) + verdict_lines(names, summaries)
    return "\n".join(lines)


def overlap_note(summaries: list[dict[str, Any]]) -> list[str]:
    """A note where a plan's "of which" rows add up to more than its exposed communication:
    a wait on two kinds at once counts in both (docs/metrics.md), as ``run``'s line says."""
    over = [s for s in summaries
            if sum(step_split(s)[f"exposed_{k}_s"] for k in KINDS) > step_split(s)["exposed_comm_s"] * (1 + 1e-9) + 1e-12]
    if not over:
        return []
    return [f"{'':<24}(a GPU's wait on two kinds at once counts in both kinds' rows)"]


def compare_json(plans: list[dict[str, Any]]) -> dict[str, Any]:
    """compare.json: the baseline's label, the fastest plan that fits, and per plan its label,
    source, differences from the baseline (``{key: [baseline's, its]}``), step split and whole
    summary."""
    summaries = [p["summary"] for p in plans]
    best = fastest(summaries)
    return {
        "baseline": plans[0]["label"],
        "fastest_fitting": None if best is None else plans[best]["label"],
        "plans": [{"label": p["label"], "source": p["source"], "file": p["file"], "changes": p["changes"],
                   "differences": {k: [a, b] for k, a, b in p["differences"]},
                   "step_split": step_split(p["summary"]), "summary": p["summary"]} for p in plans],
    }
