"""`get_runner` and the session-like Runner that trains the rewritten graph."""
from __future__ import annotations

import logging
from typing import Dict, Optional

import tensorflow as tf

from tfpar import runtime
from tfpar.analysis import analyse
from tfpar.config import Config
from tfpar.errors import TfparError
from tfpar.plan import Plan
from tfpar.planner import make_plan
from tfpar.resources import parse_resources, reconcile
from tfpar.shard import with_shard_values
from tfpar.transform.allreduce import apply_allreduce
from tfpar.transform.graph_copy import copy_graph, to_meta_graph

log = logging.getLogger("tfpar")


def get_runner(graph, resources=None, config: Optional[Config] = None) -> "Runner":
    """Turns a single-device training graph into a data-parallel Runner for this worker.

    Args:
      graph: the single-device `tf.Graph` (or a `MetaGraphDef`) with an optimizer's update ops.
      resources: the cluster: `"host1:2,host2:2"`, a path to a file of `host[: gpu ids]`
        lines, or None to take it from the running `horovodrun` job. It must agree with
        the job.
      config: a `tfpar.Config`; default `Config()` (HYBRID).

    Returns:
      A `Runner` that runs the user's tensors, ops and names like a `tf.compat.v1.Session`.
      Every worker starts from worker 0's variable values.
    """
    config = Config() if config is None else config
    if not isinstance(config, Config):
        raise TfparError(f"config must be a tfpar.Config, got {type(config).__name__}")
    requested = parse_resources(resources)
    meta = to_meta_graph(graph)
    analysis = analyse(graph if isinstance(graph, tf.Graph) else meta, config.gradient_scope)

    hvd = runtime.horovod()
    layout = reconcile(requested, runtime.current_layout())
    plan = make_plan(analysis, config, layout)

    rewritten = copy_graph(with_shard_values(meta, hvd.size(), hvd.rank()))
    apply_allreduce(rewritten, plan)
    init = runtime.init_op(rewritten)
    broadcast = runtime.broadcast_op(rewritten)
    host = layout.hosts[layout.host_of_rank(hvd.rank())]
    session = tf.compat.v1.Session(
        graph=rewritten, config=runtime.session_config(config.session_config, host.gpus))
    try:
        session.run(init)
        session.run(broadcast)
    except Exception:
        session.close()
        raise
    if hvd.rank() == 0:
        log.info("%s", plan.table())
    source = graph if isinstance(graph, tf.Graph) else None
    return Runner(session, rewritten, plan, hvd.rank(), hvd.size(), source)


class Runner:
    """Runs the rewritten graph with the names and objects of the user's original graph.

    `run(fetches, feed_dict)` takes the original graph's tensors, ops, variables or their
    names (in any nest of lists, tuples, dicts) and returns values in the same structure.
    """

    def __init__(self, session, graph: tf.Graph, plan: Plan, worker_id: int, num_workers: int,
                 source_graph: Optional[tf.Graph] = None):
        self._session = session
        self._graph = graph
        self._plan = plan
        self._worker_id = worker_id
        self._num_workers = num_workers
        self._source = source_graph
        self._reads: Dict[str, tf.Tensor] = {}

    worker_id = property(lambda self: self._worker_id, doc="This worker's index (the Horovod rank).")
    num_workers = property(lambda self: self._num_workers, doc="How many workers the job has.")
    is_chief = property(lambda self: self._worker_id == 0, doc="Whether this is worker 0.")
    plan = property(lambda self: self._plan, doc="What tfpar decided (a printable tfpar.Plan).")
    graph = property(lambda self: self._graph, doc="The rewritten graph this runner executes.")
    session = property(lambda self: self._session, doc="The underlying tf.compat.v1.Session.")

    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        """Like `tf.compat.v1.Session.run`, with the original graph's tensors, ops and names."""
        if self._session is None:
            raise TfparError("this tfpar Runner is closed")
        mapped = tf.nest.map_structure(self._element, fetches)
        feeds = None
        if feed_dict:
            feeds = {self._element(k, feed=True): v for k, v in feed_dict.items()}
        return self._session.run(mapped, feed_dict=feeds, options=options,
                                 run_metadata=run_metadata)

    def close(self):
        """Closes the session; the Horovod job stays up for other runners of this process."""
        if self._session is not None:
            self._session.close()
            self._session = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- name mapping ----------------------------------------------------------------------
    def _element(self, x, feed=False):
        if isinstance(x, tf.IndexedSlices):
            return tf.IndexedSlices(*(self._element(t) for t in (x.values, x.indices)),
                                    self._element(x.dense_shape) if x.dense_shape is not None
                                    else None)
        if isinstance(x, tf.Variable):
            self._check_graph(x)
            return self._read(x.op.name)
        if isinstance(x, (tf.Tensor, tf.Operation)):
            self._check_graph(x)
            name = x.name
        elif isinstance(x, str):
            name = x
        else:
            raise TfparError(f"cannot {'feed' if feed else 'fetch'} {x!r}: give a tensor, op, "
                             "variable or name of the graph passed to tfpar.get_runner")
        try:
            el = self._graph.as_graph_element(name)
        except (KeyError, ValueError) as e:
            raise TfparError(f"{'feed' if feed else 'fetch'} {name!r} is not in the graph "
                             f"given to tfpar.get_runner ({e})") from None
        if isinstance(el, tf.Tensor) and el.dtype == tf.resource and not feed:
            return self._read(el.op.name)
        return el

    def _check_graph(self, x):
        if self._source is not None and x.graph is not self._source:
            raise TfparError(f"{x.name!r} belongs to another graph than the one given to "
                             "tfpar.get_runner")

    def _read(self, var_name: str) -> tf.Tensor:
        """The value of a variable of the rewritten graph (made once, then reused)."""
        if var_name not in self._reads:
            try:
                op = self._graph.get_operation_by_name(var_name)
            except KeyError:
                raise TfparError(f"variable {var_name!r} is not in the graph given to "
                                 "tfpar.get_runner") from None
            with self._graph.as_default(), tf.compat.v1.name_scope("tfpar/read/"):
                if op.type == "VarHandleOp":
                    t = tf.raw_ops.ReadVariableOp(resource=op.outputs[0],
                                                  dtype=op.get_attr("dtype"))
                else:
                    t = tf.identity(op.outputs[0])
            self._reads[var_name] = t
        return self._reads[var_name]
