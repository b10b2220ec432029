"""An ordinary Horovod PyTorch training script, with SwarmSGD instead of hvd.DistributedOptimizer.

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_swarm_digits.py --quantization lattice8

The one changed line is the optimizer wrapper::

    optimizer = SwarmOptimizer(optimizer, model, local_steps=4, quantization="lattice8")

(``hvd.DistributedOptimizer(optimizer, named_parameters=...)`` before), plus
``optimizer.average_models()`` before evaluating: every rank trains its own
copy and averages it with one random partner every ``local_steps`` steps, so
the copies differ slightly until they are averaged globally.

Choosing the settings
---------------------
* ``local_steps`` (H): communication per step is 1/H of one model exchange;
  H = 4 is a good start, larger H saves more and lets the copies drift.
* ``quantization="lattice8"``: 1 byte per coordinate instead of 4; the
  quantization step follows the distance between the partners' models, so
  the error stays a small fraction of that distance.
* ``averaging="nonblocking"``: the exchange runs while the next H steps
  compute; useful when a round's transfer takes as long as some steps.
"""
import argparse

import horovod.torch as hvd
import numpy as np
import torch
from sklearn.datasets import load_digits

from horovod_qsgd.torch.swarm import SwarmOptimizer


def main():
    parser = argparse.ArgumentParser(description="Digits MLP with Horovod and SwarmSGD")
    parser.add_argument("--local-steps", type=int, default=4)
    parser.add_argument("--quantization", default="lattice8", help="lattice8 (3..8 bits) or none")
    parser.add_argument("--averaging", default="blocking", choices=["blocking", "nonblocking"])
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
    optimizer = SwarmOptimizer(optimizer, model, local_steps=args.local_steps,
                               quantization=None if args.quantization == "none" else args.quantization,
                               averaging=args.averaging)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

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
        stats = optimizer.compression_stats(reset=True)
        if hvd.rank() == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}, own model's test accuracy {100 * accuracy:.2f}%, "
                  f"{stats['bytes_sent'] / 1e3:.0f} kB sent in {stats['rounds']} rounds "
                  f"({stats['compression_ratio']:.1f}x fewer than exact), {stats['fallback_rounds']} fallbacks")

    optimizer.average_models()
    with torch.no_grad():
        accuracy = (model(x[test]).argmax(1) == y[test]).float().mean().item()
    if hvd.rank() == 0:
        print(f"averaged model: test accuracy {100 * accuracy:.2f}%")


if __name__ == "__main__":
    main()
