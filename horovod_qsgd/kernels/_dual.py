"""Write a kernel core once, compile it for the CPU and for CUDA.

A *core* is a plain Python function that does the work of one element group,
bucket or chunk.  :func:`core` compiles it with ``numba.njit`` right away and
registers it, so that :func:`cuda_twin` can later compile the *same source*
with ``numba.cuda.jit(device=True)``.  Cores call other cores by their module
global name; for the CUDA compilation the function is rebuilt with a copy of
its globals in which every registered core is replaced by its CUDA twin (and
``cuda`` is bound to ``numba.cuda``), so one source serves both targets.

CPU launchers are ordinary ``njit(parallel=True)`` functions that loop with
``prange`` over groups/buckets/chunks and call the cores.  CUDA launchers are
plain Python kernel functions wrapped by :func:`cuda_kernel`; they launch one
thread per group/bucket/chunk and call the same cores.

Arithmetic rules for cores (so that the CPU, CUDA and the CUDA simulator,
which runs the core as plain Python on numpy scalars, give the same bits):

* every float constant is a ``np.float32``/``np.float64`` module global, every
  int that meets a float is converted explicitly (numba turns
  ``float32 * int64`` into float64, numpy keeps float32);
* uint64 arithmetic only between uint64 values (uint64 op int64 is float64 in
  both numba and numpy 2);
* a product that feeds an addition goes through :func:`fmul32`/:func:`fmul64`,
  which on a real GPU are ``__fmul_rn``/``__dmul_rn`` so NVVM cannot contract
  them into an FMA (the CPU never contracts without fastmath).
"""

import contextlib
import functools
import hashlib
import os
import threading
import types

import numba
import numpy as np

__all__ = [
    "core", "gpu_only", "cuda_twin", "cuda_kernel", "is_cuda_array", "as_device", "on_cuda",
    "cpu_launcher", "cpu_launch", "set_cpu_threads", "cpu_threads", "cpu_threads_chosen",
    "fmul32", "fmul64", "launch_config", "SERIAL_BELOW", "launch_stream", "current_stream", "current_allocator",
]

# ------------------------------------------------------------ JIT cache --
# njit(cache=True) stamps a cached function with the hash of *its own* source
# file, but our launchers inline cores from other files: editing a core would
# leave stale machine code in the cache.  Our locators stamp every cached
# kernel with the hash of all kernel sources together.

_HERE = os.path.dirname(os.path.abspath(__file__))


def _kernel_sources_hash():
    h = hashlib.sha256()
    for name in sorted(os.listdir(_HERE)):
        if name.endswith(".py"):
            h.update(name.encode())
            with open(os.path.join(_HERE, name), "rb") as f:
                h.update(f.read())
    return h.digest()


def _install_cache_locators():
    from numba.core import caching

    stamp = _kernel_sources_hash()

    class _Mixin:
        def get_source_stamp(self):
            return stamp

        @classmethod
        def from_function(cls, py_func, py_file):
            if os.path.dirname(os.path.abspath(py_file)) != _HERE:
                return None
            return super().from_function(py_func, py_file)

    def find(*names):
        for name in names:
            if hasattr(caching, name):
                return getattr(caching, name)
        return None

    in_tree = find("InTreeCacheLocator", "_InTreeCacheLocator")
    user_wide = find("UserWideCacheLocator", "_UserWideCacheLocator")
    impl = find("CacheImpl", "_CacheImpl")
    if None in (in_tree, user_wide, impl):  # unknown numba: keep its own caching
        return

    class InTree(_Mixin, in_tree):
        pass

    class UserWide(_Mixin, user_wide):
        pass

    impl._locator_classes = [InTree, UserWide] + [
        c for c in impl._locator_classes if getattr(c, "__module__", None) != __name__]


_install_cache_locators()

_REGISTRY = {}  # id(cpu dispatcher) -> [cpu dispatcher, pyfunc, cuda_impl, cuda twin]


def core(fn=None, *, cuda_impl=None, inline=False):
    """Decorator: compile ``fn`` with njit now, keep it for a CUDA twin later.

    ``cuda_impl`` (optional) is a zero-argument callable returning a CUDA
    device function to use instead of compiling ``fn`` on a real GPU (not in
    the simulator, which always runs ``fn`` itself).  ``inline=True`` makes
    numba inline the CPU version into its callers at the IR level (for small
    cores called per group in hot loops, which LLVM would otherwise call).
    """
    def wrap(f):
        cpu = numba.njit(cache=True, inline="always" if inline else "never")(f)
        _REGISTRY[id(cpu)] = [cpu, f, cuda_impl, None]
        return cpu
    return wrap(fn) if fn is not None else wrap


