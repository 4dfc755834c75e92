"""A 1F1B step simulated with its repeating microbatches once (clustersim.engine.repeat) against
the same step simulated whole: the same spans on the same tasks, times within a nanosecond,
the same summary figures; and the checks that refuse a cycle that does not hold."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from clustersim.analysis.columns import TaskColumns
from clustersim.api import simulate, with_microbatches
from clustersim.config import load_scenario
from clustersim.engine import Engine, repeat
from clustersim.program.lower import lower

from .conftest import ROOT, scenario_dict

TIME_S = 1e-9  # what the splice promises: every span within a nanosecond of the full run's
REL = 1e-9


def plan(**over) -> dict:
    """A 1F1B step of 192 microbatches on 4 stages (60 simulated, 132 copied in):
    TP inside a node, PP sends and the DP gradient reduction across nodes (the flow network).
    Every GEMM at one efficiency, a backward exactly twice its forward: by their shapes this
    small model's interleaved steady state repeats every 20 microbatches, which the 8 its
    shorter step leaves out do not hold (simulated whole: bench/steady_state.py shows it)."""
    d = scenario_dict(
        cluster={"topology": "topologies/dgx-h100.yaml", "nodes": 4},
        model={"name": "small", "layers": 8, "hidden": 2048, "heads": 16, "vocab": 32000, "seq_len": 1024},
        parallel={"tp": 2, "pp": 4, "dp": 4, "schedule": "1f1b"},
        training={"micro_batch_size": 1, "global_batch_size": 192 * 4}, simulation={"gemm_efficiency": "flat"})
    for k, v in over.items():
        d[k] = {**d.get(k, {}), **v}
    return d


def both(d: dict):
    """(the step simulated whole, the step with its cycle copied in)."""
    return tuple(run({**d, "simulation": {**d.get("simulation", {}), "repeat": r}}) for r in (False, True))


def run(d: dict):
    return simulate(load_scenario(d, base_dir=ROOT))


# figures of the summary looser than REL and TIME_S, by key, as (relative, absolute): those it
# bins over the step (a link's rate per 1/100 of the step) move with a transfer's piece that
# crosses a bin's edge by a rounding error (fuzz_repeat.py 11, plan 2: a peak 1.5e-9 apart), as
# the links' peak rates compared below; utilisation over time is also rounded to 6 digits, so
# two values a nanosecond apart can round either side of a half unit (fuzz_repeat.py 7,
# plan 8: 1.1e-9 apart, rounded to 0.264635 and 0.264634): one unit of that
LOOSE = {"utilisation_over_time": (1e-6, 1e-6), "peak_utilisation": (1e-6, 0.0), "max_peak_utilisation": (1e-6, 0.0)}


def close(a, b, path: str = "", tol: tuple[float, float] = (REL, TIME_S)) -> list[str]:
    """Where two summaries differ beyond the splice's rounding (times to TIME_S, figures to REL,
    the binned and rounded figures of ``LOOSE`` to theirs)."""
    if isinstance(a, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(set(a) ^ set(b))}"]
        return [x for k in a for x in close(a[k], b[k], f"{path}.{k}", LOOSE.get(k, tol))]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: {len(a)} != {len(b)} entries"]
        return [x for i, (u, v) in enumerate(zip(a, b)) for x in close(u, v, f"{path}[{i}]", tol)]
    if isinstance(a, float) or isinstance(b, float):
        ok = a == b or math.isclose(a, b, rel_tol=max(REL, tol[0]), abs_tol=max(TIME_S, tol[1] * (1 + 1e-9)))
        return [] if ok else [f"{path}: {a!r} != {b!r}"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def differences(whole, copied, links: bool | None = True) -> list[str]:
    """Where a step with its cycle copied in differs from the step simulated whole: the spans
    (the same rows: rank, task, microbatch, form, in the same order; times within TIME_S),
    every figure of the summary but what says how it was simulated, the links' bytes and
    rates (``links``: whether any link carries traffic; None: either)."""
    out = []
    a, b = whole.trace.base, copied.trace.base
    if len(a.rank) != len(b.rank):
        return [f"spans: {len(a.rank)} and {len(b.rank)}"]
    # matched by rank, task, stream (a send and its receive share a task): spans that start
    # within a nanosecond of each other may come in either order (fuzz_repeat.py 10, plan 0:
    # a PP send and a TP all-reduce 5e-17 s apart in the whole step, at one instant in the copy)
    ia, ib = (np.lexsort((x.start_s, x.stream, x.tid, x.rank)) for x in (a, b))
    for col in ("rank", "tid", "mb"):
        if not np.array_equal(getattr(a, col)[ia], getattr(b, col)[ib]):
            out.append(f"spans: {col} differs")
    if out:
        return out
    # (comm_args too: the trace file's group, algorithm and peer)
    if [(a.forms[i].values(), a.forms[i].comm_args) for i in a.form[ia]] != \
            [(b.forms[i].values(), b.forms[i].comm_args) for i in b.form[ib]]:
        out.append("spans: forms differ")
    worst = max(float(np.abs(a.start_s[ia] - b.start_s[ib]).max(initial=0.0)),
                float(np.abs(a.end_s[ia] - b.end_s[ib]).max(initial=0.0)))
    if worst > TIME_S:
        out.append(f"spans: times differ by {worst:.3g} s")
    s, t = dict(whole.summary), dict(copied.summary)
    s["simulation"] = {k: v for k, v in s["simulation"].items() if k not in ("repeat", "repeat_tried")}
    t["simulation"] = {k: v for k, v in t["simulation"].items() if k not in ("repeat", "repeat_tried")}
    out += close(s, t)
    la = {u.name: (u.bytes, u.peak_Bps) for u in whole.trace.links}
    lb = {u.name: (u.bytes, u.peak_Bps) for u in copied.trace.links}
    if la.keys() != lb.keys() or (links is not None and bool(la) != links):
        out.append(f"links: {len(la)} and {len(lb)} links")
    elif not (all(math.isclose(la[k][0], lb[k][0], rel_tol=REL) for k in la)
              and all(math.isclose(la[k][1], lb[k][1], rel_tol=1e-6) for k in la)):  # binned: a piece may cross a bin edge
        out.append("links: bytes or peak rates differ")
    return out


def assert_same_step(whole, copied, links: bool = True) -> None:
    rep = copied.summary["simulation"]["repeat"]
    assert rep is not None and whole.summary["simulation"]["repeat"] is None
    assert rep["cycles_copied"] * rep["cycle_microbatches"] == whole.summary["plan"]["microbatches"] - rep[
        "simulated_microbatches"]
    assert differences(whole, copied, links) == []


@pytest.mark.parametrize("over", [
    {},
    {"parallel": {"zero": 1}, "training": {"recompute": "full"}},
    {"parallel": {"zero": 2, "sp": True}},
    {"simulation": {"network": "ideal"}},
    {"simulation": {"gemm_efficiency": "shape"}},  # (by GEMMs' shapes, this 1F1B repeats too)
    {"parallel": {"schedule": "interleaved", "vpp": 2}},
    {"parallel": {"schedule": "zb-h1"}},
    # (with full recompute this plan's ZB-V never settles: its later stages' forwards come at
    # irregular intervals, and the step is simulated whole, as a drifting 1F1B step is)
    {"parallel": {"schedule": "zbv", "zero": 2, "sp": True}},
    # DualPipeV's F&B chunks, their MoE all-to-alls overlapped
    {"model": {"moe": {"experts": 8, "top_k": 2, "expert_ffn": 1024}},
     "parallel": {"schedule": "dualpipev", "ep": 2, "sp": True}},
    # groups of 6 over 214 microbatches, which pp=4 does not divide (its last group of 4 kept: 70
    # simulated); on an ideal network, since on the flow network its pipeline never settles into
    # a cycle (the sends meet at shifting offsets: the whole step is simulated, as it should be)
    {"parallel": {"schedule": "interleaved", "vpp": 2, "vpp_group": 6}, "training": {"global_batch_size": 214 * 4},
     "simulation": {"network": "ideal"}},
    # DualPipe, fed from both ends: 360 microbatches, 120 simulated (60 each way), a cycle of
    # 2 + 2 copied 60 times; the second half's ids move by the first half's copies as well
    {"parallel": {"schedule": "dualpipe"}, "training": {"global_batch_size": 360 * 4}},
    {"model": {"moe": {"experts": 8, "top_k": 2, "expert_ffn": 1024}},
     "parallel": {"schedule": "dualpipe", "ep": 2, "zero": 1, "sp": True}, "training": {"global_batch_size": 360 * 4}},
    # combined 1F1B: interleaving's steady forwards and backwards paired into F&B chunks
    {"model": {"moe": {"experts": 8, "top_k": 2, "expert_ffn": 1024}},
     "parallel": {"schedule": "interleaved", "vpp": 2, "ep": 2, "sp": True, "ep_comm_overlap": True}},
    # the shared experts beside the all-to-alls (five blocks a MoE layer), recomputed; MoE every
    # second layer (both together, a chunk of one layer each, alternate so unevenly between the
    # stages that the pipeline never settles: simulated whole, as a drifting step is)
    {"model": {"moe": {"experts": 8, "top_k": 2, "expert_ffn": 1024, "shared_experts": 1,
                       "shared_expert_overlap": True}},
     "parallel": {"schedule": "interleaved", "vpp": 2, "ep": 2, "sp": True}, "training": {"recompute": "full"}},
    {"model": {"moe": {"experts": 8, "top_k": 2, "expert_ffn": 1024, "layer_freq": 2}},
     "parallel": {"schedule": "interleaved", "vpp": 2, "ep": 2, "sp": True}},
], ids=["plain", "zero1-recompute", "zero2-sp", "ideal-network", "shape", "interleaved", "zb-h1", "zbv", "dualpipev-moe",
        "interleaved-groups", "dualpipe", "dualpipe-moe", "interleaved-combined-moe", "interleaved-shared-beside",
        "interleaved-moe-every-2nd"])
def test_the_copied_cycle_gives_the_step_simulated_whole(over):
    whole, copied = both(plan(**over))
    assert_same_step(whole, copied, links=over.get("simulation", {}).get("network") != "ideal")


def test_a_cycle_of_two_interleaved_groups_is_copied_as_one_of_one_group(monkeypatch):
    """Interleaved 1F1B leaves out two groups at a time, so that a steady state whose groups
    alternate (moe_1024gpu's) repeats too. Here, with the cycles shorter than two groups not
    tried, the plan's cycle of one group (4) is taken as one of two (8): copied in 16 times, it
    gives the step simulated whole."""
    assert repeat.step_mb("interleaved", 4) == 8 and repeat.step_mb("interleaved", 4, group=6) == 12
    d = plan(parallel={"schedule": "interleaved", "vpp": 2})
    whole = run({**d, "simulation": {**d["simulation"], "repeat": False}})
    monkeypatch.setattr(repeat, "cycles_mb", lambda step: [step])
    copied = run({**d, "simulation": {**d["simulation"], "repeat": True}})
    rep = copied.summary["simulation"]["repeat"]
    assert (rep["simulated_microbatches"], rep["cycle_microbatches"], rep["cycles_copied"]) == (64, 8, 16)
    assert_same_step(whole, copied)


def test_dualpipes_cycle_is_said_to_hold_half_its_microbatches_each_way():
    """The terminal's line on a repeated DualPipe step: its cycle holds as many microbatches
    of each half (fed from each end)."""
    from clustersim.cli import _simulated_line

    summary = {"plan": {"schedule": "dualpipe", "microbatches": 360}, "world_size": 32,
               "simulation": {"simulated_ranks": 4, "spans": 93348, "collapse_symmetric": True, "repeat": {
                   "simulated_microbatches": 120, "cycle_microbatches": 2, "cycle_s": 0.03, "cut_s": 1.3,
                   "cycles_copied": 120}, "repeat_tried": 120}}
    assert "a cycle of 2 (1 each way) copied in 120 times" in _simulated_line(summary, 1.0)
    summary["plan"]["schedule"] = "1f1b"
    assert "a cycle of 2 copied in 120 times" in _simulated_line(summary, 1.0)


def test_a_straggler_splits_its_class_and_still_repeats():
    """One slow GPU (its stage's class split off): the cycle is the slow stage's, and holds."""
    d = plan(cluster={"topology": "topologies/dgx-h100.yaml", "nodes": 4,
                      "what_if": [{"gpu": 9, "slowdown": 1.3}]})
    whole, copied = both(d)
    assert len(copied.trace.ranks) > 4
    assert_same_step(whole, copied)


def test_the_comparison_allows_binned_and_rounded_figures_their_slack_and_no_more():
    """A figure the summary rounds (to 6 digits) may land a unit apart, one it bins over the
    step 1e-6 of itself; two units, 1e-5, or a figure it neither bins nor rounds 1e-6 apart,
    is a difference."""
    def summary(over_time: float, peak: float, mean: float) -> dict:
        return {"links": {"busiest": [{"utilisation_over_time": [over_time, 0.5], "peak_utilisation": peak,
                                       "utilisation": mean}]}}

    one = summary(0.264635, 0.9079773033766714, 0.264635)
    assert close(one, summary(0.264634, 0.9079773019973123, 0.264635)) == []
    assert close(one, summary(0.264633, 0.9079773033766714, 0.264635)) == [
        ".links.busiest[0].utilisation_over_time[0]: 0.264635 != 0.264633"]
    assert close(one, summary(0.264635, 0.907986, 0.264635)) == [
        ".links.busiest[0].peak_utilisation: 0.9079773033766714 != 0.907986"]
    assert close(one, summary(0.264635, 0.9079773033766714, 0.264634)) == [
        ".links.busiest[0].utilisation: 0.264635 != 0.264634"]


def test_the_comparison_matches_spans_by_task_not_by_row():
    """Two spans that start at one instant may come in either order; a span on another
    microbatch, or a nanosecond and more away, is a difference."""
    from types import SimpleNamespace

    r = simulate(scenario_dict(), repeat=False)
    base = r.trace.base

    def as_result(b):
        return SimpleNamespace(trace=SimpleNamespace(base=b, links=r.trace.links), summary=r.summary)

    n = len(base.rank)
    swapped = np.arange(n)
    swapped[[0, 1]] = [1, 0]  # two rows in the other order, the same spans
    fields = ("rank", "stream", "start_s", "end_s", "tid", "mb", "form")
    turned = replace(base, spans=None, **{f: getattr(base, f)[swapped] for f in fields})
    assert differences(as_result(base), as_result(turned)) == []
    other_mb = replace(base, spans=None, mb=np.where(np.arange(n) == n // 2, base.mb + 1, base.mb))
    assert differences(as_result(base), as_result(other_mb)) == ["spans: mb differs"]
    late = replace(base, spans=None, end_s=base.end_s + np.where(np.arange(n) == n // 3, 2e-9, 0.0))
    assert differences(as_result(base), as_result(late)) == ["spans: times differ by 2e-09 s"]


def test_how_many_microbatches_are_simulated():
    # 3/2 pp + 48 microbatches at least, whole steps of 12 left out, and a third of them at most
    assert repeat.simulated_microbatches("1f1b", 4, 192) == 60
    assert repeat.simulated_microbatches("1f1b", 64, 512) == 152  # Megatron-1T
    assert repeat.simulated_microbatches("1f1b", 4, 128) is None  # 56 simulated: more than a third
    assert repeat.simulated_microbatches("1f1b", 16, 192) is None  # gpt3_175b_1024gpu (it drifts)
    assert repeat.simulated_microbatches("1f1b", 4, 50) is None
    assert repeat.simulated_microbatches("gpipe", 4, 512) is None  # no steady cycle: all F, then all B
    assert repeat.simulated_microbatches("1f1b", 1, 512) is None  # no pipeline
    # interleaved: two groups of pp microbatches left out at a time, as many simulated as a
    # third allows (its transient outlasts 3/2 pp vpp on uneven stages), up to three times the
    # fewest (here 12 + 32 = 44: 128 = 512 - 48 x 8 <= 132)
    assert repeat.simulated_microbatches("interleaved", 4, 512, chunks=2) == 128
    assert repeat.simulated_microbatches("interleaved", 8, 512, chunks=2) == 160  # 512 - 22 x 16
    # moe_1024gpu's plan (pp 8, vpp 4: 48 + 64 = 112 at least) at 512 and at 4,096 (3 x 112)
    assert repeat.simulated_microbatches("interleaved", 8, 512, chunks=4) == 160
    assert repeat.simulated_microbatches("interleaved", 8, 4096, chunks=4) == 336
    assert repeat.simulated_microbatches("interleaved", 8, 256, chunks=4) is None  # 48 + 64 at least: over a third
    # groups of 6: steps of 12 keep the last group (514 = 85 x 6 + 4; 166 = 27 x 6 + 4)
    assert repeat.simulated_microbatches("interleaved", 4, 514, chunks=2, group=6) == 166
    assert repeat.simulated_microbatches("interleaved", 4, 214, chunks=2, group=6) == 70  # the fewest is the most
    assert repeat.simulated_microbatches("zb-h1", 4, 512) == 56  # as 1F1B
    # DualPipe, fed from both ends: steps of 12 each way, 3/2 pp + 48 each way at least, as
    # many as a third allows
    assert repeat.simulated_microbatches("dualpipe", 4, 360) == 120  # 360 - 10 x 24
    assert repeat.simulated_microbatches("dualpipe", 16, 480) == 144  # DeepSeek-V3's plan at 480 (3 x 16 + 96)
    assert repeat.simulated_microbatches("dualpipe", 4, 192) is None  # 108 at least: more than a third
    # the V schedules (two chunks a rank: 3/2 pp 2 + 48 at least), slow to settle: as many as a
    # third allows (512 - 29 x 12 = 164 <= 512 / 3), not the fewest (68 and 80 here)
    assert repeat.simulated_microbatches("zbv", 4, 512, chunks=2) == 164
    assert repeat.simulated_microbatches("dualpipev", 8, 512, chunks=2) == 164
    assert repeat.simulated_microbatches("zbv", 4, 192, chunks=2) == 60  # the fewest is also the most
    assert repeat.simulated_microbatches("dualpipev", 8, 192, chunks=2) is None  # 72 at least: more than a third


def test_repeat_false_or_no_cycle_simulates_every_microbatch(monkeypatch):
    d = plan()
    whole = run({**d, "simulation": {**d["simulation"], "repeat": False}})
    monkeypatch.setattr(repeat, "find_cycle", lambda *a, **k: None)
    fallback = run(d)
    assert fallback.summary["simulation"]["repeat"] is None
    # it says what it tried, and is otherwise the same run, bit for bit
    assert fallback.summary["simulation"].pop("repeat_tried") == 60
    assert whole.summary["simulation"].pop("repeat_tried") is None
    assert fallback.summary == whole.summary


def test_a_cycle_twelve_does_not_divide_is_copied_in_from_a_second_shorter_step(monkeypatch):
    """Where the shorter step holds no cycle that divides the microbatches it leaves out (here
    none is tried: ``cycles_mb`` gives none), the shortest longer one its last two windows
    hold is checked again on a second shorter step, a cycle longer and leaving out a multiple
    of it: a multiple of the plan's own cycle that 12 does not divide, copied in, gives the
    step simulated whole (Megatron-1T's first stage repeats every 14 microbatches)."""
    d = plan()
    whole = run({**d, "simulation": {**d["simulation"], "repeat": False}})
    own = run(d).summary["simulation"]["repeat"]["cycle_microbatches"]
    want = next(c for c in range(own, 49, own) if 12 % c)
    monkeypatch.setattr(repeat, "cycles_mb", lambda step: [])
    copied = run(d)
    rep = copied.summary["simulation"]["repeat"]
    m = repeat.again_microbatches(192, 60, want)
    assert rep["cycle_microbatches"] == want and rep["simulated_microbatches"] == m >= 60 + want
    assert copied.summary["simulation"]["repeat_tried"] == m and (192 - m) % want == 0
    assert_same_step(whole, copied)
    # the first shorter step simulated by a forked process, as `clustersim run` does: it says
    # the longer cycle it held, and the second step is made here
    forked = simulate(load_scenario(d, base_dir=ROOT), fork=True)
    assert forked.summary["simulation"]["repeat"] == rep
    assert_same_step(whole, forked)
    assert repeat.again_microbatches(100, 80, 14) is None  # nothing left to leave out


def test_the_command_says_when_no_cycle_held(tmp_path, monkeypatch, capsys):
    """A step whose shorter run shows no steady cycle is simulated whole: the terminal and the
    report's header say that the try was made (it cost its shorter step), and how to skip it."""
    import json

    import yaml

    from clustersim import cli

    d = plan()
    d["cluster"] = {**d["cluster"], "topology": str(ROOT / d["cluster"]["topology"])}
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    monkeypatch.setattr(repeat, "find_cycle", lambda *a, **k: None)
    assert cli.main(["run", str(path), "--out", str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert "all 192 microbatches run: a shorter step of 60 showed no steady cycle (--no-repeat skips" in said
    report = (tmp_path / "out" / "report.html").read_text()
    assert "simulated: all 192 microbatches; a shorter step of 60 showed no steady cycle" in report
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["simulation"]["repeat"] is None and summary["simulation"]["repeat_tried"] == 60
    assert cli.main(["run", str(path), "--out", str(tmp_path / "whole"), "--no-repeat"]) == 0
    assert "showed no steady cycle" not in capsys.readouterr().out
    assert json.loads((tmp_path / "whole" / "summary.json").read_text())["simulation"]["repeat_tried"] is None


def _short_run(d: dict):
    sc = load_scenario(d, base_dir=ROOT)
    short = repeat.simulated_microbatches("1f1b", sc.parallel.pp, sc.microbatches)
    ssc = with_microbatches(sc, short)
    sprog, _ = lower(ssc)
    eng = Engine(sprog, sc.cluster)
    trace = eng.run(links=False)
    anchor = min(r for r, s in trace.stage_of.items() if s == 0)
    return sc, short, sprog, eng, trace, anchor


@pytest.mark.parametrize("drift_s", [2e-9, 1e-13], ids=["2ns", "0.1ps"])
def test_a_cycle_that_does_not_repeat_is_refused(drift_s):
    """A steady state that drifts does not repeat, however little: a drift under a nanosecond
    a cycle passed the windows' check when it allowed 1 ns, and the copies met the simulated
    spans 1.7e-11 s apart, overlapping on a stream (bench/fuzz_repeat.py 24, plan 4)."""
    sc, short, sprog, eng, trace, anchor = _short_run(plan())
    base = trace.base
    rep = repeat.find_cycle(base, anchor, short, sc.microbatches)
    assert rep is not None and rep.cycle_mb in repeat.cycles_mb(repeat.STEP_MB)
    # a transient that has not settled: microbatches ever later, drift_s x (mb - first)^2 from
    # 40 periods before the cut on (every window of every cycle length tried lies in there; a
    # drift that grows linearly would only be another period)
    per_mb = rep.period_s / rep.cycle_mb
    late = (base.start_s > rep.cut_s - 40 * per_mb) & (base.mb >= 0)
    first = int(base.mb[late].min())
    drift = np.where(late, (base.mb - first) ** 2 * drift_s, 0.0)
    moved = replace(base, start_s=base.start_s + drift, end_s=base.end_s + drift)
    assert repeat.find_cycle(moved, anchor, short, sc.microbatches) is None


def test_spans_that_do_not_land_on_the_programs_tasks_are_refused():
    """Spliced onto a program of other microbatches (12 more), the spans do not match its
    streams' tasks: no trace, rather than a wrong one."""
    d = plan()
    sc, short, sprog, eng, trace, anchor = _short_run(d)
    rep = repeat.find_cycle(trace.base, anchor, short, sc.microbatches)
    prog, _ = lower(sc)
    good = repeat.splice(trace.base, rep, TaskColumns(sprog.items, sprog.runs, sprog),
                         TaskColumns(prog.items, prog.runs, prog))
    assert good is not None and len(good.rank) == len(prog.items) + (len(good.rank) - len(prog.items))
    other, _ = lower(with_microbatches(sc, sc.microbatches + 12))
    assert repeat.splice(trace.base, rep, TaskColumns(sprog.items, sprog.runs, sprog),
                         TaskColumns(other.items, other.runs, other)) is None


def test_the_summary_names_the_cycle():
    """The summary says what was simulated: microbatches run, the cycle, its period."""
    whole, copied = both(plan())
    rep = copied.summary["simulation"]["repeat"]
    assert rep["simulated_microbatches"] == 60 and rep["cycles_copied"] * rep["cycle_microbatches"] == 132
    # the period is the steady state's: the step's time grows by it per cycle
    per_mb = rep["cycle_s"] / rep["cycle_microbatches"]
    short = run({**plan(), "training": {"micro_batch_size": 1, "global_batch_size": 180 * 4},
                 "simulation": {"gemm_efficiency": "flat", "repeat": False}})
    assert math.isclose(whole.summary["step_time_s"] - short.summary["step_time_s"], 12 * per_mb, rel_tol=1e-9)


def test_the_command_says_what_it_ran_and_no_repeat_runs_it_all(tmp_path):
    """``clustersim run`` prints how many microbatches ran and the cycle copied in; the
    summary.json it writes says so; ``--no-repeat`` simulates every one, with the same spans
    to a nanosecond in the trace file."""
    import gzip
    import json
    import subprocess
    import sys

    import yaml

    d = plan()
    d["cluster"] = {**d["cluster"], "topology": str(ROOT / d["cluster"]["topology"])}
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    outs = {}
    for flag in ((), ("--no-repeat",)):
        out = tmp_path / ("whole" if flag else "copied")
        r = subprocess.run([sys.executable, "-m", "clustersim", "run", str(path), "--out", str(out), *flag],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        outs[bool(flag)] = (r.stdout + (out / "report.html").read_text(), json.loads((out / "summary.json").read_text()),
                            json.loads(gzip.open(out / "trace.json.gz").read()))
    from clustersim.output.report import header_html

    (said, s, t), (said_whole, s_whole, t_whole) = outs[False], outs[True]
    assert "60 of 192 microbatches run, a cycle of" in said  # the terminal
    assert s["simulation"]["repeat"]["cycle_microbatches"] == 2
    assert "simulated: 60 of 192 microbatches; their steady cycle of 2 microbatches (" in said  # the report's header
    # a cycle of one microbatch (ZB-V's, most 1F1B plans') in the singular
    one = {**s, "simulation": {**s["simulation"], "repeat": {**s["simulation"]["repeat"], "cycle_microbatches": 1}}}
    assert "their steady cycle of 1 microbatch (" in header_html(one)
    assert "microbatches run" not in said_whole and "simulated: " not in said_whole
    assert s["simulation"]["repeat"]["simulated_microbatches"] == 60 and s_whole["simulation"]["repeat"] is None
    assert s["simulation"]["repeat_tried"] == 60 and s_whole["simulation"]["repeat_tried"] is None
    ev = [e for e in t["traceEvents"] if e.get("ph") == "X"]
    ev_whole = [e for e in t_whole["traceEvents"] if e.get("ph") == "X"]
    assert len(ev) == len(ev_whole) > 0
    assert [(e["pid"], e["tid"], e["name"]) for e in ev] == [(e["pid"], e["tid"], e["name"]) for e in ev_whole]
    # the trace file's times are microseconds, printed to a nanosecond at most
    assert max(abs(a["ts"] - b["ts"]) for a, b in zip(ev, ev_whole)) <= 2e-3


SHORTER_PLANS = {
    "1f1b": {}, "zero1": {"parallel": {"zero": 1}}, "zero2": {"parallel": {"zero": 2}},
    "zero3": {"parallel": {"zero": 3}}, "zero3-kept": {"parallel": {"zero": 3, "zero3_keep_gathered": True}},
    "zero1-overlap-gather": {"parallel": {"zero": 1, "overlap_param_gather": True}},
    "interleaved": {"parallel": {"schedule": "interleaved", "vpp": 2}}, "zb-h1": {"parallel": {"schedule": "zb-h1"}},
    "zbv": {"parallel": {"schedule": "zbv", "zero": 2}}, "dualpipev": {"parallel": {"schedule": "dualpipev"}},
    "cp-unbalanced": {"parallel": {"tp": 1, "cp": 2, "cp_load_balance": False}},
    "straggler": {"cluster": {"what_if": [{"gpu": 5, "slowdown": 1.3}]}},
}


def _fields_of(prog) -> list:
    from clustersim.program.lower import _comm_fields, _task_fields

    return [(_task_fields(t), None if t.comm is None else _comm_fields(t.comm)) for t in prog.tasks]


@pytest.mark.parametrize("over", [{}, {"parallel": {"zero": 3}}, {"parallel": {"schedule": "interleaved", "vpp": 2}},
                                  {"parallel": {"schedule": "dualpipe"}}],
                         ids=["1f1b", "zero3", "interleaved", "dualpipe"])
def test_the_shorter_step_lowered_like_the_whole_one_is_the_same_program(over):
    """The shorter step reuses the whole step's lowering (work, symmetry, communication specs):
    its tasks are those of a lowering from scratch, and the whole step's lowering is untouched."""
    sc = load_scenario(plan(**over), base_dir=ROOT)
    prog, low = lower(sc)
    before = (dict(low.final_mb), dict(low.done), len(low.block_plans))
    reused, _ = lower(with_microbatches(sc, 60), like=low)
    fresh, _ = lower(with_microbatches(sc, 60))
    assert _fields_of(reused) == _fields_of(fresh)
    assert before[:2] == (low.final_mb, low.done) and len(low.block_plans) >= before[2]
    assert _fields_of(prog) == _fields_of(lower(sc)[0])


@pytest.mark.parametrize("over", SHORTER_PLANS.values(), ids=SHORTER_PLANS.keys())
def test_the_shorter_step_resumed_where_the_steps_part_is_the_same_program(over):
    """``lower_step`` keeps the whole step's lowering state where the shorter step's units
    part from it, and the shorter step's lowering resumes there (its shared units' tasks
    copied): the same tasks, ids and template runs as a lowering from scratch; the whole
    step's program is the one lowered without keeping anything."""
    from clustersim.api import lower_step, shorter_step

    sc = load_scenario(plan(**over), base_dir=ROOT)
    shorter = shorter_step(sc)
    # (interleaved leaves out two groups of 4 at a time: 192 - 16 x 8)
    short = 64 if sc.parallel.schedule == "interleaved" else 60
    assert shorter is not None and shorter is shorter_step(sc) and shorter.microbatches == short
    prog, low = lower_step(sc)
    kept = low.resume
    assert kept is not None and 0 < kept.at < len(kept.units)
    resumed, _ = lower(shorter, like=low)
    assert low.resume is None  # handed over
    fresh, _ = lower(with_microbatches(sc, short))
    assert [r[:3] for r in resumed.runs] == [r[:3] for r in fresh.runs]
    assert _fields_of(resumed) == _fields_of(fresh)
    assert _fields_of(prog) == _fields_of(lower(sc)[0])


def test_a_run_does_not_import_numpy_ma():
    """numpy's ``unique`` imports numpy.ma on its first call (10-13 ms of every run): neither
    the schedule's check (DualPipe's here) nor the cycle search (a repeated 1F1B step) call it
    (trace.unique stands in for it). numpy 1.x imports numpy.ma with numpy itself: nothing to
    test there."""
    import subprocess
    import sys

    if np.__version__.startswith("1."):
        pytest.skip("numpy 1.x imports numpy.ma as it loads")
    code = ("import sys, clustersim\n"
            "from tests.test_repeat import plan, run\n"
            "clustersim.simulate('scenarios/dualpipe.yaml')\n"
            "r = run(plan())\n"
            "assert r.summary['simulation']['repeat'] is not None\n"
            "print('numpy.ma' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("over", [{}, {"parallel": {"schedule": "interleaved", "vpp": 2}},
                                  {"parallel": {"schedule": "zb-h1"}}, {"parallel": {"schedule": "dualpipev"}}],
                         ids=["1f1b", "interleaved", "zb-h1", "dualpipev"])
def test_spans_placed_by_lane_without_sorting_them_as_a_sort_places_them(over, monkeypatch):
    """The splice places each lane's spans (before the cut, the window's copies, after it)
    from the simulated spans alone (``repeat._lane_order``); sorting the spliced spans by
    (lane, segment, task id) instead gives the same spans, field by field."""
    from clustersim.analysis.columns import TaskColumns
    from clustersim.api import _cycle, _spliced, shorter_step

    sc = load_scenario(plan(**over), base_dir=ROOT)
    sprog, _ = lower(shorter_step(sc))
    eng = Engine(sprog, sc.cluster)
    base, rep, _ = _cycle(sc, eng, eng.run(links=False))
    prog, _ = lower(sc)

    def spliced():
        return _spliced(eng, base, rep, TaskColumns(sprog.items, sprog.runs, sprog),
                        TaskColumns(prog.items, prog.runs, prog), prog)
    placed = spliced()
    assert placed is not None and placed.repeat["cycles_copied"] > 0
    monkeypatch.setattr(repeat, "_lane_order", lambda *a: None)
    sorted_ = spliced()
    for f in ("rank", "stream", "start_s", "end_s", "tid", "mb", "form"):
        assert np.array_equal(getattr(placed.base, f), getattr(sorted_.base, f)), f


@pytest.mark.parametrize("over", [{}, {"parallel": {"schedule": "interleaved", "vpp": 2}},
                                  {"parallel": {"schedule": "zb-h1"}}, {"parallel": {"schedule": "dualpipev"}}],
                         ids=["1f1b", "interleaved", "zb-h1", "dualpipev"])
def test_the_spliced_steps_end_is_known_from_the_simulated_spans(over):
    """``repeat.spliced_end_s`` (the step's end the shorter step's process works the link use
    out over before the splice is done) is the spliced spans' last end to the bit; a span
    moved past it would not be."""
    from clustersim.api import _cycle, _spliced, shorter_step

    sc = load_scenario(plan(**over), base_dir=ROOT)
    sprog, _ = lower(shorter_step(sc))
    eng = Engine(sprog, sc.cluster)
    base, rep, _ = _cycle(sc, eng, eng.run(links=False))
    prog, _ = lower(sc)
    whole = _spliced(eng, base, rep, TaskColumns(sprog.items, sprog.runs, sprog),
                     TaskColumns(prog.items, prog.runs, prog), prog)
    assert whole is not None and rep.copies > 0
    end_s = float(whole.base.end_s.max())
    assert repeat.spliced_end_s(base, rep) == end_s == eng.step_s
    # one span made to end last: one before the last window keeps its end, one in the window
    # (its n-th copy) or after the cut moves by n periods
    moves = rep.copies * rep.period_s
    before = np.flatnonzero(base.start_s < rep.cut_s - rep.period_s)
    window = np.flatnonzero((base.start_s >= rep.cut_s - rep.period_s) & (base.start_s < rep.cut_s))
    after = np.flatnonzero(base.start_s >= rep.cut_s)
    for i, moved in ((before[-1], 0.0), (window[0], moves), (window[-1], moves), (after[0], moves)):
        later = base.end_s.copy()
        later[i] = end_s - moved + 1e-6
        assert repeat.spliced_end_s(replace(base, end_s=later), rep) == later[i] + moved


def test_a_lane_out_of_task_order_is_left_to_the_sort():
    """Two spans of one lane whose start order is not their tasks' id order: the lane order
    from the simulated spans is refused (None), the splice sorts instead."""
    sc, short, sprog, eng, trace, anchor = _short_run(plan())
    base = trace.base
    rep = repeat.find_cycle(base, anchor, short, sc.microbatches)
    places = repeat._places(base, rep)
    lanes = base.rank * 100 + base.stream
    own = np.ones(len(lanes), dtype=bool)
    assert repeat._lane_order(base, rep, places, own, lanes) is not None
    i = int(np.flatnonzero(lanes[1:] == lanes[:-1])[0])  # two neighbours of one lane
    tid = base.tid.copy()
    tid[i], tid[i + 1] = tid[i + 1], tid[i]
    assert repeat._lane_order(replace(base, tid=tid), rep, places, own, lanes) is None
    unsorted = replace(base, start_s=base.start_s[::-1].copy())
    assert repeat._places(unsorted, rep) is None
    no_id = base.tid.copy()
    no_id[0] = -1
    assert repeat._places(replace(base, tid=no_id), rep) is None


def test_the_finished_transfers_placed_as_the_cut_copies_them():
    """The link use reads the flow network's finished transfers in the step's order through
    ``Engine._finished_places`` and ``_moved`` (no list of moved copies is made): their
    records, all or those a mask picks, are the cut's copies written out one by one."""
    from clustersim.analysis.columns import TaskColumns
    from clustersim.api import _cycle, _spliced

    sc, short, sprog, eng, trace, _ = _short_run(plan())
    prog, _ = lower(sc)
    finished = list(eng.net.finished)
    whole = _spliced(eng, *_cycle(sc, eng, trace)[:2], TaskColumns(sprog.items, sprog.runs, sprog),
                     TaskColumns(prog.items, prog.runs, prog), prog)
    assert whole is not None and whole.repeat["cycles_copied"] > 0
    rep = eng._cut_by
    eng._cut_records()
    starts = np.array([r[5][1] if r[5] is not None else r[2][0] for r in finished])
    rows, copy = repeat.spliced_times(starts, rep)
    expected = []  # each transfer of the step, moved by its copy's periods
    for i, k in zip(rows.tolist(), copy.tolist()):
        tag, size, times, rates, ends, course = finished[i]
        s = k * rep.period_s
        expected.append(finished[i] if not k else (tag, size, times, rates, ends, (course[0], course[1] + s))
                        if course is not None else (tag, size, [x + s for x in times], rates, ends + s, None))
    got = [eng._moved(finished[i], k) for _, i, k in zip(*eng._finished_places())]

    def same(a, b):
        return (a[:2] == b[:2] and a[2] == b[2] and a[3] is b[3] and np.array_equal(a[4], b[4])
                and (a[5] is None) == (b[5] is None) and (a[5] is None or a[5] == b[5]))
    assert len(got) == len(expected) > len(finished) and all(map(same, got, expected))
    pick = np.arange(len(finished)) % 3 == 0
    at, recs, ks = eng._finished_places(pick)
    assert at == [j for j, i in enumerate(rows.tolist()) if pick[i]] and len(at) > 0
    assert all(same(eng._moved(finished[i], k), expected[j]) for j, i, k in zip(at, recs, ks))


def test_the_records_are_cut_once_whatever_asks_again():
    """``Engine.cut_records`` given the cut again (the shorter step's process, where the
    parent's step end differs from the one it expected) only sets the step: the link use
    asked twice, the second time over another end, reads the records cut once, as an engine
    asked once over that end does."""
    from clustersim.api import _cycle

    def link_use(ends: list[float]):  # (TP8: all-reduces timed in closed form, their starts cut too)
        sc, short, sprog, eng, trace, _ = _short_run(plan(parallel={"tp": 8, "pp": 4, "dp": 1}))
        base, rep, _ = _cycle(sc, eng, trace)
        assert rep is not None
        for end_s in ends:
            eng.cut_records(rep, end_s)
            got = eng.link_use()
        return got, sum(map(len, (at for _, at in eng._alone_starts.values())))

    once, n_once = link_use([5.0])
    twice, n_twice = link_use([4.0, 5.0])
    assert twice == once and n_twice == n_once > 0
