"""Perfetto / chrome://tracing export: the trace as Chrome trace event format JSON.

One process per simulated rank, one thread per stream, one complete ("X") event per span,
and the stage's memory as a counter (:func:`memory_counter_events`)::

    stage 0 · rank 0 · stands for 64 GPUs (0-63) · pid 1
        memory GiB    a counter: the stage's memory over the step
        compute       [F attn][F mlp][F attn] ...   tid 1001
        tp                    [AR]        [AR]      tid 1002
        pp_fwd_send                          [send] tid 1006
    stage 1 · rank 64 · stands for 64 GPUs (64-127) · pid 65
        compute   ...

Receives that overlap (DualPipe's from both neighbours) go on extra threads of their stream,
``pp_fwd_recv #2``..., one lane each (:func:`lanes`): Perfetto drops an event that overlaps
another on its thread. A collective's span names its group and algorithm in its args, a
send's and a receive's their peer (``SpanForm.comm_args``), and after the spans a flow
(an arrow in Perfetto) goes from each PP send to its receive (:func:`flow_events`).
Times are microseconds (the format's unit), quantised to whole nanoseconds so that spans that
touch in the simulation still touch after Perfetto converts them to integer nanoseconds (a
rounding overlap of 1 ns would make it nest one span inside the other).
The summary's memory counters end the events, and its headline numbers go into the top-level
``metadata`` object after them: the spans are written and compressed from the trace alone, in
pieces that compress on their own (:class:`TracePieces`), and the summary is needed only for
the file's last bytes (:func:`trace_tail`; clustersim.output.background writes the pieces
while the summary is worked out, and shares them out between two processes).

:func:`trace_document` spells the document out as Python objects, plainly (the tests hold
the writer to it); :func:`write_trace` writes the same text without building them (a
1T-parameter step has ~900k spans): the spans sorted once (:func:`span_order`), times
converted as arrays, and each event put together from pieces, most of them made once per
span form (:class:`clustersim.trace.SpanForm`)::

    head   {"name":"F attn","cat":"compute","ph":"X","ts":    cached
    ts     12.5                                               whole µs, then a cached fraction
    dur    ,"dur":3.25                                        the same
    ids    ,"pid":1,"tid":1001                                one per row
    mb     ,"args":{"mb":0                                    when the span has a microbatch
    tail   ,"layer":3}}                                       cached with the head (a
                                                              collective's group and
                                                              algorithm too: per form)
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import compress, pairwise, repeat
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np

from ..trace import RECV_STREAMS, Span, SpanForm, Trace, form_text, gpu_ranges, index_ranges, stable_argsort

# Streams in the order a reader scans a rank: the work, then what feeds it, then the tail.
KNOWN_STREAMS = ("compute", "tp", "cp", "ep", "pp_fwd_recv", "pp_fwd_send", "pp_bwd_recv",
                 "pp_bwd_send", "zero", "dp", "d2h", "host", "h2d")
# Streams not listed above sort by the family their name starts with, then by name.
_DIGITS = re.compile(r"(\d+)")
_FAMILY_ORDER = ("compute", "tp", "cp", "ep", "pp", "zero", "dp")
# Thread ids: pid * _TID_STRIDE + stream id, unique across processes (Perfetto keys threads
# by tid first, as Linux tids are system-wide).
_TID_STRIDE = 1000
_UNKNOWN_STREAM_ID = 100
# zlib's level where ISA-L is missing: as small as zlib's default (6) in a third of its time
ZLIB_LEVEL = 3
# a process label lists the GPUs its rank stands for up to about this many characters (a
# class split around a straggler can hold hundreds of scattered GPUs)
LABEL_GPUS_CHARS = 160
# and its name (Perfetto's track title, cut to the panel's width) up to about this many
NAME_GPUS_CHARS = 40
try:
    # ISA-L's deflate (the isal package, a dependency where it has wheels: pyproject.toml):
    # Megatron-1T's 156 MB of JSON into 13.5 MB in 0.12 s at its level 1, against 13.6 MB in
    # 0.61 s for zlib at level 3 (moe_1024gpu: 6.2 MB into 0.59 MB, 0.006 s against 0.026 s).
    # The same deflate format: any gzip reader opens the file, and the text is the same. Not
    # always the same bytes, which ISA-L does not promise: of 1,000 processes compressing one
    # trace's six pieces alike, 3 made one piece 1-3 bytes longer (other matches, valid: the
    # same text); zlib's bytes are the same every time. A file's text is what stays the same.
    from isal import isal_zlib as _deflate

    GZIP_LEVEL = 1  # ISA-L's levels are 0-3: 2 packs 0.1 % smaller in 5 % more time, 3 larger in 3x
except ImportError:  # elsewhere zlib
    _deflate = zlib
    GZIP_LEVEL = ZLIB_LEVEL


def stream_sort_key(stream: str) -> tuple[int, int, tuple]:
    """Sort key for streams: compute, tp, cp, ep, pp_* (fwd before bwd, recv before send),
    zero (parameter gathers: ZeRO-3's, ZeRO-1/2's overlapped), dp; numbers in names by value
    (``dp_replica_2`` before ``dp_replica_13``)."""
    family = stream.split("_", 1)[0]
    fam = _FAMILY_ORDER.index(family) if family in _FAMILY_ORDER else len(_FAMILY_ORDER)
    known = KNOWN_STREAMS.index(stream) if stream in KNOWN_STREAMS else len(KNOWN_STREAMS)
    return fam, known, tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in _DIGITS.split(stream) if t)


def rank_order(trace: Trace) -> list[int]:
    """Simulated ranks by pipeline stage, then rank id."""
    return sorted(trace.ranks, key=lambda r: (trace.stage_of.get(r, 0), r))


class Codes(dict):
    """value -> 0, 1, 2, ... in order of first appearance."""

    def __missing__(self, key: Any) -> int:
        code = self[key] = len(self)
        return code


def _row_of_spans(trace: Trace) -> tuple[dict[int, list[str]], list[tuple[int, str]], np.ndarray]:
    """The streams of each rank in display order, the rows (rank, stream) in display order,
    and each span's row (``len(rows)`` for a rank outside ``trace.ranks``).

    Rows are found as numbers, ``rank * n_streams + stream code``, one np.unique for all
    spans: a tuple and a dict look-up per span would take twice as long.
    """
    base = trace.current_base()
    if base is not None:  # read by the engine already
        stream, rank, names = base.stream.astype(np.int64), base.rank, base.stream_names
    else:
        spans = trace.spans
        n = len(spans)
        form, forms = trace.forms()
        stream, names = form_text(forms, form, "stream")
        stream = stream.astype(np.int64)
        rank = np.fromiter(map(attrgetter("rank"), spans), dtype=np.int64, count=n)
    n_streams = max(len(names), 1)
    used, span_used = _distinct_inverse(rank * n_streams + stream)
    seen: dict[int, set[str]] = {r: set() for r in trace.ranks}
    for key in used.tolist():  # a few hundred distinct rows, however many spans
        seen.setdefault(key // n_streams, set()).add(names[key % n_streams])
    by_rank = {r: sorted(seen[r], key=stream_sort_key) for r in rank_order(trace)}
    rows = [(r, st) for r, sts in by_rank.items() for st in sts]
    display = {row: i for i, row in enumerate(rows)}
    row_of_used = np.array([display.get((key // n_streams, names[key % n_streams]), len(rows))
                            for key in used.tolist()], dtype=np.int64)
    return by_rank, rows, row_of_used[span_used.reshape(-1)]


def _distinct_inverse(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(keys, return_inverse=True)`` of non-negative ints: by a table of the values
    present where they are no more than a few per key (a 1T-parameter step's 918,852 (rank,
    stream) numbers below 30,000: 5 ms where the sort took 45), else by numpy's sort."""
    top = int(keys.max()) if len(keys) else -1
    if len(keys) and int(keys.min()) >= 0 and top < 4 * len(keys) + 65_536:
        present = np.zeros(top + 1, dtype=bool)
        present[keys] = True
        rank_of = np.cumsum(present) - 1  # a present value's place among them
        return np.flatnonzero(present), rank_of[keys]
    used, inverse = np.unique(keys, return_inverse=True)
    return used, inverse.reshape(-1)


