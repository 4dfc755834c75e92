"""Invariants checked after every simulation: shipped scenarios pass, planted bugs are caught,
and the CLI turns a violation into exit code 3 with nothing written."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

import clustersim.analysis.invariants as inv
from clustersim.analysis.invariants import InvariantError, Violation, check_invariants
from clustersim.api import simulate, summarize
from clustersim.cli import EXIT_INVARIANT, main
from clustersim.config import load_scenario
from clustersim.engine import run_program
from clustersim.program.lower import lower
from clustersim.trace import Trace

from .conftest import ROOT, scenario_dict, shipped_scenarios
from .test_cli import write_scenario

SCENARIOS = shipped_scenarios()


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_shipped_scenario_passes(path):
    sc = load_scenario(path)
    prog, low = lower(sc)
    sim = sc.cfg.simulation
    trace = run_program(prog, sc.cluster, sim.network, sim.collectives.model_dump())
    assert all(s.tid >= 0 for s in trace.spans)
    violations = check_invariants(prog, trace, summarize(sc, low, trace, prog))
    assert violations == [], "\n".join(map(str, violations))


def test_simulate_checks_by_default():
    r = simulate(scenario_dict())  # would raise InvariantError on a violation
    assert r.summary["step_time_s"] > 0


# --- planted violations on a small, fully simulated step --------------------------------
@pytest.fixture(scope="module")
def small():
    """(program, trace, summary) of SMALL with every rank simulated (tp collectives have 4
    simulated members; pp sends have simulated receivers)."""
    sc = load_scenario(scenario_dict())
    prog, low = lower(sc, collapse=False)
    sim = sc.cfg.simulation
    trace = run_program(prog, sc.cluster, sim.network, sim.collectives.model_dump())
    summary = summarize(sc, low, trace, prog)
    assert check_invariants(prog, trace, summary) == []
    return prog, trace, summary


def _copy(trace: Trace) -> Trace:
    return replace(trace, spans=[copy.copy(s) for s in trace.spans])


def _names(violations: list[Violation]) -> set[str]:
    return {v.invariant for v in violations}


def test_overlap_on_a_stream_detected(small):
    prog, trace, summary = small
    t = _copy(trace)
    comp = sorted((s for s in t.spans if s.rank == 0 and s.stream == "compute" and s.dur_s > 0),
                  key=lambda s: s.start_s)
    a, b = comp[0], comp[1]
    shift = (b.start_s - a.end_s) + a.dur_s / 2  # b now starts halfway through a
    b.start_s -= shift
    b.end_s -= shift
    vs = [v for v in check_invariants(prog, t, summary) if v.invariant == "stream-overlap"]
    assert len(vs) == 1
    assert {(s.rank, s.stream, s.start_s) for s in vs[0].spans} == {(0, "compute", a.start_s),
                                                                    (0, "compute", b.start_s)}


def test_overlap_allowed_on_receive_streams(small):
    prog, trace, summary = small
    t = _copy(trace)
    recv = [s for s in t.spans if s.stream == "pp_fwd_recv"]
    recv[1].start_s = recv[0].start_s  # transfers to one rank may overlap
    assert "stream-overlap" not in _names(inv.check_stream_overlap(t))


def test_task_before_its_dependency_detected(small):
    prog, trace, summary = small
    t = _copy(trace)
    own = {s.tid: s for s in t.spans if s.rank == prog.tasks[s.tid].rank and s.stream == prog.tasks[s.tid].stream}
    task = next(x for x in prog.tasks if x.deps and own[x.deps[0]].end_s > 0 and x.stream != "compute")
    dep = own[task.deps[0]]
    own[task.tid].start_s = dep.end_s / 2
    vs = inv.check_dependencies(prog, t)
    assert _names(vs) == {"dependency-order"}
    assert vs[0].spans[0].tid == task.tid and vs[0].spans[1].tid == dep.tid


def test_task_without_span_detected(small):
    prog, trace, summary = small
    t = _copy(trace)
    t.spans = [s for s in t.spans if s.tid != 0]
    assert "dependency-order" in _names(inv.check_dependencies(prog, t))


def test_collective_member_out_of_sync_detected(small):
    prog, trace, summary = small
    t = _copy(trace)
    s = next(s for s in t.spans if s.op == "all_reduce" and len(prog.tasks[s.tid].comm.members) > 1)
    s.end_s += 1e-6
    vs = check_invariants(prog, t, summary)
    assert "collective-sync" in _names(vs)
    v = next(v for v in vs if v.invariant == "collective-sync")
    assert any(x is s for x in v.spans)


def test_checks_see_spans_changed_after_the_summary_read_them(small):
    prog, trace, summary = small
    t = _copy(trace)
    t.columns()  # the summary's view of the spans, remembered on the trace
    s = next(s for s in t.spans if s.op == "all_reduce" and len(prog.tasks[s.tid].comm.members) > 1)
    s.end_s += 1e-6
    assert "collective-sync" in _names(check_invariants(prog, t, summary))


def test_backward_before_forward_detected(small):
    prog, trace, summary = small
    t = _copy(trace)
    b = next(s for s in t.spans if s.kind == "compute" and s.phase == "B" and s.mb == 1 and s.stage == 1)
    b.start_s, b.end_s = 0.0, 1e-9
    vs = inv.check_phase_order(t)
    assert _names(vs) == {"phase-order"}
    assert any(x is b for x in vs[0].spans)


def test_weight_gradient_before_backward_detected():
    d = scenario_dict(parallel={"schedule": "zb-h1"})
    sc = load_scenario(d)
    prog, low = lower(sc)
    trace = run_program(prog, sc.cluster, sc.cfg.simulation.network, sc.cfg.simulation.collectives.model_dump())
    assert inv.check_phase_order(trace) == []
    w = next(s for s in trace.spans if s.kind == "compute" and s.phase == "W" and s.mb == 0)
    bs = [s for s in trace.spans if s.kind == "compute" and s.phase == "B" and s.mb == 0 and s.stage == w.stage]
    w.start_s = min(s.start_s for s in bs)
    assert _names(inv.check_phase_order(trace)) == {"phase-order"}



def test_embedding_weight_gradient_before_layer_0_backward_detected():
    """The embedding's W has no B of its own: it reads layer 0's input gradient, so it must
    start after layer 0's B ends (ZB-H1, rank 0, microbatch 0, its W moved to right after
    the microbatch's forward)."""
    r = simulate(ROOT / "scenarios" / "zero_bubble.yaml")
    t = r.trace
    assert inv.check_phase_order(t) == []
    comp = [s for s in t.spans if s.stream == "compute" and s.rank == 0 and s.mb == 0]
    w = next(s for s in comp if s.name == "W embedding")
    last_f = max(s.end_s for s in comp if s.phase == "F")
    w.start_s, w.end_s = last_f, last_f + (w.end_s - w.start_s)
    vs = inv.check_phase_order(t)
    assert _names(vs) == {"phase-order"} and any(x is w for v in vs for x in v.spans)

