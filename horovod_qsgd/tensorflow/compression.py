"""Compressors for Horovod's TensorFlow ``compression=`` argument that really send fewer bytes.

Horovod calls ``compress(grad)``, allreduces what comes back, and calls
``decompress(result, ctx)`` (in ``hvd.DistributedGradientTape``,
``hvd.DistributedOptimizer``, Horovod's Keras ``DistributedOptimizer`` and
``hvd.allreduce``). :class:`QSGD` and :class:`TopK` work exactly like their
PyTorch twins in :mod:`horovod_qsgd.torch`:

1. ``compress`` encodes the gradient with the shared codec (one
   ``tf.numpy_function`` call into the numba kernels), starts an
   ``hvd.allgather`` of the uint8 payload under a name derived from the
   variable's name, and returns a one-element placeholder holding 1 for
   Horovod to allreduce with its own op, prescale and postscale.
2. ``decompress`` takes every rank's payload from the allgather, checks the
   headers against its own, decodes them in rank order into one fp32 sum and
   multiplies it by ``placeholder / num_ranks`` (sum or average, whatever the
   caller asked Horovod for).

From 3 ranks, large tensors take the two-stage exchange instead
(:mod:`horovod_qsgd.common.two_stage`): ``compress`` alltoalls the slices
each owner needs, ``decompress`` sums and re-encodes this rank's owned
chunk, allgathers it and decodes the owners' sums (TensorFlow's executor
starts the collectives as their inputs are ready, so no order of calls can
deadlock them).

:class:`RandomK` returns the k values every rank selects with a shared seed
and lets Horovod's allreduce sum them.

On a GPU the codecs still run on the host: ``tf.numpy_function`` hands them
host copies, and TensorFlow offers no zero-copy (DLPack) view of a tensor
inside a ``tf.function`` graph. Each compressed gradient costs 8 bytes of
PCIe per coordinate (its fp32 copy down, the decoded fp32 sum up; 16 with
Top-k's error feedback, whose residual variable crosses both ways too), and
the payloads start and end on the host wherever TensorFlow places Horovod's
allgather. Uncompressed tensors (below ``min_numel``) stay on the GPU.

Everything that changes from step to step lives in ``tf.Variable`` objects
(per gradient: an int64 step counter for the counter-based RNG and, with error
feedback, an fp32 residual), so a compressor works eagerly and inside
``tf.function`` (traced once) and is saved and restored by
``tf.train.Checkpoint(compressor=...)``. Tensors below ``min_numel`` elements
and non-float tensors go through Horovod's allreduce unchanged; Horovod
allgathers ``tf.IndexedSlices`` itself without calling the compressor.
"""
import time

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
from horovod_qsgd.codecs import RandomKCodec, TopKCodec
from horovod_qsgd.common.errors import CompressionMismatchError
from horovod_qsgd.common.exchange import decode_sum, reduction_scale, refusal_notice
from horovod_qsgd.common.naming import PAYLOAD_PREFIX, SECOND_STAGE_PREFIX, rank_key, tensor_key
from horovod_qsgd.common.two_stage import TwoStage, check_exchange, choose_exchange, qsgd_codecs
from horovod_qsgd.tensorflow.compressor_base import (PASS_THROUGH, PLACEHOLDER_DTYPES, CompressorBase, ExchangeContext,
                                                     adapter_method, op_name)
from horovod_qsgd.tensorflow.host_ops import payload_encoder, values_gatherer


