"""Sparsification cores: top-k selection (exact, Gaussian-k, sampled), random-k.

Selection works on ``acc = x + residual`` (error feedback) or on ``x``.
With error feedback the first pass over the data writes ``acc`` into the
residual array ``r``; the compaction pass then sets
``residual[i] = acc[i] - sent[i]`` for the entries it emits, where ``sent`` is
the value as transmitted (float32, or float16 rounded to nearest even), so
``sent + residual_new == x + residual_old`` in float32 (exact: the fp16
rounding error of ``acc`` is representable, Sterbenz).

The residual the first pass adds may come from a second array ``c`` (the
residual the last counted step left), so that ``c`` survives a step whose
result turns out not to count (inf or NaN: see the adapters' settle step).
``c`` may be ``r`` itself (in place). ``commit`` (int64 stamps, see
:func:`committed`) lets a GPU decide on the device whether the last step's
``r`` is that residual: then the first pass moves it into ``c`` before
overwriting ``r``, in the same pass.

All chunked passes use a fixed chunk size (``CHUNK`` elements) on every
device, so the float64 moment sums of the Gaussian selector, and hence the
selected sets, are the same on the CPU and on CUDA.  Emitted entries are
always in increasing index order.

Magnitudes are compared as the uint31 bit patterns ``bits(acc) & 0x7fffffff``
(monotone in |acc| for non-negative floats): NaN ranks above inf, so a NaN
in the gradient is selected (and sent) first instead of being hidden.
"""

import numba
import numpy as np

from ._dual import core, cpu_launcher, cuda_kernel, fmul64
from .half import f16_to_f32, f32_to_f16_rne
from .rng import payload_stream_base, random_u32
from .streaming import STREAM_MIN, stream_sum

__all__ = ["CHUNK", "stratum_index"]

CHUNK = 1 << 16
_ABS_MASK = np.uint32(0x7FFFFFFF)
_ZERO64 = np.float64(0.0)
_S32 = np.uint64(32)
_FLT_MAX = np.float32(np.finfo(np.float32).max)
_NAN32 = np.float32(np.nan)


# ------------------------------------------------------------------ cores --

@core(inline=True)
def committed(commit, stamp):
    """True where the last step's ``r`` is the residual to add: ``commit`` holds [stamp of the last step whose
    result was written, stamp of the last step whose result was not finite] (see ``finish_sum``), and that
    step's stamp is ``stamp``. An empty ``commit``: never (the residual to add is ``c``'s)."""
    return commit.size == 2 and commit[0] == stamp and commit[1] != stamp


# Where the error-feedback kernels' first pass finds the residual to add (``source``): in ``cs`` (the residual
# the last counted step left; ``rs`` receives acc), in ``rs`` itself, which moves to ``cs`` first (that step's
# new residual, which counted), or in ``rs`` updated in place (``cs`` is ``rs``: a loop without a second
# array, as fast as it was before there were two).
ADD_PREVIOUS, TAKE_TARGET, IN_PLACE = 0, 1, 2


@core
def ef_accumulate(xs, rs, cs, source):
    """rs[j] = xs[j] + the residual to add (the error-feedback accumulator), found as ``source`` says."""
    if source == TAKE_TARGET:
        for j in range(xs.size):
            v = rs[j]
            cs[j] = v
            rs[j] = xs[j] + v
    elif source == IN_PLACE:
        for j in range(xs.size):
            rs[j] = xs[j] + rs[j]
    else:
        for j in range(xs.size):
            rs[j] = xs[j] + cs[j]


