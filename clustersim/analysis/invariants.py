"""Invariants every simulated step must satisfy; a violation is a bug in the simulator.

Checked after every simulation (``simulate(..., check=True)``, the default; the CLI's
``--no-check`` skips them). Each check is linear or n log n in the number of spans. See
docs/invariants.md for why each one holds.

The checks read the spans afresh into numpy columns (:mod:`.columns`) and work on those: they
share no numbers with the summary (whose columns may predate a change to the spans), only the
program's tasks read as columns.

    1 stream-overlap     no two spans overlap on one (rank, stream), receive streams excepted
    2 dependency-order   every task starts after all its dependencies end
    3 collective-sync    the members of a collective start and end together
    4 phase-order        per stage and microbatch: F ends before B starts, B before W (compute)
    5 send-recv          every send has a receive on its receiver: same start, end and bytes
    6 step-time          step time >= the busiest rank's compute time
    7 memory             every stage: peak >= params + grads + optimizer >= 0; its timeline is
                         never negative and peaks at the reported peak
    8 critical-path      the critical path is gap-free and as long as the step
    9 bubble-split       every rank: warm-up + cool-down + dependency + imbalance = bubble, none < 0
   10 view               the columns the checks read hold the spans' own values (docs/invariants.md)
   11 rank-map           every GPU stands with one simulated rank, each simulated rank with itself,
                         and each for as many GPUs as its weight
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from itertools import repeat
from operator import eq
from typing import Any, Iterable

import numpy as np

from ..floats import sum_left
from ..plan.mesh import Mesh, parse_order
from ..program.tasks import Program
from ..trace import RECV_STREAMS, Span, Trace, unique
from .columns import SpanColumns, grouped_order, mixed_radix
from .intervals import merged, merged_length

EPS = 1e-12  # absolute float slack, seconds (or bytes)
MAX_SPANS = 3  # offending spans listed per violation
PHASE_ORDER = ("F", "B", "W")

INVARIANTS = ("stream-overlap", "dependency-order", "collective-sync", "phase-order",
              "send-recv", "step-time", "memory", "critical-path", "bubble-split", "rank-map")


def _tol(x: float) -> float:
    """EPS, or a relative slack for large times/sizes."""
    t = 1e-12 * (x if x >= 0 else -x)
    return t if t > EPS else EPS


@dataclass
class Violation:
    invariant: str
    message: str
    spans: list[Span] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"[{self.invariant}] {self.message}"]
        for s in self.spans[:MAX_SPANS]:
            lines.append(f"    rank {s.rank} stream {s.stream!r} {s.name!r} "
                         f"[{s.start_s:.9g} s, {s.end_s:.9g} s]")
        return "\n".join(lines)


class InvariantError(Exception):
    """The simulated step broke invariants: ``violations`` says which, with offending spans."""

    def __init__(self, violations: list[Violation]):
        self.violations = list(violations)
        super().__init__(self.report())

    def report(self) -> str:
        n = len(self.violations)
        head = f"simulator bug: {n} invariant violation{'s' if n != 1 else ''} (please report)"
        return "\n".join([head, *(str(v) for v in self.violations)])


def _v(invariant: str, message: str, spans: Iterable[Span]) -> Violation:
    return Violation(invariant, message, list(spans)[:MAX_SPANS])


def _tols(x: np.ndarray) -> np.ndarray:
    """:func:`_tol` of every element."""
    t = 1e-12 * np.abs(x)
    return np.where(t > EPS, t, EPS)


def _view(trace: Trace, cols: SpanColumns | None) -> SpanColumns:
    """``cols``, or the spans as columns read now (not the trace's cached view, which may
    predate changes to the spans): the checks look at the spans as they are."""
    return cols if cols is not None else SpanColumns(trace.spans, trace.ranks)


def _runs(*keys: np.ndarray) -> np.ndarray:
    """For rows sorted by ``keys``: True where a row starts a new run of equal keys."""
    n = len(keys[0])
    new = np.zeros(n, dtype=bool)
    if n:
        new[0] = True
        for k in keys:
            new[1:] |= k[1:] != k[:-1]
    return new


# --- 1 ---------------------------------------------------------------------------------
def check_stream_overlap(trace: Trace, cols: SpanColumns | None = None) -> list[Violation]:
    """Per (rank, stream), receive streams excepted: spans sorted by (start, end) must not
    start before the previous one ends (less the tolerance)."""
    c = _view(trace, cols)
    rows = np.flatnonzero(~c.is_in("stream", RECV_STREAMS))
    key = mixed_radix(c.rank, c.stream)  # (rank, stream) as one number
    if key is None:  # ranks too far apart for one number: number the (rank, stream) pairs
        key = np.unique(np.stack((c.rank, c.stream)), axis=1, return_inverse=True)[1].ravel()
    order, heads = grouped_order(key[rows], c.end_s[rows], c.start_s[rows])  # per stream by (start, end), ties in span order
    rows = rows[order]
    start, end = c.start_s[rows], c.end_s[rows]
    new = np.zeros(len(rows), dtype=bool)
    new[heads] = True
    bad = np.flatnonzero(~new[1:] & (start[1:] < end[:-1] - _tols(end[:-1])))  # pair (bad, bad + 1)
    if not len(bad):
        return []
    run = np.cumsum(new) - 1
    first_bad = bad[_runs(run[bad])]  # one report per stream: its first overlap
    first_row = np.minimum.reduceat(rows, np.flatnonzero(new))  # a stream's first span: streams in that order
    out = []
    for i in sorted(first_bad.tolist(), key=lambda i: first_row[run[i]]):
        a, b = c.spans[int(rows[i])], c.spans[int(rows[i + 1])]
        out.append(_v("stream-overlap", f"spans overlap on rank {a.rank} stream {a.stream!r}", (a, b)))
    return out


# --- 2 ---------------------------------------------------------------------------------
def check_dependencies(program: Program, trace: Trace, cols: SpanColumns | None = None) -> list[Violation]:
    """Every task has a span, and starts no earlier than each dependency ends (less the
    tolerance)."""
    c = _view(trace, cols)
    tasks = program.items  # a run's tasks are made only where a violation names one
    tc = trace.task_columns(tasks, program.runs, program)
    own = c.own_index(tasks, tc)
    out = []
    missing = np.flatnonzero(own < 0)
    if len(missing):
        t = program.task(int(missing[0]))
        out.append(_v("dependency-order", f"{len(missing)} task(s) have no span, e.g. task {t.tid} "
                      f"{t.name!r} on rank {t.rank} stream {t.stream!r}", ()))
    indptr, flat = tc.deps
    task = np.repeat(np.arange(len(tasks)), np.diff(indptr))  # (task, dependency) pairs in order
    dep_ok = (flat >= 0) & (flat < len(tasks))
    dep_row = np.where(dep_ok, own[np.where(dep_ok, flat, 0)], -1)
    row = own[task]
    pairs = np.flatnonzero((row >= 0) & (dep_row >= 0))
    start = c.start_s[row[pairs]]
    bad = pairs[start < c.end_s[dep_row[pairs]] - _tols(start)]
    if len(bad):
        task_s, dep_s = c.spans[int(row[bad[0]])], c.spans[int(dep_row[bad[0]])]
        more = [c.spans[int(row[bad[1]])]] if len(bad) > 1 else []
        out.append(_v("dependency-order", f"{len(bad)} task(s) start before a dependency ends, e.g. "
                      f"{task_s.name!r} at {task_s.start_s:.9g} s before {dep_s.name!r} ends at {dep_s.end_s:.9g} s",
                      [task_s, dep_s, *more]))
    return out


# --- 3 ---------------------------------------------------------------------------------
def check_collectives(program: Program, trace: Trace, cols: SpanColumns | None = None) -> list[Violation]:
    """The members' spans of a collective (two or more simulated members) start and end with
    the first member's, within the tolerance."""
    c = _view(trace, cols)
    tasks = program.items  # a run's tasks are made only where a violation names one
    tc = trace.task_columns(tasks, program.runs, program)
    rows = c.own_rows(tasks, tc)  # every span of a task on its own rank and stream
    t = c.tid[rows]
    group = tc.rendezvous[t]
    keep = group >= 0
    rows, group = rows[keep], group[keep]
    order = np.lexsort((rows, group))
    rows, group = rows[order], group[order]
    new = _runs(group)
    first = np.maximum.accumulate(np.where(new, np.arange(len(rows)), 0))  # each row's first member
    s0_start, s0_end = c.start_s[rows[first]], c.end_s[rows[first]]
    odd = ((np.abs(c.start_s[rows] - s0_start) > _tols(s0_start))
           | (np.abs(c.end_s[rows] - s0_end) > _tols(s0_end)))
    out = []
    bad_groups = unique(first[odd])
    for f in sorted(bad_groups.tolist(), key=lambda f: rows[f]):  # collectives in order of appearance
        members = np.flatnonzero(first == f)
        s0 = c.spans[int(rows[f])]
        key = program.task(s0.tid).comm.key
        out.append(_v("collective-sync", f"members of collective {key!r} do not start and end together",
                      [s0, *(c.spans[int(rows[i])] for i in members[odd[members]])]))
    return out