def test_dropped_receive_detected(small):
    prog, trace, summary = small
    t = _copy(trace)
    drop = next(s for s in t.spans if s.stream == "pp_bwd_recv")
    t.spans = [s for s in t.spans if s is not drop]
    vs = check_invariants(prog, t, summary)
    assert _names(vs) == {"send-recv"}
    assert vs[0].spans[0].tid == drop.tid and vs[0].spans[0].stream == "pp_bwd_send"


def test_receive_with_other_bytes_or_time_detected(small):
    prog, trace, summary = small
    for field, delta in (("size_bytes", 1.0), ("end_s", 1e-6)):
        t = _copy(trace)
        r = next(s for s in t.spans if s.stream == "pp_fwd_recv")
        setattr(r, field, getattr(r, field) + delta)
        assert "send-recv" in _names(inv.check_send_recv(prog, t)), field


def test_step_time_below_compute_detected(small):
    prog, trace, summary = small
    bad = dict(summary, step_time_s=summary["compute_s"] / 2)
    vs = check_invariants(prog, trace, bad)
    assert _names(vs) == {"step-time", "critical-path"}  # the path no longer matches the step either
    assert vs[0].spans and all(s.kind == "compute" for s in vs[0].spans)


def test_a_wrong_map_of_gpus_to_simulated_ranks_is_detected():
    """``simulation.simulated_rank_of_gpu``: GPUs swapped between two stages' ranks (the counts
    still agree with the weights), a GPU mapped to a rank not simulated, a simulated rank
    mapped to another, a map of another length."""
    sc = load_scenario(scenario_dict())
    prog, low = lower(sc)  # collapsed
    sim = sc.cfg.simulation
    trace = run_program(prog, sc.cluster, sim.network, sim.collectives.model_dump())
    summary = summarize(sc, low, trace, prog)
    rep = summary["simulation"]["simulated_rank_of_gpu"]
    assert inv.check_rank_map(trace, summary) == [] and len(set(rep)) == 2 < len(rep)  # TP4 x PP2 x DP2: 2 ranks
    a, b = rep.index(trace.ranks[0], 1), rep.index(trace.ranks[1], trace.ranks[1] + 1)  # a twin of each stage
    for change, words in (({a: rep[b], b: rep[a]}, "2 GPUs stand with a rank of another pipeline stage"),
                          ({a: 5}, "ranks not simulated: [5]"), ({trace.ranks[1]: trace.ranks[0]}, "stand with another"),
                          (None, "GPUs mapped for a world of")):
        bad = copy.deepcopy(summary)
        m = bad["simulation"]["simulated_rank_of_gpu"]
        if change is None:
            m.pop()
        else:
            for g, r in change.items():
                m[g] = r
        vs = check_invariants(prog, trace, bad)
        assert "rank-map" in _names(vs) and any(words in v.message for v in vs), (change, [str(v) for v in vs])


