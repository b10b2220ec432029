"""One worker of an elastic job (tests/torch/test_elastic.py): 3 ranks, one lost, 2 ranks, one added, 3 ranks.

Run by ``horovodrun --min-np 2 --max-np 3 --host-discovery-script ...``.
Two models train side by side, each with its own optimizer and compressor,
all in one ``hvd.elastic.TorchState``:

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
after each commit, writes ``<out>/<pid>.npz``: its top-k accounting
(gradients contributed, results received, residual mass) as of that commit.
Settings come from the environment: ``ELASTIC_QSGD_EXCHANGE``,
``ELASTIC_TOPK_EXCHANGE``, ``ELASTIC_REJOIN_RATIO`` (the re-added worker's
top-k ratio: another value makes its settings differ).
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
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    vector = torch.nn.Module()
    vector.w = torch.nn.Parameter(torch.zeros(VECTOR_NUMEL))
    qsgd = QSGD(bits=4, min_numel=0, exchange=os.environ["ELASTIC_QSGD_EXCHANGE"])
    ratio = float(os.environ.get("ELASTIC_REJOIN_RATIO", RATIO)) if rejoined else RATIO
    topk = TopK(ratio=ratio, min_numel=0, exchange=os.environ["ELASTIC_TOPK_EXCHANGE"])
    mlp_opt = hvd.DistributedOptimizer(torch.optim.SGD(mlp.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=[("mlp." + n, p) for n, p in mlp.named_parameters()],
                                       compression=qsgd)
    vector_opt = hvd.DistributedOptimizer(torch.optim.SGD(vector.parameters(), lr=0.01),
                                          named_parameters=[("vector.w", vector.w)], compression=topk)
    state = hvd.elastic.TorchState(mlp=mlp, mlp_opt=mlp_opt, vector=vector, vector_opt=vector_opt, qsgd=qsgd,
                                   topk=topk, step=0, after_rejoin=0)
    log = open(os.path.join(out, f"{os.getpid()}.jsonl"), "a")
    accounting = {"contributed": np.zeros(VECTOR_NUMEL), "received": np.zeros(VECTOR_NUMEL)}
    committed = {}

    def record(**fields):
        log.write(json.dumps(dict(fields, pid=os.getpid(), size=hvd.size(), rank=hvd.rank())) + "\n")
        log.flush()

    def save_accounting():
        path = os.path.join(out, f"{os.getpid()}.npz")
        np.savez(path + ".tmp.npz", residual=residual_mass(topk, "vector.w", VECTOR_NUMEL), **accounting)
        os.replace(path + ".tmp.npz", path)

    def on_reset():
        accounting.update({k: v.copy() for k, v in committed.items()})
        record(event="reset", steps=qsgd.step_counters(), topk_steps=topk.step_counters())

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
            mlp_opt.zero_grad()
            vector_opt.zero_grad()
            torch.nn.functional.cross_entropy(mlp(x), y).backward()
            (vector.w * c).sum().backward()
            mlp_opt.step()
            vector_opt.step()
            accounting["contributed"] += c.double().numpy()
            accounting["received"] += vector.w.grad.double().numpy()  # the average: sum / ranks
            record(step=state.step, digest=digest(mlp, vector), steps=qsgd.step_counters(),
                   topk_steps=topk.step_counters())
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
