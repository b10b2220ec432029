"""DiLoCo for Horovod: local steps of any torch optimizer (AdamW) and a compressed outer exchange.

    import horovod.torch as hvd
    from horovod_qsgd.torch import QSGD, DiLoCo

    optimizer = DiLoCo(torch.optim.AdamW(model.parameters(), lr=3e-3), model.named_parameters(),
                       sync_every=16, compression=QSGD(bits=4))
    ...                                   # the training loop is unchanged
    optimizer.average_models()            # before evaluating or saving the model

See :func:`DiLoCo` for the algorithm, the defaults and the costs.
"""
import zlib

import horovod.torch as hvd
import torch

from horovod_qsgd.common.errors import CompressionMismatchError
from horovod_qsgd.torch.handshake import check_settings_across_ranks
from horovod_qsgd.torch_shared.local_sgd import OuterLoop, check_arguments, named_parameters_of

__all__ = ["DiLoCo", "DiLoCoMixin"]
NAME_PREFIX = "horovod_qsgd.diloco"
START_ALIKE = ("DiLoCo: every rank must also start from the same model (hvd.broadcast_parameters(model.state_dict(), "
               "root_rank=0) before the first step) and, when resuming, load its own checkpoint of the same step.")


class DiLoCoMixin:
    """Methods DiLoCo adds to a torch optimizer class; see :func:`DiLoCo`.

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
        ``values_exchanged_in_full`` by :meth:`average_models`, never compressed);
        ``bytes_uncompressed``: 4 bytes each. The compressor's own counters (``bytes_sent``,
        ``compression_ratio``, ...) come with them where it keeps any; without compression ``bytes_sent``
        is ``bytes_uncompressed``.
        """
        counts = dict(self._diloco.counts)
        stats = dict(counts, bytes_uncompressed=4 * counts["values_exchanged"])
        compressor = self._diloco_compression
        if hasattr(compressor, "compression_stats"):
            own = compressor.compression_stats(reset)
            stats.update({k: v for k, v in own.items() if k not in ("bytes_uncompressed", "compression_ratio")})
            stats["bytes_sent"] += 4 * counts["values_exchanged_in_full"]  # average_models(): float32
        else:
            stats["bytes_sent"] = stats["bytes_uncompressed"] // (2 if compressor is hvd.Compression.fp16 else 1)
        sent = stats["bytes_sent"]
        stats["compression_ratio"] = stats["bytes_uncompressed"] / sent if sent else float("nan")
        if reset:
            self._diloco.counts = dict.fromkeys(counts, 0)
        return stats

    def state_dict(self):
        """The wrapped optimizer's state plus ``"diloco"``: the step counters, the anchor, the outer momentum,
        the settings and the compressor's state (its residuals and step counters).

        Between two outer steps the parameters and the inner optimizers' states differ between ranks: save
        every rank's (``torch.save(optimizer.state_dict(), f"opt.{hvd.rank()}.pt")``, and its model) to resume
        bit-identically.
        """
        state = super().state_dict()
        state["diloco"] = dict(self._diloco.state(), compression=_compression_state(self._diloco_compression))
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        diloco = state_dict.pop("diloco", None)
        if diloco is not None:
            self._diloco.check_state(diloco)  # before anything is loaded
        super().load_state_dict(state_dict)
        if diloco is not None:
            self._diloco.load(diloco)
            if diloco.get("compression") is not None and hasattr(self._diloco_compression, "load_state_dict"):
                self._diloco_compression.load_state_dict(diloco["compression"])


def _compression_state(compressor):
    return compressor.state_dict() if hasattr(compressor, "state_dict") else None


def _exchange_settings(compression):
    if isinstance(compression, type):  # Horovod's own Compression.none / fp16 are classes
        return {"compression": compression.__name__}
    return {"compression": type(compression).__name__, **compression.settings()}


