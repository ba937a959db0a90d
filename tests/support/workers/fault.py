"""A horovodrun worker that trains a HYBRID job until it is killed or stopped.

usage: fault.py OUT_DIR [LIVENESS_TIMEOUT_S]

After a few steps each worker writes OUT_DIR/rank<r>.json with its pid, its PS child's pid
and every port of the job it knows, so the test can kill something and check the leftovers.
"""
import json
import os
import sys
import time

import tensorflow as tf  # noqa: E402

from tests.support import models  # noqa: E402
import tfpar  # noqa: E402
from tfpar.runtime import cluster, liveness  # noqa: E402

tf.compat.v1.disable_eager_execution()
out_dir = sys.argv[1]
graph, h = models.build(optimizer="adagrad", emb_partitions=2, shared_embedding=True)
config = tfpar.Config(**({"liveness_timeout": float(sys.argv[2])} if len(sys.argv) > 2 else {}))
with tfpar.get_runner(graph, config=config) as runner:
    data = models.batches(4, 8 * runner.num_workers, vocab=models.PS_VOCAB)
    lo, hi = runner.worker_id * 8, (runner.worker_id + 1) * 8
    deadline = time.time() + 300
    step = 0
    while time.time() < deadline:
        x, y, ids = data[step % len(data)]
        runner.run(h["train_op"], feed_dict=models.feed(h, x[lo:hi], y[lo:hi], ids[lo:hi]))
        step += 1
        if step == 3:
            c = cluster.current()
            tf_ports = [int(a.rsplit(":", 1)[1]) for m in c.members for a in (m.worker, m.ps)
                        if a]
            hub = int(liveness.current().hub_address.rsplit(":", 1)[1])
            info = {"pid": os.getpid(), "ps_pid": c.ps_pid, "ports": tf_ports + [hub],
                    "tf_ports": tf_ports, "hub": liveness.current().hub_address,
                    "servers": [a for m in c.members for a in (m.worker, m.ps) if a]}
            with open(os.path.join(out_dir, f"rank{runner.worker_id}.json"), "w") as f:
                json.dump(info, f)
        time.sleep(0.05)
print("unexpected: training was not interrupted")
