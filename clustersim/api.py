"""The Python API: ``load_scenario`` -> ``simulate`` -> ``Result`` (summary, trace, figure)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from .analysis.critical_path import critical_path, path_report
from .analysis.exposure import exposed_collectives
from .analysis.links import link_report
from .analysis.memory import PartStatic, StageStatic, host_report, memory_report
from .analysis.columns import TaskColumns
from .analysis.metrics import COMM_KINDS, step_metrics
from .config import Scenario, changed_topology_fields, every_rank_refusal, load_scenario
from .engine import Engine
from .engine import repeat as cycles
from .engine.ahead import Ahead
from .errors import ConfigError
from .floats import sum_left
from .hardware.topology import link_ceilings, network_figures
from .host_memory import check_fits, gpus_weigh_more, rank_by_rank_tasks
from .model.transformer import total_params
from .program.lower import Lowering, grad_buckets, lower
from .program.costs import HOST_STATE_BYTES
from .program.tasks import Program
from .program.work import PARAM_BYTES
from .schedule.core import split_weight_passes
from .schedule.pipeline import chunks_per_rank
from .trace import SpanBase, Trace


@dataclass
class Result:
    """One simulated step: ``summary`` (the summary.json contract) and the ``trace``."""

    scenario: Scenario
    trace: Trace
    summary: dict[str, Any]
    # the checks the writer of simulate(after_run=...) took: their violations, once it is done
    checks_left: Callable[[], list] | None = field(default=None, repr=False, compare=False)

    def finish_checks(self) -> None:
        """Raise :class:`~clustersim.analysis.invariants.InvariantError` if the checks that
        ``simulate``'s ``after_run`` writer took found violations; call it once that writer
        is done (``clustersim run``: after the files are written, before they are moved into
        place). Nothing to do when ``simulate`` made every check itself."""
        if self.checks_left is not None:
            from .analysis.invariants import InvariantError

            violations, self.checks_left = self.checks_left(), None
            if violations:
                raise InvariantError(violations)

    def __repr__(self) -> str:
        """One line, not the spans and the summary (a notebook cell ending in the result
        printed megabytes): the scenario's name and the step's headline figures."""
        s = self.summary
        return (f"Result({s.get('scenario')!r}: step {s['step_time_s']:.4g} s, {s['tokens_per_s']:,.0f} tokens/s, "
                f"MFU {100 * s['mfu']:.1f} %; {self.trace!r}; .summary, .trace, .figure())")

    def figure(self):
        """The report's plotly figure (Gantt timeline), for notebooks."""
        from .output.report import build_figure

        return build_figure(self.trace, self.summary)


def _part_static(low: Lowering, j: int) -> PartStatic:
    w = low.work[j]
    return PartStatic(
        part=j, params=w.local_params, expert_params=w.local_expert_params,
        activation_bytes_per_mb=w.activation_bytes_per_mb,
        wgrad_bytes_per_mb=w.wgrad_bytes_per_mb, recomputed_layers=w.recomputed_layers,
        recompute_bytes_per_mb=w.recompute_bytes_per_mb,
        layers=tuple(sorted({b.layer for b in w.fwd if b.layer >= 0})),
        # the embedding and the head, with the pieces a backward is cut into ("head wgrad")
        blocks=tuple(dict.fromkeys(b.name for b in (*w.fwd, *w.bwd, *w.bwd_input, *w.bwd_weight) if b.layer < 0)),
    )


def _split_w(low: Lowering, q: int) -> frozenset:
    """(index into pipeline rank ``q``'s parts, mb) of each split backward there: what its W
    reads is held from its B to its W (schedule.core.split_weight_passes)."""
    place = {j: i for i, j in enumerate(low.parts_of[q])}
    return frozenset((place[low.schedule.stage_part[k]], mb) for k, mb in split_weight_passes(low.schedule, q))


def _bucket_pair_params(low: Lowering, part: int) -> float:
    """ZeRO-2: the most parameters of two adjacent gradient buckets of ``part`` (one alone
    where it has one), dense and routed experts together, that reduce-scatter over a group of
    more than one (lower._reduce_action); 0.0 where none does. Without
    ``overlap_grad_reduce`` every bucket waits for the microbatch's last backward, so the
    part's whole gradient is held until the first reduce-scatter starts: all its buckets::

        overlapped      compute [B .............]        not   compute [B .............]
                        dp        [RS b0][RS b1]...            dp                       [RS b0][RS b1]...
        held whole      two buckets at most                    every bucket, then one fewer each
    """
    most = 0.0
    if low.n_grad < 2:  # (then neither is reduced: lower._reduce_action)
        return most
    for attr, on in (("params", True), ("expert_params", low.mesh.size(low.grad_dim("edp")) > 1)):
        if on:
            sizes = [p for _, p in grad_buckets(low.work[part].grad_blocks(low.split), low.dp_bucket_params, attr)]
            if not low.overlap_grad_reduce:
                most += sum_left(sizes)
            else:
                most += max((a + b for a, b in zip(sizes, sizes[1:])), default=max(sizes, default=0.0))
    return most


