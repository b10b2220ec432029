"""Refuse the combination that silently trains without allreduce: Horovod's Keras wrapper around a Keras 3 optimizer.

Horovod 0.28's ``horovod.tensorflow.keras.DistributedOptimizer`` overrides
methods (``_compute_gradients``, ``_aggregate_gradients``) that Keras 3
optimizers never call, so with Keras 3 each rank trains on its own gradients
and no compressor is ever called. While Horovod builds that wrapper it hashes
the ``compression=`` argument (its allreduce function cache is keyed by it);
the compressors call :func:`refuse_keras3_horovod_optimizer` from
``__hash__`` and raise there, with the fix in the message.
"""
import sys

_HOROVOD_KERAS_MODULE = "horovod._keras"
_MAX_DEPTH = 12

KERAS3_FIX = (
    "Either use tf-keras, the Keras 2 that Horovod supports: `pip install tf-keras` and set "
    "TF_USE_LEGACY_KERAS=1 in the environment before TensorFlow is imported (then tf.keras is tf_keras "
    "and Horovod's Keras DistributedOptimizer allreduces); or keep Keras 3 and wrap the optimizer with "
    "horovod_qsgd.tensorflow.keras3.DistributedOptimizer(optimizer, compression=...), which really "
    "allreduces with compression.")


def is_keras3_optimizer(obj):
    """True for an instance of a Keras >= 3 optimizer (not tf_keras / Keras 2)."""
    keras = sys.modules.get("keras")
    if keras is None or not hasattr(keras, "__version__"):
        return False
    try:
        major = int(str(keras.__version__).split(".")[0])
    except ValueError:
        return False
    if major < 3:
        return False
    base = getattr(getattr(keras, "optimizers", None), "Optimizer", None)
    return base is not None and isinstance(obj, base)


def refuse_keras3_horovod_optimizer():
    """Raises if Horovod's Keras DistributedOptimizer is wrapping a Keras 3 optimizer right now."""
    frame = sys._getframe(1)
    for _ in range(_MAX_DEPTH):
        frame = frame.f_back
        if frame is None:
            return
        if frame.f_globals.get("__name__") == _HOROVOD_KERAS_MODULE and frame.f_code.co_name == "__init__":
            optimizer = frame.f_locals.get("self")
            if is_keras3_optimizer(optimizer):
                raise TypeError(
                    f"horovod_qsgd: horovod.tensorflow.keras.DistributedOptimizer was given a Keras 3 optimizer "
                    f"({type(optimizer).__module__}.{type(optimizer).__qualname__}). Horovod 0.28 cannot "
                    "allreduce Keras 3 gradients: the wrapper would train every rank on its own gradients "
                    "and never call the compressor. " + KERAS3_FIX)
            return
