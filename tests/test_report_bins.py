"""The timeline past BAR_BUDGET bars: runs of bins that keep every span's busy time, coloured by
the work that is busiest in them, drawn in a browser within seconds."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import pytest

import clustersim
from clustersim.output import bins, report
from clustersim.output.bins import bar_count, binned_bars, binned_within
from clustersim.output.perfetto import span_order

from .conftest import offline_page, scenario_dict
from .test_report import _rows

ROOT = Path(__file__).resolve().parent.parent
N_GROUPS = 4


def _random_rows(seed: int, n_rows: int = 3, per_row: int = 400) -> dict[str, np.ndarray]:
    """Spans that do not overlap within a row: random lengths (some of none, some long),
    random gaps, random groups and microbatches (some without one)."""
    rng = np.random.default_rng(seed)
    cols: dict[str, list] = {"row": [], "group": [], "mb": [], "start_s": [], "end_s": []}
    for r in range(n_rows):
        t = rng.uniform(0, 0.5)
        for _ in range(per_row):
            d = rng.choice([0.0, rng.exponential(0.01), rng.exponential(0.3)], p=[0.05, 0.85, 0.1])
            cols["row"].append(r)
            cols["group"].append(int(rng.integers(N_GROUPS)))
            cols["mb"].append(int(rng.integers(-1, 20)))
            cols["start_s"].append(t)
            cols["end_s"].append(t + d)
            t += d + rng.choice([0.0, rng.exponential(0.02)])
    return {k: np.array(v, dtype=float if k.endswith("_s") else np.int64) for k, v in cols.items()}


def _overlap(lo: np.ndarray, hi: np.ndarray, a: float, b: float) -> np.ndarray:
    return np.clip(np.minimum(hi, b) - np.maximum(lo, a), 0.0, None)


@pytest.mark.parametrize("seed,n_bins", [(0, 50), (1, 200), (2, 7), (3, 1)])
def test_runs_of_bins_keep_busy_time_and_show_the_busiest_group(seed, n_bins):
    c = _random_rows(seed)
    t_end = float(c["end_s"].max())
    b = binned_bars(c["row"], c["group"], c["mb"], c["start_s"], c["end_s"], N_GROUPS, t_end, n_bins)
    assert b.bin_s == pytest.approx(t_end / n_bins)
    for r in range(3):
        mine = c["row"] == r
        lo, hi, g, mb = c["start_s"][mine], c["end_s"][mine], c["group"][mine], c["mb"][mine]
        bars = np.flatnonzero(b.row == r)
        assert np.all(np.diff(b.start_s[bars]) > 0) and np.all(b.end_s[bars][:-1] <= b.start_s[bars][1:])
        assert b.busy_s[bars].sum() == pytest.approx((hi - lo).sum(), rel=1e-12)  # no span time lost
        assert b.n_spans[bars].sum() == mine.sum()
        for i in bars:
            a, z = b.start_s[i], b.end_s[i]
            assert lo.min() <= a <= z <= hi.max()
            per_group = np.array([_overlap(lo[g == k], hi[g == k], a, z).sum() for k in range(N_GROUPS)])
            np.testing.assert_allclose(b.group_busy_s[i], per_group, rtol=1e-9, atol=1e-12)
            assert b.busy_s[i] == pytest.approx(per_group.sum(), rel=1e-9, abs=1e-12)
            if per_group.sum() > 0:
                assert per_group[b.group[i]] == per_group.max()
            # the bar's bins: the same group is busiest in each one
            for k in range(int(a // b.bin_s), min(int(z // b.bin_s), n_bins - 1) + 1):
                e0, e1 = max(k * b.bin_s, a), min((k + 1) * b.bin_s, z)
                in_bin = np.array([_overlap(lo[g == j], hi[g == j], e0, e1).sum() for j in range(N_GROUPS)])
                if in_bin.sum() > 1e-12:
                    assert in_bin[b.group[i]] >= in_bin.max() - 1e-12
            inside = (hi >= a) & (lo <= z) & (mb >= 0)
            if b.mb_lo[i] >= 0:
                assert mb[inside].min() <= b.mb_lo[i] <= b.mb_hi[i] <= mb[inside].max()
        # adjacent bars of a row differ in group, or a bin without spans lies between them
        for i, j in zip(bars, bars[1:]):
            touching = int(b.end_s[i] // b.bin_s) + 1 >= int(b.start_s[j] // b.bin_s)
            assert b.group[i] != b.group[j] or not touching


def test_a_span_of_no_length_and_spans_on_bin_edges():
    row = np.array([0, 0, 0, 1])
    group = np.array([0, 1, 2, 3])
    mb = np.array([0, 1, -1, 5])
    start = np.array([0.0, 1.0, 2.5, 3.0])  # bins of 1.0 over [0, 4]
    end = np.array([1.0, 2.5, 2.5, 4.0])  # [0, 1) ends on an edge; 2.5 has no length; one ends at t_end
    b = binned_bars(row, group, mb, start, end, 4, 4.0, 4)
    got = [(int(r), int(g), s, e, busy, int(n)) for r, g, s, e, busy, n in
           zip(b.row, b.group, b.start_s, b.end_s, b.busy_s, b.n_spans)]
    assert got == [(0, 0, 0.0, 1.0, 1.0, 1), (0, 1, 1.0, 2.5, 1.5, 2), (1, 3, 3.0, 4.0, 1.0, 1)]
    assert b.mb_lo.tolist() == [0, 1, 5] and b.mb_hi.tolist() == [0, 1, 5]
    empty = binned_bars(row[:0], group[:0], mb[:0], start[:0], end[:0], 4, 0.0, 10)
    assert len(empty.row) == 0 and empty.group_busy_s.shape == (0, 4)


@pytest.mark.parametrize("n_bins", [1, 7, 100])
def test_overlapping_spans_count_once(n_bins):
    """Spans of a receive stream overlap (transfers to one rank): busy time is the union of a
    row's spans, as merging counts it, so no bar is busier than it is long."""
    from clustersim.analysis.intervals import length, union

    rng = np.random.default_rng(3)
    start = np.sort(rng.uniform(0, 10, 300))
    end = start + rng.exponential(0.3, 300)
    row = np.zeros(300, dtype=np.int64)
    b = binned_bars(row, rng.integers(0, N_GROUPS, 300), np.full(300, -1), start, end, N_GROUPS, float(end.max()),
                    n_bins)
    assert b.busy_s.sum() == pytest.approx(length(union(zip(start.tolist(), end.tolist()))), rel=1e-12)
    assert np.all(b.busy_s <= b.dur_s * (1 + 1e-12) + 1e-15)
    np.testing.assert_allclose(b.group_busy_s.sum(axis=1), b.busy_s, rtol=1e-12)
    assert b.n_spans.sum() == 300


