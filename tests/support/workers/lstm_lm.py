"""Trains examples/lstm_lm.py's graph (fed by placeholders) as one worker of a horovodrun job.

usage: horovodrun -np N ... python lstm_lm.py SCENARIOS_JSON OUT_DIR [--tf1]
Each scenario: {"name", "config": kwargs of tfpar.Config, "steps", "batch"}. Writes
OUT_DIR/<name>/rank<r>.npz with init/ and final/ values of every global variable.
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.support import models  # noqa: E402
import tfpar  # noqa: E402
from examples import lstm_lm  # noqa: E402

MODEL = dict(vocab=40, emb_dim=6, hidden=8, proj=5, num_steps=4, num_sampled=10, lr=0.5,
             clip=100.0, partitions=2, keep_prob=1.0, feed=True)


def data(steps, global_batch, seed=0):
    """Per step (inputs, targets) of the whole batch: ids repeat within and across workers."""
    rng = np.random.RandomState(seed)
    shape = (global_batch, MODEL["num_steps"])
    return [(rng.randint(0, 12, size=shape).astype(np.int32),
             rng.randint(0, MODEL["vocab"], size=shape).astype(np.int32)) for _ in range(steps)]


def main(scenarios_path, out_dir):
    with open(scenarios_path) as f:
        scenarios = json.load(f)
    session_config = models.worker_session_config()
    for sc in scenarios:
        graph, h = lstm_lm.build_graph(**MODEL)
        config = tfpar.Config(session_config=session_config, **sc["config"])
        with tfpar.get_runner(graph, None, config) as runner:
            variables = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
            names = [v.op.name for v in variables]
            init = runner.run(variables)
            b = sc["batch"]
            lo, hi = runner.worker_id * b, (runner.worker_id + 1) * b
            for inputs, targets in data(sc["steps"], b * runner.num_workers):
                runner.run(h["train_op"], {h["inputs"]: inputs[lo:hi],
                                           h["targets"]: targets[lo:hi]})
            final = runner.run(variables)
            d = os.path.join(out_dir, sc["name"])
            os.makedirs(d, exist_ok=True)
            arrays = {f"init/{n}": v for n, v in zip(names, init)}
            arrays.update({f"final/{n}": v for n, v in zip(names, final)})
            arrays["plan"] = np.array(runner.plan.to_json())
            np.savez(os.path.join(d, f"rank{runner.worker_id}.npz"), **arrays)


if __name__ == "__main__":
    if "--tf1" in sys.argv:
        tf.compat.v1.disable_v2_behavior()
    else:
        tf.compat.v1.disable_eager_execution()
    main(sys.argv[1], sys.argv[2])