class PayloadCompressor(CompressorBase):
    """Sends each gradient as compressed payloads; base of :class:`QSGD` and :class:`TopK`.

    ``second_codec`` (None: allgather only) encodes the owners' sums of the
    two-stage exchange (:mod:`horovod_qsgd.common.two_stage`).
    """

    def __init__(self, codec, min_numel, exchange="allgather", second_codec=None):
        # set first: the base class records settings(), which include them
        self.exchange = exchange
        self.second_codec = second_codec
        super().__init__(codec, min_numel)

    def settings(self):
        return dict(super().settings(), exchange=self.exchange)

    @adapter_method
    def compress(self, tensor):
        step, tensor = self._begin(tensor)
        if step is None:
            return self._pass_through(tensor)
        stats = self._runtime.stats
        process_set = step.site.process_set
        rank = process_set.rank() if process_set.included() else 0
        num_ranks = process_set.size()
        placeholder_dtype = tensor.dtype if tensor.dtype in PLACEHOLDER_DTYPES else tf.float32
        uncompressed, placeholder_nbytes = step.numel * tensor.dtype.size, placeholder_dtype.size
        exchange = "allgather" if self.second_codec is None else choose_exchange(
            self.exchange, self.codec, self.second_codec, step.numel, num_ranks)
        stats.note_exchange(step.name, exchange)
        placeholder = tf.ones([1], dtype=placeholder_dtype)
        if exchange == "two_stage" and num_ranks > 1:
            stage = TwoStage(self.codec, self.second_codec, step.name, step.numel, num_ranks, rank)

            residual_var = self._residual_variable(step.name, step.numel) if self.error_feedback else None

            def encode_for_owners(x, step_value, residual=None):
                start = time.perf_counter()
                out = np.zeros(stage.send_capacity(), dtype=np.uint8)
                residual = None if residual is None else residual.copy()
                splits = stage.encode_for_owners(x, out, int(step_value), residual)
                used = sum(splits)
                # This rank's own chunk stays uncompressed: its gradient, plus (top-k) its residual there.
                begin, end = stage.owned
                own = np.array(x[begin:end], dtype=np.float32)
                if residual is not None:
                    own += residual[begin:end]
                    residual[begin:end] = 0
                stats.add(tensors_compressed=1, tensors_two_stage=1, encode_seconds=time.perf_counter() - start,
                          bytes_uncompressed=uncompressed, bytes_sent=used + placeholder_nbytes,
                          bytes_sent_first_stage=used)
                outputs = (out[:used], np.asarray(splits, dtype=np.int32), own)
                return outputs if residual is None else outputs + (residual,)

            inputs = [step.flat, step.value] + ([] if residual_var is None else [residual_var.read_value()])
            out_dtypes = [tf.uint8, tf.int32, tf.float32] + ([] if residual_var is None else [tf.float32])
            outputs = tf.numpy_function(encode_for_owners, inputs, out_dtypes, stateful=False,
                                        name="horovod_qsgd_encode_slices")
            slices, splits, own = outputs[:3]
            slices.set_shape([None])
            splits.set_shape([num_ranks])
            own.set_shape([stage.owned[1] - stage.owned[0]])
            pending = []
            if residual_var is not None:
                outputs[3].set_shape(step.flat.shape)
                pending.append((residual_var, outputs[3]))
            received, _ = hvd.alltoall(slices, splits=splits, name=op_name(PAYLOAD_PREFIX + step.name),
                                       process_set=process_set)
            return placeholder, ExchangeContext(step.name, tensor.shape, tensor.dtype, num_ranks, gathered=received,
                                                step=step.value, step_variable=step.variable, stage=stage, own=own,
                                                process_set=process_set, pending=pending)

        def on_encoded(nbytes, seconds):
            stats.add(tensors_compressed=1, encode_seconds=seconds, bytes_uncompressed=uncompressed,
                      bytes_sent=nbytes + placeholder_nbytes)

        encode = payload_encoder(self.codec, rank_key(step.name, rank), step.numel, on_encoded)
        payload, pending = self._on_host(step, encode, tf.uint8, "horovod_qsgd_encode")
        gathered = hvd.allgather(payload, name=op_name(PAYLOAD_PREFIX + step.name), process_set=process_set)
        return placeholder, ExchangeContext(step.name, tensor.shape, tensor.dtype, num_ranks, gathered=gathered,
                                            step=step.value, step_variable=step.variable, pending=pending)

    def _second_stage(self, ctx):
        """The owner's re-encoded sum, allgathered (TensorFlow's executor orders the collectives).

        The owner-side residual's new value joins ``ctx.pending``.
        """
        stage, stats, refusals = ctx.stage, self._runtime.stats, self._runtime.refusals
        owner_var = None
        if self.error_feedback:
            begin, end = stage.owned
            owner_var = self._owner_residual_variables(ctx.name, end - begin, [stage.num_ranks, stage.rank])

        def sum_and_encode(received, own, step_value, owner_residual=None):
            start = time.perf_counter()
            total = np.array(own, dtype=np.float32)
            owner_residual = None if owner_residual is None else owner_residual.copy()
            try:
                stage.accumulate_received(received, total)
            except CompressionMismatchError as exc:
                # Still take part in the allgather, with a refusal: the peers raise instead of waiting.
                refusals[stage.name] = exc
                out = np.frombuffer(refusal_notice(), dtype=np.uint8).copy()
            else:
                out = np.zeros(stage.owned_capacity(), dtype=np.uint8)
                out = out[:stage.encode_owned(total, out, int(step_value), owner_residual)]
            stats.add(bytes_sent=out.size, bytes_sent_second_stage=out.size,
                      encode_seconds=time.perf_counter() - start)
            return out if owner_residual is None else (out, owner_residual)

        if owner_var is None:
            payload = tf.numpy_function(sum_and_encode, [ctx.gathered, ctx.own, ctx.step], tf.uint8,
                                        stateful=False, name="horovod_qsgd_encode_sum")
        else:
            payload, new_owner = tf.numpy_function(sum_and_encode, [ctx.gathered, ctx.own, ctx.step,
                                                                    owner_var.read_value()],
                                                   [tf.uint8, tf.float32], stateful=False,
                                                   name="horovod_qsgd_encode_sum")
            new_owner.set_shape(owner_var.shape)
            ctx.pending.append((owner_var, new_owner))
        payload.set_shape([None])
        return hvd.allgather(payload, name=op_name(SECOND_STAGE_PREFIX + ctx.name), process_set=ctx.process_set)

    @adapter_method
    def decompress(self, tensor, ctx):
        if ctx is PASS_THROUGH:
            return tensor
        codec, stats, refusals = self.codec, self._runtime.stats, self._runtime.refusals
        numel = ctx.shape.num_elements()
        name, num_ranks, stage = ctx.name, ctx.num_ranks, ctx.stage
        gathered = ctx.gathered if stage is None else self._second_stage(ctx)

        def decode(gathered, placeholder):
            start = time.perf_counter()
            refusal = refusals.pop(name, None)
            if refusal is not None:
                raise refusal
            total = np.zeros(numel, dtype=np.float32)
            if stage is None:
                decode_sum(codec, gathered, num_ranks, numel, name, total)
            else:
                stage.decode_gathered(gathered, total)
            scale = reduction_scale(float(placeholder.reshape(-1)[0]), num_ranks)
            if scale != 1.0:
                total *= np.float32(scale)
            stats.add(decode_seconds=time.perf_counter() - start)
            return total, self._finite_flag(total)

        total = self._settle(ctx, tf.numpy_function(decode, [gathered, tensor], [tf.float32, tf.bool],
                                                   stateful=False, name="horovod_qsgd_decode"))
        result = tf.reshape(total, ctx.shape)
        return result if ctx.dtype == tf.float32 else tf.cast(result, ctx.dtype)


