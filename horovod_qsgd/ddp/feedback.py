"""The DDP hooks' error-feedback store: what a bucket's steps did not send, kept so that DDP may rebuild its buckets.

Residuals are kept **per parameter** (keyed by the order the hooks first met the parameters), because DDP
rebuilds its buckets after the first iteration and a checkpoint may be loaded into other buckets. A step
reads and writes them **per bucket**: the bucket's parameters' residuals staged in one
:class:`~horovod_qsgd.torch_shared.feedback.KeptResidual` (two buffers, so that a step whose result is not finite
keeps nothing), which the parameters' residuals then view, so the next step of the same bucket gathers nothing.

Besides: an owner's residual of its chunk of the two stages' sum, and the node-aware exchange's residual of
this rank's node-summed shard (and its owner residual), each kept for one bucket layout and range. When the
bucket or the exchange changes they are *spilled*: added where they overlap each parameter, into mass the
parameter's next step sends. On a GPU the verdict whether a step counted stays on the device (its stamps);
anything but a step that reads or changes a residual first settles them on the host.
"""
import threading

import torch

from horovod_qsgd.common.errors import residual_length_mismatch
from horovod_qsgd.torch_shared.feedback import KeptResidual, step_stamps


class BucketFeedback:
    """The residuals of every parameter and bucket of one hook state, and the rules that move them."""

    def __init__(self):
        self._lock = threading.Lock()
        self._residuals = {}        # key -> flat float32 residual
        self._bucket_residuals = {}  # bucket index -> KeptResidual whose views the residuals of its parameters are
        self._bucket_layouts = {}   # bucket index -> the layout its KeptResidual was staged for
        # bucket index -> [stamps, steps started]: a GPU's verdicts, stamped by the pass that scales a bucket's
        # result and read by its next step's kernels (the node-aware exchange decides on the host)
        self._verdicts = {}
        # buckets whose step started since steps_over(): their stamps are being written (a Gloo thread, a GPU
        # stream) and the iteration's verdict is not made; the host reads or resets none of them
        self._started = set()
        self._spilled = {}          # key -> owner-residual mass moved here, added at the parameter's next read
        self._held = {}             # key -> the residual of a parameter no gradient reached, until one does
        self._owner_residuals = {}  # bucket index -> _OwnerResidual
        self._shard_residuals = {}  # node-aware: bucket index -> _OwnerResidual of this rank's node-summed shard

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self):
        """{residuals: by parameter key (spilled mass included), owner_residuals, shard_residuals: by bucket}."""
        with self._lock:
            self._started.clear()  # between iterations
            self._settle_on_host()
            residuals = {key: r.clone() for key, r in self._residuals.items()}
            for key, spilled in [*self._spilled.items(), *self._held.items()]:  # maybe nothing else kept
                residuals[key] = residuals[key] + spilled if key in residuals else spilled.clone()
            return dict(residuals=residuals,
                        owner_residuals={index: o.as_dict() for index, o in self._owner_residuals.items()},
                        shard_residuals={index: o.as_dict() for index, o in self._shard_residuals.items()})

    def load_state_dict(self, state):
        with self._lock:
            self._residuals = {int(key): r.clone() for key, r in state["residuals"].items()}
            self._bucket_residuals, self._bucket_layouts, self._verdicts, self._started = {}, {}, {}, set()
            self._spilled, self._held = {}, {}
            self._owner_residuals = {int(index): _OwnerResidual.from_dict(o)
                                     for index, o in state["owner_residuals"].items()}
            self._shard_residuals = {int(index): _OwnerResidual.from_dict(o)
                                     for index, o in state.get("shard_residuals", {}).items()}

    def rescale(self, factor):
        """Multiplies every residual by ``factor``: each bucket's staged buffers (both, where a GPU's stamps
        decide which holds it), with the parameters' residuals that view them, then every other residual and
        spilled mass once."""
        with self._lock:
            staged = set()
            for kept in self._bucket_residuals.values():
                kept.scale(factor)
                staged.add(kept.kept.untyped_storage().data_ptr())
            for residual in self._residuals.values():
                if residual.untyped_storage().data_ptr() not in staged:
                    residual.mul_(factor)
            for spilled in [*self._spilled.values(), *self._held.values()]:
                spilled.mul_(factor)
            for store in (self._owner_residuals, self._shard_residuals):
                for owner in store.values():
                    owner.scale(factor)

    # -- a bucket's step --------------------------------------------------------------------
    def steps_over(self):
        """Every bucket step started so far has finished (an iteration's first bucket: DDP waited for the last
        iteration's): the host may settle any bucket again."""
        with self._lock:
            self._started.clear()

    def step_stamps(self, index, device):
        """(bucket ``index``'s stamps on a GPU, or None on the CPU where the host decides; the stamp of its step
        starting now): taken after anything that settles the residuals on the host, before the step's kernels."""
        with self._lock:
            verdict = self._verdicts.get(index)
            if verdict is None or verdict[0].device != device:
                stamps = step_stamps(device)
                if stamps is None:
                    return None, 0
                self._settle_on_host()
                verdict = self._verdicts[index] = [stamps, 0]
            verdict[1] += 1
            self._started.add(index)
            return verdict[0], verdict[1] - 1

    def residual(self, index, layout, staged_numel, device):
        """(what bucket ``index``'s step reads its staged residual through and writes the new one into, a
        :class:`~horovod_qsgd.kernels.CarriedResidual`; the step's stamps and stamp): the bucket's own buffers
        while its parameters' residuals are still views of them, else gathered from them into new ones (the
        first step, a rebuilt bucket, spilled mass, a loaded checkpoint), which they then view."""
        with self._lock:
            kept = self._bucket_residuals.get(index)
            if kept is None or not self._views_of(kept.kept, layout, staged_numel, device):
                self._settle_on_host()
                kept = self._gathered_residual(index, layout, staged_numel, device)
        stamps, stamp = self.step_stamps(index, device)
        return kept.for_step(stamps, stamp), stamps, stamp

    def keep_residual(self, index, written):
        """Bucket ``index``'s step that wrote through ``written`` counts: its residual is kept, and its
        parameters' residuals are views of it."""
        with self._lock:
            self._bucket_residuals[index].keep(written)
            self._view_parameters(index)

    def owner_residual(self, index, layout, owned, device, stamps=None, stamp=0):
        """What the step reads the owner residual of bucket ``index``'s staged range ``owned`` through, and
        writes the new one into (zeros at first; with the step's ``stamps`` and ``stamp`` on a GPU)."""
        return self._kept_residual(self._owner_residuals, index, layout, owned, device, stamps, stamp)

    def shard_residual(self, index, layout, owned, device):
        """The node-aware exchange's :meth:`owner_residual`: of this rank's node-summed shard ``owned``."""
        return self._kept_residual(self._shard_residuals, index, layout, owned, device)

    def keep_owner_residual(self, index, written):
        with self._lock:
            self._owner_residuals[index].keep(written)

    def keep_shard_residual(self, index, written):
        with self._lock:
            self._shard_residuals[index].keep(written)

    def spill_stale_owner_residual(self, index, layout, plan):
        """Moves the owner residual of bucket ``index`` into its parameters' residuals unless this call's bucket
        (``layout``; ``plan`` None when it passes through, or an engine plan) is the one it was kept for. Done
        before the bucket's first stage reads any residual, so the mass is sent by the next read of each
        parameter. A bucket that passes through spills a node-aware shard residual too."""
        with self._lock:
            saved = self._owner_residuals.get(index)
            stale = []
            if saved is not None and not (plan is not None and saved.fits(layout, plan.owned)):
                stale.append(self._owner_residuals)
            if plan is None and index in self._shard_residuals:
                stale.append(self._shard_residuals)
            self._spill(index, *stale)

    def spill_owner_residual(self, index):
        """Moves the owner residual of bucket ``index``, if any, into its parameters' residuals (the node-aware
        exchange, where this rank's shard no longer takes the two stages it was kept for)."""
        with self._lock:
            if index in self._owner_residuals:
                self._spill(index, self._owner_residuals)

    def hold_back(self, keys, unused):
        """Before a bucket's step (its compressed parameters' ``keys``): the residuals of the parameters
        ``unused`` (no gradient reached them on this rank: DDP's ``find_unused_parameters``) sit the step out,
        and those of parameters that sat out earlier and have a gradient again join their step. DDP leaves a
        parameter that no rank used without a result, so what the step sent of its residual would be lost."""
        with self._lock:
            leaving = [key for key in unused if key in self._residuals or key in self._spilled]
            returning = [key for key in keys if key not in unused and key in self._held]
            if not leaving and not returning:
                return
            self._settle_on_host()
            for key in returning:
                held = self._held.pop(key)
                self._spilled[key] = self._spilled[key] + held if key in self._spilled else held
            for key in leaving:  # the bucket's next step gathers zeros where the residual's view was
                parts = [p for p in (self._residuals.pop(key, None), self._spilled.pop(key, None),
                                     self._held.pop(key, None)) if p is not None]
                self._held[key] = sum(parts[1:], parts[0].clone())

    def take_parameter_residuals(self, layout, staged_numel, device):
        """The node-aware exchange keeps error feedback per shard: residuals left per parameter (spilled by a
        rebuild) join this rank's gradient once, staged (None if there are none); (staged, restore)."""
        with self._lock:
            self._settle_on_host()
            taken = {key: (self._residuals.pop(key, None), self._spilled.pop(key, None)) for key, _, _ in layout}
        taken = {key: pair for key, pair in taken.items() if pair != (None, None)}
        if not taken:
            return None, None
        staged = torch.zeros(staged_numel, dtype=torch.float32, device=device)
        for key, offset, numel in layout:
            for part in taken.get(key, ()):
                if part is not None:
                    staged[offset:offset + numel] += part.to(device)

        def restore():  # a step whose result is not finite keeps nothing of it
            with self._lock:
                for key, (residual, spilled) in taken.items():
                    for store, part in ((self._residuals, residual), (self._spilled, spilled)):
                        if part is not None:
                            store[key] = part
        return staged, restore

    # -- under the lock ---------------------------------------------------------------------
    def _settle_on_host(self):
        """Every bucket's residuals in ``kept`` as their stamps say (one host read per bucket), its parameters'
        residuals views of them, the stamps reset: before anything but a step reads or changes them. Not the
        buckets of the iteration under way: their stamps may not be written yet (a reset would lose them) or
        say only their own result (the iteration's verdict comes at its end), and nothing read here is theirs
        (DDP's buckets of one iteration hold disjoint parameters)."""
        for index, (stamps, _) in self._verdicts.items():
            if index in self._started:
                continue
            read = stamps.cpu()
            for kept in (self._bucket_residuals.get(index), self._owner_residuals.get(index)):
                if kept is not None:
                    kept.settle_on_host(read)
            if index in self._bucket_residuals:
                self._view_parameters(index)
            stamps.zero_()

    def _view_parameters(self, index):
        kept = self._bucket_residuals[index].kept
        for key, offset, numel in self._bucket_layouts[index]:
            self._residuals[key] = kept[offset:offset + numel]

    def _gathered_residual(self, index, layout, staged_numel, device):
        """Bucket ``index``'s residual gathered from its parameters' (created where missing), as a new
        KeptResidual that they view."""
        staged = torch.zeros(staged_numel, dtype=torch.float32, device=device)
        for key, offset, numel in layout:
            residual = self._residuals.get(key)
            if residual is None:
                residual = self._residuals[key] = torch.zeros(numel, dtype=torch.float32, device=device)
            elif residual.numel() != numel:
                raise residual_length_mismatch(f"parameter {key} (in the order DDP's buckets first held them)",
                                               numel, residual.numel(), "or the parameters' order changed")
            if key in self._spilled:
                residual = self._residuals[key] = residual + self._spilled.pop(key).to(residual.device)
            staged[offset:offset + numel] = residual
        kept = self._bucket_residuals[index] = KeptResidual(staged)
        self._bucket_layouts[index] = list(layout)
        self._view_parameters(index)
        return kept

    def _views_of(self, staged, layout, staged_numel, device):
        """True where every parameter of ``layout`` has a residual that is the view of ``staged`` at its offset,
        with no spilled mass waiting."""
        if staged.numel() != staged_numel or staged.device != device:
            return False
        base, size = staged.data_ptr(), staged.element_size()
        for key, offset, numel in layout:
            residual = self._residuals.get(key)
            if (residual is None or key in self._spilled or residual.data_ptr() != base + offset * size
                    or residual.numel() != numel):
                return False
        return True

    def _kept_residual(self, store, index, layout, owned, device, stamps=None, stamp=0):
        """What ``store`` (owner or shard residuals) keeps of bucket ``index`` for staged range ``owned``, for a
        step; one kept for another layout or range (DDP rebuilt the bucket, the exchange changed) is spilled into
        its parameters' residuals first."""
        with self._lock:
            saved = store.get(index)
            if saved is not None and not saved.fits(layout, owned):
                self._spill(index, store)
                saved = None
            if saved is None:
                saved = store[index] = _OwnerResidual(
                    layout, owned, torch.zeros(owned[1] - owned[0], dtype=torch.float32, device=device))
            return saved.for_step(device, stamps, stamp)

    def _spill(self, index, *stores):
        """Moves what each of ``stores`` keeps of bucket ``index`` into its parameters' residuals (one settling
        on the host for all)."""
        if stores:
            self._settle_on_host()
        for store in stores:
            store.pop(index).spill(self._spilled, self._residuals)