@core
def hist_chunk(bits, prefix_shift, prefix, shift, mask, row):
    """Histogram of the digit ``(key >> shift) & mask`` of keys whose bits
    above ``prefix_shift`` equal ``prefix``.

    ``row`` holds 4 sub-histograms of ``mask + 1`` bins (element j counts in
    sub-histogram j % 4): runs of equal digits then do not serialise on one
    counter.  The caller adds the 4 up.
    """
    nbins = mask + 1
    ps = np.uint32(prefix_shift)
    sh = np.uint32(shift)
    um = np.uint32(mask)
    m4 = bits.size // 4
    for q in range(m4):
        for u in range(4):
            k = bits[4 * q + u] & _ABS_MASK
            if (k >> ps) == prefix:
                row[u * nbins + ((k >> sh) & um)] += 1
    for j in range(4 * m4, bits.size):
        k = bits[j] & _ABS_MASK
        if (k >> ps) == prefix:
            row[(k >> sh) & um] += 1


_LANES = 64


@core
def moments_chunk(xs, cs, add, lanes):
    """(sum, sum of squares) in float64, in a fixed order, of acc = xs + cs (float32 sums) where ``add``,
    else of xs.

    Lane u (of 64) accumulates the elements with index = u mod 64 in index
    order; the lanes are then added in lane order, then the tail.  The
    elementwise lane update vectorises on the CPU, and CUDA runs the same
    order.  ``lanes`` is float64 scratch of 2 * 64 values.
    """
    for u in range(2 * _LANES):
        lanes[u] = _ZERO64
    a = lanes[:_LANES]
    q = lanes[_LANES:]
    nb = xs.size // _LANES
    for t in range(nb):
        blk = xs[_LANES * t:_LANES * (t + 1)]
        if add:
            cblk = cs[_LANES * t:_LANES * (t + 1)]
            for u in range(_LANES):
                v = np.float64(blk[u] + cblk[u])
                a[u] += v
                q[u] += fmul64(v, v)
        else:
            for u in range(_LANES):
                v = np.float64(blk[u])
                a[u] += v
                q[u] += fmul64(v, v)
    s1 = _ZERO64
    s2 = _ZERO64
    for u in range(_LANES):
        s1 += a[u]
        s2 += q[u]
    for j in range(nb * _LANES, xs.size):
        v = np.float64(xs[j] + cs[j]) if add else np.float64(xs[j])
        s1 += v
        s2 += fmul64(v, v)
    return s1, s2


@core
def count_chunk(xs, cs, add, t):
    """Number of j with not (|acc[j]| < t) (NaN counts as selected), acc = xs + cs where ``add``, else xs."""
    c = 0
    if add:
        for j in range(xs.size):
            c += 0 if abs(xs[j] + cs[j]) < t else 1
    else:
        for j in range(xs.size):
            c += 0 if abs(xs[j]) < t else 1
    return c


@core(inline=True)
def closer_to(a, b, k):
    """Whether a count of ``a`` entries is closer to ``k`` than one of ``b``, in ratio.

    max(a, k) / min(a, k) < max(b, k) / min(b, k), cross-multiplied (exact
    in int64 for counts below 2**31); a count of 0 is never closer.
    """
    if a == 0:
        return False
    if b == 0:
        return True
    return max(a, k) * min(b, k) < max(b, k) * min(a, k)


@core(inline=True)
def emit_to(src, j, i, idx, idx_at, val32, val16, val_at, half, ef):
    """idx[idx_at] = i, the value array's [val_at] = src[j] as sent; with ``ef`` leave the residual in src[j].
    (The grouped kernels' index and value sections of a payload sit at different offsets of one span.)"""
    a = src[j]
    idx[idx_at] = i
    if half:
        h = f32_to_f16_rne(a)
        val16[val_at] = h
        sent = f16_to_f32(h)
    else:
        val32[val_at] = a
        sent = a
    if ef:
        src[j] = a - sent


@core(inline=True)
def emit(src, j, i, pos, idx, val32, val16, half, ef):
    """Write entry ``pos`` = (i, src[j]); with ``ef`` leave the residual in src[j]."""
    emit_to(src, j, i, idx, pos, val32, val16, pos, half, ef)


_BLK = 32  # block of the vectorised "any entry here?" pre-check of the write passes


@core(inline=True)
def block_has_key_at_least(bits, b0, thresh):
    blk = bits[b0:b0 + _BLK]  # a slice and a count: this form vectorises
    c = 0
    for j in range(blk.size):
        c += 1 if (blk[j] & _ABS_MASK) >= thresh else 0
    return c > 0


