"""Which pieces move between which devices to turn one tiling of a tensor into another.

A conversion between two tilings of one tensor on N devices is a set of `Transfer`s:
device `src` sends the box `src_box` of its tile, and device `dst` adds it into the box
`dst_box` of its new tile. Adding (not placing) is what makes one rule serve every case:
pieces of split tilings do not overlap, so adding them assembles the tile, and the pieces
of partial sums (a "+" cut) overlap, so adding them reduces. Every tiling conversion the
tiling planner can ask for, and the collectives (all-gather, reduce-scatter, all-to-all,
all-reduce, broadcast, their sub-group forms on hierarchical cuts), are sets of
transfers, and the adjoint of a set is the same set with src and dst swapped: a copy
becomes a sum and a sum a copy. `tfpar.transform.collectives` executes them as one
Horovod all-to-all; this module is pure, so plans can count the bytes.

A device that needs a piece held by several devices (replicas) takes its own copy when it
has one, else the nearest holder: one inside its own group at the outermost cuts (whose
links are the slowest), then the nearest by rank (ranks of a host are consecutive).
Partial sums are reduced directly (each holder's piece goes to the device that needs
it), except into a replicated cut, which goes through a split first (reduce-scatter,
then all-gather), as the cost model counts it (`cuts.convert_cost`).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence, Tuple

from tfpar.errors import TfparError
from tfpar.partition.tiling.cuts import RED, Cut, Tiling

Box = Tuple[Tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Transfer:
    """`src` sends its tile's `src_box` to `dst`, which adds it into its tile's `dst_box`
    (boxes in each device's local tile coordinates, [start, stop) per dimension)."""

    src: int
    dst: int
    src_box: Box
    dst_box: Box

    @property
    def size(self) -> int:
        n = 1
        for lo, hi in self.src_box:
            n *= hi - lo
        return n

    def reversed(self) -> "Transfer":
        return Transfer(self.dst, self.src, self.dst_box, self.src_box)


@dataclasses.dataclass(frozen=True)
class Exchange:
    """One round of transfers of a tensor of `shape` on `devices` devices: each device's
    input tile has `in_shapes[d]`, its output tile `out_shapes[d]`."""

    shape: Tuple[int, ...]
    devices: int
    transfers: Tuple[Transfer, ...]
    in_shapes: Tuple[Tuple[int, ...], ...]
    out_shapes: Tuple[Tuple[int, ...], ...]
    label: str = ""

    def adjoint(self) -> "Exchange":
        return Exchange(self.shape, self.devices, tuple(t.reversed() for t in self.transfers),
                        self.out_shapes, self.in_shapes, f"adjoint of {self.label}")

    @property
    def moved(self) -> int:
        """Elements that cross between devices (a device's own pieces move nothing)."""
        return sum(t.size for t in self.transfers if t.src != t.dst)

    def sent(self, device: int) -> int:
        return sum(t.size for t in self.transfers if t.src == device != t.dst)

    def received(self, device: int) -> int:
        return sum(t.size for t in self.transfers if t.dst == device != t.src)

    @property
    def communicates(self) -> bool:
        return self.moved > 0


def tile_shape(tiling: Tiling, shape: Sequence[int], device: int) -> Tuple[int, ...]:
    """The shape of `device`'s tile (uneven splits give the first parts one more)."""
    return tuple(hi - lo for lo, hi in tiling.tile_ranges(shape, device))


def _check(tiling: Tiling, shape: Sequence[int], devices: int, what: str):
    if tiling.devices != devices:
        raise TfparError(f"{what} tiling {tiling} is for {tiling.devices} devices, not {devices}")
    for c in tiling.cuts:
        if c.splits and not 0 <= c.dim < len(shape):
            raise TfparError(f"{what} tiling {tiling} splits dimension {c.dim} of a "
                             f"{len(shape)}-d tensor {tuple(shape)}")


def _intersect(a: Box, b: Box) -> Box:
    out = tuple((max(lo1, lo2), min(hi1, hi2)) for (lo1, hi1), (lo2, hi2) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else ()


def _local(box: Box, origin: Box) -> Box:
    return tuple((lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin))


def _distance(tiling: Tiling, a: int, b: int) -> Tuple[int, int, int]:
    """How far apart two devices are: first the outermost cut that separates them (the
    slowest links are outermost), then their rank distance."""
    da, db = tiling.digits(a), tiling.digits(b)
    shared = next((i for i, (x, y) in enumerate(zip(da, db)) if x != y), len(da))
    return (-shared, abs(a - b), a)


def exchange(src: Tiling, dst: Tiling, shape: Sequence[int], label: str = "") -> Exchange:
    """The one round of transfers that turns tiles of `src` into tiles of `dst`.

    `dst` may not hold partial sums; `src` may, but then not where `dst` replicates
    (use `conversion`, which goes through a split there).
    """
    shape = tuple(int(n) for n in shape)
    n = src.devices
    _check(src, shape, n, "source")
    _check(dst, shape, n, "target")
    if any(c.dim == RED for c in dst.cuts):
        raise TfparError(f"cannot convert into partial sums ({dst}): a tiling conversion "
                         "produces whole values")
    # Holders of each source box: {box: {partial digits: [devices]}}.
    holders: Dict[Box, Dict[Tuple[int, ...], List[int]]] = {}
    for d in range(n):
        box = src.tile_ranges(shape, d)
        holders.setdefault(box, {}).setdefault(src.partial_digits(d), []).append(d)
    transfers = []
    for d in range(n):
        want = dst.tile_ranges(shape, d)
        for box, by_partial in holders.items():
            piece = _intersect(want, box)
            if not piece:
                continue
            for devices in by_partial.values():
                s = d if d in devices else min(devices, key=lambda q: _distance(src, q, d))
                transfers.append(Transfer(s, d, _local(piece, box), _local(piece, want)))
    transfers.sort(key=lambda t: (t.src, t.dst))
    return Exchange(shape, n, tuple(transfers),
                    tuple(tile_shape(src, shape, d) for d in range(n)),
                    tuple(tile_shape(dst, shape, d) for d in range(n)),
                    label or f"{src} -> {dst}")


def conversion(src: Tiling, dst: Tiling, shape: Sequence[int]) -> List[Exchange]:
    """The exchanges, in order, that turn `src` tiles into `dst` tiles: one, or two when
    partial sums must become replicas (reduced into a split first, then gathered)."""
    if len(src.cuts) != len(dst.cuts):
        raise TfparError(f"tilings {src} and {dst} have different numbers of cuts")
    if not any(a.dim == RED and b.dim is None for a, b in zip(src.cuts, dst.cuts)):
        return [exchange(src, dst, shape)]
    mid = []
    for a, b in zip(src.cuts, dst.cuts):
        if a.dim == RED:
            # Reduce into a split of a dimension that divides the tile left here; the
            # largest dimension keeps the pieces large.
            tile = Tiling(tuple(mid)).tile_shape(shape)
            dims = sorted(range(len(shape)), key=lambda i: -tile[i])
            dim = b.dim if b.dim is not None else next(
                (i for i in dims if tile[i] % a.parts == 0), dims[0])
            mid.append(Cut(dim, a.parts))
        else:
            mid.append(a)
    mid_tiling = Tiling(tuple(mid))
    return [exchange(src, mid_tiling, shape), exchange(mid_tiling, dst, shape)]


def moved(src: Tiling, dst: Tiling, shape: Sequence[int]) -> int:
    """Elements a conversion moves between devices."""
    return sum(e.moved for e in conversion(src, dst, shape))


def broadcast(shape: Sequence[int], devices: int, root: int = 0) -> Exchange:
    """`root`'s whole tensor to every device (its adjoint sums every device's into root's)."""
    whole = tuple((0, n) for n in shape)
    shape = tuple(shape)
    return Exchange(shape, devices, tuple(Transfer(root, d, whole, whole)
                                          for d in range(devices)),
                    (shape,) * devices, (shape,) * devices, f"broadcast from {root}")
