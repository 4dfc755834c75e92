"""sweep.html and advise.html: every plan a ``sweep`` or an ``advise`` simulated, on one page.

Layout::

    clustersim · sweep scenarios/x.yaml                   what the terminal printed, as it printed it
    tokens/s per GPU against peak memory
        ▲ tokens/s per GPU      ● fits   × does not fit          (advise: ◆ the guide's options
        |  ●#7   ●#13           ×                                  at their best, ★ your plan)
        |     ●   ●     ×       ×
        +------------------------¦-------▶ peak GiB per GPU
                              capacity
    where a GPU's step goes, the best plans: compute | exposed communication | bubble, one bar each
    next: the best plan run, the best side by side   python -m clustersim run x.yaml --set "..."
                                                     python -m clustersim compare x.yaml --variant "..." ...
    every plan simulated, best first          the terminal's columns, the plan's changes in full
    refused by the scenario's rules           each plan with its rule

The figures are the sweep's own (sweep.json's rows); nothing is simulated here. The points are
what the plans give on the GPUs the scenario has: the best plan is the highest point left of
the capacity.
"""

from __future__ import annotations

import html
import shlex
from pathlib import Path
from typing import Any

from ..overrides import changes_text
from ..sweep import _cell, _columns, _heads, table_columns, value_at
from ..yamlio import read_yaml
from .report import _CSS, _plotlyjs_script, plot_div
from .compare_page import _PARTS, _small_layout
from .summary import GiB

SCATTER_DIV_ID, SPLIT_DIV_ID = "plans-scatter", "plans-split"
SPLIT_SHOWN = 20  # the best plans whose steps are drawn split
LABELLED = 5  # the best plans named beside their points
TABLE_ROWS = 2_000  # past these, the CSV has the rest (a browser lays out a longer table slowly)
COMPARED = 3  # the best plans the compare command on the page puts beside the scenario's own
_CONFIG = {"displaylogo": False, "responsive": True}
_FITS, _UNFIT, _OPTION, _OWN = "#59a14f", "#e15759", "#4e79a7", "#f28e2b"

_PAGE_CSS = """
pre.terminal { background: #f6f8fa; border: 1px solid #d0d7de; border-radius: 6px; padding: 10px 14px;
               font-size: 12px; overflow-x: auto; }
code.cmd { display: block; background: #f6f8fa; border: 1px solid #d0d7de; border-radius: 6px; padding: 8px 12px;
           font-size: 12px; white-space: pre-wrap; word-break: break-all; }
tr.nofit td { color: #8c959f; }
"""


def plan_text(sweep: dict[str, Any], row: dict[str, Any]) -> str:
    """A plan's keys as the table shows them: ``tp=4 pp=8 recompute=selective dp=2``."""
    keys = _columns(sweep)
    return " ".join(f"{h}={_cell(row['changes'].get(k))}" for h, k in zip(_heads(keys), keys) if k in row["changes"])


def _hover(sweep: dict[str, Any], r: dict[str, Any], note: str = "") -> str:
    return (f"#{r['plan']} · {html.escape(plan_text(sweep, r))}<br>step {r['step_time_s']:.4g} s · "
            f"{r['tokens_per_s_per_gpu']:,.1f} tokens/s per GPU · MFU {100 * r['mfu']:.1f} %<br>"
            f"bubble {100 * r['bubble_fraction']:.1f} % · exposed {r['exposed_comm_s']['total']:.3f} s · "
            f"{r['peak_bytes'] / GiB:.1f} GiB" + ("" if r["fits"] else " (does not fit)")
            + (f"<br>{html.escape(note)}" if note else ""))


def _notes(sweep: dict[str, Any]) -> dict[int, str]:
    """An advice's notes on a plan (the scenario's own, the guide's options it is); none for a sweep."""
    own = sweep.get("own_plan")
    return {r["plan"]: "; ".join((["the scenario's plan"] if r["plan"] == own else []) + r.get("guide_options", []))
            for r in sweep["plans"] if r["status"] == "ok"}


