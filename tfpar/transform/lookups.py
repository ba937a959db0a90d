"""Sparse lookups of replicated tables kept as built: rows gathered, then reduced.

`tf.nn.embedding_lookup_sparse` (and so every `tf.feature_column` embedding and linear
model) builds `segment_<combiner>(gather(table, unique(ids).y), unique(ids).idx, ...)`.
Grappler's SimplifyEmbeddingLookupStage turns that into `segment_<combiner>(table, ids,
...)` to save the gather, which reads the whole table. A resource variable that sparse
updates write is in copy-on-read mode, so that read copies the whole table at every step:
64 MB and 10 ms a step for the recommender's item table here, 5x its single-device step
(`docs/design/sharded-embeddings.md`). A `Snapshot` between the gather and the reduction
keeps the lookup as the user built it; the same rows are summed in the same order, so the
values are bit for bit those of the plain graph.
"""
from __future__ import annotations

from typing import Iterable, Optional

import tensorflow as tf

from tfpar.transform import surgery

REDUCTIONS = ("SparseSegmentSum", "SparseSegmentMean", "SparseSegmentSqrtN",
              "SparseSegmentSumWithNumSegments", "SparseSegmentMeanWithNumSegments",
              "SparseSegmentSqrtNWithNumSegments")
GATHERS = ("ResourceGather", "GatherV2", "Gather")
UNIQUES = ("Unique", "UniqueV2")
_PASS_THROUGH = ("Identity", "ReadVariableOp", "Enter")  # Enter: into a while loop


def keep_lookups_gathered(graph: tf.Graph, variables: Iterable[str]) -> int:
    """Puts a `Snapshot` between each sparse lookup's gather of one of `variables` (names
    of tables updated in place with sparse updates) and its segment reduction, where the
    two have Grappler's pattern; returns how many lookups it kept."""
    names = set(variables)
    kept = 0
    for op in list(graph.get_operations()):
        gather = _lookup_gather(op)
        if gather is None or _table_of(gather) not in names:
            continue
        with graph.as_default(), surgery.in_context_of(op), tf.device(op.device), \
                tf.compat.v1.name_scope(op.name + "_tfpar/"):
            rows = tf.raw_ops.Snapshot(input=op.inputs[0], name="gathered_rows")
        surgery.replace_input(op, 0, rows)
        kept += 1
    return kept


def _lookup_gather(op: tf.Operation) -> Optional[tf.Operation]:
    """The gather of `op` if `op` reduces `gather(table, unique(ids).y)` by
    `unique(ids).idx`, as Grappler's stage matches it; else None."""
    if op.type not in REDUCTIONS:
        return None
    gather = op.inputs[0].op
    while gather.type == "Identity":  # embedding_lookup's; Grappler prunes it first
        gather = gather.inputs[0].op
    if gather.type not in GATHERS:
        return None
    unique = gather.inputs[1].op
    if unique.type not in UNIQUES or op.inputs[1] is not unique.outputs[1]:
        return None
    return gather


def _table_of(gather: tf.Operation) -> Optional[str]:
    """The name of the variable a gather reads (through identities and reads)."""
    source = gather.inputs[0].op
    while source.type in _PASS_THROUGH and source.inputs:
        source = source.inputs[0].op
    return source.name
