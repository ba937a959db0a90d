"""The allreduce rewrite's collectives, as built (their results with real workers:
tests/jobs/test_equivalence.py, test_density_routing.py)."""
import tensorflow as tf

import tfpar
from examples import recommender
from tfpar.graph.analysis import analyse
from tfpar.plan.layout import parse_resources
from tfpar.plan.planner import make_plan
from tfpar.runtime import job
from tfpar.transform.allreduce import apply_allreduce
from tfpar.transform.batch_norm import apply_sync_batch_norm


def test_every_allreduce_of_a_step_can_be_fused_into_one():
    """Horovod fuses only allreduces with one op and the same scale factors: the dense
    layers' averages, the sparse tables' summed rows (route "allreduce") and a batch
    norm's statistics are all sums, so one collective execution carries them all."""
    job.horovod()  # a lone process: a job of one, as a single-process runner has
    graph, _, _ = recommender.build_graph(items=500, batch_size=8, examples=500)
    with graph.as_default():  # a batch norm in training mode on the clicks' logits
        logits = graph.get_tensor_by_name("dnn/logits/BiasAdd:0")
        tf.compat.v1.layers.batch_normalization(logits, training=True, name="bn")
    plan = make_plan(analyse(graph), tfpar.Config(sparse_route="allreduce"),
                     parse_resources("localhost:4"))
    routes = {v.route for v in plan.variables if v.role == "trained"}
    assert routes == {"allreduce"} and any(v.kind == "sparse" for v in plan.variables)
    apply_allreduce(graph, plan)
    apply_sync_batch_norm(graph, plan)
    ops = [op for op in graph.get_operations() if op.type == "HorovodAllreduce"]
    assert len(ops) > 10
    assert {(op.get_attr("reduce_op"), op.get_attr("prescale_factor"),
             op.get_attr("postscale_factor")) for op in ops} == {(1, 1.0, 1.0)}  # 1: Sum
