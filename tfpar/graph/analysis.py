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

import numpy as np
import tensorflow as tf

from tfpar.graph import row_reads
from tfpar.graph.op_index import OpsByPrefix
from tfpar.errors import Blocker, NotYetSupportedError, TfparError, raise_blockers
from tfpar.plan.graph_facts import (DEFAULT_GRADIENT_SCOPE, Gradient, GraphAnalysis,  # noqa: F401
                                    PartitionInfo, Update, VariableInfo)

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
# Writes that change a variable by an amount (done twice, they change it twice).
ACCUMULATING_WRITES = frozenset({
    "AssignAdd", "AssignSub", "AssignAddVariableOp", "AssignSubVariableOp",
    "ScatterAdd", "ScatterSub", "ScatterMul", "ScatterDiv", "ScatterNdAdd", "ScatterNdSub",
    "ResourceScatterAdd", "ResourceScatterSub", "ResourceScatterMul", "ResourceScatterDiv",
    "ResourceScatterNdAdd", "ResourceScatterNdSub"})
WRITES: Dict[str, int] = {**_APPLY_WRITES, **{"Resource" + k: v for k, v in _APPLY_WRITES.items()},
                          **{k: 1 for k in _GENERIC_WRITERS}}
# Ops that take a variable's handle (or ref) without changing it.
READERS = frozenset({
    "ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape",
    "VarIsInitializedOp", "DestroyResourceOp", "IsVariableInitialized", "Identity",
    "Gather", "GatherV2", "GatherNd", "SaveV2", "SaveSlices", "Save", "DisableCopyOnRead",
})
# Ops that pass a variable's handle (or ref) on into control flow or a function: a variable
# they carry is read inside, unless the function body writes it (checked).
FUNCTIONAL = {  # op type -> (function attrs, offset of the first input passed to the function)
    "While": (("cond", "body"), 0), "StatelessWhile": (("cond", "body"), 0),
    "If": (("then_branch", "else_branch"), 1), "StatelessIf": (("then_branch", "else_branch"), 1),
    "Case": (("branches",), 1), "StatelessCase": (("branches",), 1),
    "PartitionedCall": (("f",), 0), "StatefulPartitionedCall": (("f",), 0),
}
PASS_THROUGH = frozenset({"Enter", "RefEnter", "Switch", "RefSwitch", "Merge", "RefMerge",
                          "Identity", "RefIdentity", "NextIteration", "RefNextIteration"})
_DANGLING = frozenset({"ReadVariableOp", "Identity", "RefIdentity", "IsVariableInitialized",
                       "VarIsInitializedOp"})
_SHAPE_OPS = frozenset({"Shape", "ShapeN", "VariableShape", "Size", "Rank", "Const"})


def reachable(roots: Iterable[tf.Operation], neighbours) -> Set[tf.Operation]:
    """Every op reachable from `roots` (included) by `neighbours(op)`."""
    seen, stack = set(), list(roots)
    while stack:
        op = stack.pop()
        if op not in seen:
            seen.add(op)
            stack.extend(neighbours(op))
    return seen


FUSED_BATCH_NORMS = ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")


def training_batch_norms(graph: tf.Graph) -> Tuple[str, ...]:
    """The batch norms of `graph` in training mode (they use batch statistics) that tfpar
    takes over the global batch: fused batch-norm ops, `tf.nn.moments` over the batch
    axis (a non-fused batch norm, as Keras builds for 2-D inputs), named by its mean op,
    and TF2 `tf.cond`s with a fused one in a branch (`training=<a tensor>`), by the cond."""
    fused = [op.name for op in graph.get_operations()
             if op.type in FUSED_BATCH_NORMS and op.get_attr("is_training")]
    moments = [op.name for op in graph.get_operations() if moments_variance(op) is not None]
    conds = [c.cond for c in cond_batch_norms(graph)]
    return tuple(sorted(fused + moments + conds))


CONDS = ("If", "StatelessIf")


@dataclasses.dataclass(frozen=True)
class CondBatchNorm:
    """A fused batch norm in training mode inside one branch of a TF2 `tf.cond` (what
    Keras builds for `training=<a tensor>`), returning its y, batch mean and batch variance
    as the cond's outputs 0, 1 and 2 (the other branch: inference)."""

    cond: str  # the If op
    in_then_branch: bool  # whether the branch taken when the predicate is true trains
    # x, scale, offset, mean, variance: (the cond's input index, read from a variable)
    inputs: Tuple[Tuple[int, bool], ...]
    epsilon: float
    data_format: str
    exponential_avg_factor: float


