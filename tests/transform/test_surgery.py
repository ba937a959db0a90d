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


SERVER = """
import json, socket, sys
from tfpar.transform import surgery
server, cluster, config = surgery.server_only()
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
srv = server(cluster({"ps": [f"127.0.0.1:{port}"]}), job_name="ps", task_index=0,
             config=config(device_filters=["/job:ps"]), start=True)
loaded = sorted(m for m in sys.modules if m.startswith(("keras", "tf_keras", "tensorflow._api")))
print(json.dumps({"port": port, "api": loaded}), flush=True)
sys.stdin.read()  # until the test closes it
"""


def test_server_only_serves_a_sparse_update_without_tensorflows_api():
    """A parameter server's process loads the server alone (no API module, no Keras), and
    a worker's graph runs on it as on a full TensorFlow: a variable, Adagrad's sparse
    update with its slot, a gather, a segment sum."""
    import json
    import os
    import subprocess
    import sys

    import numpy as np

    def model():
        v = tf1.get_variable("v", initializer=np.arange(40, dtype=np.float32).reshape(10, 4))
        grad = tf.IndexedSlices(tf.ones([3, 4]), tf.constant([1, 3, 1]))
        update = tf1.train.AdagradOptimizer(0.1).apply_gradients([(grad, v)])
        read = tf.gather(v, [1, 3, 5]) + tf.math.unsorted_segment_sum(
            tf.ones([3, 4]), [0, 1, 1], 3)
        return update, read

    expected = tf.Graph()
    with expected.as_default(), tf1.Session() as sess:
        update, read = model()
        sess.run(tf1.global_variables_initializer())
        sess.run(update)
        want = sess.run(read)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        started = json.loads(proc.stdout.readline())
        assert started["api"] == [], started
        g = tf.Graph()
        with g.as_default(), tf.device("/job:ps/task:0"):
            update, read = model()
        with g.as_default(), tf1.Session(f"grpc://127.0.0.1:{started['port']}") as sess:
            sess.run(tf1.global_variables_initializer())
            sess.run(update)
            got = sess.run(read)
        np.testing.assert_array_equal(got, want)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
