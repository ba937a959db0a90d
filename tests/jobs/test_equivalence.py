"""Data-parallel training with N real processes equals single-device training.

Every scenario runs under `horovodrun -np N` (one launch per N runs them all); each worker
starts from different random values, so the runner's broadcast must make them equal. After
K steps every variable (optimizer slots and global step included) on every worker must
equal a single-device run on the concatenated batch that started from worker 0's values.

Tolerance: fp32, rtol=1e-5 and atol=1e-6. Gradients summed in another order (per worker,
then across workers) differ in the last bits; nothing else may differ.
"""
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tests.support.launch import job_results
from tests.support.reference import ATOL, RTOL, check, each_scenario, single_device


STEPS, BATCH = 4, 8


def sc(name, model, config=None):
    return {"name": name, "model": model, "config": config or {}, "steps": STEPS, "batch": BATCH}


SCENARIOS_2 = [
    sc("sgd_average", {"optimizer": "sgd"}),
    sc("sgd_sum", {"optimizer": "sgd", "reduce": "sum"}, {"average_dense": False}),
    sc("momentum_average", {"optimizer": "momentum"}, {"run_mode": "AR"}),
    sc("momentum_sum", {"optimizer": "momentum", "reduce": "sum"}, {"average_dense": False}),
    sc("adam_average", {"optimizer": "adam"}),
    sc("adam_sum", {"optimizer": "adam", "reduce": "sum"}, {"average_dense": False}),
    sc("sgd_clip", {"optimizer": "sgd", "clip": 0.05}),
    sc("adam_clip", {"optimizer": "adam", "clip": 0.05}),
    sc("momentum_ref_variables", {"optimizer": "momentum", "use_resource": False}),
    sc("sparse_sgd_allgather", {"optimizer": "sgd", "sparse": True}, {"run_mode": "AR"}),
    sc("sparse_adam_allgather", {"optimizer": "adam", "sparse": True}, {"run_mode": "AR"}),
    sc("sparse_adagrad_sum", {"optimizer": "adagrad", "sparse": True, "reduce": "sum"},
       {"run_mode": "AR", "average_dense": False, "average_sparse": False}),
    sc("sparse_adam_clip", {"optimizer": "adam", "sparse": True, "clip": 0.05},
       {"run_mode": "AR"}),
    # Batch norm in training mode: normalised over the global batch (moving averages too).
    sc("momentum_batch_norm", {"optimizer": "momentum", "batch_norm": True}),
    sc("adam_batch_norm_clip", {"optimizer": "adam", "batch_norm": True, "clip": 0.05}),
    sc("momentum_batch_norm_moments", {"optimizer": "momentum", "batch_norm": "moments"}),
    # training=<a tensor> under TF1 control flow (disable_v2_behavior): Switch and Merge.
    sc("momentum_batch_norm_cond", {"optimizer": "momentum", "batch_norm": "cond"}),
    sc("adam_batch_norm_moments_cond", {"optimizer": "adam", "batch_norm": "moments_cond"}),
    sc("momentum_batch_norm_cond_tf2", {"optimizer": "momentum", "batch_norm": "cond_tf2"}),
]
SCENARIOS_3 = [
    sc("sgd_average", {"optimizer": "sgd"}),
    sc("momentum_sum", {"optimizer": "momentum", "reduce": "sum"}, {"average_dense": False}),
    sc("adam_clip", {"optimizer": "adam", "clip": 0.05}),
    sc("sparse_adam_allgather", {"optimizer": "adam", "sparse": True}, {"run_mode": "AR"}),
    sc("momentum_batch_norm", {"optimizer": "momentum", "batch_norm": True}),
    sc("adam_batch_norm_moments_clip", {"optimizer": "adam", "batch_norm": "moments",
                                        "clip": 0.05}),
]

results2 = job_results("results2", "equivalence2", 2, SCENARIOS_2)

results3 = job_results("results3", "equivalence3", 3, SCENARIOS_3)


@each_scenario(SCENARIOS_2)
def test_two_workers_equal_single_device(results2, scenario):
    ranks = check(results2, scenario, 2)
    plan = json.loads(str(ranks[0]["plan"]))
    routes = {v["name"]: v["route"] for v in plan["variables"]}
    assert routes["w1"] == "allreduce"
    if scenario["model"].get("sparse"):
        assert routes["emb"] == "allgather"
    assert plan["batch_norms"] == {None: [], True: ["bn/FusedBatchNormV3"],
                                   "moments": ["bn/moments/mean"],
                                   "cond": ["bn/cond/FusedBatchNormV3"],
                                   "moments_cond": ["bn/moments/mean"],
                                   "cond_tf2": ["bn/cond"]}[
        scenario["model"].get("batch_norm")]


@each_scenario(SCENARIOS_3)
def test_three_workers_equal_single_device(results3, scenario):
    check(results3, scenario, 3)


def test_clipping_is_active_and_needs_the_combined_gradient(results2):
    """The clip scenarios only prove something if clipping changes the result."""
    scenario = next(s for s in SCENARIOS_2 if s["name"] == "sgd_clip")
    init = {k[len("init/"):]: v for k, v in
            np.load(os.path.join(results2, "sgd_clip", "rank0.npz")).items() if k.startswith("init/")}
    clipped, _ = single_device(scenario, 2, init)
    unclipped, _ = single_device({**scenario, "model": {"optimizer": "sgd"}}, 2, init)
    assert not np.allclose(clipped["w1"], unclipped["w1"], rtol=RTOL, atol=ATOL)