def scatter_figure(sweep: dict[str, Any]) -> dict[str, Any]:
    """tokens/s per GPU against peak memory per GPU, one point per plan simulated: those that
    fit and those that do not apart, the best plans numbered, the GPU's capacity dashed; for an
    advice, the guide's options at their best plan and the scenario's own plan marked."""
    rows = {r["plan"]: r for r in sweep["plans"]}
    ranked = [rows[n] for n in sweep["ranking"]]
    notes = _notes(sweep)
    data = []
    for fits, name, colour, symbol in ((True, "fits", _FITS, "circle"), (False, "does not fit", _UNFIT, "x")):
        pts = [r for r in ranked if r["fits"] == fits]
        if pts:
            data.append({"type": "scatter", "mode": "markers", "name": name,
                         "x": [r["peak_bytes"] / GiB for r in pts], "y": [r["tokens_per_s_per_gpu"] for r in pts],
                         "marker": {"color": colour, "symbol": symbol, "size": 8, "opacity": 0.8},
                         "hovertext": [_hover(sweep, r, notes.get(r["plan"], "")) for r in pts], "hoverinfo": "text"})
    marks = []
    for o in sweep.get("options", []):
        if o["best"] is not None:
            marks.append((rows[o["best"]], o["option"]))
    if marks:
        data.append({"type": "scatter", "mode": "markers", "name": "the guide's options, each at its best",
                     "x": [r["peak_bytes"] / GiB for r, _ in marks], "y": [r["tokens_per_s_per_gpu"] for r, _ in marks],
                     # (an open symbol is drawn in the marker's colour, its line's width)
                     "marker": {"color": _OPTION, "symbol": "diamond-open", "size": 16, "line": {"width": 2}},
                     "hovertext": [f"the guide's \u201c{html.escape(name)}\u201d at its best<br>" + _hover(sweep, r)
                                   for r, name in marks], "hoverinfo": "text"})
    own = rows.get(sweep.get("own_plan"))
    if own is not None and own["status"] == "ok":
        data.append({"type": "scatter", "mode": "markers", "name": "the scenario's plan",
                     "x": [own["peak_bytes"] / GiB], "y": [own["tokens_per_s_per_gpu"]],
                     "marker": {"color": _OWN, "symbol": "star-open", "size": 18, "line": {"width": 2}},
                     "hovertext": ["the scenario's plan<br>" + _hover(sweep, own)], "hoverinfo": "text"})
    named = [r for r in ranked if r["fits"]][:LABELLED]
    notes_text = [{"x": r["peak_bytes"] / GiB, "y": r["tokens_per_s_per_gpu"], "text": f"#{r['plan']}",
                   "showarrow": False, "xanchor": "left", "xshift": 6, "font": {"size": 11}} for r in named]
    caps = sorted({r["capacity_bytes"] for r in ranked if r["capacity_bytes"]})
    shapes = [{"type": "line", "xref": "x", "x0": c / GiB, "x1": c / GiB, "yref": "paper", "y0": 0, "y1": 1,
               "line": {"color": "#cf222e", "dash": "dash", "width": 1.5}} for c in caps]
    notes_text += [{"x": c / GiB, "xanchor": "left", "xshift": 4, "yref": "paper", "y": 1, "yanchor": "top",
                    "showarrow": False, "text": f"capacity {c / GiB:.0f} GiB", "font": {"color": "#cf222e", "size": 11}}
                   for c in caps]
    return {"data": data, "layout": _small_layout(
        460, shapes=shapes, annotations=notes_text, hovermode="closest",
        xaxis={"title": {"text": "peak memory per GPU (GiB)"}, "rangemode": "tozero"},
        yaxis={"title": {"text": "tokens/s per GPU"}, "rangemode": "tozero"},
        legend={"orientation": "h", "y": -0.16})}


def split_figure(sweep: dict[str, Any], shown: int = SPLIT_SHOWN) -> dict[str, Any] | None:
    """Where a GPU's step goes for the best ``shown`` plans, best on top: one bar each, stacked
    compute | exposed communication | bubble (the step split of docs/metrics.md), so a bar is
    as long as its plan's step; None when no plan was simulated."""
    rows = {r["plan"]: r for r in sweep["plans"]}
    best = [rows[n] for n in sweep["ranking"][:shown]]
    if not best:
        return None
    names = [f"#{r['plan']} {plan_text(sweep, r)}" + ("" if r["fits"] else " (does not fit)") for r in best]
    data = []
    for key, label, colour in _PARTS:
        xs = [r["exposed_comm_s"]["total"] if key == "exposed_comm_s" else r[key] for r in best]
        data.append({"type": "bar", "orientation": "h", "name": label, "x": xs, "y": names,
                     "marker": {"color": colour}, "hovertemplate": f"{label}: %{{x:.4g}} s<extra>%{{y}}</extra>"})
    return {"data": data, "layout": _small_layout(
        90 + 24 * len(best), barmode="stack", margin={"l": 10, "r": 20, "t": 10, "b": 40},
        legend={"orientation": "h", "y": -0.5 if len(best) < 4 else -0.12, "traceorder": "normal"},
        xaxis={"title": {"text": "seconds per step (mean GPU)"}, "rangemode": "tozero"},
        yaxis={"autorange": "reversed", "type": "category", "automargin": True})}


def _best_changes(sweep: dict[str, Any]) -> dict[int, list[tuple[str, Any]]]:
    """The plans that fit, best first, each with its changes that change the file (an advice
    sets every key it searched; a plan they leave as the file has it is the file's own)."""
    data = read_yaml(Path(sweep["scenario"]), what="scenario")
    rows = {r["plan"]: r for r in sweep["plans"]}
    return {n: [(k, v) for k, v in rows[n]["changes"].items() if value_at(data, k) != v]
            for n in sweep["ranking"] if rows[n]["fits"]}


