"""Error-feedback state kept across steps in torch tensors, for the Horovod adapter, the DDP hooks and FSDP2.

:class:`TensorFeedback` is the common store (:class:`~horovod_qsgd.common.feedback.FeedbackStore`) in torch
tensors, by name: each name's :class:`TensorState` holds its step counter, residual and owner residual (each
a :class:`KeptResidual`) with the owner residual's layout. Horovod's PyTorch compressors keep one entry per
tensor, FSDP2's one per module; the DDP hooks keep theirs per parameter (``ddp/feedback.py``).

A step whose result holds inf or NaN (a loss-scale overflow) must leave every residual as it was. Copying
each residual before each step cost a pass over it, and checking the result another (Top-k's step 1.29x
slower). Instead each residual has two buffers: a step reads the residual the last counted step left in
one (``kept``) and writes its new residual into the other (``spare``), in the pass that already reads the
residual (:class:`horovod_qsgd.kernels.CarriedResidual`). The pass that already scales the decoded sum finds
whether it is finite (:func:`horovod_qsgd.kernels.finish_sum`), and then:

* on the CPU the host reads that and swaps the buffers when the step counts (:meth:`KeptResidual.keep`);
* on a GPU nothing is read back: the finishing kernel stamps the tensor's ``stamps`` (int64 [2]: the last
  step whose result was written, the last whose result was not finite) and the next step's first pass
  reads them on the device; where the last step counted, it moves ``spare`` into ``kept`` as it reads it.
  ``spare`` is then the residual until that pass; anything else that reads or changes a residual first
  settles it on the host (:meth:`KeptResidual.settle_on_host`, one read of the stamps).

Where ``HOROVOD_QSGD_DEVICE_VERDICT=1``, CPU tensors are settled the GPU's way too: no machine of the test
suite has a GPU, and this is how it runs that logic through whole Horovod steps and DDP buckets.

Imports no Horovod.
"""
import os
import threading

import numpy as np
import torch

from horovod_qsgd.common.feedback import FeedbackStore, StepVerdict
from horovod_qsgd.kernels import CarriedResidual, committed, finish_sum
from horovod_qsgd.torch_shared.arrays import as_array

DEVICE_VERDICT_ENV = "HOROVOD_QSGD_DEVICE_VERDICT"


def step_stamps(device):
    """The commit stamps of a tensor's residuals on a GPU (None on the CPU, which decides on the host)."""
    if device.type == "cuda" or os.environ.get(DEVICE_VERDICT_ENV) == "1":
        return torch.zeros(2, dtype=torch.int64, device=device)
    return None


class DeviceNonfiniteCounts:
    """Per device, an int64 count of the non-finite results the stamps found (added to by the finishing kernel,
    read only when the statistics are)."""

    def __init__(self):
        self._counters, self._lock = {}, threading.Lock()

    def on(self, device):
        with self._lock:
            counter = self._counters.get(device)
            if counter is None:
                counter = self._counters[device] = torch.zeros(1, dtype=torch.int64, device=device)
            return counter

    def drain_into(self, stats):
        """Adds the counts to ``stats`` (CompressionStats' ``tensors_nonfinite``) and zeroes them."""
        with self._lock:
            counters = list(self._counters.values())
        for counter in counters:
            stats.add(tensors_nonfinite=int(counter.item()))
            counter.zero_()


def last_step_counted(stamps, stamp):
    """Host read of ``stamps``: True where the step before the one stamped ``stamp`` wrote a finite result."""
    return stamps is not None and bool(committed(stamps.cpu().numpy(), np.int64(stamp)))


