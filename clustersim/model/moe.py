"""Mixture-of-experts layers: router, routed experts, shared experts, token dispatch bytes.

A MoE layer replaces the dense MLP (Shazeer et al. 2017; Fedus et al. 2022; DeepSeek-V3)::

    x ─ norm2 ─ router ─ top-k ─[all-to-all dispatch]─ experts (grouped GEMM) ─[all-to-all combine]─ +
                    └──────────────── shared experts (dense MLP, no dispatch) ──────────────────────┘

Per TP rank and microbatch, with T tokens, k experts per token, E experts on ep ranks:

    router FLOPs     2 * T * h * E
    expert FLOPs     2 * (3 or 2) * h * f_e * T * k * run / t           (swiglu: gate, up, down)
    dispatch bytes   T * k * run * h * 2        sent by each rank, (ep-1)/ep of it off-rank
    combine bytes    the same back

Balanced routing is the default (every expert receives T*k/E tokens). ``ep_load`` skews it:
the experts of EP rank e are routed ``ep_load[e]`` times the balanced share (mean 1). Routing
is dropless unless ``capacity_factor`` is set; then each expert takes at most ``capacity_factor``
times its balanced share of each rank's tokens and drops the rest before the dispatch, and with
``pad_to_capacity`` its batch is also padded up to that capacity (Megatron-LM's
``--moe-expert-capacity-factor`` and ``--moe-pad-expert-input-to-capacity``,
``topk_softmax_with_capacity``). What EP rank e's experts compute, ``run[e]``, and how much of
it is real tokens, ``real[e]`` (:func:`expert_loads`)::

                        run[e]                real[e]
    dropless            ep_load[e]            ep_load[e]
    capacity c, drop    min(ep_load[e], c)    min(ep_load[e], c)
    capacity c, pad     c                     min(ep_load[e], c)

    expert FLOPs on rank e   x run[e]  (model FLOPs: x real[e])
    dispatch bytes a -> b    S/ep * run[b]          (combine: b -> a, the same)

``dispatcher: deepep`` sends a token once per node and GPU its experts are on instead of once
per expert (:func:`token_reach`, ``collectives.algorithms.deepep_flows``); what a rank hands
in, computes and keeps is the same.
"""

from __future__ import annotations

from dataclasses import replace
from math import comb
from typing import Any, Literal

import pydantic

from ..floats import sum_left
from ..yamlio import Strict
from .transformer import ELEM_BYTES, Op, elementwise_op, matmul_op


