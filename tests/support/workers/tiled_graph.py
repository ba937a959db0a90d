"""A horovodrun worker: an ordinary tf.compat.v1.layers MLP trained through
tfpar.get_runner with Config(tiling=...), weights split over the workers by the rewrite.

usage: tiled_graph.py SPEC_JSON OUT_DIR. SPEC: {"scenarios": [{"name", "tiling": (as
Config.tiling: {variable: tiling}, "auto" or a plan file), "optimizer", optional
"tiling_min_bytes", "sizes", and `build`'s MODEL_KEYS}],
"sizes", "global_batch", "steps"}. Saves per scenario
this worker's tiles (with the boxes they hold) and every other variable's value, and the
split variables fetched whole; its checkpoint is the scenario's folder.
"""
import json
import os
import sys

import numpy as np
import tensorflow as tf

from examples.split_mlp import initial, optimizer

tf.compat.v1.disable_eager_execution()
tf1 = tf.compat.v1


VOCAB = 40


ACTIVATIONS = {"relu": tf.nn.relu, "gelu": tf.nn.gelu}


MODEL_KEYS = ("embedding", "resource", "lm", "clip", "activation", "seq", "post", "block",
              "assigned")
ASSIGN = "assign_kernel"  # the user's assignment of the first kernel (`assigned`)


def assigned_value(values) -> np.ndarray:
    """What a scenario with `assigned` writes to the first kernel before training."""
    return (0.5 * values["W1"] + 0.01).astype(np.float32)


def model_options(scenario: dict) -> dict:
    """The keyword arguments of `build` that a scenario sets."""
    return {k: scenario[k] for k in MODEL_KEYS if k in scenario}


def build(sizes, values, opt_name, batch, embedding=False, resource=True, lm=False,
          clip=None, activation="relu", seq=False, post=None, block=None, assigned=False):
    """The MLP as the field writes it: tf.compat.v1.layers.dense, a mean squared loss.
    With `lm`, the last layer is a language model's output projection over a vocabulary
    of sizes[-1] words and the loss the mean sparse softmax cross-entropy of labels (word
    ids made from x). With `clip`, the gradients are clipped by their global norm (as the
    NMT tutorial does) before the update; with `post` "scaled" they are halved first, with
    "by_norm" each is clipped by its own norm instead (tf.clip_by_norm). `activation`: the
    hidden layers' ("relu" or "gelu", whose ops take scalar constants and the activation
    twice). `block` (sizes[0] == sizes[-1]), as a Transformer's feed-forward block:
    "residual" adds the input to the last layer's output; "residual_penalty" also adds an
    activity penalty on the first hidden activation to the loss (a second reader of it,
    so the layers around it do not chain). With `seq` (and
    `lm`), every example is a sequence of 2 positions ([batch, 2, width], batch-major):
    the dense layers run as tensordot (Reshape, MatMul, Reshape) and the logits are
    [batch, 2, vocab], as an NMT-style model's projection layer has them.
    With `embedding`, the input is the sum of x and rows of an embedding looked up by
    ids (a sparse gradient: HYBRID keeps it on the parameter servers). `resource`: False
    for reference variables (TF1's, under disable_v2_behavior). With `assigned`, the graph
    also assigns the first kernel from a placeholder (op ASSIGN, fed `new_kernel`), as a
    script loads pretrained weights; the run makes it before training."""
    g = tf.Graph()
    with g.as_default(), tf1.variable_scope(tf1.get_variable_scope(), use_resource=resource):
        x = tf1.placeholder(tf.float32, [batch, sizes[0]], name="x")
        t = tf1.placeholder(tf.float32, [batch, sizes[-1]], name="targets")
        h = x
        if embedding:
            table = tf1.get_variable("embedding", initializer=np.random.default_rng(5)
                                     .standard_normal((VOCAB, sizes[0])).astype(np.float32))
            ids = tf.cast(tf.math.floormod(tf.abs(x[:, 0]) * 1000.0, VOCAB), tf.int32)
            h = x + tf.nn.embedding_lookup(table, ids)
        if seq:
            h = tf.stack([h, 0.5 * h], axis=1)
        block_input, hidden = h, []
        for i in range(1, len(sizes)):
            h = tf1.layers.dense(
                h, sizes[i],
                activation=ACTIVATIONS[activation] if i < len(sizes) - 1 else None,
                kernel_initializer=tf1.constant_initializer(values[f"W{i}"]),
                bias_initializer=tf1.constant_initializer(values[f"b{i}"]))
            hidden.append(h)
        if block:
            h = h + block_input
        if lm:
            words = tf.stack([x[:, 1], x[:, 2]], axis=1) if seq else x[:, 1]
            labels = tf.cast(tf.math.floormod(tf.abs(words) * 1000.0, sizes[-1]), tf.int64)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=labels, logits=h))
        else:
            loss = 0.5 * tf.reduce_mean(tf.reduce_sum(tf.square(h - t), axis=1))
        if block == "residual_penalty":
            loss += 0.1 * tf.reduce_mean(tf.square(hidden[0]))
        if assigned:
            kernel = [v for v in tf1.global_variables() if v.op.name == "dense/kernel"][0]
            tf1.assign(kernel, tf1.placeholder(tf.float32, kernel.shape, name="new_kernel"),
                       name=ASSIGN)
        opt = optimizer(opt_name)
        if clip is None:
            train = opt.minimize(loss, name="train")
        else:
            grads, variables = zip(*opt.compute_gradients(loss))
            if post == "scaled":
                grads = [0.5 * g for g in grads]
            if post == "by_norm":
                clipped = [tf.clip_by_norm(g, clip) for g in grads]
            else:
                clipped, _ = tf.clip_by_global_norm(grads, clip)
            train = opt.apply_gradients(zip(clipped, variables), name="train")
    return g, x, t, train, opt


