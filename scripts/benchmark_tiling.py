"""Benchmark: how long the tiling planner takes.

    .venv/bin/python -m scripts.benchmark_tiling

Plans a 100-layer MLP (width 1024, batch 256) for 64 devices (target: under 1 s), the
language-model example's graph for 8 devices (extraction included), and SoyBean's MLP
(section 2.2) for 8 and 16 devices; compares each plan's bytes with SoyBean's plain
recursion (one cut at a time); writes docs/results/tiling/benchmark_tiling.md.
"""
import datetime
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from scripts.report import machine  # noqa: E402
from tfpar.partition.tiling.dataflow import mlp  # noqa: E402
from tfpar.partition.tiling.planner import recursive_cuts, cost_of, plan_tiling  # noqa: E402


def timed(fn, repeat=3):
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main():
    rows = []
    df = mlp(256, [1024] * 101)
    t, plan = timed(lambda: plan_tiling(df, 64))
    rows.append(("100-layer MLP, width 1024, batch 256", 64, df, t, plan))
    biased = mlp(256, [1024] * 101, bias=True)
    t, plan = timed(lambda: plan_tiling(biased, 64))
    rows.append(("the same with biases (bias adds and bias gradients costed)", 64, biased, t,
                 plan))
    for n in (8, 16):
        soybean = mlp(400, [300] * 6)
        t, plan = timed(lambda: plan_tiling(soybean, n))
        rows.append(("SoyBean section 2.2 MLP (5 x 300, batch 400)", n, soybean, t, plan))
    from examples import lm
    import tfpar
    from tfpar.graph.extract import extract
    graph = lm.build_graph(vocab=100_000)[0]
    analysis = tfpar.analyse(graph)
    t, plan = timed(lambda: plan_tiling(extract(graph, analysis), 8))
    rows.append(("examples/lm.py graph (vocab 100,000), extraction included", 8,
                 extract(graph, analysis), t, plan))
    lines = ["| graph | devices | ops | planning time (s) | search | planned MB | "
             "SoyBean recursion MB | data parallel MB | model parallel MB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, n, flow, t, plan in rows:
        recursion = sum(cost_of(flow, recursive_cuts(flow, plan.cuts)[0]).values())
        lines.append(f"| {name} | {n} | {len(flow.ops)} | {t:.3f} | {plan.search} | "
                     f"{plan.total_bytes / 1e6:.2f} | {recursion / 1e6:.2f} | "
                     f"{plan.data_parallel_bytes / 1e6:.2f} | "
                     f"{plan.model_parallel_bytes / 1e6:.2f} |")
    table = "\n".join(lines)
    verdict = ("target (100-layer chain under 1 s): " +
               ("met" if max(rows[0][3], rows[1][3]) < 1.0 else "not met"))
    print(table)
    print(verdict)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d")
    os.makedirs(os.path.join(REPO, "docs"), exist_ok=True)
    with open(os.path.join(REPO, "docs", "benchmark_tiling.md"), "w") as f:
        f.write(f"# Tiling planner speed\n\n`python -m scripts.benchmark_tiling`, {stamp}, on "
                f"{machine()}; best of 3.\n\n{table}\n\n**{verdict}**\n")


if __name__ == "__main__":
    main()