def gpu_only(fn):
    """Decorator: a device function for CUDA kernels only (block-level code: shared memory, barriers).

    It has no CPU build; kernels and other device functions call it by its
    module global name, as they call cores.
    """
    _REGISTRY[id(fn)] = [fn, fn, None, None]
    return fn


def _cuda():
    from numba import cuda  # imported lazily: costs time and is rarely needed
    return cuda


def _simulated():
    return bool(numba.config.ENABLE_CUDASIM)


NVVM_MISSING = (
    "horovod_qsgd: numba's CUDA target found no NVVM/libdevice, which it needs to compile the kernels for "
    "a GPU; PyTorch's CUDA wheels do not ship them. Fix: install horovod_qsgd with the extra of your CUDA "
    "major version (PyTorch's is torch.version.cuda), `pip install -e '.[cuda12]'` or `'.[cuda13]'` in its "
    "checkout, or point CUDA_HOME at a CUDA toolkit.")


NUMBA_CUDA_MISSING = (
    "horovod_qsgd: the CUDA kernels are compiled by numba-cuda (NVIDIA's CUDA target for numba), but "
    "numba.cuda here is numba's deprecated built-in target ({implementation}), which cannot compile them "
    "(it fails on min() and max() of two numbers in a kernel). Fix: install horovod_qsgd with the extra of "
    "your CUDA major version (PyTorch's is torch.version.cuda), `pip install -e '.[cuda12]'` or "
    "`'.[cuda13]'` in its checkout, or `pip install 'numba-cuda[cu12]'` / `'numba-cuda[cu13]'`.")


def require_numba_cuda():
    """Raises RuntimeError naming the fix unless ``numba.cuda`` is numba-cuda's target."""
    implementation = getattr(_cuda(), "implementation", "Built-in")
    if implementation != "NVIDIA":
        raise RuntimeError(NUMBA_CUDA_MISSING.format(implementation=implementation))


@functools.cache  # a success is kept, a failure raises again on the next call
def require_gpu_compiler():
    """Raises RuntimeError naming the fix when numba-cuda is not the CUDA target or cannot load NVVM.

    Loading NVVM is what the first compile does anyway (numba's own error says
    to use conda); a failure here would fail there too.
    """
    require_numba_cuda()
    from numba.cuda.cudadrv import nvvm
    try:
        nvvm.NVVM()
    except Exception as error:  # numba raises NvvmSupportError, numba-cuda its library finder's errors
        raise RuntimeError(f"{NVVM_MISSING} ({type(error).__name__}: {error})") from error


def _retarget(fn):
    """Copy of ``fn`` whose global cores resolve to their CUDA twins."""
    g = dict(fn.__globals__)
    for name in fn.__code__.co_names:
        val = g.get(name)
        if val is not None and id(val) in _REGISTRY and _REGISTRY[id(val)][0] is val:
            g[name] = cuda_twin(val)
    if _simulated():
        from . import _simulator
        _simulator.bind_kernel_globals(g)
    else:
        g["cuda"] = _cuda()
    return types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)


def cuda_twin(cpu_dispatcher):
    """The CUDA device-function twin of a core (compiled on first use)."""
    entry = _REGISTRY[id(cpu_dispatcher)]
    if entry[3] is None:
        cpu, fn, cuda_impl, _ = entry
        if cuda_impl is not None and not _simulated():
            entry[3] = cuda_impl()
        else:
            entry[3] = _cuda().jit(device=True)(_retarget(fn))
    return entry[3]


_THREAD = threading.local()


@contextlib.contextmanager
def launch_stream(stream, allocate=None):
    """Kernel launches, device scratch and copies made by this thread inside go to ``stream``.

    ``stream``: a numba stream (``cuda.external_stream(torch_stream.cuda_stream)``
    for PyTorch's); 0 is numba's default stream. The adapters enter it with
    the stream the framework wrote the gradient on, so the kernels are ordered
    after that write and before the framework's next use, without a sync.

    ``allocate(nbytes)``: where device scratch comes from, an object with
    ``__cuda_array_interface__`` of at least ``nbytes`` bytes, kept alive by
    the arrays viewing it (PyTorch's caching allocator, which reuses memory
    on that stream; numba's own ``cuMemAlloc``/``cuMemFree`` synchronise and
    cannot use what PyTorch holds). None: numba allocates.
    """
    previous = getattr(_THREAD, "stream", 0), getattr(_THREAD, "allocate", None)
    _THREAD.stream, _THREAD.allocate = stream, allocate
    try:
        yield
    finally:
        _THREAD.stream, _THREAD.allocate = previous


