"""The running job: Horovod start-up, the job's layout, sessions and the initial broadcast.

No graph decisions here; only what a process needs to take part in the job.
"""
from __future__ import annotations

import os
import socket
from typing import List

import numpy as np
import tensorflow as tf

from tfpar.plan.layout import Layout, job_layout
from tfpar.transform import stages, traffic

def horovod():
    """Horovod's TensorFlow module, initialised (a lone process is a job of size 1)."""
    import horovod.tensorflow as hvd
    if not hvd.is_initialized():
        hvd.init()
    return hvd


def hostname() -> str:
    return os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()


def current_layout() -> Layout:
    """The layout of the running job (every rank's host, gathered from all ranks)."""
    return job_layout(allgather_strings(hostname()))


def allgather_strings(text: str) -> List[str]:
    """Every rank's `text`, in rank order (a Horovod allgather; also a barrier)."""
    hvd = horovod()
    if hvd.size() == 1:
        return [text]
    raw = text.encode()
    lengths = _allgather(np.array([[len(raw)]], np.int64), "tfpar_string_lengths")[:, 0]
    buf = np.zeros((1, int(lengths.max())), np.uint8)
    buf[0, :len(raw)] = np.frombuffer(raw, np.uint8)
    rows = _allgather(buf, "tfpar_strings")
    return [bytes(r[:n]).decode() for r, n in zip(rows, lengths)]


def _allgather(array: np.ndarray, name: str) -> np.ndarray:
    hvd = horovod()
    g = tf.Graph()
    with g.as_default():
        gathered = hvd.allgather(tf.constant(array), name=name)
        with tf.compat.v1.Session(graph=g) as sess:
            return sess.run(gathered)


def session_config(user_config=None, host_gpus=()) -> "tf.compat.v1.ConfigProto":
    """The user's ConfigProto (or a default), with one GPU per process.

    The GPU is the local rank's entry of the host's GPU ids from the resource file, or the
    local rank itself; a `visible_device_list` the user set is kept.
    """
    config = tf.compat.v1.ConfigProto()
    if user_config is not None:
        config.CopyFrom(user_config)
    if tf.config.list_physical_devices("GPU") and not config.gpu_options.visible_device_list:
        local = horovod().local_rank()
        config.gpu_options.visible_device_list = str(host_gpus[local] if host_gpus else local)
        config.gpu_options.allow_growth = True
    return config


def broadcast_variables(graph: tf.Graph) -> list:
    """The variables of `graph` every worker holds a copy of, which the start-up broadcast
    sets to worker 0's values. Not the traffic counters nor the stage markers: each worker
    counts its own bytes and steps, and the chief's markers are not the others' (a
    restore's broadcast would otherwise give every worker the chief's counts)."""
    return [v for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
            + graph.get_collection(tf.compat.v1.GraphKeys.LOCAL_VARIABLES)
            if not v.op.name.startswith((traffic.SCOPE, stages.SCOPE))]


def broadcast_op(graph: tf.Graph, root_rank: int = 0):
    """An op that sets every variable of `graph` to its value on `root_rank`."""
    hvd = horovod()
    with graph.as_default():
        variables = broadcast_variables(graph)
        with tf.compat.v1.name_scope("tfpar/broadcast"):
            if hvd.size() == 1 or not variables:
                return tf.no_op()
            return hvd.broadcast_variables(variables, root_rank)


def init_op(graph: tf.Graph):
    with graph.as_default(), tf.compat.v1.name_scope("tfpar/init"):
        # Tiles of split variables (collection "tfpar_tiles") are set from worker 0's
        # whole initial value as they are made; the broadcast leaves them alone.
        return tf.group(tf.compat.v1.global_variables_initializer(),
                        tf.compat.v1.local_variables_initializer(),
                        tf.compat.v1.variables_initializer(graph.get_collection("tfpar_tiles")),
                        tf.compat.v1.tables_initializer())
