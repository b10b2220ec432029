"""DiLoCo's outer loop in torch tensors, whatever carries its exchange (Horovod or torch.distributed).

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models" (arXiv 2311.08105).
Every rank keeps the *anchor* :math:`\\theta` (the model as of the last synchronization, the same on every
rank) and trains its own copy :math:`x_i` with the wrapped (inner) optimizer for ``H`` steps. Then the ranks
average the *pseudo-gradients* :math:`\\Delta_i = \\theta - x_i` through the adapter's exchange (compressed or
not) and take one outer step of Nesterov SGD on the anchor:

.. math::
    \\Delta = \\tfrac{1}{N} \\textstyle\\sum_i \\Delta_i, \\quad
    m \\leftarrow \\mu m + \\Delta, \\quad
    \\theta \\leftarrow \\theta - \\eta (\\Delta + \\mu m), \\quad
    x_i \\leftarrow \\theta.

The adapter gives this loop two callables: ``exchange(tensors, purpose)`` averages a list of float32 tensors
over the ranks (``purpose`` is ``"outer"``, ``"gradients"`` or ``"models"``; the adapter names its collectives
by it, and averages ``"models"``, the parameters themselves, in full precision whatever the compressor;
``"node"``: over the ranks of this rank's node only, exactly, the same bits on each, where the loop is
hierarchical), and
``check(record, name)`` refuses on every rank a record that differs between ranks. Everything
the next step depends on (anchor, momentum, counters) is in :meth:`OuterLoop.state`.
"""
import json
import math
import zlib

import torch

STATE_FORMAT = 1
# a checkpoint of an older version did not name them
SETTINGS_BEFORE_THEY_WERE_SAVED = {"hierarchical": False, "fragments": 1}
# Synchronous steps before the first local one. Without them the byte-level language model of
# benchmarks/results/diloco/ ended 0.07-0.45 nats behind per-step AdamW at 2 ranks (800 steps, H 8-32, its
# early local models drifting apart on an edge-of-stability learning rate); with 40 still +0.033, with 80
# within 0.01. Longer trainings of larger models warm up longer (DiLoCo's paper: from a pretrained model).
DEFAULT_WARMUP_STEPS = 80
# The outer Nesterov momentum. On the same model (1600 steps, warm-up 80, H=16): at 2 ranks 0.8 ended as 0.5
# did (QSGD-4, 3 seeds); at 4 ranks it closed most of the gap 0.5 left (QSGD-4 +0.048 against +0.078, QSGD-2
# +0.018 against +0.053). DiLoCo's paper: 0.9 with 8 workers from a pretrained model.
DEFAULT_OUTER_MOMENTUM = 0.8
# The outer learning rate from sync_every = FULL_OUTER_LR_FROM on (DiLoCo's), with two workers. Below it the
# default falls in proportion to sync_every, not under 1 - outer_momentum (then the outer step moves the anchor
# as far as the ranks' average moved, as model averaging): pseudo-gradients of a few local steps point alike
# from one outer step to the next, and Nesterov momentum then multiplies each by up to
# outer_lr / (1 - outer_momentum) = 3.5. On the same model (2 ranks, 1600 steps, QSGD-4, momentum 0.8, seed 0):
# H=8 +0.062 nats at 0.7, +0.000 at 0.35; H=4 +0.244 at 0.7, +0.025 at 0.2; H=16 +0.023 at 0.7, +0.034 at 0.35.
# More workers want more: the fall is sqrt(workers / 2) times slower, a fit to QSGD-2 at 1600 steps (H=8: at
# 4 ranks 0.495 beat 0.35 by 0.005 +- 0.002 nats over 3 seeds, 0.7 0.018 worse on seed 0; at 8 ranks 0.7 beat
# 0.35 by 0.012 +- 0.006; H=4 at 8 ranks: 0.35 beat 0.2 by 0.041 +- 0.001; 2 seeds each). A guess at why,
# not measured: the average of more workers' drifts, each on a smaller share of the batch, is shorter than the
# distance a synchronous run would have moved.
DEFAULT_OUTER_LR = 0.7
FULL_OUTER_LR_FROM = 16
FULL_OUTER_LR_WORKERS = 2


