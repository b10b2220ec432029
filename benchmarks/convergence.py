"""Convergence study: does a model reach the same accuracy with compressed gradients?

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/convergence.py \
        --compressors none,qsgd-4bit,topk-1% --seeds 0,1,2 --out benchmarks/results/convergence

Data: scikit-learn's handwritten digits (1797 real 8x8 images shipped with
the package, no download), split 1437 train / 360 test with a fixed seed; each
rank trains on its own shard. Model: an MLP 64-256-256-10 whose two large
weight matrices are compressed (the last layer and the biases are below
``min_numel`` and go through plain allreduce). The same hyperparameters for
every compressor. Rank 0 writes per-epoch training loss and test accuracy,
and a plot of the loss curves.
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TRAIN_SIZE = 1437


def digits_split():
    import numpy as np
    from sklearn.datasets import load_digits
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    order = np.random.RandomState(1234).permutation(len(x))
    train, test = order[:TRAIN_SIZE], order[TRAIN_SIZE:]
    return x[train], digits.target[train], x[test], digits.target[test]


def train_digits_torch(hvd, compression, epochs=12, seed=0, lr=0.1, batch_size=32):
    """Trains on this rank's shard; returns (per-epoch mean loss over ranks, per-epoch test accuracy %)."""
    import torch
    x_train, y_train, x_test, y_test = (torch.from_numpy(a) for a in digits_split())
    shard = torch.arange(hvd.rank(), len(x_train), hvd.size())
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    generator = torch.Generator().manual_seed(seed * 1000 + hvd.rank())
    losses, accuracies = [], []
    for epoch in range(epochs):
        perm = shard[torch.randperm(len(shard), generator=generator)]
        total, batches = 0.0, 0
        for i in range(0, len(perm) - batch_size + 1, batch_size):
            batch = perm[i:i + batch_size]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x_train[batch]), y_train[batch].long())
            loss.backward()
            opt.step()
            total, batches = total + loss.item(), batches + 1
        mean_loss = hvd.allreduce(torch.tensor(total / batches), name=f"convergence.loss.{epoch}").item()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item() * 100.0
        losses.append(mean_loss)
        accuracies.append(accuracy)
    return losses, accuracies


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, runs in results.items():
        curves = np.array([r["loss"] for r in runs])
        ax.plot(np.arange(1, curves.shape[1] + 1), curves.mean(0), label=name)
    ax.set_yscale("log")
    ax.set_xlabel("epoch")
    ax.set_ylabel("training loss (mean over ranks and seeds)")
    ax.set_title("digits MLP, 2 ranks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    import horovod.torch as hvd
    import numpy as np
    import horovod_qsgd.torch as compressors
    from benchmarks.compressors import SPECS, build

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compressors", default=",".join(SPECS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "convergence"))
    args = parser.parse_args()
    hvd.init()
    results = {}
    for name in args.compressors.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            loss, accuracy = train_digits_torch(hvd, build(name, compressors), args.epochs, seed)
            results.setdefault(name, []).append({"seed": seed, "loss": loss, "accuracy": accuracy})
            if hvd.rank() == 0:
                print(f"{name:>15} seed {seed}: final loss {loss[-1]:.4f}, test accuracy {accuracy[-1]:.2f}%",
                      flush=True)
    if hvd.rank() != 0:
        return
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "convergence_pytorch.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.join(args.out, "convergence_pytorch.png"))
    base = np.mean([r["accuracy"][-1] for r in results.get("none", [])]) if "none" in results else None
    print(f"\n{'compressor':>15} {'accuracy %':>18} {'vs none':>8}")
    for name, runs in results.items():
        final = np.array([r["accuracy"][-1] for r in runs])
        spread = (final.max() - final.min()) / 2
        delta = f"{final.mean() - base:+.2f}" if base is not None else "-"
        print(f"{name:>15} {final.mean():>10.2f} +-{spread:<5.2f} {delta:>8}")


if __name__ == "__main__":
    main()
