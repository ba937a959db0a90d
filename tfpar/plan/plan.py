"""The Plan: every decision tfpar makes for a job, as plain data.

Transforms consume a Plan and decide nothing themselves, so what will happen can be printed,
saved, diffed and tested without running a cluster.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Dict, Optional, Tuple

from tfpar.partition.counts.search import GroupDecision
from tfpar.partition.tiling.cuts import Tiling
from tfpar.partition.tiling.tiling_plan import TilingPlan
from tfpar.plan.layout import host_of_rank
from tfpar.plan.routing import Routing
from tfpar.plan.table import format_table

ROUTES = ("allreduce", "allgather", "ps", "replicated", "tiled", "sharded")
SPLIT_ROUTES = ("tiled", "sharded")  # a tiling says which piece each worker holds


@dataclasses.dataclass(frozen=True)
class GradientPlan:
    """One raw gradient and the tensors a transform rewires (values, and indices if sparse)."""

    values: str
    indices: Optional[str] = None
    scope: str = ""  # the optimizer's update name scope ("" for a lone op)
    ops: Tuple[str, ...] = ()  # the ops that write the variable and its slots
    post_processed: bool = False  # clipping, scaling, ... between the raw gradient and update
    final_values: Optional[str] = None  # what the update reads (None: `values`)
    final_indices: Optional[str] = None  # likewise for `indices`
    row_sums: Tuple[str, ...] = ()  # sparse post-processing sums over rows: summed over workers
    # route "allgather": each worker sums its rows by id before the allgather (exact where
    # the post-processing is linear in the rows: what the update sums it sums first)
    sum_duplicates: bool = False
    # the update group (Plan.update_groups): its collectives and servers' step are those
    # of the runs that make this update, apart from other groups'
    group: int = 0


@dataclasses.dataclass(frozen=True)
class PartPlan:
    """One part of a variable on a parameter server: rows start, start + step, ... below
    stop, on PS task `ps_task`. A row range has step 1; parts dealt out modulo P (row i in
    part i % P, TensorFlow's `partition_strategy="mod"`) have start k and step P.

    stop is None for a variable kept whole (a scalar, or a dense variable in PS mode).
    """

    ps_task: int
    start: int = 0
    stop: Optional[int] = None
    step: int = 1

    def rows(self) -> Optional[slice]:
        """The rows it holds, as a slice of the whole variable (None: all of them)."""
        return None if self.stop is None else slice(self.start, self.stop, self.step)

    def num_rows(self) -> Optional[int]:
        return None if self.stop is None else len(range(self.start, self.stop, self.step))


@dataclasses.dataclass(frozen=True)
class VariablePlan:
    """Where one variable lives and how its gradient is combined across workers.

    route: "allreduce" (Horovod allreduce of the dense gradient; for a sparse gradient, of
    its rows summed densely with a count of the rows each worker touched), "allgather" (sparse gradient,
    Horovod allgather of values and indices), "ps" (stored in `parts` on the parameter
    servers; workers push gradients there and the chief applies the optimizer; optimizer
    slots follow their variable's parts), "replicated" (a copy on every worker, set equal
    at start by a broadcast from worker 0) or "tiled" (split over the devices by `tiling`,
    a tiling the user or the tiling planner chose: model parallelism, each worker holding
    its tile of the variable and of its slots; `predicted_bytes` of a split weight counts
    its layer's exchanges, its bias's included) or "sharded" (a sparse variable's rows,
    and its slots', split over the workers by `tiling` (rows only): each worker holds and
    updates its own rows, lookups and row gradients go to the rows' owners by all-to-all).
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
    parts: Tuple[PartPlan, ...] = ()
    slot_of: Optional[str] = None
    tiling: Optional[Tiling] = None  # routes "tiled", "sharded": which piece each device holds

    def __post_init__(self):
        if self.route not in ROUTES:
            raise ValueError(f"unknown route {self.route!r}")
        if (self.route in SPLIT_ROUTES) != (self.tiling is not None):
            raise ValueError(f"{self.name}: a tiling goes with routes 'tiled' and 'sharded' "
                             "and only with them")


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
    # PS pushes and sharded row gradients combined per host before crossing host links
    local_aggregation: bool = False
    sync: bool = True  # False: each worker applies its own gradients on the PS at once
    # {partitioner group: how its count was decided}
    partition_search: Optional[Dict[str, GroupDecision]] = None
    # density routing's links and choices, and local aggregation's (what was measured)
    routing: Optional[Routing] = None
    # the tiling planner's result, whose weights' tilings the "tiled" variables carry
    tiling: Optional[TilingPlan] = None
    # training-mode batch norms normalised over the global batch (every worker's rows)
    batch_norms: Tuple[str, ...] = ()
    # route "sharded": each batch's ids sent to their owners during the step before
    # (the input pipeline read a step ahead; Config.ids_ahead)
    ids_ahead: bool = False
    # the step's allreduced gradients travel in route "allgather"'s allgather, each worker
    # summing everyone's (Config.allreduce_by_allgather): one collective a step
    allreduce_by_allgather: bool = False
    # the step's dense gradients travel in route "sharded"'s gradient all-to-all, each
    # worker's sent whole to every worker and summed in rank order
    # (Config.allreduce_by_allgather where no allgather runs): one collective fewer a step
    allreduce_by_alltoall: bool = False
    # The trained variables of each update group (`GradientPlan.group`): updates made by
    # different runs (a GAN's generator and discriminator, by turns), whose collectives
    # are packed and servers' steps synchronised apart. () when one run makes them all.
    update_groups: Tuple[Tuple[str, ...], ...] = ()

    @property
    def num_ps(self) -> int:
        """Parameter-server tasks: one per host when any variable is on them, else none."""
        return len(self.hosts) if any(v.route == "ps" for v in self.variables) else 0

    def host_of_rank(self, rank: int) -> int:
        return host_of_rank([slots for _, slots in self.hosts], rank)

    def ps_load(self) -> Tuple[int, ...]:
        """Bytes stored on each PS task (variables and slots)."""
        load = [0] * self.num_ps
        for v in self.variables:
            for p in v.parts:
                load[p.ps_task] += _part_bytes(v, p)
        return tuple(load)

    def with_tiling(self, tiling: TilingPlan) -> "Plan":
        """This plan with the tiling planner's weights split as it chose (route "tiled");
        the other variables keep their routes."""
        return dataclasses.replace(self.with_tiles(tiling.placement), tiling=tiling)

    def with_tiles(self, chosen: Dict[str, Tiling]) -> "Plan":
        """This plan with the variables in `chosen` split by their tilings (route "tiled",
        their optimizer slots with them); the other variables keep their routes."""
        unknown = sorted(set(chosen) - {v.name for v in self.variables})
        if unknown:
            raise ValueError(f"the tiling plan splits {unknown}, which this plan does not have")
        for name, t in chosen.items():
            v = self.variable(name)
            if t.devices != self.num_workers:
                raise ValueError(f"the tiling {t} of {name!r} is for {t.devices} devices; the "
                                 f"job has {self.num_workers} workers")
            for c in t.cuts:
                if c.splits and (c.dim >= len(v.shape) or v.shape[c.dim] is None):
                    raise ValueError(f"the tiling {t} of {name!r} splits dimension {c.dim} of "
                                     f"a variable of shape {list(v.shape)}")
            tile = t.tile_shape(v.shape)
            if any(tuple(hi - lo for lo, hi in t.tile_ranges(v.shape, d)) != tile
                   for d in range(t.devices)):
                raise ValueError(f"the tiling {t} of {name!r} does not divide its shape "
                                 f"{list(v.shape)} evenly")

        def split(v):  # a slot (Adam's m and v) is split as its variable is
            owner = v.slot_of if v.slot_of in chosen else v.name
            return (dataclasses.replace(v, route="tiled", tiling=chosen[owner], parts=(),
                                        predicted_bytes=None)
                    if owner in chosen else v)
        return dataclasses.replace(self, variables=tuple(split(v) for v in self.variables))

    def with_predicted(self, predicted: Dict[str, float]) -> "Plan":
        """This plan with the predicted bytes per worker per step of these variables."""
        return dataclasses.replace(self, variables=tuple(
            dataclasses.replace(v, predicted_bytes=predicted[v.name]) if v.name in predicted
            else v for v in self.variables))

    def groups_of(self, name: str) -> Tuple[int, ...]:
        """The update groups of every update of a trained variable."""
        return tuple(sorted({g.group for g in self.variable(name).gradients}))

    def variable(self, name: str) -> VariablePlan:
        for v in self.variables:
            if v.name == name:
                return v
        raise KeyError(name)

    @property
    def predicted_bytes_per_step(self) -> Optional[float]:
        """Bytes one worker sends plus receives per step (None if a size is unknown)."""
        tiled = [v for v in self.variables if v.route == "tiled"]
        layers = [v.predicted_bytes for v in tiled if v.predicted_bytes is not None]
        # Split layers count what the rewrite moves for them; without that (a plan printed
        # before a job), the tiling planner's count over all devices.
        total = float(sum(layers))
        if tiled and not layers and self.tiling:
            total += self.tiling.total_bytes / self.tiling.devices
        for v in self.variables:
            if v.route in ("replicated", "tiled") or not v.gradients:
                continue
            if v.predicted_bytes is None:
                return None
            total += v.predicted_bytes
        return total

    # -- serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for v, out in zip(self.variables, d["variables"]):
            out["tiling"] = None if v.tiling is None else str(v.tiling)
        d["tiling"] = self.tiling.to_dict() if self.tiling else None
        d["routing"] = self.routing.to_dict() if self.routing else None
        d["partition_search"] = None if self.partition_search is None else {
            gid: g.to_dict() for gid, g in self.partition_search.items()}
        return d

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        variables = tuple(
            VariablePlan(**{**v, "shape": tuple(v["shape"]),
                            "gradients": tuple(GradientPlan(**{**g, "ops": tuple(g["ops"]),
                                                                 "row_sums": tuple(g.get("row_sums", ()))})
                                               for g in v["gradients"]),
                            "parts": tuple(PartPlan(**p) for p in v["parts"]),
                            "tiling": None if v.get("tiling") is None
                            else Tiling.parse(v["tiling"])})
            for v in d["variables"])
        return cls(**{**d, "hosts": tuple(tuple(h) for h in d["hosts"]), "variables": variables,
                      "notes": tuple(d.get("notes", ())),
                      "batch_norms": tuple(d.get("batch_norms", ())),
                      "update_groups": tuple(tuple(g) for g in d.get("update_groups", ())),
                      "tiling": TilingPlan.from_dict(d["tiling"]) if d.get("tiling") else None,
                      "routing": Routing.from_dict(d["routing"]) if d.get("routing") else None,
                      "partition_search": None if d.get("partition_search") is None else {
                          gid: GroupDecision.from_dict(g)
                          for gid, g in d["partition_search"].items()}})

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))

    # -- display ---------------------------------------------------------------------------
    def table(self) -> str:
        rows = [("variable", "shape", "bytes", "gradient/role", "route", "parts (rows@ps)",
                 "reduce", "bytes/step/worker")]
        for v in self.variables:
            rows.append((v.name, "[" + ",".join("?" if d is None else str(d) for d in v.shape) + "]",
                         "?" if v.nbytes is None else f"{v.nbytes:,}",
                         v.kind if v.role == "trained" else v.role,
                         v.route + (f" {v.tiling}" if v.tiling else ""), _fmt_parts(v.parts),
                         v.reduction or "-",
                         _fmt_bytes(v.predicted_bytes, v.route if v.gradients else "replicated")))
        hosts = ",".join(f"{h}:{n}" for h, n in self.hosts)
        head = (f"tfpar plan: run_mode={self.run_mode} (runs as {self.mode}), "
                f"{self.num_workers} worker(s) on {hosts}"
                + ("" if self.sync else ", asynchronous parameter servers"))
        total = self.predicted_bytes_per_step
        foot = ("predicted communication per worker per step: "
                + ("unknown (a gradient size is not static)" if total is None
                   else f"{total:,.0f} bytes"))
        lines = [head, format_table(rows), foot]
        if self.num_ps:
            load = ", ".join(f"ps:{i}@{self.hosts[i][0]} {b:,} B" for i, b in
                             enumerate(self.ps_load()))
            lines.append(f"parameter servers: {load}; local aggregation "
                         f"{'on' if self.local_aggregation else 'off'}")
        for gid, d in sorted((self.partition_search or {}).items()):
            how = {"searched": "searched in this job", "remembered": "remembered from an "
                   "earlier search", "config": "set by tfpar.Config"}[d.source]
            lines.append(f"partition count of {', '.join(d.variables)}: P={d.partitions} "
                         f"({how})")
            if d.search:
                lines.append("  " + d.search.describe())
        gathered = [v for v in self.variables if v.route == "allgather" and v.gradients]
        summed = [v.name for v in gathered if all(g.sum_duplicates for g in v.gradients)]
        if summed:
            lines.append("allgather: each worker's rows summed by id before they are sent: "
                         + ", ".join(summed))
        if self.allreduce_by_allgather:
            lines.append("allgather: the allreduced gradients travel in it too, each worker "
                         "summing everyone's (Config.allreduce_by_allgather): " + ", ".join(
                             v.name for v in self.variables
                             if v.route == "allreduce" and v.gradients))
        if self.allreduce_by_alltoall:
            lines.append("sharded: the dense gradients travel in its gradients' all-to-all, "
                         "each worker summing everyone's (Config.allreduce_by_allgather): "
                         + ", ".join(v.name for v in self.variables
                                     if v.route == "allreduce" and v.gradients))
        if len(summed) < len(gathered):
            lines.append("allgather: rows sent as the gradient carries them "
                         "(Config.sum_duplicate_rows, or a post-processing that would see "
                         "the sums): " + ", ".join(
                             v.name for v in gathered if v.name not in summed))
        split = [v for v in self.variables if v.route in SPLIT_ROUTES and v.slot_of is None]
        if split:
            lines.append("split variables (Config.tiling; sparse_route 'sharded': rows), the "
                         "tile each worker holds:")
            for v in split:
                boxes = " ".join(
                    f"w{d}[" + ",".join(_slice_text(x) for x in v.tiling.tile_slices(v.shape, d))
                    + "]" for d in range(v.tiling.devices))
                lines.append(f"  {v.name} {v.tiling}: {boxes}")
            if any(v.route == "sharded" for v in split) and len(self.hosts) > 1:
                lines.append("sharded rows' gradients: local aggregation "
                             + ("on (summed per host, then to their owners)"
                                if self.local_aggregation else "off (straight to their owners)"))
            if self.ids_ahead:
                lines.append("sharded lookups: each batch's ids go to their owners during the "
                             "step before (the input is read a step ahead)")
        if self.update_groups:
            lines.append("updated by different runs, each group's collectives and servers' "
                         "step apart: " + "; ".join(", ".join(g) for g in self.update_groups))
        if self.tiling:
            lines.append(self.tiling.table())
        return "\n".join(lines + [f"note: {n}" for n in self.notes])

    def __str__(self):
        return self.table()


def _part_bytes(v: VariablePlan, p: PartPlan) -> int:
    if v.nbytes is None:
        return 0
    if p.stop is None or not v.shape or not v.shape[0]:
        return v.nbytes
    return v.nbytes * p.num_rows() // v.shape[0]


def _fmt_parts(parts) -> str:
    if not parts:
        return "-"
    return " ".join(f"all@{p.ps_task}" if p.stop is None else f"{_slice_text(p.rows())}@{p.ps_task}"
                    for p in parts)


def _fmt_bytes(b, route) -> str:
    if route == "replicated":
        return "-"
    if route == "tiled" and b is None:
        return "with its layer"  # a slot or bias: counted with its weight's layer
    return "?" if b is None else f"{b:,.0f}"


def _slice_text(x: slice) -> str:
    """A tile's slice as numpy writes it: "0:6", or "1::4" (every 4th row from row 1)."""
    return f"{x.start}:{x.stop}" if (x.step or 1) == 1 else f"{x.start}::{x.step}"
