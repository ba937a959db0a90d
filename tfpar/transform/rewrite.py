"""`rewrite`: every graph edit a plan asks of one worker's copy of the training graph.

The runner calls this once per session it starts; the transforms it chains (tiles,
parameter servers, allreduce and allgather, batch norms over the global batch, sparse
lookups of whole tables kept as built, then the traffic counters and device pinning)
decide nothing: what they do is in the plan.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional

import tensorflow as tf

from tfpar.plan import Plan
from tfpar.transform import surgery
from tfpar.transform.allreduce import apply_allreduce
from tfpar.transform.batch_norm import apply_sync_batch_norm
from tfpar.transform.parameter_server import PsRewrite, apply_parameter_server, worker_device
from tfpar.transform.input_ahead import InputAhead
from tfpar.transform.lookups import keep_lookups_gathered
from tfpar.transform.sharded import apply_sharding
from tfpar.transform.stages import Markers
from tfpar.transform.tiled import TiledRewrite, apply_tiling
from tfpar.transform.traffic import Traffic


@dataclasses.dataclass
class Rewritten:
    """What the rewrite added that the runner drives: the PS side (None without servers)
    and the tiles of split variables (None without)."""

    ps: Optional[PsRewrite]
    tiled: Optional[TiledRewrite] = None  # split variables: tiled and sharded
    stages: Optional[Markers] = None  # the training step's stage markers
    ahead: Optional[InputAhead] = None  # the input read a step ahead (Plan.ids_ahead)


def rewrite(graph: tf.Graph, plan: Plan, rank: int, ps_prefix: Optional[str] = None
            ) -> Rewritten:
    """Rewrites `graph` in place for worker `rank` of `plan`.

    ps_prefix: names the state on the parameter servers, given when the job has them
    (runners of one job that follow each other use different ones); ops are then pinned
    to this worker's task of the cluster.
    """
    distributed = ps_prefix is not None
    traffic = Traffic(graph, worker_device(rank) if distributed else "")
    markers = Markers(graph, worker_device(rank) if distributed else "")
    tiled = apply_tiling(graph, plan, rank, traffic.counter("tiled"))
    sharded = apply_sharding(graph, plan, rank, traffic.counter("sharded"))
    tiled = _joined(tiled, sharded)
    ps = (apply_parameter_server(graph, plan, rank, traffic, ps_prefix, markers)
          if distributed else None)
    combined = apply_allreduce(graph, plan, traffic,
                               skip=sharded.combined if sharded is not None else {})
    if sharded is not None:
        combined.update(sharded.combined)
    group_of = {t: g.group for v in plan.variables for g in v.gradients
                for t in (g.values, g.indices) if t}
    for group in range(max(1, len(plan.update_groups))):  # each group's runs mark their own
        markers.attach("joined", [graph.get_tensor_by_name(new) for old, new in combined.items()
                                  if group_of.get(old, 0) == group],
                       _collective_updates(graph, plan, group), group)
    apply_sync_batch_norm(graph, plan, traffic)  # last: it rewires what the others read
    keep_lookups_gathered(graph, _updated_in_place(plan))
    _count_steps(graph, plan, ps, traffic.build(max(1, len(plan.update_groups))), tiled)
    if distributed:
        _pin_to_worker(graph, rank)
    ahead = sharded.ahead if sharded is not None else None
    if ahead is not None:
        ahead.check()  # nothing after the sharded rewrite reads the batch unstaged
    return Rewritten(ps, tiled, markers, ahead)


def _joined(tiled: Optional[TiledRewrite], sharded) -> Optional[TiledRewrite]:
    """The variables split over the workers, by the tiled and the sharded rewrites: the
    runner reads, saves and restores both kinds of piece alike (`collectives.whole`)."""
    if sharded is None:
        return tiled
    if tiled is None:
        return TiledRewrite(dict(sharded.tiles), list(sharded.updates), dict(sharded.replaced))
    return TiledRewrite({**tiled.tiles, **sharded.tiles}, tiled.updates + sharded.updates,
                        {**tiled.replaced, **sharded.replaced})


def _updated_in_place(plan: Plan):
    """The sparse variables each worker keeps whole and updates with sparse updates (the
    others live on the servers or are split)."""
    return [v.name for v in plan.variables if v.kind == "sparse" and v.slot_of is None
            and v.route not in ("ps", "sharded", "tiled")]


def _collective_updates(graph: tf.Graph, plan: Plan, group: Optional[int] = None):
    """The update ops of the variables whose gradients the allreduce rewrite combines
    (of update group `group` if given)."""
    return [graph.get_operation_by_name(name) for v in plan.variables
            if v.route in ("allreduce", "allgather") for g in v.gradients
            if group is None or g.group == group for name in g.ops]


def _count_steps(graph: tf.Graph, plan: Plan, ps, traffic_steps: List[tf.Operation],
                 tiled=None):
    """Makes every training step also run the traffic counters' update (its update
    group's)."""
    for group, step in (ps.steps.items() if ps is not None else ()):
        surgery.add_control_inputs(step, [traffic_steps[group]])
    for group, update in (tiled.updates if tiled is not None else ()):
        surgery.add_control_inputs(update, [traffic_steps[group]])
    for group, step in enumerate(traffic_steps):
        for update in _collective_updates(graph, plan, group):
            surgery.add_control_inputs(update, [step])


def _pin_to_worker(graph: tf.Graph, rank: int):
    """Ops placed on no job run on this worker (the PS ops were placed explicitly)."""
    for op in graph.get_operations():
        spec = tf.DeviceSpec.from_string(op.device or "")
        if spec.job is None:
            surgery.set_device(op, spec.replace(job="worker", task=rank).to_string())
