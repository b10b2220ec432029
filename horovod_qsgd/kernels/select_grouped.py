"""Exact top-k of many tensors in one launch sequence, and the sparse decode of many payloads per sender.

:mod:`.select_device` selects one tensor per launch sequence (about 20
launches); a group of 50 tensors would pay 1000 launches of host time. Here
one sequence selects for every tensor of a group, each with its own k:

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
from .scan import B, block_exclusive_scan
from .select import emit_to, value_of
from .select_device import _ABS_MASK, _EQ_ONE, _LOW32, HIST_ITEMS, ITEMS, NBINS, RADIX_BINS, RADIX_DIGITS, TILE, \
    find_digit, key_class, scan_tiles, tile_class_count

__all__ = ["select_exact_many", "scatter_many", "HIST_SPAN"]

HIST_SPAN = B * HIST_ITEMS * 4  # elements of one tensor counted by one histogram block

# selection table, a row per tensor; *_AT are element offsets in the spans of their arrays
(X_AT, NUMEL, R_AT, RC_AT, COMMIT_AT, STAMP, IDX_AT, VAL_AT, K, OUT_AT, NBYTES, FIRST_TILE, TILES,
 FIRST_HIST) = range(14)
COLUMNS = 14
# int64 state, a row per tensor
S_PREFIX, S_RANK = 0, 1  # the radix prefix chosen so far (then the threshold key); the rank sought within it
STATE_SIZE = 2

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
def init_kernel(table, state, hist):
    s = cuda.blockIdx.x  # noqa: F821 (bound by cuda_kernel)
    for b in range(cuda.threadIdx.x, RADIX_BINS, B):  # noqa: F821
        hist[s, b] = 0
    if cuda.threadIdx.x == 0:  # noqa: F821
        state[s, S_PREFIX] = 0
        state[s, S_RANK] = table[s, K]


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
    """hist[s, start + d] += the keys of tensor s with digit d whose bits above ``prefix_shift`` are its prefix."""
    sh = cuda.shared.array(NBINS, numba.int32)  # noqa: F821
    t = cuda.threadIdx.x  # noqa: F821
    s, block = row_and_index(table, FIRST_HIST, cuda.blockIdx.x)  # noqa: F821
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
def choose_kernel(hist, state, width, start):
    """One block per tensor: the digit holding its rank (from the top) joins its prefix; the rank becomes the
    rank within that digit (:func:`.select_device.radix_choose_kernel`, per row)."""
    buf = cuda.shared.array(B, numba.int64)  # noqa: F821
    s = cuda.blockIdx.x  # noqa: F821
    nbins = 1 << width
    prefix = state[s, S_PREFIX]
    digit, rank = find_digit(buf, cuda.threadIdx.x, hist[s, start:start + nbins], nbins, state[s, S_RANK])  # noqa: F821
    if digit >= 0:
        state[s, S_RANK] = rank
        state[s, S_PREFIX] = (prefix << width) | digit


@cuda_kernel
def count_kernel(keys, table, state, tiles):
    """Per tile: keys above its tensor's threshold key (row 0) and equal to it (row 1)."""
    buf = cuda.shared.array(B, numba.int64)  # noqa: F821
    t = cuda.threadIdx.x  # noqa: F821
    g = cuda.blockIdx.x  # noqa: F821
    s, tile = row_and_index(table, FIRST_TILE, g)
    _, total = block_exclusive_scan(buf, t, tile_class_count(keys, table[s, R_AT], table[s, NUMEL], tile, t,
                                                             state[s, S_PREFIX]))
    if t == 0:
        tiles[0, g] = total & _LOW32
        tiles[1, g] = total >> 32


@cuda_kernel
def scan_kernel(table, tiles, starts):
    """One block per tensor: starts[row, tile] = the tensor's exclusive prefix sums of both tile rows."""
    buf = cuda.shared.array(B, numba.int64)  # noqa: F821
    t = cuda.threadIdx.x  # noqa: F821
    s = cuda.blockIdx.x  # noqa: F821
    first, ntiles = table[s, FIRST_TILE], table[s, TILES]
    per = (ntiles + B - 1) // B
    lo = first + min(ntiles, t * per)
    hi = first + min(ntiles, t * per + per)
    for row in range(2):
        scan_tiles(buf, t, tiles, row, starts, row, lo, hi)


