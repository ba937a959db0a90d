"""The benchmark scripts' own bookkeeping (their runs are in scripts/, not in the suite)."""
import argparse
import json

from scripts import benchmark_cluster


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
