"""Headers and other small byte runs moved without a synchronous copy per run.

A ``copy_to_device`` of host bytes or a ``copy_to_host`` of a device slice
waits for the GPU's queue to drain; done for every header of every tensor,
it stops backward from overlapping with communication. Here:

* :func:`store_bytes` writes a few host bytes into a device buffer with a
  kernel that takes them as its arguments: a launch, no copy;
* :func:`gather_bytes` collects equal-length runs at many offsets (every
  rank's payload header in an allgather's result) into one scratch array
  and reads that back in a single copy;
* :func:`gather_chain` does the same where each run's offset follows from
  the run before (variable-size payloads), following the chain on the device;
  :func:`follow_chain` leaves the chain there, with every run's start for
  kernels to decode at, and reads it back later with their checks.

numpy buffers take the plain slice assignments.
"""

import numpy as np

from ._arrays import clear, copy_to, device_view, empty, to_device_cached, to_host
from ._dual import cuda_kernel, on_cuda

__all__ = ["store_bytes", "gather_bytes", "gather_chain", "follow_chain", "DeviceChain", "MAX_STORE",
           "OFFSETS_PER_LAUNCH"]

MAX_STORE = 64  # bytes one store_bytes call passes as kernel arguments
OFFSETS_PER_LAUNCH = 128  # offsets one gather launch takes as arguments (1 KiB of the 4 KiB parameter space)


@cuda_kernel
def store_kernel(buf, offset, data):
    i = cuda.grid(1)  # noqa: F821
    if i < len(data):
        buf[offset + i] = data[i]


@cuda_kernel
def gather_kernel(buf, offsets, length, out):
    """``offsets``: a tuple of kernel arguments, or a device array."""
    t = cuda.grid(1)  # noqa: F821
    row = t // length
    if row < len(offsets):
        out[row, t - row * length] = buf[offsets[row] + t - row * length]


@cuda_kernel
def chain_kernel(buf, length, field, out, records):
    """One thread follows the chain: row i is the run at offset_i, offset_{i+1} = offset_i + the
    little-endian uint32 at offset_i + field; it stops where a run would pass the end or not advance.
    records[i] = (offset_i, that uint32), or (-1, 0) past the stop."""
    if cuda.grid(1) == 0:  # noqa: F821 (a few hundred dependent steps: nothing to parallelise)
        offset = 0
        for i in range(out.shape[0]):
            records[i, 0] = -1
            records[i, 1] = 0
        for i in range(out.shape[0]):
            if offset + length > buf.size:
                break
            for j in range(length):
                out[i, j] = buf[offset + j]
            step = 0
            for j in range(4):
                step |= np.int64(buf[offset + field + j]) << (8 * j)
            records[i, 0] = offset
            records[i, 1] = step
            if step < length:
                break
            offset += step


def store_bytes(buf, offset, data):
    """``buf[offset:offset + len(data)] = data`` for a uint8 array and up to MAX_STORE host bytes."""
    data = bytes(data)
    if not data:
        return
    if not on_cuda(buf):
        buf[offset:offset + len(data)] = np.frombuffer(data, np.uint8)
        return
    if len(data) > MAX_STORE:
        raise ValueError(f"store_bytes writes at most {MAX_STORE} bytes, got {len(data)}")
    if offset < 0 or offset + len(data) > buf.size:
        raise ValueError(f"store_bytes: bytes {offset}..{offset + len(data)} lie outside the {buf.size}-byte buffer")
    store_kernel[len(data)](device_view(buf), np.int64(offset), tuple(np.uint8(b) for b in data))


