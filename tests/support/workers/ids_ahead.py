"""Trains `models.build_from_input` with the input a step ahead (Config(ids_ahead=True)) as
one worker of a horovodrun job, until the input ends; saves every variable.

usage: horovodrun -np N ... python ids_ahead.py SPEC_JSON OUT_DIR
SPEC: {"scenarios": [{"name", "optimizer", "clip", "config"}], "steps", "batch"}. Writes
OUT_DIR/<name>/rank<r>.npz (the variables, the losses, the plan).
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.support import models  # noqa: E402
import tfpar  # noqa: E402

tf.compat.v1.disable_eager_execution()


def main(spec_path, out_dir):
    with open(spec_path) as f:
        spec = json.load(f)
    import horovod.tensorflow as hvd
    hvd.init()
    ids, y = models.input_batches(spec["steps"], spec["batch"] * hvd.size())
    for sc in spec["scenarios"]:
        graph, loss, train_op = models.build_from_input(ids, y, hvd.size(), hvd.rank(),
                                                        sc["optimizer"], sc.get("clip"))
        config = tfpar.Config(session_config=models.worker_session_config(), **sc["config"])
        with tfpar.get_runner(graph, config=config) as runner:
            variables = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
            losses = []
            while True:
                try:
                    losses.append(runner.run([loss, train_op])[0])
                except tf.errors.OutOfRangeError:
                    break
            final = runner.run(variables)
            d = os.path.join(out_dir, sc["name"])
            os.makedirs(d, exist_ok=True)
            arrays = {f"final/{v.op.name}": x for v, x in zip(variables, final)}
            arrays["losses"] = np.array(losses)
            arrays["plan"] = np.array(runner.plan.to_json())
            arrays["communication"] = np.array(json.dumps(runner.communication()))
            np.savez(os.path.join(d, f"rank{runner.worker_id}.npz"), **arrays)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
