"""Trains through tfpar.MonitoredTrainingSession as one worker of a horovodrun job (or, with
--single N, through TF's own tf.compat.v1.train.MonitoredTrainingSession on N workers'
concatenated batch: the reference).

usage: horovodrun -np N ... python monitored.py SPEC_JSON OUT_DIR [--single N]
SPEC: {"tf1": bool, "scenarios": [{"name", "model": kwargs of models.build, "config":
kwargs of tfpar.Config, "last_step", "batch" (rows per worker), "save_steps",
"stop_on" [rank, run] (a hook on that rank alone requests a stop after that run),
"nan_at" (worker 0's rows are NaN at that step), "histograms" (a histogram summary of
every trainable variable), "extra_hooks" (the chief also has a
CheckpointSaverHook and a ProfilerHook writing to <name>/extra), "die_at" (every worker exits with
status 3 before that step, as a killed job)}]}.
The input is indexed by the global step (a FeedFnHook), so a resumed job continues on
the data it would have had. Writes OUT_DIR/<name>/rank<r>.npz (init/<var>: the values
after the session was created; final/<var>: FinalOpsHook's values at the end) and
rank<r>.json (runs, the agreed stop, the step, the error text, eval()'s step).
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.support import models  # noqa: E402

tf1 = tf.compat.v1


class StepIndexedInput(tf1.train.SessionRunHook):
    """Knows the global step after the session was created (restored or 0); a FeedFnHook
    takes its rows for that step, and it counts on after each run."""

    def __init__(self, step_var):
        self.step_var, self.step = step_var, None

    def after_create_session(self, session, coord):
        self.step = int(session.run(self.step_var))

    def after_run(self, run_context, run_values):
        self.step += 1


class StopOn(tf1.train.SessionRunHook):
    """Requests a stop after the `run`-th run (on the worker it is given to)."""

    def __init__(self, run):
        self.run, self.runs = run, 0

    def after_run(self, run_context, run_values):
        self.runs += 1
        if self.runs == self.run:
            run_context.request_stop()


class InitialValues(tf1.train.SessionRunHook):
    """The variables' values once the session was created (restored, or broadcast)."""

    def __init__(self, variables):
        self.variables, self.values = variables, None

    def after_create_session(self, session, coord):
        self.values = dict(zip([v.op.name for v in self.variables],
                               session.run(self.variables)))


def train(sc, n, rank, out, single, init=None):
    import tfpar
    graph, h = models.build(init_seed=100 + rank, **sc["model"])
    b, last = sc["batch"], sc["last_step"]
    data = models.batches(last, b * n, vocab=sc.get("vocab"))
    with graph.as_default():
        step_var = tf1.train.get_global_step()
        tf1.summary.scalar("train_loss", h["loss"])
        if sc.get("histograms"):  # TF1 scripts' idiom: a histogram of every variable
            for v in tf1.trainable_variables():
                tf1.summary.histogram(v.op.name, v)
        variables = graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)
        position = StepIndexedInput(step_var)

        def rows():
            x, y, ids = data[position.step]
            lo, hi = (0, b * n) if single else (rank * b, (rank + 1) * b)
            x = x[lo:hi].copy()
            if sc.get("nan_at") == position.step and (single or rank == 0):
                x[:b] = np.nan
            return models.feed(h, x, y[lo:hi], ids[lo:hi])

        initial = InitialValues(variables)
        final = tf1.train.FinalOpsHook({v.op.name: v for v in variables})
        hooks = [position, tf1.train.FeedFnHook(rows), initial,
                 tf1.train.StopAtStepHook(last_step=last),
                 tf1.train.LoggingTensorHook({"loss": h["loss"], "step": step_var},
                                             every_n_iter=2,
                                             formatter=lambda v: f"logged loss {v['loss']:.6f}"
                                             f" at step {v['step']}"),
                 tf1.train.NanTensorHook(h["loss"]), final]
        chief_only = []
        if sc.get("extra_hooks"):  # a user's own CheckpointSaverHook and ProfilerHook
            extra = os.path.join(out, sc["name"], "single_extra" if single else "extra")
            chief_only = [tf1.train.CheckpointSaverHook(extra, save_steps=3),
                          tf1.train.ProfilerHook(save_steps=3, output_dir=extra)]
        stop_on = sc.get("stop_on")
        if stop_on and (single or rank == stop_on[0]):
            hooks.append(StopOn(stop_on[1]))
        folder = os.path.join(out, sc["name"], "single" if single else "checkpoints")
        kwargs = dict(checkpoint_dir=folder, hooks=hooks, chief_only_hooks=chief_only,
                      save_checkpoint_steps=sc.get(
            "save_steps", 1000), save_summaries_steps=2, log_step_count_steps=2)
        if init is not None:  # the reference starts from the job's initial values
            kwargs["scaffold"] = tf1.train.Scaffold(init_fn=lambda _, s: [
                v.load(init[v.op.name], s) for v in variables])
        record = {"runs": 0, "error": ""}
        if single:
            session = tf1.train.MonitoredTrainingSession(**kwargs)
        else:
            session = tfpar.MonitoredTrainingSession(
                tfpar_config=tfpar.Config(session_config=models.worker_session_config(),
                                          **sc.get("config", {})), **kwargs)
        try:
            with session as sess:
                while not sess.should_stop():
                    if sc.get("die_at") == position.step:
                        sess.runner._wait_for_writer()  # killed after a complete checkpoint
                        os._exit(3)  # killed: no close, no last save
                    sess.run(h["train_op"])
                    record["runs"] += 1
                if not single:
                    with sess.runner.as_default():
                        record["eval_step"] = int(step_var.eval())
                        record["default_is_tfpar"] = \
                            tf1.get_default_session() is not None
        except Exception as e:  # noqa: BLE001 (recorded for the test)
            record["error"] = f"{type(e).__name__}: {e}"
        record["resumed_from"] = None if single else getattr(session, "resumed_from", None)
        arrays = {f"init/{k}": v for k, v in (initial.values or {}).items()}
        arrays.update({f"final/{k}": v for k, v in (final.final_ops_values or {}).items()})
        os.makedirs(os.path.join(out, sc["name"]), exist_ok=True)
        name = "single" if single else f"rank{rank}"
        np.savez(os.path.join(out, sc["name"], name + ".npz"), **arrays)
        with open(os.path.join(out, sc["name"], name + ".json"), "w") as f:
            json.dump(record, f)
        return record


