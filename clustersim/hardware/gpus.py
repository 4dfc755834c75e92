"""GPU catalogue: peak throughput, HBM and NVLink figures, and calibrated efficiencies.

Each figure has one owner: this table. Peak numbers are dense (no sparsity) tensor-core
rates from the vendors' data sheets.

Efficiencies turn a peak into what a kernel reaches. They are fitted once per GPU type to
published measurements and never tuned per scenario::

    matmul_efficiency  = measured large-GEMM TFLOP/s / peak
                         A100: 253-257 / 312 (cuBLASLt 8K-16K)  -> 0.82
                         H100: 700-800 / 989 ("commonly", bf16)  -> 0.76
                         (an 8192-cubed GEMM's; other shapes follow gemm_bf16 and gemm_fp8:
                         :class:`GemmFit`, below the catalogue)
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
from functools import lru_cache
from math import ceil

GiB = 1024**3


@dataclass(frozen=True)
class GemmFit:
    """How a GEMM's shape sets the share of the tensor-core peak it reaches on one GPU type, at
    one precision (program/costs.py ``gemm_efficiency``).

    A GEMM kernel cuts the (m x n) output into tiles, one thread block (one SM) each, and runs
    them in waves over the SMs; a tile loops over the reduction k, and pays a fixed cost of its
    own (filling its load pipeline, writing its tile out), worth ``k0`` elements of the loop
    for a 128 x 128 tile and in proportion to its area for the others. The library picks the
    tile that finishes first::

        tiles   = groups * ceil(m / tm) * ceil(n / tn)           waves = ceil(tiles / sms)
        fill    = groups * m * n / (waves * sms * tm * tn)       (tile and wave quantization)
        share   = efficiency * max over tiles of  fill * k / (k + k0 * 128 * 128 / (tm * tn))

    (NVIDIA, "Matrix Multiplication Background User's Guide", Sec 2-3: tile and wave
    quantization; the fixed cost a tile's loop amortizes is what makes short reductions slow.)
    ``efficiency``: a GEMM that fills its waves with a long reduction; ``source`` says what
    fixed it.
    """

    efficiency: float
    k0: float
    tiles: tuple[tuple[int, int], ...]
    source: str = ""


def gemm_shape_factor(fit: GemmFit, sms: int, groups: float, m: float, n: float, k: float) -> float:
    """The share of ``fit.efficiency`` a (groups, m, n, k) GEMM reaches on ``sms`` SMs
    (:class:`GemmFit`'s formula without its ``efficiency``), in (0, 1]."""
    return _shape_factor(fit.k0, fit.tiles, sms, float(groups), float(m), float(n), float(k))


@lru_cache(maxsize=65536)  # a plan's GEMMs repeat over its layers, stages and microbatches
def _shape_factor(k0: float, tiles: tuple, sms: int, groups: float, m: float, n: float, k: float) -> float:
    if m <= 0 or n <= 0 or k <= 0 or groups <= 0:
        return 1.0  # no work: nothing to time
    best = 0.0
    for tm, tn in tiles:
        count = groups * ceil(m / tm) * ceil(n / tn)
        fill = groups * m * n / (ceil(count / sms) * sms * tm * tn)
        best = max(best, fill * k / (k + k0 * (128 * 128) / (tm * tn)))
    return best


def fitted(measured: float, at: tuple[float, float, float], k0: float, tiles: tuple[tuple[int, int], ...],
           sms: int, source: str) -> GemmFit:
    """A :class:`GemmFit` whose formula gives ``measured`` (a share of the peak) at the shape
    it was measured at, ``at`` = (m, n, k): the efficiency is that measurement over the shape's
    factor, so the measurement stays the one owner of the figure."""
    return GemmFit(measured / gemm_shape_factor(GemmFit(1.0, k0, tiles), sms, 1, *at), k0, tiles, source)


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
    # how a GEMM's shape sets its share of the peak, at 16 bits and at FP8 (:class:`GemmFit`);
    # None: every GEMM at ``matmul_efficiency`` (``simulation.gemm_efficiency: flat``)
    gemm_bf16: GemmFit | None = None
    gemm_fp8: GemmFit | None = None  # per-tensor scaling's cuBLASLt kernels (tensorwise, delayed, mxfp8)
    gemm_fp8_blockwise: GemmFit | None = None  # 1x128 and 128x128 scaling's (DeepGEMM's; fp8_recipe: blockwise)

    def gemm_fit(self, precision: str) -> GemmFit | None:
        """The :class:`GemmFit` of a GEMM run at ``precision`` ('bf16', 'fp16' or 'fp8')."""
        return self.gemm_fp8 if precision == "fp8" else self.gemm_bf16

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
         sms=0, attn=None, gemm=(None, None, None)):
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
        gemm_bf16=gemm[0],
        gemm_fp8=gemm[1],
        gemm_fp8_blockwise=gemm[2],
    )


# nccl-tests on 8x H100 with NVLS: all-reduce busbw 478.9 GB/s at 8 GB (as published by NVIDIA).
# busbw = S/t * 2(n-1)/n and t = S / (eff * line rate), so eff = 478.9 / (7/4) / 450 = 0.608.
NVLS_EFFICIENCY_H100 = 478.9 / (2 * 7 / 8) / 450

# flash attention, head dimension 128, 16K tokens (module docstring): FlashAttention-2 on A100
# (forward with the causal mask, backward without: Dao 2023, Fig. 5d, 6b), FlashAttention-3 on
# H100 (Shah et al. 2024, Fig. 5d, 6b)
ATTENTION_EFFICIENCY_A100 = (200 / 312, 196 / 312)
ATTENTION_EFFICIENCY_H100 = (616 / 989, 561 / 989)


