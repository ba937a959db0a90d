"""Asynchronous training: tfpar.Config(sync=False).

What equivalence means here: each worker's step applies its own batch's gradient with the
user's optimizer to the values the parameter servers hold at that moment. So when the
workers' steps happen one after another (the test makes them take turns), the result is
single-device training on that sequence of batches, one step each (rtol=1e-5, atol=1e-6,
as test_equivalence). Optimizer state shared by all variables (Adam's beta powers, the
global step) is each worker's own, counting its own steps, so the serial check uses
optimizers without it. Without turns, no worker waits for another (a slow worker does not
slow the others), and on the LM the loss falls as in synchronous training (margin below).
"""
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tests.support import models
from tests.support.launch import REPO, WORKERS, horovodrun
from tests.support.reference import ATOL, RTOL

import tfpar
from tfpar.errors import TfparError


WORKER = os.path.join(WORKERS, "async_steps.py")
MODELS = {
    "adagrad_partitioned": {"optimizer": "adagrad", "emb_partitions": 2,
                            "shared_embedding": True},
    "momentum": {"optimizer": "momentum", "sparse": True, "emb_partitions": 3},
    "sgd_clip": {"optimizer": "sgd", "emb_partitions": 2, "clip": 0.05},
}


def _serial_reference(model, init, n, rounds=3, batch=8):
    graph, h = models.build(**model)
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES):
            v.load(init[v.op.name], sess)
        for x, y, ids in models.batches(rounds * n, batch, vocab=models.PS_VOCAB):
            sess.run(h["train_op"], feed_dict=models.feed(h, x, y, ids))
        return models.variable_values(sess, graph)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_workers_taking_turns_equal_single_device_on_their_batches_in_order(tmp_path, name):
    n = 2 if name != "momentum" else 3
    proc = horovodrun(n, WORKER, "serial", str(tmp_path), json.dumps(MODELS[name]))
    assert proc.returncode == 0, proc.stdout[-4000:]
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(n)]
    plan = json.loads(str(ranks[0]["plan"]))
    assert plan["sync"] is False and plan["mode"] == "PS"
    names = [k[len("init/"):] for k in ranks[0].files if k.startswith("init/")]
    init = {k: ranks[0][f"init/{k}"] for k in names}
    expected = _serial_reference(MODELS[name], init, n)
    moved = 0
    for r, data in enumerate(ranks):
        for k in names:
            if k == "global_step":  # each worker counts its own steps
                assert int(data[f"final/{k}"]) == 3
                continue
            np.testing.assert_allclose(data[f"final/{k}"], expected[k], rtol=RTOL, atol=ATOL,
                                       err_msg=f"{name}: {k} on worker {r}")
            moved += not np.allclose(expected[k], init[k])
    assert moved >= len(names) - 1  # every trained variable (and slot) moved
    assert int(expected["global_step"]) == 3 * n


def test_no_worker_waits_for_a_slow_one(tmp_path):
    loops = {}
    for case in ("timing_async", "timing_sync"):
        out = tmp_path / case
        out.mkdir()
        proc = horovodrun(2, WORKER, case, str(out), json.dumps(MODELS["adagrad_partitioned"]))
        assert proc.returncode == 0, proc.stdout[-4000:]
        loops[case] = [json.loads((out / f"rank{r}.json").read_text())["loop_s"]
                       for r in range(2)]
    # Rank 1 sleeps 8 x 0.3 s. Synchronous: rank 0 waits for it every step; asynchronous:
    # rank 0 runs its 8 steps at its own pace.
    assert loops["timing_sync"][0] > 0.8 * loops["timing_sync"][1], loops
    assert loops["timing_async"][0] < 0.4 * loops["timing_async"][1], loops


def _lm(tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    proc = horovodrun(2, os.path.join(REPO, "examples", "lm.py"), "--steps", "150",
                      "--warmup", "5", "--log-every", "50", "--vocab", "2000",
                      "--partitions", "1", "--json", str(out), *args, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return json.loads(out.read_text())


def test_lm_loss_falls_like_synchronous_training(tmp_path):
    """The LM (vocabulary 2,000, 128 words per worker per step, 150 steps, 2 workers): the
    mean loss of the last 50 steps is within 5% of synchronous training's, or lower (each
    of the N workers' gradients is applied, so asynchronous training makes N updates per
    round: more progress per step, with stale reads)."""
    sync = _lm(tmp_path, "sync", "--run-mode", "PS")
    assert sync["sync"] is True and sync["loss_last"] < sync["loss_first"] - 0.5
    for mode in ("PS", "HYBRID"):
        asynchronous = _lm(tmp_path, f"async_{mode}", "--run-mode", mode, "--async")
        assert asynchronous["sync"] is False and asynchronous["mode"] == mode
        # The fall is measured from synchronous training's first 50 steps (the same batches
        # on worker 0, a deterministic 4.44): asynchronous training's own first 50 steps
        # hold as many of worker 1's updates as the scheduler let in (3.8 to 4.2 in repeated
        # runs), so a fall measured from them once missed 0.5 in CI with training fine.
        assert asynchronous["loss_last"] < sync["loss_first"] - 0.5, (asynchronous, sync)
        assert asynchronous["loss_last"] <= 1.05 * sync["loss_last"], (asynchronous, sync)


def test_async_needs_a_parameter_server_mode():
    with pytest.raises(TfparError, match="AR mode has none"):
        tfpar.Config(run_mode="AR", sync=False)
    with pytest.raises(TfparError, match="sync must be True or False"):
        tfpar.Config(sync="no")
