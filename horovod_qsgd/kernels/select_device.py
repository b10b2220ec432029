"""Top-k selection kernels for a GPU: every decision is made on the device.

:mod:`.topk` drives the CPU selection from the host (it reads histograms
and counts back and chooses digits and thresholds in Python). On a GPU each
such read drains the stream, so here the choices are kernels too, and the
host only queues launches: a whole encode makes no host copy.

Shape of the work:

* histograms: grid-stride blocks of ``B`` threads, counting in a
  shared-memory histogram that each block adds to the global one;
* choices (the radix digit, the threshold's refinement): one block scans
  the histogram in parallel, or one thread decides from a few scalars;
* ordered output: ``TILE``-element tiles, one block each (``ITEMS``
  consecutive elements per thread): a count kernel per tile, a one-block
  prefix sum over the tiles, then each tile writes its entries from its
  offset plus a block-wide prefix sum, so the output stays in index order.

The decisions live in a small int64 state array (and a float64 one for the
threshold refinement), written by one kernel and read by the next on the
same stream.  Kernels of a branch that the state rules out (the exact
fallback of Gaussian-k when its moments are not finite, the refinement
rounds after the band is reached) return at once: the host cannot know
which branch runs without a read.  The selected sets, their order and the
residuals are bit for bit the CPU path's (scripts/cuda_check.py).
"""

import math

import numba
import numpy as np

from ._arrays import empty, float_bits, to_host
from ._dual import cuda_kernel, fmul64, gpu_only
from .scan import _SIMULATED, B, block_exclusive_scan
from .select import CHUNK, _LANES, closer_to, committed, emit, gather_sample_kernel

__all__ = ["accumulate", "select_exact", "select_by_threshold", "exact_threshold", "RADIX_DIGITS", "REFINEMENTS"]

# B threads per block (from .scan); in numba's simulator fewer threads take more elements each
ITEMS = 64 if _SIMULATED else 8  # consecutive elements per thread in a tile
TILE = B * ITEMS  # elements per tile (one block)
NBINS = 2048  # bins of the widest radix digit (11 bits)
HIST_ITEMS = 256 if _SIMULATED else 16  # elements per thread at least, in a histogram launch
MAX_HIST_BLOCKS = 4096
RADIX_DIGITS = ((20, 11), (10, 10), (0, 10))  # (shift, width) of the radix passes over 31-bit keys
REFINEMENTS = 3  # threshold refinements after the first count
RADIX_BINS = sum(1 << width for _, width in RADIX_DIGITS)
HIST_SIZE = 2 * RADIX_BINS  # a selection's histograms, then its sample's

# int64 state
S_MODE = 0  # what the selection runs over: MODE_*
S_COUNT = 1  # elements of the list being selected from (all of acc, or the candidates)
S_PREFIX = 2  # the radix prefix chosen so far; after the last pass, the threshold key
S_RANK = 3  # rank sought within the prefix; after the last pass, how many keys equal to the threshold to send
S_USED = 4  # entries written (the rest is padding)
S_DONE = 5  # the threshold refinement has finished
S_CHOSEN = 6  # the refinement round whose threshold (and tile counts) is used
S_BEST = 7  # the round whose count is closest to k so far
S_BOUND_TOTAL = 8  # entries at or above the sampled lower bound (exact selector)
S_ROUND_TOTAL = 9  # entries passing round r's threshold: S_ROUND_TOTAL + r
STATE_SIZE = 16

# float64 state of the threshold refinement
F_T, F_LO, F_HI, F_BEST_T, F_FINAL = 0, 1, 2, 3, 4
FSTATE_SIZE = 8

MODE_FULL, MODE_CANDIDATES, MODE_THRESHOLD = 0, 1, 2

# rows of the per-tile counts
R_GT, R_EQ, R_BOUND, R_ROUND = 0, 1, 2, 3  # R_ROUND + r for refinement round r
TILE_ROWS = 7

_ABS_MASK = 0x7FFFFFFF
_EQ_ONE = 1 << 32  # an equal key counts in the high half of a packed count, a greater one in the low half
_LOW32 = (1 << 32) - 1
_ZERO64 = np.float64(0.0)
_NAN64 = np.float64(np.nan)


