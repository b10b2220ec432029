"""Compression kernels shared by every framework adapter.

Each routine's per-element / per-group / per-bucket / per-chunk *core* is
written once as a plain Python function and compiled twice, with
``numba.njit`` for the CPU and ``numba.cuda.jit(device=True)`` for CUDA (see
:mod:`._dual`).  The functions exported here dispatch on the array type:
numpy arrays run on the CPU, objects with ``__cuda_array_interface__`` on
CUDA.  Kernels take float32 data and never import torch or TensorFlow.

Modules:

* :mod:`.rng` - counter-based random numbers (seed, step, key, index);
* :mod:`.half` - float32 <-> fp16 conversions as arithmetic cores;
* :mod:`.qsgd` - QSGD quantise + fixed-width pack, unpack + accumulate;
* :mod:`.elias` - Elias-gamma coded QSGD, parallel over buckets;
* :mod:`.select` - top-k (exact radix select, Gaussian-k, sampled), random-k;
* :mod:`.lattice` - SwarmSGD's cubic-lattice quantizer and its entry points;
* :mod:`.api` - the array-level entry points of QSGD, Elias, random-k, fp16;
* :mod:`.grouped` - QSGD's encodes and decodes of many payloads in one launch
  sequence (a fusion group's, a tensor's slices, every rank's payloads);
* :mod:`.topk` - top-k selection (driven from the host on the CPU, by
  :mod:`.select_device`'s kernels on a GPU) and the scatter back;
* :mod:`.select_device` - the GPU's selection: shared-memory histograms,
  one-block digit choices and scans, tiles written in index order;
* :mod:`.select_grouped` - top-k of many tensors in one launch sequence
  (exact, Gaussian and sampled thresholds), and the sparse decode of many
  payloads, a launch per sender;
* :mod:`.scan` - block-wide prefix sums (the selection's tiles, Elias's bucket ends);
* :mod:`.bytes` - headers written by a kernel from its arguments, many
  payloads' headers read back in one copy, variable-size payloads' header
  chain followed on the device.

Everything a codec needs is exported here; codecs do not import the
modules above directly.

CPU execution.  Every CPU launcher exists twice (:class:`._dual.cpu_launcher`):
a ``prange`` parallel build for large arrays and a serial build below
``SERIAL_BELOW`` (65536) elements, because waking numba's thread pool costs
more than encoding a small tensor.  Both release the GIL.  Compiled code is
cached on disk (``cache=True``, the CUDA kernels too); the cache entries are
stamped with a hash of *all* kernel sources, because launchers inline cores
from other files.

Threading.  numba's ``workqueue`` layer aborts the process when parallel
kernels are launched from several threads at once (TensorFlow runs ops
concurrently, torch hooks run on autograd threads).  numba picks the first
available of tbb, omp, workqueue; here (no tbb wheel installed) that is
``omp`` (GNU OpenMP), which is thread safe.  If a process ends up on
``workqueue`` anyway (e.g. ``NUMBA_THREADING_LAYER=workqueue``), parallel
launches are serialised with a lock; tests/kernels/test_kernel_threads.py
checks both.  Installing ``tbb`` (``pip install tbb``) is also fine.

Cores per rank.  Ranks on one machine share its cores: the adapters call
:func:`horovod_qsgd.common.threads.share_cores` on first use, which gives
each rank's parallel kernels ``cores // local_size`` threads (at least 1)
unless the user set ``NUMBA_NUM_THREADS`` or called :func:`set_cpu_threads`;
a one-thread share runs the serial builds (a parallel launch masked to one
thread of a larger pool was 2-4x slower).  Measured on the 2-core machine
with 2 ranks (mlp25m, 1 Gbit/s): QSGD-4 went from 2.65-2.81x to 4.56-4.93x
the uncompressed throughput.

Nothing of an encode's logic stays on the host: top-k on a GPU decides
everything on the device (:mod:`.select_device`; on the CPU :mod:`.topk`
drives the same selection from the host), Elias's bucket ends are summed
there (:mod:`.scan`) and only the payload's length is read back.  Headers
and padding go to a device as kernel arguments (:mod:`.bytes`), so QSGD and
top-k encodes make no host copy; the headers of every rank's payload are
read back in one copy.

Streams.  Every launch, device scratch allocation and copy goes to the
calling thread's :func:`launch_stream` (numba's default stream outside one);
the PyTorch adapter enters it with PyTorch's current stream on the tensor's
device, so the kernels are ordered after the gradient's producer without a
device-wide sync.
"""

from ._arrays import CarriedResidual, copy_to, device_empty, host_copy
from ._dual import (as_device, cpu_threads, cpu_threads_chosen, current_stream, is_cuda_array, launch_stream,
                    set_cpu_threads, threading_layer)
from .bytes import MAX_STORE, follow_chain, gather_bytes, gather_chain, store_bytes
from .api import (all_finite, elias_decode_accumulate, elias_decode_chained, elias_encode, elias_error,
                  finish_sum, move_into_own_chunk, narrow_f16, qsgd_decode_accumulate, qsgd_decode_many, qsgd_encode,
                  qsgd_encode_many, randomk_gather,
                  randomk_indices, randomk_scatter_accumulate, randomk_scatter_payload, widen_f16)
from .elias import max_bucket_bits
from .lattice import PURPOSE_LATTICE, decodable_radius, lattice_decode, lattice_encode
from .rng import PURPOSE_RANDOMK, PURPOSE_ROUNDING, PURPOSE_SAMPLE, stream_base
from .select import committed
from .topk import (acklam_ppf, error_counters, exact_threshold, sparse_accumulate, sparse_accumulate_many,
                   topk_encode_many, topk_select)

__all__ = [
    "CarriedResidual", "committed", "acklam_ppf", "all_finite", "elias_decode_accumulate", "elias_decode_chained",
    "elias_encode",
    "elias_error",
    "exact_threshold",
    "qsgd_decode_accumulate", "qsgd_encode", "qsgd_decode_many", "qsgd_encode_many", "randomk_gather", "randomk_indices",
    "randomk_scatter_accumulate", "randomk_scatter_payload", "sparse_accumulate", "sparse_accumulate_many",
    "error_counters", "topk_select", "topk_encode_many",
    "widen_f16", "narrow_f16", "move_into_own_chunk", "finish_sum",
    "max_bucket_bits", "lattice_encode", "lattice_decode", "decodable_radius",
    "stream_base", "threading_layer", "cpu_threads", "cpu_threads_chosen", "set_cpu_threads",
    "as_device", "is_cuda_array", "gather_bytes", "gather_chain", "follow_chain", "store_bytes", "MAX_STORE",
    "launch_stream", "current_stream", "copy_to", "device_empty", "host_copy",
    "PURPOSE_LATTICE", "PURPOSE_RANDOMK", "PURPOSE_ROUNDING", "PURPOSE_SAMPLE",
]
