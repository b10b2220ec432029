"""What the PyTorch and TensorFlow elastic workers (``elastic_worker.py``, ``elastic_worker_tf.py``) share.

The job: 3 ranks, then the worker on the host that is not ``localhost``
kills itself with SIGKILL at step ``KILL_AT`` (once per job: a marker file),
2 ranks, then a new worker joins: 3 ranks. It ends once it has taken
``STEPS`` steps and at least ``STEPS_AFTER_REJOIN`` with the new worker.
Every worker process appends per-step records to ``<out>/<pid>.jsonl`` and,
after each commit, writes ``<out>/<pid>.npz``: each top-k vector's accounting
(gradients contributed, results received, residual mass) as of that commit.
``ELASTIC_REJOIN_RATIO`` in the environment: the re-added worker's top-k
ratio (another value makes its settings differ).
"""
import json
import os
import signal
import time

import numpy as np

from horovod_qsgd.common.chunks import chunk_bounds

STEPS, KILL_AT, STEPS_AFTER_REJOIN, GIVE_UP_AT = 12, 4, 3, 300
VECTOR_NUMEL = 70_000  # above exchange="auto"'s two-stage threshold at 3 ranks
RATIO = 0.05
EXCHANGES = ("auto", "two_stage")


def topk_ratio(out):
    """This worker's top-k ratio: ``ELASTIC_REJOIN_RATIO`` for a worker started after the loss."""
    rejoined = os.path.exists(os.path.join(out, "killed"))
    return float(os.environ.get("ELASTIC_REJOIN_RATIO", RATIO)) if rejoined else RATIO


def residual_mass(compressor, numel):
    """A top-k compressor's residuals plus its owner-side residuals placed at their chunks (float64)."""
    mass = np.zeros(numel)
    for entry in compressor.state_dict()["tensors"].values():
        if entry["residual"] is not None:
            mass += np.asarray(entry["residual"], dtype=np.float64)
        if entry.get("owner_residual") is not None:
            ranks, rank = entry["owner_layout"]
            begin, end = chunk_bounds(numel, ranks, 1)[rank]
            mass[begin:end] += np.asarray(entry["owner_residual"], dtype=np.float64)
    return mass


class Worker:
    """Records, top-k accounting and the step loop of one worker process.

    ``compressors``: by key ("qsgd_auto", "topk_two_stage", ...);
    ``digest()``: a hash of every parameter; ``extra()``: fields added to
    every record.
    """

    def __init__(self, out, hvd, compressors, digest, extra=dict):
        self.out, self.hvd, self.compressors, self.digest, self.extra = out, hvd, compressors, digest, extra
        self.marker = os.path.join(out, "killed")
        self.vectors = [k for k in compressors if k.startswith("topk")]
        self.log = open(os.path.join(out, f"{os.getpid()}.jsonl"), "a")
        self.accounting = {f"{k}.{field}": np.zeros(VECTOR_NUMEL)
                           for k in self.vectors for field in ("contributed", "received")}
        self.committed = {}

    def record(self, **fields):
        self.log.write(json.dumps(dict(fields, pid=os.getpid(), size=self.hvd.size(), rank=self.hvd.rank(),
                                       **self.extra())) + "\n")
        self.log.flush()

    def step_counters(self):
        return {k: c.step_counters() for k, c in self.compressors.items()}

    def save_accounting(self):
        path = os.path.join(self.out, f"{os.getpid()}.npz")
        np.savez(path + ".tmp.npz", **self.accounting,
                 **{f"{k}.residual": residual_mass(self.compressors[k], VECTOR_NUMEL) for k in self.vectors})
        os.replace(path + ".tmp.npz", path)

    def on_reset(self):
        self.accounting.update({k: v.copy() for k, v in self.committed.items()})
        self.record(event="reset", steps=self.step_counters())

    def run(self, elastic_run, state, train_step):
        """Trains under ``elastic_run`` (the framework's ``run`` decorator) until the job is done.

        ``train_step(step, rank)``: takes one step; returns (the gradient
        ``c`` this rank gave every top-k vector, {vector: the averaged
        gradient it received}), numpy.
        """
        state.register_reset_callbacks([self.on_reset])
        hvd = self.hvd

        @elastic_run
        def train(state):
            while state.step < STEPS or state.after_rejoin < STEPS_AFTER_REJOIN:
                if state.step >= GIVE_UP_AT:
                    raise RuntimeError("no worker rejoined")
                if os.environ["HOROVOD_HOSTNAME"] != "localhost" and state.step == KILL_AT \
                        and not os.path.exists(self.marker):
                    open(self.marker, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
                contributed, received = train_step(state.step, hvd.rank())
                for k in self.vectors:
                    self.accounting[f"{k}.contributed"] += contributed
                    self.accounting[f"{k}.received"] += received[k]  # the average: sum / ranks
                self.record(step=state.step, digest=self.digest(), steps=self.step_counters())
                state.step += 1
                if hvd.size() == 3 and os.path.exists(self.marker):
                    state.after_rejoin += 1
                self.committed.update({k: v.copy() for k, v in self.accounting.items()})
                self.save_accounting()
                state.commit()
                time.sleep(0.2)

        train(state)
        self.record(event="done")
