"""Trace: what happened, as spans (rank, stream, name, kind, start, end, ...).

Everything downstream — metrics, report, Perfetto — is derived from these spans.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from itertools import chain, compress, count, repeat
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .analysis.columns import SpanColumns, TaskColumns


# times closer than this are one instant: the same instant summed along two paths (a step
# simulated whole and one whose cycle was copied in, clustersim.engine.repeat) differs in its
# last bits; the analysis reads such times as equal wherever it orders or picks among them
INSTANT_S = 1e-9
# the streams a PP send's receive is recorded on, the receiver's (the send's stream with
# "_recv" for "_send", engine.sim): the sender's transfers as they arrive, so that two from
# different senders (DualPipe's neighbours) may overlap there, where every other stream runs
# one task at a time
RECV_STREAMS = ("pp_fwd_recv", "pp_bwd_recv")
# the kinds of span that are not compute, in the summary's order: the communications, then
# optimizer offload's copies and host steps (the GPU waits for them as it waits for a transfer)
COMM_KINDS = ("tp", "cp", "ep", "pp", "dp", "offload")


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


def stable_argsort(values: np.ndarray) -> np.ndarray:
    """``np.argsort(values, kind="stable")`` of non-negative integers below 2**32, by 16-bit
    keys, which numpy sorts by radix: one pass below 2**16, else the low 16 bits and then the
    high 16 bits (each pass stable, so equal values keep their order: the same result), 3-4x
    faster than its sort of 64-bit keys on a million link ids. Other values (and floats):
    numpy's own."""
    if len(values) and values.dtype.kind in "iu":
        lo, hi = int(values.min()), int(values.max())
        if lo >= 0 and hi <= 0xFFFF:
            return np.argsort(values.astype(np.uint16), kind="stable")
        if lo >= 0 and hi <= 0xFFFFFFFF:
            first = np.argsort((values & 0xFFFF).astype(np.uint16), kind="stable")
            return first[np.argsort((values[first] >> 16).astype(np.uint16), kind="stable")]
    return np.argsort(values, kind="stable")


def gpu_ranges(gpus: Sequence[int], max_chars: int = 0) -> str:
    """GPU numbers as short text: runs of three or more at one stride as ``a-b`` (stride 1)
    or ``a-b step s``, the rest one by one. Longer than ``max_chars`` (0: no limit), it keeps
    the first items that fit with ``, ... (N GPUs)`` after them (the first one at least)::

        [0, 1, 2, 3, 8, 9, 10, 11]      0-3, 8-11
        [64, 0, 16, 32, 48]             0-64 step 16
        [3, 7]                          3, 7

    Runs are taken greedily from the lowest GPU up, which is shortest for the sets a plan's
    classes make (blocks of a mesh dimension, a stage's ranks less a few).
    """
    g = sorted(set(gpus))
    items: list[str] = []
    i, n = 0, len(g)
    while i < n:
        j = i + 1
        if i + 2 < n:
            step = g[i + 1] - g[i]
            while j + 1 < n and g[j + 1] - g[j] == step:
                j += 1
            if j - i + 1 >= 3:
                items.append(f"{g[i]}-{g[j]}" if step == 1 else f"{g[i]}-{g[j]} step {step}")
                i = j + 1
                continue
        items.append(str(g[i]))
        i += 1
    text = ", ".join(items)
    if max_chars and len(text) > max_chars:
        tail = f", ... ({n:,} GPUs)"
        cut = text.rfind(", ", 0, max(max_chars - len(tail), 0) + 1)
        text = (text[:cut] if cut > 0 else items[0]) + tail
    return text


def _whole_gpus(gpus: Iterable) -> list[int]:
    """GPU numbers ascending, once each; a TypeError for one that is not a whole number (a
    bool, a float, a string)."""
    gpus = list(gpus)
    odd = [g for g in gpus if isinstance(g, bool) or not isinstance(g, (int, np.integer))]
    if odd:
        raise TypeError(f"a GPU is a whole number, not {odd[0]!r}")
    return sorted({int(g) for g in gpus})


