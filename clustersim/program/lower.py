"""Lowering: scenario -> Program, as a chain of small passes.

    symmetry      which ranks are simulated, and which twins each one stands for
    pipeline_pass F/B/W blocks in schedule order, TP communication, PP sends (per microbatch)
    dp_grad_pass  gradient buckets all-reduced over DP as the last backward produces them,
                  then the all-reduce between the two holders of a part (DualPipe) and the
                  tied-embedding all-reduce between first and last part
    optimizer_pass the optimizer step, after every gradient of the rank is reduced

Each pass takes the Program and returns it with tasks appended; none reads the clock.

The schedule speaks of *virtual stages*: stage k runs on pipeline rank ``stage_rank[k]`` and
computes model part ``stage_part[k]`` (clustersim/schedule/core.py). GPipe, 1F1B and ZB-H1
have stage = part = rank; interleaved 1F1B puts stages r, r+p, ... on rank r; DualPipe
stages r and 2p-1-r (parts r and p-1-r). A microbatch's activation goes from stage k to
``next_stage(k, mb)`` and its gradient back to ``prev_stage``, whichever ranks those are::

    interleaved p=2, v=2:    rank 0: stages 0, 2     rank 1: stages 1, 3
        F  0 -> 1 -> 2 -> 3       sends r0->r1, r1->r0 (wrap), r0->r1
        B  3 -> 2 -> 1 -> 0       sends r1->r0, r0->r1, r1->r0
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from operator import attrgetter

import numpy as np

from ..codegen import Straight
from ..model import moe
from ..config import MAX_GPUS_ALL_RANKS, Scenario
from ..floats import sum_left
from ..hardware.gpus import GpuSpec
from ..plan.mesh import Mesh
from ..schedule.core import fused_weight_passes, units_by_start
from ..schedule.pipeline import Action, PipelineSchedule, as_schedule
from ..trace import unique_inverse
from .tasks import ActionTemplate, Comm, Program, Task
from .work import GRAD_BYTES, PARAM_BYTES, StageWork, embedding_shared_with_last_part, holders, optimizer_bytes, \
    stage_work


# the groups in which ranks communicate (the lowering's kinds, Mesh.grad_group's groups; a
# pipeline group holds every send, tied-embedding and part-holder group)
REFINE_DIMS = ("tp", "cp", "ep", "cp+dp", "edp", "pp")
HYBRID_DIMS = ("zs", "zr")  # and, under hybrid sharding, its shard and replica groups
EXPERT_HYBRID_DIMS = ("ezs", "ezr")  # (and the experts' own, where their expert-DP group is not DP's)


def refine_dims(mesh: Mesh) -> tuple[str, ...]:
    """The groups of :data:`REFINE_DIMS`, with hybrid sharding's where the mesh has them
    (a cp+dp group holds both a slow GPU's shard group and others, whose ranks differ), the
    expert-TP group's where it is neither TP's nor one rank (1 < etp < tp), and hierarchical
    CP's all-to-all slices and rings where it cuts the CP group (``Mesh.cp_a2a``)."""
    extra = HYBRID_DIMS if mesh.zero_shard else ()
    if mesh.cp_a2a:
        extra += ("cpa", "cpr")
    if mesh.grad_group("edp") == "ezs":
        extra += EXPERT_HYBRID_DIMS
    if 1 < mesh.expert_tp < mesh.tp:
        extra += ("etp",)
    return (*REFINE_DIMS[:-1], *extra, REFINE_DIMS[-1])


def refine_classes(mesh: Mesh, start) -> np.ndarray:
    """Class index of every rank: the coarsest split of the classes ``start`` gives (rows of
    equal values, one row per rank) in which, for each kind of group, the members of a class
    sit in groups that hold the same classes at the same positions (colour refinement, as
    in graph isomorphism tests: Weisfeiler and Leman 1968)::

        colours_0 = start;  colours_k+1 = (colours_k, for each kind: the colours_k of the
        rank's group, in group order), renumbered;  stop when the count stops growing
    """
    cls = _row_ids(np.asarray(start))
    groups = []
    for dim in refine_dims(mesh):
        rows = mesh.group_rows(dim)
        where = np.empty(mesh.world_size, dtype=np.int64)
        where[rows] = np.arange(len(rows))[:, None]
        groups.append((rows, where))
    n = int(cls.max()) + 1
    while True:
        cls = _row_ids(np.stack([cls, *(_row_ids(cls[rows])[where] for rows, where in groups)], axis=1))
        if int(cls.max()) + 1 == n:
            return cls
        n = int(cls.max()) + 1


def _first_alike(a: np.ndarray) -> np.ndarray:
    """Per row of ``a``, each entry replaced by the position of the first entry equal to it
    (``[7 7 3 3 3 7]`` -> ``[0 0 2 2 2 0]``): the row's pattern of equal values, whatever they
    are."""
    n = a.shape[1]
    order = np.argsort(a, axis=1, kind="stable")  # equal values keep their order: the first comes first
    s = np.take_along_axis(a, order, axis=1)
    starts = np.ones(s.shape, dtype=bool)
    starts[:, 1:] = s[:, 1:] != s[:, :-1]
    run_start = np.maximum.accumulate(np.where(starts, np.arange(n)[None, :], 0), axis=1)
    out = np.empty_like(a)
    np.put_along_axis(out, order, np.take_along_axis(order, run_start, axis=1), axis=1)
    return out


def _mates_and_places(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per entry of each row of ``labels`` (integers below the row length: a node's first
    member, a block), how many entries of its row share its label, and its place among them
    in row order::

        labels  0 0 2 2 2 0     mates  3 3 3 3 3 3     places  0 1 0 1 2 2
    """
    g, n = labels.shape
    flat = (labels + n * np.arange(g)[:, None]).ravel()
    mates = np.bincount(flat, minlength=g * n)[flat].reshape(g, n)
    order = np.argsort(flat, kind="stable")  # entries of a label in row order
    first = np.ones(len(flat), dtype=bool)
    first[1:] = flat[order][1:] != flat[order][:-1]
    run_start = np.maximum.accumulate(np.where(first, np.arange(len(flat)), 0))
    place = np.empty(len(flat), dtype=np.int64)
    place[order] = np.arange(len(flat)) - run_start
    return mates, place.reshape(g, n)


def _uneven_roles(layout: np.ndarray) -> np.ndarray:
    """Per member of each group (a row of :func:`_first_alike` node layouts, members in ring
    order), its role in the group's ring channels where the group's nodes hold different
    numbers of its members: 1 + 2 (enters its node across the network) + (leaves it); 0 in
    groups whose nodes hold as many members each, where every member enters and leaves alike.
    Where they hold it unevenly (the channels as :func:`_ring_ends` lays them out: one per
    member of the node holding the fewest, g), the members' roles differ, and so does what
    their NICs carry beside the ring (their pipeline sends)::

        group 36 40 44 on nodes 4 5 5 (one ring)    36 enters and leaves, 40 enters, 44 leaves
        group of 8 + 4 (g = 4), the node of 8       members 0-2 both, 3 enters, 4-6 neither, 7 leaves
    """
    mates = _mates_and_places(layout)[0]
    uneven = mates.min(axis=1) != mates.max(axis=1)
    out = np.zeros(layout.shape, dtype=np.int64)
    if uneven.any():  # (most plans hold every group evenly: the channels are laid out for none)
        enters, leaves, *_ = _ring_ends(layout[uneven])
        out[uneven] = 1 + 2 * enters + leaves
    return out


def _shift_roles(nodes: np.ndarray) -> np.ndarray:
    """Per member of each group (rows of node ids, members in ring order), its role in a shift
    round that ring (collectives/ring.py ``shift``: every member passes its buffer to the next,
    one ring in the group's order, no channels to even the roles out): 1 + 2 (its predecessor
    sits on another node: it enters its node across the network) + (its successor does: it
    leaves it). A ring held evenly by its nodes still gives its members different roles,
    so their NICs carry different traffic beside it (their pipeline sends)::

        CP ring 0 4 8 12 on nodes 0 0 1 1        0 and 8 enter (3), 4 and 12 leave (2)
        CP ring of 16 over two nodes of 8        0 and 8 enter, 7 and 15 leave, the rest 1
    """
    return 1 + 2 * (np.roll(nodes, 1, axis=1) != nodes) + (np.roll(nodes, -1, axis=1) != nodes)


def shift_dims(parallel) -> frozenset[str]:
    """The groups whose members pass buffers round one ring (:func:`_shift_roles`): ring
    attention's K/V over the CP group (``cp_comm: ring``) or over the rings across the
    all-to-all slices (``all_to_all+ring``: ``cpr``), and TP communication overlap's ring
    exchange over the TP group (work._ring_exchange)."""
    dims = {"ring": {"cp"}, "all_to_all+ring": {"cpr"}}.get(parallel.cp_comm, set())
    return frozenset(dims | ({"tp"} if parallel.tp_comm_overlap else set()))


def _ring_crossings(nodes: np.ndarray, units: np.ndarray) -> np.ndarray:
    """Per member of each group (rows of node ids, members in ring order; ``units``: the same
    with a last axis of the nodes' units, Cluster.gpu_units), how far its ring channel's
    cables reach where it enters its node and where it leaves it: a code 4 x in + out, each
    0 (does not), 1 (from or to a node of its own group of nodes), 2 (another group of its
    pod) or 3 (another pod); where it enters and leaves, and from and to whom, as
    :func:`_ring_ends` lays the channels out::

        DP ring over nodes 0 1 | 2 (groups of 2 nodes, one pod; one member a node: one ring)
            member on node 0   enters from node 2 (2: other group)  leaves to node 1 (1)    9
            member on node 1   enters from node 0 (1)               leaves to node 2 (2)    6
            member on node 2   enters from node 1 (2)               leaves to node 0 (2)    10
    """
    enters, leaves, src, dst = _ring_ends(nodes)
    r = np.arange(len(nodes))[:, None]
    into = enters * (1 + (units[r, src] != units).sum(axis=-1))
    out = leaves * (1 + (units[r, dst] != units).sum(axis=-1))
    return 4 * into + out


def _ring_ends(nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per member of each group (rows of node ids, or of any labels equal where the nodes
    are, members in ring order): whether its ring channel enters its node through it, whether
    it leaves through it, and the positions of the members its cables come from and go to, as
    :func:`clustersim.collectives.ring.ring_channels` lays the channels out: the nodes' blocks
    in the order they first appear, one channel per member of the block holding the fewest
    (g); channel c enters each block by its member c from the block before and leaves it by
    member c - 1 to the block after; with g = 1 (or one node), one ring in the group's order.
    Every member enters and leaves at most once."""
    g, n = nodes.shape
    pos = np.arange(n)
    first = _first_alike(nodes)  # each member's first node-mate: its block
    is_first = first == pos
    block = np.take_along_axis(np.cumsum(is_first, axis=1) - 1, first, axis=1)
    blocks = is_first.sum(axis=1, keepdims=True)
    head = np.zeros((g, n), dtype=np.int64)  # block -> the position of its first member
    rows, cols = np.nonzero(is_first)
    head[rows, block[rows, cols]] = cols
    mates, place = _mates_and_places(block)
    fewest = mates.min(axis=1, keepdims=True)
    one_ring = (fewest == 1) | (blocks == 1)
    r = np.arange(g)[:, None]
    src = np.where(one_ring, np.roll(pos, 1)[None, :], head[r, (block - 1) % blocks])
    dst = np.where(one_ring, np.roll(pos, -1)[None, :], head[r, (block + 1) % blocks])
    enters = np.where(one_ring, nodes[r, src] != nodes, place < fewest)
    leaves = np.where(one_ring, nodes[r, dst] != nodes, (place <= fewest - 2) | (place == mates - 1))
    return enters, leaves, src, dst


def _row_ids(a: np.ndarray) -> np.ndarray:
    """Per row of ``a`` (non-negative integers), an index shared by equal rows only: the
    columns folded in one by one, renumbered after each (so the codes stay below
    rows x values)."""
    ids = np.zeros(len(a), dtype=np.int64)
    for col in a.T:
        ids = unique_inverse(ids * (int(col.max()) + 1) + col)
    return ids


@dataclass
class Symmetry:
    """Which ranks run in the simulation and whom each stands for.

    Ranks fall into classes whose members run identical programs at identical times; ``rep``
    maps every rank to its class's lowest rank, the one simulated. A communication instance
    stands for its twins (the same communication of other groups whose members map to the
    same simulated ranks), which still load shared links.

    - Not collapsed: every rank is its own class; there are no twins.
    - Collapsed, every GPU at one pace: ranks differing only in their DP, TP or CP index run
      identical programs on identical hardware, so one class per pipeline stage (per stage and
      CP index when CP is not load-balanced: its ranks' attention work differs; refined as
      around stragglers where hybrid sharding's shard groups hold the CP indices in different
      patterns).
    - Collapsed, with stragglers (``slow``: rank -> compute slowdown; rank r runs on GPU r):
      the classes split around them, as finely as the step needs and no finer: ranks stay
      together while they run the same program at the same pace and every group they
      communicate in holds the same classes at the same places (:meth:`_split_classes`,
      colour refinement over the mesh's groups). One slow GPU under TP x PP x DP splits each
      stage into at most four classes (the straggler's chain, its TP peers' chains, the
      other ranks of its TP index, the rest); CP and EP peers add a few more.
    - Collapsed, where a stage straddles nodes (``gpus_per_node``): its ranks whose pipeline
      neighbours share their node send over NVLink, the others over the network, so the
      classes start apart by which chain members share each rank's node and are refined as
      around stragglers (:attr:`_chain_places`); so do ranks whose TP, CP, EP or gradient
      groups lie differently over nodes, which run different flows, or who enter and leave
      their node differently in a group its nodes hold unevenly (:attr:`_group_shapes`).
    - Collapsed, where the fabric's leaf groups or pods (``units``) cut a stage's groups or
      its pipeline routes unevenly: the same a tier up, where that split adds at most
      ``unit_split_ranks`` ranks (:meth:`_unit_split`).
    - Collapsed, with ``replicas`` (``simulation.split_replicas``): ranks start apart by DP
      index too, so twins are TP (and balanced CP) peers of one replica only, refined as
      around stragglers. A replica's peers meet every layer; replicas only at the gradient
      reduction, and where ECMP hashes their sends onto different spines each goes its own
      pace, which one class a stage moved at the slowest one's::

          TP8 x PP4 x DP3, each stage a leaf group of 3 nodes, 16 spines at 3:1
          one class a stage           4 ranks    step +20.7 % against rank by rank
          a class a stage and replica 12 ranks   +0.8 %
    - Collapsed, with a skewed expert load (``ep_distinct``: ``model.moe.ep_load``): EP ranks
      compute different shares, so the classes start apart by the index in the EP group too
      and are refined as around stragglers: one class per (stage, [CP index,] EP index) where
      TP twins share an EP index (experts split as TP) and DP twins collapsed as before.
    - Collapsed, with faults (``faulty``: the ranks whose traffic a degraded NVLink, PCIe or
      NIC-leaf cable of their node touches, and, where their split fits, those of the nodes
      below a faulty fabric cable or switch whose traffic it touches (every one below a removed
      cable or switch) and those of any node whose flows meet the faults' slowed or moved
      flows: config.Scenario.split_faults): their traffic may cross
      or meet a slower link than their twins', which makes them stragglers in communication;
      each is a class of its own, and the classes split around them the same way. So is
      each GPU that shares a NIC with a slow GPU and sends over it (``straggler_mates``:
      config.Scenario.straggler_mates): its sends leave beside the slow GPU's late ones.

    Collapsed and not give the same numbers on a symmetric placement; where twins meet different links
    (ECMP collisions, a stage that spans two leaf groups where the split by units is kept, a
    fabric fault kept in the collapse)
    an orbit moves at its slowest member's pace: close, and most often above (engine/network.py
    ``plan_flows``; tests/test_engine.py, tests/test_symmetry.py; docs/architecture.md, Known
    limitations).
    Where the classes split a stage, one communication is several orbits, and each knows the
    others (:meth:`siblings`): their twins may meet on links neither simulated instance crosses.
    Split classes are exact task by task, and approximate only where a collective shared with
    the stragglers' replicas shares GPU links with a member's own traffic while it runs
    (docs/architecture.md, "Classes split around stragglers").
    """

    mesh: Mesh
    collapse: bool
    cp_distinct: bool = False  # CP ranks run different programs (unbalanced causal attention)
    ep_distinct: bool = False  # EP ranks run different programs (skewed expert load)
    slow: dict[int, float] = field(default_factory=dict)  # rank -> compute slowdown (stragglers)
    # ranks on GPUs whose links (their node's, or the fabric's above them) a fault what-if
    # degraded or removed: their communication may run slower than their twins', so they
    # split the classes as stragglers do
    faulty: frozenset[int] = frozenset()
    # ranks whose flows share a link with those of a slow GPU of their node
    # (config.Scenario.straggler_mates): their links carry a flow that starts late where
    # their twins' carry a twin's, so each is a class of its own, as a faulty rank is
    straggler_mates: frozenset[int] = frozenset()
    # GPUs per node (0: unknown): where a stage's ranks differ in which of their pipeline
    # peers share their node, the classes split by it (:attr:`_chain_places`)
    gpus_per_node: int = 0
    # how far apart pairs of GPUs sit (Cluster.pair_tiers; None: only nodes are compared):
    # where a stage's ranks send to their pipeline neighbours over routes of different shapes
    # (one leaf, or up to the spines), the classes split by it too (:attr:`_chain_places`)
    tiers: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None
    pp_ring: bool = False  # the last stage sends to the first (interleaved 1F1B's next chunk)
    # per GPU, its node's group under one set of leaves and its pod (Cluster.gpu_units; None:
    # not compared): where those edges cut a stage's groups or pipeline routes unevenly, the
    # classes split by it too, if that adds at most ``unit_split_ranks`` ranks to the classes
    # without it (:meth:`_unit_split`)
    units: np.ndarray | None = None
    unit_split_ranks: int = 0
    # each DP replica's ranks apart (``simulation.split_replicas``): twins only within a
    # replica (its TP and CP peers), whose collectives join them every layer; replicas meet
    # only at the gradient reduction, and where ECMP hashes their sends onto different spines
    # one pace for all of them is the slowest one's (:meth:`_split_classes`)
    replicas: bool = False
    # the groups that pass buffers round one ring in their order (:func:`shift_dims`): their
    # members split by whether they enter or leave their node in it (:attr:`_group_shapes`)
    shift_dims: frozenset[str] = frozenset()
    # GPUs sharing each NIC (GPU r's is r // gpus_per_nic): a ring's roles are compared over
    # the members' NIC-mates too (:attr:`_group_shapes`)
    gpus_per_nic: int = 1
    rep: dict[int, int] = field(init=False)
    # the ranks the split by units simulates where it makes a class more than the classes
    # without it, else 0; and whether it was kept (past ``unit_split_ranks`` more)
    unit_split: int = field(init=False, default=0)
    unit_split_kept: bool = field(init=False, default=False)
    # (group, twins) -> its siblings (:meth:`siblings`), for every communication that has any:
    # the engine reads it (Program.siblings)
    sibling_map: dict = field(init=False, default_factory=dict)
    _orbits: dict = field(init=False, default_factory=dict)
    _shapes: dict = field(init=False, default_factory=dict)
    _coarse: dict = field(init=False, default_factory=dict)

    def __post_init__(self):
        m = self.mesh
        stragglers = sorted({r for r, f in self.slow.items() if f != 1.0} | set(self.faulty))
        stragglers = [r for r in stragglers if 0 <= r < m.world_size]
        if not self.collapse:
            self.rep = {r: r for r in range(m.world_size)}
            return
        fine = self._unit_split(stragglers)
        if (stragglers or self.replicas or self.ep_distinct or self.cp_distinct or self._chain_places is not None
                or self._group_shapes is not None):
            # ranks whose work differs by EP or CP index refine too: classes by (stage, [CP index,]
            # [EP index]) hold only where every group keeps one pattern of those indices, which
            # folding EP over TP and CP ranks need not (TP groups of EP indices [0 0 1 1] beside
            # [0 0 0 0]), nor hybrid sharding's shard groups, slices of a cp+dp group in rank
            # order (9 of 18 ranks, CP2: [0 1 0 1 0 1 0 1 0] beside [1 0 1 0 1 0 1 0 1]): as twins
            # their reductions never met (the run deadlocked)
            self.rep = self._split_classes(stragglers)
        else:
            self.rep = dict(enumerate(self._stage_rep))
        if fine is not None:
            # the split by units refines these classes: as many classes, the same ones. It is
            # made within the ranks it may add, never past the all-ranks limit that the
            # scenario check holds the other splits to
            more = len(set(fine.values())) - len(set(self.rep.values()))
            if not more:
                self.unit_split = 0
            elif more <= self.unit_split_ranks and self.unit_split <= MAX_GPUS_ALL_RANKS:
                self.rep = fine
            else:
                self.unit_split_kept = True

    @classmethod
    def split_count(cls, mesh: Mesh, slow: dict[int, float], faulty=frozenset(), cp_distinct: bool = False,
                    ep_distinct: bool = False, gpus_per_node: int = 0, tiers=None, pp_ring: bool = False,
                    replicas: bool = False, straggler_mates=frozenset(), shift=frozenset(),
                    gpus_per_nic: int = 1) -> int:
        """How many ranks the classes split around ``slow`` (rank -> slowdown), ``faulty``
        ranks and the slow GPUs' ``straggler_mates`` simulate (not split by units; ``shift``:
        :attr:`shift_dims`)."""
        return len(cls(mesh, True, cp_distinct, ep_distinct, slow=dict(slow), faulty=frozenset(faulty),
                       straggler_mates=frozenset(straggler_mates), gpus_per_node=gpus_per_node, tiers=tiers, pp_ring=pp_ring,
                       replicas=replicas, shift_dims=frozenset(shift), gpus_per_nic=gpus_per_nic).ranks)

    def _unit_split(self, stragglers: list[int]) -> dict[int, int] | None:
        """``rep`` split by units as well, where edges of leaf groups or pods may cut a
        stage's groups or pipeline routes unevenly, else None; ``__post_init__`` takes it
        where it is finer than the classes without units, by at most ``unit_split_ranks``
        ranks more, else keeps those, whose twins then meet routes of different shapes and
        move at the slowest one's pace.

        - Groups: over DGX A100 nodes two a leaf, TP8 x PP2 x DP3 puts stage 0 on nodes
          0 1 | 2. Its DP rings run from node 0 to node 1 under one leaf but from node 1 to
          node 2 and back to node 0 across a spine, so the members' NICs carry different
          cables (:func:`_ring_crossings`, where a group's units hold it unevenly; which
          positions of a group share a unit is compared everywhere). Collapsed as one class a
          stage, the interleaved step with ZeRO-3 was 3.4 % short; split so, 6 ranks, exact.
        - Pipeline routes, where stages are whole nodes (:meth:`_chain_codes` by
          :meth:`_unit_tiers`): GPT-3 175B's 8-node stages over 20-node groups (nodes
          16-23 | 24-31) send from nodes 16-19 across a spine and from 20-23 under one leaf.

        Which classes run, n the ranks without units and m those of this split (``unit_split``)::

            m = n                            the same classes (unit_split = 0)
            n < m <= n + unit_split_ranks    this split
            m > n + unit_split_ranks         kept: the n (unit_split_kept)
        """
        if self.units is None or not self.gpus_per_node:
            return None
        shared = self._stages_share_nodes()  # the classes below compare the routes already
        places, shapes = self._chain_places if shared else self._chain_codes(self._unit_tiers), self._unit_shapes
        if shapes is None and (places is None or shared):
            return None  # nothing the classes below do not split by
        coarse = self._group_shapes
        if shapes is not None and coarse is not None:
            shapes = _row_ids(np.stack([coarse, shapes], axis=1))
        rep = self._split_classes(stragglers, places, coarse if shapes is None else shapes)
        self.unit_split = len(set(rep.values()))
        return rep

    @cached_property
    def _unit_shapes(self) -> np.ndarray | None:
        """Per rank, a code for how its TP, CP, EP and gradient groups lie over groups of
        nodes and pods (:attr:`units`: which positions share each) and how far its ring
        channels' cables reach where it enters and leaves its node (:func:`_ring_crossings`),
        or None where every group of a kind is alike in both."""
        units = np.asarray(self.units)

        def shape(rows: np.ndarray, _dim: str) -> tuple[np.ndarray, np.ndarray]:
            u = units[rows]  # group x member x level
            alike = [_first_alike(u[:, :, k]) for k in range(u.shape[2])]
            layout = _row_ids(np.stack([_row_ids(a) for a in alike], axis=1))
            # the members' crossings where a level's units hold the group unevenly (as
            # _uneven_roles at nodes): where they hold as many members each, every unit is
            # entered and left alike, and which member crosses differs between the twins
            # of a class without their routes' shapes differing
            uneven = np.zeros(len(rows), dtype=bool)
            for a in alike:
                held = _mates_and_places(a)[0]
                uneven |= held.min(axis=1) != held.max(axis=1)
            cross = np.where(uneven[:, None], _ring_crossings(rows // self.gpus_per_node, u), 0) if uneven.any() \
                else np.zeros(rows.shape, dtype=np.int64)
            return layout, cross

        return self._member_codes(shape)

    def _split_classes(self, stragglers: list[int], places=None, shapes=None) -> dict[int, int]:
        """``rep`` where the classes split (stragglers, faults on a node's cables, a stage
        straddling nodes): the coarsest classes whose members run the same program at the same
        pace and meet, in every communication, members of the same classes at the same places
        (:func:`refine_classes`); each class simulated by its lowest rank.

        Ranks start apart by pipeline stage, which members of their pipeline chain share their
        node (where that differs within a stage: :attr:`_chain_places`), compute slowdown (and
        CP or EP index where those change the work; DP index with :attr:`replicas`); a rank
        whose traffic a fault touches is a class of its own. Refining then splits
        ranks whose TP, CP, EP, gradient (``cp+dp``, ``edp``) or pipeline groups hold
        different classes position by position, until no group splits a class::

            TP2 x PP2 x DP4 (rank = tp + 2 (dp + 4 pp)), GPU 5 slow (stage 0, tp 1, dp 2):
                      dp 0   dp 1   dp 2    dp 3
               pp 0   a  b   a  b   c [S]   a  b     S: the straggler; c: its TP peer
               pp 1   d  e   d  e   f  g    d  e     f, g: the ranks its sends reach
            8 classes of 16 ranks: a, b, d, e stand for 3 ranks each

        Why every member starts and ends each task when its representative does, by induction
        over the step: members run the same program at the same pace; a communication starts
        when its last member arrives and ends at one instant for all of them (the engine times
        each one as a whole), and a member's groups hold the same classes at the same places as
        its representative's, so each of its communications starts (and, its twins loading the
        links alike, ends) when the representative's does. Where the members' groups place a
        straggler at different distances along a ring, the flows of one collective meet the
        members' other traffic on different GPU links while they run: the timing holds, the
        link sharing is the twins' (docs/architecture.md, "Classes split around stragglers").
        """
        m = self.mesh
        r = np.arange(m.world_size)
        coord = {d: m.coord_array(d) for d in ("tp", "cp", "dp", "pp")}
        ep_index = m.expert_coords["ep"]
        factor = np.array([self.slow.get(int(x), 1.0) for x in r])
        alone = np.zeros(m.world_size, dtype=np.int64)
        # a faulty rank's links are its own: it is a class of its own. So is a straggler's
        # mate: as one class, the mates' twins beside the straggler's late flow on their
        # node's links were weighed as its sibling orbit's are (engine/network.py _weigh: real
        # over simulated flows there, an average, not what each flow meets while the other
        # is not running), and their step was 0.26 % off where it is now exact
        for x in self.faulty | self.straggler_mates:
            if 0 <= x < m.world_size:
                alone[x] = x + 1
        if places is None and shapes is None:
            places, shapes = self._chain_places, self._group_shapes
        start = np.stack([coord["pp"], 0 * r if places is None else places, coord["cp"] if self.cp_distinct else 0 * r,
                          ep_index if self.ep_distinct else 0 * r, 0 * r if shapes is None else shapes,
                          unique_inverse(factor), alone, coord["dp"] if self.replicas else 0 * r], axis=1)
        cls = refine_classes(m, start)
        first = np.full(int(cls.max()) + 1, m.world_size)
        np.minimum.at(first, cls, r)
        return dict(zip(r.tolist(), first[cls].tolist()))

    @cached_property
    def _chain_places(self) -> np.ndarray | None:
        """:meth:`_chain_codes`, the routes compared where stages share nodes."""
        return self._chain_codes(self.tiers if self.gpus_per_node and self._stages_share_nodes() else None)

    def _unit_tiers(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Per pair of GPUs, how far apart they sit by :attr:`units`, in Cluster.pair_tiers'
        codes without a fault's (0 the same GPU, 1 the same node, 2 + the levels of units
        they differ in: one group of nodes 2, one pod 3, two pods 4), where
        :meth:`_chain_codes` compares the routes of stages made of whole nodes: read off the
        units, without routing every pair (a fault splits its GPUs anyway). Rails are not
        read: the codes are pair_tiers' for GPUs of one index in their nodes, which pipeline
        neighbours of whole-node stages are."""
        other_node = src // self.gpus_per_node != dst // self.gpus_per_node
        apart = (self.units[src] != self.units[dst]).sum(axis=-1)
        return np.where(src == dst, 0, np.where(other_node, 2 + apart, 1))

    @cached_property
    def _node_mates(self) -> np.ndarray:
        """Per (chain, own stage), in :meth:`_chain_codes`' order, a code for which stages of
        its pipeline chain share its node (worked out once: 64 stages make 64 columns)."""
        node = self.mesh.group_rows("pp") // self.gpus_per_node
        return _row_ids((node[:, :, None] == node[:, None, :]).reshape(-1, self.mesh.pp).astype(np.int64))

    def _chain_codes(self, tiers) -> np.ndarray | None:
        """Per rank, which members of its pipeline chain share its node and, with ``tiers``,
        the shape of the routes to its pipeline neighbours (a code; equal codes, equal
        patterns, stage by stage), or None where every rank of a stage has the same pattern.
        A stage that straddles nodes sends to its neighbours over NVLink from some ranks and
        over the network from others; on a fabric, some under one leaf and others up to the
        spines. Their twins would meet different links, and an orbit moves at its slowest
        twin's pace: on Llama 3's Clos (two servers a leaf), TP4 x PP4 x DP3 over 6 nodes took
        16 % longer collapsed than rank by rank before the routes were compared::

            stage 0 -> 1 of chain dp0: node 0 -> node 1, one leaf        tier 2
                            chain dp1: node 0 -> node 2, across a spine   tier 3
        """
        if not self.gpus_per_node:
            return None
        rows = self.mesh.group_rows("pp")  # chain x stage
        pattern = self._node_mates[:, None]
        if tiers is not None and self.mesh.pp > 1:
            ahead = tiers(rows[:, :-1].ravel(), rows[:, 1:].ravel()).reshape(len(rows), -1)  # s -> s+1
            wrap = tiers(rows[:, -1], rows[:, 0])[:, None] if self.pp_ring else np.full((len(rows), 1), -1)
            ahead = np.hstack([ahead, wrap])  # chain x own stage: to the next stage
            behind = np.roll(ahead, 1, axis=1)  # chain x own stage: from the one before
            pattern = np.hstack([pattern, ahead.reshape(-1, 1), behind.reshape(-1, 1)])
        codes = _row_ids(pattern).reshape(rows.shape)  # chain x own stage
        if (codes == codes[:1]).all():  # each stage's ranks alike
            return None
        out = np.empty(self.mesh.world_size, dtype=np.int64)
        out[rows] = codes
        return out

    @cached_property
    def _group_shapes(self) -> np.ndarray | None:
        """Per rank, a code for how its TP, CP, EP and gradient groups lie over nodes (which
        positions of each group share a node: equal codes, equal layouts), or None where every
        group of a kind has one layout. Groups of one kind laid out differently run different
        flows: an expert-DP group of 6 inside a node rings over NVLink, one over 2 + 4 GPUs of
        two nodes crosses by 2 NICs; as twins the second ran as the first's ring mapped onto
        its members (one channel), collapsed 58 % above rank by rank::

            group (ranks)      nodes          layout (each member's first node-mate's position)
            0 1 2 3 4 5        0 0 0 0 0 0    0 0 0 0 0 0
            6 7 8 9 10 11      0 0 1 1 1 1    0 0 2 2 2 2

        Where a group's nodes hold different numbers of its members, each member's code also
        holds its role in the group's ring channels (:func:`_uneven_roles`): members that
        enter or leave their node differently load their NICs differently. So does a group
        that passes buffers round one ring (:attr:`shift_dims`), wherever it crosses nodes,
        held evenly or not (:func:`_shift_roles`): one class a stage ran every member's
        pipeline sends as the first's, beside no ring hop on its NIC, and the exposed PP time
        of ring attention over two nodes (TP1 x CP16 x PP2 x DP2) was 18 % short of rank by
        rank's, of hierarchical CP's rings (CP16 as 4 x 4) 9.5 %; split, both exact. Where GPUs
        share a NIC, a member's role comes with its NIC-mates' (a member that does neither
        shares its NIC with one that leaves: with 4 NICs a node, the CP16 ring's exposed PP time
        was 7 % off with the roles alone).
        """
        if not self.gpus_per_node:
            return None

        def shape(rows: np.ndarray, dim: str) -> tuple[np.ndarray, np.ndarray]:
            # the group's layout, and each member's role in it: in its ring channels where its
            # nodes hold it unevenly, in a shift round it wherever it crosses nodes
            layout = _first_alike(rows // self.gpus_per_node)
            roles = _uneven_roles(layout)
            if dim in self.shift_dims:
                roles = 4 * roles + _shift_roles(rows // self.gpus_per_node)
            if self.gpus_per_nic > 1 and (roles != roles.flat[0]).any():
                # a NIC carries its GPUs' hops: each member's role with its NIC-mates' (sorted)
                by_gpu = np.zeros(self.mesh.world_size, dtype=np.int64)
                by_gpu[rows] = roles
                nic = np.repeat(_row_ids(np.sort(by_gpu.reshape(-1, self.gpus_per_nic), axis=1)), self.gpus_per_nic)
                roles = _row_ids(np.stack([roles.ravel(), nic[rows].ravel()], axis=1)).reshape(roles.shape)
            return _row_ids(layout), roles

        return self._member_codes(shape)

    def _member_codes(self, shape) -> np.ndarray | None:
        """Per rank, a code of what ``shape`` (a kind's groups as rows of ranks -> a code per
        group, a code per member) says of each of its TP, CP, EP and gradient groups and of its
        place in it (equal codes, equal shapes and places), or None where every member of every
        group of a kind has one code: :attr:`_group_shapes` over nodes, :attr:`_unit_shapes`
        over leaf groups and pods."""
        codes, any_apart = [], False
        for dim in refine_dims(self.mesh)[:-1]:  # pp: _chain_places
            rows = self.mesh.group_rows(dim)
            if rows.shape[1] < 2:
                continue
            group, member = shape(rows, dim)
            code = np.empty(self.mesh.world_size, dtype=np.int64)
            code[rows] = _row_ids(np.stack([np.broadcast_to(group[:, None], member.shape).ravel(), member.ravel()],
                                           axis=1)).reshape(member.shape)
            any_apart |= bool((code != code[0]).any())
            codes.append(code)
        return _row_ids(np.stack(codes, axis=1)) if any_apart else None

    def _stages_share_nodes(self) -> bool:
        """Whether a node holds ranks of two stages. Only then are the routes' shapes
        compared by routing every pair (``tiers``): where stages are whole nodes, a leaf
        group's edge that cuts a stage's replicas unevenly (DGX-A100 SuperPOD's 20-node units
        under 8-node stages) is seen by the split by units (:meth:`_unit_split`, the shapes read
        off the units), made where it fits."""
        stage = self.mesh.coord_array("pp")
        by_node = stage.reshape(-1, self.gpus_per_node) if self.mesh.world_size % self.gpus_per_node == 0 else None
        return by_node is None or bool((by_node != by_node[:, :1]).any())

    @cached_property
    def ranks(self) -> list[int]:
        return sorted(set(self.rep.values()))

    @property
    def weight(self) -> dict[int, int]:
        return dict(sorted(Counter(self.rep.values()).items()))

    @property
    def rep_of_gpu(self) -> tuple[int, ...]:
        """The simulated rank of every GPU, by GPU (rank g runs on GPU g)."""
        rep = self.rep
        return tuple(rep[g] for g in range(len(rep)))

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
        """(orbit key, twins, members) of ``group``, computed once per group; its siblings
        (:meth:`siblings`), if it has any, go into ``sibling_map``."""
        key = (kind, group)
        if key not in self._shapes:
            self._shapes[key] = (self.orbit_key(group), self.twins(kind, group, all_groups), self.members(group))
            sib = self.siblings(kind, group, all_groups)
            if sib:
                self.sibling_map[(group, self._shapes[key][1])] = sib
        return self._shapes[key]

    @cached_property
    def _stage_rep(self) -> list[int]:
        """Rank -> the rank of its pipeline stage with every other index 0 (one class per stage)."""
        m = self.mesh
        first = np.array([m.rank(pp=q) for q in range(m.pp)])  # each stage's rank with every other index 0
        return first[m.coord_array("pp")].tolist()

    @cached_property
    def split(self) -> bool:
        """Whether a stage's ranks fall into several classes (stragglers, faults, CP or EP
        ranks that differ): then one communication of the step can be several orbits."""
        return self.collapse and len(self.ranks) > self.mesh.pp

    def siblings(self, kind: str, group: tuple[int, ...], all_groups) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """The other orbits of the communication ``group`` is one instance of, where the
        classes split it: the groups of ``kind`` that one class per pipeline stage would make
        twins of ``group`` but that are not, one tuple per orbit, its simulated instance
        first. () when the classes do not split a stage.

        The engine needs them because the twins of two orbits may meet on a link that neither
        simulated instance crosses (ECMP puts a twin send of one EP index's class and one of
        another's on one spine): the orbit check counts every flow of the siblings too, so
        that such a meeting makes the orbits asymmetric (engine/network.py ``plan_phases``)::

            one class per stage      stage 1 -> 2 sends: one orbit, dp 0..3        (no siblings)
            a class per EP index     ep 0: dp 0, 2   ep 1: dp 1, 3                 (each the other's)
        """
        if not self.split:
            return ()
        stage_rep = self._stage_rep
        coarse = self._coarse.get(kind)
        if coarse is None:
            self.twins(kind, group, all_groups)  # the orbits of kind, grouped
            coarse = self._coarse[kind] = {}
            for fine in self._orbits[kind]:
                coarse.setdefault(tuple(map(stage_rep.__getitem__, fine)), []).append(fine)
        fine = self.orbit_key(group)
        ck = tuple(map(stage_rep.__getitem__, fine))
        out = []
        for other in coarse[ck]:
            if other == fine:
                continue
            groups = self._orbits[kind][other]
            sim = other if other in groups else groups[0]  # the group of simulated ranks
            out.append((sim, *(g for g in groups if g != sim)))
        return tuple(out)


@dataclass
class Lowering:
    """What every pass reads: the plan, the schedule, per-part work, the symmetry.

    ``work[j]`` is the work of model part j (``schedule.stage_part`` maps stages to parts).
    """

    mesh: Mesh
    schedule: PipelineSchedule
    work: list[StageWork]
    sym: Symmetry
    grad_bytes: int = 4  # a gradient element in memory (training.grad_dtype)
    optimizer_bytes: int = field(default_factory=optimizer_bytes)  # optimizer state a parameter (work's)
    reduce_bytes: int = 4  # and on the wire, reduced (training.grad_reduce_dtype)
    dp_bucket_params: float = 40e6
    tied_embeddings: bool = False
    embedding_params: float = 0.0  # per TP rank, for the tied-embedding all-reduce
    zero: int = 0
    zero_prefetch_layers: int = 1
    zero3_keep_gathered: bool = False
    overlap_param_gather: bool = False  # ZeRO-1/2's gathers in the first forward (optimizer_pass)
    overlap_grad_reduce: bool = True  # DP reductions bucket by bucket beside the backward (_reduce_action)
    optimizer_offload: float = 0.0  # the share of each optimizer shard in host memory (training's)
    model_layers: int = 0  # the model's decoder layers (activation offload's window counts them)
    overlap_offload_copies: bool = False  # an offloaded optimizer's copies pipelined (optimizer_pass)
    # (CP index, index in the EP group) -> per-part work, when CP or EP ranks differ (unbalanced
    # causal attention, skewed expert load); the index that does not matter is 0
    rank_work: dict = field(default_factory=dict)
    routing: tuple = ()  # how the MoE dispatches send (Program.routing)
    # filled by __post_init__
    grad_kind: str = field(init=False)  # the action after which gradients are final: "W" or "B"
    first_mb: dict = field(default_factory=dict)  # virtual stage -> first microbatch it runs forward
    final_mb: dict = field(default_factory=dict)  # virtual stage -> microbatch of its last grad_kind action
    unit_params: dict = field(default_factory=dict)  # (part, unit) -> local params ZeRO-3 gathers
    unit_shards: dict = field(default_factory=dict)  # (part, unit) -> ((group kind, params), ...) ZeRO-3 gathers
    parts_of: dict = field(default_factory=dict)  # pipeline rank -> model parts it holds, ascending
    holders_of: dict = field(default_factory=dict)  # part -> pipeline ranks holding it, ascending
    pp_edges: tuple = ()  # (src, dst) pipeline ranks of every PP send, both directions
    tied_pps: tuple = ()  # pipeline ranks in the tied-embedding all-reduce (empty: none)
    # filled by the passes, read by later passes
    # (rank, stage, mb, block index) -> grad_kind compute tid, for the actions dp_grad_pass reduces after
    # (a stage's final microbatch; every one under ZeRO-2)
    bwd_tid: dict = field(default_factory=dict)
    last_compute: dict = field(default_factory=dict)  # rank -> its latest compute task
    last_task: dict = field(default_factory=dict)  # rank -> tids ending its last pipeline action
    done: dict = field(default_factory=dict)  # (kind, rank, stage, mb) -> tids that release the action
    sent: dict = field(default_factory=dict)  # (kind, sender rank, stage, mb) -> send tid
    grad_tasks: dict = field(default_factory=dict)  # rank -> tids of its gradient reductions
    stage_grads: dict = field(default_factory=dict)  # (rank, stage) -> tids reducing that stage's grads
    # rank -> the gradient reductions of its last gradient action under ZeRO-2/3, which its next
    # action waits for (:func:`_reduce_action`); (rank, stage, mb, group kind, bucket) -> a
    # ZeRO-2 bucket's reduce-scatter, made in the pipeline pass
    sync: dict = field(default_factory=dict)
    bucket_tid: dict = field(default_factory=dict)
    # rank -> (part, mb, unit) ZeRO-3 gathered last for its latest action, a forward's (None:
    # any other action): the backward of that microbatch right after uses it first, still held
    held: dict = field(default_factory=dict)
    # (rank, stage, mb) -> the route of a full backward's B written B then W, whose output goes
    # when its W ends (:func:`_release_after_w`)
    held_outputs: dict = field(default_factory=dict)
    _groups: dict = field(default_factory=dict, repr=False)  # (rank, dim) -> mesh group
    _pp_of: dict = field(default_factory=dict, repr=False)  # rank -> its pipeline position
    _stage_peers: dict = field(default_factory=dict, repr=False)  # (rank, stage) -> stage_peer
    _fused: dict = field(default_factory=dict, repr=False)  # pipeline rank -> its fused (stage, mb)
    routes: dict = field(default_factory=dict, repr=False)  # (rank, kind, stage, input, output stage, fused) -> _route
    # (rank, kind, id(blocks)) -> _block_plan; ("send", rank, peer, kind, part) -> a send's _comm_spec
    block_plans: dict = field(default_factory=dict, repr=False)
    # (rank, kind, stage, id(blocks), inputs) -> ActionTemplate, or False (_single_action)
    templates: dict = field(default_factory=dict, repr=False)
    use_templates: bool = True  # False: every action through _blocks (tests compare the two)
    # the shorter step's schedule (engine.repeat), whose lowering starts where this one's and
    # its part (pipeline_pass keeps its state there, ``resume``: a :class:`_Parting`)
    shorter: PipelineSchedule | None = field(default=None, repr=False)
    resume: _Parting | None = field(default=None, repr=False)

    def __post_init__(self):
        s = self.schedule = as_schedule(self.schedule)
        self.grad_kind = "W" if s.split_backward else "B"
        first, final = _first_and_final_mb(s, self.grad_kind)
        self.first_mb.update(first)
        self.final_mb.update(final)
        for j, w in enumerate(self.work):
            experts: dict = {}
            for blk in w.fwd:
                key = (j, _unit(blk))
                self.unit_params[key] = self.unit_params.get(key, 0.0) + blk.params
                experts[key] = experts.get(key, 0.0) + blk.expert_params
            # ZeRO-3 shards dense parameters over dp x cp and routed experts over their
            # expert-DP group (x cp); a group of one shards nothing
            for key, dense in self.unit_params.items():
                if key[0] == j:
                    self.unit_shards[key] = tuple(
                        (dim, n) for dim, n in (("dp", dense), ("edp", experts[key]))
                        if n > 0 and self.mesh.size(self.grad_dim(dim)) > 1)
        for q in range(s.ranks):
            self.parts_of[q] = tuple(sorted({s.stage_part[k] for k in s.stages_of(q)}))
        for j in range(s.n_parts):
            self.holders_of[j] = holders(s, j)
        self.pp_edges = _pp_edges(s)
        first, last = self.holders_of[0], self.holders_of[s.n_parts - 1]
        if self.tied_embeddings and s.n_parts > 1 and first != last:
            self.tied_pps = tuple(sorted(set(first) | set(last)))

    @property
    def split(self) -> bool:
        return self.grad_kind == "W"

    def pp_of(self, rank: int) -> int:
        """Its place in its pipeline group (asked several times per action: remembered)."""
        q = self._pp_of.get(rank)
        if q is None:
            q = self._pp_of[rank] = self.group_of(rank, "pp").index(rank)
        return q

    def grad_dim(self, kind: str) -> str:
        """The mesh group of a lowering kind: gradients and ZeRO shards ("dp", "edp") over
        ``Mesh.grad_group`` (times CP, or under hybrid sharding a shard group, "zs", whose
        shards the replica groups, "zr", then all-reduce); the others over their own."""
        return self.mesh.grad_group(kind) if kind in ("dp", "edp") else kind

    def group_of(self, rank: int, dim: str) -> tuple[int, ...]:
        """``mesh.group(rank, grad_dim(dim))``, remembered: the lowering asks for it once per
        communication."""
        key = (rank, dim)
        g = self._groups.get(key)
        if g is None:
            g = self._groups[key] = self.mesh.group(rank, self.grad_dim(dim))
        return g

    @property
    def n_grad(self) -> int:
        """Ranks that reduce (and ZeRO-shard) one gradient together: dp x cp, or a hybrid
        shard group of them."""
        return self.mesh.size(self.grad_dim("dp"))

    @property
    def n_replicas(self) -> int:
        """Hybrid sharding's replicas of each shard (1 without it: one group of every rank):
        they all-reduce it."""
        return self.mesh.size("zr")

    @property
    def grad_shards(self) -> tuple[int, int]:
        """Into how many shards a DP reduction leaves the dense and the routed-expert
        gradients (1 under ZeRO 0, whose all-reduce leaves them whole): dp x cp, and the
        expert-DP group x cp."""
        return self.mesh.grad_shards(self.zero)

    def work_of(self, rank: int, part: int) -> StageWork:
        """The work of ``part`` as rank ``rank`` runs it (CP ranks differ without load balancing)."""
        if self.rank_work:
            c = self.mesh.coords(rank)
            return self.rank_work[(c["cp"] if self.sym.cp_distinct else 0,
                                   int(self.mesh.expert_coords["ep"][rank]) if self.sym.ep_distinct else 0)][part]
        return self.work[part]

    def peer(self, rank: int, pp: int) -> int:
        """The rank at pipeline position ``pp`` with ``rank``'s TP and DP coordinates."""
        return self.group_of(rank, "pp")[pp]

    def stage_peer(self, rank: int, stage: int) -> int:
        """:meth:`peer` at the pipeline position of virtual stage ``stage``, or -1 when that
        is ``rank``'s own (a hand-over without a send); asked twice per action: remembered."""
        p = self._stage_peers.get((rank, stage))
        if p is None:
            q = self.schedule.stage_rank[stage]
            p = self._stage_peers[(rank, stage)] = -1 if q == self.pp_of(rank) else self.peer(rank, q)
        return p

    def part(self, stage: int) -> int:
        return self.schedule.stage_part[stage]

    def fused(self, q: int, stage: int, mb: int) -> bool:
        """Whether pipeline rank ``q``'s backward of ``mb`` on ``stage`` is a full backward
        written B then W in a split schedule (schedule.core.fused_weight_passes)."""
        if not self.split:
            return False
        got = self._fused.get(q)
        if got is None:
            got = self._fused[q] = fused_weight_passes(self.schedule, q)
        return (stage, mb) in got


def _pp_edges(s: PipelineSchedule) -> tuple[tuple[int, int], ...]:
    """(sender, receiver) pipeline ranks of every activation and gradient send, sorted."""
    edges = set()
    for mb, path in enumerate(s.paths):
        for a, b in zip(path, path[1:]):
            ra, rb = s.stage_rank[a], s.stage_rank[b]
            if ra != rb:  # consecutive stages on one rank hand over without a send
                edges.update({(ra, rb), (rb, ra)})
    return tuple(sorted(edges))


def _pp_groups(mesh: Mesh, pps: tuple[int, ...]) -> list[tuple[int, ...]]:
    """For every TP and DP coordinate, the ranks at pipeline positions ``pps``, in that order."""
    stride = mesh.rank(pp=1)  # moving one pipeline position moves the rank by this much
    return [tuple(r + (q - pps[0]) * stride for q in pps) for r in mesh.ranks_where(pp=pps[0])]


def _all_groups(low: Lowering, kind: str):
    """Every group of ``kind`` in the mesh (for twins: the groups that map onto the same ranks)."""
    if kind in ("tp", "cp", "dp", "ep", "edp", "etp", "zr", "ezr", "cpa", "cpr"):
        return low.mesh.groups(low.grad_dim(kind))
    if kind == "pp":
        return [g for e in low.pp_edges for g in _pp_groups(low.mesh, e)]
    if kind == "emb":
        return _pp_groups(low.mesh, low.tied_pps)
    if kind == "rep":
        sets = dict.fromkeys(h for h in low.holders_of.values() if len(h) > 1)
        return [g for h in sets for g in _pp_groups(low.mesh, h)]
    raise ValueError(f"unknown communication kind {kind!r}")


# communication kind of the lowering -> kind in the trace and metrics
_TRACE_KIND = {"pp": "pp", "emb": "dp", "rep": "dp", "edp": "dp", "zr": "dp", "ezr": "dp", "etp": "tp", "cpa": "cp",
               "cpr": "cp"}
# communication kind of the lowering -> its stream, where not its own: an expert-TP group's
# gathers run where TP's would (work.MoeBlocks), one stream of TP communication; hierarchical
# CP's all-to-alls and ring shifts on CP's
_STREAM = {"etp": "tp", "cpa": "cp", "cpr": "cp"}


def _comm_spec(low: Lowering, kind: str, group, size: float, op: str, stream: str | None, name: str,
               channel: str | None, load: tuple = ()) -> tuple:
    """What every instance of one communication shares (all but its tag, deps and meta)::

        (op, size, group, twins, members, recv rank, channel, orbit, stream, trace kind, name, load)
    """
    orbit, twins, members = low.sym.shape(kind, group, lambda: _all_groups(low, kind))
    recv = -1
    if op == "send":
        members, recv = (low.sym.rep[group[0]],), low.sym.rep[group[1]]
    return (op, size, group, twins, members, recv, channel or kind, orbit, stream or _STREAM.get(kind, kind),
            _TRACE_KIND.get(kind, kind), name, load)


def _add_comm(prog: Program, rank: int, spec: tuple, tag, deps: tuple, mb: int = -1, phase: str = "",
              stage: int = -1, layer: int = -1) -> int:
    """Append one instance of the communication ``spec`` (:func:`_comm_spec`); its task id."""
    op, size, group, twins, members, recv, channel, orbit, stream, kind, name, load = spec
    c = Comm(op, size, group, twins, members, (channel, orbit, tag), recv, load)
    tasks = prog.items
    tid = len(tasks)
    # positional, in Task's field order: the lowering creates one per task
    tasks.append(Task(tid, rank, stream, name, kind, 0.0, c, deps, mb, phase, stage, layer, 0.0, 0.0))
    return tid


def _comm(low: Lowering, prog: Program, rank: int, kind: str, group, tag, size: float, *,
          op="all_reduce", stream=None, deps=(), name="", channel=None, **meta) -> int:
    """Append one communication task; ``channel`` (default ``kind``) names the engine's channel.

    The engine times a communication in closed form when no other channel uses its links, which
    assumes a channel's communications never overlap; PP sends of the two directions run on
    separate streams, so they get separate channels (``pp F``, ``pp B``).
    """
    return _add_comm(prog, rank, _comm_spec(low, kind, group, size, op, stream, name, channel), tag, tuple(deps),
                     **meta)


COMM_SHORT = {"all_reduce": "AR", "reduce_scatter": "RS", "all_gather": "AG", "all_to_all": "A2A",
              "shift": "shift"}


def _unit(blk) -> object:
    """What ZeRO-3 gathers at once: a layer, or the embedding, or the head (all the pieces of
    its cut backward, "head wgrad" and "head norm" too: work.tp_overlapped_backward)."""
    return blk.layer if blk.layer >= 0 else blk.name.split(" ", 1)[0]


def _blocks(prog: Program, low: Lowering, r: int, act: Action, blocks, deps, chunk: bool = False):
    """One action's blocks on rank ``r``: [pre comms] compute [post comms], chained.

    A generator: it appends one block's tasks per step, so that two actions can be interleaved
    block by block (an overlapped F&B chunk, ``chunk``: its compute lasts a block's
    ``chunk_duration_s`` where the chunk's communication kernels hold SMs); it returns the
    action's last task id.

    Under ZeRO-3 each unit's parameters are all-gathered on the ``zero`` stream before its
    first block, ``zero_prefetch_layers`` units ahead of use (Rajbhandari et al. 2020, Sec 5.3)::

        zero     [AG L1]      [AG L2]      [AG L3]
        compute  [L0 ....... ][L1 ....... ][L2 ....... ]
        dp                                   [RS grads L0] (backward)

    and each unit's gradients are reduce-scattered after its last block of the action that
    makes them final (W, or B without a split). W needs no gather: ``dA = X^T dY`` reads
    activations only. ZeRO-1/2 with ``overlap_param_gather`` gathers the same way in each
    part's first forward only (the parameters the step before updated), and reduces nothing
    here.
    """
    q, stage, kind, mb = low.pp_of(r), act.stage, act.kind, act.mb
    part = low.part(stage)
    zero3 = low.zero == 3 and low.n_grad > 1
    keep = low.zero3_keep_gathered
    after_step = _gathers_after_step(low, kind, stage, mb)
    by_unit = zero3 or after_step
    # kept gathered: one gather per unit per step, at its first forward
    gather = after_step or zero3 and ((kind == "F" and (not keep or mb == low.first_mb.get(stage)))
                                      or (kind == "B" and not keep))
    reduce_now = zero3 and kind == low.grad_kind and (not keep or mb == low.final_mb[stage])
    units: list = []  # units gathered in this action, in order of use
    last_of = {_unit(blk): i for i, blk in enumerate(blocks)} if reduce_now else {}
    unit_end: dict = {}  # unit -> its last compute task so far
    gathered: dict = {}
    prev = None
    carried: tuple = ()  # overlapped communications of the previous block: this one waits for them
    tasks = prog.items
    keep_tids = _keeps_block_tids(low, kind, stage, mb)
    # the rank's compute before this action: the first units' gathers start after it (where a
    # unit's gather starts is otherwise where the unit zero_prefetch_layers before it begins)
    before = (low.last_compute[r],) if r in low.last_compute and not after_step else ()
    # at a forward-to-backward turn the unit the forward used last is still gathered (FSDP2
    # leaves the root's parameters unsharded after forward, torchtitan the last block's;
    # DeepSpeed keeps what is reused within stage3_max_reuse_distance): no second gather
    held = low.held.pop(r, None) if zero3 else None
    if held is not None and (kind != "B" or held[:2] != (part, mb)):
        held = None
    plan = _block_plan(low, r, kind, blocks)
    acts = {ly: (s, x) for ly, x, s in low.work[part].offload_acts} if kind in ("F", "B") else {}
    if acts:
        window = low.model_layers - len(acts)  # (Transformer Engine's: the layers resident at once)
        first_of: dict[int, int] = {}
        last_of_layer: dict[int, int] = {}
        for i, (blk, *_) in enumerate(plan):
            if blk.layer >= 0:
                first_of.setdefault(blk.layer, i)
                last_of_layer[blk.layer] = i
        moved: dict[int, int] = {}  # layer -> its copy down (F) or up (B)
    for i, (blk, name, pre, overlap, post) in enumerate(plan):
        layer = blk.layer
        first_deps = tuple(deps) if prev is None else (prev,)
        if carried:
            first_deps += carried
        if acts and first_of.get(layer) == i:
            first_deps += _offload_turn(prog, low, r, kind, layer, acts, moved, window, first_deps, mb, q)
        # a communication-only block (the embedding's B under SP) computes nothing: no weights needed
        u = _unit(blk) if by_unit else None
        shards = low.unit_shards.get((part, u), ()) if by_unit else ()
        if held is not None and u == held[2] and not units:
            gathered[u] = ()
            units.append(u)  # in the count of units in flight: the next one is prefetched after it
        if gather and blk.duration_s > 0 and shards and u not in gathered:
            units.append(u)
            k = len(units) - 1 - low.zero_prefetch_layers  # start when unit k begins
            ag_deps = (unit_end[units[k - 1]],) if k >= 1 else before
            gathered[u] = tuple(
                _comm(low, prog, r, dim, low.group_of(r, dim), ("AG params", kind, stage, mb, str(u), dim),
                      n * PARAM_BYTES, op="all_gather", stream="zero", deps=ag_deps,
                      name=f"{kind} AG {'expert ' if dim == 'edp' else ''}params", mb=mb, phase=kind, stage=q,
                      layer=layer)
                for dim, n in shards)
            first_deps = first_deps + gathered[u]
        for j, spec in enumerate(pre):
            prev = _add_comm(prog, r, spec, (kind, stage, mb, i, "pre", j), first_deps, mb, kind, q, layer)
            first_deps = (prev,)
        prev = len(tasks)
        # positional, in Task's field order
        duration_s = blk.chunk_duration_s if chunk and blk.chunk_duration_s is not None else blk.duration_s
        tasks.append(Task(prev, r, "compute", name, "compute", duration_s, None, first_deps, mb, kind, q, layer,
                          blk.flops, blk.model_flops))
        # after the compute they run beside, so that every later task of the action waits for
        # them through the next block (what lets the engine time an action in one go, _Segment)
        carried = tuple(_add_comm(prog, r, spec, (kind, stage, mb, i, "overlap", j), first_deps, mb, kind, q, layer)
                        for j, spec in enumerate(overlap)) if overlap else ()
        low.last_compute[r] = prev
        if acts and kind == "F" and layer in acts and last_of_layer[layer] == i:
            moved[layer] = prog.add(rank=r, stream="d2h", name="activations to host", kind="offload",
                                    duration_s=acts[layer][0], deps=(prev,), mb=mb, phase=kind, stage=q, layer=layer,
                                    size_bytes=acts[layer][1]).tid
        if keep_tids:
            low.bwd_tid[(r, stage, mb, i)] = prev
        if by_unit:
            unit_end[u] = prev
            # the unit's last block in the action (a uniform recompute group's forwards come
            # before its layers' backwards: work.recompute_groups)
            for dim, n in (shards if reduce_now and i == last_of[u] else ()):
                rs = _comm(low, prog, r, dim, low.group_of(r, dim), ("RS grads", stage, mb, str(u), dim),
                           n * low.reduce_bytes, op="reduce_scatter", stream="dp",
                           deps=(prev,), name=f"RS {'expert ' if dim == 'edp' else ''}grads", mb=mb, phase=kind,
                           stage=q, layer=layer)
                low.grad_tasks.setdefault(r, []).append(rs)
                low.stage_grads.setdefault((r, stage), []).append(rs)
                low.sync.setdefault(r, []).append(rs)
                if low.n_replicas > 1 and mb == low.final_mb[stage]:
                    # hybrid sharding: the unit's shard all-reduced over its replicas once a step
                    rk = low.mesh.replica_group(dim)
                    ar = _comm(low, prog, r, rk, low.group_of(r, rk), ("replica shard", stage, mb, str(u), dim),
                               n * low.reduce_bytes / low.grad_shards[0 if dim == "dp" else 1], stream="dp",
                               deps=(rs,),
                               name=f"AR {'expert ' if dim == 'edp' else ''}grads shard (replicas)", mb=mb,
                               phase=kind, stage=q, layer=layer)
                    low.grad_tasks[r].append(ar)
                    low.stage_grads[(r, stage)].append(ar)
                    low.sync[r].append(ar)
        # the turn of another chain of the chunk comes before this block's post communication
        # is issued: the other block's pre communication goes first on the stream they share,
        # and runs while this block computes (a gather queued behind a reduce-scatter that
        # waits for this compute would keep the other chain's compute waiting for both). A
        # chunk's chain keeps the stream where it would wait on no communication: the other
        # chain's compute is what hides this one's communication, so the chains take turns
        # where a communication stands between two blocks (DeepSeek-V3's attention and router
        # run on, and its dispatch runs beside the other chunk's experts); under ZeRO-3's
        # gathers by unit, which a block may wait on outside its plan, every block is a turn
        if not (chunk and not post and not overlap and not by_unit and i + 1 < len(plan) and not plan[i + 1][2]):
            yield
        for j, spec in enumerate(post):
            prev = _add_comm(prog, r, spec, (kind, stage, mb, i, "post", j), (prev,), mb, kind, q, layer)
    if zero3 and kind == "F" and gather and units:
        low.held[r] = (part, mb, units[-1])
    return prev


def _offload_turn(prog: Program, low: Lowering, r: int, kind: str, layer: int, acts: dict, moved: dict,
                  window: int, before: tuple, mb: int, q: int) -> tuple:
    """Activation offload where a layer's first block of an action begins (Transformer
    Engine's synchronisation for the first N of L layers offloaded, window = L - N): the tasks
    that block also waits for. A forward of layer w + i waits for layer i's copy down (at most
    w layers resident); a backward of layer w - 1 + i starts layer i's copy up (``before``: what
    the block waits for already), and a backward of layer i waits for its copy up::

        F  compute  [L0][L1][L2][L3]          B  compute  [L3][L2][L1][L0]
           d2h         [L0][L1]                  h2d         [L1]  [L0]      (L 4, N 2, w 2)
    """
    out: tuple = ()
    if kind == "F":
        if layer - window in moved:
            out = (moved[layer - window],)
        return out
    i = layer - (window - 1)
    if i in acts and i not in moved:
        moved[i] = prog.add(rank=r, stream="h2d", name="activations from host", kind="offload", duration_s=acts[i][0],
                            deps=before, mb=mb, phase=kind, stage=q, layer=i, size_bytes=acts[i][1]).tid
    if layer in acts:
        out = (moved[layer],)
    return out


def _gathers_after_step(low: Lowering, kind: str, stage: int, mb: int) -> bool:
    """Whether an action gathers ZeRO-1/2's overlapped parameters: the step before updated
    them, and each part's first forward gathers them unit by unit, the first at once
    (Megatron dispatches a bucket's all-gather as the bucket before it starts its forward, and
    waits for it before its own). Such an action is made by :func:`_blocks`, never from a
    template."""
    return low.overlap_param_gather and kind == "F" and mb == low.first_mb.get(stage)


def _keeps_block_tids(low: Lowering, kind: str, stage: int, mb: int) -> bool:
    """Whether an action keeps its blocks' compute task ids in ``low.bwd_tid``: those that
    dp_grad_pass reduces after (grad_kind on a stage's final microbatch; every one under ZeRO-2)."""
    return kind == low.grad_kind and (low.zero == 2 or mb == low.final_mb[stage])


def _block_plan(low: Lowering, r: int, kind: str, blocks) -> list[tuple]:
    """Per block of ``blocks`` as action ``kind`` runs them on rank ``r``: (block, compute task
    name, its pre, overlap and post communications as :func:`_comm_spec` tuples). The same for every
    microbatch, so worked out once: a step lowers the same blocks hundreds of times."""
    key = (r, kind, id(blocks))
    plan = low.block_plans.get(key)
    if plan is None:
        def specs(comms, name) -> tuple:
            return tuple(_comm_spec(low, c.dim, low.group_of(r, c.dim), c.size_bytes, c.op, None,
                                    f"{kind} {COMM_SHORT[c.op]} {c.label or name}", None, c.load) for c in comms)
        # what runs beside a weight gradient (work.tp_overlapped_backward) reduces the input
        # gradient, the dgrad, before it: named for that ("B AR attn dgrad"), not the wgrad
        plan = low.block_plans[key] = [(blk, f"{kind} {blk.name}", specs(blk.pre, blk.name),
                                        specs(blk.overlap, blk.name.removesuffix(" wgrad") + " dgrad"
                                              if blk.name.endswith(" wgrad") else blk.name),
                                        specs(blk.post, blk.name)) for blk in blocks]
    return plan


def _run_chains(*chains) -> list[int]:
    """Run block generators round-robin, one turn of each in turn (a block, or the blocks
    :func:`_blocks` joins); their last task ids."""
    if len(chains) == 1:  # most actions: nothing to interleave with
        chain = chains[0]
        try:
            while True:
                next(chain)
        except StopIteration as stop:
            return [stop.value]
    ends: list = [None] * len(chains)
    live = list(range(len(chains)))
    while live:
        for i in list(live):
            try:
                next(chains[i])
            except StopIteration as stop:
                ends[i] = stop.value
                live.remove(i)
    return ends


def _single_action(prog: Program, low: Lowering, r: int, a: Action, route: tuple, deps: list[int],
                   got: int = -1) -> int:
    """One action alone (nothing interleaved) on rank ``r`` (``route``: :func:`_route`); its
    last task id. The first time a rank runs these blocks with this many inputs, :func:`_blocks`
    makes the tasks and an :class:`ActionTemplate` is read off them (and checked by making them
    again from it); every later time they are made from the template. ZeRO-3's gathers and
    reductions depend on the microbatch and on earlier actions: those actions always go
    through :func:`_blocks`.

    ``got``: the place in ``deps`` of a send whose pieces this rank gathers (:func:`_inputs`),
    -1 where none. The gather is then the first task of the action's run, its inputs the send
    and the rank's last action, so that a template makes it too (the engine runs it inside the
    run's segment, the analysis reads it off the template)::

        inputs  [... send ..., wait ..., last action ...]
        run     [AG over TP] -> [blocks ...]          (the gather where the send stood)
    """
    blocks = route[0]
    last = () if got < 0 else low.last_task.get(r, ())
    inputs = [*deps, *last] if last else deps

    def made() -> int:  # the tasks made here, the gather first
        d = deps if got < 0 else [*deps[:got], _received(prog, low, r, a.kind, a.stage, route[1], a.mb, deps[got]),
                                  *deps[got + 1:]]
        return _run_chains(_blocks(prog, low, r, a, blocks, d))[0]

    if (low.zero == 3 and low.n_grad > 1) or not low.use_templates or _gathers_after_step(low, a.kind, a.stage, a.mb):
        return made()
    key = _template_key(r, a.kind, a.stage, blocks, inputs, got, last)
    tmpl = low.templates.get(key)
    tasks = prog.items
    first = len(tasks)
    if tmpl is None:
        end = made()
        tmpl = low.templates[key] = _template_of(tasks, first, inputs, a.mb) or False
        if tmpl:
            prog.runs.append((r, first, len(tasks), tmpl))
        return end
    if not tmpl:
        return made()
    if len(inputs) != tmpl.inputs:
        raise ValueError(f"a template of {tmpl.inputs} inputs made with {len(inputs)}")
    # its tasks are made only if asked for (Program.task): the engine and the analysis read
    # the run off its template, its rank, microbatch, inputs and ids
    last = prog.defer_run(r, tmpl, a.mb, inputs)
    if _keeps_block_tids(low, a.kind, a.stage, a.mb):
        for i, rel in tmpl.computes:
            low.bwd_tid[(r, a.stage, a.mb, i)] = first + rel
    if tmpl.last_compute >= 0:
        low.last_compute[r] = first + tmpl.last_compute
    return last


def _template_key(r: int, kind: str, stage: int, blocks, inputs, got: int = -1, last: tuple = ()) -> tuple:
    """The key of the template an action's run is made from: its rank, kind, stage, blocks
    and count of inputs; where it gathers its input (``got`` >= 0, :func:`_single_action`),
    also where the send stands and where each task of the rank's last action ``last`` (the
    inputs' tail) first stands among them: it can be one of the action's own inputs, and a
    template names each input by its first place, so it holds only where the same coincide."""
    if got < 0:
        return r, kind, stage, id(blocks), len(inputs)
    return r, kind, stage, id(blocks), len(inputs), got, tuple(map(inputs.index, last))


def _make(add, tmpl: ActionTemplate, r: int, mb: int, deps, tid: int) -> None:
    """Add (``add``) the tasks of ``tmpl`` for microbatch ``mb`` of rank ``r`` with inputs
    ``deps``, ids from ``tid`` on (``Program.maker``; :func:`_template_of`'s check): by the
    template's own written-out function once it has one (:func:`_maker`), else task by task
    from its protos."""
    straight = tmpl.straight
    if straight is None:
        straight = tmpl.straight = _maker(tmpl)
    made = straight.fn or straight.ready()
    if made is not None:
        made(add, r, mb, deps, tid)
        return
    refs = list(deps)  # what the dependency codes name: the inputs, then the tasks' ids as made
    add_ref = refs.append
    for spec, stream, name, kind, dur, code, phase, stage, layer, flops, model_flops, size in tmpl.protos:
        add_ref(tid)  # each id one int object, shared by the task and the deps naming it
        d = (refs[code[0]],) if len(code) == 1 else tuple(map(refs.__getitem__, code))
        if spec is None:
            # positional, in Task's field order
            add(Task(tid, r, stream, name, kind, dur, None, d, mb, phase, stage, layer, flops, model_flops, size))
        else:
            op, size, group, twins, members, channel, orbit, head, tail, recv, load = spec
            c = Comm(op, size, group, twins, members, (channel, orbit, (*head, mb, *tail)), recv, load)
            add(Task(tid, r, stream, name, kind, 0.0, c, d, mb, phase, stage, layer, 0.0, 0.0))
        tid += 1


def _maker(tmpl: ActionTemplate) -> Straight:
    """The function that appends ``tmpl``'s tasks as :func:`_make`'s loop does, written
    out task by task once the template has been used enough (:mod:`clustersim.codegen`)::

        def made(add, r, mb, inputs, tid):
            i0, i1, ... = inputs
            x0 = tid                          # each id one int object, shared by the task
            add(Task(x0, r, S0, N0, ..., (i0,), mb, ...))     # and the deps naming it
            x1 = x0 + 1
            add(Task(x1, r, S1, N1, ..., Comm(..., (C1, O1, (*H1, mb, *T1)), ...), (x0, i1), mb, ...))
            ...
    """
    def prepare() -> tuple[tuple, list]:  # (structure, values), read after a few uses
        shape = (tmpl.inputs, tuple((spec is not None, code) for spec, _, _, _, _, code, *_ in tmpl.protos))
        cells: list = []
        for spec, stream, name, kind, dur, _, phase, stage, layer, flops, model_flops, size in tmpl.protos:
            cells += (stream, name, kind, phase, stage, layer)
            cells += (dur, flops, model_flops, size) if spec is None else spec
        return shape, cells

    return Straight("template", prepare, _write_maker, {"Task": Task, "Comm": Comm})


def _write_maker(inputs: int, shape: tuple) -> tuple[list[str], str, list[str]]:
    """:func:`_maker`'s function for one structure, as source (cells, signature, body)."""
    ref = [f"i{j}" for j in range(inputs)] + [f"x{k}" for k in range(len(shape))]
    body = [f"{', '.join(ref[:inputs])}, = inputs"] if inputs else []
    cells: list[str] = []
    for k, (comm, code) in enumerate(shape):
        own = [f"{f}{k}" for f in ("S", "N", "K", "P", "G", "Y")]
        body.append("x0 = tid" if k == 0 else f"x{k} = x{k - 1} + 1")
        d = f"({ref[code[0]]},)" if len(code) == 1 else f"({', '.join(ref[c] for c in code)})"
        s, n, kind, phase, stage, layer = own
        if not comm:
            cells += own + [f"D{k}", f"FL{k}", f"MF{k}", f"SB{k}"]
            body.append(f"add(Task(x{k}, r, {s}, {n}, {kind}, D{k}, None, {d}, mb, {phase}, {stage}, {layer}, "
                        f"FL{k}, MF{k}, SB{k}))")
        else:  # spec: (op, size, group, twins, members, channel, orbit, head, tail, recv, load)
            spec = [f"{f}{k}" for f in ("OP", "SZ", "GR", "TW", "ME", "CH", "OR", "H", "T", "RC", "LD")]
            cells += own + spec
            op, size, group, twins, members, channel, orbit, head, tail, recv, load = spec
            body.append(f"add(Task(x{k}, r, {s}, {n}, {kind}, 0.0, Comm({op}, {size}, {group}, {twins}, {members}, "
                        f"({channel}, {orbit}, (*{head}, mb, *{tail})), {recv}, {load}), {d}, mb, {phase}, {stage}, "
                        f"{layer}, 0.0, 0.0))")
    return cells, "made(add, r, mb, inputs, tid)", body


def _template_of(tasks: list[Task], first: int, deps, mb: int) -> ActionTemplate | None:
    """The template of the action just made (tasks ``first`` on, for microbatch ``mb`` with
    inputs ``deps``), or None when its tasks cannot be told apart from the microbatch and
    the inputs alone. Checked: made again from the template, the tasks are equal."""
    made = tasks[first:]
    if not made:
        return None
    end = len(tasks)
    where = {d: j for j, d in reversed(list(enumerate(deps)))}  # first position of each input
    protos, computes = [], []
    for k, t in enumerate(made):
        code = []
        for d in t.deps:
            if first <= d < end:
                code.append(len(deps) + d - first)
            elif d in where:
                code.append(where[d])
            else:
                return None  # reads a task made elsewhere that the inputs do not name
        c = t.comm
        if c is None:
            spec = None
            if t.kind == "compute":  # (not an offload copy, which has no communication either)
                computes.append((len(computes), k))
        else:
            channel, orbit, tag = c.key
            if not isinstance(tag, tuple) or len(tag) < 3 or tag[2] != mb:  # _blocks: (kind, stage, mb, ...)
                return None
            spec = (c.op, c.size_bytes, c.group, c.twins, c.members, channel, orbit, tag[:2], tag[3:],
                    c.recv_rank, c.load)
        if t.mb != mb:
            return None
        protos.append((spec, t.stream, t.name, t.kind, t.duration_s, tuple(code), t.phase, t.stage, t.layer,
                       t.flops, t.model_flops, t.size_bytes))
    tmpl = ActionTemplate(tuple(protos), tuple(computes), computes[-1][1] if computes else -1, len(deps))
    again: list[Task] = []
    _make(again.append, tmpl, made[0].rank, mb, deps, first)
    for t, u in zip(made, again):
        if _task_fields(t) != _task_fields(u) or (t.comm is None) != (u.comm is None) or (
                t.comm is not None and _comm_fields(t.comm) != _comm_fields(u.comm)):
            return None
    return tmpl


# a task's fields but its communication, and a communication's: what _template_of compares
_task_fields = attrgetter(*(f.name for f in fields(Task) if f.name != "comm"))
_comm_fields = attrgetter(*(f.name for f in fields(Comm)))


def units_in_time_order(s: PipelineSchedule) -> list[tuple[int, tuple[Action, ...]]]:
    """(pipeline rank, issue unit) of all ranks, by unit-time start, then rank.

    A producer starts before its consumer (it ends no later than the consumer starts, and
    lasts > 0), so walking in this order creates every send before the task that waits for it.
    For GPipe and 1F1B this is the slot-by-slot, rank-by-rank walk of the grid.
    """
    return units_by_start(s)


def _route(low: Lowering, r: int, a: Action) -> tuple:
    """Action ``a``'s blocks on rank ``r``, where its input comes from and where its output
    goes: the same for every microbatch that takes the same path through the stages, so
    worked out once per path (a step lowers the same action hundreds of times)::

        (blocks, input stage or None, that stage's rank (-1: this one), output rank (-1: none
         or this one), the send's communication spec or None)

    F takes ``prev_stage``'s output and sends to ``next_stage``; B the reverse; W neither."""
    kind, stage, mb = a.kind, a.stage, a.mb
    s = low.schedule
    if kind == "F":
        src, dst_stage = s.prev_stage(stage, mb), s.next_stage(stage, mb)
    elif kind == "B":
        src, dst_stage = s.next_stage(stage, mb), s.prev_stage(stage, mb)
    else:
        src = dst_stage = None
    fused = kind != "F" and low.fused(low.pp_of(r), stage, mb)
    key = (r, kind, stage, src, dst_stage, fused)
    got = low.routes.get(key)
    if got is None:
        part = low.part(stage)
        dst = -1 if dst_stage is None else low.stage_peer(r, dst_stage)
        spec = None
        if dst >= 0:  # one shape per direction, peer and part
            skey = ("send", r, dst, kind, part)
            spec = low.block_plans.get(skey)
            if spec is None:
                fwd = kind == "F"
                spec = low.block_plans[skey] = _comm_spec(
                    low, "pp", (r, dst), low.work[part].pp_send_bytes, "send", "pp_fwd_send" if fwd else "pp_bwd_send",
                    "send act" if fwd else "send grad", f"pp {kind}")
        got = low.routes[key] = (low.work_of(r, part).blocks(kind, low.split, fused), src,
                                 -1 if src is None else low.stage_peer(r, src), dst, spec)
    return got


def _input_deps(prog: Program, low: Lowering, r: int, a: Action, route: tuple) -> list[int]:
    """What action ``a`` on rank ``r`` waits for (the schedule's dependencies, as tasks;
    ``route``: :func:`_route`)::

        F(k, mb)  after the send of F(prev_stage, mb)     (or that F's end, on the same rank)
        B(k, mb)  after F(k, mb), and the send of B(next_stage, mb)  (or that B's end)
        W(k, mb)  after B(k, mb)
    """
    return _inputs(prog, low, r, a, route)[0]


def _inputs(prog: Program, low: Lowering, r: int, a: Action, route: tuple,
            gather: bool = True) -> tuple[list[int], int]:
    """(:func:`_input_deps`, the place in it of a send whose pieces the receiver gathers, -1
    where none): without ``gather``, that send stands there and the gather is the caller's to
    make (:func:`_single_action`, which makes it the first task of the action's run)."""
    kind, stage, mb = a.kind, a.stage, a.mb
    if kind == "W":
        return list(low.done[("B", r, stage, mb)]), -1
    deps = [] if kind == "F" else list(low.done[("F", r, stage, mb)])
    _, src, peer, _, _ = route
    got = -1
    if src is not None:
        if peer < 0:  # same rank: no send, wait for the producer itself
            deps += low.done[(kind, r, src, mb)]
        elif not gather and low.work[low.part(stage)].pp_gather_bytes:
            got = len(deps)
            deps.append(low.sent[(kind, peer, src, mb)])
        else:
            deps.append(_received(prog, low, r, kind, stage, src, mb, low.sent[(kind, peer, src, mb)]))
    return deps, got


def _received(prog: Program, low: Lowering, r: int, kind: str, stage: int, src: int, mb: int, sent: int) -> int:
    """The task an action of ``kind`` on rank ``r`` waits for to have its input from stage
    ``src``: the send itself, or where the sends are scattered (``pp_gather_bytes``), the
    all-gather over ``r``'s TP group that puts the pieces together, after the send (Megatron-LM
    2021, p2p_communication: ``split_tensor_into_1d_equal_chunks`` on the sender,
    ``gather_split_1d_tensor`` on the receiver; Narayanan et al. 2021, section 4.1). The
    receiver gathers once its previous action is done too, where its blocking receive is
    called (Megatron-LM's 1F1B: ``send_forward_recv_backward`` between the two actions), so
    the gather never runs beside that action's own TP collectives::

        stage k-1, TP rank i   [F] [send 1/t]
        stage k,   TP rank i   [B   ]     [AG over TP, t x 1/t] [F]
    """
    size = low.work[low.part(stage)].pp_gather_bytes
    if not size:
        return sent
    spec = low.block_plans.get(("gather", r, kind))
    if spec is None:
        # TP's group, channel and stream, so TP's collectives and these share their links as one
        # channel that never overlaps itself (timed in closed form where TP's are); counted as pp
        spec = _comm_spec(low, "tp", low.group_of(r, "tp"), size, "all_gather", None,
                          "F AG act" if kind == "F" else "B AG grad", None)
        spec = low.block_plans[("gather", r, kind)] = spec[:9] + ("pp",) + spec[10:]
    # (the microbatch third in the tag, as in every communication a template makes: _template_of)
    return _add_comm(prog, r, spec, ("pp gather", kind, mb, src), (sent, *low.last_task.get(r, ())), mb, kind,
                     low.pp_of(r))


def _send_output(prog: Program, low: Lowering, r: int, a: Action, done: tuple[int, ...], route: tuple) -> None:
    """After F, send the activation to ``next_stage``'s rank; after B, the gradient to
    ``prev_stage``'s (none for W, the last stage's F, the first's B, or a hand-over on the
    same rank); ``done``: the tasks that end ``a``, ``route``: :func:`_route`."""
    spec = route[4]
    if spec is not None:
        kind, stage, mb = a.kind, a.stage, a.mb
        low.sent[(kind, r, stage, mb)] = _add_comm(prog, r, spec, (kind, stage, mb), done, mb, kind, low.pp_of(r))


def _release_after_w(prog: Program, low: Lowering, r: int, w: Action, done: tuple[int, ...]) -> None:
    """Where ``w`` ends a full backward written B then W (its B's route held in
    ``low.held_outputs``), the B's output goes now: its send, or on the same rank its hand-over
    (``low.done``), after ``done``, as DeepSeek's DualPipe sends a backward's gradient once the
    backward has run whole, weight gradients included (schedule.core's ``_plan``)::

        rank r       [B (k, mb)][W (k, mb)][send grad]
        rank r - 1                                   [B (k-1, mb)] ...
    """
    route = low.held_outputs.pop((r, w.stage, w.mb), None)
    if route is not None:
        low.done[("B", r, w.stage, w.mb)] = done
        _send_output(prog, low, r, Action(w.stage, "B", w.mb), done, route)


def _lower_unit(prog: Program, low: Lowering, r: int, unit: tuple[Action, ...]) -> None:
    """One issue unit on rank ``r``: an action, or an overlapped F&B chunk.

    A chunk runs on the one compute stream as the schedule layer defines it: it starts when
    the inputs of both its F and its B have arrived, F and B take turns (one's communication
    overlaps the other's compute), then B's W, and every output is released (sent) when the
    whole chunk ends::

        compute  [F b0][B b0][F b1][B b1] ... [W ...]
        tp             [AR F0][AR B0] ...
        pp                                        [send act][send grad]

    A turn ends where a communication stands between a chain's block and its next (the
    block's own, or the next one's before it); blocks with none between them run in one turn.
    So DeepSeek-V3's MoE layers (TP1) pair as its report's Fig. 4 does::

        compute  [F attn, router][B experts  ][F experts   ][B router, attn][F attn, router] ...
        ep                       [F dispatch ][B dispatch' ][F combine     ][B combine'    ]
                                                     (': its gradient)
    """
    wait = low.sync.pop(r, [])  # the reductions of the rank's last gradient action (ZeRO-2/3)
    if len(unit) == 1:
        a = unit[0]
        route = _route(low, r, a)
        deps, got = _inputs(prog, low, r, a, route, gather=False)
        done = (_single_action(prog, low, r, a, route, deps + wait, got),)
        low.done[(a.kind, r, a.stage, a.mb)] = done
        if a.kind == "B" and low.fused(low.pp_of(r), a.stage, a.mb):
            low.held_outputs[(r, a.stage, a.mb)] = route  # sent when its W ends
        else:
            _send_output(prog, low, r, a, done, route)
            if a.kind == "W":
                _release_after_w(prog, low, r, a, done)
        low.last_task[r] = done
        _zero2_reduce(prog, low, r, a)
        return
    paths = [_route(low, r, a) for a in unit]
    f, b = unit[0], unit[1]
    b_inputs = _input_deps(prog, low, r, b, paths[1])
    done = tuple(_run_chains(_blocks(prog, low, r, f, paths[0][0],
                                     _input_deps(prog, low, r, f, paths[0]) + b_inputs + wait, chunk=True),
                             _blocks(prog, low, r, b, paths[1][0], b_inputs, chunk=True)))
    if len(unit) == 3:  # the chunk's backward is a full backward: its W right after
        w = unit[2]
        done = tuple(_run_chains(_blocks(prog, low, r, w, paths[2][0], done, chunk=True)))
    for a in unit:  # released together when the chunk ends
        low.done[(a.kind, r, a.stage, a.mb)] = done
    for a, route in zip((f, b), paths):
        _send_output(prog, low, r, a, done, route)
    low.last_task[r] = done
    for a in unit:
        _zero2_reduce(prog, low, r, a)


def chunk_gpu(sc: Scenario) -> GpuSpec:
    """The scenario's GPU as its ops are timed: without its GEMM fits under
    ``simulation.gemm_efficiency: flat``, its FP8 GEMMs blockwise scaling's under
    ``fp8_recipe: blockwise``, and with the share of its SMs an overlapped F&B chunk's compute gets
    (``GpuSpec.chunk_sm_share``) where DeepEP dispatches: its kernels hold
    ``model.moe.deepep_sms`` SMs (20 by default, as DeepEP's ``Buffer.num_sms`` and
    Megatron-LM's ``--moe-deepep-num-sms``). Under DualPipe the SMs are partitioned through
    the overlapped chunk, F, B and the W that follows them (DeepSeek-V3 report, Sec 3.2.1-3.2.2,
    Fig. 4, and Sec 3.5.1: "20 out of the 132 SMs" for communication), the GEMMs launched on
    the rest (DeepGEMM's ``set_num_sms``) whether a dispatch is in flight at that instant or
    not::

        chunk_sm_share = (sms - deepep_sms) / sms        H800: (132 - 20) / 132 = 0.848

    Outside a chunk the dispatch waits on the compute or the compute on it: the kernels take
    nothing from a GEMM (an approximation; NCCL's kernels, which also hold SMs while they
    overlap compute, are not modelled so)."""
    gpu, m = sc.cluster.gpu, sc.model.moe
    if sc.cfg.simulation.gemm_efficiency == "flat":  # every GEMM at matmul_efficiency
        gpu = replace(gpu, gemm_bf16=None, gemm_fp8=None)
    elif sc.training.fp8_recipe == "blockwise" and sc.training.precision == "fp8":  # DeepGEMM's kernels
        gpu = replace(gpu, gemm_fp8=gpu.gemm_fp8_blockwise)
    if m is None or m.dispatcher != "deepep" or not m.deepep_sms or not gpu.sms:
        return gpu
    return replace(gpu, chunk_sm_share=(gpu.sms - m.deepep_sms) / gpu.sms)


def pipeline_pass(prog: Program, low: Lowering, units: list | None = None, start: int = 0) -> Program:
    """Forward, backward and weight-gradient blocks per schedule action, with TP communication
    and PP sends, for every simulated rank.

    Units are created in unit-time start order (:func:`units_in_time_order`), so a receiver's
    dependency on its sender's send task always refers to a task that already exists.
    ``units``, ``start``: that order and where to start in it (a lowering resumed where a
    longer step's parted from it: :func:`_resumed`). With ``low.shorter``, the state where
    the two steps' units part is kept (:func:`_parting_at`).
    """
    on_pp: dict[int, list[int]] = {}  # pipeline rank -> simulated ranks there
    for r in low.sym.ranks:
        on_pp.setdefault(low.pp_of(r), []).append(r)
    if units is None:
        units = units_in_time_order(low.schedule)
    part_at, short_units = _parting_at(low, units) if low.shorter is not None else (-1, None)
    again = _Again(prog, low) if low.use_templates and not (low.zero == 3 and low.n_grad > 1) else None
    for i in range(start, len(units)):
        if i == part_at:
            low.resume = _Parting.kept(prog, low, i, short_units)
        q, unit = units[i]
        ranks = on_pp.get(q, ())
        if again is not None and len(unit) == 1:
            again.lower(unit[0], q, ranks)
        else:
            for r in ranks:
                _lower_unit(prog, low, r, unit)
    return prog


class _Again:
    """:func:`_lower_unit` for a single action, with one call per action rather than six:
    where the action's route and template were worked out before (every action but the first
    of its kind on its rank, in a step of hundreds of microbatches), its tasks are left to be
    made from the template (``Program.defer_run``) and its send added, as :func:`_route`,
    :func:`_input_deps`, :func:`_single_action` and :func:`_send_output` do one after the
    other; else those make it. Megatron-1T lowers 65,536 actions: its whole step's lowering
    took 0.78 s with the six calls, 0.68 s with this (docs/performance-history.md, entry 27)."""

    def __init__(self, prog: Program, low: Lowering):
        self.prog, self.low = prog, low
        s = low.schedule
        self.prev, self.next = s._prev.get, s._next.get

    def lower(self, a: Action, q: int, ranks) -> None:
        """Action ``a`` of pipeline rank ``q`` on each of its simulated ``ranks``."""
        low, prog = self.low, self.prog
        kind, stage, mb = a.kind, a.stage, a.mb
        if kind == "F":
            src, dst = self.prev((stage, mb)), self.next((stage, mb))
        elif kind == "B":
            src, dst = self.next((stage, mb)), self.prev((stage, mb))
        else:
            src = dst = None
        keeps = _keeps_block_tids(low, kind, stage, mb)
        done_of = low.done
        sync = low.sync
        fused = kind != "F" and low.fused(q, stage, mb)
        gathers = src is not None and low.work[low.part(stage)].pp_gather_bytes > 0
        for r in ranks:
            route = low.routes.get((r, kind, stage, src, dst, fused))
            if route is not None:  # its inputs, as _input_deps (and _lower_unit's wait)
                blocks, _, peer, _, spec = route
                got = -1  # where deps holds a send whose pieces this rank gathers (_inputs)
                if kind == "W":
                    deps = done_of[("B", r, stage, mb)]
                else:
                    deps = () if kind == "F" else done_of[("F", r, stage, mb)]
                    if src is not None:
                        if peer < 0:
                            deps += done_of[(kind, r, src, mb)]
                        else:
                            if gathers:
                                got = len(deps)
                            deps += (low.sent[(kind, peer, src, mb)],)
                if r in sync:
                    deps = (*deps, *sync[r])
                last = () if got < 0 else low.last_task.get(r, ())
                if last:  # the gather's inputs too: the run's first task (_single_action)
                    deps = (*deps, *last)
                tmpl = low.templates.get(_template_key(r, kind, stage, blocks, deps, got, last))
            if route is None or not tmpl:  # a first time: worked out there
                _lower_unit(prog, low, r, (a,))
                continue
            sync.pop(r, None)
            first = len(prog.items)
            last = prog.defer_run(r, tmpl, mb, deps)
            if keeps:
                for i, rel in tmpl.computes:
                    low.bwd_tid[(r, stage, mb, i)] = first + rel
            if tmpl.last_compute >= 0:
                low.last_compute[r] = first + tmpl.last_compute
            done = done_of[(kind, r, stage, mb)] = (last,)
            if fused:  # a full backward's halves: B's output goes when its W ends
                if kind == "B":
                    low.held_outputs[(r, stage, mb)] = route
                else:
                    _release_after_w(prog, low, r, a, done)
            elif spec is not None:
                low.sent[(kind, r, stage, mb)] = _add_comm(prog, r, spec, (kind, stage, mb), done, mb, kind, q)
            low.last_task[r] = done
            if keeps and low.zero == 2:
                _zero2_reduce(prog, low, r, a)


# what pipeline_pass writes as it goes and later units read: kept where two steps part; the
# values of the second ones are lists it appends to (ZeRO-3's reductions), copied too
_STATE = ("bwd_tid", "last_compute", "last_task", "done", "sent", "templates", "routes", "bucket_tid", "held",
          "held_outputs")
_LIST_STATE = ("grad_tasks", "stage_grads", "sync")


@dataclass(eq=False)
class _Parting:
    """A lowering's state after its first ``at`` units: those a shorter step's lowering shares
    with it, which resumes from here (:func:`_resumed`)::

        whole step   [units 0 .. at-1 ........ | at ... (more microbatches)  ]
        shorter      [the same units, tasks    | at ... (its cool-down)      ]
                      copied, not lowered again

    Both lowerings make the same tasks with the same ids for the shared units: a unit's tasks
    depend only on the unit, the state the units before it left, and what both lowerings
    share (work, symmetry, communication specs, the schedule's stage paths)."""

    schedule: PipelineSchedule  # the shorter step's
    units: list  # its units in time order
    at: int
    items: list
    runs: list
    deferred: dict
    state: dict

    @classmethod
    def kept(cls, prog: Program, low: Lowering, at: int, units: list) -> _Parting:
        state = {name: dict(getattr(low, name)) for name in _STATE}
        state.update((name, {k: v[:] for k, v in getattr(low, name).items()}) for name in _LIST_STATE)
        return cls(low.shorter, units, at, prog.items[:], prog.runs[:], dict(prog.deferred), state)


def _parting_at(low: Lowering, units: list) -> tuple[int, list]:
    """(how many of ``units``, in order, the shorter step's lowering makes alike, its units):
    up to the first unit that differs, or that holds an action whose lowering depends on the
    step's length (a stage's final gradient action: its block ids are kept for DP, and under
    ZeRO-3 kept gathered it reduces then). -1 where nothing is shared."""
    short_units = units_in_time_order(low.shorter)
    first, last = _first_and_final_mb(low.shorter, low.grad_kind)
    if first != low.first_mb:  # (ZeRO-3 kept gathered gathers at a stage's first forward)
        return -1, short_units
    final, grad_kind, at = low.final_mb, low.grad_kind, 0
    for (q, unit), (q2, unit2) in zip(units, short_units):
        if q != q2 or unit != unit2 or any(a.kind == grad_kind and a.mb in (final[a.stage], last[a.stage])
                                           for a in unit):
            break
        at += 1
    return (at if at > 0 else -1), short_units


def _first_and_final_mb(s: PipelineSchedule, grad_kind: str) -> tuple[dict[int, int], dict[int, int]]:
    """Per virtual stage, the microbatch of its first forward and of its last ``grad_kind``
    action, in issue order (``Lowering.first_mb``, ``Lowering.final_mb``)."""
    first: dict[int, int] = {}
    final: dict[int, int] = {}
    for acts in s:
        for a in acts:
            if a.kind == "F":
                first.setdefault(a.stage, a.mb)
            elif a.kind == grad_kind:
                final[a.stage] = a.mb
    return first, final


def _resumed(prog: Program, low: Lowering, kept: _Parting) -> tuple[list, int]:
    """Put the state ``kept`` into ``prog`` and ``low`` (the shorter step's): (its units, the
    first one still to lower)."""
    prog.items[:] = kept.items
    prog.runs[:] = kept.runs
    prog.deferred.update(kept.deferred)
    for name, value in kept.state.items():
        setattr(low, name, value)
    return kept.units, kept.at


def _grad_final_actions(low: Lowering, q: int) -> list[Action]:
    """Actions of pipeline rank ``q`` that make its stages' gradients final, in issue order:
    the final W (or B) of each stage (ZeRO-2's reductions after every one are made in the
    pipeline pass: :func:`_zero2_reduce`)."""
    return [a for a in low.schedule[q] if a.kind == low.grad_kind and a.mb == low.final_mb[a.stage]]


def grad_buckets(blocks, bucket_params: float, attr: str = "params"):
    """(index of the bucket's last block, its parameters): blocks added in order until a
    bucket holds at least ``bucket_params`` or the blocks run out; a block is never split.
    ``attr`` picks which parameters: "params" (reduced over DP) or "expert_params" (over EDP)."""
    filled = 0.0
    for i, blk in enumerate(blocks):
        filled += getattr(blk, attr)
        if filled > 0 and (filled >= bucket_params or i == len(blocks) - 1):
            yield i, filled
            filled = 0.0


def _zero2_reduce(prog: Program, low: Lowering, r: int, a: Action) -> None:
    """Under ZeRO-2, the gradient buckets of rank ``r``'s action ``a`` reduce-scattered as
    soon as ``a`` is lowered (if it makes gradients final), for its next action to wait
    for: see :func:`_reduce_action`."""
    if low.zero == 2 and a.kind == low.grad_kind:
        low.sync.setdefault(r, []).extend(_reduce_action(prog, low, r, a, reduce=True, replicas=False))


def _reduce_action(prog: Program, low: Lowering, r: int, a: Action, *, reduce: bool, replicas: bool) -> list[int]:
    """The DP (and expert-DP) reductions of the gradients action ``a`` makes final on rank
    ``r``, bucket by bucket (``reduce``; else those made already, ``low.bucket_tid``), each
    followed by its all-reduce between the part's two holders (``replicas``, DualPipe, on the
    step's final microbatch of the stage); the reductions' ids.

    ZeRO-2 reduces after every microbatch, and the rank's next action waits for that (its
    first task depends on ``low.sync``), as DeepSpeed's ZeRO-2/3 and PyTorch FSDP wait for
    their reduce-scatters at the end of every backward call (the epilogue's stream
    synchronise; ``_post_backward_final_callback``'s ``wait_stream``)::

        compute  [B mb0 ...........][F mb1 ...
        dp                [RS b0][RS b1]|       the forward of mb1 waits for RS b1

    Without ``overlap_grad_reduce`` every bucket waits for the rank's last compute so far:
    the action's last block under ZeRO-2 (called right after the action is lowered), the
    step's last backward otherwise (Megatron-LM's ``finalize_model_grads`` after the whole
    forward-backward schedule; in 2021 its local DDP's ``allreduce_gradients``), where the
    part's gradients are one bucket (Megatron-LM sets ``bucket_size`` to None, its contiguous
    buffer reduced whole; :func:`lowering`)::

        compute  ... [B mb7 L1][B mb7 L0]|                         [optimizer]
        dp                                [AR grads bucket 0 .....]|
    """
    mesh = low.mesh
    op = "all_reduce" if low.zero == 0 else "reduce_scatter"
    shard, expert_shard = low.grad_shards
    q, part = low.pp_of(r), low.part(a.stage)
    dp_buckets = low.n_grad > 1 and low.zero < 3
    replicas = replicas and len(low.holders_of[part]) > 1 and low.zero < 3 and a.mb == low.final_mb[a.stage]
    out: list[int] = []
    if not (dp_buckets or replicas):
        return out
    tids = low.grad_tasks.setdefault(r, [])
    meta = dict(mb=a.mb, phase=low.grad_kind, stage=q)
    blocks = low.work[part].grad_blocks(low.split)
    # routed experts: E/ep on this rank, the same experts on every rank of its EDP group
    expert_reduce = low.zero < 3 and mesh.size(low.grad_dim("edp")) > 1
    for dim, kind, attr, share in (("dp", "dp", "params", shard), ("edp", "edp", "expert_params", expert_shard)):
        on = dp_buckets if dim == "dp" else expert_reduce
        what, label = ("bucket", "") if dim == "dp" else ("expert bucket", "expert ")
        for n, (i, params) in enumerate(grad_buckets(blocks, low.dp_bucket_params, attr)):
            dep = low.bwd_tid[(r, a.stage, a.mb, i)] if low.overlap_grad_reduce else low.last_compute[r]
            if on and reduce:
                dep = _comm(
                    low, prog, r, kind, low.group_of(r, kind), (what, a.stage, a.mb, n), params * low.reduce_bytes,
                    op=op, deps=(dep,), stream="dp", name=f"{COMM_SHORT[op]} {label}grads bucket {n}", **meta)
                tids.append(dep)
                out.append(dep)
                if dim == "dp":
                    low.stage_grads.setdefault((r, a.stage), []).append(dep)
                if low.n_replicas > 1 and a.mb == low.final_mb[a.stage]:
                    # hybrid sharding: the shard, accumulated over the step's microbatches,
                    # all-reduced over its replicas once, on the same stream (Megatron-LM's
                    # distributed-optimizer instances)
                    rk = low.mesh.replica_group(dim)
                    dep = _comm(low, prog, r, rk, low.group_of(r, rk), ("replica shard", dim, a.stage, n),
                                params * low.reduce_bytes / (shard if dim == "dp" else expert_shard), deps=(dep,),
                                stream="dp", name=f"AR {label}grads shard bucket {n} (replicas)", **meta)
                    tids.append(dep)
                    out.append(dep)
                low.bucket_tid[(r, a.stage, a.mb, dim, n)] = dep  # (what DualPipe's holders' reduction waits for)
            elif on:
                dep = low.bucket_tid[(r, a.stage, a.mb, dim, n)]
            if replicas:
                tids.append(_replica_allreduce(prog, low, r, part, (what, n), params / share, (dep,),
                                               f"AR part {part} {label}grads bucket {n} (replicas)", **meta))
    return out


def dp_grad_pass(prog: Program, low: Lowering) -> Program:
    """Gradient reduction over DP in buckets, each launched when its last gradient is final.

    Buckets fill in backward order (Li et al. 2020, "PyTorch Distributed", Sec 3.2.3)::

        compute  ... [W mlp L5][W attn L5][W mlp L4][W attn L4] ...
        dp                          [AR bucket 0 ]        [AR bucket 1] ...
        dp_replica_3                              [AR bucket 0]        [AR bucket 1]  (DualPipe)

    Gradients are final after the last W of a part (B without a split backward); a rank with
    several parts reduces each part's buckets after that part's final W, in issue order.
    ZeRO 0: all-reduce after the last microbatch. ZeRO-1: reduce-scatter after the last
    microbatch (each rank updates its shard). ZeRO-2: reduce-scatter after every microbatch,
    since only the shard of the gradients is kept, made in :func:`pipeline_pass` right after
    each action, whose rank's next action waits for them (:func:`_reduce_action`). ZeRO-3
    reduces per unit in :func:`pipeline_pass`, waited for likewise.

    A part held by two pipeline ranks (DualPipe: part j on ranks j and p-1-j) also sums its
    two copies' gradients: bucket by bucket, after the bucket's DP reduction (on the shard
    under ZeRO-1/2), an all-reduce between the holders on a stream of that part's own, so the
    two holders, which finish their parts in different orders, cannot wait on each other
    crosswise. Last, the tied embedding's all-reduce between the holders of the first and the
    last part.
    """
    shard, expert_shard = low.grad_shards
    for r in low.sym.ranks:
        q = low.pp_of(r)
        tids: list[int] = low.grad_tasks.setdefault(r, [])
        for a in _grad_final_actions(low, q):  # (ZeRO-2 reduced them in the pipeline pass already)
            _reduce_action(prog, low, r, a, reduce=low.zero < 2, replicas=True)
        if low.zero == 3:  # gradients were reduce-scattered per unit: sum the replicas' shards once
            for part in low.parts_of[q]:
                if len(low.holders_of[part]) < 2:
                    continue
                stages = [k for k in low.schedule.stages_of(q) if low.part(k) == part]
                deps = [t for k in stages for t in low.stage_grads.get((r, k), ())] or \
                    [t for k in stages for t in low.done[(low.grad_kind, r, k, low.final_mb[k])]]
                w = low.work[part]
                tids.append(_replica_allreduce(prog, low, r, part, ("all",),
                                               w.local_params / shard + w.local_expert_params / expert_shard,
                                               deps, f"AR part {part} grads (replicas)", phase=low.grad_kind, stage=q))
        if q in low.tied_pps:
            group = tuple(low.peer(r, p) for p in low.tied_pps)
            tids.append(_comm(low, prog, r, "emb", group, ("tied",), low.embedding_params * low.reduce_bytes,
                              stream="dp", deps=tuple(tids) or low.last_task[r],
                              name="AR tied embedding grads", phase="B", stage=q))
        low.last_task[r] = (tids[-1],) if tids else low.last_task[r]
        low.grad_tasks[r] = tids
    return prog


def _replica_allreduce(prog: Program, low: Lowering, r: int, part: int, tag: tuple, params: float, deps,
                       name: str, **meta) -> int:
    """All-reduce of ``params`` gradients of ``part`` between the pipeline ranks holding it."""
    group = tuple(low.peer(r, p) for p in low.holders_of[part])
    return _comm(low, prog, r, "rep", group, ("replica grads", part) + tag, params * low.reduce_bytes,
                 stream=f"dp_replica_{part}", channel=f"rep {part}", deps=deps, name=name, **meta)


def optimizer_pass(prog: Program, low: Lowering) -> Program:
    """One optimizer step per rank, over every part it holds, once all its gradients are reduced.

    Under ZeRO-1 and -2 each rank updates its shard, then the DP group all-gathers the
    updated 16-bit parameters (Megatron's distributed optimizer), or, with
    ``overlap_param_gather``, gathers them unit by unit in the next step's first forward
    (:func:`_blocks`: the step simulated is the steady one); ZeRO-3 keeps them sharded.
    DualPipe's two holders of a part both update it (same gradients, same result).

    With optimizer offload (``StageWork.offload``) the host steps a share of the shard, as
    Megatron-LM's HybridDeviceOptimizer does (:func:`_offloaded_step`).
    """
    for r in low.sym.ranks:
        q = low.pp_of(r)
        parts = low.parts_of[q]
        deps = tuple(low.grad_tasks[r]) or low.last_task[r]
        if low.optimizer_offload:
            opt = _offloaded_step(prog, low, r, q, parts, deps)
        else:
            opt = (prog.add(rank=r, stream="compute", name="optimizer step", kind="compute",
                            duration_s=sum_left(low.work[j].optimizer_s for j in parts), deps=deps, phase="opt",
                            stage=q).tid,)
        if low.zero in (1, 2) and not low.overlap_param_gather:
            # each shard's owners all-gather the updated 16-bit parameters: dense ones over
            # dp x cp, routed experts over their expert-DP group
            for dim, attr in (("dp", "local_params"), ("edp", "local_expert_params")):
                n = sum_left(getattr(low.work[j], attr) for j in parts)
                if n > 0 and low.mesh.size(low.grad_dim(dim)) > 1:
                    _comm(low, prog, r, dim, low.group_of(r, dim), ("AG params after step", dim), n * PARAM_BYTES,
                          op="all_gather", stream="dp", deps=opt,
                          name="AG expert params" if dim == "edp" else "AG params", phase="opt", stage=q)
    return prog


def _offloaded_step(prog: Program, low: Lowering, r: int, q: int, parts: tuple, deps: tuple) -> tuple:
    """Rank ``r``'s optimizer step with a share of each shard on the host (``StageWork.offload``:
    its dense and its routed experts' instances, each over every part ``r`` holds); the tasks
    the parameters' gathers wait for. Each instance's gradients are copied down, the CPU's Adam
    steps them, its weights are copied up, on streams of their own (kind ``offload``); the
    GPU's Adam over the share it keeps runs beside the CPU's, and each copy up waits for it
    (Megatron-LM's copy stream waits on the compute stream where that Adam is queued)::

        compute   [optimizer step]                         (the GPU's share)
        d2h      [grads to host]
        host                     [host optimizer step]
        h2d                                          [params from host] [AG params]

    Without ``overlap_offload_copies`` the copies are queued on the compute stream, so the
    GPU's Adam waits for the copy down; with it, the three pipeline one backward block's
    parameters at a time::

        d2h      [L0][L1][L2][L3]
        host         [ L0 ][ L1 ][ L2 ][ L3 ]
        h2d                [L0]  [L1]  [L2]  [L3]

    The routed experts' instance follows the dense one (Megatron-LM's ChainedOptimizer steps
    them in turn): its copies down once the dense one's host steps are done and, without the
    overlap, its copies up queued (one stream)."""
    offload = dict(rank=r, kind="offload", phase="opt", stage=q)
    overlap = low.overlap_offload_copies
    chains: dict[str, list] = {}
    for j in parts:  # (one instance a kind over every part, as the distributed optimizer's buffers)
        for c in low.work[j].offload:
            got = chains.setdefault(c.kind, [0.0, [], []])
            got[0] += c.gpu_s
            got[1] += c.pieces
            got[2] += c.piece_bytes
    after, ends = deps, []
    for kind, (gpu_s, pieces, sizes) in chains.items():
        x = "expert " if kind == "expert" else ""  # (as "AG expert params")
        # pipelined, a piece a backward block: numbered as they go, so that each can be told apart
        n = [f" block {k}" if len(pieces) > 1 else "" for k in range(len(pieces))]
        downs = [prog.add(stream="d2h", name=f"{x}grads to host{n[k]}", duration_s=d, deps=after, size_bytes=b,
                          **offload).tid for k, ((d, _, _), b) in enumerate(zip(pieces, sizes))]
        gpu = (prog.add(rank=r, stream="compute", name=f"{x}optimizer step", kind="compute", duration_s=gpu_s,
                        deps=after if overlap else (*after, downs[-1]), phase="opt", stage=q).tid,) if gpu_s else ()
        steps, ups = [], []
        for k, (down, (_, step_s, up_s), b) in enumerate(zip(downs, pieces, sizes)):
            steps.append(prog.add(stream="host", name=f"host {x}optimizer step{n[k]}", duration_s=step_s, deps=(down,),
                                  **offload).tid)
            ups.append(prog.add(stream="h2d", name=f"{x}params from host{n[k]}", duration_s=up_s, deps=(steps[-1], *gpu),
                                size_bytes=b, **offload).tid)
        after = (steps[-1],) if overlap else (ups[-1],)
        ends.append(ups[-1])
    return tuple(ends)


def lower(sc: Scenario, *, collapse: bool | None = None, templates: bool = True,
          like: Lowering | None = None, shorter: PipelineSchedule | None = None) -> tuple[Program, Lowering]:
    """Scenario -> Program for one training step (``templates=False``: every action made by
    :func:`_blocks`, without :class:`ActionTemplate`; the same tasks, more slowly). ``like``:
    the lowering of the same plan with other microbatches (``engine.repeat``'s shorter step),
    whose per-part work, symmetry classes (so its ``collapse``) and communication specs are
    reused as they are (none depends on the microbatches; its templates are not: a template's
    first run must be made in each program). ``shorter``: the schedule of such a shorter step
    to be lowered next with ``like`` this lowering: its units in common with this step's are
    not lowered again, their tasks are copied (:class:`_Parting`; Megatron-1T: 15,424 of the
    shorter step's 19,456 units)."""
    if like is not None:
        # every dict the passes or __post_init__ fill starts empty; the per-part work, the
        # symmetry (with its orbit caches), the settings and the communication specs carry over
        fresh = {f.name: {} for f in fields(Lowering)
                 if f.init and isinstance(getattr(like, f.name), dict) and f.name not in ("rank_work", "block_plans")}
        low = replace(like, schedule=sc.schedule, use_templates=templates, shorter=None, resume=None, **fresh)
        kept = like.resume
        if kept is not None and kept.schedule is sc.schedule and templates == like.use_templates:
            like.resume = None  # (its copies are this lowering's now)
            return run_passes(low, kept), low
        return run_passes(low), low
    low = sc.__dict__.pop(FLOOR_LOWERING, None)  # (one use: the passes fill it)
    if low is None or not templates or not (sc.cfg.simulation.collapse_symmetric if collapse is None else collapse):
        low = lowering(sc, collapse=collapse, templates=templates, shorter=shorter)
    else:
        low.shorter = shorter
    return run_passes(low), low


# where ``api.memory_floor`` leaves the lowering it read on its scenario: the one :func:`lower`
# would make first (collapsed, with templates; only the shorter step's schedule, which no
# field before the passes reads, is set then), so that a sweep's plan is not made twice
FLOOR_LOWERING = "_floor_lowering"


def lowering(sc: Scenario, *, collapse: bool | None = None, templates: bool = True,
             shorter: PipelineSchedule | None = None) -> Lowering:
    """The plan's lowering before its passes (:func:`lower`'s arguments): the per-part work,
    the symmetry classes, the schedule's parts per rank and the settings, no task yet; what
    is known of a step before it is lowered (``api.memory_floor`` reads it)."""
    mesh = sc.mesh
    cp_distinct, ep_distinct = sc.cfg.ranks_differ()
    collapse = sc.cfg.simulation.collapse_symmetric if collapse is None else collapse
    # a straggler or a fault (rank r runs on GPU r) splits the classes around it (Symmetry)
    sym = Symmetry(mesh, collapse, cp_distinct, ep_distinct, slow=dict(sc.cluster.gpu_slowdown),
                   faulty=sc.split_faults[0], straggler_mates=sc.straggler_mates if collapse else frozenset(),
                   gpus_per_node=sc.cluster.gpus_per_node, tiers=sc.cluster.pair_tiers,
                   pp_ring=sc.parallel.schedule == "interleaved", units=sc.cluster.gpu_units,
                   unit_split_ranks=sc.cfg.simulation.leaf_split_ranks, replicas=sc.splits_replicas,
                   shift_dims=shift_dims(sc.parallel), gpus_per_nic=sc.cluster.gpus_per_nic)
    gpu = chunk_gpu(sc)
    work = [stage_work(sc, j, gpu) for j in range(sc.n_parts)]
    rank_work = {(c, e): [stage_work(sc, j, gpu, c, e) for j in range(sc.n_parts)]
                 for c in range(mesh.cp if cp_distinct else 1)
                 for e in range(mesh.ep if ep_distinct else 1)} if cp_distinct or ep_distinct else {}
    return Lowering(
        mesh=mesh, schedule=sc.schedule, work=work, sym=sym, shorter=shorter,
        grad_bytes=GRAD_BYTES[sc.training.grad_dtype],
        optimizer_bytes=optimizer_bytes(sc.training.optimizer_moments_dtype),
        reduce_bytes=GRAD_BYTES[sc.training.reduced_grad_dtype],
        # without overlap, Megatron-LM sets its bucket size to infinity (ZeRO 0/1: one reduction of
        # each part's contiguous gradient buffer, dense and expert apart); ZeRO-2 keeps its buckets
        dp_bucket_params=sc.training.dp_bucket_params if sc.parallel.overlap_grad_reduce or sc.parallel.zero == 2
        else float("inf"),
        tied_embeddings=embedding_shared_with_last_part(sc.model),
        embedding_params=sc.model.vocab * sc.model.hidden / mesh.tp,
        zero=sc.parallel.zero, zero_prefetch_layers=sc.parallel.zero_prefetch_layers,
        zero3_keep_gathered=sc.parallel.zero3_keep_gathered, overlap_param_gather=sc.parallel.overlap_param_gather,
        overlap_grad_reduce=sc.parallel.overlap_grad_reduce, overlap_offload_copies=sc.training.overlap_offload_copies,
        optimizer_offload=sc.training.optimizer_offload, model_layers=sc.model.layers,
        rank_work=rank_work, use_templates=templates, routing=moe.routing(sc.model.moe),
    )


def group_dims(low: Lowering) -> dict[str, str]:
    """Each communication kind of the lowering -> the mesh group its communications run over
    (``Program.group_dims``): the group of :meth:`Lowering.group_of`, named as plan.mesh names
    it, so that DP's reductions say ``cp+dp`` (or a hybrid shard group, ``zs``); the pipeline's
    sends and the tied embedding's and a replicated part's all-reduces, whose groups are
    pipeline ranks, ``pp``."""
    out = {kind: low.grad_dim(kind) for kind in ("tp", "cp", "dp", "ep", "edp", "etp", "zr", "ezr", "cpa", "cpr")}
    out.update(dict.fromkeys(("pp", "emb", "rep"), "pp"))
    return out


def run_passes(low: Lowering, kept: _Parting | None = None) -> Program:
    """The passes in order; ``kept``: the state of a longer step's lowering where this one's
    parts from it (:class:`_Parting`), from which the pipeline pass resumes."""
    prog = Program(ranks=low.sym.ranks, weight=low.sym.weight, rep=low.sym.rep_of_gpu, maker=_make,
                   siblings=low.sym.sibling_map, routing=low.routing, group_dims=group_dims(low))
    if kept is None:
        prog = pipeline_pass(prog, low)
    else:
        prog = pipeline_pass(prog, low, *_resumed(prog, low, kept))
    for p in (dp_grad_pass, optimizer_pass):
        prog = p(prog, low)
    return prog
