"""Columnar views of a trace's spans and of a program's tasks: one numpy array per attribute.

The analysis reads every span several times over (per rank, per stream, per kind); on a large
step that is close to a million Python objects per pass. Reading each attribute once into an
array turns every later pass into a few vectorised operations::

    spans     Span(rank=0, kind="compute", start_s=0.1, ...)   Span(rank=0, kind="tp", ...)  ...
    columns   rank     [0,       0,      ...]    int64
              start_s  [0.1,     0.3,    ...]    float64
              kind     [0,       4,      ...]    int32 codes: kind_names[4] == "tp"

A column is read on first use. Text attributes become codes numbered in the sorted order of
their values, so ordering by code orders as the strings would. Row i is ``spans[i]``: where a
value goes into the summary as is (a time, a size), it is read from the span itself, so an
``int`` the engine recorded (simpy's clock starts at the integer 0) stays an ``int``.

A view is a snapshot of the spans when each column was read: a span changed in place later is
not seen. The summary shares the trace's cached view (:meth:`clustersim.trace.Trace.columns`),
and so do the invariant checks when :func:`clustersim.simulate` runs them right after it;
called on their own, they read their own view, so they check the spans as they are.
"""

from __future__ import annotations

from functools import cached_property
from itertools import chain, compress, repeat
from operator import attrgetter, is_not, itemgetter

import numpy as np

from ..trace import (FORM_FIELDS, SpanRows, form_array, form_codes, form_text, form_values, grouped_order,
                     index_ranges, stable_argsort, text_codes, unique)


def _floats(objs: list, attr: str) -> np.ndarray:
    return np.fromiter(map(attrgetter(attr), objs), np.float64, len(objs))


def _ints(objs: list, attr: str) -> np.ndarray:
    return np.fromiter(map(attrgetter(attr), objs), np.int64, len(objs))


def mixed_radix(*cols: np.ndarray) -> np.ndarray | None:
    """One int64 per row that orders as the tuple of ``cols`` does (lexicographically); None
    when the ranges are too wide to fit."""
    key = np.zeros(len(cols[0]), dtype=np.int64)
    span = 1
    for c in cols:
        lo, hi = (int(c.min()), int(c.max())) if len(c) else (0, 0)
        width = hi - lo + 1
        span *= width
        if span >= 2**62:
            return None
        key = key * width + (c - lo)
    return key


