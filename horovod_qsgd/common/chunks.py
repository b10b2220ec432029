"""Which coordinates each rank owns in the two-stage and node-aware exchanges, and where an owner-side
residual saved under one layout lies in a tensor: the arithmetic both exchanges share."""

__all__ = ["chunk_unit", "chunk_bounds", "shard_numel", "node_owner_chunk", "saved_owner_chunk"]


def chunk_unit(codec):
    """What chunk boundaries are multiples of: a QSGD bucket, one element for top-k."""
    return getattr(codec, "bucket_size", 1)


def chunk_bounds(numel, num_ranks, unit):
    """[(begin, end)] of the coordinates each rank owns, in rank order.

    Chunks are whole multiples of ``unit`` (a QSGD bucket) except the last
    non-empty one, as equal as possible; with fewer units than ranks, the
    last ranks own empty chunks.
    """
    units = -(-numel // unit)
    return [(min(numel, (r * units // num_ranks) * unit), min(numel, ((r + 1) * units // num_ranks) * unit))
            for r in range(num_ranks)]


def shard_numel(numel, local_size, unit):
    """Elements of each of the L shards of a tensor of ``numel`` elements (a multiple of ``unit``)."""
    return -(-numel // (local_size * unit)) * unit


def node_owner_chunk(numel, unit, saved_layout, saved_numel):
    """(begin, end) in the tensor of the owner residual saved with a node layout [M, L, node, local rank], or
    None where it cannot be this tensor's; clipped to the tensor: add the residual's first end - begin values."""
    num_nodes, local_size, node, local_rank = (int(v) for v in saved_layout)
    if not (0 <= node < num_nodes and 0 <= local_rank < local_size):
        return None
    shard = shard_numel(numel, local_size, unit)
    begin, end = chunk_bounds(shard, num_nodes, unit)[node]
    if end - begin != saved_numel:
        return None
    base = local_rank * shard  # the chunk's tail may lie in the shard's padding, whose residual stays zero
    return min(numel, base + begin), min(numel, base + end)


def saved_owner_chunk(numel, unit, saved_layout, saved_numel):
    """(begin, end) of the chunk an owner-side residual of ``saved_numel`` elements saved as rank
    ``saved_layout[1]`` of ``saved_layout[0]`` belongs to, or None if it cannot be this tensor's.

    When the ranks change (an elastic reset, a checkpoint from another job
    size), the adapters add the residual there into the rank's sender
    residual: the rank sends it in its next steps, so no mass is lost.
    A node layout (four values, :func:`node_owner_chunk`) gives a chunk
    clipped to the tensor: add the residual's first end - begin values.
    """
    if saved_layout and len(saved_layout) == 4:
        return node_owner_chunk(numel, unit, saved_layout, saved_numel)
    if not saved_layout or len(saved_layout) != 2:
        return None
    num_ranks, rank = (int(v) for v in saved_layout)
    if not 0 <= rank < num_ranks:
        return None
    begin, end = chunk_bounds(numel, num_ranks, unit)[rank]
    return (begin, end) if end - begin == saved_numel else None