def first_and_inverse(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_index=True, return_inverse=True)[1:]`` for a 1-D array: each
    distinct value's first place and each value's rank among the distinct values, by one
    stable sort (:func:`stable_argsort`: by radix where the values fit 32 bits; without
    numpy.ma, as :func:`unique`)."""
    order = stable_argsort(values)
    ordered = values[order]
    new = np.empty(len(ordered), dtype=bool)
    new[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=new[1:])
    inverse = np.empty(len(ordered), dtype=np.int64)
    inverse[order] = np.cumsum(new) - 1
    return order[new], inverse


def unique_inverse(values: np.ndarray) -> np.ndarray:
    """``np.unique(values, return_inverse=True)[1]`` for a 1-D array (:func:`first_and_inverse`)."""
    return first_and_inverse(values)[1]


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
    order = stable_argsort(group)  # (by radix where the groups fit 32 bits: rows often come unsorted)
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
    values: the engine makes one per distinct set of values, a span made by hand its own.

    ``comm_args``: what the trace file says of a communication besides its op, as (name,
    value) pairs in the order written: a collective's group and algorithm, a send's or a
    receive's peer (:meth:`clustersim.engine.sim.Engine.comm_args`); ``()`` for the rest.
    The engine tells forms apart by it too (one per group and peer), but it is not among
    :meth:`values`, which spans are compared by: under the symmetric collapse a peer is the
    simulated rank that stands for the real one."""

    __slots__ = FORM_FIELDS + ("comm_args",)

    def __init__(self, stream: str, name: str, kind: str, phase: str = "", stage: int = -1, layer: int = -1,
                 size_bytes: float = 0.0, op: str = "", flops: float = 0.0, model_flops: float = 0.0,
                 comm_args: tuple = ()):
        for k, v in zip(FORM_FIELDS, (stream, name, kind, phase, stage, layer, size_bytes, op, flops, model_flops)):
            object.__setattr__(self, k, v)
        object.__setattr__(self, "comm_args", comm_args)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"a SpanForm is shared by many spans; set {name} on the Span, which then takes "
                             "a form of its own")

    def values(self) -> tuple:
        """The fields, in FORM_FIELDS order."""
        return _FORM_VALUES(self)

    def __repr__(self) -> str:
        more = f", comm_args={self.comm_args!r}" if self.comm_args else ""
        return "SpanForm(" + ", ".join(f"{k}={v!r}" for k, v in zip(FORM_FIELDS, self.values())) + more + ")"

    def __reduce__(self):
        return SpanForm, (*self.values(), self.comm_args)


def _form_field(k: int, name: str) -> property:
    """A span's field kept in its form: read there; set, the span takes a new form (with the
    same ``comm_args``; ``k`` -1 sets those)."""

    def set_field(span: Span, value) -> None:
        values = list(span.form.values())
        args = span.form.comm_args
        if k < 0:
            args = value
        else:
            values[k] = value
        span.form = SpanForm(*values, comm_args=args)

    return property(attrgetter("form." + name), set_field, doc=f"``form.{name}``")


