"""A horovodrun worker for the collectives' dot-product (adjoint) tests.

usage: adjoint.py CASES_JSON OUT_DIR. Each case names a primitive of
tfpar.transform.collectives (or "convert" between two tilings, or "horovod_allgather",
Horovod's own op with its registered gradient) with a shape and dtype. Per case this
worker applies F to a random tile x and takes F* y through tf.gradients (grad_ys=y); it
saves x, F x, y, F* y, and F applied to its tile of a known whole tensor, for the test to
check <F x, y> = <x, F* y> summed over the workers, and the forward values.
"""
import json
import os
import sys

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd

from tfpar.partition.tiling import redistribution
from tfpar.partition.tiling.cuts import Cut, Tiling, RED
from tfpar.transform import collectives

tf.compat.v1.disable_eager_execution()


def tilings(case, n):
    """(input tiling, output tiling) of a case, for the shapes of its tiles."""
    kind = case["primitive"]
    one = lambda dim: Tiling((Cut(dim, n),))  # noqa: E731
    if kind == "convert":
        return Tiling.parse(case["src"]), Tiling.parse(case["dst"])
    dim = case.get("dim", 0)
    return {"allgather": (one(dim), one(None)), "reduce_scatter": (one(RED), one(dim)),
            "allreduce": (one(RED), one(None)),
            "all_to_all": (one(case.get("src_dim", 0)), one(case.get("dst_dim", 1))),
            "broadcast": (one(None), one(None)), "sum_reduce": (one(None), one(None)),
            "horovod_allgather": (one(0), one(None))}[kind]


def build(case, x, n, rank):
    kind, shape = case["primitive"], case["shape"]
    if kind == "convert":
        src, dst = tilings(case, n)
        return collectives.convert(x, src, dst, shape, rank, name=case["name"])
    if kind == "horovod_allgather":
        return hvd.allgather(x, name=case["name"])
    kwargs = {k: case[k] for k in ("dim", "root", "src_dim", "dst_dim") if k in case}
    return collectives.PRIMITIVES[kind](x, shape, n, rank, name=case["name"], **kwargs)


def main(cases_path, out_dir):
    hvd.init()
    n, rank = hvd.size(), hvd.rank()
    with open(cases_path) as f:
        cases = json.load(f)
    g = tf.Graph()
    fetch = {}
    feeds = {}
    with g.as_default():
        for case in cases:
            dtype = np.dtype(case["dtype"])
            src, dst = tilings(case, n)
            in_shape = redistribution.tile_shape(src, case["shape"], rank)
            out_shape = redistribution.tile_shape(dst, case["shape"], rank)
            rng = np.random.default_rng([case["seed"], rank])
            whole = np.random.default_rng(case["seed"]).standard_normal(case["shape"])
            box = src.tile_ranges(case["shape"], rank)
            values = {
                "x": rng.standard_normal(in_shape).astype(dtype),
                "y": rng.standard_normal(out_shape).astype(dtype),
                "tile": whole[tuple(slice(lo, hi) for lo, hi in box)].astype(dtype),
            }
            ph = {k: tf.compat.v1.placeholder(dtype, v.shape, name=f"{case['name']}_{k}")
                  for k, v in values.items()}
            fx = build(case, ph["x"], n, rank)
            (fty,) = tf.gradients(fx, ph["x"], grad_ys=ph["y"])
            with tf.compat.v1.name_scope(case["name"] + "_whole"):
                f_tile = build(dict(case, name=case["name"] + "_tile"), ph["tile"], n, rank)
            fetch[case["name"]] = {"fx": fx, "fty": fty, "f_tile": f_tile}
            for k, v in values.items():
                feeds[ph[k]] = v
            fetch[case["name"]].update({k: tf.constant(v) for k, v in values.items()})
        with tf.compat.v1.Session(graph=g) as sess:
            out = sess.run(fetch, feed_dict=feeds)
    flat = {f"{name}/{k}": v for name, d in out.items() for k, v in d.items()}
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **flat)


if __name__ == "__main__":
    main(*sys.argv[1:])
