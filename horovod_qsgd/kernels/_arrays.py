"""Scratch arrays and views on the array's device, for the host-side drivers of the kernels."""
import numpy as np

from ._dual import as_device, cuda_kernel, current_allocator, current_stream


def cuda_module():
    from numba import cuda
    return cuda


def device_view(a):
    """numba device array for a CUDA array-interface object (zero copy)."""
    return None if a is None else as_device(a)


def empty(shape, dtype, gpu):
    """Uninitialised scratch: numpy, or device memory from the current allocator (see ``launch_stream``)."""
    if not gpu:
        return np.empty(shape, dtype)
    allocate = current_allocator()
    if allocate is None:
        return cuda_module().device_array(shape, dtype, stream=current_stream())
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    raw = as_device(allocate(max(count, 1) * dtype.itemsize))  # views keep the allocator's object alive
    return raw[:max(count, 1) * dtype.itemsize].view(dtype)[:count].reshape(shape)


@cuda_kernel
def _zero_kernel(flat):
    i = cuda.grid(1)  # noqa: F821
    if i < flat.size:
        flat[i] = 0


def clear(a):
    """Zeroes a contiguous device array with a kernel (a copy of host zeros would wait for the GPU)."""
    if a.size:
        _zero_kernel[a.size](a.reshape(a.size))


def zeros(shape, dtype, gpu):
    """Zeroed scratch array (on a device: zeroed by a kernel)."""
    if not gpu:
        return np.zeros(shape, dtype)
    a = empty(shape, dtype, True)
    clear(a)
    return a


def device_empty(shape, dtype):
    """Uninitialised device array, allocated for the current stream."""
    return empty(shape, dtype, True)


def host_copy(a):
    """Host copy of a device array, after the current stream's work on it."""
    return to_host(a, True)


def to_host(a, gpu):
    """A host copy of a device array (waits for the stream), or the numpy array itself."""
    if not gpu:
        return a
    stream = current_stream()
    host = a.copy_to_host(stream=stream)
    if stream:
        stream.synchronize()  # a copy on a stream is asynchronous: the host must not read before it lands
    return host


def to_device(host):
    """A new device array holding a copy of a numpy array, made on the current stream."""
    host = np.ascontiguousarray(host)
    a = empty(host.shape, host.dtype, True)
    copy_to(a, host)
    return a


def copy_to(dst, host):
    """Copies a numpy (or device) array into the device array ``dst`` on the current stream."""
    dst.copy_to_device(host, stream=current_stream())


def float_bits(a):
    return a.view(np.uint32)
