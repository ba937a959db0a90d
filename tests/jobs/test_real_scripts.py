"""A real script's graph, unchanged, trains exactly under tfpar: examples/lstm_lm.py.

The LSTM language model of examples/lstm_lm.py is written as the field writes them: a
partitioned embedding, dropout, `tf.compat.v1.nn.rnn_cell.LSTMCell` with a projection run
by `dynamic_rnn` (its weights are read inside a `tf.while_loop`), a
`tf.compat.v1.layers.dense` layer (Keras 2, which tfpar selects), a sampled softmax over a
partitioned softmax weight and bias (sparse gradients from a gather inside the loss), a
loss scaled by a constant, `tf.clip_by_global_norm` over every gradient, Adagrad, and an
exponential moving average of the LSTM's weights. The clip threshold is above the raw norm
here (checked): a sampled softmax's gradient has one row per *batch* for each sampled class
(not one per example), and no data-parallel system reproduces the single-device norm of
such rows from per-worker rows (Horovod's allgather path neither); active clipping over
embeddings and dense layers is tested exactly in test_post_processing. Both the TF2-style graph (resource variables, functional
`While`) and the TF1 one (`tf.compat.v1.disable_v2_behavior()`: reference variables, v1
control flow) run in HYBRID on N=2 and on 2 hosts x 2 workers, and in PS mode (TF1);
the TF2 one also with its embedding and sampled softmax sharded over 2 workers
(sparse_route="sharded").
After 3 steps every variable, slot, moving average and the global step equal
single-device training on the concatenated batch within rtol 1e-5, atol 1e-6. The
sampled softmax draws its classes from a fixed seed, so every worker and the single
device draw the same ones; dropout runs with keep_prob 1 (a different mask per worker
cannot equal one device's).
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
from tests.support.one_device import assert_like_one_device, run_with_reference


STEPS, BATCH = 3, 4
TWO_HOSTS = "localhost:2,127.0.0.1:2"
REFERENCE = r'''
import sys, json, numpy as np, tensorflow as tf
if sys.argv[3] == "tf1":
    tf.compat.v1.disable_v2_behavior()
else:
    tf.compat.v1.disable_eager_execution()
import tfpar
from examples import lstm_lm
from tests.support.workers.lstm_lm import MODEL, data
init = dict(np.load(sys.argv[2]))
graph, h = lstm_lm.build_graph(**MODEL)
with graph.as_default():
    variables = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for v in variables:
            v.load(init["init/" + v.op.name], sess)
        norms = []
        for inputs, targets in data(int(sys.argv[4]), int(sys.argv[5])):
            norm, _ = sess.run([h["norm"], h["train_op"]], {h["inputs"]: inputs, h["targets"]: targets})
            norms.append(float(norm))
        values = dict(zip(["final/" + v.op.name for v in variables], sess.run(variables)))
np.savez(sys.argv[6], norms=np.array(norms), **values)
'''


def _run(tmp, n, scenarios, tf1=False, hosts=None):
    spec = os.path.join(tmp, "scenarios.json")
    with open(spec, "w") as f:
        json.dump(scenarios, f)
    args = [spec, tmp] + (["--tf1"] if tf1 else [])
    proc = horovodrun(n, os.path.join(WORKERS, "lstm_lm.py"), *args, hosts=hosts,
                      timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]


def _check(tmp, name, n, tf1, sparse_route="ps"):
    ranks = [np.load(os.path.join(tmp, name, f"rank{r}.npz")) for r in range(n)]
    out = os.path.join(tmp, name, "reference.npz")
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", REFERENCE, REPO,
                           os.path.join(tmp, name, "rank0.npz"), "tf1" if tf1 else "tf2",
                           str(STEPS), str(BATCH * n), out], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    expected = np.load(out)
    assert max(expected["norms"]) < 100.0, expected["norms"]  # the clip is inactive
    names = [k[len("final/"):] for k in expected.files if k.startswith("final/")]
    for r, data in enumerate(ranks):
        for k in names:
            np.testing.assert_allclose(data[f"final/{k}"], expected[f"final/{k}"], rtol=1e-5,
                                       atol=1e-6, err_msg=f"{name}: {k} on worker {r}")
    moved = [k for k in names if not np.allclose(expected[f"final/{k}"], ranks[0][f"init/{k}"])]
    assert any("ExponentialMovingAverage" in k for k in moved)
    assert any(k.startswith("rnn/") for k in moved) and "embedding/part_0" in moved
    plan = {v["name"]: v for v in json.loads(str(ranks[0]["plan"]))["variables"]}
    assert plan["softmax/weights/part_0"]["route"] == sparse_route
    assert plan["embedding/part_1"]["route"] == sparse_route
    return plan


CASES = [  # (name, workers, hosts, tf1, config)
    ("hybrid_tf2_n2", 2, None, False, {}),
    ("hybrid_tf2_2x2", 4, TWO_HOSTS, False, {}),
    ("hybrid_tf1_n2", 2, None, True, {}),
    ("ps_tf1_2x2", 4, TWO_HOSTS, True, {"run_mode": "PS"}),
    ("ps_tf2_n2", 2, None, False, {"run_mode": "PS"}),
    # Its embedding and sampled softmax (weights and the 1-D bias) sharded over the workers.
    ("sharded_tf2_n2", 2, None, False, {"sparse_route": "sharded"}),
]


@pytest.fixture(scope="module")
def lstm_jobs(tmp_path_factory):
    """The folder of a case's results: the cases of one shape (workers, hosts, TF1 or 2)
    run as one job, when the first of them is asked for."""
    ran = {}

    def folder(case):
        _, n, hosts, tf1, _ = case
        shape = (n, hosts, tf1)
        if shape not in ran:
            ran[shape] = str(tmp_path_factory.mktemp("lstm"))
            _run(ran[shape], n, [{"name": c[0], "config": c[4], "steps": STEPS, "batch": BATCH}
                                 for c in CASES if (c[1], c[2], c[3]) == shape],
                 tf1=tf1, hosts=hosts)
        return ran[shape]
    return folder


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_lstm_language_model_equals_single_device(lstm_jobs, case):
    name, n, hosts, tf1, config = case
    plan = _check(lstm_jobs(case), name, n, tf1, config.get("sparse_route", "ps"))
    kernel = [v for k, v in plan.items() if k.startswith("rnn/") and k.endswith("kernel")][0]
    assert kernel["route"] == ("ps" if config.get("run_mode") == "PS" else "allreduce")


def test_the_example_trains_saves_and_resumes(tmp_path):
    """examples/lstm_lm.py on 2 workers: 4 steps saving every 2 into a folder that does not
    exist yet (made, as TF's MonitoredTrainingSession makes its checkpoint_dir), then the
    same command with more steps resumes from the latest checkpoint, at its global step."""
    folder = tmp_path / "new" / "lm"
    args = ["--vocab", "300", "--batch", "4", "--save-every", "2", "--log-every", "1",
            "--checkpoint-dir", str(folder)]
    script = os.path.join(REPO, "examples", "lstm_lm.py")
    first = horovodrun(2, script, "--steps", "4", *args, timeout=300)
    assert first.returncode == 0, first.stdout[-4000:]
    assert tf.train.latest_checkpoint(str(folder)).endswith("model.ckpt-4")
    assert "step 3: loss" in first.stdout
    second = horovodrun(2, script, "--steps", "6", *args, timeout=300)
    assert second.returncode == 0, second.stdout[-4000:]
    assert f"resumed from {folder / 'model.ckpt-4'} at step 4" in second.stdout
    assert "step 5: loss" in second.stdout and "step 3: loss" not in second.stdout
    assert tf.train.latest_checkpoint(str(folder)).endswith("model.ckpt-6")
    assert glob.glob(str(folder / "events.out.tfevents.*"))  # TensorBoard's summaries


def test_a_checkpoint_folder_that_cannot_be_made_fails_before_training(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("in the way")
    proc = horovodrun(2, os.path.join(REPO, "examples", "lstm_lm.py"), "--vocab", "300",
                      "--steps", "2", "--checkpoint-dir", str(blocker / "lm"), timeout=300)
    assert proc.returncode != 0
    assert f"cannot use '{blocker / 'lm'}' as a checkpoint folder: a file is in the way" \
        in proc.stdout, proc.stdout[-3000:]
    assert "step 0: loss" not in proc.stdout  # before training


# The real-script workers below run in one job (tests/support/workers/real_scripts.py),
# each into its own folder, and their one-device references in one process.
TOGETHER = ("word2vec", "accumulate", "fed_gradients", "dtypes", "bert_optimizer", "queues",
            "loss_scale", "warm_start", "gan", "fine_tune", "late_ops")


@pytest.fixture(scope="module")
def together(tmp_path_factory):
    """The folder each worker of TOGETHER wrote its ranks' and one device's values to."""
    out = str(tmp_path_factory.mktemp("real_scripts"))
    from tests.support.workers import warm_start
    warm_start.pretrained(os.path.join(out, "warm_start"))  # its pre-trained checkpoint
    run_with_reference(os.path.join(WORKERS, "real_scripts.py"), out, *TOGETHER,
                       timeout=600)
    return lambda name: os.path.join(out, name)


def _moved(single, start, names, mode):
    """Training changed each of `names` (from the job's initial values)."""
    for name in names:
        assert not np.allclose(single[f"final/{name}"], start[f"init/{name}"]), (mode, name)


def test_horovods_word2vec_script_equals_single_device_in_every_mode(together):
    """Horovod's tensorflow_word2vec.py with the README's changes (its `init.run()` kept:
    unseeded initialisers, each worker draws its own, tfpar keeps worker 0's) trains as
    one device does on the pairs of both workers, with the tables on the parameter
    servers, allgathered (AR) and sharded; rtol 1e-5, atol 1e-6."""
    for mode in ("HYBRID", "AR", "SHARDED"):
        single, ranks = assert_like_one_device(os.path.join(together("word2vec"), mode))
        for key in (k for k in ranks[0].files if k.startswith("init/")):
            np.testing.assert_array_equal(ranks[1][key], ranks[0][key], err_msg=f"{mode} {key}")
        _moved(single, ranks[0], ("emb", "nce_weights", "nce_biases"), mode)


def test_gradients_accumulated_over_runs_equal_single_device_in_every_mode(together):
    """A TF1 script's gradient accumulation (3 micro-batches per step added into
    non-trainable variables, an embedding's gradient made dense, apply_gradients of the
    accumulators over 3, Adam, a global step): every worker ends where one device does on
    both workers' micro-batches together, in HYBRID, AR and PS; rtol 1e-5, atol 1e-6."""
    for mode in ("HYBRID", "AR", "PS"):
        single, ranks = assert_like_one_device(os.path.join(together("accumulate"), mode))
        assert int(single["final/global_step"]) == 3
        _moved(single, ranks[0], ("emb", "w1", "w2"), mode)


def test_gradients_fed_through_placeholders_equal_single_device_in_every_mode(together):
    """Gradients fetched in one run and fed back to apply_gradients in another (the
    embedding's as the values and indices of IndexedSlices, clipped by their global norm
    after the feed, a fed learning rate): every worker ends where one device does on both
    workers' batches, in HYBRID, PS, AR and sharded; rtol 1e-5, atol 1e-6. (Before, such
    an update was refused: its gradient came from no tf.gradients of its run.)"""
    for mode in ("HYBRID", "PS", "AR", "SHARDED"):
        single, ranks = assert_like_one_device(os.path.join(together("fed_gradients"), mode))
        assert int(single["final/global_step"]) == 3
        _moved(single, ranks[0], ("emb", "w1", "w2", "emb/Adam"), mode)


def test_tables_of_two_dtypes_equal_single_device_in_every_mode_and_again(together):
    """A float64 table beside a float32 one (cast up) and a float64 layer, Adam: every
    worker ends where one device does, in HYBRID, PS, AR and sharded; rtol 1e-5, atol
    1e-6 (bit for bit when measured). Then the model again in HYBRID in the same process,
    all in float32: a second model of one script, with the first one's names, trains as
    one device does. (Before, the sharded rows' lookups sent both
    tables' rows back in one all-to-all, and the rewrite failed on their concatenation;
    and a PS job's second runner met the first one's variables on the worker's TensorFlow
    server, which keeps them by name: of another dtype, they failed to initialise.)"""
    for mode in ("HYBRID", "PS", "AR", "SHARDED", "HYBRID_FLOAT32"):
        single, ranks = assert_like_one_device(os.path.join(together("dtypes"), mode))
        assert single["final/w"].dtype == (np.float32 if mode == "HYBRID_FLOAT32"
                                           else np.float64)
        _moved(single, ranks[0], ("wide", "narrow", "w", "wide/Adam"), mode)


def test_berts_adam_weight_decay_equals_single_device_in_every_mode(together):
    """Google BERT's training step (its AdamWeightDecayOptimizer built from assigns, the
    warm-up and polynomial decay, global-norm clipping, the global step incremented by
    hand): the word embeddings' gradient is sparse but their update dense, so they take
    the allgather under the default routes and `sparse_route="sharded"` (the allreduce
    without the clipping), and every worker ends where one device does on both workers'
    batches; HYBRID, sharded, AR; rtol 1e-5, atol 1e-6."""
    routes = {"HYBRID": "allgather", "SHARDED": "allgather", "AR": "allgather",
              "UNCLIPPED": "allreduce"}
    for mode, route in routes.items():
        single, ranks = assert_like_one_device(os.path.join(together("bert_optimizer"), mode))
        assert [str(got["route"]) for got in ranks] == [route] * 2, mode
        assert int(single["final/global_step"]) == 4
        _moved(single, ranks[0], ("bert/embeddings/word_embeddings", "output_weights",
                                  "bert/embeddings/word_embeddings/adam_v"), mode)


def test_queue_runner_input_trains_as_one_device_does(together):
    """TF1's queue input (the PTB tutorial's ptb_producer: a range_input_producer filled
    by queue runners) over each worker's own rows: the queue runners started by
    tfpar.MonitoredTrainingSession (HYBRID, sharded) or by the script's
    `start_queue_runners(sess=runner)` (AR, PS); every worker ends where one device does
    on all the rows, rtol 1e-5, atol 1e-6; and the script's `saver.save(runner, path)`
    writes the single-device model (PS parts whole)."""
    for mode in ("HYBRID", "SHARDED", "AR", "PS"):
        folder = os.path.join(together("queues"), mode)
        single, ranks = assert_like_one_device(folder)
        assert int(single["final/global_step"]) == 4, mode
        _moved(single, ranks[0], ("emb",), mode)
        if mode in ("AR", "PS"):
            saved = tf.train.load_checkpoint(os.path.join(folder, "saved"))
            for key in single.files:
                np.testing.assert_allclose(saved.get_tensor(key[len("final/"):]), single[key],
                                           rtol=1e-5, atol=1e-6, err_msg=f"{mode}: {key}")


LOSS_SCALE = os.path.join(WORKERS, "loss_scale.py")


@pytest.mark.parametrize("control_flow", ["tf2", "tf1"])
def test_updates_in_a_cond_skip_the_same_steps_as_one_device(together, tmp_path, control_flow):
    """TF's MixedPrecisionLossScaleOptimizer (dynamic loss scale: Adam's update in a
    tf.cond that skips a step whose gradients are not finite), as a TF2 If and as TF1's
    Switch and Merge: one worker's infinite example at step 2 makes the combined
    gradients infinite on every worker, so all skip that step and halve the scale as one
    device does; the variables, slots and the scale equal single-device training (rtol
    1e-5, atol 1e-6) in HYBRID, AR and with sparse_route="sharded", the embedding on a
    replicated route (the servers and shards apply every step's update)."""
    if control_flow == "tf2":
        out = together("loss_scale")
    else:  # TF1's control flow is chosen once a process: a job of its own
        out = str(tmp_path)
        run_with_reference(LOSS_SCALE, out, "--tf1")
    for mode in ("HYBRID", "AR", "SHARDED"):
        single, ranks = assert_like_one_device(os.path.join(out, control_flow, mode))
        assert float(single["final/current_loss_scale"]) == 2.0 ** 14  # halved once
        assert int(single["final/global_step"]) == 3  # the skipped step is not counted
        for got in ranks:
            assert json.loads(str(got["routes"]))["emb"] in ("allgather", "allreduce")
        _moved(single, ranks[0], ("emb", "w1", "w2"), mode)


def test_a_warm_start_from_a_checkpoint_reaches_every_route(together):
    """BERT's fine-tuning warm start (init_from_checkpoint of the variables a pre-trained
    checkpoint holds, a new head from its own initialiser, the script's
    global_variables_initializer() run first): every worker starts from the checkpoint's
    values, with the embedding on the parameter servers, allgathered, sharded and the
    kernels split over the workers (before, a sharded or split variable started from
    its random initialiser, silently), and trains as one device does (rtol 1e-5)."""
    out = together("warm_start")
    pretrained = tf.train.load_checkpoint(os.path.join(out, "pretrained", "model"))
    for mode in ("HYBRID", "AR", "PS", "SHARDED", "TILED"):
        single, ranks = assert_like_one_device(os.path.join(out, mode))
        for got in ranks:
            for name in ("emb", "dense/kernel", "dense/bias", "dense_1/kernel", "dense_1/bias"):
                np.testing.assert_array_equal(got[f"init/{name}"], pretrained.get_tensor(name),
                                              err_msg=f"{mode}: {name}")
        np.testing.assert_array_equal(ranks[0]["init/output_weights"],
                                      ranks[1]["init/output_weights"])
        _moved(single, ranks[0], ("emb", "dense/kernel", "output_weights"), mode)


def test_train_ops_run_by_turns_equal_single_device(together):
    """A GAN's script: the discriminator's and the generator's train ops (separate
    optimizers over separate variables) in separate runs, by turns, the generator's
    without the real input only the discriminator reads (before, every run waited for the
    other side's gradients and failed for want of it, and PS mode was refused): every
    worker ends where one device does, with both sides' embeddings on the parameter
    servers (one servers' step per side), every variable there (PS), allgathered and
    sharded; rtol 1e-5, atol 1e-6."""
    for mode in ("HYBRID", "PS", "AR", "SHARDED"):
        single, ranks = assert_like_one_device(os.path.join(together("gan"), mode))
        assert int(single["final/global_step"]) == 3
        _moved(single, ranks[0], ("emb", "w1", "discriminator/d", "discriminator/d_emb"),
               mode)


def test_a_fine_tuning_scripts_two_phases_equal_single_device(together):
    """A fine-tuning script: the head trained alone (Adam), then the whole model (Momentum,
    a second minimize() that updates the head too), each phase in its own runs. The head's
    two updates are two update groups, so a head-only run applies Adam alone (before,
    with the head's table on the servers, it was refused; with update groups per
    variable it would have applied the Momentum update too, silently). Every worker ends
    where one device does, in HYBRID, PS, AR and sharded; rtol 1e-5, atol 1e-6."""
    for mode in ("HYBRID", "PS", "AR", "SHARDED"):
        single, ranks = assert_like_one_device(os.path.join(together("fine_tune"), mode))
        assert int(single["final/global_step"]) == 4
        _moved(single, ranks[0], ("body/emb", "body/w", "head/w", "head/bias"), mode)


def test_ops_built_after_the_runner_run_as_in_a_plain_session(together):
    """A TF1 script that builds ops after its session exists: its own
    `global_variables_initializer()` run, a pretrained table assigned (on the servers'
    parts; each worker's rows, the values checked alike), a streaming metric and its
    `local_variables_initializer()`, a learning rate halved by an `assign` built in the
    loop, evaluation reads of the table (a norm, a lookup) and a Saver built last, saved
    by the chief alone. Before, each was refused as not in the graph given to
    get_runner. The variables, slots and every evaluation equal one device's on both
    workers' batches, in HYBRID (the table on the servers), PS, AR and sharded, and the
    chief's checkpoint holds the single-device model (PS parts whole); rtol 1e-5,
    atol 1e-6."""
    for mode in ("HYBRID", "PS", "AR", "SHARDED"):
        folder = os.path.join(together("late_ops"), mode)
        single, ranks = assert_like_one_device(folder)
        assert int(single["final/global_step"]) == 3 and single["final/lr"] == np.float32(0.05)
        _moved(single, ranks[0], ("emb", "w", "emb/Adagrad"), mode)
        if mode == "SHARDED":
            continue
        saved = tf.train.load_checkpoint(os.path.join(folder, "saved"))
        for key in (k for k in single.files if k.startswith("final/")):
            np.testing.assert_allclose(saved.get_tensor(key[len("final/"):]), single[key],
                                       rtol=1e-5, atol=1e-6, err_msg=f"{mode} {key}")
