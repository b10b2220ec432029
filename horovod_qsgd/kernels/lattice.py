"""Cubic-lattice (modular) quantisation relative to a reference vector.

Davies, Gurunathan, Moshrefi, Ashkboos, Alistarh, "New Bounds for Distributed
Mean Estimation and Variance Reduction", ICLR 2021, in the cubic-lattice
form that SwarmSGD (Nadiradze et al., arXiv 1910.12308) uses for models:
the sender knows ``x``, the receiver knows a nearby ``y``; only
``z mod q`` travels, with ``z`` the stochastic rounding of ``x / eps``.

Encoding (per element ``i``, float64 arithmetic on the float32 input)::

    r = x_i / eps
    z = floor(r) + [u_i < r - floor(r)]     u_i = random_u32(base, i) * 2**-32
    code = z mod q                           (q = 2**bits, LSB-first packed)

so ``E[z] = r`` up to 2**-32 (unbiased) and ``|z*eps - x_i| < eps``.

Decoding with reference ``y_i``::

    m = floor(y_i / eps + 1/2)
    d = (code - m) mod q, minus q if d >= q/2
    z' = m + d                               (the integer = code (mod q) nearest to y_i/eps)
    out_i = float32(z' * eps)

``z' == z`` whenever ``|x_i - y_i| <= eps * (q/2 - 2)`` (``|z - r| < 1`` and
``|y/eps - m| <= 1/2`` leave half a unit for rounding).  Outside that range
``z'`` differs from ``z`` by a multiple of ``q``; to *detect* it the sender
also sends, per bucket of ``bucket`` elements, a 32-bit checksum of the
integers ``z`` (the sum mod 2**64 of ``mix64(z ^ i*GOLDEN)``, folded); the
receiver recomputes it from ``z'``.  A mismatch flags the bucket; an
undetected wrong bucket needs a 32-bit collision (probability 2**-32).

Range: ``|x_i / eps|`` and ``|y_i / eps|`` must be below 2**52 (and
finite); elements outside flag their bucket (encode: ``status``, decode:
``bad``).  Decoded values of a flagged bucket are unspecified.

Launch structure: CPU launchers run ``prange`` over buckets (one bucket's
codes go through a bucket-local scratch and are packed with
:func:`qsgd.pack_span`); CUDA runs one thread per element (checksum terms
summed with ``atomic.add`` on uint64, which is order independent), the
packing kernel of :mod:`.qsgd`, and one thread per bucket to fold/compare
the checksums.  Both call the same cores; ``bucket`` must be a multiple of
8 so that buckets start on whole bytes for every ``bits``.
"""

import numba
import numpy as np

from ._arrays import clear, empty, to_host, zeros
from ._dual import as_device, core, cpu_launch, cpu_launcher, cuda_kernel, on_cuda
from .qsgd import pack_kernel, pack_span
from .rng import mix64, random_u32

__all__ = ["PURPOSE_LATTICE", "lattice_encode", "lattice_decode", "decodable_radius",
           "floor_int", "lattice_point", "nearest_congruent", "point_hash", "fold32", "unpack_code",
           "encode_cpu", "decode_cpu", "encode_kernel", "decode_kernel", "fold_kernel", "check_kernel"]

#: ``purpose`` of the rounding stream in :func:`.rng.stream_base` (1-3 are taken by rng.py).
PURPOSE_LATTICE = 8

_LIMIT = np.float64(2.0 ** 52)
_HALF64 = np.float64(0.5)
_INV32 = np.float64(2.0 ** -32)
_NAN32 = np.float32(np.nan)
_LO32 = 0xFFFFFFFF
_U32 = np.uint64(32)
_MASK32 = np.uint64(0xFFFFFFFF)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_ZERO64U = np.uint64(0)


