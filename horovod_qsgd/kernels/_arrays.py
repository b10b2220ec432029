"""Scratch arrays and views on the array's device, for the host-side drivers of the kernels."""
import numpy as np

from ._dual import as_device, cuda_kernel


def cuda_module():
    from numba import cuda
    return cuda


def device_view(a):
    """numba device array for a CUDA array-interface object (zero copy)."""
    return None if a is None else as_device(a)


def empty(shape, dtype, gpu):
    return cuda_module().device_array(shape, dtype) if gpu else np.empty(shape, dtype)


@cuda_kernel
def _zero_kernel(flat):
    i = cuda.grid(1)  # noqa: F821
    if i < flat.size:
        flat[i] = 0


def zeros(shape, dtype, gpu):
    """Zeroed scratch array; on a device zeroed by a kernel (a copy of host zeros would wait for the GPU)."""
    if not gpu:
        return np.zeros(shape, dtype)
    a = empty(shape, dtype, True)
    if a.size:
        _zero_kernel[a.size](a.reshape(a.size))
    return a


def to_host(a, gpu):
    return a.copy_to_host() if gpu else a


def float_bits(a):
    return a.view(np.uint32)
