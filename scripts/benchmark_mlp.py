"""Benchmark: a dense-only model (examples/mlp.py), tfpar against plain Horovod.

    sudo .venv/bin/python -m scripts.benchmark_mlp [--hosts 2] [--rate 1gbit] [--repeats 3]

A model with no sparse variable is where tfpar can only add overhead: HYBRID runs it as AR,
Horovod allreduces inserted after the raw gradients, as Horovod's DistributedOptimizer
does. The systems run interleaved on an emulated cluster (`tfpar.testing.emulate`, 2 workers per
host): tfpar (`tfpar.get_runner`, default Config) and Horovod (`hvd.DistributedOptimizer`
on the same graph, variables broadcast from rank 0). Reports the median step time of each
and their ratio. Writes docs/benchmark_mlp.{md,json}.
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from tfpar.testing.launch import run_for_json  # noqa: E402
from scripts.report import invocation, results_dir  # noqa: E402

SYSTEMS = ("tfpar", "horovod")


def worker(system, steps, warmup, batch, hidden, out):
    """One worker of a job: trains examples/mlp.py's graph, rank 0 writes the timing."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import horovod.tensorflow as hvd
    import tensorflow as tf
    from examples import mlp
    import tfpar
    hvd.init()
    graph, loss, _, train_op = mlp.build_graph(
        batch_size=batch, hidden=hidden,
        wrap_optimizer=hvd.DistributedOptimizer if system == "horovod" else None)
    times = []
    if system == "tfpar":
        with tfpar.get_runner(graph) as runner:
            for step in range(steps):
                start = time.perf_counter()
                runner.run([loss, train_op])
                times.append(time.perf_counter() - start)
    else:
        with graph.as_default():
            init = tf.compat.v1.global_variables_initializer()
            bcast = hvd.broadcast_variables(tf.compat.v1.global_variables(), 0)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(init)
            sess.run(bcast)
            for step in range(steps):
                start = time.perf_counter()
                sess.run([loss, train_op])
                times.append(time.perf_counter() - start)
    if hvd.rank() == 0:
        with open(out, "w") as f:
            json.dump({"system": system, "workers": hvd.size(),
                       "step_time_s": statistics.median(times[warmup:])}, f)


def run_job(cluster, system, hosts, args):
    return run_for_json(
        2 * hosts, [os.path.abspath(__file__), "--worker", system, "--steps", str(args.steps),
                    "--warmup", str(args.warmup), "--batch", str(args.batch), "--hidden",
                    *map(str, args.hidden)],
        system, cluster.hosts_arg(2, hosts), cluster, REPO, args.timeout)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None,
                   help="the report's folder (default: docs/results/<name>/)")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--steps", type=int, default=220)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch", type=int, default=256, help="examples per worker per step")
    p.add_argument("--hidden", type=int, nargs="+", default=[1024, 1024])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    args.out = args.out or results_dir("benchmark_mlp")
    if args.worker:
        return worker(args.worker, args.steps, args.warmup, args.batch, tuple(args.hidden),
                      args.out)
    from tfpar.testing.emulate import EmulatedCluster
    from scripts.report import machine
    runs = {s: [] for s in SYSTEMS}
    with EmulatedCluster(hosts=args.hosts, rate=args.rate, name="tfpm") as cluster:
        for _ in range(args.repeats):
            for system in SYSTEMS:
                r = run_job(cluster, system, args.hosts, args)
                runs[system].append(r["step_time_s"])
                print(f"{system:8s} {r['step_time_s'] * 1e3:8.2f} ms/step", flush=True)
    left = EmulatedCluster(name="tfpm").leftovers()
    if left:
        raise SystemExit(f"the emulated cluster left {left}")
    med = {s: statistics.median(v) for s, v in runs.items()}
    ratio = med["tfpar"] / med["horovod"]
    stamp = datetime.datetime.now().strftime("%Y-%m-%d")
    text = (f"# Dense-only model: tfpar against plain Horovod\n\n`{invocation()}`"
            f", {stamp}, on {machine()}. examples/mlp.py (hidden {args.hidden}, Adam), "
            f"{args.batch} examples per worker per step, N = {2 * args.hosts} on {args.hosts} "
            f"emulated hosts at {args.rate}; median step time over {args.steps - args.warmup} "
            f"steps per run, then the median of {args.repeats} interleaved runs.\n\n"
            "| system | step (ms) | runs (ms) |\n|---|---|---|\n"
            + "".join(f"| {s} | {med[s] * 1e3:.2f} | "
                      f"{', '.join(f'{t * 1e3:.2f}' for t in runs[s])} |\n" for s in SYSTEMS)
            + f"\ntfpar / Horovod: **{ratio:.3f}**\n")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "benchmark_mlp.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "benchmark_mlp.json"), "w") as f:
        json.dump({"machine": machine(), "date": stamp, "argv": sys.argv, "runs": runs,
                   "median": med, "ratio": ratio}, f, indent=2)
    print(text)


if __name__ == "__main__":
    main()