def current_stream():
    """The stream this thread's launches go to (see :func:`launch_stream`)."""
    return getattr(_THREAD, "stream", 0)


def current_allocator():
    """The scratch allocator of this thread's :func:`launch_stream`, or None."""
    return getattr(_THREAD, "allocate", None)


class cuda_kernel:
    """Lazily compiled CUDA kernel from a plain Python function.

    ``k[n](*args)`` launches ``n`` threads (``launch_config(n)`` blocks of 128)
    on the thread's :func:`current_stream`.
    """

    def __init__(self, fn):
        self.fn = fn
        self._kernel = None

    def __getitem__(self, nthreads):
        grid, block = launch_config(nthreads)
        return self.blocks(grid, block)

    def blocks(self, grid, block):
        """The kernel configured with ``grid`` blocks of ``block`` threads, on the :func:`current_stream`."""
        if self._kernel is None:
            if not _simulated():
                require_gpu_compiler()  # else numba's first compile fails with advice for conda
            # cache=True: compiled once per machine, not in every process's first backward; the cache is
            # stamped with all kernel sources (see the locators above), as the CPU builds are
            self._kernel = _cuda().jit(_retarget(self.fn), cache=True)
        return self._kernel[max(1, int(grid)), int(block), current_stream()]


def launch_config(nthreads, block=128):
    return max(1, (int(nthreads) + block - 1) // block), block


# ---------------------------------------------------------------- dispatch --

def _device_array_types():
    if _simulated():
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        return (FakeCUDAArray,)
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    return (DeviceNDArray,)


def is_cuda_array(a):
    """True for numba device arrays and objects with ``__cuda_array_interface__``."""
    if isinstance(a, np.ndarray) or a is None:
        return False
    if hasattr(a, "__cuda_array_interface__"):
        return True
    return _simulated() and isinstance(a, _device_array_types())


def as_device(a):
    """numba device array for a CUDA array (zero copy)."""
    if isinstance(a, _device_array_types()):
        return a
    return _cuda().as_cuda_array(a)


def on_cuda(*arrays):
    """True if the (non-None) arrays are CUDA arrays, False if numpy arrays.

    Raises TypeError on a mix of the two or on anything else.
    """
    kinds = set()
    for a in arrays:
        if a is None:
            continue
        if isinstance(a, np.ndarray):
            kinds.add("cpu")
        elif is_cuda_array(a):
            kinds.add("cuda")
        else:
            raise TypeError(
                f"expected a numpy array or a CUDA array (__cuda_array_interface__), got {type(a).__name__}")
    if len(kinds) > 1:
        raise TypeError("all arrays must be on the same device kind: got numpy and CUDA arrays mixed")
    return kinds == {"cuda"}


# --------------------------------------------------------------- threading --
# numba's "workqueue" threading layer aborts the process when parallel
# kernels are launched from several Python threads at once.  The "omp" and
# "tbb" layers are thread safe.  numba picks the first available of
# tbb, omp, workqueue; if it ended up on workqueue we serialise our parallel
# launches with a lock (see cpu_launch).

_LOCK = threading.Lock()
_LAYER = None


@numba.njit(parallel=True, cache=True)
def _probe(a):
    for i in numba.prange(a.size):
        a[i] = i


def threading_layer():
    """The numba threading layer in use (starts numba's pool if needed)."""
    global _LAYER
    if _LAYER is None:
        with _LOCK:
            if _LAYER is None:
                _probe(np.empty(4, np.int64))
                _LAYER = numba.threading_layer()
    return _LAYER


SERIAL_BELOW = 1 << 16  # work items (elements) below which a launch runs serially


def _renamed(fn, suffix):
    """A copy of ``fn`` whose qualified name ends in ``suffix``.

    numba's disk cache files a compiled function under its qualified name
    and first line, keyed by signature, CPU and bytecode, but not by the
    compile options: the parallel and the serial twin of one source would
    load each other's machine code, whichever was cached first.  Kernel
    launches then ran serially on all cores, or a one-thread share ran the
    parallel build (QSGD-4 encode of 1M values took 0.83 ms on either twin;
    0.44 ms once the parallel twin was its own).
    """
    twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    twin.__qualname__ = fn.__qualname__ + suffix
    twin.__doc__ = fn.__doc__
    return twin


class cpu_launcher:
    """A CPU launcher compiled twice from one source: ``prange`` parallel and serial.

    Both twins release the GIL.  Waking numba's thread pool costs tens to
    hundreds of microseconds, far more than the work on a small tensor; :func:`cpu_launch` runs the serial
    twin (``prange`` is a plain ``range`` there) below ``SERIAL_BELOW``
    elements.  Each twin is compiled on first use (and cached on disk).
    """

    def __init__(self, fn):
        self.py_func = fn
        # nogil: other Python threads (TensorFlow ops, torch hooks) keep
        # running while a kernel computes
        self.parallel = numba.njit(parallel=True, cache=True, nogil=True)(fn)
        self.serial = numba.njit(cache=True, nogil=True)(_renamed(fn, "_serial"))
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__

    def __call__(self, *args):
        return self.parallel(*args)


_CPU_THREADS = None  # threads per parallel launch; None: numba's pool size


def set_cpu_threads(n):
    """Threads each parallel CPU kernel launch uses (None: all of numba's pool).

    Several Horovod ranks on one machine each run their own kernels: with
    every rank using all cores, their threads oversubscribe the CPU and
    OpenMP's spinning workers slow down the ranks' training threads too.

    Args:
        n (int or None): threads per launch, at least 1, capped at numba's pool
            size (``NUMBA_NUM_THREADS``); None: the whole pool. Without a call,
            each compressor gives its rank ``cores // local ranks`` (at least 1)
            on first use. Change it when the ranks on a machine are not its only
            work (fewer) or their training threads are few (more).

    Costs nothing by itself; too many threads per rank cost every rank's step
    (on 2 cores, QSGD-4 at 1 Gbit/s went from 2.65-2.81x to 4.56-4.93x of
    uncompressed throughput when each of 2 ranks took one thread, not two).
    """
    global _CPU_THREADS
    if n is None:
        _CPU_THREADS = None
        return
    if int(n) < 1:
        raise ValueError(f"horovod_qsgd: kernel threads must be >= 1, got {n}")
    _CPU_THREADS = min(int(n), numba.config.NUMBA_NUM_THREADS)


def cpu_threads_chosen():
    """Whether :func:`set_cpu_threads` set a number (the adapters then keep it)."""
    return _CPU_THREADS is not None


def cpu_threads():
    """Threads a parallel CPU kernel launch uses now (see :func:`set_cpu_threads`; reading it costs nothing)."""
    return numba.config.NUMBA_NUM_THREADS if _CPU_THREADS is None else _CPU_THREADS


def cpu_launch(launcher, work, *args):
    """Run a :class:`cpu_launcher` on ``work`` elements' worth of data.

    Parallel launches are serialised with a lock only on numba's
    ``workqueue`` threading layer (which is not thread safe).
    """
    if work < SERIAL_BELOW or _CPU_THREADS == 1:
        # One thread: the serial twin. A parallel launch masked down to one thread of a larger pool
        # made a 2-rank digits run 2-4x slower than a pool of one (NUMBA_NUM_THREADS=1).
        return launcher.serial(*args)
    if _CPU_THREADS is not None:
        numba.set_num_threads(_CPU_THREADS)  # per calling thread in numba, so set on every launch
    if threading_layer() == "workqueue":
        with _LOCK:
            return launcher.parallel(*args)
    return launcher.parallel(*args)


# ------------------------------------------------------- no-FMA products --

def _fmul32_cuda():
    from numba.cuda import libdevice
    return libdevice.fmul_rn


def _fmul64_cuda():
    from numba.cuda import libdevice
    return libdevice.dmul_rn


@core(cuda_impl=_fmul32_cuda, inline=True)
def fmul32(a, b):
    """float32 product that is never fused with a following addition."""
    return a * b


@core(cuda_impl=_fmul64_cuda, inline=True)
def fmul64(a, b):
    """float64 product that is never fused with a following addition."""
    return a * b
