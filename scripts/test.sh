#!/usr/bin/env bash
# Sets up what is missing (scripts/setup.sh), then runs the whole test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh tests/kernels -x
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
bash scripts/setup.sh
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
exec "$PYTHON" -m pytest "$@"
