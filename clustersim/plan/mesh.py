"""Rank mesh: rank <-> (tp, cp, dp, pp) coordinates <-> GPU, and the communication groups.

Ranks are laid out with the first dimension of ``order`` innermost (Megatron's default
"tp-cp-dp-pp": TP neighbours share a node, PP is outermost)::

    order tp-cp-dp-pp, tp=2 cp=1 dp=2 pp=2:    rank = tp + 2*(dp + 2*pp)
        rank: 0 1 2 3 4 5 6 7
        tp:   0 1 0 1 0 1 0 1
        dp:   0 0 1 1 0 0 1 1
        pp:   0 0 0 0 1 1 1 1

Rank r runs on GPU r of the cluster (GPU r lives on node r // gpus_per_node).

Context parallelism splits every sequence over the cp ranks of a "cp" group; they hold the
same weights, so gradients (and ZeRO shards) go over the ``cp+dp`` group, all ranks with the
same TP and PP coordinates (Megatron-LM's data-parallel-with-context-parallel group).

Expert parallelism is carved out of DP (Megatron-style; with CP, of CP x DP, and with experts
split over fewer ranks than TP, below, of those TP ranks too). With ``ep`` inside ``dp`` in the
order (the default, "tp-cp-ep-dp-pp"), ep consecutive DP indices form an EP group, which
all-to-alls tokens; the ranks holding the same experts form the expert-data-parallel group
"edp", which reduces expert gradients (without CP, experts split as TP)::

    dp index:  0 1 2 3 4 5 6 7      ep=4, ep inside dp ("ep-dp")
    ep group:  [0 1 2 3] [4 5 6 7]
    edp group: {0,4} {1,5} {2,6} {3,7}

    dp index:  0 1 2 3 4 5 6 7      ep=4, ep outside dp ("dp-ep")
    ep group:  {0,2,4,6} {1,3,5,7}
    edp group: [0 1] [2 3] [4 5] [6 7]

Expert tensor parallelism (``etp``, a divisor of tp; Megatron-LM's
--expert-tensor-parallel-size) splits each routed expert over etp TP ranks, the ``etp`` group
(the whole TP group where etp = tp). The experts lie on the X = (tp / etp) x cp x dp ranks of
a stage that hold different slices, in which EP and expert-DP are carved as above: each
rank's place there, x, counts its slice of its TP group (i_tp // etp), its CP and its DP
index in the order's nesting (by default x = i_tp // etp + (TP / etp) * (i_cp + CP * i_dp),
i_ the rank's indices, TP and CP the sizes), and its EP index is x mod ep (ep inside) or
x // (X / ep) (outside). So EP folds over the TP ranks the experts
leave and the CP ranks first (MoE parallel folding, Liu et al. 2025, arXiv:2504.14960; the
layout of Megatron-Core's expert rank generator, which lays the experts over each stage's
ranks in rank order, etp innermost)::

    tp=2 etp=1 dp=4 ep=4:    x = i_tp + 2*i_dp
        (tp, dp):  (0,0) (1,0) (0,1) (1,1) (0,2) (1,2) (0,3) (1,3)
        ep group:  [ 0     1     2     3 ] [ 0     1     2     3 ]    (EP indices)
        edp group: {(0,0) (0,2)} {(1,0) (1,2)} {(0,1) (0,3)} {(1,1) (1,3)}

Expert gradients go over ``edp``, which holds the CP ranks with the same experts.

Hierarchical context parallelism (``cp_a2a``; Megatron-LM's
``--hierarchical-context-parallel-sizes``) cuts each CP group, in CP order, into ``cpa`` groups
of ``cp_a2a`` consecutive members, which all-to-all, and ``cpr`` groups of the members at the
same place in each, which pass K/V round a ring::

    cp group:     0 1 2 3 4 5 6 7        cp_a2a=2
    cpa groups:   [0 1] [2 3] [4 5] [6 7]
    cpr groups:   {0,2,4,6} {1,3,5,7}

Hybrid sharding (HSDP; ``zero_shard``): ZeRO shards over ``zs`` groups of zero_shard
members of a ``cp+dp`` group consecutive in rank order (so that a shard group fills a node
before the next, whichever of CP and DP is inner) and keeps a replica of each shard in every
one of them; the members holding the same shard form a ``zr`` group::

    cp+dp group:  0 1 2 3 4 5 6 7        zero_shard=4
    zs groups:    [0 1 2 3] [4 5 6 7]    (gather parameters, reduce-scatter gradients)
    zr groups:    {0,4} {1,5} {2,6} {3,7}  (all-reduce each gradient shard)

Where the routed experts' expert-DP group is not DP's (EP, or etp < tp), they shard over it
the same way, cut into as many consecutive slices as the dense weights have replicas
(Megatron-LM's distributed-optimizer instances split the expert-DP group as they split DP):
``ezs`` the slices of an ``edp`` group in rank order, ``ezr`` the members holding the same
expert shard::

    edp group:    0 8 16 24 32 40 48 56  (ep=8 of dp=64), zr size 2
    ezs groups:   [0 8 16 24] [32 40 48 56]
    ezr groups:   {0,32} {8,40} {16,48} {24,56}
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import product

import numpy as np

DIMS = ("tp", "cp", "dp", "pp")  # the default order, innermost first


# groups cut out of a whole group (module docstring): dim -> (the whole group, the dimension
# whose size is a slice's width, whether dim is the slices (else the members at one place in
# each), whether the whole group is taken in rank order (else in its own order)).
# Hybrid sharding slices cp+dp (edp) in rank order; hierarchical CP the CP group in CP order
SLICED = {"zs": ("cp+dp", "zs", True, True), "zr": ("cp+dp", "zs", False, True),
          "ezs": ("edp", "ezs", True, True), "ezr": ("edp", "ezs", False, True),
          "cpa": ("cp", "cpa", True, False), "cpr": ("cp", "cpa", False, False)}


def parse_order(text: str) -> tuple[tuple[str, ...], bool]:
    """(dims innermost first, ep inside dp) from an order string such as "tp-cp-ep-dp-pp".

    tp, dp and pp must appear; cp, when absent, sits just outside tp; ep, when present, must
    touch dp: before it (EP groups are consecutive DP indices) or after it (strided).
    Raises ValueError with the reason.
    """
    names = text.split("-")
    known = set(DIMS) | {"ep"}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown dimension {unknown[0]!r}; use tp, cp, ep, dp, pp joined by '-', innermost first")
    dup = [n for n in names if names.count(n) > 1]
    if dup:
        raise ValueError(f"dimension {dup[0]!r} appears twice")
    missing = [d for d in ("tp", "dp", "pp") if d not in names]
    if missing:
        raise ValueError(f"order must name tp, dp and pp (missing {missing[0]}), e.g. tp-cp-ep-dp-pp")
    ep_inner = True
    if "ep" in names:
        i, j = names.index("ep"), names.index("dp")
        if abs(i - j) != 1:
            rest = [n for n in names if n != "ep"]
            k = rest.index("dp")
            before, after = "-".join(rest[:k] + ["ep"] + rest[k:]), "-".join(rest[:k + 1] + ["ep"] + rest[k + 1:])
            raise ValueError(f"ep is carved out of dp, so it must sit next to dp ({before} or {after}; "
                             f"without expert parallelism leave ep out: {'-'.join(rest)})")
        ep_inner = i < j
        names.remove("ep")
    if "cp" not in names:
        names.insert(names.index("tp") + 1, "cp")
    return tuple(names), ep_inner


@dataclass(frozen=True)
class Mesh:
    tp: int
    dp: int
    pp: int
    order: tuple[str, ...] = DIMS  # innermost first; a missing cp sits just outside tp
    ep: int = 1  # expert-parallel size, a divisor of (tp / etp) x cp x dp
    cp: int = 1
    ep_inner: bool = True  # EP groups are consecutive DP indices (else strided)
    zero_shard: int = 0  # ranks of a ZeRO shard group (zs); 0: the whole cp+dp group
    etp: int = 0  # TP ranks splitting each routed expert, a divisor of tp; 0: tp
    cp_a2a: int = 0  # members of a hierarchical CP group's all-to-all (cpa); 0: the whole CP group

    def __post_init__(self):
        if "cp" not in self.order:
            dims = list(self.order)
            dims.insert(dims.index("tp") + 1, "cp")
            object.__setattr__(self, "order", tuple(dims))

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def size(self, dim: str) -> int:
        if dim == "edp":
            return self.expert_ranks // self.ep
        if dim == "etp":
            return self.expert_tp
        if dim in ("zs", "zr"):
            shard = self.zero_shard or self.cp * self.dp
            return shard if dim == "zs" else self.cp * self.dp // shard
        if dim in ("ezs", "ezr"):  # the expert-DP group cut into as many slices as zr has members
            return self.size("edp") // self.size("zr") if dim == "ezs" else self.size("zr")
        if dim in ("cpa", "cpr"):  # the CP group cut into all-to-all slices and the rings across them
            a2a = self.cp_a2a or self.cp
            return a2a if dim == "cpa" else self.cp // a2a
        if "+" in dim:
            out = 1
            for d in dim.split("+"):
                out *= self.size(d)
            return out
        return getattr(self, dim)

    @cached_property
    def _strides(self) -> dict[str, int]:
        stride, out = 1, {}
        for dim in self.order:
            out[dim] = stride
            stride *= self.size(dim)
        return out

    def rank(self, **coords: int) -> int:
        return sum(coords.get(d, 0) * self._strides[d] for d in DIMS)

    def coords(self, rank: int) -> dict[str, int]:
        return {d: (rank // self._strides[d]) % self.size(d) for d in DIMS}

    def coord_array(self, dim: str) -> np.ndarray:
        """Every rank's index along ``dim``, by rank: ``coords(r)[dim]`` for all ranks at once."""
        return (np.arange(self.world_size) // self._strides[dim]) % self.size(dim)

    @property
    def expert_tp(self) -> int:
        """TP ranks splitting each routed expert (``etp``, or tp where unset)."""
        return self.etp or self.tp

    @property
    def expert_ranks(self) -> int:
        """Ranks of a stage that hold different expert slices, X = (tp / etp) x cp x dp, out of
        which EP is carved (the module docstring)."""
        return self.tp // self.expert_tp * self.cp * self.dp

    @cached_property
    def expert_coords(self) -> dict[str, np.ndarray]:
        """Every rank's coordinates among the experts, by rank: pp, ``etp`` (its index in
        its expert-TP group), ``ep`` (in its EP group) and ``edp`` (in its expert-DP group),
        which name it as (tp, cp, dp, pp) do (the module docstring); x nests tp // etp, cp and
        dp as the order does (default order shown)::

            x = i_tp // etp + (TP / etp) * (i_cp + CP * i_dp)      X = (TP / etp) * CP * DP
            ep inside dp:   ep = x mod ep,        edp = x // ep
            ep outside dp:  ep = x // (X / ep),   edp = x mod (X / ep)
        """
        et = self.expert_tp
        tp = self.coord_array("tp")
        x, stride = np.zeros(self.world_size, dtype=np.int64), 1
        for dim in (d for d in self.order if d in ("tp", "cp", "dp")):
            x += (tp // et if dim == "tp" else self.coord_array(dim)) * stride
            stride *= self.tp // et if dim == "tp" else self.size(dim)
        n = self.size("edp")
        ep, edp = (x % self.ep, x // self.ep) if self.ep_inner else (x // n, x % n)
        return {"pp": self.coord_array("pp"), "etp": tp % et, "ep": ep, "edp": edp}

    def _expert_rows(self, dim: str) -> np.ndarray:
        """The groups of expert dimension ``dim`` ("ep", "edp" or "etp"): ranks sharing every
        other expert coordinate, each group ordered by its ``dim`` coordinate."""
        c = self.expert_coords
        fixed = [c[k] for k in ("pp", "etp", "ep", "edp") if k != dim]
        order = np.lexsort([c[dim]] + fixed)  # (the last key sorts first)
        rows = order.reshape(-1, self.size(dim))
        return rows[np.argsort(rows.min(axis=1), kind="stable")]

    @cached_property
    def _expert_where(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """dim -> (its groups' rows, each rank's row): :meth:`group` for the expert groups."""
        out = {}
        for dim in ("ep", "edp", "etp"):
            rows = self._expert_rows(dim)
            where = np.empty(self.world_size, dtype=np.int64)
            where[rows] = np.arange(len(rows))[:, None]
            out[dim] = (rows, where)
        return out

    def group(self, rank: int, dim: str) -> tuple[int, ...]:
        """Ranks that share every coordinate of ``rank`` except ``dim``, in ``dim`` order.

        ``ep``, ``edp`` and ``etp`` are the expert groups (see the module docstring);
        "cp+dp" combines CP with DP, CP innermost.
        """
        c = self.coords(rank)
        if dim in SLICED:  # slices of the rank's whole group, or the members at one place in each
            whole, width, is_slice, by_rank = SLICED[dim]
            g = self.group(rank, whole)
            g = tuple(sorted(g)) if by_rank else g
            n, at = self.size(width), g.index(rank)
            return g[at - at % n:at - at % n + n] if is_slice else g[at % n::n]
        if "+" in dim:
            inner, outer = dim.split("+")
            return tuple(x for o in self.group(rank, outer) for x in self.group(o, inner))
        if dim in ("ep", "edp", "etp"):
            rows, where = self._expert_where[dim]
            return tuple(rows[where[rank]].tolist())
        base = rank - c[dim] * self._strides[dim]
        return tuple(base + i * self._strides[dim] for i in range(self.size(dim)))

    def groups(self, dim: str) -> list[tuple[int, ...]]:
        """Every ``dim`` group once, ordered by their first rank; each as :meth:`group` gives it
        (:meth:`group_rows` as tuples)."""
        return [tuple(row) for row in self.group_rows(dim).tolist()]

    def group_rows(self, dim: str) -> np.ndarray:
        """Every ``dim`` group once as a row of ranks, rows ordered by their first rank.

        Worked out on the rank grid at once: ranks laid out as an array with one axis per
        dimension, the group's axes moved last (the expert groups by :meth:`_expert_rows`)::

            tp=2 dp=2 pp=2, "dp":  grid[pp][dp][tp] -> axes (pp, tp, dp) -> rows (0,2) (1,3) (4,6) (5,7)
        """
        if dim in SLICED:  # each whole row cut into (slices, width): the slices its rows, the others its columns
            whole, width, is_slice, by_rank = SLICED[dim]
            rows = self.group_rows(whole)
            cut = (np.sort(rows, axis=1) if by_rank else rows).reshape(len(rows), -1, self.size(width))
            rows = (cut if is_slice else cut.transpose(0, 2, 1)).reshape(-1, self.size(dim))
            return rows[np.argsort(rows.min(axis=1), kind="stable")]
        parts = dim.split("+")  # "cp+dp": dp major, cp minor (as group() nests them)
        if {"ep", "edp", "etp"} & set(parts):
            if len(parts) > 1:  # (CP is folded into the expert coordinates already)
                raise ValueError(f"{dim!r}: an expert group combines with no other dimension")
            return self._expert_rows(dim)
        names = [d for d in reversed(self.order)]  # C order: the innermost dimension is the last axis
        shape = [self.size(d) for d in names]
        axes = [names.index(d) for d in reversed(parts)]
        grid = np.arange(self.world_size).reshape(shape)
        rest = [a for a in range(len(names)) if a not in axes]
        rows = grid.transpose(rest + axes).reshape(-1, int(np.prod([shape[a] for a in axes])))
        return rows[np.argsort(rows.min(axis=1), kind="stable")]

    def grad_group(self, kind: str) -> str:
        """The group that reduces (and ZeRO-shards) the gradients of ``kind``, "dp" (dense) or
        "edp" (routed experts): DP times CP, as CP ranks hold the same weights, and the
        expert-DP group, which holds them already; under hybrid sharding the shard group, the
        experts' own (``ezs``) where their expert-DP group is not DP's (EP carves it out of DP,
        or experts split over fewer ranks than TP reach across TP), else DP's."""
        if self.zero_shard:
            return "ezs" if kind == "edp" and (self.ep > 1 or self.expert_tp < self.tp) else "zs"
        return {"dp": "cp+dp", "edp": "edp"}[kind]

    def replica_group(self, kind: str) -> str:
        """Under hybrid sharding, the group that all-reduces a gradient shard of ``kind`` ("dp"
        or "edp") over its replicas: ``zr``, or the experts' ``ezr`` beside ``ezs``."""
        return "ezr" if self.grad_group(kind) == "ezs" else "zr"

    def grad_shards(self, zero: int) -> tuple[int, int]:
        """Into how many shards ZeRO stage ``zero`` cuts the dense and the routed-expert
        gradients and optimizer states: their :meth:`grad_group`'s sizes, (1, 1) under ZeRO 0,
        whose all-reduce leaves them whole."""
        return (self.size(self.grad_group("dp")), self.size(self.grad_group("edp"))) if zero >= 1 else (1, 1)

    def nodes_spanned(self, dim: str, gpus_per_node: int) -> int:
        """The most nodes one ``dim`` group spans (rank r on GPU r): a TP group over more than
        one runs its every collective through the NICs."""
        nodes = np.sort(self.group_rows(dim) // gpus_per_node, axis=1)
        return int(1 + (np.diff(nodes, axis=1) != 0).sum(axis=1).max())

    def ranks_where(self, **fixed: int) -> list[int]:
        """All ranks whose coordinates match ``fixed``, ascending."""
        free = [d for d in DIMS if d not in fixed]
        out = [self.rank(**fixed, **dict(zip(free, vals)))
               for vals in product(*(range(self.size(d)) for d in free))]
        return sorted(out)


def split_layers(layers: int, stages: int) -> list[int]:
    """Even split; the remainder goes one each to the first stages.

    The last stage also carries the LM head, so extra layers go to the front::

        61 layers on 16 stages -> [4]*13 + [3]*3
    """
    base, extra = divmod(layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]