class QSGD(PayloadCompressor):
    r"""QSGD: stochastic, unbiased quantization to a few bits per coordinate (Alistarh et al., arXiv 1610.02132).

    The flattened gradient is cut into buckets of ``bucket_size`` values. A
    bucket :math:`v` with scale :math:`\|v\|` (``norm="max"``: the largest
    magnitude, as in the paper's experiments; ``"l2"``: the paper's theory)
    sends, for each coordinate, its sign and a level
    :math:`\ell_i \in \{0..s\}` with :math:`s = 2^{bits-1}-1`, where
    :math:`|v_i|/\|v\| \cdot s` is rounded up with probability equal to its
    fractional part, so :math:`E[Q(v)] = v`.

    Exchange. ``"allgather"``: every rank receives every rank's payload and
    decodes all N of them; it receives :math:`(N-1)P` bytes for a payload of
    :math:`P`, so it pays off only for a few ranks. ``"two_stage"``: each rank
    owns 1/N of the buckets; the slices go to their owners (one alltoall),
    each owner adds its own unquantized slice and the N-1 decoded ones,
    quantizes the sum again with ``second_stage_bits`` and the re-quantized
    sums are allgathered: about :math:`(N-1)/N \cdot (P + P_2)` bytes per
    rank, flat in N like a ring allreduce. ``"auto"`` (default) takes the
    allgather at 2 ranks and for tensors under 65536 elements (one collective
    instead of two) and the two stages otherwise. ``compression_stats()``
    says which exchange each tensor used and the bytes of each stage.

    The second quantization adds the variance of quantizing a sum of N
    gradients, which does not shrink with N: with 4+4 bits the relative
    error of the averaged gradient is 0.21 at 8 ranks against the
    allgather's 0.09 (``benchmarks/two_stage_error.py``).
    ``second_stage_bits=8`` brings it to 0.085, below the allgather's, for
    :math:`(N-1)/N \cdot 0.5P` more bytes. On digits neither showed in
    accuracy at 4 or 8 ranks (``benchmarks/results/convergence-two-stage``).

    When to change the defaults. ``bits=4`` matched uncompressed within the
    spread over seeds in both convergence studies (digits with momentum SGD;
    a byte-level language model with Adam, where it ended 0.04 nats per byte
    lower): start there. ``bits=8`` (3.9x fewer bytes) when the link is only
    a little slower than the compute step; ``bits=2`` (15x) when the link
    dominates the step, for more variance (it ended between 4 and 8 bits on
    the language model). From about 8 ranks with the two-stage exchange set
    ``second_stage_bits=8`` (the owners' re-quantization otherwise doubles
    the error of the averaged gradient). Raise ``min_numel`` when many small
    tensors make per-tensor overheads dominate ``compression_stats()``;
    ``bucket_size``, ``norm`` and ``encoding`` rarely need changing.

    Args:
        bits: wire bits per coordinate, 2..8 (2: ternary, 4: s=7, 8: s=127).
            Fewer bits, fewer bytes and more variance.
        bucket_size: coordinates per scale (default 512, the paper's). Larger
            buckets cost fewer scale bytes but add variance.
        norm: ``"max"`` (default; lower variance in practice) or ``"l2"``.
        encoding: ``"fixed"`` (bit-packed, default) or ``"elias"`` (the paper's
            Elias-coded sparse form; pays off with few levels, ``norm="l2"``
            and large buckets).
        scale_dtype: ``"float32"`` (default) or ``"float16"`` per-bucket scales.
        rounding: ``"stochastic"`` (unbiased, default) or ``"deterministic"``
            (round to the nearest level: no randomness, but biased).
        min_numel: tensors with fewer elements go through the ordinary
            allreduce unquantized (default 10000, as in the paper).
        seed: seed of the counter-based RNG (rounding depends on seed, step,
            variable name, rank and element index).
        exchange: ``"auto"`` (default), ``"allgather"`` or ``"two_stage"``.
        second_stage_bits: bits of the owners' re-quantized sums (default:
            ``bits``).

    State: one int64 step counter per compressed gradient (a ``tf.Variable``;
    checkpoint the compressor with ``tf.train.Checkpoint`` to resume
    bit-exactly). The payload bytes are those of ``horovod_qsgd.torch.QSGD``
    for the same input, step and name. Encoding and decoding run on the host
    (``tf.numpy_function``).

    Cost on the wire per rank and step: ``bits + 32/bucket_size`` bits per
    coordinate plus a 16-byte header per payload; 4 bits with bucket 512 is
    4.0625 bits, 7.88x fewer than fp32. Allgather at N ranks: N-1 payloads
    received; two stages: 7.8x fewer bytes than a ring allreduce at any N
    (4+4 bits).
    """

    def __init__(self, bits=4, bucket_size=512, norm="max", encoding="fixed", scale_dtype="float32",
                 rounding="stochastic", min_numel=10000, seed=0, exchange="auto", second_stage_bits=None):
        codec, second, exchange = qsgd_codecs(bits, bucket_size, norm, encoding, scale_dtype, rounding, seed,
                                              exchange, second_stage_bits)
        super().__init__(codec, min_numel, exchange, second)

    def settings(self):
        return dict(super().settings(), second_stage_bits=self.second_codec.bits)


