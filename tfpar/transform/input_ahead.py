"""The input a step ahead (`Plan.ids_ahead`): the next batch is read before the step that
trains on it, so that its ids can go to their owners during the step before (TorchRec's
pipelined input distribution).

The ops the ids are computed from, back to the input pipeline, split in two:

- the *sources*: the stateful ops among them (the iterator's `IteratorGetNext`, a
  candidate sampler, a random op), each of which must run once a batch;
- the *pure* part: the stateless ops between the sources and the ids.

Each source output gets two variables: `next` (written by `fetch_next`, a run of the
sources alone, before the step) and `current` (what the step trains on). Everything the
step computes from the sources reads `current`: the pure part is copied onto its reads,
and every other consumer of a source or pure tensor is rewired to the copy. The sources
themselves keep the originals (a sampler reads the labels of its own batch), and only
`fetch_next` runs them. `next_of(t)` is a tensor as the next batch gives it (the pure
part copied onto the `next` reads), and `advance(after)` moves `next` into `current`
once the step's reads of `current` are done.

So every batch passes through the sources once, in order, as in the user's graph: the
same batches, the same random draws. The runner drives the protocol (prime, fetch the
next batch, the step with the advance; the last batch without one:
`tfpar.runtime.runner`).
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Set

import tensorflow as tf

from tfpar.errors import NotYetSupportedError
from tfpar.graph.row_reads import upstream as graph_upstream
from tfpar.transform import surgery

SCOPE = "tfpar/input_ahead"
# Ops whose value is state the step must not read a step ahead: a fed value, a variable.
_NOT_INPUT = ("Placeholder", "PlaceholderV2", "PlaceholderWithDefault", "VariableV2",
              "VarHandleOp", "ReadVariableOp", "ResourceGather", "Variable")


class InputAhead:
    """The staging of the input that `ids` are computed from (module doc)."""

    def __init__(self, graph: tf.Graph, ids: Iterable[tf.Tensor], what: str):
        self.g = graph
        ids = list(ids)
        upstream = graph_upstream(t.op for t in ids)
        for op in upstream:
            if op.type in _NOT_INPUT:
                raise NotYetSupportedError(
                    f"the ids of {what} are computed from {op.name!r} ({op.type}): "
                    "Config(ids_ahead=True) reads the next batch a step ahead, so its ids "
                    "must come from the input pipeline (tf.data) alone, not from a fed "
                    "value or a variable; leave ids_ahead False")
        self.sources = sorted((op for op in upstream if _is_source(op)), key=lambda o: o.name)
        source_set = set(self.sources)
        # The pure part: stateless ops upstream of the ids that depend on a source.
        depends: Dict[tf.Operation, bool] = {}

        def on_source(op):
            if op not in depends:
                depends[op] = False  # (a cycle cannot occur in a graph)
                depends[op] = any(t.op in source_set or (t.op in upstream and on_source(t.op))
                                  for t in op.inputs)
            return depends[op]
        self.pure = [op for op in upstream if op not in source_set and on_source(op)]
        self._staged: Set[tf.Operation] = set(self.sources) | set(self.pure)
        self.current_vars, self.next_vars, self._reads = {}, {}, []
        with graph.as_default(), tf.compat.v1.name_scope(None), \
                tf.control_dependencies(None):
            current_reads, next_reads = {}, {}
            assigns = []
            for op in self.sources:
                for t in op.outputs:
                    name = f"{SCOPE}/{op.name}_{t.value_index}"
                    cur, nxt = _staging(t, f"{name}/current"), _staging(t, f"{name}/next")
                    self.current_vars[t], self.next_vars[t] = cur, nxt
                    current_reads[t] = _read(cur, t, f"{name}/read_current")
                    next_reads[t] = _read(nxt, t, f"{name}/read_next")
                    assigns.append(nxt.assign(t, read_value=False))
            self.fetch_next = tf.group(*assigns, name=f"{SCOPE}/fetch_next")
            self._fetch_assigns = set(assigns)
            self._copies: Dict[str, Dict[tf.Operation, tf.Operation]] = {}
            self._current = self._copy(current_reads, f"{SCOPE}/current/")
            self._next = self._copy(next_reads, f"{SCOPE}/next/")
        self._reads = [r.op for r in current_reads.values()]
        self._next_reads = next_reads
        self._carried: Dict[str, list] = {}  # name: [variable, the next batch's value]
        self.advance = self.prime = None  # (built by `finish`)
        self._rewire()

    def _copy(self, reads: Dict[tf.Tensor, tf.Tensor], scope: str) -> Dict[tf.Tensor, tf.Tensor]:
        """{source or pure tensor: the same tensor computed from `reads`}; the pure ops'
        copies are kept in `_copies[scope]` (an op without outputs too: an assertion)."""
        copies = surgery.clone_ops(self.pure, reads, scope, lambda op, ins: op.device,
                                   keep_control=lambda c: c not in self._staged)
        self._copies[scope] = copies
        out = dict(reads)
        for old, new in copies.items():
            out.update(zip(old.outputs, new.outputs))
        return out

    def _rewire(self):
        """Every consumer of a source or pure tensor outside the staged ops and their copies
        reads the copy on `current` instead."""
        copies = {t.op for t in self._current.values()} | {t.op for t in self._next.values()}
        keep = self._staged | copies | self._fetch_assigns
        for old, new in self._current.items():
            surgery.replace_uses(old, new, keep=keep)
        for op in self.g.get_operations():
            if op not in keep:
                for dep in [c for c in op.control_inputs if c in self._staged]:
                    surgery.replace_control_inputs(op, [dep], self._current_op(dep))

    def _current_op(self, op: tf.Operation) -> tf.Operation:
        """What a wait for staged op `op` waits for in the step: its copy on `current` (a
        source: the read of its staged value)."""
        copies = self._copies[f"{SCOPE}/current/"]
        if op in copies:
            return copies[op]
        return next(self._current[t].op for t in op.outputs)

    def current(self, t: tf.Tensor) -> tf.Tensor:
        """`t` as the step computes it (from the batch it trains on)."""
        return self._current.get(t, t)

    def next_of(self, t: tf.Tensor) -> tf.Tensor:
        """`t` as the next batch gives it."""
        return self._next.get(t, t)

    @property
    def replaced(self) -> Dict[str, tf.Tensor]:
        """{name of a source or pure tensor of the user's graph: its copy on `current`}: a
        fetch of the batch is the batch the step trains on."""
        return {old.name: new for old, new in self._current.items()}

    def carry(self, dtype: tf.DType, shape, name: str) -> tf.Tensor:
        """A value computed from the next batch during the step (the ids that came to this
        worker), kept for the step that trains on that batch: returns its read there;
        `carry_next` gives the value."""
        like = tf.TensorSpec(shape, dtype)
        with self.g.as_default(), tf.compat.v1.name_scope(None), \
                tf.control_dependencies(None):
            var = _staging(like, f"{SCOPE}/carried/{name}")
            read = _read(var, like, f"{SCOPE}/carried/{name}/read")
        self._carried[name] = [var, None, None]
        self._reads.append(read.op)
        return read

    def carry_next(self, name: str, value: tf.Tensor, first: tf.Tensor) -> None:
        """The next batch's value of `carry(..., name)`: `value` in a step (`advance`),
        `first` before the first step (`prime`: it may not read the staged batch, which
        is empty then)."""
        self._carried[name][1:] = [value, first]

    def finish(self) -> None:
        """Builds `advance`: `current` := `next` and every carried value's assignment, once
        the step's reads of them ran, what each step runs beside the user's fetches; and
        `prime`, the same before the first step (or after a restore), alone. Called once
        every value is carried."""
        with self.g.as_default(), tf.compat.v1.name_scope(None):
            for name, k in (("advance", 1), ("prime", 2)):
                with tf.control_dependencies(list(self._reads) if k == 1 else None):
                    moves = [self.current_vars[t].assign(self._next_reads[t], read_value=False)
                             for t in self.current_vars]
                    moves += [c[0].assign(c[k], read_value=False)
                              for c in self._carried.values()]
                    setattr(self, name, tf.group(*moves, name=f"{SCOPE}/{name}"))

    @property
    def reads(self) -> List[tf.Operation]:
        """The step's reads of `current`: a run that reaches one trains on the batch."""
        return list(self._reads)

    def check(self):
        """Raises if an op other than the staging reads a source or pure tensor (a rewrite
        that took a tensor of the batch by name after the rewiring: it would run the
        input pipeline a second time in the step)."""
        keep = self._staged | self._fetch_assigns
        for op in self._staged:
            for t in op.outputs:
                for c in t.consumers():
                    if c not in keep and not c.name.startswith(SCOPE + "/next/"):
                        raise NotYetSupportedError(
                            f"Config(ids_ahead=True): {c.name!r} ({c.type}) reads the input "
                            f"tensor {t.name!r} directly; it must read the staged batch. "
                            "Put every sparse variable on route 'sharded', or leave ids_ahead "
                            "False")


def _is_source(op: tf.Operation) -> bool:
    """A stateful op that yields a batch's values (not a handle: an iterator, a table)."""
    return (op.op_def.is_stateful and bool(op.outputs)
            and not any(t.dtype in (tf.resource, tf.variant) for t in op.outputs))


def _staging(t, name: str, initial=None) -> tf.Variable:
    """A variable of `t`'s dtype and any shape (a batch's size may vary), outside every
    collection the checkpoints and the broadcast read; initially `initial`, else empty.
    t: a tensor or a TensorSpec."""
    rank = t.shape.rank
    if initial is None:
        initial = tf.zeros([0] * (rank if rank else 1), t.dtype)
        if rank == 0:
            initial = tf.zeros([], t.dtype)
    return tf.compat.v1.Variable(initial, name=name, trainable=False, use_resource=True,
                                 validate_shape=False, shape=tf.TensorShape(None),
                                 collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])


def _read(var: tf.Variable, like, name: str) -> tf.Tensor:
    out = tf.raw_ops.ReadVariableOp(resource=var.handle, dtype=like.dtype, name=name)
    out.set_shape(like.shape)
    return out
