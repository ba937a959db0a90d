"""What the real-script workers (tests/support/workers/*.py run by
tests/jobs/test_real_scripts.py) share: the one-device reference run from the job's
initial values, the files both write, and the test's side of it."""
import os
import subprocess
import sys

import numpy as np
import tensorflow as tf

from tests.support import models

tf1 = tf.compat.v1
RTOL, ATOL = 1e-5, 1e-6
# Every mode and the sparse routes a script with tables runs in: {mode: tfpar.Config args}
EVERY_MODE = {"HYBRID": {"run_mode": "HYBRID"}, "PS": {"run_mode": "PS"},
              "AR": {"run_mode": "AR"},
              "SHARDED": {"run_mode": "HYBRID", "sparse_route": "sharded"}}


def command_line(main) -> None:
    """A worker run on its own: `main(OUT_DIR)`, or `main(OUT_DIR, N)` after --single N."""
    args = sys.argv[1:]
    main(args[0], int(args[2]) if len(args) > 2 and args[1] == "--single" else None)


def single_device(graph: tf.Graph, variables, job_file: str, train):
    """The final values of `variables` after `train(sess)` on one device: a plain
    Session on `graph`, every variable initialised, then `variables` set to the job's
    initial values (`init/<name>` of `job_file`, worker 0's)."""
    job = np.load(job_file)
    with graph.as_default(), tf1.Session(graph=graph) as sess:
        models.initialise(sess, graph)
        for v in variables:
            v.load(job["init/" + v.op.name], sess)
        train(sess)
        return sess.run(variables)


def save(path: str, variables, final, init=None, **extra) -> None:
    """`final/<name>` (and `init/<name>`) of each variable, and `extra`, into `path`."""
    names = [v.op.name for v in variables]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.savez(path, **extra, **{f"final/{k}": x for k, x in zip(names, final)},
             **({} if init is None else {f"init/{k}": x for k, x in zip(names, init)}))


def run_with_reference(worker: str, out: str, *args, n: int = 2, timeout: int = 300):
    """Runs `worker OUT ARGS` as an n-worker job, then `worker OUT --single n ARGS` (its
    one-device reference); fails the test if either fails."""
    from tests.support.launch import REPO, horovodrun
    proc = horovodrun(n, worker, out, *args, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:]
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    ref = subprocess.run([sys.executable, worker, out, "--single", str(n), *args], env=env,
                         cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert ref.returncode == 0, ref.stderr[-4000:]


def assert_like_one_device(folder: str, n: int = 2):
    """Every worker's `rank<r>.npz` in `folder` holds `single.npz`'s values (rtol 1e-5,
    atol 1e-6); returns (single, [worker files])."""
    single = np.load(os.path.join(folder, "single.npz"))
    ranks = [np.load(os.path.join(folder, f"rank{r}.npz")) for r in range(n)]
    for r, got in enumerate(ranks):
        for key in single.files:
            np.testing.assert_allclose(got[key], single[key], rtol=RTOL, atol=ATOL,
                                       err_msg=f"{folder}: {key} on worker {r}")
    return single, ranks


def run_modes(out: str, single, modes, build, train, batch: int, variables=None,
              extra=None) -> None:
    """A worker's main loop over `modes` ({mode: tfpar.Config arguments}), into
    OUT/<mode>/: with `single` (N), one device on the N workers' batches together from
    the job's initial values (single.npz); else this worker's run through tfpar
    (rank<r>.npz). build() -> (graph, handles); train(run, handles, rank, n, width)
    trains `width` examples of each step from worker `rank`'s first; variables(graph):
    the variables saved (default every global one); extra(runner): more to save."""
    for mode, config in modes.items():
        graph, h = build()
        chosen = (variables or (lambda g: g.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)))(
            graph)
        folder = os.path.join(out, mode)
        if single:
            final = single_device(graph, chosen, os.path.join(folder, "rank0.npz"),
                                  lambda sess: train(lambda f, d=None: sess.run(f, d), h, 0,
                                                     single, batch * single))
            save(os.path.join(folder, "single.npz"), chosen, final)
            continue
        import tfpar
        with tfpar.get_runner(graph, config=tfpar.Config(**config)) as runner:
            init = runner.run(chosen)
            train(runner.run, h, runner.worker_id, runner.num_workers, batch)
            final = runner.run(chosen)
            save(os.path.join(folder, f"rank{runner.worker_id}.npz"), chosen, final, init,
                 **(extra(runner) if extra else {}))
