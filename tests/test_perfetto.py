"""The Perfetto / chrome://tracing export: one X event per span, named processes and threads."""

from __future__ import annotations

import copy
import gzip
import json
import pickle
import random
import re
import zlib
from pathlib import Path

import numpy as np
import pytest
import yaml

import clustersim
from clustersim.output import perfetto
from clustersim.output.perfetto import stream_sort_key, trace_document, write_trace
from clustersim.trace import Span, Trace, gpu_ranges

from .conftest import compressed_alike, file_bytes, scenario_dict

ROOT = Path(__file__).resolve().parent.parent

SMALL = scenario_dict(description="TP4 x PP2 x DP2 on two DGX-A100 nodes")


def _simulate(collapse: bool | None = None) -> clustersim.Result:
    return clustersim.simulate(clustersim.load_scenario(copy.deepcopy(SMALL), base_dir=ROOT), collapse=collapse)


@pytest.fixture(scope="module", params=[None, False], ids=["collapsed", "all-ranks"])
def result(request) -> clustersim.Result:
    return _simulate(request.param)


@pytest.fixture(scope="module")
def doc(result, tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("trace") / "trace.json"
    write_trace(path, result.trace, result.summary)
    return json.loads(path.read_text(encoding="utf-8"))


def _names(doc: dict) -> tuple[dict[int, str], dict[tuple[int, int], str]]:
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"]
               for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    return procs, threads


def _rank_of_pid(doc: dict) -> dict[int, int]:
    procs, _ = _names(doc)
    return {pid: int(re.match(r"stage \d+ · rank (\d+)", name)[1]) for pid, name in procs.items()}


def test_top_level_shape(doc, result):
    assert doc["displayTimeUnit"] == "ms"
    meta = doc["metadata"]
    for key in ("scenario", "step_time_s", "tokens_per_s", "mfu", "hfu", "bubble_fraction", "world_size"):
        assert meta[key] == result.summary[key]
    assert meta["exposed_comm_s"] == result.summary["exposed_comm_s"]
    assert meta["memory_fits"] == result.summary["memory"]["fits"]


def test_every_rank_and_stream_is_named(doc, result):
    trace = result.trace
    procs, threads = _names(doc)
    assert sorted(procs) == sorted(r + 1 for r in trace.ranks)
    assert all(procs[r + 1].startswith(f"stage {trace.stage_of[r]} · rank {r} · ") for r in trace.ranks)
    rank_of = _rank_of_pid(doc)
    named = {(rank_of[pid], stream) for (pid, _), stream in threads.items()}
    assert named == {(s.rank, s.stream) for s in trace.spans}
    assert 0 not in procs  # Perfetto reserves pid 0 for the idle process
    assert len({tid for _, tid in threads}) == len(threads)  # tids unique across processes


def test_each_process_says_which_gpus_it_stands_for(doc, result):
    """Collapsed, a process is labelled with the GPUs its rank stands for, those
    ``simulation.simulated_rank_of_gpu`` maps to it; every rank simulated, none is labelled."""
    labels = {e["pid"]: e["args"]["labels"] for e in doc["traceEvents"] if e["name"] == "process_labels"}
    rep = result.summary["simulation"]["simulated_rank_of_gpu"]
    rank_of = _rank_of_pid(doc)
    if not result.summary["simulation"]["collapse_symmetric"]:
        assert not labels and rep == list(range(len(rep)))
        return
    assert set(labels) == set(rank_of)
    for pid, text in labels.items():
        gpus = [g for g, r in enumerate(rep) if r == rank_of[pid]]
        assert text == f"stands for {len(gpus)} GPUs: GPUs {gpu_ranges(gpus)}"
    # TP4 x PP2 x DP2: each stage is 8 consecutive GPUs, one node
    assert sorted(labels.values()) == ["stands for 8 GPUs: GPUs 0-7", "stands for 8 GPUs: GPUs 8-15"]


def test_each_process_name_says_what_its_rank_stands_for(doc, result):
    """Perfetto's JSON importer reads a process's name and no label, and writes the pid after
    the name: the name says which GPUs the rank stands for, and ends in ``pid`` so that the
    number after it does not read as part of the rank or of its GPUs."""
    procs, _ = _names(doc)
    if result.summary["simulation"]["collapse_symmetric"]:
        assert sorted(procs.values()) == ["stage 0 · rank 0 · stands for 8 GPUs (0-7) · pid",
                                          "stage 1 · rank 8 · stands for 8 GPUs (8-15) · pid"]
    else:  # every rank stands for itself alone
        assert sorted(procs.values()) == sorted(f"stage {r // 8} · rank {r} · pid" for r in range(16))


def test_a_slow_gpus_rank_split_off_is_named_apart():
    # a straggler splits its stage's class: the rank standing for it alone and the rank
    # standing for the others say so in their names, which are all distinct
    d = scenario_dict(cluster={**SMALL["cluster"], "what_if": [{"gpu": 5, "slowdown": 1.2}]})
    r = clustersim.simulate(clustersim.load_scenario(d, base_dir=ROOT))
    names = [e["args"]["name"] for e in trace_document(r.trace, r.summary)["traceEvents"]
             if e["name"] == "process_name"]
    assert len(set(names)) == len(names) == len(r.trace.ranks) > 2
    assert "stage 0 · rank 5 · stands for 1 GPU (5) · pid" in names
    others = [n for n in names if n.startswith("stage 0 ·") and "(5)" not in n]
    gpus = sorted(g for n in others for g in _gpus_said(n))
    assert gpus == [g for g in range(8) if g != 5]


def _gpus_said(name: str) -> list[int]:
    """The GPUs a process name lists in parentheses (``0-4, 6, 7``), each run spelt out."""
    out = []
    for item in re.search(r"\(([^)]*)\)", name)[1].split(", "):
        lo, _, hi = item.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def test_a_long_list_of_gpus_is_cut_short_in_the_name_not_in_the_label():
    # a class of scattered GPUs (a split around several faults): the name stays short, the
    # label (chrome://tracing) keeps its 160 characters
    scattered = [g for g in range(1, 512) if g % 3 and g % 7]
    rep = tuple(1 if g in set(scattered) else 0 for g in range(512))
    trace = Trace(spans=[], ranks=[0, 1], weight={0: 512 - len(scattered), 1: len(scattered)}, stage_of={},
                  rep=rep)
    name = perfetto.process_name(trace, 1, trace.gpus_of())
    assert name.startswith(f"stage 0 · rank 1 · stands for {len(scattered)} GPUs (1, 2, 4, ")
    assert name.endswith(", ...) · pid")
    assert len(name) < 100 and "GPUs)" not in name
    label = next(e["args"]["labels"] for e in trace_document(trace, {})["traceEvents"]
                 if e["name"] == "process_labels" and e["pid"] == 2)
    assert len(label) > 150 and label.endswith(f", ... ({len(scattered)} GPUs)")


@pytest.mark.parametrize("gpus, text", [
    ([], ""), ([5], "5"), ([3, 7], "3, 7"), ([2, 0, 1], "0-2"), ([0, 1, 2, 3, 8, 9, 10, 11], "0-3, 8-11"),
    ([64, 0, 16, 32, 48], "0-64 step 16"), ([0, 1, 2, 3, 4, 5, 7, 9, 11], "0-5, 7-11 step 2"), ([4, 4, 5], "4, 5"),
])
def test_gpu_ranges(gpus, text):
    assert gpu_ranges(gpus) == text


def test_gpu_ranges_stop_at_a_whole_item_and_count_the_gpus():
    gpus = list(range(0, 200, 2)) + list(range(201, 400, 3))
    whole = gpu_ranges(gpus)
    short = gpu_ranges(gpus, max_chars=20)
    assert whole == "0-198 step 2, 201-399 step 3" and gpu_ranges(gpus, max_chars=len(whole)) == whole
    assert short == "0-198 step 2, ... (167 GPUs)"
    assert gpu_ranges([1, 2, 4, 7, 11, 16, 22], max_chars=12) == "1, ... (7 GPUs)"  # the first at least
    assert gpu_ranges([1, 2, 4, 7, 11, 16, 22], max_chars=21) == "1, 2, ... (7 GPUs)"


def test_sort_order_compute_tp_pp_dp(doc, result):
    sort = {(e["pid"], e.get("tid")): e["args"]["sort_index"]
            for e in doc["traceEvents"] if e["ph"] == "M" and e["name"].endswith("sort_index")}
    _, threads = _names(doc)
    for pid in {pid for pid, _ in threads}:
        streams = sorted(((sort[pid, tid], name) for (p, tid), name in threads.items() if p == pid))
        order = [name for _, name in streams]
        assert order[0] == "compute"
        families = [s.split("_")[0] for s in order]
        expected = [f for f in ("compute", "tp", "pp", "dp") if f in families]
        assert sorted(set(families), key=families.index) == expected
    # processes follow the pipeline
    rank_of = _rank_of_pid(doc)
    by_stage = sorted(rank_of, key=lambda pid: sort[pid, None])
    stages = [result.trace.stage_of[rank_of[pid]] for pid in by_stage]
    assert stages == sorted(stages)
    assert stream_sort_key("pp_fwd_recv") < stream_sort_key("pp_bwd_send") < stream_sort_key("dp")


def test_one_complete_event_per_span_with_times_in_us(doc, result):
    rank_of = _rank_of_pid(doc)
    _, threads = _names(doc)
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(result.trace.spans)
    got: dict[tuple[int, str], list[dict]] = {}
    for e in events:
        got.setdefault((rank_of[e["pid"]], threads[e["pid"], e["tid"]]), []).append(e)
    want: dict[tuple[int, str], list] = {}
    for s in result.trace.spans:
        want.setdefault((s.rank, s.stream), []).append(s)
    assert set(got) == set(want)
    for key, spans in want.items():
        spans = sorted(spans, key=lambda s: (s.start_s, s.end_s))
        evs = sorted(got[key], key=lambda e: (e["ts"], e["dur"]))
        for s, e in zip(spans, evs):
            assert e["name"] == s.name and e["cat"] == s.kind
            # whole nanoseconds: within 1 ns of the span, in microseconds
            assert e["ts"] == pytest.approx(s.start_s * 1e6, abs=1e-3)
            assert e["dur"] == pytest.approx(s.dur_s * 1e6, abs=1e-3)
            args = e.get("args", {})
            assert args.get("mb", -1) == s.mb
            assert args.get("layer", -1) == s.layer
            assert args.get("phase", "") == s.phase
            assert args.get("bytes", 0) == s.size_bytes
            assert args.get("flops", 0) == s.flops
            # both FLOP counts where the span does work (docs/metrics.md)
            assert args.get("model_flops", 0) == s.model_flops
            assert ("model_flops" in args) == bool(s.flops or s.model_flops)
            # a receive's op is "recv", where the engine records its send's
            assert args.get("op", "") == ("recv" if s.stream in ("pp_fwd_recv", "pp_bwd_recv") else s.op)
            # absent, not a placeholder: no -1 microbatch or layer, no 0 bytes or FLOPs, no ""
            assert args.get("mb") != -1 and args.get("layer") != -1 and args.get("phase") != ""
            assert args.get("bytes") != 0 and args.get("flops") != 0


def test_model_flops_of_the_file_add_up_to_the_summarys(doc, result):
    # every compute span carries both FLOP counts: weighted by the GPUs each rank stands for,
    # the file's model FLOPs are the step's (the spans left out, lasting no time, do no work)
    rank_of = _rank_of_pid(doc)
    events = [e for e in doc["traceEvents"]
              if e["ph"] == "X" and e["cat"] == "compute" and "flops" in e.get("args", {})]
    assert events and all("model_flops" in e["args"] for e in events)
    weight = result.trace.weight
    model = sum(e["args"]["model_flops"] * weight[rank_of[e["pid"]]] for e in events)
    hardware = sum(e["args"]["flops"] * weight[rank_of[e["pid"]]] for e in events)
    assert model == pytest.approx(result.summary["model_flops_per_step"], rel=1e-12)
    assert hardware == pytest.approx(result.summary["hardware_flops_per_step"], rel=1e-12)


def test_a_recomputed_forward_has_model_flops_0_and_a_receive_op_recv():
    doc = trace_document(_odd_trace(3.0), {})
    args = {e["name"]: e.get("args", {}) for e in doc["traceEvents"] if e["ph"] == "X"}
    assert args["B recompute attn"]["flops"] == 2e12 and args["B recompute attn"]["model_flops"] == 0
    assert args['F "attn" \\ é\n\u2028']["model_flops"] == 1.5e12
    assert args["recv a"]["op"] == "recv" and args["send a"]["op"] == "send"
    assert "model_flops" not in args["AR"] and "model_flops" not in args["late"]


def _counters(doc: dict) -> dict[int, list[dict]]:
    by_pid: dict[int, list[dict]] = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "C":
            by_pid.setdefault(e["pid"], []).append(e)
    return by_pid


def test_each_stages_memory_is_a_counter_on_its_ranks_process(doc, result):
    """``memory GiB`` (Perfetto names a counter track by the event's name and its series):
    the stage's memory timeline from the summary, on the process of the rank it is of, its
    highest value the stage's peak."""
    counters = _counters(doc)
    stages = result.summary["memory"]["stages"]
    assert sorted(counters) == sorted(st["rank"] + 1 for st in stages)
    _, threads = _names(doc)
    tids = {tid for _, tid in threads}
    for st in stages:
        events = counters[st["rank"] + 1]
        tl = st["timeline"]
        assert {e["name"] for e in events} == {"memory"} and all(list(e["args"]) == ["GiB"] for e in events)
        assert [e["ts"] for e in events] == pytest.approx([t * 1e6 for t in tl["t_s"]], abs=1e-3)
        held = st["params_bytes"] + st["grads_bytes"] + st["optimizer_bytes"] + st["transient_bytes"]
        want = [(held + a + c + r) / 2**30 for a, c, r in
                zip(tl["activations_bytes"], tl["comm_buffers_bytes"], tl["recomputing_bytes"])]
        assert [e["args"]["GiB"] for e in events] == pytest.approx(want, abs=1e-6)
        assert max(e["args"]["GiB"] for e in events) == pytest.approx(st["peak_bytes"] / 2**30, abs=1e-6)
        assert len({e["tid"] for e in events}) == 1 and events[0]["tid"] not in tids | set(counters)
    # written with the summary, after every span
    kinds = [e["ph"] for e in doc["traceEvents"]]
    assert kinds.index("C") > len(kinds) - 1 - kinds[::-1].index("X")


def test_memory_counters_go_where_the_gpus_spans_are_and_alike_without_the_trace(result, tmp_path):
    # the forked writer (output.background) writes the tail from the summary alone: the
    # same text as from the trace of the simulated ranks
    summary = result.summary
    assert perfetto.trace_tail(summary) == perfetto.trace_tail(summary, perfetto.processes(result.trace))
    assert '"name":"memory","ph":"C"' in perfetto.trace_tail(summary)
    # a trace of some GPUs: each GPU shows the memory of the rank whose spans it holds
    rep = summary["simulation"]["simulated_rank_of_gpu"]
    stage_ranks = {st["rank"] for st in summary["memory"]["stages"]}
    gpus = sorted(stage_ranks | {1, 3, 9, 14})
    some = result.trace.for_gpus(gpus)
    doc = trace_document(some, summary)
    assert sorted(_counters(doc)) == [g + 1 for g in gpus if rep[g] in stage_ranks]
    path = tmp_path / "t.json"
    write_trace(path, some, summary)
    assert path.read_text(encoding="utf-8") == _dumps(doc)
    assert not _counters(trace_document(result.trace, {}))  # no summary, no counters


def test_back_to_back_spans_do_not_overlap_in_perfetto(doc):
    # Perfetto rounds ts and dur to whole ns separately; a 1 ns overlap would nest the slices
    by_thread: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            by_thread.setdefault((e["pid"], e["tid"]), []).append((round(e["ts"] * 1000), round(e["dur"] * 1000)))
    touching = 0
    for evs in by_thread.values():
        evs.sort()
        for (ts, dur), (nts, _) in zip(evs, evs[1:]):
            assert ts + dur <= nts
            touching += ts + dur == nts
    assert touching > 0  # the compute stream does run spans back to back


def test_gzip_round_trips_and_bytes_are_deterministic(result, tmp_path, deflate):
    plain, gz, gz2 = tmp_path / "t.json", tmp_path / "t.json.gz", tmp_path / "again.json.gz"
    write_trace(plain, result.trace, result.summary)
    write_trace(gz, result.trace, result.summary)
    write_trace(gz2, result.trace, result.summary)
    assert gz.read_bytes()[:2] == b"\x1f\x8b"
    assert gzip.decompress(gz.read_bytes()) == plain.read_bytes()
    assert file_bytes(gz) == file_bytes(gz2)  # (the text where ISA-L compresses)
    again = tmp_path / "again.json"
    write_trace(again, result.trace, result.summary)
    assert again.read_bytes() == plain.read_bytes()
    assert json.loads(plain.read_bytes())["traceEvents"]


# --------------------------------------------------------------------------- the fast writer

def _dumps(doc: dict) -> str:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def test_written_text_is_what_json_dumps_makes_of_the_document(result, tmp_path):
    # write_trace puts the text together from cached pieces; trace_document is the reference
    path = tmp_path / "t.json"
    write_trace(path, result.trace, result.summary)
    assert path.read_text(encoding="utf-8") == _dumps(trace_document(result.trace, result.summary))


def _odd_trace(late_s: float) -> Trace:
    spans = [
        Span(rank=0, stream="compute", name='F "attn" \\ é\n\u2028', kind="compute", start_s=0.0, end_s=1e-9,
             mb=0, phase="F", layer=3, flops=1.5e12, model_flops=1.5e12),
        Span(rank=5, stream="compute", name="B recompute attn", kind="compute", start_s=2.5, end_s=2.75,
             mb=0, phase="B", layer=3, flops=2e12),  # the forward again: no model work
        Span(rank=0, stream="compute", name="zero length", kind="compute", start_s=1e-9, end_s=1e-9, mb=-1),
        Span(rank=0, stream="compute", name="whole flops", kind="compute", start_s=2.5e-6, end_s=0.1234567894,
             flops=3.0, layer=0),
        # no time, where a longer span starts (a split backward's embedding B): Perfetto would
        # draw it inside that span
        Span(rank=0, stream="compute", name="no time at a start", kind="compute", start_s=2.5e-6, end_s=2.5e-6,
             mb=0, phase="B"),
        Span(rank=0, stream="tp", name="AR", kind="tp", start_s=0.123456789, end_s=0.2, mb=7,
             size_bytes=1024.5, op="all_reduce"),
        Span(rank=0, stream="tp", name="AR", kind="tp", start_s=0.123456789, end_s=0.15, mb=7,
             size_bytes=1024, op="all_reduce"),  # same start: the shorter first
        Span(rank=0, stream="tp", name="AR", kind="tp", start_s=0.123456789, end_s=0.15, mb=8,
             size_bytes=1024, op="all_reduce"),  # a tie in both: the trace's order
        Span(rank=5, stream="my_stream", name="late", kind="other", start_s=late_s, end_s=late_s + 1e-3),
        Span(rank=5, stream="compute", name="backwards", kind="compute", start_s=2.0, end_s=1.9996),
        # receives from two senders (DualPipe): overlapping, nested, then after both
        Span(rank=0, stream="pp_fwd_recv", name="recv a", kind="pp", start_s=0.1, end_s=0.3, mb=1, size_bytes=64,
             op="send", tid=7),  # (the engine gives a receive its send's op, and task)
        Span(rank=5, stream="pp_fwd_send", name="send a", kind="pp", start_s=0.1, end_s=0.3, mb=1, size_bytes=64,
             op="send", tid=7),
        # a flow to a receive on a lane of its own (recv b, "pp_fwd_recv #2"), one with no task
        # id (none), and one whose receive lasts no time (none)
        Span(rank=5, stream="pp_fwd_send", name="send b", kind="pp", start_s=0.3, end_s=0.4, mb=2, op="send", tid=3),
        Span(rank=0, stream="pp_fwd_recv", name="recv b", kind="pp", start_s=0.2, end_s=0.4, mb=2, op="send", tid=3),
        Span(rank=5, stream="pp_fwd_send", name="send c", kind="pp", start_s=0.4, end_s=0.5, mb=5, op="send"),
        Span(rank=5, stream="pp_fwd_send", name="send e", kind="pp", start_s=0.5, end_s=0.6, mb=6, op="send", tid=9),
        Span(rank=0, stream="pp_fwd_recv", name="recv e", kind="pp", start_s=0.5, end_s=0.5, mb=6, op="send", tid=9),
        Span(rank=0, stream="pp_fwd_recv", name="recv c", kind="pp", start_s=0.25, end_s=0.26, mb=3),
        Span(rank=0, stream="pp_fwd_recv", name="recv d", kind="pp", start_s=0.3, end_s=0.35, mb=4),
        # touching receives share their thread
        Span(rank=5, stream="pp_bwd_recv", name="recv g", kind="pp", start_s=0.1, end_s=0.2, mb=1),
        Span(rank=5, stream="pp_bwd_recv", name="recv g", kind="pp", start_s=0.2, end_s=0.3, mb=2),
    ]
    return Trace(spans=spans, ranks=[5, 0], weight={0: 1, 5: 8}, stage_of={0: 0, 5: 1})


@pytest.mark.parametrize("late_s", [3.0, 5e6], ids=["in-range", "past-51-days"])
def test_odd_spans_are_written_as_json_dumps_writes_them(tmp_path, late_s):
    # escapes, whole and fractional numbers, ties, an unknown stream, a negative duration, and
    # (5e6 s) times past 2**42 µs, where microseconds are formatted the slow way
    trace = _odd_trace(late_s)
    summary = {"scenario": "odd", "step_time_s": 2.0}
    plain, gz = tmp_path / "t.json", tmp_path / "t.json.gz"
    write_trace(plain, trace, summary)
    write_trace(gz, trace, summary)
    text = _dumps(trace_document(trace, summary))
    assert plain.read_text(encoding="utf-8") == text
    _assert_one_gzip_member(gz.read_bytes(), text)


def test_receives_that_overlap_go_on_lanes_of_their_own():
    # Perfetto drops a complete event that overlaps another on its thread, and draws one
    # inside another as its child: each receive stream's spans are laid out on lanes
    assert perfetto.lanes([0, 2, 3, 4, 9], [5, 6, 4, 7, 10]) == [0, 1, 2, 2, 0]
    doc = trace_document(_odd_trace(3.0), {})
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    sort_index = {(e["pid"], e["tid"]): e["args"]["sort_index"] for e in doc["traceEvents"]
                  if e["name"] == "thread_sort_index"}
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    on = {e["name"]: names[e["pid"], e["tid"]] for e in events if e["name"].startswith("recv")}
    assert on == {"recv a": "pp_fwd_recv", "recv b": "pp_fwd_recv #2", "recv c": "pp_fwd_recv #3",
                  "recv d": "pp_fwd_recv", "recv g": "pp_bwd_recv"}
    lane_sort = {sort_index[k] for k, name in names.items() if name.startswith("pp_fwd_recv")}
    assert len(lane_sort) == 1  # the lanes sort with their stream
    assert len(events) == len(_odd_trace(3.0).spans) - 3  # the three that last no time left out
    by_thread: dict = {}
    for e in events:
        by_thread.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + max(e["dur"], 0)))
    for (pid, tid), times in by_thread.items():
        if names[pid, tid].startswith("pp_"):
            times.sort()
            assert all(b[0] >= a[1] for a, b in zip(times, times[1:])), names[pid, tid]


