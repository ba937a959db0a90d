"""The AR rewrite: combine every worker's raw gradients with Horovod collectives.

Each collective is inserted between the raw gradient (what `tf.gradients` produced) and all
of its consumers, so post-processing such as clipping by global norm sees the combined
gradient exactly as single-device training on the concatenated batch would.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, Dict, List, Optional

import tensorflow as tf

from tfpar.plan import Plan
from tfpar.transform import packed, surgery
from tfpar.plan.cost import allreduce_bytes
from tfpar.graph.naming import safe_name
from tfpar.transform.traffic import Traffic, nbytes


def apply_allreduce(graph: tf.Graph, plan: Plan, traffic: Optional[Traffic] = None,
                    skip=()) -> Dict[str, str]:
    """Rewrites `graph` in place for the plan's allreduce and allgather routes.

    Returns {raw gradient tensor name: name of the combined tensor that replaced it}.
    `traffic`, if given, counts each collective's bytes per worker (ring algorithms).
    skip: raw gradients already combined (`Plan.allreduce_by_alltoall`: by the sharded
    rewrite's all-to-all).
    """
    replaced: Dict[str, str] = {}
    if plan.num_workers < 2:
        return replaced
    n = plan.num_workers
    gathered: List[_Gathered] = []
    with graph.as_default():
        for v in plan.variables:
            for k, g in enumerate(v.gradients):
                if g.values in skip:
                    continue
                scope = f"tfpar/{v.route}/{safe_name(v.name)}_{k}/"
                group = g.group
                with tf.compat.v1.name_scope(scope), _of_group(traffic, group):
                    values = graph.get_tensor_by_name(g.values)
                    indices = None if g.indices is None else graph.get_tensor_by_name(g.indices)
                    average = v.reduction == "average"
                    if v.route == "allreduce" and indices is not None:
                        flagged = _flagged_sums(values, indices, v.shape[0])
                        finish = functools.partial(_touched_rows, values, indices, average, n)
                        if plan.allreduce_by_allgather:
                            gathered.append(_Gathered(scope, flagged, None, finish, group))
                            continue
                        combined = finish(_allreduce_sum(flagged, n, traffic, "allreduce_rows"))
                    elif v.route == "allreduce":
                        if plan.allreduce_by_allgather:
                            gathered.append(_Gathered(scope, values, None, functools.partial(
                                _averaged, values, average, n), group))
                            continue
                        combined = {values: allreduce(values, average, n, traffic)}
                    elif v.route == "allgather":
                        sent_values, sent_indices = (_summed_by_id(values, indices)
                                                     if g.sum_duplicates else (values, indices))
                        gathered.append(_Gathered(scope, sent_values, sent_indices,
                                                  functools.partial(_gathered_rows, values,
                                                                    indices, average, n),
                                                  group))
                        continue
                    else:
                        continue
                _replace(combined, scope, replaced)
        for combined, scope in _allgathered(gathered, n, traffic):
            _replace(combined, scope, replaced)
    return replaced


@dataclasses.dataclass
class _Gathered:
    """One tensor for the step's allgather: `ids` None for a tensor summed over the
    workers (`finish(sum)`), else a sparse gradient's rows and ids (`finish(everyone's
    rows, everyone's ids)`); `finish` returns {old tensor: combined}."""
    scope: str
    sent: tf.Tensor
    ids: Optional[tf.Tensor]
    finish: Callable
    group: int = 0  # Plan.update_groups: packed only with the tensors of its group


def _replace(combined, scope, replaced: Dict[str, str]) -> None:
    """Every use of each old tensor in `combined` now reads its new one, except the uses
    under `scope` (a name scope or a tuple of them: the collective's own)."""
    for old, new in combined.items():
        surgery.replace_uses(old, new, keep=[c for c in old.consumers()
                                             if c.name.startswith(scope)])
        replaced[old.name] = new.name


def _allgathered(gathered: List[_Gathered], n: int, traffic: Optional[Traffic]):
    """The step's allgathered tensors, one allgather per dtype (`packed.allgather_many`:
    two or three rounds a step fewer than Horovod's own, which gathers rows and each width
    of ids apart; with `Plan.allreduce_by_allgather` the allreduce's round too) and update
    group (a run of one group must not wait for another's gradients). A tensor summed
    over the workers is summed in rank order, the same sum on every worker. Yields
    ({old tensor: combined}, the scopes whose uses keep the old one)."""
    by_dtype: Dict[tuple, List[_Gathered]] = {}
    for item in gathered:
        by_dtype.setdefault((item.group, item.sent.dtype.base_dtype), []).append(item)
    for (group, dtype), items in sorted(by_dtype.items(), key=lambda kv: (kv[0][0],
                                                                             kv[0][1].name)):
        tag = dtype.name + (f"_group_{group}" if group else "")
        scope = f"tfpar/allgather/packed_{tag}/"
        with tf.compat.v1.name_scope(scope):
            pieces, rows_at, ids_at = [], [], {}
            for item in items:
                rows_at.append(len(pieces))
                pieces.append(tf.reshape(item.sent, [-1]))
                if item.ids is not None and item.ids.name not in ids_at:
                    ids_at[item.ids.name] = len(pieces)  # ids shared (a softmax's weights, bias)
                    pieces.append(packed.as_elements(tf.cast(item.ids, tf.int64), dtype))
            everyone, mine, got = packed.allgather_many(pieces, n, f"allgather_{tag}")
            if traffic is not None:  # a ring passes on everyone else's rows
                with traffic.of_group(group):
                    traffic.add("allgather", 2.0 * (nbytes(got) - nbytes(mine)))
        for item, at in zip(items, rows_at):
            with tf.compat.v1.name_scope(item.scope):
                shape = _shape_of(item.sent)
                if item.ids is None:
                    every = tf.unstack(tf.reshape(everyone[at], [n, -1]), n)
                    combined = item.finish(tf.reshape(tf.add_n(every), shape))
                else:
                    ids = packed.from_elements(everyone[ids_at[item.ids.name]], dtype)
                    rows = tf.reshape(everyone[at], [-1] + shape[1:] if isinstance(shape, list)
                                      else tf.concat([[-1], shape[1:]], 0))
                    combined = item.finish(rows, ids)
            yield combined, (scope, item.scope)


def _of_group(traffic: Optional[Traffic], group: int):
    return traffic.of_group(group) if traffic is not None else contextlib.nullcontext()


def _shape_of(t: tf.Tensor):
    return t.shape.as_list() if t.shape.is_fully_defined() else tf.shape(t)


def _averaged(values: tf.Tensor, average: bool, n: int, total: tf.Tensor):
    return {values: total / tf.constant(n, total.dtype) if average else total}


def _gathered_rows(values: tf.Tensor, indices: tf.Tensor, average: bool, n: int,
                   rows: tf.Tensor, ids: tf.Tensor):
    if average:
        rows = rows / tf.cast(n, rows.dtype)
    return {values: rows, indices: tf.cast(ids, indices.dtype)}


def _summed_by_id(values: tf.Tensor, indices: tf.Tensor):
    """A worker's sparse gradient with each id once, its rows summed (ids in the order of
    their first appearance): what the update would sum, summed before it is sent."""
    ids, at = tf.unique(indices)
    return tf.math.unsorted_segment_sum(values, at, tf.size(ids)), ids


def _flagged_sums(values: tf.Tensor, indices: tf.Tensor, rows: int) -> tf.Tensor:
    """A sparse gradient as density routing's "allreduce" route sends it: each worker sums
    its rows into a dense [rows, ...] tensor with one more column that flags the rows it
    touched, and the sum over the workers of that tensor (`_touched_rows`) gives the
    update the touched rows (ids in ascending order, each once) and their sums. A sparse
    update applied to each touched row once with its summed gradient is what the
    optimizers' own duplicate handling does, and untouched rows stay untouched (Momentum's
    or Adam's sparse slots)."""
    flat = tf.reshape(values, [-1, values.shape[1:].num_elements()])
    summed = tf.math.unsorted_segment_sum(flat, indices, rows)
    touched = tf.math.unsorted_segment_max(tf.ones_like(indices, values.dtype), indices, rows)
    return tf.concat([summed, tf.maximum(touched, 0)[:, None]], axis=1, name="packed")


def _touched_rows(values: tf.Tensor, indices: tf.Tensor, average: bool, n: int,
                  total: tf.Tensor) -> Dict[tf.Tensor, tf.Tensor]:
    """The touched rows and their sums from every worker's `_flagged_sums` summed."""
    ids = tf.cast(tf.where(total[:, -1] > 0)[:, 0], indices.dtype)
    rows_values = tf.gather(total[:, :-1], ids)
    if average:
        rows_values = rows_values / tf.cast(n, values.dtype)
    rows_values = tf.reshape(rows_values, [-1] + values.shape[1:].as_list())
    return {values: rows_values, indices: ids}


def _allreduce_sum(x: tf.Tensor, n: int, traffic: Optional[Traffic], name: str) -> tf.Tensor:
    import horovod.tensorflow as hvd
    total = hvd.allreduce(x, op=hvd.Sum, name=name)
    if traffic is not None:
        traffic.add("allreduce", nbytes(x) * allreduce_bytes(1.0, n))
    return total


def allreduce(values: tf.Tensor, average: bool, n: int,
              traffic: Optional[Traffic] = None, name: str = "allreduce") -> tf.Tensor:
    """Horovod allreduce of `values` (average or sum), its bytes counted in `traffic`.

    Always a Horovod sum, averaged here: Horovod fuses only the allreduces that share an
    op and scale factors, so an Average beside the sums of the other rewrites (a sparse
    table's rows, a clipping norm, batch statistics) cost a second collective execution a
    step, 3-4 ms on the 2 x 2 recommender (docs/guide/modes-and-routes.md)."""
    out = _allreduce_sum(values, n, traffic, name)
    return out / tf.constant(n, out.dtype) if average else out
