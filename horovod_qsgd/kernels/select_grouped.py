"""Top-k of many tensors in one launch sequence, and the sparse decode of many payloads per sender.

:mod:`.select_device` selects one tensor per launch sequence (about 20
launches); a group of 50 tensors would pay 1000 launches of host time. Here
one sequence selects for every tensor of a group, each with its own k. Each
tensor has a row of :mod:`.select_device`'s state (and of its float state),
so the decisions that module makes per selection are made here per row, by
the same device functions.

The exact selector (:func:`select_exact_many`):

* ``init`` (one block per tensor) zeroes the tensors' radix histograms and
  states; ``accumulate`` (one block per tile) forms acc = x + the residual
  to add, with each tensor's own residual, previous residual and commit
  stamps (:class:`._arrays.CarriedResidual`);
* three radix passes over the float bits of |acc|, each a histogram (one
  block per span of ``HIST_SPAN`` elements of one tensor, counting in shared
  memory, then into that tensor's row) and a choice of digit (one block per
  tensor): the k-th largest key of every tensor;
* ``count`` (one block per tile: keys above and equal to the tensor's
  threshold), ``scan`` (one block per tensor: each tile's output offset) and
  ``write`` (one block per tile: the entries in index order, the residual
  acc - sent, and each payload's header and padding).

That is 11 launches for any number of tensors (10 without error feedback).
The selection is the radix select over all of acc, with ties to the lower
index: exactly :mod:`.topk`'s set and order, so the payloads and residuals
are the bytes of the one-by-one encodes (the sampled lower bound that
:mod:`.select_device` tries first saves passes over the data, not results;
on a group, launches cost more than passes).

Gaussian-k (:func:`select_gaussian_many`) puts between ``accumulate`` and the
radix passes: ``moments`` (one block of 64 lanes per ``CHUNK`` elements of a
tensor, :func:`.select.moments_chunk`'s order), ``threshold`` (one thread per
tensor: |mu| + sigma z, its chunks added in order) and four rounds of
``round count`` (one block per tile) and ``refine`` (one thread per tensor).
The radix passes then run only for tensors whose moments were not finite (the
exact fallback), the others return at once; ``write`` takes the entries at or
above each tensor's final threshold, and ``pad`` fills the unused slots. That
is 22 launches (21 without error feedback), the bytes of the one-by-one
device and CPU encodes.

The decode (:func:`scatter_many`) adds every payload's entries to its
output, one launch per *round*: the i-th payload of every output goes in
round i, so each output's coordinates see the additions in payload order
(the bits of one-by-one decodes) and no two threads of a launch add to one
coordinate of a well-formed payload. Rounds are the senders, not the
tensors.

The tables (int64, a row per tensor or payload) are copied to the device at
a layout's first step and kept (:func:`._arrays.to_device_cached`).
"""

import numba
import numpy as np

from ._arrays import empty, float_bits, pointer, span, to_device_cached
from ._dual import cuda_kernel, gpu_only
from .grouped import HEADER_BYTES, distinct_outputs, row_and_index, write_header
from .rng import keyed_stream_base
from .scan import B, block_exclusive_scan
from .select import CHUNK, _LANES, emit_to, stratum_index, value_of
from .select_device import _ABS_MASK, _EQ_ONE, _LOW32, _NAN64, _ZERO64, F_FINAL, F_T, FSTATE_SIZE, HIST_ITEMS, \
    ITEMS, MODE_FULL, MODE_THRESHOLD, NBINS, R_EQ, R_GT, R_ROUND, RADIX_BINS, RADIX_DIGITS, REFINEMENTS, S_CHOSEN, \
    S_DONE, S_MODE, S_PREFIX, S_RANK, S_ROUND_TOTAL, S_USED, STATE_SIZE, TILE, TILE_ROWS, at_least, chunk_moments, \
    find_digit, gaussian_threshold, key_class, refine_step, sample_threshold, scan_tiles, tile_class_count

__all__ = ["select_exact_many", "select_gaussian_many", "select_sampled_many", "scatter_many", "HIST_SPAN"]

