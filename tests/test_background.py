"""report.html and trace.json.gz written by a forked process while the summary is made
(clustersim.output.background): the same bytes as written in one process, the parent taking
over when the child fails, and nothing left behind when the run fails."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

import clustersim
from clustersim import api
from clustersim.analysis import invariants as inv
from clustersim.analysis.invariants import Violation
from clustersim.cli import EXIT_INTERRUPTED, EXIT_INVARIANT, main
from clustersim.output import background

from .conftest import ROOT, file_bytes, files_of, scenario_dict
from .test_cli import write_scenario

needs_fork = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the writer forks on Linux only")


def _spy_writers(monkeypatch) -> list:
    """Record every Writer started, and how it ended ('finished' True/False, or 'cancelled')."""
    seen = []
    start, finish, cancel = background.start, background.Writer.finish, background.Writer.cancel

    def spy_start(*a, **k):
        w = start(*a, **k)
        seen.append([w, None])
        return w

    def spy_finish(self, summary, trace):
        ok = finish(self, summary, trace)
        seen[-1][1] = ok
        return ok

    def spy_cancel(self):
        if not self.done:
            seen[-1][1] = "cancelled"
        cancel(self)

    monkeypatch.setattr(background, "start", spy_start)
    monkeypatch.setattr(background.Writer, "finish", spy_finish)
    monkeypatch.setattr(background.Writer, "cancel", spy_cancel)
    return seen


@needs_fork
def test_forked_writer_gives_the_same_files_as_one_process(tmp_path, monkeypatch):
    sc = write_scenario(tmp_path, ROOT, scenario_dict())
    seen = _spy_writers(monkeypatch)
    assert main(["run", str(sc), "--out", str(tmp_path / "forked")]) == 0
    assert len(seen) == 1 and seen[0][0] is not None and seen[0][1] is True  # the child wrote them
    monkeypatch.setattr(sys, "platform", "win32")  # as off Linux: the parent writes them itself
    assert main(["run", str(sc), "--out", str(tmp_path / "alone")]) == 0
    assert seen[1][0] is None
    forked, alone = files_of(tmp_path / "forked"), files_of(tmp_path / "alone")
    assert sorted(forked) == ["report.html", "summary.json", "trace.json.gz"]
    assert forked == alone
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # temp folders gone


@needs_fork
def test_parent_and_writer_share_the_trace_files_pieces(tmp_path, monkeypatch):
    """The parent, once its summary is written, compresses pieces of the trace file from the
    back while the writer takes them from the front (background.Share): with every piece
    made slow on both sides (the parent's summary of this small step is done long before the
    writer could finish alone), each side takes some, and the files are those one process
    writes."""
    from clustersim.output import perfetto

    sc = write_scenario(tmp_path, ROOT, scenario_dict())
    monkeypatch.setattr(perfetto, "PIECE_SPANS", 4)  # many pieces from a small step
    packed = perfetto.TracePieces.packed

    def slow(self, k):
        time.sleep(0.03)
        return packed(self, k)

    monkeypatch.setattr(perfetto.TracePieces, "packed", slow)
    taken = []
    take = background.Writer._take_pieces
    monkeypatch.setattr(background.Writer, "_take_pieces", lambda self, trace: taken.append(take(self, trace))
                        or taken[-1])
    seen = _spy_writers(monkeypatch)
    assert main(["run", str(sc), "--out", str(tmp_path / "shared")]) == 0
    assert seen[0][1] is True  # the writer put the file together
    count = perfetto.piece_count(clustersim.simulate(sc).trace)
    assert count > 10 and 0 < len(taken[0]) < count  # each side compressed some
    assert sorted(taken[0]) == list(range(count - len(taken[0]), count))  # the parent's: from the back
    monkeypatch.setattr(sys, "platform", "win32")  # one process writes everything
    assert main(["run", str(sc), "--out", str(tmp_path / "alone")]) == 0
    assert files_of(tmp_path / "shared") == files_of(tmp_path / "alone")
    assert [p.name for p in (tmp_path / "shared").iterdir() if p.name.startswith(".")] == []


def test_pieces_are_taken_once_from_either_end(tmp_path):
    share = background.Share(tmp_path, 7)
    try:
        got = [share.take(front) for front in (True, False, False, True, True, False, True, True, False)]
    finally:
        share.close()
    assert got == [0, 6, 5, 1, 2, 4, 3, None, None]
    assert not (tmp_path / background.CLAIMS_FILE).exists()


@needs_fork
def test_the_writer_works_out_the_link_use_for_the_summary(tmp_path, monkeypatch):
    """The writer works out the link use first and hands it to the parent's summary
    (Writer.links); where it fails before that, or the cluster has PARENT_LINK_USE_GPUS or
    more, the parent works it out itself: the same summary either way, and the same as in one
    process."""
    from clustersim.engine import Engine

    sc = write_scenario(tmp_path, ROOT, scenario_dict())
    handed = []
    links = background.Writer.links
    monkeypatch.setattr(background.Writer, "links", lambda self: handed.append(links(self)) or handed[-1])
    assert main(["run", str(sc), "--out", str(tmp_path / "forked")]) == 0
    assert handed and handed[0] and all(u.bytes > 0 for u in handed[0])  # the child's
    parent, link_use = os.getpid(), Engine.link_use

    def fails_in_the_child(self):
        if os.getpid() != parent:
            raise RuntimeError("planted failure in the writer's link use")
        return link_use(self)

    monkeypatch.setattr(Engine, "link_use", fails_in_the_child)
    assert main(["run", str(sc), "--out", str(tmp_path / "failed")]) == 0
    assert handed[1] is None  # none from the child: the parent's own
    monkeypatch.setattr(Engine, "link_use", link_use)
    # from PARENT_LINK_USE_GPUS on the parent works it out itself, the writer not asked
    monkeypatch.setattr(background, "PARENT_LINK_USE_GPUS", 0)
    assert main(["run", str(sc), "--out", str(tmp_path / "parents")]) == 0
    assert handed[2] is None
    monkeypatch.setattr(sys, "platform", "win32")
    assert main(["run", str(sc), "--out", str(tmp_path / "alone")]) == 0
    assert files_of(tmp_path / "forked") == files_of(tmp_path / "failed") == files_of(tmp_path / "parents") \
        == files_of(tmp_path / "alone")


def test_link_use_the_writer_said_was_there_but_is_gone_is_worked_out_here(tmp_path):
    """The output folder deleted once the writer has said its link use is there: None (the
    parent works it out, and its files then say the folder is gone), not a FileNotFoundError
    traceback from the summary."""
    r, w = os.pipe()
    os.write(w, b"l")
    os.close(w)
    assert background.Writer(tmp_path / "gone", 0, None, links_fd=r).links() is None


@needs_fork
def test_parent_writes_the_files_when_the_child_fails(tmp_path, monkeypatch):
    sc = write_scenario(tmp_path, ROOT, scenario_dict())
    assert main(["run", str(sc), "--out", str(tmp_path / "ref")]) == 0
    parent = os.getpid()
    write = background.write_files

    def fails_in_the_child(*a, **k):
        if os.getpid() != parent:
            raise RuntimeError("planted failure in the writer process")
        write(*a, **k)

    monkeypatch.setattr(background, "write_files", fails_in_the_child)
    seen = _spy_writers(monkeypatch)
    assert main(["run", str(sc), "--out", str(tmp_path / "out")]) == 0
    assert seen[0][1] is False  # the child failed ...
    assert files_of(tmp_path / "out") == files_of(tmp_path / "ref")  # ... and the parent wrote them


def _checks_go_to(monkeypatch, writer: bool) -> None:
    """Whoever asks, the checks that need no summary go to the writer (or to the parent):
    which of the two asks first depends on the machine's speed."""
    to_writer = writer
    monkeypatch.setattr(background.Share, "take_checks", lambda self, writer: writer == to_writer)


