"""Horovod Elastic with a compressor: training goes on when a worker is lost or added.

On one machine, two "hosts" are ``localhost`` and this machine's own address
(Horovod runs both without ssh). Start with three workers and let the one on
the second host die at batch 30 (``--lose-worker-at``); Horovod blacklists
that host for a few seconds, the two others take back the last commit and
go on, and when the host is discovered again a new worker joins:

    ADDR=$(hostname -I | cut -d' ' -f1)
    printf 'localhost:2\\n%s:1\\n' "$ADDR" > /tmp/hosts
    printf '#!/bin/sh\\ncat /tmp/hosts\\n' > /tmp/discover.sh && chmod +x /tmp/discover.sh
    horovodrun --gloo -np 3 --min-np 2 --max-np 3 --host-discovery-script /tmp/discover.sh \\
        --blacklist-cooldown-range 2 3 python examples/pytorch_elastic_digits.py --lose-worker-at 30

(Editing /tmp/hosts while it runs adds or removes workers too.) The only
compression lines are the compressor and ``compression=compressor`` in the
elastic state, which commits its residuals and step counters with the model
and the optimizer and re-checks its settings among the new ranks after each
reset (:mod:`horovod_qsgd.torch.elastic`).
"""
import argparse
import os
import signal

import horovod.torch as hvd
import numpy as np
import torch
from sklearn.datasets import load_digits

from horovod_qsgd.torch import QSGD, TopK

BATCH = 32


def main():
    parser = argparse.ArgumentParser(description="Digits MLP under Horovod Elastic with gradient compression")
    parser.add_argument("--compression", default="qsgd", choices=["qsgd", "topk"])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--commit-every", type=int, default=10, help="batches between commits")
    parser.add_argument("--lose-worker-at", type=int, default=None,
                        help="the worker on a host other than localhost dies (SIGKILL) at this batch, once")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(0)
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    order = torch.from_numpy(np.random.RandomState(1234).permutation(len(x)))
    train_set = torch.utils.data.TensorDataset(x[order[:1437]], y[order[:1437]])
    test_x, test_y = x[order[1437:]], y[order[1437:]]

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    compressor = QSGD(bits=4, min_numel=1000) if args.compression == "qsgd" else TopK(ratio=0.01, min_numel=1000)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                         named_parameters=model.named_parameters(), compression=compressor)
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(train_set, batch_size=BATCH, sampler=sampler)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, compression=compressor, sampler=sampler,
                                   epoch=0, batches=0)
    lose_marker = f"/tmp/horovod_qsgd_elastic_example.{os.environ.get('HOROVOD_GLOO_RENDEZVOUS_PORT')}.lost"

    def on_reset():
        if hvd.rank() == 0:
            print(f"reset: now {hvd.size()} workers", flush=True)

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        while state.epoch < args.epochs:
            for x_batch, y_batch in loader:
                if (args.lose_worker_at == state.batches and os.environ.get("HOROVOD_HOSTNAME") != "localhost"
                        and not os.path.exists(lose_marker)):
                    open(lose_marker, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x_batch), y_batch)
                loss.backward()
                optimizer.step()
                sampler.record_batch(0, BATCH)
                state.batches += 1
                if state.batches % args.commit_every == 0:
                    state.commit()
            with torch.no_grad():
                accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
            stats = compressor.compression_stats(reset=True)
            if hvd.rank() == 0:
                print(f"epoch {state.epoch} on {hvd.size()} workers: loss {loss.item():.4f}, test accuracy "
                      f"{100 * accuracy:.2f}%, {stats['compression_ratio']:.1f}x fewer bytes sent", flush=True)
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()

    train(state)


if __name__ == "__main__":
    main()
