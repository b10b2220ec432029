"""One PyTorch worker of an elastic job (tests/torch/test_elastic.py): 3 ranks, one lost, 2 ranks, one added, 3 ranks.

Run by ``horovodrun --min-np 2 --max-np 3 --host-discovery-script ...``; the
job, its records and its accounting are ``elastic_script.py``'s. Four models
train side by side, each with its own optimizer and compressor, all in one
``hvd.elastic.TorchState``, for each ``exchange`` ("auto", "two_stage"):

* an MLP on random batches, compressed with QSGD;
* a vector ``w`` whose gradient is a random vector ``c(step, rank)`` (the
  loss is ``w . c``), compressed with top-k and error feedback: the mass
  it sends plus the residuals must add up to the gradients exactly.
"""
import hashlib
import sys

import torch
import horovod.torch as hvd

from elastic_script import EXCHANGES, VECTOR_NUMEL, Worker, topk_ratio
from horovod_qsgd.torch import QSGD, TopK
from tests.multirank import wait_politely


def main(out):
    wait_politely()  # 3 ranks on the 2-core machine: see tests/multirank.py
    hvd.init()
    ratio = topk_ratio(out)
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

    def digest():
        return hashlib.sha1(b"".join(p.detach().numpy().tobytes()
                                     for m in models.values() for p in m.parameters())).hexdigest()

    def train_step(step, rank):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
        c = torch.randn(VECTOR_NUMEL, generator=g)
        for optimizer in optimizers.values():
            optimizer.zero_grad()
        loss = sum(torch.nn.functional.cross_entropy(models[k](x), y) for k in models if k.startswith("qsgd"))
        (loss + sum((models[k].w * c).sum() for k in vectors)).backward()
        for optimizer in optimizers.values():
            optimizer.step()
        return c.double().numpy(), {k: models[k].w.grad.double().numpy() for k in vectors}

    Worker(out, hvd, compressors, digest).run(hvd.elastic.run, state, train_step)


if __name__ == "__main__":
    main(sys.argv[1])
