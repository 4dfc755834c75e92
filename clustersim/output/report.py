"""HTML report: summary panels and a Gantt timeline of one simulated step, in one offline file.

Layout of ``report.html``::

    clustersim · <scenario>                         description, cluster, plan, model
    ┌ step time ┐┌ tokens/s ┐┌ TFLOP/s/GPU ┐┌ MFU ┐┌ HFU ┐┌ bubble ┐┌ memory ┐
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
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import plotly.graph_objects as go

from ..trace import Span, Trace
from .perfetto import streams_by_rank
from .summary import plan_dims

GiB = 1024**3
MiB = 1024**2
DIV_ID = "clustersim-timeline"
ROW_HEIGHT_PX = 15
BAR_WIDTH_ROWS = 0.8  # bar thickness as a fraction of a row
MAX_GAP_FRACTION = 0.002  # of the step: about a pixel of the full-width timeline

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
    ("other", "other", "#bab0ac"),
)
_GROUP_KEYS = tuple(g for g, _, _ in GROUPS)


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


def _bar(run: list[Span], busy_s: float) -> Bar:
    first, last = run[0], run[-1]
    layers = [s.layer for s in run if s.layer >= 0]
    return Bar(
        rank=first.rank, stream=first.stream, kind=first.kind, phase=first.phase, mb=first.mb,
        start_s=first.start_s, end_s=max(s.end_s for s in run), busy_s=busy_s, n_spans=len(run),
        first_name=first.name, last_name=last.name,
        layer_lo=min(layers, default=-1), layer_hi=max(layers, default=-1),
        size_bytes=sum(s.size_bytes for s in run), flops=sum(s.flops for s in run),
    )


def merge_stream(spans: list[Span], max_gap_s: float = float("inf")) -> list[Bar]:
    """Merge the spans of one (rank, stream), sorted by start, into bars.

    Roughly::

        for each span: same (kind, phase, mb) as the open bar and idle gap <= max_gap_s
                       -> extend it, else start a new one
        busy = length of the union of the spans inside the bar
    """
    bars: list[Bar] = []
    run: list[Span] = []
    busy_s = covered_to = 0.0
    for s in spans:
        if run and ((s.kind, s.phase, s.mb) != (run[0].kind, run[0].phase, run[0].mb)
                    or s.start_s - covered_to > max_gap_s):
            bars.append(_bar(run, busy_s))
            run = []
        if not run:
            busy_s, covered_to = 0.0, s.start_s
        # spans of one stream should not overlap; count any overlap once all the same
        busy_s += max(0.0, s.end_s - max(s.start_s, covered_to))
        covered_to = max(covered_to, s.end_s)
        run.append(s)
    if run:
        bars.append(_bar(run, busy_s))
    return bars


def merge_spans(trace: Trace, max_gap_s: float | None = None) -> dict[tuple[int, str], list[Bar]]:
    """Bars per (rank, stream), keyed and ordered as the timeline's rows.

    ``max_gap_s`` defaults to MAX_GAP_FRACTION of the step: a gap that would show at full
    view splits a bar, one that would not is kept inside it (and counted as not busy).
    """
    if max_gap_s is None:
        max_gap_s = MAX_GAP_FRACTION * trace.end_s
    by_row: dict[tuple[int, str], list[Span]] = {}
    for s in trace.spans:
        by_row.setdefault((s.rank, s.stream), []).append(s)
    rows = [(r, st) for r, sts in streams_by_rank(trace).items() for st in sts]
    return {row: merge_stream(sorted(by_row[row], key=lambda s: (s.start_s, s.end_s)), max_gap_s)
            for row in rows}


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
        return f"{n / GiB:.2f} GiB"
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n:.0f} B"


def fmt_time(t_s: float) -> str:
    """Seconds above one second, milliseconds below (three significant digits)."""
    if abs(t_s) >= 1.0:
        return f"{t_s:.3g} s"
    if abs(t_s) >= 1e-3 or t_s == 0:
        return f"{t_s * 1e3:.3g} ms"
    return f"{t_s * 1e6:.3g} µs"


def bar_hover(b: Bar, row_label: str) -> str:
    """Hover text: names, microbatch and layers, times in ms, busy share, bytes and FLOPs."""
    name = html.escape(b.first_name)
    if b.n_spans > 1:
        tail = "" if b.last_name == b.first_name else f" … {html.escape(b.last_name)}"
        name = f"{name}{tail} ({b.n_spans} spans)"
    where = [html.escape(row_label)]
    if b.mb >= 0:
        where.append(f"microbatch {b.mb}")
    if b.layer_lo >= 0:
        where.append(f"layer {b.layer_lo}" if b.layer_lo == b.layer_hi else f"layers {b.layer_lo}–{b.layer_hi}")
    lines = [f"<b>{name}</b>", " · ".join(where),
             f"start {b.start_s * 1e3:.3f} ms · duration {b.dur_s * 1e3:.3f} ms"]
    if b.n_spans > 1:
        share = b.busy_s / b.dur_s if b.dur_s > 0 else 1.0
        lines.append(f"busy {b.busy_s * 1e3:.3f} ms ({100 * share:.0f} % of the bar)")
    extra = []
    if b.size_bytes:
        extra.append(fmt_bytes(b.size_bytes))
    if b.flops:
        extra.append(f"{b.flops / 1e12:.3g} TFLOP")
    if extra:
        lines.append(" · ".join(extra))
    return "<br>".join(lines)


# A merged bar is only partly busy; fading it keeps a sparse run of collectives from reading
# as a solid block. Three fixed levels (one plotly trace each) instead of a per-bar opacity
# array, which makes the browser restyle every bar one by one and doubles the draw time.
FADE_LEVELS = ((0.75, 1.0), (0.4, 0.6), (0.0, 0.3))  # (busy share at least, opacity)


def fade_level(b: Bar) -> int:
    """Index into FADE_LEVELS for the bar's busy share."""
    share = b.busy_s / b.dur_s if b.dur_s > 0 else 1.0
    return next(i for i, (lo, _) in enumerate(FADE_LEVELS) if share >= lo)


