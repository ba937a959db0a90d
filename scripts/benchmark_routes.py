"""Benchmark: the four sparse routes and density routing in every configuration of the
routes' sweep, on 2 emulated hosts x 2 workers (one run of each part, the systems
interleaved within each configuration).

    sudo .venv/bin/python -m scripts.benchmark_routes [--parts lm_small lm_large recommender]
    .venv/bin/python -m scripts.benchmark_routes --summary-only   # the table of a done run

Each part is one `scripts.benchmark_cluster` run, written to docs/results/routes_sweep/
<part>/; the summary, docs/results/routes_sweep/routes_sweep.{md,json}, puts every
configuration on one line: each fixed route's step (`ps`, `allgather`, `allreduce`,
`sharded`, the sharded variants where measured), `"auto"`'s step and the routes it chose,
and whether `"auto"` was the fastest (within 5% of the fastest fixed route, or faster).
The small batch also runs AR and TF's parameter servers, the targets' references.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from scripts.report import invocation, machine, results_dir  # noqa: E402

NAME = "routes_sweep"
FIXED = ("HYBRID", "HYBRID_allgather", "HYBRID_allreduce", "HYBRID_sharded")
ROUTE_OF = {"HYBRID": "ps", "HYBRID_allgather": "allgather", "HYBRID_allreduce": "allreduce",
            "HYBRID_sharded": "sharded", "HYBRID_sharded_direct": "sharded, no aggregation",
            "HYBRID_sharded_ahead": "sharded, ids ahead"}
# part -> (model, batch, rates, vocabulary, systems, repeats, steps, warm-up steps)
PARTS = {
    "lm_small": ("lm", 128, ["1gbit"], 200_000,
                 FIXED + ("HYBRID_sharded_ahead", "HYBRID_auto", "AR", "tf_ps"), 3, 120, 40),
    "lm_large": ("lm", 2048, ["100mbit", "1gbit"], 200_000,
                 FIXED + ("HYBRID_auto",), 1, 60, 20),
    "recommender": ("recommender", 512, ["100mbit", "1gbit"], 500_000,
                    FIXED + ("HYBRID_sharded_direct", "HYBRID_auto"), 2, 120, 40),
}
WITHIN = 1.05  # "auto" counts as the fastest within 5% of the fastest fixed route


def run_part(part):
    model, batch, rates, vocab, systems, repeats, steps, warmup = PARTS[part]
    cmd = [sys.executable, "-m", "scripts.benchmark_cluster", "--model", model,
           "--batch", str(batch), "--rates", *rates, "--vocabs", str(vocab),
           "--systems", *systems, "--repeats", str(repeats), "--steps", str(steps),
           "--warmup", str(warmup), "--name", part,
           "--out", os.path.relpath(os.path.join(results_dir(NAME), part), REPO)]
    print("+", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def configurations(done):
    """[{model, batch, rate, systems: {system: row}}] of the parts' results."""
    out = []
    for part, rows in done.items():
        model, batch = PARTS[part][:2]
        for rate in dict.fromkeys(r["rate"] for r in rows):
            out.append({"part": part, "model": model, "batch": batch, "rate": rate,
                        "systems": {r["system"]: r for r in rows if r["rate"] == rate}})
    return out


def verdict(config):
    """(fastest fixed system, its step, "auto"'s step, the routes "auto" chose, "yes"/"no")."""
    systems = config["systems"]
    fixed = {s: r["step_time_s"] for s, r in systems.items() if s in ROUTE_OF}
    auto = systems.get("HYBRID_auto")
    if not fixed or auto is None:
        return None
    best = min(fixed, key=fixed.get)
    chosen = sorted(set(auto["routes"].values()))
    counted = ", ".join(f"{route} x{sum(1 for v in auto['routes'].values() if v == route)}"
                        for route in chosen)
    counted += ", aggregation " + ("on" if auto.get("local_aggregation", True) else "off")
    if auto.get("allreduce_by_allgather"):
        counted += ", the dense gradients in the allgather"
    elif auto.get("allreduce_by_allgather", "unrecorded") == "unrecorded":
        counted += " (the dense gradients' fold not recorded)"  # runs before 2026-11-28
    fastest = auto["step_time_s"] <= WITHIN * fixed[best]
    return best, fixed[best], auto["step_time_s"], counted, "yes" if fastest else "no"


