"""The Runner in one process (a Horovod job of size 1): name mapping, errors, lifecycle."""
import collections
import os

import numpy as np
import pytest
import tensorflow as tf

from tests.support import models
import tfpar

tf1 = tf.compat.v1


@pytest.fixture
def built():
    return models.build(optimizer="adam", init_seed=3)


def data_feed(h, step=0):
    x, y, ids = models.batches(step + 1, 8)[step]
    return models.feed(h, x, y, ids)


def test_runs_like_a_session(built):
    graph, h = built
    with tfpar.get_runner(graph, "localhost:1") as runner:
        assert (runner.worker_id, runner.num_workers, runner.is_chief) == (0, 1, True)
        assert runner.plan.variable("w1").route == "allreduce"
        w1 = graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)[0]
        before = runner.run(w1)
        Pair = collections.namedtuple("Pair", "loss step")
        out = runner.run({"a": [h["loss"], h["train_op"]], "b": Pair("loss:0", "global_step")},
                         feed_dict={"x:0": data_feed(h)[h["x"]], h["y"]: data_feed(h)[h["y"]]})
        assert isinstance(out["b"], Pair) and out["a"][1] is None
        assert out["b"].loss == pytest.approx(out["a"][0])
        assert runner.run("global_step:0") == 1
        assert not np.allclose(runner.run(w1), before)


def test_a_runs_collective_signature_is_left_out_where_tf1_control_flow_may_skip_some():
    """The liveness hub compares the runs' signatures across workers: equal for the same
    collectives, different for others, and none ("") where a TF1 cond or while frame may
    skip a collective (a chief-only evaluation there is not a deadlock)."""
    import horovod.tensorflow as hvd
    from tfpar.runtime.runner import collective_signature
    hvd.init()
    g = tf.Graph()
    was_v2 = tf1.control_flow_v2_enabled()
    tf1.disable_control_flow_v2()
    try:
        with g.as_default():
            x = tf.constant([1.0, 2.0])
            a, b = hvd.allreduce(x, name="a"), hvd.allreduce(x * 2, name="b")
            flag = tf1.placeholder(tf.bool, [])
            maybe = tf1.cond(flag, lambda: hvd.allreduce(x * 3, name="c"), lambda: x)
    finally:
        if was_v2:
            tf1.enable_control_flow_v2()
    one = collective_signature([a.op])
    assert one and one == collective_signature([a.op]) != collective_signature([a.op, b.op])
    assert collective_signature([x.op]) == ""
    assert collective_signature([a.op], "reinitialise w") != one
    assert collective_signature([maybe.op, a.op]) == ""


def test_make_callable_runs_like_a_sessions(built):
    """Session.make_callable (TF1 benchmarks' fast path): feeds in order, options
    accepted when asked, the fetch structure kept; on the runner and on the session hooks
    and the default session see."""
    graph, h = built
    feed = data_feed(h)
    with tfpar.get_runner(graph, "localhost:1") as runner:
        step = runner.make_callable([h["loss"], h["train_op"]], ["x:0", h["y"]])
        loss, none = step(feed[h["x"]], feed[h["y"]])
        assert none is None and np.isfinite(loss)
        assert runner.run("global_step:0") == 1
        read = runner.user_session.make_callable("global_step:0", accept_options=True)
        meta = tf1.RunMetadata()
        assert read(options=tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE),
                    run_metadata=meta) == 1
        assert meta.step_stats.dev_stats  # the options reached the run
        with pytest.raises(TypeError, match="takes 2 feed value"):
            step(feed[h["x"]])
        with pytest.raises(TypeError, match="unexpected keyword argument 'options'"):
            step(feed[h["x"]], feed[h["y"]], options=None)
        with pytest.raises(tfpar.TfparError):
            runner.make_callable("no_such_tensor:0")


def test_the_runner_is_a_session_where_tensorflow_checks_for_one(tmp_path):
    """TF's own functions that take a session take the runner: a Saver of the user's graph
    saves the model and restores it through the runner, and start_queue_runners feeds a
    queue input through it (PTB's range_input_producer); its graph is the user's, as a
    session's; `list_devices()` lists its session's; partial_run is refused clearly."""
    g = tf.Graph()
    with g.as_default():
        i = tf1.train.range_input_producer(5, shuffle=False).dequeue()
        w = tf1.get_variable("w", [5], initializer=tf1.zeros_initializer())
        loss = tf.reduce_sum(w * tf.one_hot(i, 5, dtype=tf.float32))
        train = tf1.train.GradientDescentOptimizer(1.0).minimize(loss)
        reset = w.assign(tf.fill([5], 7.0))
        saver = tf1.train.Saver()
    with tfpar.get_runner(g) as runner:
        assert runner.graph is g and runner.rewritten_graph is not g
        coord = tf1.train.Coordinator()
        threads = tf1.train.start_queue_runners(sess=runner, coord=coord)
        for _ in range(3):
            runner.run(train)
        coord.request_stop()
        coord.join(threads)
        np.testing.assert_array_equal(runner.run(w), [-1, -1, -1, 0, 0])  # 3 dequeues
        with g.as_default():
            path = saver.save(runner, str(tmp_path / "model"))
            assert tf.train.load_checkpoint(path).get_tensor("w").tolist() == [-1, -1, -1, 0, 0]
            assert runner.run(reset).tolist() == [7] * 5
            saver.restore(runner, path)
        assert runner.run(w).tolist() == [-1, -1, -1, 0, 0]
        with pytest.raises(tfpar.TfparError, match="partial_run"):
            runner.partial_run_setup([loss])
        devices = [d.device_type for d in runner.list_devices()]
        assert "CPU" in devices and devices == [d.device_type for d in
                                                runner.user_session.list_devices()]