def decodable_radius(eps, bits):
    """Largest ``|x - y|`` (per coordinate) that is guaranteed to decode: ``eps * (q/2 - 2)``."""
    return float(eps) * ((1 << bits) // 2 - 2)


# ------------------------------------------------------------------ cores --

@core(inline=True)
def in_range(r):
    """True for a finite float64 with |r| < 2**52 (False for NaN)."""
    return abs(r) < _LIMIT


@core(inline=True)
def floor_int(r):
    """floor(r) as an int, for a float64 with ``in_range(r)``."""
    f = int(r)  # truncation
    if np.float64(f) > r:
        f -= 1
    return f


@core(inline=True)
def lattice_point(r, base, i):
    """Unbiased stochastic rounding of r (float64, in range) to an int, with element i's random word."""
    f = floor_int(r)
    frac = r - np.float64(f)  # exact: r and floor(r) share the binade or floor(r) is 0
    u = np.float64(random_u32(base, i)) * _INV32
    return f + 1 if u < frac else f


@core(inline=True)
def nearest_congruent(t, code, q):
    """The integer congruent to ``code`` mod q (a power of 2) nearest to t (float64, in range)."""
    m = floor_int(t + _HALF64)
    d = (code - m) & (q - 1)
    if d >= q // 2:
        d -= q
    return m + d


@core(inline=True)
def point_hash(z, i):
    """64-bit hash of the integer z at element i (the two's complement bits of z, mixed with i)."""
    w = np.uint64(z & _LO32) | (np.uint64((z >> 32) & _LO32) << _U32)
    return mix64(w ^ (np.uint64(i) * _GOLDEN))


@core(inline=True)
def fold32(acc):
    """The 32-bit checksum of a bucket's uint64 sum of point hashes."""
    return np.uint32((acc ^ (acc >> _U32)) & _MASK32)


@core(inline=True)
def unpack_code(codes, i, bits, last):
    """Code of element i (``bits`` <= 8, LSB-first packing; ``last`` = codes.size - 1)."""
    bp = i * bits
    p = bp >> 3
    w = int(codes[p]) | (int(codes[min(p + 1, last)]) << 8)
    return (w >> (bp & 7)) & ((1 << bits) - 1)


@core
def encode_bucket(x, lo, hi, eps, q, base, tmp):
    """Codes of x[lo:hi] into tmp[0:hi-lo]; returns (checksum, ok)."""
    acc = _ZERO64U
    ok = True
    for j in range(hi - lo):
        i = lo + j
        r = np.float64(x[i]) / eps
        if in_range(r):
            z = lattice_point(r, base, i)
            tmp[j] = np.uint8(z & (q - 1))
            acc += point_hash(z, i)
        else:
            tmp[j] = np.uint8(0)
            ok = False
    return fold32(acc), ok


@core
def decode_bucket(codes, lo, hi, y, eps, bits, q, out):
    """out[lo:hi] = decoded values with reference y; returns (checksum of the decoded integers, ok)."""
    acc = _ZERO64U
    ok = True
    last = codes.size - 1
    for i in range(lo, hi):
        t = np.float64(y[i]) / eps
        if in_range(t):
            z = nearest_congruent(t, unpack_code(codes, i, bits, last), q)
            out[i] = np.float32(np.float64(z) * eps)
            acc += point_hash(z, i)
        else:
            out[i] = _NAN32
            ok = False
    return fold32(acc), ok


# ------------------------------------------------------------ CPU launchers --

@cpu_launcher
def encode_cpu(x, eps, bits, q, base, bucket, codes, sums, status):
    """codes, sums[b] (checksums) and status[b] (1: element out of range) for every bucket."""
    n = x.size
    nb = (n + bucket - 1) // bucket
    for b in numba.prange(nb):
        lo = b * bucket
        hi = min(n, lo + bucket)
        tmp = np.empty(hi - lo, np.uint8)
        s, ok = encode_bucket(x, lo, hi, eps, q, base, tmp)
        sums[b] = s
        status[b] = np.uint8(0) if ok else np.uint8(1)
        pack_span(tmp, bits, codes[(lo * bits) // 8:(hi * bits + 7) // 8])


@cpu_launcher
def decode_cpu(codes, y, eps, bits, q, bucket, sums, out, bad):
    """out = decoded values; bad[b] = 1 where bucket b's checksum or range check fails."""
    n = out.size
    nb = (n + bucket - 1) // bucket
    for b in numba.prange(nb):
        lo = b * bucket
        hi = min(n, lo + bucket)
        s, ok = decode_bucket(codes, lo, hi, y, eps, bits, q, out)
        bad[b] = np.uint8(0) if ok and s == sums[b] else np.uint8(1)


# ----------------------------------------------------------- CUDA kernels --

@cuda_kernel
def encode_kernel(x, eps, q, base, bucket, tmp, acc, status):
    i = cuda.grid(1)  # noqa: F821 (bound by cuda_kernel)
    if i < x.size:
        r = np.float64(x[i]) / eps
        if in_range(r):
            z = lattice_point(r, base, i)
            tmp[i] = np.uint8(z & (q - 1))
            cuda.atomic.add(acc, i // bucket, point_hash(z, i))  # noqa: F821
        else:
            tmp[i] = np.uint8(0)
            status[i // bucket] = np.uint8(1)


@cuda_kernel
def fold_kernel(acc, sums):
    b = cuda.grid(1)  # noqa: F821
    if b < sums.size:
        sums[b] = fold32(acc[b])


@cuda_kernel
def decode_kernel(codes, y, eps, bits, q, bucket, out, acc, bad):
    i = cuda.grid(1)  # noqa: F821
    if i < out.size:
        t = np.float64(y[i]) / eps
        if in_range(t):
            z = nearest_congruent(t, unpack_code(codes, i, bits, codes.size - 1), q)
            out[i] = np.float32(np.float64(z) * eps)
            cuda.atomic.add(acc, i // bucket, point_hash(z, i))  # noqa: F821
        else:
            out[i] = _NAN32
            bad[i // bucket] = np.uint8(1)


@cuda_kernel
def check_kernel(acc, sums, bad):
    b = cuda.grid(1)  # noqa: F821
    if b < sums.size:
        if fold32(acc[b]) != sums[b]:
            bad[b] = np.uint8(1)


# -------------------------------------------------------- array entry points --

def _nbuckets(n, bucket):
    return (n + bucket - 1) // bucket


def lattice_encode(x, codes, sums, status, *, eps, bits, bucket_size, base):
    """Quantise x (float32) into packed codes (uint8), checksums (uint32) and status (uint8) per bucket.

    ``eps`` is a positive float (used as float64); ``base`` the stream base
    word (``stream_base(seed, step, key, PURPOSE_LATTICE)``).  Returns the
    number of buckets with an element whose ``|x/eps|`` is not below 2**52.
    """
    gpu = on_cuda(x, codes, sums, status)
    n = x.size
    if n == 0:
        return 0
    q = 1 << bits
    eps = np.float64(eps)
    if not gpu:
        cpu_launch(encode_cpu, n, x, eps, bits, q, base, bucket_size, codes, sums, status)
        return int(np.count_nonzero(status))
    x, codes, sums, status = as_device(x), as_device(codes), as_device(sums), as_device(status)
    nb = _nbuckets(n, bucket_size)
    acc = zeros(nb, np.uint64, True)
    clear(status)
    tmp = empty(n, np.uint8, True)
    encode_kernel[n](x, eps, q, base, bucket_size, tmp, acc, status)
    pack_kernel[(n + 7) // 8](tmp, bits, codes)
    fold_kernel[nb](acc, sums)
    return int(np.count_nonzero(to_host(status, True)))


def lattice_decode(codes, sums, reference, out, bad, *, eps, bits, bucket_size):
    """out = decoded values (float32) with ``reference`` (float32); bad[b] = 1 for failed buckets.

    Returns the number of failed buckets (checksum mismatch, i.e. the two
    vectors were too far apart somewhere in the bucket, or a reference
    element out of range).
    """
    gpu = on_cuda(codes, sums, reference, out, bad)
    n = out.size
    if n == 0:
        return 0
    q = 1 << bits
    eps = np.float64(eps)
    if not gpu:
        cpu_launch(decode_cpu, n, codes, reference, eps, bits, q, bucket_size, sums, out, bad)
        return int(np.count_nonzero(bad))
    codes, sums, reference, out, bad = (as_device(a) for a in (codes, sums, reference, out, bad))
    nb = _nbuckets(n, bucket_size)
    acc = zeros(nb, np.uint64, True)
    clear(bad)
    decode_kernel[n](codes, reference, eps, bits, q, bucket_size, out, acc, bad)
    check_kernel[nb](acc, sums, bad)
    return int(np.count_nonzero(to_host(bad, True)))