# --- 4 ---------------------------------------------------------------------------------
def check_phase_order(trace: Trace, cols: SpanColumns | None = None) -> list[Violation]:
    """Per rank and microbatch (compute): the last F ends before the first B starts, and per
    layer, its last B and F before its first W, within the tolerance.

    A microbatch's forward passes every stage before its backward starts, so F before B holds
    on a rank whatever stages it holds. A W waits only for its own part's B: where a
    microbatch visits a rank twice (a V-shaped schedule: stages 0 and 3 on rank 0), the later
    stage's W may run before the earlier stage's B, so W is checked layer by layer (a layer
    is in one part; a part's W action comes after its B action). The embedding's W (it has
    no B of its own) goes with layer 0, whose input gradient it reads; the head's with a
    layer past the last::

        rank 0, microbatch 0:  F0 F3 B3 W3 B0 W0     W3 before B0 ends: allowed (another part)
    """
    c = _view(trace, cols)
    comp = c.compute  # the compute spans: their phase, microbatch, stage, layer and name
    phase_of = np.full(len(comp.phase_names), -1, dtype=np.int64)  # phase code -> place in PHASE_ORDER
    for i, p in enumerate(PHASE_ORDER):
        code = comp.code("phase", p)
        if code >= 0:
            phase_of[code] = i
    ph = phase_of[comp.phase] if comp.n else np.zeros(0, dtype=np.int64)
    sel = np.flatnonzero((comp.mb >= 0) & (ph >= 0))
    rows = comp.rows[sel]
    rank, stage, mb, ph = c.rank[rows], comp.stage[sel], comp.mb[sel], ph[sel]
    # each span's layer, the embedding's and the head's (layer -1 both) told apart by name
    layer = comp.layer[sel].copy()
    if comp.n:
        emb = np.array([_block_name(n) == "embedding" for n in comp.name_names] or [False])[comp.name[sel]]
        top = int(layer.max(initial=0)) + 1
        layer[(layer < 0) & emb] = 0
        layer[(layer < 0) & ~emb] = top  # the head, after every layer
    w = PHASE_ORDER.index("W")
    fb = np.flatnonzero(ph < w)
    found = _phase_misorders(c, rows[fb], (rank[fb], stage[fb], mb[fb]), ph[fb], later=None)
    found += _phase_misorders(c, rows, (rank, stage, mb, layer), ph, later=w)
    out = []
    for _, _, lr, er in sorted(found):
        a, b = c.spans[lr], c.spans[er]
        out.append(_v("phase-order", f"rank {a.rank} stage {a.stage} microbatch {a.mb}: a {b.phase} span starts "
                      f"before a {a.phase} span ends", (a, b)))
    return out