@pytest.mark.parametrize("route", ["ps", "sharded"])
def test_a_savers_own_names_and_a_sharded_saver_work_through_the_runner(tmp_path, route):
    """A Saver given a dict (its own names: a checkpoint from another model, as transfer
    learning loads it) restores its variables through the runner under those names, on
    the servers and sharded alike; a Saver(sharded=True) saves and restores on the
    servers, and is refused clearly where a table is sharded (each worker holds rows).
    Before, the first failed ('emb' is not in it) and the second failed inside
    TensorFlow."""
    def build():
        g = tf.Graph()
        with g.as_default():
            emb = tf1.get_variable("emb", [6, 2], initializer=tf1.random_uniform_initializer(
                seed=1))
            loss = tf.reduce_sum(tf.nn.embedding_lookup(emb, [1, 4, 4]) ** 2)
            train = tf1.train.AdagradOptimizer(0.1).minimize(loss)
            named = tf1.train.Saver({"pretrained/table": emb})
            sharded = tf1.train.Saver(sharded=True)
        return g, emb, train, named, sharded

    plain_g, plain_emb, _, plain_named, _ = build()  # the pretrained model's checkpoint
    with tf1.Session(graph=plain_g) as sess:
        sess.run(plain_emb.initializer)
        sess.run(plain_emb.assign(tf.fill([6, 2], 0.25)))
        pretrained = plain_named.save(sess, str(tmp_path / "pretrained"))
    g, emb, train, named, sharded = build()
    with tfpar.get_runner(g, config=tfpar.Config(sparse_route={"emb": route})) as runner:
        runner.run(train)
        named.restore(runner, pretrained)
        np.testing.assert_array_equal(runner.run(emb), np.full([6, 2], 0.25))
        runner.run(train)
        runner.restore(pretrained, {"emb": "pretrained/table"})  # the same, by hand
        np.testing.assert_array_equal(runner.run(emb), np.full([6, 2], 0.25))
        if route == "sharded":
            with pytest.raises(tfpar.TfparError, match="Saver cannot save this job's split"):
                sharded.save(runner, str(tmp_path / "sharded"))
            return
        runner.run(train)
        trained = runner.run(emb)
        path = sharded.save(runner, str(tmp_path / "sharded"))
        runner.run(train)
        sharded.restore(runner, path)
        np.testing.assert_array_equal(runner.run(emb), trained)


def test_same_result_as_a_plain_session(built):
    graph, h = built
    with tfpar.get_runner(graph) as runner:
        init = {v.op.name: runner.run(v) for v in graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)}
        for s in range(3):
            runner.run(h["train_op"], feed_dict=data_feed(h, s))
        got = runner.run(dict((v.op.name, v) for v in
                              graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)))
    with graph.as_default(), tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        for v in graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES):
            v.load(init[v.op.name], sess)
        for s in range(3):
            sess.run(h["train_op"], feed_dict=data_feed(h, s))
        want = models.variable_values(sess, graph)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_meta_graph_input(built):
    graph, h = built
    meta = tf1.train.export_meta_graph(graph=graph)
    with tfpar.get_runner(meta) as runner:
        runner.run("Adam", feed_dict={"x:0": data_feed(h)[h["x"]], "y:0": data_feed(h)[h["y"]]})
        assert runner.run("global_step:0") == 1


def test_bad_fetches_and_feeds(built):
    graph, h = built
    other, _ = models.build()
    with tfpar.get_runner(graph) as runner:
        with pytest.raises(tfpar.TfparError, match="'nope:0' is not in the graph"):
            runner.run("nope:0")
        with pytest.raises(tfpar.TfparError, match="another graph"):
            runner.run(other.get_operation_by_name("global_step"))
        with pytest.raises(tfpar.TfparError, match="feed 'missing:0'"):
            runner.run(h["loss"], feed_dict={"missing:0": 1.0})
        with pytest.raises(tfpar.TfparError, match="cannot fetch"):
            runner.run(3.5)
        # A feed of the wrong shape names the user's tensor and shapes, as a Session does.
        with pytest.raises(ValueError, match=r"Cannot feed value of shape \(2, 3\) for Tensor "
                                             r"'?x:0'?, which has shape '?\(None, 6\)'?"):
            runner.run(h["loss"], feed_dict={h["x"]: np.zeros((2, 3), np.float32)})
    with pytest.raises(tfpar.TfparError, match="closed"):
        runner.run(h["loss"])


