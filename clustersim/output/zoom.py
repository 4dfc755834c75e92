"""The report timeline's op-by-op layer: zoomed in far enough, each span is drawn inside the
merged bars.

The timeline draws merged bars (a microbatch's consecutive spans of one phase on one stream)
or runs of bins, so that a whole step draws in seconds; zooming in on them alone showed the
same bars, wider. The page also carries every drawn span (start, duration, form,
microbatch) in its own script, and once the view holds at most :data:`DETAIL_IN_VIEW` of them
(the x range and the rows shown), draws those spans, one thin SVG rectangle each, over the
merged bars::

    full view      |██████████ F mb 3 ████████████|████ B mb 1 ████|      merged bars
    zoomed in      |██████████████████████████████|█████████████████|
                   | ▆▆ ▆▆▆▆▆▆ ▆▆ ▆▆▆▆▆▆▆ ▆ ▆▆▆▆▆ | ▆▆▆ ▆▆▆▆ ▆▆▆▆▆▆ |      + one bar a span

A span's hover names it (``F attn``, its microbatch and layer, start, duration, bytes or
FLOPs), as Perfetto does with trace.json.gz. Zoomed out again, the spans' rectangles go. A
zoom costs what plotly's own redraw does (GPT-3's binned timeline: 0.2 s with or without the
spans; as plotly traces they took it to 0.9-1.6 s, and a Megatron-1T page to 2-4 s).

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
from collections.abc import Callable
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
# a span's fill, its colour a little darker: over a busy merged bar of the same colour, the
# spans stand out by more than their outlines
FILL_SHARE = 0.82


def _b64(a: np.ndarray, dtype: str) -> str:
    """``a`` as little-endian ``dtype`` bytes, base64: what the page decodes into a typed array."""
    return base64.b64encode(np.ascontiguousarray(a, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()).decode("ascii")


def detail_data(trace: Trace, order: SpanOrder, labels: list[str], groups: Callable[[str, str], str],
                extra_text: Callable[[float, float], str]) -> dict[str, Any] | None:
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


# The page's side (plain JavaScript, no library but plotly.js): decode the arrays once; on every
# draw of the figure (load, zoom, pan, reset, resize) and legend click, pick the spans in view
# and write them as SVG rectangles into a group of their own inside the plot's layer, after its
# bars (so under the critical path, and clipped and dragged with the plot). Plotly itself is not
# asked to draw them: a trace added or removed re-lays out every bar of the figure, 2-4 s a zoom
# on a 30,000-bar timeline, where the rectangles take milliseconds. Their hover is the page's
# own: on a move over the plot, the span under the pointer (its row, its time, 2 px of slack for
# the thinnest) is found among those drawn and shown in a box, plotly's hover label hidden
# meanwhile.
_SCRIPT = """(function(){
const gd=document.getElementById(%(div)s),D=%(data)s,COL=%(colours)s,FILL=%(fills)s,EDGE=%(edges)s,W=%(width)s;
if(!gd||!window.Plotly||!gd.on)return;
function dec(s,T){const b=atob(s),u=new Uint8Array(b.length);for(let i=0;i<b.length;i++)u[i]=b.charCodeAt(i);return new T(u.buffer);}
const st=dec(D.start_ms,Float64Array),du=dec(D.dur_ms,Float32Array),fo=dec(D.form,Int32Array),mb=dec(D.mb,Int32Array);
const B=D.bounds,nRows=B.length-1;let drawn=[],tip=null;
function first(lo,hi,x){while(lo<hi){const m=(lo+hi)>>1;if(st[m]<x)lo=m+1;else hi=m;}return lo;}
function ms(x){return x.toLocaleString('en-US',{minimumFractionDigits:3,maximumFractionDigits:3});}
function hidden(){const h={};gd.data.forEach(function(t){if(t.legendgroup&&t.visible==='legendonly')h[t.legendgroup]=1;});return h;}
function picked(hid){const L=gd._fullLayout,xr=L.xaxis.range,yr=L.yaxis.range;
 const a=Math.min(xr[0],xr[1]),b=Math.max(xr[0],xr[1]);
 const r0=Math.max(0,Math.ceil(Math.min(yr[0],yr[1])-0.5)),r1=Math.min(nRows-1,Math.floor(Math.max(yr[0],yr[1])+0.5));
 const out=[];
 for(let r=r0;r<=r1;r++){const hi=first(B[r],B[r+1],b);
  for(let i=first(B[r],hi,a-D.max_dur_ms[r]);i<hi;i++){if(st[i]+du[i]>=a&&!hid[D.forms[fo[i]][1]]){
   out.push([i,r]);if(out.length>D.in_view)return null;}}}
 return out;}
function text(i,r){const f=D.forms[fo[i]];let w=D.labels[r];if(mb[i]>=0)w+=' \\u00b7 microbatch '+mb[i];if(f[2]>=0)w+=' \\u00b7 layer '+f[2];
 return '<b>'+f[0]+'</b><br>'+w+'<br>start '+ms(st[i])+' ms \\u00b7 duration '+ms(du[i])+' ms'+(f[3]?'<br>'+f[3]:'');}
function layer(){const bars=gd.querySelector('.cartesianlayer .subplot.xy .barlayer');if(!bars)return null;
 const plot=bars.parentNode;let g=plot.querySelector(':scope > g.clustersim-spans');
 if(!g){g=document.createElementNS('http://www.w3.org/2000/svg','g');g.setAttribute('class','clustersim-spans');}
 // right over the bars, on every draw: plotly puts its layers back in its own order on a zoom
 if(bars.nextSibling!==g)plot.insertBefore(g,bars.nextSibling);
 return g;}
function draw(){const g=layer();if(!g)return;hide();
 const L=gd._fullLayout,xa=L.xaxis,ya=L.yaxis,hid=hidden(),p=picked(hid),w=xa._length,h=Math.abs(ya.l2p(1)-ya.l2p(0))*W;
 let out='';drawn=[];
 if(p)p.forEach(function(ir){const i=ir[0],f=D.forms[fo[i]];
  const x0=Math.max(xa.l2p(st[i]),-1),x1=Math.min(xa.l2p(st[i]+du[i]),w+1),y=ya.l2p(ir[1])-h/2;
  out+='<rect x="'+x0.toFixed(2)+'" y="'+y.toFixed(2)+'" width="'+Math.max(x1-x0,0.5).toFixed(2)+'" height="'+h.toFixed(2)
   +'" fill="'+FILL[f[1]]+'" stroke="'+EDGE[f[1]]+'" stroke-width="0.5"></rect>';drawn.push(ir);});
 // where the carried spans end (past DETAIL_MAX_SPANS): a dashed line, named at the foot of the plot (the
 // critical path runs along the top rows), where it is in view
 const u=D.until_ms===null?null:xa.l2p(D.until_ms);
 if(p&&u!==null&&u>=0&&u<=w)out+='<line x1="'+u.toFixed(2)+'" x2="'+u.toFixed(2)+'" y1="0" y2="'+ya._length
  +'" stroke="#57606a" stroke-width="1" stroke-dasharray="4 3"></line><text x="'+(u<w/2?u+5:u-5).toFixed(2)
  +'" y="'+(ya._length-5)+'" text-anchor="'+(u<w/2?'start':'end')+'" font-size="11" fill="#57606a" stroke="#ffffff" '
  +'stroke-width="3" paint-order="stroke">'+(u<w/2?'\\u2190 ':'')+'spans carried up to here'+(u<w/2?'':' \\u2192')+'</text>';
 g.innerHTML=out;}
function hide(){if(tip&&tip.style.display!=='none'){tip.style.display='none';const hl=gd.querySelector('.hoverlayer');if(hl)hl.style.visibility='';}}
function hover(e){const area=drawn.length&&gd.querySelector('.nsewdrag');if(!area){hide();return;}
 const R=area.getBoundingClientRect(),L=gd._fullLayout,xa=L.xaxis,ya=L.yaxis;
 // (a pointer's coordinates are a pixel's left edge: its centre is half a pixel on)
 const px=e.clientX-R.left+0.5,py=e.clientY-R.top+0.5;
 const y=ya.p2l(py),r=Math.round(y),x=xa.p2l(px),slack=Math.abs(xa.p2l(2)-xa.p2l(0));
 let best=null,gap=Infinity;
 if(px>=0&&px<=R.width&&Math.abs(y-r)<=W/2)drawn.forEach(function(ir){const i=ir[0];if(ir[1]!==r)return;
  const d=x<st[i]?st[i]-x:x>st[i]+du[i]?x-st[i]-du[i]:0;if(d<=slack&&d<gap){gap=d;best=ir;}});
 if(!best){hide();return;}
 if(!tip){tip=document.createElement('div');tip.className='clustersim-span-tip';document.body.appendChild(tip);
  tip.style.cssText='position:fixed;z-index:1000;pointer-events:none;background:#fff;border:1px solid #888;'
   +'border-radius:3px;padding:4px 7px;font:12px system-ui,-apple-system,Segoe UI,Roboto,Helvetica,Arial,sans-serif;'
   +'color:#222;box-shadow:0 1px 4px rgba(0,0,0,.2);white-space:nowrap';}
 tip.innerHTML=text(best[0],best[1]);tip.style.borderColor=COL[D.forms[fo[best[0]]][1]];
 tip.style.display='block';
 // beside the pointer, on the side the window has room for (as plotly's own labels flip)
 const tw=tip.offsetWidth,th=tip.offsetHeight,vw=document.documentElement.clientWidth,vh=window.innerHeight;
 tip.style.left=(e.clientX+14+tw<=vw?e.clientX+14:Math.max(0,e.clientX-14-tw))+'px';
 tip.style.top=(e.clientY+14+th<=vh?e.clientY+14:Math.max(0,e.clientY-14-th))+'px';
 const hl=gd.querySelector('.hoverlayer');if(hl)hl.style.visibility='hidden';}
gd.on('plotly_afterplot',draw);gd.on('plotly_relayout',draw);gd.on('plotly_restyle',draw);
gd.addEventListener('mousemove',hover);gd.addEventListener('mouseleave',hide);
draw();
})();"""


def darker(colour: str, share: float = EDGE_SHARE) -> str:
    """'#rrggbb' with each channel scaled by ``share``: '#4e79a7' -> '#2f4964'."""
    rgb = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(c * share):02x}" for c in rgb)


def detail_script(div_id: str, data: dict[str, Any], colours: dict[str, str]) -> str:
    """The <script> that draws the spans in view over the timeline ``div_id`` (see the module
    docstring); ``colours``: each legend group's colour ('#rrggbb')."""
    edges = {g: darker(c) for g, c in colours.items()}
    fills = {g: darker(c, FILL_SHARE) for g, c in colours.items()}
    body = _SCRIPT % {"div": json.dumps(div_id), "data": json.dumps(data, separators=(",", ":")),
                      "colours": json.dumps(colours, separators=(",", ":")),
                      "fills": json.dumps(fills, separators=(",", ":")),
                      "edges": json.dumps(edges, separators=(",", ":")), "width": DETAIL_WIDTH_ROWS}
    # (the data's texts are escaped HTML and JSON; "</" would still end the script element)
    return "<script>" + body.replace("</", "<\\/") + "</script>"