def _statics(low: Lowering) -> list[StageStatic]:
    """Static bytes per pipeline stage (all the parts it holds) by ZeRO stage, for Ψ local
    parameters and N = dp x cp, or the hybrid shard group (``parallel.zero_shard``)
    (Rajbhandari et al. 2020, Fig. 1, with g bytes per gradient)::

        ZeRO 0: 2Ψ + gΨ + 12Ψ     1: 2Ψ + gΨ + 12Ψ/N     2: 2Ψ + (g+12)Ψ/N     3: (2+g+12)Ψ/N
        (12: fp32 master weights and moments; 8 with bf16 moments, ``optimizer_moments_dtype``)

    Under ZeRO-3 the transient bytes add the gathered units in flight (16-bit) and, in the
    backward, one unit's whole gradient before its reduce-scatter (g bytes a parameter).
    Under ZeRO-2 they add two adjacent gradient buckets' whole gradients, the largest such
    pair: one reduce-scattering while the next fills (DeepSpeed's double-buffered ``ipg``
    buckets with ``overlap_comm``), g bytes a parameter; without ``overlap_grad_reduce`` the
    stage's whole gradient (gΨ), whose buckets all wait for the backward's end.
    ZeRO-3 with ``zero3_keep_gathered`` keeps the 16-bit parameters gathered (2Ψ) and, with
    several microbatches, reduce-scatters the gradients once after the last one, so they
    accumulate whole until then (gΨ): 2Ψ + gΨ + 12Ψ/N, as ZeRO-1.

    Routed-expert parameters Ψe (MoE) shard over the expert-DP group instead (N_e = N (tp/etp)
    / ep ranks hold the same expert slices; under hybrid sharding, where that group is not
    DP's, its slice, N_e = (tp/etp) dp x cp / (ep x replicas)): the same formulas with Ψe and
    N_e, e.g. 12Ψe/N_e under ZeRO-1.

    Optimizer offload (share f, ZeRO 1-3) keeps (1 - f) of the optimizer term on the GPU and
    puts 16 f Ψ/N in the host (``host_bytes``: fp32 master, m, v and the gradient buffer);
    activation offload adds what its layers keep for a microbatch's backward.
    """
    n, z = low.n_grad, low.zero
    n_e = low.mesh.size(low.grad_dim("edp"))
    out = []
    for q in range(low.mesh.pp):
        parts = tuple(_part_static(low, j) for j in low.parts_of[q])
        psi = sum_left(p.params for p in parts)
        psi_e = sum_left(low.work[j].local_expert_params for j in low.parts_of[q])
        transient = max(low.work[j].transient_bytes for j in low.parts_of[q])  # CP's K/V, one attention at a time
        sharded3 = z == 3 and not low.zero3_keep_gathered
        # gradients sharded as they are made (ZeRO-2, ZeRO-3), unless kept gathered over several
        # microbatches: reduced once, after the last one (lower._block_tasks's reduce_now)
        grads_sharded = z >= 2 and not (z == 3 and low.zero3_keep_gathered and len(low.schedule.paths) > 1)
        if z == 3:
            biggest = max((sum(p for _, p in v) for (j, _), v in low.unit_shards.items() if j in low.parts_of[q]),
                          default=0.0)
            if sharded3:  # gathered units in flight: the one computing plus those prefetched, or a
                # uniform recompute group's layers, gathered for its forwards and held through
                # their backwards; as far as an action has units (a part's layers, its embedding or head)
                units = max(sum(1 for (j, _) in low.unit_shards if j == k) for k in low.parts_of[q])
                group = max((len(g) for j in low.parts_of[q] for g in low.work[j].recompute_groups), default=1)
                transient += min(max(low.zero_prefetch_layers + 1, group), units) * biggest * PARAM_BYTES
            if grads_sharded:  # in the backward, the computing unit's whole gradient until its reduce-scatter
                transient += biggest * low.grad_bytes
        elif z == 2:
            transient += low.grad_bytes * max(_bucket_pair_params(low, j) for j in low.parts_of[q])
        shard = psi / (n if z >= 1 else 1) + psi_e / (n_e if z >= 1 else 1)  # the optimizer's, per GPU
        out.append(StageStatic(
            stage=q, params=psi + psi_e,
            param_bytes=PARAM_BYTES * (psi / (n if sharded3 else 1) + psi_e / (n_e if sharded3 else 1)),
            grad_bytes=low.grad_bytes * (psi / (n if grads_sharded else 1) + psi_e / (n_e if grads_sharded else 1)),
            optimizer_bytes=low.optimizer_bytes * (1 - low.optimizer_offload) * shard,
            # (activation offload: one microbatch's offloaded layers, one microbatch at a time on one stage)
            host_bytes=HOST_STATE_BYTES * low.optimizer_offload * shard
            + sum_left(x for j in low.parts_of[q] for _, x, _ in low.work[j].offload_acts),
            activation_bytes_per_mb=max(p.activation_bytes_per_mb for p in parts),
            transient_bytes=transient,
            parts=parts,
            split_w=_split_w(low, q),
        ))
    return out


def _host(sc: Scenario, low: Lowering, statics: list[StageStatic]) -> dict | None:
    """The nodes' host memory under optimizer or activation offload (``analysis.memory.host_report``),
    None without."""
    if not any(st.host_bytes for st in statics):
        return None
    return host_report(statics, low.mesh.coord_array("pp"), sc.cluster.gpus_per_node,
                       sc.topology.node.host.memory_GB * 1e9)


def memory_floor(sc: Scenario) -> dict[str, Any]:
    """The least peak memory per GPU the step can have, known before any task is made: for
    each pipeline stage (``_statics`` of the lowering before its passes; its schedule row in
    issue order, ``analysis.memory.activation_floor_bytes``)::

        floor           =  params + grads + optimizer  +  activation floor          +  transient
        simulated peak  =  params + grads + optimizer  +  max_t (act + buf + rec)  +  transient
                        >= floor

    ``fits`` false means no simulation of the plan can fit (advise leaves such plans out), on
    the GPUs or, under optimizer or activation offload, in a node's host memory (which the run does not change).
    {"peak_bytes": the highest stage's floor, "stage": that stage, "capacity_bytes", "fits",
    "host": the nodes' host memory under offload (``analysis.memory.host_report``) or None}.
    The lowering it reads stays on ``sc`` for :func:`simulate`'s to start from
    (``lower.FLOOR_LOWERING``): sweep and advise weigh each plan's floor, then simulate it."""
    from .analysis.memory import activation_floor_bytes
    from .program.lower import FLOOR_LOWERING, lowering

    low = sc.__dict__[FLOOR_LOWERING] = lowering(sc, collapse=True)  # (9-18 ms a plan)
    s = low.schedule
    best = None
    statics = _statics(low)
    for st in statics:
        place = {j: i for i, j in enumerate(low.parts_of[st.stage])}
        act = activation_floor_bytes(s.actions[st.stage], lambda k: place[s.stage_part[k]],
                                     [p.activation_bytes_per_mb for p in st.parts],
                                     [p.wgrad_bytes_per_mb for p in st.parts], st.split_w)
        floor = st.param_bytes + st.grad_bytes + st.optimizer_bytes + act + st.transient_bytes  # (as memory_report adds)
        if best is None or floor > best[0]:
            best = (floor, st.stage)
    capacity = sc.cluster.gpu.hbm_capacity_bytes
    host = _host(sc, low, statics)
    return {"peak_bytes": best[0], "stage": best[1], "capacity_bytes": capacity,
            "fits": best[0] <= capacity and (host is None or host["fits"]), "host": host}


