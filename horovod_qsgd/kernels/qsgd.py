"""QSGD quantisation (Alistarh et al., 2017) with fixed-width bit packing.

Per bucket of ``B`` consecutive coordinates a *scale* is computed (max |x| or
the L2 norm, see :func:`bucket_scale`) and stored (float32, or float16
rounded up).  Each coordinate gets a signed level ``l`` in ``[-s, s]`` with
``s = 2**(bits-1) - 1``::

    r = |x_i| / scale * s            (float32, with the *stored* scale)
    l = floor(r + (1 - 2**-24 - u_i))      stochastic (unbiased), u_i from rng
    l = floor(r) + [r - floor(r) >= 1/2]   deterministic (biased)
    l = min(l, s) * sign(x_i)

``u_i`` is element ``i`` of the paired stream (:mod:`.rng`: one hash
serves two coordinates), a multiple of 2**-24.  In exact arithmetic the
stochastic rule rounds the fractional part ``f = r - floor(r)`` up with
probability ``floor(2**24 f) / 2**24``: ``f`` itself when it is a multiple of
2**-24 (always for r >= 1/2), otherwise a bias below 2**-24 of one level.
The float32 sum adds one more: a sum within half a unit in the last place
below an integer is rounded onto it, so a coordinate rounds up with an extra
probability below ``ulp(s)/2`` (2**-22 of one level for 4 bits, 2**-18 for
8 bits).  The sum is what makes the rule cheap, an addition and a truncation
instead of a floor, a subtraction and a compare: QSGD-4 encoding of 1M
values on one thread took 0.54 ms with ``u_i < f``, 0.49 ms this way, and of
4M Gaussian values' codes at 2, 3 and 4 bits none differed, at 8 bits 4 did.

The code of a coordinate is the offset level ``l + s`` in
``bits`` bits (``0 .. 2s``; 2 bits is ternary {0, 1, 2}).  Codes are packed
LSB-first at exactly ``bits`` bits each, so a group of 8 coordinates is
exactly ``bits`` bytes (one thread per group, no races); the last partial
group of ``m`` coordinates takes ``ceil(m*bits/8)`` bytes, zero padded.

Decoding adds ``(l / s) * scale`` (float32) to the output.

Buckets whose input contains NaN or Inf get a NaN scale and all-zero
levels, so they decode to NaN (0 * NaN): a broken gradient stays visibly
broken instead of silently becoming zero.  A scale that overflows (L2 norm
of huge finite values above float32 max, or above 65504 with float16
scales) becomes inf and also decodes to NaN.  A zero bucket has scale 0 and
decodes to zeros.

Launch structure: CPU launchers run ``prange`` over chunks that hold whole
buckets and whole groups (computing scales, then codes into a chunk-local
scratch, then packing); CUDA runs one thread per bucket (scales), per
element (codes into a scratch array) and per group (packing, decoding).
Both call the same cores.
"""

import math

import numba
import numpy as np

from ._dual import core, cpu_launcher, cuda_kernel, fmul32, fmul64
from .half import bits_to_f32, f16_to_f32, f32_to_f16_up
from .rng import field_uniform, paired_fields, paired_uniform

__all__ = ["bucket_scale", "store_scale", "scaled_magnitude", "stochastic_floor", "rounded_level_f32",
           "rounded_code", "signed_level", "level_code", "bucket_codes", "pack_group", "pack_span", "decode_span",
           "encode_fixed_cpu", "decode_fixed_cpu", "scales_from_f16_cpu",
           "scale_kernel", "code_kernel", "pack_kernel", "decode_kernel", "f16_scale_kernel"]

_FLT_MAX = np.float32(np.finfo(np.float32).max)
_DBL_MAX = np.float64(np.finfo(np.float64).max)
_ZERO32 = np.float32(0.0)
_HALF32 = np.float32(0.5)
_ONE32 = np.float32(1.0)
_TOP24 = np.float32(1.0 - 2.0 ** -24)  # the largest uniform: 1 - u is then a uniform too
_ZERO64 = np.float64(0.0)
_NAN32 = np.float32(np.nan)
_FF = np.uint64(0xFF)
_ABS_MASK = np.uint32(0x7FFFFFFF)
_EXP_MASK = np.uint32(0x7F800000)
_U2 = np.uint8(2)
_U4 = np.uint8(4)
_U6 = np.uint8(6)


