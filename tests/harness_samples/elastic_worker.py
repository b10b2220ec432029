"""One worker of an elastic job (tests/torch/test_elastic.py): 3 ranks, one lost, 2 ranks, one added, 3 ranks.

Run by ``horovodrun --min-np 2 --max-np 3 --host-discovery-script ...``.
Four models train side by side, each with its own optimizer and compressor,
all in one ``hvd.elastic.TorchState``, for each ``exchange`` ("auto",
"two_stage"):

* an MLP on random batches, compressed with QSGD;
* a vector ``w`` whose gradient is a random vector ``c(step, rank)`` (the
  loss is ``w . c``), compressed with top-k and error feedback: the mass
  it sends plus the residuals must add up to the gradients exactly.

The worker on the host that is not ``localhost`` kills itself with SIGKILL
at step ``KILL_AT`` (once per job: a marker file); Horovod blacklists that
host, the two others go on, and after the blacklist's cooldown the host is
discovered again and a new worker joins. The job ends once it has taken
``STEPS`` steps and at least ``STEPS_AFTER_REJOIN`` with the new worker.

Every worker process appends per-step records to ``<out>/<pid>.jsonl`` and,
after each commit, writes ``<out>/<pid>.npz``: each top-k vector's accounting
(gradients contributed, results received, residual mass) as of that commit.
``ELASTIC_REJOIN_RATIO`` in the environment: the re-added worker's top-k
ratio (another value makes its settings differ).
"""
import hashlib
import json
import os
import signal
import sys
import time

import numpy as np
import torch
import horovod.torch as hvd

from horovod_qsgd.torch import QSGD, TopK

STEPS, KILL_AT, STEPS_AFTER_REJOIN, GIVE_UP_AT = 12, 4, 3, 300
VECTOR_NUMEL = 70_000  # above exchange="auto"'s two-stage threshold at 3 ranks
RATIO = 0.05
EXCHANGES = ("auto", "two_stage")


def digest(*modules):
    return hashlib.sha1(b"".join(p.detach().numpy().tobytes() for m in modules for p in m.parameters())).hexdigest()


def residual_mass(compressor, name, numel):
    """The top-k compressor's residual of ``name`` plus its owner-side residual placed at its chunk (float64)."""
    from horovod_qsgd.common.two_stage import chunk_bounds
    mass = np.zeros(numel)
    entry = compressor.state_dict()["tensors"].get(name)
    if entry is None:
        return mass
    if entry["residual"] is not None:
        mass += entry["residual"].double().numpy()
    if entry["owner_residual"] is not None:
        ranks, rank = entry["owner_layout"]
        begin, end = chunk_bounds(numel, ranks, 1)[rank]
        mass[begin:end] += entry["owner_residual"].double().numpy()
    return mass


def main(out):
    hvd.init()
    marker = os.path.join(out, "killed")
    rejoined = os.path.exists(marker)  # a worker started after the loss
    ratio = float(os.environ.get("ELASTIC_REJOIN_RATIO", RATIO)) if rejoined else RATIO
    torch.manual_seed(0)
    models, optimizers, compressors = {}, {}, {}
    for exchange in EXCHANGES:
        mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        vector = torch.nn.Module()
        vector.w = torch.nn.Parameter(torch.zeros(VECTOR_NUMEL))
        for kind, model, compressor, optimizer in (
                ("qsgd", mlp, QSGD(bits=4, min_numel=0, exchange=exchange),
                 torch.optim.SGD(mlp.parameters(), lr=0.05, momentum=0.9)),
                ("topk", vector, TopK(ratio=ratio, min_numel=0, exchange=exchange),
                 torch.optim.SGD(vector.parameters(), lr=0.01))):
            key = f"{kind}_{exchange}"
            models[key], compressors[key] = model, compressor
            optimizers[key] = hvd.DistributedOptimizer(
                optimizer, named_parameters=[(f"{key}.{n}", p) for n, p in model.named_parameters()],
                compression=compressor)
    state = hvd.elastic.TorchState(**{f"model_{k}": m for k, m in models.items()},
                                   **{f"optimizer_{k}": o for k, o in optimizers.items()},
                                   **{f"compression_{k}": c for k, c in compressors.items()}, step=0, after_rejoin=0)
    vectors = [k for k in models if k.startswith("topk")]
    log = open(os.path.join(out, f"{os.getpid()}.jsonl"), "a")
    accounting = {f"{k}.{field}": np.zeros(VECTOR_NUMEL) for k in vectors for field in ("contributed", "received")}
    committed = {}

    def record(**fields):
        log.write(json.dumps(dict(fields, pid=os.getpid(), size=hvd.size(), rank=hvd.rank())) + "\n")
        log.flush()

    def save_accounting():
        path = os.path.join(out, f"{os.getpid()}.npz")
        np.savez(path + ".tmp.npz", **accounting,
                 **{f"{k}.residual": residual_mass(compressors[k], f"{k}.w", VECTOR_NUMEL) for k in vectors})
        os.replace(path + ".tmp.npz", path)

    def on_reset():
        accounting.update({k: v.copy() for k, v in committed.items()})
        record(event="reset", steps={k: c.step_counters() for k, c in compressors.items()})

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        while state.step < STEPS or state.after_rejoin < STEPS_AFTER_REJOIN:
            if state.step >= GIVE_UP_AT:
                raise RuntimeError("no worker rejoined")
            if os.environ["HOROVOD_HOSTNAME"] != "localhost" and state.step == KILL_AT \
                    and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            g = torch.Generator().manual_seed(1000 * state.step + hvd.rank())
            x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
            c = torch.randn(VECTOR_NUMEL, generator=g)
            for optimizer in optimizers.values():
                optimizer.zero_grad()
            loss = sum(torch.nn.functional.cross_entropy(models[k](x), y) for k in models if k.startswith("qsgd"))
            (loss + sum((models[k].w * c).sum() for k in vectors)).backward()
            for optimizer in optimizers.values():
                optimizer.step()
            for k in vectors:
                accounting[f"{k}.contributed"] += c.double().numpy()
                accounting[f"{k}.received"] += models[k].w.grad.double().numpy()  # the average: sum / ranks
            record(step=state.step, digest=digest(*models.values()),
                   steps={k: c.step_counters() for k, c in compressors.items()})
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
