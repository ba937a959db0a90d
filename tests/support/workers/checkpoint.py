"""Saves and restores checkpoints as one worker of a horovodrun job.

usage: horovodrun -np N ... python checkpoint.py SCENARIOS_JSON OUT_DIR
Each scenario: {"name", "model": kwargs of models.build, "config": kwargs of tfpar.Config,
"global_batch", "restore": prefix or null, "save": path or null, "user_saver": bool,
"first_step", "steps": [k before saving, k after], "background": save in the background}. The data of step s is step s of
models.batches(..., global_batch), split evenly over the workers, so any worker count
trains on the same global batches. Writes OUT_DIR/<name>/rank<r>.npz with the values at
start (after a restore), at the save and at the end, and saved.json (the prefixes).
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
    for sc, graph, h, session_config in models.worker_scenarios(spec_path):
        with graph.as_default():
            saver = tf.compat.v1.train.Saver(max_to_keep=10) if sc.get("user_saver") else None
        config = tfpar.Config(session_config=session_config, **sc.get("config", {}))
        with tfpar.get_runner(graph, None, config) as runner:
            variables = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
            names = [v.op.name for v in variables]
            arrays, saved = {}, {}
            error = ""
            if sc.get("restore"):
                try:
                    if sc.get("restore_with_saver"):
                        saver.restore(runner.session, sc["restore"])
                    else:
                        runner.restore(sc["restore"])
                except tfpar.TfparError as e:
                    error = str(e)
            arrays.update({f"start/{n}": v for n, v in zip(names, runner.run(variables))})
            b = sc["global_batch"] // runner.num_workers
            lo, hi = runner.worker_id * b, (runner.worker_id + 1) * b
            before, after = sc["steps"]
            data = models.batches(sc["first_step"] + before + after, sc["global_batch"],
                                  vocab=models.PS_VOCAB)[sc["first_step"]:]
            for s, (x, y, ids) in enumerate(data):
                if s == before and sc.get("save"):
                    arrays.update({f"saved/{n}": v for n, v in zip(names, runner.run(variables))})
                    saved["runner"] = runner.save(sc["save"],
                                                  background=sc.get("background", False))
                    if saver is not None and runner.is_chief:
                        saved["saver"] = saver.save(runner.session, sc["save"] + "_saver",
                                                    global_step=before)
                runner.run(h["train_op"], feed_dict=models.feed(h, x[lo:hi], y[lo:hi], ids[lo:hi]))
            arrays.update({f"final/{n}": v for n, v in zip(names, runner.run(variables))})
            d = os.path.join(out_dir, sc["name"])
            os.makedirs(d, exist_ok=True)
            arrays["error"] = np.array(error)
            arrays["plan"] = np.array(runner.plan.to_json())
            np.savez(os.path.join(d, f"rank{runner.worker_id}.npz"), **arrays)
            if runner.is_chief:
                with open(os.path.join(d, "saved.json"), "w") as f:
                    json.dump(saved, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
