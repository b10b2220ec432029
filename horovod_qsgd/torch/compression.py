"""Compressors for ``hvd.DistributedOptimizer(..., compression=...)`` that really send fewer bytes.

Horovod calls ``compress(grad)``, allreduces what comes back, and calls
``decompress(result, ctx)``. Bit-packed QSGD levels and top-k (index, value)
pairs cannot be summed by an allreduce, so :class:`QSGD` and :class:`TopK`
work like this:

1. ``compress`` encodes the gradient into a payload (header + body, see
   :mod:`horovod_qsgd.codecs`), starts an asynchronous ``hvd.allgather`` of
   it under a name derived from the parameter's name, and returns a
   one-element placeholder holding 1 for the optimizer to allreduce.
2. The optimizer's allreduce of the placeholder applies its own op,
   prescale and postscale: it comes back as the number of ranks for
   ``op=hvd.Sum`` and as 1 for ``hvd.Average`` (with or without
   ``gradient_predivide_factor``), which tells ``decompress`` what to do
   without being told.
3. ``decompress`` waits for the allgather, checks every rank's header
   against its own, decodes all payloads in rank order into one fp32 sum and
   multiplies it by ``placeholder / num_ranks``.

From 3 ranks, large tensors take the two-stage exchange instead
(:mod:`horovod_qsgd.common.two_stage`), fused (:mod:`horovod_qsgd.common.fusion`):
``compress`` encodes the slices each owner needs and, once every tensor of
its group (learned from the step before) is compressed, starts one
``hvd.alltoall_async`` of the group's slices; the first ``decompress`` of a
step starts the groups still waiting, sums and re-encodes this rank's owned
chunks and starts one allgather per group, in name order; the first
``decompress`` of a group's tensors decodes the owners' sums of all of them.
What is in flight between the two calls, and when each collective starts:
:mod:`horovod_qsgd.torch.exchanges`. This file holds the Compression
interface, the per-tensor state and the statistics.

:class:`RandomK` needs none of this: every rank picks the same coordinates
from a shared seed, so the optimizer's own allreduce sums the selected values.

Tensors below ``min_numel`` elements and non-float tensors go through the
ordinary allreduce unchanged.
"""
import itertools
import os
import time
import weakref

import horovod.torch as hvd
import torch

from horovod_qsgd.codecs import RandomKCodec
from horovod_qsgd.common import docs
from horovod_qsgd.common.call_site import takes_op_uncompressed
from horovod_qsgd.common.errors import elastic_state_missing, tensor_name_shared
from horovod_qsgd.common.engine import PayloadEngine
from horovod_qsgd.common.exchange import SNAP_TOLERANCE, reduction_scale
from horovod_qsgd.common.fusion import DEFAULT_FUSION_THRESHOLD, check_fusion_threshold
from horovod_qsgd.common.node_aware import NODE_AWARE, job_nodes, looks_for_nodes
from horovod_qsgd.common.payload_compressors import QSGDArguments, TopKArguments
from horovod_qsgd.common.naming import HANDSHAKE_NAME, tensor_key
from horovod_qsgd.common.feedback import KeepsFeedback
from horovod_qsgd.common.settings import CodecSettings
from horovod_qsgd.common.stats import CompressionStats
from horovod_qsgd.kernels import finish_sum
from horovod_qsgd.torch_shared.arrays import as_array, kernel_stream
from horovod_qsgd.torch_shared.feedback import DeviceNonfiniteCounts, TensorFeedback
from horovod_qsgd.torch.call_site import check_site, find_call_site
from horovod_qsgd.torch.exchanges import PayloadExchanges
from horovod_qsgd.torch.handshake import check_settings_across_ranks
from horovod_qsgd.torch.join import note_allreduce, refuse_if_a_rank_joined, take_over_hvd_join

_PASS_THROUGH = object()
_DIRECT = "hvd.allreduce"  # a tensor name's user that is no optimizer's parameter
_payload_compressors_built = itertools.count()
# Horovod's torch collectives have no bfloat16 kernels: such tensors travel as fp32.
_HOROVOD_FLOATS = (torch.float16, torch.float32, torch.float64)