def test_config_errors(built):
    graph, _ = built
    with pytest.raises(tfpar.TfparError, match="unknown run_mode 'FAST'"):
        tfpar.Config(run_mode="FAST")
    with pytest.raises(tfpar.TfparError, match="tfpar.Config"):
        tfpar.get_runner(graph, config={"run_mode": "AR"})
    with pytest.raises(tfpar.TfparError, match="tf.Graph or a MetaGraphDef"):
        tfpar.get_runner("graph.pb")
    with pytest.raises(tfpar.TfparError, match="running job has 1"):
        tfpar.get_runner(graph, "localhost:1,elsewhere:1")
    with pytest.raises(tfpar.TfparError, match="2 worker"):
        tfpar.get_runner(graph, "localhost:2")
    assert tfpar.Config(run_mode="ar").run_mode == "AR"


@pytest.mark.parametrize("route", ["ps", "sharded"])
def test_the_users_initializer_and_load_reach_a_variable_on_the_servers_or_sharded(route):
    """The rewrite keeps an unread copy of such a variable; its initialiser (and
    Variable.load) writes that copy, and tfpar then sets the variable from it."""
    g = tf.Graph()
    with g.as_default():
        ids = tf1.placeholder(tf.int64, [None])
        emb = tf1.get_variable("emb", [6, 2], initializer=tf1.constant_initializer(0.5))
        loss = tf.reduce_sum(tf.nn.embedding_lookup(emb, ids) ** 2)
        train = tf1.train.AdagradOptimizer(0.1).minimize(loss)
        init = tf1.global_variables_initializer()
        slot, = [v for v in tf1.global_variables() if v.op.name == "emb/Adagrad"]
    with tfpar.get_runner(g, config=tfpar.Config(sparse_route=route)) as runner:
        assert runner.plan.variable("emb").route == route
        runner.run(train, {ids: [0, 1, 1]})
        assert not np.allclose(runner.run(emb), 0.5)
        runner.run(init)
        np.testing.assert_array_equal(runner.run(emb), np.full([6, 2], 0.5))
        np.testing.assert_array_equal(runner.run(slot), np.full([6, 2], 0.1, np.float32))
        emb.load(np.arange(12.0).reshape(6, 2), runner.user_session)
        np.testing.assert_array_equal(runner.run(emb), np.arange(12.0).reshape(6, 2))


def _table_with_writes(add: bool):
    """A table trained by Adagrad and written in part between steps, as scripts do;
    `add`: a scatter_add among the writes."""
    g = tf.Graph()
    with g.as_default():
        ids = tf1.placeholder(tf.int64, [None], name="ids")
        emb = tf1.get_variable("emb", [7, 2], initializer=tf1.random_uniform_initializer(
            seed=4))
        loss = tf.reduce_sum(tf.nn.embedding_lookup(emb, ids) ** 2)
        train = tf1.train.AdagradOptimizer(0.1).minimize(loss)
        writes = [tf1.scatter_update(emb, [0, 6], tf.zeros([2, 2])),  # padding rows zero
                  emb[1:5:3].assign(tf.fill([2, 2], 2.0)),  # rows 1 and 4
                  tf1.scatter_nd_update(emb, [[2], [5]], [[3.0, 3.0], [4.0, 4.0]]),
                  tf1.scatter_max(emb, [3, 3], [[0.5, -9.0], [0.25, 9.0]]),
                  tf1.scatter_update(emb, ids, tf.ones([tf.size(ids), 2]))]
        if add:
            writes.append(tf1.scatter_add(emb, [5, 5], tf.ones([2, 2])))
    return g, ids, emb, train, writes


