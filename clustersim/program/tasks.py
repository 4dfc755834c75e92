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

from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)  # immutable by convention: frozen instances cost 3x to create
class Comm:
    """A communication instance, simulated once for itself and its symmetric twins.

    ``group``: the GPUs of the simulated instance, in ring order (for ``send``: src, dst).
    ``twins``: the other instances it stands for (same shape, other GPUs); they load links
    exactly as the simulated one does, so they weigh on shared links (DESIGN: symmetric ranks).
    ``members``: simulated ranks that must all arrive before it starts (rendezvous).
    ``key``: rendezvous key, identical on every member's task.
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


@dataclass(eq=False)
class ActionTemplate:
    """The tasks of one pipeline action as the lowering makes them for every microbatch that
    runs the same blocks on the same rank: all but the task ids, the microbatch and the
    action's inputs are the same each time (a step lowers the same action hundreds of times).

    ``protos``: per task, in order, (communication spec or None, stream, name, kind,
    duration, dependency codes, phase, stage, layer, flops, model flops); a dependency code
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


@dataclass
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
    """

    ranks: list[int]
    weight: dict[int, int]
    tasks: list[Task] = field(default_factory=list)
    runs: list[tuple] = field(default_factory=list)

    def add(self, **kw) -> Task:
        t = Task(tid=len(self.tasks), **kw)
        self.tasks.append(t)
        return t

    def streams(self) -> dict[tuple[int, str], list[int]]:
        """(rank, stream) -> task ids in issue order (first appearance order of streams)."""
        out: dict[tuple[int, str], list[int]] = {}
        for t in self.tasks:
            out.setdefault((t.rank, t.stream), []).append(t.tid)
        return out
