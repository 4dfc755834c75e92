"""The HTML report: offline, escaped, summary panels, merged bars that keep the trace's busy time."""

from __future__ import annotations

import copy
import html
import json
import re
from pathlib import Path

import numpy as np
import plotly
import plotly.graph_objects as go
import pytest

import clustersim
from clustersim.analysis.intervals import length, union
from clustersim.output.report import (
    DIV_ID, FADE_LEVELS, LINKS_DIV_ID, MEMORY_DIV_ID, Bar, _typed_array, bar_hover, build_figure,
    critical_path_html, fade_level, fmt_bytes, fmt_flops, fmt_time, merge_spans, merge_stream, path_pieces, path_trace, plot_div,
    report_html, row_labels, write_report,
)
from clustersim.output.summary import format_summary
from clustersim.trace import Span, Trace, gpu_ranges

from .conftest import offline_page, scenario_dict

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")

SMALL = scenario_dict(name="small <tp4> & pp2", description='tiny "model" <script>alert(1)</script>')


def _simulate(collapse: bool | None = None) -> clustersim.Result:
    return clustersim.simulate(clustersim.load_scenario(copy.deepcopy(SMALL), base_dir=ROOT), collapse=collapse)


@pytest.fixture(scope="module")
def result() -> clustersim.Result:
    return _simulate()