class TopK(PayloadCompressor):
    r"""Top-k sparsification with error feedback (Shi et al., arXiv 1911.08772; Lin et al., DGC).

    Each step the residual :math:`r` (what earlier steps did not send) is
    added to the gradient, the ``k = max(1, floor(ratio * n))`` largest
    magnitudes of the sum are sent as (int32 index, value) pairs and the rest
    stays in the residual: ``sent + r_new == grad + r_old`` exactly.

    Exchange. ``"allgather"``: every rank receives every rank's k pairs,
    :math:`(N-1) \cdot 8k` bytes, and the result has up to :math:`Nk`
    nonzeros. ``"two_stage"``: each rank owns 1/N of the coordinates; a rank
    selects, in every other owner's chunk, the top ``ratio`` of its
    ``grad + r`` there (with error feedback: what it does not send stays in
    ``r``, so no chunk can receive more than its share, whatever the
    gradient), and one alltoall delivers them. The owner adds its own chunk
    of ``grad + r`` (uncompressed) and the received pairs, adds its
    *owner-side residual*, selects the top ``ratio`` of that sum and keeps
    the rest in the owner-side residual; the owners' selections are
    allgathered. Nothing is lost: ``sent + sum of all residuals`` equals the
    sum of all gradients. About :math:`2 (N-1)/N \cdot 8k` bytes per rank,
    flat in N, and about k nonzeros in the result. ``"auto"`` (default):
    the allgather at 2 ranks and for tensors under 65536 elements, the two
    stages otherwise. The owner-side residual is per-rank state of the
    owned chunk; it is in ``state_dict()`` and is reset (with a warning)
    when the job resumes with another number of ranks.

    When to use it. Top-k sends a weight's gradient only when its
    accumulated value is among the largest, so each weight gets few turns:
    on digits (an MLP, 30 epochs) it matched uncompressed, but on a small
    byte-level transformer language model it trained several times more
    slowly than uncompressed with Adam and with momentum SGD, at 1% and
    0.1%, exact or Gaussian (0.8 nats per byte behind after 400 steps, 0.9
    after 1200; 10% still 0.46 behind), where QSGD at 2-8 bits matched it
    (``benchmarks/results/lm-convergence``). Prefer QSGD unless the link is
    so slow that only Top-k's bytes fit, and check convergence on your model
    first. If you use it: keep ``error_feedback=True`` and the residuals in
    checkpoints; ``selector="gaussian"`` when selection time shows in
    ``compression_stats()``.

    Args:
        ratio: fraction of coordinates sent (default 0.01).
        selector: ``"exact"`` (exactly the k largest, default), ``"gaussian"``
            (Gaussian-k: a threshold from mean and standard deviation, at most
            3 refinements; much faster, k is approximate) or ``"sample"``
            (DGC: a threshold from a random sample).
        error_feedback: keep what was not sent (default True). Without it
            top-k is biased and usually converges worse.
        value_dtype: ``"float32"`` (default) or ``"float16"`` values.
        sample_ratio: fraction of coordinates the ``"sample"`` selector reads.
        min_numel: smaller tensors are allreduced unchanged (default 10000).
        seed: seed for the ``"sample"`` selector.
        exchange: ``"auto"`` (default), ``"allgather"`` or ``"two_stage"``.

    Cost on the wire per rank and step: a fixed capacity of entries (k for
    exact, somewhat more for the approximate selectors) times 8 bytes (6 with
    fp16 values) plus a 16-byte header: at ratio 0.01, 0.08 bytes per
    coordinate instead of 4. The residual costs one fp32 copy of every
    compressed gradient in memory, and it is per-rank state: per compressed
    gradient an int64 step counter and the fp32 residuals are ``tf.Variable``\ s,
    saved by ``tf.train.Checkpoint``; every rank saves its own.
    """

    def __init__(self, ratio=0.01, selector="exact", error_feedback=True, value_dtype="float32",
                 sample_ratio=0.01, min_numel=10000, seed=0, exchange="auto"):
        codec = TopKCodec(ratio=ratio, selector=selector, value_dtype=value_dtype, error_feedback=error_feedback,
                          seed=seed, sample_ratio=sample_ratio)
        super().__init__(codec, min_numel, check_exchange(exchange), codec)


