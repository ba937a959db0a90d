"""The sharded route's all-to-alls: sizes padded so that Horovod's response cache holds.

Horovod re-negotiates a collective whose tensor shape differs from the shape of its last
run; each all-to-all of the sharded route is padded to the next power of two with rows
the worker addresses to itself (no wire bytes), so its shape changes only when its rows
cross a power of two. The exchanges themselves are checked against single-device
training by the job tests (tests/jobs/test_equivalence.py and others).
"""
import tensorflow as tf

from tfpar.transform.sharded import _next_power_of_two


def test_padding_goes_to_the_next_power_of_two_in_a_graph():
    ks = [0, 1, 2, 3, 4, 5, 7, 8, 9, 511, 512, 513, 2**20, 2**20 + 1]
    graph = tf.Graph()
    with graph.as_default():
        k = tf.compat.v1.placeholder(tf.int32, [])
        padded = _next_power_of_two(k)
    with tf.compat.v1.Session(graph=graph) as session:
        got = [session.run(padded, {k: x}) for x in ks]
    assert got == [1, 1, 2, 4, 4, 8, 8, 8, 16, 512, 512, 1024, 2**20, 2**21]
