"""The program: per simulated rank, tasks on streams with dependencies.

The same shape as an execution trace (MLCommons Chakra): a task is COMPUTE (a duration) or
COMM (a collective or point-to-point transfer, timed by the engine's network model).
A stream runs its tasks in list order; a task starts when its stream is free and all of
its dependencies (on any stream, any rank) are done::

    compute  [F attn L0]        [F mlp L0]        [F attn L1] ...
    tp                  [AR]              [AR]
    pp_fwd_send                                   ...[send act mb0 -> stage 1]
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)  # immutable by convention: frozen instances cost 3x to create
class Comm:
    """A communication instance, simulated once for itself and its symmetric twins.

    ``group``: the GPUs of the simulated instance, in ring order (for ``send``: src, dst).
    ``twins``: the other instances it stands for (same shape, other GPUs); they load links
    exactly as the simulated one does, so they weigh on shared links (DESIGN: symmetric ranks).
    ``members``: simulated ranks that must all arrive before it starts (rendezvous).
    ``key``: rendezvous key, identical on every member's task: (channel, orbit, tag), the
    channel named by the lowering's communication kind first ("tp", "dp", "pp F", "rep 0").
    ``recv_rank``: for ``send``, the simulated rank that waits for the data (or -1).
    ``load``: a skewed all-to-all (MoE ``ep_load``), ``(by_src, factors)``: the flow between
    group positions i -> j carries its balanced bytes times ``factors[j]``, or ``factors[i]``
    when ``by_src``; ``()`` when balanced.
    """

    op: str  # "all_reduce" | "send"
    size_bytes: float
    group: tuple[int, ...]
    twins: tuple[tuple[int, ...], ...]
    members: tuple[int, ...]
    key: tuple
    recv_rank: int = -1
    load: tuple = ()


@dataclass(slots=True)
class Task:
    tid: int
    rank: int
    stream: str
    name: str
    kind: str  # "compute" or the communication kind: "tp" | "pp" | "dp"
    duration_s: float = 0.0
    comm: Comm | None = None
    deps: tuple[int, ...] = ()
    mb: int = -1
    phase: str = ""  # "F" | "B" | "opt"
    stage: int = -1
    layer: int = -1
    flops: float = 0.0
    model_flops: float = 0.0
    # bytes a task without a communication moves (an offload copy's), for its span; a
    # communication's are its own (Comm.size_bytes)
    size_bytes: float = 0.0


@dataclass(eq=False)
class ActionTemplate:
    """The tasks of one pipeline action as the lowering makes them for every microbatch that
    runs the same blocks on the same rank: all but the task ids, the microbatch and the
    action's inputs are the same each time (a step lowers the same action hundreds of times).

    ``protos``: per task, in order, (communication spec or None, stream, name, kind,
    duration, dependency codes, phase, stage, layer, flops, model flops, bytes); a dependency code
    ``x < inputs`` is the action's input ``x``, else its own task ``x - inputs`` (relative). A
    spec is (op, size, group, twins, members, channel, orbit, rendezvous tag before and after
    the microbatch, receive rank, load). ``computes``: (block index, relative id) of each
    compute task; ``last_compute``: the relative id of the last one (-1: none).
    """

    protos: tuple
    computes: tuple[tuple[int, int], ...]
    last_compute: int
    inputs: int  # how many inputs its actions have
    # the function that appends an action's tasks, written out for this template once it is
    # used enough (lower._maker, a codegen.Straight made on first use)
    straight: object = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.protos)


@dataclass(eq=False)
class Program:
    """All tasks of one training step, for the simulated ranks only.

    ``weight[r]`` is how many real ranks simulated rank ``r`` stands for (1 when every rank
    is simulated); metrics averaged over GPUs weigh each simulated rank by it.

    ``runs``: (rank, first task id, end task id, template) of every action the lowering made
    from an :class:`ActionTemplate`, in task id order: tasks ``first .. end - 1`` are that
    template's, in order. The engine times such a run in one go where it can
    (``engine.sim._Segment``), and the analysis reads the runs' tasks off their templates
    (``analysis.columns.TaskColumns``): a program edited by hand keeps its runs' tasks as the
    templates made them, or empties ``runs``.

    A run's tasks need not exist as objects: the lowering leaves most runs' tasks to be made
    from their template when first asked for (``deferred``: run index -> (microbatch, inputs)),
    since the engine and the analysis read a run off its template and its task ids; ``items``
    holds each task by id, None for one not made yet. :attr:`tasks` makes them all;
    :meth:`task` makes one run's::

        items     [send][None None None ... ][send][None ...]    deferred {1: (mb, inputs), ...}
        tasks     [send][F attn L0 | AR ... ][send][F attn ...]  made from templates on first ask
    """

    ranks: list[int]
    weight: dict[int, int]
    # the simulated rank that stands for each GPU (rank g runs on GPU g; lower.Symmetry.rep);
    # None where not known (a program built by hand)
    rep: tuple[int, ...] | None = field(default=None, repr=False)
    runs: list[tuple] = field(default_factory=list)
    items: list = field(default_factory=list, repr=False)
    deferred: dict[int, tuple] = field(default_factory=dict, repr=False)
    # makes a run's tasks: maker(add, template, rank, mb, inputs, first id) (the lowering's)
    maker: object = field(default=None, repr=False)
    # (group, twins) -> the communication's sibling orbits where the symmetry classes split a
    # stage (lower.Symmetry.siblings): the engine's orbit check counts their flows too
    siblings: dict = field(default_factory=dict, repr=False)
    # how the MoE dispatch all-to-alls send: () one copy per (token, expert), NCCL's algorithm;
    # else deduplicated per node and GPU (collectives.algorithms.deepep_flows), this routing
    # (model.moe.routing: experts, top_k, router groups, groups a token picks)
    routing: tuple = ()
    # a channel's communication kind (the first word of Comm.key[0]) -> the mesh group its
    # communications run over, as plan.mesh names it ("tp", "cp+dp", "edp", ...; "pp" for the
    # pipeline's): the trace file's ``group`` (lower.group_dims); empty for a program built by
    # hand, whose spans then name the group by their kind
    group_dims: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def split_stage(self) -> bool:
        """Whether the symmetry classes split a stage (:attr:`siblings`). Then no GPU's links
        are copies of its class's simulated rank's: a split class's GPU need not load its links
        as its simulated rank does (a straggler's mates forward other GPUs' PXN flows), so the
        link use counts every real flow on every link, inside nodes too, and the meetings of
        twins are looked for on every link (engine.sim: ``Engine._meetings``,
        ``_twins_links``, ``_summary_sources``; ``api.summarize``)."""
        return bool(self.siblings)

    @property
    def tasks(self) -> list[Task]:
        """Every task, by id: the runs' left to be made are made now (once)."""
        if self.deferred:
            for k in list(self.deferred):
                self._make_run(k)
        return self.items

    def task(self, tid: int) -> Task:
        """Task ``tid``, its run made now if it was left to be made."""
        t = self.items[tid]
        if t is None:
            self._make_run(self.run_of(tid))
            t = self.items[tid]
        return t

    def run_of(self, tid: int) -> int:
        """The index in ``runs`` of the run that holds task ``tid`` (it must be in one)."""
        firsts = self._firsts()
        k = bisect_right(firsts, tid) - 1
        if k < 0 or not self.runs[k][1] <= tid < self.runs[k][2]:
            raise IndexError(f"task {tid} is in no run")
        return k

    def _firsts(self) -> list[int]:
        cached = self.__dict__.get("_firsts_of")
        if cached is None or len(cached) != len(self.runs):
            cached = self.__dict__["_firsts_of"] = [r[1] for r in self.runs]
        return cached

    def defer_run(self, rank: int, tmpl: ActionTemplate, mb: int, inputs: tuple) -> int:
        """Add a run of ``tmpl`` for microbatch ``mb`` with ``inputs`` whose tasks are made
        when first asked for; the id of its last task."""
        items, runs = self.items, self.runs
        first = len(items)
        items += [None] * len(tmpl.protos)
        runs.append((rank, first, len(items), tmpl))
        self.deferred[len(runs) - 1] = (mb, tuple(inputs))
        return len(items) - 1

    def _make_run(self, k: int) -> None:
        """Make run ``k``'s tasks from its template, in place."""
        mb, inputs = self.deferred.pop(k)
        rank, first, end, tmpl = self.runs[k]
        made: list[Task] = []
        self.maker(made.append, tmpl, rank, mb, inputs, first)
        self.items[first:end] = made

    def add(self, **kw) -> Task:
        t = Task(tid=len(self.items), **kw)
        self.items.append(t)
        return t

    def streams(self) -> dict[tuple[int, str], list[int]]:
        """(rank, stream) -> task ids in issue order (first appearance order of streams)."""
        out: dict[tuple[int, str], list[int]] = {}
        for t in self.tasks:
            out.setdefault((t.rank, t.stream), []).append(t.tid)
        return out