@needs_fork
def test_a_broken_invariant_stops_the_writer_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    _checks_go_to(monkeypatch, writer=False)
    monkeypatch.setattr(inv, "check_invariants",
                        lambda program, trace, summary=None, cols=None: [Violation("collective-sync", "planted",
                                                                                   trace.spans[:2])])
    seen = _spy_writers(monkeypatch)
    sc = write_scenario(tmp_path, ROOT, scenario_dict())
    out = tmp_path / "new" / "deeper" / "out"
    assert main(["run", str(sc), "--out", str(out)]) == EXIT_INVARIANT
    assert seen and seen[0][1] == "cancelled"
    assert not (tmp_path / "new").exists()  # neither files nor the folders made for them
    assert "planted" in capsys.readouterr().err


def test_the_checks_go_to_the_first_to_ask_and_stay_there(tmp_path):
    """Share.take_checks gives the checks to the first of the two processes that asks; the
    parent's answer (Writer.checks_taken) stays what it was when asked again."""
    for writer_first in (True, False):
        folder = tmp_path / str(writer_first)
        folder.mkdir()
        share = background.Share(folder, 4)
        w = background.Writer(folder, pid=0, signal_fd=-1, share=share, checks=True)
        if writer_first:
            assert share.take_checks(writer=True)
        assert w.checks_taken() is writer_first and w.checks_taken() is writer_first
        assert not share.take_checks(writer=True) and not share.take_checks(writer=False)
        assert share.take(front=True) == 0 and share.take(front=False) == 3  # the pieces' counters untouched
        share.close()
    unoffered = background.Writer(tmp_path, pid=0, signal_fd=-1, share=None, checks=True)
    assert unoffered.checks_taken() is False


