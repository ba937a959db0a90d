"""get_runner with Config(tiling=...): an ordinary tf.compat.v1.layers MLP, its weights
(and the optimizer's slots) split over real workers by the rewrite, trains equal to
single-device training on the concatenated batch (fp32, rtol 1e-5, atol 1e-6); each
worker holds only its tiles; the user's assignment of a split kernel writes every worker's
tile; the split variables fetched whole and the checkpoint (saved,
then restored over one more step) are the single-device model's; the split layers' bytes
are counted; bad plans are refused. Every scenario runs on 2 workers, and one optimizer
of each family of them on 4 (`on_workers`).
"""
import contextlib
import io
import json
import os

import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar import cli
from examples.split_mlp import initial
from tests.support.launch import run_worker
from tests.support.workers.tiled_graph import ASSIGN, assigned_value, build, model_options

RTOL, ATOL = 1e-5, 1e-6
SIZES = [8, 12, 6]
WIDE = [8, 64, 6]
LM = [8, 12, 16]  # the last layer over a vocabulary of 16 words
BLOCK = [8, 16, 8]  # a feed-forward block: output as wide as the input
CLIP = 0.3  # below the gradients' global norm, so clipping acts
CLIP_EACH = 0.1  # below every weight's own gradient norm at every step, so clip_by_norm acts
GLOBAL_BATCH, STEPS = 8, 3


def scenarios(n, plan_file):
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
    # The user's own assignment of a split kernel before training (pretrained weights
    # through a placeholder): every worker writes its tile (reference variables: the
    # same code, in test_fetches' TF1 job).
    out += [{"name": "assigned_adam", "tiling": plans["columns then rows"],
             "optimizer": "adam", "assigned": True}]
    # A language model's output layer split over its vocabulary: the loss from split
    # logits (the split softmax), the hidden layer allreduced.
    vocab = {"dense_1/kernel": "C", "dense_1/bias": "R"} if n == 2 else \
        {"dense_1/kernel": "CC", "dense_1/bias": "RR"}
    out += [{"name": f"lm_output_{opt}", "tiling": vocab, "optimizer": opt, "lm": True,
             "sizes": LM} for opt in ("sgd", "adam")]
    # Gradients clipped by their global norm (the NMT tutorial's way): split tiles and
    # whole variables share one norm.
    out += [{"name": f"clipped_{opt}", "tiling": plans["columns then rows"], "optimizer": opt,
             "clip": CLIP} for opt in ("sgd", "adam")]
    out += [{"name": "clipped_lm_output_adam", "tiling": vocab, "optimizer": "adam",
             "lm": True, "sizes": LM, "clip": CLIP}]
    # Scaled before the global norm (its terms are the scaled tiles'); each gradient
    # clipped by its own norm (tf.clip_by_norm: the tiles' squared sums summed).
    out += [{"name": "scaled_clipped_momentum", "tiling": plans["columns then rows"],
             "optimizer": "momentum", "clip": CLIP, "post": "scaled"}]
    out += [{"name": f"clipped_by_norm_{opt}", "tiling": plans["columns then rows"],
             "optimizer": opt, "clip": CLIP_EACH, "post": "by_norm"} for opt in ("sgd", "adam")]
    out += [{"name": "clipped_by_norm_lm_output_sgd", "tiling": vocab, "optimizer": "sgd",
             "lm": True, "sizes": LM, "clip": CLIP_EACH, "post": "by_norm"}]
    # Chains: the hidden activation stays split between two split layers (columns then
    # rows: no exchange between them; a hidden layer then an LM's output layer: gathered
    # once); GELU's ops (scalar constants, the activation read twice) run on tiles too.
    out += [{"name": "lm_chain_adam", "tiling": {**plans["columns then rows"], **vocab},
             "optimizer": "adam", "lm": True, "sizes": LM}]
    # An NMT-style projection over sequences ([batch, 2, hidden] through tensordot): the
    # split softmax reads the logits [batch, 2, vocab] regrouped; the hidden layer (3-D
    # too) split beside it, each from and to the batch split.
    out += [{"name": f"seq_lm_output_{opt}", "tiling": {**plans["columns then rows"], **vocab}
             if opt == "adam" else vocab, "optimizer": opt, "lm": True, "sizes": LM,
             "seq": True} for opt in ("sgd", "adam")]
    out += [{"name": "gelu_chain_momentum", "tiling": plans["columns then rows"],
             "optimizer": "momentum", "activation": "gelu"}]
    # A Transformer's feed-forward block: a residual connection around the chain (it
    # starts and ends in the batch split, where the input is added); with the hidden
    # activation also read by the loss, the two layers do not chain (each from and to
    # the batch split).
    out += [{"name": f"ffn_{block}_adam", "tiling": plans["columns then rows"],
             "optimizer": "adam", "sizes": BLOCK, "block": block}
            for block in ("residual", "residual_penalty")]
    # The tiling planner's own plan, as `tfpar plan --tiling --json` wrote it, and "auto"
    # (the planner in the job; every weight considered).
    out += [{"name": f"planner_json_{opt}", "tiling": plan_file, "optimizer": opt}
            for opt in ("sgd", "adam")]
    # Below the default threshold nothing is split (the plan says why); above it a wide
    # first layer is.
    out += [{"name": "auto_threshold_momentum", "tiling": "auto", "optimizer": "momentum"}]
    out += [{"name": f"auto_wide_{opt}", "tiling": "auto", "tiling_min_bytes": 0,
             "optimizer": opt, "sizes": WIDE} for opt in ("sgd", "adam")]
    return out


