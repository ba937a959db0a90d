"""A horovodrun worker that gives tfpar bad input: usage: bad_job.py CASE."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tensorflow as tf  # noqa: E402

import models  # noqa: E402
import tfpar  # noqa: E402

tf.compat.v1.disable_eager_execution()
case = sys.argv[1]
if case == "resources":
    graph, _ = models.build()
    tfpar.get_runner(graph, "localhost:3")
elif case == "sparse_hybrid":
    graph, _ = models.build(sparse=True)
    tfpar.get_runner(graph)
elif case == "run_mode":
    graph, _ = models.build()
    tfpar.get_runner(graph, config=tfpar.Config(run_mode="ALLREDUCE"))
print("unexpected: no error")
