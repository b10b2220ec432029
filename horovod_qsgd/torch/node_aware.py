"""The node-aware exchange over Horovod's torch collectives (the steps: :mod:`horovod_qsgd.common.node_aware`).

Every step is a global ``hvd.alltoall_async`` whose splits are zero outside
the step's peers (the ranks of this node, or this local index's rank on every
node): no process set has to be declared in ``hvd.init()`` and no environment
variable set. A flight is one tensor's exchange, or a fused group's
(:class:`~horovod_qsgd.common.node_aware.NodeAwareGroup`: one collective per
step for all its members). Its three collectives (four with two stages between
nodes) each need the one before, and ranks decompress in different orders: a
rank that waited for one flight's step would hold back the steps its peers
wait for. So nothing here waits for a single step: :meth:`NodeAwareExchanges.wait`
polls every flight and starts each one's next collective as soon as its input
has arrived, and every compress does the same without waiting, which overlaps
the exchange with the backward pass.
"""
import threading
import time

import horovod.torch as hvd
import torch

from horovod_qsgd.common.naming import PAYLOAD_PREFIX
from horovod_qsgd.common.node_aware import STEPS, NodeAwareGroup
from horovod_qsgd.torch_arrays import as_array, concatenate_pieces, kernel_stream

_IN_NODE, _CROSS, _CROSS_SUMS, _GATHER, _DONE = range(5)
_POLL_SECONDS = 50e-6


class NodeAwareMember:
    """One tensor's part of a flight, between its compress and its result.

    ``padded``: the tensor (plus residual), zero-padded to L shards, until
    step 1 is sent; ``shard_residual`` and ``owner_residual``: this step's
    error-feedback state of the node's sum of this rank's shard (updated in
    place); ``result``: the tensor's sum over all ranks once done;
    ``flight``: None until its group starts.
    """
    __slots__ = ("plan", "step", "padded", "shard_residual", "owner_residual", "flight", "result", "node_sum", "own")

    def __init__(self, plan, step, padded, shard_residual, owner_residual):
        self.plan, self.step, self.padded = plan, step, padded
        self.shard_residual, self.owner_residual = shard_residual, owner_residual
        self.flight = self.result = self.node_sum = self.own = None


class NodeAwareFlight:
    """One group's exchange (a single tensor's, unfused): the members, the step in flight and its handle;
    ``error``: what every member's rank raises instead, once its part of every step is sent."""
    __slots__ = ("group", "members", "device", "names", "handle", "stage", "error")

    def __init__(self, group, members, names):
        self.group, self.members, self.names = group, members, names
        self.device = members[0].padded.device
        self.handle, self.stage, self.error = None, _IN_NODE, None
        for member in members:
            member.flight = self


