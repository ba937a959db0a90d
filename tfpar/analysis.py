"""Graph analysis: what a single-device training graph trains, and how. It never edits the graph.

Stock TensorFlow keeps no table of (variable, gradient) pairs, so tfpar recovers them from
the graph's structure:

1. The *gradient region* is every op `tf.gradients` created (the `gradients`, `gradients_1`,
   ... name scopes that `Optimizer.compute_gradients` and `tf.gradients` open).
2. A variable's *updates* are the ops that write it (optimizer apply ops, assigns, scatters)
   and that depend on the gradient region; an optimizer's `update_<var>/` name scope groups
   the several ops of one update (e.g. Adam on a sparse gradient).
3. The *raw gradient* is the gradient-region tensor nearest to the update, walking back from
   the update's inputs: anything in between (clipping by global norm, scaling, casts) is
   post-processing, which must see the combined gradient, so collectives go before it.
   A raw gradient that comes with integer indices from the region is an `IndexedSlices`
   (sparse); otherwise it is a dense `tf.Tensor`.
"""
from __future__ import annotations

import collections
import dataclasses
import re
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import tensorflow as tf

from tfpar.errors import TfparError

VARIABLE_OP_TYPES = frozenset({"VarHandleOp", "VariableV2", "Variable"})

# Optimizer kernels: how many leading inputs they write (the variable, then its slots).
_APPLY_WRITES = {
    "ApplyGradientDescent": 1, "ApplyProximalGradientDescent": 1,
    "ApplyMomentum": 2, "ApplyKerasMomentum": 2, "ApplyAdagrad": 2, "ApplyAdagradV2": 2,
    "ApplyProximalAdagrad": 2, "ApplyAddSign": 2, "ApplyPowerSign": 2,
    "ApplyAdam": 3, "ApplyAdamWithAmsgrad": 4, "ApplyAdaMax": 3, "ApplyAdadelta": 3,
    "ApplyRMSProp": 3, "ApplyCenteredRMSProp": 4, "ApplyFtrl": 3, "ApplyFtrlV2": 3,
    "ApplyAdagradDA": 3,
    "SparseApplyProximalGradientDescent": 1, "SparseApplyMomentum": 2,
    "SparseApplyKerasMomentum": 2, "SparseApplyAdagrad": 2, "SparseApplyAdagradV2": 2,
    "SparseApplyProximalAdagrad": 2, "SparseApplyAdadelta": 3, "SparseApplyRMSProp": 3,
    "SparseApplyCenteredRMSProp": 4, "SparseApplyFtrl": 3, "SparseApplyFtrlV2": 3,
    "SparseApplyAdagradDA": 3,
}
_GENERIC_WRITERS = (
    "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
    "ResourceScatterAdd", "ResourceScatterSub", "ResourceScatterMul", "ResourceScatterDiv",
    "ResourceScatterMin", "ResourceScatterMax", "ResourceScatterUpdate",
    "ResourceScatterNdAdd", "ResourceScatterNdSub", "ResourceScatterNdUpdate",
    "Assign", "AssignAdd", "AssignSub", "ScatterAdd", "ScatterSub", "ScatterMul",
    "ScatterDiv", "ScatterMin", "ScatterMax", "ScatterUpdate", "ScatterNdAdd",
    "ScatterNdSub", "ScatterNdUpdate",
)
WRITES: Dict[str, int] = {**_APPLY_WRITES, **{"Resource" + k: v for k, v in _APPLY_WRITES.items()},
                          **{k: 1 for k in _GENERIC_WRITERS}}
# Ops that take a variable's handle (or ref) without changing it.
READERS = frozenset({
    "ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape",
    "VarIsInitializedOp", "DestroyResourceOp", "IsVariableInitialized", "Identity",
    "Gather", "GatherV2", "GatherNd", "SaveV2", "SaveSlices", "Save",
})
_SHAPE_OPS = frozenset({"Shape", "ShapeN", "VariableShape", "Size", "Rank", "Const"})
DEFAULT_GRADIENT_SCOPE = r"(^|/)gradients(_\d+)?/"


