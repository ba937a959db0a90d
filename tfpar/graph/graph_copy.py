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
            meta = tf.compat.v1.train.export_meta_graph(graph=graph_or_meta)
        _drop_function_ops(meta)
        return meta
    raise TfparError(f"expected a tf.Graph or a MetaGraphDef, got {type(graph_or_meta).__name__}")


def copy_graph(graph_or_meta) -> tf.Graph:
    """A new tf.Graph with the same ops, names and collections (variables included)."""
    meta = to_meta_graph(graph_or_meta)
    new = tf.Graph()
    with new.as_default():
        tf.compat.v1.train.import_meta_graph(meta, clear_devices=True)
    return new


def _drop_function_ops(meta) -> None:
    """Removes from `meta`'s collections the names of ops that live in a function body, not
    in the graph: an optimizer's update built in a TF2 `tf.cond` branch adds its op to the
    graph's TRAIN_OP collection, where importing the MetaGraphDef cannot find it."""
    ops = {node.name for node in meta.graph_def.node}
    for collection in meta.collection_def.values():
        if collection.HasField("node_list"):
            kept = [n for n in collection.node_list.value if n.split(":")[0].lstrip("^") in ops]
            del collection.node_list.value[:]
            collection.node_list.value.extend(kept)
