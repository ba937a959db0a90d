"""`tfpar.MonitoredTrainingSession`: TF1's training loop (hooks, checkpoints, summaries, a
step-rate log) around a tfpar Runner, so that a script changes one line.

It follows `tf.compat.v1.train.MonitoredTrainingSession`'s order: the hooks' `begin()` on
the user's graph (before the rewrite, so the ops they add are rewritten too), the rewrite,
restore from `checkpoint_dir` or initialise and broadcast, `after_create_session`, then
each `run` between `before_run` and `after_run`, and `end()` on close. What differs, and
why: every worker agrees after each `run` whether to stop (a stop one worker's hook
requests stops all, at the same step, so none waits in a collective for a worker that
left) and whether to save; checkpoints are tfpar's single-device ones, written by every
worker's call (a job with split variables gathers them) into `checkpoint_dir`.
"""
from __future__ import annotations

import logging
import os
import time
from typing import List, Optional

import numpy as np
import tensorflow as tf

from tfpar.errors import TfparError
from tfpar.graph.inputs import takes_input
from tfpar.plan.config import Config
from tfpar.runtime import job
from tfpar.runtime.checkpoint import checkpoint_folder
from tfpar.runtime.runner import get_runner

log = logging.getLogger("tfpar")
train = tf.compat.v1.train

USE_DEFAULT = object()
CHECKPOINT_BASENAME = "model.ckpt"  # TF's own, so tf.train.latest_checkpoint finds it


def MonitoredTrainingSession(checkpoint_dir: Optional[str] = None, hooks=None,  # noqa: N802
                             chief_only_hooks=None, scaffold=None,
                             save_checkpoint_secs=USE_DEFAULT, save_summaries_steps=USE_DEFAULT,
                             save_summaries_secs=USE_DEFAULT, config=None,
                             stop_grace_period_secs: float = 120,
                             log_step_count_steps: int = 100,
                             save_checkpoint_steps=USE_DEFAULT, summary_dir: Optional[str] = None,
                             max_to_keep: int = 5, resources=None, tfpar_config=None,
                             graph: Optional[tf.Graph] = None) -> "MonitoredSession":
    """`tf.compat.v1.train.MonitoredTrainingSession` over tfpar, on the default graph.

    The arguments mean what they mean in TensorFlow; the defaults are TensorFlow's (a
    checkpoint every 600 s when neither steps nor seconds are given, summaries every 100
    steps). `config` is the session's `ConfigProto`; `resources` and `tfpar_config` (a
    `tfpar.Config`) are `tfpar.get_runner`'s. Every worker must create it and call `run`
    the same number of times (as a Horovod script does). The graph's queue runners
    (`tf.compat.v1.train.batch` and the other queue inputs) start as TF starts them, under
    a `Coordinator` the hooks get, and stop on close within `stop_grace_period_secs`.
    Horovod's `BroadcastGlobalVariablesHook` is dropped with a note: tfpar broadcasts
    itself.
    """
    graph = graph or tf.compat.v1.get_default_graph()
    if save_checkpoint_steps is USE_DEFAULT and save_checkpoint_secs is USE_DEFAULT:
        save_checkpoint_steps, save_checkpoint_secs = None, 600
    save_checkpoint_steps = None if save_checkpoint_steps is USE_DEFAULT else save_checkpoint_steps
    save_checkpoint_secs = None if save_checkpoint_secs is USE_DEFAULT else save_checkpoint_secs
    if save_summaries_steps is USE_DEFAULT and save_summaries_secs is USE_DEFAULT:
        save_summaries_steps, save_summaries_secs = 100, None
    save_summaries_steps = None if save_summaries_steps is USE_DEFAULT else save_summaries_steps
    save_summaries_secs = None if save_summaries_secs is USE_DEFAULT else save_summaries_secs
    if isinstance(config, Config) or not isinstance(tfpar_config, (Config, type(None))):
        raise TfparError(
            "MonitoredTrainingSession's config is the session's tf.compat.v1.ConfigProto, as "
            "in TensorFlow; give the tfpar.Config as tfpar_config=tfpar.Config(...)")
    tfpar_config = tfpar_config or Config()
    if config is not None:
        import dataclasses
        tfpar_config = dataclasses.replace(tfpar_config, session_config=config)
    if checkpoint_dir:
        checkpoint_folder(checkpoint_dir)  # a bad path fails now, not at the first save
    summary_dir = summary_dir or checkpoint_dir

    is_chief = job.horovod().rank() == 0
    all_hooks = _without_horovod_hooks(list(hooks or []) +
                                       (list(chief_only_hooks or []) if is_chief else []))
    scaffold = _built_scaffold(graph, scaffold)
    summaries = None
    if is_chief:  # TF's defaults: the step rate and the summaries, on the chief
        if log_step_count_steps and log_step_count_steps > 0:
            all_hooks.append(train.StepCounterHook(output_dir=summary_dir,
                                                   every_n_steps=log_step_count_steps))
        if summary_dir and (save_summaries_steps or save_summaries_secs):
            summaries = AgreedSummarySaverHook(scaffold.summary_op, summary_dir,
                                               save_summaries_steps, save_summaries_secs)
    elif scaffold.summary_op is not None:  # runs the summaries the chief writes, if it must
        summaries = AgreedSummarySaverHook(scaffold.summary_op)
    if summaries is not None:
        all_hooks.append(summaries)
    with graph.as_default():
        for hook in all_hooks:
            hook.begin()
        step = train.get_global_step(graph)
        if checkpoint_dir and step is None:
            raise TfparError("MonitoredTrainingSession(checkpoint_dir=...) needs a global "
                             "step: create it with tf.compat.v1.train.get_or_create_global_step() "
                             "before building the training op")
    runner = get_runner(graph, resources, tfpar_config)
    # Horovod scripts pass checkpoint_dir on rank 0 only; every worker takes part in
    # tfpar's restores and saves, so all take the chief's. And whether the chief writes
    # summaries: it does at the first run, as TF's hook does.
    chiefs = job.allgather_strings(
        f"{int(summaries is not None and summaries.writes)}{checkpoint_dir or ''}")[0]
    checkpoint_dir = chiefs[1:] or None
    if summaries is not None:
        summaries.follow(runner, first=chiefs[0] == "1")
    graph.finalize()  # as TF does: a hook that adds ops after begin() fails loudly
    return MonitoredSession(runner, graph, all_hooks, scaffold, checkpoint_dir,
                            save_checkpoint_steps, save_checkpoint_secs, max_to_keep,
                            summaries, stop_grace_period_secs)