@pytest.mark.parametrize("route,parts", [("ps", 3), ("sharded", None)])
def test_writes_of_part_of_a_table_between_steps_reach_its_rows(route, parts):
    """scatter_update, a slice's assign, scatter_nd_update and scatter_max of a table on
    the servers in 3 parts, or sharded, leave what they leave in a plain session (and
    scatter_add where the table is sharded); an id out of range fails the run with
    nothing written. Before, they wrote the table the rewrite leaves unused, and the run
    failed with TensorFlow's 'Resource ... does not exist'."""
    g, ids, emb, train, writes = _table_with_writes(add=route == "sharded")
    plain_g, plain_ids, plain_emb, plain_train, plain_writes = _table_with_writes(
        add=route == "sharded")
    config = tfpar.Config(sparse_route={"emb": route}, partitions=parts)
    with tfpar.get_runner(g, config=config) as runner, tf1.Session(graph=plain_g) as sess:
        if route == "ps":
            assert len(runner.plan.variable("emb").parts) == 3
        with plain_g.as_default():
            sess.run(tf1.global_variables_initializer())
        plain_emb.load(runner.run(emb), sess)
        for write, plain_write in zip(writes, plain_writes):
            runner.run(write, {ids: [2, 3]})
            sess.run(plain_write, {plain_ids: [2, 3]})
            np.testing.assert_array_equal(runner.run(emb), sess.run(plain_emb),
                                          err_msg=write.name)
            runner.run(train, {ids: [1, 2, 2]})
            sess.run(plain_train, {plain_ids: [1, 2, 2]})
            np.testing.assert_allclose(runner.run(emb), sess.run(plain_emb), rtol=1e-6)
        before = runner.run(emb)
        with pytest.raises(tf.errors.InvalidArgumentError, match="ids out of range"):
            runner.run(writes[4], {ids: [1, 7]})
        np.testing.assert_array_equal(runner.run(emb), before)


def test_an_add_to_part_of_a_table_on_the_servers_is_refused_before_any_server_starts():
    """Every worker runs a write between steps; the servers would apply an add once per
    worker, so the runner is refused at planning, naming the routes that can do it, and a
    runner made next in the same process starts its servers and trains."""
    g, _, _, _, _ = _table_with_writes(add=True)
    with pytest.raises(tfpar.NotYetSupportedError,
                       match=r"cannot put 'emb' on the parameter servers: op "
                             r"'ResourceScatterAdd' adds to it.*once per worker.*"
                             r"sparse_route=\{'emb': 'sharded'\}"):
        tfpar.get_runner(g, config=tfpar.Config(sparse_route={"emb": "ps"}))
    g, ids, emb, train, _ = _table_with_writes(add=False)
    with tfpar.get_runner(g, config=tfpar.Config(sparse_route={"emb": "ps"})) as runner:
        before = runner.run(emb)
        runner.run(train, {ids: [1]})
        assert not np.allclose(runner.run(emb)[1], before[1])


def test_a_second_model_on_the_servers_has_variables_of_its_own():
    """Two PS jobs' runners one after the other in one process (a script's second model,
    or a sweep), the same variable names, the dense layer float64 then float32: each
    trains as a plain session does. Their sessions run on the worker's TensorFlow server,
    which keeps variables by name; before, the second runner met the first's `w` there
    and failed to initialise it ("wrong dtype")."""
    for dtype in (tf.float64, tf.float32):
        g = tf.Graph()
        with g.as_default():
            tf1.set_random_seed(1)
            emb = tf1.get_variable("emb", [6, 2], dtype=dtype)
            w = tf1.get_variable("w", [2, 1], dtype=dtype)
            loss = tf.reduce_sum(tf.matmul(tf.nn.embedding_lookup(emb, [1, 2, 2]), w) ** 2)
            train = tf1.train.AdagradOptimizer(0.1).minimize(loss)
        with tfpar.get_runner(g, config=tfpar.Config(sparse_route={"emb": "ps"})) as runner:
            start = runner.run([emb, w])
            for _ in range(3):
                runner.run(train)
            got = runner.run([emb, w])
        with g.as_default(), tf1.Session(graph=g) as sess:
            sess.run(tf1.global_variables_initializer())
            emb.load(start[0], sess)
            w.load(start[1], sess)
            for _ in range(3):
                sess.run(train)
            for x, y in zip(got, sess.run([emb, w])):
                assert x.dtype == dtype.as_numpy_dtype
                np.testing.assert_allclose(x, y, rtol=1e-6)


_AFTER_A_STOP = r"""
import tensorflow as tf
tf1 = tf.compat.v1
tf1.disable_eager_execution()
import tfpar
def graph(bad):
    g = tf.Graph()
    with g.as_default():
        emb = tf1.get_variable("emb", [6, 2])
        loss = tf.reduce_sum(tf.nn.embedding_lookup(emb, [1, 2]) ** 2)
        if bad:  # a use the servers' rewrite refuses, after the servers started
            loss += tf.reduce_sum(tf.gather_nd(emb, [[1]]))
        tf1.train.AdagradOptimizer(0.1).minimize(loss)
    return g
from tfpar.runtime import cluster
try:
    tfpar.get_runner(graph(True), config=tfpar.Config(sparse_route={"emb": "ps"}))
except tfpar.TfparError as e:
    print(type(e).__name__ + ":", str(e).replace("\n", " "), flush=True)
print("servers started:", cluster.current() is not None, flush=True)
import psutil  # the PS process started ahead of the refused rewrite is gone
print("processes left:", [" ".join(c.cmdline()) for c in psutil.Process().children()], flush=True)
with tfpar.get_runner(graph(False), config=tfpar.Config(sparse_route={"emb": "ps"})) as r:
    before = r.run("emb:0")
    r.run(tf1.get_collection(tf1.GraphKeys.TRAIN_OP, scope=None) or "Adagrad")
    print("trained:", bool((r.run("emb:0") != before).any()), flush=True)
"""