@core(inline=True)
def block_has_abs_at_least(src, b0, t):
    blk = src[b0:b0 + _BLK]
    c = 0
    for j in range(blk.size):
        c += 0 if abs(blk[j]) < t else 1
    return c > 0


@core
def write_exact_chunk(src, bits, i0, thresh, eq_take, start, idx, val32, val16, half, ef):
    """Emit keys > thresh and the first eq_take keys == thresh, in index order.

    Blocks of 32 are skipped after a branch-free check that nothing in them
    reaches the threshold (almost all of them for small k/n).
    """
    pos = start
    eq = 0
    m = bits.size
    for b0 in range(0, m, _BLK):
        if b0 + _BLK <= m and not block_has_key_at_least(bits, b0, thresh):
            continue
        for j in range(b0, min(m, b0 + _BLK)):
            k = bits[j] & _ABS_MASK
            if k > thresh or (k == thresh and eq < eq_take):
                if k == thresh:
                    eq += 1
                emit(src, j, i0 + j, pos, idx, val32, val16, half, ef)
                pos += 1


@core
def write_thresh_chunk(src, i0, t, start, cap, idx, val32, val16, half, ef):
    """Emit entries with not (|a| < t) while pos < cap, in index order (blocks as above)."""
    pos = start
    m = src.size
    for b0 in range(0, m, _BLK):
        if b0 + _BLK <= m and not block_has_abs_at_least(src, b0, t):
            continue
        for j in range(b0, min(m, b0 + _BLK)):
            if not (abs(src[j]) < t):
                if pos < cap:
                    emit(src, j, i0 + j, pos, idx, val32, val16, half, ef)
                pos += 1


@core
def gather_abs(src, cand, j, out):
    out[j] = abs(src[cand[j]])


@core
def emit_candidates(src, cand, cbits, thresh, eq_take, idx, val32, val16, half, ef):
    """Emit candidates with key > thresh and the first eq_take == thresh (index order)."""
    pos = 0
    eq = 0
    for j in range(cand.size):
        k = cbits[j] & _ABS_MASK
        if k > thresh or (k == thresh and eq < eq_take):
            if k == thresh:
                eq += 1
            i = cand[j]
            emit(src, i, i, pos, idx, val32, val16, half, ef)
            pos += 1
    return pos


@core(inline=True)
def value_of(val32, val16, half, j):
    if half:
        return f16_to_f32(int(val16[j]))
    return val32[j]


@core(inline=True)
def scatter_entry(idx, val32, val16, half, j, out):
    """out[idx[j]] += value j; returns 1 for an index that is neither valid nor -1."""
    i = int(idx[j])
    if i < 0 or i >= out.size:
        return 0 if i == -1 else 1
    out[i] = out[i] + value_of(val32, val16, half, j)
    return 0


@core(inline=True)
def stratum_index(n, k, j, base):
    """Index drawn uniformly in stratum j of k equal strata of range(n).

    Stratum j is [floor(j*n/k), floor((j+1)*n/k)); the offset is
    floor(u32 * size / 2**32) with 32 random bits (exact integer math).
    """
    un = np.uint64(n)
    uk = np.uint64(k)
    uj = np.uint64(j)
    lo = (uj * un) // uk
    hi = ((uj + np.uint64(1)) * un) // uk
    off = (random_u32(base, j) * (hi - lo)) >> _S32
    return int(lo + off)


@core
def gather_sample(x, r, c, source, ef, n, m, j, base, out):
    """out[j] = |acc| at the j-th stratified sample index (before the first pass formed acc)."""
    i = stratum_index(n, m, j, base)
    a = x[i] + (c[i] if source == ADD_PREVIOUS else r[i]) if ef else x[i]
    out[j] = abs(a)