def _group_traces(key: str, label: str, colour: str, bars: list[tuple[int, Bar, str]]) -> list[go.Bar]:
    """One legend entry: horizontal bars from ``base`` (start) over ``x`` (duration), in ms.

    The most opaque level present carries the legend entry (plotly shows none for an empty
    trace); the others join its legend group, so a click on the entry hides them all.
    """
    out = []
    for level, (_, opacity) in enumerate(FADE_LEVELS):
        part = [t for t in bars if fade_level(t[1]) == level]
        if not part:
            continue
        out.append(go.Bar(
            name=label, legendgroup=key, showlegend=not out, orientation="h",
            y=np.array([row for row, _, _ in part], dtype=np.int32),
            base=np.round(np.array([b.start_s for _, b, _ in part], dtype=float) * 1e3, 6),
            x=np.round(np.array([b.dur_s for _, b, _ in part], dtype=float) * 1e3, 6),
            width=BAR_WIDTH_ROWS, marker={"color": colour, "opacity": opacity, "line": {"width": 0}},
            hovertext=[h for _, _, h in part], hoverinfo="text",
        ))
    return out


def build_figure(trace: Trace, summary: dict[str, Any]) -> go.Figure:
    """The Gantt timeline: one row per (simulated rank, stream), rows grouped by rank.

    Bars are merged spans (see :func:`merge_stream`); one plotly trace per legend group.
    """
    merged = merge_spans(trace)
    rows = list(merged)
    labels = row_labels(trace, rows)
    by_group: dict[str, list[tuple[int, Bar, str]]] = {k: [] for k in _GROUP_KEYS}
    for i, row in enumerate(rows):
        for b in merged[row]:
            by_group[bar_group(b.kind, b.phase)].append((i, b, bar_hover(b, labels[i])))
    fig = go.Figure([tr for k, label, colour in GROUPS if by_group[k]
                     for tr in _group_traces(k, label, colour, by_group[k])])
    path = path_trace(summary, rows)
    if path is not None:
        fig.add_trace(path)
    step_ms = 1e3 * float(summary.get("step_time_s") or trace.end_s)
    fig.update_layout(_layout(len(rows), labels, step_ms, _rank_bands(rows)))
    return fig


