"""TensorFlow's side of the codecs: one stateless ``tf.numpy_function`` per gradient runs the numba kernels.

The codecs work on numpy arrays; a TensorFlow graph calls them through
:func:`host_op`, which keeps the residual a value (read as it is, the new one
written into a new array that comes out: :class:`~horovod_qsgd.kernels.CarriedResidual`)
so that no variable's buffer is written behind TensorFlow's back and no two
gradients' host ops are ordered against each other. On a GPU this means a
device-to-host copy of each gradient and back.
"""
import time

import numpy as np
import tensorflow as tf

from horovod_qsgd.kernels import CarriedResidual


def flat_fp32(tensor):
    flat = tf.reshape(tensor, [-1])
    return flat if flat.dtype == tf.float32 else tf.cast(flat, tf.float32)


def host_op(fn, flat, step, residual, out_dtype, op_name):
    """``fn(x, step, residual) -> array`` as one stateless host op; returns (out, new residual or None).

    ``x`` is the flat fp32 gradient, ``step`` a Python int and ``residual``
    None or a :class:`~horovod_qsgd.kernels.CarriedResidual` that reads the
    residual's value and writes the new one into a new array, which comes
    back as the second output, so a variable's buffer is never written behind
    TensorFlow's back. Stateless, so that TensorFlow does not order it
    against other gradients' ops.
    """
    if residual is not None:
        def call(x, step_value, residual_value):
            new_residual = np.empty_like(residual_value)
            return fn(x, int(step_value), CarriedResidual(new_residual, residual_value)), new_residual

        out, new_residual = tf.numpy_function(call, [flat, step, residual], [out_dtype, tf.float32],
                                              stateful=False, name=op_name)
        new_residual.set_shape(flat.shape)
    else:
        out = tf.numpy_function(lambda x, step_value: fn(x, int(step_value), None), [flat, step], out_dtype,
                                stateful=False, name=op_name)
        new_residual = None
    out.set_shape([None])
    return out, new_residual


def values_gatherer(codec, key, on_gathered=None):
    """The host function that selects RandomK's values: what :func:`host_op` runs for RandomK."""
    def gather(x, step, residual):
        start = time.perf_counter()
        values = codec.gather(x, step=step, key=key, residual=residual)
        if on_gathered is not None:
            on_gathered(values.nbytes, time.perf_counter() - start)
        return values

    return gather
