"""Which threads each twin of a cached CPU launcher runs on (run by test_kernel_threads).

    python twins_check.py serial,parallel

Calls the twins in the given order and prints one line per call:
``<twin> <sorted thread ids>``.  Meant for a fresh process with
``NUMBA_CACHE_DIR`` set, twice: the first run compiles and caches, the second
loads from the cache.
"""

import os
import sys

import numba
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from horovod_qsgd.kernels._dual import cpu_launcher, threading_layer  # noqa: E402


@cpu_launcher
def record_thread_ids(out):
    for i in numba.prange(out.size):
        acc = 0.0
        for j in range(200_000):  # long enough that every pool thread takes iterations
            acc += np.sqrt(np.float64(j + i))
        out[i] = numba.get_thread_id() if acc > 0 else -1


def main(order):
    # get_thread_id needs numba's thread pool started; a cached serial
    # function calls it without starting the pool (segfault)
    threading_layer()
    for twin in order.split(","):
        out = np.full(16, -1, np.int64)
        getattr(record_thread_ids, twin)(out)
        print(twin, sorted(set(out.tolist())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