def DiLoCo(optimizer, named_parameters=None, sync_every=16, compression=hvd.Compression.none, outer_lr=0.7,
           outer_momentum=0.5, nesterov=True, warmup_steps=0, process_set=hvd.global_process_set):
    r"""DiLoCo: local steps of ``optimizer`` and, every ``sync_every`` steps, an outer step on the averaged change.

    Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models" (arXiv 2311.08105).
    Use it *instead of* ``hvd.DistributedOptimizer``: it wraps the local (inner) optimizer, typically AdamW.

    Algorithm. Every rank keeps the anchor :math:`\theta` (the model at the last synchronization, the same on
    every rank) and trains its own copy :math:`x_i` on its own data with the inner optimizer, without
    communicating. Every ``H = sync_every`` steps the ranks average the pseudo-gradients
    :math:`\Delta_i = \theta - x_i` through ``compression``'s exchange and take one step of Nesterov SGD on the
    anchor:

    .. math::
        \Delta = \tfrac{1}{N}\textstyle\sum_i \Delta_i, \quad m \leftarrow \mu m + \Delta, \quad
        \theta \leftarrow \theta - \eta\,(\Delta + \mu m), \quad x_i \leftarrow \theta.

    The inner optimizers' states (AdamW's moments) stay local. With ``warmup_steps`` > 0 the first steps are
    synchronous: each averages the gradients through the same exchange before the inner step, as
    ``hvd.DistributedOptimizer`` would.

    The exchange is ``compression``'s, as ``hvd.DistributedOptimizer`` runs it: :class:`QSGD` and
    :class:`TopK` send payloads (two stages from 3 ranks, fused, node-aware where the compressor says so),
    with the error feedback they keep (Top-k: the sender's residual, and the owner's in two stages), now on
    the pseudo-gradient; ``hvd.Compression.none`` (default) averages in float32, ``hvd.Compression.fp16`` in
    float16. The collectives are ``hvd.grouped_allreduce`` calls named ``horovod_qsgd.diloco.<digest>.outer``
    (``.gradients`` in the warm-up, ``.models`` for :meth:`~DiLoCoMixin.average_models`).

    Args:
        optimizer (torch.optim.Optimizer): the inner optimizer; its hyperparameters, schedule and state stay
            in use.
        named_parameters: ``model.named_parameters()`` (stable names for the exchange and the checkpoint) or
            the model. Default: the optimizer's parameters as ``param.<i>``.
        sync_every (int): ``H``, steps between outer steps (default 16). Bytes fall as ``1/H``; the quality
            cost grows with ``H`` and with the number of ranks (each inner optimizer sees ``1/N`` of the
            batch). 16 kept the byte-level language model of ``benchmarks/results/diloco/`` within 0.02 nats
            of per-step AdamW at 2 and 4 ranks; see there before going higher.
        compression: a horovod_qsgd compressor (``QSGD(bits=4)``, ``TopK(...)``) or Horovod's
            ``hvd.Compression.none`` (default) / ``fp16``. Its own instance: its state is this optimizer's.
        outer_lr (float): :math:`\eta`, the outer learning rate (default 0.7, DiLoCo's).
        outer_momentum (float): :math:`\mu` (default 0.5). DiLoCo's paper uses 0.9 with 8 workers and
            ``H`` = 500; on 2-4 ranks and a few hundred outer steps 0.9 overshot here (+0.2 nats), 0.5 did not.
        nesterov (bool): Nesterov momentum (default True); False: heavy ball, :math:`\theta \leftarrow
            \theta - \eta m`.
        warmup_steps (int): synchronous steps before the first local one (default 0). They send a gradient
            each (compressed by ``compression``) and so cost ``H`` times an outer step's bytes apiece.
        process_set: the Horovod process set whose ranks train together (default global).

    Costs: two float32 copies of the model (anchor and outer momentum) beside the inner optimizer's state; per
    outer step one exchange of the model's size (QSGD-4: about 1/8 of a float32 allreduce at 2 ranks) and a
    few passes over the model; a host read of the averages' finiteness. Per byte sent it is ``H`` times
    cheaper than compressing every step's gradient; the price is models that differ between synchronizations
    (call :meth:`~DiLoCoMixin.average_models` before evaluating) and, at large ``H`` or many ranks, quality.

    Mixed precision: with ``torch.amp.GradScaler`` its ``step(optimizer)`` calls ``step()`` on every step;
    gradients are unscaled here, an overflowed local step is skipped on its rank alone, and every rank still
    counts it, so the ranks reach each outer step together. A non-finite outer average (a rank's model
    diverged) skips the outer step on every rank and sets the models back to the anchor.

    Returns an instance of a subclass of the optimizer's class (like ``hvd.DistributedOptimizer``) sharing its
    parameter groups and state, with :meth:`~DiLoCoMixin.average_models`, ``outer_steps``,
    :meth:`~DiLoCoMixin.compression_stats` and a ``state_dict()`` that holds the anchor, the outer momentum,
    the counters and the compressor's state. Settings, counters and the starting model are compared across the
    ranks at the first step (a rank that did not ``hvd.broadcast_parameters`` is refused, on every rank).
    """
    check_arguments(sync_every, outer_lr, outer_momentum, warmup_steps)
    if isinstance(named_parameters, torch.nn.Module):
        named_parameters = named_parameters.named_parameters()
    named = named_parameters_of(optimizer, named_parameters, "DiLoCo")
    if not process_set.included():
        raise ValueError("horovod_qsgd: DiLoCo: this rank is not in process_set")
    if compression is None:
        compression = hvd.Compression.none
    manifest = zlib.crc32(repr([(n, tuple(p.shape)) for n, p in named]).encode())
    prefix = f"{NAME_PREFIX}.{process_set.process_set_id}.{manifest:08x}"

    def exchange(tensors, purpose):
        if not tensors:
            return []
        return hvd.grouped_allreduce(tensors, name=f"{prefix}.{purpose}", op=hvd.Average, process_set=process_set,
                                     compression=hvd.Compression.none if purpose == "models" else compression)

    def check(record, name):
        try:
            check_settings_across_ranks("DiLoCo", record, f"{prefix}.{name}", process_set)
        except CompressionMismatchError as exc:
            raise CompressionMismatchError(f"{exc}\n{START_ALIKE}") from None

    loop = OuterLoop(named, sync_every, outer_lr, outer_momentum, nesterov, warmup_steps, exchange, check,
                     _exchange_settings(compression))
    # A subclass of the optimizer's own class sharing its parameter groups, state and hooks (the wrapped
    # optimizer's __init__ is not called again, so any optimizer signature works).
    cls = type(optimizer.__class__.__name__, (DiLoCoMixin, optimizer.__class__), {})
    diloco = cls.__new__(cls)
    diloco.__dict__.update(optimizer.__dict__)
    diloco._diloco = loop
    diloco._diloco_compression = compression
    diloco._diloco_prefix = prefix  # the exchange's collectives are named f"{prefix}.{purpose}.{index}"
    return diloco
