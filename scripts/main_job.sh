#!/usr/bin/env bash
# Sets up what is missing (scripts/setup.sh), then compares compressors under
# horovodrun -np 2 on a 1 Gbit/s shaped network namespace and prints the table.
# Extra arguments go to benchmarks/compare.py (e.g. --rates 100mbit,1gbit,none).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
bash scripts/setup.sh
if [ $# -eq 0 ]; then set -- --quick; fi
exec "$PYTHON" benchmarks/compare.py "$@"
