"""Where the time goes after the engine has run, process by process: what ``clustersim run``
does from forking the writer of report.html and trace.json.gz to the files in place
(clustersim.output.background), as a timeline of both processes; and, where a shorter step is
simulated (Megatron-1T), what the process that simulates it (clustersim.engine.ahead) and
the parent do before that fork, at negative times.

    python bench/after_fork.py                          # moe_1024gpu
    python bench/after_fork.py --repeat 3 x.yaml y.yaml

The parent works out the summary and its invariant checks, then compresses trace pieces from
the back; the writer works out the link use the summary needs last (where no other process
has: Megatron-1T's is the shorter step's process's, which holds the run's records), makes the report's bars,
runs the checks that need no summary if the parent has not taken them yet ("checks without
the summary"), compresses pieces from the front, and once the summary is there makes the
report page and puts the trace file together. Total work bounds this phase: the two processes share the
pieces, so whichever side is longer takes fewer of them, and moving work from one side to the
other saves nothing unless a side waits (docs/performance-history.md, entry 14).

Each run is a fresh subprocess running the command itself (``clustersim/__main__.py``), its
phases wrapped to log their begin and end; times are seconds from the start of the fork (the
spans' display order, the piece count, the fork itself), read off the system's monotonic clock,
which both processes share. Example (2 cores, 2026-12-01, a slow stretch: bare simpy timeout
about 1.5 µs; the parent took all 10 pieces while the writer made its bars)::

    moe_1024gpu, run 1: the files are in place 0.41 s after the fork began
            0.000  parent  fork begins
            0.014  parent  fork done
            0.015  parent  summary begins
            0.016  writer  link use begins
            0.159  writer  link use done
            0.164  writer  report bars begin
            0.197  parent  link use handed over
            0.207  parent  summary done
            0.208  parent  checks begin
            0.251  parent  checks done
            0.270  parent  summary.json written; pieces from the back, then the writer waited for
            0.354  writer  report bars done
            0.380  writer  report page begins
            0.399  writer  report page done
            0.402  writer  trace file put together begins
            0.404  writer  trace file put together done
            0.414  parent  the writer done
            0.414  parent  files in place
        pieces of the trace file: parent 10, writer 0 (10 in all)

Here the writer is the longer side (its link use, then the report's bars, one after the other)
and the parent takes the checks. On Megatron-1T the writer's bars are done first, so it runs
the checks that need no summary (0.5-0.6 s) while the parent's summary (1.3-1.5 s) goes on;
then the two share the 225 pieces (2026-12-01: the files in place 2.0-2.4 s after the fork,
against 2.2-2.6 s when the parent made every check, alternated six times each).

Megatron-1T since the shorter step is simulated beside the whole step's lowering, its process
forked as soon as the scenario is read, and works the link use out while the parent splices
(2026-12-02, a fast stretch; excerpt)::

    megatron_1t_3072, run 1: the files are in place 1.01 s after the fork began, 2.54 s after the schedule's check began
           -1.534  parent   shorter step's process forked
           -1.531  parent   whole step's schedule begins
           -1.530  shorter  shorter step's lowering, set-up and run begin
           -1.393  parent   whole step's lowering begins
           -0.926  parent   whole step lowered
           -0.646  parent   task columns begin
           -0.387  parent   task columns done
           -0.387  parent   waits for the shorter step's spans
           -0.165  shorter  shorter step run, its cycle found
           -0.135  shorter  link use begins
           -0.126  parent   spans received
           -0.126  parent   splice begins
           -0.011  shorter  link use done
           -0.002  parent   splice done
            0.000  parent   fork begins
"""

from __future__ import annotations

import argparse
import os
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_scale import CHILD_ENV  # a sibling script (bench/ is on the path)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = [ROOT / "scenarios" / "moe_1024gpu.yaml"]


