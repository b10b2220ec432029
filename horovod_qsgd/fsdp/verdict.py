"""Whether an FSDP2 step counts, decided on the device across every rank that skips it.

A loss scaler (``torch.amp.GradScaler``, FSDP2's ``ShardedGradScaler``) skips a step on every rank where any
rank's gradient overflowed. Under FSDP2 each rank sees only its shard of the sum, so the ranks' verdicts differ
until they meet: each exchange with error feedback turns what it wrote (FSDP2's output, after the cast to its
reduce dtype, where fp16 can overflow a finite float32 sum) into a one-element flag, ORs in the flag the step's
previous exchange on this rank reached, and all-reduces it (MAX) over its groups, one after the other: the
module's shard group, and under HSDP its replicas' group too. The step's last flag then spans every rank whose
exchanges chained into it: the whole job where the last module of the backward pass spans it (FSDP2's root
does), both mesh dimensions under HSDP.

Nothing is read on the host. The flags are all-reduced asynchronously; on a GPU, waiting for one orders the
stream only. The step is decided when the next step's first exchange begins (or before a checkpoint): each
exchange's residual stamps (``torch_shared/feedback.py``) get the verdict on the device, and the codec's next
pass takes the new residual or the old one as they say. On the CPU the host reads the flag instead (not a
synchronization there), unless ``HOROVOD_QSGD_DEVICE_VERDICT=1``, which runs the GPU's logic on CPU tensors.

Imports no Horovod.
"""
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from horovod_qsgd.torch_shared.feedback import DeviceNonfiniteCounts


class StepFlags:
    """This rank's pending exchanges of the step and the flag their verdicts chain through."""

    def __init__(self):
        self._chain = None    # (work, flag): the step's latest all-reduced flag
        self._pending = {}    # key -> (work, flag, [(kept, written)], stamps, stamp, zeroed)
        self.nonfinite = DeviceNonfiniteCounts()  # this rank's non-finite outputs, on the device

    def note(self, key, output, groups, writes=None, stamps=None, stamp=0, zeroed=None):
        """Exchange ``key`` wrote ``output`` (FSDP2's tensor, in its dtype). ``writes``: [(KeptResidual, the
        CarriedResidual its step wrote through)], None where it keeps no residual (then only counted);
        ``groups``: the process groups its flag is all-reduced over, in order; ``stamps``/``stamp``: its
        residuals' device verdict (None: the host decides); ``zeroed``: a residual the step updated in place
        (one buffer), set to zeros where the step does not count."""
        bad = torch.logical_not(torch.isfinite(output).all()).reshape(1).to(torch.int32)
        self.nonfinite.on(output.device).add_(bad)
        if writes is None:
            return
        flag = bad
        if self._chain is not None:
            work, previous = self._chain
            work.wait()
            flag = torch.maximum(flag, previous)
        work = None
        for group in groups:
            if work is not None:
                work.wait()
            work = dist.all_reduce(flag, op=ReduceOp.MAX, group=group, async_op=True)
        self._chain = (work, flag)
        self._pending[key] = (work, flag, writes, stamps, stamp, zeroed)

    def pending(self, key):
        return key in self._pending

    def settle(self, verdict):
        """Hands every pending exchange's verdict to ``verdict`` (the store's
        :class:`~horovod_qsgd.common.feedback.StepVerdict`) and decides the step: the new residuals are kept where
        no exchange of the step, on any rank its flags reached, wrote inf or NaN."""
        pending, self._pending, self._chain = self._pending, {}, None
        for work, *_ in pending.values():
            work.wait()
        zeroed = [entry[5] for entry in pending.values() if entry[5] is not None]
        if zeroed:  # on the device: whether any exchange of the step, on any rank its flags reached, overflowed
            skipped = torch.stack([entry[1] for entry in pending.values()]).amax().reshape(1) > 0
            for residual in zeroed:
                residual.masked_fill_(skipped, 0)
        for key, (_, flag, writes, stamps, stamp, _) in pending.items():
            if stamps is not None:
                stamps[0].fill_(stamp)
                stamps[1:].copy_(torch.where(flag > 0, torch.full_like(stamps[1:], stamp), stamps[1:]))
                verdict.defer_on_device(key, (stamps, stamp))
            elif writes:
                verdict.defer(key, int(flag.item()) == 0, _keeper(writes))
        verdict.settle()

    def drop(self):
        """Forgets the pending verdicts (a checkpoint is loaded over them)."""
        self._pending, self._chain = {}, None


def _keeper(writes):
    def keep():
        for kept, written in writes:
            kept.keep(written)
    return keep
