"""The field's own scripts (tests/field_scripts.py) in every mode: the README's table.

Each cell (script x mode x TF2/TF1) trains 3 steps on N workers through tfpar and the same
graph on one device through a plain `tf.compat.v1.Session` on the concatenated batch. Every global variable (slots, moving averages, the global
step, the lr variable) must agree on every worker within rtol 1e-5 plus 1e-5 of the
tensor's largest magnitude (at least 1e-6): fp32 sums in another order (per worker, then
across workers; recurrent backward passes over 3-8 steps). What the script fetched
besides (`assign(lr, new_lr)`'s result and the lr read back, a canned head's
`assign_add(global_step, 1)`) must equal what the plain session returned.

A cell tfpar does not support must end with a clear TfparError naming what to change
(EXPECTED_ERRORS, documented in the README's table); every other cell must be equal.
The suite runs every mode on 2 workers (HYBRID with TF1, PS and AR with TF2; all six with
TFPAR_LONG_TESTS=1) and PS with TF1 on 2 hosts x 2 (two servers: every sparse variable in
two parts). Cells of one TF behaviour and mode share one job; a failed
job is rerun script by script to say which failed. The single-device runs are
made once per TF behaviour (the builders seed their initialisers, and every worker must
start from exactly the single device's values: checked). `scripts/field_table.py` runs
the whole table, 2 x 2 workers on two hosts included, and prints it.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.support.launch import REPO, WORKERS, horovodrun


STEPS, BATCH = 3, 4
SCRIPTS = ("lm1b", "skip_thoughts", "nmt", "ptb", "wide_deep")
MODES = {"HYBRID": {}, "PS": {"run_mode": "PS"}, "AR": {"run_mode": "AR"}}
SHARDED = {"sparse_route": "sharded"}  # HYBRID, the sparse variables' rows over the workers
# ... and the dense gradients in their all-to-all where the plan can fold them
SHARDED_FOLDED = {**SHARDED, "allreduce_by_allgather": True}
EXPECTED_ERRORS = {}  # (script, mode) -> a phrase of the clear error tfpar gives
WORKER = os.path.join(WORKERS, "field_script.py")
TWO_HOSTS = "localhost:2,127.0.0.1:2"


def _spec(out_dir, tf1, mode, scripts):
    os.makedirs(str(out_dir), exist_ok=True)
    path = os.path.join(str(out_dir), "spec.json")
    with open(path, "w") as f:
        json.dump({"tf1": tf1, "scenarios": [
            {"name": s, "script": s, "config": {**MODES, "SHARDED": SHARDED,
                                                 "SHARDED_FOLDED": SHARDED_FOLDED}[mode],
             "steps": STEPS, "batch": BATCH}
            for s in scripts]}, f)
    return path


def reference(out_dir, n, tf1, scripts=SCRIPTS, timeout=420):
    """The scripts trained on one device on n workers' rows (the same for every mode)."""
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, WORKER, _spec(out_dir, tf1, "AR", scripts),
                           str(out_dir), "--single", str(n)], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return str(out_dir)


def run_cells(out_dir, n, tf1, mode, reference_dir, scripts=SCRIPTS, hosts=None,
              timeout=420):
    """One job of n workers training `scripts` in `mode`; returns {script: "equal", the
    clear error tfpar gave, or what differed}."""
    spec = _spec(out_dir, tf1, mode, scripts)
    proc = horovodrun(n, WORKER, spec, str(out_dir), hosts=hosts, timeout=timeout)
    if proc.returncode != 0 and len(scripts) > 1:  # which script failed: each on its own
        return {s: run_cells(os.path.join(str(out_dir), f"alone_{s}"), n, tf1, mode,
                             reference_dir, [s], hosts, timeout)[s] for s in scripts}
    if proc.returncode != 0:
        return {s: "the job failed: " + proc.stdout[-3000:] for s in scripts}
    out = {}
    for s in scripts:
        try:
            out[s] = compare(os.path.join(str(out_dir), s),
                             os.path.join(reference_dir, s, "single.npz"), n)
        except AssertionError as e:
            out[s] = f"differs: {str(e)[:2000]}"
    return out


