"""Which plan to use: the plans around the parallelism guide's options for this model and
cluster, simulated and ranked, and the guide's rule checked against them (``clustersim
advise``).

The model, the cluster, the batch, the precision and the attention are the scenario's; the
plan is searched::

    tp         1, 2, 4, 8 (at most a node's GPUs; dividing the heads)
    pp         1, 2, 4, 8, 16 (at most the layers; split unevenly where they do not divide)
    cp         1, or 1 to 16 for sequences of 32K tokens and more   (guide: "For large
               sequence length (128K+), use CP")
    ep         MoE only: 1 (2 under DeepEP) to 64, dividing the experts and DP x CP ("If your
               model is MoE, use EP in addition")
    zero       1, 2, 3 without a pipeline; 1, 2 with one (ZeRO-3 re-gathers every microbatch's
               parameters on each stage: "additional communication is needed"); ZeRO-1 moves
               what plain DP moves, with less memory, and stands for it; 0 alone where the
               shard groups are one GPU (DP x CP 1, and the experts' DP group 1): there
               every stage is the plan without ZeRO
    recompute  none, selective (where it recomputes something: not Megatron's default
               under flash attention), full
    dp         the GPUs left: GPUs / (tp x pp x cp)

each degree with the scenario's own among its values (a file's CP 2 at 8K tokens is tried on
every shape, as CP 1 is), with sequence parallelism wherever tp > 1, and where pp > 1 both
1F1B and the scenario's own schedule (1F1B alone where it is a custom file; interleaving with
the scenario's vpp, or 2, as far as the layers allow), and its other settings where the plan
allows them (DeepEP's experts whole on each rank). ``--vary KEY=V1,V2`` replaces a
dimension's values (``--vary parallel.tp=8``) or adds one (``--vary
parallel.schedule=1f1b,interleaved``); not a key of the model, the cluster or the batch,
nor one of how the plans are simulated (:func:`check_plan_keys`). Plans the scenario's rules
refuse are counted, not simulated; so are plans certain not to fit in memory
(``api.memory_floor``: weights, gradients, optimizer states and the activations the schedule
holds, a lower bound of the simulated peak), unless ``--simulate-unfit``. The scenario's own
plan is plan 1, always simulated. Where no plan fits and the topology has a host to offload
to, the search is made again with the optimizer states in host memory (:func:`run_advise`).

The guide's rule for the case (its "Choose your parallelism technique", as docs/parallelism.md
states it: "The guide's rules of thumb, by simulation"), by the model's parameters N and the
GPUs G::

    N < 10B and G <= 8     TP=8, or ZeRO-3 with DP and full recompute       (this alone)
    N <= 100B              TP=8 and PP, or TP=8 with DP + ZeRO-3, or only ZeRO-3
    G <= 512               DP with TP=8, or DP with PP (ZeRO-3 inefficient)
    G > 1024               TP=8 with ZeRO-2 and PP
    (up to 100B, the GPU-count rule that applies beside the model-size one: on Llama-2 70B
    over 64 GPUs they disagree on ZeRO-3, which the search settles; 513-1024 GPUs above
    100B: the guide says nothing, both neighbours' options are shown)

"TP=8" is TP over a node's GPUs (8 on DGX and HGX nodes). Each option's best plan is shown
beside the best plan found, with how much slower it is; where it runs ZeRO-3 in several
microbatches and the micro batch size is not searched, the line says so (each microbatch
gathers every layer again: the option stands at the scenario's micro batch size).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .hardware.topology import reused_clusters
from .sweep import (DP, Plan, also_set, cell_text, check_keys, ranking, simulate_plans, table_lines, value_at,
                    with_split)
from .yamlio import read_yaml

RECOMPUTES = ("none", "selective", "full")
LONG_SEQ = 32 * 1024  # from here CP is searched (the guide: 128K+; it already pays at 32K on some plans)
ADVISE_FILES = ("advise.json", "advise.csv", "advise.html")


@dataclass(frozen=True)
class Option:
    """One of the guide's suggestions, as a test on a plan's values (``tp``, ``pp``, ``dp``,
    ``cp``, ``ep``, ``zero``, ``recompute``)."""

    name: str
    test: Callable[[dict[str, Any]], bool]
    least_gpus: int = 1  # the fewest GPUs a plan of it takes (TP=8 with a pipeline or replicas: 16)


@dataclass(frozen=True)
class Rule:
    """The guide's rule for a case: its words and its options."""

    says: list[str]  # the guide's sentences, as it words them
    options: tuple[Option, ...]


GUIDE_LONG_SEQ = 128 * 1024  # the guide: "For large sequence length (128K+), use CP"


def guide_rule(params: float, gpus: int, node_tp: int, moe: bool = False, long_seq: bool = False) -> Rule:
    """The guide's rule for a model of ``params`` parameters on ``gpus`` GPUs (``node_tp``:
    what "TP=8" means here, TP over a node's GPUs), its options asking EP besides for a MoE
    model (``moe``: "If your model is MoE, use EP in addition") and CP for 128K tokens and
    more (``long_seq``)."""
    rule = _size_rule(params, gpus, node_tp)
    if not (moe or long_seq):
        return rule
    extra = " + ".join((["EP"] if moe else []) + (["CP"] if long_seq else []))

    def also(test):
        return lambda v: test(v) and (not moe or v["ep"] > 1) and (not long_seq or v["cp"] > 1)

    return Rule(rule.says + (["If your model is MoE, use EP in addition"] if moe else [])
                + (["For large sequence length (128K+), use CP"] if long_seq else []),
                tuple(Option(f"{o.name} + {extra}", also(o.test)) for o in rule.options))