@core
def bucket_scale(xb, xbits, use_l2):
    """Raw scale of the bucket xb: max |x| or the L2 norm; NaN if any non-finite.

    ``xbits`` is the uint32 view of ``xb``: the max norm is the integer max
    of the magnitude bit patterns (monotone for non-negative floats, and it
    vectorises, unlike a NaN-aware float max).  The L2 norm is a sequential
    float64 sum in index order, then sqrt, rounded to float32 (never below
    max |x|: squares are exact in float64 and rounding is monotone).
    """
    if use_l2:
        acc = _ZERO64
        for j in range(xb.size):
            v = np.float64(xb[j])
            acc = acc + fmul64(v, v)
        # inf or NaN inputs make acc inf/NaN; finite float32 squares cannot
        # overflow a float64 sum
        return np.float32(math.sqrt(acc)) if acc <= _DBL_MAX else _NAN32
    m = np.uint32(0)
    for j in range(xbits.size):
        m = max(m, xbits[j] & _ABS_MASK)
    if m >= _EXP_MASK:
        return _NAN32
    return bits_to_f32(m)


@core
def store_scale(x, xbits, b, bucket, use_l2, half, scale32, scale16):
    """Compute bucket b's scale; write the stored value (float32) and fp16 bits."""
    lo = b * bucket
    hi = min(x.size, lo + bucket)
    raw = bucket_scale(x[lo:hi], xbits[lo:hi], use_l2)
    if half:
        h = f32_to_f16_up(raw)
        scale16[b] = h
        scale32[b] = f16_to_f32(h)
    else:
        scale32[b] = raw


@core(inline=True)
def scale_ok(scale):
    """Levels are computed only for a positive finite scale (else all 0)."""
    return scale > _ZERO32 and scale <= _FLT_MAX


@core(inline=True)
def scaled_magnitude(xi, scale, s32):
    """r = |xi| / scale * s in float32."""
    # fmul32: NVVM would fuse this product into the addition that follows (an
    # FMA skips rounding r), and the GPU's codes would differ from the CPU's
    return fmul32(abs(xi) / scale, s32)


@core(inline=True)
def stochastic_floor(r, u):
    """floor(r + (1 - 2**-24 - u)) for r >= 0 (truncation is floor there, and vectorises)."""
    # u = field * 2**-24 is exact, so NVVM fusing that product into this
    # subtraction (an FMA) gives the same bits as the CPU
    return np.int32(r + (_TOP24 - u))


@core(inline=True)
def rounded_level_f32(xi, scale, s32, stochastic, u):
    """Signed QSGD level of xi, as an exact float32 integer, for a scale with ``scale_ok(scale)``."""
    r = scaled_magnitude(xi, scale, s32)
    if stochastic:
        lvl = min(np.float32(stochastic_floor(r, u)), s32)
    else:
        floor_r = np.float32(np.int32(r))
        lvl = min(floor_r + (_ONE32 if r - floor_r >= _HALF32 else _ZERO32), s32)
    return -lvl if xi < _ZERO32 else lvl


@core(inline=True)
def rounded_code(xi, scale, s32, u):
    """Offset code ``level + s`` of xi, stochastically rounded with the uniform ``u``.

    The sign is applied in float32 lanes: integer arithmetic there made
    numba widen the lanes to int64, and the encode loop ran 30% slower.
    """
    return np.uint8(np.int32(s32 + rounded_level_f32(xi, scale, s32, True, u)))


@core(inline=True)
def signed_level(xi, scale, s32, stochastic, base, i):
    """Signed QSGD level of x[i] = xi for a scale with ``scale_ok(scale)``."""
    return int(rounded_level_f32(xi, scale, s32, stochastic, paired_uniform(base, i) if stochastic else _ZERO32))


@core(inline=True)
def level_code(x, i, scale, s, s32, stochastic, base):
    """Offset code ``level + s`` (0 .. 2s) of x[i]; ``s`` when the scale is unusable."""
    if scale_ok(scale):
        return signed_level(x[i], scale, s32, stochastic, base, i) + s
    return s


