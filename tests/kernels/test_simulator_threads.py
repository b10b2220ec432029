"""numba's CUDA simulator, as our kernels' test runs use it, keeps a block's threads on one shared array and on
the launch's ``cuda`` module, and a thread's first warning leaves a kernel's globals as they were under a thread
entering it (kernels/_simulator.py): without that, CI's simulator checks failed or mismatched the CPU at random."""

import json
import os
import subprocess
import sys

CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "simulator_threads_check.py")


def test_threads_released_together_share_one_array_and_the_launch_module():
    done = subprocess.run([sys.executable, CHECK], env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    failures = json.loads(done.stdout.splitlines()[-1])
    assert failures == {"failed_scans": 0, "failed_staggered": 0, "failed_first_warnings": 0, "split_shared_arrays": 0}