def test_memory_violations_detected(small):
    prog, trace, summary = small
    for change in ({"peak_bytes": 0.0}, {"optimizer_bytes": -1.0, "params_bytes": -1.0}):
        bad = copy.deepcopy(summary)
        bad["memory"]["stages"][1].update(change)
        vs = inv.check_memory(bad)
        assert _names(vs) == {"memory"} and "stage 1" in vs[0].message, change


def test_memory_timeline_violations_detected(small):
    prog, trace, summary = small
    bad = copy.deepcopy(summary)
    tl = bad["memory"]["stages"][0]["timeline"]
    tl["activations_bytes"] = [0.5 * x for x in tl["activations_bytes"]]  # no longer reaches the peak
    vs = inv.check_memory(bad)
    assert _names(vs) == {"memory"} and "timeline" in vs[0].message
    bad = copy.deepcopy(summary)
    bad["memory"]["stages"][1]["timeline"]["comm_buffers_bytes"][0] = -1.0
    assert any("negative" in v.message for v in inv.check_memory(bad))


def test_critical_path_and_bubble_split_violations_detected(small):
    prog, trace, summary = small
    bad = copy.deepcopy(summary)
    bad["critical_path"]["wait_s"] = 1e-3
    assert _names(inv.check_critical_path(bad)) == {"critical-path"}
    bad = copy.deepcopy(summary)
    bad["critical_path"]["length_s"] *= 0.99
    assert _names(inv.check_critical_path(bad)) == {"critical-path"}
    bad = copy.deepcopy(summary)
    row = bad["bubble"]["per_rank"][1]
    row["warm_up_s"] += 1e-3
    vs = inv.check_bubble_split(bad)
    assert _names(vs) == {"bubble-split"} and f"rank {row['rank']}" in vs[0].message
    bad = copy.deepcopy(summary)
    row = bad["bubble"]["per_rank"][0]
    row["imbalance_s"], row["warm_up_s"] = -1.0, row["warm_up_s"] + 1.0  # sums right, one part negative
    assert _names(inv.check_bubble_split(bad)) == {"bubble-split"}


