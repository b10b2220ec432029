"""An ordinary Horovod PyTorch training script; the only horovod_qsgd line is ``compression=``.

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_digits.py --compression qsgd

Choosing a compressor
---------------------
* ``QSGD(bits=8)``: 3.9x fewer bytes, accuracy indistinguishable from fp32;
  a safe first step on any link slower than the model's compute.
* ``QSGD(bits=4)`` (default here): 7.9x fewer bytes; unbiased, usually no
  tuning needed. ``bits=2`` (ternary, 15x) adds noticeable variance.
* ``TopK(ratio=0.01)``: 50x fewer bytes, error feedback keeps what is not
  sent; keep its residuals in checkpoints (``compressor.state_dict()``).
  ``selector="gaussian"`` selects much faster on large layers at the cost of
  an approximate k.
* ``RandomK``: cheapest to compute, converges slower; mostly a baseline.
From 3 ranks, large tensors take the two-stage exchange, whose bytes per
rank stay flat in the number of ranks; on a fast network with a fast
compute step plain allreduce may still win (the README's "Choosing a
compressor"). Measure with ``bash scripts/main_job.sh`` on your own network.
"""
import argparse

import horovod.torch as hvd
import numpy as np
import torch
from sklearn.datasets import load_digits

from horovod_qsgd.torch import FP16, QSGD, NoCompression, RandomK, TopK

COMPRESSION = {"none": lambda: NoCompression, "fp16": lambda: FP16, "qsgd": lambda: QSGD(bits=4),
               "topk": lambda: TopK(ratio=0.01), "randomk": lambda: RandomK(ratio=0.05, error_feedback=True)}


def main():
    parser = argparse.ArgumentParser(description="Digits MLP with Horovod and gradient compression")
    parser.add_argument("--compression", default="qsgd", choices=sorted(COMPRESSION))
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(0)
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    order = torch.from_numpy(np.random.RandomState(1234).permutation(len(x)))
    train, test = order[:1437], order[1437:]
    shard = train[hvd.rank()::hvd.size()]

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    compression = COMPRESSION[args.compression]()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    for epoch in range(args.epochs):
        perm = shard[torch.randperm(len(shard))]
        for i in range(0, len(perm) - 31, 32):
            batch = perm[i:i + 32]
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            accuracy = (model(x[test]).argmax(1) == y[test]).float().mean().item()
        stats = compression.compression_stats(reset=True) if hasattr(compression, "compression_stats") else {}
        if hvd.rank() == 0:
            ratio = f", {stats['compression_ratio']:.1f}x fewer bytes sent" if stats else ""
            print(f"epoch {epoch}: loss {loss.item():.4f}, test accuracy {100 * accuracy:.2f}%{ratio}")


if __name__ == "__main__":
    main()
