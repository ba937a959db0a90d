"""The user's own uses, outside the training step, of a variable split over the workers.

A variable of route "sharded" (or "tiled") exists only as tiles on the workers; the
whole variable of the user's graph is never initialised. The training step's uses are
rewritten by those routes. The user's graph may use the variable outside the step too:

- writes of the whole variable: `assign` (a pretrained table loaded through a
  placeholder), `assign_add`, `assign_sub`. Each worker writes its own tile from the value
  it computed. A tiled variable holds one value, so the workers must write the same one;
  an allgather of each value's fingerprint checks that every worker took part, and
  asserts that the values agree before anything is written.
- writes of part of it (`partial_writes`: a scatter, a slice's assign: a padding row
  kept zero): each worker applies a row scatter to the ids that fall in its rows, and
  takes its tile of the value an n-d scatter or a slice's assign leaves on the whole;
  checked alike (the fingerprints of the ids and values).
- reads of its value (an evaluation's lookup, a norm, what `assign` returns): the whole
  variable gathered from the tiles (`collectives.whole`).

Both are collectives: every worker runs them at the same point, as it runs a training
step (the runner watches them alike). Left as they are: the variable's initialiser, a
Saver's ops (the runner saves and restores the tiles), shape reads, and the `keep` ops
(the training step, moving averages the route copies onto the tiles, other variables'
initialisers). Before this rewrite such a write reached the never-read whole variable
and was lost without a word.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Set, Tuple

import tensorflow as tf

from tfpar.graph import initializers
from tfpar.graph.naming import safe_name
from tfpar.graph.row_reads import ASSIGNS, IGNORED, SAVES, is_restore, upstream
from tfpar.partition.tiling.cuts import Tiling
from tfpar.transform import collectives, partial_writes, surgery

_READS = ("ReadVariableOp", "Identity", "RefIdentity")
_RESOURCE_WRITES = {"AssignVariableOp": tf.raw_ops.AssignVariableOp,
                    "AssignAddVariableOp": tf.raw_ops.AssignAddVariableOp,
                    "AssignSubVariableOp": tf.raw_ops.AssignSubVariableOp}
_REF_WRITES = {"Assign": tf.compat.v1.assign, "AssignAdd": tf.compat.v1.assign_add,
               "AssignSub": tf.compat.v1.assign_sub}


def initialisers(graph: tf.Graph) -> Set[tf.Operation]:
    """Every variable's initialiser and what it reads (e.g. an EMA shadow's
    `initialized_value()` of the variable it averages)."""
    ops = []
    for op in graph.get_operations():
        if op.type in ("VarHandleOp", "VariableV2"):
            ops.extend(x for x in (initializers.initializer(op),
                                   initializers.default_initializer(op)) if x is not None)
    return upstream(ops)


class OutsideUses:
    """The uses of `var_op` outside the `keep` ops, found before any rewrite touches it."""

    def __init__(self, var_op: tf.Operation, keep: Set[tf.Operation]):
        self.var_op = var_op
        handle = var_op.outputs[0]
        # TF's `<variable>/Assign`, and the initialiser a warm start gave it instead
        own_init = {var_op.name + "/Assign",
                    getattr(initializers.initializer(var_op), "name", None)}
        self.writes: List[tf.Operation] = []
        self.reads: List[Tuple[tf.Operation, List[tf.Operation]]] = []  # (read, its users)
        self.gathers: List[tf.Operation] = []  # row lookups of the handle itself
        # By name: every worker must build the same collectives under the same names, and
        # TensorFlow lists an output's consumers in no fixed order.
        for c in sorted(handle.consumers(), key=lambda op: op.name):
            if c.type in IGNORED or c.name in own_init or c.type in SAVES:
                continue
            if c.type in ASSIGNS or c.type in partial_writes.TYPES:
                if c not in keep and not is_restore(c):
                    self.writes.append(c)
            elif c.type in _READS:
                users = sorted((x for x in c.outputs[0].consumers()
                                if x not in keep and x.type not in SAVES), key=lambda op: op.name)
                if users or c not in keep:
                    self.reads.append((c, users))
            elif c.type == "ResourceGather" and c not in keep and c.get_attr("batch_dims") == 0:
                self.gathers.append(c)

    def __bool__(self) -> bool:
        return bool(self.writes or self.reads or self.gathers)

    def rewire(self, tile: tf.Variable, tiling: Tiling, shape, rank: int, n: int,
               scope: str) -> Dict[str, object]:
        """Makes the writes write `tile` and the reads read the whole from the tiles;
        returns {original tensor or op name: its replacement} for the runner's fetches."""
        graph = self.var_op.graph
        replaced: Dict[str, object] = {}
        done: Dict[tf.Operation, tf.Operation] = {}
        box = tiling.tile_slices(tuple(shape), rank)
        wholes: Dict[Tuple[str, ...], tf.Tensor] = {}

        def whole_after(ops: Iterable[tf.Operation]) -> tf.Tensor:
            """The whole variable read after `ops` (a write among them: after its copy).
            Made in the (sorted) order of the uses: the same names on every worker."""
            after = tuple(done.get(o, o) for o in ops)
            key = tuple(sorted(o.name for o in after))
            if key not in wholes:
                with tf.control_dependencies(list(after)), tf.compat.v1.name_scope(None):
                    wholes[key] = collectives.whole(tile.value(), tiling, shape, rank,
                                                    f"{scope}/whole_{len(wholes)}")
            return wholes[key]

        for k, op in enumerate(self.writes):
            done[op] = _write(op, tile, box, tuple(shape), n, f"{scope}/write_{k}",
                              lambda op=op: whole_after(op.control_inputs))
            replaced[op.name] = done[op]
            for x in graph.get_operations():
                if x is not done[op] and op in x.control_inputs:
                    surgery.replace_control_inputs(x, [op], done[op])
            if op.outputs:  # a reference variable's assignment returns the new value
                if op.type == "Assign":  # the value written (the same on every worker)
                    with tf.control_dependencies([done[op]]):
                        new = tf.identity(op.inputs[1], name=f"{scope}/write_{k}/value")
                else:  # any other write: the new value, read back whole
                    new = whole_after([op])
                replaced[op.outputs[0].name] = new
                surgery.replace_uses(op.outputs[0], new)

        for read, users in self.reads:
            value = whole_after(read.control_inputs)
            for x in users:
                for i, t in enumerate(x.inputs):
                    if t is read.outputs[0]:
                        surgery.replace_input(x, i, value)
            replaced.setdefault(read.outputs[0].name, value)
        for gather in self.gathers:
            with tf.compat.v1.name_scope(f"{scope}/gather/"):
                rows = tf.gather(whole_after(gather.control_inputs), gather.inputs[1])
            surgery.replace_uses(gather.outputs[0], rows)
            replaced[gather.outputs[0].name] = rows
        return replaced