@pytest.mark.parametrize("seed,n_bins", [(0, 50), (5, 333)])
def test_cells_in_order_give_the_same_bars_without_a_sort(seed, n_bins, monkeypatch):
    """Pieces that come in cell order (rows whose spans never reach back into an earlier bin)
    are grouped without np.unique and reduced with reduceat instead of ufunc.at: the same
    bars, bit for bit, as the general way."""
    c = _random_rows(seed)
    args = (c["row"], c["group"], c["mb"], c["start_s"], c["end_s"], N_GROUPS, float(c["end_s"].max()), n_bins)
    in_order = []
    cells = bins._cells
    monkeypatch.setattr(bins, "_cells", lambda ids: in_order.append(cells(ids)[2] is not None) or cells(ids))
    fast = binned_bars(*args)
    monkeypatch.setattr(bins, "_cells", lambda ids: (*np.unique(ids, return_inverse=True), None))
    slow = binned_bars(*args)
    assert in_order == [True]
    for f in dataclasses.fields(bins.BinnedBars):
        a, b = getattr(fast, f.name), getattr(slow, f.name)
        assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()) if isinstance(a, np.ndarray) \
            else a == b, f.name


@pytest.mark.parametrize("seed,n_bins,chunk", [(1, 50, 500), (2, 333, 399), (3, 77, 1)])
def test_rows_binned_in_chunks_give_the_bars_of_all_at_once(seed, n_bins, chunk):
    """Rows are binned chunk by chunk (whole rows of about ``chunk`` spans; a row longer than
    that is a chunk of its own) and the bars put end to end: bit for bit the bars of all the
    rows binned at once."""
    c = _random_rows(seed, n_rows=7, per_row=150)
    args = (c["row"], c["group"], c["mb"], c["start_s"], c["end_s"], N_GROUPS, float(c["end_s"].max()), n_bins)
    whole = binned_bars(*args, chunk=len(c["row"]))
    parts = binned_bars(*args, chunk=chunk)
    assert len(np.unique(parts.row)) == 7
    for f in dataclasses.fields(bins.BinnedBars):
        a, b = getattr(parts, f.name), getattr(whole, f.name)
        assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()) if isinstance(a, np.ndarray) \
            else a == b, f.name


