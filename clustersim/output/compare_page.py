"""compare.html: the plans of one ``clustersim compare`` on one page, their timelines on one time axis.

Layout::

    clustersim · compare 3 plans                       which plan is which, the fastest that fits
    plans        label | what it is | plan | step | tokens/s | per GPU | MFU | peak | fits | report
    where a GPU's step goes      A  [compute .........|exposed ...|bubble ..]   (one time axis)
                                 B  [compute .........|exposed .........]
    exposed communication by kind      tp ▇▇ ▇   dp ▇ ▇▇▇▇▇   (one bar per plan)
    peak memory per GPU, by stage      stage 0 ▇▇ ▇▇  stage 1 ▇▇ ...   capacity - - - -
    config differences           key | A's value | B's | C's
    timelines, one per plan (up to eight), each from 0 to the slowest drawn step: zoom one, all follow

The split is :func:`clustersim.output.compare.step_split`'s, compute + exposed + bubble =
step, so the bars' lengths are the steps and their parts' differences add up to the steps'
(docs/metrics.md, "How a GPU's step splits"). Each timeline is the one its report_X.html
shows (clustersim.output.report.timeline), its time axis stretched to the slowest step
drawn; past eight plans, the first, the fastest that fits and the fastest others are drawn
(:func:`drawn_timelines`).
"""

from __future__ import annotations

import html
import json
from typing import Any

from .compare import (KINDS, other_jobs, config_value_text, verdict_lines, fastest, report_name, shows_hfu,
                      step_split)
from .report import (NUMBER_TICKS, REPORT_CSS, DIV_ID, GROUP_COLOURS, TIMELINE_CONFIG, plot_div_around_data,
                     plotlyjs_script, white_template, fmt_time, plot_div)
from .summary import GiB, host_only_unfit, plan_line, topology_changes_note, what_if_note
from .zoom import DETAIL_IN_VIEW, detail_script

COMPARE_PAGE = "compare.html"
# the width of a character of the timelines' row labels (11 px system-ui), a little over: the
# left margin every drawn timeline gets must hold the longest label of any
LABEL_CHAR_PX = 6.6
# the timelines drawn on the page: past these, each plan's own report has its timeline (a
# browser lays out several hundred thousand bars slowly)
MAX_TIMELINES = 8
SPLIT_DIV_ID, KINDS_DIV_ID, MEMORY_DIV_ID = "compare-split", "compare-kinds", "compare-memory"
_SMALL_CONFIG = {"displaylogo": False, "responsive": True}
# the step's three parts, as report.breakdown_html colours them
_PARTS = (("compute_s", "compute", GROUP_COLOURS["F"]), ("exposed_comm_s", "exposed communication", "#e15759"),
          ("bubble_s", "bubble (idle)", "#d0d7de"))
# a plan's colour in the charts by kind and by stage (Tableau 10 but its red, the exposed
# part's, and a dark blue in its place; then Tableau 20's lighter halves, again without red):
# twenty plans before a colour repeats
_PLAN_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7", "#9c755f",
                 "#bab0ac", "#2f4b7c", "#a0cbe8", "#ffbe7d", "#8cd17d", "#d4a6c8", "#86bcb6", "#f1ce63",
                 "#d7b5a6", "#79706e", "#b6992d", "#499894")
# the timelines' mode bar without autoscale: it would fit one timeline to its own bars (below
# 0 ms on a binned one) while the others keep the shared axis
_TIMELINE_CONFIG = {**TIMELINE_CONFIG, "modeBarButtonsToRemove": ["autoScale2d"]}

_PAGE_CSS = """
td.plan { white-space: normal; min-width: 18em; max-width: 40em; text-align: left; }
h3 { font-size: 15px; margin: 22px 0 2px; }
"""


def _plan_colour(i: int) -> str:
    return _PLAN_COLOURS[i % len(_PLAN_COLOURS)]


def small_layout(height_px: int, **more: Any) -> dict[str, Any]:
    """A small chart's layout, in the form the report's are (template expanded), its legend
    above the plot (below, it met the x axis's title in a narrow window), its axes' numbers
    in the report's style (NUMBER_TICKS: "2,000", not "2k")."""
    axes = {k: {**NUMBER_TICKS, **more.pop(k, {})} for k in ("xaxis", "yaxis")}
    return {"template": white_template(), "height": height_px, "margin": {"l": 60, "r": 20, "t": 34, "b": 44},
            "legend": {"orientation": "h", "x": 0, "y": 1.0, "yanchor": "bottom", "traceorder": "normal"}, **axes,
            **more}


