"""An ordinary Horovod Keras training script; the only horovod_qsgd line is ``compression=``.

    horovodrun -np 2 -H localhost:2 --gloo python examples/tensorflow_keras_digits.py --compression qsgd
    horovodrun -np 2 -H localhost:2 --gloo python examples/tensorflow_keras_digits.py --keras 3

Keras versions
--------------
TensorFlow 2.21 ships Keras 3, and Horovod 0.28's Keras ``DistributedOptimizer``
silently does not allreduce Keras 3 gradients (each rank trains alone).

* ``--keras 2`` (default): tf-keras (``pip install tf-keras``) selected with
  ``TF_USE_LEGACY_KERAS=1`` before TensorFlow is imported; Horovod's own
  ``horovod.tensorflow.keras.DistributedOptimizer(..., compression=...)``.
* ``--keras 3``: Keras 3 with ``horovod_qsgd.tensorflow.keras3.DistributedOptimizer``,
  which allreduces (with compression) before every update.

Passing one of our compressors to Horovod's Keras wrapper around a Keras 3
optimizer raises an error with this fix instead of training silently apart.
Choose a compressor as in ``examples/pytorch_digits.py``; keep
``jit_compile=False`` (the codecs run as host ops).
"""
import argparse
import os

import numpy as np


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Digits MLP with Horovod Keras and gradient compression")
    parser.add_argument("--compression", default="qsgd", choices=["none", "fp16", "qsgd", "topk", "randomk"])
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--keras", type=int, default=2, choices=[2, 3])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.1)
    return parser.parse_args(argv)


def digits_split():
    """scikit-learn's digits, split 1437 train / 360 test as every example and study here splits them."""
    from sklearn.datasets import load_digits
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    order = np.random.RandomState(1234).permutation(len(x))
    train, test = order[:1437], order[1437:]
    return x[train], digits.target[train], x[test], digits.target[test]


def make_compression(name, bits=4):
    from horovod_qsgd.tensorflow import FP16, QSGD, NoCompression, RandomK, TopK
    return {"none": lambda: NoCompression, "fp16": lambda: FP16, "qsgd": lambda: QSGD(bits=bits),
            "topk": lambda: TopK(ratio=0.01), "randomk": lambda: RandomK(ratio=0.05, error_feedback=True)}[name]()


def train_digits(hvd, compression, keras_major=2, epochs=10, lr=0.1, batch_size=32, seed=0, verbose=0):
    """Fits a 64-256-256-10 MLP on this rank's shard; returns (per-epoch loss, final test accuracy %)."""
    if keras_major == 3:
        import keras
        from horovod_qsgd.tensorflow import keras3
        wrap = keras3.DistributedOptimizer
        callbacks = []
    else:
        import horovod.tensorflow.keras as hvd_keras
        import tensorflow as tf
        keras = tf.keras
        wrap = hvd_keras.DistributedOptimizer
        callbacks = [hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)]
    x_train, y_train, x_test, y_test = digits_split()
    x_shard, y_shard = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]
    keras.utils.set_random_seed(seed)  # the same initial weights on every rank
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
    optimizer = wrap(keras.optimizers.SGD(learning_rate=lr, momentum=0.9), compression=compression)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)
    keras.utils.set_random_seed(seed * 1000 + hvd.rank())  # each rank shuffles its own shard
    history = model.fit(x_shard, y_shard, batch_size=batch_size, epochs=epochs, shuffle=True,
                        callbacks=callbacks, verbose=verbose)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    return history.history["loss"], 100.0 * accuracy


def main(argv=None):
    args = parse_args(argv)
    if args.keras == 2:
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # before TensorFlow is imported
    import horovod.tensorflow as hvd
    hvd.init()
    compression = make_compression(args.compression, args.bits)
    losses, accuracy = train_digits(hvd, compression, args.keras, args.epochs, args.lr,
                                    verbose=2 if hvd.rank() == 0 else 0)
    stats = compression.compression_stats() if hasattr(compression, "compression_stats") else {}
    if hvd.rank() == 0:
        ratio = f", {stats['compression_ratio']:.1f}x fewer bytes sent" if stats else ""
        print(f"final loss {losses[-1]:.4f}, test accuracy {accuracy:.2f}%{ratio}")


if __name__ == "__main__":
    main()
