"""Benchmark: tfpar's partition search against an exhaustive sweep, on the language model.

    .venv/bin/python -m scripts.benchmark_partitions [--workers 2] [--vocab 200000] [--max-p 16]

In one horovodrun job (HYBRID, one host) it times every partition count 1..max-p, then
lets tfpar search. Target: the searched P's step time within 5% of the best swept one,
with at most 5 trials. Prints a table; writes docs/benchmark_partitions.{md,json,png}.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from tfpar.testing.launch import horovodrun_command  # noqa: E402

from scripts.report import invocation, machine, results_dir  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=200_000)
    p.add_argument("--max-p", type=int, default=16)
    p.add_argument("--steps", type=int, default=60, help="timed steps per count")
    p.add_argument("--out", default=None,
                   help="the report's folder (default: docs/results/<name>/)")
    args = p.parse_args()
    args.out = args.out or results_dir("benchmark_partitions")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd, env = horovodrun_command(
            args.workers, [os.path.join(REPO, "scripts", "partition_sweep_worker.py"), out,
                           str(args.vocab), str(args.max_p), str(args.steps)],
            repo=REPO, log_level="3")
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, cwd=REPO, timeout=3600)
        if proc.returncode != 0 or not os.path.exists(out):
            raise SystemExit(proc.stdout[-5000:])
        with open(out) as f:
            r = json.load(f)
    sweep = {int(k): v for k, v in r["sweep"].items()}
    best_p = min(sweep, key=sweep.get)
    chosen = r["search"]["partitions"]
    samples = r["search"]["search"]["samples"]
    ratio = sweep[chosen] / sweep[best_p]
    lines = ["| P | step time (ms, sweep) | searched trial (ms) | fit (ms) |", "|---|---|---|---|"]
    fit = r["search"]["search"]["fit"]
    trial = {p_: t for p_, t in samples}
    for p_ in sorted(sweep):
        f = "" if not fit else f"{(fit[0] + fit[1] / p_ + fit[2] * p_) * 1e3:.2f}"
        t = "" if p_ not in trial else ("failed" if trial[p_] is None else
                                        f"{trial[p_] * 1e3:.2f}")
        mark = " (best)" if p_ == best_p else ""
        mark += " (chosen)" if p_ == chosen else ""
        lines.append(f"| {p_}{mark} | {sweep[p_] * 1e3:.2f} | {t} | {f} |")
    verdict = (f"searched P={chosen} in {len(samples)} trials: {ratio:.3f}x the best swept "
               f"step time (P={best_p}); target <= 1.05x with <= 5 trials: "
               + ("met" if ratio <= 1.05 and len(samples) <= 5 else "not met"))
    table = "\n".join(lines)
    print(table)
    print(verdict)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "benchmark_partitions.json"), "w") as f:
        json.dump({"machine": machine(), "date": stamp, **r}, f, indent=2)
    with open(os.path.join(args.out, "benchmark_partitions.md"), "w") as f:
        f.write(f"# Partition-count search vs exhaustive sweep\n\n`{invocation()}`"
                f", {stamp}, on {machine()}: the language model (vocab {r['vocab']:,}) in "
                f"HYBRID mode on {r['workers']} workers of one host, {r['steps']} timed steps "
                f"per count (mean over workers).\n\n{table}\n\n**{verdict}**\n\n"
                "![sweep and search](benchmark_partitions.png)\n")
    plot(sweep, samples, fit, chosen, os.path.join(args.out, "benchmark_partitions.png"))


def plot(sweep, samples, fit, chosen, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ps = sorted(sweep)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(ps, [sweep[p] * 1e3 for p in ps], "o-", label="exhaustive sweep")
    ok = [(p, t) for p, t in samples if t is not None]
    ax.plot([p for p, _ in ok], [t * 1e3 for _, t in ok], "s", ms=9, mfc="none",
            label="search trials")
    if fit:
        ax.plot(ps, [(fit[0] + fit[1] / p + fit[2] * p) * 1e3 for p in ps], "--",
                label="fitted t(P) = a + b/P + cP")
    ax.axvline(chosen, color="gray", ls=":", label=f"chosen P={chosen}")
    ax.set_xlabel("partitions P")
    ax.set_ylabel("step time (ms)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
