"""Where the time goes after the engine has run, process by process: what ``clustersim run``
does from forking the writer of report.html and trace.json.gz to the files in place
(clustersim.output.background), as a timeline of both processes.

    python bench/after_fork.py                          # moe_1024gpu
    python bench/after_fork.py --repeat 3 x.yaml y.yaml

The parent works out the summary and its invariant checks, then compresses trace pieces from
the back; the writer works out the link use the summary needs last, makes the report's bars,
compresses pieces from the front, and once the summary is there makes the report page and
puts the trace file together. Total work bounds this phase: the two processes share the
pieces, so whichever side is longer takes fewer of them, and moving work from one side to the
other saves nothing unless a side waits (docs/performance-history.md, entry 14).

Each run is a fresh subprocess; times are seconds from the start of the fork (the spans'
display order, the piece count, the fork itself), read off the system's monotonic clock, which
both processes share. Example (2 cores, 2026-12-01, a slow stretch: bare simpy timeout
about 1.5 µs)::

    moe_1024gpu, run 1: the files are in place 0.34 s after the fork began
            0.000  parent  fork begins
            0.010  parent  fork done
            0.010  parent  summary begins
            0.011  writer  link use begins
            0.123  writer  link use done
            0.127  writer  report bars begins
            0.129  parent  link use handed over
            0.134  parent  summary done
            0.135  parent  checks begin
            0.167  parent  checks done
            0.176  parent  summary.json written; pieces from the back, then the writer waited for
            0.289  writer  report bars done
            0.310  writer  report page begins
            0.328  writer  report page done
            0.334  writer  trace file put together begins
            0.335  writer  trace file put together done
            0.345  parent  files in place
        pieces of the trace file: parent 10, writer 0 (10 in all)

Here the writer is the longer side (its link use, then the report's bars, one after the other);
on Megatron-1T the parent is (the summary 1.0-1.3 s, the checks 0.4 s), and the writer
compresses most of the 225 pieces.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = [ROOT / "scenarios" / "moe_1024gpu.yaml"]


def _child(spec: str, log_path: str) -> None:
    """Run ``spec`` as ``clustersim run`` does and log the phases after the engine into
    ``log_path``: one line per event, ``pid seconds what``."""
    import clustersim.output.report as report
    from clustersim.analysis.invariants import InvariantError, check_invariants
    from clustersim.api import no_cyclic_gc, summarize
    from clustersim.config import load_scenario
    from clustersim.engine import Engine
    from clustersim.output import background, perfetto
    from clustersim.output.summary import to_json
    from clustersim.program.lower import lower

    t0 = [0.0]

    def log(what: str) -> None:
        with open(log_path, "a") as f:  # appended by both processes, a line at a time
            f.write(f"{os.getpid()} {time.monotonic() - t0[0]:.4f} {what}\n")

    def timed(owner, name: str, label: str, *, then=None) -> None:
        """Log the begin and end of ``owner.name`` (``then`` wraps what it returns)."""
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            log(f"{label} begins")
            out = fn(*args, **kwargs)
            log(f"{label} done")
            return then(out) if then is not None else out

        setattr(owner, name, wrapper)

    packed = perfetto.TracePieces.packed

    def packed_logged(self, k):
        out = packed(self, k)
        log(f"piece {k}")
        return out

    perfetto.TracePieces.packed = packed_logged
    timed(Engine, "link_use", "link use")
    timed(perfetto, "gzip_file", "trace file put together")
    timed(report, "prepare_report", "report bars", then=lambda page: _logged_page(page, log))

    sc = load_scenario(spec)
    with no_cyclic_gc():
        prog, low = lower(sc)
        sim = sc.cfg.simulation
        engine = Engine(prog, sc.cluster, sim.network, sim.collectives.model_dump())
        trace = engine.run(links=False)
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            t0[0] = time.monotonic()
            log("fork begins")
            writer = background.start(folder, trace, report=True, trace_file=True, link_use=engine.link_use)
            log("fork done")

            def links():  # as simulate() asks for them
                got = writer.links() if writer is not None else None
                log("link use handed over" if got is not None else "link use not handed over")
                return got if got is not None else engine.link_use()

            try:
                log("summary begins")
                summary = summarize(sc, low, trace, prog, engine, keep_columns=True, links=links)
                log("summary done")
                log("checks begin")
                violations = check_invariants(prog, trace, summary, cols=trace.columns())
                log("checks done")
                if violations:
                    raise InvariantError(violations)
                (folder / "summary.json").write_text(to_json(summary))
                log("summary.json written; pieces from the back, then the writer waited for")
                background.complete(writer, folder, trace, summary, report=True, trace_file=True)
                log("files in place")
            finally:
                if writer is not None:
                    writer.cancel()


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
    who = {pid: "parent" if pid == parent else "writer" for pid, _, _ in rows}
    pieces = {"parent": 0, "writer": 0}
    out = []
    end_s = None
    for pid, at, what in sorted(rows, key=lambda r: float(r[1])):
        if what.startswith("piece "):
            pieces[who[pid]] += 1
            continue
        if what == "files in place":
            end_s = float(at)
        out.append(f"    {float(at):9.3f}  {who[pid]:6}  {what}")
    head = f"{name}, run {k}: the files are in place {end_s:.2f} s after the fork began"
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
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # as installed: bytecode cached
    for spec in args.scenarios or DEFAULT:
        for k in range(1, args.repeat + 1):
            with tempfile.TemporaryDirectory() as tmp:
                log_path = Path(tmp) / "after_fork.log"
                log_path.touch()
                run = subprocess.run([sys.executable, __file__, "--child", str(spec), str(log_path)],
                                     capture_output=True, text=True, env=env)
                if run.returncode != 0:
                    print(run.stderr[-2000:], file=sys.stderr)
                    return run.returncode
                print(_report(spec.stem, k, log_path.read_text().splitlines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
