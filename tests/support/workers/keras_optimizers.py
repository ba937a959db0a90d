"""A TF1 script built of Keras layers and trained by a Keras optimizer, as tf.keras users
write one in graph mode: an `Embedding`, two `Dense` layers, and the legacy optimizer's
`apply_gradients` of `tf.gradients` (its slots and updates are Keras's own ops; for the
embedding's rows, Adam's is an assign of each whole slot times its decay, then a
`scatter_add` of the rows; SGD with momentum's is `ResourceSparseApplyKerasMomentum`).

usage: horovodrun -np N ... python keras_optimizers.py OUT_DIR
       python keras_optimizers.py OUT_DIR --single N
Writes OUT_DIR/<optimizer>/<mode>/rank<r>.npz or single.npz for its modes (`modes`).
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras is Keras 2 (tf_keras)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.support import one_device  # noqa: E402

tf1 = tf.compat.v1
VOCAB, WIDTH, BATCH, STEPS = 10, 8, 4, 3
OPTIMIZERS = {
    "adam": lambda: tf.keras.optimizers.legacy.Adam(0.05),
    "sgd_momentum": lambda: tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9),
    "ftrl": lambda: tf.keras.optimizers.legacy.Ftrl(0.1),
    "rmsprop": lambda: tf.keras.optimizers.legacy.RMSprop(0.01),
}


def build(optimizer):
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(7)
        ids = tf1.placeholder(tf.int64, [None], name="ids")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        layers = [tf.keras.layers.Embedding(VOCAB, WIDTH),
                  tf.keras.layers.Dense(12, activation="relu"), tf.keras.layers.Dense(1)]
        out = ids
        for layer in layers:
            out = layer(out)
        loss = tf.reduce_mean(tf.square(out - y))
        params = [w for layer in layers for w in layer.trainable_weights]
        train = OPTIMIZERS[optimizer]().apply_gradients(zip(tf.gradients(loss, params), params))
    return graph, dict(ids=ids, y=y, train=train)


def train(run, h, rank, n, width):
    for step in range(STEPS):
        rng = np.random.RandomState(20 + step)
        ids = rng.randint(0, VOCAB, size=BATCH * n).astype(np.int64)
        y = rng.rand(BATCH * n, 1).astype(np.float32)
        mine = slice(rank * BATCH, rank * BATCH + width)
        run(h["train"], {h["ids"]: ids[mine], h["y"]: y[mine]})


def modes(optimizer):
    """Every mode for Adam; the embedding on the servers, allgathered and sharded for the
    others (PS mode differs from HYBRID in the dense layers only)."""
    return {m: c for m, c in one_device.EVERY_MODE.items() if optimizer == "adam" or m != "PS"}


def main(out, single=None):
    tf1.disable_eager_execution()
    for optimizer in OPTIMIZERS:
        one_device.run_modes(os.path.join(out, optimizer), single, modes(optimizer),
                             lambda: build(optimizer), train, BATCH,
                             extra=lambda runner: {"plan": np.array(runner.plan.to_json())})


if __name__ == "__main__":
    one_device.command_line(main)
