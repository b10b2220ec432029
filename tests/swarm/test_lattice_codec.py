"""The cubic-lattice (modular) quantizer: unbiasedness, error bound, decoding range, detection, wire format."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from horovod_qsgd.codecs.header import PayloadError, parse_header
from horovod_qsgd.codecs.lattice import EXACT_CODEC_ID, LATTICE_CODEC_ID, ExactCodec, LatticeCodec

HERE = os.path.dirname(os.path.abspath(__file__))
EPS = 2.0 ** -8  # a power of two: z * eps is exact in float32, so decoded values carry no rounding


def encode(codec, x, eps, step=0, key=0, fill=0xA5):
    out = np.full(codec.max_payload_nbytes(x.size), fill, np.uint8)
    n = codec.encode(x, out, eps=eps, step=step, key=key)
    assert n == out.size and n % 4 == 0
    return out


def decode(codec, payload, reference):
    out = np.full(reference.size, np.nan, np.float32)
    bad = np.full(codec._nbuckets(reference.size), 7, np.uint8)
    failed = codec.decode(payload, reference, out, bad=bad)
    assert failed == int(bad.sum()) and set(np.unique(bad)) <= {0, 1}
    return out, bad


def lattice_neighbours(x, eps):
    lo = np.floor(x.astype(np.float64) / eps)
    return lo * eps, (lo + 1) * eps


def test_unbiased_with_stated_confidence():
    """Mean of N = 20000 independent roundings of each coordinate is within 5 standard errors of x.

    Under unbiasedness each standardised mean is ~N(0, 1) (CLT, Bernoulli
    rounding); P(|Z| > 5) = 5.7e-7, so for 64 coordinates a correct codec
    fails this test with probability below 4e-5. A deterministic-rounding or
    off-by-a-fraction codec is off by many standard errors.
    """
    codec = LatticeCodec(bits=8, bucket_size=4096)
    rng = np.random.default_rng(1)
    d, reps = 64, 20000
    frac = np.linspace(0.1, 0.9, d)
    x = ((rng.integers(-300, 300, d) + frac) * EPS).astype(np.float32)
    x[::2] *= -1
    assert np.array_equal(x.astype(np.float64) / EPS % 1 != 0, np.ones(d, bool))
    tiled = np.tile(x, reps)  # element index enters the stream: every copy is an independent rounding
    decoded, bad = decode(codec, encode(codec, tiled, EPS, step=3, key=9), tiled)
    assert not bad.any()
    samples = decoded.reshape(reps, d).astype(np.float64)
    p = x.astype(np.float64) / EPS - np.floor(x.astype(np.float64) / EPS)  # P(round up)
    sigma = EPS * np.sqrt(p * (1 - p))
    z = (samples.mean(0) - x) / (sigma / math.sqrt(reps))
    assert np.abs(z).max() < 5.0, z
    # the variance is that of a Bernoulli(p) rounding: eps**2 p (1-p), within 15% (~9 standard errors)
    np.testing.assert_allclose(samples.var(0), sigma ** 2, rtol=0.15)
    # every value is one of the two neighbouring lattice points
    lo, hi = lattice_neighbours(x, EPS)
    assert np.all((samples == lo) | (samples == hi))


def test_rounding_differs_between_steps_keys_and_seeds():
    codec = LatticeCodec()
    x = (np.random.default_rng(2).standard_normal(5000)).astype(np.float32)
    a = encode(codec, x, 1e-3, step=1, key=2)
    assert np.array_equal(a, encode(codec, x, 1e-3, step=1, key=2, fill=0x5A))  # deterministic, every byte written
    assert not np.array_equal(a, encode(codec, x, 1e-3, step=2, key=2))
    assert not np.array_equal(a, encode(codec, x, 1e-3, step=1, key=3))
    other = LatticeCodec(seed=1)
    b = encode(other, x, 1e-3, step=1, key=2)
    assert not np.array_equal(a[20:], b[20:])


@pytest.mark.parametrize("bits", [8, 5, 3])
def test_decodes_exactly_inside_the_radius_with_error_below_eps(bits):
    codec = LatticeCodec(bits=bits, bucket_size=512)
    rng = np.random.default_rng(bits)
    n = 20000
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    radius = codec.radius(EPS)
    assert radius == EPS * ((1 << bits) // 2 - 2)
    delta = rng.uniform(-radius, radius, n)
    delta[:8] = [radius, -radius, radius, -radius, 0, 0, radius * (1 - 1e-7), -radius * (1 - 1e-7)]
    y = (x.astype(np.float64) + delta).astype(np.float32)
    inside = np.abs(y.astype(np.float64) - x) <= radius  # float32 rounding of y may step just outside
    assert inside.mean() > 0.999
    payload = encode(codec, x, EPS, step=5, key=1)
    decoded, bad = decode(codec, payload, y)
    exact, _ = decode(codec, payload, x)  # the reference x itself: certainly the sender's points
    assert not bad.any()
    assert np.array_equal(decoded[inside], exact[inside])
    lo, hi = lattice_neighbours(x, EPS)
    assert np.all((exact == lo) | (exact == hi))
    assert np.abs(exact.astype(np.float64) - x).max() < EPS


def test_large_magnitudes_and_negative_lattice_points():
    codec = LatticeCodec(bits=8, bucket_size=64)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(3000) * 1000).astype(np.float32)  # |x / eps| up to ~2**32
    eps = 1e-6
    y = (x + rng.uniform(-50, 50, x.size) * eps).astype(np.float32)
    decoded, bad = decode(codec, encode(codec, x, eps), y)
    assert not bad.any()
    assert np.abs(decoded.astype(np.float64) - x).max() <= eps + np.spacing(np.abs(x)).max()


def test_detection_outside_the_radius_sweep():
    """One perturbed coordinate per bucket of 8, offsets from 0 to 3 q eps: a bucket is flagged iff its value
    decodes wrongly; inside the radius nothing is flagged; beyond (q/2 + 2) eps everything is."""
    bits = 6
    q = 1 << bits
    codec = LatticeCodec(bits=bits, bucket_size=8)
    k = 2000
    offsets = np.linspace(-3 * q * EPS, 3 * q * EPS, k)
    rng = np.random.default_rng(4)
    x = (rng.uniform(-1, 1, 8 * k)).astype(np.float32)
    y = x.copy()
    y[::8] = (x[::8].astype(np.float64) + offsets).astype(np.float32)
    payload = encode(codec, x, EPS, step=1)
    truth, _ = decode(codec, payload, x)
    decoded, bad = decode(codec, payload, y)
    wrong = (decoded != truth).reshape(k, 8).any(1)
    dist = np.abs(y[::8].astype(np.float64) - x[::8])
    assert np.array_equal(bad.astype(bool), wrong)
    assert not bad[dist <= codec.radius(EPS)].any()
    assert bad[dist >= (q / 2 + 2) * EPS].all()
    assert 0.6 < bad.mean() < 0.9  # the sweep covers both sides


def test_detection_in_a_large_tensor_flags_exactly_the_far_buckets():
    codec = LatticeCodec(bits=8, bucket_size=4096)
    rng = np.random.default_rng(5)
    n = 100_000
    x = rng.standard_normal(n).astype(np.float32)
    eps = codec.eps_for_spread(1e-3)
    y = (x + rng.uniform(-1e-3, 1e-3, n)).astype(np.float32)
    far = [17, 40_000, 40_001, 99_999]
    y[far] += np.float32(0.5)  # ~250 radii away
    decoded, bad = decode(codec, encode(codec, x, eps), y)
    assert np.flatnonzero(bad).tolist() == sorted({i // 4096 for i in far})


def test_non_finite_input_is_refused_and_non_finite_reference_is_flagged():
    codec = LatticeCodec(bucket_size=8)
    x = np.linspace(-1, 1, 40).astype(np.float32)
    for bad_value in (np.nan, np.inf):
        z = x.copy()
        z[21] = bad_value
        with pytest.raises(ValueError, match=r"NaN/Inf .* elements 16\.\.23"):
            encode(codec, z, 1e-3)
    with pytest.raises(ValueError, match="2\\*\\*52"):
        encode(codec, np.array([1e30] * 8, np.float32), 1e-30)
    y = x.copy()
    y[3] = np.nan
    _, bad = decode(codec, encode(codec, x, 1e-3), y)
    assert bad.tolist() == [1, 0, 0, 0, 0]


@pytest.mark.parametrize("n", [0, 1, 7, 8, 4095, 4096, 4097, 10_000])
@pytest.mark.parametrize("bits", [3, 5, 8])
def test_payload_size_formula(n, bits):
    codec = LatticeCodec(bits=bits)
    nb = -(-n // 4096)
    expected = 16 + 4 + 4 * nb + -(-n * bits // 8)
    expected += -expected % 4
    assert codec.max_payload_nbytes(n) == expected
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    payload = encode(codec, x, 1e-2)
    h = parse_header(payload)
    assert (h.codec_id, h.numel, h.nbytes, h.digest) == (LATTICE_CODEC_ID, n, expected, codec.digest)
    assert LatticeCodec.payload_eps(payload) == np.float32(1e-2)


def test_bytes_per_coordinate_is_log2_q_over_8():
    for bits in (8, 4):
        n = 1_000_000
        per_coord = LatticeCodec(bits=bits).max_payload_nbytes(n) / n
        assert bits / 8 <= per_coord < bits / 8 + 0.0011, per_coord  # 4 checksum bytes per 4096 coordinates
    assert ExactCodec().max_payload_nbytes(1000) == 16 + 4000


def test_eps_for_spread():
    codec = LatticeCodec(bits=8, headroom=2.0)
    for spread in (1e-6, 0.01, 3.0):
        eps = codec.eps_for_spread(spread)
        assert eps == np.float32(eps)
        assert codec.radius(eps) == pytest.approx(2.0 * spread, rel=1e-6)
    assert codec.eps_for_spread(0.0, magnitude=4.0) == pytest.approx(4.0 * 2.0 ** -40)
    assert codec.eps_for_spread(0.0) > 0


@pytest.mark.parametrize("kwargs, name", [
    ({"bits": 2}, "bits"), ({"bits": 9}, "bits"), ({"bits": 8.0}, "bits"),
    ({"bucket_size": 12}, "bucket_size"), ({"bucket_size": 0}, "bucket_size"),
    ({"headroom": 0.5}, "headroom"), ({"headroom": float("inf")}, "headroom"), ({"seed": -1}, "seed"),
])
def test_invalid_settings_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}="):
        LatticeCodec(**kwargs)


@pytest.mark.parametrize("eps", [0.0, -1.0, float("nan"), 1e39, "1"])
def test_invalid_eps_is_named(eps):
    codec = LatticeCodec()
    with pytest.raises(ValueError, match="^eps="):
        codec.encode(np.ones(8, np.float32), np.zeros(codec.max_payload_nbytes(8), np.uint8), eps=eps, step=0, key=0)


def test_decode_refuses_foreign_payloads_and_needs_a_reference():
    codec = LatticeCodec(bits=8)
    x = np.ones(100, np.float32)
    payload = encode(codec, x, 1e-3)
    out = np.zeros(100, np.float32)
    with pytest.raises(PayloadError, match=r"settings digest 0x[0-9a-f]{8} \(here 0x[0-9a-f]{8}\)"):
        LatticeCodec(bits=7).decode(payload, x, out)
    with pytest.raises(PayloadError, match=r"100 elements \(here 99\)"):
        codec.decode(payload, x[:99], out[:99])
    exact = np.zeros(ExactCodec().max_payload_nbytes(100), np.uint8)
    ExactCodec().encode(x, exact)
    assert parse_header(exact).codec_id == EXACT_CODEC_ID
    with pytest.raises(PayloadError, match=r"codec id \d+ \(here \d+, LatticeCodec\)"):
        codec.decode(exact, x, out)
    with pytest.raises(ValueError, match="reference"):
        codec.decode(payload, None, out)
    with pytest.raises(ValueError, match="reference has 99 elements"):
        codec.decode(payload, x[:99], out)


def test_exact_codec_round_trip_is_bitwise():
    x = np.random.default_rng(6).standard_normal(1001).astype(np.float32)
    x[5] = np.nan
    codec = ExactCodec()
    buf = np.full(codec.max_payload_nbytes(x.size), 0xA5, np.uint8)
    assert codec.encode(x, buf) == buf.size
    out = np.zeros_like(x)
    assert codec.decode(buf, None, out) == 0
    assert np.array_equal(out.view(np.uint32), x.view(np.uint32))


def test_cuda_path_in_simulator_gives_the_cpu_bytes():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "cudasim_lattice.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK:" in proc.stdout
