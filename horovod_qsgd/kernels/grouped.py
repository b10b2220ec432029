"""QSGD of many payloads in one launch sequence: what a GPU pays per group of tensors, not per tensor.

A kernel launch from Python costs tens of microseconds of host time, more
than the device time of a small tensor's encode, so launching per tensor
makes a step's codec cost grow with the model's tensor count. Here a
*table* (int64, one row per payload, on the device) says where each payload's
input, output and stream are inside one array for all inputs and one for all
outputs, and each kernel finds its row by a binary search over the table's
cumulative bucket or group counts:

* :func:`encode` - ``scale_kernel`` (one thread per bucket of every payload)
  then ``code_kernel`` (one thread per 8 coordinates: the levels of
  :func:`~.qsgd.level_code`, packed, and each payload's header and padding
  written by the thread of its first 8 coordinates). The stream base of each
  payload comes from (seed, step, key) on the device, so the table holds
  nothing that changes from step to step.
* :func:`decode` - one thread per 8 coordinates of every output, adding every
  payload of that output in table order: each coordinate sees the additions
  in the order the per-payload decodes make them, so the sums are the same
  bits.

Both give the bytes and sums that :mod:`.qsgd`'s per-payload launchers give
(payloads byte for byte, the wire format unchanged). The arrays a caller
holds are separate allocations; :func:`~._arrays.span` views the memory
from the lowest of them to the end of the highest as one array and gives each
array's offset in it, so nothing is copied together. The kernels touch
only the caller's arrays inside that span.
"""

import numpy as np

from ._arrays import pointer, span, to_device_cached
from ._dual import core, cuda_kernel, fmul32
from .half import f16_to_f32, f32_to_f16_up
from .qsgd import bucket_scale, level_code
from .rng import keyed_stream_base

__all__ = ["encode", "decode", "row_of", "row_and_index", "stored_scale", "put_u32", "write_header", "distinct_outputs", "HEADER_BYTES"]

HEADER_BYTES = 16  # codecs/header.py's layout, written here by the kernel from the table and its arguments
_MAGIC0, _MAGIC1 = 0x48, 0x51  # b"HQ"
_FF = np.uint64(0xFF)

# encode table columns
X_AT, NUMEL, OUT_AT, KEY, NBYTES, FIRST_BUCKET, FIRST_GROUP, CODES_AT = range(8)
ENCODE_COLUMNS = 8
# decode table columns (one row per output; the payloads' starts in a second array, in order)
D_OUT_AT, D_NUMEL, D_FIRST_GROUP, D_FIRST_PAYLOAD, D_END_PAYLOAD, D_CODES_AT = range(6)
DECODE_COLUMNS = 6


@core(inline=True)
def row_of(table, column, t):
    """The last row r of ``table`` with table[r, column] <= t (the column ascending, row 0's entry 0)."""
    lo = 0
    hi = table.shape[0] - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if table[mid, column] <= t:
            lo = mid
        else:
            hi = mid - 1
    return lo


