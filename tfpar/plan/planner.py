"""Deciding the Plan: the route of every variable, from the analysis, the config and the layout.

- AR: dense gradients -> Horovod allreduce, sparse -> Horovod allgather.
- HYBRID (default): dense -> allreduce; sparse variables (and their optimizer slots) live on
  the parameter servers, one PS task per host, split into row ranges balanced by bytes,
  unless `Config.sparse_route` sends them through a dense allreduce or an allgather (or
  density routing measured that one is faster). With no sparse variable on the parameter
  servers it runs as AR.
- PS: every trained variable lives on the parameter servers.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Set, Tuple

from tfpar.plan import cost, routing
from tfpar.plan.graph_facts import GraphAnalysis, VariableInfo
from tfpar.plan.config import Config
from tfpar.errors import Blocker, NotYetSupportedError, TfparError, raise_blockers
from tfpar.plan import GradientPlan, PartPlan, Plan, VariablePlan
from tfpar.plan.layout import Layout
from tfpar.plan.measurements import Measurements
from tfpar.partition.tiling.cuts import Cut, Tiling

# Sparse optimizer kernels: a sparse variable updated by anything else gets a dense update.
_SPARSE_WRITERS_PREFIXES = ("ResourceSparseApply", "SparseApply", "ResourceScatter", "Scatter")


def make_plan(analysis: GraphAnalysis, config: Config, layout: Layout,
              measured: Optional[Measurements] = None) -> Plan:
    """Routes every variable of `analysis` for `config.run_mode` on `layout`.

    measured: what the job measured (tfpar.runtime.measure): with its links, density
    routing chooses the routes of sparse_route "auto" variables and local aggregation
    "auto" is decided; its partition counts split the partitioner's groups. Without it,
    those choices fall back to their defaults and the plan says so.
    """
    measured = measured or Measurements()
    n = layout.num_workers
    notes: List[str] = []
    mode, on_ps, sparse_routes, density = _routes(analysis, config, layout, measured, notes)
    blockers: List[Blocker] = list(analysis.blockers)
    parts = _parts(analysis, config, measured.partitions, on_ps, len(layout.hosts), notes,
                   measured.link_balance)
    variables = []
    rows = {name: _row_tiling(name, config, n, measured, notes)
            for name in sorted(sparse_routes) if sparse_routes[name] == "sharded"}
    # Moving averages of sharded variables are split alike (their updates are row-wise).
    shadows = {s: v.name for v in analysis.trained for s in v.averages
               if sparse_routes.get(v.name) == "sharded"}
    for v in analysis.variables:
        try:
            if v.name in on_ps:
                variables.append(_ps_plan(v, config, n, parts[v.name]))
            elif v.name in shadows:
                variables.append(VariablePlan(route="sharded", tiling=rows[shadows[v.name]],
                                              slot_of=shadows[v.name], **_common(v)))
            elif v.role == "slot" and sparse_routes.get(v.slot_of) == "sharded":
                owner = analysis.variable(v.slot_of)
                if v.shape[:1] != owner.shape[:1]:
                    raise NotYetSupportedError(
                        f"slot {v.name!r} of {owner.name!r} has shape {list(v.shape)}, not the "
                        "variable's rows: tfpar cannot shard it with its variable")
                variables.append(VariablePlan(route="sharded", tiling=rows[owner.name],
                                              slot_of=owner.name, **_common(v)))
            elif v.role == "slot" and v.slot_of in on_ps:
                owner = analysis.variable(v.slot_of)
                if v.shape[:1] != owner.shape[:1]:
                    raise NotYetSupportedError(
                        f"slot {v.name!r} of {owner.name!r} has shape {list(v.shape)}, not the "
                        "variable's rows: tfpar cannot split it with its variable")
                variables.append(VariablePlan(route="ps", parts=parts[owner.name],
                                              slot_of=owner.name, **_common(v)))
            else:
                variables.append(_variable_plan(
                    v, config, n, sparse_routes.get(v.name), rows=rows.get(v.name),
                    summed=v.kind == "sparse" and _rows_summed(
                        v, config, measured.links, measured.alphas.get(v.name),
                        measured.sent_rows.get(v.name), n)))
        except TfparError as e:
            blockers.append(Blocker(v.name, str(e), isinstance(e, NotYetSupportedError)))
    raise_blockers(blockers)
    plan = Plan(run_mode=config.run_mode, mode=mode, num_workers=n,
                hosts=tuple((h.name, h.slots) for h in layout.hosts), variables=tuple(variables),
                global_step=analysis.global_step,
                partition_search=dict(measured.partition_search) or None)
    # Local aggregation combines the pushes of the servers' route and the row gradients of
    # route "sharded" per host before they cross to the other hosts.
    sharded = {v.name for v in variables if v.route == "sharded" and v.slot_of is None}
    aggregated = bool(on_ps or sharded)
    wanted = config.local_aggregation
    if (wanted == "auto" and aggregated and len(layout.hosts) > 1 and config.sync
            and measured.routes and measured.local_aggregation is not None):
        wanted = measured.local_aggregation
        notes.append(f"local aggregation {'on' if wanted else 'off'} (route trials)")
    elif wanted == "auto" and aggregated and len(layout.hosts) > 1 and config.sync:
        decided = None
        if density is not None and aggregation_measured(config, layout):
            decided = decide_aggregation(plan, analysis, dict(measured.duplicates),
                                         measured.links, _ahead(config))
            density = dataclasses.replace(density, aggregation=decided)
        wanted = bool(decided and decided.on)
        notes.append("local aggregation " + ("not measured: off (it is measured in the job, by "
                                             "get_runner)" if decided is None else
                                             f"{'on' if decided.on else 'off'} (measured): "
                                             f"{decided.reason}"))
    local_aggregation = aggregated and bool(wanted) and len(layout.hosts) > 1
    if aggregated and wanted and not local_aggregation:
        notes.append("one host: local aggregation off (nothing crosses a host's link)")
    if not config.sync:
        if on_ps:
            local_aggregation = False
            notes.append("asynchronous: every worker applies its own gradients to the "
                         "parameter servers' variables as soon as it has them"
                         + ("; allreduce routes stay synchronous" if mode == "HYBRID" else ""))
        else:
            notes.append("sync=False has no effect: no variable is on the parameter servers")
    batch_norms = analysis.batch_norms if n > 1 else ()
    if batch_norms:
        notes.append(f"{len(batch_norms)} batch norm(s) in training mode: normalised over the "
                     "global batch (every worker's rows; four allreduces each per step, two "
                     "of them in the backward)")
    if analysis.unsynced_batch_norms and n > 1:
        notes.append("not single-device training: the batch statistics of "
                     f"{', '.join(analysis.unsynced_batch_norms)} are each worker's own rows' "
                     "(a fused batch norm inside a function other than Keras's tf.cond for "
                     "training=<a tensor>, or a mean named as tf.nn.moments's but not built "
                     "by it); fused batch norms, tf.nn.moments and Keras's training "
                     "tensor's tf.cond are normalised over the global batch")
    variables, groups = _update_groups(variables)
    plan = dataclasses.replace(plan, variables=tuple(variables))
    ids_ahead = False
    if config.ids_ahead:
        sparse = [v for v in variables if v.slot_of is None and v.kind == "sparse"]
        why = ("no variable is on route 'sharded'" if not sharded else
               "the variables are updated by different runs (the batch read ahead would "
               "be read by another run)" if groups else
               "a sparse variable is not on route 'sharded'"
               if any(v.route != "sharded" for v in sparse) else
               "local aggregation is on (its host exchange needs the ids in the step)"
               if local_aggregation else None)
        ids_ahead = why is None
        notes.append("ids ahead: " + ("each batch's ids go to their owners during the step "
                                      "before" if ids_ahead else f"off: {why}"))
    folded = _allreduce_by_allgather(variables, config, measured.links, n, notes,
                                     density.choices if density else {})
    by_alltoall = not folded and _allreduce_by_alltoall(
        variables, config, measured.links, n, notes, local_aggregation, groups)
    if folded or by_alltoall:  # the allreduced gradients' bytes as the allgather moves them
        plan = plan.with_predicted({v.name: cost.allgather_bytes(_allreduced_bytes(v), n)
                                    for v in variables if v.route == "allreduce"
                                    and v.gradients and _allreduced_bytes(v) is not None})
    return dataclasses.replace(plan, sync=config.sync or not on_ps, notes=tuple(notes),
                               local_aggregation=local_aggregation, routing=density,
                               batch_norms=batch_norms, ids_ahead=ids_ahead,
                               allreduce_by_allgather=folded,
                               allreduce_by_alltoall=by_alltoall, update_groups=groups)


def _allreduce_by_allgather(variables: List[VariablePlan], config: Config,
                            links: Optional[routing.Links], n: int, notes: List[str],
                            priced: Dict[str, routing.RouteChoice]) -> bool:
    """Whether the step's allreduced gradients travel in route "allgather"'s allgather
    (`Config.allreduce_by_allgather`; "auto": where the measured links say their bytes
    take less time in the allgather, at its own cost per byte, than in an allreduce of
    their own, its latency included: 0.8x the LM's step at 128 words and 1 Gbit/s, 2 x 2,
    docs/results/allreduce_by_allgather). priced: density routing's choices, whose
    predictions price the sparse variables on the dense route as it did."""
    wanted = config.allreduce_by_allgather
    reduced = [v for v in variables if v.route == "allreduce" and v.gradients]
    if (wanted is False or n < 2 or not reduced
            or not any(v.route == "allgather" and v.gradients for v in variables)):
        return False
    if wanted is True:
        notes.append("allreduce by allgather: on (Config)")
        return True
    sizes = [_allreduced_bytes(v) for v in reduced]
    if links is None or None in sizes:
        notes.append("allreduce by allgather: off (the links were not measured; "
                     "Config(allreduce_by_allgather=True) turns it on)")
        return False
    rode = {v.name: priced[v.name] for v in reduced
            if v.name in priced and priced[v.name].folded_s is not None}
    delta = routing.fold_delta_s(rode, routing.Fold(routing.fold_seconds(
        sum(size for v, size in zip(reduced, sizes) if v.name not in rode), n, links,
        forced=True)))
    on = delta < 0
    notes.append(f"allreduce by allgather: {'on' if on else 'off'} (measured): "
                 f"{sum(sizes):,.0f} bytes of allreduced gradients take {1e3 * delta:+.3f} ms "
                 "in the allgather against their own allreduce (its round and bytes)")
    return on


def _allreduce_by_alltoall(variables: List[VariablePlan], config: Config,
                           links: Optional[routing.Links], n: int, notes: List[str],
                           local_aggregation: bool, groups) -> bool:
    """Whether the step's dense gradients travel in route "sharded"'s gradient all-to-all
    (`Config.allreduce_by_allgather` where no allgather runs): each worker's gradient sent
    whole to every worker beside the rows, summed in rank order there, so the step runs one
    collective fewer (the dense allreduce: 6.6 ms of the LM's sharded step at 128 words,
    1 Gbit/s, 2 x 2, docs/results/dense_fold_bound). "auto": where the measured links say
    the bytes added take less time than the allreduce they spare, its round included."""
    wanted = config.allreduce_by_allgather
    reduced = [v for v in variables if v.route == "allreduce" and v.gradients]
    sharded = [v for v in variables if v.route == "sharded" and v.slot_of is None
               and v.gradients]
    if wanted is False or n < 2 or not reduced or not sharded:
        return False
    why = ("a table on route 'allreduce' (only dense gradients ride)"
           if any(v.kind != "dense" for v in reduced) else
           "local aggregation is on (the gradients go to the host's collectors first)"
           if local_aggregation else
           "the variables are updated by different runs" if groups else
           "the dense gradients' dtypes differ from the sharded rows'"
           if len({v.dtype for v in reduced + sharded}) > 1 else
           "a sharded gradient's post-processing sums over rows (a global norm reads the "
           "dense gradients combined)"
           if any(g.row_sums for v in sharded for g in v.gradients) else None)
    if why is None and wanted is not True:  # "auto"
        sizes = [_allreduced_bytes(v) for v in reduced]
        if links is None or None in sizes:
            why = ("the links were not measured; Config(allreduce_by_allgather=True) turns "
                   "it on")
        else:
            delta = routing.fold_seconds(sum(sizes), n, links, forced=True, via="alltoall")
            if delta >= 0:
                why = (f"measured: {sum(sizes):,.0f} bytes of dense gradients would take "
                       f"{1e3 * delta:+.3f} ms in the all-to-all against their own allreduce")
    notes.append("dense allreduce in the sharded all-to-all: " + (
        "on" + (" (Config)" if wanted is True else " (measured)") if why is None
        else f"off ({why})"))
    return why is None


def _update_groups(variables) -> Tuple[List[VariablePlan], Tuple[Tuple[str, ...], ...]]:
    """The variables with their updates' groups numbered from 0 in order, and
    Plan.update_groups (() where one run makes every update)."""
    number: Dict[int, int] = {}
    for v in variables:
        for g in v.gradients:
            number.setdefault(g.group, len(number))
    if len(number) < 2:
        number = {k: 0 for k in number}
    out, names = [], {}
    for v in variables:
        grads = tuple(dataclasses.replace(g, group=number[g.group]) for g in v.gradients)
        for g in grads:
            names.setdefault(g.group, []).append(v.name)
        out.append(dataclasses.replace(v, gradients=grads) if grads else v)
    groups = tuple(tuple(dict.fromkeys(names[k])) for k in sorted(names))
    return out, (groups if len(groups) > 1 else ())


def _ahead(config: Config) -> bool:
    """Whether the ids go a step ahead where the plan allows it (every sparse variable
    sharded, no local aggregation: `make_plan`): Config.ids_ahead."""
    return bool(config.ids_ahead)


def _fold(analysis: GraphAnalysis, config: Config, n: int,
          links: routing.Links) -> Optional[routing.Fold]:
    """The fold of the step's allreduce into the allgather as density routing prices it
    (`routing.Fold`; None where Config refuses it)."""
    if config.allreduce_by_allgather is False or n < 2:
        return None
    dense = sum((v.nbytes or 0) * len(v.updates) for v in analysis.trained if v.kind == "dense")
    norm = any(u.gradient.row_sums for v in analysis.trained if v.kind == "sparse"
               for u in v.updates)  # the sharded rows' post-processing reads them summed
    return routing.Fold(routing.fold_seconds(dense, n, links, forced=True),
                        forced=config.allreduce_by_allgather is True,
                        alltoall_s=None if norm else routing.fold_seconds(
                            dense, n, links, forced=True, via="alltoall"))


def _allreduced_bytes(v: VariablePlan) -> Optional[float]:
    """Bytes a worker puts into the allreduce of variable `v` (route "allreduce") a step:
    its dense gradients, or for a sparse one its rows summed into the whole table with a
    column of flags (tfpar.transform.allreduce)."""
    if v.nbytes is None:
        return None
    if v.kind == "sparse":
        rows = v.shape[0]
        return float(rows * (v.nbytes // rows + 4) * len(v.gradients))
    return float(v.nbytes * len(v.gradients))


def on_parameter_servers(analysis: GraphAnalysis, config: Config, layout: Layout,
                         measured: Optional[Measurements] = None) -> Tuple[str, Set[str]]:
    """The mode that runs and the variables `make_plan` puts on the parameter servers,
    without the rest of the plan (what the job asks before it measures or searches)."""
    mode, on_ps, _, _ = _routes(analysis, config, layout, measured or Measurements(), [])
    return mode, on_ps


def aggregated(analysis: GraphAnalysis, config: Config, layout: Layout) -> Set[str]:
    """The variables whose gradients local aggregation would combine per host before
    measuring (on the parameter servers, or sharded by `Config.sparse_route`)."""
    mode, on_ps, sparse_routes, _ = _routes(analysis, config, layout, Measurements(), [])
    return on_ps | {name for name, r in sparse_routes.items() if r == "sharded"}


def _routes(analysis: GraphAnalysis, config: Config, layout: Layout, measured: Measurements,
            notes: List[str]):
    """(the mode that runs, the variables on the parameter servers, {sparse variable:
    route} in HYBRID, density routing's decision or None)."""
    density = None
    if measured.links is not None and measured.steps:  # rows measured: density routing
        density = route_by_density(analysis, config, layout, dict(measured.alphas),
                                   measured.links, measured.steps, dict(measured.sent_rows),
                                   dict(measured.duplicates), measured)
    if density is not None and measured.routes:
        density = _with_trial_routes(density, measured)
    sparse_routes = _sparse_routes(analysis, config, density, notes, layout.num_workers)
    if density is not None:
        if density.trials_remembered:
            notes.append("route trials remembered from an earlier job of this graph and "
                         "layout (search_routes='force' times them again)")
        notes.extend(f"route trial {k + 1}: {t.describe()}" for k, t in enumerate(density.trials))
    sparse = [name for name, r in sparse_routes.items() if r == "ps"]
    if config.run_mode == "HYBRID" and not sparse:
        mode = "AR"
        notes.append("no sparse variable: HYBRID runs as AR (dense allreduce)" if not sparse_routes
                     else "no sparse variable on the parameter servers: HYBRID runs as AR")
    else:
        mode = config.run_mode
    on_ps = {v.name for v in analysis.trained
             if mode == "PS" or (mode == "HYBRID" and sparse_routes.get(v.name) == "ps")}
    return mode, on_ps, sparse_routes, density


def _with_trial_routes(density: routing.Routing, measured: Measurements) -> routing.Routing:
    """Density routing's decision with the routes a timed trial ran (the fastest of the
    route trials, or the trial being run), each choice saying so."""
    best = routing.fastest_trial(tuple(measured.route_trials))
    why = (f"route trials: the fastest was {best.describe()}" if best is not None
           else "a route trial")
    choices = {}
    for name, c in density.choices.items():
        route = measured.routes.get(name, c.route)
        reason = why if route == c.route else f"{why} (the model chose {c.route}: {c.reason})"
        choices[name] = dataclasses.replace(c, route=route, reason=reason)
    return dataclasses.replace(density, choices=choices, trials=tuple(measured.route_trials),
                               trials_remembered=measured.routes_remembered)


def density_candidates(analysis: GraphAnalysis, config: Config) -> List[VariableInfo]:
    """The sparse variables whose route density routing decides (measured in the job)."""
    if config.run_mode != "HYBRID" or config.sparse_route in routing.FIXED_SPARSE_ROUTES:
        return []
    forced = config.sparse_route if isinstance(config.sparse_route, dict) else {}
    return [v for v in analysis.trained if v.kind == "sparse" and v.name not in forced]


def route_by_density(analysis: GraphAnalysis, config: Config, layout: Layout,
                     alphas: Dict[str, float], links: routing.Links, steps: int,
                     sent: Optional[Dict[str, float]] = None,
                     shared: Optional[Dict[str, float]] = None,
                     measured: Optional[Measurements] = None) -> routing.Routing:
    """Density routing's choice for the measured candidates (and the forced routes).
    sent: {name: rows one worker's gradients carry per step} (None: no duplicate ids);
    shared: {name: rows per step the workers of a host touch in common, summed over hosts}
    (what local aggregation spares the servers' route; None: not measured); measured: its
    `link_balance` and `owner_rows` price each route by its busiest host link (None:
    every host's link as loaded as the others)."""
    forced = config.sparse_route if isinstance(config.sparse_route, dict) else {}
    candidates, aggregating = _candidates(analysis, config, layout, alphas, links, sent, shared,
                                          measured)
    fold = _fold(analysis, config, layout.num_workers, links)
    ahead = _ahead(config)
    choices = routing.decide(tuple(candidates), layout.num_workers, links, dict(forced),
                             aggregating, fold, ahead)
    if aggregating and config.local_aggregation == "auto":
        plain = routing.decide(tuple(dataclasses.replace(c, aggregation_s=0.0)
                                     for c in candidates), layout.num_workers, links,
                               dict(forced), False, fold, ahead)
        paid = tuple(forced.values())
        if routing.predicted_step_s(plain, links, False, paid, fold, ahead) <= \
                routing.predicted_step_s(choices, links, True, paid, fold, ahead):
            choices = plain
    for name in forced:  # not measured: no density, no prediction shown
        choices[name] = routing.RouteChoice(forced[name], None,
                                            reason="set by tfpar.Config(sparse_route=...)")
    return routing.Routing(links, choices, steps)


def _candidates(analysis: GraphAnalysis, config: Config, layout: Layout,
                alphas: Dict[str, float], links: routing.Links,
                sent: Optional[Dict[str, float]], shared: Optional[Dict[str, float]],
                measured: Optional[Measurements] = None):
    """(the measured variables as density routing prices them, whether the hosts would
    aggregate their pushes and row gradients). Local aggregation on the servers' and the
    sharded routes is on unless refused; its "auto" is decided with the routes (both
    priced, the faster step taken)."""
    aggregating = (config.local_aggregation is not False and config.sync
                   and len(layout.hosts) > 1 and max(h.slots for h in layout.hosts) > 1)
    hosts = len(layout.hosts)
    candidates = []
    for name, alpha in sorted(alphas.items()):
        v = analysis.variable(name)
        load = measured.link_balance.get(name, {}) if measured is not None else {}
        way = _sharded_way(name, config, measured.owner_rows if measured is not None else {})
        row_bytes = (v.nbytes or 0) // max(v.shape[0], 1)
        saving = routing.aggregation_saving_s((shared or {}).get(name, 0.0), row_bytes,
                                              len(layout.hosts), links) if aggregating else 0.0
        candidates.append(routing.Candidate(
            name, v.shape[0], row_bytes, alpha, len(v.updates),
            # an allgather of rows summed by id first carries alpha * rows per gradient
            sent_rows=None if _rows_summed(v, config, links, alpha, (sent or {}).get(name),
                                           layout.num_workers)
            else (sent or {}).get(name), dense_route=_dense_route_problem(v) is None,
            sharded_route=_sharded_problem(v, config, layout.num_workers) is None,
            ps_route=_replicated_only(v) is None and _ps_problem(v) is None,
            aggregation_s=saving, parts=ps_part_count(v, config, hosts),
            servers_balance=load.get("servers" if _ps_way(name, config, {name: load})
                                     == "ranges" else "servers_modulo", 1.0),
            sharded_balance=load.get(way, 1.0)))
    return tuple(candidates), aggregating


def ps_part_count(v: VariableInfo, config: Config, hosts: int) -> int:
    """The parts density routing prices sparse variable `v` in on the servers' route: as
    Config.partitions asks, else one a host (a search's count is decided later)."""
    requested = config.partitions if isinstance(config.partitions, dict) else {}
    return min(_part_count(v, config, requested, hosts), max(v.shape[0] or 1, 1))


# A set of routes the model predicts slower than CUTOFF x its best plus SLACK is not
# timed (the model prices communication only, so a few ms are within its error).
TRIAL_PREDICTION_CUTOFF = 4.0
TRIAL_PREDICTION_SLACK_S = 0.02


def route_trials(analysis: GraphAnalysis, config: Config, layout: Layout,
                 measured: Measurements) -> Tuple[routing.RouteTrial, ...]:
    """The sets of routes `Config(search_routes=True)` times in the job, the model's choice
    first: then every measured variable on one route (where it can take it), with local
    aggregation on and off where "auto" decides it and a route aggregates; ranked by the
    model's step time, those over TRIAL_PREDICTION_CUTOFF x its best (plus
    TRIAL_PREDICTION_SLACK_S) dropped, at most
    `config.search_trials`. Empty when density routing has nothing to decide."""
    if measured.links is None or not measured.steps or not measured.alphas:
        return ()
    links, n = measured.links, layout.num_workers
    forced = config.sparse_route if isinstance(config.sparse_route, dict) else {}
    candidates, aggregating = _candidates(analysis, config, layout, dict(measured.alphas),
                                          links, dict(measured.sent_rows),
                                          dict(measured.duplicates), measured)
    plain = tuple(dataclasses.replace(c, aggregation_s=0.0) for c in candidates)
    allowed = {c.name: routing.allowed_routes(c, n) for c in candidates}

    fold = _fold(analysis, config, n, links)

    def predicted(routes, aggregation):
        choices = routing.decide(candidates if aggregation else plain, n, links,
                                 {**forced, **routes}, aggregation, fold, _ahead(config))
        return routing.predicted_step_s(choices, links, aggregation, tuple(forced.values()),
                                        fold, _ahead(config))

    def variants(routes):
        if not aggregating or not set(routes.values()) & {"ps", "sharded"}:
            return [None]
        return [True, False] if config.local_aggregation == "auto" else [None]

    def label(routes, aggregation):
        counts = {r: sum(1 for x in routes.values() if x == r) for r in routing.SPARSE_ROUTES}
        text = ", ".join(f"{r} x{k}" for r, k in counts.items() if k)
        return text + ("" if aggregation is None else
                       f", aggregation {'on' if aggregation else 'off'}")

    model = route_by_density(analysis, config, layout, dict(measured.alphas), links,
                             measured.steps, dict(measured.sent_rows), dict(measured.duplicates),
                             measured)
    chosen = {name: c.route for name, c in model.choices.items() if name not in forced}
    aggregation = None  # the model's, where "auto" decides it for these routes
    if variants(chosen) != [None]:
        aggregation = make_plan(analysis, config, layout, measured).local_aggregation
    first = routing.RouteTrial(
        "the model's choice: " + label(chosen, aggregation), chosen, aggregation,
        predicted(chosen, aggregating if aggregation is None else aggregation))
    seen, others = {(tuple(sorted(chosen.items())), aggregation)}, []
    for route in routing.SPARSE_ROUTES:
        routes = routing.uniform_routes({k: model.choices[k] for k in chosen}, route, allowed)
        for aggregation in variants(routes):
            key = (tuple(sorted(routes.items())), aggregation)
            if key in seen:
                continue
            seen.add(key)
            others.append(routing.RouteTrial(
                label(routes, aggregation), routes, aggregation,
                predicted(routes, aggregating if aggregation is None else aggregation)))
    best = min([first.predicted_s] + [t.predicted_s for t in others])
    cutoff = TRIAL_PREDICTION_CUTOFF * best + TRIAL_PREDICTION_SLACK_S
    others = sorted((t for t in others if t.predicted_s <= cutoff),
                    key=lambda t: t.predicted_s)
    return (first,) + tuple(others[:max(config.search_trials - 1, 0)])


def aggregation_measured(config: Config, layout: Layout) -> bool:
    """Whether local aggregation "auto" has something to decide on this layout (not one
    host, a host with two workers, synchronous training, parameter servers possible)."""
    return (config.local_aggregation == "auto" and config.run_mode != "AR" and config.sync
            and len(layout.hosts) > 1 and max(h.slots for h in layout.hosts) > 1)


def decide_aggregation(plan: Plan, analysis: GraphAnalysis, duplicates: Dict[str, float],
                       links: routing.Links,
                       ahead: bool = False) -> Optional[routing.Aggregation]:
    """Local aggregation's choice for `plan`'s parameter-server and sharded variables
    (None: none).

    Per step, a host's workers send to the other hosts' parameter servers or rows' owners
    ((H-1)/H of the rows) the rows they touch in common once each instead of once per
    worker (`duplicates`: such rows per step over all hosts, measured), and a dense
    gradient once instead of once per worker; the mean over hosts is what one link is
    spared; on route "sharded" twice (the shared rows' lookups too). It costs one more
    exchange on the servers' route and three all-to-alls on the sharded one (four where
    it turns the ids a step ahead off: `ahead`, Config.ids_ahead).
    """
    hosts = len(plan.hosts)
    routes = {v.route for v in plan.variables if v.slot_of is None}
    if not routes & {"ps", "sharded"} or hosts < 2:
        return None
    spared = 0.0  # bytes over all host links per step
    for v in plan.variables:
        if v.route not in ("ps", "sharded") or v.slot_of is not None or not v.nbytes:
            continue
        if v.kind == "sparse":
            info = analysis.variable(v.name)
            row_bytes = info.nbytes // max(info.shape[0], 1)
            twice = 2 if v.route == "sharded" else 1  # lookups and gradients
            spared += twice * duplicates.get(v.name, 0.0) * (row_bytes + routing.INDEX_BYTES)
        else:  # pushed whole by every worker unless combined by allreduce first
            pushed = sum(1 for g in v.gradients if not g.post_processed)
            spared += pushed * v.nbytes * sum(slots - 1 for _, slots in plan.hosts)
    parts = sum(len(v.parts) for v in plan.variables
                if v.route == "ps" and v.slot_of is None and v.kind == "sparse")
    sparse = {v.route for v in plan.variables if v.slot_of is None and v.kind == "sparse"}
    return routing.decide_aggregation(spared * (hosts - 1) / hosts / hosts, links,
                                      servers="ps" in routes, sharded="sharded" in routes,
                                      parts=parts, ahead=ahead and sparse == {"sharded"})


def _sparse_routes(analysis: GraphAnalysis, config: Config,
                   density: Optional[routing.Routing], notes: List[str],
                   n: int) -> Dict[str, str]:
    """{sparse trained variable: "ps" | "allreduce" | "allgather" | "sharded"} in HYBRID
    mode (empty otherwise). A variable named in the dict form gets its route or an error;
    under a global route, one that route cannot take exactly gets a replicated one, with a
    note."""
    if config.run_mode != "HYBRID":
        return {}
    sparse = [v for v in analysis.trained if v.kind == "sparse"]
    setting = config.sparse_route
    forced = setting if isinstance(setting, dict) else {}
    unknown = sorted(set(forced) - {v.name for v in analysis.variables})
    if unknown:
        raise TfparError(f"Config.sparse_route names {', '.join(unknown)}, which the graph does "
                         "not have; give variable names as in tfpar.analyse(graph).table()")
    not_sparse = sorted(set(forced) - {v.name for v in sparse})
    if not_sparse:
        raise TfparError(f"Config.sparse_route names {', '.join(not_sparse)}, whose gradient is "
                         "not sparse: only sparse variables have a route to choose; remove it")
    routes = {}
    for v in sparse:
        wanted = forced.get(v.name, setting if setting in routing.FIXED_SPARSE_ROUTES else None)
        problem = _dense_route_problem(v)
        if wanted == "allreduce" and problem:
            raise TfparError(f"Config.sparse_route sends {v.name!r} to allreduce, but {problem}; "
                             "route it to 'ps' or 'allgather'")
        replicated = _replicated_only(v)
        if replicated and v.name not in forced and wanted in ("ps", "sharded", None) and \
                (wanted or density is None or v.name not in density.choices):
            # A replicated route runs the user's update as it is, on every worker.
            routes[v.name] = "allgather" if problem else "allreduce"
            notes.append(f"{v.name}: {routes[v.name]}, as {replicated}")
            continue
        unshardable = _unshardable(v, n)
        if unshardable and v.name not in forced and wanted == "sharded":
            # The allgather, not the servers: a job asked to shard its tables opens no
            # port for them.
            routes[v.name] = "allgather"
            notes.append(f"{v.name}: allgather, not sharded rows: {unshardable}")
            continue
        servers = _ps_problem(v)
        if servers and v.name not in forced and wanted in ("ps", None) and \
                (wanted or density is None or v.name not in density.choices):
            routes[v.name] = "allgather" if problem else "allreduce"
            notes.append(f"{v.name}: {routes[v.name]}, not the parameter servers: {servers}")
            continue
        if wanted is not None:
            routes[v.name] = wanted
        elif density is not None and v.name in density.choices:
            routes[v.name] = density.choices[v.name].route
        else:
            routes[v.name] = "ps"
            notes.append(f"{v.name}: parameter servers (density not measured: routes are "
                         "measured in the job, by get_runner)")
    if density is not None and density.choices:
        if density.links is not None:
            notes.append(f"density routing: links measured {1e3 * density.links.latency_s:.3f} ms "
                         f"per exchange, {density.links.per_byte_s * 1e9:.4f} ns per byte moved, "
                         + ("" if density.links.allgather_per_byte_s is None else
                            f"{density.links.allgather_per_byte_s * 1e9:.4f} in an allgather, ")
                         + ("" if density.links.dense_per_byte_s is None else
                            f"{density.links.dense_per_byte_s * 1e9:.4f} ns per byte of a "
                            "dense route's tensor, ")
                         + f"alpha "
                         f"over {density.steps} step(s) per worker")
        notes.extend(routing.describe(name, c) for name, c in sorted(density.choices.items()))
    return routes


def _replicated_only(v: VariableInfo) -> Optional[str]:
    """Why only a replicated route (the allreduce, the allgather: every worker runs the
    user's update) can take trained variable `v`, not the parameter servers nor sharded
    rows, which run an update of their own; None where they can."""
    for u in v.updates:
        if u.conditional:
            return (f"its update {u.ops[0]!r} is made in a tf.cond branch (a step may "
                    "skip it, as a loss scale's does where a gradient is not finite): the "
                    "parameter servers and sharded rows apply every step's update")
        if v.kind == "sparse" and not any(t.startswith(_SPARSE_WRITERS_PREFIXES)
                                          for t in u.op_types):
            return (f"its optimizer's update is dense ({', '.join(u.op_types)}: no sparse "
                    "apply, so every row would be written each step): the parameter "
                    "servers and sharded rows apply sparse updates only")
    return None


def _ps_problem(v: VariableInfo) -> Optional[str]:
    """Why the parameter servers cannot hold trained variable `v` besides
    `_replicated_only` (None: they can)."""
    if v.adds_outside:
        return (f"op {v.adds_outside[0]!r} adds to it outside the optimizer update, and "
                "every worker runs it, so the servers would apply it once per worker")
    return None


def _dense_route_problem(v: VariableInfo) -> Optional[str]:
    """Why a sparse variable cannot take the dense allreduce route exactly (None: it can)."""
    if not v.shape or v.shape[0] is None or any(d is None for d in v.shape):
        return "its shape is not static"
    return next(filter(None, (_sum_first_problem(u.gradient) for u in v.updates)), None)


def _rows_summed(v: VariableInfo, config: Config, links: Optional[routing.Links],
                 alpha: Optional[float], sent: Optional[float], n: int) -> bool:
    """Whether the allgather of `v`'s gradients sums each worker's rows by id first
    (`Config.sum_duplicate_rows`; "auto": where the bytes it saves take longer on the
    measured links than the one exchange Horovod adds to negotiate a size that changes
    every step: 0.82x the step at 100 Mbit/s, 1.16x at 1 Gbit/s on the LM at 128 words,
    docs/results/allgather_summed)."""
    if config.sum_duplicate_rows is False or any(
            _sum_first_problem(u.gradient) for u in v.updates):
        return False
    if config.sum_duplicate_rows is True:
        return True
    if links is None or alpha is None or sent is None or not v.nbytes or not v.shape[0]:
        return False
    unique = alpha * v.shape[0] * len(v.updates)
    row = v.nbytes // v.shape[0] + routing.INDEX_BYTES
    saved = cost.allgather_bytes(max(sent - unique, 0.0) * row, n)
    return saved * links.per_byte_s > links.latency_s


def _sum_first_problem(g) -> Optional[str]:
    """Why a duplicate id's rows of sparse gradient `g` cannot be summed before its
    post-processing (None: they can; the update sums them anyway)."""
    if g.row_sums or g.inexact:
        # a sum over the gradient's rows (a global norm) would see the summed rows
        return "its gradient is post-processed with a sum over its rows (e.g. a norm)"
    if g.nonlinear:
        return (f"its gradient's rows are post-processed one by one by an op that is not "
                f"linear in them ({g.nonlinear!r}, e.g. a clip_by_value)")
    return None


def _common(v: VariableInfo) -> dict:
    return dict(name=v.name, shape=v.shape, dtype=v.dtype, nbytes=v.nbytes, role=v.role,
                kind=v.kind, partition_of=v.partition.full_name if v.partition else None)


def _gradients(v: VariableInfo, sum_duplicates: bool = False) -> Tuple[GradientPlan, ...]:
    """sum_duplicates: each worker sums a gradient's rows by id first, where that is exact."""
    return tuple(GradientPlan(u.gradient.values, u.gradient.indices, u.scope, u.ops,
                              post_processed=u.gradient.post_processed,
                              final_values=u.gradient.final_values,
                              final_indices=u.gradient.final_indices,
                              row_sums=u.gradient.row_sums,
                              sum_duplicates=sum_duplicates and u.gradient.kind == "sparse"
                              and _sum_first_problem(u.gradient) is None, group=u.group)
                 for u in v.updates)


def _variable_plan(v: VariableInfo, config: Config, n: int,
                   sparse_route: Optional[str] = None, summed: bool = False,
                   rows: Optional[Tiling] = None) -> VariablePlan:
    if v.role != "trained":  # a slot's owner is named, so a tiling can split it alike
        return VariablePlan(route="replicated", slot_of=v.slot_of, **_common(v))
    grads = _gradients(v)
    if v.kind == "sparse" and sparse_route == "sharded":
        return _sharded_plan(v, config, n, grads, rows or rows_over(n))
    if v.kind == "sparse" and sparse_route == "allreduce":
        rows = v.shape[0]
        row_bytes = v.nbytes // rows
        predicted = cost.allreduce_bytes(rows * (row_bytes + 4), n) * len(grads)
        return VariablePlan(route="allreduce", gradients=grads, predicted_bytes=predicted,
                            reduction="average" if config.average_sparse else "sum",
                            **_common(v))
    if v.kind == "dense":
        predicted = None if v.nbytes is None else cost.allreduce_bytes(v.nbytes, n) * len(grads)
        return VariablePlan(route="allreduce", gradients=grads, predicted_bytes=predicted,
                            reduction="average" if config.average_dense else "sum", **_common(v))
    values = _values_bytes(v)
    # Parallax's model counts values only (index traffic neglected).
    predicted = None if values is None else sum(cost.allgather_bytes(b, n) for b in values)
    return VariablePlan(route="allgather", gradients=_gradients(v, sum_duplicates=summed),
                        predicted_bytes=predicted,
                        reduction="average" if config.average_sparse else "sum", **_common(v))


def rows_over(n: int, modulo: bool = True) -> Tiling:
    """The tiling of a sharded variable: its rows split over the n workers, dealt out in
    turn (modulo: worker k holds rows k, k + n, ...; `M{n}`) or in ranges (worker k holds
    the k-th range, the first ones a row longer, as fixed_size_partitioner cuts; `R{n}`)."""
    return Tiling((Cut(0, n, cyclic=modulo),))


def _row_tiling(name: str, config: Config, n: int, measured: Measurements,
                notes: List[str]) -> Tiling:
    """The rows of sharded variable `name` over the workers, as Config.sharded_rows says:
    with "auto", the way whose busiest worker the measured ids ask fewer rows of (modulo
    on a tie, and where nothing was measured: a vocabulary sorted by frequency would put
    its hot rows in the first range)."""
    way = _sharded_way(name, config, measured.owner_rows)
    asked = measured.owner_rows.get(name)
    if config.sharded_rows == "auto" and asked:
        notes.append(f"sharded rows of {name}: {way} (measured: the busiest worker is asked "
                     f"{asked['modulo']:.0f} rows a step with modulo, {asked['ranges']:.0f} "
                     f"with ranges; an even share {asked['even']:.0f})")
    return rows_over(n, modulo=way != "ranges")


def _sharded_way(name: str, config: Config, owner_rows) -> str:
    """"modulo" or "ranges": how sharded variable `name`'s rows are dealt out
    (Config.sharded_rows; for "auto", the way whose busiest worker `owner_rows`, the
    measured rows asked, asks fewer of; modulo on a tie and where nothing was measured)."""
    asked = owner_rows.get(name)
    if config.sharded_rows != "auto":
        return config.sharded_rows
    return "ranges" if asked and asked["ranges"] < asked["modulo"] else "modulo"


def _unshardable(v: VariableInfo, n: int) -> Optional[str]:
    """Why `v`'s rows cannot be split over `n` workers, whatever the update (None: they
    can)."""
    if not v.shape or v.shape[0] is None or v.shape[0] < n:
        return "it needs a static number of rows, at least one a worker"
    if v.other_reads:
        return (f"op {v.other_reads[0]!r} reads the whole variable (as does a tf.cond, a "
                "loop or a function that looks it up)")
    return None


def _sharded_problem(v: VariableInfo, config: Config, n: int) -> Optional[str]:
    """Why route "sharded" cannot take `v` (None: it can). The rewrite refuses the same."""
    unshardable = _unshardable(v, n)
    if unshardable:
        return unshardable
    replicated = _replicated_only(v)
    if replicated:
        return replicated
    for u in v.updates:
        if u.gradient.inexact:
            return u.gradient.inexact
    if config.checkpoint_every_secs:
        return "Config.checkpoint_every_secs cannot save sharded variables"
    return None


def _sharded_plan(v: VariableInfo, config: Config, n: int, grads,
                  rows: Tiling) -> VariablePlan:
    replicated = _replicated_only(v)
    if replicated:
        raise TfparError(f"cannot shard {v.name!r}: {replicated}. Route it to 'allreduce' "
                         "or 'allgather' (or leave its route to tfpar)")
    for u in v.updates:
        if u.gradient.inexact:
            raise NotYetSupportedError(u.gradient.inexact)
    if not v.shape or v.shape[0] is None or v.shape[0] < n:
        raise TfparError(f"cannot shard {v.name!r} (shape {list(v.shape)}) over {n} workers: "
                         "route 'sharded' needs a static number of rows, at least one a worker")
    values = _values_bytes(v)
    predicted = None
    if values is not None:
        ids = sum(math.prod(u.gradient.values_shape[:1]) * routing.INDEX_BYTES
                  for u in v.updates)
        predicted = cost.sharded_bytes(sum(values), ids, n)
    return VariablePlan(route="sharded", tiling=rows, gradients=grads,
                        predicted_bytes=predicted,
                        reduction="average" if config.average_sparse else "sum", **_common(v))


def _ps_plan(v: VariableInfo, config: Config, n: int, parts) -> VariablePlan:
    replicated = _replicated_only(v)
    if replicated:
        raise TfparError(
            f"cannot put {v.name!r} on the parameter servers: {replicated}. " + (
                "Route it to 'allreduce' or 'allgather' (or leave its route to tfpar)"
                if config.run_mode == "HYBRID" else
                "Use run_mode 'HYBRID' (which allreduces or allgathers it) or 'AR'"))
    servers = _ps_problem(v)
    if servers:
        raise NotYetSupportedError(
            f"cannot put {v.name!r} on the parameter servers: {servers}. " + (
                f"Write values there (assign, scatter_update), or route it to 'sharded' "
                f"(each row has one writer), 'allgather' or 'allreduce': sparse_route="
                f"{{{v.name!r}: 'sharded'}}" if config.run_mode == "HYBRID" and
                v.kind == "sparse" else
                "Write values there (assign, scatter_update), or use run_mode 'HYBRID' "
                "(which allreduces, allgathers or shards it) or 'AR'"))
    for u in v.updates:
        if u.gradient.inexact:
            raise NotYetSupportedError(u.gradient.inexact)
    grads = _gradients(v)
    if v.kind == "sparse":
        values = _values_bytes(v)
        average = config.average_sparse
        predicted = None if values is None else sum(cost.ps_bytes(b, n) for b in values)
    else:
        average = config.average_dense
        predicted = None if v.nbytes is None else cost.ps_bytes(v.nbytes, n) * len(grads)
    return VariablePlan(route="ps", gradients=grads, predicted_bytes=predicted, parts=parts,
                        reduction="average" if average else "sum", **_common(v))


def _values_bytes(v: VariableInfo) -> Optional[List[int]]:
    out = []
    for u in v.updates:
        shape = u.gradient.values_shape
        if not shape or any(d is None for d in shape):
            return None
        out.append(math.prod(shape) * _itemsize(v.dtype))
    return out


def _part_count(v: VariableInfo, config: Config, requested: Dict[str, int],
                num_ps: int) -> int:
    """How many parts (row ranges) sparse variable `v` takes on the parameter servers:
    `requested` ({name: count}: Config.partitions' dict and the searched counts), else
    Config.partitions' int, else one per PS task."""
    whole = v.partition is not None and tuple(v.partition.full_shape) == tuple(v.shape)
    if v.partition is not None and not (whole and v.name in requested):
        # A piece of the user's own partitioner: keep it whole. (The one piece that a
        # tfpar.partitioner used as partitioner= leaves is split as requested.)
        if v.name in requested and requested[v.name] != 1:
            raise TfparError(f"{v.name!r} is already a piece of the partitioned variable "
                             f"{v.partition.full_name!r}; its partitioner decides the parts")
        return 1
    return requested.get(v.name, config.partitions if isinstance(config.partitions, int)
                         else num_ps)


def _parts(analysis: GraphAnalysis, config: Config, searched: Dict[str, int], on_ps,
           num_ps: int, notes: List[str], balance=None) -> Dict[str, Tuple[PartPlan, ...]]:
    """The parts of every PS variable (row ranges, or rows dealt out modulo: `_ps_way`),
    placed on PS tasks by bytes (largest first). searched: the counts the job decided for
    the partitioner's groups; balance: Measurements.link_balance."""
    requested = dict(config.partitions) if isinstance(config.partitions, dict) else {}
    unknown = sorted(set(requested) - {v.name for v in analysis.variables})
    if unknown:
        raise TfparError(f"Config.partitions names {', '.join(unknown)}, which the graph does "
                         "not have; give variable names as in tfpar.analyse(graph).table()")
    requested.update(searched)
    ranges: Dict[str, List[Tuple[int, Optional[int], int]]] = {}  # (start, stop, step)
    weights: Dict[str, int] = {}
    for v in analysis.trained:
        if v.name not in on_ps:
            if v.name in requested:
                raise TfparError(f"Config.partitions names {v.name!r}, which is not on the "
                                 f"parameter servers (its gradient is {v.kind}); remove it")
            continue
        slots = [analysis.variable(s) for s in v.slots]
        weights[v.name] = (v.nbytes or 0) + sum(s.nbytes or 0 for s in slots)
        if v.kind == "dense" or not v.shape:
            ranges[v.name] = [(0, None, 1)]
            continue
        rows = v.shape[0]
        if rows is None:
            raise TfparError(f"sparse variable {v.name!r} has an unknown number of rows; "
                             "give it a static shape")
        count = _part_count(v, config, requested, num_ps)
        if count > rows:
            raise TfparError(f"cannot split variable {v.name!r} into {count} parts: it has only "
                             f"{rows} rows; use tfpar.Config(partitions=...) of at most {rows}")
        way = _ps_way(v.name, config, balance or {}) if count > 1 else "ranges"
        if way == "modulo":
            ranges[v.name] = [(k, rows, count) for k in range(count)]
            if config.ps_rows == "auto" and (balance or {}).get(v.name):
                b = balance[v.name]
                notes.append(f"servers' rows of {v.name}: modulo (measured: the busiest host "
                             f"serves {b.get('servers_modulo', 1.0):.2f}x its share with "
                             f"modulo, {b.get('servers', 1.0):.2f}x with ranges)")
            continue
        # Row ranges as tf.compat.v1.fixed_size_partitioner cuts them: the first ones larger.
        base, extra = divmod(rows, count)
        bounds = [0]
        for k in range(count):
            bounds.append(bounds[-1] + base + (1 if k < extra else 0))
        ranges[v.name] = [(a, b, 1) for a, b in zip(bounds[:-1], bounds[1:])]
        if count > 1 and config.ps_rows == "auto" and (balance or {}).get(v.name):
            b = balance[v.name]
            notes.append(f"servers' rows of {v.name}: ranges (measured: the busiest host "
                         f"serves {b.get('servers', 1.0):.2f}x its share with ranges, "
                         f"{b.get('servers_modulo', 1.0):.2f}x with modulo)")
    # Greedy longest-processing-time placement: the heaviest part goes to the lightest task.
    pieces = []
    for name, rs in ranges.items():
        rows = analysis.variable(name).shape[0] if analysis.variable(name).shape else None
        for k, (start, stop, step) in enumerate(rs):
            share = 1.0 if stop is None or not rows else len(range(start, stop, step)) / rows
            pieces.append((weights[name] * share, name, k))
    load = [0.0] * max(num_ps, 1)
    task_of: Dict[Tuple[str, int], int] = {}
    for w, name, k in sorted(pieces, key=lambda p: (-p[0], p[1], p[2])):
        t = min(range(len(load)), key=lambda i: (load[i], i))
        task_of[(name, k)] = t
        load[t] += w
    if ranges:
        notes.append(f"parameter servers: {num_ps} (one per host)")
    return {name: tuple(PartPlan(task_of[(name, k)], start, stop, step)
                        for k, (start, stop, step) in enumerate(rs))
            for name, rs in ranges.items()}


def _ps_way(name: str, config: Config, balance) -> str:
    """"modulo" or "ranges": how the rows of PS variable `name` are dealt out to its parts
    (Config.ps_rows; for "auto", the way whose busiest host `balance`, the measured
    Measurements.link_balance, loads less; modulo on a tie and where nothing was
    measured)."""
    if config.ps_rows != "auto":
        return config.ps_rows
    b = balance.get(name) or {}
    ranged, dealt = b.get("servers"), b.get("servers_modulo")
    return "ranges" if ranged is not None and dealt is not None and ranged < dealt \
        else "modulo"


def _itemsize(dtype: str) -> int:
    import tensorflow as tf
    return tf.as_dtype(dtype).size


def auto_tiles(plan: Plan, planned, min_bytes: int, layer_bytes) -> Tuple[Plan, List[str]]:
    """Config(tiling="auto"): `plan` with the dense weights the tiling planner split
    (`planned`, a TilingPlan of the graph for the job's devices) split so where that pays.

    A weight is split when it is a trained dense 2-D variable on allreduce of at least
    `min_bytes`, the planner cut it (not replicated on every device), the rewrite can
    execute its layer, and its layer moves fewer bytes per step than its allreduce
    (`layer_bytes(plan split so) -> {weight: bytes}`, raising NotYetSupportedError for a
    layer the rewrite cannot split). Returns the plan and why each candidate was not split.
    """
    why: List[str] = []
    chosen = {}
    for name, tiling in sorted(planned.placement.items()):
        try:
            v = plan.variable(name)
        except KeyError:
            continue
        if v.route != "allreduce" or v.kind != "dense" or len(v.shape) != 2:
            continue
        if v.nbytes is None or v.nbytes < min_bytes:
            why.append(f"tiling auto: {name} ({v.nbytes} B) is below tiling_min_bytes "
                       f"({min_bytes} B): kept on allreduce")
            continue
        if not any(c.dim is not None for c in tiling.cuts):
            why.append(f"tiling auto: the planner keeps {name} whole on every device")
            continue
        try:
            layer_bytes(plan.with_tiles({name: tiling}))
        except NotYetSupportedError as e:
            why.append(f"tiling auto: {name} kept on allreduce: {e}")
            continue
        chosen[name] = tiling
    # Judged together, since chained layers keep the activations between them split: the
    # layer that pays least for its split goes back to allreduce until every one pays.
    while chosen:
        moved = layer_bytes(plan.with_tiles(chosen))
        ratio = {name: moved[name] / plan.variable(name).predicted_bytes for name in chosen
                 if plan.variable(name).predicted_bytes}
        worst = max(ratio, key=lambda name: (ratio[name], name), default=None)
        if worst is None or ratio[worst] < 1.0:
            break
        why.append(f"tiling auto: {worst} split {chosen[worst]} would move "
                   f"{moved[worst]:,.0f} B per step, its allreduce "
                   f"{plan.variable(worst).predicted_bytes:,.0f} B: kept on allreduce")
        del chosen[worst]
    if not chosen:
        return plan, why
    split = plan.with_tiles(chosen)
    return split.with_predicted(layer_bytes(split)), why