UP_TO_512 = "If you have up to 512 GPUs, use DP with TP=8 or PP. (ZeRO3 is inefficient)"
SIZE_RULE = "For models with up to 100B parameters, use more than 8 GPUs"
OVER_1024 = "If you have more than 1024 GPUs, use TP=8 with ZeRO2 and PP"


def _size_rule(params: float, gpus: int, node_tp: int) -> Rule:
    """The guide's rules for the model's size and the GPUs: the small-model rule alone under
    10B on 8 GPUs or fewer; else, up to 100B, the model-size rule, and beside it the GPU-count
    rule where one applies (up to 512 GPUs, more than 1,024): the guide states both, and on
    Llama-2 70B over 64 GPUs they disagree on ZeRO-3, which the search then settles; above
    100B the GPU-count rule alone (513-1,024 GPUs: both neighbours')."""
    t8 = node_tp
    tp8_pp = Option(f"TP={t8} and PP", lambda v: v["tp"] == t8 and v["pp"] > 1, 2 * t8)
    if params < 10e9 and gpus <= 8:
        return Rule(["For small models (< 10B parameters), use TP (TP=8) or ZeRO-3 with DP and Full recompute in 8 GPUs"],
                    (Option(f"TP={t8}", lambda v: v["tp"] == t8 and v["pp"] == 1),
                     Option("ZeRO-3 with DP and full recompute",
                            lambda v: v["tp"] == 1 and v["pp"] == 1 and v["zero"] == 3 and v["recompute"] == "full")))
    up_to_512 = (Option(f"DP with TP={t8}", lambda v: v["tp"] == t8 and v["pp"] == 1 and v["dp"] > 1 and v["zero"] < 3,
                        2 * t8),
                 Option("DP with PP", lambda v: v["pp"] > 1 and v["dp"] > 1 and v["zero"] < 3, 4))
    over_1024 = (Option(f"TP={t8} with ZeRO2 and PP", lambda v: v["tp"] == t8 and v["pp"] > 1 and v["zero"] == 2,
                        2 * t8),)
    by_gpus = Rule([UP_TO_512], up_to_512) if gpus <= 512 else Rule([OVER_1024], over_1024) if gpus > 1024 else None
    if params <= 100e9:
        size = Rule([SIZE_RULE + ": TP=8 and PP, or TP=8 with DP+ZeRO3, or only ZeRO3"],
                    (tp8_pp,
                     Option(f"TP={t8} with DP+ZeRO3", lambda v: v["tp"] == t8 and v["pp"] == 1 and v["zero"] == 3
                            and v["dp"] > 1, 2 * t8),
                     Option("only ZeRO3", lambda v: v["tp"] == 1 and v["pp"] == 1 and v["zero"] == 3)))
        return size if by_gpus is None else Rule(size.says + by_gpus.says, size.options + by_gpus.options)
    if by_gpus is not None:
        return by_gpus
    # 513 to 1024 GPUs above 100B: the guide has no rule; its neighbours' options
    return Rule([UP_TO_512, OVER_1024], up_to_512 + over_1024)


def _divisors(n: int, of: tuple[int, ...]) -> list[int]:
    return [x for x in of if n % x == 0]


def _with_own(values: list[int], own: int) -> list[int]:
    """A degree's ``values`` searched, with the scenario's ``own`` among them: a file's CP 2 at
    8K tokens, or PP 64, is tried on the other shapes too, not only in its own plan."""
    return values if own in values else sorted([*values, own])


def search_space(sc, data: dict[str, Any]) -> dict[str, list[Any]]:
    """The values of each dimension searched for the scenario ``sc`` (module docstring; its
    file's ``data``): each degree's with the scenario's own; selective recompute only where it
    recomputes something (under flash attention Megatron's default, the attention core, keeps
    nothing to recompute)."""
    m, gpus_per_node = sc.model, sc.topology.node.gpus
    tr = data.get("training") or {}
    selective = sc.cfg.training.attention != "flash" or tr.get("recompute_modules") not in (None, ["core_attn"])
    p = sc.parallel
    space: dict[str, list[Any]] = {
        "parallel.tp": _with_own([t for t in _divisors(m.heads, (1, 2, 4, 8)) if t <= gpus_per_node], p.tp),
        "parallel.pp": _with_own([x for x in (1, 2, 4, 8, 16) if x <= min(m.layers, sc.mesh.world_size)], p.pp),
        "parallel.cp": _with_own([1, 2, 4, 8, 16] if m.seq_len >= LONG_SEQ else [1], p.cp),
        # (DeepEP, and an FP8 dispatch, send over an EP group: they need one of two ranks or more)
        "parallel.ep": _with_own([e for e in _divisors(m.moe.experts, (1, 2, 4, 8, 16, 32, 64))
                                  if e > 1 or (m.moe.dispatcher != "deepep" and not m.moe.fp8_dispatch)]
                                 if m.moe is not None else [1], p.ep),
        "parallel.zero": [1, 2, 3],
        "training.recompute": [r for r in RECOMPUTES if r != "selective" or selective],
    }
    own = sc.parallel.schedule
    space["parallel.schedule"] = ["1f1b"] + ([own] if own not in ("1f1b", "custom") else [])
    return space


# settings practitioners tune that the search keeps at the scenario's values unless --vary
# searches them: said under the searched dimensions, so that a plan left out reads as not
# tried rather than as worse
LEVERS = ("parallel.schedule", "parallel.cp", "parallel.tp_comm_overlap", "training.micro_batch_size")


def kept_levers(sc, space: dict[str, list[Any]]) -> dict[str, Any]:
    """Each of :data:`LEVERS` the search does not vary, at the scenario's value."""
    cfg = sc.cfg.model_dump(mode="json")
    return {key: value_at(cfg, key) for key in LEVERS if key not in space}


def own_values(sc, space: dict[str, list[Any]]) -> dict[str, Any]:
    """The scenario's own plan's value of each dimension searched."""
    cfg = sc.cfg.model_dump(mode="json")
    return {key: value_at(cfg, key) for key in space}