def path_trace(summary: dict[str, Any], rows: list[tuple[int, str]]) -> go.Scatter | None:
    """The critical path as a line over the timeline: along a rank's compute row while the
    path stays on that rank, down or up to the next rank where it crosses over."""
    segments = (summary.get("critical_path") or {}).get("segments") or []
    row_of: dict[int, int] = {}
    for i, (rank, stream) in enumerate(rows):
        if stream == "compute" or rank not in row_of:
            row_of[rank] = i if stream == "compute" else row_of.get(rank, i)
    xs: list[float | None] = []
    ys: list[float | None] = []
    text: list[str] = []
    for seg in segments:
        y = row_of.get(seg["rank"])
        if y is None:
            continue
        hover = (f"critical path on rank {seg['rank']} (stage {seg['stage']})<br>{fmt_time(seg['start_s'])} → "
                 f"{fmt_time(seg['end_s'])}: {seg['tasks']:,} tasks, compute {fmt_time(seg['compute_s'])}, "
                 f"communication {fmt_time(seg['comm_s'])}<br>from {html.escape(seg['first'])} to "
                 f"{html.escape(seg['last'])}")
        xs += [1e3 * seg["start_s"], 1e3 * seg["end_s"]]
        ys += [y, y]
        text += [hover, hover]
    if not xs:
        return None
    return go.Scatter(x=xs, y=ys, mode="lines", name="critical path", line={"color": "#111111", "width": 2},
                      hovertext=text, hovertemplate="%{hovertext}<extra></extra>", legendgroup="path")


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


# Tick labels with as many decimals as the tick spacing needs (2,000 at full view, 1,000.2
# when zoomed to a millisecond), never an exponent.
_MS_TICK_FORMATS = [
    {"dtickrange": [None, 0.01], "value": ",.3f"},
    {"dtickrange": [0.01, 0.1], "value": ",.2f"},
    {"dtickrange": [0.1, 1], "value": ",.1f"},
    {"dtickrange": [1, None], "value": ",.0f"},
]


def _layout(n_rows: int, labels: list[str], step_ms: float, bands: list[dict]) -> dict:
    return {
        "template": "plotly_white",
        "barmode": "overlay",
        "height": 140 + ROW_HEIGHT_PX * max(n_rows, 4),
        "margin": {"l": 10, "r": 20, "t": 100, "b": 30},
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
                  "showline": True, "linecolor": "#9aa3ad"},
        "yaxis": {"tickmode": "array", "tickvals": list(range(n_rows)), "ticktext": labels,
                  "range": [n_rows - 0.5, -0.5], "showgrid": False, "zeroline": False,
                  "automargin": True, "tickfont": {"size": 11}},
        "shapes": bands,
        "uirevision": "timeline",
    }


# --------------------------------------------------------------------------- HTML panels

_CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif;
       margin: 24px 32px; color: #1f2328; background: #fff; line-height: 1.4; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid #d0d7de; padding-bottom: 4px; }
