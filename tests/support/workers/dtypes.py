"""Tables of two dtypes in one model: a float64 table (a scientific script's precision)
beside a float32 one cast up, and a float64 layer, trained by Adam: their lookups and
gradients travel apart by dtype on every route. Then, in the same process, the model
again in HYBRID (its tables on the servers, the layer on the worker) all in float32
(HYBRID_FLOAT32): a second model of one script, whose variables have the first one's
names.

usage: horovodrun -np N ... python dtypes.py OUT_DIR
       python dtypes.py OUT_DIR --single N   (one device, the N workers' batches together,
                                              from the job's initial values)
Writes OUT_DIR/<mode>/rank<r>.npz or single.npz (init/<var>, final/<var>) in every mode
and HYBRID_FLOAT32.
"""
import functools
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.support import one_device  # noqa: E402

tf1 = tf.compat.v1
VOCAB, BATCH, STEPS = 12, 2, 3


def build(dtype=tf.float64):
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(5)
        ids = tf1.placeholder(tf.int64, [None, 3], name="ids")
        y = tf1.placeholder(dtype, [None, 1], name="y")
        wide = tf1.get_variable("wide", [VOCAB, 4], dtype=dtype)
        narrow = tf1.get_variable("narrow", [VOCAB, 4], dtype=tf.float32)
        w = tf1.get_variable("w", [4, 1], dtype=dtype)
        rows = (tf.nn.embedding_lookup(wide, ids)
                + tf.cast(tf.nn.embedding_lookup(narrow, ids), dtype))
        loss = tf.reduce_mean(tf.square(tf.matmul(tf.reduce_mean(rows, axis=1), w) - y))
        step = tf1.train.get_or_create_global_step()
        train = tf1.train.AdamOptimizer(0.1).minimize(loss, global_step=step)
    return graph, dict(ids=ids, y=y, train=train)


def train(run, h, rank, n, width):
    for step in range(STEPS):
        rng = np.random.RandomState(step)
        ids, y = rng.randint(0, VOCAB, size=(BATCH * n, 3)), rng.rand(BATCH * n, 1)
        mine = slice(rank * width, (rank + 1) * width)
        run(h["train"], {h["ids"]: ids[mine], h["y"]: y[mine]})


def main(out, single=None):
    tf1.disable_eager_execution()
    one_device.run_modes(out, single, one_device.EVERY_MODE, build, train, BATCH)
    one_device.run_modes(out, single, {"HYBRID_FLOAT32": one_device.EVERY_MODE["HYBRID"]},
                         functools.partial(build, tf.float32), train, BATCH)


if __name__ == "__main__":
    one_device.command_line(main)
