"""A horovodrun worker that trains a HYBRID job for many steps and records memory.

usage: soak.py OUT_DIR STEPS. Writes OUT_DIR/rank<r>.json: the resident memory (bytes) of
this worker and of its PS child (if it spawned one) after a warm-up quarter of the steps
and at the end, and the steps per second.
"""
import json
import os
import sys
import time

import psutil  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.support import models  # noqa: E402
import tfpar  # noqa: E402

tf.compat.v1.disable_eager_execution()
out_dir, steps = sys.argv[1], int(sys.argv[2])
graph, h = models.build(optimizer="adam", emb_partitions=2, shared_embedding=True, clip=1.0,
                        ema=True)


def rss(pid):
    return psutil.Process(pid).memory_info().rss if pid else 0


with tfpar.get_runner(graph) as runner:
    me = psutil.Process()
    children = [c.pid for c in me.children() if "tfpar.runtime.ps_server" in " ".join(c.cmdline())]
    ps_pid = children[0] if children else None
    data = models.batches(8, 8 * runner.num_workers, vocab=models.PS_VOCAB)
    lo, hi = runner.worker_id * 8, (runner.worker_id + 1) * 8
    marks = {}
    start = time.time()
    for step in range(steps):
        x, y, ids = data[step % len(data)]
        runner.run(h["train_op"], feed_dict=models.feed(h, x[lo:hi], y[lo:hi], ids[lo:hi]))
        if step + 1 in (steps // 4, steps):
            marks[step + 1] = {"worker": rss(os.getpid()), "ps": rss(ps_pid)}
    info = {"marks": marks, "steps_per_s": steps / (time.time() - start),
            "communication": runner.communication()}
    with open(os.path.join(out_dir, f"rank{runner.worker_id}.json"), "w") as f:
        json.dump(info, f)
