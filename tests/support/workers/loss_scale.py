"""A training step whose update is made in a `tf.cond`: TF's
`MixedPrecisionLossScaleOptimizer` with a dynamic loss scale (NVIDIA's TF1 Horovod
scripts train so): the loss is scaled, the gradients unscaled, and Adam applies them only
where every gradient is finite; else the step is skipped and the scale halved. An MLP
with an embedding and a global step. At step 2 one example of the last worker's batch is
infinite, so that step's gradients are not finite, on one device as on the workers.

usage: horovodrun -np N ... python loss_scale.py OUT_DIR [--tf1]
       python loss_scale.py OUT_DIR --single N [--tf1]   (one device, the N workers'
                                                         batches together, from the job's
                                                         values)
--tf1: TF1 control flow (`disable_v2_behavior`: the cond as Switch and Merge ops);
without it TF2's (the cond as an If op, the update in its branch function).
Writes OUT_DIR/<tf1|tf2>/<mode>/rank<r>.npz (init/<var>, final/<var>, routes) or
single.npz for HYBRID (the default routes), AR and SHARDED (sparse_route="sharded").
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.support import models, one_device  # noqa: E402

tf1 = tf.compat.v1
BATCH, STEPS, VOCAB, BAD_STEP = 4, 4, 12, 2
MODES = {"HYBRID": {"run_mode": "HYBRID"}, "AR": {"run_mode": "AR"},
         "SHARDED": {"run_mode": "HYBRID", "sparse_route": "sharded"}}


def build():
    graph = tf.Graph()
    with graph.as_default():
        m = models.mlp_with_embedding(VOCAB)
        step = tf1.train.get_or_create_global_step()
        opt = tf1.mixed_precision.MixedPrecisionLossScaleOptimizer(
            tf1.train.AdamOptimizer(0.05), loss_scale="dynamic")
        train = opt.minimize(m["loss"], global_step=step)
    return graph, dict(x=m["x"], ids=m["ids"], y=m["y"], train=train)


def data(step, n):
    rng = np.random.RandomState(10 * step)
    x = rng.rand(BATCH * n, 3).astype(np.float32)
    if step == BAD_STEP:
        x[-1, 0] = np.inf  # in the last worker's batch
    return (x, rng.randint(0, VOCAB, size=BATCH * n).astype(np.int64),
            rng.rand(BATCH * n, 1).astype(np.float32))


def main(out, single=None, tf_1=False):
    (tf1.disable_v2_behavior if tf_1 else tf1.disable_eager_execution)()
    out = os.path.join(out, "tf1" if tf_1 else "tf2")
    one_device.run_modes(out, single, MODES, build, train, BATCH, extra=lambda runner: dict(
        routes=json.dumps({v.name: v.route for v in runner.plan.variables
                           if v.role == "trained"})))


def train(run, h, rank, n, width):
    """Worker `rank`'s batches of n workers' steps (`width` examples from its first)."""
    for step in range(STEPS):
        x, ids, y = data(step, n)
        mine = slice(rank * BATCH, rank * BATCH + width)
        run(h["train"], {h["x"]: x[mine], h["ids"]: ids[mine], h["y"]: y[mine]})


if __name__ == "__main__":
    args = sys.argv[1:]
    tf_1 = "--tf1" in args
    args = [a for a in args if a != "--tf1"]
    main(args[0], int(args[2]) if len(args) > 2 and args[1] == "--single" else None, tf_1)