def streams_by_rank(trace: Trace) -> dict[int, list[str]]:
    """The streams each rank used, in display order (ranks without spans get none)."""
    seen: dict[int, set[str]] = {r: set() for r in trace.ranks}
    for s in trace.spans:
        seen.setdefault(s.rank, set()).add(s.stream)
    return {r: sorted(seen[r], key=stream_sort_key) for r in rank_order(trace)}


def is_receive(stream: str) -> bool:
    """A receive stream (trace.RECV_STREAMS): the sender's transfers as they arrive, from both
    neighbours under DualPipe, so they may overlap; every other stream's spans follow one
    another (the stream-overlap check holds them to it)."""
    return stream in RECV_STREAMS


def _lasts(s: Span) -> bool:
    """Whether ``s`` lasts some time in whole nanoseconds: the trace file leaves out those
    that do not (:func:`_drawn`)."""
    return _ns(s.end_s) != _ns(s.start_s)


def lanes(start_ns: Sequence[int], end_ns: Sequence[int]) -> list[int]:
    """Lanes for spans sorted by start, so that none overlaps or nests in another on its
    lane: each goes to the first lane free by its start (Perfetto drops a complete event
    that overlaps another on its thread, and draws one inside another as its child)::

        spans  [a------]  [c---]         lanes  0: [a------][c---]
                  [b------]                     1:    [b------]
    """
    free_ns: list[int] = []  # per lane, where its last span ends
    out = []
    for t0, t1 in zip(start_ns, end_ns):
        for k, f in enumerate(free_ns):
            if f <= t0:
                break
        else:
            k = len(free_ns)
            free_ns.append(t1)
        free_ns[k] = t1
        out.append(k)
    return out


def lane_stream(stream: str, lane: int) -> str:
    """The thread of ``stream``'s lane: ``pp_fwd_recv``, ``pp_fwd_recv #2``, ..."""
    return stream if lane == 0 else f"{stream} #{lane + 1}"


def _span_threads(trace: Trace) -> tuple[dict[int, list[str]], list[str]]:
    """The threads each rank's spans go on (:func:`streams_by_rank` with the receive
    streams' extra lanes after their first, see :func:`lanes`) and each span's thread, in
    the trace's span order."""
    thread = [s.stream for s in trace.spans]
    per_row: dict[tuple[int, str], list[int]] = {}
    for i, s in enumerate(trace.spans):
        if is_receive(s.stream) and _lasts(s):
            per_row.setdefault((s.rank, s.stream), []).append(i)
    extra: dict[tuple[int, str], int] = {}
    for (rank, stream), idx in per_row.items():
        idx.sort(key=lambda i: (trace.spans[i].start_s, trace.spans[i].end_s))
        lane = lanes([_ns(trace.spans[i].start_s) for i in idx], [_ns(trace.spans[i].end_s) for i in idx])
        for i, k in zip(idx, lane):
            thread[i] = lane_stream(stream, k)
        extra[rank, stream] = max(lane)
    rows = {r: [lane_stream(st, k) for st in sts for k in range(extra.get((r, st), 0) + 1)]
            for r, sts in streams_by_rank(trace).items()}
    return rows, thread


@dataclass(frozen=True)
class SpanOrder:
    """The spans in display order: by row (rank in :func:`rank_order`, then stream), then by
    start and end; ties keep the trace's order. Row ``i`` holds display positions
    ``bounds[i]`` to ``bounds[i + 1]``; ``index_array`` maps display position -> position in
    ``trace.spans``::

        rows         (0, compute)        (0, tp)      (48, compute) ...
        index_array  3 0 7 9 12 ...   |  1 4 8 ..  |  2 5 6 ...
        bounds       0                8           12             18
    """

    rows: list[tuple[int, str]]
    by_rank: dict[int, list[str]]  # as streams_by_rank
    index_array: np.ndarray  # int64
    bounds: list[int]
    start_s: np.ndarray  # float64, in display order
    end_s: np.ndarray
    last_end_s: float  # the latest end of any span, 0.0 without spans: Trace.end_s

    def take_array(self, values: np.ndarray) -> np.ndarray:
        """``values``, one per span in the trace's order, in display order."""
        return values[self.index_array]


def span_order(trace: Trace) -> SpanOrder:
    """Sort the trace's spans once into display order (see :class:`SpanOrder`): rows as
    :func:`streams_by_rank` lists them, each row in the order ``sorted(row's spans,
    key=(start_s, end_s))`` gives; spans of a rank outside ``trace.ranks`` are left out.

    Remembered on the trace while its span list, ranks and stages stay the same (the report
    and the trace file both draw the spans in this order; a 1T-parameter step takes 0.5 s to
    sort). Spans changed in place afterwards are not seen until ``trace.spans_edited()``."""
    spans = trace.span_rows()
    key = (id(spans), len(spans), tuple(trace.ranks), tuple(trace.stage_of.items()))
    kept = trace._display_order
    if kept is not None and kept[0] == key and kept[1] is spans:
        return kept[2]
    order = _span_order(trace)
    trace._display_order = (key, spans, order)
    return order