@gpu_only
def key_class(key, thresh):
    """1 for a key above the threshold key, _EQ_ONE for one equal to it, else 0."""
    if key > thresh:
        return 1
    return _EQ_ONE if key == thresh else 0


@cuda_kernel
def init_state_kernel(st, ft, mode, count, rank, used, hist):
    """One block: the state of a selection, and its histograms zeroed."""
    for b in range(cuda.threadIdx.x, hist.size, B):  # noqa: F821
        hist[b] = 0
    if cuda.threadIdx.x == 0:  # noqa: F821
        for s in range(STATE_SIZE):
            st[s] = 0
        for s in range(FSTATE_SIZE):
            ft[s] = _NAN64
        st[S_MODE] = mode
        st[S_COUNT] = count
        st[S_RANK] = rank
        st[S_USED] = used


@gpu_only
def residual_to_add(r, rc, take_r, i):
    """The residual the first pass adds at i: rc's, or with ``take_r`` r's own, moved to rc first
    (:func:`.select.committed`)."""
    if take_r:
        v = r[i]
        rc[i] = v
        return v
    return rc[i]


@cuda_kernel
def accumulate_kernel(x, r, rc, commit, stamp):
    """r = x + the residual to add (the error-feedback accumulator), grid-stride."""
    take_r = committed(commit, stamp)
    i = cuda.grid(1)  # noqa: F821
    stride = cuda.gridsize(1)  # noqa: F821
    while i < r.size:
        r[i] = x[i] + residual_to_add(r, rc, take_r, i)
        i += stride


# ------------------------------------------------------------ radix select --

@cuda_kernel
def radix_hist_kernel(keys, cand_keys, st, prefix_shift, shift, width, hist):
    """hist[d] += number of keys with digit d = (key >> shift) & (2**width - 1) among those whose
    bits above ``prefix_shift`` are the state's prefix; keys are the float bits of acc
    (``cand_keys`` in MODE_CANDIDATES).  Nothing in MODE_THRESHOLD."""
    sh = cuda.shared.array(NBINS, numba.int32)  # noqa: F821
    t = cuda.threadIdx.x  # noqa: F821
    mode = st[S_MODE]
    if mode == MODE_THRESHOLD:
        return
    nbins = 1 << width
    for b in range(t, nbins, B):
        sh[b] = 0
    cuda.syncthreads()  # noqa: F821
    count = st[S_COUNT]
    prefix = st[S_PREFIX]
    mask = nbins - 1
    i = cuda.blockIdx.x * B + t  # noqa: F821
    stride = cuda.gridDim.x * B  # noqa: F821
    while i < count:
        key = np.int64(cand_keys[i] if mode == MODE_CANDIDATES else keys[i]) & _ABS_MASK
        if (key >> prefix_shift) == prefix:
            cuda.atomic.add(sh, (key >> shift) & mask, 1)  # noqa: F821
        i += stride
    cuda.syncthreads()  # noqa: F821
    for b in range(t, nbins, B):
        c = sh[b]
        if c:
            cuda.atomic.add(hist, b, c)  # noqa: F821


@gpu_only
def find_digit(buf, t, hist, nbins, rank):
    """Thread t's part of a block's search of a histogram of ``nbins`` bins (a multiple of B) for the bin
    holding ``rank``, counted from the top: (that bin, the rank within it) for the one thread whose
    segment holds it, (-1, 0) for the others.  Callers write what they found after it returns: every
    thread has passed the block's barriers by then."""
    per = nbins // B
    hi = nbins - t * per  # thread t sums bins [lo, hi), the t-th segment from the top
    lo = hi - per
    s = 0
    for b in range(lo, hi):
        s += hist[b]
    above, _ = block_exclusive_scan(buf, t, s)
    if above < rank and rank <= above + s:
        b = hi - 1
        while b >= lo:
            c = hist[b]
            if above + c >= rank:
                return b, rank - above
            above += c
            b -= 1
    return -1, 0


