"""User-facing configuration of a tfpar job."""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Tuple, Union

from tfpar.errors import TfparError
from tfpar.plan.routing import FIXED_SPARSE_ROUTES

RUN_MODES = ("HYBRID", "AR", "PS")


@dataclasses.dataclass
class Config:
    """How tfpar parallelises a graph.

    Args:
      run_mode: "HYBRID" (dense -> allreduce, sparse -> parameter servers; the default),
        "AR" (everything through Horovod: dense allreduce, sparse allgather) or "PS".
      average_dense: average dense gradients over workers (True) or sum them (False).
        Average matches single-device training on the concatenated batch when the loss is
        a mean over the batch; sum matches it when the loss is a sum.
      average_sparse: the same choice for sparse (IndexedSlices) gradients.
      session_config: a `tf.compat.v1.ConfigProto` for the worker sessions.
      gradient_scope: regular expression matching the name scopes that `tf.gradients`
        created (default: `gradients`, `gradients_1`, ... at any depth).
      partitions: how many parts each sparse variable on the parameter servers is split
        into: an int for all, or {variable name: int}. Default: the number of PS tasks
        (one per host). Pieces of a variable the user already partitioned (a
        `partitioner=` of a variable scope) are kept as they are.
      ps_rows: which part on the parameter servers holds which rows: "modulo" (row i in
        part i % P, TensorFlow's `partition_strategy="mod"`: a vocabulary sorted by
        frequency spreads its hot rows over every host's server), "ranges" (part k a k-th
        of the rows in one range, as `fixed_size_partitioner` cuts them), or "auto" (the
        default: where the job measures the ids (sparse_route "auto"), the one whose
        busiest host serves fewer rows a step, else "modulo"). The plan shows the parts:
        `0::2@0 1::2@1` (modulo), `0:50@0 50:100@1` (ranges).
      local_aggregation: in HYBRID and PS modes, sum the gradients of the workers of a host
        on that host's PS first, so each PS part receives one push per host per step; for
        route "sharded", de-duplicate a host's lookups and sum its row gradients by id on
        one of its workers before they cross to the rows' owners (three more all-to-alls,
        within the host).
        True (default, as Parallax), False, or "auto": measured in the job (the rows a
        host's workers push in common over `density_steps` steps, and the links as for
        sparse_route="auto"); on when the bytes it keeps off a host's link take longer
        than the exchanges it adds (large batches, slow links), off otherwise (small
        batches, where the extra exchanges cost more than the bytes); with
        sparse_route="auto", decided with the routes (each priced with and without it).
        The plan says why.
      search_partitions: for variables made inside a `tfpar.partitioner`: "auto" (use the
        count remembered for this graph and layout, else search), "force" (search again),
        or "off" (use the partitioner's minimum, or 1).
      sparse_route: in HYBRID mode, where sparse variables go: "ps" (the parameter
        servers, as Parallax; the default), "allreduce" (their gradients summed densely
        with one Horovod allreduce, the variable kept on every worker), "allgather"
        (every worker's rows gathered by Horovod, as AR mode and Horovod do, each id's
        rows summed on its worker first where the post-processing allows it; the
        variable kept on every worker), "sharded" (the rows, and their optimizer slots, split over
        the workers: each worker holds and updates its own rows, and a step exchanges ids,
        rows and row gradients by Horovod all-to-all, as TorchRec and HugeCTR's SOK do; no
        parameter server, no TensorFlow server), "auto" (density routing: each variable's alpha, the
        fraction of its rows a step touches, and the rows its gradients carry are
        measured in the first `density_steps` steps of a scratch copy of the input, the
        links by a short allreduce probe, and the cost model picks the fastest route), or
        {variable name: "ps" | "allreduce" | "allgather" | "sharded"} (those forced, the others routed
        as "auto").
        The plan says what was measured and why each route was taken.
      density_steps: steps per worker that "auto" measures alpha over.
      sharded_rows: which worker owns which rows of a variable on route "sharded":
        "modulo" (row i on worker i % N, as HugeCTR's SOK: a vocabulary sorted by
        frequency spreads its hot rows over every worker), "ranges" (worker k a k-th of
        the rows in one range, as TorchRec's row-wise sharding), or "auto" (the default:
        where the job measures the ids (sparse_route "auto"), the one whose busiest
        worker serves fewer rows a step, else "modulo"). The plan shows the tiling:
        `M4` (modulo), `R4` (ranges).
      sync: True (default): synchronous training, equal to single-device training on the
        concatenated batch. False: asynchronous training of the variables on the parameter
        servers (PS mode; in HYBRID the sparse ones): each worker applies its own batch's
        gradient with the user's optimizer as soon as it has it, on whatever values the
        servers hold then; no worker waits for another, no chief is a barrier. Reads may
        be stale by the updates other workers made meanwhile (as TensorFlow's classic
        asynchronous parameter servers and Parallax's asynchronous mode); gradients are
        not averaged over workers (each update is one worker's), the global step and
        optimizer state shared by all variables (Adam's beta powers) count this worker's
        steps, and allreduce routes (HYBRID's dense variables) stay
        synchronous. Results are not bit-equal to single-device training.
      tiling: model parallelism for wide dense layers: None (off, the default: a split
        weight cannot be saved by the user's own Saver on the chief alone) or
        {variable name: tiling}, e.g. {"dense/kernel": "C", "dense/bias": "r"} (tilings as
        `tfpar plan --tiling` prints them: R rows, C columns, r replicated, one letter
        per cut). Each listed weight (the W of one `x @ W`) is split over the workers and
        its layer runs on tiles with exact-adjoint collectives (`tfpar.transform.tiled`);
        its optimizer slots are split with it, and a listed bias joins its layer. Also:
        "auto" (the tiling planner plans the graph for the job's devices; every dense
        weight of at least `tiling_min_bytes` whose planned split moves fewer bytes per
        step than its allreduce is split so), or the plan `tfpar plan --tiling --json`
        printed (a `tfpar.Plan`, or the path of its JSON file; edit it freely), whose
        "tiled" variables are split as it says. The runtime plan shows each split
        weight's tiling, the tile each worker holds and the bytes its layer moves.
      tiling_min_bytes: the smallest weight "auto" splits (default 1 MiB).
      search_routes: with sparse_route "auto" (or a dict that leaves variables to it),
        time the routes in the job instead of trusting the cost model alone: the model's
        choice, then every measured variable on one route (each with local aggregation on
        and off when it is "auto"), the most promising `search_trials` of them, each run
        for `search_steps` training steps in a trial runner of its own; the fastest
        measured is kept and the plan lists every trial. Start-up takes longer (a graph
        copy and session per trial), and a trial on the parameter servers starts them.
        The trials are remembered in `search_cache` for this graph, layout and settings
        and reused by the next job; "force" times them again (new links, new machines).
      sum_duplicate_rows: route "allgather" (and AR mode's sparse variables): each worker
        sums its rows of a sparse gradient by id before the allgather, so each id's row is
        sent once (exact where the post-processing is linear in the rows; else the rows go
        as they are). It saves bytes but changes the allgather's size every step, and
        Horovod then negotiates it anew (about one exchange's latency): True, False, or
        "auto" (default: where density routing measured the rows and the links and the
        bytes saved take longer than one exchange; off when nothing was measured).
      allreduce_by_allgather: when route "allgather" runs (AR mode's sparse variables),
        the step's allreduced gradients (the dense ones, route "allreduce"'s tables) travel
        in its one allgather too, each worker summing everyone's in rank order: one
        collective a step instead of two, for (N-2)/N more bytes than the allreduce's ring
        (none on 2 workers). True, False, or "auto" (default: where density routing measured
        the links and the bytes added take less time than the collective saved; off when
        nothing was measured, as in AR mode: a large dense model would also lose the
        allreduce's overlap with the backward pass). Where no allgather runs but route
        "sharded" does (without local aggregation, and no global norm over every
        gradient), the dense gradients travel in its gradients' all-to-all instead, each
        worker's sent whole to every worker (`Plan.allreduce_by_alltoall`).
      ids_ahead: route "sharded": read the input pipeline a step ahead and send the next
        batch's ids to their owners during this step (TorchRec's pipelined input
        distribution), so a step waits for two rounds of all-to-alls (rows back,
        gradients out) instead of three. Every batch still passes through the input once
        and in order (the same batches, the same random draws as a plain session); the
        last batch trains without a next one. Needs the lookups' ids from the input
        pipeline (tf.data, not a feed), every sparse variable on route "sharded" and local
        aggregation off; otherwise the plan says why it is off. Checkpoints keep the
        batch read ahead with the input positions, so a resumed job neither skips nor
        replays it.
      search_trials, search_seconds: caps on the trials of one search and on its time.
      search_steps: (untimed, timed) training steps per trial.
      search_feed: for graphs fed by placeholders: step number -> feed_dict for the trials
        (and for the density measurement of sparse_route="auto").
      search_cache: folder of remembered partition searches and route trials (default
        ~/.cache/tfpar/partitions).
      liveness_timeout: seconds without a heartbeat after which a worker or parameter
        server that stopped responding (not dead: stopped, swapping, cut off) is named
        and the job stops (a dead process is noticed at once). Also how long every rank
        waits for the others to call `get_runner`, and for a worker whose input ended
        while another waits in a training step.
      step_deadline: seconds after which a training step that has not finished stops the
        job, naming the workers it waits for (None: no deadline).
      first_step_deadline: seconds a worker may spend in one start-up stage (starting the
        parameter servers, initialising, the broadcast) or in its first training step;
        past it the job stops, naming where every worker waits (a PS read, a collective,
        a push, the chief's update, its token). Default 120; None: no bound. A first
        step that legitimately takes longer (a huge graph on a slow host) needs more.
      interface: the network interface whose address tfpar's sockets bind and its servers
        are dialled at (e.g. "eth0"); default: the one Horovod's Gloo uses
        (`horovodrun --network-interface`), else the host name's address.
      checkpoint_dir: resume without code: `get_runner` restores the latest checkpoint of
        this folder (made if missing) on every worker before the first step, and the
        runner saves the single-device checkpoint `model.ckpt-<global step>` there every
        `checkpoint_every_steps` training steps and/or `checkpoint_every_secs` seconds
        (the chief copies the variables at a step boundary and writes them in the
        background, atomically), keeping the newest `checkpoint_max_to_keep` (default 5).
        `checkpoint_every_secs` is not for split layers (`tiling`): every worker must
        take part in their saves, so save them by steps.
    """

    run_mode: str = "HYBRID"
    average_dense: bool = True
    average_sparse: bool = True
    session_config: Optional[object] = None
    gradient_scope: str = r"(^|/)gradients(_\d+)?/"
    partitions: Optional[Union[int, Dict[str, int]]] = None
    local_aggregation: Union[bool, str] = True
    search_partitions: str = "auto"
    search_routes: Union[bool, str] = False
    ids_ahead: bool = False
    sum_duplicate_rows: Union[bool, str] = "auto"
    allreduce_by_allgather: Union[bool, str] = "auto"
    search_trials: int = 5
    search_seconds: float = 600.0
    search_steps: Tuple[int, int] = (5, 20)
    search_feed: Optional[Callable[[int], dict]] = None
    search_cache: Optional[str] = None
    liveness_timeout: float = 30.0
    step_deadline: Optional[float] = 600.0
    first_step_deadline: Optional[float] = 120.0
    interface: Optional[str] = None
    sparse_route: Union[str, Dict[str, str]] = "ps"
    density_steps: int = 3
    sharded_rows: str = "auto"
    ps_rows: str = "auto"
    sync: bool = True
    tiling: Union[None, str, Dict[str, str], "object"] = None
    tiling_min_bytes: int = 1 << 20
    checkpoint_dir: Optional[str] = None
    checkpoint_every_steps: Optional[int] = None
    checkpoint_every_secs: Optional[float] = None
    checkpoint_max_to_keep: int = 5

    def __post_init__(self):
        if self.tiling is not None and not (isinstance(self.tiling, str)
                                            and self.tiling == "auto"):
            from tfpar.partition.tiling.cuts import Tiling
            self.tiling = _tiles_of(self.tiling)
            cyclic = []
            try:
                for name, t in self.tiling.items():
                    if Tiling.parse(t).cyclic:
                        cyclic.append(name)
            except (KeyError, ValueError, TypeError):
                raise TfparError(f"Config.tiling: {t!r} (for {name!r}) is not a tiling: one "
                                 "letter per cut, R rows, C columns, r replicated, e.g. 'C' "
                                 "or 'rC'") from None
            if cyclic:
                raise TfparError(f"Config.tiling: {cyclic[0]!r} has a tiling with M (rows "
                                 "dealt out in turn), which only a sparse variable on route "
                                 "'sharded' takes (Config.sharded_rows); split a layer by "
                                 "R, C or r")
        if (isinstance(self.tiling_min_bytes, bool) or not isinstance(self.tiling_min_bytes, int)
                or self.tiling_min_bytes < 0):
            raise TfparError("Config.tiling_min_bytes must be a non-negative int (bytes), got "
                             f"{self.tiling_min_bytes!r}")
        mode = str(self.run_mode).upper() if isinstance(self.run_mode, str) else self.run_mode
        if mode not in RUN_MODES:
            raise TfparError(
                f"unknown run_mode {self.run_mode!r}: use one of {', '.join(RUN_MODES)} "
                "(tfpar.Config(run_mode='HYBRID'))")
        self.run_mode = mode
        counts = (self.partitions.values() if isinstance(self.partitions, dict)
                  else [] if self.partitions is None else [self.partitions])
        for c in counts:
            if isinstance(c, bool) or not isinstance(c, int) or c < 1:
                raise TfparError(f"Config.partitions must be a positive int or a dict of "
                                 f"variable name to positive int, got {self.partitions!r}")
        if self.search_partitions not in ("auto", "force", "off"):
            raise TfparError(f"Config.search_partitions must be 'auto', 'force' or 'off', got "
                             f"{self.search_partitions!r}")
        if (not isinstance(self.search_trials, int) or self.search_trials < 1
                or self.search_seconds <= 0 or len(self.search_steps) != 2
                or min(self.search_steps) < 0 or self.search_steps[1] < 1):
            raise TfparError("Config.search_trials must be >= 1, search_seconds > 0 and "
                             "search_steps (untimed >= 0, timed >= 1) steps")
        if (isinstance(self.liveness_timeout, bool)
                or not isinstance(self.liveness_timeout, (int, float))
                or self.liveness_timeout <= 0):
            raise TfparError(f"Config.liveness_timeout must be a positive number of seconds, "
                             f"got {self.liveness_timeout!r}")
        for name in ("step_deadline", "first_step_deadline"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, (int, float)) or value <= 0):
                raise TfparError(f"Config.{name} must be a positive number of seconds or "
                                 f"None, got {value!r}")
        for name in ("checkpoint_every_steps", "checkpoint_every_secs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(
                    value, (int, float)) or value <= 0 or (name.endswith("steps") and
                                                          not isinstance(value, int))):
                raise TfparError(f"Config.{name} must be a positive "
                                 f"{'int' if name.endswith('steps') else 'number'} or None, "
                                 f"got {value!r}")
        if (self.checkpoint_every_steps or self.checkpoint_every_secs) and \
                not self.checkpoint_dir:
            raise TfparError("Config.checkpoint_every_steps/secs need Config.checkpoint_dir "
                             "(the folder to save in)")
        sharded = "sharded" in (self.sparse_route.values() if isinstance(self.sparse_route, dict)
                                else [self.sparse_route])
        if self.checkpoint_every_secs and (self.tiling is not None or sharded):
            raise TfparError("Config.checkpoint_every_secs cannot save "
                             + ("split layers (tiling)" if self.tiling is not None else
                                "sharded variables (sparse_route 'sharded')")
                             + ": every worker takes part in their saves, and workers "
                             "do not reach a time at the same step; use "
                             "checkpoint_every_steps")
        if self.interface is not None and (not isinstance(self.interface, str)
                                           or not self.interface):
            raise TfparError(f"Config.interface must be a network interface name such as "
                             f"'eth0', got {self.interface!r}")
        routes = (self.sparse_route.values() if isinstance(self.sparse_route, dict)
                  else [self.sparse_route])
        allowed = FIXED_SPARSE_ROUTES + (
            () if isinstance(self.sparse_route, dict) else ("auto",))
        if not routes or any(r not in allowed for r in routes):
            raise TfparError(f"Config.sparse_route must be one of {', '.join(allowed)}"
                             + ("" if isinstance(self.sparse_route, dict) else
                                " or a dict of variable name to 'ps', 'allreduce', "
                                "'allgather' or 'sharded'")
                             + f", got {self.sparse_route!r}")
        if not isinstance(self.search_routes, bool) and self.search_routes != "force":
            raise TfparError(f"Config.search_routes must be True, False or 'force', got "
                             f"{self.search_routes!r}")
        if self.search_routes and (self.run_mode != "HYBRID" or (
                not isinstance(self.sparse_route, dict) and self.sparse_route != "auto")):
            raise TfparError("Config.search_routes times the routes that sparse_route='auto' "
                             "chooses between, in HYBRID mode; with "
                             f"run_mode={self.run_mode!r} and sparse_route="
                             f"{self.sparse_route!r} there is nothing to time: set "
                             "sparse_route='auto' or leave search_routes False")
        if self.sparse_route != "ps" and self.run_mode != "HYBRID":
            raise TfparError(f"Config.sparse_route={self.sparse_route!r} chooses between the "
                             "parameter servers and Horovod, which only HYBRID mode mixes; "
                             f"use run_mode='HYBRID' or leave sparse_route as 'ps'")
        if (isinstance(self.density_steps, bool) or not isinstance(self.density_steps, int)
                or self.density_steps < 1):
            raise TfparError(f"Config.density_steps must be a positive int, got "
                             f"{self.density_steps!r}")
        if self.sync is False and self.run_mode == "AR":
            raise TfparError("Config(sync=False) trains the parameter servers' variables "
                             "asynchronously; AR mode has none (Horovod's collectives are "
                             "synchronous): use run_mode='PS' or 'HYBRID'")
        for name in ("sum_duplicate_rows", "allreduce_by_allgather"):
            if getattr(self, name) != "auto" and not isinstance(getattr(self, name), bool):
                raise TfparError(f"Config.{name} must be True, False or 'auto', got "
                                 f"{getattr(self, name)!r}")
        if self.ps_rows not in ("auto", "modulo", "ranges"):
            raise TfparError(f"Config.ps_rows must be 'auto', 'modulo' or 'ranges', got "
                             f"{self.ps_rows!r}")
        if self.sharded_rows not in ("auto", "modulo", "ranges"):
            raise TfparError(f"Config.sharded_rows must be 'auto', 'modulo' or 'ranges', got "
                             f"{self.sharded_rows!r}")
        if not isinstance(self.ids_ahead, bool):
            raise TfparError(f"Config.ids_ahead must be True or False, got {self.ids_ahead!r}")
        if self.local_aggregation != "auto" and not isinstance(self.local_aggregation, bool):
            raise TfparError(f"Config.local_aggregation must be True, False or 'auto', got "
                             f"{self.local_aggregation!r}")
        for name in ("average_dense", "average_sparse", "sync"):
            if not isinstance(getattr(self, name), bool):
                raise TfparError(f"Config.{name} must be True or False, got {getattr(self, name)!r}")


