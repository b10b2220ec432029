r"""Uneven inputs with compressed gradients in TensorFlow: a rank out of data shadows the others' steps.

Horovod's ``hvd.join()`` answers the other ranks' allreduces with zeros but
cannot answer an allgather or an alltoall (see :mod:`horovod_qsgd.torch.join`).
:class:`Join` runs your own training step instead, eagerly called::

    compression = QSGD(bits=4)
    join = Join(train_step, compression)   # before the first step

    @tf.function
    def train_step(x, y):                  # the tape or optimizer uses compression=compression
        ...

    with join:
        for x, y in dataset:               # a different number of batches on each rank
            join(x, y)                     # train_step(x, y) as one round of the job

1. Before each round every rank sums a flag over the ranks: 1 from a rank
   with a batch, 0 from a rank that has left the block.
2. While the sum is positive, a rank that has left the block calls
   ``train_step`` on its last batch with the compressor's shadowing flag set:
   every gradient it hands Horovod becomes zeros before it is compressed,
   so it takes part in the same compressed exchanges with nothing of its
   own and applies the others' average like them. The average divides by
   the number of ranks, as Horovod's join and DDP's ``Join`` do.
3. When the sum is 0 every rank has left, and every rank leaves together.

Every rank ends with the same variables, optimizer and compressor state as
a run in which the ranks without data stepped on zero gradients by hand.
The shadow step still runs the forward pass on the rank's last batch, so
state the forward pass changes (BatchNorm's moving statistics) sees that
batch again on the shadowing ranks.

Cost: one 4-byte allreduce before each step while the block is open (the
decision to step must precede the step, which a ``tf.function`` cannot
undo). A block left by an exception does not shadow; the exception
propagates. ``hvd.join()`` itself cannot serve compressed payloads: called
while another rank trains, it is refused on every rank
(:mod:`horovod_qsgd.tensorflow.hvd_join`).
"""
import horovod.tensorflow as hvd
import tensorflow as tf

from horovod_qsgd.common.naming import JOIN_FLAG_NAME
from horovod_qsgd.tensorflow.compressor_base import CompressorBase



class Join:
    """Context manager for uneven inputs; see the module docstring.

    Args:
        step_fn: the training step (a ``tf.function`` or a Python function);
            it must compress through ``compression``.
        compression: our compressor (QSGD, TopK or RandomK), passed to Join
            before its first tensor.
        example: arguments (a tuple) for the shadow step of a rank that has
            no batch at all; by default a rank shadows with its last batch.
            Give one when a rank may get no batch in an epoch.

    Costs: one 4-byte allreduce before each step while the block is open; a
    rank out of data runs the step on its last batch with zeroed gradients
    until every rank has left (the module docstring).
    """

    def __init__(self, step_fn, compression, example=None):
        if not isinstance(compression, CompressorBase):
            raise TypeError(
                "horovod_qsgd: Join zeroes a rank's gradients inside one of our compressors, got "
                f"{type(compression).__name__}. With Horovod's own compressors use hvd.join().")
        if not tf.executing_eagerly():
            raise RuntimeError("horovod_qsgd: Join runs eagerly (call it outside tf.function and tf.compat.v1 "
                               "graphs).")
        self.step_fn = step_fn
        self.shadow_steps = 0  # steps this rank shadowed after it ran out of data
        self._shadowing = compression.shadowing_flag()
        self._last_args = (tuple(example), {}) if example is not None else None
        self._open = False

    def __enter__(self):
        if self._open:
            raise RuntimeError("horovod_qsgd: this Join is already open; open it once per epoch.")
        self._open = True
        return self

    def __exit__(self, exc_type, exc, traceback):
        self._open = False
        if exc_type is None:
            self._shadow()
        return False

    def __call__(self, *args, **kwargs):
        """One training step on this rank's batch (``step_fn(*args, **kwargs)``), in step with every rank."""
        if not self._open:
            raise RuntimeError("horovod_qsgd: call the Join inside its block (with join: ...).")
        self._active_ranks(1)
        self._last_args = (args, kwargs)
        return self.step_fn(*args, **kwargs)

    @staticmethod
    def _active_ranks(flag):
        total = hvd.allreduce(tf.constant([flag], tf.int32), op=hvd.Sum, name=JOIN_FLAG_NAME)
        return int(total.numpy()[0])

    def _shadow(self):
        while self._active_ranks(0) > 0:
            if self._last_args is None:
                raise RuntimeError(
                    "horovod_qsgd: this rank had no batch to shadow the others' steps with; pass "
                    "Join(..., example=(x, y)) with arguments step_fn accepts.")
            args, kwargs = self._last_args
            self._shadowing.assign(True)
            try:
                self.step_fn(*args, **kwargs)
            finally:
                self._shadowing.assign(False)
            self.shadow_steps += 1
