"""Scratch arrays and views on the array's device, for the host-side drivers of the kernels."""
import collections
import ctypes
import threading

import numpy as np

from ._dual import _simulated, as_device, cuda_kernel, current_allocator, current_stream, on_cuda
from .select import ADD_PREVIOUS, IN_PLACE, TAKE_TARGET, committed


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


def pointer(a):
    """The device address of a CUDA array's first element."""
    if _simulated() and not hasattr(a, "__cuda_array_interface__"):
        return int(a.ctypes.data)  # a simulated device array is a numpy array underneath
    return int(a.__cuda_array_interface__["data"][0])


def span(arrays, dtype, align=1):
    """(one device array of ``dtype`` over the memory from the lowest of ``arrays`` to the end of the highest,
    each array's offset in it in elements), or None where an array does not start at a whole element (or at a
    multiple of ``align`` bytes) from the lowest, or that one does not.

    The arrays may be separate allocations: the span also covers what lies between them, which a kernel given
    it must not touch (the grouped kernels index only inside the arrays). It holds no reference to them: the
    caller keeps them alive while it is in use.
    """
    arrays = [device_view(a) for a in arrays]
    itemsize = np.dtype(dtype).itemsize
    starts = [pointer(a) for a in arrays]
    low = min(starts)
    high = max(start + a.size * np.dtype(a.dtype).itemsize for start, a in zip(starts, arrays))
    unit = max(itemsize, align)
    if low % unit or any((start - low) % unit for start in starts):
        return None
    count = (high - low) // itemsize
    offsets = [(start - low) // itemsize for start in starts]
    if _simulated():
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        raw = np.ctypeslib.as_array((ctypes.c_uint8 * (count * itemsize)).from_address(low))
        return FakeCUDAArray(raw.view(dtype)), offsets
    interface = {"shape": (count,), "strides": None, "typestr": np.dtype(dtype).str, "data": (low, False),
                 "version": 3, "stream": None}
    return cuda_module().from_cuda_array_interface(interface, owner=None, sync=False), offsets


_TABLES = collections.OrderedDict()  # (stream, dtype, shape, bytes) -> device copy, least recently used first
_TABLES_KEPT = 256
_TABLES_LOCK = threading.Lock()  # the adapters encode from several threads (autograd's, TensorFlow's ops)


def _stream_key(stream):
    """What identifies a stream across the wrappers made of it (the adapters wrap PyTorch's anew per call)."""
    if not stream:
        return 0
    handle = getattr(stream, "handle", None)
    value = getattr(handle, "value", handle)
    try:
        return int(value)
    except (TypeError, ValueError):
        return id(stream)


def to_device_cached(host):
    """A device copy of a small host table, made once per content and stream and then reused: the grouped
    kernels' layouts repeat from step to step, and a host copy per step would wait for the GPU."""
    host = np.ascontiguousarray(host)
    stream = current_stream()
    key = (_stream_key(stream), host.dtype.str, host.shape, host.tobytes())
    with _TABLES_LOCK:
        table = _TABLES.get(key)
        if table is not None:
            _TABLES.move_to_end(key)
            return table
    table = to_device(host)
    with _TABLES_LOCK:
        _TABLES[key] = table
        if len(_TABLES) > _TABLES_KEPT:
            _TABLES.popitem(last=False)
    return table


def float_bits(a):
    return a.view(np.uint32)


class CarriedResidual:
    """An error-feedback residual whose new value goes to ``target`` while the residual a step adds is read from
    ``previous``, which the step leaves as it was: a step whose result does not count (inf or NaN) then leaves
    nothing behind, without a copy. Taken wherever the kernels and codecs take an updated-in-place residual, and
    sliced like one.

    ``commit`` (None, or int64 [2] on the arrays' device): where it says that the last step, stamped
    ``stamp``, counted, that step's residual is ``target``'s own content, which the step moves into
    ``previous`` as it reads it (:func:`horovod_qsgd.kernels.select.committed`). A GPU decides this on the
    device, with no host read; the CPU reads it.
    """
    __slots__ = ("target", "previous", "commit", "stamp")

    def __init__(self, target, previous, commit=None, stamp=0):
        self.target, self.previous, self.commit, self.stamp = target, previous, commit, stamp

    @property
    def size(self):
        return self.target.size

    def __getitem__(self, span):
        return CarriedResidual(self.target[span], self.previous[span], self.commit, self.stamp)

    def checked(self, check):
        """A copy with ``check`` (a function of an array and its name, returning it validated) applied to both."""
        return CarriedResidual(check(self.target, "residual"), check(self.previous, "previous residual"),
                               self.commit, self.stamp)


def split_residual(residual):
    """(the array a kernel writes acc and the new residual into, what the error-feedback kernels take besides
    it) for an array updated in place or a :class:`CarriedResidual`, on the arrays' device.

    What they take: on the CPU, (the array of the residual to add, where the first pass finds it: one of
    :mod:`.select`'s ``ADD_PREVIOUS``, ``TAKE_TARGET``, ``IN_PLACE``, decided here); on a device, (that array,
    the commit stamps, the stamp), decided by each kernel.
    """
    if not isinstance(residual, CarriedResidual):
        gpu = on_cuda(residual)
        return (device_view(residual), (device_view(residual), empty(0, np.int64, True), np.int64(0))) if gpu \
            else (residual, (residual, IN_PLACE))
    target, previous, commit, stamp = residual.target, residual.previous, residual.commit, residual.stamp
    if not on_cuda(target, previous, commit):
        take = commit is not None and committed(commit, np.int64(stamp))
        return target, (previous, TAKE_TARGET if take else ADD_PREVIOUS)
    commit = empty(0, np.int64, True) if commit is None else device_view(commit)
    return device_view(target), (device_view(previous), commit, np.int64(stamp))
