"""Batch normalization over the global batch, so that data parallelism stays exact.

On one device a batch-norm layer in training mode normalises by the mean and variance of
the whole batch, and its moving averages follow those. A worker holding 1/N of the rows
would use its own rows' statistics: a different model and gradient, and moving averages
that differ per worker (Horovod leaves it so, unless the script uses its
SyncBatchNormalization). tfpar rewrites each batch norm the plan lists (`Plan.batch_norms`)
to use every worker's rows: the sum of the rows and their count in one Horovod allreduce,
the sum of squared deviations from that mean in a second; the layer's output and its
moving averages come from those.

- A training-mode `FusedBatchNorm` (what `tf.compat.v1.layers.batch_normalization` makes
  for 4-D inputs) is replaced by those ops, and its backward is theirs (through the
  allreduces, whose gradient is the allreduce of the gradient).
- `tf.nn.moments` over the batch (a non-fused batch norm, e.g. for 2-D inputs) keeps the
  user's ops and their backward: its two means become global means, and the gradient
  arriving at each mean's backward is summed over the workers and scaled by local rows /
  global rows, so that the user's own backward (broadcast, divided by the local rows)
  yields the global mean's adjoint.

Why the gradient is summed: worker w's loss reads every worker's rows through the global
statistics, so the gradient of its rows is what all workers' losses send back through the
statistics; the data-parallel average of the variables' gradients then equals single-device
training's. It runs after the other transforms: whatever read the user's outputs and
gradients, theirs included, reads the new ones.
"""
from __future__ import annotations

import re
from typing import Dict, List, Tuple

import numpy as np
import tensorflow as tf

from tfpar.graph.analysis import CONDS, DEFAULT_GRADIENT_SCOPE, cond_batch_norms, moments_variance

from tfpar.errors import NotYetSupportedError
from tfpar.plan import Plan
from tfpar.transform import surgery
from tfpar.transform.allreduce import allreduce
from tfpar.graph.naming import safe_name

_GRADS = ("FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3")


def apply_sync_batch_norm(graph: tf.Graph, plan: Plan, traffic=None) -> None:
    """Makes every batch norm of `plan.batch_norms` use the statistics of all workers' rows."""
    with graph.as_default():
        for name in plan.batch_norms:
            op = graph.get_operation_by_name(name)
            if op.type == "Mean":
                _synchronise_moments(op, plan.num_workers, traffic)
            elif op.type in CONDS:
                _synchronise_cond(op, plan.num_workers, traffic)
            else:
                _synchronise(op, plan.num_workers, traffic)


def _synchronise(op: tf.Operation, n: int, traffic) -> None:
    """A fused batch norm in the graph itself -> the same over every worker's rows."""
    x, scale, offset, mean_in, var_in = op.inputs[:5]
    factor = op.get_attr("exponential_avg_factor") if op.type == "FusedBatchNormV3" else 1.0
    scope = f"tfpar/sync_batch_norm/{safe_name(op.name)}"
    with tf.device(op.device):
        y, mean_out, var_out = _global_batch_norm(
            x, scale, offset, mean_in, var_in, op.get_attr("epsilon"),
            op.get_attr("data_format").decode(), factor, n, traffic, scope)
    grads = [c for c in op.outputs[3].consumers() if c.type in _GRADS]
    surgery.replace_uses(op.outputs[0], y)
    surgery.replace_uses(op.outputs[1], mean_out)
    surgery.replace_uses(op.outputs[2], var_out)
    for grad in grads:
        dy = grad.inputs[0]
        with tf.compat.v1.name_scope(scope + "/backward/"), tf.device(grad.device):
            new = tf.gradients(y, [x, scale, offset], grad_ys=dy)
        for old, g in zip(grad.outputs[:3], new):
            if g is None:
                g = tf.zeros_like(old)
            surgery.replace_uses(old, g)


