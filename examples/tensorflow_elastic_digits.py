"""Horovod Elastic with a TensorFlow compressor: training goes on when a worker is lost or added.

The TensorFlow twin of ``pytorch_elastic_digits.py`` (its docstring tells how
two "hosts" run on one machine). With tf-keras:

    ADDR=$(hostname -I | cut -d' ' -f1)
    printf 'localhost:2\\n%s:1\\n' "$ADDR" > /tmp/hosts
    printf '#!/bin/sh\\ncat /tmp/hosts\\n' > /tmp/discover.sh && chmod +x /tmp/discover.sh
    TF_USE_LEGACY_KERAS=1 horovodrun --gloo -np 3 --min-np 2 --max-np 3 --host-discovery-script \\
        /tmp/discover.sh --blacklist-cooldown-range 2 3 python examples/tensorflow_elastic_digits.py \\
        --lose-worker-at 30

The compression lines: the compressor, ``compression=compressor`` in the
tape and in the elastic state (:mod:`horovod_qsgd.tensorflow.elastic`, which
commits its residuals and step counters with the model), and that state's
module's ``run`` in place of ``hvd.elastic.run``. The step is one
``tf.function``, traced once: it runs on 3, 2 and 3 workers alike.
"""
import argparse
import os
import signal

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

from horovod_qsgd.tensorflow import QSGD, TopK, elastic

BATCH = 32


def main():
    parser = argparse.ArgumentParser(description="Digits MLP under Horovod Elastic with gradient compression")
    parser.add_argument("--compression", default="qsgd", choices=["qsgd", "topk"])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--commit-every", type=int, default=10, help="batches between commits")
    parser.add_argument("--lose-worker-at", type=int, default=None,
                        help="the worker on a host other than localhost dies (SIGKILL) at this batch, once")
    args = parser.parse_args()

    hvd.init()
    tf.keras.utils.set_random_seed(0)
    digits = load_digits()
    x, y = (digits.data / 16.0).astype(np.float32), digits.target
    order = np.random.RandomState(1234).permutation(len(x))
    train_x, train_y, test_x, test_y = x[order[:1437]], y[order[:1437]], x[order[1437:]], y[order[1437:]]

    model = tf.keras.Sequential([tf.keras.layers.Dense(256, activation="relu"),
                                 tf.keras.layers.Dense(256, activation="relu"), tf.keras.layers.Dense(10)])
    model.build((None, 64))
    optimizer = tf.keras.optimizers.SGD(learning_rate=args.lr, momentum=0.9)
    optimizer.build(model.trainable_variables)  # its variables exist before the state broadcasts them
    compressor = QSGD(bits=4, min_numel=1000) if args.compression == "qsgd" else TopK(ratio=0.01, min_numel=1000)
    state = elastic.TensorFlowKerasState(model, optimizer, compression=compressor, epoch=0, batches=0,
                                         steps=0)
    lose_marker = f"/tmp/horovod_qsgd_elastic_example.{os.environ.get('HOROVOD_GLOO_RENDEZVOUS_PORT')}.lost"

    @tf.function
    def train_step(x_batch, y_batch):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                y_batch, model(x_batch, training=True), from_logits=True))
        tape = hvd.DistributedGradientTape(tape, compression=compressor)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def on_reset():
        if hvd.rank() == 0:
            print(f"reset: now {hvd.size()} workers", flush=True)

    state.register_reset_callbacks([on_reset])

    @elastic.run
    def train(state):
        while state.epoch < args.epochs:
            # this epoch's batches, dealt to the workers of the moment (after a reset, to the new ones)
            epoch_order = np.random.RandomState(state.epoch).permutation(len(train_x))
            batches = len(epoch_order) // (BATCH * hvd.size())
            while state.batches < batches:
                if (args.lose_worker_at == state.steps and os.environ.get("HOROVOD_HOSTNAME") != "localhost"
                        and not os.path.exists(lose_marker)):
                    open(lose_marker, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
                start = (state.batches * hvd.size() + hvd.rank()) * BATCH
                rows = epoch_order[start:start + BATCH]
                loss = train_step(train_x[rows], train_y[rows])
                state.batches += 1
                state.steps += 1
                if state.steps % args.commit_every == 0:
                    state.commit()
            accuracy = np.mean(np.argmax(model(test_x).numpy(), 1) == test_y)
            stats = compressor.compression_stats(reset=True)
            if hvd.rank() == 0:
                print(f"epoch {state.epoch} on {hvd.size()} workers: loss {float(loss):.4f}, test accuracy "
                      f"{100 * accuracy:.2f}%, {stats['compression_ratio']:.1f}x fewer bytes sent", flush=True)
            state.epoch += 1
            state.batches = 0
            state.commit()

    train(state)


if __name__ == "__main__":
    main()