@cuda_kernel
def scale_kernel(x, xbits, out32, out16, table, nbuckets, bucket, use_l2, half):
    t = cuda.grid(1)  # noqa: F821 (bound by cuda_kernel)
    if t < nbuckets:
        r, b = row_and_index(table, FIRST_BUCKET, t)
        lo = table[r, X_AT] + b * bucket
        hi = table[r, X_AT] + min(table[r, NUMEL], (b + 1) * bucket)
        raw = bucket_scale(x[lo:hi], xbits[lo:hi], use_l2)
        scales_at = table[r, OUT_AT] + HEADER_BYTES
        if half:
            out16[scales_at // 2 + b] = f32_to_f16_up(raw)
        else:
            out32[scales_at // 4 + b] = raw


@core(inline=True)
def row_and_index(table, column, t):
    """(the row of work item ``t`` by the table's cumulative count ``column``, ``t``'s index inside that row)."""
    r = row_of(table, column, t)
    return r, t - table[r, column]


@core(inline=True)
def stored_scale(bytes32, bytes16, at, b, half):
    """Bucket b's scale as the payload at byte ``at`` stores it (float32, or fp16 bits widened exactly), read
    through the float32 and uint16 views of the payloads' array."""
    if half:
        return f16_to_f32(int(bytes16[(at + HEADER_BYTES) // 2 + b]))
    return bytes32[(at + HEADER_BYTES) // 4 + b]


@core(inline=True)
def put_u32(out, at, value):
    for q in range(4):
        out[at + q] = np.uint8((np.uint64(value) >> np.uint64(8 * q)) & _FF)


@core(inline=True)
def write_header(out, at, version, codec_id, numel, digest, nbytes):
    """The 16-byte header of :mod:`horovod_qsgd.codecs.header` at byte ``at`` of ``out``."""
    out[at] = _MAGIC0
    out[at + 1] = _MAGIC1
    out[at + 2] = version
    out[at + 3] = codec_id
    put_u32(out, at + 4, numel)
    put_u32(out, at + 8, digest)
    put_u32(out, at + 12, nbytes)


@cuda_kernel
def code_kernel(x, out, out32, out16, table, ngroups, bucket, half, s, bits, stochastic, seed_word, step, purpose,
                version, codec_id, digest):
    t = cuda.grid(1)  # noqa: F821
    if t < ngroups:
        r, g = row_and_index(table, FIRST_GROUP, t)
        n, at = table[r, NUMEL], table[r, OUT_AT]
        xs = x[table[r, X_AT]:table[r, X_AT] + n]
        base = keyed_stream_base(seed_word, step, np.uint64(table[r, KEY]), purpose)
        s32 = np.float32(s)
        i0 = g * 8
        m = min(8, n - i0)
        word = np.uint64(0)
        for j in range(m):
            i = i0 + j
            scale = stored_scale(out32, out16, at, i // bucket, half)
            word |= np.uint64(level_code(xs, i, scale, s, s32, stochastic, base)) << np.uint64(j * bits)
        codes_at = at + table[r, CODES_AT]
        for q in range((m * bits + 7) // 8):
            out[codes_at + g * bits + q] = np.uint8((word >> np.uint64(8 * q)) & _FF)
        if g == 0:  # the header, and the padding that no other thread writes
            write_header(out, at, version, codec_id, n, digest, table[r, NBYTES])
            nb = (n + bucket - 1) // bucket
            for p in range(at + HEADER_BYTES + nb * (2 if half else 4), codes_at):
                out[p] = 0
            for p in range(codes_at + (n * bits + 7) // 8, at + table[r, NBYTES]):
                out[p] = 0


@cuda_kernel
def decode_kernel(buf, buf32, buf16, starts, table, ngroups, bucket, half, s, bits, out):
    t = cuda.grid(1)  # noqa: F821
    if t < ngroups:
        r, g = row_and_index(table, D_FIRST_GROUP, t)
        o, n = table[r, D_OUT_AT], table[r, D_NUMEL]
        s32 = np.float32(s)
        mask = (1 << bits) - 1
        last = buf.size - 1
        i0 = g * 8
        end = min(n, i0 + 8)
        for q in range(table[r, D_FIRST_PAYLOAD], table[r, D_END_PAYLOAD]):
            at = starts[q]
            codes_at = at + table[r, D_CODES_AT]
            for i in range(i0, end):
                scale = stored_scale(buf32, buf16, at, i // bucket, half)
                bp = i * bits
                p = codes_at + (bp >> 3)
                w = int(buf[p]) | (int(buf[min(p + 1, last)]) << 8)
                c = (w >> (bp & 7)) & mask
                out[o + i] = out[o + i] + fmul32(np.float32(c - s) / s32, scale)


def _layout(numel, bucket, half):
    """(buckets, byte offset of the codes from the payload's start) of one fixed-width payload."""
    nb = (numel + bucket - 1) // bucket
    return nb, HEADER_BYTES + ((nb * (2 if half else 4) + 3) & ~3)


def encode(xs, outs, keys, nbytes, *, bucket_size, bits, use_l2, half, stochastic, seed_word, step, purpose, version,
           codec_id, digest):
    """Encodes every float32 device array ``xs[i]`` into the uint8 device array ``outs[i]`` as a whole payload of
    ``nbytes[i]`` bytes (header included), stream key ``keys[i]``: two launches for all of them.

    Returns False, doing nothing, where the arrays cannot be spanned (an empty input, an output not 4-byte
    aligned): the caller then encodes them one by one.
    """
    if any(x.size == 0 for x in xs):
        return False
    x_span, out_span = span(xs, np.float32), span(outs, np.uint8, align=4)
    if x_span is None or out_span is None:
        return False
    (x, x_at), (out, out_at) = x_span, out_span
    rows, buckets, groups = [], 0, 0
    for numel, key, total, xa, oa in zip((x.size for x in xs), keys, nbytes, x_at, out_at):
        nb, codes_at = _layout(numel, bucket_size, half)
        rows.append((xa, numel, oa, key, total, buckets, groups, codes_at))
        buckets += nb
        groups += (numel + 7) // 8
    table = to_device_cached(np.array(rows, np.int64).reshape(-1, ENCODE_COLUMNS))
    out32 = out[:out.size // 4 * 4].view(np.float32)
    out16 = out[:out.size // 2 * 2].view(np.uint16)
    scale_kernel[buckets](x, x.view(np.uint32), out32, out16, table, np.int64(buckets), bucket_size, use_l2, half)
    code_kernel[groups](x, out, out32, out16, table, np.int64(groups), bucket_size, half, (1 << (bits - 1)) - 1, bits,
                        stochastic, np.uint64(seed_word), np.uint64(step), np.uint64(purpose), np.uint8(version),
                        np.uint8(codec_id), np.uint64(digest))
    return True


def decode(buffer, starts, outs, *, bucket_size, bits, half):
    """``outs[i] += `` the fixed-width payload at byte ``starts[i]`` of the uint8 device array ``buffer``
    (checked by the caller), in order; one array given several times sums all of its payloads. One launch.

    Returns False, doing nothing, where it cannot (outputs that overlap without being the same array, or that
    cannot be spanned): the caller then decodes them one by one.
    """
    outputs = distinct_outputs(outs)
    if outputs is None:
        return False
    (out, out_at), members = outputs
    if not buffer.size or buffer.size % 4 or pointer(buffer) % 4 or any(start % 4 for start in starts):
        return False
    rows, payload_starts, groups = [], [], 0
    for oa, indices in zip(out_at, members):
        numel = outs[indices[0]].size
        _, codes_at = _layout(numel, bucket_size, half)
        rows.append((oa, numel, groups, len(payload_starts), len(payload_starts) + len(indices), codes_at))
        payload_starts.extend(starts[i] for i in indices)
        groups += (numel + 7) // 8
    table = to_device_cached(np.array(rows, np.int64).reshape(-1, DECODE_COLUMNS))
    payloads = to_device_cached(np.array(payload_starts, np.int64))
    decode_kernel[groups](buffer, buffer.view(np.float32), buffer.view(np.uint16), payloads, table, np.int64(groups),
                          bucket_size, half, (1 << (bits - 1)) - 1, bits, out)
    return True


def distinct_outputs(outs):
    """((one float32 span over the distinct arrays of ``outs``, each one's offset in it), for each distinct array
    in order of first appearance the indices in ``outs`` that name it), or None where they cannot be taken
    together: an empty array, two that overlap without being one array, or no span."""
    order, by_array = [], {}
    for i, out in enumerate(outs):
        key = (pointer(out), out.size)
        if key not in by_array:
            by_array[key] = []
            order.append(key)
        by_array[key].append(i)
    distinct = [outs[by_array[key][0]] for key in order]
    if any(a.size == 0 for a in distinct) or _overlap(order):
        return None
    out_span = span(distinct, np.float32)
    if out_span is None:
        return None
    return out_span, [by_array[key] for key in order]


def _overlap(keys):
    """Whether any two of the (pointer, elements) float32 ranges overlap."""
    ranges = sorted((p, p + 4 * n) for p, n in keys)
    return any(ranges[i][1] > ranges[i + 1][0] for i in range(len(ranges) - 1))