MEMORY = ("parallel.zero", "training.recompute")  # the dimensions refined on the shapes that fit


def memory_settings(space: dict[str, list[Any]], pp: int) -> list[dict[str, Any]]:
    """The (zero, recompute) settings tried on a shape with ``pp`` stages, the one that saves
    the most memory first: the highest ZeRO stage (ZeRO-3 not with a pipeline, unless only it
    is asked for), the most recompute."""
    zeros = space.get("parallel.zero", [None])
    if _positive_int(pp) and pp > 1 and len(zeros) > 1:
        zeros = [z for z in zeros if z != 3] or zeros
    recs = space.get("training.recompute", [None])
    order = {r: i for i, r in enumerate(RECOMPUTES)}
    zeros = sorted(zeros, key=lambda z: -z if isinstance(z, int) else 0)  # (a bad value: the rules refuse it)
    recs = sorted(recs, key=lambda r: -order.get(r, -1) if isinstance(r, str) else 1)
    return [{k: v for k, v in (("parallel.zero", z), ("training.recompute", r)) if v is not None}
            for z in zeros for r in recs]


def unsharded(settings: list[dict[str, Any]], zero: int = 0) -> list[dict[str, Any]]:
    """``settings`` (:func:`memory_settings`) on a plan whose ZeRO shard groups are one GPU
    each: every ZeRO stage there is the plan without ZeRO, so the stages give way to zero 0
    and the settings that then repeat are dropped (the recomputes kept, in their order).
    ``zero`` 1 where the plan offloads its optimizer (which needs a distributed one, over one
    GPU here)."""
    out: list[dict[str, Any]] = []
    for x in settings:
        y = {**x, "parallel.zero": zero} if "parallel.zero" in x else x
        if y not in out:
            out.append(y)
    return out


def _shards_nothing(path: str, data: dict[str, Any], plan: Plan) -> bool:
    """Whether ZeRO has nothing to shard on ``plan``: its dense shard group (CP x DP, or the
    hybrid ``zero_shard`` group) and its routed experts' (their expert-DP group, which TP
    ranks left over by expert TP widen: MoE parallel folding) are one GPU each. False where
    the plan breaks a rule (the rules name it when it is simulated)."""
    from .config import ParallelCfg, mesh_of

    doc = _applied(path, data, plan)
    return doc is not None and mesh_of(ParallelCfg.model_validate(doc["parallel"])).grad_shards(1) == (1, 1)


