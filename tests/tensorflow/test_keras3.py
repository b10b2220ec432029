"""Keras 3 (TensorFlow 2.21's default Keras): a loud refusal where Horovod would silently not allreduce,
and horovod_qsgd.tensorflow.keras3 where it does, checked like the tf-keras path."""
import numpy as np
import pytest

from tests.tensorflow.reference import KERAS3, Reference, gathered_rows, make
from tests.tensorflow.test_keras import STEPS, attach_records, flat_weights, functional_parts, keras_data

SHARED_LAUNCHES = "horovod.tensorflow"  # a launch per rank count and env with the TF modules (tests/multirank.py)


def build_keras3_model(tf, keras, seed=0):
    """Keras 3 twin of test_keras.build_recording_model (train_step records local gradients, the
    optimizer class records what it applies)."""
    inputs, outputs, records = functional_parts(keras, seed)

    class RecordingModel(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            for record, grad in zip(records.local, grads):
                record.assign(grad)
            self.optimizer.apply(grads, self.trainable_variables)
            return {"loss": loss}

    class RecordingSGD(keras.optimizers.SGD):
        def apply(self, grads, trainable_variables=None):
            grads = list(grads)
            for record, grad in zip(records.applied, grads):
                record.assign(grad)
            return super().apply(grads, trainable_variables)

    return attach_records(tf, RecordingModel(inputs, outputs), records), RecordingSGD, records


def fit(keras, model, optimizer, x, y, records=None):
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    steps = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps.append(([r.numpy() for r in records.local], [r.numpy() for r in records.applied]))

    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[Record()] if records else [])
    return steps


@pytest.mark.ranks(2, timeout=240, env=KERAS3)
def test_keras3_fit_allreduces_with_compression_and_horovods_wrapper_is_refused(hvd_tf):
    import keras
    import tensorflow as tf
    import horovod.tensorflow.keras as hvd_keras
    from horovod_qsgd.tensorflow import QSGD, keras3
    from horovod_qsgd.tensorflow.call_site import variable_name
    hvd = hvd_tf
    assert int(keras.__version__.split(".")[0]) >= 3
    x, y = keras_data(hvd.rank())

    # Horovod's own Keras wrapper would train each rank on its own gradients: refused, with the fix.
    for wrap in (hvd_keras.DistributedOptimizer, hvd.DistributedOptimizer):
        with pytest.raises(TypeError, match="TF_USE_LEGACY_KERAS=1") as info:
            wrap(keras.optimizers.SGD(0.1), compression=QSGD())
        assert "keras3.DistributedOptimizer" in str(info.value)
    # ... and that is a real problem: without a compressor nothing stops it, and the ranks drift apart.
    model, _, _ = build_keras3_model(tf, keras)
    fit(keras, model, hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)), x, y)
    rows = gathered_rows(hvd, flat_weights(model), "weights.horovod_keras3")
    assert not np.array_equal(rows[0], rows[1]), "Horovod's Keras wrapper allreduces Keras 3 now: revisit the guard"

    for kind in ("qsgd4", "topk", None):
        compression = make(kind) if kind else hvd.Compression.none
        model, optimizer_class, records = build_keras3_model(tf, keras)
        optimizer = keras3.DistributedOptimizer(optimizer_class(learning_rate=0.1), compression=compression)
        assert type(optimizer).__name__ == "RecordingSGD" and isinstance(optimizer, optimizer_class)
        steps = fit(keras, model, optimizer, x, y, records)
        assert len(steps) == STEPS
        rows = gathered_rows(hvd, flat_weights(model), f"weights.{kind}")
        assert np.array_equal(rows[0], rows[1]), f"{kind}: ranks ended with different weights"
        if kind is None:
            continue
        names = [variable_name(v) for v in model.trainable_variables]
        assert len(set(names)) == 4 and all("/" in n for n in names), names
        reference = Reference(hvd, kind)
        for s, (local, received) in enumerate(steps):
            for name, g_local, g_received in zip(names, local, received):
                reference.check(name, g_local, g_received, f"keras3 {kind} step {s} {name}")
        assert sorted(compression._steps) == sorted(n for n in names if n.endswith("kernel"))


