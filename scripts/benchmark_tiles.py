"""Benchmark: wide layers at small batch, data parallel against weights split over workers.

    .venv/bin/python -m scripts.benchmark_tiles [--workers 2 4] [--steps 30]

Two models (SoyBean's wide-MLP shapes scaled to CPU, and a language model's output
layer with its softmax over a large vocabulary), Adam, a small global batch:
- data parallel: the single-device graph through `tfpar.get_runner` (Horovod allreduce);
- split: `examples/split_mlp.py` under a Megatron-style plan (first weight by columns,
  second by rows; the output layer by vocabulary), on `tfpar.transform.tiles`;
- rewrite: the single-device graph through `tfpar.get_runner` with the same weights
  split by `Config(tiling=...)` (the tiled rewrite: each layer from and to the batch
  split; the LM's loss from split logits), the rest allreduced.
Per system and N (workers on this machine): median step time, bytes per step per worker
(sent plus received, measured: tfpar's counters for data parallel, Horovod's received
counts for the split plan, next to the exchanges' prediction), and per-worker bytes of
weights and Adam's slots. Writes docs/benchmark_tiles.{md,json,png}.
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

MODELS = {
    # sizes (input, hidden..., output), global batch, loss
    "wide MLP": ([1024, 4096, 1024], 16, "squares"),
    "LM output layer": ([512, 32768], 16, "softmax"),
}
SYSTEMS = ("data parallel", "split", "rewrite")


def split_plan(model, n):
    sizes, _, loss = MODELS[model]
    c, r = ("C", "R") if n == 2 else (f"C{n}", f"R{n}")
    if loss == "softmax":
        return {"weights": {"W1": c}, "activations": {"logits": c}, "loss": loss,
                "optimizer": "adam"}
    return {"weights": {"W1": c, "W2": r}, "activations": {"h1": c}, "loss": loss,
            "optimizer": "adam"}


def rewrite_plan(model, n):
    """Config.tiling for the rewrite: the split plan's weights (and the first layer's
    bias, split as its columns, so the LM's logits stay split)."""
    _, _, loss = MODELS[model]
    c, r = ("C", "R") if n == 2 else (f"C{n}", f"R{n}")
    return {"W1": c, "b1": r} if loss == "softmax" else {"W1": c, "b1": r, "W2": r}


def worker(model, system, steps, warmup, out):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf
    from examples import split_mlp
    import tfpar
    tf.compat.v1.disable_eager_execution()
    hvd.init()
    rank, n = hvd.rank(), hvd.size()
    sizes, global_batch, loss_name = MODELS[model]
    values, batches = split_mlp.initial(sizes, global_batch, 1)
    xs, ts = batches[0]
    b = global_batch // n
    feed_x, feed_t = xs[rank * b:(rank + 1) * b], ts[rank * b:(rank + 1) * b]
    times = []
    if system == "split":
        m = split_mlp.build(split_plan(model, n), sizes, global_batch, rank, n, values)
        with tf.compat.v1.Session(graph=m.graph) as sess:
            sess.run([tf.compat.v1.global_variables_initializer(),
                      tf.compat.v1.local_variables_initializer()])
            for _ in range(steps):
                start = time.perf_counter()
                sess.run(m.train, {m.x: feed_x, m.targets: feed_t})
                times.append(time.perf_counter() - start)
            wire = 2 * sess.run(m.received) / steps  # received, and as much sent on average
        predicted, memory = 2 * m.predicted_per_step, m.tile_bytes()
    elif system == "rewrite":
        g, x, t, train, _, _ = split_mlp.single_device(sizes, values, loss_name, "adam", b)
        config = tfpar.Config(tiling=rewrite_plan(model, n))
        with tfpar.get_runner(g, config=config) as runner:
            for _ in range(steps):
                start = time.perf_counter()
                runner.run(train, {x: feed_x, t: feed_t})
                times.append(time.perf_counter() - start)
            comm = runner.communication()
            wire = sum(v for k, v in comm.items() if k != "steps") / comm["steps"]
            predicted = runner.plan.predicted_bytes_per_step
            tiles = runner.tiles()  # tiles of the split weights and of their slots
            memory = (sum(t["value"].nbytes for t in tiles.values())
                      + sum(int(np.prod(v.shape)) * 4 * 3 for name, v in values.items()
                            if name not in tiles))
    else:
        g, x, t, train, _, _ = split_mlp.single_device(sizes, values, loss_name, "adam")
        with tfpar.get_runner(g) as runner:
            for _ in range(steps):
                start = time.perf_counter()
                runner.run(train, {x: feed_x, t: feed_t})
                times.append(time.perf_counter() - start)
            comm = runner.communication()
            wire = sum(comm[k] for k in ("allreduce", "allgather", "ps_push", "ps_pull")) \
                / comm["steps"]
        params = sum(int(np.prod(v.shape)) for v in values.values())
        predicted, memory = None, params * 4 * 3  # weights, Adam's m and v
    rows = tfpar_gather({"step_s": statistics.median(times[warmup:]), "wire": wire,
                         "predicted": predicted, "memory": memory})
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"model": model, "system": system, "workers": n, "ranks": rows}, f)


