"""The engine's collectives over ``torch.distributed``: the transport of the DDP hooks and the FSDP2 reduce-scatter.

Imports no Horovod.
"""
import torch
import torch.distributed as dist

from horovod_qsgd.common.collectives import ALLTOALL
from horovod_qsgd.torch_arrays import TorchBuffers

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
