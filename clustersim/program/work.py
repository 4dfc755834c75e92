"""Per model part: the blocks of compute between communication points, with their costs.

A *part* is a contiguous slice of layers that one virtual stage of the schedule computes
(one per pipeline rank under GPipe and 1F1B, v per rank under interleaved 1F1B, two per rank
under DualPipe). A block is a run of ops with the blocking communications Megatron TP puts
around it::

    no SP:     [embedding]AR [attn L0]AR [mlp L0]AR ... [head]
    SP:        [embedding]RS AG[attn L0]RS AG[mlp L0]RS ... AG[head]
    backward:  [head]AR [mlp L95]AR [attn L95]AR ... [embedding]      (SP: AG before, RS after)

Two all-reduces per layer forward and two backward (Shoeybi et al. 2019, Fig. 3); sequence
parallelism turns each into a reduce-scatter and an all-gather of the same total bytes and
splits norm/dropout work by t (Korthikanti et al. 2022, Sec 4.2.2). Full recompute puts the
layer's forward, with its communication, at the head of its backward; selective recompute
re-runs core attention only (Korthikanti et al. 2022, Sec 5).

Split backward (zero-bubble schedules, Qi et al. 2023 Sec 2.1): the backward of a linear layer
``Y = X A`` is two GEMMs, ``dX = dY A^T`` (input gradient, on the path to the previous
stage) and ``dA = X^T dY`` (weight gradient, needed only by the optimizer). B keeps everything
on the activation path: the dgrad half of each weight GEMM, elementwise ops, core attention
(QK^T and PV multiply activations, not weights), recompute and all TP communication. W is
the wgrad half of each weight GEMM, with no communication::

    B:  [head: CE, lm_head dX, norm]AR [mlp L95: down dX, act, up dX, norm]AR ...
    W:  [head: lm_head dA] [mlp L95: down dA, up dA] [attn L95: proj dA, qkv dA] ... [embedding]

Each weight GEMM's backward (2x its forward FLOPs and bytes) splits evenly, so B + W costs
what the full backward costs. The embedding's backward only accumulates the table's gradient
(its input is token ids, there is no input gradient), so it is all W.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import Scenario
from ..floats import sum_left
from ..hardware.gpus import GpuSpec
from ..model import transformer as tf
from ..model.transformer import Op
from ..model import moe
from .costs import ADAM_MASTER_BYTES, OFFLOAD_COPY_BYTES, adam_step_time_s, host_copy_s, offload_times_s, ops_time_s

GRAD_BYTES = {"fp32": 4, "bf16": 2}
PARAM_BYTES = 2  # 16-bit weights used by the kernels
MOMENT_BYTES = {"fp32": 4, "bf16": 2}  # an Adam moment (training.optimizer_moments_dtype)


def optimizer_bytes(moments_dtype: str = "fp32") -> int:
    """Optimizer state per parameter: fp32 master weights and Adam's two moments, 12 bytes
    (Rajbhandari et al. 2020, Sec 3.1), 8 with bf16 moments (DeepSeek-V3 Sec 3.3.4)."""
    return ADAM_MASTER_BYTES + 2 * MOMENT_BYTES[moments_dtype]


@dataclass(frozen=True)
class CommItem:
    """A blocking communication of a block, run by the group of mesh dimension ``dim``."""

    op: str  # "all_reduce" | "reduce_scatter" | "all_gather"
    size_bytes: float  # whole tensor (each rank holds size/n of it for RS output and AG input)
    dim: str = "tp"
    load: tuple = ()  # skewed all-to-all: (by source?, factor per group position); see tasks.Comm
    label: str = ""  # its span's name after the op, where not its block's ("AG experts in")


@dataclass(frozen=True)
class Block:
    name: str
    layer: int  # global layer index, -1 for embedding / head
    duration_s: float
    flops: float
    model_flops: float
    params: float  # local parameters whose gradients are final after this block's backward
    pre: tuple[CommItem, ...] = ()  # before the compute, which waits for them
    post: tuple[CommItem, ...] = ()  # after the compute; the next block waits for them
    expert_params: float = 0.0  # routed-expert parameters (reduced over the expert-DP group)
    overlap: tuple[CommItem, ...] = ()  # start with the compute (after ``pre``); the next block waits for them
    # inside an overlapped F&B chunk where communication kernels hold some SMs through it
    # (GpuSpec.chunk_sm_share < 1: DeepEP's under DualPipe); None where they hold none
    chunk_duration_s: float | None = None


@dataclass(frozen=True)
class OffloadChain:
    """One optimizer instance's offloaded step on a part (Megatron-LM steps the dense and the
    routed experts' distributed optimizers one after the other, each a HybridDeviceOptimizer):
    the GPU's Adam over the share it keeps, and (down, step, up) seconds of each piece the
    host steps (costs.offload_times_s): the whole share, or one piece a block's parameters
    where the copies are pipelined."""

    kind: str  # "dense" or "expert"
    gpu_s: float
    pieces: tuple[tuple[float, float, float], ...]
    # each piece's copy, down (gradients) and up (weights) alike: its parameters x 4 B
    piece_bytes: tuple[float, ...] = ()


@dataclass(frozen=True)
class StageWork:
    """The work of one model part (the name is from when a stage held exactly one part)."""

    fwd: tuple[Block, ...]
    bwd: tuple[Block, ...]  # full backward
    optimizer_s: float  # the GPU's Adam over the shard it steps (all but an offloaded share)
    local_params: float  # parameters of this part per TP rank (before ZeRO sharding)
    activation_bytes_per_mb: float
    pp_send_bytes: float
    # the receiving stage's all-gather of a scattered send over its TP group, the whole
    # activation (parallel.pp_scatter_gather; 0: none)
    pp_gather_bytes: float = 0.0
    transient_bytes: float = 0.0  # held for a moment, at any time (CP's K/V while attention runs)
    recompute_bytes_per_mb: float = 0.0  # held while a backward B recomputes a layer (group) of this part
    wgrad_bytes_per_mb: float = 0.0  # held from B to W under a split backward (what the weight gradients read)
    # the layers whose forward full recompute runs again, in the groups recomputed as one (recompute_groups)
    recompute_groups: tuple[tuple[int, ...], ...] = ()
    local_expert_params: float = 0.0  # routed-expert parameters of this part per GPU
    # optimizer offload (training.optimizer_offload): the dense and experts' steps with a share
    # of their shard on the host (offload_chains)
    offload: tuple[OffloadChain, ...] = ()
    # activation offload (training.activation_offload_layers): (layer, bytes a microbatch, seconds
    # of each copy) of every layer of the part whose activations wait in host memory; left out
    # of activation_bytes_per_mb
    offload_acts: tuple[tuple[int, float, float], ...] = ()
    bwd_input: tuple[Block, ...] | None = None  # B of a split backward: input gradient
    bwd_weight: tuple[Block, ...] | None = None  # W of a split backward: weight gradients
    # the halves of a full backward written as B then W (fused): where they differ from the
    # split ones (SP: the re-gathers beside B's compute, not at W's head); None: the same
    fused_input: tuple[Block, ...] | None = None
    fused_weight: tuple[Block, ...] | None = None

    def blocks(self, kind: str, split: bool, fused: bool = False) -> tuple[Block, ...]:
        """Blocks of action ``kind`` (F, B, W); B is the full backward unless ``split``; under a
        split, ``fused``: the B or W of a full backward written as B then W."""
        if kind == "F":
            return self.fwd
        if not split:
            if kind == "W":
                raise ValueError("a W action needs a split backward")
            return self.bwd
        halves = (self.fused_input if kind == "B" else self.fused_weight) if fused else None
        if halves is None:  # (no fused halves of their own: the split ones serve)
            halves = self.bwd_input if kind == "B" else self.bwd_weight
        if halves is None:
            raise ValueError("this StageWork has no split backward (bwd_input / bwd_weight)")
        return halves

    @property
    def recomputed_layers(self) -> tuple[int, ...]:
        """The layers whose forward full recompute runs again, in layer order."""
        return tuple(ly for g in self.recompute_groups for ly in g)

    def grad_blocks(self, split: bool) -> tuple[Block, ...]:
        """The blocks after which gradients are final (``params`` count there): W, or the full B."""
        return self.blocks("W" if split else "B", split)


# Ops with FLOPs multiply an activation by a weight, except core attention (QK^T, PV).
ACTIVATION_GEMMS = ("core_attn",)


def _is_weight_gemm(op: Op) -> bool:
    return op.flops > 0 and op.name not in ACTIVATION_GEMMS


def _half(op: Op, wgrad: bool) -> Op:
    """One half of a weight GEMM's backward: the input gradient's (B) or the weight gradient's
    (W), each half its FLOPs, with its own GEMMs (``tf.backward_gemms`` lists the input
    gradients' first)."""
    cut = len(op.gemms) // 2
    return replace(_scaled(op, 0.5), gemms=op.gemms[cut:] if wgrad else op.gemms[:cut])


# A weight GEMM's backward already cut in two (:func:`tp_overlap_backward`) names its halves
DGRAD, WGRAD = " dgrad", " wgrad"


def _splits(op: Op) -> bool:
    """Whether a backward op is a weight GEMM's whole backward, which B and W share evenly."""
    return _is_weight_gemm(op) and not op.name.endswith((DGRAD, WGRAD))


def split_backward_ops(ops: list[Op]) -> tuple[list[Op], list[Op]]:
    """(input-gradient ops, weight-gradient ops) of a backward: each weight GEMM's backward
    splits evenly into dgrad (B) and wgrad (W); everything else is on the activation path (B).
    A half already cut off (named ``... dgrad`` or ``... wgrad``) goes whole to its side."""
    b = [_half(op, False) if _splits(op) else op for op in ops if not op.name.endswith(WGRAD)]
    return b, weight_grad_ops(ops)


def weight_grad_ops(ops: list[Op]) -> list[Op]:
    """The weight-gradient ops of a backward: :func:`split_backward_ops`'s second list alone."""
    return [_half(op, True) if _splits(op) else op for op in ops if _splits(op) or op.name.endswith(WGRAD)]


def _block(name, layer, ops: list[Op], gpu, precision, params, pre=(), post=(), recompute_ops=(),
           expert_params=0.0, overlap=()) -> Block:
    """A block's cost; ``recompute_ops`` add time and executed FLOPs but no model FLOPs."""
    share = gpu.chunk_sm_share
    return Block(
        name=name, layer=layer,
        duration_s=ops_time_s(list(recompute_ops) + ops, gpu, precision),
        chunk_duration_s=ops_time_s(list(recompute_ops) + ops, gpu, precision, share) if share < 1.0 else None,
        flops=sum_left(o.flops for o in list(recompute_ops) + ops), model_flops=sum_left(o.model_flops for o in ops),
        params=params, pre=tuple(pre), post=tuple(post), expert_params=expert_params, overlap=tuple(overlap),
    )


# The column-parallel GEMMs whose input gradient TP reduces: QKV (MLA: its up projections, or
# its Q projection without a query latent), the MLP's up (and gate) projection, the LM head, a
# multi-token prediction module's projection (Megatron's ColumnParallelLinear)
COLUMN_PARALLEL = ("qkv", "q_up", "q_proj", "kv_up", "up", "lm_head", "mtp_proj")


def column_parallel_at(ops: list[Op]) -> int | None:
    """Where in a block's ops its (last) column-parallel GEMM is, or None."""
    at = [i for i, op in enumerate(ops) if op.name in COLUMN_PARALLEL]
    return at[-1] if at else None


def column_parallel_run(ops: list[Op]) -> range | None:
    """The column-parallel GEMMs that read the block's gathered input, side by side: the last
    one and those right before it (MLA's two up projections, in backward order ``kv_up
    q_up``; one GEMM elsewhere), or None."""
    i = column_parallel_at(ops)
    if i is None:
        return None
    j = i
    while j > 0 and ops[j - 1].name in COLUMN_PARALLEL:
        j -= 1
    return range(j, i + 1)


def tp_overlapped_backward(spec: _Spec, regather: tuple) -> list[tuple] | None:
    """A backward block whose input gradient TP reduces, cut so that the reduction overlaps
    the weight gradient of the column-parallel GEMM it comes from; None where the block has
    no such GEMM. Pieces (name, ops, pre, overlap) in order::

        compute  [out proj, core ... ][QKV dgrad ][QKV wgrad      ][norm]
        tp  [pre]                     [AG input  ][AR / RS of dgrad]         (AG: SP only)

    Megatron-LM's column-parallel linear launches the input gradient's all-reduce (or, with
    SP, its reduce-scatter) asynchronously and computes the weight gradient meanwhile; with
    SP it first re-gathers the sequence-sharded input the forward kept, while the input
    gradient's GEMM runs (Korthikanti et al. 2022, Sec 4.2.2; Megatron-LM
    ``LinearWithGradAccumulationAndAsyncCommunication.backward``). The norm backward after it
    needs the reduced gradient. Without SP the first two pieces are one. (Megatron-LM's
    ``--no-async-tensor-model-parallel-allreduce``, ``parallel.tp_async_allreduce: false``,
    blocks instead without SP: the block is not cut; with SP the reduce-scatter is
    asynchronous always.)"""
    run = column_parallel_run(spec.ops)
    if run is None:
        return None
    gemms = [spec.ops[k] for k in run]  # (MLA's up projections side by side: their halves together)
    before, after = list(spec.ops[:run.start]), list(spec.ops[run.stop:])
    dgrad, wgrad = [_half(g, False) for g in gemms], [_half(g, True) for g in gemms]
    if regather:
        pieces = [(spec.name, before, spec.pre, spec.overlap), (f"{spec.name} dgrad", dgrad, (), regather)]
    else:
        pieces = [(spec.name, before + dgrad, spec.pre, spec.overlap)]
    pieces += [(f"{spec.name} wgrad", wgrad, (), spec.post), (f"{spec.name} norm", after, (), ())]
    # the norm waits for the reduction even where it has nothing to compute
    return [p for p in pieces[:-1] if p[1] or p[2] or p[3]] + pieces[-1:]


# The row-parallel GEMMs whose output TP reduces: the attention's out projection, the MLP's
# down projection (Megatron's RowParallelLinear)
ROW_PARALLEL = ("proj", "down")
# Chunks of a GEMM whose reduce-scatter Transformer Engine pipelines ("pipeline" method; its
# default num_splits)
RS_SPLITS = 4


def _row_parallel_at(ops: list[Op]) -> int | None:
    """Where in a block's ops its first row-parallel GEMM is, or None."""
    return next((i for i, op in enumerate(ops) if op.name in ROW_PARALLEL), None)


def _ring_exchange(name: str, gemm: Op, t: int, chunk_bytes: float) -> list[_Spec]:
    """An all-gather pipelined with the GEMM that reads it, as a ring exchange of ``t`` steps:
    at step k a rank multiplies the sequence chunk it holds while it passes that chunk on to
    its neighbour; the next step multiplies the chunk it received::

        compute  [gemm 0][gemm 1][gemm 2] ... [gemm t-1]
        tp       [shift ][shift ][shift ] ...              each shift: the whole / t

    (Transformer Engine's userbuffers, ``ring_exchange``: ``qkv_fprop``, ``fc1_fprop``,
    ``proj_dgrad``, ``fc2_dgrad``.) The t-1 shifts move the ring all-gather's (t-1)/t of the
    whole; only a step's shift longer than its GEMM chunk shows."""
    piece = _rows(gemm, 1.0 / t)
    shift = (CommItem("shift", chunk_bytes),)
    return [_Spec(f"{name} {k}", [piece], overlap=shift if k < t - 1 else ()) for k in range(t)]


def tp_overlap_forward(spec: _Spec, t: int, ag: tuple, rs: tuple) -> list[_Spec]:
    """A forward block with sequence parallelism's all-gather and reduce-scatter pipelined
    with the GEMMs beside them (Megatron-LM's ``--tp-comm-overlap``, Transformer Engine's
    userbuffers), t = 4 here::

        compute  [norm][qkv 0][qkv 1][qkv 2][qkv 3][core][proj 0][proj 1][proj 2][proj 3][residual]
        tp             [shift][shift][shift]                    [RS 0  ][RS 1  ][RS 2  ][RS 3]

    The all-gather before the column-parallel GEMM is a ring exchange (:func:`_ring_exchange`).
    The row-parallel GEMM runs in :data:`RS_SPLITS` chunks of the sequence, each chunk's
    reduce-scatter beside the next chunk's GEMM (``pipeline``: ``proj_fprop``, ``fc2_fprop``);
    the residual, on the reduced shard, waits for the last. A block without those
    communications (a ring step of context parallelism) is returned as it is. The GEMM
    chunks run at their own shapes' efficiency (:func:`_rows`); the SMs Transformer Engine
    gives the communication are not modelled."""
    out: list[_Spec] = []
    ops, pre, post = list(spec.ops), spec.pre, spec.post
    base = spec.name.split(" ", 1)[0]
    i = column_parallel_at(ops)
    if ag and pre == ag and i is not None:
        if ops[:i]:  # the norm, on the rank's sequence shard
            out.append(_Spec(_piece_name(spec.name, ops[:i]), ops[:i]))
        out += _ring_exchange(f"{base} {ops[i].name}", ops[i], t, ag[0].size_bytes / t)
        ops, pre = ops[i + 1:], ()
    j = _row_parallel_at(ops)
    if rs and post == rs and j is not None:
        if ops[:j]:  # the core attention (the MLP's activation) between the two GEMMs
            out.append(_Spec(_piece_name(spec.name, ops[:j]), ops[:j], pre))
            pre = ()
        piece, name = _rows(ops[j], 1.0 / RS_SPLITS), f"{base} {ops[j].name}"
        # chunk k's reduce-scatter, named for its chunk: beside chunk k+1, the last before the residual
        rs_of = [(CommItem("reduce_scatter", rs[0].size_bytes / RS_SPLITS, label=f"{name} {k}"),)
                 for k in range(RS_SPLITS)]
        # the last chunk's reduce-scatter is its post: queued on the tp stream as the chunk
        # ends, not when the residual is reached (under DualPipe another chunk's communication
        # can come between)
        out += [_Spec(f"{name} {k}", [piece], pre if k == 0 else (), post=rs_of[k] if k == RS_SPLITS - 1 else (),
                      overlap=rs_of[k - 1] if k else ()) for k in range(RS_SPLITS)]
        ops, pre, post = ops[j + 1:], (), ()
    last = out[-1] if out else None
    if last is not None and not (ops or pre or last.post or spec.overlap):
        # nothing to compute after the last chunk (context parallelism's QKV block): the chunk
        # takes the block's parameters and what follows it (its gather of K/V)
        out[-1] = _Spec(last.name, last.ops, last.pre, post, spec.params, spec.expert_params, last.overlap)
    else:  # the residual, once cut from the rest (else the block whole, under its own name)
        out.append(_Spec(_piece_name(spec.name, ops) if out else spec.name, ops, pre, post, spec.params,
                         spec.expert_params, spec.overlap))
    return out


def _piece_name(name: str, ops) -> str:
    """A piece of a forward block cut around its pipelined GEMMs, named for its first op so
    that its spans do not share the block's name with the others' ("attn norm", "attn
    core_attn", "attn residual"; "mlp norm", "mlp act", "mlp residual")."""
    return f"{name} {ops[0].name.rstrip('0123456789')}" if ops else name


def tp_overlap_backward(spec: _Spec, t: int, ag: tuple) -> list[_Spec]:
    """A backward block with sequence parallelism's gather of the output gradient pipelined
    with the row-parallel GEMM's input gradient (``proj_dgrad``, ``fc2_dgrad``), t = 4::

        compute  [residual][proj dgrad 0][proj dgrad 1][proj dgrad 2][proj dgrad 3][proj wgrad, core, qkv ...]
        tp                 [shift       ][shift       ][shift       ]

    The weight gradient reads the gathered gradient after the ring; the rest of the block (the
    column-parallel GEMM's reduce-scatter beside its weight gradient, already overlapped:
    :func:`tp_overlapped_backward`) is as without the overlap."""
    j = _row_parallel_at(spec.ops)
    if not ag or ag[0] not in spec.pre or j is None:
        return [spec]
    # what else the block waited for (context parallelism's gather of K/V) is the core
    # attention's, after the out projection's backward
    rest = tuple(c for c in spec.pre if c != ag[0])
    gemm = spec.ops[j]
    dgrad, wgrad = (replace(_half(gemm, half == WGRAD), name=gemm.name + half) for half in (DGRAD, WGRAD))
    out = [_Spec(_piece_name(spec.name, spec.ops[:j]), spec.ops[:j])] if spec.ops[:j] else []
    out += _ring_exchange(f"{spec.name.split(' ', 1)[0]} {dgrad.name}", dgrad, t, ag[0].size_bytes / t)
    out.append(_Spec(spec.name, [wgrad] + spec.ops[j + 1:], rest, spec.post, spec.params, spec.expert_params,
                     spec.overlap, spec.regather))
    return out


def _tp_comms(t: int, sp: bool, act_bytes: float):
    """(fwd pre, fwd post, bwd pre, bwd post) of a TP-parallel block, by SP or not."""
    if t == 1:
        return (), (), (), ()
    if sp:
        ag, rs = CommItem("all_gather", act_bytes), CommItem("reduce_scatter", act_bytes)
        return (ag,), (rs,), (ag,), (rs,)
    ar = CommItem("all_reduce", act_bytes)
    return (), (ar,), (), (ar,)


def fp8_gathers(items: tuple, fp8: str | bool) -> tuple:
    """``items`` as a Transformer Engine layer runs them under FP8 training: its all-gathers
    move the FP8 copy, one byte a value (the column-parallel layer's input, cast before the
    gather; the gradient of a row-parallel layer's output, cast before the backward's gather),
    its reduce-scatters and all-reduces the 16-bit values; unchanged otherwise."""
    if not fp8:
        return items
    return tuple(replace(c, size_bytes=c.size_bytes / 2) if c.op == "all_gather" else c for c in items)


def holders(schedule, part: int) -> tuple[int, ...]:
    """Pipeline ranks that hold model part ``part`` (two under DualPipe), ascending."""
    return tuple(sorted({schedule.stage_rank[k] for k, q in enumerate(schedule.stage_part) if q == part}))


def head_keeps_embedding_copy(sc: Scenario) -> bool:
    """A tied LM head keeps its own copy of the word embedding (Megatron) when the ranks that
    hold the last part are not those that hold the first: 1F1B with pp > 1, interleaved. Under
    DualPipe ranks 0 and p-1 hold both, so the tie is local. Multi-token prediction embeds the
    next tokens on the last part: a copy there too, its gradient all-reduced with the first's
    as a tied one's (DeepSeek-V3 shares them; DualPipe keeps them on one rank)."""
    s = sc.schedule
    return embedding_shared_with_last_part(sc.model) and holders(s, 0) != holders(s, s.n_parts - 1)


def embedding_shared_with_last_part(m) -> bool:
    """Whether the last part reads the word embedding: a tied head, or multi-token prediction."""
    return m.tied_embeddings or m.mtp_layers > 0


@dataclass(frozen=True)
class _Spec:
    """A block before costing: its ops, communications and parameters."""

    name: str
    ops: list
    pre: tuple = ()
    post: tuple = ()
    params: float = 0.0
    expert_params: float = 0.0
    overlap: tuple = ()
    # what a backward reducing its column-parallel GEMMs' input gradient gathers again for
    # their weight gradient, where not the block's hidden state (MLA's latents, an MTP
    # projection's 2h input)
    regather: tuple | None = None


def cp_attention_shares(cp: int, cp_rank: int, balanced: bool) -> list[float]:
    """Share of this rank's core attention (s/cp queries x s keys) done at each ring step.

    At step j the rank holds the K/V of chunk c = (rank - j) mod cp. Under a causal mask a
    query chunk needs only the keys at or before it. Load-balanced CP (Megatron-LM/Transformer
    Engine: 2*cp chunks, rank i holding chunks i and 2cp-1-i) gives every rank and every step
    the same work. A contiguous split does not: rank i computes a full block for c < i, the
    diagonal half-block for c = i and nothing for c > i::

        contiguous, cp=4      step: 0    1    2    3      total x (A/cp)
            rank 0                  1/4  0    0    0      1/4
            rank 3                  1/4  1/2  1/2  1/2    7/4     = (2i+1)/cp

    The whole (every rank together) stays the unsplit attention A, so plans compare at equal
    work; only its distribution follows the mask.
    """
    if balanced:
        return [1.0 / cp] * cp
    out = []
    for j in range(cp):
        c = (cp_rank - j) % cp
        out.append(2.0 / cp if c < cp_rank else (1.0 / cp if c == cp_rank else 0.0))
    return out


def _scaled(op: Op, share: float) -> Op:
    return replace(op, flops=op.flops * share, bytes=op.bytes * share, model_flops=op.model_flops * share,
                   fp8_cast_elems=op.fp8_cast_elems * share, fp8_grad_elems=op.fp8_grad_elems * share)


def _rows(op: Op, share: float) -> Op:
    """A GEMM op cut by its rows (a sequence chunk): ``share`` of its work, its GEMMs ``share``
    of their m. For forward GEMMs and input gradients, whose m is the tokens (a weight
    gradient's tokens are its k: never cut so)."""
    return replace(_scaled(op, share), gemms=tuple((g, m * share, n, k) for g, m, n, k in op.gemms))


def attention_specs(sc: Scenario, cp_rank: int, params: float, f_pre, f_post, b_pre, b_post):
    """(forward specs, backward specs) of one attention block, with context parallelism.

    cp = 1: one block, TP communication around it. cp > 1, ``cp_comm: ring`` (ring attention;
    Liu et al. 2023, Megatron-LM/Transformer Engine): each rank passes its K/V to the next
    while it computes attention against the K/V it holds, cp steps::

        compute  [qkv][attn step 0][attn step 1] ... [attn step cp-1][proj]
        cp              [shift K/V ][shift K/V ] ...
        backward: the steps in reverse order; the first shifts K/V alone, the middle ones
                  K/V and the dK/dV accumulated so far, the last the dK/dV alone, each beside
                  its step, and the QKV backward waits for that last hop: 2 (cp-1) KV.

    ``cp_comm: all_gather`` (Llama 3, Dubey et al. 2024 Sec 3.3.2): all-gather the K/V of every
    rank, then attention as one kernel; backward gathers them again and reduce-scatters dK/dV::

        compute  [qkv]          [attn + proj]            backward  [attn + proj]          [qkv]
        cp            [AG K/V]                           cp   [AG K/V]            [RS dK/dV]

    ``cp_comm: all_to_all`` (DeepSpeed-Ulysses, Jacobs et al. 2023; Megatron-LM's
    ``--cp-comm-type a2a``, Transformer Engine's ``AttnFuncWithCPAndQKVOA2A``): an all-to-all
    trades the rank's s/cp tokens of every local head for all s tokens of heads/cp of them,
    attention runs whole on those heads, and another all-to-all trades the context back; the
    backward rearranges the saved output with its gradient, and dQ, dK, dV back
    (:func:`cp_all_to_all_bytes`)::

        compute  [qkv]          [attn]          [proj]    backward  [proj]            [attn]          [qkv]
        cp            [A2A QKV]       [A2A ctx]           cp              [A2A O, dO]       [A2A dQKV]

    ``cp_comm: all_to_all+ring`` (Megatron-LM's ``a2a+p2p``, ``--hierarchical-context-parallel-sizes``;
    Transformer Engine's ``AttnFuncWithCPAndKVP2P`` given two groups): the all-to-all inside
    each slice of ``cp_a2a`` CP ranks (``cpa``), then ring attention across the slices
    (``cpr``, ``cp/cp_a2a`` steps) on their tokens for ``heads/(t cp_a2a)`` heads, whose K/V
    chunks are ``KV`` bytes as the plain ring's; the context's all-to-all back before the
    projection, and in the backward dQ, dK, dV's after the ring's last dK/dV hop.
    """
    m, t, cp = sc.model, sc.parallel.tp, sc.parallel.cp
    b, sp = sc.training.micro_batch_size, sc.parallel.sp
    flash = sc.training.attention == "flash"
    ops = tf.attn_block_fwd(m, b, t, flash, sp, cp)
    if cp == 1:
        return ([_Spec("attn", ops, f_pre, f_post, params)],
                [_Spec("attn", tf.block_bwd(ops, flash), b_pre, b_post, params)])
    at = next(i for i, op in enumerate(ops) if op.name == "core_attn")
    qkv, core, out = ops[:at], ops[at], ops[at + 1:]
    kv_bytes = _cp_kv_bytes(sc)  # this rank's K and V
    shares = cp_attention_shares(cp, cp_rank, sc.parallel.cp_load_balance)
    fwd = [_Spec("attn qkv", qkv, pre=f_pre, params=params)]
    bwd = [_Spec("attn proj", tf.block_bwd(out, flash), pre=b_pre)]
    if sc.parallel.cp_comm in ("ring", "all_to_all+ring"):
        ring, proj_pre, qkv_pre = "cp", (), ()
        if sc.parallel.cp_comm == "all_to_all+ring":
            # all-to-all inside each cpa slice of a2a ranks, then ring attention across the
            # slices (cpr, cp/a2a ranks) on s a2a/cp tokens of heads/(t a2a) heads: CP over the
            # ring's ranks of TP's attention over t*a2a (its K/V chunks KV bytes, as above)
            a2a, ring = sc.parallel.cp_a2a, "cpr"
            core = _core_attn(m, b, t * a2a, flash, cp // a2a)
            shares = cp_attention_shares(cp // a2a, cp_rank // a2a, sc.parallel.cp_load_balance)
            to_heads, proj_pre, grads_to_heads, qkv_pre = _heads_traded(sc, "cpa")
            fwd[0] = replace(fwd[0], post=to_heads)
            bwd[0] = replace(bwd[0], post=grads_to_heads)
        shift = (CommItem("shift", kv_bytes, dim=ring),)
        shift_grad = (CommItem("shift", 2 * kv_bytes, dim=ring),)  # K/V and the dK/dV accumulated so far
        for j, share in enumerate(shares):
            last = j == len(shares) - 1
            fwd.append(_Spec(f"attn ring {j}", [_scaled(core, share)], overlap=() if last else shift))
        # the backward walks the ring in the forward's reverse order, from the K/V the forward
        # held last to the rank's own (Transformer Engine, AttnFuncWithCPAndKVP2P.backward): its
        # first step passes K/V alone (no dK/dV yet), the middle ones K/V with the dK/dV so far,
        # the last the dK/dV alone, each beside its step's kernel; the QKV backward waits for
        # that last hop (the next block waits for a block's overlapped sends): 2 (cp-1) KV
        for j, share in enumerate(reversed(shares)):
            edge = j == 0 or j == len(shares) - 1
            bwd.append(_Spec(f"attn ring {j}", tf.block_bwd([_scaled(core, share)], flash),
                             overlap=() if len(shares) == 1 else shift if edge else shift_grad))
        fwd.append(_Spec("attn proj", out, pre=proj_pre, post=f_post))
        bwd.append(_Spec("attn qkv", tf.block_bwd(qkv, flash), pre=qkv_pre, post=b_post, params=params))
        return fwd, bwd
    if sc.parallel.cp_comm == "all_to_all":
        # every rank attends the whole sequence for heads/cp heads: TP's attention over t*cp
        # ranks (config checks cp divides the heads and K/V heads TP leaves)
        core = _core_attn(m, b, t * cp, flash)
        to_heads, to_tokens, grads_to_heads, grads_to_tokens = _heads_traded(sc, "cp")
        fwd[0] = replace(fwd[0], post=to_heads)
        fwd += [_Spec("attn core", [core], post=to_tokens), _Spec("attn proj", out, post=f_post)]
        bwd = [replace(bwd[0], post=grads_to_heads),
               _Spec("attn core", tf.block_bwd([core], flash), post=grads_to_tokens)]
    else:
        whole = cp * kv_bytes
        core = _scaled(core, sum_left(shares))
        fwd[0] = _Spec("attn qkv", qkv, pre=f_pre, post=(CommItem("all_gather", whole, dim="cp"),), params=params)
        fwd.append(_Spec("attn core", [core] + out, post=f_post))
        bwd = [_Spec("attn core", tf.block_bwd([core] + out, flash), pre=b_pre + (CommItem("all_gather", whole, dim="cp"),),
                     post=(CommItem("reduce_scatter", whole, dim="cp"),))]
    bwd.append(_Spec("attn qkv", tf.block_bwd(qkv, flash), post=b_post, params=params))
    return fwd, bwd


def _core_attn(m, b: int, t: int, flash: bool, cp: int = 1) -> Op:
    """The core attention of :func:`tf.attn_block_fwd` over ``t`` TP and ``cp`` CP ranks:
    all-to-all CP's whole-sequence attention on heads/cp heads is TP's over t*cp ranks."""
    return next(op for op in tf.attn_block_fwd(m, b, t, flash, cp=cp) if op.name == "core_attn")


def _heads_traded(sc: Scenario, dim: str) -> tuple[tuple, tuple, tuple, tuple]:
    """The all-to-alls that trade tokens for heads around core attention, over the CP group
    ``dim`` ("cp"; hierarchical CP's slices, "cpa"), each a block's one-item comm tuple, in
    the order they run (:func:`cp_all_to_all_bytes`)::

        forward   QKV to heads          context back to tokens
        backward  output and dO to heads     dQ, dK, dV back to tokens
    """
    qkv, ctx = cp_all_to_all_bytes(sc)
    return tuple((CommItem("all_to_all", size, dim=dim, label=label),) for size, label in (
        (qkv, "attn QKV"), (ctx, "attn context"), (2 * ctx, "attn context and grad"), (qkv, "attn QKV grads")))


def cp_transient_bytes(sc: Scenario) -> float:
    """Buffers CP holds while one layer's attention runs: ring, K/V and dK/dV being received
    and sent (2 x 2 chunks); all-gather, the gathered K/V and the dK/dV before their
    reduce-scatter (2 x cp chunks); all-to-all, the backward's rearranged output and its
    gradient beside dQ, dK, dV in both layouts (2 (QKV + context)); all-to-all+ring, the
    larger of its all-to-all's and its ring's."""
    cp, how = sc.parallel.cp, sc.parallel.cp_comm
    if cp == 1:
        return 0.0
    if how == "all_to_all":
        return 2 * sum_left(cp_all_to_all_bytes(sc))
    if how == "all_to_all+ring":  # the larger of the two, which run one after the other
        return max(2 * sum_left(cp_all_to_all_bytes(sc)), 4 * _cp_kv_bytes(sc))
    return (4 if how == "ring" else 2 * cp) * _cp_kv_bytes(sc)


def cp_all_to_all_bytes(sc: Scenario) -> tuple[float, float]:
    """(QKV, context): what a rank hands to all-to-all CP's two all-to-alls of one layer's
    forward, one microbatch, one TP rank: its s/cp tokens' queries, keys and values of the
    heads TP leaves it, and their context, 16-bit; (cp-1)/cp of each leaves the rank::

        QKV      = 2 b (s/cp) (heads q_dim + kv_width) / t     kv_width = 2 kv_heads d (MLA: heads (d_qk + d_v))
        context  = 2 b (s/cp) heads v_dim / t
    """
    m, t = sc.model, sc.parallel.tp
    tok = sc.training.micro_batch_size * m.seq_len / sc.parallel.cp
    return (tf.ELEM_BYTES * tok * (m.heads * m.qk_dim + tf.kv_width(m)) / t,
            tf.ELEM_BYTES * tok * m.heads * m.v_dim / t)


def _cp_kv_bytes(sc: Scenario) -> float:
    """A CP rank's keys and values of one microbatch, on one TP rank: its s/cp tokens, every
    head's K and V (``transformer.kv_width``), 16-bit."""
    m = sc.model
    return tf.ELEM_BYTES * sc.training.micro_batch_size * (m.seq_len / sc.parallel.cp) * tf.kv_width(m) / sc.parallel.tp


def _per_tp_rank(params: float, whole: float, t: int) -> float:
    """One TP rank's share of ``params``, of which ``whole`` every rank holds whole: the
    rest is split over the ``t`` ranks."""
    return (params - whole) / t + whole


def _fused_halves(b_in: list[Block], b_w: list[Block], moved: list[tuple[int, int]]) -> dict:
    """``fused_input`` and ``fused_weight`` of a part whose split W gathers again, under SP,
    the inputs of its column-parallel GEMMs (``moved``: (B block, W block) pairs): in a full
    backward written B then W those gathers run beside B's compute, as Megatron-LM's backward
    gathers beside the input gradient's GEMM, and W only computes::

        split  B  [dgrad ... ][RS]          W  [AG][wgrad ...]        (W may run much later)
        fused  B  [dgrad ... ][RS]          W  [wgrad ...]
                  [AG .....]

    The last B block's gathers stay at W's head: nothing after them in B would wait for them,
    and W needs them. Empty (the split halves serve) without gathers to move."""
    moved = [(i, j) for i, j in moved if i < len(b_in) - 1]
    if not moved:
        return {}
    f_in, f_w = list(b_in), list(b_w)
    for i, j in moved:
        gathers = b_w[j].pre or b_w[j].overlap
        f_in[i] = replace(b_in[i], overlap=b_in[i].overlap + gathers)
        f_w[j] = replace(b_w[j], pre=(), overlap=())
    return {"fused_input": tuple(f_in), "fused_weight": tuple(f_w)}


# the ops some modules of selective recompute run again (Megatron-LM's --recompute-modules):
# core attention where its backward runs (a checkpoint of its own), the norms' and the
# experts' activation's outputs at the head of the backward of what reads them (discarded
# outputs, recomputed as that module's output gradient arrives); mlp, moe and shared_experts
# run their blocks again whole instead, communication included
RECOMPUTED_OPS = {"core_attn": ("core_attn",), "layernorm": ("norm1", "norm2"), "moe_act": ("experts_act",),
                  "mla_up_proj": ("q_norm", "kv_norm", "q_up", "q_proj", "kv_up")}


def _placed(ops: list[Op], bwd_specs: list) -> list[tuple[Op, ...]]:
    """``ops`` run again in a module's backward, by backward block: core attention at the block
    holding its backward, the others at the first block."""
    placed: list[list[Op]] = [[] for _ in bwd_specs]
    for op in ops:
        at = 0
        if op.name == "core_attn":
            at = next((i for i, spec in enumerate(bwd_specs) if any(o.name == op.name for o in spec.ops)), 0)
        placed[at].append(op)
    return [tuple(p) for p in placed]


def recompute_groups(layers: range, recompute: str, method: str | None = None, n: int | None = None) -> list[range]:
    """The groups of a model part's ``layers`` that full recompute runs forward again, each
    as one at the head of the backward of its last layer, in layer order; a layer in no group
    keeps its activations (Megatron-LM's ``--recompute-method`` and ``--recompute-num-layers``,
    ``TransformerBlock._checkpointed_forward``, per model chunk)::

        layers 0-5 of a chunk          kept from F to B                  recomputed in B
        full (unset, = uniform 1)      the input of each layer           each layer alone
        uniform 2                      the input of layers 0, 2, 4       [0 1] [2 3] [4 5]
        block 2                        the inputs of 0, 1; all of 2-5    [0] [1]

    Empty unless ``recompute: full``."""
    if recompute != "full":
        return []
    if method == "block":
        return [range(ly, ly + 1) for ly in layers[:n]]
    step = n or 1
    return [layers[i:i + step] for i in range(0, len(layers), step)]


def stage_work(sc: Scenario, part: int, gpu: GpuSpec, cp_rank: int = 0, ep_rank: int = 0) -> StageWork:
    """Blocks, optimizer time, local parameters and activation bytes of model part ``part``.

    Part 0 starts with the embedding, the last part ends with the head; the layers are
    ``sc.layers_per_part[part]`` consecutive ones. ``cp_rank`` matters only for context
    parallelism without load balancing (its ranks' attention work differs), ``ep_rank`` (the
    index in the EP group) only for skewed expert load (``model.moe.ep_load``).
    """
    m, t, cp = sc.model, sc.parallel.tp, sc.parallel.cp
    n_parts = sc.n_parts
    sp, recompute = sc.parallel.sp, sc.training.recompute
    b, prec = sc.training.micro_batch_size, sc.training.precision
    flash, fp8 = sc.training.attention == "flash", sc.training.fp8  # (fp8: the recipe, "" outside FP8)
    per_part = sc.layers_per_part
    first_layer = sum(per_part[:part])
    act = 2.0 * b * m.seq_len / cp * m.hidden  # a 16-bit [b, s/cp, h] activation
    # Megatron-LM's scatter/gather of PP sends: a TP rank sends its 1/t and the receiver gathers
    # the rest over NVLink, where each rank would send the whole (SP's sends are sharded already)
    scatter = sc.parallel.pp_scatter_gather and t > 1 and not sp and n_parts > 1
    first, last = part == 0, part == n_parts - 1
    f_pre, f_post, b_pre, b_post = _tp_comms(t, sp, act)
    # SP keeps a column-parallel GEMM's input sequence-sharded: its weight gradient gathers it again
    regather = (CommItem("all_gather", act),) if t > 1 and sp else ()
    # MLA's up projections gather (and reduce the gradient of) the latents, not the hidden state
    a_pre, ab_post, attn_regather = f_pre, b_post, None
    if m.mla is not None:
        per_width = 2.0 * b * m.seq_len / cp  # 16-bit bytes of one value a token
        a_pre, _, _, ab_post = _tp_comms(t, sp, per_width * tf.mla_gathered_width(m))
        # (a split W's re-gather and the up projections' recompute: their inputs, no rotary part)
        attn_regather = (CommItem("all_gather", per_width * tf.mla_gathered_width(m, rope=False)),) \
            if t > 1 and sp else ()
    # the attention's and the dense MLP's gathers (Transformer Engine's layers: FP8 under FP8
    # training; so are the shared experts', MoeBlocks, and the MTP projection's); the head's,
    # the embedding's and the routed experts' stay f_pre and b_pre
    te_pre, te_b_pre = fp8_gathers(a_pre, fp8), fp8_gathers(b_pre, fp8)
    if fp8 and m.mla is not None and te_pre:
        # (the rotary key part beside the latents: Megatron-LM's own gather, 16-bit)
        rope = tf.mla_gathered_width(m) - tf.mla_gathered_width(m, rope=False)
        te_pre = (replace(te_pre[0], size_bytes=te_pre[0].size_bytes + per_width * rope / 2),)
    te_f_pre = fp8_gathers(f_pre, fp8)
    if fp8 and regather:  # a split W's re-gather of the saved FP8 input
        attn_regather = fp8_gathers(attn_regather or regather, fp8)

    mlp_f = tf.mlp_block_fwd(m, b, t, sp, cp)
    mlp_b = tf.block_bwd(mlp_f, flash)
    # per TP rank: the split part over t, the norms and row-parallel biases whole (Megatron)
    per_layer = _per_tp_rank(tf.layer_params(m), tf.layer_replicated_params(m), t)
    mlp_share = (m.hidden * m.ffn * (3 if m.mlp == "swiglu" else 2)) / t
    attn_params, mlp_params = per_layer - mlp_share, mlp_share
    attn_fwd, attn_bwd = attention_specs(sc, cp_rank, attn_params, te_pre, f_post, te_b_pre, ab_post)
    if attn_regather is not None:  # (the block whose backward reduces the latents' gradient)
        attn_bwd = [replace(spec, regather=attn_regather) if spec.post == ab_post else spec for spec in attn_bwd]
    # selective recompute re-runs its modules' ops in backward; under flash attention core
    # attention has nothing to run again, its backward recomputing it anyway (and CP needs
    # flash attention, so the single "attn" block holds the core here)
    modules = sc.training.selective_modules
    rc_names = {name for mod in modules for name in RECOMPUTED_OPS.get(mod, ()) if name != "core_attn" or not flash}
    attn_rc = [o for spec in attn_fwd for o in spec.ops if o.name in rc_names]
    dense_fwd = [_Spec("mlp", mlp_f, te_f_pre, f_post, mlp_params)]
    dense_bwd = [_Spec("mlp", mlp_b, te_b_pre, b_post, mlp_params,
                       regather=fp8_gathers(regather, fp8) if fp8 and regather else None)]
    if sc.parallel.tp_comm_overlap:  # the attention and dense MLP blocks (Transformer Engine layers)
        attn_fwd, dense_fwd = ([piece for spec in specs for piece in tp_overlap_forward(spec, t, te_f_pre, f_post)]
                               for specs in (attn_fwd, dense_fwd))
        attn_bwd, dense_bwd = ([piece for spec in specs for piece in tp_overlap_backward(spec, t, te_b_pre)]
                               for specs in (attn_bwd, dense_bwd))
    attn_rc = _placed(attn_rc, attn_bwd)
    if "mla_up_proj" in modules and m.mla is not None and attn_regather:
        # MLA's up projections run again on the latents, which SP keeps sequence-sharded: the
        # backward gathers them first, as the column-parallel layers' recompute does
        attn_bwd[0] = replace(attn_bwd[0], pre=attn_bwd[0].pre + attn_regather)

    # the word embedding is split over the vocabulary, learned positions are whole (Megatron)
    emb_params = _per_tp_rank(tf.embedding_params(m), tf.position_params(m), t)
    # A tied LM head on a later stage keeps its own copy of the word embedding (Megatron); the
    # final norm is whole on every TP rank.
    copy = m.vocab * m.hidden if head_keeps_embedding_copy(sc) else 0
    # (an untied copy is the multi-token prediction modules' embedding, read by the first's projection)
    mtp_copy = copy / t if m.mtp_layers and not m.tied_embeddings else 0.0
    head_params = _per_tp_rank(tf.head_params(m) + (copy if not mtp_copy else 0), tf.norm_params(m), t)

    emb_f = tf.embedding_fwd(m, b, t, cp)
    head_f = tf.head_fwd(m, b, t, cp)
    emb_post = (CommItem("reduce_scatter" if sp else "all_reduce", act),) if t > 1 else ()
    fwd, bwd, b_in, b_w = [], [], [], []
    moved: list[tuple[int, int]] = []  # (B block, W block) whose re-gathers a fused backward runs in B

    def forward(spec: _Spec, layer: int):
        fwd.append(_block(spec.name, layer, spec.ops, gpu, prec, spec.params, spec.pre, spec.post,
                          expert_params=spec.expert_params, overlap=spec.overlap))

    def backward(spec: _Spec, layer: int, recompute_ops=()):
        """The full backward block and its B (input gradient) and W (weight gradient) halves.

        Where the block's input gradient is reduced over TP (:func:`tp_overlapped_backward`),
        the reduction runs beside its column-parallel GEMM's weight gradient, and under SP
        the W half gathers that GEMM's input first."""
        # (what W gathers again: the block's own, MLA's latents or an MTP projection's 2h
        # input, else the hidden state where the reduction is the block's hidden state's)
        again = spec.regather if spec.regather is not None else regather if b_post and spec.post == b_post else None
        cut = again is not None and (sp or sc.parallel.tp_async_allreduce)
        pieces = tp_overlapped_backward(spec, again) if cut else None
        if pieces is None:
            bwd.append(_block(spec.name, layer, spec.ops, gpu, prec, spec.params, spec.pre, spec.post, recompute_ops,
                              spec.expert_params, spec.overlap))
        else:
            last = len(pieces) - 1
            for k, (name, ops, pre, overlap) in enumerate(pieces):
                bwd.append(_block(name, layer, ops, gpu, prec, spec.params if k == last else 0.0, pre, (),
                                  recompute_ops if k == 0 else (), spec.expert_params if k == last else 0.0, overlap))
        ops_b, ops_w = split_backward_ops(spec.ops)
        b_in.append(_block(spec.name, layer, ops_b, gpu, prec, 0.0, spec.pre, spec.post, recompute_ops,
                           overlap=spec.overlap))
        gathers = again if pieces else ()
        cols = column_parallel_run(spec.ops) if gathers else None
        others = weight_grad_ops([op for i, op in enumerate(spec.ops) if cols is None or i not in cols])
        if gathers:  # a full backward written B then W gathers beside B's compute (Megatron's order)
            moved.append((len(b_in) - 1, len(b_w)))
        if cols is not None and others:
            # the other GEMMs' weight gradients (out proj, MLP down) need no gathered input:
            # they run beside the gather, the column-parallel ones after it
            b_w.append(_block(spec.name, layer, others, gpu, prec, 0.0, overlap=gathers))
            b_w.append(_block(f"{spec.name} wgrad", layer, [_half(spec.ops[k], True) for k in cols], gpu, prec,
                              spec.params, expert_params=spec.expert_params))
        elif ops_w or gathers or spec.params or spec.expert_params:  # (a cut-off dgrad has no W)
            b_w.append(_block(spec.name, layer, ops_w, gpu, prec, spec.params, gathers,
                              expert_params=spec.expert_params))

    moe_blocks = MoeBlocks.build(sc, f_pre, f_post, b_pre, b_post, ep_rank) if m.moe is not None else None

    def mlp_specs(layer: int) -> tuple[list, list]:
        if m.is_moe_layer(layer):
            return list(moe_blocks.fwd_specs), list(moe_blocks.bwd_specs)
        return list(dense_fwd), list(dense_bwd)

    if first:
        fwd.append(_block("embedding", -1, emb_f, gpu, prec, emb_params, post=emb_post))
    # multi-token prediction on the last part: per module, its projection then a layer of its
    # own (layers ``m.layers ..``, after the model's), and the head again on its output
    mtp = m.mtp_layers if last else 0
    module_ops = tf.mtp_proj_fwd(m, b, t, sp, cp)
    lookup_ops, mtp_ops = module_ops[:1], module_ops[1:]  # the next tokens' lookup, then the projection
    mtp_params = _per_tp_rank(tf.mtp_proj_params(m), tf.mtp_replicated_params(m), t)
    # the next tokens' vocabulary-parallel lookup, reduced over TP (scattered under SP) as the
    # first part's is; then the projection, its 2h input gathered over the sequence (SP), its
    # column-parallel output over TP. Backward: the output's gradient gathered (SP), the 2h
    # input's reduced (W gathering the input again under SP), the lookup's gradient gathered (SP)
    mtp_in = _tp_comms(t, sp, 2 * act)
    mtp_lookup = _Spec("mtp embedding", lookup_ops, post=emb_post)
    mtp_lookup_bwd = _Spec("mtp embedding", tf.block_bwd(lookup_ops, flash), pre=b_pre if sp else ())
    # (the projection a Transformer Engine layer: its input's gathers FP8 under FP8 training)
    mtp_fwd = _Spec("mtp proj", mtp_ops, fp8_gathers(mtp_in[0], fp8), (CommItem("all_gather", act),) if t > 1 else (),
                    mtp_params)
    mtp_bwd = _Spec("mtp proj", tf.block_bwd(mtp_ops, flash), b_pre, mtp_in[3], mtp_params,
                    regather=fp8_gathers((CommItem("all_gather", 2 * act),), fp8) if t > 1 and sp else ())
    if last:
        # the head's input is sequence-sharded under SP: gather it; backward scatters the grad.
        # The head's gradient is whole after the last module's run of it (its parameters there)
        backward(_Spec("head", tf.block_bwd(head_f, flash), post=b_post, params=0.0 if mtp else head_params), -1)
        for k in range(mtp):  # (the model's head again: "head mtp", ZeRO-3's head unit)
            backward(_Spec("head mtp", tf.block_bwd(head_f, flash), post=b_post,
                           params=head_params if k == mtp - 1 else 0.0), -1)
    layers = range(first_layer, first_layer + per_part[part] + mtp)
    for layer in layers:
        if layer >= m.layers:  # (the first module's lookup holds the embedding copy the modules read)
            forward(replace(mtp_lookup, params=mtp_copy if layer == m.layers else 0.0), layer)
            forward(mtp_fwd, layer)
        for spec in attn_fwd + mlp_specs(layer)[0]:
            forward(spec, layer)
    # the model's layers by the method; each MTP module's layer a group of its own (block: none)
    model_layers = range(layers.start, min(layers.stop, m.layers))
    groups = recompute_groups(model_layers, recompute, sc.training.recompute_method, sc.training.recompute_layers)
    if recompute == "full" and sc.training.recompute_method != "block":
        groups += [range(ly, ly + 1) for ly in layers if ly >= m.layers]
    group_ending = {g[-1]: g for g in groups}
    def rerun(name: str, layer: int, rc_ops, pre=(), post=(), overlap=()):
        """A forward run again at the head of a backward: B's (it feeds the input gradient)."""
        # (an all-to-all named for the block it follows, where it runs beside another: the
        # shared experts' overlap, MoeBlocks._shared_beside; its rerun is the recompute's)
        pre, post, overlap = (tuple(replace(c, label=f"recompute {c.label}") if c.label in ("router", "experts") else c
                                    for c in items) for items in (pre, post, overlap))
        if rc_ops or pre or post or overlap:
            blk = _block(f"recompute {name}", layer, [], gpu, prec, 0.0, pre, post, recompute_ops=rc_ops,
                         overlap=overlap)
            bwd.append(blk)
            b_in.append(blk)

    for layer in reversed(layers):
        mlp_fwd, mlp_bwd = mlp_specs(layer)
        mlp_ops = [o for spec in mlp_fwd for o in spec.ops]
        norms = RECOMPUTED_OPS["layernorm"]
        norm = [o for o in mlp_ops if o.name in rc_names and o.name in norms]  # layernorm's norm2
        act_rc = [o for o in mlp_ops if o.name in rc_names and o.name not in norms]  # moe_act's
        if ("moe" if m.is_moe_layer(layer) else "mlp") in modules:
            # the module again from its input, communication included, the norm before it first
            # (the norm is outside the module, as the residual add after it)
            for i, spec in enumerate(mlp_fwd):
                rerun(spec.name, layer, (norm if i == 0 else []) + [
                    o for o in spec.ops if o.name not in norms and not o.name.startswith("residual")], spec.pre,
                    spec.post, spec.overlap)
            norm = act_rc = []
        elif m.is_moe_layer(layer) and "shared_experts" in modules:
            # under SP the shared experts gather their input and reduce-scatter their output
            # (MoeBlocks: the MoE block's own TP communication), again; without SP the output's
            # all-reduce is the whole MoE block's, routed and shared summed, which the shared
            # experts alone do not run again
            rerun("shared experts", layer, norm + [o for o in mlp_ops if o.name in moe.SHARED_EXPERT_OPS],
                  f_pre if sp else (), f_post if sp else ())
            norm = []
        mlp_rc = _placed(norm + act_rc, mlp_bwd)
        for ly in group_ending.get(layer, ()):
            if ly >= m.layers:  # an MTP module's checkpoint: its norms and projection again first
                rerun(mtp_fwd.name, ly, mtp_fwd.ops, mtp_fwd.pre, mtp_fwd.post)
            for spec in attn_fwd + mlp_specs(ly)[0]:  # the group's forward again, communication included
                rerun(spec.name, ly, spec.ops, spec.pre, spec.post, spec.overlap)
        for spec, rc in zip(mlp_bwd, mlp_rc):
            backward(spec, layer, recompute_ops=rc)
        for spec, rc in zip(attn_bwd, attn_rc):
            backward(spec, layer, recompute_ops=rc)
        if layer >= m.layers:  # (the copy's gradient is whole after the first module's lookup)
            backward(mtp_bwd, layer)
            backward(replace(mtp_lookup_bwd, params=mtp_copy if layer == m.layers else 0.0), layer)
    if last:
        fwd.append(_block("head", -1, head_f, gpu, prec, head_params, pre=f_pre))
        for _ in range(mtp):
            fwd.append(_block("head mtp", -1, head_f, gpu, prec, 0.0, pre=f_pre))
    if first:
        emb_b_pre = b_pre if sp else ()
        emb_b = tf.block_bwd(emb_f, flash)
        bwd.append(_block("embedding", -1, emb_b, gpu, prec, emb_params, pre=emb_b_pre))
        if emb_b_pre:  # the sequence-sharded gradient is gathered on the activation path
            b_in.append(_block("embedding", -1, [], gpu, prec, 0.0, pre=emb_b_pre))
        b_w.append(_block("embedding", -1, emb_b, gpu, prec, emb_params))

    local_params = sum_left(blk.params for blk in fwd)
    local_expert_params = sum_left(blk.expert_params for blk in fwd)
    kept = {ly: _kept_bytes(sc, ly, groups) for ly in layers}
    # an MTP module in a group of its own under full recompute is checkpointed whole (Megatron-Core):
    # it keeps its two inputs, and its layer's input, the projection's output, is recomputed
    checkpointed = [ly for g in groups for ly in g if ly >= m.layers] if recompute == "full" else []
    proj_kept = tf.mtp_proj_activation_bytes(m, b, t, sp, cp, fp8)
    for ly in checkpointed:
        kept[ly] = tf.mtp_checkpoint_bytes(m, b, t, sp, cp)
    offload_acts = _offloaded_activations(sc, kept)
    act_mb = _resident_bytes(kept, sc.model.layers - len(offload_acts)) if offload_acts else sum_left(kept.values())
    if last:  # the logits of the model's head and of each MTP module's, and what each module's projection keeps
        act_mb += (1 + mtp) * tf.head_activation_bytes(m, b, t, cp) + (mtp - len(checkpointed)) * proj_kept
    et = sc.parallel.expert_tp
    mm = memory_model(sc)  # (the busiest EP rank's tokens under a skewed expert load)
    wgrad_mb = sum_left(tf.layer_wgrad_bytes(mm, b, t, sp, m.is_moe_layer(ly), cp, et, fp8) for ly in layers)
    wgrad_mb += (tf.head_wgrad_bytes(m, b, t, sp, cp) if last else 0.0) + (tf.embedding_wgrad_bytes(m, b, cp)
                                                                           if first else 0.0)
    # each MTP module's W: the head's again, and its projection's input (2h; its FP8 copy under
    # FP8 training, as a layer's: layer_wgrad_bytes) and output gradient
    wgrad_mb += mtp * (tf.head_wgrad_bytes(m, b, t, sp, cp) + 2 * act / (t if sp else 1) / (2 if fp8 else 1) + act / t)
    # full recompute holds a group's whole activations while it recomputes (a MoE layer's
    # experts and dispatched states, not a dense MLP's); selective recompute what it left
    # unstored of one layer's attention or of its MLP (core attention's scores, Korthikanti et
    # al. 2022 Sec 5; its modules' terms)
    if modules:
        rc_groups = [range(ly, ly + 1) for ly in layers]
        extra = {ly: tf.recomputed_bytes(mm, b, t, flash, sp, m.is_moe_layer(ly), cp, modules, et, fp8)
                 for ly in layers}
    else:
        rc_groups = groups
        extra = {ly: tf.layer_activation_bytes(mm, b, t, flash, sp, cp=cp, moe_layer=m.is_moe_layer(ly), etp=et,
                                               fp8=fp8)
                 + (proj_kept if ly in checkpointed else 0.0) - kept[ly]
                 for g in groups for ly in g}
    recomputing = recompute_held_bytes(layers, rc_groups, extra, kept)
    grad_shard, expert_shard = sc.mesh.grad_shards(sc.parallel.zero)
    updated = local_params / grad_shard + local_expert_params / expert_shard
    f = sc.training.optimizer_offload
    return StageWork(
        fwd=tuple(fwd), bwd=tuple(bwd),
        optimizer_s=adam_step_time_s(updated * (1 - f), gpu, GRAD_BYTES[sc.training.grad_dtype],
                                     optimizer_bytes(sc.training.optimizer_moments_dtype)),
        offload=offload_chains(sc, gpu, bwd, (grad_shard, expert_shard)) if f else (),
        offload_acts=offload_acts,
        local_params=local_params,
        local_expert_params=local_expert_params,
        activation_bytes_per_mb=act_mb,
        pp_send_bytes=act / t if sp or scatter else act,
        pp_gather_bytes=act if scatter else 0.0,
        transient_bytes=cp_transient_bytes(sc),
        recompute_bytes_per_mb=recomputing,
        wgrad_bytes_per_mb=wgrad_mb,
        recompute_groups=tuple(tuple(g) for g in groups),
        bwd_input=tuple(b_in), bwd_weight=tuple(b_w),
        **_fused_halves(b_in, b_w, moved),
    )


def _resident_bytes(kept: dict[int, float], window: int) -> float:
    """The most a microbatch's layers hold on the GPU under activation offload: Transformer
    Engine's window keeps ``window`` (L - N) consecutive layers resident, in the forward the
    last ones computed, in the backward the next ones due (reloaded early ones among them)::

        max over j of  kept[j] + ... + kept[j + window - 1]

    (the non-offloaded layers alone where every layer keeps as much)."""
    layers = sorted(kept)
    return max(sum_left(kept[ly] for ly in layers[j:j + window]) for j in range(len(layers) - window + 1))


def _offloaded_activations(sc: Scenario, kept: dict[int, float]) -> tuple[tuple[int, float, float], ...]:
    """(layer, bytes, seconds a copy) of the part's layers among the model's first
    ``training.activation_offload_layers``: what each keeps for its backward (``kept``), copied
    to the host after its forward and back before its backward at ``node.host.copy_GBps`` (or
    the host memory's share where slower, costs.offload_times_s)::

        seconds = bytes / min(copy_Bps, memory_Bps / GPUs a node)
    """
    n = sc.training.activation_offload_layers
    if not n:
        return ()
    rates = _host_rates_Bps(sc)
    return tuple((ly, x, host_copy_s(x, *rates)) for ly, x in sorted(kept.items()) if ly < n)


def _host_rates_Bps(sc: Scenario) -> tuple[float, float]:
    """(each GPU's copy rate, its share of the host memory's bandwidth: the node's ranks use
    it at once) of the topology's ``node.host``."""
    host = sc.topology.node.host
    return host.copy_GBps * 1e9, host.memory_GBps * 1e9 / sc.cluster.gpus_per_node


def offload_chains(sc: Scenario, gpu: GpuSpec, bwd: list[Block], shards: tuple[float, float]
                   ) -> tuple[OffloadChain, ...]:
    """The dense and the routed experts' offloaded optimizer steps of a part whose backward
    blocks are ``bwd`` (each block's parameters, ``shards`` the ZeRO shard counts that divide
    them): the share ``training.optimizer_offload`` of each instance's shard on the host, in one
    piece, or pipelined one piece a block (by its parameters: an embedding or a head weighs
    what it holds; Megatron-LM pipelines tensor by tensor, which shortens only the fill and
    the drain)::

        gpu_s  = adam((1 - f) x shard)          pieces: offload_times_s(f x shard x block share)
    """
    t = sc.training
    f, pipelined = t.optimizer_offload, t.overlap_offload_copies
    copy_Bps, share_Bps = _host_rates_Bps(sc)
    out = []
    for kind, attr, shard in zip(("dense", "expert"), ("params", "expert_params"), shards):
        weights = [getattr(b, attr) for b in bwd if getattr(b, attr) > 0]
        if not weights:
            continue
        total = sum_left(weights)
        pieces = weights if pipelined else [total]
        out.append(OffloadChain(
            kind=kind, gpu_s=adam_step_time_s(total / shard * (1 - f), gpu, GRAD_BYTES[t.grad_dtype],
                                   optimizer_bytes(t.optimizer_moments_dtype)),
            pieces=tuple(offload_times_s(w / shard * f, copy_Bps, share_Bps, pipelined) for w in pieces),
            piece_bytes=tuple(w / shard * f * OFFLOAD_COPY_BYTES for w in pieces)))
    return tuple(out)


def recompute_held_bytes(layers: range, groups: list[range], extra: dict, kept: dict) -> float:
    """What a recomputing backward holds beyond what a microbatch keeps (``kept``, by layer):
    the most over the recomputed groups of what they bring back beyond it (``extra``, by
    layer: under full recompute a layer's whole activations less its kept input, under
    selective recompute the terms its modules dropped) less what the backward has freed by
    then (what the layers after the group kept: the backward reaches a group last that comes
    first in the part, as ``block``'s do)::

        held = max over groups g of  extra(g) - kept(layers after g), at least 0

        block 1 of layers 0-3:   B  [3][2][1][recompute 0 | 0]    layers 1-3 freed by then
    """
    last = {g[-1]: g for g in groups}
    freed = most = 0.0
    for ly in reversed(layers):
        g = last.get(ly)
        if g is not None:
            most = max(most, sum_left(extra[x] for x in g) - freed)
        freed += kept[ly]
    return most


def memory_model(sc: Scenario):
    """The model as the memory of a part counts it: ``sc.model``, but under a skewed expert
    load (``model.moe.ep_load``) with the busiest EP rank's tokens, so that a stage's memory is
    that of its busiest GPU. The routed experts' kept terms (their intermediates, the
    dispatched hidden states, their gradients for a split W) scale with the pairs a rank's
    experts compute (``moe.expert_loads``), as padding to capacity scales them::

        capacity_factor' = max(run), padded       [1.6, 0.8, 0.8, 0.8]: 1.6x the balanced terms
    """
    made = sc.__dict__.get("_memory_model")  # (made once a scenario: every layer of every part asks)
    if made is None:
        m, e = sc.model, sc.model.moe
        most = max(moe.expert_loads(e, sc.parallel.ep)[0]) if sc.cfg.ranks_differ()[1] else None
        made = m.model_copy(update={"moe": e.model_copy(update={"capacity_factor": most, "pad_to_capacity": True})}) \
            if most is not None else m
        sc.__dict__["_memory_model"] = made
    return made


def _kept_bytes(sc: Scenario, layer: int, groups: list[range]) -> float:
    """What ``layer`` keeps from its forward to its backward, per microbatch, per TP rank (of
    the busiest EP rank under a skewed expert load: :func:`memory_model`): the input alone
    where it heads a recomputed group, nothing elsewhere in one, and all its activations where
    full recompute leaves it out (:func:`recompute_groups`)."""
    m, tr = memory_model(sc), sc.training
    mode = tr.recompute
    if mode == "full":
        group = next((g for g in groups if layer in g), None)
        if group is not None and layer != group[0]:
            return 0.0
        mode = "full" if group is not None else "none"
    p = sc.parallel
    return tf.layer_activation_bytes(m, tr.micro_batch_size, p.tp, tr.attention == "flash", p.sp, mode,
                                     m.is_moe_layer(layer), p.cp, tr.selective_modules, p.expert_tp, tr.fp8)


@dataclass(frozen=True)
class MoeBlocks:
    """The blocks replacing a dense MLP in a MoE layer (Megatron-style, experts split over etp TP ranks)::

        forward   AG[router]A2A AG ─ [experts + shared]RS A2A RS        (SP, EP, shared experts)
        backward  AG A2A AG[experts + shared]RS A2A ─ [router]RS
        forward   [router]A2A AG ─ [experts]RS A2A                      (SP, EP, no shared expert)
        forward   [router]A2A ─ [experts + shared]A2A AR                (no SP)

    The dispatch all-to-all runs in the EP group (``ep`` DP ranks at one TP index; with CP,
    CP ranks first, and with ``etp`` < tp, TP ranks first: plan/mesh.py) and carries
    tokens * top_k * capacity hidden vectors; the combine brings them back.
    Under SP (which Megatron-LM requires of MoE with TP > 1) each TP rank dispatches its own
    s/t tokens, and the experts' TP group then gathers what the dispatch brought (``AG experts
    in``) and reduce-scatters their output before the combine (``RS experts out``), as
    Megatron-LM's all-to-all dispatcher does with expert-tensor-parallel = tp: the router routes
    the rank's own tokens and the combine returns them sequence-sharded, so only shared experts
    gather their input and reduce-scatter their output, as a dense MLP under SP does. Without SP
    every TP rank holds every token and dispatches it. Routed-expert parameters (E/ep experts per
    rank) reduce over the expert-DP group.

    With experts split over fewer ranks than TP (``etp`` < tp, MoE parallel folding; SP), the
    gather and reduce-scatter run in the expert-TP group of etp ranks, on etp/t of the tokens,
    and with etp = 1 there are none: each rank's experts are whole and compute what the
    dispatch brought it::

        forward   [router]A2A ─ [experts]A2A                            (SP, etp 1, no shared expert)
        forward   AG[router]A2A ─ [experts + shared]A2A RS              (SP, etp 1, shared experts)

    With a skewed load (``ep_load``), or a capacity that drops or pads (``capacity_factor``),
    rank ``ep_rank``'s routed experts compute its pairs (``moe.expert_loads``: ``run``, of which
    ``real`` are model work), and where the ranks' pairs differ the all-to-alls that carry
    tokens *to* the experts (forward dispatch, backward gradient of the combine) scale each
    flow by its destination's, those *from* the experts (forward combine, backward gradient of
    the dispatch) by its source's; where they are alike, every flow by theirs.
    """

    fwd_specs: tuple
    bwd_specs: tuple

    @staticmethod
    def build(sc: Scenario, f_pre, f_post, b_pre, b_post, ep_rank: int = 0) -> "MoeBlocks":
        m, t, ep, et = sc.model, sc.parallel.tp, sc.parallel.ep, sc.parallel.expert_tp
        e, h = m.moe, m.hidden
        b, flash, sp = sc.training.micro_batch_size, sc.training.attention == "flash", sc.parallel.sp
        tokens = b * m.seq_len / sc.parallel.cp
        rep_tok = tokens / t if sp else tokens
        run, real = moe.expert_loads(e, ep)
        skew = run if len(set(run)) > 1 else ()  # (the EP ranks differ: config's ranks_differ)
        if not skew:
            # every rank's pairs alike (padded to capacity, however skewed the routing): each
            # counts the mean of the real tokens among them, which sums to the step's model FLOPs
            ep_rank, real = 0, (sum_left(real) / len(real),)

        def a2a(by_src: bool, label: str = "") -> tuple:
            if ep == 1:
                return ()
            # (to the experts, with fp8_dispatch: FP8 and its scales; from them, 16-bit)
            sent = moe.dispatch_bytes(e, rep_tok, h, e.fp8_dispatch and not by_src)
            return (CommItem("all_to_all", sent if skew else sent * run[0], dim="ep",
                             load=(by_src, skew) if skew else (), label=label),)

        # under SP each TP rank routes its own s/t tokens where the experts are not split as
        # the dense MLP is (EP, or etp < tp): what a rank's experts take (its load's share of
        # its expert-TP group's tokens) is gathered over that group before them and their
        # output reduce-scattered after, and without shared experts nothing else gathers
        own = sp and t > 1 and (ep > 1 or et < t)
        if own and e.shared_experts == 0:
            f_pre = f_post = b_pre = b_post = ()
        elif own:  # the shared experts' own gathers (Transformer Engine's layers: FP8 under FP8 training)
            f_pre, b_pre = fp8_gathers(f_pre, sc.training.fp8), fp8_gathers(b_pre, sc.training.fp8)
        regroup = own and et > 1
        expert_tok = rep_tok * et if own else tokens  # the tokens a rank's experts share (balanced)
        share = run[ep_rank]
        # (what the dispatch brought, FP8 under fp8_dispatch, gathered as it came; sums back in 16 bits)
        gathered_in = moe.dispatch_bytes(e, expert_tok, h, e.fp8_dispatch) * share
        gathered = moe.dispatch_bytes(e, expert_tok, h) * share
        dim = "tp" if et == t else "etp"
        gather = (CommItem("all_gather", gathered_in, dim=dim, label="experts in"),) if regroup else ()
        scatter = (CommItem("reduce_scatter", gathered, dim=dim, label="experts out"),) if regroup else ()
        to_experts, from_experts = a2a(False) + gather, scatter + a2a(True)
        router = [tf.elementwise_op("norm2", rep_tok * h, 2)] + (
            moe.router_fwd(e, rep_tok, h) if own else moe.router_fwd(e, tokens, h, t))
        # the routed tokens' permutations: NCCL's all-to-all takes them in order of their
        # experts, permuted before the dispatch and summed back after the combine on their own
        # rank (here at the end of the experts' block, before the combine), and sorted by local
        # expert after it and back before the combine where a rank holds several; DeepEP's
        # dispatch sorts nothing on the sending rank, and its receiver permutes to the experts
        deepep = e.dispatcher == "deepep"
        permute, unpermute = moe.permutations(e, rep_tok if own else tokens, h, sum_left(run) / len(run))
        if not deepep:
            router.append(permute)
        sorts = ep > 1 and (deepep or e.experts // ep > 1)
        routed = moe.routed_experts_fwd(e, expert_tok, h, et, run[ep_rank], real[ep_rank], sorts, e.experts // ep)
        shared = moe.shared_experts_fwd(e, tokens, h, t)
        summed, residual = ([] if deepep else [unpermute]), [tf.elementwise_op("residual2", rep_tok * h, 3)]
        router_params = h * e.experts  # the router's weight is whole on every TP rank (Megatron)
        shared_params = e.shared_experts * moe.expert_params(e, h) / t  # shared experts split as the dense MLP
        routed_params = (e.experts // ep) * moe.expert_params(e, h) / et
        if e.shared_expert_overlap:
            return MoeBlocks._shared_beside(sc, router, (routed, shared, summed + residual),
                                            (f_pre, f_post, b_pre, b_post), own, a2a, (gather, scatter),
                                            (router_params, shared_params, routed_params))
        experts = routed + summed + shared + residual
        fwd = (
            _Spec("router", router, f_pre, to_experts, router_params),
            _Spec("experts", experts, (), from_experts + f_post, shared_params, routed_params),
        )
        # the backward's two all-to-alls are the combine's gradient (before the experts, "B A2A
        # experts", as the forward's combine is "F A2A experts") and the dispatch's (after them,
        # named for the dispatch it undoes, "B A2A router"): two collectives, two names
        bwd = (
            _Spec("experts", tf.block_bwd(experts, flash), b_pre + to_experts, scatter + a2a(True, "router"),
                  shared_params, routed_params),
            _Spec("router", tf.block_bwd(router, flash), (), b_post, router_params),
        )
        return MoeBlocks(fwd, bwd)

    @staticmethod
    def _shared_beside(sc: Scenario, router: list, experts: tuple, tp_comms: tuple, own: bool, a2a, regroup: tuple,
                       params: tuple) -> "MoeBlocks":
        """The blocks with the shared experts beside the all-to-alls (``model.moe.shared_expert_overlap``,
        Megatron-LM's ``--moe-shared-expert-overlap``: ``SharedExpertMLP`` on a stream of its own,
        ``linear_fc1_forward_and_act`` after the dispatch is issued, ``linear_fc2_forward`` before the
        combine is, ``pre_forward_comm`` and ``post_forward_comm`` its TP gather and reduce-scatter)::

            forward   [router]      [shared fc1]  [experts]  [shared fc2]  [combine]RS
                       AG(shared)    A2A dispatch              A2A combine
            backward  AG[combine]  [shared fc2]  [experts]  [shared fc1]  [router]RS
                                    A2A combine'              A2A dispatch'

        (with ``etp`` > 1 the experts' TP gather comes before ``[experts]``, after the dispatch,
        and their reduce-scatter after it, before the combine).

        One compute stream: the shared experts' GEMMs run while the all-to-all beside them moves,
        and the routed experts (or the combine's sum) wait for both. The gather of the shared
        experts' input runs beside the router where the rank routes its own tokens (under SP);
        where it routes the gathered ones it comes first, as without the overlap. The combine's
        sum of each token's copies (``unpermute``) comes after the combine here, where it is."""
        flash = sc.training.attention == "flash"
        f_pre, f_post, b_pre, b_post = tp_comms
        # (the TP collectives after the combine and before its gradient keep the names they have
        # without the overlap, the experts block's: "F RS experts", "B AG experts")
        f_post, b_pre = (tuple(replace(c, label=c.label or "experts") for c in items) for items in (f_post, b_pre))
        gather, scatter = regroup
        router_params, shared_params, routed_params = params
        routed, shared, combine = experts  # (the combine: its sum of each token's copies, the residual add)
        fc1, fc2 = shared[:2], shared[2:]
        up = (sc.model.moe.mats - 1) / sc.model.moe.mats  # (the shared experts' weights: up and gate, down)
        # the all-to-alls named for the blocks they follow without the overlap ("F A2A router",
        # "F A2A experts"); the experts' TP gather of what the dispatch brought waits for it and
        # runs before them, their reduce-scatter after them and before the combine (the
        # communications beside one block start together, so each all-to-all alone there)
        fwd = (
            _Spec("router", router, () if own else f_pre, (), router_params, overlap=f_pre if own else ()),
            _Spec("shared fc1", fc1, (), (), shared_params * up, overlap=a2a(False, "router")),
            _Spec("experts", routed, gather, scatter, 0.0, routed_params),
            _Spec("shared fc2", fc2, (), (), shared_params * (1 - up), overlap=a2a(True, "experts")),
            _Spec("combine", combine, (), f_post),
        )
        bwd = (
            _Spec("combine", tf.block_bwd(combine, flash), b_pre, ()),
            _Spec("shared fc2", tf.block_bwd(fc2, flash), (), (), shared_params * (1 - up),
                  overlap=a2a(False, "experts")),
            _Spec("experts", tf.block_bwd(routed, flash), gather, scatter, 0.0, routed_params),
            _Spec("shared fc1", tf.block_bwd(fc1, flash), (), (), shared_params * up, overlap=a2a(True, "router")),
            _Spec("router", tf.block_bwd(router, flash), (), b_post, router_params),
        )
        return MoeBlocks(fwd, bwd)

