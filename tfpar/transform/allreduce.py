"""The AR rewrite: combine every worker's raw gradients with Horovod collectives.

Each collective is inserted between the raw gradient (what `tf.gradients` produced) and all
of its consumers, so post-processing such as clipping by global norm sees the combined
gradient exactly as single-device training on the concatenated batch would.
"""
from __future__ import annotations

from typing import Dict, Optional

import tensorflow as tf

from tfpar.plan import Plan
from tfpar.transform import packed, surgery
from tfpar.plan.cost import allreduce_bytes
from tfpar.graph.naming import safe_name
from tfpar.transform.traffic import Traffic, nbytes


def apply_allreduce(graph: tf.Graph, plan: Plan,
                    traffic: Optional[Traffic] = None) -> Dict[str, str]:
    """Rewrites `graph` in place for the plan's allreduce and allgather routes.

    Returns {raw gradient tensor name: name of the combined tensor that replaced it}.
    `traffic`, if given, counts each collective's bytes per worker (ring algorithms).
    """
    replaced: Dict[str, str] = {}
    if plan.num_workers < 2:
        return replaced
    gathered = []  # (scope, values, indices, sent values, sent indices, average)
    with graph.as_default():
        for v in plan.variables:
            for k, g in enumerate(v.gradients):
                scope = f"tfpar/{v.route}/{safe_name(v.name)}_{k}/"
                with tf.compat.v1.name_scope(scope):
                    values = graph.get_tensor_by_name(g.values)
                    n = plan.num_workers
                    if v.route == "allreduce" and g.indices is not None:
                        indices = graph.get_tensor_by_name(g.indices)
                        combined = _dense_sum_of_rows(values, indices, v.shape[0],
                                                      v.reduction == "average", n, traffic)
                    elif v.route == "allreduce":
                        combined = {values: allreduce(values, v.reduction == "average", n,
                                                      traffic)}
                    elif v.route == "allgather":
                        indices = graph.get_tensor_by_name(g.indices)
                        gathered.append((scope, values, indices) + (
                            _summed_by_id(values, indices) if g.sum_duplicates
                            else (values, indices)) + (v.reduction == "average",))
                        continue
                    else:
                        continue
                _replace(combined, scope, replaced)
        for combined, scope in _allgathered(gathered, plan.num_workers, traffic):
            _replace(combined, scope, replaced)
    return replaced


def _replace(combined, scope, replaced: Dict[str, str]) -> None:
    """Every use of each old tensor in `combined` now reads its new one, except the uses
    under `scope` (a name scope or a tuple of them: the collective's own)."""
    for old, new in combined.items():
        surgery.replace_uses(old, new, keep=[c for c in old.consumers()
                                             if c.name.startswith(scope)])
        replaced[old.name] = new.name


def _allgathered(gathered, n: int, traffic: Optional[Traffic]):
    """The allgather route: every worker's rows and ids of every such gradient, one
    allgather per dtype of rows (`packed.allgather_many`: two or three rounds a step
    fewer than Horovod's own, which gathers rows and each width of ids apart). Yields
    ({old tensor: combined}, the scope whose uses keep the old one)."""
    by_dtype: Dict[tf.DType, list] = {}
    for item in gathered:
        by_dtype.setdefault(item[3].dtype.base_dtype, []).append(item)
    for dtype, items in sorted(by_dtype.items(), key=lambda kv: kv[0].name):
        scope = f"tfpar/allgather/packed_{dtype.name}/"
        with tf.compat.v1.name_scope(scope):
            pieces, rows_at, ids_at = [], [], {}
            for _, _, _, sent_values, sent_indices, _ in items:
                rows_at.append(len(pieces))
                pieces.append(tf.reshape(sent_values, [-1]))
                if sent_indices.name not in ids_at:  # ids shared (a softmax's weights, bias)
                    ids_at[sent_indices.name] = len(pieces)
                    pieces.append(packed.as_elements(tf.cast(sent_indices, tf.int64), dtype))
            everyone, mine, got = packed.allgather_many(pieces, n, f"allgather_{dtype.name}")
            if traffic is not None:  # a ring passes on everyone else's rows
                traffic.add("allgather", 2.0 * (nbytes(got) - nbytes(mine)))
        for k, (item_scope, values, indices, sent_values, sent_indices, average) in \
                enumerate(items):
            with tf.compat.v1.name_scope(item_scope):
                rows = sent_values.shape[1:]
                shape = ([-1] + rows.as_list() if rows.is_fully_defined()
                         else tf.concat([[-1], tf.shape(sent_values)[1:]], 0))
                all_values = tf.reshape(everyone[rows_at[k]], shape)
                if average:
                    all_values = all_values / tf.cast(n, all_values.dtype)
                all_indices = tf.cast(packed.from_elements(everyone[ids_at[sent_indices.name]],
                                                           dtype), indices.dtype)
            yield {values: all_values, indices: all_indices}, (scope, item_scope)


