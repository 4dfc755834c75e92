"""The timeline past MAX_TIMELINE_RANKS ranks: one rank of each kind, the rest as aliases."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

import clustersim
import clustersim.output.report as report
from clustersim.output.perfetto import SpanOrder, span_order
from clustersim.output.shown import only_ranks, shown_ranks, spread

from .conftest import scenario_dict

ROOT = Path(__file__).resolve().parent.parent
# 16 GPUs, TP4 x PP2 x DP2 on two nodes: run rank by rank, its DP and TP peers behave alike
SMALL = scenario_dict(name="small-all-ranks")


@pytest.fixture(scope="module")
def every_rank() -> clustersim.Result:
    return clustersim.simulate(clustersim.load_scenario(copy.deepcopy(SMALL), base_dir=ROOT), collapse=False)


def _order(ends: dict[int, float]) -> SpanOrder:
    """One compute row per rank, holding one span from 0 to the rank's end."""
    ranks = list(ends)
    end_s = np.array([ends[r] for r in ranks])
    return SpanOrder(rows=[(r, "compute") for r in ranks], by_rank={r: ["compute"] for r in ranks},
                     index_array=np.arange(len(ranks)), bounds=list(range(len(ranks) + 1)),
                     start_s=np.zeros(len(ranks)), end_s=end_s, last_end_s=float(end_s.max()))


def _row_stats(trace, rank: int) -> dict[str, tuple[int, float, float]]:
    """Per stream of ``rank``, read from the spans themselves: spans, busy time, last end."""
    out: dict[str, list] = {}
    for s in trace.spans:
        if s.rank == rank:
            n, busy, last = out.get(s.stream, (0, 0.0, 0.0))
            out[s.stream] = (n + 1, busy + (s.end_s - s.start_s), max(last, s.end_s))
    return out


def _alike(a: dict, b: dict, step_s: float) -> bool:
    return a.keys() == b.keys() and all(
        a[k][0] == b[k][0] and abs(a[k][1] - b[k][1]) <= 1e-8 * step_s and abs(a[k][2] - b[k][2]) <= 1e-8 * step_s
        for k in a)


def test_kinds_taken_stage_by_stage_latest_then_earliest():
    # stage 0: four ranks of three kinds (1 and 2 alike), ending at 3, 3, 1 and 2 s; stage 1: one
    order = _order({0: 3.0, 1: 3.0, 2: 1.0, 3: 2.0, 4: 5.0})
    stage_of = {0: 0, 1: 0, 2: 0, 3: 0, 4: 1}
    assert shown_ranks(order, stage_of, most=5).ranks == [0, 1, 2, 3, 4]  # all fit: all drawn
    three = shown_ranks(order, stage_of, most=3)
    # round 1: stage 0's latest (rank 0, the first of its kind), stage 1's only; round 2: stage
    # 0's earliest
    assert three.ranks == [0, 2, 4] and three.of == 5
    assert three.alias == {1: 0}  # rank 3 is of a kind not drawn
    assert shown_ranks(order, stage_of, most=4).ranks == [0, 2, 3, 4]
    assert shown_ranks(order, stage_of, most=2).ranks == [0, 4]


def test_stages_past_the_cap_are_drawn_spread_over_the_pipeline():
    assert spread(9) == [0, 8, 4, 2, 6, 1, 3, 5, 7]
    assert all(sorted(spread(n)) == list(range(n)) for n in range(40))
    order = _order({r: 1.0 + r for r in range(10)})  # ten stages of one rank
    shown = shown_ranks(order, {r: r for r in range(10)}, most=4)
    assert shown.ranks == [0, 2, 4, 9] and (shown.stages, shown.of_stages, shown.kinds) == (4, 10, 10)


def test_ranks_without_spans_are_not_drawn():
    order = _order({0: 1.0, 1: 2.0, 2: 3.0})
    order = SpanOrder(rows=order.rows, by_rank={**order.by_rank, 3: [], 4: []}, index_array=order.index_array,
                      bounds=order.bounds, start_s=order.start_s, end_s=order.end_s, last_end_s=order.last_end_s)
    shown = shown_ranks(order, {}, most=4)
    assert shown.ranks == [0, 1, 2] and shown.of == 5 and shown.kinds == 3


def test_only_ranks_keeps_those_rows_and_the_step_end():
    order = _order({0: 3.0, 1: 4.0, 2: 1.0})
    cut = only_ranks(order, [0, 2])
    assert cut.rows == [(0, "compute"), (2, "compute")] and cut.bounds == [0, 1, 2]
    assert cut.end_s.tolist() == [3.0, 1.0] and cut.index_array.tolist() == [0, 2] and cut.last_end_s == 4.0


