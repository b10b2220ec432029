r"""PyTorch Lightning: our DDP communication hooks and DiLoCo inside ``Trainer(strategy="ddp")``, on any device.

    from horovod_qsgd.ddp import QSGDState
    from horovod_qsgd.lightning import GradientCompression
    trainer = lightning.Trainer(strategy="ddp", callbacks=[GradientCompression(QSGDState(bits=4))])

Lightning's own ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` registers a hook only when the root device
is CUDA (lightning 2.6): on CPU ranks it trains without one and says nothing. :class:`GradientCompression`
registers the hook on the DDP model itself once the strategy has wrapped it (``on_fit_start``), whatever the
device, and logs the hook's ``compression_stats()`` through the Trainer's logger.

DiLoCo (local AdamW steps, a compressed outer exchange) is the optimizer ``configure_optimizers`` returns,
:func:`horovod_qsgd.ddp.DiLoCo`, with :class:`LocalSteps` among the callbacks: DDP must not average the
gradients of a local step, so the callback registers a hook that sends nothing, and it averages the models
before validation and at the end of each epoch and of training, so that what Lightning evaluates and saves is
the ranks' average. Details, checkpoints and the FSDP2 form: ``docs/lightning-accelerate.md``.

Lightning stays optional: importing this module without it raises ImportError naming the package.
"""
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

try:
    import lightning.pytorch as pl
except ImportError as exc:  # pragma: no cover - the test extra installs it
    raise ImportError("horovod_qsgd.lightning needs PyTorch Lightning: pip install 'lightning>=2.4' "
                      "(tested with 2.6.6)") from exc

from horovod_qsgd.ddp.hooks import QSGDState, TopKState, _PayloadState, qsgd_hook, topk_hook
from horovod_qsgd.torch_shared.local_sgd import DiLoCoMixin

__all__ = ["GradientCompression", "LocalSteps", "local_gradients_hook"]

_HOOKS = {QSGDState: qsgd_hook, TopKState: topk_hook}