def _span_order(trace: Trace) -> SpanOrder:
    n = trace.n_spans
    by_rank, rows, row = _row_of_spans(trace)
    base = trace.current_base()
    if base is not None:
        start, end = base.start_s, base.end_s
    else:
        spans = trace.spans
        start = np.fromiter(map(attrgetter("start_s"), spans), dtype=np.float64, count=n)
        end = np.fromiter(map(attrgetter("end_s"), spans), dtype=np.float64, count=n)
    order = stable_argsort(row)
    bounds = np.searchsorted(row[order], np.arange(len(rows) + 1)).tolist()
    for lo, hi in pairwise(bounds):  # row by row: 3x faster than one lexsort of all spans
        in_row = order[lo:hi]
        order[lo:hi] = in_row[np.lexsort((end[in_row], start[in_row]))]  # by start, then end; stable
    kept = order[:bounds[-1]]
    return SpanOrder(rows=rows, by_rank=by_rank, index_array=kept, bounds=bounds,
                     start_s=start[kept], end_s=end[kept], last_end_s=float(end.max()) if n else 0.0)


def stream_ids(streams: list[str]) -> dict[str, int]:
    """Stable small ids: a known stream keeps its place in KNOWN_STREAMS whatever the trace."""
    unknown = sorted((s for s in set(streams) if s not in KNOWN_STREAMS), key=stream_sort_key)
    ids = {s: KNOWN_STREAMS.index(s) + 1 for s in set(streams) if s in KNOWN_STREAMS}
    ids.update({s: _UNKNOWN_STREAM_ID + i for i, s in enumerate(unknown)})
    return ids


def pid_of(rank: int) -> int:
    """Process id of a rank; +1 because Perfetto treats pid 0 as the idle (swapper) process."""
    return rank + 1


def _ns(t_s: float) -> int:
    return round(t_s * 1e9)


def _us(t_ns: int) -> float | int:
    """Nanoseconds as microseconds, written as an int when whole (shorter, same value)."""
    return t_ns // 1000 if t_ns % 1000 == 0 else t_ns / 1000


def _ns_array(t_s: np.ndarray) -> np.ndarray:
    """:func:`_ns` of each element: the same product, rounded half to even as ``round`` does."""
    if not np.isfinite(t_s).all():
        raise ValueError("a span starts or ends at a time that is not finite")
    return np.rint(t_s * 1e9).astype(np.int64)


