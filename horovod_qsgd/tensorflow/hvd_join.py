"""``hvd.join()`` while TensorFlow payload compressors run: refused on every rank instead of killing the job.

Horovod's join answers the other ranks' allreduces with zeros but not an
allgather or an alltoall: the joined rank's background loop dies on the
payloads of QSGD and TopK (their names repeat every step, so Horovod's
response cache always holds them). A TensorFlow step cannot be stopped
halfway either: once one of its ops fails, the step still waits for every
collective it has started. So once a payload compressor has built its
collectives, ``hvd.join()`` is ours, in three steps:

1. The joining rank answers every payload collective that ran since its last
   ``hvd.join()`` (recorded by name as a ``tf.function`` built it; the
   collectives ignore name scopes, so the name Horovod negotiates is the
   recorded one), sending a 16-byte notice in place of each payload. Where
   every rank calls ``hvd.join()`` after the same steps, the notices meet
   one another.
2. Horovod's own join, which answers the rest of a step in progress (the
   placeholders' and the small gradients' allreduces) with zeros.
3. A check allreduce sums 1 from every rank that called ``hvd.join()`` with no
   refusal pending. Below the number of ranks every rank in it raises
   :class:`JoinUnsupportedError`.

A rank still in a step decodes the notices as NaN for that tensor (its
error-feedback state stays as it was, as in any non-finite step), remembers
the refusal and finishes its step: none of its tensors is decoded before its
placeholder's allreduce, answered in step 2, after every payload of the step
met a notice in step 1, so no payload is left waiting.

A refused rank raises the same error at its next compressed tensor, before
that tensor's payload leaves (TensorFlow reports it inside its own error),
or in its own ``hvd.join()``, which then runs steps 2 and 3 only. A refused
rank that leaves without either ends Horovod for the others, and their
``hvd.join()`` raises the error then.

Payload collectives run eagerly (``hvd.allreduce(..., compression=...)``
outside a ``tf.function``) cannot be answered by name (Horovod names eager
ops by their type), nor those of a Horovod Elastic job (whether a tensor
takes an alltoall follows the world): then step 3 comes first, and a rank
still training leaves the joining rank waiting until it raises alone after
``HVD_JOIN_TIMEOUT_SECONDS``, and Horovod's shutdown then ends the others'
step. So does a rank that neither steps nor joins.
"""
import threading

import horovod.tensorflow as hvd
import horovod.tensorflow.mpi_ops as mpi_ops
import numpy as np
import tensorflow as tf

from horovod_qsgd.common.errors import (HVD_JOIN_TIMEOUT_SECONDS, JoinUnsupportedError, hvd_join_refused,
                                         hvd_join_timed_out)
from horovod_qsgd.common.exchange import join_notice
from horovod_qsgd.common.naming import JOIN_CHECK_NAME

JOIN_CLASS = "horovod_qsgd.tensorflow.Join(train_step, compression)"

_lock = threading.Lock()
_collectives = {}  # name Horovod negotiates -> (kind, process set), for each one built
_sent = set()  # the names of those that ran since the last hvd.join()
_unanswerable = False  # a payload collective ran eagerly, or in an elastic job (its kind follows the world)
_refused_by = None  # how many ranks' notices this rank's last step met
_horovod_join = None


def note_payload_collective(kind, name, process_set):
    """Remembers a payload ``"allgather"`` or ``"alltoall"`` built under ``name`` (ignoring name scopes)."""
    if tf.executing_eagerly():
        note_unanswerable_collective()
        return
    with _lock:
        _collectives[name] = (kind, process_set)
    _take_over_hvd_join()


def note_unanswerable_collective():
    """A payload collective that step 1 cannot answer ran or was built (see the module docstring)."""
    global _unanswerable
    _unanswerable = True
    _take_over_hvd_join()


def sending(name, first=True):
    """Called where a payload collective's input is made, as it runs: notes that ``name`` runs in this step and,
    before the ``first`` one of a tensor, raises where an earlier step met hvd.join()'s notices."""
    if first:
        raise_if_refused()
    with _lock:
        _sent.add(name)


