"""An ordinary FSDP2 training script; the horovod_qsgd lines are the compressor and ``compress_reduce_scatter``.

    torchrun --nproc_per_node 2 examples/pytorch_fsdp_digits.py --compressor qsgd

No Horovod is needed. Each ``fully_shard`` module's gradient reduce-scatter sends every other rank's shard
compressed (QSGD-4: about 7.9x fewer bytes than fp32); each rank keeps its sharded gradient, as with FSDP2's
own reduce-scatter. Each rank saves the compressor's state with its checkpoint (``--checkpoint``): top-k's
error feedback differs between ranks, and QSGD's RNG step resumes.
"""
import argparse

import numpy as np
import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch.distributed.fsdp import fully_shard

from horovod_qsgd.fsdp import QSGD, TopK, compress_reduce_scatter


def main():
    parser = argparse.ArgumentParser(description="Digits MLP under FSDP2 with a compressed reduce-scatter")
    parser.add_argument("--compressor", default="qsgd", choices=["none", "qsgd", "topk"])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--checkpoint", default=None, help="save the compressor state here (per rank)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    order = torch.from_numpy(np.random.RandomState(1234).permutation(len(x)))
    train, test = order[:1437], order[1437:]
    shard = train[rank::size]

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    compressor = None
    if args.compressor != "none":
        compressor = compress_reduce_scatter(model, QSGD(bits=4) if args.compressor == "qsgd" else TopK(ratio=0.01))
    else:  # Gloo's reduce-scatter takes no AVG: FSDP2 then sums and divides itself
        for module in model.modules():
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

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
        stats = compressor.compression_stats(reset=True) if compressor is not None else {}
        if rank == 0:
            ratio = f", {stats['compression_ratio']:.1f}x fewer bytes sent" if stats else ""
            print(f"epoch {epoch}: loss {loss.item():.4f}, test accuracy {100 * accuracy:.2f}%{ratio}")
    if args.checkpoint and compressor is not None:
        torch.save(compressor.state_dict(), f"{args.checkpoint}.rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
