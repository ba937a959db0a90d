"""The dataflow of a training step: tensors, and the ops between them that move data.

Ops: matmuls (forward, and their dX and dW), and the two kinds of non-matmul op whose
operands have different shapes, so that a tiling cannot simply pass through them: a
`Broadcast` (a bias added over the batch rows) and a `Reduce` (a bias gradient: dY
summed over the batch). Element-wise ops between same-shaped tensors keep a tiling, so
their operands are one tensor here. What the tiling planner reads. Build one without TensorFlow (`mlp`, or `Dataflow` by
hand) for tests and what-if planning, or extract it from a real graph
(`tfpar.graph.extract`).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence, Tuple, Union

from tfpar.errors import TfparError

KINDS = ("input", "weight", "activation", "gradient")
CAUSES = ("forward", "backward_data", "backward_weight")


@dataclasses.dataclass(frozen=True)
class Matrix:
    name: str
    shape: Tuple[int, ...]
    kind: str  # "input" | "weight" | "activation" | "gradient" (of an activation)

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclasses.dataclass(frozen=True)
class MatMul:
    """out = op(a) op(b); a weight's gradient is written into the weight's own tiling."""

    name: str
    a: str
    b: str
    out: str
    transpose_a: bool = False
    transpose_b: bool = False
    cause: str = "forward"  # "forward" | "backward_data" | "backward_weight"

    @property
    def operands(self) -> Tuple[str, ...]:
        return (self.a, self.b, self.out)


@dataclasses.dataclass(frozen=True)
class Reduce:
    """out = the sum of matrix `a` over its dimension `axis`; out is a vector along the
    other one (a bias gradient: dY summed over the batch rows, axis 0)."""

    name: str
    a: str
    out: str
    axis: int = 0
    cause: str = "backward_weight"

    @property
    def operands(self) -> Tuple[str, ...]:
        return (self.a, self.out)


@dataclasses.dataclass(frozen=True)
class Broadcast:
    """Vector `a` added to matrix `out` along its dimension `axis` (a bias add: the same
    bias for every batch row, axis 0); out's other dimension is a's."""

    name: str
    a: str
    out: str
    axis: int = 0
    cause: str = "forward"

    @property
    def operands(self) -> Tuple[str, ...]:
        return (self.a, self.out)


Op = Union[MatMul, Reduce, Broadcast]


@dataclasses.dataclass
class Dataflow:
    matrices: Dict[str, Matrix] = dataclasses.field(default_factory=dict)
    ops: List[Op] = dataclasses.field(default_factory=list)

    @property
    def matmuls(self) -> List[MatMul]:
        return [op for op in self.ops if isinstance(op, MatMul)]

    def flops(self, op: Op) -> float:
        """Floating-point operations of one op on the whole tensors."""
        if isinstance(op, MatMul):
            a = self.matrices[op.a].shape
            return 2.0 * self.matrices[op.out].size * (a[0] if op.transpose_a else a[1])
        return float(self.matrices[op.a if isinstance(op, Reduce) else op.out].size)

    def matrix(self, name: str, shape: Sequence[int], kind: str) -> str:
        if kind not in KINDS:
            raise TfparError(f"matrix kind must be one of {KINDS}, got {kind!r}")
        if any(d is None or d < 1 for d in shape):
            raise TfparError(f"matrix {name!r} needs a known positive shape, got {list(shape)} "
                             "(give the batch size)")
        self.matrices[name] = Matrix(name, tuple(int(d) for d in shape), kind)
        return name

    def matmul(self, name, a, b, out, transpose_a=False, transpose_b=False, cause="forward"):
        for m in (a, b, out):
            if m not in self.matrices:
                raise TfparError(f"matmul {name!r} uses unknown matrix {m!r}")
        sa = self.matrices[a].shape[::-1] if transpose_a else self.matrices[a].shape
        sb = self.matrices[b].shape[::-1] if transpose_b else self.matrices[b].shape
        if sa[1] != sb[0] or (sa[0], sb[1]) != self.matrices[out].shape:
            raise TfparError(f"matmul {name!r}: shapes {sa} x {sb} -> "
                             f"{self.matrices[out].shape} do not agree")
        self.ops.append(MatMul(name, a, b, out, transpose_a, transpose_b, cause))

    def reduce(self, name, a, out, axis=0, cause="backward_weight"):
        """out = sum of `a` over `axis` (see `Reduce`)."""
        self._vector_op(name, a, out, axis, "reduce", out, a)
        self.ops.append(Reduce(name, a, out, axis, cause))

    def broadcast(self, name, a, out, axis=0, cause="forward"):
        """Vector `a` added to `out` along `axis` (see `Broadcast`)."""
        self._vector_op(name, a, out, axis, "broadcast", a, out)
        self.ops.append(Broadcast(name, a, out, axis, cause))

    def _vector_op(self, name, a, out, axis, what, vector, matrix):
        for m in (a, out):
            if m not in self.matrices:
                raise TfparError(f"{what} {name!r} uses unknown matrix {m!r}")
        v, mat = self.matrices[vector].shape, self.matrices[matrix].shape
        if axis not in (0, 1) or len(mat) != 2 or v != (mat[1 - axis],):
            raise TfparError(f"{what} {name!r}: a vector of shape {v} does not run along "
                             f"dimension {1 - axis} of a matrix of shape {mat}")

    def batch_times(self, workers: int) -> "Dataflow":
        """This dataflow of one worker's graph for the batch of `workers` together (the
        global batch the tiling planner splits): the rows of every matrix that is not a
        weight times `workers`."""
        out = Dataflow(ops=list(self.ops))
        for name, m in self.matrices.items():
            shape = m.shape if m.kind == "weight" else (m.shape[0] * workers,) + m.shape[1:]
            out.matrices[name] = Matrix(name, shape, m.kind)
        return out

    def scaled(self, tilings: Dict[str, "object"]) -> "Dataflow":
        """The tile graph: every matrix replaced by one tile of its one-cut tiling."""
        out = Dataflow(ops=list(self.ops))
        for name, m in self.matrices.items():
            cut = tilings[name]
            shape = list(m.shape)
            if cut.dim is not None:
                shape[cut.dim] //= cut.parts
            out.matrices[name] = Matrix(name, tuple(shape), m.kind)
        return out


def mlp(batch: int, widths: Sequence[int], bias: bool = False) -> Dataflow:
    """A fully connected chain: widths[0] inputs, then one layer per further width.

    Per layer l: forward x_l = x_(l-1) W_l; backward dx_(l-1) = dx_l W_l^T (not for the
    input); weight gradient dW_l = x_(l-1)^T dx_l, kept in W_l's tiling. Element-wise
    activations keep a tensor's tiling, so x_l stands for both sides of them. With
    `bias`, each layer adds b_l over the batch (a Broadcast) and sums dx_l over the batch
    into b_l's gradient (a Reduce).
    """
    if batch is None or batch < 1:
        raise TfparError("the tiling planner needs the batch size: give batch=...")
    if len(widths) < 2:
        raise TfparError("an MLP needs at least an input width and one layer width")
    df = Dataflow()
    df.matrix("x0", [batch, widths[0]], "input")
    for l in range(1, len(widths)):
        df.matrix(f"W{l}", [widths[l - 1], widths[l]], "weight")
        df.matrix(f"x{l}", [batch, widths[l]], "activation")
        df.matrix(f"dx{l}", [batch, widths[l]], "gradient")
        if bias:
            df.matrix(f"b{l}", [widths[l]], "weight")
    for l in range(1, len(widths)):
        df.matmul(f"fwd{l}", f"x{l - 1}", f"W{l}", f"x{l}")
        if l > 1:
            df.matmul(f"bwd{l}", f"dx{l}", f"W{l}", f"dx{l - 1}", transpose_b=True,
                      cause="backward_data")
        df.matmul(f"grad{l}", f"x{l - 1}", f"dx{l}", f"W{l}", transpose_a=True,
                  cause="backward_weight")
        if bias:
            df.broadcast(f"bias{l}", f"b{l}", f"x{l}")
            df.reduce(f"dbias{l}", f"dx{l}", f"b{l}")
    return df