@pytest.fixture(scope="module")
def report(result, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("report") / "report.html"
    write_report(path, result.trace, result.summary)
    return path.read_text(encoding="utf-8")


# --------------------------------------------------------------------------- the page


def test_report_needs_no_network(report):
    # no script, stylesheet, font or image fetched from anywhere: plotly.js is inlined
    assert not re.search(r"""<script[^>]*\bsrc\s*=""", report, re.I)
    assert not re.search(r"""<link[^>]*\bhref\s*=\s*["']?(https?:)?//""", report, re.I)
    assert not re.search(r"""<img[^>]*\bsrc\s*=\s*["']?(https?:)?//""", report, re.I)
    assert not re.search(r"@import|@font-face|url\(\s*['\"]?(https?:)?//", report, re.I)
    assert "Plotly.newPlot" in report
    assert len(report) > 1_000_000  # the inlined plotly.js bundle itself


def test_report_escapes_user_strings(report):
    assert "<script>alert(1)</script>" not in report
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in report
    assert "small &lt;tp4&gt; &amp; pp2" in report


def test_report_shows_headline_numbers(result, report):
    s = result.summary
    assert f'{s["step_time_s"]:#.4g} s' in report  # as the terminal summary prints it
    assert f'{100 * s["mfu"]:.1f} %' in report
    assert f'{100 * s["hfu"]:.1f} %' in report
    assert f'{100 * s["bubble_fraction"]:.1f} %' in report
    assert f'{s["tokens_per_s"]:,.0f}' in report
    assert f'{s["tflops_per_gpu"]:.1f}' in report
    for k, busy in s["comm_s"].items():
        if busy > 0:
            assert f'<td class="l">{k}</td>' in report


def _section(page: str, title: str) -> str:
    """From ``title`` to the next panel heading."""
    start = page.index(title)
    return page[start:page.index("<h2>", start)]


def test_memory_table_has_a_row_per_stage_and_a_verdict(result, report):
    table = _section(report, "Memory per GPU")
    stages = result.summary["memory"]["stages"]
    assert table.count("<tr>") == len(stages) + 1  # + the header row
    assert table.count('class="fits">fits') == sum(st["fits"] for st in stages) == len(stages)
    for st in stages:  # the verdict says by how much
        assert f'{st["margin_bytes"] / 1024**3:.1f} GiB spare' in table
    assert "DOES NOT FIT" not in table


def test_memory_table_flags_a_stage_that_does_not_fit(result):
    summary = copy.deepcopy(result.summary)
    st = summary["memory"]["stages"][1]
    st["capacity_bytes"], st["fits"] = st["peak_bytes"] / 2, False
    summary["memory"]["fits"] = False
    page = report_html(result.trace, summary, build_figure(result.trace, summary))
    table = _section(page, "Memory per GPU")
    assert table.count("DOES NOT FIT") == 1
    assert "DOES NOT FIT" in page[:page.index("Memory per GPU")]  # the headline card too
    # the step time's card says it too, and the terminal's step time line
    assert "the plan does not fit in memory" in page[:page.index("tokens / s")]
    assert "the plan does not fit" not in report_html(result.trace, result.summary, build_figure(result.trace, result.summary))
    step_line = next(x for x in format_summary(summary).splitlines() if x.startswith("step time"))
    assert step_line.endswith("(DOES NOT FIT in memory: the step it would take if it did)")
    assert "FIT" not in next(x for x in format_summary(result.summary).splitlines() if x.startswith("step time"))
    summary["plan"]["microbatches"] = 1
    assert " · 1 microbatch x " in format_summary(summary)


def test_report_is_deterministic(result, tmp_path):
    a, b = tmp_path / "a.html", tmp_path / "b.html"
    write_report(a, result.trace, result.summary)
    write_report(b, result.trace, result.summary)
    assert a.read_bytes() == b.read_bytes()
    assert f'id="{DIV_ID}"' in a.read_text(encoding="utf-8")


# --------------------------------------------------------------------------- the figure


def _rows(trace: Trace) -> dict[tuple[int, str], list[Span]]:
    out: dict[tuple[int, str], list[Span]] = {}
    for s in trace.spans:
        out.setdefault((s.rank, s.stream), []).append(s)
    return out


@pytest.mark.parametrize("collapse", [None, False])
def test_bars_keep_every_span_and_its_busy_time(collapse):
    trace = _simulate(collapse).trace
    merged = merge_spans(trace)
    spans = _rows(trace)
    assert set(merged) == set(spans)
    for row, bars in merged.items():
        assert sum(b.n_spans for b in bars) == len(spans[row])
        busy = length(union((s.start_s, s.end_s) for s in spans[row]))
        assert sum(b.busy_s for b in bars) == pytest.approx(busy, rel=1e-9, abs=1e-12)
        for b, nxt in zip(bars, bars[1:]):
            assert b.end_s <= nxt.start_s + 1e-12
        assert all(b.busy_s <= b.dur_s + 1e-12 for b in bars)
    assert sum(len(b) for b in merged.values()) < len(trace.spans)


def test_figure_draws_each_bar_once_in_its_row(result):
    trace = result.trace
    fig = build_figure(trace, result.summary)
    merged = merge_spans(trace)
    rows = list(merged)
    assert list(fig.layout.yaxis.ticktext) == row_labels(trace, rows)
    drawn: dict[int, list[tuple[float, float]]] = {}
    for tr in fig.data:
        if tr.name == "critical path":  # the line over the bars, tested on its own
            continue
        assert tr.type == "bar" and tr.orientation == "h"
        assert len(tr.y) == len(tr.x) == len(tr.base) == len(tr.hovertext)
        for y, base, dur in zip(tr.y, tr.base, tr.x):
            drawn.setdefault(int(y), []).append((float(base), float(dur)))
    for i, row in enumerate(rows):
        expect = sorted((b.start_s * 1e3, b.dur_s * 1e3) for b in merged[row])
        got = sorted(drawn.get(i, []))
        assert len(got) == len(expect)
        for (b0, d0), (b1, d1) in zip(got, expect):
            assert b0 == pytest.approx(b1, abs=1e-5) and d0 == pytest.approx(d1, abs=1e-5)


def test_legend_has_one_entry_per_kind(result):
    fig = build_figure(result.trace, result.summary)
    shown = [t.name for t in fig.data if t.showlegend is not False]
    assert len(shown) == len(set(shown))
    assert {"forward compute", "backward compute", "optimizer step", "TP communication",
            "PP send / recv", "DP communication"} <= set(shown)
    for name in shown:  # every faded level shares its entry's legend group
        groups = {t.legendgroup for t in fig.data if t.name == name}
        assert len(groups) == 1


def test_row_labels_name_the_rank_when_a_stage_has_several():
    trace = _simulate(collapse=False).trace
    labels = row_labels(trace, [(9, "compute"), (0, "tp")])
    assert labels == [f"rank 9 (stage {trace.stage_of[9]}) · compute", "rank 0 (stage 0) · tp"]
    collapsed = _simulate().trace
    assert row_labels(collapsed, [(collapsed.ranks[1], "pp_fwd_recv")]) == ["stage 1 · pp_fwd_recv"]


def _span(start_s, end_s, *, mb=0, phase="F", kind="compute", layer=-1, name="x") -> Span:
    return Span(rank=0, stream="compute", name=name, kind=kind, start_s=start_s, end_s=end_s,
                mb=mb, phase=phase, layer=layer)


def test_merge_joins_a_microbatch_and_splits_on_key_or_long_gap():
    spans = [
        _span(0.0, 1.0, layer=0, name="F attn"), _span(1.0, 2.0, layer=0, name="F mlp"),
        _span(2.5, 3.0, layer=1, name="F attn"),  # gap 0.5: same bar, not busy
        _span(3.0, 4.0, mb=1),  # next microbatch: new bar
        _span(4.0, 5.0, mb=1, phase="B"),  # backward: new bar
        _span(9.0, 9.5, mb=1, phase="B"),  # gap 4 > max_gap 1: new bar
    ]
    bars = merge_stream(spans, max_gap_s=1.0)
    assert [(b.start_s, b.end_s, b.n_spans) for b in bars] == [
        (0.0, 3.0, 3), (3.0, 4.0, 1), (4.0, 5.0, 1), (9.0, 9.5, 1)]
    first: Bar = bars[0]
    assert first.busy_s == pytest.approx(2.5)
    assert (first.layer_lo, first.layer_hi) == (0, 1)
    assert (first.first_name, first.last_name) == ("F attn", "F attn")


_BLANK = re.compile(r"\s*")
# a call of the page's own, its div id first (plotly.js's bundle, inlined before them, names
# Plotly.newPlot(gd, ...) in its messages: plotly 5.18's does)
_CALL = re.compile(r'Plotly\.newPlot\(\s*(?=")')


def _plots(page: str) -> tuple[list[str], list[list]]:
    """The page cut at its ``Plotly.newPlot(...)`` calls: the text around them, and each
    call's arguments as parsed JSON (div id, data, layout, config)."""
    decoder = json.JSONDecoder()
    text: list[str] = []
    calls: list[list] = []
    i = 0
    while (m := _CALL.search(page, i)) is not None:
        j = m.end()
        text.append(page[i:j])
        args = []
        while True:
            arg, j = decoder.raw_decode(page, _BLANK.match(page, j).end())
            args.append(arg)
            j = _BLANK.match(page, j).end()
            if page[j] != ",":
                break
            j += 1
        calls.append(args)
        i = j
    text.append(page[i:])
    return text, calls


def _written(collapse, tmp_path: Path):
    """The small scenario simulated, and the page write_report writes of it, as :func:`_plots`
    splits it: (result, text around the plots, the plots' arguments)."""
    r = _simulate(collapse)
    path = tmp_path / "report.html"
    write_report(path, r.trace, r.summary)
    return (r, *_plots(path.read_text(encoding="utf-8")))


@pytest.mark.parametrize("collapse", [None, False])
def test_written_page_is_the_page_of_the_validated_figure(collapse, tmp_path):
    # write_report hands plotly the figures as the dicts plotly's validators would make of them;
    # the page must be the one build_figure's validated figure gives: the same figures (as
    # JSON: key order may differ) and, around them, the same bytes
    r, text, calls = _written(collapse, tmp_path)
    want_text, want_calls = _plots(report_html(r.trace, r.summary, build_figure(r.trace, r.summary)))
    assert text == want_text
    assert [c[0] for c in calls] == [c[0] for c in want_calls]
    assert calls == want_calls


@pytest.mark.parametrize("collapse", [None, False])
def test_every_figure_on_the_page_is_what_plotly_validation_gives(collapse, tmp_path):
    # no validator runs while writing the page: each figure it embeds (timeline, memory, links)
    # must already be what go.Figure(...).to_dict() gives for it, with the "plotly_white"
    # template expanded as plotly expands the name and numeric arrays as plotly sends them
    _, _, calls = _written(collapse, tmp_path)
    div_ids = {c[0] for c in calls}
    assert {DIV_ID, MEMORY_DIV_ID} <= div_ids and (collapse is not None or LINKS_DIV_ID in div_ids)
    for div_id, data, layout, _config in calls:
        named = {"data": data, "layout": {**layout, "template": "plotly_white"}}
        assert json.loads(go.Figure(named).to_json()) == {"data": data, "layout": layout}, div_id


def _merge_one_by_one(spans: list[Span], max_gap_s: float) -> list[Bar]:
    """The merge written bar by bar: what the column-wise merge must give, float for float."""
    bars: list[Bar] = []
    run: list[Span] = []
    busy = covered = 0.0

    def close():
        layers = [s.layer for s in run if s.layer >= 0]
        bars.append(Bar(rank=run[0].rank, stream=run[0].stream, kind=run[0].kind, phase=run[0].phase, mb=run[0].mb,
                        start_s=run[0].start_s, end_s=max(s.end_s for s in run), busy_s=busy, n_spans=len(run),
                        first_name=run[0].name, last_name=run[-1].name, layer_lo=min(layers, default=-1),
                        layer_hi=max(layers, default=-1), size_bytes=sum(s.size_bytes for s in run),
                        flops=sum(s.flops for s in run)))

    for s in spans:
        if run and ((s.kind, s.phase, s.mb) != (run[0].kind, run[0].phase, run[0].mb)
                    or s.start_s - covered > max_gap_s):
            close()
            run = []
        if not run:
            busy, covered = 0.0, s.start_s
        busy += max(0.0, s.end_s - max(s.start_s, covered))
        covered = max(covered, s.end_s)
        run.append(s)
    if run:
        close()
    return bars


@pytest.mark.parametrize("collapse", [None, False])
def test_merge_gives_what_merging_bar_by_bar_gives(collapse):
    trace = _simulate(collapse).trace
    max_gap_s = 0.002 * trace.end_s
    merged = merge_spans(trace, max_gap_s)
    for row, spans in _rows(trace).items():
        assert merged[row] == _merge_one_by_one(sorted(spans, key=lambda s: (s.start_s, s.end_s)), max_gap_s)


def test_merge_of_overlapping_and_odd_spans_gives_what_merging_bar_by_bar_gives():
    spans = [
        _span(0.0, 3.0, layer=2, name="a"), _span(1.0, 2.0, layer=0, name="b"),  # inside the first
        _span(2.5, 2.5, name="zero length"), _span(3.2, 3.1, name="ends before it starts"),
        _span(3.0, 4.0, mb=1), _span(2.0, 5.0, mb=2),  # overlaps the bar before: covered goes back
        _span(5.5, 6.0, mb=2, layer=7), _span(9.0, 9.5, mb=2), _span(9.0, 9.5, mb=2, phase="B"),
    ]
    for max_gap_s in (0.0, 0.4, 1.0, float("inf")):
        assert merge_stream(spans, max_gap_s) == _merge_one_by_one(spans, max_gap_s)


def test_hover_text_and_fade_of_a_bar():
    bar = Bar(rank=0, stream="tp", kind="tp", phase="F", mb=3, start_s=0.0125, end_s=0.0175, busy_s=0.0025,
              n_spans=4, first_name="AR <qkv>", last_name="AR out", layer_lo=1, layer_hi=2,
              size_bytes=3 * 1024**2, flops=0.0)
    assert bar_hover(bar, "stage 0 · tp") == (
        "<b>AR &lt;qkv&gt; … AR out (4 spans)</b><br>stage 0 · tp · microbatch 3 · layers 1–2<br>"
        "start 12.500 ms · duration 5.000 ms<br>busy 2.500 ms (50 % of the bar)<br>data 3.0 MiB")
    assert FADE_LEVELS[fade_level(bar)][1] == 0.6  # half busy
    whole = Bar(rank=0, stream="compute", kind="compute", phase="B", mb=-1, start_s=1.0, end_s=1.0, busy_s=0.0,
                n_spans=1, first_name="B mlp", last_name="B mlp", layer_lo=5, layer_hi=5, size_bytes=0.0, flops=2e12)
    assert bar_hover(whole, "stage 1 · compute") == (
        "<b>B mlp</b><br>stage 1 · compute · layer 5<br>start 1,000.000 ms · duration 0.000 ms<br>2 TFLOP")
    assert fade_level(whole) == 0  # no length: counts as busy
    # one style of number in every hover: thousands separated, no exponent
    assert [fmt_flops(f) for f in (2e12, 999.4e12, 1.69e15, 1.5e18, 5e7)] == \
        ["2 TFLOP", "999 TFLOP", "1.69 PFLOP", "1,500 PFLOP", "50 MFLOP"]
    assert fmt_bytes(1002 * 1024**2) == "1,002.0 MiB" and fmt_bytes(1500 * 1024**3) == "1,500.00 GiB"
    assert fmt_time(3600.0) == "3,600 s" and fmt_time(12.3) == "12.3 s"


# --------------------------------------------------------------------------- in a browser

# the spans the page's zoomed-in layer draws (clustersim.output.zoom), one rectangle each
DETAIL_DRAWN_JS = f"document.querySelectorAll('#{DIV_ID} g.clustersim-spans rect').length"
BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run"]


def test_report_renders_offline_in_chromium(result, tmp_path):
    page_path = tmp_path / "report.html"
    write_report(page_path, result.trace, result.summary)
    # (errors: what its scripts raised or logged, and anything tried beyond file://)
    with offline_page(page_path, f"#{DIV_ID} .main-svg", width_px=1600) as (page, errors):
        n_bars = page.locator(f"#{DIV_ID} .barlayer .point path").count()
        shot = tmp_path / "report.png"
        page.screenshot(path=str(shot), full_page=True)
        # the mode bar (shown on hover) stands clear of the timeline's legend
        legend, modebar = (page.locator(f"#{DIV_ID} {sel}").first.bounding_box() for sel in (".legend", ".modebar"))
        page.set_viewport_size({"width": 800, "height": 1000})  # a narrow window: wide tables scroll in place
        page.wait_for_timeout(300)
        page_width_px = page.evaluate("document.documentElement.scrollWidth")
        # the box under the timeline's note names the rank a GPU runs as
        page.click("details.gpus summary")
        page.fill("#gpu-find", "13")
        found = page.inner_text("#gpu-found")
        page.fill("#gpu-find", "99")  # past the last GPU
        past = page.inner_text("#gpu-found")
    assert errors == []
    assert n_bars == sum(len(b) for b in merge_spans(result.trace).values())
    assert shot.stat().st_size > 10_000
    assert page_width_px <= 800
    rank = result.summary["simulation"]["simulated_rank_of_gpu"][13]
    assert found == (f"GPU 13 runs as rank {rank} (stage {result.trace.stage_of[rank]}): "
                     "its rows are that rank\u2019s.") and past == "no GPU 99 here (0-15)"
    assert legend and modebar and (modebar["x"] >= legend["x"] + legend["width"]
                                   or modebar["y"] >= legend["y"] + legend["height"]
                                   or legend["x"] >= modebar["x"] + modebar["width"]
                                   or legend["y"] >= modebar["y"] + modebar["height"]), (legend, modebar)


def test_report_says_which_gpus_each_rank_stands_for(result, report, tmp_path):
    """Collapsed, a folded table under the timeline's note lists each simulated rank's GPUs
    (summary.json's ``simulation.simulated_rank_of_gpu``) and the page holds that map for its
    box; every rank simulated, there is none."""
    rep = result.summary["simulation"]["simulated_rank_of_gpu"]
    table = report[report.index('<details class="gpus">'):report.index("</details>")]
    rows = re.findall(r"<tr><td>(\d+)</td><td>(\d+)</td><td>(\d+)</td><td class=\"wide l\">([^<]*)</td></tr>", table)
    assert [int(r) for r, *_ in rows] == result.trace.ranks
    for r, stage, n, which in rows:
        gpus = [g for g, x in enumerate(rep) if x == int(r)]
        assert (int(stage), int(n), which) == (result.trace.stage_of[int(r)], len(gpus), gpu_ranges(gpus))
    assert f"const rep={json.dumps(rep, separators=(',', ':'))}," in report
    full = _simulate(collapse=False)
    path = tmp_path / "report.html"
    write_report(path, full.trace, full.summary)
    assert '<details class="gpus">' not in path.read_text(encoding="utf-8")


def test_busiest_links_table_lists_the_summary_links(result, report):
    table = _section(report, "Busiest links")
    busiest = result.summary["links"]["busiest"]
    # links alike in every figure (twins of one orbit) share a row, each named in its title
    from clustersim.output.report import _pct, fmt_bytes

    figures = [(u["kind"], fmt_bytes(u["bytes"]), round(u["bw_Bps"] / 1e9), _pct(u["utilisation"]),
                _pct(u["peak_utilisation"])) for u in busiest]
    # (a row for each figures alike, wherever they rank; then a row a kind, each with its head)
    kinds = result.summary["links"]["by_kind"]
    assert busiest and kinds and table.count("<tr>") == len(set(figures)) + 1 + len(kinds) + 1
    for u in busiest:
        assert u["link"].replace(">", "&gt;") in table
        assert 0 < u["utilisation"] <= u["peak_utilisation"] <= 1 + 1e-9


def test_links_alike_share_a_row_and_a_line():
    """Ten twins with the same bytes and use: one row of the table and one line of the chart,
    named by the first and how many more; a link that differs keeps its own."""
    from clustersim.output.report import links_figure, links_html

    def link(i: int, use: float) -> dict:
        return {"link": f"leaf1.0->n{32 + i}.nic0", "kind": "nic", "bytes": use * 1e12, "bw_Bps": 45e9,
                "utilisation": use, "peak_utilisation": 1.0, "utilisation_over_time": [use, 1.0]}

    s = {"step_time_s": 1.0, "links": {"busiest": [link(i, 0.5) for i in range(10)] + [link(10, 0.4)]}}
    table = links_html(s)
    assert table.count("<tr>") == 3 and "leaf1.0-&gt;n32.nic0 and 9 alike" in table
    assert 'title="leaf1.0-&gt;n32.nic0, leaf1.0-&gt;n33.nic0,' in table and "n42.nic0</td>" in table
    names = [t["name"] for t in links_figure(s)["data"]]
    assert names == ["leaf1.0->n32.nic0 and 9 alike (nic)", "leaf1.0->n42.nic0 (nic)"]
    # alike to the end of the ten busiest that summary.json lists: more may be alike past them
    full = {"step_time_s": 1.0, "links": {"busiest": [link(i, 0.5) for i in range(10)]}}
    assert "n32.nic0 and at least 9 alike" in links_html(full).replace("&gt;", ">")
    assert [t["name"] for t in links_figure(full)["data"]] == ["leaf1.0->n32.nic0 and at least 9 alike (nic)"]
    # two orbits' twins of one mean use, ranked by name, alternate: still one line each (three
    # of five legend entries drew nothing, under another's line)
    a = [{**link(i, 0.5), "utilisation_over_time": [0.5, 1.0] if i % 2 else [1.0, 0.5]} for i in range(5)]
    names = [t["name"] for t in links_figure({"step_time_s": 1.0, "links": {"busiest": a}})["data"]]
    assert names == ["leaf1.0->n32.nic0 and 2 alike (nic)", "leaf1.0->n33.nic0 and 1 alike (nic)"]
    # each kind's highest peak, under the busiest by mean use (a NIC at 99 % for moments ranked
    # below NVLink links busier on the mean, and no row showed it)
    s["links"]["by_kind"] = {"nic": {"links": 128, "bytes": 2e12, "max_utilisation": 0.052,
                                     "max_peak_utilisation": 0.991}}
    assert ("<td>128</td><td>1,862.65 GiB</td><td>5.2 %</td><td>99.1 %</td>" in links_html(s)
            and "each kind's highest peak" in links_html(s))


def test_report_draws_the_critical_path_and_explains_exposed_comm(result, report):
    s = result.summary
    fig = build_figure(result.trace, s)
    (path,) = [t for t in fig.data if t.name == "critical path"]
    # one horizontal stroke per segment, from its start to its end, on its rank's compute row
    segs = s["critical_path"]["segments"]
    assert len(path.x) == 2 * len(segs)
    assert path.x[0] == pytest.approx(1e3 * segs[0]["start_s"]) and path.x[-1] == pytest.approx(1e3 * s["step_time_s"])
    labels = list(fig.layout.yaxis.ticktext)
    for y, seg in zip(path.y[::2], segs):
        assert labels[int(y)].endswith("· compute") and f'stage {seg["stage"]}' in labels[int(y)]
    assert "<h2>Critical path</h2>" in report and "<h2>Exposed communication by cause</h2>" in report
    top = s["exposed_comm_causes"][0]
    assert html.escape(top["collective"]) in report and html.escape(top["bottleneck"]["link"]) in report
    assert "warm-up</th>" in report and "imbalance</th>" in report


def _segment(rank: int, start_s: float, end_s: float) -> dict:
    return {"rank": rank, "stage": rank, "start_s": start_s, "end_s": end_s, "tasks": 3, "first": "F a", "last": "B b",
            "compute_s": end_s - start_s, "comm_s": 0.0}


def test_critical_path_back_and_forth_is_drawn_as_one_stretch():
    # a pipeline's steady state: the path goes back and forth between two stages far faster
    # than the full-width view can show (a stay of 0.016 s in a 10 s step, under 2 px); the
    # walk down the stages into it and out of it, and a long stay after, stay hop by hop
    walk_in = [_segment(r, 0.01 * r, 0.01 * (r + 1)) for r in range(2)]  # ranks 0, 1
    t0 = walk_in[-1]["end_s"]
    steady = [_segment(2 + k % 2, t0 + 0.016 * k, t0 + 0.016 * (k + 1)) for k in range(500)]
    t1 = steady[-1]["end_s"]
    walk_out = [_segment(4, t1, t1 + 0.01)]
    tail = [_segment(5, t1 + 0.01, 10.0)]
    segments = walk_in + steady + walk_out + tail
    summary = {"step_time_s": 10.0, "critical_path": {"segments": segments}}
    assert path_pieces(segments, 10.0) == [(0, 0), (1, 1), (2, 501), (502, 502), (503, 503)]
    rows = [(r, s) for r in range(6) for s in ("compute", "pp")]  # rank r's compute row is 2r
    path = path_trace(summary, rows)
    xs, ys = path["x"], path["y"]
    # no hop between the stretch's two rows while it lasts: one line along each
    assert [x for x in xs if x is not None and 1e3 * t0 < x < 1e3 * t1] == []
    strokes = {(a, b, y) for a, b, y, y2 in zip(xs, xs[1:], ys, ys[1:]) if a is not None and b is not None and y == y2}
    assert {(1e3 * t0, 1e3 * t1, 4), (1e3 * t0, 1e3 * t1, 6)} <= strokes
    # the walks and the tail: one stroke per segment on its rank's compute row
    for seg in walk_in + walk_out + tail:
        assert (1e3 * seg["start_s"], 1e3 * seg["end_s"], 2 * seg["rank"]) in strokes
    # connected: the walk hops from rank 1 into the stretch at rank 2's row (its first stay);
    # the stretch's last stay, on rank 3, hops on to the walk out
    k = xs.index(None)
    assert (xs[k - 2], ys[k - 2], xs[k - 1], ys[k - 1]) == (1e3 * t0, 2, 1e3 * t0, 4)
    last = len(xs) - 1 - xs[::-1].index(None)  # the stretch's last line, on rank 3's row
    assert (xs[last + 1], ys[last + 1], xs[last + 2], ys[last + 2], xs[last + 3], ys[last + 3]) == (
        1e3 * t0, 6, 1e3 * t1, 6, 1e3 * t1, 8)
    hover = path["hovertext"][last + 1]
    assert "back and forth among 2 ranks" in hover and "rank 2 (stage 2): 50.0 %, 250 stays" in hover
    note = critical_path_html({**summary, "critical_path": {
        **summary["critical_path"], "length_s": 10.0, "tasks": 3 * len(segments), "ranks_visited": 6,
        "by_kind_s": {"compute": 10.0}}})
    assert "1 stretch where it goes back and forth" in note


def test_critical_path_walks_in_and_out_of_a_stretch_stay_hop_by_hop():
    def short(ranks, t0=0.0):
        return [_segment(r, t0 + 0.01 * k, t0 + 0.01 * (k + 1)) for k, r in enumerate(ranks)]

    # a walk down three stages and back (each rank but the turn met twice) is no stretch
    v = short([1, 2, 3, 2, 1]) + [_segment(0, 0.05, 10.0)]
    assert path_pieces(v, 10.0) == [(i, i) for i in range(6)]
    # the walk in and the walk out meet ranks 4 and 5 at both ends of a back and forth between
    # 2 and 3: met again, but with a sliver of its time, they stay out of the stretch
    segs = short([5, 4] + [3, 2] * 40 + [3, 4, 5]) + [_segment(6, 0.85, 10.0)]
    assert path_pieces(segs, 10.0) == [(0, 0), (1, 1), (2, 82), (83, 83), (84, 84), (85, 85)]
    # a walk out to a rank met just before the back and forth (within 32 stays), with a sliver
    # of its time: out of the stretch
    segs = short([4] + [3, 2] * 14 + [3, 4, 5]) + [_segment(6, 0.32, 10.0)]
    assert path_pieces(segs, 10.0) == [(0, 0), (1, 29), (30, 30), (31, 31), (32, 32)]
    # an interleaved warm-up: three walks down 16 stages, each rank met three times; its hops
    # are apart enough to see, so it stays hop by hop
    walks = short(list(range(16)) * 3) + [_segment(0, 0.48, 10.0)]
    assert path_pieces(walks, 10.0) == [(i, i) for i in range(49)]
    # a cycle through four stages (a 4-stage 1F1B step): one stretch, a line on each row
    cycle = short([0, 1, 2, 3, 2, 1] * 30) + [_segment(0, 1.8, 10.0)]
    assert path_pieces(cycle, 10.0) == [(0, 179), (180, 180)]
    path = path_trace({"step_time_s": 10.0, "critical_path": {"segments": cycle}}, [(r, "compute") for r in range(4)])
    strokes = {(y, a, b) for a, b, y, y2 in zip(path["x"], path["x"][1:], path["y"], path["y"][1:])
               if a is not None and b is not None and y == y2}
    assert {(y, 0.0, 1800.0) for y in range(4)} <= strokes


def test_critical_path_of_a_small_step_is_drawn_hop_by_hop():
    # the same back and forth, slow enough to see (each stay 5 % of the step): no stretch
    segments = [_segment(k % 2, 0.05 * k, 0.05 * (k + 1)) for k in range(20)]
    summary = {"step_time_s": 1.0, "critical_path": {"segments": segments}}
    assert path_pieces(segments, 1.0) == [(i, i) for i in range(20)]
    path = path_trace(summary, [(0, "compute"), (1, "compute")])
    assert None not in path["x"] and len(path["x"]) == 40


def test_plot_script_survives_markup_in_texts():
    # a name is the user's text: "</script>" in it must not end the plot's script early, and
    # the data must read back as it was
    text = 'F </script><b>x</b> & <!-- \u2028 "q"'
    fig = {"data": [{"type": "bar", "name": text, "x": [1.5, 2.0], "hovertext": [text, "ok"]}],
           "layout": {"height": 300, "title": {"text": text}}}
    div = plot_div(fig, "some-plot", {"displaylogo": False})
    assert div.count("</script>") == 1 and div.endswith("</script></div>")
    assert "<!--" not in div and "<b>" not in div and "\u2028" not in div
    assert 'style="height:300px; width:100%;"' in div
    _, calls = _plots(div)
    assert calls == [["some-plot", fig["data"], fig["layout"], {"displaylogo": False}]]


_ARRAY_VALUES = ([1, 2, 3], [-200, 5], [70000, -1], [2**40, 1], [2**63 - 1, 0], [1.5, -2.25], [],
                 [[1.0, 2.0], [3.0, 4.0]])
_ARRAY_DTYPES = (None, "uint64", "float32", "int32")


def _fits(values: list, dtype: str | None) -> bool:
    if dtype not in ("uint64", "int32"):
        return True
    flat = [float(x) for x in np.ravel(np.array(values, dtype=object))]
    return all(np.iinfo(dtype).min <= x <= np.iinfo(dtype).max for x in flat)


@pytest.mark.parametrize(("values", "dtype"), [(v, d) for v in _ARRAY_VALUES for d in _ARRAY_DTYPES if _fits(v, d)])
def test_numeric_arrays_are_sent_as_plotly_sends_them(values, dtype):
    # the page's arrays must be what plotly's Figure.to_dict() makes of them (typed arrays with
    # plotly >= 6, narrowed ints), without plotly's converter
    v = np.array(values, dtype=dtype) if dtype else np.array(values)
    if int(plotly.__version__.split(".")[0]) < 6:
        assert _typed_array(v) is v
        return
    from _plotly_utils.utils import to_typed_array_spec

    want, got = to_typed_array_spec(v), _typed_array(v)
    if isinstance(want, dict):
        assert got == want
    else:
        assert isinstance(got, np.ndarray) and np.array_equal(got, want)


def test_page_with_the_bars_written_beforehand_is_the_page_dumped_whole(result, report):
    # prepare_report writes the bars' JSON before the summary exists and joins it with the
    # critical path's afterwards: the page must be byte for byte the one that dumps the whole
    # figure at once, with the critical path drawn
    from clustersim.output import report as rp

    whole = rp.report_html(result.trace, result.summary, rp.as_sent(rp.timeline(result.trace, result.summary)))
    assert report == whole
    assert '"mode":"lines","name":"critical path"' in whole  # the trace added after the bars


def test_plotlyjs_is_embedded_from_its_file_as_plotly_gives_it(monkeypatch):
    """The page embeds plotly.js from the file's bytes: the same bytes as plotly's own
    get_plotlyjs() encoded, and that where the file is not where plotly used to keep it."""
    from clustersim.output import report

    want = report.plotlyjs_script().encode("utf-8")
    assert report._plotlyjs_bytes() == want
    assert b"Plotly" in want[:100_000] and want.startswith(b'<script type="text/javascript">')
    monkeypatch.setattr(report, "PLOTLYJS_DATA", ("plotly", "package_data/no-such-file.js"))
    assert report._plotlyjs_bytes() == want


def test_plan_line_names_sp_zero_and_recompute_as_the_terminal_does(tmp_path):
    """The report's plan line holds what the terminal's does: SP, the ZeRO stage, recompute."""
    from clustersim.output.summary import format_summary

    d = copy.deepcopy(SMALL)
    d["parallel"] = {**d["parallel"], "sp": True, "zero": 1}
    d["training"] = {**d["training"], "recompute": "full"}
    r = clustersim.simulate(clustersim.load_scenario(d, base_dir=ROOT))
    path = tmp_path / "report.html"
    write_report(path, r.trace, r.summary)
    plan = re.search(r'<p class="meta">plan: ([^<]*)</p>', path.read_text(encoding="utf-8")).group(1)
    assert " · SP · ZeRO-1 · recompute full · " in html.unescape(plan)
    assert " · SP · ZeRO-1 · recompute full · " in format_summary(r.summary)


def test_link_use_is_drawn_from_each_bin_s_left_edge_to_the_step_s_end(result):
    """A step line ("hv") holds each value from its point to the next: the bins' points are
    their left edges, and the last value is held to the step's end (points at the bins'
    centres drew the whole curve half a bin late)."""
    from clustersim.output.report import links_figure

    fig = links_figure(result.summary)
    step_ms = 1e3 * result.summary["step_time_s"]
    for line in fig["data"]:
        n = len(line["x"]) - 1
        assert line["x"][0] == 0.0 and line["x"][-1] == step_ms
        assert line["x"][1] == pytest.approx(step_ms / n) and line["y"][-1] == line["y"][-2]


def test_the_steps_time_is_drawn_as_compute_exposed_communication_and_bubble(result, report):
    """The bar under the cards: its three parts, the summary's figures, fill the step exactly."""
    section = _section(report, "Where the step's time goes")
    widths = [float(w) for w in re.findall(r'<span style="width:([0-9.]+)%', section)]
    s = result.summary
    parts = [s["compute_s"], s["exposed_comm_s"]["total"], s["bubble_fraction"] * s["step_time_s"]]
    want = [100 * x / s["step_time_s"] for x in parts if x > 0]
    assert len(widths) == len(want) >= 2 and widths == pytest.approx(want, abs=1e-3)
    assert sum(widths) == pytest.approx(100, abs=0.01)
    for k in ("tp", "cp", "ep", "pp", "dp"):  # each kind of exposed communication named beside it
        assert (f"{k} {fmt_time(s['exposed_comm_s'][k])}" in section) == (s["exposed_comm_s"][k] > 0)


def test_plan_line_names_tp_over_nodes_the_gradients_dtype_and_a_schedule_only_where_it_orders():
    """The plan line says what changes a plan's cost and is not in its degrees: a TP group
    leaving its node, the gradients' dtype and the one they are reduced in (where they are), and the schedule
    (not for plain 1F1B on one stage, where it is gradient accumulation); the exposed line says
    where its kinds sum past its total."""
    def plan_line(**sections):
        r = clustersim.simulate(clustersim.load_scenario(scenario_dict(**sections), base_dir=ROOT))
        lines = format_summary(r.summary).splitlines()
        return next(x for x in lines if x.startswith("plan")), r.summary

    line, s = plan_line(parallel={"tp": 8, "pp": 1, "dp": 2, "order": "dp-tp-pp"})
    assert s["plan"]["tp_nodes"] == 2 and "TP8 over 2 nodes x PP1 x DP2 · fp32 grads · 4 microbatches" in line
    line, s = plan_line(parallel={"tp": 8, "pp": 1, "dp": 2}, training={"grad_reduce_dtype": "bf16"})
    assert s["plan"]["tp_nodes"] == 1 and "TP8 x PP1 x DP2 · fp32 grads reduced in bf16 · 4 microbatches" in line
    line, _ = plan_line(parallel={"tp": 8, "pp": 1, "dp": 2, "schedule": "gpipe"})
    assert " · gpipe · 4 microbatches" in line
    line, s = plan_line(parallel={"tp": 8, "pp": 2, "dp": 1})
    # (no reduction: the gradients' dtype alone, so that plans compared side by side read alike)
    assert s["plan"]["grad_reduce_dtype"] == "fp32" and " · fp32 grads · 1f1b · 8 microbatches" in line
    # selective recompute under flash attention changes nothing, and says so; under standard it does not
    line, _ = plan_line(parallel={"tp": 8, "pp": 2, "dp": 1}, training={"recompute": "selective"})
    assert " · recompute selective (a no-op: flash attention keeps no scores) · " in line
    line, _ = plan_line(parallel={"tp": 8, "pp": 2, "dp": 1}, training={"recompute": "selective",
                                                                      "attention": "standard"})
    assert " · recompute selective · " in line

    summary = copy.deepcopy(s)
    summary["comm_s"].update(tp=1.0, pp=1.0, dp=0.0)
    summary["exposed_comm_s"].update(total=1.5, tp=1.0, pp=1.0, dp=0.0)
    exposed = next(x for x in format_summary(summary).splitlines() if x.startswith("exposed comm"))
    assert exposed.endswith("tp 1.00 s · pp 1.00 s (a wait on two kinds at once counts in both)")
    summary["exposed_comm_s"].update(total=2.0)
    assert "at once" not in format_summary(summary)


def test_the_bubble_card_says_pipeline_only_with_a_pipeline(result):
    """The headline card calls the idle time a pipeline bubble where there is a pipeline;
    without one (PP 1) what idles a GPU is waiting on others (a straggler, a slow link), and
    the card says so."""
    from clustersim.output.report import cards_html

    assert result.summary["plan"]["pp"] > 1
    assert '<div class="label">pipeline bubble</div>' in cards_html(result.summary)
    flat = copy.deepcopy(result.summary)
    flat["plan"]["pp"] = 1
    page = cards_html(flat)
    assert "pipeline bubble" not in page
    assert '<div class="label">bubble</div>' in page and "waiting on other GPUs (no pipeline)" in page


def test_one_gpu_gives_its_tokens_per_s_once(result):
    """On one GPU the tokens/s line gives one figure, not the same one twice rounded two ways."""
    line = lambda s: next(x for x in format_summary(s).splitlines() if x.startswith("tokens/s"))  # noqa: E731
    assert line(result.summary).endswith(" per GPU)")
    one = copy.deepcopy(result.summary)
    one["world_size"] = 1
    assert line(one) == f"{'tokens/s':<16}{one['tokens_per_s']:,.0f}"
    from clustersim.output.report import cards_html  # and the report's card, one figure too
    per_gpu = f'{one["tokens_per_s_per_gpu"]:,.1f} per GPU</div>'
    assert per_gpu in cards_html(result.summary) and per_gpu not in cards_html(one)


def test_times_below_a_nanosecond_read_as_zero():
    """Sums of seconds leave rounding behind (a stage's imbalance of 1.78e-15 s where its GPUs
    compute alike): the report shows it as 0, not "1.78e-09 µs"."""
    assert fmt_time(1.78e-15) == fmt_time(-2.9e-11) == fmt_time(0.0) == "0 ms"
    assert fmt_time(3e-9) == "0.00300 µs" and fmt_time(2.5e-3) == "2.50 ms" and fmt_time(4.2) == "4.20 s"
    # three significant digits, trailing zeros kept: 1.0004 s beside 3.72 s reads "1.00 s", not "1 s"
    assert fmt_time(1.0004) == "1.00 s" and fmt_time(0.812) == "812 ms" and fmt_time(3.6) == "3.60 s"
    # a unit from where three digits round up to it, never an exponent
    assert fmt_time(0.9995) == "1.00 s" and fmt_time(0.0009996) == "1.00 ms" and fmt_time(0.99949) == "999 ms"
    from clustersim.output.summary import secs

    assert secs(999.7, 1.0) == "1,000 s" and secs(999.4, 1.0) == "999 s" and secs(0.16, 1.0) == "0.160 s"


def test_the_memory_table_says_a_microbatch_counts_once_per_part(result):
    """With several model parts a GPU (interleaved), the microbatches in flight count a
    microbatch once per part it is alive on (39 on interleaved v4 with 16 microbatches): the
    column and its note say so; with one part a GPU they say microbatches."""
    from clustersim.output.report import memory_html

    one = memory_html(result.summary)
    assert "(µb in flight)" in one and "once per model part" not in one
    many = copy.deepcopy(result.summary)
    st = many["memory"]["stages"][0]
    st["parts"] = st["parts"] * 2
    page = memory_html(many)
    assert "(µb in flight, counted per part)" in page and "a microbatch counted once per model part (chunk)" in page


def test_memory_lines_past_ten_stages_keep_colours_of_their_own(result):
    """The template has 10 colours: with more stages the memory chart's lines would repeat
    them (stage 10 drawn as stage 0, DeepSeek-V3's 16 stages), so a longer palette is set;
    with 10 or fewer, the template's."""
    from clustersim.output.report import memory_figure

    assert "colorway" not in memory_figure(result.summary)["layout"]
    many = copy.deepcopy(result.summary)
    st = many["memory"]["stages"][0]
    many["memory"]["stages"] = [{**st, "stage": k} for k in range(16)]
    colours = memory_figure(many)["layout"]["colorway"]
    assert len(set(colours[:16])) == 16


def test_header_tells_an_unnamed_model_by_its_shape(result):
    """A scenario without model.name gets no made-up name ("model: model") in the header: the
    model reads by its size and shape; a named one keeps its name first."""
    from clustersim.output.report import header_html

    meta = lambda s: html.unescape(re.search(r'<p class="meta">model: ([^<]*)</p>', header_html(s)).group(1))  # noqa: E731
    assert meta(result.summary) == "tiny · 0.1 B parameters, 4 layers, hidden 1024"
    d = copy.deepcopy(SMALL)
    del d["model"]["name"]
    r = clustersim.simulate(clustersim.load_scenario(d, base_dir=ROOT))
    assert r.summary["model"]["name"] is None
    assert meta(r.summary) == f"{r.summary['model']['params'] / 1e9:.1f} B parameters, 4 layers, hidden 1024"


def test_every_chart_writes_its_axes_numbers_in_one_style(tmp_path):
    """Thousands with a separator, never plotly's default SI suffix ("2k" on the memory and
    link-use charts beside the timeline's "2,000"): every axis of every chart on the report,
    and on compare's and sweep's pages (their small charts), and the time axes share the
    timeline's formats when zoomed in."""
    from clustersim.output.compare_page import small_layout
    from clustersim.output.report import _MS_TICK_FORMATS

    _, _, calls = _written(False, tmp_path)
    axes = {(div_id, k): layout[k] for div_id, _, layout, _ in calls for k in layout if k[1:5] == "axis"}
    assert {(DIV_ID, "xaxis"), (MEMORY_DIV_ID, "xaxis"), (MEMORY_DIV_ID, "yaxis"), (LINKS_DIV_ID, "xaxis")} <= set(axes)
    for where, axis in axes.items():
        if axis.get("tickmode") != "array":  # (the timeline's rows are named, not numbered)
            assert axis.get("exponentformat") == "none" and axis.get("separatethousands") is True, where
        if axis.get("title", {}).get("text") == "time (ms)":
            assert axis["tickformatstops"] == _MS_TICK_FORMATS, where
    small = small_layout(300, yaxis={"title": {"text": "tokens/s per GPU"}})
    assert small["yaxis"]["title"]["text"] == "tokens/s per GPU"
    assert all(small[k]["exponentformat"] == "none" and small[k]["separatethousands"] for k in ("xaxis", "yaxis"))


def test_a_link_use_chart_of_one_line_names_it(result):
    """Plotly draws no legend for a figure of one trace: the link-use chart of a step whose
    busiest links are all alike (one line) named no link. Its layout asks for the legend."""
    from clustersim.output.report import links_figure

    s = copy.deepcopy(result.summary)
    s["links"]["busiest"] = [u for u in s["links"]["busiest"] if u.get("utilisation_over_time")][:1]
    fig = links_figure(s)
    assert len(fig["data"]) == 1 and fig["layout"]["showlegend"] is True
    assert fig["data"][0]["name"].startswith(s["links"]["busiest"][0]["link"])
    named = {"data": fig["data"], "layout": {**fig["layout"], "template": "plotly_white"}}
    assert json.loads(go.Figure(named).to_json())["layout"]["showlegend"] is True  # (kept by plotly's validation)


def test_a_tall_timeline_writes_its_times_under_its_rows_too(result, tmp_path, monkeypatch):
    """From TALL_ROWS rows on, the timeline (taller than a screen) writes its time axis at the
    bottom as well as the top (scrolled down, it read no times): a second axis matching the
    first, drawn in Chromium with the same labels and following a zoom; a short one has one axis."""
    from clustersim.output import report as rep

    short = rep.timeline(result.trace, result.summary)
    n_rows = len(short["layout"]["yaxis"]["tickvals"])
    assert n_rows < rep.TALL_ROWS and "xaxis2" not in short["layout"]
    assert all(t.get("xaxis", "x") == "x" for t in short["data"])
    monkeypatch.setattr(rep, "TALL_ROWS", n_rows)
    tall = rep.timeline(result.trace, result.summary)
    top, bottom = tall["layout"]["xaxis"], tall["layout"]["xaxis2"]
    assert top["side"] == "top" and bottom["side"] == "bottom" and bottom["matches"] == "x"
    assert bottom["tickformatstops"] == top["tickformatstops"]
    assert [t for t in tall["data"] if t.get("xaxis") == "x2"] == [rep._BOTTOM_AXIS_TRACE]
    page_path = tmp_path / "report.html"
    write_report(page_path, result.trace, result.summary)
    with offline_page(page_path, f"#{DIV_ID} .main-svg", width_px=1600) as (page, errors):
        ticks = page.evaluate(f"""() => ['xtick', 'x2tick'].map(c => Array.from(
            document.querySelectorAll('#{DIV_ID} .' + c + ' text')).map(t => [t.textContent,
            t.getBoundingClientRect().top]))""")
        zoomed = page.evaluate(f"""async () => {{ const gd = document.getElementById('{DIV_ID}');
            await Plotly.relayout(gd, {{'xaxis.range': [1, 2]}}); return gd._fullLayout.xaxis2.range; }}""")
    assert errors == []
    (top_ticks, bottom_ticks) = ticks
    assert top_ticks and [t for t, _ in bottom_ticks] == [t for t, _ in top_ticks]
    assert min(y for _, y in bottom_ticks) > max(y for _, y in top_ticks) + rep.ROW_HEIGHT_PX * n_rows / 2
    assert zoomed == [1, 2]


def test_the_memory_charts_hover_box_names_the_time_with_its_unit(result):
    """Every stage at the time pointed at, in one box whose head is that time in ms (plotly's
    unified hover wrote a bare "718")."""
    from clustersim.output.report import memory_figure

    layout = memory_figure(result.summary)["layout"]
    assert layout["hovermode"] == "x unified" and layout["xaxis"]["unifiedhovertitle"] == {"text": "%{x:,.0f} ms"}