def test_bins_are_halved_until_the_bars_fit():
    c = _random_rows(4, n_rows=5, per_row=600)
    args = (c["row"], c["group"], c["mb"], c["start_s"], c["end_s"], N_GROUPS, float(c["end_s"].max()))
    fine = binned_bars(*args, n_bins=1000)
    assert len(fine.row) > 200
    fit = binned_within(*args, budget=200, n_bins=1000)
    n_bins = round(args[-1] / fit.bin_s)
    assert n_bins < 1000 and len(fit.row) <= 200 < len(binned_bars(*args, n_bins=2 * n_bins).row)
    assert fit.busy_s.sum() == pytest.approx(fine.busy_s.sum(), rel=1e-12)


def _adjacent_runs(c: dict[str, np.ndarray], t_end: float, n_bins: int) -> int:
    """Runs of adjacent bins holding pieces, row by row, counted from the pieces themselves."""
    span, k, _, _ = bins._pieces(c["start_s"], c["end_s"], t_end / n_bins, n_bins)
    cells = np.unique(c["row"][span] * n_bins + k)
    row, b = np.divmod(cells, n_bins)
    return int(1 + ((row[1:] != row[:-1]) | (b[1:] != b[:-1] + 1)).sum()) if len(cells) else 0


def _spans_on_edges(seed: int, t_end: float, n_bins: int) -> dict[str, np.ndarray]:
    """Spans of two rows that start or end exactly on bin edges (pieces of no length at a
    span's first or last bin), some of no length, some overlapping (a receive stream)."""
    rng = np.random.default_rng(seed)
    bin_s = t_end / n_bins
    edge = rng.integers(0, n_bins, 300) * bin_s
    start = np.where(rng.random(300) < 0.5, edge, rng.uniform(0, t_end, 300))
    end = np.where(rng.random(300) < 0.3, start, np.minimum(start + rng.choice([bin_s, 3 * bin_s, 0.01], 300), t_end))
    end = np.where(rng.random(300) < 0.3, (np.floor(end / bin_s) * bin_s).clip(start), end)
    row = rng.integers(0, 2, 300)
    order = np.lexsort((start, row))
    return {"row": row[order], "group": rng.integers(0, N_GROUPS, 300)[order], "mb": np.full(300, -1),
            "start_s": start[order], "end_s": end[order]}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("n_bins", [1, 3, 50, 200, 1000])
def test_runs_of_bins_bound_the_bars_from_below(seed, n_bins):
    """runs_at_least: on spans off the bin edges, exactly the runs of adjacent bins with pieces
    in them; on spans whose first or last piece has no length, never more; and never more
    than the bars (a bar is a run of adjacent bins of one group)."""
    c = _random_rows(seed)
    t_end = float(c["end_s"].max())
    bound = bins.runs_at_least(c["row"], c["start_s"], c["end_s"], t_end, n_bins)
    assert bound == _adjacent_runs(c, t_end, n_bins)
    assert bound <= len(binned_bars(c["row"], c["group"], c["mb"], c["start_s"], c["end_s"], N_GROUPS, t_end,
                                    n_bins).row)
    e = _spans_on_edges(seed, 10.0, n_bins)
    bound = bins.runs_at_least(e["row"], e["start_s"], e["end_s"], 10.0, n_bins)
    assert bound <= _adjacent_runs(e, 10.0, n_bins)
    assert bound <= len(binned_bars(e["row"], e["group"], e["mb"], e["start_s"], e["end_s"], N_GROUPS, 10.0,
                                    n_bins).row)


