"""The ops of a graph whose names start with a prefix (an optimizer update's scope), found
by bisection in a sorted index of their names.

A rewrite asks for an update's scope once per variable and use; scanning every op's name
each time cost seconds on the field's scripts (each name is a call into TensorFlow's C
API). A `tf.Graph` only grows, so the index takes in the ops added since it last looked.
"""
from __future__ import annotations

import bisect
from typing import List, Tuple

import tensorflow as tf


class OpsByPrefix:
    """`with_prefix(p)`: the ops of `graph` whose names start with p, in creation order."""

    def __init__(self, graph: tf.Graph):
        self._graph = graph
        self._seen = 0  # ops taken in, the first of get_operations()'s creation order
        self._names: List[str] = []  # sorted
        self._ops: List[Tuple[int, tf.Operation]] = []  # (creation order, op), as _names

    def with_prefix(self, prefix: str) -> List[tf.Operation]:
        ops = self._graph.get_operations()
        for order in range(self._seen, len(ops)):
            name = ops[order].name
            k = bisect.bisect(self._names, name)
            self._names.insert(k, name)
            self._ops.insert(k, (order, ops[order]))
        self._seen = len(ops)
        start = bisect.bisect_left(self._names, prefix)
        stop = start
        while stop < len(self._names) and self._names[stop].startswith(prefix):
            stop += 1
        return [op for _, op in sorted(self._ops[start:stop], key=lambda e: e[0])]
