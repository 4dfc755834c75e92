"""Scenario: one YAML file naming a cluster, a model, a parallel plan and a training setup.

Validated once, here, at the boundary. Every error is a ConfigError that names the file and
the field, e.g. ``scenarios/x.yaml: parallel.tp: tp=3 does not divide model.heads=64``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import pydantic

from .errors import ConfigError
from .hardware.topology import Cluster, TopologyCfg, WhatIfCfg, build_cluster, load_topology_cfg
from .model.transformer import DenseModelCfg
from .plan.mesh import Mesh, parse_order, split_layers
from .schedule.pipeline import CUSTOM, SCHEDULE_NAMES, PipelineSchedule, ScheduleError, build_schedule
from .yamlio import Strict, read_yaml, validate


class ClusterRef(Strict):
    topology: str = pydantic.Field(description="path to a topology YAML, relative to the scenario file")
    nodes: int | None = pydantic.Field(default=None, ge=1, description="overrides the topology's node count")
    what_if: list[WhatIfCfg] = pydantic.Field(
        default_factory=list, description="faults and stragglers, added to the topology's own what_if")


class ParallelCfg(Strict):
    tp: int = pydantic.Field(default=1, ge=1)
    pp: int = pydantic.Field(default=1, ge=1)
    dp: int = pydantic.Field(default=1, ge=1)
    schedule: Literal[SCHEDULE_NAMES] = "1f1b"  # type: ignore[valid-type]  # the schedule layer's names
    vpp: int = pydantic.Field(default=1, ge=1, description="virtual stages (model chunks) per rank, interleaved")
    schedule_file: str | None = pydantic.Field(
        default=None, description="custom schedule, relative to the scenario file (schedule: custom)")
    order: str = pydantic.Field(default="tp-cp-ep-dp-pp", description="rank layout, innermost first")
    layers_per_stage: list[int] | None = pydantic.Field(
        default=None, description="layers of each model part (pp*vpp parts for interleaved, else pp)")
    sp: bool = False
    ep: int = pydantic.Field(default=1, ge=1, description="expert parallelism, carved out of dp")
    zero: int = pydantic.Field(default=0, ge=0, le=3)
    zero_prefetch_layers: int = pydantic.Field(default=1, ge=0)
    zero3_keep_gathered: bool = False
    cp: int = pydantic.Field(default=1, ge=1, description="context parallelism: ranks that split each sequence")
    cp_comm: Literal["ring", "all_gather"] = "ring"
    cp_load_balance: bool = True

    @pydantic.field_validator("order")
    @classmethod
    def _order(cls, v: str) -> str:
        parse_order(v)  # raises ValueError with the reason
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


class CollectivesCfg(Strict):
    """Algorithm per collective: "auto" picks the applicable one fastest alone at each size."""

    all_reduce: Literal["auto", "ring", "tree", "hierarchical", "nvls"] = "auto"
    reduce_scatter: Literal["auto", "ring"] = "auto"
    all_gather: Literal["auto", "ring"] = "auto"
    all_to_all: Literal["auto", "pxn", "pairwise"] = "auto"


class SimulationCfg(Strict):
    network: Literal["flow", "ideal"] = "flow"
    collapse_symmetric: bool = True
    collectives: CollectivesCfg = CollectivesCfg()


class ProjectionCfg(Strict):
    """What a whole run costs at this step's speed: tokens to train on, price, power overhead."""

    tokens: float = pydantic.Field(default=1e12, gt=0, description="training tokens of the whole run")
    usd_per_gpu_hour: float | None = pydantic.Field(default=None, ge=0, description="price of one GPU-hour")
    pue: float = pydantic.Field(default=1.0, ge=1.0, description="facility power / IT power")


class ScenarioCfg(Strict):
    name: str = "scenario"
    description: str = ""
    cluster: ClusterRef
    model: DenseModelCfg
    parallel: ParallelCfg = ParallelCfg()
    training: TrainingCfg
    simulation: SimulationCfg = SimulationCfg()
    projection: ProjectionCfg = ProjectionCfg()


