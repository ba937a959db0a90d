"""Benchmark: the language model on an emulated cluster, tfpar against Horovod and TF's PS.

    sudo .venv/bin/python -m scripts.benchmark_cluster [--hosts 2] [--rates 100mbit 1gbit]
        [--vocabs 200000 50000] [--batch 2048] [--repeats 1] [--model lm|recommender]

`--model recommender` runs examples/recommender.py (several Zipf tables, FTRL + Adagrad;
`--vocabs` is its item vocabulary, `--batch` examples per worker) with tfpar's systems
only, and compares density routing with every fixed route. System `AR_frozen` runs either
example with its tables frozen (`--freeze-tables`): the step with no sparse gradient, a
floor no route's step can go under.

Hosts are network namespaces on links shaped with tc (`tfpar.testing.emulate`); horovodrun starts on
the first host and reaches the others over ssh, as on a real cluster. N = 2 workers per
host. For each link rate, vocabulary and N, the systems run interleaved (each repeat runs
every system once): tfpar HYBRID, AR and PS (examples/lm.py), plain Horovod's
DistributedOptimizer (allgather for sparse gradients, and `sparse_as_dense`;
scripts/lm_horovod_baseline.py) and TensorFlow's classic parameter servers
(`replica_device_setter` + `SyncReplicasOptimizer`; scripts/lm_tf_ps_baseline.py).

Wire bytes are the hosts' link counters (veth statistics) read when the chief prints the
warm-up step and when every worker is done (tfpar; an asynchronous chief runs ahead of
the others) or the last step (the baselines), so start-up is excluded; they are shown per step per worker
beside each system's analytic bytes (Parallax, Table 3, on this topology: ring collectives
whose ring crosses each host boundary once, parameters spread evenly over one PS per host)
and beside the floor: HYBRID's model with duplicate ids removed. Writes
docs/benchmark_cluster.{md,json,png}.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from tfpar.testing.launch import horovodrun_command  # noqa: E402
from scripts.report import invocation, machine, results_dir  # noqa: E402

from tfpar.testing.emulate import EmulatedCluster  # noqa: E402

SYSTEMS = ("HYBRID", "HYBRID_auto", "HYBRID_measured", "HYBRID_trials", "HYBRID_allreduce",
           "HYBRID_allgather", "HYBRID_sharded", "HYBRID_sharded_direct",
           "HYBRID_sharded_ahead", "HYBRID_sharded_ahead_folded", "HYBRID_sharded_direct_folded",
           "HYBRID_sharded_ranges", "HYBRID_ps_ranges", "HYBRID_sharded_direct_ranges",
           "HYBRID_async",
           "HYBRID_direct", "AR", "AR_folded", "AR_frozen", "PS", "PS_measured", "PS_async", "PS_direct",
           "horovod", "horovod_sparse_as_dense", "tf_ps")
DEFAULT_SYSTEMS = ("HYBRID", "HYBRID_auto", "HYBRID_async", "AR", "PS", "PS_async", "horovod",
                   "horovod_sparse_as_dense", "tf_ps")
LABELS = {"HYBRID": "tfpar HYBRID", "AR": "tfpar AR", "PS": "tfpar PS",
          "AR_folded": "tfpar AR, the allreduce in the allgather",
          "AR_frozen": "tfpar AR, tables frozen (no sparse gradient: no route's step is "
                       "shorter)",
          "HYBRID_auto": "tfpar HYBRID, density routing",
          "HYBRID_allreduce": "tfpar HYBRID, sparse by allreduce",
          "HYBRID_allgather": "tfpar HYBRID, sparse by allgather",
          "HYBRID_sharded": "tfpar HYBRID, sparse sharded (all-to-all)",
          "HYBRID_sharded_direct": "tfpar HYBRID, sparse sharded, no local aggregation",
          "HYBRID_sharded_ahead": "tfpar HYBRID, sparse sharded, no local aggregation, ids "
                                  "a step ahead",
          "HYBRID_sharded_ahead_folded": "tfpar HYBRID, sparse sharded, no local "
                                         "aggregation, ids a step ahead, the dense "
                                         "gradients in the all-to-all",
          "HYBRID_sharded_direct_folded": "tfpar HYBRID, sparse sharded, no local "
                                          "aggregation, the dense gradients in the all-to-all",
          "HYBRID_sharded_ranges": "tfpar HYBRID, sparse sharded, rows in ranges",
          "HYBRID_ps_ranges": "tfpar HYBRID, the servers' parts in row ranges",
          "HYBRID_sharded_direct_ranges": "tfpar HYBRID, sparse sharded, no local "
                                          "aggregation, rows in ranges",
          "HYBRID_async": "tfpar HYBRID async", "PS_async": "tfpar PS async",
          "HYBRID_direct": "tfpar HYBRID, no local aggregation",
          "HYBRID_measured": "tfpar HYBRID, routes and aggregation measured",
          "HYBRID_trials": "tfpar HYBRID, routes timed in trials",
          "PS_measured": "tfpar PS, aggregation measured",
          "PS_direct": "tfpar PS, no local aggregation",
          "horovod": "Horovod (allgather)", "horovod_sparse_as_dense": "Horovod sparse_as_dense",
          "tf_ps": "TF parameter servers"}
CONTEXT, EMB, HIDDEN, SAMPLED = 4, 64, 128, 64  # examples/lm.py's defaults
IDX = 8  # bytes of an int64 index per row


def rate_bits(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for u, f in units.items():
        if rate.endswith(u):
            return float(rate[:-len(u)]) * f
    return float(rate)


# -- the analytic model ---------------------------------------------------------------------
def batch_rows(vocab, batch, workers_per_host=2, trials=5):
    """Mean rows per step: per worker with duplicates (`ids`), unique per worker (`w`) and
    unique per host (`h`), for the embedding (context words) and the sampled softmax
    (targets plus the sampled classes), on the generated text."""
    from examples import lm
    words = lm.zipf_text(vocab)
    rng = np.random.RandomState(0)
    out = {k: [] for k in ("emb_ids", "emb_w", "emb_h", "soft_ids", "soft_w", "soft_h")}
    for _ in range(trials):
        host_emb, host_soft = [], []
        sampled = set(rng.choice(vocab, size=min(SAMPLED, vocab - 1), replace=False).tolist())
        for _ in range(workers_per_host):
            starts = rng.randint(0, len(words) - CONTEXT - 1, size=batch)
            ctx = words[starts[:, None] + np.arange(CONTEXT)].ravel()
            targets = words[starts + CONTEXT]
            out["emb_ids"].append(len(ctx))
            out["emb_w"].append(len(np.unique(ctx)))
            out["soft_ids"].append(len(targets) + len(sampled))
            out["soft_w"].append(len(set(targets.tolist()) | sampled))
            host_emb.append(ctx)
            host_soft.append(targets)
        out["emb_h"].append(len(np.unique(np.concatenate(host_emb))))
        out["soft_h"].append(len(set(np.concatenate(host_soft).tolist()) | sampled))
    return {k: float(np.mean(v)) for k, v in out.items()}


def model_bytes(system, vocab, n, hosts, rows):
    """Bytes per step that cross host links in total, divided by N (per worker)."""
    emb_row, soft_row = EMB * 4, (HIDDEN + 1) * 4  # softmax weights row + bias element
    dense = (CONTEXT * EMB * HIDDEN + HIDDEN) * 4
    sparse_all = vocab * (EMB * 4 + soft_row)
    remote = (hosts - 1) / hosts
    crossing = hosts if hosts > 1 else 0  # ring edges from one host to the next

    def ring_allreduce(w):
        return crossing * 2.0 * w * (n - 1) / n

    def ring_allgather(per_worker):
        return crossing * (n - 1) * per_worker

    def ps(pull_w, push_h):  # rows each worker reads, rows each host pushes (with indices)
        return n * pull_w * remote + hosts * push_h * remote

    sparse_unique_pull = rows["emb_w"] * (emb_row + IDX) + rows["soft_w"] * (soft_row + IDX)
    sparse_host_push = rows["emb_h"] * (emb_row + IDX) + rows["soft_h"] * (soft_row + IDX)
    sparse_dup = rows["emb_ids"] * (emb_row + IDX) + rows["soft_ids"] * (soft_row + IDX)
    # density routing's allreduce: every sparse variable whole, one count per row
    sparse_dense_rows = vocab * ((EMB * 4 + 4) + (HIDDEN * 4 + 4) + (4 + 4))
    per_worker_push = rows["emb_w"] * (emb_row + IDX) + rows["soft_w"] * (soft_row + IDX)
    if system == "floor":
        total = ring_allreduce(dense) + ps(sparse_unique_pull, sparse_host_push)
    elif system in ("HYBRID", "HYBRID_ps_ranges"):
        total = ring_allreduce(dense) + ps(sparse_unique_pull, sparse_host_push)
    elif system == "HYBRID_allreduce":
        total = ring_allreduce(dense + sparse_dense_rows)
    elif system in ("HYBRID_async", "HYBRID_direct"):  # every worker pushes its own rows
        total = ring_allreduce(dense) + ps(sparse_unique_pull, per_worker_push * n / hosts)
    elif system == "PS":
        total = ps(sparse_unique_pull + dense, sparse_host_push + dense)
    elif system in ("PS_async", "PS_direct"):
        total = ps(sparse_unique_pull + dense, (per_worker_push + dense) * n / hosts)
    elif system in ("HYBRID_sharded", "HYBRID_sharded_ranges"):  # each worker's unique
        # rows from their owners, each host's unique row gradients to them (local
        # aggregation): the servers' bytes
        total = ring_allreduce(dense) + ps(sparse_unique_pull, sparse_host_push)
    elif system in ("HYBRID_sharded_direct", "HYBRID_sharded_ahead",
                    "HYBRID_sharded_direct_ranges"):  # each worker's
        # unique rows, both ways
        total = ring_allreduce(dense) + 2 * n * per_worker_push * remote
    elif system in ("HYBRID_sharded_ahead_folded", "HYBRID_sharded_direct_folded"):
        # every worker's dense gradients to every worker on the other hosts, directly
        total = n * dense * n * remote + 2 * n * per_worker_push * remote
    elif system == "AR_frozen":  # the dense layer alone
        total = ring_allreduce(dense)
    elif system in ("AR", "horovod", "HYBRID_allgather"):
        total = ring_allreduce(dense) + ring_allgather(sparse_dup)
    elif system == "AR_folded":  # every worker's dense gradients gathered with the rows
        total = ring_allgather(dense + sparse_dup)
    elif system == "horovod_sparse_as_dense":
        total = ring_allreduce(dense + sparse_all)
    elif system == "tf_ps":  # every worker pulls and pushes for itself, duplicates included
        total = ps(sparse_dup + dense, 0) + n * (sparse_dup + dense) * remote
    elif system in ROUTED + ("PS_measured",):  # until the job says
        total = ring_allreduce(dense) + ps(sparse_unique_pull, sparse_host_push)
    else:
        raise ValueError(system)
    return total / n


def modelled_as(system, summary):
    """The system whose model describes a run: density routing's is the route it chose."""
    if system == "PS_measured":
        return "PS" if summary.get("local_aggregation", True) else "PS_direct"
    if system not in ROUTED:
        return system
    sparse = [name for name, c in (summary.get("routing") or {}).get("choices", {}).items()]
    routes = {summary["routes"][name] for name in sparse}
    if routes == {"allreduce"}:
        return "HYBRID_allreduce"
    if routes == {"allgather"}:
        return "HYBRID_allgather"
    return "HYBRID" if summary.get("local_aggregation", True) else "HYBRID_direct"