def default_outer_lr(sync_every, outer_momentum, workers=FULL_OUTER_LR_WORKERS):
    """``outer_lr=None``'s value for ``workers`` models in the outer average (ranks, or nodes where
    hierarchical): DiLoCo's 0.7 from ``sync_every * sqrt(workers / 2)`` = 16 on, in proportion below it, at least
    ``1 - outer_momentum``. One worker (a one-rank job, not measured) counts as two."""
    workers = max(workers, FULL_OUTER_LR_WORKERS)
    scale = sync_every / FULL_OUTER_LR_FROM * math.sqrt(workers / FULL_OUTER_LR_WORKERS)
    return round(max(1.0 - outer_momentum, DEFAULT_OUTER_LR * min(1.0, scale)), 6)


def needs_nodes(why_not):
    """The ValueError of hierarchical=True in a job without usable nodes (``why_not``), raised on every rank."""
    return ValueError("horovod_qsgd: DiLoCo(hierarchical=True) averages every step inside each node and runs the "
                      "outer exchange between nodes, so it needs several nodes of equal size, more than one rank "
                      f"each, but this job: {why_not}; use hierarchical=False")


START_ALIKE = ("DiLoCo: every rank must also start from the same model ({broadcast} before the first step) and, "
               "when resuming, load its own checkpoint of the same step.")


