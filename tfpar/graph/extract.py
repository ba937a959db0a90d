"""The dataflow of a real training graph, for the tiling planner.

Every `MatMul` of the graph is kept: forward ones, and the two that `tf.gradients` makes
for each (dX = dY W^T and dW = X^T dY). So are bias adds (a trained vector added over
the batch rows: `BiasAdd`, or `Add` broadcasting) as `Broadcast`s, and bias gradients
(`BiasAddGrad`, or `Sum` over the batch axis) as `Reduce`s. Tensors joined by
element-wise ops of the same shape (activations, their gradients, identities, variable
reads, a squeezing reshape) are one matrix, since SoyBean requires element-wise ops to
keep a tiling; a weight's gradient is the weight's matrix (the update is element-wise).
"""
from __future__ import annotations

import re
from typing import Dict, Optional

import tensorflow as tf

from tfpar.graph.analysis import DEFAULT_GRADIENT_SCOPE
from tfpar.errors import TfparError
from tfpar.partition.tiling.dataflow import Dataflow

ELEMENTWISE = frozenset({
    "Identity", "ReadVariableOp", "Add", "AddV2", "BiasAdd", "Sub", "Mul", "RealDiv",
    "Tanh", "Relu", "Relu6", "Elu", "Selu", "Sigmoid", "Softplus", "Neg", "Square",
    "TanhGrad", "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad", "SigmoidGrad",
    "SoftplusGrad", "AddN", "Cast",
})


def extract(graph: tf.Graph, analysis=None, batch: Optional[int] = None,
            gradient_scope: str = DEFAULT_GRADIENT_SCOPE) -> Dataflow:
    """The Dataflow of `graph`'s matmuls; `batch` replaces unknown (None) dimensions."""
    region = re.compile(gradient_scope)
    matmuls = [op for op in graph.get_operations() if op.type == "MatMul"]
    if not matmuls:
        raise TfparError("the graph has no matmuls: there is nothing for the tiling planner "
                         "to split")
    parent: Dict[str, str] = {}

    def find(t: str) -> str:
        parent.setdefault(t, t)
        while parent[t] != t:
            parent[t] = parent[parent[t]]
            t = parent[t]
        return t

    def union(a: tf.Tensor, b: tf.Tensor, force: bool = False):
        if force or (a.shape.rank in (1, 2) and a.shape.rank == b.shape.rank
                     and a.shape.is_compatible_with(b.shape)):
            parent[find(a.name)] = find(b.name)

    for op in graph.get_operations():
        if op.type in ELEMENTWISE and op.outputs:
            side = bool(region.search(op.name))
            for t in op.inputs:
                # ReluGrad(dy, x) and the like read a forward tensor: a gradient and its
                # activation are different matrices, so never join across the region.
                if t.dtype != tf.resource and bool(region.search(t.op.name)) == side:
                    union(op.outputs[0], t)
        if op.type in ("Reshape", "Squeeze") and _squeezed(op.inputs[0]) is not None \
                and _squeezed(op.inputs[0]) == _squeezed(op.outputs[0]):
            union(op.outputs[0], op.inputs[0], force=True)  # (1, n) -> (n,): one vector
    weights = {}
    if analysis is not None:
        for v in analysis.trained:
            var = graph.get_operation_by_name(v.name)
            reads = [c.outputs[0] for c in var.outputs[0].consumers()
                     if c.type == "ReadVariableOp"]
            for r in reads:
                weights[find(r.name)] = v.name
            for u in v.updates:
                if u.gradient.kind == "dense" and reads:
                    union(graph.get_tensor_by_name(u.gradient.values), reads[0])
    weights = {find(k): name for k, name in weights.items()}

    df = Dataflow()
    names: Dict[str, str] = {}

    def matrix(t: tf.Tensor, in_region: bool) -> str:
        root = find(t.name)
        if root in names:
            return names[root]
        shape = [batch if d is None else d for d in t.shape.as_list()]
        if len(shape) == 2 and 1 in shape and root in weights:  # a (1, n) view of a vector
            shape = [d for d in shape if d != 1] or [1]
        if any(d is None for d in shape):
            raise TfparError(f"tensor {t.name} has an unknown dimension {t.shape}: give the "
                             "batch size (tfpar plan --batch B)")
        if root in weights:
            name, kind = weights[root], "weight"
        else:
            name = t.op.name
            kind = ("gradient" if in_region else
                    "input" if t.op.type in ("Placeholder", "IteratorGetNext") else "activation")
        df.matrix(name, shape, kind)
        names[root] = name
        return name

    for op in matmuls:
        in_region = bool(region.search(op.name))
        a, b, out = (matrix(t, in_region) for t in (op.inputs[0], op.inputs[1], op.outputs[0]))
        kind = df.matrices[out].kind
        cause = ("forward" if not in_region else
                 "backward_weight" if kind == "weight" else "backward_data")
        df.matmul(op.name, a, b, out, op.get_attr("transpose_a"), op.get_attr("transpose_b"),
                  cause)
    for op in graph.get_operations():
        in_region = bool(region.search(op.name))
        if op.type in BROADCASTING and op.outputs[0].shape.rank == 2:
            vectors = [t for t in op.inputs if t.shape.rank == 1 and find(t.name) in weights]
            if len(vectors) == 1 and len(op.inputs) == 2:
                vector = vectors[0]
                dense = op.inputs[1] if op.inputs[0] is vector else op.inputs[0]
                if dense.shape.rank == 2:
                    df.broadcast(op.name, matrix(vector, in_region),
                                 matrix(op.outputs[0], in_region), 0,
                                 "backward_data" if in_region else "forward")
        elif op.type in ("Sum", "BiasAddGrad") and op.inputs[0].shape.rank == 2:
            if op.type == "Sum" and _constant(op.inputs[1]) not in ([0], 0):
                continue
            if find(op.outputs[0].name) in weights:
                df.reduce(op.name, matrix(op.inputs[0], in_region),
                          matrix(op.outputs[0], in_region), 0,
                          "backward_weight" if in_region else "forward")
    return df


BROADCASTING = frozenset({"BiasAdd", "Add", "AddV2", "Sub", "Mul"})


def _squeezed(t: tf.Tensor):
    dims = t.shape.as_list() if t.shape.rank is not None else None
    return None if dims is None or None in dims else [d for d in dims if d != 1]


def _constant(t: tf.Tensor):
    if t.op.type != "Const":
        return None
    return tf.make_ndarray(t.op.get_attr("value")).tolist()
