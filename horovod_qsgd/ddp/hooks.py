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

import torch
import torch.distributed as dist

from horovod_qsgd.codecs import TopKCodec
from horovod_qsgd.common import docs
from horovod_qsgd.common.chunks import chunk_unit, shard_numel
from horovod_qsgd.common.collectives import drive
from horovod_qsgd.common.engine import PayloadEngine
from horovod_qsgd.common.handshake import check_settings, settings_record
from horovod_qsgd.common.node_aware import NODE_AWARE, decode_forwarded, gather_flag, looks_for_nodes
from horovod_qsgd.common.state import check_loadable, state_header
from horovod_qsgd.common.stats import CompressionStats
from horovod_qsgd.common.two_stage import check_exchange, qsgd_codecs
from horovod_qsgd.kernels import finish_sum
from horovod_qsgd.torch_arrays import as_array, kernel_stream
from horovod_qsgd.torch_distributed import (DistributedNodes, DistributedTransport, all_gather_single,
                                            check_payload_settings)
from horovod_qsgd.torch_feedback import DeviceNonfiniteCounts, KeptResidual, scaled_and_finite, step_stamps

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class _PayloadState:
    """What a payload hook keeps between calls: settings, error feedback, the step, statistics."""

    def __init__(self, codec, second_codec, exchange, min_numel, process_group):
        check_payload_settings(codec, min_numel, "the DDP hooks")
        self.process_group = process_group
        self.codec, self.second_codec, self.exchange, self.min_numel = codec, second_codec, exchange, int(min_numel)
        self.iteration = 0  # the RNG's step; advanced after each iteration's last bucket
        self._stats = CompressionStats()
        self._engine = PayloadEngine(codec, second_codec, exchange, self._stats)
        self._nodes = None          # DistributedNodes, when the exchange is node-aware
        self._lock = threading.Lock()
        self._verified = False
        self._keys = {}             # id(parameter) -> its key: the order the hook first saw it in
        self._residuals = {}        # key -> flat float32 residual (error feedback)
        self._bucket_residuals = {}  # bucket index -> KeptResidual whose views the residuals of its parameters are
        self._bucket_layouts = {}   # bucket index -> the layout its KeptResidual was staged for
        # bucket index -> [stamps, steps started]: a GPU's verdicts, stamped by the pass that scales a bucket's
        # result and read by its next step's kernels (horovod_qsgd.torch_feedback; the node-aware exchange
        # decides on the host)
        self._verdicts = {}
        self._nonfinite_on_device = DeviceNonfiniteCounts()
        self._spilled = {}          # key -> owner-residual mass moved here, added at the parameter's next read
        self._owner_residuals = {}  # bucket index -> _OwnerResidual
        self._shard_residuals = {}  # node-aware: bucket index -> _OwnerResidual of this rank's node-summed shard
        self._waiting = None        # a two-stage bucket whose second stage is not started yet

    @property
    def error_feedback(self):
        return bool(getattr(self.codec, "error_feedback", False))

    def settings(self):
        return dict(self.codec.config(), min_numel=self.min_numel, exchange=self.exchange)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in sorted(self.settings().items()))
        return f"{type(self).__name__}({args})"

    # -- statistics -------------------------------------------------------------------------
    def compression_stats(self, reset=False):
        """Counters since the last reset (see ``horovod_qsgd.torch.QSGD.compression_stats``): buckets compressed
        (``tensors_compressed``), parameters passed through (``tensors_passed_through``), bytes before and after,
        collectives, seconds, non-finite results."""
        self._nonfinite_on_device.drain_into(self._stats)
        return self._stats.snapshot(reset)

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self):
        """The step and the residuals, plus the settings they belong to; every rank saves its own."""
        with self._lock:
            self._settle_on_host()
            residuals = {key: r.clone() for key, r in self._residuals.items()}
            for key, spilled in self._spilled.items():  # node-aware: a parameter may have nothing else kept
                residuals[key] = residuals[key] + spilled if key in residuals else spilled.clone()
            return dict(state_header(type(self).__name__, self.settings()), iteration=self.iteration,
                        residuals=residuals,
                        owner_residuals={index: o.as_dict() for index, o in self._owner_residuals.items()},
                        shard_residuals={index: o.as_dict() for index, o in self._shard_residuals.items()})

    def load_state_dict(self, state):
        check_loadable(state, type(self).__name__, self.settings())
        with self._lock:
            self.iteration = int(state["iteration"])
            self._keys = {}  # keys are given again, in the order the next iteration meets the parameters
            self._residuals = {int(key): r.clone() for key, r in state["residuals"].items()}
            self._bucket_residuals, self._bucket_layouts, self._verdicts = {}, {}, {}
            self._spilled = {}
            self._owner_residuals = {int(index): _OwnerResidual.from_dict(o)
                                     for index, o in state["owner_residuals"].items()}
            self._shard_residuals = {int(index): _OwnerResidual.from_dict(o)
                                     for index, o in state.get("shard_residuals", {}).items()}

    # -- per bucket -------------------------------------------------------------------------
    def _handshake(self, group, device):
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
            self._nodes = DistributedNodes.of_this_job(group, self.process_group, quiet=self.exchange != NODE_AWARE)
        self._verified = True

    def _split(self, bucket):
        """The bucket's parameters, keyed, split into the compressed and the passed through (:class:`_Split`)."""
        with self._lock:
            keys = [self._keys.setdefault(id(p), len(self._keys)) for p in bucket.parameters()]
        return _Split(keys, [p.numel() for p in bucket.parameters()], self.min_numel, chunk_unit(self.codec))

    def _step_stamps(self, index, device):
        """(bucket ``index``'s stamps on a GPU, or None on the CPU where the host decides; the stamp of its step
        starting now): taken after anything that settles the residuals on the host, before the step's kernels."""
        with self._lock:
            verdict = self._verdicts.get(index)
            if verdict is None or verdict[0].device != device:
                stamps = step_stamps(device)
                if stamps is None:
                    return None, 0
                self._settle_on_host()
                verdict = self._verdicts[index] = [stamps, 0]
            verdict[1] += 1
            return verdict[0], verdict[1] - 1

    def _settle_on_host(self):
        """Every bucket's residuals in ``kept`` as their stamps say (one host read per bucket), its parameters'
        residuals views of them, the stamps reset: before anything but a step reads or changes them."""
        for index, (stamps, _) in self._verdicts.items():
            read = stamps.cpu()
            for kept in (self._bucket_residuals.get(index), self._owner_residuals.get(index)):
                if kept is not None:
                    kept.settle_on_host(read)
            if index in self._bucket_residuals:
                self._view_parameters(index)
            stamps.zero_()

    def _view_parameters(self, index):
        kept = self._bucket_residuals[index].kept
        for key, offset, numel in self._bucket_layouts[index]:
            self._residuals[key] = kept[offset:offset + numel]

    def _residual(self, index, layout, staged_numel, device):
        """(what bucket ``index``'s step reads its staged residual through and writes the new one into, a
        :class:`~horovod_qsgd.kernels.CarriedResidual`; the step's stamps and stamp): the bucket's own buffers
        while its parameters' residuals are still views of them, else gathered from them into new ones (the
        first step, a rebuilt bucket, spilled mass, a loaded checkpoint), which they then view."""
        with self._lock:
            kept = self._bucket_residuals.get(index)
            if kept is None or not self._views_of(kept.kept, layout, staged_numel, device):
                self._settle_on_host()
                kept = self._gathered_residual(index, layout, staged_numel, device)
        stamps, stamp = self._step_stamps(index, device)
        return kept.for_step(stamps, stamp), stamps, stamp

    def _gathered_residual(self, index, layout, staged_numel, device):
        """Bucket ``index``'s residual gathered from its parameters' (created where missing), as a new
        KeptResidual that they view."""
        staged = torch.zeros(staged_numel, dtype=torch.float32, device=device)
        for key, offset, numel in layout:
            residual = self._residuals.get(key)
            if residual is None:
                residual = self._residuals[key] = torch.zeros(numel, dtype=torch.float32, device=device)
            elif residual.numel() != numel:
                raise ValueError(f"horovod_qsgd: parameter {key} (in the order DDP's buckets first held "
                                 f"them) has {numel} elements, its residual {residual.numel()}: the state "
                                 "was saved for another model.")
            if key in self._spilled:
                residual = self._residuals[key] = residual + self._spilled.pop(key).to(residual.device)
            staged[offset:offset + numel] = residual
        kept = self._bucket_residuals[index] = KeptResidual(staged)
        self._bucket_layouts[index] = list(layout)
        self._view_parameters(index)
        return kept

    def _views_of(self, staged, layout, staged_numel, device):
        """True where every parameter of ``layout`` has a residual that is the view of ``staged`` at its offset,
        with no spilled mass waiting."""
        if staged.numel() != staged_numel or staged.device != device:
            return False
        base, size = staged.data_ptr(), staged.element_size()
        for key, offset, numel in layout:
            residual = self._residuals.get(key)
            if (residual is None or key in self._spilled or residual.data_ptr() != base + offset * size
                    or residual.numel() != numel):
                return False
        return True

    def _keep_residual(self, index, layout, written):
        """Bucket ``index``'s step that wrote through ``written`` counts: its residual is kept, and its
        parameters' residuals are views of it."""
        with self._lock:
            self._bucket_residuals[index].keep(written)
            self._view_parameters(index)

    def _spill_stale_owner_residual(self, index, layout, plan):
        """Moves the owner-side residual of bucket ``index`` into its parameters' residuals unless this call's
        bucket (``layout``; ``plan`` None when it passes through) is the one it was kept for. Done before the
        bucket's first stage reads any residual, so the mass is sent by the next read of each parameter.
        A bucket that passes through spills a node-aware shard residual too."""
        with self._lock:
            saved = self._owner_residuals.get(index)
            if saved is not None and not (plan is not None and saved.fits(layout, plan)):
                self._settle_on_host()
                saved.spill(self._spilled, self._residuals)
                del self._owner_residuals[index]
            if plan is None and index in self._shard_residuals:
                self._shard_residuals.pop(index).spill(self._spilled, self._residuals)

    def _kept_residual(self, store, index, layout, owned, device, stamps=None, stamp=0):
        """What the step reads what ``store`` (a dict of _OwnerResidual by bucket index) keeps of bucket ``index``
        for staged range ``owned`` (zeros at first) through, and writes the new one into (with the step's
        ``stamps`` and ``stamp`` on a GPU). One kept for another layout or range (DDP rebuilt the bucket, the
        exchange changed) is spilled into its parameters' residuals first."""
        with self._lock:
            saved = store.get(index)
            if saved is not None and (saved.layout != [tuple(p) for p in layout] or saved.owned != tuple(owned)):
                self._settle_on_host()
                saved.spill(self._spilled, self._residuals)
                saved = None
            if saved is None:
                saved = store[index] = _OwnerResidual(
                    layout, owned, torch.zeros(owned[1] - owned[0], dtype=torch.float32, device=device))
            return saved.for_step(device, stamps, stamp)

    def _take_parameter_residuals(self, layout, staged_numel, device):
        """The node-aware exchange keeps error feedback per shard: residuals left per parameter (spilled by a
        rebuild) join this rank's gradient once, staged (None if there are none); (staged, restore)."""
        with self._lock:
            self._settle_on_host()
            taken = {key: (self._residuals.pop(key, None), self._spilled.pop(key, None)) for key, _, _ in layout}
        taken = {key: pair for key, pair in taken.items() if pair != (None, None)}
        if not taken:
            return None, None
        staged = torch.zeros(staged_numel, dtype=torch.float32, device=device)
        for key, offset, numel in layout:
            for part in taken.get(key, ()):
                if part is not None:
                    staged[offset:offset + numel] += part.to(device)

        def restore():  # a step whose result is not finite keeps nothing of it
            with self._lock:
                for key, (residual, spilled) in taken.items():
                    for store, part in ((self._residuals, residual), (self._spilled, spilled)):
                        if part is not None:
                            store[key] = part
        return staged, restore


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


