"""Dense decoder-only transformer: parameters, per-op FLOPs and bytes, activation memory.

Everything here is per microbatch and per tensor-parallel rank, in FLOPs and bytes; the
hardware turns them into seconds elsewhere (``program/costs.py``). One layer, Megatron
tensor parallelism (Shoeybi et al. 2019), forward::

    x ─ norm1 ─ qkv ─ core attention ─ proj ─[TP all-reduce]─ +x ─ norm2 ─ up ─ act ─ down ─[TP all-reduce]─ +
        └──────────── block "attn" ────────────┘                    └──────── block "mlp" ────────┘

Model FLOPs per token (fwd + bwd = 3 x fwd, matmuls only; Kaplan et al. 2020, PaLM App. B,
with the causal mask's half of the attention square, as Megatron-LM's FLOP count has it):

    6 * N_matmul + 6 * layers * seq * hidden       (PaLM's 12 * layers * seq * hidden, halved)
    MLA: 6 * N_matmul + 3 * layers * seq * heads * (d_qk + d_rope + d_v)

Executed attention FLOPs follow the kernel: flash attention skips the masked blocks (half the
square), standard attention computes the whole square and masks it.

Activation bytes per layer per microbatch, 16-bit (Korthikanti et al. 2022, Table 2, TP without
sequence parallelism), generalised to GQA and any MLP width:

    s*b*h*(10 + 24/t + 5*a*s/(h*t))     for GPT (kv_heads = heads, ffn = 4h, gelu)

with the 5*a*s/(h*t) term (scores, softmax, dropout mask) absent under flash attention.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import pydantic

from ..floats import sum_left
from ..yamlio import Strict


class MlaCfg(Strict):
    """The ``model.mla`` section: multi-head latent attention (DeepSeek-V2/V3), whose queries and
    keys/values are projected down to small latents, normalised, and projected up per head."""

    q_lora_rank: int | None = pydantic.Field(
        default=None, ge=1, le=2**20, description="the queries' latent width (DeepSeek-V3: 1536); null: queries "
        "projected from the hidden state at once")
    kv_lora_rank: int = pydantic.Field(ge=1, le=2**20, description="the keys' and values' latent width (512)")
    qk_head_dim: int = pydantic.Field(ge=1, le=2**16, description="a head's query/key width without its rotary part (128)")
    qk_rope_head_dim: int = pydantic.Field(default=64, ge=0, le=2**16, description="a head's rotary query/key width, "
                                           "the key's shared by every head (64)")
    v_head_dim: int = pydantic.Field(ge=1, le=2**16, description="a head's value width (128)")


class DenseModelCfg(Strict):
    """A dense decoder transformer, as written in the scenario's ``model:`` section."""

    name: str | None = pydantic.Field(
        default=None, description="what the report calls the model; null: it is told by its shape (layers, hidden)")
    layers: int = pydantic.Field(ge=1)
    hidden: int = pydantic.Field(ge=1, le=2**20)
    heads: int = pydantic.Field(ge=1, le=2**16)
    kv_heads: int | None = pydantic.Field(default=None, ge=1, le=2**16, description="default: heads (no GQA)")
    ffn_hidden: int | None = pydantic.Field(default=None, ge=1, le=2**22, description="default: 4*hidden")
    mlp: Literal["gelu", "swiglu"] = "gelu"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    bias: bool = True
    dropout: bool = True
    vocab: int = pydantic.Field(ge=1, le=2**24)
    seq_len: int = pydantic.Field(ge=1, le=2**24)
    tied_embeddings: bool = True
    position_embedding: Literal["learned", "rope"] = "learned"
    moe: "MoeCfg | None" = None
    mla: MlaCfg | None = None
    mtp_layers: int = pydantic.Field(
        default=0, ge=0, le=8, description="multi-token prediction modules on the last pipeline stage (DeepSeek-V3: "
        "1; Megatron-LM's --mtp-num-layers): each predicts one token further with a layer of its own")

    @pydantic.model_validator(mode="after")
    def _shapes(self):
        if self.hidden % self.heads:
            raise ValueError(f"model.heads={self.heads} does not divide model.hidden={self.hidden}")
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ValueError(f"model.kv_heads={self.kv_heads} does not divide model.heads={self.heads}")
        if self.mla is not None and self.kv_heads not in (None, self.heads):
            raise ValueError(f"model.kv_heads={self.kv_heads}: latent attention (model.mla) gives every head its own "
                             f"keys and values from the shared latent; drop kv_heads")
        if self.mla is not None and self.bias:
            raise ValueError("model.bias: latent attention (model.mla) is modelled without biases, as DeepSeek's "
                             "models have none; set bias: false")
        freq = self.moe.layer_freq if self.moe is not None else 1
        if isinstance(freq, list) and len(freq) != self.layers:  # (before anything asks which layers are MoE)
            raise ValueError(f"model.moe.layer_freq has {len(freq)} entries for model.layers={self.layers}: one per "
                             f"layer, 1 for a MoE MLP and 0 for a dense one")
        return self

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer`` has a MoE MLP (``MoeCfg.is_moe``); a multi-token prediction
        module's (``layer`` past the model's) has one where the model's last layer has
        (Megatron-LM builds it from the last decoder layer's spec)."""
        return self.moe is not None and self.moe.is_moe(min(layer, self.layers - 1))

    @property
    def has_dense_layers(self) -> bool:
        """Whether some layer has a dense MLP (every layer without MoE; the first few, or those
        ``layer_freq`` leaves dense, with)."""
        return not all(self.is_moe_layer(ly) for ly in range(self.layers))

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def qk_dim(self) -> int:
        """A head's query/key width: head_dim, or under MLA its own part and the rotary one."""
        return self.mla.qk_head_dim + self.mla.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def v_dim(self) -> int:
        """A head's value (and context) width: head_dim, or MLA's v_head_dim."""
        return self.mla.v_head_dim if self.mla else self.head_dim


@dataclass(frozen=True)
class Op:
    """One kernel-sized piece of work on one GPU.

    ``flops`` are what the GPU executes (drives time, HFU); ``model_flops`` are what the model
    needs (drives MFU): they differ where a kernel recomputes (flash-attention backward).
    ``bytes`` are HBM bytes read plus written.
    """

    name: str
    flops: float
    bytes: float
    model_flops: float = -1.0
    # core attention: the share of its FLOPs in QK^T, which flash attention's backward runs
    # again (1/2 where queries, keys and values are equally wide; d_qk / (d_qk + d_v) under MLA)
    qk_share: float = 0.5
    # the fused kernel that runs it where that kernel has an efficiency of its own
    # (``GpuSpec.attention_efficiency``): "flash_fwd", "flash_bwd"; "" for any other op
    kernel: str = ""
    # a GEMM under FP8 training first casts one operand to FP8 (program/costs.py
    # ``fp8_cast_time_s``): the values it casts (its input forward, the output gradient
    # backward), and, for a forward GEMM, the values of its output gradient, which its
    # backward casts (``_backward`` moves them into the first field)
    fp8_cast_elems: float = 0.0
    fp8_grad_elems: float = 0.0
    # the GEMMs it runs, ``(groups, m, n, k)`` each: ``groups`` products of (m x k) @ (k x n) in
    # one kernel (a grouped GEMM, a batched one); they set its share of the peak
    # (program/costs.py ``gemm_efficiency``), never its FLOPs. A backward lists its input
    # gradients' GEMMs, then its weight gradients' (``_backward``)
    gemms: tuple = ()

    def __post_init__(self):
        if self.model_flops < 0:
            object.__setattr__(self, "model_flops", self.flops)


ELEM_BYTES = 2  # 16-bit activations and weights in compute


def matmul_op(name: str, m: float, k: float, n: float, groups: int = 1) -> Op:
    """(m x k) @ (k x n): 2mkn FLOPs; reads both operands, writes the result. ``groups``: the
    m rows split evenly over that many products with weights of their own (a grouped GEMM: the
    local experts), m / groups rows each."""
    return Op(name, 2 * m * k * n, ELEM_BYTES * (m * k + groups * k * n + m * n), fp8_cast_elems=m * k,
              fp8_grad_elems=m * n, gemms=((groups, m / groups, n, k),))


def elementwise_op(name: str, elems: float, passes: float) -> Op:
    """Memory-bound op touching ``elems`` values ``passes`` times (reads + writes)."""
    return Op(name, 0.0, ELEM_BYTES * elems * passes)


# a MoE layer's token permutations (model/moe.py): the gradient of a permutation is the inverse
# permutation, one pass as the forward's
PERMUTATIONS = frozenset({"permute", "unpermute", "sort_in", "sort_out"})


def _backward(op: Op) -> Op:
    """Backward of an op: a matmul needs two (dgrad, wgrad); an elementwise op ~2x the traffic,
    but a permutation as much (:data:`PERMUTATIONS`)."""
    traffic = 1 if op.name in PERMUTATIONS else 2
    return Op(op.name, 2 * op.flops, traffic * op.bytes, 2 * op.model_flops, fp8_cast_elems=op.fp8_grad_elems,
              gemms=backward_gemms(op.gemms))


def backward_gemms(gemms: tuple) -> tuple:
    """The backward's GEMMs of a forward's ``(groups, m, n, k)`` ones: for Y = X W, the input
    gradient dX = dY W^T (m x n by n x k) and the weight gradient dW = X^T dY (k x m by m x n),
    reduced over the rows: all the input gradients, then all the weight gradients::

        forward (g, m, n, k)  ->  dgrad (g, m, k, n),  wgrad (g, k, n, m)
    """
    return tuple((g, m, k, n) for g, m, n, k in gemms) + tuple((g, k, n, m) for g, m, n, k in gemms)


def attn_block_fwd(m: DenseModelCfg, b: int, t: int, flash: bool, sp: bool = False, cp: int = 1) -> list[Op]:
    """Norm, QKV projection, core attention, output projection (one TP rank, one microbatch).

    With sequence parallelism the norm and residual run on s/t tokens (Korthikanti et al. 2022).
    With context parallelism the rank holds s/cp queries, which attend to all s keys: core
    attention is 1/cp of the whole, the rest runs on s/cp tokens.

    Causal mask: a query attends to the keys at or before it, half the s x s square::

        model FLOPs   4 b s^2 h / 2         (Megatron-LM's count: "only half of the mask is non-zero")
        executed      4 b s^2 h / 2 flash   (masked blocks skipped; the diagonal blocks' masked
                                             halves, block/s of the half, left out)
                      4 b s^2 h standard    (the whole square computed, then masked)
    """
    s, h = m.seq_len, m.hidden
    s_q = s / cp  # this rank's queries
    tok = b * s_q
    rep_tok = tok / t if sp else tok  # tokens of the ops TP replicates
    heads_local = m.heads / t
    q_dim, ctx_dim, kv_dim = heads_local * m.qk_dim, heads_local * m.v_dim, kv_width(m) / t
    # QK^T and PV over every (query, key): 2 (d_qk + d_v) FLOPs a pair and head (4d for MHA)
    square_flops = 2 * b * heads_local * s_q * s * (m.qk_dim + m.v_dim)
    causal_flops = square_flops / 2
    core_bytes = ELEM_BYTES * (tok * (q_dim + ctx_dim) + b * s * kv_dim)  # Q and context local, K/V of every key
    if not flash:  # scores, softmax, dropout, each written then read back
        core_bytes += ELEM_BYTES * b * heads_local * s_q * s * 6
    qkv = mla_projections(m, tok, rep_tok, t, sp) if m.mla else [matmul_op("qkv", tok, h, q_dim + kv_dim)]
    return [
        elementwise_op("norm1", rep_tok * h, 2),
        *qkv,
        Op("core_attn", causal_flops if flash else square_flops, core_bytes, causal_flops,
           m.qk_dim / (m.qk_dim + m.v_dim), "flash_fwd" if flash else "",
           # standard attention's batched GEMMs, a (batch, head) each: scores QK^T reduced over
           # a head's width, then PV over the keys (flash attention's kernel has its own figure)
           gemms=() if flash else ((b * heads_local, s_q, s, m.qk_dim), (b * heads_local, s_q, m.v_dim, s))),
        matmul_op("proj", tok, ctx_dim, h),
        elementwise_op("residual1", rep_tok * h, 3),
    ]


def kv_width(m: DenseModelCfg) -> int:
    """A token's keys and values, whole (every head): ``2 g d`` with ``g`` K/V heads, or under
    MLA ``a (d_qk + d_v)``, each head's key (its own part and the shared rotary one) and
    value (what context parallelism passes round, and core attention reads)."""
    return m.heads * (m.qk_dim + m.v_dim) if m.mla else 2 * m.n_kv_heads * m.head_dim


def mla_projections(m: DenseModelCfg, tok: float, rep_tok: float, t: int, sp: bool) -> list[Op]:
    """MLA's projections in place of the QKV GEMM (DeepSeek-V2 Sec 2.1; Megatron-Core's
    ``MLASelfAttention``), one TP rank::

        x ─ q_down ─ q_norm ─ q_up ──────── Q  (a heads x (d_qk + d_rope))
          └ kv_down ─ kv_norm ─ kv_up ─── K (own part), V;  the rotary key part straight from kv_down

    The down projections and the latents' norms are whole on every TP rank (Megatron's
    "duplicated" linears): under SP each runs on the rank's own s/t tokens, and the up
    projections, column-parallel, gather the latents (``mla_gathered_width``) instead of the
    hidden state; without SP every rank runs them on every token, holding 1/t of their model
    FLOPs. Without ``q_lora_rank`` a column-parallel ``q_proj`` reads the hidden state.
    """
    mla, h, a = m.mla, m.hidden, m.heads / t
    down_tok = rep_tok  # (s/t tokens under SP, all of them, on every rank, without)

    def duplicated(op: Op) -> Op:
        return op if sp or t == 1 else replace(op, model_flops=op.flops / t)

    q = [matmul_op("q_proj", tok, h, a * m.qk_dim)] if mla.q_lora_rank is None else [
        duplicated(matmul_op("q_down", down_tok, h, mla.q_lora_rank)),
        elementwise_op("q_norm", down_tok * mla.q_lora_rank, 2),
        matmul_op("q_up", tok, mla.q_lora_rank, a * m.qk_dim)]
    kv = [duplicated(matmul_op("kv_down", down_tok, h, mla.kv_lora_rank + mla.qk_rope_head_dim)),
          elementwise_op("kv_norm", down_tok * mla.kv_lora_rank, 2),
          matmul_op("kv_up", tok, mla.kv_lora_rank, a * (mla.qk_head_dim + mla.v_head_dim))]
    return q[:-1] + kv[:-1] + [q[-1], kv[-1]]  # the down projections, then the up ones (read by core attention)


def mla_gathered_width(m: DenseModelCfg, rope: bool = True) -> int:
    """What MLA's column-parallel up projections gather per token under SP (and reduce the
    gradient of without it): the query latent (the hidden state without ``q_lora_rank``), the
    key/value latent and the rotary key part, in place of the hidden state. Without ``rope``:
    what their weight gradients, or their recompute, gather again (their inputs alone)."""
    mla = m.mla
    return (mla.q_lora_rank or m.hidden) + mla.kv_lora_rank + (mla.qk_rope_head_dim if rope else 0)


def mla_attention_params(m: DenseModelCfg) -> tuple[int, int]:
    """(MLA's attention weights and latent norms, the part of them every TP rank holds whole:
    the down projections and the latents' norms)::

        q     h q_r + q_r a (d_qk + d_rope)       (h a (d_qk + d_rope) without q_r)
        kv    h (kv_r + d_rope) + kv_r a (d_qk + d_v)
        out   a d_v h
    DeepSeek-V3 (h 7168, a 128, q_r 1536, kv_r 512, d_qk 128, d_rope 64, d_v 128): 187.1M a layer."""
    mla, h, a = m.mla, m.hidden, m.heads
    per_norm = 2 if m.norm == "layernorm" else 1
    q_r = mla.q_lora_rank or 0
    down = h * (q_r + mla.kv_lora_rank + mla.qk_rope_head_dim) + per_norm * (q_r + mla.kv_lora_rank)
    q_up = (q_r or h) * a * m.qk_dim
    kv_up = mla.kv_lora_rank * a * (mla.qk_head_dim + mla.v_head_dim)
    return down + q_up + kv_up + a * mla.v_head_dim * h, down


def mlp_block_fwd(m: DenseModelCfg, b: int, t: int, sp: bool = False, cp: int = 1) -> list[Op]:
    """Norm, up (and gate) projection, activation, down projection (one TP rank, s/cp tokens)."""
    tok, h, f = b * m.seq_len / cp, m.hidden, m.ffn // t
    rep_tok = tok / t if sp else tok
    up_width = 2 * f if m.mlp == "swiglu" else f
    return [
        elementwise_op("norm2", rep_tok * h, 2),
        matmul_op("up", tok, h, up_width),
        elementwise_op("act", tok * f, 3 if m.mlp == "swiglu" else 2),
        matmul_op("down", tok, f, h),
        elementwise_op("residual2", rep_tok * h, 3),
    ]


def block_bwd(fwd: list[Op], flash: bool) -> list[Op]:
    """Backward ops of a block, in execution order (reverse of forward).

    Flash attention recomputes QK^T in its backward: 5 matmuls where the model needs 4, so
    the kernel executes 2.5x the forward FLOPs while the model counts 2x (Dao et al. 2022);
    ``2 + qk_share`` in general: under MLA, whose keys are wider than its values (DeepSeek-V3:
    192 and 128), 2.6x.
    """
    out = []
    for op in reversed(fwd):
        bwd = _backward(op)
        if op.name == "core_attn" and flash:
            bwd = replace(bwd, flops=(2 + op.qk_share) * op.flops, qk_share=op.qk_share, kernel="flash_bwd")
        out.append(bwd)
    return out


def embedding_fwd(m: DenseModelCfg, b: int, t: int, cp: int = 1) -> list[Op]:
    """Token (and learned position) embedding lookup on the first stage (vocab-parallel)."""
    return [elementwise_op("embedding", b * m.seq_len / cp * m.hidden, 2)]


def head_fwd(m: DenseModelCfg, b: int, t: int, cp: int = 1) -> list[Op]:
    """Final norm, LM-head matmul (vocab-parallel) and cross-entropy on the last stage."""
    tok = b * m.seq_len / cp
    vocab_local = m.vocab / t
    return [
        elementwise_op("final_norm", tok * m.hidden, 2),
        matmul_op("lm_head", tok, m.hidden, vocab_local),
        Op("cross_entropy", 0.0, 4 * tok * vocab_local * 3),  # fp32 logits: read, exp, write grad
    ]


def layer_params(m: DenseModelCfg) -> int:
    """Parameters of one transformer layer (whole, not per TP rank)."""
    h, d, f = m.hidden, m.head_dim, m.ffn
    qkv_out = (m.heads + 2 * m.n_kv_heads) * d
    attn = mla_attention_params(m)[0] if m.mla else h * qkv_out + m.heads * d * h
    mlp = h * f * (3 if m.mlp == "swiglu" else 2)
    bias = (qkv_out + h + (2 * f if m.mlp == "swiglu" else f) + h) if m.bias else 0
    return attn + mlp + 2 * norm_params(m) + bias


def norm_params(m: DenseModelCfg) -> int:
    """One norm's parameters (LayerNorm's scale and bias, RMSNorm's scale), whole on every TP
    rank: a layer has two, the head one."""
    return 2 * m.hidden if m.norm == "layernorm" else m.hidden


def layer_replicated_params(m: DenseModelCfg) -> int:
    """The parameters of one layer every TP rank holds whole (Megatron): the two norms and the
    biases of the row-parallel GEMMs (attention output, MLP output), added after their
    reduction; the rest of :func:`layer_params` is split over TP. Under MLA also its down
    projections and latents' norms (:func:`mla_attention_params`)."""
    return 2 * norm_params(m) + (2 * m.hidden if m.bias else 0) + (mla_attention_params(m)[1] if m.mla else 0)


def position_params(m: DenseModelCfg) -> int:
    """Learned position embeddings, which every TP rank holds whole (a plain embedding table
    in Megatron; the word embedding is the vocabulary-parallel one)."""
    return m.seq_len * m.hidden if m.position_embedding == "learned" else 0


def embedding_params(m: DenseModelCfg) -> int:
    """Token embedding (+ learned positions) on the first stage."""
    return m.vocab * m.hidden + position_params(m)


def head_params(m: DenseModelCfg) -> int:
    """Final norm plus an untied LM head on the last stage (tied heads reuse the embedding)."""
    return norm_params(m) + (0 if m.tied_embeddings else m.vocab * m.hidden)


def _params(m: DenseModelCfg, moe_mlp) -> int:
    """Dense parameters, with each MoE layer's MLP counted as ``moe_mlp(moe, hidden)``; the
    multi-token prediction modules' layers count as layers ``layers ..`` (:func:`mtp_params`)."""
    n = m.layers + m.mtp_layers
    total = n * layer_params(m) + embedding_params(m) + head_params(m) + m.mtp_layers * mtp_proj_params(m)
    if m.moe is not None:
        n_moe = sum(1 for ly in range(n) if m.is_moe_layer(ly))
        total += n_moe * (moe_mlp(m.moe, m.hidden) - dense_mlp_params(m))
    return total


def mtp_proj_params(m: DenseModelCfg) -> int:
    """A multi-token prediction module's own parameters beside its layer (DeepSeek-V3 Sec 2.2;
    Megatron-Core's ``MultiTokenPredictionLayer``): the norms of the embedding and of the
    hidden state, the projection of their concatenation ``2h -> h``, and its final norm; the
    embedding and the output head are the model's."""
    return mtp_replicated_params(m) + 2 * m.hidden * m.hidden


def mtp_replicated_params(m: DenseModelCfg) -> int:
    """The part of :func:`mtp_proj_params` every TP rank holds whole: its three norms."""
    return 3 * norm_params(m)


def mtp_proj_fwd(m: DenseModelCfg, b: int, t: int, sp: bool = False, cp: int = 1) -> list[Op]:
    """A multi-token prediction module before its layer, one TP rank: the next tokens'
    embedding, the two norms, the ``2h -> h`` projection (column-parallel)::

        emb(t+k) ─ enorm ─┐
                          concat ─ eh_proj ─ the module's layer ─ norm ─ head (the model's)
        h_(k-1)  ─ hnorm ─┘
    """
    tok, h = b * m.seq_len / cp, m.hidden
    rep_tok = tok / t if sp else tok
    return [elementwise_op("mtp_embedding", tok * h, 2), elementwise_op("mtp_norms", 2 * rep_tok * h, 2),
            matmul_op("mtp_proj", tok, 2 * h, h / t)]


def mtp_proj_activation_bytes(m: DenseModelCfg, b: int, t: int, sp: bool = False, cp: int = 1,
                              fp8: str = "") -> float:
    """What a multi-token prediction module keeps before its layer: the two norms' inputs and
    the projection's input, their outputs concatenated: ``2sb (2h + 2h)``, /t under SP; under
    FP8 training the projection's input as its FP8 copy, ``sb (2 * 2h + 2h)``
    (:func:`fp8_saved_terms`)."""
    return (2 + (1 if fp8 else 2)) * m.seq_len / cp * b * 2 * m.hidden / (t if sp else 1)


def mtp_checkpoint_bytes(m: DenseModelCfg, b: int, t: int, sp: bool = False, cp: int = 1) -> float:
    """What a multi-token prediction module keeps under full recompute: its checkpoint's two
    inputs, the hidden state and the next tokens' embedding, ``2 x 2sbh`` (/t under SP), as
    Megatron-Core's ``MultiTokenPredictionLayer`` checkpoints its norms, projection and layer
    together; the rest is recomputed."""
    return 2 * 2 * m.seq_len / cp * b * m.hidden / (t if sp else 1)


def total_params(m: DenseModelCfg) -> int:
    """All parameters of the model, counted once (MoE layers with all their experts)."""
    return _params(m, moe_layer_mlp_params)


def active_params(m: DenseModelCfg) -> int:
    """Parameters one token passes through (MoE: k routed + shared experts per layer)."""
    return _params(m, moe_active_mlp_params)


def dense_mlp_params(m: DenseModelCfg) -> int:
    """Weights and biases of the dense MLP of one layer."""
    mats = 3 if m.mlp == "swiglu" else 2
    bias = ((2 * m.ffn if m.mlp == "swiglu" else m.ffn) + m.hidden) if m.bias else 0
    return mats * m.hidden * m.ffn + bias


# what each module of Megatron-LM's selective recompute (--recompute-modules) drops from
# what a layer keeps: the terms of layer_activation_terms it recomputes in the backward
RECOMPUTE_MODULES = {
    "core_attn": ("scores",),                       # core attention again (QK^T, softmax)
    "layernorm": ("qkv_input", "mlp_input"),        # the two norms' outputs again
    "mlp": ("mlp_fc1", "mlp_act"),                  # a dense MLP again, from its input
    # a MoE layer again, dispatch included
    "moe": ("experts_fc1", "experts_act", "shared", "dispatched", "shared_input_fp8"),
    "moe_act": ("experts_act",),                    # the routed experts' activation function again
    # the shared experts again (with, under FP8's delayed scaling, the FP8 copy of their input)
    "shared_experts": ("shared", "shared_input_fp8"),
    "mla_up_proj": ("qkv", "mla_normed"),           # MLA's latent norms and up projections again (Transformer
                                                    # Engine fuses each norm into its up projection)
}


# the terms the attention's backward recomputes (the others, the MLP's or MoE layer's)
ATTENTION_TERMS = frozenset({"scores", "qkv_input", "qkv", "mla_normed"})


def dropped_terms(modules) -> set[str]:
    """The terms of :func:`layer_activation_terms` that selective recompute's ``modules`` drop
    (a layer lacks some: a MoE module's in a dense layer, a dense one's in a MoE layer)."""
    return {term for mod in modules for term in RECOMPUTE_MODULES[mod]}


def recomputed_bytes(m: DenseModelCfg, b: int, t: int, flash: bool, sp: bool = False, moe_layer: bool = False,
                     cp: int = 1, modules: frozenset | tuple = ("core_attn",), etp: int = 0, fp8: str = "") -> float:
    """The most of one layer's terms that selective recompute's ``modules`` drop held at once:
    the attention's (its scores, its norm's output), recomputed in its backward, or the MLP's
    or MoE layer's, recomputed in theirs, whichever is more (each is freed when its backward
    has used it)::

        held = max(dropped attention terms, dropped MLP terms)
    """
    terms = layer_activation_terms(m, b, t, flash, sp, moe_layer, cp, etp, fp8)
    dropped = dropped_terms(modules) & terms.keys()
    # (in the terms' own order: a set of strings iterates in an order the hash seed picks)
    return max(sum_left(v for x, v in terms.items() if x in dropped and x in ATTENTION_TERMS),
               sum_left(v for x, v in terms.items() if x in dropped and x not in ATTENTION_TERMS))


def layer_activation_terms(m: DenseModelCfg, b: int, t: int, flash: bool, sp: bool = False,
                           moe_layer: bool = False, cp: int = 1, etp: int = 0, fp8: str = "") -> dict[str, float]:
    """Bytes one layer keeps from forward to backward, per microbatch, per TP rank, term by
    term, without recompute (:func:`layer_activation_bytes` sums them).

    Korthikanti et al. 2022 Sec 4.1 term by term:
    replicated: norm inputs 2*2sbh, QKV input 2sbh, MLP input 2sbh, dropout masks 2*sbh
    (split over t too under sequence parallelism: 34/t in their Table 2);
    sharded over t: Q,K,V, context, MLP intermediates (the first GEMM's output, f or 2f with a
    gate, and the activation's, f); attention scores 5as^2b unless flash attention drops them.
    Under MLA, Q and K are ``a (d_qk + d_rope)`` wide, V and the context ``a d_v``, and the
    latents add ``2sb (q_r + kv_r)`` twice (``mla_latents`` before their norms, ``mla_normed``
    after, the up projections' inputs; /t under SP);
    (softmax output 2, dropout mask 1, dropout output 2 bytes per score; without dropout the
    softmax output alone, 2, is what the product with V reads).
    Context parallelism keeps the terms of its s/cp tokens: s -> s/cp (the scores term, s/cp
    queries x s keys, only arises without flash attention, which CP does not use).

    A MoE layer keeps its experts' intermediates in place of the dense MLP's (sharded over t,
    routed ``experts_*`` and ``shared``) and the hidden states dispatched to its experts,
    ``2 s b k cap h``: whole on every TP rank (the dispatch all-to-all brings them, and under
    SP with EP the TP group all-gathers them: program/work.py ``MoeBlocks``; the experts'
    first GEMM is column-parallel, its input replicated). With experts split over fewer
    ranks, ``etp`` < t (SP), a rank's experts take the tokens of its etp group alone: etp/t of
    them. The routed intermediates are /t either way (etp/t of the tokens, f_e/etp wide)::

        MoE layer, tp 2:  replicated terms + dispatched 2sbk.cap.h + (QKV + context + experts)/2
        etp 1 (SP):       the dispatched term /2

    Under FP8 training (``fp8``) the inputs of the GEMMs cast to FP8 are kept as their FP8
    copies, one byte a value (:func:`fp8_saved_terms`).
    """
    s, h = m.seq_len / cp, m.hidden
    sbh = s * b * h
    rep = 1 / t if sp else 1.0
    terms = {"norm_inputs": 2 * sbh * 2 * rep, "qkv_input": 2 * sbh * rep, "mlp_input": 2 * sbh * rep,
             "masks": (2 * sbh if m.dropout else 0.0) * rep,
             "qkv": 2 * s * b * (m.heads * m.qk_dim + kv_width(m)) / t, "context": 2 * s * b * m.heads * m.v_dim / t,
             "scores": 0.0 if flash else attention_scores_bytes(m, b, t, cp)}
    if m.mla:
        # each latent before its norm (the norm's input) and after it (the up projection's),
        # on the rank's own tokens under SP (whole without: replicated); the rotary key part
        # keeps nothing (rope saves its cos and sin only)
        q_r = m.mla.q_lora_rank or 0
        latents = 2 * s * b * (q_r + m.mla.kv_lora_rank) * rep
        terms |= {"mla_latents": latents, "mla_normed": latents}
    if moe_layer and m.moe is not None:
        # expert intermediates for the k routed copies and the shared experts, plus the
        # dispatched hidden states kept for the expert GEMMs' weight gradients
        e = m.moe
        routed = 2 * s * b * e.top_k * e.padded * e.expert_ffn / t
        terms |= {"experts_fc1": routed * (e.mats - 1), "experts_act": routed,
                  "shared": 2 * s * b * e.shared_experts * e.expert_ffn * e.mats / t,
                  "dispatched": 2 * s * b * e.top_k * e.padded * h * _expert_share(t, etp)}
    else:
        f = 2 * s * b * m.ffn / t
        terms |= {"mlp_fc1": f * (2 if m.mlp == "swiglu" else 1), "mlp_act": f}
    return fp8_saved_terms(terms, m, flash, fp8) if fp8 else terms


# the terms of layer_activation_terms that are a Linear layer's input: under FP8 training
# Transformer Engine casts them to FP8 for the forward GEMM and keeps that copy (or its
# transpose) for the weight gradient's GEMM, not the 16-bit tensor (its _Linear.forward
# saves the FP8 input, as do LayerNormLinear's normed output and GroupedLinear's inputs)
FP8_LINEAR_INPUTS = frozenset({"qkv_input", "mlp_input", "mla_normed", "mlp_act", "experts_act", "dispatched"})


def fp8_saved_terms(terms: dict[str, float], m: DenseModelCfg, flash: bool, recipe: str = "delayed"
                    ) -> dict[str, float]:
    """``terms`` (16-bit bytes, :func:`layer_activation_terms`) as FP8 training under
    ``recipe`` keeps them (Transformer Engine with Megatron-LM's layers): a Linear layer's
    input one byte a value (:data:`FP8_LINEAR_INPUTS`), where one layer alone reads it::

                                                   delayed        tensorwise, blockwise, mxfp8
        QKV / MLP input (a fused norm's output),
        MLA's normed latents, activation output,
        dispatched tokens                          2 -> 1 byte    2 -> 1
        context (the out projection's input)       flash 2 + 1,   2
                                                   standard 1
        a MoE layer's MLP input (the router's      2 + 1          2
        16-bit copy + a shared expert's FP8 copy,
        ``shared_input_fp8``)
        MLA's QKV input (two down projections,     2 -> 1 + 1     1 + 1
        an FP8 copy each)
        shared experts (first GEMM's output +      2f' + 2f -> 2f' + f
        activation's)
        norm inputs, Q/K/V, activation inputs,     unchanged
        masks

    The 16-bit tensor a Linear layer reads is freed once it has run, unless another op keeps it:
    flash attention keeps its output for its own backward, and a MoE router its input. Under
    delayed scaling the out projection and a shared expert then keep an FP8 copy besides; the
    other recipes keep their 16-bit input instead (Megatron-LM's ``set_save_original_input``,
    Transformer Engine 2.6 and later).
    """
    delayed = recipe == "delayed"
    out = {k: v / 2 if k in FP8_LINEAR_INPUTS else v for k, v in terms.items()}
    out["context"] = terms["context"] * (1.0 if not delayed else 1.5 if flash else 0.5)
    if m.mla:  # the down projections each keep a copy
        out["qkv_input"] = terms["qkv_input"]
    if "dispatched" in terms:  # a MoE layer: the router keeps its 16-bit input, a shared expert its FP8 copy
        out["mlp_input"] = terms["mlp_input"]
        if delayed and m.moe.shared_experts:
            out["shared_input_fp8"] = terms["mlp_input"] / 2
    if "shared" in terms:  # the activation's output, one of the expert's `mats` widths, is fc2's input
        out["shared"] = terms["shared"] * (1 - 0.5 / m.moe.mats)
    return out


def _expert_share(t: int, etp: int) -> float:
    """The share of a TP group's tokens a rank's routed experts take: etp/t where etp
    (0: t) splits them over fewer ranks than TP (under SP, which that needs), else all."""
    return (etp or t) / t


def layer_activation_bytes(m: DenseModelCfg, b: int, t: int, flash: bool, sp: bool = False,
                           recompute: str = "none", moe_layer: bool = False, cp: int = 1,
                           modules: frozenset | tuple = ("core_attn",), etp: int = 0, fp8: str = "") -> float:
    """Bytes one layer keeps from forward to backward, per microbatch, per TP rank: the sum of
    :func:`layer_activation_terms`, less what recompute leaves unstored. Full recompute keeps
    the layer input only: 2sbh (2sbh/t with SP). Selective recompute drops the terms of its
    ``modules`` (Megatron-LM's ``--recompute-modules``, :data:`RECOMPUTE_MODULES`; by default
    core attention's scores, which flash attention does not keep anyway)."""
    if recompute == "full":
        return 2 * m.seq_len / cp * b * m.hidden / (t if sp else 1)
    terms = layer_activation_terms(m, b, t, flash, sp, moe_layer, cp, etp, fp8)
    dropped = dropped_terms(modules) if recompute == "selective" else set()
    return sum_left(x for term, x in terms.items() if term not in dropped)


def layer_wgrad_bytes(m: DenseModelCfg, b: int, t: int, sp: bool = False, moe_layer: bool = False,
                      cp: int = 1, etp: int = 0, fp8: str = "") -> float:
    """Bytes one layer keeps from its input-gradient pass B to its weight-gradient
    pass W, per microbatch, per TP rank: each linear layer's input and output gradient, what
    ``dW = X^T dY`` reads; B frees the rest (Qi et al. 2023, arXiv:2401.10241, Sec 2.3 and
    Table 1: M_W = 32sbh against M_B = 34sbh + 5as^2b)::

        inputs    QKV 2sbh + MLP-up 2sbh       (/t under SP: the local shard, gathered again in W)
                  proj 2sbh/t + MLP-down 2sbh.f/(h t)
        grads     QKV 2sb(a+2g)d/t + MLP-up 2sb.f'/t  (f' = 2f with a gate)
                  proj 2sbh + MLP-down 2sbh          (whole: a row-parallel output's gradient)
        t = 1, a = g, f = 4h, GELU:  (2 + 2 + 2 + 8) + (6 + 8 + 2 + 2) = 32 sbh
        MLA, attention:  inputs 2sbh + 2sb(q_r + kv_r) + context;  grads 2sb(q_r + kv_r + d_rope)
                         + Q 2sb a(d_qk + d_rope)/t + K/V 2sb a(d_qk + d_v)/t + 2sbh
                         (the latent terms and 2sbh /t under SP)

    Recompute does not shrink it: B recomputes the layer, and W keeps the recomputed inputs.
    A MoE layer's MLP terms are its experts': the dispatched hidden states (whole on every TP
    rank, as :func:`layer_activation_bytes` counts them) and the routed copies' output
    gradients ``2 s b k cap h``, the intermediates ``2 s b copies f_e mats / t``; the shared
    experts read the norm's output and give one ``2sbh`` gradient. The router's weight gradient
    is taken in B (a plain linear layer, outside the split). With ``etp`` < t the dispatched
    states and their gradients are the etp group's tokens, etp/t of them (as
    :func:`layer_activation_terms`).

    Under FP8 training (``fp8``, any recipe) W reads each input as its FP8 copy, one byte a
    value: where the forward kept the 16-bit input (:func:`fp8_saved_terms`), B quantizes it
    before storing it for W (Transformer Engine's ``_Linear.backward``, ``wgrad_store``);
    MLA's normed input keeps two, one for each down projection. The output gradients stay two
    bytes a value: Transformer Engine keeps a delayed weight gradient's FP8 output gradient
    row-wise and column-wise (its transpose) on Hopper::

        t = 1, a = g, f = 4h, GELU, FP8:  (1 + 1 + 1 + 4) + (6 + 8 + 2 + 2) = 25 sbh
    """
    s, h = m.seq_len / cp, m.hidden
    sbh = s * b * h
    rep = 1 / t if sp else 1.0
    context = 2 * s * b * m.heads * m.v_dim / t  # the out projection's input
    if m.mla:
        # inputs: the norm's output (both down projections, or q_proj), each up projection's
        # latent; gradients: each down and up projection's output, the out projection's
        mla, q_r = m.mla, m.mla.q_lora_rank or 0
        latents = 2 * s * b * (2 * q_r + mla.kv_lora_rank + (mla.kv_lora_rank + mla.qk_rope_head_dim)) * rep
        ups = 2 * s * b * m.heads * (m.qk_dim + mla.qk_head_dim + mla.v_head_dim) / t
        attn = 2 * sbh * rep + latents + context + ups + 2 * sbh
    else:
        attn = 2 * sbh * rep + context + 2 * s * b * (m.heads + 2 * m.n_kv_heads) * m.head_dim / t + 2 * sbh
    if moe_layer and m.moe is not None:
        e = m.moe
        routed = e.top_k * e.padded
        mlp = 2 * 2 * s * b * routed * h * _expert_share(t, etp) \
            + 2 * s * b * (routed + e.shared_experts) * e.expert_ffn * e.mats / t
        if e.shared_experts:
            mlp += 2 * sbh * rep + 2 * sbh
    else:
        mlp = 2 * sbh * rep + 2 * s * b * m.ffn * (3 if m.mlp == "swiglu" else 2) / t + 2 * sbh
    if not fp8:
        return attn + mlp
    # the inputs among those terms, each read as its FP8 copy (half), but MLA's normed input,
    # which both down projections read, a copy each (whole)
    inputs = context + (2 * s * b * (q_r + mla.kv_lora_rank) * rep if m.mla else 2 * sbh * rep)
    if moe_layer and m.moe is not None:
        inputs += 2 * s * b * routed * h * _expert_share(t, etp) + 2 * s * b * routed * e.expert_ffn / t
        if e.shared_experts:
            inputs += 2 * sbh * rep + 2 * s * b * e.shared_experts * e.expert_ffn / t
    else:
        inputs += 2 * sbh * rep + 2 * s * b * m.ffn / t
    return attn + mlp - inputs / 2


def head_wgrad_bytes(m: DenseModelCfg, b: int, t: int, sp: bool = False, cp: int = 1) -> float:
    """What the LM head's W reads (split backward): its input, ``2sbh`` (the local shard,
    ``/t``, under SP), and the 16-bit gradient of its vocabulary-parallel logits, ``2sbV/t``."""
    s = m.seq_len / cp
    return 2 * s * b * m.hidden / (t if sp else 1) + 2 * s * b * m.vocab / t


def embedding_wgrad_bytes(m: DenseModelCfg, b: int, cp: int = 1) -> float:
    """What the embedding's W reads (split backward): the gradient of its output, gathered whole
    (``2sbh``; the token ids are negligible)."""
    return 2 * m.seq_len / cp * b * m.hidden


def attention_scores_bytes(m: DenseModelCfg, b: int, t: int, cp: int = 1) -> float:
    """One layer's stored attention scores under standard attention, per TP rank: softmax
    output 2, dropout mask 1 and dropout output 2 bytes per score, the softmax output alone
    without dropout (Korthikanti et al. 2022, Sec 4.1): 5as^2b/t or 2as^2b/t, s/cp queries."""
    return (5 if m.dropout else 2) * m.heads * (m.seq_len / cp) * m.seq_len * b / t


def head_activation_bytes(m: DenseModelCfg, b: int, t: int, cp: int = 1) -> float:
    """fp32 logits kept for the cross-entropy backward on the last stage."""
    return 4 * b * m.seq_len / cp * m.vocab / t


def model_flops_per_token_closed_form(m: DenseModelCfg) -> float:
    """6*N_matmul + 6*L*s*h (fwd+bwd): PaLM's count (App. B) with the causal half of its
    12*L*s*h attention term, as Megatron-LM counts it, for a dense model (a MoE model's active
    parameters: tests/test_throughput.py). Under MLA the attention term is
    ``3 L s a (d_qk + d_rope + d_v)`` (QK^T over the query/key width, PV over the value's;
    ``6 L s h`` where both are ``h/a``), and N_matmul counts the latents' norms too. Each
    multi-token prediction module adds a layer, its ``2h x h`` projection and the head again."""
    n = m.layers + m.mtp_layers  # each MTP module: a layer, its 2h x h projection and the head again
    n_matmul = n * layer_params(m) + (1 + m.mtp_layers) * m.vocab * m.hidden + m.mtp_layers * 2 * m.hidden ** 2
    return 6 * n_matmul + 3 * n * m.seq_len * m.heads * (m.qk_dim + m.v_dim)


from .moe import MoeCfg, moe_active_mlp_params, moe_layer_mlp_params  # noqa: E402  (moe builds on Op)

DenseModelCfg.model_rebuild()
