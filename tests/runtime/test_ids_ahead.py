"""The input a step ahead (Config(ids_ahead=True), route "sharded"): one process, against a
plain session of the same graph. Every batch passes through the input once and in order,
so the losses, the fetched batches and the variables are exactly a plain session's
(tolerance 0: the same ops on the same values); the last batch trains without a next one
and the input's end surfaces at the run after it; a checkpoint holds the batch read
ahead. Several workers: tests/jobs/test_ids_ahead.py; fed ids refused:
tests/runtime/test_runner.py (a refusal stops this process's job: it runs after the
runner tests that start servers)."""
import numpy as np
import pytest
import tensorflow as tf

from examples import lm
from tests.support import models
import tfpar
from tfpar.graph.analysis import analyse
from tfpar.plan.layout import parse_resources
from tfpar.plan.planner import make_plan

tf1 = tf.compat.v1
AHEAD = tfpar.Config(sparse_route="sharded", ids_ahead=True)


def _variables(graph):
    return graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)


def _lm(sampled=True):
    return lm.build_graph(lm.zipf_text(500, 3000), 500, batch_size=16, sampled=sampled)


def test_the_lm_trains_as_a_plain_session_with_its_ids_a_step_ahead():
    """examples/lm.py: its ids from a shuffled tf.data pipeline, a sampled softmax (a
    stateful sampler on the labels, a source of the ids) over sharded weights."""
    graph, loss, train = _lm()
    with tf1.Session(graph=graph) as session:
        session.run(tf1.global_variables_initializer())
        want_losses = [session.run([loss, train])[0] for _ in range(6)]
        want = session.run(_variables(graph))
    graph, loss, train = _lm()
    with tfpar.get_runner(graph, config=AHEAD) as runner:
        assert runner.plan.ids_ahead and "sharded lookups: each batch's ids" in runner.plan.table()
        losses = [runner.run([loss, train])[0] for _ in range(6)]
        got = runner.run(_variables(graph))
    assert losses == want_losses
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_a_feature_column_recommender_trains_as_a_plain_session():
    """examples/recommender.py: ten tables looked up by feature columns (sparse segment
    sums of ids gathered from the input's rows), FTRL and Adagrad."""
    from examples import recommender

    def build():
        return recommender.build_graph(items=2000, batch_size=32, examples=2000)
    graph, loss, train = build()
    with tf1.Session(graph=graph) as session:
        session.run(tf1.global_variables_initializer())
        want_losses = [session.run([loss, train])[0] for _ in range(4)]
        want = session.run(_variables(graph))
    graph, loss, train = build()
    with tfpar.get_runner(graph, config=AHEAD) as runner:
        assert runner.plan.ids_ahead
        assert [runner.run([loss, train])[0] for _ in range(4)] == want_losses
        for a, b in zip(runner.run(_variables(graph)), want):
            np.testing.assert_array_equal(a, b)


def _finite(noise=True):
    """Five batches of ids checked by an assertion that the ids and the loss wait for, a
    random op on them (another source), an embedding."""
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(3)
        dataset = tf.data.Dataset.range(40).map(lambda i: (i * 7) % 50).batch(8)
        ids = tf1.data.make_one_shot_iterator(dataset).get_next()
        check = tf.raw_ops.Assert(condition=tf.reduce_all(ids < 50), data=[ids])  # no outputs
        with tf.control_dependencies([check]):
            ids = tf.identity(ids)
        scale = 1.0 + tf1.random_uniform(tf.shape(ids), seed=2) if noise else 1.0
        emb = tf1.get_variable("emb", [50, 4],
                               initializer=tf1.random_uniform_initializer(seed=1))
        x = tf.nn.embedding_lookup(emb, ids)
        with tf.control_dependencies([check]):
            loss = tf.reduce_mean(tf.reduce_sum(x * x, 1) * scale)
        train = tf1.train.AdagradOptimizer(0.5).minimize(loss)
    return graph, ids, loss, train


