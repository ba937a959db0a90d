"""A horovodrun worker: a partition search on the language model, then training.

usage: search.py OUT_DIR CACHE_DIR
Runner A searches the count of the embedding (tfpar.partitioner(1, 4)) and trains STEPS
steps; runner B is made without a search. Each worker writes OUT_DIR/rank<r>.npz with
A's initial and final values, B's initial values and A's plan.
"""
import json
import os
import sys

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.support import search_model  # noqa: E402
import tfpar  # noqa: E402

tf.compat.v1.disable_eager_execution()
out_dir, cache = sys.argv[1], sys.argv[2]
rank = int(os.environ.get("HOROVOD_RANK", "0"))
size = int(os.environ.get("HOROVOD_SIZE", "1"))
batches = search_model.batches(search_model.STEPS + 50, size)


def feed(step):
    previous, target = batches[step % len(batches)]
    lo, hi = rank * search_model.BATCH, (rank + 1) * search_model.BATCH
    return {"previous:0": previous[lo:hi], "target:0": target[lo:hi]}


session_config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1)
graph, loss, train_op = search_model.build()
names = [v.op.name for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)]
fetches = [n + ":0" for n in names]  # the variables' values (an op name fetches nothing)
config = tfpar.Config(search_partitions="force", search_feed=lambda step: feed(step + 1000),
                      search_steps=(1, 3), search_cache=cache, session_config=session_config)
with tfpar.get_runner(graph, config=config) as runner:
    init_a = runner.run(fetches)
    for step in range(search_model.STEPS):
        runner.run(train_op, feed_dict=feed(step))
    final_a = runner.run(fetches)
    plan = runner.plan.to_json()
config_b = tfpar.Config(search_partitions="off", session_config=session_config)
with tfpar.get_runner(graph, config=config_b) as runner:
    init_b = runner.run(fetches)
arrays = {f"init_a/{n}": v for n, v in zip(names, init_a)}
arrays.update({f"final_a/{n}": v for n, v in zip(names, final_a)})
arrays.update({f"init_b/{n}": v for n, v in zip(names, init_b)})
arrays["plan"] = np.array(plan)
np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **arrays)