class _OwnerResidual:
    """What an owner did not send of its chunk ``owned`` of a bucket laid out as ``layout``."""

    def __init__(self, layout, owned, residual):
        self.layout, self.owned, self._kept = [tuple(p) for p in layout], tuple(owned), KeptResidual(residual)

    @property
    def residual(self):
        return self._kept.kept

    def for_step(self, device, stamps=None, stamp=0):
        """What a step reads this residual through and writes the new one into."""
        return self._kept.to(device).for_step(stamps, stamp)

    def keep(self, written):
        """The step that wrote through ``written`` counts."""
        self._kept.keep(written)

    def settle_on_host(self, stamps):
        self._kept.settle_on_host(stamps)

    def fits(self, layout, plan):
        return (plan.owned is not None and self.layout == [tuple(p) for p in layout]
                and self.owned == tuple(plan.owned))

    def spill(self, spilled, residuals):
        """Adds this residual, where it overlaps each parameter, to ``spilled[key]`` (created like
        ``residuals[key]``): the parameter's next first stage sends it."""
        begin, end = self.owned
        for key, offset, numel in self.layout:
            lo, hi = max(begin, offset), min(end, offset + numel)
            if lo < hi:
                target = spilled.get(key)
                if target is None:
                    like = residuals.get(key)
                    target = spilled[key] = torch.zeros(numel, dtype=torch.float32, device=(
                        self.residual.device if like is None else like.device))
                target[lo - offset:hi - offset] += self.residual[lo - begin:hi - begin].to(target.device)

    def as_dict(self):
        return {"layout": [list(p) for p in self.layout], "owned": list(self.owned), "residual": self.residual.clone()}

    @classmethod
    def from_dict(cls, saved):
        return cls(saved["layout"], saved["owned"], saved["residual"].clone())


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
        self.owner_residual = state._kept_residual(state._owner_residuals, self.index, self.layout, self.plan.owned,
                                                   self.flat.device, self.stamps, self.stamp)
        return as_array(self.owner_residual)


