#!/usr/bin/env bash
# Every GPU check and measurement of this project in one call, for a lent GPU machine (no Horovod, no
# TensorFlow, no network: PyTorch's CUDA build, numba and numba-cuda as installed there).
#
#     OUT=/some/folder bash scripts/gpu_session.sh
#
# Writes each step's log (and gpu_benchmark*.json) to $OUT. Steps in order of what matters most, each
# under its own time limit so that one that hangs leaves the others their time; the numba cache starts
# empty, so the first benchmark's first calls include compilation and the second's show the disk cache.
set -u
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/horovod-qsgd-numba-cache
rm -rf "$NUMBA_CACHE_DIR"
PY=${PYTHON:-python3}
# numba-cuda 0.30.4 does not import under numpy 2.5 (np.row_stack is gone): wheels carried in .whl/ (numpy 2.4)
# go first on the path
if ls .whl/*.whl > /dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

# a subset reruns some; the limits add up to about 10 minutes, one device call's most
STEPS=${STEPS:-gpu_benchmark gpu_step_cost cuda_check ddp_2ranks gpu_benchmark_cached ddp_2x2nodes}

step() {  # step NAME SECONDS COMMAND...: run it, log to $OUT/NAME.log, say how it ended and how long it took
    local name=$1 limit=$2; shift 2
    [[ " $STEPS " == *" $name "* ]] || return 0
    local start=$SECONDS
    echo "=== $name: $*"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    grep -v 'NumbaPerformanceWarning\|warn(errors\|^\[W\|^W[0-9]\|^\*\*\*\*\|Setting OMP_NUM_THREADS\|^ *warnings.warn' "$OUT/$name.log" | tail -n 40
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
    $PY -c 'import sys, torch, numpy, numba, numba.cuda as c; print(sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "numpy", numpy.__version__, "numba", numba.__version__, "numba.cuda", c.implementation)'
    $PY -m pip list 2>/dev/null | grep -iE '^(numba|numba-cuda|cuda-|nvidia-cuda-nvcc|nvidia-cuda-nvrtc|llvmlite)'
} > "$OUT/machine.log" 2>&1
cat "$OUT/machine.log"

step gpu_benchmark 150 $PY benchmarks/gpu_benchmark.py --profile --host-profile --out "$OUT/gpu_benchmark.json"
# issue #51's budget: the codecs' wall time per step for ResNet-50's and GPT-2 small's gradients
step gpu_step_cost 110 $PY benchmarks/gpu_step_cost.py --reps 10 --out "$OUT/gpu_step_cost.json"
step cuda_check 150 $PY scripts/cuda_check.py
step ddp_2ranks 80 torchrun --nproc_per_node 2 --master_port 29510 scripts/gpu_ddp_check.py
step gpu_benchmark_cached 40 $PY benchmarks/gpu_benchmark.py --reps 10 --out "$OUT/gpu_benchmark_cached.json"
node() {
    torchrun --nnodes 2 --node_rank "$1" --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29511 \
        scripts/gpu_ddp_check.py
}
step ddp_2x2nodes 80 bash -c "$(declare -f node); node 1 > /tmp/ddp_node1.log 2>&1 & node 0; rc=\$?; wait \$! || rc=1; exit \$rc"
if [[ -f /tmp/ddp_node1.log ]]; then  # the second node's ranks, into the same log
    grep -h "^rank" /tmp/ddp_node1.log | tee -a "$OUT/ddp_2x2nodes.log"
fi
