"""tfpar: automatic data parallelism for single-device `tf.compat.v1` training graphs.

    graph = build_my_single_device_graph()          # placeholders, model, optimizer.minimize
    runner = tfpar.get_runner(graph)                # under horovodrun -np N ...
    for step in range(steps):
        runner.run(train_op, feed_dict={x: my_rows}) # same tensors and names as before

Public surface:
  get_runner(graph, resources=None, config=None) -> Runner
  shard(dataset) -> this worker's disjoint slice of a tf.data.Dataset
  partitioner(min_partitions, max_partitions) -> marks variables for a searched split
  Config, Plan, Runner, TfparError, NotYetSupportedError
  analyse(graph) -> GraphAnalysis (what tfpar sees in a graph; no cluster needed)
"""
from tfpar.analysis import GraphAnalysis, analyse
from tfpar.config import Config
from tfpar.errors import NotYetSupportedError, TfparError
from tfpar.partition.partitioner import partitioner
from tfpar.plan import Plan
from tfpar.runner import Runner, get_runner
from tfpar.shard import shard
from tfpar.version import __version__

__all__ = ["get_runner", "shard", "partitioner", "Config", "Plan", "Runner", "TfparError",
           "NotYetSupportedError", "analyse", "GraphAnalysis", "__version__"]
