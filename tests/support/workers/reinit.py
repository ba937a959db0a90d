"""Re-initialisation through the runner, as TF1 and Horovod scripts do it: every worker
runs the user's `tf.compat.v1.global_variables_initializer()` after the runner exists
(unseeded random initialisers: each worker draws its own values), then
`Variable.load` of a value that differs per worker, then trains.

usage: horovodrun -np N ... python reinit.py OUT_DIR
For each mode (HYBRID with the embedding on the parameter servers, AR, HYBRID with it
sharded) writes OUT_DIR/<mode>/rank<r>.npz: every variable after the first step
(`trained/`), after the initialiser (`init/`), after the load (`loaded/`) and after two
more steps (`final/`).
"""
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar  # noqa: E402

tf1 = tf.compat.v1
MODES = {"HYBRID": {"run_mode": "HYBRID"}, "AR": {"run_mode": "AR"},
         "SHARDED": {"run_mode": "HYBRID", "sparse_route": "sharded"}}


def main(out):
    tf1.disable_eager_execution()
    rank = int(os.environ["HOROVOD_RANK"])
    for mode, config in MODES.items():
        graph = tf.Graph()
        with graph.as_default():
            ids = tf1.placeholder(tf.int64, [None])
            x = tf1.placeholder(tf.float32, [None, 4])
            emb = tf1.get_variable("emb", [20, 4])
            w = tf1.get_variable("w", [4, 1])
            step = tf1.train.get_or_create_global_step()
            loss = tf.reduce_sum(tf.matmul(x + tf.nn.embedding_lookup(emb, ids), w) ** 2)
            train = tf1.train.AdagradOptimizer(0.1).minimize(loss, global_step=step)
            init = tf1.global_variables_initializer()
            variables = tf1.global_variables()
        rng = np.random.RandomState(rank)
        feed = {ids: rng.randint(0, 20, size=4), x: rng.rand(4, 4).astype(np.float32)}
        record = {}
        with tfpar.get_runner(graph, config=tfpar.Config(**config)) as runner:
            names = [v.op.name for v in variables]

            def keep(prefix):
                record.update({f"{prefix}/{n}": v for n, v in zip(names, runner.run(variables))})

            runner.run(train, feed)
            if rank == 1:  # slower than the chief, whose re-initialisation must wait for it
                time.sleep(1.0)
            keep("trained")
            runner.run(init)
            keep("init")
            w.load(np.full([4, 1], rank + 1.0, np.float32), runner.user_session)
            emb.load(np.full([20, 4], rank + 2.0, np.float32), runner.user_session)
            keep("loaded")
            for _ in range(2):
                runner.run(train, feed)
            keep("final")
        os.makedirs(os.path.join(out, mode), exist_ok=True)
        np.savez(os.path.join(out, mode, f"rank{rank}.npz"), **record)


if __name__ == "__main__":
    main(sys.argv[1])
