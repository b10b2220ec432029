"""An ordinary PyTorch DDP training script; the horovod_qsgd lines are the hook and its state.

    torchrun --nproc_per_node 2 examples/pytorch_ddp_digits.py --hook qsgd

No Horovod is needed. The hook compresses each DDP bucket (``bucket_cap_mb``, 25 MB by default) as one
tensor and returns the average, as DDP's own allreduce does. ``--hook powersgd`` runs PyTorch's PowerSGD
(rank 4, its recommended warm-up) for comparison. Each rank saves its hook state with the model: error
feedback differs between ranks (``--checkpoint``).
"""
import argparse

import numpy as np
import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from horovod_qsgd.ddp import QSGDState, TopKState, qsgd_hook, topk_hook


def hook_and_state(name):
    """(hook, state) for ``DistributedDataParallel.register_comm_hook``; (None, None): DDP's own allreduce."""
    if name == "qsgd":
        return qsgd_hook, QSGDState(bits=4)
    if name == "topk":
        return topk_hook, TopKState(ratio=0.01)
    if name == "fp16":
        return default_hooks.fp16_compress_hook, None
    if name == "powersgd":
        return powerSGD_hook.powerSGD_hook, powerSGD_hook.PowerSGDState(process_group=None,
                                                                        matrix_approximation_rank=4,
                                                                        start_powerSGD_iter=10)
    return None, None


def main():
    parser = argparse.ArgumentParser(description="Digits MLP with DDP and a compressing communication hook")
    parser.add_argument("--hook", default="qsgd", choices=["none", "fp16", "powersgd", "qsgd", "topk"])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--checkpoint", default=None, help="save model, optimizer and hook state here (per rank)")
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

    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10)))
    hook, state = hook_and_state(args.hook)
    if hook is not None:
        model.register_comm_hook(state, hook)
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
        stats = state.compression_stats(reset=True) if isinstance(state, (QSGDState, TopKState)) else {}
        if rank == 0:
            ratio = f", {stats['compression_ratio']:.1f}x fewer bytes sent" if stats else ""
            print(f"epoch {epoch}: loss {loss.item():.4f}, test accuracy {100 * accuracy:.2f}%{ratio}")
    if args.checkpoint:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "hook_state": state.state_dict() if isinstance(state, (QSGDState, TopKState)) else None},
                   f"{args.checkpoint}.rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
