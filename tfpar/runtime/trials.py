"""The partition search inside a running job: timed trials, agreement, and memory.

For each `tfpar.partitioner` group whose count the config does not fix, every worker
builds a trial runner with the proposed count, runs a few training steps (the first ones
not timed), and the mean step time over workers decides the next count
(tfpar.partition.counts.search). Each trial has its own graph copy, session and parameter-server
state, so nothing it trains reaches the runner the user gets: that one starts from the
same initial values as without a search. The result is remembered in a small JSON file
keyed by the graph's structure, the variable shapes and the layout.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf

from tfpar.runtime import job
from tfpar.errors import TfparError
from tfpar.graph.partitioner import Group, marked_groups
from tfpar.partition.counts.search import GroupDecision, PartitionSearch, SearchResult
from tfpar.plan.measurements import Measurements
from tfpar.plan.planner import on_parameter_servers

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "tfpar", "partitions")
_TRIAL_STEP_TIMEOUT_MS = 120_000


def check_groups(groups: Dict[str, Group], analysis, mode: str) -> None:
    """Bad marks are errors: a marked dense variable, or a minimum above its rows."""
    if mode not in ("HYBRID", "PS"):
        return
    for g in groups.values():
        for name in g.variables:
            v = analysis.variable(name)
            if v.role == "trained" and v.kind != "sparse":
                raise TfparError(
                    f"tfpar.partitioner marks {name!r}, whose gradient is {v.kind}: only sparse "
                    "variables (embeddings read by lookups) are split on the parameter servers; "
                    "create it outside the partitioner")
            rows = v.shape[0] if v.shape else None
            if g.min_partitions and rows is not None and g.min_partitions > rows:
                raise TfparError(
                    f"tfpar.partitioner(min_partitions={g.min_partitions}) is larger than the "
                    f"{rows} rows of {name!r}; use at most {rows}")


def decide(groups: Dict[str, Group], analysis, config, layout, key: str,
           run_trial: Callable[[Dict[str, int]], Optional[float]]) -> Dict[str, GroupDecision]:
    """A partition count for every group, from the config, memory, or trials.

    run_trial({variable: count}) runs one timed trial on this worker and returns its mean
    step time (None if it failed); every worker calls it in the same order.
    """
    trained = {v.name for v in analysis.trained}
    fixed = config.partitions if isinstance(config.partitions, dict) else {}
    decisions: Dict[str, GroupDecision] = {}
    remembered = _agree(_load(config, key) if config.search_partitions == "auto" else None)
    base = {}
    for gid, g in sorted(groups.items()):
        names = tuple(n for n in g.variables if n in trained)
        if not names:
            continue
        rows = min(analysis.variable(n).shape[0] for n in names)
        upper = min(g.max_partitions or rows, rows)
        lower = min(g.min_partitions or 1, upper)
        if isinstance(config.partitions, int) or all(n in fixed for n in names):
            counts = {fixed.get(n, config.partitions) for n in names}
            decisions[gid] = GroupDecision(names, max(counts), "config")
        elif config.search_partitions == "off":
            decisions[gid] = GroupDecision(names, lower, "config")
        elif remembered and gid in remembered.get("groups", {}):
            r = remembered["groups"][gid]
            decisions[gid] = GroupDecision(names, r["partitions"], "remembered",
                                           SearchResult.from_dict(r["search"]))
        else:
            decisions[gid] = None  # searched below, one group at a time
        base[gid] = (names, lower, upper)
    for gid, decision in list(decisions.items()):
        if decision is not None:
            continue
        names, lower, upper = base[gid]
        others = {n: d.partitions for d in decisions.values() if d is not None
                  for n in d.variables}
        start = len(layout.hosts)  # Parallax starts at the number of servers
        search = PartitionSearch(start, lower, upper, config.search_trials)
        began = time.time()
        while (p := search.propose()) is not None:
            if agree_float(time.time() - began) > config.search_seconds:
                log(f"partition search: time cap of {config.search_seconds:.0f} s reached")
                break
            step = agree_mean(run_trial({**others, **{n: p for n in names}}))
            search.record(p, step)
            left = config.search_trials - len(search.samples)
            log(f"partition search for {', '.join(names)}: trial {len(search.samples)}: "
                 f"P={p}: " + ("failed" if step is None else f"{step * 1e3:.2f} ms/step")
                 + f"; at most {left} more")
        result = search.result()
        decisions[gid] = GroupDecision(names, result.partitions, "searched", result)
        log(f"partition search for {', '.join(names)}: {result.describe()}")
    if any(d.source == "searched" for d in decisions.values()):
        _store(config, key, decisions)
    return decisions


def resolve_counts(graph, meta, analysis, config, layout, measured: Measurements,
                   run_trial: Optional[Callable[[Dict[str, int]], Optional[float]]] = None,
                   forget: bool = False) -> Tuple[Measurements, List[str]]:
    """The partition counts of the graph's `tfpar.partitioner` groups, as the job uses them.

    measured: what the job measured so far (its routes say which marked variables are on
    the parameter servers). run_trial: runs one timed trial (see `decide`); None (the CLI)
    takes only a remembered search. Returns `measured` with the counts and how each was
    decided (unchanged when there is nothing to decide), and notes for the user.
    """
    mode, on_parameter_servers_ = on_parameter_servers(analysis, config, layout, measured)
    groups = marked_groups(graph)
    check_groups(groups, analysis, mode)
    # Groups that density routing sent to allreduce have no partition count to decide.
    groups = {gid: dataclasses.replace(g, variables=on_ps) for gid, g in groups.items()
              for on_ps in [tuple(n for n in g.variables if n in on_parameter_servers_)]
              if on_ps}
    if not groups or mode not in ("HYBRID", "PS"):
        return measured, []
    key = cache_key(meta, analysis, layout, groups, mode)
    notes = []
    if forget and os.path.exists(cache_path(config, key)):
        os.remove(cache_path(config, key))
        notes.append("forgot the remembered partition search")
    if run_trial is not None:
        decisions = decide(groups, analysis, config, layout, key, run_trial)
    else:
        decisions = remembered(config, key, groups)
        if not decisions:
            return measured, notes + [
                "the partition count of the tfpar.partitioner variables is searched when the "
                "job starts (none remembered for this graph and layout)"]
    counts = {n: d.partitions for d in decisions.values() for n in d.variables}
    return dataclasses.replace(measured, partitions=counts, partition_search=decisions), notes


def timed_steps(runner, fetches, feed: Optional[Callable[[int], dict]], warmup: int,
                measured: int, search: str = "partition search") -> Optional[float]:
    """The median seconds of the `measured` training steps after `warmup` untimed ones
    (None: the trial failed). The median, not the mean: a fresh session's first steps
    (graph optimisation, allocators, a parameter server's channels) can stay slow for
    longer than the warm-up, and another process's hiccup lands in one step."""
    options = tf.compat.v1.RunOptions(timeout_in_ms=_TRIAL_STEP_TIMEOUT_MS)
    times = []
    try:
        for i in range(warmup + measured):
            start = time.time()
            runner.run(fetches, feed_dict=feed(i) if feed else None, options=options)
            if i >= warmup:
                times.append(time.time() - start)
    except (tf.errors.ResourceExhaustedError, tf.errors.DeadlineExceededError) as e:
        log(f"{search}: trial failed ({type(e).__name__})")
        return None
    except tf.errors.InvalidArgumentError as e:
        if "must feed a value for placeholder" in e.message:
            raise TfparError(
                f"the {search} runs training steps itself, and this graph needs "
                "feeds: give tfpar.Config(search_feed=lambda step: {placeholder: value, ...}) "
                + ("or fix the count with tfpar.Config(partitions=...)"
                   if search == "partition search" else
                   "or leave tfpar.Config(search_routes=False)")) from None
        raise
    return float(np.median(times))


def training_step(graph: tf.Graph, analysis) -> List[str]:
    """Names of the ops that end a training step: the user's TRAIN_OP collection, else the
    ops downstream of the updates that nothing else waits for (e.g. the optimizer's
    global-step increment)."""
    if analysis.train_ops:
        return list(analysis.train_ops)
    writers = {graph.get_operation_by_name(n) for v in analysis.trained for u in v.updates
               for n in u.ops}
    consumers: Dict[tf.Operation, List[tf.Operation]] = {}
    for op in graph.get_operations():
        for dep in list(op.control_inputs) + [t.op for t in op.inputs]:
            consumers.setdefault(dep, []).append(op)
    seen, stack, sinks = set(), list(writers), []
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        nxt = consumers.get(op, [])
        if not nxt:
            sinks.append(op.name)
        stack.extend(nxt)
    return sorted(sinks)


def cache_key(meta, analysis, layout, groups: Dict[str, Group], mode: str) -> str:
    """A digest of the graph's ops, the variables' shapes, the layout and the marks."""
    h = hashlib.sha256()
    for node in sorted((n.name, n.op) for n in meta.graph_def.node):
        h.update(repr(node).encode())
    for v in analysis.variables:
        h.update(repr((v.name, v.shape, v.dtype)).encode())
    h.update(repr(([(x.name, x.slots) for x in layout.hosts], mode)).encode())
    h.update(repr(sorted((gid, g.min_partitions, g.max_partitions, g.variables)
                         for gid, g in groups.items())).encode())
    return h.hexdigest()[:24]


def route_cache_key(meta, analysis, layout, config) -> str:
    """A digest of what route trials depend on besides the links: the graph's ops, the
    variables' shapes, the layout, and the settings that shape the candidates and their
    timing (not `search_routes` itself, so "force" and True share a record)."""
    h = hashlib.sha256(b"routes")
    for node in sorted((n.name, n.op) for n in meta.graph_def.node):
        h.update(repr(node).encode())
    for v in analysis.variables:
        h.update(repr((v.name, v.shape, v.dtype)).encode())
    route = (sorted(config.sparse_route.items()) if isinstance(config.sparse_route, dict)
             else config.sparse_route)
    h.update(repr(([(x.name, x.slots) for x in layout.hosts], config.run_mode, route,
                   config.local_aggregation, config.sync, config.search_trials,
                   tuple(config.search_steps))).encode())
    return "routes-" + h.hexdigest()[:24]


def remembered_record(config, key: str) -> Optional[dict]:
    """Worker 0's remembered record for `key` on every worker (None: none)."""
    return _agree(_load(config, key))


def store_record(config, key: str, record: dict) -> None:
    """Worker 0 writes `record` for `key` (atomically: a crash leaves the old one)."""
    if job.horovod().rank() != 0:
        return
    path = cache_path(config, key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump({"key": key, **record}, f, indent=2)
    os.replace(path + ".tmp", path)


def cache_path(config, key: str) -> str:
    return os.path.join(config.search_cache or DEFAULT_CACHE, key + ".json")


def remembered(config, key: str, groups: Dict[str, Group]) -> Optional[Dict[str, GroupDecision]]:
    """The decisions an earlier search of this graph and layout stored, if any."""
    record = _load(config, key)
    if not record:
        return None
    out = {}
    for gid, r in record.get("groups", {}).items():
        if gid in groups:
            out[gid] = GroupDecision(tuple(r["variables"]), r["partitions"], "remembered",
                                     SearchResult.from_dict(r["search"]))
    return out or None


def _load(config, key: str) -> Optional[dict]:
    try:
        with open(cache_path(config, key)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _store(config, key: str, decisions: Dict[str, GroupDecision]) -> None:
    store_record(config, key, {"groups": {gid: d.to_dict() for gid, d in decisions.items()
                                          if d.search is not None}})


def _agree(value):
    """Worker 0's value on every worker (workers may see different files)."""
    return json.loads(job.allgather_strings(json.dumps(value))[0])


def agree_float(x: float) -> float:
    return max(float(s) for s in job.allgather_strings(repr(x)))


def agree_mean(step: Optional[float]) -> Optional[float]:
    """The mean step time over workers; a trial that failed anywhere failed."""
    times = [json.loads(s) for s in job.allgather_strings(json.dumps(step))]
    return None if any(t is None for t in times) else sum(times) / len(times)


def log(text: str) -> None:
    if job.horovod().rank() == 0:
        sys.stderr.write(f"tfpar: {text}\n")
        sys.stderr.flush()
