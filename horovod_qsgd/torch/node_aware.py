"""The node-aware exchange over Horovod's torch collectives (the steps: :mod:`horovod_qsgd.common.node_aware`).

Every step is a global ``hvd.alltoall_async`` whose splits are zero outside
the step's peers (the ranks of this node, or this local index's rank on every
node): no process set has to be declared in ``hvd.init()`` and no environment
variable set. A tensor's four collectives (five with two stages between
nodes) each need the one before, and ranks decompress in different orders: a
rank that waited for one tensor's step would hold back the steps its peers
wait for. So nothing here waits for a single step: :meth:`NodeAwareExchanges.wait`
polls every exchange in flight and starts each one's next collective as soon
as its input has arrived, and every compress does the same without waiting,
which overlaps the exchange with the backward pass.
"""
import threading
import time

import horovod.torch as hvd
import torch

from horovod_qsgd.common.exchange import refusal_notice
from horovod_qsgd.common.naming import PAYLOAD_PREFIX
from horovod_qsgd.torch_arrays import as_array, kernel_stream

_IN_NODE, _CROSS, _CROSS_SUMS, _GATHER, _DONE = range(5)
_POLL_SECONDS = 50e-6


def _array(tensor):
    return None if tensor is None else as_array(tensor)


def _notice(device):
    return torch.frombuffer(bytearray(refusal_notice()), dtype=torch.uint8).to(device)


class NodeAwareFlight:
    """One tensor's exchange between its compress and its result.

    ``shard_residual`` and ``owner_residual``: this step's error-feedback
    state of the node's sum of this rank's shard (updated in place);
    ``result``: the tensor's sum over all ranks once done; ``error``: what
    this rank raises instead, once its part of every step is sent.
    """
    __slots__ = ("plan", "step", "device", "shard_residual", "owner_residual", "handle", "stage", "node_sum", "own",
                 "error", "result")

    def __init__(self, plan, step, device, shard_residual, owner_residual):
        self.plan, self.step, self.device = plan, step, device
        self.shard_residual, self.owner_residual = shard_residual, owner_residual
        self.handle, self.stage, self.node_sum, self.own, self.error, self.result = None, _IN_NODE, None, None, None, None


