"""Sparse lookups of whole tables kept as built (tfpar.transform.lookups).

Grappler rewrites `embedding_lookup_sparse` to read the whole table; a table that sparse
updates write is copied at every such read. With the lookups kept gathered the step reads
only its rows, and trains bit for bit as the plain graph does (tolerance 0).
"""
import numpy as np
import tensorflow as tf

from examples import recommender
from tfpar.transform.lookups import keep_lookups_gathered

tf1 = tf.compat.v1
STEPS = 5


def _train(keep, steps=STEPS, items=50_000):
    """(lookups kept, the variables after `steps` steps of the recommender, the ops a
    traced step ran): as built, or with its lookups kept gathered."""
    graph, loss, train_op = recommender.build_graph(items, 64, examples=2_000)
    with graph.as_default():
        names = [v.op.name for v in tf1.trainable_variables()]
        kept = keep_lookups_gathered(graph, names) if keep else 0
        init = tf1.global_variables_initializer()
        variables = tf1.global_variables()
    with tf1.Session(graph=graph) as session:
        session.run(init)
        for _ in range(steps):
            session.run(train_op)
        meta = tf1.RunMetadata()
        session.run(train_op, options=tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE),
                    run_metadata=meta)
        ran = {n.node_name for d in meta.step_stats.dev_stats for n in d.node_stats}
        return kept, session.run({v.op.name: v for v in variables}), ran


def test_kept_lookups_train_exactly_as_built_without_reading_whole_tables():
    kept, plain, ran_plain = _train(False)
    assert kept == 0
    # The plain graph's lookups were rewritten by Grappler to read whole tables (if a
    # TensorFlow upgrade stops doing that, this module can go).
    assert any("SimplifyEmbeddingLookupStage" in n for n in ran_plain)
    kept, ours, ran_ours = _train(True)
    assert kept == 10  # each of the 5 features: its linear weights and its embedding
    assert not any("SimplifyEmbeddingLookupStage" in n for n in ran_ours)
    assert ours.keys() == plain.keys()
    for name in plain:
        np.testing.assert_array_equal(ours[name], plain[name], err_msg=name)


def test_only_the_named_tables_are_kept():
    graph, _, _ = recommender.build_graph(1_000, 8, examples=100)
    assert keep_lookups_gathered(graph, ["dnn/input_layer/item_embedding/embedding_weights"]) == 1
    assert keep_lookups_gathered(graph, ["no/such/table"]) == 0
    snapshots = [op for op in graph.get_operations() if op.type == "Snapshot"]
    assert [op.name.split("_tfpar/")[1] for op in snapshots] == ["gathered_rows"]


def test_a_lookup_in_a_while_loop_is_kept_in_its_loop():
    """TF1's while loop (the PTB tutorial's): the Snapshot is built in the loop's frame."""
    was_v2 = tf1.control_flow_v2_enabled()
    tf1.disable_control_flow_v2()
    try:
        _lookup_in_a_while_loop()
    finally:
        if was_v2:
            tf1.enable_control_flow_v2()


def _lookup_in_a_while_loop():
    graph = tf.Graph()
    with graph.as_default():
        # Positive rows: their sums cannot cancel to near zero, where rtol would not hold.
        table = tf1.get_variable("table", [100, 4], use_resource=True,
                                 initializer=tf1.random_uniform_initializer(0.5, 1.0, seed=0))
        ids = tf.sparse.from_dense(tf.constant([[1, 5, 5], [7, 0, 0]], tf.int64))

        def body(i, total):
            rows = tf.nn.embedding_lookup_sparse(table, ids, None, combiner="sum")
            return i + 1, total + tf.reduce_sum(rows)

        _, total = tf1.while_loop(lambda i, t: i < 3, body, [0, 0.0])
        assert keep_lookups_gathered(graph, ["table"]) == 1
        with tf1.Session() as session:  # built outside the loop, it would not run
            session.run(tf1.global_variables_initializer())
            t, rows = session.run([total, tf.reduce_sum(tf.gather(table, [1, 5, 5, 7]))])
            np.testing.assert_allclose(t, 3 * rows, rtol=1e-6)