@core
def randomk_gather(x, r, ef, half, factor, n, k, j, base, vals):
    """vals[j] = value sent for stratum j; with ef, r holds acc and keeps acc - sent."""
    i = stratum_index(n, k, j, base)
    a = r[i] if ef else x[i]
    a = a * factor
    if half:
        h = f32_to_f16_rne(a)
        vals[j] = f16_to_f32(h)
    else:
        vals[j] = a
    if ef:
        r[i] = a - vals[j]


@core
def nonfinite_count(xs):
    """Number of inf and NaN entries of xs (a NaN fails every comparison)."""
    count = 0
    for j in range(xs.size):
        count += 0 if abs(xs[j]) <= _FLT_MAX else 1
    return count


@core
def scale_counting_nonfinite(xs, scale, scaled):
    """xs[j] *= scale where ``scaled`` (else xs is only read); returns the number of inf and NaN results."""
    count = 0
    if scaled:
        for j in range(xs.size):
            v = xs[j] * scale
            xs[j] = v
            count += 0 if abs(v) <= _FLT_MAX else 1
    else:
        for j in range(xs.size):
            count += 0 if abs(xs[j]) <= _FLT_MAX else 1
    return count


@core
def randomk_scatter(vals, n, k, j, base, out):
    i = stratum_index(n, k, j, base)
    out[i] = out[i] + vals[j]


@core
def randomk_index(n, k, j, base, idx):
    idx[j] = stratum_index(n, k, j, base)


@core
def narrow_entry(vals, j, out16):
    """out16[j] = fp16 bits of vals[j] (round to nearest even)."""
    out16[j] = f32_to_f16_rne(vals[j])


@core
def own_chunk_entry(x, residual, c, source, j, out):
    """out[j] = x[j] + the residual to add (found as ``source`` says) and residual[j] = 0: a residual's mass
    moved into the owner's own chunk."""
    if source == TAKE_TARGET:
        v = residual[j]
        c[j] = v
    else:
        v = c[j]
    out[j] = x[j] + v
    residual[j] = np.float32(0.0)


@core
def hist_item(x, r, rc, source, bits, ef, c, chunk, prefix_shift, prefix, shift, mask, rows):
    """Histogram of chunk c (with the error-feedback accumulation when ef)."""
    lo = c * chunk
    hi = min(bits.size, lo + chunk)
    if ef:
        ef_accumulate(x[lo:hi], r[lo:hi], rc[lo:hi], source)
    hist_chunk(bits[lo:hi], prefix_shift, prefix, shift, mask, rows[c])


@core(inline=True)
def accumulate_chunk(x, r, rc, source, ef, lo, hi):
    """The error-feedback accumulation of chunk [lo, hi) when ``ef``: (the chunk of what a pass reads, the
    residual's chunk, whether that pass adds the two to find acc). Adding a second array's residual on a
    large tensor, acc is stored past the cache (:mod:`.streaming`), and the pass recomputes it from its
    cached inputs instead of reading it back."""
    xs = x[lo:hi]
    cs = rc[lo:hi]
    if ef and source == ADD_PREVIOUS and x.size >= STREAM_MIN:
        stream_sum(r[lo:hi], xs, cs)
        return xs, cs, True
    if ef:
        ef_accumulate(xs, r[lo:hi], cs, source)
        return r[lo:hi], cs, False
    return xs, cs, False


@core
def moments_item(x, r, rc, source, ef, c, sums, lanes):
    xs, cs, add = accumulate_chunk(x, r, rc, source, ef, c * CHUNK, min(x.size, (c + 1) * CHUNK))
    s1, s2 = moments_chunk(xs, cs, add, lanes)
    sums[c, 0] = s1
    sums[c, 1] = s2


@core
def write_exact_item(src, bits, c, chunk, thresh, eq_take, starts, idx, val32, val16, half, ef):
    lo = c * chunk
    hi = min(src.size, lo + chunk)
    write_exact_chunk(src[lo:hi], bits[lo:hi], lo, thresh, eq_take[c], starts[c],
                      idx, val32, val16, half, ef)