def shapes_of(space: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every combination of the dimensions other than ZeRO and recompute."""
    import itertools

    keys = [k for k in space if k not in MEMORY]
    return [dict(zip(keys, values)) for values in itertools.product(*(space[k] for k in keys))]


def _positive_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def plan_of(sc, data: dict[str, Any], values: dict[str, Any], number: int, varied: set[str]) -> Plan | None:
    """The plan with these ``values`` as changes to the file's ``data``: the values, dp (the
    GPUs, ``cluster.nodes`` x a node's, over tp x pp x cp), SP where tp > 1, the schedule,
    and the file's settings the plan cannot keep removed (null); None where the degrees do
    not multiply into the GPUs, EP does not divide DP x CP, or a schedule other than 1F1B
    is asked of one stage. A degree that is not a positive integer is left to the scenario's
    rules to refuse, by name."""
    par, tr = data.get("parallel") or {}, data.get("training") or {}
    per_node = values.get("cluster.node.gpus", sc.topology.node.gpus)
    nodes = values.get("cluster.nodes", sc.mesh.world_size // sc.topology.node.gpus)
    tp, pp, cp, ep = (values.get(f"parallel.{d}", par.get(d, 1)) for d in ("tp", "pp", "cp", "ep"))
    if not all(map(_positive_int, (nodes, per_node, tp, pp, cp, ep))):
        return Plan(number, list(values.items()))
    world = nodes * per_node
    if world % (tp * pp * cp):
        return None
    dp = world // (tp * pp * cp)
    if (dp * cp) % ep:  # EP is carved out of DP (and CP)
        return None
    if pp == 1 and values.get("parallel.schedule", "1f1b") != "1f1b":
        return None  # one stage: the schedules are one plan (1F1B's)
    # a setting the plan needs takes the place of a value varied for it (overlap_param_gather
    # removed from a ZeRO-3 shape): one change a key, as load_variant takes them
    changes = dict([*values.items(), (DP, dp), *_settings(sc, par, tr, values, varied)])
    return with_split(data, Plan(number, list(changes.items())))


def _combines(ep: int, pp: int, schedule: str, recompute: str) -> bool:
    """Whether a plan can run combined 1F1B (``parallel.ep_comm_overlap``; config's
    ``_check_ep_comm_overlap``): experts over EP, interleaving with a pipeline or 1F1B
    without, no full recompute."""
    return ep > 1 and (schedule == "interleaved" if pp > 1 else schedule == "1f1b") and recompute != "full"


def _settings(sc, par: dict, tr: dict, values: dict[str, Any], varied: set[str]) -> list[tuple[str, Any]]:
    """The changes besides the dimensions that make a plan of them: SP with TP; the schedule
    (the scenario's, or 1F1B where it has its own file), its own settings kept only with it
    (interleaving: the scenario's vpp, or 2, as far as the layers allow); whole experts on
    each rank under DeepEP; and the file's settings of another plan removed (the layer split
    only with its pipeline: :func:`clustersim.sweep.with_split`, which :func:`plan_of` applies)."""
    tp, pp = values.get("parallel.tp", par.get("tp", 1)), values.get("parallel.pp", par.get("pp", 1))
    zero, recompute = values.get("parallel.zero", par.get("zero", 0)), values.get("training.recompute")
    own = par.get("schedule", "1f1b")
    schedule = values.get("parallel.schedule", "1f1b" if own == "custom" else own)
    out: list[tuple[str, Any]] = []
    if "parallel.schedule" not in varied and schedule != own:
        out.append(("parallel.schedule", schedule))
    if "parallel.sp" not in varied and (tp > 1) != (par.get("sp") is True):  # (what the file has already is no change)
        out.append(("parallel.sp", True if tp > 1 else None))
    if tp == 1:
        out.append(("parallel.tp_comm_overlap", None))
    if par.get("ep_comm_overlap") and "parallel.ep_comm_overlap" not in varied and not _combines(
            values.get("parallel.ep", par.get("ep", 1)), pp, schedule, recompute or tr.get("recompute", "none")):
        out.append(("parallel.ep_comm_overlap", None))  # (kept where the plan can combine, as tp_comm_overlap)
    for k in ("vpp", "vpp_group", "schedule_file"):
        if k in par and schedule != own and f"parallel.{k}" not in varied:
            out.append((f"parallel.{k}", None))
    if schedule == "interleaved" and "parallel.vpp" not in varied:
        v = par.get("vpp", 2) if own == "interleaved" else 2
        while v > 2 and pp * v > sc.model.layers:
            v -= 1
        if v != par.get("vpp") or schedule != own:
            out.append(("parallel.vpp", v))
    deepep = sc.model.moe is not None and sc.model.moe.dispatcher == "deepep"
    if "parallel.etp" not in varied:
        if deepep and tp > 1:
            out.append(("parallel.etp", 1))  # DeepEP dispatches whole experts (config refuses etp > 1)
        elif "etp" in par:
            out.append(("parallel.etp", None))
    if "zero_shard" in par and "parallel.zero_shard" not in varied:
        out.append(("parallel.zero_shard", None))
    if zero not in (1, 2) and "overlap_param_gather" in par:
        out.append(("parallel.overlap_param_gather", None))
    if zero != 3:
        out += [(f"parallel.{k}", None) for k in ("zero3_keep_gathered", "zero_prefetch_layers") if k in par]
    elif par.get("overlap_grad_reduce") is False:  # ZeRO-3 reduce-scatters beside the backward, whatever the file says
        out.append(("parallel.overlap_grad_reduce", None))
    if recompute is not None and recompute != tr.get("recompute"):
        out += [(f"training.{k}", None) for k in ("recompute_modules", "recompute_method", "recompute_layers")
                if k in tr]
    if tr.get("activation_offload_layers") and "training.activation_offload_layers" not in varied and (
            pp != 1 or schedule != "1f1b" or (recompute or tr.get("recompute", "none")) != "none"):
        out.append(("training.activation_offload_layers", None))  # (one stage without recompute only: config)
    return out


def values_of(row: dict[str, Any], par: dict[str, Any], tr: dict[str, Any]) -> dict[str, Any]:
    """A plan's values as the guide's options test them."""
    ch = row["changes"]
    get = lambda k, d: ch[k] if k in ch and ch[k] is not None else d  # noqa: E731
    return {"tp": get("parallel.tp", par.get("tp", 1)), "pp": get("parallel.pp", par.get("pp", 1)),
            "dp": get(DP, par.get("dp", 1)), "cp": get("parallel.cp", par.get("cp", 1)),
            "ep": get("parallel.ep", par.get("ep", 1)), "zero": get("parallel.zero", par.get("zero", 0)),
            "recompute": get("training.recompute", tr.get("recompute", "none"))}


def _zero3_microbatches(row: dict[str, Any], par: dict[str, Any], tr: dict[str, Any], mbs: int, gbs: int,
                        space: dict[str, list[Any]]) -> int | None:
    """The microbatches of a step of the plan ``row`` where it runs ZeRO-3 with more than one
    and the micro batch size is not searched: ZeRO-3 gathers every layer's weights again for
    each (unless kept gathered), so the option stands at the scenario's micro batch size, not at
    its best (docs/parallelism.md: Llama-2 70B's TP8 x DP8 ZeRO-3 4.505 s in microbatches of 8
    sequences, 10.762 s in microbatches of 1); else None."""
    v, ch = values_of(row, par, tr), row["changes"]
    m = (ch.get("training.global_batch_size") or gbs) // (v["dp"] * mbs)
    if v["zero"] != 3 or m <= 1 or "training.micro_batch_size" in space or par.get("zero3_keep_gathered"):
        return None
    return m


REFINE_WITHIN = 0.7  # coarse to fine: the shapes refined give at least this share of the best one's tokens/s


OFFLOAD = "training.optimizer_offload"


def run_advise(path: str, vary: list[tuple[str, list[Any]]] | None = None, *, jobs: int = 1, budget: int = 200,
               refine: int = 24, progress=None, prune: bool = True) -> dict[str, Any]:
    """:func:`search_plans`; where no plan it searched fits and the topology has a host to
    offload to (``node.host``), the search again with every plan's optimizer states in host
    memory (``training.optimizer_offload=1``, the rung below the guide's "few GPUs": full
    recompute and gradient accumulation), ``offload_fallback`` then saying how the first
    search ended. Not where ``vary`` sets the offload itself."""
    advice = search_plans(path, vary, jobs=jobs, budget=budget, refine=refine, progress=progress, prune=prune)
    if any(r.get("fits") for r in advice["plans"]) or OFFLOAD in dict(vary or []) or not _offloads(path):
        return advice
    again = search_plans(path, [*(vary or []), (OFFLOAD, [1.0])], jobs=jobs, budget=budget, refine=refine,
                         progress=progress, prune=prune)
    again["offload_fallback"] = {"searched": advice["searched"], "simulated": len(advice["ranking"])}
    return again


def _offloads(path: str) -> bool:
    """Whether a search with the optimizer offloaded may find what the scenario ``path``'s own
    search did not: it does not offload already (that search was the offloaded one), and it
    loads with ``training.optimizer_offload=1`` (a host to offload to, moments that allow it;
    the ZeRO stage aside, which the search varies)."""
    from .overrides import load_variant

    data = read_yaml(Path(path), what="scenario")
    if ((data.get("training") or {}).get("optimizer_offload") or 0) > 0:
        return False  # (offloaded already: the first search was the offloaded one)
    try:
        load_variant(path, [(OFFLOAD, 1.0), ("parallel.zero", 1)], data)
    except ConfigError:
        return False
    return True


# keys that change what the plans are for rather than the plan (each, and the keys under it):
# the search ranks plans for one model, cluster and batch against each other
NOT_PLANS = {"model": "the model", "cluster": "the cluster", "training.global_batch_size": "the batch"}


# the section that says how a plan is simulated (the network model, the collapse of symmetric
# ranks, the repeat, the collectives), not which plan it is
HOW_SIMULATED = "simulation"


def check_plan_keys(vary: list[tuple[str, list[Any]]]) -> None:
    """Refuse a varied key that changes the model, the cluster or the batch (:data:`NOT_PLANS`):
    its plans would be ranked against plans of another model or GPU (``--vary model.layers=3,4``
    ranked a 3-layer model's tokens/s against a 4-layer one's); and one that changes how the
    plans are simulated (:data:`HOW_SIMULATED`): plans simulated differently would be ranked
    against each other (``--vary simulation.network=ideal`` ranked the scenario's own plan, #1,
    on the file's flow network against the others on an ideal one)."""
    def under(key: str, section: str) -> bool:
        return key == section or key.startswith(f"{section}.")

    for key, _ in vary:
        what = next((w for k, w in NOT_PLANS.items() if under(key, k)), None)
        if what is not None:
            raise ConfigError(f"{key} changes {what}: advise ranks plans for the scenario's model, cluster and batch, "
                              "which it keeps (sweep varies any key)", source="command line", field="--vary")
        if under(key, HOW_SIMULATED):
            raise ConfigError(f"{key} changes how the plans are simulated, not the plan: advise ranks plans simulated "
                              "alike (its plan #1 keeps the file's setting); set it in the scenario file for every "
                              "plan (sweep --vary compares settings)", source="command line", field="--vary")


def search_plans(path: str, vary: list[tuple[str, list[Any]]] | None = None, *, jobs: int = 1, budget: int = 200,
                 refine: int = 24, progress=None, prune: bool = True) -> dict[str, Any]:
    """Search the plans for the scenario ``path`` (``vary``: dimensions replaced or added),
    simulate them and check the guide's rule; what advise.json holds.

    Every plan of the search is simulated where there are at most ``budget``. Past that,
    coarse to fine: each shape (every dimension but ZeRO and recompute) is simulated first
    with the settings that save the most memory (:func:`memory_settings`; a shape that does
    not fit with them fits with none), then with every other setting the shapes that fit and
    give at least REFINE_WITHIN of the best one's tokens/s, at most ``refine`` of them, and
    the best two of each of the guide's options (so that each option is judged at its best).
    ``prune``: plans certain not to fit in memory (``api.memory_floor``) are listed as such and
    not simulated, except the scenario's own."""
    from .config import load_scenario
    from .model.transformer import total_params

    data = read_yaml(Path(path), what="scenario")
    sc = load_scenario(path)
    vary = vary or []
    check_plan_keys(vary)
    check_keys(path, data, vary)
    if DP in dict(vary):
        raise ConfigError("advise lets dp follow the other degrees (GPUs / (tp x pp x cp)); vary those, or use sweep "
                          "to set dp yourself", source="command line", field="--vary")
    space = search_space(sc, data)
    for key, values in vary:
        space[key] = values
    for key in ("parallel.ep", "parallel.cp"):  # a dimension of one value not asked for: not shown
        if space.get(key) == [1] and key not in dict(vary):
            del space[key]
    if space.get("parallel.schedule") == ["1f1b"] and "parallel.schedule" not in dict(vary):
        del space["parallel.schedule"]
    varied = set(space)
    par, tr = data.get("parallel") or {}, data.get("training") or {}
    own = Plan(1, list(own_values(sc, space).items()) + [(DP, sc.parallel.dp)])  # the scenario's plan, as it is
    own_doc = _applied(path, data, own)
    first: list[Plan] = [own]
    rest: dict[int, tuple[dict[str, Any], list[dict[str, Any]]]] = {}
    for shape in shapes_of(space):
        settings = memory_settings(space, shape.get("parallel.pp", 1))
        plan = plan_of(sc, data, {**shape, **settings[0]}, len(first) + 1, varied)
        if plan is None:
            continue
        if _shards_nothing(path, data, plan):  # every ZeRO stage is the plan without ZeRO: that one, listed once
            offloaded = shape.get(OFFLOAD, (data.get("training") or {}).get("optimizer_offload"))
            settings = unsharded(settings, 1 if isinstance(offloaded, (int, float)) and offloaded > 0 else 0)
            plan = plan_of(sc, data, {**shape, **settings[0]}, len(first) + 1, varied)
        if own_doc is not None and _applied(path, data, plan) == own_doc:  # the scenario's plan: #1 stands for it
            rest[own.number] = (shape, settings)
            continue
        first.append(plan)
        rest[plan.number] = (shape, settings)
    if len(first) == 1:
        raise ConfigError(f"no plan of the search has degrees that multiply into the cluster's {sc.mesh.world_size:,} "
                          f"GPUs", source="command line", field="--vary")
    params = total_params(sc.model)
    node_tp = max(t for t in (1, 2, 4, 8) if t <= sc.topology.node.gpus)
    rule = guide_rule(params, sc.mesh.world_size, node_tp, moe=sc.model.moe is not None,
                      long_seq=sc.model.seq_len >= GUIDE_LONG_SEQ)
    number = len(first)
    # (the scenario's plan among a shape's other settings is #1, not one more plan)
    own_vals = dict(own.changes)
    again = own_doc is not None and any(
        _applied(path, data, plan_of(sc, data, {**shape, **x}, 0, varied)) == own_doc
        for shape, settings in rest.values() if all(own_vals.get(k) == v for k, v in shape.items())
        for x in settings[1:])
    searched = number + sum(len(x) - 1 for _, x in rest.values()) - again
    every = searched <= budget

    def more_of(ns) -> list[Plan]:
        nonlocal number
        out = []
        for n in ns:
            shape, settings = rest[n]
            for x in settings[1:]:
                plan = plan_of(sc, data, {**shape, **x}, number + 1, varied)
                if own_doc is None or _applied(path, data, plan) != own_doc:  # (the scenario's plan is #1 already)
                    number += 1
                    out.append(plan)
        return out

    def could_be(opt: Option, n: int) -> bool:  # whether some setting of shape n is one of opt's plans
        shape, settings = rest[n]
        return any(opt.test(values_of({"changes": dict(plan_of(sc, data, {**shape, **x}, 0, varied).changes)},
                                      par, tr)) for x in settings)

    rows: dict[int, dict[str, Any]] = {}
    with reused_clusters():  # (both rounds' plans on the file's cluster: built once)
        if every:
            simulate_plans(path, data, first + more_of(sorted(rest)), rows, jobs=jobs, progress=progress,
                           prune=prune, keep=own.number)
        else:
            simulate_plans(path, data, first, rows, jobs=jobs, progress=progress, prune=prune, keep=own.number)
            fit = [n for n in ranking(list(rows.values())) if rows[n].get("fits") and n in rest]
            pick = [n for n in fit if rows[n]["tokens_per_s"] >= REFINE_WITHIN * rows[fit[0]]["tokens_per_s"]][
                :refine] if fit else []
            for opt in rule.options:
                pick += [n for n in fit if n not in pick and could_be(opt, n)][:2]
            simulate_plans(path, data, more_of(sorted(pick)), rows, jobs=jobs, progress=progress, prune=prune)
    ordered = [rows[n] for n in sorted(rows)]
    _check_some_plan_passes(ordered, own.number, bool(vary), path)
    ranked = ranking(ordered)
    by_number = {r["plan"]: r for r in ordered}
    for r in ordered:
        if r["status"] in ("ok", "unfit"):
            v = values_of(r, par, tr)
            r["guide_options"] = [o.name for o in rule.options if o.test(v)]
    options = []
    mbs, gbs = sc.cfg.training.micro_batch_size, sc.cfg.training.global_batch_size
    for opt in rule.options:
        mine = [n for n in ranked if opt.name in by_number[n]["guide_options"]]
        fit = [n for n in mine if by_number[n]["fits"]]
        unfit = sum(1 for r in ordered if r["status"] == "unfit" and opt.name in r["guide_options"])
        options.append({"option": opt.name, "best": fit[0] if fit else None, "plans": len(mine) + unfit,
                        "least_gpus": opt.least_gpus,
                        "zero3_microbatches": _zero3_microbatches(by_number[fit[0]], par, tr, mbs, gbs, space)
                        if fit else None})
    return {"scenario": str(path), "params": params, "gpus": sc.mesh.world_size,
            "gpus_per_node": sc.topology.node.gpus, "guide": rule.says, "options": options, "vary": space,
            "kept": kept_levers(sc, space),
            "shapes": len(rest), "searched": searched, "coarse_to_fine": not every, "own_plan": 1, "dp_follows": True,
            "pruned": prune, "offload_fallback": None,
            "plans": ordered,
            "ranking": ranked}


def _check_some_plan_passes(rows: list[dict[str, Any]], own: int, varied: bool, path: str) -> None:
    """Refuse a search whose every plan but the scenario's own (``own``, kept as the file has
    it) the scenario's rules refuse (``--vary training.micro_batch_size=3`` against a batch of
    32, ``parallel.tp=16`` against 8 KV heads): nothing was searched, and an unfit plan #1
    would have the advice blame memory and search again with the optimizer offloaded. The
    commonest rule is named, with a plan it refused."""
    searched = [r for r in rows if r["plan"] != own]
    if not searched or any(r["status"] != "refused" for r in searched):
        return
    reasons = Counter(r["reason"] for r in searched)
    reason, n = reasons.most_common(1)[0]
    plan = next(r["plan"] for r in searched if r["reason"] == reason)
    others = (f"; the other {len(searched) - n:,} for {len(reasons) - 1} other reason{'s' if len(reasons) > 2 else ''}"
              if len(reasons) > 1 else "")
    raise ConfigError(f"the scenario's rules refuse every plan of the search ({len(searched):,} of {len(searched):,}): "
                      f"{n:,} for {reason} (plan #{plan}){others}",
                      source="command line" if varied else path, field="--vary" if varied else None)


def _applied(path: str, data: dict[str, Any], plan: Plan) -> dict[str, Any] | None:
    """The scenario ``plan`` makes of the file's ``data``, validated, every default filled in
    (None where its changes cannot be made or it breaks a rule): two plans that make the same
    one are one plan, simulated once (a file's ``sp: false`` and a plan's removal of it are
    one setting; so are no recompute and a selective one that recomputes nothing, under flash
    attention)."""
    from .config import ScenarioCfg
    from .overrides import apply_changes
    from .yamlio import validate

    try:
        cfg = validate(ScenarioCfg, apply_changes(data, plan.changes, source=path), source=path)
    except ConfigError:
        return None
    if cfg.training.recomputes_nothing:
        cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"recompute": "none",
                                                                                 "recompute_modules": None})})
    return cfg.model_dump(mode="json")