def _block_name(name: str) -> str:
    """A compute span's block: its name without the leading phase ("W attn" -> "attn")."""
    head, _, rest = name.partition(" ")
    return rest if head in PHASE_ORDER and rest else name


def _phase_misorders(c: SpanColumns, rows: np.ndarray, group: tuple[np.ndarray, ...], ph: np.ndarray,
                     later: int | None) -> list[tuple]:
    """(first appearance of the late key, later phase, late row, early row) of each pair of
    phases of one ``group`` (columns of ``rows``, rank first) in which a later phase's first
    span starts before an earlier phase's last one ends; only pairs whose later phase is
    ``later`` when given."""
    if not len(rows):
        return []
    rank = group[0]
    start, end = c.start_s[rows], c.end_s[rows]
    key = mixed_radix(*group, ph)
    if key is None:  # too wide for one number: number the keys
        key = np.unique(np.stack((*group, ph)), axis=1, return_inverse=True)[1].ravel()
    by_rank = rank - rank.min(initial=0)  # the key's leading part: sorting rank by rank is faster
    o_first, _ = grouped_order(by_rank, start, key)  # per key: the earliest start first (ties in span order)
    o_last, _ = grouped_order(by_rank, -end, key)  # per key: the latest end first
    heads = np.flatnonzero(_runs(key[o_first]))  # the same keys in both orders
    early = rows[o_first[heads]]  # per key, in key order
    late = rows[o_last[heads]]
    seen = np.minimum.reduceat(rows[o_first], heads) if len(heads) else heads  # a key's first span
    k_group = [a[o_first[heads]] for a in group]
    k_ph = ph[o_first[heads]]
    found = []
    for off in (1, 2):  # the keys of one group are adjacent, phases ascending
        i = np.arange(len(heads) - off)
        j = i + off
        same = np.ones(len(i), dtype=bool)
        for a in k_group:
            same &= a[i] == a[j]
        if later is not None:
            same &= k_ph[j] == later
        i, j = i[same], j[same]
        late_end = c.end_s[late[i]]
        hit = c.start_s[early[j]] < late_end - _tols(late_end)
        found += zip(seen[i[hit]].tolist(), k_ph[j[hit]].tolist(), late[i[hit]].tolist(), early[j[hit]].tolist())
    return found


