"""Elias-coded QSGD (Alistarh et al., 2017, section 3).

The levels are those of :mod:`.qsgd` (same scale, same rounding, same random
numbers, so a decoded Elias payload equals the decoded fixed-width payload
of the same input bit for bit).  Each bucket's nonzero levels are written as
a bit stream, LSB-first within bytes::

    for each nonzero level l at bucket position j (in index order):
        gamma(j - j_prev)    # j_prev starts at -1, so the gap is >= 1
        sign bit             # 1 = negative
        gamma(|l|)

``gamma(N)`` (N >= 1, L = floor(log2 N)) is L zero bits, a one bit, then the
low L bits of N LSB-first: the Elias-gamma length 2L + 1 with the leading
one doubling as the terminator of the zero run.

Every bucket's stream starts on a byte boundary (at most 7 padding bits per
bucket) and the payload stores the cumulative byte end of each bucket, so
both the encoder (two passes: sizes, prefix sum, write) and the decoder
work on buckets in parallel.  The decoder stops a bucket when no one bit is
left (zero padding cannot start a code).

Worst case: all coordinates nonzero with level s, ``3 + 2*floor(log2 s)``
bits per coordinate (any other pattern is shorter, since
``2*log2(g) + 1 <= 2g - 1`` for a gap g), plus the byte padding.

A bucket with a NaN or inf scale decodes to NaN on all its coordinates
(as in the fixed-width format).
"""

import numba
import numpy as np

from ._dual import core, cpu_launcher, cuda_kernel, fmul32
from .half import f16_to_f32
from .qsgd import scale_ok, signed_level, store_scale

__all__ = ["max_bucket_bits", "bucket_nbits", "bucket_write", "bucket_decode",
           "sizes_cpu", "write_cpu", "decode_cpu", "sizes_kernel", "write_kernel", "decode_kernel",
           "chained_decode_kernel"]

_FF = np.uint64(0xFF)
_U8 = np.uint64(8)
_FLT_MAX = np.float32(np.finfo(np.float32).max)
_ZERO32 = np.float32(0.0)


def max_bucket_bits(m, s):
    """Worst-case stream bits of a bucket of m coordinates with s levels."""
    return m * (3 + 2 * (int(s).bit_length() - 1))


@core(inline=True)
def ilog2(v):
    """floor(log2(v)) for v >= 1."""
    L = 0
    while (v >> (L + 1)) != 0:
        L += 1
    return L


@core
def bucket_nbits(xb, i0, scale, s, stochastic, base):
    """Stream length in bits of one bucket."""
    if not scale_ok(scale):
        return 0
    s32 = np.float32(s)
    nbits = 0
    prev = -1
    for j in range(xb.size):
        lvl = signed_level(xb[j], scale, s32, stochastic, base, i0 + j)
        if lvl != 0:
            nbits += 2 * ilog2(j - prev) + 2 * ilog2(abs(lvl)) + 3
            prev = j
    return nbits


@core(inline=True)
def bw_put(dst, acc, nacc, pos, v, nb):
    """Append the nb <= 32 low bits of v; flush whole bytes to dst."""
    acc |= np.uint64(v) << np.uint64(nacc)
    nacc += nb
    while nacc >= 8:
        dst[pos] = np.uint8(acc & _FF)
        acc >>= _U8
        nacc -= 8
        pos += 1
    return acc, nacc, pos


@core(inline=True)
def bw_gamma(dst, acc, nacc, pos, v):
    L = ilog2(v)
    acc, nacc, pos = bw_put(dst, acc, nacc, pos, 1 << L, L + 1)
    return bw_put(dst, acc, nacc, pos, v - (1 << L), L)