class GradientCompression(pl.Callback):
    r"""Registers a horovod_qsgd DDP communication hook on Lightning's DDP model (or installs FSDP2's compressed
    reduce-scatter) and logs its statistics.

    Args:
        state (QSGDState, TopKState, or horovod_qsgd.fsdp's QSGD or TopK): the hook's state, built as for
            ``DistributedDataParallel.register_comm_hook`` (:mod:`horovod_qsgd.ddp`), for ``strategy="ddp"``;
            or, for ``ModelParallelStrategy`` (FSDP2; ``fully_shard`` in ``configure_model``), the compressor
            :func:`horovod_qsgd.fsdp.compress_reduce_scatter` installs on the model. Its ``compression_stats()``
            is what gets logged and its ``state_dict()`` what the checkpoint keeps.
        hook (callable, optional): the DDP hook; default: :func:`~horovod_qsgd.ddp.qsgd_hook` for a
            ``QSGDState``, :func:`~horovod_qsgd.ddp.topk_hook` for a ``TopKState`` (none for FSDP2).
        log_every_n_steps (int, optional): log the counters every this many optimizer steps (default: the
            Trainer's ``log_every_n_steps``; 0: never). Logged as ``compression/<counter>`` from rank 0, its
            own counts since the start (``bytes_sent``, ``bytes_uncompressed``, ``compression_ratio``, the
            collectives and seconds; see :meth:`horovod_qsgd.ddp.QSGDState.compression_stats`).

    Costs: what the hook costs (``horovod_qsgd.ddp``); logging reads host counters, no collective. A checkpoint
    gathers every rank's hook state (Top-k's residuals are the rank's own) to the saving rank: one
    ``all_gather_object`` of the residuals, about the compressed parameters' size per rank, in float32; QSGD keeps
    only its step counter. A checkpoint resumes on the same number of ranks.

    If the strategy already registered a hook (``DDPStrategy(ddp_comm_hook=...)`` on CUDA), the callback
    registers none: with this ``state`` it only logs; with another it warns. Where Lightning skipped the
    strategy's hook (CPU), the callback says so and registers its own.
    """

    def __init__(self, state, hook=None, log_every_n_steps=None):
        from horovod_qsgd.fsdp.reduce_scatter import _ReduceScatterCompressor
        self.sharded = isinstance(state, _ReduceScatterCompressor)
        if not (self.sharded or isinstance(state, _PayloadState)):
            raise TypeError("horovod_qsgd: GradientCompression takes a QSGDState or TopKState from horovod_qsgd.ddp "
                            f"(DDP) or a QSGD or TopK from horovod_qsgd.fsdp (FSDP2), not a {type(state).__name__}")
        self.state = state
        self.hook = hook if hook is not None or self.sharded else _HOOKS[type(state)]
        self.log_every_n_steps = log_every_n_steps
        self.registered = False  # whether this state serves the model (registered here or by the strategy)

    def on_fit_start(self, trainer, pl_module):
        model = trainer.strategy.model
        if self.sharded:
            from horovod_qsgd.fsdp import compress_reduce_scatter
            compress_reduce_scatter(model, self.state)  # its errors name what is missing (fully_shard first)
            self.registered = True
            return
        if not isinstance(model, DistributedDataParallel):
            _not_ddp(trainer, "GradientCompression registers a DDP communication hook")
            return
        registered = list(getattr(model, "_comm_hooks", []))
        if registered:
            if any(state is self.state for _, state in registered):
                self.registered = True
            else:
                warnings.warn("horovod_qsgd: the strategy already registered a DDP communication hook "
                              f"({getattr(registered[0][0], '__name__', registered[0][0])}); GradientCompression registered none (DDP takes one). "
                              "Pass the hook to DDPStrategy or to this callback, not both.")
            return
        if getattr(trainer.strategy, "_ddp_comm_hook", None) is not None:
            warnings.warn(f"horovod_qsgd: Lightning did not register DDPStrategy(ddp_comm_hook=...) on "
                          f"{trainer.strategy.root_device.type} (it does on CUDA only); GradientCompression "
                          "registered its own hook instead.")
        model.register_comm_hook(self.state, self.hook)
        self.registered = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.registered:
            _log_counts(self, trainer, pl_module, self.state.compression_stats())

    # -- checkpoints: every rank's state, in the checkpoint its rank 0 writes ------------------------------
    def state_dict(self):
        return _gathered(self.state.state_dict(), getattr(self.state, "process_group", None))

    def load_state_dict(self, state_dict):
        group = getattr(self.state, "process_group", None)
        self.state.load_state_dict(_this_ranks(state_dict, group, "GradientCompression"))


def local_gradients_hook(state, bucket):
    """A DDP communication hook that sends nothing: every rank keeps its own gradients (for local steps).

    Args:
        state: unused (None).
        bucket (torch.distributed.GradBucket): DDP's bucket, returned as it is.

    Costs nothing: no collective, no copy.
    """
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


