"""What `get_runner` measured in the job, as one value that `make_plan` reads.

The user's `Config` says what they asked for; this says what the job found: its links,
how densely each sparse variable's rows are touched (for density routing and local
aggregation), and the partition counts the search (or its memory) decided for
`tfpar.partitioner` groups. Pure data: the runtime layer fills it (tfpar.runtime.measure,
tfpar.runtime.trials); every decision taken from it is `make_plan`'s, and the plan shows it.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Tuple

from tfpar.partition.counts.search import GroupDecision
from tfpar.plan.routing import Links, RouteTrial


@dataclasses.dataclass(frozen=True)
class Measurements:
    """What the job measured before planning; `make_plan` decides from it.

    links: the job's links as a Horovod allreduce sees them (None: nothing measured).
    alphas: {sparse variable: mean fraction of its rows one worker's step touches} for the
    variables whose route density routing decides. sent_rows: {variable: rows one worker's
    gradients carry per step, duplicate ids included}. duplicates: {variable: rows per step
    that a host's workers touch in common} (what local aggregation spares). steps: steps
    measured per worker (0: the rows were not measured, only the links). partitions: {variable: parts} decided in the job for the
    partitioner's groups (they win over Config.partitions for those variables).
    partition_search: {group: how its count was decided}, for the plan to show.
    owner_rows: {sparse variable: {"ranges", "modulo": the rows a step would ask of the
    busiest worker were the variable sharded so; "even": an n-th of the rows asked}}
    (Config.sharded_rows "auto").
    link_balance: {sparse variable: {"modulo", "ranges": how much more than its share of
    the rows asked the busiest host serves were the rows sharded so; "servers",
    "servers_modulo": the same on the parameter servers' parts in row ranges, dealt out
    modulo}} (1: as even as priced; measured on several hosts only), for density routing
    to price each route by its busiest link and for Config.ps_rows "auto".
    routes, local_aggregation: what the fastest route trial ran (they win over density
    routing's choice and "auto" aggregation); route_trials: every trial, for the plan.
    """

    links: Optional[Links] = None
    alphas: Mapping[str, float] = dataclasses.field(default_factory=dict)
    sent_rows: Mapping[str, float] = dataclasses.field(default_factory=dict)
    duplicates: Mapping[str, float] = dataclasses.field(default_factory=dict)
    owner_rows: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)
    link_balance: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)
    steps: int = 0
    partitions: Mapping[str, int] = dataclasses.field(default_factory=dict)
    partition_search: Mapping[str, GroupDecision] = dataclasses.field(default_factory=dict)
    # Route trials (Config(search_routes=True)): the timed candidates, and the routes and
    # local aggregation of the fastest, which overrule the cost model's choice.
    route_trials: Tuple[RouteTrial, ...] = ()
    routes: Mapping[str, str] = dataclasses.field(default_factory=dict)
    local_aggregation: Optional[bool] = None
    routes_remembered: bool = False  # the trials are an earlier job's, not timed now
