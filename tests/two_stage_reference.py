"""The two-stage exchange's result, computed from every rank's gradient with the codecs alone.

Each rank can regenerate every rank's input (:func:`gradient`), so every
rank computes what all ranks must receive: each sender's slice encoded with
its key and decoded, the owner's sum formed with its own slice unquantized,
that sum encoded with the second-stage codec and decoded into place.
"""
import numpy as np


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
        total = grads[owner][begin:end].copy()
        if residuals is not None:
            total += residuals[owner][begin:end]
            residuals[owner][begin:end] = 0
        for sender in range(num_ranks):
            if sender == owner:
                continue
            buf = np.zeros(first.max_payload_nbytes(end - begin), np.uint8)
            key = zlib.crc32(f"{name}@rank{sender}>owner{owner}".encode())
            used = first.encode(grads[sender][begin:end], buf, step=step, key=key,
                                residual=None if residuals is None else residuals[sender][begin:end])
            first.decode_accumulate(buf[:used], total)
        buf = np.zeros(second.max_payload_nbytes(end - begin), np.uint8)
        used = second.encode(total, buf, step=step, key=zlib.crc32(f"{name}@owner{owner}".encode()),
                             residual=None if owner_residuals is None else owner_residuals[owner])
        second.decode_accumulate(buf[:used], result[begin:end])
    return result
