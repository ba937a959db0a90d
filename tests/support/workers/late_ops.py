"""A TF1 script that builds ops after its session exists, as many do: the initialiser run
inside `with Session() as sess:`, a pretrained table assigned, a streaming metric,
evaluation reads of the table and a Saver built after the session, a learning rate set
through an op built late.

usage: horovodrun -np N ... python late_ops.py OUT_DIR
       python late_ops.py OUT_DIR --single N   (one device, the N workers' batches together)
Writes OUT_DIR/<mode>/rank<r>.npz (init/<var>, final/<var>, eval/...) or single.npz, and the chief's
checkpoint OUT_DIR/<mode>/saved (not with the sharded rows: a Saver cannot save them),
for HYBRID (the table on the parameter servers), PS, AR and SHARDED.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.support import one_device  # noqa: E402

tf1 = tf.compat.v1
BATCH, STEPS, VOCAB = 4, 3, 12


def build():
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(7)  # the script's own initialiser run draws the same everywhere
        ids = tf1.placeholder(tf.int64, [None], name="ids")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        emb = tf1.get_variable("emb", [VOCAB, 3])
        w = tf1.get_variable("w", [3, 1])
        lr = tf1.get_variable("lr", [], trainable=False,
                              initializer=tf1.constant_initializer(0.1))
        loss = tf.reduce_mean(tf.square(tf.matmul(tf.nn.embedding_lookup(emb, ids), w) - y))
        train = tf1.train.AdagradOptimizer(lr).minimize(
            loss, global_step=tf1.train.get_or_create_global_step())
    return graph, dict(ids=ids, y=y, emb=emb, w=w, lr=lr, loss=loss, train=train)


def data(step, n):
    rng = np.random.RandomState(70 + step)
    return (rng.randint(0, VOCAB, size=BATCH * n).astype(np.int64),
            rng.rand(BATCH * n, 1).astype(np.float32))


def script(sess, graph, h, rank, n, width, folder, chief):
    """The user's loop; every op below is built after the session (the runner) exists."""
    with graph.as_default():
        sess.run(tf1.global_variables_initializer())
        pretrained = tf1.placeholder(tf.float32, [VOCAB, 3])  # loaded into the table
        sess.run(tf1.assign(h["emb"], pretrained), {pretrained: np.linspace(
            -1, 1, VOCAB * 3, dtype=np.float32).reshape(VOCAB, 3)})
        start = sess.run(tf1.global_variables())  # the seeded draws: one device's
        mean_loss, update = tf1.metrics.mean(h["loss"])
        sess.run(tf1.local_variables_initializer())
        halve = tf1.assign(h["lr"], h["lr"] / 2)
        for step in range(STEPS):
            ids, y = data(step, n)
            mine = slice(rank * BATCH, rank * BATCH + width)
            sess.run(h["train"], {h["ids"]: ids[mine], h["y"]: y[mine]})
            if step == 1:
                sess.run(halve)
        ids, y = data(STEPS, n)  # an evaluation on every worker's batch
        sess.run(update, {h["ids"]: ids, h["y"]: y})
        evaluated = {"eval/metric": sess.run(mean_loss),
                     "eval/norm": sess.run(tf.norm(h["emb"])),
                     "eval/rows": sess.run(tf.nn.embedding_lookup(h["emb"], [0, 3, 3])),
                     "eval/lr": sess.run(h["lr"].read_value())}
        saver = tf1.train.Saver() if folder is not None else None
        if saver is not None and chief:  # the Horovod way: the chief alone saves
            saver.save(sess, os.path.join(folder, "saved"))
        variables = tf1.global_variables()
        return variables, start, sess.run(variables), evaluated


def main(out, single=None):
    tf1.disable_eager_execution()
    for mode, config in one_device.EVERY_MODE.items():
        graph, h = build()
        folder = os.path.join(out, mode)
        os.makedirs(folder, exist_ok=True)
        saves = folder if mode != "SHARDED" else None
        if single:
            with tf1.Session(graph=graph) as sess:
                variables, start, final, evaluated = script(sess, graph, h, 0, single,
                                                            BATCH * single, None, False)
            one_device.save(os.path.join(folder, "single.npz"), variables, final, start,
                            **evaluated)
            continue
        import tfpar
        with tfpar.get_runner(graph, config=tfpar.Config(**config)) as runner:
            variables, start, final, evaluated = script(
                runner, graph, h, runner.worker_id, runner.num_workers, BATCH, saves,
                runner.is_chief)
            one_device.save(os.path.join(folder, f"rank{runner.worker_id}.npz"), variables,
                            final, start, **evaluated)


if __name__ == "__main__":
    one_device.command_line(main)
