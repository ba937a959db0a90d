"""Every test in this folder starts real multi-process jobs: the `job` marker is applied
here, so `pytest -m 'not job'` runs the fast unit tests (the other folders) alone."""
import os

import pytest

JOBS = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.fspath).startswith(JOBS + os.sep):
            item.add_marker(pytest.mark.job)
