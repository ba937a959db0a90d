"""Dense layers computed on tiles: a matmul and a bias add under the planner's tilings.

Each worker holds its tile of a weight (its `Tiling`'s box). A weight's tiling fixes, cut
by cut, SoyBean's form of Y = X W (section 3):

    W split by rows (R)     X split by columns, Y partial sums ("+", summed later)
    W split by columns (C)  X replicated,       Y split by columns
    W replicated (r)        X split by rows,    Y split by rows (data parallel)

so the layer converts X from the tiling it arrives in to the one the forms need, multiplies
its tiles locally, and converts Y (partial sums reduced) into the tiling its consumer
wants. Every conversion is an exact-adjoint collective (`collectives`), so TensorFlow's own
gradient of the layer is the exact backward: dX and dW are local matmuls on tiles and the
communication is the conversions' adjoints. A weight stored replicated over some cuts is
one parameter held by several workers: its gradient is summed over them (`replicated`).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import tensorflow as tf

from tfpar.errors import TfparError
from tfpar.partition.tiling import redistribution
from tfpar.partition.tiling.cuts import RED, Cut, Tiling
from tfpar.transform import collectives


def batch_split(devices_per_cut: Sequence[int]) -> Tiling:
    """Rows split at every cut: each worker's own batch, as data parallelism holds it."""
    return Tiling(tuple(Cut(0, m) for m in devices_per_cut))


def forms(w: Tiling):
    """(X's tiling, Y's tiling as computed) that weight tiling `w` makes (module doc)."""
    x_cuts, y_cuts = [], []
    for c in w.cuts:
        if c.dim == 0:
            x_cuts.append(Cut(1, c.parts))
            y_cuts.append(Cut(RED, c.parts))
        elif c.dim == 1:
            x_cuts.append(Cut(None, c.parts))
            y_cuts.append(Cut(1, c.parts))
        elif c.dim is None:
            x_cuts.append(Cut(0, c.parts))
            y_cuts.append(Cut(0, c.parts))
        else:
            raise TfparError(f"weight tiling {w} cuts a matrix along {c.dim}")
    return Tiling(tuple(x_cuts)), Tiling(tuple(y_cuts))


def bias_tiling(y: Tiling) -> Tiling:
    """The tiling of a bias [M] added to Y [B, M] under `y`: split where Y's columns are."""
    return Tiling(tuple(Cut(0 if c.dim == 1 else None, c.parts) for c in y.cuts))


def replicated(w_tile: tf.Tensor, tiling: Tiling, shape: Sequence[int], rank: int,
               scale: float = 1.0, counter=None, name: str = "replicated") -> tf.Tensor:
    """`w_tile` unchanged; its gradient summed over the workers that hold the same tile
    (the cuts where `tiling` replicates) and multiplied by `scale` (1/N for a mean loss)."""
    summed = Tiling(tuple(Cut(RED, c.parts) if c.dim is None else c for c in tiling.cuts))
    needs_sum = summed != tiling

    @tf.custom_gradient
    def apply(t):
        def grad(dy):
            if needs_sum:
                dy = collectives.convert(dy, summed, tiling, shape, rank, counter,
                                         name + "_sum")
            return dy * scale if scale != 1.0 else dy
        return tf.identity(t), grad

    with tf.compat.v1.name_scope(name):
        return apply(w_tile)


def dense(x: tf.Tensor, x_tiling: Tiling, batch: int, w_tile: tf.Tensor, w_tiling: Tiling,
          w_shape: Sequence[int], y_tiling: Tiling, rank: int,
          b_tile: Optional[tf.Tensor] = None, b_tiling: Optional[Tiling] = None,
          counter: Optional[Callable[[int], None]] = None, name: str = "dense") -> tf.Tensor:
    """This worker's tile of Y = X W (+ b) under `y_tiling`.

    x: its tile of X [batch, K] under `x_tiling`; w_tile: its tile of W [K, M] under
    `w_tiling` (already passed through `replicated` where it replicates); b_tile: its tile
    of b [M] under `b_tiling` (likewise).
    """
    k, m = w_shape
    need_x, made_y = forms(w_tiling)
    with tf.compat.v1.name_scope(name):
        x_used = collectives.convert(x, x_tiling, need_x, (batch, k), rank, counter, "x")
        y = tf.matmul(x_used, w_tile)
        want = redistribution.tile_shape(made_y, (batch, m), rank)
        if tuple(y.shape.as_list()) != want:
            raise TfparError(f"{name}: a tile product of shape {y.shape.as_list()}, expected "
                             f"{list(want)} (tilings X {need_x}, W {w_tiling})")
        y = collectives.convert(y, made_y, y_tiling, (batch, m), rank, counter, "y")
        if b_tile is not None:
            b_used = collectives.convert(b_tile, b_tiling, bias_tiling(y_tiling), (m,), rank,
                                         counter, "b")
            y = tf.nn.bias_add(y, b_used)
        return y