def gather_bytes(buf, offsets, length, tail=None):
    """Host uint8 array of shape (len(offsets), length): row i is ``buf[offsets[i]:offsets[i] + length]``.

    A device buffer is read with one copy and one launch whatever the number of offsets (up to
    ``OFFSETS_PER_LAUNCH`` go as the kernel's arguments, more as a device table, copied there once per set of
    offsets and kept).
    ``tail`` (a uint8 array on the same device) is read in that same copy:
    then returns (rows, host copy of tail).
    """
    offsets = [int(o) for o in offsets]
    for o in offsets:
        if o < 0 or o + length > buf.size:
            raise ValueError(f"gather_bytes: bytes {o}..{o + length} lie outside the {buf.size}-byte buffer")
    if not on_cuda(buf):
        rows = np.array([buf[o:o + length] for o in offsets], np.uint8).reshape(len(offsets), length)
        return rows if tail is None else (rows, np.array(tail, np.uint8))
    head = len(offsets) * length
    out = empty(head + (0 if tail is None else tail.size), np.uint8, True)
    view, rows = device_view(buf), out[:head].reshape((len(offsets), length))
    if len(offsets) > OFFSETS_PER_LAUNCH:  # a fused group's every payload: the offsets as a table, one launch
        table = to_device_cached(np.array(offsets, np.int64))
        gather_kernel[len(offsets) * length](view, table, np.int64(length), rows)
    elif offsets:
        group = tuple(np.int64(o) for o in offsets)
        gather_kernel[len(group) * length](view, group, np.int64(length), rows)
    if tail is not None and tail.size:
        copy_to(out[head:], device_view(tail))
    host = to_host(out, True)
    rows = host[:head].reshape(len(offsets), length)
    return rows if tail is None else (rows, host[head:])


def gather_chain(buf, count, length, field):
    """Host uint8 array (count, length): the runs of a chain of variable-length records in ``buf``.

    Record i starts where record i-1 ends: at its start plus the
    little-endian uint32 at byte ``field`` of it (the payload headers'
    length). Where the chain stops (a record would pass the end of ``buf``
    or has a length below ``length``) the remaining rows are zeros. A device
    buffer is followed on the device and read once.
    """
    if not 0 <= field <= length - 4:
        raise ValueError(f"gather_chain: the length field at byte {field} is not inside a {length}-byte run")
    if not on_cuda(buf):
        rows, offset = np.zeros((count, length), np.uint8), 0
        for i in range(count):
            if offset + length > buf.size:
                break
            rows[i] = buf[offset:offset + length]
            step = int(np.frombuffer(rows[i, field:field + 4].tobytes(), "<u4")[0])
            if step < length:
                break
            offset += step
        return rows
    return follow_chain(buf, count, length, field).read()


class DeviceChain:
    """A chain followed on the device (:func:`follow_chain`), not yet read.

    ``records``: int64 (count, 2) device array, row i = (start, length field)
    of run i, (-1, 0) past where the chain stopped; ``tail``: zeroed device
    uint8 scratch for the checks of kernels that decode at those starts,
    read back with the runs by :meth:`read`.
    """

    def __init__(self, count, length, tail_nbytes):
        head = count * length
        # the tail follows the rows in one allocation, 8-byte aligned for int64 counters
        self._tail_at = (head + 7) & ~7
        self._scratch = empty(self._tail_at + tail_nbytes, np.uint8, True)
        clear(self._scratch)
        self.rows = self._scratch[:head].reshape((count, length))
        self.tail = self._scratch[self._tail_at:]
        self.records = empty((count, 2), np.int64, True)

    def read(self):
        """Host rows (count, length), or (rows, tail's host bytes) when a tail was asked for: one copy."""
        host = to_host(self._scratch, True)
        rows = host[:self.rows.size].reshape(self.rows.shape)
        return (rows, host[self._tail_at:]) if self.tail.size else rows


def follow_chain(buf, count, length, field, tail_nbytes=0):
    """Follows the chain of :func:`gather_chain` in a device buffer without reading it: a :class:`DeviceChain`."""
    if not 0 <= field <= length - 4:
        raise ValueError(f"follow_chain: the length field at byte {field} is not inside a {length}-byte run")
    chain = DeviceChain(count, length, tail_nbytes)
    chain_kernel[1](device_view(buf), np.int64(length), np.int64(field), chain.rows, chain.records)
    return chain
