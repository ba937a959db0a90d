"""Collectives for tiles, each a linear operator whose gradient is its exact adjoint.

Horovod registers data-parallel gradients: its allgather's gradient averages over the
workers, so it is the adjoint of the forward operator only up to a factor N. Model-
parallel tiles need the true adjoint (DistDL): the gradient of an all-gather must be the
reduce-scatter of the *sum*, the gradient of a broadcast the sum-reduce to its root. Here
every primitive is one or more `redistribution.Exchange`s (which piece goes where), run as
one Horovod all-to-all each, and its gradient is the same routine on the adjoint exchange
(sources and destinations swapped: copies become sums). Dot-product tests check
<F x, y> = <x, F* y> summed over the workers (`tests/transform/test_collectives.py`).

Every worker must build the same primitives in the same order (Horovod matches
collectives by name); the exchange is computed from the tilings alone, so every worker
knows whether a round moves anything, and all of them skip it or all run it.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import tensorflow as tf

from tfpar.partition.tiling import redistribution
from tfpar.partition.tiling.cuts import RED, Cut, Tiling
from tfpar.partition.tiling.redistribution import Exchange


def run_exchange(x: tf.Tensor, ex: Exchange, rank: int, counter=None,
                 name: str = "exchange") -> tf.Tensor:
    """This worker's output tile of `ex` applied to its input tile `x`, with the exact
    adjoint as gradient. `counter(received_bytes, predicted_bytes)`, if given, is called
    for each all-to-all built (forward and adjoint) with the bytes this worker receives:
    a tensor of what Horovod reports at run time, and the exchange's count; it may return
    an op (a counter's update) that then runs with the exchange."""

    @tf.custom_gradient
    def apply(t):
        out = _move(t, ex, rank, counter, name)

        def adjoint(dy):
            return _move(dy, ex.adjoint(), rank, counter, name + "_adjoint")
        return out, adjoint

    with tf.compat.v1.name_scope(name):
        x = tf.convert_to_tensor(x)
        want = tuple(ex.in_shapes[rank])
        if tuple(x.shape.as_list()) != want:
            from tfpar.errors import TfparError
            raise TfparError(f"{ex.label}: worker {rank}'s tile has shape "
                             f"{x.shape.as_list()}, expected {list(want)}")
        return apply(x)


def never_folded(x: tf.Tensor) -> tf.Tensor:
    """`x`, bit for bit, as a tensor TensorFlow's constant folding never evaluates.

    Horovod's ops are not marked stateful, so constant folding runs one whose inputs are
    all constants (a worker that sends nothing, a broadcast of a constant initial value)
    while it optimises the graph, on that worker alone, and the job hangs. Appending an
    empty piece cut from a stateful op (the clock) makes the input a computed tensor.
    """
    empty = tf.cast(tf.reshape(tf.timestamp(), [1])[:0], x.dtype)
    flat = tf.concat([tf.reshape(x, [-1]), empty], 0)
    shape = x.shape.as_list() if x.shape.is_fully_defined() else tf.shape(x)
    return tf.reshape(flat, shape)


def _move(x: tf.Tensor, ex: Exchange, rank: int, counter, name: str) -> tf.Tensor:
    """The transfers of `ex` seen from `rank`: send pieces, receive, add into place."""
    import horovod.tensorflow as hvd
    out_shape = list(ex.out_shapes[rank])
    pieces: List[tf.Tensor] = []
    received = []
    bump = None
    if ex.communicates:
        # Horovod sends the payload's first splits[0] elements to rank 0, and so on, and
        # concatenates what it receives in the senders' rank order; a pair's pieces keep
        # the exchange's order on both sides.
        sends = sorted((t for t in ex.transfers if t.src == rank and t.dst != rank),
                       key=lambda t: t.dst)
        splits = [0] * ex.devices
        flat = []
        for t in sends:
            flat.append(tf.reshape(_slice(x, t.src_box), [-1]))
            splits[t.dst] += t.size
        payload = never_folded(tf.concat(flat, 0) if flat else tf.zeros([0], x.dtype))
        got, got_splits = hvd.alltoall(payload, splits=tf.constant(splits, tf.int32),
                                       name=f"{name}_alltoall")
        if counter is not None:  # what arrived, as Horovod reports it, and the prediction
            itemsize = x.dtype.size
            bump = counter(tf.cast(tf.reduce_sum(got_splits), tf.float64) * itemsize,
                           ex.received(rank) * itemsize)
        incoming = sorted((t for t in ex.transfers if t.dst == rank and t.src != rank),
                          key=lambda t: t.src)
        sizes = [t.size for t in incoming]
        if sizes:
            chunks = tf.split(got, sizes) if len(sizes) > 1 else [got]
            for t, chunk in zip(incoming, chunks):
                received.append((t, tf.reshape(chunk, [hi - lo for lo, hi in t.src_box])))
    for t in ex.transfers:
        if t.dst == rank and t.src == rank:
            pieces.append((t, _slice(x, t.src_box)))
    pieces.extend(received)
    if not pieces:
        out = tf.zeros(out_shape, x.dtype)
    else:
        padded = [_place(p, t.dst_box, out_shape) for t, p in pieces]
        out = padded[0] if len(padded) == 1 else tf.add_n(padded)
    if ex.communicates and not received:
        # Every worker runs the all-to-all, also one that receives nothing from it (else
        # the others wait for it forever): appending the empty tensor it received is a
        # data dependency that changes no bit.
        out = tf.reshape(tf.concat([tf.reshape(out, [-1]), got], 0), out_shape)
    if bump is not None:
        with tf.control_dependencies([bump]):
            out = tf.identity(out)
    return out


def _slice(x: tf.Tensor, box) -> tf.Tensor:
    if all(lo == 0 and hi == n for (lo, hi), n in zip(box, x.shape.as_list())):
        return x
    return tf.slice(x, [lo for lo, _ in box], [hi - lo for lo, hi in box])


def _place(piece: tf.Tensor, box, shape: Sequence[int]) -> tf.Tensor:
    """`piece` at `box` of a zero tensor of `shape`."""
    pad = [[lo, n - hi] for (lo, hi), n in zip(box, shape)]
    if not any(a or b for a, b in pad):
        return piece
    return tf.pad(piece, pad)


def convert(x: tf.Tensor, src: Tiling, dst: Tiling, shape: Sequence[int], rank: int,
            counter=None, name: str = "convert") -> tf.Tensor:
    """`x`, this worker's tile of a tensor of `shape` under `src`, as its tile under `dst`
    (any two tilings of one device count; partial sums ("+" cuts) are reduced)."""
    if src == dst:
        return x
    for i, ex in enumerate(redistribution.conversion(src, dst, shape)):
        x = run_exchange(x, ex, rank, counter, f"{name}_{i}")
    return x


# -- the named collectives: each a conversion between two tilings ------------------------------
def _one_cut(dim, n: int) -> Tiling:
    return Tiling((Cut(dim, n),))


def allgather(x, shape, n, rank, dim=0, counter=None, name="allgather"):
    """Tiles split along `dim` -> the whole tensor on every worker. Adjoint: reduce-scatter
    of the sum."""
    return convert(x, _one_cut(dim, n), _one_cut(None, n), shape, rank, counter, name)


def reduce_scatter(x, shape, n, rank, dim=0, counter=None, name="reduce_scatter"):
    """Every worker's whole-size partial sum -> its part (along `dim`) of the sum. Adjoint:
    all-gather."""
    return convert(x, _one_cut(RED, n), _one_cut(dim, n), shape, rank, counter, name)


def allreduce(x, shape, n, rank, counter=None, name="allreduce"):
    """Partial sums -> the sum on every worker (reduce-scatter, then all-gather). Its own
    adjoint."""
    return convert(x, _one_cut(RED, n), _one_cut(None, n), shape, rank, counter, name)


def all_to_all(x, shape, n, rank, src_dim=0, dst_dim=1, counter=None, name="all_to_all"):
    """Tiles split along `src_dim` -> split along `dst_dim`. Adjoint: the reverse."""
    return convert(x, _one_cut(src_dim, n), _one_cut(dst_dim, n), shape, rank, counter, name)


def broadcast(x, shape, n, rank, root=0, counter=None, name="broadcast"):
    """`root`'s tensor on every worker (other workers' `x` is not read). Adjoint: the sum
    of every worker's tensor, on `root` (zeros elsewhere)."""
    return run_exchange(x, redistribution.broadcast(shape, n, root), rank, counter, name)


def sum_reduce(x, shape, n, rank, root=0, counter=None, name="sum_reduce"):
    """The sum of every worker's tensor, on `root` (zeros elsewhere). Adjoint: broadcast."""
    return run_exchange(x, redistribution.broadcast(shape, n, root).adjoint(), rank, counter,
                        name)


PRIMITIVES: Dict[str, object] = {
    "allgather": allgather, "reduce_scatter": reduce_scatter, "allreduce": allreduce,
    "all_to_all": all_to_all, "broadcast": broadcast, "sum_reduce": sum_reduce,
}


def whole(tile: tf.Tensor, tiling: Tiling, shape, rank: int, name: str) -> tf.Tensor:
    """The whole variable on every worker, put together from every worker's tile under
    `tiling` (a collective: every worker must run it at the same point)."""
    if tiling.cyclic:  # the tiles in order are the rows in ranges of a permuted table
        ranges = Tiling((Cut(0, tiling.devices),))
        stacked = whole(tile, ranges, shape, rank, name)
        return tf.gather(stacked, cyclic_positions(shape[0], tiling.devices))
    everywhere = Tiling(tuple(Cut(None, c.parts) for c in tiling.cuts))
    return convert(tile, tiling, everywhere, tuple(shape), rank, None, name)


def cyclic_positions(rows: int, n: int) -> tf.Tensor:
    """Where row i of a table whose rows are dealt out over n workers in turn stands in
    the workers' tiles put one after another: worker i % n's tile (the first rows % n
    tiles a row longer) at place i // n."""
    i = tf.range(rows, dtype=tf.int64)
    k = i % n
    return k * (rows // n) + tf.minimum(k, rows % n) + i // n


def tile_of(value: tf.Tensor, tiling: Tiling, shape, rank: int, name: str) -> tf.Tensor:
    """This worker's tile under `tiling` of worker 0's whole `value` (the others' `value`
    is not read; a collective: every worker must run it at the same point)."""
    value = broadcast(value, tuple(shape), tiling.devices, rank, 0, None, name)
    return value[tiling.tile_slices(tuple(shape), rank)]
