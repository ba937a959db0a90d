"""What one op of a dataflow moves under k-cut tilings (SoyBean's Theorem 1), and the
tilings a tensor can take: the costs the planner and the simulator share."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from tfpar.partition.tiling.cuts import Cut, Tiling, broadcast_cost, matmul_cost, reduce_cost
from tfpar.partition.tiling.dataflow import Dataflow, MatMul, Op, Reduce


def options(shape: Sequence[int], m: int) -> List[Optional[int]]:
    """One-cut tilings of a tensor: each evenly divisible dimension, or replication."""
    return [d for d, n in enumerate(shape) if n % m == 0 and n >= m] + [None]


def tilings_of(shape: Sequence[int], order: Sequence[int]) -> List[Tiling]:
    """Every k-cut tiling of a tensor for cuts into `order` parts (outermost first)."""
    out = [Tiling()]
    for m in order:
        out = [t.then(Cut(d, m)) for t in out for d in options(t.tile_shape(shape), m)]
    return out


def op_cut_cost(op: Op, dims: Sequence[Optional[int]], sizes: Sequence[float], m: int
                ) -> float:
    """Elements one op moves for one cut into m parts (its operands' tilings `dims` and
    tile sizes, in `op.operands` order)."""
    if isinstance(op, MatMul):
        return matmul_cost(*dims, *sizes, m, op.transpose_a, op.transpose_b)[0]
    if isinstance(op, Reduce):
        return reduce_cost(dims[0], dims[1], sizes[0], sizes[1], m, op.axis)[0]
    return broadcast_cost(dims[0], dims[1], sizes[0], m, op.axis)


def op_k_cut_cost(df: Dataflow, op: Op, tilings: Dict[str, Tiling]) -> float:
    """Elements one op moves under k-cut tilings: sum over cuts of the cut's cost on the
    tiles left by the cuts before it, times the number of those tiles (Theorem 1)."""
    return sum(op_cut_costs(df, op, tilings))


def op_cut_costs(df: Dataflow, op: Op, tilings: Dict[str, Tiling]) -> List[float]:
    """The terms of `op_k_cut_cost`, one per cut: the elements that cross each cut."""
    out, weight = [], 1
    names = op.operands
    for level, cut in enumerate(tilings[names[0]].cuts):
        ts = [tilings[x] for x in names]
        sizes = [_tile_size(df.matrices[x].shape, t, level) for x, t in zip(names, ts)]
        out.append(weight * op_cut_cost(op, [t.cuts[level].dim for t in ts], sizes, cut.parts))
        weight *= cut.parts
    return out


def _tile_size(shape, tiling: Tiling, level: int) -> float:
    return float(_size(Tiling(tiling.cuts[:level]).tile_shape(shape)))


def _size(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
