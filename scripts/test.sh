#!/usr/bin/env bash
# Set up (or refresh) the environment, then run the whole test suite with real processes:
# first the fast unit tests, then the multi-process jobs (tests marked `job`).
# Extra arguments go to both pytest runs, e.g. `bash scripts/test.sh -k analysis`.
set -euo pipefail
START=$SECONDS
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export TF_CPP_MIN_LOG_LEVEL=2 PYTHONUNBUFFERED=1
status=0
# The unit tests run in two processes (pytest-xdist). The jobs too, a module at a time in
# each (tests/jobs/conftest.py groups them): a job's processes take both cores when they
# compute, but every job also waits (start-up, rendezvous, timeouts, shaped links), about
# 15% of the suite's time, which the other process's jobs fill.
for selection in "not job" "job"; do
  echo "== tests: -m '$selection'"
  parallel=(-n 2)
  [ "$selection" = "job" ] && parallel=(-n 2 --dist loadgroup)
  "$ROOT/.venv/bin/python" -m pytest tests -m "$selection" "${parallel[@]}" -v -rA \
      --timeout=900 --durations=20 "$@" || {
    rc=$?
    # 5: nothing selected (e.g. -k matched only one kind); not a failure
    [ "$rc" -eq 5 ] || status=$rc
  }
done
echo "== suite time: $(( (SECONDS - START) / 60 )) min $(( (SECONDS - START) % 60 )) s" \
  "(set-up included; exit status $status)"
exit "$status"