class Span:
    """What one task did on one rank and stream, from ``start_s`` to ``end_s``. The fields
    every span of the same kind of task shares (stream, name, kind, phase, stage, layer,
    size_bytes, op, flops, model_flops, and a communication's ``comm_args`` for the trace
    file) live in its :class:`SpanForm` and read as its own; the rest are the span's: rank,
    start_s, end_s, mb (-1: none) and tid (the program task that produced it; a send and its
    receive share one)::

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
    comm_args = _form_field(-1, "comm_args")  # (not among values(): SpanForm)

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
    list ``spans``, as the columnar views are: spans changed in place later are not seen.

    Made from the engine's records (:meth:`of_log`) it holds no span objects at first
    (``spans`` None): the columns are the spans, and :meth:`make_spans` makes the objects
    when a reader asks for them (a 1T-parameter step has 918,852; making and reading them
    back cost about a second, and the summary, the report and the trace file read columns)."""

    spans: list | None  # the list described (identity and length tell whether it still is); None: not made
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
        form, forms = form_codes(spans)
        stream, names = form_text(forms, form, "stream")
        rank, start, end, tid, mb = _own_columns(spans)
        return cls(spans, rank, stream, names, start, end, tid, mb, form, forms)

    @classmethod
    def of_log(cls, log: list) -> SpanBase:
        """The columns of the spans ``log`` records, in its order, without making them. An
        entry is a :class:`Span`, or a run of spans as one record::

            (first, rank, mb, forms, starts, ends)   spans i = 0, 1, ...: task first + i
                                                     on rank, microbatch mb, form forms[i],
                                                     from starts[i] to ends[i]

        (the engine times a run of a template in one go: clustersim.engine.sim._Segment).
        The forms are numbered in order of first appearance, as :func:`form_codes` numbers
        them over the spans written out. Times are kept as Python floats: a record holding
        any other number (an ``int`` 0) is written out as spans, which keep it."""
        is_run = np.fromiter(map(tuple.__instancecheck__, log), bool, len(log))
        if not is_run.any():
            return cls.of(log)
        runs = list(compress(log, is_run.tolist()))
        objs = list(compress(log, (~is_run).tolist()))
        m = len(objs)
        # each entry's key, its forms: a run's tuple of them, a span's own (one)
        key_id = np.empty(len(log), dtype=np.int64)
        key_id[is_run] = np.fromiter(map(id, map(itemgetter(3), runs)), np.int64, len(runs))
        key_id[~is_run] = np.fromiter(map(id, map(attrgetter("form"), objs)), np.int64, m)
        firsts: dict[int, int] = {}  # id(key) -> the first entry that has it
        first_of = np.fromiter(map(firsts.setdefault, key_id.tolist(), count()), np.int64, len(log))
        # the forms numbered as they first appear, key by key in order of first appearance
        # (a key's forms appear first where it does, or earlier)
        code_of: dict[int, int] = {}  # id(form) -> code
        forms: list[SpanForm] = []
        flat: list[int] = []  # each key's forms' codes, key after key
        key_at = np.empty(len(firsts), dtype=np.int64)  # where each key's codes begin in flat
        key_len = np.empty(len(firsts), dtype=np.int64)
        for k, i in enumerate(firsts.values()):
            fs = log[i][3] if is_run[i] else log[i].form
            key_at[k], key_len[k] = len(flat), len(fs) if type(fs) is tuple else 1
            for f in fs if type(fs) is tuple else (fs,):
                c = code_of.get(id(f))
                if c is None:
                    c = code_of[id(f)] = len(forms)
                    forms.append(f)
                flat.append(c)
        ordinal = np.empty(len(log), dtype=np.int64)
        ordinal[list(firsts.values())] = np.arange(len(firsts))
        key = ordinal[first_of]  # each entry's key, numbered
        counts = key_len[key]
        at = np.cumsum(counts) - counts  # where each entry's first span goes
        n = int(counts.sum())
        within_all = np.arange(n, dtype=np.int64) - np.repeat(at, counts)
        form = np.array(flat, dtype=np.int32)[np.repeat(key_at[key], counts) + within_all]
        run_n = counts[is_run]
        obj_at = at[~is_run]
        rank = np.empty(n, dtype=np.int64)
        tid = np.empty(n, dtype=np.int64)
        mb = np.empty(n, dtype=np.int64)
        start = np.empty(n, dtype=np.float64)
        end = np.empty(n, dtype=np.float64)
        rank[obj_at], start[obj_at], end[obj_at], tid[obj_at], mb[obj_at] = _own_columns(objs)
        pos = np.flatnonzero(np.repeat(is_run, counts))  # the runs' rows
        within = within_all[pos]
        tid[pos] = np.repeat(np.fromiter(map(itemgetter(0), runs), np.int64, len(runs)), run_n) + within
        rank[pos] = np.repeat(np.fromiter(map(itemgetter(1), runs), np.int64, len(runs)), run_n)
        mb[pos] = np.repeat(np.fromiter(map(itemgetter(2), runs), np.int64, len(runs)), run_n)
        start[pos] = np.fromiter(chain.from_iterable(map(itemgetter(4), runs)), np.float64, n - m)
        end[pos] = np.fromiter(chain.from_iterable(map(itemgetter(5), runs)), np.float64, n - m)
        # a time held as another number than a float (an int 0: simpy's clock before it
        # moves) would read back as a float: such a log is written out as spans, which keep it
        zero = np.flatnonzero((start == 0.0) | (end == 0.0)).tolist()
        for i in zero:
            k = int(np.searchsorted(at, i, side="right")) - 1  # the entry that row i is of
            entry = log[k]
            if type(entry) is tuple:
                held = (entry[4][i - int(at[k])], entry[5][i - int(at[k])])
            else:
                held = (entry.start_s, entry.end_s)
            if type(held[0]) is not float or type(held[1]) is not float:
                return cls.of(list(chain.from_iterable(map(_written_out, log))))
        stream, names = form_text(forms, form, "stream")
        return cls(None, rank, stream, names, start, end, tid, mb, form, forms)

    def span(self, i: int) -> Span:
        """Row ``i`` as a span: the list's own once made, else a new one made from the row."""
        if self.spans is not None:
            return self.spans[i]
        return Span.of_form(int(self.rank[i]), self.forms[self.form[i]], float(self.start_s[i]),
                            float(self.end_s[i]), int(self.mb[i]), int(self.tid[i]))

    def make_spans(self) -> list:
        """The spans, made once from the rows (:attr:`spans` from then on)."""
        if self.spans is None:
            forms = self.forms
            spans = list(map(Span.of_form, self.rank.tolist(), map(forms.__getitem__, self.form.tolist()),
                             self.start_s.tolist(), self.end_s.tolist(), self.mb.tolist(), self.tid.tolist()))
            object.__setattr__(self, "spans", spans)
        return self.spans

    def sorted(self) -> SpanBase:
        """The spans by rank, start, end and stream name (stable: ties keep their order), as
        ``sorted(spans, key=attrgetter("rank", "start_s", "end_s", "stream"))`` orders them,
        with their columns."""
        order, _ = grouped_order(self.rank, self.stream, self.end_s, self.start_s)  # rank by rank: in cache
        spans = None if self.spans is None else list(map(self.spans.__getitem__, order.tolist()))
        return SpanBase(spans, self.rank[order], self.stream[order], self.stream_names, self.start_s[order],
                        self.end_s[order], self.tid[order], self.mb[order], self.form[order], self.forms)

    def describes(self, spans: list) -> bool:
        return self.spans is spans and len(spans) == len(self.rank)


