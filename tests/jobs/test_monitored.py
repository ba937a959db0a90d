"""tfpar.MonitoredTrainingSession against TensorFlow's own, with real processes.

Each job trains models.build's MLP with an embedding through tfpar.MonitoredTrainingSession
with TF's standard hooks (StopAtStepHook, FeedFnHook feeding the rows of the global step,
LoggingTensorHook, NanTensorHook, FinalOpsHook, and the session's own StepCounterHook and
SummarySaverHook); the reference trains the same graph from the job's initial values
through tf.compat.v1.train.MonitoredTrainingSession on one device with the concatenated
batch. Variables (slots and step included) must agree within rtol 1e-5 and atol 1e-6 (fp32
sums in another order); runs, stops, summary steps must be the same.
"""
import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tests.support.launch import REPO, WORKERS, horovodrun


WORKER = os.path.join(WORKERS, "monitored.py")
RTOL, ATOL = 1e-5, 1e-6
MODEL = {"optimizer": "adam", "sparse": True}
PLAIN = {"name": "plain", "model": MODEL, "last_step": 6, "batch": 4, "save_steps": 3}
WITH_USER_HOOKS = {**PLAIN, "name": "user_hooks", "extra_hooks": True}
# A histogram of every variable, the embedding's sharded: the chief's summaries read it
# whole, a collective the other worker must join.
SHARDED_HISTOGRAMS = {**PLAIN, "name": "sharded_histograms", "histograms": True,
                      "config": {"sparse_route": "sharded"}}
INPUT_ENDS = {"name": "input_ends", "rows": 12}  # 6 rows a worker, 2 a step: 3 steps
STOP_ON_ONE = {"name": "stop_on_one", "model": MODEL, "last_step": 6, "batch": 4,
               "stop_on": [1, 3]}


def _spec(folder, scenarios, tf1=False):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "spec.json")
    with open(path, "w") as f:
        json.dump({"tf1": tf1, "scenarios": scenarios}, f)
    return path


def job(folder, n, scenarios, tf1=False, hosts=None, expect_ok=True):
    proc = horovodrun(n, WORKER, _spec(folder, scenarios, tf1), folder, hosts=hosts,
                      timeout=300)
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-8000:]
    return proc


def reference(folder, n, scenarios, tf1=False):
    """TF's own MonitoredTrainingSession on n workers' rows, from the job's initial values."""
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, WORKER, _spec(folder, scenarios, tf1), folder,
                           "--single", str(n)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-6000:]


def load(folder, name, who):
    with open(os.path.join(folder, name, who + ".json")) as f:
        record = json.load(f)
    return record, np.load(os.path.join(folder, name, who + ".npz"))


def assert_equal_to_reference(folder, name, n):
    single, expected = load(folder, name, "single")
    assert not single["error"], single["error"]
    finals = [k for k in expected.files if k.startswith("final/")]
    assert finals
    for r in range(n):
        record, got = load(folder, name, f"rank{r}")
        assert not record["error"], record["error"]
        assert record["runs"] == single["runs"], (record, single)
        for k in finals:
            np.testing.assert_allclose(got[k], expected[k], rtol=RTOL, atol=ATOL,
                                       err_msg=f"{name}: {k} on worker {r}")
    moved = [k for k in finals if not np.allclose(expected[k], expected["init/" + k[6:]])]
    assert "final/w1" in moved
    return single


def summaries(folder, values=None):
    """{tag: [steps]} of the events files in folder, and how many files there are.
    values: a dict that gets {(tag, step): the histogram's [min, max, num, sum,
    sum_squares]}."""
    files = glob.glob(os.path.join(folder, "events.out.tfevents.*"))
    steps = {}
    for path in files:
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                steps.setdefault(value.tag, []).append(event.step)
                if values is not None and value.HasField("histo"):
                    h = value.histo
                    values[value.tag, event.step] = [h.min, h.max, h.num, h.sum,
                                                     h.sum_squares]
    return {k: sorted(v) for k, v in steps.items()}, len(files)


@pytest.fixture(scope="module")
def hybrid_tf2(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("monitored_hybrid_tf2"))
    proc = job(folder, 2, [PLAIN, STOP_ON_ONE, WITH_USER_HOOKS, SHARDED_HISTOGRAMS,
                           INPUT_ENDS])
    reference(folder, 2, [PLAIN, STOP_ON_ONE, WITH_USER_HOOKS, SHARDED_HISTOGRAMS])
    return folder, proc.stdout