# GEMM shapes (GemmFit): the tiles the libraries' kernel names show (cuBLAS on Ampere:
# ampere_*gemm_{256x128,128x256,128x128,128x64,64x64}; on Hopper sm90_xmma_gemm_*_tilesize
# {128x128,256x128}, nvjet 128x256; CUTLASS's and DeepGEMM's 128 x 64..256), and the fixed cost
# of a tile, k0, least-squares fitted to published tables of GEMMs by shape:
#   A100, 16 bits: 725, from EleutherAI's cookbook (Anthony et al. 2024,
#     sizing/results/{transformer_data,gemm_data}: fp16, the slowest of 200 runs) on the 18 rows
#     whose output is at least 2048 x 2048 or 192 wide: rms 4.9 %, worst 11 %
#   Hopper, 16 bits: 375, from XLA's H100 (sm_90) bf16 perf table (matmul_interpolator_data.h:
#     m, n, k of 256-4096, batch 1-4) on the 55 rows whose output is at least 2048 x 2048: rms
#     3.7 %, worst 9 %, with a fixed 5 us a call fitted beside it (not applied: no kernel's
#     launch is modelled)
#   Hopper, FP8 with blockwise scaling: 1425, with the efficiency, from DeepGEMM's README
#     (H800, its first release: the 6 dense rows of m 4096 and the 4 grouped contiguous ones):
#     rms 1.6 %, worst 3 %
#   Hopper, FP8 with per-tensor scaling (cuBLASLt): no published table by shape; twice the
#     16-bit k0 (a tile's fixed time the same, its loop twice as fast an element), at the
#     level of Stas Bekman's ml-engineering MAMF table (H100 SXM, torch._scaled_mm: 1402.6 of
#     1979 TFLOP/s at 1024 x 9216 x 14336)
# The 16-bit level stays the large-GEMM measurement each GPU already had (module docstring),
# now at the shape it was taken at (8192 cubed)
AMPERE_TILES = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 64))
HOPPER_TILES = ((128, 128), (128, 256), (256, 128), (128, 64), (64, 128))
K0_AMPERE_16, K0_HOPPER_16, K0_HOPPER_FP8_BLOCKWISE = 725.0, 375.0, 1425.0
K0_HOPPER_FP8 = 2 * K0_HOPPER_16
LARGE_GEMM = (8192.0, 8192.0, 8192.0)
# DeepGEMM on H800, (m, n, k) = (4096, 7168, 16384): 1358 of 1979 TFLOP/s
DEEPGEMM_FP8 = (1358 / 1979, (4096.0, 7168.0, 16384.0))
# the maximum achievable FP8 matmul on H100 SXM (MAMF), (m, n, k) = (1024, 9216, 14336)
MAMF_FP8 = (1402.6 / 1979, (1024.0, 9216.0, 14336.0))


def _ampere(mm_eff: float) -> GemmFit:
    return fitted(mm_eff, LARGE_GEMM, K0_AMPERE_16, AMPERE_TILES, 108, "A100 cuBLASLt 8K-16K; k0: EleutherAI cookbook")


def _hopper(mm_eff: float, sms: int = 132) -> tuple[GemmFit, GemmFit, GemmFit]:
    """Hopper's fits, 16-bit, FP8 per-tensor and FP8 blockwise, fixed on ``sms`` SMs (the
    H100's, which B200 borrows)."""
    return (fitted(mm_eff, LARGE_GEMM, K0_HOPPER_16, HOPPER_TILES, sms, "H100 large GEMMs; k0: XLA sm_90 perf table"),
            fitted(*MAMF_FP8, K0_HOPPER_FP8, HOPPER_TILES, sms, "H100 MAMF (ml-engineering); k0: twice the 16-bit"),
            fitted(*DEEPGEMM_FP8, K0_HOPPER_FP8_BLOCKWISE, HOPPER_TILES, sms, "DeepGEMM on H800 (first release)"))


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        _gpu("A100-SXM4-40GB", 312, None, 1555, 40, 300, 0.82, 0.82,
             "memory efficiency borrowed from A100-80GB", tdp_W=400, sms=108, attn=ATTENTION_EFFICIENCY_A100,
             gemm=(_ampere(0.82), None, None)),
        _gpu("A100-SXM4-80GB", 312, None, 2039, 80, 300, 0.82, 0.82, tdp_W=400, sms=108,
             attn=ATTENTION_EFFICIENCY_A100, gemm=(_ampere(0.82), None, None)),
        _gpu("H100-SXM5-80GB", 989, 1979, 3350, 80, 450, 0.76, 0.91, nvls=NVLS_EFFICIENCY_H100, tdp_W=700, sms=132,
             attn=ATTENTION_EFFICIENCY_H100, gemm=_hopper(0.76)),
        _gpu("H800-SXM-80GB", 989, 1979, 3350, 80, 200, 0.76, 0.91,
             "same die as H100; efficiencies borrowed from H100", nvls=NVLS_EFFICIENCY_H100, tdp_W=700, sms=132,
             attn=ATTENTION_EFFICIENCY_H100, gemm=_hopper(0.76)),
        _gpu("H200-SXM-141GB", 989, 1979, 4800, 141, 450, 0.76, 0.89,
             "matmul, attention and NVLS efficiency borrowed from H100", nvls=NVLS_EFFICIENCY_H100, tdp_W=700,
             sms=132, attn=ATTENTION_EFFICIENCY_H100, gemm=_hopper(0.76)),
        _gpu("B200", 2250, 4500, 8000, 180, 900, 0.76, 0.89,
             "no published measurement yet; efficiencies borrowed from H200", nvls=NVLS_EFFICIENCY_H100,
             tdp_W=1000, sms=148, attn=ATTENTION_EFFICIENCY_H100, gemm=_hopper(0.76)),
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
