"""Where a training step's time goes: traced steps of the LM, by kind of work.

    sudo .venv/bin/python -m scripts.step_breakdown [--batch 128] [--vocab 200000]
        [--rate 1gbit] [--systems HYBRID AR PS HYBRID_async HYBRID_sharded ...]
        [--env HOROVOD_CYCLE_TIME=0.5]

Runs examples/lm.py's graph under tfpar on 2 emulated hosts x 2 workers (`tfpar.testing.emulate`)
and traces steps on every worker with TensorFlow's RunMetadata (FULL_TRACE). Each traced
op is put in a kind: Horovod collectives, parameter-server reads (the gathers on the PS
and their transfers), pushes (accumulator applies), the chief's take and update, the
wait for the token, the sharded route's own ops (its collectives count as Horovod's), and
the model's own compute. Per kind: the busy time in the step
(union of its ops' intervals on all devices of the step) and the number of exchanges
(cross-process transfers and collectives) per step. Writes docs/results/step_breakdown/step_breakdown.md.
"""
import argparse
import datetime
import json
import os
import subprocess
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from tfpar.testing.launch import horovodrun_command  # noqa: E402
from scripts.report import invocation, results_dir  # noqa: E402

KINDS = ("compute", "horovod", "ps_read", "push", "chief_take_apply", "token_wait",
         "transfer", "sharded", "other_tfpar")
# The sparse route of each system (the LM's default: the parameter servers).
ROUTES = {"HYBRID_sharded": "sharded", "HYBRID_sharded_direct": "sharded",
          "HYBRID_sharded_ahead": "sharded",
          "HYBRID_allgather": "allgather", "HYBRID_measured": "auto"}


def kind_of(node: str, device: str, label: str = "") -> str:
    name = node.split(":")[0]
    if " = Horovod" in label:  # a collective named by its caller (the sharded exchanges)
        return "horovod"
    if name.startswith("Horovod") or "/Horovod" in name or "allreduce" in name.lower() \
            or "allgather" in name.lower() or "alltoall" in name.lower():
        return "horovod"
    if name.startswith("tfpar/sharded/"):  # the route's own ops: ids, rows, the owners' apply
        return "sharded"
    if name.startswith(("_Recv", "_Send", "RecvTensor")) or name in ("_Recv", "_Send"):
        return "transfer"
    if "token" in name.lower() or "sync/wait" in name:
        return "token_wait"
    if name.startswith("tfpar/apply") or "take" in name.lower() or "release" in name:
        return "chief_take_apply"
    if name.startswith(("tfpar/push", "tfpar/forward")) or "ApplyGradient" in name \
            or "apply_grad" in name.lower():
        return "push"
    if "/job:ps" in device and ("Gather" in name or "read" in name.lower()):
        return "ps_read"
    if name.startswith("tfpar/"):
        return "other_tfpar" if "/job:ps" not in device else "ps_read"
    return "compute"


def union(intervals):
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def breakdown(step_stats):
    """{kind: (busy seconds, exchanges)} and the step's wall time, from one RunMetadata."""
    spans = {k: [] for k in KINDS}
    exchanges = {k: 0 for k in KINDS}
    lo, hi = None, None
    for dev in step_stats.dev_stats:
        for n in dev.node_stats:
            a = n.all_start_micros / 1e6
            b = a + max(n.all_end_rel_micros, 1) / 1e6
            k = kind_of(n.node_name, dev.device, n.timeline_label)
            # A tensor from another process: the partitioner's _Recv (each one RecvTensor
            # call; every device here is a CPU of its own process, so no Recv is local).
            if " = _Recv(" in n.timeline_label or " = _HostRecv(" in n.timeline_label:
                exchanges["transfer"] += 1
                spans["transfer"].append((a, b))
                continue
            spans[k].append((a, b))
            if k in ("horovod", "transfer"):  # a collective; a tensor from another process
                exchanges[k] += 1
            lo = a if lo is None else min(lo, a)
            hi = b if hi is None else max(hi, b)
    out = {k: (union(v), exchanges[k]) for k, v in spans.items()}
    # Partitions of the step run by other processes (one RunGraph call each).
    remote = {d.device.split("/device:")[0] for d in step_stats.dev_stats
              if "/job:ps" in d.device}
    out["ps_partitions"] = (0.0, len(remote))
    return out, (hi or 0) - (lo or 0)