def format_advice(advice: dict[str, Any], top: int = 10) -> str:
    """The terminal's advice: the case and the guide's rule, the search, the best plans (each
    with the guide's option it is), each option at its best against the best plan, a verdict."""
    rows = {r["plan"]: r for r in advice["plans"]}
    ranked = advice["ranking"]
    n, done = len(rows), len(ranked)
    # (values as the table and --vary write them: true, not Python's True)
    dims = " · ".join(f"{k.rsplit('.', 1)[-1]} {','.join(map(cell_text, v))}" for k, v in advice["vary"].items())
    lines = [f"clustersim · advise {advice['scenario']}",
             f"{'case':<12}{advice['params'] / 1e9:,.1f}B parameters on {advice['gpus']:,} GPUs "
             f"({advice['gpus_per_node']} a node)",
             f"{'the guide':<12}" + " + ".join(f'"{x}"' for x in advice["guide"])
             + (" (513 to 1,024 GPUs: no rule of its own; its neighbours')" if advice["guide"][:2] == [UP_TO_512, OVER_1024]
                else f" (the case has {advice['gpus']:,} GPUs, not more than 8: the rule's options that need more "
                     "cannot be run)" if advice["gpus"] <= 8 and any(x.startswith(SIZE_RULE) for x in advice["guide"])
                else ""),
             f"{'searched':<12}{dims}; dp follows: {advice['shapes']:,} shape{'s' if advice['shapes'] != 1 else ''}"
             # (not every shape takes every setting: no ZeRO-3 with a pipeline, no ZeRO where nothing shards)
             + (f", each with the settings it takes (zero 0 where its shard groups are one GPU, no 3 with a "
                f"pipeline): {n:,} plans" if not advice["coarse_to_fine"] else
                f", {advice['searched']:,} plans; coarse to fine (each shape first with the settings that save the "
                f"most memory, then the fastest that fit with every other): {n:,} plans")
             + (f", {done:,} simulated" if done != n else "")]
    if kept := advice.get("kept"):
        lines.append(f"{'kept':<12}" + " · ".join(f"{k.rsplit('.', 1)[-1]} {cell_text(v)}" for k, v in kept.items())
                     + " as the scenario has them (--vary searches them)")
    if fb := advice.get("offload_fallback"):
        lines.append(f"{'':<12}(searched again with the optimizer states in host memory, optimizer_offload 1: none of "
                     f"the first search's {fb['searched']:,} plans fits with them on the GPUs)")
    best = rows[ranked[0]] if ranked and rows[ranked[0]]["fits"] else None
    # a plan's row with the settings it changes besides the columns (SP with TP, say): what a
    # run of it needs to give the same step
    notes = {}
    for p in ranked:
        options = "; ".join((["the scenario's plan"] if p == advice["own_plan"] else []) + rows[p]["guide_options"])
        more = also_set(advice, rows[p])
        notes[p] = " · ".join(x for x in (options, f"also {more}" if more else "") if x)
    lines += table_lines(advice, top, notes, "guide's option · also set", files="advise.json with --out",
                         refused_shown=3)
    lines.append("the guide's options, each at its best plan that fits:")
    width = max(len(o["option"]) for o in advice["options"])
    for o in advice["options"]:
        if o["best"] is None:
            least = o.get("least_gpus", 1)
            why = ("none fits" if o["plans"] else f"needs {least:,} GPUs or more, the case has {advice['gpus']:,}"
                   if advice["gpus"] < least else "not among the plans simulated")
            lines.append(f"  {o['option']:<{width}}  {why}")
            continue
        r = rows[o["best"]]
        gap = "" if best is None else (
            "the best plan found" if r["plan"] == best["plan"] else
            f"{100 * (1 - r['tokens_per_s'] / best['tokens_per_s']):.1f} % fewer tokens/s than #{best['plan']}")
        m = o.get("zero3_microbatches")
        regather = (f" (its ZeRO-3 gathers every layer again in each of its {m} microbatches: --vary "
                    "training.micro_batch_size tries fewer, larger ones)") if m and r["plan"] != (best or {}).get("plan") else ""
        lines.append(f"  {o['option']:<{width}}  #{r['plan']}: {r['tokens_per_s_per_gpu']:,.1f} tokens/s per GPU, "
                     f"{100 * r['mfu']:.1f} % MFU; {gap}{regather}")
    own = rows[advice["own_plan"]]
    if own["status"] == "ok":
        where = ""
        if best is not None:
            gain = best["tokens_per_s"] / own["tokens_per_s"] - 1
            where = ("the best plan found" if own["plan"] == best["plan"] else
                     f"the best plan found, #{best['plan']}, gives {100 * gain:.1f} % more tokens/s" if gain >= 0 else
                     f"the best plan found, #{best['plan']}, gives {-100 * gain:.1f} % fewer tokens/s, and fits")
        if not own["fits"] and best is not None and best["plan"] != own["plan"] and gain >= 0:
            # (its tokens/s are those it would give if it fit: the gain is over a plan that cannot run)
            where = f"if it did, the best plan found, #{best['plan']}, would still give {100 * gain:.1f} % more tokens/s"
        lines.append(f"{'your plan':<12}#{own['plan']}: {own['tokens_per_s_per_gpu']:,.1f} tokens/s per GPU"
                     + ("" if own["fits"] else " (does not fit)") + (f"; {where}" if where else ""))
    else:
        lines.append(f"{'your plan':<12}#{own['plan']}: {own['status']}: {own['reason']}")
    if best is None:
        lines.append(f"{'verdict':<12}no plan searched fits in memory")
    else:
        hits = [o for o in advice["options"] if o["best"] == best["plan"]]
        if hits:
            lines.append(f"{'verdict':<12}the best plan found, #{best['plan']}, is the guide's \"{hits[0]['option']}\"")
            # (what turns it: any plan that fits outside that option, would it lead)
            turning = [rows[p] for p in ranked if rows[p]["fits"] and hits[0]["option"] not in rows[p]["guide_options"]]
        else:
            good = [o for o in advice["options"] if o["best"] is not None]
            top_opt = max(good, key=lambda o: rows[o["best"]]["tokens_per_s"]) if good else None
            tail = (f"; the guide's best option, \"{top_opt['option']}\" (#{top_opt['best']}), gives "
                    f"{100 * (1 - rows[top_opt['best']]['tokens_per_s'] / best['tokens_per_s']):.1f} % fewer tokens/s"
                    if top_opt else "; none of the guide's options fits" if any(o["plans"] for o in advice["options"])
                    else "; none of the guide's options was among the plans simulated")
            lines.append(f"{'verdict':<12}the best plan found, #{best['plan']}, is none of the guide's options" + tail)
            turning = [rows[p] for p in ranked if rows[p]["fits"] and rows[p]["guide_options"]]  # (any option's)
        doubt = verdict_doubt(best, turning, advice["gpus"]) or close_call(best, turning)
        if doubt:
            lines.append(f"{'':<12}{doubt}")
        if caveat := zero2_under_pp(best, [rows[p] for p in ranked]):
            lines.append(f"{'':<12}{caveat}")
    return "\n".join(lines)


