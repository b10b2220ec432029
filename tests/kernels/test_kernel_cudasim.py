"""CUDA code paths in numba's CUDA simulator give the CPU's bytes."""

import os
import subprocess
import sys

CUDA_CHECK = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "scripts", "cuda_check.py")


def test_cuda_paths_in_simulator_match_cpu_and_vectors():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run([sys.executable, CUDA_CHECK], env=env,
                          capture_output=True, text=True, timeout=1100)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK:" in proc.stdout
