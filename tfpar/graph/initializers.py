"""A variable's initialiser and initial value, as its `tf.Variable` holds them.

TensorFlow names a variable's initialiser `<variable>/Assign`, but
`tf.compat.v1.train.init_from_checkpoint` (a fine-tuning script's warm start) gives the
variable another one, a restore from the checkpoint, and leaves that op unused. So the
variable's own record in the graph's collections (kept by a MetaGraphDef) says which."""
from __future__ import annotations

from typing import Optional

import tensorflow as tf

_KEYS = (tf.compat.v1.GraphKeys.GLOBAL_VARIABLES, tf.compat.v1.GraphKeys.LOCAL_VARIABLES)


def _variable(var_op: tf.Operation):
    for key in _KEYS:
        for v in var_op.graph.get_collection(key):
            if getattr(v, "op", None) is var_op:
                return v
    return None


def default_initializer(var_op: tf.Operation) -> Optional[tf.Operation]:
    """TensorFlow's `<variable>/Assign` of `var_op` (None: none)."""
    try:
        op = var_op.graph.get_operation_by_name(var_op.name + "/Assign")
    except KeyError:
        return None
    return op if op.type in ("Assign", "AssignVariableOp") else None


def initializer(var_op: tf.Operation) -> Optional[tf.Operation]:
    """The op that initialises the variable `var_op` (None: none found)."""
    v = _variable(var_op)
    op = getattr(v, "initializer", None) if v is not None else None
    return op if isinstance(op, tf.Operation) else default_initializer(var_op)


def initial_value(var_op: tf.Operation) -> Optional[tf.Tensor]:
    """The value the variable `var_op` is initialised with (None: none found)."""
    v = _variable(var_op)
    try:
        value = v.initial_value if v is not None else None
    except (AttributeError, ValueError):
        value = None
    if isinstance(value, tf.Tensor) and value.graph is var_op.graph:
        return value
    assign = default_initializer(var_op)
    return assign.inputs[1] if assign is not None else None


def is_initializer(op: tf.Operation) -> bool:
    """Whether `op` initialises the variable it writes (TF's `<variable>/Assign`, or the
    initialiser its tf.Variable names)."""
    if not op.inputs or op.inputs[0].op.type not in ("VarHandleOp", "VariableV2"):
        return False
    var_op = op.inputs[0].op
    return op.name == var_op.name + "/Assign" or op is initializer(var_op)
