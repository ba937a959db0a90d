"""`tfpar run` relaunches a job after a fault, and the job ends with the model it would
have had without it (tests/support/workers/recover.py: HYBRID with an embedding on the
parameter servers, Adam, a checkpoint every 3 steps, input indexed by the global step,
10 steps). Variables (slots included) are compared with an uninterrupted run within fp32
rtol 1e-5 and atol 1e-6 (the same rows; sums over workers in another order where the
worker count changed). The 2-worker jobs run two at a time: a relaunch mostly waits.
"""
import json
import os
import random
import subprocess
import sys
import tempfile
import time

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tensorflow as tf

from tests.support.launch import REPO, WORKERS, horovodrun, processes_running

WORKER = os.path.join(WORKERS, "recover.py")
RTOL, ATOL = 1e-5, 1e-6


def tfpar_run(*args, timeout=420, cluster=None, env=None):
    """`tfpar run args...` here, or on the first host of an emulated `cluster` as a user
    logged in there would type it (`env`: variables added to the environment)."""
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
               **(env or {}))
    cmd = [sys.executable, "-m", "tfpar.cli", "run", *args]
    if cluster is not None:
        cmd = cluster.command(cmd)
    return subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


def uninterrupted(tmp_path, *extra):
    """The job's model without faults (2 workers)."""
    out = str(tmp_path / "uninterrupted.npz")
    proc = horovodrun(2, WORKER, str(tmp_path / "uninterrupted"), out, *extra, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return dict(np.load(out))


def assert_same_model(got, expected, steps=10):
    names = [k for k in expected if k != "workers"]
    assert set(names) <= set(got)
    for k in names:
        np.testing.assert_allclose(got[k], expected[k], rtol=RTOL, atol=ATOL, err_msg=k)
    assert int(got["global_step"]) == steps


def _relaunched(folder, *extra, restarts="2"):
    """`tfpar run` of the worker on 2 local workers: (its output, its final model or None)."""
    out = os.path.join(folder, "final.npz")
    proc = tfpar_run("--restarts", restarts, "--gloo", "-np", "2", "-H", "localhost:2", "--",
                     sys.executable, WORKER, os.path.join(folder, "ckpt"), out, *extra)
    return proc, (dict(np.load(out)) if os.path.exists(out) else None)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """The 2-worker jobs of this module, two at a time (a relaunch mostly waits: for the
    fault to be named, for the job to end): {name: a future of its result}."""
    def folder(name):
        return str(tmp_path_factory.mktemp(name))

    def killed(name, *extra):
        d = folder(name)
        return d, _relaunched(d, "--kill-at", "5", "--marker", os.path.join(d, "killed"),
                              *extra)
    jobs = {"killed": lambda: killed("killed"),
            "dataset": lambda: killed("dataset", "--dataset"),
            "script_error": lambda: _relaunched(folder("script_error"), "--raise-at", "2",
                                                restarts="5"),
            "reference": lambda: uninterrupted(tmp_path_factory.mktemp("reference")),
            "reference_dataset": lambda: uninterrupted(
                tmp_path_factory.mktemp("reference_dataset"), "--dataset")}
    pool = ThreadPoolExecutor(2, thread_name_prefix="tfpar-test-job")
    futures = {name: pool.submit(job) for name, job in jobs.items()}
    pool.shutdown(wait=True)
    return futures


def test_a_killed_worker_is_relaunched_and_the_model_is_the_fault_free_one(local):
    folder, (proc, final) = local["killed"].result()
    assert proc.returncode == 0, proc.stdout[-8000:]
    assert os.path.exists(os.path.join(folder, "killed"))  # the fault happened
    assert "launch 1 failed" in proc.stdout and "died" in proc.stdout, proc.stdout[-4000:]
    assert "the job succeeded (launch 2, 1 restart(s))" in proc.stdout
    assert_same_model(final, local["reference"].result())
    assert processes_running(WORKER) == []


def test_a_tf_data_input_goes_on_where_each_worker_was(local):
    """The input is a tfpar.shard'ed tf.data pipeline: the checkpoint holds each worker's
    position in it, so the relaunched job trains on the rows it would have had."""
    folder, (proc, final) = local["dataset"].result()
    assert proc.returncode == 0, proc.stdout[-8000:]
    assert "the job succeeded (launch 2, 1 restart(s))" in proc.stdout
    ckpt = os.path.join(folder, "ckpt")
    assert [f for f in os.listdir(ckpt) if ".input-1-of-2" in f]  # worker 1's position
    assert_same_model(final, local["reference_dataset"].result())


def test_a_script_error_is_reported_and_not_retried_endlessly(local):
    proc, _ = local["script_error"].result()
    assert proc.returncode != 0
    assert proc.stdout.count("tfpar run: launch ") == 2 + 2  # two launches, each announced
    assert "ValueError: a bug in the script at step 2" in proc.stdout
    assert "the same error again: it is the script's own; not relaunching" in proc.stdout
    assert processes_running(WORKER) == []


def test_a_host_that_keeps_failing_is_left_out_and_the_job_finishes(tmp_path):
    """2 hosts x 2 workers; the first worker on host 127.0.0.1 is killed at step 5 of every
    4-worker launch: after 2 faults the host is left out and 2 workers finish the job. The
    model is the fault-free one and its checkpoint restores into the plain graph."""
    out = str(tmp_path / "final.npz")
    proc = tfpar_run("--restarts", "3", "--host-failures", "2", "--min-np", "2", "--gloo",
                     "-np", "4", "-H", "localhost:2,127.0.0.1:2", "--",
                     sys.executable, WORKER, str(tmp_path / "ckpt"), out, "--kill-at", "5",
                     "--kill-host", "127.0.0.1", "--marker", str(tmp_path / "killed"),
                     timeout=600)
    assert proc.returncode == 0, proc.stdout[-8000:]
    assert "host 127.0.0.1 failed 2 times: left out; going on with 2 worker(s)" in proc.stdout
    final = np.load(out)
    assert int(final["workers"]) == 2
    assert_same_model(final, uninterrupted(tmp_path))
    from tests.support import models
    graph, _ = models.build(optimizer="adam", sparse=True)
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        tf.compat.v1.train.Saver().restore(
            sess, tf.train.latest_checkpoint(str(tmp_path / "ckpt")))
        for v in tf.compat.v1.global_variables():
            np.testing.assert_array_equal(sess.run(v), final[v.op.name], err_msg=v.op.name)


CHAOS_STEPS, CHAOS_EVERY = 300, 20


def test_chaos_on_two_emulated_hosts(tmp_path):
    """2 emulated hosts x 2 workers (HYBRID, the embedding on the parameter servers, Adam, a
    `tfpar.shard`ed tf.data input, a checkpoint every 20 steps), 300 steps. At 3 random
    steps a random role is SIGKILLed: the chief, a worker on the other host, the other
    host's parameter server (a random order; the seed is printed, TFPAR_CHAOS_SEED sets
    it). `tfpar run` alone brings the job to step 300, and its model (slots included)
    equals the same job's without faults; no process, listening port or temporary file
    is left."""
    from tfpar.testing.emulate import EmulatedCluster
    seed = int(os.environ.get("TFPAR_CHAOS_SEED", random.SystemRandom().randrange(10**6)))
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(1, CHAOS_STEPS), 3))
    kills = [{"step": s, "role": r, "marker": str(tmp_path / f"fault{i}")}
             for i, (s, r) in enumerate(zip(steps, rng.sample(["chief", "worker", "ps"], 3)))]
    print(f"chaos seed {seed}: {[(k['step'], k['role']) for k in kills]}")
    # The jobs' temporary files go to a folder of their own (Horovod passes TMPDIR on to
    # every process, over ssh too), so other tests running meanwhile cannot blur the check.
    private = tmp_path / "tmp"
    private.mkdir()
    temporary = set(os.listdir(tempfile.gettempdir()))
    with EmulatedCluster(hosts=2, rate="1gbit", name="tfpc") as cluster:
        def job(name, *extra):
            out = str(tmp_path / f"{name}.npz")
            proc = tfpar_run("--restarts", "4", "--gloo", "--disable-cache", "-np", "4",
                             "-H", cluster.hosts_arg(2), "--", sys.executable, WORKER,
                             str(tmp_path / name), out, "--dataset", "--steps",
                             str(CHAOS_STEPS), "--every", str(CHAOS_EVERY), *extra,
                             cluster=cluster, timeout=600, env={"TMPDIR": str(private)})
            assert proc.returncode == 0, f"seed {seed}, {kills}:\n{proc.stdout[-8000:]}"
            return proc, np.load(out)

        proc, got = job("chaos", "--kills", json.dumps(kills))
        _, expected = job("fault_free")
        for ns in cluster.namespaces:  # nothing of the job listens on either host
            # (its processes on the other host end over ssh as `tfpar run` returns: a
            # second or so for their servers to close, over 15 s on a loaded 2-core
            # machine, not a port left behind)
            deadline = time.monotonic() + 60
            while True:
                ports = cluster.run(["ss", "-ltnH"], host=cluster.namespaces.index(ns)).stdout
                left = [line for line in ports.splitlines() if ":22 " not in line]
                if not left or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert left == [], ports
    assert all(os.path.exists(k["marker"]) for k in kills), (seed, kills)  # each fault done
    assert proc.stdout.count("failed") >= 3 and "3 restart(s)" in proc.stdout, \
        proc.stdout[-6000:]
    assert int(got["workers"]) == 4
    assert_same_model(got, expected, steps=CHAOS_STEPS)
    assert processes_running(WORKER) == []
    assert os.listdir(private) == []
    assert {e for e in set(os.listdir(tempfile.gettempdir())) - temporary
            if "tfpar" in e or "horovod" in e} == set()
    ckpt = os.listdir(tmp_path / "chaos")
    assert not [f for f in ckpt if "tmp" in f or "temp" in f], ckpt  # no partial write
