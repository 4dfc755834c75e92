"""sweep.html and advise.html: every plan a ``sweep`` or an ``advise`` simulated, on one page.

Layout::

    clustersim · sweep scenarios/x.yaml                   what the terminal printed, as it printed it
    tokens/s per GPU against peak memory
        ▲ tokens/s per GPU      ● fits   × does not fit          (advise: ◆ the guide's options
        |  ●#7   ●#13           ×                                  at their best, ★ your plan)
        |     ●   ●     ×       ×
        +------------------------¦-------▶ peak GiB per GPU
                              capacity
    tokens/s per GPU against the first numeric key varied (a sweep's): a line per setting of the others
    where a GPU's step goes, the best plans: compute | exposed communication | bubble, one bar each
    next: the best plan run, the best side by side   python -m clustersim run x.yaml --set "..."
                                                     python -m clustersim compare x.yaml --variant "..." ...
    every plan simulated, best first          the terminal's columns, and what else a plan sets
    certain not to fit, not simulated         each plan with its memory floor (advise; sweep --skip-unfit)
    refused by the scenario's rules           each plan with its rule

The figures are the sweep's own (sweep.json's rows); nothing is simulated here (the commands'
plans are loaded again, to give only the changes that change the scenario). The points are
what the plans give on the GPUs the scenario has: the best plan is the highest point left of
the capacity.
"""

from __future__ import annotations

import html
import shlex
from typing import Any

from ..overrides import changes_text
from ..sweep import (UNFIT_WHY, also_set, cell_text, column_heads, estimate_legend, plan_text, table_columns,
                     value_at)
from .report import REPORT_CSS, plotlyjs_script, white_template, plot_div
from .compare_page import small_layout, parts_figure
from .summary import GiB

SCATTER_DIV_ID, SPLIT_DIV_ID, LINES_DIV_ID = "plans-scatter", "plans-split", "plans-lines"
SPLIT_SHOWN = 20  # the best plans whose steps are drawn split
LABELLED = 5  # the best plans named beside their points
LINES_SHOWN = 12  # the lines of lines_figure: the combinations whose best plan that fits gives the most
TABLE_ROWS = 2_000  # past these, the CSV has the rest (a browser lays out a longer table slowly)
COMPARED = 3  # the best plans the compare command on the page puts beside the scenario's own
_CONFIG = {"displaylogo": False, "responsive": True}
_FITS, _UNFIT, _OWN = "#59a14f", "#e15759", "#f28e2b"
_UNFIT_LEGEND = "#57606a"  # the lines chart's hollow marker in its legend: grey, as it stands for every line's
_FIND = object()  # scatter_figure's own plan: found from the sweep
# the guide's options, one colour each, told apart from each other and from the points' green
# and red (a navy beside the blue read as the same option)
_OPTIONS = ("#4e79a7", "#b07aa1", "#1f1f1f", "#9c755f", "#76b7b2")
# the lines chart's dash past each round of the colours (12 lines over 10 colours drew pairs alike)
_DASHES = ("solid", "dash", "dot")

_PAGE_CSS = """
pre.terminal { background: #f6f8fa; border: 1px solid #d0d7de; border-radius: 6px; padding: 10px 14px;
               font-size: 12px; white-space: pre-wrap; overflow-wrap: anywhere; }  /* a long line wraps, not hides */
code.cmd { display: block; background: #f6f8fa; border: 1px solid #d0d7de; border-radius: 6px; padding: 8px 12px;
           font-size: 12px; white-space: pre-wrap; word-break: break-all; }
tr.nofit td { color: #8c959f; }
div.wide { overflow-x: auto; }  /* a table wider than the page scrolls, not clipped at its edge */
"""


def _hover(sweep: dict[str, Any], r: dict[str, Any], note: str = "") -> str:
    more = also_set(sweep, r)
    return (f"#{r['plan']} · {html.escape(plan_text(sweep, r))}" + (f" · {html.escape(more)}" if more else "")
            + f"<br>step {r['step_time_s']:.3f} s · "
            f"{r['tokens_per_s_per_gpu']:,.1f} tokens/s per GPU · MFU {100 * r['mfu']:.1f} %<br>"
            f"bubble {100 * r['bubble_fraction']:.1f} % · exposed {r['exposed_comm_s']['total']:.3f} s · "
            f"{r['peak_bytes'] / GiB:.1f} GiB" + (" (does not fit)" if not r["fits"] else " (tight)" if r.get("tight") else "")
            + (f"<br>{html.escape(note)}" if note else ""))


