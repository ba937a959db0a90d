"""What real TF1-style graphs need from the analysis: reads inside control flow, every
blocker at once, Keras 2 layers, and clear errors for post-processing tfpar cannot
reproduce exactly."""
import os
import subprocess
import sys

import pytest
import tensorflow as tf

import tfpar
from tests.support.launch import REPO
from tfpar.plan.planner import make_plan
from tfpar.plan.layout import parse_resources

tf1 = tf.compat.v1
tf1.disable_eager_execution()


def _while_graph(update_inside=False):
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [3, 3])
        w = tf1.get_variable("attention_g", [3, 3], use_resource=True)
        c = tf1.get_variable("c", [3, 3], use_resource=True)

        def body(i, h):
            deps = [c.assign_add(tf.ones([3, 3]))] if update_inside else []
            with tf.control_dependencies(deps):
                return i + 1, tf.tanh(tf.matmul(h, w) + c)

        _, out = tf.while_loop(lambda i, h: i < 3, body, [0, x])
        cond = tf.cond(tf.reduce_sum(x) > 0, lambda: out * w, lambda: out)
        tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(cond))
    return g


def test_variables_read_inside_while_and_cond_are_reads():
    analysis = tfpar.analyse(_while_graph())
    assert analysis.variable("attention_g").kind == "dense"
    assert analysis.variable("c").role == "trained"


def test_a_variable_updated_inside_a_loop_is_named():
    with pytest.raises(tfpar.TfparError, match="'c' is updated inside While op 'while'"):
        tfpar.analyse(_while_graph(update_inside=True))


def test_every_blocker_is_reported_at_once():
    g = tf.Graph()
    with g.as_default():
        ids = tf1.placeholder(tf.int32, [4])
        emb = tf1.get_variable("emb", [10, 3])
        other = tf1.get_variable("other", [10, 3])
        loss = tf.reduce_sum(tf.nn.embedding_lookup(emb, ids)) + tf.reduce_sum(
            tf.nn.embedding_lookup(other, ids))
        gv = tf1.train.GradientDescentOptimizer(0.1).compute_gradients(loss)
        # Post-processing that per-worker rows cannot reproduce: a per-row weight.
        gv = [(tf.IndexedSlices(g.values * tf.cast(tf.reshape(ids, [-1, 1]), tf.float32),
                                g.indices, g.dense_shape), v) for g, v in gv]
        tf1.train.GradientDescentOptimizer(0.1).apply_gradients(gv)
    analysis = tfpar.analyse(g, strict=False)
    with pytest.raises(tfpar.NotYetSupportedError) as e:
        make_plan(analysis, tfpar.Config(), parse_resources("localhost:2"))
    text = str(e.value)
    assert "2 problems" in text and "'emb'" in text and "'other'" in text
    assert "one value per row" in text and "run_mode='AR'" in text
    # AR mode combines whole rows with allgather: exact, so nothing blocks it.
    make_plan(analysis, tfpar.Config(run_mode="AR"), parse_resources("localhost:2"))


def test_compat_v1_layers_work_after_importing_tfpar():
    """A script that imports TensorFlow, then tfpar, builds tf.compat.v1.layers.dense and an
    LSTM cell (Keras 2, installed by the README's set-up) and trains them with tfpar."""
    script = (
        "import tensorflow as tf, tfpar\n"
        "tf.compat.v1.disable_eager_execution()\n"
        "g = tf.Graph()\n"
        "with g.as_default():\n"
        "    x = tf.compat.v1.placeholder(tf.float32, [2, 3, 4])\n"
        "    out, _ = tf.compat.v1.nn.dynamic_rnn(tf.compat.v1.nn.rnn_cell.LSTMCell(5), x,\n"
        "                                         dtype=tf.float32)\n"
        "    y = tf.compat.v1.layers.dense(out, 2, name='dense')\n"
        "    step = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_sum(y))\n"
        "with tfpar.get_runner(g) as r:\n"
        "    r.run(step, {x: [[[1.0] * 4] * 3] * 2})\n"
        "    print(sorted(v['name'] for v in r.plan.to_dict()['variables']))\n")
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_USE_LEGACY_KERAS", None)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'dense/kernel'" in proc.stdout and "'rnn/lstm_cell/kernel'" in proc.stdout
