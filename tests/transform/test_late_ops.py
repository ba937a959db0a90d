"""Ops a script builds after tfpar.get_runner (tfpar/transform/late_ops.py), one worker:
run as a plain session runs them, or refused naming the fix.

The runner's side runs in a fresh process (`python -m tests.transform.test_late_ops`):
a parameter-server job's servers live as long as the process, and another unit test's
runner that stopped them in a shared pytest process would stop these too."""
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tests.support.launch import REPO

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
        # A pretrained table loaded late (its value, then a lookup after it), and a row
        # read back after the assign's own read.
        pretrained = tf1.placeholder(tf.float32, [50, 4], name="pretrained")
        load = tf1.assign(h["emb"], pretrained)
        out.append(sess.run(load, {pretrained: np.arange(200.0).reshape(50, 4) / 100}))
        out.append(sess.run(tf.nn.embedding_lookup(h["emb"], [7])))
        for _ in range(2):
            out.append(sess.run([h["loss"], h["train"]], FEED)[0])
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


def through_the_runner(route: str, resource: bool, folder: str):
    """The script through a one-worker runner, its values into folder/runner.npz."""
    g, h = build(resource)
    with tfpar.get_runner(g, config=tfpar.Config(sparse_route=route)) as runner:
        assert "Sum" not in {op.name for op in g.get_operations()}
        got = script(runner, g, h, folder if route != "sharded" else None)
    np.savez(os.path.join(folder, "runner.npz"), *[np.asarray(x) for x in got])


@pytest.mark.parametrize("route,resource", [("ps", True), ("ps", False), ("sharded", True),
                                            ("allgather", True)])
def test_ops_built_after_the_runner_give_what_a_plain_session_gives(tmp_path, route, resource):
    """Each value equals a plain session's exactly (tolerance 0): reads of the table on
    the servers or in rows read it whole (after a step where they wait for it), a late
    assign of the whole table writes its parts or rows, a later Saver saves and restores
    the single-device model (not with sharded rows: refused as for any Saver)."""
    saves = route != "sharded"
    g, h = build(resource)
    os.makedirs(tmp_path / "plain")
    with tf1.Session(graph=g) as sess:
        expected = script(sess, g, h, str(tmp_path / "plain") if saves else None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.transform.test_late_ops", route, str(resource),
         str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = np.load(str(tmp_path / "runner.npz"), allow_pickle=True)
    assert len(got.files) == len(expected)
    for i, a in enumerate(expected):
        np.testing.assert_array_equal(got[f"arr_{i}"], np.asarray(a), err_msg=f"value {i}")


def test_what_cannot_be_done_late_is_refused_naming_the_fix():
    """An optimizer built late would train each worker alone; a late add to a table split
    over the workers would add once per worker; TF1 control flow is not copied. Each is
    refused before it runs, and the runner trains on after."""
    g, h = build()
    with tfpar.get_runner(g, config=tfpar.Config(sparse_route="sharded")) as runner, \
            g.as_default():
        with pytest.raises(tfpar.NotYetSupportedError, match="Build the train op before"):
            runner.run(tf1.train.GradientDescentOptimizer(0.1).minimize(h["loss"]), FEED)
        with pytest.raises(tfpar.NotYetSupportedError, match="writes variable 'emb', which "
                           r"is split over the workers by rows \(route 'sharded'\)"):
            runner.run(tf1.assign_add(h["emb"], tf.ones([50, 4])))
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


if __name__ == "__main__":  # the runner's side of a test above: ROUTE RESOURCE FOLDER
    tf1.disable_eager_execution()
    through_the_runner(sys.argv[1], sys.argv[2] == "True", sys.argv[3])