def plan_name(p: dict[str, Any]) -> str:
    """A plan's label, with "(does not fit)" where it does not: what the charts call it."""
    return p["label"] + ("" if p["summary"]["memory"]["fits"] else " (does not fit)")


def split_figure(plans: list[dict[str, Any]]) -> dict[str, Any]:
    """Where a GPU's step goes, one horizontal bar per plan (the first on top): see
    :func:`parts_figure`."""
    return parts_figure([plan_name(p) for p in plans], [step_split(p["summary"]) for p in plans], 34)


def parts_figure(names: list[str], splits: list[dict[str, float]], row_px: int) -> dict[str, Any]:
    """One horizontal bar per name (the first on top), stacked compute | exposed
    communication | bubble (``splits``: each ``compute_s``, ``exposed_comm_s``, ``bubble_s``
    and ``step_time_s``, as :func:`clustersim.output.compare.step_split` gives them), in
    seconds on one axis: each bar is as long as its step, written at its end. compare.html's
    and sweep.html's."""
    data = []
    for key, label, colour in _PARTS:
        xs = [sp[key] for sp in splits]
        text = [f"{label}: {fmt_time(x)} ({100 * x / sp['step_time_s']:.1f} % of {fmt_time(sp['step_time_s'])})"
                if sp["step_time_s"] else label for x, sp in zip(xs, splits)]
        data.append({"type": "bar", "orientation": "h", "name": label, "x": xs, "y": names,
                     "marker": {"color": colour}, "hovertext": text, "hoverinfo": "text"})
    # each bar's step at its end: the bars' lengths are what the plans are compared by
    steps = [{"x": sp["step_time_s"], "y": name, "xanchor": "left", "showarrow": False, "xshift": 4,
              "text": f"{sp['step_time_s']:.3f} s", "font": {"size": 11}} for name, sp in zip(names, splits)]
    return {"data": data, "layout": small_layout(
        100 + row_px * len(names), barmode="stack", annotations=steps,
        xaxis={"title": {"text": "seconds per step (mean GPU)"}, "rangemode": "tozero",
               "range": [0, 1.08 * max(sp["step_time_s"] for sp in splits)]},
        yaxis={"autorange": "reversed", "type": "category", "automargin": True})}


