"""Checkpoints that are the single-device model's checkpoint.

`Runner.save` writes what `tf.compat.v1.train.Saver()` in the user's own single-device
graph would write: every global variable under its original name and full shape (parameter-
server parts put back together, the pieces of a variable the user partitioned as slices of
the whole), optimizer slots, moving averages and the global step. The user's graph restores
it with a plain Saver and no tfpar, and tfpar restores a single-device checkpoint (or one
written by any other layout, mode or partition count) into any job.

Writes are atomic: each save goes to a new prefix (`path-<global step>`), TensorFlow's
bundle writer renames its files into place only when they are complete, and the
`checkpoint` state file is replaced (atomically) only after that; a job killed while
saving leaves the previous checkpoint readable. The oldest checkpoints beyond
`max_to_keep` are deleted after a save succeeds.
"""
from __future__ import annotations

import dataclasses
import glob
import itertools
import logging
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tfpar.errors import TfparError
from tfpar.transform.parameter_server import piece_of, whole_of

log = logging.getLogger("tfpar")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One variable of the single-device graph as a checkpoint stores it."""

    name: str  # variable op name in the graph (e.g. "emb/part_1")
    key: str  # checkpoint key: the name, or the whole variable's name for a piece
    slice_spec: str  # "" for a whole variable, else "full shape offset,length:..." (Saver's)
    shape: Tuple[int, ...]
    dtype: str


def checkpoint_folder(folder: str) -> str:
    """`folder` made if missing (as TensorFlow's MonitoredTrainingSession does with its
    checkpoint_dir); a TfparError naming it and why when it cannot be (a file in the way,
    no permission). Returns its absolute path."""
    folder = os.path.abspath(folder)
    try:
        os.makedirs(folder, exist_ok=True)
        if not os.access(folder, os.W_OK):
            raise PermissionError(f"[Errno 13] Permission denied: {folder!r}")
    except OSError as e:
        why = ("a file is in the way" if isinstance(e, (FileExistsError, NotADirectoryError))
               else e.strerror or str(e))
        raise TfparError(f"cannot use {folder!r} as a checkpoint folder: {why}; give a folder "
                         "that exists or can be created") from None
    return folder


def entries_of(graph: tf.Graph) -> Tuple[Entry, ...]:
    """What a default `Saver()` of `graph` saves: every global variable."""
    out = []
    with graph.as_default():
        for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES):
            info = v.to_proto().save_slice_info_def
            shape = tuple(v.shape.as_list())
            if info.full_name:
                spec = (" ".join(str(d) for d in info.full_shape) + " "
                        + ":".join(f"{o},{n}" for o, n in zip(info.var_offset, info.var_shape)))
                out.append(Entry(v.op.name, info.full_name, spec, shape, v.dtype.base_dtype.name))
            else:
                out.append(Entry(v.op.name, v.op.name, "", shape, v.dtype.base_dtype.name))
    return tuple(out)


class SaveOps:
    """The chief's checkpoint write as ops of the rewritten graph, built on first use: one
    SaveV2 fed by the variables' values (`write`) or by copies taken at a step boundary
    (`take`, then `write(copies=True)` in a thread while training goes on). No value passes
    through numpy or another session. The copies of parameter-server parts are made on their
    servers (each holds its parts twice from the first background save on), those of the
    other variables on the chief.

    reads: {variable name: its value in the rewritten graph}, for every entry not `fed`;
    parts: {variable name: [(part variable, its PartPlan)]} (PS variables);
    fed: the entries given as numpy values to `write` (variables split over the workers,
    gathered by a collective); chief: the chief's CPU (where its copies are made);
    writer: the CPU that runs SaveV2, on the chief's host: in a PS job the parameter server
    there, so the parts it holds (on one host: all of them) reach the file without a
    transfer to the chief and its serialisation, which on a loaded host costs the training
    more than the write itself."""

    _made = itertools.count()  # (runners of one process must not share the chief's copies)

    def __init__(self, graph: tf.Graph, entries: Sequence[Entry], reads: Dict[str, tf.Tensor],
                 parts: Dict[str, list],
                 fed: Sequence[str], chief: str, writer: str):
        self.entries = tuple(entries)
        self._graph, self._reads, self._parts = graph, reads, parts
        self._chief, self._writer = chief, writer
        self._fed = set(fed)
        self._scope = f"tfpar/snapshot{next(self._made)}/"
        self._prefix: Optional[tf.Tensor] = None
        self._feeds: Dict[str, tf.Tensor] = {}
        self._saves: Dict[bool, tf.Operation] = {}  # copies? -> its SaveV2
        self._take: Optional[tf.Operation] = None
        self._copies: Dict[str, tf.Tensor] = {}

    def take(self, session) -> None:
        """Copies every variable not fed (call it at a step boundary)."""
        if self._take is None:
            self._build_copies()
        session.run(self._take)

    def write(self, session, prefix: str, fed: Dict[str, np.ndarray], copies: bool = False
              ) -> str:
        """Writes the checkpoint bundle at `prefix` from the variables (or from the last
        `take`'s copies) and the `fed` values; returns the prefix."""
        if copies not in self._saves:
            self._build_save(copies)
        session.run(self._saves[copies], {self._prefix: prefix,
                                          **{self._feeds[n]: v for n, v in fed.items()}})
        return prefix

    def _build_save(self, copies: bool):
        if copies and self._take is None:
            self._build_copies()
        with self._graph.as_default(), tf.device(self._writer), \
                tf.compat.v1.name_scope(self._scope):
            if self._prefix is None:
                self._prefix = tf.compat.v1.placeholder(tf.string, [], name="prefix")
            values = []
            for e in self.entries:
                if e.name in self._fed:
                    if e.name not in self._feeds:
                        self._feeds[e.name] = tf.compat.v1.placeholder(e.dtype, e.shape)
                    values.append(self._feeds[e.name])
                else:
                    values.append(self._copies[e.name] if copies else self._reads[e.name])
            self._saves[copies] = tf.raw_ops.SaveV2(
                prefix=self._prefix, tensor_names=[e.key for e in self.entries],
                shape_and_slices=[e.slice_spec for e in self.entries], tensors=values)

    def _build_copies(self):
        assigns = []
        with self._graph.as_default():
            for e in self.entries:
                if e.name in self._fed:
                    continue
                if e.name in self._parts:
                    held = []
                    for var, _ in self._parts[e.name]:
                        # Named after the part (its name holds the rewrite's generation):
                        # the servers' resources are shared by every runner of the job.
                        with tf.device(var.device), \
                                tf.compat.v1.name_scope(f"{var.op.name}/snapshot/"):
                            copy, assign = _copy_of(tf.identity(var))  # (a ref variable too)
                        assigns.append(assign)
                        held.append(copy)
                    with tf.device(self._writer):
                        self._copies[e.name] = whole_of(held, [p for _, p in self._parts[e.name]])
                else:
                    with tf.device(self._chief), \
                            tf.compat.v1.name_scope(self._scope + e.name + "/"):
                        self._copies[e.name], assign = _copy_of(self._reads[e.name])
                    assigns.append(assign)
            self._take = tf.group(*assigns)


def _copy_of(value: tf.Tensor) -> Tuple[tf.Tensor, tf.Operation]:
    """(a read of a new variable holding a copy of `value`, the op that copies it there)."""
    copy = tf.compat.v1.Variable(tf.zeros(value.shape, value.dtype), trainable=False,
                                 collections=[], use_resource=True, name="copy")
    return copy.read_value(), copy.assign(value, read_value=False)


def read(path: str, entries: Sequence[Entry]) -> List[np.ndarray]:
    """The value of every entry in the checkpoint at `path` (a prefix, or a folder: its
    latest). Raises a TfparError naming every missing or mis-shaped variable before
    anything is read, so a restore is complete or does not happen."""
    prefix = resolve(path)
    reader = tf.compat.v1.train.NewCheckpointReader(prefix)
    shapes = reader.get_variable_to_shape_map()
    problems = []
    for e in entries:
        full = (tuple(int(d) for d in e.slice_spec.split(" ")[:-1]) if e.slice_spec else e.shape)
        if e.key not in shapes:
            problems.append(f"{e.key!r} is not in it")
        elif tuple(shapes[e.key]) != tuple(full):
            problems.append(f"{e.key!r} has shape {list(shapes[e.key])} there, "
                            f"{list(full)} in this graph")
    if problems:
        raise TfparError(f"cannot restore {prefix}: " + "; ".join(problems[:10])
                         + (f" (and {len(problems) - 10} more)" if len(problems) > 10 else "")
                         + ". Restore a checkpoint of this model, saved by Runner.save or by a "
                         "Saver of the single-device graph; nothing was restored")
    g = tf.Graph()
    with g.as_default(), tf.device("/cpu:0"):
        restored = tf.raw_ops.RestoreV2(prefix=prefix, tensor_names=[e.key for e in entries],
                                        shape_and_slices=[e.slice_spec for e in entries],
                                        dtypes=[tf.as_dtype(e.dtype) for e in entries])
        with tf.compat.v1.Session(graph=g, config=_local()) as sess:
            return sess.run(restored) if entries else []


def resolve(path: str) -> str:
    """A checkpoint prefix from a prefix or a folder (its latest checkpoint)."""
    if os.path.isdir(path):
        latest = tf.train.latest_checkpoint(path)
        if latest is None:
            raise TfparError(f"no checkpoint in folder {path!r} (no 'checkpoint' state file "
                             "naming one); give a checkpoint prefix or a folder Runner.save "
                             "wrote to")
        return latest
    if not glob.glob(path + ".index"):
        raise TfparError(f"no checkpoint at {path!r} (no {path}.index): give the prefix that "
                         "Runner.save returned, or the folder it wrote to")
    return path


def remove_partial_writes(folder: str) -> List[str]:
    """Deletes the files of checkpoint writes that never finished in `folder` (TensorFlow's
    bundle writer writes `<file>.tempstate<n>` and renames it when complete: a process
    killed while saving leaves them). Returns what it deleted."""
    partial = glob.glob(os.path.join(folder, "*.tempstate*"))
    for f in partial:
        try:
            os.remove(f)
        except FileNotFoundError:
            pass
    return partial


def record(prefix: str, max_to_keep: Optional[int]) -> None:
    """Makes `prefix` the folder's latest checkpoint, then deletes the oldest beyond
    `max_to_keep` (None or 0: keep all)."""
    folder = os.path.dirname(os.path.abspath(prefix))
    state = tf.train.get_checkpoint_state(folder)
    previous = [p for p in (state.all_model_checkpoint_paths if state else [])
                if os.path.abspath(p) != os.path.abspath(prefix)]
    kept = previous + [prefix]
    dropped = []
    if max_to_keep:
        dropped, kept = kept[:-max_to_keep], kept[-max_to_keep:]
    tf.compat.v1.train.update_checkpoint_state(folder, prefix, all_model_checkpoint_paths=kept)
    for old in dropped:
        for f in glob.glob(old + ".index") + glob.glob(old + ".data-*") + glob.glob(old + ".meta"):
            os.remove(f)


ITERATOR_TYPES = ("OneShotIterator", "IteratorV2", "Iterator")


def input_suffix(rank: int, num_workers: int) -> str:
    """The suffix of worker `rank`'s input positions beside a checkpoint prefix."""
    return f".input-{rank}-of-{num_workers}"


STAGED = "tfpar_staged"  # the input positions' batch read ahead (Plan.ids_ahead)


class InputPositions:
    """Where this worker's `tf.data` iterators are (TensorFlow's serialized iterator
    state), saved beside a checkpoint as `<prefix>.input-<rank>-of-<N>` and restored from
    it, so a restarted job with the same worker count neither replays nor skips data.
    Each worker writes and reads its own file; ops built on first use.

    With the input read a step ahead (`Plan.ids_ahead`, `ahead`: its `InputAhead`), the
    iterators are a batch past the model: the batch read ahead and not yet trained on is
    saved with them, and a restore puts it back as the next batch (`restore` says so: the
    runner then stages it, its ids' exchange included)."""

    def __init__(self, graph: tf.Graph, rank: int, num_workers: int, ahead=None):
        self._graph, self._suffix = graph, input_suffix(rank, num_workers)
        self._iterators = [op for op in graph.get_operations() if op.type in ITERATOR_TYPES]
        self._ahead = ahead
        self._ops = None

    def __bool__(self):
        return bool(self._iterators)

    def _built(self):
        if self._ops is None:
            with self._graph.as_default(), tf.device("/cpu:0"), \
                    tf.compat.v1.name_scope("tfpar_input_positions"):
                path = tf.compat.v1.placeholder(tf.string, [])
                names = [op.name for op in self._iterators]
                states = [tf.raw_ops.SerializeIterator(resource_handle=op.outputs[0],
                                                       external_state_policy=1)
                          for op in self._iterators]
                restored = tf.raw_ops.RestoreV2(prefix=path, tensor_names=names,
                                                shape_and_slices=[""] * len(names),
                                                dtypes=[tf.variant] * len(names))
                restore = tf.group(*[tf.raw_ops.DeserializeIterator(
                    resource_handle=op.outputs[0], serialized=r)
                    for op, r in zip(self._iterators, restored)])
                staged_flag = tf.compat.v1.placeholder_with_default(False, [])
                restore_staged = None
                sources = list(self._ahead.current_vars) if self._ahead is not None else []
                if sources:  # the batch read ahead (values of any shape), and whether held
                    held = [f"{STAGED}_{k}" for k in range(len(sources))]
                    names += [STAGED] + held
                    states += [staged_flag] + [self._ahead.current_vars[t].read_value()
                                               for t in sources]
                    values = tf.raw_ops.RestoreV2(prefix=path, tensor_names=held,
                                                  shape_and_slices=[""] * len(held),
                                                  dtypes=[t.dtype for t in sources])
                    restore_staged = tf.group(*[
                        self._ahead.next_vars[t].assign(v, read_value=False)
                        for t, v in zip(sources, values)])
                save = tf.raw_ops.SaveV2(prefix=path, tensor_names=names,
                                         shape_and_slices=[""] * len(names), tensors=states)
            self._ops = (path, save, restore, restore_staged, staged_flag)
        return self._ops

    def save(self, session, prefix: str, max_to_keep: Optional[int],
             staged: bool = False) -> None:
        """Writes this worker's positions beside `prefix` (and the batch read ahead, when
        `staged`); keeps the newest `max_to_keep` of this worker's files in the folder
        (each host keeps its own workers')."""
        path, save, _, _, staged_flag = self._built()
        session.run(save, {path: prefix + self._suffix, staged_flag: staged})
        if max_to_keep:
            mine = glob.glob(os.path.join(os.path.dirname(os.path.abspath(prefix)),
                                          "*" + self._suffix + ".index"))
            steps = sorted(mine, key=lambda f: _step_of(f[:-len(self._suffix + ".index")]))
            for old in steps[:-max_to_keep]:
                for f in glob.glob(old[:-len(".index")] + "*"):
                    os.remove(f)

    def restore(self, session, prefix: str) -> Optional[bool]:
        """Sets this worker's iterators from the positions saved beside `prefix`. Returns
        None (nothing changed) when there are none for this worker count, else whether a
        batch read ahead was saved with them and is now the next batch (the runner stages
        it). A batch read ahead that this runner cannot take (no `ids_ahead`) is skipped,
        with a warning."""
        if not glob.glob(prefix + self._suffix + ".index"):
            return None
        path, _, restore, restore_staged, _ = self._built()
        reader = tf.compat.v1.train.NewCheckpointReader(prefix + self._suffix)
        held = reader.has_tensor(STAGED) and bool(reader.get_tensor(STAGED))
        if held and restore_staged is None:
            log.warning("tfpar: %s: the input positions are a batch past the model (saved "
                        "with Config(ids_ahead=True)); this job skips that batch: resume "
                        "with ids_ahead=True to train on it", prefix)
        session.run([restore] + ([restore_staged] if held and restore_staged is not None
                                 else []), {path: prefix + self._suffix})
        return held and restore_staged is not None


def _step_of(prefix: str) -> int:
    tail = prefix.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def _local():
    return tf.compat.v1.ConfigProto(device_count={"GPU": 0}, inter_op_parallelism_threads=1,
                                    intra_op_parallelism_threads=2)


class Assigner:
    """Ops that set variables of a rewritten graph (replicated copies, PS parts and the
    tiles of split variables) from numpy values of the single-device variables, built once.

    tiles: {variable name: a function from the whole value (read on worker 0 only) to
    this worker's tile, and the tile variable}; their assign ops are collectives that
    every worker runs (`tiled`)."""

    def __init__(self, graph: tf.Graph, local: Dict[str, tf.Variable],
                 parts: Dict[str, list],
                 tiles: Optional[Dict[str, Tuple[object, tf.Variable]]] = None):
        self._graph, self._local, self._parts = graph, local, parts
        self._tiles = dict(tiles or {})
        self._ops: Dict[str, Tuple[tf.Tensor, tf.Operation]] = {}

    def tiled(self, entries: Sequence[Entry]) -> List[Entry]:
        """The entries held as tiles: every worker must run their assign ops together."""
        return [e for e in entries if e.name in self._tiles]

    def assign_ops(self, entries: Sequence[Entry], values) -> Tuple[list, dict]:
        ops, feeds = [], {}
        for e, value in zip(entries, values):
            if e.name not in self._ops:
                self._ops[e.name] = self._build(e)
            ph, op = self._ops[e.name]
            ops.append(op)
            feeds[ph] = value
        return ops, feeds

    def _build(self, e: Entry):
        with self._graph.as_default(), tf.compat.v1.name_scope("tfpar/restore/"):
            ph = tf.compat.v1.placeholder(e.dtype, e.shape)
            if e.name in self._tiles:
                tile_of, var = self._tiles[e.name]
                return ph, tf.compat.v1.assign(var, tile_of(ph)).op
            if e.name in self._parts:
                assigns = []
                for var, part in self._parts[e.name]:
                    with tf.device(var.device):
                        assigns.append(tf.compat.v1.assign(var, piece_of(ph, part)).op)
                return ph, tf.group(*assigns)
            if e.name not in self._local:
                raise TfparError(f"variable {e.name!r} is not in the graph tfpar runs")
            var = self._local[e.name]
            return ph, tf.compat.v1.assign(var, ph).op
