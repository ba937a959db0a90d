"""A horovodrun worker that gives tfpar bad input: usage: bad_job.py CASE."""
import os
import sys

import tensorflow as tf  # noqa: E402

from tests.support import models  # noqa: E402
import tfpar  # noqa: E402

tf.compat.v1.disable_eager_execution()
case = sys.argv[1]
if case == "resources":
    graph, _ = models.build()
    tfpar.get_runner(graph, "localhost:3")
elif case == "partitions":
    graph, _ = models.build(sparse=True)
    tfpar.get_runner(graph, config=tfpar.Config(partitions=50))
elif case == "sparse_apply":
    graph = tf.Graph()
    with graph.as_default():
        emb = tf.compat.v1.get_variable("emb", [10, 3], use_resource=True)
        loss = tf.reduce_sum(tf.nn.embedding_lookup(emb, [1, 2, 2]))
        (grad, var), = tf.compat.v1.train.AdamOptimizer(0.1).compute_gradients(loss)
        tf.compat.v1.train.AdamOptimizer(0.1).apply_gradients([(tf.convert_to_tensor(grad), var)])
    # routed by name to the servers, which apply sparse updates only
    tfpar.get_runner(graph, config=tfpar.Config(sparse_route={"emb": "ps"}))
elif case == "more_hosts":
    graph, _ = models.build(sparse=True)
    tfpar.get_runner(graph, "localhost:1,127.0.0.1:1")
elif case == "run_mode":
    graph, _ = models.build()
    tfpar.get_runner(graph, config=tfpar.Config(run_mode="ALLREDUCE"))
elif case == "unresolvable_host":
    graph, _ = models.build()
    tfpar.get_runner(graph, "nosuchhost.invalid:2")
elif case in ("id_out_of_range", "id_out_of_range_sharded"):
    graph = tf.Graph()
    with graph.as_default():
        ids = tf.compat.v1.placeholder(tf.int32, [None])
        emb = tf.compat.v1.get_variable("emb", [100, 3], use_resource=True)
        loss = tf.reduce_sum(tf.nn.embedding_lookup(emb, ids))
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    config = (tfpar.Config(partitions=2) if case == "id_out_of_range" else
              tfpar.Config(sparse_route="sharded"))
    with tfpar.get_runner(graph, config=config) as runner:
        # Sharded: worker 1's id 106 has worker 0's rows (modulo 2): worker 1 is named
        runner.run(train, {ids: [3, 107, 5] if case == "id_out_of_range" else
                           [3, 106 if runner.worker_id == 1 else 4]})
print("unexpected: no error")
