"""GPU catalogue: peak throughput, HBM and NVLink figures, and calibrated efficiencies.

Each figure has one owner: this table. Peak numbers are dense (no sparsity) tensor-core
rates from the vendors' data sheets.

Efficiencies turn a peak into what a kernel reaches. They are fitted once per GPU type to
published measurements and never tuned per scenario::

    matmul_efficiency  = measured large-GEMM TFLOP/s / peak
                         A100: 253-257 / 312 (cuBLASLt 8K-16K)  -> 0.82
                         H100: 700-800 / 989 ("commonly", bf16)  -> 0.76
    memory_efficiency  = measured STREAM copy / HBM peak
                         A100-80GB: 1.61-1.75 / 2.039 -> 0.82
                         H100: 2.90-3.18 / 3.35      -> 0.91
                         H200: 4.0-4.5 / 4.8         -> 0.89
    attention_efficiency = a flash-attention kernel's TFLOP/s / peak, (forward, backward), head
                         dimension 128 at 16K tokens, its FLOPs counted as clustersim counts them
                         (the causal half; the backward 2.5x the forward)
                         A100 (FlashAttention-2, Dao 2023, Fig. 5d and 6b):
                               forward causal ~200 / 312, backward 196 / 312  -> (0.64, 0.63)
                         H100 (FlashAttention-3, Shah et al. 2024, Fig. 5d and 6b, 989 peak at
                               the 1830 MHz clock they fix): forward causal 616,
                               backward 561 (without the mask: the one they give) -> (0.62, 0.57)
                         (cuDNN 9.1 on H100 in the same figures: 539 and 516)

GPUs without a published measurement in the reference file borrow the figure of their
closest sibling (noted per entry); the calibration work replaces them.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator type. Rates are per GPU; NVLink bandwidth is per direction."""

    name: str
    bf16_flops: float
    fp8_flops: float | None
    hbm_bw_Bps: float
    hbm_capacity_bytes: float
    nvlink_bw_Bps: float
    matmul_efficiency: float
    memory_efficiency: float
    note: str = ""
    # NVLink SHARP (NVLS, third-generation NVSwitch and later): the NVSwitch reduces and
    # multicasts, each GPU sends S up and receives S down. The per-direction rate it sustains,
    # as a fraction of NVLink line rate; None where the switch cannot (A100's NVSwitch).
    nvls_efficiency: float | None = None
    # flash attention's fused kernels, (forward, backward): their share of the tensor-core peak,
    # below a large GEMM's (softmax's exponentials run on the slower special-function units,
    # the backward's five matmuls wait on its reductions); None: matmul_efficiency
    attention_efficiency: tuple[float, float] | None = None
    tdp_W: float = 0.0  # board power limit (vendor datasheets), for energy projections
    sms: int = 0  # streaming multiprocessors (vendor whitepapers); 0 where not given
    # the share of the SMs the compute of an overlapped F&B chunk gets where communication
    # kernels hold the rest through it (DeepEP's, ``model.moe.deepep_sms``): set per run by the
    # lowering (program.lower), 1.0 in the catalogue
    chunk_sm_share: float = 1.0

    def peak_flops(self, precision: str) -> float:
        """Dense tensor-core peak for ``precision`` ('bf16', 'fp16' or 'fp8')."""
        if precision in ("bf16", "fp16"):
            return self.bf16_flops
        if precision == "fp8":
            if self.fp8_flops is None:
                raise KeyError(f"{self.name} has no fp8 tensor cores")
            return self.fp8_flops
        raise KeyError(f"unknown precision {precision!r}")


def _gpu(name, bf16_T, fp8_T, hbm_GBps, hbm_GiB, nvlink_GBps, mm_eff, mem_eff, note="", nvls=None, tdp_W=0.0,
         sms=0, attn=None):
    return GpuSpec(
        name=name,
        bf16_flops=bf16_T * 1e12,
        fp8_flops=None if fp8_T is None else fp8_T * 1e12,
        hbm_bw_Bps=hbm_GBps * 1e9,
        hbm_capacity_bytes=hbm_GiB * GiB,
        nvlink_bw_Bps=nvlink_GBps * 1e9,
        matmul_efficiency=mm_eff,
        memory_efficiency=mem_eff,
        note=note,
        nvls_efficiency=nvls,
        attention_efficiency=attn,
        tdp_W=tdp_W,
        sms=sms,
    )


# nccl-tests on 8x H100 with NVLS: all-reduce busbw 478.9 GB/s at 8 GB (as published by NVIDIA).
# busbw = S/t * 2(n-1)/n and t = S / (eff * line rate), so eff = 478.9 / (7/4) / 450 = 0.608.
NVLS_EFFICIENCY_H100 = 478.9 / (2 * 7 / 8) / 450

# flash attention, head dimension 128, 16K tokens (module docstring): FlashAttention-2 on A100
# (forward with the causal mask, backward without: Dao 2023, Fig. 5d, 6b), FlashAttention-3 on
# H100 (Shah et al. 2024, Fig. 5d, 6b)
ATTENTION_EFFICIENCY_A100 = (200 / 312, 196 / 312)
ATTENTION_EFFICIENCY_H100 = (616 / 989, 561 / 989)


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        _gpu("A100-SXM4-40GB", 312, None, 1555, 40, 300, 0.82, 0.82,
             "memory efficiency borrowed from A100-80GB", tdp_W=400, sms=108, attn=ATTENTION_EFFICIENCY_A100),
        _gpu("A100-SXM4-80GB", 312, None, 2039, 80, 300, 0.82, 0.82, tdp_W=400, sms=108,
             attn=ATTENTION_EFFICIENCY_A100),
        _gpu("H100-SXM5-80GB", 989, 1979, 3350, 80, 450, 0.76, 0.91, nvls=NVLS_EFFICIENCY_H100, tdp_W=700, sms=132,
             attn=ATTENTION_EFFICIENCY_H100),
        _gpu("H800-SXM-80GB", 989, 1979, 3350, 80, 200, 0.76, 0.91,
             "same die as H100; efficiencies borrowed from H100", nvls=NVLS_EFFICIENCY_H100, tdp_W=700, sms=132,
             attn=ATTENTION_EFFICIENCY_H100),
        _gpu("H200-SXM-141GB", 989, 1979, 4800, 141, 450, 0.76, 0.89,
             "matmul, attention and NVLS efficiency borrowed from H100", nvls=NVLS_EFFICIENCY_H100, tdp_W=700,
             sms=132, attn=ATTENTION_EFFICIENCY_H100),
        _gpu("B200", 2250, 4500, 8000, 180, 900, 0.76, 0.89,
             "no published measurement yet; efficiencies borrowed from H200", nvls=NVLS_EFFICIENCY_H100,
             tdp_W=1000, sms=148, attn=ATTENTION_EFFICIENCY_H100),
    )
}

# Short names users type; each maps to one catalogue entry.
ALIASES: dict[str, str] = {
    "A100": "A100-SXM4-80GB",
    "A100-80GB": "A100-SXM4-80GB",
    "A100-40GB": "A100-SXM4-40GB",
    "H100": "H100-SXM5-80GB",
    "H800": "H800-SXM-80GB",
    "H200": "H200-SXM-141GB",
}


def lookup_gpu(name: str) -> GpuSpec:
    """Catalogue entry for ``name`` or an alias; KeyError lists the known names."""
    key = ALIASES.get(name, name)
    if key not in GPUS:
        known = ", ".join(sorted(GPUS) + sorted(ALIASES))
        raise KeyError(f"unknown GPU {name!r}; known: {known}")
    return GPUS[key]