@dataclasses.dataclass(frozen=True)
class Gradient:
    """The raw gradient of one update: a dense tensor, or the values and indices of IndexedSlices."""

    kind: str  # "dense" | "sparse"
    values: str  # tensor name
    indices: Optional[str] = None  # tensor name, sparse only
    post_processed: bool = False  # ops (clipping, scaling, ...) stand between it and the update
    values_shape: Tuple[Optional[int], ...] = ()  # static shape of `values` (None: unknown dim)


@dataclasses.dataclass(frozen=True)
class Update:
    """One optimizer update of a variable: the ops that write it and its slots, and its gradient."""

    ops: Tuple[str, ...]
    op_types: Tuple[str, ...]
    scope: str  # the optimizer's `.../update_<var>/` name scope, or "" for a lone op
    gradient: Gradient
    slots: Tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class PartitionInfo:
    """Where a piece of a partitioned variable sits in the whole."""

    full_name: str
    full_shape: Tuple[int, ...]
    offset: Tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class VariableInfo:
    """One variable of the graph and everything tfpar needs to know about it."""

    name: str  # op name, e.g. "dense/kernel" or "emb/part_0"
    shape: Tuple[Optional[int], ...]
    dtype: str
    nbytes: Optional[int]
    resource: bool
    trainable: bool
    role: str  # "trained" | "untrained" | "slot" | "optimizer_state" | "other"
    updates: Tuple[Update, ...] = ()
    slot_of: Optional[str] = None
    partition: Optional[PartitionInfo] = None

    @property
    def kind(self) -> str:
        """"dense", "sparse" or "none" (no gradient reaches it)."""
        kinds = {u.gradient.kind for u in self.updates}
        if not kinds:
            return "none"
        return "dense" if "dense" in kinds else "sparse"

    @property
    def slots(self) -> Tuple[str, ...]:
        return tuple(dict.fromkeys(s for u in self.updates for s in u.slots))


@dataclasses.dataclass(frozen=True)
class GraphAnalysis:
    """Every variable of a graph with its role, gradient and updates; plus step and train ops."""

    variables: Tuple[VariableInfo, ...]
    global_step: Optional[str]
    train_ops: Tuple[str, ...]

    @property
    def trained(self) -> Tuple[VariableInfo, ...]:
        return tuple(v for v in self.variables if v.role == "trained")

    def variable(self, name: str) -> VariableInfo:
        for v in self.variables:
            if v.name == name or v.name + ":0" == name:
                return v
        raise KeyError(name)

    def table(self) -> str:
        """A readable per-variable table."""
        rows = [("variable", "shape", "dtype", "bytes", "role", "gradient", "update ops")]
        for v in self.variables:
            upd = ", ".join(sorted({t for u in v.updates for t in u.op_types})) or (
                f"slot of {v.slot_of}" if v.slot_of else "-")
            rows.append((v.name, _fmt_shape(v.shape), v.dtype, _fmt_int(v.nbytes), v.role,
                         v.kind if v.role == "trained" else "-", upd))
        return format_table(rows)


def analyse(graph_or_meta, gradient_scope: str = DEFAULT_GRADIENT_SCOPE) -> GraphAnalysis:
    """Analyses a `tf.Graph` (or `MetaGraphDef`) holding one or more optimizer update ops."""
    if isinstance(graph_or_meta, tf.compat.v1.MetaGraphDef):
        from tfpar.transform.graph_copy import copy_graph
        graph = copy_graph(graph_or_meta)
    elif isinstance(graph_or_meta, tf.Graph):
        graph = graph_or_meta
    else:
        raise TfparError(f"tfpar analyses a tf.Graph or a MetaGraphDef, got "
                         f"{type(graph_or_meta).__name__}")
    return _Analyser(graph, gradient_scope).run()


