"""A training script as `tfpar run` relaunches it: tfpar.MonitoredTrainingSession with a
checkpoint_dir (a checkpoint every 3 steps), its input indexed by the global step (so a
resumed job trains on the data it would have had), HYBRID with an embedding on the
parameter servers and Adam.

usage: python recover.py CHECKPOINT_DIR OUT_NPZ [--kill-at STEP --marker PATH]
       [--kill-host HOST] [--raise-at STEP] [--dataset] [--steps N] [--every K]
       [--kills JSON]
--kill-at: worker 1 (or, with --kill-host, the first worker on that host while the job
has 4 workers) SIGKILLs itself before that step, once per marker file (its first launch),
writing the time into the marker. With TFPAR_STEP_TIMES=PATH, worker 0 appends the time of
each launch's first step there (scripts/benchmark_recovery.py).
--raise-at: worker 0 raises ValueError before that step, on every launch (a script error).
--dataset: the input is a `tfpar.shard`ed tf.data pipeline (no feeds): a restarted job must
go on from each worker's saved position in it.
--steps, --every: train to step N (default 10), a checkpoint every K steps (default 3).
--kills: a JSON list of faults, each {"step": S, "role": "chief" | "worker" | "ps",
"marker": PATH}, each done once (its marker written, with the time, before it): before
step S the chief (worker 0), the last worker (on the last host) or that host's parameter
server (killed by its first worker, which spawned it) is SIGKILLed, as chance would.
Writes OUT_NPZ on worker 0 at the end: every variable (FinalOpsHook), and "workers".
"""
import argparse
import json
import os
import signal
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.support import models  # noqa: E402
from tests.support.workers.monitored import StepIndexedInput  # noqa: E402
import tfpar  # noqa: E402

tf1 = tf.compat.v1
tf1.disable_eager_execution()
GLOBAL_BATCH = 8


def chaos_victim(role: str, rank: int, size: int) -> bool:
    """Whether this worker does a fault of `role`: the chief kills itself, the last worker
    itself, and the last host's first worker that host's parameter server."""
    if role == "chief":
        return rank == 0
    if role == "worker":
        return rank == size - 1
    local_size = int(os.environ["HOROVOD_LOCAL_SIZE"])
    return rank == size - local_size  # the last host's first worker


def do_fault(role: str, marker: str):
    """(A background checkpoint write may be under way: the kill may cut it short.)"""
    with open(marker, "w") as f:
        f.write(repr(time.time()))
    if role == "ps":
        from tfpar.runtime import cluster
        os.kill(cluster.current().ps_pid, signal.SIGKILL)
    else:
        os.kill(os.getpid(), signal.SIGKILL)


def from_dataset(data, seed):
    """An embedding (on the parameter servers) and a dense layer trained with Adam on a
    `tfpar.shard`ed tf.data input of the rows of every step, `GLOBAL_BATCH // N` a step."""
    x = np.concatenate([d[0] for d in data])
    y = np.concatenate([d[1] for d in data])
    ids = np.concatenate([d[2] for d in data])
    size = int(os.environ["HOROVOD_SIZE"])
    graph = tf.Graph()
    with graph.as_default():
        ds = tfpar.shard(tf.data.Dataset.from_tensor_slices((x, y, ids)))
        xb, yb, ib = tf1.data.make_one_shot_iterator(ds.batch(GLOBAL_BATCH // size)).get_next()
        init = tf1.random_normal_initializer(stddev=0.3, seed=seed)
        emb = tf1.get_variable("emb", [models.VOCAB, x.shape[1]], initializer=init)
        w = tf1.get_variable("w", [x.shape[1], y.shape[1]], initializer=init)
        hidden = tf.tanh(xb + tf.nn.embedding_lookup(emb, ib))
        loss = tf.reduce_mean(tf.reduce_sum(tf.square(tf.matmul(hidden, w) - yb), axis=1))
        step = tf1.train.get_or_create_global_step()
        train_op = tf1.train.AdamOptimizer(0.05).minimize(loss, global_step=step)
    return graph, {"train_op": train_op, "loss": loss}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint_dir")
    p.add_argument("out")
    p.add_argument("--kill-at", type=int)
    p.add_argument("--marker")
    p.add_argument("--kill-host")
    p.add_argument("--raise-at", type=int)
    p.add_argument("--dataset", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--kills")
    args = p.parse_args()
    kills = json.loads(args.kills) if args.kills else []
    rank, size = int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
    host = os.environ.get("HOROVOD_HOSTNAME", "")
    # The same global batch on any worker count: a job that goes on with fewer workers
    # trains on the same rows.
    per_worker = GLOBAL_BATCH // size
    data = models.batches(args.steps, GLOBAL_BATCH)
    if args.dataset:
        graph, h = from_dataset(data, 100 + rank)
    else:
        graph, h = models.build(optimizer="adam", sparse=True, init_seed=100 + rank)
    with graph.as_default():
        step_var = tf1.train.get_global_step()
        position = StepIndexedInput(step_var)

        def rows():
            x, y, ids = data[position.step]
            lo, hi = rank * per_worker, (rank + 1) * per_worker
            return models.feed(h, x[lo:hi], y[lo:hi], ids[lo:hi])

        final = tf1.train.FinalOpsHook({v.op.name: v for v in tf1.global_variables()})
        hooks = [position, tf1.train.StopAtStepHook(last_step=args.steps), final]
        if not args.dataset:
            hooks.insert(1, tf1.train.FeedFnHook(rows))
        victim = (args.kill_host is None and rank == 1) or (
            args.kill_host is not None and size == 4 and host == args.kill_host
            and int(os.environ["HOROVOD_LOCAL_RANK"]) == 0)
        with tfpar.MonitoredTrainingSession(checkpoint_dir=args.checkpoint_dir, hooks=hooks,
                                            save_checkpoint_steps=args.every) as sess:
            first_step = True
            while not sess.should_stop():
                if args.raise_at is not None and position.step == args.raise_at and rank == 0:
                    raise ValueError(f"a bug in the script at step {position.step}")
                if victim and position.step == args.kill_at and (
                        args.kill_host is not None or not os.path.exists(args.marker)):
                    sess.runner._wait_for_writer()  # killed after a complete checkpoint
                    with open(args.marker, "w") as f:
                        f.write(repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
                for k in kills:
                    if k["step"] == position.step and not os.path.exists(k["marker"]) \
                            and chaos_victim(k["role"], rank, size):
                        do_fault(k["role"], k["marker"])
                sess.run(h["train_op"])
                if first_step and rank == 0 and os.environ.get("TFPAR_STEP_TIMES"):
                    with open(os.environ["TFPAR_STEP_TIMES"], "a") as f:  # (a benchmark's)
                        f.write(f"{time.time()!r}\n")
                first_step = False
    if rank == 0:
        np.savez(args.out, workers=size, **final.final_ops_values)


if __name__ == "__main__":
    main()
