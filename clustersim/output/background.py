"""report.html and trace.json.gz written by a second process while the summary is worked out.

Both files need the trace for nearly all their work and the summary only at the end (the
report's panels and critical path, the trace file's metadata). Once the engine has run, the
run forks a writer; the two processes then use both cores, and share out the trace file's
pieces (perfetto.TracePieces: about 4,096 events each, compressed on their own) so that they
end together::

    parent  [engine run]─fork─[summary: metrics, memory, critical path][checks][summary.json]─[pieces n-1, n-2, ...]─wait─move
    child                     [link use][report bars][checks?][pieces 0, 1, 2, ...]─summary─[report page][pieces ...]─[trace.json.gz]

(the child's link use: where no other process works it out; a step whose shorter step ran in
its own process, clustersim.engine.ahead, gets it from that one)

The writer takes pieces from the front, the parent from the back once its summary is written,
one at a time (:class:`Share`), until they meet: whichever of the two is done first takes
more of them. A piece's text does not depend on who compresses it, so the file's text is the
same whatever the split (its bytes too where zlib compresses; ISA-L's deflate need not give
the same bytes twice: perfetto._deflate). The parent's pieces reach the writer through a
pickle file, and it puts the file together.

The invariant checks that need no summary (streams, dependencies, collectives, phase order,
sends: ``invariants.check_trace``, most of the checks' work) go to whichever of the two asks
first: the writer once its report bars are made, the parent once its summary is. On
Megatron-1T the writer is there first (0.9 s against 1.7 s after the fork) and runs them
(0.5-0.6 s) while the parent's summary goes on; on moe_1024gpu the parent is. Pieces could
not even that out: the parent's summary was the longer side by itself. The writer's
violations come back in a pickle file once it is done (``Writer.checks_verdict``), and the
parent judges them before anything is moved into place; if the writer failed before saying,
the parent runs those checks itself.

The child has the trace as the parent had it at the fork (its pages are shared until
written). The summary reaches it through a pickle file in the run's temp folder, and one
byte on a pipe says it is there (a second byte: the parent's pieces are). The child writes its
files into that folder; the parent moves them into place only after it has waited for the
child, so a failed check (which kills the child) still leaves nothing behind. Where the
parent writes the files itself (the same functions, so the same files): off Linux (Windows has
no fork; on macOS system libraries may not survive one), in a process running other Python
threads (a lock one of them holds would stay held in the child), and when the child fails.

On Megatron-1T (bench/bench_scale.py) the two files take about 1.3-1.8 s and the summary with
its checks 1.4-1.8 s: they overlap instead of adding up; with the checks the writer takes,
2.0-2.4 s from the fork to the files in place against 2.2-2.6 s when the parent made them
all (bench/after_fork.py, alternated six times each). On moe_1024gpu the summary is done
first, and the parent then compresses most of the trace file while the writer makes the
report.
"""

from __future__ import annotations

import functools
import mmap
import os
import pickle
import select
import signal
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..forking import can_fork, fork_with_pipes, release
from ..trace import Trace, link_columns, links_of_columns

try:
    import fcntl  # (POSIX: the lock on the claims' counters, used once forked, on Linux alone)
except ImportError:  # Windows: no fork, the files are written in the process itself (start)
    fcntl = None

SUMMARY_FILE = ".summary.pickle"  # in the temp folder, removed once the child is done
PIECES_FILE = ".pieces.pickle"  # the parent's pieces of the trace file, for the child
LINKS_FILE = ".links.pickle"  # the link use the child worked out, for the parent
CLAIMS_FILE = ".claims"  # the counters of Share
CHECKS_FILE = ".checks.pickle"  # the violations the writer found, when it took the checks
# from this many GPUs on, the parent works the link use out itself rather than the writer
# (start's ``link_use``, which clustersim run then leaves None): the forked writer runs it at
# about half its speed in a process of gigabytes (copy-on-write: reading an object writes its
# reference count, so the pages it touches are copied), and its links cross back as pickled
# columns. clustersim run, alternating, on
# 2026-12-07: 131,072 GPUs 24.8-26.4 s against 27.7-28.2 s, 65,536 12.3-12.7 s against
# 13.2-14.0 s, 16,384 3.48-3.54 s against 3.29-3.60 s (even); smaller steps gain from the
# writer's taking it (history entry 14), which is the same link use, the same files
PARENT_LINK_USE_GPUS = 32_768


