"""The terminal summary table and summary.json.

    clustersim · gpt3-175b-1024gpu
    plan            TP8 x PP16 x DP8 · fp32 grads · 1f1b · 192 microbatches x 1 x 2048 tokens
    step time       18.89 s
    ...
    memory (GiB)    stage  params  grads  optim  activ  other    peak / cap
                        0     2.7    5.4   16.1   29.2    0.0    53.4 / 80  fits

"other" is what the peak holds besides the four before it (communication buffers, a layer
recomputed, ZeRO-3's gathered units, CP's K/V), so that a row adds up to its peak.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..errors import printable  # (a scenario's name or description printed as written, on its line)
from ..floats import sum_left, three_digits
from ..trace import COMM_KINDS

GiB = 1024**3


def to_json(summary: dict[str, Any]) -> str:
    """Deterministic JSON text (key order as built, fixed indent, trailing newline), with
    ``simulation.simulated_rank_of_gpu`` on one line: one number a line, a 16,384-GPU run's
    would be most of the file."""
    text = json.dumps(summary, indent=2, allow_nan=False) + "\n"
    return _PER_GPU.sub(lambda m: m.group(1) + "[" + ", ".join(re.findall(r"\d+", m.group(2))) + "]", text, 1)


# the per-GPU list as json.dumps(indent=2) writes it: "key": [ one number a line ]
_PER_GPU = re.compile(r'("simulated_rank_of_gpu": )\[\s*([\d,\s]*?)\s*\]')


def _stage_rows(stages: list[dict]) -> list[dict]:
    """All stages when few; else the first, the last and the four with the highest peak."""
    if len(stages) <= 8:
        return stages
    keep = {0, len(stages) - 1} | {s["stage"] for s in sorted(stages, key=lambda s: -s["peak_bytes"])[:4]}
    return [s for s in stages if s["stage"] in keep]


def plan_dims(p: dict[str, Any], sep: str) -> str:
    """"TP4 x CP8 (ring) x PP1 x DP2 (EP2)": the parallel degrees, CP and EP only when used, the
    experts' TP where it is not TP's ("(EP8, ETP1)"), the nodes a TP or EP group spans where
    it leaves its node ("TP16 over 2 nodes", "(EP16 over 2 nodes)"), and a deduplicating
    dispatch and an FP8 one ("(EP16 over 2 nodes, DeepEP, FP8 dispatch)"), and the shared
    experts beside the all-to-alls ("(EP16 over 2 nodes, shared experts beside)")."""
    cp = ""
    if p.get("cp", 1) > 1:
        how = p.get("cp_comm", "ring") + ("" if p.get("cp_load_balance", True) else ", unbalanced")
        if p.get("cp_a2a"):  # hierarchical: "all_to_all+ring, 8 x 2"
            how += f", {p['cp_a2a']} x {p['cp'] // p['cp_a2a']}"
        cp = f"{sep}CP{p['cp']} ({how})"
    # EP's all-to-alls block every MoE layer: across nodes they run at the NICs' pace
    ep_over = f" over {p['ep_nodes']} nodes" if p.get("ep_nodes", 1) > 1 else ""
    experts = [f"EP{p['ep']}{ep_over}"] if p.get("ep", 1) > 1 else []
    if (p.get("etp") or p["tp"]) != p["tp"]:  # (a config's etp, which validate shows, is None where it is tp)
        experts.append(f"ETP{p['etp']}")
    if experts and p.get("dispatcher") == "deepep":  # tokens cross once per node: another cost of EP
        experts.append("DeepEP")
    if experts and p.get("fp8_dispatch"):  # the tokens to the experts in about half the bytes
        experts.append("FP8 dispatch")
    if experts and p.get("shared_expert_overlap"):  # what hides some of the all-to-alls
        experts.append("shared experts beside")
    ep = f" ({', '.join(experts)})" if experts else ""
    # TP's all-reduces block every layer: over NICs they cost far more (parallelism guide)
    over = f" over {p['tp_nodes']} nodes" if p.get("tp_nodes", 1) > 1 else ""
    return f"TP{p['tp']}{over}{cp}{sep}PP{p['pp']}{sep}DP{p['dp']}{ep}"


def plan_options(p: dict[str, Any]) -> str:
    """" · SP (TP comm overlap) · ZeRO-1 · recompute full": what of SP (and whether its
    collectives are pipelined with the GEMMs), ZeRO (and how it gathers the parameters, where
    not by default; what share of its optimizer states it offloads) and recompute the plan uses."""
    zero = f" · ZeRO-{p['zero']}" if p.get("zero") else ""
    replicas = p.get("dp", 1) * p.get("cp", 1) // p["zero_shard"] if p.get("zero_shard") else 1
    if zero and replicas > 1:  # hybrid sharding (a shard group of all of them is plain ZeRO)
        tp, etp, ep = p.get("tp", 1), p.get("etp") or p.get("tp", 1), p.get("ep") or 1
        experts = tp // etp * p.get("dp", 1) * p.get("cp", 1) // ep // replicas  # (their own slices: mesh.grad_group)
        zero += (f" (hybrid: shards over {p['zero_shard']}" + (f", experts over {experts}" if ep > 1 or etp < tp
                                                               else "") + f", {replicas} replicas)")
    if zero and p.get("zero3_keep_gathered") and p["zero"] == 3:
        zero += " (kept gathered)"
    if zero and p.get("overlap_param_gather"):
        zero += " (gathers overlapped)"
    if zero and p.get("optimizer_offload"):  # (offload needs ZeRO)
        zero += (f" · optimizer {100 * p['optimizer_offload']:g} % in host memory"
                 + (" (copies pipelined)" if p.get("overlap_offload_copies") else ""))
    sp = (" · SP" + (" (TP comm overlap)" if p.get("tp_comm_overlap") else "")) if p.get("sp") else ""
    if p.get("pp_scatter_gather"):  # (only where it scatters: api's plan)
        sp += " · PP sends scattered over TP"
    recompute = f" · recompute {p['recompute']}" if p.get("recompute", "none") != "none" else ""
    if n := p.get("activation_offload_layers"):
        recompute += f" · activations of {n} layer{'s' if n != 1 else ''} in host memory"
    modules = p.get("recompute_modules") or ["core_attn"]
    if p.get("recompute") == "selective" and modules != ["core_attn"]:
        noop = "core_attn" in modules and p.get("attention") == "flash"
        recompute += f" ({', '.join(modules)}{'; core_attn a no-op under flash attention' if noop else ''})"
    elif p.get("recompute") == "selective" and p.get("attention") == "flash":
        recompute += " (a no-op: flash attention keeps no scores)"  # the user may think it saves memory
    n = p.get("recompute_layers")
    if n is not None and p.get("recompute") == "full" and (n, p.get("recompute_method")) != (1, "uniform"):
        layers = f"{n} layer{'s' if n != 1 else ''}"
        # the most layers a model chunk (a part) has; unknown: the count is taken as less
        most = max(p["layers_per_stage"]) if p.get("layers_per_stage") else n + 1
        # a stage of one part (1F1B, GPipe) is one chunk: say stage, as the user thinks of it
        per_stage = p.get("parts_per_stage")
        chunk = "stage" if per_stage and all(len(q) == 1 for q in per_stage) else "model chunk"
        if p.get("recompute_method") == "block":
            first = f"first {layers}" if n > 1 else "first layer"
            recompute += f" ({first} of each {chunk})" if n < most else (
                f" (every layer: no {chunk} has more than {most})")
        else:
            recompute += f" (groups of {layers})" if n < most else f" (each {chunk} one group of at most {most})"
    return sp + zero + recompute + _fp8_option(p) + _grads_option(p)


def _fp8_option(p: dict[str, Any]) -> str:
    """" · fp8 (blockwise)": FP8 training and its recipe, which sets what a layer keeps."""
    return f" · fp8 ({p['fp8_recipe']})" if p.get("precision") == "fp8" and p.get("fp8_recipe") else ""


def topology_changes_note(hw: dict[str, Any]) -> str:
    """" · changed: node.nic.bw_Gbps=800": the topology's fields the scenario changes
    (``hardware.changes``), and the NVLink rate a swapped GPU kept (:func:`nvlink_kept_note`);
    "" where none."""
    changes = hw.get("changes")
    if not changes:
        return ""
    said = lambda v: "null" if v is None else str(v).lower() if isinstance(v, bool) else v  # noqa: E731  (as YAML)
    return " · changed: " + " ".join(f"{k}={said(v)}" for k, v in changes.items()) + nvlink_kept_note(hw)


def nvlink_kept_note(hw: dict[str, Any]) -> str:
    """" (NVLink kept at the topology's 450 GB/s, not B200's 900: cluster.node.nvlink.bw_GBps=900
    gives it)": where the scenario swapped the GPUs and the node kept its NVLink rate
    (``hardware.nvlink_kept``), "" elsewhere."""
    kept = hw.get("nvlink_kept")
    if not kept:
        return ""
    return (f" (NVLink kept at the topology's {kept['bw_GBps']:g} GB/s, not {hw['gpu']}'s {kept['gpu_bw_GBps']:g}: "
            f"cluster.node.nvlink.bw_GBps={kept['gpu_bw_GBps']:g} gives it)")


def link_ceilings_said(hw: dict[str, Any], links: dict[str, Any] | None = None) -> list[str]:
    """One sentence per link that caps transfers between nodes below the NIC's rate
    (``hardware.link_ceilings``, :func:`link_ceiling_said` each); [] where none does."""
    return [link_ceiling_said(c, links) for c in hw.get("link_ceilings") or ()]


def link_ceiling_said(c: dict[str, Any], links: dict[str, Any] | None = None) -> str:
    """An entry of ``hardware.link_ceilings`` (topology.link_ceilings) in words: "PCIe at 64
    GB/s caps the NICs' 90 GB/s between nodes; node.pcie_GBps raises it". Where the summary's
    link use ``links`` says no byte of the step crossed the fabric's switches, the leaf-spine
    cables' sentence says so (a plan whose traffic stays on its rails, under one leaf group,
    is not slowed by them: the step does not change)."""
    if c["link"] == "pcie":
        return (f"PCIe at {c['bw_GBps']:.3g} GB/s caps the NICs' {c['nic_GBps']:.3g} GB/s between nodes; "
                "node.pcie_GBps raises it")
    ports, spines, most = c["nic_ports_per_leaf"], c["spines"], c["spines_at_line_rate"]
    fix = (f"fabric.spines={most} keeps them at line rate" if most >= 1 else
           f"no spine count keeps them at line rate: the oversubscription is above the leaf's {ports} "
           f"port{'s' if ports != 1 else ''}")
    unused = links is not None and not (links.get("by_kind") or {}).get("fabric", {}).get("bytes")
    return (f"leaf-spine cables at {c['bw_GBps']:.3g} GB/s, below a NIC's {c['nic_GBps']:.3g}: a leaf's "
            f"{ports} NIC port{'s' if ports != 1 else ''} spread over {spines} spine"
            f"{'s' if spines != 1 else ''}, each flow on one cable; {fix}"
            + ("; this step sends nothing over them" if unused else ""))


def network_said(hw: dict[str, Any]) -> str:
    """The links the cluster was built with (``hardware.network``), in the units the topology
    file gives them, each rate with its efficiency: "NVLink 450 GB/s x 0.81 (NVLS 0.608) · 8
    NICs of 400 Gb/s x 0.9, PCIe 64 GB/s · rail-optimised leaf-spine, 32 leaves, 16 spines,
    1:1, x 0.9"; where NVLink is above the GPU's own rate, says so. "" where the summary has
    none (an older summary.json)."""
    net = hw.get("network")
    if not net:
        return ""
    parts = []
    if net.get("nvlink_GBps"):
        nvlink = f"NVLink {net['nvlink_GBps']:g} GB/s x {net['nvlink_efficiency']:g}"
        if net.get("nvls_efficiency"):
            nvlink += f" (NVLS {net['nvls_efficiency']:.3g})"
        if net.get("nvlink_above_gpu_GBps"):
            nvlink += (f", above {hw['gpu']}'s own {net['nvlink_above_gpu_GBps']:g} GB/s a direction "
                       "(node.nvlink.bw_GBps is in GB/s, not Gb/s)")
        parts.append(nvlink)
    if net.get("nics_per_node"):
        k = net["nics_per_node"]
        parts.append(f"{k} NIC{'s' if k != 1 else ''} of {net['nic_Gbps']:g} Gb/s x {net['nic_efficiency']:g}, "
                     f"PCIe {net['pcie_GBps']:g} GB/s")
    fab = net.get("fabric")
    if fab:
        shape = f"{fab['tiers']}-tier fat tree" if fab["kind"] == "fat_tree" else "leaf-spine"
        leaves, spines, cores = fab["leaves"], fab["spines"], fab.get("cores") or 0
        said = [("rail-optimised " if fab["rail_optimized"] else "") + shape,
                f"{leaves:,} lea{'ves' if leaves != 1 else 'f'}",
                *([f"{spines:,} spine{'s' if spines != 1 else ''}"] if spines else []),
                *([f"{cores:,} core{'s' if cores != 1 else ''}"] if cores else []),
                # (a ratio above a single leaf, which has no uplinks, would read as if it held)
                f"its {fab['oversubscription']:g}:1 unused (every node under one leaf)"
                if fab.get("oversubscription_unused") else f"{fab['oversubscription']:g}:1"]
        if fab.get("pod_oversubscription"):
            said[-1] += f" ({fab['pod_oversubscription']:g}:1 above the pods)"
        if fab["efficiency"] != 1:
            said.append(f"x {fab['efficiency']:g}")
        parts.append(", ".join(said))
    return " · ".join(parts)


def what_if_note(hw: dict[str, Any]) -> str:
    """" · what-if: n0.nic2-leaf0.2 x0.5 bandwidth, GPU 5 1.2x slower": the faults and
    stragglers (``hardware.what_if``), "" where none."""
    said = []
    for w in hw.get("what_if") or ():
        if "link" in w:
            said.append(f"{w['link']} x{w['bw_factor']:g} bandwidth")
        elif "gpu" in w:
            said.append(f"GPU {w['gpu']} {w['slowdown']:g}x slower")
        else:
            said.append(f"{w.get('remove_link') or w.get('remove_switch')} removed")
    return " · what-if: " + ", ".join(said) if said else ""


def peak_text(s: dict[str, Any]) -> str:
    """"bf16 peak 989": the FLOP/s peak MFU divides by, in TFLOP/s, named by its precision
    (an fp8 run's is the fp8 peak); "" without one."""
    peak = (s.get("hardware") or {}).get("peak_flops")
    precision = (s.get("plan") or {}).get("precision")
    return f"{precision + ' ' if precision else ''}peak {peak / 1e12:.0f}" if peak else ""


def _grads_option(p: dict[str, Any]) -> str:
    """" · fp32 grads reduced in bf16": the gradients' dtype (their memory), and where they are
    reduced over data (and context) parallel ranks the dtype they are reduced in, since it sets
    the bytes of every gradient collective; and " after the backward" where they are not
    reduced beside it (``overlap_grad_reduce``). Named without a reduction too, so that two
    plans compared side by side do not seem to differ in it."""
    if "grad_dtype" not in p:
        return ""
    if p.get("dp", 1) * p.get("cp", 1) == 1:
        return f" · {p['grad_dtype']} grads"
    reduce = p["grad_reduce_dtype"]  # (TrainingCfg.reduced_grad_dtype: grad_dtype where none is set)
    after = " after the backward" if p.get("overlap_grad_reduce") is False else ""
    return (f" · {p['grad_dtype']} grads" + (f" reduced in {reduce}" if reduce != p["grad_dtype"] else "")
            + (f"{' reduced' if reduce == p['grad_dtype'] else ''}{after}" if after else ""))


def _overlap_note(ex: dict[str, float], kinds: list[str]) -> str:
    """What the exposed line adds where its kinds sum past the total: a wait while two kinds
    are in flight counts in each (metrics.md, "How a GPU's step splits")."""
    if sum_left(ex[k] for k in kinds) <= ex["total"] * (1 + 1e-9):
        return ""
    return " (a wait on two kinds at once counts in both)"


def schedule_part(p: dict[str, Any], sep: str) -> str:
    """``sep`` and the schedule's label, or "" for plain 1F1B without a pipeline (gradient
    accumulation over microbatches; another schedule on one stage still orders them, as GPipe
    keeps every microbatch's activations)."""
    if p.get("pp", 1) == 1 and p.get("schedule") == "1f1b" and not p.get("ep_comm_overlap"):
        return ""
    return sep + schedule_label(p)


def schedule_label(p: dict[str, Any]) -> str:
    """The schedule as the plan lines name it: ``interleaved v2``, with its microbatch group
    where it is not pp (``interleaved v2 (groups of 6)``), and ``combined`` where forwards and
    backwards pair into overlapped chunks (``parallel.ep_comm_overlap``)."""
    return (f"{p['schedule']}" + (f" v{p['vpp']}" if p.get("vpp", 1) > 1 else "")
            + (f" (groups of {p['vpp_group']})" if p.get("vpp_group") not in (None, p.get("pp")) else "")
            + (" combined" if p.get("ep_comm_overlap") else ""))


def plan_line(s: dict[str, Any]) -> str:
    """The plan as the terminal names it: "TP8 x PP4 x DP2 · fp32 grads · 1f1b · 64
    microbatches x 1 x 4096 tokens" (``run``'s plan line, ``compare``'s for each plan)."""
    p, m = s["plan"], s["plan"]["microbatches"]
    return (plan_dims(p, " x ") + plan_options(p) + schedule_part(p, " · ")
            + f" · {m} microbatch{'es' if m != 1 else ''} x {p['micro_batch_size']} x {s['model']['seq_len']} tokens")


def step_text(step_s: float) -> str:
    """The step time as the terminal and the report's card give it: four significant digits,
    trailing zeros kept ("4.300 s", not "4.3 s": a figure read beside compare's 4.300 s), and
    whole seconds with separators from 1,000 s on ("5,811 s")."""
    return f"{step_s:,.0f} s" if abs(step_s) >= 999.95 else f"{step_s:#.4g} s"


def secs(x: float, step_s: float) -> str:
    """A part of the step as the terminal gives it: "0.178 s", "0.160 s" (trailing zeros kept),
    "5,710 s" from 1,000 s on, and
    "0 s" below a nanosecond's share of the step (a difference of two times that rounding
    left over: 5.31e-15 s of cool-down beside a 5,811 s step)."""
    if abs(x) <= 1e-9 * max(step_s, 1.0):
        return "0 s"
    return f"{x:,.0f} s" if abs(x) >= 999.5 else f"{three_digits(x)} s"  # (999.7 s: "1,000 s", not "1e+03 s")


def _projection_line(pj: dict[str, Any] | None) -> list[str]:
    if not pj:
        return []
    cost = f" · ${pj['cost_usd']:,.0f}" if pj.get("cost_usd") is not None else ""
    pue = f" x PUE {pj['pue']:g}" if pj.get("pue", 1.0) != 1.0 else ""  # (the energy counts it)
    return [f"{'projection':<16}{pj['tokens'] / 1e12:g}T tokens: {pj['days']:,.1f} days, "
            f"{pj['gpu_hours']:,.0f} GPU-hours{cost}, {pj['energy_MWh']:,.0f} MWh at GPU TDP{pue}"]


def wall_said(wall_s: float) -> str:
    """A wall time as the terminal gives it: "1.4 s", and two decimals below a tenth ("0.04 s",
    where one would read 0.0)."""
    return f"{wall_s:.1f} s" if wall_s >= 0.095 else f"{wall_s:.2f} s"


def _bubble_line(s: dict[str, Any]) -> list[str]:
    b = s.get("bubble")
    line = f"{'bubble':<16}{100 * s['bubble_fraction']:.1f} % of the step"
    unfilled = unfilled_pipeline(s)
    if b and b["bubble_s"] > 0:
        t = s["step_time_s"]
        if (s.get("plan") or {}).get("pp", 2) == 1:  # (as the report's card says: no pipeline fills or drains)
            line += " (no pipeline: idle, waiting on other GPUs)"
        line += (f": warm-up {secs(b['warm_up_s'], t)} · cool-down {secs(b['cool_down_s'], t)} · "
                 f"dependency {secs(b['dependency_s']['total'], t)} · imbalance {secs(b['imbalance_s'], t)} per GPU")
    if not unfilled:
        return [line]
    smaller = " or a smaller micro_batch_size" if s["plan"].get("micro_batch_size", 1) > 1 else ""
    return [line, f"{'':<16}{unfilled}; a larger training.global_batch_size{smaller} gives more"]


def unfilled_pipeline(s: dict[str, Any]) -> str:
    """Where a pipeline has fewer microbatches than stages, that it never fills (the terminal
    under its bubble line, with what gives more; the report under its bubble card); else "".
    1F1B and GPipe idle (p - 1) / (m + p - 1) of the forwards' and backwards' time (Narayanan
    et al. 2021, Sec 2.2): at least half where m <= p - 1."""
    plan = s.get("plan") or {}
    p, m = plan.get("pp", 1), plan.get("microbatches")
    if p <= 1 or m is None or m >= p:
        return ""
    return f"fewer microbatches ({m:,}) than stages ({p:,}): the pipeline never fills"


def _path_line(s: dict[str, Any]) -> list[str]:
    cp = s.get("critical_path")
    if not cp or cp["length_s"] <= 0:
        return []
    parts = " · ".join(f"{k} {100 * v / cp['length_s']:.0f} %" for k, v in cp["by_kind_s"].items() if v > 0)
    n = cp["ranks_visited"]
    return [f"{'critical path':<16}{parts} ({cp['tasks']:,} tasks over {n} rank{'s' if n != 1 else ''})"]


# the span names' short words, as the terminal spells them out (docs/reference.md, "Span names")
_PHASE_WORDS = {"F": "forward", "B": "backward"}
_OP_WORDS = {"AR": "all-reduce", "RS": "reduce-scatter", "AG": "all-gather", "A2A": "all-to-all", "shift": "shift",
             "send": "send", "recv": "receive"}
# a counter folded to # in a group's name, as "every ..." (a GEMM's chunk number follows its piece: "proj #")
_EVERY_WORDS = {"bucket": "bucket", "part": "part", "ring": "ring step"}
_PLAIN_WORDS = {"grads": "gradients", "params": "parameters", "attn": "attention", "mlp": "MLP",
                "dgrad": "input gradient", "wgrad": "weight gradient", "act": "activations", "grad": "gradients"}


def plain_collective(collective: str) -> str:
    """A collective's name (``exposed_comm_causes[].collective``: ``<kind> <op>: <span
    name>``, numbers folded to #) in words, for the terminal: ``dp all_reduce: AR grads
    bucket #`` reads ``dp all-reduce of gradients, every bucket``, ``tp all_reduce: F AR
    attn`` ``tp forward all-reduce of attention``, ``pp send: recv grad`` ``pp receive of
    gradients``, ``cp shift: F shift attn ring #`` ``cp forward shift of attention, every ring
    step``. A name without the short name of a collective is returned as it is, but for its
    pieces' count (``offload: grads to host block #``: ``offload: grads to host, every block``)."""
    head, sep, name = collective.partition(": ")
    words = name.split()
    phase = _PHASE_WORDS.get(words[0], "") if words else ""
    words = words[1:] if phase else words
    if not sep or not words or words[0] not in _OP_WORDS:
        # no collective: optimizer offload's copies and host steps, pipelined a piece a block
        return collective.replace(" block #", ", every block")
    op, rest = _OP_WORDS[words[0]], words[1:]
    # one group holds every bucket, part, ring step or chunk (their numbers folded to #): said
    # once, at the end
    every, kept = [], []
    for i, w in enumerate(rest):
        if i + 1 < len(rest) and rest[i + 1] == "#" and w in _EVERY_WORDS:
            every.append(_EVERY_WORDS[w])
        elif w == "#":
            if rest[i - 1] not in _EVERY_WORDS and "chunk" not in every:
                every.append("chunk")
        else:
            kept.append(w)
    rest = f" {' '.join(kept)} ".replace(" grads shard ", " gradient shards ").strip()
    replicas = rest.endswith("(replicas)")
    rest = rest.removesuffix("(replicas)").strip()
    what = " ".join(_PLAIN_WORDS.get(w, w) for w in rest.split())
    return (f"{head.split()[0]} {phase + ' ' if phase else ''}{op}{' of ' + what if what else ''}"
            f"{' over the replicas' if replicas else ''}{', every ' + ' and '.join(every) if every else ''}")


def _causes_lines(s: dict[str, Any], n: int = 3) -> list[str]:
    out = []
    for i, c in enumerate((s.get("exposed_comm_causes") or [])[:n]):
        where = ""
        if c.get("bottleneck"):
            bn = c["bottleneck"]
            # (another of its own group: DualPipe's other part, a bucket beside the next)
            shared = ", ".join(("another " if x["collective"] == c["collective"] else "")
                               + plain_collective(x["collective"]) for x in c.get("shared_with", [])[:1])
            where = f" · bound by {bn['link']} ({bn['kind']})" + (f", shared with {shared}" if shared else "")
        # how many a GPU runs: a cost paid per microbatch (ZeRO-3's gathers) shows as a count
        n = c.get("count_per_gpu", 1)  # (a mean over GPUs: whole where every GPU runs as many)
        times = (f" ({round(n):,} times a GPU)" if abs(n - round(n)) < 1e-6 else f" ({n:.3g} times a GPU on average)"
                 ) if n > 1 else ""
        out.append(f"{'top exposed' if i == 0 else '':<16}{c['exposed_s']:.3g} s  {plain_collective(c['collective'])}"
                   f"{times}{where}")
    return out


def fabric_faults_note(faults: dict | None, sep: str, collapsed: bool = True) -> str:
    """What the terminal and the report say of the GPUs the faults reach beyond those their
    nodes' own cables split anyway ("" if none, or in a run of every rank): that the
    classes split around them (one phrase; why the run simulates more ranks than without
    the fault), or that the collapse kept them (two); before it, where the GPUs the faults
    reach on any node were not asked, that (one); each after ``sep``."""
    if not faults or not collapsed:
        return ""
    unasked = "" if faults["reach_asked"] else (
        f"{sep}the GPUs the faults reach on other nodes not asked (too many pairs of GPUs in the plan's "
        f"groups to route them all): their twins move at the pace the simulated ones see")
    if not faults["kept_in_collapse"]:
        return unasked + (f"{sep}split around the {_gpus(faults['gpus'])} more that the faults reach "
                          f"(simulation.fabric_fault_split_ranks: {faults['split_up_to']:,})" if faults["gpus"] else "")
    return unasked + (f"{sep}faults kept in the collapse, their orbits at the slowest twin's pace:{sep}a split "
            f"around the {_gpus(faults['gpus'])} they reach would simulate {faults['split_ranks']:,} ranks "
            f"(simulation.fabric_fault_split_ranks: {faults['split_up_to']:,})")


def leaf_split_note(split: dict | None, sep: str, collapsed: bool = True, ranks: int = 0) -> str:
    """What the terminal and the report say where the edges of the fabric's leaf groups or
    pods cut the plan's groups or pipeline routes unevenly ("" if they do not, or in a run of
    every rank): that the classes split by them (why the run simulates more ranks), or that
    the collapse kept them and what the split would have simulated (against the ``ranks``
    simulated); after ``sep``."""
    if not split or not collapsed:
        return ""
    cut = "leaf groups cut the plan's groups or pipeline routes unevenly"
    limit = f"(simulation.leaf_split_ranks: {split['split_up_to']:,} more at most)"
    if not split["kept_in_collapse"]:
        return f"{sep}split where {cut} {limit}"
    more = f", {split['ranks'] - ranks:,} more" if 0 < ranks < split["ranks"] else ""
    return (f"{sep}{cut}, kept in the collapse:{sep}a split by them would simulate {split['ranks']:,} ranks{more} "
            f"{limit}; twins move at the slowest one's pace")


# how far a step estimated at the slowest twin's pace (simulation.asymmetric_orbits) was from
# every rank's in the fuzz rounds (docs/architecture.md, "Known limitations"): said wherever a
# step is marked as an estimate (run, sweep and advise tables, compare)
ESTIMATE_SPREAD = "mostly within 1 % of every rank's, -4 % to +21 % in random plans"
SLOWEST_TWIN = "some communications at their slowest twin's pace"


def all_ranks_run(worlds) -> bool:
    """Whether every one of ``worlds`` (GPU counts) may be simulated rank by rank
    (``--all-ranks``: at most MAX_GPUS_ALL_RANKS), so that a note may offer it."""
    from ..config import MAX_GPUS_ALL_RANKS

    return all(w <= MAX_GPUS_ALL_RANKS for w in worlds)


# a lead under this between two plans of which either step is an estimate is said to be one
# that may not hold (compare's fastest plan over the next, advise's verdict): most estimates are
# within 1 % of every rank's step, a few several percent off (ESTIMATE_SPREAD)
CLOSE_LEAD = 0.02


def estimates_clause(whose: list[str], worlds, settings: bool = False) -> str:
    """Whose steps (``whose``: names, in order) are estimates and why, and ``--all-ranks`` where
    each of their GPU counts ``worlds`` may run it (``settings``: with ``run --set``, for plans
    that are a scenario's changes): the end of compare's and advise's line on a close lead,
    "A's and B's steps are estimates (...); run --all-ranks checks them"."""
    owners = " and ".join(f"{w}'s" for w in whose)
    many = len(whose) > 1
    how = f"--set with {'their' if many else 'its'} settings and " if settings else ""
    check = f"; run {how}--all-ranks checks {'them' if many else 'it'}" if all_ranks_run(worlds) else ""
    return f"{owners} {'steps are estimates' if many else 'step is an estimate'} ({SLOWEST_TWIN}){check}"


def asymmetric_note(sim: dict, sep: str, world: int) -> str:
    """What the terminal and the report say where some communications moved at their slowest
    twin's pace (``simulation.asymmetric_orbits``: their twins cross links unlike the
    simulated rank's: another spine where ECMP hashes them apart, a slower cable), after
    ``sep``; "" where none did. The kinds, not the counts: a count is of distinct
    communications, not of tasks. ``--all-ranks`` is offered where it may run (``world``
    GPUs, at most MAX_GPUS_ALL_RANKS); -4 % and +21 % are the farthest the fuzz rounds
    measured such a step from every rank's (docs/architecture.md, "Known limitations")."""
    orbits = sim.get("asymmetric_orbits")
    if not orbits:
        return ""
    kinds = list(orbits)
    what = " and ".join(filter(None, (", ".join(kinds[:-1]), kinds[-1])))
    check = "; --all-ranks checks it" if all_ranks_run([world]) else ""
    return (f"{sep}{what} communications move at their slowest twin's pace (twins on other links: another spine, "
            f"a slower cable),{sep}so the step is an estimate: {ESTIMATE_SPREAD}{check}")


# how far a collapsed step with a slow GPU, its orbits all symmetric, was from every rank's in
# the fuzz rounds of 2026-12-07 (54 such plans of bench/fuzz_fabrics.py and fuzz_symmetry.py: 49
# exact, 4 within 1 %, one +3.5 %: docs/architecture.md, "Known limitations")
STRAGGLER_SPREAD = "mostly within 1 % of every rank's, up to +3.5 % in random plans"


def straggler_note(summary: dict, sep: str) -> str:
    """What the terminal and the report say where a slow GPU (``hardware.what_if``'s
    ``slowdown``) split the classes of a collapsed run, after ``sep``; "" where no GPU is slow,
    every rank ran, or each DP replica ran apart (``simulation.split_replicas``). The slow
    GPU's classes run apart, but a replica it holds back only through others' timing (an
    all-to-all, a shared link) stays a twin of undisturbed ones, in lock-step with them: where
    the held-back sends would leave shared links to the others at other moments, every
    rank's step is shorter (docs/architecture.md, "Known limitations")."""
    sim = summary.get("simulation", {})
    world = summary.get("world_size", 0)
    slow = [w["gpu"] for w in (summary.get("hardware", {}).get("what_if") or []) if "slowdown" in w]
    if (not slow or not sim.get("collapse_symmetric") or sim.get("split_replicas")
            or sim.get("simulated_ranks", world) >= world):
        return ""
    gpus = f"GPU{'s' if len(slow) > 1 else ''} {', '.join(map(str, slow))}"
    check = "; --all-ranks checks it" if all_ranks_run([world]) else ""
    return (f"{sep}slow {gpus}: replicas held back only through others' timing run in lock-step with their "
            f"twins,{sep}so the step is an estimate: {STRAGGLER_SPREAD}{check}")


def replicas_note(sim: dict, sep: str) -> str:
    """What the terminal and the report say where each DP replica was simulated apart
    (``simulation.split_replicas``), after ``sep``; "" where it was not."""
    if not sim.get("split_replicas"):
        return ""
    return f"{sep}each DP replica apart, twins only among its TP and CP peers (simulation.split_replicas)"


def _gpus(n: int) -> str:
    return f"{n:,} GPU{'s' if n != 1 else ''}"


def collective_fallbacks_note(fallbacks: dict | None, sep: str) -> str:
    """What the terminal and the report say of algorithms named in ``simulation.collectives``
    that could not run some groups ("" if none), a phrase per collective, each after ``sep``."""
    return "".join(
        f"{sep}{op}: {f['asked']} cannot run {sum(f['ran'].values()):,} of the {f['of']:,} communications simulated "
        f"({_CANNOT.get(f['asked'], 'groups it does not apply to')}); "
        f"{' and '.join(f'{a} ({n:,})' for a, n in f['ran'].items())} ran those (simulation.collectives)"
        for op, f in (fallbacks or {}).items())


# where a named algorithm cannot run a group (collectives.algorithms.applicable)
_CANNOT = {"tree": "groups inside one node, or uneven over nodes",
           "hierarchical": "groups inside one node, uneven over nodes, or of one GPU a node",
           "nvls": "groups across nodes, or GPUs without NVLS",
           "nvls_tree": "groups inside one node, uneven over nodes, of one GPU a node, or GPUs without NVLS"}



# how much longer published runs took than clustersim simulates them, least and most, over the
# runs tests/test_published.py holds (Korthikanti et al.'s and Narayanan et al.'s on A100s,
# NVIDIA's H100 FP8 ones, DeepSeek-V3's), which that test keeps to the simulation's: what makes
# MFU an upper bound (no kernel launches, no framework overhead: docs/metrics.md)
PUBLISHED_LONGER = (0.02, 0.43)


def published_longer() -> str:
    """"published runs took 2-43 % longer than simulated" (:data:`PUBLISHED_LONGER`): what
    makes a simulated step a lower bound (``run``'s MFU line, sweep's and advise's tables)."""
    low, high = PUBLISHED_LONGER
    return f"published runs took {100 * low:.0f}-{100 * high:.0f} % longer than simulated"


def format_summary(s: dict[str, Any]) -> str:
    """The short human summary printed by ``clustersim run``."""
    mem, hw = s["memory"], s["hardware"]
    ex, comm = s["exposed_comm_s"], s["comm_s"]
    kinds = [k for k in COMM_KINDS if comm[k] > 0]
    t = s["step_time_s"]
    exposed = " · ".join(f"{k} {secs(ex[k], t)}" for k in kinds) or "none"
    hidden = " · ".join(f"{k} {secs(comm[k] - ex[k], t)}" for k in kinds) or "none"
    lines = [
        f"clustersim · {printable(s['scenario'])}",
        *( [printable(s["description"])] if s.get("description") else [] ),
        f"{'cluster':<16}{s['world_size']} x {printable(hw['gpu'])} ({hw['nodes']} node{'s' if hw['nodes'] != 1 else ''} x {hw['gpus_per_node']}, {printable(hw['topology'])})"
        + printable(topology_changes_note(hw) + what_if_note(hw)),
        *([f"{'network':<16}{printable(network_said(hw))}"] if network_said(hw) else []),
        *(f"{'':<16}{printable(c)}" for c in link_ceilings_said(hw, s.get("links"))),
        f"{'plan':<16}{plan_line(s)}",
        # a plan that does not fit could not run: said where the eye goes first, not only below
        f"{'step time':<16}{step_text(s['step_time_s'])}" + ("" if mem["fits"] else
                                                        f"  (DOES NOT FIT in {'host ' if host_only_unfit(mem) else ''}"
                                                        "memory: the step it would take if it did)"),
        f"{'tokens/s':<16}{s['tokens_per_s']:,.0f}"
        + (f" ({s['tokens_per_s_per_gpu']:,.1f} per GPU)" if s["world_size"] > 1 else ""),  # (one GPU: one figure)
        f"{'TFLOP/s per GPU':<16}{s['tflops_per_gpu']:.1f} model · {s['hw_tflops_per_gpu']:.1f} hardware "
        f"({peak_text(s)})",
        f"{'MFU / HFU':<16}{100 * s['mfu']:.1f} % / {100 * s['hfu']:.1f} % (upper bounds: {published_longer()}, "
        f"docs/metrics.md)",
        *_bubble_line(s),
        *_projection_line(s.get("projection")),
        f"{'exposed comm':<16}{secs(ex['total'], t)} per GPU: {exposed}" + _overlap_note(ex, kinds),
        f"{'hidden comm':<16}{hidden}",
        *_causes_lines(s),
        *_path_line(s),
        f"{'memory (GiB)':<16}{'stage':>5} {'params':>7} {'grads':>6} {'optim':>6} {'activ':>6} {'other':>6} "
        f"{'peak':>7} / cap",
    ]
    for st in _stage_rows(mem["stages"]):
        g = lambda k: st[k] / GiB  # noqa: E731
        margin = st.get("margin_bytes")
        spare = "" if margin is None else (f" ({margin / GiB:.1f} spare{', tight' if st.get('tight') else ''})"
                                           if margin >= 0 else f" (by {-margin / GiB:.1f})")
        verdict = ("fits" if st["fits"] else "DOES NOT FIT") + spare
        # the rest of the peak: buffers, recomputing and transients at its instant (>= 0: the peak's instant
        # holds at least the most activations, analysis.memory)
        other = st["peak_bytes"] - sum_left(st[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                                       "activations_bytes"))
        lines.append(f"{'':<16}{st['stage']:>5} {g('params_bytes'):>7.1f} {g('grads_bytes'):>6.1f} "
                     f"{g('optimizer_bytes'):>6.1f} {g('activations_bytes'):>6.1f} {max(other, 0.0) / GiB:>6.1f} "
                     f"{g('peak_bytes'):>7.1f} / {st['capacity_bytes'] / GiB:.0f}  {verdict}")
    if len(mem["stages"]) > len(_stage_rows(mem["stages"])):
        lines.append(f"{'':<16}(first, last and highest-peak stages of {len(mem['stages'])}; all in summary.json)")
    if any(p.get("split_w") for st in mem["stages"] for p in st.get("parts", ())):
        lines.append(f"{'':<16}(activ includes what split backwards hold from B to W: docs/parallelism.md, "
                     "\"Zero bubble\")")
    if mem.get("tight"):
        lines.append(f"{'':<16}(tight: less than {mem['tight_below_bytes'] / GiB:.1f} spare, which the CUDA context, "
                     "NCCL's buffers and fragmentation, not counted here, can take)")
    if host := mem.get("host"):
        lines.append(host_line(host))
    return "\n".join(lines)


def host_only_unfit(mem: dict[str, Any]) -> bool:
    """Whether every GPU fits and the hosts' memory does not hold what they offload
    (``memory``: summary.json's): the plan does not fit, and it is the host's doing."""
    host = mem.get("host")
    return bool(host) and not host["fits"] and mem["peak_bytes"] <= mem["capacity_bytes"]


def host_line(host: dict) -> str:
    """What the GPUs offload (optimizer states, activations) in host memory (``memory.host``): a node's against its
    capacity, and one GPU's (the most of any stage)."""
    gpu_bytes = host["gpu_bytes"]
    margin = host["margin_bytes"]
    verdict = (f"fits ({margin / GiB:,.0f} GiB spare)" if host["fits"] else f"DOES NOT FIT (by {-margin / GiB:,.1f} GiB)")
    return (f"{'host memory':<16}{host['peak_bytes'] / GiB:,.1f} / {host['capacity_bytes'] / GiB:,.0f} GiB a node "
            f"({gpu_bytes / GiB:,.1f} a GPU: what it offloads)  {verdict}")
