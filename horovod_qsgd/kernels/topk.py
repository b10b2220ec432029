"""Top-k selection: the selectors' thresholds, passes and writes, and the scatter back.

On the CPU the per-element work runs in :mod:`.select`'s cores and the
choices between them are made here, on the host: the radix passes of the
exact selector (histograms summed on the host, digits chosen there), the
Gaussian-k threshold from the moments with up to three count refinements,
DGC's sampled threshold, and the prefix sums that place each chunk's output.
On a CUDA device the same choices are kernels (:mod:`.select_device`), so an
encode never waits for the GPU; the selected entries are the same bytes.
"""
import math

import numpy as np

from . import select as _sel
from . import select_device as _dev
from . import select_grouped as _grouped
from ._arrays import device_view, split_residual, empty, float_bits, to_host, zeros
from ._dual import cpu_launch, on_cuda
from .rng import PURPOSE_SAMPLE, seed_word

__all__ = ["topk_select", "topk_encode_many", "sparse_accumulate", "sparse_accumulate_many", "exact_threshold",
           "acklam_ppf"]


_EXACT_CHUNK = 1 << 18
_EXACT_SAMPLE_MIN = 4096  # samples for the exact selector's lower bound
_DIGITS = _dev.RADIX_DIGITS


def _radix_select(x, r, bits, ef, k, chunk=_EXACT_CHUNK, carried=None):
    """Exact k-th largest key of ``bits & 0x7fffffff`` by 3 histogram passes (CPU).

    Returns (thresh, gt, eq) with per-chunk counts of keys > thresh and == thresh.
    The first pass also does the error-feedback accumulation when ``ef``, adding ``carried``'s residual
    (:func:`._arrays.carried_residual`; None: r's own).
    """
    carried = (r, _sel.IN_PLACE) if carried is None else carried
    n = bits.size
    nch = (n + chunk - 1) // chunk
    prefix, prefix_shift, kk = 0, 31, k
    gt = np.zeros(nch, np.int64)
    rows_all = []
    for shift, width in _DIGITS:
        nbins = 1 << width
        rows = np.zeros((nch, 4 * nbins), np.int32)  # 4 sub-histograms per chunk
        cpu_launch(_sel.hist_cpu, n, x, r, *carried, bits, ef, prefix_shift, prefix, shift, nbins - 1, rows, chunk)
        ef = False
        rows = rows.astype(np.int64).reshape(nch, 4, nbins).sum(axis=1)
        total = rows.sum(axis=0)
        above = np.cumsum(total[::-1])  # above[t] = count in bins >= nbins-1-t
        t = int(np.searchsorted(above, kk))  # first t with above[t] >= kk
        d = nbins - 1 - t
        kk -= int(above[t] - total[d])
        gt += rows[:, d + 1:].sum(axis=1)
        rows_all.append(rows)
        prefix = (prefix << width) | d
        prefix_shift = shift
    eq = rows_all[-1][:, prefix & ((1 << _DIGITS[-1][1]) - 1)]
    return prefix, gt, eq


def exact_threshold(values, k):
    """k-th largest |value| (float32) of a float32 array, by radix select.

    On a CUDA device the select runs there and the result is read back (one copy).
    """
    if on_cuda(values):
        return _dev.exact_threshold(device_view(values), k)
    thresh, _, _ = _radix_select(values, values, float_bits(values), False, k)
    return np.array([thresh], np.uint32).view(np.float32)[0]


