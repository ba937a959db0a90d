"""DeviceMesh: the devices a plan is for, as nested groups with their links' costs.

One value replaces the tuples that used to say this in four ways (the planner's
hierarchy, the simulator's machine, the CLI's levels): levels outermost first, e.g. 2
hosts of 4 devices is `DeviceMesh((MeshLevel(2, 1.25e9, 2e-5), MeshLevel(4, 25e9, 5e-6)))`.
Each level's links carry what crosses between its groups; alpha-beta costs as in Alpa's
LogicalDeviceMesh. Devices are numbered in mixed radix, the outermost level the most
significant digit (as `Tiling.tile_ranges` numbers them).
"""
from __future__ import annotations

import dataclasses
from typing import Tuple


@dataclasses.dataclass(frozen=True)
class MeshLevel:
    """`parts` groups joined by links of `bandwidth` bytes/s and `latency` s per message."""

    parts: int
    bandwidth: float
    latency: float = 0.0

    def __post_init__(self):
        if not isinstance(self.parts, int) or self.parts < 1:
            raise ValueError(f"a mesh level needs a positive int of parts, got {self.parts!r}")
        if not self.bandwidth > 0:
            raise ValueError(f"a mesh level needs a positive bandwidth, got {self.bandwidth!r}")
        if self.latency < 0:
            raise ValueError(f"a mesh level's latency cannot be negative: {self.latency!r}")


@dataclasses.dataclass(frozen=True)
class DeviceMesh:
    """Devices as nested levels (outermost first), and each device's flops per second."""

    levels: Tuple[MeshLevel, ...]
    flops: float = 1e12

    def __post_init__(self):
        object.__setattr__(self, "levels", tuple(
            lv if isinstance(lv, MeshLevel) else MeshLevel(*lv) for lv in self.levels))
        if not self.levels:
            raise ValueError("a device mesh needs at least one level")

    @classmethod
    def flat(cls, devices: int, bandwidth: float = 1e9, latency: float = 0.0,
             flops: float = 1e12) -> "DeviceMesh":
        """`devices` devices all joined by the same links."""
        return cls((MeshLevel(devices, bandwidth, latency),), flops)

    @classmethod
    def hosts(cls, hosts: int, per_host: int, host_bandwidth: float, device_bandwidth: float,
              latency: float = 0.0, flops: float = 1e12) -> "DeviceMesh":
        """`hosts` hosts of `per_host` devices; a level of one part is left out."""
        levels = [MeshLevel(n, bw, latency) for n, bw in
                  ((hosts, host_bandwidth), (per_host, device_bandwidth)) if n > 1]
        return cls(tuple(levels) or (MeshLevel(1, device_bandwidth, latency),), flops)

    @property
    def devices(self) -> int:
        n = 1
        for lv in self.levels:
            n *= lv.parts
        return n

    def prime_cuts(self) -> Tuple[MeshLevel, ...]:
        """Each level split into prime cuts (a level of 4 is two cuts of 2), outermost first:
        the cuts a tiling makes, each with the links it crosses."""
        out = []
        for lv in self.levels:
            k, p = lv.parts, 2
            while k > 1:
                while k % p == 0:
                    out.append(MeshLevel(p, lv.bandwidth, lv.latency))
                    k //= p
                p += 1
        return tuple(out)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceMesh":
        return cls(tuple(MeshLevel(**lv) for lv in d["levels"]), d.get("flops", 1e12))

    def __str__(self):
        return " x ".join(f"{lv.parts} ({lv.bandwidth / 1e9:g} GB/s"
                          + (f", {lv.latency * 1e6:g} us" if lv.latency else "") + ")"
                          for lv in self.levels)
