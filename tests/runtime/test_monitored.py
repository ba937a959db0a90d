"""tfpar.MonitoredTrainingSession in one process: its arguments as TensorFlow's take
them (tests/jobs/test_monitored.py: the training loop in real jobs)."""
import numpy as np
import pytest
import tensorflow as tf

import tfpar

tf1 = tf.compat.v1


def test_a_tfpar_config_given_as_the_sessions_config_is_a_clear_error():
    """MonitoredTrainingSession's `config` is TensorFlow's ConfigProto; a tfpar.Config
    there (or a ConfigProto as tfpar_config) names the argument to use. Before, it failed
    inside protobuf's CopyFrom."""
    with pytest.raises(tfpar.TfparError, match=r"give the tfpar.Config as tfpar_config="):
        tfpar.MonitoredTrainingSession(config=tfpar.Config(run_mode="AR"))
    with pytest.raises(tfpar.TfparError, match=r"tfpar_config=tfpar.Config"):
        tfpar.MonitoredTrainingSession(tfpar_config=tf1.ConfigProto())


def test_a_scaffolds_init_fn_loads_a_pretrained_table_into_the_monitored_session(tmp_path):
    """Scaffold(init_fn=f) is called as f(scaffold, session) after initialisation, as TF
    calls it (TF-slim's assign_from_checkpoint_fn, a Saver of other names restoring a
    pretrained table). Before, tfpar called TF's bound wrapper with both and failed."""
    def build():
        g = tf.Graph()
        with g.as_default():
            emb = tf1.get_variable("emb", [6, 2])
            loss = tf.reduce_sum(tf.nn.embedding_lookup(emb, [1, 4]) ** 2)
            train = tf1.train.AdagradOptimizer(0.1).minimize(
                loss, global_step=tf1.train.get_or_create_global_step())
            named = tf1.train.Saver({"pretrained/table": emb})
        return g, emb, train, named

    g, emb, _, named = build()
    with tf1.Session(graph=g) as sess:
        sess.run(emb.assign(tf.fill([6, 2], 0.25)))
        pretrained = named.save(sess, str(tmp_path / "pretrained"))
    g, emb, train, named = build()
    calls = []

    def init_fn(scaffold, session):
        calls.append(scaffold)
        named.restore(session, pretrained)

    with g.as_default():
        scaffold = tf1.train.Scaffold(init_fn=init_fn)
        with tfpar.MonitoredTrainingSession(scaffold=scaffold, save_summaries_steps=None,
                                            hooks=[tf1.train.StopAtStepHook(last_step=2)]) as s:
            np.testing.assert_array_equal(s.run(emb), np.full([6, 2], 0.25))
            while not s.should_stop():
                s.run(train)
    assert len(calls) == 1 and isinstance(calls[0], tf1.train.Scaffold)
