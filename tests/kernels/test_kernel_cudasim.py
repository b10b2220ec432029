"""CUDA code paths in numba's CUDA simulator give the CPU's bytes."""

import os

CUDA_CHECK = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "scripts", "cuda_check.py")


def test_cuda_paths_in_simulator_match_cpu_and_vectors(simulator_runs):
    # cuda_check.py and the lattice check, run in the simulator by the compile gate's recording (conftest.py)
    code, out, err = simulator_runs["record"].result()
    print(out[-3000:], err[-3000:])
    assert code == 0, out[-3000:] + err[-3000:]
    assert "CUDA-simulator checks bit-identical to the CPU path and the test vectors" in out
    assert "OK: lattice codec CUDA simulator == CPU" in out


def test_only_the_bits_of_nans_may_differ():
    """cuda_check's comparison forgives what GPUs do to NaNs (0x7fffffff for NaN + x and inf - inf, where x86
    keeps the operand's bits or makes 0xffc00000), in float32 words and float16 payload values, and nothing
    else: a value against a NaN, or a NaN's neighbour, still differs."""
    import importlib.util

    import numpy as np
    spec = importlib.util.spec_from_file_location("cuda_check", CUDA_CHECK)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    cpu = np.array([1.5, np.nan, -np.inf, 3.0], np.float32)
    gpu = cpu.copy()
    gpu.view(np.uint32)[1] = 0x7FFFFFFF
    assert check.same(cpu, cpu) is True
    assert check.same(cpu, gpu) == check.NAN_BITS
    other = gpu.copy()
    other[3] = 3.25
    assert check.same(cpu, other) is False
    number = cpu.copy()
    number[1] = 0.0
    assert check.same(cpu, number) is False
    half = np.concatenate([np.zeros(16, np.uint8), np.array([1, np.nan, np.inf], np.float16).view(np.uint8)])
    gpu_half = half.copy()
    gpu_half[16 + 3] ^= 0x01  # the float16 NaN's high byte: 0x7e -> 0x7f, still NaN
    assert check.same(half, gpu_half) == check.NAN_BITS
    gpu_half[16 + 5] ^= 0x01  # the inf's high byte: 0x7c -> 0x7d, a NaN where the CPU has inf
    assert check.same(half, gpu_half) is False
    assert check.same(cpu, cpu[:3]) is False