class SpanColumns:
    """The spans of a trace as arrays (module docstring); ``ranks``: the trace's simulated
    ranks, in the order per-rank results follow (needed by :meth:`rank_groups` only).

    :attr:`compute` and :attr:`other` are views of the compute spans and of the rest (rows
    ``rows`` of this one): attributes only one side needs (the phase of a compute span, the
    bytes of a communication) are read for that side only."""

    def __init__(self, spans: list, ranks: list[int] | None = None, rows: np.ndarray | None = None):
        self.spans = spans  # held: the view is of this list (see Trace.columns)
        self.n = len(spans)
        self.ranks = list(ranks) if ranks is not None else None
        self.rows = rows  # a part's rows in the whole view (None: the whole)
        self._own: tuple | None = None

    def _part(self, rows: np.ndarray) -> SpanColumns:
        spans = self.spans
        part = SpanColumns(spans.take(rows) if isinstance(spans, SpanRows) else
                           list(map(spans.__getitem__, rows.tolist())), rows=rows)
        codes, forms = self._forms
        part.__dict__["_forms"] = (codes[rows], forms)
        for attr in ("rank", "tid", "mb", "start_s", "end_s"):  # the same values, read already
            col = self.__dict__.get(attr)
            if col is not None:
                part.__dict__[attr] = col[rows]
        return part

    @cached_property
    def compute(self) -> SpanColumns:
        """The compute spans' view; its ``rows`` index this one."""
        return self._part(np.flatnonzero(self.kind == self.code("kind", "compute")))

    @cached_property
    def other(self) -> SpanColumns:
        """The view of the spans that are not compute (communications); ``rows`` index this one."""
        return self._part(np.flatnonzero(self.kind != self.code("kind", "compute")))

    def take(self, attr: str, rows: np.ndarray, dtype=np.float64) -> np.ndarray:
        """``attr`` of the spans ``rows`` only, read now (nothing kept)."""
        if attr in FORM_FIELDS:
            codes, forms = self._forms
            return form_array(forms, codes[rows], attr, dtype)
        spans = self.spans
        return np.fromiter(map(attrgetter(attr), [spans[i] for i in rows.tolist()]), dtype, len(rows))

    @cached_property
    def _forms(self) -> tuple:
        """(each span's form code, the forms): the fields spans share are read per form."""
        return form_codes(self.spans)

    def form_values(self, attr: str) -> list:
        """``attr`` (a field spans share, FORM_FIELDS) of each span, as its form holds it."""
        codes, forms = self._forms
        return form_values(forms, codes, attr)

    def form_table(self, attr: str) -> tuple[np.ndarray, list]:
        """(each span's form code, ``attr`` of each form as it holds it): :meth:`form_values`
        before it is spread over the spans."""
        codes, forms = self._forms
        return codes, list(map(attrgetter(attr), forms))

    def _form_array(self, attr: str, dtype=np.float64) -> np.ndarray:
        codes, forms = self._forms
        return form_array(forms, codes, attr, dtype)

    def _form_text(self, attr: str) -> tuple[np.ndarray, list[str]]:
        codes, forms = self._forms
        return form_text(forms, codes, attr)

    # --- numbers -------------------------------------------------------------------------
    @cached_property
    def rank(self) -> np.ndarray:
        return _ints(self.spans, "rank")

    @cached_property
    def tid(self) -> np.ndarray:
        return _ints(self.spans, "tid")

    @cached_property
    def mb(self) -> np.ndarray:
        return _ints(self.spans, "mb")

    @cached_property
    def stage(self) -> np.ndarray:
        return self._form_array("stage", np.int64)

    @cached_property
    def layer(self) -> np.ndarray:
        return self._form_array("layer", np.int64)

    @cached_property
    def start_s(self) -> np.ndarray:
        return _floats(self.spans, "start_s")

    @cached_property
    def end_s(self) -> np.ndarray:
        return _floats(self.spans, "end_s")

    @cached_property
    def size_bytes(self) -> np.ndarray:
        return self._form_array("size_bytes")

    # --- text, as codes (each form's value, spread) ----------------------------------------
    @cached_property
    def _kind(self) -> tuple[np.ndarray, list[str]]:
        return self._form_text("kind")

    @cached_property
    def _stream(self) -> tuple[np.ndarray, list[str]]:
        return self._form_text("stream")

    @cached_property
    def _phase(self) -> tuple[np.ndarray, list[str]]:
        return self._form_text("phase")

    @cached_property
    def _op(self) -> tuple[np.ndarray, list[str]]:
        return self._form_text("op")

    @cached_property
    def _name(self) -> tuple[np.ndarray, list[str]]:
        return self._form_text("name")

    kind = property(lambda self: self._kind[0], doc="kind codes (``kind_names``)")
    kind_names = property(lambda self: self._kind[1])
    stream = property(lambda self: self._stream[0], doc="stream codes (``stream_names``)")
    stream_names = property(lambda self: self._stream[1])
    phase = property(lambda self: self._phase[0], doc="phase codes (``phase_names``)")
    phase_names = property(lambda self: self._phase[1])
    op = property(lambda self: self._op[0], doc="op codes (``op_names``)")
    op_names = property(lambda self: self._op[1])
    name = property(lambda self: self._name[0], doc="name codes (``name_names``)")
    name_names = property(lambda self: self._name[1])

    def code(self, attr: str, value: str) -> int:
        """The code of ``value`` in the text column ``attr``; -1 when no span has it."""
        names = getattr(self, attr + "_names")
        for i, v in enumerate(names):
            if v == value:
                return i
        return -1

    def codes_of(self, attr: str, values: list[str]) -> np.ndarray:
        """Codes of ``values`` in the text column ``attr`` (-1 where no span has the value)."""
        index = {v: i for i, v in enumerate(getattr(self, attr + "_names"))}
        return np.array([index.get(v, -1) for v in values], dtype=np.int64)

    def is_in(self, attr: str, values) -> np.ndarray:
        """Row mask: the text column ``attr`` holds one of ``values``."""
        codes = [c for c in (self.code(attr, v) for v in values) if c >= 0]
        return np.isin(getattr(self, attr), codes)

    # --- groupings -----------------------------------------------------------------------
    @cached_property
    def rank_pos(self) -> np.ndarray:
        """Each span's rank as its position in ``ranks``."""
        if self.ranks is None:
            raise ValueError("a view without the trace's ranks has no per-rank grouping")
        if not self.n:
            return np.zeros(0, dtype=np.int64)
        known = np.asarray(self.ranks, dtype=np.int64)
        lo = int(min(self.rank.min(), known.min(initial=0)))
        hi = int(max(self.rank.max(), known.max(initial=0)))
        lookup = np.full(hi - lo + 1, -1, dtype=np.int64)
        lookup[known - lo] = np.arange(len(known))
        pos = lookup[self.rank - lo]
        if (pos < 0).any():
            raise KeyError(int(self.rank[np.argmax(pos < 0)]))  # a span on a rank the trace does not list
        return pos

    @cached_property
    def rank_groups(self) -> tuple[np.ndarray, np.ndarray]:
        """(order, bounds): ``order[bounds[k]:bounds[k+1]]`` are the rows of ``ranks[k]``, in
        span order."""
        order = stable_argsort(self.rank_pos)
        bounds = np.searchsorted(self.rank_pos[order], np.arange(len(self.ranks) + 1))
        return order, bounds

    @cached_property
    def time_groups(self) -> tuple[np.ndarray, np.ndarray]:
        """(order, bounds) as :attr:`rank_groups`, each rank's rows sorted by (start, kind) —
        kind in its text order — then span order."""
        order, _ = grouped_order(self.rank_pos, self.kind, self.start_s)
        bounds = np.searchsorted(self.rank_pos[order], np.arange(len(self.ranks) + 1))
        return order, bounds

    def end_s_max(self):
        """The latest end over the spans, as the span recorded it (0.0 without spans) —
        :attr:`clustersim.trace.Trace.end_s`."""
        if not self.n:
            return 0.0
        return self.spans[int(np.argmax(self.end_s))].end_s  # argmax: the first of equal ends

    def own_rows(self, tasks: list, tc: TaskColumns | None = None) -> np.ndarray:
        """Rows (ascending) of the spans left by a task on its own rank and stream: a send's
        receive, recorded on the receiver under the same id, is not one. Remembered for
        ``tasks``."""
        if self._own is not None and self._own[0] is tasks and self._own[1] == len(tasks):
            return self._own[2]
        tc = tc if tc is not None else TaskColumns(tasks)
        tid = self.tid
        rows = np.flatnonzero((tid >= 0) & (tid < len(tasks)))
        t = tid[rows]
        stream_of = self.codes_of("stream", tc.stream_names)  # task stream code -> span stream code
        rows = rows[(self.rank[rows] == tc.rank[t]) & (self.stream[rows] == stream_of[tc.stream[t]])]
        self._own = (tasks, len(tasks), rows, None)
        return rows

    def own_index(self, tasks: list, tc: TaskColumns | None = None) -> np.ndarray:
        """Task id -> row of the span it left on its own rank and stream (:meth:`own_rows`),
        -1 when none; of several, the last (as a dict filled in span order keeps)."""
        rows = self.own_rows(tasks, tc)
        if self._own[3] is None:
            out = np.full(len(tasks), -1, dtype=np.int64)
            np.maximum.at(out, self.tid[rows], rows)  # rows ascend: the largest is the last
            self._own = (*self._own[:3], out)
        return self._own[3]