# --- 5 ---------------------------------------------------------------------------------
def check_send_recv(program: Program, trace: Trace, cols: SpanColumns | None = None) -> list[Violation]:
    """Every send to a simulated receiver has a receive there with the same start, end and
    bytes (within the tolerance); every receive has a send."""
    c = _view(trace, cols)
    tasks = program.items  # a run's tasks are made only where a violation names one
    tc = trace.task_columns(tasks, program.runs, program)
    tid = c.tid
    is_recv = c.is_in("stream", RECV_STREAMS)
    ok_tid = (tid >= 0) & (tid < len(tasks))
    # a send: not on a receive stream, op "send", its task's communication has a receiver
    maybe = np.flatnonzero(~is_recv & ok_tid & (tc.recv_rank[np.where(ok_tid, tid, 0)] >= 0))
    form_of, op_of_form = c.form_table("op")
    ops = list(map(op_of_form.__getitem__, form_of[maybe].tolist()))
    is_send = np.zeros(c.n, dtype=bool)
    is_send[maybe[np.fromiter(map(eq, ops, repeat("send")), bool, len(ops))]] = True
    # sends: per task id, the last send span (a dict filled in span order), ids in order of appearance
    send_rows = np.flatnonzero(is_send)
    ids, first_at = np.unique(tid[send_rows], return_index=True)
    _, last_rev = np.unique(tid[send_rows][::-1], return_index=True)
    last_rows = send_rows[len(send_rows) - 1 - last_rev]
    by_appearance = np.argsort(first_at, kind="stable")
    ids, last_rows = ids[by_appearance], last_rows[by_appearance]
    # receives grouped by task id, in span order
    recv_rows = np.flatnonzero(is_recv)
    recv_rows = recv_rows[np.argsort(tid[recv_rows], kind="stable")]
    recv_tid = tid[recv_rows]
    lo = np.searchsorted(recv_tid, ids, side="left")
    hi = np.searchsorted(recv_tid, ids, side="right")
    count = hi - lo
    send = np.repeat(np.arange(len(ids)), count)  # (send, candidate receive) pairs
    cand = recv_rows[np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count) + np.repeat(lo, count)]
    s_row = last_rows[send]
    want = tc.recv_rank[ids[send]]
    s_start, s_end, s_size = c.start_s[s_row], c.end_s[s_row], c.take("size_bytes", s_row)
    match = ((c.rank[cand] == want) & (np.abs(c.start_s[cand] - s_start) <= _tols(s_start))
             & (np.abs(c.end_s[cand] - s_end) <= _tols(s_end))
             & (np.abs(c.take("size_bytes", cand) - s_size) <= _tols(s_size)))
    matched = np.zeros(len(ids), dtype=bool)
    matched[send[match]] = True
    out = []
    unmatched = last_rows[~matched]
    if len(unmatched):
        out.append(_v("send-recv", f"{len(unmatched)} send(s) without a matching receive (same time and "
                      "bytes on the receiver)", (c.spans[int(i)] for i in unmatched[:MAX_SPANS])))
    orphan = ~np.isin(recv_tid, ids, kind="table")  # task ids: a table; sorting would import numpy.ma (10 ms)
    if orphan.any():
        # receives of ids without a send: ids in order of their first receive, then span order
        o_rows, o_tid = recv_rows[orphan], recv_tid[orphan]
        _, first_recv, inv = np.unique(o_tid, return_index=True, return_inverse=True)
        o_rows = o_rows[np.lexsort((o_rows, o_rows[first_recv][inv]))]
        out.append(_v("send-recv", f"{len(o_rows)} receive(s) without a send",
                      (c.spans[int(i)] for i in o_rows[:MAX_SPANS])))
    return out


