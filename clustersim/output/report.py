"""HTML report: summary panels and a Gantt timeline of one simulated step, in one offline file.

Layout of ``report.html``::

    clustersim · <scenario>                         description, cluster, plan, model
    ┌ step time ┐┌ tokens/s ┐┌ TFLOP/s/GPU ┐┌ MFU ┐┌ HFU ┐┌ bubble ┐┌ memory ┐
    where the step's time goes  [compute ........|exposed comm .....| bubble ...]
    communication per GPU     kind | busy | hidden | exposed | ▇▇▇░░     critical path by kind
    exposed comm by cause     collective | exposed | bottleneck link | shared with
    time per stage            stage | compute | exposed comm | bubble: warm-up cool-down dependency imbalance
    memory per stage          stage | params grads optim activ buffers | peak / cap | fits, margin
    memory over the step      one line per stage, capacity dashed
    busiest links             table and use over the step
    timeline (plotly)
        stage 0 · compute   ▇▇▇ ▇▇▇ ▇▇▇▇ ▇▇▇▇ ...      forward / backward / optimizer
        stage 0 · tp        ░░░ ░░░ ░░░░ ░░░░ ...      lighter = less busy inside the bar
        stage 0 · pp_fwd_send  ▏  ▏  ▏
        stage 1 · compute      ▇▇▇ ▇▇▇ ...
        ...                 0 ms ─────────────── step time
        critical path       a black line over the bars, hopping between stages

The timeline merges consecutive spans of one (rank, stream) that share kind, phase and
microbatch into one bar, which takes a GPT-3-sized trace (~160k spans) down to ~24k bars.

Past BAR_BUDGET (30k) bars, more than a browser lays out in seconds, each row is drawn as runs
of bins instead (clustersim.output.bins): a 1T-parameter step has ~900k spans and ~260k bars.

The timeline is built in columns: the spans sorted once (perfetto.span_order, shared with the
trace file), the fields spans share read once per span form, bars merged in one loop
(:class:`BarColumns`), hover texts and fade levels per column. Every figure (timeline, memory,
links) is made as the dict plotly's validators would make of it, the template read from
plotly's own JSON and numeric arrays as plotly sends them (:func:`_typed_array`), and written
into the page by :func:`plot_div` as JSON safe inside a <script>: no validator runs, and
plotly's own page writer is not imported (it brings narwhals, 0.1 s of every run).
build_figure, for notebooks, still validates; test_report checks that the page's figures are
what validation gives and that the arrays are what plotly's converter makes.
"""

from __future__ import annotations

import base64
import functools
import html
import importlib.resources
import json
import pkgutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import pairwise
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np
import plotly
import plotly.graph_objects as go

from ..analysis.links import BUSIEST
from ..floats import sum_left, three_digits
from ..trace import COMM_KINDS, Span, SpanForm, Trace, form_array, form_codes, form_values, gpu_ranges
from .bins import BAR_BUDGET, TIMELINE_BINS, BinnedBars, bar_count, binned_within
from .perfetto import Codes, SpanOrder, span_order
from .shown import MAX_TIMELINE_RANKS, only_ranks, shown_ranks
from .summary import (asymmetric_note, collective_fallbacks_note, fabric_faults_note, host_only_unfit,
                      leaf_split_note, link_ceilings_said, network_said, peak_text, plain_collective, plan_dims,
                      plan_options, replicas_note,
                      schedule_part, step_text, straggler_note, topology_changes_note, unfilled_pipeline,
                      what_if_note)
from .zoom import DETAIL_IN_VIEW, detail_data, detail_script

GiB = 1024**3
MiB = 1024**2
DIV_ID = "clustersim-timeline"
ROW_HEIGHT_PX = 15
BAR_WIDTH_ROWS = 0.8  # bar thickness as a fraction of a row
MAX_GAP_FRACTION = 0.002  # of the step: about a pixel of the full-width timeline
# the table of which GPUs each rank stands for lists them up to about this many characters a
# rank (a class split around a straggler can hold hundreds of scattered GPUs; the box finds any)
REPORT_GPUS_CHARS = 240

# Legend entries: (group, label, colour), in legend order. Colours: Tableau 10.
GROUPS = (
    ("F", "forward compute", "#4e79a7"),
    ("B", "backward compute", "#f28e2b"),
    ("W", "weight-grad compute", "#edc948"),
    ("opt", "optimizer step", "#b07aa1"),
    ("compute", "other compute", "#9c755f"),
    ("tp", "TP communication", "#59a14f"),
    ("cp", "CP communication", "#76b7b2"),
    ("ep", "EP communication", "#ff9da7"),
    ("pp", "PP send / recv", "#e15759"),
    ("dp", "DP communication", "#7f7f7f"),
    ("offload", "offload to the host (copies, its Adam)", "#d4a6c8"),
    ("other", "other", "#bab0ac"),
)
_GROUP_KEYS = tuple(g for g, _, _ in GROUPS)
GROUP_COLOURS = {g: colour for g, _, colour in GROUPS}


@dataclass(frozen=True, slots=True)
class Bar:
    """Consecutive spans of one (rank, stream) with the same kind, phase and microbatch."""

    rank: int
    stream: str
    kind: str
    phase: str
    mb: int
    start_s: float
    end_s: float
    busy_s: float  # union of the merged spans, <= end_s - start_s
    n_spans: int
    first_name: str
    last_name: str
    layer_lo: int  # -1 when no merged span has a layer
    layer_hi: int
    size_bytes: float
    flops: float

    @property
    def dur_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class BarColumns:
    """The bars as columns, one entry per bar, by row and by time within a row: what
    :func:`merge_spans` lists, without an object per bar (a 1T-parameter step has ~260k)."""

    row: np.ndarray  # int64: index of the bar's (rank, stream) row
    kind: list[str]
    phase: list[str]
    mb: list[int]
    start_s: np.ndarray  # float64
    end_s: np.ndarray
    busy_s: np.ndarray
    n_spans: np.ndarray  # int64
    first_name: list[str]
    last_name: list[str]
    layer_lo: np.ndarray  # int64, -1 when no merged span has a layer
    layer_hi: np.ndarray
    size_bytes: list[float]
    flops: list[float]

    @property
    def dur_s(self) -> np.ndarray:
        return self.end_s - self.start_s

    def bars(self, rows: list[tuple[int, str]]) -> list[Bar]:
        """As :class:`Bar` objects; ``rows[row]`` is a bar's (rank, stream)."""
        return [Bar(rank=rows[r][0], stream=rows[r][1], kind=k, phase=ph, mb=mb, start_s=t0, end_s=t1, busy_s=busy,
                    n_spans=n, first_name=a, last_name=z, layer_lo=lo, layer_hi=hi, size_bytes=b, flops=f)
                for r, k, ph, mb, t0, t1, busy, n, a, z, lo, hi, b, f in zip(
                    self.row.tolist(), self.kind, self.phase, self.mb, self.start_s.tolist(), self.end_s.tolist(),
                    self.busy_s.tolist(), self.n_spans.tolist(), self.first_name, self.last_name,
                    self.layer_lo.tolist(), self.layer_hi.tolist(), self.size_bytes, self.flops)]

    @classmethod
    def of(cls, bars: list[Bar]) -> BarColumns:
        """Bars as columns, all in row 0."""
        def col(field: str, dtype: Any = None) -> Any:
            values = [getattr(b, field) for b in bars]
            return values if dtype is None else np.array(values, dtype=dtype)

        return cls(row=np.zeros(len(bars), dtype=np.int64), kind=col("kind"), phase=col("phase"), mb=col("mb"),
                   start_s=col("start_s", float), end_s=col("end_s", float), busy_s=col("busy_s", float),
                   n_spans=col("n_spans", np.int64), first_name=col("first_name"), last_name=col("last_name"),
                   layer_lo=col("layer_lo", np.int64), layer_hi=col("layer_hi", np.int64),
                   size_bytes=col("size_bytes"), flops=col("flops"))


def _runs(keys: list[tuple], start_s: list[float], end_s: list[float], bounds: list[int],
          max_gap_s: float) -> tuple[list[int], list[float]]:
    """Where each bar starts (position of its first span) and its busy time, row by row::

        for each span: same (kind, phase, mb) as the open bar and idle gap <= max_gap_s
                       -> extend it, else start a new one
        busy += end - max(start, covered so far);  covered = max(covered, end)

    Spans of one stream should not overlap; an overlap counts once all the same. The float
    operations are those of merging one bar at a time, in the same order, so busy times come
    out bit for bit the same (``max`` written out: the same operand wins ties, and a call
    per span would cost 0.1 s on a million spans).
    """
    firsts: list[int] = []
    busy: list[float] = []
    for lo, hi in pairwise(bounds):
        if lo == hi:
            continue
        firsts.append(lo)
        run_key, covered, b = keys[lo], start_s[lo], 0.0
        d = end_s[lo] - start_s[lo]
        if d > 0.0:
            b += d
        if end_s[lo] > covered:
            covered = end_s[lo]
        for j, key, start, end in zip(range(lo + 1, hi), keys[lo + 1:hi], start_s[lo + 1:hi], end_s[lo + 1:hi]):
            if key != run_key or start - covered > max_gap_s:
                busy.append(b)
                firsts.append(j)
                run_key, covered, b = key, start, 0.0
            d = end - (covered if covered > start else start)
            if d > 0.0:
                b += d
            if end > covered:
                covered = end
        busy.append(b)
    return firsts, busy


def _bar_sums(values: np.ndarray, firsts: list[int], ends: list[int]) -> list[float]:
    """``sum(values[i:j])`` for each bar's spans ``i:j``, left to right (:func:`~clustersim.floats.sum_left`).

    A bar with at most one nonzero value sums to that value in any order, so numpy adds
    those bars (``+ 0.0``: a sum of -0.0s is 0.0, as ``sum`` gives); Python the others.
    """
    if not firsts:
        return []
    out = (np.add.reduceat(values, firsts) + 0.0).tolist()
    several = np.flatnonzero(np.add.reduceat((values != 0).astype(np.int64), firsts) > 1).tolist()
    if several:
        terms = values.tolist()
        for k in several:
            out[k] = sum_left(terms[firsts[k]:ends[k]])
    return out


def _kind_phase_codes(forms: list[SpanForm]) -> tuple[np.ndarray, list[tuple[str, str]]]:
    """(a code per form for its (kind, phase), the (kind, phase) of each code, in order of
    first appearance)."""
    codes = Codes()
    per_form = np.array([codes[f.kind, f.phase] for f in forms], dtype=np.int64)
    return per_form, list(codes)


def _merge(spans: list[Span], forms: tuple[np.ndarray, list[SpanForm]], order: SpanOrder | None, bounds: list[int],
           start_s: np.ndarray, end_s: np.ndarray, max_gap_s: float, mb: np.ndarray | None = None) -> BarColumns:
    """Bars of spans in display order: ``order`` reorders ``spans`` (None: already in
    order); rows are ``bounds[r]:bounds[r + 1]``; starts and ends as arrays in that order;
    ``forms``: the spans' form codes and forms (:func:`clustersim.trace.form_codes`); ``mb``:
    the spans' microbatches in their own order, when read already (:meth:`Trace.mbs`).

    The fields spans share are read once per form and spread by form code; the microbatch
    is read from the spans in their own order (close together in memory), then reordered.
    Sums are Python's ``sum`` over a bar's spans in order, maxima exact.
    """
    n = len(spans)
    codes, form_list = forms
    if mb is None:
        mb = np.fromiter(map(attrgetter("mb"), spans), dtype=np.int64, count=n)
    if order is not None:
        codes, mb = order.take_array(codes), order.take_array(mb)
    # a bar goes on while (kind, phase, mb) stays the same: as one int per span
    per_form, kind_phase = _kind_phase_codes(form_list)
    kp = per_form[codes]
    lo = int(mb.min(initial=0))
    keys = (kp * (int(mb.max(initial=0)) - lo + 1) + (mb - lo)).tolist()
    firsts, busy = _runs(keys, start_s.tolist(), end_s.tolist(), bounds, max_gap_s)
    ends = firsts[1:] + [bounds[-1]] if firsts else []  # one past each bar's last span
    layer = form_array(form_list, codes, "layer", np.int64)
    has_layer = layer >= 0
    no_layer = np.iinfo(np.int64).max
    if firsts:
        layer_lo = np.minimum.reduceat(np.where(has_layer, layer, no_layer), firsts)
        layer_lo[layer_lo == no_layer] = -1
        layer_hi = np.maximum.reduceat(np.where(has_layer, layer, -1), firsts)
        bar_end_s = np.maximum.reduceat(end_s, firsts)
    else:
        layer_lo = layer_hi = np.zeros(0, dtype=np.int64)
        bar_end_s = np.zeros(0)
    bar_kp = kp[firsts].tolist()
    return BarColumns(
        row=np.searchsorted(bounds, firsts, side="right") - 1,
        kind=[kind_phase[k][0] for k in bar_kp], phase=[kind_phase[k][1] for k in bar_kp], mb=mb[firsts].tolist(),
        start_s=start_s[firsts], end_s=bar_end_s, busy_s=np.array(busy, dtype=float),
        n_spans=np.array(ends, dtype=np.int64) - np.array(firsts, dtype=np.int64),
        first_name=form_values(form_list, codes[firsts], "name"),
        last_name=form_values(form_list, codes[np.array(ends, dtype=np.int64) - 1], "name"),
        layer_lo=layer_lo, layer_hi=layer_hi,
        size_bytes=_bar_sums(form_array(form_list, codes, "size_bytes"), firsts, ends),
        flops=_bar_sums(form_array(form_list, codes, "flops"), firsts, ends),
    )