def scenario_config(sweep: dict[str, Any]) -> dict[str, Any]:
    """The swept scenario's config as validated, its topology's fields included
    (:func:`clustersim.output.compare.effective_config`): what a plan's changes are compared with."""
    from ..config import load_scenario
    from .compare import effective_config

    return effective_config(load_scenario(sweep["scenario"]))


def own_plan(sweep: dict[str, Any], base: dict[str, Any] | None = None) -> int | None:
    """The plan that is the scenario as its file has it: an advice's first; in a sweep, the
    plan whose every change is the scenario's own value (``base``: :func:`scenario_config`,
    worked out where not given), if one is; else None."""
    if "own_plan" in sweep:
        return sweep["own_plan"]
    base = scenario_config(sweep) if base is None else base
    return next((r["plan"] for r in sweep["plans"] if r["status"] == "ok"
                 and all(value_at(base, k) == v for k, v in r["changes"].items())), None)


def _notes(sweep: dict[str, Any], own: int | None) -> dict[int, str]:
    """A plan's notes: the scenario's own (plan ``own``), and under an advice the guide's options it is."""
    return {r["plan"]: "; ".join((["the scenario's plan"] if r["plan"] == own else []) + r.get("guide_options", []))
            for r in sweep["plans"] if r["status"] == "ok"}