@dataclass
class Scenario:
    """A validated scenario with its topology resolved. Build with :func:`load_scenario`."""

    cfg: ScenarioCfg
    topology: TopologyCfg
    source: str
    schedule_text: str | None = None  # contents of parallel.schedule_file (schedule: custom)
    schedule_path: str | None = None  # where it was read from, for error messages

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
        order, ep_inner = parse_order(p.order)
        return Mesh(tp=p.tp, dp=p.dp, pp=p.pp, order=order, ep=p.ep, cp=p.cp, ep_inner=ep_inner)

    @property
    def microbatches(self) -> int:
        t = self.training
        return t.global_batch_size // (self.parallel.dp * t.micro_batch_size)

    @cached_property
    def schedule(self) -> PipelineSchedule:
        """The pipeline order: per rank, actions over virtual stages (see clustersim/schedule/)."""
        p = self.parallel
        if p.schedule == CUSTOM:
            if self.schedule_text is None:
                raise ScheduleError("schedule custom needs the text of parallel.schedule_file")
            return build_schedule(CUSTOM, p.pp, self.microbatches, text=self.schedule_text)
        opts = {"v": p.vpp} if p.schedule == "interleaved" else {}
        return build_schedule(p.schedule, p.pp, self.microbatches, **opts)

    @property
    def n_parts(self) -> int:
        """Model parts (contiguous slices of layers): pp*vpp for interleaved, pp for the others,
        what the file says for custom."""
        return self.schedule.n_parts

    @property
    def layers_per_part(self) -> list[int]:
        """Layers of each model part, first part first (``parallel.layers_per_stage`` or an even split)."""
        return list(self.parallel.layers_per_stage or split_layers(self.model.layers, self.n_parts))

    @property
    def layers_per_stage(self) -> list[int]:
        """Old name of :attr:`layers_per_part` (one part per stage under GPipe and 1F1B)."""
        return self.layers_per_part

    @property
    def tokens_per_step(self) -> int:
        return self.training.global_batch_size * self.model.seq_len


MAX_GPUS = 131_072  # the cluster graph and routes are built in memory
MAX_GPUS_ALL_RANKS = 4_096  # every rank simulated (no symmetric collapse): minutes at this size
MAX_MICROBATCHES = 65_536  # per pipeline and step: the schedule holds an action per microbatch and stage
MAX_LAYERS = 10_000  # the program holds blocks per layer, microbatch and stage


