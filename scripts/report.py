"""What the benchmarks print about themselves: the machine, and the command that ran."""
import os
import platform
import sys


def machine() -> str:
    """CPU model, cores, memory and kernel of this machine."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        with open("/proc/meminfo") as f:
            memory = f", {int(f.readline().split()[1]) / 2 ** 20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        memory = ""
    return f"{cpu}, {os.cpu_count()} cores{memory}, {platform.system()} {platform.release()}"


def invocation(argv=None) -> str:
    """The command line of a benchmark run as a module (`python -m scripts.NAME ...`)."""
    argv = list(argv or sys.argv)
    name = os.path.splitext(os.path.basename(argv[0]))[0]
    return " ".join(["python", "-m", f"scripts.{name}", *argv[1:]])


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "docs", "results")


def results_dir(name: str) -> str:
    """docs/results/<experiment>/ for a report named `name` (`benchmark_` dropped), made."""
    folder = os.path.join(RESULTS, name[len("benchmark_"):] if name.startswith("benchmark_")
                          else name)
    os.makedirs(folder, exist_ok=True)
    return folder


# Claims read off a report's table: (what, [(system, against)]) -> "a / b ms = r x".
RATIOS = {
    "cluster_n4_100mbit": ("tfpar HYBRID against TF's parameter servers and Horovod, N = 4 on "
                           "2 hosts, 100 Mbit/s", [("tfpar HYBRID", "TF parameter servers"),
                                                   ("tfpar HYBRID", "Horovod (allgather)")]),
    "cluster_small_batch_routes": ("density routing at a small batch against TF's parameter "
                                   "servers and AR", [("tfpar HYBRID, density routing",
                                                       "TF parameter servers"),
                                                      ("tfpar HYBRID, density routing",
                                                       "tfpar AR")]),
    "sharded_rows_large_batch": (
        "sharded rows dealt out modulo N against rows in ranges, LM 2,048 words (a "
        "vocabulary sorted by frequency), 2 x 2, 100 Mbit/s",
        [("tfpar HYBRID, sparse sharded (all-to-all)",
          "tfpar HYBRID, sparse sharded, rows in ranges"),
         ("tfpar HYBRID, sparse sharded (all-to-all)", "tfpar HYBRID")]),
    "sharded_rows_auto": (
        "density routing after sharded rows went modulo N, LM 2,048 words, 2 x 2, 100 Mbit/s",
        [("tfpar HYBRID, density routing", "tfpar HYBRID, sparse sharded (all-to-all)")]),
    "balance_priced": (
        "density routing with each route priced on its busiest host link, LM 2,048 words, "
        "2 x 2, 100 Mbit/s (and 1 Gbit/s below it in the report)",
        [("tfpar HYBRID, density routing", "tfpar HYBRID, sparse sharded (all-to-all)"),
         ("tfpar HYBRID, density routing", "tfpar HYBRID")]),
    "balance_priced_small_batch": (
        "density routing with each route priced on its busiest host link, LM 128 words, "
        "2 x 2, 1 Gbit/s",
        [("tfpar HYBRID, density routing", "tfpar HYBRID, sparse by allgather"),
         ("tfpar HYBRID, density routing", "tfpar HYBRID, sparse sharded (all-to-all)")]),
    "ps_rows_modulo": (
        "the servers' parts dealt out modulo against row ranges (Config.ps_rows), LM 2,048 "
        "words, 2 x 2, 100 Mbit/s (and 1 Gbit/s below it in the report)",
        [("tfpar HYBRID", "tfpar HYBRID, the servers' parts in row ranges"),
         ("tfpar HYBRID, density routing", "tfpar HYBRID")]),
    "sharded_rows_small_batch": (
        "sharded rows dealt out modulo N against rows in ranges, LM 128 words, 2 x 2, 1 Gbit/s",
        [("tfpar HYBRID, sparse sharded, no local aggregation",
          "tfpar HYBRID, sparse sharded, no local aggregation, rows in ranges"),
         ("tfpar HYBRID, sparse sharded, no local aggregation, ids a step ahead", "tfpar AR")]),
}


def _step_ms(text: str, system: str):
    """The step time (ms) of `system`'s row in a report's table."""
    import re
    header = next((ln for ln in text.splitlines() if "step (ms)" in ln), None)
    if header is None:
        return None
    column = [c.strip() for c in header.strip("|").split("|")].index("step (ms)")
    for ln in text.splitlines():
        cells = [c.strip() for c in ln.strip("|").split("|")]
        if system in cells and len(cells) > column and re.match(r"^[\d.]+$", cells[column]):
            return float(cells[column])
    return None


def _entry(folder: str):
    """(title, headline, date, commit, command) of one experiment's report."""
    import re
    import subprocess
    reports = sorted(f for f in os.listdir(folder) if f.endswith(".md"))
    if not reports:
        return None
    with open(os.path.join(folder, reports[0])) as f:
        text = f.read()
    title = next((ln.lstrip("# ").strip() for ln in text.splitlines() if ln.startswith("#")),
                 reports[0])
    headline = next(iter(re.findall(r"\*\*([^*]+)\*\*", text)), "")
    name = os.path.basename(folder)
    if name in RATIOS:
        title, pairs = RATIOS[name]
        figures = []
        for mine, other in pairs:
            a, b = _step_ms(text, mine), _step_ms(text, other)
            if a is not None and b:
                figures.append(f"{a:g} ms against {other} {b:g} ms: {a / b:.2f}x")
        headline = "; ".join(figures) or headline
    date = next(iter(re.findall(r"\b20\d\d-\d\d-\d\d\b", text)), "")
    command = next(iter(re.findall(r"`((?:python|\.venv/bin/python)[^`]*)`", text)), "")
    # The commit that last changed the report itself (a move of the file does not count).
    commit = subprocess.run(["git", "log", "-1", "--follow", "--diff-filter=AM", "--format=%h",
                             "--", os.path.join(folder, reports[0])], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    return reports[0], title, headline, date, commit, command


def index() -> str:
    """docs/results/README.md: one row per current experiment, then the archive."""
    lines = ["# Results", "",
             "Generated by `python -m scripts.report` from the reports in each folder (one folder",
             "per experiment: its report, data and plot). Current results first; superseded runs",
             "are under [archive/](archive/). The narrative and history of the benchmarks:",
             "[benchmarks.md](benchmarks.md).", "",
             "| experiment | what | headline | date | commit | command |", "|---|---|---|---|---|---|"]
    archived = []
    for base, into in ((RESULTS, lines), (os.path.join(RESULTS, "archive"), archived)):
        for name in sorted(os.listdir(base)):
            folder = os.path.join(base, name)
            if not os.path.isdir(folder) or name == "archive":
                continue
            entry = _entry(folder)
            if entry is None:
                continue
            report, title, headline, date, commit, command = entry
            rel = os.path.relpath(os.path.join(folder, report), RESULTS)
            into.append(f"| [{name}]({rel}) | {title} | {headline} | {date} | {commit} | "
                        f"`{command}` |")
    if archived:
        lines += ["", "## Archive (superseded)", "",
                  "| experiment | what | headline | date | commit | command |",
                  "|---|---|---|---|---|---|"] + archived
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    with open(os.path.join(RESULTS, "README.md"), "w") as f:
        f.write(index())
    print(os.path.join(RESULTS, "README.md"))
