"""Every test in this folder starts real multi-process jobs: the `job` marker is applied
here, so `pytest -m 'not job'` runs the fast unit tests (the other folders) alone."""
import os

import pytest

JOBS = os.path.dirname(os.path.abspath(__file__))


# Modules whose tests build an emulated cluster: one address range, so one at a time.
EMULATED = {"tests.jobs.test_emulated_hosts", "tests.jobs.test_recovery"}
# The heaviest first, so that two workers (scripts/test.sh: -n 2 --dist loadgroup
# --no-loadscope-reorder, which keeps this order: xdist's own puts the groups with the
# most tests first) end together: seconds of each group's tests, two at a time on this
# machine (2026-11-28).
COST = {"shared jobs": 460, "emulated cluster": 390, "tests.jobs.test_real_scripts": 345,
        "tests.jobs.test_field_scripts": 240, "tests.jobs.test_tiled_rewrite": 235,
        "tests.jobs.test_readme_commands": 175, "tests.jobs.test_jobs": 145,
        "tests.jobs.test_faults": 135, "tests.jobs.test_async": 130,
        "tests.jobs.test_monitored": 115, "tests.jobs.test_stalls": 105,
        "tests.jobs.test_checkpoint": 90, "tests.jobs.test_tiles": 70}


# A wrapper: its first half runs before every other hook, pytest-xdist's included (which
# copies the groups into the tests' ids; a conftest loaded at start-up, `pytest
# tests/jobs/test_x.py`, would otherwise come after it), its second after them all,
# pytest's own reordering (tests that share a fixture's value together) included.
@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks this folder's tests `job` and groups them for pytest-xdist's loadgroup: a
    module's tests stay in one worker (its module-scoped jobs run once), the modules
    whose scenarios run as one shared job (tests/support/launch.job_results) together,
    and those that build an emulated cluster together; then puts the heaviest groups
    first."""
    from tests.support.launch import SHARED_JOB_MODULES
    for item in items:
        if not str(item.fspath).startswith(JOBS + os.sep):
            continue
        item.add_marker(pytest.mark.job)
        module = item.module.__name__
        item.add_marker(pytest.mark.xdist_group(
            "shared jobs" if module in SHARED_JOB_MODULES else
            "emulated cluster" if module in EMULATED else module))
    yield
    _heaviest_first(items)


def _heaviest_first(items):
    """The job tests in the order of their groups' COST, heaviest first; stable, so a
    group's tests keep their order (the shared jobs' included)."""
    def group(item):
        mark = item.get_closest_marker("xdist_group")
        return mark.args[0] if mark is not None and "job" in item.keywords else None
    jobs = [i for i in items if group(i) is not None]
    jobs.sort(key=lambda i: -COST.get(group(i), 0))
    rest = iter(jobs)
    items[:] = [next(rest) if group(i) is not None else i for i in items]
