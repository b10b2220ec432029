"""The exact average of a list of float32 tensors over the ranks of this rank's node, by two alltoalls.

Hierarchical DiLoCo averages every step's gradients inside the node (the fast link) and only its outer
exchange crosses between nodes. Every rank of the node must then hold the *same* bits after each step, or the
node's models drift apart: a float32 allreduce sums in its own order, which Gloo does not promise to be the
same on every rank. So the sum is made here, in local-rank order, once per shard:

1. every rank pads the concatenated tensors to L shards and sends shard j to local rank j;
2. local rank j adds the L shards it received in local-rank order (the node's sum of shard j) and sends it
   to every rank of the node;
3. every rank concatenates the L sums and divides by L.

Each rank sends ``2 (L - 1) / L`` of the tensors' float32 bytes inside the node, as a ring allreduce does,
and nothing between nodes. The collectives are the adapter's (Horovod's global alltoall whose splits are zero
outside the node; torch.distributed's ``all_to_all_single`` in the node's group).
"""
import torch

from horovod_qsgd.common.errors import CompressionMismatchError


def average_in_node(tensors, local_size, alltoall):
    """``tensors`` (float32) averaged over the ``local_size`` ranks of this rank's node, the same bits on each.

    ``alltoall(send, shard, step)`` sends ``send``'s j-th ``shard`` elements to local rank j and returns what
    the node's ranks sent this rank, in local-rank order (``step``: "scatter", then "gather", for its name).
    """
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1) for t in tensors])
    numel = flat.numel()
    shard = -(-numel // local_size)
    padded = torch.zeros(local_size * shard, dtype=torch.float32, device=flat.device)
    padded[:numel] = flat
    received = alltoall(padded, shard, "scatter")
    node_sum = received[:shard].clone()
    for j in range(1, local_size):
        node_sum += received[j * shard:(j + 1) * shard]
    gathered = alltoall(node_sum.repeat(local_size), shard, "gather")
    averaged = gathered[:numel].div_(local_size)
    return [part.view_as(t) for part, t in zip(torch.split(averaged, [t.numel() for t in tensors]), tensors)]


def check_received(layout, received_splits, shard, label):
    """CompressionMismatchError unless every rank of ``layout``'s node sent ``shard`` elements (a global
    alltoall's ``received_splits``): each rank of the node sees every other's count, so every one refuses."""
    received_splits = [int(s) for s in received_splits]
    if received_splits != layout.in_node_splits(shard):
        differ = [r for r in layout.local_ranks() if received_splits[r] != shard]
        raise CompressionMismatchError(
            f"horovod_qsgd: {label}: rank(s) {differ} of this node averaged another number of elements "
            f"({[received_splits[r] * layout.local_size for r in differ]}, padded) than this rank "
            f"({layout.local_size * shard}): every rank of a node must step the same model")


class AveragesInNode:
    """What a hierarchical DiLoCo exchange of either adapter keeps for its in-node averages: the node layout
    (``nodes``, found at the first step) and the bytes this rank sent inside the node; the adapter gives the
    collective, ``_in_node_alltoall(send, shard, step)`` (see :func:`average_in_node`)."""

    def __init__(self):
        self.nodes = None
        self.bytes_sent_in_node = 0

    def average_in_node(self, tensors):
        """``tensors`` averaged over this rank's node, the same bits on each of its ranks, the bytes counted."""
        self.bytes_sent_in_node += bytes_sent(sum(t.numel() for t in tensors), self.nodes.local_size)
        return average_in_node(tensors, self.nodes.local_size, self._in_node_alltoall)

    def _in_node_alltoall(self, send, shard, step):
        raise NotImplementedError


def bytes_sent(numel, local_size):
    """Bytes one rank sends inside the node to average ``numel`` float32 values (both alltoalls)."""
    return 2 * 4 * (local_size - 1) * -(-numel // local_size)