HIST_SPAN = B * HIST_ITEMS * 4  # elements of one tensor counted by one histogram block

# selection table, a row per tensor; *_AT are element offsets in the spans of their arrays; K is the rank the
# selection seeks, CAP the payload's entries (K for the exact selector); KEY, M and FIRST_SAMPLE the sample
# selector's stream key, sample size and first sample in the group's samples
(X_AT, NUMEL, R_AT, RC_AT, COMMIT_AT, STAMP, IDX_AT, VAL_AT, K, OUT_AT, NBYTES, FIRST_TILE, TILES,
 FIRST_HIST, CAP, FIRST_CHUNK, FIRST_SLOT, KEY, M, FIRST_SAMPLE) = range(20)
COLUMNS = 20

# scatter table, a row per payload of one round
P_IDX_AT, P_VAL_AT, P_CAP, P_OUT_AT, P_NUMEL, P_SLOT, P_FIRST = range(7)
P_COLUMNS = 7


@gpu_only
def takes_target(commits, table, s, stamp_base):
    """Whether tensor s's residual to add is its target's own content (:func:`.select.committed`, per row)."""
    at = table[s, COMMIT_AT]
    stamp = stamp_base + table[s, STAMP]
    return at >= 0 and commits[at] == stamp and commits[at + 1] != stamp


@cuda_kernel
def init_kernel(table, mode, state, fstate, hist):
    """One block per tensor: its state row (:func:`.select_device.init_state_kernel`'s), histograms zeroed."""
    s = cuda.blockIdx.x  # noqa: F821 (bound by cuda_kernel)
    for b in range(cuda.threadIdx.x, RADIX_BINS, B):  # noqa: F821
        hist[s, b] = 0
    if cuda.threadIdx.x == 0:  # noqa: F821
        for c in range(STATE_SIZE):
            state[s, c] = 0
        for c in range(FSTATE_SIZE):
            fstate[s, c] = _NAN64
        state[s, S_MODE] = mode
        state[s, S_RANK] = table[s, K]
        state[s, S_USED] = min(table[s, K], table[s, CAP])


@cuda_kernel
def accumulate_kernel(x, r, rc, commits, stamp_base, table):
    """r = x + the residual to add, per tile (the error-feedback accumulator)."""
    s, tile = row_and_index(table, FIRST_TILE, cuda.blockIdx.x)  # noqa: F821
    n, xa, ra, ca = table[s, NUMEL], table[s, X_AT], table[s, R_AT], table[s, RC_AT]
    take = takes_target(commits, table, s, stamp_base)
    for u in range(ITEMS):
        i = tile * TILE + u * B + cuda.threadIdx.x  # noqa: F821
        if i < n:
            if take:
                v = r[ra + i]
                rc[ca + i] = v
            else:
                v = rc[ca + i]
            r[ra + i] = x[xa + i] + v


@cuda_kernel
def hist_kernel(keys, table, state, prefix_shift, shift, width, start, hist):
    """hist[s, start + d] += the keys of tensor s with digit d whose bits above ``prefix_shift`` are its prefix;
    nothing for a tensor selecting by threshold."""
    sh = cuda.shared.array(NBINS, numba.int32)  # noqa: F821
    t = cuda.threadIdx.x  # noqa: F821
    s, block = row_and_index(table, FIRST_HIST, cuda.blockIdx.x)  # noqa: F821
    if state[s, S_MODE] == MODE_THRESHOLD:
        return
    nbins = 1 << width
    for b in range(t, nbins, B):
        sh[b] = 0
    cuda.syncthreads()  # noqa: F821
    prefix = state[s, S_PREFIX]
    at = table[s, R_AT]
    mask = nbins - 1
    lo = block * HIST_SPAN
    hi = min(table[s, NUMEL], lo + HIST_SPAN)
    for i in range(lo + t, hi, B):
        key = np.int64(keys[at + i]) & _ABS_MASK
        if (key >> prefix_shift) == prefix:
            cuda.atomic.add(sh, (key >> shift) & mask, 1)  # noqa: F821
    cuda.syncthreads()  # noqa: F821
    for b in range(t, nbins, B):
        c = sh[b]
        if c:
            cuda.atomic.add(hist, (s, start + b), c)  # noqa: F821


