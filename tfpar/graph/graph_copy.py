"""Copying a user's graph so rewrites never touch the original."""
from __future__ import annotations

import tensorflow as tf

from tfpar.errors import TfparError


def to_meta_graph(graph_or_meta) -> "tf.compat.v1.MetaGraphDef":
    """A MetaGraphDef (graph plus collections) for a tf.Graph or a MetaGraphDef."""
    if isinstance(graph_or_meta, tf.compat.v1.MetaGraphDef):
        return graph_or_meta
    if isinstance(graph_or_meta, tf.Graph):
        # export_meta_graph warns about collections it cannot serialise; those hold Python
        # objects tfpar never reads. Inside the graph: with eager execution on (TF2's
        # default), it refuses to run outside one, where a plain Session would not.
        with graph_or_meta.as_default():
            return tf.compat.v1.train.export_meta_graph(graph=graph_or_meta)
    raise TfparError(f"expected a tf.Graph or a MetaGraphDef, got {type(graph_or_meta).__name__}")


def copy_graph(graph_or_meta) -> tf.Graph:
    """A new tf.Graph with the same ops, names and collections (variables included)."""
    meta = to_meta_graph(graph_or_meta)
    new = tf.Graph()
    with new.as_default():
        tf.compat.v1.train.import_meta_graph(meta, clear_devices=True)
    return new
