r"""Horovod Elastic with our compressors: the compressor is part of the elastic state.

    compression = QSGD(bits=4)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    state = hvd.elastic.TorchState(model, optimizer, compression=compression, epoch=0)

    @hvd.elastic.run
    def train(state):
        ...                     # optimizer.step(); state.commit() every few steps

Importing :mod:`horovod_qsgd.torch` registers :class:`CompressorStateHandler`
with Horovod's ``TorchState`` (``set_handler_registry``), which then treats a
compressor like the model and the optimizer:

1. ``state.commit()`` keeps a copy of the compressor's ``state_dict()``
   (step counters, error-feedback residuals, owner-side residuals).
2. After a lost worker (``HorovodInternalError``), ``restore`` puts back the
   last commit on the surviving ranks, as Horovod does with the model: the
   steps since are taken again.
3. After every reset (worker lost or added), ``sync`` runs on every rank: the
   settings are checked again among the new ranks at the next step, the
   exchange forgets what was in flight and its fusion groups, and the step
   counters become rank 0's (a new worker must draw the same random streams,
   which random-k's coordinate choice depends on).

Residuals stay with the rank that made them: a new worker starts with none.
An owner-side residual (two stages with top-k) belongs to a chunk of the
old layout; when the number of ranks or this rank's place changes, it is
added to this rank's own residual there and sent in its next steps, so a
reset loses no mass on the ranks that survive. A lost worker's residuals (as
of the last commit) are lost with it.

In an elastic job (``HOROVOD_ELASTIC=1``), a compressor that is not in the
state refuses to compress, on every rank, with an error that says this:
without the reset above, the first step after a worker joins would hang in
the settings check.
"""
import horovod.torch as hvd
from horovod.torch.elastic import state as _elastic_state

from horovod_qsgd.torch.compression import _CompressorBase

STEP_COUNTERS_NAME = "horovod_qsgd.elastic.step_counters"


class CompressorStateHandler(_elastic_state.StateHandler):
    """Commits, restores and re-synchronises a compressor in ``hvd.elastic.TorchState`` (module docstring)."""

    def __init__(self, compressor):
        super().__init__(compressor)
        compressor.elastic_state_attached = True
        self._saved = compressor.state_dict()

    def save(self):
        self._saved = self.value.state_dict()

    def restore(self):
        self.value.load_state_dict(self._saved)

    def sync(self):
        steps = hvd.broadcast_object(self.value.step_counters(), root_rank=0, name=STEP_COUNTERS_NAME)
        self.value.start_new_world(steps)

    def set_value(self, value):
        value.elastic_state_attached = True
        super().set_value(value)


def register_state_handler():
    """Adds :class:`CompressorStateHandler` to Horovod's TorchState registry (once)."""
    registry = _elastic_state.get_handler_registry()
    if not any(handler is CompressorStateHandler for _, handler in registry):
        _elastic_state.set_handler_registry(list(registry) + [(_CompressorBase, CompressorStateHandler)])
