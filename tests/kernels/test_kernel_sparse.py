"""Top-k (exact, Gaussian-k, sampled) and random-k."""

import numpy as np
import pytest

from horovod_qsgd.codecs import HEADER_NBYTES, PayloadError, RandomKCodec, TopKCodec

from .helpers import bits_equal, decode, encode


def _entries(codec, payload, n):
    cap = codec.capacity(n)
    idx = payload[HEADER_NBYTES:HEADER_NBYTES + 4 * cap].view(np.int32)
    vdt = np.float16 if codec.value_dtype == "float16" else np.float32
    vals = payload[HEADER_NBYTES + 4 * cap:HEADER_NBYTES + 4 * cap + cap * np.dtype(vdt).itemsize].view(vdt)
    return idx, vals.astype(np.float32)


def _reference_topk(acc, k):
    """k largest |acc|, ties -> lower index (stable sort on -|acc|)."""
    order = np.argsort(-np.abs(acc.astype(np.float64)), kind="stable")
    return np.sort(order[:k])


@pytest.mark.parametrize("n,ratio", [(1, 0.5), (2, 0.5), (100, 0.07), (5000, 0.01), (70001, 0.001),
                                     (600_000, 0.01)])
@pytest.mark.parametrize("ties", [False, True])
def test_exact_topk_matches_sort_reference(n, ratio, ties):
    rng = np.random.default_rng(n)
    if ties:  # few distinct magnitudes, random signs: ties at the threshold
        x = (rng.integers(0, 5, n) * rng.choice([-1, 1], n)).astype(np.float32)
    else:
        x = rng.standard_normal(n).astype(np.float32)
    codec = TopKCodec(ratio=ratio, error_feedback=False)
    k = codec.k(n)
    p = encode(codec, x)
    assert p.size == codec.max_payload_nbytes(n) == HEADER_NBYTES + 8 * k + (0 if k % 1 == 0 else 0)
    idx, vals = _entries(codec, p, n)
    assert np.array_equal(idx, _reference_topk(x, k))
    assert bits_equal(vals, x[idx])
    out = decode(codec, p, n)
    want = np.zeros(n, np.float32)
    want[idx] = x[idx]
    assert bits_equal(out, want)


def test_exact_topk_sends_nan_and_inf_first():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    x[10], x[500] = np.nan, -np.inf
    codec = TopKCodec(ratio=0.002, error_feedback=False)
    idx, vals = _entries(codec, encode(codec, x), x.size)
    assert list(idx) == [10, 500] and np.isnan(vals[0]) and vals[1] == -np.inf


@pytest.mark.parametrize("selector", ["gaussian", "sample"])
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1])
def test_approximate_selectors_land_near_k(selector, ratio):
    """Gaussian data: the count is in [2k/3, 4k/3] (the refinement band)."""
    n = 300_000
    x = np.random.default_rng(7).standard_normal(n).astype(np.float32)
    codec = TopKCodec(ratio=ratio, selector=selector, error_feedback=False)
    k = codec.k(n)
    p = encode(codec, x, step=1, key=2)
    idx, vals = _entries(codec, p, n)
    sel = idx[idx >= 0]
    print(f"\n{selector} ratio={ratio}: {sel.size} entries for k={k} ({sel.size / k:.3f} k)")
    assert 2 * k / 3 <= sel.size <= 4 * k / 3
    assert np.all(np.diff(sel) > 0)
    assert np.all(idx[sel.size:] == -1) and np.all(vals[sel.size:] == 0)
    # every sent magnitude is >= every unsent magnitude it beat (a threshold set)
    mask = np.zeros(n, bool)
    mask[sel] = True
    assert np.abs(x[mask]).min() >= np.abs(x[~mask]).max()


@pytest.mark.parametrize("selector", ["exact", "gaussian", "sample"])
@pytest.mark.parametrize("value_dtype", ["float32", "float16"])
def test_error_feedback_conserves_bitwise(selector, value_dtype):
    """sent + residual_new == x + residual_old, bit for bit, over several steps."""
    n = 20_000
    rng = np.random.default_rng(11)
    codec = TopKCodec(ratio=0.01, selector=selector, value_dtype=value_dtype)
    r = (rng.standard_normal(n) * 0.1).astype(np.float32)
    for step in range(3):
        x = rng.standard_normal(n).astype(np.float32)
        acc = x + r
        p = encode(codec, x, step=step, key=5, residual=r)
        sent = decode(codec, p, n)
        assert bits_equal(sent + r, acc)
        idx, _ = _entries(codec, p, n)
        valid = idx[idx >= 0]
        assert np.all(np.diff(valid) > 0) and np.all(idx[valid.size:] == -1)
        assert np.count_nonzero(r[idx[idx >= 0]]) <= (0 if value_dtype == "float32" else idx.size)


def test_without_error_feedback_x_and_residual_are_untouched():
    x = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    x0 = x.copy()
    codec = TopKCodec(ratio=0.01, error_feedback=False)
    encode(codec, x)  # no residual needed
    assert bits_equal(x, x0)


