"""Local aggregation decided by measurement (Config(local_aggregation="auto")).

- The decision (tfpar.plan.routing, pure): on when the bytes a host's link is spared take longer
  there than the one exchange it adds, off otherwise.
- The planner's bytes: the duplicate rows a host's workers push (measured) and all but one
  copy of a dense gradient, bound for the other hosts' parameter servers.
- The mechanism: a host's aggregate holds each row its workers share once (TensorFlow's
  accumulator merges pushes only when their ids ascend, which tfpar's pushes do).
- In a real job: tests/jobs/test_local_aggregation.py.
"""
import json

import numpy as np
import pytest
import tensorflow as tf

from tests.support import models
from tests.support.launch import job_results
from tests.support.reference import check, each_scenario

import tfpar
from tfpar.plan import routing
from tfpar.graph.analysis import analyse
from tfpar.errors import TfparError
from tfpar.plan.measurements import Measurements
from tfpar.plan.planner import decide_aggregation, make_plan
from tfpar.plan.layout import parse_resources
from tfpar.transform.parameter_server import sum_by_id

LINKS = routing.Links(latency_s=1e-3, per_byte_s=1e-8)
TWO_HOSTS = "localhost:2,127.0.0.1:2"


def _aggregate(pushes, prepare):
    """Pushes (ids, values) into one sparse accumulator; what a take returns."""
    g = tf.Graph()
    with g.as_default():
        acc = tf.compat.v1.SparseConditionalAccumulator(tf.float32, shape=[10, 2],
                                                        reduction_type="SUM")
        ops = []
        for ids, vals in pushes:
            ids, vals = prepare(tf.constant(ids, tf.int64), tf.constant(vals, tf.float32))
            ops.append(acc.apply_indexed_slices_grad(
                tf.IndexedSlices(vals, ids, tf.constant([10, 2], tf.int64)), local_step=0))
        taken = acc.take_indexed_slices_grad(len(pushes))
        with tf.compat.v1.Session(graph=g) as sess:
            for op in ops:
                sess.run(op)
            return sess.run([taken.indices, taken.values])


def _unsorted(ids, vals):
    uniq, idx = tf.unique(ids)
    return uniq, tf.math.unsorted_segment_sum(vals, idx, tf.size(uniq))


@pytest.mark.parametrize("prepare, rows", [(sum_by_id, 5), (_unsorted, 7)],
                         ids=["tfpar_pushes", "unsorted_pushes"])
def test_a_hosts_aggregate_holds_each_shared_row_once(prepare, rows):
    """Two workers push ids {7, 2, 5, 2} and {5, 9, 2, 0} (rows 2 and 5 shared): the sum has
    5 rows when the pushes ascend (tfpar) and 7 when they do not (the guard: TF's merge
    assumes order), with the same sums either way."""
    a = (np.array([7, 2, 5, 2]), np.arange(8, dtype=np.float32).reshape(4, 2))
    b = (np.array([5, 9, 2, 0]), np.arange(8, 16, dtype=np.float32).reshape(4, 2))
    ids, vals = _aggregate([a, b], prepare)
    assert len(ids) == rows
    dense = np.zeros((10, 2), np.float32)
    np.add.at(dense, ids, vals)
    expected = np.zeros((10, 2), np.float32)
    for i, v in (a, b):
        np.add.at(expected, i, v)
    np.testing.assert_array_equal(dense, expected)
    if prepare is sum_by_id:
        assert list(ids) == sorted(set(ids))


def test_aggregation_pays_when_the_spared_bytes_outlast_one_exchange():
    on = routing.decide_aggregation(100_000, LINKS)  # 2 ms on the link > 1 ms
    off = routing.decide_aggregation(10_000, LINKS)  # 0.2 ms < 1 ms
    assert on.on and not off.on
    assert on.saving_s == pytest.approx(2e-3) and on.cost_s == 1e-3
    assert "100,000 bytes" in on.reason and "<=" in off.reason


def _plan(config, hosts="a:2,b:2", **model):
    graph, _ = models.build(batch=8, **model)
    analysis = analyse(graph)
    return analysis, make_plan(analysis, config, parse_resources(hosts))