@cuda_kernel
def radix_choose_kernel(hist, st, width, bits_out):
    """One block: the digit holding the state's rank (counted from the top), appended to the prefix;
    the rank becomes the rank within that digit.  ``bits_out[0]`` gets the new prefix (after the last
    pass: the k-th largest key, i.e. the float bits of the threshold)."""
    buf = cuda.shared.array(B, numba.int64)  # noqa: F821
    t = cuda.threadIdx.x  # noqa: F821
    if st[S_MODE] == MODE_THRESHOLD:
        return
    prefix = st[S_PREFIX]
    digit, rank = find_digit(buf, t, hist, 1 << width, st[S_RANK])
    if digit >= 0:
        st[S_RANK] = rank
        st[S_PREFIX] = (prefix << width) | digit
        bits_out[0] = (prefix << width) | digit


@gpu_only
def tile_class_count(keys, at, n, tile, t, thresh):
    """Of thread t's ITEMS consecutive elements of the tile of keys[at:at + n]: keys above ``thresh`` (low
    half) and equal to it (high half)."""
    c = 0
    for u in range(ITEMS):
        p = tile * TILE + t * ITEMS + u
        if p < n:
            c += key_class(np.int64(keys[at + p]) & _ABS_MASK, thresh)
    return c


@cuda_kernel
def exact_count_kernel(keys, cand_keys, st, tiles):
    """Per tile of the list: keys above the threshold key (row R_GT) and equal to it (R_EQ)."""
    buf = cuda.shared.array(B, numba.int64)  # noqa: F821
    t = cuda.threadIdx.x  # noqa: F821
    tile = cuda.blockIdx.x  # noqa: F821
    mode = st[S_MODE]
    count = st[S_COUNT]
    if mode == MODE_THRESHOLD or tile * TILE >= count:
        return
    listed = cand_keys if mode == MODE_CANDIDATES else keys
    _, total = block_exclusive_scan(buf, t, tile_class_count(listed, 0, count, tile, t, st[S_PREFIX]))
    if t == 0:
        tiles[R_GT, tile] = total & _LOW32
        tiles[R_EQ, tile] = total >> 32


# -------------------------------------------- candidates (exact selector) --

@gpu_only
def at_least(a, bound):
    """1 where not (|a| < bound): the threshold selectors' rule, NaN included (:func:`.select.count_chunk`)."""
    return 0 if abs(a) < bound else 1


@gpu_only
def thread_count_at_least(x, r, rc, take_r, accumulate, bound, tile, t):
    """Of thread t's elements of the tile: how many have not (|acc| < bound); with ``accumulate``,
    r = x + the residual to add first."""
    c = 0
    for u in range(ITEMS):
        i = tile * TILE + t * ITEMS + u
        if i < r.size:
            if accumulate:
                a = x[i] + residual_to_add(r, rc, take_r, i)
                r[i] = a
            else:
                a = r[i]
            c += 0 if abs(a) < bound else 1
    return c


@cuda_kernel
def bound_count_kernel(x, r, rc, commit, stamp, accumulate, low, tiles, st):
    """Per tile: entries with not (|acc| < low[0]) (the sampled lower bound), row R_BOUND, and their
    total; with ``accumulate``, first r = x + the residual to add (acc)."""
    buf = cuda.shared.array(B, numba.int64)  # noqa: F821
    t = cuda.threadIdx.x  # noqa: F821
    tile = cuda.blockIdx.x  # noqa: F821
    take_r = committed(commit, stamp)
    _, total = block_exclusive_scan(buf, t, thread_count_at_least(x, r, rc, take_r, accumulate, low[0], tile, t))
    if t == 0:
        tiles[R_BOUND, tile] = total
        cuda.atomic.add(st, S_BOUND_TOTAL, total)  # noqa: F821


@cuda_kernel
def bound_decide_kernel(low, st, k, capacity):
    """Select among the candidates when the bound is finite and leaves k to ``capacity`` of them."""
    if cuda.grid(1) == 0:  # noqa: F821
        total = st[S_BOUND_TOTAL]
        if math.isfinite(low[0]) and total >= k and total <= capacity:
            st[S_MODE] = MODE_CANDIDATES
            st[S_COUNT] = total


