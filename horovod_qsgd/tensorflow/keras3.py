"""Keras 3: real allreduce (with or without compression) where Horovod 0.28's Keras support stops.

Horovod 0.28 knows Keras 2 only. With the Keras 3 that TensorFlow 2.21 ships,

* ``horovod.tensorflow.keras.DistributedOptimizer`` wraps methods Keras 3
  never calls, so ``model.fit`` trains every rank on its own gradients
  (our compressors refuse to be passed to it, see
  :mod:`horovod_qsgd.tensorflow.keras_guard`);
* ``hvd.DistributedGradientTape(...).gradient(loss, model.trainable_variables)``
  fails (``'Variable' object has no attribute 'ref'``): Keras 3 variables
  are not ``tf.Variable``\\ s.

This module fills both gaps::

    import keras
    from horovod_qsgd.tensorflow import QSGD
    from horovod_qsgd.tensorflow import keras3

    compression = QSGD(bits=4)
    model.compile(optimizer=keras3.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=compression),
                  loss=..., jit_compile=False)
    model.fit(...)            # gradients are allreduced (compressed) before every update

    tape = keras3.DistributedGradientTape(tf.GradientTape(), compression=compression)  # custom loops

The alternative is tf-keras with ``TF_USE_LEGACY_KERAS=1`` and Horovod's own
Keras optimizer. ``jit_compile`` must stay off: the codecs run as host ops,
which XLA cannot compile.
"""
import sys

import horovod.tensorflow as hvd
import tensorflow as tf

from horovod_qsgd.tensorflow.call_site import variable_name
from horovod_qsgd.tensorflow.keras_guard import is_keras3_optimizer


def tf_variables(variables):
    """The ``tf.Variable`` behind each Keras 3 variable (other variables are returned unchanged).

    ``tape.gradient(loss, tf_variables(model.trainable_variables))`` gives the
    gradients of the Keras 3 variables, in the same order, and works with
    Horovod's ``DistributedGradientTape``. The ``tf.Variable``\\ s are named by
    the Keras variables' paths (``"dense/kernel:0"``), so compressor state is
    keyed by the same names as in :func:`DistributedOptimizer`.
    """
    out = []
    for var in variables:
        inner = getattr(var, "_value", None) if not isinstance(var, tf.Variable) else var
        if not isinstance(inner, tf.Variable):
            raise TypeError(f"horovod_qsgd: {var!r} is neither a tf.Variable nor a built Keras 3 variable; "
                            "build the model (call it once or model.build(...)) before asking for gradients.")
        out.append(inner)
    return out


class _Keras3Tape:
    """Horovod's DistributedGradientTape, with Keras 3 variables accepted as sources."""

    def __init__(self, distributed_tape):
        self._distributed_tape = distributed_tape

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        return self._distributed_tape.gradient(target, tf_variables(sources), output_gradients, **kwargs)

    def register_local_source(self, source):
        return self._distributed_tape.register_local_source(tf_variables([source])[0])

    def __getattr__(self, name):
        return getattr(self._distributed_tape, name)

    def __enter__(self):
        self._distributed_tape.__enter__()
        return self

    def __exit__(self, *exc_info):
        return self._distributed_tape.__exit__(*exc_info)


def DistributedGradientTape(gradtape, **kwargs):
    """``hvd.DistributedGradientTape(gradtape, **kwargs)`` that takes Keras 3 variables as sources.

    Same arguments as Horovod's (``compression=``, ``op=``, ``groups=``, ...).
    """
    return _Keras3Tape(hvd.DistributedGradientTape(gradtape, **kwargs))


def allreduce_gradients(grads, variables, compression=hvd.Compression.none, op=hvd.Average,
                        gradient_predivide_factor=1.0, sparse_as_dense=False,
                        process_set=hvd.global_process_set, device_dense="", device_sparse="", groups=None):
    """Allreduces each gradient under its variable's path (``None`` stays ``None``, on every rank alike).

    Prescale and postscale split the average as Horovod's own optimizers do
    for ``gradient_predivide_factor``. ``groups`` as Horovod's: a number of
    groups of consecutive gradients, or lists of variables (the others alone);
    each group is one ``hvd.grouped_allreduce``, whose two-stage tensors a
    compressor fuses (:mod:`horovod_qsgd.tensorflow.fusion`).
    """
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("horovod_qsgd: gradient_predivide_factor needs op=hvd.Average")
    prescale, postscale = ((1.0 / gradient_predivide_factor, gradient_predivide_factor) if op == hvd.Average
                           else (1.0, 1.0))
    options = dict(op=op, compression=compression, prescale_factor=prescale, postscale_factor=postscale,
                   process_set=process_set, device_dense=device_dense, device_sparse=device_sparse)
    grads = list(grads)
    reduced = [None] * len(grads)
    present = [i for i, grad in enumerate(grads) if grad is not None]
    for i in present:
        if sparse_as_dense and isinstance(grads[i], tf.IndexedSlices):
            grads[i] = tf.convert_to_tensor(grads[i])
    if groups is None:
        for i in present:
            reduced[i] = hvd.allreduce(grads[i], name=variable_name(variables[i]), **options)
        return reduced
    for group in _split_into_groups(present, variables, groups):
        for i, result in zip(group, _allreduce_group([grads[i] for i in group], [variables[i] for i in group],
                                                     options)):
            reduced[i] = result
    return reduced


