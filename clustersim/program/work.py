"""Per pipeline stage: the blocks of compute between communication points, with their costs.

A block is a run of ops that ends where Megatron TP needs an all-reduce::

    stage 0 forward:  [embedding]AR [attn L0]AR [mlp L0]AR [attn L1]AR ... 
    last stage fwd:   ... [mlp L95]AR [head]
    backward:         [head]AR [mlp L95]AR [attn L95]AR ... [embedding]

Two all-reduces per layer forward, two backward (Shoeybi et al. 2019, Fig. 3); one after the
vocab-parallel embedding forward and one for the LM head's input gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Scenario
from ..hardware.gpus import GpuSpec
from ..model import transformer as tf
from .costs import adam_step_time_s, ops_time_s

GRAD_BYTES = {"fp32": 4, "bf16": 2}
PARAM_BYTES = 2  # 16-bit weights used by the kernels
OPTIMIZER_BYTES = 12  # fp32 master weights + Adam m + v (Rajbhandari et al. 2020, Sec 3.1)


@dataclass(frozen=True)
class Block:
    name: str
    layer: int  # global layer index, -1 for embedding / head
    duration_s: float
    flops: float
    model_flops: float
    params: float  # local parameters whose gradients are final after this block's backward
    tp_allreduce_bytes: float = 0.0  # all-reduce after the block; 0 = none


@dataclass(frozen=True)
class StageWork:
    fwd: tuple[Block, ...]
    bwd: tuple[Block, ...]
    optimizer_s: float
    local_params: float
    activation_bytes_per_mb: float
    pp_send_bytes: float


def _block(name, layer, ops, gpu, precision, params, ar_bytes) -> Block:
    return Block(
        name=name, layer=layer, duration_s=ops_time_s(ops, gpu, precision),
        flops=sum(o.flops for o in ops), model_flops=sum(o.model_flops for o in ops),
        params=params, tp_allreduce_bytes=ar_bytes,
    )


def stage_work(sc: Scenario, stage: int, gpu: GpuSpec) -> StageWork:
    """Blocks, optimizer time, local parameters and activation bytes of one pipeline stage."""
    m, t, p = sc.model, sc.parallel.tp, sc.parallel.pp
    b, prec = sc.training.micro_batch_size, sc.training.precision
    flash = sc.training.attention == "flash"
    split = sc.layers_per_stage
    first_layer = sum(split[:stage])
    ar = 2.0 * b * m.seq_len * m.hidden if t > 1 else 0.0  # 16-bit [b, s, h] activation
    first, last = stage == 0, stage == p - 1

    attn_f = tf.attn_block_fwd(m, b, t, flash)
    mlp_f = tf.mlp_block_fwd(m, b, t)
    attn_b, mlp_b = tf.block_bwd(attn_f, flash), tf.block_bwd(mlp_f, flash)
    per_layer = tf.layer_params(m) / t
    mlp_share = (m.hidden * m.ffn * (3 if m.mlp == "swiglu" else 2)) / t
    attn_params, mlp_params = per_layer - mlp_share, mlp_share

    emb_params = tf.embedding_params(m) / t
    # A tied LM head on a later stage keeps its own copy of the word embedding (Megatron).
    head_params = (tf.head_params(m) + (m.vocab * m.hidden if m.tied_embeddings and p > 1 else 0)) / t
    if first and last and m.tied_embeddings:
        head_params = tf.head_params(m) / t

    fwd, bwd = [], []
    if first:
        fwd.append(_block("embedding", -1, tf.embedding_fwd(m, b, t), gpu, prec, emb_params, ar))
    if last:
        head_f = tf.head_fwd(m, b, t)
        bwd.append(_block("head", -1, tf.block_bwd(head_f, flash), gpu, prec, head_params, ar))
    for layer in range(first_layer, first_layer + split[stage]):
        fwd.append(_block("attn", layer, attn_f, gpu, prec, attn_params, ar))
        fwd.append(_block("mlp", layer, mlp_f, gpu, prec, mlp_params, ar))
    for layer in reversed(range(first_layer, first_layer + split[stage])):
        bwd.append(_block("mlp", layer, mlp_b, gpu, prec, mlp_params, ar))
        bwd.append(_block("attn", layer, attn_b, gpu, prec, attn_params, ar))
    if last:
        fwd.append(_block("head", -1, head_f, gpu, prec, head_params, 0.0))
    if first:
        bwd.append(_block("embedding", -1, tf.block_bwd(tf.embedding_fwd(m, b, t), flash), gpu, prec, emb_params, 0.0))

    local_params = sum(blk.params for blk in fwd)
    act = split[stage] * tf.layer_activation_bytes(m, b, t, flash)
    if last:
        act += tf.head_activation_bytes(m, b, t)
    return StageWork(
        fwd=tuple(fwd), bwd=tuple(bwd),
        optimizer_s=adam_step_time_s(local_params, gpu, GRAD_BYTES[sc.training.grad_dtype]),
        local_params=local_params,
        activation_bytes_per_mb=act,
        pp_send_bytes=2.0 * b * m.seq_len * m.hidden,
    )
