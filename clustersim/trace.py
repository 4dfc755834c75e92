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
    first: dict = {}
    raw = np.fromiter(map(first.setdefault, values, count()), np.int64, n)
    names = sorted(first)
    renumber = np.zeros(n, dtype=np.int32)
    renumber[[first[v] for v in names]] = np.arange(len(names), dtype=np.int32)
    return renumber[raw], names


@dataclass(slots=True)
class Span:
    rank: int
    stream: str
    name: str
    kind: str  # "compute" | "tp" | "pp" | "dp"
    start_s: float
    end_s: float
    mb: int = -1
    phase: str = ""
    stage: int = -1
    layer: int = -1
    size_bytes: float = 0.0
    op: str = ""  # communication op ("all_reduce", "send", ...); "" for compute
    flops: float = 0.0
    model_flops: float = 0.0
    tid: int = -1  # the program task that produced it (a send and its receive share one)

    @property
    def dur_s(self) -> float:
        return self.end_s - self.start_s


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

    @classmethod
    def of(cls, spans: list) -> SpanBase:
        n = len(spans)
        stream, names = text_codes(map(attrgetter("stream"), spans), n)
        return cls(spans, np.fromiter(map(attrgetter("rank"), spans), np.int64, n), stream, names,
                   np.fromiter(map(attrgetter("start_s"), spans), np.float64, n),
                   np.fromiter(map(attrgetter("end_s"), spans), np.float64, n),
                   np.fromiter(map(attrgetter("tid"), spans), np.int64, n))

    def sorted(self) -> SpanBase:
        """The spans by rank, start, end and stream name (stable: ties keep their order), as
        ``sorted(spans, key=attrgetter("rank", "start_s", "end_s", "stream"))`` orders them,
        with their columns."""
        order = np.lexsort((self.stream, self.end_s, self.start_s, self.rank))
        spans = list(map(self.spans.__getitem__, order.tolist()))
        return SpanBase(spans, self.rank[order], self.stream[order], self.stream_names, self.start_s[order],
                        self.end_s[order], self.tid[order])

    def describes(self, spans: list) -> bool:
        return self.spans is spans and len(spans) == len(self.rank)


@dataclass(frozen=True)
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
                c.__dict__.update(rank=b.rank, tid=b.tid, start_s=b.start_s, end_s=b.end_s,
                                  _stream=(b.stream, b.stream_names))
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

    def task_columns(self, tasks) -> TaskColumns:
        """The program's ``tasks`` as numpy columns
        (:class:`~clustersim.analysis.columns.TaskColumns`), remembered for the same list of the
        same length: the critical path and the invariant checks both read them (the checks drop
        them when done)."""
        c = self._task_columns
        if c is None or c.tasks is not tasks or c.n != len(tasks):
            from .analysis.columns import TaskColumns

            c = self._task_columns = TaskColumns(tasks)
        return c
