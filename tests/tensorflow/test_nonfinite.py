"""A step whose gradient holds inf or NaN on any rank: non-finite everywhere, and no trace in the state."""
import numpy as np
import pytest

from tests.nonfinite_cases import (assert_same_state, check_a_partial_overflow_keeps_nothing_of_the_step,
                                   check_discarded_steps, check_steps_right_after_a_discarded_one,
                                   check_training_through_overflows, make_compressor, residuals)

SHARED_LAUNCHES = "horovod.tensorflow"  # a launch per rank count and env with the TF modules (tests/multirank.py)


def _compressor(kind, exchange):
    import horovod_qsgd.tensorflow as adapter
    return make_compressor(adapter, kind, exchange)


def _check_discarded_steps(hvd, traced):
    import tensorflow as tf
    functions = {}

    def reduce(compressor, name, grad):
        def eager(x):
            return hvd.allreduce(x, name=name, compression=compressor, op=hvd.Sum)
        if traced and name not in functions:
            functions[name] = tf.function(eager)
        return (functions[name] if traced else eager)(tf.constant(grad)).numpy()

    check_discarded_steps(_compressor, hvd.rank(), hvd.size(), reduce,
                          lambda array, tag: hvd.allgather(tf.constant(array[None]), name=tag).numpy())
    check_steps_right_after_a_discarded_one(_compressor, hvd.rank(), reduce)

    def reduce_pair(compressor, tag, grads):
        def eager(a, b):
            return hvd.grouped_allreduce([a, b], name=tag, compression=compressor, op=hvd.Sum)
        if traced and tag not in functions:
            functions[tag] = tf.function(eager)
        return [t.numpy() for t in (functions[tag] if traced else eager)(*map(tf.constant, grads))]

    check_a_partial_overflow_keeps_nothing_of_the_step(_compressor, hvd.rank(), reduce_pair)


@pytest.mark.ranks(2, timeout=300)
def test_nonfinite_steps_are_discarded_eagerly_and_traced_on_two_ranks(hvd_tf):
    _check_discarded_steps(hvd_tf, traced=False)
    _check_discarded_steps(hvd_tf, traced=True)


@pytest.mark.ranks(3, timeout=360)
def test_nonfinite_steps_are_discarded_traced_on_three_ranks(hvd_tf):
    _check_discarded_steps(hvd_tf, traced=True)


def _residuals(compressor):
    return {name: residuals(compressor, name) for name in compressor.state_dict()["tensors"]}


def _train_with_loss_scale(hvd, kind, exchange, steps=60, overflow_steps=(3, 4, 20), leave_out=False):
    """A custom loop with tf-keras' LossScaleOptimizer and DistributedGradientTape inside tf.function; at
    ``overflow_steps`` rank 1's loss overflows (``leave_out``: those steps are not run at all).
    Returns (final loss over every rank's data, compressor or None)."""
    import tensorflow as tf
    keras = tf.keras
    compressor = None if kind == "none" else _compressor(kind, exchange)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="tanh"), keras.layers.Dense(1)])
    optimizer = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.05), initial_scale=2.0 ** 16)
    rng = np.random.default_rng(100 + hvd.rank())
    inputs = rng.standard_normal((256, 64)).astype(np.float32)
    targets = np.sin(inputs[:, :1] * 2) + inputs[:, 1:2] * 0.5

    @tf.function
    def train_step(x, y, factor):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y)) * factor
            scaled = optimizer.get_scaled_loss(loss)
        tape = hvd.DistributedGradientTape(tape, compression=compressor or hvd.Compression.none)
        grads = optimizer.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    for step in range(steps):
        batch = slice(32 * (step % 8), 32 * (step % 8 + 1))
        overflow = step in overflow_steps
        if overflow and leave_out:
            continue
        factor = np.float32(np.inf if overflow and hvd.rank() == 1 else 1.0)
        before = [v.numpy().copy() for v in model.trainable_variables]
        residuals = _residuals(compressor) if compressor is not None and step > 0 else None
        scale = float(optimizer.loss_scale)
        train_step(tf.constant(inputs[batch]), tf.constant(targets[batch]), tf.constant(factor))
        if overflow:  # skipped alike on every rank: weights and error feedback as before the step
            assert all(np.array_equal(b, v.numpy()) for b, v in zip(before, model.trainable_variables)), step
            assert float(optimizer.loss_scale) == scale / 2, f"{kind}: no overflow seen at step {step}"
            if residuals is not None:
                for name, entry in _residuals(compressor).items():
                    assert_same_state(entry, residuals[name])
        if compressor is not None:
            compressor.rescale_residuals(float(optimizer.loss_scale) / scale)  # residuals follow the loss scale
    for index, variable in enumerate(model.trainable_variables):
        value = variable.numpy()
        assert np.isfinite(value).all()
        rows = hvd.allgather(tf.constant(value.reshape(1, -1)), name=f"check.{kind}.{exchange}.{index}").numpy()
        assert all(np.array_equal(rows[0], row) for row in rows), f"{kind}: weights differ between ranks"
    loss = np.mean((model(inputs).numpy() - targets) ** 2, dtype=np.float32)
    return float(hvd.allreduce(tf.constant(loss), name=f"loss.{kind}.{exchange}", op=hvd.Average)), compressor


@pytest.mark.ranks(2, timeout=400, env={"TF_USE_LEGACY_KERAS": "1"})
def test_loss_scale_optimizer_skips_overflow_steps_alike_and_trains_like_uncompressed(hvd_tf):
    check_training_through_overflows(
        lambda kind, exchange, **kw: _train_with_loss_scale(hvd_tf, kind, exchange, **kw))