def _flat_fp32(tensor):
    flat = tensor.detach().reshape(-1)
    return flat if flat.dtype == torch.float32 and flat.is_contiguous() else flat.float().contiguous()


class _InFlight:
    """A compressed tensor between ``compress`` and ``decompress``.

    ``residual`` and ``owner_residual`` are the :class:`~horovod_qsgd.kernels.CarriedResidual` this step
    writes its error-feedback state through, kept only if the result shows that the step counts (see
    ``_settle``); ``state`` holds what the last counted step left.
    """
    __slots__ = ("handle", "name", "shape", "dtype", "num_ranks", "step", "out", "state", "residual",
                 "owner_residual")

    def __init__(self, handle, name, shape, dtype, num_ranks, step, out, state=None, residual=None):
        self.handle, self.name, self.shape, self.dtype = handle, name, shape, dtype
        self.num_ranks, self.step = num_ranks, step
        self.out = out  # flat fp32 memory to decode into, or None for a new tensor
        self.state, self.residual, self.owner_residual = state, residual, None

    def zeroed_output(self, device):
        """Zeros to accumulate the decoded payloads in.

        Reusing the gradient's memory (see CallSite.result_replaces_input)
        skips a fresh allocation, whose page faults cost as much as the
        decoding itself on large CPU tensors (~20 ms for 16.7M elements).
        """
        if self.out is not None:
            return self.out.zero_()
        return torch.zeros(self.shape.numel(), dtype=torch.float32, device=device)


