"""Races between a block's threads in numba's CUDA simulator, with and without kernels/_simulator.py.

Run with NUMBA_ENABLE_CUDASIM=1 (test_simulator_threads.py does). At a 1 us switch interval, prints one JSON
line: the launches of a block-wide prefix sum (a device function with barriers, on a shared array) that raised
or gave a wrong sum, the launches that raised of a kernel whose threads leave a device function at different
times, the launches that raised of a kernel whose threads enter a device function while another raises its first
warning, and the trials in which 32 threads released together by a barrier got more than one "shared" array.
With ``--unpatched`` (the simulator as numba ships it) the last three come out in the tens here (80, 65 and 35
of 100, 100 and 200, 2026-11-28); with the stand-in for ``cuda`` but no warning registry, 26 to 53 of 100
first-warning launches raise "dictionary changed size during iteration" (three runs), CI's failure.
"""
import json
import os
import sys
import threading
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402
from numba.cuda.simulator import kernelapi  # noqa: E402

from horovod_qsgd.kernels import _simulator  # noqa: E402
from horovod_qsgd.kernels._dual import cuda_kernel, gpu_only  # noqa: E402
from horovod_qsgd.kernels.scan import inclusive_sums  # noqa: E402

THREADS, TRIALS, LAUNCHES = 32, 200, 100


def split_shared_arrays():
    split = 0
    for _ in range(TRIALS):
        shared, got, gate = kernelapi.FakeCUDAShared(0), [None] * THREADS, threading.Barrier(THREADS)

        def allocate(t):
            gate.wait()
            got[t] = shared.array(16, np.int64)

        threads = [threading.Thread(target=allocate, args=(t,)) for t in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        split += len({id(a) for a in got}) > 1
    return split


def failed_scans():
    failed, values = 0, np.arange(1, 200, dtype=np.int64)
    for _ in range(LAUNCHES):
        out = cuda.to_device(np.zeros_like(values))
        try:
            inclusive_sums(cuda.to_device(values), out)
            failed += not np.array_equal(out.copy_to_host(), np.cumsum(values))
        except Exception:  # the simulator re-raises an error of one of the block's threads
            failed += 1
    return failed


@gpu_only
def count_after(spins, counter):
    """Adds 1 to counter[0] after ``spins`` idle steps: threads leave at different times."""
    s = 0
    for j in range(spins):
        s += j
    cuda.atomic.add(counter, 0, 1 + s - s)


@cuda_kernel
def staggered_kernel(counter):
    count_after(cuda.threadIdx.x % 8 * 200, counter)


def failed_counting_launches(kernel_of_launch):
    """Launches of ``kernel_of_launch()``, one block whose every thread adds 1 to a counter, that raised or
    counted wrong."""
    failed = 0
    for _ in range(LAUNCHES):
        kernel = kernel_of_launch()
        counter = cuda.to_device(np.zeros(1, np.int64))
        try:
            kernel.blocks(1, THREADS)(counter)
            failed += int(counter.copy_to_host()[0]) != THREADS
        except Exception:  # the simulator re-raises an error of one of the block's threads
            failed += 1
    return failed


def failed_staggered():
    return failed_counting_launches(lambda: staggered_kernel)


# compiled afresh for each launch: a function's first warning is what adds the registry to its globals
FIRST_WARNING_SOURCE = """
@gpu_only
def wrapping_add(counter):
    big = np.uint64(0xFFFFFFFFFFFFFFFF)
    cuda.atomic.add(counter, 0, int(big * big))  # wraps to 1: numpy warns


@cuda_kernel
def first_warning_kernel(counter):
    s = 0
    for j in range(cuda.threadIdx.x % 8 * 20):
        s += j
    wrapping_add(counter)
"""


def fresh_first_warning_kernel():
    # numpy's names make the globals long, as a kernel module's are: the simulator's swap iterates them
    namespace = dict(vars(np), np=np, cuda=cuda, gpu_only=gpu_only, cuda_kernel=cuda_kernel)
    exec(FIRST_WARNING_SOURCE, namespace)
    return namespace["first_warning_kernel"]


def failed_first_warnings():
    return failed_counting_launches(fresh_first_warning_kernel)


if __name__ == "__main__":
    assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run under NUMBA_ENABLE_CUDASIM=1"
    if "--unpatched" in sys.argv:
        _simulator.bind_kernel_globals = lambda kernel_globals: kernel_globals.__setitem__("cuda", cuda)
    warnings.simplefilter("ignore", RuntimeWarning)  # ignored warnings still register in the globals
    sys.setswitchinterval(1e-6)
    # the kernels first: their first launch binds their ``cuda`` (kernels/_dual.py), which locks the shared arrays
    failed = {"failed_scans": failed_scans(), "failed_staggered": failed_staggered(),
              "failed_first_warnings": failed_first_warnings()}
    print(json.dumps(dict(failed, split_shared_arrays=split_shared_arrays())))