def payload_hook(state, bucket):
    """The DDP communication hook of :class:`QSGDState` and :class:`TopKState` (``qsgd_hook``, ``topk_hook``)."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    state._handshake(group, buffer.device)
    num_ranks = group.size()
    split = state._split(bucket)
    if buffer.dtype in _FLOATS and split.layout and state._nodes is not None:
        future = _node_aware(state, bucket, group, buffer, split)
    elif buffer.dtype not in _FLOATS or not split.layout or num_ranks == 1:
        if state.error_feedback:
            state._spill_stale_owner_residual(bucket.index(), split.layout, None)
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
    state._stats.add(tensors_passed_through=num_parameters, bytes_uncompressed=buffer.numel() * buffer.element_size(),
                     bytes_sent=buffer.numel() * buffer.element_size())
    work = dist.all_reduce(buffer.div_(group.size()), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _compress(state, bucket, group, buffer, num_ranks, split):
    start = time.perf_counter()
    bucket_flat = buffer.reshape(-1)
    small_future = _average_small(state, group, split, bucket_flat)
    flat = split.stage(bucket_flat)
    plan = state._engine.plan(f"ddp.bucket{bucket.index()}", flat.numel(), num_ranks, group.rank(),
                              sum(numel for _, _, numel in split.layout) * buffer.element_size(), 0)
    if state.error_feedback:
        state._spill_stale_owner_residual(bucket.index(), split.layout, plan)
        residual, stamps, stamp = state._residual(bucket.index(), split.layout, flat.numel(), flat.device)
    else:
        residual, (stamps, stamp) = None, state._step_stamps(bucket.index(), flat.device)
    exchange = _Exchange(state, bucket, plan, split, flat, residual, _new_future(flat.device))
    exchange.stamps, exchange.stamp = stamps, stamp
    future = _with_small(exchange.future, small_future, split, bucket_flat)
    exchange.transport = DistributedTransport(group, group.rank(), flat.device)
    with kernel_stream(flat.device):
        exchange.conduct = plan.conduct(exchange.transport, flat, exchange.step, as_array(residual),
                                        exchange.take_owner_residual if state.error_feedback else None)
        waits = _advance(exchange)
    state._stats.add(encode_seconds=time.perf_counter() - start)
    _resume_waiting(state)  # the bucket before's next collective, after this bucket's first on every rank
    if waits:
        state._waiting = exchange
    return future


def _advance(exchange, received=None):
    """Runs the bucket's exchange to its next collective and starts it; True if that collective is not the last
    (the next hook call resumes the exchange, so a bucket's first collective overlaps the backward pass), else
    its arrival finishes the bucket."""
    collective = exchange.conduct.send(received)
    work, result = exchange.transport.start(collective)
    exchange.state._stats.add(collectives_started=1)
    if collective.final:
        work.get_future().then(lambda _: _finish(exchange, result))
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
    nodes, device, step = state._nodes, buffer.device, state.iteration
    bucket_flat = buffer.reshape(-1)
    small_future = _average_small(state, group, split, bucket_flat)
    unit = chunk_unit(state.codec)
    shard = shard_numel(split.staged_numel, nodes.local_size, unit)
    plan = state._engine.plan(f"ddp.bucket{bucket.index()}.shard{nodes.local_rank}", shard, nodes.count,
                              nodes.cross_rank, 4 * shard, 0)
    base = nodes.local_rank * shard  # where this rank's shard starts in the staged tensor
    residual = owner_residual = restore = None
    if state.error_feedback:  # error feedback where the compression happens: on the node's sum of the shard
        residual = state._kept_residual(state._shard_residuals, bucket.index(), split.layout,
                                        (base, base + shard), device)
        owners = state._owner_residuals
        if plan.owned is not None:
            begin, end = plan.owned
            owner_residual = state._kept_residual(owners, bucket.index(), split.layout, (base + begin, base + end),
                                                  device)
        elif bucket.index() in owners:  # kept for a two-stage plan this bucket no longer takes
            with state._lock:
                owners.pop(bucket.index()).spill(state._spilled, state._residuals)
    send = torch.empty(nodes.local_size * shard, dtype=torch.float32, device=device)
    flat = split.stage(bucket_flat, out=send)
    if state.error_feedback:  # after the spills above: what they moved is sent now
        carried, restore = state._take_parameter_residuals(split.layout, flat.numel(), device)
        if carried is not None:
            flat += carried
    slices = torch.empty_like(send)
    dist.all_to_all_single(slices, send, group=nodes.local)
    node_sum = slices[:shard]
    for j in range(1, nodes.local_size):  # in local-rank order: the same bits on every node
        node_sum += slices[j * shard:(j + 1) * shard]
    cross = DistributedTransport(nodes.cross, nodes.cross_rank, device)
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
        plans = [plan if j == nodes.local_rank else state._engine.plan(
            f"ddp.bucket{bucket.index()}.shard{j}", shard, nodes.count, nodes.cross_rank, 4 * shard, 0, noted=False)
            for j in range(nodes.local_size)]
        with kernel_stream(device):
            error = decode_forwarded(
                as_array(rows), [(j, j * row.numel(), row.numel()) for j in range(nodes.local_size)],
                lambda j, forwarded: plans[j].decode(forwarded, as_array(shards[j * shard:(j + 1) * shard])),
                f"bucket {bucket.index()}", ranks_named="local rank")
        finite = scaled_and_finite(shards[:flat.numel()], 1.0 / group.size())
    state._stats.add(collectives_started=collectives, encode_seconds=time.perf_counter() - start)
    future = _new_future(device)
    if error is not None:
        if restore is not None:
            restore()
        future.set_exception(error)
        return future
    result = shards[:flat.numel()]
    # every rank holds the whole bucket's result: all decide alike whether the step's residuals stay
    if finite:
        if state.error_feedback:
            with state._lock:
                state._shard_residuals[bucket.index()].keep(residual)
                if owner_residual is not None:
                    state._owner_residuals[bucket.index()].keep(owner_residual)
    else:
        state._stats.add(tensors_nonfinite=1)
        if restore is not None:
            restore()
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
    exchange, state._waiting = state._waiting, None
    if exchange is None:
        return
    start = time.perf_counter()
    exchange.work.wait()
    received, exchange.work, exchange.received = exchange.received, None, None
    with kernel_stream(exchange.flat.device):
        if _advance(exchange, received):
            state._waiting = exchange
    state._stats.add(encode_seconds=time.perf_counter() - start)


def _finish(exchange, received):
    """Decodes into the bucket's buffer, divides by N, keeps the step's residuals if the result is finite."""
    state, plan = exchange.state, exchange.plan
    try:
        try:
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
                           counter=as_array(state._nonfinite_on_device.on(total.device)))
        elif scaled_and_finite(total, 1.0 / plan.num_ranks):
            if exchange.residual is not None:
                state._keep_residual(exchange.index, exchange.layout, exchange.residual)
            if exchange.owner_residual is not None:
                with state._lock:
                    state._owner_residuals[exchange.index].keep(exchange.owner_residual)
        else:
            state._stats.add(tensors_nonfinite=1)
        exchange.split.unstage(total, exchange.buffer.reshape(-1))
        state._stats.add(decode_seconds=time.perf_counter() - start)
        exchange.future.set_result(exchange.buffer)
    except Exception as exc:  # every rank's DDP raises it when it waits for the bucket
        exchange.future.set_exception(exc)


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
    group, as DDP's own allreduce gives.""")

    def __init__(self, process_group=None, bits=4, bucket_size=512, norm="max", encoding="fixed",
                 scale_dtype="float32", rounding="stochastic", min_numel=10000, seed=0, exchange="auto",
                 second_stage_bits=None):
        codec, second, exchange = qsgd_codecs(bits, bucket_size, norm, encoding, scale_dtype, rounding, seed,
                                              exchange, second_stage_bits)
        super().__init__(codec, second, exchange, min_numel, process_group)

    def settings(self):
        return dict(super().settings(), second_stage_bits=self.second_codec.bits)


class TopKState(_PayloadState):
    __doc__ = docs.topk("``state.state_dict()`` on every rank. DDP: ``model.register_comm_hook(TopKState(), "
                        "topk_hook)``; the residuals are kept per parameter, so DDP's bucket rebuild after the "
                        "first iteration loses nothing.", node_aware="gpu")

    def __init__(self, process_group=None, ratio=0.01, selector="exact", error_feedback=True, value_dtype="float32",
                 sample_ratio=0.01, min_numel=10000, seed=0, exchange="auto"):
        codec = TopKCodec(ratio=ratio, selector=selector, value_dtype=value_dtype, error_feedback=error_feedback,
                          seed=seed, sample_ratio=sample_ratio)
        super().__init__(codec, codec, check_exchange(exchange), min_numel, process_group)


qsgd_hook = topk_hook = payload_hook
