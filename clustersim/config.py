"""Scenario: one YAML file naming a cluster, a model, a parallel plan and a training setup.

Validated once, here, at the boundary. Every error is a ConfigError that names the file and
the field, e.g. ``scenarios/x.yaml: parallel.tp: tp=3 does not divide model.heads=64``. The
last check, the one that builds the pipeline schedule, may be left to the caller
(``load_scenario(check_schedule=False)``, :meth:`Scenario.check_schedule`): ``clustersim run``
makes it first thing after it forks the process that simulates a shorter step.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pydantic

from .errors import ConfigError
from .floats import sum_left
from .hardware.gpus import lookup_gpu
from .hardware.topology import (MAX_GPUS, Cluster, TopologyCfg, WhatIfCfg, check_what_ifs, cluster_of, gpus_per_nic,
                                load_topology_cfg)
from .model.moe import expert_loads
from .model.transformer import RECOMPUTE_MODULES, DenseModelCfg
from .plan.mesh import Mesh, parse_order, split_layers
from .schedule.pipeline import (CUSTOM, SCHEDULE_NAMES, V_SCHEDULES, PipelineSchedule, ScheduleError, build_schedule,
                                 chunks_per_rank)
from .yamlio import Strict, given_file, read_yaml, short_repr, validate


class ClusterRef(Strict):
    topology: str = pydantic.Field(description="path to a topology YAML, relative to the scenario file")
    nodes: int | None = pydantic.Field(default=None, ge=1, description="overrides the topology's node count")
    gpu: str | None = pydantic.Field(
        default=None, description="overrides the topology's GPU (a name of the catalogue): its nodes and fabric "
        "with other GPUs")
    node: dict[str, Any] | None = pydantic.Field(
        default=None, description="overrides of the topology's node fields, merged into them key by key and "
        "checked as the topology's: {nic: {bw_Gbps: 800}} is the cluster with NICs twice as fast")
    fabric: dict[str, Any] | None = pydantic.Field(
        default=None, description="overrides of the topology's fabric fields, merged likewise: "
        "{oversubscription: 2}")
    what_if: list[WhatIfCfg] = pydantic.Field(
        default_factory=list, description="faults and stragglers, added to the topology's own what_if")


class ParallelCfg(Strict):
    tp: int = pydantic.Field(default=1, ge=1)
    pp: int = pydantic.Field(default=1, ge=1)
    dp: int = pydantic.Field(default=1, ge=1)
    schedule: Literal[SCHEDULE_NAMES] = "1f1b"  # type: ignore[valid-type]  # the schedule layer's names
    vpp: int = pydantic.Field(default=1, ge=1, description="virtual stages (model chunks) per rank, interleaved")
    vpp_group: int | None = pydantic.Field(
        default=None, ge=1, description="interleaved: microbatches each chunk runs before the next, default pp "
        "(Megatron's --microbatch-group-size-per-virtual-pipeline-stage)")
    schedule_file: str | None = pydantic.Field(
        default=None, description="custom schedule, relative to the scenario file (schedule: custom)")
    order: str = pydantic.Field(default="tp-cp-ep-dp-pp", description="rank layout, innermost first")
    layers_per_stage: list[int] | None = pydantic.Field(
        default=None, description="layers of each model part (pp*vpp parts for interleaved, else pp)")
    sp: bool = False
    tp_async_allreduce: bool = pydantic.Field(
        default=True, description="backward TP all-reduce beside the weight gradient (Megatron's async all-reduce)")
    pp_scatter_gather: bool = pydantic.Field(
        default=False, description="without sp: each TP rank sends 1/tp of a PP send's activation (gradient) and the "
        "receiving stage all-gathers it over its TP group (Megatron-LM's scatter/gather of 2021, "
        "--scatter-gather-tensors-in-pipeline; Narayanan et al. 2021, section 4.1)")
    tp_comm_overlap: bool = pydantic.Field(
        default=False, description="SP's all-gathers and reduce-scatters pipelined with the GEMMs beside them, "
        "chunk by chunk (Megatron-LM's --tp-comm-overlap, Transformer Engine's userbuffers); needs sp")
    ep_comm_overlap: bool = pydantic.Field(
        default=False, description="combined 1F1B (Megatron-LM's --overlap-moe-expert-parallel-comm): each steady-"
        "state forward runs with the backward after it as one overlapped chunk, one's expert all-to-alls under the "
        "other's compute; needs ep > 1 and, with pp > 1, schedule interleaved")
    ep: int = pydantic.Field(default=1, ge=1, description="expert parallelism, carved out of dp (and cp, and, "
                             "with etp below tp, the TP ranks the experts leave)")
    etp: int | None = pydantic.Field(
        default=None, ge=1, description="expert tensor parallelism: TP ranks that split each routed expert, a "
        "divisor of tp (Megatron-LM's --expert-tensor-parallel-size; default tp). Below tp the EP groups fold "
        "over the TP ranks the experts leave (MoE parallel folding)")
    zero: int = pydantic.Field(default=0, ge=0, le=3)
    zero_prefetch_layers: int = pydantic.Field(default=1, ge=0)
    zero3_keep_gathered: bool = False
    zero_shard: int | None = pydantic.Field(
        default=None, ge=2, description="hybrid sharding (HSDP): ZeRO shards over groups of this many of the "
        "cp*dp ranks and keeps a replica in each group (default: one group of all of them); with ep > 1 or "
        "etp < tp the routed experts over as many slices of their expert-DP group as there are replicas")
    overlap_param_gather: bool = pydantic.Field(
        default=False, description="ZeRO-1/2: all-gather the updated parameters unit by unit inside the next "
        "step's first forward, not after the optimizer step (Megatron's --overlap-param-gather)")
    overlap_grad_reduce: bool = pydantic.Field(
        default=True, description="reduce the gradients over DP bucket by bucket as the backward makes them final, "
        "beside it (PyTorch DDP and FSDP, DeepSpeed, Megatron-LM's --overlap-grad-reduce); false: each rank "
        "reduces them after its last backward, each part's in one bucket (under ZeRO-2, after each, in buckets), as "
        "Megatron-LM does without that flag")
    cp: int = pydantic.Field(default=1, ge=1, description="context parallelism: ranks that split each sequence")
    cp_comm: Literal["ring", "all_gather", "all_to_all", "all_to_all+ring"] = pydantic.Field(
        default="ring", description="how attention sees the other CP ranks' tokens: ring (ring attention), "
        "all_gather (Llama 3's K/V all-gather), all_to_all (DeepSpeed-Ulysses, Megatron-LM's --cp-comm-type a2a: "
        "heads traded for tokens) or all_to_all+ring (Megatron-LM's a2a+p2p: all-to-all inside groups of cp_a2a "
        "ranks, a ring across them)")
    cp_a2a: int | None = pydantic.Field(
        default=None, ge=2, description="cp_comm all_to_all+ring: the ranks of each all-to-all, a divisor of cp "
        "below it (Megatron-LM's --hierarchical-context-parallel-sizes, its first)")
    cp_load_balance: bool = True

    @property
    def expert_tp(self) -> int:
        """TP ranks that split each routed expert: ``etp``, or ``tp`` where it is not set."""
        return self.etp or self.tp

    @property
    def expert_ranks(self) -> int:
        """Ranks of a stage that hold different expert slices, each a 1/etp slice of its
        experts: (tp / etp) x cp x dp, of which EP takes ep (the mesh's, plan/mesh.py)."""
        return Mesh(tp=self.tp, dp=self.dp, pp=self.pp, cp=self.cp, etp=self.expert_tp).expert_ranks

    @pydantic.field_validator("order")
    @classmethod
    def _order(cls, v: str) -> str:
        parse_order(v)  # raises ValueError with the reason
        return v

    @pydantic.model_validator(mode="before")
    @classmethod
    def _a_file_is_a_custom_schedule(cls, data: Any) -> Any:
        """``schedule_file`` without a ``schedule``: the custom schedule it holds (as
        ``clustersim schedule --file``); with another schedule named, the check refuses it."""
        if isinstance(data, dict) and data.get("schedule_file") is not None and "schedule" not in data:
            return {**data, "schedule": "custom"}
        return data


class TrainingCfg(Strict):
    micro_batch_size: int = pydantic.Field(default=1, ge=1)
    global_batch_size: int = pydantic.Field(ge=1)
    precision: Literal["bf16", "fp16", "fp8"] = "bf16"
    fp8_recipe: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] = pydantic.Field(
        default="delayed", description="under precision fp8, how FP8 tensors are scaled (Megatron-LM's "
        "--fp8-recipe): delayed (the default), or one of the recipes that scale from the tensor itself, which "
        "keep the out projection's and a shared expert's 16-bit inputs rather than FP8 copies (Transformer "
        "Engine 2.6 and later) and allow layernorm and moe_act recompute; blockwise is DeepSeek-V3's")
    grad_dtype: Literal["fp32", "bf16"] = "fp32"
    # the gradients' size on the wire may differ from their size in memory: DeepSpeed's
    # communication_data_type and FSDP's reduce_dtype reduce in 16 bits into fp32 shards
    grad_reduce_dtype: Literal["fp32", "bf16"] | None = None
    # AdamW's decoupled weight decay keeps the same states and makes the same pass: one model
    optimizer: Literal["adam", "adamw"] = "adam"
    optimizer_moments_dtype: Literal["fp32", "bf16"] = pydantic.Field(
        default="fp32", description="Adam's first and second moments: fp32, or bf16 as DeepSeek-V3 kept them "
        "(Megatron-LM's --exp-avg-dtype and --exp-avg-sq-dtype); the master weights stay fp32")
    optimizer_offload: float = pydantic.Field(
        default=0.0, ge=0.0, le=1.0, description="the share of each rank's optimizer shard (fp32 master weights "
        "and moments) kept in host memory and stepped by the CPU, as Megatron-LM's --optimizer-cpu-offload with "
        "--optimizer-offload-fraction: its gradients copied to the host, the CPU's Adam, the weights copied back; "
        "needs parallel.zero >= 1, fp32 moments and the topology's node.host")
    overlap_offload_copies: bool = pydantic.Field(
        default=False, description="pipeline the offloaded shard's copies and CPU steps a backward block's "
        "parameters at a time on their own streams (Megatron-LM's --overlap-cpu-optimizer-d2h-h2d: tensor by "
        "tensor) instead of copying it all, stepping it, copying it back; ignored without optimizer_offload")
    activation_offload_layers: int = pydantic.Field(
        default=0, ge=0, description="keep the activations of the model's first this many layers in host memory "
        "between their forward and their backward, as Megatron-LM's --cpu-offloading with "
        "--cpu-offloading-num-layers (Transformer Engine's offload): each layer's copied down after its forward "
        "and back before its backward; needs pp 1, no recompute and the topology's node.host")
    attention: Literal["flash", "standard"] = "flash"
    recompute: Literal["none", "selective", "full"] = "none"
    # which layers full recompute recomputes, as Megatron-LM's --recompute-method and
    # --recompute-num-layers (program/work.py recompute_groups); unset: every layer alone
    recompute_method: Literal["uniform", "block"] | None = pydantic.Field(
        default=None, description="full recompute: uniform recomputes groups of recompute_layers layers, each "
        "from its first layer's input; block recomputes the first recompute_layers layers of each model chunk "
        "and keeps every activation of the rest")
    # the modules are model.transformer's (one list: the terms each drops)
    recompute_modules: list[Literal[tuple(RECOMPUTE_MODULES)]] | None = \
        pydantic.Field(default=None, min_length=1, description="selective recompute: the parts of each layer run "
                       "again in the backward instead of kept, as Megatron-LM's --recompute-modules (default core_attn)")
    recompute_layers: int | None = pydantic.Field(
        default=None, ge=1, description="full recompute: the layers of a uniform group, or the layers "
        "of each model chunk that block recomputes")
    dp_bucket_params: int = pydantic.Field(default=40_000_000, ge=1)

    @pydantic.field_validator("optimizer_offload", mode="before")
    @classmethod
    def _a_share(cls, v: Any) -> Any:
        """A percent typed for the share (50 for half) is named as such, not as a bound."""
        if isinstance(v, (int, float)) and not isinstance(v, bool) and 1 < v <= 100 and float(v).is_integer():
            raise ValueError(f"is a share from 0 to 1 (0.5 offloads half of each shard), not a percent; got {v}")
        return v

    @property
    def selective_modules(self) -> frozenset:
        """What selective recompute runs again (``recompute_modules``, by default core
        attention); empty under other recompute."""
        if self.recompute != "selective":
            return frozenset()
        return frozenset(self.recompute_modules or ("core_attn",))

    @property
    def recomputes_nothing(self) -> bool:
        """Selective recompute of the attention core alone under flash attention, which keeps
        no scores to recompute: the plan without recompute, run for run."""
        return self.selective_modules == {"core_attn"} and self.attention == "flash"

    @property
    def fp8(self) -> str:
        """The FP8 recipe the model's activation terms follow (``fp8_recipe``), "" outside FP8
        training (model/transformer.py ``fp8_saved_terms``)."""
        return self.fp8_recipe if self.precision == "fp8" else ""

    @property
    def reduced_grad_dtype(self) -> str:
        """The dtype gradients are reduced in: ``grad_reduce_dtype``, or ``grad_dtype`` where
        it is not set."""
        return self.grad_reduce_dtype or self.grad_dtype


