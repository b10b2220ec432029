"""An ordinary Horovod PyTorch script training a small byte-level transformer with AdamW, with DiLoCo instead of
hvd.DistributedOptimizer.

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_diloco_lm.py             # DiLoCo, QSGD-4
    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_diloco_lm.py --per-step  # for comparison

The one changed line is the optimizer wrapper::

    optimizer = DiLoCo(optimizer, model.named_parameters(), sync_every=16, compression=QSGD(bits=4))

(``hvd.DistributedOptimizer(optimizer, named_parameters=..., compression=...)`` before), plus
``optimizer.average_models()`` before evaluating or saving: every rank trains its own copy for
``sync_every`` steps, and the copies are equal only right after an outer step.

Choosing the settings
---------------------
* ``sync_every`` (H): bytes per step fall as 1/H. 16 and 32 with the 80-step warm-up kept the byte-level
  language model of ``benchmarks/results/diloco/`` within 0.02 nats of per-step AdamW at 2 ranks (1600 steps,
  QSGD-2: 103x and 131x fewer bytes), and 16 at 4 ranks (103x, just: +0.018); more ranks or a larger H cost
  quality (each inner AdamW sees 1/N of the batch).
* ``compression=QSGD(bits=4)``: the outer exchange at about 1/7 of float32's bytes; ``QSGD(bits=2)`` ended
  better still there, at 1/11.
* ``outer_lr`` / ``outer_momentum``: 0.7 / 0.8 by default (the outer lr falls in proportion below H = 16, more
  slowly with more ranks: successive outer steps then point alike and the momentum would multiply them); lower
  the momentum to 0.5 without a warm-up.
* ``warmup_steps`` (default 80): synchronous steps first, each costing an outer step's bytes; without them
  the copies drift apart early and the model ends far behind.
* ``hierarchical=True`` (``--hierarchical``) on nodes of several ranks each: the ranks of a node average every
  step and stay one model; only the outer exchange crosses between nodes (``docs/local-steps.md``).

The text is the interpreter's own standard library source (no download).
"""
import argparse
import glob
import os

import horovod.torch as hvd
import numpy as np
import torch

from horovod_qsgd.torch import QSGD, DiLoCo

CONTEXT, WIDTH = 64, 128


class ByteTransformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(256, WIDTH)
        self.position = torch.nn.Parameter(torch.randn(CONTEXT, WIDTH) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.out = torch.nn.Linear(WIDTH, 256)

    def forward(self, tokens):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        h = self.embedding(tokens) + self.position[:tokens.shape[1]]
        return self.out(self.blocks(h, mask=mask, is_causal=True))


def corpus():
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    text = b"".join(open(f, "rb").read() for f in files)
    cut = len(text) * 9 // 10
    return np.frombuffer(text[:cut], np.uint8), np.frombuffer(text[cut:], np.uint8)


def batch(data, rng, size):
    starts = rng.integers(0, len(data) - CONTEXT - 1, size)
    return torch.from_numpy(np.stack([data[s:s + CONTEXT + 1] for s in starts]).astype(np.int64))


def loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))


def main():
    parser = argparse.ArgumentParser(description="Byte-level transformer, AdamW, Horovod with DiLoCo")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--sync-every", type=int, default=16)
    parser.add_argument("--per-step", action="store_true", help="hvd.DistributedOptimizer instead (uncompressed)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hierarchical", action="store_true",
                        help="nodes of several ranks: average every step inside the node, DiLoCo between nodes")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(0)
    train, validation = corpus()
    model = ByteTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if args.per_step:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    else:
        optimizer = DiLoCo(optimizer, model.named_parameters(), sync_every=args.sync_every,
                           compression=QSGD(bits=4), hierarchical=args.hierarchical)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps,
                                                   pct_start=0.05)
    rng = np.random.default_rng(1 + hvd.rank())  # each rank its own batches: 16 of the global 16 * N
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = loss_of(model, batch(train, rng, 16))
        loss.backward()
        optimizer.step()
        schedule.step()
        if (step + 1) % 200 == 0 and hvd.rank() == 0:
            print(f"step {step + 1}: training loss {loss.item():.3f} (rank 0's own model)", flush=True)

    if not args.per_step:
        optimizer.average_models()
    with torch.no_grad():
        held_out = batch(validation, np.random.default_rng(0), 256)[hvd.rank()::hvd.size()]
        validation_loss = hvd.allreduce(loss_of(model, held_out), name="validation").item()
    if hvd.rank() == 0:
        if args.per_step:
            print(f"per-step AdamW: validation {validation_loss:.4f} nats per byte")
        else:
            stats = optimizer.compression_stats()
            every_step = args.steps * 4 * sum(p.numel() for p in model.parameters())  # a float32 gradient each
            print(f"DiLoCo: validation {validation_loss:.4f} nats per byte; {stats['warmup_steps']} warm-up and "
                  f"{stats['outer_steps']} outer steps, {stats['bytes_sent'] / 1e6:.2f} MB sent by this rank "
                  f"(between nodes where hierarchical), {every_step / stats['bytes_sent']:.0f}x fewer than a float32 "
                  "gradient every step")


if __name__ == "__main__":
    main()