@core
def write_thresh_item(src, c, t, starts, cap, idx, val32, val16, half, ef):
    lo = c * CHUNK
    hi = min(src.size, lo + CHUNK)
    write_thresh_chunk(src[lo:hi], lo, t, starts[c], cap, idx, val32, val16, half, ef)


@core
def count_item(x, r, rc, source, ef, c, t, counts):
    """Count of chunk c at threshold t (after the error-feedback accumulation if ef)."""
    xs, cs, add = accumulate_chunk(x, r, rc, source, ef, c * CHUNK, min(x.size, (c + 1) * CHUNK))
    counts[c] = count_chunk(xs, cs, add, t)


@core
def compact_item(src, c, t, starts, cand):
    """The indices i of chunk c with not (|src[i]| < t) into cand from starts[c], in index order (cand holds
    every chunk's, as counted). Branch-free through a scratch one entry longer: every index is written, the
    position advances on a hit (the exact selector's ~1.6k candidates per 100 coordinates put one in 40% of
    32-blocks, which defeated the block pre-check of the write passes: 1.4x slower)."""
    lo = c * CHUNK
    xs = src[lo:min(src.size, lo + CHUNK)]
    start = starts[c]
    count = (starts[c + 1] if c + 1 < starts.size else cand.size) - start
    scratch = np.empty(count + 1, np.int64)
    pos = 0
    for j in range(xs.size):
        scratch[min(pos, count)] = lo + j
        pos += 0 if abs(xs[j]) < t else 1
    cand[start:start + count] = scratch[:count]


@core
def mark_hits(xs, cs, add, t, hits):
    """hits[j] = 1 where not (|acc[j]| < t), acc = xs + cs when ``add`` else xs (a loop that vectorises)."""
    if add:
        for j in range(xs.size):
            hits[j] = 0 if abs(xs[j] + cs[j]) < t else 1
    else:
        for j in range(xs.size):
            hits[j] = 0 if abs(xs[j]) < t else 1


@core
def collect_hits(xs, cs, add, hits, slot, slot_abs):
    """The positions of the hits in order into ``slot``, and |acc| there into ``slot_abs``, as far as they
    hold; returns the number of hits. Eight marks are tested as one word: at the exact selector's ~1.6%
    candidates most words are zero."""
    n = xs.size
    words = hits[:n - n % 8].view(np.uint64)
    cap = slot.size
    pos = 0
    for w in range(words.size):
        if words[w]:
            for j in range(8 * w, 8 * w + 8):
                if hits[j]:
                    if pos < cap:
                        slot[pos] = j
                        slot_abs[pos] = abs(xs[j] + cs[j]) if add else abs(xs[j])
                    pos += 1
    for j in range(8 * words.size, n):
        if hits[j]:
            if pos < cap:
                slot[pos] = j
                slot_abs[pos] = abs(xs[j] + cs[j]) if add else abs(xs[j])
            pos += 1
    return pos


@core
def count_collect_item(x, r, rc, source, ef, c, t, counts, slots, slot_abs):
    """:func:`count_item` that also collects chunk c's hits (see :func:`collect_hits`), in the pass that
    forms acc: the compaction pass over all of acc is then not needed."""
    xs, cs, add = accumulate_chunk(x, r, rc, source, ef, c * CHUNK, min(x.size, (c + 1) * CHUNK))
    hits = np.empty(xs.size, np.uint8)
    mark_hits(xs, cs, add, t, hits)
    counts[c] = collect_hits(xs, cs, add, hits, slots[c], slot_abs[c])


@core
def gather_collected_item(slots, slot_abs, counts, starts, c, cand, cvals):
    start = starts[c]
    for j in range(counts[c]):
        cand[start + j] = c * CHUNK + slots[c, j]
        cvals[start + j] = slot_abs[c, j]


@core
def ef_accumulate_item(x, r, rc, source, c):
    lo = c * CHUNK
    hi = min(x.size, lo + CHUNK)
    ef_accumulate(x[lo:hi], r[lo:hi], rc[lo:hi], source)


# ------------------------------------------------------------ CPU launchers --