def planner_json(n, folder) -> str:
    """The plan `tfpar plan --tiling --json` prints for the graph one worker builds."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["plan", "tests/support/workers/tiled_graph.py:graph_for_plan", "--tiling",
                       "--resources", f"localhost:{n}", "--json"])
    assert rc == 0
    path = os.path.join(folder, "plan.json")
    with open(path, "w") as f:
        f.write(out.getvalue())
    return path


def single_device(sc: dict) -> dict:
    """The scenario's variables after STEPS steps on one device, on the global batch."""
    sizes = sc.get("sizes", SIZES)
    values, batches = initial(sizes, GLOBAL_BATCH, STEPS)
    g, x, t, train, opt = build(sizes, values, sc["optimizer"], GLOBAL_BATCH,
                                **model_options(sc))
    with tf.compat.v1.Session(graph=g) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        if sc.get("assigned"):
            sess.run(ASSIGN, {"new_kernel:0": assigned_value(values)})
        for xs, ts in batches:
            sess.run(train, {x: xs, t: ts})
        with g.as_default():
            variables = tf.compat.v1.global_variables()
        return {v.op.name: value for v, value in zip(variables, sess.run(variables))}


BATCHES = {2: 2, 4: 1}  # jobs per worker count: each well under ~3 minutes on a loaded
# 2-core machine


def _batches():
    return [(n, k) for n in (2, 4) for k in range(BATCHES[n])]


def on_workers(n, cases):
    """Every scenario on 2 workers; on 4, one optimizer of each family of scenarios (its
    adam one where it has one): a tile's slots are split as its variable is on any N, so
    the other optimizers add nothing there but time (4 workers on 2 cores)."""
    if n == 2:
        return cases
    families = {}
    for sc in cases:
        family = sc["name"].rsplit("_", 1)[0] if sc["name"].endswith(
            ("_sgd", "_momentum", "_adam")) else sc["name"]
        families.setdefault(family, []).append(sc)
    return [next((sc for sc in group if sc["optimizer"] == "adam"), group[0])
            for group in families.values()]


@pytest.fixture(scope="module", params=_batches(), ids=lambda p: f"N{p[0]}_batch{p[1]}")
def job(request, tmp_path_factory):
    n, k = request.param
    folder = tmp_path_factory.mktemp(f"rewrite{n}_{k}")
    cases = on_workers(n, scenarios(n, planner_json(n, str(folder))))[k::BATCHES[n]]
    spec = {"scenarios": cases, "sizes": SIZES, "global_batch": GLOBAL_BATCH, "steps": STEPS}
    return n, cases, run_worker(n, "tiled_graph.py", spec, folder, timeout=420)


