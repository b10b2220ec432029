r"""QSGD and top-k behind a DDP communication hook: the Horovod adapter's exchange for ``torch.distributed``.

Each DDP bucket (about 25 MB of fused gradients, ``bucket_cap_mb``) becomes one compressed tensor
``ddp.bucket<i>``, and the hook returns a future of

    average = (1/N) * sum over ranks r of decode(encode(g_r + e_r)),

with ``e_r`` the rank's error-feedback residual (top-k; QSGD keeps none), bitwise what the codecs give
alone for the same gradients (``tests/ddp/test_hooks.py``). Parameters below ``min_numel`` (default 10000)
take one plain allreduce per bucket; each larger one starts a new QSGD scale, so a large gradient's scale
never swamps a norm's small one.

Exchanges (``exchange``): ``"auto"`` (default) is an allgather of the payloads at 2 ranks and the two stages
from 3 for buckets of 65,536 elements or more (an ``all_to_all_single`` of the slices to their owners, each
owner's re-encoded sum to every rank in a second one: about 2(N-1)/N of a payload per rank, flat in N), and
``"node_aware"`` for CUDA gradients on several nodes of equal size (the node sums at full precision first;
only the shards' sums cross between nodes, compressed). ``"allgather"``, ``"two_stage"`` and ``"node_aware"``
force one: the allgather's bytes per rank grow with N (keep it to a few ranks); node-aware on CPU nodes joined
by 1 Gbit/s was slower than the flat two stages (its in-node sum moves the whole bucket at full precision).

Cost: a bucket's encode and decode on the host or the GPU (``compression_stats()`` counts their seconds,
the bytes and the collectives); top-k's error feedback holds two float32 buffers the size of the compressed
parameters, keyed by parameter so DDP's bucket rebuild loses nothing and needs no warm-up; ``state_dict()``
holds them.

How the hook orders its collectives, the node-aware steps and where each residual lives: ``docs/ddp.md``.
"""
import threading
import time
import warnings

import torch
import torch.distributed as dist

from horovod_qsgd.codecs import TopKCodec
from horovod_qsgd.common import docs
from horovod_qsgd.common.chunks import chunk_unit, shard_numel
from horovod_qsgd.common.collectives import drive
from horovod_qsgd.common.engine import PayloadEngine
from horovod_qsgd.common.feedback import StepVerdict
from horovod_qsgd.common.handshake import check_settings, settings_record
from horovod_qsgd.common.node_aware import NODE_AWARE, decode_forwarded, gather_flag, looks_for_nodes
from horovod_qsgd.common.settings import CodecSettings
from horovod_qsgd.common.state import check_loadable, state_header
from horovod_qsgd.common.stats import CompressionStats
from horovod_qsgd.common.two_stage import check_exchange, qsgd_codecs
from horovod_qsgd.ddp.feedback import BucketFeedback
from horovod_qsgd.kernels import finish_sum
from horovod_qsgd.torch_shared.arrays import as_array, kernel_stream
from horovod_qsgd.torch_shared.distributed import (DistributedNodes, DistributedTransport, all_gather_single,
                                            check_payload_settings)