class _CompressorBase(CodecSettings, KeepsFeedback):
    """Settings handshake, per-tensor state, checkpoints and statistics shared by all compressors."""

    # What hvd.join() sends in place of this compressor's tensor (horovod_qsgd.torch.join): zeros, as
    # Horovod's join does, for a tensor that is summed as it is.
    _join_stand_in = 0.0

    def __init__(self, codec, min_numel):
        if min_numel < 0:
            raise ValueError(f"horovod_qsgd: min_numel must be >= 0, got {min_numel}")
        self.codec = codec
        self.min_numel = int(min_numel)
        self._feedback = TensorFeedback()
        self._verified_process_sets = set()
        self._warned_ops = set()  # Min, Max, Product: taken uncompressed, warned of once
        self._users = {}  # tensor name -> a weak reference to its parameter, or _DIRECT
        self._stats = CompressionStats()
        self._nonfinite_on_device = DeviceNonfiniteCounts()  # no host read per tensor
        self._in_elastic_job = os.environ.get("HOROVOD_ELASTIC") == "1"
        self.elastic_state_attached = False  # set by horovod_qsgd.torch.elastic's state handler

    # -- settings ---------------------------------------------------------------------------
    def settings(self):
        return dict(self.codec.config(), min_numel=self.min_numel)

    def _passes_through(self, tensor):
        return (not tensor.dtype.is_floating_point or tensor.is_sparse
                or tensor.numel() < self.min_numel)

    def _handshake(self, process_set, tensor):
        """Once per process set: every rank checks every rank's settings (raises on all ranks); True the first
        time. ``tensor``: the first tensor compressed there."""
        key = process_set.process_set_id
        if key in self._verified_process_sets:
            return False
        check_settings_across_ranks(type(self).__name__, self.settings(), HANDSHAKE_NAME, process_set)
        self._verified_process_sets.add(key)
        return True

    def _claim_name(self, site):
        """Refuses a second user of a tensor name (another model's parameter, or hvd.allreduce beside an
        optimizer), whose state this compressor keeps by name: the users would share one residual. The same
        script runs on every rank, so every rank refuses alike, before the tensor's collectives. A parameter
        that is gone (its model deleted) leaves the name to the next user."""
        user = _DIRECT if site.parameter is None else site.parameter
        claimed = self._users.get(site.name)
        holder = claimed if claimed is None or claimed is _DIRECT else claimed()
        if holder is None:
            self._users[site.name] = _DIRECT if user is _DIRECT else weakref.ref(user)
        elif holder is not user:
            raise tensor_name_shared(site.name, _DIRECT if holder is _DIRECT else "the parameter it met first",
                                     _DIRECT if user is _DIRECT else "another parameter (another model's)")

    def _owner_layout(self, site, tensor):
        """What an owner-side residual of ``tensor`` belongs to on this rank now: [ranks, rank]."""
        return [site.process_set.size(), site.process_set.rank()]

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self):
        """Step counters and residuals by tensor name, plus the settings they belong to.

        Residuals differ between ranks: save each rank's ``state_dict()``
        (e.g. ``torch.save(c.state_dict(), f"compressor.{hvd.rank()}.pt")``)
        to resume bit-exactly.
        """
        return self._feedback.checkpoint(type(self).__name__, self.settings())

    def rescale_residuals(self, factor):
        """Multiplies every error-feedback residual by ``factor`` (a float or a 0-d tensor).

        A loss scaler hands the compressor *scaled* gradients, so residuals
        are kept in the scale of their step. When the scale changes
        (``GradScaler.update()`` halves it after an overflow and doubles it
        after ``growth_interval`` good steps), call this with new / old scale;
        otherwise the mass a residual holds counts once at the wrong scale.
        """
        self._feedback.rescale_feedback(factor)

    # -- Horovod Elastic (horovod_qsgd.torch.elastic) ----------------------------------------
    def start_new_world(self, steps):
        """After an elastic reset, on every rank: the settings are checked again at the next compress, the
        exchange starts afresh (nothing in flight, fusion groups learned anew) and the step counters are
        ``steps`` (rank 0's, by tensor name), so that a rank that joined draws the same random streams."""
        self._verified_process_sets = set()
        self._forget_exchanges()
        self._feedback.set_step_counters(steps)

    def _forget_exchanges(self):
        """Drops what a failed step left in flight."""

    # -- statistics -------------------------------------------------------------------------
    def compression_stats(self, reset=False):
        """Counters since the last reset: tensors, bytes before and after, encode/decode seconds.

        Log it once per step with ``reset=True`` to get per-step numbers.
        ``tensors_nonfinite`` counts compressed results that held inf or NaN
        (steps a loss scaler skips; their error-feedback state was kept).
        """
        self._nonfinite_on_device.drain_into(self._stats)
        return self._stats.snapshot(reset)

    def _pass_through(self, tensor):
        """The tensor for the ordinary allreduce and the ctx that undoes a bfloat16 widening."""
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.dtype.is_floating_point and tensor.dtype not in _HOROVOD_FLOATS:
            sent, ctx = tensor.float(), tensor.dtype
        else:
            sent, ctx = tensor, _PASS_THROUGH
        self._stats.add(tensors_passed_through=1, bytes_uncompressed=nbytes,
                        bytes_sent=sent.numel() * sent.element_size())
        return sent, ctx

    # -- Horovod's Compression interface ------------------------------------------------------
    def compress(self, tensor):
        if self._in_elastic_job and not self.elastic_state_attached:
            raise RuntimeError(elastic_state_missing(type(self).__name__))
        site = find_call_site(tensor)  # refuses Adasum on every rank, before the handshake's collective
        self._handshake(site.process_set, tensor)
        if site.name is not None:  # every named tensor: a refusal then leaves no collective of the same user behind
            self._claim_name(site)
        # A frozen parameter's zero gradient goes uncompressed, so that its residual stays (it would move the
        # frozen weights) and the result is the zeros Horovod's own allreduce gives.
        if (self._passes_through(tensor) or site.frozen
                or takes_op_uncompressed(site.name, hvd, site.op, self._warned_ops)):
            sent, ctx = self._pass_through(tensor)
            note_allreduce(site, sent, 0.0)
            return sent, ctx
        check_site(site)
        start = time.perf_counter()
        flat = _flat_fp32(tensor)
        self._feedback.verdict.begin(site.name)  # a new step: the last one is decided before its state is read
        state = self._feedback.state(site.name, flat.numel(), tensor.device, self.error_feedback,
                                     self._owner_layout(site, tensor), self.codec)
        # The step writes its residual into a second buffer, kept once the result shows the step counts (_settle).
        residual = None if state.residual is None else state.residual.for_step(state.stamps, state.step)
        with kernel_stream(tensor.device):
            sent, handle = self._encode(tensor, flat, site, state.step, residual)
        note_allreduce(site, sent, self._join_stand_in)
        out = flat if site.result_replaces_input and flat.data_ptr() == tensor.data_ptr() else None
        ctx = self._make_context(handle, site, tensor, state, out, residual)
        state.step += 1
        self._stats.add(encode_seconds=time.perf_counter() - start)
        return sent, ctx

    def decompress(self, tensor, ctx):
        passed = self._passed_through(tensor, ctx)
        if passed is not None:
            return passed
        self._check_allreduced(tensor)
        start = time.perf_counter()
        with kernel_stream(tensor.device):
            received = self._receive(ctx)
            received_at = time.perf_counter()
            total, finite = self._decode(tensor, ctx, received)
            self._settle(ctx, finite)
            result = total.view(ctx.shape).to(ctx.dtype)
        self._stats.add(wait_seconds=received_at - start, decode_seconds=time.perf_counter() - received_at)
        return result

    def _encode(self, tensor, flat, site, step, residual):
        """Returns (tensor for the optimizer's allreduce, what ``_make_context`` keeps of the exchange), counted.

        ``residual``: the CarriedResidual this step reads the error-feedback residual through and writes the
        new one into (None without).
        """
        raise NotImplementedError

    def _make_context(self, handle, site, tensor, state, out, residual):
        """What ``decompress`` gets back from ``compress``."""
        return _InFlight(handle, site.name, tensor.shape, tensor.dtype, site.process_set.size(), state.step, out,
                         state, residual)

    def _settle(self, ctx, finite):
        """Hands the tensor's verdict to the step's (:class:`~horovod_qsgd.common.feedback.StepVerdict`): the
        step's error-feedback state is kept if every tensor of the step came out finite, else the state before it.

        A gradient with inf or NaN on any rank (a loss-scale overflow) makes
        the decoded result non-finite on every rank: QSGD gives the bucket a
        NaN scale, top-k sends non-finite values first, random-k sets its
        first value to NaN. Every rank decodes the same bits, so every rank
        decides alike, without a collective; the loss scaler skips the whole
        step, and nothing of it stays in any tensor's residuals, the finite
        layers' included. ``finite``: found by the pass that scaled the result
        (:meth:`_finish`); None on a GPU, where that pass stamped the verdict
        on the device (:mod:`horovod_qsgd.torch_shared.feedback`): no host read.
        """
        verdict = self._feedback.verdict
        if finite is None:
            verdict.defer_on_device(ctx.name, (ctx.state.stamps, ctx.step + 1))
            return
        if not finite:
            self._stats.add(tensors_nonfinite=1)
        writes = [(kept, written) for kept, written in ((ctx.state.residual, ctx.residual),
                                                        (ctx.state.owner_residual, ctx.owner_residual))
                  if written is not None]

        def keep():
            for kept, written in writes:
                kept.keep(written)
        verdict.defer(ctx.name, finite, keep)

    def _finish(self, total, scale, ctx):
        """(``total`` times ``scale``, whether it is finite) in one pass: ``scale`` a float, or on a GPU a float32
        device tensor. Where ctx's tensor has stamps (a GPU), the verdict is stamped there instead (None)."""
        if ctx.state.stamps is None:
            return total, finish_sum(as_array(total), scale)
        finish_sum(as_array(total), as_array(scale.reshape(1)) if total.is_cuda else scale,
                   stamps=as_array(ctx.state.stamps), stamp=ctx.step + 1,
                   counter=as_array(self._nonfinite_on_device.on(total.device)))
        return total, None

    def _check_allreduced(self, tensor):
        """Runs on the optimizer's allreduced ``tensor`` before ``_receive`` waits for anything else."""

    def _receive(self, ctx):
        """Waits for what ``_encode`` started besides the optimizer's allreduce; returns its result."""
        return None

    def _decode(self, tensor, ctx, received):
        """(the flat fp32 result from the allreduced ``tensor``, ``_encode``'s ctx and ``_receive``'s result,
        whether it is finite), through :meth:`_finish`."""
        raise NotImplementedError

    @staticmethod
    def _placeholder(tensor):
        dtype = tensor.dtype if tensor.dtype in _HOROVOD_FLOATS else torch.float32
        return torch.ones(1, dtype=dtype, device=tensor.device)

    @staticmethod
    def _passed_through(tensor, ctx):
        """The decompressed tensor if ctx marks a pass-through, else None."""
        # None: Horovod reduced the tensor without calling compress (a sparse gradient it allgathers)
        if ctx is _PASS_THROUGH or ctx is None:
            return tensor
        if isinstance(ctx, torch.dtype):
            return tensor.to(ctx)
        return None