def kinds_figure(plans: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Exposed communication per kind, one bar per plan and kind (where two kinds overlap, each
    counts the time, as in the report); None when no plan exposes any."""
    splits = [step_split(p["summary"]) for p in plans]
    kinds = [k for k in KINDS if any(sp[f"exposed_{k}_s"] > 0 for sp in splits)]
    if not kinds:
        return None
    # each bar's seconds above it: one plan's large bar sets the axis, and another's 0.16 s is a
    # sliver then, readable only by its label
    data = [{"type": "bar", "name": plan_name(p), "x": kinds, "y": [sp[f"exposed_{k}_s"] for k in kinds],
             "marker": {"color": _plan_colour(i)}, "texttemplate": "%{y:.3g} s", "textposition": "outside",
             "cliponaxis": False, "textfont": {"size": 10},
             "hovertemplate": "%{x}: %{y:.4g} s exposed<extra>" + html.escape(p["label"]) + "</extra>"}
            for i, (p, sp) in enumerate(zip(plans, splits))]
    return {"data": data, "layout": small_layout(
        280, barmode="group", yaxis={"title": {"text": "exposed s / GPU"}, "rangemode": "tozero"})}


def memory_figure(plans: list[dict[str, Any]]) -> dict[str, Any]:
    """Peak memory of a GPU of each pipeline stage, one bar per plan, with each GPU's capacity
    dashed (one line where the plans' GPUs hold the same)."""
    data = []
    most = max(len(p["summary"]["memory"]["stages"]) for p in plans)
    for i, p in enumerate(plans):
        stages = p["summary"]["memory"]["stages"]
        data.append({"type": "bar", "name": plan_name(p), "x": [f"stage {st['stage']}" for st in stages],
                     "y": [st["peak_bytes"] / GiB for st in stages], "marker": {"color": _plan_colour(i)},
                     "hovertemplate": "%{x}: %{y:.1f} GiB at the peak<extra>" + html.escape(p["label"]) + "</extra>"})
    caps = sorted({p["summary"]["memory"]["capacity_bytes"] for p in plans})
    line = {"color": "#cf222e", "dash": "dash", "width": 1.5}
    shapes = [{"type": "line", "xref": "paper", "x0": 0, "x1": 1, "yref": "y", "y0": c / GiB, "y1": c / GiB,
               "line": line} for c in caps if c]
    # each line named in the legend, not beside it: a label on the plot covered the last
    # stage's bars where they reach the line
    data += [{"type": "scatter", "mode": "lines", "x": [None], "y": [None], "hoverinfo": "skip",
              "line": line, "name": f"capacity {c / GiB:.0f} GiB" + (
                  f" ({', '.join(p['label'] for p in plans if p['summary']['memory']['capacity_bytes'] == c)})"
                  if len(caps) > 1 else "")}
             for c in caps if c]
    stage_names = [f"stage {s}" for s in range(most)]
    return {"data": data, "layout": small_layout(
        300, barmode="group", shapes=shapes,
        xaxis={"type": "category", "categoryorder": "array", "categoryarray": stage_names},
        yaxis={"title": {"text": "GiB per GPU at the peak"}, "rangemode": "tozero"})}


def _plans_table(plans: list[dict[str, Any]], reports: bool) -> str:
    e = html.escape
    best = fastest([p["summary"] for p in plans])
    hfu = shows_hfu([p["summary"] for p in plans])  # (HFU beside MFU, as the terminal's table)
    rows = []
    for i, p in enumerate(plans):
        s, mem = p["summary"], p["summary"]["memory"]
        fits = (f'<span class="fits">fits</span> in {mem["capacity_bytes"] / GiB:.0f}' if mem["fits"]
                else f'<span class="nofit">NO: host</span> ({mem["host"]["capacity_bytes"] / GiB:,.0f})'
                if host_only_unfit(mem) else f'<span class="nofit">NO</span> ({mem["capacity_bytes"] / GiB:.0f})')
        link = f'<a href="{e(report_name(p["label"]))}">{e(report_name(p["label"]))}</a>' if reports else ""
        mark = " ★" if i == best else ""
        rows.append(f'<tr><td class="l"><b>{e(p["label"])}</b>{mark}</td><td class="plan">{e(p["source"])}<br>'
                    f'<span class="note">{e(plan_line(s))}</span></td><td>{s["step_time_s"]:.3f} s</td>'
                    f'<td>{s["tokens_per_s"]:,.0f}</td><td>{s["tokens_per_s_per_gpu"]:,.1f}</td>'
                    f'<td>{100 * s["mfu"]:.1f} %</td>' + (f'<td>{100 * s["hfu"]:.1f} %</td>' if hfu else "")
                    + f'<td>{mem["peak_bytes"] / GiB:.1f}</td><td class="l">{fits}</td>'
                    f'<td class="l">{link}</td></tr>')
    return ("<h2>Plans</h2><table><tr><th class=\"l\"></th><th class=\"l\">plan</th><th>step</th><th>tokens/s</th>"
            "<th>per GPU</th><th>MFU</th>" + ("<th>HFU</th>" if hfu else "") + "<th>peak GiB</th><th class=\"l\">fits</th><th class=\"l\">report</th></tr>"
            + "".join(rows) + "</table><p class=\"note\">★ the most tokens/s of the plans that fit. "
            + ("A plan's report has its summary panels, memory and links in full. " if reports else "")
            + "compare.json has every plan's summary.</p>")


def _verdict_html(plans: list[dict[str, Any]]) -> str:
    """The terminal's verdict and note on different jobs, one paragraph a line (★ marks the
    fastest that fits in the table)."""
    names = [p["label"] for p in plans]
    summaries = [p["summary"] for p in plans]
    lines = other_jobs(names, summaries) + verdict_lines(names, summaries)
    return "".join(f'<p class="meta">{html.escape(" ".join(line.split()))}</p>' for line in lines)


def _differences_html(plans: list[dict[str, Any]]) -> str:
    """The config fields where any plan differs from the first, one row each: every plan's value."""
    keys: list[str] = []
    for p in plans[1:]:
        keys += [k for k, _, _ in p["differences"] if k not in keys]
    if not keys:
        return ""
    e = html.escape
    base = {k: a for p in plans[1:] for k, a, _ in p["differences"]}
    theirs = [{k: b for k, _, b in p["differences"]} for p in plans]
    rows = "".join(f'<tr><td class="l"><code>{e(k)}</code></td>'
                   + "".join(f'<td class="l">{e(config_value_text(t.get(k, base[k]) if i else base[k]))}</td>'
                             for i, t in enumerate(theirs)) + "</tr>" for k in keys)
    heads = "".join(f'<th class="l">{e(p["label"])}</th>' for p in plans)
    return (f'<h2>Config differences</h2><table><tr><th class="l">field</th>{heads}</tr>{rows}</table>'
            "<p class=\"note\">Each field that some plan sets otherwise than the first (A), as the YAML writes it "
            "(the fields a value leaves unset left out); compare.json has every plan's whole summary.</p>")


def drawn_timelines(plans: list[dict[str, Any]], most: int | None = None) -> list[int]:
    """Which plans' timelines the page draws, in the plans' order: all of them up to ``most``;
    past that the first (the baseline), the fastest that fits, then the others that fit by
    tokens/s, then those that do not (``most``: MAX_TIMELINES by default)."""
    most = MAX_TIMELINES if most is None else most
    if len(plans) <= most:
        return list(range(len(plans)))
    summaries = [p["summary"] for p in plans]
    best = fastest(summaries)
    order = sorted(range(len(plans)), key=lambda i: (i != 0, i != best, not summaries[i]["memory"]["fits"],
                                                     -summaries[i]["tokens_per_s"], i))
    return sorted(order[:most])


def timeline_caption(trace, layout: dict[str, Any]) -> str:
    """What a plan's timeline on the page shows: the ranks drawn and the GPUs each stands for,
    and bins where the bars are (its report's note, clustersim.output.report.timeline_note,
    says more)."""
    weights = sorted({trace.weight.get(r, 1) for r in trace.ranks})
    meta = layout.get("meta") or {}
    shown, binned = meta.get("shown"), meta.get("binned")
    ranks = len(shown["drawn"]) if shown else len(trace.ranks)
    parts = [f"{ranks:,} simulated rank{'s' if ranks != 1 else ''}"
             + (f" of {shown['of']:,}" if shown else "")
             + (f", each standing for {' or '.join(map(str, weights))} GPUs" if weights != [1] and len(weights) <= 2
                else f", each standing for {weights[0]} to {weights[-1]} GPUs" if weights != [1] else "")]
    if binned:
        parts.append(f"bars joined from bins of {fmt_time(binned['bin_ms'] / 1e3)}, each in the colour of the work "
                     "busiest in it (zoomed in, still bins)")
    return "; ".join(parts) + "."


def _timelines_html(plans: list[dict[str, Any]], timelines: list[tuple | None]) -> str:
    """The timelines :func:`drawn_timelines` picks, their time axis from 0 to the slowest
    drawn step, and the script that zooms every timeline to the range one is zoomed to."""
    drawn = [i for i in drawn_timelines(plans) if timelines[i] is not None]
    if not drawn:
        return ""
    slowest_s = max(plans[i]["summary"]["step_time_s"] for i in drawn)
    end_ms = 1e3 * slowest_s * 1.005
    left = [plans[i]["label"] for i in range(len(plans)) if i not in drawn]
    parts = ["<h2>Timelines on one time axis</h2><p class=\"note\">Each plan's timeline as its report draws it, "
             f"from 0 to the slowest step drawn ({fmt_time(slowest_s)}): a shorter step ends sooner. Zoom one, and "
             "the others follow; double-click to reset."
             + (f" Zoomed in to {DETAIL_IN_VIEW:,} spans or fewer in view, a timeline draws each span inside its "
                "bars." if any(timelines[i][3] for i in drawn) else "")
             + (f" {len(drawn)} of the {len(plans)} plans are drawn (the first, the fastest that fits, then the "
                f"fastest); {', '.join(left)} are in their reports." if left else "") + "</p>"]
    # one left margin for all, wide enough for the longest row label of any: plotly's automargin
    # would size each to its own labels, and t = 0 would stand at a different place in each
    labels = [t for i in drawn for t in timelines[i][1].get("yaxis", {}).get("ticktext", ())]
    left_px = round(LABEL_CHAR_PX * max(map(len, labels), default=0)) + 16
    ids = []
    for i in drawn:
        p, (data_json, layout, caption, spans) = plans[i], timelines[i]
        div_id = f"{DIV_ID}-{p['label']}"
        ids.append(div_id)
        layout = {**layout, "xaxis": {**layout["xaxis"], "range": [0, end_ms]},
                  "yaxis": {**layout.get("yaxis", {}), "automargin": False},
                  "margin": {**layout.get("margin", {}), "l": left_px}}
        before, after = plot_div_around_data({"layout": layout}, div_id, _TIMELINE_CONFIG)
        unfit = "" if p["summary"]["memory"]["fits"] else ' · <span class="nofit">does not fit</span>'
        if spans and spans["until_ms"] is not None:  # (the report's note says it too: report.timeline_note)
            caption = (f"{caption} Zoomed in, its spans are drawn in the step's first "
                       f"{fmt_time(spans['until_ms'] / 1e3)} ({spans['carried']:,} of {spans['of']:,}).")
        hw = p["summary"].get("hardware", {})  # (a cluster the plan line does not show: its changes, its what-ifs)
        parts.append(f"<h3>{html.escape(p['label'])} · {html.escape(plan_line(p['summary']))}"
                     f"{html.escape(topology_changes_note(hw) + what_if_note(hw))} · "
                     f"{p['summary']['step_time_s']:.3f} s{unfit}</h3><p class=\"note\">{html.escape(caption)}</p>"
                     + before + data_json + after
                     # each span drawn once zoomed in, as in its report (clustersim.output.zoom)
                     + (detail_script(div_id, spans, GROUP_COLOURS) if spans else ""))
    parts.append(_zoom_together_script(ids, end_ms))
    return "\n".join(parts)


def _zoom_together_script(ids: list[str], end_ms: float) -> str:
    """When one timeline's time axis is zoomed, panned or reset, the others take its range; a
    reset (a double click: the whole step again) also gives the others their own rows back,
    which a box zoom of theirs may have narrowed."""
    return ("<script>(function(){const ids=" + json.dumps(ids) + ",end=" + json.dumps(end_ms) + ";let busy=false;"
            "const rows={};ids.forEach(function(id){const el=document.getElementById(id);"
            "if(el&&el.layout&&el.layout.yaxis&&el.layout.yaxis.range)rows[id]=el.layout.yaxis.range.slice();});"
            "ids.forEach(function(id){const el=document.getElementById(id);if(!el||!el.on)return;"
            "el.on('plotly_relayout',function(ev){if(busy)return;let r=null;"
            "if(ev['xaxis.range[0]']!==undefined)r=[ev['xaxis.range[0]'],ev['xaxis.range[1]']];"
            "else if(ev['xaxis.range'])r=ev['xaxis.range'];else if(ev['xaxis.autorange'])r=[0,end];"
            "if(!r)return;const reset=Math.abs(r[0])<1e-9&&Math.abs(r[1]-end)<=1e-9*end;busy=true;"
            "Promise.all(ids.filter(function(o){return o!==id;}).map(function(o){const u={'xaxis.range':r.slice()};"
            "if(reset&&rows[o])u['yaxis.range']=rows[o].slice();return Plotly.relayout(o,u);}))"
            ".then(function(){busy=false;},function(){busy=false;});});});})();</script>")


def compare_html(plans: list[dict[str, Any]], timelines: list[tuple | None], reports: bool) -> str:
    """The whole page, plotly.js inlined (it works offline). ``plans``: as
    :func:`clustersim.output.compare.format_compare` takes them; ``timelines``: per plan, its
    timeline's data as JSON (as the report writes it), its layout, its caption
    (:func:`timeline_caption`) and its spans one by one (the figure's ``"detail"``,
    clustersim.output.report.timeline; None without spans), or None where it has no
    timeline; ``reports``: whether each plan's
    report_X.html is beside the page (linked)."""
    kinds = kinds_figure(plans)
    body = [
        f"<h1>clustersim · compare {len(plans)} plans</h1>", _verdict_html(plans), _plans_table(plans, reports),
        "<h2>Where a GPU's step goes</h2>", plot_div(split_figure(plans), SPLIT_DIV_ID, _SMALL_CONFIG),
        "<p class=\"note\">Per GPU, the mean over GPUs: compute, the communication the compute stream waited for, "
        "and the bubble (idle) add up to the step, so each bar is as long as its plan's step, and the "
        "differences between two plans' parts add up to the difference between their steps.</p>",
    ]
    if kinds is not None:
        body += ["<h2>Exposed communication by kind</h2>", plot_div(kinds, KINDS_DIV_ID, _SMALL_CONFIG),
                 "<p class=\"note\">Seconds a GPU's compute stream waited for each kind; where two kinds overlap, "
                 "each counts the time.</p>"]
    body += ["<h2>Peak memory per GPU, by pipeline stage</h2>",
             plot_div(memory_figure(plans), MEMORY_DIV_ID, _SMALL_CONFIG),
             _differences_html(plans), _timelines_html(plans, timelines)]
    title = html.escape(f"clustersim · compare {len(plans)} plans")
    return ('<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{title}</title>\n<style>{REPORT_CSS}{_PAGE_CSS}</style>\n</head>\n<body>\n"
            + plotlyjs_script() + "\n" + "\n".join(x for x in body if x) + "\n</body>\n</html>\n")
