"""What the graph analysis finds, as plain values (no TensorFlow): every variable's role,
gradient and updates. `tfpar.graph.analysis` produces them; the planner consumes them."""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from tfpar.errors import Blocker
from tfpar.plan.table import format_table

DEFAULT_GRADIENT_SCOPE = r"(^|/)gradients(_\d+)?/"


@dataclasses.dataclass(frozen=True)
class Gradient:
    """The raw gradient of one update: a dense tensor, or the values and indices of IndexedSlices."""

    kind: str  # "dense" | "sparse"
    values: str  # tensor name
    indices: Optional[str] = None  # tensor name, sparse only
    post_processed: bool = False  # ops (clipping, scaling, ...) stand between it and the update
    values_shape: Tuple[Optional[int], ...] = ()  # static shape of `values` (None: unknown dim)
    # What the update ops read: the raw gradient after post-processing (= raw if none).
    final_values: Optional[str] = None
    final_indices: Optional[str] = None
    # Sparse only: outputs of post-processing ops that sum the gradient's rows (a norm's
    # L2Loss or reduce_sum): on a worker they see its rows only, so they are summed over
    # workers. `inexact` names post-processing that per-worker rows cannot reproduce.
    row_sums: Tuple[str, ...] = ()
    inexact: Optional[str] = None
    # Sparse only: the first post-processing op that is not linear in the rows (a
    # clip_by_value, a square; None: all are, e.g. a scaling), where summing a duplicate
    # id's rows before the post-processing (the dense allreduce and the allgather's
    # de-duplication do) would change what the update gets.
    nonlinear: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Update:
    """One optimizer update of a variable: the ops that write it and its slots, and its gradient."""

    ops: Tuple[str, ...]
    op_types: Tuple[str, ...]
    scope: str  # the optimizer's `.../update_<var>/` name scope, or "" for a lone op
    gradient: Gradient
    slots: Tuple[str, ...]
    # Made inside a TF1 `tf.cond` branch (the variable written through a Switch: a loss
    # scale's "apply only where the gradients are finite"), so a step may skip it.
    conditional: bool = False
    # The update group: updates that every run which makes one of them makes all of (a
    # GAN's two minimize() results, run by turns, are two groups; so are a fine-tuning
    # script's head-only and whole-model ones, though both update the head).
    group: int = 0


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
    # Reads of a sparse trained variable other than row lookups, shape reads and moving
    # averages (op names): a whole read in the step, or another write after the step made
    # from it. Route "sharded" needs none (`tfpar.graph.row_reads`).
    other_reads: Tuple[str, ...] = ()
    # The variables that hold a moving average of a sparse trained variable (shadows an
    # ExponentialMovingAverage updates from it after the step, row by row).
    averages: Tuple[str, ...] = ()
    # Ops that change a trained variable by an amount outside the training step
    # (assign_add, scatter_add, scatter_mul, ...): every worker runs them, so only a route
    # where each value has one writer (replicated copies, sharded rows) applies each once.
    adds_outside: Tuple[str, ...] = ()

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
    blockers: Tuple[Blocker, ...] = ()  # what tfpar cannot handle in this graph, each with its fix
    batch_norms: Tuple[str, ...] = ()  # batch-norm ops in training mode (batch statistics)
    unsynced_batch_norms: Tuple[str, ...] = ()  # batch statistics not taken globally

    @property
    def update_groups(self) -> Tuple[Tuple[str, ...], ...]:
        """The trained variables of each update group (`Update.group`), in group order."""
        groups = {}
        for v in self.trained:
            for u in v.updates:
                groups.setdefault(u.group, []).append(v.name)
        return tuple(tuple(dict.fromkeys(groups[k])) for k in sorted(groups))

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


def _fmt_shape(shape) -> str:
    return "[" + ",".join("?" if d is None else str(d) for d in shape) + "]"


def _fmt_int(n) -> str:
    return "?" if n is None else f"{n:,}"
