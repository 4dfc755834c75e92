"""Against published measurements (the papers cited at each table below), before calibration.

Each band is an accuracy bound either way of the published figure (within a factor of 1.2 of
it, say), not the model's present bias: clustersim is optimistic on every row today (one GEMM
efficiency for every shape, no framework overhead: docs/metrics.md), and a model nearer the
published figures, or past them by as much, passes. The docs' tables, which the tests below
hold to the live simulation, give each row's ratio. Nothing here is tuned to these rows:
efficiencies come from GEMM/STREAM/nccl-tests figures.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

import clustersim

ROOT = Path(__file__).resolve().parent.parent
GiB = 1024**3


def within(ratio: float, factor: float) -> bool:
    """Whether ``ratio`` (published over simulated, or the other way) is within ``factor`` of 1
    either way."""
    return 1 / factor < ratio < factor


@pytest.mark.parametrize("variant,published_s", [("full", 1.42), ("seqsel", 1.10)])
def test_korthikanti_22b_step_time(variant, published_s):
    # Korthikanti et al. 2022, Table 5: 22B, 8x A100, TP8, mbs 4
    s = clustersim.simulate(ROOT / f"scenarios/korthikanti_22b_{variant}.yaml").summary
    assert s["step_time_s"] == pytest.approx(published_s, rel=0.2)


def test_korthikanti_22b_recompute_costs_more_than_sp_selective():
    full = clustersim.simulate(ROOT / "scenarios/korthikanti_22b_full.yaml").summary
    sel = clustersim.simulate(ROOT / "scenarios/korthikanti_22b_seqsel.yaml").summary
    # published ratio 1.42 / 1.10 = 1.29
    assert full["step_time_s"] / sel["step_time_s"] == pytest.approx(1.42 / 1.10, rel=0.1)


def test_korthikanti_22b_model_state_memory():
    # measured params + grads + optimizer: 45.56 GiB per GPU
    st = clustersim.simulate(ROOT / "scenarios/korthikanti_22b_full.yaml").summary["memory"]["stages"][0]
    assert (st["params_bytes"] + st["grads_bytes"] + st["optimizer_bytes"]) / GiB == pytest.approx(45.56, rel=0.05)


# Korthikanti et al. 2022 (arXiv:2205.05198), Tables 3 and 5: model, heads, hidden, layers, pp, GPUs (= global batch, micro batch 1),
# vpp, published step (s) with full recompute and TP alone, and with SP + selective recompute.
# The 22B row is scenarios/korthikanti_22b_*.yaml (micro batch 4, one step of 4 sequences).
KORTHIKANTI_TABLE5 = [
    ("175B", 96, 12288, 96, 8, 64, 3, 18.13, 13.75),
    ("530B", 128, 20480, 105, 35, 280, 3, 49.05, 37.83),
    ("1T", 160, 25600, 128, 64, 512, 1, 94.42, 71.49),
]


@functools.lru_cache(maxsize=None)
def korthikanti_step(row: str, variant: str) -> float:
    """The simulated step of Table 5's ``row`` ("22B", "175B", ...) with ``variant`` "full"
    (full recompute, TP without SP) or "seqsel" (SP and selective recompute), as the paper ran
    it: standard attention (2022), TP 8, DP 1, interleaved where vpp > 1."""
    if row == "22B":
        return clustersim.simulate(ROOT / f"scenarios/korthikanti_22b_{variant}.yaml", brief=True).summary["step_time_s"]
    _, a, h, l, pp, gpus, vpp, _, _ = next(r for r in KORTHIKANTI_TABLE5 if r[0] == row)
    d = {"name": f"korthikanti-{row}-{variant}", "cluster": {"topology": "topologies/dgx-a100.yaml", "nodes": gpus // 8},
         "model": {"name": row, "layers": l, "hidden": h, "heads": a, "mlp": "gelu", "vocab": 51200, "seq_len": 2048},
         "parallel": {"tp": 8, "pp": pp, "dp": 1, "sp": variant == "seqsel",
                      **({"schedule": "interleaved", "vpp": vpp} if vpp > 1 else {"schedule": "1f1b"})},
         "training": {"micro_batch_size": 1, "global_batch_size": gpus, "attention": "standard",
                      "recompute": "full" if variant == "full" else "selective"}}
    s = clustersim.simulate(clustersim.load_scenario(d, base_dir=ROOT), brief=True).summary
    assert s["memory"]["fits"]
    return s["step_time_s"]


KORTHIKANTI_STEPS = [("22B", 1.42, 1.10)] + [(r[0], r[7], r[8]) for r in KORTHIKANTI_TABLE5]


@pytest.mark.parametrize("row, full_s, seqsel_s", KORTHIKANTI_STEPS)
def test_korthikanti_table5_step_times(row, full_s, seqsel_s):
    """Every row of Table 5, 22B on 8 A100s to 1T on 512, with full recompute and with SP +
    selective recompute: simulated 4-12 % faster than published (the rows with full recompute
    closer), and SP + selective recompute saving about what it saved them."""
    full, seqsel = korthikanti_step(row, "full"), korthikanti_step(row, "seqsel")
    assert within(full_s / full, 1.2) and within(seqsel_s / seqsel, 1.25)
    assert full / seqsel == pytest.approx(full_s / seqsel_s, rel=0.06)


def test_korthikanti_table5_in_the_docs():
    """docs/metrics.md's table of the rows is the simulation's."""
    text = " ".join((ROOT / "docs/metrics.md").read_text().split())
    for row, full_s, seqsel_s in KORTHIKANTI_STEPS:
        full, seqsel = korthikanti_step(row, "full"), korthikanti_step(row, "seqsel")
        assert (f"| {row} | {full_s:.2f} | {full:.2f} | {full_s / full:.2f} | {seqsel_s:.2f} | {seqsel:.2f} | "
                f"{seqsel_s / seqsel:.2f} |") in text, row


# Korthikanti et al. 2022, Table 4: one layer of the 22B model (TP 8, micro batch 4), forward
# and backward (ms), per variant: the recompute settings and SP
KORTHIKANTI_LAYER_MS = {
    "no recompute": ([("training.recompute", "none")], 7.7, 11.9),
    "sequence parallel": ([("training.recompute", "none"), ("parallel.sp", True)], 7.2, 11.8),
    "full recompute": ([], 7.7, 19.5),
    "selective recompute": ([("training.recompute", "selective")], 7.7, 13.2),
    "selective + sequence parallel": ([("training.recompute", "selective"), ("parallel.sp", True)], 7.2, 13.1),
}


@functools.lru_cache(maxsize=None)
def korthikanti_layer_ms(variant: str) -> tuple[float, float]:
    """(forward, backward) of one middle layer of the 22B model in ``variant``, in ms: from its
    first span to its last on the simulated rank, compute and TP communication, the mean over
    layers 5-39."""
    from clustersim.overrides import load_variant

    changes = KORTHIKANTI_LAYER_MS[variant][0]
    tr = clustersim.simulate(load_variant(ROOT / "scenarios/korthikanti_22b_full.yaml", changes), brief=True).trace
    rank = tr.ranks[0]
    out = []
    for phase in ("F", "B"):
        ends: dict[int, tuple[float, float]] = {}
        for sp in tr.spans:
            if sp.rank == rank and sp.phase == phase and sp.layer is not None and 5 <= sp.layer < 40:
                lo, hi = ends.get(sp.layer, (float("inf"), 0.0))
                ends[sp.layer] = (min(lo, sp.start_s), max(hi, sp.end_s))
        out.append(1e3 * sum(hi - lo for lo, hi in ends.values()) / len(ends))
    return out[0], out[1]


@pytest.mark.parametrize("variant", list(KORTHIKANTI_LAYER_MS))
def test_korthikanti_22b_layer_times(variant):
    """Table 4's layer of the 22B model, five variants: each forward and backward 4-8 %
    faster than published (within a factor of 1.2), so what a variant adds or saves is near
    the paper's (full recompute adds 7.4 ms to the backward against its 7.6; SP saves 0.5 ms
    of the forward)."""
    _, fwd_ms, bwd_ms = KORTHIKANTI_LAYER_MS[variant]
    f, b = korthikanti_layer_ms(variant)
    assert within(fwd_ms / f, 1.2) and within(bwd_ms / b, 1.2)
    base_f, base_b = korthikanti_layer_ms("no recompute")
    assert b - base_b == pytest.approx(bwd_ms - 11.9, abs=1.0) and f - base_f == pytest.approx(fwd_ms - 7.7, abs=0.2)


def test_korthikanti_22b_layer_times_in_the_docs():
    text = " ".join((ROOT / "docs/metrics.md").read_text().split())
    for variant, (_, fwd_ms, bwd_ms) in KORTHIKANTI_LAYER_MS.items():
        f, b = korthikanti_layer_ms(variant)
        assert f"| {variant} | {fwd_ms:.1f} | {f:.1f} | {bwd_ms:.1f} | {b:.1f} |" in text, variant


DEEPSEEK_V3_TOKENS_PER_GPU_S = 1e12 / (180e3 * 3600)  # the report's 180K H800 GPU-hours per trillion tokens


@functools.lru_cache(maxsize=None)
def deepseek_v3() -> dict:
    return clustersim.simulate(ROOT / "scenarios/deepseek_v3_2048gpu.yaml").summary


def test_deepseek_v3_pretraining_throughput():
    """DeepSeek-V3's run (report Sec 3.1-3.2): 180K H800 GPU-hours per trillion tokens, about
    1,543 tokens/s per GPU. With DeepEP's SMs taken inside DualPipe's chunks but without the
    pipeline sends' SMs and FP8's overheads (the scenario's comment), clustersim is optimistic, by the factor the scenario's comment quotes (its memory against
    the 80 GB it fit in: tests/test_fp8_activations.py).
    Its model has the report's 671B parameters, 37B a token (tests/test_mla.py)."""
    import yaml

    path = ROOT / "scenarios/deepseek_v3_2048gpu.yaml"
    s = deepseek_v3()
    ratio = s["tokens_per_s"] / s["world_size"] / DEEPSEEK_V3_TOKENS_PER_GPU_S
    assert within(ratio, 1.6)
    d = yaml.safe_load(path.read_text())
    d["model"]["moe"].update(dispatcher="alltoall")
    nccl = clustersim.simulate(clustersim.load_scenario(d, base_dir=path.parent)).summary
    comment = " ".join(line.lstrip("# ") for line in path.read_text().splitlines() if line.startswith("#"))
    assert f"clustersim gives about {ratio:.1f}x that" in comment
    assert f"makes the step about {nccl['step_time_s'] / s['step_time_s']:.1f}x longer" in comment
    ends = max(st["peak_bytes"] for st in s["memory"]["stages"] if st["stage"] in (0, 15))
    assert s["memory"]["fits"]
    assert (f"a peak of {s['memory']['peak_bytes'] / GiB:.1f} GiB, under the 80 GB it fit in ({ends / GiB:.1f} on "
            "the two ranks holding the embedding") in comment
    text = " ".join((ROOT / "docs/parallelism.md").read_text().split())
    assert (f"It simulates {s['tokens_per_s'] / s['world_size']:,.0f} tokens/s per GPU against the "
            f"{DEEPSEEK_V3_TOKENS_PER_GPU_S:,.0f} the report's 180K GPU-hours per trillion tokens make, {ratio:.1f}x optimistic") in text
    assert (f"plan takes {nccl['step_time_s'] / s['step_time_s']:.1f}x as long, "
            f"{nccl['tokens_per_s'] / nccl['world_size']:,.0f} tokens/s per GPU") in text
    from clustersim.model.transformer import active_params, total_params

    m = clustersim.load_scenario(path).model
    plain = m.model_copy(update={"mtp_layers": 0})  # the report's count leaves the MTP module out
    assert f"Its model has {total_params(plain) / 1e9:.1f}B parameters, {active_params(plain) / 1e9:.1f}B a token" in text
    # the scenario's split gives the last part (head, MTP) one layer; split evenly, DualPipe's
    # ranks 0 and 15 (the first and last parts) are the slowest and over 80 GB
    d = yaml.safe_load(path.read_text())
    d["parallel"]["layers_per_stage"] = None
    even = clustersim.simulate(clustersim.load_scenario(d, base_dir=path.parent)).summary
    assert even["plan"]["layers_per_stage"] == [4] * 13 + [3] * 3
    waits = {x["stage"]: x["imbalance_s"] for x in even["bubble"]["per_rank"]}  # the end ranks wait least
    assert max(waits[0], waits[15]) < 1e-9 < min(w for q, w in waits.items() if q not in (0, 15))
    assert even["step_time_s"] > s["step_time_s"] and not even["memory"]["fits"]
    assert (f"makes the step {even['step_time_s']:.2f} s, {even['tokens_per_s'] / even['world_size']:,.0f} tokens/s "
            f"per GPU ({even['tokens_per_s'] / even['world_size'] / DEEPSEEK_V3_TOKENS_PER_GPU_S:.1f}x), with "
            f"{even['bubble']['imbalance_s']:.2f} s of imbalance a GPU, and those two ranks peak at "
            f"{even['memory']['peak_bytes'] / GiB:.1f} GiB") in text


# Narayanan et al. SC'21 (arXiv:2104.04473), Table 1, weak scaling on Selene (DGX A100 80GB,
# 8 HDR NICs a node): parameters (B),
# heads, hidden, layers, tp, pp, GPUs, global batch, micro batch, vpp, TFLOP/s per GPU as
# published (recompute counted, the whole attention square: 96 B s l h^2 (1 + s/6h + V/16lh))
NARAYANAN_TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 16, 1, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 16, 1, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 16, 1, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 8, 1, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 4, 1, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 1, 1, 163),
]


