r"""Horovod Elastic with our TensorFlow compressors: the compressor is part of the elastic state.

    from horovod_qsgd.tensorflow import QSGD, elastic

    compression = QSGD(bits=4)
    state = elastic.TensorFlowKerasState(model, optimizer, compression=compression, epoch=0)

    @elastic.run                # not hvd.elastic.run: see run()
    def train(state):
        ...                     # a tf.function step with hvd.DistributedGradientTape(tape,
                                # compression=compression); state.commit() every few steps

:class:`TensorFlowKerasState` and :class:`TensorFlowState` are Horovod's
classes of the same names, plus: every keyword argument that is one of our
compressors is handled like the model:

1. ``state.commit()`` keeps a copy of its ``state_dict()`` (step counters,
   error-feedback residuals, owner-side residuals).
2. After a lost worker, ``restore`` puts back the last commit on the
   surviving ranks (the steps since are taken again).
3. After every reset (worker lost or added), ``sync`` runs on every rank:
   the step counters become rank 0's (a new worker must draw the same random
   streams, which random-k's coordinates depend on) and the settings are
   checked among the new ranks, so that a worker started with other settings
   is refused on every rank.

A ``tf.function`` is traced once and goes on running after the world
changed, so in an elastic job (``HOROVOD_ELASTIC=1``, set by ``horovodrun``)
the compressors trace no plan: every compressed tensor takes "an alltoall
where the plan has two stages, then an allgather", and the plan (allgather or
two stages, the chunks, the owner) is made when the ops run, for the world
they run in. Residuals stay with the rank that made them; an owner-side
residual of an old layout is added to this rank's residual at its old chunk
and sent in its next steps, so the surviving ranks lose no mass. A lost
worker's residuals (as of the last commit) are lost with it. Only the global
process set is compressed in an elastic job.

In an elastic job a compressor that is not in one of these states refuses
to compress, naming this module.
"""
import functools

import tensorflow as tf

import horovod.tensorflow as hvd
from horovod.common.elastic import run_fn
from horovod.common.exceptions import HorovodInternalError
from horovod.tensorflow import elastic as _horovod_elastic

from horovod_qsgd.tensorflow.compressor_base import CompressorBase

STEP_COUNTERS_NAME = "horovod_qsgd.elastic.step_counters"
# What a collective's error says when a worker was lost (Horovod's own run looks for the op type in the node's
# name only, which our named collectives and any alltoall do not carry)
_LOST_WORKER_SIGNS = ("Horovod has been shut down", "HorovodAllreduce", "HorovodAllgather", "HorovodBroadcast",
                      "HorovodAlltoall", "gloo")
_WRONG_RUN = ("horovod_qsgd: this elastic state runs under hvd.elastic.run, whose TensorFlow version returns None "
              "when an alltoall or a named allgather fails, as if training were done (our compressors' collectives "
              "are such ops). Decorate the training function with horovod_qsgd.tensorflow.elastic.run instead.")


def run(func):
    """``hvd.elastic.run`` for TensorFlow, for training with our compressors.

    Horovod's TensorFlow ``run`` turns a collective's failure into a reset
    only when the failed node is named like one of its allreduces, allgathers
    or broadcasts, and otherwise returns None as if ``func`` had finished: a
    lost worker would silently end training on the others. This one resets on
    any failure of a Horovod collective and re-raises every other error.
    """
    @functools.wraps(func)
    def call(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except tf.errors.UnknownError as error:
            # our own errors (a mismatch between ranks) end the job: a reset would meet them again
            if "horovod_qsgd:" not in error.message and any(sign in error.message for sign in _LOST_WORKER_SIGNS):
                raise HorovodInternalError(error) from error
            raise

    elastic_call = run_fn(call, _reset)

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        state.run_by_horovod_qsgd = True
        return elastic_call(state, *args, **kwargs)

    return wrapper


def _reset():
    hvd.shutdown()
    hvd.init()


class _WithCompressors:
    """Takes our compressors out of the keyword arguments and commits, restores and syncs them."""

    def _take_compressors(self, kwargs):
        self._compressors = {key: value for key, value in kwargs.items() if isinstance(value, CompressorBase)}
        for key, compressor in self._compressors.items():
            compressor.elastic_state_attached = True
            setattr(self, key, compressor)
        self._saved_compressors = {key: c.state_dict() for key, c in self._compressors.items()}
        return {key: value for key, value in kwargs.items() if key not in self._compressors}

    def save(self):
        super().save()
        self._saved_compressors = {key: c.state_dict() for key, c in self._compressors.items()}

    def restore(self):
        super().restore()
        for key, compressor in self._compressors.items():
            compressor.load_state_dict(self._saved_compressors[key])

    def sync(self):
        if self._compressors and not getattr(self, "run_by_horovod_qsgd", False):
            raise RuntimeError(_WRONG_RUN)
        super().sync()
        for key, compressor in sorted(self._compressors.items()):
            steps = hvd.broadcast_object(compressor.step_counters(), root_rank=0,
                                         name=f"{STEP_COUNTERS_NAME}.{key}")
            compressor.start_new_world(steps)
            compressor.verify_settings()


class TensorFlowKerasState(_WithCompressors, _horovod_elastic.TensorFlowKerasState):
    """``hvd.elastic.TensorFlowKerasState(model, optimizer, **kwargs)``; keyword arguments that are compressors
    are committed, restored and synchronised with the model (module docstring)."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        super().__init__(model, optimizer, backend, **self._take_compressors(kwargs))


class TensorFlowState(_WithCompressors, _horovod_elastic.TensorFlowState):
    """``hvd.elastic.TensorFlowState(variables, **kwargs)``; keyword arguments that are compressors are
    committed, restored and synchronised with the variables (module docstring).

    Like Horovod's, it broadcasts the variables after a reset only in a
    ``tf.compat.v1`` session; eagerly a new worker keeps its own initial
    values: use :class:`TensorFlowKerasState` there."""

    def __init__(self, variables=None, session=None, **kwargs):
        super().__init__(variables, session, **self._take_compressors(kwargs))
