"""A GEMM's efficiency by its shape (hardware/gpus.py GemmFit, program/costs.py
gemm_efficiency): the formula's properties, the fits against the published tables they were
fitted to, the level each GPU's large-GEMM measurement keeps, and how ops carry their GEMMs
(forward, backward halves, grouped experts, standard attention, TP overlap's pieces)."""

from __future__ import annotations

import math

import pytest

import clustersim
from clustersim.hardware.gpus import GPUS, GemmFit, gemm_shape_factor, lookup_gpu
from clustersim.model.transformer import _backward, matmul_op
from clustersim.program.costs import gemm_efficiency, op_time_s


H100, A100 = lookup_gpu("H100"), lookup_gpu("A100")


def share(gpu, precision: str, g: float, m: float, n: float, k: float, sms: int | None = None) -> float:
    """The share of the peak one (g, m, n, k) GEMM reaches."""
    fit = gpu.gemm_fit(precision)
    return fit.efficiency * gemm_shape_factor(fit, sms or gpu.sms, g, m, n, k)


def predicted_tflops(gpu, precision: str, g, m, n, k, bytes_per_elem: int, fixed_s: float = 0.0) -> float:
    """What the fit gives a GEMM benchmark, as the roofline times it (operands at
    ``bytes_per_elem``, a 16-bit output), plus a fixed time a call."""
    flops = 2 * g * m * n * k
    compute_s = flops / (gpu.peak_flops(precision) * share(gpu, precision, g, m, n, k))
    memory_s = g * ((m * k + k * n) * bytes_per_elem + 2 * m * n) / (gpu.hbm_bw_Bps * gpu.memory_efficiency)
    return flops / (max(compute_s, memory_s) + fixed_s) / 1e12


# --- the formula ---------------------------------------------------------------------------------

def test_a_long_reduction_over_full_waves_reaches_the_fits_efficiency():
    """fill * k / (k + k0'): a 128 x 128 tile on every SM, 4 waves, k of a million: the factor
    is k / (k + k0) to the ulp."""
    fit = GemmFit(0.8, 400.0, ((128, 128),))
    m = n = 128 * 132 * 4
    assert gemm_shape_factor(fit, 132, 1, 128, n, 1e6) == pytest.approx(1e6 / (1e6 + 400), rel=1e-12)
    assert gemm_shape_factor(fit, 132, 1, m, 128, 1e6) == pytest.approx(1e6 / (1e6 + 400), rel=1e-12)


def test_the_last_waves_fill_and_a_bigger_tiles_smaller_fixed_cost():
    """133 tiles on 132 SMs run two waves, the second holding one tile: fill 133 / 264. With a
    second, larger tile the library takes whichever finishes first, its fixed cost k0 scaled
    by 128 x 128 over its area."""
    one = GemmFit(1.0, 0.0, ((128, 128),))
    assert gemm_shape_factor(one, 132, 1, 128 * 133, 128, 4096) == pytest.approx(133 / 264, rel=1e-12)
    two = GemmFit(1.0, 400.0, ((128, 128), (256, 128)))
    k = 1024
    full = gemm_shape_factor(two, 132, 1, 256 * 132, 128, k)  # the 256-row tile fills one wave exactly
    assert full == pytest.approx(k / (k + 200), rel=1e-12)
    # grouped: every group's rows are tiled apart (a group of 129 rows takes two 128-row tiles):
    # 66 groups, 132 tiles, one wave, each group's second tile nearly empty
    assert gemm_shape_factor(one, 132, 66, 129, 128, 1e9) == pytest.approx(66 * 129 / (132 * 128), rel=1e-12)