def cond_batch_norms(graph: tf.Graph) -> Tuple[CondBatchNorm, ...]:
    """Every TF2 `tf.cond` of `graph` built as Keras builds a batch norm with a training
    tensor (see CondBatchNorm); other training batch norms in functions are not listed."""
    conds = [op for op in graph.get_operations() if op.type in CONDS]
    if not conds:
        return ()
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    found = []
    for op in conds:
        branches = [library.get(op.get_attr(a).name) for a in ("then_branch", "else_branch")]
        training = [[n for n in f.node_def if n.op in FUSED_BATCH_NORMS
                     and n.attr["is_training"].b] if f is not None else [None]
                    for f in branches]
        if sorted(len(t) for t in training) != [0, 1]:
            continue
        in_then = len(training[0]) == 1
        function, node = (branches[0], training[0][0]) if in_then else (branches[1],
                                                                         training[1][0])
        inputs = _function_inputs(function, [i for i in node.input if not i.startswith("^")])
        outputs = [function.ret[a.name] for a in function.signature.output_arg[:3]]
        if inputs is None or outputs != [f"{node.name}:{o}:0" for o in
                                         ("y", "batch_mean", "batch_variance")]:
            continue
        found.append(CondBatchNorm(
            op.name, in_then, tuple((i + 1, read) for i, read in inputs[:5]),
            node.attr["epsilon"].f, node.attr["data_format"].s.decode() or "NHWC",
            node.attr["exponential_avg_factor"].f if node.op == "FusedBatchNormV3" else 1.0))
    return tuple(found)


def _function_inputs(function, inputs) -> Optional[List[Tuple[int, bool]]]:
    """For each input of a node in `function`: (the function argument's index, whether it
    is read through a ReadVariableOp of the argument); None if one is anything else."""
    args = [a.name for a in function.signature.input_arg]
    nodes = {n.name: n for n in function.node_def}
    out = []
    for name in inputs:
        if name in args:
            out.append((args.index(name), False))
            continue
        node = nodes.get(name.split(":")[0])
        if node is None or node.op != "ReadVariableOp" or node.input[0] not in args:
            return None
        out.append((args.index(node.input[0]), True))
    return out


def _batch_axes(op: tf.Operation) -> Optional[Tuple[int, ...]]:
    """The axes a `Mean` op reduces, if they are static and hold the batch axis 0."""
    if op.type != "Mean":
        return None
    axes = tf.get_static_value(op.inputs[1])
    rank = op.inputs[0].shape.rank
    if axes is None or rank is None:
        return None
    axes = tuple(sorted(int(a) % rank for a in np.ravel(axes)))
    return axes if 0 in axes else None


def moments_variance(mean: tf.Operation) -> Optional[tf.Operation]:
    """The variance op of `tf.nn.moments(x, axes)` whose mean op is `mean`, when the axes
    hold the batch axis: Mean(SquaredDifference(x, StopGradient(mean))) over the same axes;
    None for any other op."""
    axes = _batch_axes(mean)
    if axes is None or not mean.name.endswith("moments/mean"):
        return None
    for stop in mean.outputs[0].consumers():
        if stop.type != "StopGradient":
            continue
        for diff in stop.outputs[0].consumers():
            if diff.type != "SquaredDifference" or diff.inputs[0] is not mean.inputs[0]:
                continue
            for variance in diff.outputs[0].consumers():
                if (_batch_axes(variance) == axes
                        and variance.get_attr("keep_dims") == mean.get_attr("keep_dims")):
                    return variance
    return None


def unsynced_batch_norms(graph: tf.Graph) -> Tuple[str, ...]:
    """Batch statistics tfpar does not take over the global batch: means over the batch
    axis named as `tf.nn.moments`'s but not built as it builds them, and fused batch norms
    in training mode inside functions other than a cond_batch_norms branch."""
    found = [op.name for op in graph.get_operations()
             if op.name.endswith("moments/mean") and _batch_axes(op) is not None
             and moments_variance(op) is None]
    synced = {graph.get_operation_by_name(c.cond).get_attr(
        "then_branch" if c.in_then_branch else "else_branch").name
        for c in cond_batch_norms(graph)}
    for function in graph.as_graph_def().library.function:
        for node in function.node_def:
            if (node.op in FUSED_BATCH_NORMS and node.attr["is_training"].b
                    and function.signature.name not in synced):
                found.append(f"{function.signature.name}/{node.name}")
    return tuple(sorted(found))


def analyse(graph_or_meta, gradient_scope: str = DEFAULT_GRADIENT_SCOPE,
            strict: bool = True) -> GraphAnalysis:
    """Analyses a `tf.Graph` (or `MetaGraphDef`) holding one or more optimizer update ops.

    strict: raise one error listing every blocker found (else they are in `.blockers`).
    """
    if isinstance(graph_or_meta, tf.compat.v1.MetaGraphDef):
        from tfpar.graph.graph_copy import copy_graph
        graph = copy_graph(graph_or_meta)
    elif isinstance(graph_or_meta, tf.Graph):
        graph = graph_or_meta
    else:
        raise TfparError(f"tfpar analyses a tf.Graph or a MetaGraphDef, got "
                         f"{type(graph_or_meta).__name__}")
    analysis = _Analyser(graph, gradient_scope).run()
    if strict:
        raise_blockers(analysis.blockers)
    return analysis


