"""Small helpers shared by the kernel tests."""

import numpy as np


def encode(codec, x, step=0, key=0, residual=None):
    # garbage-filled: every byte of the payload must be written by encode
    out = np.full(codec.max_payload_nbytes(x.size), 0xA5, np.uint8)
    n = codec.encode(x, out, step=step, key=key, residual=residual)
    assert n <= out.size and n % 4 == 0
    return out[:n]


def decode(codec, payload, n):
    out = np.zeros(n, np.float32)
    codec.decode_accumulate(payload, out)
    return out


def roundtrip(codec, x, step=0, key=0, residual=None):
    return decode(codec, encode(codec, x, step, key, residual), x.size)


def bits_equal(a, b):
    """Bitwise equality of float32 arrays (NaN == NaN, -0.0 != 0.0)."""
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32))
