"""Checkpoints are the single-device model's checkpoint, and training resumes exactly.

A HYBRID job of 2 workers trains 3 steps, saves (Runner.save, and the user's own Saver
through runner.session), and trains 3 more: the uninterrupted run. Other jobs restore the
step-3 checkpoint into 2 hosts x 2 workers HYBRID (with another partition count), into PS
mode (from a checkpoint the single-device graph wrote with a plain Saver) and into AR on 2
workers, and into the plain single-device graph with a plain Saver and no tfpar. Every variable, slot and the global step equal the saved ones, and 3 more
steps equal the uninterrupted run's (rtol 1e-5, atol 1e-6: the sums run in other orders).
A checkpoint that lacks a variable restores nothing and raises. A process killed while
saving leaves the previous checkpoint readable. A background save holds the values of its
step boundary although training went on while it was written.

Route "sharded" (the embeddings' rows over the workers) in the same jobs, on the model
without clipping: a checkpoint saved by 2 workers with it restores into the "ps" route,
into 2 hosts x 2 workers sharded, and into the plain single-device graph, whose own save
restores into "sharded" again; each resumes exactly.
"""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from tests.support import models
from tests.support.launch import REPO, WORKERS, horovodrun


RTOL, ATOL = 1e-5, 1e-6
TWO_HOSTS = "localhost:2,127.0.0.1:2"
MODEL = {"optimizer": "adam", "emb_partitions": 2, "shared_embedding": True, "clip": 2.0}
SHARDED_MODEL = {k: v for k, v in MODEL.items() if k != "clip"}
SHARDED = {"sparse_route": "sharded"}
GLOBAL_BATCH = 16


def _job(tmp, n, scenarios, hosts=None):
    spec = os.path.join(tmp, f"scenarios_{scenarios[0]['name']}.json")
    with open(spec, "w") as f:
        json.dump(scenarios, f)
    proc = horovodrun(n, os.path.join(WORKERS, "checkpoint.py"), spec, tmp, hosts=hosts,
                      timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]


def _load(tmp, name, rank=0):
    return np.load(os.path.join(tmp, name, f"rank{rank}.npz"))


def sc(name, config=None, model=MODEL, **kw):
    return {"name": name, "model": model, "config": config or {}, "global_batch": GLOBAL_BATCH,
            "first_step": 0, "steps": [3, 3], **kw}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ckpt"))
    ckpt = os.path.join(tmp, "ckpt", "model")
    os.makedirs(os.path.dirname(ckpt))
    # (A background save too: training goes on while it is written.)
    # (Saved from parts on the servers dealt out modulo 2.)
    _job(tmp, 2, [sc("train", {"partitions": 2}, save=ckpt, user_saver=True),
                  sc("background", {"partitions": 2},
                     save=os.path.join(tmp, "background", "model"), background=True),
                  sc("sharded", SHARDED, SHARDED_MODEL,
                     save=os.path.join(tmp, "sharded", "ckpt", "model"))])
    saved = {}
    for name in ("train", "sharded"):
        with open(os.path.join(tmp, name, "saved.json")) as f:
            saved.update({(k if name == "train" else f"{name}_{k}"): v
                          for k, v in json.load(f).items()})
    resume = dict(first_step=3, steps=[0, 3])
    # A checkpoint the plain single-device graph wrote itself (no tfpar): restore the runner's
    # with a Saver, save it again with that Saver.
    for name, model, prefix in (("single", MODEL, saved["runner"]),
                                ("sharded_single", SHARDED_MODEL, saved["sharded_runner"])):
        graph, _ = models.build(**model)
        with graph.as_default():
            saver = tf.compat.v1.train.Saver()
            with tf.compat.v1.Session(graph=graph) as sess:
                saver.restore(sess, prefix)
                saved[name] = saver.save(sess, os.path.join(tmp, name, "model"), global_step=3)
    _job(tmp, 4, [sc("hybrid_2x2", {"partitions": 3}, restore=saved["runner"], **resume),
                  # restored into row ranges
                  sc("hybrid_2x2_from_folder", {"ps_rows": "ranges"},
                     restore=os.path.dirname(ckpt), **resume),
                  sc("sharded_2x2", SHARDED, SHARDED_MODEL, restore=saved["sharded_runner"],
                     **resume)],
         hosts=TWO_HOSTS)
    _job(tmp, 2, [sc("sharded_to_ps", {}, SHARDED_MODEL, restore=saved["sharded_runner"],
                     **resume),
                  sc("sharded_from_single", SHARDED, SHARDED_MODEL,
                     restore=saved["sharded_single"], **resume),
                  # saved with the rows modulo N (M), restored into rows in ranges (R)
                  sc("sharded_to_ranges", dict(SHARDED, sharded_rows="ranges"), SHARDED_MODEL,
                     restore=saved["sharded_runner"], **resume),
                  sc("ps", {"run_mode": "PS"}, restore=saved["single"], **resume),
                  sc("ar", {"run_mode": "AR"}, restore=saved["runner"], **resume),
                  sc("user_saver", restore=saved["saver"], user_saver=True,
                     restore_with_saver=True, **resume),
                  # Adagrad's slots are not in a checkpoint of the Adam model.
                  dict(sc("missing"), model=dict(MODEL, optimizer="adagrad"), steps=[0, 0],
                       restore=saved["runner"])])
    return tmp, saved