def test_spans_that_last_no_time_are_left_out_of_the_file():
    # Perfetto orders events of one start longest first and would draw the span of no time
    # inside the span starting with it, as its child: no event of the file nests in another
    doc = trace_document(_odd_trace(3.0), {})
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert all(e["dur"] != 0 for e in events)
    assert not {"zero length", "no time at a start"} & {e["name"] for e in events}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    compute = sorted(((round(e["ts"] * 1000), round((e["ts"] + e["dur"]) * 1000)) for e in events
                      if names[e["pid"], e["tid"]] == "compute" and e["pid"] == 1), key=lambda t: (t[0], -t[1]))
    assert len(compute) == 2 and compute[0][1] <= compute[1][0]  # as Perfetto orders them: one after the other


@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev"])
def test_a_dualpipe_trace_has_no_receive_on_another(tmp_path, schedule):
    # DualPipe's first and last ranks receive forward activations from both neighbours;
    # DualPipeV's ranks receive from both arms of the V
    path = tmp_path / "t.json"
    d = yaml.safe_load((ROOT / "scenarios" / "dualpipe.yaml").read_text())
    d["parallel"]["schedule"] = schedule
    result = clustersim.simulate(clustersim.load_scenario(d, base_dir=ROOT / "scenarios"))
    write_trace(path, result.trace, result.summary)
    doc = json.loads(path.read_text(encoding="utf-8"))
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    by_thread: dict = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            by_thread.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    assert schedule != "dualpipe" or any("#" in n for n in names.values())  # it has receives that overlap
    for key, times in by_thread.items():
        times.sort()
        assert all(b[0] >= a[1] - 1e-9 for a, b in zip(times, times[1:])), names[key]
    assert sum(map(len, by_thread.values())) == sum(1 for s in result.trace.spans if perfetto._lasts(s))
    # every send's flow ends on its receive, on whichever lane that went
    flows = _flows(doc)
    assert len(flows) == sum(1 for e in _x_events(doc) if e["args"].get("op") == "send") > 0
    assert all(recv["args"]["op"] == "recv" for _, _, _, recv in flows)
    assert schedule != "dualpipe" or any("#" in names[end["pid"], end["tid"]] for _, end, _, _ in flows)


