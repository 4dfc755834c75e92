"""The Python API: ``load_scenario`` -> ``simulate`` -> ``Result`` (summary, trace, figure)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .analysis.memory import StageStatic, memory_report
from .analysis.metrics import step_metrics
from .config import Scenario, load_scenario
from .engine import run_program
from .model.transformer import total_params
from .program.lower import Lowering, lower
from .program.work import OPTIMIZER_BYTES, PARAM_BYTES
from .trace import Trace


@dataclass
class Result:
    """One simulated step: ``summary`` (the summary.json contract) and the ``trace``."""

    scenario: Scenario
    trace: Trace
    summary: dict[str, Any]

    def figure(self):
        """The report's plotly figure (Gantt timeline), for notebooks."""
        from .output.report import build_figure

        return build_figure(self.trace, self.summary)


def _statics(low: Lowering) -> list[StageStatic]:
    out = []
    for s, w in enumerate(low.work):
        out.append(StageStatic(
            stage=s, params=w.local_params, param_bytes=PARAM_BYTES * w.local_params,
            grad_bytes=low.grad_bytes * w.local_params, optimizer_bytes=OPTIMIZER_BYTES * w.local_params,
            activation_bytes_per_mb=w.activation_bytes_per_mb,
        ))
    return out


def summarize(sc: Scenario, low: Lowering, trace: Trace) -> dict[str, Any]:
    """Assemble summary.json: metrics, memory, the resolved plan and what was simulated."""
    gpu = sc.cluster.gpu
    peak = gpu.peak_flops(sc.training.precision)
    world = sc.mesh.world_size
    metrics = step_metrics(trace, world_size=world, peak_flops=peak, tokens_per_step=sc.tokens_per_step)
    p, t = sc.parallel, sc.training
    return {
        "scenario": sc.cfg.name,
        "description": sc.cfg.description,
        "world_size": world,
        **metrics,
        "memory": memory_report(trace, _statics(low), gpu.hbm_capacity_bytes),
        "plan": {
            "tp": p.tp, "pp": p.pp, "dp": p.dp, "schedule": p.schedule, "order": p.order,
            "micro_batch_size": t.micro_batch_size, "global_batch_size": t.global_batch_size,
            "microbatches": sc.microbatches, "layers_per_stage": sc.layers_per_stage,
            "precision": t.precision, "attention": t.attention,
        },
        "model": {"name": sc.model.name, "params": total_params(sc.model), "layers": sc.model.layers,
                  "seq_len": sc.model.seq_len},
        "hardware": {"gpu": gpu.name, "peak_flops": peak, "hbm_capacity_bytes": gpu.hbm_capacity_bytes,
                     "topology": sc.topology.name, "nodes": sc.topology.nodes,
                     "gpus_per_node": sc.topology.node.gpus},
        "simulation": {"network": sc.cfg.simulation.network,
                       "collapse_symmetric": len(trace.ranks) < world,
                       "simulated_ranks": len(trace.ranks), "spans": len(trace.spans)},
    }


def simulate(scenario: Scenario | str | Path | dict, *, collapse: bool | None = None) -> Result:
    """Simulate one training step of ``scenario`` (a Scenario, a YAML path or a dict)."""
    sc = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    prog, low = lower(sc, collapse=collapse)
    trace = run_program(prog, sc.cluster, sc.cfg.simulation.network)
    return Result(scenario=sc, trace=trace, summary=summarize(sc, low, trace))