def scatter_figure(sweep: dict[str, Any], own: int | None | object = _FIND) -> dict[str, Any]:
    """tokens/s per GPU against peak memory per GPU, one point per plan simulated: those that
    fit and those that do not apart, the best plans numbered, the GPU's capacity dashed; for an
    advice, each of the guide's options at its best plan and the scenario's own plan marked.

    The memory axis ends a little past the larger of the capacity and the largest peak, but
    not past 1.5 times the capacity (or the largest peak that fits): a plan further out is
    drawn at its edge as a triangle pointing off the scale (its hover says its peak), so the
    plans that fit are not squeezed against the left."""
    rows = {r["plan"]: r for r in sweep["plans"]}
    ranked = [rows[n] for n in sweep["ranking"]]
    own = own_plan(sweep) if own is _FIND else own
    notes = _notes(sweep, own)
    caps = sorted({r["capacity_bytes"] for r in ranked if r["capacity_bytes"]})
    fit_peaks = [r["peak_bytes"] for r in ranked if r["fits"]]
    peaks = [r["peak_bytes"] for r in ranked]
    end = min(max(peaks, default=0.0) * 1.04, max([1.5 * max(caps, default=0.0), *(1.1 * x for x in fit_peaks)]))
    # past the capacity however far below it every peak is (an advice leaves out the plans that
    # cannot fit): the line the page reads the plans against is always drawn
    end = max(end, 1.04 * max(caps, default=0.0)) or max(peaks, default=1.0) * 1.04

    def x_of(r: dict[str, Any]) -> float:
        return min(r["peak_bytes"], end) / GiB

    data = []
    for fits, name, colour, symbol in ((True, "fits", _FITS, "circle"), (False, "does not fit", _UNFIT, "x")):
        pts = [r for r in ranked if r["fits"] == fits]
        if not pts:
            continue
        # the points past the edge, triangles, in a trace of their own out of the legend: the
        # legend draws a trace's first point's symbol, a triangle where the fastest plan that
        # does not fit was past the edge, and the entry then showed no "x"
        inside = [r for r in pts if r["peak_bytes"] <= end]
        for part, shape, legend in ((inside, symbol, True), ([r for r in pts if r["peak_bytes"] > end],
                                                             "triangle-right", not inside)):
            if part:
                data.append({"type": "scatter", "mode": "markers", "name": name, "legendgroup": name,
                             "showlegend": legend, "x": [x_of(r) for r in part],
                             "y": [r["tokens_per_s_per_gpu"] for r in part],
                             "marker": {"color": colour, "size": 8, "opacity": 0.8, "symbol": shape},
                             "hovertext": [_hover(sweep, r, notes.get(r["plan"], "")) for r in part],
                             "hoverinfo": "text",
                             # (the triangles at the edge drawn whole, not cut by the plot's border)
                             **({"cliponaxis": False} if shape == "triangle-right" else {})})
    for i, o in enumerate(o for o in sweep.get("options", []) if o["best"] is not None):
        r = rows[o["best"]]
        data.append({"type": "scatter", "mode": "markers", "name": f"the guide's \u201c{html.escape(o['option'])}\u201d",
                     "x": [x_of(r)], "y": [r["tokens_per_s_per_gpu"]],
                     # (an open symbol is drawn in the marker's colour, its line's width)
                     "marker": {"color": _OPTIONS[i % len(_OPTIONS)], "symbol": "diamond-open", "size": 16,
                                "line": {"width": 2}},
                     "hovertext": [f"the guide's \u201c{html.escape(o['option'])}\u201d at its best<br>"
                                   + _hover(sweep, r)], "hoverinfo": "text"})
    mine = rows.get(own)
    if mine is not None and mine["status"] == "ok":
        data.append({"type": "scatter", "mode": "markers", "name": "the scenario's plan",
                     "x": [x_of(mine)], "y": [mine["tokens_per_s_per_gpu"]],
                     "marker": {"color": _OWN, "symbol": "star-open", "size": 18, "line": {"width": 2}},
                     "hovertext": ["the scenario's plan<br>" + _hover(sweep, mine)], "hoverinfo": "text"})
    ys = [r["tokens_per_s_per_gpu"] for r in ranked] or [0.0]
    marked = frozenset([own, *(o["best"] for o in sweep.get("options", []) if o["best"] is not None)])
    # the best plans that fit labelled, and the plans faster than all of them that do not fit
    # (which plan is the fast point past the capacity line?)
    fit = [r for r in ranked if r["fits"]]
    top = fit[0]["tokens_per_s_per_gpu"] if fit else -1.0
    faster = [r for r in ranked if not r["fits"] and r["tokens_per_s_per_gpu"] > top]
    notes_text = _point_labels(fit[:LABELLED] + faster[:LABELLED], x_of, end / GiB, max(ys) - min(ys), marked)
    shapes = [{"type": "line", "xref": "x", "x0": c / GiB, "x1": c / GiB, "yref": "paper", "y0": 0, "y1": 1,
               "line": {"color": "#cf222e", "dash": "dash", "width": 1.5}} for c in caps if c <= end]
    notes_text += [{"x": c / GiB, "xanchor": "left", "xshift": 4, "yref": "paper", "y": 1, "yanchor": "top",
                    "showarrow": False, "text": f"capacity {c / GiB:.0f} GiB", "font": {"color": "#cf222e", "size": 11},
                    "bgcolor": "rgba(255,255,255,0.85)"} for c in caps if c <= end]
    return {"data": data, "layout": small_layout(
        480, shapes=shapes, annotations=notes_text, hovermode="closest",
        xaxis={"title": {"text": "peak memory per GPU (GiB)" + (
            f"; past {end / GiB:,.0f} GiB drawn at the edge" if max(peaks, default=0.0) > end else "")},
            "range": [0, end / GiB * 1.02]},
        yaxis={"title": {"text": "tokens/s per GPU"}})}


def _point_labels(named: list[dict[str, Any]], x_of, x_span: float, y_span: float,
                  marked: frozenset[int] = frozenset()) -> list[dict[str, Any]]:
    """"#7" beside each of the ``named`` points, on its right, or on its left where a label
    already stands close by, or above where both sides are taken; twice as far from the plans
    ``marked`` with a larger symbol (the scenario's star, an option's diamond)."""
    out: list[dict[str, Any]] = []
    taken: list[tuple[float, float, str]] = []
    for r in named:
        x, y = x_of(r), r["tokens_per_s_per_gpu"]
        near = {side for tx, ty, side in taken
                if abs(tx - x) < 0.06 * (x_span or 1.0) and abs(ty - y) < 0.05 * (y_span or abs(y) or 1.0)}
        side = next((s for s in ("right", "left", "above") if s not in near), "above")
        taken.append((x, y, side))
        gap = 12 if r["plan"] in marked else 6
        place = {"right": {"xanchor": "left", "xshift": gap}, "left": {"xanchor": "right", "xshift": -gap},
                 "above": {"xanchor": "center", "yanchor": "bottom", "yshift": gap}}[side]
        out.append({"x": x, "y": y, "text": f"#{r['plan']}", "showarrow": False, "font": {"size": 11}, **place})
    return out


