"""The sharded rewrite: sparse variables whose rows are split over the workers (route
"sharded"), exchanged by all-to-all, as TorchRec's row-wise sharding and HugeCTR's SOK.

For every variable with route "sharded" (and its optimizer slots, split alike), on worker r:

- the worker holds rows [lo, hi) of the plan's row tiling (`rows_over`) as a variable of
  its own (initial value: worker 0's whole initial value, sliced), in collection `TILES`,
  so checkpoints, fetches and restores see the whole variable as they see a tiled one
  (`tiled.whole`, `tiled.tile_of`); the whole variable is never made;
- a lookup (a gather of the variable's rows) de-duplicates its ids, sends each to the
  worker that owns its row (one Horovod all-to-all), gathers the rows asked of it from
  its own and sends them back (a second all-to-all), and expands them back to the ids;
- the user's backward of the lookup is left as it is; its rows are scaled by 1/N when
  averaging and post-processed on each worker as the user's graph says (clipping,
  scaling), every sum over rows in that (a global norm) summed over the workers, as the
  PS route does; the final rows are summed by id, sent to the rows' owners (a third and
  fourth all-to-all: ids, rows) and summed again by id there (several workers' rows);
- each owner applies a copy of the user's own update ops (the same optimizer and
  hyper-parameters; TensorFlow's duplicate-summing included) to its rows and slots, with
  ids made local to its range. Every worker thus updates its own rows as a single device
  would update them with the gradient of the concatenated batch.

No parameter server and no TensorFlow server take part: only Horovod's collectives.
Not yet: reads of the variable other than lookups in the training step (an EMA of it,
a whole read), local (per-host) de-duplication.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf

from tfpar.errors import NotYetSupportedError, TfparError
from tfpar.graph.naming import safe_name
from tfpar.plan import Plan, VariablePlan
from tfpar.transform import collectives, surgery
from tfpar.transform.tiled import TILES, new_tile

_GATHERS = ("ResourceGather", "GatherV2", "Gather")
# Uses of the variable that the training step does not run, or whose value we give.
_IGNORED = ("VarIsInitializedOp", "DestroyResourceOp", "IsVariableInitialized",
            "DisableCopyOnRead")


@dataclasses.dataclass
class ShardedRewrite:
    """What the rewrite made: {variable name: this worker's rows}, the new update ops."""

    tiles: Dict[str, tf.Variable]
    updates: List[tf.Operation]


def apply_sharding(graph: tf.Graph, plan: Plan, rank: int,
                   counter=None) -> Optional[ShardedRewrite]:
    """Rewrites `graph` in place for the plan's route "sharded" (module doc). `counter`:
    the traffic counter of path "sharded" (`Traffic.counter`)."""
    sharded = [v for v in plan.variables if v.route == "sharded" and v.slot_of is None]
    if not sharded:
        return None
    by_name = {v.name: v for v in plan.variables}
    made: Dict[str, tf.Variable] = {}
    updates: List[tf.Operation] = []
    with graph.as_default():
        for v in sharded:
            _Sharded(graph, plan, v, by_name, rank, counter).rewrite(made, updates)
        for key in (tf.compat.v1.GraphKeys.GLOBAL_VARIABLES,
                    tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES):
            ref = graph.get_collection_ref(key)
            ref[:] = [x for x in ref if x.op.name not in made]
    return ShardedRewrite(made, updates)


class _Sharded:
    """One sharded variable's rewrite on worker `rank`."""

    def __init__(self, graph, plan: Plan, v: VariablePlan, by_name, rank: int, counter):
        self.g, self.v, self.rank, self.counter = graph, v, rank, counter
        self.n = plan.num_workers
        self.by_name = by_name
        self.var_op = graph.get_operation_by_name(v.name)
        self.resource = self.var_op.type == "VarHandleOp"
        self.starts = [v.tiling.tile_ranges(v.shape, d)[0][0] for d in range(self.n)]
        self.lo, self.hi = v.tiling.tile_ranges(v.shape, rank)[0]
        self.scope = f"tfpar/sharded/{safe_name(v.name)}"
        self.exchanges = 0  # all-to-alls built (names must match on every worker)

    # -- main --------------------------------------------------------------------------------
    def rewrite(self, made, updates):
        v = self.v
        with tf.compat.v1.name_scope(None):
            self.part = new_tile(self.g, self.var_op, v.tiling, tuple(v.shape), self.rank,
                                  f"{self.scope}/rows")
        made[v.name] = self.part
        update_ops = self._update_ops()
        self._rewire_reads(update_ops)
        for i, g in enumerate(v.gradients):
            updates.append(self._replace_update(i, g, update_ops[i], made))

    def _update_ops(self) -> List[List[tf.Operation]]:
        out = []
        for g in self.v.gradients:
            if g.scope:
                out.append([op for op in self.g.get_operations() if op.name.startswith(g.scope)])
            else:
                out.append([self.g.get_operation_by_name(n) for n in g.ops])
        return out

    # -- forward -----------------------------------------------------------------------------
    def _rewire_reads(self, update_ops):
        """Every lookup of the variable in the step now asks the rows' owners."""
        skip = {op for ops in update_ops for op in ops}
        handle = self.var_op.outputs[0]
        training = _training_ops(self.g, self.by_name)
        shape_of = lambda op: tf.constant(list(self.v.shape), dtype=op.get_attr("out_type"))
        for c in list(handle.consumers()):
            if c in skip or c.type in _IGNORED or c not in training:
                continue  # the initialiser, a Saver's read: never run by a training step
            if c.type == "ResourceGather" and c.inputs[0] is handle:
                self._lookup(c)
            elif c.type == "VariableShape":
                surgery.replace_uses(c.outputs[0], shape_of(c))
            elif c.type in ("Identity", "RefIdentity", "ReadVariableOp"):
                read = c.outputs[0]
                for x in list(read.consumers()):
                    if x in skip or x not in training:
                        continue
                    if x.type in _GATHERS and x.inputs[0] is read and _axis_zero(x):
                        self._lookup(x)
                    elif x.type == "Shape":
                        surgery.replace_uses(x.outputs[0], shape_of(x))
                    else:
                        self._refuse(x)
            else:
                self._refuse(c)

    def _refuse(self, op):
        raise NotYetSupportedError(
            f"variable {self.v.name!r} is read by op {op.name!r} ({op.type}) in the training "
            "step; route 'sharded' supports lookups of its rows (embedding_lookup, gather) "
            "only: use sparse_route 'ps' for it")

    def _lookup(self, gather: tf.Operation):
        """Replaces `gather`'s rows with the owners' rows, fetched by all-to-all."""
        ids = gather.inputs[1]
        with tf.compat.v1.name_scope(f"{self.scope}/lookup/"):
            flat = tf.reshape(ids, [-1])
            unique, where = tf.unique(flat)
            sorted_ids, splits, order = self._by_owner(unique)
            asked, asked_splits = self._all_to_all(sorted_ids, splits, "ids")
            local = tf.cast(asked, tf.int64) - self.lo
            rows = tf.gather(self.part.read_value() if self.resource else self.part, local)
            back, _ = self._all_to_all(rows, asked_splits, "rows")
            mine = tf.gather(back, tf.math.invert_permutation(order))
            out = tf.gather(mine, where)
            row_shape = gather.outputs[0].shape[ids.shape.rank:] if ids.shape.rank is not None \
                else None
            out = tf.reshape(out, tf.concat([tf.shape(ids), tf.shape(out)[1:]], 0))
            if row_shape is not None:
                out.set_shape(ids.shape.concatenate(row_shape))
        surgery.replace_uses(gather.outputs[0], out)

    # -- backward and update -----------------------------------------------------------------
    def _prepare(self, i: int, g) -> tf.Tensor:
        """Makes this worker's final rows its exact share of the single-device update's
        (as the PS route does): the raw rows scaled by 1/N when averaging, and every sum
        over rows in the post-processing (a global norm, clip_by_norm's norm) summed over
        the workers, so its scalars (a clipping factor) are the single-device ones. Returns
        the rows the update reads."""
        from tfpar.transform.allreduce import allreduce
        raw = self.g.get_tensor_by_name(g.values)
        final = self.g.get_tensor_by_name(g.final_values or g.values)
        scope = f"{self.scope}/gradient_{i}/"
        new = raw
        if self.v.reduction == "average" and self.n > 1:
            with tf.compat.v1.name_scope(scope):
                new = raw * tf.constant(1.0 / self.n, raw.dtype)
            surgery.replace_uses(raw, new, keep=[new.op])
        for name in g.row_sums if self.n > 1 else ():
            partial = self.g.get_tensor_by_name(name)
            with tf.compat.v1.name_scope(scope + "row_sum/"):
                total = allreduce(partial, False, self.n, None)
            surgery.replace_uses(partial, total, keep=[total.op])
        return new if final is raw else final

    def _replace_update(self, i: int, g, ops: List[tf.Operation], made) -> tf.Operation:
        """The user's update `i`, copied onto this worker's rows with the rows' summed
        gradient from every worker."""
        values = self._prepare(i, g)
        indices = self.g.get_tensor_by_name(g.final_indices or g.indices)
        name = f"{self.scope}/update_{i}"
        with tf.compat.v1.name_scope(f"{name}/exchange/"):
            row_shape = values.shape[1:]
            flat = tf.reshape(values, [-1, row_shape.num_elements()])
            unique, where = tf.unique(tf.reshape(indices, [-1]))
            summed = tf.math.unsorted_segment_sum(flat, where, tf.size(unique))
            sorted_ids, splits, order = self._by_owner(unique)
            got_ids, _ = self._all_to_all(sorted_ids, splits, "grad_ids")
            got_rows, _ = self._all_to_all(tf.gather(summed, order), splits, "grad_rows")
            mine, at = tf.unique(tf.cast(got_ids, tf.int64))
            total = tf.math.unsorted_segment_sum(got_rows, at, tf.size(mine))
            total = tf.reshape(total, tf.concat([[-1], row_shape.as_list()], 0))
            local = tf.cast(mine - self.lo, indices.dtype)
        mapping = {values: total, indices: local,
                   self.var_op.outputs[0]: surgery.variable_input(self.part)}
        used = {t for op in ops for t in op.inputs}
        if values not in used or indices not in used:
            raise NotYetSupportedError(
                f"the update of {self.v.name!r} does not read its gradient directly; route "
                "'sharded' cannot copy it onto the workers' rows: use sparse_route 'ps'")
        for p, owner in self._state(ops):
            if p is self.var_op:
                var = self.part
            else:
                var = new_tile(self.g, p, self.v.tiling, tuple(self.v.shape), self.rank,
                                f"{name}/{safe_name(p.name.rsplit('/', 1)[-1])}_rows")
                made[p.name] = var
                mapping[p.outputs[0]] = surgery.variable_input(var)
            if not self.resource:  # a reference variable's update reads its `read` too
                for c in p.outputs[0].consumers():
                    if c.type == "Identity" and c.outputs[0] in used:
                        mapping[c.outputs[0]] = var.value()
        copies = surgery.clone_ops(ops, mapping, f"{name}/apply/", lambda op, ins: op.device,
                                   strip_prefix=g.scope)
        sinks = [c for o, c in copies.items()
                 if not any(x in copies for t in o.outputs for x in t.consumers())
                 and not any(o in x.control_inputs for x in copies)]
        done = tf.group(*sinks, name=f"{name}/done")
        originals = set(ops)
        copied = set(copies.values())
        for op in self.g.get_operations():
            if op not in copied and op not in originals:
                surgery.replace_control_inputs(op, originals, done)
        return done

    def _state(self, ops):
        """(variable op, None) for the variable and each of its slots the update writes."""
        seen = []
        for op in ops:
            for t in op.inputs:
                p = t.op
                if p.type not in ("VariableV2", "VarHandleOp") or p in seen:
                    continue
                if p is self.var_op:
                    seen.append(p)
                    continue
                plan_slot = self.by_name.get(p.name)
                if plan_slot is not None and plan_slot.slot_of == self.v.name:
                    seen.append(p)
        return [(p, None) for p in seen]

    # -- exchanges ---------------------------------------------------------------------------
    def _by_owner(self, ids: tf.Tensor):
        """(ids sorted by owner, how many each owner gets, the sorting permutation)."""
        ids64 = tf.cast(ids, tf.int64)
        bounds = tf.constant(np.array(self.starts[1:], np.int64))
        owner = tf.searchsorted(bounds, ids64, side="right", out_type=tf.int32)
        order = tf.argsort(owner, stable=True)
        splits = tf.math.bincount(owner, minlength=self.n, maxlength=self.n, dtype=tf.int32)
        return tf.gather(ids64, order), splits, order

    def _all_to_all(self, x: tf.Tensor, splits: tf.Tensor, what: str):
        import horovod.tensorflow as hvd
        self.exchanges += 1
        got, got_splits = hvd.alltoall(collectives.never_folded(x), splits=splits,
                                       name=f"{safe_name(self.v.name)}_{what}_{self.exchanges}",
                                       ignore_name_scope=True)
        if self.counter is not None:  # what arrived from the others, as Horovod reports it
            row = int(np.prod(x.shape.as_list()[1:])) if x.shape.rank > 1 else 1
            others = tf.reduce_sum(got_splits) - got_splits[self.rank]
            bump = self.counter(tf.cast(others, tf.float64) * (row * x.dtype.size), None)
            if bump is not None:
                with tf.control_dependencies([bump]):
                    got = tf.identity(got)
        return got, got_splits


def _axis_zero(gather: tf.Operation) -> bool:
    if gather.type != "GatherV2":
        return True
    axis = tf.get_static_value(gather.inputs[2])
    return axis is not None and int(axis) == 0 and gather.get_attr("batch_dims") == 0


def _training_ops(graph: tf.Graph, by_name) -> set:
    """The ops a training step runs: everything the plan's updates depend on."""
    roots = [graph.get_operation_by_name(n) for v in by_name.values()
             for g in v.gradients for n in g.ops]
    seen, stack = set(), list(roots)
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        stack.extend([t.op for t in op.inputs] + list(op.control_inputs))
    return seen
