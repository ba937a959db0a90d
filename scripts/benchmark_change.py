"""Benchmark: a change against the commit before it, interleaved on the emulated cluster.

    .venv/bin/python -m scripts.benchmark_change --base COMMIT --name NAME [--repeats 3] \
        -- <scripts.benchmark_cluster arguments, e.g. --rates 1gbit --batch 128 --systems AR>

Runs `scripts.benchmark_cluster` with the given arguments (one repeat per run) in the
base commit (a copy made by `git archive`, using this checkout's .venv) and in this
working tree, alternately, `--repeats` times each, so both see the same machine. Reports
each (link, system)'s median step time and wire bytes per tree and their ratio (this
tree over the base). Writes docs/results/<NAME>/<NAME>.{md,json}.
"""
import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from scripts.report import invocation, machine, results_dir  # noqa: E402


def _copy_of(commit: str, into: str) -> str:
    """A copy of the repository at `commit` in `into`, with this checkout's .venv."""
    os.makedirs(into, exist_ok=True)
    archive = subprocess.run(["git", "archive", commit], cwd=REPO, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "x", "-C", into], input=archive, check=True)
    os.symlink(os.path.join(REPO, ".venv"), os.path.join(into, ".venv"))
    return into


def _one_run(tree: str, args, out: str, timeout: float):
    """The rows of one `benchmark_cluster` run (one repeat) in `tree`."""
    os.makedirs(out, exist_ok=True)
    cmd = [os.path.join(REPO, ".venv", "bin", "python"), "-m", "scripts.benchmark_cluster",
           *args, "--repeats", "1", "--name", "change", "--out", out]
    env = {**os.environ, "PYTHONPATH": tree}
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        sys.exit(f"benchmark_cluster failed in {tree}:\n{proc.stdout[-3000:]}\n"
                 f"{proc.stderr[-3000:]}")
    with open(os.path.join(out, "change.json")) as f:
        return json.load(f)["rows"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="the commit to compare against")
    p.add_argument("--name", required=True, help="docs/results/<NAME>/")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--what", default="", help="one line: what the change is")
    p.add_argument("cluster_args", nargs=argparse.REMAINDER,
                   help="after --: the arguments of scripts.benchmark_cluster")
    args = p.parse_args()
    cluster_args = [a for a in args.cluster_args if a != "--"]
    base_sha = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=REPO, check=True,
                              capture_output=True, text=True).stdout.strip()
    head_sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, check=True,
                              capture_output=True, text=True).stdout.strip()
    scratch = tempfile.mkdtemp(prefix="tfpar_change_")
    try:
        trees = {"base": _copy_of(args.base, os.path.join(scratch, "base")), "this": REPO}
        runs = {"base": [], "this": []}
        for repeat in range(args.repeats):
            for label, tree in trees.items():
                rows = _one_run(tree, cluster_args,
                                os.path.join(scratch, f"{label}_{repeat}"), args.timeout)
                runs[label].append(rows)
                for r in rows:
                    print(f"repeat {repeat + 1} {label}: {r['rate']} {r['system']} "
                          f"{1e3 * r['step_time_s']:.1f} ms/step "
                          f"{r['wire_per_step_worker'] / 1e6:.3f} MB", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def medians(label):
        out = {}
        for rows in runs[label]:
            for r in rows:
                key = (r["rate"], r["system"])
                out.setdefault(key, ([], []))
                out[key][0].append(r["step_time_s"])
                out[key][1].append(r["wire_per_step_worker"])
        return {k: (statistics.median(t), statistics.median(b), t) for k, (t, b) in out.items()}

    base, this = medians("base"), medians("this")
    table = []
    for key in sorted(this):
        if key not in base:
            continue
        (bt, bb, bts), (tt, tb, tts) = base[key], this[key]
        table.append({"rate": key[0], "system": key[1], "base_ms": 1e3 * bt,
                      "this_ms": 1e3 * tt, "ratio": tt / bt, "base_mb": bb / 1e6,
                      "this_mb": tb / 1e6, "base_runs_ms": [1e3 * x for x in bts],
                      "this_runs_ms": [1e3 * x for x in tts]})
    date = datetime.date.today().isoformat()
    lines = [f"# A change against its base: {args.what or args.name}", "",
             f"`{invocation()}`, {date}, on {machine()}: `scripts.benchmark_cluster` "
             f"run in the base ({base_sha}) and in this tree ({head_sha} and its working "
             f"tree), alternately, {args.repeats} times each (one repeat per run); the "
             "median of the runs. Wire: MB per step per worker on the hosts' links.", "",
             "| link | system | base (ms) | this (ms) | this / base | base MB | this MB | "
             "runs, base (ms) | runs, this (ms) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['rate']} | {r['system']} | {r['base_ms']:.1f} | "
                     f"{r['this_ms']:.1f} | **{r['ratio']:.2f}x** | {r['base_mb']:.3f} | "
                     f"{r['this_mb']:.3f} | "
                     + ", ".join(f"{x:.1f}" for x in r["base_runs_ms"]) + " | "
                     + ", ".join(f"{x:.1f}" for x in r["this_runs_ms"]) + " |")
    folder = results_dir(args.name)
    with open(os.path.join(folder, f"{args.name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(folder, f"{args.name}.json"), "w") as f:
        json.dump({"machine": machine(), "date": date, "argv": sys.argv[1:], "base": base_sha,
                   "this": head_sha, "rows": table}, f, indent=2)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
