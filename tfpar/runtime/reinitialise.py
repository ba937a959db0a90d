"""A user's re-initialisation through the runner: a run of the initialisers of the model's
variables (`tf.compat.v1.global_variables_initializer()`, as TF1 and Horovod scripts run it
first; `Variable.load`) after `get_runner`.

On one device it sets the one model. In the rewritten graph it sets each worker's copy of
a replicated variable on its own (a random initialiser draws differently on each worker),
and of a variable on the parameter servers or split over the workers only the unread copy
the rewrite left of it. So after such a run every worker broadcasts worker 0's values of
the replicated ones, and the chief's values of the others (read from the copies its run
wrote) go to their parts and tiles as a restore's do: the workers hold one model again.
It is a collective: every worker makes the same run, as scripts do.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tfpar.graph import initializers
from tfpar.graph.row_reads import upstream
from tfpar.runtime import job


class Reinitialiser:
    """Finds the runs that re-initialise variables (`reached`) and makes every worker hold
    the one model after them (`__call__`).

    entries: the single-device model's variables (`checkpoint.Entry`); assigner: the
    `checkpoint.Assigner` that sets them from whole values; replicated: {name: variable}
    of those every worker holds a copy of."""

    def __init__(self, session, graph: tf.Graph, entries: Sequence, assigner,
                 replicated: Dict[str, tf.Variable], rank: int, size: int):
        self._session, self._graph = session, graph
        self._entries = {e.name: e for e in entries}
        self._assigner, self._replicated = assigner, replicated
        self._rank, self._size = rank, size
        self._initializers: Optional[Dict[str, str]] = None  # (built on first use)
        self._reached: Dict[tuple, Tuple[str, ...]] = {}
        self._broadcasts: Dict[tuple, tf.Operation] = {}
        self._copy_reads: Dict[str, tf.Tensor] = {}

    def reached(self, ops: Sequence[tf.Operation]) -> Tuple[str, ...]:
        """The variables whose initialisers a run of `ops` runs (in the rewritten graph, a
        replicated variable's own, or that of the copy left of another one)."""
        key = tuple(op.name for op in ops)
        if key not in self._reached:
            if self._initializers is None:
                self._initializers = self._initializers_of_entries()
            self._reached[key] = tuple(sorted({self._initializers[op.name]
                                               for op in upstream(ops)
                                               if op.name in self._initializers}))
        return self._reached[key]

    def __call__(self, names: Tuple[str, ...]):
        """After a run of the initialisers of `names` on every worker: the chief's values
        of those not replicated go to their parts and tiles, and worker 0's replicated
        ones are broadcast."""
        replicated = [n for n in names if n in self._replicated]
        others = [self._entries[n] for n in names if n not in self._replicated]
        if others and self._size > 1:
            # Every worker is here, so every read it ran before its own initialiser run
            # (of the values trained so far) is done: only now may the chief overwrite the
            # parts they read. (Without this, a slower worker could read the new values.)
            job.allgather_strings("reinitialising")
        if others:
            if self._rank == 0:
                values = self._session.run([self._copy_read(e.name) for e in others])
                ops, feeds = self._assigner.assign_ops(others, values)
            else:  # the tiles: each worker takes its tile of the chief's (a collective)
                tiled = self._assigner.tiled(others)
                ops, feeds = self._assigner.assign_ops(
                    tiled, [np.zeros(e.shape, e.dtype) for e in tiled])
            if ops:
                self._session.run(ops, feeds)
        if replicated and self._size > 1:
            key = tuple(replicated)
            if key not in self._broadcasts:  # named alike on every worker: same runs, same order
                with self._graph.as_default(), tf.compat.v1.name_scope(
                        f"tfpar/reinitialised_{len(self._broadcasts)}"):
                    self._broadcasts[key] = job.horovod().broadcast_variables(
                        [self._replicated[n] for n in replicated], 0)
            self._session.run(self._broadcasts[key])
        if others and self._size > 1:  # no worker reads a part before the chief set it
            job.allgather_strings("reinitialised")

    def _initializers_of_entries(self) -> Dict[str, str]:
        """{initialiser op name: its variable's name} for the model's variables (TF's
        `<variable>/Assign`, or the restore a warm start gave it instead)."""
        out = {}
        for name in self._entries:
            try:
                var_op = self._graph.get_operation_by_name(name)
            except KeyError:
                continue
            for op in (initializers.initializer(var_op), initializers.default_initializer(var_op)):
                if op is not None and op.inputs and op.inputs[0].op is var_op:
                    out[op.name] = name
        return out

    def _copy_read(self, name: str) -> tf.Tensor:
        """A read of the copy of variable `name` that its initialiser writes."""
        if name not in self._copy_reads:
            handle = self._graph.get_operation_by_name(name).outputs[0]
            with self._graph.as_default(), tf.compat.v1.name_scope("tfpar/reinitialised/"):
                self._copy_reads[name] = tf.raw_ops.ReadVariableOp(
                    resource=handle, dtype=handle.op.get_attr("dtype")) \
                    if handle.dtype == tf.resource else tf.identity(handle)
        return self._copy_reads[name]
