"""Codecs for exchanging *models* between two ranks: the cubic-lattice quantizer and exact fp32.

Both write the 16-byte header of :mod:`.header` and are decoded with the
receiver's own vector as *reference*; :class:`ExactCodec` ignores it.
"""

import math

import numpy as np

from .. import kernels as K
from .base import Codec, _check_array, align4, check_int, read_bytes, view, write_bytes
from .header import HEADER_NBYTES

__all__ = ["LatticeCodec", "ExactCodec", "LATTICE_CODEC_ID", "EXACT_CODEC_ID"]

LATTICE_CODEC_ID = 4
EXACT_CODEC_ID = 5
_EPS_MAX = float(np.finfo(np.float32).max)
_EPS_MIN = float(np.finfo(np.float32).tiny)


def _check_float(name, value, lo, *, open_low=True):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name}={value!r} must be a float")
    value = float(value)
    if not math.isfinite(value) or value < lo or (open_low and value == lo):
        raise ValueError(f"{name}={value!r} is out of range; allowed: a finite float "
                         f"{'>' if open_low else '>='} {lo}")
    return value


class _ModelCodec(Codec):
    """What both model codecs share: fixed payload sizes and decode(payload, reference, out)."""

    def _open_for_decode(self, payload, reference, out):
        h, payload, out, gpu = self._open_payload(payload, out)
        if reference is not None:
            reference = _check_array("reference", reference, np.float32, size=out.size, gpu=gpu)
        return h, payload, reference, out, gpu


