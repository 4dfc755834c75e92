"""The report timeline's op-by-op layer (clustersim.output.zoom): the spans the page carries,
and what a browser draws of them once zoomed in."""

from __future__ import annotations

import base64
import copy
import html
import re

import numpy as np
import pytest

import clustersim
from clustersim.output import report, zoom
from clustersim.output.perfetto import span_order
from clustersim.output.report import DIV_ID, as_sent, report_html, timeline, timeline_note, write_report

from .conftest import offline_page, scenario_dict
from .test_report import DETAIL_DRAWN_JS, ROOT

SCENARIO = scenario_dict(name="zoom <pp2>")


@pytest.fixture(scope="module")
def result() -> clustersim.Result:
    return clustersim.simulate(clustersim.load_scenario(copy.deepcopy(SCENARIO), base_dir=ROOT))


def _decoded(detail: dict, key: str, dtype: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(detail[key]), dtype=np.dtype(dtype).newbyteorder("<"))


def test_the_page_carries_every_drawn_span(result):
    detail = timeline(result.trace, result.summary)["detail"]
    order = span_order(result.trace)
    codes, forms = result.trace.forms()
    assert detail["bounds"] == list(order.bounds)
    assert np.array_equal(_decoded(detail, "start_ms", "f8"), order.start_s * 1e3)
    assert np.allclose(_decoded(detail, "dur_ms", "f4"), (order.end_s - order.start_s) * 1e3, rtol=1e-6, atol=1e-9)
    assert np.array_equal(_decoded(detail, "form", "i4"), order.take_array(codes))
    assert np.array_equal(_decoded(detail, "mb", "i4"), order.take_array(result.trace.mbs()))
    # a form's name, legend group, layer and last hover line
    name, group, layer, extra = detail["forms"][0]
    f = forms[0]
    assert (name, group, layer) == (html.escape(f.name), report.bar_group(f.kind, f.phase), f.layer)
    assert extra == report.size_flops_text(f.size_bytes, f.flops)
    # the longest span of each row, for the spans that reach into the view from before it
    for r, (lo, hi) in enumerate(zip(order.bounds[:-1], order.bounds[1:])):
        assert detail["max_dur_ms"][r] == pytest.approx(((order.end_s - order.start_s)[lo:hi] * 1e3).max())


def test_size_and_flops_line():
    assert report.size_flops_text(3 * 1024**2, 0.0) == "data 3.0 MiB"
    assert report.size_flops_text(0.0, 2e12) == "2 TFLOP"
    assert report.size_flops_text(3 * 1024**2, 2e12) == "data 3.0 MiB · 2 TFLOP"
    assert report.size_flops_text(0.0, 0.0) == ""


def test_past_the_limit_the_page_carries_the_first_spans(result, monkeypatch):
    limit = result.trace.n_spans // 3
    monkeypatch.setattr(zoom, "DETAIL_MAX_SPANS", limit)
    fig = timeline(result.trace, result.summary)
    detail, order = fig["detail"], span_order(result.trace)
    until_s = np.sort(order.start_s)[limit]  # the earliest start of the spans left out
    carried = np.flatnonzero(order.start_s < until_s)
    assert 0 < len(carried) == detail["carried"] <= limit and detail["of"] == result.trace.n_spans
    assert detail["until_ms"] == until_s * 1e3
    assert np.array_equal(_decoded(detail, "start_ms", "f8"), order.start_s[carried] * 1e3)
    # each row's carried spans are its first ones
    for r, (lo, hi) in enumerate(zip(order.bounds[:-1], order.bounds[1:])):
        n_row = int((order.start_s[lo:hi] < until_s).sum())
        assert detail["bounds"][r + 1] - detail["bounds"][r] == n_row
        assert (order.start_s[lo:lo + n_row] < until_s).all()
    assert fig["layout"]["meta"]["detail"] == {k: detail[k] for k in ("until_ms", "carried", "of")}
    page = report_html(result.trace, result.summary, as_sent(fig))
    assert page.count("g.clustersim-spans") == 1
    assert (f"The page carries the spans that start in the step's first {report.fmt_time(until_s)} "
            f"({detail['carried']:,} of {result.trace.n_spans:,}; trace.json.gz has every span)") in page


