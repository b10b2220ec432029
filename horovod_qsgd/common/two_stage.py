r"""The two-stage exchange: compressed scatter-reduce, then an allgather of re-compressed sums.

An allgather of whole payloads delivers N-1 payloads to every rank, so the
bytes a rank receives grow with the number of ranks N. Here every rank *owns*
1/N of the coordinates (a fixed, bucket-aligned split every rank computes
alike, :func:`chunk_bounds`):

1. each rank encodes the slice of its gradient that rank j owns, for every
   j, and one ``alltoall`` delivers the slices to their owners;
2. the owner adds its own slice (unquantized) and the N-1 decoded slices it
   received, in rank order, encodes that sum again with the second-stage
   codec, and one ``allgather`` delivers every owner's re-encoded sum to
   every rank, which decodes them into place.

A rank sends and receives about ``(N-1)/N`` of a first-stage payload and
``(N-1)/N`` of a second-stage payload: flat in N, like a ring allreduce, at
the cost of a second compression of the sum. The owner decodes its own
re-encoded sum like everybody else, so every rank ends with the same bits.

Top-k runs the same two stages with error feedback on both sides: a sender
selects within each owner's chunk (what it does not send stays in its
residual, so no chunk receives more than its share) and moves its own
chunk's residual into its own contribution; the owner selects from its sum
plus an owner-side residual, which keeps what the owner did not send.

Everything here works on codec arrays (numpy, or CUDA arrays for the CUDA
kernels) that the adapters allocate; the collectives are the adapters' job.
"""
import itertools
import warnings
import zlib

from horovod_qsgd.common.chunks import chunk_bounds, chunk_unit, saved_owner_chunk
from horovod_qsgd.common.errors import CompressionMismatchError
from horovod_qsgd.common.exchange import decode_checked, refusal_notice
from horovod_qsgd.kernels import store_bytes

EXCHANGES = ("allgather", "two_stage", "auto", "node_aware")  # node_aware: PyTorch only, so far
# Below this many elements a tensor stays on one collective under exchange="auto": an alltoall is not
# fused by Horovod, so a second collective costs a round trip that small tensors cannot win back.
AUTO_TWO_STAGE_MIN_NUMEL = 1 << 16


def _describe_layout(layout):
    if layout and len(layout) == 4:
        return f"local rank {layout[3]} of node {layout[2]} ({layout[0]} nodes of {layout[1]} ranks)"
    return f"rank {layout[1]} of {layout[0]}" if layout and len(layout) == 2 else f"layout {layout!r}"


def owner_layout_changed(tensor_name, saved, layout):
    """The warning when an owner-side residual saved for layout ``saved`` meets this rank's ``layout``
    ([ranks, rank], or a node layout [nodes, ranks per node, node, local rank])."""
    return (f"horovod_qsgd: tensor {tensor_name!r}: the owner-side residual was saved as "
            f"{_describe_layout(saved)}, this is {_describe_layout(layout)}; it is reset to zeros (its unsent "
            "mass is lost once).")


def encode_slices_together(stages, xs, outs, step, residuals):
    """:meth:`TwoStage.encode_for_owners` of several stages of one fixed-size codec (a fused group's members, or
    one tensor's), at one step: every slice of every stage in one ``encode_many`` (one launch sequence on a
    GPU). Returns each stage's splits."""
    parts = [stage.slices_for_owners(x, out, residual) for stage, x, out, residual in zip(stages, xs, outs, residuals)]
    keeps_residual = any(part[4] is not None for part in parts)
    used = iter(stages[0].first.encode_many(
        [piece for part in parts for piece in part[1]], [slot for part in parts for slot in part[2]], step=step,
        keys=[key for part in parts for key in part[3]],
        residuals=[r for part in parts for r in (part[4] or [None] * len(part[1]))] if keeps_residual else None))
    member_splits = []
    for stage, (owners, *_) in zip(stages, parts):
        splits = dict((owner, next(used)) for owner in owners)
        member_splits.append([splits.get(owner, 0) for owner in range(stage.num_ranks)])
    return member_splits


class KeepsOwnerResidual:
    """A plan whose rank keeps an owner-side residual (``name``, ``owner_layout()``, ``own_numel()``)."""

    def keeps_owner_residual(self, saved_layout, saved_numel):
        """True if an owner-side residual saved for ``saved_layout`` with ``saved_numel`` elements is this
        rank's chunk here; otherwise warns that it is reset to zeros (its unsent mass is lost once)."""
        if list(saved_layout or []) == self.owner_layout() and saved_numel == self.own_numel():
            return True
        warnings.warn(owner_layout_changed(self.name, saved_layout, self.owner_layout()))
        return False


