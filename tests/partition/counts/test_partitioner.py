"""tfpar.partitioner: what it marks, and its bad input (no cluster unless stated)."""
import pytest
import tensorflow as tf

import tfpar
from tfpar.graph.analysis import analyse
from tfpar.graph.partitioner import marked_groups
from tfpar.runtime.trials import check_groups, training_step

tf1 = tf.compat.v1


def _graph(body):
    g = tf.Graph()
    with g.as_default():
        ids = tf1.placeholder(tf.int32, [None], name="ids")
        loss = body(ids)
        tf1.train.AdagradOptimizer(0.1).minimize(
            loss, global_step=tf1.train.get_or_create_global_step())
    return g


def test_context_manager_and_variable_scope_forms_mark_their_variables():
    marks = tfpar.partitioner(min_partitions=2, max_partitions=8)
    other = tfpar.partitioner()

    def body(ids):
        with marks:
            a = tf1.get_variable("a", [30, 4])
            b = tf1.get_variable("b", [20, 4])
        with tf1.variable_scope("scoped", partitioner=other):
            c = tf1.get_variable("c", [10, 4])
        d = tf1.get_variable("d", [10, 4])
        lookups = [tf.nn.embedding_lookup(v, ids % 10) for v in (a, b, d)]
        return tf.reduce_sum(sum(lookups) + tf1.nn.embedding_lookup(c, ids % 10))

    g = _graph(body)
    groups = marked_groups(g)
    by_vars = {grp.variables: grp for grp in groups.values()}
    assert set(by_vars) == {("a", "b"), ("scoped/c/part_0",)}
    assert (by_vars[("a", "b")].min_partitions, by_vars[("a", "b")].max_partitions) == (2, 8)
    # The group names follow the order of first use, so a rebuilt model keeps its memory.
    assert sorted(groups) == ["partitioner_0", "partitioner_1"]
    check_groups(groups, analyse(g), "HYBRID")
    assert training_step(g, analyse(g)) == ["Adagrad"]


def test_the_marked_variables_are_split_as_decided():
    from tfpar.plan.planner import make_plan
    from tfpar.plan.layout import parse_resources

    def body(ids):
        with tfpar.partitioner():
            emb = tf1.get_variable("emb", [30, 4])
        return tf.reduce_sum(tf.nn.embedding_lookup(emb, ids))

    g = _graph(body)
    plan = make_plan(analyse(g), tfpar.Config(partitions={"emb": 3}), parse_resources("h:2"))
    assert [(p.start, p.stop, p.step) for p in plan.variable("emb").parts] == [
        (0, 30, 3), (1, 30, 3), (2, 30, 3)]
    plan = make_plan(analyse(g), tfpar.Config(partitions={"emb": 3}, ps_rows="ranges"),
                     parse_resources("h:2"))
    assert [(p.start, p.stop) for p in plan.variable("emb").parts] == [(0, 10), (10, 20),
                                                                       (20, 30)]


def test_bad_bounds():
    with pytest.raises(tfpar.TfparError, match="min_partitions=8 is larger than max_partitions=4"):
        tfpar.partitioner(min_partitions=8, max_partitions=4)
    with pytest.raises(tfpar.TfparError, match="min_partitions must be a positive int"):
        tfpar.partitioner(min_partitions=0)
    with pytest.raises(tfpar.TfparError, match="search_partitions must be"):
        tfpar.Config(search_partitions="sometimes")


def test_a_minimum_above_the_rows_is_an_error():
    def body(ids):
        with tfpar.partitioner(min_partitions=50):
            emb = tf1.get_variable("emb", [30, 4])
        return tf.reduce_sum(tf.nn.embedding_lookup(emb, ids))

    with pytest.raises(tfpar.TfparError, match=r"min_partitions=50\) is larger than the 30 rows"):
        tfpar.get_runner(_graph(body))


def test_a_partitioner_around_a_dense_variable_is_an_error_in_hybrid_and_ignored_in_ar():
    def body(ids):
        with tfpar.partitioner():
            w = tf1.get_variable("w", [4, 4])
        emb = tf1.get_variable("emb", [30, 4])
        return tf.reduce_sum(tf.matmul(tf.nn.embedding_lookup(emb, ids), w))

    g = _graph(body)
    with pytest.raises(tfpar.TfparError, match="marks 'w', whose gradient is dense"):
        tfpar.get_runner(g)
    check_groups(marked_groups(g), analyse(g), "AR")  # AR splits nothing: marks are ignored


def test_a_search_on_a_fed_graph_needs_search_feed(tmp_path):
    """A lone process (job of size 1) with a real PS: the trial cannot run without feeds."""
    def body(ids):
        with tfpar.partitioner(max_partitions=2):
            emb = tf1.get_variable("emb", [30, 4])
        return tf.reduce_sum(tf.nn.embedding_lookup(emb, ids))

    config = tfpar.Config(search_cache=str(tmp_path), search_steps=(0, 1))
    with pytest.raises(tfpar.TfparError, match="search_feed"):
        tfpar.get_runner(_graph(body), config=config)