# --- 6 ---------------------------------------------------------------------------------
def check_step_time(trace: Trace, summary: dict[str, Any] | None, cols: SpanColumns | None = None
                    ) -> list[Violation]:
    """The step lasts at least as long as the busiest rank computes (its own union of compute
    spans, not the summary's)."""
    step = (summary or {}).get("step_time_s")
    if step is None:
        step = trace.end_s
    c = _view(trace, cols)
    order, bounds = c.rank_groups
    compute = c.kind == c.code("kind", "compute")
    best, who = 0.0, None
    for i, r in enumerate(c.ranks):
        mine = order[bounds[i]:bounds[i + 1]]
        mine = mine[compute[mine]]
        busy = merged_length(merged(c.start_s[mine], c.end_s[mine]))
        if busy > best:
            best, who = busy, r
    if step < best - _tol(best):
        spans = [s for s in trace.spans if s.rank == who and s.kind == "compute"]
        return [_v("step-time", f"step time {step:.9g} s < rank {who}'s compute time {best:.9g} s",
                   sorted(spans, key=lambda s: -s.end_s))]
    return []


# --- 7 ---------------------------------------------------------------------------------
def check_memory(summary: dict[str, Any] | None) -> list[Violation]:
    out = []
    for st in ((summary or {}).get("memory") or {}).get("stages", []):
        static = st.get("params_bytes", 0.0) + st.get("grads_bytes", 0.0) + st.get("optimizer_bytes", 0.0)
        parts = [st.get(k, 0.0) for k in ("params_bytes", "grads_bytes", "optimizer_bytes")]
        peak = st.get("peak_bytes", 0.0)
        if any(x < 0 for x in parts) or peak < static - _tol(static):
            out.append(_v("memory", f"stage {st.get('stage')}: peak {peak:.6g} B, params+grads+optimizer "
                          f"{static:.6g} B (need peak >= static >= 0)", ()))
            continue
        tl = st.get("timeline")
        if not tl:
            continue
        rec = tl.get("recomputing_bytes") or [0.0] * len(tl["activations_bytes"])
        totals = [a + b + r for a, b, r in zip(tl["activations_bytes"], tl["comm_buffers_bytes"], rec)]
        if min(tl["activations_bytes"] + tl["comm_buffers_bytes"] + rec, default=0.0) < 0:
            out.append(_v("memory", f"stage {st.get('stage')}: negative bytes in its memory timeline", ()))
        from_timeline = static + st.get("transient_bytes", 0.0) + max(totals, default=0.0)
        if abs(from_timeline - peak) > _tol(peak) * 1e3:
            out.append(_v("memory", f"stage {st.get('stage')}: peak {peak:.9g} B but its timeline peaks at "
                          f"{from_timeline:.9g} B (static + transient + activations + buffers + recomputing)", ()))
    return out


