"""Sparsifying codecs: top-k and random-k."""

import math

import numpy as np

from .. import kernels as K
from .base import (Codec, _check_array, _is_cuda, align4, check_choice, check_int, check_ratio,
                   check_residual, host_copy, to_float32, view, write_bytes)
from .header import HEADER_NBYTES, WIRE_VERSION, PayloadError

__all__ = ["TopKCodec", "RandomKCodec", "num_selected"]

SAMPLE_MIN = 4096


def num_selected(ratio, numel):
    """k = max(1, floor(ratio * numel)) (0 for an empty tensor)."""
    return 0 if numel == 0 else max(1, int(math.floor(ratio * numel)))


def _value_bytes(value_dtype):
    return 2 if value_dtype == "float16" else 4


class TopKCodec(Codec):
    r"""Top-k sparsification with error feedback.

    Sends the ``k = max(1, floor(ratio * n))`` coordinates of largest
    magnitude of ``acc = x + residual`` as (int32 index, value) pairs and
    keeps the rest in ``residual`` (error feedback, Stich et al. 2018;
    Lin et al. 2018, DGC): after encoding,
    ``residual = acc - sent`` with ``sent`` the values as transmitted, so
    ``sent + residual_new == x + residual_old`` exactly (float32).

    Args:
        ratio (float): fraction of coordinates sent, in (0, 1].  Default 0.01.
            Lower: less traffic, more staleness in the residual.
        selector (str): how the k entries are found.

            * ``"exact"`` (default): exactly the k largest |acc|, ties broken
              by lower index.  A sampled lower bound on the threshold picks
              ~1.6k candidates in two passes over the data, then a radix
              select on the float bits of the candidates finds the exact set
              (3 histogram passes + compaction over all of acc if the bound
              misses, or for small tensors).
            * ``"gaussian"``: Gaussian-k (Shi et al., arXiv:1911.08772): the
              threshold ``|mu| + sigma * Phi^-1(1 - k/(2n))`` from the mean
              and standard deviation of acc, refined at most 3 times (halved
              if fewer than 2k/3 pass, times 1.5 if more than 4k/3; bisecting
              once the band is bracketed; if no threshold lands in the band
              the one whose count is closest to k is used).  About
              k entries (in [2k/3, 4k/3] for roughly Gaussian gradients);
              fewer passes than exact.
            * ``"sample"``: DGC's sampled threshold: the exact top
              ``k * m / n`` of ``m = max(4096, sample_ratio * n, 64 n / k)``
              stratified samples of |acc| gives the threshold, refined like
              gaussian.

        value_dtype (str): ``"float32"`` (default) or ``"float16"`` (values
            rounded to nearest fp16; the rounding error stays in the
            residual; |acc| >= 65520 is sent as inf).
        error_feedback (bool): keep unsent mass in ``residual`` (default
            True).  Without it the unsent coordinates are dropped (biased).
        seed (int): seed of the sample selector's random sample.
        sample_ratio (float): sample fraction of the ``"sample"`` selector.

    Capacity: every payload has room for exactly ``capacity(n)`` entries,
    ``k`` for ``"exact"`` and ``min(n, ceil(4k/3))`` for the approximate
    selectors, so all ranks send the same number of bytes.  When an
    approximate selector finds more than the capacity, the entries first in
    index order are sent and the others stay in the residual.  Unused slots
    hold index -1 and value 0 and decode to nothing.  Entries are in
    increasing index order.  NaN/inf in acc rank above every finite value
    and are sent (and so propagate); Gaussian/sample selectors fall back to
    exact selection when the statistics are not finite.

    Wire cost: ``16 + capacity * (4 + value_bytes)`` bytes (rounded up to a
    multiple of 4), i.e. ``ratio * 64`` bits per coordinate for fp32 values
    (ratio 0.01: 0.64 bits/coordinate, 50x smaller than fp32; ratio 0.001:
    500x), ``ratio * 48`` with fp16 values; approximate selectors 4/3 of that.
    """

    codec_id = 2
    MAX_NUMEL = 2 ** 31 - 1
    fault_width = 1  # entries whose index is out of range

    def __init__(self, ratio=0.01, selector="exact", value_dtype="float32", error_feedback=True,
                 seed=0, sample_ratio=0.01):
        self.ratio = check_ratio("ratio", ratio)
        self.selector = check_choice("selector", selector, ("exact", "gaussian", "sample"))
        self.value_dtype = check_choice("value_dtype", value_dtype, ("float32", "float16"))
        if not isinstance(error_feedback, (bool, np.bool_)):
            raise ValueError(f"error_feedback={error_feedback!r} must be True or False")
        self.error_feedback = bool(error_feedback)
        self.seed = check_int("seed", seed, 0, 2 ** 64 - 1)
        self.sample_ratio = check_ratio("sample_ratio", sample_ratio)

    def config(self):
        return {"ratio": self.ratio, "selector": self.selector, "value_dtype": self.value_dtype,
                "error_feedback": self.error_feedback, "seed": self.seed,
                "sample_ratio": self.sample_ratio}

    def k(self, numel):
        return num_selected(self.ratio, int(numel))

    def capacity(self, numel):
        """Entries in every payload for a tensor of ``numel`` elements."""
        k = self.k(numel)
        if self.selector == "exact":
            return k
        return min(int(numel), (4 * k + 2) // 3)

    def sample_size(self, numel):
        """m = min(n, max(4096, ceil(sample_ratio * n), 64 n / k)).

        The last term keeps at least ~64 sampled entries above the sampled
        threshold, so its quantile is not dominated by noise on small tensors.
        """
        n = int(numel)
        k = self.k(n)
        if k == 0:
            return 0
        return min(n, max(SAMPLE_MIN, int(math.ceil(self.sample_ratio * n)), (64 * n + k - 1) // k))

    def max_payload_nbytes(self, numel):
        cap = self.capacity(numel)
        return HEADER_NBYTES + 4 * cap + align4(cap * _value_bytes(self.value_dtype))

    def _sections(self, buf, n):
        cap = self.capacity(n)
        idx = view(buf, HEADER_NBYTES, cap, np.int32)
        vdt = np.uint16 if self.value_dtype == "float16" else np.float32
        vals = view(buf, HEADER_NBYTES + 4 * cap, cap, vdt)
        return idx, vals

    def encode(self, x, out, *, step, key, residual=None):
        """Select, write the payload into out, update residual; returns the length."""
        step, key = self._check_step_key(step, key)
        x, out, residual, gpu = self._prepare_encode(x, out, residual, need_residual=self.error_feedback)
        n = x.size
        idx, vals = self._sections(out, n)
        cap = idx.size
        if n:  # fills every slot: the selected entries, then index -1 and value 0
            K.topk_select(x, residual, idx, vals, k=self.k(n), selector=self.selector,
                          error_feedback=self.error_feedback, half=self.value_dtype == "float16",
                          sample_base=K.stream_base(self.seed, step, key, K.PURPOSE_SAMPLE),
                          sample_size=self.sample_size(n))
        return self._finish(out, n, HEADER_NBYTES + cap * (4 + _value_bytes(self.value_dtype)))

    def encode_many(self, xs, outs, *, step, keys, residuals=None):
        """See :meth:`Codec.encode_many`: on a GPU every selector selects for all inputs in one launch sequence
        (exact 11 launches, Gaussian 22, sample 29, :mod:`horovod_qsgd.kernels.select_grouped`)."""
        if xs and _is_cuda(xs[0]):
            self._check_step_key(step, 0)
            for key in keys:
                self._check_step_key(0, key)
            given = [None] * len(xs) if residuals is None else residuals
            prepared = [self._prepare_encode(x, out, residual, need_residual=self.error_feedback)
                        for x, out, residual in zip(xs, outs, given)]
            if all(gpu for _, _, _, gpu in prepared):
                converted = [x for x, _, _, _ in prepared]  # converted once
                if K.topk_encode_many(converted, [residual for _, _, residual, _ in prepared],
                                      [out for _, out, _, _ in prepared], [self.k(x.size) for x in converted],
                                      [self.capacity(x.size) for x in converted], selector=self.selector,
                                      error_feedback=self.error_feedback, half=self.value_dtype == "float16",
                                      version=WIRE_VERSION, codec_id=self.codec_id, digest=self.digest,
                                      sampling=(self.seed, step, list(keys),
                                                [self.sample_size(x.size) for x in converted])
                                      if self.selector == "sample" else None):
                    return [self.max_payload_nbytes(x.size) for x in converted]
        return super().encode_many(xs, outs, step=step, keys=keys, residuals=residuals)

    def decode_sum(self, buffer, payloads, outs, faults=None):
        """See :meth:`Codec.decode_sum`: on a GPU, one launch per payload of the most-summed output (the
        senders), not per payload."""
        if isinstance(payloads, list) and payloads and _is_cuda(buffer):
            opened = [self._open_payload(buffer[start:end], out, header)
                      for (start, end, header), out in zip(payloads, outs)]
            counters = self.fault_counters(len(payloads), True) if faults is None else faults
            places = [(start, self.capacity(h.numel)) for (start, _, _), (h, _, _, _) in zip(payloads, opened)]
            if K.sparse_accumulate_many(buffer, places, [out for _, _, out, _ in opened], counters,
                                        half=self.value_dtype == "float16"):
                if faults is None:
                    self.raise_for_faults(host_copy(counters.view(np.uint8)), [h for h, _, _, _ in opened])
                return None
        return super().decode_sum(buffer, payloads, outs, faults)

    def _decode_one(self, h, payload, out, bad_count):
        """out[index] += value for every entry of the payload; entries with an index out of range counted."""
        idx, vals = self._sections(payload, h.numel)
        K.sparse_accumulate(idx, vals, out, half=self.value_dtype == "float16", bad_counts=bad_count, slot=0)

    def raise_for_faults(self, fault_bytes, headers):
        bad = np.ascontiguousarray(fault_bytes).view(np.int64)  # one out-of-range count per payload
        if bad.any():
            slot = int(np.flatnonzero(bad)[0])
            raise PayloadError(self._numbered(
                f"corrupt top-k payload: {int(bad[slot])} entries have an index outside [0, {headers[slot].numel}) "
                "that is not the padding value -1", slot, len(headers)))


class RandomKCodec(Codec):
    r"""Random-k sparsification with indices shared by all ranks.

    The ``k = max(1, floor(ratio * n))`` indices depend only on
    ``(seed, step, key, n)``: one index uniform in each of k equal strata
    ``[floor(j n / k), floor((j+1) n / k))`` (sorted and distinct by
    construction).  Every rank picks the same indices, so the values can be
    summed by a plain allreduce of k floats (:meth:`gather` /
    :meth:`scatter_accumulate`); :meth:`encode` / :meth:`decode_accumulate`
    with a header exist for symmetry (the payload carries step and key so
    the decoder can rebuild the indices).

    Args:
        ratio (float): fraction sent, in (0, 1].  Default 0.01.
        seed (int): seed of the index stream (must match across ranks).
        value_dtype (str): ``"float32"`` (default) or ``"float16"`` (values
            rounded to nearest fp16 before sending).
        error_feedback (bool): keep unsent coordinates (and fp16 rounding
            error) in ``residual``.  Default False.
        rescale (bool): multiply the values by ``n / k`` so the estimate is
            unbiased (Stich et al.); default False.  Incompatible with
            error feedback (which already removes the bias).

    Wire cost: ``k`` values, ``ratio * 32`` bits per coordinate with fp32
    values (no indices are sent); the encode payload adds a 32-byte
    header+step/key block.
    """

    codec_id = 3

    def __init__(self, ratio=0.01, seed=0, value_dtype="float32", error_feedback=False, rescale=False):
        self.ratio = check_ratio("ratio", ratio)
        self.seed = check_int("seed", seed, 0, 2 ** 64 - 1)
        self.value_dtype = check_choice("value_dtype", value_dtype, ("float32", "float16"))
        for name, v in (("error_feedback", error_feedback), ("rescale", rescale)):
            if not isinstance(v, (bool, np.bool_)):
                raise ValueError(f"{name}={v!r} must be True or False")
        if error_feedback and rescale:
            raise ValueError("error_feedback=True and rescale=True cannot be combined: "
                             "allowed are error feedback (biased values, residual keeps the rest) "
                             "or rescaling by n/k (unbiased, no residual)")
        self.error_feedback = bool(error_feedback)
        self.rescale = bool(rescale)

    def config(self):
        return {"ratio": self.ratio, "seed": self.seed, "value_dtype": self.value_dtype,
                "error_feedback": self.error_feedback, "rescale": self.rescale}

    def k(self, numel):
        return num_selected(self.ratio, int(numel))

    def _base(self, step, key):
        step, key = self._check_step_key(step, key)
        return K.stream_base(self.seed, step, key, K.PURPOSE_RANDOMK)

    def indices(self, numel, step, key, *, device="cpu"):
        """The k int64 indices (increasing) for this step and key; ``device`` "cpu" or "cuda"."""
        check_choice("device", device, ("cpu", "cuda"))
        return K.randomk_indices(int(numel), self.k(numel), self._base(step, key), gpu=device == "cuda")

    def gather(self, x, step, key, residual=None, out=None):
        """float32 array of the k values to allreduce (fp16-rounded when value_dtype is float16).

        With error feedback ``residual`` is required and updated in place.
        """
        base = self._base(step, key)
        x = to_float32(x)
        gpu = not isinstance(x, np.ndarray)
        n = x.size
        k = self.k(n)
        if self.error_feedback:
            if residual is None:
                raise ValueError("RandomKCodec(error_feedback=True) needs residual=, a float32 array of x.size")
            residual = check_residual(residual, n, gpu)
        if out is None:
            if gpu:
                out = K.device_empty(k, np.float32)
            else:
                out = np.empty(k, np.float32)
        else:
            out = _check_array("out", out, np.float32, size=k, gpu=gpu)
        K.randomk_gather(x, residual, out, base=base, error_feedback=self.error_feedback,
                         half=self.value_dtype == "float16", factor=(n / k) if self.rescale and k else 1.0)
        return out

    def scatter_accumulate(self, values, out, step, key):
        """out[index_j] += values[j]; values float32 (or float16, widened) of size k."""
        base = self._base(step, key)
        gpu = _is_cuda(out)
        out = _check_array("out", out, np.float32, gpu=gpu)
        values = to_float32(values, what="values")
        if values.size != self.k(out.size):
            raise ValueError(f"values has {values.size} elements, expected k={self.k(out.size)} for numel {out.size}")
        K.randomk_scatter_accumulate(values, out, base=base)

    # -- payload form ------------------------------------------------------

    def max_payload_nbytes(self, numel):
        return HEADER_NBYTES + 16 + align4(self.k(numel) * _value_bytes(self.value_dtype))

    def encode(self, x, out, *, step, key, residual=None):
        """Payload: header, step (uint64), key (uint32), 4 zero bytes, k values."""
        self._check_step_key(step, key)
        x, out, residual, gpu = self._prepare_encode(x, out, residual, need_residual=self.error_feedback)
        n = x.size
        k = self.k(n)
        vals = self.gather(x, step, key, residual=residual)
        write_bytes(out, HEADER_NBYTES, np.array([step], "<u8").tobytes() + np.array([key, 0], "<u4").tobytes())
        off = HEADER_NBYTES + 16
        if self.value_dtype == "float16":
            K.narrow_f16(vals, view(out, off, k, np.uint16))  # exact: already fp16-rounded
        else:
            if gpu:
                K.copy_to(view(out, off, k, np.float32), vals)
            else:
                view(out, off, k, np.float32)[:] = vals
        return self._finish(out, n, off + k * _value_bytes(self.value_dtype))

    def _decode_one(self, h, payload, out, counters):
        n = h.numel
        k = self.k(n)
        off = HEADER_NBYTES + 16
        if self.value_dtype == "float16":
            vals = K.widen_f16(view(payload, off, k, np.uint16))
        else:
            vals = view(payload, off, k, np.float32)
        # the indices' stream comes from the payload's step and key, read on the payload's device
        K.randomk_scatter_payload(vals, out, payload[HEADER_NBYTES:HEADER_NBYTES + 12], seed=self.seed,
                                  purpose=K.PURPOSE_RANDOMK)
