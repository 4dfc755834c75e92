"""Perfetto / chrome://tracing export: the trace as Chrome trace event format JSON.

One process per simulated rank, one thread per stream, one complete ("X") event per span::

    stage 0 · rank 0            (pid 1)
        compute       [F attn][F mlp][F attn] ...   tid 1001
        tp                    [AR]        [AR]      tid 1002
        pp_fwd_send                          [send] tid 1006
    stage 1 · rank 64           (pid 65)
        compute   ...

Times are microseconds (the format's unit), quantised to whole nanoseconds so that spans that
touch in the simulation still touch after Perfetto converts them to integer nanoseconds (a
rounding overlap of 1 ns would make it nest one span inside the other).
The summary's headline numbers go into the top-level ``metadata`` object.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from ..trace import Span, Trace

# Streams in the order a reader scans a rank: the work, then what feeds it, then the tail.
KNOWN_STREAMS = ("compute", "tp", "cp", "ep", "pp_fwd_recv", "pp_fwd_send", "pp_bwd_recv",
                 "pp_bwd_send", "zero", "dp")
# Streams not listed above sort by the family their name starts with, then by name.
_FAMILY_ORDER = ("compute", "tp", "cp", "ep", "pp", "zero", "dp")
# Thread ids: pid * _TID_STRIDE + stream id, unique across processes (Perfetto keys threads
# by tid first, as Linux tids are system-wide).
_TID_STRIDE = 1000
_UNKNOWN_STREAM_ID = 100


def stream_sort_key(stream: str) -> tuple[int, int, str]:
    """Sort key for streams: compute, tp, cp, ep, pp_* (fwd before bwd, recv before send),
    zero (ZeRO-3 parameter gathers), dp."""
    family = stream.split("_", 1)[0]
    fam = _FAMILY_ORDER.index(family) if family in _FAMILY_ORDER else len(_FAMILY_ORDER)
    known = KNOWN_STREAMS.index(stream) if stream in KNOWN_STREAMS else len(KNOWN_STREAMS)
    return fam, known, stream


def rank_order(trace: Trace) -> list[int]:
    """Simulated ranks by pipeline stage, then rank id."""
    return sorted(trace.ranks, key=lambda r: (trace.stage_of.get(r, 0), r))


def streams_by_rank(trace: Trace) -> dict[int, list[str]]:
    """The streams each rank used, in display order (ranks without spans get none)."""
    seen: dict[int, set[str]] = {r: set() for r in trace.ranks}
    for s in trace.spans:
        seen.setdefault(s.rank, set()).add(s.stream)
    return {r: sorted(seen[r], key=stream_sort_key) for r in rank_order(trace)}


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


def _number(x: float) -> float | int:
    """Whole floats as ints: byte and FLOP counts read better as 50331648 than 50331648.0."""
    return int(x) if float(x).is_integer() else x


def span_args(s: Span) -> dict[str, Any]:
    """The span's details, leaving out fields that carry no information (-1, 0, empty)."""
    args: dict[str, Any] = {}
    if s.mb >= 0:
        args["mb"] = s.mb
    if s.layer >= 0:
        args["layer"] = s.layer
    if s.phase:
        args["phase"] = s.phase
    if s.size_bytes:
        args["bytes"] = _number(s.size_bytes)
    if s.op:
        args["op"] = s.op
    if s.flops:
        args["flops"] = _number(s.flops)
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


def metadata_events(trace: Trace) -> list[dict[str, Any]]:
    """process_name / thread_name and their sort indices, so the UI lists ranks by stage."""
    rows = streams_by_rank(trace)
    tids = thread_ids(trace)
    out: list[dict[str, Any]] = []
    for order, rank in enumerate(rows):
        pid = pid_of(rank)
        stage = trace.stage_of.get(rank, 0)
        name = f"stage {stage} · rank {rank}"
        out.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": order}})
        weight = trace.weight.get(rank, 1)
        if weight > 1:
            out.append({"name": "process_labels", "ph": "M", "pid": pid,
                        "args": {"labels": f"stands for {weight} GPUs"}})
        for st in rows[rank]:
            tid = tids[rank, st]
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": st}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                        "args": {"sort_index": tid % _TID_STRIDE}})
    return out


def thread_ids(trace: Trace) -> dict[tuple[int, str], int]:
    """(rank, stream) -> tid, in display order."""
    rows = streams_by_rank(trace)
    ids = stream_ids([st for sts in rows.values() for st in sts])
    return {(r, st): pid_of(r) * _TID_STRIDE + ids[st] for r, sts in rows.items() for st in sts}


def span_events(trace: Trace) -> list[dict[str, Any]]:
    """All spans as X events, sorted by process, thread and time (stable, so deterministic)."""
    tids = thread_ids(trace)
    row = {key: i for i, key in enumerate(tids)}  # display position of each thread
    spans = sorted(trace.spans, key=lambda s: (row[s.rank, s.stream], s.start_s, s.end_s))
    return [span_event(s, pid_of(s.rank), tids[s.rank, s.stream]) for s in spans]


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
    if "simulation" in summary:
        meta["simulation"] = summary["simulation"]
    return meta


def trace_document(trace: Trace, summary: dict[str, Any]) -> dict[str, Any]:
    """The whole JSON object: metadata events first, then spans."""
    return {
        "displayTimeUnit": "ms",
        "metadata": trace_metadata(summary),
        "traceEvents": metadata_events(trace) + span_events(trace),
    }


def write_trace(path: str | Path, trace: Trace, summary: dict[str, Any]) -> None:
    """Write the trace for Perfetto / chrome://tracing; gzip when ``path`` ends with ``.gz``.

    The bytes depend only on the inputs (gzip header without name or time), so two runs of
    the same scenario give identical files.
    """
    text = json.dumps(trace_document(trace, summary), separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)
    data = text.encode("utf-8")
    path = Path(path)
    if path.name.endswith(".gz"):
        data = gzip.compress(data, compresslevel=6, mtime=0)
    path.write_bytes(data)