class CollectivesCfg(Strict):
    """Algorithm per collective: "auto" picks the applicable one fastest alone at each size."""

    all_reduce: Literal["auto", "ring", "tree", "hierarchical", "nvls", "nvls_tree"] = "auto"
    reduce_scatter: Literal["auto", "ring"] = "auto"
    all_gather: Literal["auto", "ring"] = "auto"
    all_to_all: Literal["auto", "pxn", "pairwise"] = "auto"


class SimulationCfg(Strict):
    network: Literal["flow", "ideal"] = "flow"
    gemm_efficiency: Literal["shape", "flat"] = pydantic.Field(
        default="shape", description="shape: a GEMM's share of the peak follows its shape (tiles and waves over the SMs, "
        "the fixed cost a short reduction pays: hardware.gpus.GemmFit, fitted to published GEMM tables); flat: every "
        "GEMM at the GPU's large-GEMM matmul efficiency, as before shapes were modelled (the grouped experts' reads of every "
        "local expert's weights aside)")
    collapse_symmetric: bool = True
    repeat: bool = pydantic.Field(
        default=True, description="simulate a long 1F1B, interleaved, ZB-H1, ZB-V, DualPipeV or DualPipe step's "
        "repeating microbatches once and copy the cycle in, where its timeline is checked to repeat (clustersim.engine.repeat); "
        "false: simulate every one")
    collectives: CollectivesCfg = CollectivesCfg()
    # a split around fabric faults costs what the refinement makes of it: a rail-optimised
    # DGX leaf's 32 nodes split every class of a 1,024-GPU plan (22-81 s and 2-9 GB against
    # about a second kept in the collapse); 256 ranks take seconds, as the all-ranks runs of
    # tests/test_symmetry.py do. At most the all-ranks limit (MAX_GPUS_ALL_RANKS)
    fabric_fault_split_ranks: int = pydantic.Field(
        default=256, ge=0, le=4_096, description="split the symmetric classes around the GPUs below a fabric fault "
        "or around every GPU on any node whose flows any fault touches, where that split simulates at most this many "
        "ranks; past it the collapse keeps the fault (0: never split)")
    # the same trade for a plan the fabric's leaf groups or pods cut unevenly, counted in the
    # ranks it adds (a straggler's split does not take it away) and set lower: such splits come
    # unasked with the plan, and a sweep or advise runs many. Every fuzz plan the split mended
    # needed at most 24 more ranks (bench/fuzz_fabrics.py 184, plan 27: +15.3 % -> +3.1 %);
    # GPT-3 175B's 8-node stages over DGX-A100 SuperPOD's 20-node units add 16 at 1,024 GPUs
    # (0.8 -> 1.4 s), its advise's PP4 plans 32 for at most 0.05 % (advise 61 s without the
    # split, 97 s at 24, 135 s at 64); at 4,096 and 8,192 GPUs 96 (1.5 -> 18.8 s with 256
    # microbatches, 1.0 -> 4.5 s; the steps 3.2 % and 3.7 % shorter); Megatron-1T 320
    leaf_split_ranks: int = pydantic.Field(
        default=24, ge=0, le=4_096, description="split the symmetric classes where the edges of the fabric's leaf "
        "groups or pods cut a stage's groups or pipeline routes unevenly, so that twins meet routes of one shape, "
        "where that split adds at most this many ranks to those simulated without it; past it the twins move at the "
        "slowest one's pace (0: never split)")
    # DP replicas meet only at the gradient reduction, TP and CP peers every layer: where
    # ECMP hashes the replicas' sends onto different spines, the collapse's one pace for all
    # of them is the slowest one's, and rank by rank each goes its own (docs/architecture.md,
    # "Classes split by DP replica"). Off by default: it simulates pp x dp ranks (GPT-3 175B
    # on 1,024 A100s: 128, `run` in about 6 s, against 32 in 2 s and every rank in two minutes)
    split_replicas: bool = pydantic.Field(
        default=False, description="simulate each data-parallel replica apart, one rank per stage and replica "
        "(pp x dp), its twins only its own TP and CP peers: where ECMP's hashed paths make the replicas' sends "
        "differ, the step comes closer to the rank-by-rank one, where the default collapse moves every replica at "
        "the slowest one's pace")


class ProjectionCfg(Strict):
    """What a whole run costs at this step's speed: tokens to train on, price, power overhead."""

    tokens: float = pydantic.Field(default=1e12, gt=0, le=1e18, description="training tokens of the whole run")
    usd_per_gpu_hour: float | None = pydantic.Field(default=None, ge=0, le=1e6, description="price of one GPU-hour")
    pue: float = pydantic.Field(default=1.0, ge=1.0, le=10.0, description="facility power / IT power")


class ScenarioCfg(Strict):
    name: str = "scenario"
    description: str = ""
    cluster: ClusterRef
    model: DenseModelCfg
    parallel: ParallelCfg = ParallelCfg()
    training: TrainingCfg
    simulation: SimulationCfg = SimulationCfg()
    projection: ProjectionCfg = ProjectionCfg()

    def ranks_differ(self) -> tuple[bool, bool]:
        """(CP ranks run different programs, EP ranks do): unbalanced causal attention, a
        skewed expert load (the pairs EP ranks' experts compute differ: model/moe.py
        ``expert_loads``; padded to capacity they are alike, and each rank counts the mean of
        the real tokens among them). The symmetric classes keep those indices (program/lower.py
        Symmetry)."""
        p, moe = self.parallel, self.model.moe
        return (p.cp > 1 and not p.cp_load_balance,
                p.ep > 1 and moe is not None and moe.ep_load is not None and len(set(expert_loads(moe, p.ep)[0])) > 1)


