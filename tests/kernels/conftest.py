"""The two CUDA-simulator runs that the kernel tests read, and the compile gate that follows the first, all
started in the background as soon as the session has collected a test that reads them.

Each simulator run is one single-threaded Python process of several minutes
(``scripts/gpu_compile_check.py --record``: ``scripts/cuda_check.py`` and the
lattice check with every launch recorded; ``transfers_check.py``); the gate
(``scripts/gpu_compile_check.py --launches`` in ``.venv-gpu-compile``)
compiles the recorded launches once the first ends. Started at collection,
they run beside the rest of the session (multi-rank tests whose ranks spend
much of their time starting and waiting): the modules that read them run
last, so the session does not stand idle waiting for a run that has only
one core's work left. ``test_kernel_cudasim.py`` reads the first run's
verdict, ``test_gpu_compile.py`` the gate's, and ``test_host_transfers.py``
the second run's.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RECORD = [os.path.join(ROOT, "scripts", "gpu_compile_check.py"), "--record"]
TRANSFERS = [os.path.join(HERE, "transfers_check.py")]
GATE = os.path.join(ROOT, "scripts", "gpu_compile_check.py")
# numba-cuda and ptxas live in a venv of their own (scripts/test.sh makes it): installed beside the
# other tests, numba-cuda's simulator would run every simulator test several times slower
GATE_PYTHON = os.path.join(ROOT, ".venv-gpu-compile", "bin", "python")
TIMEOUT = 1500
READERS = ("simulator_runs", "gate_run", "report")  # the fixtures that read the runs


class SimulatorRun:
    """A script in numba's own CUDA simulator (the test environment's numba, not numba-cuda's slower one)."""

    def __init__(self, args):
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
        self.process = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
        self._result = None
        self._lock = threading.Lock()

    def result(self):
        """(exit code, stdout, stderr), once the run ends."""
        with self._lock:
            if self._result is None:
                try:
                    out, err = self.process.communicate(timeout=TIMEOUT)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    out, err = self.process.communicate()
                    err += f"\n(killed after {TIMEOUT} s)"
                self._result = (self.process.returncode, out, err)
            return self._result

    def kill(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


class GateRun:
    """The compile gate on the launches the record run saved, started by a thread once that run ends."""

    def __init__(self, record, launches, table):
        self.record, self.launches, self.table = record, launches, table
        self.process, self._result, self._stopped = None, None, False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        code, _, _ = self.record.result()
        if code != 0 or self._stopped:
            self._result = (None, "the simulator checks failed, see test_kernel_cudasim.py")
            return
        if not os.path.exists(GATE_PYTHON):
            self._result = (None, f"{GATE_PYTHON} is missing: scripts/test.sh creates it (the gpu-compile extra "
                                  "in a venv)")
            return
        self.process = subprocess.Popen([GATE_PYTHON, GATE, "--launches", str(self.launches), "--table",
                                         str(self.table)], cwd=ROOT, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
        try:
            output, _ = self.process.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            output = self.process.communicate()[0] + f"\n(killed after {TIMEOUT} s)"
        self._result = (self.process.returncode, output)

    def result(self):
        """(exit code, output), once the gate ends; code None where it could not start (the output says why)."""
        self._thread.join()
        return self._result

    def kill(self):
        self._stopped = True
        if self.process is not None and self.process.poll() is None:
            self.process.kill()


class Runs(dict):
    def __init__(self):
        super().__init__()
        self.directory = tempfile.mkdtemp(prefix="hq-simulator-")
        launches = os.path.join(self.directory, "launches.pkl")
        self["record"] = SimulatorRun([*RECORD, launches])
        self["record"].launches = launches
        self["transfers"] = SimulatorRun(TRANSFERS)
        self["gate"] = GateRun(self["record"], launches, os.path.join(self.directory, "table.md"))

    def stop(self):
        for run in self.values():
            run.kill()
        shutil.rmtree(self.directory, ignore_errors=True)


_RUNS = []


def _runs():
    if not _RUNS:
        _RUNS.append(Runs())
    return _RUNS[0]


def _reads_a_run(item):
    return bool(set(getattr(item, "fixturenames", ())) & set(READERS))


def pytest_collection_modifyitems(session, config, items):
    """The modules that read the background runs go last, whole (their module fixtures set up once)."""
    readers = {item.module for item in items if _reads_a_run(item)}
    items[:] = ([item for item in items if item.module not in readers]
                + [item for item in items if item.module in readers])


def pytest_collection_finish(session):
    if any(_reads_a_run(item) for item in session.items):
        _runs()


def pytest_sessionfinish(session, exitstatus):
    if _RUNS:
        _RUNS.pop().stop()


@pytest.fixture(scope="session")
def simulator_runs():
    return _runs()