def test_monitored_training_equals_tfs_own_monitored_training(hybrid_tf2):
    folder, output = hybrid_tf2
    single = assert_equal_to_reference(folder, "plain", 2)
    assert single["runs"] == PLAIN["last_step"]
    for r in range(2):
        record, got = load(folder, "plain", f"rank{r}")
        assert int(got["final/global_step"]) == PLAIN["last_step"]
        assert record["eval_step"] == PLAIN["last_step"]  # tensor.eval() under as_default
        assert record["default_is_tfpar"]
    # LoggingTensorHook logged the user's tensors on every worker.
    assert output.count("logged loss") >= 2 * 3, output[-3000:]
    # Checkpoints: every save_steps steps and at the end, TF's names, the latest restorable.
    ckpt = tf.train.latest_checkpoint(os.path.join(folder, "plain", "checkpoints"))
    assert ckpt.endswith("model.ckpt-6"), ckpt
    reader = tf.train.load_checkpoint(ckpt)
    _, got = load(folder, "plain", "rank0")
    np.testing.assert_array_equal(reader.get_tensor("w1"), got["final/w1"])


def test_a_users_checkpoint_saver_and_profiler_hooks_work_through_tfpar(hybrid_tf2):
    """CheckpointSaverHook's Saver writes tfpar's single-device checkpoint (restorable by a
    plain Saver, at TF's steps); ProfilerHook writes the step's timeline."""
    folder, _ = hybrid_tf2
    assert_equal_to_reference(folder, "user_hooks", 2)
    ours = os.path.join(folder, "user_hooks", "extra")
    theirs = os.path.join(folder, "user_hooks", "single_extra")
    state = tf.train.get_checkpoint_state(ours)
    steps = sorted(int(p.rsplit("-", 1)[1]) for p in state.all_model_checkpoint_paths)
    # (TF's list also names the session's own checkpoints: both hooks share one Saver.)
    their_steps = sorted(int(p.rsplit("-", 1)[1]) for p in
                         tf.train.get_checkpoint_state(theirs).all_model_checkpoint_paths
                         if os.path.dirname(p) == theirs)
    assert steps == their_steps, (steps, their_steps)
    _, got = load(folder, "user_hooks", "rank0")
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(ours))
    for name in ("w1", "emb", "global_step"):
        np.testing.assert_array_equal(reader.get_tensor(name), got[f"final/{name}"])
    assert glob.glob(os.path.join(ours, "timeline-*.json"))


def test_the_end_of_the_input_ends_training_cleanly_on_every_worker(hybrid_tf2):
    folder, _ = hybrid_tf2
    records = [load(folder, "input_ends", f"rank{r}") for r in range(2)]
    for record, values in records:
        assert not record["error"], record
        assert record["runs"] == 3
        assert int(values["final/global_step"]) == 3  # end() ran: FinalOpsHook's values
    np.testing.assert_array_equal(records[0][1]["final/w"], records[1][1]["final/w"])


def test_summaries_are_written_by_the_chief_at_tfs_steps(hybrid_tf2):
    folder, _ = hybrid_tf2
    ours, files = summaries(os.path.join(folder, "plain", "checkpoints"))
    theirs, _ = summaries(os.path.join(folder, "plain", "single"))
    assert files == 1  # the chief alone writes (both workers share the folder here)
    assert ours["train_loss"] == theirs["train_loss"], (ours, theirs)
    assert ours["global_step/sec"] == theirs["global_step/sec"], (ours, theirs)
    # TensorBoard's graph is the user's (the rewritten one has Horovod's ops).
    path, = glob.glob(os.path.join(folder, "plain", "checkpoints", "events.out.tfevents.*"))
    graphs = [tf.compat.v1.GraphDef.FromString(e.graph_def) for e in
              tf.compat.v1.train.summary_iterator(path) if e.graph_def]
    assert graphs and not any(n.op.startswith("Horovod") for n in graphs[0].node)
    assert os.path.exists(os.path.join(folder, "plain", "checkpoints", "graph.pbtxt"))


def test_histograms_of_a_sharded_embedding_are_written_at_tfs_steps_with_its_values(
        hybrid_tf2):
    """The chief's summaries read the sharded embedding whole (a collective): every worker
    runs them at the steps the chief writes them, so none waits for ever."""
    folder, _ = hybrid_tf2
    assert_equal_to_reference(folder, "sharded_histograms", 2)
    ours, theirs = {}, {}
    our_steps, _ = summaries(os.path.join(folder, "sharded_histograms", "checkpoints"), ours)
    their_steps, _ = summaries(os.path.join(folder, "sharded_histograms", "single"), theirs)
    emb, = [tag for tag in their_steps if tag.startswith("emb")]  # "emb_1": TF's unique name
    assert our_steps == their_steps and len(their_steps[emb]) == 3, (our_steps, their_steps)
    assert set(ours) == set(theirs)
    for key in theirs:
        # A summary fetched with the training op reads the variable before or after its
        # update (a race on one device too): min, max, sum and sum of squares agree within
        # a step's change, the element count exactly (a tile missing or twice would not).
        assert ours[key][2] == theirs[key][2], key
        np.testing.assert_allclose(ours[key], theirs[key], rtol=0.05, atol=0.05,
                                   err_msg=str(key))
    # The embedding moved between the histograms (the steps are not all the initial one).
    first, last = min(their_steps[emb]), max(their_steps[emb])
    assert theirs[emb, first] != theirs[emb, last]