def train_until_the_input_ends(sc, rank, out):
    """A tf.data input that ends (tfpar.shard: each worker its slice of `rows` rows): the
    loop ends by OutOfRangeError, which the session's `with` takes as a clean end."""
    import tfpar
    record = {"runs": 0, "error": ""}
    with tf.Graph().as_default():
        step = tf1.train.get_or_create_global_step()
        rows = tf.data.Dataset.range(sc["rows"]).map(lambda i: tf.cast(i, tf.float32))
        x = tf1.data.make_one_shot_iterator(tfpar.shard(rows).batch(2)).get_next()
        w = tf1.get_variable("w", [], initializer=tf1.ones_initializer())
        loss = tf.reduce_mean(tf.square(w * x - 1.0))
        train_op = tf1.train.GradientDescentOptimizer(0.01).minimize(loss, global_step=step)
        final = tf1.train.FinalOpsHook({"w": w, "global_step": step})
        try:
            with tfpar.MonitoredTrainingSession(hooks=[final]) as sess:
                while not sess.should_stop():
                    sess.run(train_op)
                    record["runs"] += 1
        except Exception as e:  # noqa: BLE001 (recorded for the test)
            record["error"] = f"{type(e).__name__}: {e}"
    os.makedirs(os.path.join(out, sc["name"]), exist_ok=True)
    np.savez(os.path.join(out, sc["name"], f"rank{rank}.npz"),
             **{f"final/{k}": v for k, v in (final.final_ops_values or {}).items()})
    with open(os.path.join(out, sc["name"], f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    return record


def main(spec_path, out, single=None):
    with open(spec_path) as f:
        spec = json.load(f)
    if spec.get("tf1"):
        tf1.disable_v2_behavior()
    else:
        tf1.disable_eager_execution()
    tf1.logging.set_verbosity(tf1.logging.INFO)  # LoggingTensorHook and the step rate
    rank = int(os.environ.get("HOROVOD_RANK", "0"))
    failed = False
    for sc in spec["scenarios"]:
        if "rows" in sc:
            if not single:
                failed = bool(train_until_the_input_ends(sc, rank, out)["error"]) or failed
            continue
        init = None
        if single:
            job = np.load(os.path.join(out, sc["name"], "rank0.npz"))
            init = {k[len("init/"):]: job[k] for k in job.files if k.startswith("init/")}
        record = train(sc, int(single or os.environ.get("HOROVOD_SIZE", "1")), rank, out,
                       bool(single), init)
        failed = failed or bool(record["error"])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    args = sys.argv[1:]
    single = None
    if "--single" in args:
        i = args.index("--single")
        single = int(args[i + 1])
        args = args[:i] + args[i + 2:]
    main(*args, single=single)
