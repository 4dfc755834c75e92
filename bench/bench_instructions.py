"""Instructions each phase of a run executes, counted under valgrind: a speed comparison that
the machine's drift does not blur.

    python bench/bench_instructions.py                          # moe_1024gpu
    python bench/bench_instructions.py x.yaml y.yaml            # these scenarios
    python bench/bench_instructions.py --against ../old x.yaml  # this checkout against another

Wall time on a shared 2-core machine drifts by 1.5x and more within minutes, more than most
changes move it; the instructions a run executes do not drift (the same program, inputs and
hash seed give the same count to a few parts in a million). Each scenario runs once per
checkout in a fresh interpreter under callgrind (``valgrind --tool=callgrind``, 30-80x slower
than a plain run; the runs go two at a time, as the count does not depend on what else runs).
The phases are those of ``bench_scale.py`` (a long 1F1B step's shorter step is lowered under
"lower"; finding and copying its cycle counts under "run"); between two phases the child calls
``os.getppid()``, and ``--dump-before=os_getppid`` makes callgrind write the counts so far
and start again from zero, so one run gives every phase::

    interpreter | import | bare | load | lower | setup | run | analysis | outputs | exit
               getppid  getppid getppid ...                                     getppid

"bare" is 20,000 simpy timeouts of a process that does nothing else (left out of the total):
the table ends with the instructions per bare timeout, the run's instructions per task and
their ratio, the engine's cost per task in bare timeouts without the drift.

A count is not a time: a cache miss costs more than an add. It says whether a change does
less work, and where; bench_scale.py says how long the work takes. Example (2026-11-30,
moe_1024gpu, the span forms and the report's own plot writer against the commit before)::

    moe_1024gpu          ac68b3c       c456bc4      change
    interpreter          186.2 M       186.2 M      +0.0 %
    import             1,465.1 M     1,345.2 M      -8.2 %
    load                 234.7 M       234.9 M      +0.1 %
    lower                764.5 M       761.7 M      -0.4 %
    setup              1,926.6 M     1,926.6 M      -0.0 %
    run                3,781.3 M     3,869.6 M      +2.3 %
    analysis             939.5 M       858.8 M      -8.6 %
    outputs            1,564.0 M     1,412.1 M      -9.7 %
    exit                 215.7 M       201.5 M      -6.6 %
    total             11,077.5 M    10,796.7 M      -2.5 %

One checkout, Megatron-1T (2026-12-01, c168739 with the bare phase; 8 minutes)::

    megatron_1t_3072      c168739+
    ...
    run               14,418.1 M
    ...
    total             49,702.6 M
    bare / event           8,218
    run / task            16,876
      x bare                2.05
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = [ROOT / "scenarios/moe_1024gpu.yaml"]
PHASES = ("interpreter", "import", "bare", "load", "lower", "setup", "run", "analysis", "outputs", "exit")
BARE_EVENTS = 20_000  # simpy timeouts of the "bare" phase: the drift-free reference for the run's cost


def child(path: str) -> None:
    """The run, phase by phase, with a marker call between phases (see the module docstring)."""
    mark = os.getppid
    mark()  # the interpreter has started
    import gc
    from pathlib import Path as P

    gc.disable()  # as python -m clustersim does
    from bench_scale import bare_env  # (this script's folder is on the path)

    from clustersim.analysis.invariants import InvariantError, check_invariants
    from clustersim.api import no_cyclic_gc, summarize
    from clustersim.config import load_scenario
    from clustersim.output.perfetto import write_trace
    from clustersim.output.report import write_report
    from clustersim.output.summary import to_json
    from clustersim.program.lower import lower

    bare = bare_env(BARE_EVENTS)
    mark()
    bare.run()
    mark()
    sc = load_scenario(path)
    _ = sc.cluster
    mark()
    with no_cyclic_gc():
        try:
            from clustersim.api import lower_step
        except ImportError:  # a checkout from before the shorter step resumed the whole one's lowering
            prog, low = lower(sc)
        else:
            prog, low = lower_step(sc, repeat=sc.cfg.simulation.repeat)
        try:
            from clustersim.api import _run
        except ImportError:  # a checkout from before repeated microbatches (--against)
            from clustersim.engine import Engine

            mark()
            sim = sc.cfg.simulation
            engine = Engine(prog, sc.cluster, sim.network, sim.collectives.model_dump())
            mark()
            trace = engine.run()
        else:
            seen: set[str] = set()

            def phase(key: str) -> None:  # lower (a shorter step's too), setup; the rest is "run"
                if key in ("lowered", "set_up") and key not in seen:
                    seen.add(key)
                    mark()
            engine, trace, _, _ = _run(sc, prog, None, links=True, repeat=sc.cfg.simulation.repeat, mark=phase,
                                    low=low)
        mark()
        summary = summarize(sc, low, trace, prog, engine, keep_columns=True)
        violations = check_invariants(prog, trace, summary, cols=trace.columns())
        if violations:
            raise InvariantError(violations)
        mark()
        with tempfile.TemporaryDirectory() as tmp:
            P(tmp, "summary.json").write_text(to_json(summary))
            write_report(P(tmp, "report.html"), trace, summary)
            write_trace(P(tmp, "trace.json.gz"), trace, summary)
        mark()
    print(len(prog.items))  # the tasks, for the run's instructions per task



def count(tree: Path, scenario: Path) -> tuple[list[int], int]:
    """Instructions per phase (PHASES order) of one run of ``scenario`` with the clustersim of
    ``tree`` (a checkout), and its tasks."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONPATH=str(tree), PYTHONHASHSEED="0")
    # compile the sources first (an installed package runs from its bytecode cache)
    subprocess.run([sys.executable, "-c", "import clustersim.api, clustersim.output.report"], cwd=tree, env=env,
                   check=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "cg.out")
        run = subprocess.run(["valgrind", "--tool=callgrind", "--dump-before=os_getppid", f"--callgrind-out-file={out}",
                              sys.executable, __file__, "--child", str(scenario)],
                             cwd=tree, env=env, capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"{scenario.name} under valgrind failed:\n{run.stderr[-3000:]}")
        dumps = sorted(Path(tmp).glob("cg.out.*"), key=lambda p: int(p.suffix[1:])) + [out]
        counts = [int(re.search(r"^summary: (\d+)", d.read_text(), re.M)[1]) for d in dumps]
    if len(counts) != len(PHASES):
        sys.exit(f"{scenario.name}: expected {len(PHASES)} phases, callgrind wrote {len(counts)} (os.getppid "
                 "called elsewhere?)")
    return counts, int(run.stdout.split()[-1])