class Share:
    """The pieces of the trace file shared out between the writer (from the front) and the
    parent (from the back), one at a time until they meet::

        pieces   0  1  2  3  4  5  6  7  8  9
        writer   → → → →
        parent                  ← ← ←            front = 4, back = 7: pieces 4-6 still free

    Two counters in a small file that both processes map, changed under a POSIX record lock
    (``fcntl.lockf``: held per process, so parent and child exclude each other through the
    descriptor they share; the kernel drops it if its holder dies). In the writer, it also
    reads the pipe on which the parent says that the summary, then its pieces, are there."""

    def __init__(self, folder: Path, count: int):
        self.folder = folder
        self.fd = os.open(folder / CLAIMS_FILE, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        # front, back, and who took the invariant checks (0: nobody yet, 1: the parent, 2: the writer)
        os.write(self.fd, struct.pack("<qqq", 0, count, 0))
        self.counters = mmap.mmap(self.fd, 24)
        self.signals = -1  # in the writer: the pipe's read end

    def take(self, front: bool) -> int | None:
        """The next free piece from the front (the writer) or the back (the parent); None
        once every piece is taken."""
        fcntl.lockf(self.fd, fcntl.LOCK_EX)
        try:
            lo, hi = struct.unpack_from("<qq", self.counters)
            if lo >= hi:
                return None
            if front:
                struct.pack_into("<q", self.counters, 0, lo + 1)
                return lo
            struct.pack_into("<q", self.counters, 8, hi - 1)
            return hi - 1
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN)

    def take_checks(self, writer: bool) -> bool:
        """Whether the caller (the writer, or the parent) gets the invariant checks that need
        no summary: the first of the two to ask does."""
        fcntl.lockf(self.fd, fcntl.LOCK_EX)
        try:
            (who,) = struct.unpack_from("<q", self.counters, 16)
            if who:
                return False
            struct.pack_into("<q", self.counters, 16, 2 if writer else 1)
            return True
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN)

    def taken(self, front: bool):
        """Pieces as :meth:`take` gives them, until none is left."""
        return iter(lambda: self.take(front), None)

    def summary_ready(self) -> bool:
        """In the writer: whether the parent's signal that the summary is there has come
        (the next byte on the pipe), without waiting."""
        return bool(select.select([self.signals], [], [], 0)[0])

    def summary(self) -> dict[str, Any]:
        return _receive(self.signals, b"s", self.folder / SUMMARY_FILE)

    def parents_pieces(self) -> dict[int, tuple]:
        return _receive(self.signals, b"p", self.folder / PIECES_FILE)

    def close(self) -> None:
        self.counters.close()
        os.close(self.fd)
        (self.folder / CLAIMS_FILE).unlink(missing_ok=True)


def _receive(signals: int, expected: bytes, path: Path):
    """In the writer: wait for the parent's byte ``expected`` on the pipe ``signals``, then
    read the pickle file ``path`` it says is there; leave (exit code 1) if the pipe says
    anything else, or closes (the parent failed)."""
    if os.read(signals, 1) != expected:
        raise SystemExit(1)
    return pickle.loads(path.read_bytes())


def write_files(folder: Path, trace: Trace, summary, *, report: bool, trace_file: bool,
                share: Share | None = None, checks: Callable[[], list] | None = None) -> None:
    """Write report.html and trace.json.gz into ``folder``. ``summary``: the summary, or a
    function that gives it, asked for once everything the trace alone decides is done: the
    timeline's bars made, every piece of the trace file written and compressed. With
    ``share`` (in the writer), the pieces are shared out with the parent (:class:`Share`): the
    summary is read as soon as it is there, and the page made then, between two pieces; and
    ``checks`` (the invariant checks that need no summary) are run here, once the bars are
    made, if the parent has not taken them yet (their violations into CHECKS_FILE)."""
    from .perfetto import TracePieces, gzip_file, trace_tail
    from .report import SUMMARY_LINK, TRACE_LINK, prepare_report

    page = prepare_report(trace, (SUMMARY_LINK,) + ((TRACE_LINK,) if trace_file else ())) if report else None
    if checks is not None and share is not None and share.take_checks(writer=True):
        (folder / CHECKS_FILE).write_bytes(pickle.dumps(checks(), protocol=pickle.HIGHEST_PROTOCOL))
    html = None
    packed: dict[int, tuple] = {}
    if trace_file:
        pieces = TracePieces(trace)
        for k in share.taken(front=True) if share is not None else range(pieces.count):
            packed[k] = pieces.packed(k)
            if page is not None and html is None and share is not None and share.summary_ready():
                # the page now: the parent takes pieces meanwhile, so both end together
                summary, html = _page(page, summary)
    if html is None and page is not None:
        summary, html = _page(page, summary)
    summary = summary() if callable(summary) else summary
    if html is not None:
        (folder / "report.html").write_bytes(html)
    if trace_file:
        if share is not None:
            packed.update(share.parents_pieces())
        (folder / "trace.json.gz").write_bytes(gzip_file([packed[k] for k in range(pieces.count)],
                                                          trace_tail(summary)))