def acklam_ppf(p):
    """Inverse standard normal CDF (Acklam's rational approximation, |rel err| < 1.2e-9)."""
    a = (-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
         1.383577518672690e+02, -3.066479806614716e+01, 2.506628277459239e+00)
    b = (-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
         6.680131188771972e+01, -1.328068155288572e+01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
         -2.549732539343734e+00, 4.374664141464968e+00, 2.938163982698783e+00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
         3.754408661907416e+00)
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    plow = 0.02425
    if p < plow:
        q = math.sqrt(-2 * math.log(p))
        return (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / \
               ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1)
    if p > 1 - plow:
        q = math.sqrt(-2 * math.log(1 - p))
        return -(((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / \
                ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1)
    q = p - 0.5
    rr = q * q
    return (((((a[0] * rr + a[1]) * rr + a[2]) * rr + a[3]) * rr + a[4]) * rr + a[5]) * q / \
           (((((b[0] * rr + b[1]) * rr + b[2]) * rr + b[3]) * rr + b[4]) * rr + 1)


def _count(src, t, x=None, ef=False, carried=None):
    """Per-chunk counts of not (|src| < t); with ef, first src = x + ``carried``'s residual (None: src's own)."""
    counts = np.empty((src.size + _sel.CHUNK - 1) // _sel.CHUNK, np.int64)
    carried = (src, _sel.IN_PLACE) if carried is None else carried
    # counts its first array unless ef
    cpu_launch(_sel.count_cpu, src.size, x if ef else src, src, *carried, ef, t, counts)
    return counts


def _refine(src, t, k, max_refinements=_dev.REFINEMENTS, x=None, ef_pending=False, carried=None):
    """(threshold, per-chunk counts) after at most 3 refinements of t.

    A refinement halves t when fewer than 2k/3 entries pass and multiplies
    it by 1.5 when more than 4k/3 pass (Shi et al.); once both a too-low and
    a too-high threshold have been seen it bisects between them instead, so
    the steps cannot overshoot back and forth across the band.  If no
    threshold lands in the band, the one whose count is closest to k (in
    ratio) is used.  ``ef_pending``: the first count pass also forms
    acc = x + ``carried``'s residual in src.  The device runs the same steps in
    :func:`.select_device.refine_kernel`.
    """
    lo = hi = None  # thresholds known to pass too many / too few
    counts = _count(src, np.float32(t), x=x, ef=ef_pending, carried=carried)
    best = (int(counts.sum()), t, counts)
    for _ in range(max_refinements):
        total = int(counts.sum())
        if 3 * total < 2 * k:
            hi = t
            t = t / 2 if lo is None else (lo + t) / 2
        elif 3 * total > 4 * k:
            lo = t
            t = t * 1.5 if hi is None else (hi + t) / 2
        else:
            return np.float32(t), counts
        counts = _count(src, np.float32(t))
        total = int(counts.sum())
        if 2 * k <= 3 * total <= 4 * k:
            return np.float32(t), counts
        if _sel.closer_to(total, best[0], k):
            best = (total, t, counts)
    return np.float32(best[1]), best[2]


def _exclusive(c):
    out = np.zeros_like(c)
    np.cumsum(c[:-1], out=out[1:])
    return out


def gaussian_z(k, n):
    """Phi^-1(1 - k / (2n)): Gaussian-k's threshold in standard deviations."""
    p = 1.0 - k / (2.0 * n)
    return acklam_ppf(p) if p < 1.0 else 0.0


def exact_sample_rank(k, n, m):
    """(rank j, or None for a full select): the sampled lower bound is the j-th largest of m samples."""
    if 4 * m >= n:  # small tensor: sampling saves nothing
        return None
    kk = k * m / n
    return min(m, int(math.ceil(kk + 4 * math.sqrt(kk) + 4)))


def topk_select(x, residual, idx, values, *, k, selector, error_feedback, half,
                sample_base=None, sample_size=0):
    """Select entries of acc = x (+ residual) into idx (int32) / values, then pad.

    ``idx.size`` is the capacity; emitted entries come first in index order,
    the unused slots get index -1 and value 0.  ``values`` is float32, or
    uint16 fp16 bits when ``half``.  With ``error_feedback`` the residual is
    updated in place, or is a :class:`._arrays.CarriedResidual`.  On a CUDA
    device every step runs there (:mod:`.select_device`): no host copy.
    """
    ef = bool(error_feedback)
    residual, carried = split_residual(residual) if ef else (None, None)
    gpu = on_cuda(x, residual, idx, values)
    n = x.size
    cap = idx.size
    if n == 0 or cap == 0:
        return
    if gpu:
        x, residual, idx, values = device_view(x), device_view(residual), device_view(idx), device_view(values)
        r = residual if ef else x
        carried = carried if ef else _dev.in_place(r)
        val32, val16 = (empty(1, np.float32, True), values) if half else (values, empty(1, np.uint16, True))
        if selector == "exact":
            m = exact_sample_size(k, n)
            j = exact_sample_rank(k, n, m)
            _dev.select_exact(x, r, idx, val32, val16, k=k, ef=ef, half=half,
                              sample=None if j is None else (m, j, sample_base), carried=carried)
        elif selector == "gaussian":
            _dev.select_by_threshold(x, r, idx, val32, val16, k=k, ef=ef, half=half, gaussian_z=gaussian_z(k, n),
                                     carried=carried)
        elif selector == "sample":
            _dev.select_by_threshold(x, r, idx, val32, val16, k=k, ef=ef, half=half,
                                     sample=(sample_size, sample_rank(k, n, sample_size), sample_base),
                                     carried=carried)
        else:
            raise ValueError(f"unknown selector {selector!r}")
        return
    r = residual if ef else x
    carried = carried if ef else (r, _sel.IN_PLACE)
    val32, val16 = (np.empty(1, np.float32), values) if half else (values, np.empty(1, np.uint16))
    used = _select_cpu(x, r, carried, idx, val32, val16, half, ef, k, selector, sample_base, sample_size)
    idx[used:] = -1
    values[used:] = 0


def topk_encode_many(xs, residuals, outs, ks, caps, *, selector, error_feedback, half, version, codec_id, digest,
                     sampling=None):
    """Whole top-k payloads of the CUDA arrays ``xs[i]`` (float32) into ``outs[i]`` (uint8), seeking ``ks[i]``
    entries in ``caps[i]`` slots (the same for the exact selector), residuals updated in place or
    :class:`._arrays.CarriedResidual`: the bytes and residuals of the codec's one-by-one encodes, in one launch
    sequence for all (:mod:`.select_grouped`). ``sampling``, for the sample selector: (seed, step, the tensors'
    keys, their sample sizes). Returns False, having done nothing, where the arrays cannot be taken together:
    encode them one by one then."""
    ef = bool(error_feedback)
    split = [split_residual(residual) for residual in residuals] if ef else None
    xs, outs, ks, caps = [device_view(x) for x in xs], [device_view(out) for out in outs], [int(k) for k in ks], \
        [int(cap) for cap in caps]
    common = dict(ef=ef, half=half, version=version, codec_id=codec_id, digest=digest)
    if selector == "exact" and ks == caps:
        return _grouped.select_exact_many(xs, split, outs, ks, **common)
    if selector == "gaussian":
        return _grouped.select_gaussian_many(xs, split, outs, ks, caps, [gaussian_z(k, x.size) for x, k in zip(xs, ks)],
                                             **common)
    if selector == "sample":
        seed, step, keys, sizes = sampling
        ranks = [sample_rank(k, x.size, m) for x, k, m in zip(xs, ks, sizes)]
        return _grouped.select_sampled_many(xs, split, outs, ks, caps,
                                            (seed_word(seed), step, PURPOSE_SAMPLE, keys, sizes, ranks), **common)
    return False


def _select_cpu(x, r, carried, idx, val32, val16, half, ef, k, selector, sample_base, sample_size):
    n = x.size
    cap = idx.size
    src = r  # acc lives in the residual after the first pass (or is x)
    if selector == "exact":
        return _exact_sampled(x, r, carried, idx, val32, val16, half, ef, k, sample_base)
    if selector == "gaussian":
        sums = np.empty(((n + _sel.CHUNK - 1) // _sel.CHUNK, 2), np.float64)
        cpu_launch(_sel.moments_cpu, n, x, r, *carried, ef, sums)
        s1, s2 = 0.0, 0.0
        for a, b in sums:  # fixed order on every device
            s1 += float(a)
            s2 += float(b)
        mu = s1 / n
        sigma = math.sqrt(max(s2 / n - mu * mu, 0.0)) if math.isfinite(s2) else float("nan")
        if not (math.isfinite(mu) and math.isfinite(sigma)):  # NaN/inf: select exactly
            return _exact_full(x, r, None, False, idx, val32, val16, half, ef, k)
        t = abs(mu) + sigma * gaussian_z(k, n)
        pending = False  # the moments pass formed acc
    elif selector == "sample":
        m = sample_size
        sample = np.empty(m, np.float32)
        cpu_launch(_sel.gather_sample_cpu, m, x, r, *carried, ef, sample_base, sample)
        t = float(exact_threshold(sample, sample_rank(k, n, m)))
        if not math.isfinite(t):
            return _exact_full(x, r, carried, ef, idx, val32, val16, half, ef, k)
        pending = ef  # the first count pass forms acc
    else:
        raise ValueError(f"unknown selector {selector!r}")
    t32, counts = _refine(src, t, k, x=x, ef_pending=pending, carried=carried)
    cpu_launch(_sel.write_thresh_cpu, n, src, t32, _exclusive(counts), cap, idx, val32, val16, half, ef)
    return min(int(counts.sum()), cap)


def sample_rank(k, n, m):
    """Rank in the m-sample whose value is the sample selector's threshold: k m / n rounded, at least 1."""
    return max(1, (k * m + n // 2) // n)


def _exact_full(x, r, carried, ef_pending, idx, val32, val16, half, ef, k):
    """Exact top-k by 3 radix histogram passes over all of acc, then compaction.

    ``r`` holds acc (or is x); ``ef_pending``: the first pass still has to
    form acc = x + ``carried``'s residual in r.  ``ef``: leave acc - sent in r.
    """
    src = r
    thresh, gt, eq = _radix_select(x, r, float_bits(src), ef_pending, k, carried=carried)
    eq_take = np.clip(k - int(gt.sum()) - _exclusive(eq), 0, eq)
    starts = _exclusive(gt + eq_take)
    cpu_launch(_sel.write_exact_cpu, src.size, src, float_bits(src), thresh, eq_take, starts, idx, val32, val16,
               half, ef, _EXACT_CHUNK)
    return min(k, idx.size)


def _exact_sampled(x, r, carried, idx, val32, val16, half, ef, k, base):
    """Exact top-k: a sampled lower bound on the threshold filters candidates.

    The j-th largest of m stratified samples of |acc| (j = kk + 4 sqrt(kk) + 4
    for kk = k m / n expected sample hits) is below the true k-th largest
    value except with probability ~1e-5; one pass counts the entries at or
    above it (forming acc = x + r on the way), one pass compacts their
    indices, and the exact radix select then runs on those ~1.6k candidates
    only.  The result is exactly the top k with ties to the lower index; if
    the bound was too high or too loose, the full radix select runs instead.
    On the CPU the counting pass collects each chunk's candidates too, as far
    as its room holds them: the compaction pass (18 of a 25M-element encode's
    40 ms) runs only for a chunk of very many.
    """
    n = x.size
    m = exact_sample_size(k, n)
    j = exact_sample_rank(k, n, m)
    if j is None:
        return _exact_full(x, r, carried, ef, idx, val32, val16, half, ef, k)
    sample = np.empty(m, np.float32)
    cpu_launch(_sel.gather_sample_cpu, m, x, r, *carried, ef, base, sample)
    t_low = exact_threshold(sample, j)
    if not np.isfinite(t_low):
        return _exact_full(x, r, carried, ef, idx, val32, val16, half, ef, k)
    # each chunk's candidates are collected as they are counted, where they fit (acc then lives in r)
    nch = (n + _sel.CHUNK - 1) // _sel.CHUNK
    # a chunk expects ~1.5 k CHUNK / n candidates (1000 at 1%); its room holds 2.7x that or more. Positions in
    # the chunk are uint16: CHUNK is 65536
    room = min(_sel.CHUNK, 4 * (k * _sel.CHUNK // n) + 1024)
    counts = np.empty(nch, np.int64)
    slots, slot_abs = np.empty((nch, room), np.uint16), np.empty((nch, room), np.float32)
    cpu_launch(_sel.count_collect_cpu, n, x, r, *carried, ef, t_low, counts, slots, slot_abs)
    total = int(counts.sum())
    if total < k or total > n // 4:
        return _exact_full(x, r, None, False, idx, val32, val16, half, ef, k)
    starts = _exclusive(counts)
    cand = np.empty(total, np.int64)
    cvals = np.empty(total, np.float32)
    if counts.max() <= room:
        cpu_launch(_sel.gather_collected_cpu, total, slots, slot_abs, counts, starts, cand, cvals)
    else:  # a chunk of many large entries: compact them from acc
        cpu_launch(_sel.compact_cpu, n, r, t_low, starts, cand)
        cpu_launch(_sel.gather_abs_cpu, total, r, cand, cvals)
    thresh, gt, eq = _radix_select(cvals, cvals, float_bits(cvals), False, k, chunk=total)
    _sel.emit_candidates(r, cand, float_bits(cvals), thresh, k - int(gt.sum()), idx, val32, val16, half, ef)
    return min(k, idx.size)


def exact_sample_size(k, n):
    """Samples behind the exact selector's lower bound: m = min(n, max(4096, ceil(64 n / k)))."""
    return min(n, max(_EXACT_SAMPLE_MIN, -(-64 * n // k)))


def sparse_accumulate(idx, values, out, *, half, bad_counts=None, slot=0):
    """out[idx[j]] += values[j] for valid entries (idx == -1 is padding).

    Returns the number of entries whose index is neither -1 nor in range.
    With ``bad_counts`` (int64 counters on the same device, from
    :func:`error_counters`) that number is added to ``bad_counts[slot]``
    instead and None is returned: one read then checks many payloads.
    """
    gpu = on_cuda(idx, values, out)
    if idx.size == 0:
        return 0 if bad_counts is None else None
    if gpu:
        idx, values, out = device_view(idx), device_view(values), device_view(out)
    val32, val16 = (empty(1, np.float32, gpu), values) if half else (values, empty(1, np.uint16, gpu))
    if not gpu:
        bad = int(cpu_launch(_sel.scatter_cpu, idx.size, idx, val32, val16, half, out, 1 << 14))
        if bad_counts is None:
            return bad
        bad_counts[slot] += bad
        return None
    counts = zeros(1, np.int64, True) if bad_counts is None else device_view(bad_counts)
    _sel.scatter_kernel[idx.size](idx, val32, val16, half, out, counts, np.int64(0 if bad_counts is None else slot))
    return int(to_host(counts, True)[0]) if bad_counts is None else None


def sparse_accumulate_many(buffer, payloads, outs, bad_counts, *, half):
    """``outs[i] +=`` the top-k payload at (byte start, capacity) ``payloads[i]`` of the CUDA array ``buffer``
    (checked by the caller), in order (an array given several times sums its payloads in that order); entries
    with an index neither valid nor -1 counted in the device counters ``bad_counts[i]``. One launch per
    payload of the most-given output, not per payload (:mod:`.select_grouped`). Returns False, having done
    nothing, where the outputs cannot be taken together."""
    return _grouped.scatter_many(device_view(buffer), [(int(start), int(cap)) for start, cap in payloads],
                                 [device_view(out) for out in outs], device_view(bad_counts), half=half)


def error_counters(n, gpu):
    """n zeroed int64 counters for :func:`sparse_accumulate`'s ``bad_counts``."""
    return zeros(n, np.int64, gpu)
