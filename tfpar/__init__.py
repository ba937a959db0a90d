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
  checkpoint_folder(path) -> path made if missing, or a clear error before training
  MonitoredTrainingSession(checkpoint_dir, hooks, ...) -> TF1's training loop over tfpar
"""
import importlib.util as _importlib_util
import os as _os

# TF1-style scripts build layers with tf.compat.v1.layers and tf.compat.v1.nn.rnn_cell, which
# TensorFlow >= 2.16 offers only with Keras 2 (the tf-keras package). TensorFlow picks its
# Keras on first use, so selecting Keras 2 here works for any script that imports tfpar
# before it builds a layer; a user's own TF_USE_LEGACY_KERAS setting wins.
if _importlib_util.find_spec("tf_keras") is not None:
    _os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

from tfpar.plan.config import Config  # noqa: E402
from tfpar.errors import NotYetSupportedError, TfparError  # noqa: E402
from tfpar.plan import Plan  # noqa: E402
from tfpar.version import __version__  # noqa: E402

# What needs TensorFlow loads on first use, so the pure core (plans, cost model, partition
# counts and tilings) imports without it.
_LAZY = {"get_runner": "tfpar.runtime.runner", "Runner": "tfpar.runtime.runner", "shard": "tfpar.runtime.sharding",
         "partitioner": "tfpar.graph.partitioner", "analyse": "tfpar.graph.analysis",
         "GraphAnalysis": "tfpar.graph.analysis",
         "checkpoint_folder": "tfpar.runtime.checkpoint",
         "MonitoredTrainingSession": "tfpar.runtime.monitored"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later reads skip this hook
        return value
    raise AttributeError(f"module 'tfpar' has no attribute {name!r}")


__all__ = ["get_runner", "shard", "partitioner", "Config", "Plan", "Runner", "TfparError",
           "NotYetSupportedError", "analyse", "GraphAnalysis", "checkpoint_folder",
           "MonitoredTrainingSession", "__version__"]
