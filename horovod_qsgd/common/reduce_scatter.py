r"""The compressed reduce-scatter: FSDP2's gradient exchange, run as the first of the two stages.

A reduce-scatter's input on each of N ranks is N rows; row j holds this
rank's gradient of the coordinates rank j owns, and rank j ends with the
sum of every rank's row j. Compressed (:class:`ReduceScatterPlan`):

1. ``encode``: every row but its own, each with the codec (its own RNG key
   per sender and owner), into one buffer; one alltoall delivers row j to
   rank j. The own row stays uncompressed (with error feedback: plus the
   residual's mass there, which is then zero).
2. The owner adds the N-1 decoded rows, in rank order, to its own row.

That is :class:`~horovod_qsgd.common.two_stage.TwoStage`'s first stage with
the rows as the chunks; there is no second stage, since the sum stays with
its owner and nothing is re-encoded. A rank sends (N-1) compressed rows and
receives as many, as an ideal reduce-scatter sends (N-1) rows at full
precision. Top-k's error feedback is the sender's only: what a row did not
send stays in that rank's residual of the row.

A row is *staged* (:class:`RowLayout`) so that each parameter's piece of it
starts at a multiple of the codec's unit (QSGD's ``bucket_size``): no scale
spans two parameters (a scale shared by a layer norm and a weight lost
accuracy in the DDP hooks, ``horovod_qsgd.ddp``). The adapter stages,
runs the conduct, scales the owner's sum and unstages it.
"""
from horovod_qsgd.common.collectives import ALLTOALL, Collective
from horovod_qsgd.common.errors import CompressionMismatchError
from horovod_qsgd.common.naming import PAYLOAD_PREFIX
from horovod_qsgd.common.two_stage import TwoStage
from horovod_qsgd.kernels import move_into_own_chunk

REDUCE_SCATTER = "reduce_scatter"


class RowLayout:
    """Where each parameter's piece of a row goes in the staged row the codec compresses.

    ``pieces``: element counts of the pieces, in row order (FSDP2: each
    parameter's padded shard); ``unit``: what each staged piece starts at a
    multiple of. ``offsets[i]``: piece i's start in the staged row;
    ``staged_numel``: the staged row's length, a multiple of ``unit`` (so that
    the rows of N ranks are the chunks :func:`~horovod_qsgd.common.chunks.chunk_bounds`
    gives too); ``in_place``: the staged row is the row itself (no gap).
    """

    def __init__(self, pieces, unit):
        self.pieces, self.offsets, at = [int(n) for n in pieces], [], 0
        for numel in self.pieces:
            at = -(-at // unit) * unit
            self.offsets.append(at)
            at += numel
        self.row_numel = sum(self.pieces)
        self.staged_numel = -(-at // unit) * unit
        self.in_place = self.staged_numel == self.row_numel

    def runs(self):
        """[(offset in the row, offset in the staged row, elements)] of the pieces."""
        runs, at = [], 0
        for numel, offset in zip(self.pieces, self.offsets):
            runs.append((at, offset, numel))
            at += numel
        return runs


class ReduceScatterPlan(TwoStage):
    """One compressed reduce-scatter on ``rank`` of ``num_ranks``: staged rows of ``staged_row_numel`` elements.

    ``uncompressed_nbytes``: what an ideal reduce-scatter of the same input sends from this rank ((N-1) rows
    in the input's dtype), for the statistics.
    """
    kind = REDUCE_SCATTER

    def __init__(self, codec, name, staged_row_numel, num_ranks, rank, stats, uncompressed_nbytes):
        super().__init__(codec, codec, name, staged_row_numel * num_ranks, num_ranks, rank)
        self.bounds = [(owner * staged_row_numel, (owner + 1) * staged_row_numel) for owner in range(num_ranks)]
        self.owned = self.bounds[rank]
        self.stats, self.uncompressed_nbytes = stats, uncompressed_nbytes
        self.payload_name = PAYLOAD_PREFIX + name

    def encode(self, x, out, own, step, residual=None):
        """Step 1: the other owners' rows of ``x`` (flat float32, N staged rows) into ``out`` (zeroed uint8 of
        :meth:`send_capacity` bytes); this rank's row into ``own`` (float32), with the residual's mass there.
        Returns the alltoall's splits."""
        splits = self.encode_for_owners(x, out, step, residual)
        begin, end = self.owned
        move_into_own_chunk(x[begin:end], None if residual is None else residual[begin:end], own)
        used = sum(splits)
        self.stats.add(tensors_compressed=1, bytes_uncompressed=self.uncompressed_nbytes, bytes_sent=used)
        return splits

    def conduct(self, transport, x, step, residual=None):
        """The reduce-scatter up to the owner's sum, as :meth:`~horovod_qsgd.common.engine.AllgatherPlan.conduct`:
        yields the one alltoall, and returns (this rank's staged row of the sum, a float32 tensor of the
        adapter's; None, or the CompressionMismatchError a received row raised: another codec, setting or shape
        on its sender, which every rank that receives from it finds too)."""
        out = transport.zeros(self.send_capacity(), "uint8")
        own = transport.empty(self.own_numel(), "float32")
        splits = self.encode(transport.array(x), transport.array(out), transport.array(own), step, residual)
        received, _ = yield Collective(ALLTOALL, self.payload_name, out[:sum(splits)], splits=splits,
                                       arriving=self.first_stage_arriving(), final=True)
        try:
            self.accumulate_received(transport.array(received), transport.array(own))
        except CompressionMismatchError as exc:
            return own, exc
        return own, None
