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


def test_kernel_threads_setting_keeps_the_bytes_and_rejects_nonsense():
    import numba
    import numpy as np
    from horovod_qsgd import kernels
    from horovod_qsgd.codecs import QSGDCodec
    x = np.random.default_rng(3).standard_normal(300_000).astype(np.float32)
    codec = QSGDCodec(bits=4)
    payloads = []
    try:
        for threads in (1, numba.config.NUMBA_NUM_THREADS):
            kernels.set_cpu_threads(threads)
            assert kernels.cpu_threads() == threads
            out = np.zeros(codec.max_payload_nbytes(x.size), np.uint8)
            payloads.append(out[:codec.encode(x, out, step=5, key=9)].tobytes())
        kernels.set_cpu_threads(10 ** 6)
        assert kernels.cpu_threads() == numba.config.NUMBA_NUM_THREADS  # capped at the pool size
        with pytest.raises(ValueError, match="kernel threads must be >= 1"):
            kernels.set_cpu_threads(0)
    finally:
        kernels.set_cpu_threads(None)
    assert payloads[0] == payloads[1]
    assert not kernels.cpu_threads_chosen()


@pytest.mark.parametrize("order", ["serial,parallel", "parallel,serial"])
def test_cached_twins_keep_their_own_machine_code(order, tmp_path):
    """numba's disk cache keys a function by name, line and bytecode, not by
    ``parallel=True``: the two twins of a launcher once loaded each other's
    code, so "parallel" kernels ran on one thread.  Both cold and cached
    runs must give the serial twin one thread and the parallel twin two."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), NUMBA_NUM_THREADS="2")
    for attempt in ("compiles", "loads from the cache"):
        proc = subprocess.run([sys.executable, os.path.join(HERE, "twins_check.py"), order], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
        assert lines == {"serial": "[0]", "parallel": "[0, 1]"}, (attempt, proc.stdout)
    assert any(name.endswith(".nbi") for _, _, files in os.walk(tmp_path) for name in files), \
        "nothing was cached: the test did not exercise the cache"
