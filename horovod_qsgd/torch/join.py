r"""Uneven inputs with compressed gradients: a rank that runs out of data shadows the others' steps.

Horovod's ``hvd.join()`` lets a rank that has finished answer the others'
allreduces with zeros, but it cannot answer an allgather or an alltoall:
with payload compression the joined rank's background loop dies
(``unordered_map::at``) and the job with it; once a payload has been
compressed, ``hvd.join()`` is therefore replaced by a refusal on every rank
(see the end of this module). :class:`Join` does what
PyTorch's ``torch.distributed.algorithms.Join`` does for DDP, with the
optimizer's own collectives::

    with Join(optimizer):
        for batch in loader:          # a different number of batches on each rank
            optimizer.zero_grad()
            loss_fn(model(batch)).backward()
            optimizer.step()

1. Inside the block every ``optimizer.synchronize()`` (called by ``step()``,
   or by hand before a ``GradScaler``) also sums a flag of 1 over the ranks,
   submitted before the gradients are waited for: the number of ranks
   still training.
2. A rank that leaves the block shadows steps: it sums a flag of 0,
   synchronizes zero gradients through the same compressed exchanges and,
   while any rank still trains, applies the averaged gradient like the
   others, so every rank ends with the same parameters and optimizer state.
   The average divides by the number of ranks, joined ones included, as
   Horovod's join and DDP's ``Join`` (``divide_by_initial_world_size``) do.
3. When the flags sum to 0 every rank has left: that last round of zero
   gradients is not applied, and the compressor's state (residuals, step
   counters) is put back to what it was before it, on every rank alike.

Cost: one 4-byte allreduce per step while the block is open. The flag is
waited for after the gradients, so it adds no round trip in front of them.
A block left by an exception does not shadow (the others would wait for
steps it cannot take); the exception propagates.
"""
import threading
import time
from dataclasses import dataclass

import horovod.torch as hvd
import horovod.torch.mpi_ops as mpi_ops
import torch

from horovod_qsgd.common.errors import (HVD_JOIN_TIMEOUT_SECONDS, JoinUnsupportedError, hvd_join_refused,
                                         hvd_join_timed_out)
from horovod_qsgd.common.naming import JOIN_CHECK_NAME, JOIN_FLAG_NAME

JOIN_CLASS = "horovod_qsgd.torch.Join(optimizer)"


class Join:
    """Context manager for uneven inputs; see the module docstring.

    Args:
        optimizer: the ``hvd.DistributedOptimizer`` (any ``compression=``); no other setting.

    Costs: one 4-byte allreduce per step while the block is open, waited for after the gradients (no round
    trip in front of them); a rank that ran out of data computes nothing but sends zero gradients through the
    same compressed exchanges until every rank has left.
    """

    def __init__(self, optimizer):
        if not callable(getattr(optimizer, "synchronize", None)) or not hasattr(optimizer, "skip_synchronize"):
            raise TypeError("horovod_qsgd: Join needs the optimizer returned by hvd.DistributedOptimizer, "
                            f"got {type(optimizer).__name__}.")
        self.optimizer = optimizer
        self.process_set = getattr(optimizer, "process_set", hvd.global_process_set)
        self.shadow_steps = 0  # steps this rank shadowed after it ran out of data
        self._synchronize = None

    def __enter__(self):
        if self._synchronize is not None:
            raise RuntimeError("horovod_qsgd: this Join is already open; open it once per epoch.")
        self._synchronize = self.optimizer.synchronize
        self.optimizer.synchronize = self._synchronize_training
        return self

    def __exit__(self, exc_type, exc, traceback):
        self.optimizer.synchronize, synchronize = self._synchronize, self._synchronize
        self._synchronize = None
        if exc_type is None:
            self._shadow(synchronize)
        return False

    def _flag(self, value):
        return hvd.allreduce_async(torch.full((1,), value, dtype=torch.int32), name=JOIN_FLAG_NAME, op=hvd.Sum,
                                   process_set=self.process_set)

    def _synchronize_training(self):
        flag = self._flag(1)
        self._synchronize()
        hvd.synchronize(flag)

    def _shadow(self, synchronize):
        optimizer = self.optimizer
        compression = getattr(optimizer, "_compression", None)
        has_state = callable(getattr(compression, "state_dict", None))
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        while True:
            saved = compression.state_dict() if has_state else None  # residuals come cloned
            flag = self._flag(0)
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                else:
                    p.grad.zero_()
            synchronize()
            if int(hvd.synchronize(flag)[0]) == 0:
                if has_state:
                    compression.load_state_dict(saved)
                optimizer._synchronized = False
                return
            with optimizer.skip_synchronize():
                optimizer.step()
            self.shadow_steps += 1


