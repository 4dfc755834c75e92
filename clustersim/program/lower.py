"""Lowering: scenario -> Program, as a chain of small passes.

    symmetry      which ranks are simulated, and which twins each one stands for
    pipeline_pass F/B blocks in schedule order, TP all-reduces, PP sends (per microbatch)
    dp_grad_pass  gradient buckets all-reduced over DP as the last backward produces them,
                  then the tied-embedding all-reduce between first and last stage
    optimizer_pass the optimizer step, after every gradient of the rank is reduced

Each pass takes the Program and returns it with tasks appended; none reads the clock.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property

from ..config import Scenario
from ..plan.mesh import Mesh
from ..schedule.pipeline import Schedule, build_schedule, unit_time_grid
from .tasks import Comm, Program
from .work import GRAD_BYTES, PARAM_BYTES, StageWork, stage_work


@dataclass
class Symmetry:
    """Which ranks run in the simulation and whom each stands for.

    Collapsed (default): ranks differing only in their DP or TP index run identical
    programs on identical hardware, so one rank per pipeline stage is simulated; a
    communication instance stands for its twins (same shape on other GPUs), which still load
    shared links. Not collapsed: every rank is simulated, there are no twins. Both give the
    same numbers on a symmetric placement; where twins meet different links (a stage that
    spans two leaf groups) an orbit moves at its slowest member's pace, a close upper bound
    (engine/network.py ``plan_flows``; tests/test_engine.py).
    """

    mesh: Mesh
    collapse: bool
    rep: dict[int, int] = field(init=False)
    _orbits: dict = field(init=False, default_factory=dict)
    _shapes: dict = field(init=False, default_factory=dict)

    def __post_init__(self):
        m = self.mesh
        if self.collapse:
            self.rep = {r: m.rank(tp=0, dp=0, pp=m.coords(r)["pp"]) for r in range(m.world_size)}
        else:
            self.rep = {r: r for r in range(m.world_size)}

    @cached_property
    def ranks(self) -> list[int]:
        return sorted(set(self.rep.values()))

    @property
    def weight(self) -> dict[int, int]:
        return dict(sorted(Counter(self.rep.values()).items()))

    def orbit_key(self, group: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.rep[r] for r in group)

    def twins(self, kind: str, group: tuple[int, ...], all_groups) -> tuple[tuple[int, ...], ...]:
        """Other groups of ``kind`` whose members map to the same simulated ranks."""
        if kind not in self._orbits:
            orbits: dict[tuple, list] = {}
            for g in all_groups():
                orbits.setdefault(self.orbit_key(g), []).append(g)
            self._orbits[kind] = orbits
        return tuple(g for g in self._orbits[kind][self.orbit_key(group)] if g != group)

    def members(self, group: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sorted(set(self.orbit_key(group))))

    def shape(self, kind: str, group: tuple[int, ...], all_groups) -> tuple[tuple, tuple, tuple]:
        """(orbit key, twins, members) of ``group``, computed once per group."""
        key = (kind, group)
        if key not in self._shapes:
            self._shapes[key] = (self.orbit_key(group), self.twins(kind, group, all_groups), self.members(group))
        return self._shapes[key]


@dataclass
class Lowering:
    """What every pass reads: the plan, the schedule, per-stage work, the symmetry."""

    mesh: Mesh
    schedule: Schedule
    work: list[StageWork]
    sym: Symmetry
    grad_bytes: int = 4
    dp_bucket_params: float = 40e6
    tied_embeddings: bool = False
    embedding_params: float = 0.0  # per TP rank, for the tied-embedding all-reduce
    # filled by pipeline_pass, read by later passes
    zero: int = 0
    zero_prefetch_layers: int = 1
    zero3_keep_gathered: bool = False
    # filled by __post_init__
    first_mb: dict = field(default_factory=dict)  # stage -> first microbatch it runs forward
    final_mb: dict = field(default_factory=dict)  # stage -> microbatch of its last backward
    unit_params: dict = field(default_factory=dict)  # (stage, unit) -> local params ZeRO-3 gathers
    # filled by the passes, read by later passes
    bwd_tid: dict = field(default_factory=dict)  # (rank, mb, block index) -> backward compute tid
    last_compute: dict = field(default_factory=dict)  # rank -> its latest compute task
    last_task: dict = field(default_factory=dict)  # rank -> tid of its last pipeline task
    grad_tasks: dict = field(default_factory=dict)  # rank -> tids of its gradient reductions

    def __post_init__(self):
        for s, acts in enumerate(self.schedule):
            self.first_mb[s] = next(a.mb for a in acts if a.kind == "F")
            self.final_mb[s] = next(a.mb for a in reversed(acts) if a.kind == "B")
        for s, w in enumerate(self.work):
            for blk in w.fwd:
                key = (s, _unit(blk))
                self.unit_params[key] = self.unit_params.get(key, 0.0) + blk.params


def _comm(low: Lowering, prog: Program, rank: int, kind: str, group, tag, size: float, *,
          op="all_reduce", stream=None, deps=(), name="", **meta) -> int:
    all_groups = {
        "tp": lambda: low.mesh.groups("tp"),
        "dp": lambda: low.mesh.groups("dp"),
        "pp": lambda: _pp_pairs(low.mesh, +1) + _pp_pairs(low.mesh, -1),
        "emb": lambda: _emb_pairs(low.mesh),
    }[kind]
    orbit, twins, members = low.sym.shape(kind, group, all_groups)
    recv = -1
    if op == "send":
        members, recv = (low.sym.rep[group[0]],), low.sym.rep[group[1]]
    c = Comm(op=op, size_bytes=size, group=group, twins=twins, members=members, key=(kind, orbit, tag),
             recv_rank=recv)
    return prog.add(rank=rank, stream=stream or kind, name=name, kind="pp" if kind == "pp" else
                    ("dp" if kind == "emb" else kind), comm=c, deps=tuple(deps), **meta).tid


def _pp_pairs(mesh: Mesh, direction: int) -> list[tuple[int, int]]:
    out = []
    for r in range(mesh.world_size):
        c = mesh.coords(r)
        nxt = c["pp"] + direction
        if 0 <= nxt < mesh.pp:
            out.append((r, mesh.rank(**{**c, "pp": nxt})))
    return out


def _emb_pairs(mesh: Mesh) -> list[tuple[int, int]]:
    return [(r, mesh.rank(**{**mesh.coords(r), "pp": mesh.pp - 1})) for r in mesh.ranks_where(pp=0)]


COMM_SHORT = {"all_reduce": "AR", "reduce_scatter": "RS", "all_gather": "AG"}


def _unit(blk) -> object:
    """What ZeRO-3 gathers at once: a layer, or the embedding, or the head."""
    return blk.layer if blk.layer >= 0 else blk.name


def _blocks(prog: Program, low: Lowering, r: int, act, blocks, deps: list[int], s: int) -> int:
    """One action's blocks on rank ``r``: [pre comms] compute [post comms], chained.

    Under ZeRO-3 each unit's parameters are all-gathered on the ``zero`` stream before its
    first block, ``zero_prefetch_layers`` units ahead of use (Rajbhandari et al. 2020, Sec 5.3)::

        zero     [AG L1]      [AG L2]      [AG L3]
        compute  [L0 ....... ][L1 ....... ][L2 ....... ]
        dp                                   [RS grads L0] (backward)

    and each unit's gradients are reduce-scattered after its last backward block. Returns the
    action's last task id.
    """
    mesh = low.mesh
    zero3 = low.zero == 3 and mesh.dp > 1
    # kept gathered: one gather per unit per step, at its first forward
    gather = zero3 and (not low.zero3_keep_gathered or (act.kind == "F" and act.mb == low.first_mb.get(s)))
    reduce_now = zero3 and (not low.zero3_keep_gathered or act.mb == low.final_mb[s])
    units: list = []  # units gathered in this action, in order of use
    unit_end: dict = {}  # unit -> its last compute task so far
    gathered: dict = {}
    prev = None
    for i, blk in enumerate(blocks):
        meta = dict(mb=act.mb, phase=act.kind, stage=s, layer=blk.layer)
        first_deps = tuple(deps) if prev is None else (prev,)
        u = _unit(blk)
        if gather and low.unit_params.get((s, u), 0) > 0 and u not in gathered:
            units.append(u)
            k = len(units) - 1 - low.zero_prefetch_layers  # start when unit k begins
            if k >= 1:
                ag_deps = (unit_end[units[k - 1]],)
            else:
                ag_deps = (low.last_compute[r],) if r in low.last_compute else ()
            gathered[u] = _comm(low, prog, r, "dp", mesh.group(r, "dp"), ("AG params", act.kind, act.mb, str(u)),
                                low.unit_params[(s, u)] * PARAM_BYTES, op="all_gather", stream="zero",
                                deps=ag_deps, name=f"{act.kind} AG params", **meta)
            first_deps = first_deps + (gathered[u],)
        for j, c in enumerate(blk.pre):
            prev = _comm(low, prog, r, c.dim, mesh.group(r, c.dim), (act.kind, act.mb, i, "pre", j), c.size_bytes,
                         op=c.op, deps=first_deps, name=f"{act.kind} {COMM_SHORT[c.op]} {blk.name}", **meta)
            first_deps = (prev,)
        prev = prog.add(rank=r, stream="compute", name=f"{act.kind} {blk.name}", kind="compute",
                        duration_s=blk.duration_s, flops=blk.flops, model_flops=blk.model_flops,
                        deps=first_deps, **meta).tid
        low.last_compute[r] = prev
        unit_end[u] = prev
        if act.kind == "B":
            low.bwd_tid[(r, act.mb, i)] = prev
        unit_done = i + 1 == len(blocks) or _unit(blocks[i + 1]) != u
        if reduce_now and act.kind == "B" and unit_done and low.unit_params.get((s, u), 0) > 0:
            low.grad_tasks.setdefault(r, []).append(_comm(
                low, prog, r, "dp", mesh.group(r, "dp"), ("RS grads", act.mb, str(u)),
                low.unit_params[(s, u)] * low.grad_bytes, op="reduce_scatter", stream="dp", deps=(prev,),
                name="RS grads", **meta))
        for j, c in enumerate(blk.post):
            prev = _comm(low, prog, r, c.dim, mesh.group(r, c.dim), (act.kind, act.mb, i, "post", j), c.size_bytes,
                         op=c.op, deps=(prev,), name=f"{act.kind} {COMM_SHORT[c.op]} {blk.name}", **meta)
    return prev


def pipeline_pass(prog: Program, low: Lowering) -> Program:
    """Forward and backward blocks per schedule action, with TP all-reduces and PP sends.

    Tasks are created in unit-time slot order so a receiver's dependency on its sender's
    send task always refers to a task that already exists.
    """
    mesh, sym = low.mesh, low.sym
    grid = unit_time_grid(low.schedule)
    sent: dict[tuple, int] = {}  # (phase, sender rank, mb) -> send tid
    f_end: dict[tuple[int, int], int] = {}  # (rank, mb) -> last tid of its forward
    on_stage: dict[int, list[tuple[int, dict]]] = {}  # pp index -> [(simulated rank, coords)]
    for r in sym.ranks:
        c = mesh.coords(r)
        on_stage.setdefault(c["pp"], []).append((r, c))
    for slot in range(len(grid[0])):
        for s in range(mesh.pp):
            act = grid[s][slot]
            if act is None:
                continue
            for r, c in on_stage[s]:
                blocks = low.work[s].fwd if act.kind == "F" else low.work[s].bwd
                deps: list[int] = []
                if act.kind == "F" and s > 0:
                    deps.append(sent[("F", mesh.rank(**{**c, "pp": s - 1}), act.mb)])
                if act.kind == "B":
                    deps.append(f_end[(r, act.mb)])
                    if s < mesh.pp - 1:
                        deps.append(sent[("B", mesh.rank(**{**c, "pp": s + 1}), act.mb)])
                prev = _blocks(prog, low, r, act, blocks, deps, s)
                if act.kind == "F":
                    f_end[(r, act.mb)] = prev
                    if s < mesh.pp - 1:
                        dst = mesh.rank(**{**c, "pp": s + 1})
                        sent[("F", r, act.mb)] = _comm(
                            low, prog, r, "pp", (r, dst), ("F", act.mb), low.work[s].pp_send_bytes, op="send",
                            stream="pp_fwd_send", deps=(prev,), name="send act", mb=act.mb, phase="F", stage=s)
                elif s > 0:
                    dst = mesh.rank(**{**c, "pp": s - 1})
                    sent[("B", r, act.mb)] = _comm(
                        low, prog, r, "pp", (r, dst), ("B", act.mb), low.work[s].pp_send_bytes, op="send",
                        stream="pp_bwd_send", deps=(prev,), name="send grad", mb=act.mb, phase="B", stage=s)
                low.last_task[r] = prev
    return prog


def dp_grad_pass(prog: Program, low: Lowering) -> Program:
    """Gradient reduction over DP in buckets, each launched when its last gradient is final.

    Buckets fill in backward order (Li et al. 2020, "PyTorch Distributed", Sec 3.2.3)::

        compute  ... [B mlp L5][B attn L5][B mlp L4][B attn L4] ...
        dp                          [AR bucket 0 ]        [AR bucket 1] ...

    ZeRO 0: all-reduce after the last microbatch. ZeRO-1: reduce-scatter after the last
    microbatch (each rank updates its shard). ZeRO-2: reduce-scatter after every microbatch,
    since only the shard of the gradients is kept. ZeRO-3 reduces per unit in
    :func:`pipeline_pass`. Then the tied embedding's all-reduce between first and last stage.
    """
    mesh = low.mesh
    op = "all_reduce" if low.zero == 0 else "reduce_scatter"
    for r in low.sym.ranks:
        s = mesh.coords(r)["pp"]
        tids: list[int] = list(low.grad_tasks.get(r, []))
        if mesh.dp > 1 and low.zero < 3:
            mbs = sorted({a.mb for a in low.schedule[s] if a.kind == "B"}) if low.zero == 2 else [low.final_mb[s]]
            blocks = low.work[s].bwd
            for mb in mbs:
                filled, n = 0.0, 0
                for i, blk in enumerate(blocks):
                    filled += blk.params
                    if filled > 0 and (filled >= low.dp_bucket_params or i == len(blocks) - 1):
                        tids.append(_comm(low, prog, r, "dp", mesh.group(r, "dp"), ("bucket", mb, n),
                                          filled * low.grad_bytes, op=op, deps=(low.bwd_tid[(r, mb, i)],),
                                          name=f"{COMM_SHORT[op]} grads bucket {n}", mb=mb, phase="B", stage=s))
                        filled, n = 0.0, n + 1
        if low.tied_embeddings and mesh.pp > 1 and s in (0, mesh.pp - 1):
            c = mesh.coords(r)
            pair = (mesh.rank(**{**c, "pp": 0}), mesh.rank(**{**c, "pp": mesh.pp - 1}))
            tids.append(_comm(low, prog, r, "emb", pair, ("tied",), low.embedding_params * low.grad_bytes,
                              stream="dp", deps=tuple(tids) or (low.last_task[r],),
                              name="AR tied embedding grads", phase="B", stage=s))
        low.last_task[r] = tids[-1] if tids else low.last_task[r]
        low.grad_tasks[r] = tids
    return prog


def optimizer_pass(prog: Program, low: Lowering) -> Program:
    """One optimizer step per rank once all its gradients are reduced.

    Under ZeRO-1 and -2 each rank updates its shard, then the DP group all-gathers the
    updated 16-bit parameters (Megatron's distributed optimizer); ZeRO-3 keeps them sharded.
    """
    for r in low.sym.ranks:
        s = low.mesh.coords(r)["pp"]
        deps = tuple(low.grad_tasks[r]) or (low.last_task[r],)
        opt = prog.add(rank=r, stream="compute", name="optimizer step", kind="compute",
                       duration_s=low.work[s].optimizer_s, deps=deps, phase="opt", stage=s).tid
        if low.zero in (1, 2) and low.mesh.dp > 1:
            _comm(low, prog, r, "dp", low.mesh.group(r, "dp"), ("AG params after step",),
                  low.work[s].local_params * PARAM_BYTES, op="all_gather", deps=(opt,),
                  name="AG params", phase="opt", stage=s)
    return prog


def lower(sc: Scenario, *, collapse: bool | None = None) -> tuple[Program, Lowering]:
    """Scenario -> Program for one training step."""
    mesh = sc.mesh
    sym = Symmetry(mesh, sc.cfg.simulation.collapse_symmetric if collapse is None else collapse)
    work = [stage_work(sc, s, sc.cluster.gpu) for s in range(mesh.pp)]
    low = Lowering(
        mesh=mesh, schedule=build_schedule(sc.parallel.schedule, mesh.pp, sc.microbatches), work=work, sym=sym,
        grad_bytes=GRAD_BYTES[sc.training.grad_dtype], dp_bucket_params=sc.training.dp_bucket_params,
        tied_embeddings=sc.model.tied_embeddings, embedding_params=sc.model.vocab * sc.model.hidden / mesh.tp,
        zero=sc.parallel.zero, zero_prefetch_layers=sc.parallel.zero_prefetch_layers,
        zero3_keep_gathered=sc.parallel.zero3_keep_gathered,
    )
    return run_passes(low), low


def run_passes(low: Lowering) -> Program:
    prog = Program(ranks=low.sym.ranks, weight=low.sym.weight)
    for p in (pipeline_pass, dp_grad_pass, optimizer_pass):
        prog = p(prog, low)
    return prog