@needs_fork
def test_a_broken_invariant_the_writer_finds_leaves_nothing(tmp_path, monkeypatch, capsys):
    """The writer took the checks that need no summary (it got to them first) and found a
    violation: the parent, whose own checks passed, says so once the writer is done; the
    files stay unwritten."""
    _checks_go_to(monkeypatch, writer=True)
    parent = os.getpid()
    real = inv.check_trace

    def planted(program, trace, cols=None):
        if os.getpid() == parent:
            raise AssertionError("the parent ran the writer's checks")
        return [Violation("dependency-order", "planted in the writer", trace.spans[:1])] + real(program, trace, cols)

    monkeypatch.setattr(inv, "check_trace", planted)
    seen = _spy_writers(monkeypatch)
    sc = write_scenario(tmp_path, ROOT, scenario_dict())
    out = tmp_path / "new" / "out"
    assert main(["run", str(sc), "--out", str(out)]) == EXIT_INVARIANT
    assert seen and seen[0][1] is True  # the writer finished (its files were not moved in)
    assert not (tmp_path / "new").exists()
    err = capsys.readouterr().err
    assert "[dependency-order] planted in the writer" in err and "1 invariant violation" in err


@needs_fork
def test_checks_the_writer_took_and_did_not_report_run_in_the_parent(tmp_path, monkeypatch, capsys):
    """The writer took the checks and failed before saying what they found: the parent
    writes the files itself (as on any failure of the writer) and runs those checks too."""
    _checks_go_to(monkeypatch, writer=True)
    parent = os.getpid()
    ran = []

    def dies_in_the_writer(program, trace, cols=None):
        if os.getpid() != parent:
            os._exit(1)
        ran.append(1)
        return [Violation("send-recv", "found by the parent", trace.spans[:1])]

    monkeypatch.setattr(inv, "check_trace", dies_in_the_writer)
    seen = _spy_writers(monkeypatch)
    sc = write_scenario(tmp_path, ROOT, scenario_dict())
    assert main(["run", str(sc), "--out", str(tmp_path / "out")]) == EXIT_INVARIANT
    assert seen[0][1] is False and ran == [1]
    assert not (tmp_path / "out").exists()
    assert "[send-recv] found by the parent" in capsys.readouterr().err


@needs_fork
def test_the_outputs_are_the_same_whoever_runs_the_checks(tmp_path, monkeypatch):
    sc = write_scenario(tmp_path, ROOT, scenario_dict())
    got = {}
    for writer in (True, False):
        with monkeypatch.context() as m:
            _checks_go_to(m, writer)
            out = tmp_path / f"out-{writer}"
            assert main(["run", str(sc), "--out", str(out)]) == 0
            got[writer] = files_of(out)
    assert got[True] == got[False] and set(got[True]) == {"summary.json", "report.html", "trace.json.gz"}


