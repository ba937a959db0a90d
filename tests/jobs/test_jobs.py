"""Real horovodrun jobs: sharding, bad input inside a job, and the example."""
import json
import os
import re
import shutil

import pytest

from tests.support.launch import REPO, WORKERS, horovodrun, processes_running



def test_shard_gives_disjoint_complete_slices(tmp_path):
    proc = horovodrun(3, os.path.join(WORKERS, "shard.py"), str(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stdout[-5000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for key in ("direct", "meta"):
        slices = [s[key] for s in seen]
        assert all(slices), slices
        flat = [e for s in slices for e in s]
        assert sorted(flat) == list(range(23)), (key, slices)  # disjoint and complete
        assert slices[1] == list(range(1, 23, 3))


@pytest.mark.parametrize("case, message", [
    ("resources", r"resources give host 'localhost' 3 worker\(s\) but the running job has 2"),
    ("partitions", r"cannot split variable 'emb' into 50 parts: it has only 20 rows"),
    ("sparse_apply", r"cannot put 'emb' on the parameter servers: its optimizer's update is "
                     r"dense \(ResourceApplyAdam: no sparse apply"),
    ("more_hosts", r"resources name 2 host\(s\) .*but the running job has 1"),
    ("run_mode", r"unknown run_mode 'ALLREDUCE'"),
    ("unresolvable_host", r"name host 'nosuchhost.invalid', which does not resolve"),
    # The user's id and the variable's rows, not a part's local index (the PS has 2 parts).
    ("id_out_of_range", r"lookup in variable emb got ids\] \[107\] \[which are not in "
                        r"\[0, 100\)"),
    # Sharded rows: the worker whose batch holds the id, not the owner of its rows (before:
    # worker 0 failed with "indices[1] = 53 is not in [0, 50)", its own row numbers).
    ("id_out_of_range_sharded", r"worker 1 \(host localhost, pid \d+\) failed: .*lookup in "
                                r"variable emb got ids\] \[106\] \[which are not in \[0, 100\)"),
])
def test_bad_input_in_a_job_fails_cleanly(tmp_path, case, message):
    script = tmp_path / f"bad_job_{case}_marker.py"
    shutil.copy(os.path.join(WORKERS, "bad_job.py"), script)
    proc = horovodrun(2, str(script), case, timeout=120)
    assert proc.returncode != 0
    assert re.search(message, proc.stdout), proc.stdout[-4000:]
    assert "unexpected: no error" not in proc.stdout
    assert proc.elapsed < 60
    assert processes_running(script.name) == []


def test_example_trains_on_two_workers():
    proc = horovodrun(2, os.path.join(REPO, "examples", "mlp.py"), "--steps", "100",
                      "--log-every", "50")
    assert proc.returncode == 0, proc.stdout[-5000:]
    losses = [float(m) for m in re.findall(r"step +\d+ +loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 2 and losses[-1] < 2.3  # below chance level (ln 10)
    assert "done: 100 steps on 2 workers" in proc.stdout and "global step 100" in proc.stdout
    assert "steps/s" in proc.stdout


def test_language_model_example_trains_in_hybrid(tmp_path):
    summary = tmp_path / "summary.json"
    proc = horovodrun(2, os.path.join(REPO, "examples", "lm.py"), "--vocab", "3000", "--steps",
                      "80", "--log-every", "40", "--partitions", "2", "--json", str(summary))
    assert proc.returncode == 0, proc.stdout[-5000:]
    assert "runs as HYBRID" in proc.stdout and "words/s" in proc.stdout
    s = json.loads(summary.read_text())
    assert s["mode"] == "HYBRID" and s["workers"] == 2
    assert s["loss_last"] < s["loss_first"] - 0.5  # it learns the generated text's structure
    b = s["bytes_per_step"]
    assert b["ps_push"] > 0 and b["ps_pull"] > 0 and b["allreduce"] > 0 and b["allgather"] == 0


def test_recommender_example_routes_each_table_by_its_density(tmp_path):
    """examples/recommender.py (feature columns, FTRL + Adagrad, Zipf ids) with
    sparse_route "auto": every table measured and routed, each by its fastest predicted
    route among the kinds the job pays for; the large tables never by the dense
    allreduce; it learns."""
    summary = tmp_path / "summary.json"
    proc = horovodrun(2, os.path.join(REPO, "examples", "recommender.py"), "--vocab", "20000",
                      "--batch-size", "256", "--steps", "30", "--warmup", "5",
                      "--log-every", "10", "--json", str(summary))
    assert proc.returncode == 0, proc.stdout[-5000:]
    s = json.loads(summary.read_text())
    choices = s["routing"]["choices"]
    assert len(choices) == 10, sorted(choices)  # 5 features x (linear weights, embedding)
    used = {c["route"] for c in choices.values()}
    folded = s["allreduce_by_allgather"]
    for name, c in choices.items():
        assert s["routes"][name] == c["route"], (name, c)
        t = {r: c[f"{r}_s"] for r in ("ps", "allreduce", "allgather", "sharded")
             if c[f"{r}_s"] is not None}
        if folded:  # the dense route's bytes ride in the allgather
            t["allreduce"] = c["folded_s"]
        fastest = min(t, key=t.get)
        assert t[c["route"]] == t[fastest] or fastest not in used, (name, c)
        if "/hour" in name or "/device" in name:
            assert c["alpha"] > 0.5, (name, c)  # most rows touched
        if "/item" in name or "/user" in name:
            assert c["alpha"] < 0.05 and c["route"] != "allreduce", (name, c)
    # The dense gradients' allreduce, or (allreduce_by_allgather, measured to pay: on 2
    # workers it adds no bytes) those gradients in the allgather.
    assert (s["bytes_per_step"]["allreduce"] > 0) != folded
    assert s["bytes_per_step"]["allgather"] > 0 or not folded
    assert s["loss_last"] < s["loss_first"]


def test_language_model_example_reads_a_text_file(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat and the dog sat on the log . " * 300)
    summary = tmp_path / "summary.json"
    proc = horovodrun(2, os.path.join(REPO, "examples", "lm.py"), "--text", str(text), "--vocab",
                      "50", "--steps", "40", "--log-every", "20", "--run-mode", "PS",
                      "--partitions", "1",
                      "--json", str(summary))
    assert proc.returncode == 0, proc.stdout[-5000:]
    s = json.loads(summary.read_text())
    assert s["mode"] == "PS" and s["bytes_per_step"]["allreduce"] == 0
    assert s["loss_last"] < s["loss_first"]