def _us_list(t_ns: np.ndarray) -> list[float | int]:
    """:func:`_us` of each element, as Python numbers (they print as json.dumps prints them)."""
    out = (t_ns / 1000).tolist()  # exact int -> float below 2**53 ns (104 days), as in Python
    whole = np.flatnonzero(t_ns % 1000 == 0)
    for i, v in zip(whole.tolist(), (t_ns[whole] // 1000).tolist()):
        out[i] = v
    return out


# "." and the digits after it of n / 1000 for n % 1000 in 1..999, trailing zeros dropped
_FRACTION_US = ("",) + tuple("." + f"{r:03d}".rstrip("0") for r in range(1, 1000))
# Below 2**42 µs (51 days) doubles lie closer together than 0.001, so the shortest decimal that
# reads back as n / 1000 is n / 1000 exactly: its repr is the integer digits and _FRACTION_US.
_EXACT_US_BELOW_NS = 2**42 * 1000


def _us_digits(t_ns: np.ndarray) -> tuple[list[int | str], list[int]]:
    """``str(_us(n))`` of each element, as json.dumps writes it (``12``, ``12.5``, ``0.001``),
    in two parts to be written one after the other: whole µs and an index into _FRACTION_US.
    Outside the exact range, the whole text and index 0 ("")."""
    if t_ns.size and (t_ns.min() < 0 or t_ns.max() >= _EXACT_US_BELOW_NS):
        return list(map(str, _us_list(t_ns))), [0] * t_ns.size
    return (t_ns // 1000).tolist(), (t_ns % 1000).tolist()


def _number(x: float) -> float | int:
    """Whole floats as ints: byte and FLOP counts read better as 50331648 than 50331648.0."""
    return int(x) if float(x).is_integer() else x


def file_op(stream: str, op: str) -> str:
    """The op a span's arguments give: ``recv`` for a receive (:func:`is_receive`), which
    the engine records with its send's op, ``send``, else the span's own."""
    return "recv" if op == "send" and is_receive(stream) else op


def _detail_args(layer: int, phase: str, size_bytes: float, op: str, flops: float,
                 model_flops: float, comm_args: tuple = ()) -> dict[str, Any]:
    """The span's details after its microbatch, leaving out those that carry no information;
    ``op`` as the file gives it (:func:`file_op`), then what the engine says of the
    communication (``SpanForm.comm_args``: a collective's ``group``, ``group_size`` and
    ``algorithm``, a send's or a receive's ``peer_stage`` and ``peer_rank``).
    ``model_flops`` goes wherever ``flops`` does, 0 included (a recomputed forward: executed,
    not model work), so that a compute span that works has both counts (docs/metrics.md)."""
    args: dict[str, Any] = {}
    if layer >= 0:
        args["layer"] = layer
    if phase:
        args["phase"] = phase
    if size_bytes:
        args["bytes"] = _number(size_bytes)
    if op:
        args["op"] = op
    args.update(comm_args)
    if flops:
        args["flops"] = _number(flops)
    if flops or model_flops:
        args["model_flops"] = _number(model_flops)
    return args


def span_args(s: Span) -> dict[str, Any]:
    """The span's details, leaving out fields that carry no information (-1, 0, empty)."""
    args: dict[str, Any] = {"mb": s.mb} if s.mb >= 0 else {}
    args.update(_detail_args(s.layer, s.phase, s.size_bytes, file_op(s.stream, s.op), s.flops, s.model_flops,
                             s.comm_args))
    return args


def span_event(s: Span, pid: int, tid: int) -> dict[str, Any]:
    """One complete ("X") event; ts/dur in whole nanoseconds, written in microseconds."""
    start_ns, end_ns = _ns(s.start_s), _ns(s.end_s)
    ev: dict[str, Any] = {"name": s.name, "cat": s.kind, "ph": "X", "ts": _us(start_ns),
                          "dur": _us(end_ns - start_ns), "pid": pid, "tid": tid}
    args = span_args(s)
    if args:
        ev["args"] = args
    return ev


def process_name(trace: Trace, rank: int, gpus_of: dict[int, list[int]] | None) -> str:
    """The name of ``rank``'s process: its stage and rank, the GPUs it stands for where the
    trace is collapsed, and ``pid`` last, since Perfetto writes the process id after the name
    (``stage 1 · rank 16 17`` reads as two ranks; ``... · pid 17`` does not)::

        stage 0 · rank 0 · stands for 128 GPUs (0-127) · pid
        stage 0 · rank 5 · stands for 1 GPU (5) · pid              a slow GPU's rank, split off
        stage 0 · rank 3 · pid                                      every rank simulated

    Perfetto's JSON importer reads no other metadata of a process than its name and sort
    index: the ``process_labels`` event is for chrome://tracing, which shows them. ``gpus_of``:
    ``trace.gpus_of()``, passed in so that it is worked out once for every process."""
    name = f"stage {trace.stage_of.get(rank, 0)} · rank {rank}"
    if _collapsed(trace, rank, gpus_of):
        weight = trace.weight.get(rank, 1)
        which = ""
        if gpus_of:  # the list shorter than the label's; the count is said already
            text = gpu_ranges(gpus_of[rank], NAME_GPUS_CHARS)
            which = f" ({text.removesuffix(f' ({len(set(gpus_of[rank])):,} GPUs)')})"
        name += f" · stands for {weight} GPU{'s' if weight != 1 else ''}{which}"
    return name + " · pid"


def _collapsed(trace: Trace, rank: int, gpus_of: dict[int, list[int]] | None) -> bool:
    """Whether ``rank``'s process stands for GPUs besides its own (or, in a trace where some
    rank does, for its own alone: then every process says whom)."""
    return trace.weight.get(rank, 1) > 1 or bool(gpus_of and len(gpus_of) < len(trace.rep))


def _metadata_events(trace: Trace, rows: dict[int, list[str]],
                     tids: dict[tuple[int, str], int]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    gpus_of = trace.gpus_of()
    for order, rank in enumerate(rows):
        pid = pid_of(rank)
        name = process_name(trace, rank, gpus_of)
        out.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": order}})
        weight = trace.weight.get(rank, 1)
        if _collapsed(trace, rank, gpus_of):  # collapsed: every rank says whom
            s = "s" if weight != 1 else ""
            # which GPUs: a twin's row is its simulated rank's (summary.json has every GPU's,
            # simulation.simulated_rank_of_gpu, where the label stops short)
            which = f": GPU{s} {gpu_ranges(gpus_of[rank], LABEL_GPUS_CHARS)}" if gpus_of else ""
            out.append({"name": "process_labels", "ph": "M", "pid": pid,
                        "args": {"labels": f"stands for {weight} GPU{s}{which}"}})
        elif trace.spans_of and trace.spans_of.get(rank, rank) != rank:  # run --trace-gpus: a twin's row
            out.append({"name": "process_labels", "ph": "M", "pid": pid,
                        "args": {"labels": f"the spans of simulated rank {trace.spans_of[rank]}"}})
        for st in rows[rank]:
            tid = tids[rank, st]
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": st}})
            # a lane sorts with its stream's first, just after it (Perfetto breaks ties by tid)
            out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                        "args": {"sort_index": tids[rank, st.split(" #", 1)[0]] % _TID_STRIDE}})
    return out


def metadata_events(trace: Trace) -> list[dict[str, Any]]:
    """process_name / thread_name and their sort indices, so the UI lists ranks by stage."""
    rows = _span_threads(trace)[0]
    return _metadata_events(trace, rows, _thread_ids(rows))


def _thread_ids(rows: dict[int, list[str]]) -> dict[tuple[int, str], int]:
    ids = stream_ids([st for sts in rows.values() for st in sts])
    return {(r, st): pid_of(r) * _TID_STRIDE + ids[st] for r, sts in rows.items() for st in sts}


def thread_ids(trace: Trace) -> dict[tuple[int, str], int]:
    """(rank, thread) -> tid, in display order: a thread per stream, and per extra lane of a
    receive stream (:func:`lanes`)."""
    return _thread_ids(_span_threads(trace)[0])


def span_events(trace: Trace) -> list[dict[str, Any]]:
    """The spans that last some time as X events (:func:`_drawn`), sorted by process, stream
    and time (stable, so deterministic), each on its thread (its stream's, or its lane's:
    :func:`lanes`)."""
    rows, thread = _span_threads(trace)
    tids = _thread_ids(rows)
    row = {key: i for i, key in enumerate(tids)}  # display position of each thread
    order = sorted((i for i, s in enumerate(trace.spans) if _lasts(s)),
                   key=lambda i: (row[trace.spans[i].rank, trace.spans[i].stream], trace.spans[i].start_s,
                                  trace.spans[i].end_s))
    return [span_event(trace.spans[i], pid_of(trace.spans[i].rank), tids[trace.spans[i].rank, thread[i]])
            for i in order]


def flow_events(trace: Trace) -> list[dict[str, Any]]:
    """An arrow from each PP send to its receive, as Chrome trace flow events: a flow start
    (``"ph": "s"``) on the send's thread at its start and a flow end (``"ph": "f"``, ``"bp":
    "e"``: bound to the slice enclosing it, the receive, rather than the next one to begin)
    on the receive's thread (its lane's, :func:`lanes`) at the receive's start. Both are
    named and categorised as the send is (Perfetto pairs the two by id, category and name)
    and the id is the send's task id, which its receive shares (``Span.tid``): every flow
    once, the same ids every time, in id order, each flow's start just before its end (the
    end repeats most of the start's text, which the compression then takes for a reference).

    A pair needs both spans drawn (:func:`_drawn`) on processes that are the simulated ranks
    themselves: a GPU's process under ``run --trace-gpus`` that holds another rank's spans
    gets none, as its real peer is not in the trace (nor is a span without a task id, or a
    task id held by more than one send or receive).

    Why flow events after every span, and not ``bind_id`` with ``flow_out``/``flow_in`` on the
    X events themselves (which Perfetto's JSON importer reads too, without extra events):
    Perfetto binds a flow to a slice as it reads the events sorted by time, events of one
    time longest first and then in file order, and drops a flow end read before its start. A
    receive starts and ends with its send, and a gradient's receiver (the previous stage)
    comes first in the file: every backward flow would be dropped. A flow event of one time
    sorts after every X event of that time, and each start is written before its end."""
    rows, thread = _span_threads(trace)
    tids = _thread_ids(rows)
    procs = processes(trace)
    sends: dict[int, list[int]] = {}
    recvs: dict[int, list[int]] = {}
    for i, s in enumerate(trace.spans):
        if s.op == "send" and s.tid >= 0 and _lasts(s) and procs.get(s.rank) == s.rank:
            (recvs if is_receive(s.stream) else sends).setdefault(s.tid, []).append(i)
    ids = sorted(t for t, at in sends.items() if len(at) == 1 and len(recvs.get(t, ())) == 1)

    def event(flow_id: int, ph: str, i: int) -> dict[str, Any]:
        send, s = trace.spans[sends[flow_id][0]], trace.spans[i]
        ev: dict[str, Any] = {"name": send.name, "cat": send.kind, "ph": ph}
        if ph == "f":
            ev["bp"] = "e"
        ev.update(id=flow_id, ts=_us(_ns(s.start_s)), pid=pid_of(s.rank), tid=tids[s.rank, thread[i]])
        return ev

    return [e for t in ids for e in (event(t, "s", sends[t][0]), event(t, "f", recvs[t][0]))]


@dataclass(frozen=True)
class FlowPairs:
    """The trace file's flows (:func:`flow_events`) in id order: each one's id, and the
    display positions (in the order of the drawn spans, :func:`_drawn`) of its send and its
    receive."""

    ids: np.ndarray  # int64, ascending
    send: np.ndarray  # int64
    recv: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)


def flow_pairs(trace: Trace) -> FlowPairs:
    """The trace file's flows (:class:`FlowPairs`), remembered on the trace with the display
    order they are of: worked out before the writer's fork (:func:`piece_count`) and read by
    both processes (:class:`TracePieces`)."""
    order = span_order(trace)
    kept = trace._flows
    if kept is not None and kept[0] is order:
        return kept[1]
    pairs = _flow_pairs(trace, _drawn(order))
    trace._flows = (order, pairs)
    return pairs


def _flow_pairs(trace: Trace, order: SpanOrder) -> FlowPairs:
    """:func:`flow_pairs` of the drawn spans ``order``, by arrays: the sends and receives
    found by their forms (a few thousand) on the rows of their streams (a few hundred), then
    paired by task id."""
    none = np.zeros(0, dtype=np.int64)
    codes, forms = trace.forms()
    sends = np.fromiter((f.op == "send" for f in forms), bool, len(forms))
    streams = {f.stream for f in compress(forms, sends.tolist())}
    procs = processes(trace)
    bounds = order.bounds
    # the rows of the streams sends and receives are on, of processes that are simulated ranks
    rows = [k for k, (rank, stream) in enumerate(order.rows) if stream in streams and procs.get(rank) == rank]
    if not rows:
        return FlowPairs(none, none, none)
    lo = np.array([bounds[k] for k in rows], dtype=np.int64)
    at = index_ranges(np.stack([lo, np.array([bounds[k + 1] for k in rows], dtype=np.int64)], axis=1).ravel(),
                      np.arange(0, 2 * len(rows), 2))  # their display positions
    span = order.index_array[at]
    code = codes[span]
    at, span, code = at[sends[code]], span[sends[code]], code[sends[code]]
    b = trace.current_base()
    if b is not None:
        tid = b.tid[span]
    else:
        spans = trace.spans
        tid = np.fromiter((spans[i].tid for i in span.tolist()), np.int64, len(span))
    known = tid >= 0
    at, tid, code = at[known], tid[known], code[known]
    recv = np.fromiter((is_receive(f.stream) for f in forms), bool, len(forms))[code]
    send_ids, send_at = _held_once(tid[~recv], at[~recv])
    recv_ids, recv_at = _held_once(tid[recv], at[recv])
    k = np.minimum(np.searchsorted(recv_ids, send_ids), max(len(recv_ids) - 1, 0))
    paired = np.flatnonzero(recv_ids[k] == send_ids) if len(recv_ids) else none
    return FlowPairs(send_ids[paired], send_at[paired], recv_at[k[paired]])


def _held_once(ids: np.ndarray, at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ids that occur once in ``ids`` (non-negative), ascending, and the ``at`` of each
    (sorted by radix, :func:`stable_argsort`: np.unique's sort took 7 ms on Megatron-1T's
    64,512 sends)."""
    order = stable_argsort(ids)
    ordered = ids[order]
    starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1]))) if len(ids) else order[:0]
    once = starts[np.diff(np.append(starts, len(ids))) == 1]
    return ordered[once], at[order[once]]


_HEADLINE_KEYS = ("scenario", "description", "world_size", "step_time_s", "tokens_per_s",
                  "tokens_per_s_per_gpu", "tflops_per_gpu", "hw_tflops_per_gpu", "mfu", "hfu",
                  "bubble_fraction", "exposed_comm_s", "hidden_comm_s", "plan")


def trace_metadata(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary's headline numbers (missing keys are skipped, not invented)."""
    meta: dict[str, Any] = {"generator": "clustersim"}
    meta.update({k: summary[k] for k in _HEADLINE_KEYS if k in summary})
    mem = summary.get("memory")
    if mem:
        meta["memory_peak_bytes"] = mem.get("peak_bytes")
        meta["memory_capacity_bytes"] = mem.get("capacity_bytes")
        meta["memory_fits"] = mem.get("fits")
    if "simulation" in summary:  # but the map of every GPU (summary.json has it): a number per GPU
        meta["simulation"] = {k: v for k, v in summary["simulation"].items() if k != "simulated_rank_of_gpu"}
    return meta


# GiB in a byte: the memory counter's unit, as the report's and the terminal's memory figures
_GIB_PER_BYTE = 1 / 2**30


def processes(trace: Trace) -> dict[int, int]:
    """Each process's rank, in display order -> the simulated rank whose spans it holds: itself,
    or in a trace of some GPUs (``Trace.for_gpus``, ``run --trace-gpus``) the rank that stands
    for that GPU."""
    spans_of = trace.spans_of or {}
    return {r: spans_of.get(r, r) for r in rank_order(trace)}


def memory_counter_events(summary: dict[str, Any], procs: dict[int, int] | None = None) -> list[dict[str, Any]]:
    """The summary's memory timelines (``memory.stages[].timeline``) as counter ("C") events,
    ``memory`` with one series, ``GiB``, which Perfetto shows as the process's track
    ``memory GiB``: from each sample's time, what the stage's GPU holds as its peak counts it,
    params + grads + optimizer + transient + activations + communication buffers +
    recomputing (the counter's highest value is the stage's ``peak_bytes``).

    A stage's timeline is one simulated rank's (``memory.stages[].rank``, its busiest): it goes
    on that rank's process, or with ``procs`` (:func:`processes`) on every process holding that
    rank's spans (none where the trace has no such process). Without ``procs`` the processes
    are the simulated ranks, as in the trace of every simulated rank; either way stage by
    stage, each process's samples in time order. Each has a tid of its own, ``pid * 1000`` (no
    stream's): without one Perfetto takes the pid for the tid, and pid 1002 is the tid of
    rank 0's ``tp`` thread."""
    return [{"name": "memory", "ph": "C", "pid": pid, "tid": pid * _TID_STRIDE, "ts": t, "args": {"GiB": v}}
            for pids, ts_us, gib in _memory_series(summary, procs) for pid in pids for t, v in zip(ts_us, gib)]


def _memory_series(summary: dict[str, Any], procs: dict[int, int] | None) -> list[tuple[list[int], list, list]]:
    """Per stage with a timeline, (the pids its counter goes on, the samples' times in µs, the
    GiB held from each): :func:`memory_counter_events`."""
    pids_of: dict[int, list[int]] = {}
    for rank, simulated in (procs or {}).items():
        pids_of.setdefault(simulated, []).append(pid_of(rank))
    out = []
    for st in (summary.get("memory") or {}).get("stages") or ():
        tl = st.get("timeline")
        if not tl or not tl.get("t_s") or "rank" not in st:
            continue
        held_bytes = sum(st.get(k, 0.0) for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "transient_bytes"))
        rec = tl.get("recomputing_bytes") or 0.0
        total_bytes = held_bytes + np.asarray(tl["activations_bytes"]) + np.asarray(tl["comm_buffers_bytes"]) + rec
        pids = [pid_of(st["rank"])] if procs is None else pids_of.get(st["rank"], [])
        # to about a KiB (6 decimals of a GiB): 9 digits where a float's repr writes 17
        out.append((pids, _us_list(_ns_array(np.asarray(tl["t_s"], dtype=np.float64))),
                    np.round(total_bytes * _GIB_PER_BYTE, 6).tolist()))
    return out


def _memory_counters_text(summary: dict[str, Any], procs: dict[int, int] | None) -> str:
    """``"," + _dumps(e)`` of each of :func:`memory_counter_events`, joined: each sample's text
    made once for all the processes it goes on (``run --trace-gpus all`` puts one stage's on
    hundreds of GPUs)."""
    out = []
    for pids, ts_us, gib in _memory_series(summary, procs):
        # repr writes a finite float or an int as json.dumps does, without its encoder's set-up
        points = [f'"ts":{t!r},"args":{{"GiB":{v!r}}}}}' for t, v in zip(ts_us, gib)]
        for pid in pids:
            head = f',{{"name":"memory","ph":"C","pid":{pid},"tid":{pid * _TID_STRIDE},'
            out.append(head + head.join(points) if points else "")
    return "".join(out)


def trace_document(trace: Trace, summary: dict[str, Any]) -> dict[str, Any]:
    """The whole JSON object: metadata events first, then spans, then the flows from the PP
    sends to their receives, then the memory counters, then the summary's headline."""
    return {
        "displayTimeUnit": "ms",
        "traceEvents": metadata_events(trace) + span_events(trace) + flow_events(trace)
        + memory_counter_events(summary, processes(trace)),
        "metadata": trace_metadata(summary),
    }


def _dumps(obj: Any) -> str:
    """JSON as the trace file writes it: compact, UTF-8 text, no NaN or infinity."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


class _EventParts(dict):
    """(name, kind, layer, phase, size_bytes, op, flops, model_flops, comm_args) -> the fixed
    text of an event (``op`` as :func:`file_op` gives it)::

        head      {"name":"F attn","cat":"compute","ph":"X","ts":
        after_mb  ,"layer":3}}                  closes args and event; "}}" without details
        no_mb     ,"args":{"layer":3}}          "}" without details

    A step repeats the same few thousand combinations, so each is dumped once.
    """

    def __missing__(self, key: tuple) -> tuple[str, str, str]:
        name, kind, *details = key
        head = f'{{"name":{_dumps(name)},"cat":{_dumps(kind)},"ph":"X","ts":'
        args = _dumps(_detail_args(*details))  # '{"layer":3}' or '{}'
        if args == "{}":
            parts = head, "}}", "}"
        else:
            parts = head, f",{args[1:]}}}", f',"args":{args}}}'
        self[key] = parts
        return parts


def _event_key(form: SpanForm) -> tuple:
    """The key of ``form``'s text in :class:`_EventParts` (read once per form)."""
    return (form.name, form.kind, form.layer, form.phase, form.size_bytes, file_op(form.stream, form.op),
            form.flops, form.model_flops, form.comm_args)