def _check_plan(cfg: ScenarioCfg, topo: TopologyCfg, source: str) -> None:
    """Cross-section rules that no single section can check alone."""
    m, p, t = cfg.model, cfg.parallel, cfg.training

    def fail(field: str, msg: str):
        raise ConfigError(msg, source=source, field=field)

    world = topo.nodes * topo.node.gpus
    if world > MAX_GPUS:
        fail("cluster.nodes", f"{topo.nodes} nodes x {topo.node.gpus} GPUs = {world:,} GPUs; clustersim builds the "
                              f"cluster graph in memory and takes at most {MAX_GPUS:,} GPUs: use fewer nodes")
    if world > MAX_GPUS_ALL_RANKS and not cfg.simulation.collapse_symmetric:
        fail("simulation.collapse_symmetric", f"simulating every one of {world:,} ranks would take hours and many "
                                              f"GB; keep collapse_symmetric: true (exact on symmetric placements) "
                                              f"or use at most {MAX_GPUS_ALL_RANKS:,} GPUs")
    if world > MAX_GPUS_ALL_RANKS and any(w.gpu is not None for w in topo.what_if):  # the scenario's merged in
        fail("cluster.what_if", f"a slow GPU makes every rank simulated, too slow for {world:,} GPUs (at most "
                                f"{MAX_GPUS_ALL_RANKS:,}); try the straggler on a smaller cluster")
    if p.tp * p.cp * p.pp * p.dp != world:
        dims, vals = ("tp*cp*pp*dp", f"{p.tp}*{p.cp}*{p.pp}*{p.dp}") if p.cp > 1 else ("tp*pp*dp", f"{p.tp}*{p.pp}*{p.dp}")
        fail("parallel", f"{dims} = {vals} = {p.tp * p.cp * p.pp * p.dp} does not equal the "
                         f"world size {world} (cluster: {topo.nodes} node{'s' if topo.nodes != 1 else ''} x "
                         f"{topo.node.gpus} GPUs)")
    if m.heads % p.tp:
        fail("parallel.tp", f"tp={p.tp} does not divide model.heads={m.heads}")
    if m.n_kv_heads % p.tp:
        fail("parallel.tp", f"tp={p.tp} does not divide model.kv_heads={m.n_kv_heads}")
    if m.ffn % p.tp:
        ffn = f"model.ffn_hidden={m.ffn}" + ("" if m.ffn_hidden else " (default 4*hidden)")
        fail("parallel.tp", f"tp={p.tp} does not divide {ffn}")
    if p.ep > 1 and m.moe is None:
        fail("parallel.ep", f"ep={p.ep} needs a mixture-of-experts model (model.moe)")
    if m.moe is not None:
        if m.moe.experts % p.ep:
            fail("parallel.ep", f"ep={p.ep} does not divide model.moe.experts={m.moe.experts}")
        if p.dp % p.ep:
            fail("parallel.ep", f"ep={p.ep} does not divide dp={p.dp} (expert parallelism is carved out of DP)")
        if m.moe.expert_ffn % p.tp:
            fail("parallel.tp", f"tp={p.tp} does not divide model.moe.expert_ffn={m.moe.expert_ffn}")
    if p.cp > 1:
        chunks = 2 * p.cp if p.cp_load_balance else p.cp
        if m.seq_len % chunks:
            how = f"2*cp = {chunks} chunks (cp_load_balance)" if p.cp_load_balance else f"cp={p.cp} chunks"
            fail("parallel.cp", f"model.seq_len={m.seq_len} does not split into {how}")
        if t.attention != "flash":
            fail("parallel.cp", "context parallelism runs blockwise (flash) attention; set training.attention: flash")
    if p.sp and p.tp == 1:
        fail("parallel.sp", "sequence parallelism splits TP's replicated work; it needs tp > 1")
    if p.pp > m.layers:
        fail("parallel.pp", f"pp={p.pp} is more than model.layers={m.layers}")
    per_step = p.dp * t.micro_batch_size
    if m.layers > MAX_LAYERS:
        fail("model.layers", f"{m.layers:,} layers; clustersim simulates models of at most {MAX_LAYERS:,} layers")
    if t.global_batch_size // per_step > MAX_MICROBATCHES:
        fail("training.global_batch_size",
             f"{t.global_batch_size // per_step:,} microbatches per step (global_batch_size / (dp * micro_batch_size)); "
             f"at most {MAX_MICROBATCHES:,} can be simulated: raise micro_batch_size or dp")
    if t.global_batch_size % per_step:
        fail("training.global_batch_size",
             f"global_batch_size={t.global_batch_size} is not a multiple of dp*micro_batch_size = {per_step}")
    if t.precision == "fp8":
        from .hardware.gpus import lookup_gpu
        if lookup_gpu(topo.gpu).fp8_flops is None:
            fail("training.precision", f"fp8 needs fp8 tensor cores; {topo.gpu} has none")


def _check_schedule_options(cfg: ScenarioCfg, source: str) -> None:
    """The schedule's own parameters, in the scenario's words, before the schedule is built.

    Needs (pipeline_bubbles in shared/reference/published-runs.yaml; the schedule layer checks
    the same and is the fallback):
        interleaved   vpp >= 2, m % pp == 0              (Megatron-LM runs microbatches p at a time)
        dualpipe      pp even, m even, m >= 2 pp         (the reference DualPipe's asserts)
        custom        schedule_file, and only then
    """
    p = cfg.parallel
    m = cfg.training.global_batch_size // (p.dp * cfg.training.micro_batch_size)
    m_is = f"m={m} microbatches (global_batch_size / (dp * micro_batch_size))"

    def fail(field: str, msg: str):
        raise ConfigError(msg, source=source, field=field)

    if p.schedule == "interleaved":
        if p.vpp < 2:
            fail("parallel.vpp", f"schedule interleaved needs vpp >= 2 model chunks per rank; got vpp={p.vpp} "
                                 f"(vpp=1 is plain 1f1b)")
        if m % p.pp:
            fail("parallel.schedule", f"interleaved needs {m_is} to be a multiple of pp={p.pp} (Megatron-LM "
                                      f"runs them in groups of pp per chunk)")
    elif p.vpp != 1:
        fail("parallel.vpp", f"vpp={p.vpp} is used by schedule interleaved only (schedule is {p.schedule}); "
                             f"leave it at 1")
    if p.schedule == "dualpipe":
        if p.pp % 2:
            fail("parallel.schedule", f"dualpipe needs an even pp (two directions meet in the middle); got pp={p.pp}")
        if m % 2 or m < 2 * p.pp:
            fail("parallel.schedule", f"dualpipe needs {m_is} even and at least 2*pp={2 * p.pp} (half per "
                                      f"direction, at least pp each)")
    if p.schedule == CUSTOM and p.schedule_file is None:
        fail("parallel.schedule_file", "schedule custom needs parallel.schedule_file: a file with one row of "
                                       "actions per pipeline rank (see docs/reference.md)")
    if p.schedule != CUSTOM and p.schedule_file is not None:
        fail("parallel.schedule_file", f"is read by schedule custom only (schedule is {p.schedule})")


