"""Training an MLP, and a language model's output layer with its softmax cross-entropy on
logits split over the vocabulary, with weights split over real workers equals
single-device training.

Each plan gives every weight a tiling (row, column, replicated, hybrid 2 x 2, and the
tiling planner's own plan for the MLP); after 3
steps every variable and optimizer slot, put back together from the workers' tiles,
equals single-device training on the concatenated batch (fp32, rtol 1e-5, atol 1e-6), and
replicas of a tile are identical on every worker that holds one.
"""
import os

import numpy as np
import pytest
import tensorflow as tf

from tests.support.launch import run_worker
from examples import split_mlp
from examples.split_mlp import SLOTS, initial, tiling_of
from tfpar.partition.tiling.dataflow import mlp
from tfpar.partition.tiling.planner import plan_tiling

RTOL, ATOL = 1e-5, 1e-6
SIZES = [8, 12, 6]  # input, hidden, output: divisible by 2 and 4
STEPS = 3


def plans(n):
    """Hand-written plans: (weights' tilings, the hidden activation's tiling)."""
    if n == 2:
        shapes = {"column then row (Megatron)": ("C", "R", "C"),
                  "row then column": ("R", "C", "R"),
                  "replicated (data parallel)": ("r", "r", "R"),
                  "column then replicated": ("C", "r", "R")}
    else:
        shapes = {"hybrid 2x2": ("rC", "rR", "RC"),
                  "column over 4": ("C4", "R4", "C4"),
                  "rows outside, columns inside": ("Cr", "rC", "RR")}
    # The output layer of a language model: logits split over the vocabulary (columns).
    softmax = ({"LM output layer, vocabulary split": ("r", "C", "R", "C")} if n == 2 else
               {"LM output layer, vocabulary split": ("rr", "CC", "RR", "CC"),
                "LM output layer, hybrid": ("rr", "rC", "RR", "RC")})
    # The tiling planner's own plan for this MLP and N (weights and activations).
    planned = plan_tiling(mlp(8, SIZES, bias=True), n).tilings
    shapes["planner's own plan"] = (str(planned["W1"]), str(planned["W2"]), str(planned["x1"]))
    out = []
    for loss, table in (("squares", shapes), ("softmax", softmax)):
        for label, (w1, w2, h1, *logits) in table.items():
            for opt in ("sgd", "momentum", "adam"):
                name = f"{label} {opt}"
                for ch in ",()'":
                    name = name.replace(ch, "")
                out.append({"name": name.replace(" ", "_"), "optimizer": opt, "loss": loss,
                            "weights": {"W1": w1, "W2": w2},
                            "activations": {"h1": h1, "logits": (logits or ["-"])[0]}})
    return out


def spec(n):
    return {"sizes": SIZES, "steps": STEPS, "global_batch": 8, "plans": plans(n)}


def single_device(sp, opt_name, loss_name):
    values, batches = initial(SIZES, sp["global_batch"], STEPS)
    g, x, t, train, opt, variables = split_mlp.single_device(SIZES, values, loss_name, opt_name)
    with tf.compat.v1.Session(graph=g) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for xs, ts in batches:
            sess.run(train, {x: xs, t: ts})
        out = {}
        for name, v in variables.items():
            out[name] = sess.run(v)
            for s in SLOTS[opt_name]:
                out[f"{name}/{s}"] = sess.run(opt.get_slot(v, s))
        return out, values


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"N{n}")
def job(request, tmp_path_factory):
    n = request.param
    return n, run_worker(n, "tiled_mlp.py", spec(n), tmp_path_factory.mktemp(f"tiled{n}"),
                         timeout=400)


def assemble(tiles_by_rank, tiling, shape, name):
    whole = np.full(shape, np.nan, np.float32)
    for r, tile in enumerate(tiles_by_rank):
        box = tuple(slice(lo, hi) for lo, hi in tiling.tile_ranges(shape, r))
        if not np.isnan(whole[box]).any():  # a replica: it must equal the first holder's
            np.testing.assert_array_equal(tile, whole[box], err_msg=f"{name}: replica {r}")
        whole[box] = tile
    assert not np.isnan(whole).any(), name
    return whole


def test_split_mlp_equals_single_device(job):
    n, out = job
    sp = spec(n)
    for plan in sp["plans"]:
        ranks = [np.load(os.path.join(out, plan["name"], f"rank{r}.npz")) for r in range(n)]
        expected, init = single_device(sp, plan["optimizer"], plan["loss"])
        for name, value in expected.items():
            var = name.split("/")[0]
            got = assemble([r[name] for r in ranks], tiling_of(plan, var, SIZES), value.shape,
                           name)
            np.testing.assert_allclose(got, value, rtol=RTOL, atol=ATOL,
                                       err_msg=f"{plan['name']}: {name}")
        assert not np.allclose(expected["W1"], init["W1"])  # training moved the weights


def test_bytes_moved_are_the_exchanges_prediction(job):
    """What Horovod reports arriving per step equals what the plan's exchanges predict
    (exactly: both count the same pieces), and split plans do move bytes."""
    n, out = job
    for plan in spec(n)["plans"]:
        ranks = [np.load(os.path.join(out, plan["name"], f"rank{r}.npz")) for r in range(n)]
        for r, data in enumerate(ranks):
            assert float(data["__bytes_received_per_step"]) == pytest.approx(
                float(data["__bytes_predicted_per_step"]), rel=1e-9), (plan["name"], r)
        assert sum(float(d["__bytes_received_per_step"]) for d in ranks) > 0, plan["name"]
