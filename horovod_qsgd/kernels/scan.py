"""Prefix sums on a GPU without a trip through the host.

:func:`block_exclusive_scan` is the block-wide building block of the
selection kernels (:mod:`.select_device`); :func:`inclusive_sums` turns a
few thousand per-bucket sizes into cumulative ends with one block, where a
host ``cumsum`` would cost a copy each way.
"""

import numba
import numpy as np

from ._arrays import to_host
from ._dual import cuda_kernel, gpu_only, on_cuda

__all__ = ["B", "block_exclusive_scan", "inclusive_sums"]

# numba's simulator runs every GPU thread as a Python thread, and its barriers cost more than the
# work: there blocks have 64 threads (the kernels are written for any block size)
_SIMULATED = bool(numba.config.ENABLE_CUDASIM)
B = 64 if _SIMULATED else 256  # threads per block of the block-level kernels


@gpu_only
def block_exclusive_scan(buf, t, v):
    """(sum of ``v`` over the block's threads before ``t``, sum over all); ``buf``: shared int64[B]."""
    buf[t] = v
    cuda.syncthreads()  # noqa: F821
    off = 1
    while off < B:
        add = buf[t - off] if t >= off else 0
        cuda.syncthreads()  # noqa: F821
        buf[t] += add
        cuda.syncthreads()  # noqa: F821
        off *= 2
    inclusive = buf[t]
    total = buf[B - 1]
    cuda.syncthreads()  # noqa: F821 (buf may be reused at once)
    return inclusive - v, total


@cuda_kernel
def inclusive_sums_kernel(values, out):
    """One block: out[j] = values[0] + ... + values[j]; thread t sums a contiguous segment."""
    buf = cuda.shared.array(B, numba.int64)  # noqa: F821
    t = cuda.threadIdx.x  # noqa: F821
    n = values.size
    per = (n + B - 1) // B
    lo = min(n, t * per)
    hi = min(n, lo + per)
    s = 0
    for j in range(lo, hi):
        s += values[j]
    acc, _ = block_exclusive_scan(buf, t, s)
    for j in range(lo, hi):
        acc += values[j]
        out[j] = acc


def inclusive_sums(values, out):
    """out = cumulative sums of int64 ``values`` (on their device); returns the total, read from the device."""
    if values.size == 0:
        return 0
    if not on_cuda(values, out):
        out[:] = np.cumsum(values)
        return int(out[-1])
    inclusive_sums_kernel.blocks(1, B)(values, out)
    return int(to_host(out[values.size - 1:], True)[0])
