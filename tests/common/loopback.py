"""N ranks' conducts run in one process: a transport over numpy arrays and the collectives written out.

An allgather concatenates every rank's part in rank order; an alltoall hands rank j each sender's
``splits[j]`` elements, in sender order, with how many came from each. The same contract the adapters'
transports implement over Horovod and torch.distributed (see :mod:`horovod_qsgd.common.collectives`).
"""
import numpy as np

from horovod_qsgd.common.collectives import ALLGATHER, ALLTOALL


def deliver(collectives, sized=True):
    """What each rank receives from one collective that every rank asked for (their ``collectives``).

    ``sized``: as torch.distributed, every part is the size its receiver announced (a shorter allgather part,
    a refusal notice, zero-padded to it); else as Horovod, any size.
    """
    first = collectives[0]
    assert all((c.kind, c.name, c.final, c.equal_parts) == (first.kind, first.name, first.final, first.equal_parts)
               for c in collectives), "the ranks asked for different collectives"
    if first.kind == ALLGATHER:
        parts = [np.asarray(c.send) for c in collectives]
        for sender, c in enumerate(collectives):
            if sized and c.arriving is not None and parts[sender].size < c.arriving[sender]:
                parts[sender] = np.concatenate([parts[sender], np.zeros(c.arriving[sender] - parts[sender].size,
                                                                        np.uint8)])
        for c in collectives:  # what each rank said it would receive is what arrives
            assert not sized or c.arriving is None or c.arriving == [p.size for p in parts]
        return [np.concatenate(parts)] * len(collectives)
    assert first.kind == ALLTOALL
    starts = [np.cumsum([0] + list(c.splits)) for c in collectives]
    received = []
    for owner, c in enumerate(collectives):
        parts = [np.asarray(s.send)[start[owner]:start[owner + 1]] for s, start in zip(collectives, starts)]
        assert not sized or c.arriving is None or c.arriving == [p.size for p in parts]
        received.append((np.concatenate(parts), [p.size for p in parts]))
    return received


def conduct_all(conducts, sized=True):
    """Runs every rank's conduct in lockstep: ([(kind, name, final)] of the collectives, every rank's return)."""
    asked, received = [], [None] * len(conducts)
    while True:
        collectives, returned = [], []
        for rank, conduct in enumerate(conducts):
            try:
                collectives.append(conduct.send(received[rank]))
            except StopIteration as done:
                returned.append(done.value)
        if returned:
            assert len(returned) == len(conducts), "some ranks' exchanges ended before others'"
            return asked, returned
        asked.append((collectives[0].kind, collectives[0].name, collectives[0].final))
        received = deliver(collectives, sized)