def test_a_refusal_of_the_servers_rewrite_starts_no_server_and_a_retry_trains():
    """The servers start only after the rewrite succeeded: a use of a variable the
    servers' rewrite refuses leaves no server behind (nor the PS process started ahead
    of it, `cluster.prestart`), and a later get_runner in the
    process (a notebook's retry with the graph fixed) starts them and trains. Before,
    the refusal came with the servers up, it stopped them, and the retry waited for ever
    on the stopped server."""
    import subprocess
    import sys
    from tests.support.launch import REPO
    proc = subprocess.run([sys.executable, "-c", _AFTER_A_STOP], cwd=REPO, text=True,
                          capture_output=True, timeout=180,
                          env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.stdout.splitlines() == [
        proc.stdout.splitlines()[0], "servers started: False", "processes left: []",
        "trained: True"], \
        proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.startswith("NotYetSupportedError: variable 'emb' is used by op "
                                  "'GatherNd'")


def test_graph_without_update_ops():
    g = tf.Graph()
    with g.as_default():
        tf.reduce_sum(tf1.get_variable("w", [2]))
    with pytest.raises(tfpar.TfparError, match="no optimizer update ops"):
        tfpar.get_runner(g)


def test_hybrid_on_one_worker_runs_a_real_parameter_server():
    """A lone process (job of size 1) still gets its PS process and trains as one device."""
    graph, h = models.build(sparse=True, optimizer="adagrad")
    with tfpar.get_runner(graph) as runner:
        assert runner.plan.mode == "HYBRID" and runner.plan.num_ps == 1
        x, y, ids = models.batches(1, 8)[0]
        before = runner.run("emb:0")
        runner.run(h["train_op"], feed_dict=models.feed(h, x, y, ids))
        after = runner.run("emb:0")
        touched = sorted(set(ids.tolist()))
        assert not np.allclose(after[touched], before[touched])
        untouched = [i for i in range(models.VOCAB) if i not in touched]
        np.testing.assert_array_equal(after[untouched], before[untouched])
        comm = runner.communication()
        assert comm["steps"] == 1 and comm["ps_push"] > 0 and comm["ps_pull"] > 0
        assert runner.ps_pushes() == {"emb/part_0": 1}


def test_train_ops_run_by_turns_each_take_their_own_servers_step():
    """A GAN's generator and discriminator, trained by turns with variables on the
    servers: each minimize() result is an update group of its own (the plan says so),
    with its own servers' step, and the variables after turns equal a plain session's.
    A run of part of a group's updates there (one table's update op alone) is refused,
    naming both sides and the fix, before anything runs."""
    def gan():
        g = tf.Graph()
        with g.as_default():
            tf1.set_random_seed(7)
            ids = tf1.placeholder(tf.int64, [None])
            real = tf1.placeholder(tf.float32, [None, 1])
            gen = tf1.get_variable("gen", [6, 2], use_resource=True)
            disc = tf1.get_variable("disc", [6, 2], use_resource=True)
            disc2 = tf1.get_variable("disc2", [6, 2], use_resource=True)
            dense = tf1.get_variable("dense", [2, 1], use_resource=True)
            fake = tf.matmul(tf.nn.embedding_lookup(gen, ids), dense)
            judged = tf.matmul(tf.nn.embedding_lookup(disc, ids)
                               + tf.nn.embedding_lookup(disc2, ids), dense)
            g_loss = tf.reduce_sum(fake * judged)
            d_loss = tf.reduce_sum(tf.square(judged - real)) - g_loss
            g_train = tf1.train.AdagradOptimizer(0.1).minimize(g_loss, var_list=[gen])
            d_train = tf1.train.AdamOptimizer(0.1).minimize(d_loss,
                                                            var_list=[disc, disc2, dense])
            init = tf1.global_variables_initializer()
        return g, dict(ids=ids, real=real, g_train=g_train, d_train=d_train, init=init,
                       variables=[gen, disc, disc2, dense])

    def turns(run, h):
        for step in range(3):
            run(h["d_train"], {h["ids"]: [step, 2, 5], h["real"]: [[1.0], [0.5], [-1.0]]})
            run(h["g_train"], {h["ids"]: [1, step]})  # no real input: d's alone needs it
        return [run(v) for v in h["variables"]]

    g, h = gan()
    with tf1.Session(graph=g) as session:
        session.run(h["init"])
        expected = turns(session.run, h)
    g, h = gan()
    with tfpar.get_runner(g) as runner:  # HYBRID: the tables on the servers
        assert runner.plan.update_groups == (("gen",), ("disc", "disc2", "dense"))
        assert "updated by different runs" in runner.plan.table()
        from tfpar.plan import Plan
        assert Plan.from_json(runner.plan.to_json()).update_groups == runner.plan.update_groups
        before = runner.run("disc")
        part = list(runner.plan.variable("disc").gradients[0].ops)  # disc's update alone
        with pytest.raises(tfpar.TfparError, match=r"this run updates \['disc'\] on the "
                                                   r"parameter servers but not \['disc2'\]"):
            runner.run(part, {h["ids"]: [1, 2], h["real"]: [[1.0], [0.5]]})
        np.testing.assert_array_equal(runner.run("disc"), before)  # nothing ran
        got = turns(runner.run, h)
        assert runner.communication()["steps"] == 6  # each side's runs count
        runner.run([h["g_train"], h["d_train"]], {h["ids"]: [1], h["real"]: [[1.0]]})
        assert runner.communication()["steps"] == 7  # both sides in one run: one step
    for want, have in zip(expected, got):
        np.testing.assert_allclose(have, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("route", ["ps", "allgather"])
def test_a_scripts_own_initialiser_run_draws_what_a_plain_session_draws(route):
    """A seeded TF1 script runs global_variables_initializer() through the runner: its
    random initialisers draw what they draw in a plain session (before, the runner's own
    start-up had drawn their first numbers, so the script's run drew the second), on a
    table on the servers and replicated alike; tolerance 0."""
    def build():
        g = tf.Graph()
        with g.as_default():
            tf1.set_random_seed(11)
            ids = tf1.placeholder(tf.int64, [None])
            emb = tf1.get_variable("emb", [7, 3], use_resource=True)
            w = tf1.get_variable("w", [3, 1], initializer=tf1.truncated_normal_initializer())
            loss = tf.reduce_sum(tf.matmul(tf.nn.embedding_lookup(emb, ids), w))
            train = tf1.train.AdagradOptimizer(0.1).minimize(loss)
            init = tf1.global_variables_initializer()
        return g, ids, train, init, [emb, w]

    g, ids, train, init, names = build()
    with tf1.Session(graph=g) as session:
        session.run(init)
        expected = session.run(names)
        session.run(train, {ids: [1, 4]})
        trained = session.run(names)
    g, ids, train, init, names = build()
    with tfpar.get_runner(g, config=tfpar.Config(sparse_route={"emb": route})) as runner:
        assert runner.plan.variable("emb").route == route
        runner.run(init)
        for want, got in zip(expected, runner.run(names)):
            np.testing.assert_array_equal(got, want)
        runner.run(train, {ids: [1, 4]})
        for want, got in zip(trained, runner.run(names)):
            np.testing.assert_allclose(got, want, rtol=1e-6)


def test_assign_results_and_unmappable_fetches(built):
    """An assign's result is its new value (a resource variable's _UnreadVariable), an
    op's is None; what the runner cannot map is a TfparError naming it."""
    graph, h = built
    with graph.as_default():
        lr = tf1.get_variable("lr_var", [], trainable=False, use_resource=True,
                              initializer=tf1.constant_initializer(0.5))
        new_lr = tf1.placeholder(tf.float32, [], name="new_lr")
        update = tf1.assign(lr, new_lr)
        bump = tf1.assign_add(lr, 1.0)
    with tfpar.get_runner(graph) as runner:
        assert runner.run(update, {new_lr: 0.25}) == pytest.approx(0.25)
        assert runner.run(update.op, {new_lr: 0.5}) is None
        assert runner.run(bump) == pytest.approx(1.5) and runner.run(lr) == pytest.approx(1.5)
        with pytest.raises(tfpar.TfparError, match="cannot read 'Assign.*' as a variable"):
            runner._read(update.op.name)  # pylint: disable=protected-access
        with pytest.raises(tfpar.TfparError, match="cannot fetch 3"):
            runner.run(3)


@pytest.mark.parametrize("config", [{}, {"run_mode": "AR"}, {"sparse_route": "auto"}],
                         ids=["hybrid", "ar", "density_routing"])
def test_get_runner_plans_once_and_leaves_the_config_as_given(monkeypatch, config):
    """One pass: whatever get_runner measures goes into one Measurements value, make_plan
    runs once on it, and the user's Config is not rewritten."""
    from tfpar.runtime import runner as runner_module
    calls = []
    real = runner_module.make_plan

    def counting(*args, **kwargs):
        calls.append(args[3] if len(args) > 3 else kwargs.get("measured"))
        return real(*args, **kwargs)

    monkeypatch.setattr(runner_module, "make_plan", counting)
    graph, h = models.build(sparse=True, optimizer="adagrad")
    given = tfpar.Config(density_steps=1, search_feed=lambda step: data_feed(h), **config)
    before = repr(given)
    with tfpar.get_runner(graph, config=given) as runner:
        runner.run(h["train_op"], feed_dict=data_feed(h))
        assert len(calls) == 1, calls
        assert repr(given) == before
        measured_routes = calls[0].links is not None
        assert measured_routes == (config.get("sparse_route") == "auto")
        if measured_routes:  # the plan shows what was measured and chosen
            assert set(runner.plan.routing.choices) == {"emb"}


def test_config_checkpoint_dir_resumes_without_code(tmp_path):
    """Config(checkpoint_dir=..., checkpoint_every_steps=2): saved in the background every
    2 training steps (complete when the runner closes), restored by the next get_runner
    before its first step."""
    folder = str(tmp_path / "new" / "ckpt")
    config = tfpar.Config(checkpoint_dir=folder, checkpoint_every_steps=2)
    graph, h = models.build(optimizer="adam", init_seed=1)
    with tfpar.get_runner(graph, config=config) as runner:
        for step in range(5):
            runner.run(h["train_op"], feed_dict=data_feed(h, step))
            runner.run(h["loss"], feed_dict=data_feed(h, step))  # not a step: no save
        saved = runner.run(_variable(graph, "w1"))  # after step 5; last saved after step 4
    state = tf.train.get_checkpoint_state(folder)
    assert [p.rsplit("-", 1)[1] for p in state.all_model_checkpoint_paths] == ["2", "4"]
    reader = tf.train.load_checkpoint(folder)
    assert int(reader.get_tensor("global_step")) == 4
    # What a save killed mid-write leaves (TensorFlow's bundle writer's temporary files):
    # deleted when the job resumes; the complete checkpoints stay.
    partial = [os.path.join(folder, f"model.ckpt-6{s}.tempstate123") for s in
               (".index", ".data-00000-of-00001")]
    for f in partial:
        open(f, "w").close()
    graph2, h2 = models.build(optimizer="adam", init_seed=2)  # other initial values
    with tfpar.get_runner(graph2, config=config) as runner:
        assert not any(os.path.exists(f) for f in partial)
        assert os.path.exists(state.all_model_checkpoint_paths[-1] + ".index")
        assert int(runner.run(_variable(graph2, "global_step"))) == 4
        np.testing.assert_array_equal(runner.run(_variable(graph2, "w1")),
                                      reader.get_tensor("w1"))
        assert not np.array_equal(runner.run(_variable(graph2, "w1")), saved)


def _variable(graph, name):
    return next(v for v in graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)
                if v.op.name == name)


@pytest.mark.parametrize("kwargs,message", [
    ({"checkpoint_every_steps": 2}, "need Config.checkpoint_dir"),
    ({"checkpoint_dir": "x", "checkpoint_every_steps": 0}, "must be a positive int"),
    ({"checkpoint_dir": "x", "checkpoint_every_secs": 5, "tiling": {"dense/kernel": "C"}},
     "use checkpoint_every_steps"),
    ({"checkpoint_dir": "x", "checkpoint_every_secs": 5, "sparse_route": {"emb": "sharded"}},
     "cannot save sharded variables")])
def test_bad_checkpoint_configs_are_clear_errors(kwargs, message):
    with pytest.raises(tfpar.TfparError, match=message):
        tfpar.Config(**kwargs)


def test_a_moving_average_of_a_sharded_variable_is_split_with_it():
    """An ExponentialMovingAverage of a sharded variable is row by row: its shadow is
    sharded alike and updated from the worker's own rows, equal to a plain session's (one
    worker: the rows all its own; several workers: tests/jobs/test_equivalence.py); a
    Saver of the graph is not a read that matters (the runner saves the variable)."""
    graph, h = models.build(optimizer="adagrad", sparse=True, ema=True, init_seed=5)
    with graph.as_default():
        tf1.train.Saver()
        shadow = next(v for v in tf1.global_variables()
                      if v.op.name == "emb/ExponentialMovingAverage")
        init = tf1.global_variables_initializer()
    batches = models.batches(3, 8)
    with tf1.Session(graph=graph) as session:
        session.run(init)
        for x, y, ids in batches:
            session.run(h["train_op"], feed_dict=models.feed(h, x, y, ids))
        want = session.run(shadow)
    graph, h = models.build(optimizer="adagrad", sparse=True, ema=True, init_seed=5)
    with tfpar.get_runner(graph, config=tfpar.Config(sparse_route="sharded")) as runner:
        assert runner.plan.variable("emb/ExponentialMovingAverage").route == "sharded"
        assert runner.plan.variable("emb/ExponentialMovingAverage").slot_of == "emb"
        for x, y, ids in batches:
            runner.run(h["train_op"], feed_dict=models.feed(h, x, y, ids))
        got = runner.run("emb/ExponentialMovingAverage:0")
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_a_whole_read_of_a_sharded_variable_is_refused_with_the_fix():
    """Route "sharded" supports lookups of a variable's rows and its moving averages: a
    read of it whole after the step (a sum written into another variable) is refused
    before anything runs where the variable is named to it, naming the variable and the
    route that takes it; under the global route it takes the allgather instead."""
    graph, h = models.build(optimizer="adagrad", sparse=True)
    with graph.as_default():
        emb = next(v for v in tf1.global_variables() if v.op.name == "emb")
        with tf.control_dependencies([h["train_op"]]):
            total = tf1.get_variable("total", [], trainable=False)
            total.assign(tf.reduce_sum(emb), name="total_of_emb")
    with pytest.raises(tfpar.NotYetSupportedError,
                       match=r"'emb' is read by op .*total_of_emb.* after the "
                             r"training step.*sparse_route=\{'emb': 'ps'\}"):
        tfpar.get_runner(graph, config=tfpar.Config(sparse_route={"emb": "sharded"}))


def _lookup_in_a_cond():
    """An embedding looked up inside a tf.cond's branch, another outside: (graph, ids,
    train_op)."""
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(3)
        ids = tf1.placeholder(tf.int64, [None], name="ids")
        emb = tf1.get_variable("emb", [10, 3])
        other = tf1.get_variable("other", [10, 3])
        rows = tf.cond(tf.size(ids) > 0, lambda: tf.gather(emb, ids),
                       lambda: tf.zeros([0, 3]))
        loss = tf.reduce_sum(tf.square(rows * tf.gather(other, ids)))
        train = tf1.train.AdagradOptimizer(0.1).minimize(loss)
    return graph, ids, train


def test_a_lookup_inside_a_cond_of_a_sharded_variable_is_refused_naming_the_cond():
    """A tf.cond takes the variable whole for its branch, whatever the branch reads: the
    refusal (the variable named to route "sharded") says so, not "a moving average", and
    names the fix."""
    graph, _, _ = _lookup_in_a_cond()
    with pytest.raises(tfpar.NotYetSupportedError,
                       match=r"'emb' is read by op 'cond' \(If\) in the training step "
                             r"\(a tf\.cond, tf\.while_loop or function takes it whole.*"
                             r"sparse_route=\{'emb': 'ps'\}"):
        tfpar.get_runner(graph, config=tfpar.Config(sparse_route={"emb": "sharded",
                                                                  "other": "sharded"}))


def test_under_the_global_sharded_route_a_table_it_cannot_split_takes_the_allgather():
    """sparse_route="sharded" for every table: the one a tf.cond looks up takes the
    allgather (no server: a job asked to shard opens no port), the plan says why, the
    other is sharded, and training equals a plain session's."""
    feeds = [np.array([1, 4, 4, 7]), np.array([0, 9, 4])]
    graph, ids, train = _lookup_in_a_cond()
    with graph.as_default(), tf1.Session(graph=graph) as session:
        session.run(tf1.global_variables_initializer())
        for f in feeds:
            session.run(train, {ids: f})
        want = session.run(tf1.trainable_variables())
    graph, ids, train = _lookup_in_a_cond()
    with tfpar.get_runner(graph, config=tfpar.Config(sparse_route="sharded")) as runner:
        assert runner.plan.variable("emb").route == "allgather"
        assert runner.plan.variable("other").route == "sharded"
        assert any(n.startswith("emb: allgather, not sharded rows: op 'cond' reads the whole "
                                "variable") for n in runner.plan.notes), runner.plan.notes
        for f in feeds:
            runner.run(train, {ids: f})
        with graph.as_default():
            got = runner.run(tf1.trainable_variables())
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)