class NodeAwareExchanges:
    """The node-aware flights of one compressor in flight on this rank."""

    def __init__(self, stats):
        self.stats = stats
        self._flights = []
        self._lock = threading.Lock()  # one thread advances the exchanges at a time (hooks run on several)

    def start(self, members, group_name=None):
        """Starts step 1 of ``members`` (:class:`NodeAwareMember`), one tensor alone (``group_name`` None: its
        own collectives' names, the unfused wire) or a fused group named ``group_name``; returns the flight."""
        plans = [member.plan for member in members]
        if group_name is None:
            group, names = NodeAwareGroup(plans, fused=False), plans[0].collective_names
        else:
            group, names = NodeAwareGroup(plans), [f"{group_name}.{step}" for step in STEPS]
        flight = NodeAwareFlight(group, members, names)
        layout = group.layout
        tag = torch.tensor(group.tag, dtype=torch.float32, device=flight.device)
        rows = [tag.expand(layout.local_size, group.tag_width)]
        rows += [member.padded.view(layout.local_size, member.plan.shard) for member in members]
        sent = torch.cat(rows, dim=1).reshape(-1)
        for member in members:
            member.padded = None
        self._start(flight, sent, group.in_node_splits())
        with self._lock:
            self._flights.append(flight)
        return flight

    def progress(self):
        """Starts the next step of every exchange whose collective has finished; waits for none."""
        if self._lock.acquire(blocking=False):
            try:
                self._advance_finished()
            finally:
                self._lock.release()

    def wait(self, member):
        """Advances every exchange until ``member``'s flight is done; returns its result (flat float32) or raises
        its flight's error."""
        flight = member.flight
        while flight.stage != _DONE:
            with self._lock:
                progressed = self._advance_finished()
            if not progressed and flight.stage != _DONE:
                time.sleep(_POLL_SECONDS)
        if flight.error is not None:
            raise flight.error
        result, member.result = member.result, None
        return result

    def synchronize(self, handle):
        """``hvd.synchronize(handle)`` of another collective, advancing the exchanges while it runs: a peer
        may need this rank's next step before it can start the collective waited for."""
        while self._flights and not hvd.poll(handle):
            self.progress()
            time.sleep(_POLL_SECONDS)
        return hvd.synchronize(handle)

    def forget(self):
        """Drops what a failed step left in flight."""
        with self._lock:
            self._flights = []

    def _advance_finished(self):
        progressed = False
        for flight in list(self._flights):
            if flight.handle is not None and hvd.poll(flight.handle):
                received, received_splits = hvd.synchronize(flight.handle)
                flight.handle = None
                with kernel_stream(flight.device):
                    self._advance(flight, received, received_splits)
                if flight.stage == _DONE:
                    self._flights.remove(flight)
                progressed = True
        return progressed

    def _start(self, flight, sent, splits):
        flight.handle = hvd.alltoall_async(sent, splits=torch.tensor(splits, dtype=torch.int32),
                                           name=PAYLOAD_PREFIX + flight.names[flight.stage])
        self.stats.add(collectives_started=1)

    def _advance(self, flight, received, received_splits):
        group = flight.group
        if flight.stage == _IN_NODE:
            sums, flight.error = group.sum_in_node(received, received_splits.tolist())
            for member, node_sum in zip(flight.members, sums or ()):
                member.node_sum = node_sum
            self._start_cross(flight)
        elif flight.stage == _CROSS and group.kind == "two_stage":
            self._start_cross_sums(flight, received)
        elif flight.stage in (_CROSS, _CROSS_SUMS):
            self._start_gather(flight, received)
        else:
            self._finish(flight, received, received_splits)

    def _start_cross(self, flight):
        """Step 2: the node's sum of each member's shard, encoded, to this local index's rank on every node."""
        group, members, device = flight.group, flight.members, flight.device
        outs = [torch.zeros(0, dtype=torch.uint8, device=device)]
        if flight.error is not None:  # every peer gets a refusal notice, forwards it in step 3: its node raises
            pieces, counts = group.refuse_between_nodes()
        else:
            outs = [torch.zeros(m.plan.cross.capacity(), dtype=torch.uint8, device=device) for m in members]
            if group.kind == "two_stage":
                for member in members:
                    member.own = torch.empty(member.plan.cross.own_numel(), dtype=torch.float32, device=device)
            pieces, counts = group.encode_between_nodes(
                [as_array(m.node_sum) for m in members], [as_array(o) for o in outs], [as_array(m.own) for m in members],
                [m.step for m in members], [as_array(m.shard_residual) for m in members])
        for member in members:
            member.node_sum = None
        flight.stage = _CROSS
        self._start(flight, concatenate_pieces(pieces, outs), group.cross_splits(counts))

    def _start_cross_sums(self, flight, received):
        """Step 2's second stage: the owner's sum of the slices it received, re-encoded, to every node."""
        group, members = flight.group, flight.members
        outs = [torch.zeros(0, dtype=torch.uint8, device=flight.device)]
        if flight.error is not None:  # its peers raise on the notice, as on the first stage's
            pieces, counts = group.refuse_between_nodes(second_stage=True)
        else:
            outs = [torch.zeros(m.plan.cross.owned_capacity(), dtype=torch.uint8, device=flight.device)
                    for m in members]
            pieces, counts, flight.error = group.sum_between_nodes(
                as_array(received), [as_array(m.own) for m in members], [as_array(o) for o in outs],
                [m.step for m in members], [as_array(m.owner_residual) for m in members])
        for member in members:
            member.own = None
        flight.stage = _CROSS_SUMS
        self._start(flight, concatenate_pieces(pieces, outs), group.cross_splits(counts))

    def _start_gather(self, flight, received):
        """Step 3: the group's failure flag and the bytes step 2 received (not where it failed) to every rank of
        the node."""
        pieces, splits = flight.group.forward_in_node(flight.error is not None, received.numel())
        flight.stage = _GATHER
        self._start(flight, concatenate_pieces(pieces, [received]), splits)

    @staticmethod
    def _finish(flight, received, received_splits):
        """Step 4: every shard of every member decoded from what the node's ranks forwarded."""
        group = flight.group
        flight.stage = _DONE
        if flight.error is not None:  # this rank's own error goes first: its node-mates raise on its flag
            return
        sums = [torch.zeros(group.layout.local_size * member.plan.shard, dtype=torch.float32, device=flight.device)
                for member in flight.members]
        flight.error = group.decode_node(as_array(received), received_splits.tolist(), [as_array(s) for s in sums])
        if flight.error is None:
            for member, total in zip(flight.members, sums):
                member.result = total[:member.plan.numel]