def density_of(summary):
    """{variable: measured alpha} of a density-routed run ({} otherwise)."""
    return {name: c["alpha"] for name, c in
            ((summary.get("routing") or {}).get("choices") or {}).items()}


# -- running one system ---------------------------------------------------------------------
def command(system, vocab, batch, steps, warmup, hosts, model="lm", partitions=None):
    if system in ("HYBRID", "AR", "PS") or system.startswith(("HYBRID_", "PS_", "AR_")):
        mode, _, variant = system.partition("_")
        script = [os.path.join(REPO, "examples", f"{model}.py"), "--run-mode", mode,
                  "--partitions", str(partitions or hosts)]
        if model == "recommender" and variant == "":
            variant = "ps"  # its own default is "auto"
        script += {"": [], "auto": ["--sparse-route", "auto"],
                   "allreduce": ["--sparse-route", "allreduce"],
                   "allgather": ["--sparse-route", "allgather"],
                   "sharded": ["--sparse-route", "sharded"], "async": ["--async"],
                   "sharded_direct": ["--sparse-route", "sharded", "--no-local-aggregation"],
                   "sharded_ahead": ["--sparse-route", "sharded", "--no-local-aggregation",
                                     "--ids-ahead"],
                   "sharded_ahead_folded": ["--sparse-route", "sharded",
                                            "--no-local-aggregation", "--ids-ahead",
                                            "--allreduce-by-allgather", "on"],
                   "sharded_direct_folded": ["--sparse-route", "sharded",
                                             "--no-local-aggregation",
                                             "--allreduce-by-allgather", "on"],
                   "sharded_ranges": ["--sparse-route", "sharded", "--sharded-rows", "ranges"],
                   "ps_ranges": ["--sparse-route", "ps", "--ps-rows", "ranges"],
                   "sharded_direct_ranges": ["--sparse-route", "sharded",
                                             "--no-local-aggregation", "--sharded-rows",
                                             "ranges"],
                   "ps": ["--sparse-route", "ps"],
                   "frozen": ["--freeze-tables"],
                   "folded": ["--allreduce-by-allgather", "on"],
                   "direct": ["--no-local-aggregation"],
                   # "force": each job times its own (a remembered result would be
                   # another link rate's: the emulated hosts keep their names)
                   "trials": ["--sparse-route", "auto", "--local-aggregation", "auto",
                              "--search-routes", "force"],
                   "measured": ["--sparse-route", "auto", "--local-aggregation", "auto"]
                   if mode == "HYBRID" else ["--local-aggregation", "auto"]}[variant]
    elif system == "tf_ps":
        script = [os.path.join(REPO, "scripts", "lm_tf_ps_baseline.py")]
    else:
        script = [os.path.join(REPO, "scripts", "lm_horovod_baseline.py")]
        if system == "horovod_sparse_as_dense":
            script.append("--sparse-as-dense")
    return script + ["--vocab", str(vocab), "--batch-size", str(batch), "--steps", str(steps),
                     "--warmup", str(warmup), "--log-every", str(warmup)]