# --------------------------------------------------------------------------- which group, algorithm, peer

def _x_events(doc: dict) -> list[dict]:
    return [e for e in doc["traceEvents"] if e["ph"] == "X"]


def _flows(doc: dict) -> list[tuple[dict, dict, dict, dict]]:
    """(flow start, flow end, the send's X event, the receive's X event) of each flow of
    ``doc``, checked to pair up as Perfetto pairs them: one start and one end per id (the same
    name and category), the start first in the file, after every X event and before the
    counters, each bound to the one X event on its thread that it lies in."""
    events = doc["traceEvents"]
    at = {id(e): k for k, e in enumerate(events)}
    starts = [e for e in events if e["ph"] == "s"]
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert len({e["id"] for e in starts}) == len(starts) == len(ends)  # ids unique, each flow once
    kinds = [e["ph"] for e in events]
    last_x = len(kinds) - 1 - kinds[::-1].index("X") if "X" in kinds else -1
    counters = kinds.index("C") if "C" in kinds else len(kinds)
    by_thread: dict = {}
    for e in _x_events(doc):
        by_thread.setdefault((e["pid"], e["tid"]), []).append(e)

    def slice_at(e: dict) -> dict:
        inside = [x for x in by_thread[e["pid"], e["tid"]] if x["ts"] <= e["ts"] < x["ts"] + x["dur"]]
        assert len(inside) == 1, e
        return inside[0]

    out = []
    for start in starts:
        end = ends[start["id"]]
        assert end["bp"] == "e" and "bp" not in start
        assert (start["name"], start["cat"]) == (end["name"], end["cat"])
        assert last_x < at[id(start)] < at[id(end)] < counters
        out.append((start, end, slice_at(start), slice_at(end)))
    return out


