#!/usr/bin/env bash
# Set up (or refresh) the environment, then run the whole test suite with real processes.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k analysis`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export TF_CPP_MIN_LOG_LEVEL=2 PYTHONUNBUFFERED=1
exec "$ROOT/.venv/bin/python" -m pytest tests -v -rA --timeout=900 "$@"