# -- hvd.join() with compressed payloads ------------------------------------------------------------------
# Horovod's join cannot answer an allgather or an alltoall (with its response cache the joined rank's
# background loop dies), so once a payload compressor runs, hvd.join() is ours:
# 1. The joining rank repeats every allreduce the compressors handed Horovod (by name, shape, op, scaling):
#    a payload's placeholder as NaN, anything else as zeros. A rank still in a step gets them, finds NaN
#    where its placeholder's sum should be and, before it waits for any payload, adds 0 to a check allreduce.
# 2. The joining rank adds 1 to the same check. Its sum is the number of ranks in hvd.join(): all of them
#    when every rank ran out of data together (then Horovod's own join runs, with nothing left to answer),
#    fewer when a rank was still training: then every rank raises JoinUnsupportedError naming the fix.
# No rank waits for a collective another rank will not start, except past HVD_JOIN_TIMEOUT_SECONDS when a
# rank is in neither a step nor hvd.join() (a collective of its own, or a step whose allreduces did not pass
# the compressors under their names: the optimizer's groups=) or reaches hvd.join() that much later than
# the first: then the joining rank raises alone, and the others meet Horovod's shutdown when it exits.


@dataclass(frozen=True)
class _Allreduce:
    shape: tuple
    dtype: torch.dtype
    device: torch.device
    op: object
    prescale_factor: float
    postscale_factor: float
    process_set: object
    marker: float  # what hvd.join() sends in its place


_allreduces = {}  # name -> the latest _Allreduce of that name
_allreduces_lock = threading.Lock()
_horovod_join = None


def note_allreduce(site, sent, marker):
    """Remembers the allreduce Horovod runs next on ``sent`` for ``site`` (``marker``: hvd.join()'s stand-in)."""
    if site.name is None:
        return
    with _allreduces_lock:
        _allreduces[site.name] = _Allreduce(tuple(sent.shape), sent.dtype, sent.device, site.op,
                                            site.prescale_factor, site.postscale_factor, site.process_set, marker)


def take_over_hvd_join():
    """Makes ``hvd.join()`` refuse compressed payloads on every rank (see above); called by payload compressors."""
    global _horovod_join
    if _horovod_join is not None:
        return
    with _allreduces_lock:
        if _horovod_join is None:
            _horovod_join = mpi_ops.join
            hvd.join = mpi_ops.join = _join_refusing_payloads


def refuse_if_a_rank_joined(placeholder):
    """Raises JoinUnsupportedError on a rank in a step if a rank in hvd.join() sent this placeholder (NaN)."""
    if not torch.isnan(placeholder.reshape(-1)[0]):  # every rank in a step sends 1
        return
    joined = hvd.allreduce(torch.zeros(1, dtype=torch.int32), name=JOIN_CHECK_NAME, op=hvd.Sum)
    _refused(int(joined[0]))


def _refused(joined_ranks):
    # What was recorded belongs to the refused steps: a later hvd.join() (a new model) must not repeat it,
    # nor start again a name whose stand-in no one answered.
    with _allreduces_lock:
        _allreduces.clear()
    raise JoinUnsupportedError(hvd_join_refused(JOIN_CLASS, joined_ranks, hvd.size()))


def _wait(handle, deadline):
    while not hvd.poll(handle):
        if time.monotonic() > deadline:
            raise JoinUnsupportedError(hvd_join_timed_out(JOIN_CLASS))
        time.sleep(0.002)
    try:
        return hvd.synchronize(handle)
    except hvd.HorovodInternalError as exc:  # a rank still in a step raised and left
        raise JoinUnsupportedError(hvd_join_refused(JOIN_CLASS, "some", hvd.size())) from exc


def _join_refusing_payloads(device=-1):
    """``hvd.join()`` while payload compressors run; see the comment above."""
    with _allreduces_lock:
        allreduces = list(_allreduces.items())
    deadline = time.monotonic() + HVD_JOIN_TIMEOUT_SECONDS
    stand_ins = [hvd.allreduce_async_(torch.full(a.shape, a.marker, dtype=a.dtype, device=a.device), name=name,
                                      op=a.op, prescale_factor=a.prescale_factor,
                                      postscale_factor=a.postscale_factor, process_set=a.process_set)
                 for name, a in allreduces]
    joined = int(_wait(hvd.allreduce_async(torch.ones(1, dtype=torch.int32), name=JOIN_CHECK_NAME, op=hvd.Sum),
                       deadline)[0])
    if joined < hvd.size():
        _refused(joined)
    for handle in stand_ins:  # every rank repeated the same allreduces
        _wait(handle, deadline)
    return _horovod_join(device)