def _read_schedule_file(path: Path, source: str) -> str:
    if not path.is_file():
        raise ConfigError(f"schedule file not found: {path}", source=source, field="parallel.schedule_file")
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}", source=source, field="parallel.schedule_file") from None


def _check_schedule(sc: Scenario) -> None:
    """Build the schedule once (it is cached) and check the layer split against its parts."""
    p, layers = sc.parallel, sc.model.layers
    field = "parallel.schedule_file" if p.schedule == CUSTOM else "parallel.schedule"
    where = f"{sc.schedule_path}: " if sc.schedule_path else ""
    try:
        n = sc.n_parts
    except ScheduleError as exc:
        raise ConfigError(where + exc.message, source=sc.source, field=field) from None
    idle = [r for r, acts in enumerate(sc.schedule.actions) if not acts]
    if idle:  # its GPUs would hold no layers: a smaller pp says the same
        raise ConfigError(f"{where}rank {idle[0]} has no actions; every pipeline rank must run at least one stage",
                          source=sc.source, field=field)
    if p.layers_per_stage is not None:
        per = {"interleaved": f"pp*vpp = {p.pp}*{p.vpp}", CUSTOM: "the custom schedule's stages"}.get(
            p.schedule, f"pp={p.pp}")
        if len(p.layers_per_stage) != n:
            raise ConfigError(f"has {len(p.layers_per_stage)} entries, expected one per model part: {per} = {n}",
                              source=sc.source, field="parallel.layers_per_stage")
        if sum(p.layers_per_stage) != layers or min(p.layers_per_stage) < 1:
            raise ConfigError(f"entries must be >= 1 and sum to model.layers={layers} "
                              f"(sum is {sum(p.layers_per_stage)})", source=sc.source, field="parallel.layers_per_stage")
    elif n > layers:
        what = {"interleaved": ("parallel.vpp", f"pp*vpp = {p.pp}*{p.vpp} = {n} model chunks"),
                CUSTOM: ("parallel.schedule_file", f"the custom schedule's {n} stages")}.get(
            p.schedule, ("parallel.pp", f"pp={p.pp} parts"))
        raise ConfigError(f"{what[1]} need at least one layer each, but model.layers={layers}",
                          source=sc.source, field=what[0])


def _with_what_ifs(topo: TopologyCfg, extra: list) -> TopologyCfg:
    """The topology with the scenario's what-ifs after its own."""
    merged = topo.model_copy(update={"what_if": [*topo.what_if, *extra]})
    merged._source = getattr(topo, "_source", None)
    return merged


def _build_checked(topo: TopologyCfg, own: int, source: str) -> Cluster:
    """Build the cluster now, so that a misspelt name or a cut-off GPU in the scenario's
    what-ifs (entries from ``own`` on) names the scenario's entry."""
    try:
        return build_cluster(topo)
    except ConfigError as exc:
        m = re.match(r"what_if\[(\d+)\](.*)", exc.field or "")
        if m and int(m.group(1)) >= own:
            raise ConfigError(exc.message, source=source,
                              field=f"cluster.what_if[{int(m.group(1)) - own}]{m.group(2)}") from None
        raise


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
    own = len(topo.what_if)
    if cfg.cluster.what_if:
        topo = _with_what_ifs(topo, cfg.cluster.what_if)
    _check_plan(cfg, topo, source)  # before any graph is built: it refuses clusters too large to build
    _check_schedule_options(cfg, source)
    sc = Scenario(cfg=cfg, topology=topo, source=source)
    if cfg.cluster.what_if:  # built once, here, and kept (``Scenario.cluster`` is cached)
        sc.__dict__["cluster"] = _build_checked(topo, own, source)
    if cfg.parallel.schedule_file is not None:
        sc.schedule_path = str(base / cfg.parallel.schedule_file)
        sc.schedule_text = _read_schedule_file(Path(sc.schedule_path), source)
    _check_schedule(sc)
    return sc