# --- 8 ---------------------------------------------------------------------------------
def check_critical_path(summary: dict[str, Any] | None) -> list[Violation]:
    cp = (summary or {}).get("critical_path")
    if not cp:
        return []
    step = summary.get("step_time_s", 0.0)
    if abs(cp["length_s"] - step) > _tol(step) * 1e3 or cp["wait_s"] > _tol(step) * 1e3:
        return [_v("critical-path", f"critical path {cp['length_s']:.12g} s (gaps {cp['wait_s']:.3g} s) "
                   f"!= step time {step:.12g} s", ())]
    return []


# --- 9 ---------------------------------------------------------------------------------
def check_bubble_split(summary: dict[str, Any] | None) -> list[Violation]:
    out = []
    for row in ((summary or {}).get("bubble") or {}).get("per_rank", []):
        parts = (row["warm_up_s"], row["cool_down_s"], row["dependency_s"]["total"], row["imbalance_s"])
        tol = _tol(row["bubble_s"]) * 1e3
        if abs(sum_left(parts) - row["bubble_s"]) > tol or min(parts) < -tol:
            out.append(_v("bubble-split", f"rank {row['rank']}: warm-up, cool-down, dependency, imbalance "
                          f"{', '.join(f'{x:.9g}' for x in parts)} s do not split its bubble "
                          f"{row['bubble_s']:.9g} s", ()))
    return out


def check_rank_map(trace: Trace, summary: dict[str, Any] | None) -> list[Violation]:
    """``simulation.simulated_rank_of_gpu`` (where known) gives every GPU of the world one
    simulated rank of its own pipeline stage (placed by the plan's mesh), each simulated rank
    itself, and each as many GPUs as ``weight`` says."""
    sim = (summary or {}).get("simulation") or {}
    rep = sim.get("simulated_rank_of_gpu")
    if rep is None:
        return []
    out = []
    world = summary.get("world_size", len(rep))
    if len(rep) != world:
        out.append(_v("rank-map", f"{len(rep):,} GPUs mapped for a world of {world:,}", ()))
    ranks = set(trace.ranks)
    if not ranks.issuperset(rep):
        out.append(_v("rank-map", f"GPUs mapped to ranks not simulated: {sorted(set(rep) - ranks)[:5]}", ()))
    wrong = [r for r in trace.ranks if r < len(rep) and rep[r] != r]
    if wrong:
        out.append(_v("rank-map", f"simulated ranks that stand with another: {wrong[:5]}", ()))
    counts = Counter(rep)
    off = [r for r in trace.ranks if counts.get(r, 0) != trace.weight.get(r, 1)]
    if off:
        out.append(_v("rank-map", "GPUs mapped per rank differ from its weight: " + ", ".join(
            f"rank {r} {counts.get(r, 0)} for {trace.weight.get(r, 1)}" for r in off[:5]), ()))
    p = summary.get("plan") or {}
    if all(k in p for k in ("tp", "cp", "dp", "pp", "order")) and len(rep) == p["tp"] * p["cp"] * p["dp"] * p["pp"]:
        order, _ = parse_order(p["order"])
        mesh = Mesh(tp=p["tp"], dp=p["dp"], pp=p["pp"], order=order, cp=p["cp"])
        stage, of = mesh.coord_array("pp"), np.asarray(rep, dtype=np.int64)  # each GPU's pipeline stage
        astray = np.flatnonzero((of < len(rep)) & (stage != stage[np.minimum(of, len(rep) - 1)]))
        if len(astray):
            g = int(astray[0])
            out.append(_v("rank-map", f"{len(astray):,} GPUs stand with a rank of another pipeline stage, as GPU "
                          f"{g} (stage {stage[g]}) with rank {rep[g]} (stage {stage[rep[g]]})", ()))
    return out