@needs_fork
def test_a_failure_while_summarising_leaves_nothing(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("planted failure in the summary")

    monkeypatch.setattr(api, "summarize", broken)
    seen = _spy_writers(monkeypatch)
    sc = write_scenario(tmp_path, ROOT, scenario_dict())
    (tmp_path / "kept").mkdir()
    out = tmp_path / "kept" / "out"
    with pytest.raises(RuntimeError, match="planted"):
        main(["run", str(sc), "--out", str(out)])
    assert seen and seen[0][1] == "cancelled"
    assert list((tmp_path / "kept").iterdir()) == []  # a folder that was there stays, empty


def test_writer_asks_for_the_summary_after_the_trace_work(small_result, tmp_path, monkeypatch):
    """The writer runs before the summary exists: the timeline's bars are made and every
    piece of the trace file is written and compressed before it asks (in one process, with
    no parent to share the pieces with); the files are those of the plain writers."""
    from clustersim.output import perfetto, report

    events = []
    prepare, packed = report.prepare_report, perfetto.TracePieces.packed

    def spy_prepare(*a, **k):
        events.append("prepare_report")
        return prepare(*a, **k)

    def spy_packed(self, k):
        events.append(f"piece {k}")
        return packed(self, k)

    monkeypatch.setattr(report, "prepare_report", spy_prepare)
    monkeypatch.setattr(perfetto.TracePieces, "packed", spy_packed)

    def summary():
        events.append("summary")
        return small_result.summary

    background.write_files(tmp_path, small_result.trace, summary, report=True, trace_file=True)
    count = perfetto.piece_count(small_result.trace)
    assert events == ["prepare_report", *(f"piece {k}" for k in range(count)), "summary"]
    monkeypatch.undo()
    perfetto.write_trace(tmp_path / "plain.json.gz", small_result.trace, small_result.summary)
    report.write_report(tmp_path / "plain.html", small_result.trace, small_result.summary,
                        (report.SUMMARY_LINK, report.TRACE_LINK))  # (the files run writes beside it)
    assert file_bytes(tmp_path / "trace.json.gz") == file_bytes(tmp_path / "plain.json.gz")
    assert (tmp_path / "report.html").read_bytes() == (tmp_path / "plain.html").read_bytes()


@needs_fork
def test_an_interrupt_while_waiting_stops_the_writer(tmp_path, monkeypatch):
    real_waitpid = os.waitpid
    interrupted = []

    def waitpid(pid, options):
        if not interrupted:  # Ctrl-C while the parent waits for the writer
            interrupted.append(pid)
            raise KeyboardInterrupt
        return real_waitpid(pid, options)

    monkeypatch.setattr(os, "waitpid", waitpid)
    sc = write_scenario(tmp_path, ROOT, scenario_dict())
    try:
        code = main(["run", str(sc), "--out", str(tmp_path / "out")])
    except KeyboardInterrupt:  # (not let through to pytest, which would stop the session)
        pytest.fail("the interrupt went through clustersim run")
    assert code == EXIT_INTERRUPTED  # (it says so on one line, no traceback)
    monkeypatch.undo()
    with pytest.raises(ChildProcessError):  # the writer was stopped and reaped
        os.waitpid(interrupted[0], 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.yaml"]  # no files, no temp folder


def test_no_fork_while_other_threads_run(small_result, tmp_path):
    """A lock another thread holds at the fork would stay held in the child: write in-process."""
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert background.start(tmp_path, small_result.trace, report=True, trace_file=True) is None
    finally:
        stop.set()
        other.join()
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def small_result():
    return api.simulate(scenario_dict())


def test_link_use_is_worked_out_after_the_hook_and_is_the_same(root):
    # simulate(after_run=...) forks the writer before the link accounting (the writers do not
    # read it): the hook sees a trace without links, the result has the links the plain run
    # works out inside Engine.run
    seen = []
    scenario = root / "scenarios/moe_1024gpu.yaml"
    hooked = api.simulate(scenario, after_run=lambda trace, link_use, checks: seen.append(list(trace.links)))
    plain = api.simulate(scenario)
    assert seen == [[]] and len(plain.trace.links) > 1000
    assert hooked.trace.links == plain.trace.links and hooked.summary == plain.summary


@needs_fork
def test_a_writer_fork_that_fails_writes_the_files_here(tmp_path, monkeypatch):
    """os.fork can fail (memory, a process limit): the files are written in this process, the
    same bytes, and the pipes and the pieces' counters made for the writer are closed again."""
    sc = write_scenario(tmp_path, ROOT, scenario_dict())
    assert main(["run", str(sc), "--out", str(tmp_path / "forked")]) == 0

    def no_fork():
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", no_fork)
    open_before = sorted(os.listdir("/proc/self/fd"))
    assert main(["run", str(sc), "--out", str(tmp_path / "here")]) == 0
    assert sorted(os.listdir("/proc/self/fd")) == open_before
    assert files_of(tmp_path / "here") == files_of(tmp_path / "forked")
