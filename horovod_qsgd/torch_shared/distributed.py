"""The engine's collectives over ``torch.distributed``: the transport of the DDP hooks and the FSDP2 reduce-scatter.

Imports no Horovod.
"""
import os
import socket

import torch
import torch.distributed as dist

from horovod_qsgd.common.collectives import ALLTOALL
from horovod_qsgd.common.node_aware import NodeLayout, node_blind_reason, warn_node_blind
from horovod_qsgd.torch_shared.arrays import TorchBuffers

# torch 2.13 calls it all_gather_single and deprecates the old name; torch 2.11 (seen on a GPU machine) has only
# the old name, and the adapters must not fail there
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def check_payload_settings(codec, min_numel, adapter):
    """ValueError, naming the fix, unless ``codec``'s payloads have a fixed size (torch.distributed's collectives
    take sizes known in advance) and ``min_numel`` >= 0; ``adapter``: what the error calls the caller."""
    if min_numel < 0:
        raise ValueError(f"horovod_qsgd: min_numel must be >= 0, got {min_numel}")
    if not codec.payload_nbytes_is_fixed:
        raise ValueError(f"horovod_qsgd: {adapter} needs payloads of a fixed size (torch.distributed's "
                         "collectives take sizes known in advance); encoding='elias' varies: use encoding='fixed'.")


class DistributedTransport(TorchBuffers):
    """The engine's collectives (:class:`~horovod_qsgd.common.collectives.Collective`) over ``torch.distributed``'s
    ``group``, where this rank is ``rank``; tensors on ``device``. Every size is known in advance (these adapters
    take fixed-size payloads only): an allgather of equal parts is one ``all_gather_single``, one of parts that
    differ (the owners' sums) an ``all_to_all_single`` of this rank's part to every rank."""

    def __init__(self, group, rank, device):
        super().__init__(device)
        self.group, self.rank = group, rank
        self.started = 0

    def start(self, collective, async_op=True):
        """(the work of ``collective``, what the conduct is sent once it is done: the tensor it receives into,
        for an alltoall with the bytes from each rank)."""
        arriving, send = collective.arriving, collective.send
        received = torch.empty(sum(arriving), dtype=torch.uint8, device=self.device)
        self.started += 1
        if collective.kind == ALLTOALL:
            return dist.all_to_all_single(received, send, arriving, collective.splits, group=self.group,
                                          async_op=async_op), (received, arriving)
        part = arriving[self.rank]
        if send.numel() < part:  # a refusal notice: zero-padded to the size every peer expects
            send = torch.cat([send, torch.zeros(part - send.numel(), dtype=torch.uint8, device=self.device)])
        if collective.equal_parts:
            return all_gather_single(received, send, group=self.group, async_op=async_op), received
        return dist.all_to_all_single(received, send.repeat(len(arriving)), arriving, [part] * len(arriving),
                                      group=self.group, async_op=async_op), received

    def run(self, collective):
        """``collective`` run to its end; what the conduct is sent."""
        return self.start(collective, async_op=False)[1]


def node_names(group):
    """Every rank's node in ``group`` (a collective): torchrun's ``GROUP_RANK``, else the host name."""
    names = [None] * group.size()
    dist.all_gather_object(names, os.environ.get("GROUP_RANK") or socket.gethostname(), group=group)
    return names


class DistributedNodes(NodeLayout):
    """The job's nodes for the node-aware exchanges (DDP hooks, FSDP2), a
    :class:`~horovod_qsgd.common.node_aware.NodeLayout` of any grouping, with this rank's node's process group
    (``local``) and the group of the ranks with this rank's local index on every node (``cross``)."""

    def __init__(self, members, rank):
        layout = NodeLayout.of_members(members, rank)
        super().__init__(layout.num_nodes, layout.local_size, layout.node, layout.local_rank, layout.members)
        # every rank creates every group, in the same order, as torch.distributed requires
        for ranks in members:
            group = dist.new_group(ranks)
            if rank in ranks:
                self.local = group
        for j in range(self.local_size):
            group = dist.new_group([ranks[j] for ranks in members])
            if j == self.local_rank:
                self.cross = group

    @classmethod
    def of_this_job(cls, group, process_group, quiet=False, refuse=None):
        """The layout from torchrun's ``GROUP_RANK`` (else the host name), alike on every rank; None (flat
        exchange, with a warning on every rank unless ``quiet``: ``"auto"`` asked for no layout in
        particular) where nodes differ in size or there is one node or one rank per node; there instead, where
        given, raises ``refuse(why_not)`` on every rank."""
        if process_group is not None:
            raise ValueError("horovod_qsgd: exchange='node_aware' needs the default process group "
                             "(process_group=None)")
        members = {}
        for rank, node in enumerate(node_names(group)):
            members.setdefault(node, []).append(rank)
        members = list(members.values())
        why_not = node_blind_reason(sorted({len(m) for m in members}), len(members))
        if why_not is not None:
            if refuse is not None:
                raise refuse(why_not)
            if not quiet:
                warn_node_blind(why_not)
            return None
        return cls(members, dist.get_rank())
