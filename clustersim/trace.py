"""Trace: what happened, as spans (rank, stream, name, kind, start, end, ...).

Everything downstream — metrics, report, Perfetto — is derived from these spans.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import count
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .analysis.columns import SpanColumns, TaskColumns


def text_codes(values: Iterable, n: int) -> tuple[np.ndarray, list]:
    """(code of each of the ``n`` values, the distinct values sorted): ``names[codes[i]] ==
    values[i]``, codes int32 numbered in the sorted order of the values, so that ordering by
    code orders as the text would. One pass numbers each value by the position of its first
    occurrence; those numbers are then renumbered in sorted order."""
    return _codes(values, n, sort=True)


def appearance_codes(values: Iterable, n: int) -> tuple[np.ndarray, list]:
    """(int32 code of each of the ``n`` values, the distinct values in order of first
    appearance): ``distinct[codes[i]] == values[i]``; values need only hash."""
    return _codes(values, n, sort=False)


def _codes(values: Iterable, n: int, sort: bool) -> tuple[np.ndarray, list]:
    """(int32 code of each of the ``n`` values, the distinct values): numbered in sorted order
    with ``sort``, else in order of first appearance. Values need only hash (and, to sort,
    order)."""
    first: dict = {}
    raw = np.fromiter(map(first.setdefault, values, count()), np.int64, n)
    names = sorted(first) if sort else list(first)
    renumber = np.zeros(n, dtype=np.int32)
    renumber[[first[v] for v in names]] = np.arange(len(names), dtype=np.int32)
    return renumber[raw], names


def unique(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)``: the distinct values, ascending. numpy's own asks whether the
    array is masked first, which imports numpy.ma on its first call (about 10 ms: a third of
    what moe_1024gpu's invariant checks take otherwise)."""
    ordered = np.sort(values, axis=None)
    if len(ordered) < 2:
        return ordered
    keep = np.empty(len(ordered), dtype=bool)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


def index_ranges(ptr: np.ndarray, which: np.ndarray) -> np.ndarray:
    """The indices ``ptr[i]:ptr[i + 1]`` for each ``i`` of ``which``, in that order, as one array
    (the rows of a CSR structure: the links of some flows, the dependencies of some tasks)."""
    if len(which) == 1:  # the usual case in the flow network: one link at the bottleneck
        i = int(which[0])
        return np.arange(ptr[i], ptr[i + 1])
    lo = ptr[which]
    counts = ptr[which + 1] - lo
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    return np.repeat(lo - (np.cumsum(counts) - counts), counts) + np.arange(total)


