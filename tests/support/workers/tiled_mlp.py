"""A horovodrun worker that trains examples/split_mlp.py's model under several plans.

usage: tiled_mlp.py SPEC_JSON OUT_DIR. SPEC: {"plans": [{"name", ...plan}], "steps",
"global_batch", "sizes"}. Per plan it saves this worker's tile of every variable and slot
after the steps, and the bytes its collectives received per step (as Horovod reported
them, and as the exchanges predict), for tests/transform/test_tiles.py.
"""
import json
import os
import sys

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd

from examples import split_mlp

tf.compat.v1.disable_eager_execution()


def run_plan(spec, plan, rank, n, out_dir):
    values, batches = split_mlp.initial(spec["sizes"], spec["global_batch"], spec["steps"])
    model = split_mlp.build(plan, spec["sizes"], spec["global_batch"], rank, n, values)
    b = spec["global_batch"] // n
    with tf.compat.v1.Session(graph=model.graph) as sess:
        sess.run([tf.compat.v1.global_variables_initializer(),
                  tf.compat.v1.local_variables_initializer()])
        for xs, ts in batches:
            sess.run(model.train, {model.x: xs[rank * b:(rank + 1) * b],
                                   model.targets: ts[rank * b:(rank + 1) * b]})
        out = model.state(sess)
        out["__bytes_predicted_per_step"] = np.array(model.predicted_per_step, np.float64)
        out["__bytes_received_per_step"] = np.array(sess.run(model.received) / len(batches))
    folder = os.path.join(out_dir, plan["name"])
    os.makedirs(folder, exist_ok=True)
    np.savez(os.path.join(folder, f"rank{rank}.npz"), **out)


def main(spec_path, out_dir):
    hvd.init()
    with open(spec_path) as f:
        spec = json.load(f)
    for plan in spec["plans"]:
        run_plan(spec, plan, hvd.rank(), hvd.size(), out_dir)


if __name__ == "__main__":
    main(*sys.argv[1:])