def _synchronise_cond(op: tf.Operation, n: int, traffic) -> None:
    """A TF2 `tf.cond` whose training branch is a fused batch norm (Keras's
    `training=<a tensor>`): where the predicate picks that branch, its y, batch mean and
    variance, and the gradients the cond's backward gives its x, scale and offset, come
    from the batch norm over every worker's rows. The cond still runs (its other branch
    is inference), and the global statistics are computed on every step whichever branch
    is taken, so every worker runs each step that reads the layer."""
    found = {c.cond: c for c in cond_batch_norms(op.graph)}.get(op.name)
    if found is None:
        raise NotYetSupportedError(f"batch norm {op.name!r}: not a tf.cond as Keras builds it")
    scope = f"tfpar/sync_batch_norm/{safe_name(op.name)}"
    pred = op.inputs[0]

    def chosen(synchronised, original):  # where the predicate picks the training branch
        if found.in_then_branch:
            return tf.where(pred, synchronised, original)
        return tf.where(pred, original, synchronised)

    with tf.compat.v1.name_scope(scope + "/"), tf.device(op.device):
        values = []
        for k, (index, read) in enumerate(found.inputs):
            t = op.inputs[index]
            if read:  # where the variable is (a parameter server's, in PS mode)
                with tf.device(t.op.device):
                    t = tf.raw_ops.ReadVariableOp(
                        resource=t, dtype=op.outputs[0].dtype if k == 0 else tf.float32)
            values.append(t)
    with tf.device(op.device):
        outputs = _global_batch_norm(*values, found.epsilon, found.data_format,
                                     found.exponential_avg_factor, n, traffic, scope)
    backward = [c for t in op.outputs for c in t.consumers() if c.type in CONDS]
    with tf.compat.v1.name_scope(scope + "/"), tf.device(op.device):
        for k, new in enumerate(outputs):
            old = op.outputs[k]
            picked = chosen(new, old)
            surgery.replace_uses(old, picked, keep=[picked.op])
    for grad in dict.fromkeys(backward):
        if len(grad.outputs) != len(op.inputs) - 1:
            raise NotYetSupportedError(f"batch norm {op.name!r}: its backward {grad.name!r} "
                                       "does not give one gradient per input")
        dy = grad.inputs[1]  # after the predicate: the gradient of the cond's output 0, y
        with tf.compat.v1.name_scope(scope + "/backward/"), tf.device(grad.device):
            new = tf.gradients(outputs[0], values[:3], grad_ys=dy)
            for (index, _), g in zip(found.inputs[:3], new):
                old = grad.outputs[index - 1]
                picked = chosen(tf.zeros_like(old) if g is None else g, old)
                surgery.replace_uses(old, picked, keep=[picked.op])


def _global_batch_norm(x, scale, offset, mean_in, var_in, epsilon: float, data_format: str,
                       factor: float, n: int, traffic, scope: str):
    """What a fused batch norm in training mode returns (y, batch mean, batch variance for
    the moving averages), over every worker's rows."""
    channels_first = data_format in ("NCHW", "NCDHW")
    rank = x.shape.rank
    if rank is None:
        raise NotYetSupportedError(f"batch norm {scope!r}: its input's rank is unknown")
    axes = [0] + list(range(2, rank)) if channels_first else list(range(rank - 1))
    channel_axis = 1 if channels_first else rank - 1
    name = scope.rsplit("/", 1)[-1]
    with tf.compat.v1.name_scope(scope + "/"):
        xf = tf.cast(x, tf.float32)  # as the fused op computes (float16 inputs too)
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(xf), axes)), tf.float32)
        local = tf.concat([tf.reduce_sum(xf, axes), tf.reshape(count, [1])], 0)
        total = allreduce(local, False, n, traffic, name=f"{name}_sum")
        rows = total[-1]
        mean = total[:-1] / rows
        shape = [1] * rank
        shape[channel_axis] = -1
        centered = xf - tf.reshape(mean, shape)
        squares = allreduce(tf.reduce_sum(tf.square(centered), axes), False, n, traffic,
                            name=f"{name}_squares")
        variance = squares / rows
        factor_of = tf.math.rsqrt(variance + epsilon) * scale
        y = tf.cast(centered * tf.reshape(factor_of, shape) + tf.reshape(offset, shape),
                    x.dtype)
        # What the fused op returns for the moving averages: the variance with Bessel's
        # correction, both averaged into the inputs when it keeps the averages itself.
        unbiased = variance * rows / tf.maximum(rows - 1.0, 1.0)
        if factor != 1.0:
            return (y, (1.0 - factor) * mean_in + factor * mean,
                    (1.0 - factor) * var_in + factor * unbiased)
        return y, mean, unbiased