def test_every_batch_trains_once_and_the_end_surfaces_after_the_last():
    graph, ids, loss, train = _finite()
    plain = []
    with tf1.Session(graph=graph) as session:
        session.run(tf1.global_variables_initializer())
        while True:
            try:
                plain.append(session.run([ids, loss, train])[:2])
            except tf.errors.OutOfRangeError:
                break
        want = session.run(_variables(graph))
    graph, ids, loss, train = _finite()
    got = []
    with tfpar.get_runner(graph, config=AHEAD) as runner:
        while True:
            try:  # a fetch of the batch is the batch the step trains on
                got.append(runner.run([ids, loss, train])[:2])
            except tf.errors.OutOfRangeError:
                break
        with pytest.raises(tf.errors.OutOfRangeError):
            runner.run(train)
        values = runner.run(_variables(graph))
    assert len(got) == len(plain) == 5
    for (a_ids, a_loss), (b_ids, b_loss) in zip(got, plain):
        np.testing.assert_array_equal(a_ids, b_ids)
        assert a_loss == b_loss
    for a, b in zip(values, want):
        np.testing.assert_array_equal(a, b)


def test_a_feed_of_the_batch_read_ahead_is_refused():
    """A plain session would train on a fed batch tensor; the step reads the staged batch,
    so a feed of it would be ignored: refused, naming it, before anything runs."""
    graph, ids, loss, train = _finite()
    with tfpar.get_runner(graph, config=AHEAD) as runner:
        with pytest.raises(tfpar.TfparError, match=r"feed of 'Identity:0'.*step "
                                                   r"ahead.*leave ids_ahead False"):
            runner.run(train, feed_dict={ids: np.arange(8)})
        runner.run(train)  # the job goes on


def test_a_checkpoint_keeps_the_batch_read_ahead(tmp_path, caplog):
    """Saved after 3 steps (the 4th batch read ahead, its iterator a batch further): a new
    runner that restores it trains on the 4th batch next, as the first would have; one
    without ids_ahead skips that batch and says so."""
    graph, loss, train = _lm(sampled=False)  # (a sampler's random state is not saved)
    with tfpar.get_runner(graph, config=AHEAD) as runner:
        for _ in range(3):
            runner.run(train)
        prefix = runner.save(str(tmp_path / "model"))
        want_losses = [runner.run([loss, train])[0] for _ in range(3)]
        want = runner.run(_variables(graph))
    graph, loss, train = _lm(sampled=False)
    with tfpar.get_runner(graph, config=AHEAD) as runner:
        runner.restore(prefix)
        assert [runner.run([loss, train])[0] for _ in range(3)] == want_losses
        for a, b in zip(runner.run(_variables(graph)), want):
            np.testing.assert_array_equal(a, b)
    graph, loss, train = _lm(sampled=False)
    with tfpar.get_runner(graph, config=tfpar.Config(sparse_route="sharded")) as runner:
        runner.restore(prefix)
        assert runner.run([loss, train])[0] != want_losses[0]
    assert "a batch past the model" in caplog.text


@pytest.mark.parametrize("config,why", [
    (dict(sparse_route="sharded"), "local aggregation is on"),
    (dict(sparse_route={"emb": "sharded", "bias": "ps"}, local_aggregation=False),
     "a sparse variable is not on route 'sharded'"),
    (dict(sparse_route="ps"), "no variable is on route 'sharded'")])
def test_the_plan_says_why_ids_do_not_go_ahead(config, why):
    ids, y = models.input_batches(2, 4)
    graph, _, _ = models.build_from_input(ids, y)
    plan = make_plan(analyse(graph), tfpar.Config(ids_ahead=True, **config),
                     parse_resources("a:2,b:2"))
    assert not plan.ids_ahead
    assert any(n.startswith(f"ids ahead: off: {why}") for n in plan.notes), plan.notes
    on = make_plan(analyse(graph), tfpar.Config(ids_ahead=True, sparse_route="sharded",
                                                local_aggregation=False),
                   parse_resources("a:2,b:2"))
    assert on.ids_ahead and type(on).from_json(on.to_json()).ids_ahead


def test_ids_ahead_must_be_a_bool():
    with pytest.raises(tfpar.TfparError, match="ids_ahead must be True or False"):
        tfpar.Config(ids_ahead="yes")