def tfpar_gather(row):
    from tfpar.runtime import job
    return [json.loads(s) for s in job.allgather_strings(json.dumps(row))]


def run_job(model, system, n, args):
    return run_for_json(
        n, [os.path.abspath(__file__), "--worker", system, "--model", model, "--steps",
            str(args.steps), "--warmup", str(args.warmup)],
        f"{model}, {system}", repo=REPO, timeout=args.timeout)


def summarise(result):
    ranks = result["ranks"]
    mean = lambda k: sum(r[k] for r in ranks) / len(ranks)  # noqa: E731
    return {"step_ms": 1e3 * max(r["step_s"] for r in ranks), "wire_mb": mean("wire") / 1e6,
            "predicted_mb": (mean("predicted") / 1e6 if ranks[0]["predicted"] is not None
                             else None),
            "memory_mb": max(r["memory"] for r in ranks) / 1e6}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--model", choices=list(MODELS), help=argparse.SUPPRESS)
    p.add_argument("--out", default=None,
                   help="the report's folder (default: docs/results/<name>/)")
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    args.out = args.out or results_dir("benchmark_tiles")
    if args.worker:
        return worker(args.model, args.worker, args.steps, args.warmup, args.out)
    from scripts.report import machine
    rows = []
    for model in MODELS:
        for n in args.workers:
            for system in SYSTEMS:
                s = summarise(run_job(model, system, n, args))
                rows.append(dict(s, model=model, workers=n, system=system))
                print(f"{model:16s} N={n} {system:14s} {s['step_ms']:8.1f} ms "
                      f"{s['wire_mb']:8.3f} MB/step {s['memory_mb']:8.2f} MB", flush=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d")
    lines = ["| model | N | system | step (ms) | wire MB/step/worker | predicted | "
             "weights + slots MB/worker | memory vs data parallel |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        dp = next(x for x in rows if x["model"] == r["model"] and x["workers"] == r["workers"]
                  and x["system"] == "data parallel")
        pred = f"{r['predicted_mb']:.3f}" if r["predicted_mb"] is not None else "-"
        lines.append(f"| {r['model']} | {r['workers']} | {r['system']} | {r['step_ms']:.1f} | "
                     f"{r['wire_mb']:.3f} | {pred} | {r['memory_mb']:.2f} | "
                     f"{r['memory_mb'] / dp['memory_mb']:.3f} |")
    text = (f"# Wide layers at small batch: data parallel against split weights\n\n"
            f"`{invocation()}`, {stamp}, on {machine()}. N workers on this one machine "
            f"(localhost, Gloo); Adam; {args.steps} steps, the median after {args.warmup} "
            "of the slowest worker. Wire: sent plus received per worker per step, measured "
            "(tfpar's counters; the bytes Horovod reports arriving in the split "
            "plan's all-to-alls, doubled); predicted: the plan's exchanges (rewrite: "
            "`runner.plan`'s bytes per step, its allreduced variables included). split: "
            "tile layers written for the plan (`examples/split_mlp.py`); rewrite: the "
            "single-device graph through `get_runner(config=Config(tiling=...))`. Models: "
            + "; ".join(f"{m} {MODELS[m][0]}, global batch {MODELS[m][1]}" for m in MODELS)
            + ".\n\n" + "\n".join(lines) + "\n")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "benchmark_tiles.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "benchmark_tiles.json"), "w") as f:
        json.dump({"machine": machine(), "date": stamp, "argv": sys.argv, "rows": rows}, f,
                  indent=2)
    _plot(rows, os.path.join(args.out, "benchmark_tiles.png"))
    print(text)


def _plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    labels = sorted({(r["model"], r["workers"]) for r in rows})
    for ax, key, title in zip(axes, ("step_ms", "wire_mb", "memory_mb"),
                              ("step time (ms)", "wire MB/step/worker",
                               "weights + slots MB/worker")):
        for k, system in enumerate(SYSTEMS):
            vals = [next(r[key] for r in rows if (r["model"], r["workers"]) == lab
                         and r["system"] == system) for lab in labels]
            width = 0.8 / len(SYSTEMS)
            ax.bar([i + width * k for i in range(len(labels))], vals, width, label=system)
        ax.set_xticks([i + 0.4 - 0.4 / len(SYSTEMS) for i in range(len(labels))])
        ax.set_xticklabels([f"{m}\nN={n}" for m, n in labels], fontsize=7)
        ax.set_title(title)
    axes[1].set_yscale("log")  # hundreds of MB against a few hundred kB
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