def _names(data, phase):
    return [k[len(phase) + 1:] for k in data.files if k.startswith(phase + "/")]


def test_restored_runs_equal_the_saved_values_and_resume_exactly(jobs):
    tmp, _ = jobs
    train = _load(tmp, "train")
    names = _names(train, "saved")
    assert int(train["saved/global_step"]) == 3 and int(train["final/global_step"]) == 6
    for name, n in (("hybrid_2x2", 4), ("hybrid_2x2_from_folder", 4), ("ps", 2), ("ar", 2),
                    ("user_saver", 2)):
        for rank in range(n):
            data = _load(tmp, name, rank)
            assert str(data["error"]) == ""
            assert sorted(_names(data, "start")) == sorted(names)
            for k in names:
                # Restored values are the saved ones, bit for bit.
                np.testing.assert_array_equal(data[f"start/{k}"], train[f"saved/{k}"],
                                              err_msg=f"{name}: restored {k} on worker {rank}")
                np.testing.assert_allclose(data[f"final/{k}"], train[f"final/{k}"], rtol=RTOL,
                                           atol=ATOL, err_msg=f"{name}: {k} on worker {rank}")
    plan = {v["name"]: v for v in json.loads(str(_load(tmp, "hybrid_2x2")["plan"]))["variables"]}
    assert len(plan["shared"]["parts"]) == 3  # another partition count than the saver's
    assert [p["step"] for p in plan["shared"]["parts"]] == [3, 3, 3]  # modulo
    plan = {v["name"]: v for v in json.loads(str(_load(tmp, "train")["plan"]))["variables"]}
    assert [p["step"] for p in plan["shared"]["parts"]] == [2, 2]
    plan = {v["name"]: v for v in
            json.loads(str(_load(tmp, "hybrid_2x2_from_folder")["plan"]))["variables"]}
    assert [p["step"] for p in plan["shared"]["parts"]] == [1, 1]  # ranges
    moved = [k for k in names if not np.allclose(train["saved/" + k], train["final/" + k])]
    assert "shared" in moved and "emb/part_0" in moved and "w1/Adam" in moved


def test_a_sharded_checkpoint_restores_into_any_route_and_back(jobs):
    """Saved by 2 workers with route "sharded" (every worker takes part: the rows are
    gathered from their owners); restored into "ps", into 4 workers on 2 hosts sharded, and
    from the single-device graph's own save into "sharded": restored values bit for bit,
    and 3 more steps equal the uninterrupted run; saved with the rows dealt out modulo N,
    restored into rows in ranges."""
    tmp, saved = jobs
    train = _load(tmp, "sharded")
    names = _names(train, "saved")
    plan = {v["name"]: v for v in json.loads(str(train["plan"]))["variables"]}
    assert plan["shared"]["route"] == plan["emb/part_0"]["route"] == "sharded"
    assert plan["shared"]["tiling"] == "M"
    shapes = tf.compat.v1.train.NewCheckpointReader(
        saved["sharded_runner"]).get_variable_to_shape_map()
    assert shapes["shared"] == [models.SHARED_VOCAB, models.IN] and "shared/Adam" in shapes
    for name, n, route in (("sharded_to_ps", 2, "ps"), ("sharded_2x2", 4, "sharded"),
                           ("sharded_from_single", 2, "sharded"),
                           ("sharded_to_ranges", 2, "sharded")):
        for rank in range(n):
            data = _load(tmp, name, rank)
            assert str(data["error"]) == ""
            plan = {v["name"]: v for v in json.loads(str(data["plan"]))["variables"]}
            assert plan["shared"]["route"] == route
            if name == "sharded_to_ranges":
                assert plan["shared"]["tiling"] == "R"
            for k in names:
                np.testing.assert_array_equal(data[f"start/{k}"], train[f"saved/{k}"],
                                              err_msg=f"{name}: restored {k} on worker {rank}")
                np.testing.assert_allclose(data[f"final/{k}"], train[f"final/{k}"], rtol=RTOL,
                                           atol=ATOL, err_msg=f"{name}: {k} on worker {rank}")
    moved = [k for k in names if not np.allclose(train["saved/" + k], train["final/" + k])]
    assert "shared" in moved and "shared/Adam" in moved and "emb/part_1" in moved