def _without_horovod_hooks(hooks: List) -> List:
    kept = []
    for h in hooks:
        if type(h).__name__ == "BroadcastGlobalVariablesHook" and \
                type(h).__module__.startswith("horovod"):
            log.warning("tfpar: Horovod's BroadcastGlobalVariablesHook is not needed (tfpar "
                        "broadcasts worker 0's variables itself); it is left out")
            continue
        kept.append(h)
    return kept


def _built_scaffold(graph: tf.Graph, scaffold):
    """A Scaffold whose summary op and saver exist in the user's graph before the rewrite
    (TF's hooks build them lazily, which would be after it)."""
    scaffold = scaffold or train.Scaffold()
    for field in ("init_op", "init_feed_dict", "ready_op", "ready_for_local_init_op",
                  "local_init_op", "local_init_feed_dict"):
        if getattr(scaffold, "_" + field, None) is not None:
            raise TfparError(f"tfpar.MonitoredTrainingSession: Scaffold({field}=...) is not "
                             "supported (tfpar initialises and broadcasts the variables "
                             "itself); use Scaffold(init_fn=...) to set values after that")
    with graph.as_default():
        summary_op = scaffold.summary_op or tf.compat.v1.summary.merge_all()
        saver = scaffold.saver or train.Saver(allow_empty=True)
        if not graph.get_collection(tf.compat.v1.GraphKeys.SAVERS):
            graph.add_to_collection(tf.compat.v1.GraphKeys.SAVERS, saver)
    # A Scaffold's `init_fn` is the user's function bound to it: it takes the session.
    user_init = scaffold.init_fn
    return train.Scaffold(init_fn=(lambda _, session: user_init(session)) if user_init else None,
                          summary_op=summary_op, saver=saver, copy_from_scaffold=None)


