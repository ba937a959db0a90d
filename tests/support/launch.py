"""Launching real multi-process jobs with horovodrun from the tests."""
from __future__ import annotations

import json
import os
import subprocess
import time

import psutil

from tfpar.testing import launch

SUPPORT = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(SUPPORT, "workers")  # the scripts each process of a test job runs
REPO = os.path.dirname(os.path.dirname(SUPPORT))


def horovodrun_command(np_, script, *args, hosts=None, cluster=None):
    """The horovodrun command line (on the first host of an emulated `cluster` if given,
    as a user logged in there would type it) and its environment."""
    return launch.horovodrun_command(np_, [script, *args], hosts, cluster, REPO)


def horovodrun(np_, script, *args, hosts=None, timeout=300, env=None, cluster=None):
    """Runs `script` on np_ workers (local, or on an emulated cluster's hosts); returns the
    CompletedProcess (output in .stdout, seconds in .elapsed)."""
    cmd, full_env = horovodrun_command(np_, script, *args, hosts=hosts, cluster=cluster)
    full_env.update(env or {})
    start = time.time()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout, env=full_env, cwd=REPO)
    proc.elapsed = time.time() - start
    return proc


def run_scenarios(out_dir, n, scenarios, hosts=None, timeout=600, cluster=None):
    """Runs the equivalence worker's scenarios as one horovodrun job of n workers; the
    results land in out_dir/<scenario>/rank<r>.npz."""
    spec = os.path.join(str(out_dir), "scenarios.json")
    with open(spec, "w") as f:
        json.dump(scenarios, f)
    proc = horovodrun(n, os.path.join(WORKERS, "equivalence.py"), spec, str(out_dir),
                      hosts=hosts, timeout=timeout, cluster=cluster)
    assert proc.returncode == 0, proc.stdout[-8000:]
    return out_dir


def run_worker(n, worker, spec, out_dir, timeout=300):
    """Runs tests/support/workers/`worker` on n workers with `spec` (written as JSON into out_dir)
    and out_dir as arguments; asserts it succeeded and returns out_dir."""
    path = os.path.join(str(out_dir), "spec.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    proc = horovodrun(n, os.path.join(WORKERS, worker), path, str(out_dir),
                      timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return out_dir


# The equivalence worker's scenarios of every collected module, by job shape (n, hosts):
# they run as one job per shape, each module's into its own folder. A launch costs 4-5 s
# on 2 workers and about 9 s on 2 hosts x 2 (TensorFlow's import in every process and the
# servers' processes); a scenario 1-2.5 s.
_SHARED: dict = {}  # (n, hosts) -> [(folder, scenarios)]
_RAN: dict = {}  # (n, hosts) -> the shared job's folder
SHARED_JOB_MODULES: set = set()  # the modules whose scenarios run in those jobs


def job_results(name, folder, n, scenarios, hosts=None, before_servers=False):
    """A module-scoped fixture `name`: the folder of the scenarios' results (each
    <folder>/<scenario>/rank<r>.npz). The scenarios of every collected module with the same
    n and hosts run once, together, as one job of n workers (each module's folder apart).
    before_servers: these run first, before another module's scenarios start parameter
    servers (which live as long as the job's processes), so they can check what listens."""
    import pytest
    import sys

    SHARED_JOB_MODULES.add(sys._getframe(1).f_globals["__name__"])
    shape = (n, hosts)
    entry = (folder, scenarios)
    if before_servers:
        _SHARED.setdefault(shape, []).insert(0, entry)
    else:
        _SHARED.setdefault(shape, []).append(entry)

    @pytest.fixture(scope="module", name=name)
    def results(tmp_path_factory):
        if shape not in _RAN:
            base = tmp_path_factory.mktemp(f"job{n}")
            union = [{**sc, "name": os.path.join(f, sc["name"])}
                     for f, scs in _SHARED[shape] for sc in scs]
            _RAN[shape] = run_scenarios(base, n, union, hosts=hosts)
        return os.path.join(str(_RAN[shape]), folder)
    return results


def processes_running(marker: str):
    """Processes whose command line mentions `marker` (to prove nothing was left behind)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(marker in part for part in (p.info["cmdline"] or [])):
                found.append(p.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def concurrent_jobs(request, key_of, run, width=2):
    """{key: a future of run(key)} for every selected parametrized test of the requesting
    module (its key: key_of(test function's name, its parameters)), `width` jobs at a time.

    For a module whose jobs mostly wait (for a deadline, a liveness timeout, a relaunch):
    side by side they cost the suite little, and each job's own timings stay its own. A
    test takes its result with `.result()`, which raises what the job's function raised."""
    from concurrent.futures import ThreadPoolExecutor
    keys = []
    for item in request.session.items:
        if item.module is request.module and hasattr(item, "callspec"):
            key = key_of(item.originalname, item.callspec.params)
            if key not in keys:
                keys.append(key)
    pool = ThreadPoolExecutor(width, thread_name_prefix="tfpar-test-job")
    futures = {k: pool.submit(run, k) for k in keys}
    pool.shutdown(wait=True)
    return futures
