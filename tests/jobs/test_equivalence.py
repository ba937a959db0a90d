"""Data-parallel training with N real processes equals single-device training.

Every scenario runs under `horovodrun -np N` (one launch per N runs them all, with the
other modules' scenarios of that shape: `tests.support.launch.job_results`); each worker
starts from different random values, so the runner's broadcast must make them equal. After
K steps every variable (optimizer slots and global step included) on every worker must
equal a single-device run on the concatenated batch that started from worker 0's values.

Tolerance: fp32, rtol=1e-5 and atol=1e-6. Gradients summed in another order (per worker,
then across workers) differ in the last bits; nothing else may differ.

Route "sharded" (sparse_route="sharded": the embedding's rows and slots split over the
workers, exchanged by all-to-all) runs in the same jobs. Its `vocab` scenarios draw ids
over the whole vocabulary with every fifth id 3 (duplicated within and across workers;
every worker owns rows the others look up); "sgd_few_ids" draws them from the first half
(on 2 workers only worker 0 owns rows that are looked up: the other sends and receives
nothing but takes part). No server is started for it: after training, each worker
listens on the same sockets as in the Horovod-only scenarios, and has no child process.
"""
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tests.support import models
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


def sharded(name, model, config=None, vocab=models.VOCAB):
    return {**sc(f"sharded_{name}", {"sparse": True, **model},
                 {"sparse_route": "sharded", **(config or {})}), "vocab": vocab}


SHARDED_2 = [
    sharded("adam", {"optimizer": "adam"}),
    sharded("momentum", {"optimizer": "momentum"}),
    sharded("ftrl", {"optimizer": "ftrl"}),
    sharded("adagrad_sum", {"optimizer": "adagrad", "reduce": "sum"},
            {"average_dense": False, "average_sparse": False}),
    sharded("adam_ref_variables", {"optimizer": "adam", "use_resource": False}),
    sharded("sgd_few_ids", {"optimizer": "sgd"}, vocab=None),
    # Post-processing: the global norm over every gradient (the sharded rows' included);
    # clip_by_norm of the sparse gradient and its rows scaled by a tensor of the graph.
    sharded("adam_clip", {"optimizer": "adam", "clip": 0.05}),
    sharded("sgd_clip_by_norm_scaled", {"optimizer": "sgd", "clip_by_norm": 0.1,
                                        "scale_sparse": True}),
    # The user's partitioned embedding (each piece sharded) and one read by two lookups.
    sharded("adam_partitioned_and_shared", {"optimizer": "adam", "emb_partitions": 2,
                                            "shared_embedding": True}, vocab=models.PS_VOCAB),
    # An ExponentialMovingAverage of every variable after the step: the embedding's shadow
    # sharded alike, updated from each worker's own rows.
    sharded("adagrad_ema", {"optimizer": "adagrad", "ema": True}),
    # Rows in ranges (Config.sharded_rows; the others deal them out modulo N).
    sharded("adam_ranges", {"optimizer": "adam"}, {"sharded_rows": "ranges"}),
    sharded("ftrl_ema_ranges", {"optimizer": "ftrl", "ema": True}, {"sharded_rows": "ranges"}),
    # The dense gradients in the rows' all-to-all (Config.allreduce_by_allgather), summed
    # or averaged, beside one table's rows and beside two tables' (a partitioned one).
    sharded("adagrad_sum_dense_in_alltoall", {"optimizer": "adagrad", "reduce": "sum"},
            {"average_dense": False, "average_sparse": False, "allreduce_by_allgather": True}),
    sharded("adam_partitioned_dense_in_alltoall", {"optimizer": "adam", "emb_partitions": 2},
            {"allreduce_by_allgather": True}, vocab=models.PS_VOCAB),
]
# TF1's other optimizers with a sparse apply (RMSProp centred with momentum, Adadelta,
# the proximal ones, AdagradDA with its global step): each owner of rows (a parameter
# server, a worker of the sharded rows) runs a copy of the user's own update op. And a
# partitioned table looked up with TF1's default partition_strategy="mod" (row i in
# piece i % 3, each piece's rows again split over the owners).
OTHER_OPTIMIZERS = ["rmsprop", "adadelta", "proximal_adagrad", "proximal_sgd", "adagrad_da"]
MOD_LOOKUP = {"optimizer": "adam", "emb_partitions": 3, "partition_strategy": "mod"}
OPTIMIZERS_2 = ([sharded(o, {"optimizer": o}) for o in OTHER_OPTIMIZERS]
                + [{**sc(f"servers_{o}", {"optimizer": o, "sparse": True}), "vocab": models.VOCAB}
                   for o in OTHER_OPTIMIZERS]
                + [sharded("adam_partitioned_mod", MOD_LOOKUP, vocab=models.PS_VOCAB),
                   {**sc("servers_adam_partitioned_mod", MOD_LOOKUP), "vocab": models.PS_VOCAB}])
