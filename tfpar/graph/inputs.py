"""Which runs take a batch from the job's input: those that reach a tf.data iterator's
`get_next`, a TF1 queue's dequeue (`tf.compat.v1.train.batch`, `range_input_producer`)
or a reader's read. Each such run moves the worker's input on by a batch, so a run the
chief makes for itself (TF's summaries at a step with no training in it, say a
learning-rate assignment) must be made by every worker, or the workers' input falls out
of step with single-device training's (which takes that batch of every worker's rows).
It never edits the graph."""
from __future__ import annotations

from typing import Iterable, Union

import tensorflow as tf

from tfpar.graph.row_reads import upstream

INPUT_OPS = frozenset({
    "IteratorGetNext", "IteratorGetNextSync", "IteratorGetNextAsOptional",
    "QueueDequeue", "QueueDequeueV2", "QueueDequeueMany", "QueueDequeueManyV2",
    "QueueDequeueUpTo", "QueueDequeueUpToV2",
    "ReaderRead", "ReaderReadV2", "ReaderReadUpTo", "ReaderReadUpToV2",
})


def takes_input(fetches: Iterable[Union[tf.Operation, tf.Tensor]]) -> bool:
    """Whether running `fetches` (ops or tensors of one graph) takes input (module doc)."""
    ops = [f if isinstance(f, tf.Operation) else f.op for f in fetches]
    return any(op.type in INPUT_OPS for op in upstream(ops))