def projection(sc: Scenario, tokens_per_s: float) -> dict[str, Any]:
    """A whole run at this step's speed (``projection`` of the scenario)::

        steps      = tokens / tokens per step
        days       = tokens / tokens_per_s / 86400
        gpu_hours  = world size * days * 24
        cost_usd   = gpu_hours * usd_per_gpu_hour                    (None without a price)
        energy_MWh = gpu_hours * GPU board power (TDP) * PUE / 1e6   (at TDP: an upper bound
                     for the GPUs, which rarely all draw their limit; hosts and network excluded)
    """
    pj = sc.cfg.projection
    world, gpu = sc.mesh.world_size, sc.cluster.gpu
    seconds = pj.tokens / tokens_per_s if tokens_per_s > 0 else float("inf")
    gpu_hours = world * seconds / 3600
    return {
        "tokens": pj.tokens,
        "steps": pj.tokens / sc.tokens_per_step,
        "days": seconds / 86400,
        "gpu_hours": gpu_hours,
        "cost_usd": None if pj.usd_per_gpu_hour is None else gpu_hours * pj.usd_per_gpu_hour,
        "energy_MWh": gpu_hours * gpu.tdp_W * pj.pue / 1e6,
        "gpu_power_W": gpu.tdp_W,
        "pue": pj.pue,
    }


def summarize(sc: Scenario, low: Lowering, trace: Trace, prog: Program, engine: Engine | None = None, *,
              keep_columns: bool = False, links: Callable[[], list] | None = None,
              brief: bool = False) -> dict[str, Any]:
    """Assemble summary.json: metrics, memory, the critical path, exposed communication by
    cause, the resolved plan and what was simulated. ``engine`` (the one that ran ``prog``)
    names the links that bounded exposed collectives. The trace's columnar view the summary
    is made from is dropped at the end (its arrays are large), unless ``keep_columns``.
    ``links``: gives the trace's link use (``Trace.links``, else already there), asked for
    once everything else is worked out (``clustersim run``'s writer works it out meanwhile).
    ``brief``: without the critical path, the causes of exposed communication and the link
    use (null), what a sweep's plans do not show (the rest is the same)."""
    gpu = sc.cluster.gpu
    peak = gpu.peak_flops(sc.training.precision)
    changes = changed_topology_fields(sc.cfg.cluster, sc.topology._file_data)
    world = sc.mesh.world_size
    metrics = step_metrics(trace, world_size=world, peak_flops=peak, tokens_per_step=sc.tokens_per_step)
    p, t = sc.parallel, sc.training
    statics = _statics(low)
    summary = {
        "scenario": sc.cfg.name,
        "description": sc.cfg.description,
        "world_size": world,
        **metrics,
        "memory": memory_report(trace, statics, gpu.hbm_capacity_bytes, _host(sc, low, statics)),
        "critical_path": None if brief else path_report(critical_path(prog, trace), metrics["step_time_s"]),
        "exposed_comm_causes": None if brief else exposed_collectives(prog, trace, engine, sc.cluster),
        "links": None,  # filled in last, in this place (see ``links``)
        "projection": projection(sc, metrics["tokens_per_s"]),
        "plan": {
            "tp": p.tp, "pp": p.pp, "dp": p.dp, "cp": p.cp, "cp_comm": p.cp_comm, "cp_a2a": p.cp_a2a,
            "cp_load_balance": p.cp_load_balance, "schedule": p.schedule, "vpp": p.vpp,
            "vpp_group": p.vpp_group, "order": p.order,
            "micro_batch_size": t.micro_batch_size, "global_batch_size": t.global_batch_size,
            "microbatches": sc.microbatches, "layers_per_stage": sc.layers_per_stage,
            "precision": t.precision, "fp8_recipe": t.fp8 or None,
            "attention": t.attention, "sp": p.sp,
            # (where it scatters anything, as work.stage_work decides: not under SP, TP1 or PP1)
            "pp_scatter_gather": any(w.pp_gather_bytes > 0 for w in low.work),
            "tp_comm_overlap": p.tp_comm_overlap, "ep": p.ep, "etp": p.expert_tp, "ep_comm_overlap": p.ep_comm_overlap,
            "zero": p.zero,
            "zero3_keep_gathered": p.zero3_keep_gathered, "overlap_param_gather": p.overlap_param_gather,
            "overlap_grad_reduce": p.overlap_grad_reduce,
            "zero_shard": p.zero_shard,
            "optimizer_offload": t.optimizer_offload, "overlap_offload_copies": t.overlap_offload_copies,
            "activation_offload_layers": t.activation_offload_layers,
            "recompute": t.recompute, "recompute_method": t.recompute_method, "recompute_layers": t.recompute_layers,
            "recompute_modules": sorted(t.selective_modules) or None,
            "grad_dtype": t.grad_dtype,
            "grad_reduce_dtype": t.reduced_grad_dtype,
            "tp_nodes": sc.mesh.nodes_spanned("tp", sc.topology.node.gpus),
            "ep_nodes": sc.mesh.nodes_spanned("ep", sc.topology.node.gpus),
            "dispatcher": sc.model.moe.dispatcher if sc.model.moe is not None else None,
            "deepep_sms": sc.model.moe.deepep_sms if sc.model.moe is not None and sc.model.moe.dispatcher == "deepep"
            else None,
            "fp8_dispatch": sc.model.moe.fp8_dispatch if sc.model.moe is not None else None,
            "shared_expert_overlap": sc.model.moe.shared_expert_overlap if sc.model.moe is not None else None,
            "parts_per_stage": [list(low.parts_of[q]) for q in range(sc.mesh.pp)],
        },
        "model": {"name": sc.model.name, "params": total_params(sc.model), "layers": sc.model.layers,
                  "hidden": sc.model.hidden,
                  "seq_len": sc.model.seq_len, "mtp_layers": sc.model.mtp_layers,
                  "attention": "mla" if sc.model.mla else "gqa" if sc.model.n_kv_heads < sc.model.heads else "mha"},
        "hardware": {"gpu": gpu.name, "peak_flops": peak, "hbm_capacity_bytes": gpu.hbm_capacity_bytes,
                     "topology": sc.topology.name, "nodes": sc.topology.nodes,
                     "gpus_per_node": sc.topology.node.gpus, "changes": changes,
                     "nvlink_kept": _nvlink_kept(sc, changes),
                     "link_ceilings": link_ceilings(sc.topology), "network": network_figures(sc.topology),
                     "host": sc.topology.node.host.model_dump() if sc.topology.node.host is not None else None,
                     # the faults and stragglers, the topology file's and the scenario's, as given
                     "what_if": [w.model_dump(exclude_none=True) for w in sc.topology.what_if] or None},
        "simulation": {"network": sc.cfg.simulation.network,
                       "collapse_symmetric": len(trace.ranks) < world,
                       "split_replicas": sc.splits_replicas and len(trace.ranks) < world,
                       "simulated_ranks": len(trace.ranks), "spans": trace.n_spans,
                       "collective_algorithms": trace.algorithms, "repeat": trace.repeat,
                       "repeat_tried": trace.repeat_tried, "fabric_faults": _fabric_faults(sc, trace, world),
                       "leaf_split": _leaf_split(sc, low, trace, world),
                       "asymmetric_orbits": _in_kind_order(trace.asymmetric_orbits),
                       "collective_fallbacks": collective_fallbacks(sc.cfg.simulation.collectives, trace.algorithms),
                       "simulated_rank_of_gpu": list(trace.rep) if trace.rep is not None else None},
    }
    if links is not None:
        trace.links = links()
    # where the classes split a stage, the link use counts every real flow on every link
    # already (Program.split_stage): no GPU's links are copied from another's
    copied = () if prog.split_stage else (sc.cluster.owned_links, sc.cluster.own_nic_links)
    summary["links"] = None if brief else link_report(trace, metrics["step_time_s"], *copied)
    # the parts above shared the trace's columnar view (Trace.columns); unless the caller
    # reads it next (simulate's invariant checks), its arrays go now
    if not keep_columns:
        trace.drop_columns()
    return summary