def test_every_pp_send_has_one_flow_to_its_receive_on_the_next_stage(doc, result):
    # a send's args name the receiver, a receive's the sender: simulated ranks and their stages,
    # as the processes are named; the flow goes from the send to the receive on the next stage
    # (a gradient's: the previous), which starts no earlier
    rank_of, stage_of = _rank_of_pid(doc), result.trace.stage_of
    events = _x_events(doc)
    sends = [e for e in events if e.get("args", {}).get("op") == "send"]
    recvs = [e for e in events if e.get("args", {}).get("op") == "recv"]
    flows = _flows(doc)
    assert len(flows) == len(sends) == len(recvs) > 0
    assert {id(send) for _, _, send, _ in flows} == {id(e) for e in sends}  # each send once
    assert {id(recv) for _, _, _, recv in flows} == {id(e) for e in recvs}
    for start, end, send, recv in flows:
        assert send["args"]["op"] == "send" and recv["args"]["op"] == "recv"
        assert start["ts"] == send["ts"] and end["ts"] == recv["ts"] >= send["ts"]
        assert (start["name"], start["cat"]) == (send["name"], "pp")
        src, dst = rank_of[send["pid"]], rank_of[recv["pid"]]
        assert stage_of[dst] == stage_of[src] + (1 if send["args"]["phase"] == "F" else -1)
        assert (send["args"]["peer_stage"], send["args"]["peer_rank"]) == (stage_of[dst], dst)
        assert (recv["args"]["peer_stage"], recv["args"]["peer_rank"]) == (stage_of[src], src)
        assert (send["args"]["mb"], send["args"]["bytes"]) == (recv["args"]["mb"], recv["args"]["bytes"])
    assert not any("peer_rank" in e.get("args", {}) or "group" in e.get("args", {})
                   for e in events if e["cat"] == "compute")