p.desc { margin: 0 0 6px; font-size: 15px; }
p.meta, p.note { margin: 2px 0; color: #57606a; font-size: 13px; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; margin-top: 18px; }
.card { border: 1px solid #d0d7de; border-radius: 8px; padding: 10px 16px; min-width: 130px; }
.card .label { font-size: 12px; color: #57606a; text-transform: uppercase; letter-spacing: .04em; }
.card .value { font-size: 24px; font-weight: 600; font-variant-numeric: tabular-nums; }
.card .sub { font-size: 12px; color: #57606a; }
.panels { display: flex; flex-wrap: wrap; gap: 32px; align-items: flex-start; }
table { border-collapse: collapse; font-size: 13px; font-variant-numeric: tabular-nums; }
th, td { padding: 3px 10px; text-align: right; border-bottom: 1px solid #eaeef2; white-space: nowrap; }
th { background: #f6f8fa; font-weight: 600; border-bottom: 1px solid #d0d7de; }
td.l, th.l { text-align: left; }
tr.total td { font-weight: 600; border-top: 1px solid #d0d7de; }
.meter { display: inline-block; width: 160px; height: 10px; background: #eaeef2; border-radius: 3px;
         overflow: hidden; vertical-align: middle; }
.meter span { display: inline-block; height: 100%; vertical-align: top; }
.hidden { background: #8cc084; } .exposed { background: #e15759; }
.used { background: #4e79a7; } .over { background: #e15759; }
.fits { color: #1a7f37; font-weight: 600; } .nofit { color: #cf222e; font-weight: 700; }
.legend-key { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin: 0 4px 0 10px; }
"""


def _card(label: str, value: str, sub: str = "", cls: str = "") -> str:
    sub_html = f'<div class="sub">{sub}</div>' if sub else ""
    return (f'<div class="card"><div class="label">{label}</div>'
            f'<div class="value {cls}">{value}</div>{sub_html}</div>')


def _n(count: int, noun: str) -> str:
    """'1 node', '8 nodes'."""
    return f"{count:,} {noun}" if count == 1 else f"{count:,} {noun}s"


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def header_html(summary: dict[str, Any]) -> str:
    """Title, description and one line each on cluster, plan and model."""
    e = html.escape
    name = e(str(summary.get("scenario", "scenario")))
    out = [f"<h1>clustersim · {name}</h1>"]
    if summary.get("description"):
        out.append(f'<p class="desc">{e(str(summary["description"]))}</p>')
    hw, plan, model = summary.get("hardware", {}), summary.get("plan", {}), summary.get("model", {})
    if hw:
        out.append(f'<p class="meta">cluster: {summary.get("world_size", "?")} × {e(str(hw.get("gpu", "?")))} '
                   f'({_n(hw.get("nodes") or 0, "node")} × {hw.get("gpus_per_node", "?")}, '
                   f'{e(str(hw.get("topology", "")))})</p>')
    if plan:
        out.append(f'<p class="meta">plan: {e(plan_dims(plan, " × "))} · '
                   f'{e(str(plan.get("schedule", "")))} · {plan.get("microbatches")} microbatches × '
                   f'{plan.get("micro_batch_size")} × {model.get("seq_len", "?")} tokens · '
                   f'{e(str(plan.get("precision", "")))} · {e(str(plan.get("attention", "")))} attention</p>')
    if model:
        params = model.get("params")
        size = f"{params / 1e9:.1f} B parameters, " if params else ""
        out.append(f'<p class="meta">model: {e(str(model.get("name", "")))} · {size}'
                   f'{model.get("layers", "?")} layers</p>')
    return "\n".join(out)


def cards_html(summary: dict[str, Any]) -> str:
    """The headline numbers, one card each."""
    s = summary
    peak = s.get("hardware", {}).get("peak_flops")
    tflops_sub = f'{s["hw_tflops_per_gpu"]:.1f} hardware' if "hw_tflops_per_gpu" in s else ""
    if peak:
        tflops_sub += f" · peak {peak / 1e12:.0f}"
    cards = [
        _card("step time", f'{s["step_time_s"]:.4g} s'),
        _card("tokens / s", f'{s["tokens_per_s"]:,.0f}',
              f'{s["tokens_per_s_per_gpu"]:,.1f} per GPU' if "tokens_per_s_per_gpu" in s else ""),
        _card("TFLOP/s per GPU", f'{s["tflops_per_gpu"]:.1f}', tflops_sub),
        _card("MFU", _pct(s["mfu"]), "model FLOPs / peak"),
        _card("HFU", _pct(s["hfu"]), "executed FLOPs / peak"),
        _card("pipeline bubble", _pct(s["bubble_fraction"]), "of the step, GPU mean"),
    ]
    exposed = s.get("exposed_comm_s", {}).get("total")
    if exposed is not None:
        share = exposed / s["step_time_s"] if s["step_time_s"] else 0.0
        cards.append(_card("exposed comm", fmt_time(exposed), f"{_pct(share)} of the step"))
    mem = s.get("memory")
    if mem:
        ok = mem["fits"]
        cards.append(_card("peak memory", f'{mem["peak_bytes"] / GiB:.1f} GiB',
                           f'of {mem["capacity_bytes"] / GiB:.0f} GiB · ' + ("fits" if ok else "DOES NOT FIT"),
                           "" if ok else "nofit"))
    pj = s.get("projection")
    if pj:
        cost = f' · ${pj["cost_usd"]:,.0f}' if pj.get("cost_usd") is not None else ""
        cards.append(_card(f'run of {pj["tokens"] / 1e12:g}T tokens', f'{pj["days"]:,.1f} days',
                           f'{pj["gpu_hours"]:,.0f} GPU-hours{cost}'))
    return f'<div class="cards">{"".join(cards)}</div>'


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
    """Layout of a small line chart over the step (link use, memory): time in ms along x."""
    return {"height": height_px, "margin": {"l": 60, "r": 20, "t": 10, "b": 40}, "template": "plotly_white",
            "xaxis": {"title": "time (ms)", "range": [0, step_ms]},
            "yaxis": {"title": y_title, "rangemode": "tozero"},
            "legend": {"orientation": "h", "y": -0.25}}


def _embedded(fig: go.Figure | None, div_id: str, note: str) -> str:
    """A small chart with its note, for a page that has loaded plotly.js once; "" without one."""
    if fig is None:
        return ""
    return (f'<p class="note">{note}</p>'
            + fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id,
                          config={"displaylogo": False, "responsive": True}))


LINKS_DIV_ID = "clustersim-links"
LINKS_SHOWN = 5


def links_figure(summary: dict[str, Any]) -> go.Figure | None:
    """Utilisation over the step of the busiest links (lines, one per link), or None."""
    busiest = [u for u in (summary.get("links") or {}).get("busiest", []) if u.get("utilisation_over_time")]
    if not busiest:
        return None
    step_ms = 1e3 * float(summary.get("step_time_s") or 0.0)
    fig = go.Figure()
    for u in busiest[:LINKS_SHOWN]:
        series = u["utilisation_over_time"]
        width = step_ms / len(series)
        fig.add_trace(go.Scatter(
            x=[width * (i + 0.5) for i in range(len(series))], y=[100 * x for x in series], mode="lines",
            name=f'{u["link"]} ({u["kind"]})', line={"shape": "hv", "width": 1.5},
            hovertemplate="%{y:.0f} % at %{x:.0f} ms<extra>" + html.escape(u["link"]) + "</extra>"))
    fig.update_layout(_over_step_layout(300, step_ms, "use of bandwidth (%)"))
    return fig


def links_html(summary: dict[str, Any]) -> str:
    """The busiest links of the step: bytes, mean and peak utilisation of usable bandwidth."""
    links = summary.get("links") or {}
    busiest = links.get("busiest") or []
    if not busiest:
        return ""
    rows = []
    for u in busiest:
        meter = (f'<span class="meter"><span class="exposed" style="width:{100 * min(u["utilisation"], 1):.1f}%">'
                 f'</span></span>')
        rows.append(f'<tr><td class="l">{html.escape(u["link"])}</td><td class="l">{html.escape(u["kind"])}</td>'
                    f'<td>{fmt_bytes(u["bytes"])}</td><td>{u["bw_Bps"] / 1e9:.0f} GB/s</td>'
                    f'<td>{_pct(u["utilisation"])}</td><td>{_pct(u["peak_utilisation"])}</td>'
                    f'<td class="l">{meter}</td></tr>')
    return ("<div><h2>Busiest links</h2><table><tr><th class=\"l\">link</th><th class=\"l\">kind</th>"
            "<th>bytes</th><th>usable bw</th><th>mean use</th><th>peak use</th><th></th></tr>"
            + "".join(rows) + "</table><p class=\"note\">Mean use: bytes / (usable bandwidth × step). "
            "Peak: the busiest 1/100 of the step. Links of the simulated ranks; their twins' links carry "
            "the same.</p></div>")


MEMORY_DIV_ID = "clustersim-memory"


def memory_figure(summary: dict[str, Any]) -> go.Figure | None:
    """Memory of one GPU of each stage over the step (GiB): static state, transient bytes,
    activations alive and communication buffers, against the GPU's capacity."""
    mem = summary.get("memory") or {}
    stages = [st for st in mem.get("stages", []) if st.get("timeline")]
    if not stages:
        return None
    tight = mem.get("tightest_stage", stages[0]["stage"])
    fig = go.Figure()
    for st in stages:
        tl = st["timeline"]
        base = st["params_bytes"] + st["grads_bytes"] + st["optimizer_bytes"] + st.get("transient_bytes", 0.0)
        ys = [(base + a + b) / GiB for a, b in zip(tl["activations_bytes"], tl["comm_buffers_bytes"])]
        xs = [1e3 * t for t in tl["t_s"]] + [1e3 * summary["step_time_s"]]
        fig.add_trace(go.Scatter(
            x=xs, y=ys + ys[-1:], mode="lines", name=f'stage {st["stage"]}' + (" (tightest)" if st["stage"] == tight else ""),
            line={"shape": "hv", "width": 2.5 if st["stage"] == tight else 1.2},
            hovertemplate="%{y:.1f} GiB at %{x:,.0f} ms<extra>stage " + str(st["stage"]) + "</extra>"))
    cap = mem["capacity_bytes"] / GiB
    step_ms = 1e3 * summary["step_time_s"]
    fig.add_trace(go.Scatter(x=[0, step_ms], y=[cap, cap], mode="lines", name=f"capacity {cap:.0f} GiB",
                             line={"dash": "dash", "color": "#cf222e", "width": 1.5}, hoverinfo="skip"))
    fig.update_layout(_over_step_layout(320, step_ms, "memory per GPU (GiB)"))
    return fig


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
        verdict = (f'<span class="fits">fits{margin_txt}</span>' if st["fits"]
                   else f'<span class="nofit">DOES NOT FIT{margin_txt}</span>')
        inflight = st.get("inflight_microbatches")
        act_note = f" ({inflight} mb)" if inflight is not None else ""
        buffers = f'{st["comm_buffers_bytes"] / GiB:.2f}' if "comm_buffers_bytes" in st else ""
        rows.append(f'<tr><td>{st["stage"]}</td><td>{st["params"] / 1e9:.2f} B</td><td>{g("params_bytes")}</td>'
                    f'<td>{g("grads_bytes")}</td><td>{g("optimizer_bytes")}</td>'
                    f'<td>{g("activations_bytes")}{act_note}</td><td>{buffers}</td><td>{g("transient_bytes")}</td>'
                    f'<td><b>{g("peak_bytes")}</b></td>'
                    f'<td>{g("capacity_bytes")}</td><td class="l">{meter} {100 * used:.0f} %</td>'
                    f'<td class="l">{verdict}</td></tr>')
    return ("<div><h2>Memory per GPU, by pipeline stage (GiB)</h2><table><tr><th>stage</th>"
            "<th>parameters</th><th>params</th><th>grads</th><th>optimizer</th><th>activations (in flight)</th>"
            "<th>comm buffers</th><th>transient</th><th>peak</th><th>capacity</th><th class=\"l\">peak / capacity</th><th class=\"l\"></th></tr>"
            + "".join(rows) + "</table></div>")


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

    rows = "".join(
        f'<tr><td>{st["stage"]}</td><td>{fmt_time(st["compute_s"])}</td>'
        f'<td>{fmt_time(st["exposed_comm_s"]["total"])}</td><td>{fmt_time(st["bubble_s"])}</td>'
        f'<td>{_pct(st["bubble_fraction"])}</td>{split(st)}</tr>' for st in stages)
    return ("<div><h2>Time per GPU, by pipeline stage</h2><table><tr><th>stage</th><th>compute</th>"
            "<th>exposed comm</th><th>bubble</th><th>bubble / step</th><th>warm-up</th><th>cool-down</th>"
            "<th>dependency</th><th>imbalance</th></tr>" + rows + "</table>"
            "<p class=\"note\">Bubble: compute idle with none of the GPU's own communication in flight. "
            "Warm-up: before its first backward; cool-down: after its last forward; dependency: waiting "
            "on another GPU in between; imbalance: what the busiest GPU computes longer.</p></div>")


def causes_html(summary: dict[str, Any]) -> str:
    """The collectives with the most exposed time, the link that bounded each, what shared it."""
    causes = summary.get("exposed_comm_causes") or []
    if not causes:
        return ""
    e = html.escape
    rows = []
    for c in causes:
        bn = c.get("bottleneck")
        link = f'{e(bn["link"])} ({e(bn["kind"])}, {bn["bw_Bps"] / 1e9:.0f} GB/s)' if bn else ""
        if c.get("alone"):
            shared = "nothing (alone on its links)"
        else:
            shared = ", ".join(f'{e(x["collective"])} {fmt_time(x["overlap_s"])}'
                               for x in c.get("shared_with", [])) or "nothing at that time"
        rows.append(f'<tr><td class="l">{e(c["collective"])}</td><td>{fmt_time(c["exposed_s"])}</td>'
                    f'<td>{fmt_time(c["comm_s"])}</td><td>{c["count_per_gpu"]:,.0f}</td>'
                    f'<td>{fmt_bytes(c["size_bytes"])}</td><td class="l">{e(str(c.get("algorithm", "")))}</td>'
                    f'<td class="l">{link}</td><td class="l">{shared}</td></tr>')
    return ("<div><h2>Exposed communication by cause</h2><table><tr><th class=\"l\">collective</th>"
            "<th>exposed / GPU</th><th>on the wire / GPU</th><th>per GPU</th><th>size</th><th class=\"l\">algorithm</th>"
            "<th class=\"l\">bottleneck link</th><th class=\"l\">shared with (while its most exposed instance ran)</th>"
            "</tr>" + "".join(rows) + "</table><p class=\"note\">Bottleneck: the link whose share of the "
            "collective's traffic takes longest at that link's bandwidth.</p></div>")


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
            f'{_n(len(cp["segments"]), "segment")}; drawn as a black line on the timeline. Communication on '
            "the path delayed the step.</p></div>")


def timeline_note(trace: Trace) -> str:
    """What a row and a bar stand for."""
    weights = sorted({trace.weight.get(r, 1) for r in trace.ranks})
    who = ""
    if weights and weights != [1]:
        w = " or ".join(str(x) for x in weights)
        who = f" Each simulated rank stands for {w} GPUs that behave alike (its TP, CP and DP peers)."
    return (f'<p class="note">One row per simulated rank and stream ({_n(len(trace.ranks), "rank")}, '
            f'{_n(len(trace.spans), "span")}).{who} A bar joins consecutive spans of one microbatch and phase on '
            "its stream; hover for how many and the busy time inside (lighter = less busy). "
            "Drag to zoom, double-click to reset, click a legend entry to hide it.</p>")


def report_html(trace: Trace, summary: dict[str, Any], fig: go.Figure) -> str:
    """The complete page; plotly.js is inlined so the file works offline."""
    from plotly.offline import get_plotlyjs

    plotlyjs = f'<script type="text/javascript">{get_plotlyjs()}</script>'  # once, before every plot
    plot = fig.to_html(
        full_html=False, include_plotlyjs=False, div_id=DIV_ID,
        config={"displaylogo": False, "responsive": True,
                "toImageButtonOptions": {"filename": "clustersim-timeline", "scale": 2}},
    )
    title = html.escape(f"clustersim · {summary.get('scenario', 'scenario')}")
    links_plot = _embedded(links_figure(summary), LINKS_DIV_ID, "Use of bandwidth over the step, per 1/100 of "
                           f"it, for the {LINKS_SHOWN} busiest links.")
    memory_plot = _embedded(memory_figure(summary), MEMORY_DIV_ID, "One GPU of each stage over the step: "
                            "parameters, gradients, optimizer state and transient bytes, plus the activations "
                            "alive and communication buffers held at each instant.")
    body = "\n".join([
        plotlyjs, header_html(summary), cards_html(summary),
        f'<div class="panels">{comm_html(summary)}{critical_path_html(summary)}</div>',
        causes_html(summary), stages_html(summary),
        memory_html(summary), memory_plot, links_html(summary), links_plot,
        "<h2>Timeline</h2>", timeline_note(trace), plot,
    ])
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{title}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n{body}\n</body>\n</html>\n")


def write_report(path: str | Path, trace: Trace, summary: dict[str, Any]) -> None:
    """Write ``report.html``: header, summary panels and the Gantt timeline, self-contained."""
    Path(path).write_text(report_html(trace, summary, build_figure(trace, summary)), encoding="utf-8")
