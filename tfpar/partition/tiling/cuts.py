"""Tilings of tensors and what converting between them costs (SoyBean, sections 3-4).

One *cut* splits a group of devices into m subgroups, and tiles each tensor one way:
split along dimension d into m equal parts, replicate (`r`), or, for a matmul's output
only, `red` (m full-size partial sums still to be added). A k-cut tiling is the sequence
of the cuts' basic tilings (outermost first), e.g. "RC" on 4 devices: rows over the two
outer groups, columns inside each. For 2-D tensors R = split rows (dim 0), C = split
columns (dim 1).

Costs count elements moved, summed over devices, by the "ghost area" rule: each device
fetches what its local computation needs and it does not hold. For a cut into m parts of
a tensor of S elements:

    split d -> split d': S(1 - 1/m)  (each holds S/m, needs S/m, shares S/m^2)   [d != d']
    split   -> r       : S(m - 1)    (each fetches the S - S/m it lacks)
    r       -> any     : 0
    red     -> split   : S(m - 1)    (each gathers its S/m from m-1 partials)
    red     -> r       : 2S(m - 1)   (red -> split -> r)

For m = 2 this is the digest's table (R<->C S/2, R->r S, red->R S, red->r 2S).

One more basic tiling is not a box: `M` (a *cyclic* row cut, `Cut(0, m, cyclic=True)`),
part k holding rows k, k + m, k + 2m, ... (HugeCTR SOK's ownership of embedding rows by id
modulo m). Only route "sharded" uses it, as a tiling's only cut; `tile_slices` gives every
tiling's tile as slices (a step on the rows for `M`), `tile_ranges` boxes only.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Sequence, Tuple, Union

RED = "red"


@dataclasses.dataclass(frozen=True)
class Cut:
    """One basic tiling: split dimension `dim` into `parts`, or replicate (dim None).
    cyclic: rows dealt out in turn (part k holds rows k, k + parts, ...), not in ranges."""

    dim: Union[int, None, str]  # a dimension, None (replicate) or RED (partial sums)
    parts: int = 2
    cyclic: bool = False

    def __post_init__(self):
        if self.cyclic and self.dim != 0:
            raise ValueError("only a row cut (dimension 0) can be cyclic")

    def __str__(self):
        letter = ("r" if self.dim is None else "+" if self.dim == RED else "M" if self.cyclic
                  else {0: "R", 1: "C"}.get(self.dim, f"P{self.dim}"))
        return letter if self.parts == 2 else f"{letter}{self.parts}"

    @property
    def splits(self) -> bool:
        return self.dim is not None and self.dim != RED


@dataclasses.dataclass(frozen=True)
class Tiling:
    """A k-cut tiling: one Cut per cut of the device groups, outermost first."""

    cuts: Tuple[Cut, ...] = ()

    def then(self, cut: Cut) -> "Tiling":
        """Composition (Definition 1): this tiling, then `cut` inside each tile."""
        return Tiling(self.cuts + (cut,))

    def flattened(self) -> Tuple[Tuple[Optional[int], int], ...]:
        """Theorem 2: only how many ways each dimension is split matters, not the order.
        Returns sorted (dim, total parts) pairs, replication included as dim None."""
        total: Dict[Optional[int], int] = {}
        for c in self.cuts:
            total[c.dim] = total.get(c.dim, 1) * c.parts
        return tuple(sorted(total.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))

    def tile_shape(self, shape: Sequence[int]) -> Tuple[int, ...]:
        out = list(shape)
        for c in self.cuts:
            if c.splits:
                out[c.dim] //= c.parts
        return tuple(out)

    def digits(self, device: int) -> Tuple[int, ...]:
        """`device`'s part at each cut. Devices are numbered in mixed radix over the cuts,
        the outermost cut the most significant digit, so the first cut separates devices
        [0, N/m) from [N/m, 2N/m), ..."""
        if not 0 <= device < self.devices:
            raise ValueError(f"device {device} is not in 0..{self.devices - 1}")
        out, rest = [], self.devices
        for c in self.cuts:
            rest //= c.parts
            out.append((device // rest) % c.parts)
        return tuple(out)

    @property
    def cyclic(self) -> bool:
        """Whether a cut deals the rows out in turn (`M`): the tiles are not boxes."""
        return any(c.cyclic for c in self.cuts)

    def tile_slices(self, shape: Sequence[int], device: int) -> Tuple[slice, ...]:
        """The slices of a whole tensor of `shape` that make `device`'s tile, for every
        tiling (`value[tiling.tile_slices(shape, d)]`): a cyclic cut's rows by a step."""
        if self.cyclic:
            if len(self.cuts) != 1:
                raise ValueError(f"tiling {self}: a cyclic cut must be the only cut")
            return (slice(device, shape[0], self.cuts[0].parts),) + tuple(
                slice(0, n) for n in shape[1:])
        return tuple(slice(lo, hi) for lo, hi in self.tile_ranges(shape, device))

    def tile_ranges(self, shape: Sequence[int], device: int) -> Tuple[Tuple[int, int], ...]:
        """The [start, stop) range along each dimension that `device` holds. A split that
        does not divide evenly gives the first parts one more (as numpy's array_split).
        Not for a cyclic tiling (its tiles are not boxes: `tile_slices`)."""
        if self.cyclic:
            raise ValueError(f"tiling {self} deals rows out in turn: its tiles are not "
                             "ranges (use tile_slices)")
        ranges = [[0, n] for n in shape]
        for c, part in zip(self.cuts, self.digits(device)):
            if c.splits:
                lo, hi = ranges[c.dim]
                n = hi - lo
                ranges[c.dim] = [lo + part * (n // c.parts) + min(part, n % c.parts),
                                 lo + (part + 1) * (n // c.parts) + min(part + 1, n % c.parts)]
        return tuple((lo, hi) for lo, hi in ranges)

    def partial_digits(self, device: int) -> Tuple[int, ...]:
        """`device`'s part at each partial-sum cut: the tensor is the sum over these."""
        return tuple(d for c, d in zip(self.cuts, self.digits(device)) if c.dim == RED)

    @property
    def devices(self) -> int:
        n = 1
        for c in self.cuts:
            n *= c.parts
        return n

    def __str__(self):
        return "".join(str(c) for c in self.cuts) or "-"

    @classmethod
    def parse(cls, text: str) -> "Tiling":
        """"RC", "rR", "C3R" (a 3-way column cut, then a 2-way row cut), "+C" (partial
        sums over the first cut, columns split inside), "M4" (rows dealt out over 4
        parts in turn); "-" (no cut)."""
        if text == "-":
            return cls()
        cuts, i = [], 0
        while i < len(text):
            ch = text[i]
            i += 1
            if ch == "+":
                dim = RED
            elif ch == "P":
                j = i
                while j < len(text) and text[j].isdigit():
                    j += 1
                dim, i = int(text[i:j]), j
            else:
                dim = {"R": 0, "C": 1, "r": None, "M": 0}[ch]
            j = i
            while j < len(text) and text[j].isdigit():
                j += 1
            parts = int(text[i:j]) if j > i else 2
            i = j
            cuts.append(Cut(dim, parts, cyclic=ch == "M"))
        return cls(tuple(cuts))


def convert_cost(src, dst: Optional[int], size: float, m: int) -> float:
    """Elements moved to turn a one-cut tiling `src` (a dim, None for r, or RED) into `dst`."""
    if src == RED:
        return size * (m - 1) * (2 if dst is None else 1)
    if src is None or src == dst:
        return 0.0
    if dst is None:
        return size * (m - 1)
    return size * (1 - 1 / m)


def matmul_cost(ta, tb, tc, sa: float, sb: float, sc: float, m: int,
                transpose_a=False, transpose_b=False) -> Tuple[float, str]:
    """Equation 2: the cheapest aligned form of C = op(A) op(B) for one cut into m parts.

    ta, tb, tc: the one-cut tilings (dim or None) of the stored A, B, C; a transposed
    operand's dim 0 is the product's dim 1. Returns (elements moved, form).
    """
    def as_used(t, transposed):
        return t if (t is None or not transposed) else 1 - t

    ua, ub = as_used(ta, transpose_a), as_used(tb, transpose_b)
    forms = (
        ("R x r -> R", convert_cost(ua, 0, sa, m) + convert_cost(ub, None, sb, m)
         + convert_cost(0, tc, sc, m)),
        ("r x C -> C", convert_cost(ua, None, sa, m) + convert_cost(ub, 1, sb, m)
         + convert_cost(1, tc, sc, m)),
        ("C x R -> red", convert_cost(ua, 1, sa, m) + convert_cost(ub, 0, sb, m)
         + convert_cost(RED, tc, sc, m)),
    )
    name, cost = min(forms, key=lambda f: f[1])
    return cost, name


def reduce_cost(ta, tc, sa: float, sc: float, m: int, axis: int = 0) -> Tuple[float, str]:
    """out = sum of A over `axis`, for one cut into m parts: the cheapest of summing a
    split of the reduced axis (partial sums: red), of the kept axis (out split), or of
    a whole A (out whole on every device). ta: A's tiling; tc: the vector out's (0/None)."""
    kept = 1 - axis
    forms = (
        ("split reduced axis -> red", convert_cost(ta, axis, sa, m)
         + convert_cost(RED, tc, sc, m)),
        ("split kept axis -> split", convert_cost(ta, kept, sa, m) + convert_cost(0, tc, sc, m)),
        ("whole -> r", convert_cost(ta, None, sa, m)),
    )
    name, cost = min(forms, key=lambda f: f[1])
    return cost, name


def broadcast_cost(ta, tc, sa: float, m: int, axis: int = 0) -> float:
    """Vector A added to matrix C along `axis`: where C is split along A's dimension
    (1 - axis), each device needs its part of A; anywhere else, all of A."""
    return convert_cost(ta, 0 if tc == 1 - axis else None, sa, m)


def distinct_tilings(k: int, dims: int = 2) -> int:
    """How many different k-cut tilings a `dims`-d tensor has (flattening: (k+1)(k+2)/2
    for matrices), counted by enumerating compositions of binary cuts."""
    seen = {Tiling()}
    for _ in range(k):
        seen = {t.then(Cut(d)) for t in seen for d in list(range(dims)) + [None]}
    return len({t.flattened() for t in seen})
