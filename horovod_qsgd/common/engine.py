"""The exchange of one compressed tensor, written once for every adapter.

An adapter (:mod:`horovod_qsgd.torch`, :mod:`horovod_qsgd.tensorflow`) turns
tensors into codec arrays (numpy on the host, CUDA arrays on a GPU),
allocates the zeroed buffers a plan asks for, runs the collective a plan
names and keeps the per-tensor state (step counters, residuals). Everything
between the collectives is here, as numbered steps in the order they run:

Allgather (:class:`AllgatherPlan`; 2 ranks, small tensors)
    1. ``encode``: the gradient (plus its residual) into one payload.
       The adapter allgathers it under ``payload_name``.
    2. ``decode``: every rank's payload, in rank order, into one sum.

Two stages (:class:`TwoStagePlan`; from 3 ranks, large tensors; see
:mod:`horovod_qsgd.common.two_stage`, and :mod:`horovod_qsgd.common.fusion`
for many tensors in one collective)
    1. ``encode``: the slices the other owners need, and this rank's own chunk
       (uncompressed, with the residual's mass there). The adapter alltoalls
       the slices under ``payload_name``.
    2. ``sum_and_encode``: the owner adds what arrived to its own chunk and
       re-encodes the sum, or writes a refusal notice if a slice does not
       match. The adapter allgathers it under ``second_stage_name``.
    3. ``decode``: every owner's sum into its chunk.

Each plan's :meth:`~AllgatherPlan.conduct` runs those steps as a generator that
yields each :class:`~horovod_qsgd.common.collectives.Collective` it needs, in
order, and is sent what that collective received: the adapter that drives it
(a transport, see :mod:`horovod_qsgd.common.collectives`) never branches on
the exchange.

The adapter then multiplies by :func:`~horovod_qsgd.common.exchange.reduction_scale`
(sum or average, as its call site asked) and settles the step's state. Each
step counts the tensors and bytes it produces in the compressor's
:class:`~horovod_qsgd.common.stats.CompressionStats`; collectives are counted
by whoever starts them (fusion decides how many there are), seconds by the
adapter (they depend on where it waits).
"""

from horovod_qsgd.common.collectives import ALLGATHER, ALLTOALL, Collective
from horovod_qsgd.common.exchange import decode_gathered
from horovod_qsgd.common.node_aware import NODE_AWARE, NodeAwarePlan
from horovod_qsgd.common.naming import PAYLOAD_PREFIX, SECOND_STAGE_PREFIX, rank_key
from horovod_qsgd.common.two_stage import KeepsOwnerResidual, TwoStage, choose_exchange, encode_slices_together
from horovod_qsgd.kernels import move_into_own_chunk


class PayloadEngine:
    """Plans the exchange of each compressed tensor of a compressor that sends payloads (QSGD, top-k).

    ``second_codec`` encodes the owners' sums of the two stages (None:
    allgather only); ``mode`` is the compressor's ``exchange`` argument.
    """

    def __init__(self, codec, second_codec, mode, stats):
        self.codec, self.second_codec, self.mode, self.stats = codec, second_codec, mode, stats

    def plan(self, name, numel, num_ranks, rank, uncompressed_nbytes, placeholder_nbytes, note_as=None,
             noted=True):
        """The plan of tensor ``name`` (``numel`` elements) on ``rank`` of ``num_ranks``, noted in the statistics.

        ``uncompressed_nbytes``: what a plain allreduce would have sent;
        ``placeholder_nbytes``: what the adapter sends besides the payloads;
        ``note_as``: the name the statistics note the exchange under (a node-aware plan's shard is its tensor's);
        ``noted=False``: not noted (the plan of another rank's shard, whose payloads this rank only decodes).
        """
        mode = "auto" if self.mode == NODE_AWARE else self.mode  # between nodes: as for a tensor of the nodes
        exchange = "allgather" if self.second_codec is None else choose_exchange(
            mode, self.codec, self.second_codec, numel, num_ranks)
        if noted:
            self.stats.note_exchange(note_as or name, exchange if note_as is None else NODE_AWARE)
        cls = TwoStagePlan if exchange == "two_stage" and num_ranks > 1 else AllgatherPlan
        return cls(self.codec, self.second_codec, name, numel, num_ranks, rank, self.stats, uncompressed_nbytes,
                   placeholder_nbytes)

    def plan_node_aware(self, name, numel, layout, uncompressed_nbytes):
        """The :class:`~horovod_qsgd.common.node_aware.NodeAwarePlan` of tensor ``name`` on ``layout``'s nodes."""
        return NodeAwarePlan(self, name, numel, layout, uncompressed_nbytes)


class _Counted:
    """What a plan's step 1 counts once per tensor, and what an adapter asks of any plan."""

    @property
    def starts_with_alltoall(self):
        """Whether the first collective is an alltoall, which Horovod does not fuse: an adapter that fuses a
        round's tensors groups these itself."""
        return self.collectives()[0][0] == ALLTOALL

    def _count_encoded(self, sent_nbytes, **extra):
        self.stats.add(tensors_compressed=1, bytes_uncompressed=self.uncompressed_nbytes,
                       bytes_sent=sent_nbytes + self.placeholder_nbytes, **extra)


