"""Epochs as the TF1 NMT tutorial's training loop runs them: an initializable iterator over
`tfpar.shard`ed examples, initialised at each epoch's start (its `skip_count` fed, 0 here),
and trained until the input ends with `OutOfRangeError`; an embedding and a dense layer,
Adam.

The step that raises `OutOfRangeError` must train nothing. (TensorFlow's own sparse Adam
decays its first moment in such a step on one device: that assign reads no gradient and
runs before the input's end is seen. tfpar's routes all wait for the gradients, so the
reference here stops each epoch by counting its steps, with no failing run.)

usage: horovodrun -np N ... python epochs.py OUT_DIR
       python epochs.py OUT_DIR --single N
Writes OUT_DIR/<mode>/rank<r>.npz or single.npz for each of MODES (the embedding on the
servers, allgathered, sharded).
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.support import one_device  # noqa: E402

tf1 = tf.compat.v1
EXAMPLES, VOCAB, BATCH, EPOCHS = 24, 12, 2, 3
MODES = {m: one_device.EVERY_MODE[m] for m in ("HYBRID", "AR", "SHARDED")}


def build(workers=None):
    """workers: None for a worker's graph (its shard of the examples, BATCH a step), N for
    one device's (every example, N x BATCH a step)."""
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(5)
        rng = np.random.RandomState(0)
        ids = rng.randint(0, VOCAB, size=(EXAMPLES, 3)).astype(np.int64)
        y = rng.rand(EXAMPLES, 1).astype(np.float32)
        skip_count = tf1.placeholder(tf.int64, [], name="skip_count")
        dataset = tf.data.Dataset.from_tensor_slices((ids, y))
        if workers is None:
            import tfpar
            dataset = tfpar.shard(dataset)
        dataset = dataset.skip(skip_count).batch(BATCH * (workers or 1), drop_remainder=True)
        iterator = tf1.data.make_initializable_iterator(dataset)
        x, target = iterator.get_next()
        emb = tf1.get_variable("emb", [VOCAB, 4])
        w = tf1.get_variable("w", [4, 1])
        h = tf.reduce_mean(tf.nn.embedding_lookup(emb, x), axis=1)
        loss = tf.reduce_mean(tf.square(tf.matmul(h, w) - target))
        step = tf1.train.get_or_create_global_step()
        train = tf1.train.AdamOptimizer(0.1).minimize(loss, global_step=step)
    return graph, dict(init=iterator.initializer, skip_count=skip_count, train=train)


def main(out, single=None):
    tf1.disable_eager_execution()
    for mode, config in MODES.items():
        folder = os.path.join(out, mode)
        graph, h = build(single)
        variables = graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)
        if single:
            def train(sess):
                for _ in range(EPOCHS):
                    sess.run(h["init"], {h["skip_count"]: 0})
                    for _ in range(EXAMPLES // (BATCH * single)):
                        sess.run(h["train"])
            final = one_device.single_device(graph, variables, os.path.join(folder, "rank0.npz"),
                                             train)
            one_device.save(os.path.join(folder, "single.npz"), variables, final)
            continue
        import tfpar
        with tfpar.get_runner(graph, config=tfpar.Config(**config)) as runner:
            init = runner.run(variables)
            for _ in range(EPOCHS):
                runner.run(h["init"], {h["skip_count"]: 0})
                while True:
                    try:
                        runner.run(h["train"])
                    except tf.errors.OutOfRangeError:
                        break
            final = runner.run(variables)
        one_device.save(os.path.join(folder, f"rank{runner.worker_id}.npz"), variables, final,
                        init)


if __name__ == "__main__":
    one_device.command_line(main)