def _own_columns(spans: list) -> tuple[np.ndarray, ...]:
    """(rank, start_s, end_s, tid, mb) of ``spans``, the fields each span holds itself, as
    columns (int64, float64, float64, int64, int64)."""
    n = len(spans)
    return (np.fromiter(map(attrgetter("rank"), spans), np.int64, n),
            np.fromiter(map(attrgetter("start_s"), spans), np.float64, n),
            np.fromiter(map(attrgetter("end_s"), spans), np.float64, n),
            np.fromiter(map(attrgetter("tid"), spans), np.int64, n),
            np.fromiter(map(attrgetter("mb"), spans), np.int64, n))


def _written_out(entry) -> list[Span]:
    """The spans of one entry of the engine's records (:meth:`SpanBase.of_log`)."""
    if type(entry) is not tuple:
        return [entry]
    first, rank, mb, forms, starts, ends = entry
    return list(map(Span.of_form, repeat(rank), forms, starts, ends, repeat(mb), count(first)))


def span_times(spans: Sequence[Span], rows: list[int]) -> tuple[list, list]:
    """(starts, ends) of the spans ``rows`` of ``spans``, as the spans hold them: off the
    columns of a :class:`SpanRows` view (whose spans are made from them), else off the spans."""
    if isinstance(spans, SpanRows):
        at = np.asarray(rows, dtype=np.int64)
        if spans.rows is not None:
            at = spans.rows[at]
        return spans.base.start_s[at].tolist(), spans.base.end_s[at].tolist()
    return [spans[i].start_s for i in rows], [spans[i].end_s for i in rows]


