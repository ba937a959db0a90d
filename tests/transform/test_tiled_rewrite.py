"""Tiling plans that cannot be carried out are refused clearly (bad tilings, configs,
unsplittable layers, post-processing a tile cannot follow), and chains keep activations
split only where nothing else reads them. The rewrite itself, with real workers:
tests/jobs/test_tiled_rewrite.py.
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
from tests.support.workers.tiled_graph import build, model_options

RTOL, ATOL = 1e-5, 1e-6
SIZES = [8, 12, 6]
GLOBAL_BATCH = 8

def test_bad_tiling_plans_are_refused_clearly():
    from tfpar.graph.analysis import analyse
    from tfpar.errors import TfparError
    from tfpar.plan.planner import make_plan
    from tfpar.plan.layout import parse_resources
    from tfpar.runtime.runner import _with_tiles
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


def test_tiling_configs_and_unsplittable_layers_are_refused_clearly(tmp_path):
    from tfpar.graph.analysis import analyse
    from tfpar.errors import NotYetSupportedError, TfparError
    from tfpar.plan.planner import make_plan
    from tfpar.plan.layout import parse_resources
    from tfpar.runtime.runner import _with_tiles
    from tfpar.transform.tiled import predicted_bytes
    with pytest.raises(TfparError, match="neither 'auto' nor a readable plan file"):
        tfpar.Config(tiling=str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TfparError, match="is not the JSON of a tfpar plan"):
        tfpar.Config(tiling=str(tmp_path / "bad.json"))
    with pytest.raises(TfparError, match="tiling_min_bytes must be"):
        tfpar.Config(tiling="auto", tiling_min_bytes=-1)
    values, _ = initial(SIZES, GLOBAL_BATCH, 1)
    g, *_ = build(SIZES, values, "sgd", GLOBAL_BATCH)
    plan = make_plan(analyse(g), tfpar.Config(), parse_resources("localhost:2"))
    with pytest.raises(TfparError, match="splits no variable"):
        tfpar.Config(tiling=plan)
    # A plan (as `tfpar plan --tiling --json` writes it) is taken as its tiled variables.
    split = _with_tiles(plan, {"dense/kernel": "C", "dense_1/kernel": "R"})
    (tmp_path / "plan.json").write_text(split.to_json())
    assert tfpar.Config(tiling=str(tmp_path / "plan.json")).tiling == {
        "dense/kernel": "C", "dense_1/kernel": "R"}
    assert tfpar.Config(tiling=split).tiling == tfpar.Config(
        tiling=str(tmp_path / "plan.json")).tiling
    # A weight read by two matmuls is not a layer the rewrite can split.
    g2 = tf.Graph()
    with g2.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 6])
        w = tf.compat.v1.get_variable("w", [6, 6], use_resource=True)
        loss = tf.reduce_sum(tf.matmul(tf.matmul(x, w), w))
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    plan2 = make_plan(analyse(g2), tfpar.Config(), parse_resources("localhost:2"))
    with pytest.raises(NotYetSupportedError, match="exactly one matmul x @ W, found 2"):
        predicted_bytes(g2, _with_tiles(plan2, {"w": "C"}))
    # A bias split without its weight would be trained by nobody: refused.
    with pytest.raises(NotYetSupportedError, match="'dense/bias': it is not the bias added"):
        predicted_bytes(g, _with_tiles(plan, {"dense/bias": "R", "dense_1/kernel": "C"}))


POST_PROCESSING = {
    "by_norm": lambda dw: tf.clip_by_norm(dw, 0.1),
    "rows": lambda dw: tf.clip_by_norm(dw, 0.1, axes=[1]),
    "sorted": lambda dw: tf.sort(dw, axis=0),
    "masked": lambda dw: dw * tf.constant(np.eye(6, dtype=np.float32)),
}


def _predicted_bytes_with_post_processing(post: str):
    """predicted_bytes of one layer x @ w, w split by columns, whose gradient goes through
    POST_PROCESSING[post] before the update (what get_runner checks first)."""
    from tfpar.graph.analysis import analyse
    from tfpar.plan.planner import make_plan
    from tfpar.plan.layout import parse_resources
    from tfpar.runtime.runner import _with_tiles
    from tfpar.transform.tiled import predicted_bytes
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 6])
        w = tf.compat.v1.get_variable("w", [6, 6], use_resource=True)
        loss = tf.reduce_sum(tf.square(tf.matmul(x, w)))
        opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)
        opt.apply_gradients([(POST_PROCESSING[post](dw), v)
                             for dw, v in opt.compute_gradients(loss)])
    plan = make_plan(analyse(g), tfpar.Config(), parse_resources("localhost:2"))
    return predicted_bytes(g, _with_tiles(plan, {"w": "C"}))


@pytest.mark.parametrize("post,error", [
    ("rows", "goes through Sum .* are followed on tiles"),
    ("sorted", "goes through .*sort.* are followed on tiles"),
    ("masked", "also reads .* of shape \\(6, 6\\); only scalars")])
def test_post_processing_a_tile_cannot_follow_is_refused_clearly(post, error):
    """Clipping each row by its own norm (a sum over some axes), an op that needs the whole
    gradient (a sort) or an operand of the gradient's shape (a mask) is refused at
    get_runner, naming the op; clip_by_norm over the whole gradient is followed (a sum
    over every axis: accepted)."""
    from tfpar.errors import NotYetSupportedError
    with pytest.raises(NotYetSupportedError, match=error):
        _predicted_bytes_with_post_processing(post)
    assert set(_predicted_bytes_with_post_processing("by_norm")) == {"w"}


def test_chains_keep_activations_split_only_where_nothing_else_reads_them():
    """Two split layers with an activation between them form a chain (the activation's
    exchange disappears from the predicted bytes); a bias left whole between them, or a
    second reader of the activation (an activity penalty in the loss), breaks it."""
    from tfpar.graph.analysis import analyse
    from tfpar.plan.planner import make_plan
    from tfpar.plan.layout import parse_resources
    from tfpar.runtime.runner import _with_tiles
    from tfpar.transform.tiled import chains, layer_bytes, predicted_bytes
    from tfpar.partition.tiling.cuts import Tiling
    from tfpar.transform import tiles
    values, _ = initial(SIZES, GLOBAL_BATCH, 1)
    g, *_ = build(SIZES, values, "adam", GLOBAL_BATCH // 2)  # a worker's rows
    plan = make_plan(analyse(g), tfpar.Config(), parse_resources("localhost:2"))
    megatron = _with_tiles(plan, {"dense/kernel": "C", "dense/bias": "R", "dense_1/kernel": "R"})
    assert chains(g, megatron) == [["dense/kernel", "dense_1/kernel"]]
    got = predicted_bytes(g, megatron)
    # Alone, each layer converts from and to the batch split; chained, the columns the
    # first makes are the columns the second reads: no exchange between them.
    c, r = Tiling.parse("C"), Tiling.parse("R")
    alone = layer_bytes(r, (12, 6), GLOBAL_BATCH)
    assert got["dense_1/kernel"] == layer_bytes(r, (12, 6), GLOBAL_BATCH,
                                                x_from=tiles.forms(r)[0]) < alone
    assert got["dense/kernel"] == layer_bytes(c, (8, 12), GLOBAL_BATCH, Tiling.parse("R"),
                                              False, y_to=tiles.forms(r)[0])
    # The first layer's bias left whole: added by the user's op, in the batch split.
    no_bias = _with_tiles(plan, {"dense/kernel": "C", "dense_1/kernel": "R"})
    assert sorted(chains(g, no_bias)) == [["dense/kernel"], ["dense_1/kernel"]]
    assert predicted_bytes(g, no_bias)["dense_1/kernel"] == alone
    # The activation read by the loss as well (an activity penalty): no chain.
    g2 = tf.Graph()
    with g2.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [GLOBAL_BATCH // 2, 8])
        h = tf.compat.v1.layers.dense(x, 12, activation=tf.nn.relu)
        y = tf.compat.v1.layers.dense(h, 6)
        loss = tf.reduce_mean(tf.square(y)) + 0.01 * tf.reduce_mean(tf.square(h))
        tf.compat.v1.train.AdamOptimizer(0.1).minimize(loss)
    plan2 = make_plan(analyse(g2), tfpar.Config(), parse_resources("localhost:2"))
    split2 = _with_tiles(plan2, {"dense/kernel": "C", "dense/bias": "R", "dense_1/kernel": "R"})
    assert sorted(chains(g2, split2)) == [["dense/kernel"], ["dense_1/kernel"]]