def trace_tail(summary: dict[str, Any], procs: dict[int, int] | None = None) -> str:
    """The text after the last span: the summary's memory counters (on the processes
    ``procs``, :func:`memory_counter_events`), then its headline numbers. Each counter goes on
    a process the file's head names, so the comma before it follows an event; without
    ``procs`` the summary's simulated ranks are taken for the processes, as they are in the
    trace clustersim.output.background writes (that of every simulated rank)."""
    return f'{_memory_counters_text(summary, procs)}],"metadata":{_dumps(trace_metadata(summary))}}}'


# Events per piece of the trace file (:class:`TracePieces`): small enough that two processes
# sharing the pieces out end within a few milliseconds of each other (a piece is about 0.6 MB of
# JSON, 5-10 ms to write and compress), large enough that starting each piece's compression
# afresh costs little (a piece's first 32 KB find no earlier text to refer to: about 1 % more
# bytes on Megatron-1T than one stream).
PIECE_SPANS = 4096


class TracePieces:
    """The trace file's text up to its memory counters, cut into pieces of PIECE_SPANS events
    (the spans in display order, then the flows from the PP sends to their receives, two
    events a flow: :func:`flow_events`), each written and compressed on its own: whichever
    process compresses a piece, its text is the same (and under zlib its bytes: ISA-L need not
    give the same bytes twice, the note at ``_deflate``), so the file depends on the trace
    alone while the pieces are shared out between processes (clustersim.output.background).
    A gzip file of such pieces is one deflate stream::

        gzip header | piece 0          | piece 1   | ... | flows ... | tail           | CRC-32, length
                      head, metadata,    events ...        2048 each   summary's
                      events 0-4095      (sync flush)                  counters and
                      (sync flush)                                     headline
                                                                       (final block)

    A piece ends with a sync flush (its blocks end on a byte, none is final) and refers to no
    earlier piece's text, so the pieces follow one another as they are; the tail ends the
    stream. The CRC-32 of the whole text is put together from the pieces' own
    (:func:`crc32_combine`). The text is what ``_dumps(trace_document(...))`` gives."""

    def __init__(self, trace: Trace):
        order = self.order = _drawn(span_order(trace))
        by_rank, self.lane_ids = dict(order.by_rank), {}
        for row, lane in _receive_lanes(order).items():
            rank, stream = order.rows[row]
            sts = by_rank[rank] = list(by_rank[rank])
            at = sts.index(stream) + 1
            sts[at:at] = [lane_stream(stream, k) for k in range(1, max(lane) + 1)]
            self.lane_ids[row] = lane
        self.tids = _thread_ids(by_rank)
        for row, lane in self.lane_ids.items():
            rank, stream = order.rows[row]
            self.lane_ids[row] = [f',"pid":{pid_of(rank)},"tid":{self.tids[rank, lane_stream(stream, k)]}'
                                  for k in lane]
        codes, forms = trace.forms()
        self.per_form = list(map(_EventParts().__getitem__, map(_event_key, forms)))  # each form's text, once
        self.codes = order.take_array(codes)
        self.mbs = order.take_array(trace.mbs())
        events = [_dumps(e) for e in _metadata_events(trace, by_rank, self.tids)]
        self.head = '{"displayTimeUnit":"ms","traceEvents":[' + ",".join(events)
        self.has_metadata = bool(events)
        self.n_spans = len(order.index_array)
        self.flows = flow_pairs(trace)
        self.span_pieces = _span_pieces(self.n_spans)
        self.count = self.span_pieces + _flow_pieces(len(self.flows))
        # a flow's name and category, its send's, per form (dumped once for each send form)
        self.flow_heads: dict[int, str] = {}
        self.forms = forms
        self.row_ids: list[str] | None = None  # per row, its thread's ids (_ids_at)

    def text(self, k: int) -> str:
        """Piece ``k``'s text: a piece of the spans (:meth:`span_text`), or after those, of
        the flows (:meth:`flow_text`)."""
        return self.span_text(k) if k < self.span_pieces else self.flow_text(k - self.span_pieces)

    def flow_text(self, j: int) -> str:
        """The events of flows ``j * flows_per_piece()`` on (:func:`flow_events`: each flow's
        start, then its end), each after a comma (the spans come before them)."""
        flows, per = self.flows, flows_per_piece()
        lo, hi = j * per, min(len(self.flows), (j + 1) * per)
        if lo >= hi:
            return ""
        sends, recvs = flows.send[lo:hi], flows.recv[lo:hi]
        codes = self.codes[sends].tolist()
        for code in set(codes).difference(self.flow_heads):  # each send form's, once
            self.flow_heads[code] = self._flow_head(code)
        heads = list(map(self.flow_heads.__getitem__, codes))
        s_us, s_frac = _us_digits(_ns_array(self.order.start_s[sends]))
        r_us, r_frac = _us_digits(_ns_array(self.order.start_s[recvs]))
        frac = _FRACTION_US
        return "," + ",".join([
            f'{head}"s","id":{i},"ts":{st}{frac[sf]}{s_ids}}},{head}"f","bp":"e","id":{i},"ts":{rt}{frac[rf]}{r_ids}}}'
            for head, i, st, sf, s_ids, rt, rf, r_ids
            in zip(heads, flows.ids[lo:hi].tolist(), s_us, s_frac, self._ids_at(sends), r_us, r_frac,
                   self._ids_at(recvs))])

    def _flow_head(self, code: int) -> str:
        """``{"name":...,"cat":...,"ph":`` of the flows of a send of form ``code``."""
        form = self.forms[code]
        return f'{{"name":{_dumps(form.name)},"cat":{_dumps(form.kind)},"ph":'

    def _ids_at(self, at: np.ndarray) -> list[str]:
        """``,"pid":P,"tid":T`` of the events at display positions ``at`` (a lane's thread on a
        receive stream with lanes)."""
        order = self.order
        if self.row_ids is None:  # each row's, once (a few hundred)
            self.row_ids = [f',"pid":{pid_of(rank)},"tid":{self.tids[rank, stream]}' for rank, stream in order.rows]
        rows = np.searchsorted(np.asarray(order.bounds), at, side="right") - 1
        out = list(map(self.row_ids.__getitem__, rows.tolist()))
        if self.lane_ids:
            laned = np.flatnonzero(np.isin(rows, list(self.lane_ids)))
            for k, row, pos in zip(laned.tolist(), rows[laned].tolist(), at[laned].tolist()):
                out[k] = self.lane_ids[row][pos - order.bounds[row]]
        return out

    def span_text(self, k: int) -> str:
        """Span piece ``k``'s text: the head with the metadata events first in piece 0, then
        the events of display positions ``k * PIECE_SPANS`` on, each after a comma unless it
        is the first event of all."""
        lo, hi = k * PIECE_SPANS, min(self.n_spans, (k + 1) * PIECE_SPANS)
        out = [self.head] if k == 0 else []
        if hi <= lo:
            return "".join(out)
        if k > 0 or self.has_metadata:
            out.append(",")
        order = self.order
        parts = list(map(self.per_form.__getitem__, self.codes[lo:hi].tolist()))
        mbs = self.mbs[lo:hi].tolist()
        start_ns, end_ns = _ns_array(order.start_s[lo:hi]), _ns_array(order.end_s[lo:hi])
        ts_us, ts_frac = _us_digits(start_ns)
        dur_us, dur_frac = _us_digits(end_ns - start_ns)
        frac, bounds, rows = _FRACTION_US, order.bounds, order.rows
        row = bisect_right(bounds, lo) - 1  # the row of position lo
        lines = []
        while row < len(rows) and bounds[row] < hi:
            rank, stream = rows[row]
            a, b = max(bounds[row], lo) - lo, min(bounds[row + 1], hi) - lo
            if a >= b:  # a row whose spans all last no time (_drawn)
                row += 1
                continue
            lane = self.lane_ids.get(row)
            if lane is None:
                ids_of: Any = repeat(f',"pid":{pid_of(rank)},"tid":{self.tids[rank, stream]}')
            else:  # a receive stream whose spans overlap: each on its lane's thread
                first = bounds[row]
                ids_of = lane[a + lo - first:b + lo - first]
            lines.append(",".join([
                f'{head}{ts}{frac[ts_f]},"dur":{dur}{frac[dur_f]}{ids},"args":{{"mb":{mb}{after_mb}' if mb >= 0
                else f'{head}{ts}{frac[ts_f]},"dur":{dur}{frac[dur_f]}{ids}{no_mb}'
                for (head, after_mb, no_mb), mb, ts, ts_f, dur, dur_f, ids
                in zip(parts[a:b], mbs[a:b], ts_us[a:b], ts_frac[a:b], dur_us[a:b], dur_frac[a:b], ids_of)]))
            row += 1
        out.append(",".join(lines))
        return "".join(out)

    def packed(self, k: int) -> tuple[bytes, int, int]:
        """Piece ``k`` compressed on its own (raw deflate, ending in a sync flush), with the
        CRC-32 and the length of its text's bytes."""
        data = self.text(k).encode("utf-8")
        z = _deflate.compressobj(GZIP_LEVEL, _deflate.DEFLATED, -15)
        return z.compress(data) + z.flush(_deflate.Z_SYNC_FLUSH), _deflate.crc32(data), len(data)


