"""Which runs take a batch from the input (tfpar/graph/inputs.py)."""
import tensorflow as tf

from tfpar.graph.inputs import takes_input

tf1 = tf.compat.v1


def test_a_summary_of_the_loss_takes_input_and_one_of_a_variable_does_not():
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.data.make_one_shot_iterator(tf.data.Dataset.range(10).batch(2)).get_next()
        i = tf1.train.range_input_producer(5, shuffle=False).dequeue()
        w = tf1.get_variable("w", [], initializer=tf1.zeros_initializer())
        loss = tf.reduce_sum(tf.cast(x, tf.float32) * w)
        loss_summary = tf1.summary.scalar("loss", loss)
        queue_summary = tf1.summary.scalar("step", tf.cast(i, tf.float32) * w)
        w_summary = tf1.summary.scalar("w", w)
    assert takes_input([loss_summary]) and takes_input([queue_summary.op])
    assert takes_input([tf1.summary.merge([w_summary, loss_summary])])
    assert not takes_input([w_summary]) and not takes_input([w])
