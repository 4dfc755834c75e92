"""Rank mesh: rank <-> (dp, pp, tp) coordinates <-> GPU, and the communication groups.

Ranks are laid out with the first dimension of ``order`` innermost (Megatron's default
"tp-dp-pp": TP neighbours share a node, PP is outermost)::

    order tp-dp-pp, tp=2 dp=2 pp=2:    rank = tp + 2*(dp + 2*pp)
        rank: 0 1 2 3 4 5 6 7
        tp:   0 1 0 1 0 1 0 1
        dp:   0 0 1 1 0 0 1 1
        pp:   0 0 0 0 1 1 1 1

Rank r runs on GPU r of the cluster (GPU r lives on node r // gpus_per_node).

Expert parallelism is carved out of DP (Megatron-style, experts TP-split like the dense MLP):
ep consecutive DP indices form an EP group, which all-to-alls tokens; the ranks holding the
same experts (DP indices equal mod ep) form the expert-data-parallel group "edp", which
reduces expert gradients::

    dp index:  0 1 2 3 4 5 6 7      ep=4
    ep group:  [0 1 2 3] [4 5 6 7]
    edp group: {0,4} {1,5} {2,6} {3,7}
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import product

DIMS = ("tp", "dp", "pp")


@dataclass(frozen=True)
class Mesh:
    tp: int
    dp: int
    pp: int
    order: tuple[str, ...] = DIMS  # innermost first
    ep: int = 1  # expert-parallel size, a divisor of dp

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    def size(self, dim: str) -> int:
        if dim == "edp":
            return self.dp // self.ep
        return getattr(self, dim)

    @cached_property
    def _strides(self) -> dict[str, int]:
        stride, out = 1, {}
        for dim in self.order:
            out[dim] = stride
            stride *= self.size(dim)
        return out

    def rank(self, **coords: int) -> int:
        return sum(coords[d] * self._strides[d] for d in DIMS)

    def coords(self, rank: int) -> dict[str, int]:
        return {d: (rank // self._strides[d]) % self.size(d) for d in DIMS}

    def group(self, rank: int, dim: str) -> tuple[int, ...]:
        """Ranks that share every coordinate of ``rank`` except ``dim``, in ``dim`` order.

        ``ep`` and ``edp`` are the expert groups inside DP (see the module docstring).
        """
        if dim in ("ep", "edp"):
            d = self.coords(rank)["dp"]
            base = rank - d * self._strides["dp"]
            if dim == "ep":
                idx = range(d - d % self.ep, d - d % self.ep + self.ep)
            else:
                idx = range(d % self.ep, self.dp, self.ep)
            return tuple(base + i * self._strides["dp"] for i in idx)
        base = rank - self.coords(rank)[dim] * self._strides[dim]
        return tuple(base + i * self._strides[dim] for i in range(self.size(dim)))

    def groups(self, dim: str) -> list[tuple[int, ...]]:
        """Every ``dim`` group once, ordered by their first rank."""
        seen = {}
        for r in range(self.world_size):
            g = self.group(r, dim)
            seen.setdefault(g[0], g)
        return [seen[k] for k in sorted(seen)]

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