def _write(op: tf.Operation, tile: tf.Variable, box, shape, n: int, scope: str,
           whole) -> tf.Operation:
    """`op`'s write of the variable (of `shape`) done on this worker's `tile` (the slices
    `box` of it: `Tiling.tile_slices`), after every worker's inputs to it are checked to
    be the same. whole(): the whole variable's value before `op` (a collective: called
    only where needed)."""
    partial = op.type in partial_writes.TYPES
    checked = partial_writes.inputs(op) if partial else [op.inputs[1]]
    with tf.control_dependencies(op.control_inputs), tf.compat.v1.name_scope(scope + "/"):
        same = same_on_every_worker(checked, n, scope, op.inputs[0].op.name, op.name)
        with tf.control_dependencies([same]):
            if op.type in partial_writes.ROW_SCATTERS:
                rows_held, columns = box[0], [(x.start, x.stop) for x in box[1:]]
                ids, rows = partial_writes.rows_in(op, shape[0], rows_held.start,
                                                   rows_held.stop, columns, rows_held.step or 1)
                return tf.group(partial_writes.scatter(op, tile, ids, rows), name="done")
            if partial:  # an n-d scatter or a slice's assign: this tile of its result
                value = partial_writes.new_value(op, whole())
                kind = "AssignVariableOp" if op.inputs[0].dtype == tf.resource else "Assign"
            else:
                value, kind = op.inputs[1], op.type
            piece = value[box]
            if kind in _RESOURCE_WRITES:
                write = _RESOURCE_WRITES[kind](resource=tile.handle, value=piece)
            else:
                write = _REF_WRITES[kind](tile, piece).op
        return tf.group(write, name="done")


def same_on_every_worker(checked: List[tf.Tensor], n: int, scope: str, variable: str,
                         op_name: str) -> tf.Operation:
    """An assertion that every worker's `checked` tensors (what it writes to `variable`,
    split over the workers) are the same as the others': an allgather of their
    fingerprints (a collective, named from `scope`)."""
    import horovod.tensorflow as hvd
    mine = tf.concat([tf.reshape(tf.bitcast(tf.fingerprint(tf.reshape(t, [1, -1])),
                                            tf.int64), [1]) for t in checked], 0)
    every = hvd.allgather(collectives.never_folded(mine),
                          name=f"tfpar_{safe_name(scope)}_fingerprints", ignore_name_scope=True)
    return tf.debugging.assert_equal(
        every, tf.tile(mine, [n]), summarize=n * len(checked), message=(
            f"tfpar: the workers wrote different values to {variable!r} (op {op_name!r}); "
            "its rows are split over the workers, so it holds one value: write the same "
            "value on every worker (nothing was written)"))
