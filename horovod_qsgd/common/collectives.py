"""What an exchange asks its adapter for: collectives, named and sized, in order.

Each exchange of :mod:`horovod_qsgd.common.engine` (one tensor) and
:mod:`horovod_qsgd.common.fusion` (a fused group) is *conducted* by a
generator: it runs every step between two collectives, yields the next
:class:`Collective` and is sent what that collective received. The adapter
is a *transport*: it allocates (``zeros(n, dtype)``, ``empty(n, dtype)``,
dtype "uint8" or "float32"), gives the codec array of one of its tensors
(``array``), joins fused pieces (``concatenate``, where it fuses) and runs
the collectives, waiting at once (:func:`drive`), polling, or resuming the
conduct in a later call, without knowing which exchange it carries.
"""

import numpy as np

ALLGATHER, ALLTOALL = "allgather", "alltoall"


class RefusedEarlier(Exception):
    """Thrown into a conduct that waits for its first collective: an exchange this rank conducted before it
    refused (``error``), so this one sends a refusal notice in place of its next step without waiting, since
    ranks that grouped their tensors otherwise may never start the collective it waits for."""

    def __init__(self, error):
        super().__init__(str(error))
        self.error = error


class Collective:
    """One collective an exchange asks its adapter for.

    ``kind``: :data:`ALLGATHER` (every rank's ``send`` to every rank, in rank
    order; what arrived is sent back to the conduct) or :data:`ALLTOALL`
    (``splits[j]`` elements of ``send`` to rank j, in order; sent back as
    (what arrived, the elements from each rank)); ``name``: what Horovod
    matches it by; ``send``: the adapter's tensor (uint8, or float32 for the
    node-aware exchange's first step). ``arriving``: bytes from each rank where every rank knows
    them in advance (fixed-size payloads; else None), which collectives that
    need sizes beforehand (``torch.distributed``) take: an allgather's part
    shorter than ``arriving[rank]`` (a refusal notice) is sent zero-padded to
    it. ``equal_parts``: every rank's part of an allgather has one size by
    construction (not by chance). ``final``: what this collective receives is
    the exchange's result, for the plan's ``decode``. ``refusal``: None, or
    the error this rank found in what it received, whose notice ``send``
    carries; an adapter may raise it as soon as the collective has started
    (the conduct also returns it at its end).
    """
    __slots__ = ("kind", "name", "send", "splits", "arriving", "equal_parts", "final", "refusal")

    def __init__(self, kind, name, send, splits=None, arriving=None, equal_parts=False, final=False, refusal=None):
        self.kind, self.name, self.send, self.splits = kind, name, send, splits
        self.arriving, self.equal_parts, self.final, self.refusal = arriving, equal_parts, final, refusal

    def __repr__(self):
        return (f"Collective({self.kind}, {self.name!r}, {len(self.send)} bytes, splits={self.splits}, "
                f"arriving={self.arriving}, final={self.final})")


def drive(conduct, run):
    """Runs an exchange's ``conduct`` (a plan's generator) to its end, each collective by ``run(collective)``,
    which returns what it received; returns what ``conduct`` returns."""
    received = None
    while True:
        try:
            collective = conduct.send(received)
        except StopIteration as done:
            return done.value
        received = run(collective)


def conclude(conduct, received):
    """Sends ``conduct`` what its final collective received; returns what it returns."""
    try:
        conduct.send(received)
    except StopIteration as done:
        return done.value
    raise RuntimeError("horovod_qsgd: an exchange asked for a collective after its final one")


def join_host_pieces(pieces, buffers):
    """One host uint8 array of a fused buffer's pieces: bytes (manifests) and (member, start, end) ranges of
    the numpy ``buffers`` (``FusedTwoStage.first_stage_pieces``, ``FusedTwoStage.second_stage_pieces``)."""
    return np.concatenate([np.frombuffer(piece, np.uint8) if isinstance(piece, bytes)
                           else buffers[piece[0]][piece[1]:piece[2]] for piece in pieces])


class HostBuffers:
    """What a conduct allocates and reads through, on the host: numpy arrays, their own codec arrays (the
    TensorFlow adapter's host ops, and the loopback ranks of the tests)."""
    zeros = staticmethod(lambda n, dtype: np.zeros(n, dtype))
    empty = staticmethod(lambda n, dtype: np.empty(n, dtype))
    array = staticmethod(lambda array: array)
    concatenate = staticmethod(join_host_pieces)
