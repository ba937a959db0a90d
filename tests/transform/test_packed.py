"""Several tensors in one collective (tfpar.transform.packed), as built: the cutting of a
gathered buffer checked bit for bit without Horovod, and the allgather route's rewrite
(its results with real workers: tests/jobs/test_equivalence.py, test_density_routing.py)."""
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from examples import lm, recommender
from tfpar.graph.analysis import analyse
from tfpar.plan.layout import parse_resources
from tfpar.plan.planner import make_plan
from tfpar.runtime import job
from tfpar.transform import packed
from tfpar.transform.allreduce import apply_allreduce

tf1 = tf.compat.v1


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_a_gathered_buffer_is_cut_back_into_every_workers_pieces_bit_for_bit(dtype):
    """Three workers' rows and ids (their bits: NaN patterns, the largest int64) of
    uneven lengths, one worker's empty, end to end as an allgather returns them."""
    rng = np.random.RandomState(0)
    ids = [np.array([2 ** 63 - 1, 0x7FC000017FC00001, -1, 5], np.int64),
           np.zeros([0], np.int64), rng.randint(-2 ** 62, 2 ** 62, size=7).astype(np.int64)]
    rows = [rng.randn(3 * 4).astype(dtype), rng.randn(2 * 4).astype(dtype),
            np.zeros([0], dtype)]
    graph = tf.Graph()
    with graph.as_default():
        parts = [packed.with_sizes([tf.constant(r), packed.as_elements(tf.constant(i),
                                                                       tf.as_dtype(dtype))])
                 for r, i in zip(rows, ids)]
        rows_back, ids_back = packed.split_gathered(tf.concat(parts, 0), 2, 3)
        ids_back = packed.from_elements(ids_back, tf.as_dtype(dtype))
        with tf1.Session() as session:
            got_rows, got_ids = session.run([rows_back, ids_back])
    assert got_rows.tobytes() == np.concatenate(rows).tobytes()
    np.testing.assert_array_equal(got_ids, np.concatenate(ids))


@pytest.mark.parametrize("model, folded", [("lm", False), ("recommender", False),
                                           ("lm", True), ("recommender", True)])
def test_the_allgather_route_is_one_allgather_a_step(model, folded):
    """Every allgathered gradient's rows and ids (the LM's int32 and int64 ids, the
    recommender's ten tables) travel in one Horovod allgather: Horovod's own optimizer
    takes three executions for the LM (rows; each width of ids). With
    `allreduce_by_allgather` the dense gradients (and the recommender's small tables on
    route "allreduce") ride in it too, and no allreduce is left."""
    job.horovod()  # a lone process: a job of one, as a single-process runner has
    if model == "lm":
        graph, _, _ = lm.build_graph(lm.zipf_text(1000, 5000), 1000, 4, batch_size=8)
    else:
        graph, _, _ = recommender.build_graph(items=500, batch_size=8, examples=500)
    analysis = analyse(graph)
    # The recommender's small tables (the hour, the device) on the dense allreduce.
    routes = {v.name: "allreduce" if v.shape[0] < 200 else "allgather"
              for v in analysis.trained if v.kind == "sparse"}
    config = (tfpar.Config(run_mode="AR", allreduce_by_allgather=folded) if model == "lm"
              else tfpar.Config(sparse_route=routes, allreduce_by_allgather=folded))
    plan = make_plan(analysis, config, parse_resources("localhost:4"))
    if model == "recommender":
        assert any(v.kind == "sparse" and v.route == "allreduce" for v in plan.variables)
    gathered = [v for v in plan.variables if v.route == "allgather"]
    assert len(gathered) >= 3
    widths = {graph.get_tensor_by_name(g.indices).dtype for v in gathered for g in v.gradients}
    assert widths == ({tf.int32, tf.int64} if model == "lm" else {tf.int64})
    assert plan.allreduce_by_allgather == folded
    apply_allreduce(graph, plan)
    collectives = [op.type for op in graph.get_operations() if op.type.startswith("Horovod")]
    assert collectives.count("HorovodAllgather") == 1
    assert ("HorovodAllreduce" in collectives) != folded