def check_arguments(sync_every, outer_lr, outer_momentum, warmup_steps, fragments=1):
    """Raises ValueError naming a bad argument (the same on every rank: no collective has run); ``outer_lr``
    None is the default's."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"horovod_qsgd: DiLoCo: sync_every={sync_every!r} must be an integer >= 1 "
                         "(local steps between two outer steps; 1 averages after every step)")
    if outer_lr is not None and (not isinstance(outer_lr, (int, float)) or isinstance(outer_lr, bool)
                                 or not 0 < outer_lr <= 2):
        raise ValueError(f"horovod_qsgd: DiLoCo: outer_lr={outer_lr!r} must be a number in (0, 2]; 1 with "
                         "outer_momentum=0 is plain model averaging")
    if not isinstance(outer_momentum, (int, float)) or isinstance(outer_momentum, bool) or not 0 <= outer_momentum < 1:
        raise ValueError(f"horovod_qsgd: DiLoCo: outer_momentum={outer_momentum!r} must be a number in [0, 1)")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"horovod_qsgd: DiLoCo: warmup_steps={warmup_steps!r} must be an integer >= 0")
    if isinstance(fragments, bool) or not isinstance(fragments, int) or not 1 <= fragments <= sync_every:
        raise ValueError(f"horovod_qsgd: DiLoCo: fragments={fragments!r} must be an integer from 1 to sync_every "
                         f"({sync_every}): each fragment synchronizes once every sync_every steps, at its own step")


def check_warmup_compression(compression, warmup_compression):
    """Refuses one compressor instance for both the outer exchange and the warm-up: each keeps its own residuals
    and step counters (Horovod's own none / fp16, classes without state, may serve both)."""
    if warmup_compression is not None and warmup_compression is compression and not isinstance(compression, type):
        raise ValueError("horovod_qsgd: DiLoCo: warmup_compression is the outer compressor itself; pass a new "
                         "instance (each keeps its own residuals), or leave it None to warm up through compression")


def named_parameters_of(optimizer, named_parameters, who, keep_unstepped=False):
    """[(name, parameter)] of every parameter ``optimizer`` steps, in ``named_parameters``' order (names from
    ``model.named_parameters()``, or ``param.<i>`` where None); ``keep_unstepped``: the named parameters the
    optimizer does not step too. ``who`` names the caller in errors."""
    in_optimizer = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        return [(f"param.{i}", p) for i, p in enumerate(in_optimizer)]
    named_parameters = list(named_parameters)
    names = [n for n, _ in named_parameters]
    if len(set(names)) != len(names):
        raise ValueError(f"horovod_qsgd: {who}: named_parameters has duplicate names")
    named_ids = {id(p) for _, p in named_parameters}
    missing = [p for p in in_optimizer if id(p) not in named_ids]
    if missing:
        raise ValueError(f"horovod_qsgd: {who}: {len(missing)} of the optimizer's parameters are not in "
                         "named_parameters; pass model.named_parameters() or the model itself.")
    if keep_unstepped:
        return named_parameters
    stepped = {id(p) for p in in_optimizer}
    return [(n, p) for n, p in named_parameters if id(p) in stepped]


def manifest_digest(named_parameters):
    """CRC-32 of the parameters' names, shapes and dtypes: equal on every rank that built the same model."""
    manifest = [(n, list(p.shape), str(p.dtype)) for n, p in named_parameters]
    return zlib.crc32(json.dumps(manifest).encode())


def _digest(tensors):
    """CRC-32 of the tensors' bytes: equal on every rank exactly when the tensors are."""
    crc = 0
    for t in tensors:
        crc = zlib.crc32(t.detach().float().contiguous().cpu().numpy().tobytes(), crc)
    return crc


def fragment_bounds(numels, count):
    """[(begin, end)]: ``count`` runs of consecutive parameters (``numels``: their sizes), none empty, each
    ending where the running total comes nearest to its share of the whole."""
    if count > len(numels):
        raise ValueError(f"horovod_qsgd: DiLoCo: fragments={count}, but the model has {len(numels)} parameter "
                         f"tensor(s) and a fragment takes whole ones: use fragments <= {len(numels)}")
    running = [0]
    for numel in numels:
        running.append(running[-1] + numel)
    ends = []
    for k in range(1, count):
        first, last = (ends[-1] if ends else 0) + 1, len(numels) - (count - k)
        share = running[-1] * k / count
        ends.append(min(range(first, last + 1), key=lambda i: abs(running[i] - share)))
    starts = [0] + ends
    return list(zip(starts, ends + [len(numels)]))


def check_fragments(named_parameters, fragments):
    """Raises ValueError where the model has fewer parameter tensors than ``fragments`` (before any collective)."""
    fragment_bounds([p.numel() for _, p in named_parameters], fragments)


class OuterLoop:
    """The anchor, the outer momentum, the step counters and the schedule of one DiLoCo optimizer.

    ``named_parameters``: [(name, parameter)] in a fixed order (the order of the exchange's tensors).
    ``fragments``: streaming DiLoCo's fragments, runs of consecutive parameters of near equal size; fragment f
    synchronizes when the local steps since the warm-up are ``(f + 1) * sync_every // fragments`` modulo
    ``sync_every``, so the last one keeps whole DiLoCo's schedule. ``workers``: the models the outer exchange
    averages (the ranks; the nodes where hierarchical), for ``outer_lr=None``'s value.
    """

    def __init__(self, named_parameters, sync_every, outer_lr, outer_momentum, nesterov, warmup_steps,
                 exchange, check, exchange_settings, hierarchical=False, fragments=1,
                 workers=FULL_OUTER_LR_WORKERS):
        self.params = [p for _, p in named_parameters]
        self.fragments = fragment_bounds([p.numel() for p in self.params], fragments)
        self.fragment_offsets = [(f + 1) * sync_every // fragments % sync_every for f in range(fragments)]
        self.manifest_digest = manifest_digest(named_parameters)
        if outer_lr is None:
            outer_lr = default_outer_lr(sync_every, outer_momentum, workers)
        self.sync_every, self.outer_lr, self.outer_momentum = sync_every, float(outer_lr), float(outer_momentum)
        self.nesterov, self.warmup_steps, self.hierarchical = bool(nesterov), warmup_steps, bool(hierarchical)
        self.exchange, self.check, self.exchange_settings = exchange, check, exchange_settings
        self.steps = 0              # step() calls, skipped ones included: the ranks advance it together
        self.outer_steps = 0        # outer steps taken (or skipped as non-finite), a fragment's each
        self.anchor = None          # float32 copies of the parameters at the last synchronization
        self.momentum = None
        self.averaged_at = None     # self.steps at the last average_models() that sent: in sync until a step
        self.verified = False
        self.counts = dict.fromkeys(("inner_steps", "inner_steps_skipped", "warmup_steps", "outer_steps",
                                     "outer_steps_skipped", "models_averaged", "values_exchanged",
                                     "values_exchanged_in_full", "values_averaged_in_node"), 0)

    # -- settings -----------------------------------------------------------------------------
    def settings(self):
        return {"sync_every": self.sync_every, "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum,
                "nesterov": self.nesterov, "warmup_steps": self.warmup_steps, "hierarchical": self.hierarchical,
                "fragments": len(self.fragments),
                "model": f"{len(self.params)} tensors, digest {self.manifest_digest:08x}",
                "exchange": self.exchange_settings}

    def handshake(self):
        """Once per process, at the first step: every rank compares every rank's settings, counters and model
        (the anchor, or the parameters before the first anchor); a difference is refused on every rank."""
        if self.verified:
            return
        model = self.anchor if self.anchor is not None else self.params
        self.check(dict(self.settings(), steps=self.steps, outer_steps=self.outer_steps,
                        model_digest=f"{_digest(model):08x}"), "handshake")
        self.verified = True

    @property
    def in_warmup(self):
        return self.steps < self.warmup_steps

    # -- the steps --------------------------------------------------------------------------------
    def average_gradients(self):
        """A warm-up step: every parameter's gradient replaced by its average over the ranks (through the
        exchange). Returns whether every averaged gradient is finite (alike on every rank)."""
        with_grad = [p for p in self.params if p.grad is not None]
        averaged = self.exchange([p.grad.detach().float() for p in with_grad], "gradients")
        self.counts["values_exchanged"] += sum(a.numel() for a in averaged)
        with torch.no_grad():
            for p, a in zip(with_grad, averaged):
                p.grad.copy_(a.view_as(p.grad))
        return _all_finite(averaged)

    def average_in_node(self):
        """A local step of a hierarchical loop: every parameter's gradient (zeros where it has none, as
        ``hvd.DistributedOptimizer`` sends them) replaced by its exact average over the node's ranks, so that
        they stay one model. Returns whether every average is finite (alike on the node's ranks)."""
        grads = [p.grad.detach().float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
                 for p in self.params]
        averaged = self.exchange(grads, "node")
        self.counts["values_averaged_in_node"] += sum(a.numel() for a in averaged)
        with torch.no_grad():
            for p, a in zip(self.params, averaged):
                if p.grad is None:
                    p.grad = a.view_as(p).to(p.dtype)
                else:
                    p.grad.copy_(a.view_as(p.grad))
        return _all_finite(averaged)

    def before_local_step(self):
        """The first local step after construction or the warm-up takes the anchor."""
        if self.anchor is None:
            self.anchor = [p.detach().float().clone() for p in self.params]
            self.momentum = [torch.zeros_like(a) for a in self.anchor]

    def after_step(self, took_inner_step, warmup):
        """Counts the step; every ``sync_every`` steps after the warm-up, the outer step. Every rank calls it
        once per ``step()``, skipped steps included, so that every rank reaches the outer step together."""
        self.steps += 1
        self.counts["inner_steps" if took_inner_step else "inner_steps_skipped"] += 1
        if warmup:
            self.counts["warmup_steps"] += 1
        else:
            for fragment in self._fragments_due():
                self.outer_step(fragment)

    def _fragments_due(self):
        """The fragments whose outer step is at this step count (one where the count is a fragment's turn)."""
        phase = (self.steps - self.warmup_steps) % self.sync_every
        return [f for f, offset in enumerate(self.fragment_offsets) if offset == phase]

    def outer_step(self, fragment=0):
        """The outer step of one fragment (the whole model where there is one): its pseudo-gradient averaged,
        Nesterov on its anchor, its parameters set to it. Each fragment has its own exchange (``outer``, or
        ``outer.fragment<f>``), whose codec keeps its own residuals and step counter."""
        begin, end = self.fragments[fragment]
        anchor, momentum, params = self.anchor[begin:end], self.momentum[begin:end], self.params[begin:end]
        pseudo = [a - p.detach().float() for a, p in zip(anchor, params)]
        purpose = "outer" if len(self.fragments) == 1 else f"outer.fragment{fragment}"
        averaged = self.exchange(pseudo, purpose)
        self.counts["values_exchanged"] += sum(a.numel() for a in averaged)
        self.outer_steps += 1
        if _all_finite(averaged):  # else: the interval's local progress is dropped on every rank
            # One rounding per operation, no fused multiply-add (torch's alpha= may fuse): a reference written
            # with numpy float32 operations gets the same bits.
            mu = self.outer_momentum
            torch._foreach_mul_(momentum, mu)
            torch._foreach_add_(momentum, averaged)
            if self.nesterov:
                update = torch._foreach_mul(momentum, mu)
                torch._foreach_add_(update, averaged)
                torch._foreach_mul_(update, self.outer_lr)
            else:
                update = torch._foreach_mul(momentum, self.outer_lr)
            torch._foreach_sub_(anchor, update)
            self.counts["outer_steps"] += 1
        else:
            self.counts["outer_steps_skipped"] += 1
        self._write_parameters(anchor, params)

    def _write_parameters(self, values, params=None):
        with torch.no_grad():
            for p, value in zip(self.params if params is None else params, values):
                p.copy_(value.view_as(p))

    @property
    def in_sync(self):
        """True where every rank holds the same parameters: in the warm-up (no anchor yet: each step averaged the
        gradients), or with no local step since the last outer step of the whole model (one fragment) or the
        last average_models()."""
        at_outer_step = len(self.fragments) == 1 and bool(self._fragments_due())
        return self.anchor is None or at_outer_step or self.averaged_at == self.steps

    def average_models(self):
        """Every rank's parameters replaced by their exact average (full precision; nothing to send where the
        ranks are in sync). The anchor and the outer momentum stay: the next outer step goes on from them."""
        if self.in_sync:
            return
        averaged = self.exchange([p.detach().float() for p in self.params], "models")
        numel = sum(a.numel() for a in averaged)
        self.counts["values_exchanged"] += numel
        self.counts["values_exchanged_in_full"] += numel
        self.counts["models_averaged"] += 1
        self._write_parameters(averaged)
        self.averaged_at = self.steps

    # -- checkpoints -------------------------------------------------------------------------------
    def state(self):
        return {"format": STATE_FORMAT, "settings": self.settings(), "steps": self.steps,
                "outer_steps": self.outer_steps,
                "anchor": None if self.anchor is None else [a.clone() for a in self.anchor],
                "momentum": None if self.momentum is None else [m.clone() for m in self.momentum]}

    def check_state(self, state):
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError("horovod_qsgd: DiLoCo: the checkpoint's 'diloco' entry is not a DiLoCo state of this "
                             f"version (format {STATE_FORMAT}); save it with this version's state_dict()")
        mine = self.settings()
        recorded = dict(SETTINGS_BEFORE_THEY_WERE_SAVED, **state["settings"])
        differ = {k: (recorded.get(k), v) for k, v in mine.items() if recorded.get(k) != v}
        if differ:
            raise ValueError("horovod_qsgd: DiLoCo: the checkpoint was saved with other settings: " + ", ".join(
                f"{k}={saved!r} there, {now!r} here" for k, (saved, now) in differ.items()) +
                "; build the optimizer as it was built for the checkpoint")

    def load(self, state):
        self.steps, self.outer_steps = int(state["steps"]), int(state["outer_steps"])
        device = self.params[0].device if self.params else None
        self.anchor = None if state["anchor"] is None else [a.to(device).clone() for a in state["anchor"]]
        self.momentum = None if state["momentum"] is None else [m.to(device).clone() for m in state["momentum"]]
        self.averaged_at = None  # the parameters loaded with this state may differ between ranks
        self.verified = False  # the loaded counters and anchor are compared across ranks at the next step


class DiLoCoMixin:
    """Methods DiLoCo adds to a torch optimizer class (:func:`horovod_qsgd.torch.DiLoCo`,
    :func:`horovod_qsgd.ddp.DiLoCo`); each adapter's subclass says what its exchange sent and keeps.

    ``isinstance(optimizer, DiLoCoMixin)`` tells a DiLoCo optimizer apart.
    """

    # torch.amp.GradScaler calls step() on every step, overflowed or not, with ``grad_scale`` and ``found_inf``
    # set: a step skipped on one rank still counts there, so that every rank reaches the outer step together.
    _step_supports_amp_scaling = True

    def step(self, closure=None):
        """One step of the wrapped optimizer (a warm-up step averages the gradients first); every ``sync_every``
        steps after the warm-up, the outer step (a collective: every rank calls ``step()`` equally often)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        loop = self._diloco
        loop.handshake()
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        if grad_scale is not None:  # GradScaler's scale, this rank's own: gradients leave it before any exchange
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            torch._foreach_mul_(grads, grad_scale.double().reciprocal().float())
        warmup = loop.in_warmup
        if warmup:
            take = loop.average_gradients()  # non-finite on one rank: non-finite on every rank
        else:
            loop.before_local_step()
            if loop.hierarchical:  # a rank's overflow is in its node's average: the node skips together
                take = loop.average_in_node()
            else:
                take = found_inf is None or not bool(found_inf.item())
        if take:
            if grad_scale is not None or found_inf is not None:
                self.grad_scale = self.found_inf = None  # handled here; torch's own optimizers refuse them
                try:
                    super().step()
                finally:
                    self.grad_scale, self.found_inf = grad_scale, found_inf
            else:
                super().step()
        loop.after_step(take, warmup)
        return loss

    def average_models(self):
        """Replaces every rank's parameters by their average over the ranks (a collective: call it on every rank).

        At a synchronization (``step()`` calls a multiple of ``sync_every`` after the warm-up) every rank
        already holds the same parameters and nothing is sent; elsewhere it is one full-precision allreduce
        of the parameters. The anchor and the outer momentum stay, so training may go on after it. Use it
        before evaluating or saving the model.
        """
        self._diloco.average_models()

    @property
    def outer_steps(self):
        """Outer steps taken so far (non-finite ones included)."""
        return self._diloco.outer_steps

    def compression_stats(self, reset=False):
        """Counters since the last reset, for a logger.

        ``inner_steps`` / ``inner_steps_skipped`` (a loss scaler's overflow), ``warmup_steps`` (of those, the
        synchronous ones), ``outer_steps`` / ``outer_steps_skipped`` (a non-finite average: the interval's
        local progress dropped on every rank), ``models_averaged`` (:meth:`average_models` calls that sent),
        ``values_exchanged``: float32 values averaged (gradients, pseudo-gradients, models; of those
        ``values_exchanged_in_full`` by :meth:`average_models`, never compressed), ``values_averaged_in_node``
        (hierarchical: every local step's gradients, inside the node);
        ``bytes_uncompressed``: 4 bytes each. The compressor's own counters (``bytes_sent``,
        ``compression_ratio``, ...) come with them where it keeps any; without compression ``bytes_sent``
        is ``bytes_uncompressed``.
        """
        counts = dict(self._diloco.counts)
        stats = dict(counts, **self._diloco_exchange_stats(counts, reset))
        stats["bytes_uncompressed"] = 4 * counts["values_exchanged"]  # the loop's, not a compressor's own count
        sent = stats["bytes_sent"]
        stats["compression_ratio"] = stats["bytes_uncompressed"] / sent if sent else float("nan")
        if reset:
            self._diloco.counts = dict.fromkeys(counts, 0)
        return stats

    def state_dict(self):
        """The wrapped optimizer's state plus ``"diloco"``: the step counters, the anchor, the outer momentum,
        the settings and the compressor's state (its residuals and step counters).

        Between two outer steps the parameters and the inner optimizers' states differ between ranks: save
        every rank's (``torch.save(optimizer.state_dict(), f"opt.{rank}.pt")``, and its model) to resume
        bit-identically.
        """
        state = super().state_dict()
        state["diloco"] = dict(self._diloco.state(), compression=self._diloco_exchange_state())
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        diloco = state_dict.pop("diloco", None)
        if diloco is not None:
            self._diloco.check_state(diloco)  # before anything is loaded
        super().load_state_dict(state_dict)
        if diloco is not None:
            self._diloco.load(diloco)
            if diloco.get("compression") is not None:
                self._diloco_load_exchange_state(diloco["compression"])

    # -- what each adapter says of its exchange ---------------------------------------------------------
    def _diloco_exchange_stats(self, counts, reset):
        """``bytes_sent`` and the compressor's own counters since the last reset."""
        raise NotImplementedError

    def _diloco_exchange_state(self):
        """What the exchange's checkpoint holds (residuals, step counters), or None."""
        raise NotImplementedError

    def _diloco_load_exchange_state(self, state):
        raise NotImplementedError


def wrap_optimizer(optimizer, mixin, **attributes):
    """An instance of a subclass of ``optimizer``'s class with ``mixin``'s methods, sharing its parameter groups,
    state and hooks (the optimizer's ``__init__`` is not called again, so any optimizer signature works)."""
    cls = type(optimizer.__class__.__name__, (mixin, optimizer.__class__), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped.__dict__.update(attributes)
    return wrapped


def _all_finite(tensors):
    if not tensors:
        return True
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())