def test_a_collectives_group_is_its_ranks_mesh_group(doc, result):
    # "tp: GPUs 0-3": the mesh group the collective runs over, the rank's own, by global GPU
    # rank; DP's gradient reductions over cp+dp (CP ranks hold the same weights), the tied
    # embedding's between the first and the last stage over pp
    mesh = clustersim.load_scenario(copy.deepcopy(SMALL), base_dir=ROOT).mesh
    rank_of = _rank_of_pid(doc)
    collectives = [e for e in _x_events(doc) if e.get("args", {}).get("op") not in (None, "send", "recv")]
    assert {e["cat"] for e in collectives} == {"tp", "dp"} and mesh.grad_group("dp") == "cp+dp"
    for e in collectives:
        dim = "pp" if e["name"] == "AR tied embedding grads" else {"tp": "tp", "dp": "cp+dp"}[e["cat"]]
        group = mesh.group(rank_of[e["pid"]], dim)
        assert e["args"]["group"] == f"{dim}: GPUs {gpu_ranges(group)}"
        assert e["args"]["group_size"] == len(group) > 1
        assert "peer_rank" not in e["args"]
    assert {e["args"]["group"] for e in collectives if e["pid"] == 1} == {"tp: GPUs 0-3", "cp+dp: GPUs 0, 4",
                                                                           "pp: GPUs 0, 8"}