@cuda_kernel
def write_kernel(r, keys, table, state, starts, out, idx, val32, val16, half, ef, version, codec_id, digest):
    """Each tile writes its tensor's selected entries in index order from its offset (keys above the threshold
    key and the first S_RANK equal to it, :func:`.select_device.write_kernel`'s rule); the tensor's first tile
    also writes its payload's header and tail padding."""
    buf = cuda.shared.array(B, numba.int64)  # noqa: F821
    t = cuda.threadIdx.x  # noqa: F821
    g = cuda.blockIdx.x  # noqa: F821
    s, tile = row_and_index(table, FIRST_TILE, g)
    n, ra, k = table[s, NUMEL], table[s, R_AT], table[s, K]
    thresh = state[s, S_PREFIX]
    eq_take = state[s, S_RANK]
    eq_before = starts[1, g]
    eq_left = max(eq_take - eq_before, 0)  # of the equal keys from this tile on, how many are sent
    before, _ = block_exclusive_scan(buf, t, tile_class_count(keys, ra, n, tile, t, thresh))
    eq_seen = before >> 32
    pos = starts[0, g] + min(eq_before, eq_take) + (before & _LOW32) + min(eq_seen, eq_left)
    ia, va = table[s, IDX_AT], table[s, VAL_AT]
    for u in range(ITEMS):
        p = tile * TILE + t * ITEMS + u
        if p < n:
            cls = key_class(np.int64(keys[ra + p]) & _ABS_MASK, thresh)
            if cls == 1 or (cls == _EQ_ONE and eq_seen < eq_left):
                if pos < k:
                    emit_to(r, ra + p, p, idx, ia + pos, val32, val16, va + pos, half, ef)
                pos += 1
            if cls == _EQ_ONE:
                eq_seen += 1
    if tile == 0 and t == 0:
        at, nbytes = table[s, OUT_AT], table[s, NBYTES]
        write_header(out, at, version, codec_id, n, digest, nbytes)
        for q in range(at + HEADER_BYTES + k * (6 if half else 8), at + nbytes):
            out[q] = 0


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
    targets = [target for target, _ in residuals] if ef else xs
    previous = [carried[0] for _, carried in residuals] if ef else xs
    commits = [carried[1] for _, carried in residuals if carried[1].size] if ef else []
    no_commits = (empty(2, np.int64, True), [])  # never read: every row's COMMIT_AT is -1
    spans = [span(xs, np.float32), span(targets, np.float32), span(previous, np.float32),
             span(outs, np.uint8, align=4), span(commits, np.int64) if commits else no_commits]
    if any(s is None for s in spans):
        return False
    (x, x_at), (r, r_at), (rc, rc_at), (out, out_at), (commit, commit_at) = spans
    commit_at = iter(commit_at)
    # the stamps advance every step and the table is kept between steps: it holds each one's distance from the
    # lowest (0 for a group that steps together), the lowest goes as an argument
    stamps = [int(carried[2]) for _, carried in residuals if carried[1].size] if ef else []
    stamp_base = min(stamps, default=0)
    rows, tiles, hist_blocks = [], 0, 0
    value_bytes = 2 if half else 4
    for i, (a, k) in enumerate(zip(xs, ks)):
        n = a.size
        at, stamp = -1, 0
        if ef and residuals[i][1][1].size:
            at, stamp = next(commit_at), int(residuals[i][1][2]) - stamp_base
        nbytes = (HEADER_BYTES + k * (4 + value_bytes) + 3) & ~3
        vals = out_at[i] + HEADER_BYTES + 4 * k
        ntiles = -(-n // TILE)
        rows.append((x_at[i], n, r_at[i], rc_at[i], at, stamp, (out_at[i] + HEADER_BYTES) // 4, vals // value_bytes,
                     k, out_at[i], nbytes, tiles, ntiles, hist_blocks))
        tiles += ntiles
        hist_blocks += -(-n // HIST_SPAN)
    table = to_device_cached(np.array(rows, np.int64).reshape(-1, COLUMNS))
    nseg = len(rows)
    state = empty((nseg, STATE_SIZE), np.int64, True)
    hist = empty((nseg, RADIX_BINS), np.int32, True)
    tile_counts = empty((2, tiles), np.int64, True)
    starts = empty((2, tiles), np.int64, True)
    init_kernel.blocks(nseg, B)(table, state, hist)
    if ef:
        accumulate_kernel.blocks(tiles, B)(x, r, rc, commit, np.int64(stamp_base), table)
    keys = float_bits(r)
    prefix_shift, start = 31, 0
    for shift, width in RADIX_DIGITS:
        hist_kernel.blocks(hist_blocks, B)(keys, table, state, np.int64(prefix_shift), np.int64(shift),
                                           np.int64(width), np.int64(start), hist)
        choose_kernel.blocks(nseg, B)(hist, state, np.int64(width), np.int64(start))
        prefix_shift, start = shift, start + (1 << width)
    count_kernel.blocks(tiles, B)(keys, table, state, tile_counts)
    scan_kernel.blocks(nseg, B)(table, tile_counts, starts)
    words = out[:out.size // 4 * 4]
    val32, val16 = (empty(1, np.float32, True), out[:out.size // 2 * 2].view(np.uint16)) if half else \
        (words.view(np.float32), empty(1, np.uint16, True))
    write_kernel.blocks(tiles, B)(r, keys, table, state, starts, out, words.view(np.int32), val32, val16, half, ef,
                                  np.uint8(version), np.uint8(codec_id), np.uint64(digest))
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
