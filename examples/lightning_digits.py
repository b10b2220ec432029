"""A PyTorch Lightning script; the horovod_qsgd lines are one callback (and, for DiLoCo, the optimizer).

    torchrun --nproc_per_node 2 examples/lightning_digits.py --compression qsgd      # DDP, QSGD-4
    python examples/lightning_digits.py --devices 2 --compression qsgd               # Lightning launches them
    torchrun --nproc_per_node 2 examples/lightning_digits.py --strategy fsdp2        # ModelParallelStrategy
    torchrun --nproc_per_node 2 examples/lightning_digits.py --diloco                # local AdamW steps

On CPU ranks Lightning registers no communication hook (``DDPStrategy(ddp_comm_hook=...)`` works on CUDA only),
so the callback ``GradientCompression`` registers ours on the DDP model; on GPUs either works:

    trainer = L.Trainer(strategy=DDPStrategy(ddp_comm_state=state, ddp_comm_hook=qsgd_hook),
                        callbacks=[GradientCompression(state)])   # the callback then only logs

``--strategy fsdp2`` shards each layer with ``fully_shard`` in ``configure_model`` (Lightning's
``ModelParallelStrategy``); the callback installs the compressed reduce-scatter. ``--diloco`` returns
``horovod_qsgd.ddp.DiLoCo`` around AdamW from ``configure_optimizers``, with the ``LocalSteps`` callback.

``--summary FILE`` writes each rank's outcome (final validation loss, a checksum of its parameters, the bytes
the compressor counted) as ``FILE.rank<r>.json``: the tests read it.
"""
import argparse
import hashlib
import json
import os

import lightning as L
import numpy as np
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import horovod_qsgd.ddp
import horovod_qsgd.fsdp
from horovod_qsgd.lightning import GradientCompression, LocalSteps


def compressor(name, strategy):
    """The state the callback takes: horovod_qsgd.ddp's for DDP, horovod_qsgd.fsdp's for FSDP2."""
    if name == "none":
        return None
    module = horovod_qsgd.fsdp if strategy == "fsdp2" else horovod_qsgd.ddp
    if name == "qsgd":
        return (module.QSGD if strategy == "fsdp2" else module.QSGDState)(bits=4)
    return (module.TopK if strategy == "fsdp2" else module.TopKState)(ratio=0.01)


class DigitsMLP(L.LightningModule):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                       torch.nn.ReLU(), torch.nn.Linear(256, 10))

    def configure_model(self):
        if self.args.strategy != "fsdp2":
            return
        from torch.distributed.fsdp import fully_shard
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)
        if self.args.compression == "none":  # Gloo's reduce-scatter takes no AVG: FSDP2 sums and divides itself
            for module in self.modules():
                if hasattr(module, "set_force_sum_reduction_for_comms"):
                    module.set_force_sum_reduction_for_comms(True)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", torch.nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_accuracy", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        if self.args.diloco:
            inner = torch.optim.AdamW(self.parameters(), lr=self.args.lr)
            return horovod_qsgd.ddp.DiLoCo(inner, self, sync_every=self.args.sync_every,
                                           compression=compressor(self.args.compression, "ddp"),
                                           warmup_steps=self.args.warmup_steps)
        return torch.optim.SGD(self.parameters(), lr=self.args.lr, momentum=0.9)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Digits MLP in Lightning with a compressed gradient exchange")
    parser.add_argument("--compression", default="qsgd", choices=["none", "qsgd", "topk"])
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp2"])
    parser.add_argument("--diloco", action="store_true", help="DiLoCo around AdamW (the compression: its outer one)")
    parser.add_argument("--sync-every", type=int, default=8)
    parser.add_argument("--warmup-steps", type=int, default=16)
    parser.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 2)))
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=None, help="default: 0.1 (SGD), 3e-3 (DiLoCo's AdamW)")
    parser.add_argument("--summary", default=None)
    args = parser.parse_args(argv)
    args.lr = args.lr if args.lr is not None else (3e-3 if args.diloco else 0.1)
    return args


def data():
    """(train, validation) loaders of sklearn's digits; Lightning deals the training batches to the ranks."""
    L.seed_everything(0, verbose=False)
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    order = torch.from_numpy(np.random.RandomState(1234).permutation(len(x)))
    train = DataLoader(TensorDataset(x[order[:1437]], y[order[:1437]]), batch_size=32, shuffle=True)
    return train, DataLoader(TensorDataset(x[order[1437:]], y[order[1437:]]), batch_size=360)


def main(argv=None, callbacks=()):
    """Trains (``callbacks``: more of them, e.g. a test's probe); returns this rank's summary (see the module's
    docstring)."""
    args = parse_args(argv)
    train, test = data()
    callbacks, state = list(callbacks), None
    if args.diloco:
        callbacks.append(LocalSteps())
    elif args.compression != "none":
        state = compressor(args.compression, args.strategy)
        callbacks.append(GradientCompression(state))
    strategy = (ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
                if args.strategy == "fsdp2" else DDPStrategy(process_group_backend="gloo"))
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_epochs=args.epochs,
                        callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=10)
    model = DigitsMLP(args)
    trainer.fit(model, train, test)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    stats = (trainer.optimizers[0].compression_stats() if args.diloco else
             state.compression_stats() if state is not None else {})
    if trainer.global_rank == 0:
        ratio = f", {stats['compression_ratio']:.1f}x fewer bytes sent" if stats else ""
        print(f"validation loss {metrics['val_loss']:.4f}, accuracy {100 * metrics['val_accuracy']:.2f}%{ratio}")
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    summary = {"val_loss": metrics["val_loss"], "val_accuracy": metrics["val_accuracy"],
               "parameters_sha256": hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in full)).hexdigest(),
               "logged": {k: v for k, v in metrics.items() if k.startswith("compression/")},
               "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float))},
               "global_step": trainer.global_step}
    if args.summary:
        with open(f"{args.summary}.rank{trainer.global_rank}.json", "w") as f:
            json.dump(summary, f)
    return summary


if __name__ == "__main__":
    main()