@dataclass
class Scenario:
    """A validated scenario with its topology resolved. Build with :func:`load_scenario`, a
    changed one with :func:`clustersim.overrides.load_variant` (or ``load_scenario`` of a dict).

    Read-only once made: what is worked out from it is kept (its cluster, mesh, schedule,
    the classes its what-ifs split), so a field set afterwards would simulate the plan it had
    (a larger ``cfg.training.global_batch_size`` gave twice the tokens/s); setting one raises
    AttributeError. (Its ``cfg`` sections are frozen pydantic models already.)"""

    cfg: ScenarioCfg
    topology: TopologyCfg
    source: str
    schedule_text: str | None = None  # contents of parallel.schedule_file (schedule: custom)
    schedule_path: str | None = None  # where it was read from, for error messages

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__ or name not in self.__dataclass_fields__:  # (set by __init__ already; no field)
            what = (f"is read-only once loaded (its {name} is set, and what is worked out from it is kept)"
                    if name in self.__dict__ else f"has no field {name}, and is read-only once loaded")
            raise AttributeError(
                f"a Scenario {what}: "
                f"make the changed plan with clustersim.load_variant(path, [(\"parallel.tp\", 4)]) or "
                f"clustersim.load_scenario(a dict)")
        object.__setattr__(self, name, value)

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
        return cluster_of(self.topology)

    @cached_property
    def mesh(self) -> Mesh:
        return mesh_of(self.parallel)

    @cached_property
    def split_faults(self) -> tuple[frozenset[int], int]:
        """(the faulty GPUs the symmetric classes split around, the simulated ranks a split
        around every GPU the faults reach would take where it is not made, else 0). The GPUs
        a fault on a node's own cables touches (:attr:`node_touched_gpus`) always split (the
        scenario check refuses a split past the all-ranks limit); the others the faults
        reach, below a fabric fault (:attr:`fabric_touched_gpus`) or anywhere
        (:attr:`reached_gpus`), split where the split simulates at most
        ``simulation.fabric_fault_split_ranks``, else those below a fabric fault alone where
        that fits, else none: the collapse keeps them, its orbits moving at their slowest
        twin's pace (docs/architecture.md, "Classes split around faults")::

            own | fabric | reached     where its split fits (always on a cluster that small),
                                       or has the classes own's alone has
            own | fabric               else, where its split fits
            own                        else
        """
        cluster = self.cluster
        own = self.node_touched_gpus
        fabric = own | self.fabric_touched_gpus
        wide = fabric | self.reached_gpus
        most = self.cfg.simulation.fabric_fault_split_ranks
        if wide == own or cluster.num_gpus <= most:
            return wide, 0

        def ranks(gpus: frozenset[int]) -> int:
            return self._split_ranks(gpus, self.straggler_mates)

        n = ranks(wide)
        if n <= most:
            return wide, 0
        if fabric != own and ranks(fabric) <= most:
            return fabric, n
        # the node's own split is made whatever it costs: where it has as many classes as the
        # wide one (the same classes, since a wider split refines a narrower one), nothing is kept
        return (wide, 0) if ranks(own) == n else (own, n)

    @cached_property
    def node_touched_gpus(self) -> frozenset[int]:
        """The GPUs a fault on their own node's cables splits from their twins under this
        plan: of ``Cluster.fault_gpus`` (every GPU of such a node), those whose flows cross
        the faulty cable or share a link with a flow that does (engine/network.py
        ``fault_crossers``). The others' traffic takes the paths their twins' takes, so they
        stay in their classes: a NIC cable at half bandwidth under TP8 x PP x DP on rails
        splits around one GPU instead of its node's eight (GPT-3's 1,024 GPUs: 64 simulated
        ranks instead of 256, where the GPUs the fault reaches elsewhere do not split too:
        :attr:`split_faults`).
        """
        return self._touched(self.cluster.fault_cables)

    @cached_property
    def straggler_mates(self) -> frozenset[int]:
        """The GPUs that share a NIC with a slow GPU of their node (``what_if: [{gpu,
        slowdown}]``) and send over it under this plan: their own flows cross the NIC's cable
        to its leaf, which a flow of the slow GPU crosses (engine/network.py
        ``straggler_mates``). Each is a class of its own, as a GPU a fault touches is
        (program/lower.py ``Symmetry``): the slow GPU's sends leave late beside its mates'
        where their twins on other nodes leave beside sends that start together. Merged with
        those twins, the mates' sends moved as if none came late (TP1 x PP2 x DP32 on DGX
        H100s with one NIC each, a GPU at 1.3x: the step 1.07 % long against rank by rank,
        the straggler's cost 2.6 times the all-ranks one). Empty without slow GPUs, on nodes
        with a NIC a GPU, and where the split with them would simulate more than the
        MAX_GPUS_ALL_RANKS ranks a run may (a GB200 rack's 72 GPUs on one NIC): the
        classes are then split as without them, close rather than exact, not refused."""
        cluster = self.cluster
        slow = sorted(g for g, f in cluster.gpu_slowdown.items() if f != 1.0 and g < self.mesh.world_size)
        if not slow:
            return frozenset()
        from .engine.network import straggler_mates

        mates = frozenset().union(*straggler_mates(cluster, self._fault_groups, slow).values())
        if mates and self.mesh.world_size > MAX_GPUS_ALL_RANKS \
                and self._split_ranks(self.node_touched_gpus, mates) > MAX_GPUS_ALL_RANKS:
            return frozenset()
        return mates

    def _split_ranks(self, faulty: frozenset[int], mates: frozenset[int]) -> int:
        """How many ranks the classes split around this plan's slow GPUs, ``faulty`` GPUs and a
        slow GPU's ``mates`` simulate (program/lower.py ``Symmetry.split_count``)."""
        from .program.lower import Symmetry, shift_dims

        cluster = self.cluster
        return Symmetry.split_count(self.mesh, cluster.gpu_slowdown, faulty, *self.cfg.ranks_differ(),
                                    cluster.gpus_per_node, cluster.pair_tiers, self.parallel.schedule == "interleaved",
                                    self.cfg.simulation.split_replicas, mates, shift_dims(self.parallel),
                                    cluster.gpus_per_nic)

    @cached_property
    def fabric_touched_gpus(self) -> frozenset[int]:
        """The same of the fabric's faults: of the GPUs of the nodes below a degraded leaf or
        pod-spine uplink (``Cluster.fabric_fault_gpus``), those whose flows cross it or meet
        a flow that does (a rail leaf's uplink under TP8: some of the rail's GPUs); every
        one below a removed cable or switch."""
        return self._touched(self.cluster.fabric_fault_cables)

    @property
    def reached_gpus(self) -> frozenset[int]:
        """Every GPU the faults (a node's cables or the fabric's) touch, on any node: its flows
        cross a degraded cable or share a link with flows that do or that a removal moved
        (engine/network.py ``fault_reach``); a slowed flow takes less of every link it
        crosses, so the others there get more, where their twins elsewhere do not. Empty
        without faults, or where :attr:`reach_asked` is false (then only the GPUs the faults
        marked are asked: :attr:`node_touched_gpus`, :attr:`fabric_touched_gpus`)."""
        return self._reach or frozenset()

    @property
    def reach_asked(self) -> bool:
        """Whether :attr:`reached_gpus` was worked out: there are faults, and the plan's groups
        have at most ``REACH_PAIRS_ROUTED`` pairs of GPUs to route."""
        return self._reach is not None

    @cached_property
    def _reach(self) -> frozenset[int] | None:
        faults = self.cluster.fault_cables + self.cluster.fabric_fault_cables
        if not faults:
            return None
        from .engine.network import fault_reach

        got = fault_reach(self.cluster, self._fault_groups, faults)
        return None if got is None else frozenset(got)

    @cached_property
    def _fault_groups(self) -> list:
        """The plan's communication groups a fault's reach is routed over, rows of ranks per
        kind (``refine_dims``): made once for the node's, the fabric's and the whole reach."""
        from .program.lower import refine_dims

        return [self.mesh.group_rows(d) for d in refine_dims(self.mesh)]

    def _touched(self, faults: list) -> frozenset[int]:
        if not faults:
            return frozenset()
        from .engine.network import fault_crossers

        return frozenset(fault_crossers(self.cluster, self._fault_groups, faults))

    @property
    def splits_replicas(self) -> bool:
        """Whether ``simulation.split_replicas`` splits anything: it is set and there are DP
        replicas to simulate apart (the lowering, the summary and the memory check read it)."""
        return self.cfg.simulation.split_replicas and self.parallel.dp > 1

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
        opts = {"v": p.vpp, "group": p.vpp_group} if p.schedule == "interleaved" else {}
        if p.ep_comm_overlap:  # (checked: interleaved, or 1f1b at pp=1)
            opts["combined"] = True
        return build_schedule(p.schedule, p.pp, self.microbatches, **opts)

    def check_schedule(self) -> None:
        """Build the schedule and check it against the plan (``ConfigError`` naming the field),
        unless :func:`load_scenario` did: the last check of loading, which it may leave to the
        caller (its ``check_schedule``)."""
        if not self.__dict__.get("_schedule_checked"):
            _check_schedule(self)
            self.__dict__["_schedule_checked"] = True

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


MAX_GPUS_ALL_RANKS = 4_096  # every rank simulated (no symmetric collapse): minutes at this size


# the ClusterRef fields that override a topology section, and that section's model's name
_OVERRIDES = {"node": "NodeCfg", "fabric": "FabricCfg"}


def scenario_json_schema() -> dict[str, Any]:
    """The JSON schema of the scenario format (``clustersim schema``): ``ScenarioCfg``'s, with
    ``cluster.node`` and ``cluster.fabric`` described as what they are, overrides of the
    topology's node and fabric sections merged key by key: the topology's fields (nested
    ones too), every one optional and without a default, since a key left out keeps the
    topology file's value::

        TopologyCfg  node: NodeCfg {gpus, nvlink: LinkCfg, nics, nic: NicCfg, pcie_GBps}
        scenario     cluster.node: NodeCfgOverride {the same, none required, no defaults} | null
    """
    schema = ScenarioCfg.model_json_schema()
    topo = TopologyCfg.model_json_schema()["$defs"]
    todo, made = list(_OVERRIDES.values()), {}
    while todo:  # each section's model and the models it nests
        name = todo.pop()
        if name not in made:
            made[name] = _partial(topo[name])
            todo += re.findall(r"#/\$defs/(\w+)Override", repr(made[name]))
    schema["$defs"].update({f"{name}Override": d for name, d in sorted(made.items())})
    fields = schema["$defs"]["ClusterRef"]["properties"]
    for key, name in _OVERRIDES.items():
        fields[key]["anyOf"] = [{"$ref": f"#/$defs/{name}Override"}, {"type": "null"}]
    return schema