@cuda_kernel
def choose_kernel(hist, state, width, start, bits):
    """One block per tensor: the digit holding its rank (from the top) joins its prefix; the rank becomes the
    rank within that digit, and ``bits[s]`` the prefix (after the last pass: the float bits of the k-th largest
    |value|) (:func:`.select_device.radix_choose_kernel`, per row)."""
    buf = cuda.shared.array(B, numba.int64)  # noqa: F821
    s = cuda.blockIdx.x  # noqa: F821
    if state[s, S_MODE] == MODE_THRESHOLD:
        return
    nbins = 1 << width
    prefix = state[s, S_PREFIX]
    digit, rank = find_digit(buf, cuda.threadIdx.x, hist[s, start:start + nbins], nbins, state[s, S_RANK])  # noqa: F821
    if digit >= 0:
        state[s, S_RANK] = rank
        state[s, S_PREFIX] = (prefix << width) | digit
        bits[s] = (prefix << width) | digit


@cuda_kernel
def count_kernel(keys, table, state, tiles):
    """Per tile of a tensor selecting by key: keys above its threshold key (row R_GT) and equal to it (R_EQ)."""
    buf = cuda.shared.array(B, numba.int64)  # noqa: F821
    t = cuda.threadIdx.x  # noqa: F821
    g = cuda.blockIdx.x  # noqa: F821
    s, tile = row_and_index(table, FIRST_TILE, g)
    if state[s, S_MODE] == MODE_THRESHOLD:
        return
    _, total = block_exclusive_scan(buf, t, tile_class_count(keys, table[s, R_AT], table[s, NUMEL], tile, t,
                                                             state[s, S_PREFIX]))
    if t == 0:
        tiles[R_GT, g] = total & _LOW32
        tiles[R_EQ, g] = total >> 32


@cuda_kernel
def scan_kernel(table, state, tiles, starts):
    """One block per tensor: starts[0, tile] (and starts[1, tile]) = the tensor's exclusive prefix sums of its
    tile counts: the chosen round's for a tensor selecting by threshold, else rows R_GT (and R_EQ)."""
    buf = cuda.shared.array(B, numba.int64)  # noqa: F821
    t = cuda.threadIdx.x  # noqa: F821
    s = cuda.blockIdx.x  # noqa: F821
    first, ntiles = table[s, FIRST_TILE], table[s, TILES]
    per = (ntiles + B - 1) // B
    lo = first + min(ntiles, t * per)
    hi = first + min(ntiles, t * per + per)
    if state[s, S_MODE] == MODE_THRESHOLD:
        scan_tiles(buf, t, tiles, R_ROUND + state[s, S_CHOSEN], starts, 0, lo, hi)
    else:
        for row in range(2):
            scan_tiles(buf, t, tiles, R_GT + row, starts, row, lo, hi)


@gpu_only
def tile_count_at_least(r, at, n, tile, t, t32):
    """Of thread t's ITEMS consecutive elements of the tile of r[at:at + n]: how many are not below ``t32``."""
    c = 0
    for u in range(ITEMS):
        p = tile * TILE + t * ITEMS + u
        if p < n:
            c += at_least(r[at + p], t32)
    return c