class PayloadCompressor(_CompressorBase):
    """Sends each gradient as compressed payloads (base of :class:`QSGD` and :class:`TopK`): ``compress``
    hands it to this compressor's :class:`~horovod_qsgd.torch.exchanges.PayloadExchanges` behind a
    placeholder for the optimizer's allreduce, ``decompress`` takes its sum from there. ``second_codec``
    (None: allgather only) encodes the owners' sums of the two stages (:mod:`horovod_qsgd.common.two_stage`).
    """

    def __init__(self, codec, min_numel, exchange="allgather", second_codec=None,
                 fusion_threshold=DEFAULT_FUSION_THRESHOLD):
        super().__init__(codec, min_numel)
        self.exchange = exchange
        self.second_codec = second_codec
        self.fusion_threshold = check_fusion_threshold(fusion_threshold)
        # Group names count from 1 in each compressor; two compressors in one process (two optimizers) must not
        # start collectives under the same name. Scripts build their compressors in the same order on every rank.
        self._exchanges = PayloadExchanges(PayloadEngine(codec, second_codec, exchange, self._stats), self._feedback,
                                           self._stats, self.fusion_threshold,
                                           f"compressor{next(_payload_compressors_built)}.", self.error_feedback)
        self._nodes = None  # the NodeLayout, where this compressor's exchange is node-aware (global process set)

    # A placeholder's NaN tells a rank in a step that a rank is in hvd.join() (every rank in a step sends 1).
    _join_stand_in = float("nan")

    def _check_allreduced(self, placeholder):
        refuse_if_a_rank_joined(placeholder)  # before waiting for a payload the joined rank will not send

    def _forget_exchanges(self):
        self._exchanges.forget()

    def _handshake(self, process_set, tensor):
        """Also finds the nodes, once, where the exchange may be node-aware (see :meth:`_takes_node_aware`)."""
        first = super()._handshake(process_set, tensor)
        if first and looks_for_nodes(self.exchange, tensor.is_cuda, process_set.process_set_id == 0):
            self._nodes = self._find_nodes()
        return first

    def _find_nodes(self):
        """The job's NodeLayout, alike on every rank (see :func:`horovod_qsgd.common.node_aware.job_nodes`)."""
        mine = torch.tensor([[hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()]])
        records = hvd.allgather(mine, name=HANDSHAKE_NAME + ".nodes").tolist()
        return job_nodes(records, hvd.rank(), asked=self.exchange == NODE_AWARE)

    def _takes_node_aware(self, site, tensor):
        """True for a tensor on several nodes that :func:`~horovod_qsgd.common.node_aware.looks_for_nodes`
        sends node-aware."""
        return self._nodes is not None and looks_for_nodes(self.exchange, tensor.is_cuda,
                                                           site.process_set.process_set_id == 0)

    def _owner_layout(self, site, tensor):
        if self._takes_node_aware(site, tensor):
            return self._nodes.as_list()
        return super()._owner_layout(site, tensor)

    def settings(self):
        return dict(super().settings(), exchange=self.exchange, fusion_threshold=self.fusion_threshold)

    def _encode(self, tensor, flat, site, step, residual):
        take_over_hvd_join()  # from the first payload on, which Horovod's join could not answer
        placeholder = self._placeholder(tensor)
        nodes = self._nodes if self._takes_node_aware(site, tensor) else None
        return placeholder, self._exchanges.start(tensor, flat, site, step, residual, placeholder.element_size(),
                                                  nodes)

    def _make_context(self, handle, site, tensor, state, out, residual):
        ctx = super()._make_context(handle, site, tensor, state, out, residual)
        self._exchanges.join(ctx, site)
        return ctx

    def _receive(self, ctx):
        return self._exchanges.receive(ctx)

    def _decode(self, tensor, ctx, received):
        total = self._exchanges.result(ctx, received)
        if tensor.is_cuda:
            return self._finish(total, device_reduction_scale(tensor, ctx.num_ranks), ctx)
        return self._finish(total, reduction_scale(tensor.reshape(-1)[0].item(), ctx.num_ranks), ctx)


