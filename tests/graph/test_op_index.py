"""The ops by name prefix (tfpar.graph.op_index): what a scan of every op's name finds, in
creation order, and the ops added after the index first looked."""
import tensorflow as tf

from tfpar.graph.op_index import OpsByPrefix


def _scan(graph, prefix):
    return [op for op in graph.get_operations() if op.name.startswith(prefix)]


def test_ops_by_prefix_equal_a_scan_and_follow_the_graph_as_it_grows():
    g = tf.Graph()
    with g.as_default():
        with tf.compat.v1.name_scope("Adam/update_w"):
            tf.constant(1.0, name="b")
            tf.constant(2.0, name="a")
        tf.constant(3.0, name="Adam/update_w_1/a")  # another scope with the same start
        tf.constant(4.0, name="Adam")
    index = OpsByPrefix(g)
    for prefix in ("Adam/update_w/", "Adam/update_w", "Adam", "", "zzz"):
        assert index.with_prefix(prefix) == _scan(g, prefix), prefix
    assert [op.name for op in index.with_prefix("Adam/update_w/")] == \
        ["Adam/update_w/b", "Adam/update_w/a"]  # creation order, not by name
    with g.as_default():
        tf.constant(5.0, name="Adam/update_w/c")
        tf.constant(6.0, name="A")
    for prefix in ("Adam/update_w/", "A", ""):
        assert index.with_prefix(prefix) == _scan(g, prefix), prefix