SILENCE_S = 300  # a job that prints nothing this long is hung (a step of the dense route
# at 100 Mbit/s takes 20 s, and its start-up broadcast of the tables a minute)


class Watchdog:
    """Kills `proc` once it has run `total_s` seconds or printed nothing for `silence_s`
    (call `saw_output` at each line); `killed` then says which."""

    def __init__(self, proc, total_s: float, silence_s: float, poll_s: float = 1.0):
        self.proc, self.total_s, self.silence_s = proc, total_s, silence_s
        self.start = self.last = time.monotonic()
        self.killed = None
        self._done = threading.Event()
        threading.Thread(target=self._watch, args=(poll_s,), daemon=True).start()

    def saw_output(self):
        self.last = time.monotonic()

    def cancel(self):
        self._done.set()

    def _watch(self, poll_s):
        while not self._done.wait(poll_s):
            now = time.monotonic()
            if now - self.start > self.total_s:
                self.killed = f"ran past {self.total_s:g} s"
            elif now - self.last > self.silence_s:
                self.killed = f"printed nothing for {self.silence_s:g} s"
            else:
                continue
            self.proc.kill()
            return


def run_one(cluster, system, vocab, batch, n, hosts, steps, warmup, timeout, model="lm",
            per_host=2, partitions=None):
    """Runs one job; returns its summary with the wire bytes between the warm-up step and
    the last step."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "summary.json")
        # The start-up broadcast of 200k-row variables and their slots takes over Gloo's
        # default 30 s per operation on 100 Mbit/s links at N = 6.
        cmd, env = horovodrun_command(
            n, [*command(system, vocab, batch, steps, warmup, hosts, model, partitions), "--json",
                out],
            cluster.hosts_arg(per_host, hosts), cluster, REPO,
            {"HOROVOD_GLOO_TIMEOUT_SECONDS": "600"}, log_level="3")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, cwd=REPO)
        marks, tail = {}, []
        # A job that hangs is killed (its output then ends): tfpar's own jobs end
        # themselves past their deadlines, the baselines have none.
        watchdog = Watchdog(proc, timeout, SILENCE_S)
        for line in proc.stdout:
            watchdog.saw_output()
            tail = (tail + [line])[-60:]
            if "<stdout>:step" in line:
                step = int(line.split("step")[1].split()[0])
                if step in (warmup, steps):
                    marks[step] = cluster.wire_bytes()
            elif "<stdout>:done:" in line:  # tfpar's: printed once every worker is done
                marks["done"] = cluster.wire_bytes()
        proc.wait()
        watchdog.cancel()
        if proc.returncode != 0 or not os.path.exists(out) or warmup not in marks \
                or steps not in marks:
            killed = f" (killed: {watchdog.killed})" if watchdog.killed else ""
            raise RuntimeError(f"{system} N={n} vocab={vocab} failed{killed}:\n"
                               f"{''.join(tail)}")
        with open(out) as f:
            summary = json.load(f)
    # The end: when every worker is done (an asynchronous chief runs ahead of the others).
    w0, w1 = marks[warmup], marks.get("done", marks[steps])
    # TF's SyncReplicas baseline counts the job's steps (updates) itself: its chief may run
    # several own steps per update.
    timed = summary.get("updates", steps - warmup)
    sent = sum(w1[h]["sent"] - w0[h]["sent"] for h in cluster.names[:hosts])
    summary.update(system=system, hosts=hosts, wire_per_step_worker=sent / timed / n)
    return summary


def recommender_dense_bytes(items, n, hosts):
    """Bytes one host link carries a step when every recommender table is allreduced whole
    (its embedding and its linear weight per row, and a count per row): a ring's share."""
    from examples.recommender import FEATURES
    floats = sum((vocab or items) * (width + 2) for vocab, width, _ in FEATURES.values())
    return 2.0 * floats * 4 * (n - 1) / n if hosts > 1 else 0.0