def _census(trace: Trace, ops) -> dict:
    """Collective -> algorithm -> the spans of ``trace`` whose args say it."""
    out: dict = {}
    for s in trace.spans:
        if s.op in ops:
            algo = dict(s.comm_args)["algorithm"]
            out.setdefault(s.op, {}).setdefault(algo, 0)
            out[s.op][algo] += 1
    return out


def test_a_collectives_algorithm_is_what_the_census_counts(doc, result):
    census = result.summary["simulation"]["collective_algorithms"]
    assert census and _census(result.trace, census) == census
    said = {(e["args"]["op"], e["args"]["algorithm"]) for e in _x_events(doc) if e["args"].get("op") in census}
    assert said == {(op, a) for op, per in census.items() for a in per}
    # two algorithms in one step (NVLS inside the node for TP, ring across for DP), and one
    # fixed by the scenario where it can run
    d = yaml.safe_load((ROOT / "scenarios" / "llama2_70b_64gpu.yaml").read_text())
    for fixed in (None, "tree"):
        if fixed:
            d.setdefault("simulation", {})["collectives"] = {"all_reduce": fixed}
        r = clustersim.simulate(clustersim.load_scenario(d, base_dir=ROOT / "scenarios"))
        census = r.summary["simulation"]["collective_algorithms"]
        assert _census(r.trace, census) == census
        assert len(census["all_reduce"]) == 2 if fixed is None else "tree" in census["all_reduce"]