def compare(folder, reference_path, n):
    """'equal' when every worker started from the single device's values and ended with
    its values and fetches; the error text when the job wrote one. Raises otherwise."""
    error = os.path.join(folder, "error.txt")
    if os.path.exists(error):
        with open(error) as f:
            return f.read()
    expected = np.load(reference_path)
    names = [k for k in expected.files if k.startswith(("final/", "fetched/"))]
    for r in range(n):
        got = np.load(os.path.join(folder, f"rank{r}.npz"))
        assert set(k for k in got.files if k.startswith(("final/", "fetched/"))) == set(names)
        for k in (k for k in expected.files if k.startswith("init/")):
            np.testing.assert_array_equal(got[k], expected[k], err_msg=f"{folder}: {k}")
        for k in names:
            want = expected[k]
            if want.dtype.kind == "f":
                scale = max(float(np.max(np.abs(want), initial=0.0)), 0.1)
                np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-5 * scale,
                                           err_msg=f"{folder}: {k} on worker {r}")
            else:
                np.testing.assert_array_equal(got[k], want, err_msg=f"{folder}: {k} on {r}")
    moved = [k for k in names if k.startswith("final/")
             and not np.allclose(expected[k], expected["init/" + k[len("final/"):]])]
    assert moved, f"{folder}: training moved nothing"
    return "equal"


def check_cells(results, mode):
    for script, outcome in results.items():
        expected = EXPECTED_ERRORS.get((script, mode))
        if expected is None:
            assert outcome == "equal", f"{script} in {mode}: {outcome}"
        else:
            assert outcome.startswith(("TfparError", "NotYetSupportedError")), outcome
            assert expected in outcome, outcome


_REFERENCES = {}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """(tf1, n, scripts) -> the folder of the single-device runs, made once for every mode."""
    def get(tf1, n, scripts=SCRIPTS):
        for (t, m, done), folder in _REFERENCES.items():  # one run that made them already
            if (t, m) == (tf1, n) and set(scripts) <= set(done):
                return folder
        if (tf1, n, scripts) not in _REFERENCES:
            _REFERENCES[(tf1, n, scripts)] = reference(
                tmp_path_factory.mktemp(f"reference_{'tf1' if tf1 else 'tf2'}_{n}"), n, tf1,
                scripts)
        return _REFERENCES[(tf1, n, scripts)]
    return get


# The suite: every mode once and both TF behaviours, 2 workers (and PS with TF1 on 2 x 2
# below); TFPAR_LONG_TESTS=1 (scripts/long_tests.sh) runs every mode with both, and
# `python -m scripts.field_table` the whole table.
CELLS = [(mode, tf1) for tf1 in (False, True) for mode in MODES
         if os.environ.get("TFPAR_LONG_TESTS") or (mode, tf1) in (
             ("HYBRID", True), ("PS", False), ("AR", False))]


@pytest.mark.parametrize("mode,tf1", CELLS,
                         ids=[f"{m.lower()}_{'tf1' if t else 'tf2'}_n2" for m, t in CELLS])
def test_field_scripts_equal_single_device(tmp_path, references, mode, tf1):
    check_cells(run_cells(tmp_path, 2, tf1, mode, references(tf1, 2)), mode)


def test_field_scripts_with_sharded_rows_equal_single_device(tmp_path, references):
    """Route "sharded" on the scripts whose sparse variables are read other than by a
    plain gather: the canned wide & deep's linear model (TF1 variables: sparse segment
    sums of the whole weights, embedding_lookup_sparse's fast path) and LM1B's sampled
    softmax over a partitioned variable. (Every script, TF1 and TF2: TFPAR_LONG_TESTS.)
    The dense gradients ride in the rows' all-to-all where the plan allows it: in wide &
    deep's (two optimizers, FTRL and Adagrad); LM1B clips by the global norm, so not there
    (the plan says why)."""
    long = os.environ.get("TFPAR_LONG_TESTS")
    for tf1 in ((True, False) if long else (True,)):
        scripts = SCRIPTS if long else ("wide_deep", "lm1b")
        check_cells(run_cells(tmp_path / str(tf1), 2, tf1, "SHARDED_FOLDED",
                              references(tf1, 2), scripts), "SHARDED_FOLDED")
        for script in scripts:
            plan = json.loads(str(np.load(tmp_path / str(tf1) / script / "rank0.npz")["plan"]))
            note = next(n for n in plan["notes"] if n.startswith("dense allreduce in the "))
            assert plan["allreduce_by_alltoall"] == note.endswith("on (Config)"), note
            if script == "wide_deep":
                assert plan["allreduce_by_alltoall"], note


def test_field_scripts_on_two_hosts_equal_single_device(tmp_path, references):
    """PS mode, TF1 (reference variables), 2 hosts x 2 workers: two parameter servers, so
    every sparse variable and its slots are in two parts, with local aggregation. The
    suite runs the recurrent PTB model, LM1B's partitioned sampled softmax and the canned
    wide & deep (every script: TFPAR_LONG_TESTS)."""
    scripts = SCRIPTS if os.environ.get("TFPAR_LONG_TESTS") else ("ptb", "lm1b", "wide_deep")
    check_cells(run_cells(tmp_path, 4, True, "PS", references(True, 4, scripts), scripts,
                          hosts=TWO_HOSTS), "PS")
