"""Reference solvers for the tiling planner's tests.

Both cost a k-cut assignment from the scalar one-cut rule (`op_cut_cost`: Equation 2
for matmuls) summed over cuts as Theorem 1 says, not with the vectorised tables the planner solves
over, and share none of its search.

- `brute_force`: one array with an axis per matrix, summed over matmuls; its minimum is
  the least cost over literally every k-cut assignment (while there are a few million).
- `chain_optimum`: for `mlp` chains too large to list (4 layers on 8 devices have 27^13
  assignments), the same minimum layer by layer, trying every tiling of a layer's
  matrices for every tiling of its boundary.
"""
import functools
import itertools

import numpy as np

from tfpar.partition.tiling.cuts import Tiling
from tfpar.partition.tiling.op_costs import op_cut_cost, tilings_of


@functools.lru_cache(maxsize=None)
def _cut_cost(op, dims, sizes, parts):
    return op_cut_cost(op, dims, sizes, parts)


def tables(df, order):
    """The matrices, their k-cut tilings, and each op's cost table: Theorem 1's sum over
    cuts of the scalar one-cut rule (`op_cut_cost`: Equation 2 for matmuls) on the tiles
    left by the cuts before, times their number."""
    names = list(dict.fromkeys(x for op in df.ops for x in op.operands))
    doms = {x: tilings_of(df.matrices[x].shape, order) for x in names}
    # per matrix, per tiling: (dim, size of the tile it cuts) at every level
    levels = {x: [[(t.cuts[level].dim,
                    float(np.prod(Tiling(t.cuts[:level]).tile_shape(df.matrices[x].shape))))
                   for level in range(len(order))] for t in doms[x]] for x in names}
    factors = []
    for op in df.ops:
        operands = op.operands
        scope = tuple(dict.fromkeys(operands))
        table = np.zeros([len(doms[x]) for x in scope])
        for idx in itertools.product(*(range(len(doms[x])) for x in scope)):
            chosen = dict(zip(scope, idx))
            per = [levels[x][chosen[x]] for x in operands]
            total, weight = 0.0, 1
            for level, parts in enumerate(order):
                total += weight * _cut_cost(op, tuple(p[level][0] for p in per),
                                            tuple(p[level][1] for p in per), parts)
                weight *= parts
            table[idx] = total
        factors.append((scope, table))
    return names, doms, factors


def brute_force(df, order, limit=5e6, tabled=None):
    names, doms, factors = tabled or tables(df, order)
    count = np.prod([len(doms[x]) for x in names], dtype=float)
    if count > limit:
        return None
    total = np.zeros([1] * len(names))
    for factor in factors:
        total = total + _aligned(factor, names)
    return float(total.min())


def chain_optimum(df, order, tabled=None):
    """The least cost of an `mlp` chain, layer by layer: layer l's ops touch the rest
    only through x_(l-1), dx_(l-1) (before) and x_l, dx_l (after), so for every boundary
    assignment the best of everything before it is a table over that boundary, and layer
    l tries every (x_(l-1), dx_(l-1), W_l) and every bias b_l for every (x_l, dx_l)."""
    _, doms, factors = tabled or tables(df, order)
    layers = sum(1 for x in df.matrices if x.startswith("W"))
    best = None  # over (x_(l-1), dx_(l-1)); layer 1 has no dx0
    for l in range(1, layers + 1):
        prev = (f"x{l - 1}", f"dx{l - 1}") if l > 1 else (f"x{l - 1}",)
        axes = list(prev) + [f"W{l}", f"x{l}", f"dx{l}"]
        total = np.zeros([len(doms[x]) for x in axes])
        if best is not None:
            total = total + _aligned((prev, best), axes)
        for scope, table in factors:
            if f"W{l}" in scope:  # fwd_l, bwd_l and grad_l all use W_l
                total = total + _aligned((scope, table), axes)
        if f"b{l}" in doms:  # the bias add and gradient: their best b_l for each x_l, dx_l
            bias = [f for f in factors if f"b{l}" in f[0]]
            joint = sum(_aligned(f, [f"b{l}", f"x{l}", f"dx{l}"]) for f in bias)
            total = total + _aligned(((f"x{l}", f"dx{l}"), joint.min(axis=0)), axes)
        best = total.min(axis=tuple(range(len(prev) + 1)))  # over x_(l-1), dx_(l-1), W_l
    return float(best.min())


def _aligned(factor, axes):
    """A factor's table with one axis per name in `axes` (size 1 where it has none)."""
    scope, table = factor
    perm = sorted(range(len(scope)), key=lambda j: axes.index(scope[j]))
    shape = [1] * len(axes)
    for j in perm:
        shape[axes.index(scope[j])] = table.shape[j]
    return table.transpose(perm).reshape(shape)