@pytest.mark.parametrize("gpu", [H100, A100])
def test_shorter_reductions_and_narrower_outputs_reach_less(gpu):
    """Monotone where the waves fill: halving k, or the output, never raises the share; no
    shape passes the fit's efficiency."""
    fit = gpu.gemm_bf16
    ks = [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    shares = [share(gpu, "bf16", 1, 8192, 8192, k) for k in ks]
    assert all(a < b for a, b in zip(shares, shares[1:]))
    assert all(0 < s_ <= fit.efficiency for s_ in shares)
    for m in (64, 128, 512, 2048, 16384, 65536):
        for n in (64, 256, 1024, 8192):
            assert 0 < share(gpu, "bf16", 1, m, n, 4096) <= fit.efficiency


def test_each_gpus_large_gemm_measurement_keeps_its_shape():
    """The level of a 16-bit fit is the GPU's large-GEMM measurement (matmul_efficiency, 8192
    cubed); FP8's with per-tensor scaling the H100's maximum achievable FP8 matmul (1,402.6 of
    1,979 TFLOP/s at 1024 x 9216 x 14336), with blockwise scaling DeepGEMM's (4096, 7168,
    16384) row, 1,358. The H800, H200 and B200 borrow H100's fits, fixed on 132 SMs: B200's
    148 fill the waves of the same GEMMs otherwise."""
    from dataclasses import replace

    for gpu in GPUS.values():
        on = 132 if gpu.sms == 148 else None  # (B200's fits are H100's)
        assert share(gpu, "bf16", 1, 8192, 8192, 8192, sms=on) == pytest.approx(gpu.matmul_efficiency, rel=1e-12)
    for name in ("H100-SXM5-80GB", "H800-SXM-80GB", "H200-SXM-141GB", "B200"):
        gpu = GPUS[name]
        assert share(gpu, "fp8", 1, 1024, 9216, 14336, sms=132) == pytest.approx(1402.6 / 1979, rel=1e-12)
        blockwise = replace(gpu, gemm_fp8=gpu.gemm_fp8_blockwise)
        assert share(blockwise, "fp8", 1, 4096, 7168, 16384, sms=132) == pytest.approx(1358 / 1979, rel=1e-12)
        assert (gpu.gemm_bf16, gpu.gemm_fp8, gpu.gemm_fp8_blockwise) == (
            H100.gemm_bf16, H100.gemm_fp8, H100.gemm_fp8_blockwise)
    assert H100.gemm_fp8.k0 == 2 * H100.gemm_bf16.k0
    assert A100.gemm_fp8 is None and A100.gemm_fp8_blockwise is None


# --- the fits against the tables they were fitted to ---------------------------------------------

# DeepGEMM's first README, H800, FP8 (1x128 and 128x128 scaling): the dense rows of m 4096,
# then the grouped contiguous ones, (groups, m a group, n, k, TFLOP/s)
DEEPGEMM = [(1, 4096, 2112, 7168, 1058), (1, 4096, 24576, 1536, 990), (1, 4096, 32768, 512, 590),
            (1, 4096, 7168, 16384, 1358), (1, 4096, 4096, 7168, 1304), (1, 4096, 7168, 2048, 1025),
            (4, 8192, 4096, 7168, 1297), (4, 8192, 7168, 2048, 1099), (8, 4096, 4096, 7168, 1288),
            (8, 4096, 7168, 2048, 1093)]
# XLA's H100 (sm_90) bf16 table, matmul_interpolator_data.h: (batch, m, n) -> TFLOP/s at
# k = 256, 512, 1024, 2048, 4096; the rows whose output is at least 2048 x 2048
XLA_KS = (256, 512, 1024, 2048, 4096)
XLA = {(1, 4096, 4096): (392.16, 543.12, 677.44, 738.74, 783.33),
       (1, 4096, 2048): (304.00, 447.02, 593.23, 716.07, 758.43),
       (1, 2048, 4096): (299.26, 450.40, 594.21, 715.35, 753.64),
       (1, 4096, 1024): (216.48, 343.71, 488.06, 631.98, 738.47),
       (1, 1024, 4096): (209.72, 338.93, 490.29, 634.22, 738.47),
       (1, 2048, 2048): (213.04, 345.48, 493.90, 631.98, 737.97),
       (2, 4096, 4096): (464.02, 607.67, 692.97, 763.01, 807.67),
       (4, 4096, 4096): (503.87, 619.86, 725.51, 764.58, 793.13),
       (2, 2048, 2048): (299.59, 447.02, 600.19, 717.74, 756.70),
       (4, 2048, 2048): (394.76, 542.29, 674.04, 725.75, 779.14),
       (4, 1024, 1024): (214.75, 337.65, 489.85, 626.09, 735.94)}
XLA_FIXED_S = 5e-6  # the fixed time a call took in that table, fitted beside k0
# EleutherAI's cookbook (Anthony et al. 2024, sizing/results), A100, fp16: (m, n, k, TFLOP/s)
COOKBOOK = [(8192, 6144, 8192, 228.5), (8192, 8192, 2048, 216.6), (8192, 8192, 8192, 254.0),
            (8192, 8192, 8192, 257.5), (8192, 12288, 16384, 255.0), (8192, 16384, 4096, 235.9),
            (8192, 16384, 16384, 252.9), (2048, 2048, 4096, 193.2), (4096, 4096, 4096, 239.1),
            (8192, 8192, 4096, 251.5), (2048, 2048, 2048, 167.6), (4096, 4096, 4096, 249.1),
            (8192, 8192, 8192, 267.7), (27648, 192, 4096, 176.7), (27648, 256, 4096, 227.2),
            (27648, 320, 4096, 206.7), (27648, 384, 4096, 242.6), (27648, 448, 4096, 220.8)]


def rms(errors: list[float]) -> float:
    return math.sqrt(sum(e * e for e in errors) / len(errors))


def test_the_blockwise_fp8_fit_gives_deepgemms_table():
    """Within 4 % on every row (rms 1.6 %), one efficiency and one k0 for k from 512 to 16,384
    and outputs from 4096 x 2112 to 8 groups of 4096 x 7168."""
    from dataclasses import replace

    gpu = replace(H100, gemm_fp8=H100.gemm_fp8_blockwise)
    errors = [predicted_tflops(gpu, "fp8", g, m, n, k, 1) / t - 1 for g, m, n, k, t in DEEPGEMM]
    assert max(map(abs, errors)) < 0.04 and rms(errors) < 0.02


def test_the_hopper_16_bit_fit_gives_xlas_table():
    """XLA's H100 table at its own level (the fit's shape, an efficiency of 0.885 a long
    reduction over full waves reaches in it) with its 5 µs a call: rms under 4 %, every row
    within 10 %, k from 256 to 4,096."""
    fit = GemmFit(0.885, H100.gemm_bf16.k0, H100.gemm_bf16.tiles)
    from dataclasses import replace

    gpu = replace(H100, gemm_bf16=fit)
    errors = [predicted_tflops(gpu, "bf16", g, m, n, k, 2, XLA_FIXED_S) / t - 1
              for (g, m, n), row in XLA.items() for k, t in zip(XLA_KS, row)]
    assert max(map(abs, errors)) < 0.10 and rms(errors) < 0.04


def test_the_ampere_fit_gives_the_cookbooks_table():
    """EleutherAI's A100 GEMMs at the fit's shape and an efficiency of 0.85 (the cookbook's
    level: the slowest of 200 runs): rms under 5 %, every row within 12 %."""
    from dataclasses import replace

    gpu = replace(A100, gemm_bf16=GemmFit(0.85, A100.gemm_bf16.k0, A100.gemm_bf16.tiles))
    errors = [predicted_tflops(gpu, "bf16", 1, m, n, k, 2) / t - 1 for m, n, k, t in COOKBOOK]
    assert max(map(abs, errors)) < 0.12 and rms(errors) < 0.05


# --- ops and their GEMMs -----------------------------------------------------------------------

def test_an_ops_efficiency_weighs_its_gemms_by_their_flops():
    """A backward holds the input gradient's GEMM and the weight gradient's, equal FLOPs: its
    efficiency is their harmonic mean, so its compute time is the sum of theirs."""
    fwd = matmul_op("proj", 8192, 768, 6144)  # TP8's out projection of the 22B model: k = 768
    bwd = _backward(fwd)
    assert bwd.gemms == ((1, 8192, 768, 6144), (1, 768, 6144, 8192))
    d, w = (share(A100, "bf16", *g) for g in bwd.gemms)
    assert gemm_efficiency(bwd, A100, "bf16") == pytest.approx(2 / (1 / d + 1 / w), rel=1e-12)
    assert d > share(A100, "bf16", *fwd.gemms[0])  # the input gradient reduces over 6144, the forward over 768
    assert gemm_efficiency(fwd, A100, "bf16") < 0.7 * A100.matmul_efficiency


def test_the_split_backwards_halves_take_their_own_gemms():
    """ZB-H1's B and W: the input gradient's GEMM and the weight gradient's, their compute
    adding up to the whole backward's."""
    from clustersim.program.work import split_backward_ops

    bwd = _backward(matmul_op("qkv", 8192, 6144, 2304))
    (b,), (w,) = split_backward_ops([bwd])
    assert b.gemms == bwd.gemms[:1] and w.gemms == bwd.gemms[1:]
    assert op_time_s(b, A100, "bf16") + op_time_s(w, A100, "bf16") == pytest.approx(op_time_s(bwd, A100, "bf16"),
                                                                                   rel=1e-12)


def test_grouped_experts_with_few_tokens_each_reach_less():
    """The routed experts' grouped GEMM: a rank's pairs over its local experts, each its own
    rows and weights. 24,576 pairs over 16 experts reach more of the peak than over 256 (96
    rows each: every tile of 128 rows a quarter empty), and the GEMM reads every local
    expert's weights."""
    from clustersim.model.moe import MoeCfg, routed_experts_fwd

    moe = MoeCfg(experts=256, top_k=8, expert_ffn=2048)
    few, many = (routed_experts_fwd(moe, 3072, 7168, 1, local_experts=e)[0] for e in (16, 256))
    assert few.flops == many.flops and few.gemms == ((16, 1536.0, 4096, 7168),)
    assert gemm_efficiency(many, H100, "bf16") < gemm_efficiency(few, H100, "bf16")
    assert many.bytes - few.bytes == pytest.approx(2 * (256 - 16) * 7168 * 4096, rel=1e-12)


def test_standard_attentions_scores_reduce_over_a_heads_width():
    """Standard attention's batched GEMMs: QK^T reduced over d = 128, PV over the keys; flash
    attention's kernel keeps its own published figure."""
    from clustersim.model.transformer import DenseModelCfg, attn_block_fwd

    m = DenseModelCfg(layers=2, hidden=6144, heads=48, ffn_hidden=24576, vocab=51200, seq_len=2048)
    std = next(op for op in attn_block_fwd(m, 4, 8, False) if op.name == "core_attn")
    assert std.gemms == ((24, 2048, 2048, 128), (24, 2048, 128, 2048))
    assert sum(2 * g * mm * n * k for g, mm, n, k in std.gemms) == pytest.approx(std.flops, rel=1e-12)
    assert gemm_efficiency(std, A100, "bf16") < 0.5 * A100.matmul_efficiency
    flash = next(op for op in attn_block_fwd(m, 4, 8, True) if op.name == "core_attn")
    assert flash.gemms == () and op_time_s(flash, A100, "bf16") == pytest.approx(
        max(flash.flops / (A100.bf16_flops * A100.attention_efficiency[0]),
            flash.bytes / (A100.hbm_bw_Bps * A100.memory_efficiency)), rel=1e-12)


def test_every_gemms_flops_are_its_ops():
    """The shapes an op carries set its efficiency, never its FLOPs: every GEMM op's GEMMs add
    up to its executed FLOPs, forward and backward, MLA's projections, standard attention,
    the experts, and the pieces the lowering cuts (a split backward's halves, TP overlap's
    chunks of rows)."""
    from clustersim.model.moe import MoeCfg, routed_experts_fwd, shared_experts_fwd
    from clustersim.model.transformer import DenseModelCfg, attn_block_fwd, mlp_block_fwd
    from clustersim.program.work import _half, _rows

    def total(op):
        return sum(2 * g * m * n * k for g, m, n, k in op.gemms)

    mla = DenseModelCfg(layers=2, hidden=1024, heads=8, ffn_hidden=4096, vocab=1000, seq_len=2048, bias=False,
                        mla={"q_lora_rank": 384, "kv_lora_rank": 128, "qk_head_dim": 96, "qk_rope_head_dim": 32,
                             "v_head_dim": 128})
    dense = DenseModelCfg(layers=2, hidden=1024, heads=8, kv_heads=2, ffn_hidden=2816, mlp="swiglu", vocab=1000,
                          seq_len=2048)
    moe = MoeCfg(experts=16, top_k=2, expert_ffn=512, shared_experts=1, capacity_factor=1.25, pad_to_capacity=True)
    ops = [*attn_block_fwd(mla, 2, 2, False, True), *attn_block_fwd(dense, 2, 2, False), *mlp_block_fwd(dense, 2, 2),
           *routed_experts_fwd(moe, 4096, 1024, 2, local_experts=4), *shared_experts_fwd(moe, 4096, 1024, 2)]
    gemm_ops = [op for op in ops if op.gemms]
    assert len(gemm_ops) >= 10
    for op in gemm_ops:
        b = _backward(op)
        for piece in (op, b, _rows(op, 1 / 4), _rows(_half(b, False), 1 / 8) if op.name != "core_attn" else b):
            assert total(piece) == pytest.approx(piece.flops, rel=1e-12), op.name
        if op.name != "core_attn":  # a weight GEMM's backward: its halves, B and W
            assert total(_half(b, False)) + total(_half(b, True)) == pytest.approx(b.flops, rel=1e-12), op.name
    assert not any(op.flops and not op.gemms for op in ops if op.name != "core_attn")


def test_flat_times_every_gemm_at_the_matmul_efficiency(root):
    """``simulation.gemm_efficiency: flat``: the GPU as its ops are timed has no fits, and the
    22B model's step is what every GEMM at 0.82 of the A100's peak gives; by shape it is
    longer (its TP8 out projection and standard attention's scores reach less)."""
    from clustersim.overrides import load_variant
    from clustersim.program.lower import chunk_gpu

    path = root / "scenarios/korthikanti_22b_full.yaml"
    flat = load_variant(path, [("simulation.gemm_efficiency", "flat")])
    assert chunk_gpu(flat).gemm_bf16 is None and chunk_gpu(clustersim.load_scenario(path)).gemm_bf16 is not None
    by_shape = clustersim.simulate(path, brief=True).summary
    at_one = clustersim.simulate(flat, brief=True).summary
    assert at_one["model_flops_per_step"] == by_shape["model_flops_per_step"]
    assert by_shape["step_time_s"] > 1.05 * at_one["step_time_s"]
    assert by_shape["plan"] == at_one["plan"]


def test_a_chunk_on_fewer_sms_runs_its_waves_over_them():
    """DeepEP's SMs inside DualPipe's chunks: the peak scales by the share, and the GEMM's waves
    run over the SMs left (112 of 132), so a GEMM that filled 132 SMs fills 112 differently."""
    op = matmul_op("experts_up", 128 * 12, 7168, 128 * 11)  # 132 tiles of 128 x 128: one full wave on 132 SMs
    sm_share, fit = 112 / 132, H100.gemm_bf16
    whole, part = gemm_efficiency(op, H100, "bf16"), gemm_efficiency(op, H100, "bf16", sm_share)
    assert whole == pytest.approx(fit.efficiency * 7168 / (7168 + fit.k0), rel=1e-12)
    assert part == pytest.approx(fit.efficiency * gemm_shape_factor(fit, 112, 1, 128 * 12, 128 * 11, 7168), rel=1e-12)
    assert part < 0.8 * whole  # 132 tiles over 112 SMs: two waves, or smaller tiles that pay more
    assert op_time_s(op, H100, "bf16", sm_share) == pytest.approx(
        op.flops / (H100.bf16_flops * sm_share * part), rel=1e-12)


def test_the_fp8_recipe_picks_its_kernels_fit(root):
    """Blockwise scaling (DeepSeek-V3's, DeepGEMM's kernels) times FP8 GEMMs by DeepGEMM's fit,
    per-tensor scaling (cuBLASLt) by its own; ``flat`` by neither."""
    from clustersim.overrides import load_variant
    from clustersim.program.lower import chunk_gpu

    path = root / "scenarios/deepseek_v3_2048gpu.yaml"
    assert chunk_gpu(clustersim.load_scenario(path)).gemm_fp8 == H100.gemm_fp8_blockwise
    assert chunk_gpu(load_variant(path, [("training.fp8_recipe", "tensorwise")])).gemm_fp8 == H100.gemm_fp8
    assert chunk_gpu(load_variant(path, [("simulation.gemm_efficiency", "flat")])).gemm_fp8 is None