def test_error_lists_invariant_and_at_most_three_spans(small):
    prog, trace, summary = small
    v = Violation("stream-overlap", "planted", trace.spans[:5])
    v = inv._v(v.invariant, v.message, v.spans)
    assert len(v.spans) == 3
    err = InvariantError([v])
    text = str(err)
    assert "[stream-overlap] planted" in text and "1 invariant violation" in text
    s = trace.spans[0]
    assert f"rank {s.rank} stream {s.stream!r} {s.name!r}" in text
    assert err.violations == [v]


def test_simulate_raises_on_violation(monkeypatch):
    monkeypatch.setattr(inv, "check_invariants", lambda *a, **k: [Violation("memory", "planted")])
    with pytest.raises(InvariantError) as ei:
        simulate(scenario_dict())
    assert ei.value.violations[0].invariant == "memory"
    simulate(scenario_dict(), check=False)  # skipped: no error


# --- the command line --------------------------------------------------------------------
def _planted(monkeypatch):
    calls = []

    def fake(program, trace, summary=None, cols=None):
        calls.append(1)
        return [Violation("collective-sync", "planted violation", trace.spans[:2])]

    monkeypatch.setattr(inv, "check_invariants", fake)
    return calls


def test_cli_exit_3_and_no_outputs_on_violation(tmp_path, monkeypatch, capsys):
    calls = _planted(monkeypatch)
    sc = write_scenario(tmp_path, ROOT, scenario_dict())
    out = tmp_path / "out"
    rc = main(["run", str(sc), "--out", str(out), "--no-report", "--no-trace"])
    assert rc == EXIT_INVARIANT == 3
    assert calls
    err = capsys.readouterr().err
    assert "invariant violation" in err and "[collective-sync] planted violation" in err
    assert "Traceback" not in err
    assert not (out / "summary.json").exists()


def test_simulate_hands_the_checks_the_summarys_view(monkeypatch):
    seen = []

    def spy(program, trace, summary=None, cols=None):
        seen.append(cols is not None and cols is trace.columns() and cols.spans is trace.span_rows())
        return []

    monkeypatch.setattr(inv, "check_invariants", spy)
    simulate(scenario_dict())
    assert seen == [True]


def test_cli_no_check_skips_the_checks(tmp_path, monkeypatch, capsys):
    calls = _planted(monkeypatch)
    sc = write_scenario(tmp_path, ROOT, scenario_dict())
    out = tmp_path / "out"
    rc = main(["run", str(sc), "--out", str(out), "--no-report", "--no-trace", "--no-check"])
    assert rc == 0
    assert not calls
    assert (out / "summary.json").is_file()


def test_checks_judge_the_view_they_are_given(small):
    """simulate() hands the checks the columns the summary was made from; given a view, the
    checks judge that view (here of spans with a dependency broken), not the spans read anew."""
    from clustersim.analysis.columns import SpanColumns

    prog, trace, summary = small
    assert check_invariants(prog, trace, summary) == []
    bad = _copy(trace)
    own = {s.tid: s for s in bad.spans if s.rank == prog.tasks[s.tid].rank and s.stream == prog.tasks[s.tid].stream}
    task = next(x for x in prog.tasks if x.deps and own[x.deps[0]].end_s > 0 and x.stream != "compute")
    own[task.tid].start_s = own[task.deps[0]].end_s / 2
    bad_view = SpanColumns(bad.spans, bad.ranks)
    assert "dependency-order" in _names(check_invariants(prog, bad, summary, cols=bad_view))
    assert check_invariants(prog, trace, summary, cols=SpanColumns(trace.spans, trace.ranks)) == []
    # a view that does not hold the spans' own values is itself the violation
    vs = check_invariants(prog, trace, summary, cols=bad_view)
    assert _names(vs) == {"view"} and vs[0].spans[0].tid == task.tid
