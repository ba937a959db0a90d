"""An MLP (or a language model's output layer) whose weights are split over the workers,
written directly with tfpar's tile layers (`tfpar.transform.tiles`).

This is what the model-parallel rewrite will produce from an ordinary graph; until that
rewrite exists it is how a plan's splits are executed, tested and benchmarked. Each worker
holds only its tile of every weight and bias (and the optimizer's slots of those tiles);
its batch is its own rows of the global batch.

A plan: {"weights": {"W1": "C", "W2": "R", ...}, "activations": {"h1": "C", ...,
"logits": "C"}, "loss": "squares" | "softmax", "optimizer": "sgd" | "momentum" | "adam"}
with tilings as `tfpar.partition.tiling.cuts.Tiling.parse` reads them.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

import numpy as np
import tensorflow as tf

from tfpar.partition.tiling.cuts import Tiling
from tfpar.transform import tiles

tf1 = tf.compat.v1


def initial(sizes, global_batch, steps, seed=3):
    """The whole model's initial values and `steps` global batches (x, targets)."""
    rng = np.random.default_rng(seed)
    values = {}
    for i in range(len(sizes) - 1):
        values[f"W{i + 1}"] = (rng.standard_normal((sizes[i], sizes[i + 1])) / np.sqrt(sizes[i])
                               ).astype(np.float32)
        values[f"b{i + 1}"] = (0.1 * rng.standard_normal(sizes[i + 1])).astype(np.float32)
    batches = [(rng.standard_normal((global_batch, sizes[0])).astype(np.float32),
                rng.standard_normal((global_batch, sizes[-1])).astype(np.float32))
               for _ in range(steps)]
    return values, batches


def optimizer(name):
    return {"sgd": lambda: tf1.train.GradientDescentOptimizer(0.1),
            "momentum": lambda: tf1.train.MomentumOptimizer(0.1, 0.9),
            "adam": lambda: tf1.train.AdamOptimizer(0.01)}[name]()


SLOTS = {"sgd": [], "momentum": ["momentum"], "adam": ["m", "v"]}


@dataclasses.dataclass
class SplitModel:
    graph: tf.Graph
    x: tf.Tensor  # this worker's rows of the input
    targets: tf.Tensor
    loss: tf.Tensor
    train: tf.Operation
    optimizer: object
    variables: Dict[str, Tuple[tf.Variable, Tiling, Tuple[int, ...]]]
    received: tf.Variable  # bytes the tiles' collectives received, as Horovod reports them
    predicted_per_step: float  # the same, as the plan's exchanges predict it

    def state(self, sess) -> Dict[str, np.ndarray]:
        """Every variable's and slot's tile on this worker."""
        out = {}
        for name, (v, _, _) in self.variables.items():
            out[name] = sess.run(v)
            for s in self.optimizer.get_slot_names():
                out[f"{name}/{s}"] = sess.run(self.optimizer.get_slot(v, s))
        return out

    def tile_bytes(self) -> int:
        """Bytes of this worker's weights and their slots."""
        per_var = 1 + len(self.optimizer.get_slot_names())
        return sum(int(np.prod(v.shape.as_list())) * 4 * per_var
                   for v, _, _ in self.variables.values())


def tiling_of(plan, name: str, sizes: List[int]) -> Tiling:
    """The tiling of variable W<i> or b<i> under `plan`."""
    if name.startswith("W"):
        return Tiling.parse(plan["weights"][name])
    return tiles.bias_tiling(output_tiling(plan, int(name[1:]), len(sizes) - 1))


def output_tiling(plan, layer: int, layers: int) -> Tiling:
    if layer < layers:
        return Tiling.parse(plan["activations"][f"h{layer}"])
    if plan.get("loss") == "softmax":
        return Tiling.parse(plan["activations"]["logits"])
    return batch_tiling(plan)


def batch_tiling(plan) -> Tiling:
    return tiles.batch_split([c.parts for c in Tiling.parse(plan["weights"]["W1"]).cuts])


def build(plan, sizes, global_batch, rank, n, values) -> SplitModel:
    """The split model's graph on worker `rank` of `n`, starting from `values` (whole)."""
    layers = len(sizes) - 1
    b = global_batch // n
    predicted = [0.0]
    g = tf.Graph()
    with g.as_default():
        with tf1.variable_scope("tfpar_traffic"):
            received = tf1.get_local_variable("received", [], tf.float64,
                                              initializer=tf1.zeros_initializer())

        def count(arrived, expected):
            predicted[0] += expected
            return received.assign_add(arrived, read_value=False)

        x = tf1.placeholder(tf.float32, [b, sizes[0]], name="x")
        t = tf1.placeholder(tf.float32, [b, sizes[-1]], name="targets")
        h, h_tiling = x, batch_tiling(plan)
        variables = {}
        for i in range(1, layers + 1):
            y_t = output_tiling(plan, i, layers)
            for name, shape in ((f"W{i}", (sizes[i - 1], sizes[i])), (f"b{i}", (sizes[i],))):
                tiling = tiling_of(plan, name, sizes)
                box = tuple(slice(lo, hi) for lo, hi in tiling.tile_ranges(shape, rank))
                v = tf1.get_variable(name, initializer=values[name][box])
                variables[name] = (v, tiling, shape)
            # One parameter held as tiles: its gradient is the sum over the workers' batches
            # (exact adjoints), divided by n for the mean loss each worker computes.
            w, w_t, w_shape = variables[f"W{i}"]
            bias, b_t, b_shape = variables[f"b{i}"]
            h = tiles.dense(
                h, h_tiling, global_batch,
                tiles.replicated(w, w_t, w_shape, rank, 1.0 / n, count, f"W{i}_param"),
                w_t, w_shape, y_t, rank,
                tiles.replicated(bias, b_t, b_shape, rank, 1.0 / n, count, f"b{i}_param"),
                b_t, count, name=f"layer{i}")
            h_tiling = y_t
            if i < layers:
                h = tf.nn.relu(h)
        if plan.get("loss") == "softmax":  # logits split over the vocabulary
            labels = tf.argmax(t, axis=1)
            loss = tf.reduce_mean(tiles.softmax_cross_entropy(
                h, h_tiling, global_batch, sizes[-1], labels, batch_tiling(plan), rank, count))
        else:
            loss = 0.5 * tf.reduce_mean(tf.reduce_sum(tf.square(h - t), axis=1))
        opt = optimizer(plan["optimizer"])
        train = opt.minimize(loss)
    return SplitModel(g, x, t, loss, train, opt, variables, received, predicted[0])


def single_device(sizes, values, loss_name: str, opt_name: str, batch=None):
    """The same model as one device trains it (whole weights, ordinary ops): (graph, x,
    targets, train op, optimizer, {name: variable}); `batch`: a static batch size (the
    tiled rewrite needs one)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [batch, sizes[0]], name="x")
        t = tf1.placeholder(tf.float32, [batch, sizes[-1]], name="targets")
        h, variables = x, {}
        for i in range(1, len(sizes)):
            for name in (f"W{i}", f"b{i}"):
                variables[name] = tf1.get_variable(name, initializer=values[name])
            h = tf.matmul(h, variables[f"W{i}"]) + variables[f"b{i}"]
            if i < len(sizes) - 1:
                h = tf.nn.relu(h)
        if loss_name == "softmax":
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=tf.argmax(t, axis=1), logits=h))
        else:
            loss = 0.5 * tf.reduce_mean(tf.reduce_sum(tf.square(h - t), axis=1))
        opt = optimizer(opt_name)
        train = opt.minimize(loss)
    return g, x, t, train, opt, variables
