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

tf1 = tf.compat.v1
BATCH, STEPS, VOCAB, BAD_STEP = 4, 4, 12, 2
MODES = {"HYBRID": {"run_mode": "HYBRID"}, "AR": {"run_mode": "AR"},
         "SHARDED": {"run_mode": "HYBRID", "sparse_route": "sharded"}}


def build():
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(3)
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        ids = tf1.placeholder(tf.int64, [None], name="ids")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        emb = tf1.get_variable("emb", [VOCAB, 3])
        w1 = tf1.get_variable("w1", [3, 4])
        w2 = tf1.get_variable("w2", [4, 1])
        h = tf.nn.relu(tf.matmul(x + tf.nn.embedding_lookup(emb, ids), w1))
        loss = tf.reduce_mean(tf.square(tf.matmul(h, w2) - y))
        step = tf1.train.get_or_create_global_step()
        opt = tf1.mixed_precision.MixedPrecisionLossScaleOptimizer(
            tf1.train.AdamOptimizer(0.05), loss_scale="dynamic")
        train = opt.minimize(loss, global_step=step)
    return graph, dict(x=x, ids=ids, y=y, train=train)


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
    for mode, config in MODES.items():
        graph, h = build()
        variables = graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)
        names = [v.op.name for v in variables]
        folder = os.path.join(out, mode)
        if single:
            job = np.load(os.path.join(folder, "rank0.npz"))
            with graph.as_default(), tf1.Session(graph=graph) as sess:
                sess.run(tf1.global_variables_initializer())
                for v in variables:
                    v.load(job["init/" + v.op.name], sess)
                for step in range(STEPS):
                    x, ids, y = data(step, single)
                    sess.run(h["train"], {h["x"]: x, h["ids"]: ids, h["y"]: y})
                final = sess.run(variables)
            np.savez(os.path.join(folder, "single.npz"),
                     **{f"final/{k}": v for k, v in zip(names, final)})
            continue
        import tfpar
        with tfpar.get_runner(graph, config=tfpar.Config(**config)) as runner:
            init = runner.run(variables)
            rank, n = runner.worker_id, runner.num_workers
            for step in range(STEPS):
                x, ids, y = data(step, n)
                mine = slice(rank * BATCH, (rank + 1) * BATCH)
                runner.run(h["train"], {h["x"]: x[mine], h["ids"]: ids[mine], h["y"]: y[mine]})
            final = runner.run(variables)
            routes = {v.name: v.route for v in runner.plan.variables if v.role == "trained"}
            os.makedirs(folder, exist_ok=True)
            np.savez(os.path.join(folder, f"rank{rank}.npz"), routes=json.dumps(routes),
                     **{f"init/{k}": v for k, v in zip(names, init)},
                     **{f"final/{k}": v for k, v in zip(names, final)})


if __name__ == "__main__":
    args = sys.argv[1:]
    tf_1 = "--tf1" in args
    args = [a for a in args if a != "--tf1"]
    main(args[0], int(args[2]) if len(args) > 2 and args[1] == "--single" else None, tf_1)
