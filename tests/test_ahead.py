"""The shorter step of a repeated step simulated by a forked process while the parent lowers
the whole step (clustersim.engine.ahead): the same result as one process makes, whether the
child finishes, fails before or after sending its spans, or finds no cycle."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from clustersim import api
from clustersim.config import load_scenario
from clustersim.engine import ahead as ahead_mod
from clustersim.engine import repeat
from clustersim.forking import can_fork
from tests.test_repeat import ROOT, plan

pytestmark = pytest.mark.skipif(not can_fork(), reason="needs fork (Linux, one thread)")

FIELDS = ("rank", "stream", "start_s", "end_s", "tid", "mb", "form")


@pytest.fixture
def forks(monkeypatch):
    """The children :meth:`Ahead.start` made, and the Ahead objects, to check on afterwards."""
    made: list[tuple[ahead_mod.Ahead, int]] = []
    start = ahead_mod.Ahead.start

    def recording(self):
        start(self)
        made.append((self, self.pid))

    monkeypatch.setattr(ahead_mod.Ahead, "start", recording)
    return made


def _simulate(fork: bool, links_after: bool = False):
    """simulate() as clustersim run calls it (``links_after``: the link use asked for by the
    summary, last) or as the API does by default (worked out with the run)."""
    sc = load_scenario(plan(), base_dir=ROOT)
    after = (lambda trace, link_use, checks: None) if links_after else None
    return api.simulate(sc, fork=fork, after_run=after)


def _same(a, b) -> None:
    assert json.dumps(a.summary, sort_keys=True) == json.dumps(b.summary, sort_keys=True)
    for f in FIELDS:
        assert np.array_equal(getattr(a.trace.base, f), getattr(b.trace.base, f)), f
    assert a.trace.links == b.trace.links and a.trace.links


def _gone(forks) -> None:
    """Exactly one child was forked, and it has been waited for."""
    assert len(forks) == 1
    ahead, pid = forks[0]
    assert pid > 0 and ahead.pid == -1
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


@pytest.mark.parametrize("links_after", [False, True], ids=["links-with-run", "links-last"])
def test_the_forked_shorter_run_gives_the_same_step(forks, links_after):
    one = _simulate(False, links_after)
    assert not forks
    two = _simulate(True, links_after)
    _gone(forks)
    assert two.summary["simulation"]["repeat"]["cycles_copied"] > 0
    _same(one, two)


def test_a_child_that_fails_before_its_spans_leaves_the_run_here(forks, monkeypatch):
    one = _simulate(False)

    def fails(*a, **k):
        raise RuntimeError("the child fails")

    monkeypatch.setattr(api, "_shorter_run", fails)  # (only the child calls it)
    two = _simulate(True)
    _gone(forks)
    _same(one, two)


@pytest.mark.parametrize("links_after", [False, True], ids=["links-with-run", "links-last"])
def test_a_child_that_fails_after_its_spans_leaves_the_link_use_here(forks, monkeypatch, links_after):
    one = _simulate(False, links_after)

    def fails(links):
        raise RuntimeError("the child fails")

    monkeypatch.setattr(ahead_mod, "link_columns", fails)  # (only the child calls it)
    two = _simulate(True, links_after)
    _gone(forks)
    _same(one, two)


def test_a_step_end_the_parent_does_not_confirm_is_worked_over_again(forks, monkeypatch):
    """The child works the link use out over the end it expects the splice to give the step
    (``repeat.spliced_end_s``) before the parent's end comes; where the two differ, it works
    it out again over the parent's: the same link use as one process."""
    one = _simulate(False, links_after=True)
    monkeypatch.setattr(ahead_mod, "spliced_end_s", lambda base, rep: 1.5 * repeat.spliced_end_s(base, rep))
    two = _simulate(True, links_after=True)
    _gone(forks)
    _same(one, two)


def test_spans_that_do_not_splice_leave_the_whole_step_here(forks, monkeypatch):
    """The child's spans came, but do not splice: the parent simulates the whole step and
    tells the child it needs no link use."""
    monkeypatch.setattr(repeat, "splice", lambda *a, **k: None)
    one = _simulate(False)
    two = _simulate(True)
    _gone(forks)
    assert two.summary["simulation"]["repeat"] is None
    _same(one, two)