def _split_into_groups(indices, variables, groups):
    """Horovod's grouping of the gradients at ``indices``: ``groups`` consecutive runs as even as possible,
    or one group per list of variables and one for each gradient in none."""
    if isinstance(groups, list):
        paths = {variable_name(variables[i]): i for i in indices}
        split = [[paths.pop(variable_name(v)) for v in group if variable_name(v) in paths] for group in groups]
        return [g for g in split if g] + [[i] for i in paths.values()]  # paths kept the indices' order
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"horovod_qsgd: groups={groups!r} must be a positive int or a list of lists of variables")
    size, extra = divmod(len(indices), groups)
    bounds = [k * size + min(k, extra) for k in range(groups + 1)]
    return [indices[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _allreduce_group(grads, variables, options):
    """One hvd.grouped_allreduce; a compressor names each gradient by its variable (``call_site`` reads this
    frame's ``grads`` and ``variables``)."""
    return hvd.grouped_allreduce(grads, **options)


def DistributedOptimizer(optimizer, compression=hvd.Compression.none, op=hvd.Average,
                         gradient_predivide_factor=1.0, sparse_as_dense=False,
                         process_set=hvd.global_process_set, device_dense="", device_sparse="", groups=None):
    """A Keras 3 optimizer that allreduces the gradients (with ``compression``) before applying them.

    Returns a new optimizer of a subclass of ``type(optimizer)``, built from
    ``optimizer.get_config()`` (wrap it before training), whose ``apply`` /
    ``apply_gradients`` first runs :func:`allreduce_gradients`. It saves and
    loads as the original class: a model saved as ``.keras`` and reloaded
    with ``keras.models.load_model`` has a plain optimizer again, which
    trains every rank alone; wrap it again
    (``model.compile(optimizer=DistributedOptimizer(model.optimizer, ...), ...)``). Each gradient is exchanged under its
    variable's path, so names are equal on every rank; compressor state (a
    ``tf.Module``) is checkpointed separately:
    ``tf.train.Checkpoint(model=model, optimizer=opt, compressor=compression)``.

    ``groups`` (as Horovod's: a number, or lists of variables) exchanges each
    group in one ``hvd.grouped_allreduce``: our compressors then send a
    group's two-stage tensors in one alltoall and one allgather.

    With ``gradient_accumulation_steps`` the allreduce runs on every
    micro-batch's gradients (correct, but no traffic is saved by accumulating).

    Under a ``mixed_float16`` policy ``compile`` wraps it in Keras's
    ``LossScaleOptimizer``, which applies it only where its rank's own
    gradients are finite: the ranks would then run different collectives
    and hang. When that wrapper builds it, the wrapper's finiteness check is
    made one verdict for all ranks (a one-element allreduce with op=Min per
    step), so every rank skips an overflowing step alike. Wrapping the other
    way, ``DistributedOptimizer(LossScaleOptimizer(opt))``, checks the
    allreduced gradients and needs no extra collective.
    """
    if not is_keras3_optimizer(optimizer):
        raise TypeError(
            f"horovod_qsgd: keras3.DistributedOptimizer wraps Keras 3 optimizers; got "
            f"{type(optimizer).__module__}.{type(optimizer).__qualname__}. For tf-keras "
            "(TF_USE_LEGACY_KERAS=1) use horovod.tensorflow.keras.DistributedOptimizer(..., compression=...).")
    options = dict(compression=compression, op=op, gradient_predivide_factor=gradient_predivide_factor,
                   sparse_as_dense=sparse_as_dense, process_set=process_set, device_dense=device_dense,
                   device_sparse=device_sparse, groups=groups)
    if groups is not None:
        _split_into_groups([], [], groups)  # a bad value is refused here, not at the first step
    base = type(optimizer)

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if trainable_variables is not None:
            variables = list(trainable_variables)
        elif self.built:
            variables = list(self._trainable_variables)
        else:
            return base.apply(self, grads, trainable_variables)  # raises Keras's own error
        return base.apply(self, allreduce_gradients(grads, variables, **options), variables)

    def build(self, variables):
        wrapper = _wrapping_loss_scale_optimizer(self)
        if wrapper is not None:
            _agree_on_finite_steps(wrapper, process_set)
        return base.build(self, variables)

    cls = type(base.__name__, (base,), {"apply": apply, "build": build, "__module__": base.__module__,
                                        "__qualname__": base.__qualname__, "_horovod_qsgd_options": options})
    return cls.from_config(optimizer.get_config())


def _wrapping_loss_scale_optimizer(optimizer):
    """The Keras ``LossScaleOptimizer`` whose ``build`` is building ``optimizer`` (its inner one), else None."""
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if (frame.f_code.co_name == "build" and owner is not optimizer
                and getattr(owner, "inner_optimizer", None) is optimizer and hasattr(owner, "check_finite")):
            return owner
        frame = frame.f_back
    return None


def _agree_on_finite_steps(wrapper, process_set):
    """Makes ``wrapper``'s finiteness check the verdict of all ranks: the step is finite where every rank's
    gradients are (an allreduce of one flag with op=Min), so that every rank applies or skips it alike."""
    local_check = wrapper.check_finite

    def check_finite(grads):
        finite = tf.cast(local_check(grads), tf.float32)
        everywhere = hvd.allreduce(tf.reshape(finite, [1]), name="horovod_qsgd.loss_scale.finite", op=hvd.Min,
                                   process_set=process_set)
        return tf.reshape(everywhere, []) > 0.5

    wrapper.check_finite = check_finite
