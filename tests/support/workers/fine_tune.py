"""A fine-tuning script's two phases: the head trained alone (Adam, its own minimize()),
then the whole model (Momentum, another minimize() of the same loss, which updates the
head too), each phase its own session runs.

usage: horovodrun -np N ... python fine_tune.py OUT_DIR
       python fine_tune.py OUT_DIR --single N   (one device, the N workers' batches together,
                                                from the job's values)
Writes OUT_DIR/<mode>/rank<r>.npz (init/<var>, final/<var>) or single.npz for HYBRID (both
tables on the parameter servers), PS (every variable there), AR and SHARDED.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.support import one_device  # noqa: E402

tf1 = tf.compat.v1
BATCH, STEPS, VOCAB = 4, 4, 12
MODES = one_device.EVERY_MODE


def build():
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        ids = tf1.placeholder(tf.int64, [None], name="ids")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        with tf1.variable_scope("body"):
            emb = tf1.get_variable("emb", [VOCAB, 3])
            w = tf1.get_variable("w", [3, 4])
        with tf1.variable_scope("head"):
            out = tf1.get_variable("w", [4, 1])
            bias = tf1.get_variable("bias", [VOCAB, 1])  # a per-id bias: a table
        h = tf.nn.relu(tf.matmul(x + tf.nn.embedding_lookup(emb, ids), w))
        pred = tf.matmul(h, out) + tf.nn.embedding_lookup(bias, ids)
        loss = tf.reduce_mean(tf.square(pred - y))
        step = tf1.train.get_or_create_global_step()
        head = tf1.train.AdamOptimizer(0.05).minimize(loss, var_list=[out, bias],
                                                      global_step=step)
        whole = tf1.train.MomentumOptimizer(0.05, 0.9).minimize(loss, global_step=step)
    return graph, dict(x=x, ids=ids, y=y, head=head, whole=whole)


def data(step, n):
    rng = np.random.RandomState(50 + step)
    return (rng.rand(BATCH * n, 3).astype(np.float32),
            rng.randint(0, VOCAB, size=BATCH * n).astype(np.int64),
            rng.rand(BATCH * n, 1).astype(np.float32))


def train(run, h, rank, n, width):
    """Two steps of the head alone, then two of the whole model."""
    for step in range(STEPS):
        x, ids, y = data(step, n)
        mine = slice(rank * BATCH, rank * BATCH + width)
        run(h["head"] if step < 2 else h["whole"],
            {h["x"]: x[mine], h["ids"]: ids[mine], h["y"]: y[mine]})


def main(out, single=None):
    tf1.disable_eager_execution()
    one_device.run_modes(out, single, MODES, build, train, BATCH)


if __name__ == "__main__":
    one_device.command_line(main)
