"""A horovodrun worker that trains an MLP whose layers are split over the workers.

usage: tiled_mlp.py SPEC_JSON OUT_DIR. SPEC: {"plans": [{"name", "optimizer", "weights":
{"W1": tiling, ...}, "activations": {"h1": tiling, ..., "logits": tiling}, "loss":
"squares" | "softmax"}], "steps", "global_batch", "sizes"}. Each worker holds only its tile of every weight (`tfpar.transform.tiles`) and
the optimizer's slots of that tile; its batch is rows [rank*B, (rank+1)*B) of the global
batch. It saves every variable's and slot's tile after the steps, and the bytes its
collectives received per step (as Horovod reported them, and as the exchanges predict),
for tests/transform/test_tiles.py.
"""
import json
import os
import sys

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd

from tfpar.partition.tiling import redistribution
from tfpar.partition.tiling.cuts import Tiling
from tfpar.transform import tiles

tf.compat.v1.disable_eager_execution()
tf1 = tf.compat.v1


def initial(spec):
    """The whole model's initial values and the global batches (same on every worker)."""
    sizes = spec["sizes"]
    rng = np.random.default_rng(3)
    values = {}
    for i in range(len(sizes) - 1):
        values[f"W{i + 1}"] = (rng.standard_normal((sizes[i], sizes[i + 1])) / np.sqrt(sizes[i])
                               ).astype(np.float32)
        values[f"b{i + 1}"] = (0.1 * rng.standard_normal(sizes[i + 1])).astype(np.float32)
    batches = [(rng.standard_normal((spec["global_batch"], sizes[0])).astype(np.float32),
                rng.standard_normal((spec["global_batch"], sizes[-1])).astype(np.float32))
               for _ in range(spec["steps"])]
    return values, batches


def optimizer(name):
    return {"sgd": lambda: tf1.train.GradientDescentOptimizer(0.1),
            "momentum": lambda: tf1.train.MomentumOptimizer(0.1, 0.9),
            "adam": lambda: tf1.train.AdamOptimizer(0.01)}[name]()


def slot_names(name):
    return {"sgd": [], "momentum": ["momentum"], "adam": ["m", "v"]}[name]


def run_plan(spec, plan, rank, n, out_dir):
    values, batches = initial(spec)
    sizes = spec["sizes"]
    layers = len(sizes) - 1
    b = spec["global_batch"] // n
    predicted = [0]
    softmax = plan.get("loss") == "softmax"
    measured = []

    def count(received, expected):
        predicted[0] += expected
        with tf1.variable_scope("traffic", reuse=tf1.AUTO_REUSE):
            total = tf1.get_local_variable("received", [], tf.float64,
                                           initializer=tf1.zeros_initializer())
        measured[:] = [total]
        return total.assign_add(received, read_value=False)

    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [b, sizes[0]])
        t = tf1.placeholder(tf.float32, [b, sizes[-1]])
        batch_tiling = tiles.batch_split([c.parts for c in Tiling.parse(plan["weights"]["W1"]).cuts])
        h, h_tiling = x, batch_tiling
        variables = {}
        for i in range(1, layers + 1):
            w_t = Tiling.parse(plan["weights"][f"W{i}"])
            y_t = (Tiling.parse(plan["activations"][f"h{i}"]) if i < layers
                   else Tiling.parse(plan["activations"]["logits"]) if softmax else batch_tiling)
            b_t = tiles.bias_tiling(y_t)
            shape_w, shape_b = (sizes[i - 1], sizes[i]), (sizes[i],)
            box_w, box_b = w_t.tile_ranges(shape_w, rank), b_t.tile_ranges(shape_b, rank)
            w = tf1.get_variable(f"W{i}", initializer=values[f"W{i}"][
                tuple(slice(lo, hi) for lo, hi in box_w)])
            bias = tf1.get_variable(f"b{i}", initializer=values[f"b{i}"][
                tuple(slice(lo, hi) for lo, hi in box_b)])
            variables[f"W{i}"], variables[f"b{i}"] = (w, w_t, shape_w), (bias, b_t, shape_b)
            w_used = tiles.replicated(w, w_t, shape_w, rank, 1.0 / n, count, f"W{i}_param")
            b_used = tiles.replicated(bias, b_t, shape_b, rank, 1.0 / n, count, f"b{i}_param")
            h = tiles.dense(h, h_tiling, spec["global_batch"], w_used, w_t, shape_w, y_t, rank,
                            b_used, b_t, count, name=f"layer{i}")
            h_tiling = y_t
            if i < layers:
                h = tf.nn.relu(h)
        if softmax:  # the output layer of a language model: logits split over the vocabulary
            labels = tf.argmax(t, axis=1)
            loss = tf.reduce_mean(tiles.softmax_cross_entropy(
                h, h_tiling, spec["global_batch"], sizes[-1], labels, batch_tiling, rank, count))
        else:
            loss = 0.5 * tf.reduce_mean(tf.reduce_sum(tf.square(h - t), axis=1))
        opt = optimizer(plan["optimizer"])
        train = opt.minimize(loss)
        with tf1.Session() as sess:
            sess.run([tf1.global_variables_initializer(), tf1.local_variables_initializer()])
            for xs, ts in batches:
                sess.run(train, {x: xs[rank * b:(rank + 1) * b], t: ts[rank * b:(rank + 1) * b]})
            out = {}
            for name, (v, tiling, shape) in variables.items():
                out[name] = sess.run(v)
                for s in slot_names(plan["optimizer"]):
                    out[f"{name}/{s}"] = sess.run(opt.get_slot(v, s))
            out["__bytes_predicted_per_step"] = np.array(predicted[0], np.float64)
            out["__bytes_received_per_step"] = np.array(
                sess.run(measured[0]) / len(batches) if measured else 0.0)
    folder = os.path.join(out_dir, plan["name"])
    os.makedirs(folder, exist_ok=True)
    np.savez(os.path.join(folder, f"rank{rank}.npz"), **out)


def main(spec_path, out_dir):
    hvd.init()
    with open(spec_path) as f:
        spec = json.load(f)
    for plan in spec["plans"]:
        run_plan(spec, plan, hvd.rank(), hvd.size(), out_dir)


if __name__ == "__main__":
    main(*sys.argv[1:])
