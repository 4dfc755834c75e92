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
from .analysis.memory import PartStatic, StageStatic, memory_report
from .analysis.metrics import step_metrics
from .config import Scenario, load_scenario
from .engine import Engine
from .engine import repeat as cycles
from .model.transformer import total_params
from .program.lower import Lowering, lower
from .program.tasks import Program
from .program.work import OPTIMIZER_BYTES, PARAM_BYTES
from .trace import Trace


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

    def figure(self):
        """The report's plotly figure (Gantt timeline), for notebooks."""
        from .output.report import build_figure

        return build_figure(self.trace, self.summary)


def _part_static(low: Lowering, j: int) -> PartStatic:
    w = low.work[j]
    return PartStatic(
        part=j, params=w.local_params, activation_bytes_per_mb=w.activation_bytes_per_mb,
        layers=tuple(sorted({b.layer for b in w.fwd if b.layer >= 0})),
        blocks=tuple(b.name for b in w.fwd if b.layer < 0),
    )


def _statics(low: Lowering) -> list[StageStatic]:
    """Static bytes per pipeline stage (all the parts it holds) by ZeRO stage, for Ψ local
    parameters and N = dp x cp (Rajbhandari et al. 2020, Fig. 1, with g bytes per gradient)::

        ZeRO 0: 2Ψ + gΨ + 12Ψ     1: 2Ψ + gΨ + 12Ψ/N     2: 2Ψ + (g+12)Ψ/N     3: (2+g+12)Ψ/N

    Routed-expert parameters Ψe (MoE) shard over the expert-DP group instead (N_e = N/ep ranks
    hold the same experts): the same formulas with Ψe and N_e, e.g. 12Ψe/N_e under ZeRO-1.
    """
    n, z = low.n_grad, low.zero
    n_e = low.mesh.size("cp+edp")
    out = []
    for q in range(low.mesh.pp):
        parts = tuple(_part_static(low, j) for j in low.parts_of[q])
        psi = sum(p.params for p in parts)
        psi_e = sum(low.work[j].local_expert_params for j in low.parts_of[q])
        transient = max(low.work[j].transient_bytes for j in low.parts_of[q])  # one layer recomputes at a time
        sharded3 = z == 3 and not low.zero3_keep_gathered
        if sharded3:
            # gathered units in flight: the one computing plus those prefetched
            biggest = max((sum(p for _, p in v) for (j, _), v in low.unit_shards.items() if j in low.parts_of[q]),
                          default=0.0)
            transient += (low.zero_prefetch_layers + 1) * biggest * PARAM_BYTES
        out.append(StageStatic(
            stage=q, params=psi + psi_e,
            param_bytes=PARAM_BYTES * (psi / (n if sharded3 else 1) + psi_e / (n_e if sharded3 else 1)),
            grad_bytes=low.grad_bytes * (psi / (n if z >= 2 else 1) + psi_e / (n_e if z >= 2 else 1)),
            optimizer_bytes=OPTIMIZER_BYTES * (psi / (n if z >= 1 else 1) + psi_e / (n_e if z >= 1 else 1)),
            activation_bytes_per_mb=max(p.activation_bytes_per_mb for p in parts),
            transient_bytes=transient,
            parts=parts,
        ))
    return out


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
              keep_columns: bool = False, links: Callable[[], list] | None = None) -> dict[str, Any]:
    """Assemble summary.json: metrics, memory, the critical path, exposed communication by
    cause, the resolved plan and what was simulated. ``engine`` (the one that ran ``prog``)
    names the links that bounded exposed collectives. The trace's columnar view the summary
    is made from is dropped at the end (its arrays are large), unless ``keep_columns``.
    ``links``: gives the trace's link use (``Trace.links``, else already there), asked for
    once everything else is worked out (``clustersim run``'s writer works it out meanwhile)."""
    gpu = sc.cluster.gpu
    peak = gpu.peak_flops(sc.training.precision)
    world = sc.mesh.world_size
    metrics = step_metrics(trace, world_size=world, peak_flops=peak, tokens_per_step=sc.tokens_per_step)
    p, t = sc.parallel, sc.training
    summary = {
        "scenario": sc.cfg.name,
        "description": sc.cfg.description,
        "world_size": world,
        **metrics,
        "memory": memory_report(trace, _statics(low), gpu.hbm_capacity_bytes),
        "critical_path": path_report(critical_path(prog, trace), metrics["step_time_s"]),
        "exposed_comm_causes": exposed_collectives(prog, trace, engine, sc.cluster),
        "links": None,  # filled in last, in this place (see ``links``)
        "projection": projection(sc, metrics["tokens_per_s"]),
        "plan": {
            "tp": p.tp, "pp": p.pp, "dp": p.dp, "cp": p.cp, "cp_comm": p.cp_comm,
            "cp_load_balance": p.cp_load_balance, "schedule": p.schedule, "vpp": p.vpp, "order": p.order,
            "micro_batch_size": t.micro_batch_size, "global_batch_size": t.global_batch_size,
            "microbatches": sc.microbatches, "layers_per_stage": sc.layers_per_stage,
            "precision": t.precision, "attention": t.attention, "sp": p.sp, "ep": p.ep, "zero": p.zero,
            "recompute": t.recompute,
            "parts_per_stage": [list(low.parts_of[q]) for q in range(sc.mesh.pp)],
        },
        "model": {"name": sc.model.name, "params": total_params(sc.model), "layers": sc.model.layers,
                  "seq_len": sc.model.seq_len},
        "hardware": {"gpu": gpu.name, "peak_flops": peak, "hbm_capacity_bytes": gpu.hbm_capacity_bytes,
                     "topology": sc.topology.name, "nodes": sc.topology.nodes,
                     "gpus_per_node": sc.topology.node.gpus},
        "simulation": {"network": sc.cfg.simulation.network,
                       "collapse_symmetric": len(trace.ranks) < world,
                       "simulated_ranks": len(trace.ranks), "spans": trace.n_spans,
                       "collective_algorithms": trace.algorithms, "repeat": trace.repeat,
                       "repeat_tried": trace.repeat_tried},
    }
    if links is not None:
        trace.links = links()
    summary["links"] = link_report(trace, metrics["step_time_s"])
    # the parts above shared the trace's columnar view (Trace.columns); unless the caller
    # reads it next (simulate's invariant checks), its arrays go now
    if not keep_columns:
        trace.drop_columns()
    return summary