def merge_stream(spans: list[Span], max_gap_s: float = float("inf")) -> list[Bar]:
    """Merge the spans of one (rank, stream), sorted by start, into bars.

    Roughly::

        for each span: same (kind, phase, mb) as the open bar and idle gap <= max_gap_s
                       -> extend it, else start a new one
        busy = length of the union of the spans inside the bar
    """
    if not spans:
        return []
    start_s = np.array([s.start_s for s in spans], dtype=float)
    end_s = np.array([s.end_s for s in spans], dtype=float)
    bars = _merge(spans, form_codes(spans), None, [0, len(spans)], start_s, end_s, max_gap_s)
    return bars.bars([(spans[0].rank, spans[0].stream)])


def _merged(trace: Trace, max_gap_s: float | None = None) -> tuple[SpanOrder, BarColumns]:
    order = span_order(trace)
    if max_gap_s is None:
        max_gap_s = MAX_GAP_FRACTION * order.last_end_s
    return order, _merge(trace.span_rows(), trace.forms(), order, order.bounds, order.start_s, order.end_s,
                         max_gap_s, trace.mbs())


def merge_spans(trace: Trace, max_gap_s: float | None = None) -> dict[tuple[int, str], list[Bar]]:
    """Bars per (rank, stream), keyed and ordered as the timeline's rows.

    ``max_gap_s`` defaults to MAX_GAP_FRACTION of the step: a gap that would show at full
    view splits a bar, one that would not is kept inside it (and counted as not busy).
    """
    order, columns = _merged(trace, max_gap_s)
    out: dict[tuple[int, str], list[Bar]] = {row: [] for row in order.rows}
    for b in columns.bars(order.rows):
        out[b.rank, b.stream].append(b)
    return out


def bar_group(kind: str, phase: str) -> str:
    """Legend group of a bar: compute by phase (F, B, W, opt), communication by kind."""
    if kind == "compute":
        return phase if phase in ("F", "B", "W", "opt") else "compute"
    return kind if kind in _GROUP_KEYS else "other"


def row_labels(trace: Trace, rows: Iterable[tuple[int, str]]) -> list[str]:
    """'stage 3 · tp'; 'rank 5 (stage 3) · tp' when several simulated ranks share a stage."""
    per_stage: dict[int, int] = {}
    for r in trace.ranks:
        st = trace.stage_of.get(r, 0)
        per_stage[st] = per_stage.get(st, 0) + 1
    labels = []
    for rank, stream in rows:
        st = trace.stage_of.get(rank, 0)
        who = f"stage {st}" if per_stage.get(st, 0) <= 1 else f"rank {rank} (stage {st})"
        labels.append(f"{who} · {stream}")
    return labels


def fmt_bytes(n: float) -> str:
    """Binary units, as GPU memory is counted."""
    if n >= GiB:
        return f"{n / GiB:,.2f} GiB"
    if n >= MiB:
        return f"{n / MiB:,.1f} MiB"
    if n >= 1024:
        return f"{n / 1024:,.1f} KiB"
    return f"{n:.0f} B"


# below a nanosecond, a time is the rounding of sums of seconds (a stage's imbalance of
# 1.78e-15 s where two GPUs compute alike), shown as 0: no op, hop or latency is that short
NOISE_S = 1e-9


def fmt_time(t_s: float) -> str:
    """Seconds above one second, milliseconds below (three significant digits, trailing zeros
    kept: "1.00 s", "3.60 s" beside "3.72 s"); 0 below NOISE_S."""
    if abs(t_s) < NOISE_S:
        t_s = 0.0
    if abs(t_s) >= 999.5:  # (.3g writes 3.6e+03 there)
        return f"{t_s:,.0f} s"
    # (each unit from where three digits round up to it: 0.9995 s is "1.00 s", not "1e+03 ms")
    if abs(t_s) >= 0.9995:
        return f"{three_digits(t_s)} s"
    if abs(t_s) >= 0.9995e-3 or t_s == 0:
        return f"{three_digits(t_s * 1e3)} ms"
    return f"{three_digits(t_s * 1e6)} µs"


class _Memo(dict):
    """``f(x)`` remembered per ``x``: names, sizes and FLOP counts repeat over thousands of bars."""

    def __init__(self, f: Callable[[Any], Any]):
        super().__init__()
        self.f = f

    def __missing__(self, x: Any) -> Any:
        y = self[x] = self.f(x)
        return y


def hover_texts(bars: BarColumns, labels: list[str]) -> list[str]:
    """Hover text of each bar: names, microbatch and layers, times in ms, busy share, bytes
    and FLOPs, e.g.::

        <b>F attn … F mlp (6 spans)</b>
        stage 0 · compute · microbatch 3 · layers 0–1
        start 12.345 ms · duration 6.789 ms
        busy 6.000 ms (88 % of the bar)
        data 1.2 GiB · 3.45 TFLOP
    """
    escape = _Memo(html.escape)
    size_text = _Memo(fmt_bytes)
    flops_text = _Memo(fmt_flops)
    where_row = [html.escape(label) for label in labels]  # labels[row]: the bar's row
    out = []
    for row, first, last, n, mb, lo, hi, start, dur, busy, size, flops in zip(
            bars.row.tolist(), bars.first_name, bars.last_name, bars.n_spans.tolist(), bars.mb,
            bars.layer_lo.tolist(), bars.layer_hi.tolist(), bars.start_s.tolist(), bars.dur_s.tolist(),
            bars.busy_s.tolist(), bars.size_bytes, bars.flops):
        name = escape[first]
        if n > 1:
            tail = "" if last == first else f" … {escape[last]}"
            name = f"{name}{tail} ({n} spans)"
        where = where_row[row]
        if mb >= 0:
            where = f"{where} · microbatch {mb}"
        if lo >= 0:
            where = f"{where} · layer {lo}" if lo == hi else f"{where} · layers {lo}–{hi}"
        text = f"<b>{name}</b><br>{where}<br>start {start * 1e3:,.3f} ms · duration {dur * 1e3:,.3f} ms"
        if n > 1:
            share = busy / dur if dur > 0 else 1.0
            text = f"{text}<br>busy {busy * 1e3:,.3f} ms ({100 * share:.0f} % of the bar)"
        if size or flops:
            text = f"{text}<br>{size_flops_text(size, flops, size_text, flops_text)}"
        out.append(text)
    return out


def fmt_flops(flops: float) -> str:
    """'3.45 TFLOP'; '1.69 PFLOP' from 1,000 TFLOP on, '1,500 PFLOP' from 1,000 PFLOP, '50
    MFLOP' below a GFLOP: never an exponent ('1.69e+03 TFLOP', '5e-05 TFLOP')."""
    if flops >= 999.5e15:
        return f"{flops / 1e15:,.0f} PFLOP"
    if flops >= 999.5e12:  # (what .3g would round up to 1e+03 TFLOP)
        return f"{flops / 1e15:.3g} PFLOP"
    if flops >= 1e9 or flops <= 0:
        return f"{flops / 1e12:.3g} TFLOP"
    for scale, unit in ((1e6, "MFLOP"), (1e3, "kFLOP")):
        if flops >= scale:
            return f"{flops / scale:.3g} {unit}"
    return f"{flops:.3g} FLOP"


def size_flops_text(size_bytes: float, flops: float, size_text=None, flops_text=None) -> str:
    """A hover's last line: 'data 1.2 GiB · 3.45 TFLOP' (the spans' ``size_bytes``: a
    collective's buffer, a transfer's or a copy's bytes), either alone, or '' with neither
    (``size_text``, ``flops_text``: memos of :func:`fmt_bytes` and :func:`fmt_flops`)."""
    size = "data " + (size_text[size_bytes] if size_text is not None else fmt_bytes(size_bytes)) if size_bytes else ""
    work = (flops_text[flops] if flops_text is not None else fmt_flops(flops)) if flops else ""
    return " · ".join(x for x in (size, work) if x)


def bar_hover(b: Bar, row_label: str) -> str:
    """Hover text of one bar (see :func:`hover_texts`)."""
    return hover_texts(BarColumns.of([b]), [row_label])[0]


# A merged bar is only partly busy; fading it keeps a sparse run of collectives from reading
# as a solid block. Three fixed levels (one plotly trace each) instead of a per-bar opacity
# array, which makes the browser restyle every bar one by one and doubles the draw time.
FADE_LEVELS = ((0.75, 1.0), (0.4, 0.6), (0.0, 0.3))  # (busy share at least, opacity)


def fade_levels(busy_s: np.ndarray, dur_s: np.ndarray) -> np.ndarray:
    """Index into FADE_LEVELS of each bar::

        share = busy / dur  (1 for a bar of no length)
        level = the first i with share >= FADE_LEVELS[i][0]
    """
    share = np.ones(len(busy_s))
    np.divide(busy_s, dur_s, out=share, where=dur_s > 0)
    level = np.full(len(busy_s), -1, dtype=np.int64)
    for i, (lo, _) in reversed(list(enumerate(FADE_LEVELS))):
        level[share >= lo] = i
    if (level < 0).any():
        raise ValueError("a bar is busy for less than no time")
    return level


def fade_level(b: Bar) -> int:
    """Index into FADE_LEVELS for the bar's busy share."""
    return int(fade_levels(np.array([b.busy_s]), np.array([b.dur_s]))[0])


# plotly.js typed arrays: numpy dtype -> the code plotly.js reads in a {"dtype", "bdata"} spec
_TYPED_ARRAY_CODES = {"int8": "i1", "uint8": "u1", "int16": "i2", "uint16": "u2", "int32": "i4", "uint32": "u4",
                      "float32": "f4", "float64": "f8"}
# plotly >= 6 sends numeric arrays to plotly.js as base64 typed arrays (Figure.to_dict), older
# plotly as lists (what the JSON writer makes of an array)
_SENDS_TYPED_ARRAYS = int(plotly.__version__.split(".")[0]) >= 6


def _typed_array(v: np.ndarray) -> np.ndarray | dict[str, str]:
    """A numeric array as plotly sends it to plotly.js: with plotly >= 6 a typed array spec,
    ``{"dtype": "f8", "bdata": base64 of the little-endian bytes}`` (and ``"shape": "2, 3"``
    beyond one dimension), 64-bit ints narrowed to the smallest int type that holds them
    (plotly.js has no 64-bit ints), else the array."""
    if not _SENDS_TYPED_ARRAYS or v.size == 0:
        return v
    if v.dtype.kind in "iu" and v.dtype.itemsize == 8:
        lo, hi = int(v.min()), int(v.max())
        fits = [t for t in ((np.int8, np.int16, np.int32) if v.dtype.kind == "i" or lo < 0
                            else (np.uint8, np.uint16, np.uint32)) if np.iinfo(t).min <= lo and hi <= np.iinfo(t).max]
        if not fits:
            return v
        v = v.astype(fits[0])
    code = _TYPED_ARRAY_CODES.get(str(v.dtype))
    if code is None:
        return v
    spec = {"dtype": code, "bdata": base64.b64encode(np.ascontiguousarray(v, v.dtype.newbyteorder("<"))).decode("ascii")}
    if v.ndim > 1:
        spec["shape"] = ", ".join(map(str, v.shape))
    return spec


# inside a <script>, "</script>" or "<!--" in a text would end or hide it, and old parsers took
# U+2028 and U+2029 for line ends: JSON reads these escapes as the same characters
_SCRIPT_SAFE = (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                ("\u2029", "\\u2029"))


def _plain(x: Any) -> Any:
    """What the JSON writer makes of a numpy value or array: the Python number or list."""
    if isinstance(x, (np.generic, np.ndarray)):
        return x.tolist()
    raise TypeError(f"cannot write {type(x).__name__} into a plot's JSON")


def script_json(obj: Any) -> str:
    """``obj`` as compact JSON that is safe inside an HTML <script> element."""
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, default=_plain)  # the page is UTF-8
    for unsafe, escaped in _SCRIPT_SAFE:
        text = text.replace(unsafe, escaped)
    return text