def plan_steps(system, vocab, batch, n, hosts, rate, rows, steps, warmup):
    """Fewer steps for a system whose analytic bytes make a step take many seconds."""
    if rows is None:  # the recommender: only its dense route is priced (every table whole)
        if system != "HYBRID_allreduce":
            return steps, warmup
        seconds = recommender_dense_bytes(vocab, n, hosts) * 8 / rate
    else:
        seconds = model_bytes(system, vocab, n, hosts, rows) * n / max(hosts, 1) * 8 / rate
    if seconds * (steps - warmup) <= 60:
        return steps, warmup
    timed = 2 * max(2, int(30 / max(seconds, 1e-3)))  # a multiple of the log interval, 2
    return 2 + timed, 2


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hosts", type=int, nargs="+", default=[2],
                   help="hosts per run (N = hosts x --per-host)")
    p.add_argument("--per-host", type=int, default=2,
                   help="workers per host (1: no two workers share a host's CPU cores)")
    p.add_argument("--partitions", type=int, default=None,
                   help="parts of each variable on the parameter servers (default: one "
                        "per host)")
    p.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"])
    p.add_argument("--vocabs", type=int, nargs="+", default=[200_000, 50_000])
    p.add_argument("--batch", type=int, default=2048, help="words per worker per step")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--systems", nargs="+", default=list(DEFAULT_SYSTEMS), choices=SYSTEMS)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--name", default="benchmark_cluster")
    p.add_argument("--model", default="lm", choices=("lm", "recommender"),
                   help="examples/lm.py (default) or examples/recommender.py (tfpar only)")
    p.add_argument("--out", default=None,
                   help="the report's folder (default: docs/results/<name>/)")
    p.add_argument("--merge", nargs="*", default=[], metavar="JSON",
                   help="earlier results of this script to show with this run's (a row of "
                   "this run replaces theirs for the same link, N, vocabulary and system)")
    p.add_argument("--render", metavar="JSON",
                   help="write the tables and plot of an earlier run's results; run nothing")
    args = p.parse_args()
    if args.warmup < 1 or args.steps % args.warmup:
        p.error("--steps must be a multiple of --warmup: each job logs every --warmup steps, "
                "and the wire bytes are read at the warm-up's log line and the last one")
    args.out = args.out or results_dir(args.name)
    if args.model != "lm" and set(args.systems) & {"horovod", "horovod_sparse_as_dense",
                                                   "tf_ps"}:
        p.error("the baselines (horovod*, tf_ps) are written for the language model only")
    if args.render:
        with open(args.render) as f:
            done = json.load(f)
        args.rates = list(dict.fromkeys(r["rate"] for r in done["rows"]))
        args.batch = done["rows"][0]["batch"]
        args.repeats = max(r["repeats"] for r in done["rows"])
        args.merged_from = done.get("merged_from", [])
        args.model = done.get("model", "lm")
        return write(done["rows"], args, done["argv"], done["date"])
    rows = []
    for rate in args.rates:
        with EmulatedCluster(hosts=max(args.hosts), rate=rate, name="tfpb") as cluster:
            for hosts in args.hosts:
                n = args.per_host * hosts
                for vocab in args.vocabs:
                    counts = (batch_rows(vocab, args.batch, args.per_host)
                              if args.model == "lm" else None)
                    runs = {s: [] for s in args.systems}
                    for _ in range(args.repeats):
                        for system in args.systems:
                            steps, warmup = plan_steps(system, vocab, args.batch, n, hosts,
                                                       rate_bits(rate), counts, args.steps,
                                                       args.warmup)
                            try:
                                r = run_one(cluster, system, vocab, args.batch, n, hosts,
                                            steps, warmup, args.timeout, args.model,
                                            args.per_host, args.partitions)
                            except RuntimeError as e:  # reported, and the others go on
                                print(f"{rate} N={n} vocab={vocab:,} {LABELS[system]}: {e}"
                                      [-6000:], flush=True)
                                continue
                            runs[system].append(r)
                            print(f"{rate} N={n} vocab={vocab:,} {LABELS[system]:<24} "
                                  f"{r['step_time_s'] * 1e3:8.1f} ms/step "
                                  f"{r['wire_per_step_worker'] / 1e6:8.3f} MB wire/step/worker",
                                  flush=True)
                    for system, rs in runs.items():
                        if not rs:
                            continue
                        rows.append({
                            "rate": rate, "workers": n, "hosts": hosts, "vocab": vocab,
                            "batch": args.batch, "system": system,
                            "step_time_s": statistics.median(r["step_time_s"] for r in rs),
                            "words_per_s": statistics.median(r["words_per_s"] for r in rs),
                            "wire_per_step_worker": statistics.median(
                                r["wire_per_step_worker"] for r in rs),
                            "model_per_step_worker": counts and model_bytes(
                                modelled_as(system, rs[-1]), vocab, n, hosts, counts),
                            "routes": {k: v for k, v in rs[-1].get("routes", {}).items()
                                       if k in density_of(rs[-1])},
                            "alpha": density_of(rs[-1]),
                            "local_aggregation": rs[-1].get("local_aggregation", True),
                            "allreduce_by_allgather": rs[-1].get("allreduce_by_allgather"),
                            "routing": rs[-1].get("routing"),  # links, predictions
                            "floor_per_step_worker": counts and model_bytes(
                                "floor", vocab, n, hosts, counts),
                            "loss_last": rs[-1].get("loss_last"), "repeats": len(rs),
                            "rows": counts})
        left = EmulatedCluster(name="tfpb").leftovers()
        if left:
            raise SystemExit(f"the emulated cluster left {left}")
    write(merged(rows, args), args)