def test_past_the_cap_one_rank_of_each_kind_is_drawn(every_rank):
    trace = every_rank.trace
    order = span_order(trace)
    assert len(order.by_rank) == 16
    shown = shown_ranks(order, trace.stage_of, most=4)
    assert 2 <= len(shown.ranks) <= 4 and shown.of == 16
    assert {trace.stage_of[r] for r in shown.ranks} == {0, 1}  # every stage drawn
    stats = {r: _row_stats(trace, r) for r in trace.ranks}
    step_s = trace.end_s
    assert shown.alias  # DP and TP peers repeat each other
    for hidden, drawn in shown.alias.items():
        assert drawn in shown.ranks and trace.stage_of[hidden] == trace.stage_of[drawn]
        assert _alike(stats[hidden], stats[drawn], step_s), (hidden, drawn)
    for r in set(trace.ranks) - set(shown.ranks) - set(shown.alias):  # of a kind not drawn
        assert not any(_alike(stats[r], stats[d], step_s) for d in shown.ranks if trace.stage_of[d] == trace.stage_of[r])


def test_the_timeline_past_the_cap(every_rank, monkeypatch):
    trace, summary = every_rank.trace, every_rank.summary
    full = report.timeline(trace, summary)
    assert "meta" not in full["layout"] or "shown" not in full["layout"]["meta"]
    monkeypatch.setattr(report, "MAX_TIMELINE_RANKS", 4)
    cut = report.timeline(trace, summary)
    shown = shown_ranks(span_order(trace), trace.stage_of, most=4)
    meta = cut["layout"]["meta"]["shown"]
    assert meta == {"ranks": len(shown.ranks), "of": 16, "alike": len(shown.alias), "kinds": shown.kinds,
                    "stages": 2, "of_stages": 2, "drawn": shown.ranks,
                    "alias": {str(r): a for r, a in shown.alias.items()}}
    labels = cut["layout"]["yaxis"]["ticktext"]
    assert {int(lab.split()[1]) for lab in labels} == set(shown.ranks)
    assert len(labels) == sum(len(span_order(trace).by_rank[r]) for r in shown.ranks)

    # the drawn rows' bars are the ones the full timeline has on those rows
    def bars(fig) -> set:
        text = fig["layout"]["yaxis"]["ticktext"]
        out = set()
        for t in fig["data"]:
            if t.get("type") == "bar":
                for y, base, x in zip(t["y"], t["base"], t["x"]):
                    out.add((text[int(y)], round(float(base), 9), round(float(x), 9)))
        return out
    kept = {b for b in bars(full) if int(b[0].split()[1]) in shown.ranks}
    assert bars(cut) == kept and kept

    # the critical path: every segment drawn (its DP peers' on their alias's rows), at the
    # same times as on the full timeline
    path_full, path_cut = full["data"][-1], cut["data"][-1]
    assert path_full["name"] == path_cut["name"] == "critical path"
    assert path_cut["x"] == path_full["x"]
    assert {y for y in path_cut["y"] if y is not None} <= {i for i, lab in enumerate(labels) if "compute" in lab}

    note = report.timeline_note(trace, None, meta)
    assert f"draws {len(shown.ranks)} of the 16 ranks" in note and "trace.json.gz has every rank" in note


def test_a_path_on_a_rank_not_drawn_nor_alike_is_left_out():
    rows = [(0, "compute"), (0, "pp"), (4, "compute")]
    def seg(rank: int, start_s: float) -> dict:
        return {"rank": rank, "stage": 0, "start_s": start_s, "end_s": start_s + 1.0, "tasks": 1,
                "compute_s": 1.0, "comm_s": 0.0, "first": "F0", "last": "F0"}
    summary = {"step_time_s": 3.0, "critical_path": {"segments": [seg(0, 0.0), seg(7, 1.0), seg(9, 2.0)]}}
    path = report.path_trace(summary, rows, alias={7: 4})
    xs = [x for x in path["x"] if x is not None]
    assert min(xs) == 0.0 and max(xs) == 2000.0  # rank 9's second is not drawn
    assert set(path["y"]) - {None} == {0, 2}  # rank 7 on rank 4's compute row


def test_the_path_line_breaks_where_it_crosses_a_rank_not_drawn():
    # joined over the gap, the line would show the path on rank 0 while it ran on rank 9
    rows = [(0, "compute"), (4, "compute")]

    def seg(rank: int, start_s: float) -> dict:
        return {"rank": rank, "stage": 0, "start_s": start_s, "end_s": start_s + 1.0, "tasks": 1,
                "compute_s": 1.0, "comm_s": 0.0, "first": "F0", "last": "F0"}
    summary = {"step_time_s": 4.0, "critical_path": {"segments": [seg(0, 0.0), seg(9, 1.0), seg(4, 2.0), seg(0, 3.0)]}}
    path = report.path_trace(summary, rows)
    assert path["x"] == [0.0, 1000.0, None, 2000.0, 3000.0, 3000.0, 4000.0]
    assert path["y"] == [0, 0, None, 1, 1, 0, 0]
