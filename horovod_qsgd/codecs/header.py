"""The 16-byte payload header and its errors.

Layout (little endian)::

    offset 0  2 bytes  magic b"HQ"
    offset 2  uint8    wire format version (WIRE_VERSION)
    offset 3  uint8    codec id (1 QSGD, 2 top-k, 3 random-k, 4 lattice, 5 exact fp32;
                       4 and 5 are SwarmSGD's model exchange)
    offset 4  uint32   numel of the encoded tensor
    offset 8  uint32   config digest of the encoding codec
    offset 12 uint32   total payload length in bytes, header included

Every payload length is a multiple of 4, so payloads concatenated by an
allgather keep their 4-byte aligned sections; a reader walks them with
``parse_header(buf[off:]).nbytes``.
"""

import struct
from collections import namedtuple

import numpy as np

from ..kernels import as_device, follow_chain, gather_bytes, gather_chain, host_copy, is_cuda_array

__all__ = ["HEADER_NBYTES", "WIRE_VERSION", "MAGIC", "Header", "PayloadError",
           "parse_header", "pack_header", "split_payloads", "read_header_bytes", "read_header_chain",
           "follow_header_chain"]

MAGIC = b"HQ"
WIRE_VERSION = 1
HEADER_NBYTES = 16
_STRUCT = struct.Struct("<2sBBIII")
assert _STRUCT.size == HEADER_NBYTES

Header = namedtuple("Header", ["version", "codec_id", "numel", "digest", "nbytes"])


class PayloadError(ValueError):
    """A payload does not match the codec or tensor decoding it, or is damaged.

    Raised by the rank that decodes it, from the header's checks (codec, element count, digest, length), instead
    of decoding garbage into a gradient; the message names the tensor and the field that differs."""


def pack_header(codec_id, numel, digest, nbytes):
    return _STRUCT.pack(MAGIC, WIRE_VERSION, codec_id, numel, digest, nbytes)


def _head_bytes(buf):
    if isinstance(buf, (bytes, bytearray, memoryview)):
        return bytes(buf[:HEADER_NBYTES]), len(buf)
    if isinstance(buf, np.ndarray):
        if buf.dtype != np.uint8 or buf.ndim != 1:
            raise TypeError(f"payload must be a 1-D uint8 array, got {buf.dtype} with shape {buf.shape}")
        return buf[:HEADER_NBYTES].tobytes(), buf.size
    if is_cuda_array(buf):
        d = as_device(buf)
        if d.dtype != np.uint8 or d.ndim != 1:
            raise TypeError(f"payload must be a 1-D uint8 array, got {d.dtype} with shape {d.shape}")
        return host_copy(d[:min(HEADER_NBYTES, d.size)]).tobytes(), d.size
    raise TypeError(f"payload must be bytes, a numpy uint8 array or a CUDA uint8 array, got {type(buf).__name__}")


def parse_header(buf):
    """Header of the payload at the start of ``buf`` (bytes, numpy or CUDA uint8)."""
    head, size = _head_bytes(buf)
    if len(head) < HEADER_NBYTES:
        raise PayloadError(f"truncated payload: {len(head)} bytes, the header alone needs {HEADER_NBYTES}")
    magic, version, codec_id, numel, digest, nbytes = _STRUCT.unpack(head)
    if magic != MAGIC:
        raise PayloadError(f"not a horovod_qsgd payload: magic {magic!r}, expected {MAGIC!r}")
    if nbytes < HEADER_NBYTES or nbytes % 4:
        raise PayloadError(f"corrupt header: payload length {nbytes} is below {HEADER_NBYTES} or not a multiple of 4")
    return Header(version, codec_id, numel, digest, nbytes)


def read_header_bytes(buf, offsets, tail=None):
    """The 16 header bytes at each offset of a numpy or CUDA uint8 array; a device is read once for all.

    ``tail`` (uint8, same device) is read in the same copy: then returns (headers, tail's host bytes).
    """
    if tail is None:
        return [row.tobytes() for row in gather_bytes(buf, offsets, HEADER_NBYTES)]
    rows, tail_bytes = gather_bytes(buf, offsets, HEADER_NBYTES, tail)
    return [row.tobytes() for row in rows], tail_bytes


def read_header_chain(buf, count):
    """The 16 header bytes of the first ``count`` payloads concatenated in ``buf`` (each starts where
    the one before ends, by its header's length); a device is walked there and read once. Past a header
    whose length would not advance, or beyond the buffer's end, the rows are zeros."""
    return [row.tobytes() for row in gather_chain(buf, count, HEADER_NBYTES, HEADER_NBYTES - 4)]


def follow_header_chain(buf, count, checks_nbytes):
    """The chain of :func:`read_header_chain` in a CUDA buffer, followed on the device and not yet read:
    a :class:`~horovod_qsgd.kernels.bytes.DeviceChain` whose ``records`` hold each payload's (start,
    length) for kernels to decode at, with ``checks_nbytes`` of zeroed scratch (``tail``) for their
    checks; its ``read()`` returns the 16-byte rows and the checks' host bytes in one copy."""
    return follow_chain(as_device(buf), count, HEADER_NBYTES, HEADER_NBYTES - 4, checks_nbytes)


def split_payloads(buf):
    """Offsets ``[(offset, Header), ...]`` of the payloads concatenated in ``buf``."""
    out = []
    off = 0
    total = len(buf) if isinstance(buf, (bytes, bytearray, memoryview)) else buf.size
    while off < total:
        h = parse_header(buf[off:])
        if off + h.nbytes > total:
            raise PayloadError(f"truncated payload at offset {off}: header says {h.nbytes} bytes, "
                               f"{total - off} left")
        out.append((off, h))
        off += h.nbytes
    return out
