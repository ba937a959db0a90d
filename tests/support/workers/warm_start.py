"""A fine-tuning script's warm start, as Google BERT's run_classifier.py makes it:
`get_assignment_map_from_checkpoint` maps the trainable variables the pre-trained
checkpoint holds, `tf.compat.v1.train.init_from_checkpoint` makes their initialisers
restore from it, and a new head (`output_weights`) starts from its own initialiser. The
script runs `global_variables_initializer()` first, then trains: an embedding, two
`tf.compat.v1.layers.dense` layers, the head, Adam.

usage: python warm_start.py OUT_DIR --make          (writes the pre-trained checkpoint)
       horovodrun -np N ... python warm_start.py OUT_DIR
       python warm_start.py OUT_DIR --single N     (one device, the N workers' batches
                                                    together, from the job's values)
Writes OUT_DIR/<mode>/rank<r>.npz (init/<var>: after the initialiser's run, final/<var>)
or single.npz for HYBRID (the embedding on the parameter servers), AR, PS, SHARDED
(sparse_route="sharded") and TILED (both kernels split over 2 workers).
"""
import collections
import os
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.support import one_device  # noqa: E402

tf1 = tf.compat.v1
VOCAB, WIDTH, BATCH, STEPS = 10, 8, 4, 3
MODES = {"HYBRID": {"run_mode": "HYBRID"}, "AR": {"run_mode": "AR"}, "PS": {"run_mode": "PS"},
         "SHARDED": {"run_mode": "HYBRID", "sparse_route": "sharded"},
         "TILED": {"run_mode": "AR", "tiling": {"dense/kernel": "R", "dense_1/kernel": "C"}}}
PRETRAINED = ("emb", "dense/kernel", "dense/bias", "dense_1/kernel", "dense_1/bias")


def get_assignment_map_from_checkpoint(tvars, init_checkpoint):
    """BERT's modeling.py: {checkpoint name: variable name} of the variables it holds."""
    name_to_variable = collections.OrderedDict()
    for var in tvars:
        name = var.name
        m = re.match("^(.*):\\d+$", name)
        if m is not None:
            name = m.group(1)
        name_to_variable[name] = var
    assignment_map = collections.OrderedDict()
    for name, _ in tf.train.list_variables(init_checkpoint):
        if name in name_to_variable:
            assignment_map[name] = name
    return assignment_map


def build(checkpoint, batch_size):
    """The graph at a static batch size (splitting the kernels needs one)."""
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(7)
        ids = tf1.placeholder(tf.int64, [batch_size], name="ids")
        y = tf1.placeholder(tf.float32, [batch_size, 1], name="y")
        emb = tf1.get_variable("emb", [VOCAB, WIDTH])
        h = tf1.layers.dense(tf.nn.embedding_lookup(emb, ids), 12, activation=tf.nn.relu)
        h = tf1.layers.dense(h, 6)
        head = tf1.get_variable("output_weights", [6, 1])
        loss = tf.reduce_mean(tf.square(tf.matmul(h, head) - y))
        train = tf1.train.AdamOptimizer(0.05).minimize(loss)
        if checkpoint is not None:
            tvars = tf1.trainable_variables()
            tf1.train.init_from_checkpoint(
                checkpoint, get_assignment_map_from_checkpoint(tvars, checkpoint))
        init = tf1.global_variables_initializer()
    return graph, dict(ids=ids, y=y, train=train, init=init)


def batch(step, n):
    rng = np.random.RandomState(20 + step)
    return (rng.randint(0, VOCAB, size=BATCH * n).astype(np.int64),
            rng.rand(BATCH * n, 1).astype(np.float32))


def pretrained(out):
    """The pre-trained checkpoint: every variable but the head, from another seed."""
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(99)
        emb = tf1.get_variable("emb", [VOCAB, WIDTH])
        # Seeded by hand: Keras's legacy layers draw from a seed of their own, not the
        # graph's, and a checkpoint that changed from run to run made the test's values,
        # and how close to its tolerance they came, change with it.
        h = tf1.layers.dense(tf.nn.embedding_lookup(emb, [0]), 12,
                             kernel_initializer=tf1.glorot_uniform_initializer(seed=1))
        tf1.layers.dense(h, 6, kernel_initializer=tf1.glorot_uniform_initializer(seed=2))
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            os.makedirs(os.path.join(out, "pretrained"), exist_ok=True)
            tf1.train.Saver().save(sess, os.path.join(out, "pretrained", "model"))


def main(out, single=None):
    tf1.disable_eager_execution()
    checkpoint = os.path.join(out, "pretrained", "model")
    for mode, config in MODES.items():
        graph, h = build(checkpoint, BATCH * (single or 1))
        variables = graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)
        folder = os.path.join(out, mode)

        def train(run, rank, n, together=1):
            for step in range(STEPS):
                ids, y = batch(step, n * together)
                mine = slice(rank * BATCH, (rank + together) * BATCH)
                run(h["train"], {h["ids"]: ids[mine], h["y"]: y[mine]})
        if single:
            final = one_device.single_device(graph, variables, os.path.join(folder, "rank0.npz"),
                                             lambda sess: train(sess.run, 0, 1, single))
            one_device.save(os.path.join(folder, "single.npz"), variables, final)
            continue
        import tfpar
        with tfpar.get_runner(graph, config=tfpar.Config(**config)) as runner:
            runner.run(h["init"])  # as the script does first: restores the checkpoint's
            init = runner.run(variables)
            train(runner.run, runner.worker_id, runner.num_workers)
            final = runner.run(variables)
            one_device.save(os.path.join(folder, f"rank{runner.worker_id}.npz"), variables,
                            final, init)


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--make" in args:
        pretrained(args[0])
    else:
        main(args[0], int(args[2]) if len(args) > 2 and args[1] == "--single" else None)