def _in_kind_order(counts: dict[str, int]) -> dict[str, int] | None:
    """``counts`` by communication kind in the summary's order of kinds (COMM_KINDS: tp, cp,
    ep, pp, dp), or None where there are none."""
    rank = {k: i for i, k in enumerate(COMM_KINDS)}
    return {k: counts[k] for k in sorted(counts, key=lambda k: (rank.get(k, len(rank)), k))} or None


def collective_fallbacks(asked, used: dict[str, dict[str, int]]) -> dict | None:
    """``simulation.collective_fallbacks``: per collective whose algorithm the scenario names
    (``simulation.collectives``, not auto), where that one could not run some groups (tree or
    hierarchical inside one node, NVLS across nodes), what ran them instead and how many
    communications of the simulated ranks each; null when none fell back::

        asked all_reduce: tree    used {ring: 20608, tree: 84}    ->    {all_reduce: {asked: tree,
                                                                          ran: {ring: 20608}, of: 20692}}
    """
    out = {}
    for op, algo in asked.model_dump().items():
        per = used.get(op) or {}
        ran = {a: n for a, n in per.items() if a != algo}
        if algo != "auto" and ran:
            out[op] = {"asked": algo, "ran": ran, "of": sum(per.values())}
    return out or None


def _fabric_faults(sc: Scenario, trace: Trace, world: int) -> dict | None:
    """``simulation.fabric_faults``: how many GPUs the faults reach through the fabric
    (below a fabric fault, or on any node beside slowed flows) besides those a faulty cable
    of their own node splits anyway, whether the collapse kept them (their split would
    simulate more ranks than ``simulation.fabric_fault_split_ranks``), how many ranks that
    split would have simulated, that setting, and whether the GPUs the faults reach on any
    node were asked at all (null: no fault, or the faults reach none and were asked)."""
    faults = sc.cluster.fault_cables or sc.cluster.fabric_fault_cables
    gpus = (sc.fabric_touched_gpus | sc.reached_gpus) - sc.node_touched_gpus
    if not faults or (not gpus and sc.reach_asked):
        return None
    kept = sc.split_faults[1] if len(trace.ranks) < world else 0
    return {"gpus": len(gpus), "kept_in_collapse": kept > 0, "split_ranks": kept or None,
            "split_up_to": sc.cfg.simulation.fabric_fault_split_ranks, "reach_asked": sc.reach_asked}


def _leaf_split(sc: Scenario, low: Lowering, trace: Trace, world: int) -> dict | None:
    """``simulation.leaf_split``: where the edges of the fabric's leaf groups or pods cut the
    plan's groups or pipeline routes unevenly in a collapsed run, the ranks a split by them
    simulates, whether the collapse kept them instead (the split would add more ranks than
    ``simulation.leaf_split_ranks``) and that setting (null: no such cut, or every rank
    simulated; program/lower.py ``Symmetry._unit_split``)."""
    n = low.sym.unit_split
    if not n or len(trace.ranks) >= world:
        return None
    return {"ranks": n, "kept_in_collapse": low.sym.unit_split_kept,
            "split_up_to": sc.cfg.simulation.leaf_split_ranks}


