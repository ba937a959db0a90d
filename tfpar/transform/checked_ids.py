"""A lookup's ids checked against its table's rows, where the table is split: on one
device `embedding_lookup` names an id out of range; split over parameter servers or
workers, the gather that fails is a part's, on another process, with part-local row
numbers. The check on the worker that looks up names the user's table and ids."""
from __future__ import annotations

import tensorflow as tf


def checked_ids(variable: str, rows: int, ids: tf.Tensor) -> tf.Tensor:
    """`ids`, after a check that fails naming `variable`, the ids not in [0, rows), and
    its rows."""
    bad = tf.boolean_mask(ids, tf.logical_or(ids < 0, ids >= rows))
    check = tf.debugging.Assert(
        tf.equal(tf.size(bad), 0),
        [f"tfpar: a lookup in variable {variable} got ids", bad,
         f"which are not in [0, {rows}) (its rows)"], summarize=20)
    with tf.control_dependencies([check]):
        return tf.identity(ids)
