"""The collectives for tiles: exact adjoints (dot-product tests with real processes), the
forward values, and the bytes each conversion moves against the planner's cost model.

Tolerance: fp64 rtol 1e-12, fp32 rtol 1e-5 (both sides sum the same products in another
order). Horovod's own allgather is shown to fail the same test: its registered gradient
averages over workers (a data-parallel convention), a factor N from the adjoint.
"""
import itertools

import numpy as np
import pytest

from tests.support.launch import run_worker
from tfpar.partition.tiling import redistribution
from tfpar.partition.tiling.cuts import RED, Cut, Tiling, convert_cost

SHAPES = {2: (6, 5), 3: (7, 5), 4: (9, 6)}  # uneven splits on purpose
TOL = {"float64": 1e-12, "float32": 1e-5}


def _one(letter, n):
    return letter if n == 2 else f"{letter}{n}"


def cases(n):
    shape = list(SHAPES[n])
    out = []

    def add(**kw):
        for dtype in ("float64", "float32"):
            name = f"c{len(out)}"
            out.append(dict(kw, name=name, shape=kw.get("shape", shape), dtype=dtype,
                            seed=len(out) + 7 * n))

    add(primitive="allgather", dim=0)
    add(primitive="allgather", dim=1)
    add(primitive="reduce_scatter", dim=0)
    add(primitive="reduce_scatter", dim=1)
    add(primitive="allreduce")
    add(primitive="all_to_all", src_dim=0, dst_dim=1)
    add(primitive="all_to_all", src_dim=1, dst_dim=0)
    add(primitive="broadcast", root=n - 1)
    add(primitive="sum_reduce", root=0)
    add(primitive="convert", src=_one("R", n), dst=_one("C", n), shape=[n, 2 * n + 1])
    for src, dst in itertools.product("RCr+", "RCr"):
        add(primitive="convert", src=_one(src, n), dst=_one(dst, n))
    if n == 4:  # hierarchical cuts: sub-groups of 2 inside 2 groups
        pairs = [("RC", "CR"), ("rR", "rr"), ("Rr", "rr"), ("+C", "rC"), ("+r", "rr"),
                 ("R+", "Rr"), ("++", "rr"), ("++", "RC"), ("rC", "Rr"), ("CC", "rR"),
                 ("R", "RC")]
        for src, dst in pairs:
            src_t, dst_t = (Tiling.parse(t) if len(t) == 2 else Tiling.parse(_one(t, n))
                            for t in (src, dst))
            if len(src_t.cuts) == len(dst_t.cuts):
                add(primitive="convert", src=src, dst=dst)
    add(primitive="horovod_allgather")
    return out


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"N{n}")
def job(request, tmp_path_factory):
    n = request.param
    out = run_worker(n, "adjoint.py", cases(n), tmp_path_factory.mktemp(f"adjoint{n}"),
                     timeout=180)
    ranks = [np.load(out / f"rank{r}.npz") for r in range(n)]
    return n, cases(n), ranks


def _dots(case, ranks):
    k = case["name"]
    lhs = sum(float(np.vdot(r[f"{k}/fx"].astype(np.float64), r[f"{k}/y"])) for r in ranks)
    rhs = sum(float(np.vdot(r[f"{k}/x"].astype(np.float64), r[f"{k}/fty"])) for r in ranks)
    scale = sum(float(np.abs(r[f"{k}/fx"]).sum() * np.abs(r[f"{k}/y"]).max()) for r in ranks)
    return lhs, rhs, scale


def test_every_primitive_is_its_adjoints_adjoint(job):
    n, all_cases, ranks = job
    checked = 0
    for case in all_cases:
        if case["primitive"] == "horovod_allgather":
            continue
        lhs, rhs, scale = _dots(case, ranks)
        assert abs(lhs - rhs) <= TOL[case["dtype"]] * scale, (case, lhs, rhs)
        checked += 1
    assert checked == len(all_cases) - 2 >= 40


def test_horovods_allgather_gradient_is_not_the_adjoint(job):
    """Horovod averages the gradient of allgather: <F x, y> = N <x, G y>, not <x, F* y>."""
    n, all_cases, ranks = job
    for case in all_cases:
        if case["primitive"] != "horovod_allgather":
            continue
        lhs, rhs, scale = _dots(case, ranks)
        assert abs(lhs - rhs) > 0.05 * abs(lhs), (lhs, rhs)
        np.testing.assert_allclose(lhs, n * rhs, rtol=1e-4)


def _expected_forward(case, n, rank, whole):
    kind = case["primitive"]
    if kind == "broadcast" or kind == "horovod_allgather":
        return whole
    if kind == "sum_reduce":
        return n * whole if rank == case["root"] else np.zeros_like(whole)
    if kind == "convert":
        src, dst = Tiling.parse(case["src"]), Tiling.parse(case["dst"])
    else:
        one = lambda d: Tiling((Cut(d, n),))  # noqa: E731
        src, dst = {"allgather": (one(case.get("dim", 0)), one(None)),
                    "reduce_scatter": (one(RED), one(case.get("dim", 0))),
                    "allreduce": (one(RED), one(None)),
                    "all_to_all": (one(case.get("src_dim")), one(case.get("dst_dim")))}[kind]
    copies = 1
    for c in src.cuts:
        copies *= c.parts if c.dim == RED else 1  # every partial sum is the whole tile here
    box = dst.tile_ranges(case["shape"], rank)
    return copies * whole[tuple(slice(lo, hi) for lo, hi in box)]


def test_every_primitive_computes_what_it_says(job):
    n, all_cases, ranks = job
    for case in all_cases:
        whole = np.random.default_rng(case["seed"]).standard_normal(case["shape"])
        for r, data in enumerate(ranks):
            np.testing.assert_allclose(
                data[f"{case['name']}/f_tile"], _expected_forward(case, n, r, whole),
                rtol=TOL[case["dtype"]], atol=TOL[case["dtype"]],
                err_msg=f"{case} on worker {r}")


# -- pure: what the exchanges move ---------------------------------------------------------------
