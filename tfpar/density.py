"""Measuring what density routing needs, in the job, before the graph is rewritten.

- `measure_alpha`: the rows of each sparse variable one worker's step touches, from a
  scratch copy of the worker's own (sharded) graph that computes only the gradients' ids:
  no variable is written and the real input pipeline starts from its beginning.
- `measure_links`: an alpha-beta fit of Horovod allreduces of two sizes on the job's links.

Every rank calls both in the same order; the results are agreed (gathered, then the same
reduction on every rank), so every rank routes alike.
"""
from __future__ import annotations

import json
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tfpar import cost, runtime
from tfpar.errors import TfparError
from tfpar.routing import Links
from tfpar.shard import with_shard_values
from tfpar.transform.graph_copy import copy_graph

_PROBES = 0  # link probes of this process (their Horovod op names must differ)


def measure_alpha(meta, variables: Sequence, steps: int,
                  feed: Optional[Callable[[int], dict]] = None) -> Dict[str, float]:
    """{variable name: mean fraction of its rows touched by one worker's step}, averaged
    over `steps` steps and every worker. `variables` are `analysis.VariableInfo`s of sparse
    variables; `feed(step)` feeds a graph that reads placeholders."""
    hvd = runtime.horovod()
    local = _local_alpha(copy_graph(with_shard_values(meta, hvd.size(), hvd.rank())),
                         variables, steps, feed)
    every = [json.loads(s) for s in runtime.allgather_strings(json.dumps(local))]
    return {v.name: float(np.mean([e[v.name] for e in every])) for v in variables}


def _local_alpha(graph: tf.Graph, variables, steps: int, feed) -> Dict[str, float]:
    fetches = {v.name: [graph.get_tensor_by_name(u.gradient.indices) for u in v.updates]
               for v in variables}
    touched: Dict[str, List[float]] = {v.name: [] for v in variables}
    with graph.as_default():
        inits = [tf.compat.v1.global_variables_initializer(),
                 tf.compat.v1.local_variables_initializer(), tf.compat.v1.tables_initializer()]
    with tf.compat.v1.Session(graph=graph, config=runtime.session_config()) as session:
        initialised = False
        for step in range(steps):
            feed_dict = _feed(graph, feed, step)
            try:
                ids = session.run(fetches, feed_dict=feed_dict)
            except tf.errors.FailedPreconditionError:
                if initialised:
                    raise
                session.run(inits)  # the ids depend on a variable (e.g. a lookup table)
                initialised = True
                ids = session.run(fetches, feed_dict=feed_dict)
            except tf.errors.InvalidArgumentError as e:
                if "must feed a value for placeholder" in e.message:
                    raise TfparError(
                        "tfpar.Config(sparse_route='auto') measures each sparse variable's "
                        "density by running its lookups, and this graph needs feeds: give "
                        "tfpar.Config(search_feed=lambda step: {placeholder: value, ...}) or "
                        "set the routes with sparse_route='ps', 'allreduce' or a dict") from None
                raise
            for v in variables:
                # The rows one step reads and pushes: every gradient's distinct ids.
                rows = set()
                for part in ids[v.name]:
                    rows.update(np.unique(part).tolist())
                touched[v.name].append(len(rows) / v.shape[0])
    return {name: float(np.mean(t)) for name, t in touched.items()}


def _feed(graph: tf.Graph, feed, step: int) -> Optional[dict]:
    if feed is None:
        return None
    out = {}
    for key, value in feed(step).items():
        name = key if isinstance(key, str) else key.name
        out[graph.get_tensor_by_name(name if ":" in name else name + ":0")] = value
    return out


def measure_links(repeats: int = 3, max_elements: int = 1 << 24) -> Links:
    """An alpha-beta fit t = latency + bytes * per_byte of Horovod allreduces on the job's links.

    The latency is the fastest of `repeats` one-float allreduces (other work only adds
    time). The large probe grows 4x from 64K floats until it takes 10x the latency and at
    least 20 ms, so its bytes, not noise, decide the slope. Rank 0's timings decide (each
    growth step too), so every rank runs the same collectives and gets the same fit.
    """
    global _PROBES
    _PROBES += 1
    hvd = runtime.horovod()
    n = hvd.size()
    t_small = _agreed(_time_allreduce(1, repeats, f"tfpar_link_probe_{_PROBES}_small"))
    k = 1 << 16
    while True:
        t_large = _agreed(_time_allreduce(k, repeats, f"tfpar_link_probe_{_PROBES}_{k}"))
        if (t_large >= max(10 * t_small, 0.02)) or k >= max_elements:
            break
        k *= 4
    moved = cost.allreduce_bytes(4 * k, n) - cost.allreduce_bytes(4, n)
    per_byte = max(t_large - t_small, 0.0) / moved if moved > 0 else 0.0
    return Links(latency_s=t_small, per_byte_s=per_byte)


def _time_allreduce(elements: int, repeats: int, name: str) -> float:
    hvd = runtime.horovod()
    g = tf.Graph()
    with g.as_default():
        op = hvd.allreduce(tf.ones([elements], tf.float32), op=hvd.Sum, name=name)
    with tf.compat.v1.Session(graph=g, config=runtime.session_config()) as session:
        session.run(op)  # warm up (negotiation, buffers)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            session.run(op)
            samples.append(time.perf_counter() - start)
    return min(samples)


def _agreed(seconds: float) -> float:
    """Rank 0's measurement, on every rank."""
    return float(runtime.allgather_strings(repr(seconds))[0])
