"""The benchmark scripts' own bookkeeping and the examples' benchmark options (their runs
are in scripts/, not in the suite)."""
import argparse
import json

import numpy as np
import tensorflow as tf

from examples import lm, recommender
from scripts import benchmark_cluster

tf1 = tf.compat.v1


def _row(system, run=None):
    row = {"rate": "1gbit", "workers": 4, "vocab": 10, "system": system}
    return row if run is None else dict(row, run=run)


def test_merged_rows_keep_the_command_that_measured_them(tmp_path):
    # An earlier report that itself merged an older one: its merged rows must still name
    # the older command, not the earlier report's.
    earlier = {"argv": ["scripts/benchmark_cluster.py", "--systems", "AR", "HYBRID"],
               "merged_from": ["python -m scripts.benchmark_cluster --systems HYBRID_sharded"],
               "rows": [_row("AR"), _row("HYBRID"), _row("HYBRID_sharded", run=1)]}
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(earlier))
    args = argparse.Namespace(merge=[str(path)], rates=["1gbit"])
    rows = benchmark_cluster.merged([_row("AR")], args)
    runs = {r["system"]: r.get("run") for r in rows}
    assert runs == {"AR": None, "HYBRID": 1, "HYBRID_sharded": 2}
    assert args.merged_from == ["python -m scripts.benchmark_cluster --systems AR HYBRID",
                                "python -m scripts.benchmark_cluster --systems HYBRID_sharded"]


def _trained(graph, train_op, steps=2):
    """{variable name: (before, after)} of every global variable over a few plain steps."""
    with graph.as_default():
        variables = [v for v in tf1.global_variables() if "/Adagrad" not in v.name
                     and "/Ftrl" not in v.name and "global_step" not in v.name]
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            before = sess.run(variables)
            for _ in range(steps):
                sess.run(train_op)
            after = sess.run(variables)
    return {v.op.name: (b, a) for v, b, a in zip(variables, before, after)}


def test_frozen_tables_train_only_the_dense_layers():
    """The benchmarks' floor (`AR_frozen`): the examples with `--freeze-tables` send no
    sparse gradient, yet still train their dense layers."""
    assert "--freeze-tables" in benchmark_cluster.command("AR_frozen", 1000, 8, 10, 2, 2)
    assert "--freeze-tables" in benchmark_cluster.command("AR_frozen", 1000, 8, 10, 2, 2,
                                                          model="recommender")
    for graph, train_op, tables in [
            (*lm.build_graph(vocab=500, batch_size=8, train_tables=False)[::2],
             ("embedding", "softmax")),
            (*recommender.build_graph(items=500, batch_size=8, examples=500,
                                      train_tables=False)[::2], ("linear", "embedding"))]:
        changed = {name: not np.array_equal(b, a)
                   for name, (b, a) in _trained(graph, train_op).items()}
        frozen = {name for name in changed if any(t in name for t in tables)}
        assert frozen and not any(changed[name] for name in frozen), changed
        assert all(changed[name] for name in changed if name not in frozen), changed
        with graph.as_default():
            assert not frozen & {v.op.name for v in tf1.trainable_variables()}


def test_the_routes_sweep_names_the_fastest_fixed_route_and_judges_auto():
    from scripts import benchmark_routes

    def row(system, ms, routes=None):
        return {"rate": "1gbit", "system": system, "step_time_s": ms / 1e3,
                "wire_per_step_worker": 1e5, "routes": routes or {},
                "local_aggregation": False, "allreduce_by_allgather": False}
    auto = {"embedding": "allgather", "softmax/weights": "allgather", "softmax/bias": "allreduce"}
    rows = [row("HYBRID", 30), row("HYBRID_allgather", 20), row("HYBRID_allreduce", 900),
            row("HYBRID_sharded", 25), row("AR", 18)]
    fast = {"lm_small": rows + [row("HYBRID_auto", 20.9, auto)]}
    slow = {"lm_small": rows + [row("HYBRID_auto", 21.1, auto)]}
    (config,) = benchmark_routes.configurations(fast)
    best, best_s, auto_s, counted, ok = benchmark_routes.verdict(config)
    # AR is a reference, not a route: the fastest fixed route is the allgather
    assert (best, ok) == ("HYBRID_allgather", "yes") and best_s == 0.020
    assert counted == "allgather x2, allreduce x1, aggregation off"
    assert benchmark_routes.verdict(benchmark_routes.configurations(slow)[0])[4] == "no"
    table, fastest, total = benchmark_routes.summary(fast)
    assert (fastest, total) == (1, 1) and "1.04x the fastest fixed" in table
    assert benchmark_routes.summary(slow)[1:] == (0, 1)


def test_the_tf_ps_baselines_server_serves_its_task():
    """The TF parameter-server baseline starts tfpar's server process with its spec as
    tfpar does (on stdin: passed otherwise the server waited for it and the benchmark's
    jobs hung at their first session)."""
    import socket
    from scripts import lm_tf_ps_baseline

    ports = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("localhost", 0))
        ports.append(s.getsockname()[1])
        s.close()
    spec = {"ps": [f"localhost:{ports[0]}"], "worker": [f"localhost:{ports[1]}"]}
    proc = lm_tf_ps_baseline.start_ps(spec, 0)
    try:
        server = tf.distribute.Server(tf.train.ClusterSpec(spec), job_name="worker",
                                      task_index=0)
        with tf.Graph().as_default():
            with tf1.device("/job:ps/task:0"):
                v = tf1.get_variable("v", initializer=[1.0, 2.0], use_resource=True)
            config = tf1.ConfigProto(operation_timeout_in_ms=60_000)
            with tf1.Session(server.target, config=config) as sess:
                sess.run(v.initializer)
                assert sess.run(v).tolist() == [1.0, 2.0]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_cluster_benchmark_kills_a_job_that_hangs_or_runs_too_long():
    """A job that prints nothing for the silence limit (a baseline hung at its first
    session) or runs past its total is killed and named so; one that keeps printing is
    left alone."""
    import subprocess
    import sys
    import time

    def watched(code, total_s, silence_s):
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                text=True)
        dog = benchmark_cluster.Watchdog(proc, total_s, silence_s, poll_s=0.05)
        for _ in proc.stdout:
            dog.saw_output()
        proc.wait()
        dog.cancel()
        return proc.returncode, dog.killed

    started = time.monotonic()
    assert watched("import time; print('up', flush=True); time.sleep(60)", 60, 1) == \
        (-9, "printed nothing for 1 s")
    talks = "import time\nfor _ in range(600):\n    print('.', flush=True); time.sleep(0.01)"
    assert watched(talks, 1.5, 1) == (-9, "ran past 1.5 s")
    assert watched("print('done')", 60, 1) == (0, None)
    assert time.monotonic() - started < 30
