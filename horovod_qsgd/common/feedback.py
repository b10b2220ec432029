"""The error-feedback store: what training depends on per tensor, and the rules that move it, written once.

Per tensor name the store keeps:

* the **step** counter: steps the tensor took, which the counter-based RNG draws its streams from;
* the **residual** (error feedback): what its steps did not send, as long as the tensor;
* the **owner residual** and the **layout** it was kept for: where this rank owns a chunk of the sum (the two
  stages, or two stages between 3 or more nodes), what that chunk's second encode did not send; the layout
  is [ranks, rank] or a node layout [nodes, ranks per node, node, local rank].

The rules, the same in every adapter:

* a residual of another length than its tensor is an error that names both
  (:func:`~horovod_qsgd.common.errors.residual_length_mismatch`), or, where the adapter says why the length
  may change between steps (FSDP2's rows, when a parameter got no gradient), reset to zeros with a warning;
* an owner residual kept for another layout than this rank's (an elastic reset, a checkpoint of another job
  size or node layout) is added into the residual at its old chunk before the residual is next read: this
  rank sends that mass in its next steps. Where it cannot be this tensor's chunk it is dropped with a warning;
* a plan that cannot keep the owner residual it finds starts from zeros, with a warning;
* a checkpoint holds, by name, ``{step, residual, owner_residual, owner_layout}`` (None where nothing is
  kept; an empty owner residual is none); loading one replaces the state: names it lacks start afresh;
* a loss scaler's rescale multiplies every residual; an elastic world's step counters are set from rank 0's, and
  so are Random-k's at its first step (its ranks must draw the same coordinates).

A step in which any tensor's result is not finite keeps no residual that any of its tensors wrote: a loss scaler
skips the whole step when one gradient overflows, and the layers that stayed finite must not keep what it sent.
:class:`StepVerdict` decides that once per step; each tensor's new residual waits in the second of its two
buffers until then (``torch_shared.feedback.KeptResidual``; a spare variable in TensorFlow).

:class:`FeedbackStore` holds the rules; each adapter subclasses it with the arrays its framework keeps them in:
``torch_shared.feedback.TensorFeedback`` (torch tensors by name: Horovod's PyTorch compressors per tensor, FSDP2 per
module) and ``tensorflow/feedback.py`` (``tf.Variable`` objects, which a traced function reads and
``tf.train.Checkpoint`` tracks). The DDP hooks' residuals are not kept by name: per parameter, so that DDP may
rebuild its buckets, and staged per bucket (``ddp/feedback.py``), with the same rules for a changed bucket.
"""
import collections
import random
import threading
import warnings

from horovod_qsgd.common.chunks import chunk_unit
from horovod_qsgd.common.errors import residual_length_mismatch
from horovod_qsgd.common.state import check_loadable, state_header
from horovod_qsgd.common.two_stage import moved_owner_chunk


