"""A custom TensorFlow training loop: hvd.DistributedGradientTape in tf.function, with compression and checkpoints.

    horovodrun -np 2 -H localhost:2 --gloo python examples/tensorflow_gradient_tape.py --compression topk
    # stop it, then resume from the last checkpoint, residuals and RNG step counters included:
    horovodrun -np 2 -H localhost:2 --gloo python examples/tensorflow_gradient_tape.py --compression topk

Three things differ from an uncompressed Horovod loop, and only the first is required:

1. ``compression=`` on the tape (create the compressor once, outside tf.function);
2. the compressor goes into ``tf.train.Checkpoint``: its error-feedback
   residuals and step counters are per-rank ``tf.Variable``\\ s, so every rank
   writes its own checkpoint;
3. ``compression_stats(reset=True)`` reports bytes before/after and
   encode/decode time since the last call.

The model uses plain ``tf.Variable``\\ s; with Keras 3 layers pass the tape
through ``horovod_qsgd.tensorflow.keras3.DistributedGradientTape``.
"""
import argparse

import numpy as np


def digits_split():
    """scikit-learn's digits, split 1437 train / 360 test as every example and study here splits them."""
    from sklearn.datasets import load_digits
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    order = np.random.RandomState(1234).permutation(len(x))
    train, test = order[:1437], order[1437:]
    return x[train], digits.target[train], x[test], digits.target[test]


def digits_mlp(sizes=(64, 256, 256, 10)):
    """(variables, logits): an MLP of plain tf.Variables, the same initial weights on every rank."""
    import tensorflow as tf
    rng = np.random.default_rng(0)
    variables = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        variables.append(tf.Variable(rng.uniform(-limit, limit, (fan_in, fan_out)).astype(np.float32),
                                     name=f"dense{i}/kernel"))
        variables.append(tf.Variable(np.zeros(fan_out, np.float32), name=f"dense{i}/bias"))

    def logits(x):
        for i in range(0, len(variables), 2):
            x = x @ variables[i] + variables[i + 1]
            if i + 2 < len(variables):
                x = tf.nn.relu(x)
        return x
    return variables, logits


def main(argv=None):
    parser = argparse.ArgumentParser(description="Digits MLP, custom loop, DistributedGradientTape")
    parser.add_argument("--compression", default="qsgd", choices=["none", "fp16", "qsgd", "topk", "randomk"])
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint-dir", default="/tmp/horovod_qsgd_tape_example")
    args = parser.parse_args(argv)

    import horovod.tensorflow as hvd
    import tensorflow as tf

    from horovod_qsgd.tensorflow import FP16, QSGD, NoCompression, RandomK, TopK

    hvd.init()
    x_train, y_train, x_test, y_test = digits_split()
    x_shard, y_shard = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]

    variables, logits = digits_mlp()

    compression = {"none": lambda: NoCompression, "fp16": lambda: FP16, "qsgd": lambda: QSGD(bits=args.bits),
                   "topk": lambda: TopK(ratio=0.01),
                   "randomk": lambda: RandomK(ratio=0.05, error_feedback=True)}[args.compression]()
    epoch = tf.Variable(0, dtype=tf.int64)
    tracked = dict(variables=variables, epoch=epoch)
    if hasattr(compression, "compression_stats"):
        tracked["compressor"] = compression
    checkpoint = tf.train.Checkpoint(**tracked)
    manager = tf.train.CheckpointManager(checkpoint, f"{args.checkpoint_dir}/rank{hvd.rank()}", max_to_keep=2)
    if manager.latest_checkpoint:
        checkpoint.restore(manager.latest_checkpoint)  # compressor state is restored when first used

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits(x)))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(args.lr * g)
        return loss

    order = np.random.default_rng(hvd.rank())
    while epoch.numpy() < args.epochs:
        perm = order.permutation(len(x_shard))
        for i in range(0, len(perm) - 31, 32):
            batch = perm[i:i + 32]
            loss = train_step(tf.constant(x_shard[batch]), tf.constant(y_shard[batch]))
        epoch.assign_add(1)
        manager.save()
        accuracy = np.mean(np.argmax(logits(tf.constant(x_test)).numpy(), 1) == y_test) * 100.0
        stats = compression.compression_stats(reset=True) if "compressor" in tracked else {}
        if hvd.rank() == 0:
            ratio = f", {stats['compression_ratio']:.1f}x fewer bytes sent" if stats else ""
            print(f"epoch {int(epoch.numpy())}: loss {float(loss):.4f}, test accuracy {accuracy:.2f}%{ratio}",
                  flush=True)


if __name__ == "__main__":
    main()
