"""Copying the user's graph (tfpar.graph.graph_copy): the same ops and collections."""
import tensorflow as tf

from tfpar.graph.graph_copy import copy_graph

tf1 = tf.compat.v1


def test_a_graph_whose_train_op_collection_names_a_branch_op_is_copied():
    """An optimizer applied in a TF2 tf.cond adds its op, which lives in the branch's
    function, to the graph's TRAIN_OP collection: the copy leaves that name out (else
    importing fails on it) and keeps every op and the other collections."""
    g = tf.Graph()
    with g.as_default():
        w = tf1.get_variable("w", [2], use_resource=True)
        loss = tf.reduce_sum(w * w)
        grad, = tf.gradients(loss, [w])
        opt = tf1.train.GradientDescentOptimizer(0.1)
        tf.cond(tf.reduce_all(tf.math.is_finite(grad)),
                lambda: opt.apply_gradients([(grad, w)]), tf.no_op)
        tf1.add_to_collection(tf1.GraphKeys.TRAIN_OP, loss.op)
    names = [op.name for op in g.get_collection(tf1.GraphKeys.TRAIN_OP)]
    assert "GradientDescent" in names  # the branch's op, not in g's ops
    copy = copy_graph(g)
    assert {op.name for op in g.get_operations()} <= {op.name for op in copy.get_operations()}
    assert [op.name for op in copy.get_collection(tf1.GraphKeys.TRAIN_OP)] == [loss.op.name]
    assert [v.name for v in copy.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)] == ["w:0"]