def _numeric(values: list[Any]) -> bool:
    return len(values) > 1 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def lines_figure(sweep: dict[str, Any], most: int = LINES_SHOWN) -> tuple[str, dict[str, Any]] | None:
    """tokens/s per GPU against the first varied key whose values are numbers (GPUs a node,
    nodes, a bandwidth, a degree), one line per combination of the other varied keys (the
    ``most`` whose best plan that fits gives the most tokens/s per GPU, then those where none
    fits, by their best), plans that do not fit drawn hollow: how the plan
    scales along that key (flat over ``cluster.nodes`` is linear scaling). (the key, the
    figure), or None where no varied key is numeric or nothing was simulated."""
    key = next((k for k, v in sweep["vary"].items() if _numeric(v)), None)
    rows = {r["plan"]: r for r in sweep["plans"]}
    done = [rows[n] for n in sweep["ranking"]]
    if key is None or not done:
        return None
    # (paired values, ``sweep --zip``: one line through them all)
    others = [] if sweep.get("paired") else [k for k in sweep["vary"] if k != key]
    lines: dict[tuple, list[dict[str, Any]]] = {}
    for r in done:
        lines.setdefault(tuple(cell_text(r["changes"].get(k)) for k in others), []).append(r)

    def rank(g: tuple) -> tuple[bool, float]:
        # (a sweep of 1,536 plans of Llama-2 70B drew 12 lines of ZeRO-3 plans without
        # recompute, none of whose plans fits, above every line that does)
        fit = [r["tokens_per_s_per_gpu"] for r in lines[g] if r["fits"]]
        return not fit, -max(fit or [r["tokens_per_s_per_gpu"] for r in lines[g]])

    best = sorted(lines, key=rank)[:most]
    heads = column_heads(others)
    colours = white_template()["layout"]["colorway"]
    data = []
    for i, g in enumerate(best):
        pts = sorted(lines[g], key=lambda r: r["changes"][key])
        name = html.escape(" ".join(f"{h}={v}" for h, v in zip(heads, g))) or "tokens/s per GPU"
        colour = colours[i % len(colours)]
        dash = _DASHES[i // len(colours) % len(_DASHES)]
        data.append({"type": "scatter", "mode": "lines+markers", "name": name, "legendgroup": name,
                     "x": [r["changes"][key] for r in pts], "y": [r["tokens_per_s_per_gpu"] for r in pts],
                     "line": {"color": colour, "dash": dash}, "marker": {"size": 8, "color": colour},
                     "hovertext": [_hover(sweep, r) for r in pts], "hoverinfo": "text"})
        # the plans that do not fit, hollow over their filled points: the legend draws a line's
        # marker as its first point's, which an array of symbols would make hollow for the whole
        # line where only its first plan does not fit
        unfit = [r for r in pts if not r["fits"]]
        if unfit:
            data.append({"type": "scatter", "mode": "markers", "name": name, "legendgroup": name,
                         "showlegend": False, "x": [r["changes"][key] for r in unfit],
                         "y": [r["tokens_per_s_per_gpu"] for r in unfit],
                         "marker": {"size": 8, "color": "white", "line": {"color": colour, "width": 2}},
                         "hovertext": [_hover(sweep, r) for r in unfit], "hoverinfo": "text"})
    if any(not r["fits"] for g in best for r in lines[g]):
        # the legend names the lines by colour; a hollow marker is of no line's, so an entry of
        # its own, drawing no point, says what it means where the eye looks for it
        data.append({"type": "scatter", "mode": "markers", "name": "does not fit (hollow)", "x": [None],
                     "y": [None], "showlegend": True, "hoverinfo": "skip",
                     "marker": {"size": 8, "color": "white", "line": {"color": _UNFIT_LEGEND, "width": 2}}})
    layout = small_layout(420, hovermode="closest", xaxis={"title": {"text": key},
                                                           "tickvals": sorted(set(sweep["vary"][key]))},
                          yaxis={"title": {"text": "tokens/s per GPU"}})
    if len(best) > 1:
        # the lines in the legend's order are ranked, not sorted by value (pp=4, pp=1, pp=2 read as a slip)
        layout["legend"] = {**layout["legend"], "title": {"text": "best first:"}}
    return key, {"data": data, "layout": layout}


def split_figure(sweep: dict[str, Any], shown: int = SPLIT_SHOWN) -> dict[str, Any] | None:
    """Where a GPU's step goes for the best ``shown`` plans, best on top: one bar each, stacked
    compute | exposed communication | bubble (the step split of docs/metrics.md), so a bar is
    as long as its plan's step; None when no plan was simulated."""
    rows = {r["plan"]: r for r in sweep["plans"]}
    best = [rows[n] for n in sweep["ranking"][:shown]]
    if not best:
        return None
    # (escaped: plotly draws a category's tags, and a swept value is the user's text)
    names = [html.escape(f"#{r['plan']} {plan_text(sweep, r)}" + ("" if r["fits"] else " (does not fit)"))
             for r in best]
    return parts_figure(names, [{"compute_s": r["compute_s"], "exposed_comm_s": r["exposed_comm_s"]["total"],
                                 "bubble_s": r["bubble_s"], "step_time_s": r["step_time_s"]} for r in best], 24)


def _best_changes(sweep: dict[str, Any], most: int,
                  base: dict[str, Any] | None = None) -> list[tuple[int, list[tuple[str, Any]]]]:
    """The best ``most`` plans that fit, each with those of its changes that change the
    scenario as validated, its topology's fields included (an advice sets every key it
    searched: ``parallel.sp: null`` where the file leaves SP at its default changes nothing;
    ``cluster.node.nic.bw_Gbps=400`` on a topology of 400 neither); a plan left as the
    scenario is has none. ``base``: :func:`scenario_config`, worked out where not given."""
    from ..overrides import load_variant
    from .compare import effective_config

    path = sweep["scenario"]
    base = scenario_config(sweep) if base is None else base
    rows = {r["plan"]: r for r in sweep["plans"]}
    out = []
    for n in (n for n in sweep["ranking"] if rows[n]["fits"]):
        changes = list(rows[n]["changes"].items())
        cfg = effective_config(load_variant(path, changes))
        out.append((n, [(k, v) for k, v in changes if value_at(cfg, k) != value_at(base, k)]))
        if len(out) == most:
            break
    return out


def _shell_word(text: str) -> str:
    """``text`` as one word of a shell command: as it is where nothing in it needs quoting, in
    double quotes where that keeps it as it is, else as :func:`shlex.quote` quotes it."""
    if text and shlex.quote(text) == text:
        return text
    if not any(c in text for c in '"$`\\!'):
        return f'"{text}"'
    return shlex.quote(text)


def compare_command(sweep: dict[str, Any], most: int = COMPARED, best: list | None = None) -> str | None:
    """The ``compare`` command that puts the best plans that fit (at most ``most``) beside the
    scenario as its file has it, each as a variant; None when none fits but the file's own.
    ``best``: :func:`_best_changes` of ``most + 1`` plans or more, worked out where not given."""
    best = _best_changes(sweep, most + 1) if best is None else best
    best = [changes for _, changes in best if changes][:most]
    if not best:
        return None
    words = ["python", "-m", "clustersim", "compare", sweep["scenario"]]
    for changes in best:
        words += ["--variant", changes_text(changes)]
    return " ".join(map(_shell_word, words)) + " --out out/compare_best"


def run_command(sweep: dict[str, Any], best: list | None = None) -> str | None:
    """The ``run`` command of the best plan that fits (its report and trace file); None when
    none fits. ``best``: :func:`_best_changes`, worked out where not given."""
    best = _best_changes(sweep, 1) if best is None else best
    if not best:
        return None
    n, changes = best[0]
    words = ["python", "-m", "clustersim", "run", sweep["scenario"]] + (
        ["--set", changes_text(changes)] if changes else [])
    return " ".join(map(_shell_word, words)) + f" --out out/best_plan_{n}"


def _table_html(sweep: dict[str, Any], own: int | None) -> str:
    """Every simulated plan, best first, in the terminal's columns (plans that do not fit greyed)."""
    rows = {r["plan"]: r for r in sweep["plans"]}
    shown = [rows[n] for n in sweep["ranking"][:TABLE_ROWS]]
    cols = table_columns(sweep, shown)
    notes = _notes(sweep, own)
    notes = notes if any(notes.values()) else None
    more = {r["plan"]: also_set(sweep, r) for r in shown}
    with_more = any(more.values())  # (once: a row per plan, up to TABLE_ROWS of them)
    e = html.escape
    heads = "".join(f"<th>{e(h)}</th>" for h, _ in cols) + ('<th class="l">note</th>' if notes is not None else "") + (
        '<th class="l">also set</th>' if with_more else "")
    body = []
    for r in shown:
        n = r["plan"]
        cells = "".join(f"<td>{e(f(r))}</td>" for _, f in cols)
        if notes is not None:
            cells += f'<td class="l">{e(notes.get(n, ""))}</td>'
        if with_more:
            cells += f'<td class="l"><code>{e(more[n])}</code></td>'
        grey = "" if r["fits"] else ' class="nofit"'
        body.append(f"<tr{grey}>{cells}</tr>")
    left = len(sweep["ranking"]) - TABLE_ROWS
    tail = f'<p class="note">... and {left:,} more in the CSV.</p>' if left > 0 else ""
    legend = " ".join(x.strip() for x in estimate_legend(shown))
    tail += f'<p class="note">{e(legend)}.</p>' if legend else ""
    return (f"<h2>Every plan simulated, best first</h2><div class=\"wide\"><table><tr>{heads}</tr>{''.join(body)}"
            f"</table></div>{tail}"
            "<p class=\"note\">Best first: the plans that fit by tokens/s, then those that do not (greyed: the step "
            "they would take if they fit).</p>")


def _left_out_html(sweep: dict[str, Any], status: str) -> str:
    """The plans not simulated: refused by a rule, (``unfit``) certain not to fit, or
    (``failed``) whose worker process was killed."""
    left = [r for r in sweep["plans"] if r["status"] == status]
    if not left:
        return ""
    e = html.escape
    rows = "".join(f'<tr><td>{r["plan"]}</td><td class="l">{e(plan_text(sweep, r))}</td>'
                   f'<td class="l wide">{e(r["reason"])}</td></tr>' for r in left[:TABLE_ROWS])
    more = f'<p class="note">... and {len(left) - TABLE_ROWS:,} more in the JSON.</p>' if len(left) > TABLE_ROWS else ""
    if status == "unfit":
        head, col = f"Certain not to fit in memory, not simulated: {len(left):,} of {len(sweep['plans']):,}", "why"
        why = UNFIT_WHY.replace("exceed it", "exceed the GPU's memory")
        more += f'<p class="note">Their {e(why)}: no simulation could make them fit.</p>'
    elif status == "failed":
        head, col = f"Ended without a result: {len(left):,} of {len(sweep['plans']):,}", "why"
    else:
        head, col = f"Refused by the scenario's rules: {len(left):,} of {len(sweep['plans']):,}", "rule"
    return (f"<h2>{head}</h2>"
            f'<div class="wide"><table><tr><th>plan #</th><th class="l">plan</th><th class="l wide">{col}</th></tr>{rows}'
            f'</table></div>{more}')


def plans_html(sweep: dict[str, Any], terminal: str, what: str) -> str:
    """The page of a sweep or an advice (``what``: "sweep" or "advise"; ``sweep``: what
    sweep.json or advise.json holds; ``terminal``: what the command printed)."""
    e = html.escape
    title = f"clustersim · {what} {sweep['scenario']}"
    body = [f"<h1>{e(title)}</h1>", f'<pre class="terminal">{e(terminal)}</pre>']
    base = scenario_config(sweep)  # (the scenario loaded once for the page)
    own = own_plan(sweep, base)
    rows = {r["plan"]: r for r in sweep["plans"]}
    fitting = [n for n in sweep["ranking"] if rows[n]["fits"]]
    if sweep["ranking"] and not fitting:
        low = min((rows[n] for n in sweep["ranking"]), key=lambda r: r["peak_bytes"])
        body.append(f'<p class="nofit">None of the {len(sweep["ranking"]):,} plans simulated fits in '
                    f'{low["capacity_bytes"] / GiB:.0f} GiB: the lowest peak is #{low["plan"]}\'s, '
                    f'{low["peak_bytes"] / GiB:.1f} GiB. Their steps are what they would take if they fit.</p>')
    unfit = [r for r in sweep["plans"] if r["status"] == "unfit"]
    if not sweep["ranking"] and unfit:
        low = min(unfit, key=lambda r: r["floor_bytes"])
        body.append(f'<p class="nofit">None of the {len(unfit):,} plans can fit in '
                    f'{low["capacity_bytes"] / GiB:.0f} GiB, so none was simulated: the lowest memory floor is '
                    f'#{low["plan"]}\'s, {low["floor_bytes"] / GiB:.1f} GiB.</p>')
    if sweep["ranking"]:
        body += ["<h2>Tokens/s per GPU against peak memory</h2>",
                 plot_div(scatter_figure(sweep, own), SCATTER_DIV_ID, _CONFIG),
                 "<p class=\"note\">One point per plan simulated; hover for its plan and figures. "
                 + ("The best plan is the highest point left of the capacity line" if fitting else
                    "No plan fits: every point is right of the capacity line")
                 + (": the diamonds mark each of the guide's options at its best plan, the star the scenario's own"
                    if "options" in sweep else "; the star is the scenario as its file has it"
                    if own is not None else "") + ".</p>"]
        lines = lines_figure(sweep) if "options" not in sweep else None  # (an advice searches too many keys)
        if lines is not None:
            key, fig = lines
            several = sum(d["mode"] == "lines+markers" for d in fig["data"]) > 1  # (lines_figure's own count)
            body += [f"<h2>Tokens/s per GPU against {html.escape(key)}</h2>", plot_div(fig, LINES_DIV_ID, _CONFIG),
                     "<p class=\"note\">"
                     + (f"One line per setting of the other keys varied (at most {LINES_SHOWN}: those whose best "
                        "plan that fits gives the most tokens/s per GPU, then those where none fits); " if several
                        else "")
                     + ("hollow: the plan does not fit" if several else "Hollow: the plan does not fit")
                     + ("; a plan certain not to fit was not simulated and leaves a gap" if unfit else "")
                     + (". Flat is linear scaling: the same throughput per GPU on more nodes.</p>"
                        if key == "cluster.nodes" else
                        f". Flat is the same throughput per GPU whatever <code>{html.escape(key)}</code>.</p>")]
        split = split_figure(sweep)
        shown = [rows[n] for n in sweep["ranking"][:SPLIT_SHOWN]]
        body += [f"<h2>Where a GPU's step goes, the best {len(shown)}"
                 + (" (those that fit first)" if not all(r["fits"] for r in shown) else "") + "</h2>",
                 plot_div(split, SPLIT_DIV_ID, _CONFIG),
                 "<p class=\"note\">Per GPU, the mean over GPUs: compute, the communication the compute stream "
                 "waited for, and the bubble (idle) add up to the step.</p>"]
    best = _best_changes(sweep, COMPARED + 1, base)  # (each loaded once for both commands)
    cmd, run = compare_command(sweep, best=best), run_command(sweep, best=best)
    if cmd is not None or run is not None:
        body.append("<h2>Next</h2>")
    if run is not None:
        body += ["<p class=\"note\">The best plan that fits, run on its own (its report and trace file):</p>",
                 f'<code class="cmd">{e(run)}</code>']
    if cmd is not None:
        body += ["<p class=\"note\">The scenario as its file has it beside the best plans that fit (itself aside): "
                 "their timelines, memory and exposed communication on one page (out/compare_best/compare.html):</p>",
                 f'<code class="cmd">{e(cmd)}</code>']
    body += [_table_html(sweep, own) if sweep["ranking"] else "", _left_out_html(sweep, "unfit"),
             _left_out_html(sweep, "refused"), _left_out_html(sweep, "failed")]
    return ('<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{e(title)}</title>\n<style>{REPORT_CSS}{_PAGE_CSS}</style>\n</head>\n<body>\n"
            + plotlyjs_script() + "\n" + "\n".join(x for x in body if x) + "\n</body>\n</html>\n")
