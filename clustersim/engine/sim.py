"""The simpy core: streams that run tasks in order, rendezvous for collectives, a network.

Per simulated rank, one stream each for compute, tp, dp, pp_fwd_send, ... (:class:`_Stream`,
driven by callbacks on simpy events). A stream takes its next task when the previous one is
done and the task's dependencies are done — CUDA-stream semantics, so overlap emerges from
dependencies, never from a knob::

    compute  [F attn]     [F mlp]      [B mlp]    [B attn] ...
    tp              [AR]         [AR]          [AR]       [AR]
    dp                                                 [AR bucket 0 ........]

A communication starts when every member rank has reached it. It is timed

* ``ideal``: zero time (what-if: free communication);
* alone (no other communication channel ever uses its links): the closed-form time of its
  flows on the graph (DESIGN: cheapest exact model first);
* otherwise: as flows in the shared :class:`FlowNetwork`.

Tasks whose duration does not depend on what else runs (compute, and the first two kinds of
communication) are timed ahead of the clock, as soon as their inputs' end times are known:
they cost no simpy event. Only flow-network communications run on the clock (their rates
depend on what shares their links at each instant); on a dense step that is the PP sends
alone, and gpt3_175b_1024gpu went from 170,000 events to 27,000, with identical spans (12,000
today).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Callable, Iterator
from itertools import chain, compress, repeat
from operator import itemgetter
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import simpy

from ..hardware.topology import Cluster
from ..program.tasks import Comm, Program, Task
from ..trace import (LinkUse, Span, SpanBase, SpanForm, Trace, appearance_codes, gpu_ranges, index_ranges,
                     stable_argsort, unique, unique_inverse)
from ..codegen import Straight
from ..analysis.links import first_by_use
from ..collectives.algorithms import ALGORITHMS, AUTO, DEEPEP, applicable
from .network import FlowNetwork, FlowPlan, with_pairs, max_min_rates, plan_phases, wire_scales, with_meetings


@dataclass
class _Rendezvous:
    """Members of a communication that have arrived, each at its own start; it runs from the
    last arrival (the latest start), for all of them."""

    streams: list
    start_s: float = 0.0

    def arrive(self, st: _Stream, start_s: float) -> None:
        self.streams.append(st)
        if start_s > self.start_s:
            self.start_s = start_s

    def finish(self) -> None:
        """Its flows ended now: every member goes on, in the order they arrived."""
        for st in self.streams:
            st.finish()


def _comm_tasks(prog: Program):
    """(task, how many) for the communication tasks of ``prog``: each task outside the runs
    of a template once, and those of a template's first run once for all its runs (every run
    of one template has communications of the same shapes, channels and streams,
    ``Program.runs``)."""
    tasks = prog.items
    pos = 0
    for _, first, end, _ in prog.runs:  # in task id order
        yield from ((t, 1) for t in tasks[pos:first] if t.comm is not None)
        pos = end
    yield from ((t, 1) for t in tasks[pos:] if t.comm is not None)
    yield from _run_comm_tasks(prog)


def _run_comm_tasks(prog: Program):
    """(task, how many runs of its template) for the communication tasks of each template's
    first run, templates in order of first use (:func:`_comm_tasks`' second part)."""
    tasks = prog.items  # a template's first run is made, not left to be made (lower._single_action)
    runs_of: dict[int, list] = {}
    for _, first, end, tmpl in prog.runs:
        entry = runs_of.get(id(tmpl))
        if entry is None:
            runs_of[id(tmpl)] = [first, end, 1]
        else:
            entry[2] += 1
    for first, end, n in runs_of.values():
        yield from ((t, n) for t in tasks[first:end] if t.comm is not None)


def _transfer_start(record: tuple) -> float:
    """When a finished flow-network transfer (``FlowNetwork.finished``) started: its kept
    course's start if it followed one, else its first rate change."""
    return record[5][1] if record[5] is not None else record[2][0]


_CHOOSE = frozenset(op for op, algos in ALGORITHMS.items() if len(algos) > 1)  # collectives with a choice
# a collective's group in the trace file lists its GPUs up to about this many characters, then
# how many (an expert group strided over a stage can hold hundreds); group_size counts them all
GROUP_GPUS_CHARS = 160

# candidate links from which _dominated_links first keeps those that can carry e2's share
LOAD_FILTER_FROM = 8


def _stage_of(program: Program) -> dict[int, int]:
    """Rank -> the stage of its last task that has one (ranks in order). Read from the end, it
    stops once every rank is found: a step's last tasks are its ranks' (a million tasks need
    not all be read)."""
    found: dict[int, int] = {}
    want = set(program.ranks)
    left = len(want)
    items = program.items
    for tid in range(len(items) - 1, -1, -1):
        t = items[tid] or program.task(tid)
        if t.stage >= 0 and t.rank not in found:
            found[t.rank] = t.stage
            if t.rank in want:
                left -= 1
                if not left:
                    break
    return dict(sorted(found.items()))


@dataclass
class _LinkFlows:
    """Every (plan, flow, weight) entry of a step's flow plans, by the link it crosses: links
    ascending, each link's entries in plan then flow order, what a loop over the plans' flows
    would collect (as :meth:`as_dict` gives it), on arrays: a 16K-GPU MoE on a fabric without
    rails has 7 million entries, which as tuples took seconds and gigabytes to make and read."""

    links: np.ndarray  # link ids, ascending
    ptr: np.ndarray  # the entries of links[i] are ptr[i]:ptr[i + 1]
    plan: np.ndarray
    flow: np.ndarray
    weight: np.ndarray  # float64
    flow_id: np.ndarray  # per entry, its flow numbered across the plans, in (plan, flow) order

    @classmethod
    def of(cls, on_edge: dict[int, list[tuple[int, int, float]]]) -> _LinkFlows:
        """The arrays of ``on_edge`` (link -> its entries, links in order)."""
        counts = np.fromiter(map(len, on_edge.values()), np.int64, len(on_edge))
        ptr = np.zeros(len(on_edge) + 1, dtype=np.int64)
        np.cumsum(counts, out=ptr[1:])
        n = int(ptr[-1])
        flat = list(chain.from_iterable(on_edge.values()))
        plan = np.fromiter(map(itemgetter(0), flat), np.int64, n)
        flow = np.fromiter(map(itemgetter(1), flat), np.int64, n)
        flow_id = unique_inverse(plan * (int(flow.max(initial=0)) + 1) + flow)  # the rank of (plan, flow)
        return cls(np.fromiter(on_edge, np.int64, len(on_edge)), ptr, plan, flow,
                   np.fromiter(map(itemgetter(2), flat), np.float64, n), flow_id)

    def __len__(self) -> int:
        return int(self.ptr[-1])

    def as_dict(self) -> dict[int, list[tuple[int, int, float]]]:
        """Link -> its (plan, flow, weight) entries, as tuples."""
        rows = list(zip(self.plan.tolist(), self.flow.tolist(), self.weight.tolist()))
        bounds = self.ptr.tolist()
        return {e: rows[lo:hi] for e, lo, hi in zip(self.links.tolist(), bounds, bounds[1:])}

    def subset(self, which: np.ndarray) -> _LinkFlows:
        """The links of indices ``which`` (ascending) with their entries."""
        ent = index_ranges(self.ptr, which)
        ptr = np.zeros(len(which) + 1, dtype=np.int64)
        np.cumsum(np.diff(self.ptr)[which], out=ptr[1:])
        return _LinkFlows(self.links[which], ptr, self.plan[ent], self.flow[ent], self.weight[ent], self.flow_id[ent])

    def distinct(self, bw_Bps: list[float]) -> np.ndarray:
        """The indices of the links left when links of the same bandwidth and the same entries
        (plan, flow and weight, in order) count as one: the first of each, ascending. Links are
        grouped by a hash of their entries, then each is compared entry by entry with the first
        of its group; should two differ (a collision), the entries are compared as tuples::

            hash(link) = mix(sum over its entries k of mix(mix(plan, flow, k) ^ weight) ^ count) ^ mix(bw)

        (sums mod 2**64; ``mix`` is :func:`_mix64`, a bijection that spreads every input bit)
        """
        n_l = len(self.links)
        counts = np.diff(self.ptr)
        bw = np.asarray(bw_Bps, dtype=np.float64)[self.links]
        if n_l == 0:
            return np.zeros(0, dtype=np.int64)
        link_of = np.repeat(np.arange(n_l), counts)
        pos = (np.arange(len(link_of)) - self.ptr[:-1][link_of]).astype(np.uint64)
        u64 = np.uint64
        mix = _mix64((self.plan.astype(u64) * u64(0x9E3779B97F4A7C15)) ^ (self.flow.astype(u64) * u64(0xC2B2AE3D27D4EB4F))
                     ^ (pos * u64(0x165667B19E3779F9)))
        mix = _mix64(mix ^ (self.weight + 0.0).view(u64))  # (+ 0.0: -0.0 as 0.0, as == has them)
        key = _mix64(np.add.reduceat(mix, self.ptr[:-1]) ^ counts.astype(u64)) ^ _mix64(bw.view(u64))
        order = np.argsort(key, kind="stable")  # a group's links in link order
        ranked = key[order]
        first = np.flatnonzero(np.concatenate(([True], ranked[1:] != ranked[:-1])))
        rep = np.empty(n_l, dtype=np.int64)
        rep[order] = np.repeat(order[first], np.diff(np.append(first, n_l)))
        dup = np.flatnonzero(rep != np.arange(n_l))
        if len(dup):
            same = (bw[dup] == bw[rep[dup]]) & (counts[dup] == counts[rep[dup]])
            if same.all():
                a, b = index_ranges(self.ptr, dup), index_ranges(self.ptr, rep[dup])
                eq = (self.plan[a] == self.plan[b]) & (self.flow[a] == self.flow[b]) & (self.weight[a] == self.weight[b])
                starts = np.zeros(len(dup), dtype=np.int64)
                np.cumsum(counts[dup][:-1], out=starts[1:])
                same = np.logical_and.reduceat(eq, starts)
            if not same.all():  # a hash collision: as tuples
                canon: dict[tuple, int] = {}
                return np.fromiter((i for i, (e, sig) in enumerate(self.as_dict().items())
                                    if canon.setdefault((bw_Bps[e], tuple(sig)), i) == i), np.int64)
        return np.flatnonzero(rep == np.arange(n_l))


def _on_links(kept: np.ndarray, plan: FlowPlan) -> FlowPlan:
    """``plan`` on the links ``kept`` marks (a mask over the cluster's links) only: each flow's
    pairs on the others dropped, from its tuple and from the plan's arrays
    (``FlowPlan.pairs``). A flow that loses none keeps its tuple as it is."""
    sizes, edge, w = plan.pairs
    on = kept[edge]
    flow_of = np.repeat(np.arange(len(sizes)), sizes)
    cut = np.bincount(flow_of[~on], minlength=len(sizes)).tolist()
    flags, ends = on.tolist(), np.cumsum(sizes).tolist()
    weights = tuple(ws if not c else tuple(compress(ws, flags[end - len(ws):end]))
                    for ws, c, end in zip(plan.weights, cut, ends))
    out = FlowPlan(weights=weights, fractions=plan.fractions, latency_s=plan.latency_s, wire_scale=plan.wire_scale,
                   wire_scale_out=plan.wire_scale_out, orbit_symmetric=plan.orbit_symmetric)
    return with_pairs(out, (np.bincount(flow_of[on], minlength=len(sizes)), edge[on], w[on]))


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (Steele, Lea and Flood, "Fast splittable
    pseudorandom number generators", OOPSLA 2014): each output bit depends on every input bit."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _flows_on_links(plans: list[FlowPlan]) -> _LinkFlows:
    """The (plan, flow, weight) of every flow crossing each link, on arrays (:class:`_LinkFlows`)."""
    parts = [plan.pairs for plan in plans]
    edge = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
    if not len(edge):
        z = np.zeros(0, dtype=np.int64)
        return _LinkFlows(z, np.zeros(1, dtype=np.int64), z, z, np.zeros(0), z)
    weight = np.concatenate([p[2] for p in parts])
    plan_of = np.repeat(np.arange(len(parts)), [len(p[1]) for p in parts])
    flow_of = np.concatenate([np.repeat(np.arange(len(p[0])), p[0]) for p in parts])
    first = np.cumsum([0] + [len(p[0]) for p in parts])  # each plan's first flow among all
    order = stable_argsort(edge)  # by link, the pairs' own order within each
    edge = edge[order]
    bounds = np.flatnonzero(np.concatenate(([True], edge[1:] != edge[:-1], [True])))
    plan_of, flow_of = plan_of[order], flow_of[order]
    return _LinkFlows(edge[bounds[:-1]], bounds, plan_of, flow_of, weight[order], first[plan_of] + flow_of)


class _Lazy(dict):
    """A dict that makes a missing value with ``make(key)`` on first use."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, key):
        value = self[key] = self.make(key)
        return value


def _implied_rows(on: _LinkFlows, bw_Bps: list[float], few: int = 128):
    """:func:`_dominated_links`' question on arrays, for every link e2 whose fewest-links flow
    crosses at most ``few`` links: which links e1 imply it (carry each of its flows with
    w1(f) * c2/c1 >= w2(f) (1 - 1e-12), the test of the loop, in the same floats). The
    candidates are that flow's links; each (e2, e1) pair is checked flow by flow by looking
    (e1, flow) up among the sorted (link, flow) keys. (``few``: on a three-tier fabric without
    rails a 16K-GPU all-to-all's flow stands for its twins on 94-96 links; left to the loop
    (``few`` 64), the 8,300 links where such a flow is the fewest-links one took 1.2-1.3 s,
    against 0.3-0.4 s more here. A DP ring's orbit flow crosses thousands: taking those here
    too doubled the time)::

        e2 = L7, flows {f3 (crosses L2 L7 L9), f8 (crosses 40 links)}
        pairs (L7, L2) (L7, L9)  ->  look up (L2, f3) (L2, f8) (L9, f3) (L9, f8)  ->  L9 implies L7

    Returns (per link in order, whether it was looked at here; link -> its sorted implying
    links, for those that have any; for the loop, made on first use: link -> {flow: weight},
    flow -> set of its links, flow -> its (weight per capacity, link) in order), or None when a
    flow lists a link twice (the loop keeps the last weight)."""
    links = on.links.tolist()
    n_l = len(links)
    ptr, w, flow = on.ptr, on.weight, on.flow_id
    counts = np.diff(ptr)
    n = int(ptr[-1])
    link_of = np.repeat(np.arange(n_l), counts)  # link index of each entry
    n_f = int(flow.max()) + 1
    key = link_of * n_f + flow
    if (key[1:] >= key[:-1]).all():  # (the usual order: each link's flows numbered in plan order)
        key_sorted, w_sorted = key, w
    else:
        by_key = np.argsort(key)
        key_sorted, w_sorted = key[by_key], w[by_key]
    if (key_sorted[1:] == key_sorted[:-1]).any():
        return None
    n_links = np.bincount(flow, minlength=n_f)
    by_flow = np.argsort(flow, kind="stable")  # each flow's links, in link order (the entries' own)
    flow_ptr = np.zeros(n_f + 1, dtype=np.int64)
    np.cumsum(n_links, out=flow_ptr[1:])
    flow_links = link_of[by_flow]
    # each link's flow with the fewest links (the first such): its candidates are that flow's links
    spread = n_links[flow]
    least = np.flatnonzero(spread == np.minimum.reduceat(spread, ptr[:-1])[link_of])
    fewest = least[np.concatenate(([True], link_of[least][1:] != link_of[least][:-1]))]
    light = np.flatnonzero(n_links[flow[fewest]] <= few)
    pair_e2 = np.repeat(light, n_links[flow[fewest[light]]])
    pair_e1 = flow_links[index_ranges(flow_ptr, flow[fewest[light]])]
    # e1 must carry every flow of e2 (none twice): at least as many
    other = (pair_e1 != pair_e2) & (counts[pair_e1] >= counts[pair_e2])
    pair_e2, pair_e1 = pair_e2[other], pair_e1[other]
    implied: dict[int, list[int]] = {}
    bw_all = np.asarray(bw_Bps, dtype=np.float64)
    bw = bw_all[links]
    # each pair checked flow by flow in rounds of 2, 4, 8, ... of e2's entries, a pair left
    # out once a flow fails it (most fail on their first flows: a 16K-GPU MoE's 630,000 pairs
    # carry 32 million entries, of which 3 million are looked at)
    alive, done = np.arange(len(pair_e2)), 0
    width = 2
    while len(alive):
        e2, e1 = pair_e2[alive], pair_e1[alive]
        take = np.clip(counts[e2] - done, 0, width)
        if not take.any():
            break
        pair_of = np.repeat(np.arange(len(alive)), take)
        ent = np.repeat(ptr[e2] + done - (np.cumsum(take) - take), take) + np.arange(len(pair_of))
        q = e1[pair_of] * n_f + flow[ent]
        at = np.minimum(np.searchsorted(key_sorted, q), n - 1)
        scale = bw[e2] / bw[e1]
        ok = (key_sorted[at] == q) & (w_sorted[at] * scale[pair_of] >= w[ent] * (1 - 1e-12))
        alive = alive[np.bincount(pair_of[~ok], minlength=len(alive)) == 0]
        done += width
        width *= 2
    good = alive[np.lexsort((pair_e1[alive], pair_e2[alive]))]
    for i2, i1 in zip(pair_e2[good].tolist(), pair_e1[good].tolist()):
        implied.setdefault(links[i2], []).append(links[i1])
    is_light = np.zeros(n_l, dtype=bool)
    is_light[light] = True

    index = {e: i for i, e in enumerate(links)}

    def flows_on(e: int) -> dict[int, float]:
        lo, hi = ptr[index[e]], ptr[index[e] + 1]
        return dict(zip(flow[lo:hi].tolist(), w[lo:hi].tolist()))

    # (the links' own int objects, shared by every set: thousands of sets of thousands of links)
    links_on = _Lazy(lambda f: set(map(links.__getitem__, flow_links[flow_ptr[f]:flow_ptr[f + 1]].tolist())))
    link_ids = np.asarray(links, dtype=np.int64)

    def by_load(f: int) -> tuple[list[float], list[int]]:  # the loop's sorted (w / c, link), on arrays
        mine = by_flow[flow_ptr[f]:flow_ptr[f + 1]]
        ids = link_ids[link_of[mine]]
        x = w[mine] / bw_all[ids]
        order = np.lexsort((ids, x))
        return x[order].tolist(), ids[order].tolist()

    return is_light.tolist(), implied, _Lazy(flows_on), links_on, _Lazy(by_load)


# (link, flow) entries from which _dominated_links looks for implying links on arrays
DOMINATED_ROWS_FROM = 20_000


def _dominated_links(on_edge: dict[int, list] | _LinkFlows, bw_Bps: list[float]) -> set[int]:
    """Links whose capacity constraint is implied by another link's, whatever flows are active.

    Link e2 is implied by e1 when every flow crossing e2 also crosses e1 with at least its
    weight scaled by the capacities, w1(f) * c2/c1 >= w2(f): then for any rates r >= 0,
    sum w2 r <= (c2/c1) sum w1 r <= c2. Dropping e2 leaves the feasible rates, and so the
    max-min allocation, unchanged; a fair-share computation then touches a few links per flow
    (an all-to-all's many per-destination links are all implied by its source's).

    ``on_edge``: link -> its (plan, flow, weight) entries, links in order, as a dict or as
    :class:`_LinkFlows`. Links are taken in order, and a link dropped already implies none
    after it. Which links could imply a link does not depend on that order: with many (link,
    flow) entries, it is worked out on arrays first (:func:`_implied_rows`), and only the
    order is left to the loop.
    """
    arrays = on_edge if isinstance(on_edge, _LinkFlows) else None
    big = (len(arrays) if arrays is not None else sum(map(len, on_edge.values()))) >= DOMINATED_ROWS_FROM
    if big and arrays is None:
        arrays = _LinkFlows.of(on_edge)
    rows = _implied_rows(arrays, bw_Bps) if big else None
    if rows is None and isinstance(on_edge, _LinkFlows):
        on_edge = on_edge.as_dict()
    if rows is None:
        links, counts = list(on_edge), None
        light, implied = [False] * len(links), {}
        sig = {e: {(pi, fi): w for pi, fi, w in flows} for e, flows in on_edge.items()}
        # the links each flow crosses among those considered (only they can imply a link: a plan's
        # own list of a flow's links can be the thousands its twins cross)
        links_of: dict = {}
        for e, flows in sig.items():
            for f in flows:
                links_of.setdefault(f, set()).add(e)

        def load_order(f) -> tuple[list[float], list[int]]:  # (weight per capacity, link), in order
            pairs = sorted((sig[e][f] / bw_Bps[e], e) for e in links_of[f])
            return [x for x, _ in pairs], [e for _, e in pairs]

        loads = _Lazy(load_order)
    else:  # flows numbered, {flow: weight} per link and each flow's links made when needed
        links, counts = arrays.links.tolist(), np.diff(arrays.ptr).tolist()
        light, implied, sig, links_of, loads = rows
    dropped: set[int] = set()

    def _by_load(f, floor: float) -> list[int]:
        """The links of flow ``f`` on which it weighs at least ``floor`` per unit of capacity."""
        xs, es = loads[f]
        return es[bisect_left(xs, floor):]

    # links crossed by one flow only (most links of a flow standing for many twins): of those
    # of one flow, the one with the highest weight per capacity implies the others
    single: dict = {}
    for k, e in enumerate(links):
        if (counts[k] if counts is not None else len(sig[e])) == 1:  # (rows: no flow twice on a link)
            single.setdefault(next(iter(sig[e])), []).append(e)
    for f, es in single.items():
        best = max(es, key=lambda e: (sig[e][f] / bw_Bps[e], -e))
        for e2 in es:
            if e2 != best and sig[best][f] * (bw_Bps[e2] / bw_Bps[best]) >= sig[e2][f] * (1 - 1e-12):
                dropped.add(e2)
    for e2, on_arrays in zip(links, light):
        if e2 in dropped:
            continue
        if on_arrays:  # the links that imply it were worked out on arrays: the first still kept
            for e1 in implied.get(e2, ()):
                if e1 not in dropped:
                    dropped.add(e2)
                    break
            continue
        flows2 = sig[e2]
        # e1 must carry every flow that crosses e2: intersect those flows' links
        cands: set[int] | None = None
        for ls in sorted(map(links_of.__getitem__, flows2), key=len):  # smallest first: a flow
            cands = set(ls) if cands is None else cands & ls  # standing for many twins has thousands
            if len(cands) <= 1:
                break
        cands.discard(e2)
        if len(cands) > LOAD_FILTER_FROM:  # flows that cross thousands of links (an orbit's): keep the
            # links that carry each of them with enough weight per capacity, a condition every e1
            # must meet (with a margin far above rounding, so only links that would fail go)
            for f, w2 in flows2.items():
                cands.intersection_update(_by_load(f, w2 / bw_Bps[e2] * (1 - 1e-9)))
        for e1 in sorted(cands):
            if e1 in dropped:
                continue
            flows1, scale = sig[e1], bw_Bps[e2] / bw_Bps[e1]
            if all(f in flows1 and flows1[f] * scale >= w * (1 - 1e-12) for f, w in flows2.items()):
                dropped.add(e2)
                break
    return dropped


def _shape(c: Comm) -> tuple:
    """What a communication's flows depend on, by value: (op, group, twins, load). The
    engine's plans, algorithms and closed forms are keyed by it (plus algorithm, size or
    stream)."""
    return (c.op, c.group, c.twins, c.load)


def _asymmetric_orbits(phased: dict[tuple, tuple[FlowPlan, ...]], keys_of: dict[str, set]) -> dict[str, int]:
    """Communication kind -> how many of its distinct communications (``keys_of[kind]``: their
    plans' keys in ``phased``, (op, group, twins, load, algorithm): a stage's sends to the
    next, a DP group's all-reduce; not tasks) have a phase whose orbit is not symmetric
    (``FlowPlan.orbit_symmetric``: twins on links unlike the simulated instance's), which then
    moves at its slowest twin's pace::

        simulated   a  -> spine 1 ---------------> b     rank by rank: each at its own pace
        twin        a' -> spine 0 (another send) -> b'   collapsed: a too at the pace of a'

    Twins slowed only where they meet another communication's (Engine._meetings) are not
    counted: those orbits are symmetric, and mostly exact (docs/architecture.md, "Known
    limitations")."""
    counts = {kind: sum(not all(p.orbit_symmetric for p in phased[key]) for key in keys)
              for kind, keys in keys_of.items()}
    return {kind: n for kind, n in counts.items() if n}


def _shape_id(c: Comm) -> tuple:
    """A communication's shape by identity, for the engine's caches: hashing its twins (dozens
    of groups) costs more than the rest of a start. The lowering shares group and twin tuples
    between the communications of one shape, and the program keeps them alive as long as the
    engine, so equal ids mean equal tuples (equal tuples under different ids only miss)."""
    return (c.op, id(c.group), id(c.twins), c.size_bytes, id(c.load))


@dataclass(frozen=True, eq=False)
class LinkLoads:
    """What one communication puts on each link it crosses, twins included
    (:meth:`Engine.link_loads`): the links in id order, the seconds its traffic needs on each
    at the link's full bandwidth, and the real flows on each in its busiest phase."""

    edges: np.ndarray
    busy_s: np.ndarray
    flows: np.ndarray

    def __contains__(self, e: int) -> bool:
        i = int(np.searchsorted(self.edges, e))
        return i < len(self.edges) and int(self.edges[i]) == e

    def busiest(self) -> tuple[int, float, float] | None:
        """(link, seconds, flows) of the link with the most seconds to nine digits, the lowest
        id among those equal there (a collapsed run's twins sum a link's load in another order:
        last bits named another of equal links); None where it crosses none. Picked as the
        summary picks its busiest links (analysis.links.first_by_use; the edges are in id
        order, so the lowest index is the lowest id)."""
        if not len(self.edges):
            return None
        i = first_by_use(self.busy_s, np.arange(len(self.edges)), 1, int)[0]
        return int(self.edges[i]), float(self.busy_s[i]), float(self.flows[i])

    def as_dict(self) -> dict[int, tuple[float, float]]:
        """link -> (seconds, flows)."""
        return dict(zip(self.edges.tolist(), zip(self.busy_s.tolist(), self.flows.tolist())))


class Engine:
    """Runs one Program to completion and returns its Trace."""

    def __init__(self, program: Program, cluster: Cluster, network: str = "flow",
                 algorithms: dict[str, str] | None = None):
        self.prog = program
        self.cluster = cluster
        self.network = network
        self.algorithms = dict(algorithms or {})  # collective -> "auto" or an algorithm name
        self.env = simpy.Environment()
        self.net = FlowNetwork(self.env, cluster.edge_bw_Bps)
        # when each task ends, -1 while unknown. A task's end is known as soon as its inputs
        # are: a fixed-duration task (compute, or a communication timed in closed form) is
        # worked out ahead of the clock; only communications in the flow network wait for it
        # (see _Stream). Completion is no simpy event: the streams waiting for it are woken
        # by a direct call once the current callback is done (:meth:`_wake`).
        self.end_s: list[float] = [-1.0] * len(program.items)
        self.waiters: dict[int, list[_Stream]] = {}  # task id -> streams waiting for it, while they wait
        self._ready: deque[_Stream] = deque()
        self._waking = False
        self._chasing = 0  # streams stepped by a dependent's chase, nested (_Stream.step)
        self._stream_of: list = []
        self._loop: tuple = ()  # while it runs: what the stream loop reads of the engine (run)
        # the spans in the order recorded: Span objects, and a run timed in one go as one
        # record (_straight_code; SpanBase.of_log reads both as columns)
        self.spans: list = []
        # the spans' shared fields (SpanForm), one per distinct set of values (equal as Python
        # compares them: 0 and 0.0 share one); keys in FORM_FIELDS order, then comm_args
        self.forms: dict[tuple, SpanForm] = {}
        # task id -> the form of its own span where known before the run (tasks of templates:
        # one list of forms per template), else None
        self._form_of: list[SpanForm | None] = [None] * len(program.items)
        self._recv_forms: dict[tuple, SpanForm] = {}  # (send's form, sender, receiver, stage) -> the receive's
        self._comm_args: dict[tuple, tuple] = {}  # a collective's shape by identity and channel -> comm_args
        self._rdv: dict[tuple, _Rendezvous] = {}  # communication -> its members so far (several)
        self._plans: dict[tuple, tuple[FlowPlan, ...]] = {}
        self._algos: dict[tuple, str] = {}
        self._own_plans: dict[tuple, tuple[FlowPlan, ...]] = {}  # (op, group, load, algo): _own_plan
        self._shared_orbits: dict[tuple, object] = {}  # what sibling orbits share (network.plan_phases)
        # plan key -> {phase: the scale-out links where its twins meet another communication's}
        self._meeting: dict[tuple, dict[int, np.ndarray]] = {}
        self._kept: dict | None = None  # while _classify plans: plan key -> network.plan_phases's kept
        # what _twins_links reads, kept from _classify until the link use first asks (_accounting):
        # the makers and the plans before meetings
        self._makers: dict | None = None
        self._before_meetings: dict | None = None
        self._alone: dict[tuple, float | None] = {}
        self._channel_codes: dict[tuple, int] = {}  # (channel, orbit, stream) -> its code (_classify)
        self._loads_of: dict[tuple, LinkLoads] = {}  # link_loads, by shape and size
        self._plan_of: dict[tuple, tuple[FlowPlan, ...]] = {}  # by (op, id group, id twins, size)
        self._alone_of: dict[tuple, float] = {}  # the same and the stream; -1: not alone
        self._full_of: dict[tuple, tuple[FlowPlan, ...]] = {}
        self._start_of: dict[tuple, tuple] = {}  # by _shape_id: (phases, the same with every link)
        self._full_plans: dict[tuple, tuple[FlowPlan, ...]] = {}  # before links were merged or dropped
        # the same with every scale-out link a twin crosses, weighing the twins there (_twins_links);
        # None until the link use asks (_accounting)
        self._account_plans: dict[tuple, tuple[FlowPlan, ...]] | None = None
        # communications timed in closed form: id -> (the communication, its starts); by object,
        # so that a segment logs a start with one append (:meth:`_starts_log`)
        self._alone_starts: dict[int, tuple[Comm, list[float]]] = {}
        # the Repeat that cuts the records above (repeated, cut_records), when link_use first
        # asks (_cut_records); they are cut once that has made _finished_cut
        self._cut_by = None
        self._last_end_s = 0.0  # the step the link use is over (step_s): set by run, repeated or cut_records
        # the flow network's finished transfers as the cut copies them (_cut_records): which
        # record is in each place, and how many periods it moves; None: each once, unmoved
        self._finished_cut: tuple[list[int], list[int], float] | None = None
        self._census: dict[tuple, list] = {}  # shape -> [a communication of it, how many tasks]
        self.asymmetric_orbits: dict[str, int] = {}  # (_asymmetric_orbits; set by _classify)
        self.stage_of = _stage_of(program)
        if network == "flow":
            self._classify()

    # --- communication timing -------------------------------------------------------
    def _plan(self, c: Comm, algo: str | None = None) -> tuple[FlowPlan, ...]:
        """The phases of ``c`` by ``algo`` (default: the one it runs with)."""
        if algo is None:
            fast = _shape_id(c)
            phases = self._plan_of.get(fast)
            if phases is None:
                phases = self._plan_of[fast] = self._plan(c, self.algorithm(c))
            return phases
        key = (*_shape(c), algo)
        if key not in self._plans:
            # (its siblings follow from its group and twins: lower.Symmetry.siblings)
            self._plans[key] = plan_phases(self.cluster, c, algo, self.prog.siblings.get((c.group, c.twins), ()),
                                           self._shared_orbits,
                                           None if self._kept is None else self._kept.setdefault(key, {}),
                                           route=self.prog.routing)
        return self._plans[key]

    def _full_plan(self, c: Comm) -> tuple[FlowPlan, ...]:
        """The phases of ``c`` with every link they cross (for link accounting): before
        :meth:`_classify` merged and dropped links, or the plan itself when it did not run."""
        fast = _shape_id(c)
        full = self._full_of.get(fast)
        if full is None:
            full = self._full_of[fast] = self._full_plans.get((*_shape(c), self.algorithm(c))) or self._plan(c)
        return full

    def _account_plan(self, c: Comm) -> tuple[FlowPlan, ...]:
        """The phases of ``c`` as the link use counts them: :meth:`_full_plan` with every
        scale-out link its twins cross (:meth:`_twins_links`); asked once per shape, by the
        link use."""
        return self._accounting().get((*_shape(c), self.algorithm(c))) or self._full_plan(c)

    def _accounting(self) -> dict[tuple, tuple[FlowPlan, ...]]:
        """Plan key -> its phases as the link use counts them (:meth:`_twins_links`), worked out
        the first time the link use asks: a run whose summary lists no links (a sweep's) never
        does, and ``clustersim run`` does in the writer's process (clustersim.output.background)."""
        if self._account_plans is None:
            accounted = self._twins_links(self._before_meetings) if self._makers else {}
            self._account_plans = {key: accounted.get(key, phases) for key, phases in self._full_plans.items()}
            self._makers = self._before_meetings = None
        return self._account_plans

    def _tags_as_counted(self) -> None:
        """The flow network's finished transfers tagged with their phases as the link use counts
        them (:meth:`_accounting`), where those differ from the timing's (tagged when they started)."""
        swap = {id(f): a for key, counted in self._accounting().items()
                for f, a in zip(self._full_plans[key], counted) if f is not a}
        if swap:
            finished = self.net.finished
            finished[:] = [(swap.get(id(r[0]), r[0]), *r[1:]) for r in finished]

    def _twins_links(self, phased: dict) -> dict[tuple, tuple[FlowPlan, ...]]:
        """Per plan whose symmetric orbit's twins cross scale-out links (or any link where GPUs
        share a NIC: Cluster.twins_cross_mask) no simulated flow of its communication
        crosses (``phased``: the plans before :meth:`_meetings`), its phases with those links
        too (network.with_meetings on all of them), each weighing how many instances' flow k
        cross it: what the twins carry there, which the link use counts
        (:meth:`_account_plan`). The timing's plans weigh them only where they meet another
        communication's (:meth:`_meetings`); elsewhere each twin's flow k moves as the
        simulated one does, on links of the same signature, so counting them changes no time.
        A link a sibling orbit's simulated flows cross (the same communication, load and
        algorithm) weighs every orbit's real flows there already (network.plan_phases); one of
        another plan of its communicator (another load, another algorithm) does not::

            DP ring, 8 nodes under 2 leaves; simulated instance over spine 1, a twin over spine 3
            timing       flow k: own links (NICs, leaf0 -> spine1 ...)
            link use     flow k: the same, and leaf0 -> spine3 ... (1: the twin's flow k)"""
        out: dict[tuple, list[FlowPlan]] = {}
        orbits: dict[tuple, list[tuple]] = {}  # a communication's sibling orbits: its family, load and algorithm
        for n, keys in self._families(phased).items():
            for key in keys:
                orbits.setdefault((n, key[3], key[4]), []).append(key)
        # (inside nodes, a twin GPU's links take its class's simulated rank's use, but where the
        # classes split a stage: Program.split_stage)
        counted = None if self.prog.split_stage else self.cluster.twins_cross_mask
        for key, k, twins in self._uncovered(phased, orbits.values()):
            if counted is not None:
                twins = twins[counted[twins]]
            if len(twins) and k in self._makers.get(key, {}):
                phases = out.setdefault(key, list(phased[key]))
                phases[k] = with_meetings(self._makers[key][k], twins)
        return {key: tuple(phases) for key, phases in out.items()}

    def _uncovered(self, phased: dict, groups) -> Iterator[tuple[tuple, int, np.ndarray]]:
        """Per group of plans of ``phased`` (lists of their keys), phase by phase: (a plan's key,
        the phase, the links its real flows cross that no simulated flow of the group's plans
        crosses in that phase), for each plan that crosses a link there (:meth:`_meetings`,
        :meth:`_twins_links`)."""
        covered = np.zeros(len(self.cluster.edges), dtype=bool)  # the group's simulated links, a phase at a time
        for keys in groups:
            for k in range(max(len(phased[key]) for key in keys)):
                # (a plan crossing no link has none among its own links either)
                plans = [(key, phased[key][k]) for key in keys if k < len(phased[key])
                         and phased[key][k].meet_real is not None and len(phased[key][k].meet_real)]
                if not plans:
                    continue
                own = np.fromiter(set().union(*(p.edges for _, p in plans)), np.int64)
                covered[own] = True
                for key, plan in plans:
                    yield key, k, plan.meet_real[~covered[plan.meet_real]]
                covered[own] = False

    def _families(self, phased: dict) -> dict[int, list[tuple]]:
        """The plans of ``phased`` by communication: one operation over its groups, its sibling
        orbits' included (one communicator, whose collectives run one after another)."""
        family_of: dict[tuple, int] = {}  # (op, every group) -> its number
        keys_of: dict[int, list[tuple]] = {}
        for key in phased:
            op, g, tw, _, _ = key
            groups = frozenset((g, *tw, *(x for orbit in self.prog.siblings.get((g, tw), ()) for x in orbit)))
            keys_of.setdefault(family_of.setdefault((op, groups), len(family_of)), []).append(key)
        return keys_of

    def _closed_form_s(self, phases: tuple[FlowPlan, ...], size_bytes: float, tuner: bool = False) -> float:
        """Time of ``phases`` alone on their links: per phase, latency plus its slowest flow.
        ``tuner``: as the tuner sees them (:meth:`algorithm`), the fabric's links beyond the
        NICs left out."""
        total = 0.0
        for plan in phases:
            weights = list(plan.weights)
            if tuner:
                seen = self.cluster.tuner_sees
                weights = [tuple(p for p in ws if seen[p[0]]) for ws in weights]
            rates = max_min_rates(weights, self.cluster.edge_bw_Bps)
            total += plan.latency_s + max((f * size_bytes / r for f, r in zip(plan.fractions, rates)), default=0.0)
        return total

    def algorithm(self, c: Comm) -> str:
        """The algorithm ``c`` runs with: as configured for its collective, or ("auto") the
        applicable one fastest alone on its links at its size, as NCCL's tuner chooses by size
        and topology. A configured algorithm that cannot run this group (NVLS across nodes,
        hierarchical inside one) falls back to the default (ring).

        "Alone" is the group's own instance, without the twins it stands for: each
        communicator tunes itself, and a rank-by-rank run, which has no twins, must choose as
        the collapsed one does. (Weighed with its twins, a DP all-reduce over 32 GPUs of a
        Clos without rails chose tree where each instance alone chooses hierarchical: the
        collapsed step was 6.8 % shorter than the rank-by-rank one, bench/fuzz_symmetry.py.)

        "On its links" is as the tuner sees them: the GPUs' own links (NVLink, PCIe) and their
        NICs' cables, not the fabric's switches beyond. NCCL's topology search stops at the
        NIC and its cost model takes the network's bandwidth from the NICs; which spine ECMP
        hashes each flow to is unknown to it. So equivalent groups choose alike, whatever the
        hashing does to each. (Weighing the spines, one DP group of four on three GB200 racks
        chose hierarchical where the others chose tree, its flows spread better by the hash,
        and the collapsed step, every twin on the simulated group's tree, was 5.2 % shorter
        than the rank-by-rank one.) The flows themselves still cross the spines they hash to.

        A MoE dispatch of a program whose dispatcher deduplicates (``Program.routing``) runs
        by ``deepep``, DeepEP's own kernels rather than an NCCL algorithm."""
        key = (*_shape(c), c.size_bytes)
        if key not in self._algos:
            if c.op == "all_to_all" and self.prog.routing and c.key[0] == "ep":
                self._algos[key] = DEEPEP
                return DEEPEP
            options = ALGORITHMS.get(c.op, ("ring",))
            nvls = self.cluster.gpu.nvls_efficiency is not None and self.cluster.cfg.node.gpus > 1
            usable = [a for a in options if applicable(c.op, a, c.group, self.cluster.node_of, nvls)] or [options[0]]
            want = self.algorithms.get(c.op, "auto")
            if want != "auto":
                choice = want if want in usable else options[0]
                self._algos[key] = choice
                return choice
            usable = [a for a in usable if a in AUTO.get(c.op, options)] or usable
            if len(usable) == 1 or c.size_bytes <= 0:
                choice = usable[0]
            else:
                choice = min(usable, key=lambda a: (self._closed_form_s(self._own_plan(c, a), c.size_bytes, True),
                                                    options.index(a)))
            self._algos[key] = choice
        return self._algos[key]

    def _own_plan(self, c: Comm, algo: str) -> tuple[FlowPlan, ...]:
        """The phases of ``c``'s own instance by ``algo``, without its twins: as the rank-by-rank
        run's communication of its group is, every member simulated (:meth:`algorithm`)."""
        key = (c.op, c.group, c.load, algo)
        plan = self._own_plans.get(key)
        if plan is None:
            alone = replace(c, twins=(), members=tuple(sorted(set(c.group))))
            plan = self._own_plans[key] = plan_phases(self.cluster, alone, algo, route=self.prog.routing)
        return plan

    def _classify(self) -> None:
        """Plan every communication once; merge equivalent links; find channels alone on theirs.

        Two links on which every flow of the step has the same weight, and which have the same
        bandwidth, impose the same constraint: keep one (exact, and it keeps the fair-share
        computation small when a flow stands for many twins on parallel rails). A link whose
        constraint another link implies in every mix of flows is dropped too
        (:func:`_dominated_links`).
        """
        # a channel is one (kind, orbit) on one stream: a stream never overlaps itself, two
        # streams of the same kind and group (ZeRO-3 gathers and gradient reductions) can
        # first by identity (cheap), then by value: hashing twins once per distinct object
        distinct: dict[tuple, Task] = {}
        for t, n in _comm_tasks(self.prog):
            c = t.comm
            fast = _shape_id(c)
            distinct[(*fast, c.key[:2], t.stream)] = t
            self._count(fast, c, n)
        shapes: dict[tuple, Comm] = {}
        keys_of: dict[str, set] = {}  # communication kind -> its plans' keys (for asymmetric_orbits)
        for t in distinct.values():
            key = (*_shape(t.comm), self.algorithm(t.comm))
            shapes[(*key, t.comm.key[:2] + (t.stream,))] = t.comm
            keys_of.setdefault(t.kind, set()).add(key)
        self._kept = {}  # (every plan is made here first: each phase crossing a scale-out link keeps its maker)
        phased = {(op, g, tw, ld, a): self._plan(c, a) for (op, g, tw, ld, a, _), c in shapes.items()}
        self._before_meetings = dict(phased)  # (for _twins_links, when the link use asks)
        for key, meeting in self._meetings(phased).items():
            self._meeting[key] = meeting
            kept = self._kept[key]
            phased[key] = self._plans[key] = tuple(with_meetings(kept[k], meeting[k]) if k in meeting else plan
                                                   for k, plan in enumerate(phased[key]))
        self._makers, self._kept = self._kept, None
        self.asymmetric_orbits = _asymmetric_orbits(phased, keys_of)
        plans = {(key, k): plan for key, phases in phased.items() for k, plan in enumerate(phases)}
        on_edge = _flows_on_links(list(plans.values()))
        bw = self.cluster.edge_bw_Bps
        distinct = on_edge.subset(on_edge.distinct(bw))
        kept_links = np.zeros(len(bw), dtype=bool)  # the distinct links none of which another implies
        kept_links[distinct.links] = True
        kept_links[list(_dominated_links(distinct, bw))] = False
        for key, phases in phased.items():
            self._full_plans[key] = phases
            self._plans[key] = tuple(map(partial(_on_links, kept_links), phases))
        # a channel is (name, orbit, stream), and an orbit is a rank per group member: hashed
        # once per shape here, not once per link (a DP ring over 16,384 GPUs: a tuple of
        # 16,384, 65,536 links)
        codes = self._channel_codes
        users: dict[int, set] = {}
        for (op, g, tw, ld, a, channel) in shapes:
            code = codes.setdefault(channel, len(codes))
            for plan in self._plans[(op, g, tw, ld, a)]:
                for e in plan.edges:
                    users.setdefault(e, set()).add(code)
        # per link, the one channel that uses it, or -1 where several do
        self._sole_user = {e: next(iter(u)) if len(u) == 1 else -1 for e, u in users.items()}
        self._plan_of.clear()  # plans looked up before the links were merged
        self._full_of.clear()

    def _meetings(self, phased: dict[tuple, tuple[FlowPlan, ...]]) -> dict[tuple, dict[int, np.ndarray]]:
        """Per plan and phase, the links where the orbit's twins meet another communication's
        real flows and that no simulated flow of its communication crosses (network.plan_phases
        constrains its simulated flows there).

        A symmetric orbit's simulated flows stand for its twins' on their own links only. ECMP
        sends the twins of two communications to spines at random: where twin a' of A and twin
        b' of B meet on a spine link that neither simulated instance crosses, the collapsed run
        saw neither slowed, and a step of ZeRO-3 gathers beside expert all-to-alls was 5.1 %
        short of the rank-by-rank one (bench/fuzz_symmetry.py)::

            A  (simulated) leaf0 -> spine1         a'  leaf2 -> spine3   <- meets b' there
            B  (simulated) leaf0 -> spine2         b'  leaf2 -> spine3

        With spine3 in both plans, each weighing its twins there, A's and B's simulated flows
        share it as a' and b' do, and each orbit moves at the pace of its twin slowed there
        (an upper bound, as an asymmetric orbit is). The same holds on a NIC's cable, where a
        DP ring that stays inside one class meets the PP sends of the twins' GPUs.

        A communication is its operation over its groups (one communicator, whose collectives
        run one after another): its sibling orbits (classes split) are one, and the links any of
        their simulated flows cross are covered for all of them, since each weighs the others'
        flows there (network.plan_phases). Timing is not known here: two communications that
        never run at once count too. Links inside a node count as well: a TP ring's flow from
        the simulated GPU into its twin's port meets the twin's own PP send leaving by it,
        which the PP send's plan, on the simulated GPU's port, does not see (1F1B with TP
        overlap and EP2 on two DGX H100 nodes was 0.002 % short of the rank-by-rank step:
        bench/fuzz_fabrics.py 246 routed by destination, plan 24; where the classes split a
        stage, a 32-GPU plan with a slow GPU, ZeRO-3 and TP2 was 1.9 % short). Weighing each
        flow k's own images there (network._images_on), such a meeting is the rank-by-rank
        constraint on that link. Inside nodes only the links some simulated flow crosses
        count: any other is a twin's copy of one of them, whose constraint stands for it (at
        16,384 GPUs, counting those too made 83 meetings instead of 51, 0.12 s more link use,
        35 MiB more). Until 2026-12-07 meetings were looked for inside nodes only where the
        classes split a stage (``Program.split_stage``, where every link counts): counting them
        everywhere once doubled moe_1024gpu's engine."""
        keys_of = self._families(phased)
        crossing = []  # per family, the links its real flows cross
        for keys in keys_of.values():
            arrays = [p.meet_real for key in keys for p in phased[key] if p.meet_real is not None]
            if arrays:
                crossing.append(unique(np.concatenate(arrays)))
        if not crossing:
            return {}
        families_on = np.bincount(np.concatenate(crossing), minlength=len(self.cluster.edges))
        # inside nodes, only links some simulated flow crosses: any other is a twin's copy of
        # one (by the symmetry the twins stand for), whose constraint stands for it
        if self.prog.split_stage:  # (every link counts: Program.split_stage)
            where = np.ones(len(self.cluster.edges), dtype=bool)
        else:
            on = set().union(*(p.edges for phases in phased.values() for p in phases))
            where = self.cluster.scale_out_mask.copy()
            where[np.fromiter(on, np.int64, len(on))] = True
        out: dict[tuple, dict[int, np.ndarray]] = {}
        for key, k, met in self._uncovered(phased, keys_of.values()):
            met = met[(families_on[met] > 1) & where[met]]
            if len(met):
                out.setdefault(key, {})[k] = met
        return out

    def _count(self, fast: tuple, c: Comm, n: int = 1, census: dict | None = None) -> None:
        """``n`` more communication tasks of shape ``fast`` in the algorithms' ``census``
        (default: the program's)."""
        census = self._census if census is None else census
        entry = census.get(fast)
        if entry is None:
            census[fast] = [c, n]
        else:
            entry[1] += n

    def link_loads(self, c: Comm) -> LinkLoads:
        """Per link ``c`` crosses (twins included): (seconds its traffic needs there at the
        link's full bandwidth, real flows crossing it in its busiest phase, a pipeline's hops
        counted by their share of its bytes: network._in_lockstep), as :class:`LinkLoads`'
        arrays. The link with the most seconds is the one that bounds ``c`` alone
        (:meth:`_closed_form_s`). Worked out once per shape and size, on arrays (a plan whose
        twins meet others' crosses thousands of links; a DP ring over 131,072 GPUs with its
        twins, 400,000), summed pair by pair in plan order as a loop over them would."""
        key = (_shape_id(c), c.size_bytes)
        out = self._loads_of.get(key)
        if out is not None:
            return out
        bw = self.cluster.edge_columns[0]
        phases = [plan.pairs + (plan.fractions,) for plan in self._full_plan(c)]
        edges = unique(np.concatenate([pe for _, pe, _, _ in phases])) if phases else np.zeros(0, dtype=np.int64)
        secs, most = np.zeros(len(edges)), np.zeros(len(edges))
        for sizes, pe, pw, fractions in phases:
            at = np.searchsorted(edges, pe)
            frac = np.repeat(np.asarray(fractions, dtype=float), sizes)
            np.add.at(secs, at, pw * frac * c.size_bytes / bw[pe])
            flows = np.zeros(len(edges))
            np.add.at(flows, at, pw)
            np.maximum(most, flows, out=most)
        out = self._loads_of[key] = LinkLoads(edges, secs, most)
        return out

    def timed_alone(self, t: Task) -> bool:
        """Whether ``t``'s communication never shared a link with another channel (closed form)."""
        return self.network == "flow" and t.comm is not None and self._alone_duration(t.comm, t.stream) is not None

    def _alone_duration(self, c: Comm, stream: str) -> float | None:
        """Closed-form time if ``c`` never shares a link with another channel, else None."""
        key = (*_shape(c), c.size_bytes, stream)
        if key not in self._alone:
            phases = self._plan(c)
            code = self._channel_codes.get(c.key[:2] + (stream,), -2)
            sole = self._sole_user
            if all(sole[e] == code for plan in phases for e in plan.edges):
                self._alone[key] = self._closed_form_s(phases, c.size_bytes)
            else:
                self._alone[key] = None
        return self._alone[key]

    def fixed_comm_s(self, c: Comm, stream: str) -> float:
        """Seconds ``c`` takes whatever else runs: 0 (ideal network, nothing to move), its
        closed form when alone on its links; -1 when the flow network must time it."""
        if self.network == "ideal" or c.size_bytes <= 0:
            return 0.0
        fast = (c.op, id(c.group), id(c.twins), c.size_bytes, id(c.load), stream)  # _shape_id + stream, inline
        dur = self._alone_of.get(fast)
        if dur is None:
            alone = self._alone_duration(c, stream)
            dur = self._alone_of[fast] = -1.0 if alone is None else alone
        return dur

    def _start_comm(self, c: Comm, stream: str, at_s: float, on_done: Callable[[], None]) -> None:
        """Start ``c`` in the flow network at ``at_s`` (now if that has passed; queued if
        later); ``on_done`` is called when its last phase ends (see :meth:`FlowNetwork.transfer`)."""
        fast = _shape_id(c)
        hit = self._start_of.get(fast)
        if hit is None:
            hit = self._start_of[fast] = (self._plan(c), self._full_plan(c))
        phases, full = hit
        if len(phases) == 1:
            self.net.transfer(phases[0], c.size_bytes, tag=full[0], at_s=at_s, on_done=on_done)
            return
        done = self.env.event()
        done.callbacks.append(lambda _e: on_done())

        def run_phases():  # one after the other: each phase needs the previous one's result
            for k, (plan, whole) in enumerate(zip(phases, full)):
                yield self.net.transfer(plan, c.size_bytes, tag=whole, at_s=at_s if k == 0 else None)
            done.succeed()

        self.env.process(run_phases())

    # --- processes -----------------------------------------------------------------
    def _starts_log(self, c: Comm):
        """The ``append`` of the list of ``c``'s starts in closed form (for link accounting)."""
        hit = self._alone_starts.get(id(c))
        if hit is None:
            hit = self._alone_starts[id(c)] = (c, [])
        return hit[1].append

    def form(self, key: tuple) -> SpanForm:
        """The form with the values ``key`` (in FORM_FIELDS order, then ``comm_args``), made on
        first use."""
        form = self.forms.get(key)
        if form is None:
            form = self.forms[key] = SpanForm(*key)
        return form

    def _span_key(self, t: Task, rank: int, stream: str, name: str, receive: bool = False) -> tuple:
        """The values of the form of ``t``'s span on ``rank`` and ``stream`` (FORM_FIELDS order,
        then ``comm_args``); with ``receive``, of its send's receive."""
        c = t.comm
        return (stream, name, t.kind, t.phase, self.stage_of.get(rank, t.stage), t.layer,
                c.size_bytes if c else t.size_bytes, c.op if c else "", t.flops, t.model_flops,
                () if c is None else self.comm_args(t, receive))

    def comm_args(self, t: Task, receive: bool = False) -> tuple:
        """What the trace file says of communication task ``t``'s span besides its op
        (``SpanForm.comm_args``), as (name, value) pairs; with ``receive``, of the receive of
        ``t``, a send::

            collective   group       "tp: GPUs 0-7": the mesh group (Program.group_dims) and
                                     its GPUs (trace.gpu_ranges, up to GROUP_GPUS_CHARS)
                         group_size  8
                         algorithm   "ring": :meth:`algorithm`, as the census counts it
            send         peer_stage  the receiver's stage, peer_rank its simulated rank
            receive      peer_stage  the sender's stage, peer_rank its simulated rank

        The group is the simulated instance's, that of the rank whose span it is; a peer is a
        simulated rank (under the symmetric collapse the one that stands for the real peer), so
        each reads as the process names in the trace file do. Worked out once per shape: the
        engine calls this for every form it makes, and for every communication task outside a
        template's runs."""
        c = t.comm
        if c.op == "send":
            peer = t.rank if receive else c.recv_rank
            return (("peer_stage", self.stage_of.get(peer, 0)), ("peer_rank", peer)) if peer >= 0 else ()
        channel = c.key[0] if c.key else ""
        key = (c.op, id(c.group), id(c.twins), c.size_bytes, id(c.load), channel)
        args = self._comm_args.get(key)
        if args is None:
            dim = self.prog.group_dims.get(str(channel).split(" ", 1)[0], t.kind)
            args = self._comm_args[key] = (("group", f"{dim}: GPUs {gpu_ranges(c.group, GROUP_GPUS_CHARS)}"),
                                           ("group_size", len(c.group)), ("algorithm", self.algorithm(c)))
        return args

    def _complete(self, t: Task, start_s: float, end_s: float) -> None:
        """Record ``t`` (and the receive of a send) over [start_s, end_s] and release whatever
        waits for it (``end_s`` may lie ahead of the clock: it is known already)."""
        c = t.comm
        form = self._form_of[t.tid]
        if form is None:
            form = self.form(self._span_key(t, t.rank, t.stream, t.name))
        self.spans.append(Span.of_form(t.rank, form, start_s, end_s, t.mb, t.tid))
        if c is not None and c.recv_rank >= 0:
            # the receive's form follows from the send's, the sender (its peer), the receiver
            # and the task's stage (where the receiver has none of its own): worked out once
            # per such key
            key = (form, t.rank, c.recv_rank, t.stage)
            recv = self._recv_forms.get(key)
            if recv is None:
                recv = self._recv_forms[key] = self.form(self._span_key(
                    t, c.recv_rank, t.stream.replace("_send", "_recv"), t.name.replace("send", "recv"), receive=True))
            self.spans.append(Span.of_form(c.recv_rank, recv, start_s, end_s, t.mb, t.tid))
        self.end_s[t.tid] = end_s
        streams = self.waiters.pop(t.tid, None)
        if streams:
            self._release(streams)

    def _release(self, streams: list) -> None:
        """One dependency of each of ``streams`` is done: queue those with none left to wait
        for (the stream loop does the same inline for its tasks)."""
        for st in streams:
            st.pending -= 1
            if not st.pending:
                st.queued = True
                self._ready.append(st)

    def _wake(self) -> None:
        """Step the streams whose last dependency finished, in the order they were released,
        after the callback that released them (a stream steps on before its dependents, as
        when completion was a simpy event)."""
        if self._waking:
            return
        self._waking = True
        ready = self._ready
        while ready:
            st = ready.popleft()
            if st.queued:  # else a dependent already stepped it (_Stream.step, "chase")
                st.queued = False
                st.step()
        self._waking = False

    def run(self, links: bool = True) -> Trace:
        """Simulate the program; its trace. ``links``: with the trace's link use (``links``),
        else without it, for :meth:`link_use` to work out later (``simulate`` forks the
        writer of the report and the trace file first, which do not read it)."""
        self._stream_of = [None] * len(self.prog.items)  # task id -> its stream, once created
        # what every _Stream.step reads of the engine, fixed for the run: one tuple to unpack
        # instead of a dozen attribute reads per step (up to 190,000 steps)
        self._loop = (self.end_s, self.cluster.gpu_slowdown, self.spans.append, self.waiters.pop, self._ready.append,
                      self.network == "flow", self._stream_of, self.forms, self._form_of, Span.of_form)
        for (rank, stream), entries in _segmented(self).items():
            _Stream(self, rank, stream, entries).step()
        self._wake()
        self.env.run()
        # the streams and the engine refer to each other: drop the streams now, so that the
        # run's working state is freed by reference counting when the engine goes, even where
        # the cyclic collector is off (python -m clustersim)
        self._stream_of = []
        self._loop = ()
        unfinished = self.end_s.count(-1.0)
        if unfinished:
            raise RuntimeError(f"simulation deadlocked with {unfinished} tasks not run")
        # sorted by rank, start, end and stream; the columns read to sort go with the trace
        base = SpanBase.of_log(self.spans).sorted()
        self.spans = []  # the records: the trace has their columns, and makes spans from those
        if not self._census:  # (counted by _classify under the flow network)
            for t, n in _comm_tasks(self.prog):
                self._count(_shape_id(t.comm), t.comm, n)
        self._last_end_s = float(base.end_s.max()) if len(base.end_s) else 0.0
        return Trace(spans=None, ranks=list(self.prog.ranks), weight=dict(self.prog.weight), rep=self.prog.rep,
                     stage_of=dict(self.stage_of), algorithms=self._algorithms_used(self._census),
                     asymmetric_orbits=dict(self.asymmetric_orbits), links=self.link_use() if links else [], base=base)

    def _algorithms_used(self, census: dict) -> dict[str, dict[str, int]]:
        """Collective -> algorithm -> how many communication tasks of the ``census``
        (:meth:`_count`) used it, for the collectives that have a choice (``Trace.algorithms``)."""
        used: dict[str, dict[str, int]] = {}
        for c, n in census.values():
            if c.op in _CHOOSE:
                per = used.setdefault(c.op, {})
                algo = self.algorithm(c)
                per[algo] = per.get(algo, 0) + n
        return {op: dict(sorted(v.items())) for op, v in sorted(used.items())}

    def record_starts(self) -> np.ndarray:
        """When each communication this run recorded for link accounting started (closed-form
        ones and flow-network transfers), as the run left them: ``engine.repeat.find_cycle``
        places its cut away from them, before :meth:`_cut_records` cuts them."""
        alone = list(map(itemgetter(1), self._alone_starts.values()))
        finished = self.net.finished
        return np.fromiter(chain(chain.from_iterable(alone), map(_transfer_start, finished)), np.float64,
                           sum(map(len, alone)) + len(finished))

    def repeated(self, rep, base: SpanBase, program: Program, gap_comms: list) -> Trace:
        """The trace of ``program`` (the whole step) from a run of fewer of its microbatches
        (``engine.repeat``) on this engine's program: the spliced spans ``base`` and the whole
        program's algorithms census (``gap_comms``: the communications of its tasks outside
        runs), which only this engine's set-up decides. Where this engine made the run, its
        records of communications, which only :meth:`link_use` reads, are cut and copied as
        the spans were when it first asks (:meth:`_cut_records`), after the writer's fork
        rather than on the way to it; where another process made it (clustersim.engine.ahead),
        that one cuts its own (:meth:`cut_records`) and this engine never runs."""
        # the census _comm_tasks would give, of the communications with a choice (what
        # _algorithms_used reports; a PP send has none), with the tasks outside runs read off
        # ``gap_comms`` rather than found among a million tasks
        census: dict[tuple, list] = {}
        for c, n in chain(zip(gap_comms, repeat(1)), ((t.comm, n) for t, n in _run_comm_tasks(program))):
            if c.op in _CHOOSE:
                self._count(_shape_id(c), c, n, census)
        self.cut_records(rep, float(base.end_s.max()) if len(base.end_s) else 0.0)
        return Trace(spans=None, ranks=list(program.ranks), weight=dict(program.weight), rep=program.rep,
                     stage_of=dict(self.stage_of), algorithms=self._algorithms_used(census),
                     asymmetric_orbits=dict(self.asymmetric_orbits), base=base)

    def cut_records(self, rep, step_s: float) -> None:
        """Let :meth:`link_use` read this run's records as ``rep`` cuts and copies its spans
        (:meth:`_cut_records`, on its first call), over a step of ``step_s`` (the spliced
        step's last end, :attr:`step_s`): what :meth:`repeated` does, for an engine that
        ran the shorter step while another made the spliced trace (clustersim.engine.ahead).
        Called again, it sets the step only: the records are cut once, by the first cut."""
        if self._cut_by is None:
            self._cut_by = rep
        self._last_end_s = step_s

    @property
    def step_s(self) -> float:
        """The step the link use is worked out over: the last span's end, of the run or
        (:meth:`repeated`) of the spliced step."""
        return self._last_end_s

    def _cut_records(self) -> None:
        """The closed-form starts and the flow network's finished transfers of a run whose cycle
        was copied in (:meth:`repeated`), cut and copied as its spans were: once. The transfers
        are not copied: ``_finished_cut`` says which one stands in each place of the step's
        list and by how many periods it moves (:meth:`_finished_places`), so that the link use
        makes the moved records only of the few transfers on the links it details."""
        rep = self._cut_by
        if rep is None or self._finished_cut is not None:  # nothing to cut, or cut already
            return
        from .repeat import spliced_times

        for _, at in self._alone_starts.values():
            times = np.asarray(at, dtype=np.float64)
            rows, copy = spliced_times(times, rep)
            at[:] = (times[rows] + copy * rep.period_s).tolist()
        finished = self.net.finished
        starts = np.fromiter(map(_transfer_start, finished), np.float64, len(finished))
        rows, copy = spliced_times(starts, rep)
        self._finished_cut = (rows.tolist(), copy.tolist(), rep.period_s)

    def _finished_places(self, of: np.ndarray | None = None) -> tuple[list[int], list[int], list[int]]:
        """(position, record, copy) of the step's finished transfers, in the step's order: each
        record of ``net.finished`` once and unmoved, or as the cut copies it (``copy`` periods
        later, :meth:`_cut_records`); with ``of`` (a mask over the records), only those."""
        n = len(self.net.finished)
        if self._finished_cut is None:
            rows, copy = list(range(n)), [0] * n
        else:
            rows, copy, _ = self._finished_cut
        if of is None:
            return list(range(len(rows))), rows, copy
        at = np.flatnonzero(of[np.asarray(rows, dtype=np.int64)]).tolist() if len(rows) else []
        return at, list(map(rows.__getitem__, at)), list(map(copy.__getitem__, at))

    def _moved(self, record: tuple, k: int) -> tuple:
        """A finished transfer's record ``k`` periods of the cut later (itself for 0)."""
        if not k:
            return record
        s = k * self._finished_cut[2]
        tag, size, times, rates, ends, course = record
        if course is not None:
            return (tag, size, times, rates, ends, (course[0], course[1] + s))
        return (tag, size, [x + s for x in times], rates, ends + s, None)

    def link_use(self) -> list[LinkUse]:
        """The links the run's communications used (``Trace.links``), over the run's step."""
        return self._link_use(self._last_end_s)

    def _flow_intervals(self, c: Comm) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, float, np.ndarray]]:
        """A communication timed in closed form, phase by phase, on arrays: (links per flow,
        every (flow, link) pair's link and bytes, flow by flow, the phase's start offset, each
        flow's duration). Each flow starts after its phase's latency and runs at its rate
        alone::

            duration = fraction x size / rate        bytes on a link = weight x fraction / wire scale x size
            next phase's offset = this one's + latency + its longest flow
        """
        out, t0 = [], 0.0
        for plan, whole in zip(self._plan(c), self._account_plan(c)):
            rates = np.asarray(max_min_rates(list(plan.weights), self.cluster.edge_bw_Bps), dtype=np.float64)
            frac = np.asarray(plan.fractions, dtype=np.float64)
            dur = frac * c.size_bytes / rates
            sizes, pair_edge, pair_w = whole.pairs
            wire = pair_w * np.repeat(frac * c.size_bytes, sizes) / wire_scales(whole, self.cluster.nvlink_mask)
            out.append((sizes, pair_edge, wire, t0 + plan.latency_s, dur))
            t0 += plan.latency_s + max(0.0, float(dur.max()) if len(dur) else 0.0)
        return out

    @staticmethod
    def _rate_segments(here: tuple, transfers: list[tuple], parts: dict) -> None:
        """The (start, stop, bytes) of the flows of ``transfers`` (all of one plan, each
        ``(position in finished, rate change times, rates, flow ends)``) on the chosen links
        ``here`` = (links, flows x links weights), one piece per flow and rate change: appends
        ``(positions, starts, stops, bytes)`` to ``parts[e]`` for each chosen link ``e``, in
        transfer, rate change and flow order. The rate changes of all the transfers are stacked,
        one row each with its transfer's flow ends::

            piece (k, i) = [t_k, min(t_k+1, end_i)] at rate r_k,i   where that is > 0 long and r > 0
        """
        cols, x = here
        # only the flows that cross a chosen link (of a plan over thousands of links, the
        # few flows on the chosen ones), in order
        on = np.flatnonzero((x > 0).any(axis=1))
        x = x[on]
        counts = [len(times) for _, times, _, _ in transfers]
        t0 = np.fromiter(chain.from_iterable(times for _, times, _, _ in transfers), np.float64, sum(counts))
        # each row's next rate change in its own transfer (inf after its last)
        nxt = np.fromiter(chain.from_iterable(chain(times[1:], (np.inf,)) for _, times, _, _ in transfers),
                          np.float64, len(t0))
        # the rows are the network's cached rates, shared by many rate changes: each stacked once
        flat = [row for _, _, rates, _ in transfers for row in rates]
        codes, ids = appearance_codes(map(id, flat), len(flat))
        of_id = dict(zip(map(id, flat), flat))
        r = np.vstack([of_id[i][on] for i in ids])[codes]
        ends = np.repeat(np.vstack([e[on] for _, _, _, e in transfers]), counts, axis=0)
        t1 = np.minimum(nxt[:, None], ends)
        ok = (t1 > t0[:, None]) & (r > 0)
        k_idx, i_idx = np.nonzero(ok)
        if not len(k_idx):
            return
        start, stop = t0[k_idx], t1[k_idx, i_idx]
        moved = r[k_idx, i_idx] * (stop - start)
        j = np.repeat(np.fromiter((j for j, *_ in transfers), np.int64, len(transfers)), counts)[k_idx]
        for c, e in enumerate(cols):
            w = x[i_idx, c]
            sel = w > 0
            if sel.any():
                parts[e].append((j[sel], start[sel], stop[sel], moved[sel] * w[sel]))

    @staticmethod
    def _course_segments(here: tuple, times, rates, ends, shifts: np.ndarray, rows: dict) -> None:
        """Append to ``rows[e]`` the pieces (:meth:`_rate_segments`) of a kept course (times
        relative to its start), once per start in ``shifts``: a transfer that followed it."""
        parts: dict[int, list[tuple]] = {e: [] for e in here[0]}
        Engine._rate_segments(here, [(0, times, rates, ends)], parts)
        for e, got in parts.items():
            for _, start, stop, moved in got:
                rows[e].append(((start[None, :] + shifts[:, None]).ravel(), (stop[None, :] + shifts[:, None]).ravel(),
                                np.tile(moved, len(shifts))))

    def _summary_sources(self) -> np.ndarray:
        """Per link, the link whose use the summary gives it (analysis.links.every_gpu_rows): itself,
        but collapsed, for a GPU's own NVLink ports and PCIe lane (Cluster.owned_edges: none
        where GPUs share a NIC, where every link counts every twin), its class's simulated rank's,
        and for a PCIe lane to a NIC of its own, that NIC's cable (by conservation at the NIC)::

            n3.gpu5->n3.nvsw  ->  n0.gpu5->n0.nvsw      (GPU 29's class runs on GPU 5)
            n3.gpu5->n3.nic5  ->  n3.nic5->leaf3.5      (its own NIC's cable)
        """
        source = np.arange(len(self.cluster.edges))
        rep = self.prog.rep
        # (where the classes split a stage, the link use counts every real flow where it goes,
        # inside nodes too: Program.split_stage)
        if rep is None or self.prog.split_stage or all(r == g for g, r in enumerate(rep)):
            return source
        owned = self.cluster.owned_edges
        reps = np.asarray(rep, dtype=np.int64)
        moved = reps != np.arange(len(reps))
        source[owned[moved]] = owned[reps[moved]]
        lanes = self.cluster.own_nic_edges
        lanes = lanes[lanes[:, 0] >= 0]
        source[lanes[:, :2].ravel()] = lanes[:, 2:].ravel()
        return source

    def _link_use(self, step_s: float, bins: int = 100, detailed: int = 10) -> list[LinkUse]:
        """Bytes per link over the step, flow by flow: a flow's bytes times its weight on each
        link it crosses (real traffic, twins included), spread evenly over the time the flow
        ran at each of its rates. Collapsed, these are the simulated ranks' links and every
        scale-out link their twins cross, or lane to a NIC that GPUs share (:meth:`_accounting`):
        their twins' other links inside their nodes carry the same (the summary gives every GPU
        its own: analysis.links.every_gpu_rows). The rate over time (``bins`` slices of the step) is
        worked out for the ``detailed`` links of highest mean use (to nine digits, ties by
        name, as the summary lists them) and the busiest of each kind, picked among every
        GPU's links as a run of every rank picks them (:meth:`_summary_sources`); the others
        get their bytes only (peak 0, no series)."""
        if self.network != "flow" or step_s <= 0:
            return []
        self._cut_records()
        self._tags_as_counted()
        total = np.zeros(len(self.cluster.edges))
        # closed-form communications, by shape: every instance moves the same bytes. Logged
        # by object (a segment logs its template's communication every time), grouped here by
        # identity, then by value; shapes in order of first appearance, each one's starts in
        # time order
        by_id: dict[tuple, tuple[Comm, list[float]]] = {}
        for c, at in self._alone_starts.values():
            k = _shape_id(c)
            entry = by_id.get(k)
            if entry is None:
                by_id[k] = (c, list(at))
            else:
                entry[1].extend(at)
        starts: dict[tuple, tuple[Comm, list[float]]] = {}
        for c, at in by_id.values():
            key = (*_shape(c), c.size_bytes)
            entry = starts.get(key)
            if entry is None:
                starts[key] = (c, at)
            else:
                entry[1].extend(at)
        shapes = {key: self._flow_intervals(c) for key, (c, _) in starts.items()}
        for key, (_, at) in starts.items():
            for _, pair_edge, pair_bytes, _, _ in shapes[key]:
                # (unbuffered: the same sums, in the same order, as a loop over the pairs)
                np.add.at(total, pair_edge, pair_bytes * len(at))
        # flows of the network: link bytes per byte of the flow (its bytes include the timing scale)
        per_plan: dict[int, tuple[FlowPlan, np.ndarray]] = {}  # id -> (plan, bytes per flow)
        # transfers of one plan and size share their bytes-per-flow array: count, then add (in
        # order of first appearance, as the sums below must be made in one order)
        finished = self.net.finished
        keys = list(zip(map(id, map(itemgetter(0), finished)), map(id, map(itemgetter(1), finished))))
        of_key = dict(zip(keys, map(itemgetter(0, 1), finished)))  # (id plan, id array) -> them
        _, placed, _ = self._finished_places()
        for key, n in Counter(map(keys.__getitem__, placed)).items():
            whole, size = of_key[key]
            if id(whole) not in per_plan:
                per_plan[id(whole)] = (whole, np.zeros(len(size)))
            per_plan[id(whole)][1][:] += n * size
        for whole, moved in per_plan.values():
            # every (flow, link) pair in plan order, added one after the other (np.add.at is
            # unbuffered: the same sums, in the same order, as a loop over the pairs)
            sizes, pair_edge, pair_w = whole.pairs
            per_pair = wire_scales(whole, self.cluster.nvlink_mask)
            np.add.at(total, pair_edge, pair_w / per_pair * np.repeat(moved, sizes))
        edges, bw = self.cluster.edges, self.cluster.edge_bw_Bps
        used = np.flatnonzero(total).tolist()
        # the links are chosen as a run of every rank would choose them, among every GPU's links
        # as the summary lists them (analysis.links.every_gpu_rows): each link's use is its
        # source's (_summary_sources), whose rate over time is then worked out
        source = self._summary_sources()
        every = total[source]
        use = every / np.asarray(bw)
        carried = np.flatnonzero(every)
        kind = dict(zip(used, map(self.cluster.edge_kind.__getitem__, used)))
        codes, _ = self.cluster.edge_kind_codes
        of_kind = codes[carried]
        # the busiest and each kind's busiest, by the mean to nine digits, then by the pair of
        # ends (as their names order), as the summary reads their peaks
        # (analysis.links.first_by_use; pairs, not names made for thousands of links alike)
        chosen = set(first_by_use(use, carried, detailed, edges.__getitem__))
        for k in sorted(set(of_kind.tolist())):  # (not np.unique: it imports numpy.ma, tests/test_repeat.py)
            chosen.update(first_by_use(use, carried[of_kind == k], 1, edges.__getitem__))
        chosen = set(source[sorted(chosen)].tolist())
        # (start, end, bytes) of everything the chosen links carried, then binned at once
        segs: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {e: [] for e in chosen}
        picked = np.fromiter(sorted(chosen), np.int64, len(chosen))
        for key, (_, at) in starts.items():
            t0 = np.sort(np.asarray(at))  # the order they were logged in depends on how they were timed
            for sizes, pair_edge, pair_bytes, off, dur in shapes[key]:
                hit = np.flatnonzero(np.isin(pair_edge, picked))
                if not len(hit):
                    continue
                owner = np.repeat(np.arange(len(sizes)), sizes)  # each pair's flow
                begin = t0 + off
                on = pair_edge[hit]
                for e in chosen.intersection(on.tolist()):
                    mine = hit[on == e]  # the pairs of the flows that cross it, in order
                    ends = begin[None, :] + dur[owner[mine]][:, None]
                    segs[e].append((np.tile(begin, len(mine)), ends.ravel(), np.repeat(pair_bytes[mine], len(at))))
        # per plan, its flows' weights on the chosen links (a flows x links matrix)
        mine: dict[int, tuple[list[int], np.ndarray] | None] = {}
        for k, (whole, _) in per_plan.items():
            cols = sorted(whole.edges & chosen)
            if not cols:
                mine[k] = None
                continue
            x = np.zeros((len(whole.weights), len(cols)))
            scales = np.broadcast_to(wire_scales(whole, self.cluster.nvlink_mask), (len(whole.pairs[1]),))
            at = 0  # (the pairs, flow after flow, as the weights list them)
            for i, ws in enumerate(whole.weights):
                for e, w in ws:
                    if e in chosen:
                        x[i, cols.index(e)] = w / scales[at]
                    at += 1
            mine[k] = (cols, x)
        # transfers timed in the network, plan by plan (_rate_segments); each link's segments
        # in the order the transfers finished
        later: dict[int, list] = {}  # id plan -> [(position in finished, times, rates, ends)]
        # transfers that followed one kept course (the flow network replays a transfer that
        # runs alone, shifted in time) share its segments: worked out once, shifted per start
        by_course: dict[tuple, tuple] = {}
        on_chosen = np.fromiter((mine[id(e[0])] is not None for e in finished), bool, len(finished))
        for j, i, k in zip(*self._finished_places(on_chosen)):
            whole, _, times, rates, ends, course = self._moved(finished[i], k)
            here = mine[id(whole)]
            if course is not None:
                key = (id(whole), id(course[0]))
                if key not in by_course:
                    _, rel_times, rel_rows, rel_ends = course[0]
                    by_course[key] = (here, rel_times, rel_rows, rel_ends, [])
                by_course[key][4].append(course[1])
                continue
            later.setdefault(id(whole), []).append((j, times, rates, ends))
        rows: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {e: [] for e in chosen}
        parts: dict[int, list[tuple]] = {e: [] for e in chosen}
        for k, transfers in later.items():
            self._rate_segments(mine[k], transfers, parts)
        for e, got in parts.items():
            if got:
                j, start, stop, moved = (np.concatenate(x) for x in zip(*got))
                o = np.argsort(j, kind="stable")
                rows[e].append((start[o], stop[o], moved[o]))
        for here, rel_times, rel_rows, rel_ends, t0s in by_course.values():
            self._course_segments(here, rel_times, rel_rows, rel_ends, np.asarray(t0s), rows)
        tot = total.tolist()
        out = list(map(LinkUse, [f"{u}->{v}" for u, v in map(edges.__getitem__, used)], map(kind.__getitem__, used),
                       map(bw.__getitem__, used), map(tot.__getitem__, used), repeat(0.0), repeat(())))
        for u, e in zip(out, used):
            if e in chosen:  # its rate over the step
                segs[e] += rows[e]
                series = _binned(segs[e], step_s, bins) / (step_s / bins)
                u.peak_Bps, u.series_Bps = float(series.max()), tuple(series.tolist())
        return out


_SEGMENT = object()  # the ``comm`` of a _Segment: the stream loop tells it from a task by it


class _Segment:
    """One action's tasks (a run of the program, ``Program.runs``), all of fixed duration
    (compute, communications timed in closed form with nobody to wait for), timed in one go:
    the same sums and maxima, in the same order, as the stream loop works out task by task,
    without handing over between streams at every task (a compute stream and its TP stream
    do, layer by layer)::

        compute  [F attn L0]      [F mlp L0]      ...     each task starts at max(its stream's
        tp                  [AR]            [AR]            previous end, its dependencies' ends)

    It sits in the list of the stream of its first task; its tasks on other streams leave
    theirs. ``inputs``: the task ids whose ends it reads (slot k + 1 of its values is the end
    of ``inputs[k]``, the tasks' ends follow from slot ``base`` on); the stream loop waits for
    ``deps``, those the first task reads. An input read by a later task (its stream's previous
    task, a dependency from outside) may still be unknown when that task comes: the segment
    then stops there and waits for it, as that task's stream would (every later task waits for
    that one: :func:`_segment_code`), so every end is known exactly when the stream loop would
    know it. ``code``: shared by every run of one template (:func:`_segment_code`).
    """

    __slots__ = ("deps", "inputs", "code", "late", "first", "end", "mb", "base", "last", "vals", "pos", "wait",
                 "timed")
    comm = _SEGMENT

    def __init__(self, inputs: tuple[int, ...], seg: tuple, first: int, end: int, mb: int):
        self.inputs = inputs
        self.code, self.late, self.base, self.last, n_early, self.timed = seg
        self.deps = tuple(dict.fromkeys(inputs[:n_early]))  # what the stream loop waits for
        self.first, self.end, self.mb = first, end, mb
        self.vals: list | None = None  # while stopped: the values so far
        self.pos = 0  # tasks timed so far
        self.wait = -1  # while stopped: the input waited for

    def run(self, eng: Engine, rank: int) -> float | None:
        """Time, record and release the tasks; the end of the last one on its own stream, or
        None when stopped before a task whose input is not known yet (``wait``)."""
        end_s = eng.end_s
        vals, pos = self.vals, self.pos
        if vals is None:
            vals = [0.0]
            vals += map(end_s.__getitem__, self.inputs)  # -1.0 for late inputs not known yet
            timed = self.timed.fn or self.timed.ready()
            if timed is not None and -1.0 not in vals:  # every input known: the template's own code
                lo = self.first
                ends = timed(rank, self.mb, lo, eng.spans.append, vals)
                _settle(eng, lo, ends)
                return ends[self.last - self.base]
        spans_append, of_form = eng.spans.append, Span.of_form
        first, mb, late, inputs = self.first, self.mb, self.late, self.inputs
        code = self.code
        stopped = False
        for check, (p0, rest, dur, form, logged), tid in zip(late[pos:] if pos else late, code[pos:] if pos else code,
                                                             range(first + pos, self.end)):
            if check:
                for slot in check:
                    d = inputs[slot - 1]
                    e = end_s[d]
                    if e < 0.0:
                        stopped = True
                        self.wait = d
                        break
                    vals[slot] = e
                if stopped:
                    break
            start = vals[p0]
            for p in rest:  # in the task's dependency order, as the stream loop takes them
                e = vals[p]
                if e > start:
                    start = e
            end = start + dur
            vals.append(end)
            if logged is not None:  # the append of its communication's list of starts
                logged(start)
            spans_append(of_form(rank, form, start, end, mb, tid))
        base = self.base
        _settle(eng, first + pos, vals[base + pos:])
        if stopped:
            self.vals, self.pos = vals, len(vals) - base  # the tasks timed so far
            return None
        self.vals = None
        return vals[self.last]


def _settle(eng: Engine, lo: int, ends: list[float]) -> None:
    """Write the ends of tasks ``lo, lo + 1, ...`` (a segment's, just timed) and release the
    streams waiting for them."""
    hi = lo + len(ends)
    eng.end_s[lo:hi] = ends
    waiters = eng.waiters
    if waiters:
        for released in map(waiters.pop, range(lo, hi), repeat(None)):
            if released:
                eng._release(released)


def _reach(tasks: list[Task], k: int) -> list[bool]:
    """Which tasks of a run wait for its task ``k``, through the run (dependencies and each
    stream's order)."""
    first, n = tasks[0].tid, len(tasks)
    out = [False] * n
    out[k] = True
    last_on: dict[str, int] = {}
    for i, t in enumerate(tasks):
        if i > k:
            pred = last_on.get(t.stream)
            out[i] = (pred is not None and out[pred]) or any(
                first <= d < first + n and out[d - first] for d in t.deps)
        last_on[t.stream] = i
    return out


def _segment_code(eng: Engine, tasks: list[Task], forms: list[SpanForm]) -> tuple | None:
    """What every run of one template shares, read off one run's ``tasks`` (rank, streams,
    durations and dependencies are those of every run): (what each input slot reads, in slot
    order: ``("pred", stream)``, that stream's task before the run, or ``(task, position)``,
    a dependency from outside, the own stream's previous task first; the :class:`_Segment`
    code; each stream's last task in the run, relative, streams in order of their first task
    there), or None when the run cannot be one segment: a task the stream loop does not time
    inline, a task that does not wait for the first one through the run, or a task reading an
    input from outside (other than the first task) that some later task does not wait for (the
    segment could not stop there without holding that one back). ``forms``: those of the
    tasks' spans."""
    slow = eng.cluster.gpu_slowdown
    rank, first, n = tasks[0].rank, tasks[0].tid, len(tasks)
    streams: list[str] = []  # in order of their first task: the run's own stream first
    durs: list[float] = []
    for t in tasks:
        c = t.comm
        if c is None:
            durs.append(t.duration_s * slow.get(rank, 1.0) if slow and t.kind == "compute" else t.duration_s)
        else:
            dur = -1.0 if len(c.members) > 1 or c.recv_rank >= 0 else eng.fixed_comm_s(c, t.stream)
            if dur < 0.0:
                return None
            durs.append(dur)
        if t.stream not in streams:
            streams.append(t.stream)
    if not all(_reach(tasks, 0)):
        return None
    own = tasks[0].stream
    ext = [(k, j) for k, t in enumerate(tasks) for j, d in enumerate(t.deps) if not first <= d < first + n]
    # inputs: the own stream's previous task and the first task's outside dependencies (read
    # before the segment starts), then the other streams' previous tasks and the later
    # outside dependencies (read when their task comes)
    early = [pos for pos in ext if pos[0] == 0]
    later = [pos for pos in ext if pos[0] > 0]
    slot_of: dict = {("pred", own): 1}
    for pos in early:
        slot_of[pos] = len(slot_of) + 1
    n_early = len(slot_of)
    for s in streams[1:]:
        slot_of[("pred", s)] = len(slot_of) + 1
    for pos in later:
        slot_of[pos] = len(slot_of) + 1
    base = 1 + len(slot_of)
    code, late = [], []
    last_on: dict[str, int] = {}
    log = eng.network == "flow"
    for k, t in enumerate(tasks):
        k0 = last_on.get(t.stream)
        check = []
        if k0 is None:
            p0 = slot_of[("pred", t.stream)]
            if t.stream != own:
                check.append(p0)
        else:
            p0 = base + k0
        rest = []
        for j, d in enumerate(t.deps):
            if first <= d < first + n:
                rest.append(base + d - first)
            else:
                rest.append(slot_of[(k, j)])
                if k > 0:
                    check.append(slot_of[(k, j)])
        if check and not all(_reach(tasks, k)[k:]):
            return None
        late.append(tuple(check))
        c = t.comm
        logged = eng._starts_log(c) if c is not None and durs[k] > 0.0 and log else None
        code.append((p0, tuple(rest), durs[k], forms[k], logged))
        last_on[t.stream] = k
    order = [key for key in slot_of]  # slot - 1 -> what it reads
    last = {s: last_on[s] for s in streams}  # each stream's last task, relative
    code = tuple(code)
    return order, (code, tuple(late), base, base + last_on[own], n_early, _straight_code(code, base)), last


def _straight_code(code: tuple, base: int) -> Straight:
    """The :class:`_Segment` code of one template as one Python function without a loop,
    once the template has been used enough (:mod:`clustersim.codegen`): what
    :meth:`_Segment.run` works out task by task when every input is known, the same sums and
    maxima in the same order, with the slots as local variables and the durations, the forms and
    logs as closure cells (Megatron-1T times 789,000 tasks this way)::

        def timed(rank, mb, first, record, vals):
            v0, v1, v2, ... = vals            # the inputs (v0: unused, 0.0)
            s0 = v1                           # task 0: its stream's previous end ...
            if v3 > s0: s0 = v3               # ... or a later dependency's end
            e0 = s0 + D0
            ...
            ends = [e0, e1, ...]              # the tasks' ends
            record((first, rank, mb, FORMS, [s0, s1, ...], ends))   # the spans, as one record
            return ends

    The spans are recorded as one tuple (task ids first, first + 1, ...), which the trace
    reads as columns (:meth:`clustersim.trace.SpanBase.of_log`) instead of a span object per
    task.
    """
    def prepare() -> tuple[tuple, list]:  # (structure, values), read after a few uses
        shape = (base, tuple((p0, rest, logged is not None) for p0, rest, _, _, logged in code))
        cells = []
        for _, _, dur, _, logged in code:
            cells += (dur,) if logged is None else (dur, logged)
        cells.append(tuple(form for _, _, _, form, _ in code))
        return shape, cells

    return Straight("segment", prepare, _write_straight)


def _write_straight(base: int, shape: tuple) -> tuple[list[str], str, list[str]]:
    """:func:`_straight_code`'s function for one structure, as source: the cells (per task
    its duration and, if logged, its log; then the tasks' forms), the signature, the body."""
    n = len(shape)
    slot = [f"v{i}" for i in range(base)] + [f"e{k}" for k in range(n)]
    body = [f"{', '.join(slot[:base])}, = vals"]
    cells: list[str] = []
    for k, (p0, rest, logged) in enumerate(shape):
        cells += [f"D{k}"] + ([f"L{k}"] if logged else [])
        body.append(f"s{k} = {slot[p0]}")
        body += [f"if {slot[p]} > s{k}: s{k} = {slot[p]}" for p in rest]
        body.append(f"e{k} = s{k} + D{k}")
        if logged:
            body.append(f"L{k}(s{k})")
    cells.append("FORMS")
    body.append(f"ends = [{', '.join(f'e{k}' for k in range(n))}]")
    body.append(f"record((first, rank, mb, FORMS, [{', '.join(f's{k}' for k in range(n))}], ends))")
    body.append("return ends")
    return cells, "timed(rank, mb, first, record, vals)", body


def _segment_plan(rank: int, hit: tuple | None) -> tuple | None:
    """:func:`_segment_code`'s result for the runs of one template on ``rank``, as
    :func:`_segmented` reads it per run: (what each input reads: ((rank, stream), -1) for
    that stream's last task so far or (task, dependency) for that dependency of the run's task,
    the segment code, ((rank, stream), relative id) of each stream's last task in the run with
    the own stream first, the own (rank, stream)); the keys made once, not per run."""
    if hit is None:
        return None
    order, seg, last = hit
    reads = tuple(((rank, what[1]), -1) if what[0] == "pred" else what for what in order)
    own = reads[0][0]  # the run's first task's stream, first in ``last`` too
    ends = tuple(((rank, s) if s != own[1] else own, rel) for s, rel in last.items())
    return reads, seg, ends, own


def _segmented(eng: Engine) -> dict[tuple[int, str], list]:
    """(rank, stream) -> what its stream runs, in order (streams in order of first appearance,
    as Program.streams gives them): its tasks, with each run of the program that can be one
    :class:`_Segment` in the list of its first task's stream, in place of its tasks there, and
    left out of the other streams it touches. A task after a segment's tasks on its stream,
    where the segment sits on another stream, waits for the last of them explicitly (a copy of
    it with that dependency added: its stream's own end no longer says when they end).

    One pass over the tasks outside segments; a segment costs a few lookups, whatever its
    length (Megatron-1T: 65,000 segments for 789,000 of its 854,000 tasks)."""
    tasks = eng.prog.items
    out: dict[tuple[int, str], list] = {}
    last_of: dict[tuple[int, str], int] = {}  # (rank, stream) -> its last task so far
    moved: dict[tuple[int, str], int] = {}  # (rank, stream) -> its last task, run by a segment elsewhere
    codes: dict[tuple, tuple | None] = {}  # (template, rank) -> _segment_plan
    forms_of: dict[tuple, list] = {}  # (template, rank) -> the forms of its tasks' own spans, in order
    form_of = eng._form_of

    def plain(lo: int, hi: int) -> None:
        for t in tasks[lo:hi]:
            key = (t.rank, t.stream)
            entries = out.get(key)
            if entries is None:
                entries = out[key] = []
            after = moved.pop(key, None)
            if after is not None:
                t = replace(t, deps=t.deps + (after,))
            entries.append(t)
            last_of[key] = t.tid

    pos = 0
    deferred = eng.prog.deferred  # runs whose tasks are not made (Program): read off the template
    for k_run, (rank, first, end, tmpl) in enumerate(eng.prog.runs):  # in task id order
        plain(pos, first)
        pos = end
        key = (id(tmpl), rank)  # (a template is one rank's: the rank only keeps the keys right)
        hit = codes.get(key, False)
        if hit is False:
            forms_of[key] = [eng.form(eng._span_key(t, rank, t.stream, t.name)) for t in tasks[first:end]]
            hit = codes[key] = _segment_plan(rank, _segment_code(eng, tasks[first:end], forms_of[key]))
        args = deferred.get(k_run)  # (microbatch, inputs) of a run whose tasks are not made
        inputs: list | None = None
        if hit is not None:
            inputs = []
            for k, j in hit[0]:  # (rank, stream): its last task so far; else (task, dep): that dep
                if j < 0:
                    d = last_of.get(k)
                elif args is None:
                    d = tasks[first + k].deps[j]
                else:  # the dependency the template's code names: an input, or a task of the run
                    code = tmpl.protos[k][5][j]
                    d = args[1][code] if code < tmpl.inputs else first + code - tmpl.inputs
                if d is None:  # the stream's first task: the run is left to the stream loop
                    inputs = None
                    break
                inputs.append(d)
        if inputs is None:  # no segment
            if args is not None:
                eng.prog.task(first)  # its tasks made now, in place
            form_of[first:end] = forms_of[key]
            plain(first, end)
            continue
        _, seg, ends, own = hit
        segment = _Segment(tuple(inputs), seg, first, end, tasks[first].mb if args is None else args[0])
        for k, rel in ends:  # each stream's last task in the run: the own stream's first
            entries = out.get(k)
            if entries is None:
                entries = out[k] = []
            last_of[k] = first + rel
            if k is own:
                entries.append(segment)
                moved.pop(k, None)
            else:
                moved[k] = first + rel
    plain(pos, len(tasks))
    return out


# how deep one stream's step may step the streams it depends on (each waits in the ready queue
# anyway: a bound keeps the recursion shallow, whatever the program)
CHASE_DEPTH = 8


class _Stream:
    """One (rank, stream): its tasks in order, each when the previous one is done and its
    dependencies are, driven by callbacks (no generator process per stream).

    A task starts at max(end of the stream's previous task, ends of its dependencies). Its
    end is worked out as soon as those are known, ahead of the clock, when its duration does
    not depend on what else runs: compute, and communications timed in closed form (alone
    on their links; all members' arrival times known). A communication timed in the flow
    network is queued to begin at its start (the last member's, with several) as soon as
    that is known, and the stream waits for its end, which depends on what else is on the
    links once the clock gets there::

        step:  a dependency's end unknown  -> wait for it (woken when it is known)
               start = max(free_s, ends of dependencies)
               fixed duration              -> end = start + duration, record, next task
               flow network                -> arrive; the last member queues the transfer
                                              at the latest arrival; on its end: record
                                              (every member), next task
    """

    __slots__ = ("eng", "tasks", "rank", "stream", "stage", "i", "free_s", "start_s", "pending", "queued")

    def __init__(self, eng: Engine, rank: int, stream: str, entries: list):
        self.eng, self.tasks, self.i = eng, entries, 0  # tasks, and segments (_Segment) in their place
        self.rank, self.stream, self.stage = rank, stream, eng.stage_of.get(rank)  # None: each task's own
        self.free_s = self.start_s = 0.0
        self.pending = 0
        self.queued = False  # released and waiting in Engine._ready to be stepped
        stream_of = eng._stream_of
        for t in entries:
            if t.comm is _SEGMENT:
                stream_of[t.first:t.end] = [self] * (t.end - t.first)
            else:
                stream_of[t.tid] = self

    def step(self, _event=None) -> None:
        eng = self.eng
        end_s, slow, spans_append, waiters_pop, ready_append, flow, stream_of, forms, form_of, of_form = eng._loop
        rank, stream, stage = self.rank, self.stream, self.stage
        tasks = self.tasks
        n, i, free = len(tasks), self.i, self.free_s  # the loop's state, written back before leaving it
        while i < n:
            t = tasks[i]
            start = free
            if t.deps:
                pending = None
                late_chase = False
                for d in t.deps:
                    e = end_s[d]
                    if e < 0.0:
                        # chase: the stream that runs d was released and waits in the ready
                        # queue; step it now rather than wait to be woken by it (a compute
                        # stream and its TP stream hand over at every layer)
                        st = stream_of[d]
                        if st is not None and st.queued and eng._chasing < CHASE_DEPTH:
                            st.queued = False
                            eng._chasing += 1
                            st.step()
                            eng._chasing -= 1
                            e = end_s[d]
                            late_chase = pending is not None
                        if e < 0.0:
                            if pending is None:
                                pending = []
                            pending.append(d)
                            continue
                    if e > start:
                        start = e
                if late_chase:  # a chase may have ended a dependency found unknown before it
                    still = [d for d in pending if end_s[d] < 0.0]
                    if not still:
                        for d in pending:
                            if end_s[d] > start:
                                start = end_s[d]
                    pending = still
                if pending:
                    self.i, self.free_s, self.pending = i, free, len(pending)
                    waiters = eng.waiters
                    for d in pending:
                        waiters.setdefault(d, []).append(self)
                    return
            c = t.comm
            if c is None:
                # rank r runs on GPU r; a straggler (topology what_if) computes slower (its host's
                # work and copies under offload, kind "offload", are not its compute)
                free = start + (t.duration_s * slow.get(rank, 1.0) if slow and t.kind == "compute" else t.duration_s)
                size_bytes, op = t.size_bytes, ""
            elif c is _SEGMENT:  # an action's fixed-duration tasks, timed in one go (_Segment)
                got = t.run(eng, rank)
                if got is None:  # stopped: an input of a later task is not known yet (rare)
                    self.i, self.free_s, self.pending = i, free, 1
                    eng.waiters.setdefault(t.wait, []).append(self)
                    return
                free = got
                i += 1
                continue
            else:
                dur = eng.fixed_comm_s(c, stream)
                if dur < 0.0 or len(c.members) > 1 or c.recv_rank >= 0:
                    self.i, self.free_s = i, free
                    if dur < 0.0:  # the flow network times it
                        self._start_flow(t, c, start)
                        return
                    if not self._fixed_comm(c, start, dur):
                        return  # waiting for the other members
                    i, free = self.i, self.free_s  # advanced by _fixed_comm
                    continue
                # a fixed duration and nobody to wait for (what _fixed_comm does for one member)
                if dur > 0.0 and flow:
                    eng._starts_log(c)(start)
                free = start + dur
                size_bytes, op = c.size_bytes, c.op
            # Engine._complete, inline (compute and one-member closed forms are most of a
            # step's tasks outside segments)
            tid = t.tid
            form = form_of[tid]
            if form is None:  # a task outside the templates
                key = (stream, t.name, t.kind, t.phase, t.stage if stage is None else stage, t.layer, size_bytes, op,
                       t.flops, t.model_flops, () if c is None else eng.comm_args(t))
                form = forms.get(key)
                if form is None:
                    form = eng.form(key)
            spans_append(of_form(rank, form, start, free, t.mb, tid))
            end_s[tid] = free
            released = waiters_pop(tid, None)
            if released:
                for st in released:
                    st.pending -= 1
                    if not st.pending:
                        st.queued = True
                        ready_append(st)
            i += 1
        self.i, self.free_s = i, free

    def _start_flow(self, t: Task, c: Comm, start: float) -> None:
        """Start ``t``'s communication, timed in the flow network, at ``start``: queued at once
        with one member; with more, at the last arrival (:meth:`_arrive`), queued by the last
        member to get there, whatever the clock says then (every member's start is known
        ahead of the clock, as a fixed duration's end is); :meth:`finish` goes on when it ends."""
        eng = self.eng
        if len(c.members) == 1:  # nobody to wait for: its flows are queued to begin at start
            self.start_s = start
            eng._start_comm(c, t.stream, start, on_done=self.finish)
            return
        now = eng.env._now
        rdv = self._arrive(c, start if start > now else now)  # (a start the clock has passed: now)
        if rdv is not None:
            for st in rdv.streams:
                st.start_s = rdv.start_s
            eng._start_comm(c, t.stream, rdv.start_s, on_done=rdv.finish)

    def _arrive(self, c: Comm, start: float) -> _Rendezvous | None:
        """Arrive at ``c`` (several members) at ``start``: its members once all have, else None."""
        rdvs = self.eng._rdv
        rdv = rdvs.get(c.key)
        if rdv is None:
            rdv = rdvs[c.key] = _Rendezvous([], start)
        rdv.arrive(self, start)
        if len(rdv.streams) < len(c.members):
            return None
        del rdvs[c.key]
        return rdv

    def _fixed_comm(self, c: Comm, start: float, dur: float) -> bool:
        """Arrive at a fixed-duration communication at ``start``; when every member has, it
        runs from the last arrival for ``dur`` on all of them. False while others are due."""
        eng = self.eng
        if len(c.members) > 1:
            rdv = self._arrive(c, start)
            if rdv is None:
                return False
            start, members = rdv.start_s, rdv.streams
        else:
            members = (self,)
        if dur > 0.0 and eng.network == "flow":
            eng._starts_log(c)(start)
        end = start + dur
        for st in members:
            eng._complete(st.tasks[st.i], start, end)
            st.free_s = end
            st.i += 1
            if st is not self:
                st.queued = True
                eng._ready.append(st)
        return True

    def finish(self, _event=None) -> None:
        """A communication of the flow network ended now."""
        eng = self.eng
        t = self.tasks[self.i]
        now = eng.env._now  # (Environment.now is a property around it)
        eng._complete(t, self.start_s, now)
        self.free_s = now
        self.i += 1
        self.step()
        eng._wake()


def _binned(segs: list[tuple[np.ndarray, np.ndarray, np.ndarray]], step_s: float, bins: int) -> np.ndarray:
    """Bytes per slice of [0, step_s] of transfers each spread evenly over [start, end].

    With rate_i = bytes_i / (end_i - start_i), the bytes carried by time t are
        F(t) = sum_{start_i < t} rate_i (t - start_i) - sum_{end_i < t} rate_i (t - end_i),
    evaluated at the slice edges from per-slice sums run across the slices (each time's slice
    found among the edges, no sort of the transfers); a slice gets F(right) - F(left).
    Zero-length transfers land whole in the slice of their start.
    """
    if not segs:
        return np.zeros(bins)
    s = np.concatenate([x[0] for x in segs])
    e = np.concatenate([x[1] for x in segs])
    b = np.concatenate([x[2] for x in segs])
    out = np.zeros(bins)
    width = step_s / bins
    point = e <= s
    if point.any():
        np.add.at(out, np.minimum((s[point] / width).astype(int), bins - 1), b[point])
        s, e, b = s[~point], e[~point], b[~point]
    if len(s) == 0:
        return out
    rate = b / (e - s)
    edges_t = np.arange(bins + 1) * width
    edges_t[-1] = max(step_s, float(e.max()))  # the last slice takes everything up to the end

    def ramp(at: np.ndarray) -> np.ndarray:  # sum over at_i < t of rate_i (t - at_i), per edge t
        # at_i < edges_t[j] exactly where j >= k_i: the sums over at_i < t per edge are the
        # running sums of per-slice ones (no sort of the segments: a slice's own are summed
        # in their order)
        k = np.searchsorted(edges_t, at, side="right")
        cum_r = np.cumsum(np.bincount(k, weights=rate, minlength=bins + 2))[:bins + 1]
        cum_rt = np.cumsum(np.bincount(k, weights=rate * at, minlength=bins + 2))[:bins + 1]
        return edges_t * cum_r - cum_rt

    carried = ramp(s) - ramp(e)
    # a slice where nothing ran is a difference of two equal sums, which rounding can leave a
    # few bytes below zero: bytes carried are never negative
    return out + np.maximum(np.diff(carried), 0.0)


def run_program(program: Program, cluster: Cluster, network: str = "flow",
                algorithms: dict[str, str] | None = None) -> Trace:
    """Simulate ``program`` on ``cluster``; ``network`` is 'flow' or 'ideal'; ``algorithms``
    maps a collective to "auto" (the default) or the algorithm it must use."""
    return Engine(program, cluster, network, algorithms).run()