def grouped_order(group: np.ndarray, *keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order, starts): rows ordered by ``group`` (ascending), then within a group by ``keys``
    as ``np.lexsort(keys)`` orders (the last key first), ties in row order; ``starts``: where
    each group begins in ``order``. Sorting group by group is several times faster than one
    lexsort over everything (small sorts stay in cache)."""
    order = np.argsort(group, kind="stable")
    g = group[order]
    starts = np.flatnonzero(np.concatenate(([True], g[1:] != g[:-1]))) if len(g) else np.zeros(0, dtype=np.int64)
    if keys and len(starts) > 1 + len(order) // 256:  # many small groups: one lexsort is cheaper
        order = np.lexsort((*keys, group))
    elif keys:
        ends = np.append(starts[1:], len(order))
        for a, b in zip(starts.tolist(), ends.tolist()):
            seg = order[a:b]
            order[a:b] = seg[np.lexsort(tuple(k[seg] for k in keys))]
    return order, starts


# what the spans of one kind of task share (SpanForm), in Span's constructor order
FORM_FIELDS = ("stream", "name", "kind", "phase", "stage", "layer", "size_bytes", "op", "flops", "model_flops")
# every field of a span, in its constructor's order
SPAN_FIELDS = ("rank", "stream", "name", "kind", "start_s", "end_s", "mb", "phase", "stage", "layer", "size_bytes",
               "op", "flops", "model_flops", "tid")
_FORM_VALUES = attrgetter(*FORM_FIELDS)
_SPAN_VALUES = attrgetter(*SPAN_FIELDS)


class SpanForm:
    """The fields a span shares with every span of the same kind of task, one object for all
    of them (a step repeats a few thousand forms over up to a million spans)::

        Span(rank 0, mb 0, 1.20-1.25 ms) ──┐
        Span(rank 0, mb 1, 1.31-1.36 ms) ──┼──▶ SpanForm(stream="compute", name="F attn", layer=3, ...)
        Span(rank 8, mb 0, 1.20-1.25 ms) ──┘

    Readers that go over every span (the analysis's columns, the trace file, the report)
    read each form once and spread its values by form. Read-only, since spans share it; it
    is compared and hashed as an object (a group of spans), so two forms may hold the same
    values: the engine makes one per distinct set of values, a span made by hand its own."""

    __slots__ = FORM_FIELDS

    def __init__(self, stream: str, name: str, kind: str, phase: str = "", stage: int = -1, layer: int = -1,
                 size_bytes: float = 0.0, op: str = "", flops: float = 0.0, model_flops: float = 0.0):
        for k, v in zip(FORM_FIELDS, (stream, name, kind, phase, stage, layer, size_bytes, op, flops, model_flops)):
            object.__setattr__(self, k, v)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"a SpanForm is shared by many spans; set {name} on the Span, which then takes "
                             "a form of its own")

    def values(self) -> tuple:
        """The fields, in FORM_FIELDS order."""
        return _FORM_VALUES(self)

    def __repr__(self) -> str:
        return "SpanForm(" + ", ".join(f"{k}={v!r}" for k, v in zip(FORM_FIELDS, self.values())) + ")"

    def __reduce__(self):
        return SpanForm, self.values()


def _form_field(k: int, name: str) -> property:
    """A span's field kept in its form: read there; set, the span takes a new form."""

    def set_field(span: Span, value) -> None:
        values = list(span.form.values())
        values[k] = value
        span.form = SpanForm(*values)

    return property(attrgetter("form." + name), set_field, doc=f"``form.{name}``")


class Span:
    """What one task did on one rank and stream, from ``start_s`` to ``end_s``. The fields
    every span of the same kind of task shares (stream, name, kind, phase, stage, layer,
    size_bytes, op, flops, model_flops) live in its :class:`SpanForm` and read as its own;
    the rest are the span's: rank, start_s, end_s, mb (-1: none) and tid (the program task
    that produced it; a send and its receive share one)::

        Span(rank=0, stream="compute", name="F attn", kind="compute", start_s=0.1, end_s=0.2, ...)
        span.name == span.form.name

    The engine makes spans from forms it shares: ``Span.of_form(rank, form, start_s, end_s, mb,
    tid)``."""

    __slots__ = ("rank", "start_s", "end_s", "mb", "tid", "form")

    def __init__(self, rank: int, stream: str, name: str, kind: str, start_s: float, end_s: float, mb: int = -1,
                 phase: str = "", stage: int = -1, layer: int = -1, size_bytes: float = 0.0, op: str = "",
                 flops: float = 0.0, model_flops: float = 0.0, tid: int = -1):
        self.rank, self.start_s, self.end_s, self.mb, self.tid = rank, start_s, end_s, mb, tid
        self.form = SpanForm(stream, name, kind, phase, stage, layer, size_bytes, op, flops, model_flops)

    stream = _form_field(0, "stream")
    name = _form_field(1, "name")
    kind = _form_field(2, "kind")  # "compute" | "tp" | "pp" | "dp" | ...
    phase = _form_field(3, "phase")
    stage = _form_field(4, "stage")
    layer = _form_field(5, "layer")
    size_bytes = _form_field(6, "size_bytes")
    op = _form_field(7, "op")  # communication op ("all_reduce", "send", ...); "" for compute
    flops = _form_field(8, "flops")
    model_flops = _form_field(9, "model_flops")

    @property
    def dur_s(self) -> float:
        return self.end_s - self.start_s

    def values(self) -> tuple:
        """Every field, in SPAN_FIELDS order."""
        return _SPAN_VALUES(self)

    def as_dict(self) -> dict:
        """Every field by name, in SPAN_FIELDS order (a row of a table of spans)."""
        return dict(zip(SPAN_FIELDS, _SPAN_VALUES(self)))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Span):
            return NotImplemented
        return self.values() == other.values()

    __hash__ = None  # mutable, as before

    def __repr__(self) -> str:
        return "Span(" + ", ".join(f"{k}={v!r}" for k, v in zip(SPAN_FIELDS, self.values())) + ")"

    def __reduce__(self):
        return Span.of_form, (self.rank, self.form, self.start_s, self.end_s, self.mb, self.tid)