def compare_command(sweep: dict[str, Any], most: int = COMPARED) -> str | None:
    """The ``compare`` command that puts the best plans that fit (at most ``most``) beside the
    scenario as its file has it, each as a variant; None when none fits but the file's own."""
    changed = _best_changes(sweep)
    best = [n for n in changed if changed[n]][:most]
    if not best:
        return None
    words = ["python", "-m", "clustersim", "compare", sweep["scenario"]]
    for n in best:
        words += ["--variant", changes_text(changed[n])]
    return " ".join(shlex.quote(w) for w in words) + " --out compare_best"


def run_command(sweep: dict[str, Any]) -> str | None:
    """The ``run`` command of the best plan that fits (its report and trace file); None when
    none fits."""
    changed = _best_changes(sweep)
    if not changed:
        return None
    n, changes = next(iter(changed.items()))
    words = ["python", "-m", "clustersim", "run", sweep["scenario"]] + (
        ["--set", changes_text(changes)] if changes else [])
    return " ".join(shlex.quote(w) for w in words) + f" --out best_plan_{n}"


def _table_html(sweep: dict[str, Any]) -> str:
    """Every simulated plan, best first, in the terminal's columns (plans that do not fit greyed)."""
    rows = {r["plan"]: r for r in sweep["plans"]}
    cols = table_columns(sweep)
    notes = _notes(sweep) if "options" in sweep else None
    e = html.escape
    heads = "".join(f"<th>{e(h)}</th>" for h, _ in cols) + ('<th class="l">note</th>' if notes is not None else "")
    body = []
    for n in sweep["ranking"][:TABLE_ROWS]:
        r = rows[n]
        cells = "".join(f"<td>{e(f(r))}</td>" for _, f in cols)
        if notes is not None:
            cells += f'<td class="l">{e(notes.get(n, ""))}</td>'
        grey = "" if r["fits"] else ' class="nofit"'
        body.append(f"<tr{grey}>{cells}</tr>")
    more = len(sweep["ranking"]) - TABLE_ROWS
    tail = f'<p class="note">... and {more:,} more in the CSV.</p>' if more > 0 else ""
    return (f"<h2>Every plan simulated, best first</h2><table><tr>{heads}</tr>{''.join(body)}</table>{tail}"
            "<p class=\"note\">Best first: the plans that fit by tokens/s, then those that do not (greyed: the step "
            "they would take if they fit).</p>")


def _refused_html(sweep: dict[str, Any]) -> str:
    refused = [r for r in sweep["plans"] if r["status"] == "refused"]
    if not refused:
        return ""
    e = html.escape
    rows = "".join(f'<tr><td>{r["plan"]}</td><td class="l">{e(plan_text(sweep, r))}</td>'
                   f'<td class="l wide">{e(r["reason"])}</td></tr>' for r in refused[:TABLE_ROWS])
    return (f"<h2>Refused by the scenario's rules: {len(refused):,} of {len(sweep['plans']):,}</h2>"
            f'<table><tr><th>#</th><th class="l">plan</th><th class="l wide">rule</th></tr>{rows}</table>')


def plans_html(sweep: dict[str, Any], terminal: str, what: str) -> str:
    """The page of a sweep or an advice (``what``: "sweep" or "advise"; ``sweep``: what
    sweep.json or advise.json holds; ``terminal``: what the command printed)."""
    e = html.escape
    title = f"clustersim · {what} {sweep['scenario']}"
    body = [f"<h1>{e(title)}</h1>", f'<pre class="terminal">{e(terminal)}</pre>']
    if sweep["ranking"]:
        body += ["<h2>Tokens/s per GPU against peak memory</h2>",
                 plot_div(scatter_figure(sweep), SCATTER_DIV_ID, _CONFIG),
                 "<p class=\"note\">One point per plan simulated; hover for its plan and figures. The best plan is "
                 "the highest point left of the capacity line" + (": the diamonds mark each of the guide's options "
                                                                  "at its best plan, the star the scenario's own"
                                                                  if "options" in sweep else "") + ".</p>"]
        split = split_figure(sweep)
        body += [f"<h2>Where a GPU's step goes, the best {min(SPLIT_SHOWN, len(sweep['ranking']))}</h2>",
                 plot_div(split, SPLIT_DIV_ID, _CONFIG),
                 "<p class=\"note\">Per GPU, the mean over GPUs: compute, the communication the compute stream "
                 "waited for, and the bubble (idle) add up to the step.</p>"]
    cmd, run = compare_command(sweep), run_command(sweep)
    if cmd is not None or run is not None:
        body.append("<h2>Next</h2>")
    if run is not None:
        body += ["<p class=\"note\">The best plan that fits, run on its own (its report and trace file):</p>",
                 f'<code class="cmd">{e(run)}</code>']
    if cmd is not None:
        body += ["<p class=\"note\">The best plans that fit side by side with the scenario as its file has it: their "
                 "timelines, memory and exposed communication on one page (compare_best/compare.html):</p>",
                 f'<code class="cmd">{e(cmd)}</code>']
    body += [_table_html(sweep), _refused_html(sweep)]
    return ('<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{e(title)}</title>\n<style>{_CSS}{_PAGE_CSS}</style>\n</head>\n<body>\n"
            + _plotlyjs_script() + "\n" + "\n".join(x for x in body if x) + "\n</body>\n</html>\n")
