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