class _Analyser:
    def __init__(self, graph: tf.Graph, gradient_scope: str):
        self.graph = graph
        self.ops = graph.get_operations()
        self.by_prefix = OpsByPrefix(graph)
        scope_re = re.compile(gradient_scope)
        self.region: Set[tf.Operation] = {op for op in self.ops if scope_re.search(op.name)}
        self._library = None
        with graph.as_default():  # Variable.to_proto needs graph mode
            self.collection_vars = self._collection_variables()
        # Gradients accumulated over runs: a read of an accumulator is a raw gradient.
        self.region |= self._accumulator_reads()
        # Gradients fetched in one run and fed back to apply_gradients in another.
        self.region |= self._fed_gradients()
        self.after_grad = self._descendants(self.region)

    def _accumulator_reads(self) -> Set[tf.Operation]:
        """The reads of gradient accumulators that an optimizer update takes its gradient
        from: an accumulator is a variable that is not trained, that an `assign_add` fills
        with values computed from tf.gradients (by data, over several runs), and whose
        value an update op of a trained variable reads (data, not its written input). The
        update then applies the accumulated sum, which tfpar allreduces as the gradient.
        Only where that update reads no gradient of its own run (else it is not an
        accumulation, and its gradient is found as usual)."""
        from_gradients = reachable(self.region, lambda op: [c for t in op.outputs
                                                             for c in t.consumers()])
        reads: Set[tf.Operation] = set()
        for var in (op for op in self.ops if op.type in VARIABLE_OP_TYPES
                    and not self.collection_vars.get(op.name, (False, None))[0]):
            handle = var.outputs[0]
            filled = any(c.type in ("AssignAddVariableOp", "AssignAdd")
                         and c.inputs[0] is handle and c.inputs[1].op in from_gradients
                         for c in handle.consumers())
            if not filled:
                continue
            read_type = "ReadVariableOp" if var.type == "VarHandleOp" else "Identity"
            for read in (c for c in handle.consumers() if c.type == read_type):
                # What the read's value flows into, up to the ops that write a variable.
                flow = reachable([read], lambda op: [c for t in op.outputs for c in t.consumers()
                                                     if c.type not in WRITES])
                downstream = {c for op in flow for t in op.outputs for c in t.consumers()}
                updates = [c for c in downstream if c.type in WRITES
                           and c.type not in _GENERIC_WRITERS
                           and any(t.op in flow for t in c.inputs[WRITES[c.type]:])]
                inputs = [t.op for u in updates for t in u.inputs[WRITES[u.type]:]]
                if updates and not row_reads.upstream(inputs) & self.region:
                    reads.add(read)
        return reads

    def _fed_gradients(self) -> Set[tf.Operation]:
        """The placeholders a script feeds gradients through: it fetches the gradients in
        one run (or computes them in numpy) and feeds them to `apply_gradients` in another,
        as Horovod's optimizer allows. A placeholder counts when its value reaches an
        optimizer's update of a trained variable (the ops of its `update_<var>/` scope, or
        one apply op) that reads no gradient of its own run, and its shape is the
        gradient's: the variable's (dense), its rows' (`IndexedSlices` values) or a vector
        of integers (their indices). The update then applies the fed value, which tfpar
        combines over the workers as the gradient of each worker's batch."""
        found: Set[tf.Operation] = set()
        done: Set[str] = set()
        for var in (op for op in self.ops if op.type in VARIABLE_OP_TYPES
                    and self.collection_vars.get(op.name, (False, None))[0]):
            shape = tf.TensorShape(var.get_attr("shape"))
            dtype = tf.as_dtype(var.get_attr("dtype"))
            rows = tf.TensorShape([None]).concatenate(shape[1:]) if shape.rank else shape
            for op, pos in self._writers(var):
                scope = _update_scope(op.name, var.name)
                if (pos != 0 or not (scope or op.type not in _GENERIC_WRITERS)
                        or (scope or op.name) in done):
                    continue  # an initializer's or a user's assign, or seen
                done.add(scope or op.name)
                ops = set(self.by_prefix.with_prefix(scope)) if scope else {op}
                entries = [t.op for o in ops for t in o.inputs if t.op not in ops]
                feeding = self._fed_upstream(entries)
                for p in feeding:
                    if p.type not in ("Placeholder", "PlaceholderWithDefault"):
                        continue
                    t = p.outputs[0]
                    if ((t.dtype == dtype and (t.shape.is_compatible_with(shape)
                                               or t.shape.is_compatible_with(rows)))
                            or (t.dtype.is_integer and t.shape.rank == 1)):
                        found.add(p)
        return found

    def _fed_upstream(self, entries) -> Set[tf.Operation]:
        """The ops upstream of an update's `entries`, not through variables (its slots, the
        beta powers); empty as soon as one is a gradient of the run itself (or an
        accumulator's read): then nothing of the update is fed."""
        seen, stack = set(), list(entries)
        while stack:
            op = stack.pop()
            if op in seen:
                continue
            if op in self.region:
                return set()
            seen.add(op)
            if op.type not in VARIABLE_OP_TYPES:
                stack.extend([t.op for t in op.inputs] + list(op.control_inputs))
        return seen

    # -- graph helpers ---------------------------------------------------------------------
    def _descendants(self, roots: Iterable[tf.Operation]) -> Set[tf.Operation]:
        control_out = collections.defaultdict(list)
        for op in self.ops:
            for dep in op.control_inputs:
                control_out[dep].append(op)
        return reachable(roots, lambda op: [c for t in op.outputs for c in t.consumers()]
                         + control_out[op])

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
        blockers: List[Blocker] = []
        for op in var_ops:
            trainable, part = self.collection_vars.get(op.name, (False, None))
            updates = ()
            if trainable:
                found = self._not_understood(op)
                try:
                    updates = self._updates(op, writers[op])
                except TfparError as e:
                    found.append(Blocker(op.name, str(e), isinstance(e, NotYetSupportedError)))
                blockers.extend(found)
                for u in updates:
                    for s in u.slots:
                        slot_owner.setdefault(s, op.name)
            infos[op.name] = (op, trainable, part, updates)
        blockers.extend(self._horovod_ops())
        blockers.extend(self._sync_replicas())
        step_ops = row_reads.training_ops(
            self.graph.get_operation_by_name(n)
            for _, trainable, _, updates in infos.values() for u in updates for n in u.ops)
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
                slot_of=slot_owner.get(name), partition=part,
                adds_outside=self._adds_outside(op, step_ops) if trainable else (),
                **(self._reads(op, updates, step_ops)
                   if any(u.gradient.kind == "sparse" for u in updates) else {})))
        if not any(v.role == "trained" for v in result) and not blockers:
            accumulated = self._applied_from_variables()
            if accumulated:
                raise NotYetSupportedError(
                    f"{accumulated}: tfpar distributes an update whose gradient comes from "
                    "tf.gradients, in the step itself, accumulated over runs (a variable "
                    "that is not trained, filled by assign_add of gradients) or fed through "
                    "placeholders; this one is none of these, so each worker would apply "
                    "its own value. Compute the "
                    "gradient with tf.gradients (compute_gradients then apply_gradients, "
                    "or minimize())")
            raise TfparError(
                "the graph has no optimizer update ops (no variable is written from a gradient): "
                "build the training step with an optimizer's minimize() or apply_gradients() "
                "before calling tfpar")
        step = tf.compat.v1.train.get_global_step(self.graph)
        train_ops = tuple(op.name for op in self.graph.get_collection(
            tf.compat.v1.GraphKeys.TRAIN_OP) if isinstance(op, tf.Operation))
        return GraphAnalysis(tuple(self._update_groups(result)),
                             step.op.name if step is not None else None, train_ops,
                             tuple(blockers), training_batch_norms(self.graph),
                             unsynced_batch_norms(self.graph))

    def _update_groups(self, variables) -> List[VariableInfo]:
        """`variables` with each update's `Update.group`: the updates grouped by the last
        ops after them (ops that nothing reads or waits for: what a user runs, such as
        `minimize()`'s result or a `tf.group` of several). Updates before the same such
        ops are one group; a GAN's two `minimize()` results, run by turns, make two."""
        control_out = collections.defaultdict(list)
        for op in self.ops:
            for dep in op.control_inputs:
                control_out[dep].append(op)

        def after(op):
            return [c for t in op.outputs for c in t.consumers()] + control_out[op]

        # Not what a user runs: an optimizer's own reads after its updates (an assign's
        # read_value that nothing reads), or any read or copy left dangling.
        scopes = tuple(u.scope for v in variables for u in v.updates if u.scope)
        groups: Dict[frozenset, int] = {}
        out = []
        for v in variables:
            updates = []
            for u in v.updates:
                ops = [self.graph.get_operation_by_name(n) for n in u.ops]
                ends = frozenset(x.name for x in reachable(ops, after)
                                 if not after(x) and x.type not in _DANGLING
                                 and not x.name.startswith(scopes))
                updates.append(dataclasses.replace(u, group=groups.setdefault(ends,
                                                                              len(groups))))
            out.append(dataclasses.replace(v, updates=tuple(updates)) if updates else v)
        return out

    @staticmethod
    def _adds_outside(var_op, step_ops) -> Tuple[str, ...]:
        """`VariableInfo.adds_outside`: the ops outside the step that add to `var_op`."""
        return tuple(sorted(c.name for c in var_op.outputs[0].consumers()
                            if c.type in ACCUMULATING_WRITES and c not in step_ops
                            and not row_reads.is_restore(c)))

    def _reads(self, var_op, updates, step_ops) -> dict:
        """A sparse variable's `other_reads` and `averages` (`row_reads`)."""
        ops = {o for u in updates for o in (
            [op for op in self.ops if op.name.startswith(u.scope)] if u.scope else
            [self.graph.get_operation_by_name(n) for n in u.ops])}
        reads = row_reads.row_reads(var_op, ops, step_ops)
        return {"other_reads": tuple(dict.fromkeys(op.name for op, _ in reads.others)),
                "averages": tuple(dict.fromkeys(shadow.name for _, shadow, _ in
                                                reads.averages))}

    def _horovod_ops(self) -> List[Blocker]:
        """Horovod's own collectives in the user's graph (a Horovod script's
        DistributedOptimizer, broadcast_global_variables, allreduce): tfpar adds its own, so
        each is a blocker that says which line to delete."""
        fixes = {"HorovodAllreduce": "hvd.DistributedOptimizer(...) or hvd.allreduce(...): "
                                     "use the plain optimizer",
                 "HorovodGroupedAllreduce": "hvd.DistributedOptimizer(...): use the plain "
                                            "optimizer",
                 "HorovodAllgather": "hvd.allgather(...) (or DistributedOptimizer's sparse "
                                     "path): use the plain optimizer",
                 "HorovodBroadcast": "hvd.broadcast_global_variables(0) or "
                                     "hvd.BroadcastGlobalVariablesHook(0): delete it (tfpar "
                                     "broadcasts worker 0's variables itself)"}
        by_type: Dict[str, List[str]] = {}
        for op in self.ops:
            if op.type.startswith("Horovod"):
                by_type.setdefault(op.type, []).append(op.name)
        out = []
        for kind, names in sorted(by_type.items()):
            fix = fixes.get(kind, "a Horovod call: delete it")
            some = ", ".join(repr(n) for n in names[:2]) + (", ..." if len(names) > 2 else "")
            out.append(Blocker(names[0], f"{len(names)} {kind} op(s) ({some}): Horovod's own "
                               f"collectives, from {fix}. tfpar distributes the single-device "
                               "graph itself (README: from Horovod to tfpar)"))
        return out

    def _sync_replicas(self) -> List[Blocker]:
        """TF's `SyncReplicasOptimizer` (its token queue): TF's own parameter-server
        synchronisation, which tfpar replaces, so a blocker that says what to change."""
        queues = [op.name for op in self.ops if op.type in ("FIFOQueueV2", "FIFOQueue")
                  and op.name.split("/")[-1] == "sync_token_q"]
        if not queues:
            return []
        return [Blocker(queues[0], (
            f"tf.compat.v1.train.SyncReplicasOptimizer (its token queue {queues[0]!r}): "
            "TensorFlow's own synchronisation of workers on parameter servers, which tfpar "
            "replaces. Train with the optimizer it wraps (opt, not "
            "SyncReplicasOptimizer(opt, ...)) and drop its make_session_run_hook(); tfpar "
            "applies every step's gradients of all workers, as replicas_to_aggregate = the "
            "number of workers"))]

    def _writers(self, var_op) -> List[Tuple[tf.Operation, int]]:
        """(op, input position) for every op that writes this variable, directly or in a
        TF1 `tf.cond` branch (through the cond's Switch of its handle)."""
        out = []
        for handle in _cond_handles(var_op):
            for c in handle.consumers():
                n = WRITES.get(c.type, 0)
                out.extend((c, i) for i, t in enumerate(c.inputs) if t is handle and i < n)
                if c.type in CONDS:  # a TF2 tf.cond whose branch writes it: (the If, 0)
                    out.extend((c, 0) for i, t in enumerate(c.inputs)
                               if t is handle and self._function_writes(c, i))
        return out

    def _not_understood(self, var_op) -> List[Blocker]:
        """Every use of a trained variable that tfpar cannot account for, as blockers.

        Control flow and functions (`tf.while_loop`, `tf.cond`, `dynamic_rnn`, attention
        decoders) that carry the variable's handle read it inside; one whose body *writes*
        the variable is a blocker, as is a write tfpar does not know.
        """
        found: List[Blocker] = []
        stack, seen, looped = [var_op.outputs[0]], set(), set()
        while stack:
            t = stack.pop()
            if t in seen:
                continue
            seen.add(t)
            for c in t.consumers():
                if c.type in CONDS and t is var_op.outputs[0]:
                    continue  # a TF2 tf.cond branch's write is an update (`_writers`)
                if c.type in FUNCTIONAL:
                    for pos, x in enumerate(c.inputs):
                        if x is t and self._function_writes(c, pos):
                            found.append(Blocker(var_op.name, (
                                f"variable {var_op.name!r} is updated inside {c.type} op "
                                f"{c.name!r} (a tf.while_loop, tf.cond or function body): tfpar "
                                "cannot combine an update made inside a loop across workers; "
                                "update it with an optimizer outside the loop")))
                elif c.type in PASS_THROUGH and c.type not in ("Identity", "RefIdentity"):
                    stack.extend(c.outputs)  # v1 control flow: follow the handle
                    if c.type not in _SWITCHES or t in looped:
                        looped.update(c.outputs)
                elif c.type in WRITES and t is not var_op.outputs[0]:
                    # A write in a tf.cond branch is an update (`_writers`); in a loop not.
                    if c in self.after_grad and t in looped:
                        found.append(Blocker(var_op.name, (
                            f"variable {var_op.name!r} is written by op {c.name!r} ({c.type}) "
                            "inside control flow: tfpar cannot combine an update made inside a "
                            "loop or branch across workers; update it with an optimizer outside")))
                elif (c.type in WRITES or c.type in READERS or c not in self.after_grad):
                    continue
                else:
                    found.append(Blocker(var_op.name, (
                        f"variable {var_op.name!r} is used by op {c.name!r} of type {c.type}, "
                        "which tfpar understands neither as a read nor as an optimizer update; "
                        "update trained variables with a tf.compat.v1.train optimizer "
                        f"(known update ops: {', '.join(sorted(WRITES)[:6])}, ...)")))
        return found

    def _function_writes(self, op: tf.Operation, position: int, depth: int = 0) -> bool:
        """Whether the function(s) `op` calls write the resource given at input `position`."""
        attrs, offset = FUNCTIONAL[op.type]
        if position < offset or depth > 8:
            return depth > 8
        names = []
        for a in attrs:
            value = op.get_attr(a)
            names.extend(f.name for f in (value if isinstance(value, list) else [value]))
        return any(self._body_writes(n, position - offset, depth) for n in names)

    def _body_writes(self, fname: str, arg: int, depth: int) -> bool:
        fdef = self._functions().get(fname)
        if fdef is None or arg >= len(fdef.signature.input_arg):
            return False
        aliases = {fdef.signature.input_arg[arg].name}
        changed = True
        while changed:  # names that carry the handle: the argument and Identity chains of it
            changed = False
            for n in fdef.node_def:
                if n.op in PASS_THROUGH and n.input and n.input[0] in aliases:
                    for out in (n.name, n.name + ":output:0"):
                        if out not in aliases:
                            aliases.add(out)
                            changed = True
        for n in fdef.node_def:
            inputs = [i for i in n.input if not i.startswith("^")]
            if n.op in WRITES and inputs and inputs[0] in aliases:
                return True
            if n.op in FUNCTIONAL:
                attrs, offset = FUNCTIONAL[n.op]
                for pos, i in enumerate(inputs):
                    if i in aliases and pos >= offset:
                        for a in attrs:
                            value = n.attr[a]
                            funcs = list(value.list.func) if value.HasField("list") else [value.func]
                            if any(self._body_writes(f.name, pos - offset, depth + 1)
                                   for f in funcs):
                                return True
        return False

    def _row_post_processing(self, var_op, values, indices, final_indices, update_ops):
        """Checks that a sparse gradient's post-processing is exact on per-worker rows.

        On the parameter servers each worker post-processes its own rows (its share of the
        concatenated batch's gradient) and pushes the result, whose duplicate ids are then
        summed, as the update would sum them. That equals single-device training when every op
        on the rows is row-wise (row i from row i and from tensors that do not depend on the
        rows), and every reduction over the rows is a sum, which is then summed over workers
        (e.g. the global norm of clip_by_global_norm). Returns (row sums, problem or None,
        the first row-wise op that is not linear in the rows or None).
        """
        rows = {values}
        sums: List[str] = []
        nonlinear: Optional[str] = None
        stack = [values]
        while stack:
            t = stack.pop()
            for c in t.consumers():
                if c in update_ops or c not in self.after_grad:
                    continue
                if c.type == "UnsortedSegmentSum" and c.inputs[0] is t and \
                        _passes_to(c.inputs[1], indices):
                    # The rows made dense by their ids (tf.convert_to_tensor of the
                    # IndexedSlices, as an optimizer's arithmetic does): linear in them, and
                    # what follows is dense, the same from rows summed by id first.
                    continue
                if c.type in _ROW_SUMS and self._sums_rows(c, t):
                    sums.append(c.outputs[0].name)
                    continue
                if c.type in _ROW_WISE:
                    for other in c.inputs:
                        if other in rows:
                            continue
                        if c.type == "Sum" or not _broadcasts_over_rows(other, t):
                            return (), _inexact(var_op, c, f"its input {other.name!r} has "
                                                "one value per row"), None
                    if nonlinear is None and not _linear_in_rows(c, rows):
                        nonlinear = c.name
                    out = c.outputs[0]
                    if out not in rows:
                        rows.add(out)
                        stack.append(out)
                    continue
                return (), _inexact(var_op, c, f"a {c.type} op over the gradient's rows is "
                                    "neither row-wise nor a sum"), None
        t = final_indices
        while t is not indices:
            if t.op.type not in _INDEX_PASS or t.op in update_ops:
                return (), _inexact(var_op, t.op, "it changes the gradient's indices"), None
            t = t.op.inputs[0]
        return tuple(dict.fromkeys(sums)), None, nonlinear


    def _sums_rows(self, op: tf.Operation, rows: tf.Tensor) -> bool:
        if op.type == "L2Loss":
            return True
        axes = tf.get_static_value(op.inputs[1])
        if axes is None:
            return False
        rank = rows.shape.rank
        axes = [int(a) % rank if rank else int(a) for a in np.atleast_1d(axes)]
        return 0 in axes or (rank is not None and len(axes) == 0)

    def _functions(self):
        if self._library is None:
            self._library = {f.signature.name: f
                             for f in self.graph.as_graph_def().library.function}
        return self._library

    def _applied_from_variables(self) -> str:
        """Optimizer updates whose gradient comes from other variables' values that no
        gradient fills, not from tf.gradients, named; "" if none."""
        found = []
        for op in self.ops:
            if op.type not in _APPLY_WRITES and op.type[len("Resource"):] not in _APPLY_WRITES:
                continue
            n = WRITES[op.type]
            sources = sorted({x.name for t in op.inputs[n:] for x in row_reads.upstream([t.op])
                              if x.type in VARIABLE_OP_TYPES})
            if sources:
                found.append(f"{op.name} updates {op.inputs[0].op.name!r} from the value of "
                             + ", ".join(repr(x) for x in sources))
        return "; ".join(found)

    def _updates(self, var_op, writers) -> Tuple[Update, ...]:
        groups: Dict[str, List[tf.Operation]] = {}
        for op, pos in writers:
            if pos != 0 or op not in self.after_grad:
                continue  # initializers, restores, or this variable used as another's slot
            scope = _update_scope(op.name, var_op.name)
            key = scope or op.name
            if key not in groups:
                groups[key] = self.by_prefix.with_prefix(scope) if scope else [op]
        updates = []
        for key, ops in groups.items():
            scope = key if key.endswith("/") else ""
            if len(ops) == 1 and ops[0].type in CONDS:
                updates.append(self._cond_update(var_op, ops[0]))
            else:
                updates.append(self._update(var_op, scope, ops))
        return tuple(updates)

    def _cond_update(self, var_op, cond: tf.Operation) -> Update:
        """The update of `var_op` made in a branch of the TF2 `tf.cond` `cond` (an If op):
        the branch's ops that write the variable, their slots and the cond's inputs their
        values come from, whose nearest gradient is the raw one."""
        handle_args = [i - 1 for i, t in enumerate(cond.inputs)
                       if i > 0 and t is var_op.outputs[0]]
        types, slots, entries = [], [], []
        for attr in ("then_branch", "else_branch"):
            fdef = self._functions().get(cond.get_attr(attr).name)
            if fdef is None:
                continue
            args = [a.name for a in fdef.signature.input_arg]
            nodes = {n.name: n for n in fdef.node_def}
            aliases = {args[k] for k in handle_args}
            for n in fdef.node_def:  # Identity chains of the handle
                if n.op in PASS_THROUGH and n.input and n.input[0] in aliases:
                    aliases.update((n.name, n.name + ":output:0"))
            writers = [n for n in fdef.node_def if n.op in WRITES and n.input
                       and n.input[0] in aliases]
            if not writers:
                continue
            # The optimizer's ops of this update: its `update_<var>/` scope (a sparse
            # Adam scatters the gradient into its slots, then updates the variable from them).
            marker = "update_" + var_op.name + "/"
            scoped = [n for n in fdef.node_def if n.op in WRITES and marker in n.name]
            for n in scoped if any(marker in w.name for w in writers) else writers:
                inputs = [i for i in n.input if not i.startswith("^")]
                types.append(n.op)
                k = WRITES[n.op]
                slots.extend(cond.inputs[1 + args.index(i)].op.name for i in inputs[:k]
                             if i in args)
                stack, seen = list(inputs[k:]), set()
                while stack:  # back to the branch's arguments: the cond's inputs
                    name = stack.pop().split(":")[0]
                    if name in seen:
                        continue
                    seen.add(name)
                    if name in args:
                        t = cond.inputs[1 + args.index(name)]
                        if t.op in self.after_grad:
                            entries.append(t)
                    elif name in nodes:
                        stack.extend(i.lstrip("^") for i in nodes[name].input)
        gradient = self._raw_gradient(var_op, list(dict.fromkeys(entries)), [cond], {cond})
        return Update(ops=(cond.name,), op_types=tuple(dict.fromkeys(types)), scope="",
                      gradient=gradient,
                      slots=tuple(dict.fromkeys(s for s in slots if s != var_op.name)),
                      conditional=True)

    def _update(self, var_op, scope, ops) -> Update:
        members = set(ops)
        entries, slots = [], []
        conditional = False
        for op in ops:
            n = WRITES.get(op.type, 0)
            for i, t in enumerate(op.inputs):
                if i < n:
                    written = _through_switches(t)
                    conditional |= written is not t
                    if written.op is not var_op and written.op.type in VARIABLE_OP_TYPES:
                        slots.append(written.op.name)
                elif op.type in _SWITCHES and i == 1:
                    continue  # a cond's predicate says whether, not what
                elif t.op not in members and t.op in self.after_grad:
                    entries.append(t)
        writer_ops = [op for op in ops if op.type in WRITES]
        gradient = self._raw_gradient(var_op, entries, writer_ops, members)
        return Update(ops=tuple(op.name for op in writer_ops),
                      op_types=tuple(dict.fromkeys(op.type for op in writer_ops)),
                      scope=scope, gradient=gradient,
                      slots=tuple(dict.fromkeys(s for s in slots if s != var_op.name)),
                      conditional=conditional)

    def _raw_gradient(self, var_op, entries: Sequence[tf.Tensor], writer_ops,
                      members) -> Gradient:
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
                data = t.op.inputs[:1] if t.op.type in _SWITCHES else t.op.inputs
                queue.extend((i, d + 1) for i in data)
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
            final_values = _entry(entries, lambda t: t.dtype == dtype
                                  and t.shape.is_compatible_with(row_shape), values)
            final_indices = _entry(entries, lambda t: t.dtype.is_integer and t.shape.rank == 1,
                                   indices)
            row_sums, inexact, nonlinear = self._row_post_processing(
                var_op, values, indices, final_indices, members)
            return Gradient("sparse", values.name, indices.name,
                            post_processed=found[values] > 0 or final_indices is not indices,
                            values_shape=_shape(values), final_values=final_values.name,
                            final_indices=final_indices.name, row_sums=row_sums,
                            inexact=inexact, nonlinear=nonlinear)
        dense = _nearest(var_op, {t: d for t, d in found.items() if t.dtype == dtype
                                  and t.shape.is_compatible_with(shape)}, "gradient", where)
        final = _entry(entries, lambda t: t.dtype == dtype and t.shape.is_compatible_with(shape),
                       dense)
        return Gradient("dense", dense.name, post_processed=found[dense] > 0,
                        values_shape=_shape(dense), final_values=final.name)


