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