NO_OWNER = (-1, -1)  # the owner layout of a plan whose ranks own no chunk (an empty owner-side residual's)


class AllgatherPlan(_Counted):
    """Every rank's whole payload to every rank, in one allgather."""
    kind = "allgather"
    owned = None  # no rank owns a chunk: no owner-side residual

    def __init__(self, codec, second_codec, name, numel, num_ranks, rank, stats, uncompressed_nbytes,
                 placeholder_nbytes):
        self.codec, self.name, self.numel, self.num_ranks, self.rank = codec, name, numel, num_ranks, rank
        self.stats, self.uncompressed_nbytes, self.placeholder_nbytes = stats, uncompressed_nbytes, placeholder_nbytes
        self.payload_name = PAYLOAD_PREFIX + name

    def capacity(self):
        """Bytes of the zeroed buffer :meth:`encode` writes into."""
        return self.codec.max_payload_nbytes(self.numel)

    def fusion_nbytes(self):
        """What this tensor counts against its fused group's threshold: its float32 gradient's bytes (an
        allgather group waits for its last member, which the backward pass sets by gradient size)."""
        return 4 * self.numel

    def collectives(self):
        """[(kind, name)] of the collectives :meth:`conduct` yields, in order (for a graph built in advance)."""
        return [(ALLGATHER, self.payload_name)]

    def owner_layout(self):
        """:data:`NO_OWNER` (no rank owns a chunk): what :meth:`TwoStagePlan.owner_layout` is where it does."""
        return list(NO_OWNER)

    def own_numel(self):
        """0: this rank keeps no chunk of its own (see :meth:`TwoStagePlan.own_numel`)."""
        return 0

    def encode(self, x, out, step, residual=None):
        """Step 1: encodes ``x`` (flat float32) into ``out``; returns the bytes used, to allgather.

        ``residual`` (error feedback): added to ``x`` and updated in place
        with what the payload does not carry.
        """
        used = self.codec.encode(x, out, step=step, key=rank_key(self.name, self.rank), residual=residual)
        self._count_encoded(used)
        return used

    @staticmethod
    def encode_together(plans, xs, outs, steps, residuals):
        """Step 1 of several plans of one codec (a fused group's members), as each plan's :meth:`encode`: one
        ``encode_many`` where they share a step (one launch sequence on a GPU). Returns the bytes each used."""
        codec = plans[0].codec
        if len(set(steps)) == 1:
            used = codec.encode_many(xs, outs, step=steps[0], keys=[rank_key(plan.name, plan.rank) for plan in plans],
                                     residuals=None if all(r is None for r in residuals) else list(residuals))
            for plan, nbytes in zip(plans, used):
                plan._count_encoded(nbytes)
            return used
        return [plan.encode(x, out, step, residual) for plan, x, out, step, residual
                in zip(plans, xs, outs, steps, residuals)]

    def decode(self, gathered, out):
        """Step 2: adds every rank's payload in the allgather's result, checked, in rank order, to ``out``."""
        decode_gathered(self.codec, gathered, self.num_ranks, self.numel, self.name, out)

    def conduct(self, transport, x, step, residual=None, owner_residual=None):
        """The exchange up to its result, as a generator: yields each :class:`Collective`, is sent what it
        received, and returns (what the last one received, for :meth:`decode`; None, or the error to raise
        instead of decoding, once that collective is done).

        ``transport``: the adapter's ``zeros(n, dtype)`` and ``empty(n, dtype)`` (its tensors; dtype "uint8" or
        "float32") and ``array(tensor)`` (the codec array of one); ``x``: the flat float32 gradient (the
        adapter's tensor); ``residual``: the error-feedback residual as the codec takes it (None without);
        ``owner_residual``: unused here (see :meth:`TwoStagePlan.conduct`).
        """
        out = transport.zeros(self.capacity(), "uint8")
        used = self.encode(transport.array(x), transport.array(out), step, residual)
        arriving = [self.capacity()] * self.num_ranks if self.codec.payload_nbytes_is_fixed else None
        gathered = yield Collective(ALLGATHER, self.payload_name, out[:used], arriving=arriving, equal_parts=True,
                                    final=True)
        return gathered, None