def simulate(scenario: Scenario | str | Path | dict, *, collapse: bool | None = None,
             repeat: bool | None = None, check: bool = True,
             after_run: Callable[[Trace, Callable[[], list] | None, Callable[[], list] | None], Any] | None = None,
             keep: list | None = None, fork: bool = False, brief: bool = False) -> Result:
    """Simulate one training step of ``scenario`` (a Scenario, a YAML path or a dict).

    ``collapse``, ``repeat``: override ``simulation.collapse_symmetric`` and ``simulation.repeat``.
    ``check``: verify the step's invariants (docs/invariants.md) and raise
    :class:`~clustersim.analysis.invariants.InvariantError` listing any violation.
    ``after_run``: called as soon as the engine has run, before the summary is worked out
    (``clustersim run`` starts writing the trace file and the report then,
    clustersim.output.background), with the trace, which has no ``links`` yet, the function
    that works them out (``Engine.link_use``; None where another process works them out
    already: ``fork``) and, with ``check``, the function that runs the
    checks that need no summary (``invariants.check_trace``; None without ``check``). It may
    return an object that works on them elsewhere meanwhile (:class:`Elsewhere`): the summary
    asks it for the link use last (else works it out here, then), and once the summary is
    made, whether it took the checks (else they are run here); if it did, the summary's own
    checks are run here and the rest is judged by :meth:`Result.finish_checks`.
    ``keep``: a list the step's working objects (program, lowering, engine) are appended to
    rather than freed when this returns (``clustersim run`` leaves them to the process's
    exit: freeing Megatron-1T's 854,340 tasks one by one takes 0.18 s).
    ``fork``: where a shorter step is simulated and its cycle copied in, simulate it in a
    forked process while this one lowers the whole step (clustersim.engine.ahead;
    ``clustersim run`` does, with the whole step's schedule left unchecked by
    ``load_scenario(check_schedule=False)`` until then): the same result, sooner on two
    cores.
    ``brief``: a summary without the critical path, the causes of exposed communication and
    the link use (null; not worked out): ``sweep`` and ``advise`` show none of them, and each
    plan takes less time (Llama-2 70B on 64 GPUs: about a third less)."""
    for name, flag, none_too in (("collapse", collapse, True), ("repeat", repeat, True), ("check", check, False),
                                 ("fork", fork, False), ("brief", brief, False)):
        if not (isinstance(flag, bool) or none_too and flag is None):  # ("False", a string, would read as true)
            also = " or None (as the scenario says)" if none_too else ""
            raise TypeError(f"simulate's {name} is True or False{also}, not {flag!r}")
    sc = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    repeat = sc.cfg.simulation.repeat if repeat is None else repeat
    every_rank = "collapse=False" if collapse is False else \
        None if collapse or sc.cfg.simulation.collapse_symmetric else "simulation.collapse_symmetric"
    if every_rank:
        _check_every_rank(sc, every_rank)
    with no_cyclic_gc(), _ahead(sc, collapse, repeat, fork) as ahead:
        sc.check_schedule()  # (where load_scenario left it: the child needs no whole schedule)
        prog, low = lower_step(sc, collapse, repeat)
        _check_fits(sc, prog, every_rank)
        engine, trace, extra, links_ahead = _run(sc, prog, collapse, links=after_run is None and not brief,
                                                 repeat=repeat, low=low, ahead=ahead, check=check)
        _check_step_length(sc, trace.end_s)
        link_use = links_ahead or engine.link_use
        links = elsewhere = None
        if after_run is not None:
            # the link use only now: the summary reads it (last), the files written from here
            # do not
            elsewhere = after_run(trace, None if links_ahead else engine.link_use,
                                  partial(check_trace, prog, trace) if check else None)

            def links() -> list:
                got = elsewhere.links() if elsewhere is not None else None
                return got if got is not None else link_use()
        summary = summarize(sc, low, trace, prog, engine, keep_columns=check, links=links, brief=brief)
        result = Result(scenario=sc, trace=trace, summary=summary)
        if check:
            result.checks_left = check_step(prog, trace, summary, elsewhere)
        if keep is not None:
            keep += (prog, low, engine, *extra)
    return result


MAX_STEP_S = 1e9  # about 32 years; the trace file counts nanoseconds in 64 bits (292 years)


def _check_step_length(sc: Scenario, step_s: float) -> None:
    """Refuse a step that runs past :data:`MAX_STEP_S` (or not to a finite end): no plan trains
    at that pace, and its times would not fit the trace file. Bounded inputs can still
    multiply to it (a huge model on a slow, degraded cluster)."""
    if not step_s <= MAX_STEP_S:
        # a what-if that slows the cluster is the likelier cause where the scenario has one
        what_if = bool(sc.cfg.cluster.what_if)
        raise ConfigError(f"the simulated step lasts {step_s:.3g} s, more than {MAX_STEP_S:.0e} s (about "
                          f"{MAX_STEP_S / 3.156e7:.0f} years): a model this large on a cluster this slow is no "
                          f"plan to simulate; "
                          + ("ease the what-ifs' slowdowns and bw_factors, or " if what_if else "")
                          + "shrink the model or the batch (training.micro_batch_size, training.global_batch_size), "
                          "or raise the bandwidths and efficiencies",
                          source=sc.source, field="cluster.what_if" if what_if else "model")


