#!/usr/bin/env bash
# Create or refresh tfpar's virtual environment (.venv) with the pinned stack:
# Python 3.11, tensorflow-cpu 2.18.1, tf-keras 2.18.0, horovod 0.28.1 compiled with Gloo, numpy,
# protobuf, pytest.
#
# Horovod is source-only and links the TensorFlow it was compiled against, so the compiled
# wheel is cached under $TFPAR_CACHE keyed by the exact TF version; a fresh venv then
# installs it in seconds instead of recompiling (~2-3 min on 2 cores).
#
# Idempotent: a venv that already has the right versions is left as it is.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TFPAR_VENV:-$ROOT/.venv}"
PYTHON="${TFPAR_PYTHON:-python3.11}"
TF_PKG="${TFPAR_TF_PKG:-tensorflow-cpu}"
TF_VERSION="2.18.1"
HVD_VERSION="0.28.1"
TF_KERAS_VERSION="2.18.0"  # Keras 2 for TF 2.18 (tf-keras has no 2.18.1)
CACHE="${TFPAR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tfpar}"
PYTAG="$($PYTHON -c 'import sys;print("py%d%d"%sys.version_info[:2])')"
WHEELS="$CACHE/horovod-$HVD_VERSION-$TF_PKG-$TF_VERSION-$PYTAG-gpu_${HOROVOD_GPU_OPERATIONS:-none}"

log() { echo "[bootstrap] $*" >&2; }

if ! command -v "$PYTHON" >/dev/null; then
  echo "tfpar bootstrap: $PYTHON not found; install Python 3.11 or set TFPAR_PYTHON" >&2
  exit 1
fi
if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null; then
  log "installing cmake and g++ (needed to compile Horovod)"
  if command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq cmake g++ >/dev/null) || true
  fi
  command -v cmake >/dev/null || { echo "tfpar bootstrap: cmake is required to build Horovod" >&2; exit 1; }
fi

# The emulated cluster (tfpar/testing/emulate.py: network namespaces, tc, one sshd per host) used by
# tests/jobs/test_emulated_hosts.py and scripts/benchmark_cluster.py.
if ! command -v sshd >/dev/null && [ ! -x /usr/sbin/sshd ] || ! command -v tc >/dev/null \
    || ! command -v unshare >/dev/null; then
  log "installing openssh-server, iproute2 and util-linux (for the emulated cluster)"
  if command -v apt-get >/dev/null; then
    (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server iproute2 util-linux \
       >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
       apt-get install -y -qq openssh-server iproute2 util-linux >/dev/null)) || true
  fi
  [ -x /usr/sbin/sshd ] || { echo "tfpar bootstrap: OpenSSH's sshd is required (apt-get install openssh-server)" >&2; exit 1; }
fi

[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
PY="$VENV/bin/python"

have() { "$PY" - "$@" <<'PYEOF' 2>/dev/null
import sys, importlib.metadata as md
for spec in sys.argv[1:]:
    name, ver = spec.split("==")
    if md.version(name) != ver:
        sys.exit(1)
PYEOF
}

if ! have "$TF_PKG==$TF_VERSION" numpy==2.0.2 protobuf==5.29.6 pytest==9.0.1 pytest-timeout==2.3.1 pytest-xdist==3.8.0 psutil==6.1.0 \
     matplotlib==3.9.4 "tf-keras==$TF_KERAS_VERSION"; then
  log "installing TensorFlow $TF_VERSION and test tools"
  "$PY" -m pip install -q --upgrade pip setuptools wheel packaging
  "$PY" -m pip install -q "$TF_PKG==$TF_VERSION" numpy==2.0.2 protobuf==5.29.6 \
      pytest==9.0.1 pytest-timeout==2.3.1 pytest-xdist==3.8.0 psutil==6.1.0 matplotlib==3.9.4
  # Keras 2 for TF1-style scripts: tf.compat.v1.layers and tf.compat.v1.nn.rnn_cell need it
  # on TF >= 2.16 (tfpar selects it on import; see tfpar/__init__.py).
  "$PY" -m pip install -q --no-deps "tf-keras==$TF_KERAS_VERSION"
fi

# Horovod imports with this TensorFlow and has Gloo (one import; `horovodrun --check-build`
# imports TensorFlow once per framework and feature, ~10 s).
gloo_ok() { "$PY" -c "import horovod.tensorflow as h; assert h.gloo_built()" 2>/dev/null; }
installed_horovod=0
if ! have "horovod==$HVD_VERSION" || ! gloo_ok; then
  installed_horovod=1
  mkdir -p "$WHEELS"
  if ! ls "$WHEELS"/horovod-*.whl >/dev/null 2>&1; then
    log "compiling Horovod $HVD_VERSION against TF $TF_VERSION (Gloo${HOROVOD_GPU_OPERATIONS:+, $HOROVOD_GPU_OPERATIONS}); cached in $WHEELS"
    HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
    HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
      "$PY" -m pip wheel -q --no-cache-dir --no-build-isolation --no-deps \
        -w "$WHEELS" "horovod==$HVD_VERSION"
  fi
  log "installing cached Horovod wheel"
  "$PY" -m pip install -q --no-cache-dir "$WHEELS"/horovod-*.whl
fi

# tfpar itself, editable; not again when this checkout's is in place (a reinstall while
# other processes start would briefly leave them without it).
if [ "$(cd / && "$PY" -c 'import importlib.util as u; s = u.find_spec("tfpar"); print(s.origin if s else "")' 2>/dev/null)" \
     != "$ROOT/tfpar/__init__.py" ]; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT" >/dev/null
fi
if [ "$installed_horovod" = 1 ] && ! gloo_ok; then
  # Read the whole report before matching: `| grep -q` closes the pipe at the first match,
  # horovodrun dies of the broken pipe, and pipefail turns that into a failure.
  build_report="$("$VENV/bin/horovodrun" --check-build 2>&1)" || true
  echo "tfpar bootstrap: Horovod does not import with Gloo:" >&2; echo "$build_report" >&2
  exit 1
fi
log "ready: $VENV (TF $TF_VERSION, Horovod $HVD_VERSION with Gloo)"
