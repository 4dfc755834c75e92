"""Forking a helper process: whether it is safe here, and the fork itself with its pipes.

Two parts of ``clustersim run`` fork: the process that simulates a repeated step's shorter
step (clustersim.engine.ahead) and the writer of report.html and trace.json.gz
(clustersim.output.background). Both make their pipes, then fork with Ctrl-C held back
(SIGINT blocked, and SIGTERM, which the command line stops on as it does on Ctrl-C) until
each side knows which it is and the parent has noted its child::

    block SIGINT ─ pipes ─ fork ─┬─ parent: note the child's pid and pipe ends ─ release
                                 └─ child:  release inside its own try (an interrupt ends it there)

so that neither an interrupted child runs the parent's code nor an interrupted parent loses
its child. This module imports nothing from the package: engine/ and output/ both use it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

# Ctrl-C, and SIGTERM (kill, timeout, Slurm), which clustersim's command line turns into an
# exception as Python does Ctrl-C (cli.main)
_STOPS = {signal.SIGINT, signal.SIGTERM}


def can_fork() -> bool:
    """Whether a process may be forked here: on Linux (Windows has no fork; on macOS system
    libraries may not survive one), and with no other Python thread running (a lock one of
    them holds would stay held in the child)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and threading.active_count() == 1


def pool_forks() -> bool:
    """Whether a search's worker processes may be forked (``sweep``, ``advise``: ``--jobs``):
    where the platform has fork, Linux and macOS (not Windows: the plans run in one process).
    On macOS too, though system libraries may not survive a fork (:func:`can_fork`): a
    worker is a whole plan, not a moment of one run, and one that dies is reported (its plan
    "ended without a result"), where a run's forked writer would lose the run's files."""
    import multiprocessing

    return hasattr(os, "fork") and "fork" in multiprocessing.get_all_start_methods()


def _hold() -> set:
    """Block Ctrl-C and SIGTERM where the platform can (not Windows: nothing is held there,
    and nothing forks either); the signal mask from before."""
    return signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS) if hasattr(signal, "pthread_sigmask") else set()


def fork_with_pipes(pipes: int) -> tuple[int, list[int], set] | None:
    """Make ``pipes`` pipes, then fork, Ctrl-C held back in both processes: (the child's pid,
    0 in the child; the pipes' ends, read then write end of each; the signal mask each side
    gives back with :func:`release` once it has noted which it is). None where a pipe or the
    fork fails (memory, process limits): nothing left open, Ctrl-C released."""
    fds: list[int] = []
    held = _hold()
    try:
        for _ in range(pipes):
            fds += os.pipe()
        with warnings.catch_warnings():
            # Python 3.12+ warns of forking a process with other OS threads: numpy's BLAS
            # keeps a pool, which neither process calls across the fork
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError:
        for fd in fds:
            os.close(fd)
        release(held)
        return None
    return pid, fds, held


def release(held: set) -> None:
    """Let Ctrl-C through again: the signal mask from before :func:`fork_with_pipes` or
    :func:`ctrl_c_held`."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


@contextmanager
def ctrl_c_held() -> Iterator[None]:
    """Ctrl-C (and SIGTERM) held back while the block runs (a child stopped and waited for, not left
    unwaited-for by an interrupt in between).

    The signal mask holds them for the calling thread: a signal sent to the process goes to a
    thread that does not block it, whose handler Python then runs in the main thread at once.
    clustersim starts no thread (numpy's BLAS pool blocks signals); a host program with threads
    of its own may see the interrupt inside the block."""
    held = _hold()
    try:
        yield
    finally:
        release(held)


class WorkerSlots:
    """One slot per worker process of a pool forked after it is made: the worker's pid and a
    number of its own (0: none), in shared memory the fork hands down. Callers hold ``lock``
    around each look and change, for microseconds; a process killed while it waits (outside
    the lock) leaves nothing locked. clustersim.host_memory keeps the bytes each search
    worker's run was weighed at here, clustersim.sweep the plan each one simulates."""

    def __init__(self, slots: int) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        self.lock = ctx.Lock()
        self.pids = ctx.RawArray("q", slots)
        self.values = ctx.RawArray("q", slots)

    def set(self, pid: int, value: int) -> None:
        """``pid``'s number is ``value`` now, in its slot, else a free one (an ended process
        keeps its slot until :meth:`reap` reads it); not kept where no slot is free."""
        pids = list(self.pids)
        i = pids.index(pid) if pid in pids else pids.index(0) if 0 in pids else None
        if i is not None:
            self.pids[i], self.values[i] = pid, value

    def mark(self, value: int) -> None:
        """This process's number is ``value`` now (:meth:`set` under the lock)."""
        with self.lock:
            self.set(os.getpid(), value)

    def reap(self) -> list[int]:
        """The numbers of the processes that have ended, their slots freed."""
        gone = [i for i, pid in enumerate(self.pids) if pid and not process_alive(pid)]
        values = [self.values[i] for i in gone]
        for i in gone:
            self.pids[i] = self.values[i] = 0
        return values

    def others(self, pid: int) -> int:
        """The sum of the numbers of every process but ``pid``."""
        return sum(v for p, v in zip(self.pids, self.values) if p and p != pid)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a signal 0 reaches it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
