"""Data-parallel training of a dense MLP with tfpar.

    horovodrun -np 2 -H localhost:2 python examples/mlp.py [--steps 200] [--data my.npz]

The graph is ordinary single-device tf.compat.v1 code; tfpar changes two lines (marked).
Data: a synthetic classification task (labels from a random "teacher" network) generated
here, or your own .npz file holding arrays `x` (float, [n, features]) and `y` (int, [n]).
"""
import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar  # noqa: E402

tf1 = tf.compat.v1
tf1.disable_eager_execution()


def make_data(n=20000, features=32, classes=10, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(n, features).astype(np.float32)
    teacher = rng.randn(features, 64).astype(np.float32), rng.randn(64, classes).astype(np.float32)
    y = np.argmax(np.tanh(x @ teacher[0]) @ teacher[1], axis=1).astype(np.int64)
    return x, y


def build_graph(x=None, y=None, batch_size=64, hidden=(256, 256), lr=1e-3,
                wrap_optimizer=None):
    """The single-device training graph; returns (graph, loss, accuracy, train_op).

    wrap_optimizer: a function applied to the optimizer (for baselines such as Horovod's
    DistributedOptimizer); tfpar needs none."""
    if x is None:
        x, y = make_data()
    classes = int(y.max()) + 1
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(1)
        dataset = tf.data.Dataset.from_tensor_slices((x, y))
        dataset = tfpar.shard(dataset)                          # tfpar line 1 of 2
        dataset = dataset.shuffle(10000, seed=0).repeat().batch(batch_size, drop_remainder=True)
        features, labels = tf1.data.make_one_shot_iterator(dataset).get_next()
        h = features
        for i, width in enumerate(hidden):
            h = tf.nn.relu(_dense(h, width, f"dense{i}"))
        logits = _dense(h, classes, "logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits), name="loss")
        accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), labels), tf.float32),
                                  name="accuracy")
        step = tf1.train.get_or_create_global_step()
        optimizer = tf1.train.AdamOptimizer(lr)
        if wrap_optimizer is not None:
            optimizer = wrap_optimizer(optimizer)
        train_op = optimizer.minimize(loss, global_step=step)
    return graph, loss, accuracy, train_op


def _dense(h, width, name):
    with tf1.variable_scope(name):
        w = tf1.get_variable("kernel", [h.shape[-1], width],
                             initializer=tf1.glorot_uniform_initializer())
        b = tf1.get_variable("bias", [width], initializer=tf1.zeros_initializer())
    return tf.matmul(h, w) + b


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    p.add_argument("--data", help=".npz with arrays x [n, features] and y [n] (default: generated)")
    p.add_argument("--log-every", type=int, default=50)
    args = p.parse_args()
    x = y = None
    if args.data:
        with np.load(args.data) as d:
            x, y = d["x"].astype(np.float32), d["y"].astype(np.int64)
    graph, loss, accuracy, train_op = build_graph(x, y, args.batch_size)

    with tfpar.get_runner(graph) as runner:                    # tfpar line 2 of 2
        if runner.is_chief:
            print(runner.plan)
        start = last = time.time()
        for step in range(1, args.steps + 1):
            loss_v, acc_v, _ = runner.run([loss, accuracy, train_op])
            if step % args.log_every == 0 and runner.is_chief:
                now = time.time()
                print(f"step {step:5d}  loss {loss_v:.4f}  accuracy {acc_v:.3f}  "
                      f"{args.log_every / (now - last):.1f} steps/s "
                      f"({args.log_every * args.batch_size * runner.num_workers / (now - last):.0f}"
                      " examples/s)", flush=True)
                last = now
        if runner.is_chief:
            print(f"done: {args.steps} steps on {runner.num_workers} workers in "
                  f"{time.time() - start:.1f} s; global step {runner.run('global_step:0')}")


if __name__ == "__main__":
    main()
