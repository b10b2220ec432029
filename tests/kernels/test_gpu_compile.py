"""The compile gate: every CUDA kernel compiles with numba-cuda and assembles with ptxas for cc 8.0 and 9.0.

No GPU is needed (scripts/gpu_compile_check.py). The gate itself must fail
when a kernel spills or was never launched in the simulator, so both are
provoked here from the same recording of launches.
"""
import os
import pathlib
import pickle
import subprocess

import pytest

from tests.kernels.conftest import GATE, GATE_PYTHON


def run_gate(*args):
    if not os.path.exists(GATE_PYTHON):
        pytest.fail(f"{GATE_PYTHON} is missing: scripts/test.sh creates it (the gpu-compile extra in a venv)")
    done = subprocess.run([GATE_PYTHON, GATE, *args], capture_output=True, text=True, timeout=600)
    return done.returncode, done.stdout + done.stderr


@pytest.fixture(scope="module")
def gate_run(simulator_runs):
    # the launches recorded in numba's own simulator (conftest.py), which runs the checks several times
    # faster than numba-cuda's would in the gate's venv; the compiles are the gate's, started by conftest.py
    # as soon as the recording ends
    code, out, err = simulator_runs["record"].result()
    assert code == 0, f"the simulator checks failed, see test_kernel_cudasim.py\n{out[-2000:]}{err[-2000:]}"
    gate = simulator_runs["gate"]
    code, output = gate.result()
    if code is None:
        pytest.fail(output)
    return code, output, gate.launches, pathlib.Path(gate.table)


@pytest.mark.timeout(900)
def test_every_kernel_compiles_for_sm80_and_sm90_without_spills(gate_run):
    code, output, launches, table = gate_run
    assert code == 0, output
    with open(launches, "rb") as f:
        launched = pickle.load(f)
    rows = [line for line in table.read_text().splitlines() if line.startswith("| ") and "| cc |" not in line]
    signatures = sum(len(sigs) for sigs in launched.values())
    assert len(rows) == 2 * signatures  # one row per launch signature and capability
    assert {row.split(" | ")[1] for row in rows} == {"8.0", "9.0"}
    assert not any("ERROR" in row for row in rows)
    assert f"{2 * signatures} of {2 * signatures} compiles" in output


# The two provocations compile one kernel, not all 64 again: the gate's verdict on the rest is the test above's.
SPILLER = ("horovod_qsgd.kernels.select_device", "tile_scan_kernel")  # 64 registers uncapped


def only(launches, keys, path):
    """A launch record of ``launches`` with only the kernels ``keys``, written to ``path``."""
    with open(launches, "rb") as f:
        launched = pickle.load(f)
    with open(path, "wb") as f:
        pickle.dump({key: launched[key] for key in keys}, f)
    return str(path)


@pytest.mark.timeout(900)
def test_gate_fails_on_spills(gate_run, tmp_path):
    code, output, launches, _ = gate_run
    code, output = run_gate("--launches", only(launches, [SPILLER], tmp_path / "one.pkl"), "--table", "", "--cc",
                            "9.0", "--maxrregcount", "24")
    assert code == 1, output
    assert "bytes spilled to local memory" in output
    assert "select_device.tile_scan_kernel for cc 9.0" in output


@pytest.mark.timeout(900)
def test_gate_fails_on_a_kernel_the_simulator_never_launched(gate_run, tmp_path):
    code, output, launches, _ = gate_run
    code, output = run_gate("--launches", only(launches, [SPILLER], tmp_path / "partial.pkl"), "--table", "",
                            "--cc", "9.0")
    assert code == 1, output
    assert "FAIL horovod_qsgd.kernels.bytes.gather_kernel: never launched by the simulator checks" in output
    assert "1 of 1 compiles" in output  # the one kernel launched compiles