class RandomK(CompressorBase):
    r"""Random-k sparsification with a shared seed.

    Every rank draws the same ``k = max(1, floor(ratio * n))`` coordinates
    from (seed, step, variable name), one uniformly inside each of k equal
    strata, so Horovod's own allreduce sums the selected values directly:
    the wire carries k values instead of n, and no indices.

    When to use it. Mostly as a baseline: it needs no index on the wire and
    no selection, but it sends random coordinates, so it converges more
    slowly than Top-k or QSGD at the same bytes (on digits 0.5-0.9 points
    behind at 1%; on the language model with Adam the furthest behind of all).
    Prefer QSGD.

    Args:
        ratio: fraction of coordinates sent (default 0.01).
        error_feedback: keep unsent coordinates in a residual (default False).
        rescale: multiply sent values by n/k so the estimate is unbiased
            (default False; increases variance by n/k).
        value_dtype: ``"float32"`` (default) or ``"float16"``: values are sent
            and summed as fp16 (half the bytes; the sum is rounded to fp16,
            as with Horovod's ``Compression.fp16``).
        min_numel: smaller tensors are allreduced unchanged (default 10000).
        seed: the shared seed; must be equal on all ranks (checked).

    State: per compressed gradient an int64 step counter (and a residual with
    error feedback), in ``tf.Variable``\ s.
    """

    def __init__(self, ratio=0.01, error_feedback=False, rescale=False, value_dtype="float32",
                 min_numel=10000, seed=0):
        super().__init__(RandomKCodec(ratio=ratio, seed=seed, value_dtype=value_dtype,
                                      error_feedback=error_feedback, rescale=rescale), min_numel)

    @adapter_method
    def compress(self, tensor):
        step, tensor = self._begin(tensor)
        if step is None:
            return self._pass_through(tensor)
        stats = self._runtime.stats
        uncompressed = step.numel * tensor.dtype.size

        half = self.codec.value_dtype == "float16"

        def on_gathered(nbytes, seconds):
            stats.add(tensors_compressed=1, encode_seconds=seconds, bytes_uncompressed=uncompressed,
                      bytes_sent=nbytes // 2 if half else nbytes)

        # The codec returns fp32 values, fp16-rounded with value_dtype="float16"; those are sent as fp16
        # (an exact cast), as horovod_qsgd.torch.RandomK sends them: the same bytes in both frameworks.
        gather = values_gatherer(self.codec, tensor_key(step.name), on_gathered)
        values, pending = self._on_host(step, gather, tf.float32, "horovod_qsgd_gather")
        if half:
            values = tf.cast(values, tf.float16)
        return values, ExchangeContext(step.name, tensor.shape, tensor.dtype, step.site.process_set.size(),
                                       step=step.value, step_variable=step.variable, pending=pending)

    @adapter_method
    def decompress(self, tensor, ctx):
        if ctx is PASS_THROUGH:
            return tensor
        codec, stats = self.codec, self._runtime.stats
        numel, key = ctx.shape.num_elements(), tensor_key(ctx.name)

        def scatter(values, step_value):
            start = time.perf_counter()
            total = np.zeros(numel, dtype=np.float32)
            codec.scatter_accumulate(np.ascontiguousarray(values, dtype=np.float32), total,
                                     step=int(step_value), key=key)
            stats.add(decode_seconds=time.perf_counter() - start)
            return total, self._finite_flag(total)

        total = self._settle(ctx, tf.numpy_function(scatter, [tensor, ctx.step], [tf.float32, tf.bool],
                                                   stateful=False, name="horovod_qsgd_scatter"))
        result = tf.reshape(total, ctx.shape)
        return result if ctx.dtype == tf.float32 else tf.cast(result, ctx.dtype)