@core
def bucket_codes(xb, i0, scale, s, stochastic, base, dst, fields):
    """dst[j] = level code of xb[j] (global index i0 + j), one bucket.

    ``fields`` is scratch for the random stream, at least ``xb.size``
    uint32.  Loops run over slices with ``range(size)``: a possibly negative
    index makes numba emit wraparound code, which stops LLVM vectorising.
    """
    s32 = np.float32(s)
    m = xb.size
    if not scale_ok(scale):
        for j in range(m):
            dst[j] = np.uint8(s)
    elif stochastic and i0 % 2 == 0:
        # one hash per pair of coordinates (rng.paired_fields), then one
        # vectorised loop over the coordinates
        even = m - m % 2
        u = fields[:even]
        paired_fields(base, i0 // 2, u)
        for j in range(even):
            dst[j] = rounded_code(xb[j], scale, s32, field_uniform(u[j]))
        if m % 2:
            dst[m - 1] = np.uint8(signed_level(xb[m - 1], scale, s32, True, base, i0 + m - 1) + s)
    else:
        for j in range(m):
            dst[j] = np.uint8(signed_level(xb[j], scale, s32, stochastic, base, i0 + j) + s)


@core
def pack_group(src, s0, m, bits, codes, o):
    """Pack the m <= 8 codes src[s0:s0+m] LSB-first into codes[o : o+ceil(m*bits/8)]."""
    word = np.uint64(0)
    for j in range(m):
        word |= np.uint64(src[s0 + j]) << np.uint64(j * bits)
    for t in range((m * bits + 7) // 8):
        codes[o + t] = np.uint8((word >> np.uint64(8 * t)) & _FF)


@core
def pack_span(src, bits, dst):
    """Pack the codes src (starting at a group boundary) into dst.

    The same bytes as :func:`pack_group` on each group; for bits dividing 8
    it packs byte by byte, which vectorises.
    """
    m = src.size
    if bits == 8:
        for j in range(m):
            dst[j] = src[j]
    elif bits == 4:
        for t in range(m // 2):
            dst[t] = src[2 * t] | (src[2 * t + 1] << _U4)
        if m % 2:
            dst[m // 2] = src[m - 1]
    elif bits == 2:
        for t in range(m // 4):
            dst[t] = (src[4 * t] | (src[4 * t + 1] << _U2) | (src[4 * t + 2] << _U4)
                      | (src[4 * t + 3] << _U6))
        if m % 4:
            v = np.uint8(0)
            for q in range(m % 4):
                v |= src[(m // 4) * 4 + q] << np.uint8(2 * q)
            dst[m // 4] = v
    else:
        for g in range((m + 7) // 8):
            pack_group(src, g * 8, min(8, m - g * 8), bits, dst, g * bits)


@core
def decode_span(codes, i0, out, scale, s, bits):
    """out[j] += (level / s) * scale for the codes of coordinates i0 + j.

    ``out`` is an output slice within one bucket; ``codes`` is the whole
    packed code array (a code spans at most two bytes).  Byte-aligned runs
    of 8-, 4- and 2-bit codes take loops without gathers (they vectorise);
    the result is the same either way.
    """
    s32 = np.float32(s)
    mask = (1 << bits) - 1
    m = out.size
    done = 0
    if (i0 * bits) % 8 == 0:
        p0 = (i0 * bits) >> 3
        if bits == 8:
            cb = codes[p0:p0 + m]
            for j in range(m):
                out[j] = out[j] + fmul32(np.float32(int(cb[j]) - s) / s32, scale)
            done = m
        elif bits == 4:
            cb = codes[p0:p0 + m // 2]
            for t in range(m // 2):
                c = int(cb[t])
                out[2 * t] = out[2 * t] + fmul32(np.float32((c & 15) - s) / s32, scale)
                out[2 * t + 1] = out[2 * t + 1] + fmul32(np.float32((c >> 4) - s) / s32, scale)
            done = (m // 2) * 2
        elif bits == 2:
            cb = codes[p0:p0 + m // 4]
            for t in range(m // 4):
                c = int(cb[t])
                for q in range(4):
                    out[4 * t + q] = out[4 * t + q] + fmul32(
                        np.float32(((c >> (2 * q)) & 3) - s) / s32, scale)
            done = (m // 4) * 4
    last = codes.size - 1
    for j in range(done, m):
        bp = (i0 + j) * bits
        p = bp >> 3
        w = int(codes[p]) | (int(codes[min(p + 1, last)]) << 8)
        c = (w >> (bp & 7)) & mask
        out[j] = out[j] + fmul32(np.float32(c - s) / s32, scale)


@core
def scale_from_f16(scale16, scale32, b):
    scale32[b] = f16_to_f32(int(scale16[b]))


# ------------------------------------------------------------ CPU launchers --

@cpu_launcher
def encode_fixed_cpu(x, xbits, bucket, use_l2, half, s, bits, stochastic, base,
                     scale32, scale16, codes, chunk):
    """Scales, codes and packing fused per chunk.

    ``chunk`` is a multiple of lcm(bucket, 8), so chunks hold whole buckets
    and whole groups; codes go through a chunk-local uint8 scratch (packing
    4-bit codes as they were computed instead was no faster once the
    coordinate loop vectorised).
    """
    n = x.size
    nchunks = (n + chunk - 1) // chunk
    for c in numba.prange(nchunks):
        lo = c * chunk
        hi = min(n, lo + chunk)
        tmp = np.empty(hi - lo, np.uint8)
        fields = np.empty(bucket, np.uint32)
        for b in range(lo // bucket, (hi + bucket - 1) // bucket):
            store_scale(x, xbits, b, bucket, use_l2, half, scale32, scale16)
            b0 = b * bucket
            b1 = min(n, b0 + bucket)
            bucket_codes(x[b0:b1], b0, scale32[b], s, stochastic, base, tmp[b0 - lo:b1 - lo], fields)
        pack_span(tmp, bits, codes[(lo // 8) * bits:(lo * bits + (hi - lo) * bits + 7) // 8])


@cpu_launcher
def decode_fixed_cpu(codes, bucket, scale32, s, bits, out, chunk):
    """out += decoded; ``chunk`` (elements) is a multiple of ``bucket``."""
    n = out.size
    nchunks = (n + chunk - 1) // chunk
    for c in numba.prange(nchunks):
        lo = c * chunk
        hi = min(n, lo + chunk)
        for b in range(lo // bucket, (hi + bucket - 1) // bucket):
            b0 = b * bucket
            decode_span(codes, b0, out[b0:min(n, b0 + bucket)], scale32[b], s, bits)


@cpu_launcher
def scales_from_f16_cpu(scale16, scale32):
    for b in numba.prange(scale16.size):
        scale_from_f16(scale16, scale32, b)


# ----------------------------------------------------------- CUDA kernels --

@cuda_kernel
def scale_kernel(x, xbits, nb, bucket, use_l2, half, scale32, scale16):
    b = cuda.grid(1)  # noqa: F821 (bound by cuda_kernel)
    if b < nb:
        store_scale(x, xbits, b, bucket, use_l2, half, scale32, scale16)


@cuda_kernel
def code_kernel(x, bucket, scale32, s, stochastic, base, tmp):
    i = cuda.grid(1)  # noqa: F821
    if i < x.size:
        tmp[i] = level_code(x, i, scale32[i // bucket], s, np.float32(s), stochastic, base)


@cuda_kernel
def pack_kernel(tmp, bits, codes):
    g = cuda.grid(1)  # noqa: F821
    n = tmp.size
    if g < (n + 7) // 8:
        pack_group(tmp, g * 8, min(8, n - g * 8), bits, codes, g * bits)


@cuda_kernel
def decode_kernel(codes, bucket, scale32, s, bits, out):
    """One thread per group of 8 (split at bucket boundaries)."""
    g = cuda.grid(1)  # noqa: F821
    n = out.size
    if g < (n + 7) // 8:
        i = g * 8
        end = min(n, i + 8)
        while i < end:
            b = i // bucket
            j = min(end, (b + 1) * bucket)
            decode_span(codes, i, out[i:j], scale32[b], s, bits)
            i = j


@cuda_kernel
def f16_scale_kernel(scale16, scale32):
    b = cuda.grid(1)  # noqa: F821
    if b < scale16.size:
        scale_from_f16(scale16, scale32, b)
