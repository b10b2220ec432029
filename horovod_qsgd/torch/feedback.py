"""The Horovod PyTorch compressors' error-feedback store: each tensor's step counter and residuals, by name.

A tensor's :class:`TensorState` holds its RNG step counter, its residual (what its steps did not send) and,
where this rank owns a chunk of the sum (the two stages, or between 3 or more nodes), the owner residual of
that chunk with the layout it belongs to. The residuals are
:class:`~horovod_qsgd.torch_feedback.KeptResidual`: a step writes into a spare buffer, kept only once its
result is finite. The store keeps the rules that move them: a residual that does not match its tensor is an
error, an owner residual of another layout (an elastic reset, a checkpoint from another job size) is spilled
into the residual, the checkpoint format, a loss scaler's rescale, an elastic world's step counters.
"""
import threading

from horovod_qsgd.common.chunks import chunk_unit
from horovod_qsgd.common.errors import residual_length_mismatch
from horovod_qsgd.common.two_stage import moved_owner_chunk
from horovod_qsgd.torch_feedback import KeptResidual, step_stamps


class TensorState:
    """What training depends on per tensor: the RNG step counter and the error-feedback residuals.

    ``residual`` and ``owner_residual`` are :class:`~horovod_qsgd.torch_feedback.KeptResidual`; ``owner_residual``:
    with the two-stage exchange and error feedback, what this rank's owned chunk of the sum did not send;
    ``owner_layout`` the (ranks, rank) it belongs to. ``stamps``: on a GPU, whether the last step counted, as
    the device knows it (:mod:`horovod_qsgd.torch_feedback`).
    """

    def __init__(self, step=0, residual=None, owner_residual=None, owner_layout=None):
        self.step = step
        self.residual = residual
        self.owner_residual = owner_residual
        self.owner_layout = owner_layout
        self.stamps = None

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

    def owner_residual_for_step(self, plan, numel, device, step):
        """What a step reads and writes the owner residual of ``plan``'s chunk (``numel`` elements) through:
        zeros where there is none, or where the one kept belongs to another layout."""
        if self.owner_residual is not None and not plan.keeps_owner_residual(self.owner_layout,
                                                                            self.owner_residual.numel()):
            self.owner_residual = None
        if self.owner_residual is None:
            self.owner_residual = KeptResidual.zeros(numel, device)
            self.owner_layout = plan.owner_layout()
        return self.owner_residual.for_step(self.stamps, step)


class TensorFeedback:
    """Every tensor's :class:`TensorState`, by name."""

    def __init__(self):
        self._states = {}
        self._lock = threading.Lock()

    def state(self, name, numel, device, needs_residual, owner_layout, codec):
        """Tensor ``name``'s state for a step on ``device`` (created at its first step), with a residual of
        ``numel`` elements where ``needs_residual``; raises where the one kept has another length. An owner
        residual kept for a layout other than ``owner_layout`` (an elastic reset, a checkpoint from another job
        size or node layout) is added into the residual at its old chunk (aligned as ``codec``'s chunks are):
        this rank sends that mass in its next steps."""
        with self._lock:
            state = self._states.get(name)
            if state is None:
                state = self._states[name] = TensorState()
        state.stamps_on(device)
        if needs_residual:
            if state.residual is None:
                state.residual = KeptResidual.zeros(numel, device)
            elif state.residual.numel() != numel:
                raise residual_length_mismatch(f"tensor {name!r}", numel, state.residual.numel())
            state.residual.to(device)
        if state.owner_residual is not None and list(state.owner_layout or []) != owner_layout:
            _spill_moved_owner_residual(name, state, numel, codec, owner_layout)
        return state

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self):
        """{tensor name: {step, residual, owner_residual, owner_layout}}, the residuals cloned."""
        tensors = {}
        for name, s in list(self._states.items()):
            s.settle_on_host()
            tensors[name] = {"step": s.step, "residual": _clone(s.residual and s.residual.kept),
                             "owner_residual": _clone(s.owner_residual and s.owner_residual.kept),
                             "owner_layout": s.owner_layout}
        return tensors

    def load_state_dict(self, tensors):
        with self._lock:
            self._states = {name: TensorState(t["step"], _kept(t["residual"]), _kept(t.get("owner_residual")),
                                              t.get("owner_layout"))
                            for name, t in tensors.items()}

    def rescale(self, factor):
        """Multiplies every residual by ``factor`` (a float or a 0-d tensor)."""
        for state in list(self._states.values()):
            for residual in state.residuals():
                residual.scale(factor)

    # -- Horovod Elastic --------------------------------------------------------------------
    def set_step_counters(self, steps):
        """The step counters become ``steps`` (by tensor name); every stamp is settled first (they name steps)."""
        with self._lock:
            for state in self._states.values():
                state.settle_on_host()
            for name, step in steps.items():
                self._states.setdefault(name, TensorState()).step = int(step)

    def step_counters(self):
        """{tensor name: steps taken}."""
        with self._lock:
            return {name: state.step for name, state in self._states.items()}

    def __getitem__(self, name):
        return self._states[name]


def _clone(tensor):
    return None if tensor is None else tensor.clone()


def _kept(tensor):
    return None if tensor is None else KeptResidual(tensor.clone())


def _spill_moved_owner_residual(name, state, numel, codec, layout):
    state.settle_on_host()
    chunk = moved_owner_chunk(name, numel, chunk_unit(codec), state.owner_layout, state.owner_residual.numel(),
                              layout)
    if chunk is not None:
        begin, end = chunk
        residual = state.residual.kept
        residual[begin:end].add_(state.owner_residual.kept[:end - begin].to(residual.device))
    state.owner_residual, state.owner_layout = None, None
