"""QSGD codec (fixed-width and Elias-coded)."""

import numpy as np

from .. import kernels as K
from .base import Codec, _check_array, _is_cuda, align4, check_choice, check_int, view, write_bytes
from .header import HEADER_NBYTES, WIRE_VERSION, PayloadError

__all__ = ["QSGDCodec"]


class QSGDCodec(Codec):
    r"""QSGD: stochastic quantisation to ``s = 2**(bits-1) - 1`` levels per sign.

    Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient
    Quantization and Encoding", NeurIPS 2017.  The tensor is cut into
    buckets of ``bucket_size`` coordinates; each bucket has a scale
    (``norm="max"``: max |x_i|, ``norm="l2"``: ||x||_2) and each coordinate
    is sent as a signed level ``l_i`` in ``[-s, s]`` with

    .. math::
        r_i = |x_i| / \mathrm{scale} \cdot s, \quad
        l_i = \mathrm{sign}(x_i)(\lfloor r_i \rfloor + [u_i < r_i - \lfloor r_i \rfloor]),

    ``u_i`` uniform from a counter-based generator seeded by
    ``(seed, step, key, i)``.  Decoding gives ``l_i / s * scale``, an unbiased
    estimate of ``x_i`` (``rounding="stochastic"``).  With the L2 norm the
    variance per bucket of d coordinates is at most
    ``min(d/s**2, sqrt(d)/s) * ||x||^2`` (paper, Lemma 3.1); the max norm
    gives a smaller variance in practice and is the default.

    Args:
        bits (int): 2..8 bits per coordinate on the wire (``encoding="fixed"``);
            2 is ternary {-1, 0, 1} * scale, 4 gives s = 7, 8 gives s = 127.
            Default 4.  Fewer bits: less traffic, more variance (slower
            convergence); 8 bits is close to uncompressed SGD.
        bucket_size (int): coordinates per scale, >= 1.  Default 512.  Smaller
            buckets lower the variance (the scale follows the local
            magnitude) and cost ``32 / bucket_size`` more bits per coordinate.
        norm (str): ``"max"`` (default) or ``"l2"`` (the paper's analysis).
        encoding (str): ``"fixed"`` (default: exactly ``bits`` bits per
            coordinate, fixed payload size, fastest) or ``"elias"`` (the
            paper's section 3 code: only nonzero levels, Elias-gamma coded
            gaps and levels; smaller when most levels are 0, e.g. L2 norm with
            large buckets, but variable-size and slower).
        scale_dtype (str): ``"float32"`` (default) or ``"float16"`` (scales
            rounded *up* to fp16 so |x|/scale <= 1; halves the scale cost; a
            bucket whose max/norm exceeds 65504 decodes to NaN).
        rounding (str): ``"stochastic"`` (default, unbiased) or
            ``"deterministic"`` (round to nearest level: no randomness, but
            *biased*, small values are always sent as 0).
        seed (int): seed of the rounding random numbers; the same on all
            ranks is fine (``key`` and ``step`` separate the streams).

    Wire cost per coordinate, fixed encoding: ``bits + scale_bits / bucket_size``,
    e.g. 4-bit, bucket 512, fp32 scales: ``4 + 32/512 = 4.0625`` bits, 7.88x
    smaller than fp32; 8-bit: 8.0625 bits, 3.97x; 2-bit: 2.0625, 15.5x.
    Payload bytes (exact): ``16 + align4(nb * scale_bytes) + ceil(n*bits/8)``,
    rounded up to a multiple of 4, with ``nb = ceil(n / bucket_size)``.

    Elias encoding: ``16 + align4(nb * scale_bytes) + 4 * nb`` (bucket byte
    offsets) plus the streams, each bucket's padded to a byte; the worst case
    (every level = s) is ``3 + 2*floor(log2 s)`` bits per coordinate.  With
    the L2 norm and ``s ~ sqrt(bucket_size)`` the paper bounds the expected
    size by about ``2.8 n + 32`` bits per bucket of n.

    Code of a coordinate (fixed): the offset level ``l + s`` in ``bits``
    bits, packed LSB-first, 8 coordinates per ``bits`` bytes.  NaN/Inf in a
    bucket makes that whole bucket decode to NaN.
    """

    codec_id = 1

    def __init__(self, bits=4, bucket_size=512, norm="max", encoding="fixed",
                 scale_dtype="float32", rounding="stochastic", seed=0):
        self.bits = check_int("bits", bits, 2, 8)
        self.bucket_size = check_int("bucket_size", bucket_size, 1, 2 ** 32 - 1)
        self.norm = check_choice("norm", norm, ("max", "l2"))
        self.encoding = check_choice("encoding", encoding, ("fixed", "elias"))
        self.scale_dtype = check_choice("scale_dtype", scale_dtype, ("float32", "float16"))
        self.rounding = check_choice("rounding", rounding, ("stochastic", "deterministic"))
        self.seed = check_int("seed", seed, 0, 2 ** 64 - 1)
        self.levels = (1 << (self.bits - 1)) - 1
        self.payload_nbytes_is_fixed = self.encoding == "fixed"
        self.decodes_chained = not self.payload_nbytes_is_fixed
        self.fault_width = 3 if self.decodes_chained else 0  # see kernels.elias_error

    def config(self):
        return {"bits": self.bits, "bucket_size": self.bucket_size, "norm": self.norm,
                "encoding": self.encoding, "scale_dtype": self.scale_dtype,
                "rounding": self.rounding, "seed": self.seed}

    # -- layout --------------------------------------------------------------

    def _nbuckets(self, n):
        return (n + self.bucket_size - 1) // self.bucket_size

    def _scale_bytes(self, n):
        return self._nbuckets(n) * (2 if self.scale_dtype == "float16" else 4)

    def _max_stream_bytes(self, n):
        nb = self._nbuckets(n)
        if nb == 0:
            return 0
        full = n // self.bucket_size
        per_full = (K.max_bucket_bits(self.bucket_size, self.levels) + 7) // 8
        tail = n - full * self.bucket_size
        return full * per_full + ((K.max_bucket_bits(tail, self.levels) + 7) // 8 if tail else 0)

    def max_payload_nbytes(self, numel):
        n = int(numel)
        body = HEADER_NBYTES + align4(self._scale_bytes(n))
        if self.encoding == "fixed":
            return align4(body + (n * self.bits + 7) // 8)
        return align4(body + 4 * self._nbuckets(n) + self._max_stream_bytes(n))

    def _sections(self, buf, n):
        nb = self._nbuckets(n)
        half = self.scale_dtype == "float16"
        scales = view(buf, HEADER_NBYTES, nb, np.uint16 if half else np.float32)
        off = HEADER_NBYTES + align4(self._scale_bytes(n))
        return scales, off

    # -- encode / decode -----------------------------------------------------

    def encode(self, x, out, *, step, key, residual=None):
        """Encode x into out (header + body); returns the payload length in bytes."""
        step, key = self._check_step_key(step, key)
        x, out, _, gpu = self._prepare_encode(x, out, residual, need_residual=False)
        n = x.size
        if self.encoding == "fixed" and gpu and n:
            nbytes = self.max_payload_nbytes(n)
            if K.qsgd_encode_many([x], [out], [key], [nbytes], step=step, **self._kernel_settings()):
                return nbytes  # the grouped kernels' two launches, header and padding included
        scales, off = self._sections(out, n)
        scales_end = HEADER_NBYTES + self._scale_bytes(n)
        # An odd count of fp16 scales leaves 2 alignment bytes: zero them, never send stale memory.
        write_bytes(out, scales_end, bytes(off - scales_end))
        base = K.stream_base(self.seed, step, key, K.PURPOSE_ROUNDING)
        kw = dict(bucket_size=self.bucket_size, bits=self.bits, use_l2=self.norm == "l2",
                  half=self.scale_dtype == "float16", stochastic=self.rounding == "stochastic", base=base)
        if self.encoding == "fixed":
            ncodes = (n * self.bits + 7) // 8
            K.qsgd_encode(x, scales, out[off:off + ncodes], **kw)
            used = off + ncodes
        else:
            nb = self._nbuckets(n)
            ends = view(out, off, nb, np.uint32)
            s0 = off + 4 * nb
            used = s0 + K.elias_encode(x, scales, ends, out[s0:s0 + self._max_stream_bytes(n)], **kw)
        return self._finish(out, n, used)

    def encode_many(self, xs, outs, *, step, keys, residuals=None):
        """See :meth:`Codec.encode_many`: fixed-width payloads on a GPU take two launches for all of them."""
        if self.encoding == "fixed" and xs and residuals is None and _is_cuda(xs[0]):
            step = self._check_step_key(step, 0)[0]
            keys = [self._check_step_key(0, key)[1] for key in keys]
            prepared = [self._prepare_encode(x, out, None, need_residual=False) for x, out in zip(xs, outs)]
            xs, outs = [x for x, _, _, _ in prepared], [out for _, out, _, _ in prepared]  # converted once
            if all(gpu for _, _, _, gpu in prepared):
                nbytes = [self.max_payload_nbytes(x.size) for x in xs]
                if K.qsgd_encode_many(xs, outs, keys, nbytes, step=step, **self._kernel_settings()):
                    return nbytes
        return super().encode_many(xs, outs, step=step, keys=keys, residuals=residuals)

    def _kernel_settings(self):
        return dict(bucket_size=self.bucket_size, bits=self.bits, half=self.scale_dtype == "float16",
                    use_l2=self.norm == "l2", stochastic=self.rounding == "stochastic", seed=self.seed,
                    version=WIRE_VERSION, codec_id=self.codec_id, digest=self.digest)

    def decode_sum(self, buffer, payloads, outs, faults=None):
        """See :meth:`Codec.decode_sum`: fixed-width payloads on a GPU take one launch for all of them."""
        if self.encoding == "fixed" and isinstance(payloads, list) and payloads and _is_cuda(buffer):
            opened = [self._open_payload(buffer[start:end], out, header)
                      for (start, end, header), out in zip(payloads, outs)]
            if K.qsgd_decode_many(buffer, [start for start, _, _ in payloads], [out for _, _, out, _ in opened],
                                  bucket_size=self.bucket_size, bits=self.bits, half=self.scale_dtype == "float16"):
                return None
        return super().decode_sum(buffer, payloads, outs, faults)

    def _decode_one(self, h, payload, out, counters):
        n = h.numel
        if self.encoding != "fixed":
            return self._decode_elias(h, payload, out, counters)
        scales, off = self._sections(payload, n)
        K.qsgd_decode_accumulate(scales, payload[off:off + (n * self.bits + 7) // 8], out, bucket_size=self.bucket_size,
                                 bits=self.bits, half=self.scale_dtype == "float16")

    def _elias_layout(self, n):
        """Byte offsets of the scales, the bucket ends and the streams inside an Elias payload of n elements."""
        ends_at = HEADER_NBYTES + align4(self._scale_bytes(n))
        return HEADER_NBYTES, ends_at, ends_at + 4 * self._nbuckets(n)

    def _elias_truncation(self, h):
        stream_at = self._elias_layout(h.numel)[2]
        if h.nbytes < stream_at:
            return f"truncated Elias payload: {h.nbytes} bytes, the offsets alone end at {stream_at}"
        return None

    def _decode_elias(self, h, payload, out, counters):
        if self._elias_truncation(h):
            return  # raise_for_faults reports it
        n = h.numel
        scales, _ = self._sections(payload, n)
        _, ends_at, stream_at = self._elias_layout(n)
        K.elias_decode_accumulate(scales, view(payload, ends_at, self._nbuckets(n), np.uint32),
                                  payload[stream_at:h.nbytes], out, bucket_size=self.bucket_size, bits=self.bits,
                                  half=self.scale_dtype == "float16", counters=counters)

    def _decode_chained(self, buffer, records, outs, faults):
        """Every Elias payload's buckets decode in parallel at the payload's start as the device found it."""
        width = self.fault_width
        for slot, out in enumerate(outs):
            out = _check_array("out", out, np.float32, gpu=True)
            K.elias_decode_chained(buffer, records, slot, out, faults[width * slot:width * (slot + 1)],
                                   layout=self._elias_layout(out.size), bucket_size=self.bucket_size,
                                   bits=self.bits, half=self.scale_dtype == "float16")

    def raise_for_faults(self, fault_bytes, headers):
        counters = np.ascontiguousarray(fault_bytes).view(np.int64).reshape(-1, 3)
        for slot, (header, row) in enumerate(zip(headers, counters)):
            error = self._elias_truncation(header) or K.elias_error(row, self._nbuckets(header.numel))
            if error:
                raise PayloadError(self._numbered(error, slot, len(headers)))
