"""`get_runner` and the session-like Runner that trains the rewritten graph."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import threading
import time
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tfpar.runtime import checkpoint, job, liveness
from tfpar.runtime import trials
from tfpar.graph.analysis import analyse
from tfpar.graph.row_reads import upstream
from tfpar.plan.config import Config
from tfpar.errors import raise_blockers, TfparError, summary
from tfpar.plan import Plan
from tfpar.runtime.measure import measure
from tfpar.runtime.reinitialise import Reinitialiser
from tfpar.plan.measurements import Measurements
from tfpar.plan.planner import auto_tiles, make_plan, on_parameter_servers, route_trials
from tfpar.plan.routing import RouteTrial, fastest_trial
from tfpar.plan.layout import parse_resources, reconcile
from tfpar.runtime.sharding import with_shard_values
from tfpar.transform import stages, surgery
from tfpar.graph.graph_copy import copy_graph, to_meta_graph
from tfpar.graph.naming import safe_name
from tfpar.transform.parameter_server import piece_of, ps_device, whole_of, worker_device
from tfpar.transform.rewrite import rewrite
from tfpar.transform.collectives import tile_of, whole
from tfpar.transform.late_ops import LateOps
from tfpar.transform.outside_uses import same_on_every_worker
from tfpar.transform.tiled import chains, predicted_bytes
from tfpar.transform.traffic import PATHS, counters

log = logging.getLogger("tfpar")
WITHIN_HOST_BYTES_PER_S = 10e9  # the tiling mesh's links inside a host (not measured)
_CALLS = 0  # get_runner calls of this process (each one a rendezvous of every rank)


def get_runner(graph, resources=None, config: Optional[Config] = None) -> "Runner":
    """Turns a single-device training graph into a data-parallel Runner for this worker.

    Args:
      graph: the single-device `tf.Graph` (or a `MetaGraphDef`) with an optimizer's update ops.
      resources: the cluster: `"host1:2,host2:2"`, a path to a file of `host[: gpu ids]`
        lines, or None to take it from the running `horovodrun` job. It must agree with
        the job.
      config: a `tfpar.Config`; default `Config()` (HYBRID).

    Returns:
      A `Runner` that runs the user's tensors, ops and names like a `tf.compat.v1.Session`.
      Every worker starts from worker 0's variable values.
    """
    config = Config() if config is None else config
    if not isinstance(config, Config):
        raise TfparError(f"config must be a tfpar.Config, got {type(config).__name__}")
    requested = parse_resources(resources)
    meta, source, analysis = _read(graph, config)
    layout = _join(requested, config)
    measured = measure(meta, analysis, config, layout)
    if config.search_routes:
        measured = _route_trials(meta, source, analysis, config, layout, measured)
    measured = _partition_counts(meta, source, analysis, config, layout, measured)
    # Nothing is timed from here on, so the servers' start may share the cores.
    prestarted = _prestart_servers(analysis, config, layout, measured)
    try:
        plan = make_plan(analysis, config, layout, measured)  # every decision, once
        if config.tiling:
            plan = _split(plan, config, source, analysis, layout, measured)
        runner = _start(meta, plan, config, layout,
                        graph if isinstance(graph, tf.Graph) else None)
    finally:
        if prestarted:  # not taken: no parameter servers after all, or an error came first
            from tfpar.runtime import cluster as ps_cluster
            ps_cluster.discard_prestarted()
    if runner.is_chief:
        log.info("%s", plan.table())
    if config.checkpoint_dir:
        runner._resume(config)
    return runner


def _read(graph, config: Config):
    """(the MetaGraphDef, the user's tf.Graph, its analysis); a Horovod script's own
    collectives are refused here, before anything runs the graph."""
    meta = to_meta_graph(graph)
    source = graph if isinstance(graph, tf.Graph) else copy_graph(meta)
    analysis = analyse(source, config.gradient_scope, strict=False)
    raise_blockers([b for b in analysis.blockers
                    if source.get_operation_by_name(b.subject).type.startswith("Horovod")])
    return meta, source, analysis


def _prestart_servers(analysis, config: Config, layout, measured: Measurements) -> bool:
    """Starts this host's parameter-server process ahead of the rewrite when the plan puts
    variables on the servers (`cluster.prestart`); True if it may have."""
    try:
        _, on_ps = on_parameter_servers(analysis, config, layout, measured)
    except TfparError:
        return False  # make_plan raises it, as without this
    if not on_ps:
        return False
    from tfpar.runtime import cluster as ps_cluster
    ps_cluster.prestart(layout)
    return True


def _join(requested, config: Config):
    """Meets every rank (a clear error if one never comes), starts Horovod and the job's
    liveness; returns the job's layout."""
    global _CALLS
    _CALLS += 1
    liveness.wait_for_arrival(_CALLS, config.liveness_timeout)  # before any collective
    hvd = job.horovod()
    layout = reconcile(requested, job.current_layout())
    if hvd.size() > 1 or config.run_mode != "AR":  # (a lone process may have a PS to watch)
        liveness.get_liveness(hvd.rank(), hvd.size(),
                              layout.hosts[layout.host_of_rank(hvd.rank())].name,
                              config.liveness_timeout, config.step_deadline, config.interface,
                              config.first_step_deadline)
    return layout


def _with_tiles(plan: Plan, tiling) -> Plan:
    from tfpar.partition.tiling.cuts import Tiling
    try:
        return plan.with_tiles({name: Tiling.parse(t) for name, t in tiling.items()})
    except ValueError as e:
        raise TfparError(f"Config.tiling: {e}") from None


def _split(plan: Plan, config: Config, graph: tf.Graph, analysis, layout,
           measured: Measurements) -> Plan:
    """The plan with the weights Config.tiling splits (tiled route), and the bytes each
    split layer will move. On several hosts, "auto" plans on a mesh whose host links are
    the measured ones (the links within a host are taken as 10 GB/s: not measured)."""
    def layer_bytes(p):
        return predicted_bytes(graph, p)

    def with_chains(p):
        return dataclasses.replace(p, notes=p.notes + tuple(
            f"tiled chain: {' -> '.join(c)} (the activations between stay split)"
            for c in chains(graph, p) if len(c) > 1))
    if config.tiling != "auto":
        split = _with_tiles(plan, config.tiling)
        return with_chains(split.with_predicted(layer_bytes(split)))
    from tfpar.plan.mesh import DeviceMesh
    from tfpar.graph.extract import extract
    from tfpar.partition.tiling.planner import plan_tiling
    slots = {h.slots for h in layout.hosts}
    devices = layout.num_workers
    if len(layout.hosts) > 1 and len(slots) == 1 and measured.links is not None:
        devices = DeviceMesh.hosts(len(layout.hosts), layout.hosts[0].slots,
                                   1.0 / measured.links.per_byte_s, WITHIN_HOST_BYTES_PER_S,
                                   measured.links.latency_s)
    try:
        flow = extract(graph, analysis, None, config.gradient_scope)
        planned = plan_tiling(flow.batch_times(layout.num_workers), devices)
    except TfparError as e:
        return dataclasses.replace(plan, notes=plan.notes + (f"tiling auto: nothing split ({e})",))
    split, why = auto_tiles(plan, planned, config.tiling_min_bytes, layer_bytes)
    return with_chains(dataclasses.replace(split, tiling=planned, notes=split.notes + tuple(why)))


def _route_trials(meta, graph, analysis, config: Config, layout,
                  measured: Measurements) -> Measurements:
    """`measured` with the routes and local aggregation of the fastest route trial
    (`Config(search_routes=True)`): each candidate of `planner.route_trials` planned,
    started and timed like a partition trial; the mean over workers decides. The trials
    are remembered (`search_cache`) for this graph, layout and settings; "force" times
    them again."""
    key = trials.route_cache_key(meta, analysis, layout, config)
    if config.search_routes != "force":
        record = trials.remembered_record(config, key)
        done = tuple(RouteTrial(**t) for t in (record or {}).get("trials", ()))
        best = fastest_trial(done)
        if best is not None:
            trials.log(f"route trials: remembered ({best.describe()}); "
                       "search_routes='force' times them again")
            return dataclasses.replace(measured, route_trials=done, routes=best.routes,
                                       local_aggregation=best.aggregation,
                                       routes_remembered=True)
    warmup, steps = config.search_steps
    step_ops = trials.training_step(graph, analysis)
    began, done = time.time(), []
    for k, t in enumerate(route_trials(analysis, config, layout, measured)):
        if k and trials.agree_float(time.time() - began) > config.search_seconds:
            trials.log(f"route trials: time cap of {config.search_seconds:.0f} s reached")
            break
        candidate = dataclasses.replace(measured, routes=t.routes,
                                        local_aggregation=t.aggregation)
        trial = _start(meta, make_plan(analysis, config, layout, candidate), config, layout,
                       graph, trial=True)
        try:
            # The first trial warms the process too (Horovod's caches, thread pools, the
            # servers' channels): it runs longer untimed, so it is not slower for being first.
            untimed = warmup + (warmup + steps if k == 0 else 0)
            step = trials.agree_mean(trials.timed_steps(trial, step_ops, config.search_feed,
                                                        untimed, steps, "route trials"))
        finally:
            trial.release()
        done.append(dataclasses.replace(t, measured_s=step))
        trials.log(f"route trial {k + 1}: {done[-1].describe()}")
    best = fastest_trial(tuple(done))
    if best is None:
        return measured
    trials.store_record(config, key, {"trials": [dataclasses.asdict(t) for t in done]})
    return dataclasses.replace(measured, route_trials=tuple(done), routes=best.routes,
                               local_aggregation=best.aggregation)


def _partition_counts(meta, graph, analysis, config: Config, layout,
                      measured: Measurements) -> Measurements:
    """`measured` with the counts of `tfpar.partitioner` groups (searched in this job by
    timed trials, each planned and started with its candidate counts, if need be)."""
    warmup, steps = config.search_steps
    step_ops = []  # the training step's ops, found at the first trial

    def run_trial(trial_counts):
        step_ops[:] = step_ops or trials.training_step(graph, analysis)
        candidate = dataclasses.replace(measured, partitions=trial_counts)
        trial = _start(meta, make_plan(analysis, config, layout, candidate), config, layout,
                       graph, trial=True)
        try:
            return trials.timed_steps(trial, step_ops, config.search_feed, warmup, steps)
        finally:
            trial.release()

    return trials.resolve_counts(graph, meta, analysis, config, layout, measured,
                                 run_trial)[0]


def _start(meta, plan: Plan, config: Config, layout, source: Optional[tf.Graph],
           trial: bool = False) -> "Runner":
    """Rewrites a copy of the graph for `plan`, starts its session, initialises it."""
    hvd = job.horovod()
    rank = hvd.rank()
    host = layout.hosts[layout.host_of_rank(rank)]
    session_config = job.session_config(config.session_config, host.gpus)
    rewritten = copy_graph(with_shard_values(meta, hvd.size(), rank))
    entries = checkpoint.entries_of(rewritten)  # the single-device model's variables
    cluster = ps = None
    live = liveness.current()
    stage = live.stage if live is not None else (lambda text: None)
    try:
        stage("rewriting the graph")
        generation = None
        if plan.num_ps:  # only PS jobs start servers: after the rewrite, which may refuse
            from tfpar.runtime import cluster as ps_cluster
            generation = ps_cluster.next_generation()
        done = rewrite(rewritten, plan, rank,
                       f"tfpar/r{generation}" if generation is not None else None)
        release = (_own_container(rewritten, f"tfpar.r{generation}")
                   if generation is not None else None)
        ps, tiled = done.ps, done.tiled
        init = job.init_op(rewritten)
        broadcast = job.broadcast_op(rewritten)
    except BaseException as e:
        if live:
            live.abort(_reason(e))
        raise
    if plan.num_ps:
        stage("starting the parameter servers")
        cluster = ps_cluster.get_cluster(layout, live, session_config, config.interface)
    try:
        session = tf.compat.v1.Session(
            target=cluster.target if cluster else "", graph=rewritten,
            config=cluster.session_config(session_config) if cluster else session_config)
    except BaseException as e:
        if live:
            live.abort(_reason(e))
        raise
    try:
        # One run, so an initial value that several initialisers read (a random one read
        # by a PS part and by an EMA shadow of it) is drawn once.
        stage("initialising the variables" + (" (the chief: also the parts on the parameter "
                                               "servers)" if ps is not None and rank == 0
                                               else ""))
        # Copies of the initialisers' random ops draw them: a script's own run of
        # global_variables_initializer() then draws what it draws in a plain session.
        session.run(surgery.with_own_draws(
            [init, ps.init] if ps is not None and rank == 0 else [init], "tfpar/startup/"))
        stage("the broadcast of worker 0's variables (a Horovod collective)")
        session.run(broadcast)
        if ps is not None:
            stage("waiting for every worker to initialise (a Horovod collective)")
            job.allgather_strings("initialised")  # no worker reads a PS part before this
    except BaseException as e:
        session.close()
        if live:
            live.abort(_reason(e))
        raise
    local = {v.op.name: v for v in rewritten.get_collection(
        tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)}
    assigner = checkpoint.Assigner(rewritten, local, ps.parts if ps is not None else {},
                                   _tile_setters(plan, tiled, rank))
    if live is not None:
        live.step_finished()  # start-up is over: ready for the user's first step
    return Runner(session, rewritten, plan, rank, hvd.size(), source, ps, trial=trial,
                  broadcast=broadcast, entries=entries, assigner=assigner,
                  liveness=live if hvd.size() > 1 else None,
                  tiles=tiled.tiles if tiled is not None else None,
                  stages=done.stages.reads, stage_groups=done.stages.groups, ahead=done.ahead,
                  replaced=tiled.replaced if tiled is not None else None,
                  known=frozenset(node.name for node in meta.graph_def.node),
                  release=release)


def _own_container(graph: tf.Graph, container: str) -> tf.Operation:
    """Puts this worker's variables of a PS job's graph in a container of this runner's;
    returns the op that frees its resource variables (`Runner.close` runs it). Its session
    runs on the worker's TensorFlow server, which keeps a variable by its name for the
    life of the process, unlike a plain session: a later runner's variable of the same
    name would be this one (a second model of one script, trained after the first), and
    with another dtype fail to initialise. The parameter servers' parts are named per
    runner already."""
    handles = []
    for op in graph.get_operations():
        if op.type in ("VarHandleOp", "VariableV2") and not op.device.startswith("/job:ps"):
            surgery.set_container(op, container)
            if op.type == "VarHandleOp":
                handles.append(op.outputs[0])
    with graph.as_default(), tf.compat.v1.name_scope("tfpar/release/"):
        return tf.group(*[tf.raw_ops.DestroyResourceOp(resource=h, ignore_lookup_error=True)
                          for h in handles])


def _tile_setters(plan: Plan, tiled, rank: int):
    """{split variable: (whole value on worker 0 -> this worker's tile, tile variable)}."""
    if tiled is None:
        return {}
    out = {}
    for name, var in tiled.tiles.items():
        v = plan.variable(name)
        out[name] = (lambda value, v=v, name=name: tile_of(
            value, v.tiling, v.shape, rank, f"tile_of_{safe_name(name)}"), var)
    return out


def _reason(e: BaseException) -> str:
    return summary(e)


class Runner(surgery.session_base()):
    """Runs the rewritten graph with the names and objects of the user's original graph.

    `run(fetches, feed_dict)` takes the original graph's tensors, ops, variables or their
    names (in any nest of lists, tuples, dicts) and returns values in the same structure.
    It is a TensorFlow session as TF's own functions check one (`start_queue_runners`,
    a Saver's `save` and `restore`), on the user's graph.
    """

    def __init__(self, session, graph: tf.Graph, plan: Plan, worker_id: int, num_workers: int,
                 source_graph: Optional[tf.Graph] = None, ps=None, trial: bool = False,
                 broadcast=None, entries=(), assigner=None, liveness=None, tiles=None,
                 stages=None, ahead=None, replaced=None, stage_groups=None,
                 known: Optional[FrozenSet[str]] = None, release=None):
        self._session = session
        self._release = release  # frees this worker's variables on its server (PS jobs)
        self._liveness = liveness
        self._stages = dict(stages or {})  # stage -> its markers' values (see _where)
        self._stage_groups = dict(stage_groups or {})  # stage -> each marker's update group
        self._steps = 0  # training steps this runner finished
        if liveness is not None:
            liveness.set_probe(self._where)
        # What makes a run a training step (counted: checkpoints every N steps, the stage
        # markers): an optimizer's update or the parameter servers' step. What makes it
        # wait for the other workers (watched as a step is): those, or a Horovod
        # collective (a split variable's whole read, a user's assignment of one).
        self._updates = {op.name for op in graph.get_operations()
                         if op.type.startswith(("Apply", "ResourceApply", "SparseApply",
                                                "ResourceSparseApply"))}
        if ps is not None:
            self._updates.update(step.name for step in ps.steps.values())
        self._collective = self._updates | {op.name for op in graph.get_operations()
                                            if op.type.startswith("Horovod")}
        self._is_step_cache: Dict[tuple, bool] = {}
        self._waits_cache: Dict[tuple, bool] = {}
        self._signatures: Dict[tuple, str] = {}  # (see _collectives)
        self._broadcast = broadcast
        self._entries = tuple(entries)
        self._assigner = assigner
        # The user's runs of initialisers (replicated variables: those the start-up
        # broadcast sets, not tiles, counters or markers).
        self._reinitialise = Reinitialiser(
            session, graph, self._entries, assigner,
            {v.op.name: v for v in job.broadcast_variables(graph)}, worker_id, num_workers)
        self._session_view = None
        self._trial = trial
        self._ps = ps
        # {update op of the user's graph: (its variable, its update group)}: a run updates
        # whole groups (Plan.update_groups), each with its collectives and servers' step.
        self._update_groups = {op: (v.name, g.group) for v in plan.variables
                               if v.slot_of is None for g in v.gradients for op in g.ops} \
            if source_graph is not None else {}
        self._ps_variables = {v.name for v in plan.variables if v.route == "ps"} \
            if ps is not None else set()
        self._runs_groups: Dict[tuple, Tuple[frozenset, Optional[str]]] = {}
        self._group_steps = [0] * max(1, len(plan.update_groups))  # each group's steps (see _where)
        self._running: frozenset = frozenset()  # the groups of the step that runs
        self._replaced = dict(ps.replaced) if ps is not None else {}
        self._replaced.update(replaced or {})  # split variables' writes and reads outside the step
        self._counters = counters(graph)
        self._graph = graph
        self._plan = plan
        self._worker_id = worker_id
        self._num_workers = num_workers
        self._source = source_graph
        self._reads: Dict[str, tf.Tensor] = dict(ps.reads) if ps is not None else {}
        self._saves = 0
        self._tiles = dict(tiles or {})
        self._late_reads = 0  # (see _read_after)
        self._writer: Optional[threading.Thread] = None  # a background save's write
        self._writer_error: Optional[BaseException] = None
        self._tile_reads: Optional[list] = None  # (built by `tiles`)
        self._counter_reads: Optional[list] = None  # (built by `communication`)
        self._push_reads: Optional[list] = None  # (built by `ps_pushes`)
        self._save_ops: Optional[checkpoint.SaveOps] = None  # (built by the first save)
        self._autosave = None  # (folder, every steps, every secs, keep, last step, last time)
        self._inputs = checkpoint.InputPositions(graph, worker_id, num_workers, ahead)
        # The input read a step ahead (Plan.ids_ahead): its ops, whether a batch is staged
        # (its ids already with their owners), and which fetches train on it.
        self._ahead = ahead
        self._staged = False
        self._consumes_cache: Dict[tuple, bool] = {}
        if ahead is not None:
            self._replaced.update(ahead.replaced)
            self._ahead_reads = {op.name for op in ahead.reads}
            self._advance = ahead.advance
        # Ops the script adds to its graph after get_runner (`known`: the names it had),
        # copied into this graph on first use; variables held in parts or tiles read whole.
        self._moved = {name: "ps" for name in (ps.reads if ps is not None else ())}
        self._moved.update({name: plan.variable(name).route for name in self._tiles})
        self._late = LateOps(source_graph, graph, known, self._existing, self._moved,
                             self._read_after, self._write_after) \
            if source_graph is not None and known is not None else None

    worker_id = property(lambda self: self._worker_id, doc="This worker's index (the Horovod rank).")
    num_workers = property(lambda self: self._num_workers, doc="How many workers the job has.")
    is_chief = property(lambda self: self._worker_id == 0, doc="Whether this is worker 0.")
    plan = property(lambda self: self._plan, doc="What tfpar decided (a printable tfpar.Plan).")
    graph = property(lambda self: self._graph if self._source is None else self._source,
                     doc="The user's graph, as a session's (the rewritten one where the "
                         "runner was made from a MetaGraphDef).")
    rewritten_graph = property(lambda self: self._graph,
                               doc="The rewritten graph this runner executes.")
    sess_str = property(lambda self: "")

    @property
    def session(self):
        """A session on the rewritten graph, for a `tf.compat.v1.train.Saver` of the user's
        graph: `saver.save(runner.session, path)` writes the single-device checkpoint (PS
        parts read whole); `saver.restore(runner.session, path)` runs `Runner.restore` (so
        every worker must call it). Anything else runs as on the underlying session."""
        if self._session is None:
            raise TfparError("this tfpar Runner is closed")
        if self._session_view is None:
            self._session_view = _SessionView(self._session, self._graph, self.restore,
                                              self._tiles)
        return self._session_view

    # -- checkpoints -----------------------------------------------------------------------
    def save(self, path: str, global_step: Optional[int] = None,
             max_to_keep: Optional[int] = 5, background: bool = False) -> Optional[str]:
        """Writes the single-device model's checkpoint at `path-<step>` (chief only).

        Every global variable of the user's graph under its original name and full shape:
        parameter-server parts put back together, slots, moving averages, the global step.
        The user's graph restores it with a plain `tf.compat.v1.train.Saver`. The write is
        atomic (a killed save leaves the previous checkpoint readable) and only the newest
        `max_to_keep` checkpoints of the folder are kept (None: all). The step is the graph's
        global step unless given. Returns the prefix written; on other workers it writes
        nothing and returns None. A job with split variables (Config.tiling) saves each
        whole, gathered from the workers' tiles: there every worker must call save.
        Every worker that calls it also writes where its `tf.data` iterators are
        (`<prefix>.input-<rank>-of-<N>`), so a restore with the same worker count goes on
        with the data where it was: call it on every worker for that.
        background: copy the variables now (a consistent snapshot at this step boundary:
        the parameter servers copy their parts where they are and keep that copy, the chief
        its other variables) and write the copies in a thread, so training goes on; the
        next save and `close` wait for the write (and raise its error, if it failed).
        """
        if self._session is None:
            raise TfparError("this tfpar Runner is closed")
        tiled = [e for e in self._entries if e.name in self._tiles]
        gathered = dict(zip((e.name for e in tiled),
                            self._session.run([self._read(e.name) for e in tiled])))
        checkpoint.checkpoint_folder(os.path.dirname(os.path.abspath(path)))
        if global_step is None:
            step_name = self._plan.global_step
            global_step = (int(self._session.run(self._read(step_name))) if step_name
                           else self._saves)
        self._saves += 1
        prefix = f"{path}-{int(global_step)}"
        if self._inputs:  # each worker's tf.data position, at this same step boundary
            self._inputs.save(self._session, prefix, max_to_keep, staged=self._staged)
        if not self.is_chief:
            return None
        self._wait_for_writer()  # (it may still read the last snapshot)
        if self._save_ops is None:
            fed = [e.name for e in tiled]
            self._save_ops = checkpoint.SaveOps(
                self._graph, self._entries,
                {e.name: self._read(e.name) for e in self._entries if e.name not in gathered},
                self._ps.parts if self._ps is not None else {}, fed,
                chief=(worker_device(0) if self._ps is not None else "") + "/device:CPU:0",
                writer=(ps_device(self._plan.host_of_rank(0)) if self._ps is not None
                        else "/device:CPU:0"))
        if background:
            # A copy of every variable now (the servers copy their parts where they are);
            # the thread writes the copies while training goes on.
            self._save_ops.take(self._session)
            self._writer = threading.Thread(target=self._write, name="tfpar-checkpoint",
                                            args=(prefix, gathered, True, max_to_keep))
            self._writer.start()
        else:
            self._write(prefix, gathered, False, max_to_keep)
            self._wait_for_writer()
        return prefix

    def _write(self, prefix: str, fed: dict, copies: bool, max_to_keep):
        try:
            # (absolute: in a PS job the write runs in the chief host's server process)
            self._save_ops.write(self._session, os.path.abspath(prefix), fed, copies)
            checkpoint.record(prefix, max_to_keep)  # only a complete write becomes latest
        except BaseException as e:  # noqa: BLE001 (raised by the caller's next save/close)
            self._writer_error = e

    def _wait_for_writer(self):
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        error, self._writer_error = self._writer_error, None
        if error is not None:
            raise TfparError(f"writing a checkpoint failed: {summary(error)}") from error

    def _resume(self, config: Config):
        """Config.checkpoint_dir: restore its latest checkpoint (every worker), then save
        there periodically (see `run`)."""
        folder = checkpoint.checkpoint_folder(config.checkpoint_dir)
        if self.is_chief:
            checkpoint.remove_partial_writes(folder)  # of a save a fault cut short
        if tf.train.latest_checkpoint(folder):
            restored = self.restore(folder)
            if self.is_chief:
                log.warning("tfpar: resumed from %s", restored)
        self._autosave = [folder, config.checkpoint_every_steps, config.checkpoint_every_secs,
                          config.checkpoint_max_to_keep, self._steps, time.time()]

    def _autosave_due(self):
        folder, steps, secs, keep, last_step, last_time = self._autosave
        due = bool(steps and self._steps - last_step >= steps)
        if not due and secs and time.time() - last_time >= secs:
            due = self.is_chief  # only the chief writes (split layers save by steps)
        if due:
            self.save(os.path.join(folder, "model.ckpt"), max_to_keep=keep, background=True)
            self._autosave[4:] = [self._steps, time.time()]

    def restore(self, path: str, variables: Optional[Sequence[str]] = None) -> str:
        """Sets the model from a checkpoint of the single-device model (one Runner.save or
        a Saver of the user's graph wrote, in any mode, worker count or partition count).

        Every worker must call it (it ends with a broadcast from the chief). `path`: a
        prefix, or a folder (its latest checkpoint). `variables`: restore only these
        variable names (default: all), or a dict {variable name: its name in the
        checkpoint} (a Saver given a `var_list` dict names them its own way; None: its
        own name, or for a part of a partitioned variable the whole one's). Either every variable is restored or, when the
        checkpoint lacks one or has another shape, none is and a TfparError says which.
        Returns the prefix restored. Each worker's `tf.data` position is restored too when
        every worker saved its own with this worker count (see `save`).
        """
        if self._session is None:
            raise TfparError("this tfpar Runner is closed")
        entries = self._entries
        if isinstance(variables, dict):  # the checkpoint's names for them
            entries = tuple(dataclasses.replace(e, key=variables[e.name] or e.key)
                            for e in entries if e.name in variables)
        elif variables is not None:
            wanted = set(variables)
            entries = tuple(e for e in entries if e.name in wanted)
        status, values, prefix = "", None, ""
        if self.is_chief:
            try:
                prefix = checkpoint.resolve(path)
                values = checkpoint.read(prefix, entries)
            except (TfparError, tf.errors.OpError) as e:
                status = f"{type(e).__name__}: {getattr(e, 'message', None) or e}"
        everyone = job.allgather_strings(status + "\0" + prefix)  # also a barrier
        status, prefix = everyone[0].split("\0", 1)
        if status:
            raise TfparError(f"restore from {path!r} failed on the chief: {status}")
        if self.is_chief:
            ops, feeds = self._assigner.assign_ops(entries, values)
        else:  # the tiles of split variables: each worker takes its tile of the chief's
            tiled = self._assigner.tiled(entries)
            ops, feeds = self._assigner.assign_ops(
                tiled, [np.zeros(e.shape, e.dtype) for e in tiled])
        if ops:
            self._session.run(ops, feeds)
        if self._broadcast is not None:
            self._session.run(self._broadcast)
        # The input's positions, when every worker saved its own for this worker count
        # (else every worker's input goes on from where it is now).
        have = os.path.exists(prefix + checkpoint.input_suffix(
            self._worker_id, self._num_workers) + ".index") if self._inputs else False
        if all(x == "1" for x in job.allgather_strings("1" if have else "0")) and have:
            if self._inputs.restore(self._session, prefix) and self._ahead is not None:
                # The batch read ahead when it was saved is the next one: staged with its
                # ids' exchange (a collective: every worker restores).
                self._session.run(self._ahead.prime)
                self._staged = True
            elif self._ahead is not None:
                self._staged = False  # the iterators are where the model is
        elif self._inputs and self.is_chief:
            log.warning("tfpar: %s holds no input positions for %d workers: the tf.data "
                        "input is not moved to where it was", prefix, self._num_workers)
        return prefix

    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        """Like `tf.compat.v1.Session.run`, with the original graph's tensors, ops and names."""
        if self._session is None:
            raise TfparError("this tfpar Runner is closed")
        name = getattr(fetches, "name", fetches)
        if isinstance(name, str) and is_saver_op(name):  # saver.save(runner) or restore
            feeds = {getattr(k, "name", k): v for k, v in (feed_dict or {}).items()}
            if self._late is not None and self._late_name(name):  # a Saver built later
                if _RESTORE_OP.search(name.split(":")[0]):
                    path = next(iter(feeds.values()))
                    self.restore(path.decode() if isinstance(path, bytes) else str(path),
                                 saver_restores(self._source, name))
                    return None
                feeds = {self._element(k, feed=True).name: v for k, v in feeds.items()}
                name = self._element(name).name
            return self.session.run(name, feeds, options, run_metadata)
        mapped = tf.nest.map_structure(self._element, fetches)
        groups = self._groups_of_run(fetches)
        feeds = None
        if feed_dict:
            feeds = {self._element(k, feed=True): v for k, v in feed_dict.items()}
            staged = [k.name for k in feeds if self._ahead is not None
                      and getattr(k, "name", None) in self._ahead.replaced]
            if staged:  # the step reads the batch staged a step ago, not this tensor
                raise TfparError(
                    f"feed of {staged[0]!r}: with Config(ids_ahead=True) the input is read "
                    "a step ahead, and the step trains on the staged batch, not on this "
                    "tensor; feed an input of your own (a placeholder) or leave ids_ahead "
                    "False")
        step = self._is_step(mapped)
        self._running = groups
        # A run of initialisers (global_variables_initializer(), Variable.load) is followed
        # by setting every worker's variables to the chief's (tfpar.runtime.reinitialise).
        reinit = self._reinitialise.reached(_fetched_ops(mapped))
        if self._liveness is None or not (reinit or self._waits(mapped)):
            out = self._execute(mapped, feeds, options, run_metadata)
            if reinit:
                self._reinitialise(reinit)
        else:
            self._liveness.step_started(*self._collectives(
                mapped, fetches, "reinitialise " + " ".join(reinit) if reinit else ""),
                counted=self._waits(mapped))
            ended = False
            try:
                out = self._execute(mapped, feeds, options, run_metadata)
                if reinit:
                    self._reinitialise(reinit)
            except tf.errors.OutOfRangeError:
                ended = True  # its input is exhausted: the others must be told if they go on
                raise
            finally:
                self._liveness.step_finished(input_ended=ended)
        if step:
            self._steps += 1
            for group in groups:
                self._group_steps[group] += 1
            if self._autosave is not None:
                self._autosave_due()
        return out

    def partial_run_setup(self, *args, **kwargs):
        raise TfparError("partial_run is not supported through tfpar")

    def partial_run(self, *args, **kwargs):
        raise TfparError("partial_run is not supported through tfpar")

    def list_devices(self):
        """The devices this worker's session runs on, as `Session.list_devices()`."""
        if self._session is None:
            raise TfparError("this tfpar Runner is closed")
        return self._session.list_devices()

    def _groups_of_run(self, fetches) -> frozenset:
        """The update groups (Plan.update_groups) a run of `fetches` updates. Refuses a
        run that updates some of a group's variables on the parameter servers but not all:
        the group's servers' step (pushes, the chief's updates, the token) applies them
        together, so it would apply the others too."""
        if not self._update_groups:
            return frozenset(range(len(self._group_steps)))
        ops = []
        for x in tf.nest.flatten(fetches, expand_composites=True):
            if isinstance(x, str):
                try:
                    x = self._source.as_graph_element(x)
                except (KeyError, ValueError):
                    continue
            if isinstance(x, tf.Tensor):
                x = x.op
            if isinstance(x, tf.Operation) and x.graph is self._source:
                ops.append(x)
        key = tuple(op.name for op in ops)
        if key not in self._runs_groups:
            reached = {self._update_groups[op.name] for op in upstream(ops)
                       if op.name in self._update_groups}
            groups = frozenset(group for _, group in reached)
            on_ps = {(name, group) for name, group in reached if name in self._ps_variables}
            missing = {(name, group) for name, group in self._update_groups.values()
                       if group in groups and name in self._ps_variables} - on_ps
            self._runs_groups[key] = (groups, None if not on_ps or not missing else (
                f"this run updates {sorted({n for n, _ in on_ps})} on the parameter servers "
                f"but not {sorted({n for n, _ in missing})}, which every other run that "
                "updates them updates with them: "
                "tfpar's parameter-server step applies their updates together, so it would "
                "update those too. Run what the other runs run (an optimizer's minimize() "
                "result or a tf.group of them), or give the variables of one of them a "
                "replicated route: Config(sparse_route={name: 'allgather', ...}) in "
                "HYBRID, run_mode 'AR' for dense ones"))
        groups, refusal = self._runs_groups[key]
        if refusal:
            raise TfparError(refusal)
        return groups

    def make_callable(self, fetches, feed_list=None, accept_options=False):
        """Like `tf.compat.v1.Session.make_callable`: a function of the values of
        `feed_list` (in order) that runs `fetches` through `run`, so both name the original
        graph; with `accept_options`, it takes `options` and `run_metadata` too. A fetch or
        feed it cannot map fails here, as TensorFlow's does."""
        if self._session is None:
            raise TfparError("this tfpar Runner is closed")
        feed_list = list(feed_list or [])
        tf.nest.map_structure(self._element, fetches)
        for k in feed_list:
            self._element(k, feed=True)

        def call(*values, **kwargs):
            if len(values) != len(feed_list):
                raise TypeError(f"this callable takes {len(feed_list)} feed value(s), "
                                f"{len(values)} given")
            unknown = set(kwargs) - ({"options", "run_metadata"} if accept_options else set())
            if unknown:
                raise TypeError(f"unexpected keyword argument {sorted(unknown)[0]!r}")
            return self.run(fetches, dict(zip(feed_list, values)) or None,
                            kwargs.get("options"), kwargs.get("run_metadata"))
        return call

    def _execute(self, mapped, feeds, options, run_metadata):
        """One session run of `mapped`; with the input a step ahead (`Plan.ids_ahead`), a
        run that trains on the staged batch first reads the next one (a run of the input
        alone), and moves it in with its ids' exchange (`advance`, beside the fetches);
        the first such run stages a batch first (`prime`), and the last batch runs without
        a next one. The input's end (OutOfRangeError) surfaces at the run after it, as in a plain
        session's loop."""
        if self._ahead is None or not self._consumes(mapped):
            return self._session.run(mapped, feed_dict=feeds, options=options,
                                     run_metadata=run_metadata)
        if not self._staged:
            self._session.run(self._ahead.fetch_next, feed_dict=feeds, options=options)
            self._session.run(self._ahead.prime, feed_dict=feeds, options=options)
            self._staged = True
        try:
            self._session.run(self._ahead.fetch_next, feed_dict=feeds, options=options)
        except tf.errors.OutOfRangeError:
            self._staged = False  # the staged batch is the last: train on it alone
            return self._session.run(mapped, feed_dict=feeds, options=options,
                                     run_metadata=run_metadata)
        return self._session.run((mapped, self._advance), feed_dict=feeds, options=options,
                                 run_metadata=run_metadata)[0]

    def _consumes(self, mapped) -> bool:
        """Whether running `mapped` reads the staged batch (it trains on it)."""
        return _reaches(mapped, self._ahead_reads, self._consumes_cache)

    def _where(self) -> str:
        """Where this worker's running training step waits, from its stage markers (read by
        a second session run while the step runs; see tfpar.transform.stages)."""
        if not self._stages or self._session is None:
            return ""
        counts = self._session.run(self._stages, options=tf.compat.v1.RunOptions(
            timeout_in_ms=5000))
        if len(self._group_steps) < 2:
            return stages.describe(counts, self._steps)
        done = {stage: [self._group_steps[g] if g in self._running else None
                        for g in self._stage_groups.get(stage, ())] for stage in counts}
        return stages.describe(counts, done)

    def _is_step(self, mapped) -> bool:
        """Whether running `mapped` is a training step: it reaches an update."""
        return _reaches(mapped, self._updates, self._is_step_cache)

    def _collectives(self, mapped, fetches, extra: str = "") -> Tuple[str, str]:
        """The Horovod collectives a run of `mapped` takes part in (and `extra`: what else
        the run waits for), as a signature that the same run has on every worker ("":
        none), and the user's `fetches` named, for the liveness hub to compare runs across
        workers."""
        elements = _fetched_ops(mapped)
        key = tuple(x.name for x in elements) + (extra,)
        if key not in self._signatures:
            self._signatures[key] = collective_signature(elements, extra)
        named = ", ".join(str(getattr(x, "name", x)) for x in tf.nest.flatten(fetches))
        return self._signatures[key], (named if len(named) <= 160 else named[:157] + "...")

    def waits_for_every_worker(self, fetches) -> bool:
        """Whether running `fetches` (the original graph's tensors, ops or names) takes part
        in a collective, so that every worker must run it at the same point: a training
        step, or a read of a variable split over the workers (a summary of a sharded
        embedding)."""
        return self._waits(tf.nest.map_structure(self._element, fetches))

    def _waits(self, mapped) -> bool:
        """Whether running `mapped` waits for the other workers: it reaches a collective
        or an update."""
        return _reaches(mapped, self._collective, self._waits_cache)

    def communication(self, mean_over_workers: bool = False) -> Dict[str, float]:
        """Bytes this worker moved so far, per path, from the tensors actually sent.

        Keys: "allreduce" and "allgather" (ring algorithms: sent plus received), "ps_push"
        (gradients pushed to parameter servers, by the worker and, with local aggregation,
        the host's sum forwarded by its first worker), "ps_pull" (rows and variables read
        from them), "tiled" (the exchanges of split layers), "sharded" (the all-to-alls of
        sharded variables: ids, rows and row gradients, and the dense gradients where they
        ride in them, `Plan.allreduce_by_alltoall`; received from the others, doubled),
        and "steps" (training steps run). Divide by "steps" for bytes per step.
        mean_over_workers: average over all workers instead; every worker must then call
        it at the same point (it gathers the counts through Horovod).
        """
        if self._session is None:
            raise TfparError("this tfpar Runner is closed")
        names = list(PATHS) + ["steps"]
        if self._counter_reads is None:  # read ops built once, in the job's graph (not
            # eagerly: TF2's default mode would run them outside it)
            with self._graph.as_default(), tf.compat.v1.name_scope("tfpar/traffic_reads/"):
                self._counter_reads = [self._counters[k].read_value() for k in names]
        values = self._session.run(self._counter_reads)
        mine = dict(zip(names, (float(v) for v in values)))
        if not mean_over_workers:
            return mine
        everyone = [json.loads(s) for s in job.allgather_strings(json.dumps(mine))]
        return {k: sum(d[k] for d in everyone) / len(everyone) for k in names}

    def tiles(self) -> Dict[str, dict]:
        """This worker's tiles of the variables split over the workers (Config.tiling):
        {variable name: {"value": its tile, "tiling": the tiling, "box": [[start, stop,
        step], ...] of the whole variable it holds (step 1 but on the rows of a cyclic
        tiling: `whole[start:stop:step, ...]`)}}."""
        if self._session is None:
            raise TfparError("this tfpar Runner is closed")
        names = sorted(self._tiles)
        if self._tile_reads is None:  # read ops built once: the graph does not grow
            with self._graph.as_default(), tf.compat.v1.name_scope("tfpar/tile_reads/"):
                self._tile_reads = [self._tiles[n].read_value() for n in names]
        out = {}
        for name, value in zip(names, self._session.run(self._tile_reads)):
            v = self._plan.variable(name)
            out[name] = {"value": value, "tiling": str(v.tiling),
                         "box": [[x.start, x.stop, x.step or 1] for x in
                                 v.tiling.tile_slices(v.shape, self._worker_id)]}
        return out

    def ps_pushes(self) -> Dict[str, int]:
        """{"variable/part_k": pushes its parameter server received so far} (PS jobs)."""
        if self._ps is None:
            return {}
        keys = sorted(self._ps.pushes)
        if self._push_reads is None:  # as `communication`'s
            with self._graph.as_default(), tf.compat.v1.name_scope("tfpar/push_reads/"):
                self._push_reads = [self._ps.pushes[k].read_value() for k in keys]
        values = self._session.run(self._push_reads)
        return {k: int(v) for k, v in zip(keys, values)}

    @property
    def user_session(self):
        """A session on the user's graph whose runs go through this runner (as `run`),
        a Saver's save and restore through tfpar's checkpoint: what hooks and `init_fn`s
        of `tfpar.MonitoredTrainingSession` get, and the default session of `as_default`."""
        if self._source is None:
            raise TfparError("this Runner was made from a MetaGraphDef: there is no user "
                             "graph to make a session for")
        return _UserSession(self, self._source)

    def as_default(self):
        """`with runner.as_default():` makes `tensor.eval()`, `op.run()` and
        `tf.compat.v1.get_default_session()` run the user's graph through this runner."""
        return surgery.default_session(self.user_session)

    def release(self):
        """Ends a search trial: frees its parameter-server state, then closes it."""
        if self._ps is not None and self._session is not None:
            job.allgather_strings("trial done")  # every worker is done with the PS state
            if self.is_chief:
                self._session.run(self._ps.release)
        self.close()

    def close(self):
        """Closes the session. The Horovod job, and in a PS job the parameter servers, stay
        up until the process exits: then each worker waits for all the others, so no PS
        stops while another worker may still read from it."""
        if self._session is not None:
            try:
                self._wait_for_writer()  # a background checkpoint write ends first
                if self._release is not None:
                    self._session.run(self._release)
            finally:
                if self._liveness is not None:
                    self._liveness.set_probe(None)
                self._session.close()
                self._session = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- name mapping ----------------------------------------------------------------------
    def _element(self, x, feed=False):
        """The rewritten graph's counterpart of a fetch or feed key of the user's graph:
        whatever `tf.compat.v1.Session.run` takes, with the same result."""
        if isinstance(x, tf.IndexedSlices):
            return tf.IndexedSlices(*(self._element(t, feed) for t in (x.values, x.indices)),
                                    self._element(x.dense_shape, feed)
                                    if x.dense_shape is not None else None)
        if isinstance(x, tf.SparseTensor):
            return tf.SparseTensor(*(self._element(t, feed)
                                     for t in (x.indices, x.values, x.dense_shape)))
        if isinstance(x, tf.Variable):
            self._check_graph(x)
            target = surgery.fetch_target(x)
            if target is not None:  # the result of an assignment: its new value, read after it
                return self._element(target, feed)
            late = self._late_copy(x.op)
            return self._read(x.op.name if late is None else late.name)
        if isinstance(x, (tf.Tensor, tf.Operation)):
            self._check_graph(x)
            name = x.name
        elif isinstance(x, str):
            name = x
        else:
            raise TfparError(f"cannot {'feed' if feed else 'fetch'} {x!r}: give a tensor, op, "
                             "variable or name of the graph passed to tfpar.get_runner")
        el = self._late_copy(x if isinstance(x, (tf.Tensor, tf.Operation)) else name)
        if el is None and name in self._replaced and not feed:
            return self._replaced[name]
        if el is None:
            try:
                el = self._graph.as_graph_element(name) if feed else self._existing(name)
            except (KeyError, ValueError) as e:
                raise TfparError(f"{'feed' if feed else 'fetch'} {name!r} is not in the graph "
                                 f"given to tfpar.get_runner ({e})") from None
        if (isinstance(el, tf.Tensor) and not feed
                and el.op.type in ("VarHandleOp", "VariableV2", "Variable")):
            return self._read(el.op.name)  # a variable by its name: its value, as a session
        return el

    def _late_copy(self, x):
        """The copy in this graph of `x` (a tensor, op or name of the user's graph) when
        the script built it after get_runner (`tfpar.transform.late_ops`), else None."""
        if self._late is None:
            return None
        if isinstance(x, str):
            try:
                x = self._source.as_graph_element(x)
            except (KeyError, ValueError):
                return None
        if not isinstance(x, (tf.Tensor, tf.Operation)):
            return None
        if not self._late.is_late(x.op if isinstance(x, tf.Tensor) else x):
            return None
        return self._late.tensor(x) if isinstance(x, tf.Tensor) else self._late.op(x)

    def _late_name(self, name: str) -> bool:
        """Whether `name` is of an op the script built after get_runner."""
        try:
            x = self._source.as_graph_element(name)
        except (KeyError, ValueError):
            return False
        return self._late.is_late(x.op if isinstance(x, tf.Tensor) else x)

    def _existing(self, name: str):
        """This graph's tensor or op for `name` of the graph given to get_runner: what the
        rewrite made of it, else the copy of it."""
        found = self._replaced.get(name)
        if found is not None:
            return found
        found = self._graph.as_graph_element(name)
        if (isinstance(found, tf.Tensor) and found.op.type in ("Identity", "RefIdentity")
                and found.op.inputs[0].op.type in ("VariableV2", "Variable")
                and found.op.inputs[0].op.name in self._moved):
            # A reference variable's `read` that the rewrite left (a slot's, which nothing
            # in the step reads): the variable lives in parts or tiles, so read it whole.
            return self._read(found.op.inputs[0].op.name)
        return found

    def _check_graph(self, x):
        if self._source is not None and x.graph is not self._source:
            raise TfparError(f"{x.name!r} belongs to another graph than the one given to "
                             "tfpar.get_runner")

    def _read_after(self, var_name: str, after: Sequence[tf.Operation] = ()) -> tf.Tensor:
        """The whole value of a variable held in parts or tiles, read after the ops
        `after` (a read made anew, so it waits for them; without them, `_read`'s)."""
        if not after:
            return self._read(var_name)
        self._late_reads += 1
        with self._graph.as_default(), tf.control_dependencies(list(after)), \
                tf.compat.v1.name_scope(f"tfpar/read_after/{self._late_reads}/"):
            if var_name in self._tiles:
                v = self._plan.variable(var_name)
                value = whole(self._tiles[var_name].value(), v.tiling, v.shape,
                              self._worker_id, f"whole_after_{self._late_reads}_"
                                               f"{safe_name(var_name)}")
                self._collective |= {op.name for op in self._graph.get_operations()
                                     if op.type.startswith("Horovod")}
                return value
            held = self._ps.parts[var_name]
            return whole_of([var.read_value() for var, _ in held], [p for _, p in held])

    def _write_after(self, var_name: str, value: tf.Tensor, after: Sequence[tf.Operation],
                     op_name: str) -> tf.Operation:
        """A write of the whole `value` (the script's `assign` `op_name`, built after
        get_runner) to a variable held in parts or tiles, after the ops `after`: each part
        on the servers gets its rows (every worker writes the same value, as an `assign`
        built before does); each worker its tile of a split variable, once an allgather
        of the workers' value fingerprints found them equal (else the run fails and
        nothing is written). Both are run by every worker, as the script's own assign is."""
        self._late_reads += 1
        with self._graph.as_default(), tf.control_dependencies(list(after)), \
                tf.compat.v1.name_scope(f"tfpar/write_after/{self._late_reads}/"):
            if var_name not in self._tiles:
                writes = []
                for var, part in self._ps.parts[var_name]:
                    with tf.device(var.device):
                        writes.append(_assign(var, piece_of(value, part)))
                return tf.group(*writes)
            v = self._plan.variable(var_name)
            scope = f"tfpar/write_after/{self._late_reads}/{safe_name(var_name)}"
            same = same_on_every_worker([value], self._num_workers, scope, var_name, op_name)
            with tf.control_dependencies([same]):
                write = _assign(self._tiles[var_name],
                                value[v.tiling.tile_slices(tuple(v.shape), self._worker_id)])
            self._collective |= {op.name for op in self._graph.get_operations()
                                 if op.type.startswith("Horovod")}
            return write

    def _read(self, var_name: str) -> tf.Tensor:
        """The value of a variable of the rewritten graph (made once, then reused). A
        variable split over the workers is gathered whole from their tiles: a collective,
        so every worker must fetch it at the same point (as in a training step)."""
        if var_name not in self._reads and var_name in self._tiles:
            v = self._plan.variable(var_name)
            with self._graph.as_default(), tf.compat.v1.name_scope("tfpar/read/"):
                self._reads[var_name] = whole(self._tiles[var_name].value(), v.tiling,
                                              v.shape, self._worker_id,
                                              f"whole_{safe_name(var_name)}")
            # Fetching it waits for the other workers: watched as a step is.
            self._collective |= {op.name for op in self._graph.get_operations()
                                 if op.type.startswith("Horovod")}
        if var_name not in self._reads:
            try:
                op = self._graph.get_operation_by_name(var_name)
            except KeyError:
                raise TfparError(f"variable {var_name!r} is not in the graph given to "
                                 "tfpar.get_runner") from None
            if op.type not in ("VarHandleOp", "VariableV2", "Variable"):
                raise TfparError(f"cannot read {var_name!r} as a variable: it is a {op.type} "
                                 "op, not a variable of the graph given to tfpar.get_runner")
            with self._graph.as_default(), tf.compat.v1.name_scope("tfpar/read/"):
                if op.type == "VarHandleOp":
                    t = tf.raw_ops.ReadVariableOp(resource=op.outputs[0],
                                                  dtype=op.get_attr("dtype"))
                else:
                    t = tf.identity(op.outputs[0])
            self._reads[var_name] = t
        return self._reads[var_name]


_RESTORE_OP = re.compile(r"(^|/)save(_\d+)?/restore_all$")
# The tensor a Saver's save fetches (a sharded Saver's: its Identity).
_SAVE_OP = re.compile(r"(^|/)save(_\d+)?/(control_dependency(_\d+)?|Identity)$")


# TF1 control flow: ops behind a Switch may not run, and ops in a while frame run any
# number of times, so a run through them may take part in fewer collectives than it reads.
_V1_CONTROL_FLOW = frozenset({"Switch", "RefSwitch", "Enter", "RefEnter"})


def collective_signature(ops: Sequence[tf.Operation], extra: str = "") -> str:
    """A short hash of the Horovod collectives a run of `ops` takes part in (and `extra`),
    equal on every worker for the same run; "" when it has none, or when TF1 control flow
    may skip some of them (then the liveness hub does not compare it)."""
    reached = upstream(ops)
    if any(op.type in _V1_CONTROL_FLOW for op in reached):
        return ""
    names = sorted(op.name for op in reached if op.type.startswith("Horovod"))
    names += [extra] if extra else []
    return hashlib.sha1("\n".join(names).encode()).hexdigest()[:12] if names else ""


def _fetched_ops(mapped) -> List[tf.Operation]:
    """The ops a run of the fetches `mapped` (of the rewritten graph) asks for."""
    return [x.op if isinstance(x, tf.Tensor) else x for x in tf.nest.flatten(mapped)
            if isinstance(x, (tf.Tensor, tf.Operation))]


def _reaches(mapped, names, cache: Dict[tuple, bool]) -> bool:
    """Whether running the fetches `mapped` runs an op named in `names` (data and control
    inputs); remembered in `cache` by the fetches' names."""
    elements = _fetched_ops(mapped)
    key = tuple(x.name for x in elements)
    if key not in cache:
        cache[key] = any(op.name in names for op in upstream(elements))
    return cache[key]


def is_saver_op(name: str) -> bool:
    """Whether `name` is a tf.compat.v1.train.Saver's save or restore op (or tensor)."""
    op = name.split(":")[0]
    return bool(_RESTORE_OP.search(op) or _SAVE_OP.search(op))


def _checkpoint_key(value: tf.Tensor) -> Optional[str]:
    """The checkpoint name a Saver's restore reads `value` from (an output of its
    RestoreV2, through identities), or None."""
    while value.op.type == "Identity":
        value = value.op.inputs[0]
    if value.op.type not in ("RestoreV2", "RestoreSlice", "Restore"):
        return None
    names = tf.get_static_value(value.op.inputs[1])
    if names is None:
        return None
    names = np.atleast_1d(names)
    key = names[value.value_index if value.op.type == "RestoreV2" else 0]
    return key.decode() if isinstance(key, bytes) else str(key)


def _assign(var, value: tf.Tensor) -> tf.Operation:
    """An op writing `value` to `var` (a resource or a reference variable)."""
    if var.op.type == "VarHandleOp":
        return tf.raw_ops.AssignVariableOp(resource=var.handle, value=value)
    return tf.compat.v1.assign(var, value, validate_shape=False).op


def saver_restores(graph: tf.Graph, restore_op_name: str):
    """The variables a Saver's restore op (of `graph`) writes (its var_list), as a dict
    {variable name: its name in the checkpoint} (a Saver given a dict names them its own
    way)."""
    op = graph.get_operation_by_name(restore_op_name.split(":")[0])
    names, stack, seen = {}, [op], set()
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        if x.type in ("Assign", "AssignVariableOp") and x.inputs[0].op.type in (
                "VariableV2", "VarHandleOp"):
            names[x.inputs[0].op.name] = _checkpoint_key(x.inputs[1])
        stack.extend(x.control_inputs)
        stack.extend(t.op for t in x.inputs if t.op.type in ("NoOp", "Identity", "Assign",
                                                              "AssignVariableOp"))
    return dict(sorted(names.items())) or None


class _SessionView(surgery.session_base()):
    """The runner's session as `tf.compat.v1.train.Saver` sees it (see Runner.session)."""

    def __init__(self, session, graph: tf.Graph, restore, tiled: Sequence[str]):
        # The rewritten graph's session; `restore(path, variables)` is Runner.restore;
        # `tiled`: the variables split over the workers (a Saver cannot save them).
        self._session, self._graph, self._restore, self._tiled = (
            session, graph, restore, sorted(tiled))

    graph = property(lambda self: self._graph)
    sess_str = property(lambda self: self._session.sess_str)

    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        name = getattr(fetches, "name", fetches)
        if isinstance(name, str) and _RESTORE_OP.search(name.split(":")[0]) and feed_dict:
            path = next(iter(feed_dict.values()))
            path = path.decode() if isinstance(path, bytes) else str(path)
            self._restore(path, saver_restores(self._graph, name))
            return None
        if (isinstance(name, str) and _SAVE_OP.search(name.split(":")[0])
                and self._tiled):
            raise TfparError(
                f"a tf.compat.v1.train.Saver cannot save this job's split variables "
                f"{self._tiled} (route 'sharded', Config.tiling): each worker holds "
                "only its rows or tiles. Use runner.save(path) on every worker: it writes "
                "the single-device checkpoint, each variable whole (nothing was written)")
        try:
            return self._session.run(fetches, feed_dict, options, run_metadata)
        except (KeyError, ValueError, TypeError) as e:
            if "save" in str(e):
                raise TfparError(
                    f"{e}: a tf.compat.v1.train.Saver used through runner.session must be built "
                    "in the graph before tfpar.get_runner; or use runner.save(path) and "
                    "runner.restore(path)") from None
            raise

    def partial_run_setup(self, *args, **kwargs):
        return self._session.partial_run_setup(*args, **kwargs)

    def partial_run(self, *args, **kwargs):
        return self._session.partial_run(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._session, name)


class _UserSession(surgery.session_base()):
    """What hooks, `init_fn` and the default session see: a session on the user's graph
    whose runs go through the runner (a Saver's save and restore through tfpar's
    checkpoint: the single-device model, PS parts put together)."""

    def __init__(self, runner, graph):
        self._runner, self._graph = runner, graph

    graph = property(lambda self: self._graph)
    sess_str = property(lambda self: "")

    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        return self._runner.run(fetches, feed_dict, options, run_metadata)

    def as_default(self):
        return surgery.default_session(self)

    def make_callable(self, fetches, feed_list=None, accept_options=False):
        return self._runner.make_callable(fetches, feed_list, accept_options)

    def list_devices(self):
        return self._runner.list_devices()

    def partial_run_setup(self, *args, **kwargs):
        raise TfparError("partial_run is not supported through tfpar")

    def partial_run(self, *args, **kwargs):
        raise TfparError("partial_run is not supported through tfpar")

    def close(self):
        pass