def _child(spec: str, log_path: str) -> None:
    """Run ``python -m clustersim run spec`` in this process, as that command does, its
    phases after the engine logged into ``log_path``: one line per event, ``pid seconds what``.
    The process ends by ``os._exit`` with the command's exit code."""
    import clustersim.cli as cli
    import clustersim.output.report as report
    from clustersim import api
    from clustersim import config as cfg
    from clustersim.engine import Engine, ahead
    from clustersim.output import background, perfetto

    t0 = [time.monotonic()]  # the report counts from the writer's fork ("fork begins")

    def log(what: str) -> None:
        with open(log_path, "a") as f:  # appended by both processes, a line at a time
            f.write(f"{os.getpid()} {time.monotonic() - t0[0]:.4f} {what}\n")

    def timed(owner, name: str, begins: str | None, done: str | None, *, then=None) -> None:
        """Log the begin and end of ``owner.name`` (None: not that one); ``then`` wraps what it
        returns."""
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if begins is not None:
                log(begins)
            out = fn(*args, **kwargs)
            if done is not None:
                log(done)
            return then(out) if then is not None else out

        setattr(owner, name, wrapper)

    start = background.start

    def start_logged(*args, **kwargs):
        log("fork begins")
        writer = start(*args, **kwargs)
        log("fork done")
        return writer

    background.start = start_logged
    packed = perfetto.TracePieces.packed

    def packed_logged(self, k):
        out = packed(self, k)
        log(f"piece {k}")
        return out

    perfetto.TracePieces.packed = packed_logged
    # before the writer's fork, where a shorter step is simulated (Megatron-1T): the process
    # that simulates it beside the whole step's lowering (clustersim.engine.ahead)
    timed(ahead.Ahead, "start", "shorter step's process forked", None)
    timed(cfg.Scenario, "check_schedule", "whole step's schedule begins", None)
    timed(api, "lower_step", "whole step's lowering begins", "whole step lowered")
    timed(api, "_shorter_run", "shorter step's lowering, set-up and run begin", "shorter step run, its cycle found")
    timed(api, "_warm", "task columns begin", "task columns done")
    timed(ahead.Ahead, "result", "waits for the shorter step's spans", "spans received")
    timed(api, "_spliced", "splice begins", "splice done")
    timed(Engine, "link_use", "link use begins", "link use done")
    def said(there: str, missing: str | None):
        def then(got):
            if got is not None or missing is not None:
                log(there if got is not None else missing)
            return got
        return then

    timed(ahead.Ahead, "links", None, None, then=said("link use received", "link use not received"))
    timed(background.Writer, "links", None, None, then=said("link use handed over", None))
    timed(api, "summarize", "summary begins", "summary done")
    timed(api, "check_step", "checks begin", "checks done")  # all of them, or the summary's
    timed(api, "check_trace", "checks without the summary begin", "checks without the summary done")
    timed(background, "complete", "summary.json written; pieces from the back, then the writer waited for",
          "the writer done")
    timed(cli._Staging, "move_in", None, "files in place")
    timed(perfetto, "gzip_file", "trace file put together begins", "trace file put together done")
    timed(report, "prepare_report", "report bars begin", "report bars done", then=lambda page: _logged_page(page, log))
    # the command itself (clustersim/__main__.py: no cyclic collector, the step's objects left
    # to os._exit), into a folder beside the log, which the caller removes
    sys.argv = ["clustersim", "run", spec, "--out", str(Path(log_path).parent / "out")]
    runpy.run_module("clustersim", run_name="__main__")


def _logged_page(page, log):
    """The report's page function (``prepare_report``'s result), its begin and end logged."""
    def logged(summary):
        log("report page begins")
        out = page(summary)
        log("report page done")
        return out
    return logged


def _report(name: str, k: int, lines: list[str]) -> str:
    """The timeline of one run, from its log lines."""
    rows = [line.split(" ", 2) for line in lines if line.strip()]
    parent = next(pid for pid, _, what in rows if what == "fork begins")
    shorter = {pid for pid, _, what in rows if what.startswith("shorter step's lowering")}
    who = {pid: "parent" if pid == parent else "shorter" if pid in shorter else "writer" for pid, _, _ in rows}
    fork_s = next(float(at) for _, at, what in rows if what == "fork begins")
    check_s = next((float(at) for _, at, what in rows if what == "whole step's schedule begins"), fork_s)
    pieces = {"parent": 0, "writer": 0}
    out = []
    end_s = None
    for pid, at, what in sorted(rows, key=lambda r: float(r[1])):
        if what.startswith("piece "):
            pieces[who[pid]] += 1
            continue
        if what == "files in place":
            end_s = float(at) - fork_s
        out.append(f"    {float(at) - fork_s:9.3f}  {who[pid]:7}  {what}")
    head = (f"{name}, run {k}: the files are in place {end_s:.2f} s after the fork began, "
            f"{end_s + fork_s - check_s:.2f} s after the schedule's check began")
    total = pieces["parent"] + pieces["writer"]
    tail = f"    pieces of the trace file: parent {pieces['parent']}, writer {pieces['writer']} ({total} in all)"
    return "\n".join([head, *out, tail])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenarios", nargs="*", type=Path, help="scenario YAML files (default: moe_1024gpu)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per scenario, each in a fresh process")
    ap.add_argument("--child", nargs=2, metavar=("SCENARIO", "LOG"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(*args.child)
        return 0
    for spec in args.scenarios or DEFAULT:
        for k in range(1, args.repeat + 1):
            with tempfile.TemporaryDirectory() as tmp:
                log_path = Path(tmp) / "after_fork.log"
                log_path.touch()
                run = subprocess.run([sys.executable, __file__, "--child", str(spec), str(log_path)],
                                     capture_output=True, text=True, env=CHILD_ENV)
                if run.returncode != 0:
                    print(run.stderr[-2000:], file=sys.stderr)
                    return run.returncode
                print(_report(spec.stem, k, log_path.read_text().splitlines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