@pytest.mark.ranks(2, timeout=180, env=KERAS3)
def test_keras3_variables_through_distributed_gradient_tape(hvd_tf):
    import keras
    import tensorflow as tf
    from horovod_qsgd.tensorflow import keras3
    from horovod_qsgd.tensorflow.call_site import variable_name
    hvd = hvd_tf
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(300, activation="relu"),
                              keras.layers.Dense(40)])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    compression = make("topk")
    reference = Reference(hvd, "topk")

    @tf.function
    def step(x, y):
        with tf.GradientTape(persistent=True) as tape:
            loss = loss_fn(y, model(x, training=True))
        local = tape.gradient(loss, model.trainable_variables)
        received = keras3.DistributedGradientTape(tape, compression=compression).gradient(
            loss, model.trainable_variables)
        for v, g in zip(model.trainable_variables, received):
            v.assign_sub(0.1 * g)
        return local, received

    x, y = keras_data(hvd.rank())
    names = [variable_name(v) for v in model.trainable_variables]
    for s in range(STEPS):
        local, received = step(tf.constant(x[32 * s:32 * (s + 1)]), tf.constant(y[32 * s:32 * (s + 1)]))
        for name, g_local, g_received in zip(names, local, received):
            reference.check(name, g_local.numpy(), g_received.numpy(), f"keras3 tape step {s} {name}")
    rows = gathered_rows(hvd, flat_weights(model), "weights.tape")
    assert np.array_equal(rows[0], rows[1])
    # Plain Horovod fails on Keras 3 variables; the wrapper is what makes this work.
    with pytest.raises(AttributeError, match="ref"):
        with tf.GradientTape() as tape:
            loss = loss_fn(y[:32], model(x[:32]))
        hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)


def test_keras3_groups_are_split_as_horovods_and_bad_ones_are_refused():
    from types import SimpleNamespace

    from horovod_qsgd.tensorflow.keras3 import _split_into_groups
    variables = [SimpleNamespace(name=f"v{i}:0", path=f"model/v{i}") for i in range(5)]
    present = [0, 1, 2, 4]  # v3 has no gradient
    assert _split_into_groups(present, variables, 1) == [[0, 1, 2, 4]]
    assert _split_into_groups(present, variables, 3) == [[0, 1], [2], [4]]
    assert _split_into_groups(present, variables, 9) == [[0], [1], [2], [4]]
    # Lists of variables: a group each (in the list's order), the gradients in none alone.
    assert _split_into_groups(present, variables, [[variables[4], variables[0]], [variables[3]]]) == [[4, 0], [1], [2]]
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="must be a positive int or a list of lists of variables"):
            _split_into_groups(present, variables, bad)
    import keras
    from horovod_qsgd.tensorflow import keras3
    with pytest.raises(ValueError, match="groups=0 must be a positive int"):
        keras3.DistributedOptimizer(keras.optimizers.SGD(0.1), groups=0)  # refused when built, not at step 1


@pytest.mark.parametrize("num_ranks", [pytest.param(2, marks=pytest.mark.ranks(2, timeout=240, env=KERAS3)),
                                       pytest.param(3, marks=pytest.mark.ranks(3, timeout=240, env=KERAS3))])
def test_mixed_float16_fit_skips_an_overflow_on_one_rank_on_every_rank(hvd_tf, num_ranks):
    """``compile`` wraps the optimizer in Keras's LossScaleOptimizer under mixed_float16; rank 0's first batch
    overflows. Every rank skips that step alike (no rank waits for another), and the weights stay equal."""
    import keras
    import tensorflow as tf
    from horovod_qsgd.tensorflow import QSGD, keras3
    hvd = hvd_tf
    assert hvd.size() == num_ranks
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10)])
        rng = np.random.default_rng(hvd.rank())
        x = rng.standard_normal((96, 20)).astype(np.float32)
        y = rng.integers(0, 10, 96)
        if hvd.rank() == 0:
            x[:32] *= 1e6  # float16 overflows: the first step's gradients are not finite here alone
        optimizer = keras3.DistributedOptimizer(keras.optimizers.SGD(0.01), compression=QSGD(bits=4, min_numel=100))
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=False)
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        before = np.concatenate([w.numpy().ravel() for w in model.trainable_weights])
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        weights = np.concatenate([w.numpy().astype(np.float32).ravel() for w in model.trainable_weights])
        scale = float(model.optimizer.dynamic_scale.numpy())
        assert int(model.optimizer.iterations.numpy()) == 2  # the overflowing step was skipped
        assert scale == model.optimizer.initial_scale / 2, scale
        assert not np.array_equal(weights, before)
        rows = hvd.allgather(tf.constant(np.append(weights, scale)[None]), name="mixed.weights").numpy()
        assert all(np.array_equal(rows[0], row) for row in rows), "the ranks' weights differ"
    finally:
        keras.mixed_precision.set_global_policy("float32")