def _check_every_rank(sc: Scenario, field: str) -> None:
    """Refuse every rank of ``sc`` simulated (``field``: what asked for it) past the all-ranks
    limit, or where the machine has too little memory for it, before anything is lowered:
    the step's tasks are counted on the collapsed program (host_memory.rank_by_rank_tasks)."""
    world = sc.mesh.world_size
    why = every_rank_refusal(world)  # (load_scenario refused it already for collapse_symmetric: false)
    if why:
        raise ConfigError(why, source=sc.source, field=field)
    prog, _ = lower(sc, collapse=True)
    check_fits(rank_by_rank_tasks(prog), world, f"simulating every one of the {world:,} ranks",
               f"leave the symmetric collapse on ({len(prog.ranks):,} ranks simulated, exact on symmetric "
               f"placements) or use a machine with more memory", source=sc.source, field=field)


def _nvlink_kept(sc: Scenario, changes: dict[str, Any] | None) -> dict[str, float] | None:
    """Where the scenario swaps the topology's GPUs (``cluster.gpu``) and keeps the NVLink rate
    the topology file sets, which is not the new GPU's own (B200s in a DGX H100 node: 450 GB/s,
    not NVLink 5's 900): both rates, per GPU per direction, so that the outputs say which the
    step ran at; else None. The node is the topology's: its NVSwitch stays, whatever GPUs it
    holds, unless ``cluster.node.nvlink.bw_GBps`` changes it too (``changes``: the scenario's
    changes of its topology, ``hardware.changes``). A ``cluster.gpu`` that names the
    topology's own GPU (by any of its names) swaps nothing, and ``changes`` leaves it out: the
    rate is the file's own choice."""
    kept = sc.topology.node.nvlink.bw_GBps
    if "gpu" not in (changes or {}) or not kept or "node.nvlink.bw_GBps" in changes:
        return None
    own = sc.cluster.gpu.nvlink_bw_Bps / 1e9
    return None if own == kept else {"bw_GBps": kept, "gpu_bw_GBps": own}


def _check_fits(sc: Scenario, prog: Program, every_rank: str | None) -> None:
    """Refuse the lowered ``prog`` where the machine has too little memory to simulate it
    (host_memory.check_fits), naming what made it so large. Every rank simulated was weighed
    before it was lowered (:func:`_check_every_rank`, on the same count of tasks)."""
    if every_rank:
        return
    gpus = sc.mesh.world_size
    if gpus_weigh_more(len(prog.items), gpus):
        what, field = f"a cluster of {gpus:,} GPUs", "cluster.nodes"
        remedy = "simulate fewer nodes, or use a machine with more memory"
    elif sc.splits_replicas:
        what, field = f"each DP replica apart, {len(prog.ranks):,} simulated ranks", "simulation.split_replicas"
        remedy = "leave it false, or use a machine with more memory"
    elif sc.cluster.gpu_slowdown or sc.split_faults[0]:
        what, field = f"the what-ifs' split into {len(prog.ranks):,} simulated ranks", "cluster.what_if"
        remedy = "use fewer stragglers or faults, or a machine with more memory"
    elif sc.cfg.ranks_differ()[1]:
        what, field = f"the skewed expert load's {len(prog.ranks):,} simulated ranks", "model.moe.ep_load"
        remedy = "leave the load even, or use a machine with more memory"
    else:
        what, field = f"the step of {sc.schedule.n_microbatches:,} microbatches", "training.global_batch_size"
        remedy = "use fewer microbatches, or a machine with more memory"
    check_fits(len(prog.items), gpus, what, remedy, source=sc.source, field=field)


class Elsewhere(Protocol):
    """What ``simulate``'s ``after_run`` may return: work done in another process while the
    summary is made (``clustersim run``'s writer, clustersim.output.background.Writer)."""

    def links(self) -> list | None:
        """The trace's link use, worked out there (None: not, work it out here)."""

    def checks_taken(self) -> bool:
        """Whether it took the checks that need no summary (asked once, after the summary)."""

    def checks_verdict(self) -> list | None:
        """Once it is done: the violations its checks found (None: it did not say)."""


def check_step(prog: Program, trace: Trace, summary: dict[str, Any],
               elsewhere: Elsewhere | None = None) -> Callable[[], list] | None:
    """The step's invariant checks (docs/invariants.md), on the view the summary was made
    from (the spans have not changed since; the checks drop it when done): raises
    InvariantError on a violation found here. Where ``elsewhere`` took the checks that need
    no summary, only the summary's are made here, and the function returned gives the
    others' violations once it is done (run here after all if it did not say)."""
    from .analysis.invariants import InvariantError, check_invariants, check_summary

    cols = trace.columns()
    if elsewhere is not None and elsewhere.checks_taken():
        left = partial(_verdict, elsewhere, prog, trace)
        violations = check_summary(trace, summary, cols)
    else:
        left, violations = None, check_invariants(prog, trace, summary, cols=cols)
    if violations:
        raise InvariantError(violations)
    return left


def _verdict(elsewhere: Elsewhere, prog: Program, trace: Trace) -> list:
    """The violations of the checks ``elsewhere`` took, or those checks run here if it did not say."""
    got = elsewhere.checks_verdict()
    return got if got is not None else check_trace(prog, trace)


def check_trace(prog: Program, trace: Trace) -> list:
    """The invariant checks that need no summary (:func:`clustersim.analysis.invariants.check_trace`),
    on the trace's view of its spans (which they first check against the spans): the
    function ``simulate`` hands ``after_run``."""
    from .analysis.invariants import check_trace as checked

    return checked(prog, trace, trace.columns())


def _engine_of(sc: Scenario, program: Program) -> Engine:
    """An engine set up for ``program`` on ``sc``'s cluster, with its network and algorithms."""
    sim = sc.cfg.simulation
    return Engine(program, sc.cluster, sim.network, sim.collectives.model_dump())


