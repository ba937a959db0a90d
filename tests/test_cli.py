"""The tfpar command's `inspect` and `plan`: no cluster is started. They run in this
process (`tfpar.cli.main`), not as `tfpar ...`: each command's process would spend 2-3 s
importing TensorFlow. The console script itself runs as a user types it in the README's
and the guide's commands (tests/jobs/test_readme_commands.py: docs/guide/cli.md and
tiling.md)."""
import contextlib
import io
import os
import subprocess
import sys

import tensorflow as tf

from tests.support.launch import REPO
from tfpar import cli
from tfpar.plan import Plan

MODEL = os.path.join(REPO, "examples", "mlp.py")


def tfpar_cmd(*args):
    """`tfpar ARGS` from the repository's root: (exit status, stdout, stderr) as a
    CompletedProcess. The model file's folder, which the command puts on sys.path, is
    taken off again."""
    out, err, path, cwd = io.StringIO(), io.StringIO(), list(sys.path), os.getcwd()
    try:
        os.chdir(REPO)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(list(args)) or 0
            except SystemExit as e:  # argparse's errors
                code = e.code if isinstance(e.code, int) else 1
    finally:
        os.chdir(cwd)
        sys.path[:] = path
    return subprocess.CompletedProcess(["tfpar", *args], code, out.getvalue(), err.getvalue())


def test_inspect_prints_every_variable():
    proc = tfpar_cmd("inspect", MODEL)
    assert proc.returncode == 0, proc.stderr
    assert "dense0/kernel" in proc.stdout and "dense0/kernel/Adam_1" in proc.stdout
    assert "ResourceApplyAdam" in proc.stdout and "global step: global_step" in proc.stdout


def test_plan_json_round_trips(tmp_path):
    proc = tfpar_cmd("plan", f"{MODEL}:build_graph", "--resources", "hostA:2,hostB:2", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = Plan.from_json(proc.stdout)
    assert plan.num_workers == 4 and plan.hosts == (("hostA", 2), ("hostB", 2))
    assert plan.variable("dense1/kernel").route == "allreduce"


def test_plan_from_a_saved_meta_graph(tmp_path):
    from examples import mlp
    graph = mlp.build_graph()[0]
    path = str(tmp_path / "model.meta")
    tf.compat.v1.train.export_meta_graph(filename=path, graph=graph)
    proc = tfpar_cmd("plan", path, "--resources", "localhost:2")
    assert proc.returncode == 0, proc.stderr
    assert "runs as AR" in proc.stdout and "logits/kernel" in proc.stdout


def test_plan_of_a_ps_job_shows_parts_and_servers():
    proc = tfpar_cmd("plan", MODEL, "--run-mode", "PS", "--resources", "hostA:2,hostB:2")
    assert proc.returncode == 0, proc.stderr
    assert "runs as PS" in proc.stdout and "@1" in proc.stdout
    assert "parameter servers: ps:0@hostA" in proc.stdout and "ps:1@hostB" in proc.stdout


def test_errors():
    proc = tfpar_cmd("plan", MODEL, "--run-mode", "PS", "--partitions", "0")
    assert proc.returncode == 2 and "Config.partitions must be a positive int" in proc.stderr
    proc = tfpar_cmd("inspect", f"{MODEL}:no_such_function")
    assert proc.returncode == 2 and "no function no_such_function()" in proc.stderr
    proc = tfpar_cmd("inspect", "missing.py")
    assert proc.returncode == 2 and "no such file" in proc.stderr


def test_plan_routes_sparse_variables_as_asked():
    lm = os.path.join(REPO, "examples", "lm.py")
    proc = tfpar_cmd("plan", f"{lm}:build_graph", "--resources", "hostA:2,hostB:2",
                     "--sparse-route", "allreduce")
    assert proc.returncode == 0, proc.stderr
    assert "runs as AR" in proc.stdout and "no sparse variable on the parameter servers" in proc.stdout
    proc = tfpar_cmd("plan", f"{lm}:build_graph", "--resources", "hostA:2,hostB:2",
                     "--sparse-route", "auto", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = Plan.from_json(proc.stdout)
    assert plan.variable("embedding").route == "ps"
    assert any("density not measured" in n for n in plan.notes)


def test_plan_shows_each_workers_sharded_rows():
    """`tfpar plan --sparse-route sharded`: rows dealt out modulo N (without a job's
    measurement), or in ranges with --sharded-rows ranges; each worker's rows printed."""
    lm = os.path.join(REPO, "examples", "lm.py")
    proc = tfpar_cmd("plan", f"{lm}:build_graph", "--resources", "hostA:2,hostB:2",
                     "--sparse-route", "sharded")
    assert proc.returncode == 0, proc.stderr
    assert "embedding M4: w0[0::4,0:64] w1[1::4,0:64] w2[2::4,0:64] w3[3::4,0:64]" \
        in proc.stdout, proc.stdout
    proc = tfpar_cmd("plan", f"{lm}:build_graph", "--resources", "hostA:2,hostB:2",
                     "--sparse-route", "sharded", "--sharded-rows", "ranges")
    assert proc.returncode == 0, proc.stderr
    assert "embedding R4: w0[0:25000,0:64]" in proc.stdout, proc.stdout
    # the dense gradients in the rows' all-to-all where asked and possible
    folded = tfpar_cmd("plan", f"{lm}:build_graph", "--resources", "hostA:2,hostB:2",
                       "--sparse-route", "sharded", "--no-local-aggregation",
                       "--allreduce-by-allgather", "on")
    assert folded.returncode == 0, folded.stderr
    assert "sharded: the dense gradients travel in its gradients' all-to-all" in folded.stdout
    assert "dense allreduce in the sharded all-to-all: on (Config)" in folded.stdout
    assert "dense allreduce in the sharded all-to-all: off (local aggregation" in proc.stdout
