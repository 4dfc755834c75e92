"""report.html and trace.json.gz written by a forked process while the summary is made
(clustersim.output.background): the same bytes as written in one process, the parent taking
over when the child fails, and nothing left behind when the run fails."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from clustersim import api
from clustersim.analysis import invariants as inv
from clustersim.analysis.invariants import Violation
from clustersim.cli import EXIT_INVARIANT, main
from clustersim.output import background

from .conftest import ROOT, scenario_dict
from .test_cli import write_scenario

needs_fork = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the writer forks on Linux only")


def _outputs(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _spy_writers(monkeypatch) -> list:
    """Record every Writer started, and how it ended ('finished' True/False, or 'cancelled')."""
    seen = []
    start, finish, cancel = background.start, background.Writer.finish, background.Writer.cancel

    def spy_start(*a, **k):
        w = start(*a, **k)
        seen.append([w, None])
        return w

    def spy_finish(self, summary):
        ok = finish(self, summary)
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
    forked, alone = _outputs(tmp_path / "forked"), _outputs(tmp_path / "alone")
    assert sorted(forked) == ["report.html", "summary.json", "trace.json.gz"]
    assert forked == alone
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # temp folders gone


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
    assert _outputs(tmp_path / "out") == _outputs(tmp_path / "ref")  # ... and the parent wrote them


@needs_fork
def test_a_broken_invariant_stops_the_writer_and_leaves_nothing(tmp_path, monkeypatch, capsys):
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
    """The writer runs before the summary exists: every event is written and compressed and
    the timeline's bars are made before it asks; the files are those of the plain writers."""
    from clustersim.output import perfetto, report

    events = []
    for module, name in ((perfetto, "prepare_trace"), (report, "prepare_report")):
        def spy(*a, _f=getattr(module, name), _name=name, **k):
            finish = _f(*a, **k)
            events.append(_name)
            return finish
        monkeypatch.setattr(module, name, spy)

    def summary():
        events.append("summary")
        return small_result.summary

    background.write_files(tmp_path, small_result.trace, summary, report=True, trace_file=True)
    assert events == ["prepare_trace", "prepare_report", "summary"]
    perfetto.write_trace(tmp_path / "plain.json.gz", small_result.trace, small_result.summary)
    report.write_report(tmp_path / "plain.html", small_result.trace, small_result.summary)
    assert (tmp_path / "trace.json.gz").read_bytes() == (tmp_path / "plain.json.gz").read_bytes()
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
    with pytest.raises(KeyboardInterrupt):
        main(["run", str(sc), "--out", str(tmp_path / "out")])
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
    hooked = api.simulate(scenario, after_run=lambda trace: seen.append(list(trace.links)))
    plain = api.simulate(scenario)
    assert seen == [[]] and len(plain.trace.links) > 1000
    assert hooked.trace.links == plain.trace.links and hooked.summary == plain.summary
