"""A horovodrun worker that trains on tfpar.shard'ed data and saves the elements it saw.

usage: shard.py OUT_DIR. Two graphs: one built in this job (shard reads the job's
environment), and one built as if elsewhere (exported with a 1-worker shard) that
get_runner must point at this worker.
"""
import json
import os
import sys

import tensorflow as tf  # noqa: E402

import tfpar  # noqa: E402

tf1 = tf.compat.v1
tf1.disable_eager_execution()
ELEMENTS = 23


def build():
    g = tf.Graph()
    with g.as_default():
        ds = tfpar.shard(tf.data.Dataset.range(ELEMENTS))
        item = tf1.data.make_one_shot_iterator(ds).get_next(name="item")
        w = tf1.get_variable("w", [], initializer=tf1.ones_initializer())
        loss = tf.square(w * tf.cast(item, tf.float32))
        tf1.train.GradientDescentOptimizer(1e-4).minimize(loss, name="train")
    return g


def consume(graph):
    seen = []
    with tfpar.get_runner(graph) as runner:
        while True:
            try:
                # Items only: with 23 elements the shards are uneven (8, 8, 7), and a
                # training step would wait in an allreduce for a worker that ran out.
                item = runner.run("item:0")
            except tf.errors.OutOfRangeError:
                return runner.worker_id, seen
            seen.append(int(item))


def main(out):
    rank, seen = consume(build())
    env = {k: os.environ.pop(k) for k in ("HOROVOD_SIZE", "HOROVOD_RANK")}
    meta = tf1.train.export_meta_graph(graph=build())  # built as if outside the job
    os.environ.update(env)
    _, seen_meta = consume(meta)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"direct": seen, "meta": seen_meta}, f)


if __name__ == "__main__":
    main(sys.argv[1])