class LatticeCodec(_ModelCodec):
    r"""Cubic-lattice (modular) quantizer of a vector relative to the receiver's own vector.

    Davies et al., "New Bounds for Distributed Mean Estimation and Variance
    Reduction" (ICLR 2021), as used by SwarmSGD (Nadiradze et al., arXiv
    1910.12308) for model exchange.  Models, unlike gradients, are large in
    norm but close to each other; QSGD-style quantizers pay for the norm,
    this one only for the distance.  With step ``eps`` and ``q = 2**bits``
    the sender sends, per coordinate,

    .. math::
        c_i = z_i \bmod q, \qquad z_i = \lfloor x_i/\varepsilon \rfloor
              + [u_i < x_i/\varepsilon - \lfloor x_i/\varepsilon \rfloor]

    (stochastic rounding from the counter-based generator, so
    :math:`E[z_i \varepsilon] = x_i` and :math:`|z_i\varepsilon - x_i| < \varepsilon`),
    and the receiver, holding :math:`y`, decodes the integer congruent to
    :math:`c_i` mod q nearest to :math:`y_i/\varepsilon`, times eps.  That is
    exactly :math:`z_i\varepsilon` whenever

    .. math:: |x_i - y_i| \le \varepsilon (q/2 - 2)  \quad (\texttt{radius(eps)}).

    Beyond it the decoded value is off by a multiple of :math:`q\varepsilon`;
    a 32-bit checksum of the integers per bucket of ``bucket_size``
    coordinates detects that (``decode`` returns the number of failed
    buckets; a miss needs a 2**-32 collision).

    Args:
        bits (int): 3..8 bits per coordinate on the wire, ``q = 2**bits``.
            Default 8 (1 byte per coordinate, radius 126 eps).  Fewer bits
            give a smaller radius for the same eps, so a coarser eps for the
            same spread: error per coordinate grows as ``2**-bits``.
        bucket_size (int): coordinates per checksum, a multiple of 8.
            Default 4096 (4 bytes per 4096 coordinates).
        headroom (float): :meth:`eps_for_spread` picks eps so that the
            radius is ``headroom`` times the expected spread ``max|x - y|``.
            Default 2.0.  Larger: fewer decode failures, proportionally
            larger quantization error.
        seed (int): seed of the rounding stream (with step, key, index).

    Wire: ``16 (header) + 4 (eps, float32) + 4 * ceil(n / bucket_size)
    + ceil(n * bits / 8)`` bytes, rounded up to a multiple of 4: at 8 bits
    ``1 + 4/4096`` bytes per coordinate, 3.996x fewer than fp32.
    """

    codec_id = LATTICE_CODEC_ID

    def __init__(self, bits=8, bucket_size=4096, headroom=2.0, seed=0):
        self.bits = check_int("bits", bits, 3, 8)
        self.bucket_size = check_int("bucket_size", bucket_size, 8, 2 ** 31)
        if self.bucket_size % 8:
            raise ValueError(f"bucket_size={bucket_size!r} must be a multiple of 8 (buckets start on whole bytes)")
        self.headroom = _check_float("headroom", headroom, 1.0, open_low=False)
        self.seed = check_int("seed", seed, 0, 2 ** 64 - 1)
        self.q = 1 << self.bits

    def config(self):
        return {"bits": self.bits, "bucket_size": self.bucket_size, "headroom": self.headroom,
                "seed": self.seed}

    # -- step size ------------------------------------------------------------

    def radius(self, eps):
        """Largest per-coordinate ``|x - y|`` that always decodes with step eps: ``eps * (q/2 - 2)``."""
        return K.decodable_radius(eps, self.bits)

    def eps_for_spread(self, spread, magnitude=0.0):
        """Step eps whose radius is ``headroom * spread``, as a float32 value.

        ``spread`` is the expected ``max_i |x_i - y_i|``; ``magnitude`` is
        ``max_i |x_i|``.  eps is at least ``magnitude * 2**-40`` (so
        ``|x/eps|`` stays far below the 2**52 limit; a spread below that is
        finer than float32 can represent anyway) and the smallest normal
        float32.
        """
        spread = _check_float("spread", spread, 0.0, open_low=False)
        magnitude = _check_float("magnitude", magnitude, 0.0, open_low=False)
        eps = self.headroom * spread / (self.q // 2 - 2)
        eps = max(eps, magnitude * 2.0 ** -40, _EPS_MIN)
        return float(np.float32(min(eps, _EPS_MAX)))

    # -- layout ---------------------------------------------------------------

    def _nbuckets(self, n):
        return (n + self.bucket_size - 1) // self.bucket_size

    def max_payload_nbytes(self, numel):
        n = int(numel)
        return align4(HEADER_NBYTES + 4 + 4 * self._nbuckets(n) + (n * self.bits + 7) // 8)

    def _sections(self, buf, n):
        nb = self._nbuckets(n)
        off = HEADER_NBYTES + 4 + 4 * nb
        return view(buf, HEADER_NBYTES + 4, nb, np.uint32), buf[off:off + (n * self.bits + 7) // 8]

    @staticmethod
    def payload_eps(payload):
        """The step eps a payload was encoded with (float)."""
        return float(np.frombuffer(read_bytes(payload, HEADER_NBYTES, 4), np.float32)[0])

    # -- encode / decode ------------------------------------------------------

    def encode(self, x, out, *, eps, step, key):
        """Encode x with step ``eps`` into out (header + body); returns the payload length.

        ``eps`` is rounded to float32 (the value in the payload is the one
        both sides use).  Raises ValueError if x holds NaN/Inf or a value with
        ``|x/eps| >= 2**52``.
        """
        step, key = self._check_step_key(step, key)
        eps = _check_float("eps", eps, 0.0)
        if not _EPS_MIN <= eps <= _EPS_MAX:
            raise ValueError(f"eps={eps!r} is out of range for float32; allowed: "
                             f"{_EPS_MIN:g} <= eps <= {_EPS_MAX:g}")
        eps32 = np.float32(eps)
        x, out, _, gpu = self._prepare_encode(x, out, None, need_residual=False)
        n = x.size
        nb = self._nbuckets(n)
        write_bytes(out, HEADER_NBYTES, eps32.tobytes())
        sums, codes = self._sections(out, n)
        status = _empty(nb, np.uint8, gpu)
        base = K.stream_base(self.seed, step, key, K.PURPOSE_LATTICE)
        failed = K.lattice_encode(x, codes, sums, status, eps=eps32, bits=self.bits,
                                  bucket_size=self.bucket_size, base=base)
        if failed:
            first = int(np.flatnonzero(_host(status))[0])
            lo = first * self.bucket_size
            raise ValueError(f"x has NaN/Inf or |x/eps| >= 2**52 (eps={float(eps32):g}) in {failed} bucket(s), "
                             f"the first at elements {lo}..{min(n, lo + self.bucket_size) - 1}")
        return self._finish(out, n, HEADER_NBYTES + 4 + 4 * nb + codes.size)

    def decode(self, payload, reference, out, bad=None):
        """out = the decoded vector, using ``reference`` (the receiver's vector, float32).

        Returns the number of buckets that failed to decode (0: every value
        is the sender's lattice point).  The values of failed buckets are
        unspecified: discard the whole result or re-send.  ``bad``
        (optional, uint8, one per bucket) receives 1 for each failed bucket.
        """
        h, payload, reference, out, gpu = self._open_for_decode(payload, reference, out)
        if reference is None:
            raise ValueError("LatticeCodec.decode needs reference=, the receiver's own float32 vector")
        n = h.numel
        sums, codes = self._sections(payload, n)
        if bad is None:
            bad = _empty(self._nbuckets(n), np.uint8, gpu)
        else:
            bad = _check_array("bad", bad, np.uint8, size=self._nbuckets(n), gpu=gpu)
        return K.lattice_decode(codes, sums, reference, out, bad, eps=self.payload_eps(payload),
                                bits=self.bits, bucket_size=self.bucket_size)


class ExactCodec(_ModelCodec):
    """Full-precision model exchange with the same header: ``16 + 4 n`` bytes of float32.

    Used for tensors that are not quantized, for rounds without a spread
    estimate, and as the fallback when a lattice payload fails to decode.
    """

    codec_id = EXACT_CODEC_ID

    def config(self):
        return {}

    def max_payload_nbytes(self, numel):
        return HEADER_NBYTES + 4 * int(numel)

    def encode(self, x, out, **_ignored):
        """Copy x (as float32) after the header; returns the payload length."""
        x, out, _, gpu = self._prepare_encode(x, out, None, need_residual=False)
        n = x.size
        body = view(out, HEADER_NBYTES, n, np.float32)
        body[:] = x
        return self._finish(out, n, HEADER_NBYTES + 4 * n)

    def decode(self, payload, reference, out, bad=None):
        """out = the sender's vector (reference and bad unused); returns 0."""
        h, payload, _, out, gpu = self._open_for_decode(payload, None, out)
        out[:] = view(payload, HEADER_NBYTES, h.numel, np.float32)
        return 0


def _empty(n, dtype, gpu):
    return K.device_empty(max(n, 1), dtype)[:n] if gpu else np.empty(n, dtype)


def _host(a):
    return a if isinstance(a, np.ndarray) else K.host_copy(a)
