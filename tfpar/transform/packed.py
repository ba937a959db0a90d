"""Several tensors in one Horovod collective, bit for bit.

Each Horovod execution is a round across the job: a negotiation and a pass of the ring,
4-5 ms on the emulated 2 x 2 hosts where a row's bytes take microseconds. Horovod fuses
only tensors of one dtype and one kind of collective, so a sparse gradient's rows
(float32) and its ids (int64 or int32) cost two rounds, and a second table's ids of the
other integer width a third. Here ids ride as the bits of row elements (bitcast, exact)
and each worker's pieces travel behind a header of their sizes, so every allgathered
gradient of a dtype is one allgather (the sharded route's all-to-alls pack the same way).
"""
from __future__ import annotations

from typing import List

import tensorflow as tf

from tfpar.transform import collectives


def per_int64(dtype: tf.DType) -> int:
    """Elements of `dtype` that hold the bits of one int64."""
    return 1 if dtype.size == 8 else 8 // dtype.size


def as_elements(x64: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """int64 values as the bits of `dtype` elements (flat; bitcast, exact)."""
    return x64 if dtype == tf.int64 else tf.reshape(tf.bitcast(x64, dtype), [-1])


def from_elements(e: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """The int64 values whose bits `e` holds (`as_elements` undone)."""
    if dtype == tf.int64:
        return e
    per = per_int64(dtype)
    return tf.reshape(tf.bitcast(tf.reshape(e, [-1, per]) if per > 1 else e, tf.int64), [-1])


def allgather_many(pieces: List[tf.Tensor], n: int, name: str):
    """What `hvd.allgather` returns for each of `pieces` (1-D tensors of one dtype, of any
    length on each worker): every worker's piece in rank order, from one allgather.

    Returns (per piece its gathered tensor, the tensor this worker sent, the gathered one)
    so that a caller can count the bytes."""
    import horovod.tensorflow as hvd
    send = collectives.never_folded(with_sizes(pieces))
    got = hvd.allgather(send, name=name)
    return split_gathered(got, len(pieces), n), send, got


def with_sizes(pieces: List[tf.Tensor]) -> tf.Tensor:
    """One worker's part of `allgather_many`: its pieces' sizes (as int64 bits), then the
    pieces."""
    dtype = pieces[0].dtype
    sizes = tf.stack([tf.size(p, out_type=tf.int64) for p in pieces])
    return tf.concat([as_elements(sizes, dtype)] + list(pieces), 0)


def split_gathered(got: tf.Tensor, count: int, n: int) -> List[tf.Tensor]:
    """`n` workers' `with_sizes` parts end to end, cut back into `count` pieces each, and
    each piece's parts joined in rank order. Each header says where the next worker's
    part begins."""
    per = per_int64(got.dtype)
    out: List[List[tf.Tensor]] = [[] for _ in range(count)]
    at = tf.constant(0, tf.int64)
    for _ in range(n):
        header = from_elements(tf.slice(got, [at], [count * per]), got.dtype)
        body = tf.reduce_sum(header)
        parts = tf.split(tf.slice(got, [at + count * per], [body]), header, num=count)
        for k in range(count):
            out[k].append(parts[k])
        at = at + count * per + body
    return [tf.concat(o, 0) for o in out]