SHARDED_3 = [
    sharded("ftrl", {"optimizer": "ftrl"}),
    sharded("momentum_ref_variables", {"optimizer": "momentum", "use_resource": False}),
    sharded("adagrad_clip", {"optimizer": "adagrad", "clip": 0.05}),
    # (Resource variables: with TF1 variables under TF2 control flow, a shadow's
    # initialized_value reads its variable in a race that a plain Session loses too.)
    sharded("momentum_ema", {"optimizer": "momentum", "ema": True}),
    sharded("adagrad_clip_ranges", {"optimizer": "adagrad", "clip": 0.05},
            {"sharded_rows": "ranges"}),
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

results2 = job_results("results2", "equivalence2", 2, SCENARIOS_2 + SHARDED_2,
                       before_servers=True)  # test_sharded_starts_no_server

# The other optimizers in a 2-worker job of their own (a shape no other module uses): the
# shared 2-worker job took over 3 minutes with them on a slow day.
optimizers2 = job_results("optimizers2", "optimizers2", 2, OPTIMIZERS_2, "localhost:2")

# 3 workers as two hosts of 2 and 1 (two names of this machine, as in
# test_parameter_server): the sharded rows' local aggregation on hosts of unequal size.
results3 = job_results("results3", "equivalence3", 3, SCENARIOS_3 + SHARDED_3,
                       "localhost:2,127.0.0.1:1")


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


def check_sharded(ranks, n, scenario):
    plan = {v["name"]: v for v in json.loads(str(ranks[0]["plan"]))["variables"]}
    sparse = [v for v in plan.values() if v["kind"] == "sparse" and v["role"] == "trained"]
    assert sparse and all(v["route"] == "sharded" for v in sparse)
    # rows over the n workers: modulo n (M) unless ranges (R) were asked
    way = "R" if scenario["config"].get("sharded_rows") == "ranges" else "M"
    for v in sparse:
        assert v["tiling"] == (way if n == 2 else f"{way}{n}")
        slots = [s for s in plan.values() if s["slot_of"] == v["name"]]
        assert all(s["route"] == "sharded" and s["tiling"] == v["tiling"] for s in slots)
    assert plan["w1"]["route"] == "allreduce"
    folded = scenario["config"].get("allreduce_by_allgather") is True
    assert json.loads(str(ranks[0]["plan"]))["allreduce_by_alltoall"] == folded
    for rank in ranks:
        traffic = json.loads(str(rank["communication"]))
        assert traffic["sharded"] > 0 and traffic["ps_push"] == traffic["ps_pull"] == 0, traffic
        assert (traffic["allreduce"] == 0) == folded, traffic  # the dense gradients rode


@each_scenario(SHARDED_2)
def test_sharded_on_two_workers_equals_single_device(results2, scenario):
    check_sharded(check(results2, scenario, 2), 2, scenario)


@each_scenario(OPTIMIZERS_2)
def test_other_optimizers_on_the_owners_of_rows_equal_single_device(optimizers2, scenario):
    ranks = check(optimizers2, scenario, 2)
    if scenario["name"].startswith("sharded_"):
        check_sharded(ranks, 2, scenario)
    else:
        plan = {v["name"]: v for v in json.loads(str(ranks[0]["plan"]))["variables"]}
        sparse = [v for v in plan.values() if v["kind"] == "sparse" and v["role"] == "trained"]
        assert sparse and all(v["route"] == "ps" for v in sparse), plan
        pushes = json.loads(str(ranks[0]["ps_pushes"]))
        assert pushes and all(count > 0 for count in pushes.values()), pushes


@each_scenario(SHARDED_3)
def test_sharded_on_three_workers_equals_single_device(results3, scenario):
    """On hosts of 2 and 1 workers, with local aggregation: rank 0 collects its host's
    ids and rows for the owners of local rank 0 (ranks 0 and 2), rank 1 for rank 1; rank
    2, alone on its host, for every owner."""
    ranks = check(results3, scenario, 3)
    check_sharded(ranks, 3, scenario)
    plan = json.loads(str(ranks[0]["plan"]))
    assert [n for _, n in plan["hosts"]] == [2, 1] and plan["local_aggregation"]


def test_sharded_starts_no_server(results2):
    """Only Horovod listens: the same sockets as in a Horovod-only scenario of the job (no
    TensorFlow server, no parameter server process, no tfpar socket), on every worker."""
    for rank in range(2):
        horovod_only = np.load(os.path.join(results2, SCENARIOS_2[0]["name"], f"rank{rank}.npz"))
        for scenario in SHARDED_2:
            data = np.load(os.path.join(results2, scenario["name"], f"rank{rank}.npz"))
            assert json.loads(str(data["children"])) == []
            assert json.loads(str(data["listening"])) == json.loads(
                str(horovod_only["listening"])), scenario["name"]