class AgreedSummarySaverHook(train.SessionRunHook):
    """TF's `SummarySaverHook` (the same summaries at the same steps, a `SessionLog` START
    first, the user's graph for TensorBoard), with the runs that fetch the summaries
    agreed by every worker.

    A summary may read a variable split over the workers (a histogram of a sharded
    embedding or of a tiled layer): a collective, which the chief alone would wait in for
    ever. So the chief decides after each run whether the next one writes summaries
    (`wants_next`: TF's timer, read at the end of a run rather than the start of the
    next), every worker learns it in the session's agreement after the run, and the
    other workers fetch the summaries in the same runs when they take part in a
    collective, or take a batch from the input (a summary of the loss: each worker's
    input must move on as one device's does), and discard them. Without an output folder
    it only follows."""

    def __init__(self, summary_op, output_dir: Optional[str] = None,
                 save_steps: Optional[int] = None, save_secs: Optional[float] = None):
        self._op = summary_op
        self._output_dir = output_dir
        self._timer = train.SecondOrStepTimer(every_secs=save_secs, every_steps=save_steps) \
            if output_dir is not None else None
        self._writer = None
        self._step = None
        self._next_step = None  # the global step the next run reaches (None: no run yet)
        self._fetch = output_dir is not None  # the chief writes; the others see `follow`
        self.agreed = False  # whether the next run fetches the summaries (every worker)
        self._requested = False

    writes = property(lambda self: self._output_dir is not None)

    def follow(self, runner, first: bool):
        """After the rewrite: whether the others must run the summaries with the chief, and
        whether the first run does (the chief writes summaries)."""
        self._fetch = (self.writes or runner.waits_for_every_worker(self._op)
                       or (self._op is not None and takes_input([self._op])))
        self.agreed = first

    def wants_next(self) -> bool:
        """The chief's decision for the next run, as TF's hook takes it."""
        return self.writes and (self._next_step is None
                                or self._timer.should_trigger_for_step(self._next_step))

    def begin(self):
        if self.writes:
            self._writer = tf.compat.v1.summary.FileWriterCache.get(self._output_dir)
            self._step = train.get_global_step()
            if self._step is None:
                raise RuntimeError("Global step should be created to use SummarySaverHook.")
            self._step = tf.identity(self._step, name="tfpar_summary_step")
        self._next_step = None

    def before_run(self, run_context):
        self._requested = self.agreed
        fetches = {"global_step": self._step} if self.writes else {}
        if self._requested and self._fetch and self._op is not None:
            fetches["summary"] = self._op
        return train.SessionRunArgs(fetches) if fetches else None

    def after_run(self, run_context, run_values):
        if not self.writes:
            return
        results = run_values.results
        step = results["global_step"] + 1
        if self._next_step is None or self._requested:
            step = run_context.session.run(self._step)
        if self._next_step is None:
            self._writer.add_session_log(
                tf.compat.v1.SessionLog(status=tf.compat.v1.SessionLog.START), step)
        if self._requested:
            self._timer.update_last_triggered_step(step)
            if "summary" in results:
                self._writer.add_summary(results["summary"], step)
        self._next_step = step + 1

    def end(self, session=None):
        if self._writer is not None:
            self._writer.flush()


class _Agreement:
    """One Horovod allgather per run of small flags (stop, save, failed, the chief's
    summaries at the next run), so that every worker takes the same decision at the same
    step. Built once: a step pays one small collective, not a new graph."""

    STOP, SAVE, FAILED, SUMMARIES = 0, 1, 2, 3

    def __init__(self):
        hvd = job.horovod()
        self.size = hvd.size()
        if self.size == 1:
            return
        self._graph = tf.Graph()
        with self._graph.as_default():
            self._flags = tf.compat.v1.placeholder(tf.int32, [1, 4])
            self._gathered = hvd.allgather(self._flags, name="tfpar_monitored_flags")
        self._session = tf.compat.v1.Session(
            graph=self._graph, config=tf.compat.v1.ConfigProto(device_count={"GPU": 0}))

    def __call__(self, stop: bool, save: bool, failed: bool, summaries: bool) -> np.ndarray:
        """The flags of every worker, [workers, 4]."""
        mine = np.array([[stop, save, failed, summaries]], np.int32)
        if self.size == 1:
            return mine
        return self._session.run(self._gathered, {self._flags: mine})

    def close(self):
        if self.size > 1:
            self._session.close()


