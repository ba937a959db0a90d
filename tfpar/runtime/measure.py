"""Measuring what planning needs, in the job, before the graph is rewritten.

- `measure`: everything at once, as one `tfpar.plan.Measurements` value for `make_plan`
  (nothing when no choice depends on a measurement).
- `measure_rows`: the rows of each sparse variable one worker's step
  touches, the rows its gradients carry (duplicate ids included), and those the workers
  of one host touch in common, from a scratch copy of the
  worker's own (sharded) graph that computes only the gradients' ids: no variable is
  written and the real input pipeline starts from its beginning.
- `measure_links`: an alpha-beta fit of Horovod allreduces of two sizes on the job's links.

Every rank calls both in the same order; the results are agreed (gathered, then the same
reduction on every rank), so every rank routes alike.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tfpar.partition.tiling.cuts import Cut, Tiling
from tfpar.plan import cost

from tfpar.runtime import job
from tfpar.errors import TfparError
from tfpar.plan.measurements import Measurements
from tfpar.plan.planner import (aggregated, aggregation_measured, density_candidates,
                                ps_part_count)
from tfpar.plan.routing import Links
from tfpar.runtime.sharding import with_shard_values
from tfpar.graph.graph_copy import copy_graph

_PROBES = 0  # link probes of this process (their Horovod op names must differ)


def measure(meta, analysis, config, layout) -> Measurements:
    """What density routing (`sparse_route="auto"` or a dict), local aggregation ("auto")
    and the tiling planner ("auto" on several hosts) need: the job's links and the rows
    each sparse variable's gradients touch, carry, and share within a host. Empty when
    none of them has anything to decide."""
    candidates = density_candidates(analysis, config)
    aggregation = aggregation_measured(config, layout) and bool(
        candidates or aggregated(analysis, config, layout))
    if not candidates and not aggregation:
        if config.tiling == "auto" and len(layout.hosts) > 1:  # the tiling mesh's host links
            return Measurements(links=measure_links())
        return Measurements()
    # The ids are read anyway: those of the variables sharded by the user's dict too, to
    # choose how their rows are dealt out (Config.sharded_rows "auto").
    forced = config.sparse_route if isinstance(config.sparse_route, dict) else {}
    names = {v.name for v in candidates}
    rows_of = [v for v in analysis.trained if v.kind == "sparse" and (
        v.name in names or aggregation or (forced.get(v.name) == "sharded"
                                           and config.sharded_rows == "auto"))]
    # The rows a host's workers share: for local aggregation "auto", and for density
    # routing to price the servers' route with the aggregation it would get.
    per_host = aggregation or (candidates and config.local_aggregation is not False
                               and config.sync and len(layout.hosts) > 1
                               and max(h.slots for h in layout.hosts) > 1)
    # How the rows asked fall on the host links, for density routing to price each route
    # by its busiest host (the servers' parts as density routing prices them).
    hosts = len(layout.hosts)
    balance = BalanceOver([layout.host_of_rank(r) for r in range(layout.num_workers)],
                          {v.name: ps_part_count(v, config, hosts) for v in candidates}) \
        if candidates and hosts > 1 else None
    alphas, duplicates, sent, owners, balanced = measure_rows(
        meta, rows_of, config.density_steps, config.search_feed,
        layout.host_of_rank if per_host else None, balance)
    return Measurements(links=measure_links(), steps=config.density_steps,
                        alphas={v.name: alphas[v.name] for v in candidates}, sent_rows=sent,
                        duplicates=duplicates, owner_rows=owners, link_balance=balanced)


@dataclasses.dataclass(frozen=True)
class BalanceOver:
    """What `measure_rows` needs to count how the rows asked fall on the hosts: the host
    of each rank, and the parts each variable would take on the parameter servers (part k
    on the server of host k % hosts, as the planner's placement deals out equal parts)."""

    host_of_rank: Sequence[int]
    parts: Dict[str, int]


def measure_rows(meta, variables: Sequence, steps: int,
                 feed: Optional[Callable[[int], dict]] = None,
                 host_of_rank: Optional[Callable[[int], int]] = None,
                 balance: Optional[BalanceOver] = None):
    """(alpha, duplicates, sent, owners, balanced): {variable name: mean fraction of its
    rows one worker's step touches (over `steps` steps and every worker)}, {variable name:
    rows per step, summed over hosts, that a host's workers touch more than once between
    them} (what local aggregation saves; with `host_of_rank`, else empty), {variable name:
    rows one worker's gradients carry per step, duplicate ids included} (what an allgather
    sends), means over workers, {variable name: {"ranges", "modulo": the rows a step asks
    of the busiest owner were its rows sharded so (`Tiling` R{n}, M{n}); "even": an n-th
    of all}}, means over steps, and, with `balance`, {variable name in balance.parts:
    {"modulo", "ranges", "servers", "servers_modulo": the busiest host's rows over its
    even share (`link_balance`) with the rows sharded so, or on the servers in
    balance.parts[name] parts, in ranges or dealt out modulo}} (else empty)."""
    hvd = job.horovod()
    n = hvd.size()
    local, carried = _local_rows(copy_graph(with_shard_values(meta, n, hvd.rank())),
                                 variables, steps, feed)
    parts = balance.parts if balance is not None else {}

    def counted(v):
        ways = {way: [owner_counts(ids, v.shape[0], n, way).tolist() for ids in local[v.name]]
                for way in ("ranges", "modulo")}
        if v.name in parts:  # the servers' parts, in row ranges and dealt out modulo
            ways["servers"] = [owner_counts(ids, v.shape[0], parts[v.name], "ranges").tolist()
                               for ids in local[v.name]]
            ways["servers_modulo"] = [
                owner_counts(ids, v.shape[0], parts[v.name], "modulo").tolist()
                for ids in local[v.name]]
        return ways

    here = {v.name: (float(np.mean([len(ids) / v.shape[0] for ids in local[v.name]])),
                     float(np.mean(carried[v.name])), counted(v))
            for v in variables}
    every = [json.loads(s) for s in job.allgather_strings(json.dumps(here))]
    alpha = {v.name: float(np.mean([e[v.name][0] for e in every])) for v in variables}
    sent = {v.name: float(np.mean([e[v.name][1] for e in every])) for v in variables}
    owners, balanced = {}, {}
    for v in variables:
        asked = {way: np.sum([e[v.name][2][way] for e in every], axis=0)  # [steps, owners]
                 for way in every[0][v.name][2]}
        owners[v.name] = {way: float(np.mean(np.max(asked[way], axis=1)))
                          for way in ("ranges", "modulo")}
        owners[v.name]["even"] = float(np.mean(asked["modulo"].sum(axis=1))) / n
        if v.name in parts:
            host_of = list(balance.host_of_rank)
            hosts = max(host_of) + 1
            balanced[v.name] = {way: link_balance(asked[way], host_of, hosts)
                                for way in ("ranges", "modulo")}
            for way in ("servers", "servers_modulo"):
                balanced[v.name][way] = link_balance(
                    asked[way], [k % hosts for k in range(parts[v.name])], hosts, even=True)
    if host_of_rank is None:
        return alpha, {}, sent, owners, balanced
    rows = [json.loads(s) for s in job.allgather_strings(json.dumps(local))]
    hosts: Dict[int, List[int]] = {}
    for rank in range(len(rows)):
        hosts.setdefault(host_of_rank(rank), []).append(rank)
    duplicates = {}
    for v in variables:
        per_step = []
        for step in range(steps):
            total = 0
            for ranks in hosts.values():
                sets = [set(rows[r][v.name][step]) for r in ranks]
                total += sum(len(x) for x in sets) - len(set().union(*sets))
            per_step.append(total)
        duplicates[v.name] = float(np.mean(per_step))
    return alpha, duplicates, sent, owners, balanced


def link_balance(asked, host_of_owner: Sequence[int], hosts: int,
                 even: bool = False) -> float:
    """How much more than its share of the rows asked the busiest host serves, the mean
    over steps (1: as priced): what its link carries beside the others', since each row
    asked of a host crosses its link out (the row) and in (its gradient) for every worker
    elsewhere. asked: [steps, owners] the rows asked of each owner (every worker's distinct
    ids summed); host_of_owner: each owner's host. A host's share is its owners' share of
    all owners (the sharded rows: each worker owns as many), or with `even` an equal one
    (the servers: one a host, priced as if balanced)."""
    asked = np.asarray(asked, np.float64)
    owners = np.asarray(host_of_owner)
    share = np.array([1.0 / hosts if even else np.mean(owners == h) for h in range(hosts)])
    load = np.stack([asked[:, owners == h].sum(axis=1) for h in range(hosts)], axis=1)
    total = load.sum(axis=1)
    busy = (total > 0)
    if not np.any(busy):
        return 1.0
    share = np.maximum(share, 1e-12)  # a host that owns nothing serves nothing
    return float(np.mean(np.max(load[busy] / (total[busy, None] * share), axis=1)))



def owner_counts(ids: Sequence[int], rows: int, n: int, way: str) -> np.ndarray:
    """How many of `ids` (rows of a table of `rows` rows) each of n workers owns when
    the rows are sharded by `way`: "ranges" (`Tiling` R{n}) or "modulo" (M{n})."""
    ids = np.asarray(ids, np.int64)
    if way == "modulo":
        owner = ids % n
    else:
        starts = [Tiling((Cut(0, n),)).tile_ranges((rows,), k)[0][0] for k in range(1, n)]
        owner = np.searchsorted(np.asarray(starts, np.int64), ids, side="right")
    return np.bincount(owner, minlength=n)


def _local_rows(graph: tf.Graph, variables, steps: int, feed):
    """({variable name: per step, the distinct rows this worker's step touches},
    {variable name: per step, the ids its gradients carry, duplicates included})."""
    fetches = {v.name: [graph.get_tensor_by_name(u.gradient.indices) for u in v.updates]
               for v in variables}
    touched: Dict[str, List[List[int]]] = {v.name: [] for v in variables}
    carried: Dict[str, List[int]] = {v.name: [] for v in variables}
    if not variables:
        return touched, carried
    with graph.as_default():
        inits = [tf.compat.v1.global_variables_initializer(),
                 tf.compat.v1.local_variables_initializer(), tf.compat.v1.tables_initializer()]
    with tf.compat.v1.Session(graph=graph, config=job.session_config()) as session:
        initialised = False
        for step in range(steps):
            feed_dict = _feed(graph, feed, step)
            try:
                ids = session.run(fetches, feed_dict=feed_dict)
            except tf.errors.FailedPreconditionError:
                if initialised:
                    raise
                session.run(inits)  # the ids depend on a variable (e.g. a lookup table)
                initialised = True
                ids = session.run(fetches, feed_dict=feed_dict)
            except tf.errors.InvalidArgumentError as e:
                if "must feed a value for placeholder" in e.message:
                    raise TfparError(
                        "tfpar measures each sparse variable's density (for "
                        "Config(sparse_route='auto') or local_aggregation='auto') by running "
                        "its lookups, and this graph needs feeds: give "
                        "tfpar.Config(search_feed=lambda step: {placeholder: value, ...}) or "
                        "set sparse_route to 'ps', 'allreduce', 'allgather' or a dict and "
                        "local_aggregation to True or False") from None
                raise
            for v in variables:
                # The rows one step reads and pushes: every gradient's distinct ids.
                rows = set()
                for part in ids[v.name]:
                    rows.update(np.unique(part).tolist())
                touched[v.name].append(sorted(int(r) for r in rows))
                carried[v.name].append(sum(int(np.size(part)) for part in ids[v.name]))
    return touched, carried


def _feed(graph: tf.Graph, feed, step: int) -> Optional[dict]:
    if feed is None:
        return None
    out = {}
    for key, value in feed(step).items():
        name = key if isinstance(key, str) else key.name
        out[graph.get_tensor_by_name(name if ":" in name else name + ":0")] = value
    return out


def measure_links(repeats: int = 3, max_rows: int = 1 << 17) -> Links:
    """Fits the costs density routing compares, with Horovod on the job's links.

    latency: the median of `LATENCY_SAMPLES` one-float allreduces: what a round costs a
    step, where the fastest of a few was as often half of it as not (1.1 to 2.9 ms in
    jobs of one model on the emulated 2 x 2 at 100 Mbit/s), and density routing then
    priced the servers' protocol so cheap that it took them at 1.4x the step (the
    slopes below use the fastest: other work only adds time).
    per_byte: the slope of plain allreduces against the bytes each worker moves.
    dense_per_byte: the slope of the dense route itself (rows summed into a [rows, 64+1]
    tensor, allreduced, touched rows gathered back) against that tensor's bytes, so the
    local passes over it count too. alltoall_latency: the median tiny all-to-all (route
    "sharded"'s exchange), timed by turns with the latency's allreduces. allgather_per_byte: the slope of plain allgathers against the
    bytes each worker moves (no sum: a byte costs less than in an allreduce). Each probe
    grows 4x until it takes 10x the latency
    and at least 20 ms, so bytes, not noise, decide the slope. Rank 0's timings decide
    (each growth step too), so every rank runs the same collectives and gets the same fit.
    """
    global _PROBES
    _PROBES += 1
    hvd = job.horovod()
    n = hvd.size()
    tag = f"tfpar_link_probe_{_PROBES}"
    t_small = _agreed(_time(_plain_allreduce, 1, repeats, f"{tag}_small"))
    # The tiny allreduce and all-to-all by turns, in the same moments: a probe of one
    # after the other measured the all-to-all at 13.5 ms one day and 4.3 the next, with
    # the allreduce at 2.3 and 2.1 (2 emulated hosts x 2, 100 Mbit/s), and priced the
    # sharded rows out of the route they won.
    latency, t_alltoall = (_agreed(t) for t in _time_by_turns(
        (_plain_allreduce, _plain_alltoall), 1, LATENCY_SAMPLES, f"{tag}_latency"))
    k, t_large = _grow(lambda k: _agreed(_time(_plain_allreduce, k, repeats, f"{tag}_{k}")),
                       1 << 16, t_small, 1 << 24)
    moved = cost.allreduce_bytes(4 * k, n) - cost.allreduce_bytes(4, n)
    per_byte = max(t_large - t_small, 0.0) / moved if moved > 0 else 0.0
    t_rows = _agreed(_time(_dense_route, 8, repeats, f"{tag}_rows_small"))
    rows, t_many = _grow(lambda r: _agreed(_time(_dense_route, r, repeats, f"{tag}_rows_{r}")),
                         1 << 10, t_rows, max_rows)
    dense = (rows - 8) * (_PROBE_COLUMNS + 1) * 4
    dense_per_byte = max(t_many - t_rows, 0.0) / dense
    t_gather = _agreed(_time(_plain_allgather, 1, repeats, f"{tag}_gather_small"))
    g, t_gathered = _grow(lambda k: _agreed(_time(_plain_allgather, k, repeats,
                                                  f"{tag}_gather_{k}")),
                          1 << 14, t_gather, 1 << 22)
    gathered = cost.allgather_bytes(4 * g, n) - cost.allgather_bytes(4, n)
    return Links(latency_s=latency, per_byte_s=per_byte, dense_per_byte_s=dense_per_byte,
                 alltoall_latency_s=t_alltoall, allgather_per_byte_s=max(
                     t_gathered - t_gather, 0.0) / gathered if gathered > 0 else None)


_PROBE_COLUMNS = 64
LATENCY_SAMPLES = 9


def _grow(timed, start: int, t_small: float, limit: int):
    k = start
    while True:
        t = timed(k)
        if t >= max(10 * t_small, 0.02) or k >= limit:
            return k, t
        k *= 4


def _variable(value) -> tf.Tensor:
    """`value` read from a variable: a constant input would let TensorFlow's graph optimizer
    fold the probe (collective included) once, and time nothing."""
    return tf.compat.v1.Variable(value, trainable=False, use_resource=True).read_value()


def _plain_allreduce(k: int, name: str):
    hvd = job.horovod()
    return hvd.allreduce(_variable(tf.ones([k], tf.float32)), op=hvd.Sum, name=name)


def _plain_allgather(k: int, name: str):
    """`k` floats from every worker, as route "allgather" gathers rows."""
    hvd = job.horovod()
    return hvd.allgather(_variable(tf.ones([k], tf.float32)), name=name)


def _plain_alltoall(k: int, name: str):
    """`k` floats to every worker, as route "sharded" exchanges ids and rows."""
    hvd = job.horovod()
    return hvd.alltoall(_variable(tf.ones([k * hvd.size()], tf.float32)), name=name,
                        ignore_name_scope=True)[0]


def _dense_route(rows: int, name: str):
    """What tfpar.transform.allreduce does for a sparse gradient of `rows` rows."""
    hvd = job.horovod()
    ids = _variable(tf.range(0, rows, max(rows // 8, 1))[:8])
    values = _variable(tf.ones([8, _PROBE_COLUMNS]))
    summed = tf.math.unsorted_segment_sum(values, ids, rows)
    touched = tf.math.unsorted_segment_max(tf.ones_like(ids, tf.float32), ids, rows)
    packed = tf.concat([summed, tf.maximum(touched, 0)[:, None]], axis=1)
    total = hvd.allreduce(packed, op=hvd.Sum, name=name)
    return tf.gather(total[:, :-1], tf.where(total[:, -1] > 0)[:, 0])


def _time(build, size: int, repeats: int, name: str, statistic=min) -> float:
    g = tf.Graph()
    with g.as_default():
        op = build(size, name)
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(graph=g, config=job.session_config()) as session:
        session.run(init)
        session.run(op)  # warm up (negotiation, buffers)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            session.run(op)
            samples.append(time.perf_counter() - start)
    return statistic(samples)


def _time_by_turns(builds, size: int, repeats: int, name: str) -> List[float]:
    """The median time of each of `builds`' ops, run by turns (one of each, `repeats`
    times), so that a slow moment of the machine slows all of them alike."""
    g = tf.Graph()
    with g.as_default():
        ops = [build(size, f"{name}_{k}") for k, build in enumerate(builds)]
        init = tf.compat.v1.global_variables_initializer()
    samples: List[List[float]] = [[] for _ in ops]
    with tf.compat.v1.Session(graph=g, config=job.session_config()) as session:
        session.run(init)
        for op in ops:
            session.run(op)  # warm up (negotiation, buffers)
        for _ in range(repeats):
            for op, times in zip(ops, samples):
                start = time.perf_counter()
                session.run(op)
                times.append(time.perf_counter() - start)
    return [statistics.median(times) for times in samples]


def _agreed(seconds: float) -> float:
    """Rank 0's measurement, on every rank."""
    return float(job.allgather_strings(repr(seconds))[0])