class TwoStagePlan(TwoStage, KeepsOwnerResidual, _Counted):
    """Slices to their owners in one alltoall; the owners' re-encoded sums to every rank in one allgather."""
    kind = "two_stage"

    def __init__(self, codec, second_codec, name, numel, num_ranks, rank, stats, uncompressed_nbytes,
                 placeholder_nbytes):
        super().__init__(codec, second_codec, name, numel, num_ranks, rank)
        self.stats, self.uncompressed_nbytes, self.placeholder_nbytes = stats, uncompressed_nbytes, placeholder_nbytes
        self.payload_name, self.second_stage_name = PAYLOAD_PREFIX + name, SECOND_STAGE_PREFIX + name

    def capacity(self):
        """Bytes of the zeroed buffer :meth:`encode` writes the slices into."""
        return self.send_capacity()

    def fusion_nbytes(self):
        """What this tensor counts against its fused group's threshold: its first-stage payload capacity."""
        return self.payload_capacity()

    def collectives(self):
        """[(kind, name)] of the collectives :meth:`conduct` yields, in order (for a graph built in advance)."""
        return [(ALLTOALL, self.payload_name), (ALLGATHER, self.second_stage_name)]

    def owner_layout(self):
        """[ranks, rank]: what an owner-side residual belongs to (saved with it in checkpoints)."""
        return [self.num_ranks, self.rank]

    def encode(self, x, out, own, step, residual=None):
        """Step 1: the slices of ``x`` for the other owners into ``out``; returns the alltoall's splits.

        ``own`` (float32, :meth:`own_numel`) receives this rank's own chunk,
        which it keeps uncompressed: ``x`` there plus, with error feedback,
        the residual there, which is then zero (its mass moved into the sum).
        Elsewhere the residual is updated as each slice's encode leaves it.
        """
        splits = self.encode_for_owners(x, out, step, residual)
        self._keep_own_chunk(x, own, residual, splits)
        return splits

    def _keep_own_chunk(self, x, own, residual, splits):
        begin, end = self.owned
        move_into_own_chunk(x[begin:end], None if residual is None else residual[begin:end], own)
        used = sum(splits)
        self._count_encoded(used, tensors_two_stage=1, bytes_sent_first_stage=used)

    @staticmethod
    def encode_together(plans, xs, outs, owns, steps, residuals):
        """Step 1 of several plans of one codec (a fused group's members), as each plan's :meth:`encode`: every
        member's slices in one ``encode_many`` where payload sizes are fixed and the members share a step (one
        launch sequence on a GPU). Returns each member's splits."""
        if not plans[0].first.payload_nbytes_is_fixed or len(set(steps)) != 1:
            return [plan.encode(x, out, own, step, residual) for plan, x, out, own, step, residual
                    in zip(plans, xs, outs, owns, steps, residuals)]
        member_splits = encode_slices_together(plans, xs, outs, steps[0], residuals)
        for plan, x, own, residual, splits in zip(plans, xs, owns, residuals, member_splits):
            plan._keep_own_chunk(x, own, residual, splits)
        return member_splits

    def sum_and_encode(self, received, total, out, step, owner_residual=None):
        """Step 2 (see :meth:`TwoStage.sum_and_encode`): returns (bytes used, None) or (bytes of a refusal
        notice, the CompressionMismatchError to raise once they are sent)."""
        used, refusal = super().sum_and_encode(received, total, out, step, owner_residual)
        self.stats.add(bytes_sent=used, bytes_sent_second_stage=used)
        return used, refusal

    def decode(self, gathered, out):
        """Step 3: adds every owner's decoded sum into its chunk of ``out`` (float32, zeros on entry)."""
        self.decode_gathered(gathered, out)

    def conduct(self, transport, x, step, residual=None, owner_residual=None):
        """The exchange up to its result, as :meth:`AllgatherPlan.conduct`: the slices to their owners, the
        owner's step, the owners' sums to every rank; a refusal (see :meth:`sum_and_encode`) is returned once
        its notice is sent. ``owner_residual``: None, or a function called once the slices arrived that returns
        the owner-side residual as the codec takes it (or None)."""
        out = transport.zeros(self.capacity(), "uint8")
        own = transport.empty(self.own_numel(), "float32")
        splits = self.encode(transport.array(x), transport.array(out), transport.array(own), step, residual)
        return (yield from self.conduct_encoded(transport, out[:sum(splits)], splits, own, step, owner_residual))

    def conduct_encoded(self, transport, slices, splits, own, step, owner_residual=None):
        """:meth:`conduct` from step 1's results: ``slices`` (the adapter's uint8 tensor), their ``splits`` and
        this rank's ``own`` chunk, as :meth:`encode` wrote them (an adapter that encodes before it knows whether
        the tensor is fused with others)."""
        received, _ = yield Collective(ALLTOALL, self.payload_name, slices, splits=splits,
                                       arriving=self.first_stage_arriving())
        owned = transport.zeros(self.owned_capacity(), "uint8")
        used, refusal = self.sum_and_encode(transport.array(received), transport.array(own), transport.array(owned),
                                            step, None if owner_residual is None else owner_residual())
        gathered = yield Collective(ALLGATHER, self.second_stage_name, owned[:used],
                                    arriving=self.second_stage_arriving(), final=True, refusal=refusal)
        return gathered, refusal

    def second_stage_arriving(self):
        """Bytes of each owner's re-encoded sum, or None where payload sizes vary."""
        if not self.second.payload_nbytes_is_fixed:
            return None
        return [self.second.max_payload_nbytes(end - begin) for begin, end in self.bounds]