@cpu_launcher
def ef_accumulate_cpu(x, r, rc, source):
    for c in numba.prange((x.size + CHUNK - 1) // CHUNK):
        ef_accumulate_item(x, r, rc, source, c)


@cpu_launcher
def hist_cpu(x, r, rc, source, bits, ef, prefix_shift, prefix, shift, mask, rows, chunk):
    for c in numba.prange(rows.shape[0]):
        hist_item(x, r, rc, source, bits, ef, c, chunk, prefix_shift, prefix, shift, mask, rows)


@cpu_launcher
def moments_cpu(x, r, rc, source, ef, sums):
    for c in numba.prange(sums.shape[0]):
        moments_item(x, r, rc, source, ef, c, sums, np.empty(2 * _LANES, np.float64))


@cpu_launcher
def count_cpu(x, r, rc, source, ef, t, counts):
    for c in numba.prange(counts.size):
        count_item(x, r, rc, source, ef, c, t, counts)


@cpu_launcher
def count_collect_cpu(x, r, rc, source, ef, t, counts, slots, slot_abs):
    for c in numba.prange(counts.size):
        count_collect_item(x, r, rc, source, ef, c, t, counts, slots, slot_abs)


@cpu_launcher
def gather_collected_cpu(slots, slot_abs, counts, starts, cand, cvals):
    for c in numba.prange(counts.size):
        gather_collected_item(slots, slot_abs, counts, starts, c, cand, cvals)


@cpu_launcher
def compact_cpu(src, t, starts, cand):
    for c in numba.prange(starts.size):
        compact_item(src, c, t, starts, cand)


@cpu_launcher
def gather_abs_cpu(src, cand, out):
    for j in numba.prange(cand.size):
        gather_abs(src, cand, j, out)


@cpu_launcher
def write_exact_cpu(src, bits, thresh, eq_take, starts, idx, val32, val16, half, ef, chunk):
    for c in numba.prange(starts.size):
        write_exact_item(src, bits, c, chunk, thresh, eq_take, starts, idx, val32, val16, half, ef)


@cpu_launcher
def write_thresh_cpu(src, t, starts, cap, idx, val32, val16, half, ef):
    for c in numba.prange(starts.size):
        write_thresh_item(src, c, t, starts, cap, idx, val32, val16, half, ef)


@cpu_launcher
def scatter_cpu(idx, val32, val16, half, out, chunk):
    m = idx.size
    nch = (m + chunk - 1) // chunk
    bad = np.zeros(nch, np.int64)
    for c in numba.prange(nch):
        for j in range(c * chunk, min(m, (c + 1) * chunk)):
            bad[c] += scatter_entry(idx, val32, val16, half, j, out)
    return bad.sum()


@cpu_launcher
def gather_sample_cpu(x, r, rc, source, ef, base, out):
    n = x.size
    m = out.size
    for j in numba.prange(m):
        gather_sample(x, r, rc, source, ef, n, m, j, base, out)


@cpu_launcher
def randomk_gather_cpu(x, r, ef, half, factor, base, vals):
    n = x.size
    k = vals.size
    for j in numba.prange(k):
        randomk_gather(x, r, ef, half, factor, n, k, j, base, vals)


@cpu_launcher
def nonfinite_counts_cpu(src, counts):
    for c in numba.prange(counts.size):
        counts[c] = nonfinite_count(src[c * CHUNK:min(src.size, (c + 1) * CHUNK)])


@cpu_launcher
def finish_sum_cpu(src, scale, scaled, counts):
    for c in numba.prange(counts.size):
        counts[c] = scale_counting_nonfinite(src[c * CHUNK:min(src.size, (c + 1) * CHUNK)], scale, scaled)


@cpu_launcher
def randomk_scatter_payload_cpu(vals, meta, seed_w, purpose, out):
    base = payload_stream_base(meta, seed_w, purpose)
    n = out.size
    k = vals.size
    for j in numba.prange(k):
        randomk_scatter(vals, n, k, j, base, out)


@cpu_launcher
def narrow_f16_cpu(vals, out16):
    for j in numba.prange(vals.size):
        narrow_entry(vals, j, out16)


@cpu_launcher
def own_chunk_cpu(x, residual, rc, source, out):
    for j in numba.prange(out.size):
        own_chunk_entry(x, residual, rc, source, j, out)


@cpu_launcher
def randomk_scatter_cpu(vals, base, out):
    n = out.size
    k = vals.size
    for j in numba.prange(k):
        randomk_scatter(vals, n, k, j, base, out)


@cpu_launcher
def randomk_index_cpu(n, base, idx):
    k = idx.size
    for j in numba.prange(k):
        randomk_index(n, k, j, base, idx)


# ----------------------------------------------------------- CUDA kernels --

@cuda_kernel
def scatter_kernel(idx, val32, val16, half, out, bad, slot):
    j = cuda.grid(1)  # noqa: F821
    if j < idx.size:
        if scatter_entry(idx, val32, val16, half, j, out):
            cuda.atomic.add(bad, slot, 1)  # noqa: F821


@cuda_kernel
def gather_sample_kernel(x, r, rc, commit, stamp, ef, base, out):
    j = cuda.grid(1)  # noqa: F821
    if j < out.size:
        gather_sample(x, r, rc, TAKE_TARGET if committed(commit, stamp) else ADD_PREVIOUS, ef, x.size, out.size, j,
                      base, out)


@cuda_kernel
def randomk_gather_kernel(x, r, ef, half, factor, base, vals):
    j = cuda.grid(1)  # noqa: F821
    if j < vals.size:
        randomk_gather(x, r, ef, half, factor, x.size, vals.size, j, base, vals)


@cuda_kernel
def poison_if_nonfinite_kernel(src, vals):
    i = cuda.grid(1)  # noqa: F821
    if i < src.size and not (abs(src[i]) <= _FLT_MAX):
        vals[0] = _NAN32  # every thread that writes writes the same value


@cuda_kernel
def finish_sum_kernel(src, scale, stamps, stamp, counter):
    """src *= scale[0], grid-stride; stamps[0] = stamp, and stamps[1] = stamp where a result is inf or NaN, which
    the call that raises stamps[1] first counts once in counter[0]."""
    i = cuda.grid(1)  # noqa: F821
    stride = cuda.gridsize(1)  # noqa: F821
    factor = scale[0]
    bad = False
    while i < src.size:
        v = src[i] * factor
        src[i] = v
        bad = bad or not (abs(v) <= _FLT_MAX)
        i += stride
    if cuda.grid(1) == 0:  # noqa: F821
        stamps[0] = stamp
    if bad and cuda.atomic.max(stamps, 1, stamp) < stamp:  # noqa: F821
        cuda.atomic.add(counter, 0, 1)  # noqa: F821


@cuda_kernel
def randomk_scatter_payload_kernel(vals, meta, seed_w, purpose, out):
    j = cuda.grid(1)  # noqa: F821
    if j < vals.size:
        randomk_scatter(vals, out.size, vals.size, j, payload_stream_base(meta, seed_w, purpose), out)


@cuda_kernel
def narrow_f16_kernel(vals, out16):
    j = cuda.grid(1)  # noqa: F821
    if j < vals.size:
        narrow_entry(vals, j, out16)


@cuda_kernel
def own_chunk_kernel(x, residual, rc, commit, stamp, out):
    j = cuda.grid(1)  # noqa: F821
    if j < out.size:
        own_chunk_entry(x, residual, rc, TAKE_TARGET if committed(commit, stamp) else ADD_PREVIOUS, j, out)


@cuda_kernel
def randomk_scatter_kernel(vals, base, out):
    j = cuda.grid(1)  # noqa: F821
    if j < vals.size:
        randomk_scatter(vals, out.size, vals.size, j, base, out)


@cuda_kernel
def randomk_index_kernel(n, base, idx):
    j = cuda.grid(1)  # noqa: F821
    if j < idx.size:
        randomk_index(n, idx.size, j, base, idx)
