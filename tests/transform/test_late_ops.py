"""Ops a script builds after tfpar.get_runner (tfpar/transform/late_ops.py), in one process:
run as a plain session runs them, or refused naming the fix."""
import os

import numpy as np
import pytest
import tensorflow as tf

import tfpar

tf1 = tf.compat.v1
FEED = {"ids:0": [1, 2, 3, 2], "y:0": [1.0, 0.0, 1.0, 0.0]}


def build(resource=True):
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        ids = tf1.placeholder(tf.int32, [None], name="ids")
        y = tf1.placeholder(tf.float32, [None], name="y")
        emb = tf1.get_variable("emb", [50, 4], use_resource=resource)
        w = tf1.get_variable("w", [4, 1], use_resource=resource)
        logit = tf.squeeze(tf.matmul(tf.nn.embedding_lookup(emb, ids), w), 1)
        loss = tf.reduce_mean((logit - y) ** 2)
        train = tf1.train.AdagradOptimizer(0.1).minimize(
            loss, tf1.train.get_or_create_global_step())
    return g, dict(emb=emb, w=w, loss=loss, train=train)


def script(sess, g, h, folder):
    """A TF1 script's loop whose every op but the train step is built after the session."""
    out = []
    with g.as_default():
        sess.run(tf1.global_variables_initializer())
        for _ in range(3):
            out.append(sess.run([h["loss"], h["train"]], FEED)[0])
        # "Sum" and "ReadVariableOp" name ops tfpar made in the job's graph too (the
        # sharded rows' exchange): the script's later ops of those names are its own.
        out.append(sess.run(tf.reduce_sum(h["emb"] ** 2)))
        out.append(sess.run(tf.reduce_sum(tf.nn.embedding_lookup(h["emb"], [1, 2]))))
        out.append(sess.run(tf.shape(h["emb"])))
        out.append(sess.run("Sum:0"))  # by name, as TF1 scripts fetch
        with tf.control_dependencies([h["train"]]):  # read after a step: the new value
            emb = h["emb"]
            after = tf.reduce_sum(emb.read_value() if hasattr(emb, "handle")
                                  else tf.identity(emb))
        out.append(sess.run(after, FEED))
        mean, update = tf1.metrics.mean(h["loss"])
        sess.run(tf1.local_variables_initializer())
        sess.run(update, FEED)
        out.append(sess.run(mean))
        late = tf1.placeholder(tf.float32, [], name="late")
        out.append(sess.run(late * 2 + tf.reduce_sum(h["w"]), {late: 3.0}))
        it = tf1.data.make_initializable_iterator(tf.data.Dataset.range(5).map(lambda i: i * 2))
        sess.run(it.initializer)
        out.extend([sess.run(it.get_next()), sess.run(it.get_next())])
        out.append(sess.run(tf1.report_uninitialized_variables()))
        slots = [v for v in tf1.global_variables() if "Adagrad" in v.op.name]
        # A reference variable's slot by its name (a value; a resource one's is a handle).
        out.append(sess.run(slots[0].op.name + ":0" if slots[0].op.type == "VariableV2"
                            else slots[0]))
        if folder is not None:
            saver = tf1.train.Saver()
            path = saver.save(sess, os.path.join(folder, "m"))
            saved = tf.train.load_checkpoint(path)
            out.extend([saved.get_tensor("emb"), saved.get_tensor("emb/Adagrad")])
            sess.run(h["train"], FEED)
            saver.restore(sess, path)
            out.append(sess.run(h["emb"]))
    return out


@pytest.mark.parametrize("route,resource", [("ps", True), ("ps", False), ("sharded", True),
                                            ("allgather", True)])
def test_ops_built_after_the_runner_give_what_a_plain_session_gives(tmp_path, route, resource):
    """Each value equals a plain session's exactly (tolerance 0): reads of the table on
    the servers or in rows read it whole, a later Saver saves and restores the
    single-device model (not with sharded rows: refused as for any Saver)."""
    saves = route != "sharded"
    g, h = build(resource)
    os.makedirs(tmp_path / "plain")
    with tf1.Session(graph=g) as sess:
        expected = script(sess, g, h, str(tmp_path / "plain") if saves else None)
    g, h = build(resource)
    with tfpar.get_runner(g, config=tfpar.Config(sparse_route=route)) as runner:
        assert "Sum" not in {op.name for op in g.get_operations()}
        got = script(runner, g, h, str(tmp_path) if saves else None)
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(expected, got)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=f"value {i}")


def test_what_cannot_be_done_late_is_refused_naming_the_fix():
    """An optimizer built late would train each worker alone; a late write of a table
    on the servers would miss its parts; TF1 control flow is not copied. Each is refused
    before it runs, and the runner trains on after."""
    g, h = build()
    with tfpar.get_runner(g, config=tfpar.Config(sparse_route="ps")) as runner, \
            g.as_default():
        with pytest.raises(tfpar.NotYetSupportedError, match="Build the train op before"):
            runner.run(tf1.train.GradientDescentOptimizer(0.1).minimize(h["loss"]), FEED)
        with pytest.raises(tfpar.NotYetSupportedError,
                           match="writes variable 'emb', which lives on the parameter servers"):
            runner.run(tf1.assign(h["emb"], tf.zeros([50, 4])))
        was_v2 = tf1.control_flow_v2_enabled()
        tf1.disable_control_flow_v2()
        try:
            branch = tf1.cond(tf.constant(True), lambda: tf.constant(1.0),
                              lambda: tf.constant(2.0))
        finally:
            if was_v2:
                tf1.enable_control_flow_v2()
        with pytest.raises(tfpar.NotYetSupportedError, match="TF1 control flow"):
            runner.run(branch)
        before = runner.run(h["emb"])
        runner.run(h["train"], FEED)
        assert not np.array_equal(runner.run(h["emb"]), before)
        assert runner.run(tf1.train.get_global_step()) == 1
