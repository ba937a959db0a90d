"""The reads of a variable besides its updates, sorted by what route "sharded" can split.

A sharded variable exists only as row ranges on the workers, so the training step may
read it by row lookups (gathers on axis 0) and shape reads only; any other read (a whole
read in the step, or a read after the step that writes another variable with it: an
`ExponentialMovingAverage`) needs the whole variable. Both the planner (whether density
routing may choose "sharded", through `VariableInfo.other_reads`) and the sharded rewrite
(which replaces the lookups and refuses the rest) sort the reads here, so they agree.
It never edits the graph.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, List, Optional, Set, Tuple

import tensorflow as tf

GATHERS = ("ResourceGather", "GatherV2", "Gather")
# Ops that read rows `indices` (input 1) of their data (input 0) and sum them by segment:
# embedding_lookup_sparse's fast path (feature columns' linear_model with TF1 variables).
SEGMENT_READS = ("SparseSegmentSum", "SparseSegmentMean", "SparseSegmentSqrtN",
                 "SparseSegmentSumWithNumSegments", "SparseSegmentMeanWithNumSegments",
                 "SparseSegmentSqrtNWithNumSegments")
# Uses of the variable that the training step does not run, or whose value a rewrite gives.
IGNORED = ("VarIsInitializedOp", "DestroyResourceOp", "IsVariableInitialized",
           "DisableCopyOnRead")
_ASSIGNS = ("Assign", "AssignSub", "AssignAdd", "AssignVariableOp", "AssignSubVariableOp",
            "AssignAddVariableOp")
_SAVES = ("SaveV2", "Save", "SaveSlices", "MergeV2Checkpoints")


@dataclasses.dataclass
class RowReads:
    """lookups: reads of rows in the training step (gathers on axis 0, and sparse segment
    reductions of a read, `SEGMENT_READS`); shapes: shape reads there
    (VariableShape of the handle, Shape of a read); others: (op, where) of every other
    read that needs the whole variable, where "in the training step" or "after the
    training step"."""

    lookups: List[tf.Operation]
    shapes: List[tf.Operation]
    others: List[Tuple[tf.Operation, str]]


def training_ops(roots: Iterable[tf.Operation]) -> Set[tf.Operation]:
    """The ops a training step runs: everything the update ops `roots` depend on."""
    seen, stack = set(), list(roots)
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        stack.extend([t.op for t in op.inputs] + list(op.control_inputs))
    return seen


def row_reads(var_op: tf.Operation, updates: Set[tf.Operation],
              training: Set[tf.Operation]) -> RowReads:
    """Sorts the reads of `var_op` (a variable) other than its own `updates` (module doc).
    training: `training_ops` of the step. A read outside the step is ignored (an
    initialiser, a Saver) unless it writes another variable after the step."""
    out = RowReads([], [], [])
    handle = var_op.outputs[0]
    for c in list(handle.consumers()):
        if c in updates or c.type in IGNORED:
            continue
        if c not in training:
            _after_step(c, var_op, out)
        elif c.type == "ResourceGather" and c.inputs[0] is handle:
            out.lookups.append(c)
        elif c.type == "VariableShape":
            out.shapes.append(c)
        elif c.type in ("Identity", "RefIdentity", "ReadVariableOp"):
            for x in list(c.outputs[0].consumers()):
                if x in updates:
                    continue
                if x not in training:
                    _after_step(x, var_op, out)
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


def _after_step(op: tf.Operation, var_op: tf.Operation, out: RowReads) -> None:
    writer = _writes_another(op, var_op)
    if writer is not None:
        out.others.append((writer, "after the training step"))


def _writes_another(op: tf.Operation, var_op: tf.Operation) -> Optional[tf.Operation]:
    """An op that writes a variable other than `var_op` with what `op` computes (a moving
    average's update), found among `op`'s consumers; None if there is none."""
    seen, stack = set(), [op]
    while stack:
        x = stack.pop()
        if x in seen or len(seen) > 200:
            continue
        seen.add(x)
        if x.type in _ASSIGNS and x is not op and x.inputs[0].op is not var_op:
            return x
        if x.type in _SAVES:
            continue  # a Saver's save reads it: the runner saves the variable itself
        stack.extend(c for t in x.outputs for c in t.consumers())
    return None


def _axis_zero(gather: tf.Operation) -> bool:
    if gather.type != "GatherV2":
        return True
    axis = tf.get_static_value(gather.inputs[2])
    return axis is not None and int(axis) == 0 and gather.get_attr("batch_dims") == 0