@cuda_kernel
def write_kernel(r, keys, table, state, fstate, starts, out, idx, val32, val16, half, ef, version, codec_id, digest):
    """Each tile writes its tensor's selected entries in index order from its offset, at most the payload's
    capacity: by key, the keys above the threshold key and the first S_RANK equal to it
    (:func:`.select_device.write_kernel`'s rule); by threshold, the entries at or above the final one. The
    tensor's first tile also writes its payload's header and tail padding."""
    buf = cuda.shared.array(B, numba.int64)  # noqa: F821
    t = cuda.threadIdx.x  # noqa: F821
    g = cuda.blockIdx.x  # noqa: F821
    s, tile = row_and_index(table, FIRST_TILE, g)
    n, ra, cap = table[s, NUMEL], table[s, R_AT], table[s, CAP]
    ia, va = table[s, IDX_AT], table[s, VAL_AT]
    if state[s, S_MODE] == MODE_THRESHOLD:
        t32 = np.float32(fstate[s, F_FINAL])
        before, _ = block_exclusive_scan(buf, t, tile_count_at_least(r, ra, n, tile, t, t32))
        pos = starts[0, g] + before
        for u in range(ITEMS):
            p = tile * TILE + t * ITEMS + u
            if p < n and at_least(r[ra + p], t32):
                if pos < cap:
                    emit_to(r, ra + p, p, idx, ia + pos, val32, val16, va + pos, half, ef)
                pos += 1
    else:
        thresh = state[s, S_PREFIX]
        eq_take = state[s, S_RANK]
        eq_before = starts[1, g]
        eq_left = max(eq_take - eq_before, 0)  # of the equal keys from this tile on, how many are sent
        before, _ = block_exclusive_scan(buf, t, tile_class_count(keys, ra, n, tile, t, thresh))
        eq_seen = before >> 32
        pos = starts[0, g] + min(eq_before, eq_take) + (before & _LOW32) + min(eq_seen, eq_left)
        for u in range(ITEMS):
            p = tile * TILE + t * ITEMS + u
            if p < n:
                cls = key_class(np.int64(keys[ra + p]) & _ABS_MASK, thresh)
                if cls == 1 or (cls == _EQ_ONE and eq_seen < eq_left):
                    if pos < cap:
                        emit_to(r, ra + p, p, idx, ia + pos, val32, val16, va + pos, half, ef)
                    pos += 1
                if cls == _EQ_ONE:
                    eq_seen += 1
    if tile == 0 and t == 0:
        at, nbytes = table[s, OUT_AT], table[s, NBYTES]
        write_header(out, at, version, codec_id, n, digest, nbytes)
        for q in range(at + HEADER_BYTES + cap * (6 if half else 8), at + nbytes):
            out[q] = 0


# ------------------------------------------------------------ Gaussian-k --

@cuda_kernel
def moments_kernel(r, table, sums):
    """sums[g] = (sum, sum of squares) of chunk g of the tensors' acc in float64: one block of 64 threads per
    chunk, in :func:`.select_device.chunk_moments`'s order (acc formed by then)."""
    lane_sum = cuda.shared.array(_LANES, numba.float64)  # noqa: F821
    lane_sq = cuda.shared.array(_LANES, numba.float64)  # noqa: F821
    u = cuda.threadIdx.x  # noqa: F821
    g = cuda.blockIdx.x  # noqa: F821
    s, c = row_and_index(table, FIRST_CHUNK, g)
    lo = c * CHUNK
    s1, s2 = chunk_moments(r, r, r, False, False, table[s, R_AT], lo, min(table[s, NUMEL], lo + CHUNK), lane_sum,
                           lane_sq, u)
    if u == 0:
        sums[g, 0] = s1
        sums[g, 1] = s2


