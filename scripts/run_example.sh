#!/usr/bin/env bash
# Set up (or refresh) the environment, then train the MLP example on 2 local workers.
# Extra arguments go to the example, e.g. `bash scripts/run_example.sh --steps 1000`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export TF_CPP_MIN_LOG_LEVEL=2 PYTHONUNBUFFERED=1 PATH="$ROOT/.venv/bin:$PATH"
exec horovodrun -np 2 -H localhost:2 python examples/mlp.py "$@"
