#!/usr/bin/env bash
# The suite's long matrix in full (the suite runs a cross-section of it): every mode x TF
# behaviour of the field scripts on 2 workers. About 5 minutes on 2 cores. `python -m scripts.field_table` runs the whole
# field-script table (2 x 2 included).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export TF_CPP_MIN_LOG_LEVEL=2 PYTHONUNBUFFERED=1 TFPAR_LONG_TESTS=1
exec "$ROOT/.venv/bin/python" -m pytest tests/jobs/test_field_scripts.py -m job -v -rA --timeout=900 "$@"
