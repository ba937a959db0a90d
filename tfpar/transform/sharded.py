"""The sharded rewrite: sparse variables whose rows are split over the workers (route
"sharded"), exchanged by all-to-all, as TorchRec's row-wise sharding and HugeCTR's SOK.

For every variable with route "sharded" (and its optimizer slots, split alike), on worker r:

- the worker holds its rows of the plan's row tiling (`rows_over`: a range of rows, or
  every n-th row from its rank on: `RowOwners`) as a variable of
  its own (initial value: worker 0's whole initial value, sliced), in collection `TILES`,
  so checkpoints, fetches and restores see the whole variable as they see a tiled one
  (`collectives.whole`, `collectives.tile_of`); the whole variable is never made;
- lookups (gathers of the variables' rows, and sparse segment sums of them:
  embedding_lookup_sparse) de-duplicate their ids and send each to the
  worker that owns its row, which gathers the rows asked of it and sends them back:
  every lookup of the step in one all-to-all of ids and one of rows (when their ids do
  not depend on each other's rows), and the rows are expanded back to the ids (with
  local aggregation, `Plan.local_aggregation`, through a worker of the asker's host,
  which asks for the host's unique ids and hands the rows back);
- the user's backward of the lookup is left as it is; its rows are scaled by 1/N when
  averaging and post-processed on each worker as the user's graph says (clipping,
  scaling), every sum over rows in that (a global norm) summed over the workers, as the
  PS route does; the final rows are summed by id and sent to the rows' owners with their
  ids, every gradient of the step in one all-to-all, and summed again by id there (with
  local aggregation, through that worker of the sender's host first, which sums the
  host's rows by id: a row the host's workers share crosses the host's link once each
  way);
- each owner applies a copy of the user's own update ops (the same optimizer and
  hyper-parameters; TensorFlow's duplicate-summing included) to its rows and slots, with
  ids made local to its rows. Every worker thus updates its own rows as a single device
  would update them with the gradient of the concatenated batch.

The user's own writes and reads of the variable outside the training step (an `assign`
of pretrained rows, an evaluation's read) go to the workers' rows (`outside_uses`).

No parameter server and no TensorFlow server take part: only Horovod's collectives.
Not yet: a whole read of the variable in the training step.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf

from tfpar.errors import NotYetSupportedError
from tfpar.graph.analysis import FUNCTIONAL
from tfpar.graph.naming import safe_name
from tfpar.graph.op_index import OpsByPrefix
from tfpar.graph.row_reads import SEGMENT_READS, row_reads, training_ops, upstream
from tfpar.plan import Plan, VariablePlan
from tfpar.transform import collectives, packed, surgery
from tfpar.transform.checked_ids import checked_ids
from tfpar.transform.input_ahead import InputAhead
from tfpar.transform.outside_uses import OutsideUses, initialisers
from tfpar.transform.tiled import TILES, initial_value, new_tile

# Ops that take a variable whole for a function body or a TF1 loop frame or branch.
_CONTROL_FLOW = frozenset(FUNCTIONAL) | {"Enter", "RefEnter", "Switch", "RefSwitch"}



@dataclasses.dataclass
class ShardedRewrite:
    """What the rewrite made: {variable name: this worker's rows}, the new update ops, and
    the input staged a step ahead (`Plan.ids_ahead`; else None)."""

    tiles: Dict[str, tf.Variable]
    updates: List[Tuple[int, tf.Operation]]  # (update group, a new update op)
    ahead: Optional[InputAhead] = None
    # {original tensor or op name: its replacement}: the user's writes and reads of the
    # sharded variables outside the training step (`outside_uses`), for the runner's fetches.
    replaced: Dict[str, object] = dataclasses.field(default_factory=dict)
    # {raw dense gradient: its sum over the workers} (`Plan.allreduce_by_alltoall`: they
    # rode in the gradients' all-to-all; the allreduce rewrite leaves them alone).
    combined: Dict[str, str] = dataclasses.field(default_factory=dict)


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
    exchanges = _Exchanges(plan.num_workers, rank, counter,
                           _hosts(plan) if plan.local_aggregation else None)
    with graph.as_default():
        variables = [_Sharded(graph, plan, v, by_name, rank, exchanges) for v in sharded]
        made.update((s.v.name, s.part) for s in variables)
        lookups = [lk for s in variables for lk in s.find_lookups()]
        ahead = None
        if plan.ids_ahead:  # before the rest reads the batch: they read the staged one
            originals = {lk.gather: lk.ids for lk in lookups}
            ahead = InputAhead(graph, originals.values(), "the lookups of " + ", ".join(
                sorted({lk.owner.v.name for lk in lookups})))
            for lk in lookups:
                lk.ahead = ahead.next_of(originals[lk.gather])
        for s in variables:
            s.copy_averages(made)
        # Lookups of variables split alike with one ids tensor (a sampled softmax's weights
        # and biases) share their exchanges: one all-to-all of the ids, one of their rows.
        # The lookups of variables with the same update groups (Plan.update_groups) go in
        # one exchange; another group's runs may lack their ids (a GAN's real images).
        groups: Dict[tuple, List[_Lookup]] = {}
        for lk in lookups:
            key = (plan.groups_of(lk.owner.v.name), lk.ids.name, lk.owner.owners,
                   lk.owner.part.dtype.base_dtype.name)
            groups.setdefault(key, []).append(lk)
        for k, update_groups in enumerate(sorted({key[0] for key in groups})):
            _lookups([g for key, g in groups.items() if key[0] == update_groups], exchanges,
                     ahead, f"_group_{k}" if k else "")
        if ahead is not None:
            ahead.finish()
        # Every gradient's rows go to their owners in one all-to-all (per dtype), unless
        # one of them waits for an update (a second optimizer's): that one goes alone.
        sends = [s.outgoing(i, g) for s in variables for i, g in enumerate(s.v.gradients)]
        riders = _dense_gradients(graph, plan) if plan.allreduce_by_alltoall else []
        combined = _exchange_gradients(sends, exchanges, _update_ops_of(graph, plan), plan,
                                       riders)
        for send in sends:
            updates.append((send.g.group, send.owner.apply(send, made)))
        replaced: Dict[str, object] = {}
        for s in variables:
            replaced.update(s.rewire_outside_step())
        for key in (tf.compat.v1.GraphKeys.GLOBAL_VARIABLES,
                    tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES):
            ref = graph.get_collection_ref(key)
            ref[:] = [x for x in ref if x.op.name not in made]
    return ShardedRewrite(made, updates, ahead, replaced, combined)


class _Sharded:
    """One sharded variable's rewrite on worker `rank`."""

    def __init__(self, graph, plan: Plan, v: VariablePlan, by_name, rank: int, exchanges):
        self.g, self.v, self.rank, self.exchanges = graph, v, rank, exchanges
        self.n = plan.num_workers
        self.by_name = by_name
        self.var_op = graph.get_operation_by_name(v.name)
        self.resource = self.var_op.type == "VarHandleOp"
        self.owners = RowOwners.of(v.tiling, v.shape)
        self.scope = f"tfpar/sharded/{safe_name(v.name)}"
        with graph.as_default(), tf.compat.v1.name_scope(None):
            self.part = new_tile(graph, self.var_op, v.tiling, tuple(v.shape), rank,
                                 f"{self.scope}/rows")
        self.update_ops = self._update_ops()

    def rows(self, local_ids: tf.Tensor) -> tf.Tensor:
        """This worker's rows at `local_ids` (row numbers within its rows). Gathered from
        the handle: a read of a variable that sparse updates write copies it whole."""
        if self.resource:
            return tf.raw_ops.ResourceGather(resource=self.part.handle, indices=local_ids,
                                             dtype=self.part.dtype.base_dtype)
        return tf.gather(self.part, local_ids)

    def _update_ops(self) -> List[List[tf.Operation]]:
        out = []
        index = OpsByPrefix(self.g)
        for g in self.v.gradients:
            if g.scope:
                out.append(index.with_prefix(g.scope))
            else:
                out.append([self.g.get_operation_by_name(n) for n in g.ops])
        return out

    # -- forward -----------------------------------------------------------------------------
    def find_lookups(self) -> List["_Lookup"]:
        """The lookups of the variable in the training step (its shape reads made
        constants); any other read (`row_reads`: an ExponentialMovingAverage of it, a
        whole read) is refused."""
        skip = {op for ops in self.update_ops for op in ops}
        training = _training_ops(self.g, self.by_name)
        reads = row_reads(self.var_op, skip, training)
        if reads.others:
            self._refuse(*reads.others[0])
        self.averages = reads.averages
        # The user's own writes and reads outside the step, found before the rewrite.
        self.outside = OutsideUses(self.var_op, training | skip | initialisers(self.g) | {
            op for _, _, ops in reads.averages for op in ops})
        for op in reads.shapes:
            surgery.replace_uses(op.outputs[0], tf.constant(list(self.v.shape),
                                                            dtype=op.get_attr("out_type")))
        return [_Lookup(self, op) for op in reads.lookups]

    def rewire_outside_step(self) -> Dict[str, object]:
        """The user's writes and reads of the variable outside the training step, on the
        workers' rows (`outside_uses`)."""
        if not self.outside:
            return {}
        with self.g.as_default():
            return self.outside.rewire(self.part, self.v.tiling, tuple(self.v.shape),
                                       self.rank, self.n, f"{self.scope}/outside")

    def copy_averages(self, made) -> None:
        """Each moving average of the variable (`row_reads`), done on this worker's rows:
        its shadow split alike (as the plan says), updated by a copy of the user's ops
        from the worker's own rows, after the worker's update as before."""
        for writer, shadow, ops in self.averages:
            plan = self.by_name.get(shadow.name)
            if plan is None or plan.route != "sharded" or plan.slot_of != self.v.name:
                self._refuse(writer, "after the training step")
            name = f"{self.scope}/average_{safe_name(shadow.name)}"
            part = self._shadow_rows(shadow, name)
            made[shadow.name] = part
            mapping = {self.var_op.outputs[0]: surgery.variable_input(self.part),
                       shadow.outputs[0]: surgery.variable_input(part)}
            for op in ops:  # a reference variable's `read`, shared with the step
                for t in op.inputs:
                    if t.op not in ops and t.op.type == "Identity" and \
                            t.op.inputs[0].op is self.var_op:
                        mapping[t] = self.part.value()
            copies = surgery.clone_ops(ops, mapping, f"{name}/", lambda op, ins: op.device)
            for old, new in zip(writer.outputs, copies[writer].outputs):
                surgery.replace_uses(old, new)
            copied = set(copies.values())
            for op in self.g.get_operations():
                if op not in copied:
                    surgery.replace_control_inputs(op, [writer], copies[writer])

    def _shadow_rows(self, shadow: tf.Operation, name: str) -> tf.Variable:
        """This worker's rows of a moving average's shadow: initialised from the
        variable's rows where the shadow's initial value is the variable's
        (`initialized_value`), else from its own (worker 0's, sliced)."""
        if not _depends_on([initial_value(shadow)], [self.var_op]):
            return new_tile(self.g, shadow, self.v.tiling, tuple(self.v.shape), self.rank, name)
        with tf.control_dependencies(None), tf.compat.v1.name_scope(None):
            # The rows' initial value itself (initialised in the same run: the same
            # broadcast value).
            return tf.compat.v1.Variable(self.part.initial_value, name=name,
                                         trainable=False, collections=[TILES],
                                         use_resource=self.resource)

    def _refuse(self, op, where="in the training step"):
        # A function call or TF1 loop takes the whole variable, whatever its body reads.
        why = ("a tf.cond, tf.while_loop or function takes it whole, even for a lookup in "
               "its body" if op.type in _CONTROL_FLOW else
               "an ExponentialMovingAverage of it, or another whole read")
        raise NotYetSupportedError(
            f"variable {self.v.name!r} is read by op {op.name!r} ({op.type}) {where} "
            f"({why}); route 'sharded' supports lookups of its rows (embedding_lookup, "
            "gather) outside control flow only: route it to the parameter servers, "
            f"tfpar.Config(sparse_route={{{self.v.name!r}: 'ps'}})")

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

    def outgoing(self, i: int, g) -> "_Send":
        """Update `i`'s final rows summed by id and sorted by owner, to send."""
        values = self._prepare(i, g)
        indices = self.g.get_tensor_by_name(g.final_indices or g.indices)
        with tf.compat.v1.name_scope(f"{self.scope}/update_{i}/exchange/"):
            flat = tf.reshape(values, [-1, values.shape[1:].num_elements()])
            unique, where = tf.unique(tf.reshape(indices, [-1]))
            summed = tf.math.unsorted_segment_sum(flat, where, tf.size(unique))
            sorted_ids, splits, order = _by_owner(unique, self.owners)
        return _Send(self, i, g, values, indices, sorted_ids, tf.gather(summed, order), splits)

    def apply(self, send: "_Send", made) -> tf.Operation:
        """A copy of the user's update `send.i` on this worker's rows and slots, with the
        rows every worker sent here summed by id."""
        i, g, values, indices = send.i, send.g, send.values, send.indices
        ops = self.update_ops[i]
        name = f"{self.scope}/update_{i}"
        with tf.compat.v1.name_scope(f"{name}/exchange/"):
            mine, at = tf.unique(send.got_ids)
            total = tf.math.unsorted_segment_sum(send.got_rows, at, tf.size(mine))
            total = tf.reshape(total, [-1] + values.shape[1:].as_list())
            local = tf.cast(self.owners.local(mine, self.rank), indices.dtype)
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
        # Every op of the update waits for the gradient, as on the other routes: Adam's
        # decay of its slot (an assign that reads no gradient) must not run in a step whose
        # input ended (OutOfRangeError) and trained nothing else.
        for copy in copies.values():
            surgery.add_control_inputs(copy, [total.op])
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

def _training_ops(graph: tf.Graph, by_name) -> set:
    """The ops a training step runs: everything the plan's updates depend on."""
    return training_ops(graph.get_operation_by_name(n) for v in by_name.values()
                        for g in v.gradients for n in g.ops)


@dataclasses.dataclass
class _Lookup:
    """A gather of a sharded variable's rows in the training step."""

    owner: _Sharded
    gather: tf.Operation
    ahead: Optional[tf.Tensor] = None  # the next batch's ids (`Plan.ids_ahead`)

    @property
    def ids(self) -> tf.Tensor:
        return self.gather.inputs[1]


@dataclasses.dataclass(frozen=True)
class RowOwners:
    """Which worker owns each row of a sharded variable, as its plan's tiling says: row
    ranges (`starts`: each worker's first row; tiling `R{n}`) or rows dealt out in turn
    (row i: worker i % n; tiling `M{n}`)."""

    n: int
    starts: Tuple[int, ...] = ()
    cyclic: bool = False

    @classmethod
    def of(cls, tiling, shape) -> "RowOwners":
        n = tiling.devices
        if tiling.cyclic:
            return cls(n, (), True)
        return cls(n, tuple(tiling.tile_ranges(shape, d)[0][0] for d in range(n)))

    def owner(self, ids64: tf.Tensor) -> tf.Tensor:
        """The owner of each id (int64), as int32."""
        if self.cyclic:
            return tf.cast(ids64 % self.n, tf.int32)
        bounds = tf.constant(np.array(self.starts[1:], np.int64))
        return tf.searchsorted(bounds, ids64, side="right", out_type=tf.int32)

    def local(self, ids: tf.Tensor, rank: int) -> tf.Tensor:
        """Worker `rank`'s ids (of rows it owns) as row numbers of its own rows."""
        if self.cyclic:
            return ids // self.n
        return ids - self.starts[rank]


def _by_owner(ids: tf.Tensor, owners: RowOwners):
    """(ids sorted by owner, as int64; how many each owner gets; the sorting permutation)."""
    ids64 = tf.cast(ids, tf.int64)
    owner = owners.owner(ids64)
    order = tf.argsort(owner, stable=True)
    splits = tf.math.bincount(owner, minlength=owners.n, maxlength=owners.n, dtype=tf.int32)
    return tf.gather(ids64, order), splits, order


class _Exchanges:
    """The job's all-to-alls of sharded variables, named in the order every worker builds
    them (Horovod matches collectives by name), their bytes counted on path "sharded"."""

    def __init__(self, n: int, rank: int, counter, hosts=None):
        self.n, self.rank, self.counter = n, rank, counter
        # Local aggregation: every host's ranks (None: off, or no host has two workers).
        self.hosts = hosts if hosts and max(len(h) for h in hosts) > 1 else None

    def to_owners(self, items, name: str, riders=()):
        """Rows with their ids to the workers that own them. items: [(ids sorted by owner
        (int64), their rows [k, width], how many go to each worker, their
        `RowOwners`)], the rows of one dtype. Returns per item (ids, rows) that arrived
        here, and the sum over the workers of each of `riders` (tensors of the rows' dtype
        sent whole to every worker beside the rows, summed in rank order: the same sum on
        every worker; no local aggregation).

        With local aggregation, the rows go first to the worker of this host that collects
        them for their owner (the owner's local rank, modulo the host's workers), which
        sums them by id and sends them on: a row the host's workers share crosses the
        host's link once. Two all-to-alls instead of one."""
        if self.hosts is not None:
            assert not riders, "the plan folds no dense gradient where the hosts aggregate"
            items = self._via_host(items, name)
        if len(items) == 1 and not riders:
            ids, rows, splits, _ = items[0]
            return [self.rows_with_ids(ids, rows, splits, name)], []
        got, sums = self._many([x[:3] for x in items], name, riders)
        return [(ids, rows) for ids, rows, _ in got], sums

    def _to_collectors(self, splits: tf.Tensor):
        """(the permutation that sorts rows sorted by owner by their collector on this
        worker's host: the worker with the owner's local rank, modulo the host's workers;
        how many rows go to each worker)."""
        mine = next(h for h in self.hosts if self.rank in h)
        local = [w - h[0] for h in self.hosts for w in h]  # each owner's local rank
        collector = tf.constant(np.array([mine[k % len(mine)] for k in local], np.int32))
        owner = tf.repeat(tf.range(self.n, dtype=tf.int32), splits)
        order = tf.argsort(tf.gather(collector, owner), stable=True)
        return order, tf.math.unsorted_segment_sum(splits, collector, self.n)

    def _via_host(self, items, name: str):
        """Each item's rows summed by id on the host's collectors (`to_owners`), sorted by
        owner again: what the collectors send on."""
        first = []
        for ids, rows, splits, _ in items:
            order, per_collector = self._to_collectors(splits)
            first.append((tf.gather(ids, order), tf.gather(rows, order), per_collector))
        got = self.many(first, f"{name}_host")
        out = []
        for (ids, rows, _), (_, _, _, owners) in zip(got, items):
            unique, where = tf.unique(ids)
            summed = tf.math.unsorted_segment_sum(rows, where, tf.size(unique))
            sorted_ids, splits, order = _by_owner(unique, owners)
            out.append((sorted_ids, tf.gather(summed, order), splits, owners))
        return out

    def ask(self, items, serve, name: str):
        """Rows from their owners. items: [(ids sorted by owner (int64), how many go to each
        worker, their `RowOwners`)]; serve(k, ids): item k's rows [m, width] at the
        ids that came to this worker, in their order. Returns each item's rows in the
        order of its ids: one all-to-all of ids and one of rows for all items.

        With local aggregation, the ids go first to the host's collector for their owner
        (`to_owners`), which asks for the host's unique ids and hands the rows back: a row
        the host's workers share crosses the host's link once each way, for two more
        all-to-alls within the host."""
        if self.hosts is not None:
            return self._ask_via_host(items, serve, name)
        return self._ask_owners(items, serve, name)

    def ask_ahead(self, now, ahead_items, serve, name: str, ahead: InputAhead):
        """`ask` with the ids a step ahead (`Plan.ids_ahead`; no local aggregation): this
        batch's ids went to their owners in the step before (carried here by
        `InputAhead.carry`), so one all-to-all brings its rows back and takes the next
        batch's ids out. now, ahead_items: per item (ids sorted by owner (int64), how many
        go to each worker), of this batch and of the next; serve(k, ids): item k's rows at
        the ids that came here. Returns each item's rows of this batch, in the order of its
        ids.

        To each worker go, per item, how many next ids it gets (the header), those ids,
        then the rows it asked of this worker (it knows how many: it asked); ids and
        counts ride as the bits of row elements (bitcast, exact)."""
        n, count = self.n, len(now)
        asked = [(ahead.carry(tf.int64, [None], f"{name}_asked_{k}"),
                  ahead.carry(tf.int32, [n], f"{name}_came_{k}"))
                 for k in range(count)]  # what came here a step ago: this batch's ids
        rows = [serve(k, ids) for k, (ids, _) in enumerate(asked)]
        dtype = rows[0].dtype
        if any(r.dtype != dtype for r in rows):
            raise NotYetSupportedError(
                "Config(ids_ahead=True): the sharded variables looked up in one step have "
                f"different dtypes ({', '.join(sorted({r.dtype.name for r in rows}))}); "
                "leave ids_ahead False")
        per = packed.per_int64(dtype)
        widths = [int(r.shape[1]) for r in rows]
        ids_to = [tf.split(packed.as_elements(ids, dtype), splits * per, num=n)
                  for ids, splits in ahead_items]
        rows_to = [tf.split(r, came, num=n) for r, (_, came) in zip(rows, asked)]
        counts = tf.stack([splits for _, splits in ahead_items], axis=1)  # [n, items]
        send = []
        for d in range(n):
            send.append(packed.as_elements(tf.cast(counts[d], tf.int64), dtype))
            send.extend(ids_to[k][d] for k in range(count))
            send.extend(tf.reshape(rows_to[k][d], [-1]) for k in range(count))
        sizes = (count * per + tf.add_n([splits * per for _, splits in ahead_items])
                 + tf.add_n([came * w for (_, came), w in zip(asked, widths)]))
        got, got_sizes = self.run(tf.concat(send, 0), sizes, name)
        chunks = tf.split(got, got_sizes, num=n)
        next_ids, next_came, back = [[] for _ in now], [[] for _ in now], [[] for _ in now]
        for src in range(n):
            header = tf.cast(packed.from_elements(chunks[src][:count * per], dtype), tf.int32)
            mine = tf.stack([splits[src] for _, splits in now])  # rows asked of src
            body = tf.split(chunks[src][count * per:],
                            tf.concat([header * per, mine * tf.constant(widths, tf.int32)], 0),
                            num=2 * count)
            for k in range(count):
                next_ids[k].append(packed.from_elements(body[k], dtype))
                next_came[k].append(header[k])
                back[k].append(tf.reshape(body[count + k], [-1, widths[k]]))
        # Before the first step (and after a restore) no rows are due: the ids alone.
        if count == 1:
            first = [self.run(ahead_items[0][0], ahead_items[0][1], f"{name}_first_ids")]
        else:
            first = [(ids, came) for ids, _, came in self.many(
                [(ids, None, splits) for ids, splits in ahead_items], f"{name}_first_ids")]
        for k in range(count):
            ahead.carry_next(f"{name}_asked_{k}", tf.concat(next_ids[k], 0), first[k][0])
            ahead.carry_next(f"{name}_came_{k}", tf.stack(next_came[k]), first[k][1])
        return [tf.concat(b, 0) for b in back]

    def _ask_owners(self, items, serve, name: str):
        if len(items) == 1:
            ids, splits, _ = items[0]
            asked, came = self.run(ids, splits, f"{name}_ids")
            back, _ = self.run(serve(0, asked), came, f"{name}_rows")
            return [back]
        asked = self.many([(ids, None, splits) for ids, splits, _ in items], f"{name}_ids")
        rows = [serve(k, ids) for k, (ids, _, _) in enumerate(asked)]
        return self.rows_back([(r, came, splits) for r, (_, _, came), (_, splits, _)
                               in zip(rows, asked, items)], f"{name}_rows")

    def _ask_via_host(self, items, serve, name: str):
        first, perms = [], []
        for ids, splits, _ in items:
            order, per_collector = self._to_collectors(splits)
            first.append((tf.gather(ids, order), None, per_collector))
            perms.append(order)
        got = self.many(first, f"{name}_host_ids")
        second, kept = [], []
        for (ids, _, came), (_, _, owners) in zip(got, items):
            unique, where = tf.unique(ids)
            sorted_ids, splits, order = _by_owner(unique, owners)
            second.append((sorted_ids, splits, owners))
            kept.append((where, order, came))
        rows = self._ask_owners(second, serve, name)  # the host's unique ids
        handed = [tf.gather(tf.gather(r, tf.math.invert_permutation(order)), where)
                  for r, (where, order, _) in zip(rows, kept)]
        back = self.rows_back([(r, came, per_collector) for r, (_, _, came), (_, _, per_collector)
                               in zip(handed, kept, first)], f"{name}_host_rows")
        return [tf.gather(r, tf.math.invert_permutation(perm)) for r, perm in zip(back, perms)]

    def run(self, x: tf.Tensor, splits: tf.Tensor, name: str):
        """(what this worker receives, how many rows from each worker)."""
        import horovod.tensorflow as hvd
        got, got_splits = hvd.alltoall(collectives.never_folded(x), splits=splits,
                                       name=f"tfpar_sharded_{name}", ignore_name_scope=True)
        if self.counter is not None:  # what arrived from the others, as Horovod reports it
            row = int(np.prod(x.shape.as_list()[1:])) if x.shape.rank > 1 else 1
            others = tf.reduce_sum(got_splits) - got_splits[self.rank]
            bump = self.counter(tf.cast(others, tf.float64) * (row * x.dtype.size), None)
            if bump is not None:
                with tf.control_dependencies([bump]):
                    got = tf.identity(got)
        return got, got_splits

    def many(self, items, name: str):
        """Several exchanges in one all-to-all. items: [(ids sorted by owner (int64),
        their rows [k, width] or None, how many go to each worker)], the rows of one
        dtype. Each worker is sent, per item, how many it gets, then the ids with their
        rows (ids and counts ride as the bits of extra elements: bitcast, exact). Returns
        per item (ids, rows or None, how many came from each worker)."""
        return self._many(items, name, ())[0]

    def _many(self, items, name: str, riders):
        """`many`, with `riders` (tensors of the rows' dtype) sent whole to every worker
        after the rows and summed over the workers in rank order: (`many`'s, the sums)."""
        n, count = self.n, len(items)
        dtype = next((r.dtype for _, r, _ in items if r is not None), tf.int64)
        per = packed.per_int64(dtype)

        def to_elements(x64):
            return packed.as_elements(x64, dtype)

        def from_elements(e):
            return packed.from_elements(e, dtype)

        widths, pieces = [], []
        for ids, rows, splits in items:
            record = [tf.reshape(to_elements(ids), [-1, per])]
            if rows is not None:
                record.append(tf.reshape(rows, [-1, int(np.prod(rows.shape.as_list()[1:]))]))
            record = record[0] if len(record) == 1 else tf.concat(record, 1)
            widths.append(int(record.shape[1]))
            pieces.append(tf.split(record, splits, num=n))
        counts = tf.stack([splits for _, _, splits in items], axis=1)  # [n, items]
        flat = [tf.reshape(r, [-1]) for r in riders]
        rider_sizes = [tf.size(r, out_type=tf.int32) for r in riders]
        send = []
        for d in range(n):
            send.append(to_elements(tf.cast(counts[d], tf.int64)))
            send.extend(tf.reshape(pieces[k][d], [-1]) for k in range(count))
            send.extend(flat)
        sizes = count * per + tf.add_n([splits * w for (_, _, splits), w in zip(items, widths)])
        if riders:  # every worker gets all of them
            sizes += tf.add_n(rider_sizes)
        got, got_sizes = self.run(tf.concat(send, 0), sizes, name)
        chunks = tf.split(got, got_sizes, num=n)
        records, came = [[] for _ in items], [[] for _ in items]
        ridden = [[] for _ in riders]
        for s in range(n):
            header = tf.cast(from_elements(chunks[s][:count * per]), tf.int32)
            body = tf.split(chunks[s][count * per:], tf.concat(
                [header * tf.constant(widths, tf.int32),
                 tf.stack(rider_sizes) if riders else tf.zeros([0], tf.int32)], 0),
                num=count + len(riders))
            for k in range(count):
                records[k].append(tf.reshape(body[k], [-1, widths[k]]))
                came[k].append(header[k])
            for k, r in enumerate(riders):
                piece = tf.reshape(body[count + k], tf.shape(r))
                piece.set_shape(r.shape)
                ridden[k].append(piece)
        sums = [tf.add_n(every) for every in ridden]  # rank order: the same on every worker
        out = []
        for k, (_, rows, _) in enumerate(items):
            record = tf.concat(records[k], 0)
            ids = from_elements(tf.reshape(record[:, :per], [-1]))
            out.append((ids, None if rows is None else record[:, per:], tf.stack(came[k])))
        return out, sums

    def rows_back(self, items, name: str):
        """The rows asked of this worker, back to the askers, for several lookups in one
        all-to-all. items: [(rows [m, width] in the order the ids came, how many came
        from each worker, how many this worker asked of each)]. Returns the rows of each
        item that came back, in the order this worker sent its ids. Rows of several
        dtypes (a float64 table beside a float32 one) go in one all-to-all per dtype."""
        kinds: Dict[tf.DType, List[int]] = {}
        for k, (rows, _, _) in enumerate(items):
            kinds.setdefault(rows.dtype, []).append(k)
        if len(kinds) > 1:
            out: List[Optional[tf.Tensor]] = [None] * len(items)
            for dtype, ks in kinds.items():  # in the items' order: alike on every worker
                for k, back in zip(ks, self.rows_back([items[k] for k in ks],
                                                      f"{name}_{dtype.name}")):
                    out[k] = back
            return out
        n = self.n
        widths = [int(rows.shape[1]) for rows, _, _ in items]
        pieces = [tf.split(rows, came, num=n) for rows, came, _ in items]
        send = [tf.reshape(pieces[k][d], [-1]) for d in range(n) for k in range(len(items))]
        sizes = tf.add_n([came * w for (_, came, _), w in zip(items, widths)])
        got, got_sizes = self.run(tf.concat(send, 0), sizes, name)
        chunks = tf.split(got, got_sizes, num=n)
        back = [[] for _ in items]
        for s in range(n):
            body = tf.split(chunks[s], tf.stack([asked[s] * w for (_, _, asked), w
                                                 in zip(items, widths)]), num=len(items))
            for k in range(len(items)):
                back[k].append(tf.reshape(body[k], [-1, widths[k]]))
        return [tf.concat(b, 0) for b in back]

    def rows_with_ids(self, ids: tf.Tensor, rows: tf.Tensor, splits: tf.Tensor, name: str):
        """Rows and their int64 ids to the workers `splits` says, in one all-to-all: the ids
        ride along as the bits of extra columns (bitcast, exact). Returns (ids, rows)."""
        if rows.dtype not in (tf.float32, tf.float64):
            got_ids, _ = self.run(ids, splits, f"{name}_ids")
            got_rows, _ = self.run(rows, splits, f"{name}_rows")
            return got_ids, got_rows
        id_columns = tf.reshape(tf.bitcast(ids, rows.dtype), [-1, 8 // rows.dtype.size])
        width = 8 // rows.dtype.size
        got, _ = self.run(tf.concat([id_columns, rows], 1), splits, name)
        got_ids = tf.reshape(tf.bitcast(got[:, :width], tf.int64), [-1])
        return got_ids, got[:, width:]


@dataclasses.dataclass
class _Send:
    """One update's rows on their way to their owners (`got_*`: what arrived here)."""

    owner: _Sharded
    i: int
    g: object  # its GradientPlan
    values: tf.Tensor  # what the user's update reads
    indices: tf.Tensor
    ids: tf.Tensor  # unique ids sorted by owner (int64)
    rows: tf.Tensor  # their summed rows, [k, row elements]
    splits: tf.Tensor  # rows for each worker
    got_ids: Optional[tf.Tensor] = None
    got_rows: Optional[tf.Tensor] = None


def _exchange_gradients(sends: List[_Send], exchanges: "_Exchanges", update_ops, plan: Plan,
                        riders: List[Tuple[tf.Tensor, bool]] = ()) -> Dict[str, str]:
    """Sets every send's `got_*`: the sends of one dtype and update group that wait for no
    update share one all-to-all; the others go one by one. riders: the dense gradients
    (and whether to average them) that ride in the first shared all-to-all
    (`Plan.allreduce_by_alltoall`); returns {raw gradient: its sum over the workers}."""
    together: Dict[str, List[_Send]] = {}
    for send in sends:
        alone = _depends_on([send.values, send.indices], update_ops)
        key = (f"{send.rows.dtype.name}_{send.g.group}" if not alone
               else f"alone_{len(together)}")
        together.setdefault(key, []).append(send)
    carrier = next((key for key in together if not key.startswith("alone_")), None)
    if riders:
        raws = [raw for raw, _ in riders]
        if carrier is None or any(raw.dtype != together[carrier][0].rows.dtype
                                  for raw in raws):
            raise NotYetSupportedError(
                "Config(allreduce_by_allgather): the dense gradients cannot ride in the "
                "sharded rows' all-to-all (no gradient of their dtype goes with the step's "
                "other rows); set allreduce_by_allgather=False")
        if _depends_on([t for x in together[carrier] for t in (x.values, x.indices)],
                       [raw.op for raw in raws]):
            raise NotYetSupportedError(
                "Config(allreduce_by_allgather): the sharded rows' gradients are computed "
                "from the dense gradients (a post-processing over every gradient), which "
                "must be summed over the workers first; set allreduce_by_allgather=False")
    combined: Dict[str, str] = {}
    for k, (key, group) in enumerate(together.items()):
        rides = riders if key == carrier else []
        with tf.compat.v1.name_scope(f"tfpar/sharded/gradients_{k}/") as scope:
            got, sums = exchanges.to_owners(
                [(x.ids, x.rows, x.splits, x.owner.owners) for x in group],
                f"gradients_{k}", [raw for raw, _ in rides])
        for send, (ids, rows) in zip(group, got):
            send.got_ids, send.got_rows = ids, rows
        for (raw, average), total in zip(rides, sums):
            with tf.compat.v1.name_scope(scope):
                new = total / tf.constant(exchanges.n, total.dtype) if average else total
            surgery.replace_uses(raw, new, keep=[c for c in raw.consumers()
                                                 if c.name.startswith(scope)])
            combined[raw.name] = new.name
    return combined


def _dense_gradients(graph: tf.Graph, plan: Plan) -> List[Tuple[tf.Tensor, bool]]:
    """The raw gradients of the plan's dense route (`Plan.allreduce_by_alltoall`), each
    with whether it is averaged."""
    return [(graph.get_tensor_by_name(g.values), v.reduction == "average")
            for v in plan.variables if v.route == "allreduce" for g in v.gradients]


def _lookups(groups: List[List[_Lookup]], exchanges: "_Exchanges",
             ahead: Optional[InputAhead] = None, tag: str = ""):
    """Replaces every lookup group's gathers with the owners' rows: all groups in one
    all-to-all of ids and one of rows when no group's ids depend on another's rows (else
    group by group, in order). With the input a step ahead, the ids went a step earlier:
    the step sends the next batch's and asks for this one's rows alone."""
    gathers = [lk.gather for group in groups for lk in group]
    if len(groups) < 2 or any(_depends_on([group[0].ids], gathers) for group in groups):
        batches = [([group], f"lookup{tag}_{k}") for k, group in enumerate(groups)]
    else:
        batches = [(groups, "lookups" + tag)]
    if ahead is not None and len(batches) > 1:
        raise NotYetSupportedError(
            "Config(ids_ahead=True): the ids of one lookup of a sharded variable are computed "
            "from the rows of another; they cannot go a step ahead: leave ids_ahead False")
    for batch, name in batches:
        with tf.compat.v1.name_scope(f"tfpar/sharded/{name}/"):
            asks, widths = [], {}
            for group in batch:
                first = group[0].owner.v  # the group's variables are split alike
                unique, where = tf.unique(tf.reshape(group[0].ids, [-1]))
                unique = checked_ids(first.name, first.shape[0], unique)
                sorted_ids, splits, order = _by_owner(unique, group[0].owner.owners)
                asks.append((sorted_ids, splits, group[0].owner.owners, where, order))

            def serve(k, ids, batch=batch):
                owner = batch[k][0].owner
                packed, widths[k] = _rows_of(batch[k], owner.owners.local(ids, owner.rank))
                return packed

            if ahead is None:
                back = exchanges.ask([a[:3] for a in asks], serve, name)
            else:
                nexts = []
                for group in batch:
                    unique, _ = tf.unique(tf.reshape(group[0].ahead, [-1]))
                    sorted_ids, splits, _ = _by_owner(unique, group[0].owner.owners)
                    nexts.append((sorted_ids, splits))
                back = exchanges.ask_ahead([a[:2] for a in asks], nexts, serve, name, ahead)
            for k, (group, rows, ask) in enumerate(zip(batch, back, asks)):
                _expand(group, rows, widths[k], ask[3], ask[4])


def _rows_of(group: List[_Lookup], local: tf.Tensor):
    """(the group's rows at `local` side by side, [m, sum of widths]; the widths)."""
    widths, columns = [], []
    for lk in group:
        rows = lk.owner.rows(local)
        width = int(np.prod(rows.shape.as_list()[1:]))
        widths.append(width)
        columns.append(tf.reshape(rows, [-1, width]))
    return (columns[0] if len(columns) == 1 else tf.concat(columns, 1)), widths


def _expand(group: List[_Lookup], back: tf.Tensor, widths, where, order):
    """The rows that came back (in the order of the ids sent), un-sorted, expanded to the
    ids, split per variable: what the group's gathers returned."""
    ids = group[0].ids
    mine = tf.gather(back, tf.math.invert_permutation(order))
    every = tf.gather(mine, where)
    pieces = [every] if len(group) == 1 else tf.split(every, widths, axis=1)
    for lk, piece in zip(group, pieces):
        if lk.gather.type in SEGMENT_READS:
            surgery.replace_uses(lk.gather.outputs[0], _segment_reduction(lk, piece))
            continue
        row_shape = lk.gather.outputs[0].shape[ids.shape.rank:]
        out = tf.reshape(piece, tf.concat([tf.shape(ids), row_shape.as_list()], 0)
                         if row_shape.is_fully_defined() and row_shape.rank
                         else tf.shape(ids))
        out.set_shape(lk.gather.outputs[0].shape)
        surgery.replace_uses(lk.gather.outputs[0], out)


def _segment_reduction(lk: "_Lookup", rows: tf.Tensor) -> tf.Tensor:
    """The lookup's sparse segment reduction over the rows of its ids that came back (in
    the ids' order: the same sums in the same order as over the whole variable)."""
    op = lk.gather
    ids = op.inputs[1]
    kwargs = {"data": tf.reshape(rows, [-1] + list(lk.owner.v.shape[1:])),
              "indices": tf.range(tf.size(ids, out_type=ids.dtype), dtype=ids.dtype),
              "segment_ids": op.inputs[2]}
    if op.type.endswith("WithNumSegments"):
        kwargs["num_segments"] = op.inputs[3]
    if "sparse_gradient" in op.node_def.attr:
        kwargs["sparse_gradient"] = op.get_attr("sparse_gradient")
    out = getattr(tf.raw_ops, op.type)(**kwargs)
    out.set_shape(op.outputs[0].shape)
    return out


def _hosts(plan: Plan) -> List[List[int]]:
    """Every host's ranks (consecutive, in the plan's host order)."""
    out, first = [], 0
    for _, slots in plan.hosts:
        out.append(list(range(first, first + slots)))
        first += slots
    return out


def _depends_on(tensors, ops) -> bool:
    """Whether any of `tensors` is computed from (or waits for) any op in `ops`."""
    targets = set(ops)
    return bool(targets) and not targets.isdisjoint(upstream(t.op for t in tensors))


def _update_ops_of(graph: tf.Graph, plan: Plan) -> List[tf.Operation]:
    """The ops that write the plan's trained variables (every update)."""
    return [graph.get_operation_by_name(n) for v in plan.variables for g in v.gradients
            for n in g.ops]