def test_a_browser_marks_where_the_carried_spans_end(result, tmp_path, monkeypatch):
    monkeypatch.setattr(zoom, "DETAIL_MAX_SPANS", result.trace.n_spans // 3)
    path = tmp_path / "report.html"
    write_report(path, result.trace, result.summary)
    until_ms = timeline(result.trace, result.summary)["detail"]["until_ms"]
    lines = f"document.querySelectorAll('#{DIV_ID} g.clustersim-spans line').length"
    with offline_page(path, f"#{DIV_ID} .main-svg") as (page, errors):
        page.evaluate(f"Plotly.relayout('{DIV_ID}', {{'xaxis.range': [{0.98 * until_ms}, {1.02 * until_ms}]}})")
        page.wait_for_timeout(300)
        at_cut = page.evaluate(lines), page.text_content(f"#{DIV_ID} g.clustersim-spans text").strip(" \u2190\u2192")
        page.evaluate(f"Plotly.relayout('{DIV_ID}', {{'xaxis.range': [{1.1 * until_ms}, {1.2 * until_ms}]}})")
        page.wait_for_timeout(300)
        past, drawn_past = page.evaluate(lines), page.evaluate(DETAIL_DRAWN_JS)
    assert errors == []
    assert at_cut == (1, "spans carried up to here") and past == 0 and drawn_past == 0


def test_the_note_says_what_zooming_in_shows(result, tmp_path):
    fig = as_sent(timeline(result.trace, result.summary))
    assert "detail" in fig  # as_sent keeps it beside plotly's data and layout
    page = report_html(result.trace, result.summary, fig)
    assert f"Zoomed in to {zoom.DETAIL_IN_VIEW:,} spans or fewer in view, each span is drawn" in page
    assert page.count("g.clustersim-spans") == 1
    # the plotly figure alone (no spans beside it) promises nothing
    assert "Zoomed in" not in timeline_note(result.trace)
    write_report(tmp_path / "report.html", result.trace, result.summary)
    assert (tmp_path / "report.html").read_text(encoding="utf-8") == page


def test_darker():
    assert zoom.darker("#4e79a7") == "#2f4964"
    assert zoom.darker("#ffffff", 0.5) == "#808080"


def _in_view(detail: dict, x0_ms: float, x1_ms: float) -> list[int]:
    """The spans a view of every row over [x0, x1] ms holds, by the module's rule."""
    start = _decoded(detail, "start_ms", "f8")
    end = start + _decoded(detail, "dur_ms", "f4")
    return np.flatnonzero((start < x1_ms) & (end >= x0_ms)).tolist()


def _tip_span(detail: dict, want: list[int], tip: str) -> int | None:
    """The span in ``want`` whose name, start and duration the hover box ``tip`` gives."""
    name = tip.split("\n")[0]
    times = re.search(r"start ([\d,.]+) ms · duration ([\d,.]+) ms", tip)
    start, dur = (float(times.group(k).replace(",", "")) for k in (1, 2))
    st, du = _decoded(detail, "start_ms", "f8"), _decoded(detail, "dur_ms", "f4")
    forms, fo = detail["forms"], _decoded(detail, "form", "i4")
    found = [i for i in want if html.unescape(forms[fo[i]][0]) == name and abs(st[i] - start) < 6e-4
             and abs(du[i] - dur) < 6e-4]
    return found[0] if found else None


@pytest.mark.parametrize("in_view", [50, zoom.DETAIL_IN_VIEW])
def test_a_browser_draws_the_spans_in_view(result, tmp_path, monkeypatch, in_view):
    monkeypatch.setattr(zoom, "DETAIL_IN_VIEW", in_view)  # 50: fewer than the step's spans
    path = tmp_path / "report.html"
    write_report(path, result.trace, result.summary)
    detail = timeline(result.trace, result.summary)["detail"]
    forms, fo = detail["forms"], _decoded(detail, "form", "i4")
    step_ms = result.summary["step_time_s"] * 1e3
    x0, x1 = 0.45 * step_ms, 0.47 * step_ms
    want = _in_view(detail, x0, x1)
    every = len(_in_view(detail, 0, step_ms))
    assert 0 < len(want) <= in_view and every == result.trace.n_spans
    full = every if every <= in_view else 0  # drawn unzoomed: every span, or none past the limit
    # a window of more than in_view spans, at most in_view of them not of the first span's group
    hidden = forms[fo[want[0]]][1]
    hi_ms = x1
    while True:
        spread = _in_view(detail, x0, hi_ms)
        n_hidden = sum(forms[fo[i]][1] == hidden for i in spread)
        if len(spread) > in_view or hi_ms >= step_ms:
            break
        hi_ms = min(step_ms, hi_ms + 0.01 * step_ms)
    while len(spread) - n_hidden > in_view:
        hi_ms -= 0.001 * step_ms
        spread = _in_view(detail, x0, hi_ms)
        n_hidden = sum(forms[fo[i]][1] == hidden for i in spread)
    spread_ms = (x0, hi_ms)
    relayout = "Plotly.relayout('%s', {'xaxis.range': [%r, %r]})"
    widest = (f"(() => {{const r = [...document.querySelectorAll('#{DIV_ID} g.clustersim-spans rect')]"
              ".map(e => e.getBoundingClientRect()).sort((a, b) => b.width - a.width)[0];"
              " return [r.x + r.width / 2, r.y + r.height / 2];})()")
    with offline_page(path, f"#{DIV_ID} .main-svg") as (page, errors):
        drawn_full = page.evaluate(DETAIL_DRAWN_JS)
        page.evaluate(relayout % (DIV_ID, x0, x1))
        page.wait_for_timeout(300)
        drawn = page.evaluate(DETAIL_DRAWN_JS)
        # over the bars: plotly puts its layers back in its own order on a zoom
        above = page.evaluate(f"document.querySelector('#{DIV_ID} g.clustersim-spans').previousSibling"
                              ".getAttribute('class')")
        # the pointer on a span: the page's box names it, plotly's own label is hidden meanwhile
        page.locator(f"#{DIV_ID} .nsewdrag").scroll_into_view_if_needed()
        page.mouse.move(*page.evaluate(widest))
        page.wait_for_timeout(200)
        tip = page.inner_text(".clustersim-span-tip")
        inside = page.evaluate("(() => {const r = document.querySelector('.clustersim-span-tip')"
                               ".getBoundingClientRect(); return r.left >= 0 && r.right <= "
                               "document.documentElement.clientWidth && r.bottom <= innerHeight;})()")
        plotly_label = page.evaluate(f"document.querySelector('#{DIV_ID} .hoverlayer').style.visibility")
        page.mouse.move(5, 5)  # off the chart: the box goes
        page.wait_for_timeout(200)
        tip_gone = page.evaluate("getComputedStyle(document.querySelector('.clustersim-span-tip')).display")
        # a legend group hidden: its spans are not drawn either
        label = next(text for key, text, _ in report.GROUPS if key == hidden)
        page.locator(f"#{DIV_ID} .legend .traces", has_text=label).first.click()
        page.wait_for_timeout(1000)  # (plotly waits out a double click's 300 ms before it toggles)
        after_hide = page.evaluate(DETAIL_DRAWN_JS)
        # a view holding more than the limit, but not once the group is hidden: drawn then
        page.evaluate(relayout % (DIV_ID, *spread_ms))
        page.wait_for_timeout(300)
        hidden_counted = page.evaluate(DETAIL_DRAWN_JS)
        page.locator(f"#{DIV_ID} .legend .traces", has_text=label).first.click()
        page.wait_for_timeout(1000)
        # a drag across the plot zooms to what it covered, as a user zooms
        box = page.locator(f"#{DIV_ID} .nsewdrag").bounding_box()
        page.mouse.move(box["x"] + 0.40 * box["width"], box["y"] + 10)
        page.mouse.down()
        page.mouse.move(box["x"] + 0.45 * box["width"], box["y"] + box["height"] - 10, steps=5)
        page.mouse.up()
        page.wait_for_timeout(500)
        dragged = page.evaluate(f"document.getElementById('{DIV_ID}')._fullLayout.xaxis.range")
        y_range = page.evaluate(f"document.getElementById('{DIV_ID}')._fullLayout.yaxis.range")
        drawn_dragged = page.evaluate(DETAIL_DRAWN_JS)
        page.evaluate(relayout % (DIV_ID, 0, step_ms))
        page.wait_for_timeout(300)
        drawn_back = page.evaluate(DETAIL_DRAWN_JS)
    assert errors == []
    assert drawn_full == full and drawn == len(want) and drawn_back == full
    assert _tip_span(detail, want, tip) is not None, tip
    assert "barlayer" in above and inside
    assert plotly_label == "hidden" and tip_gone == "none"
    assert after_hide == sum(forms[fo[i]][1] != hidden for i in want)
    assert hidden_counted == len(spread) - n_hidden  # hidden spans do not count toward the limit
    # the drag zoomed both ways (a box): the spans of the rows and times it covered
    rows = [r for r in range(len(detail["bounds"]) - 1) if min(y_range) - 0.5 <= r <= max(y_range) + 0.5]
    bounds = detail["bounds"]
    in_box = [i for i in _in_view(detail, *dragged) if any(bounds[r] <= i < bounds[r + 1] for r in rows)]
    assert drawn_dragged == (len(in_box) if len(in_box) <= in_view else 0)
