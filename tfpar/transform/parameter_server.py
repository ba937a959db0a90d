"""The PS rewrite: variables of the plan's "ps" route live in parts on the parameter servers.

Per step, for each such variable (synchronous, as single-device training; see `_apply_own`
for asynchronous training, `Plan.sync` False):

1. forward: the worker reads only the rows it needs: the unique ids of each lookup are
   split by part and gathered on the part's PS (a dense read pulls the whole part);
2. the worker scales its gradient to its share of the single-device gradient (1/N for
   averaging) and runs the user's post-processing (clipping, scaling) on it, with every sum
   over the gradient's rows (a global norm's L2Loss) summed over workers first; the result,
   what the update reads, is combined on the worker (duplicate ids summed), split by part
   and pushed into accumulators (SUM) on the PS tasks: into the host's local accumulator
   when local aggregation is on, whose sum the host's first worker forwards to the owner.
   A dense gradient that is post-processed (PS mode) is averaged by allreduce first, so the
   chief post-processes the whole gradient itself and nothing is pushed;
3. the chief takes each part's sum and runs a copy of the user's own optimizer update ops
   on the part (its variable and slot parts), on the PS;
4. then it puts one token in every other worker's queue; a worker ends its step by taking
   its token, so step k+1 always reads what step k wrote.

The accumulators drop gradients older than their step, so every worker counts its steps
(`tfpar/sync/step`) and pushes with that count.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import tensorflow as tf

from tfpar.graph.analysis import FUNCTIONAL, WRITES, reachable
from tfpar.graph.op_index import OpsByPrefix
from tfpar.graph.row_reads import is_restore
from tfpar.errors import NotYetSupportedError, TfparError
from tfpar.plan import PartPlan, Plan, VariablePlan
from tfpar.transform import partial_writes, surgery
from tfpar.graph.naming import scope_name
from tfpar.transform.checked_ids import checked_ids
from tfpar.transform.stages import Markers
from tfpar.transform.traffic import Traffic, nbytes

PS_VARIABLES = "tfpar_ps_variables"  # collection of the part variables (the chief initialises)
_DEAD_CONSUMERS = ("VarIsInitializedOp", "DestroyResourceOp", "IsVariableInitialized",
                   "DisableCopyOnRead")
_GATHERS = ("GatherV2", "Gather")
_ASSIGNS = ("Assign", "AssignVariableOp", "AssignAdd", "AssignSub", "AssignAddVariableOp",
            "AssignSubVariableOp")
# The fix named where a use of a variable cannot go to the parameter servers.
_ANOTHER_ROUTE = ("take {name!r} off the parameter servers: run_mode='HYBRID' with "
                  "sparse_route={{{name!r}: 'sharded'}} (or 'allgather'; a dense variable "
                  "takes the allreduce there), or run_mode='AR'")


def ps_device(task: int) -> str:
    return f"/job:ps/task:{task}/device:CPU:0"


def worker_device(rank: int) -> str:
    return f"/job:worker/task:{rank}"


@dataclasses.dataclass
class PsRewrite:
    """What the runner needs from the rewrite."""

    reads: Dict[str, tf.Tensor]  # variable name -> its whole value, read from its parts
    replaced: Dict[str, tf.Tensor]  # original tensor name -> the tensor that replaced it
    pushes: Dict[str, tf.Variable]  # "var/part_k" -> count of pushes its PS received (chief)
    init: tf.Operation  # initialises the parts (run by the chief only)
    # end a training step, one per update group (Plan.update_groups): what the original
    # updates' users now wait for
    steps: Dict[int, tf.Operation]
    release: tf.Operation  # frees this rewrite's variables on the PS (after a search trial)
    # variable name -> [(part variable, its PartPlan)] (for checkpoints, late reads)
    parts: Dict[str, list] = dataclasses.field(default_factory=dict)


def whole_of(values: List[tf.Tensor], parts: List[PartPlan]) -> tf.Tensor:
    """A variable's whole value from its parts' `values`: row ranges one after the other;
    rows dealt out modulo put back in their order."""
    if len(values) == 1:
        return values[0]
    if all(p.step == 1 for p in parts):
        return tf.concat(values, 0)
    return tf.dynamic_stitch([tf.range(p.start, p.stop, p.step) for p in parts], values)


def piece_of(value: tf.Tensor, part: PartPlan) -> tf.Tensor:
    """Part `part`'s rows of a whole value."""
    rows = part.rows()
    return value if rows is None else value[rows]


def apply_parameter_server(graph: tf.Graph, plan: Plan, rank: int, traffic: Traffic,
                           prefix: str = "tfpar", markers: Optional[Markers] = None
                           ) -> PsRewrite:
    """Rewrites `graph` (in place) for worker `rank` so the plan's "ps" variables live on the PS.

    `prefix` names the state this rewrite shares on the parameter servers (parts,
    accumulators, queues); runners of one job that follow each other use different ones.
    `markers`: where the synchronous step marks its stages (reads, collectives, pushes,
    the chief's update or the token) for the liveness probe.
    """
    return _Rewriter(graph, plan, rank, traffic, prefix, markers).run()