class MoeCfg(Strict):
    """The ``model.moe`` section: which layers are MoE and how their experts look."""

    experts: int = pydantic.Field(ge=1, le=2**16, description="routed experts per MoE layer")
    top_k: int = pydantic.Field(ge=1, description="routed experts per token")
    expert_ffn: int = pydantic.Field(ge=1, description="hidden size of one expert's MLP")
    shared_experts: int = pydantic.Field(default=0, ge=0)
    dense_layers_first: int = pydantic.Field(default=0, ge=0, description="the first k layers keep a dense MLP")
    layer_freq: pydantic.PositiveInt | list[Literal[0, 1]] = pydantic.Field(
        default=1, description="which layers are MoE (Megatron-LM's --moe-layer-freq): N, every Nth from layer 0 "
        "(layer i where i % N == 0); or one 0 (dense) or 1 (MoE) per layer, as [0, 1] * 24 for a MoE MLP in every "
        "second layer from layer 1 (Llama 4 Maverick's interleaving)")
    capacity_factor: float | None = pydantic.Field(
        default=None, ge=1.0, description="each expert takes at most this times its balanced share of a rank's "
        "tokens and drops the rest (Megatron-LM's --moe-expert-capacity-factor); null: dropless")
    pad_to_capacity: bool = pydantic.Field(
        default=False, description="pad every expert's batch up to its capacity (Megatron-LM's "
        "--moe-pad-expert-input-to-capacity, GShard's and Switch's fixed shapes): its experts compute and the "
        "all-to-alls carry capacity_factor times the balanced share whatever the routing; needs capacity_factor")
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    ep_load: list[pydantic.PositiveFloat] | None = pydantic.Field(
        default=None, description="tokens routed to each EP rank's experts, relative to balanced routing "
                                  "(one per EP index, mean 1; capacity_factor cuts them)")
    shared_expert_overlap: bool = pydantic.Field(
        default=False, description="run the shared experts beside the all-to-alls: their up projection beside the "
        "dispatch, their down projection beside the combine, their input's gather beside the router (Megatron-LM's "
        "--moe-shared-expert-overlap); needs shared_experts")
    dispatcher: Literal["alltoall", "deepep"] = pydantic.Field(
        default="alltoall", description="alltoall: one copy per (token, expert) over NCCL (Megatron-LM's alltoall "
        "dispatcher); deepep: one copy per token and node across nodes, forwarded over NVLink to the GPUs "
        "holding its experts (DeepEP, Megatron-LM's flex dispatcher)")
    deepep_sms: int = pydantic.Field(
        default=20, ge=0, le=1024, description="SMs DeepEP's kernels hold while they run (dispatcher deepep; DeepEP's "
        "Buffer.num_sms and Megatron-LM's --moe-deepep-num-sms, both 20 by default): inside DualPipe's overlapped "
        "F&B chunks the GEMMs run on the others; 0 takes none")
    fp8_dispatch: bool = pydantic.Field(
        default=False, description="the all-to-alls that carry tokens to the experts (the forward's dispatch, the "
        "backward's gradient of the combine) move FP8 values with an fp32 scale per 128 (DeepSeek-V3's dispatch; "
        "DeepEP's FP8 dispatch): 1 + 4/128 bytes a value instead of 2; those from the experts stay 16-bit. Needs "
        "training.precision: fp8 and parallel.ep > 1")
    router_groups: int | None = pydantic.Field(
        default=None, ge=1, description="group-limited routing: the experts in this many groups of consecutive "
        "experts, of which each token picks router_group_top_k before its top_k experts (DeepSeek-V3: 8)")
    router_group_top_k: int | None = pydantic.Field(
        default=None, ge=1, description="groups a token's experts come from (DeepSeek-V3: 4 nodes)")

    @pydantic.field_validator("layer_freq", mode="before")
    @classmethod
    def _layer_freq(cls, v: Any) -> Any:
        """One message for either form (pydantic's would name its union's branches)."""
        if isinstance(v, list):
            bad = next((i for i, x in enumerate(v) if isinstance(x, bool) or x not in (0, 1)), None)
            if bad is not None:
                raise ValueError(f"a list of 0 (a dense layer) and 1 (a MoE layer); entry {bad} is {v[bad]!r}")
        elif isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"a positive integer N (every Nth layer MoE) or a list of 0 and 1, one per layer "
                             f"(got {v!r})")
        return v

    @pydantic.model_validator(mode="after")
    def _top_k(self):
        if self.top_k > self.experts:
            raise ValueError(f"model.moe.top_k={self.top_k} exceeds model.moe.experts={self.experts}")
        if self.shared_expert_overlap and not self.shared_experts:
            raise ValueError("model.moe.shared_expert_overlap runs the shared experts beside the dispatch and the "
                             "combine; model.moe.shared_experts is 0")
        if self.pad_to_capacity and self.capacity_factor is None:
            raise ValueError("model.moe.pad_to_capacity pads each expert's batch to its capacity; it needs "
                             "model.moe.capacity_factor")
        if self.capacity_factor is not None and self.capacity_factor * self.top_k > self.experts:
            # an expert cannot take more than every token
            raise ValueError(f"model.moe.capacity_factor={self.capacity_factor:g} lets an expert take more than "
                             f"every token: at most experts / top_k = {self.experts / self.top_k:g}")
        groups, top = self.router_groups, self.router_group_top_k
        if (groups is None) != (top is None):
            given, missing = ("router_groups", "router_group_top_k") if top is None else \
                ("router_group_top_k", "router_groups")
            raise ValueError(f"model.moe.{given} needs model.moe.{missing}: group-limited routing picks "
                             f"router_group_top_k of router_groups groups")
        if groups is not None:
            if self.experts % groups:
                raise ValueError(f"model.moe.router_groups={groups} does not divide model.moe.experts={self.experts}")
            if top > groups:
                raise ValueError(f"model.moe.router_group_top_k={top} exceeds model.moe.router_groups={groups}")
            if self.top_k > top * (self.experts // groups):
                raise ValueError(f"model.moe.top_k={self.top_k} exceeds the {top * (self.experts // groups)} experts "
                                 f"of router_group_top_k={top} groups of {self.experts // groups}")
        return self

    @property
    def mats(self) -> int:
        """Weight matrices per expert: gate, up, down for swiglu; up, down for gelu."""
        return 3 if self.mlp == "swiglu" else 2

    def is_moe(self, layer: int) -> bool:
        """Whether model layer ``layer`` (0-based) has a MoE MLP: past ``dense_layers_first``,
        and where ``layer_freq`` puts one (Megatron-LM's ``moe_layer_pattern``: ``i % N == 0``
        for an integer N, else the list's entry)::

            layer_freq 2                 MoE 0 2 4 ...     dense 1 3 5 ...
            layer_freq [0, 1] * 24       MoE 1 3 5 ...     dense 0 2 4 ...   (48 layers)
            dense_layers_first 3         MoE 3 4 5 ...     dense 0 1 2
        """
        freq = self.layer_freq
        return layer >= self.dense_layers_first and (layer % freq == 0 if isinstance(freq, int) else freq[layer] == 1)

    @property
    def padded(self) -> float:
        """Token-expert pairs an expert computes under balanced routing, relative to its
        balanced share: ``capacity_factor`` where batches are padded to capacity, else 1 (a
        capacity of at least the balanced share drops nothing)."""
        return self.capacity_factor if self.pad_to_capacity else 1.0


def expert_loads(moe: MoeCfg, ep: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per EP rank, the token-expert pairs its experts compute (``run``) and the real tokens
    among them (``real``), relative to balanced routing: ``ep_load`` (balanced: 1 each) cut at
    ``capacity_factor`` where set (the tokens beyond an expert's capacity are dropped before
    the dispatch), every rank at capacity where ``pad_to_capacity``::

        ep_load [1.6, 0.8, 0.8, 0.8]    dropless   run = real = [1.6, 0.8, 0.8, 0.8]
        capacity_factor 1.25            drop       run = real = [1.25, 0.8, 0.8, 0.8]
                                        pad        run [1.25] * 4, real [1.25, 0.8, 0.8, 0.8]

    Megatron-LM's ``topk_softmax_with_capacity`` sets each expert's capacity from the routing
    rank's own tokens, so with every rank routing alike each expert keeps
    ``min(load, capacity_factor)`` of every rank's share."""
    load = tuple(moe.ep_load) if moe.ep_load is not None else (1.0,) * ep
    cap = moe.capacity_factor
    real = load if cap is None else tuple(min(x, cap) for x in load)
    return ((cap,) * len(load) if moe.pad_to_capacity else real), real


def expert_params(moe: MoeCfg, hidden: int) -> int:
    """Parameters of one expert's MLP."""
    return moe.mats * hidden * moe.expert_ffn


def moe_layer_mlp_params(moe: MoeCfg, hidden: int) -> int:
    """The MoE part of one layer: router, routed and shared experts (replaces the dense MLP)."""
    return hidden * moe.experts + (moe.experts + moe.shared_experts) * expert_params(moe, hidden)


def moe_active_mlp_params(moe: MoeCfg, hidden: int) -> int:
    """Parameters a token passes through in a MoE layer: router, k routed, all shared experts."""
    return hidden * moe.experts + (moe.top_k + moe.shared_experts) * expert_params(moe, hidden)


def router_fwd(moe: MoeCfg, tokens: float, hidden: int, t: int = 1) -> list[Op]:
    """Router logits, softmax / top-k. Replicated over TP: each of the ``t`` TP ranks routes
    the same tokens, so each executes the whole matmul but holds 1/t of its model FLOPs (the
    model needs it once)."""
    logits = matmul_op("router", tokens, hidden, moe.experts)
    logits = replace(logits, model_flops=logits.flops / t)
    return [logits, elementwise_op("topk", tokens * moe.experts, 3)]


def routed_experts_fwd(moe: MoeCfg, tokens: float, hidden: int, t: int, run: float | None = None,
                       real: float = 1.0, sorts: bool = False, local_experts: int = 1) -> list[Op]:
    """The routed experts' grouped GEMMs on the tokens this rank receives.

    Each rank of the EP group computes E/ep experts on (tokens * k * run) / (E/ep) tokens
    each, i.e. tokens * k * run token-expert pairs in all: independent of ep. ``run`` and
    ``real``: the rank's pairs and the real tokens among them relative to balanced routing
    (:func:`expert_loads`; by default balanced routing's: ``moe.padded`` and 1). Padding is
    executed but is not model work: model FLOPs count the ``real`` pairs.

    ``sorts``: the pairs are sorted by local expert after the dispatch and back before the
    combine, a pass of reads and writes each (Megatron-LM's all-to-all dispatcher with more
    than one local expert: ``sort_chunks_by_idxs`` in ``dispatch_postprocess`` and
    ``combine_preprocess``; DeepEP's flex dispatcher permutes the tokens it received to the
    experts there, and unpermutes them before its combine, alike).

    ``local_experts``: the experts this rank holds, each a product of the grouped GEMM over its
    share of the pairs (balanced among them), each reading its own weights.
    """
    if run is None:
        run = moe.padded
    pairs = tokens * moe.top_k * run
    f = moe.expert_ffn / t
    up = (moe.mats - 1) * f

    def gemm(name: str, k: float, n: float) -> Op:
        op = matmul_op(name, pairs, k, n, local_experts)
        return replace(op, model_flops=op.flops * real / run)

    sort_in, sort_out = ([elementwise_op(name, pairs * hidden, 2)] for name in ("sort_in", "sort_out")) if sorts \
        else ([], [])
    return [
        *sort_in,
        gemm("experts_up", hidden, up),
        elementwise_op("experts_act", pairs * f, 3 if moe.mats == 3 else 2),
        gemm("experts_down", f, hidden),
        *sort_out,
    ]


def permutations(moe: MoeCfg, tokens: float, hidden: int, sent: float) -> tuple[Op, Op]:
    """The permutations around the dispatch on the rank whose ``tokens`` are routed, each a
    pass over the tokens and their ``sent`` x k copies (the share a capacity leaves, or pads
    to: ``expert_loads``): ``permute`` gathers each token's copies in order of their experts
    before the dispatch, ``unpermute`` sums them back, weighted by the router's
    probabilities, after the combine (Megatron-LM's ``permute`` and ``unpermute``,
    ``moe_utils.py``)::

        permute      read T h, write T k sent h          unpermute   read T k sent h, write T h
    """
    elems = tokens * hidden * (1 + moe.top_k * sent)
    return elementwise_op("permute", elems, 1), elementwise_op("unpermute", elems, 1)


SHARED_EXPERT_OPS = ("shared_up", "shared_act", "shared_down")  # the ops of shared_experts_fwd


def shared_experts_fwd(moe: MoeCfg, tokens: float, hidden: int, t: int) -> list[Op]:
    """Shared experts: a dense MLP every token passes through, no dispatch needed."""
    if moe.shared_experts == 0:
        return []
    f = moe.shared_experts * moe.expert_ffn / t
    return [
        matmul_op(SHARED_EXPERT_OPS[0], tokens, hidden, (moe.mats - 1) * f),
        elementwise_op(SHARED_EXPERT_OPS[1], tokens * f, 3 if moe.mats == 3 else 2),
        matmul_op(SHARED_EXPERT_OPS[2], tokens, f, hidden),
    ]


# DeepSeek-V3's FP8 dispatch (arXiv:2412.19437, Sec 3.3.2): the activations before the experts'
# up projections, and the activation gradients before their down projections, are quantized to
# FP8 in tiles of 1 x 128 values, each tile with an fp32 scale, and sent so; the combine and
# the dispatch's gradient stay BF16
FP8_DISPATCH_BYTES = 1 + 4 / 128


def dispatch_bytes(moe: MoeCfg, tokens: float, hidden: int, fp8: bool = False) -> float:
    """Bytes one rank hands to the dispatch all-to-all under balanced dropless routing (16-bit
    hidden states, k copies; with ``fp8``, FP8 values and their scales:
    :data:`FP8_DISPATCH_BYTES` a value); the ranks' loads (:func:`expert_loads`) scale them."""
    return tokens * moe.top_k * hidden * (FP8_DISPATCH_BYTES if fp8 else ELEM_BYTES)


def routing(moe: MoeCfg | None) -> tuple:
    """What the engine needs of a deduplicating dispatch (``collectives.algorithms``'
    ``deepep``): (experts, top_k, router groups, groups a token picks); () for NCCL's
    all-to-all, one copy per (token, expert)."""
    if moe is None or moe.dispatcher != "deepep":
        return ()
    return (moe.experts, moe.top_k, moe.router_groups or 1, moe.router_group_top_k or 1)


def token_reach(experts: int, top_k: int, groups: int, group_top_k: int, held: tuple[int, ...]) -> float:
    """The chance that a token's top-k experts include one of ``held``: the share of tokens
    a GPU (or node) holding those experts receives once per token, as a deduplicating
    dispatch sends it.

    Routing is uniform: a token picks ``group_top_k`` of the ``groups`` groups of consecutive
    experts at random (DeepSeek-V3's node-limited routing, Megatron-LM's group-limited
    routing; one group: no limit), then ``top_k`` distinct experts at random among the
    ``M = group_top_k * E/groups`` they hold. Where the picked groups hold ``s`` of ``held``::

        P(miss | s) = C(M - s, k) / C(M, k)          P(reach) = 1 - E_groups[P(miss | s)]
        no group limit:  P(reach) = 1 - C(E - |held|, k) / C(E, k)

    The expectation over the groups counts, per subset of the groups ``held`` touches, the
    ways to pick the rest among the untouched ones. DeepSeek-V3, 256 experts, top-8, 8 groups
    of which 4: a node holding one group receives 45 % of the tokens (4/8 of them pick its
    group, and 1 - C(96,8)/C(128,8) of those one of its experts), where one copy per
    (token, expert) sends it 8 x 32/256 = 1 copy a token on average.
    """
    size = experts // groups
    picked = group_top_k * size
    per_group: dict[int, int] = {}
    for x in held:
        per_group[x // size] = per_group.get(x // size, 0) + 1
    touched = list(per_group.values())
    # ways[q][s]: subsets of the touched groups with q groups holding s of ``held``
    ways: dict[tuple[int, int], int] = {(0, 0): 1}
    for c in touched:
        nxt = dict(ways)
        for (q, s), w in ways.items():
            if q < group_top_k:
                nxt[(q + 1, s + c)] = nxt.get((q + 1, s + c), 0) + w
        ways = nxt
    others = groups - len(touched)
    miss = sum_left(w * comb(others, group_top_k - q) * comb(picked - s, top_k) for (q, s), w in ways.items())
    return 1.0 - miss / (comb(groups, group_top_k) * comb(picked, top_k))
