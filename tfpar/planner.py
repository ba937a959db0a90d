"""Deciding the Plan: the route of every variable, from the analysis, the config and the layout."""
from __future__ import annotations

import math

from tfpar import cost
from tfpar.analysis import GraphAnalysis, VariableInfo
from tfpar.config import Config
from tfpar.errors import NotYetSupportedError
from tfpar.plan import GradientPlan, Plan, VariablePlan
from tfpar.resources import Layout


def make_plan(analysis: GraphAnalysis, config: Config, layout: Layout) -> Plan:
    """Routes dense gradients to allreduce and (in AR mode) sparse ones to allgather."""
    n = layout.num_workers
    sparse = [v.name for v in analysis.trained if v.kind == "sparse"]
    notes = []
    if config.run_mode == "PS":
        raise NotYetSupportedError(
            "run_mode='PS' (every variable on parameter servers) is not supported yet; "
            "use tfpar.Config(run_mode='AR')")
    if config.run_mode == "HYBRID":
        if sparse:
            raise NotYetSupportedError(
                f"HYBRID mode puts sparse variables on parameter servers, which is not supported "
                f"yet (sparse: {', '.join(sparse)}); use tfpar.Config(run_mode='AR') to combine "
                "their gradients with Horovod allgather")
        notes.append("no sparse variable: HYBRID runs as AR (dense allreduce)")
    variables = tuple(_variable_plan(v, config, n) for v in analysis.variables)
    return Plan(run_mode=config.run_mode, mode="AR", num_workers=n,
                hosts=tuple((h.name, h.slots) for h in layout.hosts), variables=variables,
                global_step=analysis.global_step, notes=tuple(notes))


def _variable_plan(v: VariableInfo, config: Config, n: int) -> VariablePlan:
    common = dict(name=v.name, shape=v.shape, dtype=v.dtype, nbytes=v.nbytes, role=v.role,
                  kind=v.kind, partition_of=v.partition.full_name if v.partition else None)
    if v.role != "trained":
        return VariablePlan(route="replicated", **common)
    grads = tuple(GradientPlan(u.gradient.values, u.gradient.indices) for u in v.updates)
    if v.kind == "dense":
        predicted = None if v.nbytes is None else cost.allreduce_bytes(v.nbytes, n) * len(grads)
        return VariablePlan(route="allreduce", gradients=grads, predicted_bytes=predicted,
                            reduction="average" if config.average_dense else "sum", **common)
    predicted = 0.0
    for u in v.updates:
        shape = u.gradient.values_shape
        if not shape or any(d is None for d in shape):
            predicted = None
            break
        # Parallax's model counts values only (index traffic neglected).
        predicted += cost.allgather_bytes(math.prod(shape) * _itemsize(v.dtype), n)
    return VariablePlan(route="allgather", gradients=grads, predicted_bytes=predicted,
                        reduction="average" if config.average_sparse else "sum", **common)


def _itemsize(dtype: str) -> int:
    import tensorflow as tf
    return tf.as_dtype(dtype).size
