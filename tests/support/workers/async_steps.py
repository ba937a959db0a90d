"""Asynchronous training (tfpar.Config(sync=False)) as one worker of a horovodrun job.

usage: async_steps.py CASE OUT_DIR [MODEL_JSON]

Cases:
  serial: PS mode, asynchronous; the workers take turns (worker 0's step, a barrier,
    worker 1's step, a barrier, ...) for 3 rounds, so the updates happen in a known order.
    Writes OUT_DIR/rank<r>.npz with init/ and final/ values and the batches each used.
  timing_async, timing_sync: rank 1 sleeps 0.3 s before each of its 8 steps; each rank
    writes how long its loop took to OUT_DIR/rank<r>.json (asynchronous: worker 0 does
    not wait for worker 1).
"""
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.support import models  # noqa: E402
import tfpar  # noqa: E402
from tfpar.runtime import job  # noqa: E402

tf.compat.v1.disable_eager_execution()
ROUNDS, BATCH = 3, 8


def main(case, out_dir, model_json="{}"):
    rank = int(os.environ["HOROVOD_RANK"])
    model = json.loads(model_json)
    graph, h = models.build(init_seed=100 + rank, **model)
    config = tfpar.Config(run_mode="PS", sync=case == "timing_sync", liveness_timeout=20.0,
                          session_config=models.worker_session_config())
    with tfpar.get_runner(graph, config=config) as runner:
        assert runner.plan.sync == (case == "timing_sync"), runner.plan
        n = runner.num_workers
        variables = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
        names = [v.op.name for v in variables]
        init = runner.run(variables)
        data = models.batches(ROUNDS * n, BATCH, vocab=models.PS_VOCAB)
        if case == "serial":
            for step in range(ROUNDS):
                for turn in range(n):
                    if turn == rank:
                        x, y, ids = data[step * n + turn]
                        runner.run(h["train_op"], feed_dict=models.feed(h, x, y, ids))
                    job.allgather_strings("turn")  # a barrier outside tfpar's graph
            final = runner.run(variables)
            arrays = {f"init/{k}": v for k, v in zip(names, init)}
            arrays.update({f"final/{k}": v for k, v in zip(names, final)})
            arrays["plan"] = np.array(runner.plan.to_json())
            np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **arrays)
        else:
            start = time.time()
            for step in range(8):
                if rank == 1:
                    time.sleep(0.3)
                x, y, ids = data[step % len(data)]
                runner.run(h["train_op"], feed_dict=models.feed(h, x, y, ids))
            elapsed = time.time() - start
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                json.dump({"loop_s": elapsed}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
