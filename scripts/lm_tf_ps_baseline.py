"""Baseline for the LM benchmark: TensorFlow's classic parameter servers.

    PYTHONPATH=. horovodrun -np N -H h1:2,h2:2 python scripts/lm_tf_ps_baseline.py --vocab V --steps S

The same graph as examples/lm.py, trained the way TensorFlow 1 documented distributed
training (the baseline Parallax compares with): between-graph replication, every variable
placed by `replica_device_setter` on the parameter servers (the vocabulary-sized ones split
over them with `fixed_size_partitioner`), and `SyncReplicasOptimizer` aggregating the N
workers' gradients each step. horovodrun only starts the processes and Horovod only
exchanges the server addresses once; each host's first worker starts that host's PS task
(`python -m tfpar.runtime.ps_server`, a bare TensorFlow server). It prints "step K ..." lines like
examples/lm.py (the benchmark reads wire counters at them) and writes a JSON summary.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfpar.runtime.liveness import job_address  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
from examples import lm  # noqa: E402

tf1 = tf.compat.v1


def _free_port():
    s = socket.socket()
    s.bind(("", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _allgather(text):
    """Every rank's string (Horovod is used for nothing else)."""
    raw = np.frombuffer(text.encode().ljust(512), np.uint8)[None]
    with tf.Graph().as_default(), tf1.Session() as sess:
        rows = sess.run(hvd.allgather(tf.constant(raw)))
    return [bytes(r).decode().strip() for r in rows]


def start_ps(spec, task):
    """A bare TensorFlow server for task `task` of job "ps" in cluster `spec`, in a process
    of its own; its spec is the first line on its stdin, as tfpar sends it (tfpar starts it
    before the ports are known), and the pipe stays open: its end tells the server that
    this worker is gone."""
    proc = subprocess.Popen([sys.executable, "-m", "tfpar.runtime.ps_server"],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    proc.stdin.write((json.dumps({"cluster": spec, "task": task}) + "\n").encode())
    proc.stdin.flush()
    return proc


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--vocab", type=int, default=100_000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--threads", type=int)
    p.add_argument("--json")
    args = p.parse_args()
    hvd.init()
    rank, n, local = hvd.rank(), hvd.size(), hvd.local_rank()
    host = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
    address = job_address(host) or host
    ps_port = _free_port() if local == 0 else 0
    me = json.dumps({"worker": f"{address}:{_free_port()}",
                     "ps": f"{address}:{ps_port}" if ps_port else ""})
    members = [json.loads(s) for s in _allgather(me)]
    spec = {"worker": [m["worker"] for m in members], "ps": [m["ps"] for m in members if m["ps"]]}
    num_ps = len(spec["ps"])
    ps_proc = None
    if ps_port:
        task = spec["ps"].index(members[rank]["ps"])
        ps_proc = start_ps(spec, task)
    cluster = tf.train.ClusterSpec(spec)
    config = lm.session_config(args.threads)
    config.device_filters.extend(["/job:ps", f"/job:worker/task:{rank}"])
    server = tf.distribute.Server(cluster, job_name="worker", task_index=rank, config=config)

    made = {}

    def sync(optimizer):
        made["opt"] = tf1.train.SyncReplicasOptimizer(optimizer, replicas_to_aggregate=n,
                                                      total_num_replicas=n)
        return made["opt"]

    setter = tf1.train.replica_device_setter(
        ps_tasks=num_ps, worker_device=f"/job:worker/task:{rank}", cluster=cluster)
    graph, loss, train_op = lm.build_graph(lm.zipf_text(args.vocab), args.vocab,
                                           batch_size=args.batch_size, partitions=num_ps,
                                           wrap_optimizer=sync, device=setter)
    with graph.as_default():
        # Every worker says when it is done, so the chief stops its PS only after.
        with tf1.device("/job:ps/task:0"):
            done_queue = tf1.FIFOQueue(n, tf.int32, shared_name="benchmark_done")
            mark_done, done_count = done_queue.enqueue(rank), done_queue.size()
            stop_queue = tf1.FIFOQueue(1, tf.int32, shared_name="benchmark_stop")
            stop, stopped = stop_queue.enqueue(0), stop_queue.size()
        # SyncReplicasOptimizer aggregates any N gradients per update: a worker that stopped
        # would starve the others' updates (a chief behind the rest would wait forever). So
        # the other workers keep training until the chief is done, and then the chief
        # releases any step still waiting with spare tokens.
        step = tf.identity(tf1.train.get_global_step())
        release = made["opt"]._sync_token_queue.enqueue_many(  # pylint: disable=protected-access
            tf.fill([n * args.steps], step))
        hook = made["opt"].make_session_run_hook(rank == 0)
        scaffold = tf1.train.Scaffold()
        if rank == 0:
            creator = tf1.train.ChiefSessionCreator(scaffold, server.target, config=config)
        else:
            creator = tf1.train.WorkerSessionCreator(scaffold, server.target, config=config)
        _allgather("servers up")
        # The chief initialises first, so no worker waits out TensorFlow's 30 s readiness
        # poll.
        sess = tf1.train.MonitoredSession(creator, hooks=[hook]) if rank == 0 else None
        _allgather("initialised")
        if sess is None:
            sess = tf1.train.MonitoredSession(creator, hooks=[hook])
    losses = []
    global_step = tf1.train.get_global_step(graph)
    start, first_update = time.time(), 0
    for step in range(1, args.steps + 1):
        if step == args.warmup + 1:
            start, first_update = time.time(), sess.run(global_step)
        losses.append(sess.run([loss, train_op])[0])
        if step % args.log_every == 0 and rank == 0:
            print(f"step {step:5d}  loss {np.mean(losses[-args.log_every:]):.4f}", flush=True)
    elapsed = time.time() - start
    # SyncReplicasOptimizer aggregates any N gradients per update, so a fast worker (the
    # chief, beside its PS) may push several while a slow one pushes none: a worker's own
    # step count is not the job's. The job's step is an update (N x batch words), counted
    # by the global step.
    updates = int(sess.run(global_step)) - int(first_update)
    timed = args.steps - args.warmup
    summary = {"mode": "tf_parameter_servers", "workers": n, "vocab": args.vocab,
               "step_time_s": elapsed / max(updates, 1),
               "words_per_s": updates * args.batch_size * n / elapsed,
               "updates": updates, "own_steps": timed, "own_step_time_s": elapsed / timed,
               "loss_first": float(np.mean(losses[:args.log_every])),
               "loss_last": float(np.mean(losses[-args.log_every:]))}
    if rank == 0:
        sess.run(stop)
        sess.run(release)
        while sess.run(done_count) < n - 1:
            time.sleep(0.05)
    else:
        while not sess.run(stopped):
            sess.run(train_op)
        sess.run(mark_done)
    _allgather("done")  # no PS stops while a worker still trains
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    if ps_proc is not None:
        ps_proc.terminate()
        ps_proc.wait()
    os._exit(0)  # a MonitoredSession of SyncReplicas would wait on its queue runners


if __name__ == "__main__":
    main()