def _receive_lanes(order: SpanOrder) -> dict[int, list[int]]:
    """Per row of a receive stream whose spans overlap (in whole nanoseconds, as the file
    has them), each span's lane (:func:`lanes`), in display order."""
    out = {}
    for row, (_, stream) in enumerate(order.rows):
        lo, hi = order.bounds[row], order.bounds[row + 1]
        if not is_receive(stream) or hi - lo < 2:
            continue
        start_ns, end_ns = _ns_array(order.start_s[lo:hi]), _ns_array(order.end_s[lo:hi])
        if (start_ns[1:] < np.maximum.accumulate(end_ns[:-1])).any():
            out[row] = lanes(start_ns.tolist(), end_ns.tolist())
    return out


def _drawn(order: SpanOrder) -> SpanOrder:
    """``order`` without the spans that last no time in whole nanoseconds, as the file has
    them (the B of the embedding under a split backward, ring steps with no causal work, the
    W of an attention step): Perfetto orders events of one start longest first and draws
    such a span inside the span that starts where it does, as its child. Every row is kept,
    an empty one too (its thread still named)."""
    keep = _ns_array(order.end_s) != _ns_array(order.start_s)
    if keep.all():
        return order
    at = np.flatnonzero(keep)
    return SpanOrder(rows=order.rows, by_rank=order.by_rank, index_array=order.index_array[at],
                     bounds=np.searchsorted(at, order.bounds).tolist(), start_s=order.start_s[at],
                     end_s=order.end_s[at], last_end_s=order.last_end_s)