class SpanRows(Sequence):
    """Rows of a :class:`SpanBase` read as spans, each made when asked for and not kept
    (``rows``: those rows, in that order; None: all): what the analysis's columnar views hold
    for the odd span they name (an example in a message, a sample's time), while the spans
    are not made. Read-only: edit ``Trace.spans``, which makes them."""

    def __init__(self, base: SpanBase, rows: np.ndarray | None = None):
        self.base, self.rows = base, rows

    def __len__(self) -> int:
        return len(self.base.rank) if self.rows is None else len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.base.span(int(i) if self.rows is None else int(self.rows[i]))

    def take(self, rows: np.ndarray) -> SpanRows:
        """These rows of the view (a view of the same base)."""
        return SpanRows(self.base, rows if self.rows is None else self.rows[rows])


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


def link_columns(links: list[LinkUse]) -> tuple[list, ...]:
    """``links`` as one list per field (:func:`links_of_columns` gives them back), to send
    to another process: lists of strings and floats pickle in C, where 69,000 LinkUse objects
    (the 16K-GPU step) take 0.19 s to pickle and 0.14 s to read back, one object at a time."""
    return tuple(map(list, zip(*map(_LINK_FIELDS, links)))) if links else ((),) * len(fields(LinkUse))


def links_of_columns(columns: tuple[list, ...]) -> list[LinkUse]:
    """The links :func:`link_columns` was given."""
    return list(map(LinkUse, *columns))


_LINK_FIELDS = attrgetter(*(f.name for f in fields(LinkUse)))  # a LinkUse's fields, in order


