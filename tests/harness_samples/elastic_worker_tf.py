"""The TensorFlow twin of ``elastic_worker.py`` (tests/tensorflow/test_elastic.py): 3 ranks, one lost, 2, 3.

One tf-keras model holds, for each ``exchange`` ("auto", "two_stage"), an
MLP trained on random batches with QSGD and a vector ``w`` whose gradient is
a random vector ``c(step, rank)`` sent with top-k and error feedback; each
part has its own ``hvd.DistributedGradientTape`` and compressor, and one
SGD optimizer applies them all. The step is one ``tf.function`` traced once
per process: after a reset it runs on a world of another size.

The worker on the host that is not ``localhost`` kills itself with SIGKILL
at step ``KILL_AT`` (once per job: a marker file). Every worker appends
per-step records to ``<out>/<pid>.jsonl`` and after each commit writes the
top-k accounting to ``<out>/<pid>.npz`` (see elastic_worker.py).
``ELASTIC_REJOIN_RATIO``: the re-added worker's top-k ratio.
"""
import hashlib
import json
import os
import signal
import sys
import time

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

from horovod_qsgd.tensorflow import QSGD, TopK, elastic

STEPS, KILL_AT, STEPS_AFTER_REJOIN, GIVE_UP_AT = 12, 4, 3, 300
VECTOR_NUMEL = 70_000  # above exchange="auto"'s two-stage threshold at 3 ranks
RATIO = 0.05
EXCHANGES = ("auto", "two_stage")


def residual_mass(compressor, numel):
    """The top-k compressor's residual plus its owner-side residual placed at its chunk (float64)."""
    from horovod_qsgd.common.two_stage import chunk_bounds
    mass = np.zeros(numel)
    for entry in compressor.state_dict()["tensors"].values():
        if entry["residual"] is not None:
            mass += entry["residual"]
        if entry.get("owner_residual") is not None:
            ranks, rank = entry["owner_layout"]
            begin, end = chunk_bounds(numel, ranks, 1)[rank]
            mass[begin:end] += entry["owner_residual"]
    return mass


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
    marker = os.path.join(out, "killed")
    rejoined = os.path.exists(marker)
    ratio = float(os.environ.get("ELASTIC_REJOIN_RATIO", RATIO)) if rejoined else RATIO
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
    def train_step(x, y, c):
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
            received[exchange] = grad  # the average: sum / ranks
        optimizer.apply_gradients(grads_and_vars)
        return received

    log = open(os.path.join(out, f"{os.getpid()}.jsonl"), "a")
    accounting = {f"topk_{e}.{field}": np.zeros(VECTOR_NUMEL) for e in EXCHANGES for field in ("contributed", "received")}
    committed = {}

    def record(**fields):
        log.write(json.dumps(dict(fields, pid=os.getpid(), size=hvd.size(), rank=hvd.rank(),
                                  traces=train_step.experimental_get_tracing_count())) + "\n")
        log.flush()

    def digest():
        return hashlib.sha1(b"".join(v.numpy().tobytes() for v in model.variables)).hexdigest()

    def save_accounting():
        path = os.path.join(out, f"{os.getpid()}.npz")
        np.savez(path + ".tmp.npz", **accounting,
                 **{f"topk_{e}.residual": residual_mass(compressors[f"topk_{e}"], VECTOR_NUMEL) for e in EXCHANGES})
        os.replace(path + ".tmp.npz", path)

    def on_reset():
        accounting.update({k: v.copy() for k, v in committed.items()})
        record(event="reset", steps={k: c.step_counters() for k, c in compressors.items()})

    state.register_reset_callbacks([on_reset])

    @elastic.run
    def train(state):
        while state.step < STEPS or state.after_rejoin < STEPS_AFTER_REJOIN:
            if state.step >= GIVE_UP_AT:
                raise RuntimeError("no worker rejoined")
            if os.environ["HOROVOD_HOSTNAME"] != "localhost" and state.step == KILL_AT \
                    and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            rng = np.random.default_rng(1000 * state.step + hvd.rank())
            x = rng.standard_normal((16, 32), dtype=np.float32)
            y = rng.integers(0, 4, 16)
            c = rng.standard_normal(VECTOR_NUMEL, dtype=np.float32)
            received = train_step(x, y, c)
            for exchange in EXCHANGES:
                accounting[f"topk_{exchange}.contributed"] += c
                accounting[f"topk_{exchange}.received"] += received[exchange].numpy()
            record(step=state.step, digest=digest(), steps={k: c.step_counters() for k, c in compressors.items()})
            state.step += 1
            if hvd.size() == 3 and os.path.exists(marker):
                state.after_rejoin += 1
            committed.update({k: v.copy() for k, v in accounting.items()})
            save_accounting()
            state.commit()
            time.sleep(0.2)

    train(state)
    record(event="done")


if __name__ == "__main__":
    main(sys.argv[1])
