"""RNG, fp16 conversions, bit casts, packing and the normal quantile."""

import math

import numpy as np
import pytest

from horovod_qsgd.kernels import acklam_ppf, stream_base
from horovod_qsgd.kernels.half import bits_to_f32, f16_to_f32, f32_to_f16_rne, f32_to_f16_up
from horovod_qsgd.kernels.qsgd import pack_group, pack_span
from horovod_qsgd.kernels.rng import (field_uniform, paired_fields, paired_uniform, paired_uniform_py,
                                      payload_stream_base, seed_word, uniform, uniform_py)


def _values():
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal(3000).astype(np.float32) * np.float32(s)
             for s in (1e-8, 1e-6, 6e-5, 1e-3, 1.0, 300.0, 3e4, 1e5)]
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, -65520, 65536,
                         2 ** -24, 2 ** -25, 3 * 2 ** -26, 2 ** -14, -2 ** -14, 6.1e-5, 1.0 + 2 ** -11,
                         1.0 + 3 * 2 ** -11, 1e-45, 3.4e38], np.float32)
    return np.concatenate(parts + [specials])


def test_uniform_matches_reference_and_is_uniform():
    base = stream_base(1, 2, 3, 1)
    got = np.array([uniform(base, i) for i in range(2000)], np.float64)
    ref = np.array([uniform_py(base, i) for i in range(2000)])
    assert np.array_equal(got, ref)
    assert got.min() >= 0.0 and got.max() < 1.0
    assert abs(got.mean() - 0.5) < 5 * math.sqrt(1 / 12 / got.size)
    assert np.all(got * 2 ** 24 == np.floor(got * 2 ** 24))  # 24-bit grid
    other = np.array([uniform(stream_base(1, 3, 3, 1), i) for i in range(2000)])
    assert np.mean(other == got) < 0.01


def test_paired_stream_matches_reference_and_its_halves_are_independent_uniforms():
    """QSGD's rounding stream: one hash, two 24-bit fields (elements 2p and 2p + 1)."""
    base = stream_base(4, 5, 6, 1)
    n = 20000
    got = np.array([paired_uniform(base, i) for i in range(n)], np.float64)
    assert np.array_equal(got, [paired_uniform_py(base, i) for i in range(n)])
    fields = np.zeros(n, np.uint32)
    paired_fields(base, 0, fields)
    assert np.array_equal([field_uniform(f) for f in fields], got)
    assert np.all(got * 2 ** 24 == np.floor(got * 2 ** 24)) and got.min() >= 0.0 and got.max() < 1.0
    even, odd = got[0::2], got[1::2]
    # means within 5 standard errors of 1/2; bin counts of each half pass a chi-square test at 1e-4
    from scipy import stats
    for half in (even, odd):
        assert abs(half.mean() - 0.5) < 5 * math.sqrt(1 / 12 / half.size)
        assert stats.chisquare(np.histogram(half, bins=20, range=(0, 1))[0]).pvalue > 1e-4
    # the two fields of one word are uncorrelated: |r| below 5 / sqrt(pairs)
    assert abs(np.corrcoef(even, odd)[0, 1]) < 5 / math.sqrt(even.size)
    # and jointly uniform on a 5x5 grid
    joint = np.histogram2d(even, odd, bins=5, range=[[0, 1], [0, 1]])[0].reshape(-1)
    assert stats.chisquare(joint).pvalue > 1e-4


@pytest.mark.parametrize("p0", [0, 1, 255, 2 ** 40 + 3])
def test_paired_fields_give_the_paired_stream(p0):
    """The vectorised word loop QSGD encoding uses draws exactly the paired stream's uniforms."""
    base = stream_base(7, 8, 9, 1)
    fields = np.zeros(514, np.uint32)
    paired_fields(base, p0, fields)
    assert fields.max() < 2 ** 24
    got = np.array([field_uniform(f) for f in fields], np.float64)
    assert np.array_equal(got, [paired_uniform_py(base, 2 * p0 + j) for j in range(fields.size)])


