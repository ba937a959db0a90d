"""Every test in this folder starts real multi-process jobs: the `job` marker is applied
here, so `pytest -m 'not job'` runs the fast unit tests (the other folders) alone."""
import os

import pytest

JOBS = os.path.dirname(os.path.abspath(__file__))


# Modules whose tests build an emulated cluster: one address range, so one at a time.
EMULATED = {"tests.jobs.test_emulated_hosts", "tests.jobs.test_recovery"}
# The heaviest first (seconds of each module's jobs on a fresh clone, 2026-11-28). Note:
# pytest-xdist's loadgroup then orders the groups by their number of tests; keeping this
# order (--no-loadscope-reorder) measured no faster (24:40 against 22:34-23:57).
COST = {"shared jobs": 230, "emulated cluster": 260, "tests.jobs.test_field_scripts": 170,
        "tests.jobs.test_real_scripts": 160, "tests.jobs.test_tiled_rewrite": 130,
        "tests.jobs.test_readme_commands": 105, "tests.jobs.test_training_loops": 90}


# First: pytest-xdist's own hook copies the groups into the tests' ids, and runs before a
# conftest loaded at start-up (`pytest tests/jobs/test_x.py`), which would be too late.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks this folder's tests `job` and groups them for pytest-xdist's loadgroup: a
    module's tests stay in one worker (its module-scoped jobs run once), the modules
    whose scenarios run as one shared job (tests/support/launch.job_results) together,
    and those that build an emulated cluster together. Heaviest groups first."""
    from tests.support.launch import SHARED_JOB_MODULES
    group = {}
    for item in items:
        if not str(item.fspath).startswith(JOBS + os.sep):
            continue
        item.add_marker(pytest.mark.job)
        module = item.module.__name__
        group[item] = ("shared jobs" if module in SHARED_JOB_MODULES else
                       "emulated cluster" if module in EMULATED else module)
        item.add_marker(pytest.mark.xdist_group(group[item]))
    jobs = [i for i in items if i in group]
    # stable: a module's tests keep their order (shared jobs' order included)
    jobs.sort(key=lambda i: -COST.get(group[i], 0))
    rest = iter(jobs)
    items[:] = [next(rest) if i in group else i for i in items]