class _OwnerResidual:
    """What an owner did not send of its chunk ``owned`` of a bucket laid out as ``layout``."""

    def __init__(self, layout, owned, residual):
        self.layout, self.owned, self._kept = [tuple(p) for p in layout], tuple(owned), KeptResidual(residual)

    @property
    def residual(self):
        return self._kept.kept

    def for_step(self, device, stamps=None, stamp=0):
        """What a step reads this residual through and writes the new one into."""
        return self._kept.to(device).for_step(stamps, stamp)

    def keep(self, written):
        """The step that wrote through ``written`` counts."""
        self._kept.keep(written)

    def settle_on_host(self, stamps):
        self._kept.settle_on_host(stamps)

    def scale(self, factor):
        self._kept.scale(factor)

    def fits(self, layout, owned):
        """Whether it was kept for this bucket ``layout`` and staged range ``owned`` (None: no owned range)."""
        return owned is not None and self.layout == [tuple(p) for p in layout] and self.owned == tuple(owned)

    def spill(self, spilled, residuals):
        """Adds this residual, where it overlaps each parameter, to ``spilled[key]`` (created like
        ``residuals[key]``): the parameter's next first stage sends it."""
        begin, end = self.owned
        for key, offset, numel in self.layout:
            lo, hi = max(begin, offset), min(end, offset + numel)
            if lo < hi:
                target = spilled.get(key)
                if target is None:
                    like = residuals.get(key)
                    target = spilled[key] = torch.zeros(numel, dtype=torch.float32, device=(
                        self.residual.device if like is None else like.device))
                target[lo - offset:hi - offset] += self.residual[lo - begin:hi - begin].to(target.device)

    def as_dict(self):
        return {"layout": [list(p) for p in self.layout], "owned": list(self.owned), "residual": self.residual.clone()}

    @classmethod
    def from_dict(cls, saved):
        return cls(saved["layout"], saved["owned"], saved["residual"].clone())
