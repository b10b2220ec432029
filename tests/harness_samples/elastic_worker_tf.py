"""One TensorFlow worker of an elastic job (tests/tensorflow/test_elastic.py): 3 ranks, one lost, 2, 3.

Run by ``horovodrun --min-np 2 --max-np 3 --host-discovery-script ...``; the
job, its records and its accounting are ``elastic_script.py``'s. One
tf-keras model holds, for each ``exchange`` ("auto", "two_stage"), an MLP
trained on random batches with QSGD and a vector ``w`` whose gradient is a
random vector ``c(step, rank)`` sent with top-k and error feedback; each part
has its own ``hvd.DistributedGradientTape`` and compressor, and one SGD
optimizer applies them all. The step is one ``tf.function`` traced once per
process: after a reset it runs on a world of another size (records carry its
trace count).
"""
import hashlib
import sys

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

from elastic_script import EXCHANGES, VECTOR_NUMEL, Worker, topk_ratio
from horovod_qsgd.tensorflow import QSGD, TopK, elastic


class Parts(tf.keras.Model):
    def __init__(self):
        super().__init__()
        self.mlps, self.vectors = {}, {}
        for exchange in EXCHANGES:
            mlp = tf.keras.Sequential([tf.keras.layers.Dense(64, activation="relu"), tf.keras.layers.Dense(4)])
            mlp.build((None, 32))
            self.mlps[exchange] = mlp
            self.vectors[exchange] = self.add_weight(name=f"w_{exchange}", shape=(VECTOR_NUMEL,),
                                                     initializer="zeros")
        self.built = True


def main(out):
    hvd.init()
    ratio = topk_ratio(out)
    tf.keras.utils.set_random_seed(0)
    model = Parts()
    optimizer = tf.keras.optimizers.SGD(learning_rate=0.01)
    optimizer.build(model.trainable_variables)  # its variables exist before the state broadcasts them
    compressors = {}
    for exchange in EXCHANGES:
        compressors[f"qsgd_{exchange}"] = QSGD(bits=4, min_numel=0, exchange=exchange)
        compressors[f"topk_{exchange}"] = TopK(ratio=ratio, min_numel=0, exchange=exchange)
    state = elastic.TensorFlowKerasState(model, optimizer, **{f"compression_{k}": c for k, c in compressors.items()},
                                         step=0, after_rejoin=0)

    @tf.function
    def step_function(x, y, c):
        grads_and_vars, received = [], {}
        for exchange in EXCHANGES:
            mlp, w = model.mlps[exchange], model.vectors[exchange]
            with tf.GradientTape() as tape:
                logits = mlp(x)
                loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
            grads = hvd.DistributedGradientTape(tape, compression=compressors[f"qsgd_{exchange}"]).gradient(
                loss, mlp.trainable_variables)
            grads_and_vars += zip(grads, mlp.trainable_variables)
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * c)
            (grad,) = hvd.DistributedGradientTape(tape, compression=compressors[f"topk_{exchange}"]).gradient(
                loss, [w])
            grads_and_vars.append((grad, w))
            received[f"topk_{exchange}"] = grad
        optimizer.apply_gradients(grads_and_vars)
        return received

    def train_step(step, rank):
        rng = np.random.default_rng(1000 * step + rank)
        x = rng.standard_normal((16, 32), dtype=np.float32)
        y = rng.integers(0, 4, 16)
        c = rng.standard_normal(VECTOR_NUMEL, dtype=np.float32)
        return c, {k: v.numpy() for k, v in step_function(x, y, c).items()}

    def digest():
        return hashlib.sha1(b"".join(v.numpy().tobytes() for v in model.variables)).hexdigest()

    Worker(out, hvd, compressors, digest, extra=lambda: {"traces": step_function.experimental_get_tracing_count()}
           ).run(elastic.run, state, train_step)


if __name__ == "__main__":
    main(sys.argv[1])