@pytest.mark.parametrize("budget", [5, 60, 400, 10_000, None])
def test_bins_passed_over_give_the_same_bars(budget, monkeypatch):
    """binned_within skips the numbers of bins whose runs alone are over the budget: the bars
    are those of halving and binning each time, field by field, with fewer binnings. (None:
    a budget of exactly the bars at 125 bins, which the finer numbers do not fit.)"""
    c = _random_rows(7, n_rows=4, per_row=500)
    args = (c["row"], c["group"], c["mb"], c["start_s"], c["end_s"], N_GROUPS, float(c["end_s"].max()))
    if budget is None:  # sparse spans of one group: a bar per run of bins, the bound exact
        rng = np.random.default_rng(7)
        start = np.cumsum(rng.exponential(0.05, (4, 300)), axis=1).reshape(-1)
        end = start + rng.uniform(0, 0.002, 1200)
        args = (np.repeat(np.arange(4), 300), np.zeros(1200, dtype=np.int64), np.full(1200, -1), start, end,
                N_GROUPS, float(end.max()))
        budget = len(binned_bars(*args, n_bins=125).row)
        assert bins.runs_at_least(*args[:1], *args[3:5], args[6], 125) == budget
        assert len(binned_bars(*args, n_bins=250).row) > budget
    made = []
    binned = bins.binned_bars
    monkeypatch.setattr(bins, "binned_bars", lambda *a: made.append(a[-1]) or binned(*a))
    fast = binned_within(*args, budget=budget, n_bins=1000)
    n_bins, tried = 1000, []
    while True:  # the plain loop
        tried.append(n_bins)
        slow = binned(*args, n_bins)
        if len(slow.row) <= budget or n_bins == 1:
            break
        n_bins = max(1, n_bins // 2)
    assert made[-1] == tried[-1] and set(made) <= set(tried)
    if budget == 60:
        assert len(made) < len(tried)  # (here the runs alone rule out the finer bins)
    for f in dataclasses.fields(bins.BinnedBars):
        a, b = getattr(fast, f.name), getattr(slow, f.name)
        assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()) if isinstance(a, np.ndarray) \
            else a == b, f.name


SMALL = scenario_dict(name="bins", description="a step drawn in bins")


@pytest.fixture(scope="module")
def result() -> clustersim.Result:
    return clustersim.simulate(clustersim.load_scenario(copy.deepcopy(SMALL), base_dir=ROOT), collapse=False)


@pytest.mark.parametrize("max_gap_s", [0.0, 1e-4, float("inf")])
def test_bar_count_is_what_merging_makes(result, max_gap_s):
    trace = result.trace
    order = span_order(trace)
    kind_phase, _, mb = report._span_keys(trace, order)
    row = np.repeat(np.arange(len(order.rows)), np.diff(order.bounds))
    key = kind_phase * (int(mb.max()) + 2) + (mb + 1)
    merged = report.merge_spans(trace, max_gap_s)
    assert bar_count(row, key, order.start_s, order.end_s, max_gap_s) == sum(len(b) for b in merged.values())


def _binned_figure(result, monkeypatch, budget: int) -> dict:
    monkeypatch.setattr(report, "BAR_BUDGET", budget)
    return report.timeline(result.trace, result.summary)


