"""Trains tests/field_scripts.py's scripts: as one worker of a horovodrun job through tfpar,
or (--single) on one device through a plain `tf.compat.v1.Session` on the whole batch.

usage: horovodrun -np N ... python -m tests.support.workers.field_script SPEC_JSON OUT_DIR
       python -m tests.support.workers.field_script SPEC_JSON OUT_DIR --single N
SPEC: {"tf1": bool, "scenarios": [{"name", "script", "config", "steps", "batch"}]}.
Each run writes OUT_DIR/<name>/rank<r>.npz (single: single.npz): init/ and final/ values
of every global variable, and fetched/<k>: what the script fetched besides (the result of
`assign(lr, new_lr)`, the lr read back, a canned head's `assign_add(global_step, 1)`).
A scenario whose get_runner or first step raises a TfparError writes error.txt instead
(the test decides whether that cell of the table is a clear error or a failure).
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar  # noqa: E402
from tests.support import field_scripts  # noqa: E402

LR_STEPS = {0: 1.0, 2: 0.5}  # PTB: the lr assigned before these steps (an epoch's decay)


def train(run, graph, script, worker, n, steps, batch):
    """The script's loop: feeds this worker's rows of each step; returns what it fetched."""
    fetched = {}
    state = None
    final = {p: graph.get_tensor_by_name(t) for p, t in script.state.items()}
    for k, whole in enumerate(script.data(steps, batch * n)):
        if script.lr is not None and k in LR_STEPS:
            lr, new_lr, lr_update = script.lr
            fetched[f"lr_update_{k}"] = run(lr_update, {new_lr: LR_STEPS[k]})
            fetched[f"lr_{k}"] = run(lr)
        feed = {name: value[worker * batch:(worker + 1) * batch] for name, value in whole.items()}
        for p in script.state:  # the LSTM's state carried from the last step (zeros first)
            feed[p] = state[p] if state is not None else np.zeros(
                [batch] + final[p].shape.as_list()[1:], np.float32)
        out, state = run([script.train, final], feed)
        if not isinstance(out, dict) and out is not None:  # e.g. assign_add's new value
            fetched[f"train_{k}"] = out
    return fetched


def _save(path, names, init, final, fetched, extra=None):
    arrays = {f"init/{n}": v for n, v in zip(names, init)}
    arrays.update({f"final/{n}": v for n, v in zip(names, final)})
    arrays.update({f"fetched/{k}": np.asarray(v) for k, v in fetched.items()})
    arrays.update(extra or {})
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.savez(path, **arrays)


def worker(spec, out_dir):
    from tests.support import models
    session_config = models.worker_session_config()
    for sc in spec["scenarios"]:
        graph, script = field_scripts.SCRIPTS[sc["script"]]()
        config = tfpar.Config(session_config=session_config,
                              **{**script.config, **sc.get("config", {})})
        d = os.path.join(out_dir, sc["name"])
        try:
            runner = tfpar.get_runner(graph, None, config)
        except tfpar.TfparError as e:
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "error.txt"), "w") as f:
                f.write(f"{type(e).__name__}: {e}")
            continue
        with runner:
            variables = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
            init = runner.run(variables)
            fetched = train(runner.run, graph, script, runner.worker_id, runner.num_workers,
                            sc["steps"], sc["batch"])
            final = runner.run(variables)
            _save(os.path.join(d, f"rank{runner.worker_id}.npz"),
                  [v.op.name for v in variables], init, final, fetched,
                  {"plan": np.array(runner.plan.to_json())})


def single(spec, out_dir, n):
    """Each scenario on one device, on the N workers' rows concatenated. Its initial values
    are its seeded initialisers' (a job's worker 0 draws the same: the comparison checks)."""
    for sc in spec["scenarios"]:
        graph, script = field_scripts.SCRIPTS[sc["script"]]()
        with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
            variables = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
            sess.run(tf.compat.v1.global_variables_initializer())
            start = sess.run(variables)
            fetched = train(sess.run, graph, script, 0, 1, sc["steps"], sc["batch"] * n)
            final = sess.run(variables)
        _save(os.path.join(out_dir, sc["name"], "single.npz"), [v.op.name for v in variables],
              start, final, fetched)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    if spec.get("tf1"):  # as a TF1 script: reference variables, v1 control flow
        tf.compat.v1.disable_v2_behavior()
    else:
        tf.compat.v1.disable_eager_execution()
    if "--single" in sys.argv:
        single(spec, sys.argv[2], int(sys.argv[sys.argv.index("--single") + 1]))
    else:
        worker(spec, sys.argv[2])