def _zero2_pp(row: dict[str, Any]) -> bool:
    """Whether a plan's row runs ZeRO-2 under a pipeline (its changes name both: every plan
    of the search sets the ZeRO stage and the pipeline's degree)."""
    ch = row["changes"]
    return ch.get("parallel.zero") == 2 and (ch.get("parallel.pp") or 1) > 1


def zero2_under_pp(best: dict[str, Any], ranked: list[dict[str, Any]]) -> str:
    """Where the best plan runs ZeRO-2 under a pipeline, that the common frameworks do not
    run it (docs/parallelism.md, the guide's rules: DeepSpeed's pipeline engine refuses
    ZeRO-2, Megatron-LM's distributed optimizer is ZeRO-1), and the best plan that fits
    without it; else "". The plan is simulated as FSDP's gradient sharding runs (each
    microbatch's gradients reduce-scattered), so its figures stand; whether it can be run is
    the user's framework's."""
    if not _zero2_pp(best):
        return ""
    alt = next((r for r in ranked if r["fits"] and not _zero2_pp(r)), None)
    tail = (f"; the best plan without it, #{alt['plan']}, {_behind(best, alt)}" if alt is not None
            else "; no plan without it fits")
    return (f"#{best['plan']} runs ZeRO-2 under a pipeline (its gradients reduce-scattered every microbatch, "
            f"simulated so), which DeepSpeed's pipeline engine refuses and Megatron-LM's distributed optimizer "
            f"(ZeRO-1) does not do{tail}")


