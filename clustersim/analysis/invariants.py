"""Invariants every simulated step must satisfy; a violation is a bug in the simulator.

Checked after every simulation (``simulate(..., check=True)``, the default; the CLI's
``--no-check`` skips them). Each check is linear or n log n in the number of spans. See
docs/invariants.md for why each one holds.

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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from ..program.tasks import Program
from ..trace import Span, Trace
from .intervals import length, union

EPS = 1e-12  # absolute float slack, seconds (or bytes)
RECV_STREAMS = ("pp_fwd_recv", "pp_bwd_recv")
MAX_SPANS = 3  # offending spans listed per violation
PHASE_ORDER = ("F", "B", "W")

INVARIANTS = ("stream-overlap", "dependency-order", "collective-sync", "phase-order",
              "send-recv", "step-time", "memory", "critical-path", "bubble-split")


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


# --- 1 ---------------------------------------------------------------------------------
def check_stream_overlap(trace: Trace) -> list[Violation]:
    by_stream: dict[tuple[int, str], list[Span]] = {}
    for s in trace.spans:
        if s.stream not in RECV_STREAMS:
            by_stream.setdefault((s.rank, s.stream), []).append(s)
    out = []
    for (rank, stream), spans in by_stream.items():
        spans.sort(key=lambda s: (s.start_s, s.end_s))
        for a, b in zip(spans, spans[1:]):
            if b.start_s < a.end_s - _tol(a.end_s):
                out.append(_v("stream-overlap", f"spans overlap on rank {rank} stream {stream!r}", (a, b)))
                break  # one report per stream
    return out


# --- 2 ---------------------------------------------------------------------------------
def check_dependencies(program: Program, trace: Trace) -> list[Violation]:
    times = trace.own_spans(program.tasks)
    out = []
    missing = [t for t in program.tasks if t.tid not in times]
    if missing:
        t = missing[0]
        out.append(_v("dependency-order", f"{len(missing)} task(s) have no span, e.g. task {t.tid} "
                      f"{t.name!r} on rank {t.rank} stream {t.stream!r}", ()))
    bad: list[tuple[Span, Span]] = []
    for t in program.tasks:
        if t.tid not in times:
            continue
        span = times[t.tid]
        start = span.start_s
        for d in t.deps:
            if d in times and start < times[d].end_s - _tol(start):
                bad.append((span, times[d]))
    if bad:
        task, dep = bad[0]
        out.append(_v("dependency-order", f"{len(bad)} task(s) start before a dependency ends, e.g. "
                      f"{task.name!r} at {task.start_s:.9g} s before {dep.name!r} ends at {dep.end_s:.9g} s",
                      [task, dep, *(b[0] for b in bad[1:2])]))
    return out


# --- 3 ---------------------------------------------------------------------------------
def check_collectives(program: Program, trace: Trace) -> list[Violation]:
    groups: dict[tuple, list[Span]] = {}
    tasks = program.tasks
    for s in trace.spans:
        if not 0 <= s.tid < len(tasks):
            continue
        t = tasks[s.tid]
        c = t.comm
        if c is None or len(c.members) < 2 or s.rank != t.rank or s.stream != t.stream:
            continue
        groups.setdefault(c.key, []).append(s)
    out = []
    for key, spans in groups.items():
        s0 = spans[0]
        odd = [s for s in spans[1:] if abs(s.start_s - s0.start_s) > _tol(s0.start_s)
               or abs(s.end_s - s0.end_s) > _tol(s0.end_s)]
        if odd:
            out.append(_v("collective-sync", f"members of collective {key!r} do not start and end together",
                          [s0, *odd]))
    return out


# --- 4 ---------------------------------------------------------------------------------
def check_phase_order(trace: Trace) -> list[Violation]:
    # per rank (each holds one stage; replicas of a stage across dp/cp/tp run independently):
    # (rank, stage, mb, phase) -> earliest starting span, latest ending span
    first: dict[tuple[int, int, int, str], Span] = {}
    last: dict[tuple[int, int, int, str], Span] = {}
    for s in trace.spans:
        if s.kind != "compute" or s.mb < 0 or s.phase not in PHASE_ORDER:
            continue
        k = (s.rank, s.stage, s.mb, s.phase)
        if k not in first or s.start_s < first[k].start_s:
            first[k] = s
        if k not in last or s.end_s > last[k].end_s:
            last[k] = s
    out = []
    for (rank, stage, mb, phase), late in last.items():
        i = PHASE_ORDER.index(phase)
        for nxt in PHASE_ORDER[i + 1:]:
            early = first.get((rank, stage, mb, nxt))
            if early is not None and early.start_s < late.end_s - _tol(late.end_s):
                out.append(_v("phase-order", f"rank {rank} stage {stage} microbatch {mb}: a {nxt} span starts before "
                              f"a {phase} span ends", (late, early)))
    return out


# --- 5 ---------------------------------------------------------------------------------
def check_send_recv(program: Program, trace: Trace) -> list[Violation]:
    tasks = program.tasks
    sends: dict[int, Span] = {}
    recvs: dict[int, list[Span]] = {}
    for s in trace.spans:
        if s.stream in RECV_STREAMS:
            recvs.setdefault(s.tid, []).append(s)
        elif s.op == "send" and 0 <= s.tid < len(tasks) and tasks[s.tid].comm is not None \
                and tasks[s.tid].comm.recv_rank >= 0:
            sends[s.tid] = s
    out = []
    unmatched = []
    for tid, s in sends.items():
        want = tasks[tid].comm.recv_rank
        match = [r for r in recvs.get(tid, ()) if r.rank == want
                 and abs(r.start_s - s.start_s) <= _tol(s.start_s) and abs(r.end_s - s.end_s) <= _tol(s.end_s)
                 and abs(r.size_bytes - s.size_bytes) <= _tol(s.size_bytes)]
        if not match:
            unmatched.append(s)
    if unmatched:
        out.append(_v("send-recv", f"{len(unmatched)} send(s) without a matching receive (same time and "
                      "bytes on the receiver)", unmatched))
    orphans = [r for tid, rs in recvs.items() for r in rs if tid not in sends]
    if orphans:
        out.append(_v("send-recv", f"{len(orphans)} receive(s) without a send", orphans))
    return out


# --- 6 ---------------------------------------------------------------------------------
def check_step_time(trace: Trace, summary: dict[str, Any] | None) -> list[Violation]:
    step = (summary or {}).get("step_time_s")
    if step is None:
        step = trace.end_s
    best, who = 0.0, None
    for r, spans in trace.by_rank().items():
        c = length(union((s.start_s, s.end_s) for s in spans if s.kind == "compute"))
        if c > best:
            best, who = c, r
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
        totals = [a + b for a, b in zip(tl["activations_bytes"], tl["comm_buffers_bytes"])]
        if min(tl["activations_bytes"] + tl["comm_buffers_bytes"], default=0.0) < 0:
            out.append(_v("memory", f"stage {st.get('stage')}: negative bytes in its memory timeline", ()))
        from_timeline = static + st.get("transient_bytes", 0.0) + max(totals, default=0.0)
        if abs(from_timeline - peak) > _tol(peak) * 1e3:
            out.append(_v("memory", f"stage {st.get('stage')}: peak {peak:.9g} B but its timeline peaks at "
                          f"{from_timeline:.9g} B (static + transient + activations + buffers)", ()))
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
        if abs(sum(parts) - row["bubble_s"]) > tol or min(parts) < -tol:
            out.append(_v("bubble-split", f"rank {row['rank']}: warm-up, cool-down, dependency, imbalance "
                          f"{', '.join(f'{x:.9g}' for x in parts)} s do not split its bubble "
                          f"{row['bubble_s']:.9g} s", ()))
    return out


def check_invariants(program: Program | None, trace: Trace, summary: dict[str, Any] | None = None
                     ) -> list[Violation]:
    """All violations of the step (empty when it is sound). Checks that need the program are
    skipped when it is None."""
    out = check_stream_overlap(trace)
    if program is not None:
        out += check_dependencies(program, trace)
        out += check_collectives(program, trace)
    out += check_phase_order(trace)
    if program is not None:
        out += check_send_recv(program, trace)
    out += check_step_time(trace, summary)
    out += check_memory(summary)
    out += check_critical_path(summary)
    out += check_bubble_split(summary)
    return out
