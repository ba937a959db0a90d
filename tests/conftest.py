"""Test session set-up: graph mode, quiet TensorFlow, Keras 2, Horovod's cycle, and the
`job` marker."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Keras 2, as `import tfpar` selects it (tfpar/__init__.py), chosen before TensorFlow's import
# in this process and every process a test starts: TensorFlow imports its Keras eagerly, and
# Keras 3 brings matplotlib with it, 0.6 s of each job process's start. tfpar's behaviour
# is the same either way (test_real_graph_analysis unsets it to check tfpar's own choice).
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

# Horovod's background loop meets the other workers every HOROVOD_CYCLE_TIME ms (1 by
# default), busy or idle: 7% of a core per worker, which the suite's jobs (up to 8
# processes on 2 cores) take from each other; every 5 ms, 2-4% (measured, 2026-11-28).
# Only the moment a collective starts moves, never what it computes.
os.environ.setdefault("HOROVOD_CYCLE_TIME", "5")

import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_eager_execution()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "job: starts real multi-process jobs (horovodrun, parameter servers); "
        "`pytest -m 'not job'` runs the fast unit tests alone")