@core
def bucket_write(xb, i0, scale, s, stochastic, base, dst):
    """Write one bucket's stream into dst (exactly its ceil(nbits/8) bytes)."""
    if not scale_ok(scale):
        return
    s32 = np.float32(s)
    acc = np.uint64(0)
    nacc = 0
    pos = 0
    prev = -1
    for j in range(xb.size):
        lvl = signed_level(xb[j], scale, s32, stochastic, base, i0 + j)
        if lvl != 0:
            acc, nacc, pos = bw_gamma(dst, acc, nacc, pos, j - prev)
            acc, nacc, pos = bw_put(dst, acc, nacc, pos, 1 if lvl < 0 else 0, 1)
            acc, nacc, pos = bw_gamma(dst, acc, nacc, pos, abs(lvl))
            prev = j
    if nacc > 0:
        dst[pos] = np.uint8(acc & _FF)


@core(inline=True)
def br_bit(src, p):
    return (int(src[p >> 3]) >> (p & 7)) & 1


@core
def br_gamma(src, p, end):
    """(value, new position); value -1 at the end of the stream, -2 if corrupt."""
    L = 0
    while p < end and br_bit(src, p) == 0:
        L += 1
        p += 1
    if p >= end:
        return -1, p
    p += 1
    if L > 40 or p + L > end:
        return -2, p
    v = 0
    for t in range(L):
        v |= br_bit(src, p + t) << t
    return (1 << L) | v, p + L


@core
def bucket_decode(src, out, scale, s):
    """out += decoded bucket; returns 0, or 1 if the stream is corrupt."""
    if not (scale <= _FLT_MAX):  # NaN or inf scale: the bucket is NaN
        for j in range(out.size):
            out[j] = out[j] + fmul32(_ZERO32, scale)
        return 0
    s32 = np.float32(s)
    end = src.size * 8
    p = 0
    i = -1
    while True:
        gap, p = br_gamma(src, p, end)
        if gap == -1:
            return 0
        i += gap
        if gap < 0 or i >= out.size or p >= end:
            return 1
        neg = br_bit(src, p)
        p += 1
        lvl, p = br_gamma(src, p, end)
        if lvl < 1 or lvl > s:
            return 1
        q = np.float32(lvl) / s32
        if neg:
            q = -q
        out[i] = out[i] + fmul32(q, scale)


BAD_OFFSETS = 2  # decode status of a bucket whose byte range is not inside the stream


@core
def bucket_bounds(ends, b):
    return (0 if b == 0 else int(ends[b - 1])), int(ends[b])


@core
def sizes_item(x, xbits, b, bucket, use_l2, half, s, stochastic, base, scale32, scale16, nbytes):
    """Pass 1 for bucket b: store its scale, nbytes[b] = its stream bytes."""
    store_scale(x, xbits, b, bucket, use_l2, half, scale32, scale16)
    lo = b * bucket
    bits = bucket_nbits(x[lo:min(x.size, lo + bucket)], lo, scale32[b], s, stochastic, base)
    nbytes[b] = (bits + 7) // 8


@core
def write_item(x, b, bucket, s, stochastic, base, scale32, ends, stream):
    p0, p1 = bucket_bounds(ends, b)
    lo = b * bucket
    bucket_write(x[lo:min(x.size, lo + bucket)], lo, scale32[b], s, stochastic, base, stream[p0:p1])


@core
def decode_bucket(stream, ends, b, bucket, scale, s, out, status):
    """status[b] = 0, 1 for a corrupt stream, BAD_OFFSETS when the bucket's byte range is not in the stream."""
    p0, p1 = bucket_bounds(ends, b)
    if p1 < p0 or p1 > stream.size:
        status[b] = BAD_OFFSETS
        return
    lo = b * bucket
    status[b] = bucket_decode(stream[p0:p1], out[lo:min(out.size, lo + bucket)], scale, s)


@core
def decode_item(stream, ends, b, bucket, scale32, s, out, status):
    decode_bucket(stream, ends, b, bucket, scale32[b], s, out, status)