def test_stream_base_rejects_bad_arguments():
    with pytest.raises(ValueError, match="key"):
        stream_base(0, 0, 2 ** 32, 1)
    with pytest.raises(ValueError, match="step"):
        stream_base(0, -1, 0, 1)


def test_f16_rne_matches_numpy():
    v = _values()
    with np.errstate(over="ignore"):
        want = v.astype(np.float16).view(np.uint16)
    got = np.array([f32_to_f16_rne(a) for a in v], np.uint16)
    assert np.array_equal(got, want)


def test_f16_widen_is_exact():
    h = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16)
    want = h.view(np.float16).astype(np.float32)
    got = np.array([f16_to_f32(int(b)) for b in h], np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_f16_round_up_is_smallest_half_above():
    a = np.abs(_values())
    a = a[np.isfinite(a) & (a <= 65504)]
    up = np.array([f32_to_f16_up(v) for v in a], np.uint16)
    upf = up.view(np.float16).astype(np.float32)
    assert np.all(upf >= a)
    below = np.nextafter(up.view(np.float16), np.float16(-1)).astype(np.float32)
    assert np.all((below < a) | (a == 0))
    assert f32_to_f16_up(np.float32(65505.0)) == 0x7C00
    assert f32_to_f16_up(np.float32(np.nan)) == 0x7E00


def test_bits_to_f32_is_a_bit_cast():
    v = _values()
    got = np.array([bits_to_f32(b) for b in v.view(np.uint32)], np.float32)
    finite = ~np.isnan(v)
    assert np.array_equal(got[finite].view(np.uint32), v[finite].view(np.uint32))
    assert np.all(np.isnan(got[~finite]))


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("m", [1, 7, 8, 9, 64, 67])
def test_pack_span_equals_pack_group(bits, m):
    rng = np.random.default_rng(bits * 100 + m)
    src = rng.integers(0, (1 << bits) - 1, m).astype(np.uint8)
    nbytes = (m * bits + 7) // 8
    a = np.zeros(nbytes, np.uint8)
    pack_span(src, bits, a)
    b = np.zeros(nbytes, np.uint8)
    for g in range((m + 7) // 8):
        pack_group(src, g * 8, min(8, m - g * 8), bits, b, g * bits)
    assert np.array_equal(a, b)
    # LSB-first: unpacking the bit string gives the codes back
    allbits = np.unpackbits(a, bitorder="little")
    back = [int("".join(str(int(t)) for t in allbits[j * bits:(j + 1) * bits][::-1]), 2) for j in range(m)]
    assert back == list(src)


def test_acklam_ppf_accuracy():
    scipy_stats = pytest.importorskip("scipy.stats")
    for p in (1e-9, 1e-4, 0.01, 0.02425, 0.3, 0.5, 0.9, 0.999, 1 - 1e-7):
        assert abs(acklam_ppf(p) - scipy_stats.norm.ppf(p)) < 1e-8 * max(1.0, abs(scipy_stats.norm.ppf(p)))
    with pytest.raises(ValueError):
        acklam_ppf(1.0)


@pytest.mark.parametrize("seed,step,key", [(0, 0, 0), (2 ** 64 - 1, 2 ** 64 - 1, 2 ** 32 - 1), (12345, 77, 4242)])
def test_payload_stream_base_reads_step_and_key_as_stream_base_takes_them(seed, step, key):
    meta = np.frombuffer(np.array([step], "<u8").tobytes() + np.array([key], "<u4").tobytes(), np.uint8)
    assert payload_stream_base(meta, seed_word(seed), np.uint64(3)) == stream_base(seed, step, key, 3)
    assert payload_stream_base(meta, seed_word(seed), np.uint64(3)) != stream_base(seed, step ^ 1, key, 3)
