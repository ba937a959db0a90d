"""Batch normalization over the global batch, so that data parallelism stays exact.

On one device a batch-norm layer in training mode normalises by the mean and variance of
the whole batch, and its moving averages follow those. A worker holding 1/N of the rows
would use its own rows' statistics: a different model and gradient, and moving averages
that differ per worker (Horovod leaves it so, unless the script uses its
SyncBatchNormalization). tfpar rewrites each training-mode `FusedBatchNorm` the plan lists
(`Plan.batch_norms`, what `tf.compat.v1.layers.batch_normalization` makes for 4-D
inputs) to use every worker's rows: the sum of the rows and their count in one Horovod
allreduce, the sum of squared deviations from that mean in a second; the layer's output,
its moving averages and its backward (through the allreduces, whose gradient is the
allreduce of the gradient) come from those. It runs after the other transforms: whatever
read the user's outputs and gradients, theirs included, reads the new ones.
"""
from __future__ import annotations

import tensorflow as tf

from tfpar.errors import NotYetSupportedError
from tfpar.plan import Plan
from tfpar.transform import surgery
from tfpar.transform.allreduce import allreduce
from tfpar.transform.naming import safe_name

_GRADS = ("FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3")


def apply_sync_batch_norm(graph: tf.Graph, plan: Plan, traffic=None) -> None:
    """Makes every batch norm of `plan.batch_norms` use the statistics of all workers' rows."""
    with graph.as_default():
        for name in plan.batch_norms:
            _synchronise(graph.get_operation_by_name(name), plan.num_workers, traffic)


def _synchronise(op: tf.Operation, n: int, traffic) -> None:
    x, scale, offset, mean_in, var_in = op.inputs[:5]
    channels_first = op.get_attr("data_format") in (b"NCHW", b"NCDHW")
    rank = x.shape.rank
    if rank is None:
        raise NotYetSupportedError(f"batch norm {op.name!r}: its input's rank is unknown")
    axes = [0] + list(range(2, rank)) if channels_first else list(range(rank - 1))
    channel_axis = 1 if channels_first else rank - 1
    epsilon = op.get_attr("epsilon")
    factor = op.get_attr("exponential_avg_factor") if op.type == "FusedBatchNormV3" else 1.0
    scope = f"tfpar/sync_batch_norm/{safe_name(op.name)}"
    with tf.compat.v1.name_scope(scope + "/"), tf.device(op.device):
        xf = tf.cast(x, tf.float32)  # as the fused op computes (float16 inputs too)
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(xf), axes)), tf.float32)
        local = tf.concat([tf.reduce_sum(xf, axes), tf.reshape(count, [1])], 0)
        total = allreduce(local, False, n, traffic, name=f"{safe_name(op.name)}_sum")
        rows = total[-1]
        mean = total[:-1] / rows
        shape = [1] * rank
        shape[channel_axis] = -1
        centered = xf - tf.reshape(mean, shape)
        squares = allreduce(tf.reduce_sum(tf.square(centered), axes), False, n, traffic,
                            name=f"{safe_name(op.name)}_squares")
        variance = squares / rows
        factor_of = tf.math.rsqrt(variance + epsilon) * scale
        y = tf.cast(centered * tf.reshape(factor_of, shape) + tf.reshape(offset, shape),
                    x.dtype)
        # What the fused op returns for the moving averages: the variance with Bessel's
        # correction, both averaged into the inputs when it keeps the averages itself.
        unbiased = variance * rows / tf.maximum(rows - 1.0, 1.0)
        if factor != 1.0:
            mean_out = (1.0 - factor) * mean_in + factor * mean
            var_out = (1.0 - factor) * var_in + factor * unbiased
        else:
            mean_out, var_out = mean, unbiased
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