def graph_for_plan(sizes=(8, 12, 6), batch=4, opt_name="adam"):
    """The graph one worker builds, for `tfpar plan --tiling` (model.py:function)."""
    values, _ = initial(list(sizes), batch, 1)
    return build(list(sizes), values, opt_name, batch)[0]


def main(spec_path, out_dir):
    import tfpar
    with open(spec_path) as f:
        spec = json.load(f)
    gb = spec["global_batch"]
    for sc in spec["scenarios"]:
        sizes = sc.get("sizes", spec["sizes"])
        import horovod.tensorflow as hvd
        hvd.init()
        n, rank = hvd.size(), hvd.rank()
        b = gb // n
        values, batches = initial(sizes, gb, spec["steps"])
        g, x, t, train, _ = build(sizes, values, sc["optimizer"], b, **model_options(sc))
        with g.as_default():
            saver = tf1.train.Saver()  # the user's own, as TF1 scripts build it
        out = {}
        config = tfpar.Config(tiling=sc["tiling"],
                              tiling_min_bytes=sc.get("tiling_min_bytes", 1 << 20))
        with tfpar.get_runner(g, config=config) as runner:
            if sc.get("assigned"):  # every worker, the same value, before training
                runner.run(ASSIGN, {"new_kernel:0": assigned_value(values)})
            trace = tf1.RunMetadata()
            for xs, ts in batches:  # the last step traced: which ops ran
                runner.run(train, {x: xs[rank * b:(rank + 1) * b],
                                   t: ts[rank * b:(rank + 1) * b]},
                           options=tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE),
                           run_metadata=trace)
            out["__ran"] = np.array(sorted({n.node_name for d in trace.step_stats.dev_stats
                                            for n in d.node_stats}))
            folder = os.path.join(out_dir, sc["name"])
            os.makedirs(folder, exist_ok=True)
            # The split variables fetched whole, then checkpointed whole (every worker
            # calls both: they gather the tiles); one more step changes every tile, and
            # restoring the checkpoint puts the saved values back.
            tiles = runner.tiles()
            with g.as_default():
                split = [v for v in tf1.global_variables() if v.op.name in tiles]
            for v, value in zip(split, runner.run(split)):
                out[f"whole/{v.op.name}"] = value
            runner.save(os.path.join(folder, "ckpt"))
            xs, ts = batches[0]
            runner.run(train, {x: xs[rank * b:(rank + 1) * b], t: ts[rank * b:(rank + 1) * b]})
            if sc.get("resource", True):
                runner.restore(folder)
            else:  # through the user's Saver (it restores through the runner)
                saver.restore(runner.session, tf.train.latest_checkpoint(folder))
            try:  # the user's Saver cannot save tiles: a clear error, nothing written
                saver.save(runner.session, os.path.join(folder, "by_saver"))
                out["__saver_error"] = np.array("")
            except tfpar.TfparError as e:
                out["__saver_error"] = np.array(str(e))
            for name, tile in runner.tiles().items():  # (after the restore)
                out[f"tile/{name}"] = tile["value"]
                out[f"box/{name}"] = np.array(tile["box"])
            with g.as_default():
                rest = [v for v in tf1.global_variables() if v.op.name not in tiles]
            for v, value in zip(rest, runner.run(rest)):
                out[f"var/{v.op.name}"] = value
            out["__routes"] = np.array(json.dumps({v.name: v.route for v in runner.plan.variables}))
            out["__plan"] = np.array(runner.plan.to_json())
            out["__plan_table"] = np.array(runner.plan.table())
            comm = runner.communication()
            out["__tiled_bytes_per_step"] = np.array(comm["tiled"] / max(comm["steps"], 1))
        np.savez(os.path.join(folder, f"rank{rank}.npz"), **out)


if __name__ == "__main__":
    main(*sys.argv[1:])
