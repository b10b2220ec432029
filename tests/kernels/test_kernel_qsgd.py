"""QSGD (fixed-width and Elias): round trips, sizes, statistics, edge cases."""

import math

import numpy as np
import pytest

from horovod_qsgd.codecs import HEADER_NBYTES, QSGDCodec

from .helpers import bits_equal, decode, encode, roundtrip

SIZES = [1, 7, 8, 9, 63, 511, 512, 513, 1000, 4099]


def _x(n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 50.0], n)).astype(np.float32)


def _stored_scales(codec, payload, n):
    nb = (n + codec.bucket_size - 1) // codec.bucket_size
    if codec.scale_dtype == "float16":
        return payload[HEADER_NBYTES:HEADER_NBYTES + 2 * nb].view(np.float16).astype(np.float32)
    return payload[HEADER_NBYTES:HEADER_NBYTES + 4 * nb].view(np.float32)


def _expected_nbytes(n, bits, bucket, scale_bytes):
    nb = math.ceil(n / bucket)
    a4 = lambda v: (v + 3) // 4 * 4  # noqa: E731
    return a4(HEADER_NBYTES + a4(nb * scale_bytes) + math.ceil(n * bits / 8))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bits,bucket,norm,scale_dtype", [
    (2, 64, "max", "float32"), (4, 512, "max", "float32"), (8, 100, "l2", "float32"),
    (3, 37, "l2", "float16"), (5, 8, "max", "float16"), (7, 1, "max", "float32")])
def test_fixed_roundtrip_error_is_within_one_level(n, bits, bucket, norm, scale_dtype):
    codec = QSGDCodec(bits=bits, bucket_size=bucket, norm=norm, scale_dtype=scale_dtype)
    x = _x(n, seed=n + bits)
    payload = encode(codec, x, step=3, key=9)
    assert payload.size == codec.max_payload_nbytes(n) == _expected_nbytes(
        n, bits, bucket, 2 if scale_dtype == "float16" else 4)
    out = decode(codec, payload, n)
    scales = _stored_scales(codec, payload, n)
    step = np.repeat(scales, bucket)[:n] / codec.levels  # one level, per coordinate
    assert np.all(scales >= np.array([np.abs(x[i:i + bucket]).max() for i in range(0, n, bucket)]))
    assert np.all(np.abs(out - x) <= step * (1 + 1e-5) + 1e-30)
    # decode accumulates
    out2 = np.full(n, 1.5, np.float32)
    codec.decode_accumulate(payload, out2)
    assert bits_equal(out2, np.float32(1.5) + out)


def test_bits_per_coordinate_of_the_docstring_example():
    codec = QSGDCodec(bits=4, bucket_size=512)
    n = 512 * 1000
    body = codec.max_payload_nbytes(n) - HEADER_NBYTES
    assert body * 8 / n == 4 + 32 / 512
    assert abs(32 / (4 + 32 / 512) - 7.88) < 0.01


def test_zero_buckets_and_lone_nonzero():
    for norm in ("max", "l2"):
        for enc in ("fixed", "elias"):
            codec = QSGDCodec(bits=4, bucket_size=16, norm=norm, encoding=enc)
            x = np.zeros(64, np.float32)
            x[40] = -0.37  # bucket 2 has exactly one nonzero
            out = roundtrip(codec, x)
            assert bits_equal(out[:32], np.zeros(32))  # zero buckets decode to +0, no NaN
            assert out[40] == np.float32(-0.37)  # scale == |x|: level s, exact
            assert np.count_nonzero(out) == 1