@cuda_kernel
def compact_kernel(r, keys, low, starts, st, cand_idx, cand_keys):
    """The candidates' indices and keys, in index order (MODE_CANDIDATES only)."""
    buf = cuda.shared.array(B, numba.int64)  # noqa: F821
    t = cuda.threadIdx.x  # noqa: F821
    tile = cuda.blockIdx.x  # noqa: F821
    if st[S_MODE] != MODE_CANDIDATES:
        return
    bound = low[0]
    c = 0
    for u in range(ITEMS):
        i = tile * TILE + t * ITEMS + u
        if i < r.size and not (abs(r[i]) < bound):
            c += 1
    before, _ = block_exclusive_scan(buf, t, c)
    pos = starts[0, tile] + before
    for u in range(ITEMS):
        i = tile * TILE + t * ITEMS + u
        if i < r.size and not (abs(r[i]) < bound):
            cand_idx[pos] = i
            cand_keys[pos] = keys[i]
            pos += 1


# ------------------------------------------ thresholds (approximate) --

@gpu_only
def acc_value(x, r, rc, take_r, ef, i):
    """acc[i] in float64; with ``ef``, r[i] = x[i] + the residual to add (float32) first."""
    a = x[i]
    if ef:
        a = a + residual_to_add(r, rc, take_r, i)
        r[i] = a
    return np.float64(a)


@gpu_only
def chunk_moments(x, r, rc, take_r, ef, at, lo, hi, lane_sum, lane_sq, u):
    """(sum, sum of squares) of acc[at + lo:at + hi] in float64, in :func:`.select.moments_chunk`'s order, for
    thread u of a block of 64 (the others get partial sums): thread u is lane u (elements u mod 64, in index
    order), then thread 0 adds the lanes in lane order and the tail. ``lane_sum``, ``lane_sq``: the block's
    shared arrays of 64. With ``ef``, r = x + the residual to add on the way (:func:`acc_value`)."""
    blocks = (hi - lo) // _LANES
    s1 = _ZERO64
    s2 = _ZERO64
    for q in range(blocks):
        v = acc_value(x, r, rc, take_r, ef, at + lo + q * _LANES + u)
        s1 += v
        s2 += fmul64(v, v)
    lane_sum[u] = s1
    lane_sq[u] = s2
    cuda.syncthreads()  # noqa: F821
    if u == 0:
        s1 = _ZERO64
        s2 = _ZERO64
        for w in range(_LANES):
            s1 += lane_sum[w]
            s2 += lane_sq[w]
        for i in range(at + lo + blocks * _LANES, at + hi):
            v = acc_value(x, r, rc, take_r, ef, i)
            s1 += v
            s2 += fmul64(v, v)
    return s1, s2


@cuda_kernel
def moments_block_kernel(x, r, rc, commit, stamp, ef, sums):
    """sums[c] = (sum, sum of squares) of chunk c of acc (:func:`chunk_moments`): one block of 64 threads per
    chunk. With ``ef``, r = x + r on the way."""
    lane_sum = cuda.shared.array(_LANES, numba.float64)  # noqa: F821
    lane_sq = cuda.shared.array(_LANES, numba.float64)  # noqa: F821
    u = cuda.threadIdx.x  # noqa: F821
    c = cuda.blockIdx.x  # noqa: F821
    lo = c * CHUNK
    s1, s2 = chunk_moments(x, r, rc, committed(commit, stamp), ef, 0, lo, min(x.size, lo + CHUNK), lane_sum, lane_sq,
                           u)
    if u == 0:
        sums[c, 0] = s1
        sums[c, 1] = s2


@gpu_only
def gaussian_threshold(s1, s2, n, z, st, ft):
    """t = |mu| + sigma * z from acc's sum and sum of squares (float64); MODE_FULL if not finite."""
    nf = np.float64(n)
    mu = s1 / nf
    sigma = _NAN64
    if math.isfinite(s2):
        sigma = math.sqrt(max(s2 / nf - fmul64(mu, mu), _ZERO64))
    if math.isfinite(mu) and math.isfinite(sigma):
        ft[F_T] = abs(mu) + fmul64(sigma, z)
        st[S_MODE] = MODE_THRESHOLD
    else:
        st[S_MODE] = MODE_FULL


