"""Array-level entry points: dispatch on the array type to CPU or CUDA.

numpy arrays run the ``njit(parallel=True)`` launchers; objects with
``__cuda_array_interface__`` (numba device arrays, torch CUDA tensors) run the
CUDA kernels.  The arrays passed here are already typed views of a payload
(the codecs in :mod:`horovod_qsgd.codecs` cut them); nothing here knows about
headers.  Arguments are assumed valid (the codecs validate them).
"""

import math

import numpy as np

from . import elias as _el
from . import grouped as _grouped
from . import qsgd as _q
from . import select as _sel
from . import select_device as _dev
from .rng import PURPOSE_ROUNDING, seed_word
from .scan import inclusive_sums
from ._arrays import copy_to, device_view, empty, float_bits, split_residual, to_host, zeros
from ._dual import cpu_launch, on_cuda

__all__ = [
    "qsgd_encode", "qsgd_decode_accumulate", "qsgd_encode_many", "qsgd_decode_many", "elias_encode", "elias_decode_accumulate", "elias_decode_chained",
    "randomk_indices", "randomk_gather", "randomk_scatter_accumulate", "widen_f16", "move_into_own_chunk",
    "finish_sum",
]

_TARGET_CHUNK = 1 << 16  # elements per CPU work item for the QSGD launchers