class FeedbackStore:
    """The rules of error-feedback state by tensor name, over the arrays a subclass keeps.

    A subclass implements the ``_`` methods below the rules: where each name's step, residual and owner
    residual are, and the four array operations the rules need (length, copy for a checkpoint, scale, add a
    chunk). Its ``verdict`` (a :class:`StepVerdict`) decides whether the steps' new residuals are kept; the
    last step is decided before anything but a step reads or changes the state.
    """

    verdict = None

    def settle_step(self):
        """Decides the last step (see :class:`StepVerdict`), where a verdict is pending."""
        if self.verdict is not None:
            self.verdict.settle()

    # -- the rules ------------------------------------------------------------------------------
    def checked_residual(self, name, numel, device=None, resized=None):
        """Tensor ``name``'s residual (created as zeros at its first step). One kept with another length than
        ``numel`` is an error; where ``resized`` says why the length may change between steps, it is reset to
        zeros with a warning instead (its unsent mass is lost once)."""
        residual = self._residual(name)
        if residual is not None and self._numel(residual) != numel:
            if resized is None:
                raise residual_length_mismatch(f"tensor {name!r}", numel, self._numel(residual))
            warnings.warn(f"horovod_qsgd: {name!r}: the residual has {self._numel(residual)} elements, {resized} "
                          f"{numel}; it is reset to zeros (its unsent mass is lost once).")
            residual = None
        return self._new_residual(name, numel, device) if residual is None else residual

    def spill_moved_owner_residual(self, name, layout, codec):
        """Where tensor ``name``'s owner residual was kept for a layout other than ``layout`` (this rank's now),
        adds it into the residual at its old chunk (aligned as ``codec``'s chunks are; dropped with a warning
        where it cannot be this tensor's) and drops it. Call it before the residual is read."""
        owner_residual = self._owner_residual(name)
        if owner_residual is None:
            return
        saved = self._owner_layout(name)
        if saved is None or saved == list(layout):
            return
        self._settle(name)  # the arrays' values, not which arrays they are
        residual = self._residual(name)
        if residual is not None:
            chunk = moved_owner_chunk(name, self._numel(residual), chunk_unit(codec), saved,
                                      self._numel(owner_residual), list(layout))
            if chunk is not None:
                self._add_chunk(residual, *chunk, owner_residual)
        self._drop_owner(name)

    def owner_residual_for(self, name, plan, device=None):
        """The owner residual ``plan``'s step reads and writes: the one kept where the plan keeps it
        (:meth:`~horovod_qsgd.common.two_stage.TwoStage.keeps_owner_residual`, which warns where not), else
        new zeros for the plan's layout. A layout of None is one only this process made (a ``tf.compat.v1``
        graph's variable before its Session runs): it is this rank's."""
        owner_residual = self._owner_residual(name)
        if owner_residual is not None:
            saved = self._owner_layout(name)
            if saved is None or plan.keeps_owner_residual(saved, self._numel(owner_residual)):
                return owner_residual
        return self._new_owner(name, plan.own_numel(), plan.owner_layout(), device)

    # -- checkpoints ------------------------------------------------------------------------
    def checkpoint(self, compressor, settings, key="tensors"):
        """What a compressor's ``state_dict()`` returns: the header that says what wrote it (its class name
        ``compressor`` and its ``settings``; :mod:`horovod_qsgd.common.state`) and :meth:`feedback_entries`
        under ``key``."""
        return dict(state_header(compressor, settings), **{key: self.feedback_entries()})

    def load_checkpoint(self, state, compressor, settings):
        """Loads a :meth:`checkpoint`; raises ValueError, naming the difference and the fix, unless such a
        compressor wrote it."""
        check_loadable(state, compressor, settings)
        self.load_feedback_entries(state["tensors"])

    def feedback_entries(self):
        """{tensor name: {step, residual, owner_residual, owner_layout}}: copies, None where nothing is kept."""
        self.settle_step()
        entries = {}
        for name in self._names():
            self._settle(name)
            residual, owner = self._residual(name), self._owner_residual(name)
            owner_residual = None if owner is None else self._saved(owner)
            if owner_residual is not None and len(owner_residual) == 0:
                owner_residual = None  # an elastic job's, where this rank owns no chunk
            entries[name] = {"step": self._step(name),
                             "residual": None if residual is None else self._saved(residual),
                             "owner_residual": owner_residual,
                             "owner_layout": None if owner_residual is None else list(self._owner_layout(name))}
        return entries

    def load_feedback_entries(self, entries):
        """Replaces the state by ``entries`` (:meth:`feedback_entries`' form; ``owner_residual`` and
        ``owner_layout`` may be missing): a name they lack starts afresh."""
        self.settle_step()
        for name in list(self._names()):
            self._settle(name)
            if name not in entries:
                self._reset(name)
        for name, entry in entries.items():
            self._set_step(name, int(entry["step"]))
            self._load_residual(name, entry.get("residual"))
            owner_residual = entry.get("owner_residual")
            self._load_owner(name, owner_residual, None if owner_residual is None else
                             [int(v) for v in entry["owner_layout"]])

    def rescale_feedback(self, factor):
        """Multiplies every residual and owner residual by ``factor`` (a loss scaler's new / old scale)."""
        self.settle_step()
        for name in list(self._names()):
            for array in (self._residual(name), self._owner_residual(name)):
                if array is not None:
                    self._scale(array, factor)

    # -- Horovod Elastic --------------------------------------------------------------------
    def step_counters(self):
        """{tensor name: steps taken}: what a new elastic world gets from rank 0."""
        return {name: self._step(name) for name in list(self._names())}

    def set_step_counters(self, steps):
        """The step counters become ``steps`` (rank 0's, by tensor name): a name they lack counts from 0 (its
        residuals stay)."""
        self.settle_step()
        for name in list(self._names()):
            self._settle(name)
            if name not in steps:
                self._set_step(name, 0)
        for name, step in steps.items():
            self._set_step(name, int(step))

    # -- what a subclass keeps --------------------------------------------------------------
    def _names(self):
        """Every tensor name with any state."""
        raise NotImplementedError

    def _step(self, name):
        """Tensor ``name``'s step counter (an int)."""
        raise NotImplementedError

    def _set_step(self, name, step):
        raise NotImplementedError

    def _residual(self, name):
        """Tensor ``name``'s residual, or None."""
        raise NotImplementedError

    def _new_residual(self, name, numel, device):
        """A residual of ``numel`` zeros for tensor ``name``, kept and returned."""
        raise NotImplementedError

    def _load_residual(self, name, value):
        """Tensor ``name``'s residual becomes a copy of ``value`` (None: none is kept)."""
        raise NotImplementedError

    def _owner_residual(self, name):
        """Tensor ``name``'s owner residual, or None."""
        raise NotImplementedError

    def _owner_layout(self, name):
        """The layout (a list of ints) tensor ``name``'s owner residual was kept for; None where only this
        process knows it."""
        raise NotImplementedError

    def _new_owner(self, name, numel, layout, device):
        """An owner residual of ``numel`` zeros kept for ``layout``, kept and returned."""
        raise NotImplementedError

    def _load_owner(self, name, value, layout):
        """Tensor ``name``'s owner residual becomes a copy of ``value``, kept for ``layout`` (None: none is)."""
        raise NotImplementedError

    def _drop_owner(self, name):
        raise NotImplementedError

    def _reset(self, name):
        """Tensor ``name`` starts afresh: step 0, no residual kept."""
        raise NotImplementedError

    def _settle(self, name):
        """Makes tensor ``name``'s arrays what the host reads, before anything but a step reads or changes
        them (a GPU's verdicts; nothing by default)."""

    def _numel(self, array):
        raise NotImplementedError

    def _saved(self, array):
        """A copy of ``array`` for a checkpoint."""
        raise NotImplementedError

    def _scale(self, array, factor):
        raise NotImplementedError

    def _add_chunk(self, residual, begin, end, owner_residual):
        """``residual[begin:end] += owner_residual[:end - begin]``."""
        raise NotImplementedError


