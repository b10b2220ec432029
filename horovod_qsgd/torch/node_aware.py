"""The node-aware exchange over Horovod's torch collectives (the steps: :mod:`horovod_qsgd.common.node_aware`).

Every step is a global ``hvd.alltoall_async`` whose splits are zero outside
the step's peers (the ranks of this node, or this local index's rank on every
node): no process set has to be declared in ``hvd.init()`` and no environment
variable set. A flight is one tensor's exchange, or a fused group's
(:class:`~horovod_qsgd.common.node_aware.NodeAwareGroup`: one collective per
step for all its members), conducted by the group
(:meth:`~horovod_qsgd.common.node_aware.NodeAwareGroup.conduct`). Its three
collectives (four with two stages between
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

from horovod_qsgd.common.node_aware import STEPS, NodeAwareGroup
from horovod_qsgd.torch.transport import HorovodTransport
from horovod_qsgd.torch_shared.arrays import as_array, kernel_stream

_POLL_SECONDS = 50e-6


class NodeAwareMember:
    """One tensor's part of a flight, between its compress and its result.

    ``padded``: the tensor (plus residual), zero-padded to L shards, until
    step 1 is sent; ``shard_residual`` and ``owner_residual``: this step's
    error-feedback state of the node's sum of this rank's shard (updated in
    place); ``result``: the tensor's sum over all ranks once done;
    ``flight``: None until its group starts.
    """
    __slots__ = ("plan", "step", "padded", "shard_residual", "owner_residual", "flight", "result")

    def __init__(self, plan, step, padded, shard_residual, owner_residual):
        self.plan, self.step, self.padded = plan, step, padded
        self.shard_residual, self.owner_residual = shard_residual, owner_residual
        self.flight = self.result = None


class NodeAwareFlight:
    """One group's exchange (a single tensor's, unfused): the members, the engine's conduct of its steps and
    the handle of the step in flight; ``error``: what every member's rank raises instead, once its part of
    every step is sent."""
    __slots__ = ("members", "device", "transport", "conduct", "handle", "done", "error")

    def __init__(self, members):
        self.members, self.device = members, members[0].padded.device
        self.transport = HorovodTransport(hvd.global_process_set, self.device)
        self.conduct = self.handle = self.error = None
        self.done = False
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
        flight = NodeAwareFlight(members)
        layout = group.layout
        tag = torch.tensor(group.tag, dtype=torch.float32, device=flight.device)
        rows = [tag.expand(layout.local_size, group.tag_width)]
        rows += [member.padded.view(layout.local_size, member.plan.shard) for member in members]
        sent = torch.cat(rows, dim=1).reshape(-1)
        for member in members:
            member.padded = None
        owner_residuals = [as_array(m.owner_residual) for m in members]
        flight.conduct = group.conduct(flight.transport, names, sent, [m.step for m in members],
                                       [as_array(m.shard_residual) for m in members], lambda: owner_residuals)
        self._start(flight, next(flight.conduct))
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
        while not flight.done:
            with self._lock:
                progressed = self._advance_finished()
            if not progressed and not flight.done:
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
                    self._advance(flight, received, received_splits.tolist())
                if flight.done:
                    self._flights.remove(flight)
                progressed = True
        return progressed

    def _start(self, flight, collective):
        flight.handle = flight.transport.start(collective)
        self.stats.add(collectives_started=1)

    def _advance(self, flight, received, received_splits):
        """The flight's conduct, sent what its last step received, runs to its next step and starts it, or to
        its end: every member's result, or the flight's error."""
        try:
            collective = flight.conduct.send((received, received_splits))
        except StopIteration as done:
            sums, flight.error = done.value
            flight.conduct, flight.transport, flight.done = None, None, True
            for member, total in zip(flight.members, sums or ()):
                member.result = total[:member.plan.numel]
            return
        self._start(flight, collective)
