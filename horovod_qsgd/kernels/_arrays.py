"""Scratch arrays and views on the array's device, for the host-side drivers of the kernels."""
import numpy as np

from ._dual import as_device


def cuda_module():
    from numba import cuda
    return cuda


def device_view(a):
    """numba device array for a CUDA array-interface object (zero copy)."""
    return None if a is None else as_device(a)


def empty(shape, dtype, gpu):
    return cuda_module().device_array(shape, dtype) if gpu else np.empty(shape, dtype)


def zeros(shape, dtype, gpu):
    return cuda_module().to_device(np.zeros(shape, dtype)) if gpu else np.zeros(shape, dtype)


def to_host(a, gpu):
    return a.copy_to_host() if gpu else a


def float_bits(a):
    return a.view(np.uint32)
