"""The Plan: every decision tfpar makes for a job, as plain data.

Transforms consume a Plan and decide nothing themselves, so what will happen can be printed,
saved, diffed and tested without running a cluster.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Optional, Tuple

from tfpar.analysis import format_table

ROUTES = ("allreduce", "allgather", "replicated")


@dataclasses.dataclass(frozen=True)
class GradientPlan:
    """One raw gradient and the tensors a transform rewires (values, and indices if sparse)."""

    values: str
    indices: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class VariablePlan:
    """Where one variable lives and how its gradient is combined across workers.

    route: "allreduce" (dense gradient, Horovod allreduce), "allgather" (sparse gradient,
    Horovod allgather of values and indices) or "replicated" (no gradient: a copy on every
    worker, set equal at start by a broadcast from worker 0).
    """

    name: str
    shape: Tuple[Optional[int], ...]
    dtype: str
    nbytes: Optional[int]
    role: str
    kind: str
    route: str
    reduction: Optional[str] = None  # "average" | "sum" for trained variables
    gradients: Tuple[GradientPlan, ...] = ()
    partition_of: Optional[str] = None
    predicted_bytes: Optional[float] = None  # per worker per step, sent + received

    def __post_init__(self):
        if self.route not in ROUTES:
            raise ValueError(f"unknown route {self.route!r}")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What tfpar decided for a graph on a layout."""

    run_mode: str  # as the user asked
    mode: str  # what runs: "AR" (a HYBRID graph with no sparse variable runs as AR)
    num_workers: int
    hosts: Tuple[Tuple[str, int], ...]
    variables: Tuple[VariablePlan, ...]
    global_step: Optional[str] = None
    notes: Tuple[str, ...] = ()

    def variable(self, name: str) -> VariablePlan:
        for v in self.variables:
            if v.name == name:
                return v
        raise KeyError(name)

    @property
    def predicted_bytes_per_step(self) -> Optional[float]:
        """Bytes one worker sends plus receives per step (None if a size is unknown)."""
        total = 0.0
        for v in self.variables:
            if v.route == "replicated":
                continue
            if v.predicted_bytes is None:
                return None
            total += v.predicted_bytes
        return total

    # -- serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        variables = tuple(
            VariablePlan(**{**v, "shape": tuple(v["shape"]),
                            "gradients": tuple(GradientPlan(**g) for g in v["gradients"])})
            for v in d["variables"])
        return cls(**{**d, "hosts": tuple(tuple(h) for h in d["hosts"]), "variables": variables,
                      "notes": tuple(d.get("notes", ()))})

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))

    # -- display ---------------------------------------------------------------------------
    def table(self) -> str:
        rows = [("variable", "shape", "bytes", "gradient/role", "route", "reduce",
                 "bytes/step/worker")]
        for v in self.variables:
            rows.append((v.name, "[" + ",".join("?" if d is None else str(d) for d in v.shape) + "]",
                         "?" if v.nbytes is None else f"{v.nbytes:,}",
                         v.kind if v.role == "trained" else v.role, v.route,
                         v.reduction or "-", _fmt_bytes(v.predicted_bytes, v.route)))
        hosts = ",".join(f"{h}:{n}" for h, n in self.hosts)
        head = (f"tfpar plan: run_mode={self.run_mode} (runs as {self.mode}), "
                f"{self.num_workers} worker(s) on {hosts}")
        total = self.predicted_bytes_per_step
        foot = ("predicted communication per worker per step: "
                + ("unknown (a gradient size is not static)" if total is None
                   else f"{total:,.0f} bytes"))
        return "\n".join([head, format_table(rows), foot] + [f"note: {n}" for n in self.notes])

    def __str__(self):
        return self.table()


def _fmt_bytes(b, route) -> str:
    if route == "replicated":
        return "-"
    return "?" if b is None else f"{b:,.0f}"
