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


def summed(tiling: Tiling) -> Tiling:
    """`tiling` with its replicating cuts as partial sums: how the gradient of a tile held
    by several workers arrives before it is summed over them."""
    return Tiling(tuple(Cut(RED, c.parts) if c.dim is None else c for c in tiling.cuts))


def replicated(w_tile: tf.Tensor, tiling: Tiling, shape: Sequence[int], rank: int,
               scale: float = 1.0, counter=None, name: str = "replicated") -> tf.Tensor:
    """`w_tile` unchanged; its gradient summed over the workers that hold the same tile
    (the cuts where `tiling` replicates) and multiplied by `scale` (1/N for a mean loss)."""
    partial = summed(tiling)
    needs_sum = partial != tiling

    @tf.custom_gradient
    def apply(t):
        def grad(dy):
            if needs_sum:
                dy = collectives.convert(dy, partial, tiling, shape, rank, counter,
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


def rows_only(t: Tiling) -> Tiling:
    """`t` with its column cuts replicated: the rows a worker's tile covers, whole."""
    return Tiling(tuple(Cut(None, c.parts) if c.dim == 1 else c for c in t.cuts))


def rows_partial(t: Tiling) -> Tiling:
    """`t` with its column cuts as partial sums (per-row sums over a column slice)."""
    return Tiling(tuple(Cut(RED, c.parts) if c.dim == 1 else c for c in t.cuts))


def logits_tiling(made_y: Tiling) -> Tiling:
    """The tiling a split softmax reads logits in: the product's, its partial sums (a
    weight split by rows) reduced into a split of the rows."""
    return Tiling(tuple(Cut(0, c.parts) if c.dim == RED else c for c in made_y.cuts))


def softmax_moved_bytes(tiling: Tiling, batch: int, labels_tiling: Tiling,
                        itemsize: int = 4) -> int:
    """Bytes `softmax_cross_entropy` moves between workers per step, forward and
    backward: the labels to the tiles' rows (ids travel as float64), the row maxima, the
    sums and their adjoint, the loss back to the label rows and its adjoint."""
    rows = rows_only(tiling)
    slices = 1
    for c in tiling.cuts:
        slices *= c.parts if c.dim == 1 else 1
    out = 8 * redistribution.moved(labels_tiling, rows, (batch, 1))
    if slices > 1:
        out += itemsize * (redistribution.moved(tiling, rows, (batch, slices))
                           + 2 * redistribution.moved(rows_partial(tiling), rows, (batch, 2)))
    return out + 2 * itemsize * redistribution.moved(rows, labels_tiling, (batch, 1))


def softmax_cross_entropy(logits: tf.Tensor, tiling: Tiling, batch: int, vocab: int,
                          labels: tf.Tensor, labels_tiling: Tiling, rank: int,
                          counter=None, name: str = "split_softmax") -> tf.Tensor:
    """Per-row softmax cross-entropy of logits [batch, vocab] held as tiles under `tiling`
    (e.g. split over the vocabulary), for this worker's rows under `labels_tiling` (its
    labels [rows] of global ids; usually its own batch, the rows split at every cut).

    No worker holds a whole row of logits: each reduces its slice (the maximum, the sum
    of exponentials, the target's logit) and only those [rows, 1] values cross the
    column cuts (the maximum only for stability, without gradient; the sums by an
    all-reduce whose adjoint sends the gradient back to every slice).
    """
    if any(c.dim == RED for c in tiling.cuts):
        raise TfparError(f"{name}: logits must be whole values, not partial sums ({tiling})")
    with tf.compat.v1.name_scope(name):
        (_, _), (c0, c1) = tiling.tile_ranges((batch, vocab), rank)
        rows = rows_only(tiling)
        # Labels of the rows this tile covers (ids travel as float64: exact below 2^53).
        row_labels = collectives.convert(tf.cast(labels, tf.float64)[:, None], labels_tiling,
                                         rows, (batch, 1), rank, counter, "labels")
        row_labels = tf.stop_gradient(tf.cast(row_labels[:, 0], tf.int64))
        # The row maximum over every slice: each slice's maximum, gathered across the
        # column cuts as a [batch, slices] matrix.
        col_cuts = [c.parts for c in tiling.cuts if c.dim == 1]
        slices = 1
        for p in col_cuts:
            slices *= p
        local_max = tf.reduce_max(logits, axis=1, keepdims=True)
        if slices > 1:
            # Under `tiling` a [batch, slices] matrix gives each worker one column.
            all_max = collectives.convert(tf.stop_gradient(local_max), tiling, rows,
                                          (batch, slices), rank, counter, "max")
            row_max = tf.reduce_max(all_max, axis=1, keepdims=True)
        else:
            row_max = local_max
        row_max = tf.stop_gradient(row_max)
        sum_exp = tf.reduce_sum(tf.exp(logits - row_max), axis=1, keepdims=True)
        in_slice = tf.logical_and(row_labels >= c0, row_labels < c1)
        local_ids = tf.where(in_slice, row_labels - c0, tf.zeros_like(row_labels))
        picked = tf.gather(logits, local_ids, axis=1, batch_dims=1)[:, None]
        target = picked * tf.cast(in_slice, logits.dtype)[:, None]
        partial = tf.concat([sum_exp, target], axis=1)  # [rows, 2], summed over slices
        total = (collectives.convert(partial, rows_partial(tiling), rows, (batch, 2), rank,
                                     counter, "sums") if slices > 1 else partial)
        loss = tf.math.log(total[:, 0]) + row_max[:, 0] - total[:, 1]
        return collectives.convert(loss[:, None], rows, labels_tiling, (batch, 1), rank,
                                   counter, "rows")[:, 0]