def worker(system, vocab, batch, steps, traced, out):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    from examples import lm
    import tfpar
    mode, _, variant = system.partition("_")
    graph, loss, train_op = lm.build_graph(lm.zipf_text(vocab), vocab, batch_size=batch)
    direct = variant.endswith(("direct", "ahead"))
    config = tfpar.Config(run_mode=mode, sync=variant != "async", partitions=2,
                          local_aggregation=False if direct else
                          "auto" if variant == "measured" else True,
                          sparse_route=ROUTES.get(system, "ps"),
                          ids_ahead=variant.endswith("ahead"))
    rows = []
    with tfpar.get_runner(graph, config=config) as runner:
        for step in range(steps):
            runner.run(train_op)
        options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
        walls = []
        for step in range(traced):
            meta = tf.compat.v1.RunMetadata()
            start = time.perf_counter()
            runner.run(train_op, options=options, run_metadata=meta)
            walls.append(time.perf_counter() - start)
            rows.append(breakdown(meta.step_stats)[0])
        untraced = []
        for step in range(traced):
            start = time.perf_counter()
            runner.run(train_op)
            untraced.append(time.perf_counter() - start)
        result = {"system": system, "rank": runner.worker_id,
                  "step_s": statistics.median(untraced), "traced_step_s": statistics.median(walls),
                  "kinds": {k: [statistics.median(r[k][0] for r in rows),
                                statistics.median(r[k][1] for r in rows)]
                            for k in KINDS + ("ps_partitions",)},
                  "local_aggregation": runner.plan.local_aggregation}
        with open(f"{out}.rank{runner.worker_id}.json", "w") as f:
            json.dump(result, f)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--systems", nargs="+", default=["HYBRID", "HYBRID_direct", "HYBRID_async",
                                                    "AR", "PS", "PS_direct", "PS_async"])
    p.add_argument("--vocab", type=int, default=200_000)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--steps", type=int, default=30, help="untraced steps first")
    p.add_argument("--traced", type=int, default=10)
    p.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE",
                   help="variables for the workers' environment (HOROVOD_CYCLE_TIME=0.5)")
    p.add_argument("--out", default=None,
                   help="the report's folder (default: docs/results/<name>/)")
    args = p.parse_args()
    args.out = args.out or results_dir("step_breakdown")
    if args.worker:
        return worker(args.worker, args.vocab, args.batch, args.steps, args.traced, args.result)
    from tfpar.testing.emulate import EmulatedCluster
    from scripts.report import machine
    results = {}
    with EmulatedCluster(hosts=2, rate=args.rate, name="tfpx") as cluster, \
            tempfile.TemporaryDirectory() as tmp:
        for system in args.systems:
            prefix = os.path.join(tmp, system)
            cmd, env = horovodrun_command(
                4, [os.path.abspath(__file__), "--worker", system, "--result", prefix,
                    "--vocab", str(args.vocab), "--batch", str(args.batch), "--steps",
                    str(args.steps), "--traced", str(args.traced)],
                cluster.hosts_arg(2, 2), cluster, REPO,
                env=dict(x.split("=", 1) for x in args.env), log_level="3")
            proc = subprocess.run(cmd, env=env, cwd=REPO, timeout=900, capture_output=True,
                                  text=True)
            if proc.returncode != 0:
                print(f"{system} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
                continue
            results[system] = [json.load(open(f"{prefix}.rank{r}.json")) for r in range(4)]
            print(system, json.dumps(results[system][1]), flush=True)
    if EmulatedCluster(name="tfpx").leftovers():
        raise SystemExit("the emulated cluster left something behind")
    stamp = datetime.datetime.now().strftime("%Y-%m-%d")
    lines = [f"# Where the step time goes\n\n`{invocation()}`, {stamp}, "
             f"on {machine()}. The LM at {args.batch} words per worker per step, vocabulary "
             f"{args.vocab:,}, N = 4 on 2 emulated hosts at {args.rate}. Per system: the "
             "median untraced step, and for worker 0 (chief) and worker 1 the busy time of "
             "each kind of work in a traced step (union of its ops' intervals over every "
             "device the step ran on; kinds overlap, so they do not add up to the step) and "
             "its exchanges per step (transfers: tensors received from another process, "
             "one RecvTensor call each; horovod: collectives). PS partitions: the parameter "
             "servers' parts of the step (one RunGraph call each).\n\n"
             "| system | step (ms) | worker | " + " | ".join(KINDS) + " | PS partitions |\n"
             "|" + "---|" * (4 + len(KINDS)) + "\n"]
    for system, ranks in results.items():
        for r in (0, 1):
            res = ranks[r]
            cells = [f"{res['kinds'][k][0] * 1e3:.1f} ms / {res['kinds'][k][1]:.0f}" for k in KINDS]
            lines.append(f"| {system} | {statistics.median(x['step_s'] for x in ranks) * 1e3:.1f}"
                         f" | {r} | " + " | ".join(cells)
                         + f" | {res['kinds']['ps_partitions'][1]:.0f} |\n")
    text = "".join(lines)
    with open(os.path.join(args.out, "step_breakdown.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
