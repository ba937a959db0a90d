"""The partition search in a real 2-worker job, on the language model.

The search (forced, counts 1..4, at most 5 trials of 1+3 steps) runs inside get_runner.
The runner it returns must start from exactly the values a runner made without a search
starts from (no trial update leaks), and after 3 steps equal single-device training on
the concatenated batch (rtol 1e-5, atol 1e-6). A second job finds the count remembered.
"""
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tests.support import search_model
from tests.support.launch import REPO, WORKERS, horovodrun
from tests.support.reference import ATOL, RTOL


N = 2


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("search")
    cache = out / "cache"
    proc = horovodrun(N, os.path.join(WORKERS, "search.py"), str(out), str(cache),
                      timeout=600)
    assert proc.returncode == 0, proc.stdout[-8000:]
    return out, proc.stdout


def _single_device(init):
    graph, loss, train_op = search_model.build()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        variables = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
        sess.run(tf.compat.v1.global_variables_initializer())
        for v in variables:
            v.load(init[v.op.name], sess)
        for previous, target in search_model.batches(search_model.STEPS + 50, N)[
                :search_model.STEPS]:
            sess.run(train_op, {"previous:0": previous, "target:0": target})
        return dict(zip([v.op.name for v in variables], sess.run(variables)))


def test_search_runs_and_chooses_within_bounds(job):
    out, stdout = job
    plan = json.loads(str(np.load(out / "rank0.npz")["plan"]))
    (decision,) = plan["partition_search"].values()
    assert decision["source"] == "searched" and decision["variables"] == ["embedding"]
    samples = decision["search"]["samples"]
    assert 1 <= len(samples) <= 5 and all(1 <= p <= 4 for p, _ in samples)
    assert 1 <= decision["partitions"] <= 4
    emb = next(v for v in plan["variables"] if v["name"] == "embedding")
    assert len(emb["parts"]) == decision["partitions"]
    assert "partition search for embedding: trial 1: P=1" in stdout  # progress is logged


def test_training_after_the_search_starts_as_without_it_and_equals_one_device(job):
    out, _ = job
    ranks = [np.load(out / f"rank{r}.npz") for r in range(N)]
    names = [k[len("init_a/"):] for k in ranks[0].files if k.startswith("init_a/")]
    init = {n: ranks[0][f"init_a/{n}"] for n in names}
    for data in ranks:
        for n in names:
            np.testing.assert_array_equal(data[f"init_a/{n}"], data[f"init_b/{n}"], err_msg=n)
            np.testing.assert_array_equal(data[f"init_a/{n}"], init[n], err_msg=n)
    expected = _single_device(init)
    for r, data in enumerate(ranks):
        for n in names:
            np.testing.assert_allclose(data[f"final_a/{n}"], expected[n], rtol=RTOL, atol=ATOL,
                                       err_msg=f"{n} on worker {r}")
    assert not np.allclose(expected["embedding"], init["embedding"])


def test_the_count_is_remembered(job, tmp_path):
    out, _ = job
    files = os.listdir(out / "cache")
    assert len(files) == 1 and files[0].endswith(".json")
    record = json.loads((out / "cache" / files[0]).read_text())
    (group,) = record["groups"].values()
    plan = json.loads(str(np.load(out / "rank0.npz")["plan"]))
    assert group["partitions"] == next(iter(plan["partition_search"].values()))["partitions"]


def test_tfpar_plan_shows_the_remembered_search_and_can_forget_it(job):
    from tests.test_cli import tfpar_cmd
    out, _ = job
    args = ("plan", os.path.join(REPO, "tests", "support", "search_model.py:build"),
            "--resources", "localhost:2", "--search-cache", str(out / "cache"))
    proc = tfpar_cmd(*args)
    assert proc.returncode == 0, proc.stderr
    assert "partition count of embedding: P=" in proc.stdout
    assert "(remembered from an earlier search)" in proc.stdout and "trials: P=1:" in proc.stdout
    proc = tfpar_cmd(*args, "--forget-search")
    assert proc.returncode == 0 and "forgot the remembered partition search" in proc.stdout
    assert os.listdir(out / "cache") == []
    assert "searched when the job starts" in tfpar_cmd(*args).stdout