def device_reduction_scale(placeholder, num_ranks):
    """:func:`reduction_scale` as a float32 0-d tensor on the placeholder's device.

    On a GPU, ``.item()`` would wait for the queue to drain at every tensor.
    The rule is computed in float64 like the host's and rounded once to
    float32, as a Python float is when a float32 tensor is multiplied by it.
    """
    value = placeholder.reshape(-1)[0].double()
    scaled = value
    for exact in (1.0, float(num_ranks)):  # the last assignment wins: num_ranks first, as on the host
        scaled = torch.where((value - exact).abs() <= SNAP_TOLERANCE * exact, torch.full_like(value, exact), scaled)
    return (scaled / num_ranks).float()


class QSGD(QSGDArguments, PayloadCompressor):
    __doc__ = docs.qsgd("tensor", fusion="step", node_aware="gpu")


class TopK(TopKArguments, PayloadCompressor):
    __doc__ = docs.topk("checkpoint it.", fusion="step", node_aware="gpu")


class RandomK(_CompressorBase):
    __doc__ = docs.randomk("tensor")

    def __init__(self, ratio=0.01, error_feedback=False, rescale=False, value_dtype="float32",
                 min_numel=10000, seed=0):
        super().__init__(RandomKCodec(ratio=ratio, seed=seed, value_dtype=value_dtype,
                                      error_feedback=error_feedback, rescale=rescale), min_numel)

    def _handshake(self, process_set, tensor):
        """Also sets the step counters to rank 0's at the first step: they pick the coordinates, which must be the
        same on every rank, and a checkpoint loaded on rank 0 alone, or a resume at another number of ranks,
        leaves them different."""
        first = super()._handshake(process_set, tensor)
        if first and process_set.process_set_id == hvd.global_process_set.process_set_id:
            self._feedback.set_step_counters(hvd.broadcast_object(self._feedback.step_counters(), root_rank=0,
                                                                  name=HANDSHAKE_NAME + ".steps"))
        return first

    def _encode(self, tensor, flat, site, step, residual):
        values = torch.as_tensor(self.codec.gather(
            as_array(flat), step=step, key=tensor_key(site.name),
            residual=None if residual is None else as_array(residual)), device=flat.device)
        if self.codec.value_dtype == "float16":
            values = values.half()  # exact: the codec rounded them to fp16; the allreduce sums in fp16
        self._stats.add(tensors_compressed=1, bytes_uncompressed=tensor.numel() * tensor.element_size(),
                        bytes_sent=values.numel() * values.element_size())
        return values, None

    def _decode(self, tensor, ctx, received):
        """The values scattered to their coordinates: the result is finite where the k allreduced values are
        (the rest is zeros), which is checked on them, not on the whole result."""
        values = tensor.float().contiguous()
        total = ctx.zeroed_output(tensor.device)
        self.codec.scatter_accumulate(as_array(values), as_array(total), step=ctx.step, key=tensor_key(ctx.name))
        _, finite = self._finish(values, torch.ones(1, device=values.device) if values.is_cuda else 1.0, ctx)
        return total, finite