def piece_count(trace: Trace) -> int:
    """How many pieces :class:`TracePieces` cuts the trace's events into: the spans' (at
    least one: the head), then the flows' (:func:`flow_pairs`, remembered for the pieces)."""
    return _span_pieces(len(_drawn(span_order(trace)).index_array)) + _flow_pieces(len(flow_pairs(trace)))


def _span_pieces(n_spans: int) -> int:
    """The pieces of ``n_spans`` drawn spans (at least one: the head)."""
    return max(1, -(-n_spans // PIECE_SPANS))


def flows_per_piece() -> int:
    """Flows per piece of the trace file: PIECE_SPANS events, two a flow."""
    return max(1, PIECE_SPANS // 2)


def _flow_pieces(n_flows: int) -> int:
    """The pieces of ``n_flows`` flows (:func:`flows_per_piece`)."""
    return -(-n_flows // flows_per_piece())


def gzip_file(packed: list[tuple[bytes, int, int]], tail: str) -> bytes:
    """The gzip file of the pieces ``packed`` (in order, as :meth:`TracePieces.packed` gives
    them) and ``tail``: the header zlib writes (no name, mtime 0), the pieces, the tail
    compressed to the stream's end, the CRC-32 and the length of the whole text (RFC 1952)."""
    data = tail.encode("utf-8")
    z = _deflate.compressobj(GZIP_LEVEL, _deflate.DEFLATED, -15)
    last = z.compress(data) + z.flush(_deflate.Z_FINISH)
    crc, size = 0, 0
    for _, piece_crc, piece_size in packed:
        crc, size = crc32_combine(crc, piece_crc, piece_size), size + piece_size
    crc, size = crc32_combine(crc, _deflate.crc32(data), len(data)), size + len(data)
    return b"".join([_gzip_header(), *(p for p, _, _ in packed), last,
                     struct.pack("<II", crc, size & 0xFFFFFFFF)])


def _gzip_header() -> bytes:
    """The 10 bytes zlib starts a gzip stream with at GZIP_LEVEL (magic, deflate, no flags,
    mtime 0, the level's XFL byte, the system's OS byte). The XFL byte only informs: 4 says
    "fastest" at level 1, which ISA-L's level 1 is too."""
    return zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31).flush()[:10]


# CRC-32 (the gzip polynomial, bits reflected)
_CRC32_POLY = 0xEDB88320


def _mult_mod_poly(a: int, b: int) -> int:
    """a(x) * b(x) mod the CRC-32 polynomial, both as reflected 32-bit words (bit 31 = x^0)."""
    prod, m = 0, 1 << 31
    while a:
        if a & m:
            prod ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _CRC32_POLY if b & 1 else b >> 1
    return prod


# x^(2^k) mod the polynomial, k = 0..31 (x^1 is bit 30 reflected); x^(2^(k+1)) = (x^(2^k))^2
_X_POW2 = [1 << 30]
for _ in range(31):
    _X_POW2.append(_mult_mod_poly(_X_POW2[-1], _X_POW2[-1]))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """``zlib.crc32(a + b)`` from ``crc1 = zlib.crc32(a)``, ``crc2 = zlib.crc32(b)`` and
    ``len2 = len(b)``. A CRC is linear over GF(2): appending ``len2`` bytes multiplies a's
    register by x^(8 len2) modulo the polynomial, and b's CRC adds (XOR) to it; the pre- and
    post-inversion of the register cancel out in the sum (RFC 1952, section 8; the same sum
    as zlib's crc32_combine). x^(8 len2) is a product of the squares x^(2^k), one per bit of
    8 len2: about 35 products in all for a piece, not a pass over its bytes."""
    if len2 <= 0:
        return crc1
    power, n, k = 1 << 31, len2, 3  # x^0; 8 len2 = len2 << 3
    while n:
        if n & 1:
            power = _mult_mod_poly(_X_POW2[k & 31], power)
        n >>= 1
        k += 1
    return _mult_mod_poly(power, crc1) ^ crc2


def prepare_trace(trace: Trace, gz: bool = True) -> Callable[[dict[str, Any]], bytes]:
    """Write (and with ``gz``, compress) every event of the trace file now, from the trace
    alone, piece by piece (:class:`TracePieces`); the function returned takes the summary
    and gives the whole file's bytes."""
    pieces, procs = TracePieces(trace), processes(trace)
    if not gz:
        events = "".join(map(pieces.text, range(pieces.count))).encode("utf-8")
        return lambda summary: events + trace_tail(summary, procs).encode("utf-8")
    packed = list(map(pieces.packed, range(pieces.count)))
    return lambda summary: gzip_file(packed, trace_tail(summary, procs))


def write_trace(path: str | Path, trace: Trace, summary: dict[str, Any]) -> None:
    """Write the trace for Perfetto / chrome://tracing; gzip when ``path`` ends with ``.gz``.

    The text depends only on the inputs, and so do the bytes where zlib compresses (gzip
    header without name or time): two runs of the same scenario give the same text, and under
    zlib identical files; ISA-L's deflate may pick other matches for the same text (the note
    at ``_deflate``). The file is written once it is complete.
    """
    path = Path(path)
    path.write_bytes(prepare_trace(trace, gz=path.name.endswith(".gz"))(summary))