def mark_step_on_device(entries, finite, need_answer):
    """A step's verdict over the device verdicts ``entries`` ([(stamps, the stamp its finishing pass wrote)], see
    :class:`~horovod_qsgd.common.feedback.StepVerdict`), made on the device: where any tensor's result was not
    finite (or ``finite`` is False), every entry's stamps say its step did not count, so that the next step's
    first pass keeps none of the step's residuals. No host read unless ``need_answer`` (then one)."""
    answers = []
    by_device = {}
    for stamps, stamp in entries:
        by_device.setdefault(stamps.device, []).append((stamps, stamp))
    for device, group in by_device.items():
        stamps = [s for s, _ in group]
        written = torch.tensor([stamp for _, stamp in group], dtype=torch.int64).to(device, non_blocking=True)
        stacked = torch.stack(stamps)
        counted = ((stacked[:, 0] == written) & (stacked[:, 1] != written)).all()
        if not finite:
            counted = torch.zeros_like(counted)
        torch._foreach_copy_([s[1:] for s in stamps], list(torch.where(counted, stacked[:, 1], written).split(1)))
        answers.append(counted)
    if not need_answer:
        return None
    return finite and all(bool(a) for a in answers)


def scaled_and_finite(total, scale):
    """Multiplies the decoded sum ``total`` by ``scale``; whether the result is finite, decided on the host: found
    by the same pass on the CPU, by a check and one host read on a GPU (the DDP hooks, FSDP2's reduce-scatter)."""
    if total.is_cuda:
        total.mul_(scale)
        return bool(torch.isfinite(total).all())
    return finish_sum(as_array(total), scale)


class KeptResidual:
    """One error-feedback residual (a flat fp32 tensor) and the buffer the next step writes into."""

    __slots__ = ("kept", "_spare", "_taken")

    def __init__(self, kept):
        self.kept, self._spare = kept, None
        self._taken = None  # the stamp of the last step that read it through stamps (None: the host decides)

    @classmethod
    def zeros(cls, numel, device):
        return cls(torch.zeros(numel, dtype=torch.float32, device=device))

    def numel(self):
        return self.kept.numel()

    def for_step(self, stamps=None, stamp=0):
        """What a step reads the residual through and writes its new residual into (torch tensors; see
        :func:`horovod_qsgd.torch_shared.arrays.as_array`): ``kept`` read, ``spare`` written (allocated once; with
        ``stamps`` as a copy of ``kept``, so that whichever of the two they name holds the residual)."""
        spare = self._spare
        if spare is None or spare.numel() != self.kept.numel() or spare.device != self.kept.device:
            spare = self._spare = self.kept.clone() if stamps is not None else torch.empty_like(self.kept)
        self._taken = stamp if stamps is not None else None
        return CarriedResidual(spare, self.kept, stamps, stamp)

    def keep(self, step):
        """The step that wrote through ``step`` (from :meth:`for_step`) counts: its residual is kept (CPU)."""
        self.kept, self._spare = step.target, step.previous

    def settle_on_host(self, stamps):
        """Makes ``kept`` the residual whatever ``stamps`` say (they are reset by the caller): before anything
        but a step reads or changes it (a checkpoint, a spill, a move to another device). Where the last step
        that read it counted, that step's residual is in ``spare`` (its first pass moved the one before into
        ``kept``)."""
        if self._spare is not None and self._taken is not None and last_step_counted(stamps, self._taken + 1):
            self.kept, self._spare = self._spare, self.kept

    def single_buffer(self, dtype):
        """The residual as one buffer of ``dtype`` that steps update in place (no spare; FSDP2's lean Top-k):
        converted once where it was made or loaded in another dtype."""
        if self.kept.dtype != dtype:
            self.kept = self.kept.to(dtype)
        self._spare = None
        return self.kept

    def nbytes(self):
        """Bytes its buffers hold (the spare's too, once a step made it)."""
        return sum(t.numel() * t.element_size() for t in (self.kept, self._spare) if t is not None)

    def scale(self, factor):
        """Multiplies the residual by ``factor``: ``kept``, and where stamps decide, ``spare`` too, which may
        hold it."""
        self.kept.mul_(factor)
        if self._spare is not None and self._taken is not None:
            self._spare.mul_(factor)

    def to(self, device):
        if self.kept.device != device:
            self.kept, self._spare = self.kept.to(device), None
        return self