@core
def chained_decode_item(buf, words, floats, halves, records, slot, layout, b, bucket, half, s, out, status):
    """Bucket b of the payload whose (start, length) only the device knows: ``records[slot]``, from
    following the payloads' header chain. ``layout`` = the byte offsets of the scales, the bucket ends and
    the stream inside the payload; ``words``/``floats``/``halves``: ``buf`` viewed as uint32/float32/uint16.
    A payload whose start or length cannot hold that layout is left alone (status 0): the headers, read
    after the decode, reject it on the host."""
    start, nbytes = records[slot, 0], records[slot, 1]
    scales_at, ends_at, stream_at = layout
    if start < 0 or start % 4 != 0 or nbytes < stream_at or start + nbytes > buf.size:
        status[b] = 0
        return
    nb = status.size
    first_end = (start + ends_at) // 4
    if half:
        scale = f16_to_f32(int(halves[(start + scales_at) // 2 + b]))
    else:
        scale = floats[(start + scales_at) // 4 + b]
    decode_bucket(buf[start + stream_at:start + nbytes], words[first_end:first_end + nb], b, bucket, scale, s,
                  out, status)


@core
def tally_status(status, b, counters):
    """Adds bucket b's status to a payload's counters: [offsets out of the stream, corrupt buckets,
    nb - first corrupt bucket (a maximum, so that zeroed counters need no sentinel)]."""
    if status[b] == BAD_OFFSETS:
        counters[0] += 1
    elif status[b]:
        counters[1] += 1
        counters[2] = max(counters[2], status.size - b)


# ------------------------------------------------------------ CPU launchers --

@cpu_launcher
def sizes_cpu(x, xbits, bucket, use_l2, half, s, stochastic, base, scale32, scale16, nbytes):
    for b in numba.prange(nbytes.size):
        sizes_item(x, xbits, b, bucket, use_l2, half, s, stochastic, base, scale32, scale16, nbytes)


@cpu_launcher
def write_cpu(x, bucket, s, stochastic, base, scale32, ends, stream):
    for b in numba.prange(ends.size):
        write_item(x, b, bucket, s, stochastic, base, scale32, ends, stream)


@cpu_launcher
def decode_cpu(stream, ends, bucket, scale32, s, out, status):
    for b in numba.prange(ends.size):
        decode_item(stream, ends, b, bucket, scale32, s, out, status)


# ----------------------------------------------------------- CUDA kernels --

@cuda_kernel
def sizes_kernel(x, xbits, bucket, use_l2, half, s, stochastic, base, scale32, scale16, nbytes):
    b = cuda.grid(1)  # noqa: F821
    if b < nbytes.size:
        sizes_item(x, xbits, b, bucket, use_l2, half, s, stochastic, base, scale32, scale16, nbytes)


@cuda_kernel
def write_kernel(x, bucket, s, stochastic, base, scale32, ends, stream):
    b = cuda.grid(1)  # noqa: F821
    if b < ends.size:
        write_item(x, b, bucket, s, stochastic, base, scale32, ends, stream)


@cuda_kernel
def decode_kernel(stream, ends, bucket, scale32, s, out, status):
    b = cuda.grid(1)  # noqa: F821
    if b < ends.size:
        decode_item(stream, ends, b, bucket, scale32, s, out, status)


@cuda_kernel
def chained_decode_kernel(buf, words, floats, halves, records, slot, layout, bucket, half, s, out, status):
    b = cuda.grid(1)  # noqa: F821
    if b < status.size:
        chained_decode_item(buf, words, floats, halves, records, slot, layout, b, bucket, half, s, out, status)


@cuda_kernel
def narrow_ends_kernel(cum, ends):
    """ends (uint32) = cumulative byte ends (int64, checked below 2**32 by the caller)."""
    b = cuda.grid(1)  # noqa: F821
    if b < ends.size:
        ends[b] = cum[b]


@cuda_kernel
def tally_kernel(status, counters):
    b = cuda.grid(1)  # noqa: F821
    if b < status.size and status[b]:
        if status[b] == BAD_OFFSETS:
            cuda.atomic.add(counters, 0, 1)  # noqa: F821
        else:
            cuda.atomic.add(counters, 1, 1)  # noqa: F821
            cuda.atomic.max(counters, 2, status.size - b)  # noqa: F821
