"""The shorter step of a repeated step, simulated by a forked process while the parent lowers
the whole step.

A long 1F1B, interleaved, ZB-H1, ZB-V, DualPipeV or DualPipe step (Megatron-1T: 512
microbatches) is simulated as a shorter step whose cycle is copied in
(:mod:`clustersim.engine.repeat`). Only
the splice needs both steps, so ``clustersim run`` forks as soon as the scenario is read,
before even the whole step's schedule is built: the child builds the shorter step's schedule,
lowers it, sets its engine up, runs it and finds its cycle, while the parent checks the whole
step's schedule, lowers the whole step, lowers the shorter step too (resumed where the two
lowerings part: program.lower._Parting) and sets up an engine on it that does not run (the
summary reads only what a set-up decides of it: algorithms, the links a channel has alone,
the census), and works out the task columns the splice and the summary read::

    parent  ─fork─[whole schedule][lower the whole step][shorter step][set-up][task columns] wait [splice]─fork writer─[summary ....][links]
    child         └[shorter schedule][lower the shorter step][set-up][run ..............][cycle][link use]
                                                                        spans, cycle ──→   ←── step end     ──→

The child sends the shorter step's spans (:class:`~clustersim.trace.SpanBase`: its columns,
pickled) and its cycle (:class:`~clustersim.engine.repeat.Repeat`); the parent splices them
into the whole step's trace as it would its own run's. Meanwhile the child, which holds the
run's records of communications, works out the link use over the end the splice gives the
step (:func:`~clustersim.engine.repeat.spliced_end_s`, from its spans and cycle alone); the
parent sends back the spliced step's end, which confirms it (where it does not, the child
works the link use out again over that end), and the summary asks for it last
(:meth:`Ahead.links`). The two processes run the same
code on the same program (a shorter step lowered from scratch and one resumed from the
whole step's lowering are the same tasks and ids: tests/test_repeat.py), so the trace is
the one a single process makes. On Megatron-1T the two sides take about as long, where they
ran one after the other, and the writer no longer works out the link use
(docs/performance.md, "Where the rest is").

Nothing is forked where there is no shorter step (the parent simulates the whole step), off
Linux, with other Python threads running (as for the writer: clustersim.output.background),
or where the fork itself fails; then, and where the child fails before sending its spans,
the parent simulates the shorter step itself. Where the child finds no cycle, or its spans
do not splice, the parent simulates the whole step, as it would have. Where the child fails
after sending its spans, the parent runs its own engine for the link use. Where the whole
step's schedule does not check, the parent stops the child and says so (``ConfigError``).
Nothing the child does is written anywhere.

The parent must send the step's end (:meth:`Ahead.step_end`, which closes its end of that
pipe) before it forks any other process: a process forked while that end is open would keep
it open, and the child would wait on it for ever.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..forking import can_fork, ctrl_c_held, fork_with_pipes, release
from ..trace import LinkUse, SpanBase, link_columns, links_of_columns
from .repeat import spliced_end_s

if TYPE_CHECKING:
    from .repeat import Repeat
    from .sim import Engine

_PR_SET_PDEATHSIG = 1  # prctl's option (linux/prctl.h)
_LENGTH = struct.Struct("<q")  # a message's length, before its bytes
_STEP_S = struct.Struct("<d")  # the spliced step's end in seconds, parent to child


class Ahead:
    """The forked process that simulates the shorter step, from the parent's side.

    ``work``: run in the child; gives (the engine that ran the shorter step, its spans, its
    cycle, a longer cycle's length), the spans and the cycle None where no cycle holds
    (:func:`clustersim.api._cycle`)."""

    def __init__(self, work: Callable[[], tuple[Engine, SpanBase | None, Repeat | None, int | None]]):
        self._work = work
        self.forked = False  # once: a second start forks nothing
        self.pid = -1  # the child, while it is not waited for
        self._from = -1  # the child's messages: spans and cycle, then the link use
        self._to = -1  # the spliced step's end, for the child

    @property
    def running(self) -> bool:
        """Whether a child was forked and has not been waited for."""
        return self.pid >= 0

    def start(self) -> None:
        """Fork the child (once, where a fork is safe and succeeds, Ctrl-C held back around it:
        clustersim.forking); it never returns into the caller."""
        if self.forked or not can_fork():
            return
        self.forked = True
        parent = os.getpid()
        forked = fork_with_pipes(2)
        if forked is None:  # no pipe or no process to be had (memory, process limits): no child
            return
        pid, (from_r, from_w, to_r, to_w), held = forked
        if pid == 0:
            self._child_process(parent, from_r, from_w, to_r, to_w, held)
        self.pid, self._from, self._to = pid, from_r, to_w
        try:
            os.close(from_w)
            os.close(to_r)
        finally:  # (whatever fails here, Ctrl-C is never left held for the rest of the process)
            release(held)

    def _child_process(self, parent: int, from_r: int, from_w: int, to_r: int, to_w: int, held) -> None:
        """The child's whole life: it leaves by os._exit, which skips the interpreter's
        teardown and the parent's buffered output, and writes nothing but its messages."""
        code = 1
        try:
            _die_with_parent(parent)
            release(held)  # (an interrupt now ends it here)
            os.close(from_r)
            os.close(to_w)
            # nothing of the child's reaches the terminal: the parent says what there is to say
            quiet = os.open(os.devnull, os.O_WRONLY)
            os.dup2(quiet, 1)
            os.dup2(quiet, 2)
            os.close(quiet)
            warnings.simplefilter("ignore")
            self._child(from_w, to_r)
            code = 0
        except BaseException:  # noqa: BLE001 - the parent sees the pipe close and does the work itself
            code = 1
        finally:
            os._exit(code)

    def _child(self, out: int, step_in: int) -> None:
        engine, base, rep, longer = self._work()
        _send(out, (base, rep, None) if rep is not None else (None, None, longer))
        if rep is None:
            return
        # the link use over the end the splice will give the step, worked out while the parent
        # splices (this process would wait otherwise); the end the parent sends confirms it,
        # else it is worked out again over that end
        guess_s = spliced_end_s(base, rep)
        engine.cut_records(rep, guess_s)
        columns = link_columns(engine.link_use())
        step_end_bytes = _read_exactly(step_in, _STEP_S.size)
        if step_end_bytes is None:  # the parent does not need the link use
            return
        (step_s,) = _STEP_S.unpack(step_end_bytes)
        if step_s != guess_s:
            engine.cut_records(rep, step_s)
            columns = link_columns(engine.link_use())
        _send(out, columns)

    def result(self) -> tuple[SpanBase | None, Repeat | None, int | None] | None:
        """In the parent: (the shorter step's spans, its cycle, a longer cycle it held) from
        the child, the first two None where no cycle holds (the third then the length of one
        :func:`~clustersim.engine.repeat.longer_cycle` found, or None); None where there is no
        child or it failed before saying (the caller simulates the shorter step itself)."""
        if self._from < 0:
            return None
        got = _receive(self._from)
        if got is None:
            self.close()
            return None
        if got[1] is None:  # the child is done
            self.close()
        return got

    def step_end(self, step_s: float | None) -> None:
        """In the parent, once the spans are spliced: the spliced step's end, the one the
        child's link use is over (it is worked out again where the child expected another);
        None: the parent does not need it (the splice failed).
        Before any other process is forked (module docstring)."""
        if self._to < 0:
            return
        try:
            if step_s is not None:
                os.write(self._to, _STEP_S.pack(step_s))
        except OSError:  # the child is gone: links() says so
            pass
        finally:
            os.close(self._to)
            self._to = -1
        if step_s is None:
            self.close()

    def links(self) -> list[LinkUse] | None:
        """In the parent, after :meth:`step_end`: the link use the child worked out, or None
        where it did not (the caller works it out)."""
        if self._from < 0:
            return None
        got = _receive(self._from)
        self.close()
        return None if got is None else links_of_columns(got)

    def close(self) -> None:
        """Stop the child if it still runs, and wait for it (the parent is done with it);
        Ctrl-C is held back meanwhile, so that the child is never left unwaited-for."""
        for fd in (self._from, self._to):
            if fd >= 0:
                os.close(fd)
        self._from = self._to = -1
        if self.pid < 0:
            return
        with ctrl_c_held():
            try:
                if os.waitpid(self.pid, os.WNOHANG)[0] == 0:
                    os.kill(self.pid, signal.SIGKILL)
                    os.waitpid(self.pid, 0)
            except (ChildProcessError, ProcessLookupError):  # reaped already (SIGCHLD ignored by the host)
                pass
            finally:
                self.pid = -1


def _die_with_parent(parent: int) -> None:
    """In the child of ``parent``: be killed if the parent dies (Linux's ``PR_SET_PDEATHSIG``),
    rather than simulate on until a closed pipe says so; best effort (a libc without
    ``prctl`` leaves the pipes to say it)."""
    import ctypes  # (here: only a child needs it)

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before that took effect
        os._exit(1)


def _send(fd: int, obj) -> None:
    """``obj`` pickled, after its length."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    for view in (memoryview(_LENGTH.pack(len(data))), memoryview(data)):
        while view:
            view = view[os.write(fd, view):]


def _receive(fd: int):
    """The object :func:`_send` sent, or None where the pipe closed first or the message does
    not read (a child that died while writing it)."""
    head = _read_exactly(fd, _LENGTH.size)
    if head is None:
        return None
    (n,) = _LENGTH.unpack(head)
    data = _read_exactly(fd, n) if n >= 0 else None
    if data is None:
        return None
    try:
        return pickle.loads(data)
    except Exception:  # noqa: BLE001 - a message cut short: as if none came
        return None


def _read_exactly(fd: int, n: int) -> bytearray | None:
    """``n`` bytes from ``fd``, or None where it closes first."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = os.readv(fd, [view[got:]])
        if k == 0:
            return None
        got += k
    return buf