class KeepsFeedback:
    """What a Horovod compressor (PyTorch's or TensorFlow's) with a :class:`FeedbackStore` as ``_feedback`` and
    ``settings()`` says of its state, the same in both frameworks."""

    def load_state_dict(self, state):
        self._feedback.load_checkpoint(state, type(self).__name__, self.settings())

    def step_counters(self):
        """{tensor name: steps taken}: what ``start_new_world`` gets from rank 0."""
        return self._feedback.step_counters()


class StepVerdict:
    """Whether a training step counts, decided once for all the tensors (or DDP buckets, FSDP2 modules) it took.

    A loss scaler skips a step in which any gradient overflowed, on every rank, while the layers near the
    output usually stay finite. Each tensor's verdict is the same on every rank (every rank decodes the same
    bits), and so is their conjunction: the step's new residuals are kept where every tensor of the step came
    out finite, else none is. A tensor's step defers keeping them (:meth:`defer`, or :meth:`defer_on_device`
    where a GPU stamped the tensor's verdict on the device); the step is decided (:meth:`settle`) when a tensor
    of it starts its next step (:meth:`begin`), which comes after every tensor of the step finished, and before
    anything else reads or changes the residuals.

    ``mark_device(entries, finite, need_answer)``: the adapter's device part. ``entries`` are the deferred device
    verdicts; ``finite`` is False where a host verdict already says the step does not count. It makes every
    entry say what the step's verdict is, on the device, and returns that verdict as a bool where
    ``need_answer`` (host verdicts wait on it: one host read), else None.
    """

    def __init__(self, mark_device=None):
        self._lock = threading.Lock()
        self._mark_device = mark_device
        self._keeps = {}      # key -> what keeps that tensor's new residuals
        self._on_device = {}  # key -> a device verdict (the adapter's)
        self._finite = True

    def begin(self, key):
        """Before tensor ``key``'s step reads its residuals: where it took part in the step still undecided, that
        step is over and is decided first."""
        if key in self._keeps or key in self._on_device:
            self.settle()

    def defer(self, key, finite, keep, discard=None):
        """Tensor ``key``'s result was ``finite`` or not; ``keep()`` keeps its new residuals if the step counts,
        ``discard()`` (where given) puts back what the step took if it does not."""
        with self._lock:
            self._keeps[key] = (keep, discard)
            self._finite = self._finite and bool(finite)

    def defer_on_device(self, key, entry):
        """Tensor ``key``'s verdict is on the device (``entry``, which ``mark_device`` reads)."""
        with self._lock:
            self._on_device[key] = entry

    def settle(self):
        """Decides the step: keeps every tensor's new residuals if all its results were finite."""
        with self._lock:
            keeps, on_device, finite = self._keeps, self._on_device, self._finite
            self._keeps, self._on_device, self._finite = {}, {}, True
        if on_device:
            answer = self._mark_device(list(on_device.values()), finite, bool(keeps))
            finite = finite if answer is None else answer
        for keep, discard in keeps.values():
            if finite:
                keep()
            elif discard is not None:
                discard()