def simulate(scenario: Scenario | str | Path | dict, *, collapse: bool | None = None,
             repeat: bool | None = None, check: bool = True,
             after_run: Callable[[Trace, Callable[[], list], Callable[[], list] | None], Any] | None = None,
             keep: list | None = None) -> Result:
    """Simulate one training step of ``scenario`` (a Scenario, a YAML path or a dict).

    ``collapse``, ``repeat``: override ``simulation.collapse_symmetric`` and ``simulation.repeat``.
    ``check``: verify the step's invariants (docs/invariants.md) and raise
    :class:`~clustersim.analysis.invariants.InvariantError` listing any violation.
    ``after_run``: called as soon as the engine has run, before the summary is worked out
    (``clustersim run`` starts writing the trace file and the report then,
    clustersim.output.background), with the trace, which has no ``links`` yet, the function
    that works them out (``Engine.link_use``) and, with ``check``, the function that runs the
    checks that need no summary (``invariants.check_trace``; None without ``check``). It may
    return an object that works on them elsewhere meanwhile (:class:`Elsewhere`): the summary
    asks it for the link use last (else works it out here, then), and once the summary is
    made, whether it took the checks (else they are run here); if it did, the summary's own
    checks are run here and the rest is judged by :meth:`Result.finish_checks`.
    ``keep``: a list the step's working objects (program, lowering, engine) are appended to
    rather than freed when this returns (``clustersim run`` leaves them to the process's
    exit: freeing Megatron-1T's 854,340 tasks one by one takes 0.18 s)."""
    sc = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    repeat = sc.cfg.simulation.repeat if repeat is None else repeat
    with no_cyclic_gc():
        prog, low = lower_step(sc, collapse, repeat)
        engine, trace, extra = _run(sc, prog, collapse, links=after_run is None, repeat=repeat, low=low)
        links = elsewhere = None
        if after_run is not None:
            # the link use only now: the summary reads it (last), the files written from here
            # do not
            elsewhere = after_run(trace, engine.link_use, partial(check_trace, prog, trace) if check else None)

            def links() -> list:
                got = elsewhere.links() if elsewhere is not None else None
                return got if got is not None else engine.link_use()
        summary = summarize(sc, low, trace, prog, engine, keep_columns=check, links=links)
        result = Result(scenario=sc, trace=trace, summary=summary)
        if check:
            result.checks_left = check_step(prog, trace, summary, elsewhere)
        if keep is not None:
            keep += (prog, low, engine, *extra)
    return result


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


