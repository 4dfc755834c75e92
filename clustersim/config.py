"""Scenario: one YAML file naming a cluster, a model, a parallel plan and a training setup.

Validated once, here, at the boundary. Every error is a ConfigError that names the file and
the field, e.g. ``scenarios/x.yaml: parallel.tp: tp=3 does not divide model.heads=64``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import pydantic

from .errors import ConfigError
from .hardware.topology import Cluster, TopologyCfg, build_cluster, load_topology_cfg
from .model.transformer import DenseModelCfg
from .plan.mesh import DIMS, Mesh, split_layers
from .schedule.pipeline import SCHEDULES
from .yamlio import Strict, read_yaml, validate


class ClusterRef(Strict):
    topology: str = pydantic.Field(description="path to a topology YAML, relative to the scenario file")
    nodes: int | None = pydantic.Field(default=None, ge=1, description="overrides the topology's node count")


class ParallelCfg(Strict):
    tp: int = pydantic.Field(default=1, ge=1)
    pp: int = pydantic.Field(default=1, ge=1)
    dp: int = pydantic.Field(default=1, ge=1)
    schedule: Literal["1f1b", "gpipe"] = "1f1b"
    order: str = "tp-dp-pp"
    layers_per_stage: list[int] | None = None
    sp: bool = False
    zero: int = pydantic.Field(default=0, ge=0, le=3)
    zero_prefetch_layers: int = pydantic.Field(default=1, ge=0)
    zero3_keep_gathered: bool = False

    @pydantic.field_validator("order")
    @classmethod
    def _order(cls, v: str) -> str:
        if sorted(v.split("-")) != sorted(DIMS):
            raise ValueError(f"order must be a permutation of {'-'.join(DIMS)}, innermost first")
        return v


class TrainingCfg(Strict):
    micro_batch_size: int = pydantic.Field(default=1, ge=1)
    global_batch_size: int = pydantic.Field(ge=1)
    precision: Literal["bf16", "fp16", "fp8"] = "bf16"
    grad_dtype: Literal["fp32", "bf16"] = "fp32"
    optimizer: Literal["adam"] = "adam"
    attention: Literal["flash", "standard"] = "flash"
    recompute: Literal["none", "selective", "full"] = "none"
    dp_bucket_params: int = pydantic.Field(default=40_000_000, ge=1)


class SimulationCfg(Strict):
    network: Literal["flow", "ideal"] = "flow"
    collapse_symmetric: bool = True


class ScenarioCfg(Strict):
    name: str = "scenario"
    description: str = ""
    cluster: ClusterRef
    model: DenseModelCfg
    parallel: ParallelCfg = ParallelCfg()
    training: TrainingCfg
    simulation: SimulationCfg = SimulationCfg()


@dataclass
class Scenario:
    """A validated scenario with its topology resolved. Build with :func:`load_scenario`."""

    cfg: ScenarioCfg
    topology: TopologyCfg
    source: str

    @property
    def model(self) -> DenseModelCfg:
        return self.cfg.model

    @property
    def parallel(self) -> ParallelCfg:
        return self.cfg.parallel

    @property
    def training(self) -> TrainingCfg:
        return self.cfg.training

    @cached_property
    def cluster(self) -> Cluster:
        return build_cluster(self.topology)

    @cached_property
    def mesh(self) -> Mesh:
        p = self.parallel
        return Mesh(tp=p.tp, dp=p.dp, pp=p.pp, order=tuple(p.order.split("-")))

    @property
    def microbatches(self) -> int:
        t = self.training
        return t.global_batch_size // (self.parallel.dp * t.micro_batch_size)

    @property
    def layers_per_stage(self) -> list[int]:
        return list(self.parallel.layers_per_stage or split_layers(self.model.layers, self.parallel.pp))

    @property
    def tokens_per_step(self) -> int:
        return self.training.global_batch_size * self.model.seq_len


def _check_plan(cfg: ScenarioCfg, topo: TopologyCfg, source: str) -> None:
    """Cross-section rules that no single section can check alone."""
    m, p, t = cfg.model, cfg.parallel, cfg.training

    def fail(field: str, msg: str):
        raise ConfigError(msg, source=source, field=field)

    world = topo.nodes * topo.node.gpus
    if p.tp * p.pp * p.dp != world:
        fail("parallel", f"tp*pp*dp = {p.tp}*{p.pp}*{p.dp} = {p.tp * p.pp * p.dp} does not equal the "
                         f"world size {world} (cluster: {topo.nodes} node{'s' if topo.nodes != 1 else ''} x "
                         f"{topo.node.gpus} GPUs)")
    if m.heads % p.tp:
        fail("parallel.tp", f"tp={p.tp} does not divide model.heads={m.heads}")
    if m.n_kv_heads % p.tp:
        fail("parallel.tp", f"tp={p.tp} does not divide model.kv_heads={m.n_kv_heads}")
    if m.ffn % p.tp:
        ffn = f"model.ffn_hidden={m.ffn}" + ("" if m.ffn_hidden else " (default 4*hidden)")
        fail("parallel.tp", f"tp={p.tp} does not divide {ffn}")
    if p.sp and p.tp == 1:
        fail("parallel.sp", "sequence parallelism splits TP's replicated work; it needs tp > 1")
    if p.pp > m.layers:
        fail("parallel.pp", f"pp={p.pp} is more than model.layers={m.layers}")
    if p.layers_per_stage is not None:
        if len(p.layers_per_stage) != p.pp:
            fail("parallel.layers_per_stage", f"has {len(p.layers_per_stage)} entries, expected pp={p.pp}")
        if sum(p.layers_per_stage) != m.layers or min(p.layers_per_stage) < 1:
            fail("parallel.layers_per_stage",
                 f"entries must be >= 1 and sum to model.layers={m.layers} (sum is {sum(p.layers_per_stage)})")
    per_step = p.dp * t.micro_batch_size
    if t.global_batch_size % per_step:
        fail("training.global_batch_size",
             f"global_batch_size={t.global_batch_size} is not a multiple of dp*micro_batch_size = {per_step}")
    if t.precision == "fp8":
        from .hardware.gpus import lookup_gpu
        if lookup_gpu(topo.gpu).fp8_flops is None:
            fail("training.precision", f"fp8 needs fp8 tensor cores; {topo.gpu} has none")


def load_scenario(src: str | Path | dict[str, Any], *, base_dir: str | Path | None = None) -> Scenario:
    """Read and validate a scenario from a YAML path or a dict (paths relative to ``base_dir``)."""
    if isinstance(src, dict):
        data, source = src, "<dict>"
        base = Path(base_dir or ".")
    else:
        path = Path(src)
        data, source = read_yaml(path, what="scenario"), str(src)
        base = path.parent
    cfg = validate(ScenarioCfg, data, source=source)
    topo_path = base / cfg.cluster.topology
    if not topo_path.is_file():
        raise ConfigError(f"topology file not found: {topo_path}", source=source, field="cluster.topology")
    overrides = {"nodes": cfg.cluster.nodes} if cfg.cluster.nodes is not None else None
    topo = load_topology_cfg(topo_path, overrides)
    _check_plan(cfg, topo, source)
    return Scenario(cfg=cfg, topology=topo, source=source)
