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
from operator import attrgetter, is_not

import numpy as np

from ..trace import FORM_FIELDS, form_array, form_codes, form_text, form_values, grouped_order, text_codes


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
        part = SpanColumns(list(map(spans.__getitem__, rows.tolist())), rows=rows)
        codes, forms = self._forms
        part.__dict__["_forms"] = (codes[rows], forms)
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
        order = np.argsort(self.rank_pos, kind="stable")
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
    """The tasks of a program as arrays (read on first use, like :class:`SpanColumns`)."""

    def __init__(self, tasks: list):
        self.tasks = tasks
        self.n = len(tasks)

    @cached_property
    def rank(self) -> np.ndarray:
        return _ints(self.tasks, "rank")

    @cached_property
    def _stream(self) -> tuple[np.ndarray, list[str]]:
        return text_codes(map(attrgetter("stream"), self.tasks), self.n)

    stream = property(lambda self: self._stream[0], doc="stream codes (``stream_names``)")
    stream_names = property(lambda self: self._stream[1])

    @cached_property
    def comms(self) -> list:
        return list(map(attrgetter("comm"), self.tasks))

    @cached_property
    def _with_comm(self) -> tuple[np.ndarray, list]:
        """(ids of the tasks with a communication, those communications)."""
        comms = self.comms
        has = np.fromiter(map(is_not, comms, repeat(None)), bool, self.n)
        return np.flatnonzero(has), list(compress(comms, has))

    def _per_comm(self, values, fill: int) -> np.ndarray:
        """A task column from one value per communication (``fill`` for tasks without one)."""
        ids, comms = self._with_comm
        out = np.full(self.n, fill, dtype=np.int64)
        out[ids] = np.fromiter(values, np.int64, len(comms))
        return out

    @cached_property
    def deps(self) -> tuple[np.ndarray, np.ndarray]:
        """(indptr, flat): task t's dependencies are ``flat[indptr[t]:indptr[t+1]]``, in order."""
        deps = list(map(attrgetter("deps"), self.tasks))
        indptr = np.zeros(self.n + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, deps), np.int64, self.n), out=indptr[1:])
        return indptr, np.fromiter(chain.from_iterable(deps), np.int64, int(indptr[-1]))

    @cached_property
    def prev(self) -> np.ndarray:
        """The task issued before each one on its (rank, stream), -1 for the first."""
        key = self.rank * max(len(self.stream_names), 1) + self.stream
        order = np.argsort(key, kind="stable")
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
        ids, comms = self._with_comm
        out = np.full(self.n, -1, dtype=np.int64)
        meet = np.flatnonzero(self.n_members[ids] >= 2)
        if not len(meet):
            return out
        ids, comms = ids[meet], [comms[i] for i in meet.tolist()]
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

    @cached_property
    def n_members(self) -> np.ndarray:
        """Simulated members of each task's communication (0: none)."""
        return self._per_comm(map(len, map(attrgetter("members"), self._with_comm[1])), 0)

    @cached_property
    def recv_rank(self) -> np.ndarray:
        """The receiving simulated rank of a send (-1: none, or no communication)."""
        return self._per_comm(map(attrgetter("recv_rank"), self._with_comm[1]), -1)