def summary(done):
    configs = configurations(done)
    shown = [s for s in ROUTE_OF if any(s in c["systems"] for c in configs)]
    head = ("| model, batch a worker | link | " + " | ".join(ROUTE_OF[s] for s in shown)
            + " | `\"auto\"` | routes it chose | fastest fixed | `\"auto\"` the fastest |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in configs:
        v = verdict(c)
        if v is None:
            continue
        best, best_s, auto_s, counted, ok = v
        cells = []
        for s in shown:
            r = c["systems"].get(s)
            cells.append("-" if r is None else
                         f"{r['step_time_s'] * 1e3:.1f} ms, {r['wire_per_step_worker'] / 1e6:.3f} MB")
        ref = "; ".join(f"{label} {c['systems'][s]['step_time_s'] * 1e3:.1f} ms"
                        for s, label in (("AR", "AR"), ("tf_ps", "TF's PS"))
                        if s in c["systems"])
        lines.append(
            f"| {c['model']}, {c['batch']} | {c['rate']} | " + " | ".join(cells)
            + f" | {auto_s * 1e3:.1f} ms ({auto_s / best_s:.2f}x the fastest fixed) | "
            f"{counted} | {ROUTE_OF[best]} | {ok}" + (f" ({ref})" if ref else "") + " |")
    return "\n".join(lines), sum(1 for c in configs if (verdict(c) or "")[4:] == ("yes",)), \
        sum(1 for c in configs if verdict(c))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    p.add_argument("--summary-only", action="store_true",
                   help="write the summary of the parts already in docs/results/routes_sweep/")
    args = p.parse_args()
    if not args.summary_only:
        for part in args.parts:
            run_part(part)
    folder = results_dir(NAME)
    done, commands = {}, []
    for part in PARTS:
        path = os.path.join(folder, part, part + ".json")
        if os.path.exists(path):
            with open(path) as f:
                result = json.load(f)
            done[part] = result["rows"]
            commands.append(f"`{invocation(result['argv'])}` ({result['date']})")
    table, fastest, total = summary(done)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d")
    text = (f"# The sparse routes and density routing, every configuration\n\n"
            f"`{invocation([a for a in sys.argv if a != '--summary-only'])}`, {stamp}, "
            f"on {machine()}. 2 emulated hosts x 2 workers "
            "(network namespaces, links shaped with tc tbf; every process shares this "
            "machine's cores). Each configuration's systems ran interleaved; a step is the "
            "median over the repeats of the mean of the timed steps; MB: wire bytes a step a "
            "worker. `ps`: the parameter servers (local aggregation on); `sharded`: rows "
            "dealt out over the workers, all-to-all (local aggregation on); `allreduce`: "
            "each table whole (fewer steps timed, it is seconds a step). `\"auto\"` counts as "
            f"the fastest within {WITHIN:.2f}x of the fastest fixed route.\n\n"
            f"**`\"auto\"` the fastest in {fastest} of {total} configurations.**\n\n"
            + table + "\n\nThe parts (their reports, with wire bytes against the model, "
            "density routing's measured alphas and plots, are in the folders beside this):\n\n"
            + "\n".join(f"- {c}" for c in commands) + "\n")
    with open(os.path.join(folder, NAME + ".md"), "w") as f:
        f.write(text)
    with open(os.path.join(folder, NAME + ".json"), "w") as f:
        json.dump({"machine": machine(), "date": stamp, "argv": sys.argv,
                   "parts": done}, f, indent=2)
    print(text)


if __name__ == "__main__":
    main()
