"""The report timeline's op-by-op layer: zoomed in far enough, each span is drawn inside the
merged bars.

The timeline draws merged bars (a microbatch's consecutive spans of one phase on one stream)
or runs of bins, so that a whole step draws in seconds; zooming in on them alone showed the
same bars, wider. The page also carries every drawn span (start, duration, form,
microbatch) in its own script, and once the view holds at most :data:`DETAIL_IN_VIEW` of them
(the x range and the rows shown), draws those spans, one thin bar each, over the merged
bars::

    full view      |██████████ F mb 3 ████████████|████ B mb 1 ████|      merged bars
    zoomed in      |██████████████████████████████|█████████████████|
                   | ▆▆ ▆▆▆▆▆▆ ▆▆ ▆▆▆▆▆▆▆ ▆ ▆▆▆▆▆ | ▆▆▆ ▆▆▆▆ ▆▆▆▆▆▆ |      + one bar a span

A span's hover names it (``F attn``, its microbatch and layer, start, duration, bytes or
FLOPs), as Perfetto does with trace.json.gz. Zoomed out again, the spans' bars go.

Each span costs the page 20 bytes before base64 (start float64, duration float32, form and
microbatch int32). Past :data:`DETAIL_MAX_SPANS` drawn spans (GPT-3's step on 1,024 GPUs has
468,904, a 1T-parameter step 918,852) the page carries those that start in the step's first
stretch, the earliest :data:`DETAIL_MAX_SPANS` at most (warm-up and the first steady
microbatches), and its note says how far they go; trace.json.gz has every span.
"""

from __future__ import annotations

import base64
import html
import json
from typing import Any

import numpy as np

from ..trace import Trace
from .perfetto import SpanOrder

DETAIL_MAX_SPANS = 60_000  # drawn spans a page carries at most: 1.6 MB of base64
DETAIL_IN_VIEW = 3_000  # spans drawn one by one at most: a browser redraws that many at once
DETAIL_WIDTH_ROWS = 0.45  # a span's bar, thinner than the merged bar (report.BAR_WIDTH_ROWS) it lies in
# a span's outline, its colour darkened: back-to-back spans show where one ends, and a span
# thinner than the outline still shows in (a darker) colour, not as a gap
EDGE_SHARE = 0.6