def settled(stamp):
    """A spare's stamp once its variable took what it held (no spare pending): the generation stays known."""
    return -2 - stamp if stamp >= 0 else stamp


class Generations:
    """:class:`StepVerdict`'s rule for steps that run in graphs (TensorFlow), where each tensor's state is its own
    variables and the verdicts live here, on the host, reached from stateless host ops (a variable shared by
    the tensors would order every tensor's ops after the others').

    A generation is one step of all the tensors: a tensor that took part in the current one starts the next
    (:meth:`start`). A step's write is stamped ``2 * generation + (1 if its own result was finite)``
    (:meth:`record`), and a spare counts (:meth:`counted`) where every result of its generation was finite. A
    stamp of another process (restored from a checkpoint) falls back to its own verdict: generations count from
    a random epoch in each process. -1: nothing written; :func:`settled` stamps: nothing pending.
    """

    KEPT = 4096  # generations whose verdicts are remembered (an older one falls back to its own verdict)

    def __init__(self):
        self._lock = threading.Lock()
        self._current = random.SystemRandom().randrange(1, 1 << 29) << 32
        self._verdicts = collections.OrderedDict()

    def start(self, stamp):
        """The generation of a tensor's step whose last write was stamped ``stamp``."""
        took_part = None  # stamp -1: nothing written yet
        if stamp != -1:
            took_part = (stamp if stamp >= 0 else -2 - stamp) >> 1  # a settled stamp, back to the stamp
        with self._lock:
            if took_part == self._current:
                self._current += 1
            return self._current

    def record(self, generation, finite):
        """A tensor's result in ``generation`` was ``finite`` or not; returns the stamp of its write."""
        with self._lock:
            self._verdicts[generation] = self._verdicts.get(generation, True) and finite
            while len(self._verdicts) > self.KEPT:
                self._verdicts.popitem(last=False)
        return 2 * generation + int(finite)

    def counted(self, stamp):
        """Whether the write stamped ``stamp`` is pending and its step counted."""
        if stamp < 0:
            return False
        with self._lock:
            return self._verdicts.get(stamp >> 1, bool(stamp & 1))
