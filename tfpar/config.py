"""User-facing configuration of a tfpar job."""
from __future__ import annotations

import dataclasses
from typing import Optional

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
    """

    run_mode: str = "HYBRID"
    average_dense: bool = True
    average_sparse: bool = True
    session_config: Optional[object] = None
    gradient_scope: str = r"(^|/)gradients(_\d+)?/"

    def __post_init__(self):
        mode = str(self.run_mode).upper() if isinstance(self.run_mode, str) else self.run_mode
        if mode not in RUN_MODES:
            raise TfparError(
                f"unknown run_mode {self.run_mode!r}: use one of {', '.join(RUN_MODES)} "
                "(tfpar.Config(run_mode='HYBRID'))")
        self.run_mode = mode
        for name in ("average_dense", "average_sparse"):
            if not isinstance(getattr(self, name), bool):
                raise TfparError(f"Config.{name} must be True or False, got {getattr(self, name)!r}")
