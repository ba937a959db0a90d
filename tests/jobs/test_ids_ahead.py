"""The input a step ahead (Config(ids_ahead=True), route "sharded", no local aggregation)
in real jobs of 2 workers and of 2 hosts x 2: each worker's tf.data input a slice of every
global batch (`models.build_from_input`), trained until it ends; the variables, slots
included, equal single-device training on the global batches (rtol=1e-5, atol=1e-6, as
test_equivalence), every batch trained once (the last without a next one). One process,
exactly against a plain session, checkpoints and refusals: tests/runtime/test_ids_ahead.py.
"""
import json

import numpy as np
import pytest
import tensorflow as tf

from tests.support import models
from tests.support.launch import run_worker, horovodrun, WORKERS

STEPS, BATCH = 5, 4
AHEAD = {"sparse_route": "sharded", "local_aggregation": False, "ids_ahead": True}
SCENARIOS = {
    2: [{"name": "adagrad", "optimizer": "adagrad", "config": AHEAD},
        {"name": "adam_clip", "optimizer": "adam", "clip": 0.05, "config": AHEAD}],
    4: [{"name": "ftrl", "optimizer": "ftrl", "config": AHEAD},
        {"name": "momentum_clip", "optimizer": "momentum", "clip": 0.05, "config": AHEAD},
        # the dense gradients in the rows' all-to-all (Config.allreduce_by_allgather)
        {"name": "adam_dense_in_alltoall", "optimizer": "adam",
         "config": {**AHEAD, "allreduce_by_allgather": True}}],
}
HOSTS = {2: None, 4: "localhost:2,127.0.0.1:2"}


@pytest.fixture(scope="module", params=[2, 4], ids=["2_workers", "2_hosts_x_2"])
def job(request, tmp_path_factory):
    import os
    n = request.param
    out = tmp_path_factory.mktemp(f"ahead{n}")
    spec = out / "spec.json"
    spec.write_text(json.dumps({"scenarios": SCENARIOS[n], "steps": STEPS, "batch": BATCH}))
    proc = horovodrun(n, os.path.join(WORKERS, "ids_ahead.py"), str(spec), str(out),
                      hosts=HOSTS[n], timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return n, out


def _single_device(optimizer, clip, n):
    ids, y = models.input_batches(STEPS, BATCH * n)
    graph, loss, train = models.build_from_input(ids, y, 1, 0, optimizer, clip)
    with graph.as_default():
        variables = tf.compat.v1.global_variables()
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(tf.compat.v1.global_variables_initializer())
        # Exactly the batches there are: a plain session's run past the end does part of
        # a step (Adam's decay of its slots, which waits for no input) before the input
        # fails; the runner with the input ahead knows the end before the step.
        losses = [session.run([loss, train])[0] for _ in range(STEPS)]
        return {v.op.name: x for v, x in zip(variables, session.run(variables))}, losses


def test_ids_a_step_ahead_equal_single_device_training(job):
    n, out = job
    for sc in SCENARIOS[n]:
        want, want_losses = _single_device(sc["optimizer"], sc.get("clip"), n)
        mean_loss = np.mean([np.load(out / sc["name"] / f"rank{r}.npz")["losses"]
                             for r in range(n)], axis=0)
        np.testing.assert_allclose(mean_loss, want_losses, rtol=1e-5)
        for r in range(n):
            got = np.load(out / sc["name"] / f"rank{r}.npz")
            plan = json.loads(str(got["plan"]))
            assert plan["ids_ahead"] and {v["route"] for v in plan["variables"]
                                          if v["name"] in ("emb", "bias")} == {"sharded"}
            # every batch once, the last one included (the losses of the whole batch: each
            # worker's mean over its slice, averaged)
            assert len(got["losses"]) == STEPS
            traffic = json.loads(str(got["communication"]))
            assert traffic["sharded"] > 0
            folded = sc["config"].get("allreduce_by_allgather") is True
            assert plan["allreduce_by_alltoall"] == folded
            assert (traffic["allreduce"] == 0) == folded, traffic
            slots = [k for k in got.files if k.startswith("final/emb/")]
            assert slots, got.files  # the optimizer's slots of the sharded rows
            for name, value in want.items():
                np.testing.assert_allclose(got[f"final/{name}"], value, rtol=1e-5, atol=1e-6,
                                           err_msg=f"{sc['name']}: {name} on worker {r}")