class _FormSpan(Span):
    """A :class:`Span` made from a shared form: the engine makes up to a million, and six
    fields cost two thirds of fifteen to set. Nothing else tells it from a Span."""

    __slots__ = ()

    def __init__(self, rank: int, form: SpanForm, start_s: float, end_s: float, mb: int, tid: int):
        self.rank, self.form, self.start_s, self.end_s, self.mb, self.tid = rank, form, start_s, end_s, mb, tid


# Span.of_form(rank, form, start_s, end_s, mb, tid): a span of ``form`` (shared, not copied)
Span.of_form = _FormSpan


def form_codes(spans: list) -> tuple[np.ndarray, list[SpanForm]]:
    """(each span's form as an int32 code, the distinct forms in order of first appearance):
    ``forms[codes[i]] is spans[i].form``. Forms are told apart as objects (cheap to hash)."""
    return appearance_codes(map(attrgetter("form"), spans), len(spans))


def form_values(forms: list[SpanForm], codes: np.ndarray, attr: str) -> list:
    """``attr`` of each span whose form codes are ``codes``, as the forms hold it (an int
    stays an int): each form read once, spread by code."""
    values = list(map(attrgetter(attr), forms))
    return list(map(values.__getitem__, codes.tolist()))


def form_array(forms: list[SpanForm], codes: np.ndarray, attr: str, dtype=np.float64) -> np.ndarray:
    """:func:`form_values` as an array of ``dtype``."""
    return np.fromiter(map(attrgetter(attr), forms), dtype, len(forms))[codes]


def form_text(forms: list[SpanForm], codes: np.ndarray, attr: str) -> tuple[np.ndarray, list]:
    """:func:`text_codes` of a text field held by the forms, per span: (codes, the distinct
    values sorted) over the forms that ``codes`` uses only."""
    present = np.bincount(codes, minlength=len(forms)) > 0
    if not present.all():  # a part of the spans: leave out the values no span of it has
        used = np.flatnonzero(present)
        forms = [forms[i] for i in used.tolist()]
        renumber = np.zeros(len(present), dtype=np.int32)
        renumber[used] = np.arange(len(used), dtype=np.int32)
        codes = renumber[codes]
    per_form, names = text_codes(map(attrgetter(attr), forms), len(forms))
    return per_form[codes], names


