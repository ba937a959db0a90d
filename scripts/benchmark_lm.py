"""Benchmark: the language-model example under four ways of training it, in one run.

    .venv/bin/python -m scripts.benchmark_lm [--workers 2 4] [--vocabs 50000 500000]

For every worker count and vocabulary size it launches, one after another on this machine:
tfpar HYBRID (sparse on parameter servers, dense allreduce), tfpar AR (Horovod allgather
for sparse gradients), plain Horovod with `sparse_as_dense=True`, and tfpar PS mode. N = 4
runs as two hosts of two workers (`-H localhost:2,127.0.0.1:2`), so it has two parameter
servers and local aggregation as on two machines. It prints a table of step time, words/s
and bytes per step per worker (from the tensors each worker actually sent, see
`Runner.communication()`), and writes docs/benchmark_lm.{md,json,png}.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from tfpar.testing.launch import horovodrun_command  # noqa: E402
from scripts.report import invocation, machine, results_dir  # noqa: E402

SYSTEMS = ("HYBRID", "AR", "horovod_sparse_as_dense", "PS")
LABELS = {"HYBRID": "tfpar HYBRID", "AR": "tfpar AR (allgather)",
          "horovod_sparse_as_dense": "Horovod sparse_as_dense", "PS": "tfpar PS"}


def hosts_for(n, two_hosts):
    return f"localhost:{n // 2},127.0.0.1:{n - n // 2}" if two_hosts and n > 1 else f"localhost:{n}"


def run_one(system, n, vocab, steps, warmup, two_hosts=False):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "summary.json")
        if system == "horovod_sparse_as_dense":
            script = [os.path.join(REPO, "scripts", "lm_horovod_baseline.py"),
                      "--sparse-as-dense"]
        else:
            # One part per parameter server, as issue 3 measured; benchmark_partitions.py
            # measures the search.
            script = [os.path.join(REPO, "examples", "lm.py"), "--run-mode", system,
                      "--log-every", str(steps), "--partitions", "2" if two_hosts else "1"]
        cmd, env = horovodrun_command(
            n, [*script, "--vocab", str(vocab), "--steps", str(steps), "--warmup", str(warmup),
                "--json", out], hosts_for(n, two_hosts), repo=REPO, log_level="3")
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, cwd=REPO, timeout=1200)
        if proc.returncode != 0 or not os.path.exists(out):
            raise SystemExit(f"{system} N={n} vocab={vocab} failed:\n{proc.stdout[-4000:]}")
        with open(out) as f:
            return json.load(f)


def sparse_ratio(vocab, batch=128, context=4, sampled=64, trials=20):
    """alpha: the element-weighted fraction of the sparse variables one worker touches per
    step, estimated on the generated text (embedding: the context words; softmax weights
    and bias: targets plus the sampled classes, at most)."""
    from examples import lm
    words = lm.zipf_text(vocab)
    rng = np.random.RandomState(0)
    alphas = []
    for _ in range(trials):
        starts = rng.randint(0, len(words) - context - 1, size=batch)
        ctx = words[starts[:, None] + np.arange(context)]
        targets = words[starts + context]
        emb_rows = len(np.unique(ctx))
        soft_rows = min(vocab, len(np.unique(targets)) + sampled)
        touched = emb_rows * 64 + soft_rows * (128 + 1)
        alphas.append(touched / (vocab * (64 + 128 + 1)))
    return float(np.mean(alphas))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--vocabs", type=int, nargs="+", default=[50_000, 500_000])
    p.add_argument("--steps", type=int, default=170)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--two-hosts", action="store_true", help="run N workers as two hosts of N/2 "
                   "(two parameter servers, local aggregation) instead of one host")
    p.add_argument("--out", default=None,
                   help="the report's folder (default: docs/results/<name>/)")
    args = p.parse_args()
    args.out = args.out or results_dir("benchmark_lm_two_hosts" if args.two_hosts else "benchmark_lm")
    rows = []
    for n in args.workers:
        for vocab in args.vocabs:
            alpha = sparse_ratio(vocab)
            for system in args.systems:
                r = run_one(system, n, vocab, args.steps, args.warmup, args.two_hosts)
                r.update(system=system, alpha=alpha, bytes_total=sum(r["bytes_per_step"].values()))
                rows.append(r)
                print(f"N={n} vocab={vocab:>7} {LABELS[system]:<26} "
                      f"{r['step_time_s'] * 1e3:8.1f} ms/step {r['words_per_s']:9.0f} words/s "
                      f"{r['bytes_total'] / 1e6:9.3f} MB/step/worker", flush=True)
    table = format_table(rows)
    print()
    print(table)
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d")
    name = "benchmark_lm_two_hosts" if args.two_hosts else "benchmark_lm"
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump({"machine": machine(), "date": stamp, "steps": args.steps,
                   "warmup": args.warmup, "rows": rows}, f, indent=2)
    layout = ("each N as two hosts of N/2 workers (-H localhost:N/2,127.0.0.1:N/2: two "
              "parameter servers, local aggregation)" if args.two_hosts else
              "each N as one host (-H localhost:N: one parameter server)")
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write(f"# Language-model benchmark\n\n`{invocation()}`, {stamp}, "
                f"on {machine()}. All workers and servers share this one machine (loopback), "
                f"{layout}; {args.steps} steps, the first {args.warmup} not timed; 128 words "
                "per worker per step; bytes are the mean over workers of what each sent plus "
                f"received.\n\n{table}\n\n![step time and bytes]({name}.png)\n")
    plot(rows, os.path.join(args.out, name + ".png"))


def format_table(rows):
    head = ("| N | vocab | alpha | system | step time (ms) | words/s | MB/step/worker | "
            "allreduce | allgather | PS push | PS pull | bytes vs allgather |")
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for r in rows:
        base = next((x for x in rows if x["workers"] == r["workers"]
                     and x["vocab"] == r["vocab"] and x["system"] == "AR"), r)
        b = r["bytes_per_step"]
        lines.append(
            f"| {r['workers']} | {r['vocab']:,} | {r['alpha']:.4f} | {LABELS[r['system']]} | "
            f"{r['step_time_s'] * 1e3:.1f} | {r['words_per_s']:,.0f} | "
            f"{r['bytes_total'] / 1e6:.3f} | "
            + " | ".join(f"{b.get(k, 0) / 1e6:.3f}" for k in
                         ("allreduce", "allgather", "ps_push", "ps_pull"))
            + f" | {r['bytes_total'] / base['bytes_total']:.2f}x |")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    configs = sorted({(r["workers"], r["vocab"]) for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in rows)]
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        xs = [j + i * width for j in range(len(configs))]
        sel = [next(r for r in rows if (r["workers"], r["vocab"]) == c and r["system"] == system)
               for c in configs]
        axes[0].bar(xs, [r["step_time_s"] * 1e3 for r in sel], width, label=LABELS[system])
        axes[1].bar(xs, [r["bytes_total"] / 1e6 for r in sel], width, label=LABELS[system])
    for ax, title in zip(axes, ("step time (ms, log)", "MB per step per worker (log)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(configs))])
        ax.set_xticklabels([f"N={n}\nvocab {v:,}" for n, v in configs])
        ax.set_title(title)
    for ax in axes:
        ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle("Language model (examples/lm.py), one machine, " + machine()[:60], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