def _run(sc: Scenario, prog: Program, collapse: bool | None, links: bool, repeat: bool = True,
         mark: Callable[[str], None] | None = None, low: Lowering | None = None,
         ahead: Ahead | None = None, check: bool = True) -> tuple[Engine, Trace, tuple, Callable[[], list] | None]:
    """(the engine, the step's trace, the working objects of a shorter run, the function
    that gives the link use where another process works it out, else None): ``prog`` run
    whole, or, with ``repeat`` where a 1F1B, interleaved, ZB-H1, ZB-V, DualPipeV or DualPipe
    step is long enough and its cycle is found, fewer of its microbatches run and the cycle copied in
    (:mod:`clustersim.engine.repeat`).
    ``low``: ``prog``'s lowering, whose plan-wide parts the shorter step's reuses.
    ``ahead``: the process that simulated the shorter step meanwhile, if any
    (:mod:`clustersim.engine.ahead`): its spans and cycle are spliced here, on an engine set
    up for the shorter step that does not run; where it failed, the run is made here. While it
    runs, the task columns the splice, the summary and (with ``check``) the checks read are
    worked out (:func:`_warm`).
    ``mark`` (the bench scripts) is called at the end of each phase: "lowered" (the shorter
    step; at once when there is none), "set_up", "ran", "spliced" (when there was one; where
    no cycle held, "set_up" and "ran" again for the whole step)."""
    mark = mark or (lambda _: None)
    shorter = shorter_step(sc, repeat)
    short = None if shorter is None else shorter.microbatches
    if shorter is not None:
        sprog, slow = lower(shorter, collapse=collapse, like=low)
        mark("lowered")
        engine = _engine_of(sc, sprog)
        mark("set_up")
        tasks = TaskColumns(sprog.items, sprog.runs, sprog), TaskColumns(prog.items, prog.runs, prog)
        base, rep, longer, from_child = _spans_and_cycle(sc, engine, ahead, tasks, check)
        mark("ran")
        trace = None if rep is None else _spliced(engine, base, rep, *tasks, prog)
        mark("spliced")
        links_ahead = None
        if from_child:
            # (before the writer's fork: engine.ahead's module docstring)
            ahead.step_end(None if trace is None else engine.step_s)
            if trace is not None:
                links_ahead = partial(_links_ahead, ahead, engine, rep)
        if trace is None and longer is not None:
            again = _again(sc, prog, collapse, longer, tasks[1], low)
            if again is not None:
                engine, trace, sprog, slow = again
                short = trace.repeat["simulated_microbatches"]
        if trace is not None:
            trace.repeat_tried = short
            if links:
                trace.links = (links_ahead or engine.link_use)()
            return engine, trace, (sprog, slow), links_ahead
    else:
        mark("lowered")
    engine = _engine_of(sc, prog)
    mark("set_up")
    trace = engine.run(links=links)
    trace.repeat_tried = short  # None: not tried; else no cycle held in it
    mark("ran")
    return engine, trace, (), None


def _again(sc: Scenario, prog: Program, collapse: bool | None, cycle_mb: int,
           full_tasks: TaskColumns, low: Lowering | None = None) -> tuple[Engine, Trace, Program, Lowering] | None:
    """A second shorter step where the first held a cycle of ``cycle_mb`` microbatches that
    its left-out microbatches are no multiple of (:func:`clustersim.engine.repeat.longer_cycle`):
    ``m - n C`` microbatches (:func:`~clustersim.engine.repeat.again_microbatches`), lowered
    with ``low``'s per-part work, symmetry and communication specs (``prog``'s lowering; its
    units in common are not copied: they part from the whole step's elsewhere than the first
    shorter step's), run here, that cycle found again and copied in; (its engine, the spliced
    trace, its program and lowering), or None where it does not hold::

        first   m' = m - 12 n     no cycle among 1, 2, 3, 4, 6, 12; two windows of C held
        second  m'' = m - C n''   >= m' + C, three windows of C checked, copied in n'' times

    Tried only where m' + m'' < m: both tries together simulate less than the whole step.
    ``repeat_tried`` then says m'' (the summary's ``simulation.repeat`` the cycle)."""
    first = shorter_step(sc).microbatches
    m = cycles.again_microbatches(sc.microbatches, first, cycle_mb)
    if m is None or first + m >= sc.microbatches:  # (both tries would simulate more than the whole)
        return None
    again = with_microbatches(sc, m)
    sprog, slow = lower(again, collapse=collapse, like=low)
    engine = _engine_of(sc, sprog)
    base, rep, _ = _cycle(sc, engine, engine.run(links=False), again, [cycle_mb])
    if rep is None:
        return None
    trace = _spliced(engine, base, rep, TaskColumns(sprog.items, sprog.runs, sprog), full_tasks, prog)
    return None if trace is None else (engine, trace, sprog, slow)


def _spans_and_cycle(sc: Scenario, engine: Engine, ahead: Ahead | None, tasks: tuple[TaskColumns, TaskColumns],
                     check: bool) -> tuple[SpanBase | None, cycles.Repeat | None, int | None, bool]:
    """(the shorter step's spans, its cycle, a longer cycle's length where none held
    (:func:`_cycle`), whether they came from ``ahead``'s child): from
    the child, the task columns ``tasks`` worked out while it runs (:func:`_warm`); else from
    ``engine``'s run of the shorter step, made here (no child, or it failed)."""
    if ahead is not None and ahead.running:
        _warm(*tasks, check)
    got = ahead.result() if ahead is not None else None
    if got is not None:
        return (*got, True)
    return (*_cycle(sc, engine, engine.run(links=False)), False)


def _shorter_run(sc: Scenario, collapse: bool | None) -> tuple[Engine, SpanBase | None, cycles.Repeat | None,
                                                                  int | None]:
    """The shorter step lowered (from scratch: the whole step's lowering is the other
    process's), set up and run, and its cycle: what the forked process of
    :mod:`clustersim.engine.ahead` does."""
    sprog, _ = lower(shorter_step(sc), collapse=collapse)
    engine = _engine_of(sc, sprog)
    return (engine, *_cycle(sc, engine, engine.run(links=False)))