def _tiles_of(spec) -> Dict[str, str]:
    """Config.tiling as {variable name: tiling}: from a dict, a tfpar.Plan, or the path
    of a plan's JSON file (`tfpar plan --tiling --json`)."""
    from tfpar.plan import Plan
    source = spec
    if isinstance(spec, str):
        try:
            with open(spec) as f:
                spec = Plan.from_json(f.read())
        except OSError as e:
            raise TfparError(f"Config.tiling: {source!r} is neither 'auto' nor a readable plan "
                             f"file ({e.strerror}); give 'auto', a dict {{variable: tiling}}, "
                             "or the JSON of `tfpar plan --tiling --json`") from None
        except (ValueError, KeyError, TypeError) as e:
            raise TfparError(f"Config.tiling: {source!r} is not the JSON of a tfpar plan "
                             f"({type(e).__name__}: {e}); write it with "
                             "`tfpar plan --tiling --json`") from None
    if isinstance(spec, Plan):
        spec = {v.name: str(v.tiling) for v in spec.variables
                if v.route == "tiled" and v.slot_of is None}
        if not spec:
            raise TfparError(f"Config.tiling: the plan {source if isinstance(source, str) else ''}"
                             " splits no variable (no route 'tiled'): make it with "
                             "`tfpar plan --tiling --json`")
    if not isinstance(spec, dict) or not spec:
        raise TfparError("Config.tiling must be None, 'auto', a plan, or a non-empty dict "
                         f"{{variable name: tiling such as 'C'}}, got {spec!r}")
    return {name: str(t) for name, t in spec.items()}
