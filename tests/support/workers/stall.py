"""A horovodrun worker that misuses a job in a way that used to hang it.

usage: stall.py CASE MODE     (MODE: a run mode, or SHARDED: HYBRID with the embedding's
                              rows sharded over the workers)

Cases (liveness timeout 5 s):
  one_rank: only rank 0 calls tfpar.get_runner (rank 1 sleeps).
  uneven_dataset: rank 1's tf.data input has 3 batches, rank 0's has 6; each trains until
    its input ends (OutOfRangeError), as scripts do.
  uneven_loop: fed by placeholders, rank 1 runs 3 steps and rank 0 runs 6.
  slow_worker: rank 1 spends 60 s in its own code before step 4 (step deadline 4 s).
  even_dataset: both ranks have 6 batches: must end cleanly, exit 0.
  stuck_ps_read: rank 0 stops (SIGSTOP) the job's parameter server before the first step,
    so every PS read waits (first step deadline 20 s, liveness timeout 60 s).
  stuck_collective: both ranks run the user's global_variables_initializer() (a
    collective through tfpar, not a step), then rank 1 spends 60 s in its own code before
    its first step, so rank 0 waits in the step's allreduce (first step deadline 20 s,
    liveness timeout 60 s).
  chief_only_read: the embedding is sharded (HYBRID only) and rank 0 alone reads its sum
    (a collective) before step 3, as a chief-only evaluation or summary would.
"""
import signal
import os
import sys
import time

import numpy as np
import tensorflow as tf

import tfpar

tf.compat.v1.disable_eager_execution()
case, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ["HOROVOD_RANK"])
stuck = case.startswith("stuck_")
sharded = case == "chief_only_read" or mode == "SHARDED"
config = tfpar.Config(run_mode="HYBRID" if mode == "SHARDED" else mode,
                      liveness_timeout=60.0 if stuck else 5.0,
                      sparse_route="sharded" if sharded else "ps",
                      step_deadline=4.0 if case == "slow_worker" else 600.0,
                      first_step_deadline=20.0 if stuck else 120.0)
batches = 3 if case == "uneven_dataset" and rank == 1 else 6
rng = np.random.RandomState(rank)
x_data = rng.rand(batches * 4, 5).astype(np.float32)
ids_data = rng.randint(0, 30, size=batches * 4).astype(np.int64)

graph = tf.Graph()
with graph.as_default():
    dataset = tf.data.Dataset.from_tensor_slices((x_data, ids_data)).batch(4)
    if case in ("uneven_dataset", "even_dataset"):
        x, ids = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
    else:
        x = tf.compat.v1.placeholder(tf.float32, [None, 5], name="x")
        ids = tf.compat.v1.placeholder(tf.int64, [None], name="ids")
    emb = tf.compat.v1.get_variable("emb", [30, 5], use_resource=True)
    w = tf.compat.v1.get_variable("w", [5, 1], use_resource=True)
    loss = tf.reduce_mean(tf.matmul(x + tf.nn.embedding_lookup(emb, ids), w) ** 2)
    train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    emb_sum = tf.reduce_sum(emb)
    init = tf.compat.v1.global_variables_initializer()

if case == "one_rank" and rank == 1:
    time.sleep(60)
    sys.exit(0)
runner = tfpar.get_runner(graph, config=config)
print(f"rank {rank}: runner ready", flush=True)
if case == "stuck_ps_read" and rank == 0:
    from tfpar.runtime import cluster
    os.kill(cluster.current().ps_pid, signal.SIGSTOP)
if case == "stuck_collective":
    runner.run(init)  # a re-initialisation: the first step is still the first
    if rank == 1:
        time.sleep(60)
steps = 0
if case in ("uneven_dataset", "even_dataset"):
    while True:
        try:
            runner.run(train)
        except tf.errors.OutOfRangeError:
            break
        steps += 1
else:
    for step in range(3 if case == "uneven_loop" and rank == 1 else 6):
        if case == "slow_worker" and rank == 1 and step == 3:
            time.sleep(60)
        if case == "chief_only_read" and rank == 0 and step == 2:
            print(f"rank 0: sum {runner.run(emb_sum)}", flush=True)
        feed = {x: x_data[4 * step:4 * step + 4], ids: ids_data[4 * step:4 * step + 4]}
        runner.run(train, feed)
        steps += 1
print(f"rank {rank}: done after {steps} steps", flush=True)