class TaskColumns:
    """The tasks of a program as arrays (read on first use, like :class:`SpanColumns`).

    With the program's ``runs`` (``Program.runs``), the tasks of each run are read off its
    template, for all runs of a template at once: a run's tasks are the template's protos with
    the run's rank, ids and inputs (what the lowering made them from, and what the engine
    reads them as). Only the tasks outside runs, and the few in runs that read the run's
    inputs (their dependencies), are read one by one (Megatron-1T: 170,000 of 854,000)::

        tasks     [send][F attn L0 | AR | F mlp L0 | AR ...][send][F attn L0 | AR ...]
        runs             run 0, template 3                        run 1, template 3
        read      object  template 3's protos, rank and ids of run  object  (the same protos)
    """

    def __init__(self, tasks: list, runs: list | tuple = (), program=None):
        self.tasks = tasks
        self.n = len(tasks)
        self.runs = runs
        # the Program whose ``items`` are ``tasks``: a run whose tasks it has not made
        # (Program.deferred) is read off its template and inputs, or made when a task's
        # object is needed
        self.program = program

    def _task(self, tid: int):
        t = self.tasks[tid]
        return t if t is not None else self.program.task(tid)

    @cached_property
    def _layout(self) -> _RunLayout:
        return _RunLayout(self.tasks, self.runs)

    @cached_property
    def _gap_comms(self) -> tuple[np.ndarray, list]:
        """(ids of the tasks outside runs that have a communication, those communications)."""
        lay = self._layout
        comms = list(map(attrgetter("comm"), lay.gap))
        has = np.fromiter(map(is_not, comms, repeat(None)), bool, len(comms))
        return lay.gap_ids[has], list(compress(comms, has))

    @property
    def gap_comms(self) -> list:
        """The communications of the tasks outside runs, in task order."""
        return self._gap_comms[1]

    def _per_comm(self, of_comm, of_spec, fill: int) -> np.ndarray:
        """A column with one value per communication: ``of_comm`` of those of the tasks outside
        runs, ``of_spec`` of the communication specs of the templates' protos; ``fill`` for
        tasks without one."""
        lay = self._layout
        out = np.full(self.n, fill, dtype=np.int64)
        ids, comms = self._gap_comms
        out[ids] = np.fromiter(map(of_comm, comms), np.int64, len(comms))
        if len(lay.run_ids):
            spec = list(map(itemgetter(0), lay.protos))
            out[lay.run_ids] = np.fromiter((fill if x is None else of_spec(x) for x in spec), np.int64,
                                           len(spec))[lay.proto]
        return out

    @cached_property
    def rank(self) -> np.ndarray:
        lay = self._layout
        out = np.empty(self.n, dtype=np.int64)
        out[lay.gap_ids] = _ints(lay.gap, "rank")
        out[lay.run_ids] = lay.run_rank[lay.run_of]
        return out

    @cached_property
    def _stream(self) -> tuple[np.ndarray, list[str]]:
        lay = self._layout
        codes, names = text_codes(chain(map(attrgetter("stream"), lay.gap), map(itemgetter(1), lay.protos)),
                                  len(lay.gap) + len(lay.protos))
        out = np.empty(self.n, dtype=codes.dtype)
        out[lay.gap_ids] = codes[:len(lay.gap)]
        out[lay.run_ids] = codes[len(lay.gap):][lay.proto]
        return out, names

    stream = property(lambda self: self._stream[0], doc="stream codes (``stream_names``)")
    stream_names = property(lambda self: self._stream[1])

    @cached_property
    def mb(self) -> np.ndarray:
        """Each task's microbatch. Every task of a run has its run's (lower._template_of
        checks it), read from the run's record where the run is not made yet
        (``Program.deferred``), else from its first task."""
        lay = self._layout
        out = np.empty(self.n, dtype=np.int64)
        out[lay.gap_ids] = _ints(lay.gap, "mb")
        deferred = self.program.deferred if self.program is not None else {}
        tasks = self.tasks
        run_mb = np.fromiter((deferred[k][0] if k in deferred else tasks[first].mb
                              for k, first in enumerate(lay.run_first.tolist())), np.int64, len(lay.run_first))
        out[lay.run_ids] = run_mb[lay.run_of]
        return out

    @cached_property
    def n_members(self) -> np.ndarray:
        """Simulated members of each task's communication (0: none)."""
        return self._per_comm(lambda c: len(c.members), lambda spec: len(spec[4]), 0)

    @cached_property
    def recv_rank(self) -> np.ndarray:
        """The receiving simulated rank of a send (-1: none, or no communication)."""
        return self._per_comm(attrgetter("recv_rank"), itemgetter(9), -1)

    @cached_property
    def deps(self) -> tuple[np.ndarray, np.ndarray]:
        """(indptr, flat): task t's dependencies are ``flat[indptr[t]:indptr[t+1]]``, in order.
        A task of a run that reads none of the run's inputs depends on tasks of its run only:
        ``first + code - inputs`` for each of its template's dependency codes."""
        lay = self._layout
        inner = ~lay.p_reads_input[lay.proto]  # tasks of runs made from their template alone
        deferred = self.program.deferred if self.program is not None else {}
        # runs whose tasks are not made: their tasks that read inputs are read off the
        # template and the run's inputs (Program.deferred) too
        if deferred:
            run_deferred = np.zeros(len(self.runs), dtype=bool)
            run_deferred[np.fromiter(deferred, np.int64, len(deferred))] = True
            by_code = ~inner & run_deferred[lay.run_of]
        else:
            by_code = np.zeros(len(lay.run_ids), dtype=bool)
        own = inner | by_code
        own_ids, own_proto, own_run = lay.run_ids[own], lay.proto[own], lay.run_of[own]
        read_ids = lay.outside.copy()  # the others, read one by one
        read_ids[lay.run_ids[~own]] = True
        read_ids = np.flatnonzero(read_ids)
        tasks = self.tasks
        read = [tasks[i].deps for i in read_ids.tolist()]
        counts = np.empty(self.n, dtype=np.int64)
        counts[read_ids] = np.fromiter(map(len, read), np.int64, len(read))
        counts[own_ids] = lay.p_n_deps[own_proto]
        indptr = np.zeros(self.n + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        flat = np.empty(int(indptr[-1]), dtype=np.int64)
        at_read = index_ranges(indptr, read_ids)
        flat[at_read] = np.fromiter(chain.from_iterable(read), np.int64, int(counts[read_ids].sum()))
        if len(own_ids):
            n_deps = lay.p_n_deps[own_proto]
            at = index_ranges(lay.p_code_ptr, own_proto)  # each dependency's place among the protos' codes
            # a task of the run: first + code - inputs (the proto's part worked out per code, once)
            values = np.repeat(lay.run_first[own_run], n_deps)
            values += lay.p_rel[at]
            named = lay.p_named[at]  # an input of the run: inputs[code] (runs not made only)
            if named.any():
                runs = np.repeat(own_run, n_deps)[named]
                used = unique(runs)
                ptr = np.zeros(len(self.runs) + 1, dtype=np.int64)
                read_in = [deferred[k][1] for k in used.tolist()]
                ptr[used + 1] = np.fromiter(map(len, read_in), np.int64, len(read_in))
                np.cumsum(ptr, out=ptr)
                inputs = np.fromiter(chain.from_iterable(read_in), np.int64, int(ptr[-1]))
                values[named] = inputs[ptr[runs] + lay.p_codes[at[named]]]
            if bool((own_ids[1:] > own_ids[:-1]).all()):  # (runs in id order): the places not read
                mine = np.ones(len(flat), dtype=bool)  # a mask is 4x faster than the ranges on 800,000 tasks
                mine[at_read] = False
                flat[mine] = values
            else:
                flat[index_ranges(indptr, own_ids)] = values
        return indptr, flat

    @cached_property
    def _lane(self) -> np.ndarray:
        """Each task's (rank, stream) as one number, in the order of ranks, then stream codes."""
        return self.rank * max(len(self.stream_names), 1) + self.stream

    @cached_property
    def stream_order(self) -> np.ndarray:
        """Task ids by (rank, stream), each stream's in issue (id) order."""
        return stable_argsort(self._lane)  # (by radix: the lanes come interleaved, in id order)

    @cached_property
    def prev(self) -> np.ndarray:
        """The task issued before each one on its (rank, stream), -1 for the first."""
        key = self._lane
        order = self.stream_order
        out = np.full(self.n, -1, dtype=np.int64)
        same = key[order[1:]] == key[order[:-1]]
        out[order[1:][same]] = order[:-1][same]
        return out

    @cached_property
    def rendezvous(self) -> np.ndarray:
        """Tasks that meet at one rendezvous share a number, -1 for the others: communications
        with two or more simulated members and the same key. The engine makes only those wait
        for each other (one member starts alone, whatever its key), and a collapsed step has
        few of them: the keys of the others are not read.

        Keys are hashed once; only tasks whose hashes collide are compared key by key."""
        out = np.full(self.n, -1, dtype=np.int64)
        ids = np.flatnonzero(self.n_members >= 2)
        if not len(ids):
            return out
        comms = [self._task(i).comm for i in ids.tolist()]
        h = np.fromiter(map(hash, map(attrgetter("key"), comms)), np.int64, len(comms))
        _, first, inv, counts = np.unique(h, return_index=True, return_inverse=True, return_counts=True)
        group = first[inv]  # same hash: the first such communication's place, a provisional group
        shared = np.flatnonzero(counts[inv] > 1)
        shared = shared[np.argsort(inv[shared], kind="stable")]
        seen: dict = {}
        last = -1
        for r, g in zip(shared.tolist(), inv[shared].tolist()):  # equal hashes: tell the keys apart exactly
            if g != last:
                seen, last = {}, g
            group[r] = seen.setdefault(comms[r].key, r)
        out[ids] = group
        return out


class _RunLayout:
    """Where the tasks of a program's runs are and what their templates say about them (see
    :class:`TaskColumns`): per task of a run, its run and its proto (in one table of the protos
    of every template used); per proto, its dependency codes and whether any of them reads
    the run's inputs; the ids and objects of the tasks outside runs."""

    def __init__(self, tasks: list, runs):
        n, m = len(tasks), len(runs)
        ranks, firsts, ends, templates = zip(*runs) if m else ((), (), (), ())
        ids = list(map(id, templates))
        by_id = dict(zip(ids, templates))  # the templates used, in order of first use
        index: dict[int, int] = {}  # id(template) -> its first proto in the table
        protos: list = []
        inputs: list[int] = []  # per proto: how many inputs its template's runs have
        for key, tmpl in by_id.items():
            index[key] = len(protos)
            protos += tmpl.protos
            inputs += [tmpl.inputs] * len(tmpl.protos)
        starts = list(map(index.__getitem__, ids))
        self.protos = protos
        self.run_rank = np.array(ranks, dtype=np.int64)
        self.run_first = np.array(firsts, dtype=np.int64)
        length = np.array(ends, dtype=np.int64) - self.run_first
        total = int(length.sum())
        self.run_of = np.repeat(np.arange(m, dtype=np.int64), length)
        rel = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(length) - length, length)
        self.run_ids = self.run_first[self.run_of] + rel
        self.proto = np.asarray(starts, dtype=np.int64)[self.run_of] + rel if m else np.zeros(0, np.int64)
        self.outside = outside = np.ones(n, dtype=bool)
        outside[self.run_ids] = False
        self.gap_ids = np.flatnonzero(outside)
        self.gap = list(map(tasks.__getitem__, self.gap_ids.tolist()))
        codes = list(map(itemgetter(5), protos))
        self.p_inputs = np.asarray(inputs, dtype=np.int64)
        self.p_n_deps = np.fromiter(map(len, codes), np.int64, len(codes))
        self.p_code_ptr = np.zeros(len(codes) + 1, dtype=np.int64)
        np.cumsum(self.p_n_deps, out=self.p_code_ptr[1:])
        self.p_codes = np.fromiter(chain.from_iterable(codes), np.int64, int(self.p_code_ptr[-1]))
        first_code = np.repeat(self.p_inputs, self.p_n_deps)  # codes below it name an input
        self.p_named = self.p_codes < first_code  # per code: an input of the run
        self.p_rel = self.p_codes - first_code  # per code naming a task of the run: its place after the run's first
        reads = np.zeros(len(codes), dtype=bool)
        np.logical_or.at(reads, np.repeat(np.arange(len(codes)), self.p_n_deps), self.p_named)
        self.p_reads_input = reads
