"""Benchmark: what recovery costs. The step-time overhead of background checkpoints, and
the time `tfpar run` takes from a killed worker to the first step after the relaunch.

    .venv/bin/python -m scripts.benchmark_recovery [--workers 2] [--steps 200] [--repeats 2]

Overhead: examples/lstm_lm.py's graph (fed; vocabulary 10,000, HYBRID: the embedding and
the softmax on the parameter servers), trained with and without
`Config(checkpoint_dir=..., checkpoint_every_steps=20)`, interleaved; the mean step time
after a warm-up (the steps that save included), then the median over the repeats.
Restart: tests/support/workers/recover.py under `tfpar run`, a worker SIGKILLed before
step 5; the time from the kill to the chief's first step of the relaunch (the job's
start-up plus the restore), with local workers and with 4 workers on 2 emulated hosts
(needs root). Writes docs/results/recovery/benchmark_recovery.{md,json}.
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
from tfpar.testing.launch import run_for_json  # noqa: E402
from scripts.report import invocation, machine, results_dir  # noqa: E402


def worker(checkpoints: bool, steps: int, warmup: int, out: str):
    """One worker: trains the LSTM LM, rank 0 writes its median step time."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf
    import tfpar
    from examples import lstm_lm
    tf.compat.v1.disable_eager_execution()
    graph, h = lstm_lm.build_graph(feed=True, batch_size=32)
    rng = np.random.RandomState(int(os.environ.get("HOROVOD_RANK", "0")))
    with tempfile.TemporaryDirectory() as folder:
        config = tfpar.Config(checkpoint_dir=folder, checkpoint_every_steps=20) \
            if checkpoints else tfpar.Config()
        times = []
        with tfpar.get_runner(graph, config=config) as runner:
            for _ in range(steps):
                words = rng.randint(0, 10_000, size=(32, 9))
                feed = {h["inputs"]: words[:, :-1], h["targets"]: words[:, 1:]}
                start = time.perf_counter()
                runner.run(h["train_op"], feed)
                times.append(time.perf_counter() - start)
            saved = len(tf.train.get_checkpoint_state(folder).all_model_checkpoint_paths) \
                if checkpoints and runner.is_chief else 0
            if runner.is_chief:
                with open(out, "w") as f:
                    json.dump({"step_time_s": statistics.median(times[warmup:]),
                               "mean_step_time_s": statistics.mean(times[warmup:]),
                               "checkpoints_kept": saved}, f)


def restart_time(workers: int, cluster=None) -> dict:
    """`tfpar run` with a worker killed before step 5 (locally: worker 1; on an emulated
    `cluster` of 2 hosts: the last worker, on the second host): seconds from the kill to
    the chief's first step after the relaunch."""
    recover = os.path.join(REPO, "tests", "support", "workers", "recover.py")
    with tempfile.TemporaryDirectory() as tmp:
        marker, steps = os.path.join(tmp, "killed"), os.path.join(tmp, "steps")
        env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3",
                   TFPAR_STEP_TIMES=steps)
        hosts = cluster.hosts_arg(workers // 2) if cluster else f"localhost:{workers}"
        fault = (["--kills", json.dumps([{"step": 5, "role": "worker", "marker": marker}])]
                 if cluster else ["--kill-at", "5", "--marker", marker])
        cmd = [sys.executable, "-m", "tfpar.cli", "run", "--restarts", "2", "--gloo",
               *(["--disable-cache"] if cluster else []), "-np", str(workers), "-H", hosts,
               "--", sys.executable, recover, os.path.join(tmp, "ckpt"),
               os.path.join(tmp, "final.npz"), *fault]
        started = time.time()
        proc = subprocess.run(cluster.command(cmd) if cluster else cmd, cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(proc.stdout[-3000:])
        with open(marker) as f:
            killed = float(f.read())
        with open(steps) as f:
            firsts = sorted(float(t) for t in f.read().split())
        after = [t for t in firsts if t > killed]
        return {"kill_to_first_step_s": after[0] - killed,
                "first_launch_to_first_step_s": firsts[0] - started,
                "total_s": time.time() - started}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", choices=("on", "off"), help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="the report's folder")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker == "on", args.steps, args.warmup, args.out)
    args.out = args.out or results_dir("benchmark_recovery")
    runs = {"off": [], "on": []}
    for _ in range(args.repeats):
        for mode in ("off", "on"):
            r = run_for_json(args.workers, [os.path.abspath(__file__), "--worker", mode,
                                            "--steps", str(args.steps), "--warmup",
                                            str(args.warmup)], f"checkpoints {mode}",
                             repo=REPO, timeout=900)
            runs[mode].append(r["mean_step_time_s"])  # the mean: saves are on some steps
            print(f"checkpoints {mode:3s} {r['mean_step_time_s'] * 1e3:8.2f} ms/step",
                  flush=True)
    restart = restart_time(args.workers)
    print(f"restart: {restart}", flush=True)
    from tfpar.testing.emulate import EmulatedCluster
    with EmulatedCluster(hosts=2, rate="1gbit", name="tfpb") as cluster:
        emulated = restart_time(4, cluster)
    print(f"restart on 2 emulated hosts x 2: {emulated}", flush=True)
    med = {m: statistics.median(v) for m, v in runs.items()}
    overhead = med["on"] / med["off"] - 1.0
    stamp = datetime.datetime.now().strftime("%Y-%m-%d")
    text = (f"# What recovery costs: background checkpoints and a relaunch\n\n`{invocation()}`"
            f", {stamp}, on {machine()}. {args.workers} local workers.\n\n"
            f"**Checkpoints every 20 steps cost {100 * overhead:+.1f}% step time; a killed "
            f"worker's job is training again {restart['kill_to_first_step_s']:.1f} s after "
            f"the kill**\n\n"
            "Overhead: examples/lstm_lm.py's graph (HYBRID, vocabulary 10,000), mean step "
            f"time over {args.steps - args.warmup} steps (a save's step included), median of "
            f"{args.repeats} "
            "interleaved runs:\n\n| checkpoints | step (ms) | runs (ms) |\n|---|---|---|\n"
            + "".join(f"| {m} | {med[m] * 1e3:.2f} | "
                      f"{', '.join(f'{t * 1e3:.2f}' for t in runs[m])} |\n"
                      for m in ("off", "on"))
            + f"\nRestart (`tfpar run`, worker 1 SIGKILLed before step 5 of "
              f"tests/support/workers/recover.py): {restart['kill_to_first_step_s']:.1f} s "
              f"from the kill to the chief's first step after the relaunch (the first "
              f"launch took {restart['first_launch_to_first_step_s']:.1f} s to its first "
              "step).\n\nOn 2 emulated hosts x 2 workers (network namespaces, 1 Gbit/s, "
              "`tfpar.testing.emulate`; ssh between hosts, a parameter server per host), "
              "the last worker (on the second host) SIGKILLed before step 5: "
              f"**{emulated['kill_to_first_step_s']:.1f} s** from the kill to the chief's "
              "first step after the relaunch (the first launch took "
              f"{emulated['first_launch_to_first_step_s']:.1f} s to its first step).\n")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "benchmark_recovery.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "benchmark_recovery.json"), "w") as f:
        json.dump({"machine": machine(), "date": stamp, "argv": sys.argv, "runs": runs,
                   "median": med, "overhead": overhead, "restart": restart,
                   "restart_emulated_2x2": emulated}, f, indent=2)
    print(text)


if __name__ == "__main__":
    main()
