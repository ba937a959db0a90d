"""Ops a script adds to its graph after `tfpar.get_runner`, copied into the job's graph.

A plain session runs ops built after it was made, and TF1 scripts rely on it:
`sess.run(tf.compat.v1.global_variables_initializer())` inside `with Session() as sess:`,
a `Saver` or a metric built after the session, an evaluation op, a summary. The runner
executes a rewritten copy of the graph as it was at `get_runner`, so such an op is copied
into it on its first use, with every op it needs that is also new:

- inputs from the graph as it was are the job graph's tensors and ops of the same names,
  or what the rewrite made of them (a parameter-server variable's read, say);
- a read of a variable the job does not hold whole (route "ps": parts on the servers;
  "sharded" or "tiled": rows or tiles on the workers) reads its whole value, as a fetch
  of the variable does, after what the read waits for: a `ReadVariableOp`, a lookup
  (`ResourceGather`), a shape, a reference variable's value (a later Saver's `SaveV2`);
- an `assign` of such a variable's whole value (a pretrained table loaded late, a
  `tf.train.Checkpoint`'s restore) writes its parts on the servers, or each worker's
  tile once the workers' values are checked to be the same;
- what tfpar cannot redo late is refused before anything runs, naming the op and the
  fix: an optimizer update (it would train outside the job's collectives), any other
  write of a variable the job does not hold whole (an add, a scatter: every worker runs
  it), and TF1 control flow (its frames are not copied).

A name the job graph already holds for one of tfpar's own ops never stands for a later op
of the user's: only the names of the graph given to `get_runner` are looked up there.
"""
from __future__ import annotations

from typing import Callable, Dict, FrozenSet, List, Union

import tensorflow as tf

from tfpar.errors import NotYetSupportedError
from tfpar.graph.analysis import FUNCTIONAL, VARIABLE_OP_TYPES, WRITES
from tfpar.transform import partial_writes, surgery

Element = Union[tf.Tensor, tf.Operation]

_OPTIMIZER_UPDATES = ("Apply", "ResourceApply", "SparseApply", "ResourceSparseApply")
_V1_CONTROL_FLOW = frozenset({"Enter", "RefEnter", "Exit", "RefExit", "Switch", "RefSwitch",
                              "Merge", "RefMerge", "NextIteration", "RefNextIteration",
                              "LoopCond"})
# Reads of a variable's handle, redone on the whole value of a variable held in parts.
_READS = ("ReadVariableOp", "VariableShape", "ResourceGather", "ResourceGatherNd",
          "VarIsInitializedOp", "IsVariableInitialized")
# Writes of a whole variable, redone on its parts or tiles (an add is not: every worker
# runs it, and the parts would get each worker's).
_WHOLE_WRITES = ("Assign", "AssignVariableOp")
_ROUTES = {"ps": "lives on the parameter servers",
           "sharded": "is split over the workers by rows (route 'sharded')",
           "tiled": "is split over the workers in tiles (Config.tiling)"}


