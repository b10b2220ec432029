#!/usr/bin/env bash
# Installs whatever is missing for horovod_qsgd into the current Python environment:
# PyTorch 2.13.0 (CPU), TensorFlow 2.21 with tf-keras, numba and the test tools (Lightning and
# Accelerate among them), then
# Horovod 0.28.1 built from source (about 12 minutes the first time, seconds after),
# then this package in editable mode. Safe to run again: finished steps are skipped.
#
# PYTHON=/path/to/python picks the interpreter (default: python3 on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
say() { echo "[setup] $*"; }

if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  say "installing iproute2 (ip, tc) for the network-namespace byte counts"
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq iproute2 >/dev/null
  else
    say "warning: no ip/tc and cannot apt-get; byte-count tests will be skipped"
  fi
fi

# torch is pinned exactly: any looser spec lets pip pick a multi-GB CUDA build.
if ! "$PYTHON" - <<'PY' 2>/dev/null
import importlib.metadata as md
need = {"torch": "2.13.0", "tensorflow-cpu": "2.21.0", "tf-keras": "2.21.0"}
for name, version in need.items():
    assert md.version(name).split("+")[0] == version, name
import numba, pytest, pytest_timeout, scipy, sklearn, matplotlib, horovod_qsgd  # noqa: F401
assert md.version("lightning") == "2.6.6" and md.version("accelerate") == "1.15.0"
PY
then
  say "installing PyTorch 2.13.0 (CPU), TensorFlow 2.21, tf-keras, numba, test tools and horovod_qsgd"
  "$PYTHON" -m pip install -q -e ".[torch,tensorflow,test,bench]"
else
  say "frameworks and horovod_qsgd already installed"
fi

"$PYTHON" scripts/build_horovod.py

# pyenv's shims learn of new console scripts (horovodrun) only on 'pyenv rehash'.
if ! command -v horovodrun >/dev/null && command -v pyenv >/dev/null; then
  pyenv rehash || true
fi
if ! command -v horovodrun >/dev/null; then
  scripts_dir=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
  say "horovodrun is installed in $scripts_dir, which is not on PATH: run"
  say "  export PATH=\"$scripts_dir:\$PATH\""
  say "or call it as: $PYTHON -m horovod.runner.launch -np 2 -H localhost:2 --gloo ..."
fi
say "ready"
