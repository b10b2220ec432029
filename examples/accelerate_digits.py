"""A Hugging Face Accelerate script; the horovod_qsgd lines register the hook after ``accelerator.prepare``.

    accelerate launch --num_processes 2 --cpu examples/accelerate_digits.py --compression qsgd
    torchrun --nproc_per_node 2 examples/accelerate_digits.py --compression qsgd      # the same
    accelerate launch --num_processes 2 examples/accelerate_digits.py --no-cpu --fsdp2     # GPUs only

Accelerate lists only its own hook types (``DDPCommunicationHookType``); any other DDP communication hook goes
on the model ``prepare`` returned, which is ``DistributedDataParallel`` on several processes:

    model, optimizer, train = accelerator.prepare(model, optimizer, train)
    model.register_comm_hook(state, qsgd_hook)

``--fsdp2``: FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``), ``compress_reduce_scatter`` installed
on the model ``prepare`` sharded. GPUs only, and not run here (no GPU): Accelerate 1.15 ignores the FSDP plugin
on CPU processes and wraps the model in DDP; the script says so and stops.

``--summary FILE`` writes each rank's outcome as ``FILE.rank<r>.json`` (the tests read it).
"""
import argparse
import hashlib
import json

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

from horovod_qsgd.ddp import QSGDState, TopKState, qsgd_hook, topk_hook


def model_and_data():
    set_seed(0)
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    order = torch.from_numpy(np.random.RandomState(1234).permutation(len(x)))
    train = DataLoader(TensorDataset(x[order[:1437]], y[order[:1437]]), batch_size=32, shuffle=True)
    test = DataLoader(TensorDataset(x[order[1437:]], y[order[1437:]]), batch_size=180)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    return model, train, test


def main(argv=None):
    """Trains; returns this rank's summary (see the module's docstring)."""
    parser = argparse.ArgumentParser(description="Digits MLP in Accelerate with a compressing DDP hook")
    parser.add_argument("--compression", default="qsgd", choices=["none", "qsgd", "topk"])
    parser.add_argument("--fsdp2", action="store_true", help="FSDP2 with a compressed reduce-scatter (GPUs only)")
    parser.add_argument("--cpu", action=argparse.BooleanOptionalAction, default=True,
                        help="train on CPU processes (default; --no-cpu: the GPUs)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--summary", default=None)
    args = parser.parse_args(argv)

    plugin = None
    if args.fsdp2:
        from accelerate import FullyShardedDataParallelPlugin
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True)
    accelerator = Accelerator(cpu=args.cpu, fsdp_plugin=plugin)
    if args.fsdp2 and accelerator.distributed_type != DistributedType.FSDP:
        raise SystemExit(f"--fsdp2: Accelerate chose {accelerator.distributed_type} and ignored the FSDP plugin: "
                         "it enables FSDP on accelerators only (GPUs, XPUs, ...), not on CPU processes "
                         "(accelerate 1.15, AcceleratorState). Run it on GPUs.")
    model, train, test = model_and_data()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer, train, test = accelerator.prepare(model, optimizer, train, test)

    state = None
    if args.compression != "none" and args.fsdp2:
        from horovod_qsgd.fsdp import QSGD, TopK, compress_reduce_scatter
        state = compress_reduce_scatter(model, QSGD(bits=4) if args.compression == "qsgd" else TopK(ratio=0.01))
    elif args.compression != "none":
        state = QSGDState(bits=4) if args.compression == "qsgd" else TopKState(ratio=0.01)
        model.register_comm_hook(state, qsgd_hook if args.compression == "qsgd" else topk_hook)

    for epoch in range(args.epochs):
        model.train()
        for x, y in train:
            optimizer.zero_grad()
            accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
            optimizer.step()
        model.eval()
        losses, hits, count = 0.0, 0, 0
        with torch.no_grad():
            for x, y in test:
                logits, y = accelerator.gather_for_metrics((model(x), y))
                losses += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
                hits, count = hits + int((logits.argmax(1) == y).sum()), count + len(y)
        stats = state.compression_stats() if state is not None else {}
        ratio = f", {stats['compression_ratio']:.1f}x fewer bytes sent" if stats else ""
        accelerator.print(f"epoch {epoch}: validation loss {losses / count:.4f}, accuracy "
                          f"{100 * hits / count:.2f}%{ratio}")

    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in accelerator.unwrap_model(model).parameters()]
    summary = {"val_loss": losses / count, "val_accuracy": hits / count,
               "parameters_sha256": hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in full)).hexdigest(),
               "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float))}}
    if args.summary:
        with open(f"{args.summary}.rank{accelerator.process_index}.json", "w") as f:
            json.dump(summary, f)
    return summary


if __name__ == "__main__":
    main()
