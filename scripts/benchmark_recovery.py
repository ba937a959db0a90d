"""Benchmark: what recovery costs. The step-time overhead of background checkpoints, and
the time `tfpar run` takes from a killed worker to the first step after the relaunch.

    .venv/bin/python -m scripts.benchmark_recovery [--workers 2] [--windows 20] [--window 100]

Overhead: examples/lstm_lm.py's graph (fed; vocabulary 10,000, HYBRID: the embedding and
the softmax on the parameter servers; 10.5 MB of variables and Adagrad slots), trained in
one job whose windows of `--window` steps alternate between no checkpoints and a background
save every 20 steps (`Runner.save(background=True)`, what `Config(checkpoint_every_steps=20)`
calls); the overhead is the mean step time of the saving windows over that of the others.
One job, interleaved, because separate launches of the same job differ by more than the
overhead (about 5% here). Restart: tests/support/workers/recover.py under `tfpar run`, a
worker SIGKILLed before step 5; the time from the kill to the chief's first step of the
relaunch (the job's start-up plus the restore), with local workers and with 4 workers on 2
emulated hosts (needs root). Writes docs/results/recovery/benchmark_recovery.{md,json}.
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


EVERY = 20  # steps between saves in a saving window


def worker(windows: int, window: int, out: str):
    """One worker: trains the LSTM LM in `windows` + 1 windows of `window` steps (the first
    a warm-up), every other one saving every EVERY steps; rank 0 writes the step times."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf
    import tfpar
    from examples import lstm_lm
    tf.compat.v1.disable_eager_execution()
    graph, h = lstm_lm.build_graph(feed=True, batch_size=32)
    rng = np.random.RandomState(int(os.environ.get("HOROVOD_RANK", "0")))
    times = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as folder, tfpar.get_runner(graph) as runner:
        for w in range(-1, windows):
            mode = "on" if w % 2 else "off"
            for i in range(window):
                words = rng.randint(0, 10_000, size=(32, 9))
                feed = {h["inputs"]: words[:, :-1], h["targets"]: words[:, 1:]}
                start = time.perf_counter()
                runner.run(h["train_op"], feed)
                if mode == "on" and i % EVERY == EVERY - 1:
                    runner.save(os.path.join(folder, "model.ckpt"), max_to_keep=5,
                                background=True)
                if w >= 0:
                    times[mode].append(time.perf_counter() - start)
        saved = (len(tf.train.get_checkpoint_state(folder).all_model_checkpoint_paths)
                 if runner.is_chief else 0)
    if runner.is_chief:
        with open(out, "w") as f:
            json.dump({"times_s": times, "checkpoints_kept": saved}, f)