_ROW_WISE = frozenset({  # element-wise ops: row i of the output depends on row i of inputs only
    "Identity", "Cast", "Neg", "Square", "Sqrt", "Rsqrt", "Abs", "Sign", "Reciprocal", "Exp",
    "Log", "Log1p", "Tanh", "Sigmoid", "Relu", "Relu6", "Floor", "Ceil", "Round",
    "Mul", "RealDiv", "Div", "DivNoNan", "MulNoNan", "AddV2", "Add", "Sub", "Pow",
    "Maximum", "Minimum", "SquaredDifference", "ClipByValue", "CheckNumerics",
    "StopGradient", "PreventGradient", "EnsureShape"})
_ROW_SUMS = frozenset({"L2Loss", "Sum"})  # reductions that may sum over the rows
# Row-wise ops linear in the rows: f(a + b) = f(a) + f(b), so a duplicate id's rows may be
# summed before them. A product or quotient is linear in a row input times (or over) a
# tensor that does not depend on the rows; a sum or difference, when both inputs are rows.
_LINEAR = frozenset({"Identity", "Cast", "Neg", "CheckNumerics", "StopGradient",
                     "PreventGradient", "EnsureShape"})
_LINEAR_SCALINGS = frozenset({"Mul", "MulNoNan", "RealDiv", "Div", "DivNoNan"})
_LINEAR_SUMS = frozenset({"AddV2", "Add", "Sub"})