def test_a_background_save_holds_its_steps_values(jobs):
    """Runner.save(background=True): the servers copy their parts at the step boundary and
    the chief writes while 3 more steps run; the checkpoint has the boundary's values."""
    tmp, _ = jobs
    data = _load(tmp, "background")
    with open(os.path.join(tmp, "background", "saved.json")) as f:
        prefix = json.load(f)["runner"]
    graph, _ = models.build(**MODEL)
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        tf.compat.v1.train.Saver().restore(sess, prefix)
        variables = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
        values = dict(zip([v.op.name for v in variables], sess.run(variables)))
    assert set(values) == set(_names(data, "saved"))
    for k, v in values.items():
        np.testing.assert_array_equal(v, data[f"saved/{k}"], err_msg=k)
    moved = [k for k in _names(data, "saved")
             if not np.allclose(data[f"saved/{k}"], data[f"final/{k}"])]
    assert "shared" in moved and "shared/Adam" in moved  # on the servers, trained on


def test_the_checkpoint_is_the_single_device_models(jobs):
    """The user's original graph restores it with a plain Saver and no tfpar."""
    tmp, saved = jobs
    train = _load(tmp, "train")
    for prefix in (saved["runner"], saved["saver"]):
        graph, _ = models.build(**MODEL)
        with graph.as_default():
            saver = tf.compat.v1.train.Saver()
            variables = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
            with tf.compat.v1.Session(graph=graph) as sess:
                saver.restore(sess, prefix)
                values = dict(zip([v.op.name for v in variables], sess.run(variables)))
        assert set(values) == set(_names(train, "saved"))
        for k, v in values.items():
            np.testing.assert_array_equal(v, train[f"saved/{k}"], err_msg=f"{prefix}: {k}")
    # Original names and whole shapes: the PS parts of `shared` put back together, and the
    # user's partitioned `emb` as slices of one [23, 6] variable, as a Saver writes it.
    shapes = tf.compat.v1.train.NewCheckpointReader(saved["runner"]).get_variable_to_shape_map()
    assert shapes["shared"] == [models.SHARED_VOCAB, models.IN]
    assert shapes["emb"] == [models.PS_VOCAB, models.IN] and "emb/part_0" not in shapes
    assert shapes["global_step"] == [] and "shared/Adam" in shapes


def test_a_restore_that_cannot_be_complete_raises_and_restores_nothing(jobs):
    tmp, _ = jobs
    for rank in range(2):
        data = _load(tmp, "missing", rank)
        assert "nothing was restored" in str(data["error"])
        assert "'w1/Adagrad' is not in it" in str(data["error"])
        # The variables kept their initial values (all equal to worker 0's broadcast ones).
        np.testing.assert_array_equal(data["start/w1"], _load(tmp, "missing", 0)["start/w1"])
        assert int(data["start/global_step"]) == 0


KILL_WORKER = r'''
import os, sys, tensorflow as tf, tfpar
tf.compat.v1.disable_eager_execution()
g = tf.Graph()
with g.as_default():
    big = tf.compat.v1.get_variable("big", [1_000_000, 64])  # 256 MB: a save takes a while
    loss = tf.reduce_sum(tf.square(tf.gather(big, [1, 2])))
    step = tf.compat.v1.train.get_or_create_global_step()
    train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=step)
with tfpar.get_runner(g) as runner:
    runner.run(train)
    print("saved", runner.save(sys.argv[1]), flush=True)
    while True:
        runner.run(train)
        print("saving", flush=True)
        runner.save(sys.argv[1])
'''


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_readable(tmp_path):
    prefix = str(tmp_path / "model")
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", KILL_WORKER, prefix], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, cwd=REPO)
    partial = []
    try:
        first = None
        for line in proc.stdout:
            if line.startswith("saved"):
                first = line.split()[1]
            if line.startswith("saving"):
                break
        # Killed in the middle of writing the second checkpoint: while TensorFlow's
        # bundle writer writes a file under a temporary name (renamed when complete).
        deadline = time.time() + 60
        while not partial and time.time() < deadline:
            partial = glob.glob(prefix + "-2*.tempstate*")
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert partial, "the second save was never caught while writing"
    assert first == prefix + "-1"
    latest = tf.train.latest_checkpoint(str(tmp_path))
    assert latest == first
    reader = tf.compat.v1.train.NewCheckpointReader(latest)
    assert reader.get_tensor("global_step") == 1
    assert reader.get_tensor("big").shape == (1_000_000, 64)