class NodeAwareExchanges:
    """The node-aware exchanges of one compressor in flight on this rank."""

    def __init__(self, stats):
        self.stats = stats
        self._flights = []
        self._lock = threading.Lock()  # one thread advances the exchanges at a time (hooks run on several)

    def start(self, plan, padded, step, shard_residual=None, owner_residual=None):
        """Starts step 1 for ``padded`` (float32, :meth:`NodeAwarePlan.padded_numel`); returns the flight."""
        flight = NodeAwareFlight(plan, step, padded.device, shard_residual, owner_residual)
        self._start(flight, padded, plan.in_node_splits())
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

    def wait(self, flight):
        """Advances every exchange until ``flight`` is done; returns its result (flat float32) or raises its error."""
        while flight.stage != _DONE:
            with self._lock:
                progressed = self._advance_finished()
            if not progressed and flight.stage != _DONE:
                time.sleep(_POLL_SECONDS)
        if flight.error is not None:
            raise flight.error
        return flight.result

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
                                           name=PAYLOAD_PREFIX + flight.plan.collective_names[flight.stage])
        self.stats.add(collectives_started=1)

    def _advance(self, flight, received, received_splits):
        plan = flight.plan
        if flight.stage == _IN_NODE:
            flight.error = plan.check_in_node(received_splits.tolist())
            if flight.error is None:
                rows = received.view(plan.layout.local_size, plan.shard)
                flight.node_sum = rows[0].clone()
                for row in rows[1:]:  # in local-rank order: the same bits on every node
                    flight.node_sum += row
            self._start_cross(flight)
        elif flight.stage == _CROSS and plan.cross.kind == "two_stage":
            self._start_cross_sums(flight, received)
        elif flight.stage in (_CROSS, _CROSS_SUMS):
            if flight.error is None:
                flight.node_sum.zero_()
                try:  # raises on another node's refusal notice, or a payload that does not match
                    plan.cross.decode(as_array(received), as_array(flight.node_sum))
                except Exception as exc:  # raised once this rank's last step is sent: nobody waits for it
                    flight.error = plan.between_nodes(exc)
            self._start_gather(flight)
        else:
            self._finish(flight, received, received_splits)

    def _start_cross(self, flight):
        """Step 2: the node's sum of this rank's shard, encoded, to this local index's rank on every node."""
        plan, cross = flight.plan, flight.plan.cross
        nodes = plan.layout.num_nodes
        out = torch.zeros(cross.capacity(), dtype=torch.uint8, device=flight.device)
        if cross.kind == "two_stage":
            if flight.error is None:
                flight.own = torch.empty(cross.own_numel(), dtype=torch.float32, device=flight.device)
                counts = cross.encode(as_array(flight.node_sum), as_array(out), as_array(flight.own), flight.step,
                                      _array(flight.shard_residual))
                sent = out[:sum(counts)]
            else:  # every owner refuses this rank's slice, and tells every rank in the next step
                notice = _notice(flight.device)
                counts = [0 if k == plan.layout.node else notice.numel() for k in range(nodes)]
                sent = notice.repeat(nodes - 1)
        else:
            if flight.error is None:
                used = cross.encode(as_array(flight.node_sum), as_array(out), flight.step,
                                    _array(flight.shard_residual))
                payload = out[:used]
            else:
                payload = _notice(flight.device)
            counts, sent = [payload.numel()] * nodes, payload.repeat(nodes)
        flight.stage = _CROSS
        self._start(flight, sent, plan.cross_splits(counts))

    def _start_cross_sums(self, flight, received):
        """Step 2's second stage: the owner's sum of the slices it received, re-encoded, to every node."""
        plan, cross = flight.plan, flight.plan.cross
        if flight.error is None:
            owned = torch.zeros(cross.owned_capacity(), dtype=torch.uint8, device=flight.device)
            used, error = cross.sum_and_encode(as_array(received), as_array(flight.own), as_array(owned),
                                                      flight.step, _array(flight.owner_residual))
            payload = owned[:used]  # a refusal notice where a slice did not match: every peer raises on it
            flight.error = None if error is None else plan.between_nodes(error)
        else:
            payload = _notice(flight.device)
        nodes = plan.layout.num_nodes
        flight.stage = _CROSS_SUMS
        self._start(flight, payload.repeat(nodes), plan.cross_splits([payload.numel()] * nodes))

    def _start_gather(self, flight):
        """Step 4: the decoded shard and its failure flag to every rank of the node."""
        plan = flight.plan
        shard = flight.node_sum if flight.error is None else torch.zeros(plan.shard, device=flight.device)
        flag = torch.full((1,), 0.0 if flight.error is None else 1.0, device=flight.device)
        flight.node_sum, flight.own = None, None
        flight.stage = _GATHER
        self._start(flight, torch.cat([shard, flag]).repeat(plan.layout.local_size), plan.gather_splits())

    def _finish(self, flight, received, received_splits):
        plan = flight.plan
        mismatch = plan.check_in_node(received_splits.tolist(), gathered=True)
        if mismatch is not None:
            flight.error, flight.stage = flight.error or mismatch, _DONE
            return
        rows = received.view(plan.layout.local_size, plan.shard + 1)
        failed = plan.failed_ranks(rows[:, plan.shard].tolist())
        if flight.error is None and failed:
            flight.error = RuntimeError(
                f"horovod_qsgd: tensor {plan.name!r} failed between nodes on rank(s) {failed} of this node (their "
                "error says why); its result is not used here either.")
        if flight.error is None:
            flight.result = rows[:, :plan.shard].reshape(-1)[:plan.numel]
        flight.stage = _DONE
