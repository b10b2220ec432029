"""Counter-based random numbers: the same bits on every device and rank.

A stream is identified by ``(seed, step, key, purpose)``; its base word is
computed on the host by :func:`stream_base` (pure Python integers).  Element
``i`` of the stream is ``mix64(base + (i + 1) * GOLDEN)`` where ``mix64`` is
the splitmix64 finaliser.  :func:`uniform` takes the top 24 bits of that word
as a float32 in [0, 1) (an exact multiple of 2**-24).

QSGD's rounding, one uniform per coordinate, uses a *paired* stream: word
``p`` serves elements ``2p`` (bits 40..63) and ``2p + 1`` (bits 8..31), two
disjoint 24-bit fields of one splitmix64 output (:func:`paired_uniform`
for one element; :func:`paired_fields` draws a run of them in one
vectorised loop).  It halves the hashing, the largest part of QSGD
encoding after the levels themselves.

``key`` is a uint32 the adapters derive from a stable tensor name (crc32 of
the name); ``purpose`` separates the streams that one codec uses for
different things (rounding, sampling, random-k strata).
"""

import numpy as np

from ._dual import core

__all__ = ["stream_base", "mix64", "uniform", "random_u32", "paired_uniform", "paired_fields", "field_uniform",
           "keyed_stream_base", "mix64_py", "uniform_py", "paired_uniform_py",
           "PURPOSE_ROUNDING", "PURPOSE_SAMPLE", "PURPOSE_RANDOMK"]

PURPOSE_ROUNDING = 1
PURPOSE_SAMPLE = 2
PURPOSE_RANDOMK = 3
# Taken elsewhere, listed so a new stream does not reuse them: 8 the lattice
# quantiser's dither (kernels/lattice.py), 9 SwarmSGD's matchings (torch/swarm.py).

_MASK = (1 << 64) - 1
_GOLDEN_INT = 0x9E3779B97F4A7C15
_M1_INT = 0xBF58476D1CE4E5B9
_M2_INT = 0x94D049BB133111EB

_GOLDEN = np.uint64(_GOLDEN_INT)
_M1 = np.uint64(_M1_INT)
_M2 = np.uint64(_M2_INT)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S32 = np.uint64(32)
_S40 = np.uint64(40)
_S8 = np.uint64(8)
_LOW24 = np.uint64(0xFFFFFF)
_ONE = np.uint64(1)
_INV24 = np.float32(2.0 ** -24)


def mix64_py(z):
    """splitmix64 finaliser on Python ints (reference implementation)."""
    z &= _MASK
    z = ((z ^ (z >> 30)) * _M1_INT) & _MASK
    z = ((z ^ (z >> 27)) * _M2_INT) & _MASK
    return z ^ (z >> 31)


def _check_u(name, v, bits):
    v = int(v)
    if v < 0 or v >= (1 << bits):
        raise ValueError(f"{name} must be an integer in [0, 2**{bits}), got {v}")
    return v


def stream_base(seed, step, key, purpose):
    """uint64 base word of the stream (seed, step, key, purpose)."""
    seed = _check_u("seed", seed, 64)
    step = _check_u("step", step, 64)
    key = _check_u("key", key, 32)
    h = mix64_py(seed + _GOLDEN_INT)
    h = mix64_py(h ^ step)
    h = mix64_py(h ^ ((key << 8) | int(purpose)))
    return np.uint64(h)


def seed_word(seed):
    """The first word of every stream of ``seed``: :func:`payload_stream_base` goes on from it."""
    return np.uint64(mix64_py(_check_u("seed", seed, 64) + _GOLDEN_INT))


def uniform_py(base, i):
    """Reference for :func:`uniform` on Python ints."""
    h = mix64_py(int(base) + (i + 1) * _GOLDEN_INT)
    return (h >> 40) * 2.0 ** -24


def paired_uniform_py(base, i):
    """Reference for :func:`paired_uniform` on Python ints."""
    h = mix64_py(int(base) + (i // 2 + 1) * _GOLDEN_INT)
    return ((h >> 8) & 0xFFFFFF if i % 2 else h >> 40) * 2.0 ** -24


@core(inline=True)
def mix64(z):
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@core(inline=True)
def payload_stream_base(meta, seed_w, purpose):
    """:func:`stream_base` with step and key read from 12 payload bytes (uint64 and uint32, little-endian).

    ``seed_w`` is :func:`seed_word`; a kernel computes the base from a
    payload on the device, so a decode need not read the payload's step and key back.
    """
    step = np.uint64(0)
    for i in range(8):
        step |= np.uint64(meta[i]) << np.uint64(8 * i)
    key = np.uint64(0)
    for i in range(4):
        key |= np.uint64(meta[8 + i]) << np.uint64(8 * i)
    return keyed_stream_base(seed_w, step, key, purpose)


@core(inline=True)
def keyed_stream_base(seed_w, step, key, purpose):
    """:func:`stream_base` on the device from :func:`seed_word` and the step and key (uint64)."""
    return mix64(mix64(seed_w ^ step) ^ ((key << _S8) | np.uint64(purpose)))


@core(inline=True)
def random_u32(base, i):
    """32 random bits (as uint64) of element ``i`` (int) of the stream."""
    return mix64(base + (np.uint64(i) + _ONE) * _GOLDEN) >> _S32


@core(inline=True)
def uniform(base, i):
    """float32 uniform in [0, 1) of element ``i`` (int) of the stream."""
    return np.float32(mix64(base + (np.uint64(i) + _ONE) * _GOLDEN) >> _S40) * _INV24


@core(inline=True)
def paired_uniform(base, i):
    """float32 uniform of element ``i`` (int) of the paired stream."""
    h = mix64(base + (np.uint64(i >> 1) + _ONE) * _GOLDEN)
    if i & 1:
        return np.float32((h >> _S8) & _LOW24) * _INV24
    return np.float32(h >> _S40) * _INV24


@core(inline=True)
def paired_fields(base, p0, dst):
    """dst[j] = the 24-bit integer behind element ``2*p0 + j`` of the paired stream (j < dst.size, even).

    :func:`field_uniform` turns it into the uniform :func:`paired_uniform`
    gives.  A separate loop over words, stepping the counter by addition,
    vectorises (one multiply less per word), and lets the caller's loop over
    coordinates run without the pairs' interleaving: QSGD-4 encoding of 1M
    values on one thread took 0.55 ms with one hash per pair inside the
    coordinate loop, 0.47 ms this way.
    """
    z = base + (np.uint64(p0) + _ONE) * _GOLDEN
    for t in range(dst.size // 2):
        h = mix64(z)
        z += _GOLDEN
        dst[2 * t] = np.uint32(h >> _S40)
        dst[2 * t + 1] = np.uint32((h >> _S8) & _LOW24)


@core(inline=True)
def field_uniform(f):
    """float32 uniform in [0, 1) of a 24-bit field from :func:`paired_fields`."""
    return np.float32(np.int32(f)) * _INV24