@dataclass(frozen=True)
class SpanBase:
    """What sorting the spans reads from each of them, kept as columns for the readers after
    it (the summary's and the invariant checks' :class:`~clustersim.analysis.columns.SpanColumns`,
    the report's and the trace file's display order): row i is ``spans[i]``. A snapshot of the
    list ``spans``, as the columnar views are: spans changed in place later are not seen."""

    spans: list  # the list described (identity and length tell whether it still is)
    rank: np.ndarray  # int64
    stream: np.ndarray  # int32 codes, in the sorted order of stream_names (text_codes)
    stream_names: list[str]
    start_s: np.ndarray  # float64
    end_s: np.ndarray
    tid: np.ndarray  # int64
    mb: np.ndarray  # int64
    form: np.ndarray  # int32 codes into forms (form_codes)
    forms: list[SpanForm]

    @classmethod
    def of(cls, spans: list) -> SpanBase:
        n = len(spans)
        form, forms = form_codes(spans)
        stream, names = form_text(forms, form, "stream")
        return cls(spans, np.fromiter(map(attrgetter("rank"), spans), np.int64, n), stream, names,
                   np.fromiter(map(attrgetter("start_s"), spans), np.float64, n),
                   np.fromiter(map(attrgetter("end_s"), spans), np.float64, n),
                   np.fromiter(map(attrgetter("tid"), spans), np.int64, n),
                   np.fromiter(map(attrgetter("mb"), spans), np.int64, n), form, forms)

    def sorted(self) -> SpanBase:
        """The spans by rank, start, end and stream name (stable: ties keep their order), as
        ``sorted(spans, key=attrgetter("rank", "start_s", "end_s", "stream"))`` orders them,
        with their columns."""
        order, _ = grouped_order(self.rank, self.stream, self.end_s, self.start_s)  # rank by rank: in cache
        spans = list(map(self.spans.__getitem__, order.tolist()))
        return SpanBase(spans, self.rank[order], self.stream[order], self.stream_names, self.start_s[order],
                        self.end_s[order], self.tid[order], self.mb[order], self.form[order], self.forms)

    def describes(self, spans: list) -> bool:
        return self.spans is spans and len(spans) == len(self.rank)


@dataclass(slots=True)  # read-only by convention: frozen instances cost 4x to create (a step has up to 26,000)
class LinkUse:
    """Bytes one directed link carried in the step (real traffic: a simulated flow's bytes
    times its weight there) and, for the busiest links, its rate over the step (``series_Bps``,
    mean rate per slice) and the highest of those (``peak_Bps``; 0 when not worked out)."""

    name: str  # "n0.gpu0->n0.nvsw"
    kind: str  # "nvlink" | "pcie" | "nic" | "fabric"
    bw_Bps: float
    bytes: float
    peak_Bps: float
    series_Bps: tuple[float, ...] = ()  # mean rate in each 1/len of the step


