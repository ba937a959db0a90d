"""Per-worker communication counters, computed in the graph from the tensors actually moved.

Each communication path adds a scalar tensor (bytes this worker sent plus received in one
step); `build()` turns them into local counter variables that grow by those amounts every
training step. The runner reads them (`Runner.communication()`).
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Tuple

import tensorflow as tf

PATHS = ("allreduce", "allgather", "ps_push", "ps_pull", "tiled", "sharded")
SCOPE = "tfpar/traffic/"


class Traffic:
    """Collects byte counts per path while transforms build the graph."""

    def __init__(self, graph: tf.Graph, device: str = ""):
        self.graph, self.device = graph, device
        # path -> (update group or None for every group, bytes)
        self.terms: Dict[str, List[Tuple[Optional[int], tf.Tensor]]] = {p: [] for p in PATHS}
        self._vars: Dict[str, tf.Variable] = {}
        self._group: Optional[int] = None

    @contextlib.contextmanager
    def of_group(self, group: int):
        """What is added inside counts at the steps of update group `group` only
        (Plan.update_groups): another group's runs do not compute its tensors."""
        outer, self._group = self._group, group
        try:
            yield
        finally:
            self._group = outer

    def add(self, path: str, nbytes: tf.Tensor) -> None:
        """Counts `nbytes` on `path` at every training step (of the current group)."""
        self.terms[path].append((self._group, tf.cast(nbytes, tf.float64)))

    def counted(self, path: str, tensor: tf.Tensor, nbytes: tf.Tensor) -> tf.Tensor:
        """`tensor`, counting `nbytes` on `path` whenever it is computed (not every step)."""
        with self.graph.as_default(), tf.device(self.device):
            bump = self._var(path).assign_add(tf.cast(nbytes, tf.float64), read_value=False)
            with tf.control_dependencies([bump]):
                return tf.identity(tensor)

    def counter(self, path: str):
        """A `collectives` counter: each exchange adds the bytes its worker received, as
        Horovod reports them, doubled (sent plus received: a worker sends what the others
        receive from it, the same on average)."""
        def count(received: tf.Tensor, predicted: float) -> tf.Operation:
            with self.graph.as_default(), tf.device(self.device):
                return self._var(path).assign_add(2.0 * received, read_value=False)
        return count

    def build(self, groups: int = 1) -> List[tf.Operation]:
        """For each update group, the op that adds one of its steps' bytes (and 1 to the
        step count) to the counters. The groups share the step count's op: a run that
        makes two groups' updates counts one step (an op runs once a session run)."""
        out = []
        with self.graph.as_default(), tf.device(self.device), \
                tf.compat.v1.name_scope(SCOPE):
            step = self._var("steps").assign_add(tf.constant(1.0, tf.float64),
                                                 read_value=False)
            for group in range(groups):
                updates = [step]
                for path in PATHS:
                    self._var(path)
                    terms = [t for g, t in self.terms[path] if g is None or g == group]
                    if terms:
                        updates.append(self._var(path).assign_add(tf.add_n(terms),
                                                                  read_value=False))
                out.append(tf.group(*updates, name="update" + (f"_group_{group}" if group
                                                               else "")))
        return out

    def _var(self, path: str) -> tf.Variable:
        if path not in self._vars:
            with self.graph.as_default(), tf.device(self.device), tf.control_dependencies(None):
                self._vars[path] = tf.compat.v1.get_local_variable(
                    f"{SCOPE}{path}", shape=[], dtype=tf.float64,
                    initializer=tf.compat.v1.zeros_initializer(), use_resource=True)
        return self._vars[path]


def nbytes(t: tf.Tensor) -> tf.Tensor:
    """Bytes of `t` as a float64 scalar. A static size is a constant, so a step's counter
    update does not wait for the tensor (the updates wait for that counter update; see
    tfpar.transform.rewrite)."""
    if t.shape.is_fully_defined():
        return tf.constant(float(t.shape.num_elements() * t.dtype.size), tf.float64)
    return tf.cast(tf.size(t, out_type=tf.int64) * t.dtype.size, tf.float64)


def counters(graph: tf.Graph) -> Dict[str, tf.Variable]:
    """{path or "steps": counter variable} of a graph that `Traffic.build` rewrote."""
    out = {}
    for v in graph.get_collection(tf.compat.v1.GraphKeys.LOCAL_VARIABLES):
        if v.op.name.startswith(SCOPE):
            out[v.op.name[len(SCOPE):]] = v
    return out