from horovod_qsgd.torch_shared.feedback import DeviceNonfiniteCounts, mark_step_on_device, scaled_and_finite

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class _PayloadState(CodecSettings):
    """What a payload hook keeps between calls: settings, error feedback (``feedback``), the step, statistics.

    Its attributes are the hook's working state, as ``PowerSGDState``'s are: ``engine`` plans each bucket's
    exchange, ``nodes`` is the job's node layout where the exchange is node-aware, ``waiting`` the two-stage
    bucket whose second stage has not started yet."""

    def __init__(self, codec, second_codec, exchange, min_numel, process_group):
        check_payload_settings(codec, min_numel, "the DDP hooks")
        self.process_group = process_group
        self.codec, self.second_codec, self.exchange, self.min_numel = codec, second_codec, exchange, int(min_numel)
        self.iteration = 0  # the RNG's step; advanced after each iteration's last bucket
        self.stats = CompressionStats()
        self.engine = PayloadEngine(codec, second_codec, exchange, self.stats)
        self.feedback = BucketFeedback()
        self.verdict = StepVerdict(mark_step_on_device)  # whether an iteration's residuals are kept, for all buckets
        self.nonfinite_on_device = DeviceNonfiniteCounts()
        self.nodes = None    # DistributedNodes, when the exchange is node-aware
        self.waiting = None  # an _Exchange
        self._verified = False
        self._keys = {}      # id(parameter) -> its key: the order the hook first saw it in
        self._keys_lock = threading.Lock()

    def settings(self):
        return dict(self.codec.config(), min_numel=self.min_numel, exchange=self.exchange)

    # -- pickling (as PowerSGDState: torch.save(state) works) ------------------------------------
    def __getstate__(self):
        """The constructor's arguments and :meth:`state_dict`; the process group cannot be pickled and is left
        out (an unpickled state serves the default group), with a warning where one was given."""
        if self.process_group is not None:
            warnings.warn("horovod_qsgd: the DDP hook state's process_group cannot be pickled; the unpickled state "
                          "serves the default process group.")
        return {"arguments": dict(self._arguments), "state": self.state_dict()}

    def __setstate__(self, saved):
        type(self).__init__(self, **saved["arguments"])
        self.load_state_dict(saved["state"])

    # -- statistics -------------------------------------------------------------------------
    def compression_stats(self, reset=False):
        """Counters since the last reset (see ``horovod_qsgd.torch.QSGD.compression_stats``): buckets compressed
        (``tensors_compressed``), parameters passed through (``tensors_passed_through``), bytes before and after,
        collectives, seconds, non-finite results."""
        self.nonfinite_on_device.drain_into(self.stats)
        return self.stats.snapshot(reset)

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self):
        """The step and the residuals, plus the settings they belong to; every rank saves its own."""
        self.verdict.settle()
        return dict(state_header(type(self).__name__, self.settings()), iteration=self.iteration,
                    **self.feedback.state_dict())

    def load_state_dict(self, state):
        check_loadable(state, type(self).__name__, self.settings())
        self.verdict.settle()
        self.feedback.load_state_dict(state)
        with self._keys_lock:
            # A state that met parameters keeps their keys: DDP may have rebuilt its buckets since, and keys
            # given in the next iteration's order would hand each residual to another parameter. A new state
            # gives them in its first iteration's order, DDP's initial buckets: the order the saved state met them.
            self.iteration = int(state["iteration"])

    def rescale_residuals(self, factor):
        """Multiplies every error-feedback residual by ``factor`` (a float or a 0-d tensor).

        The hooks see the *scaled* gradients of ``torch.amp.GradScaler``, so residuals are kept in the scale
        of their step: call this with new / old scale after ``scaler.update()`` changed it, or the unsent mass
        counts once at the wrong scale (``docs/mixed-precision.md``).
        """
        self.verdict.settle()
        self.feedback.rescale(factor)

    # -- per bucket -------------------------------------------------------------------------
    def handshake(self, group, device):
        """At the first bucket, every rank checks every rank's settings and gradients' device type (raises on
        all ranks), then finds the nodes where the exchange is node-aware."""
        if self._verified:
            return
        records = [None] * group.size()
        mine = settings_record(type(self).__name__, dict(self.settings(), device=device.type))
        dist.all_gather_object(records, mine, group=group)
        check_settings(records)
        if self.exchange == NODE_AWARE or looks_for_nodes(self.exchange, device.type == "cuda",
                                                          self.process_group is None):
            self.nodes = DistributedNodes.of_this_job(group, self.process_group, quiet=self.exchange != NODE_AWARE)
        self._verified = True

    def split(self, bucket):
        """The bucket's parameters, keyed, split into the compressed and the passed through (:class:`_Split`);
        with error feedback, the residuals of those no gradient reached on this rank sit the step out
        (``BucketFeedback.hold_back``)."""
        parameters = bucket.parameters()
        with self._keys_lock:
            keys = [self._keys.setdefault(id(p), len(self._keys)) for p in parameters]
        split = _Split(keys, [p.numel() for p in parameters], self.min_numel, chunk_unit(self.codec))
        if self.error_feedback and split.layout:
            # DDP (find_unused_parameters=True) leaves .grad undefined where no gradient reached a parameter
            self.feedback.hold_back([key for key, _, _ in split.layout],
                                    {key for key, p in zip(keys, parameters) if p.grad is None})
        return split