def table(scenario: Path, names: list[str], results: list[tuple[list[int], int]]) -> str:
    """The counts per phase side by side ("total" leaves the bare timeouts out), then the run's
    instructions per task against a bare simpy timeout's per event: the engine's cost per
    task in bare timeouts, free of the machine's drift (instructions, not time)."""
    head = f"{scenario.stem:<14}" + "".join(f"{n:>14}" for n in names) + ("      change" if len(names) == 2 else "")
    lines = [head]
    bare, run = PHASES.index("bare"), PHASES.index("run")
    for i, phase in enumerate((*PHASES, "total")):
        vals = [sum(c) - c[bare] if phase == "total" else c[i] for c, _ in results]
        line = f"{phase:<14}" + "".join(f"{v / 1e6:>12,.1f} M" for v in vals)
        if len(vals) == 2 and vals[0]:
            line += f"{100 * (vals[1] - vals[0]) / vals[0]:>+10.1f} %"
        lines.append(line)
    per_event = [c[bare] / BARE_EVENTS for c, _ in results]
    per_task = [c[run] / tasks for c, tasks in results]
    lines.append(f"{'bare / event':<14}" + "".join(f"{v:>14,.0f}" for v in per_event))
    lines.append(f"{'run / task':<14}" + "".join(f"{v:>14,.0f}" for v in per_task))
    lines.append(f"{'  x bare':<14}" + "".join(f"{t / e:>14.2f}" for t, e in zip(per_task, per_event)))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenarios", nargs="*", type=Path)
    ap.add_argument("--against", type=Path, help="another checkout of clustersim, counted first")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return
    if shutil.which("valgrind") is None:
        sys.exit("bench_instructions.py needs valgrind (Debian: apt install valgrind)")
    trees = ([args.against.resolve()] if args.against else []) + [ROOT]
    names = [_label(t) for t in trees]
    scenarios = [p.resolve() for p in args.scenarios] or DEFAULT
    with ThreadPoolExecutor(max_workers=max(os.cpu_count() or 1, 1)) as pool:
        jobs = {(s, t): pool.submit(count, t, s) for s in scenarios for t in trees}
        for s in scenarios:
            print(table(s, names, [jobs[s, t].result() for t in trees]), flush=True)
            print()


def _label(tree: Path) -> str:
    """The checkout's commit (short), "+" when its working tree differs from it."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=tree,
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + ("+" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return tree.name


if __name__ == "__main__":
    main()