def test_timeline_past_the_budget_draws_runs_of_bins(result, monkeypatch):
    trace = result.trace
    n_merged = sum(len(b) for b in report.merge_spans(trace).values())
    assert report.timeline(trace, result.summary)["layout"].get("meta") is None  # under budget: merged bars
    budget = n_merged // 3
    fig = _binned_figure(result, monkeypatch, budget)
    meta = fig["layout"]["meta"]["binned"]
    assert meta["merged_bars"] == n_merged and meta["bars"] <= budget
    bars = [tr for tr in fig["data"] if tr["type"] == "bar"]
    assert sum(len(tr["base"]) for tr in bars) == meta["bars"]
    # every row keeps its spans' busy time: the bars' busy shares times their lengths
    rows = span_order(trace).rows
    spans = _rows(trace)
    busy_ms = dict.fromkeys(range(len(rows)), 0.0)
    bars_of = dict.fromkeys(range(len(rows)), 0)
    for tr in bars:
        for y, dur, text in zip(tr["y"].tolist(), tr["x"].tolist(), tr["hovertext"]):
            busy_ms[y] += float(text.split("<br>busy ")[1].split(" ms")[0].replace(",", ""))
            bars_of[y] += 1
            assert dur >= 0
    for i, row in enumerate(rows):
        expect = 1e3 * sum(s.end_s - s.start_s for s in spans[row])
        # each bar's hover rounds its busy time to 1 µs: half of that a bar at most
        assert busy_ms[i] == pytest.approx(expect, rel=1e-6, abs=0.5e-3 * bars_of[i] + 1e-9)
    go.Figure(fig)  # plotly accepts it as it is
    page = report.report_html(trace, result.summary, report.as_sent(fig))
    assert f"bins of {report.fmt_time(meta['bin_ms'] / 1e3)}" in page and f"{n_merged:,} bars" in page


def test_binned_timeline_renders_in_chromium(result, monkeypatch, tmp_path):
    monkeypatch.setattr(report, "BAR_BUDGET", 300)
    page_path = tmp_path / "report.html"
    report.write_report(page_path, result.trace, result.summary)
    with offline_page(page_path, f"#{report.DIV_ID} .main-svg", width_px=1600) as (page, errors):
        n_drawn = page.locator(f"#{report.DIV_ID} .barlayer .point path").count()
    fig = report.timeline(result.trace, result.summary)
    assert errors == []
    assert 0 < n_drawn == fig["layout"]["meta"]["binned"]["bars"] <= 300


@pytest.mark.parametrize("seed,n_bins", [(0, 50), (1, 7), (4, 1)])
def test_a_bar_names_the_microbatches_it_holds(seed, n_bins):
    """A run of bins counts the microbatches of its pieces and lists the first MB_LISTED;
    its hover names them as they are: a bar of microbatches 0 and 68 said "microbatches
    0–68", as if it held the 67 between."""
    c = _random_rows(seed)
    b = binned_bars(c["row"], c["group"], c["mb"], c["start_s"], c["end_s"], N_GROUPS, float(c["end_s"].max()),
                    n_bins)
    # worked out piece by piece: a bar holds the pieces of its row within its time
    span, _, lo, hi = bins._pieces(c["start_s"], c["end_s"], b.bin_s, n_bins)
    for i in range(len(b.row)):
        mine = (c["row"][span] == b.row[i]) & (lo >= b.start_s[i]) & (hi <= b.end_s[i])
        mbs = sorted(set(c["mb"][span[mine]].tolist()) - {-1})
        assert b.n_mbs[i] == len(mbs)
        assert b.mbs[i].tolist() == (mbs + [-1] * bins.MB_LISTED)[:bins.MB_LISTED]
    row, group = np.zeros(3, dtype=np.int64), np.zeros(3, dtype=np.int64)
    start, end = np.array([0.0, 1.0, 2.0]), np.array([1.0, 2.0, 3.0])
    said = lambda mb: report.binned_hover_texts(  # noqa: E731
        binned_bars(row, group, np.array(mb), start, end, 4, 3.0, 1), ["stage 0 · compute"])[0].split("<br>")[1]
    assert said([0, 68, 0]) == "stage 0 · compute · microbatches 0, 68"
    assert said([3, 4, 5]) == "stage 0 · compute · microbatches 3–5"
    assert said([7, 7, -1]) == "stage 0 · compute · microbatch 7"
    assert said([-1, -1, -1]) == "stage 0 · compute"
    many = binned_bars(np.zeros(6, dtype=np.int64), np.zeros(6, dtype=np.int64), np.array([0, 9, 20, 33, 40, 68]),
                       np.arange(6.0), np.arange(1.0, 7.0), 4, 6.0, 1)
    assert report.binned_hover_texts(many, ["s"])[0].split("<br>")[1] == "s · 6 microbatches in 0–68"