def moved_owner_chunk(tensor_name, numel, unit, saved_layout, saved_numel, layout):
    """Where in the sender residual an owner-side residual saved for ``saved_layout`` goes now that this rank
    is ``layout`` ([ranks, rank]): (begin, end), or None, warned as reset, when it cannot be this tensor's."""
    chunk = saved_owner_chunk(numel, unit, saved_layout, saved_numel)
    if chunk is None:
        warnings.warn(owner_layout_changed(tensor_name, saved_layout, layout))
    return chunk


def check_exchange(exchange):
    """``exchange``, or ValueError naming the allowed values."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange={exchange!r} is not supported; allowed values: "
                         + ", ".join(repr(e) for e in EXCHANGES))
    return exchange


def qsgd_codecs(bits, bucket_size, norm, encoding, scale_dtype, rounding, seed, exchange, second_stage_bits):
    """(first-stage codec, second-stage codec, exchange) for a QSGD compressor's arguments, validated."""
    from horovod_qsgd.codecs import QSGDCodec
    check_exchange(exchange)
    first = QSGDCodec(bits=bits, bucket_size=bucket_size, norm=norm, encoding=encoding, scale_dtype=scale_dtype,
                      rounding=rounding, seed=seed)
    second = first if second_stage_bits is None or second_stage_bits == bits else QSGDCodec(
        bits=second_stage_bits, bucket_size=bucket_size, norm=norm, encoding=encoding, scale_dtype=scale_dtype,
        rounding=rounding, seed=seed)
    return first, second, exchange


def sender_key(name, sender, owner):
    """RNG key of the slice ``sender`` encodes for ``owner``: independent noise per rank and chunk."""
    return zlib.crc32(f"{name}@rank{sender}>owner{owner}".encode("utf-8"))


def owner_key(name, owner):
    """RNG key of the sum ``owner`` re-encodes in the second stage."""
    return zlib.crc32(f"{name}@owner{owner}".encode("utf-8"))


def stage_nbytes(first_codec, second_codec, numel, num_ranks):
    """Bytes one rank sends in (first stage, second stage) for fixed-size payloads.

    Rank r sends the N-1 slices it does not own in the first stage and its
    own re-encoded chunk in the second (the allgather returns N-1 chunks
    to it). Every rank's total is within a bucket of the mean.
    """
    bounds = chunk_bounds(numel, num_ranks, chunk_unit(first_codec))
    sizes1 = [first_codec.max_payload_nbytes(e - b) for b, e in bounds]
    sizes2 = [second_codec.max_payload_nbytes(e - b) for b, e in bounds]
    return (sum(sizes1) * (num_ranks - 1) / num_ranks, sum(sizes2) * (num_ranks - 1) / num_ranks)


def choose_exchange(mode, first_codec, second_codec, numel, num_ranks):
    """"allgather" or "two_stage" for one tensor; ``mode="auto"`` picks the one that moves fewer bytes.

    Per rank and step, the allgather receives N-1 whole payloads; the two
    stages receive about (N-1)/N of a first- and of a second-stage payload
    each. At 2 ranks the two are equal and the allgather wins (one
    collective, one quantization); from 3 ranks the two stages move fewer
    bytes, for tensors of at least ``AUTO_TWO_STAGE_MIN_NUMEL`` elements.
    """
    if mode != "auto":
        return mode
    if num_ranks < 3 or numel < AUTO_TWO_STAGE_MIN_NUMEL:
        return "allgather"
    allgather = (num_ranks - 1) * first_codec.max_payload_nbytes(numel)
    return "two_stage" if sum(stage_nbytes(first_codec, second_codec, numel, num_ranks)) < allgather \
        else "allgather"


