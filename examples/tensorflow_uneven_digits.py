"""Uneven inputs in TensorFlow: each rank has a different number of batches, horovod_qsgd.tensorflow.Join.

    horovodrun -np 3 -H localhost:3 --gloo python examples/tensorflow_uneven_digits.py

Rank r trains on a share of the digits that grows with r, so the ranks run
out of batches at different steps. ``hvd.join()`` cannot answer compressed
payloads; ``Join`` lets a rank without data take part in the others' steps
with zero gradients, so every rank ends with the same weights:

1. make the ``Join`` right after the compressor, before the first step;
2. call the step through it (``join(x, y)``) inside ``with join:``.
"""
import argparse

import numpy as np


def main(argv=None):
    parser = argparse.ArgumentParser(description="Digits MLP, uneven shards, Join")
    parser.add_argument("--compression", default="qsgd", choices=["qsgd", "topk"])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)

    import horovod.tensorflow as hvd
    import tensorflow as tf

    from tensorflow_gradient_tape import digits_mlp, digits_split  # this directory is on sys.path as a script
    from horovod_qsgd.tensorflow import QSGD, Join, TopK

    hvd.init()
    x_train, y_train, x_test, y_test = digits_split()
    # rank r gets a share proportional to r + 1: 1/6, 2/6, 3/6 of the data at 3 ranks
    weights = np.arange(1, hvd.size() + 1)
    cuts = np.concatenate([[0], np.cumsum(weights)]) * len(x_train) // weights.sum()
    x_mine, y_mine = x_train[cuts[hvd.rank()]:cuts[hvd.rank() + 1]], y_train[cuts[hvd.rank()]:cuts[hvd.rank() + 1]]

    variables, logits = digits_mlp()

    compression = QSGD(bits=4, min_numel=1000) if args.compression == "qsgd" else TopK(ratio=0.01, min_numel=1000)
    optimizer = tf.keras.optimizers.SGD(0.1, momentum=0.9)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, logits(x), from_logits=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    join = Join(train_step, compression)
    batches = len(x_mine) // args.batch
    for epoch in range(args.epochs):
        order = np.random.default_rng(epoch + 100 * hvd.rank()).permutation(len(x_mine))
        with join:
            for b in range(batches):
                index = order[b * args.batch:(b + 1) * args.batch]
                join(tf.constant(x_mine[index]), tf.constant(y_mine[index]))
        accuracy = float(np.mean(np.argmax(logits(tf.constant(x_test)).numpy(), axis=1) == y_test))
        same = hvd.allgather(tf.reshape(variables[0], (1, -1)), name=f"check.{epoch}").numpy()
        stats = compression.compression_stats(reset=True)
        print(f"rank {hvd.rank()} epoch {epoch}: {batches} batches of its own, {join.shadow_steps} shadowed in all; "
              f"test accuracy {accuracy:.3f}; weights equal on every rank: {all((row == same[0]).all() for row in same)}; "
              f"{stats['compression_ratio']:.1f}x fewer bytes", flush=True)


if __name__ == "__main__":
    main()
