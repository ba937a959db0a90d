"""The single-device reference run, and the check that N workers reproduced it.

Tolerance: fp32, rtol=1e-5 and atol=1e-6. Gradients summed in another order (per worker,
then across workers) differ in the last bits; nothing else may differ.
"""
import os

import numpy as np
import tensorflow as tf

from tests.support import models

RTOL, ATOL = 1e-5, 1e-6


def single_device(scenario, n, init):
    """Trains the scenario's graph on one device with the concatenated batch."""
    graph, h = models.build(**scenario["model"])
    with graph.as_default():
        variables = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
        with tf.compat.v1.Session(graph=graph) as sess:
            models.initialise(sess, graph)
            for v in variables:
                v.load(init[v.op.name], sess)
            losses, norms = [], []
            for x, y, ids in models.batches(scenario["steps"], scenario["batch"] * n,
                                            vocab=scenario.get("vocab")):
                fetches = [h["loss"], h["train_op"]] + ([h["norm"]] if h.get("norm") is not None
                                                        else [])
                out = sess.run(fetches, feed_dict=models.feed(h, x, y, ids))
                losses.append(out[0])
                norms.extend(out[2:])
            single_device.norms = norms  # the raw global norms, for tests of clipping
            single_device.eval_losses = _eval_losses(sess, graph, h, scenario, n)
            return models.variable_values(sess, graph), losses


def _eval_losses(sess, graph, h, scenario, n):
    """With a `training` placeholder in the graph (a batch norm's training=<a tensor>):
    the loss in inference mode (training=False) on each worker's rows of models.eval_batch,
    after training; else None."""
    if "training" not in [op.name for op in graph.get_operations()]:
        return None
    b = scenario["batch"]
    x, y, ids = models.eval_batch(b * n, scenario.get("vocab"))
    training = graph.get_tensor_by_name("training:0")
    return [sess.run(h["loss"], {**models.feed(h, x[r * b:(r + 1) * b], y[r * b:(r + 1) * b],
                                               ids[r * b:(r + 1) * b]), training: False})
            for r in range(n)]


def check(out_dir, scenario, n):
    ranks = [np.load(os.path.join(out_dir, scenario["name"], f"rank{r}.npz")) for r in range(n)]
    names = [k[len("init/"):] for k in ranks[0].files if k.startswith("init/")]
    init0 = {k: ranks[0][f"init/{k}"] for k in names}
    # The broadcast made every worker start from worker 0's values, exactly.
    for r in ranks[1:]:
        for k in names:
            np.testing.assert_array_equal(r[f"init/{k}"], init0[k], err_msg=f"init {k}")
    # The same step has the same collectives on every worker (else the liveness hub would
    # take a slow step for runs that differ: tfpar.runtime.liveness._check_runs).
    assert len({str(r["step_collectives"]) for r in ranks}) == 1, \
        [str(r["step_collectives"]) for r in ranks]
    expected, losses = single_device(scenario, n, init0)
    assert set(expected) == set(names)
    for r, data in enumerate(ranks):
        for k in names:
            np.testing.assert_allclose(data[f"final/{k}"], expected[k], rtol=RTOL, atol=ATOL,
                                       err_msg=f"{scenario['name']}: {k} on worker {r}")
    if single_device.eval_losses is not None:  # inference mode after training, per worker
        for r, data in enumerate(ranks):
            np.testing.assert_allclose(data["eval_loss"], single_device.eval_losses[r],
                                       rtol=RTOL, atol=ATOL, err_msg=f"eval loss on {r}")
    # Training moved the variables (the comparison is not between two untouched copies).
    moved = [k for k in names if not np.allclose(expected[k], init0[k])]
    assert "w1" in moved and "global_step" in moved
    assert int(expected["global_step"]) == scenario["steps"]
    clip = scenario["model"].get("clip")
    if clip is not None:  # the clip was active at every step: raw norm above the threshold
        assert len(single_device.norms) == scenario["steps"]
        assert min(single_device.norms) > clip, single_device.norms
    return ranks


def each_scenario(scenarios):
    """Parametrizes a test over `scenarios`, each named by its "name"."""
    import pytest
    return pytest.mark.parametrize("scenario", scenarios, ids=[s["name"] for s in scenarios])


def equal_single_device_tests(scenarios_2, scenarios_4, also=lambda ranks, scenario: None):
    """A scenario module's two equivalence tests, over its fixtures `results2` (one host of 2
    workers) and `results4` (2 hosts x 2): every scenario ends equal to single-device
    training, and `also(ranks, scenario)` checks what that module adds (routes, plans).
    Both are job tests (their fixtures run horovodrun): use it in tests/jobs/."""

    @each_scenario(scenarios_2)
    def test_two_workers_equal_single_device(results2, scenario):
        also(check(results2, scenario, 2), scenario)

    @each_scenario(scenarios_4)
    def test_two_hosts_of_two_workers_equal_single_device(results4, scenario):
        also(check(results4, scenario, 4), scenario)

    return test_two_workers_equal_single_device, test_two_hosts_of_two_workers_equal_single_device
