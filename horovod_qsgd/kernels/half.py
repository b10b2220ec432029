"""float32 <-> IEEE binary16 conversions as kernel cores (pure arithmetic).

No bit casts of scalars are needed, so the same source runs on the CPU, on
CUDA and in the CUDA simulator.  Every step is exact in float32 (scaling by a
power of two, Sterbenz subtraction), so the results match numpy bit for bit:

* :func:`f32_to_f16_rne` equals ``np.float32(v).astype(np.float16)``
  (round to nearest even, overflow to inf, NaN to the quiet NaN 0x7e00);
* :func:`f32_to_f16_up` rounds a non-negative value *up* (used for QSGD
  scales so that ``|x| / scale <= 1`` still holds after rounding); values
  above 65504 become inf;
* :func:`f16_to_f32` widens exactly;
* :func:`bits_to_f32` is the float32 whose bit pattern is a given uint32
  (a scalar bit cast written as arithmetic; NaN payloads become the
  canonical NaN).
"""

import math

import numpy as np

from ._dual import core

__all__ = ["f32_to_f16_rne", "f32_to_f16_up", "f16_to_f32", "bits_to_f32"]

# _POW2[e + 40] == 2.0 ** e for e in [-40, 40] (a constant array on CUDA)
_POW2 = np.array([2.0 ** e for e in range(-40, 41)], dtype=np.float32)
_OFF = 40
# _POW2_WIDE[e] == 2.0 ** (e - 150) for e in [1, 254]; [0] == 2.0 ** -149
_POW2_WIDE = np.array([2.0 ** -149] + [2.0 ** (e - 150) for e in range(1, 255)], dtype=np.float32)
_HALF = np.float32(0.5)
_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)
_F1024 = np.float32(1024.0)
_MIN_NORMAL = np.float32(2.0 ** -14)
_TWO24 = np.float32(2.0 ** 24)
_MAX_F16 = np.float32(65504.0)
_RNE_OVERFLOW = np.float32(65520.0)
_INF = np.float32(np.inf)
_NAN = np.float32(np.nan)


@core
def _exponent(a):
    """e with 2**e <= a < 2**(e+1), for 2**-14 <= a < 2**16."""
    e = 15
    while _POW2[e + _OFF] > a:
        e -= 1
    return e


@core
def _round_half_even(y):
    f = math.floor(y)
    d = y - np.float32(f)
    q = int(f)
    if d > _HALF or (d == _HALF and (q & 1) == 1):
        q += 1
    return q


@core
def f32_to_f16_rne(v):
    """binary16 bits (int) of float32 ``v``, round to nearest even."""
    sign = 0
    if v < _ZERO or (v == _ZERO and math.copysign(_ONE, v) < _ZERO):
        sign = 0x8000
    a = abs(v)
    if a != a:
        return 0x7E00 | sign
    if a >= _RNE_OVERFLOW:
        return 0x7C00 | sign
    if a < _MIN_NORMAL:
        return _round_half_even(a * _TWO24) | sign
    e = _exponent(a)
    y = (a / _POW2[e + _OFF] - _ONE) * _F1024
    return (((e + 15) << 10) + _round_half_even(y)) | sign


@core
def f32_to_f16_up(a):
    """binary16 bits (int) of the smallest half >= ``a`` (``a`` >= 0 or NaN)."""
    if a != a:
        return 0x7E00
    if a > _MAX_F16:
        return 0x7C00
    if a < _MIN_NORMAL:
        return int(math.ceil(a * _TWO24))
    e = _exponent(a)
    y = (a / _POW2[e + _OFF] - _ONE) * _F1024
    return ((e + 15) << 10) + int(math.ceil(y))


@core(inline=True)
def f16_to_f32(h):
    """float32 value of binary16 bits ``h`` (int)."""
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        v = np.float32(m) * _POW2[_OFF - 24]
    elif e == 31:
        v = _INF if m == 0 else _NAN
    else:
        v = np.float32(m + 1024) * _POW2[e - 25 + _OFF]
    if (h & 0x8000) != 0:
        v = -v
    return v


@core
def bits_to_f32(u):
    """float32 with IEEE bit pattern ``u`` (uint32 or int)."""
    u = int(u)
    e = (u >> 23) & 0xFF
    m = u & 0x7FFFFF
    if e == 255:
        v = _INF if m == 0 else _NAN
    elif e == 0:
        v = np.float32(m) * _POW2_WIDE[0]
    else:
        v = np.float32(m | 0x800000) * _POW2_WIDE[e]
    if (u & 0x80000000) != 0:
        v = -v
    return v