def test_dense_variables_on_the_ps_spare_all_but_one_copy_per_host():
    analysis, plan = _plan(tfpar.Config(run_mode="PS", local_aggregation="auto"))
    dense = sum(v.nbytes for v in plan.variables if v.route == "ps" and v.slot_of is None)
    decision = decide_aggregation(plan, analysis, {}, LINKS)
    # 2 hosts of 2 workers: one spared copy per host, half of it bound for the other host.
    assert decision.saved_bytes == pytest.approx(dense * 2 * 0.5 / 2)


def test_sparse_variables_spare_their_measured_duplicate_rows():
    analysis, plan = _plan(tfpar.Config(local_aggregation="auto"), sparse=True,
                           optimizer="adagrad")
    emb = analysis.variable("emb")
    row = emb.nbytes // emb.shape[0]
    decision = decide_aggregation(plan, analysis, {"emb": 6.0}, LINKS)
    assert decision.saved_bytes == pytest.approx(6.0 * (row + routing.INDEX_BYTES) * 0.5 / 2)
    assert not decide_aggregation(plan, analysis, {"emb": 0.0}, LINKS).on


def test_the_plan_takes_the_measured_choice_and_says_why():
    analysis, plan = _plan(tfpar.Config(local_aggregation="auto"), sparse=True,
                           optimizer="adagrad")
    assert not plan.local_aggregation
    assert any("local aggregation not measured" in n for n in plan.notes)
    # What the job measured decides: many rows shared within a host pay, none does not.
    for duplicates, on in ((1e6, True), (0.0, False)):
        measured = Measurements(links=LINKS, duplicates={"emb": duplicates}, steps=3)
        plan = make_plan(analysis, tfpar.Config(local_aggregation="auto"),
                         parse_resources("a:2,b:2"), measured)
        assert plan.local_aggregation is on
        assert any(n.startswith(f"local aggregation {'on' if on else 'off'} (measured): ")
                   for n in plan.notes)
        assert tfpar.Plan.from_json(plan.to_json()) == plan
        assert plan.routing.aggregation.on is on


def test_sharded_rows_are_aggregated_per_host_as_the_servers_pushes():
    """Route "sharded" on several hosts: local aggregation (on by default) sums a host's
    row gradients before they cross to their owners; one host, or False, sends them
    straight; "auto" prices three more all-to-alls (ids, rows, gradients through the
    host's collector) against the host's shared rows, spared both ways."""
    sharded = dict(sparse=True, optimizer="adagrad")
    _, plan = _plan(tfpar.Config(sparse_route="sharded"), **sharded)
    assert plan.variable("emb").route == "sharded" and not plan.num_ps
    assert plan.local_aggregation
    assert "sharded rows' gradients: local aggregation on" in plan.table()
    _, alone = _plan(tfpar.Config(sparse_route="sharded"), hosts="a:4", **sharded)
    assert not alone.local_aggregation
    _, off = _plan(tfpar.Config(sparse_route="sharded", local_aggregation=False), **sharded)
    assert not off.local_aggregation and "local aggregation off" in off.table()
    analysis, plan = _plan(tfpar.Config(sparse_route="sharded", local_aggregation="auto"),
                           **sharded)
    links = routing.Links(latency_s=1e-3, per_byte_s=1e-8, alltoall_latency_s=0.25e-3)
    emb = analysis.variable("emb")
    row = emb.nbytes // emb.shape[0]
    decision = decide_aggregation(plan, analysis, {"emb": 6.0}, links)
    assert decision.cost_s == pytest.approx(0.75e-3) and "all-to-all" in decision.reason
    assert decision.saved_bytes == pytest.approx(2 * 6.0 * (row + routing.INDEX_BYTES) / 4)
    for duplicates, on in ((1e5, True), (0.0, False)):
        measured = Measurements(links=links, duplicates={"emb": duplicates}, steps=3)
        plan = make_plan(analysis, tfpar.Config(sparse_route="sharded",
                                                local_aggregation="auto"),
                         parse_resources("a:2,b:2"), measured)
        assert plan.local_aggregation is on and plan.routing.aggregation.on is on


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_bad_local_aggregation_is_a_clear_error(bad):
    with pytest.raises(TfparError, match="local_aggregation must be True, False or 'auto'"):
        tfpar.Config(local_aggregation=bad)


# -- a real job ---------------------------------------------------------------------------------