def _synchronise_moments(mean_op: tf.Operation, n: int, traffic) -> None:
    """`tf.nn.moments(x, axes)` over the batch -> the moments of every worker's rows."""
    variance_op = moments_variance(mean_op)
    if variance_op is None:
        raise NotYetSupportedError(f"batch norm {mean_op.name!r}: not built as tf.nn.moments")
    # Found before the rewiring below, which changes what the forward tensors are.
    incoming = {op: _incoming_gradients(op) for op in (mean_op, variance_op)}
    x = mean_op.inputs[0]
    axes = sorted(int(a) % x.shape.rank
                  for a in np.ravel(tf.get_static_value(mean_op.inputs[1])))
    keep_dims = mean_op.get_attr("keep_dims")
    name = safe_name(mean_op.name)
    with tf.compat.v1.name_scope(f"tfpar/sync_batch_norm/{name}/"), \
            tf.device(mean_op.device):
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype)
        local = tf.reduce_sum(x, axes, keepdims=keep_dims)
        total = allreduce(tf.concat([tf.reshape(local, [-1]), tf.reshape(count, [1])], 0),
                          False, n, traffic, name=f"{name}_sum")
        rows = total[-1]
        mean = tf.reshape(total[:-1], tf.shape(local)) / rows
    surgery.replace_uses(mean_op.outputs[0], mean)  # the variance's deviations included
    with tf.compat.v1.name_scope(f"tfpar/sync_batch_norm/{name}/"), \
            tf.device(variance_op.device):
        squares = allreduce(tf.reduce_sum(variance_op.inputs[0], axes, keepdims=keep_dims),
                            False, n, traffic, name=f"{name}_squares")
        variance = squares / rows
    surgery.replace_uses(variance_op.outputs[0], variance)
    for op, gradients in incoming.items():
        for i, (gradient, readers) in enumerate(gradients):
            with tf.compat.v1.name_scope(f"tfpar/sync_batch_norm/{name}/backward/"), \
                    tf.device(op.device):
                summed = allreduce(gradient, False, n, traffic,
                                   name=f"{safe_name(op.name)}_grad_{i}")
                scaled = summed * tf.cast(count / rows, summed.dtype)
            for reader, index in readers:
                surgery.replace_input(reader, index, scaled)


def _incoming_gradients(op: tf.Operation) -> List[Tuple[tf.Tensor, List[Tuple[tf.Operation,
                                                                               int]]]]:
    """For each backward of `op` (one per gradients call that went through it): the gradient
    arriving at it and the (op, input index) pairs that read it there."""
    pattern = re.compile(DEFAULT_GRADIENT_SCOPE + re.escape(op.name) + "_grad/")
    scopes: Dict[str, List[tf.Operation]] = {}
    for candidate in op.graph.get_operations():
        match = pattern.search(candidate.name)
        if match:
            scopes.setdefault(candidate.name[:match.end()], []).append(candidate)
    forward = {*op.inputs, *op.outputs}
    found = []
    for scope, members in sorted(scopes.items()):
        inside = set(members)
        readers: Dict[tf.Tensor, List[Tuple[tf.Operation, int]]] = {}
        for member in members:
            for index, t in enumerate(member.inputs):
                if t.op not in inside and t not in forward:
                    readers.setdefault(t, []).append((member, index))
        if len(readers) != 1:
            raise NotYetSupportedError(
                f"batch norm {op.name!r}: its backward {scope!r} reads "
                f"{sorted(t.name for t in readers) or 'no'} gradient(s), one expected; "
                "build it with tf.nn.moments and tf.gradients (an optimizer's minimize)")
        [(gradient, uses)] = readers.items()
        found.append((gradient, uses))
    return found