def _chunk_for(bucket):
    unit = bucket * 8 // math.gcd(bucket, 8)
    return unit * max(1, _TARGET_CHUNK // unit)


# ------------------------------------------------------------------- QSGD --

def _scale_arrays(scales, nb, half, gpu):
    """(stored float32 scales, fp16 bits) arrays for the launchers."""
    if half:
        return empty(max(nb, 1), np.float32, gpu), scales
    return scales, empty(1, np.uint16, gpu)


def _levels(bits):
    """QSGD's s: the nonzero magnitudes a ``bits``-bit signed code can hold."""
    return (1 << (bits - 1)) - 1


def qsgd_encode(x, scales, codes, *, bucket_size, bits, use_l2, half, stochastic, base):
    """Quantise x (float32) into scales (float32, or uint16 fp16 bits) and codes (uint8)."""
    gpu = on_cuda(x, scales, codes)
    n = x.size
    nb = (n + bucket_size - 1) // bucket_size
    s = _levels(bits)
    if n == 0:
        return
    if not gpu:
        scale32, scale16 = _scale_arrays(scales, nb, half, False)
        cpu_launch(_q.encode_fixed_cpu, n, x, float_bits(x), bucket_size, use_l2, half, s, bits, stochastic,
                   base, scale32, scale16, codes, _chunk_for(bucket_size))
        return
    x, scales, codes = device_view(x), device_view(scales), device_view(codes)
    scale32, scale16 = _scale_arrays(scales, nb, half, True)
    _q.scale_kernel[nb](x, float_bits(x), nb, bucket_size, use_l2, half, scale32, scale16)
    tmp = empty(n, np.uint8, True)
    _q.code_kernel[n](x, bucket_size, scale32, s, stochastic, base, tmp)
    _q.pack_kernel[(n + 7) // 8](tmp, bits, codes)


def _stored_scales(scales, half, gpu):
    if not half:
        return scales
    out = empty(scales.size, np.float32, gpu)
    if gpu:
        _q.f16_scale_kernel[scales.size](scales, out)
    else:
        cpu_launch(_q.scales_from_f16_cpu, scales.size, scales, out)
    return out


def qsgd_decode_accumulate(scales, codes, out, *, bucket_size, bits, half):
    """out += decoded fixed-width QSGD codes."""
    gpu = on_cuda(scales, codes, out)
    n = out.size
    if n == 0:
        return
    s = _levels(bits)
    if gpu:
        scales, codes, out = device_view(scales), device_view(codes), device_view(out)
    scale32 = _stored_scales(scales, half, gpu)
    if gpu:
        _q.decode_kernel[(n + 7) // 8](codes, bucket_size, scale32, s, bits, out)
    else:
        chunk = bucket_size * max(1, _TARGET_CHUNK // bucket_size)
        cpu_launch(_q.decode_fixed_cpu, n, codes, bucket_size, scale32, s, bits, out, chunk)


def qsgd_encode_many(xs, outs, keys, nbytes, *, step, bucket_size, bits, use_l2, half, stochastic, seed, version,
                     codec_id, digest):
    """Whole fixed-width QSGD payloads (header, scales, codes, padding) of the CUDA arrays ``xs[i]`` (float32)
    into ``outs[i]`` (uint8), stream (seed, step, ``keys[i]``), ``nbytes[i]`` bytes each: the bytes the codec's
    one-by-one encodes write, in two launches for all (:mod:`.grouped`). Returns False, having done nothing,
    where the arrays cannot be taken together: encode them one by one then."""
    return _grouped.encode([device_view(x) for x in xs], [device_view(out) for out in outs], keys, nbytes,
                           bucket_size=bucket_size, bits=bits, use_l2=use_l2, half=half, stochastic=stochastic,
                           seed_word=seed_word(seed), step=step, purpose=PURPOSE_ROUNDING, version=version,
                           codec_id=codec_id, digest=digest)


def qsgd_decode_many(buffer, starts, outs, *, bucket_size, bits, half):
    """``outs[i] +=`` the checked fixed-width QSGD payload at byte ``starts[i]`` of the CUDA array ``buffer``, in
    order (an array given several times sums its payloads in that order), in one launch (:mod:`.grouped`).
    Returns False, having done nothing, where the outputs cannot be taken together."""
    return _grouped.decode(device_view(buffer), [int(start) for start in starts], [device_view(out) for out in outs],
                           bucket_size=bucket_size, bits=bits, half=half)


def elias_encode(x, scales, ends, stream, *, bucket_size, bits, use_l2, half, stochastic, base):
    """Elias-coded QSGD; writes scales, ends (uint32 cumulative byte ends), stream.

    Returns the number of stream bytes used (``ends[-1]``).
    """
    gpu = on_cuda(x, scales, ends, stream)
    n = x.size
    nb = ends.size
    if n == 0:
        return 0
    s = _levels(bits)
    if gpu:
        x, scales, ends, stream = device_view(x), device_view(scales), device_view(ends), device_view(stream)
    scale32, scale16 = _scale_arrays(scales, nb, half, gpu)
    nbytes = empty(nb, np.int64, gpu)
    if gpu:
        _el.sizes_kernel[nb](x, float_bits(x), bucket_size, use_l2, half, s, stochastic, base,
                             scale32, scale16, nbytes)
    else:
        cpu_launch(_el.sizes_cpu, n, x, float_bits(x), bucket_size, use_l2, half, s, stochastic, base,
                   scale32, scale16, nbytes)
    cum = empty(nb, np.int64, gpu)
    total = inclusive_sums(nbytes, cum)  # the one read: the payload's length
    if total > stream.size or total >= 2 ** 32:
        raise ValueError(f"Elias stream needs {total} bytes, only {stream.size} available")
    if gpu:
        _el.narrow_ends_kernel[nb](cum, ends)
        _el.write_kernel[nb](x, bucket_size, s, stochastic, base, scale32, ends, stream)
    else:
        ends[:] = cum
        cpu_launch(_el.write_cpu, n, x, bucket_size, s, stochastic, base, scale32, ends, stream)
    return total


def elias_decode_accumulate(scales, ends, stream, out, *, bucket_size, bits, half, counters=None):
    """out += decoded Elias stream; ValueError naming the first corrupt bucket.

    Each bucket checks its own byte range and stream on its device.  With
    ``counters`` (int64[3] on the same device, zeroed, see :func:`elias_error`)
    the faults are added there instead of read back, for one read of many
    payloads' checks; None is returned.
    """
    gpu = on_cuda(scales, ends, stream, out)
    if out.size == 0:
        return
    s = _levels(bits)
    nb = ends.size
    if gpu:
        scales, ends, stream, out = device_view(scales), device_view(ends), device_view(stream), device_view(out)
    scale32 = _stored_scales(scales, half, gpu)
    status = empty(nb, np.int32, gpu)
    own = counters is None
    counters = zeros(3, np.int64, gpu) if own else (device_view(counters) if gpu else counters)
    if gpu:
        _el.decode_kernel[nb](stream, ends, bucket_size, scale32, s, out, status)
        _el.tally_kernel[nb](status, counters)
    else:
        cpu_launch(_el.decode_cpu, out.size, stream, ends, bucket_size, scale32, s, out, status)
        for b in np.flatnonzero(status):
            _el.tally_status(status, b, counters)
    if own:
        error = elias_error(to_host(counters, gpu), nb)
        if error:
            raise ValueError(error)


def elias_decode_chained(buffer, records, slot, out, counters, *, layout, bucket_size, bits, half):
    """out += the Elias payload ``records[slot]`` of a device buffer (a device-resident (start, length)
    from :func:`~.bytes.follow_chain`), the host knowing neither; the faults are added to ``counters``
    (int64[3], zeroed, see :func:`elias_error`). ``layout``: the byte offsets of the scales, the bucket ends
    and the stream inside a payload of ``out.size`` elements."""
    if out.size == 0:
        return
    buffer, out, counters = device_view(buffer), device_view(out), device_view(counters)
    nb = (out.size + bucket_size - 1) // bucket_size
    whole = buffer[:buffer.size // 4 * 4]  # the payload starts found on the device are multiples of 4
    status = empty(nb, np.int32, True)
    _el.chained_decode_kernel[nb](buffer, whole.view(np.uint32), whole.view(np.float32), whole.view(np.uint16),
                                  records, np.int64(slot), tuple(np.int64(v) for v in layout), bucket_size, half,
                                  _levels(bits), out, status)
    _el.tally_kernel[nb](status, counters)


def elias_error(counters, nb):
    """The message for a payload's Elias decode counters (host int64[3]), or None when it decoded cleanly."""
    if counters[0]:
        return "Elias bucket offsets are not increasing or run past the stream"
    if counters[1]:
        return f"corrupt Elias stream in bucket {nb - int(counters[2])} (and {int(counters[1]) - 1} more)"
    return None


# ---------------------------------------------------------------- checks --

def all_finite(x):
    """True if the host float32 array ``x`` holds no inf or NaN: one vectorised pass on the CPU's threads
    (numpy's isfinite().all() writes a bool per element first: 2-5x slower on 25M elements)."""
    counts = np.zeros(-(-x.size // _sel.CHUNK), np.int64)
    if counts.size:
        cpu_launch(_sel.nonfinite_counts_cpu, x.size, x, counts)
    return not counts.any()


# --------------------------------------------------------------- random-k --

def randomk_indices(n, k, base, *, gpu=False):
    """The k stratified indices (int64, increasing) of stream ``base``."""
    idx = empty(k, np.int64, gpu)
    if k:
        if gpu:
            _sel.randomk_index_kernel[k](n, base, idx)
        else:
            cpu_launch(_sel.randomk_index_cpu, k, n, base, idx)
    return idx


def randomk_gather(x, residual, values, *, base, error_feedback, half, factor):
    """values[j] = sent value of stratum j (float32; fp16-rounded when half).

    If acc (x, or x + residual with error feedback) holds inf or NaN anywhere,
    values[0] is NaN: the allreduced sum is then non-finite on every rank, as
    an uncompressed one would be, wherever the strata fell. ``residual``: updated
    in place, or a :class:`._arrays.CarriedResidual`.
    """
    ef = bool(error_feedback)
    residual, carried = split_residual(residual) if ef else (None, None)
    gpu = on_cuda(x, residual, values)
    if values.size == 0:
        return
    if gpu:
        x, residual, values = device_view(x), device_view(residual), device_view(values)
    r = residual if ef else x
    f = np.float32(factor)
    if gpu:
        if ef:
            _dev.accumulate(x, r, carried)
        _sel.randomk_gather_kernel[values.size](x, r, ef, half, f, base, values)
        _sel.poison_if_nonfinite_kernel[r.size](r, values)
    else:
        if ef:
            cpu_launch(_sel.ef_accumulate_cpu, x.size, x, r, *carried)
        cpu_launch(_sel.randomk_gather_cpu, values.size, x, r, ef, half, f, base, values)
        if not all_finite(r):
            values[0] = np.nan


def narrow_f16(values, out_u16):
    """out_u16 = fp16 bit patterns of float32 values (round to nearest even), on the values' device."""
    gpu = on_cuda(values, out_u16)
    if values.size == 0:
        return
    if gpu:
        _sel.narrow_f16_kernel[values.size](device_view(values), device_view(out_u16))
    else:
        cpu_launch(_sel.narrow_f16_cpu, values.size, values, out_u16)


def move_into_own_chunk(x, residual, out):
    """out = x + residual and residual = 0 (float32, equal sizes; ``residual`` None: out = x), on their device:
    the owner's own chunk of a two-stage exchange, which takes the mass its error-feedback residual holds there.
    ``residual``: an array, or a :class:`._arrays.CarriedResidual` (whose ``previous`` is left as it was)."""
    residual, carried = (None, None) if residual is None else split_residual(residual)
    gpu = on_cuda(x, out, residual)
    if out.size == 0:
        return
    if residual is None:
        if gpu:
            copy_to(device_view(out), device_view(x))
        else:
            out[:] = x
        return
    if gpu:
        _sel.own_chunk_kernel[out.size](device_view(x), device_view(residual), *carried, device_view(out))
    else:
        cpu_launch(_sel.own_chunk_cpu, out.size, x, residual, *carried, out)


def finish_sum(total, scale, *, stamps=None, stamp=0, counter=None):
    """Multiplies a decoded sum by the optimizer's ``scale`` and finds whether it is finite, in one pass.

    On the CPU: ``scale`` a float (1.0: ``total`` is only read); returns True where no element is inf or
    NaN. On a device: ``scale`` a one-element float32 device array; nothing is read back; returns None.
    Given ``stamps`` (int64 [2], see :func:`horovod_qsgd.kernels.select.committed`), they get ``stamp`` as
    written, and as not finite where an element is inf or NaN, which adds 1 to ``counter[0]`` (the CPU
    writes them too, as a device would).
    """
    if on_cuda(total):  # launched for an empty total too: its stamps say the step was written
        total = device_view(total)
        blocks = max(1, min(_dev.MAX_HIST_BLOCKS, -(-total.size // (_dev.B * _dev.HIST_ITEMS))))
        _sel.finish_sum_kernel.blocks(blocks, _dev.B)(total, device_view(scale).reshape(1), device_view(stamps),
                                                      np.int64(stamp), device_view(counter))
        return None
    counts = np.zeros(-(-total.size // _sel.CHUNK), np.int64)
    if counts.size:
        cpu_launch(_sel.finish_sum_cpu, total.size, total, np.float32(scale), float(scale) != 1.0, counts)
    finite = not counts.any()
    if stamps is not None:
        stamps[0] = stamp
        if not finite and stamps[1] < stamp:
            stamps[1] = stamp
            counter[0] += 1
    return finite


def randomk_scatter_accumulate(values, out, *, base):
    """out[index_j] += values[j] (float32 values)."""
    gpu = on_cuda(values, out)
    if values.size == 0:
        return
    if gpu:
        values, out = device_view(values), device_view(out)
        _sel.randomk_scatter_kernel[values.size](values, base, out)
    else:
        cpu_launch(_sel.randomk_scatter_cpu, values.size, values, base, out)


def randomk_scatter_payload(values, out, meta, *, seed, purpose):
    """As :func:`randomk_scatter_accumulate`, with the stream of the step and key in ``meta`` (12 payload
    bytes on the values' device): computed there, not read back."""
    gpu = on_cuda(values, out, meta)
    if values.size == 0:
        return
    seed_w = seed_word(seed)
    if gpu:
        values, out, meta = device_view(values), device_view(out), device_view(meta)
        _sel.randomk_scatter_payload_kernel[values.size](values, meta, seed_w, np.uint64(purpose), out)
    else:
        cpu_launch(_sel.randomk_scatter_payload_cpu, values.size, values, meta, seed_w, np.uint64(purpose), out)


def widen_f16(src_u16):
    """float32 copy of an array of IEEE fp16 bit patterns (uint16), exact."""
    gpu = on_cuda(src_u16)
    if gpu:
        src_u16 = device_view(src_u16)
    out = empty(src_u16.size, np.float32, gpu)
    if src_u16.size:
        if gpu:
            _q.f16_scale_kernel[src_u16.size](src_u16, out)
        else:
            cpu_launch(_q.scales_from_f16_cpu, src_u16.size, src_u16, out)
    return out
