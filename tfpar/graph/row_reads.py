"""The reads of a variable besides its updates, sorted by what route "sharded" can split.

A sharded variable exists only as row ranges on the workers, so the training step may
read it by row lookups (gathers on axis 0) and shape reads only; any other read (a whole
read in the step, or a read after the step that writes another variable with it: an
`ExponentialMovingAverage`) needs the whole variable. Both the planner (whether density
routing may choose "sharded", through `VariableInfo.other_reads`) and the sharded rewrite
(which replaces the lookups and refuses the rest) sort the reads here, so they agree.
A moving average of the variable (`ExponentialMovingAverage.apply`: after the step, the
shadow less `(shadow - variable) * (1 - decay)`) is row by row, so a shadow split alike
updates its rows from the worker's own: such reads are `averages`, not `others`.
It never edits the graph.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, List, Optional, Set, Tuple

import tensorflow as tf

from tfpar.graph import initializers

GATHERS = ("ResourceGather", "GatherV2", "Gather")
# Ops that read rows `indices` (input 1) of their data (input 0) and sum them by segment:
# embedding_lookup_sparse's fast path (feature columns' linear_model with TF1 variables).
SEGMENT_READS = ("SparseSegmentSum", "SparseSegmentMean", "SparseSegmentSqrtN",
                 "SparseSegmentSumWithNumSegments", "SparseSegmentMeanWithNumSegments",
                 "SparseSegmentSqrtNWithNumSegments")
# Uses of the variable that the training step does not run, or whose value a rewrite gives.
IGNORED = ("VarIsInitializedOp", "DestroyResourceOp", "IsVariableInitialized",
           "DisableCopyOnRead")
ASSIGNS = ("Assign", "AssignSub", "AssignAdd", "AssignVariableOp", "AssignSubVariableOp",
            "AssignAddVariableOp")
SAVES = ("SaveV2", "Save", "SaveSlices", "MergeV2Checkpoints")
_VARIABLES = ("VarHandleOp", "VariableV2")
# Row-wise arithmetic a moving average's update may do (with scalars).
_ELEMENTWISE = ("Sub", "Mul", "Add", "AddV2", "Neg", "Identity", "Cast", "ReadVariableOp",
                "RealDiv")


@dataclasses.dataclass
class RowReads:
    """lookups: reads of rows in the training step (gathers on axis 0, and sparse segment
    reductions of a read, `SEGMENT_READS`); shapes: shape reads there
    (VariableShape of the handle, Shape of a read); others: (op, where) of every other
    read that needs the whole variable, where "in the training step" or "after the
    training step"; averages: the moving averages of it, each (the op that writes the
    shadow, the shadow variable op, the ops from the reads to that write)."""

    lookups: List[tf.Operation]
    shapes: List[tf.Operation]
    others: List[Tuple[tf.Operation, str]]
    averages: List[Tuple[tf.Operation, tf.Operation, List[tf.Operation]]] = \
        dataclasses.field(default_factory=list)


def is_restore(assign: tf.Operation) -> bool:
    """Whether `assign` is a Saver's restore (its value read from a checkpoint): those run
    through `Runner.restore` (see runner._SessionView), which knows where each variable
    lives."""
    t = assign.inputs[1]
    while t.op.type == "Identity":
        t = t.op.inputs[0]
    return t.op.type in ("RestoreV2", "Restore", "RestoreSlice")


def upstream(roots: Iterable[tf.Operation]) -> Set[tf.Operation]:
    """`roots` and every op they read from or wait for (data and control inputs)."""
    seen, stack = set(), list(roots)
    while stack:
        op = stack.pop()
        if op not in seen:
            seen.add(op)
            stack.extend([t.op for t in op.inputs] + list(op.control_inputs))
    return seen


def training_ops(roots: Iterable[tf.Operation]) -> Set[tf.Operation]:
    """The ops a training step runs: everything the update ops `roots` depend on."""
    return upstream(roots)


def row_reads(var_op: tf.Operation, updates: Set[tf.Operation],
              training: Set[tf.Operation]) -> RowReads:
    """Sorts the reads of `var_op` (a variable) other than its own `updates` (module doc).
    training: `training_ops` of the step. A read outside the step is ignored (an
    initialiser, a Saver) unless it writes another variable after the step."""
    out = RowReads([], [], [])
    handle = var_op.outputs[0]
    # By name: the rewrite names and orders its exchanges by these lists, the same on every
    # worker, and TensorFlow lists an output's consumers in no fixed order.
    for c in _by_name(handle.consumers()):
        if c in updates or c.type in IGNORED:
            continue
        if c not in training:
            _after_step(c, var_op, out)
        elif c.type == "ResourceGather" and c.inputs[0] is handle:
            out.lookups.append(c)
        elif c.type == "VariableShape":
            out.shapes.append(c)
        elif c.type in ("Identity", "RefIdentity", "ReadVariableOp"):
            for x in _by_name(c.outputs[0].consumers()):
                if x in updates:
                    continue
                if x not in training:
                    _after_step(x, var_op, out, c)
                elif x.type in GATHERS + SEGMENT_READS and x.inputs[0] is c.outputs[0] \
                        and _axis_zero(x):
                    out.lookups.append(x)
                elif x.type == "Shape":
                    out.shapes.append(x)
                else:
                    out.others.append((x, "in the training step"))
        else:
            out.others.append((c, "in the training step"))
    return out


def _by_name(ops: Iterable[tf.Operation]) -> List[tf.Operation]:
    return sorted(ops, key=lambda op: op.name)


def _after_step(op: tf.Operation, var_op: tf.Operation, out: RowReads,
                read: Optional[tf.Operation] = None) -> None:
    """`op` reads the variable (or `read`'s output, the variable's read) after the step."""
    writer = _writes_another(op, var_op)
    if writer is None or initializers.is_initializer(writer):
        return  # none, or another variable's initialiser (a shadow's: initialized_value)
    average = _moving_average(op, writer, var_op, read)
    if average is None:
        out.others.append((writer, "after the training step"))
    elif all(w is not writer for w, _, _ in out.averages):
        out.averages.append((writer, writer.inputs[0].op, average))


def _moving_average(start: tf.Operation, writer: tf.Operation, var_op: tf.Operation,
                    read: Optional[tf.Operation]) -> Optional[List[tf.Operation]]:
    """The ops from `start` (which reads `var_op`, or `read`'s output) and from the
    shadow's reads to `writer` when `writer` subtracts from a variable shaped as `var_op`
    a row-wise function of the two and of scalars (a moving average's update); None
    otherwise."""
    shadow = writer.inputs[0].op
    if writer.type not in ("AssignSub", "AssignSubVariableOp") or shadow.type not in _VARIABLES \
            or shadow.get_attr("shape") != var_op.get_attr("shape"):
        return None
    up = _ancestors(writer)
    ops = [x for x in up if x is start or _reaches(x, start, shadow, up)]
    if start not in ops:
        return None
    for x in ops:
        if x.type not in _ELEMENTWISE:
            return None
        for t in x.inputs:
            if t.op not in ops and t.op not in (var_op, shadow, read) and \
                    t.shape.num_elements() != 1:
                return None  # a tensor other than the two and scalars
    return sorted(ops, key=lambda o: o.name) + [writer]


def _ancestors(op: tf.Operation) -> Set[tf.Operation]:
    """The ops `op` reads from (its data inputs, transitively), variables excluded."""
    seen, stack = set(), [t.op for t in op.inputs]
    while stack:
        x = stack.pop()
        if x in seen or x.type in _VARIABLES or len(seen) > 200:
            continue
        seen.add(x)
        stack.extend(t.op for t in x.inputs)
    return seen


def _reaches(op: tf.Operation, start: tf.Operation, shadow: tf.Operation, up) -> bool:
    """Whether `op` computes from `start` or reads `shadow`, within `up`."""
    seen, stack = set(), [op]
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        if x is start or any(t.op is shadow for t in x.inputs):
            return True
        stack.extend(t.op for t in x.inputs if t.op in up)
    return False


def _writes_another(op: tf.Operation, var_op: tf.Operation) -> Optional[tf.Operation]:
    """An op that writes a variable other than `var_op` with what `op` computes (a moving
    average's update), found among `op`'s consumers; None if there is none."""
    seen, stack = set(), [op]
    while stack:
        x = stack.pop()
        if x in seen or len(seen) > 200:
            continue
        seen.add(x)
        if x.type in ASSIGNS and x is not op and x.inputs[0].op is not var_op:
            return x
        if x.type in SAVES:
            continue  # a Saver's save reads it: the runner saves the variable itself
        stack.extend(c for t in x.outputs for c in t.consumers())
    return None


def _axis_zero(gather: tf.Operation) -> bool:
    if gather.type != "GatherV2":
        return True
    axis = tf.get_static_value(gather.inputs[2])
    return axis is not None and int(axis) == 0 and gather.get_attr("batch_dims") == 0
