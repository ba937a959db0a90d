"""Horovod's TF1 example `tensorflow_mnist.py`, with the changes the README's "From Horovod
to tfpar" lists: `hvd.DistributedOptimizer(opt)` deleted, `tf.train.MonitoredTrainingSession`
changed to `tfpar.MonitoredTrainingSession`, the broadcast deleted (Horovod 0.28 has no
`BroadcastGlobalVariablesHook` on TF >= 2.16; its scripts run `hvd.broadcast_global_variables(0)`
instead). Everything else is Horovod's shape: hvd.init(), conv layers, `StopAtStepHook`, `LoggingTensorHook`, a ConfigProto with the local rank's GPU, a
checkpoint_dir on rank 0 only, a feed-dict batch generator. Generated images stand in for
MNIST (no downloads).

usage: horovodrun -np N python horovod_mnist.py CHECKPOINT_DIR OUT_NPZ [--unchanged]
--unchanged keeps hvd.DistributedOptimizer and the broadcast: tfpar must refuse them clearly.
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar  # noqa: E402

tf1 = tf.compat.v1
STEPS = 6


def conv_model(feature, target):
    """Horovod's conv_model (tf.layers instead of tf.contrib.layers), without dropout so
    that a test can compare values."""
    target = tf.one_hot(tf.cast(target, tf.int32), 10, 1, 0)
    feature = tf.reshape(feature, [-1, 28, 28, 1])
    with tf1.variable_scope("conv_layer1"):
        h_conv1 = tf1.layers.conv2d(feature, 8, kernel_size=[5, 5], activation=tf.nn.relu,
                                    padding="SAME")
        h_pool1 = tf.nn.max_pool2d(h_conv1, ksize=2, strides=2, padding="SAME")
    with tf1.variable_scope("conv_layer2"):
        h_conv2 = tf1.layers.conv2d(h_pool1, 16, kernel_size=[5, 5], activation=tf.nn.relu,
                                    padding="SAME")
        h_pool2 = tf.nn.max_pool2d(h_conv2, ksize=2, strides=2, padding="SAME")
        h_pool2_flat = tf.reshape(h_pool2, [-1, 7 * 7 * 16])
    h_fc1 = tf1.layers.dense(h_pool2_flat, 64, activation=tf.nn.relu)
    logits = tf1.layers.dense(h_fc1, 10, activation=None)
    loss = tf1.losses.softmax_cross_entropy(target, logits)
    return tf.argmax(logits, 1), loss


def build(unchanged=False):
    with tf1.name_scope("input"):
        image = tf1.placeholder(tf.float32, [None, 784], name="image")
        label = tf1.placeholder(tf.float32, [None], name="label")
    predict, loss = conv_model(image, label)
    opt = tf1.train.AdamOptimizer(0.001)
    if unchanged:
        opt = hvd.DistributedOptimizer(opt)
    global_step = tf1.train.get_or_create_global_step()
    train_op = opt.minimize(loss, global_step=global_step)
    return image, label, loss, global_step, train_op


def batches(batch_size=16):
    rng = np.random.RandomState(hvd.rank())
    while True:
        yield (rng.rand(batch_size, 784).astype(np.float32),
               rng.randint(0, 10, batch_size).astype(np.float32))


def main(checkpoint_dir, out, unchanged=False):
    hvd.init()
    image, label, loss, global_step, train_op = build(unchanged)
    variables = tf1.global_variables()
    final = tf1.train.FinalOpsHook({v.op.name: v for v in variables})
    if unchanged:
        hvd.broadcast_global_variables(0)
    hooks = [tf1.train.StopAtStepHook(last_step=STEPS),
             tf1.train.LoggingTensorHook(tensors={"step": global_step, "loss": loss},
                                         every_n_iter=2), final]
    config = tf1.ConfigProto()
    config.gpu_options.allow_growth = True
    config.gpu_options.visible_device_list = str(hvd.local_rank())
    checkpoint_dir = checkpoint_dir if hvd.rank() == 0 else None
    generator = batches()
    with tfpar.MonitoredTrainingSession(checkpoint_dir=checkpoint_dir, hooks=hooks,
                                        config=config) as mon_sess:
        while not mon_sess.should_stop():
            image_, label_ = next(generator)
            mon_sess.run(train_op, feed_dict={image: image_, label: label_})
    if hvd.rank() == 0:
        np.savez(out, **final.final_ops_values)


if __name__ == "__main__":
    tf1.disable_v2_behavior()  # a TF1 script (not on import: a test builds its graph too)
    tf1.logging.set_verbosity(tf1.logging.INFO)
    main(sys.argv[1], sys.argv[2], unchanged="--unchanged" in sys.argv)
