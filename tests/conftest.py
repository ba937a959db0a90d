"""Test session set-up: graph mode, quiet TensorFlow, and the `job` marker."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_eager_execution()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "job: starts real multi-process jobs (horovodrun, parameter servers); "
        "`pytest -m 'not job'` runs the fast unit tests alone")