def _linear_in_rows(op: tf.Operation, rows) -> bool:
    """Whether the row-wise `op` is linear in its inputs that are gradient rows."""
    if op.type in _LINEAR:
        return True
    from_rows = [t in rows for t in op.inputs]
    if op.type in _LINEAR_SCALINGS:  # rows * c, c * rows, rows / c
        return sum(from_rows) == 1 and (op.type in ("Mul", "MulNoNan") or from_rows[0])
    if op.type in _LINEAR_SUMS:
        return all(from_rows)
    return False
_INDEX_PASS = frozenset({"Identity", "Cast"})
_SWITCHES = ("Switch", "RefSwitch")


def _cond_handles(var_op: tf.Operation) -> List[tf.Tensor]:
    """A variable's handle (or ref) and its copies into TF1 `tf.cond` branches (the
    outputs of Switches of it, nested conds included)."""
    out, stack = [], [var_op.outputs[0]]
    while stack:
        t = stack.pop()
        if t in out:
            continue
        out.append(t)
        stack.extend(o for c in t.consumers() if c.type in _SWITCHES and c.inputs[0] is t
                     for o in c.outputs)
    return out


def _through_switches(t: tf.Tensor) -> tf.Tensor:
    """The tensor a chain of TF1 cond Switches passes on as `t` (`t` if none)."""
    while t.op.type in _SWITCHES:
        t = t.op.inputs[0]
    return t