class _Analyser:
    def __init__(self, graph: tf.Graph, gradient_scope: str):
        self.graph = graph
        self.ops = graph.get_operations()
        scope_re = re.compile(gradient_scope)
        self.region: Set[tf.Operation] = {op for op in self.ops if scope_re.search(op.name)}
        self.after_grad = self._descendants(self.region)
        with graph.as_default():  # Variable.to_proto needs graph mode
            self.collection_vars = self._collection_variables()

    # -- graph helpers ---------------------------------------------------------------------
    def _descendants(self, roots: Iterable[tf.Operation]) -> Set[tf.Operation]:
        control_out = collections.defaultdict(list)
        for op in self.ops:
            for dep in op.control_inputs:
                control_out[dep].append(op)
        seen, stack = set(), list(roots)
        while stack:
            op = stack.pop()
            if op in seen:
                continue
            seen.add(op)
            for t in op.outputs:
                stack.extend(t.consumers())
            stack.extend(control_out[op])
        return seen

    def _collection_variables(self):
        out = {}
        trainable = {v.op.name for v in self.graph.get_collection(
            tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)}
        for key in (tf.compat.v1.GraphKeys.GLOBAL_VARIABLES, tf.compat.v1.GraphKeys.LOCAL_VARIABLES,
                    tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES):
            for v in self.graph.get_collection(key):
                part = None
                info = v.to_proto().save_slice_info_def
                if info.full_name:
                    part = PartitionInfo(info.full_name, tuple(info.full_shape),
                                         tuple(info.var_offset))
                out[v.op.name] = (v.op.name in trainable, part)
        return out

    # -- main ------------------------------------------------------------------------------
    def run(self) -> GraphAnalysis:
        var_ops = [op for op in self.ops if op.type in VARIABLE_OP_TYPES]
        writers = {op: self._writers(op) for op in var_ops}
        slot_owner: Dict[str, str] = {}
        infos = {}
        for op in var_ops:
            trainable, part = self.collection_vars.get(op.name, (False, None))
            updates = ()
            if trainable:
                self._check_understood(op)
                updates = self._updates(op, writers[op])
                for u in updates:
                    for s in u.slots:
                        slot_owner.setdefault(s, op.name)
            infos[op.name] = (op, trainable, part, updates)
        result = []
        for name, (op, trainable, part, updates) in infos.items():
            if trainable:
                role = "trained" if updates else "untrained"
            elif name in slot_owner:
                role = "slot"
            elif any(w in self.after_grad for w, _ in writers[op]):
                role = "optimizer_state"  # e.g. global_step, Adam's beta powers
            else:
                role = "other"
            shape = tf.TensorShape(op.get_attr("shape"))
            dtype = tf.as_dtype(op.get_attr("dtype"))
            nbytes = shape.num_elements() * dtype.size if shape.is_fully_defined() else None
            result.append(VariableInfo(
                name=name, shape=tuple(shape.as_list()) if shape.rank is not None else (),
                dtype=dtype.name, nbytes=nbytes, resource=op.type == "VarHandleOp",
                trainable=trainable, role=role, updates=updates,
                slot_of=slot_owner.get(name), partition=part))
        if not any(v.role == "trained" for v in result):
            raise TfparError(
                "the graph has no optimizer update ops (no variable is written from a gradient): "
                "build the training step with an optimizer's minimize() or apply_gradients() "
                "before calling tfpar")
        step = tf.compat.v1.train.get_global_step(self.graph)
        train_ops = tuple(op.name for op in self.graph.get_collection(
            tf.compat.v1.GraphKeys.TRAIN_OP) if isinstance(op, tf.Operation))
        return GraphAnalysis(tuple(result), step.op.name if step is not None else None, train_ops)

    def _writers(self, var_op) -> List[Tuple[tf.Operation, int]]:
        """(op, input position) for every op that writes this variable."""
        handle = var_op.outputs[0]
        out = []
        for c in handle.consumers():
            n = WRITES.get(c.type, 0)
            out.extend((c, i) for i, t in enumerate(c.inputs) if t is handle and i < n)
        return out

    def _check_understood(self, var_op):
        for c in var_op.outputs[0].consumers():
            if c.type in WRITES or c.type in READERS or c not in self.after_grad:
                continue
            raise TfparError(
                f"variable {var_op.name!r} is used by op {c.name!r} of type {c.type}, which tfpar "
                "does not understand as an update; use a tf.compat.v1.train optimizer "
                f"(known update ops: {', '.join(sorted(WRITES)[:6])}, ...)")

    def _updates(self, var_op, writers) -> Tuple[Update, ...]:
        groups: Dict[str, List[tf.Operation]] = {}
        for op, pos in writers:
            if pos != 0 or op not in self.after_grad:
                continue  # initializers, restores, or this variable used as another's slot
            scope = _update_scope(op.name, var_op.name)
            key = scope or op.name
            if key not in groups:
                groups[key] = ([o for o in self.ops if o.name.startswith(scope)] if scope else [op])
        updates = []
        for key, ops in groups.items():
            scope = key if key.endswith("/") else ""
            updates.append(self._update(var_op, scope, ops))
        return tuple(updates)

    def _update(self, var_op, scope, ops) -> Update:
        members = set(ops)
        entries, slots = [], []
        for op in ops:
            n = WRITES.get(op.type, 0)
            for i, t in enumerate(op.inputs):
                if i < n:
                    if t.op is not var_op and t.op.type in VARIABLE_OP_TYPES:
                        slots.append(t.op.name)
                elif t.op not in members and t.op in self.after_grad:
                    entries.append(t)
        writer_ops = [op for op in ops if op.type in WRITES]
        gradient = self._raw_gradient(var_op, entries, writer_ops)
        return Update(ops=tuple(op.name for op in writer_ops),
                      op_types=tuple(dict.fromkeys(op.type for op in writer_ops)),
                      scope=scope, gradient=gradient,
                      slots=tuple(dict.fromkeys(s for s in slots if s != var_op.name)))

    def _raw_gradient(self, var_op, entries: Sequence[tf.Tensor], writer_ops) -> Gradient:
        found: Dict[tf.Tensor, int] = {}
        queue = collections.deque((t, 0) for t in entries)
        seen = set()
        while queue:
            t, d = queue.popleft()
            if t in seen:
                continue
            seen.add(t)
            if t.op in self.region:
                found.setdefault(t, d)
            elif t.op in self.after_grad:
                queue.extend((i, d + 1) for i in t.op.inputs)
        where = ", ".join(op.name for op in writer_ops)
        shape = tf.TensorShape(var_op.get_attr("shape"))
        dtype = tf.as_dtype(var_op.get_attr("dtype"))
        ints = {t: d for t, d in found.items() if t.dtype.is_integer and t.shape.rank == 1
                and t.op.type not in _SHAPE_OPS and not _is_cast_of_shape(t)}
        if ints:
            row_shape = tf.TensorShape([None]).concatenate(shape[1:])
            values = _nearest(var_op, {t: d for t, d in found.items() if t.dtype == dtype
                                       and t.shape.is_compatible_with(row_shape)},
                              "gradient values", where)
            indices = _nearest(var_op, ints, "gradient indices", where)
            return Gradient("sparse", values.name, indices.name,
                            post_processed=found[values] > 0, values_shape=_shape(values))
        dense = _nearest(var_op, {t: d for t, d in found.items() if t.dtype == dtype
                                  and t.shape.is_compatible_with(shape)}, "gradient", where)
        return Gradient("dense", dense.name, post_processed=found[dense] > 0,
                        values_shape=_shape(dense))


