"""A small image classifier with batch norm as TF1 tutorials write them, trained with tfpar.

    horovodrun -np 2 -H localhost:2 python examples/cnn.py

The shape of TensorFlow's TF1 CIFAR-10 and ResNet scripts, unchanged for tfpar:
`tf.compat.v1.layers.conv2d` and `batch_normalization(training=is_training)` on 4-D
activations (a fused batch norm inside `tf.cond`, since the flag is a tensor), ReLU, max
pooling, a dense layer with a batch norm on 2-D activations (`tf.nn.moments`), L2 weight
decay over the kernels, a piecewise-constant learning rate on the global step, Momentum,
and the batch norms' `UPDATE_OPS` run before each step. Evaluation feeds
`is_training=False` (the moving averages). tfpar normalises every batch norm over the
global batch, so training equals one device's on the concatenated batch. The two tfpar
lines are marked. `--tf1` builds it as a TF1 script would after
`tf.compat.v1.disable_v2_behavior()` (reference variables, v1 control flow).

Data: generated images whose class is a coloured pattern plus noise (no download), or
your own `.npz` with `images` [n, height, width, channels] and integer `labels` (`--data`).
"""
import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar  # noqa: E402  (before any layer is built: it selects Keras 2 for tf.compat.v1)

tf1 = tf.compat.v1


def generated_images(n, size=8, classes=4, seed=0):
    """`n` images [size, size, 3]: class k brightens channel k % 3 in band k, plus noise."""
    rng = np.random.RandomState(seed)
    labels = rng.randint(0, classes, size=n).astype(np.int32)
    images = rng.normal(0.0, 1.0, size=(n, size, size, 3)).astype(np.float32)
    band = size // classes
    for k in range(classes):
        images[labels == k, k * band:(k + 1) * band, :, k % 3] += 0.5
    return images, labels


def build_graph(size=8, channels=3, classes=4, filters=(8, 16), dense=16, lr=0.1,
                weight_decay=1e-3, data=None, batch_size=32):
    """The classifier's graph. Fed by placeholders `images`, `labels` and `is_training`
    (default True) unless `data` (arrays of images and labels) is given: then each worker
    reads its shard of them, shuffled, in batches of `batch_size` (`images` and `labels`
    can still be fed). Returns (graph, handles)."""
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(1)
        is_training = tf1.placeholder_with_default(True, [], name="is_training")
        if data is None:
            images = tf1.placeholder(tf.float32, [None, size, size, channels], name="images")
            labels = tf1.placeholder(tf.int32, [None], name="labels")
        else:
            dataset = tf.data.Dataset.from_tensor_slices(data)
            dataset = tfpar.shard(dataset)                               # tfpar line 1 of 2
            dataset = dataset.shuffle(10_000, seed=0).repeat().batch(batch_size,
                                                                     drop_remainder=True)
            images, labels = tf1.data.make_one_shot_iterator(dataset).get_next()
        x = images
        for i, f in enumerate(filters):
            x = tf1.layers.conv2d(x, f, 3, padding="same", use_bias=False, name=f"conv{i}")
            x = tf1.layers.batch_normalization(x, training=is_training, momentum=0.9,
                                               name=f"conv{i}_bn")
            x = tf1.layers.max_pooling2d(tf.nn.relu(x), 2, 2)
        x = tf1.layers.flatten(x)
        x = tf1.layers.dense(x, dense, use_bias=False, name="fc")
        x = tf.nn.relu(tf1.layers.batch_normalization(x, training=is_training, momentum=0.9,
                                                      name="fc_bn"))
        logits = tf1.layers.dense(x, classes, name="logits")
        cross_entropy = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
        kernels = [v for v in tf1.trainable_variables() if "kernel" in v.name]
        loss = tf.identity(cross_entropy + weight_decay * tf.add_n(
            [tf.nn.l2_loss(k) for k in kernels]), name="loss")
        accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32),
                                                   labels), tf.float32), name="accuracy")
        step = tf1.train.get_or_create_global_step()
        rate = tf1.train.piecewise_constant(step, [2, 100], [lr, lr / 2, lr / 10])
        optimizer = tf1.train.MomentumOptimizer(rate, 0.9)
        with tf1.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            train_op = optimizer.minimize(loss, global_step=step)
    return graph, {"images": images, "labels": labels, "is_training": is_training,
                   "loss": loss, "accuracy": accuracy, "train_op": train_op}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=32, help="images per worker per step")
    parser.add_argument("--data", help="an .npz with images and labels (default: generated)")
    parser.add_argument("--run-mode", default="HYBRID", choices=["HYBRID", "AR", "PS"])
    parser.add_argument("--checkpoint-dir", help="save here (and TensorBoard's summaries), "
                        "resume from here")
    parser.add_argument("--tf1", action="store_true",
                        help="tf.compat.v1.disable_v2_behavior() first, as TF1 scripts do")
    args = parser.parse_args()
    tf1.logging.set_verbosity(tf1.logging.INFO)  # LoggingTensorHook's lines, as TF1 scripts
    if args.tf1:
        tf1.disable_v2_behavior()
    else:
        tf1.disable_eager_execution()
    if args.data:
        with np.load(args.data) as data:
            images, labels = data["images"].astype(np.float32), data["labels"].astype(np.int32)
    else:
        images, labels = generated_images(4096)
    held_out = len(images) // 8  # evaluated with the moving averages after training
    graph, h = build_graph(images.shape[1], channels=images.shape[3],
                           classes=int(labels.max()) + 1,
                           data=(images[held_out:], labels[held_out:]),
                           batch_size=args.batch)
    config = tfpar.Config(run_mode=args.run_mode)
    with graph.as_default():
        step = tf1.train.get_or_create_global_step()
        tf1.summary.scalar("loss", h["loss"])
        log = tf1.train.LoggingTensorHook({"step": step, "loss": h["loss"]}, every_n_iter=25,
                                          formatter=lambda v: f"step {v['step']}: loss "
                                                              f"{v['loss']:.4f}")
        with tfpar.MonitoredTrainingSession(                             # tfpar line 2 of 2
                checkpoint_dir=args.checkpoint_dir, tfpar_config=config,
                hooks=[tf1.train.StopAtStepHook(last_step=args.steps)],
                chief_only_hooks=[log]) as sess:
            if sess.is_chief:
                print(sess.runner.plan, flush=True)
            while not sess.should_stop():
                sess.run(h["train_op"])
            # Every worker evaluates: the batch norms' statistics are allreduced in the
            # graph. Fed batch by batch (the dataset's batches have a static size); through
            # the runner, as these runs are not training steps for the hooks.
            b, correct = args.batch, 0.0
            for lo in range(0, held_out - b + 1, b):
                correct += b * sess.runner.run(h["accuracy"], {
                    h["images"]: images[lo:lo + b], h["labels"]: labels[lo:lo + b],
                    h["is_training"]: False})
            if sess.is_chief:
                print(f"held-out accuracy {correct / (held_out // b * b):.3f} "
                      "(moving averages)", flush=True)


if __name__ == "__main__":
    main()