def _passes_to(t: tf.Tensor, source: tf.Tensor) -> bool:
    """Whether `t` is `source` passed on unchanged (identities and casts)."""
    while t is not source and t.op.type in _INDEX_PASS:
        t = t.op.inputs[0]
    return t is source


def _entry(entries: Sequence[tf.Tensor], fits, raw: tf.Tensor) -> tf.Tensor:
    """The tensor among an update's inputs that carries the (post-processed) gradient."""
    if raw in entries:
        return raw
    matching = list(dict.fromkeys(t for t in entries if fits(t)))
    return matching[0] if len(matching) == 1 else raw


def _broadcasts_over_rows(other: tf.Tensor, rows: tf.Tensor) -> bool:
    """`other` is the same for every row: lower rank than the rows, or one row."""
    if other.dtype == tf.resource:
        return False
    shape = other.shape
    if shape.rank is None or rows.shape.rank is None:
        return False
    return shape.rank < rows.shape.rank or shape[0] == 1


def _inexact(var_op, op, why) -> str:
    return (f"the gradient of {var_op.name!r} is post-processed by op {op.name!r} ({op.type}) "
            f"in a way tfpar cannot reproduce exactly on the parameter servers: {why}. "
            "Post-process sparse gradients with row-wise ops and sums over rows (scaling, "
            "tf.clip_by_norm, tf.clip_by_global_norm), or train this variable with "
            "tfpar.Config(run_mode='AR')")


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
            "update. In-graph towers (a model built once per GPU, their gradients averaged, "
            "as TF's multi-GPU CIFAR-10 tutorial does) are what horovodrun replaces: build "
            "the model once and start a process per GPU (horovodrun -np <GPUs>)")
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
