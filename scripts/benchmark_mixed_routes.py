"""Benchmark: the recommender with its small tables on the dense allreduce route beside the
allgather route for the large ones (what density routing chooses), against every table
on the allgather route.

    .venv/bin/python -m scripts.benchmark_mixed_routes [--workers 4] [--repeats 3]

N workers on this host (no shaped link: what it measures is the step's collectives and
compute, not the wire). The two systems run interleaved, `--repeats` times each; a step's
time is the mean of the last `--steps - --warmup` steps, the median over repeats is
reported. A mix of routes is as cheap as its parts only if Horovod fuses the step's
allreduces into one execution: tfpar makes every allreduce a sum for that
(`tfpar/transform/allreduce.py`). Writes docs/results/mixed_routes/mixed_routes.{md,json}.
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from scripts.report import invocation, machine, results_dir  # noqa: E402

SMALL = ("category", "hour", "device")  # examples/recommender.py's small vocabularies
SYSTEMS = {"allgather": "every table on the allgather route",
           "mixed": "the small tables' linear weights and embeddings on the dense allreduce, "
                    "the large ones on the allgather"}


def routes(graph, system):
    """Config.sparse_route's dict for `system` over the recommender's sparse variables."""
    import tensorflow as tf
    out = {}
    with graph.as_default():
        for v in tf.compat.v1.trainable_variables():
            name = v.op.name
            if not (name.startswith("linear") and "bias" not in name) and "embedding" not in name:
                continue
            small = any(f"/{s}/" in name or f"{s}_embedding" in name for s in SMALL)
            out[name] = "allreduce" if system == "mixed" and small else "allgather"
    return out


def worker(system, steps, warmup, out):
    """One job's worker: trains the recommender; the chief writes its mean step time."""
    import tensorflow as tf
    import tfpar
    from examples import recommender
    tf.compat.v1.disable_eager_execution()
    graph, _, train_op = recommender.build_graph(500_000, 512)
    config = tfpar.Config(sparse_route=routes(graph, system))
    with tfpar.get_runner(graph, config=config) as runner:
        for step in range(steps):
            if step == warmup:
                start = time.time()
            runner.run(train_op)
        runner.communication()  # waits for every worker
        if runner.is_chief:
            chosen = {v.name: v.route for v in runner.plan.variables if v.role == "trained"}
            with open(out, "w") as f:
                json.dump({"step_ms": (time.time() - start) / (steps - warmup) * 1000,
                           "allreduce": sorted(n for n, r in chosen.items()
                                               if r == "allreduce")}, f)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--worker", choices=sorted(SYSTEMS), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.warmup, args.out)

    from tfpar.testing.launch import run_for_json
    runs = {s: [] for s in SYSTEMS}
    for repeat in range(args.repeats):
        for system in SYSTEMS:
            result = run_for_json(args.workers, [
                "-m", "scripts.benchmark_mixed_routes", "--worker", system,
                "--steps", str(args.steps), "--warmup", str(args.warmup)],
                f"{system} (repeat {repeat + 1})", repo=REPO)
            runs[system].append(result["step_ms"])
            print(f"{system}: {result['step_ms']:.1f} ms/step", flush=True)
    median = {s: statistics.median(v) for s, v in runs.items()}
    ratio = median["mixed"] / median["allgather"]
    stamp = datetime.date.today().isoformat()
    text = [f"# Mixed sparse routes: the recommender's small tables on the allreduce\n",
            f"`{invocation()}`, {stamp}, on {machine()}. {args.workers} workers on this one "
            f"host, no shaped link; {args.steps} steps a job, the last "
            f"{args.steps - args.warmup} timed; median of {args.repeats} interleaved "
            f"run(s).\n",
            f"**The mix takes {ratio:.2f}x the step of every table on the allgather route** "
            f"({median['mixed']:.1f} against {median['allgather']:.1f} ms).\n",
            "| system | routes | step (ms), median | runs (ms) |", "|---|---|---|---|"]
    for system, what in SYSTEMS.items():
        text.append(f"| {system} | {what} | {median[system]:.1f} | "
                    + ", ".join(f"{t:.1f}" for t in runs[system]) + " |")
    folder = results_dir("mixed_routes")
    with open(os.path.join(folder, "mixed_routes.md"), "w") as f:
        f.write("\n".join(text) + "\n")
    with open(os.path.join(folder, "mixed_routes.json"), "w") as f:
        json.dump({"machine": machine(), "date": stamp, "argv": sys.argv[1:],
                   "runs": runs, "median": median}, f, indent=2)
    print("\n".join(text))


if __name__ == "__main__":
    main()
