"""examples/cnn.py's graph (fed by placeholders): trained as one worker of a horovodrun job,
or on one device for the reference.

usage: horovodrun -np N ... python cnn.py worker SCENARIO_JSON OUT_DIR [--tf1]
       python -m tests.support.workers.cnn reference RANK0_NPZ N STEPS BATCH OUT_NPZ [--tf1]
The scenario: {"name", "config": kwargs of tfpar.Config, "steps", "batch"}. A worker writes
OUT_DIR/rank<r>.npz with init/ and final/ values of every global variable, the plan, and
eval_loss: the loss with is_training=False (the moving averages) on its rows of a batch no
step trained on. The reference trains on the concatenated batches from rank 0's initial
values and writes final/ values and each worker's eval_loss.
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.support import models  # noqa: E402
import tfpar  # noqa: E402
from examples import cnn  # noqa: E402

tf1 = tf.compat.v1


def data(steps, global_batch):
    """Per step (images, labels) of the whole batch, then one batch to evaluate on."""
    images, labels = cnn.generated_images((steps + 1) * global_batch, seed=3)
    return [(images[i * global_batch:(i + 1) * global_batch],
             labels[i * global_batch:(i + 1) * global_batch]) for i in range(steps + 1)]


def _feed(h, batch, lo, hi, training=True):
    fd = {h["images"]: batch[0][lo:hi], h["labels"]: batch[1][lo:hi]}
    if not training:
        fd[h["is_training"]] = False
    return fd


def worker(scenario_path, out_dir):
    with open(scenario_path) as f:
        sc = json.load(f)
    graph, h = cnn.build_graph()
    config = tfpar.Config(session_config=models.worker_session_config(), **sc["config"])
    with tfpar.get_runner(graph, None, config) as runner:
        variables = graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)
        names = [v.op.name for v in variables]
        init = runner.run(variables)
        b = sc["batch"]
        lo, hi = runner.worker_id * b, (runner.worker_id + 1) * b
        *train, held_out = data(sc["steps"], b * runner.num_workers)
        for batch in train:
            runner.run(h["train_op"], _feed(h, batch, lo, hi))
        final = runner.run(variables)
        eval_loss = runner.run(h["loss"], _feed(h, held_out, lo, hi, training=False))
        arrays = {f"init/{n}": v for n, v in zip(names, init)}
        arrays.update({f"final/{n}": v for n, v in zip(names, final)})
        arrays["plan"] = np.array(runner.plan.to_json())
        arrays["eval_loss"] = np.array(eval_loss)
        np.savez(os.path.join(out_dir, f"rank{runner.worker_id}.npz"), **arrays)


def reference(rank0_path, n, steps, b, out_path):
    rank0 = np.load(rank0_path)
    graph, h = cnn.build_graph()
    with graph.as_default(), tf1.Session(graph=graph) as sess:
        variables = graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)
        sess.run(tf1.global_variables_initializer())
        for v in variables:
            v.load(rank0["init/" + v.op.name], sess)
        *train, held_out = data(steps, b * n)
        for batch in train:
            sess.run(h["train_op"], _feed(h, batch, 0, b * n))
        values = {"final/" + v.op.name: x for v, x in zip(variables, sess.run(variables))}
        eval_loss = [sess.run(h["loss"], _feed(h, held_out, r * b, (r + 1) * b, False))
                     for r in range(n)]
    np.savez(out_path, eval_loss=np.array(eval_loss), **values)


if __name__ == "__main__":
    if "--tf1" in sys.argv:
        tf1.disable_v2_behavior()
    else:
        tf1.disable_eager_execution()
    args = [a for a in sys.argv[1:] if a != "--tf1"]
    if args[0] == "worker":
        worker(*args[1:])
    else:
        reference(args[1], *map(int, args[2:5]), args[5])
