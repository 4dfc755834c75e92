"""Where model meets hardware: seconds for an op on a GPU (roofline with calibrated efficiency).

    time = max( flops / (peak_flops * efficiency),
                bytes / (hbm_bw * memory_efficiency) )

    efficiency = a GEMM's by its shape (tiles and waves over the SMs, a short reduction's
                 fixed cost: hardware/gpus.py GemmFit), or for flash attention's fused
                 kernels attention_efficiency (forward, backward)

(Williams et al. 2009, "Roofline"; efficiencies fitted per GPU in hardware/gpus.py.)
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

from ..floats import sum_left
from ..hardware.gpus import GemmFit, GpuSpec, gemm_shape_factor
from ..model.transformer import Op

# fp32 master weights, Adam m and v and the gradient read; master, m, v and 16-bit weights written
# (m and v 4 bytes each, or 2 in bf16: work.optimizer_bytes)
ADAM_MASTER_BYTES, ADAM_WEIGHT_BYTES = 4, 2


# Ops that FP8 training still runs in 16-bit: Transformer Engine casts the GEMMs of its Linear
# layers (QKV, out projection, MLP, experts) to FP8, but leaves dot-product attention in BF16
# unless asked (its fp8_dpa is off by default), and Megatron-LM's output layer (the LM head)
# and MoE router are not Transformer Engine layers
BF16_UNDER_FP8 = frozenset({"core_attn", "lm_head", "router"})


# Transformer Engine's cast of a GEMM operand to FP8 (``cast_transpose``): it reads each 16-bit
# value and writes it as FP8 twice, as is and transposed (Hopper's FP8 GEMMs take one layout, and
# the weight gradient reads the other)
FP8_CAST_BYTES_PER_ELEM = 2 + 1 + 1


def fp8_cast_time_s(op: Op, gpu: GpuSpec) -> float:
    """The memory-bound pass that casts an FP8 GEMM's operand to FP8 before it runs: its input
    in the forward (and in a recompute), its output gradient in the backward, 4 bytes a value::

        time = fp8_cast_elems * (2 read + 1 FP8 + 1 FP8 transposed) / (hbm_bw * memory_efficiency)

    Not counted: the weights' casts (once a step, where the first microbatch makes them), the
    amax pass current scaling makes before it casts, and the casts Transformer Engine fuses into
    the norm or the activation before the GEMM (a fused one writes the FP8 copies alone: the
    read here is then too much)."""
    return op.fp8_cast_elems * FP8_CAST_BYTES_PER_ELEM / (gpu.hbm_bw_Bps * gpu.memory_efficiency)


def op_time_s(op: Op, gpu: GpuSpec, precision: str, sm_share: float = 1.0) -> float:
    """Roofline time of one op (under ``fp8``, the ops of :data:`BF16_UNDER_FP8` at the bf16
    peak). ``sm_share``: the share of the SMs the op gets where communication kernels hold the
    rest; the tensor-core peak scales with it, HBM bandwidth does not (the SMs left still
    saturate it)::

        time = max( flops / (peak * sm_share * efficiency), bytes / (hbm_bw * memory_efficiency) )

    ``efficiency``: the op's GEMMs' by their shapes (:func:`gemm_efficiency`), or its
    flash-attention kernels' own (``GpuSpec.attention_efficiency``, forward or backward) for
    core attention under flash.
    An FP8 GEMM adds the cast of its operand to FP8 (:func:`fp8_cast_time_s`), a kernel of its own.
    """
    cast_s = 0.0
    if precision == "fp8":
        if op.name in BF16_UNDER_FP8:
            precision = "bf16"
        elif op.fp8_cast_elems:
            cast_s = fp8_cast_time_s(op, gpu)
    eff = gemm_efficiency(op, gpu, precision, sm_share)
    if op.kernel and gpu.attention_efficiency is not None:  # a flash-attention kernel's own
        eff = gpu.attention_efficiency[op.kernel == "flash_bwd"]
    compute = op.flops / (gpu.peak_flops(precision) * sm_share * eff)
    memory = op.bytes / (gpu.hbm_bw_Bps * gpu.memory_efficiency)
    return max(compute, memory) + cast_s


def gemm_efficiency(op: Op, gpu: GpuSpec, precision: str, sm_share: float = 1.0) -> float:
    """The share of the peak an op's GEMMs reach together: each GEMM's by its shape
    (``GpuSpec.gemm_fit``, :class:`~clustersim.hardware.gpus.GemmFit`) on the SMs it gets,
    weighted by its FLOPs, as GEMMs run back to back::

        efficiency = sum flops_i / sum (flops_i / efficiency_i)      flops_i = 2 g m n k

    ``matmul_efficiency`` for an op without GEMM shapes or a GPU without a fit."""
    fit = gpu.gemm_fit(precision)
    if fit is None or not op.gemms:
        return gpu.matmul_efficiency
    return _gemms_efficiency(op.gemms, fit, max(1, round(gpu.sms * sm_share)))


@lru_cache(maxsize=16384)  # a plan's ops repeat over its layers, stages and microbatches
def _gemms_efficiency(gemms: tuple, fit: GemmFit, sms: int) -> float:
    work = [g * m * n * k for g, m, n, k in gemms]
    spent = [w / (fit.efficiency * gemm_shape_factor(fit, sms, *shape)) for w, shape in zip(work, gemms)]
    return sum_left(work) / sum_left(spent)


def ops_time_s(ops: Iterable[Op], gpu: GpuSpec, precision: str, sm_share: float = 1.0) -> float:
    """Ops run back to back on one stream: times add."""
    return sum_left(op_time_s(o, gpu, precision, sm_share) for o in ops)


def adam_step_time_s(params: float, gpu: GpuSpec, grad_bytes: int = 4, state_bytes: int = 12) -> float:
    """Fused Adam over ``params`` local parameters: memory-bound, one pass over the states
    (``state_bytes``: master weights and moments, ``work.optimizer_bytes``)::

        read   master 4 + m + v + gradient g          write   master 4 + m + v + weights 2
        fp32 moments, fp32 gradients: 16 + 14 = 30 bytes a parameter
    """
    bytes_ = params * (state_bytes + grad_bytes + state_bytes + ADAM_WEIGHT_BYTES)
    return bytes_ / (gpu.hbm_bw_Bps * gpu.memory_efficiency)


# Optimizer offload (Megatron-LM's HybridDeviceOptimizer, read in its source): the host keeps
# the offloaded shard's fp32 master weights and moments and a pinned fp32 gradient buffer; the
# gradient goes down and the updated master weights come back as fp32, each cast on the GPU
OFFLOAD_COPY_BYTES = 4
HOST_STATE_BYTES = 12 + 4  # master, m, v and the gradient buffer, a parameter
HOST_ADAM_BYTES = 16 + 12  # read master, m, v, gradient; write master, m, v (fp32 AdamW on the CPU)


def host_copy_s(size_bytes: float, copy_Bps: float, host_share_Bps: float) -> float:
    """Seconds a copy to or from host memory takes: at the GPU's copy rate, or the host
    memory's share where slower (the copy lands there too)::

        size_bytes / min(copy_Bps, host_share_Bps)
    """
    return size_bytes / min(copy_Bps, host_share_Bps)


def offload_times_s(params: float, copy_Bps: float, host_share_Bps: float,
                    pipelined: bool = False) -> tuple[float, float, float]:
    """(down, step, up): seconds to copy the gradients of ``params`` offloaded parameters to the
    host, to step them with the CPU's Adam, and to copy their weights back::

        down = up = params * 4 B / min(copy_Bps, host_share_Bps)
        step      = params * 28 B / host_share_Bps              (+ 8 B pipelined)

    ``copy_Bps``: node.host.copy_GBps, every GPU copying; ``host_share_Bps``: node.host.
    memory_GBps over the node's GPUs, whose ranks step at once. A copy lands in host memory
    too: one alone moves at the slower of the two; pipelined (``overlap_offload_copies``),
    the copies of the next and the last tensors run beside the step and take their 4 + 4
    bytes a parameter of the same memory, which the step is charged with.
    """
    copy_s = host_copy_s(params * OFFLOAD_COPY_BYTES, copy_Bps, host_share_Bps)
    step_bytes = HOST_ADAM_BYTES + (2 * OFFLOAD_COPY_BYTES if pipelined else 0)
    return copy_s, params * step_bytes / host_share_Bps, copy_s