def test_fed_ids_cannot_go_ahead_and_the_error_says_so():
    """Config(ids_ahead=True) reads the input a step ahead: ids from a feed are refused
    with the fix (tests/runtime/test_ids_ahead.py: the rest)."""
    graph, h = models.build(optimizer="adagrad", sparse=True)
    with pytest.raises(tfpar.NotYetSupportedError,
                       match=r"ids of the lookups of emb are computed from 'ids' "
                             r"\(Placeholder\).*tf\.data.*leave ids_ahead False"):
        tfpar.get_runner(graph, config=tfpar.Config(sparse_route="sharded", ids_ahead=True))


def test_a_graph_built_with_eager_execution_on_runs_like_a_session(tmp_path):
    """TF2's default mode (eager execution on, the graph built under `as_default`) is what a
    plain Session accepts: the runner reads, counts and saves without building ops
    outside the job's graph (a process of its own: this suite turns eager off)."""
    import subprocess
    import sys
    code = f"""
import tensorflow as tf
import tfpar
from tests.support import models
assert tf.executing_eagerly()
graph, h = models.build(optimizer="adagrad", sparse=True)
with tfpar.get_runner(graph, "localhost:1") as runner:
    for step, (x, y, ids) in enumerate(models.batches(2, 8)):
        runner.run(h["train_op"], feed_dict=models.feed(h, x, y, ids))
    assert runner.communication()["steps"] == 2
    assert runner.communication()["steps"] == 2
    runner.ps_pushes()
    runner.save({str(tmp_path / 'model')!r})
print("trained eagerly-built graph")
"""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=240, cwd=env["PYTHONPATH"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trained eagerly-built graph" in proc.stdout