def note_refused(joined):
    """A tensor of this rank's step met the notices of ``joined`` ranks in hvd.join()."""
    global _refused_by
    with _lock:
        _refused_by = joined if _refused_by is None else max(_refused_by, joined)


def raise_if_refused():
    """Raises JoinUnsupportedError where an earlier step met hvd.join()'s notices (before a payload leaves)."""
    if _refused_by is not None:
        raise JoinUnsupportedError(hvd_join_refused(JOIN_CLASS, _refused_by, hvd.size()))


def _take_over_hvd_join():
    global _horovod_join
    with _lock:
        if _horovod_join is None:
            _horovod_join = mpi_ops.join
            hvd.join = mpi_ops.join = _join_refusing_payloads


def _within(fn, *args):
    """``fn(*args)``, or JoinUnsupportedError after HVD_JOIN_TIMEOUT_SECONDS (the call is left running)."""
    outcome = []

    def run():
        try:
            outcome.append((True, fn(*args)))
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="horovod_qsgd.hvd_join", daemon=True)
    thread.start()
    thread.join(HVD_JOIN_TIMEOUT_SECONDS)
    if not outcome:
        raise JoinUnsupportedError(hvd_join_timed_out(JOIN_CLASS))
    done, value = outcome[0]
    if not done:
        raise value
    return value


@tf.function(input_signature=[tf.TensorSpec([1], tf.int32)], autograph=False)
def _ranks_in_join(flag):
    # an argument, not a constant: grappler would run an allreduce of a constant once, when it folds the graph
    return hvd.allreduce(flag, name=JOIN_CHECK_NAME, op=hvd.Sum, ignore_name_scope=True)


def _horovod_join_now():
    """Horovod's join, run anew: its op has no input and is not stateful, so an eager call after the first
    returns the first call's answer at once (measured with Horovod 0.28.1), leaving the others' allreduces
    unanswered. A function of its own each time runs it."""
    return tf.function(lambda: _horovod_join(), autograph=False)()


def _answer_payloads(collectives):
    """Step 1: the notice in place of every recorded payload (a function: the names are graph names)."""
    notice = tf.constant(np.frombuffer(join_notice(), np.uint8))

    @tf.function(autograph=False)
    def answer(notice):
        answers = []
        for name, (kind, process_set) in collectives:
            if kind == "alltoall":
                splits = tf.fill([process_set.size()], tf.size(notice))
                answers.append(hvd.alltoall(tf.tile(notice, [process_set.size()]), splits=splits, name=name,
                                            ignore_name_scope=True, process_set=process_set)[0])
            else:
                answers.append(hvd.allgather(notice, name=name, ignore_name_scope=True, process_set=process_set))
        return answers

    answer(notice)


def _join_refusing_payloads():
    """``hvd.join()`` while payload compressors run; see the module docstring."""
    global _refused_by
    if not tf.executing_eagerly():  # traced into a function: only its ops run later
        return _horovod_join()
    with _lock:
        collectives = sorted((name, _collectives[name]) for name in _sent if name in _collectives)
        unanswerable, refused = _unanswerable, _refused_by
        _refused_by = None
        _sent.clear()  # the functions of the next hvd.join() may be others
    if refused is None:
        if unanswerable:  # returns once every rank is in hvd.join()
            _within(_ranks_in_join, tf.ones([1], tf.int32))
        if collectives:
            _within(_answer_payloads, collectives)
    try:
        last = _horovod_join_now()
    except tf.errors.OpError as exc:  # a refused rank left: Horovod has shut down
        raise JoinUnsupportedError(hvd_join_refused(JOIN_CLASS, "some", hvd.size())) from exc
    in_join = int(_ranks_in_join(tf.constant([0 if refused is not None else 1], tf.int32))[0])
    if in_join < hvd.size():
        raise JoinUnsupportedError(hvd_join_refused(JOIN_CLASS, in_join, hvd.size()))
    return last
