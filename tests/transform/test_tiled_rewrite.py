"""get_runner with Config(tiling=...): an ordinary tf.compat.v1.layers MLP, its weights
(and the optimizer's slots) split over real workers by the rewrite, trains equal to
single-device training on the concatenated batch (fp32, rtol 1e-5, atol 1e-6); each
worker holds only its tiles; the split variables fetched whole and the checkpoint (saved,
then restored over one more step) are the single-device model's; the split layers' bytes
are counted; bad plans are refused.
"""
import json
import os

import numpy as np
import pytest
import tensorflow as tf

import tfpar
from examples.split_mlp import initial
from tests.launch import run_worker
from tests.workers.tiled_graph import build

RTOL, ATOL = 1e-5, 1e-6
SIZES = [8, 12, 6]
GLOBAL_BATCH, STEPS = 8, 3


def scenarios(n):
    c, r = ("C", "R") if n == 2 else ("rC", "rR")
    rep = "r" if n == 2 else "rr"
    plans = {
        "columns then rows": {"dense/kernel": c, "dense/bias": r, "dense_1/kernel": r,
                              "dense_1/bias": rep},
        "kernels only": {"dense/kernel": r, "dense_1/kernel": c},
    }
    out = [{"name": f"{label}_{opt}".replace(" ", "_"), "tiling": tiling, "optimizer": opt}
           for label, tiling in plans.items() for opt in ("sgd", "momentum", "adam")]
    # One plan, three routes: an embedding on the parameter servers (HYBRID), split dense
    # weights, and the rest allreduced.
    out += [{"name": f"hybrid_embedding_{opt}", "tiling": plans["columns then rows"],
             "optimizer": opt, "embedding": True} for opt in ("sgd", "adam")]
    # TF1's reference variables (as under disable_v2_behavior).
    out += [{"name": f"reference_variables_{opt}", "tiling": plans["columns then rows"],
             "optimizer": opt, "resource": False} for opt in ("momentum", "adam")]
    return out


def single_device(opt_name, embedding=False, resource=True):
    values, batches = initial(SIZES, GLOBAL_BATCH, STEPS)
    g, x, t, train, opt = build(SIZES, values, opt_name, GLOBAL_BATCH, embedding, resource)
    with tf.compat.v1.Session(graph=g) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for xs, ts in batches:
            sess.run(train, {x: xs, t: ts})
        with g.as_default():
            variables = tf.compat.v1.global_variables()
        return {v.op.name: value for v, value in zip(variables, sess.run(variables))}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"N{n}")
def job(request, tmp_path_factory):
    n = request.param
    spec = {"scenarios": scenarios(n), "sizes": SIZES, "global_batch": GLOBAL_BATCH,
            "steps": STEPS}
    return n, run_worker(n, "tiled_graph.py", spec, tmp_path_factory.mktemp(f"rewrite{n}"),
                         timeout=600)


@pytest.mark.job
def test_split_layers_of_an_ordinary_graph_equal_single_device(job):
    n, out = job
    for sc in scenarios(n):
        ranks = [np.load(os.path.join(out, sc["name"], f"rank{r}.npz")) for r in range(n)]
        expected = single_device(sc["optimizer"], sc.get("embedding", False),
                                 sc.get("resource", True))
        routes = json.loads(str(ranks[0]["__routes"]))
        assert all(routes[name] == "tiled" for name in sc["tiling"])
        if sc.get("embedding"):  # the embedding really is on the parameter servers
            assert routes["embedding"] == "ps"
        split = {k[len("tile/"):] for k in ranks[0].files if k.startswith("tile/")}
        # Every tiled variable and its slots are held as tiles, and only as tiles.
        for name in sc["tiling"]:
            assert name in split, (sc["name"], name)
        for name, value in expected.items():
            if name in split:
                whole = np.full(value.shape, np.nan, np.float32)
                for data in ranks:
                    box = tuple(slice(lo, hi) for lo, hi in data[f"box/{name}"])
                    tile = data[f"tile/{name}"]
                    assert tile.size < value.size or "bias" in name or sc["tiling"].get(
                        name, "C") in ("r", "rr"), (name, "a split variable's tile is smaller")
                    whole[box] = tile
                got = whole
            else:
                got = ranks[0][f"var/{name}"]
            np.testing.assert_allclose(got, value, rtol=RTOL, atol=ATOL,
                                       err_msg=f"{sc['name']}: {name}")
            if name in split:  # fetched whole, on every worker
                for data in ranks:
                    np.testing.assert_array_equal(data[f"whole/{name}"], got)
        # The checkpoint (written, then restored over one more step) is the single-device
        # model's: every variable under its own name and whole shape.
        reader = tf.train.load_checkpoint(os.path.join(out, sc["name"]))
        assert "runner.save(path) on every worker" in str(ranks[0]["__saver_error"])
        assert not any(f.startswith("by_saver") for f in os.listdir(os.path.join(out, sc["name"])))
        assert set(reader.get_variable_to_shape_map()) == set(expected)
        for name, value in expected.items():
            np.testing.assert_allclose(reader.get_tensor(name), value, rtol=RTOL, atol=ATOL,
                                       err_msg=f"{sc['name']}: checkpoint {name}")
        assert float(ranks[0]["__tiled_bytes_per_step"]) > 0


def test_bad_tiling_plans_are_refused_clearly():
    from tfpar.analysis import analyse
    from tfpar.errors import TfparError
    from tfpar.planner import make_plan
    from tfpar.resources import parse_resources
    from tfpar.runner import _with_tiles
    with pytest.raises(TfparError, match="not a tiling"):
        tfpar.Config(tiling={"dense/kernel": "X"})
    values, _ = initial(SIZES, GLOBAL_BATCH, 1)
    g, *_ = build(SIZES, values, "sgd", GLOBAL_BATCH)
    plan = make_plan(analyse(g), tfpar.Config(), parse_resources("localhost:2"))
    for tiling, message in (({"dense/kernel": "RC"}, "for 4 devices; the job has 2"),
                            ({"nope": "C"}, "does not have"),
                            ({"dense_1/kernel": "C3"}, "for 3 devices"),
                            ({"dense/kernel": "P2"}, "splits dimension 2")):
        with pytest.raises(TfparError, match=message):
            _with_tiles(plan, tiling)
    plan3 = make_plan(analyse(g), tfpar.Config(), parse_resources("localhost:3"))
    with pytest.raises(TfparError, match="does not divide"):
        _with_tiles(plan3, {"dense/kernel": "R3", "dense/bias": "r3"})  # 8 rows over 3
