"""Two train ops run by turns, as a GAN's script runs them: a generator (an embedding and
two layers, Adam) and a discriminator (an embedding and a layer, SGD), each with its own
optimizer over its own variables, their steps in separate session runs, the generator's
with a global step and without the real input (`y`) that only the discriminator reads.

usage: horovodrun -np N ... python gan.py OUT_DIR
       python gan.py OUT_DIR --single N   (one device, the N workers' batches together,
                                          from the job's values)
Writes OUT_DIR/<mode>/rank<r>.npz (init/<var>, final/<var>) or single.npz for HYBRID (both
embeddings on the parameter servers, each updated by one side's runs), PS (every variable
there), AR and SHARDED (sparse_route="sharded").
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.support import models, one_device  # noqa: E402

tf1 = tf.compat.v1
BATCH, STEPS, VOCAB = 4, 3, 12
MODES = one_device.EVERY_MODE


def build():
    graph = tf.Graph()
    with graph.as_default():
        m = models.mlp_with_embedding(VOCAB)  # the generator: emb, w1, w2
        fake = tf.matmul(tf.nn.relu(tf.matmul(m["x"] + tf.nn.embedding_lookup(
            m["emb"], m["ids"]), m["w1"])), m["w2"])
        with tf1.variable_scope("discriminator"):
            d = tf1.get_variable("d", [1, 1])
            d_emb = tf1.get_variable("d_emb", [VOCAB, 1])
        judged = tf.nn.embedding_lookup(d_emb, m["ids"])
        real_score = tf.matmul(m["y"], d) + judged
        fake_score = tf.matmul(fake, d) + judged
        d_loss = tf.reduce_mean(tf.square(real_score - 1.0)) + tf.reduce_mean(
            tf.square(fake_score))
        g_loss = tf.reduce_mean(tf.square(fake_score - 1.0))
        step = tf1.train.get_or_create_global_step()
        g_train = tf1.train.AdamOptimizer(0.05).minimize(
            g_loss, var_list=[m["emb"], m["w1"], m["w2"]], global_step=step)
        d_train = tf1.train.GradientDescentOptimizer(0.1).minimize(d_loss, var_list=[d, d_emb])
    return graph, dict(x=m["x"], ids=m["ids"], y=m["y"], g_train=g_train, d_train=d_train)


def data(step, n):
    rng = np.random.RandomState(30 + step)
    return (rng.rand(BATCH * n, 3).astype(np.float32),
            rng.randint(0, VOCAB, size=BATCH * n).astype(np.int64),
            rng.rand(BATCH * n, 1).astype(np.float32))


def train(run, h, rank, n, width):
    """By turns: the discriminator's step, then the generator's, on the same batch."""
    for step in range(STEPS):
        x, ids, y = data(step, n)
        mine = slice(rank * BATCH, rank * BATCH + width)
        feed = {h["x"]: x[mine], h["ids"]: ids[mine]}
        run(h["d_train"], {**feed, h["y"]: y[mine]})
        run(h["g_train"], feed)  # no real input: the discriminator's run alone reads it


def main(out, single=None):
    tf1.disable_eager_execution()
    one_device.run_modes(out, single, MODES, build, train, BATCH)


if __name__ == "__main__":
    one_device.command_line(main)
