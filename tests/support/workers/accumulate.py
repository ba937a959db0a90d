"""Gradients accumulated over several runs, as TF1 scripts do for a batch larger than
memory: `compute_gradients` of each micro-batch added into non-trainable accumulators
(`assign_add`; an embedding's IndexedSlices made dense first), then `apply_gradients` of
the accumulators, then the accumulators zeroed. Adam on an MLP with an embedding and
a global step.

usage: horovodrun -np N ... python accumulate.py OUT_DIR
       python accumulate.py OUT_DIR --single N   (one device, the N workers' micro-batches
                                                  together, from the job's initial values)
Writes OUT_DIR/<mode>/rank<r>.npz or single.npz (init/<var>, final/<var>) for the modes
HYBRID, AR and PS.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.support import models, one_device  # noqa: E402

tf1 = tf.compat.v1
MICRO, BATCH, STEPS, VOCAB = 3, 4, 3, 12
MODES = {"HYBRID": {"run_mode": "HYBRID"}, "AR": {"run_mode": "AR"}, "PS": {"run_mode": "PS"}}


def build():
    graph = tf.Graph()
    with graph.as_default():
        m = models.mlp_with_embedding(VOCAB)
        x, ids, y, emb, w1, w2, loss = (m[k] for k in ("x", "ids", "y", "emb", "w1", "w2",
                                                        "loss"))
        step = tf1.train.get_or_create_global_step()
        opt = tf1.train.AdamOptimizer(0.05)
        grads = opt.compute_gradients(loss, [emb, w1, w2])
        accums = [tf1.Variable(tf.zeros(v.shape), trainable=False, name=f"accum_{i}")
                  for i, (_, v) in enumerate(grads)]
        add = tf.group(*[a.assign_add(tf.convert_to_tensor(g)) for a, (g, _) in zip(accums, grads)])
        zero = tf.group(*[a.assign(tf.zeros_like(a)) for a in accums])
        apply = opt.apply_gradients([(a / MICRO, v) for a, (_, v) in zip(accums, grads)],
                                    global_step=step)
    return graph, dict(x=x, ids=ids, y=y, add=add, zero=zero, apply=apply)


def data(step, micro, n):
    rng = np.random.RandomState(10 * step + micro)
    return (rng.rand(BATCH * n, 3).astype(np.float32),
            rng.randint(0, VOCAB, size=BATCH * n).astype(np.int64),
            rng.rand(BATCH * n, 1).astype(np.float32))


def train(run, h, rank, n, width):
    for step in range(STEPS):
        run(h["zero"])
        for micro in range(MICRO):
            x, ids, y = data(step, micro, n)
            mine = slice(rank * width, (rank + 1) * width)
            run(h["add"], {h["x"]: x[mine], h["ids"]: ids[mine], h["y"]: y[mine]})
        run(h["apply"])


def main(out, single=None):
    tf1.disable_eager_execution()
    one_device.run_modes(out, single, MODES, build, train, BATCH, variables=lambda g: [
        v for v in g.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)
        if not v.op.name.startswith("accum")])


if __name__ == "__main__":
    one_device.command_line(main)