def test_a_stop_one_worker_requests_stops_every_worker_at_the_same_step(hybrid_tf2):
    folder, _ = hybrid_tf2
    single = assert_equal_to_reference(folder, "stop_on_one", 2)
    assert single["runs"] == STOP_ON_ONE["stop_on"][1]
    for r in range(2):
        _, got = load(folder, "stop_on_one", f"rank{r}")
        assert int(got["final/global_step"]) == STOP_ON_ONE["stop_on"][1]


def test_ps_mode_tf1_on_two_hosts_equals_tfs_own_monitored_training(tmp_path):
    folder = str(tmp_path)
    sc = {**PLAIN, "config": {"run_mode": "PS"}, "model": {"optimizer": "adagrad",
                                                           "sparse": True, "use_resource": False}}
    job(folder, 4, [sc], tf1=True, hosts="localhost:2,127.0.0.1:2")
    reference(folder, 4, [sc], tf1=True)
    assert_equal_to_reference(folder, "plain", 4)


def test_nan_loss_stops_every_worker_and_a_killed_job_resumes_exactly(tmp_path):
    """NanTensorHook's error on worker 0 (its rows are NaN) reaches worker 1; then a job
    killed at step 5 (after the checkpoint of step 3) is relaunched with the same
    checkpoint_dir and ends equal to an uninterrupted run."""
    folder = str(tmp_path)
    nan = {**PLAIN, "name": "nan", "nan_at": 2}
    killed = {**PLAIN, "name": "resumed", "die_at": 5}
    proc = job(folder, 2, [nan, killed], expect_ok=False)
    assert proc.returncode != 0
    records = [load(folder, "nan", f"rank{r}")[0] for r in range(2)]
    assert records[0]["error"].startswith("NanLossDuringTrainingError"), records[0]
    assert records[1]["error"].startswith("TfparError") and "NanLoss" in records[1]["error"]
    assert records[0]["runs"] == records[1]["runs"] == 2
    checkpoints = os.path.join(folder, "resumed", "checkpoints")
    assert tf.train.latest_checkpoint(checkpoints).endswith("model.ckpt-3")

    job(folder, 2, [{**PLAIN, "name": "resumed"}, PLAIN])  # relaunched; and uninterrupted
    for r in range(2):
        record, got = load(folder, "resumed", f"rank{r}")
        assert record["resumed_from"].endswith("model.ckpt-3"), record
        assert record["runs"] == PLAIN["last_step"] - 3
        _, uninterrupted = load(folder, "plain", f"rank{r}")
        for k in (k for k in uninterrupted.files if k.startswith("final/")):
            np.testing.assert_allclose(got[k], uninterrupted[k], rtol=RTOL, atol=ATOL,
                                       err_msg=f"{k} on worker {r}")


MNIST = os.path.join(WORKERS, "horovod_mnist.py")


def test_a_horovod_script_runs_after_the_readmes_changes_and_restores_on_one_device(tmp_path):
    """Horovod's tensorflow_mnist.py shape with the README's two changes trains on 2
    workers (checkpoint_dir given on rank 0 only, as Horovod's scripts do); its checkpoint
    restores into the plain single-device graph."""
    folder, out = str(tmp_path / "checkpoints"), str(tmp_path / "final.npz")
    proc = horovodrun(2, MNIST, folder, out, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert "loss = " in proc.stdout  # LoggingTensorHook
    final = np.load(out)
    assert int(final["global_step"]) == 6
    sys.path.insert(0, os.path.dirname(MNIST))
    try:
        import horovod_mnist  # the same graph, on one device, with a plain Saver
    finally:
        sys.path.pop(0)
    graph = tf.Graph()
    with graph.as_default():
        horovod_mnist.build()
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session(graph=graph) as sess:
            saver.restore(sess, tf.train.latest_checkpoint(folder))
            for v in tf.compat.v1.global_variables():
                np.testing.assert_array_equal(sess.run(v), final[v.op.name], err_msg=v.op.name)


def test_an_unchanged_horovod_script_is_refused_with_what_to_delete(tmp_path):
    proc = horovodrun(2, MNIST, str(tmp_path / "c"), str(tmp_path / "f.npz"), "--unchanged",
                      timeout=300)
    assert proc.returncode != 0
    assert "HorovodAllreduce op(s)" in proc.stdout, proc.stdout[-4000:]
    assert "hvd.DistributedOptimizer(...)" in proc.stdout and "use the plain optimizer" \
        in proc.stdout
    assert "HorovodBroadcast op(s)" in proc.stdout and "hvd.broadcast_global_variables(0)" \
        in proc.stdout
    assert not os.path.exists(str(tmp_path / "f.npz"))