def test_a_fork_that_fails_leaves_the_run_here_and_no_pipe_open(forks, monkeypatch):
    """os.fork can fail (memory, a process limit): no child, the run made here, the pipes made
    for it closed again."""
    one = _simulate(False)

    def no_fork():
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(os, "fork", no_fork)
    open_before = sorted(os.listdir("/proc/self/fd"))
    two = _simulate(True)
    assert sorted(os.listdir("/proc/self/fd")) == open_before
    assert len(forks) == 1 and forks[0][1] == -1  # asked to fork; none made
    _same(one, two)


def test_a_child_that_finds_no_cycle_leaves_the_whole_step_here(forks, monkeypatch):
    monkeypatch.setattr(repeat, "find_cycle", lambda *a, **k: None)
    one = _simulate(False)
    two = _simulate(True)
    _gone(forks)
    tried = api.shorter_step(load_scenario(plan(), base_dir=ROOT)).microbatches
    assert two.summary["simulation"]["repeat"] is None and two.summary["simulation"]["repeat_tried"] == tried
    _same(one, two)


def test_no_fork_without_a_shorter_step(forks):
    sc = load_scenario(plan(), base_dir=ROOT)
    r = api.simulate(sc, fork=True, repeat=False)
    assert not forks and r.summary["simulation"]["repeat"] is None


def test_an_interrupt_while_the_child_runs_stops_it_and_writes_nothing(forks, monkeypatch, tmp_path, capsys):
    """Ctrl-C in the parent while the child simulates: ``clustersim run`` exits with 130,
    saying so on one line, the child is stopped and waited for, and no file or folder is left."""
    from clustersim.cli import EXIT_INTERRUPTED, main
    from tests.test_cli import write_scenario

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(api, "_warm", interrupted)  # (the parent's, while the child runs)
    sc = write_scenario(tmp_path, ROOT, plan())
    (tmp_path / "kept").mkdir()
    try:
        code = main(["run", str(sc), "--out", str(tmp_path / "kept" / "out")])
    except KeyboardInterrupt:  # (not let through to pytest, which would stop the session)
        pytest.fail("the interrupt went through clustersim run")
    assert code == EXIT_INTERRUPTED
    assert capsys.readouterr().err.strip() == "interrupted: no outputs written"
    _gone(forks)
    assert list((tmp_path / "kept").iterdir()) == []


def test_a_schedule_that_does_not_check_stops_the_child(forks, tmp_path, capsys):
    """clustersim run forks before the whole step's schedule is checked (load_scenario leaves
    that check to simulate): a plan that fails it still exits with 2 and one line naming the
    field, the child stopped and waited for, nothing written."""
    from clustersim.cli import EXIT_BAD_INPUT, main
    from tests.test_cli import write_scenario

    d = plan(parallel={"layers_per_stage": [2, 2, 4]})  # 3 entries for 4 stages
    sc = write_scenario(tmp_path, ROOT, d)
    assert main(["run", str(sc), "--out", str(tmp_path / "out")]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "parallel.layers_per_stage" in err and "\n" not in err
    _gone(forks)
    assert not (tmp_path / "out").exists()


def test_the_child_dies_with_its_parent(tmp_path):
    """A parent killed outright (SIGKILL: no cleanup runs) takes the child with it at once,
    rather than leaving it to simulate on until a closed pipe says so."""
    import signal
    import subprocess
    import sys
    import time

    code = f"""
import sys, time
sys.path.insert(0, {str(ROOT)!r})
from clustersim import api
from clustersim.config import load_scenario
from clustersim.engine import ahead
from tests.test_repeat import ROOT, plan

def slow(*a, **k):  # the child's work, long enough to outlive its parent
    time.sleep(60)

api._shorter_run = slow
start = ahead.Ahead.start

def started(self):
    start(self)
    print(self.pid, flush=True)
    time.sleep(60)  # the parent, killed here

ahead.Ahead.start = started
api.simulate(load_scenario(plan(), base_dir=ROOT), fork=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        child = int(proc.stdout.readline())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def alive() -> bool:
        try:
            with open(f"/proc/{child}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has died
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 5
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    still = alive()
    if still:
        os.kill(child, signal.SIGKILL)  # (not left behind by a failing test)
    assert not still


def test_no_fork_while_other_threads_run(forks):
    """A lock another thread holds at the fork would stay held in the child: with another
    thread running, nothing is forked and the run is made here, the same."""
    import threading

    one = _simulate(False)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        two = _simulate(True)
    finally:
        stop.set()
        other.join()
    assert not forks or all(pid == -1 for _, pid in forks)
    _same(one, two)
