"""Keras model.fit with compression: tf-keras (TF_USE_LEGACY_KERAS=1) through Horovod's own Keras optimizer.

The received gradients (recorded where the wrapped optimizer applies them)
are compared bitwise with the independent reference of
tests/tensorflow/reference.py, and two ranks fitting on different data must
end with identical weights, with and without compression: the check that
catches an optimizer that silently does not allreduce.
"""
from types import SimpleNamespace

import numpy as np
import pytest

from tests.tensorflow.reference import LEGACY_KERAS, Reference, gathered_rows, make

SHARED_LAUNCHES = "horovod.tensorflow"  # a launch per rank count and env with the TF modules (tests/multirank.py)

STEPS = 3


def keras_data(rank, samples=STEPS * 32):
    rng = np.random.default_rng(100 + rank)
    return rng.standard_normal((samples, 64)).astype(np.float32), rng.integers(0, 40, samples).astype(np.int32)


def functional_parts(keras, seed=0):
    """Inputs and outputs of the small test network (64 -> 300 relu -> 40), and an empty record holder.

    The records live in a SimpleNamespace, which Keras does not track: they are
    no weights of the model or optimizer (and no broadcast overwrites them).
    """
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(300, activation="relu", name="wide")(inputs)
    return inputs, keras.layers.Dense(40, name="head")(hidden), SimpleNamespace()


def attach_records(tf, model, records):
    """One local and one applied gradient record per trainable variable."""
    records.local = [tf.Variable(tf.zeros(v.shape), trainable=False) for v in model.trainable_variables]
    records.applied = [tf.Variable(tf.zeros(v.shape), trainable=False) for v in model.trainable_variables]
    return model


def build_recording_model(tf, keras, seed=0):
    """A model whose train_step records each step's local gradients, an optimizer class that records
    the gradients it applies (Horovod's wrapper calls it with the allreduced ones), and the records."""
    inputs, outputs, records = functional_parts(keras, seed)

    class RecordingModel(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape(persistent=True) as tape:
                loss = self.compiled_loss(y, self(x, training=True))
            for record, grad in zip(records.local, tape.gradient(loss, self.trainable_variables)):
                record.assign(grad)
            self.optimizer.minimize(loss, self.trainable_variables, tape=tape)
            return {"loss": loss}

    class RecordingSGD(keras.optimizers.SGD):
        def apply_gradients(self, grads_and_vars, *args, **kwargs):
            grads_and_vars = list(grads_and_vars)
            for record, (grad, _) in zip(records.applied, grads_and_vars):
                record.assign(grad)
            return super().apply_gradients(grads_and_vars, *args, **kwargs)

    return attach_records(tf, RecordingModel(inputs, outputs), records), RecordingSGD, records


def flat_weights(model):
    return np.concatenate([v.numpy().reshape(-1) for v in model.trainable_variables])


def fit_and_record(hvd, tf, keras, hvd_keras, compression, x, y, **wrapper_kwargs):
    model, optimizer_class, records = build_recording_model(tf, keras)
    optimizer = hvd_keras.DistributedOptimizer(optimizer_class(learning_rate=0.1), compression=compression,
                                               **wrapper_kwargs)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    steps = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps.append(([r.numpy() for r in records.local], [r.numpy() for r in records.applied]))

    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0), Record()])
    return model, steps


@pytest.mark.ranks(2, timeout=240, env=LEGACY_KERAS)
def test_fit_receives_average_of_decoded_payloads_and_ranks_agree(hvd_tf):
    import tensorflow as tf
    import horovod.tensorflow.keras as hvd_keras
    keras = tf.keras
    assert not keras.__name__.startswith("keras."), keras.__name__  # tf-keras, not Keras 3
    hvd = hvd_tf
    x, y = keras_data(hvd.rank())
    for kind in ("qsgd4", "topk"):
        compressor = make(kind)
        model, steps = fit_and_record(hvd, tf, keras, hvd_keras, compressor, x, y)
        assert len(steps) == STEPS
        reference = Reference(hvd, kind)
        names = [v.name.split(":")[0] for v in model.trainable_variables]
        assert names == ["wide/kernel", "wide/bias", "head/kernel", "head/bias"]
        for s, (local, received) in enumerate(steps):
            for name, g_local, g_received in zip(names, local, received):
                reference.check(name, g_local, g_received, f"{kind} fit step {s} {name}")
        assert compressor.compression_stats()["tensors_compressed"] == 2 * STEPS
        rows = gathered_rows(hvd, flat_weights(model), f"weights.{kind}")
        assert np.array_equal(rows[0], rows[1]), f"{kind}: ranks ended with different weights"

    # Without compression the same holds (and the data really differ between ranks).
    model, _ = fit_and_record(hvd, tf, keras, hvd_keras, hvd.Compression.none, x, y)
    rows = gathered_rows(hvd, flat_weights(model), "weights.none")
    assert np.array_equal(rows[0], rows[1]), "uncompressed: ranks ended with different weights"
    assert not np.array_equal(gathered_rows(hvd, x, "data")[0], gathered_rows(hvd, x, "data")[1])

    # Accumulating two batches per allreduce: one exchange per two steps, ranks still agree.
    compressor = make("qsgd4")
    model, _ = fit_and_record(hvd, tf, keras, hvd_keras, compressor, x, y, backward_passes_per_step=2)
    rows = gathered_rows(hvd, flat_weights(model), "weights.accumulated")
    assert np.array_equal(rows[0], rows[1]), "backward_passes_per_step=2: ranks ended with different weights"
    assert {n: int(v.numpy()) for n, v in compressor._steps.items()} == {"wide/kernel": STEPS // 2,
                                                                      "head/kernel": STEPS // 2}
