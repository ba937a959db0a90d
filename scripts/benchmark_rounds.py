"""What one collective round costs: chains of dependent Horovod collectives, timed.

    sudo .venv/bin/python -m scripts.benchmark_rounds [--rate 1gbit] [--steps 200]

At a small batch a step's time is its compute plus its rounds of dependent collectives
(docs/results/step_breakdown/): the allgather route has one round a step (every worker
gets every row gradient and updates its own copy), the sharded route at least two (the
rows from their owners, the row gradients to them) and three unless the ids go a step
ahead. This times, on 2 emulated hosts x 2 workers, one `session.run` of k dependent
collectives of the sizes the LM's small batch moves (128 ids, 128 rows of 256 floats) for
k = 1, 2, 3, and the step's other collectives, so that a route's floor is a sum of
measured rounds. Writes docs/results/rounds/rounds.md (and .json).
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tfpar.testing.launch import horovodrun_command  # noqa: E402
from scripts.report import invocation, machine, results_dir  # noqa: E402

IDS, WIDTH = 128, 256  # the LM's small batch: ids a worker asks, floats a row


def cases(tf, hvd):
    """{name: (a function building the timed fetch, rounds)}: each a chain of dependent
    collectives (each input computed from the last output, so no two share a cycle)."""
    n = hvd.size()

    def alltoall_chain(k, width):
        def build():
            x = tf.random.uniform([IDS * n, width])
            for i in range(k):
                got, _ = hvd.alltoall(x, splits=tf.fill([n], IDS), name=f"a2a_{k}_{width}_{i}")
                x = got + 1.0
            return x
        return build

    def allgather_chain(k, width):
        def build():
            x = tf.random.uniform([IDS, width])
            for i in range(k):
                got = hvd.allgather(x, name=f"ag_{k}_{width}_{i}")
                x = got[:IDS] + 1.0
            return x
        return build

    def allreduce_many(count, size):
        def build():
            xs = [tf.random.uniform([size]) for _ in range(count)]
            return [hvd.allreduce(x, name=f"ar_{count}_{size}_{i}") for i, x in enumerate(xs)]
        return build

    return {
        "no collective (the run itself)": (lambda: tf.random.uniform([IDS, WIDTH]), 0),
        "1 alltoall of ids": (alltoall_chain(1, 1), 1),
        "1 alltoall of rows": (alltoall_chain(1, WIDTH), 1),
        "2 alltoalls of rows, chained": (alltoall_chain(2, WIDTH), 2),
        "3 alltoalls of rows, chained": (alltoall_chain(3, WIDTH), 3),
        "1 allgather of rows": (allgather_chain(1, WIDTH), 1),
        "2 allgathers of rows, chained": (allgather_chain(2, WIDTH), 2),
        "1 allreduce (1 MB)": (allreduce_many(1, 256 * 1024), 1),
        "20 allreduces together (50 KB each)": (allreduce_many(20, 12800), 1),
    }


def worker(steps, out):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    import horovod.tensorflow as hvd
    hvd.init()
    result = {}
    for name, (build, rounds) in cases(tf, hvd).items():
        with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
            fetch = build()
            for _ in range(steps // 4):  # warm: Horovod's response cache, thread pools
                sess.run(fetch)
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                sess.run(fetch)
                times.append(time.perf_counter() - start)
            result[name] = {"rounds": rounds, "median_s": statistics.median(times)}
    with open(f"{out}.rank{hvd.rank()}.json", "w") as f:
        json.dump(result, f)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE",
                   help="variables for the workers' environment (HOROVOD_CYCLE_TIME=0.5)")
    p.add_argument("--out", default=None, help="the report's folder (default: docs/results/rounds/)")
    args = p.parse_args()
    if args.worker:
        return worker(args.steps, args.result)
    args.out = args.out or results_dir("rounds")
    from tfpar.testing.emulate import EmulatedCluster
    with EmulatedCluster(hosts=2, rate=args.rate, name="tfpr") as cluster, \
            tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "rounds")
        cmd, env = horovodrun_command(
            4, [os.path.abspath(__file__), "--worker", "--result", prefix, "--steps",
                str(args.steps)], cluster.hosts_arg(2, 2), cluster, REPO,
            env=dict(x.split("=", 1) for x in args.env), log_level="3")
        proc = subprocess.run(cmd, env=env, cwd=REPO, timeout=900, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"the job failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        ranks = [json.load(open(f"{prefix}.rank{r}.json")) for r in range(4)]
    if EmulatedCluster(name="tfpr").leftovers():
        raise SystemExit("the emulated cluster left something behind")
    base = statistics.median(r["no collective (the run itself)"]["median_s"] for r in ranks)
    rows = []
    for name, case in ranks[0].items():
        t = statistics.median(r[name]["median_s"] for r in ranks)
        rounds = case["rounds"]
        rows.append({"case": name, "rounds": rounds, "step_s": t,
                     "per_round_s": (t - base) / rounds if rounds else None})
    stamp = datetime.datetime.now().strftime("%Y-%m-%d")
    small = [r["per_round_s"] * 1e3 for r in rows
             if r["rounds"] and ("alltoall" in r["case"] or "allgather" in r["case"])]
    headline = (f"**One round of dependent collectives costs {min(small):.1f}-{max(small):.1f} ms "
                "here, whatever its size up to 128 KB: a small-batch step is its compute plus "
                "its rounds.**\n\n")
    lines = [f"# What one collective round costs\n\n`{invocation()}`, {stamp}, on "
             f"{machine()}. N = 4 on 2 emulated hosts at {args.rate}"
             f"{' (' + ', '.join(args.env) + ')' if args.env else ''}; one `session.run` "
             "of each case, the median of "
             f"{args.steps} runs on each worker, the median over workers. A chain's "
             "collectives depend on each other, so each is a round of its own. Rows: "
             f"{IDS} a worker, {WIDTH} floats each.\n\n" + headline +
             "| case | rounds | run (ms) | per round, less the bare run (ms) |\n|---|---|---|---|\n"]
    for r in rows:
        per = f"{r['per_round_s'] * 1e3:.2f}" if r["per_round_s"] is not None else "-"
        lines.append(f"| {r['case']} | {r['rounds']} | {r['step_s'] * 1e3:.2f} | {per} |\n")
    text = "".join(lines)
    with open(os.path.join(args.out, "rounds.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "rounds.json"), "w") as f:
        json.dump({"date": stamp, "machine": machine(), "argv": sys.argv, "rows": rows}, f,
                  indent=1)
    print(text)


if __name__ == "__main__":
    main()
