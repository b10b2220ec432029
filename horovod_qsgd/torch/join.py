r"""Uneven inputs with compressed gradients: a rank that runs out of data shadows the others' steps.

Horovod's ``hvd.join()`` lets a rank that has finished answer the others'
allreduces with zeros, but it cannot answer an allgather or an alltoall:
with payload compression the coordinator's background loop dies
(``unordered_map::at``) and the job with it. :class:`Join` does what
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
import horovod.torch as hvd
import torch

JOIN_FLAG_NAME = "horovod_qsgd.join.active_ranks"


class Join:
    """Context manager for uneven inputs; see the module docstring.

    Args:
        optimizer: the ``hvd.DistributedOptimizer`` (any ``compression=``).
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
