"""Makes numba's CUDA simulator safe between the threads of a block, for our kernels' test runs.

The simulator runs a block's threads as Python threads, and three things it does are not safe between them:

* ``cuda.shared.array`` looks its call site up in a dict and stores a new array when it is missing. Two
  threads that both miss each get their own array: one of them then works on private "shared" memory, and a
  scan or histogram of that launch is silently wrong.
* a device function, at every call, swaps ``cuda`` in its globals for the launch's fake module and puts the
  real one back on return: a thread that returns first does so under another thread still inside, whose next
  ``cuda.syncthreads()`` fails.
* that swap iterates the function's globals, and the first warning a function's code raises (numpy's uint64
  wraparound in our hashes, even when ignored) adds ``__warningregistry__`` to them: a thread entering the
  function meanwhile fails with "dictionary changed size during iteration" (CI, 2026-11-28).

Each window is a few bytecodes wide; the shorter the interpreter's switch interval (the simulator runs set
0.2 ms, scripts/gpu_compile_check.py) and the busier the machine, the more often a thread is switched inside
one: CI saw a random mismatch of scripts/cuda_check.py against the CPU. The shared arrays get a lock (one
lookup per array and thread); our kernels see ``cuda`` as a stand-in, which the simulator leaves
alone and which always means the running launch's module (a lock around every device call instead made the
simulator runs several times slower); their globals hold a warning registry from the start. Nothing here
touches what a GPU runs.
"""

import sys
import threading

import numpy as np

_lock = threading.Lock()
_launch_cuda = None  # the stand-in, made once the first kernel is retargeted


class _LaunchCuda:
    """``cuda`` inside a simulated kernel: the running launch's fake module (one launch runs at a time)."""

    def __init__(self):
        from numba.cuda.simulator import kernel

        self._kernel = kernel

    def __getattr__(self, name):
        return getattr(self._kernel._kernel_context, name)


def bind_kernel_globals(kernel_globals):
    """Readies a retargeted kernel's own globals for the simulator's threads; makes its shared arrays safe."""
    kernel_globals["cuda"] = kernel_cuda_module()
    kernel_globals.setdefault("__warningregistry__", {})


def kernel_cuda_module():
    """What ``cuda`` is bound to in our kernels' globals under the simulator."""
    global _launch_cuda
    if _launch_cuda is None:
        from numba.cuda.simulator import kernelapi

        kernelapi.FakeCUDAShared.array = _shared_array
        _launch_cuda = _LaunchCuda()
    return _launch_cuda


def _shared_array(self, shape, dtype):
    """The simulator's ``FakeCUDAShared.array``, the lookup and the store made one step: one array per call
    site (file and line) and launch."""
    from numba.core import types
    from numba.np import numpy_support

    if isinstance(dtype, types.Type):
        dtype = numpy_support.as_dtype(dtype)
    if shape == 0:  # dynamic shared memory: one buffer for all
        return np.frombuffer(self._dynshared.data, dtype=dtype, count=self._dynshared_size // dtype.itemsize)
    frame = sys._getframe(1)
    site = (frame.f_code.co_filename, frame.f_lineno)
    with _lock:
        found = self._allocations.get(site)
        if found is None:
            found = self._allocations[site] = np.empty(shape, dtype)
    return found
