"""The Perfetto / chrome://tracing export: one X event per span, named processes and threads."""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path

import pytest

import clustersim
from clustersim.output.perfetto import stream_sort_key, write_trace

from .conftest import scenario_dict

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
    return {pid: int(name.rsplit("rank ", 1)[1]) for pid, name in procs.items()}


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
    assert sorted(procs.values()) == sorted(f"stage {trace.stage_of[r]} · rank {r}" for r in trace.ranks)
    rank_of = _rank_of_pid(doc)
    named = {(rank_of[pid], stream) for (pid, _), stream in threads.items()}
    assert named == {(s.rank, s.stream) for s in trace.spans}
    assert 0 not in procs  # Perfetto reserves pid 0 for the idle process
    assert len({tid for _, tid in threads}) == len(threads)  # tids unique across processes


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
            # absent, not a placeholder: no -1 microbatch or layer, no 0 bytes or FLOPs, no ""
            assert args.get("mb") != -1 and args.get("layer") != -1 and args.get("phase") != ""
            assert args.get("bytes") != 0 and args.get("flops") != 0


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


def test_gzip_round_trips_and_bytes_are_deterministic(result, tmp_path):
    plain, gz, gz2 = tmp_path / "t.json", tmp_path / "t.json.gz", tmp_path / "again.json.gz"
    write_trace(plain, result.trace, result.summary)
    write_trace(gz, result.trace, result.summary)
    write_trace(gz2, result.trace, result.summary)
    assert gz.read_bytes()[:2] == b"\x1f\x8b"
    assert gzip.decompress(gz.read_bytes()) == plain.read_bytes()
    assert gz.read_bytes() == gz2.read_bytes()
    again = tmp_path / "again.json"
    write_trace(again, result.trace, result.summary)
    assert again.read_bytes() == plain.read_bytes()
    assert json.loads(plain.read_bytes())["traceEvents"]
