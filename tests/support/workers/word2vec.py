"""Horovod's TF1 `tensorflow_word2vec.py`, with the README's changes for tfpar (no
DistributedOptimizer, no broadcast, the learning rate of the global batch) and its
session made by `tfpar.get_runner`: skip-gram pairs, an embedding looked up by id, NCE
loss over sampled classes, SGD; `init.run()` and `optimizer.run(feed_dict=...)` under
`with runner.as_default()`, and the normalised embeddings' `.eval()` at the end (on every
worker: a read of a sharded variable is a collective). The initialisers are unseeded, as
the script's: `init.run()` draws on each worker and tfpar keeps worker 0's.

usage: horovodrun -np N ... python word2vec.py OUT_DIR
       python word2vec.py OUT_DIR --single N   (one device, the N workers' pairs together,
                                                from the job's values after init.run())
Writes OUT_DIR/<mode>/rank<r>.npz (init/<var>, final/<var>, normalized) or single.npz,
for the modes HYBRID (the tables on the parameter servers), AR and SHARDED.
"""
import math
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.support import one_device  # noqa: E402

tf1 = tf.compat.v1
VOCAB, EMBED, SAMPLED, BATCH, STEPS = 40, 8, 6, 8, 4
MODES = {"HYBRID": {"run_mode": "HYBRID"}, "AR": {"run_mode": "AR"},
         "SHARDED": {"run_mode": "HYBRID", "sparse_route": "sharded"}}


def build():
    graph = tf.Graph()
    with graph.as_default():
        train_inputs = tf1.placeholder(tf.int32, shape=[None], name="inputs")
        train_labels = tf1.placeholder(tf.int32, shape=[None, 1], name="labels")
        embeddings = tf1.Variable(tf1.random_uniform([VOCAB, EMBED], -1.0, 1.0), name="emb")
        embed = tf.nn.embedding_lookup(embeddings, train_inputs)
        nce_weights = tf1.Variable(tf1.truncated_normal([VOCAB, EMBED],
                                                        stddev=1.0 / math.sqrt(EMBED)),
                                   name="nce_weights")
        nce_biases = tf1.Variable(tf.zeros([VOCAB]), name="nce_biases")
        # The sampled classes from a fixed seed: every worker and the single device draw
        # the same ones at each step.
        sampled = tf.random.log_uniform_candidate_sampler(
            tf.cast(train_labels, tf.int64), 1, SAMPLED, True, VOCAB, seed=7)
        loss = tf.reduce_mean(tf1.nn.nce_loss(
            weights=nce_weights, biases=nce_biases, labels=train_labels, inputs=embed,
            num_sampled=SAMPLED, num_classes=VOCAB, sampled_values=sampled))
        optimizer = tf1.train.GradientDescentOptimizer(1.0).minimize(loss)
        norm = tf.sqrt(tf.reduce_sum(tf.square(embeddings), 1, keepdims=True))
        normalized_embeddings = embeddings / norm
        init = tf1.global_variables_initializer()
    return graph, dict(inputs=train_inputs, labels=train_labels, loss=loss,
                       optimizer=optimizer, normalized=normalized_embeddings, init=init)


def pairs(step, n):
    """The skip-gram pairs of a step for n workers' batches together (ids repeat)."""
    rng = np.random.RandomState(100 + step)
    centre = rng.randint(0, VOCAB, size=BATCH * n).astype(np.int32)
    return centre, ((centre + rng.randint(1, 3, size=BATCH * n)) % VOCAB)[:, None]


def main(out, single=None):
    tf1.disable_eager_execution()
    for mode, config in MODES.items():
        graph, h = build()
        variables = graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)
        folder = os.path.join(out, mode)
        if single:
            normalized = []

            def train(sess):
                for step in range(STEPS):
                    x, y = pairs(step, single)
                    sess.run(h["optimizer"], {h["inputs"]: x, h["labels"]: y})
                normalized.append(sess.run(h["normalized"]))
            final = one_device.single_device(graph, variables,
                                             os.path.join(folder, "rank0.npz"), train)
            one_device.save(os.path.join(folder, "single.npz"), variables, final,
                            normalized=normalized[0])
            continue
        import tfpar
        runner = tfpar.get_runner(graph, config=tfpar.Config(**config))
        rank, n = runner.worker_id, runner.num_workers
        with runner, runner.as_default():
            h["init"].run()  # as the script does first
            init = runner.run(variables)
            for step in range(STEPS):
                x, y = pairs(step, n)
                mine = slice(rank * BATCH, (rank + 1) * BATCH)
                h["optimizer"].run(feed_dict={h["inputs"]: x[mine], h["labels"]: y[mine]})
            final = runner.run(variables)
            normalized = h["normalized"].eval()
        one_device.save(os.path.join(folder, f"rank{rank}.npz"), variables, final, init,
                        normalized=normalized)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], int(args[2]) if len(args) > 2 and args[1] == "--single" else None)
