"""The two-stage exchange's result, computed from every rank's gradient with the codecs alone.

Each rank can regenerate every rank's input (:func:`gradient`), so every
rank computes what all ranks must receive: each sender's slice encoded with
its key and decoded, the owner's sum formed with its own slice unquantized,
that sum encoded with the second-stage codec and decoded into place.
"""
import numpy as np

from tests.reduce_scatter_reference import owner_sum


def gradient(rank, numel, step=0):
    return np.random.default_rng(100 * rank + step).standard_normal(numel).astype(np.float32)


def bounds(numel, num_ranks, bucket):
    """Owned chunks written out again from the rule in the docstring: bucket-aligned, as equal as possible."""
    buckets = -(-numel // bucket)
    cuts = [min(numel, (r * buckets // num_ranks) * bucket) for r in range(num_ranks + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def first_stage_inboxes(stages, grads, step=0):
    """What each owner receives from the first stage: the other ranks' encoded slices, in rank order."""
    inbox = [[] for _ in stages]
    for r, stage in enumerate(stages):
        out = np.zeros(stage.send_capacity(), np.uint8)
        splits = stage.encode_for_owners(grads[r], out, step=step)
        assert splits[r] == 0 and sum(splits) <= out.size
        offsets = np.cumsum([0] + splits)
        for owner in range(len(stages)):
            inbox[owner].append(out[offsets[owner]:offsets[owner + 1]])
    return [np.concatenate(parts) for parts in inbox]


def reference(first, second, name, grads, step, unit, residuals=None, owner_residuals=None):
    """The summed result every rank must get (Sum; Average multiplies it by 1/N), from the codecs alone.

    With error feedback (top-k), ``residuals[r]`` (full length) and
    ``owner_residuals[r]`` (rank r's chunk) are every rank's state before the
    step and are updated in place, as the ranks update theirs.
    """
    import zlib
    num_ranks, numel = len(grads), grads[0].size
    result = np.zeros(numel, np.float32)
    for owner, (begin, end) in enumerate(bounds(numel, num_ranks, unit)):
        total = owner_sum(first, name, grads, owner, begin, end, step, residuals)
        buf = np.zeros(second.max_payload_nbytes(end - begin), np.uint8)
        used = second.encode(total, buf, step=step, key=zlib.crc32(f"{name}@owner{owner}".encode()),
                             residual=None if owner_residuals is None else owner_residuals[owner])
        second.decode_accumulate(buf[:used], result[begin:end])
    return result


def allgather_reference(codec, name, xs, step, residuals=None):
    """The allgather exchange's sum (unscaled): every rank's payload, encoded with its key, decoded in rank order;
    ``residuals[r]``: rank r's error-feedback residual, updated in place."""
    import zlib
    total = np.zeros(xs[0].size, np.float32)
    for rank, x in enumerate(xs):
        buf = np.zeros(codec.max_payload_nbytes(x.size), np.uint8)
        used = codec.encode(x, buf, step=step, key=zlib.crc32(f"{name}@rank{rank}".encode()),
                            residual=None if residuals is None else residuals[rank])
        codec.decode_accumulate(buf[:used], total)
    return total


def node_aware_reference(first, second, name, grads, step, unit, per_node, residuals=None, owner_residuals=None):
    """The summed result of the node-aware exchange (``horovod_qsgd.common.node_aware``), from the codecs alone.

    Ranks r = node * per_node + j. Each gradient (plus, with error feedback,
    its whole residual ``residuals[r]``, then zeroed) is padded to
    ``per_node`` shards; node k's sum of shard j, in local-rank order, is
    exchanged among the nodes as tensor ``<name>.shard<j>``: every node's
    payload allgathered (2 nodes, or shards below the two stages' threshold)
    or the two stages, with a zero shard residual whose update lands at shard
    j of ``residuals[r]``, and ``owner_residuals[r]`` (rank r's chunk of its
    shard) kept by the owners.
    """
    import zlib

    from horovod_qsgd.common.two_stage import choose_exchange
    num_ranks, numel = len(grads), grads[0].size
    nodes = num_ranks // per_node
    shard = -(-numel // (per_node * unit)) * unit
    xs = []
    for r in range(num_ranks):
        x = np.zeros(per_node * shard, np.float32)
        x[:numel] = grads[r] if residuals is None else grads[r] + residuals[r]
        if residuals is not None:
            residuals[r][:] = 0
        xs.append(x)
    result = np.zeros(per_node * shard, np.float32)
    two_stage = choose_exchange("auto", first, second, shard, nodes) == "two_stage"
    for j in range(per_node):
        part = slice(j * shard, (j + 1) * shard)
        holders = [k * per_node + j for k in range(nodes)]
        sums = []
        for k in range(nodes):
            total = xs[k * per_node][part].copy()
            for i in range(1, per_node):
                total += xs[k * per_node + i][part]
            sums.append(total)
        shard_residuals = None if residuals is None else [np.zeros(shard, np.float32) for _ in holders]
        shard_name = f"{name}.shard{j}"
        if two_stage:
            owners = None if owner_residuals is None else [owner_residuals[r] for r in holders]
            total = reference(first, second, shard_name, sums, step, unit, shard_residuals, owners)
        else:
            total = np.zeros(shard, np.float32)
            for k, x in enumerate(sums):
                out = np.zeros(first.max_payload_nbytes(shard), np.uint8)
                used = first.encode(x, out, step=step, key=zlib.crc32(f"{shard_name}@rank{k}".encode()),
                                    residual=None if residuals is None else shard_residuals[k])
                first.decode_accumulate(out[:used], total)
        result[part] = total
        if residuals is not None:
            for k, r in enumerate(holders):
                begin, end = min(numel, j * shard), min(numel, (j + 1) * shard)
                residuals[r][begin:end] = shard_residuals[k][:end - begin]
    return result[:numel]


def averaged_training(kind, sizes, num_ranks, steps):
    """What every rank must get at each step of a training whose tensor i ("layer{i}.weight", ``sizes[i]``
    elements) has gradient ``gradient(rank, sizes[i], 10 * step + i)``, averaged: QSGD 4-bit or Top-k 2% with
    its residuals, two stages."""
    from horovod_qsgd.codecs import QSGDCodec, TopKCodec
    codec, unit = (QSGDCodec(bits=4), 512) if kind == "qsgd" else (TopKCodec(ratio=0.02), 1)
    wanted = [[] for _ in range(steps)]
    for i, numel in enumerate(sizes):
        residuals = [np.zeros(numel, np.float32) for _ in range(num_ranks)] if kind == "topk" else None
        owner_residuals = None if kind == "qsgd" else [np.zeros(e - b, np.float32) for b, e in
                                                         bounds(numel, num_ranks, unit)]
        for step in range(steps):
            grads = [gradient(r, numel, 10 * step + i) for r in range(num_ranks)]
            total = reference(codec, codec, f"layer{i}.weight", grads, step, unit, residuals, owner_residuals)
            wanted[step].append(total * np.float32(1.0 / num_ranks))
    return wanted


def allgathered_training(kind, sizes, num_ranks, steps):
    """:func:`averaged_training` through the allgather: every rank's whole gradient (plus its residual, top-k)
    encoded with its key, and every rank's payload decoded into the sum, in rank order."""
    import zlib
    from horovod_qsgd.codecs import QSGDCodec, TopKCodec
    codec = QSGDCodec(bits=4) if kind == "qsgd" else TopKCodec(ratio=0.02)
    wanted = [[] for _ in range(steps)]
    for i, numel in enumerate(sizes):
        name = f"layer{i}.weight"
        residuals = [np.zeros(numel, np.float32) for _ in range(num_ranks)] if kind == "topk" else None
        for step in range(steps):
            total = np.zeros(numel, np.float32)
            for rank in range(num_ranks):
                buf = np.zeros(codec.max_payload_nbytes(numel), np.uint8)
                used = codec.encode(gradient(rank, numel, 10 * step + i), buf, step=step,
                                    key=zlib.crc32(f"{name}@rank{rank}".encode()),
                                    residual=None if residuals is None else residuals[rank])
                codec.decode_accumulate(buf[:used], total)
            wanted[step].append(total * np.float32(1.0 / num_ranks))
    return wanted
