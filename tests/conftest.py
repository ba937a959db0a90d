"""Test session set-up: graph mode, quiet TensorFlow, Keras 2, and the `job` marker."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Keras 2, as `import tfpar` selects it (tfpar/__init__.py), chosen before TensorFlow's import
# in this process and every process a test starts: TensorFlow imports its Keras eagerly, and
# Keras 3 brings matplotlib with it, 0.6 s of each job process's start. tfpar's behaviour
# is the same either way (test_real_graph_analysis unsets it to check tfpar's own choice).
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_eager_execution()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "job: starts real multi-process jobs (horovodrun, parameter servers); "
        "`pytest -m 'not job'` runs the fast unit tests alone")