@cuda_kernel
def gaussian_threshold_kernel(sums, n, z, st, ft):
    """The Gaussian threshold from the chunks' moments, added in chunk order."""
    if cuda.grid(1) == 0:  # noqa: F821
        s1 = _ZERO64
        s2 = _ZERO64
        for c in range(sums.shape[0]):
            s1 += sums[c, 0]
            s2 += sums[c, 1]
        gaussian_threshold(s1, s2, n, z, st, ft)


@gpu_only
def sample_threshold(t, st, ft):
    """The sampled threshold ``t`` (a float32's value) starts the refinement; MODE_FULL if not finite."""
    if math.isfinite(t):
        ft[F_T] = t
        st[S_MODE] = MODE_THRESHOLD
    else:
        st[S_MODE] = MODE_FULL


@cuda_kernel
def sample_threshold_kernel(threshold, st, ft):
    if cuda.grid(1) == 0:  # noqa: F821
        sample_threshold(np.float64(threshold[0]), st, ft)


@cuda_kernel
def round_count_kernel(x, r, rc, commit, stamp, accumulate, st, ft, rnd, tiles):
    """Per tile: entries with not (|acc| < float32(t)), row R_ROUND + rnd, and their total, while the
    refinement runs; with ``accumulate``, r = x + the residual to add first (always)."""
    buf = cuda.shared.array(B, numba.int64)  # noqa: F821
    t = cuda.threadIdx.x  # noqa: F821
    tile = cuda.blockIdx.x  # noqa: F821
    active = st[S_MODE] == MODE_THRESHOLD and st[S_DONE] == 0
    if not (accumulate or active):
        return
    c = thread_count_at_least(x, r, rc, committed(commit, stamp), accumulate, np.float32(ft[F_T]), tile, t)
    if active:
        _, total = block_exclusive_scan(buf, t, c)
        if t == 0:
            tiles[R_ROUND + rnd, tile] = total
            cuda.atomic.add(st, S_ROUND_TOTAL + rnd, total)  # noqa: F821


@gpu_only
def finish_refinement(st, ft, rnd, t, total, capacity):
    st[S_DONE] = 1
    st[S_CHOSEN] = rnd
    st[S_USED] = min(total, capacity)
    ft[F_FINAL] = t


@gpu_only
def refine_step(st, ft, rnd, k, capacity, last):
    """One refinement step after round ``rnd``'s count, as :func:`.topk._refine` takes it on the host."""
    if st[S_MODE] != MODE_THRESHOLD or st[S_DONE] != 0:
        return
    total = st[S_ROUND_TOTAL + rnd]
    t = ft[F_T]
    if 2 * k <= 3 * total and 3 * total <= 4 * k:
        finish_refinement(st, ft, rnd, t, total, capacity)
        return
    if rnd == 0 or closer_to(total, st[S_ROUND_TOTAL + st[S_BEST]], k):
        st[S_BEST] = rnd
        ft[F_BEST_T] = t
    if rnd == last:
        best = st[S_BEST]
        finish_refinement(st, ft, best, ft[F_BEST_T], st[S_ROUND_TOTAL + best], capacity)
        return
    if 3 * total < 2 * k:
        ft[F_HI] = t
        lo = ft[F_LO]
        ft[F_T] = t / 2 if math.isnan(lo) else (lo + t) / 2
    else:
        ft[F_LO] = t
        hi = ft[F_HI]
        ft[F_T] = t * 1.5 if math.isnan(hi) else (hi + t) / 2


@cuda_kernel
def refine_kernel(st, ft, rnd, k, capacity, last):
    if cuda.grid(1) == 0:  # noqa: F821
        refine_step(st, ft, rnd, k, capacity, last)


# ------------------------------------------------------------------ output --

