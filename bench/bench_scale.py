"""How fast clustersim runs a scenario, phase by phase, and how that grows with the cluster.

    python bench/bench_scale.py                        # moe_1024gpu and the two bench scenarios
    python bench/bench_scale.py --repeat 3 x.yaml      # medians of 3 runs; x.yaml added
    python bench/bench_scale.py --only x.yaml          # x.yaml alone
    python bench/bench_scale.py --sweep                # wall time vs GPUs and vs microbatches
                                                       # (1F1B, then ZB-V and DualPipeV)

Every scenario (and sweep point) runs in a fresh subprocess, so its peak RSS is its own. The
phases are those of ``python -m clustersim run``: import (clustersim, plotly & co.), load
(read and check the YAML, build the cluster graph), lower (plan -> per-rank tasks), engine
(setup: plan and classify every communication; run: the simpy run; the link accounting is
worked out by the forked writer, as clustersim run does; splice: where a long 1F1B step
simulates fewer microbatches and copies its cycle in, finding, checking and copying it,
clustersim.engine.repeat, whose shorter step's lowering counts under "lower"; "simulated" is
that step's tasks),
analysis (summary and invariant checks, while a forked process writes report.html and
trace.json.gz, as the command does: clustersim.output.background), outputs (summary.json, then
waiting for that process: what the files add after the summary; "writers alone s" is what they
cost in one process, measured afterwards); the total is all of these but "writers alone".
"clustersim run s" is the README's command itself, timed from outside (interpreter start-up
and exit included). "writer RSS MiB" is the forked writer's peak. The phases here run one after
the other in one process, to time each; where a shorter step is simulated (Megatron-1T) the
command simulates it in a forked process beside the whole step's lowering
(clustersim.engine.ahead), so its "clustersim run s" is below the total.
"simpy events" are the events the run scheduled; it runs until none is left, so all were
processed. "x bare timeout" compares the engine's seconds per event (setup and run) with those
of a process that only yields simpy timeouts, on the same machine: each measured run times the
bare timeout itself just before its lowering and just after its engine, in the same process,
and takes its ratios against the mean of the two ("bare timeout us"; the machine's speed drifts
over minutes, and one reading at the start misled the ratios of runs made minutes later by as
much as the drift). bench_instructions.py gives the same ratio in instructions, drift-free.

Example (2 cores, 2026-12-03, --repeat 3, on a fast stretch of a machine whose speed drifts
by 1.5x or more within minutes: compare scenarios, not machines; docs/performance.md has the
targets and the figures, and bench_instructions.py compares two versions without the drift;
moe_1024gpu here is its PP16 DualPipe plan of that day)::

    bare simpy timeout at the start: 0.54 us per event (median of 5 x 200,000; each run reads its own)
                             moe_1024gpu   llama3_405b_16k  megatron_1t_3072
    GPUs                           1,024            16,384             3,072
    simulated ranks                   16                16                64
    tasks                         36,072            30,432           854,340
      simulated                   36,072            30,432           253,860
    spans                         37,032            32,448           918,852
    simpy events                  26,792            15,323            39,917
    import s                        0.17              0.16              0.16
    load s                          0.02              0.25              0.15
    lower s                         0.05              0.17              0.42
    engine s                        0.46              1.21              1.24
      setup s                       0.14              0.97              0.21
      run s                         0.33              0.25              0.69
      splice s                      0.00              0.00              0.33
    analysis s                      0.11              0.32              0.79
    outputs s                       0.06              0.03              0.36
    total s                         0.86              2.14              3.10
    writers alone s                 0.11              0.10              0.66
    clustersim run s                0.96              2.29              2.55
    peak RSS MiB                     125               384               556
    writer RSS MiB                   125               348               547
    events/s                      58,037            12,633            32,268
    tasks/s                       78,139            25,091           690,625
    bare timeout us                 0.56              0.56              0.54
    engine us/event                17.23             79.15             30.99
    x bare timeout                  31.3             143.8              57.6
    engine us/task                 12.80             39.86              1.45
      x bare timeout                23.2              72.4               2.7
      run only                      16.2              14.6               5.0
      ideal network                  3.5               3.7               2.6
    every GPU's tasks          2,308,608        31,162,368        41,008,320
      x bare, each                  0.36              0.07              0.06

"every GPU's tasks" counts the tasks of every GPU the results describe (each simulated rank's
tasks times the ranks it stands for, :func:`covered_tasks`) and "x bare, each" the engine's
cost per such task: what the symmetric collapse saves, not the per-event target's measure.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import numpy as np
import simpy

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = [ROOT / "scenarios/moe_1024gpu.yaml", ROOT / "bench/scenarios/llama3_405b_16k.yaml",
           ROOT / "bench/scenarios/megatron_1t_3072.yaml"]
SWEEP_GPUS = (64, 256, 1024, 4096, 16384, 32768, 65536)  # at SWEEP_M microbatches, DP grows
SWEEP_M = 16
SWEEP_MICROBATCHES = (8, 32, 128, 512)  # at SWEEP_FIXED_GPUS
SWEEP_FIXED_GPUS = 256
SWEEP_V = ("zbv", "dualpipev", "dualpipe")  # the microbatch sweep again under these (all repeat)
SWEEP_MOE_MICROBATCHES = (16, 64, 128, 512)  # moe_1024gpu's plan as its microbatches grow
BARE_TIMEOUTS, BARE_REPEATS = 200_000, 5
CHILD_BARE_REPEATS = 3  # in each measured run, right after it (see measure)


def simpy_events(env: simpy.Environment) -> int:
    """Events ``env`` has scheduled so far: simpy numbers each one from ``env._eid``, an
    itertools.count (simpy/core.py, Environment.schedule). Reading it takes one number."""
    return next(env._eid)


def bare_env(n: int) -> simpy.Environment:
    """An environment whose one process only yields ``n`` timeouts, ready to run: the bare
    cost of a simpy event (also counted in instructions by bench_instructions.py)."""
    def ticker(env):
        for _ in range(n):
            yield env.timeout(1e-6)

    env = simpy.Environment()
    env.process(ticker(env))
    return env


def bare_timeout_s(n: int = BARE_TIMEOUTS, repeats: int = BARE_REPEATS) -> float:
    """Seconds per event of a process that only yields ``n`` timeouts (median of ``repeats``)."""
    per_event_s = []
    for _ in range(repeats):
        env = bare_env(n)
        t0 = time.perf_counter()
        env.run()
        per_event_s.append((time.perf_counter() - t0) / simpy_events(env))
    return median(per_event_s)


def dense_scenario(gpus: int, microbatches: int, schedule: str = "1f1b") -> dict:
    """The sweep's dense plan: a Llama-2-70B-like model, TP8 x PP4 x DP(gpus/32), 1F1B (or
    ``schedule``), on DGX-H100 nodes; ``microbatches`` per pipeline and step."""
    dp = gpus // 32
    return {
        "name": f"dense-{gpus}gpu-m{microbatches}" + ("" if schedule == "1f1b" else f"-{schedule}"),
        "cluster": {"topology": "topologies/dgx-h100.yaml", "nodes": gpus // 8},
        "model": {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "ffn_hidden": 28672, "mlp": "swiglu",
                  "norm": "rmsnorm", "bias": False, "dropout": False, "vocab": 32000, "seq_len": 4096,
                  "tied_embeddings": False, "position_embedding": "rope"},
        "parallel": {"tp": 8, "pp": 4, "dp": dp, "schedule": schedule},
        "training": {"micro_batch_size": 1, "global_batch_size": dp * microbatches, "attention": "flash"},
    }


def measure(spec: str) -> dict:
    """Run one scenario as ``clustersim run`` does, timing each phase. ``spec``: a YAML path, or
    ``dense:GPUS:M`` (or ``dense:GPUS:M:SCHEDULE``) for a sweep point, or ``moe:M`` for
    scenarios/moe_1024gpu.yaml with M microbatches."""
    gc.disable()  # as python -m clustersim does for its whole process (clustersim/__main__.py)
    t_import = time.perf_counter()
    from clustersim.analysis.invariants import InvariantError
    from clustersim.api import _run, check_step, check_trace, lower_step, no_cyclic_gc, summarize
    from clustersim.config import load_scenario
    from clustersim.output import background
    from clustersim.output.summary import to_json

    t0 = time.perf_counter()  # clustersim, plotly & co. imported
    if spec.startswith("dense:"):
        _, gpus, m, *schedule = spec.split(":")
        sc = load_scenario(dense_scenario(int(gpus), int(m), *schedule), base_dir=ROOT)
    elif spec.startswith("moe:"):
        from clustersim.api import with_microbatches

        sc = with_microbatches(load_scenario(DEFAULT[0]), int(spec.split(":")[1]))
    else:
        sc = load_scenario(spec)
    _ = sc.cluster  # the graph is built on first use; count it as loading
    t_loaded = time.perf_counter()
    bare_before_s = bare_timeout_s(repeats=CHILD_BARE_REPEATS)  # see bare_s below
    t1 = time.perf_counter()
    with no_cyclic_gc():  # as simulate() and clustersim run do
        prog, low = lower_step(sc, repeat=sc.cfg.simulation.repeat)
        marks: dict[str, float] = {}
        # as simulate() and clustersim run do: the link use is worked out by the writer; a long
        # 1F1B step simulates fewer microbatches (lowered again) and copies its cycle in
        engine, trace, _, _ = _run(sc, prog, None, links=False, repeat=sc.cfg.simulation.repeat, low=low,
                                mark=lambda k: marks.__setitem__(k, time.perf_counter()))
        t3 = time.perf_counter()
        t_lowered = marks["lowered"]  # the shorter step's lowering counts as lowering
        t_setup = marks["set_up"]
        events = simpy_events(engine.env)
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            writer = background.start(tmp, trace, report=True, trace_file=True, link_use=engine.link_use,
                                      checks=functools.partial(check_trace, prog, trace))

            def links():  # as simulate() asks for them: the writer's, else worked out here
                got = writer.links() if writer is not None else None
                return got if got is not None else engine.link_use()
            try:
                summary = summarize(sc, low, trace, prog, engine, keep_columns=True, links=links)
                left = check_step(prog, trace, summary, writer)  # as simulate() does: the writer may have taken some
                t4 = time.perf_counter()
                (tmp / "summary.json").write_text(to_json(summary))
                background.complete(writer, tmp, trace, summary, report=True, trace_file=True)
                violations = left() if left is not None else []  # as clustersim run does
                if violations:
                    raise InvariantError(violations)
                t5 = time.perf_counter()
            finally:
                if writer is not None:
                    writer.cancel()
            rss_MiB = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
            writer_MiB = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024 if writer else 0.0
            t6 = time.perf_counter()
            background.write_files(tmp, trace, summary, report=True, trace_file=True)  # in this process
            writers_alone_s = time.perf_counter() - t6
    # the simulated program again on an ideal network (every communication takes no time: no
    # flow network, no fair shares, no set-up): what the stream loop and the spans cost per task
    # without the network model, set-up and run
    from clustersim.engine import Engine

    t7 = time.perf_counter()
    Engine(engine.prog, sc.cluster, "ideal", sc.cfg.simulation.collectives.model_dump()).run(links=False)
    ideal_s = time.perf_counter() - t7
    # the bare cost of a simpy timeout in this same process, just before the lowering and just
    # after the run, averaged: the machine's speed drifts by 1.5x or more over minutes, so each
    # run's ratios are taken against its own readings (which still miss swings within seconds)
    bare_s = (bare_before_s + bare_timeout_s(repeats=CHILD_BARE_REPEATS)) / 2
    sim_tasks = len(engine.prog.items)  # those simulated: fewer than the step's when its cycle was copied in
    gpu_tasks = covered_tasks(prog)
    return {
        "gpus": sc.mesh.world_size, "microbatches": sc.microbatches, "ranks": len(prog.ranks),
        "tasks": len(prog.items), "sim_tasks": sim_tasks, "spans": trace.n_spans, "events": events,
        "bare_us": bare_s * 1e6,
        "x_bare": (t3 - t_lowered) / events / bare_s, "x_bare_task": (t3 - t_lowered) / len(prog.items) / bare_s,
        "x_bare_task_run": (marks["ran"] - t_setup) / sim_tasks / bare_s,
        "x_bare_task_ideal": ideal_s / sim_tasks / bare_s,
        "gpu_tasks": gpu_tasks, "x_bare_gpu_task": (t3 - t_lowered) / gpu_tasks / bare_s,
        "import_s": t0 - t_import, "load_s": t_loaded - t0, "lower_s": t_lowered - t1,
        "engine_setup_s": t_setup - t_lowered, "engine_run_s": marks["ran"] - t_setup,
        "splice_s": t3 - marks["ran"], "engine_s": t3 - t_lowered,
        "analysis_s": t4 - t3, "outputs_s": t5 - t4, "total_s": t5 - t_import - (t1 - t_loaded),
        "writers_alone_s": writers_alone_s,
        "rss_MiB": rss_MiB, "writer_rss_MiB": writer_MiB,
    }


def covered_tasks(prog) -> int:
    """The tasks of every GPU the step's results cover: each simulated rank's tasks times
    ``Program.weight``, the ranks it stands for (its twins and itself)::

        moe_1024gpu     8 simulated ranks x 128 (DP twins): 15,575 x 128 = 1,993,600

    Not the per-event target's measure (that is per task simulated): what the engine costs
    per task of the whole step that summary.json, the report and the trace describe."""
    rank_of = np.full(len(prog.items), -1, dtype=np.int64)
    for rank, first, end, _ in prog.runs:
        rank_of[first:end] = rank
    for t in prog.items:
        if t is not None and rank_of[t.tid] < 0:
            rank_of[t.tid] = t.rank
    per_rank = np.bincount(rank_of)
    return int(sum(int(per_rank[r]) * prog.weight.get(r, 1) for r in prog.ranks if r < len(per_rank)))


# Subprocesses import clustersim from its bytecode cache, as an installed package does (pip
# compiles it): with PYTHONDONTWRITEBYTECODE set, every run would compile the sources again
# (about 0.12 s of "import" on this machine).
CHILD_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def measure_fresh(spec: str, repeat: int) -> dict:
    """Medians over ``repeat`` fresh subprocesses of :func:`measure`."""
    runs = []
    for _ in range(repeat):
        out = subprocess.run([sys.executable, __file__, "--child", spec], check=False, capture_output=True, text=True,
                             env=CHILD_ENV)
        if out.returncode:
            raise SystemExit(f"{spec} failed:\n{out.stderr}")
        runs.append(json.loads(out.stdout.splitlines()[-1]))
    return {k: median(r[k] for r in runs) for k in runs[0]}


def cli_wall_s(path: str, repeat: int) -> float:
    """Median wall time of ``python -m clustersim run path`` as a user runs it: interpreter
    start-up, import, simulation with its checks, the three outputs, exit."""
    walls = []
    path = str(Path(path).resolve())
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeat):
            t0 = time.perf_counter()
            # from an empty folder: "-m" puts the working folder first on sys.path, and the
            # clustersim to time is the one this interpreter has installed
            out = subprocess.run([sys.executable, "-m", "clustersim", "run", path, "--out", tmp],
                                 check=False, capture_output=True, text=True, cwd=tmp, env=CHILD_ENV)
            walls.append(time.perf_counter() - t0)
            if out.returncode:
                raise SystemExit(f"clustersim run {path} failed:\n{out.stderr}")
    return median(walls)


# --- printing ------------------------------------------------------------------------
COUNT, SECONDS = "{:,.0f}", "{:.2f}"
ROWS = [  # label, key, format
    ("GPUs", "gpus", COUNT), ("simulated ranks", "ranks", COUNT), ("tasks", "tasks", COUNT),
    ("  simulated", "sim_tasks", COUNT), ("spans", "spans", COUNT), ("simpy events", "events", COUNT),
    ("import s", "import_s", SECONDS), ("load s", "load_s", SECONDS), ("lower s", "lower_s", SECONDS),
    ("engine s", "engine_s", SECONDS), ("  setup s", "engine_setup_s", SECONDS), ("  run s", "engine_run_s", SECONDS),
    ("  splice s", "splice_s", SECONDS),
    ("analysis s", "analysis_s", SECONDS), ("outputs s", "outputs_s", SECONDS), ("total s", "total_s", SECONDS),
    ("writers alone s", "writers_alone_s", SECONDS), ("clustersim run s", "cli_wall_s", SECONDS),
    ("peak RSS MiB", "rss_MiB", COUNT), ("writer RSS MiB", "writer_rss_MiB", COUNT),
    ("events/s", "events_per_s", COUNT), ("tasks/s", "tasks_per_s", COUNT),
    ("bare timeout us", "bare_us", SECONDS),
    ("engine us/event", "us_per_event", SECONDS), ("x bare timeout", "x_bare", "{:.1f}"),
    ("engine us/task", "us_per_task", SECONDS), ("  x bare timeout", "x_bare_task", "{:.1f}"),
    ("  run only", "x_bare_task_run", "{:.1f}"), ("  ideal network", "x_bare_task_ideal", "{:.1f}"),
    ("every GPU's tasks", "gpu_tasks", COUNT), ("  x bare, each", "x_bare_gpu_task", "{:.2f}"),
]
SWEEP_COLS = [("GPUs", "gpus", COUNT), ("m", "microbatches", COUNT), ("tasks", "tasks", COUNT),
              ("events", "events", COUNT), ("load s", "load_s", SECONDS), ("lower s", "lower_s", SECONDS),
              ("engine s", "engine_s", SECONDS), ("setup s", "engine_setup_s", SECONDS),
              ("analysis s", "analysis_s", SECONDS), ("outputs s", "outputs_s", SECONDS),
              ("total s", "total_s", SECONDS), ("RSS MiB", "rss_MiB", COUNT)]


def derive(r: dict) -> dict:
    """Rates from one scenario's medians (engine seconds, setup included). The ratios to a bare
    simpy timeout are each run's own (:func:`measure`), medians too. Per event: per simpy event
    the run scheduled. Per task: per task of the step (its start and end, simulated or, where
    the step's cycle was copied in, copied), the simulator's own unit of work, since most tasks
    now cost no simpy event (docs/architecture.md, "Ahead of the clock"); "run only" leaves
    the set-up and the splice out and counts the tasks simulated; "ideal network" is the same
    simulated program set up and run again with ``simulation.network: ideal`` (communications
    take no time: no flow network, no fair shares), per task simulated: the engine's own loop
    without the network model, so that the two rows above it split into the loop and the
    model."""
    return {**r, "events_per_s": r["events"] / r["engine_s"], "tasks_per_s": r["tasks"] / r["engine_s"],
            "us_per_event": 1e6 * r["engine_s"] / r["events"], "us_per_task": 1e6 * r["engine_s"] / r["tasks"]}


def print_scenarios(names: list[str], results: list[dict]) -> None:
    width = max(12, *(len(n) + 2 for n in names))
    print(f"{'':<18}" + "".join(f"{n:>{width}}" for n in names))
    for label, key, fmt in ROWS:
        print(f"{label:<18}" + "".join(f"{fmt.format(r[key]):>{width}}" for r in results))


def print_sweep(title: str, specs: list[str], repeat: int) -> None:
    """Measure each sweep point and print its row as soon as it is done."""
    print(title)
    print("".join(f"{label:>11}" for label, _, _ in SWEEP_COLS), flush=True)
    for spec in specs:
        r = measure_fresh(spec, repeat)
        print("".join(f"{fmt.format(r[key]):>11}" for _, key, fmt in SWEEP_COLS), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("scenarios", nargs="*", help="extra scenario YAML files")
    ap.add_argument("--repeat", type=int, default=1, help="runs per scenario; medians are printed")
    ap.add_argument("--only", action="store_true", help="measure only the scenarios given, not the three default ones")
    ap.add_argument("--sweep", action="store_true", help="wall time vs GPU count and vs microbatches")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # one measurement, printed as JSON
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child)))
        return
    if args.sweep:
        print(f"dense plan: Llama-2-70B-like, TP8 x PP4 x DP(GPUs/32), 1F1B, DGX-H100 (medians of {args.repeat})")
        print_sweep(f"\nGPUs grow (DP), {SWEEP_M} microbatches",
                    [f"dense:{g}:{SWEEP_M}" for g in SWEEP_GPUS], args.repeat)
        print_sweep(f"\nmicrobatches grow, {SWEEP_FIXED_GPUS} GPUs",
                    [f"dense:{SWEEP_FIXED_GPUS}:{m}" for m in SWEEP_MICROBATCHES], args.repeat)
        for schedule in SWEEP_V:
            print_sweep(f"\nmicrobatches grow, {SWEEP_FIXED_GPUS} GPUs, {schedule}",
                        [f"dense:{SWEEP_FIXED_GPUS}:{m}:{schedule}" for m in SWEEP_MICROBATCHES], args.repeat)
        print_sweep("\nmicrobatches grow, scenarios/moe_1024gpu.yaml's plan (1,024 GPUs, interleaved)",
                    [f"moe:{m}" for m in SWEEP_MOE_MICROBATCHES], args.repeat)
        return
    bare_s = bare_timeout_s()
    print(f"bare simpy timeout at the start: {bare_s * 1e6:.2f} us per event (median of {BARE_REPEATS} x "
          f"{BARE_TIMEOUTS:,}; each run reads its own)", flush=True)
    paths = ([] if args.only else DEFAULT) + [Path(p) for p in args.scenarios]
    if not paths:
        ap.error("--only needs scenarios")
    results = [derive({**measure_fresh(str(p), args.repeat), "cli_wall_s": cli_wall_s(str(p), args.repeat)})
               for p in paths]
    print_scenarios([p.stem for p in paths], results)


if __name__ == "__main__":
    main()