def _run(sc: Scenario, prog: Program, collapse: bool | None, links: bool, repeat: bool = True,
         mark: Callable[[str], None] | None = None, low: Lowering | None = None) -> tuple[Engine, Trace, tuple]:
    """(the engine, the step's trace, the working objects of a shorter run): ``prog`` run
    whole, or, with ``repeat`` where a 1F1B, interleaved or ZB-H1 step is long enough and its cycle is found, fewer
    of its microbatches run and the cycle copied in (:mod:`clustersim.engine.repeat`).
    ``low``: ``prog``'s lowering, whose plan-wide parts the shorter step's reuses.
    ``mark`` (the bench scripts) is called at the end of each phase: "lowered" (the shorter
    step; at once when there is none), "set_up", "ran", "spliced" (when there was one; where
    no cycle held, "set_up" and "ran" again for the whole step)."""
    sim = sc.cfg.simulation
    algorithms = sim.collectives.model_dump()

    def engine_of(program: Program) -> Engine:
        return Engine(program, sc.cluster, sim.network, algorithms)

    m = sc.microbatches
    mark = mark or (lambda _: None)
    p = sc.parallel
    shorter = shorter_step(sc, repeat)
    short = None if shorter is None else shorter.microbatches
    if shorter is not None:
        sprog, slow = lower(shorter, collapse=collapse, like=low)
        mark("lowered")
        engine = engine_of(sprog)
        mark("set_up")
        strace = engine.run(links=False)
        mark("ran")
        trace = _spliced(engine, strace, sprog, prog, short, m, cycles.step_mb(p.schedule, p.pp))
        mark("spliced")
        if trace is not None:
            trace.repeat_tried = short
            if links:
                trace.links = engine.link_use()
            return engine, trace, (sprog, slow)
    else:
        mark("lowered")
    engine = engine_of(prog)
    mark("set_up")
    trace = engine.run(links=links)
    trace.repeat_tried = short  # None: not tried; else no cycle held in it
    mark("ran")
    return engine, trace, ()


def shorter_step(sc: Scenario, repeat: bool = True) -> Scenario | None:
    """The step of fewer microbatches simulated in place of ``sc``'s where ``repeat`` allows
    (:func:`clustersim.engine.repeat.simulated_microbatches`), else None; made once per
    scenario, so that its schedule is the one :func:`lower_step` lowered the step with."""
    p = sc.parallel
    short = cycles.simulated_microbatches(p.schedule, p.pp, sc.microbatches, p.vpp if p.schedule == "interleaved"
                                          else 1) if repeat else None
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


def _spliced(engine: Engine, strace: Trace, sprog: Program, prog: Program, short: int, m: int,
             step: int) -> Trace | None:
    """The trace of ``prog`` (``m`` microbatches) from ``engine``'s run of ``sprog`` (``short``
    of them), or None where no cycle holds (:func:`clustersim.engine.repeat.find_cycle`)."""
    from .analysis.columns import TaskColumns

    first = [r for r, s in strace.stage_of.items() if s == 0]
    base = strace.current_base()
    if not first or base is None:
        return None
    rep = cycles.find_cycle(base, min(first), short, m, engine.record_starts(), step)
    if rep is None:
        return None
    full_tasks = TaskColumns(prog.items, prog.runs, prog)
    spliced = cycles.splice(base, rep, TaskColumns(sprog.items, sprog.runs, sprog), full_tasks)
    if spliced is None:
        return None
    trace = engine.repeated(rep, spliced, prog, full_tasks.gap_comms)
    trace.repeat = rep.summary()
    trace.keep_task_columns(full_tasks)  # the critical path and the checks read them next
    return trace


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