def _b64(a: np.ndarray, dtype: str) -> str:
    """``a`` as little-endian ``dtype`` bytes, base64: what the page decodes into a typed array."""
    return base64.b64encode(np.ascontiguousarray(a, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()).decode("ascii")


def detail_data(trace: Trace, order: SpanOrder, labels: list[str], groups: list[str],
                extra_text: Any) -> dict[str, Any] | None:
    """The drawn spans as the page's script reads them (past DETAIL_MAX_SPANS, those that start
    before the earliest start of the rest), or None without spans. ``order``: the drawn rows'
    spans in display order (each row's spans by start, so those carried are each row's
    first); ``labels``: each row's label; ``groups(kind, phase)``: a span's legend group
    key; ``extra_text(size_bytes, flops)``: the hover's last line ('' for none)::

        until_ms                   None where every span is carried, else the start before
                                   which they are; carried, of: how many of how many
        bounds[r] .. bounds[r+1]   row r's spans, by start
        start_ms, dur_ms           per span
        form, mb                   per span: index into forms; microbatch (-1: none)
        forms[i]                   [name (escaped), legend group, layer, extra text]
        max_dur_ms[r]              the longest span of row r: a span that starts before the
                                   view reaches into it only that far
    """
    n = len(order.start_s)
    carried, until_s = np.arange(n), None
    if n > DETAIL_MAX_SPANS:
        until_s = float(np.partition(order.start_s, DETAIL_MAX_SPANS)[DETAIL_MAX_SPANS])
        carried = np.flatnonzero(order.start_s < until_s)  # (ties at until_s all left out: at most the limit)
    if not len(carried):
        return None
    codes, forms = trace.forms()
    form = order.take_array(codes)[carried]
    mb = order.take_array(trace.mbs())[carried]
    start_ms = order.start_s[carried] * 1e3
    dur_ms = (order.end_s[carried] - order.start_s[carried]) * 1e3
    bounds = np.searchsorted(carried, order.bounds).tolist()  # each row's carried spans: its first
    max_dur = [float(dur_ms[lo:hi].max()) if hi > lo else 0.0 for lo, hi in zip(bounds[:-1], bounds[1:])]
    return {
        "until_ms": None if until_s is None else until_s * 1e3, "carried": len(carried), "of": n,
        "bounds": bounds,
        "start_ms": _b64(start_ms, "f8"), "dur_ms": _b64(dur_ms, "f4"),
        "form": _b64(form, "i4"), "mb": _b64(mb, "i4"),
        "forms": [[html.escape(f.name), groups(f.kind, f.phase), int(f.layer), extra_text(f.size_bytes, f.flops)]
                  for f in forms],
        "max_dur_ms": max_dur,
        "labels": [html.escape(label) for label in labels],
        "in_view": DETAIL_IN_VIEW,
    }


# The page's side (plain ES5+ functions, no library but plotly.js): decode the arrays once,
# then on every zoom, pan, reset or legend click pick the spans in view and redraw them as one
# bar trace per legend group, after the figure's own traces (so over its bars and path).
_SCRIPT = """(function(){
const gd=document.getElementById(%(div)s),D=%(data)s,COL=%(colours)s,EDGE=%(edges)s,W=%(width)s;
if(!gd||!window.Plotly||!gd.on)return;
function dec(s,T){const b=atob(s),u=new Uint8Array(b.length);for(let i=0;i<b.length;i++)u[i]=b.charCodeAt(i);return new T(u.buffer);}
const st=dec(D.start_ms,Float64Array),du=dec(D.dur_ms,Float32Array),fo=dec(D.form,Int32Array),mb=dec(D.mb,Int32Array);
const B=D.bounds,nRows=B.length-1;let own=0,busy=false;
function first(lo,hi,x){while(lo<hi){const m=(lo+hi)>>1;if(st[m]<x)lo=m+1;else hi=m;}return lo;}
function ms(x){return x.toLocaleString('en-US',{minimumFractionDigits:3,maximumFractionDigits:3});}
function hidden(){const h={};gd.data.forEach(function(t){if(t.legendgroup&&!t.clustersimDetail&&t.visible==='legendonly')h[t.legendgroup]=1;});return h;}
function picked(){const L=gd._fullLayout,xr=L.xaxis.range,yr=L.yaxis.range;
 const a=Math.min(xr[0],xr[1]),b=Math.max(xr[0],xr[1]);
 const r0=Math.max(0,Math.ceil(Math.min(yr[0],yr[1])-0.5)),r1=Math.min(nRows-1,Math.floor(Math.max(yr[0],yr[1])+0.5));
 const out=[];
 for(let r=r0;r<=r1;r++){const hi=first(B[r],B[r+1],b);
  for(let i=first(B[r],hi,a-D.max_dur_ms[r]);i<hi;i++){if(st[i]+du[i]>=a){out.push(i);if(out.length>D.in_view)return null;}}}
 return out;}
function row(i){let lo=0,hi=nRows;while(hi-lo>1){const m=(lo+hi)>>1;if(B[m]<=i)lo=m;else hi=m;}return lo;}
function hover(i,r){const f=D.forms[fo[i]];let w=D.labels[r];if(mb[i]>=0)w+=' \\u00b7 microbatch '+mb[i];if(f[2]>=0)w+=' \\u00b7 layer '+f[2];
 return '<b>'+f[0]+'</b><br>'+w+'<br>start '+ms(st[i])+' ms \\u00b7 duration '+ms(du[i])+' ms'+(f[3]?'<br>'+f[3]:'');}
function update(){if(busy)return;busy=true;
 try{const p=picked(),hid=hidden(),by={};
  if(p)p.forEach(function(i){const f=D.forms[fo[i]],g=f[1];if(hid[g])return;const r=row(i);
   const t=by[g]||(by[g]={base:[],x:[],y:[],hovertext:[]});t.base.push(st[i]);t.x.push(du[i]);t.y.push(r);t.hovertext.push(hover(i,r));});
  const drop=[];for(let k=gd.data.length-own;k<gd.data.length;k++)drop.push(k);
  if(drop.length)Plotly.deleteTraces(gd,drop);
  const add=Object.keys(by).sort().map(function(g){const t=by[g];return{type:'bar',orientation:'h',base:t.base,x:t.x,y:t.y,
   width:W,hoverinfo:'text',hovertext:t.hovertext,legendgroup:g,showlegend:false,name:g,clustersimDetail:true,
   marker:{color:COL[g],opacity:1,line:{width:0.5,color:EDGE[g]}}};});
  own=add.length;if(add.length)Plotly.addTraces(gd,add);
 }finally{busy=false;}}
gd.on('plotly_relayout',update);gd.on('plotly_restyle',update);
setTimeout(update,0);  // a step of few spans shows them at once, unzoomed
})();"""


def darker(colour: str, share: float = EDGE_SHARE) -> str:
    """'#rrggbb' with each channel scaled by ``share``: '#4e79a7' -> '#2f4964'."""
    rgb = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(c * share):02x}" for c in rgb)


def detail_script(div_id: str, data: dict[str, Any], colours: dict[str, str]) -> str:
    """The <script> that draws the spans in view over the timeline ``div_id`` (see the module
    docstring); ``colours``: each legend group's colour ('#rrggbb')."""
    edges = {g: darker(c) for g, c in colours.items()}
    body = _SCRIPT % {"div": json.dumps(div_id), "data": json.dumps(data, separators=(",", ":")),
                      "colours": json.dumps(colours, separators=(",", ":")),
                      "edges": json.dumps(edges, separators=(",", ":")), "width": DETAIL_WIDTH_ROWS}
    # (the data's texts are escaped HTML and JSON; "</" would still end the script element)
    return "<script>" + body.replace("</", "<\\/") + "</script>"
