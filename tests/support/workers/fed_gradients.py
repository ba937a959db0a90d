"""Gradients fetched in one run and fed back through placeholders to `apply_gradients`
in another, as TF1 scripts do that look at or change gradients outside the graph (and
as Horovod's optimizer allows): the embedding's gradient fed as the values and indices
of an `IndexedSlices`, the dense ones as arrays, clipped in the graph by their global
norm after the feed; the learning rate fed too. Adam on an MLP with an embedding and a
global step.

usage: horovodrun -np N ... python fed_gradients.py OUT_DIR
       python fed_gradients.py OUT_DIR --single N   (one device, the N workers' batches
                                                     together, from the job's values)
Writes OUT_DIR/<mode>/rank<r>.npz or single.npz (init/<var>, final/<var>) in every mode.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.support import models, one_device  # noqa: E402

tf1 = tf.compat.v1
BATCH, STEPS, VOCAB = 4, 3, 12


def build():
    graph = tf.Graph()
    with graph.as_default():
        m = models.mlp_with_embedding(VOCAB)
        step = tf1.train.get_or_create_global_step()
        lr = tf1.placeholder(tf.float32, [], name="learning_rate")
        opt = tf1.train.AdamOptimizer(lr)
        grads = opt.compute_gradients(m["loss"], [m["emb"], m["w1"], m["w2"]])
        fed = []
        for g, v in grads:
            if isinstance(g, tf.IndexedSlices):  # the rows and their ids, as fetched
                fed.append(tf.IndexedSlices(
                    tf1.placeholder(tf.float32, [None] + v.shape.as_list()[1:]),
                    tf1.placeholder(tf.int64, [None]), tf.constant(v.shape.as_list())))
            else:
                fed.append(tf1.placeholder(tf.float32, v.shape))
        clipped, _ = tf.clip_by_global_norm(fed, 0.05)
        apply = opt.apply_gradients(zip(clipped, [v for _, v in grads]), global_step=step)
    return graph, dict(m, lr=lr, grads=[g for g, _ in grads], fed=fed, apply=apply)


def train(run, h, rank, n, width):
    for step in range(STEPS):
        rng = np.random.RandomState(step)
        x, ids, y = (rng.rand(BATCH * n, 3).astype(np.float32),
                     rng.randint(0, VOCAB, size=BATCH * n), rng.rand(BATCH * n, 1))
        mine = slice(rank * width, (rank + 1) * width)
        got = run(h["grads"], {h["x"]: x[mine], h["ids"]: ids[mine], h["y"]: y[mine]})
        feed = {h["lr"]: 0.05 / (1 + step)}
        for placeholder, value in zip(h["fed"], got):
            if isinstance(placeholder, tf.IndexedSlices):
                feed.update({placeholder.values: value.values,
                             placeholder.indices: value.indices})
            else:
                feed[placeholder] = value
        run(h["apply"], feed)


def main(out, single=None):
    tf1.disable_eager_execution()
    one_device.run_modes(out, single, one_device.EVERY_MODE, build, train, BATCH)


if __name__ == "__main__":
    one_device.command_line(main)