def _partial(node: Any) -> Any:
    """A JSON schema ``node`` with no field required and no default, its references to other
    models' partial forms (``#/$defs/X`` -> ``#/$defs/XOverride``)."""
    if isinstance(node, list):
        return [_partial(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _partial(v) for k, v in node.items() if k not in ("required", "default")}
    if "$ref" in out:
        out["$ref"] += "Override"
    if "title" in out and "properties" in out:
        out["title"] += "Override"
    return out


def every_rank_refusal(world: int) -> str | None:
    """Why every one of ``world`` ranks may not be simulated (past MAX_GPUS_ALL_RANKS), or
    None: for ``simulation.collapse_symmetric: false`` here and for ``--all-ranks`` (api.simulate)."""
    if world <= MAX_GPUS_ALL_RANKS:
        return None
    return (f"simulating every one of {world:,} ranks would take hours and many GB; keep the symmetric collapse on "
            f"(exact on symmetric placements) or use at most {MAX_GPUS_ALL_RANKS:,} GPUs")
MAX_MICROBATCHES = 65_536  # per pipeline and step: the schedule holds an action per microbatch and stage
MAX_LAYERS = 10_000  # the program holds blocks per layer, microbatch and stage
# (MAX_GPUS, imported above, is the topology's: the cluster graph and routes are built in memory)
MAX_STAGE_PASSES = 65_536  # pp * vpp * m: the schedule is built when the scenario is checked (~2 s here)
MAX_SCHEDULE_FILE_BYTES = 2 * 1024 * 1024  # a custom schedule is parsed whole (~0.5 MB/s)


def _check_plan(cfg: ScenarioCfg, topo: TopologyCfg, source: str) -> None:
    """Cross-section rules that no single section can check alone."""
    m, p, t = cfg.model, cfg.parallel, cfg.training

    def fail(field: str, msg: str):
        raise ConfigError(msg, source=source, field=field)

    world = topo.nodes * topo.node.gpus
    if world > MAX_GPUS:
        fail("cluster.nodes", f"{topo.nodes} nodes x {topo.node.gpus} GPUs = {world:,} GPUs; clustersim builds the "
                              f"cluster graph in memory and takes at most {MAX_GPUS:,} GPUs: use fewer nodes")
    if not cfg.simulation.collapse_symmetric and (why := every_rank_refusal(world)):
        fail("simulation.collapse_symmetric", why)
    if cfg.simulation.split_replicas and cfg.simulation.collapse_symmetric \
            and (n := p.pp * p.dp * (p.cp if cfg.ranks_differ()[0] else 1)) > MAX_GPUS_ALL_RANKS:
        fail("simulation.split_replicas", f"one rank per stage and DP replica is {n:,} simulated ranks, more than the "
                                          f"{MAX_GPUS_ALL_RANKS:,} a run may simulate rank by rank: leave it false")
    _check_split(cfg, world, _slow_gpus(topo, world), set(), "slow GPUs", source, topo.node.gpus,
                 gpus_per_nic=gpus_per_nic(topo.node))
    if p.tp * p.cp * p.pp * p.dp != world:
        dims, vals = ("tp*cp*pp*dp", f"{p.tp}*{p.cp}*{p.pp}*{p.dp}") if p.cp > 1 else ("tp*pp*dp", f"{p.tp}*{p.pp}*{p.dp}")
        other = p.tp * p.cp * p.pp
        # (where the other degrees divide the GPUs, the dp that fills them: what sweep and advise let follow)
        hint = f"; parallel.dp={world // other} fills them" if world % other == 0 else ""
        fail("parallel", f"{dims} = {vals} = {p.tp * p.cp * p.pp * p.dp} does not equal the "
                         f"world size {world} (cluster: {topo.nodes} node{'s' if topo.nodes != 1 else ''} x "
                         f"{topo.node.gpus} GPUs){hint}")
    if m.heads % p.tp:
        fail("parallel.tp", f"tp={p.tp} does not divide model.heads={m.heads}")
    if m.n_kv_heads % p.tp:
        fail("parallel.tp", f"tp={p.tp} does not divide model.kv_heads={m.n_kv_heads}")
    if m.ffn % p.tp:
        ffn = f"model.ffn_hidden={m.ffn}" + ("" if m.ffn_hidden else " (default 4*hidden)")
        fail("parallel.tp", f"tp={p.tp} does not divide {ffn}")
    if p.ep > 1 and m.moe is None:
        fail("parallel.ep", f"ep={p.ep} needs a mixture-of-experts model (model.moe)")
    if p.etp is not None and m.moe is None:
        fail("parallel.etp", f"etp={p.etp} splits routed experts; it needs a mixture-of-experts model (model.moe)")
    if m.moe is not None:
        if m.moe.dense_layers_first >= m.layers:
            fail("model.moe.dense_layers_first", f"{m.moe.dense_layers_first} dense layers first leaves no MoE layer "
                                                 f"of model.layers={m.layers}; drop model.moe for a dense model")
        if not any(m.is_moe_layer(ly) for ly in range(m.layers)):
            fail("model.moe.layer_freq", f"no layer is MoE: with dense_layers_first={m.moe.dense_layers_first} it "
                                         f"leaves every one of the {m.layers} layers dense")
        if m.moe.experts % p.ep:
            fail("parallel.ep", f"ep={p.ep} does not divide model.moe.experts={m.moe.experts}")
        et = p.expert_tp
        if p.tp % et:
            fail("parallel.etp", f"etp={et} does not divide tp={p.tp}: an expert's slices lie on TP ranks")
        if p.expert_ranks % p.ep:
            if et == p.tp and p.cp == 1:
                fail("parallel.ep", f"ep={p.ep} does not divide dp={p.dp} (expert parallelism is carved out of DP)")
            terms = ([("(tp / etp)", p.tp // et)] if et < p.tp else []) + ([("cp", p.cp)] if p.cp > 1 else []) \
                + [("dp", p.dp)]
            fail("parallel.ep", f"ep={p.ep} does not divide {' x '.join(n for n, _ in terms)} = "
                                f"{' x '.join(str(v) for _, v in terms)} = {p.expert_ranks}: the ranks of a stage "
                                f"that hold different experts, out of which EP is carved")
        if (p.ep > 1 or et < p.tp) and p.tp > 1 and not p.sp:
            # each TP rank dispatches (or, experts unsplit, computes) its own s/t tokens, which
            # needs them sequence-split
            why = ("as Megatron-LM requires: each TP rank dispatches its own share of the tokens" if p.ep > 1 else
                   "as clustersim models experts split over fewer ranks than TP: each TP rank routes its own share "
                   "of the tokens")
            what = f"expert parallelism (ep={p.ep})" if et == p.tp else f"experts split over fewer ranks (etp={et})"
            fail("parallel.sp", f"{what} with tensor parallelism (tp={p.tp}) needs sequence parallelism "
                                f"(sp: true), {why}")
        if m.moe.expert_ffn % et:
            field = "parallel.etp" if p.etp is not None else "parallel.tp"
            fail(field, f"{field.split('.')[1]}={et} does not divide model.moe.expert_ffn={m.moe.expert_ffn}")
        if m.moe.shared_experts and m.moe.expert_ffn % p.tp:  # shared experts split as the dense MLP
            fail("parallel.tp", f"tp={p.tp} does not divide model.moe.expert_ffn={m.moe.expert_ffn}, which the "
                                f"shared experts split over TP")
        load = m.moe.ep_load
        if load is not None:
            if len(load) != p.ep:
                fail("model.moe.ep_load", f"{len(load)} entries for parallel.ep={p.ep}: one per EP index")
            mean = sum_left(load) / len(load)
            if abs(mean - 1.0) > 1e-6:
                fail("model.moe.ep_load", f"the entries average {mean:.6g}, not 1: each is an EP rank's tokens "
                                          f"relative to the balanced share, so they must average 1")
            # a token picks top_k distinct experts, at most experts/ep of them on one EP rank: a
            # rank takes at most min(top_k, experts/ep) / top_k of its pairs, ep times the balanced share
            local = m.moe.experts // p.ep
            most = min(m.moe.top_k, local) / m.moe.top_k * p.ep
            if max(load) > most * (1 + 1e-9):
                fail("model.moe.ep_load", f"an entry of {max(load):.12g} is more than an EP rank can take: each "
                                          f"token sends top_k={m.moe.top_k} copies to distinct experts, at most "
                                          f"{local} of them on one rank ({m.moe.experts} experts over ep={p.ep}), so "
                                          f"at most {most:.12g} times the balanced share")
        if m.moe.dispatcher == "deepep":
            _check_deepep(cfg, topo.node.gpus, fail)
            sms = lookup_gpu(topo.gpu).sms
            if m.moe.deepep_sms % 2:
                fail("model.moe.deepep_sms", f"{m.moe.deepep_sms} is odd; DeepEP's kernels pair their SMs into "
                                             f"channels (Buffer.set_num_sms asserts an even count)")
            if sms and m.moe.deepep_sms >= sms:
                fail("model.moe.deepep_sms", f"DeepEP's kernels would hold {m.moe.deepep_sms} of the {topo.gpu}'s {sms} "
                                             f"SMs, leaving none to compute (DeepEP's default: 20)")
        elif "deepep_sms" in m.moe.model_fields_set:
            fail("model.moe.deepep_sms", f"the SMs DeepEP's kernels hold; the dispatcher is {m.moe.dispatcher}, not "
                                         f"deepep: drop it or set model.moe.dispatcher: deepep")
        if m.moe.fp8_dispatch and t.precision != "fp8":
            fail("model.moe.fp8_dispatch", f"sends the experts' inputs cast to FP8 for their FP8 GEMMs; "
                                           f"training.precision is {t.precision}: set it to fp8 or drop fp8_dispatch")
        if m.moe.fp8_dispatch and p.ep == 1:
            fail("model.moe.fp8_dispatch", "with parallel.ep=1 no all-to-all carries tokens to the experts: drop "
                                           "fp8_dispatch or set parallel.ep > 1")
    if p.cp > 1:
        chunks = 2 * p.cp if p.cp_load_balance else p.cp
        if m.seq_len % chunks:
            how = f"2*cp = {chunks} chunks (cp_load_balance)" if p.cp_load_balance else f"cp={p.cp} chunks"
            fail("parallel.cp", f"model.seq_len={m.seq_len} does not split into {how}")
        if t.attention != "flash" and p.cp_comm != "all_to_all":  # (the ring and all-gather attend blockwise)
            fail("parallel.cp", f"cp_comm {p.cp_comm} runs blockwise (flash) attention; set training.attention: "
                                f"flash (all_to_all attends whole sequences and runs either)")
        if p.cp_comm in ("all_gather", "all_to_all") and m.mla is not None and m.qk_dim != m.v_dim:
            # (Transformer Engine's attn_forward_func_with_cp asserts it: keys wider than values)
            fail("parallel.cp_comm", f"{p.cp_comm} context parallelism does not run latent attention, whose keys "
                                     f"({m.qk_dim} wide a head) are wider than its values ({m.v_dim}): Transformer "
                                     f"Engine runs it with ring CP (and all_to_all+ring) only; set cp_comm: ring")
        if p.cp_comm == "all_to_all+ring":
            a2a = p.cp_a2a
            if a2a is None or a2a >= p.cp or p.cp % a2a:
                fail("parallel.cp_a2a", f"cp_comm all_to_all+ring all-to-alls inside groups of cp_a2a ranks and "
                     f"rings across them: cp_a2a must divide cp={p.cp} and be below it"
                     + ("" if a2a is None else f" (got {a2a}" + ("; cp_a2a = cp is cp_comm all_to_all" if a2a == p.cp
                                                                  else "") + ")"))
        elif p.cp_a2a is not None:
            fail("parallel.cp_a2a", f"sets the all-to-all groups of cp_comm all_to_all+ring (cp_comm is "
                                    f"{p.cp_comm}); drop it or set cp_comm: all_to_all+ring")
        if p.cp_comm in ("all_to_all", "all_to_all+ring"):
            # each rank attends heads/a2a of the heads TP leaves it (Transformer Engine asserts
            # both head counts divisible by the all-to-all's size)
            a2a, what = (p.cp, "cp") if p.cp_comm == "all_to_all" else (p.cp_a2a, "cp_a2a")
            for field, heads in (("heads", m.heads), ("kv_heads", m.n_kv_heads)):
                if (heads // p.tp) % a2a:
                    fail("parallel.cp" if what == "cp" else "parallel.cp_a2a",
                         f"cp_comm {p.cp_comm} gives each of the {what}={a2a} ranks of an all-to-all a share of the "
                         f"model.{field}={heads} / tp={p.tp} = {heads // p.tp} heads each TP rank holds; "
                         f"{what} does not divide them")
            if not p.cp_load_balance and p.cp_comm == "all_to_all":
                fail("parallel.cp_load_balance", "false changes nothing under cp_comm all_to_all: every rank "
                                                 "attends the whole sequence for its heads; drop it")
    if p.sp and p.tp == 1:
        fail("parallel.sp", "sequence parallelism splits TP's replicated work; it needs tp > 1")
    if p.tp_comm_overlap and not p.sp:
        # the overlap pipelines SP's all-gathers and reduce-scatters (Megatron-LM asserts the same)
        fail("parallel.tp_comm_overlap", "pipelines sequence parallelism's all-gathers and reduce-scatters with "
             "the GEMMs beside them; it needs sp: true" + ("" if p.tp > 1 else f" and tp > 1 (tp={p.tp})"))
    if p.tp_comm_overlap and m.mla is not None:
        fail("parallel.tp_comm_overlap", "pipelining SP's collectives with latent attention's projections "
                                         "(model.mla) is not modelled; drop tp_comm_overlap")
    if p.tp_comm_overlap and (spans := mesh_of(p).nodes_spanned("tp", topo.node.gpus)) > 1:
        # userbuffers map the TP peers' memory over NVLink: one NVLink domain (a node here)
        fail("parallel.tp_comm_overlap", f"Transformer Engine's userbuffers exchange over NVLink inside one node, "
             f"but each TP group here spans {spans} nodes (tp={p.tp}, {topo.node.gpus} GPUs a node, order "
             f"{p.order}); keep TP inside a node or drop the overlap")
    if p.zero_shard is not None:
        n = p.cp * p.dp
        whole = f"cp*dp = {p.cp}*{p.dp} = {n}" if p.cp > 1 else f"dp={p.dp}"
        if p.zero == 0:
            fail("parallel.zero_shard", "sets the ZeRO shard group; zero=0 shards nothing (set zero: 1, 2 or 3)")
        if p.zero_shard < 2 or n % p.zero_shard:
            fail("parallel.zero_shard", f"zero_shard={p.zero_shard} must be at least 2 and divide {whole}: the "
                                        f"ranks that share the states, in groups that replicate them")
        mesh = mesh_of(p)  # (ep and etp divide what they must by now)
        replicas, edp = mesh.size("zr"), mesh.size("edp")
        if mesh.grad_group("edp") == "ezs" and (edp % replicas or edp // replicas < 2):
            # the experts shard over slices of their expert-DP group, as many as the dense replicas
            etp = p.expert_tp
            fold = f"(tp/etp) x {whole} / ep = {p.tp // etp} x {n} / {p.ep}" if etp < p.tp else f"{whole} / ep={p.ep}"
            fail("parallel.zero_shard", f"zero_shard={p.zero_shard} leaves {replicas} replicas of each shard; the "
                                        f"experts' DP group ({fold} = {edp} ranks) must split into "
                                        f"{replicas} shard groups of 2 or more (Megatron-LM's distributed-optimizer "
                                        f"instances split it as they split DP)")
    if p.zero3_keep_gathered and p.zero != 3:
        fail("parallel.zero3_keep_gathered", f"keeps ZeRO-3's gathered parameters between microbatches; zero={p.zero} "
             "does not shard the parameters (set zero: 3, or drop the field)")
    if p.zero_prefetch_layers != 1 and p.zero != 3 and not p.overlap_param_gather:  # (1, the default: harmless)
        fail("parallel.zero_prefetch_layers", "how many units ahead ZeRO-3 (or ZeRO-1/2 with overlap_param_gather) "
             f"gathers parameters; zero={p.zero} gathers none during the step (drop the field)")
    if t.activation_offload_layers:
        _check_activation_offload(cfg, topo, fail)
    _check_offload(cfg, topo, fail)
    if not p.overlap_grad_reduce and p.overlap_param_gather:
        # (Megatron-LM refuses the pair: its parameter gathers are dispatched by the buckets of
        # the overlapped gradient reduction)
        fail("parallel.overlap_grad_reduce", "false does not go with overlap_param_gather: true (Megatron-LM gathers "
                                             "the parameters by the buckets of the overlapped gradient reduction); "
                                             "drop one of them")
    if not p.overlap_grad_reduce and p.zero == 3:
        fail("parallel.overlap_grad_reduce", "ZeRO-3 reduce-scatters each unit's gradients as its backward makes "
                                             "them (the gradients are never whole on a rank); drop the setting "
                                             "or use ZeRO-0 to 2")
    if p.overlap_param_gather and p.zero not in (1, 2):
        fail("parallel.overlap_param_gather", "overlaps ZeRO-1/2's all-gather of the updated parameters; "
             f"zero={p.zero} {'gathers none' if p.zero == 0 else 'gathers them per layer already'}")
    if p.sp and m.seq_len % (p.cp * p.tp):
        # each TP rank keeps s/(cp t) tokens of the norms, residuals and PP sends (Megatron asserts the same)
        over = f"cp*tp = {p.cp * p.tp}" if p.cp > 1 else f"tp={p.tp}"
        fail("parallel.sp", f"sequence parallelism splits model.seq_len={m.seq_len} over {over} ranks; "
                            f"it does not divide")
    if p.pp > m.layers:
        fail("parallel.pp", f"pp={p.pp} is more than model.layers={m.layers}")
    _check_recompute(t, m, fail)
    _check_recompute_modules(t, m, fail)
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
        gpu = lookup_gpu(topo.gpu)
        if gpu.fp8_flops is None:
            fail("training.precision", f"fp8 needs fp8 tensor cores; {topo.gpu} has none")
        if t.fp8_recipe == "mxfp8" and "B200" not in gpu.name:
            fail("training.fp8_recipe", f"mxfp8 needs Blackwell tensor cores; {topo.gpu} has none")
        kept = sorted({"layernorm", "moe_act"} & t.selective_modules)
        if kept and t.fp8_recipe == "delayed":
            # Megatron-LM refuses them: delayed scaling keeps FP8 copies of the recomputed tensors
            fail("training.recompute_modules", f"{' and '.join(kept)} recompute under precision fp8 "
                 f"{'needs' if len(kept) == 1 else 'need'} a recipe other than delayed scaling "
                 "(training.fp8_recipe: tensorwise, blockwise or mxfp8), as Megatron-LM requires")
    elif "fp8_recipe" in t.model_fields_set:
        fail("training.fp8_recipe", "applies to precision: fp8 only")


def _check_offload(cfg: ScenarioCfg, topo: TopologyCfg, fail: Callable[[str, str], None]) -> None:
    """What optimizer offload needs: a sharded optimizer (Megatron-LM offloads the distributed
    optimizer's shards only; DeepSpeed's ZeRO-Offload ZeRO's) and a host to offload to."""
    t, z = cfg.training, cfg.parallel.zero
    if not t.optimizer_offload:  # (overlap_offload_copies then has nothing to overlap: ignored, as Megatron-LM does)
        return
    if z == 0:
        fail("training.optimizer_offload", "offloads each rank's shard of the optimizer states, as Megatron-LM's "
             "distributed optimizer and DeepSpeed's ZeRO do; parallel.zero=0 keeps them whole (set zero: 1, 2 or 3)")
    _need_host(cfg, topo, "training.optimizer_offload", fail)
    if t.optimizer_moments_dtype != "fp32":
        fail("training.optimizer_moments_dtype", f"{t.optimizer_moments_dtype} moments do not go with "
             "training.optimizer_offload: Megatron-LM's offloaded optimizer keeps fp32 moments, on the host and "
             "on the GPU (its HybridDeviceOptimizer takes no moment dtype); drop one of them")


def _need_host(cfg: ScenarioCfg, topo: TopologyCfg, field: str, fail: Callable[[str, str], None]) -> None:
    """An offload's host: the topology's ``node.host``, named where it is missing."""
    if topo.node.host is None:
        removed = isinstance(cfg.cluster.node, dict) and "host" in cfg.cluster.node
        fail(field, "needs the nodes' host memory and copy bandwidth; "
             + ("the scenario's cluster.node.host: null removes the topology's" if removed else
                f"the topology {cfg.cluster.topology} has no node.host (memory_GB, memory_GBps, copy_GBps): add it "
                "there or under cluster.node.host"))


def _check_activation_offload(cfg: ScenarioCfg, topo: TopologyCfg, fail: Callable[[str, str], None]) -> None:
    """What Megatron-LM's layer-level activation offload takes (its TransformerConfig asserts):
    one pipeline stage, no recompute, fewer layers than the model has; here also no MTP module
    (its layers are not the decoder's) and a host to offload to."""
    t, m, field = cfg.training, cfg.model, "training.activation_offload_layers"
    n = t.activation_offload_layers
    if cfg.parallel.pp != 1:
        fail(field, f"offloads the activations of layers on one pipeline stage (Megatron-LM has no CPU offloading "
                    f"with pipeline parallelism); pp={cfg.parallel.pp}")
    if cfg.parallel.schedule != "1f1b":
        fail(field, f"runs each microbatch's forward then its backward on one stage (Megatron-LM without a "
                    f"pipeline); schedule {cfg.parallel.schedule} holds several microbatches: use 1f1b")
    if cfg.parallel.ep_comm_overlap:
        fail(field, "offloads one microbatch's layers between its forward and its backward; combined 1F1B "
                    "(parallel.ep_comm_overlap) runs one microbatch's forward beside another's backward: drop one")
    if t.recompute != "none":
        fail(field, f"offloads what the layers keep for their backward; recompute {t.recompute} does not go with it "
                    "(Megatron-LM refuses both at once): drop one of them")
    if n >= m.layers:
        fail(field, f"{n} layers of model.layers={m.layers}: at most {m.layers - 1} (the last layer's backward "
                    "follows its forward at once; Megatron-LM takes fewer than the layers)")
    if m.mtp_layers:
        fail(field, "does not go with model.mtp_layers (multi-token prediction's layers are not modelled offloaded)")
    _need_host(cfg, topo, field, fail)


def _check_deepep(cfg: ScenarioCfg, gpus_per_node: int, fail: Callable[[str, str], None]) -> None:
    """What a deduplicating dispatch (``model.moe.dispatcher: deepep``) needs: as Megatron-LM's
    flex dispatcher, an EP group to dispatch over (it asserts TP x EP > 1) and no padding to
    capacity; experts whole on each rank (etp 1: with etp > 1 the flex dispatcher sends over
    the TP x EP group, which is not modelled); its own kernels rather than an NCCL all-to-all
    algorithm; an EP group across nodes made of whole nodes in EP rank order (DeepEP's
    internode kernels pair GPUs by local rank, rank // 8 the node); and router groups that
    do not straddle EP ranks, so that every GPU and node is reached alike (the combine's
    flows are then the dispatch's)."""
    moe, p = cfg.model.moe, cfg.parallel
    if p.ep == 1:
        fail("model.moe.dispatcher", "deepep dispatches tokens over the expert-parallel group; it needs parallel.ep > 1")
    if p.expert_tp > 1:
        fail("model.moe.dispatcher", f"deepep is modelled with whole experts on each rank (etp: 1); here "
                                     f"{'etp' if p.etp is not None else 'etp (as tp)'}={p.expert_tp}, and Megatron-LM's "
                                     f"flex dispatcher then sends over the TP x EP group, which clustersim does not model")
    if moe.pad_to_capacity:
        fail("model.moe.dispatcher", "deepep does not pad expert batches to capacity (Megatron-LM's flex dispatcher "
                                     "refuses --moe-pad-expert-input-to-capacity): drop model.moe.pad_to_capacity or "
                                     "use alltoall")
    if cfg.simulation.collectives.all_to_all != "auto":
        fail("simulation.collectives.all_to_all", f"{cfg.simulation.collectives.all_to_all} is an NCCL algorithm; "
                                                  f"model.moe.dispatcher: deepep sends with its own kernels (leave auto)")
    rows = mesh_of(p).group_rows("ep")
    nodes = rows // gpus_per_node
    if (nodes != nodes[:, :1]).any():  # the group leaves a node: whole nodes, in EP rank order
        blocks = nodes.reshape(len(rows), -1, gpus_per_node) if p.ep % gpus_per_node == 0 else None
        if blocks is None or (blocks != blocks[:, :, :1]).any():
            held = sorted({int(c) for c in np.unique(nodes[0], return_counts=True)[1]})
            fail("model.moe.dispatcher", f"deepep's internode kernels pair GPUs by local rank, so an EP group that "
                                         f"spans nodes must hold all {gpus_per_node} GPUs of each, in EP rank order; "
                                         f"here an EP group of {p.ep} holds {' or '.join(map(str, held))} of a node's "
                                         f"{gpus_per_node} (parallel.order: {p.order}): keep EP inside a node or make "
                                         f"it whole nodes")
    if moe.router_groups:
        per_gpu, per_group = moe.experts // p.ep, moe.experts // moe.router_groups
        if per_gpu % per_group and per_group % per_gpu:
            fail("model.moe.router_groups", f"groups of {per_group} experts straddle the EP ranks' {per_gpu} "
                                            f"(router_groups={moe.router_groups}, ep={p.ep}): deepep is modelled with "
                                            f"each rank's experts in one group or whole groups on a rank")


def _check_ep_comm_overlap(cfg: ScenarioCfg, fail: Callable[[str, str], None]) -> None:
    """Combined 1F1B where Megatron-LM runs it (``TransformerConfig``'s checks of
    ``overlap_moe_expert_parallel_comm``): experts over an EP group, interleaving where there is
    a pipeline (its combined schedules are the interleaved one and the one without a
    pipeline), no recompute that runs a layer's dispatch again (full recompute, or the
    ``moe`` module), and one multi-token prediction layer at most."""
    p, t, moe = cfg.parallel, cfg.training, cfg.model.moe
    if moe is None:
        fail("parallel.ep_comm_overlap", "overlaps the expert all-to-alls of one microbatch with another's compute; "
                                         "the model has no experts (model.moe): drop the setting")
    if p.ep == 1:
        fail("parallel.ep_comm_overlap", "overlaps the expert all-to-alls of one microbatch with another's compute; "
                                         "with parallel.ep=1 there are none: set ep > 1 or drop the setting")
    if p.pp > 1 and p.schedule != "interleaved":
        fail("parallel.ep_comm_overlap", f"with pp={p.pp} Megatron-LM combines forwards and backwards in the "
                                         f"interleaved schedule only (schedule is {p.schedule}): set schedule: "
                                         f"interleaved" + (" (dualpipe and dualpipev overlap their own chunks)"
                                                           if p.schedule in ("dualpipe", "dualpipev") else ""))
    if p.pp == 1 and p.schedule != "1f1b":
        fail("parallel.ep_comm_overlap", f"without a pipeline the combined schedule is 1f1b's (schedule is "
                                         f"{p.schedule})")
    if t.recompute == "full":
        fail("parallel.ep_comm_overlap", "does not go with training.recompute: full, which runs each layer's "
                                         "dispatch again inside its backward (Megatron-LM refuses the pair); use "
                                         "selective recompute")
    if t.recompute == "selective" and "moe" in (t.recompute_modules or ()):
        fail("parallel.ep_comm_overlap", "does not go with the moe module in training.recompute_modules, which runs "
                                         "the dispatch again (Megatron-LM refuses the pair)")
    if moe.shared_expert_overlap:
        fail("parallel.ep_comm_overlap", "does not go with model.moe.shared_expert_overlap, whose shared experts "
                                         "run beside their own microbatch's all-to-alls (Megatron-LM refuses the "
                                         "pair): drop one")
    if (cfg.model.mtp_layers or 0) > 1:
        fail("parallel.ep_comm_overlap", f"Megatron-LM combines forwards and backwards with one multi-token "
                                         f"prediction layer at most (model.mtp_layers={cfg.model.mtp_layers})")


def _check_recompute_modules(t: TrainingCfg, m: DenseModelCfg, fail: Callable[[str, str], None]) -> None:
    """``recompute_modules`` only with ``recompute: selective``, each module one the model has."""
    if t.recompute_modules is None:
        return
    if t.recompute != "selective":
        fail("training.recompute_modules", f"chooses what selective recompute runs again; recompute={t.recompute} "
                                           f"(set recompute: selective, or drop the field)")
    for name in t.recompute_modules:
        if name in ("moe", "moe_act", "shared_experts") and m.moe is None:
            fail("training.recompute_modules", f"{name} recomputes part of a MoE layer; the model has none (model.moe)")
        if name == "shared_experts" and m.moe.shared_experts == 0:
            fail("training.recompute_modules", "shared_experts recomputes the shared experts; model.moe.shared_experts "
                                               "is 0 (drop it from the list)")
        if name == "mlp" and not m.has_dense_layers:
            fail("training.recompute_modules", "mlp recomputes a dense MLP; every layer is MoE "
                                               "(model.moe.dense_layers_first: 0): recompute moe instead")
        if name == "mla_up_proj" and m.mla is None:
            fail("training.recompute_modules", "mla_up_proj recomputes latent attention's up projections; the model "
                                               "has none (model.mla)")


def _check_recompute(t: TrainingCfg, m: DenseModelCfg, fail: Callable[[str, str], None]) -> None:
    """``recompute_method`` and ``recompute_layers`` choose full recompute's layers: both or
    neither, and only with ``recompute: full`` (Megatron-LM asks the same of its flags)."""
    method, n = t.recompute_method, t.recompute_layers
    if method is None and n is None:
        return
    field = "training.recompute_method" if method is not None else "training.recompute_layers"
    if t.recompute != "full":
        fail(field, f"chooses the layers full recompute recomputes; recompute={t.recompute} "
                    f"{'recomputes no layer' if t.recompute == 'none' else 'recomputes parts of every layer'}"
                    f" (set recompute: full, or drop the field)")
    if n is None:
        fail("training.recompute_layers", f"recompute_method {method} needs recompute_layers: "
             + ("the layers of each group recomputed from its first layer's input" if method == "uniform"
                else "how many layers of each model chunk to recompute (the rest keep their activations)"))
    if method is None:
        fail("training.recompute_method", f"recompute_layers={n} needs recompute_method: block (the first {n} layers "
                                          f"of each model chunk recomputed, the rest keep their activations) or "
                                          f"uniform (groups of {n} layers, each recomputed from its first layer's input)")
    if n > m.layers:
        fail("training.recompute_layers", f"recompute_layers={n} is more than model.layers={m.layers}")


def _check_schedule_options(cfg: ScenarioCfg, source: str) -> None:
    """The schedule's own parameters, in the scenario's words, before the schedule is built.

    Needs (the schedules' papers and reference code; the schedule layer checks
    the same and is the fallback):
        interleaved   vpp >= 2, pp >= 2, m % pp == 0     (Megatron-LM runs microbatches p at a time;
                      or groups of vpp_group g:          pp <= g <= m, m % g == 0 or m % g >= pp)
        dualpipe      pp even, m even, m >= 2 pp         (the reference DualPipe's asserts)
        zbv           pp >= 2                            (a V over one rank is one stage)
        dualpipev     pp >= 2, m >= 2 pp                 (the reference DualPipeV's assert)
        custom        schedule_file, and only then
    """
    p = cfg.parallel
    m = cfg.training.global_batch_size // (p.dp * cfg.training.micro_batch_size)
    m_is = f"m={m} microbatches (global_batch_size / (dp * micro_batch_size))"

    def fail(field: str, msg: str):
        raise ConfigError(msg, source=source, field=field)

    v = chunks_per_rank(p.schedule, p.vpp)
    if p.pp * v * m > MAX_STAGE_PASSES:
        what = f"pp*2*m ({p.schedule}'s two chunks a rank)" if p.schedule in V_SCHEDULES else "pp*vpp*m"
        fail("training.global_batch_size",
             f"{what} = {p.pp}*{v}*{m} = {p.pp * v * m:,} stage passes per step (m = global_batch_size / "
             f"(dp * micro_batch_size)); the schedule, an action per pass, is built when the scenario is checked "
             f"and clustersim takes at most {MAX_STAGE_PASSES:,}: raise micro_batch_size or dp, or lower pp")

    if p.schedule == "interleaved":
        if p.vpp < 2:
            fail("parallel.vpp", f"schedule interleaved needs vpp >= 2 model chunks per rank; got vpp={p.vpp} "
                                 f"(vpp=1 is plain 1f1b)")
        if p.pp < 2:
            fail("parallel.schedule", f"interleaved needs pp >= 2 pipeline ranks to interleave vpp={p.vpp} "
                                      f"chunks over; got pp={p.pp} (one rank runs its chunks as one stage: use "
                                      f"1f1b, as Megatron-LM requires too)")
        g = p.pp if p.vpp_group is None else p.vpp_group
        if m < p.pp:
            fail("parallel.schedule", f"interleaved needs {m_is} to be at least pp={p.pp} (Megatron-LM runs "
                                      f"them in groups of at least pp per chunk)")
        if p.vpp_group is not None and not p.pp <= g <= m:
            fail("parallel.vpp_group", f"vpp_group={g} microbatches a chunk runs before the next must be from "
                                       f"pp={p.pp} to {m_is}")
        if 0 < m % g < p.pp:
            if p.vpp_group is None:
                fail("parallel.schedule", f"interleaved needs {m_is} to be a multiple of pp={p.pp} (Megatron-LM "
                                          f"runs them in groups of pp per chunk; parallel.vpp_group sets a larger "
                                          f"group, whose last group must hold at least pp)")
            fail("parallel.vpp_group", f"{m_is} in groups of vpp_group={g} leave a last group of {m % g}, fewer "
                                       f"than pp={p.pp}, which Megatron-LM refuses (its ranks would wait on each "
                                       f"other); choose a group that divides m or leaves at least pp")
    elif p.vpp != 1:
        fail("parallel.vpp", f"vpp={p.vpp} is used by schedule interleaved only (schedule is {p.schedule}); "
                             f"leave it at 1")
    elif p.vpp_group is not None:
        fail("parallel.vpp_group", f"vpp_group={p.vpp_group} is used by schedule interleaved only (schedule is "
                                   f"{p.schedule}); leave it out")
    if p.schedule in V_SCHEDULES and p.pp < 2:
        # (not zb-h1: with one stage there is no bubble for its deferred W to fill, and holding
        # every layer's W inputs to the end costs memory and delays the DP reductions)
        fail("parallel.schedule", f"{p.schedule} needs pp >= 2 pipeline ranks for its V; got pp={p.pp} (one rank "
                                  f"runs both chunks as one stage: use 1f1b)")
    if p.schedule == "dualpipev" and m < 2 * p.pp:
        fail("parallel.schedule", f"dualpipev needs {m_is} at least 2*pp={2 * p.pp} (as the reference DualPipeV "
                                  f"asserts)")
    if p.schedule == "dualpipe":
        if p.pp % 2:
            fail("parallel.schedule", f"dualpipe needs an even pp (two directions meet in the middle); got pp={p.pp}")
        if m % 2 or m < 2 * p.pp:
            fail("parallel.schedule", f"dualpipe needs {m_is} even and at least 2*pp={2 * p.pp} (half per "
                                      f"direction, at least pp each)")
    if p.ep_comm_overlap:
        _check_ep_comm_overlap(cfg, fail)
    if p.schedule == CUSTOM and p.schedule_file is None:
        fail("parallel.schedule_file", "schedule custom needs parallel.schedule_file: a file with one row of "
                                       "actions per pipeline rank (see docs/reference.md)")
    if p.schedule != CUSTOM and p.schedule_file is not None:  # (a file without a schedule is custom's)
        fail("parallel.schedule_file", f"is read by schedule custom only (schedule is {p.schedule})")


def _referenced_file(base: Path, name: str, rel_to: str, source: str, field: str, what: str) -> Path:
    """``base / name``: a file the scenario names, relative to ``rel_to`` (its own folder, or
    ``base_dir`` for a dict); a ConfigError naming the field and the resolved path if it is not
    a file."""

    def quoted(s: str) -> str:  # whole, unless absurdly long
        return s if len(s) <= 300 and s.isprintable() else short_repr(s)

    if name.startswith("~"):  # a home folder, as a shell would read it (~/topos/x.yaml)
        name = os.path.expanduser(name)
    where = (quoted(name) if os.path.isabs(name) else
             f"{quoted(name)} (relative to {rel_to}: {quoted(os.path.abspath(base / name))})")
    return given_file(name, what=what, source=source, field=field, base=base, shown=where)


def read_schedule_file(path: Path, source: str, field: str = "parallel.schedule_file") -> str:
    """The text of the custom schedule file ``path`` (UTF-8, at most MAX_SCHEDULE_FILE_BYTES);
    a ConfigError naming ``source`` and ``field`` if it cannot be read as one."""
    try:
        size = path.stat().st_size
        if size > MAX_SCHEDULE_FILE_BYTES:
            raise ConfigError(f"{path} is {size:,} bytes; a custom schedule is parsed whole and clustersim reads at "
                              f"most {MAX_SCHEDULE_FILE_BYTES:,}", source=source,
                              field=field)
        return path.read_text(encoding="utf-8-sig")  # (a byte-order mark, as spreadsheets write, dropped)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not a text file (byte {exc.start} is not UTF-8)", source=source,
                          field=field) from None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}", source=source, field=field) from None


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
        per = {"interleaved": f"pp*vpp = {p.pp}*{p.vpp}", CUSTOM: "the custom schedule's stages",
               **{v: f"2*pp = 2*{p.pp} ({v} places two on each rank)" for v in V_SCHEDULES}}.get(
            p.schedule, f"pp={p.pp}")
        if len(p.layers_per_stage) != n:
            raise ConfigError(f"has {len(p.layers_per_stage)} entries, expected one per model part: {per} = {n} "
                              "(null splits the layers evenly)", source=sc.source, field="parallel.layers_per_stage")
        empty = [i for i, k in enumerate(p.layers_per_stage) if k < 1]
        if empty:
            raise ConfigError(f"entry {empty[0]} is {p.layers_per_stage[empty[0]]}; every model part holds at least "
                              "one layer", source=sc.source, field="parallel.layers_per_stage")
        if sum(p.layers_per_stage) != layers:
            raise ConfigError(f"entries must sum to model.layers={layers} (sum is {sum(p.layers_per_stage)})",
                              source=sc.source, field="parallel.layers_per_stage")
    elif n > layers:
        what = {"interleaved": ("parallel.vpp", f"pp*vpp = {p.pp}*{p.vpp} = {n} model chunks"),
                CUSTOM: ("parallel.schedule_file", f"the custom schedule's {n} stages"),
                **{v: ("parallel.pp", f"2*pp = {n} model chunks ({v} places two on each rank)")
                   for v in V_SCHEDULES}}.get(
            p.schedule, ("parallel.pp", f"pp={p.pp} parts"))
        raise ConfigError(f"{what[1]} need at least one layer each, but model.layers={layers}",
                          source=sc.source, field=what[0])


def _with_what_ifs(topo: TopologyCfg, extra: list) -> TopologyCfg:
    """The topology with the scenario's what-ifs after its own."""
    merged = topo.model_copy(update={"what_if": [*topo.what_if, *extra]})
    merged._source = getattr(topo, "_source", None)
    return merged


def _slow_gpus(topo: TopologyCfg, world: int) -> dict[int, float]:
    """The slow GPUs of ``topo``'s what-ifs, GPU -> slowdown (those on the cluster)."""
    return {w.gpu: w.slowdown for w in topo.what_if if w.gpu is not None and w.slowdown != 1.0 and 0 <= w.gpu < world}


def mesh_of(p: ParallelCfg) -> Mesh:
    """The rank mesh of plan ``p``."""
    order, ep_inner = parse_order(p.order)
    return Mesh(tp=p.tp, dp=p.dp, pp=p.pp, order=order, ep=p.ep, cp=p.cp, ep_inner=ep_inner,
                zero_shard=p.zero_shard or 0, etp=p.expert_tp,
                # (at cp=1 cp_comm and cp_a2a choose nothing, as a sweep over cp may leave them)
                cp_a2a=(p.cp_a2a or 0) if p.cp > 1 and p.cp_comm == "all_to_all+ring" else 0)


def _check_split(cfg: ScenarioCfg, world: int, slow: dict[int, float], faulty: set[int], what: str,
                 source: str, gpus_per_node: int = 0, tiers=None, straggler_mates: frozenset[int] = frozenset(),
                 gpus_per_nic: int = 1) -> None:
    """Refuse stragglers (``slow``: GPU -> slowdown) or faulty nodes' GPUs that would split the
    symmetric classes into more ranks than an all-ranks run may simulate (program/lower.py
    Symmetry)."""
    p = cfg.parallel
    if world <= MAX_GPUS_ALL_RANKS or not (slow or faulty) or not cfg.simulation.collapse_symmetric \
            or p.tp * p.cp * p.pp * p.dp != world or p.tp % p.expert_tp \
            or p.expert_ranks % p.ep:  # (other checks name those)
        return
    from .program.lower import Symmetry, shift_dims

    mesh = mesh_of(p)
    n = Symmetry.split_count(mesh, slow, faulty, *cfg.ranks_differ(), gpus_per_node, tiers, p.schedule == "interleaved",
                             cfg.simulation.split_replicas, straggler_mates, shift_dims(p), gpus_per_nic)
    if n > MAX_GPUS_ALL_RANKS:
        gpus = sorted(set(slow) | set(faulty))
        shown = ", ".join(map(str, gpus[:5])) + (", ..." if len(gpus) > 5 else "")
        also = ", or leave simulation.split_replicas false" if cfg.simulation.split_replicas else ""
        raise ConfigError(f"{what} ({shown}) split the symmetric classes into {n:,} simulated ranks, more than "
                          f"{MAX_GPUS_ALL_RANKS:,}: use fewer stragglers or faults, or a smaller cluster{also}",
                          source=source, field="cluster.what_if")


def topology_changes(cluster: ClusterRef) -> dict[str, Any]:
    """What the scenario's cluster section changes in its topology file: ``nodes``, ``gpu``,
    ``node`` and ``fabric`` where given (the last two merged into the file's key by key,
    :func:`clustersim.hardware.topology.load_topology_cfg`)."""
    return {k: v for k, v in (("nodes", cluster.nodes), ("gpu", cluster.gpu), ("node", cluster.node),
                              ("fabric", cluster.fabric)) if v is not None}


def changed_topology_fields(cluster: ClusterRef, file_data: dict | None = None) -> dict[str, Any] | None:
    """The topology fields the scenario's cluster section changes besides the node count, dotted:
    ``{"node.nic.bw_Gbps": 800}`` (summary.json's ``hardware.changes``); None where none.
    A field set to what the topology file ``file_data`` (as read) already has changes nothing
    and is left out: ``cluster.gpu: A100`` on a file of ``A100-SXM4-80GB`` nodes (the same GPU
    by another of its names), or ``nic.bw_Gbps: 400`` on a file of 400 Gb/s NICs."""
    return {k: v for k, v in _flat_items(topology_changes(cluster))
            if k != "nodes" and v != {} and not _as_in_file(k, v, file_data or {})} or None


def _as_in_file(key: str, value: Any, file_data: dict) -> bool:
    """Whether the topology file (``file_data``, as read) sets ``key`` (dotted) to ``value``;
    GPUs are the same where their names look up the same catalogue entry."""
    here: Any = file_data
    for part in key.split("."):
        if not isinstance(here, dict) or part not in here:
            return False
        here = here[part]
    if key == "gpu" and isinstance(here, str) and isinstance(value, str):
        try:
            return lookup_gpu(here).name == lookup_gpu(value).name
        except KeyError:  # a name the catalogue does not know is reported elsewhere
            return here == value
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731  (400 is 400.0)
    return here == value if number(here) and number(value) else type(here) is type(value) and here == value


def _scenarios_error(exc: ConfigError, overrides: dict[str, Any], topo_path: Path, source: str) -> ConfigError:
    """A topology error as the scenario's where a change of its cluster section made it: the
    field the error names lies under a changed one, or one it changed lies under the field
    (``node.nics`` that no longer divides ``node.gpus``), or the file alone loads; else as it is."""
    changed = [k for k, _ in _flat_items(overrides)]
    field = exc.field or ""
    # certainly the scenario's: the field changed, or one inside it; a change inside the field
    # the error names (node.nics under node) only where the file alone loads
    mine = [k for k in changed if field and (k == field or field.startswith(k + "."))]
    # or a key missing beside one the scenario gave in a nested section (node.host.memory_GB
    # given, node.host.copy_GBps not, on a topology without a host)
    mine = mine or [k for k in changed if field and k.count(".") >= 2 and field.startswith(k.rsplit(".", 1)[0] + ".")]
    if not overrides or not (mine or _fine_alone(topo_path)):
        return exc
    mine = mine or [k for k in changed if field and k.startswith(field + ".")]
    if changed == ["nodes"] or mine == ["nodes"]:
        # (the count cut short, as the message cuts it: 10**400 nodes is one line, not three)
        return ConfigError(f"{exc.message} (topology {topo_path}, cluster.nodes={short_repr(overrides['nodes'])})",
                           source=source, field="cluster.nodes", bad_value=exc.bad_value)
    named = mine or changed
    what = ", ".join(f"cluster.{k}={short_repr(v)}" for k, v in _flat_items(overrides) if k in named)
    return ConfigError(f"{exc.message} (topology {topo_path}, with {what})", source=source,
                       field=f"cluster.{field}" if mine and field else "cluster", bad_value=exc.bad_value)


def _flat_items(data: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """``{"node": {"nic": {"bw_Gbps": 800}}}`` as ``[("node.nic.bw_Gbps", 800)]``."""
    out: list[tuple[str, Any]] = []
    for k, v in data.items():
        key = f"{prefix}{k}"
        out += _flat_items(v, key + ".") if isinstance(v, dict) and v else [(key, v)]
    return out


def _fine_alone(topo_path: Path) -> bool:
    """Whether the topology file loads, what-ifs and all, with its own node count: then an
    error with the scenario's ``cluster.nodes`` is that field's."""
    try:
        load_topology_cfg(topo_path)
    except ConfigError:
        return False
    return True


def _build_checked(topo: TopologyCfg, own: int, source: str, overrides: dict[str, Any] | None = None,
                   topo_path: Path | None = None) -> Cluster | None:
    """Check the what-ifs now (building the cluster when one touches the network), so that a
    misspelt name or a cut-off GPU in the scenario's what-ifs (entries from ``own`` on) names
    the scenario's entry, and one of the topology's own that only the scenario's changes of
    its topology (``overrides``, :func:`topology_changes`) break names them: ``cluster.nodes``
    where the node count is all they change."""
    try:
        return check_what_ifs(topo)
    except ConfigError as exc:
        m = re.match(r"what_if\[(\d+)\](.*)", exc.field or "")
        if m and int(m.group(1)) >= own:
            raise ConfigError(exc.message, source=source,
                              field=f"cluster.what_if[{int(m.group(1)) - own}]{m.group(2)}") from None
        if topo_path is not None:
            # the entry is the file's, not a change's: the scenario's only where the file alone is sound
            entry = ConfigError(f"{exc.field}: {exc.message}", source=exc.source)
            blamed = _scenarios_error(entry, overrides or {}, topo_path, source)
            if blamed is not entry:
                raise blamed from None
        raise _referred(exc, source) from None


def _referred(exc: ConfigError, source: str, read: bool = False) -> ConfigError:
    """``exc``, a topology file's own error (not one :func:`_scenarios_error` made the
    scenario's), told which scenario reads that file: the file and field to mend stay first,
    the scenario that led there follows::

        topologies/my.yaml: node.nic.bw_Gbs: unknown key (the topology of scenarios/x.yaml, cluster.topology)

    ``read``: ``exc`` came of reading the topology file, so that one naming ``source`` is the
    scenario's own file, which names itself in cluster.topology: told so too."""
    if not exc.source or (exc.source == source and not read):
        return exc
    return ConfigError(f"{exc.message} (the topology of {source}, cluster.topology)", source=exc.source,
                       field=exc.field, bad_value=exc.bad_value)


def is_topology_data(data: dict) -> bool:
    """Whether a YAML mapping is a topology's (``gpu``, ``node``) rather than a scenario's
    (``cluster``, ``model``): ``validate`` checks either, and each loader names the other."""
    return not {"cluster", "model"} & data.keys() and bool({"gpu", "node"} & data.keys())


def _exists(path: str) -> bool:
    """Whether ``path`` names a file or folder (False where it cannot name one: too long)."""
    try:
        return Path(path).exists()
    except (OSError, ValueError):
        return False


def load_scenario(src: str | Path | dict[str, Any], *, base_dir: str | Path | None = None,
                  check_schedule: bool = True, source: str | None = None) -> Scenario:
    """Read and validate a scenario from a YAML path or a dict (paths relative to ``base_dir``).
    ``source``: what error messages name a dict by (default ``<dict>``; ``compare`` names a
    variant by its file and changes).
    ``check_schedule=False`` leaves the last check, the one that builds the pipeline schedule
    (:meth:`Scenario.check_schedule`), to the caller: ``clustersim run`` forks the process
    that simulates a shorter step first, which needs no schedule of the whole step
    (clustersim.engine.ahead), and ``simulate`` makes the check first thing after that fork.
    Until it is made, reading the schedule (``schedule``, ``n_parts``, the layer split) may
    raise a ``ScheduleError`` where the check would name the field."""
    if not isinstance(src, (str, os.PathLike, dict)):  # a caller's mistake, not bad input: no ConfigError
        raise TypeError(f"a scenario is a YAML file's path or a dict, not {type(src).__name__}")
    if isinstance(src, dict):
        # (a dict with a source is a scenario file's variant, overrides.load_variant)
        rel_to = ("the scenario's folder" if source else "base_dir") if base_dir else \
            "the current folder (a dict without base_dir)"
        data, source = src, source or "<dict>"
        base = Path(base_dir or ".")
    else:
        if isinstance(src, str) and "\n" in src and not _exists(src):  # (a file's text, read and passed on)
            raise TypeError("a scenario is a YAML file's path or a dict, not the file's text: give the path, or "
                            "load_scenario(yaml.safe_load(text), base_dir=its folder)")
        path = Path(src)
        data, source = read_yaml(path, what="scenario"), str(src)
        base, rel_to = path.parent, "the scenario's folder"
    if is_topology_data(data):
        has = " and ".join(k for k in ("gpu", "node") if k in data)
        raise ConfigError(f"this is a topology file (it has {has}, not cluster and model); give a scenario, "
                          "which names its topology in cluster.topology", source=source)
    cfg = validate(ScenarioCfg, data, source=source)
    topo_path = _referenced_file(base, cfg.cluster.topology, rel_to, source, "cluster.topology", "topology")
    overrides = topology_changes(cfg.cluster)
    try:
        topo = load_topology_cfg(topo_path, overrides or None, build=False)  # what-ifs checked below, merged
    except ConfigError as exc:
        blamed = _scenarios_error(exc, overrides, topo_path, source)
        raise (blamed if blamed is not exc else _referred(exc, source, read=True)) from None
    own = len(topo.what_if)
    if cfg.cluster.what_if:
        topo = _with_what_ifs(topo, cfg.cluster.what_if)
    _check_plan(cfg, topo, source)  # before any graph is built: it refuses clusters too large to build
    _check_schedule_options(cfg, source)
    sc = Scenario(cfg=cfg, topology=topo, source=source)
    if topo.what_if:  # a graph built to check them is kept (``Scenario.cluster`` is cached)
        cluster = _build_checked(topo, own, source, overrides, topo_path)
        if cluster is not None:
            sc.__dict__["cluster"] = cluster
            slow = {g: f for g, f in cluster.gpu_slowdown.items() if f != 1.0}
            _check_split(cfg, cluster.num_gpus, slow, set(sc.node_touched_gpus), "slow GPUs and faulty nodes", source,
                         cluster.gpus_per_node, cluster.pair_tiers, sc.straggler_mates, cluster.gpus_per_nic)
        elif sc.mesh.world_size > MAX_GPUS_ALL_RANKS and (slow := _slow_gpus(topo, sc.mesh.world_size)):
            # slow GPUs alone build no graph to check; the lowering's classes also split by the
            # routes to the pipeline neighbours (Symmetry.tiers), which _check_plan's count could not see
            _check_split(cfg, sc.mesh.world_size, slow, set(), "slow GPUs", source, sc.cluster.gpus_per_node,
                         sc.cluster.pair_tiers, sc.straggler_mates, sc.cluster.gpus_per_nic)
    if cfg.parallel.schedule_file is not None:
        path = _referenced_file(base, cfg.parallel.schedule_file, rel_to, source, "parallel.schedule_file", "schedule")
        # (set here, once the checks above have run on the scenario: Scenario is read-only)
        object.__setattr__(sc, "schedule_path", str(path))
        object.__setattr__(sc, "schedule_text", read_schedule_file(path, source))
    if check_schedule:
        sc.check_schedule()
    return sc