@functools.lru_cache(maxsize=None)
def narayanan_row(i: int, overlap_grad_reduce: bool = False, scatter_gather: bool = True) -> tuple[float, float]:
    """Row ``i`` of Table 1 as the paper ran it (full recompute, standard attention, fp16,
    1F1B or interleaved, TP's backward all-reduces blocking as the paper describes them, PP's
    sends scattered over the TP ranks and gathered by the receiver (the paper's section 4.1), the
    gradients' DP all-reduce after the pipeline's flush as Megatron-LM then made it):
    (simulated TFLOP/s per GPU by the paper's formula, the step in seconds)."""
    _, a, h, l, tp, pp, gpus, gbs, mbs, vpp, _ = NARAYANAN_TABLE1[i]
    d = {"name": f"narayanan-table1-{i}", "cluster": {"topology": "topologies/dgx-a100.yaml", "nodes": gpus // 8},
         "model": {"name": "gpt", "layers": l, "hidden": h, "heads": a, "mlp": "gelu", "vocab": 51200,
                   "seq_len": 2048, "tied_embeddings": True, "position_embedding": "learned"},
         # Megatron-LM of 2021 all-reduced the gradients after the whole schedule (its local
         # DDP's allreduce_gradients in train_step), not beside the backward
         "parallel": {"tp": tp, "pp": pp, "dp": gpus // (tp * pp), "tp_async_allreduce": False,
                      "pp_scatter_gather": scatter_gather,
                      "overlap_grad_reduce": overlap_grad_reduce,
                      **({"schedule": "interleaved", "vpp": vpp} if vpp > 1 else {"schedule": "1f1b"})},
         "training": {"micro_batch_size": mbs, "global_batch_size": gbs, "precision": "fp16",
                      "attention": "standard", "recompute": "full"}}
    s = clustersim.simulate(clustersim.load_scenario(d, base_dir=ROOT)).summary
    assert s["memory"]["fits"]
    s_, V = 2048, 51200
    flops = 96 * gbs * s_ * l * h * h * (1 + s_ / (6 * h) + V / (16 * l * h))
    tflops = flops / s["step_time_s"] / gpus / 1e12
    # what the simulation executes, less the norms, GELU, softmax and the optimizer's FLOPs
    # the formula leaves out
    assert s["hw_tflops_per_gpu"] == pytest.approx(tflops, rel=0.02)
    return tflops, s["step_time_s"]


@pytest.mark.parametrize("i", range(len(NARAYANAN_TABLE1)))
def test_narayanan_table1_weak_scaling(i):
    """Every row of Table 1, from 1.7B on 32 GPUs to 1T on 3,072, against its published TFLOP/s:
    the paper's formula over the simulated step is the simulated executed FLOPs (the summary's
    hardware TFLOP/s) and 2-14 % above the paper's (within a factor of 1.25), most of it inside
    each layer (Korthikanti et al.'s 22B above: 7-12 %; docs/metrics.md)."""
    tflops, _ = narayanan_row(i)
    assert within(tflops / NARAYANAN_TABLE1[i][-1], 1.25)


def test_narayanan_table1_in_the_docs():
    """docs/metrics.md's table of the ten rows is the simulation's."""
    text = " ".join((ROOT / "docs/metrics.md").read_text().split())
    for i, row in enumerate(NARAYANAN_TABLE1):
        tflops, step_s = narayanan_row(i)
        pub = row[-1]
        assert f"| {row[0]:g}B | {row[6]:,} | {pub} | {tflops:.0f} | {tflops / pub:.2f} |" in text, row
        assert f" | {step_s:.2f} s |" in text
    # and with the gradients reduced beside the backward, as frameworks do today
    overlapped = [narayanan_row(i, overlap_grad_reduce=True)[0] / row[-1] for i, row in enumerate(NARAYANAN_TABLE1)]
    assert f"the rows read {100 * (min(overlapped) - 1):.0f}-{100 * (max(overlapped) - 1):.0f} % above (" + ", ".join(
        f"{r:.2f}" for r in overlapped) + ")" in text
    assert all(narayanan_row(i, True)[1] <= narayanan_row(i)[1] for i in range(len(NARAYANAN_TABLE1)))
    # and with each TP rank sending the whole activation, as Megatron Core does (the rows with
    # a pipeline; the others send nothing)
    piped = [i for i, row in enumerate(NARAYANAN_TABLE1) if row[5] > 1]
    whole = {i: narayanan_row(i, scatter_gather=False) for i in piped}
    assert all(whole[i][1] >= narayanan_row(i)[1] for i in piped)
    assert ("the rows with a pipeline read " + ", ".join(f"{whole[i][0] / NARAYANAN_TABLE1[i][-1]:.2f}" for i in piped[:-1])
            + f" and {whole[piped[-1]][0] / NARAYANAN_TABLE1[piped[-1]][-1]:.2f}") in text
    assert f"the 1T model's step is {whole[piped[-1]][1]:.2f} s, not {narayanan_row(piped[-1])[1]:.2f}" in text
    gains = [whole[i][1] / narayanan_row(i)[1] - 1 for i in piped]
    assert f"here it is {100 * min(gains):.1f}-{100 * max(gains):.1f} %" in text


# NVIDIA's Megatron-Bridge performance summary, NeMo container 25.11, DGX-H100, FP8 with
# current (per-tensor) scaling, 8K tokens (docs/performance-summary.md of NVIDIA-NeMo/Megatron-Bridge;
# docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary.html):
# (model, GPUs, GBS, TP, PP, CP, VP, FSDP, published tokens/s per GPU, published model TFLOP/s per GPU)
MEGATRON_BRIDGE_H100_FP8 = [
    ("llama3-8b", 8, 128, 1, 1, 1, 1, True, 14451, 744),
    ("llama3-70b", 64, 128, 4, 8, 1, 5, False, 1602, 719),
    ("llama3.1-405b", 1024, 512, 8, 8, 2, 8, False, 292, 737),
]
LLAMA3 = {"llama3-8b": (32, 4096, 32, 14336), "llama3-70b": (80, 8192, 64, 28672),
          "llama3.1-405b": (126, 16384, 128, 53248)}


@functools.lru_cache(maxsize=None)
def megatron_bridge_row(i: int) -> dict:
    """Row ``i`` as the recipes run it: micro batches of one sequence, distributed optimizer
    (ZeRO-1; the 8B row's FSDP as ZeRO-3), its gathers and reductions overlapped, 16-bit gradient
    reductions, SP and TP communication overlap with TP, interleaved where VP > 1, no recompute,
    flash attention; 405B's 126 layers over 64 chunks with one in the first and the last, as
    Megatron-LM's embedding- and loss-aware split makes them."""
    name, gpus, gbs, tp, pp, cp, vp, fsdp, _, _ = MEGATRON_BRIDGE_H100_FP8[i]
    layers, hidden, heads, ffn = LLAMA3[name]
    parallel = {"tp": tp, "pp": pp, "cp": cp, "dp": gpus // (tp * pp * cp), "zero": 3 if fsdp else 1,
                "overlap_param_gather": not fsdp}
    if tp > 1:
        parallel.update(sp=True, tp_comm_overlap=True)
    if vp > 1:
        parallel.update(schedule="interleaved", vpp=vp)
    if layers % (pp * vp):
        parallel["layers_per_stage"] = [1] + [2] * (pp * vp - 2) + [1]
    d = {"name": f"megatron-bridge-{name}", "cluster": {"topology": "topologies/dgx-h100.yaml", "nodes": gpus // 8},
         "model": {"name": name, "layers": layers, "hidden": hidden, "heads": heads, "kv_heads": 8,
                   "ffn_hidden": ffn, "mlp": "swiglu", "norm": "rmsnorm", "bias": False, "dropout": False,
                   "vocab": 128256, "seq_len": 8192, "tied_embeddings": False, "position_embedding": "rope"},
         "parallel": parallel,
         "training": {"micro_batch_size": 1, "global_batch_size": gbs, "precision": "fp8",
                      "fp8_recipe": "tensorwise", "grad_dtype": "bf16", "attention": "flash"}}
    s = clustersim.simulate(clustersim.load_scenario(d, base_dir=ROOT), brief=True).summary
    assert s["memory"]["fits"]
    return s


@pytest.mark.parametrize("i", range(len(MEGATRON_BRIDGE_H100_FP8)))
def test_megatron_bridge_h100_fp8_rows(i):
    """NVIDIA's published H100 FP8 throughput of Llama 3 8B, 70B and 3.1 405B: the same model
    FLOPs a token (Megatron-Bridge counts the causal half, as clustersim does: within 0.3 %), and
    clustersim 1.23-1.43x optimistic, more than on the A100 runs of 2021-2022 above: it models
    the casts of the GEMMs' operands to FP8 but not the weights' casts and the scales, no SMs
    the overlapped TP, CP and DP communication takes from the GEMMs, no framework overhead
    (docs/metrics.md)."""
    *_, tokens, tflops = MEGATRON_BRIDGE_H100_FP8[i]
    s = megatron_bridge_row(i)
    per_token = s["model_flops_per_step"] / s["tokens_per_step"]
    assert tokens * per_token / 1e12 == pytest.approx(tflops, rel=3e-3)
    assert within(s["tokens_per_s"] / s["world_size"] / tokens, 1.6)


def test_megatron_bridge_h100_fp8_rows_in_the_docs():
    """docs/metrics.md's table of those rows is the simulation's."""
    text = " ".join((ROOT / "docs/metrics.md").read_text().split())
    for i, row in enumerate(MEGATRON_BRIDGE_H100_FP8):
        s = megatron_bridge_row(i)
        mine = s["tokens_per_s"] / s["world_size"]
        ex = s["exposed_comm_s"]
        assert (f"| {row[0]} | {row[1]:,} | {row[8]:,} | {mine:,.0f} | {mine / row[8]:.2f} | {s['step_time_s']:.2f} s | "
                f"{s['compute_s']:.2f} s | {ex['total']:.2f} s | {100 * s['bubble_fraction']:.1f} % |") in text, row


def test_the_mfu_line_quotes_how_much_longer_the_published_runs_took():
    """The terminal's MFU line calls MFU an upper bound and quotes how much longer the published
    runs took than simulated, least and most (summary.PUBLISHED_LONGER): the figures of every
    run above, held here to the simulation's (Korthikanti et al.'s steps, Narayanan et al.'s
    TFLOP/s, NVIDIA's H100 FP8 and DeepSeek-V3's tokens/s), so that the line changes with them."""
    from clustersim.output.summary import PUBLISHED_LONGER, format_summary

    ratios = [pub / korthikanti_step(row, v) for row, full_s, seqsel_s in KORTHIKANTI_STEPS
              for v, pub in (("full", full_s), ("seqsel", seqsel_s))]
    ratios += [narayanan_row(i)[0] / row[-1] for i, row in enumerate(NARAYANAN_TABLE1)]
    ratios += [megatron_bridge_row(i)["tokens_per_s"] / megatron_bridge_row(i)["world_size"] / row[8]
               for i, row in enumerate(MEGATRON_BRIDGE_H100_FP8)]
    s = deepseek_v3()
    ratios.append(s["tokens_per_s"] / s["world_size"] / DEEPSEEK_V3_TOKENS_PER_GPU_S)
    assert (round(min(ratios) - 1, 2), round(max(ratios) - 1, 2)) == PUBLISHED_LONGER
    lo, hi = PUBLISHED_LONGER
    line = next(x for x in format_summary(s).splitlines() if x.startswith("MFU / HFU"))
    assert line.endswith(f"(upper bounds: published runs took {100 * lo:.0f}-{100 * hi:.0f} % longer than "
                         "simulated, docs/metrics.md)")


def test_the_readmes_ranges_are_the_simulations():
    """README's "Test it" quotes each comparison's range (Narayanan et al.'s TFLOP/s 2-14 % above
    published, Korthikanti et al.'s Table 5 steps published 4-13 % longer, NVIDIA's FP8 rows
    1.23-1.43x): held to the rows above, so that a change that moves them changes the README."""
    text = " ".join((ROOT / "README.md").read_text().split())

    def pct(ratios: list[float]) -> str:
        return f"{100 * (min(ratios) - 1):.0f}-{100 * (max(ratios) - 1):.0f} %"

    narayanan = [narayanan_row(i)[0] / row[-1] for i, row in enumerate(NARAYANAN_TABLE1)]
    assert f"simulated {pct(narayanan)} above their TFLOP/s" in text
    korthikanti = [pub / korthikanti_step(row, v) for row, full_s, seqsel_s in KORTHIKANTI_STEPS
                   for v, pub in (("full", full_s), ("seqsel", seqsel_s))]
    assert f"published {pct(korthikanti)} longer" in text
    nvidia = [megatron_bridge_row(i)["tokens_per_s"] / megatron_bridge_row(i)["world_size"] / row[8]
              for i, row in enumerate(MEGATRON_BRIDGE_H100_FP8)]
    assert f"simulated {min(nvidia):.2f}-{max(nvidia):.2f}x their throughput" in text