class LocalSteps(pl.Callback):
    r"""DiLoCo in Lightning: ``configure_optimizers`` returns :func:`horovod_qsgd.ddp.DiLoCo`, and this callback

    - registers :func:`local_gradients_hook` on Lightning's DDP model, so that DDP sends nothing and each rank
      steps on its own gradients (DiLoCo's warm-up and outer steps do their own exchanges);
    - calls the optimizer's ``average_models()`` before each validation and at the end of each training epoch
      and of training, so that what Lightning evaluates and ``ModelCheckpoint`` saves (it runs after every
      other callback) is the ranks' average;
    - logs the optimizer's ``compression_stats()`` as ``compression/<counter>``.

    Args:
        log_every_n_steps (int, optional): as :class:`GradientCompression`'s (default: the Trainer's).

    Costs: ``average_models()`` sends nothing at a synchronization (every ``sync_every`` steps after the
    warm-up) and one float32 allreduce of the model elsewhere: validate and end epochs at synchronizations
    (``val_check_interval`` and the epoch's batches multiples of ``sync_every``, the warm-up one too) to keep
    the bytes at DiLoCo's. DDP still broadcasts the model's buffers every forward pass unless
    ``DDPStrategy(broadcast_buffers=False)``.

    Checkpoints: Lightning saves rank 0's optimizer state and loads it on every rank. At a synchronization the
    anchor, the outer momentum and the counters are the same on every rank, so training resumes in step; the
    inner AdamW moments (and Top-k's residuals) of the other ranks are rank 0's after a resume, which is not
    bit-identical to going on. Bit-identical resumption needs every rank's optimizer state
    (``torch.save(optimizer.state_dict(), f"opt.{rank}.pt")``).
    """

    def __init__(self, log_every_n_steps=None):
        self.log_every_n_steps = log_every_n_steps
        self.optimizer = None

    def on_fit_start(self, trainer, pl_module):
        found = [getattr(opt, "_optimizer", opt) for opt in trainer.optimizers]
        found = [opt for opt in found if isinstance(opt, DiLoCoMixin)]
        if len(found) != 1:
            raise TypeError("horovod_qsgd: LocalSteps needs configure_optimizers to return one "
                            f"horovod_qsgd.ddp.DiLoCo optimizer; it returned {len(found)} among "
                            f"{[type(getattr(o, '_optimizer', o)).__name__ for o in trainer.optimizers]}")
        self.optimizer = found[0]
        model = trainer.strategy.model
        if isinstance(model, DistributedDataParallel):
            if getattr(model, "_comm_hooks", []) or getattr(trainer.strategy, "_ddp_comm_hook", None) is not None:
                raise ValueError("horovod_qsgd: LocalSteps keeps each rank's gradients local; remove the "
                                 "strategy's ddp_comm_hook (DiLoCo does its own exchanges)")
            model.register_comm_hook(None, local_gradients_hook)
        elif trainer.world_size > 1:
            _not_ddp(trainer, "LocalSteps keeps DDP's gradients local")

    def _average(self, trainer):
        if self.optimizer is not None and not trainer.sanity_checking:
            self.optimizer.average_models()

    def on_validation_start(self, trainer, pl_module):
        self._average(trainer)

    def on_train_epoch_end(self, trainer, pl_module):
        self._average(trainer)

    def on_train_end(self, trainer, pl_module):
        self._average(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.optimizer is not None:
            _log_counts(self, trainer, pl_module, self.optimizer.compression_stats())


def _not_ddp(trainer, what):
    if trainer.world_size == 1:
        warnings.warn(f"horovod_qsgd: one process: nothing to exchange ({what}).")
        return
    raise TypeError(f"horovod_qsgd: {what}, but the strategy {type(trainer.strategy).__name__} did not wrap the "
                    "model in DistributedDataParallel: use strategy='ddp' (DDPStrategy). For FSDP2 "
                    "(ModelParallelStrategy) call horovod_qsgd.fsdp.compress_reduce_scatter(...) in "
                    "configure_model after fully_shard instead (docs/lightning-accelerate.md).")


def _log_counts(callback, trainer, pl_module, stats):
    every = callback.log_every_n_steps
    every = trainer.log_every_n_steps if every is None else every
    if not every or trainer.global_step % every:
        return
    counts = {f"compression/{key}": float(value) for key, value in stats.items() if isinstance(value, (int, float))}
    pl_module.log_dict(counts, on_step=True, on_epoch=False, rank_zero_only=True)


def _on_host(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: _on_host(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_host(item) for item in value)
    return value


def _gathered(state, group):
    """Every rank's ``state`` (a collective: Lightning builds a checkpoint on every rank, writes rank 0's)."""
    if not dist.is_initialized():
        return {"ranks": [_on_host(state)]}
    states = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, _on_host(state), group=group)
    return {"ranks": states}


def _this_ranks(saved, group, who):
    states = saved["ranks"]
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if len(states) != size:
        raise ValueError(f"horovod_qsgd: {who}'s checkpoint holds the hook states of {len(states)} ranks, this job "
                         f"has {size}: resume on {len(states)} ranks (each rank's error feedback is its own), or "
                         "leave this callback out of the resumed checkpoint's callbacks to start it afresh")
    return states[dist.get_rank(group) if dist.is_initialized() else 0]