@dataclass
class Trace:
    """Spans of the simulated ranks; ``weight[r]`` real ranks behave like simulated rank r."""

    spans: list[Span]
    ranks: list[int]
    weight: dict[int, int]
    stage_of: dict[int, int] = field(default_factory=dict)
    # collective -> algorithm -> communications of the simulated ranks that used it
    algorithms: dict[str, dict[str, int]] = field(default_factory=dict)
    links: list[LinkUse] = field(default_factory=list)  # links the simulated communications used
    _by_rank: tuple | None = field(default=None, repr=False, compare=False)
    _columns: SpanColumns | None = field(default=None, init=False, repr=False, compare=False)
    _task_columns: TaskColumns | None = field(default=None, init=False, repr=False, compare=False)
    _display_order: tuple | None = field(default=None, init=False, repr=False, compare=False)
    _forms: tuple | None = field(default=None, init=False, repr=False, compare=False)
    # the columns the engine read from the spans to sort them (SpanBase), for the readers after it
    base: SpanBase | None = field(default=None, repr=False, compare=False)

    @property
    def end_s(self) -> float:
        return max((s.end_s for s in self.spans), default=0.0)

    def own_spans(self, tasks) -> dict[int, Span]:
        """Task id -> the span the task left on its own rank and stream (a send's receive,
        recorded on the receiver under the same id, is left out). ``tasks``: the program's."""
        out: dict[int, Span] = {}
        n = len(tasks)
        for s in self.spans:
            if 0 <= s.tid < n:
                t = tasks[s.tid]
                if s.rank == t.rank and s.stream == t.stream:
                    out[s.tid] = s
        return out

    def by_rank(self) -> dict[int, list[Span]]:
        """Spans per simulated rank (remembered while the span list stays the same list of
        the same length; the analysis asks several times)."""
        key = (id(self.spans), len(self.spans))
        if self._by_rank is not None and self._by_rank[0] == key:
            return self._by_rank[1]
        out: dict[int, list[Span]] = {r: [] for r in self.ranks}
        for s in self.spans:
            out[s.rank].append(s)
        self._by_rank = (key, out)
        return out

    def forms(self) -> tuple[np.ndarray, list[SpanForm]]:
        """(each span's form as a code, the forms: :func:`form_codes`), from the engine's
        columns (:attr:`base`) while they describe the spans, else read and remembered as
        :meth:`by_rank` is."""
        b = self.current_base()
        if b is not None:
            return b.form, b.forms
        key = (id(self.spans), len(self.spans))
        if self._forms is None or self._forms[0] != key:
            self._forms = (key, form_codes(self.spans))
        return self._forms[1]

    def mbs(self) -> np.ndarray:
        """Each span's microbatch (int64), from the engine's columns (:attr:`base`) while they
        describe the spans, else read from the spans."""
        b = self.current_base()
        if b is not None:
            return b.mb
        return np.fromiter(map(attrgetter("mb"), self.spans), np.int64, len(self.spans))

    def columns(self) -> SpanColumns:
        """The spans as numpy columns (:class:`~clustersim.analysis.columns.SpanColumns`),
        remembered while the span list stays the same list of the same length, as
        :meth:`by_rank`; rank, stream, start, end and task id come from the engine's columns
        (:attr:`base`) while they describe the list. A snapshot: spans changed in place
        afterwards are not seen until :meth:`spans_edited` is called."""
        c = self._columns
        if c is None or c.spans is not self.spans or c.n != len(self.spans) or c.ranks != self.ranks:
            from .analysis.columns import SpanColumns

            c = self._columns = SpanColumns(self.spans, self.ranks)
            b = self.current_base()
            if b is not None:  # read once already
                c.__dict__.update(rank=b.rank, tid=b.tid, mb=b.mb, start_s=b.start_s, end_s=b.end_s,
                                  _stream=(b.stream, b.stream_names), _forms=(b.form, b.forms))
        return c

    def current_base(self) -> SpanBase | None:
        """The engine's columns (:attr:`base`) while they describe the span list, else None."""
        b = self.base
        return b if b is not None and b.describes(self.spans) else None

    def drop_columns(self, tasks: bool = False) -> None:
        """Forget the columnar view of the spans (and with ``tasks``, of the tasks) and the
        display order: their arrays are large, and they are rebuilt on demand (from the
        engine's columns, :attr:`base`, while they describe the spans)."""
        self._columns = None
        self._display_order = None
        if tasks:
            self._task_columns = None

    def spans_edited(self) -> None:
        """Say that spans were changed in place: every view read from them is forgotten, the
        engine's columns (:attr:`base`) included, so the next reader reads them afresh (the
        views are snapshots; identity and length cannot tell an edit)."""
        self.drop_columns(tasks=True)
        self.base = None
        self._forms = None

    def task_columns(self, tasks, runs=(), program=None) -> TaskColumns:
        """The program's ``tasks`` as numpy columns
        (:class:`~clustersim.analysis.columns.TaskColumns`; with its ``runs``, those runs' tasks
        are read off their templates; with the ``program`` whose ``items`` they are, the runs
        it has not made too), remembered for the same list of the same length: the critical
        path and the invariant checks both read them (the checks drop them when done)."""
        c = self._task_columns
        if c is None or c.tasks is not tasks or c.n != len(tasks):
            from .analysis.columns import TaskColumns

            c = self._task_columns = TaskColumns(tasks, runs, program)
        return c