class LateOps:
    """Copies, on first use, the ops of `source` that are not in `known` (the names of
    the graph `get_runner` was given) into `target`, the job's graph.

    existing(name): the job graph's element for a known tensor or op name. moved:
    {variable name: route} of the variables the job does not hold whole. whole(name,
    after): such a variable's whole value in the job graph, read after the ops `after`.
    write(name, value, after, op name): an op writing the whole `value` to such a
    variable, after the ops `after`.
    """

    def __init__(self, source: tf.Graph, target: tf.Graph, known: FrozenSet[str],
                 existing: Callable[[str], Element], moved: Dict[str, str],
                 whole: Callable[..., tf.Tensor], write: Callable[..., tf.Operation]):
        self._source, self._target, self._known = source, target, known
        self._existing, self._moved, self._whole = existing, moved, whole
        self._write = write
        self._outputs: Dict[tf.Operation, List[tf.Tensor]] = {}  # late op -> its copy's outputs
        self._ops: Dict[tf.Operation, tf.Operation] = {}  # late op -> its copy

    def is_late(self, op: tf.Operation) -> bool:
        """Whether `op` (of the user's graph) was built after `get_runner`."""
        return op.graph is self._source and op.name not in self._known

    def op(self, op: tf.Operation) -> tf.Operation:
        """The job graph's copy of the late op `op` (made with what it needs)."""
        self._copy(op)
        return self._ops[op]

    def tensor(self, t: tf.Tensor) -> tf.Tensor:
        """The job graph's copy of the late tensor `t`."""
        self._copy(t.op)
        return self._outputs[t.op][t.value_index]

    # -- copying -------------------------------------------------------------------------
    def _copy(self, root: tf.Operation):
        if root in self._ops:
            return
        order = self._late_upstream(root)
        for op in order:
            self._check(op)
        if any(_calls_functions(op) for op in order):
            self._copy_functions()
        for op in order:
            self._copy_one(op)

    def _late_upstream(self, root: tf.Operation) -> List[tf.Operation]:
        """The late ops `root` needs that have no copy yet, inputs before consumers."""
        order, state, stack = [], {}, [(root, False)]
        while stack:
            op, done = stack.pop()
            if done:
                state[op] = "done"
                order.append(op)
                continue
            if op in state or op in self._ops:
                continue
            state[op] = "open"
            stack.append((op, True))
            for dep in [t.op for t in op.inputs] + list(op.control_inputs):
                if self.is_late(dep) and dep not in state and dep not in self._ops:
                    stack.append((dep, False))
        return order

    def _moved_inputs(self, op: tf.Operation) -> List[tuple]:
        """(index, variable name) of each input of `op` that is a variable the job does
        not hold whole."""
        return [(i, t.op.name) for i, t in enumerate(op.inputs)
                if t.op.type in VARIABLE_OP_TYPES and t.op.name in self._moved]

    def _check(self, op: tf.Operation):
        fix = ("build it before tfpar.get_runner, as every op the training step needs is "
               "(tfpar rewrites the graph it is given once)")
        if op.type.startswith(_OPTIMIZER_UPDATES):
            raise NotYetSupportedError(
                f"op {op.name!r} ({op.type}) is an optimizer update added to the graph after "
                "tfpar.get_runner: tfpar did not make it data-parallel, so each worker would "
                "train alone. Build the train op before tfpar.get_runner")
        if op.type in _V1_CONTROL_FLOW:
            raise NotYetSupportedError(
                f"op {op.name!r} ({op.type}) is TF1 control flow added to the graph after "
                f"tfpar.get_runner; tfpar cannot copy its frame into the job's graph: {fix}")
        moved = self._moved_inputs(op)
        if op.type in _READS or (op.type in _WHOLE_WRITES and [i for i, _ in moved] == [0]):
            return  # a read, or a whole value written (not itself a moved variable's)
        for index, name in moved:
            writes = (op.type in WRITES or op.type in partial_writes.TYPES
                      or _is_ref_input(op, index))
            if writes or op.type in FUNCTIONAL or op.inputs[index].dtype == tf.resource:
                what = "writes" if writes else "uses"
                raise NotYetSupportedError(
                    f"op {op.name!r} ({op.type}), added to the graph after "
                    f"tfpar.get_runner, {what} variable {name!r}, which "
                    f"{_ROUTES.get(self._moved[name], 'is not held whole here')}; tfpar "
                    f"rewrites such uses only in the graph it is given: {fix}")

    def _copy_one(self, op: tf.Operation):
        with self._target.as_default(), tf.compat.v1.name_scope(None):
            controls = [self._control(c) for c in op.control_inputs]
            moved = self._moved_inputs(op)
            if moved and op.type in _WHOLE_WRITES:  # (checked: of input 0 alone)
                value = self._input(op.inputs[1])
                done = self._write(moved[0][1], value, controls, op.name)
                self._ops[op] = done
                if op.outputs:  # a reference variable's Assign: the value written
                    with tf.control_dependencies([done]):
                        self._outputs[op] = [tf.identity(value)]
                else:
                    self._outputs[op] = []
                return
            if moved and op.type in _READS:
                outputs = [self._read_moved(op, moved[0][1], controls)]
                self._outputs[op] = outputs
                self._ops[op] = outputs[0].op
                return
            inputs = [self._input(t) for t in op.inputs]
            # A reference variable's value (a Saver's SaveV2, an identity; or its `read`,
            # which passes the buffer on): read whole after what this op and its
            # consumers wait for.
            moved += [(i, t.op.inputs[0].op.name) for i, t in enumerate(op.inputs)
                      if not self.is_late(t.op) and t.op.type == "Identity"
                      and t.op.inputs and t.op.inputs[0].op.type in ("VariableV2", "Variable")
                      and t.op.inputs[0].op.name in self._moved]
            if moved:
                after = controls + self._consumers_controls(op)
                for index, name in moved:
                    if after or op.inputs[index].op.type in VARIABLE_OP_TYPES:
                        inputs[index] = self._whole(name, after)
            new = surgery.copy_op(op, self._target, inputs, controls)
        self._outputs[op] = list(new.outputs)
        self._ops[op] = new

    def _read_moved(self, op: tf.Operation, name: str, controls) -> tf.Tensor:
        """What the read `op` of the moved variable `name` gives, from its whole value
        (read after what `op` waits for)."""
        with tf.control_dependencies(controls), tf.compat.v1.name_scope(f"tfpar/late/{name}/"):
            if op.type in ("VarIsInitializedOp", "IsVariableInitialized"):
                return tf.constant(True)  # the runner initialised it at its start
            whole = self._whole(name, controls)
            if op.type == "ReadVariableOp":
                return tf.identity(whole)
            if op.type == "VariableShape":
                return tf.shape(whole, out_type=op.get_attr("out_type"))
            if op.type == "ResourceGatherNd":
                return tf.gather_nd(whole, self._input(op.inputs[1]))
            return tf.gather(whole, self._input(op.inputs[1]),
                             batch_dims=op.get_attr("batch_dims"))

    def _consumers_controls(self, op: tf.Operation) -> List[tf.Operation]:
        """What the consumers of `op` wait for. An op that takes a reference variable
        passes the variable's buffer on, so TensorFlow reads it when a consumer runs:
        `tf.identity(v)` summed under `control_dependencies([train_op])` gives the value
        after the step. The whole value read here waits for the same ops."""
        out = []
        for consumer in (c for t in op.outputs for c in t.consumers()):
            for c in consumer.control_inputs:
                if not self.is_late(c):
                    out.append(self._control(c))
                elif c in self._ops:
                    out.append(self._ops[c])
        return out

    def _input(self, t: tf.Tensor) -> tf.Tensor:
        if self.is_late(t.op):
            return self._outputs[t.op][t.value_index]
        return self._existing(t.name)

    def _control(self, c: tf.Operation) -> tf.Operation:
        if self.is_late(c):
            return self._ops[c]
        found = self._existing(c.name)
        return found.op if isinstance(found, tf.Tensor) else found

    def _copy_functions(self):
        """Every function of the user's graph that the job graph lacks (a later tf.data
        pipeline's map, a later tf.function), copied in before the ops that call them."""
        have = {f.signature.name for f in self._target.as_graph_def().library.function}
        library = self._source.as_graph_def().library
        missing = tf.compat.v1.GraphDef()
        missing.library.function.extend(f for f in library.function
                                        if f.signature.name not in have)
        missing.library.gradient.extend(g for g in library.gradient
                                        if g.function_name not in have)
        if missing.library.function:
            with self._target.as_default():
                tf.graph_util.import_graph_def(missing, name="")


def _calls_functions(op: tf.Operation) -> bool:
    for value in op.node_def.attr.values():
        if value.HasField("func") or (value.HasField("list") and value.list.func):
            return True
    return False


def _is_ref_input(op: tf.Operation, index: int) -> bool:
    """Whether input `index` of `op` is one its kernel may write (a ref argument)."""
    position = 0
    for arg in op.op_def.input_arg:
        if arg.number_attr:
            count = op.get_attr(arg.number_attr)
        elif arg.type_list_attr:
            count = len(op.get_attr(arg.type_list_attr))
        else:
            count = 1
        if position <= index < position + count:
            return arg.is_ref
        position += count
    return False