def plot_div(fig: go.Figure | dict[str, Any], div_id: str, config: dict[str, Any], data_json: str | None = None
             ) -> str:
    """A plot on a page that has loaded plotly.js: its <div>, as tall as the layout says
    (else the page decides), and the script that draws it there::

        <div style="height:650px; width:100%;"><div id="ID" class="plotly-graph-div" ...></div>
        <script>if (document.getElementById("ID")) {Plotly.newPlot("ID", data, layout, config)};</script></div>

    ``fig``: a figure dict taken as it is (numeric arrays as plotly sends them, see
    :func:`as_sent`), or a plotly figure (its ``to_dict()``). ``data_json``: its ``data``
    as :func:`script_json` writes it, made beforehand (the figure's own is then not read)."""
    d = fig if isinstance(fig, dict) else fig.to_dict()
    before, after = plot_div_around_data(d, div_id, config)
    return before + (script_json(d.get("data", [])) if data_json is None else data_json) + after


def plot_div_around_data(d: dict[str, Any], div_id: str, config: dict[str, Any]) -> tuple[str, str]:
    """:func:`plot_div`'s text before and after the figure's data, for figure dict ``d``."""
    layout = d.get("layout", {})
    height = layout.get("height")
    style = f"height:{height}px; width:100%;" if isinstance(height, (int, float)) else "height:100%; width:100%;"
    ident = json.dumps(div_id)
    return (f'<div style="{style}"><div id={ident} class="plotly-graph-div" style="height:100%; width:100%;"></div>'
            f'<script>if (document.getElementById({ident})) {{Plotly.newPlot({ident}, ',
            f', {script_json(layout)}, {script_json(config)})}};</script></div>')


@functools.cache
def _white_template_json() -> str:
    """The "plotly_white" template, as JSON, read once from plotly's package data.

    It is what plotly expands ``template="plotly_white"`` into (``layout.template`` of
    ``Figure.to_dict()``; test_report checks), read in ~0.02 s where the expansion builds a
    Template object and imports dozens of validator modules (~0.17 s).
    """
    try:
        return (importlib.resources.files("plotly") / "package_data/templates/plotly_white.json").read_text(
            encoding="utf-8")
    except OSError:  # a plotly that keeps its templates elsewhere: let it expand the name itself
        return json.dumps(go.Figure().update_layout(template="plotly_white").to_dict()["layout"]["template"])


def white_template() -> dict[str, Any]:
    """A fresh copy of the expanded "plotly_white" template, for a layout's ``"template"``."""
    return json.loads(_white_template_json())


def _bar_traces(bars: BarColumns, hover: list[str]) -> list[dict[str, Any]]:
    """The merged bars as plotly traces (see :func:`_group_traces`), grouped by kind and phase."""
    group_of = _Memo(lambda kp: _GROUP_KEYS.index(bar_group(*kp)))
    group = np.fromiter(map(group_of.__getitem__, zip(bars.kind, bars.phase)), dtype=np.int64, count=len(bars.kind))
    return _group_traces(group, bars.row, bars.start_s, bars.dur_s, bars.busy_s, hover)


def _group_traces(group: np.ndarray, row: np.ndarray, start_s: np.ndarray, dur_s: np.ndarray, busy_s: np.ndarray,
                  hover: list[str]) -> list[dict[str, Any]]:
    """One legend entry per group (``group``: index into GROUPS): horizontal bars from
    ``base`` (start) over ``x`` (duration), in ms, one trace per fade level present.

    The most opaque level present carries the legend entry (plotly shows none for an empty
    trace); the others join its legend group, so a click on the entry hides them all. Each
    trace is the dict ``go.Bar(...)`` validates to, keys in its order, so no validator
    walks the arrays (see test_report: it matches a validated figure byte for byte).
    """
    level = fade_levels(busy_s, dur_s)
    base_ms = np.round(start_s * 1e3, 6)
    dur_ms = np.round(dur_s * 1e3, 6)
    out = []
    for g, (key, label, colour) in enumerate(GROUPS):
        in_group = group == g
        shown = False
        for lvl, (_, opacity) in enumerate(FADE_LEVELS):
            idx = np.flatnonzero(in_group & (level == lvl))
            if not idx.size:
                continue
            out.append({
                "base": base_ms[idx].tolist(), "hoverinfo": "text", "hovertext": [hover[i] for i in idx.tolist()],
                "legendgroup": key, "marker": {"color": colour, "line": {"width": 0}, "opacity": opacity},
                "name": label, "orientation": "h", "showlegend": not shown, "width": BAR_WIDTH_ROWS,
                "x": dur_ms[idx], "y": row[idx].astype(np.int32), "type": "bar",
            })
            shown = True
    return out