class MonitoredSession:
    """The session `tfpar.MonitoredTrainingSession` returns (TF's MonitoredSession API)."""

    def __init__(self, runner, graph, hooks, scaffold, checkpoint_dir, save_steps, save_secs,
                 max_to_keep, summaries: Optional[AgreedSummarySaverHook] = None,
                 stop_grace_period_secs: float = 120):
        self._runner, self._graph, self._hooks = runner, graph, hooks
        self._grace = stop_grace_period_secs
        self._coord = train.Coordinator(clean_stop_exception_types=[])
        self._threads = []
        self._summaries = summaries
        self._user_session = runner.user_session
        self._checkpoint_dir, self._save_steps, self._save_secs = (
            checkpoint_dir, save_steps, save_secs)
        self._max_to_keep = max_to_keep
        self._agreement = _Agreement()
        self._stop = False
        self._closed = False
        step = train.get_global_step(graph)
        self._step_tensor = step  # a variable: the runner reads its value
        self.resumed_from = None  # the checkpoint restored at the start, if any
        self.resumed_at = None  # and its global step
        with graph.as_default():
            if checkpoint_dir and tf.train.latest_checkpoint(checkpoint_dir):
                self.resumed_from = runner.restore(checkpoint_dir)
                self.resumed_at = self._global_step()
                log.info("tfpar: resumed from %s at step %d", self.resumed_from,
                         self.resumed_at)
            elif scaffold.init_fn is not None:
                scaffold.init_fn(self._user_session)
            self._last_save = (self._global_step(), time.time())
            if checkpoint_dir and runner.is_chief:  # the user's graph, as TF writes it
                tf.io.write_graph(graph.as_graph_def(add_shapes=True), checkpoint_dir,
                                  "graph.pbtxt")
            if checkpoint_dir and self.resumed_from is None:
                self._save()  # as TF's CheckpointSaverHook does at the start
            if graph.get_collection(tf.compat.v1.GraphKeys.QUEUE_RUNNERS):
                # TF's queue inputs (tf.compat.v1.train.batch, string_input_producer...):
                # their threads enqueue through the runner, as TF's session starts them.
                self._threads = train.start_queue_runners(sess=self._user_session,
                                                          coord=self._coord)
            for hook in self._hooks:
                hook.after_create_session(self._user_session, self._coord)

    runner = property(lambda self: self._runner, doc="The tfpar Runner underneath.")
    graph = property(lambda self: self._graph)
    is_chief = property(lambda self: self._runner.is_chief)

    def should_stop(self) -> bool:
        """True once any worker's hook requested a stop (agreed at the same run on all)."""
        return self._stop or self._closed

    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        """Runs the user's fetches with every hook's `before_run`/`after_run` around them."""
        if self.should_stop():
            raise RuntimeError("Run called even after should_stop requested.")
        context = train.SessionRunContext(train.SessionRunArgs(fetches, feed_dict),
                                          self._user_session)
        with self._graph.as_default():
            requests = [h.before_run(context) for h in self._hooks]
            all_fetches, all_feeds, all_options = self._merged(
                fetches, feed_dict, options, requests)
            metadata = run_metadata or (tf.compat.v1.RunMetadata() if all_options else None)
            try:
                # A failed step raises here at once: the job's liveness tells the others.
                outputs = self._runner.run(all_fetches, all_feeds, all_options, metadata)
            except tf.errors.OutOfRangeError:
                # The input ended: on every worker at the same step when the slices are even.
                self._stop = True
                raise
            except Exception:
                self._coord.raise_requested_exception()  # a queue runner's error, if any
                raise
            failure = None
            try:
                for i, hook in enumerate(self._hooks):
                    hook.after_run(context, train.SessionRunValues(
                        results=outputs["hooks"].get(i), options=all_options,
                        run_metadata=metadata))
            except Exception as e:  # noqa: BLE001 (told to the other workers, then raised)
                failure = e
        self._agree(context.stop_requested or self._coord.should_stop(), failure)
        if failure is not None:
            raise failure
        return outputs["caller"]

    def _merged(self, fetches, feed_dict, options, requests):
        feeds = dict(feed_dict or {})
        hook_fetches = {}
        merged = tf.compat.v1.RunOptions()
        merged_any = options is not None
        if options is not None:
            merged.MergeFrom(options)
        for i, request in enumerate(requests):
            if request is None:
                continue
            if request.fetches is not None:
                hook_fetches[i] = request.fetches
            for k, v in (request.feed_dict or {}).items():
                if k in feeds:
                    raise RuntimeError(f"Same tensor is fed by two hooks: {k}")
                feeds[k] = v
            if request.options is not None:
                merged_any = True
                merged.trace_level = max(merged.trace_level, request.options.trace_level)
                merged.timeout_in_ms = max(merged.timeout_in_ms, request.options.timeout_in_ms)
                merged.debug_options.debug_tensor_watch_opts.extend(
                    request.options.debug_options.debug_tensor_watch_opts)
        return ({"caller": fetches, "hooks": hook_fetches}, feeds or None,
                merged if merged_any else None)

    def _agree(self, stop_requested: bool, failure: Optional[BaseException]):
        want_save = self._runner.is_chief and self._save_due()
        summaries = self._summaries is not None and self._summaries.wants_next()
        flags = self._agreement(bool(stop_requested), want_save, failure is not None,
                                summaries)
        failed = [r for r in range(len(flags)) if flags[r, _Agreement.FAILED]]
        if failed and failure is None:
            texts = job.allgather_strings("")
            raise TfparError(f"worker(s) {failed} stopped the job with an error in a step or "
                             f"a hook: {texts[failed[0]] or '(see its log)'}")
        if failed:
            job.allgather_strings(f"{type(failure).__name__}: {failure}")
            return
        if self._summaries is not None:
            self._summaries.agreed = bool(flags[0, _Agreement.SUMMARIES])
        if flags[:, _Agreement.STOP].any():
            self._stop = True
        if flags[0, _Agreement.SAVE]:
            self._save()

    def _global_step(self) -> int:
        if self._step_tensor is None:
            return 0
        return int(self._runner.run(self._step_tensor))

    def _save_due(self) -> bool:
        if not self._checkpoint_dir:
            return False
        step, at = self._last_save
        if self._save_steps and self._global_step() >= step + self._save_steps:
            return True
        return bool(self._save_secs) and time.time() >= at + self._save_secs

    def _save(self, background: bool = True):
        """Every worker calls it (split variables are gathered); the chief copies the
        variables now and writes them in the background (the last save waits)."""
        step = self._global_step()
        prefix = self._runner.save(os.path.join(self._checkpoint_dir, CHECKPOINT_BASENAME),
                                   global_step=step, max_to_keep=self._max_to_keep,
                                   background=background)
        self._last_save = (step, time.time())
        if prefix:
            log.info("tfpar: saved %s", prefix)

    def close(self):
        """Calls every hook's `end()`, saves a last checkpoint, closes the runner."""
        self._close(run_end=True)

    def _close(self, run_end: bool):
        if self._closed:
            return
        try:
            if run_end:
                with self._graph.as_default():
                    for hook in self._hooks:
                        hook.end(self._user_session)
                if self._checkpoint_dir and self._global_step() > self._last_save[0]:
                    self._save(background=False)
        finally:
            self._closed = True
            self._coord.request_stop()
            try:
                self._coord.join(self._threads, stop_grace_period_secs=self._grace,
                                 ignore_live_threads=True)
            finally:
                self._agreement.close()
                self._runner.close()

    def __enter__(self):
        return self

    def __exit__(self, exception_type, exception, traceback):
        # As TF's: the input's end and StopIteration end training cleanly.
        clean = exception_type in (None, tf.errors.OutOfRangeError, StopIteration)
        self._close(run_end=clean)
        return exception_type in (tf.errors.OutOfRangeError, StopIteration)