@cuda_kernel
def tile_scan_kernel(tiles, st, row, starts):
    """One block: starts[0] = exclusive prefix sums over the list's tiles of tile row ``row``; for
    ``row`` < 0 the selection's own rows: the chosen round's (MODE_THRESHOLD), or R_GT into
    starts[0] and R_EQ into starts[1]."""
    buf = cuda.shared.array(B, numba.int64)  # noqa: F821
    t = cuda.threadIdx.x  # noqa: F821
    mode = st[S_MODE]
    ntiles = (st[S_COUNT] + TILE - 1) // TILE
    per = (ntiles + B - 1) // B
    lo = min(ntiles, t * per)
    hi = min(ntiles, lo + per)
    rows = 1 if row >= 0 or mode == MODE_THRESHOLD else 2
    for which in range(rows):
        if which == 1:
            source = R_EQ
        elif row >= 0:
            source = row
        else:
            source = R_ROUND + st[S_CHOSEN] if mode == MODE_THRESHOLD else R_GT
        scan_tiles(buf, t, tiles, source, starts, which, lo, hi)


@gpu_only
def scan_tiles(buf, t, tiles, source, starts, which, lo, hi):
    """Thread t's share [lo, hi) of a block-wide exclusive prefix sum of ``tiles[source]`` into ``starts[which]``
    (the block's threads take consecutive shares in order)."""
    c = 0
    for j in range(lo, hi):
        c += tiles[source, j]
    acc, _ = block_exclusive_scan(buf, t, c)
    for j in range(lo, hi):
        starts[which, j] = acc
        acc += tiles[source, j]


@cuda_kernel
def write_kernel(src, keys, cand_idx, cand_keys, st, ft, starts, idx, val32, val16, half, ef, capacity):
    """Each tile writes its selected entries in index order from its offset (see :func:`.select.emit`).

    MODE_THRESHOLD: entries with not (|acc| < float32(final t)), the first ``capacity`` of them.
    Otherwise keys above the threshold key and the first S_RANK keys equal to it, over all of acc or
    the candidates.
    """
    buf = cuda.shared.array(B, numba.int64)  # noqa: F821
    t = cuda.threadIdx.x  # noqa: F821
    tile = cuda.blockIdx.x  # noqa: F821
    mode = st[S_MODE]
    count = st[S_COUNT]
    if tile * TILE >= count:
        return
    by_value = mode == MODE_THRESHOLD
    t32 = np.float32(ft[F_FINAL])
    thresh = st[S_PREFIX]
    eq_take = st[S_RANK]
    eq_before = 0 if by_value else starts[1, tile]
    eq_left = max(eq_take - eq_before, 0)  # of the equal keys from this tile on, how many are sent
    c = 0
    for u in range(ITEMS):
        p = tile * TILE + t * ITEMS + u
        if p < count:
            if by_value:
                c += 0 if abs(src[p]) < t32 else 1
            else:
                c += key_class(np.int64(cand_keys[p] if mode == MODE_CANDIDATES else keys[p]) & _ABS_MASK,
                               thresh)
    before, _ = block_exclusive_scan(buf, t, c)
    eq_seen = before >> 32
    pos = starts[0, tile] + min(eq_before, eq_take) + (before & _LOW32) + min(eq_seen, eq_left)
    for u in range(ITEMS):
        p = tile * TILE + t * ITEMS + u
        if p < count:
            i = cand_idx[p] if mode == MODE_CANDIDATES else p
            if by_value:
                cls = 0 if abs(src[i]) < t32 else 1
            else:
                cls = key_class(np.int64(cand_keys[p] if mode == MODE_CANDIDATES else keys[p]) & _ABS_MASK,
                                thresh)
            if cls == 1 or (cls == _EQ_ONE and eq_seen < eq_left):
                if pos < capacity:
                    emit(src, i, i, pos, idx, val32, val16, half, ef)
                pos += 1
            if cls == _EQ_ONE:
                eq_seen += 1