@pytest.mark.parametrize("enc", ["fixed", "elias"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_input_makes_its_bucket_nan(enc, bad):
    codec = QSGDCodec(bits=4, bucket_size=8, encoding=enc)
    x = _x(40)
    x[13] = bad
    out = roundtrip(codec, x)
    assert np.all(np.isnan(out[8:16]))
    assert not np.any(np.isnan(out[:8])) and not np.any(np.isnan(out[16:]))


def test_fp16_scale_overflow_is_nan_not_zero():
    codec = QSGDCodec(bits=4, bucket_size=4, scale_dtype="float16")
    x = np.array([1e5, 1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 4.0], np.float32)
    out = roundtrip(codec, x)
    assert np.all(np.isnan(out[:4])) and np.all(np.isfinite(out[4:]))


def test_stochastic_rounding_is_reproducible_and_step_dependent():
    codec = QSGDCodec(bits=3, bucket_size=64)
    x = _x(1000)
    a = encode(codec, x, step=5, key=1)
    assert np.array_equal(a, encode(codec, x, step=5, key=1))
    assert not np.array_equal(a, encode(codec, x, step=6, key=1))
    assert not np.array_equal(a, encode(codec, x, step=5, key=2))
    assert not np.array_equal(a, encode(QSGDCodec(bits=3, bucket_size=64, seed=1), x, step=5, key=1))


def test_deterministic_rounding_is_deterministic_and_biased():
    codec = QSGDCodec(bits=2, bucket_size=4, rounding="deterministic")
    x = np.array([1.0, 0.3, -0.3, 0.6] * 64, np.float32)
    a = encode(codec, x, step=1)
    assert np.array_equal(a, encode(codec, x, step=2))
    out = decode(codec, a, x.size)
    # round to nearest of {0, 1}: 0.3 -> 0, 0.6 -> 1 on every step: biased
    assert np.all(out[1::4] == 0) and np.all(out[3::4] == 1)


def test_stochastic_rounding_is_unbiased():
    """Mean of T independent quantisations converges to x.

    Per coordinate the level rounding has variance <= 1/4 level^2, so the
    mean of T draws is within 5 sigma = 5 * (scale/s) / (2 sqrt(T)).
    """
    n, T = 256, 2000
    codec = QSGDCodec(bits=2, bucket_size=64)
    x = _x(n, seed=3)
    acc = np.zeros(n, np.float64)
    scales = None
    for t in range(T):
        p = encode(codec, x, step=t, key=4)
        scales = _stored_scales(codec, p, n)
        acc += decode(codec, p, n)
    level = np.repeat(scales, 64) / codec.levels
    bound = 5 * level / (2 * math.sqrt(T)) + 1e-7 * np.abs(x)
    assert np.all(np.abs(acc / T - x) <= bound)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_stochastic_rule_is_the_float32_sum_of_the_docstring(bits):
    """Level of r = |x| / scale * s for uniforms u on the 2**-24 grid (kernels/qsgd.py's docstring).

    The level is floor of the float32-rounded sum r + (1 - 2**-24 - u): it
    rounds up when u < f - ulp/2 and down when u >= f + ulp/2 (f = r - floor(r),
    ulp at s), and never leaves [-s, s].
    """
    from horovod_qsgd.kernels.qsgd import rounded_level_f32

    g = 2.0 ** -24
    s = 2 ** (bits - 1) - 1
    s32 = np.float32(s)
    scale = np.float32(s)  # then r == |x| exactly
    half_ulp = math.ulp(float(s)) * 2.0 ** 29 / 2  # float32 ulp of s, halved
    rng = np.random.default_rng(bits)
    r = np.concatenate([rng.integers(0, 2 ** 24, 3000) * g * s, [0.0, s, 2.5 * g, 0.5, 1.0]])
    r = r.astype(np.float32).astype(np.float64)  # float32 values; float64 sums of them and u are exact
    for ri in r:
        f = ri - math.floor(ri)
        for u in {0.0, 1 - g, *(min(max(f + k * g, 0.0), 1 - g) for k in range(-3, 4)), rng.integers(0, 2 ** 24) * g}:
            want = min(math.floor(np.float32(ri + (1 - g - u))), s)  # exact sum in float64, rounded once
            got = rounded_level_f32(np.float32(ri), scale, s32, True, np.float32(u))
            assert got == want and rounded_level_f32(np.float32(-ri), scale, s32, True, np.float32(u)) == -want
            if u < f - half_ulp:
                assert got == math.floor(ri) + 1
            elif u >= f + half_ulp:
                assert got == math.floor(ri)


@pytest.mark.parametrize("bits", [2, 4])
def test_variance_within_paper_bound_l2(bits):
    """E||Q(v) - v||^2 <= min(d/s^2, sqrt(d)/s) ||v||^2 per bucket (Lemma 3.1)."""
    d, nbk, T = 128, 4, 400
    codec = QSGDCodec(bits=bits, bucket_size=d, norm="l2")
    s = codec.levels
    x = _x(d * nbk, seed=bits)
    sq = np.zeros(nbk)
    for t in range(T):
        e = roundtrip(codec, x, step=t).astype(np.float64) - x
        sq += (e.reshape(nbk, d) ** 2).sum(axis=1)
    bound = min(d / s ** 2, math.sqrt(d) / s) * (x.astype(np.float64).reshape(nbk, d) ** 2).sum(axis=1)
    assert np.all(sq / T <= bound)


@pytest.mark.parametrize("n", [1, 9, 300, 4099])
@pytest.mark.parametrize("cfg", [dict(bits=4, bucket_size=64, norm="l2"), dict(bits=2, bucket_size=7),
                                 dict(bits=8, bucket_size=512, scale_dtype="float16")])
def test_elias_decodes_like_fixed(n, cfg):
    x = _x(n, seed=n)
    fixed = roundtrip(QSGDCodec(encoding="fixed", **cfg), x, step=2, key=3)
    codec = QSGDCodec(encoding="elias", **cfg)
    p = encode(codec, x, step=2, key=3)
    assert not codec.payload_nbytes_is_fixed
    assert p.size <= codec.max_payload_nbytes(n)
    assert bits_equal(decode(codec, p, n), fixed)


def test_elias_worst_case_fits_the_bound():
    codec = QSGDCodec(bits=8, bucket_size=100, encoding="elias")
    x = np.full(1000, -2.5, np.float32)  # every level is -s
    p = encode(codec, x)
    assert p.size == codec.max_payload_nbytes(x.size)
    assert np.all(decode(codec, p, x.size) == -2.5)


def test_elias_size_against_paper_bound():
    """s = sqrt(d), L2 norm: the paper bounds the expected size by ~2.8 d + 32 bits per bucket.

    Our stream adds per bucket a 32-bit byte offset and < 8 bits of padding,
    so the asserted bound is 2.8 d + 32 + 32 + 8 bits per bucket.
    """
    bits = 7
    s = 2 ** (bits - 1) - 1
    d = s * s  # 3969
    nb = 20
    codec = QSGDCodec(bits=bits, bucket_size=d, norm="l2", encoding="elias")
    x = np.random.default_rng(5).standard_normal(d * nb).astype(np.float32)
    p = encode(codec, x, step=1)
    measured = (p.size - HEADER_NBYTES) * 8 / x.size
    print(f"\nElias QSGD, s={s}, d={d}, l2: {measured:.3f} bits/coordinate "
          f"(paper bound {2.8 + 32 / d:.3f}; fixed-width {bits + 32 / d:.3f})")
    assert measured <= 2.8 + (32 + 32 + 8) / d


def test_elias_corrupt_payload_raises():
    from horovod_qsgd.codecs import PayloadError
    codec = QSGDCodec(bits=4, bucket_size=64, encoding="elias")
    x = _x(640)
    p = encode(codec, x)
    bad = p.copy()
    nb = 10
    ends_off = HEADER_NBYTES + 4 * nb
    bad[ends_off:ends_off + 4 * nb] = 0xFF  # offsets beyond the stream
    with pytest.raises(PayloadError):
        decode(codec, bad, x.size)
    with pytest.raises(PayloadError, match="truncated"):
        decode(codec, p[:-4], x.size)


def test_fp16_and_bf16_inputs_are_converted():
    codec = QSGDCodec(bits=4, bucket_size=32)
    x16 = _x(300).astype(np.float16)
    assert np.array_equal(encode(codec, x16, step=1), encode(codec, x16.astype(np.float32), step=1))
    ml_dtypes = pytest.importorskip("ml_dtypes")
    xb = _x(300).astype(ml_dtypes.bfloat16)
    assert np.array_equal(encode(codec, xb, step=1), encode(codec, xb.astype(np.float32), step=1))


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_, np.float64, np.uint8])
def test_non_float32_like_input_is_refused(dtype):
    codec = QSGDCodec()
    x = np.ones(10, dtype)
    with pytest.raises(TypeError, match=r"supported: float32, float16 and bfloat16"):
        codec.encode(x, np.zeros(codec.max_payload_nbytes(10), np.uint8), step=0, key=0)


def test_empty_tensor():
    codec = QSGDCodec()
    p = encode(codec, np.zeros(0, np.float32))
    assert p.size == HEADER_NBYTES
    decode(codec, p, 0)