def test_split_layers_of_an_ordinary_graph_equal_single_device(job):
    n, cases, out = job
    auto_split = set()
    for sc in cases:
        ranks = [np.load(os.path.join(out, sc["name"], f"rank{r}.npz")) for r in range(n)]
        expected = single_device(sc)
        if sc.get("post") == "by_norm":  # the clip acted: not what unclipped training gives
            unclipped = single_device({k: v for k, v in sc.items() if k not in
                                       ("clip", "post")})
            assert not np.allclose(expected["dense_1/kernel"], unclipped["dense_1/kernel"])
        routes = json.loads(str(ranks[0]["__routes"]))
        plan = tfpar.Plan.from_json(str(ranks[0]["__plan"]))
        if sc["tiling"] == "auto":
            asked = {v.name: str(v.tiling) for v in plan.variables
                     if v.route == "tiled" and v.slot_of is None}
            auto_split |= set(asked)
        elif isinstance(sc["tiling"], str):  # the planner's JSON
            with open(sc["tiling"]) as f:
                asked = {v.name: str(v.tiling) for v in tfpar.Plan.from_json(f.read()).variables
                         if v.route == "tiled" and v.slot_of is None}
        else:
            asked = sc["tiling"]
        assert all(routes[name] == "tiled" for name in asked)
        for name in asked:  # the runtime plan shows each split weight's tiles
            assert f"  {name} {asked[name]}: w0[" in str(ranks[0]["__plan_table"])
        # Bytes the split layers moved (mean over workers) == what the plan predicted.
        predicted = sum(v.predicted_bytes for v in plan.variables
                        if v.route == "tiled" and v.predicted_bytes is not None)
        measured = np.mean([float(r["__tiled_bytes_per_step"]) for r in ranks])
        assert abs(measured - predicted) <= 0.05 * predicted, (sc["name"], measured, predicted)
        if sc.get("lm"):  # no worker computed whole logits: the user's ops did not run
            for r in ranks:
                ran = set(r["__ran"].tolist())
                assert not [op for op in ran if op.startswith("dense_1/")
                            and op.rsplit("/", 1)[-1] in ("MatMul", "BiasAdd")]
                assert not any(op.rsplit("/", 1)[-1] == "SparseSoftmaxCrossEntropyWithLogits"
                               for op in ran)  # (its scope's label reshape does run)
                assert any(op.startswith("tfpar/tiled/dense_1_kernel/split_softmax")
                           for op in ran)
        # A chain keeps the hidden activation split: the user's activation ops did not
        # run, their copies on tiles did, and the plan says so.
        chained = "dense/kernel" in asked and "dense_1/kernel" in asked and \
            "dense/bias" in asked and not sc.get("seq") and \
            sc.get("block") != "residual_penalty"  # (tensordot's Reshape; a 2nd reader)
        ran = set(ranks[0]["__ran"].tolist())
        activation = "Relu" if sc.get("activation", "relu") == "relu" else "Erf"
        assert (f"dense/{activation}" in ran) != chained, sc["name"]
        assert any(op.startswith("tfpar/tiled/dense_kernel/then/") and op.endswith(activation)
                   for op in ran) == chained, sc["name"]
        assert any("dense/kernel -> dense_1/kernel" in note for note in plan.notes) == chained
        if sc["name"] == "auto_threshold_momentum":  # kept, and the plan says why
            assert not asked and predicted == measured == 0
            assert any("below tiling_min_bytes" in note for note in plan.notes)
        else:
            assert predicted > 0
        if sc.get("embedding"):  # the embedding really is on the parameter servers
            assert routes["embedding"] == "ps"
        split = {k[len("tile/"):] for k in ranks[0].files if k.startswith("tile/")}
        # Every tiled variable and its slots are held as tiles, and only as tiles.
        for name in asked:
            assert name in split, (sc["name"], name)
        for name, value in expected.items():
            if name in split:
                whole = np.full(value.shape, np.nan, np.float32)
                for data in ranks:
                    box = tuple(slice(*b) for b in data[f"box/{name}"])
                    tile = data[f"tile/{name}"]
                    assert tile.size < value.size or "bias" in name or asked.get(
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
        by_saver = any(f.startswith("by_saver") for f in os.listdir(os.path.join(out, sc["name"])))
        if asked:  # the user's Saver cannot save tiles: a clear error, nothing written
            assert "runner.save(path) on every worker" in str(ranks[0]["__saver_error"])
            assert not by_saver
        else:
            assert str(ranks[0]["__saver_error"]) == "" and by_saver
        assert set(reader.get_variable_to_shape_map()) == set(expected)
        for name, value in expected.items():
            np.testing.assert_allclose(reader.get_tensor(name), value, rtol=RTOL, atol=ATOL,
                                       err_msg=f"{sc['name']}: checkpoint {name}")
    if any(sc["name"].startswith("auto_wide") for sc in cases):
        assert "dense/kernel" in auto_split, "tiling='auto' did not split the wide layer"
