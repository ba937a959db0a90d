"""Baseline for the LM benchmark: plain Horovod's DistributedOptimizer.

    PYTHONPATH=. horovodrun -np N python scripts/lm_horovod_baseline.py --vocab V --steps S [--sparse-as-dense]

The same graph as examples/lm.py, with Horovod's optimizer wrapper instead of tfpar. By
default Horovod allgathers each sparse gradient (IndexedSlices, duplicates included) and
allreduces the dense ones; with --sparse-as-dense every sparse gradient is made dense and
allreduced (4w(N-1)/N bytes per worker per step for all trainable variables). It prints
"step K ..." lines like examples/lm.py (the cluster benchmark reads wire counters at them).
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from examples import lm  # noqa: E402
from tfpar.plan.cost import allreduce_bytes  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--vocab", type=int, default=100_000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--threads", type=int)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--sparse-as-dense", action="store_true")
    p.add_argument("--json")
    args = p.parse_args()
    hvd.init()
    graph, loss, train_op = lm.build_graph(
        lm.zipf_text(args.vocab), args.vocab, batch_size=args.batch_size,
        wrap_optimizer=lambda o: hvd.DistributedOptimizer(
            o, sparse_as_dense=args.sparse_as_dense))
    n = hvd.size()
    with graph.as_default():
        variables = tf.compat.v1.trainable_variables()
        dense_bytes = sum(v.shape.num_elements() * v.dtype.size for v in variables)
        init = tf.compat.v1.global_variables_initializer()
        bcast = hvd.broadcast_variables(tf.compat.v1.global_variables(), 0)
    with tf.compat.v1.Session(graph=graph, config=lm.session_config(args.threads)) as sess:
        sess.run(init)
        sess.run(bcast)
        losses = []
        for step in range(args.steps):
            if step == args.warmup:
                start = time.time()
            losses.append(sess.run([loss, train_op])[0])
            if (step + 1) % args.log_every == 0 and hvd.rank() == 0:
                print(f"step {step + 1:5d}  loss {np.mean(losses[-args.log_every:]):.4f}",
                      flush=True)
        elapsed = time.time() - start
    timed = args.steps - args.warmup
    summary = {"mode": "horovod_sparse_as_dense" if args.sparse_as_dense else "horovod",
               "workers": n, "vocab": args.vocab,
               "step_time_s": elapsed / timed,
               "words_per_s": timed * args.batch_size * n / elapsed,
               "bytes_per_step": ({"allreduce": allreduce_bytes(dense_bytes, n)}
                                  if args.sparse_as_dense else {}),
               "loss_first": float(np.mean(losses[:10])), "loss_last": float(np.mean(losses[-10:]))}
    if hvd.rank() == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
