"""Shared machinery of the codecs: validation, dtype conversion, digest, header I/O."""

import json
import zlib

import numpy as np

from ..kernels import (MAX_STORE, CarriedResidual, as_device, copy_to, error_counters, host_copy, is_cuda_array,
                       store_bytes, widen_f16)
from .header import WIRE_VERSION, PayloadError, pack_header, parse_header

__all__ = ["Codec", "to_float32", "check_choice", "align4"]

SUPPORTED_INPUT = "float32, float16 and bfloat16 (converted to float32 first)"


def align4(n):
    return (n + 3) & ~3


def check_choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed values: "
                         + ", ".join(repr(a) for a in allowed))
    return value


def check_int(name, value, lo, hi=None):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}={value!r} must be an integer")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise ValueError(f"{name}={value!r} is out of range; allowed: {rng}")
    return int(value)


def check_ratio(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not 0.0 < value <= 1.0:
        raise ValueError(f"{name}={value!r} is out of range; allowed: a float in (0, 1]")
    return float(value)


_is_cuda = is_cuda_array
_dev = as_device


def to_float32(x, *, what="x"):
    """float32 1-D view or copy of x (numpy or CUDA array).

    float16 inputs are widened exactly; numpy arrays of a ``bfloat16`` dtype
    (ml_dtypes, as used by TensorFlow and JAX) are widened exactly by a bit
    shift.  CUDA bfloat16 cannot be passed through the CUDA array interface:
    adapters convert it (``tensor.float()``) before calling a codec.
    Anything else raises TypeError.
    """
    if isinstance(x, np.ndarray):
        arr = x
    elif _is_cuda(x):
        arr = _dev(x)
    else:
        raise TypeError(f"{what} must be a numpy array or a CUDA array (__cuda_array_interface__), "
                        f"got {type(x).__name__}")
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {tuple(arr.shape)}; flatten it first")
    dt = np.dtype(arr.dtype)
    if dt == np.float32:
        if isinstance(arr, np.ndarray):
            return np.ascontiguousarray(arr)
        if not arr.is_c_contiguous():
            raise ValueError(f"{what} must be contiguous")
        return arr
    if dt == np.float16:
        if isinstance(arr, np.ndarray):
            return arr.astype(np.float32)
        return widen_f16(arr.view(np.uint16))
    if dt.name == "bfloat16" and isinstance(arr, np.ndarray):
        return (np.ascontiguousarray(arr).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    raise TypeError(f"{what} has dtype {dt.name}; supported: {SUPPORTED_INPUT}")


def _check_array(name, a, dtype, size=None, min_size=None, gpu=False):
    if gpu:
        if not _is_cuda(a):
            raise TypeError(f"{name} must be a CUDA array like x, got {type(a).__name__}")
        a = _dev(a)
    elif not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy array like x, got {type(a).__name__}")
    if np.dtype(a.dtype) != dtype or a.ndim != 1:
        raise TypeError(f"{name} must be a 1-D {np.dtype(dtype).name} array, got {np.dtype(a.dtype).name} "
                        f"with shape {tuple(a.shape)}")
    contiguous = a.flags["C_CONTIGUOUS"] if isinstance(a, np.ndarray) else a.is_c_contiguous()
    if not contiguous:
        raise ValueError(f"{name} must be contiguous")
    if size is not None and a.size != size:
        raise ValueError(f"{name} has {a.size} elements, expected {size}")
    if min_size is not None and a.size < min_size:
        raise ValueError(f"{name} has {a.size} bytes, the payload needs up to {min_size}")
    return a


def check_residual(residual, n, gpu):
    """An error-feedback residual of ``n`` elements on x's device, checked: an array updated in place, or a
    :class:`~horovod_qsgd.kernels.CarriedResidual` (both of its arrays checked)."""
    if isinstance(residual, CarriedResidual):
        return residual.checked(lambda a, name: _check_array(name, a, np.float32, size=n, gpu=gpu))
    return _check_array("residual", residual, np.float32, size=n, gpu=gpu)


def view(buf, offset, count, dtype):
    """``count`` items of ``dtype`` at byte ``offset`` of a uint8 array (numpy or device)."""
    nbytes = count * np.dtype(dtype).itemsize
    return buf[offset:offset + nbytes].view(dtype)


def write_bytes(buf, offset, data):
    """Copy host bytes into a numpy or device uint8 array.

    Up to ``MAX_STORE`` bytes (headers, padding) go to a device as a kernel's
    arguments, so that encoding never waits for the GPU; longer runs are a copy.
    """
    data = bytes(data)
    if not data:
        return
    if isinstance(buf, np.ndarray) or len(data) <= MAX_STORE:
        store_bytes(buf, offset, data)
    else:
        copy_to(buf[offset:offset + len(data)], np.frombuffer(data, np.uint8))


def read_bytes(buf, offset, n):
    if isinstance(buf, np.ndarray):
        return buf[offset:offset + n].tobytes()
    return host_copy(buf[offset:offset + n]).tobytes()


class Codec:
    """Base class; subclasses define ``codec_id``, ``config()``, the layout and the kernels."""

    codec_id = 0
    payload_nbytes_is_fixed = True
    # int64 counters per payload in which a decode counts what it finds wrong (0: it has nothing to check)
    fault_width = 0
    # whether decode_sum takes device records: variable-size payloads on a CUDA device that the device found
    decodes_chained = False
    MAX_NUMEL = 2 ** 32 - 1

    def config(self):
        raise NotImplementedError

    @property
    def digest(self):
        """uint32 crc32 of (codec class, config, wire format version), stable across runs.

        Computed once: codecs are immutable after construction.
        """
        d = self.__dict__.get("_digest")
        if d is None:
            text = json.dumps({"codec": type(self).__name__, "config": self.config(),
                               "wire_version": WIRE_VERSION}, sort_keys=True, separators=(",", ":"))
            d = self.__dict__["_digest"] = zlib.crc32(text.encode("utf-8")) & 0xFFFFFFFF
        return d

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"

    def max_payload_nbytes(self, numel):
        raise NotImplementedError

    def encode_many(self, xs, outs, *, step, keys, residuals=None):
        """Encodes ``xs[i]`` into ``outs[i]`` under ``keys[i]``, all at ``step``; returns the bytes each used.

        The encodes of a group of tensors, or of one tensor's slices, as :meth:`encode` makes them one by one
        (the same bytes). Where a codec has grouped kernels (QSGD's fixed width on a GPU) they take one launch
        sequence for all; otherwise one encode each. ``residuals``: None, or one per input.
        """
        residuals = [None] * len(xs) if residuals is None else residuals
        return [self.encode(x, out, step=step, key=key, residual=residual)
                for x, out, key, residual in zip(xs, outs, keys, residuals)]

    def decode_accumulate(self, payload, out, *, header=None):
        """out += decode(payload) (float32, in place); PayloadError if the payload is damaged or not this codec's.

        ``header``: the payload's header, already read (None: read here).
        """
        self.decode_sum(payload, [(0, payload.size, header)], [out])

    def decode_sum(self, buffer, payloads, outs, faults=None):
        """Adds the payloads of ``buffer`` to ``outs`` in order (float32; one array given twice sums both).

        The one decode of every exchange. ``payloads``: [(start, end, header)]
        (a header None is read here), or, where :attr:`decodes_chained`, the
        device records (len(outs), 2) of each payload's (start, length) or
        (-1, 0) from :func:`~.header.follow_header_chain`, for payloads whose
        starts only a CUDA device knows. What a decode finds wrong (a
        corrupt stream, an index out of range) raises PayloadError here, read
        back once for all payloads; or, given ``faults`` (zeroed int64
        counters, :attr:`fault_width` per payload, on the payloads' device), it
        is counted there for the caller to read with the payloads' headers in
        one copy and pass to :meth:`raise_for_faults`. Meanwhile garbage may go
        into ``outs``, never outside them. Device records need ``faults``.
        """
        width = self.fault_width
        if not isinstance(payloads, list):
            if faults is None or not self.decodes_chained:
                raise ValueError(f"{self!r}: device records need decodes_chained and fault counters")
            return self._decode_chained(buffer, payloads, outs, faults)
        counters, headers = faults, []
        for slot, ((start, end, header), out) in enumerate(zip(payloads, outs)):
            h, payload, out, gpu = self._open_payload(buffer[start:end], out, header)
            if counters is None:
                counters = self.fault_counters(len(payloads), gpu)
            self._decode_one(h, payload, out, counters[width * slot:width * (slot + 1)] if width else None)
            headers.append(h)
        if faults is None and counters is not None:
            checks = counters.view(np.uint8)
            self.raise_for_faults(checks if isinstance(checks, np.ndarray) else host_copy(checks), headers)
        return None

    def fault_counters(self, count, gpu):
        """Zeroed counters for the faults of ``count`` payloads (:meth:`decode_sum`'s ``faults``) on the host or the
        device, or None where the decode has nothing to count."""
        return error_counters(self.fault_width * count, gpu) if self.fault_width else None

    def raise_for_faults(self, fault_bytes, headers):
        """Raises PayloadError where the host bytes of :meth:`decode_sum`'s ``faults`` show one (``headers``: the
        payloads', in order)."""

    def _decode_one(self, header, payload, out, counters):
        """out += the payload checked against ``header``; faults counted in ``counters`` (None: no fault_width)."""
        raise NotImplementedError(f"{type(self).__name__} has no gradient decode")

    def _decode_chained(self, buffer, records, outs, faults):
        raise NotImplementedError(f"{type(self).__name__} has no chained decode")

    @staticmethod
    def _numbered(message, slot, count):
        """``message`` naming the payload among several."""
        return message if count == 1 else f"{message} (payload number {slot} of {count})"

    # -- helpers for subclasses -------------------------------------------

    def _prepare_encode(self, x, out, residual, need_residual):
        """Validate encode arguments; returns (x32, out, residual, gpu)."""
        x = to_float32(x)
        gpu = not isinstance(x, np.ndarray)
        n = x.size
        if n > self.MAX_NUMEL:
            raise ValueError(f"x has {n} elements; {type(self).__name__} supports at most {self.MAX_NUMEL}")
        out = _check_array("out", out, np.uint8, min_size=self.max_payload_nbytes(n), gpu=gpu)
        if need_residual:
            if residual is None:
                raise ValueError(f"{type(self).__name__} uses error feedback: pass residual=, "
                                 f"a float32 array of x.size ({n}) elements, zeros at the start")
            residual = check_residual(residual, n, gpu)
        return x, out, residual, gpu

    @staticmethod
    def _check_step_key(step, key):
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= step < 2 ** 64:
            raise ValueError(f"step={step!r} must be an integer in [0, 2**64)")
        if isinstance(key, bool) or not isinstance(key, (int, np.integer)) or not 0 <= key < 2 ** 32:
            raise ValueError(f"key={key!r} must be an integer in [0, 2**32) (e.g. crc32 of the tensor name)")
        return int(step), int(key)

    def _finish(self, out, numel, nbytes_used):
        """Zero the alignment padding and write the header; returns the total length."""
        total = align4(nbytes_used)
        write_bytes(out, nbytes_used, bytes(total - nbytes_used))
        write_bytes(out, 0, pack_header(self.codec_id, numel, self.digest, total))
        return total

    def _open_payload(self, payload, out, header=None):
        """Validate a payload against this codec and ``out``; returns (header, payload, out, gpu).

        ``header``: the payload's header, already read (one read for all
        payloads of an exchange); None reads it here.
        """
        gpu = _is_cuda(out)
        out = _check_array("out", out, np.float32, gpu=gpu)
        if gpu and not _is_cuda(payload):
            raise TypeError("payload must be a CUDA array when out is one")
        payload = _check_array("payload", payload, np.uint8, gpu=gpu)
        h = parse_header(payload) if header is None else header
        differences = self.header_differences(h, out.size)
        if differences:
            raise PayloadError(f"the payload does not match {self!r} and out: " + "; ".join(differences))
        if payload.size < h.nbytes:
            raise PayloadError(f"truncated payload: header says {h.nbytes} bytes, got {payload.size}")
        if payload.size > h.nbytes:
            raise PayloadError(f"payload has {payload.size} bytes but its header says {h.nbytes}: "
                               f"pass exactly one payload (split concatenations with parse_header)")
        return h, payload, out, gpu

    def header_differences(self, header, numel):
        """How a parsed payload header differs from what this codec makes of ``numel`` elements ([] if not).

        The one check of a header against a codec: the codec's own decode
        raises PayloadError with it, an exchange CompressionMismatchError
        naming the rank that sent it.
        """
        differences = []
        if header.version != WIRE_VERSION:
            differences.append(f"wire format version {header.version} (here {WIRE_VERSION})")
        if header.codec_id != self.codec_id:
            differences.append(f"codec id {header.codec_id} (here {self.codec_id}, {type(self).__name__})")
        if header.digest != self.digest:
            differences.append(f"settings digest {header.digest:#010x} (here {self.digest:#010x}): other codec "
                               "settings")
        if header.numel != numel:
            differences.append(f"{header.numel} elements (here {numel}): the tensor's shape differs")
        if not differences and self.payload_nbytes_is_fixed and header.nbytes != self.max_payload_nbytes(numel):
            differences.append(f"{header.nbytes} bytes, where a {type(self).__name__} payload of {numel} elements "
                               f"has {self.max_payload_nbytes(numel)}: it is damaged")
        return differences
