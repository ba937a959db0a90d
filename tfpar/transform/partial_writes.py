"""A user's write of part of a variable outside the training step, on a variable that
tfpar split (sharded rows, a tiled weight's tiles, the parameter servers' parts).

Scripts write parts of a table between steps: `scatter_update(table, [0], zeros)` keeps
a padding row zero, `table[0].assign(...)` sets one row, `scatter_add` adds counts. On
one device the op writes the one variable; under tfpar that variable is never
initialised (its values live in rows, tiles or parts), so the op must be redone on them.
This module knows the ops and their arithmetic; `outside_uses` (sharded rows, tiles) and
`parameter_server` (parts) decide where each piece goes.

- A scatter by rows (`ROW_SCATTERS`) is cut by row range: each holder of rows
  `[lo, hi)` applies the same op to the ids that fall there (`rows_in`).
- A scatter by n-d indices or a slice's assign is computed on the whole value
  (`new_value`), then each holder writes its piece of the result.

Every worker runs the op, as it runs the step. A holder that gets the op from every
worker (a parameter server's part) applies it N times: right only for an op that gives
the same result when repeated (`repeatable`: write a value, min, max); an add is refused
there by the caller.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import tensorflow as tf

from tfpar.graph.analysis import ACCUMULATING_WRITES

tf1 = tf.compat.v1

# op type -> the tf.compat.v1 function that redoes it on another variable (ref or resource)
_ROW = {"Update": tf1.scatter_update, "Add": tf1.scatter_add, "Sub": tf1.scatter_sub,
        "Mul": tf1.scatter_mul, "Div": tf1.scatter_div, "Min": tf1.scatter_min,
        "Max": tf1.scatter_max}
ROW_SCATTERS = {**{"Scatter" + k: f for k, f in _ROW.items()},
                **{"ResourceScatter" + k: f for k, f in _ROW.items()}}
# op type -> its value on a tensor (the whole variable's value before it)
_ND = {"Update": tf.tensor_scatter_nd_update, "Add": tf.tensor_scatter_nd_add,
       "Sub": tf.tensor_scatter_nd_sub, "Min": tf.tensor_scatter_nd_min,
       "Max": tf.tensor_scatter_nd_max}
ND_SCATTERS = {**{"ScatterNd" + k: f for k, f in _ND.items()},
               **{"ResourceScatterNd" + k: f for k, f in _ND.items()}}
SLICE_ASSIGNS = ("StridedSliceAssign", "ResourceStridedSliceAssign")
TYPES = frozenset(ROW_SCATTERS) | frozenset(ND_SCATTERS) | frozenset(SLICE_ASSIGNS)
_SLICE_MASKS = ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask",
                "shrink_axis_mask")


def repeatable(op: tf.Operation) -> bool:
    """Whether `op` done twice with the same inputs leaves what it leaves done once (it
    writes values, a min or a max, not an amount)."""
    return op.type not in ACCUMULATING_WRITES


def inputs(op: tf.Operation) -> List[tf.Tensor]:
    """What `op` writes besides the variable: ids and rows, or a slice's bounds and value."""
    return list(op.inputs[1:])


def rows_in(op: tf.Operation, rows: int, lo: int, hi: int,
            columns: Sequence[Tuple[int, int]] = (), step: int = 1) -> Tuple[tf.Tensor, tf.Tensor]:
    """The ids (made local: less `lo`, over `step`) and rows of `op`'s row scatter that
    fall in rows lo, lo + step, ... below hi of a variable of `rows` rows, each row cut to
    `columns` (a (start, stop) per further dimension; none: whole rows). An id outside
    [0, rows) fails the run before any write, as on one device."""
    ids, updates = op.inputs[1], op.inputs[2]
    flat = tf.reshape(ids, [-1])
    checked = [tf.debugging.assert_non_negative(flat, message=f"tfpar: {op.name}: ids"),
               tf.debugging.assert_less(flat, tf.cast(rows, flat.dtype),
                                        message=f"tfpar: {op.name}: ids out of range")]
    with tf.control_dependencies(checked):
        held = (flat >= lo) & (flat < hi)
        if step != 1:
            held &= tf.equal((flat - tf.cast(lo, flat.dtype)) % tf.cast(step, flat.dtype), 0)
        mine = tf.reshape(tf.where(held), [-1])
        local = (tf.gather(flat, mine) - tf.cast(lo, flat.dtype)) // tf.cast(step, flat.dtype)
    if updates.shape.rank == 0:
        return local, updates  # one value for every id
    rows_of = tf.reshape(updates, tf.concat([[-1], tf.shape(updates)[tf.rank(ids):]], 0))
    picked = tf.gather(rows_of, mine)
    if columns:
        picked = picked[(slice(None),) + tuple(slice(a, b) for a, b in columns)]
    return local, picked


def scatter(op: tf.Operation, variable: tf.Variable, ids: tf.Tensor,
            updates: tf.Tensor) -> tf.Operation:
    """`op`'s row scatter done on `variable` with `ids` and `updates` (from `rows_in`)."""
    return _op_of(ROW_SCATTERS[op.type](variable, ids, updates))


def new_value(op: tf.Operation, whole: tf.Tensor) -> tf.Tensor:
    """The variable's value after `op` (an n-d scatter or a slice's assign), from its
    value `whole` before."""
    if op.type in ND_SCATTERS:
        return ND_SCATTERS[op.type](whole, op.inputs[1], op.inputs[2])
    return tf.raw_ops.TensorStridedSliceUpdate(
        input=whole, begin=op.inputs[1], end=op.inputs[2], strides=op.inputs[3],
        value=op.inputs[4], **{m: op.get_attr(m) for m in _SLICE_MASKS})


def _op_of(result) -> Optional[tf.Operation]:
    """The write op of what tf.compat.v1's scatter returned (a ref tensor, or a resource
    variable's unread value)."""
    return result if isinstance(result, tf.Operation) else result.op