@cuda_kernel
def pad_kernel(st, idx, val32, val16, half):
    """Slots from the state's used count on: index -1, value 0."""
    j = cuda.grid(1)  # noqa: F821
    if j < idx.size and j >= st[S_USED]:
        idx[j] = -1
        if half:
            val16[j] = 0
        else:
            val32[j] = 0


# ---------------------------------------------------------- launch order --

class _Scratch:
    """Device scratch of one selection over n elements, from the current allocator."""

    def __init__(self, n):
        self.ntiles = -(-n // TILE)
        states = empty(2 * STATE_SIZE, np.int64, True)
        self.main, self.sample = states[:STATE_SIZE], states[STATE_SIZE:]
        self.fstate = empty(FSTATE_SIZE, np.float64, True)
        self.hist = empty(HIST_SIZE, np.int32, True)  # the main select's, then the sample's
        self.tiles = empty((TILE_ROWS, self.ntiles), np.int64, True)
        self.starts = empty((2, self.ntiles), np.int64, True)
        self.bits = empty(1, np.uint32, True)  # a radix select's result, read as a float32 by later kernels
        self.no_candidates = empty(1, np.int32, True)


def _init(state, fstate, mode, count, rank, used, hist):
    init_state_kernel.blocks(1, B)(state, fstate, np.int64(mode), np.int64(count), np.int64(rank), np.int64(used),
                                   hist)


def _radix(keys, cand_keys, state, hist, bits_out):
    """The radix passes: the state's prefix becomes the key of its rank, bits_out[0] too."""
    grid = min(MAX_HIST_BLOCKS, -(-keys.size // (B * HIST_ITEMS)))
    prefix_shift, start = 31, 0
    for shift, width in RADIX_DIGITS:
        rows = hist[start:start + (1 << width)]
        radix_hist_kernel.blocks(grid, B)(keys, cand_keys, state, np.int64(prefix_shift), np.int64(shift),
                                          np.int64(width), rows)
        radix_choose_kernel.blocks(1, B)(rows, state, np.int64(width), bits_out)
        prefix_shift, start = shift, start + (1 << width)


def _sample_threshold(x, r, carried, ef, w, m, rank, base):
    """The rank-th largest of m stratified samples of |acc| into w.bits (a float32's bits)."""
    sample = empty(m, np.float32, True)
    gather_sample_kernel[m](x, r, *carried, ef, base, sample)
    _init(w.sample, w.fstate, MODE_FULL, m, rank, 0, w.hist[RADIX_BINS:])
    keys = float_bits(sample)
    _radix(keys, keys, w.sample, w.hist[RADIX_BINS:], w.bits)


def _write(w, r, cand_idx, cand_keys, idx, val32, val16, half, ef, padded):
    keys = float_bits(r)
    exact_count_kernel.blocks(w.ntiles, B)(keys, cand_keys, w.main, w.tiles)
    tile_scan_kernel.blocks(1, B)(w.tiles, w.main, np.int64(-1), w.starts)
    write_kernel.blocks(w.ntiles, B)(r, keys, cand_idx, cand_keys, w.main, w.fstate, w.starts, idx, val32, val16,
                                     half, ef, np.int64(idx.size))
    if padded:
        pad_kernel[idx.size](w.main, idx, val32, val16, half)


def in_place(r):
    """``carried`` for a residual ``r`` updated in place: (r, no commit stamps, stamp 0)."""
    return r, empty(0, np.int64, True), np.int64(0)


def accumulate(x, r, carried=None):
    """r = x + the residual to add on the device (the error-feedback accumulator); ``carried``:
    (the residual array to add, commit stamps, this step's stamp of the last step), see :mod:`.select`;
    None: r's own, in place."""
    carried = in_place(r) if carried is None else carried
    accumulate_kernel.blocks(min(MAX_HIST_BLOCKS, -(-r.size // (B * HIST_ITEMS))), B)(x, r, *carried)


def select_exact(x, r, idx, val32, val16, *, k, ef, half, sample=None, carried=None):
    """Exact top-k of acc = x (+ residual) on the device, as :func:`.topk._exact_sampled` selects on the CPU.

    ``sample``: None for the radix select over all of acc, or (m, j, base): the j-th largest of m
    samples bounds the threshold from below and the select runs over the candidates above it (over
    all of acc if the bound turns out not finite, too high or too loose). ``carried``: as for
    :func:`accumulate`.
    """
    carried = in_place(r) if carried is None else carried
    n = r.size
    w = _Scratch(n)
    keys = float_bits(r)
    _init(w.main, w.fstate, MODE_FULL, n, k, min(k, idx.size), w.hist[:RADIX_BINS])
    if sample is None:
        if ef:
            accumulate(x, r, carried)
        cand_idx, cand_keys = w.no_candidates, keys
    else:
        m, j, base = sample
        _sample_threshold(x, r, carried, ef, w, m, j, base)
        low = w.bits.view(np.float32)
        bound_count_kernel.blocks(w.ntiles, B)(x, r, *carried, ef, low, w.tiles, w.main)  # acc now lives in r
        tile_scan_kernel.blocks(1, B)(w.tiles, w.main, np.int64(R_BOUND), w.starts)
        capacity = min(n // 4, 2 * k + 4096)  # ~1.6k expected
        bound_decide_kernel[1](low, w.main, np.int64(k), np.int64(capacity))
        cand_idx, cand_keys = empty(capacity, np.int32, True), empty(capacity, np.uint32, True)
        compact_kernel.blocks(w.ntiles, B)(r, keys, low, w.starts, w.main, cand_idx, cand_keys)
    _radix(keys, cand_keys, w.main, w.hist[:RADIX_BINS], w.bits)
    _write(w, r, cand_idx, cand_keys, idx, val32, val16, half, ef, padded=idx.size > k)


def select_by_threshold(x, r, idx, val32, val16, *, k, ef, half, gaussian_z=None, sample=None, carried=None):
    """Approximate top-k on the device, as :func:`.topk._select_cpu` selects on the CPU.

    ``gaussian_z``: Gaussian-k, t = |mu| + sigma * gaussian_z; ``sample`` = (m, rank, base): DGC's
    sampled threshold.  Then up to REFINEMENTS refinements, every one launched (each returns at once
    once the band is reached); the exact select, launched too, runs only when the first threshold is
    not finite. ``carried``: as for :func:`accumulate`.
    """
    carried = in_place(r) if carried is None else carried
    n = r.size
    w = _Scratch(n)
    _init(w.main, w.fstate, MODE_THRESHOLD, n, k, min(k, idx.size), w.hist[:RADIX_BINS])
    if gaussian_z is not None:
        sums = empty((-(-n // CHUNK), 2), np.float64, True)
        moments_block_kernel.blocks(sums.shape[0], _LANES)(x, r, *carried, ef, sums)  # acc now lives in r
        gaussian_threshold_kernel[1](sums, np.int64(n), np.float64(gaussian_z), w.main, w.fstate)
        pending = False
    else:
        m, rank, base = sample
        _sample_threshold(x, r, carried, ef, w, m, rank, base)
        sample_threshold_kernel[1](w.bits.view(np.float32), w.main, w.fstate)
        pending = ef  # the first count forms acc
    for rnd in range(REFINEMENTS + 1):
        round_count_kernel.blocks(w.ntiles, B)(x, r, *carried, pending and rnd == 0, w.main, w.fstate, np.int64(rnd),
                                               w.tiles)
        refine_kernel[1](w.main, w.fstate, np.int64(rnd), np.int64(k), np.int64(idx.size), np.int64(REFINEMENTS))
    keys = float_bits(r)
    _radix(keys, keys, w.main, w.hist[:RADIX_BINS], w.bits)
    _write(w, r, w.no_candidates, keys, idx, val32, val16, half, ef, padded=True)


def exact_threshold(values, k):
    """k-th largest |value| of a float32 device array: the select on the device, one read."""
    w = _Scratch(values.size)
    _init(w.main, w.fstate, MODE_FULL, values.size, k, 0, w.hist[:RADIX_BINS])
    keys = float_bits(values)
    _radix(keys, keys, w.main, w.hist[:RADIX_BINS], w.bits)
    return to_host(w.bits.view(np.float32), True)[0]