def test_a_trace_of_some_gpus_has_flows_between_the_simulated_ranks_only():
    # run --trace-gpus: GPU 1's process holds rank 0's spans, whose peer is GPU 8's rank, not
    # the GPU 1 sends to: no flow goes from or to such a process
    r = _simulate()  # collapsed: rank 0 for GPUs 0-7, rank 8 for 8-15
    doc = trace_document(r.trace.for_gpus([0, 1, 8, 9]), r.summary)
    flows = _flows(doc)
    assert flows and {(start["pid"], end["pid"]) for start, end, _, _ in flows} == {(1, 9), (9, 1)}
    assert not _flows(trace_document(r.trace.for_gpus([1, 9]), r.summary))


def test_a_forms_comm_args_survive_a_copy_and_an_edit_but_do_not_tell_spans_apart():
    r = _simulate()
    send = next(s for s in r.trace.spans if s.op == "send" and not perfetto.is_receive(s.stream))
    assert dict(send.comm_args) == {"peer_stage": 1, "peer_rank": 8}
    again = pickle.loads(pickle.dumps(send))  # (clustersim.engine.ahead hands spans over pickled)
    assert again.comm_args == send.comm_args and again == send
    edited = pickle.loads(pickle.dumps(send))
    edited.name = "renamed"
    assert edited.comm_args == send.comm_args and edited.form is not send.form
    edited.name, edited.comm_args = send.name, (("peer_stage", 0), ("peer_rank", 0))
    assert edited == send  # compared by values(): a collapsed trace's peers are its simulated ranks


def _assert_one_gzip_member(data: bytes, text: str) -> None:
    """``data`` is one gzip member holding ``text``, with the header zlib writes (no name,
    mtime 0) and nothing after it."""
    empty = zlib.compressobj(perfetto.GZIP_LEVEL, zlib.DEFLATED, 31)  # (zlib.compress takes wbits from 3.11)
    assert data[:10] == (empty.compress(b"") + empty.flush())[:10]
    z = zlib.decompressobj(31)  # checks the CRC-32 and the length in the trailer
    assert z.decompress(data) == text.encode("utf-8")
    assert z.eof and z.unused_data == b""


@pytest.fixture(params=["isal", "zlib"])
def deflate(request, monkeypatch):
    """The trace file's compressor: ISA-L's (a dependency where it has wheels), or zlib, which
    the writer falls back to elsewhere. Both must make a file any gzip reader opens."""
    if request.param == "isal":
        pytest.importorskip("isal")
        assert perfetto._deflate.__name__ == "isal.isal_zlib"  # the writer picked it up
    else:
        monkeypatch.setattr(perfetto, "_deflate", zlib)
        monkeypatch.setattr(perfetto, "GZIP_LEVEL", perfetto.ZLIB_LEVEL)
    return request.param


