"""How many kernel threads each rank gets when several ranks share a machine."""
import os
import threading

_lock = threading.Lock()
_decided = False


def available_cores():
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def share_cores(local_size):
    """Once per process: ``available_cores() // local_size`` kernel threads (at least 1) for this rank.

    Left alone when the user chose: ``NUMBA_NUM_THREADS`` in the environment
    or an earlier :func:`horovod_qsgd.kernels.set_cpu_threads` call. Returns
    the kernel threads in use.
    """
    global _decided
    from horovod_qsgd import kernels
    with _lock:
        if not _decided:
            _decided = True
            if "NUMBA_NUM_THREADS" not in os.environ and not kernels.cpu_threads_chosen():
                kernels.set_cpu_threads(max(1, available_cores() // max(1, int(local_size))))
    return kernels.cpu_threads()