def _nearest(var_op, candidates: Dict[tf.Tensor, int], what: str, where: str) -> tf.Tensor:
    if not candidates:
        raise TfparError(
            f"cannot find the {what} of variable {var_op.name!r} updated by {where}: no tensor "
            "from tf.gradients reaches the update (if gradients were made under another name "
            "scope, set tfpar.Config(gradient_scope=...))")
    best = min(candidates.values())
    nearest = [t for t, d in candidates.items() if d == best]
    if len(nearest) > 1:
        raise TfparError(
            f"variable {var_op.name!r} updated by {where} takes its {what} from several tensors "
            f"({', '.join(sorted(t.name for t in nearest))}); tfpar needs one raw gradient per "
            "update")
    return nearest[0]


def _shape(t: tf.Tensor) -> Tuple[Optional[int], ...]:
    return tuple(t.shape.as_list()) if t.shape.rank is not None else ()


def _is_cast_of_shape(t: tf.Tensor) -> bool:
    return t.op.type == "Cast" and t.op.inputs[0].op.type in _SHAPE_OPS


def _update_scope(op_name: str, var_name: str) -> str:
    """The `.../update_<var>/` scope an optimizer opened for this variable, or ""."""
    marker = "update_" + var_name + "/"
    i = op_name.find(marker)
    while i >= 0:
        if i == 0 or op_name[i - 1] == "/":
            return op_name[:i + len(marker)]
        i = op_name.find(marker, i + 1)
    return ""


def _fmt_shape(shape) -> str:
    return "[" + ",".join("?" if d is None else str(d) for d in shape) + "]"


def _fmt_int(n) -> str:
    return "?" if n is None else f"{n:,}"


def format_table(rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns with a rule under the header row."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