def close_call(best: dict[str, Any], turning: list[dict[str, Any]]) -> str:
    """Where the verdict's steps are exact but a plan of ``turning`` (as :func:`verdict_doubt`
    reads it) gives less than CLOSE_LEAD fewer tokens/s than the best plan: the nearest such
    plan, that a lead so small is less than what the simulation leaves out may move
    (docs/metrics.md: no launches or framework; published A100 steps 1-14 % longer than
    simulated, H100 FP8 runs more), and both plans' peak memory,
    what else may choose between them. "" otherwise."""
    from .output.summary import CLOSE_LEAD, GiB

    close = [r for r in turning if _gap(best, r) < CLOSE_LEAD]
    if not close:
        return ""
    r = close[0]
    return (f"a close call: #{r['plan']} {_behind(best, r)}, less than what the simulation leaves out "
            f"(kernel launches, the framework) may move; #{r['plan']} peaks at {r['peak_bytes'] / GiB:.1f} GiB, "
            f"#{best['plan']} at {best['peak_bytes'] / GiB:.1f} of {best['capacity_bytes'] / GiB:.0f} GiB")


def verdict_doubt(best: dict[str, Any], turning: list[dict[str, Any]], gpus: int) -> str:
    """What the verdict adds where it may not hold: a plan of ``turning`` (those that would
    turn it, were they faster: any outside the guide's option the best plan is, or any of the
    guide's options where the best plan is none; fastest first) within CLOSE_LEAD of the best
    plan's tokens/s, where the best plan's step or that plan's is an estimate (the rows'
    ``estimate``): the nearest such plan, or the nearest of all where the best one's step is
    an estimate. "" otherwise."""
    from .output.summary import CLOSE_LEAD, estimates_clause

    close = [r for r in turning if _gap(best, r) < CLOSE_LEAD]
    rival = close[0] if close and best.get("estimate") else next((r for r in close if r.get("estimate")), None)
    if rival is None:
        return ""
    flagged = [r for r in (best, rival) if r.get("estimate")]
    return (f"the verdict may not hold: #{rival['plan']} {_behind(best, rival)}, and "
            + estimates_clause([f"#{r['plan']}" for r in flagged], [gpus] * len(flagged), settings=True))


def _gap(best: dict[str, Any], r: dict[str, Any]) -> float:
    """How far plan ``r`` is behind ``best``: the share fewer tokens/s (as the lines above give it)."""
    return 1 - r["tokens_per_s"] / best["tokens_per_s"]


def _behind(best: dict[str, Any], r: dict[str, Any]) -> str:
    """"is level with #B" (within 0.05 %), else "gives x % fewer tokens/s than #B"."""
    gap = _gap(best, r)
    return (f"is level with #{best['plan']}" if gap < 5e-4 else
            f"gives {100 * gap:.1f} % fewer tokens/s than #{best['plan']}")