class TensorState:
    """What training depends on per tensor: the RNG step counter and the error-feedback residuals.

    ``residual`` and ``owner_residual`` are :class:`~horovod_qsgd.torch_shared.feedback.KeptResidual`; ``owner_layout``
    the layout the owner residual belongs to. ``stamps``: on a GPU, whether the last step counted, as the
    device knows it (:mod:`horovod_qsgd.torch_shared.feedback`).
    """

    __slots__ = ("step", "residual", "owner_residual", "owner_layout", "stamps")

    def __init__(self):
        self.stamps = None
        self.clear()

    def clear(self):
        """Step 0, no residual kept (its stamps, settled, stay)."""
        self.step = 0
        self.residual = self.owner_residual = self.owner_layout = None

    def residuals(self):
        return [r for r in (self.residual, self.owner_residual) if r is not None]

    def stamps_on(self, device):
        """The stamps of this tensor on ``device`` (None on the CPU); the residuals settled on the host first if
        they were on another device."""
        if self.stamps is None or self.stamps.device != device:
            self.settle_on_host()
            self.stamps = step_stamps(device)
        return self.stamps

    def settle_on_host(self):
        """``kept`` is each residual and the stamps say nothing, after one host read: before a residual is
        changed, saved or moved outside a step, or the step counter is set."""
        if self.stamps is not None:
            read = self.stamps.cpu()
            for residual in self.residuals():
                residual.settle_on_host(read)
            self.stamps.zero_()


class TensorFeedback(FeedbackStore):
    """Every tensor's :class:`TensorState`, by name."""

    def __init__(self):
        self._states = {}
        self._lock = threading.Lock()
        self.verdict = StepVerdict(mark_step_on_device)

    def state(self, name, numel, device, needs_residual, owner_layout, codec):
        """Tensor ``name``'s state for a step on ``device`` (created at its first step), its residual of ``numel``
        elements on ``device`` where ``needs_residual`` (checked), and an owner residual kept for a layout other
        than ``owner_layout`` spilled into it."""
        state = self.entry(name)
        state.stamps_on(device)
        if needs_residual:
            self.checked_residual(name, numel, device).to(device)
        if state.owner_residual is not None:
            self.spill_moved_owner_residual(name, owner_layout, codec)
        return state

    def entry(self, name):
        """Tensor ``name``'s state, created empty where it has none."""
        with self._lock:
            state = self._states.get(name)
            if state is None:
                state = self._states[name] = TensorState()
            return state

    def owner_residual_for_step(self, name, plan, device, step):
        """What ``plan``'s step ``step`` reads and writes tensor ``name``'s owner residual through."""
        state = self._states[name]
        return self.owner_residual_for(name, plan, device).for_step(state.stamps, step)

    # -- the arrays the common rules move ---------------------------------------------------
    def _names(self):
        with self._lock:
            return list(self._states)

    def _step(self, name):
        return self._states[name].step

    def _set_step(self, name, step):
        self.entry(name).step = step

    def _residual(self, name):
        return self._states[name].residual

    def _new_residual(self, name, numel, device):
        state = self._states[name]
        state.residual = KeptResidual.zeros(numel, device)
        return state.residual

    def _load_residual(self, name, value):
        self._states[name].residual = None if value is None else KeptResidual(value.clone().float())

    def _owner_residual(self, name):
        return self._states[name].owner_residual

    def _owner_layout(self, name):
        return self._states[name].owner_layout

    def _new_owner(self, name, numel, layout, device):
        state = self._states[name]
        state.owner_residual, state.owner_layout = KeptResidual.zeros(numel, device), list(layout)
        return state.owner_residual

    def _load_owner(self, name, value, layout):
        state = self._states[name]
        state.owner_residual = None if value is None else KeptResidual(value.clone().float())
        state.owner_layout = layout

    def _drop_owner(self, name):
        state = self._states[name]
        state.owner_residual = state.owner_layout = None

    def _reset(self, name):
        self._states[name].clear()

    def _settle(self, name):
        self._states[name].settle_on_host()

    def _numel(self, array):
        return array.numel()

    def _saved(self, array):
        return array.kept.clone()

    def _scale(self, array, factor):
        array.scale(factor)

    def _add_chunk(self, residual, begin, end, owner_residual):
        target = residual.kept
        target[begin:end].add_(owner_residual.kept[:end - begin].to(target.device))
