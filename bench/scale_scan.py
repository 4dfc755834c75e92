"""Plans at scale beyond the three of bench_scale.py, each run as a user runs it, to find the
ones that are slow or large out of proportion: a sweep of plans meets them all.

    python bench/scale_scan.py                 # every plan below
    python bench/scale_scan.py gb200 fsdp      # the plans whose names contain a word given

Per plan: ``clustersim run`` wall time (interpreter, import, simulation, the three files),
its peak RSS, the ranks simulated and the spans. Each plan is made here (a model, a plan,
a topology of topologies/) and written to a temporary folder; the run writes its files there.

Example (2 cores, 2026-12-02, bare simpy timeout about 1.3 µs; docs/performance.md has
the whole table; "before" is the tree before history entries 25 and 26)::

    plan                       GPUs  ranks     spans   wall s   RSS MiB   before
    16k_dp_only_zero2        16,384      1       200      4.1       393   23.7 s, 630 MiB
    gb200_8k_tree             8,064      8    25,542     13.5       578   108.6 s, 4,728 MiB
    16k_moe_roce             16,384     16    10,726     19.5     1,729   35.6 s, 3,791 MiB
    (the other 15: 0.6-5.6 s, 81-454 MiB)

and moe_1024gpu's what-ifs, which split its symmetry classes but for the last, whose split
would take every rank (2026-12-03, a fast stretch)::

    1k_moe_slow_gpu           1,024     64   148,128      2.1       261  moe_1024gpu with GPU 5 20 % slower
    1k_moe_skewed_ep          1,024    256   592,512      6.0       642  moe_1024gpu with a skewed expert load ...
    1k_moe_nic_half           1,024    288   666,576      6.6       695  moe_1024gpu with one NIC cable at half ...
    1k_moe_leaf_half          1,024     16    37,032      1.0       122  moe_1024gpu with a leaf's uplink at half ...

and the main plan's long step (2026-12-06, bare simpy timeout about 0.7 µs; all 512
microbatches simulated, before history entries 53-54: 21.6 s, 763 MiB)::

    1k_moe_512mb              1,024      8   520,503      4.7       510  moe_1024gpu's plan at 512 microbatches ...

and GPT-3's, whose NIC fault touches one GPU's traffic on its node and reaches the 128 GPUs
of rail 5, whose split fits the 256 ranks of ``simulation.fabric_fault_split_ranks``
(2026-12-05; until then GPU 5 alone split: 64 ranks, 641,360 spans, 4.9 s and 651 MiB, the
step 1.7 % long)::

    1k_gpt3_nic_half          1,024    256 3,751,232     33.1     3,151  gpt3_175b_1024gpu with node 0's NIC 5 ...

and GPT-3 with each DP replica simulated apart (``simulation.split_replicas``; 2026-12-05;
one class a stage: 32 ranks, about 2 s, 295 MiB)::

    1k_gpt3_replicas          1,024    128 1,875,616      7.5       953  gpt3_175b_1024gpu with each DP replica ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGIES = ROOT / "topologies"

LLAMA_405B = {"layers": 126, "hidden": 16384, "heads": 128, "kv_heads": 8, "ffn_hidden": 53248, "mlp": "swiglu",
              "norm": "rmsnorm", "bias": False, "dropout": False, "vocab": 128256, "seq_len": 8192,
              "tied_embeddings": False, "position_embedding": "rope"}
LLAMA_70B = {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "ffn_hidden": 28672, "mlp": "swiglu",
             "norm": "rmsnorm", "bias": False, "dropout": False, "vocab": 32000, "seq_len": 4096,
             "tied_embeddings": False, "position_embedding": "rope"}
LLAMA_8B = {**LLAMA_70B, "layers": 32, "hidden": 4096, "heads": 32, "ffn_hidden": 14336}
GPT3 = {"layers": 96, "hidden": 12288, "heads": 96, "mlp": "gelu", "vocab": 51200, "seq_len": 2048}


def _moe() -> dict:
    return yaml.safe_load((ROOT / "scenarios" / "moe_1024gpu.yaml").read_text())["model"]


# moe_1024gpu's plan until 2026-12-04 (PP16 DualPipe; it does not fit since a split backward holds
# its W's inputs, docs/performance-history.md entry 42), kept for its what-ifs below, whose figures
# docs/performance.md gives
MOE_1K = {"tp": 1, "pp": 16, "dp": 64, "ep": 16, "zero": 1, "schedule": "dualpipe"}
MOE_1K_TRAINING = {"training": {"recompute": "full"}}
MOE_1K_MAIN = {"tp": 1, "pp": 8, "dp": 128, "ep": 16, "zero": 1, "schedule": "interleaved", "vpp": 4,
               "overlap_param_gather": True}  # scenarios/moe_1024gpu.yaml's plan since 2026-12-04

# name -> (what it probes, topology file, nodes, model, parallel, global batch[, more: sections
# merged into the scenario's, "moe" into its model's])
PLANS = {
    "16k_1f1b": ("Llama-3-405B at 16K GPUs, plain 1F1B, ZeRO-1", "roce-clos-llama3.yaml", 2048, LLAMA_405B,
                 {"tp": 8, "pp": 16, "dp": 128, "sp": True, "zero": 1, "schedule": "1f1b"}, 128 * 16),
    "16k_cp2_128k": ("a 128K-token context over CP2 at 16K GPUs", "roce-clos-llama3.yaml", 2048,
                     {**LLAMA_405B, "seq_len": 131072}, {"tp": 8, "cp": 2, "pp": 16, "dp": 64, "sp": True,
                                                          "schedule": "1f1b"}, 64 * 16),
    "16k_m128": ("128 microbatches of 1F1B at 16K GPUs (repeating cycle)", "roce-clos-llama3.yaml", 2048,
                 LLAMA_405B, {"tp": 8, "pp": 16, "dp": 128, "schedule": "1f1b"}, 128 * 128),
    "16k_fsdp": ("ZeRO-3 over DP 2,048 with TP8", "dgx-h100.yaml", 2048, LLAMA_70B,
                 {"tp": 8, "pp": 1, "dp": 2048, "zero": 3}, 2048 * 2),
    "16k_dp_only_zero2": ("one DP ring over 16,384 GPUs (one simulated rank)", "dgx-h100.yaml", 2048, LLAMA_8B,
                          {"tp": 1, "pp": 1, "dp": 16384, "zero": 2}, 16384),
    "16k_zero3_interleaved": ("ZeRO-3 with interleaved 1F1B at 16K GPUs", "dgx-h100.yaml", 2048, LLAMA_405B,
                              {"tp": 8, "pp": 16, "dp": 128, "zero": 3, "schedule": "interleaved", "vpp": 2},
                              128 * 16),
    "16k_moe_roce": ("the MoE at 16K GPUs on Llama 3's RoCE Clos (no rails), EP64, 1F1B: asymmetric "
                     "all-to-all orbits", "roce-clos-llama3.yaml", 2048, None,
                     {"tp": 1, "pp": 16, "dp": 1024, "ep": 64, "zero": 1, "schedule": "1f1b"}, 1024 * 16),
    "8k_gpt3_a100": ("GPT-3 175B on 8K A100s, ZeRO-1", "dgx-a100.yaml", 1024, GPT3,
                     {"tp": 8, "pp": 8, "dp": 128, "zero": 1, "schedule": "1f1b"}, 128 * 64),
    "8k_moe_1f1b": ("a DeepSeek-V3-like MoE on 8K GPUs, EP8, ZeRO-2, 1F1B", "dgx-h100.yaml", 1024, None,
                    {"tp": 1, "pp": 8, "dp": 1024, "ep": 8, "zero": 2, "schedule": "1f1b"}, 1024 * 16),
    "gb200_8k_tree": ("GB200 NVL72, 112 racks, ZeRO-0: DP all-reduce by trees over 252 GPUs",
                      "gb200-nvl72.yaml", 112, LLAMA_405B,
                      {"tp": 4, "pp": 8, "dp": 252, "sp": True, "schedule": "interleaved", "vpp": 2}, 252 * 16),
    "gb200_10k_zero1": ("GB200 NVL72, 144 racks, ZeRO-1 (rings)", "gb200-nvl72.yaml", 144, LLAMA_405B,
                        {"tp": 8, "pp": 8, "dp": 162, "zero": 1, "sp": True, "schedule": "1f1b"}, 162 * 16),
    "gb200_144_zero3": ("ZeRO-3 over two GB200 racks", "gb200-nvl72.yaml", 2, LLAMA_70B,
                        {"tp": 1, "pp": 1, "dp": 144, "zero": 3}, 144),
    "4k_moe_dualpipe": ("the MoE at 4K GPUs, EP64, DualPipe", "dgx-h100.yaml", 512, None,
                        {"tp": 1, "pp": 16, "dp": 256, "ep": 64, "zero": 1, "schedule": "dualpipe"}, 256 * 32),
    "2k_moe_h800": ("the MoE on 2K H800s, EP32, DualPipe", "h800-cluster.yaml", 256, None,
                    {"tp": 1, "pp": 8, "dp": 256, "ep": 32, "zero": 1, "schedule": "dualpipe"}, 256 * 16),
    "4k_zbh1": ("ZB-H1 at 4K GPUs", "dgx-h100.yaml", 512, LLAMA_70B,
                {"tp": 8, "pp": 8, "dp": 64, "schedule": "zb-h1"}, 64 * 64),
    "4k_cp4_allgather": ("CP4 by all-gather, 64K tokens, on a fat tree", "fat-tree.yaml", 512,
                         {**LLAMA_70B, "seq_len": 65536}, {"tp": 8, "cp": 4, "pp": 4, "dp": 32,
                                                            "cp_comm": "all_gather", "schedule": "1f1b"}, 32 * 8),
    "4k_gpt3_m256": ("256 microbatches on 4K A100s", "dgx-a100.yaml", 512, GPT3,
                     {"tp": 8, "pp": 8, "dp": 64, "zero": 1, "schedule": "1f1b"}, 64 * 256),
    "2k_gpipe": ("GPipe with 64 microbatches", "dgx-h100.yaml", 256, LLAMA_70B,
                 {"tp": 8, "pp": 4, "dp": 64, "schedule": "gpipe"}, 64 * 64),
    # what-ifs that split moe_1024gpu's classes (docs/performance.md, "What-ifs split the classes")
    "1k_moe_slow_gpu": ("moe_1024gpu with GPU 5 20 % slower", "dgx-h100.yaml", 128, None, MOE_1K, 2048,
                        {**MOE_1K_TRAINING, "cluster": {"what_if": [{"gpu": 5, "slowdown": 1.2}]}}),
    "1k_moe_skewed_ep": ("moe_1024gpu with a skewed expert load (one class per stage and EP index)",
                         "dgx-h100.yaml", 128, None, MOE_1K, 2048,
                         {**MOE_1K_TRAINING, "moe": {"ep_load": [1.5, *[1.0] * 7, 0.8, *[1.0] * 6, 0.7]}}),
    "1k_moe_nic_half": ("moe_1024gpu with one NIC cable at half bandwidth (its node's GPUs split)",
                        "dgx-h100.yaml", 128, None, MOE_1K, 2048,
                        {**MOE_1K_TRAINING, "cluster": {"what_if": [{"link": "n0.nic5-leaf0.5", "bw_factor": 0.5}]}}),
    "1k_gpt3_nic_half": ("gpt3_175b_1024gpu with node 0's NIC 5 cable at half bandwidth (rail 5's GPUs split)",
                         "dgx-a100.yaml", 128, GPT3, {"tp": 8, "pp": 16, "dp": 8, "schedule": "1f1b"}, 1536,
                         {"cluster": {"what_if": [{"link": "n0.nic5-leaf0.5", "bw_factor": 0.5}]}}),
    # each DP replica simulated apart (docs/architecture.md, "Classes split by DP replica")
    "1k_gpt3_replicas": ("gpt3_175b_1024gpu with each DP replica apart (simulation.split_replicas)",
                         "dgx-a100.yaml", 128, GPT3, {"tp": 8, "pp": 16, "dp": 8, "schedule": "1f1b"}, 1536,
                         {"simulation": {"split_replicas": True}}),
    # a long step of the main plan (interleaved, vpp 4): its groups alternate, a cycle of 16
    # microbatches copied in (docs/architecture.md, "Repeating microbatches")
    "1k_moe_512mb": ("moe_1024gpu's plan at 512 microbatches (a cycle of two groups copied in)", "dgx-h100.yaml", 128,
                     None, MOE_1K_MAIN, 512 * 128, MOE_1K_TRAINING),
    "1k_moe_leaf_half": ("moe_1024gpu with a leaf's uplink at half bandwidth (kept in the collapse)",
                         "dgx-h100.yaml", 128, None, MOE_1K, 2048,
                         {**MOE_1K_TRAINING, "cluster": {"what_if": [{"link": "leaf0.0-spine0", "bw_factor": 0.5}]}}),
}


def scenario(name: str) -> dict:
    """The scenario of plan ``name`` (a dict as a YAML file holds it)."""
    _, topo, nodes, model, parallel, batch, *more = PLANS[name]
    more = more[0] if more else {}
    model = {"name": name, **(model or _moe())}
    if "moe" in more:
        model["moe"] = {**model["moe"], **more["moe"]}
    return {"name": name, "description": PLANS[name][0],
            "cluster": {"topology": str(TOPOLOGIES / topo), "nodes": nodes, **more.get("cluster", {})},
            "model": model, "parallel": parallel,
            "training": {"micro_batch_size": 1, "global_batch_size": batch, "precision": "bf16",
                         "attention": "flash", **more.get("training", {})},
            "simulation": more.get("simulation", {})}


def run(name: str, folder: Path) -> dict:
    """``clustersim run`` on plan ``name`` in a fresh process: wall time, peak RSS, and what
    its summary says was simulated."""
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(scenario(name), sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "clustersim", "run", str(path), "--out", str(folder / name)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=folder)
    _, status, usage = os.wait4(child.pid, 0)  # this child's own peak RSS
    wall = time.perf_counter() - t0
    err = child.stderr.read().decode()
    child.stderr.close()
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{name} failed:\n{err}")
    sim = json.loads((folder / name / "summary.json").read_text())["simulation"]
    return {"gpus": scenario(name)["cluster"]["nodes"] * yaml.safe_load(
                (TOPOLOGIES / PLANS[name][1]).read_text())["node"]["gpus"],
            "ranks": sim["simulated_ranks"], "spans": sim["spans"], "wall_s": wall,
            "rss_MiB": usage.ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("words", nargs="*", help="run only the plans whose names contain one of these")
    args = ap.parse_args()
    names = [n for n in PLANS if not args.words or any(w in n for w in args.words)]
    print(f"{'plan':<24}{'GPUs':>7}{'ranks':>7}{'spans':>10}{'wall s':>9}{'RSS MiB':>10}  what it probes")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            r = run(name, Path(tmp))
            print(f"{name:<24}{r['gpus']:>7,}{r['ranks']:>7,}{r['spans']:>10,}{r['wall_s']:>9.1f}"
                  f"{r['rss_MiB']:>10,.0f}  {PLANS[name][0]}", flush=True)


if __name__ == "__main__":
    main()
