"""The two CUDA-simulator runs that the kernel tests read, started together.

Each is one single-threaded Python process of one to two minutes
(``scripts/gpu_compile_check.py --record``: ``scripts/cuda_check.py`` and the
lattice check with every launch recorded; ``transfers_check.py``): started
side by side on the first test that needs either, they take the time of the
longer one. ``test_kernel_cudasim.py`` reads the first one's verdict,
``test_gpu_compile.py`` compiles its recorded launches, and
``test_host_transfers.py`` reads the second.
"""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RECORD = [os.path.join(ROOT, "scripts", "gpu_compile_check.py"), "--record"]
TRANSFERS = [os.path.join(HERE, "transfers_check.py")]
TIMEOUT = 900


class SimulatorRun:
    """A script in numba's own CUDA simulator (the test environment's numba, not numba-cuda's slower one)."""

    def __init__(self, args):
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
        self.process = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
        self._result = None

    def result(self):
        """(exit code, stdout, stderr), once the run ends."""
        if self._result is None:
            try:
                out, err = self.process.communicate(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                out, err = self.process.communicate()
                err += f"\n(killed after {TIMEOUT} s)"
            self._result = (self.process.returncode, out, err)
        return self._result


@pytest.fixture(scope="session")
def simulator_runs(tmp_path_factory):
    launches = tmp_path_factory.mktemp("simulator") / "launches.pkl"
    runs = {"record": SimulatorRun([*RECORD, str(launches)]), "transfers": SimulatorRun(TRANSFERS)}
    runs["record"].launches = launches
    yield runs
    for run in runs.values():
        if run.process.poll() is None:
            run.process.kill()
            run.process.communicate()
