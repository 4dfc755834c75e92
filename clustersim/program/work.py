"""Per pipeline stage: the blocks of compute between communication points, with their costs.

A block is a run of ops with the blocking communications Megatron TP puts around it::

    no SP:     [embedding]AR [attn L0]AR [mlp L0]AR ... [head]
    SP:        [embedding]RS AG[attn L0]RS AG[mlp L0]RS ... AG[head]
    backward:  [head]AR [mlp L95]AR [attn L95]AR ... [embedding]      (SP: AG before, RS after)

Two all-reduces per layer forward and two backward (Shoeybi et al. 2019, Fig. 3); sequence
parallelism turns each into a reduce-scatter and an all-gather of the same total bytes and
splits norm/dropout work by t (Korthikanti et al. 2022, Sec 4.2.2). Full recompute puts the
layer's forward, with its communication, at the head of its backward; selective recompute
re-runs core attention only (Korthikanti et al. 2022, Sec 5).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Scenario
from ..hardware.gpus import GpuSpec
from ..model import transformer as tf
from ..model.transformer import Op
from .costs import adam_step_time_s, ops_time_s

GRAD_BYTES = {"fp32": 4, "bf16": 2}
PARAM_BYTES = 2  # 16-bit weights used by the kernels
OPTIMIZER_BYTES = 12  # fp32 master weights + Adam m + v (Rajbhandari et al. 2020, Sec 3.1)


@dataclass(frozen=True)
class CommItem:
    """A blocking communication of a block, run by the group of mesh dimension ``dim``."""

    op: str  # "all_reduce" | "reduce_scatter" | "all_gather"
    size_bytes: float  # whole tensor (each rank holds size/n of it for RS output and AG input)
    dim: str = "tp"


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


@dataclass(frozen=True)
class StageWork:
    fwd: tuple[Block, ...]
    bwd: tuple[Block, ...]
    optimizer_s: float
    local_params: float  # parameters this GPU's stage owns per TP rank (before ZeRO sharding)
    activation_bytes_per_mb: float
    pp_send_bytes: float
    transient_bytes: float = 0.0  # held only while one layer recomputes (full recompute)


def _block(name, layer, ops: list[Op], gpu, precision, params, pre=(), post=(), recompute_ops=()) -> Block:
    """A block's cost; ``recompute_ops`` add time and executed FLOPs but no model FLOPs."""
    return Block(
        name=name, layer=layer,
        duration_s=ops_time_s(list(recompute_ops) + ops, gpu, precision),
        flops=sum(o.flops for o in list(recompute_ops) + ops), model_flops=sum(o.model_flops for o in ops),
        params=params, pre=tuple(pre), post=tuple(post),
    )


def _tp_comms(t: int, sp: bool, act_bytes: float):
    """(fwd pre, fwd post, bwd pre, bwd post) of a TP-parallel block, by SP or not."""
    if t == 1:
        return (), (), (), ()
    if sp:
        ag, rs = CommItem("all_gather", act_bytes), CommItem("reduce_scatter", act_bytes)
        return (ag,), (rs,), (ag,), (rs,)
    ar = CommItem("all_reduce", act_bytes)
    return (), (ar,), (), (ar,)


def stage_work(sc: Scenario, stage: int, gpu: GpuSpec) -> StageWork:
    """Blocks, optimizer time, local parameters and activation bytes of one pipeline stage."""
    m, t, p = sc.model, sc.parallel.tp, sc.parallel.pp
    sp, recompute = sc.parallel.sp, sc.training.recompute
    b, prec = sc.training.micro_batch_size, sc.training.precision
    flash = sc.training.attention == "flash"
    split = sc.layers_per_stage
    first_layer = sum(split[:stage])
    act = 2.0 * b * m.seq_len * m.hidden  # a 16-bit [b, s, h] activation
    first, last = stage == 0, stage == p - 1
    f_pre, f_post, b_pre, b_post = _tp_comms(t, sp, act)

    attn_f = tf.attn_block_fwd(m, b, t, flash, sp)
    mlp_f = tf.mlp_block_fwd(m, b, t, sp)
    attn_b, mlp_b = tf.block_bwd(attn_f, flash), tf.block_bwd(mlp_f, flash)
    per_layer = tf.layer_params(m) / t
    mlp_share = (m.hidden * m.ffn * (3 if m.mlp == "swiglu" else 2)) / t
    attn_params, mlp_params = per_layer - mlp_share, mlp_share
    # selective recompute re-runs core attention in backward; flash attention already does
    attn_rc = [o for o in attn_f if o.name == "core_attn"] if recompute == "selective" and not flash else []

    emb_params = tf.embedding_params(m) / t
    # A tied LM head on a later stage keeps its own copy of the word embedding (Megatron).
    head_params = (tf.head_params(m) + (m.vocab * m.hidden if m.tied_embeddings and p > 1 else 0)) / t
    if first and last and m.tied_embeddings:
        head_params = tf.head_params(m) / t

    emb_f = tf.embedding_fwd(m, b, t)
    head_f = tf.head_fwd(m, b, t)
    emb_post = (CommItem("reduce_scatter" if sp else "all_reduce", act),) if t > 1 else ()
    fwd, bwd = [], []
    if first:
        fwd.append(_block("embedding", -1, emb_f, gpu, prec, emb_params, post=emb_post))
    if last:
        # the head's input is sequence-sharded under SP: gather it; backward scatters the grad
        bwd.append(_block("head", -1, tf.block_bwd(head_f, flash), gpu, prec, head_params, post=b_post))
    for layer in range(first_layer, first_layer + split[stage]):
        fwd.append(_block("attn", layer, attn_f, gpu, prec, attn_params, f_pre, f_post))
        fwd.append(_block("mlp", layer, mlp_f, gpu, prec, mlp_params, f_pre, f_post))
    for layer in reversed(range(first_layer, first_layer + split[stage])):
        if recompute == "full":
            bwd.append(_block("recompute attn", layer, [], gpu, prec, 0.0, f_pre, f_post, recompute_ops=attn_f))
            bwd.append(_block("recompute mlp", layer, [], gpu, prec, 0.0, f_pre, f_post, recompute_ops=mlp_f))
        bwd.append(_block("mlp", layer, mlp_b, gpu, prec, mlp_params, b_pre, b_post))
        bwd.append(_block("attn", layer, attn_b, gpu, prec, attn_params, b_pre, b_post, recompute_ops=attn_rc))
    if last:
        fwd.append(_block("head", -1, head_f, gpu, prec, head_params, pre=f_pre))
    if first:
        bwd.append(_block("embedding", -1, tf.block_bwd(emb_f, flash), gpu, prec, emb_params,
                          pre=b_pre if sp else ()))

    local_params = sum(blk.params for blk in fwd)
    act_mb = split[stage] * tf.layer_activation_bytes(m, b, t, flash, sp, recompute)
    if last:
        act_mb += tf.head_activation_bytes(m, b, t)
    transient = tf.layer_activation_bytes(m, b, t, flash, sp) if recompute == "full" else 0.0
    zero_shard = sc.parallel.dp if sc.parallel.zero >= 1 else 1
    return StageWork(
        fwd=tuple(fwd), bwd=tuple(bwd),
        optimizer_s=adam_step_time_s(local_params / zero_shard, gpu, GRAD_BYTES[sc.training.grad_dtype]),
        local_params=local_params,
        activation_bytes_per_mb=act_mb,
        pp_send_bytes=act / t if sp else act,
        transient_bytes=transient,
    )
