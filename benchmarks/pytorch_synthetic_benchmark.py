"""Synthetic PyTorch benchmark in the style of Horovod's pytorch_synthetic_benchmark.py.

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/pytorch_synthetic_benchmark.py \\
        --model mlp25m --compression qsgd --bits 4

Prints Horovod's ``Img/sec per ...`` / ``Total img/sec on N ...`` lines, and
with ``--json-out`` writes throughput, step time, loopback bytes per step
(from ``/proc/net/dev`` of the network namespace the job runs in, both ranks'
traffic; Horovod's idle coordination measured separately) and the
compressors' own statistics.
"""
import os
import sys

import torch

import horovod.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import horovod_qsgd.torch as adapter  # noqa: E402
from benchmarks import synthetic  # noqa: E402
from benchmarks.models_torch import build_model, input_shape  # noqa: E402


def main(argv=None):
    args = synthetic.parse_args(__doc__.split("\n\n")[0], argv)
    hvd.init()
    torch.manual_seed(0)
    model = build_model(args.model)
    compression = synthetic.make_compression(args, adapter)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if not args.local_only:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.randn(args.batch_size, *input_shape(args.model))
    target = torch.randint(0, 1000 if args.model.startswith("mlp") else 10, (args.batch_size,))

    def train_step():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(data), target).backward()
        optimizer.step()

    synthetic.run(args, synthetic.Job(
        framework="pytorch", rank=hvd.rank(), size=hvd.size(),
        num_params=sum(p.numel() for p in model.parameters()), compression=compression,
        step=train_step, barrier=lambda: hvd.allreduce(torch.zeros(1), name="benchmark.barrier"),
        sum_over_ranks=lambda name, value: hvd.allreduce(torch.tensor(value, dtype=torch.float64),
                                                         op=hvd.Sum, name=name).item()))


if __name__ == "__main__":
    main()