@pytest.mark.parametrize("piece_spans", [1, 2, 3, 5, 4096])
@pytest.mark.parametrize("late_s", [3.0, 5e6], ids=["in-range", "past-51-days"])
def test_pieces_of_any_size_make_the_same_file(tmp_path, monkeypatch, deflate, late_s, piece_spans):
    # the trace file is written and compressed piece by piece (TracePieces): cut anywhere (in
    # a row, at its end, one event each), the text is the document's and the file one member
    monkeypatch.setattr(perfetto, "PIECE_SPANS", piece_spans)
    trace = _odd_trace(late_s)
    summary = {"scenario": "odd", "step_time_s": 2.0}
    pieces = perfetto.TracePieces(trace)
    n_events = sum(1 for sp in trace.spans if perfetto._lasts(sp))  # those lasting no time left out
    assert n_events == len(trace.spans) - 3
    n_flows = 2  # send a -> recv a, send b -> recv b; the flows' pieces hold two events a flow
    assert pieces.count == perfetto.piece_count(trace) == -(-n_events // piece_spans) + -(-n_flows // max(1, piece_spans // 2))
    text = _dumps(trace_document(trace, summary))
    assert "".join(map(pieces.text, range(pieces.count))) + perfetto.trace_tail(summary) == text
    data = perfetto.gzip_file(list(map(pieces.packed, range(pieces.count))), perfetto.trace_tail(summary))
    _assert_one_gzip_member(data, text)
    write_trace(tmp_path / "t.json.gz", trace, summary)
    (tmp_path / "pieces.json.gz").write_bytes(data)
    assert file_bytes(tmp_path / "t.json.gz") == file_bytes(tmp_path / "pieces.json.gz")


def test_pieces_compress_alike_whoever_compresses_them(result, deflate):
    # the writer and the parent each compress some of the pieces (output.background): a
    # piece's bytes depend on the piece alone, not on what was compressed before it
    a, b = perfetto.TracePieces(result.trace), perfetto.TracePieces(result.trace)
    n = a.count
    forward = [a.packed(k) for k in range(n)]
    backward = {k: b.packed(k) for k in reversed(range(n))}
    if not compressed_alike():  # (ISA-L: the same text, conftest.compressed_alike)
        forward, backward = _inflated(forward), _inflated(backward)
    assert forward == [backward[k] for k in range(n)]


def _inflated(packed):
    """Pieces as :meth:`perfetto.TracePieces.packed` gives them, their deflate undone."""
    pieces = packed.items() if isinstance(packed, dict) else enumerate(packed)
    got = {k: (zlib.decompressobj(-15).decompress(p), crc, size) for k, (p, crc, size) in pieces}
    return got if isinstance(packed, dict) else [got[k] for k in range(len(packed))]


def test_crc32_combine_is_the_crc_of_the_joined_bytes():
    rng = random.Random(7)
    for _ in range(200):
        a = rng.randbytes(rng.randint(0, 2000))
        b = rng.randbytes(rng.choice([0, 1, 2, 3, rng.randint(0, 70_000)]))
        assert perfetto.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_microseconds_are_written_as_repr_writes_them():
    edge = [0, 1, 9, 10, 999, 1000, 1001, 1500, 123_456_789, 2**42 * 1000 - 1, 2**42 * 1000 - 999]
    rng = np.random.default_rng(0)
    t_ns = np.array(edge + rng.integers(0, 2**42 * 1000, 20_000).tolist(), dtype=np.int64)
    whole, frac = perfetto._us_digits(t_ns)
    written = [f"{w}{perfetto._FRACTION_US[f]}" for w, f in zip(whole, frac)]
    assert written == [repr(perfetto._us(n)) for n in t_ns.tolist()]


@pytest.mark.parametrize("n,top", [(0, 1), (1, 5), (300, 3), (10_000, 30_000), (5_000, 2**40)])
def test_rows_numbered_as_np_unique_numbers_them(n, top):
    """The display rows' (rank, stream) numbers are told apart by a table of the values present
    (few distinct, small) or by numpy's sort (a wide range): either way what np.unique gives."""
    keys = np.random.default_rng(n).integers(0, top, n).astype(np.int64)
    used, inverse = perfetto._distinct_inverse(keys)
    want_used, want_inverse = np.unique(keys, return_inverse=True)
    assert used.tolist() == want_used.tolist() and inverse.tolist() == want_inverse.reshape(-1).tolist()


def test_spans_for_gpus_counts_what_for_gpus_makes_and_a_gpu_without_a_rank_is_named():
    r = _simulate()
    for gpus in ([0], [1, 9, 15], range(16)):
        assert r.trace.spans_for_gpus(gpus) == r.trace.for_gpus(gpus).n_spans > 0
    assert r.trace.spans_for_gpus(range(16)) == 8 * r.trace.n_spans  # each of the 2 ranks stands for 8 GPUs
    with pytest.raises(ValueError, match="GPU 16 is not one of the 16 GPUs"):
        r.trace.for_gpus([16])
    by_hand = Trace(spans=[], ranks=[0, 4], weight={0: 4, 4: 4})  # no rep: which rank GPU 1 is is not known
    with pytest.raises(ValueError, match="GPU 1 is not a simulated rank"):
        by_hand.for_gpus([1])
    assert by_hand.for_gpus([4]).ranks == [4]


# --------------------------------------------------------------------------- the documentation

def _section(path: Path, heading: str) -> str:
    """The text under ``heading`` (a markdown heading line) up to the next heading of its level
    or above."""
    text = path.read_text(encoding="utf-8")
    level = heading.split(" ", 1)[0]
    body = text[text.index(f"\n{heading}\n") + len(heading) + 2:]
    ends = [m.start() for m in re.finditer(r"^#{1,%d} " % len(level), body, flags=re.MULTILINE)]
    return body[:ends[0]] if ends else body


def test_the_reference_names_every_thread_and_argument_of_the_file():
    text = _section(ROOT / "docs" / "reference.md", "### trace.json.gz")
    ticked = set(re.findall(r"`([^`\n]+)`", text))
    assert set(perfetto.KNOWN_STREAMS) - ticked == set()  # d2h, host, h2d under offload too
    every = Span(rank=0, stream="pp_fwd_recv", name="recv act", kind="pp", start_s=0.0, end_s=1.0, mb=0, phase="F",
                 layer=0, size_bytes=1, op="send", flops=1, model_flops=1)
    assert set(perfetto.span_args(every)) - ticked == set()  # op and model_flops among them
    # a collective's group and algorithm, a send's and a receive's peer, and the flows
    r = _simulate()
    said = {k for s in r.trace.spans for k in perfetto.span_args(s)}
    assert {"group", "group_size", "algorithm", "peer_stage", "peer_rank"} <= said and said - ticked == set()
    assert {'"ph": "s"', '"ph": "f"', '"bp": "e"', "id"} <= ticked
    assert {"recv", "memory GiB", "overlap_param_gather"} <= {t.removeprefix("parallel.") for t in ticked}
    # the zero thread's gathers are ZeRO-1/2's too (moe_1024gpu: overlap_param_gather)
    row = next(line for line in (ROOT / "docs" / "reference.md").read_text(encoding="utf-8").splitlines()
               if line.startswith("| `AR grads bucket N`"))
    assert "overlap_param_gather" in row.split("`F AG params`", 1)[1]


def test_the_docs_agree_that_the_trace_files_text_stays_the_same():
    # ISA-L's deflate need not give the same bytes twice (the note at perfetto._deflate): the
    # reference and architecture.md's "Determinism" promise the text, and the bytes under zlib
    for text in (_section(ROOT / "docs" / "reference.md", "### trace.json.gz"),
                 _section(ROOT / "docs" / "architecture.md", "### Determinism")):
        assert "ISA-L" in text
        for sentence in re.split(r"(?<=[.:;])\s+", " ".join(text.split())):
            assert not ("byte-identical" in sentence and "trace.json.gz" in sentence) or "text" in sentence, sentence
