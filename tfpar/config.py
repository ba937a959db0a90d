"""User-facing configuration of a tfpar job."""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Union

from tfpar.errors import TfparError

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
      partitions: how many parts (row ranges) each sparse variable on the parameter servers
        is split into: an int for all, or {variable name: int}. Default: the number of PS
        tasks (one per host). Pieces of a variable the user already partitioned (a
        `partitioner=` of a variable scope) are kept as they are.
      local_aggregation: in HYBRID and PS modes, sum the gradients of the workers of a host
        on that host's PS first, so each PS part receives one push per host per step.
    """

    run_mode: str = "HYBRID"
    average_dense: bool = True
    average_sparse: bool = True
    session_config: Optional[object] = None
    gradient_scope: str = r"(^|/)gradients(_\d+)?/"
    partitions: Optional[Union[int, Dict[str, int]]] = None
    local_aggregation: bool = True

    def __post_init__(self):
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
        for name in ("average_dense", "average_sparse", "local_aggregation"):
            if not isinstance(getattr(self, name), bool):
                raise TfparError(f"Config.{name} must be True or False, got {getattr(self, name)!r}")