@cuda_kernel
def gaussian_threshold_kernel(sums, table, zs, state, fstate):
    """One thread per tensor: its threshold from its chunks' moments, added in chunk order."""
    s = cuda.grid(1)  # noqa: F821
    if s < table.shape[0]:
        n = table[s, NUMEL]
        first = table[s, FIRST_CHUNK]
        s1 = _ZERO64
        s2 = _ZERO64
        for c in range(first, first + (n + CHUNK - 1) // CHUNK):
            s1 += sums[c, 0]
            s2 += sums[c, 1]
        gaussian_threshold(s1, s2, n, zs[s], state[s], fstate[s])


@cuda_kernel
def round_count_kernel(r, table, state, fstate, rnd, tiles):
    """Per tile of a tensor still refining its threshold: the entries at or above it, row R_ROUND + rnd, and
    their total (:func:`.select_device.round_count_kernel`, per row)."""
    buf = cuda.shared.array(B, numba.int64)  # noqa: F821
    t = cuda.threadIdx.x  # noqa: F821
    g = cuda.blockIdx.x  # noqa: F821
    s, tile = row_and_index(table, FIRST_TILE, g)
    if state[s, S_MODE] != MODE_THRESHOLD or state[s, S_DONE] != 0:
        return
    t32 = np.float32(fstate[s, F_T])
    _, total = block_exclusive_scan(buf, t, tile_count_at_least(r, table[s, R_AT], table[s, NUMEL], tile, t, t32))
    if t == 0:
        tiles[R_ROUND + rnd, g] = total
        cuda.atomic.add(state, (s, S_ROUND_TOTAL + rnd), total)  # noqa: F821


@cuda_kernel
def refine_kernel(table, state, fstate, rnd, last):
    """One thread per tensor: its refinement step after round ``rnd`` (:func:`.select_device.refine_step`)."""
    s = cuda.grid(1)  # noqa: F821
    if s < table.shape[0]:
        refine_step(state[s], fstate[s], rnd, table[s, K], table[s, CAP], last)


# -------------------------------------------------------------- sample-k --

@cuda_kernel
def gather_samples_kernel(r, table, seed_w, step, purpose, samples):
    """samples[FIRST_SAMPLE + j] = |acc| at the j-th stratified index of its tensor, from the tensor's stream
    (:func:`.select.gather_sample`, per row; acc is formed by then)."""
    j = cuda.grid(1)  # noqa: F821
    if j < samples.size:
        s, e = row_and_index(table, FIRST_SAMPLE, j)
        base = keyed_stream_base(seed_w, step, np.uint64(table[s, KEY]), purpose)
        samples[j] = abs(r[table[s, R_AT] + stratum_index(table[s, NUMEL], table[s, M], e, base)])


@cuda_kernel
def sample_threshold_kernel(thresholds, state, fstate):
    """One thread per tensor: its sampled threshold (a float32) starts its refinement."""
    s = cuda.grid(1)  # noqa: F821
    if s < state.shape[0]:
        sample_threshold(np.float64(thresholds[s]), state[s], fstate[s])


@cuda_kernel
def pad_kernel(table, state, idx, val32, val16, half):
    """Every payload's slots from its state's used count on: index -1, value 0."""
    j = cuda.grid(1)  # noqa: F821
    if j < table[table.shape[0] - 1, FIRST_SLOT] + table[table.shape[0] - 1, CAP]:
        s, e = row_and_index(table, FIRST_SLOT, j)
        if e >= state[s, S_USED]:
            idx[table[s, IDX_AT] + e] = -1
            if half:
                val16[table[s, VAL_AT] + e] = 0
            else:
                val32[table[s, VAL_AT] + e] = 0


# ---------------------------------------------------------- launch order --

class _Group:
    """A group's spans, device table and scratch: what both selectors' launch sequences share."""

    def __init__(self, xs, residuals, outs, ks, caps, *, ef, half, keys=None, sizes=None):
        targets = [target for target, _ in residuals] if ef else xs
        previous = [carried[0] for _, carried in residuals] if ef else xs
        commits = [carried[1] for _, carried in residuals if carried[1].size] if ef else []
        no_commits = (empty(2, np.int64, True), [])  # never read: every row's COMMIT_AT is -1
        spans = [span(xs, np.float32), span(targets, np.float32), span(previous, np.float32),
                 span(outs, np.uint8, align=4), span(commits, np.int64) if commits else no_commits]
        self.ok = all(sp is not None for sp in spans)
        if not self.ok:
            return
        (self.x, x_at), (self.r, r_at), (self.rc, rc_at), (self.out, out_at), (self.commit, commit_at) = spans
        commit_at = iter(commit_at)
        # the stamps advance every step and the table is kept between steps: it holds each one's distance from
        # the lowest (0 for a group that steps together), the lowest goes as an argument
        stamps = [int(carried[2]) for _, carried in residuals if carried[1].size] if ef else []
        self.stamp_base = np.int64(min(stamps, default=0))
        rows, tiles, hist_blocks, chunks, slots, samples = [], 0, 0, 0, 0, 0
        value_bytes = 2 if half else 4
        keys = [0] * len(xs) if keys is None else keys
        sizes = [0] * len(xs) if sizes is None else sizes
        for i, (a, k, cap) in enumerate(zip(xs, ks, caps)):
            n = a.size
            at, stamp = -1, 0
            if ef and residuals[i][1][1].size:
                at, stamp = next(commit_at), int(residuals[i][1][2]) - int(self.stamp_base)
            nbytes = (HEADER_BYTES + cap * (4 + value_bytes) + 3) & ~3
            vals = out_at[i] + HEADER_BYTES + 4 * cap
            ntiles = -(-n // TILE)
            rows.append((x_at[i], n, r_at[i], rc_at[i], at, stamp, (out_at[i] + HEADER_BYTES) // 4,
                         vals // value_bytes, k, out_at[i], nbytes, tiles, ntiles, hist_blocks, cap, chunks, slots,
                         keys[i], sizes[i], samples))
            tiles += ntiles
            hist_blocks += -(-n // HIST_SPAN)
            chunks += -(-n // CHUNK)
            slots += cap
            samples += sizes[i]
        self.rows = rows
        self.table = to_device_cached(np.array(rows, np.int64).reshape(-1, COLUMNS))
        self.nseg, self.tiles, self.hist_blocks, self.chunks, self.slots = len(rows), tiles, hist_blocks, chunks, slots
        self.samples = samples
        self.state = empty((self.nseg, STATE_SIZE), np.int64, True)
        self.fstate = empty((self.nseg, FSTATE_SIZE), np.float64, True)
        self.hist = empty((self.nseg, RADIX_BINS), np.int32, True)
        self.tile_counts = empty((TILE_ROWS, tiles), np.int64, True)
        self.starts = empty((2, tiles), np.int64, True)
        out = self.out
        self.words = out[:out.size // 4 * 4]
        self.val32, self.val16 = (empty(1, np.float32, True), out[:out.size // 2 * 2].view(np.uint16)) if half else \
            (self.words.view(np.float32), empty(1, np.uint16, True))

    def start(self, mode, ef):
        init_kernel.blocks(self.nseg, B)(self.table, np.int64(mode), self.state, self.fstate, self.hist)
        if ef:
            accumulate_kernel.blocks(self.tiles, B)(self.x, self.r, self.rc, self.commit, self.stamp_base,
                                                    self.table)

    def select_by_key(self):
        """The radix passes, then the tile counts, for every tensor not selecting by threshold."""
        keys = float_bits(self.r)
        _radix(keys, self.table, self.state, self.hist, self.hist_blocks, empty(self.nseg, np.uint32, True))
        count_kernel.blocks(self.tiles, B)(keys, self.table, self.state, self.tile_counts)

    def write(self, half, ef, version, codec_id, digest):
        scan_kernel.blocks(self.nseg, B)(self.table, self.state, self.tile_counts, self.starts)
        write_kernel.blocks(self.tiles, B)(self.r, float_bits(self.r), self.table, self.state, self.fstate,
                                           self.starts, self.out, self.words.view(np.int32), self.val32, self.val16,
                                           half, ef, np.uint8(version), np.uint8(codec_id), np.uint64(digest))


def _radix(keys, table, state, hist, hist_blocks, bits):
    """The three radix passes of every row's selection over ``keys`` (rows by key only); ``bits[s]`` gets each
    row's k-th largest key."""
    prefix_shift, start = 31, 0
    for shift, width in RADIX_DIGITS:
        hist_kernel.blocks(hist_blocks, B)(keys, table, state, np.int64(prefix_shift), np.int64(shift),
                                           np.int64(width), np.int64(start), hist)
        choose_kernel.blocks(table.shape[0], B)(hist, state, np.int64(width), np.int64(start), bits)
        prefix_shift, start = shift, start + (1 << width)


def _refine_and_write(group, half, ef, version, codec_id, digest):
    """The threshold selectors' rounds of count and refinement, the exact fallback, the write and the pad."""
    per_tensor = -(-group.nseg // B)
    for rnd in range(REFINEMENTS + 1):
        round_count_kernel.blocks(group.tiles, B)(group.r, group.table, group.state, group.fstate, np.int64(rnd),
                                                  group.tile_counts)
        refine_kernel.blocks(per_tensor, B)(group.table, group.state, group.fstate, np.int64(rnd),
                                            np.int64(REFINEMENTS))
    group.select_by_key()  # the exact fallback, for the tensors whose first threshold was not finite
    group.write(half, ef, version, codec_id, digest)
    pad_kernel.blocks(-(-group.slots // B), B)(group.table, group.state, group.words.view(np.int32), group.val32,
                                               group.val16, half)


def select_exact_many(xs, residuals, outs, ks, *, ef, half, version, codec_id, digest):
    """Whole top-k payloads (header, k int32 indices, k values, padding) of the float32 CUDA arrays ``xs[i]``
    into the uint8 CUDA arrays ``outs[i]`` (each ``16 + k * (4 + value bytes)`` rounded up to 4): the exact
    top ``ks[i]`` of acc = x + residual, ties to the lower index, in index order; with ``ef`` each residual
    keeps acc - sent. ``residuals[i]``: (the array written, (the residual to add, commit stamps, stamp)) as
    :func:`._arrays.split_residual` gives on a device; ignored without ``ef``.

    Returns False, doing nothing, where the arrays cannot be spanned (an empty input, a misaligned output):
    the caller then encodes them one by one.
    """
    if any(x.size == 0 for x in xs):
        return False
    group = _Group(xs, residuals, outs, ks, ks, ef=ef, half=half)
    if not group.ok:
        return False
    group.start(MODE_FULL, ef)
    group.select_by_key()
    group.write(half, ef, version, codec_id, digest)
    return True


def select_gaussian_many(xs, residuals, outs, ks, caps, zs, *, ef, half, version, codec_id, digest):
    """Whole Gaussian-k payloads (header, ``caps[i]`` int32 indices and values, padding) of the float32 CUDA
    arrays ``xs[i]`` into ``outs[i]``, as :func:`.select_device.select_by_threshold` writes them one by one:
    the entries of acc at or above |mu| + sigma ``zs[i]``, refined towards ``ks[i]`` of them, in index order,
    the unused slots index -1 and value 0 (the exact top ``ks[i]`` where acc's moments are not finite).
    ``residuals``, ``ef`` and the return value as for :func:`select_exact_many`."""
    if any(x.size == 0 or cap == 0 for x, cap in zip(xs, caps)):
        return False
    group = _Group(xs, residuals, outs, ks, caps, ef=ef, half=half)
    if not group.ok:
        return False
    group.start(MODE_THRESHOLD, ef)
    sums = empty((group.chunks, 2), np.float64, True)
    moments_kernel.blocks(group.chunks, _LANES)(group.r, group.table, sums)
    gaussian_threshold_kernel.blocks(-(-group.nseg // B), B)(sums, group.table,
                                                             to_device_cached(np.asarray(zs, np.float64)),
                                                             group.state, group.fstate)
    _refine_and_write(group, half, ef, version, codec_id, digest)
    return True


def select_sampled_many(xs, residuals, outs, ks, caps, sampling, *, ef, half, version, codec_id, digest):
    """Whole sample-k payloads (DGC's sampled threshold) of the float32 CUDA arrays ``xs[i]`` into ``outs[i]``, as
    :func:`.select_device.select_by_threshold` writes them one by one: the ``ranks[i]``-th largest of
    ``sizes[i]`` stratified samples of |acc| (stream (seed, ``step``, ``keys[i]``, ``purpose``), ``sampling`` =
    (seed word, step, purpose, keys, sizes, ranks)) starts the refinement towards ``ks[i]`` entries; the exact
    top ``ks[i]`` where that threshold is not finite. Arguments and return value otherwise as for
    :func:`select_gaussian_many`."""
    seed_w, step, purpose, keys, sizes, ranks = sampling
    if any(x.size == 0 or cap == 0 or m == 0 for x, cap, m in zip(xs, caps, sizes)):
        return False
    group = _Group(xs, residuals, outs, ks, caps, ef=ef, half=half, keys=keys, sizes=sizes)
    if not group.ok:
        return False
    group.start(MODE_THRESHOLD, ef)
    samples = empty(group.samples, np.float32, True)
    gather_samples_kernel.blocks(-(-group.samples // B), B)(group.r, group.table, np.uint64(seed_w), np.uint64(step),
                                                            np.uint64(purpose), samples)
    # the samples' own selection: a row per tensor over its samples, seeking its rank
    rows, hist_blocks = [], 0
    for row, m, rank in zip(group.rows, sizes, ranks):
        sample_row = [0] * COLUMNS
        sample_row[NUMEL], sample_row[R_AT], sample_row[K], sample_row[CAP] = m, row[FIRST_SAMPLE], rank, rank
        sample_row[FIRST_HIST] = hist_blocks
        rows.append(sample_row)
        hist_blocks += -(-m // HIST_SPAN)
    table = to_device_cached(np.array(rows, np.int64).reshape(-1, COLUMNS))
    state, hist = empty((group.nseg, STATE_SIZE), np.int64, True), empty((group.nseg, RADIX_BINS), np.int32, True)
    thresholds = empty(group.nseg, np.uint32, True)
    unused_fstate = empty((group.nseg, FSTATE_SIZE), np.float64, True)
    init_kernel.blocks(group.nseg, B)(table, np.int64(MODE_FULL), state, unused_fstate, hist)
    _radix(float_bits(samples), table, state, hist, hist_blocks, thresholds)
    sample_threshold_kernel.blocks(-(-group.nseg // B), B)(thresholds.view(np.float32), group.state, group.fstate)
    _refine_and_write(group, half, ef, version, codec_id, digest)
    return True


@cuda_kernel
def scatter_round_kernel(idx, val32, val16, half, out, table, entries, bad):
    """out[index] += value for every entry of this round's payloads (one per output); entries with an index
    out of range are counted in ``bad[slot]``."""
    j = cuda.grid(1)  # noqa: F821
    if j < entries:
        p, e = row_and_index(table, P_FIRST, j)
        o, n = table[p, P_OUT_AT], table[p, P_NUMEL]
        i = int(idx[table[p, P_IDX_AT] + e])
        if i < -1 or i >= n:
            cuda.atomic.add(bad, table[p, P_SLOT], 1)  # noqa: F821
        elif i >= 0:
            out[o + i] = out[o + i] + value_of(val32, val16, half, table[p, P_VAL_AT] + e)


def scatter_many(buffer, payloads, outs, bad, *, half):
    """``outs[i] +=`` the top-k payload at (byte start, capacity) ``payloads[i]`` of the uint8 CUDA array
    ``buffer``, its faults counted in ``bad[i]``; one launch per round (the payloads of an output in order,
    the first of every output in round 0). Returns False, doing nothing, where it cannot (outputs that
    overlap without being one array, or that cannot be spanned; a misaligned buffer)."""
    outputs = distinct_outputs(outs)
    if outputs is None or not buffer.size or buffer.size % 4 or pointer(buffer) % 4 \
            or any(start % 4 for start, _ in payloads):
        return False
    (out, out_at), by_output = outputs
    value_bytes = 2 if half else 4
    words = buffer.view(np.int32)
    val32, val16 = (empty(1, np.float32, True), buffer.view(np.uint16)) if half else \
        (buffer.view(np.float32), empty(1, np.uint16, True))
    for rnd in range(max(len(members) for members in by_output)):
        rows, entries = [], 0
        for oa, members in zip(out_at, by_output):
            if rnd < len(members):
                i = members[rnd]
                start, cap = payloads[i]
                rows.append(((start + HEADER_BYTES) // 4, (start + HEADER_BYTES + 4 * cap) // value_bytes, cap, oa,
                             outs[i].size, i, entries))
                entries += cap
        if entries:
            table = to_device_cached(np.array(rows, np.int64).reshape(-1, P_COLUMNS))
            scatter_round_kernel[entries](words, val32, val16, half, out, table, np.int64(entries), bad)
    return True
