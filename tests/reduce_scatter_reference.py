"""The compressed reduce-scatter's result, computed from every rank's staged input with the codecs alone.

Written out again from :mod:`horovod_qsgd.common.reduce_scatter`'s docstring: owner j's sum is its own row j
(plus its residual there, which is then zero) and every other sender's row j, encoded with the key of that
sender and owner and decoded, added in rank order.
"""
import zlib

import numpy as np


def staged(pieces, unit):
    """(offsets of the pieces in a staged row, the staged row's length): each piece at a multiple of ``unit``,
    the row a multiple of ``unit`` long."""
    offsets, at = [], 0
    for numel in pieces:
        at += -at % unit
        offsets.append(at)
        at += numel
    return offsets, at + -at % unit


def stage(rows, pieces, unit):
    """Rows (N x sum(pieces)) staged as the plan's input: one flat float32 array of N staged rows."""
    offsets, length = staged(pieces, unit)
    out = np.zeros((rows.shape[0], length), np.float32)
    at = 0
    for numel, offset in zip(pieces, offsets):
        out[:, offset:offset + numel] = rows[:, at:at + numel]
        at += numel
    return out.reshape(-1)


def unstage(row, pieces, unit):
    offsets, _ = staged(pieces, unit)
    return np.concatenate([row[offset:offset + numel] for numel, offset in zip(pieces, offsets)])


def reduce_scatter_reference(codec, name, xs, step, residuals=None):
    """Every owner's staged sum (unscaled); ``xs[r]``: rank r's staged input (N rows); ``residuals[r]``: rank
    r's error-feedback residual of the same length, updated in place as the ranks update theirs."""
    num_ranks = len(xs)
    row = xs[0].size // num_ranks
    return [owner_sum(codec, name, xs, owner, owner * row, (owner + 1) * row, step, residuals)
            for owner in range(num_ranks)]


def owner_sum(codec, name, xs, owner, begin, end, step, residuals=None):
    """What ``owner`` sums of coordinates [begin, end): its own gradient there (plus its residual, then zero)
    and every other rank's, encoded with the key of that sender and owner and decoded, in rank order (also the
    first of the two stages, :mod:`tests.two_stage_reference`)."""
    total = xs[owner][begin:end].copy()
    if residuals is not None:
        total += residuals[owner][begin:end]
        residuals[owner][begin:end] = 0
    for sender in range(len(xs)):
        if sender == owner:
            continue
        buf = np.zeros(codec.max_payload_nbytes(end - begin), np.uint8)
        used = codec.encode(xs[sender][begin:end], buf, step=step,
                            key=zlib.crc32(f"{name}@rank{sender}>owner{owner}".encode()),
                            residual=None if residuals is None else residuals[sender][begin:end])
        codec.decode_accumulate(buf[:used], total)
    return total


def fsdp_rows(grads, num_ranks):
    """FSDP2's reduce-scatter input for a module: row j holds every parameter's j-th dim-0 shard, padded."""
    pieces = [-(-g.size // num_ranks) for g in grads]
    rows = np.zeros((num_ranks, sum(pieces)), np.float32)
    at = 0
    for g, piece in zip(grads, pieces):
        padded = np.zeros(piece * num_ranks, np.float32)
        padded[:g.size] = g
        rows[:, at:at + piece] = padded.reshape(num_ranks, piece)
        at += piece
    return rows, pieces


def fsdp_shards(row, pieces, sizes, rank):
    """A module's row of the sum split into each parameter's shard on ``rank`` (the padding dropped)."""
    shards, at = [], 0
    for piece, n in zip(pieces, sizes):
        valid = max(0, min(piece, n - rank * piece))
        shards.append(row[at:at + valid])
        at += piece
    return shards


def weights_module(sizes):
    """A module of zero parameters of ``sizes`` whose loss given gradients g_i is sum_i <w_i, g_i>: the gradient
    of w_i is exactly g_i (rounded to the parameter dtype); a None gradient leaves its parameter out."""
    import torch

    class Weights(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n)) for n in sizes])

        def forward(self, grads):
            return sum((w * g.to(w.dtype)).sum() for w, g in zip(self.w, grads) if g is not None)
    return Weights()


def three_unit_model(modules):
    """Units ``a``, ``small`` and ``b`` (:func:`weights_module`) of the sizes ``modules`` gives "fsdp.a",
    "fsdp.small" and "fsdp.root"; its forward takes {module name: gradients}."""
    import torch

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.small, self.b = (weights_module(modules[n]) for n in ("fsdp.a", "fsdp.small", "fsdp.root"))

        def forward(self, grads):
            return self.a(grads["fsdp.a"]) + self.small(grads["fsdp.small"]) + self.b(grads["fsdp.root"])
    return Model()
