"""Stage markers: counters a training step bumps as it passes each of its stages, so a
probe (a second, concurrent session run) can tell where a step that does not finish waits.

The liveness links carry what the probe finds to the hub, which names it when the first
step or a step deadline runs out (see tfpar.runtime.liveness). A marker only counts: it waits for
its stage's ops and the step's end waits for it, so nothing runs that did not run before.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import tensorflow as tf

# name -> what a step that has not passed that stage waits for, in the order steps pass them
STAGES = {
    "read": "a read from the parameter servers (this step's PS reads have not all returned)",
    "joined": "a collective with the other workers (this step's Horovod allreduce, "
              "allgather or all-to-all has not completed: a worker that has not joined it, "
              "or compute before it)",
    "pushed": "a push of its gradients to the parameter servers",
    "applied": "the chief's update on the parameter servers (it takes every worker's push "
               "of this step)",
    "token": "its token from the chief (the end of the chief's update of this step)",
}
SCOPE = "tfpar/stage/"


class Markers:
    """The markers of one rewritten graph (worker-local counters, one per stage)."""

    def __init__(self, graph: tf.Graph, device: str):
        self.graph, self.device = graph, device
        # stage -> its counters' values (one per rewrite that marks it: the PS step's
        # collectives and the allreduce route's are counted apart, so neither waits for
        # the other's ops)
        self.reads: Dict[str, List[tf.Tensor]] = {}
        # stage -> the update group (Plan.update_groups) of each of its counters: a run
        # of one group passes only that group's markers
        self.groups: Dict[str, List[int]] = {}

    def mark(self, stage: str, after: Sequence, group: int = 0) -> tf.Operation:
        """An op that counts `stage` once every op or tensor of `after` has run; the step's
        end must wait for it (the caller adds it to the step)."""
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}")
        deps = [x.op if isinstance(x, tf.Tensor) else x for x in after]
        with self.graph.as_default(), tf.device(self.device), \
                tf.compat.v1.name_scope(SCOPE), tf.control_dependencies(None):
            counter = tf.compat.v1.get_local_variable(
                f"{SCOPE}{stage}_{len(self.reads.get(stage, []))}", shape=[], dtype=tf.int64,
                use_resource=True, initializer=tf.compat.v1.zeros_initializer())
            self.reads.setdefault(stage, []).append(counter.read_value())
            self.groups.setdefault(stage, []).append(group)
            with tf.control_dependencies(deps):
                return counter.assign_add(1, read_value=False)

    def attach(self, stage: str, after: Sequence, end_ops: List[tf.Operation],
               group: int = 0):
        """Marks `stage` after `after` and makes each op of `end_ops` wait for the mark."""
        from tfpar.transform import surgery
        if not after:
            return
        marked = self.mark(stage, after, group)
        for op in end_ops:
            surgery.add_control_inputs(op, [marked])


def describe(counts: Dict[str, Sequence[int]], steps_done) -> str:
    """Where step `steps_done + 1` waits, from the markers' counts: the first stage it has
    not passed (one of its counters not past `steps_done`), in STAGES' order.
    `steps_done` may also be {stage: [steps done for each counter]} (each counter's update
    group's steps; None for a counter this step does not pass)."""
    for stage in STAGES:
        done = (steps_done.get(stage, ()) if isinstance(steps_done, dict)
                else [steps_done] * len(counts.get(stage, ())))
        if any(d is not None and c <= d for c, d in zip(counts.get(stage, ()), done)):
            return STAGES[stage]
    return "the end of its training step (every marked stage passed: its own update)"