def merged(rows, args):
    """This run's rows with those of earlier runs (`--merge`) it did not measure again."""
    def key(r):
        return r["rate"], r["workers"], r["vocab"], r["system"]
    mine = {key(r) for r in rows}
    args.merged_from = []
    for path in args.merge:
        with open(path) as f:
            earlier = json.load(f)
        base = len(args.merged_from)
        # Its own merged rows keep their commands: run k of it is run base + 1 + k here.
        args.merged_from += [invocation(earlier["argv"])] + earlier.get("merged_from", [])
        rows = rows + [dict(r, run=base + 1 + r.get("run", 0)) for r in earlier["rows"]
                       if key(r) not in mine]
        args.rates = list(dict.fromkeys(args.rates + [r["rate"] for r in earlier["rows"]]))
    order = {s: i for i, s in enumerate(SYSTEMS)}
    return sorted(rows, key=lambda r: (rate_bits(r["rate"]), r["workers"], r["vocab"],
                                       order[r["system"]]))


def table(rows, rate, unit="words"):
    head = (f"| N | vocab | system | step (ms) | {unit}/s | wire MB/step/worker | model MB | "
            "floor MB | wire / floor | step vs HYBRID |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if r["rate"] != rate:
            continue
        hybrid = next((x for x in rows if x["rate"] == rate and x["workers"] == r["workers"]
                       and x["vocab"] == r["vocab"] and x["system"] == "HYBRID"), r)
        lines.append(
            f"| {r['workers']} | {r['vocab']:,} | {LABELS[r['system']]}"
            + (f" (run {r['run']})" if r.get("run") else "") + " | "
            f"{r['step_time_s'] * 1e3:.0f} | {r['words_per_s']:,.0f} | "
            f"{r['wire_per_step_worker'] / 1e6:.3f} | " + _mb(r["model_per_step_worker"])
            + _mb(r["floor_per_step_worker"])
            + (f"{r['wire_per_step_worker'] / r['floor_per_step_worker']:.2f}x | "
               if r["floor_per_step_worker"] else "- | ")
            + f"{r['step_time_s'] / hybrid['step_time_s']:.2f}x |")
    return "\n".join(lines)


def _mb(b):
    return "- | " if b is None else f"{b / 1e6:.3f} | "


# (column, route, system): every sparse variable on one route, local aggregation as the
# system sets it.
FIXED_ROUTES = (("ps", "ps", "HYBRID"), ("ps, row ranges", "ps", "HYBRID_ps_ranges"),
                ("ps, no aggregation", "ps", "HYBRID_direct"),
                ("allreduce", "allreduce", "HYBRID_allreduce"),
                ("allgather", "allgather", "HYBRID_allgather"),
                ("sharded", "sharded", "HYBRID_sharded"),
                ("sharded, no aggregation", "sharded", "HYBRID_sharded_direct"))
ROUTED = ("HYBRID_auto", "HYBRID_measured", "HYBRID_trials")  # density routing (and more)


def density_table(rows):
    """Per configuration and density-routed system: the measured alphas, the routes
    chosen and the time, each fixed route's time (the fixed routes this run measured), and
    whether it chose the fastest route (one route for every variable; a route within 5%
    of the fastest counts) or, routes mixed, how much faster it ran than the fastest
    fixed route."""
    columns = [c for c in FIXED_ROUTES if any(r["system"] == c[2] for r in rows)]
    lines = []
    for r in rows:
        if r["system"] not in ROUTED:
            continue
        same = {x["system"]: x for x in rows if (x["rate"], x["workers"], x["vocab"])
                == (r["rate"], r["workers"], r["vocab"])}
        fixed = {label: (route, same[system]["step_time_s"]) for label, route, system
                 in columns if system in same}
        chosen = sorted(set(r["routes"].values()))
        if len({route for route, _ in fixed.values()}) < 2:
            verdict = "-"
        elif len(chosen) == 1 and chosen[0] not in {route for route, _ in fixed.values()}:
            best = min(t for _, t in fixed.values())
            verdict = (f"{chosen[0]}, not measured alone: "
                       + (f"{best / r['step_time_s']:.2f}x faster than" if r["step_time_s"] < best
                          else f"{r['step_time_s'] / best:.2f}x the time of")
                       + " the fastest route measured")
        elif len(chosen) == 1:
            best = min(t for _, t in fixed.values())
            near = sorted({route for route, t in fixed.values() if t <= 1.05 * best})
            verdict = ("yes" if chosen[0] in near else "no") + (
                f" (within 5%: {', '.join(near)})" if len(near) > 1 else "")
        else:
            best = min(t for _, t in fixed.values())
            verdict = ("routes mixed: " + (f"{best / r['step_time_s']:.2f}x faster than"
                                           if r["step_time_s"] < best else
                                           f"{r['step_time_s'] / best:.2f}x the time of")
                       + " the fastest fixed route")
        alpha = r["alpha"]
        counted = ", ".join(f"{route} x{sum(1 for v in r['routes'].values() if v == route)}"
                            for route in chosen)
        aggregation = "on" if r.get("local_aggregation", True) else "off"
        lines.append(
            f"| {r['rate']} | {r['workers']} | {r['vocab']:,} | {LABELS[r['system']]} | "
            + (f"{min(alpha.values()):.3f} to {max(alpha.values()):.3f}" if alpha else "-")
            + f" | {counted}, aggregation {aggregation} | {r['step_time_s'] * 1e3:.0f} | "
            + " | ".join(f"{fixed[label][1] * 1e3:.0f}" if label in fixed else "-"
                         for label, _, _ in columns) + f" | {verdict} |")
    if not lines:
        return ""
    head = ("| link | N | vocab | system | alpha | routes chosen (variables) | "
            "density-routed (ms) | " + " | ".join(f"{label} (ms)" for label, _, _ in columns)
            + " | chose the fastest |")
    return "\n".join([head, "|" + "---|" * (head.count("|") - 1)] + lines)


def write(rows, args, argv=None, stamp=None):
    os.makedirs(args.out, exist_ok=True)
    argv = argv or sys.argv
    stamp = stamp or datetime.datetime.now().strftime("%Y-%m-%d")
    with open(os.path.join(args.out, args.name + ".json"), "w") as f:
        json.dump({"machine": machine(), "date": stamp, "argv": argv, "rows": rows,
                   "model": getattr(args, "model", "lm"),
                   "merged_from": getattr(args, "merged_from", [])}, f, indent=2)
    model = getattr(args, "model", "lm")
    title = "Language model" if model == "lm" else "Recommender (examples/recommender.py)"
    unit = "words" if model == "lm" else "examples"
    text = [f"# {title} on an emulated cluster\n\n`{invocation(argv)}`, "
            f"{stamp}, on {machine()}. Hosts are network namespaces on this one machine "
            f"(tfpar.testing.emulate), {rows[0]['workers'] // rows[0]['hosts']} worker(s) each, "
            "links shaped with tc tbf; all processes share "
            f"the machine's CPU cores. {args.batch} {unit} per worker per step; median of "
            f"{args.repeats} interleaved run(s). Wire bytes: the hosts' link counters between "
            "the warm-up step and the last step, divided by steps and workers. "
            + ("Model: the system's own bytes by Parallax's Table 3 on this topology; floor: "
               "HYBRID's with duplicate ids removed.\n" if model == "lm" else
               "vocab: the item table's (the large one).\n")]
    for i, argv in enumerate(getattr(args, "merged_from", []), 1):
        text.append(f"\nWith the rows this run did not measure from an earlier run ({i}): "
                    f"`{argv}`.\n")
    for rate in args.rates:
        text.append(f"\n## Links at {rate}\n\n{table(rows, rate, unit)}\n")
    sweep = density_table(rows)
    if sweep:
        text.append("\n## Density routing: measured alpha, the route chosen, and each route\n\n"
                    "alpha: the fraction of a variable's rows one worker's step touches, "
                    "measured by the density-routed run (the least and the most of its "
                    "sparse variables). `ps`, `allreduce`, `allgather` and `sharded`: tfpar "
                    "HYBRID with every sparse variable on the parameter servers, through a "
                    "dense allreduce, through Horovod's allgather, or its rows sharded over "
                    "the workers (all-to-all).\n\n" + sweep + "\n")
    text.append(f"\n![step time and wire bytes]({args.name}.png)\n")
    with open(os.path.join(args.out, args.name + ".md"), "w") as f:
        f.write("".join(text))
    print("".join(text))
    plot(rows, args, os.path.join(args.out, args.name + ".png"))


def plot(rows, args, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    configs = sorted({(r["rate"], r["workers"], r["vocab"]) for r in rows},
                     key=lambda c: (rate_bits(c[0]), c[1], c[2]))
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        xs = [j + i * width for j in range(len(configs))]
        sel = [next((r for r in rows if (r["rate"], r["workers"], r["vocab"]) == c
                     and r["system"] == system), None) for c in configs]
        axes[0].bar(xs, [r["step_time_s"] * 1e3 if r else 0 for r in sel], width,
                    label=LABELS[system])
        axes[1].bar(xs, [r["wire_per_step_worker"] / 1e6 if r else 0 for r in sel], width,
                    label=LABELS[system])
    for ax, title in zip(axes, ("step time (ms, log)", "wire MB per step per worker (log)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(configs))])
        ax.set_xticklabels([f"{r}\nN={n} V={v // 1000}k" for r, n, v in configs], fontsize=8)
        ax.set_yscale("log")
        ax.set_title(title)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{getattr(args, 'model', 'lm')} on emulated hosts, batch {args.batch} per "
                 f"worker; {machine()[:70]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
