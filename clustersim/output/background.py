"""report.html and trace.json.gz written by a second process while the summary is worked out.

Both files need the trace for nearly all their work and the summary only at the end (the
report's panels and critical path, the trace file's metadata). Once the engine has run, the
run forks a writer; the two processes then use both cores::

    parent  [engine run]─fork─[summary: metrics, memory, critical path, checks][summary.json]─wait─move
    child                     [trace.json.gz events][report bars]─summary─[report page][trace metadata]

The child has the trace as the parent had it at the fork (its pages are shared until
written). The summary reaches it through a pickle file in the run's temp folder, and one
byte on a pipe says it is there. The child writes its files into that folder; the parent
moves them into place only after it has waited for the child, so a failed check (which
kills the child) still leaves nothing behind. Where the parent writes the files itself (the
same functions, so the same bytes): off Linux (Windows has no fork; on macOS system libraries
may not survive one), in a process running other Python threads (a lock one of them holds
would stay held in the child), and when the child fails.

On Megatron-1T (bench/bench_scale.py) the two files take about 2.1 s and the summary with
its checks about as long: they overlap instead of adding up.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

from ..trace import Trace

SUMMARY_FILE = ".summary.pickle"  # in the temp folder, removed once the child is done


def write_files(folder: Path, trace: Trace, summary, *, report: bool, trace_file: bool) -> None:
    """Write report.html and trace.json.gz into ``folder``. ``summary``: the summary, or a
    function that gives it, asked for once everything the trace alone decides is done: every
    event of the trace file written and compressed, the timeline's bars made."""
    from .perfetto import prepare_trace
    from .report import prepare_report

    trace_bytes = prepare_trace(trace) if trace_file else None
    page = prepare_report(trace) if report else None
    summary = summary() if callable(summary) else summary
    if trace_bytes is not None:
        (folder / "trace.json.gz").write_bytes(trace_bytes(summary))
    if page is not None:
        (folder / "report.html").write_text(page(summary), encoding="utf-8")


def complete(writer: Writer | None, folder: Path, trace: Trace, summary: dict[str, Any], *, report: bool,
             trace_file: bool) -> None:
    """Hand ``summary`` to ``writer`` and wait for it; where there is none (:func:`start`
    gave None) or it failed, write the files here, the same bytes."""
    if writer is None or not writer.finish(summary):
        write_files(folder, trace, summary, report=report, trace_file=trace_file)


class Writer:
    """A forked process writing report.html and trace.json.gz into a folder: :meth:`finish`
    hands it the summary and waits for it, :meth:`cancel` stops it."""

    def __init__(self, folder: Path, pid: int, signal_fd: int):
        self.folder, self.pid, self._fd = folder, pid, signal_fd
        self.done = False  # the child has been waited for

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def finish(self, summary: dict[str, Any]) -> bool:
        """Give the child the summary and wait for it; True if it wrote its files."""
        summary_path = self.folder / SUMMARY_FILE
        try:
            data = pickle.dumps(summary, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - a summary extended with something unpicklable
            self.cancel()
            return False
        summary_path.write_bytes(data)
        try:
            os.write(self._fd, b"s")
        except OSError:  # the child is gone already
            pass
        self._close()
        _, status = os.waitpid(self.pid, 0)  # an interrupt here leaves cancel() to stop it
        self.done = True
        summary_path.unlink(missing_ok=True)
        return os.waitstatus_to_exitcode(status) == 0

    def cancel(self) -> None:
        """Stop the child if it still runs (the parent failed): nothing it wrote is kept."""
        if self.done:
            return
        self.done = True
        self._close()
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(self.pid, 0)


def start(folder: Path, trace: Trace, *, report: bool, trace_file: bool) -> Writer | None:
    """Fork a process that writes the files into ``folder`` once it has the summary; None
    where there is nothing to write or no fork (the caller then writes them itself)."""
    if not (report or trace_file) or not sys.platform.startswith("linux") or threading.active_count() > 1:
        return None
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns of forking a process with other OS threads: numpy's BLAS keeps
        # a pool, which the child never calls (the writers do no linear algebra)
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid:
        os.close(read_fd)
        return Writer(folder, pid, write_fd)
    # the child: never returns into the caller's code, and leaves by os._exit, which skips
    # the interpreter's teardown (freeing the step's objects one by one) and the parent's
    # buffered output
    code = 1
    try:
        os.close(write_fd)

        def summary() -> dict[str, Any]:
            if os.read(read_fd, 1) != b"s":  # the parent closed the pipe: it failed
                raise SystemExit(1)
            return pickle.loads((folder / SUMMARY_FILE).read_bytes())

        write_files(folder, trace, summary, report=report, trace_file=trace_file)
        code = 0
    except BaseException:  # noqa: BLE001 - the parent sees the exit code and writes the files itself
        code = 1
    finally:
        os._exit(code)