class TwoStage:
    """One tensor's two-stage exchange on one rank: what to send, what to sum, what to decode.

    ``first`` encodes the slices sent to their owners, ``second`` the
    owners' sums; ``name`` is the tensor's name (equal on every rank). The
    caller allocates every buffer (zeroed uint8 payload buffers of the
    capacities below, float32 sums) and runs the collectives.
    """

    def __init__(self, first, second, name, numel, num_ranks, rank):
        self.first, self.second = first, second
        self.name, self.numel, self.num_ranks, self.rank = name, numel, num_ranks, rank
        self.bounds = chunk_bounds(numel, num_ranks, chunk_unit(first))
        self.owned = self.bounds[rank]

    def own_numel(self):
        """Elements of this rank's own chunk (the float32 buffer the first stage fills with it)."""
        begin, end = self.owned
        return end - begin

    def payload_capacity(self):
        """Bytes of the first-stage payloads of every chunk: the tensor's size for fusion, equal on every rank."""
        return sum(self.first.max_payload_nbytes(e - b) for b, e in self.bounds)

    def send_capacity(self):
        """Bytes of the buffer :meth:`encode_for_owners` writes into."""
        return sum(self.first.max_payload_nbytes(e - b) for j, (b, e) in enumerate(self.bounds) if j != self.rank)

    def encode_for_owners(self, x, out, step, residual=None):
        """Encodes the slices of x for every other owner into ``out``, in rank order; returns the splits.

        ``splits[j]`` is the number of bytes for rank j (0 for this rank,
        which keeps its own slice uncompressed), as an alltoall takes them;
        they add up to the bytes used at the start of ``out``. ``residual``:
        the sender's error-feedback residual (top-k), updated in place in the
        other owners' chunks; the caller moves its own chunk's residual into
        its own contribution.
        """
        if self.first.payload_nbytes_is_fixed:  # every slot known in advance: one encode_many for all slices
            return encode_slices_together([self], [x], [out], step, [residual])[0]
        splits, offset = [], 0
        for owner, (begin, end) in enumerate(self.bounds):
            if owner == self.rank:
                splits.append(0)
                continue
            slot = out[offset:offset + self.first.max_payload_nbytes(end - begin)]
            used = self.first.encode(x[begin:end], slot, step=step, key=sender_key(self.name, self.rank, owner),
                                     residual=None if residual is None else residual[begin:end])
            splits.append(used)
            offset += used
        return splits

    def slices_for_owners(self, x, out, residual=None):
        """(owners, their slices of ``x``, their slots in ``out``, stream keys, residual slices or None) of
        :meth:`encode_for_owners` where payload sizes are fixed, every slot known before anything is encoded."""
        owners = [owner for owner in range(self.num_ranks) if owner != self.rank]
        sizes = [self.first.max_payload_nbytes(self.bounds[owner][1] - self.bounds[owner][0]) for owner in owners]
        slots = [out[start:start + size] for start, size in zip(itertools.accumulate(sizes, initial=0), sizes)]
        spans = [slice(*self.bounds[owner]) for owner in owners]
        return (owners, [x[span] for span in spans], slots, [sender_key(self.name, self.rank, owner) for owner in owners],
                None if residual is None else [residual[span] for span in spans])

    def accumulate_received(self, received, total):
        """Adds the slices the other ranks sent this owner, decoded in rank order, to ``total``.

        ``total`` holds this rank's own slice of the gradient (plus its
        residual there, for top-k) on entry (float32, ``owned`` length).
        """
        begin, end = self.owned
        senders = [r for r in range(self.num_ranks) if r != self.rank]
        decode_checked(self.first, received, senders, [end - begin] * len(senders), [total] * len(senders), self.name,
                       "first-stage slice")

    def first_stage_arriving(self):
        """Bytes of the slice each rank sends this owner (0 from itself), or None where payload sizes vary."""
        if not self.first.payload_nbytes_is_fixed:
            return None
        begin, end = self.owned
        return [0 if sender == self.rank else self.first.max_payload_nbytes(end - begin)
                for sender in range(self.num_ranks)]

    def owned_capacity(self):
        """Bytes of the buffer :meth:`encode_owned` writes into."""
        begin, end = self.owned
        return self.second.max_payload_nbytes(end - begin)

    def sum_and_encode(self, received, total, out, step, owner_residual=None):
        """The owner's step: the received slices added to ``total``, the sum encoded into ``out``.

        ``total``: this rank's own chunk on entry (see :meth:`accumulate_received`);
        ``out``: zeroed uint8 of :meth:`owned_capacity` bytes. Returns (bytes used, None), or, when a
        received slice does not match (another codec, setting or shape on its sender), (bytes of a
        refusal notice written to ``out``, the CompressionMismatchError): send those bytes in the
        allgather all the same, so that every peer raises instead of waiting, then raise it.
        """
        try:
            self.accumulate_received(received, total)
        except CompressionMismatchError as exc:
            notice = refusal_notice()
            store_bytes(out, 0, notice)
            return len(notice), exc
        return self.encode_owned(total, out, step, owner_residual), None

    def encode_owned(self, total, out, step, owner_residual=None):
        """Encodes the owner's sum into ``out``; returns the bytes used.

        ``owner_residual`` (top-k): what earlier steps' sums did not send,
        added to this one and updated in place (error feedback on the owner).
        """
        return self.second.encode(total, out, step=step, key=owner_key(self.name, self.rank),
                                  residual=owner_residual)

    def decode_gathered(self, gathered, out):
        """Adds every owner's decoded sum into its chunk of ``out`` (float32, zeros on entry)."""
        decode_checked(self.second, gathered, range(self.num_ranks), [e - b for b, e in self.bounds],
                       [out[begin:end] for begin, end in self.bounds], self.name, "second-stage sum")
