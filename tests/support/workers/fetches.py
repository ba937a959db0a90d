"""Fetches and feeds through `Runner.run` against a plain `tf.compat.v1.Session`.

usage: horovodrun -np N ... python -m tests.support.workers.fetches OUT_DIR [--tf1]
For each run mode (HYBRID, PS, and HYBRID with sharded rows) every worker builds the graph twice: one copy goes to
`tfpar.get_runner`, the other to a plain session given the runner's initial values. Each
fetch below runs through both with the worker's own rows; their results must be equal
(assign-family results of resource and reference variables on a replicated, an
allreduced, a parameter-server and a sharded variable, writes of part of the embedding
(scatter_update, a row's assign, scatter_nd_update; scatter_add where it is sharded),
`tf.group` ops, an assignment's op,
IndexedSlices and SparseTensor fetches, strings). Then a step is trained and the
assignments are fetched again: a fed value's assignment gives that value whatever the
training did. Writes OUT_DIR/<mode>/rank<r>.json with what was compared.
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf1 = tf.compat.v1


# Run modes; SHARDED: HYBRID with the sparse variable's rows sharded over the workers.
MODES = {"HYBRID": {"run_mode": "HYBRID"}, "PS": {"run_mode": "PS"},
         "SHARDED": {"run_mode": "HYBRID", "sparse_route": "sharded"}}


def build(sharded=False):
    """The graph and its fetches; `sharded`: also an assign_add of the embedding (of a
    sharded variable it adds each worker's rows; on the parameter servers it is refused)."""
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(0)
        ids = tf1.placeholder(tf.int64, [None], name="ids")
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        emb = tf1.get_variable("emb", [10, 3])  # sparse gradient: the PS route
        w = tf1.get_variable("w", [3, 1])  # dense: allreduce (HYBRID) or the PS (PS mode)
        lr = tf1.get_variable("lr", [], initializer=tf1.constant_initializer(0.1),
                              trainable=False)  # replicated
        counter = tf1.get_variable("counter", [], dtype=tf.int64, trainable=False,
                                   initializer=tf1.zeros_initializer())
        loss = tf.reduce_mean(tf.matmul(x + tf.nn.embedding_lookup(emb, ids), w) ** 2)
        step = tf1.train.get_or_create_global_step()
        opt = tf1.train.GradientDescentOptimizer(lr)
        grads = opt.compute_gradients(loss)
        train = opt.apply_gradients(grads, global_step=step)
        new_lr = tf1.placeholder(tf.float32, [], name="new_lr")
        new_w = tf1.placeholder(tf.float32, [3, 1], name="new_w")
        new_emb = tf1.placeholder(tf.float32, [10, 3], name="new_emb")
        h = {
            "assign_lr": tf1.assign(lr, new_lr),
            "assign_add_counter": tf1.assign_add(counter, 1),
            "assign_w": tf1.assign(w, new_w),
            "assign_emb": tf1.assign(emb, new_emb),
            "group": tf.group(tf1.assign(lr, new_lr), tf1.assign_add(counter, 2)),
            "emb_gradient": [g for g, v in grads if v is emb][0],  # IndexedSlices
            "sparse": tf.sparse.from_dense(tf.cast(tf.reshape(ids, [1, -1]) > 4, tf.int32)),
            "string": tf.strings.as_string(counter),
            "loss": loss,
            # A norm over every gradient, not read by the update (logged, say): one
            # device's, of the workers' gradients combined.
            "gradient_norm": tf.linalg.global_norm([g for g, _ in grads]),
            # A whole read of each variable outside the training step (as an eval does).
            "sums": [tf.reduce_sum(emb * 1.0), tf.reduce_sum(w * 1.0)],
        }
        h["assign_op"] = tf1.assign(lr, new_lr * 2.0).op
        # Writes of part of the table between steps (a padding row kept zero, one row
        # set, rows by n-d indices), each worker writing the same values.
        h["scatter_emb"] = tf1.scatter_update(emb, [0, 7], new_emb[:2] * 0.0)
        h["row_assign_emb"] = emb[2].assign(new_emb[3] + 1.0)
        h["scatter_nd_emb"] = tf1.scatter_nd_update(emb, [[9], [4]], new_emb[:2] * 3.0)
        if sharded:  # on the servers every worker's add would be applied: refused there
            h["assign_add_emb"] = tf1.assign_add(emb, new_emb)
            h["scatter_add_emb"] = tf1.scatter_add(emb, [1, 8, 1], new_emb[:3])
        h["train"], h["vars"], h["grads"] = train, [emb, w, lr, counter, step], grads
    return graph, h


def feeds(graph, rank):
    rng = np.random.RandomState(rank)
    return {graph.get_tensor_by_name("ids:0"): rng.randint(0, 10, size=4),
            graph.get_tensor_by_name("x:0"): rng.rand(4, 3).astype(np.float32),
            graph.get_tensor_by_name("new_lr:0"): 0.05 * (rank + 1),
            graph.get_tensor_by_name("new_w:0"): np.arange(3, dtype=np.float32)[:, None],
            graph.get_tensor_by_name("new_emb:0"): np.full([10, 3], 0.5, np.float32)}


def _plain(value):
    """A fetched value as JSON-comparable data (IndexedSlices/SparseTensor values too)."""
    if isinstance(value, tf1.SparseTensorValue):
        return {"indices": _plain(value.indices), "values": _plain(value.values),
                "dense_shape": _plain(value.dense_shape)}
    if hasattr(value, "values") and hasattr(value, "indices"):  # IndexedSlicesValue
        return {"indices": _plain(value.indices), "values": _plain(value.values)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.ndarray):
        return value.tolist() if value.dtype.kind != "S" else [v.decode() for v in value.flat]
    if isinstance(value, np.generic):
        return value.item()
    return value


def main(out_dir):
    import tfpar
    from tfpar.runtime import job
    from tests.support import models
    for mode, config in MODES.items():
        if mode == "SHARDED":  # saved after every training step, and only then (a fetch
            # that waits for the others, a sharded variable's whole read, is not a step)
            config = dict(config, checkpoint_every_steps=1,
                          checkpoint_dir=os.path.join(out_dir, "SHARDED_checkpoints"))
        graph, h = build(sharded=mode == "SHARDED")
        runner = tfpar.get_runner(graph, None, tfpar.Config(
            session_config=models.worker_session_config(), **config))
        rank = runner.worker_id
        plain_graph, p = build(sharded=mode == "SHARDED")
        with plain_graph.as_default():
            session = tf1.Session(graph=plain_graph)
            session.run(tf1.global_variables_initializer())
            for v, value in zip(p["vars"], runner.run(h["vars"])):
                v.load(value, session)
        order = ["assign_lr", "assign_add_counter", "assign_w", "assign_emb", "group",
                 "emb_gradient", "sparse", "string", "assign_op", "loss", "sums"]
        order[order.index("assign_emb") + 1:order.index("assign_emb") + 1] = [
            "scatter_emb", "row_assign_emb", "scatter_nd_emb"]
        if mode == "SHARDED":
            order[order.index("assign_emb") + 1:order.index("assign_emb") + 1] = [
                "assign_add_emb", "scatter_add_emb"]
        compared = {}

        def both(key, trained=False):
            got = runner.run(h[key], feeds(graph, rank))
            want = session.run(p[key], feeds(plain_graph, rank))
            compared[key + ("_after_training" if trained else "")] = [_plain(got), _plain(want)]

        for key in order:
            both(key)
            # A write's result read back from the servers would show the next write of a
            # worker ahead (as any read of them between steps does): in step, as a step is.
            job.allgather_strings(key)
        # The gradients' norm: one device's on both workers' batches. Its dense gradient
        # is the mean of the two workers'; its sparse one holds both workers' rows, each
        # halved (a mean over twice the examples), and global_norm squares them unsummed.
        squares = 0.0
        each = [session.run([g for g, _ in p["grads"]], feeds(plain_graph, r)) for r in range(2)]
        for parts in zip(*each):
            if hasattr(parts[0], "indices"):  # IndexedSlicesValue
                squares += sum(np.sum(np.square(x.values / 2.0, dtype=np.float64)) for x in parts)
            else:
                squares += np.sum(np.square((parts[0] + parts[1]) / 2.0, dtype=np.float64))
        compared["gradient_norm"] = [
            _plain(runner.run(h["gradient_norm"], feeds(graph, rank))), float(np.sqrt(squares))]
        # The variables after those assignments (read whole from wherever they live).
        compared["variables"] = [_plain(runner.run(h["vars"][:4])),
                                 _plain(session.run(p["vars"][:4]))]
        runner.run(h["train"], feeds(graph, rank))  # a training step moves w and emb
        # A whole read after training sees the trained variables (the plain session did
        # not train: against the variables the runner fetches). Between barriers: another
        # worker's assignment of a variable on the servers would be seen here too.
        job.allgather_strings("trained")
        emb_now, w_now = runner.run(h["vars"][:2])
        compared["sums_after_training"] = [
            _plain(runner.run(h["sums"], feeds(graph, rank))),
            [float(np.sum(emb_now, dtype=np.float32)), float(np.sum(w_now, dtype=np.float32))]]
        job.allgather_strings("read")
        for key in ("assign_w", "assign_emb", "assign_lr"):
            both(key, trained=True)
        if mode == "SHARDED":  # workers that write different values: refused, none written
            var, placeholder, shape = h["vars"][0], "new_emb:0", [10, 3]
            for key in ("assign_emb", "scatter_nd_emb", "scatter_add_emb"):
                before = runner.run(var)
                differ = dict(feeds(graph, rank))
                differ[graph.get_tensor_by_name(placeholder)] = np.full(shape, rank, np.float32)
                try:
                    runner.run(h[key], differ)
                    outcome = "written"
                except tf.errors.InvalidArgumentError as e:
                    outcome = "refused" if "write the same value" in e.message else e.message
                compared[f"different_values_{key}"] = [outcome, "refused"]
                compared[f"after_refusal_{key}"] = [_plain(runner.run(var)), _plain(before)]
        compared["plan"] = {v.name: v.route for v in runner.plan.variables}
        runner.close()
        session.close()
        os.makedirs(os.path.join(out_dir, mode), exist_ok=True)
        with open(os.path.join(out_dir, mode, f"rank{rank}.json"), "w") as f:
            json.dump(compared, f)


if __name__ == "__main__":
    if "--tf1" in sys.argv:
        tf1.disable_v2_behavior()
    else:
        tf1.disable_eager_execution()
    main(sys.argv[1])