def test_capacity_overflow_stays_in_residual():
    """Gaussian selector, 2k equal large values: cap = ceil(4k/3) sent, the rest kept."""
    n = 30_000
    codec = TopKCodec(ratio=0.01, selector="gaussian")
    k, cap = codec.k(n), codec.capacity(n)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    big = np.sort(rng.choice(n, 2 * k, replace=False))
    x[big] = 100.0
    r = np.zeros(n, np.float32)
    p = encode(codec, x, residual=r)
    idx, vals = _entries(codec, p, n)
    assert cap == (4 * k + 2) // 3 and np.array_equal(idx, big[:cap])  # first in index order
    assert np.all(r[big[:cap]] == 0) and np.all(r[big[cap:]] == 100.0)
    assert bits_equal(decode(codec, p, n) + r, x)


def test_corrupt_index_raises():
    codec = TopKCodec(ratio=0.01, error_feedback=False)
    x = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    p = encode(codec, x).copy()
    p[HEADER_NBYTES:HEADER_NBYTES + 4] = np.array([5000], np.int32).view(np.uint8)
    with pytest.raises(PayloadError, match="index"):
        decode(codec, p, x.size)


# ---------------------------------------------------------------- random-k --

def test_randomk_indices_shared_distinct_stratified():
    codec = RandomKCodec(ratio=0.01, seed=3)
    n = 100_003
    k = codec.k(n)
    a = codec.indices(n, step=4, key=9)
    assert a.dtype == np.int64 and a.size == k
    assert np.array_equal(a, RandomKCodec(ratio=0.01, seed=3).indices(n, step=4, key=9))
    assert np.all(np.diff(a) > 0)
    j = np.arange(k)
    assert np.all(a >= j * n // k) and np.all(a < (j + 1) * n // k)
    assert np.mean(a == codec.indices(n, step=5, key=9)) < 0.05
    assert np.mean(a == codec.indices(n, step=4, key=10)) < 0.05
    assert np.mean(a == RandomKCodec(ratio=0.01, seed=4).indices(n, step=4, key=9)) < 0.05
    # uniform inside the strata
    off = (a - j * n // k) / (((j + 1) * n // k) - j * n // k)
    assert abs(off.mean() - 0.5) < 5 * (1 / 12 / k) ** 0.5


def test_randomk_gather_scatter_and_payload():
    n = 5000
    x = np.random.default_rng(2).standard_normal(n).astype(np.float32)
    for codec in (RandomKCodec(ratio=0.02), RandomKCodec(ratio=0.02, rescale=True),
                  RandomKCodec(ratio=0.02, value_dtype="float16")):
        idx = codec.indices(n, step=1, key=2)
        vals = codec.gather(x, step=1, key=2)
        factor = np.float32(n / idx.size) if codec.rescale else np.float32(1)
        want_vals = x[idx] * factor
        if codec.value_dtype == "float16":
            want_vals = want_vals.astype(np.float16).astype(np.float32)
        assert bits_equal(vals, want_vals)
        out = np.zeros(n, np.float32)
        codec.scatter_accumulate(vals, out, step=1, key=2)
        want = np.zeros(n, np.float32)
        want[idx] = want_vals
        assert bits_equal(out, want)
        p = encode(codec, x, step=1, key=2)
        assert p.size == codec.max_payload_nbytes(n)
        assert bits_equal(decode(codec, p, n), want)


def test_randomk_error_feedback_conserves():
    n = 4000
    rng = np.random.default_rng(5)
    codec = RandomKCodec(ratio=0.05, error_feedback=True, value_dtype="float16")
    r = (rng.standard_normal(n) * 0.1).astype(np.float32)
    for step in range(3):
        x = rng.standard_normal(n).astype(np.float32)
        acc = x + r
        vals = codec.gather(x, step=step, key=1, residual=r)
        sent = np.zeros(n, np.float32)
        codec.scatter_accumulate(vals, sent, step=step, key=1)
        assert bits_equal(sent + r, acc)
    with pytest.raises(ValueError, match="residual"):
        codec.gather(x, step=0, key=1)


def test_randomk_rejects_rescale_with_error_feedback():
    with pytest.raises(ValueError, match="rescale"):
        RandomKCodec(error_feedback=True, rescale=True)


@pytest.mark.parametrize("value_dtype", ["float32", "float16"])
def test_exact_sampled_path_and_its_fallback(monkeypatch, value_dtype):
    """Large n takes the sampled-candidate path; a wrong bound falls back, same result."""
    from horovod_qsgd.kernels import topk
    n = 400_000
    rng = np.random.default_rng(21)
    x = (rng.integers(0, 50, n) * rng.choice([-1, 1], n)).astype(np.float32)  # many ties
    codec = TopKCodec(ratio=0.003, value_dtype=value_dtype)
    r0 = (rng.standard_normal(n) * 0.01).astype(np.float32)
    acc = x + r0
    results = []
    for force_fallback in (False, True):
        if force_fallback:
            monkeypatch.setattr(topk, "exact_threshold", lambda v, j: np.float32(1e30))
        r = r0.copy()
        p = encode(codec, x, residual=r)
        idx, _ = _entries(codec, p, n)
        assert np.array_equal(idx, _reference_topk(acc, codec.k(n)))
        assert bits_equal(decode(codec, p, n) + r, acc)
        results.append((p, r))
    assert np.array_equal(results[0][0], results[1][0]) and bits_equal(results[0][1], results[1][1])


@pytest.mark.parametrize("n", [0, 1, 65535, 65536, 65537, 300_000])
def test_all_finite_finds_one_inf_or_nan_anywhere(n):
    from horovod_qsgd.kernels import all_finite
    from horovod_qsgd.kernels.select import CHUNK
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32) * 1e30
    assert all_finite(x) and all_finite(np.full(n, np.finfo(np.float32).max, np.float32))
    for position in sorted({0, n // 2, n - 1, min(n - 1, CHUNK), min(n - 1, CHUNK - 1)}) if n else []:
        for bad in (np.inf, -np.inf, np.nan):
            y = x.copy()
            y[position] = bad
            assert not all_finite(y), (position, bad)


def test_random_k_sends_nan_when_acc_holds_one_outside_its_strata():
    codec, codec_ef = RandomKCodec(ratio=0.01), RandomKCodec(ratio=0.01, error_feedback=True)
    x = np.ones(100_000, np.float32)
    outside = next(i for i in range(x.size) if i not in set(codec.indices(x.size, 3, 7).tolist()))
    assert np.isfinite(codec.gather(x, step=3, key=7)).all()
    for bad in (np.nan, np.inf):
        x[outside] = bad
        values = codec.gather(x, step=3, key=7)
        assert np.isnan(values[0]) and np.isfinite(values[1:]).all()
        residual = np.zeros_like(x)
        assert np.isnan(codec_ef.gather(x, step=3, key=7, residual=residual)[0])


@pytest.mark.parametrize("n, carried", [(400_000, False), (400_000, True), ((1 << 22) + 12_345, True)])
@pytest.mark.parametrize("crowded", [False, True])
def test_exact_sampled_candidates_collected_as_counted(monkeypatch, crowded, n, carried):
    """The sampled bound's candidates, collected per chunk in the counting pass, spread or ``crowded`` (6000
    of the largest values in one chunk of 65536, more than its room: compacted from acc in a pass of their
    own): the exact top k; with a CarriedResidual the residual added is left as it was and the new one is
    acc - sent, stored past the cache on a tensor of at least STREAM_MIN elements."""
    from horovod_qsgd.kernels import CarriedResidual, topk
    from horovod_qsgd.kernels.select import CHUNK
    from horovod_qsgd.kernels.streaming import STREAM_MIN
    assert (n >= STREAM_MIN) == (n > 400_000)
    launched = []

    def recording_launch(launcher, work, *args):
        launched.append(launcher.__name__)
        return cpu_launch(launcher, work, *args)

    from horovod_qsgd.kernels._dual import cpu_launch
    monkeypatch.setattr(topk, "cpu_launch", recording_launch)
    rng = np.random.default_rng(5)
    x = rng.standard_normal(n).astype(np.float32)
    if crowded:
        x[2 * CHUNK + 3:2 * CHUNK + 6003] = (10 + rng.random(6000)).astype(np.float32)
    r0 = (rng.standard_normal(n) * 0.1).astype(np.float32)
    acc = x + r0
    codec = TopKCodec(ratio=0.01)
    previous, target = r0.copy(), np.full(n + 1, np.nan, np.float32)[1:]  # the stores' aligned body after a head
    p = encode(codec, x, residual=CarriedResidual(target, previous) if carried else previous)
    new_residual = target if carried else previous
    idx, _ = _entries(codec, p, n)
    assert np.array_equal(idx, _reference_topk(acc, codec.k(n)))
    assert bits_equal(decode(codec, p, n) + new_residual, acc)
    if carried:
        assert bits_equal(previous, r0)
    assert "count_collect_cpu" in launched
    assert ("compact_cpu" in launched) == crowded, launched


@pytest.mark.parametrize("selector", ["gaussian", "sample", "exact"])
def test_a_streamed_carried_encode_is_the_in_place_one(selector):
    """On a tensor of STREAM_MIN elements or more, a CarriedResidual's first pass stores acc past the cache and
    the pass's own reads recompute it: the payload and the new residual are the bits of the in-place encode
    (which streams nothing), and the residual added is left as it was."""
    from horovod_qsgd.kernels import CarriedResidual
    from horovod_qsgd.kernels.streaming import STREAM_MIN
    n = STREAM_MIN + 12_345
    rng = np.random.default_rng(8)
    x = rng.standard_normal(n).astype(np.float32)
    r0 = (rng.standard_normal(n) * 0.3).astype(np.float32)
    codec = TopKCodec(ratio=0.01, selector=selector)
    in_place = r0.copy()
    expected = encode(codec, x, residual=in_place, step=3)
    previous, target = r0.copy(), np.full(n + 1, np.nan, np.float32)[1:]  # an unaligned target: a head first
    streamed = encode(codec, x, residual=CarriedResidual(target, previous), step=3)
    assert np.array_equal(streamed, expected)
    assert bits_equal(target, in_place) and bits_equal(previous, r0)