class _Rewriter:
    def __init__(self, graph, plan: Plan, rank: int, traffic: Traffic, prefix: str,
                 markers: Optional[Markers] = None):
        self.g, self.plan, self.rank, self.traffic = graph, plan, rank, traffic
        self.markers = markers
        self.step_reads: List[tf.Tensor] = []  # what the forward reads from the PS
        self.prefix = prefix
        self.worker = worker_device(rank)
        self.host = plan.host_of_rank(rank)
        self.ps_vars = [v for v in plan.variables if v.route == "ps" and v.slot_of is None]
        self.slots = {v.name: [s for s in plan.variables if s.slot_of == v.name]
                      for v in self.ps_vars}
        self.parts: Dict[str, List[tf.Variable]] = {}
        self.replaced: Dict[str, tf.Tensor] = {}
        self.reads: Dict[str, tf.Tensor] = {}
        self.pushes: Dict[str, tf.Variable] = {}
        self.final: Dict[tuple, tf.Tensor] = {}  # (variable, update) -> values the update reads
        self.final_indices: Dict[tuple, tf.Tensor] = {}
        self.combined_first = set()  # (variable, update): dense, averaged before post-processing
        # every worker runs these each step of their update group (Plan.update_groups)
        self.collectives: Dict[int, List[tf.Tensor]] = {}

    # -- main --------------------------------------------------------------------------------
    def run(self) -> PsRewrite:
        with self.g.as_default():
            originals = {v.op.name: v for v in self.g.get_collection(
                tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)}
            for v in self.ps_vars:
                for p in [v] + self.slots[v.name]:
                    self._make_parts(p, originals)
            for v in self.ps_vars:
                scope_ops = self._update_ops(v)
                for p in [v] + self.slots[v.name]:
                    self._rewire_consumers(p, originals, scope_ops)
            self._prepare_gradients()
            # Nothing may stay colocated with a variable that no longer runs anywhere.
            surgery.drop_colocation(self.g, [p.name for v in self.ps_vars
                                             for p in [v] + self.slots[v.name]])
            # One servers' step per update group: a GAN's generator and discriminator,
            # trained by turns, each count, push, apply and take tokens on their own.
            groups: Dict[int, List[tuple]] = {}  # group -> its updates (variable, index)
            for v in self.ps_vars:
                for i, g in enumerate(v.gradients):
                    groups.setdefault(g.group, []).append((v, i))
            done = {}
            for group, updates in sorted(groups.items()):
                tag = f"_group_{group}" if group else ""
                with tf.device(self.worker), tf.compat.v1.name_scope("tfpar/sync/"):
                    step_var = tf.compat.v1.get_local_variable(
                        "tfpar/sync/step" + tag, shape=[], dtype=tf.int64, use_resource=True,
                        initializer=tf.compat.v1.zeros_initializer())
                    step = step_var.read_value()
                with self.traffic.of_group(group):
                    done[group] = self._sync(step, step_var, group, updates, tag)
            on_ps = self.g.get_collection(PS_VARIABLES)
            init = tf.compat.v1.variables_initializer(on_ps, name="tfpar/ps/init")
            frees = []
            for var in on_ps:
                if not hasattr(var, "handle"):
                    continue  # a reference variable's part: TensorFlow has no op to free one
                with tf.device(var.device):
                    frees.append(tf.raw_ops.DestroyResourceOp(resource=var.handle,
                                                              ignore_lookup_error=True))
            release = tf.group(*frees, name="tfpar/ps/release")
        parts = {v.name: list(zip(self.parts[v.name], v.parts))
                 for v in self.ps_vars + [s for ss in self.slots.values() for s in ss]}
        return PsRewrite(self.reads, self.replaced, self.pushes, init, done, release, parts)

    # -- storage -------------------------------------------------------------------------------
    def _make_parts(self, v: VariablePlan, originals):
        orig = originals.get(v.name)
        if orig is None:
            raise TfparError(f"variable {v.name!r} is not in the graph's global variables")
        init_value = self.g.get_tensor_by_name(orig.initial_value.name)
        resource = self.g.get_operation_by_name(v.name).type == "VarHandleOp"
        parts = []
        for k, part in enumerate(v.parts):
            with tf.device(self.worker):
                value = piece_of(init_value, part)
            # A reference variable's parts are reference variables: its update ops (Apply*,
            # Scatter*, Assign*) are copied onto them as they are.
            with tf.device(ps_device(part.ps_task)):
                parts.append(tf.compat.v1.Variable(
                    value, name=f"{self.prefix}/ps/{v.name}/part_{k}", trainable=False,
                    use_resource=resource, collections=[PS_VARIABLES],
                    dtype=orig.dtype.base_dtype))
        self.parts[v.name] = parts
        # The original no longer exists anywhere: keep it out of initialisers and savers.
        for key in (tf.compat.v1.GraphKeys.GLOBAL_VARIABLES,
                    tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES):
            ref = self.g.get_collection_ref(key)
            ref[:] = [x for x in ref if getattr(x, "op", None) is None or x.op.name != v.name]
        with tf.device(self.worker), tf.compat.v1.name_scope(f"tfpar/read/{v.name}/"):
            self.reads[v.name] = self._read_whole(v)

    def _read_whole(self, v: VariablePlan) -> tf.Tensor:
        values = []
        for var, part in zip(self.parts[v.name], v.parts):
            with tf.device(ps_device(part.ps_task)):
                values.append(var.read_value())
        return whole_of(values, list(v.parts))

    def _update_ops(self, v: VariablePlan, i: int = None) -> List[tf.Operation]:
        """The ops of update `i` of `v` (all its updates when i is None)."""
        if i is None:
            return [op for j in range(len(v.gradients)) for op in self._update_ops(v, j)]
        g = v.gradients[i]
        if g.scope:
            if not hasattr(self, "_ops_by_prefix"):
                self._ops_by_prefix = OpsByPrefix(self.g)
            return self._ops_by_prefix.with_prefix(g.scope)
        return [self.g.get_operation_by_name(n) for n in g.ops]

    # -- forward -------------------------------------------------------------------------------
    def _rewire_consumers(self, v: VariablePlan, originals, update_ops):
        """Every read of the original variable now reads its parts on the PS."""
        var_op = self.g.get_operation_by_name(v.name)
        handle = var_op.outputs[0]
        skip = set(update_ops)
        initializer = originals[v.name].initializer
        whole = []  # the whole value, read once per step where needed

        def read_whole(after=()):
            """The whole value; `after`: ops the original read waited for (e.g. an EMA's
            read after the training step), so the new read waits for them too."""
            if after or not whole:
                with tf.device(self.worker), tf.control_dependencies(list(after)), \
                        tf.compat.v1.name_scope(f"tfpar/{scope_name(v.name)}/read/"):
                    t = self._read_whole(v)
                    t = self.traffic.counted("ps_pull", t, nbytes(t))
                if after:
                    return t
                self.step_reads.append(t)
                whole.append(t)
            return whole[0]

        def shape_of(op):
            with tf.device(self.worker):
                return tf.constant(list(v.shape), dtype=op.get_attr("out_type"))

        # Assignments first: whatever waited for one (a read after it) then waits for
        # the assignment of the parts.
        consumers = sorted(handle.consumers(), key=lambda c: c.type not in _ASSIGNS + tuple(
            partial_writes.TYPES))
        for c in consumers:
            if c in skip or c is initializer or c.type in _DEAD_CONSUMERS:
                continue
            if c.type in _ASSIGNS and c.inputs[0] is handle and not is_restore(c):
                self._rewire_assign(v, c)
                continue
            if c.type in WRITES or c.type in partial_writes.TYPES:
                if c in self._training_ops():
                    raise NotYetSupportedError(
                        f"variable {v.name!r} is written by op {c.name!r} ({c.type}) outside "
                        "its optimizer update; tfpar cannot yet move that write to the "
                        "parameter servers: " + _ANOTHER_ROUTE.format(name=v.name))
                if c.type in partial_writes.TYPES and not is_restore(c):
                    self._rewire_partial_write(v, c, read_whole)
                continue  # a write nothing in training runs (e.g. the saver's restore)
            scope = f"tfpar/{scope_name(v.name)}/{c.type}/"
            if c.type in ("ResourceGather",) + _GATHERS and c.inputs[0] is handle:
                self._replace(c.outputs[0], self._gather(v, c, scope))
            elif c.type == "ReadVariableOp":
                self._replace(c.outputs[0], read_whole(c.control_inputs))
            elif c.type == "VariableShape":
                self._replace(c.outputs[0], shape_of(c))
            elif c.type in ("Identity", "RefIdentity") and not self._resource(v):
                # A reference variable's read (`var/read`): lookups through it gather rows,
                # its shape is static, anything else reads the whole value.
                read = c.outputs[0]
                for x in list(read.consumers()):
                    if x in skip:
                        continue  # the update's own read (TF1's Adam: m * beta1): of its part
                    if x.type in _GATHERS and x.inputs[0] is read:
                        self._replace(x.outputs[0], self._gather(
                            v, x, f"tfpar/{scope_name(v.name)}/{x.type}/"))
                    elif x.type == "Shape":
                        self._replace(x.outputs[0], shape_of(x))
                    else:
                        for i, t in enumerate(x.inputs):
                            if t is read:
                                surgery.replace_input(x, i, read_whole(x.control_inputs))
                self.replaced[read.name] = read_whole()
            elif c.type in FUNCTIONAL and self._initialisation_only(c, originals):
                if not self._resource(v):  # its inputs are evaluated (a ref's is read) first:
                    initial = self.g.get_tensor_by_name(originals[v.name].initial_value.name)
                    for i, t in enumerate(c.inputs):  # give it the value it returns then
                        if t is handle:
                            surgery.replace_input(c, i, initial)
                continue  # e.g. an EMA shadow's initial value: reads the initial value then
            elif ((c.type in FUNCTIONAL or c.type == "Switch") and self._resource(v)
                  and len(v.parts) == 1):
                # A loop or function reads the variable inside (an LSTM's weights in a
                # tf.while_loop), or TF1's cond passes its handle into a branch (a batch
                # norm's training=<a tensor>): it gets the handle of the variable's one
                # part on the PS.
                part = self.parts[v.name][0]
                for i, t in enumerate(c.inputs):
                    if t is handle:
                        surgery.replace_input(c, i, part.handle)
                if c.type == "Switch":  # it passes the handle on: where the handle is
                    surgery.place_apart(c, part.handle.device)
            elif (c.type in ("RefSwitch", "Switch", "RefEnter", "Enter")
                  and self._initialisation_only(c, originals)):
                continue  # v1 control flow of an initial value (its branch is not taken)
            elif not self._resource(v) and c.type not in FUNCTIONAL:
                for i, t in enumerate(c.inputs):  # e.g. the saver's SaveV2 reading the ref
                    if t is handle:
                        surgery.replace_input(c, i, read_whole(c.control_inputs))
            else:
                raise NotYetSupportedError(
                    f"variable {v.name!r} is used by op {c.name!r} ({c.type}); tfpar cannot "
                    "yet move such a use to the parameter servers: "
                    + _ANOTHER_ROUTE.format(name=v.name))

    def _rewire_partial_write(self, v: VariablePlan, op: tf.Operation, read_whole):
        """A user's write of part of a PS variable outside the step (`partial_writes`: a
        padding row kept zero by `scatter_update`, a row's `assign`) done on its parts.
        Every worker runs it, so each part gets it from every worker: only a write that
        repeats to the same result (a value, min, max) is right; an add is refused."""
        if not partial_writes.repeatable(op):
            raise NotYetSupportedError(
                f"variable {v.name!r} lives on the parameter servers and op {op.name!r} "
                f"({op.type}) changes part of it outside the optimizer update: every worker "
                "runs it, so the servers would apply it once per worker. Write values "
                "(scatter_update, a slice's assign), or " + _ANOTHER_ROUTE.format(name=v.name))
        if op.type not in partial_writes.ROW_SCATTERS:
            value = partial_writes.new_value(op, read_whole(op.control_inputs))
            self._rewire_assign(v, op, value)
            return
        writes = []
        scope = f"tfpar/{scope_name(v.name)}/{op.type}/"
        for var, part in zip(self.parts[v.name], v.parts):
            lo, hi, step = (0, v.shape[0], 1) if part.stop is None else \
                (part.start, part.stop, part.step)
            with tf.device(self.worker), tf.control_dependencies(op.control_inputs), \
                    tf.compat.v1.name_scope(scope):
                ids, rows = partial_writes.rows_in(op, v.shape[0], lo, hi, (), step)
            with tf.device(ps_device(part.ps_task)), tf.compat.v1.name_scope(scope):
                writes.append(partial_writes.scatter(op, var, ids, rows))
        with tf.device(self.worker):
            done = tf.group(*writes, name=scope + "done")
        if op.outputs:  # a reference variable's scatter returns the new value
            self._replace(op.outputs[0], read_whole([done]))
        self._after_write(op, done)

    def _rewire_assign(self, v: VariablePlan, op: tf.Operation, value=None):
        """A user's `assign` of a whole PS variable (e.g. a learning rate set through a
        placeholder) writes its parts on the parameter servers. Every worker that runs it
        writes the same value, as each would on one device. `assign_add`/`assign_sub` would
        then add once per worker: refused. value: what a partial write leaves (default
        what `op` assigns)."""
        if value is None and op.type not in ("Assign", "AssignVariableOp"):
            raise NotYetSupportedError(
                f"variable {v.name!r} lives on the parameter servers and op {op.name!r} "
                f"({op.type}) adds to it outside the optimizer update: every worker would add "
                "once. Use assign (a value every worker computes alike), or run_mode='AR'")
        value = op.inputs[1] if value is None else value
        assigns, news = [], []
        for var, part in zip(self.parts[v.name], v.parts):
            with tf.device(self.worker), tf.compat.v1.name_scope(
                    f"tfpar/{scope_name(v.name)}/assign/"):
                piece = piece_of(value, part)
            with tf.device(ps_device(part.ps_task)):
                if self._resource(v):
                    assigns.append(tf.raw_ops.AssignVariableOp(resource=var.handle, value=piece))
                else:
                    new = tf.compat.v1.assign(var, piece, validate_shape=False)
                    assigns.append(new.op)
                    news.append(tf.identity(new))
        with tf.device(self.worker), tf.control_dependencies(list(op.control_inputs)):
            done = tf.group(*assigns, name=f"tfpar/{scope_name(v.name)}/assign/done")
        if news:  # a reference variable's Assign returns the new value
            with tf.device(self.worker):
                whole = whole_of(news, list(v.parts))
            self._replace(op.outputs[0], whole)
        self._after_write(op, done)

    def _after_write(self, op: tf.Operation, done: tf.Operation):
        """What waited for the user's write `op` waits for `done`, its redone write; a
        fetch of `op` runs `done`."""
        for x in self.g.get_operations():
            if x is not done and op in x.control_inputs:
                surgery.replace_control_inputs(x, [op], done)
        self.replaced[op.name] = done

    def _initialisation_only(self, op: tf.Operation, originals) -> bool:
        """Whether `op` is outside every training update's inputs (as the `cond` of an EMA
        shadow's `initialized_value()`, which reads the original's initial value because
        the original is not initialised here). Such a use is left as it is: a read of the
        original at run time fails loudly (it is never initialised), never silently."""
        return op not in self._training_ops()

    def _training_ops(self, updates: Optional[List[tuple]] = None):
        """The ops that `updates` ((variable, index); default: every trained variable's)
        wait for."""
        if updates is not None:
            roots = [self.g.get_operation_by_name(n) for v, i in updates
                     for n in v.gradients[i].ops]
            return reachable(roots, lambda x: [t.op for t in x.inputs] + list(x.control_inputs))
        if not hasattr(self, "_in_training"):
            self._in_training = self._training_ops([(v, i) for v in self.plan.variables
                                                    for i in range(len(v.gradients))])
        return self._in_training

    def _resource(self, v: VariablePlan) -> bool:
        return self.g.get_operation_by_name(v.name).type == "VarHandleOp"

    def _replace(self, old: tf.Tensor, new: tf.Tensor):
        surgery.replace_uses(old, new)
        self.replaced[old.name] = new

    def _gather(self, v: VariablePlan, op: tf.Operation, scope: str) -> tf.Tensor:
        """Rows of `v` that a lookup needs, from the parts that hold them."""
        if op.type == "ResourceGather" and op.get_attr("batch_dims") != 0:
            raise NotYetSupportedError(f"{op.name}: a gather with batch_dims on a PS variable")
        if op.type == "GatherV2" and (tf.get_static_value(op.inputs[2]) != 0
                                      or op.get_attr("batch_dims") != 0):
            raise NotYetSupportedError(f"{op.name}: a gather along another axis than the rows "
                                       "of a PS variable")
        with tf.device(self.worker), tf.compat.v1.name_scope(scope), \
                tf.control_dependencies(op.control_inputs):
            ids = op.inputs[1]
            uniq, idx = tf.unique(tf.reshape(ids, [-1]))
            uniq = checked_ids(v.name, v.shape[0], uniq)
            ranges, placed = self._split(v, uniq)
            rows = []
            for var, part, (local_ids, _) in zip(self.parts[v.name], v.parts, ranges):
                with tf.device(ps_device(part.ps_task)):
                    if self._resource(v):
                        rows.append(tf.raw_ops.ResourceGather(resource=var.handle,
                                                              indices=local_ids,
                                                              dtype=var.dtype.base_dtype))
                    else:
                        rows.append(tf.gather(var, local_ids))
            stitched = rows[0] if placed is None else tf.dynamic_stitch(placed, rows)
            # Counted when the lookup runs: the rows come back and the ids went out.
            stitched = self.traffic.counted("ps_pull", stitched,
                                            nbytes(stitched) + nbytes(uniq))
            out = tf.gather(stitched, idx)
            out = tf.reshape(out, tf.concat([tf.shape(ids), tf.shape(stitched)[1:]], 0))
            out.set_shape(op.outputs[0].shape)
        if not op.control_inputs:
            self.step_reads.append(out)
        return out

    def _split(self, v: VariablePlan, ids: tf.Tensor, values: Optional[tf.Tensor] = None):
        """Splits unique ids (and their values) by part: [(part-local ids, values)], positions."""
        parts = v.parts
        if len(parts) == 1:
            local = ids if not parts[0].start else ids - parts[0].start
            return [(local, values)], None
        if parts[0].step > 1:  # dealt out modulo: part k holds rows k, k + P, ...
            count = len(parts)
            assert all((p.start, p.step) == (k, count) for k, p in enumerate(parts)), parts
            which = tf.cast(ids % count, tf.int32)
            local = tf.dynamic_partition(ids // count, which, count)
        else:
            bounds = tf.constant([p.start for p in parts[1:]], dtype=ids.dtype)
            starts = tf.constant([p.start for p in parts], dtype=ids.dtype)
            which = tf.reduce_sum(tf.cast(ids[:, None] >= bounds[None, :], tf.int32), axis=1)
            local = tf.dynamic_partition(ids - tf.gather(starts, which), which, len(parts))
        vals = (tf.dynamic_partition(values, which, len(parts)) if values is not None
                else [None] * len(parts))
        positions = tf.dynamic_partition(tf.range(tf.size(ids)), which, len(parts))
        return list(zip(local, vals)), positions

    def _count_push(self, *tensors):
        for t in tensors:
            self.traffic.add("ps_push", nbytes(t))

    # -- gradients -------------------------------------------------------------------------------

    def _prepare_gradients(self):
        """Makes what each worker pushes its exact share of what the update reads.

        Sparse: the raw values are scaled to this worker's share of the single-device
        gradient (1/N for averaging), and every sum over their rows in the post-processing
        (e.g. a global norm) is summed over workers, so scalars such as a clipping factor
        are the single-device ones. Dense and post-processed (PS mode): averaged by
        allreduce before the post-processing, so every worker holds the final gradient.
        """
        from tfpar.transform.allreduce import allreduce
        n = self.plan.num_workers
        for v in self.ps_vars:
            for i, g in enumerate(v.gradients):
                with self.traffic.of_group(g.group):
                    self._prepare_gradient(v, i, g, n, allreduce)

    def _prepare_gradient(self, v: VariablePlan, i: int, g, n: int, allreduce):
        """`_prepare_gradients` for update `i` of `v` (its gradient `g`)."""
        key = (v.name, i)
        raw = self.g.get_tensor_by_name(g.values)
        final = self.g.get_tensor_by_name(g.final_values or g.values)
        scope = f"tfpar/gradient/{scope_name(v.name)}_{i}/"
        if not self.plan.sync:
            # Asynchronous: each worker applies what its own batch gives, unscaled
            # and post-processed on its own (a dense one it holds whole).
            self.final[key] = final
            if g.indices is None:
                self.combined_first.add(key)
            else:
                self.final_indices[key] = self.g.get_tensor_by_name(
                    g.final_indices or g.indices)
            return
        new, readers = raw, set(raw.consumers())
        with tf.device(self.worker), tf.compat.v1.name_scope(scope):
            if g.indices is None and (g.post_processed or self._read_elsewhere(v, i, raw)):
                if n > 1:
                    new = allreduce(raw, v.reduction == "average", n, self.traffic)
                    self.collectives.setdefault(g.group, []).append(new)
                self.combined_first.add(key)
            elif v.reduction == "average" and n > 1:
                new = raw * tf.constant(1.0 / n, raw.dtype)
        if new is not raw:  # all but the ops just built on it read `new`
            surgery.replace_uses(raw, new, keep=[c for c in raw.consumers()
                                                 if c not in readers])
        self.final[key] = new if final is raw else final
        if g.indices is not None:
            self.final_indices[key] = self.g.get_tensor_by_name(
                g.final_indices or g.indices)
        for name in g.row_sums if n > 1 else ():
            partial = self.g.get_tensor_by_name(name)
            with tf.device(self.worker), tf.compat.v1.name_scope(scope + "row_sum/"):
                total = allreduce(partial, False, n, self.traffic)
            surgery.replace_uses(partial, total, keep=[total.op])
            self.collectives.setdefault(g.group, []).append(total)

    def _read_elsewhere(self, v: VariablePlan, i: int, raw: tf.Tensor) -> bool:
        """Whether ops other than the update read a dense gradient (then they need it whole)."""
        update = set(self._update_ops(v, i))
        return any(c not in update for c in raw.consumers())

    def _sync(self, step: tf.Tensor, step_var, group: int, updates: List[tuple],
              tag: str) -> tf.Operation:
        """Pushes, (local chief) forwards, (chief) applies and tokens: one synchronous step
        of the update group's `updates` ((variable, index); `tag` names its own state)."""
        if not self.plan.sync:
            return self._apply_own(step_var, group, updates, tag)
        route = _Route.of(self.plan, self.rank)
        self.wanted_before = self._wanted_before_updates(updates)
        combined_first = self.combined_first & {(v.name, i) for v, i in updates}
        if self.wanted_before and combined_first and self.plan.num_workers > 1:
            # The chief applies a gradient every worker holds whole without waiting for any
            # push: a scalar allreduce, joined once those ops ran, makes it wait for them.
            # Its input is a variable's read and its output is written to one: TensorFlow
            # keeps a stateful op's control inputs (not a constant's), and would turn a
            # Horovod op (not marked stateful) that nothing reads into a no-op.
            from tfpar.transform.allreduce import allreduce
            with tf.device(self.worker), tf.compat.v1.name_scope("tfpar/sync/"):
                with tf.control_dependencies(self.wanted_before):
                    ran = tf.cast(step_var.read_value(), tf.float32)
                joined = allreduce(ran, False, self.plan.num_workers, self.traffic,
                                   name="before_updates" + tag)
                seen = tf.compat.v1.get_local_variable(
                    "tfpar/sync/before_updates" + tag, shape=[], dtype=tf.float32,
                    use_resource=True, initializer=tf.compat.v1.zeros_initializer())
                self.collectives.setdefault(group, []).append(
                    seen.assign(joined, read_value=False))
        pushes, forwards, owned = [], [], []
        for v, i in updates:
            for k, part, accum, push, forward in self._push_gradient(v, i, step, route):
                pushes.extend([push] if push is not None else [])
                forwards.extend([forward] if forward is not None else [])
                owned.append((v, i, k, part, accum))
        joined = self._run_collectives(group, tag)
        with tf.control_dependencies(pushes + forwards + joined):
            after_push = tf.no_op(name="tfpar/sync/pushed" + tag)
        if route.chief:
            applied, last = [], {}
            for v, i, k, part, accum in owned:
                # Several updates of one part run one after the other, in the graph's order.
                with tf.control_dependencies([after_push] + last.get((v.name, k), [])):
                    taken = None if accum is None else _take(accum, route.global_pushers)
                    op = self._apply(v, i, k, part, taken)
                applied.append(op)
                last[(v.name, k)] = [op]
            with tf.control_dependencies(applied), tf.compat.v1.name_scope("tfpar/sync/release/"):
                released = [_release(self.prefix + tag, j, self.plan.host_of_rank(j), step)
                            for j in range(1, self.plan.num_workers)]
                synced = tf.group(*released, after_push)
        else:
            with tf.control_dependencies([after_push]):
                token = _wait(self.prefix + tag, self.rank, route.host)
            synced = tf.group(token, name="tfpar/sync/wait" + tag)
        with tf.control_dependencies([synced]), tf.device(self.worker):
            done = tf.group(step_var.assign_add(1, read_value=False),
                            name="tfpar/sync/done" + tag)
        if self.markers is not None:
            training = self._training_ops(updates)
            reads = [t for t in self.step_reads if any(c in training for c in t.consumers())]
            self.markers.attach("read", reads, [done], group)
            self.markers.attach("joined", joined, [done], group)
            self.markers.attach("pushed", pushes + forwards, [done], group)
            self.markers.attach("applied" if route.chief else "token", [synced], [done], group)
        self._replace_updates(done, updates)
        return done

    def _run_collectives(self, group: int, tag: str) -> List[tf.Operation]:
        """Ops that make this worker run every collective of the step.

        A worker whose own step reads no result of a collective (a gradient only the
        chief's update reads, e.g. clipped by a norm over dense gradients alone) must still
        join it, or the others wait forever. A control input is not enough: Horovod's ops
        are not stateful, and TensorFlow drops a stateless op nothing reads. So one element
        of each result is written to a variable of the worker."""
        collectives = self.collectives.get(group, [])
        outputs = [t for t in collectives if isinstance(t, tf.Tensor)]
        ops = [t for t in collectives if isinstance(t, tf.Operation)]
        if not outputs:
            return ops
        with tf.device(self.worker), tf.compat.v1.name_scope(f"tfpar/sync/joined{tag}/"):
            seen = tf.compat.v1.get_local_variable(
                "tfpar/sync/joined" + tag, shape=[], dtype=tf.float32, use_resource=True,
                initializer=tf.compat.v1.zeros_initializer())
            first = [tf.reduce_sum(tf.cast(tf.reshape(t, [-1])[:1], tf.float32))
                     for t in outputs]
            return ops + [seen.assign(tf.add_n(first), read_value=False)]

    def _apply_own(self, step_var, group: int, updates: List[tuple],
                   tag: str) -> tf.Operation:
        """Asynchronous step: this worker applies its own gradient to every part on the PS,
        with no accumulator, no chief and no token: no worker waits for another."""
        applied, last = [], {}
        for v, i in updates:
            key = (v.name, i)
            pieces = [None] * len(v.parts)
            if key not in self.combined_first:
                name = scope_name(v.name) + (f"/update_{i}" if i else "")
                with tf.device(self.worker), tf.compat.v1.name_scope(f"tfpar/push/{name}/"):
                    uniq, summed = sum_by_id(self.final_indices[key], self.final[key])
                    split, _ = self._split(v, uniq, summed)
                    pieces = [tf.IndexedSlices(vals, ids) for ids, vals in split]
                    for ids, vals in split:
                        self._count_push(vals, ids)
            else:
                with tf.device(self.worker):
                    self._count_push(self.final[key])
            for k, part in enumerate(v.parts):
                with tf.control_dependencies(last.get((v.name, k), [])):
                    op = self._apply(v, i, k, part, pieces[k])
                applied.append(op)
                last[(v.name, k)] = [op]
        with tf.control_dependencies(applied + self._run_collectives(group, tag)), \
                tf.device(self.worker):
            done = tf.group(step_var.assign_add(1, read_value=False),
                            name="tfpar/sync/done" + tag)
        self._replace_updates(done, updates)
        return done

    def _push_gradient(self, v: VariablePlan, i: int, step, route: "_Route"):
        """This worker's share of what update `i` of `v` reads, deduplicated, split by part
        and pushed.

        Yields (k, part, owner's accumulator, push op, forward op or None) per part; no
        accumulator and no push for a gradient every worker already holds whole.
        """
        key = (v.name, i)
        if key in self.combined_first:
            for k, part in enumerate(v.parts):
                yield k, part, None, None, None
            return
        values = self.final[key]
        indices = self.final_indices.get(key)
        sparse = indices is not None
        name = scope_name(v.name) + (f"/update_{i}" if i else "")
        with tf.device(self.worker), tf.compat.v1.name_scope(f"tfpar/push/{name}/"):
            if sparse:
                uniq, summed = sum_by_id(indices, values)
                pieces, _ = self._split(v, uniq, summed)  # each part keeps the order
            else:
                pieces = [(None, values)]
        for k, (part, (ids, vals)) in enumerate(zip(v.parts, pieces)):
            shape = _part_shape(v, part)
            accum = _accumulator(v, shape, ps_device(part.ps_task),
                                 f"{self.prefix}/acc/{name}/part_{k}", sparse)
            forward = None
            with tf.device(self.worker), tf.compat.v1.name_scope(f"tfpar/push/{name}/"):
                if route.aggregate:
                    local = _accumulator(v, shape, ps_device(route.host),
                                         f"{self.prefix}/local_acc/{name}/part_{k}/host_"
                                         f"{route.host}", sparse)
                    with tf.control_dependencies(self.wanted_before):
                        push = _push(local, ids, vals, shape, step)
                else:
                    with tf.control_dependencies(self.wanted_before):
                        push = self._global_push(v, i, k, accum, ids, vals, shape, step)
                self._count_push(*([vals] if ids is None else [vals, ids]))
            if route.aggregate and route.local_chief:
                with tf.device(ps_device(route.host)), tf.control_dependencies([push]), \
                        tf.compat.v1.name_scope(f"tfpar/forward/{name}/"):
                    host_sum = _take(local, route.local_workers)
                    ids_f, vals_f = ((host_sum.indices, host_sum.values) if sparse
                                     else (None, host_sum))
                    forward = self._global_push(v, i, k, accum, ids_f, vals_f, shape, step)
                    self._count_push(*([vals_f] if ids_f is None else [vals_f, ids_f]))
            yield k, part, accum, push, forward

    def _global_push(self, v, i, k, accum, ids, vals, shape, step) -> tf.Operation:
        """A push to the PS that owns the part, counted there (see `PsRewrite.pushes`)."""
        push = _push(accum, ids, vals, shape, step)
        counter = self._push_counter(v, k, i)
        with tf.control_dependencies([push]), tf.device(counter.device):
            return counter.assign_add(1, read_value=False)

    def _push_counter(self, v: VariablePlan, k: int, i: int = 0) -> tf.Variable:
        key = f"{v.name}/part_{k}" + (f"/update_{i}" if i else "")
        if key not in self.pushes:
            # control_dependencies(None): the counter's initializer must not wait for a push.
            with tf.control_dependencies(None), tf.device(ps_device(v.parts[k].ps_task)):
                self.pushes[key] = tf.compat.v1.Variable(
                    tf.constant(0, tf.int64), name=f"{self.prefix}/pushes/{scope_name(key)}",
                    trainable=False, use_resource=True, collections=[PS_VARIABLES])
        return self.pushes[key]

    def _apply(self, v: VariablePlan, i: int, k: int, part: PartPlan, taken) -> tf.Operation:
        """The user's optimizer update `i`, copied onto part k of `v` and its slots.

        `taken`: the sum of the workers' pushes (what the update reads), or None when this
        worker holds the whole final gradient itself (dense, combined before post-processing).
        """
        g = v.gradients[i]
        key = (v.name, i)
        device = ps_device(part.ps_task)
        name = scope_name(v.name) + (f"/update_{i}" if i else "")
        mapping = {}
        final = self.final[key]
        if taken is not None:
            mapping[final] = taken if g.indices is None else taken.values
        elif part.stop is not None:
            raise NotYetSupportedError(f"{v.name!r}: a whole dense gradient for a part")
        if g.indices and taken is not None:
            orig_indices = self.final_indices[key]
            with tf.device(device):
                mapping[orig_indices] = tf.cast(taken.indices, orig_indices.dtype)
        ops = self._update_ops(v, i)
        used = {t for op in ops for t in op.inputs}
        for p in [v] + self.slots[v.name]:
            handle = self.g.get_operation_by_name(p.name).outputs[0]
            part_var = self.parts[p.name][k]
            mapping[handle] = part_var.handle if self._resource(p) else part_var.op.outputs[0]
            if not self._resource(p):  # a reference variable read by its `read` snapshot
                for c in handle.consumers():
                    if c.type == "Identity" and c.outputs[0] in used:
                        mapping[c.outputs[0]] = part_var.value()
        # Inputs made under a control dependency on an earlier update (e.g. the learning
        # rate of an optimizer applied after another) are copied too, without that wait.
        members, stack = set(ops), list(ops)
        while stack:
            for t in stack.pop().inputs:
                if (t.op not in members and t not in mapping and t.op.type not in
                        ("VarHandleOp", "VariableV2") and self._waits_for_updates(t.op)):
                    members.add(t.op)
                    stack.append(t.op)
        ops = list(members)
        missing = [t.name for t in mapping if t not in used and t.dtype.base_dtype != tf.resource
                   and not t.dtype._is_ref_dtype]  # pylint: disable=protected-access
        if missing:
            raise NotYetSupportedError(
                f"the update of {v.name!r} does not read its gradient {', '.join(missing)} "
                "directly; tfpar cannot copy it onto the parameter servers")

        def device_of(op, inputs):
            for t in inputs:
                if t.dtype == tf.resource or t.dtype._is_ref_dtype:  # pylint: disable=protected-access
                    return t.op.device or device
            return device

        # A control input that waits for an original update of a PS variable would wait
        # for the end of the step (`done`), which waits for this apply: drop it; the
        # updates of one part run in their order instead (see `_sync`).
        copies = surgery.clone_ops(ops, mapping, f"tfpar/apply/{name}/part_{k}/", device_of,
                                   strip_prefix=g.scope,
                                   keep_control=lambda c: not self._waits_for_updates(c))
        sinks = [c for o, c in copies.items()
                 if not any(x in copies for t in o.outputs for x in t.consumers())
                 and not any(o in x.control_inputs for x in copies)]
        with tf.device(device):
            return tf.group(*sinks, name=f"tfpar/apply/{name}/part_{k}/done")

    def _wanted_before_updates(self, updates: List[tuple]) -> List[tf.Operation]:
        """The ops the user's graph runs before the updates of PS variables by control
        dependency (e.g. reads of the step's values, batch norm's UPDATE_OPS).

        On one device they run before the update. Here the chief applies every update, so
        each worker's pushes wait for its own copies of them: the chief's apply, which waits
        for every push, then comes after them on every worker. Without this another worker
        could read a variable after the chief updated it.
        """
        update = {op for v, i in updates for op in self._update_ops(v, i)}
        boundary = set(self.final.values()) | set(self.final_indices.values())
        wanted, seen, stack = [], set(), list(update)
        while stack:
            op = stack.pop()
            if op in seen:
                continue
            seen.add(op)
            for c in op.control_inputs:
                if c not in update and c not in wanted and not self._waits_for_updates(c):
                    wanted.append(c)
            stack.extend(t.op for t in op.inputs if t not in boundary and t.op.type not in
                         ("VarHandleOp", "VariableV2", "Placeholder"))
        return sorted(wanted, key=lambda o: o.name)

    def _waits_for_updates(self, op: tf.Operation) -> bool:
        """Whether `op` runs only after an original update of a PS variable."""
        if not hasattr(self, "_after_updates"):
            control_out = {}
            for x in self.g.get_operations():
                for c in x.control_inputs:
                    control_out.setdefault(c, []).append(x)
            seen = set()
            stack = [x for v in self.ps_vars for x in self._update_ops(v)]
            while stack:
                x = stack.pop()
                if x in seen:
                    continue
                seen.add(x)
                stack.extend(c for t in x.outputs for c in t.consumers())
                stack.extend(control_out.get(x, ()))
            self._after_updates = seen
        return op in self._after_updates

    def _replace_updates(self, done: tf.Operation, updates: List[tuple]):
        """Whatever waited for these original updates ((variable, index)) of PS variables
        now waits for `done`, their group's step."""
        old = set()
        for v, i in updates:
            old.update(self._update_ops(v, i))
        for op in self.g.get_operations():
            if op in old or op is done:
                continue
            surgery.replace_control_inputs(op, old, done)
            for t in op.inputs:
                if t.op in old:
                    raise NotYetSupportedError(
                        f"op {op.name!r} reads {t.name!r}, an output of the optimizer update of a "
                        "variable on the parameter servers; tfpar cannot rewire that")


@dataclasses.dataclass(frozen=True)
class _Route:
    """Where one worker's pushes go, from the plan's hosts and the worker's rank."""

    host: int  # this worker's host (and the task of its host's PS)
    chief: bool  # worker 0: takes the sums and applies the updates
    aggregate: bool  # push to the host's local accumulator (else straight to the owner)
    local_chief: bool  # the host's first worker: forwards the host's sum to the owner
    local_workers: int  # pushes a local accumulator waits for
    global_pushers: int  # pushes an owner's accumulator waits for per step

    @classmethod
    def of(cls, plan: Plan, rank: int) -> "_Route":
        sizes = [slots for _, slots in plan.hosts]
        aggregate = [plan.local_aggregation and n > 1 for n in sizes]
        host = plan.host_of_rank(rank)
        return cls(host=host, chief=rank == 0, aggregate=aggregate[host],
                   local_chief=rank == sum(sizes[:host]), local_workers=sizes[host],
                   global_pushers=sum(1 if a else n for a, n in zip(aggregate, sizes)))


def sum_by_id(indices: tf.Tensor, values: tf.Tensor):
    """The rows of a sparse gradient summed per id: (ids ascending as int64, sums).

    Ascending because TensorFlow's SparseConditionalAccumulator merges two pushes in one
    walk over their ids that assumes order: with ids in any other order a row that two
    pushes share is kept twice. The sum stays right (the update deduplicates), but a host's
    aggregate would then forward as many rows as its workers pushed, sparing nothing.
    """
    uniq, idx = tf.unique(tf.cast(indices, tf.int64))
    summed = tf.math.unsorted_segment_sum(values, idx, tf.size(uniq))
    order = tf.argsort(uniq)
    return tf.gather(uniq, order), tf.gather(summed, order)


def _part_shape(v: VariablePlan, part: PartPlan) -> List[int]:
    if part.stop is None:
        return list(v.shape)
    return [part.num_rows()] + list(v.shape[1:])


def _accumulator(v: VariablePlan, shape, device: str, shared_name: str, sparse: bool):
    with tf.device(device):
        cls = (tf.compat.v1.SparseConditionalAccumulator if sparse
               else tf.compat.v1.ConditionalAccumulator)
        return cls(tf.as_dtype(v.dtype), shape=shape, shared_name=shared_name,
                   name=shared_name.replace("/", "_"), reduction_type="SUM")


# Ops on an accumulator or queue run where it lives (their handle edge requires it).
def _push(accum, ids, vals, shape, step) -> tf.Operation:
    with tf.device(accum.accumulator_ref.device):
        if ids is None:
            return accum.apply_grad(vals, local_step=step)
        return accum.apply_indexed_slices_grad(
            tf.IndexedSlices(vals, ids, tf.constant(shape, tf.int64)), local_step=step)


def _take(accum, num_required: int):
    with tf.device(accum.accumulator_ref.device):
        if isinstance(accum, tf.compat.v1.SparseConditionalAccumulator):
            return accum.take_indexed_slices_grad(num_required)
        return accum.take_grad(num_required)


def _release(prefix: str, rank: int, host: int, step) -> tf.Operation:
    with tf.device(ps_device(host)):
        return _token_queue(prefix, rank).enqueue(step)


def _wait(prefix: str, rank: int, host: int) -> tf.Tensor:
    with tf.device(ps_device(host)):
        return _token_queue(prefix, rank).dequeue()


def _token_queue(prefix: str, rank: int):
    """Worker `rank`'s queue: one per worker, so a fast worker cannot take another's token."""
    return tf.queue.FIFOQueue(capacity=16, dtypes=[tf.int64], shapes=[[]],
                              shared_name=f"{prefix}/token/worker_{rank}",
                              name="token_worker_%d" % rank)