@contextmanager
def _ahead(sc: Scenario, collapse: bool | None, repeat: bool, fork: bool):
    """With ``fork`` where a shorter step will be simulated: the :class:`Ahead` whose child,
    forked on the way in where a fork is safe, simulates it; the child is stopped and waited
    for on the way out. Else None."""
    if not fork or shorter_step(sc, repeat) is None:
        yield None
        return
    _ = sc.cluster  # the graph, built once for both processes (it is cached)
    ahead = Ahead(partial(_shorter_run, sc, collapse))
    try:
        ahead.start()
        yield ahead
    finally:
        ahead.close()


def _links_ahead(ahead: Ahead, engine: Engine, rep: cycles.Repeat) -> list:
    """The link use the process of :mod:`clustersim.engine.ahead` worked out; where it did
    not, ``engine`` (set up for the shorter step, its spans spliced, not run) runs the
    shorter step here for its records."""
    got = ahead.links()
    if got is not None:
        return got
    step_s = engine.step_s
    engine.run(links=False)
    engine.cut_records(rep, step_s)
    return engine.link_use()


def shorter_step(sc: Scenario, repeat: bool = True) -> Scenario | None:
    """The step of fewer microbatches simulated in place of ``sc``'s where ``repeat`` allows
    (:func:`clustersim.engine.repeat.simulated_microbatches`), else None; made once per
    scenario, so that its schedule is the one :func:`lower_step` lowered the step with."""
    p = sc.parallel
    short = cycles.simulated_microbatches(p.schedule, p.pp, sc.microbatches, chunks_per_rank(p.schedule, p.vpp),
                                          p.vpp_group) if repeat else None
    if short is None:
        return None
    made = sc.__dict__.get("_shorter_step")
    if made is None:
        made = sc.__dict__["_shorter_step"] = with_microbatches(sc, short)
    return made


def lower_step(sc: Scenario, collapse: bool | None = None, repeat: bool = True) -> tuple[Program, Lowering]:
    """``sc``'s program and lowering, as :func:`simulate` makes them: where a shorter step will
    be simulated (:func:`shorter_step`), the lowering keeps its state where the two steps'
    units part, so that the shorter one's (``_run``) resumes from there."""
    shorter = shorter_step(sc, repeat)
    return lower(sc, collapse=collapse, shorter=None if shorter is None else shorter.schedule)


def _cycle(sc: Scenario, engine: Engine, strace: Trace, short: Scenario | None = None,
           tried: list[int] | None = None) -> tuple[SpanBase | None, cycles.Repeat | None, int | None]:
    """(the spans of ``engine``'s run of ``sc``'s shorter step ``short`` (by default
    :func:`shorter_step`), whose trace is ``strace``; the cycle found in them, of the lengths
    ``tried`` if given; None, or where no cycle holds None, None and the length of a longer
    cycle they hold that a second shorter step could copy in)
    (:func:`clustersim.engine.repeat.find_cycle`, :func:`~clustersim.engine.repeat.longer_cycle`)."""
    first = [r for r, s in strace.stage_of.items() if s == 0]
    base = strace.current_base()
    if not first or base is None:
        return None, None, None
    p, short = sc.parallel, short or shorter_step(sc)
    step, halves = cycles.step_mb(p.schedule, p.pp, p.vpp_group), cycles.ways(p.schedule)
    rep = cycles.find_cycle(base, min(first), short.microbatches, sc.microbatches, engine.record_starts(), step,
                            halves, tried)
    if rep is not None:
        return base, rep, None
    if tried is not None:
        return None, None, None
    return None, None, cycles.longer_cycle(base, min(first), short.microbatches, engine.record_starts(), step, halves,
                                           cycles.group_mb(p.schedule, p.pp, p.vpp_group))


def _spliced(engine: Engine, base: SpanBase, rep: cycles.Repeat, short_tasks: TaskColumns, full_tasks: TaskColumns,
             prog: Program) -> Trace | None:
    """The trace of ``prog`` (the whole step; ``full_tasks`` its task columns) from the spans
    ``base`` of the shorter step's run (``short_tasks`` its task columns) and their cycle
    ``rep``, with ``engine`` (set up for the shorter step) for the algorithms census, or None
    where the splice does not hold."""
    spliced = cycles.splice(base, rep, short_tasks, full_tasks)
    if spliced is None:
        return None
    trace = engine.repeated(rep, spliced, prog, full_tasks.gap_comms)
    trace.repeat = rep.summary()
    trace.keep_task_columns(full_tasks)  # the critical path and the checks read them next
    return trace


def _warm(short_tasks: TaskColumns, full_tasks: TaskColumns, check: bool) -> None:
    """Work out now the task columns the splice reads of both programs
    (:func:`clustersim.engine.repeat.splice`: ranks, streams, microbatches, lane order; the
    whole program's communications outside runs, for the census), the critical path reads
    (previous task on the stream, rendezvous groups) and, with ``check``, the invariant
    checks (dependencies, receivers): they are cached on the columns, so the later readers
    find them made."""
    for cols in (short_tasks, full_tasks):
        _ = cols.stream_order, cols.mb
    _ = full_tasks.gap_comms, full_tasks.prev, full_tasks.rendezvous
    if check:
        _ = full_tasks.deps, full_tasks.recv_rank


def with_microbatches(sc: Scenario, m: int) -> Scenario:
    """``sc`` with ``m`` microbatches per step (its global batch made ``m * dp * micro batch``),
    sharing its cluster and mesh."""
    t = sc.cfg.training
    training = t.model_copy(update={"global_batch_size": m * sc.parallel.dp * t.micro_batch_size})
    out = Scenario(cfg=sc.cfg.model_copy(update={"training": training}), topology=sc.topology, source=sc.source,
                   schedule_text=sc.schedule_text, schedule_path=sc.schedule_path)
    out.__dict__["cluster"] = sc.cluster
    out.__dict__["mesh"] = sc.mesh
    return out


@contextmanager
def no_cyclic_gc():
    """Pause Python's cyclic garbage collector: a step makes millions of long-lived objects
    (tasks, events, spans) and the collector would rescan them over and over (20-40 % of the
    time); reference counting still frees everything that is not in a cycle."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
