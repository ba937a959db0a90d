"""The README's table of field scripts: every script x mode (HYBRID, PS, AR, and HYBRID with
route "sharded") x TF2/TF1 x {2 workers, 2 x 2 on two hosts}, each equal to single-device training or a clear error (tests/support/field_scripts.py;
the suite runs the 2-worker cells in tests/jobs/test_field_scripts.py).

    .venv/bin/python -m scripts.field_table [--out docs/field_scripts.md]

Prints a markdown table (and writes it to --out); exits 1 if any cell is neither equal nor
the expected clear error. About 15 minutes on 2 cores.
"""
import argparse
import os
import tempfile
import time

from tests.jobs import test_field_scripts as table

LAYOUTS = {"2 workers": (2, None), "2 x 2": (4, table.TWO_HOSTS)}
# HYBRID with every sparse variable's rows sharded over the workers (all-to-all) beside
# the three modes.
MODES = (*table.MODES, "SHARDED")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    rows, bad, start = {}, 0, time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for tf1 in (False, True):
            for layout, (n, hosts) in LAYOUTS.items():
                ref = table.reference(os.path.join(tmp, f"ref_{tf1}_{n}"), n, tf1)
                for mode in MODES:
                    out = os.path.join(tmp, f"{mode}_{tf1}_{n}")
                    results = table.run_cells(out, n, tf1, mode, ref, hosts=hosts)
                    for script, outcome in results.items():
                        expected = table.EXPECTED_ERRORS.get((script, mode))
                        ok = outcome == "equal" if expected is None else expected in outcome
                        bad += not ok
                        cell = "equal" if outcome == "equal" else (
                            "clear error" if ok else "FAILED: " + outcome.splitlines()[0][:120])
                        rows.setdefault(script, {})[
                            f"{mode} {'TF1' if tf1 else 'TF2'} {layout}"] = cell
                    print(f"{mode} {'TF1' if tf1 else 'TF2'} {layout}: {results and {s: r[:60] for s, r in results.items()}}", flush=True)
    columns = list(next(iter(rows.values())))
    lines = ["| script | " + " | ".join(columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    lines += [f"| {s} | " + " | ".join(rows[s][c] for c in columns) + " |" for s in rows]
    text = "\n".join(lines) + f"\n\n{len(rows) * len(columns)} cells, {bad} failed, " \
        f"{time.time() - start:.0f} s\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