def _page(page, summary) -> tuple[dict[str, Any], bytes]:
    """(the summary, asked for if it is a function; the report page made with it)."""
    summary = summary() if callable(summary) else summary
    return summary, page(summary)


def complete(writer: Writer | None, folder: Path, trace: Trace, summary: dict[str, Any], *, report: bool,
             trace_file: bool) -> None:
    """Hand ``summary`` to ``writer``, take pieces of the trace file while it writes, and wait
    for it; where there is none (:func:`start` gave None) or it failed, write the files
    here, the same bytes."""
    if writer is None or not writer.finish(summary, trace):
        write_files(folder, trace, summary, report=report, trace_file=trace_file)


class Writer:
    """A forked process writing report.html and trace.json.gz into a folder: :meth:`finish`
    hands it the summary, takes pieces of the trace file while it writes, and waits for it;
    :meth:`cancel` stops it."""

    def __init__(self, folder: Path, pid: int, signal_fd: int, share: Share | None = None, links_fd: int = -1,
                 checks: bool = False):
        self.folder, self.pid, self._fd, self.share = folder, pid, signal_fd, share
        self._links_fd = links_fd  # the pipe on which the child says the link use is there
        self.done = False  # the child has been waited for
        self._checks = checks and share is not None  # the child was offered the checks
        self._checks_theirs: bool | None = None  # whether it took them, once asked

    def checks_taken(self) -> bool:
        """In the parent, once its summary is made: whether the writer took the checks that
        need no summary (it asks once its report bars are made); if not, they are the
        parent's from now on. On Megatron-1T the writer is done with its share of the work
        first and takes them; on moe_1024gpu the parent is."""
        if self._checks_theirs is None:
            self._checks_theirs = bool(self._checks and self.share is not None
                                       and not self.share.take_checks(writer=False))
        return self._checks_theirs

    def checks_verdict(self) -> list | None:
        """After :meth:`finish`: the violations the writer's checks found, or None if it took
        them and did not get to say (it failed: the caller runs them itself)."""
        path = self.folder / CHECKS_FILE
        if not self._checks_theirs or not self.done or not path.is_file():
            return None
        try:
            return pickle.loads(path.read_bytes())
        except OSError:  # (the folder deleted meanwhile: the caller runs them, and its files fail to say it)
            return None
        finally:
            path.unlink(missing_ok=True)

    def links(self) -> list | None:
        """The link use the child worked out first thing (:func:`start`'s ``link_use``),
        once it is there; None if the child did not get that far (the caller works it out)."""
        if self._links_fd < 0:
            return None
        try:
            there = os.read(self._links_fd, 1) == b"l"  # b"": the child left without it
        finally:
            os.close(self._links_fd)
            self._links_fd = -1
        path = self.folder / LINKS_FILE
        try:
            got = links_of_columns(pickle.loads(path.read_bytes())) if there else None
            path.unlink(missing_ok=True)
        except OSError:  # (the output folder deleted meanwhile: worked out here; writing the files then says it)
            got = None
        return got

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._links_fd >= 0:
            os.close(self._links_fd)
            self._links_fd = -1

    def _signal(self, what: bytes) -> None:
        try:
            os.write(self._fd, what)
        except OSError:  # the child is gone already
            pass

    def finish(self, summary: dict[str, Any], trace: Trace) -> bool:
        """Give the child the summary, compress pieces of ``trace``'s file from the back until
        the child has taken the rest, and wait for it; True if it wrote its files."""
        summary_path, pieces_path = self.folder / SUMMARY_FILE, self.folder / PIECES_FILE
        try:
            data = pickle.dumps(summary, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - a summary extended with something unpicklable
            self.cancel()
            return False
        summary_path.write_bytes(data)
        self._signal(b"s")
        if self.share is not None:
            try:
                mine = self._take_pieces(trace)
                pieces_path.write_bytes(pickle.dumps(mine, protocol=pickle.HIGHEST_PROTOCOL))
            except Exception:  # noqa: BLE001 - the child waits for these: stop it, write here
                self.cancel()
                return False
            self._signal(b"p")
        self._close()
        _, status = os.waitpid(self.pid, 0)  # an interrupt here leaves cancel() to stop it
        self.done = True
        summary_path.unlink(missing_ok=True)
        pieces_path.unlink(missing_ok=True)
        self._drop_share()
        return os.waitstatus_to_exitcode(status) == 0

    def _take_pieces(self, trace: Trace) -> dict[int, tuple]:
        """Pieces of the trace file from the back, compressed here, until none is left."""
        from .perfetto import TracePieces

        pieces, mine = None, {}
        for k in self.share.taken(front=False):
            if pieces is None:  # only once there is one to take
                pieces = TracePieces(trace)
            mine[k] = pieces.packed(k)
        return mine

    def _drop_share(self) -> None:
        if self.share is not None:
            self.share.close()
            self.share = None

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
        self._drop_share()


def start(folder: Path, trace: Trace, *, report: bool, trace_file: bool,
          link_use: Callable[[], list] | None = None, checks: Callable[[], list] | None = None) -> Writer | None:
    """Fork a process that writes the files into ``folder`` once it has the summary; None
    where there is nothing to write or no fork (the caller then writes them itself). The
    spans' display order is worked out before the fork: both processes write pieces of the
    trace file in it (and the report draws in it). ``link_use``: worked out by the child
    first, for the parent's summary (:meth:`Writer.links`), which needs it last: on
    moe_1024gpu the summary with its checks is the longer of the two sides; None where it is
    worked out elsewhere (Megatron-1T: clustersim.engine.ahead; the parent itself
    from :data:`PARENT_LINK_USE_GPUS` GPUs on).
    ``checks``: the invariant checks that need no summary, which the child runs if it gets to
    them first (:meth:`Writer.checks_taken`, :meth:`Writer.checks_verdict`); only with the
    trace file, whose pieces the two share out anyway."""
    if not (report or trace_file) or not can_fork():
        return None
    share = None
    if trace_file:
        from .perfetto import piece_count

        share = Share(folder, piece_count(trace))
    # (Ctrl-C held back around the fork: clustersim.forking)
    forked = fork_with_pipes(2 if link_use is not None else 1)
    if forked is None:  # no pipe or no process to be had (memory, process limits): written here
        if share is not None:
            share.close()
        return None
    pid, fds, held = forked
    read_fd, write_fd, links_r, links_w = (*fds, -1, -1)[:4]
    if pid:
        try:
            writer = Writer(folder, pid, write_fd, share, links_r, checks=checks is not None)
            os.close(read_fd)
            if links_w >= 0:
                os.close(links_w)
        finally:  # (whatever fails here, Ctrl-C is never left held for the rest of the process)
            release(held)
        return writer
    # the child: never returns into the caller's code, and leaves by os._exit, which skips
    # the interpreter's teardown (freeing the step's objects one by one) and the parent's
    # buffered output
    code = 1
    try:
        release(held)  # (an interrupt now ends it here)
        os.close(write_fd)
        if link_use is not None:
            os.close(links_r)
            (folder / LINKS_FILE).write_bytes(pickle.dumps(link_columns(link_use()), protocol=pickle.HIGHEST_PROTOCOL))
            os.write(links_w, b"l")
            os.close(links_w)
        if share is None:
            summary = functools.partial(_receive, read_fd, b"s", folder / SUMMARY_FILE)
        else:
            share.signals = read_fd
            summary = share.summary
        write_files(folder, trace, summary, report=report, trace_file=trace_file, share=share, checks=checks)
        code = 0
    except BaseException:  # noqa: BLE001 - the parent sees the exit code and writes the files itself
        code = 1
    finally:
        os._exit(code)
