"""Giving each worker a disjoint slice of the input."""
from __future__ import annotations

import os

import tensorflow as tf

# Graph collections naming the shard constants, rewritten per worker by get_runner so a
# graph built elsewhere (e.g. a saved MetaGraphDef) still shards for the worker running it.
NUM_SHARDS_KEY = "tfpar_num_shards"
SHARD_INDEX_KEY = "tfpar_shard_index"


def worker_from_environment():
    """(num_workers, worker_id) of this process in a horovodrun/mpirun job, or (1, 0)."""
    for size_var, rank_var in (("HOROVOD_SIZE", "HOROVOD_RANK"),
                               ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
                               ("PMI_SIZE", "PMI_RANK")):
        if size_var in os.environ and rank_var in os.environ:
            return int(os.environ[size_var]), int(os.environ[rank_var])
    return 1, 0


def shard(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """This worker's slice of `dataset`: elements i, i+N, i+2N, ... for worker i of N.

    The slices of all workers are disjoint and together hold every element. Shard before
    shuffling and batching (shuffle with the same seed on every worker, or after sharding),
    and before `map` for cheaper input. For feed-dict input, use `runner.worker_id` and
    `runner.num_workers` to pick each worker's rows instead.
    """
    n, i = worker_from_environment()
    if tf.executing_eagerly():
        return dataset.shard(n, i)
    with tf.compat.v1.name_scope("tfpar_shard"):
        num = tf.constant(n, tf.int64, name="num_shards")
        index = tf.constant(i, tf.int64, name="shard_index")
    tf.compat.v1.add_to_collection(NUM_SHARDS_KEY, num)
    tf.compat.v1.add_to_collection(SHARD_INDEX_KEY, index)
    return dataset.shard(num, index)


def with_shard_values(meta, num_workers: int, worker_id: int):
    """A copy of MetaGraphDef `meta` whose `tfpar.shard` constants select this worker's slice.

    The rewrite is on the proto because a one-shot iterator copies its dataset, constants
    included, into a library function: the constants must change there too.
    """
    targets = {}
    for key, value in ((NUM_SHARDS_KEY, num_workers), (SHARD_INDEX_KEY, worker_id)):
        for name in meta.collection_def[key].node_list.value if key in meta.collection_def else ():
            targets[name.split(":")[0]] = value
    if not targets:
        return meta
    out = tf.compat.v1.MetaGraphDef()
    out.CopyFrom(meta)
    nodes = list(out.graph_def.node)
    for function in out.graph_def.library.function:
        nodes.extend(function.node_def)
    for node in nodes:
        if node.op == "Const" and node.name in targets:
            node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(targets[node.name], tf.int64))
    return out
