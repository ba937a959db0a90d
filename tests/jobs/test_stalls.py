"""Misuse that used to hang a job now ends it, within the liveness timeout, naming the cause.

Each case is a real 2-worker horovodrun job (tests/support/workers/stall.py, liveness timeout 5 s)
copied under a unique name, so the test can prove no process of it is left. The jobs
mostly wait (for a deadline or a timeout), so they run three at a time.
"""
import os
import re
import shutil

import pytest

from tests.support.launch import WORKERS, concurrent_jobs, horovodrun, processes_running


WORKER = r"worker {r} \(host localhost, pid \d+\)"
CASES = {
    "one_rank": r"rank\(s\) 1 of the job did not call tfpar.get_runner within 5 s",
    "uneven_dataset": WORKER.format(r=1) + r" ran out of input after 3 training step\(s\) "
                      r"while " + WORKER.format(r=0) + r" has waited \d+ s for it in step 4: "
                      r"every worker must run the same number of training steps",
    "uneven_loop": WORKER.format(r=1) + r" finished after 3 training step\(s\) while "
                   + WORKER.format(r=0) + r" has waited \d+ s for it in step 4",
    "slow_worker": r"training step 4 of " + WORKER.format(r=0) + r" has run for \d+ s, over "
                   r"tfpar.Config\(step_deadline=4\); it waits for " + WORKER.format(r=1)
                   + r", which is not in a training step",
    # Found by the liveness timeout (5 s), not the step deadline (600 s).
    "chief_only_read": WORKER.format(r=0) + r" and " + WORKER.format(r=1) + r" took part in "
                       r"different collectives in their run 3 that waits for the other "
                       r"workers: " + WORKER.format(r=0) + r" ran Sum:0, "
                       + WORKER.format(r=1) + r" ran GradientDescent\. Every worker must "
                       r"make the same such runs in the same order",
}


STUCK = {  # the first-step bound names where each worker waits
    ("stuck_ps_read", "PS"): [WORKER.format(r=0) + r" is in a read from the parameter servers",
                              WORKER.format(r=1) + r" is in a read from the parameter servers"],
    ("stuck_collective", "AR"): [WORKER.format(r=0) + r" is in a collective with the other "
                                 r"workers", WORKER.format(r=1) + r" is in its own code, outside any training step"],
}


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """{(case, mode): (CompletedProcess, the script's unique name)} of the selected tests."""
    def key_of(_, params):
        return params.get("case", "even_dataset"), params["mode"]

    def run(key):
        case, mode = key
        folder = tmp_path_factory.mktemp(f"stall_{case}_{mode}")
        script = folder / f"stall_{case}_{mode}_marker.py"
        shutil.copy(os.path.join(WORKERS, "stall.py"), script)
        return horovodrun(2, str(script), case, mode, timeout=180), script.name
    return concurrent_jobs(request, key_of, run, width=3)


def _run(jobs, case, mode):
    return jobs[(case, mode)].result()


# The arrival check runs before the mode matters: HYBRID alone covers it.
# And the sharded rows, whose steps wait in all-to-alls: a worker whose input ends early.
@pytest.mark.parametrize("case, mode", [(c, m) for c in sorted(CASES) for m in ("HYBRID", "AR")
                                        if (c, m) not in (("one_rank", "AR"),
                                                          ("chief_only_read", "AR"))]
                         + [("uneven_dataset", "SHARDED")])
def test_misuse_ends_the_job_naming_the_cause(jobs, case, mode):
    proc, marker = _run(jobs, case, mode)
    assert proc.returncode != 0, proc.stdout[-4000:]
    assert re.search(CASES[case], proc.stdout), proc.stdout[-4000:]
    # Every worker says why it stops (not just the one that noticed).
    if case != "one_rank":
        assert len(re.findall(r"tfpar: .*; stopping worker \d of the job", proc.stdout)) == 2
        assert not re.search(r"\[\d\]<stderr>:Traceback", proc.stdout), proc.stdout[-4000:]
    assert "rank 0: done after" not in proc.stdout  # the waiting worker never finished
    assert proc.elapsed < 60  # start-up, 5 s of liveness timeout, teardown
    assert processes_running(marker) == []


@pytest.mark.parametrize("mode", ["HYBRID", "AR"])
def test_equal_input_ends_cleanly(jobs, mode):
    """The check must not fire when every worker's input ends at the same step."""
    proc, marker = _run(jobs, "even_dataset", mode)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.stdout.count("done after 6 steps") == 2
    assert processes_running(marker) == []


@pytest.mark.parametrize("case, mode", sorted(STUCK), ids=[c for c, _ in sorted(STUCK)])
def test_a_stuck_first_step_names_where_each_worker_waits(jobs, case, mode):
    """Config.first_step_deadline (20 s here, liveness timeout 60 s) ends a first step that
    waits forever, and the message says which stage each worker is in."""
    proc, marker = _run(jobs, case, mode)
    assert proc.returncode != 0, proc.stdout[-4000:]
    head = WORKER.format(r=0) + r" has been in its first training step for \d+ s, over " \
        r"tfpar.Config\(first_step_deadline=20\): "
    assert re.search(head, proc.stdout), proc.stdout[-4000:]
    for where in STUCK[(case, mode)]:
        assert re.search(where, proc.stdout), proc.stdout[-4000:]
    assert "done after" not in proc.stdout
    assert proc.elapsed < 120  # start-up, the 20 s bound, teardown (not 60 s of liveness)
    assert processes_running(marker) == []
