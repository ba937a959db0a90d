"""`TilingPlan`: what the tiling planner decided, as a plain value (printable, JSON)."""
from __future__ import annotations

import dataclasses
import json
from typing import Dict, Optional, Tuple

from tfpar.partition.tiling.cuts import Tiling
from tfpar.plan.mesh import DeviceMesh


@dataclasses.dataclass(frozen=True)
class TilingPlan:
    """What the tiling planner decided, with the data- and model-parallel baselines."""

    devices: int
    cuts: Tuple[int, ...]  # parts per cut, outermost first
    tilings: Dict[str, Tiling]  # matrix -> its k-cut tiling
    shapes: Dict[str, Tuple[int, ...]]
    kinds: Dict[str, str]
    bytes_by_cause: Dict[str, float]
    data_parallel_bytes: float
    model_parallel_bytes: float
    bytes_by_cut: Tuple[float, ...] = ()  # bytes crossing each cut's links, outermost first
    mesh: Optional[DeviceMesh] = None  # the devices planned for, if more than a count
    cut_bandwidths: Optional[Tuple[float, ...]] = None  # with a mesh: each cut's links, GB/s
    search: str = ""  # how the tilings were found
    # Time mode (simulated on the mesh): step times, seconds.
    step_time_s: Optional[float] = None
    data_parallel_time_s: Optional[float] = None
    model_parallel_time_s: Optional[float] = None
    # Time mode: seconds each cause keeps the links busy, and compute seconds per device.
    time_by_cause: Optional[Dict[str, float]] = None

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes_by_cause.values())

    @property
    def placement(self) -> Dict[str, Tiling]:
        """Each weight's tiling; `tile` says which piece each device holds."""
        return {x: t for x, t in self.tilings.items() if self.kinds[x] == "weight"}

    def tile(self, name: str, device: int) -> Tuple[Tuple[int, int], ...]:
        """The [start, stop) ranges of tensor `name` that `device` (0..N-1) holds."""
        return self.tilings[name].tile_ranges(self.shapes[name], device)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["tilings"] = {x: str(t) for x, t in self.tilings.items()}
        d["mesh"] = self.mesh.to_dict() if self.mesh else None
        return d

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> "TilingPlan":
        d = dict(d)
        d["cuts"] = tuple(d["cuts"])
        d["tilings"] = {x: Tiling.parse(t) for x, t in d["tilings"].items()}
        d["shapes"] = {k: tuple(v) for k, v in d["shapes"].items()}
        if d.get("mesh"):
            d["mesh"] = DeviceMesh.from_dict(d["mesh"])
        for key in ("bytes_by_cut", "cut_bandwidths"):
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "TilingPlan":
        return cls.from_dict(json.loads(text))

    def table(self) -> str:
        from tfpar.plan.table import format_table
        rows = [("tensor", "kind", "shape", "tiling")]
        for x in sorted(self.tilings, key=lambda n: (self.kinds[n] != "weight", n)):
            rows.append((x, self.kinds[x], "x".join(map(str, self.shapes[x])),
                         str(self.tilings[x])))
        mb = 1e6
        lines = [f"tfpar tiling plan: {self.devices} devices as cuts "
                 f"{' x '.join(map(str, self.cuts)) or '-'} (outermost first); search: "
                 f"{self.search}",
                 format_table(rows),
                 "bytes per step: " + ", ".join(f"{c} {b / mb:.3f} MB"
                                                for c, b in self.bytes_by_cause.items())
                 + f"; total {self.total_bytes / mb:.3f} MB",
                 f"for comparison: data parallel {self.data_parallel_bytes / mb:.3f} MB, "
                 f"model parallel {self.model_parallel_bytes / mb:.3f} MB"]
        if self.bytes_by_cut:
            links = self.cut_bandwidths or (None,) * len(self.cuts)
            lines.append("bytes across each cut: " + ", ".join(
                f"cut {i + 1} ({p} parts{f', {bw:g} GB/s links' if bw else ''}) "
                f"{b / mb:.3f} MB" for i, (p, bw, b) in enumerate(
                    zip(self.cuts, links, self.bytes_by_cut))))
        if self.step_time_s is not None:
            lines.append(f"simulated step time: {self.step_time_s * 1e3:.3f} ms (data parallel "
                         f"{self.data_parallel_time_s * 1e3:.3f} ms, model parallel "
                         f"{self.model_parallel_time_s * 1e3:.3f} ms)")
            lines.append("busy time: " + ", ".join(f"{c} {t * 1e3:.4g} ms"
                                                    for c, t in self.time_by_cause.items()))
        return "\n".join(lines)
