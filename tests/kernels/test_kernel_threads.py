"""Concurrent encode/decode from several Python threads (TensorFlow runs ops
concurrently; torch calls hooks from autograd threads)."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(layer):
    env = dict(os.environ)
    env.pop("NUMBA_THREADING_LAYER", None)
    if layer:
        env["NUMBA_THREADING_LAYER"] = layer
    return subprocess.run([sys.executable, os.path.join(HERE, "threads_check.py")], env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("layer", [None, "workqueue"])
def test_four_threads_match_single_threaded(layer):
    proc = _run(layer)
    print(proc.stdout, proc.stderr[-2000:])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "OK:" in proc.stdout
    if layer:
        assert f"threading layer: {layer}" in proc.stdout


def test_in_process_threads_match():
    """The same check in this process, whatever layer it ended up with."""
    sys.path.insert(0, HERE)
    try:
        import threads_check
    finally:
        sys.path.remove(HERE)
    assert threads_check.main() == 0
