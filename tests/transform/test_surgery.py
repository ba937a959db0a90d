"""The private-API module still works on this TensorFlow (a TF upgrade breaks it here first)."""
import tensorflow as tf

from tfpar.transform import surgery

tf1 = tf.compat.v1


def test_replace_uses():
    g = tf.Graph()
    with g.as_default():
        a = tf.constant(2.0, name="a")
        b = tf.constant(3.0, name="b")
        c = tf.add(a, 1.0, name="c")
        d = tf.multiply(a, 10.0, name="d")
        assert surgery.replace_uses(a, b, keep=[d.op]) == 1
        with tf1.Session() as sess:
            assert sess.run([c, d]) == [4.0, 20.0]


def test_drop_colocation_frees_ops_from_a_moved_variable():
    """Gradients of an embedding lookup built with colocate_gradients_with_ops are
    colocated with the embedding; dropping it leaves their other colocations and devices."""
    g = tf.Graph()
    with g.as_default():
        emb = tf1.get_variable("emb", [5, 2], use_resource=True)
        other = tf1.get_variable("other", [2], use_resource=True)
        loss = tf.reduce_sum(tf.nn.embedding_lookup(emb, [1, 3]) * other)
        tf1.gradients(loss, [emb, other], colocate_gradients_with_ops=True)
        with tf1.colocate_with(emb.op), tf1.colocate_with(other.op):
            both = tf.identity(loss, name="both")

        def colocated(name):
            return [op.name for op in g.get_operations()
                    if f"loc:@{name}".encode() in op.node_def.attr["_class"].list.s]
        assert len(colocated("emb")) > 2 and "both" in colocated("other")
        changed = surgery.drop_colocation(g, ["emb"])
        assert changed >= 3 and colocated("emb") == []
        assert both.op.colocation_groups() == [b"loc:@other"]
        with tf1.Session() as sess:  # the graph still runs
            sess.run(tf1.global_variables_initializer())
            sess.run(both)
