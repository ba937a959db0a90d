"""The field's own scripts (tests/field_scripts.py) in every mode: the README's table.

Each cell (script x mode x TF2/TF1) trains 3 steps on N workers through tfpar and the same
graph on one device through a plain `tf.compat.v1.Session` on the concatenated batch, from
worker 0's initial values. Every global variable (slots, moving averages, the global
step, the lr variable) must agree on every worker within rtol 1e-5 plus 1e-5 of the
tensor's largest magnitude (at least 1e-6): fp32 sums in another order (per worker, then
across workers; recurrent backward passes over 3-8 steps). What the script fetched
besides (`assign(lr, new_lr)`'s result and the lr read back, a canned head's
`assign_add(global_step, 1)`) must equal what the plain session returned.

A cell tfpar does not support must end with a clear TfparError naming what to change
(EXPECTED_ERRORS, documented in the README's table); every other cell must be equal.
Cells of one TF behaviour and mode share one job (horovodrun); `scripts/field_table.py`
runs the whole table, 2 x 2 workers on two hosts included, and prints it.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.launch import REPO, TESTS, horovodrun

pytestmark = pytest.mark.job  # multi-process jobs (horovodrun)

STEPS, BATCH = 3, 4
SCRIPTS = ("lm1b", "skip_thoughts", "nmt", "ptb", "wide_deep")
MODES = {"HYBRID": {}, "PS": {"run_mode": "PS"}, "AR": {"run_mode": "AR"}}
EXPECTED_ERRORS = {}  # (script, mode) -> a phrase of the clear error tfpar gives
WORKER = os.path.join(TESTS, "workers", "field_script.py")


def run_cells(out_dir, n, tf1, mode, scripts=SCRIPTS, hosts=None, timeout=420):
    """One job of n workers training `scripts` in `mode`, then their single-device runs;
    returns {script: "equal" or the error text}."""
    scenarios = [{"name": s, "script": s, "config": MODES[mode], "steps": STEPS,
                  "batch": BATCH} for s in scripts]
    spec = os.path.join(str(out_dir), "spec.json")
    with open(spec, "w") as f:
        json.dump({"tf1": tf1, "scenarios": scenarios}, f)
    proc = horovodrun(n, WORKER, spec, str(out_dir), hosts=hosts, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-8000:]
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    single = subprocess.run([sys.executable, WORKER, spec, str(out_dir), "--single", str(n)],
                            env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert single.returncode == 0, single.stderr[-6000:]
    return {s: compare(os.path.join(str(out_dir), s), n) for s in scripts}


def compare(folder, n):
    """'equal' when every worker's values equal the single device's; else the error the
    job wrote. Fails the test on any difference."""
    error = os.path.join(folder, "error.txt")
    if os.path.exists(error):
        with open(error) as f:
            return f.read()
    expected = np.load(os.path.join(folder, "single.npz"))
    names = [k for k in expected.files if k.startswith(("final/", "fetched/"))]
    moved = 0
    for r in range(n):
        got = np.load(os.path.join(folder, f"rank{r}.npz"))
        assert set(k for k in got.files if k.startswith(("final/", "fetched/"))) == set(names)
        for k in names:
            want = expected[k]
            if want.dtype.kind == "f":
                scale = max(float(np.max(np.abs(want), initial=0.0)), 0.1)
                np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-5 * scale,
                                           err_msg=f"{folder}: {k} on worker {r}")
            else:
                np.testing.assert_array_equal(got[k], want, err_msg=f"{folder}: {k} on {r}")
        moved = sum(not np.allclose(expected[k], got["init/" + k[len("final/"):]])
                    for k in names if k.startswith("final/"))
    assert moved > 0, f"{folder}: training moved nothing"
    return "equal"


def _check_cells(results, mode):
    for script, outcome in results.items():
        expected = EXPECTED_ERRORS.get((script, mode))
        if expected is None:
            assert outcome == "equal", f"{script} in {mode}: {outcome}"
        else:
            assert outcome.startswith(("TfparError", "NotYetSupportedError")), outcome
            assert expected in outcome, outcome


CELLS = [(mode, tf1) for mode in MODES for tf1 in (False, True)]


@pytest.mark.parametrize("mode,tf1", CELLS,
                         ids=[f"{m.lower()}_{'tf1' if t else 'tf2'}_n2" for m, t in CELLS])
def test_field_scripts_equal_single_device(tmp_path, mode, tf1):
    _check_cells(run_cells(tmp_path, 2, tf1, mode), mode)
