#!/usr/bin/env bash
# Sets up what is missing (scripts/setup.sh), then runs the whole test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh tests/kernels -x
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
bash scripts/setup.sh
# The tests also compile every CUDA kernel for named GPUs (no GPU needed) with numba-cuda and ptxas, from a
# venv of their own: numba-cuda replaces numba.cuda wherever it is installed, and its simulator runs our
# simulator tests 7x slower than numba's own (transfers_check.py: 659 s against 86 s).
GPU_COMPILE_PYTHON=.venv-gpu-compile/bin/python
if ! "$GPU_COMPILE_PYTHON" -c 'import numba_cuda; from cuda.pathfinder import find_nvidia_binary_utility as f
assert f("ptxas")' 2>/dev/null; then
  echo "[test] creating .venv-gpu-compile: the gpu-compile extra (numba-cuda, NVVM, ptxas; about 700 MB)"
  "$PYTHON" -m venv --system-site-packages .venv-gpu-compile
  "$GPU_COMPILE_PYTHON" -m pip install -q -e ".[gpu-compile]"
fi
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
exec "$PYTHON" -m pytest "$@"