def _span_keys(trace: Trace, order: SpanOrder) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per span, in display order: its merge key without the microbatch (a code per
    (kind, phase)), its legend group (index into GROUPS) and its microbatch."""
    codes, forms = trace.forms()
    per_form, pairs = _kind_phase_codes(forms)
    group_of = np.array([_GROUP_KEYS.index(bar_group(*kp)) for kp in pairs] or [0], dtype=np.int64)
    mb = trace.mbs()
    kind_phase = per_form[order.take_array(codes)]
    return kind_phase, group_of[kind_phase], order.take_array(mb)


def _timeline_bars(trace: Trace, order: SpanOrder) -> tuple[int, BarColumns | BinnedBars]:
    """The timeline's bars: the merged bars (see :func:`merge_stream`), or, where they would
    be more than BAR_BUDGET, runs of bins (clustersim.output.bins). Also how many merged bars
    there are (at least; counted without merging when they are too many)."""
    max_gap_s = MAX_GAP_FRACTION * order.last_end_s
    if trace.n_spans > BAR_BUDGET:  # else there are fewer bars than that, whatever they are
        kind_phase, group, mb = _span_keys(trace, order)
        row = np.repeat(np.arange(len(order.rows)), np.diff(order.bounds))
        key = kind_phase * (int(mb.max(initial=0)) + 2) + (mb + 1)
        n_merged = bar_count(row, key, order.start_s, order.end_s, max_gap_s)
        if n_merged > BAR_BUDGET:
            return n_merged, binned_within(row, group, mb, order.start_s, order.end_s, len(GROUPS), order.last_end_s,
                                          budget=BAR_BUDGET)
    bars = _merge(trace.span_rows(), trace.forms(), order, order.bounds, order.start_s, order.end_s, max_gap_s,
                  trace.mbs())
    return len(bars.kind), bars


def binned_hover_texts(bars: BinnedBars, labels: list[str]) -> list[str]:
    """Hover text of each run of bins: the mix of work, where, when, busy share, e.g.::

        <b>backward compute 65 % · forward compute 35 %</b>
        stage 3 · compute · microbatches 40–73      (or 40, 68; or 12 microbatches in 40–73)
        start 12,345.678 ms · duration 95.123 ms
        busy 93.500 ms (98 % of the bar) · 53 spans
    """
    where_row = [html.escape(label) for label in labels]
    names = [label for _, label, _ in GROUPS]
    out = []
    share = np.zeros_like(bars.group_busy_s)
    np.divide(bars.group_busy_s, bars.busy_s[:, None], out=share, where=bars.busy_s[:, None] > 0)
    for i, (row, g, lo, hi, n_mbs, mbs, start, dur, busy, n) in enumerate(zip(
            bars.row.tolist(), bars.group.tolist(), bars.mb_lo.tolist(), bars.mb_hi.tolist(), bars.n_mbs.tolist(),
            bars.mbs.tolist(), bars.start_s.tolist(), bars.dur_s.tolist(), bars.busy_s.tolist(),
            bars.n_spans.tolist())):
        mix = [(s, j) for j, s in enumerate(share[i].tolist()) if s >= 0.005]
        if len(mix) > 1:
            mix.sort(reverse=True)
            what = " · ".join(f"{names[j]} {100 * s:.0f} %" for s, j in mix[:3]) + (" · …" if len(mix) > 3 else "")
        else:
            what = names[g]
        where = where_row[row]
        if lo >= 0:
            where = f"{where} · {_microbatches_text(lo, hi, n_mbs, mbs)}"
        busy_share = busy / dur if dur > 0 else 1.0
        out.append(f"<b>{what}</b><br>{where}<br>start {start * 1e3:,.3f} ms · duration {dur * 1e3:,.3f} ms<br>"
                   f"busy {busy * 1e3:,.3f} ms ({100 * busy_share:.0f} % of the bar) · {_n(n, 'span')}")
    return out


def _microbatches_text(lo: int, hi: int, n_mbs: int, listed: list[int]) -> str:
    """A binned bar's microbatches as they are (``n_mbs`` of them from ``lo`` to ``hi``, the
    first few ``listed``): one, a few by name ("microbatches 0, 68"), every one of a range
    ("microbatches 40–73"), or how many in which range ("12 microbatches in 0–68"): a range
    alone said 0–68 of a bar holding microbatches 0 and 68."""
    if n_mbs == 1:
        return f"microbatch {lo}"
    if n_mbs == hi - lo + 1 and n_mbs > 2:
        return f"microbatches {lo}–{hi}"
    if n_mbs <= len(listed):
        return "microbatches " + ", ".join(str(mb) for mb in listed[:n_mbs])
    return f"{n_mbs:,} microbatches in {lo}–{hi}"


def timeline(trace: Trace, summary: dict[str, Any]) -> dict[str, Any]:
    """The Gantt timeline as a plain figure dict, ``{"data": [...], "layout": {...}}``: one
    row per (simulated rank, stream), rows grouped by rank; bars are merged spans (see
    :func:`merge_stream`), or runs of bins past BAR_BUDGET bars (``layout.meta`` then says
    so, see :func:`timeline_note`), one plotly trace per legend group and fade level, then
    the critical path. Traces and layout are in validated form (the template expanded),
    with numeric arrays as numpy arrays (see :func:`as_sent`). Beside them, ``"detail"``: the
    drawn spans one by one, for the page's zoomed-in layer (clustersim.output.zoom; past its
    limit the first of them, ``layout.meta["detail"]`` then says how far they go).
    """
    return _timeline_parts(trace)[1](summary)


def _drawn(trace: Trace) -> tuple[SpanOrder, Any, list[str]]:
    """(the drawn rows' spans in display order, which ranks are drawn (``shown_ranks``), the
    rows' labels)."""
    order = span_order(trace)
    shown = shown_ranks(order, trace.stage_of, MAX_TIMELINE_RANKS)
    if len(shown.ranks) < shown.of:
        order = only_ranks(order, shown.ranks)
    return order, shown, row_labels(trace, order.rows)


def _detail(trace: Trace, order: SpanOrder | None = None, labels: list[str] | None = None) -> dict[str, Any] | None:
    """The drawn spans, for the page's op-by-op layer (clustersim.output.zoom: past its limit,
    the first of them), or None without spans; ``order``, ``labels``: as :func:`_drawn` gives
    them, where made already."""
    if order is None or labels is None:
        order, _, labels = _drawn(trace)
    return detail_data(trace, order, labels, bar_group, size_flops_text)


def _timeline_parts(trace: Trace) -> tuple[list[dict[str, Any]], Callable[[dict[str, Any]], dict[str, Any]]]:
    """:func:`timeline`'s work that needs the trace only (the bars and their hover texts),
    done now: (the bars' traces, a function that adds what needs the summary: critical path,
    axis). The figure's ``data`` starts with those traces, whatever the summary."""
    order, shown, labels = _drawn(trace)
    rows = order.rows
    n_merged, bars = _timeline_bars(trace, order)
    meta: dict[str, Any] = {}
    if isinstance(bars, BinnedBars):
        data = _group_traces(bars.group, bars.row, bars.start_s, bars.dur_s, bars.busy_s,
                             binned_hover_texts(bars, labels))
        meta["binned"] = {"merged_bars": n_merged, "bars": len(bars.row), "bin_ms": bars.bin_s * 1e3}
    else:
        data = _bar_traces(bars, hover_texts(bars, labels))
    detail = _detail(trace, order, labels)
    if detail is not None and detail["until_ms"] is not None:  # the first spans alone (see timeline_note)
        meta["detail"] = {k: detail[k] for k in ("until_ms", "carried", "of")}
    if len(shown.ranks) < shown.of:
        meta["shown"] = {"ranks": len(shown.ranks), "of": shown.of, "alike": len(shown.alias), "kinds": shown.kinds,
                         "stages": shown.stages, "of_stages": shown.of_stages,
                         # for the look-up box: the ranks drawn, and the drawn rank of each other's kind
                         "drawn": list(shown.ranks), "alias": {str(r): a for r, a in shown.alias.items()}}

    def with_summary(summary: dict[str, Any]) -> dict[str, Any]:
        path = path_trace(summary, rows, shown.alias)
        step_ms = 1e3 * float(summary.get("step_time_s") or order.last_end_s)
        layout = _layout(len(rows), labels, step_ms, _rank_bands(rows))
        if meta:
            layout["meta"] = meta
        under = [dict(_BOTTOM_AXIS_TRACE)] if "xaxis2" in layout else []
        fig = {"data": [*data, *under] if path is None else [*data, *under, path], "layout": layout}
        if detail is not None:
            fig["detail"] = detail
        return fig
    return data, with_summary


def build_figure(trace: Trace, summary: dict[str, Any]) -> go.Figure:
    """The Gantt timeline as a plotly figure (see :func:`timeline`), validated by plotly."""
    fig_dict = timeline(trace, summary)
    fig = go.Figure(fig_dict["data"])
    fig.update_layout(fig_dict["layout"])
    return fig


def as_sent(fig_dict: dict[str, Any]) -> dict[str, Any]:
    """What ``Figure.to_dict()`` gives for the figure :func:`build_figure` makes of
    ``fig_dict``, without validating it again: numeric arrays as plotly sends them."""
    sent = {"data": list(map(_sent_trace, fig_dict["data"])), "layout": fig_dict["layout"]}
    if "detail" in fig_dict:  # (the page's spans one by one: not plotly's, kept beside it)
        sent["detail"] = fig_dict["detail"]
    return sent


def _sent_trace(trace: dict[str, Any]) -> dict[str, Any]:
    """One trace of :func:`as_sent`."""
    return {k: _typed_array(v) if isinstance(v, np.ndarray) else v for k, v in trace.items()}


# how the report draws a critical path that goes back and forth faster than the view can show
# (:func:`path_pieces`): stays shorter than PATH_DENSE_PX pixels of the full-width view (1,000
# px across the step, as bins.TIMELINE_BINS), a rank met again within PATH_REVISIT stays,
# PATH_DENSE_MIN stays or more per rank drawn; a line along the row of each rank with
# PATH_MAJOR of the stretch's time or more
PATH_DENSE_PX = 4
PATH_REVISIT = 32
PATH_DENSE_MIN = 8
PATH_MAJOR = 0.05


def path_pieces(segments: list[dict[str, Any]], step_s: float) -> list[tuple[int, int]]:
    """The critical path's segments (summary.json ``critical_path.segments``, one per stay on
    a rank) as pieces to draw, (first, last) segment index each: a segment alone, or a
    *stretch* where the path goes back and forth among a few ranks faster than the
    full-width view can show. A pipeline's steady state sends the path back and forth between
    stages every microbatch (Megatron-1T: stages 59 and 60, 510 times in 85 s, each stay
    0.16 s, under 2 px; a 4-stage 1F1B step of 1,024 microbatches: all four, 1,500 times);
    drawn hop by hop, its vertical lines fill the rows between those stages solid black::

        ranks      ... 57 58 59 60 61 62 63 62 61 60 59 60 59 60 ... 59 60 61 62 63 62 ...
        met again                          ^  ^  ^  ^  ^  ^  ^  ...  ^  ^
        stretch                                     60 59 60 59 ... 59 60            stages
                                                                                     59 and 60
    A stretch is a run of stays, each shorter than PATH_DENSE_PX pixels, on ranks met again
    within PATH_REVISIT stays, at its ends only ranks with PATH_MAJOR of its time or more (the
    ranks drawn), reaching back over the first stays on those ranks just before it, and with
    PATH_DENSE_MIN stays or more per rank drawn. A walk down the stages (the warm-up), a walk
    down and back (61 62 63 62 61), an interleaved warm-up's three walks down 16 stages (each
    rank met three times: hops that the view still shows apart) or a long stay stays drawn hop
    by hop."""
    n = len(segments)
    short_s = PATH_DENSE_PX * step_s / TIMELINE_BINS
    ranks = [seg["rank"] for seg in segments]
    short = [seg["end_s"] - seg["start_s"] < short_s for seg in segments]
    again = [False] * n  # its rank met within the PATH_REVISIT short stays before it
    last: dict[int, int] = {}
    for k in range(n):
        if not short[k]:
            last.clear()  # a long stay ends any back and forth
            continue
        j = last.get(ranks[k])
        again[k] = j is not None and k - j <= PATH_REVISIT
        last[ranks[k]] = k
    stretches: list[tuple[int, int]] = []
    k = 0
    while k < n:
        if not again[k]:
            k += 1
            continue
        lo = hi = k
        while hi < n and again[hi]:
            hi += 1
        k = hi
        major = _major_ranks(segments[lo:hi])
        while lo < hi and ranks[lo] not in major:
            lo += 1
        while hi > lo and ranks[hi - 1] not in major:
            hi -= 1
        floor = stretches[-1][1] if stretches else 0
        while lo > floor and short[lo - 1] and ranks[lo - 1] in major:  # the first stays on its ranks
            lo -= 1
        if hi - lo >= PATH_DENSE_MIN * len(_major_ranks(segments[lo:hi])):
            stretches.append((lo, hi))
    out: list[tuple[int, int]] = []
    k = 0
    for lo, hi in stretches:
        out += [(i, i) for i in range(k, lo)] + [(lo, hi - 1)]
        k = hi
    return out + [(i, i) for i in range(k, n)]


def _major_ranks(segs: list[dict[str, Any]]) -> set[int]:
    """The ranks holding PATH_MAJOR or more of ``segs``' time."""
    on: dict[int, float] = {}
    for seg in segs:
        on[seg["rank"]] = on.get(seg["rank"], 0.0) + seg["end_s"] - seg["start_s"]
    total = sum_left(on.values())
    return {rank for rank, t in on.items() if total <= 0 or t >= PATH_MAJOR * total}


def _segment_hover(seg: dict[str, Any]) -> str:
    return (f"critical path on rank {seg['rank']} (stage {seg['stage']})<br>{fmt_time(seg['start_s'])} → "
            f"{fmt_time(seg['end_s'])}: {seg['tasks']:,} tasks, compute {fmt_time(seg['compute_s'])}, "
            f"communication {fmt_time(seg['comm_s'])}<br>from {html.escape(seg['first'])} to "
            f"{html.escape(seg['last'])}")


def _stretch_hover(segs: list[dict[str, Any]]) -> str:
    """What a stretch of the path (:func:`path_pieces`) is made of: its ranks' shares of it."""
    start_s, end_s = segs[0]["start_s"], segs[-1]["end_s"]
    on: dict[int, list] = {}
    for seg in segs:
        got = on.setdefault(seg["rank"], [seg["stage"], 0.0, 0])
        got[1] += seg["end_s"] - seg["start_s"]
        got[2] += 1
    span_s = end_s - start_s
    shares = "<br>".join(
        f"rank {rank} (stage {stage}): {_pct(t / span_s if span_s > 0 else 0.0)}, {_n(visits, 'stay')}"
        for rank, (stage, t, visits) in on.items())
    return (f"critical path back and forth among {len(on)} ranks<br>{fmt_time(start_s)} → {fmt_time(end_s)}: "
            f"{_n(len(segs), 'stay')} of {fmt_time(span_s / len(segs))} on average<br>{shares}")


def path_trace(summary: dict[str, Any], rows: list[tuple[int, str]],
               alias: dict[int, int] | None = None) -> dict[str, Any] | None:
    """The critical path as a line over the timeline: along a rank's compute row while the
    path stays on that rank, down or up to the next rank where it crosses over; a stretch
    that goes back and forth faster than the view can show (:func:`path_pieces`) as a line on
    each of its ranks' rows, without the hops. ``alias``: a rank not drawn -> the drawn rank
    of its kind (clustersim.output.shown), on whose rows its part of the path goes; the path
    on other ranks not drawn is left out, the line broken there. A scatter trace in
    validated form (what ``go.Scatter(...)`` gives), or None."""
    row_of: dict[int, int] = {}
    for i, (rank, stream) in enumerate(rows):
        if stream == "compute" or rank not in row_of:
            row_of[rank] = i if stream == "compute" else row_of.get(rank, i)
    for hidden, drawn in (alias or {}).items():
        if drawn in row_of:
            row_of.setdefault(hidden, row_of[drawn])
    every = (summary.get("critical_path") or {}).get("segments") or []
    step_s = float(summary.get("step_time_s") or (every[-1]["end_s"] if every else 0.0))
    xs: list[float | None] = []
    ys: list[float | None] = []
    text: list[str | None] = []
    # runs of segments on drawn rows: the line breaks where a part of the path is left out
    # (joined over it, it would show the path on a rank it was not on)
    runs: list[list[dict[str, Any]]] = []
    drawn_before = False
    for seg in every:
        drawn = seg["rank"] in row_of
        if drawn:
            if not drawn_before:
                runs.append([])
            runs[-1].append(seg)
        drawn_before = drawn
    for segments in runs:
        if xs:
            xs.append(None)
            ys.append(None)
            text.append(None)
        _path_line(segments, step_s, row_of, xs, ys, text)
    if not xs:
        return None
    return {"hovertemplate": "%{hovertext}<extra></extra>", "hovertext": text, "legendgroup": "path",
            "line": {"color": "#111111", "width": 2}, "mode": "lines", "name": "critical path",
            "x": xs, "y": ys, "type": "scatter"}


def _path_line(segments: list[dict[str, Any]], step_s: float, row_of: dict[int, int], xs: list, ys: list,
               text: list) -> None:
    """Points of :func:`path_trace`'s line over ``segments``, one after the other on drawn
    rows, appended to ``xs``, ``ys`` and ``text``."""
    for first, last in path_pieces(segments, step_s):
        if first == last:
            seg = segments[first]
            hover = _segment_hover(seg)
            xs += [1e3 * seg["start_s"], 1e3 * seg["end_s"]]
            ys += [row_of[seg["rank"]]] * 2
            text += [hover, hover]
            continue
        segs = segments[first:last + 1]
        hover = _stretch_hover(segs)
        x0, x1 = 1e3 * segs[0]["start_s"], 1e3 * segs[-1]["end_s"]
        enter, leave = row_of[segs[0]["rank"]], row_of[segs[-1]["rank"]]
        # in at the first segment's row (the hop from the piece before), each other rank's
        # line on its own, then the last segment's row, from which the next piece hops on
        xs += [x0, None]
        ys += [enter, None]
        text += [hover, None]
        major = _major_ranks(segs)
        for y in dict.fromkeys(row_of[seg["rank"]] for seg in segs if seg["rank"] in major):
            if y != leave:
                xs += [x0, x1, None]
                ys += [y, y, None]
                text += [hover, hover, None]
        xs += [x0, x1]
        ys += [leave, leave]
        text += [hover, hover]


def _rank_bands(rows: list[tuple[int, str]]) -> list[dict]:
    """Light background bands on every other rank, so a rank's rows read as one group."""
    spans: list[list[int]] = []  # [first row, last row] per rank
    for i, (rank, _) in enumerate(rows):
        if spans and rows[spans[-1][0]][0] == rank:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return [{"type": "rect", "xref": "paper", "yref": "y", "x0": 0, "x1": 1, "y0": lo - 0.5,
             "y1": hi + 0.5, "fillcolor": "#eef1f5", "line": {"width": 0}, "layer": "below"}
            for n, (lo, hi) in enumerate(spans) if n % 2 == 0]


# one style for the numbers on every chart's axes, "2,000": plotly's default wrote "2k" on the
# memory and link-use charts beside the timeline's "2,000" (its ms tick formats below)
NUMBER_TICKS = {"exponentformat": "none", "separatethousands": True}

# Tick labels with as many decimals as the tick spacing needs (2,000 at full view, 1,000.2
# when zoomed to a millisecond), never an exponent.
_MS_TICK_FORMATS = [
    {"dtickrange": [None, 0.01], "value": ",.3f"},
    {"dtickrange": [0.01, 0.1], "value": ",.2f"},
    {"dtickrange": [0.1, 1], "value": ",.1f"},
    {"dtickrange": [1, None], "value": ",.0f"},
]


TALL_ROWS = 40  # rows from which the timeline is taller than most screens: its time axis is written under it too

# the empty trace on the timeline's time axis under its rows: plotly draws no axis without a trace on it
_BOTTOM_AXIS_TRACE = {"hoverinfo": "skip", "showlegend": False, "x": [], "xaxis": "x2", "y": [], "type": "scatter"}


def _bottom_axis(top: dict) -> dict:
    """The timeline's time axis (``top``) again, under its rows, following the top one's zoom
    (``matches``): a tall timeline scrolled down read no times, its labels at the top alone."""
    return {**{k: v for k, v in top.items() if k not in ("title", "side", "mirror", "range")},
            "side": "bottom", "overlaying": "x", "matches": "x", "anchor": "y", "showgrid": False}


def _layout(n_rows: int, labels: list[str], step_ms: float, bands: list[dict]) -> dict:
    """Layout of the timeline, in validated form; from TALL_ROWS rows on, with the time axis
    under the rows too (:func:`_bottom_axis`, drawn where :data:`_BOTTOM_AXIS_TRACE` is on it)."""
    layout = {
        "template": white_template(),
        "barmode": "overlay",
        "height": 140 + ROW_HEIGHT_PX * max(n_rows, 4),
        # the mode bar stands upright in the right margin: across the top it covered the
        # legend's last entries whenever the pointer was over the chart
        "margin": {"l": 10, "r": 44, "t": 100, "b": 30},
        "modebar": {"orientation": "v"},
        "font": {"family": "system-ui, -apple-system, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif",
                 "size": 12},
        "legend": {"orientation": "h", "x": 0, "y": 1, "yref": "container", "yanchor": "top",
                   "traceorder": "normal",
                   "itemclick": "toggle", "itemdoubleclick": "toggleothers"},
        "hoverlabel": {"align": "left"},
        "hovermode": "closest",
        # time runs along the top, as in trace viewers: the chart is taller than a screen
        "xaxis": {"title": {"text": "time (ms)", "standoff": 6}, "side": "top", "mirror": "ticks",
                  "range": [0, step_ms * 1.005], "tickformatstops": _MS_TICK_FORMATS,
                  "showgrid": True, "gridcolor": "#d9dde3", "zeroline": False, "ticks": "outside",
                  "showline": True, "linecolor": "#9aa3ad", **NUMBER_TICKS},
        "yaxis": {"tickmode": "array", "tickvals": list(range(n_rows)), "ticktext": labels,
                  "range": [n_rows - 0.5, -0.5], "showgrid": False, "zeroline": False,
                  "automargin": True, "tickfont": {"size": 11}},
        "shapes": bands,
        "uirevision": "timeline",
    }
    if n_rows >= TALL_ROWS:
        layout["xaxis2"] = _bottom_axis(layout["xaxis"])
        layout["margin"] = {**layout["margin"], "b": 40}  # (room for the labels under the rows)
    return layout


# --------------------------------------------------------------------------- HTML panels

REPORT_CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif;
       margin: 24px 32px; color: #1f2328; background: #fff; line-height: 1.4; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid #d0d7de; padding-bottom: 4px; }
p.desc { margin: 0 0 6px; font-size: 15px; }
p.meta, p.note { margin: 2px 0; color: #57606a; font-size: 13px; }
.span-name { color: #8c959f; font-size: 12px; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; margin-top: 18px; }
.card { border: 1px solid #d0d7de; border-radius: 8px; padding: 10px 16px; min-width: 130px; }
.card .label { font-size: 12px; color: #57606a; text-transform: uppercase; letter-spacing: .04em; }
.card .value { font-size: 24px; font-weight: 600; font-variant-numeric: tabular-nums; }
.card .sub { font-size: 12px; color: #57606a; }
.panels { display: flex; flex-wrap: wrap; gap: 0 32px; align-items: flex-start; }
.panels > div { flex: 1 1 auto; }  /* a panel alone on its row spans it, its heading's rule too */
table { border-collapse: collapse; font-size: 13px; font-variant-numeric: tabular-nums;
        display: block; overflow-x: auto; max-width: 100%;  /* a wide table scrolls, not the page */
        /* and shows it: a shadow on a side with more columns past it (the white covers sit
           with the content, the shadows with the box, so a side's shadow shows only while
           columns lie past it) */
        background: linear-gradient(to right, #fff 30%, rgba(255,255,255,0)) left / 40px 100% no-repeat local,
                    linear-gradient(to left, #fff 30%, rgba(255,255,255,0)) right / 40px 100% no-repeat local,
                    radial-gradient(farthest-side at 0 50%, rgba(0,0,0,.2), rgba(0,0,0,0)) left / 14px 100% no-repeat scroll,
                    radial-gradient(farthest-side at 100% 50%, rgba(0,0,0,.2), rgba(0,0,0,0)) right / 14px 100% no-repeat scroll; }
th, td { padding: 3px 10px; text-align: right; border-bottom: 1px solid #eaeef2; white-space: nowrap; }
th { background: #f6f8fa; font-weight: 600; border-bottom: 1px solid #d0d7de; }
td.l, th.l { text-align: left; }
td.wrap, th.wrap { white-space: normal; min-width: 12em; }
td.wide, th.wide { white-space: normal; min-width: 26em; }
tr.total td { font-weight: 600; border-top: 1px solid #d0d7de; }
details.gpus { margin: 4px 0 10px; font-size: 13px; }
details.gpus summary { cursor: pointer; color: #0969da; }
#gpu-find { width: 7em; font-size: 13px; }
.meter { display: inline-block; width: 130px; height: 10px; background: #eaeef2; border-radius: 3px;
         overflow: hidden; vertical-align: middle; }  /* 130 px: an interleaved MoE's memory table fits a 1,400-px window */
.meter span { display: inline-block; height: 100%; vertical-align: top; }
.hidden { background: #8cc084; } .exposed { background: #e15759; }
.used { background: #4e79a7; } .over { background: #e15759; }
.fits { color: #1a7f37; font-weight: 600; } .nofit { color: #cf222e; font-weight: 700; }
.fits.tight { color: #9a6700; }
/* the whole step: the section's width */
.breakdown { display: flex; height: 22px; border-radius: 4px; overflow: hidden; margin: 4px 0; }
.breakdown span { display: block; height: 100%; }
.legend-key { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin: 0 4px 0 10px; }
"""


def _card(label: str, value: str, sub: str = "", cls: str = "") -> str:
    sub_html = f'<div class="sub">{sub}</div>' if sub else ""
    return (f'<div class="card"><div class="label">{label}</div>'
            f'<div class="value {cls}">{value}</div>{sub_html}</div>')


def _n(count: int, noun: str) -> str:
    """'1 node', '8 nodes'."""
    return f"{count:,} {noun}" if count == 1 else f"{count:,} {noun}s"


def model_line(model: dict[str, Any]) -> str:
    """The header's model: its name where the scenario gives one, its size and its shape
    ('llama3-8b · 8.0 B parameters, 32 layers, hidden 4096'); unnamed, size and shape alone,
    as a name of the default's would tell nothing."""
    params = model.get("params")
    shape = [f"{params / 1e9:.1f} B parameters" if params else "", _n(model.get("layers") or 0, "layer"),
             # (summaries written before hidden was among the keys lack it)
             f"hidden {model['hidden']}" if model.get("hidden") else ""]
    return " · ".join(p for p in (model.get("name") or "", ", ".join(p for p in shape if p)) if p)


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


# the files beside a page that its header links, each (name, what it holds)
Files = tuple[tuple[str, str], ...]
# those of ``clustersim run``: summary.json always, the trace unless --no-trace
SUMMARY_LINK = ("summary.json", "every figure of this page, and more, as JSON")
TRACE_LINK = ("trace.json.gz", "every span of every simulated rank: ui.perfetto.dev opens it, zoomable to "
              "each op, where the timeline below merges them into bars")


def files_html(files: Files) -> str:
    """One line linking the files beside the page (none: nothing): what the page draws comes
    from them, and Perfetto shows what its bars merge."""
    if not files:
        return ""
    e = html.escape
    return ('<p class="meta">files: ' + " · ".join(f'<a href="{e(name)}">{e(name)}</a> ({e(what)})'
                                                    for name, what in files) + "</p>")


def header_html(summary: dict[str, Any]) -> str:
    """Title, description and one line each on cluster, plan and model."""
    from ..engine.repeat import ways  # (the schedules fed from both ends; the engine's, not imported with the page)

    e = html.escape
    name = e(str(summary.get("scenario", "scenario")))
    out = [f"<h1>clustersim · {name}</h1>"]
    if summary.get("description"):
        out.append(f'<p class="desc">{e(str(summary["description"]))}</p>')
    hw, plan, model = summary.get("hardware", {}), summary.get("plan", {}), summary.get("model", {})
    if hw:
        out.append(f'<p class="meta">cluster: {summary.get("world_size", "?")} × {e(str(hw.get("gpu", "?")))} '
                   f'({_n(hw.get("nodes") or 0, "node")} × {hw.get("gpus_per_node", "?")}, '
                   f'{e(str(hw.get("topology", "")))}){e(topology_changes_note(hw) + what_if_note(hw))}'
                   f'{e("".join(" · " + c for c in link_ceilings_said(hw, summary.get("links"))))}</p>')
        if network_said(hw):
            out.append(f'<p class="meta">network: {e(network_said(hw))}</p>')
    if plan:
        out.append(f'<p class="meta">plan: {e(plan_dims(plan, " × ") + plan_options(plan))}'
                   f'{e(schedule_part(plan, " · ")) if "schedule" in plan else ""} · {plan.get("microbatches")} microbatches × '
                   f'{plan.get("micro_batch_size")} × {model.get("seq_len", "?")} tokens · '
                   # (fp8 is in the options, with its recipe)
                   f'{"" if plan.get("fp8_recipe") else e(str(plan.get("precision", ""))) + " · "}'
                   f'{e(str(plan.get("attention", "")))} attention</p>')
    if model:
        out.append(f'<p class="meta">model: {e(model_line(model))}</p>')
    rep = summary.get("simulation", {}).get("repeat")
    if rep:  # what the timeline below holds: most of it copied from a steady cycle
        out.append(f'<p class="meta">simulated: {rep["simulated_microbatches"]} of {plan.get("microbatches")} '
                   f'microbatches; their steady cycle of {rep["cycle_microbatches"]} '
                   f'microbatch{"es" if rep["cycle_microbatches"] != 1 else ""}'
                   f'{" (half each way)" if ways(plan.get("schedule", "")) == 2 else ""} '
                   f'({rep["cycle_s"]:.4g} s) copied in {rep["cycles_copied"]} times from '
                   f'{rep["cut_s"]:.4g} s on (simulation.repeat)</p>')
    elif summary.get("simulation", {}).get("repeat_tried"):
        out.append(f'<p class="meta">simulated: all {plan.get("microbatches")} microbatches; a shorter step of '
                   f'{summary["simulation"]["repeat_tried"]} showed no steady cycle to copy in '
                   f'(simulation.repeat)</p>')
    sim = summary.get("simulation", {})
    collapsed = sim.get("collapse_symmetric", False)
    splits = replicas_note(sim, " ") + fabric_faults_note(sim.get("fabric_faults"), " ", collapsed) \
        + leaf_split_note(sim.get("leaf_split"), " ", collapsed, sim.get("simulated_ranks", 0)) \
        + asymmetric_note(sim, " ", summary.get("world_size", 0)) + straggler_note(summary, " ")
    if splits:
        out.append(f'<p class="meta">simulated:{e(splits)}</p>')
    fallbacks = collective_fallbacks_note(summary.get("simulation", {}).get("collective_fallbacks"), "\n")
    out.extend(f'<p class="meta">simulated: {e(line)}</p>' for line in fallbacks.split("\n") if line)
    return "\n".join(out)


def cards_html(summary: dict[str, Any]) -> str:
    """The headline numbers, one card each."""
    s = summary
    tflops_sub = " · ".join(x for x in (f'{s["hw_tflops_per_gpu"]:.1f} hardware' if "hw_tflops_per_gpu" in s
                                         else "", peak_text(s)) if x)
    fits = (s.get("memory") or {}).get("fits", True)
    hosts = not fits and host_only_unfit(s["memory"])  # (every GPU fits, the hosts' memory does not)
    cards = [  # a plan that does not fit says so beside its step time too: it could not run
        _card("step time", step_text(s["step_time_s"]),
              "" if fits else f"the plan does not fit in {'host ' if hosts else ''}memory", "" if fits else "nofit"),
        _card("tokens / s", f'{s["tokens_per_s"]:,.0f}',
              f'{s["tokens_per_s_per_gpu"]:,.1f} per GPU' if "tokens_per_s_per_gpu" in s and s.get("world_size", 2) > 1
              else ""),
        _card("TFLOP/s per GPU", f'{s["tflops_per_gpu"]:.1f}', tflops_sub),
        # (what the simulation leaves out makes it an upper bound: docs/metrics.md, published
        # A100 steps 1-14 % longer than simulated, H100 FP8 runs 1.23-1.43x)
        _card("MFU", _pct(s["mfu"]), "model FLOPs / peak; an upper bound"),
        _card("HFU", _pct(s["hfu"]), "executed FLOPs / peak"),
        # without a pipeline, what idles a GPU is waiting for others (a straggler, a slow link)
        # (the note on a line of its own after its colon: the card keeps its width)
        _card("pipeline bubble", _pct(s["bubble_fraction"]), "<br>".join(
            x for x in ("of the step, GPU mean", unfilled_pipeline(s).replace(": ", ":<br>")) if x))
        if s.get("plan", {}).get("pp", 2) > 1 else
        _card("bubble", _pct(s["bubble_fraction"]), "of the step idle, waiting on other GPUs (no pipeline)"),
    ]
    exposed = s.get("exposed_comm_s", {}).get("total")
    if exposed is not None:
        share = exposed / s["step_time_s"] if s["step_time_s"] else 0.0
        cards.append(_card("exposed comm", fmt_time(exposed), f"{_pct(share)} of the step"))
    mem = s.get("memory")
    if mem:
        ok = mem["fits"]
        cards.append(_card("peak memory", f'{mem["peak_bytes"] / GiB:.1f} GiB',
                           f'of {mem["capacity_bytes"] / GiB:.0f} GiB · '
                           + (("fits, tight" if mem.get("tight") else "fits") if ok else
                              "fits; the host's memory does not" if hosts else "DOES NOT FIT"),
                           "" if ok else "nofit"))
    pj = s.get("projection")
    if pj:
        cost = f' · ${pj["cost_usd"]:,.0f}' if pj.get("cost_usd") is not None else ""
        pue = f' x PUE {pj["pue"]:g}' if pj.get("pue", 1.0) != 1.0 else ""  # (as the terminal's projection line)
        unfit = "<br>if the plan fit in memory" if mem and not mem["fits"] else ""  # (as the step's card says)
        cards.append(_card(f'run of {pj["tokens"] / 1e12:g}T tokens', f'{pj["days"]:,.1f} days',
                           f'{pj["gpu_hours"]:,.0f} GPU-hours{cost}<br>{pj["energy_MWh"]:,.0f} MWh at GPU TDP{pue}'
                           + unfit, "" if not unfit else "nofit"))
    return f'<div class="cards">{"".join(cards)}</div>'


def breakdown_html(summary: dict[str, Any]) -> str:
    """Where the step's time goes, for the mean GPU, as one bar::

        step = compute + exposed communication + bubble          (docs/invariants.md, bubble-split)
        [compute .................|exposed comm .........| bubble ......]

    Exposed: the GPU's compute stream idle while communication runs; its kinds are listed
    beside it (where two kinds overlap each counts it, so they can add up to more)."""
    step_s = summary.get("step_time_s") or 0.0
    ex = summary.get("exposed_comm_s", {})
    if step_s <= 0 or "compute_s" not in summary or "total" not in ex:
        return ""
    kinds = " · ".join(f"{k} {fmt_time(ex[k])}" for k in COMM_KINDS if ex.get(k, 0.0) > 0)
    compute_colour = next(c for g, _, c in GROUPS if g == "F")  # the timeline's, and .exposed's red below
    # (optimizer offload's copies and host steps are waited for as communication is)
    waited = "exposed communication" + (" and offload" if ex.get("offload", 0.0) > 0 else "")
    parts = [("compute", summary["compute_s"], compute_colour, ""),
             (waited, ex["total"], "#e15759", f": {kinds}" if kinds else ""),
             ("bubble (idle)", summary.get("bubble_fraction", 0.0) * step_s, "#d0d7de", "")]
    parts = [x for x in parts if x[1] > 0]
    segs = "".join(f'<span style="width:{100 * s / step_s:.3f}%;background:{c}" title="{label}: {fmt_time(s)} '
                   f'({_pct(s / step_s)})"></span>' for label, s, c, _ in parts)
    keys = "".join(f'<span class="legend-key" style="background:{c}"></span>{label} {fmt_time(s)} '
                   f'({_pct(s / step_s)}){html.escape(more)}' for label, s, c, more in parts)
    return (f'<div><h2>Where the step\'s time goes</h2><div class="breakdown">{segs}</div>'
            f'<p class="note">{keys}</p><p class="note">Per GPU, the mean over GPUs: compute, the communication '
            'the compute stream waited for, and the bubble (idle, nothing running) add up to the step. Where two '
            'kinds of communication overlap, each kind counts the time.</p></div>')


def comm_html(summary: dict[str, Any]) -> str:
    """Communication per GPU: busy time per kind split into hidden (under compute) and exposed."""
    comm, exposed = summary.get("comm_s", {}), summary.get("exposed_comm_s", {})
    kinds = [k for k in comm if comm[k] > 0]
    if not kinds:
        return "<h2>Communication per GPU</h2><p class=\"note\">No communication in this step.</p>"
    step = summary["step_time_s"] or 1.0
    widest = max(comm[k] for k in kinds)
    rows = []
    for k in kinds:
        busy, exp = comm[k], exposed.get(k, 0.0)
        hid = max(busy - exp, 0.0)
        w_hid, w_exp = 100 * hid / widest, 100 * exp / widest
        meter = (f'<span class="meter"><span class="hidden" style="width:{w_hid:.1f}%"></span>'
                 f'<span class="exposed" style="width:{w_exp:.1f}%"></span></span>')
        rows.append(f'<tr><td class="l">{html.escape(k)}</td><td>{fmt_time(busy)}</td><td>{fmt_time(hid)}</td>'
                    f'<td>{fmt_time(exp)}</td><td>{_pct(exp / step)}</td><td class="l">{meter}</td></tr>')
    if "total" in exposed:
        rows.append(f'<tr class="total"><td class="l">all kinds</td><td></td><td></td>'
                    f'<td>{fmt_time(exposed["total"])}</td><td>{_pct(exposed["total"] / step)}</td><td></td></tr>')
    return ("<div><h2>Communication per GPU</h2><table><tr><th class=\"l\">kind</th><th>busy</th>"
            "<th>hidden</th><th>exposed</th><th>exposed / step</th>"
            "<th class=\"l\"><span class=\"legend-key hidden\"></span>hidden"
            "<span class=\"legend-key exposed\"></span>exposed</th></tr>"
            + "".join(rows) + "</table>"
            "<p class=\"note\">Exposed: the GPU's compute stream is idle while this kind runs. "
            "“all kinds” counts overlapping kinds once.</p></div>")


def _over_step_layout(height_px: int, step_ms: float, y_title: str) -> dict:
    """Layout of a small line chart over the step (link use, memory): time in ms along x.
    In validated form (see :func:`links_figure`)."""
    return {"height": height_px, "margin": {"l": 60, "r": 20, "t": 10, "b": 40}, "template": white_template(),
            "xaxis": {"title": {"text": "time (ms)"}, "range": [0, step_ms], "tickformatstops": _MS_TICK_FORMATS,
                      **NUMBER_TICKS},
            "yaxis": {"title": {"text": y_title}, "rangemode": "tozero", **NUMBER_TICKS},
            # (plotly hides the legend of a single line, and the line is then nobody's: the one
            # link of a step whose busiest links are all alike)
            "showlegend": True, "legend": {"orientation": "h", "y": -0.25}}


def _embedded(fig: dict[str, Any] | None, div_id: str, note: str) -> str:
    """A small chart with its note, for a page that has loaded plotly.js once; "" without one.
    ``fig`` is taken as it is (as :func:`links_figure` makes it: already in validated form)."""
    if fig is None:
        return ""
    return (f'<p class="note">{note}</p>'
            + plot_div(fig, div_id, {"displaylogo": False, "responsive": True}))


LINKS_DIV_ID = "clustersim-links"
LINKS_SHOWN = 5


def links_figure(summary: dict[str, Any]) -> dict[str, Any] | None:
    """Utilisation over the step of the busiest links (lines, one per link), or None.

    A figure dict in validated form, what ``go.Figure(...).to_dict()`` gives (test_report
    checks), so that writing the report runs no plotly validator; ``go.Figure(d)`` makes a
    figure of it.
    """
    busiest = [u for u in (summary.get("links") or {}).get("busiest", []) if u.get("utilisation_over_time")]
    if not busiest:
        return None
    step_ms = 1e3 * float(summary.get("step_time_s") or 0.0)
    data = []
    # one line for links whose use is the same bin by bin (twins of one orbit): drawn on top of
    # each other they would show one line under five names
    for alike in _alike(busiest, lambda u: (u["kind"], tuple(round(x, 3) for x in u["utilisation_over_time"])))[
            :LINKS_SHOWN]:
        u, name = alike[0], _alike_name(alike, busiest)
        series = u["utilisation_over_time"]
        width_ms = step_ms / len(series)
        data.append({
            "hovertemplate": "%{y:.0f} % at %{x:,.0f} ms<extra>" + html.escape(name) + "</extra>",
            "line": {"shape": "hv", "width": 1.5}, "mode": "lines", "name": f'{name} ({u["kind"]})',
            # each bin's value from its left edge ("hv" holds it to the next point), and the
            # last one held to the step's end
            "x": [width_ms * i for i in range(len(series))] + [step_ms],
            "y": [100 * x for x in series] + [100 * series[-1]],
            "type": "scatter"})
    return {"data": data, "layout": _over_step_layout(300, step_ms, "use of bandwidth (%)")}


def links_html(summary: dict[str, Any]) -> str:
    """The busiest links of the step: bytes, mean and peak utilisation of usable bandwidth."""
    links = summary.get("links") or {}
    busiest = links.get("busiest") or []
    if not busiest:
        return ""
    rows = []
    # (alike as the row shows them: twins' figures differ in their last bits)
    for alike in _alike(busiest, lambda u: (u["kind"], fmt_bytes(u["bytes"]), round(u["bw_Bps"] / 1e9),
                                            _pct(u["utilisation"]), _pct(u["peak_utilisation"]))):
        u = alike[0]
        meter = (f'<span class="meter"><span class="exposed" style="width:{100 * min(u["utilisation"], 1):.1f}%">'
                 f'</span></span>')
        every = html.escape(", ".join(x["link"] for x in alike), quote=True)
        rows.append(f'<tr><td class="l" title="{every}">{html.escape(_alike_name(alike, busiest))}</td>'
                    f'<td class="l">{html.escape(u["kind"])}</td>'
                    f'<td>{fmt_bytes(u["bytes"])}</td><td>{u["bw_Bps"] / 1e9:.0f} GB/s</td>'
                    f'<td>{_pct(u["utilisation"])}</td><td>{_pct(u["peak_utilisation"])}</td>'
                    f'<td class="l">{meter}</td></tr>')
    # each kind's highest peak: a NIC at 99 % for moments ranks below NVLink links busier on
    # the mean, and the table above would not show it
    kinds = "".join(f'<tr><td class="l">{html.escape(k)}</td><td>{v["links"]:,}</td><td>{fmt_bytes(v["bytes"])}</td>'
                    f'<td>{_pct(v["max_utilisation"])}</td><td>{_pct(v["max_peak_utilisation"])}</td></tr>'
                    for k, v in (links.get("by_kind") or {}).items())
    by_kind = ('<table style="margin-top:10px"><tr><th class="l">every link of a kind</th><th>links</th>'
               f'<th>bytes</th><th>highest mean use</th><th>highest peak use</th></tr>{kinds}</table>') if kinds else ""
    return ("<div><h2>Busiest links</h2><table><tr><th class=\"l\">link</th><th class=\"l\">kind</th>"
            "<th>bytes</th><th>usable bw</th><th>mean use</th><th>peak use</th><th></th></tr>"
            + "".join(rows) + "</table>" + by_kind + "<p class=\"note\">Mean use: bytes / (usable bandwidth × step). "
            "Peak: the busiest 1/100 of the step. Every GPU's links, collapsed as well (docs/reference.md, "
            "links). Links alike in every figure shown share a row (hover it for their names); the busiest are "
            "those of highest mean use, and each kind's highest peak is in the table under them.</p></div>")


def _alike(links: list[dict[str, Any]], key) -> list[list[dict[str, Any]]]:
    """``links`` (the busiest, in their order) in groups of the same ``key``, each where its
    first link stands: links of equal use rank by name, so two orbits' twins of one mean use
    alternate (three lines drawn on top of each other under names of their own, before)."""
    groups: dict[Any, list[dict[str, Any]]] = {}
    for u in links:
        groups.setdefault(key(u), []).append(u)
    return list(groups.values())


def _alike_name(alike: list[dict[str, Any]], busiest: list[dict[str, Any]]) -> str:
    """"leaf1.0->n32.nic0 and 9 alike": the first link of a run and how many more; "at least"
    where the run reaches the end of a full ``busiest`` (summary.json lists the
    :data:`~clustersim.analysis.links.BUSIEST` busiest: links alike past them are not there)."""
    if len(alike) < 2:
        return alike[0]["link"]
    cut = len(busiest) >= BUSIEST and alike[-1] is busiest[-1]
    return alike[0]["link"] + f" and {'at least ' if cut else ''}{len(alike) - 1} alike"


MEMORY_DIV_ID = "clustersim-memory"


def memory_figure(summary: dict[str, Any]) -> dict[str, Any] | None:
    """Memory of one GPU of each stage over the step (GiB): static state, transient bytes,
    activations alive, communication buffers and what a recomputing backward holds, against
    the GPU's capacity. A figure dict
    in validated form (as :func:`links_figure`), or None."""
    mem = summary.get("memory") or {}
    stages = [st for st in mem.get("stages", []) if st.get("timeline")]
    if not stages:
        return None
    tight = mem.get("tightest_stage", stages[0]["stage"])
    data = []
    for st in stages:
        tl = st["timeline"]
        base = st["params_bytes"] + st["grads_bytes"] + st["optimizer_bytes"] + st.get("transient_bytes", 0.0)
        rec = tl.get("recomputing_bytes") or [0.0] * len(tl["activations_bytes"])
        ys = [(base + a + b + r) / GiB for a, b, r in zip(tl["activations_bytes"], tl["comm_buffers_bytes"], rec)]
        xs = [1e3 * t for t in tl["t_s"]] + [1e3 * summary["step_time_s"]]
        data.append({
            "hovertemplate": "stage " + str(st["stage"]) + ": %{y:.1f} GiB<extra></extra>",
            "line": {"shape": "hv", "width": 2.5 if st["stage"] == tight else 1.2}, "mode": "lines",
            # (the least spare: over the capacity, the most over it)
            "name": f'stage {st["stage"]}' + ((" (tightest)" if mem.get("fits", True) else " (most over)")
                                              if st["stage"] == tight else ""),
            "x": xs, "y": ys + ys[-1:], "type": "scatter"})
    cap = mem["capacity_bytes"] / GiB
    step_ms = 1e3 * summary["step_time_s"]
    data.append({"hoverinfo": "skip", "line": {"color": "#cf222e", "dash": "dash", "width": 1.5}, "mode": "lines",
                 "name": f"capacity {cap:.0f} GiB", "x": [0, step_ms], "y": [cap, cap], "type": "scatter"})
    layout = _over_step_layout(320, step_ms, "memory per GPU (GiB)")
    # every stage at the time pointed at, in one box: their lines crowd one band of the axis
    layout["hovermode"] = "x unified"
    # the box's head is the time, with its unit (bare "718" otherwise; plotly.js 3.1 on)
    layout["xaxis"]["unifiedhovertitle"] = {"text": "%{x:,.0f} ms"}
    if len(stages) > len(layout["template"]["layout"]["colorway"]):
        # past the template's colours they would repeat (stage 10 drawn as stage 0): one each
        layout["colorway"] = plotly.colors.qualitative.Dark24 + plotly.colors.qualitative.Light24
    return {"data": data, "layout": layout}


def memory_html(summary: dict[str, Any]) -> str:
    """Memory per GPU of each pipeline stage, in GiB, against the GPU's capacity."""
    mem = summary.get("memory")
    if not mem:
        return ""
    rows = []
    for st in mem["stages"]:
        g = lambda k: f"{st[k] / GiB:.1f}"  # noqa: E731
        used = st["peak_bytes"] / st["capacity_bytes"] if st["capacity_bytes"] else 0.0
        fill = "used" if st["fits"] else "over"
        meter = f'<span class="meter"><span class="{fill}" style="width:{min(used, 1.0) * 100:.1f}%"></span></span>'
        margin = st.get("margin_bytes")
        margin_txt = "" if margin is None else (f" · {margin / GiB:.1f} GiB spare" if margin >= 0
                                                else f" by {-margin / GiB:.1f} GiB")
        tight = " tight" if st.get("tight") else ""
        verdict = (f'<span class="fits{tight}">fits{margin_txt}{" (tight)" if tight else ""}</span>' if st["fits"]
                   else f'<span class="nofit">DOES NOT FIT{margin_txt}</span>')
        inflight = st.get("inflight_microbatches")
        act_note = f" ({inflight} µb)" if inflight is not None else ""
        buffers = f'{st["comm_buffers_bytes"] / GiB:.2f}' if "comm_buffers_bytes" in st else ""
        # the verdict first after the peak: at a laptop's width the table scrolls, and what a
        # reader needs first must be in view
        rows.append(f'<tr><td>{st["stage"]}</td><td><b>{g("peak_bytes")}</b></td><td>{g("capacity_bytes")}</td>'
                    f'<td class="l">{meter} {100 * used:.0f} %</td><td class="l">{verdict}</td>'
                    f'<td>{st["params"] / 1e9:.2f} B</td><td>{g("params_bytes")}</td>'
                    f'<td>{g("grads_bytes")}</td><td>{g("optimizer_bytes")}</td>'
                    f'<td>{g("activations_bytes")}{act_note}</td><td>{buffers}</td>'
                    f'<td>{st.get("recomputing_bytes", 0.0) / GiB:.2f}</td><td>{g("transient_bytes")}</td></tr>')
    # (with several model parts a GPU, interleaved or V-shaped, a microbatch counts once per
    # part it is alive on: 39 on interleaved v4 with 16 microbatches)
    parts = any(len(st.get("parts") or ()) > 1 for st in mem["stages"])
    return ("<div><h2>Memory per GPU, by pipeline stage (GiB)</h2><table><tr><th>stage</th>"
            "<th>peak</th><th>capacity</th><th class=\"l\">peak / capacity</th><th class=\"l\"></th>"
            "<th>parameters<br>(count)</th><th>params</th><th>grads</th><th>optimizer</th>"
            + ("<th>activations<br>(µb in flight, counted per part)</th>" if parts else "<th>activations<br>(µb in flight)</th>")
            + "<th>comm<br>buffers</th><th>recomputing<br>(at the peak)</th><th>transient</th></tr>"
            + "".join(rows) + "</table>" + (
                f'<p class="note">Tight: less than {mem["tight_below_bytes"] / GiB:.1f} GiB spare, which the CUDA '
                "context, NCCL's buffers and the allocator's fragmentation, not counted here, can take.</p>"
                if mem.get("tight") else "") + _host_note(mem) + '<p class="note">GiB but for the parameters\' count (B: billions) '
            "and, beside the activations, the most microbatches (µb) whose activations a GPU of the stage holds "
            "at once" + (", a microbatch counted once per model part (chunk) of the GPU it is alive on" if parts
                         else "") + ".</p></div>")


def _host_note(mem: dict[str, Any]) -> str:
    """Under optimizer or activation offload, the host memory they take (the terminal's ``host
    memory`` line), "" without."""
    host = mem.get("host")
    if not host:
        return ""
    gpu = host["gpu_bytes"]
    verdict = (f'<span class="fits">fits · {host["margin_bytes"] / GiB:,.0f} GiB spare</span>' if host["fits"]
               else f'<span class="nofit">DOES NOT FIT by {-host["margin_bytes"] / GiB:,.1f} GiB</span>')
    return (f'<p>Host memory (offload): <b>{host["peak_bytes"] / GiB:,.1f}</b> of '
            f'{host["capacity_bytes"] / GiB:,.0f} GiB on node {host["node"]} ({gpu / GiB:,.1f} GiB a GPU: the '
            f'optimizer states and activations it offloads, not in the table) {verdict}</p>')


def stages_html(summary: dict[str, Any]) -> str:
    """Time per pipeline stage: compute, exposed communication and the bubble of one GPU,
    with the bubble split into warm-up, cool-down, dependency waits and imbalance."""
    stages = summary.get("per_stage")
    if not stages:
        return ""

    def split(st: dict) -> str:
        if "warm_up_s" not in st:
            return "<td></td>" * 4
        return "".join(f"<td>{fmt_time(x)}</td>" for x in (st["warm_up_s"], st["cool_down_s"],
                                                            st["dependency_s"]["total"], st["imbalance_s"]))

    # where a stage's simulated ranks differ (what-ifs split it), the row is its busiest GPU's: say which
    split_stages = any(st.get("ranks_simulated", 1) > 1 for st in stages)
    rows = "".join(
        f'<tr><td>{st["stage"]}</td>' + (f'<td>{st.get("gpu", "")}</td>' if split_stages else "")
        + f'<td>{fmt_time(st["compute_s"])}</td>'
        f'<td>{fmt_time(st["exposed_comm_s"]["total"])}</td><td>{fmt_time(st["bubble_s"])}</td>'
        f'<td>{_pct(st["bubble_fraction"])}</td>{split(st)}</tr>' for st in stages)
    return ("<div><h2>Time per GPU, by pipeline stage</h2><table><tr><th>stage</th>"
            + ("<th>GPU</th>" if split_stages else "") + "<th>compute</th>"
            "<th>exposed comm</th><th>bubble</th><th>bubble / step</th><th>warm-up</th><th>cool-down</th>"
            "<th>dependency</th><th>imbalance</th></tr>" + rows + "</table>"
            + ("<p class=\"note\">Where a stage's GPUs are simulated apart (what-ifs split them into classes, or "
               "every rank is simulated), its row is its busiest GPU's, the one that idles least (a straggler, "
               "say).</p>" if split_stages else "")
            + "<p class=\"note\">Bubble: compute idle with none of the GPU's own communication in flight. "
            "Warm-up: before its first backward; cool-down: after its last forward; dependency: waiting "
            "on another GPU in between; imbalance: what the busiest GPU computes longer, as far as the bubble "
            "holds it (the rest of the difference idles as exposed communication).</p></div>")


def causes_html(summary: dict[str, Any]) -> str:
    """The collectives with the most exposed time, the link that bounded each, what shared it."""
    from ..collectives.algorithms import at_nvls_share  # (the engine's rule, not imported with the page)

    causes = summary.get("exposed_comm_causes") or []
    if not causes:
        return ""
    e = html.escape
    rows = []
    for c in causes:
        bn = c.get("bottleneck")
        share = " NVLS sustains" if bn and at_nvls_share(c.get("algorithm", ""), bn["kind"]) else ""  # (its bw_Bps)
        link = f'{e(bn["link"])} ({e(bn["kind"])}, {bn["bw_Bps"] / 1e9:.0f} GB/s{share})' if bn else ""
        if c.get("alone"):
            shared = "nothing (alone on its links)"
        elif c.get("kind") == "offload":  # (timed alone, not on the network: no size, no links)
            shared = ""
        else:
            # one line each: the cell wraps (td.wrap), so the table stays within the window
            shared = "<br>".join(f'{e(plain_collective(x["collective"]))} ({fmt_time(x["overlap_s"])} together)'
                                 for x in c.get("shared_with", [])) or "nothing at that time"
        # in words, as the terminal says it, over the spans' name as the timeline and the trace show it
        named = e(plain_collective(c["collective"]))
        if named != e(c["collective"]):
            named += f'<br><span class="span-name">{e(c["collective"])}</span>'
        rows.append(f'<tr><td class="l wrap">{named}</td><td>{fmt_time(c["exposed_s"])}</td>'
                    f'<td>{fmt_time(c["comm_s"])}</td><td>{c["count_per_gpu"]:,.0f}</td>'
                    f'<td>{fmt_bytes(c["size_bytes"]) if c["size_bytes"] else ""}</td>'
                    f'<td class="l">{e(str(c.get("algorithm", "")))}</td>'
                    f'<td class="l wrap">{link}</td><td class="l wrap">{shared}</td></tr>')
    return ("<div><h2>Exposed communication by cause</h2><table><tr><th class=\"l\">collective</th>"
            "<th>exposed<br>/ GPU</th><th>on the wire<br>/ GPU</th><th>times<br>/ GPU</th><th>size<br>(largest)</th>"
            "<th class=\"l\">algorithm</th><th class=\"l wrap\">bottleneck link</th>"
            "<th class=\"l wrap\">shared with (while its most exposed instance ran)</th>"
            "</tr>" + "".join(rows) + "</table><p class=\"note\">A row stands for every span of one collective, "
            "whatever its bucket, layer or chunk number; under it in grey, its spans' name as the timeline and the "
            "trace file give it (# for the number). Bottleneck: the link whose share of the collective's "
            "traffic takes longest at that link's bandwidth. Shared with: the other collectives on that link "
            "meanwhile, and how long the two were in flight together.</p></div>")


def critical_path_html(summary: dict[str, Any]) -> str:
    """What the critical path is made of, per kind, and how often it changes GPU."""
    cp = summary.get("critical_path")
    if not cp or cp["length_s"] <= 0:
        return ""
    rows = "".join(f'<tr><td class="l">{html.escape(k)}</td><td>{fmt_time(v)}</td><td>{_pct(v / cp["length_s"])}</td></tr>'
                   for k, v in cp["by_kind_s"].items() if v > 0)
    return ("<div><h2>Critical path</h2><table><tr><th class=\"l\">on the path</th><th>time</th><th>share</th></tr>"
            + rows + f'<tr class="total"><td class="l">step</td><td>{fmt_time(cp["length_s"])}</td><td></td></tr>'
            f'</table><p class="note">{cp["tasks"]:,} tasks over {_n(cp["ranks_visited"], "rank")}, '
            f'{_n(len(cp["segments"]), "segment")}; drawn as a black line on the timeline'
            f"{_stretches_note(cp, summary)}. Communication on the path delayed the step.</p></div>")


def _stretches_note(cp: dict[str, Any], summary: dict[str, Any]) -> str:
    """How the timeline draws the path's stretches (:func:`path_pieces`), if it has any."""
    step_s = float(summary.get("step_time_s") or cp["length_s"])
    n = sum(first != last for first, last in path_pieces(cp["segments"], step_s))
    if not n:
        return ""
    return (f" ({n:,} stretch{'es' if n != 1 else ''} where it goes back and forth between a few ranks faster than "
            f"the timeline can show: a line along the row of each rank with {_pct(PATH_MAJOR)} of it or more, the "
            "hops left out)")


# what each row's stream name says (docs/architecture.md, "Streams per simulated rank")
STREAM_ROWS = ("A row's name ends in its stream: compute; tp, cp, ep and dp for those groups' collectives (dp the "
               "gradients' reductions); zero for ZeRO's parameter gathers, coloured as DP communication (they "
               "run over the DP group); pp_fwd_send and pp_bwd_send for the pipeline's sends and "
               "pp_fwd_recv and pp_bwd_recv for what a stage waits to receive; dp_replica_J for the all-reduce of "
               "DualPipe's two copies of part J; d2h, h2d and host for offload's copies and the CPU's Adam. ")


def timeline_note(trace: Trace, binned: dict[str, Any] | None = None, shown: dict[str, Any] | None = None,
                  replicas: bool = False, spans: dict[str, Any] | None = None) -> str:
    """What a row and a bar stand for; ``binned``: the timeline's ``layout.meta["binned"]``
    when it shows runs of bins, ``shown``: its ``layout.meta["shown"]`` when it draws some of
    the ranks (see :func:`timeline`); ``replicas``: each DP replica was simulated apart
    (``simulation.split_replicas``), so a rank's twins are its replica's TP and CP peers;
    ``spans``: the spans the page carries to draw one by one once zoomed in (the figure's
    ``"detail"``, clustersim.output.zoom; ``until_ms`` set where they are the step's first
    stretch alone, too many to carry all), None where it carries none."""
    weights = sorted({trace.weight.get(r, 1) for r in trace.ranks})
    who = ""
    if weights and weights != [1]:
        w = " or ".join(str(x) for x in weights) if len(weights) <= 2 else f"{weights[0]} to {weights[-1]}"
        # (which groups' peers depends on how they lie on the cluster: CP peers on other nodes,
        # or placed unlike, are ranks of their own; the summary's simulation section counts them)
        peers = ("peers in its DP replica's TP, CP and EP groups placed alike" if replicas
                 else "peers in its TP, CP, DP and EP groups placed alike on the cluster")
        who = f" Each simulated rank stands for {w} GPUs that behave alike (its {peers})."
    head = (f'<p class="note">One row per simulated rank and stream ({_n(len(trace.ranks), "rank")}, '
            f'{_n(trace.n_spans, "span")}).{who} ')
    if shown:
        kind = "ranks whose every row has the same span count, busy time and end"
        if shown["kinds"] <= shown["ranks"]:
            which = f"one rank of each kind ({kind})"
        else:
            which = (f"{shown['ranks']:,} of the {shown['kinds']:,} kinds of rank ({kind}), taken stage by stage, "
                     "those that finish last and first before the others")
            if shown["stages"] < shown["of_stages"]:
                which += f", from {shown['stages']:,} of the {shown['of_stages']:,} stages, spread over the pipeline"
        head += (f"The timeline draws {shown['ranks']:,} of the {shown['of']:,} ranks (a browser lays out more than "
                 f"{MAX_TIMELINE_RANKS:,} slowly): {which}; trace.json.gz has every rank. ")
        if shown["alike"]:
            head += (f"{shown['alike']:,} of the others are of a drawn rank's kind: where the critical path crosses "
                     "one, it is drawn on that rank's rows. ")
        if shown["kinds"] > shown["ranks"]:
            head += "The critical path's line breaks where it crosses a rank of a kind not drawn. "
    tail = STREAM_ROWS + "Drag to zoom, double-click to reset, click a legend entry to hide it.</p>"
    if spans and spans["until_ms"] is not None:
        tail = (f"The page carries the spans that start in the step's first {fmt_time(spans['until_ms'] / 1e3)} "
                f"({spans['carried']:,} of {spans['of']:,}{'' if binned else '; trace.json.gz has every span'}): "
                f"zoomed in there to {DETAIL_IN_VIEW:,} spans or fewer in view, each is drawn inside the bars, "
                f"thinner, with its name on hover. {tail}")
    elif spans:
        tail = (f"Zoomed in to {DETAIL_IN_VIEW:,} spans or fewer in view, each span is drawn inside the bars, "
                f"thinner, with its name on hover. {tail}")
    if binned:
        return (f"{head}Joined by microbatch and phase, the spans would make at least {binned['merged_bars']:,} bars, "
                f"more than a browser draws quickly ({BAR_BUDGET:,}); so each row is cut into bins of "
                f"{fmt_time(binned['bin_ms'] / 1e3)} and a bar joins adjacent bins where the same work is "
                "busiest, in its colour. Hover for the mix, the microbatches and the busy time (lighter = less "
                "busy); trace.json.gz, opened in Perfetto, has every span. " + tail)
    return (f"{head}A bar joins consecutive spans of one microbatch and phase on its stream; hover for how many "
            "and the busy time inside (lighter = less busy). " + tail)


def gpus_html(trace: Trace, shown: dict[str, Any] | None = None) -> str:
    """Which GPUs each simulated rank stands for, folded under the timeline's note, with a box
    that names the rank of any GPU typed in (the spans of a GPU are its rank's: summary.json's
    ``simulation.simulated_rank_of_gpu``). Empty when every rank is simulated or the map is
    not known. ``shown``: the timeline's ``layout.meta["shown"]`` where it draws a choice of
    the ranks (a rank not drawn may be of a drawn one's kind)."""
    gpus_of = trace.gpus_of()
    if not gpus_of or all(len(g) <= 1 for g in gpus_of.values()):
        return ""
    world = len(trace.rep)
    rows = "".join(f'<tr><td>{r}</td><td>{trace.stage_of.get(r, 0)}</td><td>{len(g):,}</td>'
                   f'<td class="wide l">{html.escape(gpu_ranges(g, REPORT_GPUS_CHARS))}</td></tr>'
                   for r, g in gpus_of.items())
    stage = {r: trace.stage_of.get(r, 0) for r in trace.ranks}
    # where a GPU's rows are: its rank's if drawn, else those of the drawn rank of its kind
    where = ({str(r): r for r in shown.get("drawn", [])} | {k: int(v) for k, v in shown.get("alias", {}).items()}
             if shown else {str(r): r for r in trace.ranks})
    script = (f"<script>(function(){{const rep={json.dumps(list(trace.rep), separators=(',', ':'))},"
              f"stage={json.dumps({str(k): v for k, v in stage.items()}, separators=(',', ':'))},"
              f"drawn={json.dumps(where, separators=(',', ':'))};"
              "const box=document.getElementById('gpu-find'),out=document.getElementById('gpu-found');"
              "box.addEventListener('input',function(){const t=box.value.trim();"
              "if(t===''){out.textContent='';return;}"
              "if(!/^[0-9]+$/.test(t)||Number(t)>=rep.length){out.textContent='no GPU '+t+' here (0-'+(rep.length-1)+')';return;}"
              "const g=Number(t),r=rep[g],d=drawn[r];"
              "out.textContent='GPU '+g+' runs as rank '+r+' (stage '+stage[r]+'): '+(d===r?'its rows are that rank\u2019s'"
              ":d!==undefined?'that rank is not drawn below; rank '+d+', drawn, behaves as it does'"
              ":'that rank is not drawn below, nor one that behaves as it does (trace.json.gz has it)')+'.';});"
              "})();</script>")
    return (f'<details class="gpus"><summary>Which GPUs each simulated rank stands for</summary>'
            f'<p class="note">In this run a GPU\'s spans are those of the rank that stands for it (<code>--all-ranks</code> '
            f'simulates each GPU on its own, docs/getting-started.md says how far apart they can be). GPU '
            f'<input id="gpu-find" type="number" min="0" max="{world - 1}" placeholder="0-{world - 1}"> '
            f'<span id="gpu-found"></span></p>'
            f"<table><tr><th>rank</th><th>stage</th><th>GPUs</th><th class=\"wide l\">which</th></tr>{rows}</table>"
            f"</details>{script}")


def _timeline_meta(fig: go.Figure | dict[str, Any], key: str) -> dict[str, Any] | None:
    """The timeline's ``layout.meta[key]``: "binned" (None when it shows merged bars) or
    "shown" (None when it draws every rank)."""
    meta = fig["layout"].get("meta") if isinstance(fig, dict) else fig.layout.meta
    return meta.get(key) if isinstance(meta, dict) else None


def report_html(trace: Trace, summary: dict[str, Any], fig: go.Figure | dict[str, Any],
                data_json: str | None = None, files: Files = ()) -> str:
    """The complete page; plotly.js is inlined so the file works offline. ``fig``: the
    timeline, as :func:`build_figure` makes it or as plotly sends it (``Figure.to_dict()``),
    which is taken as it is; ``data_json``: its data, written beforehand (see :func:`plot_div`);
    ``files``: the files beside the page its header links (:func:`files_html`)."""
    d = fig if isinstance(fig, dict) else fig.to_dict()
    data = script_json(d.get("data", [])) if data_json is None else data_json
    return "".join(plotlyjs_script() if part is _PLOTLYJS else data if part is _DATA else part
                   for part in _page_parts(trace, summary, d, files))


# where the page's two large parts go in :func:`_page_parts`: plotly.js and the timeline's data
_PLOTLYJS, _DATA = object(), object()
TIMELINE_CONFIG = {"displaylogo": False, "responsive": True,
                   "toImageButtonOptions": {"filename": "clustersim-timeline", "scale": 2}}


def plotlyjs_script() -> str:
    """plotly.js in a <script>, once per page, before every plot."""
    from plotly.offline import get_plotlyjs

    return f'<script type="text/javascript">{get_plotlyjs()}</script>'


# where plotly keeps plotly.js: ``plotly.offline.get_plotlyjs`` reads and decodes this file
PLOTLYJS_DATA = ("plotly", "package_data/plotly.min.js")


def _plotlyjs_bytes() -> bytes:
    """:func:`plotlyjs_script`, UTF-8 encoded, from the file's own bytes: its 4.8 MB are not
    decoded and encoded again (0.01-0.02 s of the 0.13-0.15 s the report takes before the
    summary on moe_1024gpu). Where plotly no longer keeps the file there, the script, encoded."""
    try:
        js = pkgutil.get_data(*PLOTLYJS_DATA)
    except OSError:
        js = None
    if js is None:
        return plotlyjs_script().encode("utf-8")
    return b'<script type="text/javascript">' + js + b"</script>"


def _page_parts(trace: Trace, summary: dict[str, Any], d: dict[str, Any], files: Files = ()) -> list:
    """The page's text in order, with ``_PLOTLYJS`` and ``_DATA`` where plotly.js and the
    timeline's data go (timeline figure dict ``d``): :func:`report_html` joins them as text,
    :func:`prepare_report` as UTF-8 bytes written before the summary came."""
    before, after = plot_div_around_data(d, DIV_ID, TIMELINE_CONFIG)
    # the spans one by one: beside the figure where timeline() made it, else (a plotly
    # figure, which holds only its own keys) made here
    detail = d["detail"] if "detail" in d else _detail(trace)
    title = html.escape(f"clustersim · {summary.get('scenario', 'scenario')}")
    links_plot = _embedded(links_figure(summary), LINKS_DIV_ID, "Use of bandwidth over the step, per 1/100 of "
                           f"it, for the busiest links: {LINKS_SHOWN} lines at most, one for links whose use is "
                           "the same.")
    memory_plot = _embedded(memory_figure(summary), MEMORY_DIV_ID, "One GPU of each stage over the step (where "
                            "stragglers or faults split a stage, the one with the highest peak): parameters, "
                            "gradients, optimizer state and transient bytes, plus the activations alive (under a "
                            "split backward, what the weight gradients read from B to W), communication "
                            "buffers and what a recomputing backward holds at each instant.")
    body = "\n".join([
        header_html(summary) + files_html(files), cards_html(summary), breakdown_html(summary),
        f'<div class="panels">{comm_html(summary)}{critical_path_html(summary)}</div>',
        causes_html(summary), stages_html(summary),
        memory_html(summary), memory_plot, links_html(summary), links_plot,
        "<h2>Timeline</h2>", timeline_note(trace, _timeline_meta(d, "binned"), _timeline_meta(d, "shown"),
                                        bool(summary.get("simulation", {}).get("split_replicas")),
                                        detail),
        gpus_html(trace, _timeline_meta(d, "shown")), before,
    ])
    if detail is not None:
        after += "\n" + detail_script(DIV_ID, detail, GROUP_COLOURS)
    head = (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{title}</title>\n<style>{REPORT_CSS}</style>\n</head>\n<body>\n")
    return [head, _PLOTLYJS, "\n" + body, _DATA, after + "\n</body>\n</html>\n"]


def prepare_report(trace: Trace, files: Files = ()) -> Callable[[dict[str, Any]], bytes]:
    """Make the timeline's bars now, from the trace alone; the function returned takes the
    summary and gives the whole page, UTF-8 encoded (clustersim.output.background makes the
    bars while the summary is worked out). ``files``: as :func:`report_html`'s."""
    bars, figure = _timeline_parts(trace)
    # the bars' JSON, most of the page's, needs no summary: written (and encoded, as is
    # plotly.js) now too. A JSON list is its items' JSON joined by commas, so the page's
    # bytes are those of dumping it whole
    bars_json = "[" + ",".join(script_json(_sent_trace(t)) for t in bars)
    bars_bytes, plotlyjs = bars_json.encode("utf-8"), _plotlyjs_bytes()

    def page(summary: dict[str, Any]) -> bytes:
        fig = figure(summary)
        rest = [script_json(_sent_trace(t)) for t in fig["data"][len(bars):]]  # the critical path
        data = bars_bytes + (("," if bars and rest else "") + ",".join(rest) + "]").encode("utf-8")
        return b"".join(plotlyjs if part is _PLOTLYJS else data if part is _DATA else part.encode("utf-8")
                        for part in _page_parts(trace, summary, fig, files))
    return page


def write_report(path: str | Path, trace: Trace, summary: dict[str, Any], files: Files = ()) -> None:
    """Write ``report.html``: header, summary panels and the Gantt timeline, self-contained
    (``files``: as :func:`report_html`'s)."""
    Path(path).write_bytes(prepare_report(trace, files)(summary))