VIEW_SAMPLES = 1000  # rows of a handed-over view compared with their spans


def check_view(trace: Trace, cols: SpanColumns) -> list[Violation]:
    """A view handed to the checks holds the spans' own values: rank, stream, start, end and
    task id of up to VIEW_SAMPLES rows spread over the trace equal those of the spans. The
    summary and the checks share that view (its first columns read by the engine when it
    sorted the spans), so a wrong one would mislead both alike; this looks behind it."""
    n = trace.n_spans
    if n != cols.n:
        return [_v("view", f"the view has {cols.n:,} rows for {n:,} spans", ())]
    rows = unique(np.linspace(0, n - 1, min(VIEW_SAMPLES, n)).astype(np.int64)).tolist() if n else []
    names = cols.stream_names
    spans = trace.span_rows()
    sampled = [spans[i] for i in rows]
    bad = [s for s, r, st, a, b, tid in zip(
        sampled, cols.rank[rows].tolist(), cols.stream[rows].tolist(), cols.start_s[rows].tolist(),
        cols.end_s[rows].tolist(), cols.tid[rows].tolist())
        if (s.rank, s.stream, s.start_s, s.end_s, s.tid) != (r, names[st], a, b, tid)]
    return [_v("view", f"{len(bad)} of {len(rows)} sampled rows of the columns differ from their spans", bad)] \
        if bad else []


def check_invariants(program: Program | None, trace: Trace, summary: dict[str, Any] | None = None,
                     cols: SpanColumns | None = None) -> list[Violation]:
    """All violations of the step (empty when it is sound). Checks that need the program are
    skipped when it is None. The spans are read afresh once, for all the checks, unless
    ``cols`` gives them: :func:`clustersim.simulate` hands over the view the summary was made
    from (the spans have not changed since), so the checks judge exactly what it reports and
    a Megatron-1T step does not read its 918,852 spans into columns twice (about 1 s).

    The same as :func:`check_trace` then :func:`check_summary` (``clustersim run``'s writer
    may judge the first while the summary is made, clustersim.output.background)."""
    out = check_view(trace, cols) if cols is not None else []
    if out:  # the checks below would judge the wrong data
        return out
    cols = _view(trace, cols)
    return _trace_checks(program, trace, cols) + check_summary(trace, summary, cols)


def check_trace(program: Program | None, trace: Trace, cols: SpanColumns | None = None) -> list[Violation]:
    """The checks that read the spans and the program only, not the summary: streams, the
    program's dependencies, collectives, phase order, sends and receives (most of the
    checks' work; a view ``cols`` that does not match the spans stops them)."""
    out = check_view(trace, cols) if cols is not None else []
    return out or _trace_checks(program, trace, _view(trace, cols))


def _trace_checks(program: Program | None, trace: Trace, cols: SpanColumns) -> list[Violation]:
    """:func:`check_trace` on a view known to hold the spans."""
    out = check_stream_overlap(trace, cols)
    if program is not None:
        out += check_dependencies(program, trace, cols)
        out += check_collectives(program, trace, cols)
    out += check_phase_order(trace, cols)
    if program is not None:
        out += check_send_recv(program, trace, cols)
    return out


def check_summary(trace: Trace, summary: dict[str, Any] | None, cols: SpanColumns | None = None) -> list[Violation]:
    """The checks of the summary against the spans and itself: step time, memory, critical
    path, bubble split, the map of GPUs to simulated ranks. Drops the program's columns the
    summary shared with the checks."""
    out = check_step_time(trace, summary, _view(trace, cols))
    trace.drop_columns(tasks=True)  # the program's columns, shared with the summary, are no longer needed
    out += check_memory(summary)
    out += check_critical_path(summary)
    out += check_bubble_split(summary)
    out += check_rank_map(trace, summary)
    return out