def _summed_by_id(values: tf.Tensor, indices: tf.Tensor):
    """A worker's sparse gradient with each id once, its rows summed (ids in the order of
    their first appearance): what the update would sum, summed before it is sent."""
    ids, at = tf.unique(indices)
    return tf.math.unsorted_segment_sum(values, at, tf.size(ids)), ids


def _dense_sum_of_rows(values: tf.Tensor, indices: tf.Tensor, rows: int, average: bool,
                       n: int, traffic: Optional[Traffic]) -> Dict[tf.Tensor, tf.Tensor]:
    """A sparse gradient combined by one dense allreduce (density routing's "allreduce").

    Each worker sums its rows into a dense [rows, ...] tensor with one more column that
    flags the rows it touched; the allreduce sums both; the update then gets the touched
    rows (ids in ascending order, each once) and their sums. A sparse update applied to
    each touched row once with its summed gradient is what the optimizers' own duplicate
    handling does, and untouched rows stay untouched (Momentum's or Adam's sparse slots).
    """
    import horovod.tensorflow as hvd
    row_shape = values.shape[1:]
    flat = tf.reshape(values, [-1, row_shape.num_elements()])
    summed = tf.math.unsorted_segment_sum(flat, indices, rows)
    touched = tf.math.unsorted_segment_max(tf.ones_like(indices, values.dtype), indices, rows)
    flagged = tf.concat([summed, tf.maximum(touched, 0)[:, None]], axis=1, name="packed")
    total = hvd.allreduce(flagged, op=hvd.Sum, name="allreduce_rows")
    if traffic is not None:
        traffic.add("allreduce", nbytes(flagged) * allreduce_bytes(1.0, n))
    ids = tf.cast(tf.where(total[:, -1] > 0)[:, 0], indices.dtype)
    rows_values = tf.gather(total[:, :-1], ids)
    if average:
        rows_values = rows_values / tf.cast(n, values.dtype)
    rows_values = tf.reshape(rows_values, [-1] + row_shape.as_list())
    return {values: rows_values, indices: ids}


def allreduce(values: tf.Tensor, average: bool, n: int,
              traffic: Optional[Traffic] = None, name: str = "allreduce") -> tf.Tensor:
    """Horovod allreduce of `values` (average or sum), its bytes counted in `traffic`.

    Always a Horovod sum, averaged here: Horovod fuses only the allreduces that share an
    op and scale factors, so an Average beside the sums of the other rewrites (a sparse
    table's rows, a clipping norm, batch statistics) cost a second collective execution a
    step, 3-4 ms on the 2 x 2 recommender (docs/guide/modes-and-routes.md)."""
    import horovod.tensorflow as hvd
    out = hvd.allreduce(values, op=hvd.Sum, name=name)
    if average:
        out = out / tf.constant(n, out.dtype)
    if traffic is not None:
        traffic.add("allreduce", nbytes(values) * allreduce_bytes(1.0, n))
    return out
