"""The only place tfpar touches private TensorFlow graph APIs.

Rewrites need to rewire existing ops and change constants in place, which TensorFlow's
public API cannot do. Keeping every private call here means a TensorFlow upgrade breaks
one small module, and its tests say so.
"""
from __future__ import annotations

from typing import Iterable

import tensorflow as tf


def replace_uses(old: tf.Tensor, new: tf.Tensor, keep: Iterable[tf.Operation] = ()) -> int:
    """Makes every consumer of `old` (except the ops in `keep`) read `new`; returns how many."""
    keep = set(keep)
    count = 0
    for consumer in list(old.consumers()):
        if consumer in keep:
            continue
        for i, t in enumerate(consumer.inputs):
            if t is old:
                consumer._update_input(i, new)  # pylint: disable=protected-access
                count += 1
    return count