@dataclass
class Trace:
    """Spans of the simulated ranks; ``weight[r]`` real ranks behave like simulated rank r.

    The engine hands over its spans as columns (:attr:`base`, with ``spans=None``): the span
    objects are made the first time ``spans`` is read. Readers that go over every span read
    the columns (:meth:`columns`, :meth:`forms`, :meth:`mbs`), or :meth:`span_rows` for a few
    of them, and leave the objects unmade; :attr:`n_spans` counts them either way."""

    spans: list[Span] | None
    ranks: list[int]
    weight: dict[int, int]
    stage_of: dict[int, int] = field(default_factory=dict)
    # collective -> algorithm -> communications of the simulated ranks that used it
    algorithms: dict[str, dict[str, int]] = field(default_factory=dict)
    asymmetric_orbits: dict[str, int] = field(default_factory=dict)  # (engine.sim._asymmetric_orbits)
    links: list[LinkUse] = field(default_factory=list)  # links the simulated communications used
    # how the step's repeating microbatches were simulated once (clustersim.engine.repeat);
    # None: every microbatch was simulated
    repeat: dict | None = None
    # microbatches of the shorter step simulated to find that cycle (None: none was tried); with
    # ``repeat`` None, none held and every microbatch was simulated after it
    repeat_tried: int | None = None
    # the simulated rank that stands for each GPU, by GPU (Program.rep); None where not known
    rep: tuple[int, ...] | None = field(default=None, repr=False)
    # a trace of some GPUs (for_gpus): GPU -> the simulated rank whose spans it holds
    spans_of: dict[int, int] | None = field(default=None, repr=False)
    _by_rank: tuple | None = field(default=None, repr=False, compare=False)
    _columns: SpanColumns | None = field(default=None, init=False, repr=False, compare=False)
    _task_columns: TaskColumns | None = field(default=None, init=False, repr=False, compare=False)
    _display_order: tuple | None = field(default=None, init=False, repr=False, compare=False)
    # the trace file's flows from PP sends to their receives, with the display order they are in
    # (output.perfetto.flow_pairs: worked out before the writer's fork, read on both sides)
    _flows: tuple | None = field(default=None, init=False, repr=False, compare=False)
    _forms: tuple | None = field(default=None, init=False, repr=False, compare=False)
    # the columns the engine read from the spans to sort them (SpanBase), for the readers after it
    base: SpanBase | None = field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:
        """One line: its size and what it stands for, not its spans (millions of them)."""
        n, gpus = len(self.ranks), sum(self.weight.values()) if self.weight else len(self.ranks)
        return (f"Trace({self.n_spans:,} spans of {n:,} simulated rank{'s' if n != 1 else ''} for {gpus:,} GPUs, "
                f"ending at {self.end_s:.4g} s)")

    @property
    def end_s(self) -> float:
        b = self.current_base()
        if b is not None:
            return float(b.end_s.max()) if len(b.end_s) else 0.0
        return max((s.end_s for s in self.spans), default=0.0)

    @property
    def n_spans(self) -> int:
        """How many spans there are (without making them)."""
        return len(self._spans) if self._spans is not None else len(self._base.rank) if self._base is not None else 0

    def span_rows(self) -> Sequence[Span]:
        """The spans as a sequence, without making them all: the list once made, else a
        read-only view of the engine's columns (:class:`SpanRows`) whose items are made when
        read. The same object while the spans stay the same (caches key on it)."""
        if self._spans is not None or self._base is None:
            return self.spans
        rows = self._rows
        if rows is None or rows.base is not self._base:
            rows = self._rows = SpanRows(self._base)
        return rows

    def gpus_of(self) -> dict[int, list[int]] | None:
        """The GPUs each simulated rank stands for, ascending (itself among them), from
        :attr:`rep`; None where that is not known::

            rep     GPU 0 1 2 3 4 5 6 7          gpus_of   {0: [0, 1, 2, 3], 4: [4, 5, 6, 7]}
                        0 0 0 0 4 4 4 4
        """
        if self.rep is None:
            return None
        out: dict[int, list[int]] = {r: [] for r in self.ranks}
        for g, r in enumerate(self.rep):
            out.setdefault(r, []).append(g)  # (a rank not simulated: the rank-map check names it)
        return out

    def spans_for_gpus(self, gpus: Iterable[int]) -> int:
        """How many spans :meth:`for_gpus` would hold for ``gpus``, without making them."""
        rep = self._rep_of(gpus := _whole_gpus(gpus))
        b = self.current_base()
        ranks = b.rank if b is not None else np.fromiter((s.rank for s in self.spans), np.int64, self.n_spans)
        per = dict(zip(*np.unique(ranks, return_counts=True))) if len(ranks) else {}
        return int(sum(per.get(rep[g], 0) for g in gpus))

    def _rep_of(self, gpus: list[int]):
        """:attr:`rep`, or where it is not known, each simulated rank standing for itself alone;
        a ValueError for a GPU that then has no rank."""
        if self.rep is not None:
            bad = [g for g in gpus if not 0 <= g < len(self.rep)]
            if bad:
                raise ValueError(f"GPU {bad[0]} is not one of the {len(self.rep):,} GPUs")
            return self.rep
        ranks = set(self.ranks)
        bad = [g for g in gpus if g not in ranks]
        if bad:
            raise ValueError(f"GPU {bad[0]} is not a simulated rank, and which rank stands for it is not known "
                             "(this trace has no rep)")
        return {r: r for r in self.ranks}

    def for_gpus(self, gpus: Iterable[int]) -> Trace:
        """The trace of ``gpus``, one rank each, holding the spans of the simulated rank that
        stands for it (:attr:`rep`): what the run of every rank records for them where the
        collapse is exact. Its ranks are the GPUs, ascending, each standing for itself::

            rep      0 0 0 0 4 4 4 4          for_gpus([1, 5, 6])   rank 1: rank 0's spans
            ranks    0       4                                      rank 5: rank 4's spans
                                                                    rank 6: rank 4's spans
        """
        gpus = _whole_gpus(gpus)
        rep = self._rep_of(gpus)
        b = self.current_base() or SpanBase.of(self.spans)
        order = stable_argsort(b.rank)
        ranks_sorted = b.rank[order]
        reps = np.array([rep[g] for g in gpus], dtype=np.int64)
        lo, hi = np.searchsorted(ranks_sorted, reps, "left"), np.searchsorted(ranks_sorted, reps, "right")
        counts = hi - lo
        rows = order[index_ranges(np.stack([lo, hi], axis=1).ravel(), np.arange(0, 2 * len(gpus), 2))] \
            if len(gpus) else order[:0]
        base = SpanBase(None, np.repeat(np.array(gpus, dtype=np.int64), counts), b.stream[rows], b.stream_names,
                        b.start_s[rows], b.end_s[rows], b.tid[rows], b.mb[rows], b.form[rows], b.forms)
        return Trace(spans=None, ranks=gpus, weight=dict.fromkeys(gpus, 1),
                     stage_of={g: self.stage_of.get(rep[g], 0) for g in gpus}, algorithms=self.algorithms,
                     asymmetric_orbits=self.asymmetric_orbits,
                     repeat=self.repeat, repeat_tried=self.repeat_tried, rep=None,
                     spans_of={g: rep[g] for g in gpus}, base=base)

    def by_rank(self) -> dict[int, list[Span]]:
        """Spans per simulated rank (remembered while the span list stays the same list of
        the same length; the analysis asks several times)."""
        key = (id(self.spans), len(self.spans))  # (reads every span object: makes them if need be)
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
        spans = self.span_rows()
        if c is None or c.spans is not spans or c.n != len(spans) or c.ranks != self.ranks:
            from .analysis.columns import SpanColumns

            c = self._columns = SpanColumns(spans, self.ranks)
            b = self.current_base()
            if b is not None:  # read once already
                c.__dict__.update(rank=b.rank, tid=b.tid, mb=b.mb, start_s=b.start_s, end_s=b.end_s,
                                  _stream=(b.stream, b.stream_names), _forms=(b.form, b.forms))
        return c

    def current_base(self) -> SpanBase | None:
        """The engine's columns (:attr:`base`) while they describe the span list, else None."""
        b = self._base
        return b if b is not None and (self._spans is None or b.describes(self._spans)) else None

    def drop_columns(self, tasks: bool = False) -> None:
        """Forget the columnar view of the spans (and with ``tasks``, of the tasks): their
        arrays are large, and they are rebuilt on demand (from the engine's columns,
        :attr:`base`, while they describe the spans). The display order stays: the trace
        file's pieces are written in it after the summary (a 1T-parameter step sorts its
        spans in 0.2 s), and it is made before the summary's columns, which set the peak."""
        self._columns = None
        if tasks:
            self._task_columns = None

    def spans_edited(self) -> None:
        """Say that spans were changed in place: every view read from them is forgotten, the
        engine's columns (:attr:`base`) included, so the next reader reads them afresh (the
        views are snapshots; identity and length cannot tell an edit)."""
        self.drop_columns(tasks=True)
        self._display_order = None
        self._flows = None
        self.base = None
        self._forms = None

    def keep_task_columns(self, cols: TaskColumns) -> None:
        """Remember ``cols``, the program's task columns made before this trace was (the
        splice of a repeated step reads them first), for :meth:`task_columns`."""
        self._task_columns = cols

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


def _get_spans(self: Trace) -> list[Span]:
    if self._spans is None:
        self._spans = self._base.make_spans() if self._base is not None else []
    return self._spans


def _set_spans(self: Trace, spans: list[Span] | None) -> None:
    self._spans = spans


def _get_base(self: Trace) -> SpanBase | None:
    return self._base


def _set_base(self: Trace, base: SpanBase | None) -> None:
    if base is None and getattr(self, "_spans", ...) is None and getattr(self, "_base", None) is not None:
        self._spans = self._base.make_spans()  # the columns were the spans: make them before they go
    self._base = base


# ``Trace(spans=None, base=...)`` holds the columns only; reading ``spans`` makes the objects
# once (:meth:`SpanBase.make_spans`); dropping ``base`` first makes them too
Trace.spans = property(_get_spans, _set_spans, doc="The spans (made from :attr:`base` when first read).")
Trace.base = property(_get_base, _set_base, doc="The columns the engine read or made the spans from (SpanBase).")
Trace._rows = None  # the SpanRows view span_rows hands out, while the spans are not made