class _Split:
    """Where a bucket's parameters go. ``layout``: [(key, offset, numel)] of the parameters of at least
    ``min_numel`` elements in the staged tensor the codec compresses, each at a multiple of ``alignment``
    (QSGD's bucket_size); ``bucket_offsets``: where each of them lies in DDP's flat buffer; ``small``:
    [(offset, numel)] in that buffer of the others, which one allreduce averages."""

    def __init__(self, keys, sizes, min_numel, alignment):
        self.layout, self.bucket_offsets, self.small = [], [], []
        staged = bucket = 0
        for key, numel in zip(keys, sizes):
            if numel >= min_numel:
                staged = -(-staged // alignment) * alignment
                self.layout.append((key, staged, numel))
                self.bucket_offsets.append(bucket)
                staged += numel
            else:
                self.small.append((bucket, numel))
            bucket += numel
        self.staged_numel = staged
        # the buffer itself can be the staged tensor: nothing small, no padding
        self.in_place = not self.small and staged == bucket

    def stage(self, flat, out=None):
        """The large parameters of the bucket's flat buffer, as the fp32 tensor the codec compresses: ``flat``
        itself where it can be, else ``out`` (fp32, at least ``staged_numel``; zeros past it) or a new one."""
        if out is None:
            if self.in_place and flat.dtype == torch.float32:
                return flat
            out = torch.empty(self.staged_numel, dtype=torch.float32, device=flat.device)
        end = 0
        for (_, offset, numel), at in zip(self.layout, self.bucket_offsets):
            out[end:offset].zero_()  # the alignment gap: written, never left as the allocator's bytes
            out[offset:offset + numel] = flat[at:at + numel]
            end = offset + numel
        out[end:].zero_()
        return out[:self.staged_numel]

    def unstage(self, staged, flat):
        if staged.data_ptr() == flat.data_ptr():
            return
        for (_, offset, numel), at in zip(self.layout, self.bucket_offsets):
            flat[at:at + numel] = staged[offset:offset + numel]

    def small_part(self, flat):
        return torch.cat([flat[at:at + numel] for at, numel in self.small]) if self.small else None

    def put_small(self, values, flat):
        offset = 0
        for at, numel in self.small:
            flat[at:at + numel] = values[offset:offset + numel]
            offset += numel



class _Exchange:
    """One bucket between its hook call and its decode: the engine's ``conduct`` of its exchange, and what its
    settle needs."""

    def __init__(self, state, bucket, plan, split, flat, residual, future):
        self.state, self.plan, self.split, self.layout = state, plan, split, split.layout
        self.index, self.buffer, self.flat, self.residual = bucket.index(), bucket.buffer(), flat, residual
        self.step, self.future = state.iteration, future
        self.transport, self.conduct, self.owner_residual, self.work, self.received = None, None, None, None, None
        self.stamps, self.stamp = None, 0  # on a GPU, the bucket's verdict stamps and this step's stamp

    def take_owner_residual(self):
        """What the owner's step reads the bucket's owner-side residual through (the engine calls it once the
        slices have arrived)."""
        state = self.state
        self.owner_residual = state.feedback.owner_residual(self.index, self.layout, self.plan.owned,
                                                            self.flat.device, self.stamps, self.stamp)
        return as_array(self.owner_residual)


def payload_hook(state, bucket):
    """The DDP communication hook of :class:`QSGDState` and :class:`TopKState` (``qsgd_hook``, ``topk_hook``)."""
    if not isinstance(bucket, dist.GradBucket):
        raise TypeError(
            f"horovod_qsgd: the DDP hook got a {type(bucket).__name__}, not a GradBucket: DDP's python reducer "
            "(compiled autograd, torch._dynamo.config.optimize_ddp='python_reducer') hands hooks its own buckets, "
            "which the compressed exchange cannot serve. Keep DDP's C++ reducer (the default, or "
            "optimize_ddp='ddp_optimizer') with these hooks.")
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    if bucket.index() == 0:  # an iteration's first bucket: the last iteration is over, and decided
        state.verdict.settle()
        state.feedback.steps_over()
    state.handshake(group, buffer.device)
    num_ranks = group.size()
    split = state.split(bucket)
    if buffer.dtype in _FLOATS and split.layout and state.nodes is not None:
        future = _node_aware(state, bucket, group, buffer, split)
    elif buffer.dtype not in _FLOATS or not split.layout or num_ranks == 1:
        if state.error_feedback:
            state.feedback.spill_stale_owner_residual(bucket.index(), split.layout, None)
        future = _allreduce_average(state, buffer, group, len(bucket.parameters()))
        _resume_waiting(state)  # the waiting bucket's second stage, after this collective on every rank
    else:
        future = _compress(state, bucket, group, buffer, num_ranks, split)
    if bucket.is_last():
        _resume_waiting(state)
        state.iteration += 1
    return future


def _allreduce_average(state, buffer, group, num_parameters):
    """DDP's own average of ``buffer`` (a whole bucket or its small parameters): a future of it."""
    state.stats.add(tensors_passed_through=num_parameters, bytes_uncompressed=buffer.numel() * buffer.element_size(),
                     bytes_sent=buffer.numel() * buffer.element_size())
    work = dist.all_reduce(buffer.div_(group.size()), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _compress(state, bucket, group, buffer, num_ranks, split):
    start = time.perf_counter()
    bucket_flat = buffer.reshape(-1)
    small_future = _average_small(state, group, split, bucket_flat)
    flat = split.stage(bucket_flat)
    plan = state.engine.plan(f"ddp.bucket{bucket.index()}", flat.numel(), num_ranks, group.rank(),
                              sum(numel for _, _, numel in split.layout) * buffer.element_size(), 0)
    if state.error_feedback:
        state.feedback.spill_stale_owner_residual(bucket.index(), split.layout, plan)
        residual, stamps, stamp = state.feedback.residual(bucket.index(), split.layout, flat.numel(), flat.device)
    else:
        residual, (stamps, stamp) = None, state.feedback.step_stamps(bucket.index(), flat.device)
    exchange = _Exchange(state, bucket, plan, split, flat, residual, _new_future(flat.device))
    exchange.stamps, exchange.stamp = stamps, stamp
    future = _with_small(exchange.future, small_future, split, bucket_flat)
    exchange.transport = DistributedTransport(group, group.rank(), flat.device)
    with kernel_stream(flat.device):
        exchange.conduct = plan.conduct(exchange.transport, flat, exchange.step, as_array(residual),
                                        exchange.take_owner_residual if state.error_feedback else None)
        waits = _advance(exchange)
    state.stats.add(encode_seconds=time.perf_counter() - start)
    _resume_waiting(state)  # the bucket before's next collective, after this bucket's first on every rank
    if waits:
        state.waiting = exchange
    return future


def _advance(exchange, received=None):
    """Runs the bucket's exchange to its next collective and starts it; True if that collective is not the last
    (the next hook call resumes the exchange, so a bucket's first collective overlaps the backward pass), else
    its arrival finishes the bucket."""
    collective = exchange.conduct.send(received)
    work, result = exchange.transport.start(collective)
    exchange.state.stats.add(collectives_started=1)
    if collective.final:
        work.get_future().then(lambda arrived: _finish(exchange, result, arrived))
        return False
    exchange.work, exchange.received = work, result
    return True


def _node_aware(state, bucket, group, buffer, split):
    """The bucket's exchange, in the hook call: an in-node reduce-scatter at full precision (each of the node's
    L ranks gets the node's sum of one shard), the engine's exchange of that shard among the nodes (allgather
    or two stages, as for a tensor among as many ranks as nodes), an in-node allgather of what that exchange
    received (still compressed) behind a failure flag, and every shard decoded on every rank. Only what
    crosses nodes is compressed (``docs/node-aware-design.md``)."""
    start = time.perf_counter()
    nodes, device, step = state.nodes, buffer.device, state.iteration
    bucket_flat = buffer.reshape(-1)
    small_future = _average_small(state, group, split, bucket_flat)
    unit = chunk_unit(state.codec)
    shard = shard_numel(split.staged_numel, nodes.local_size, unit)
    plan = state.engine.plan(f"ddp.bucket{bucket.index()}.shard{nodes.local_rank}", shard, nodes.num_nodes,
                              nodes.node, 4 * shard, 0)
    base = nodes.local_rank * shard  # where this rank's shard starts in the staged tensor
    residual = owner_residual = restore = None
    if state.error_feedback:  # error feedback where the compression happens: on the node's sum of the shard
        residual = state.feedback.shard_residual(bucket.index(), split.layout, (base, base + shard), device)
        if plan.owned is not None:
            begin, end = plan.owned
            owner_residual = state.feedback.owner_residual(bucket.index(), split.layout, (base + begin, base + end),
                                                           device)
        else:  # one kept for a two-stage plan this bucket no longer takes
            state.feedback.spill_owner_residual(bucket.index())
    send = torch.empty(nodes.local_size * shard, dtype=torch.float32, device=device)
    flat = split.stage(bucket_flat, out=send)
    if state.error_feedback:  # after the spills above: what they moved is sent now
        carried, restore = state.feedback.take_parameter_residuals(split.layout, flat.numel(), device)
        if carried is not None:
            flat += carried
    slices = torch.empty_like(send)
    dist.all_to_all_single(slices, send, group=nodes.local)
    node_sum = slices[:shard]
    for j in range(1, nodes.local_size):  # in local-rank order: the same bits on every node
        node_sum += slices[j * shard:(j + 1) * shard]
    cross = DistributedTransport(nodes.cross, nodes.node, device)
    with kernel_stream(device):
        gathered, refusal = drive(plan.conduct(cross, node_sum, step, as_array(residual),
                                               lambda: as_array(owner_residual)), cross.run)
    collectives = 2 + cross.started
    # what crossed, still compressed, behind this rank's failure flag, to every rank of the node: rows of one
    # length (fixed payload sizes, one shard size); every rank decodes every shard with its local rank's plan
    error = refusal
    row = torch.cat([torch.frombuffer(bytearray(gather_flag(error is not None)), dtype=torch.uint8).to(device),
                     gathered])
    rows = torch.empty(nodes.local_size * row.numel(), dtype=torch.uint8, device=device)
    all_gather_single(rows, row, group=nodes.local)
    shards = send.zero_()  # sent long ago: its buffer takes the node's shards in local-rank order
    if error is None:
        plans = [plan if j == nodes.local_rank else state.engine.plan(
            f"ddp.bucket{bucket.index()}.shard{j}", shard, nodes.num_nodes, nodes.node, 4 * shard, 0, noted=False)
            for j in range(nodes.local_size)]
        with kernel_stream(device):
            error = decode_forwarded(
                as_array(rows), [(j, j * row.numel(), row.numel()) for j in range(nodes.local_size)],
                lambda j, forwarded: plans[j].decode(forwarded, as_array(shards[j * shard:(j + 1) * shard])),
                f"bucket {bucket.index()}", ranks_named="local rank")
        finite = scaled_and_finite(shards[:flat.numel()], 1.0 / group.size())
    state.stats.add(collectives_started=collectives, encode_seconds=time.perf_counter() - start)
    future = _new_future(device)
    if error is not None:
        if restore is not None:
            restore()
        future.set_exception(error)
        return future
    result = shards[:flat.numel()]
    # every rank holds the whole bucket's result: all decide alike whether the iteration's residuals stay
    if not finite:
        state.stats.add(tensors_nonfinite=1)

    def keep():
        if state.error_feedback:
            state.feedback.keep_shard_residual(bucket.index(), residual)
            if owner_residual is not None:
                state.feedback.keep_owner_residual(bucket.index(), owner_residual)
    state.verdict.defer(bucket.index(), finite, keep, restore)
    split.unstage(result, bucket_flat)
    future.set_result(buffer)
    return _with_small(future, small_future, split, bucket_flat)


def _average_small(state, group, split, bucket_flat):
    """A future of the average of the bucket's parameters below ``min_numel`` (one allreduce); None without any."""
    small = split.small_part(bucket_flat)
    return None if small is None else _allreduce_average(state, small, group, len(split.small))


def _with_small(future, small_future, split, bucket_flat):
    """``future`` (of the bucket's buffer), done only once the small parameters' average is in the bucket too.

    On a GPU the collectives' futures complete when their copies back to the device are queued, not done:
    ``wait()`` (not ``value()``) makes this thread's stream wait for them, and the future returned carries the
    device, so DDP's stream waits for the copy of the small average as well. ``collect_all``'s own future
    carries no device: returned as such, DDP read the small parameters before their average landed (seen on an
    H200 with Gloo: whole small parameters off by up to 3.4 in 16 of 47 rank results,
    ``benchmarks/results/gpu/h200/ddp_2ranks_before_fix.log``)."""
    if small_future is None:
        return future
    done = _new_future(bucket_flat.device)

    def put_small(_):
        try:
            averaged, result = small_future.wait(), future.wait()  # both complete: no host wait
            split.put_small(averaged, bucket_flat)
            done.set_result(result)
        except Exception as exc:  # DDP raises it where it waits for the bucket
            done.set_exception(exc)
    torch.futures.collect_all([small_future, future]).then(put_small)
    return done


def _new_future(device):
    return torch.futures.Future(devices=[device]) if device.type == "cuda" else torch.futures.Future()


def _resume_waiting(state):
    """The waiting bucket's exchange, resumed once its collective arrived: for the two stages, the owner's step
    and the second collective (see the module's docstring for the order)."""
    exchange, state.waiting = state.waiting, None
    if exchange is None:
        return
    start = time.perf_counter()
    exchange.work.wait()
    received, exchange.work, exchange.received = exchange.received, None, None
    with kernel_stream(exchange.flat.device):
        if _advance(exchange, received):
            state.waiting = exchange
    state.stats.add(encode_seconds=time.perf_counter() - start)


def _finish(exchange, received, arrived):
    """Decodes into the bucket's buffer, divides by N, hands the step's residuals to the iteration's verdict.
    ``arrived``: the last collective's future, whose error (Gloo's, NCCL's) is the bucket's."""
    state, plan = exchange.state, exchange.plan
    try:
        try:
            arrived.value()  # raises the collective's own error: nothing arrived to decode
            exchange.conduct.send(received)
        except StopIteration as done:
            gathered, refusal = done.value
        finally:
            exchange.conduct = exchange.transport = None  # the conduct refers to the exchange: no cycle kept
        if refusal is not None:
            raise refusal
        start = time.perf_counter()
        total = exchange.flat.zero_()
        with kernel_stream(total.device):
            plan.decode(as_array(gathered), as_array(total))
        # as the Horovod adapter scales an average: the same bits
        if exchange.stamps is not None:  # a GPU: the verdict stamped for the next step's kernels, nothing read
            with kernel_stream(total.device):
                finish_sum(as_array(total), _device_scale(1.0 / plan.num_ranks, total.device),
                           stamps=as_array(exchange.stamps), stamp=exchange.stamp + 1,
                           counter=as_array(state.nonfinite_on_device.on(total.device)))
            state.verdict.defer_on_device(exchange.index, (exchange.stamps, exchange.stamp + 1))
        else:
            finite = scaled_and_finite(total, 1.0 / plan.num_ranks)
            if not finite:
                state.stats.add(tensors_nonfinite=1)
            state.verdict.defer(exchange.index, finite, lambda: _keep(exchange))
        exchange.split.unstage(total, exchange.buffer.reshape(-1))
        state.stats.add(decode_seconds=time.perf_counter() - start)
        exchange.future.set_result(exchange.buffer)
    except Exception as exc:  # every rank's DDP raises it when it waits for the bucket
        exchange.future.set_exception(exc)


def _keep(exchange):
    """The bucket's step counts (every bucket of its iteration came out finite): its new residuals are kept."""
    state = exchange.state
    if exchange.residual is not None:
        state.feedback.keep_residual(exchange.index, exchange.residual)
    if exchange.owner_residual is not None:
        state.feedback.keep_owner_residual(exchange.index, exchange.owner_residual)


def _device_scale(scale, device):
    """``scale`` as finish_sum takes it on ``device``: a float on the CPU, a float32 device array on a GPU."""
    return as_array(torch.full((1,), scale, dtype=torch.float32, device=device)) if device.type == "cuda" else scale





class QSGDState(_PayloadState):
    __doc__ = docs.qsgd("bucket", node_aware="gpu", state="""

    DDP: ``model.register_comm_hook(QSGDState(process_group=None, bits=4),
    qsgd_hook)``. A DDP bucket's parameters of at least ``min_numel``
    elements are one tensor, each starting a new scale (see
    :mod:`horovod_qsgd.ddp`; ``exchange="node_aware"`` compresses only
    what crosses between nodes); ``encoding="elias"`` is not available here
    (its payloads vary in size). The result is the average over the process
    group, as DDP's own allreduce gives. ``process_group`` (default None:
    the default group): DDP's ``process_group``, where it was given one.""")

    def __init__(self, process_group=None, bits=4, bucket_size=512, norm="max", encoding="fixed",
                 scale_dtype="float32", rounding="stochastic", min_numel=10000, seed=0, exchange="auto",
                 second_stage_bits=None):
        codec, second, exchange = qsgd_codecs(bits, bucket_size, norm, encoding, scale_dtype, rounding, seed,
                                              exchange, second_stage_bits)
        super().__init__(codec, second, exchange, min_numel, process_group)
        self._arguments = dict(bits=bits, bucket_size=bucket_size, norm=norm, encoding=encoding,
                               scale_dtype=scale_dtype, rounding=rounding, min_numel=min_numel, seed=seed,
                               exchange=exchange, second_stage_bits=second_stage_bits)

    def settings(self):
        return dict(super().settings(), second_stage_bits=self.second_codec.bits)


class TopKState(_PayloadState):
    __doc__ = docs.topk("``state.state_dict()`` on every rank. DDP: ``model.register_comm_hook(TopKState(), "
                        "topk_hook)``; the residuals are kept per parameter, so DDP's bucket rebuild after the "
                        "first iteration loses nothing. ``process_group`` (default None: the default group): DDP's "
                        "``process_group``, where it was given one.", node_aware="gpu")

    def __init__(self, process_group=None, ratio=0.01, selector="exact", error_feedback=True, value_dtype="float32",
                 sample_ratio=0.01, min_numel=10000, seed=0, exchange="auto"):
        codec = TopKCodec(ratio=ratio, selector=selector, value_dtype=value_dtype, error_feedback=error_feedback,
                          seed=seed, sample_ratio=sample_ratio)
        super().__init__(codec, codec, check_exchange(exchange), min_numel, process_group)
        self._arguments = dict(ratio=ratio, selector=selector, error_feedback=error_feedback,
                               value_dtype=value_dtype, sample_ratio=sample_ratio, min_numel=min_numel, seed=seed,
                               exchange=exchange)


def qsgd_hook(state, bucket):
    """The DDP communication hook of :class:`QSGDState` (its own function, so that DDP's logging names it).

    Args:
        state (QSGDState): the settings, statistics and step counter (``register_comm_hook``'s ``state``).
        bucket (torch.distributed.GradBucket): DDP's bucket of gradients.

    Returns a future of the bucket's average over the process group. Costs: what :class:`QSGDState` says.
    """
    return payload_hook(state, bucket)


def topk_hook(state, bucket):
    """The DDP communication hook of :class:`TopKState`.

    Args:
        state (TopKState): the settings, residuals and statistics (``register_comm_hook``'s ``state``).
        bucket (torch.distributed.GradBucket): DDP's bucket of gradients.

    Returns a future of the bucket's average over the process group. Costs: what :class:`TopKState` says.
    """
    return payload_hook(state, bucket)
