"""The Plan value, the planner's decisions and the cost model."""
import pytest

import tfpar
from tfpar import cost
from tfpar.analysis import analyse
from tfpar.plan import Plan
from tfpar.planner import make_plan
from tfpar.resources import parse_resources

import models


def plan_for(n=2, **model):
    graph, _ = models.build(batch=8, **model)
    config = tfpar.Config(run_mode="AR" if model.get("sparse") else "HYBRID")
    return make_plan(analyse(graph), config, parse_resources(f"localhost:{n}"))


def test_json_round_trip():
    for plan in (plan_for(), plan_for(3, sparse=True, optimizer="adam")):
        again = Plan.from_json(plan.to_json())
        assert again == plan
        assert again.table() == plan.table()


def test_routes_and_predicted_bytes():
    plan = plan_for(4, sparse=True, optimizer="adam")
    assert plan.variable("w1").route == "allreduce"
    assert plan.variable("w1").predicted_bytes == cost.allreduce_bytes(models.IN * models.HIDDEN * 4, 4)
    emb = plan.variable("emb")
    assert emb.route == "allgather" and emb.reduction == "average"
    # 8 looked-up rows of IN floats per worker, gathered by 3 others: 2 s (N-1).
    assert emb.predicted_bytes == 2 * (8 * models.IN * 4) * 3
    assert plan.variable("emb/Adam").route == "replicated"
    assert plan.variable("global_step").route == "replicated"
    assert plan.predicted_bytes_per_step == sum(
        v.predicted_bytes for v in plan.variables if v.route != "replicated")


def test_parallax_table3_vectors():
    # Parallax section 3.1 (digest test vectors): N = 8, w = 4 MB.
    mb = 1e6
    assert cost.allreduce_bytes(4 * mb, 8) == pytest.approx(14 * mb)
    assert cost.allgather_bytes(0.02 * 4 * mb, 8) == pytest.approx(1.12 * mb)
    assert cost.allreduce_bytes(4 * mb, 1) == 0


def test_hybrid_without_sparse_runs_as_ar():
    plan = plan_for()
    assert plan.run_mode == "HYBRID" and plan.mode == "AR"
    assert any("HYBRID runs as AR" in n for n in plan.notes)


def test_sparse_on_ps_and_ps_mode_are_not_yet_supported():
    graph, _ = models.build(sparse=True)
    a = analyse(graph)
    layout = parse_resources("localhost:2")
    with pytest.raises(tfpar.NotYetSupportedError, match="emb.*run_mode='AR'"):
        make_plan(a, tfpar.Config(), layout)
    with pytest.raises(tfpar.NotYetSupportedError, match="PS"):
        make_plan(a, tfpar.Config(run_mode="PS"), layout)


def test_sum_semantics_in_plan():
    graph, _ = models.build(sparse=True)
    plan = make_plan(analyse(graph), tfpar.Config(run_mode="AR", average_dense=False),
                     parse_resources("localhost:2"))
    assert plan.variable("w1").reduction == "sum" and plan.variable("emb").reduction == "average"