def overhead_of(times: dict, window: int) -> dict:
    """The saving windows' mean step time over the others', each pair's, and what a save
    adds to each step of its 20-step cycle (the save's step is the last)."""
    import numpy as np
    on, off = (np.array(times[m]) for m in ("on", "off"))
    pairs = on.reshape(-1, window).mean(1) / off.reshape(-1, window).mean(1) - 1.0
    cycle = on.reshape(-1, EVERY).mean(0) - off.reshape(-1, EVERY).mean(0)
    return {"overhead": float(on.mean() / off.mean() - 1.0), "step_off_s": float(off.mean()),
            "step_on_s": float(on.mean()), "window_pairs": [float(p) for p in pairs],
            "added_per_cycle_step_s": [float(c) for c in cycle]}


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
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="the report's folder")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--windows", type=int, default=20, help="windows measured (half saving)")
    p.add_argument("--window", type=int, default=100, help="steps a window")
    p.add_argument("--repeats", type=int, default=5, help="jobs (the median is reported)")
    p.add_argument("--report", metavar="JSON", help="write the report of this run's JSON")
    args = p.parse_args()
    if args.report:
        with open(args.report) as f:
            text = report(json.load(f))
        with open(os.path.join(os.path.dirname(args.report), "benchmark_recovery.md"), "w") as f:
            f.write(text)
        return print(text)
    if args.worker:
        return worker(args.windows, args.window, args.out)
    args.out = args.out or results_dir("benchmark_recovery")
    runs = []
    for _ in range(args.repeats):
        r = run_for_json(args.workers, [os.path.abspath(__file__), "--worker", "--windows",
                                        str(args.windows), "--window", str(args.window)],
                         "checkpoint overhead", repo=REPO, timeout=900)
        runs.append(overhead_of(r["times_s"], args.window))
        print(f"checkpoints every {EVERY} steps: {100 * runs[-1]['overhead']:+.2f}% "
              f"({runs[-1]['step_off_s'] * 1e3:.2f} -> {runs[-1]['step_on_s'] * 1e3:.2f} ms)",
              flush=True)
    restart = restart_time(args.workers)
    print(f"restart: {restart}", flush=True)
    from tfpar.testing.emulate import EmulatedCluster
    with EmulatedCluster(hosts=2, rate="1gbit", name="tfpb") as cluster:
        emulated = restart_time(4, cluster)
    print(f"restart on 2 emulated hosts x 2: {emulated}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    data = {"machine": machine(), "date": datetime.datetime.now().strftime("%Y-%m-%d"),
            "invocation": invocation(), "argv": sys.argv, "workers": args.workers,
            "windows": args.windows, "window": args.window, "runs": runs,
            "overhead": statistics.median(r["overhead"] for r in runs), "restart": restart,
            "restart_emulated_2x2": emulated}
    with open(os.path.join(args.out, "benchmark_recovery.json"), "w") as f:
        json.dump(data, f, indent=2)
    text = report(data)
    with open(os.path.join(args.out, "benchmark_recovery.md"), "w") as f:
        f.write(text)
    print(text)


def report(d: dict) -> str:
    """The report of a run's JSON (`python -m scripts.benchmark_recovery --report JSON`
    writes it again)."""
    runs, restart, emulated = d["runs"], d["restart"], d["restart_emulated_2x2"]
    typical = min(runs, key=lambda r: abs(r["overhead"] - d["overhead"]))
    cycle = typical["added_per_cycle_step_s"]
    around = cycle[-1] + cycle[0]  # the step that copies and the next, where the write starts
    share = around / (EVERY * typical["step_off_s"])
    return (f"# What recovery costs: background checkpoints and a relaunch\n\n"
            f"`{d['invocation']}`, {d['date']}, on {d['machine']}. {d['workers']} local "
            f"workers.\n\n"
            f"**Checkpoints every {EVERY} steps cost {100 * d['overhead']:+.1f}% step time "
            f"(the median of {len(runs)} jobs; the two steps around a save take "
            f"{around * 1e3:.1f} ms more, {100 * share:.1f}% of the {EVERY} steps); a killed "
            f"worker's job is training again {restart['kill_to_first_step_s']:.1f} s after "
            f"the kill**\n\n"
            f"Overhead: examples/lstm_lm.py's graph (HYBRID, vocabulary 10,000, 10.5 MB "
            f"of variables and slots), one job of {d['windows']} windows of {d['window']} "
            f"steps alternating between no saves and a background save every {EVERY} steps, "
            f"{len(runs)} jobs. Windows of one job differ by a few percent either way, so the "
            "job's ratio and the median over jobs are what to read:\n\n"
            "| job | step, no saves (ms) | step, saving (ms) | overhead | window pairs |\n"
            "|---|---|---|---|---|\n"
            + "".join(f"| {i + 1} | {r['step_off_s'] * 1e3:.2f} | {r['step_on_s'] * 1e3:.2f} "
                      f"| {100 * r['overhead']:+.2f}% | "
                      f"{', '.join(f'{100 * p:+.1f}%' for p in r['window_pairs'])} |\n"
                      for i, r in enumerate(runs))
            + f"\nWhat a save adds to the steps of its {EVERY}-step cycle (the job nearest the "
              f"median): {cycle[-1] * 1e3:+.1f} ms to the step that saves (the copies), "
              f"{cycle[0] * 1e3:+.1f} ms to the next (the write begins), "
              f"{sum(cycle[1:-1]) * 1e3:+.1f} ms to the other {EVERY - 2} together.\n"
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

if __name__ == "__main__":
    main()
