"""Synthetic PyTorch benchmark in the style of Horovod's pytorch_synthetic_benchmark.py.

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/pytorch_synthetic_benchmark.py \
        --model mlp25m --compression qsgd --bits 4

Prints Horovod's ``Img/sec per ...`` / ``Total img/sec on N ...`` lines, and
with ``--json-out`` writes throughput, step time, loopback bytes per step
(from ``/proc/net/dev`` of the network namespace the job runs in, both ranks'
traffic) and the compressors' own statistics.
"""
import argparse
import json
import os
import sys
import timeit

import numpy as np
import torch

import horovod.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.models_torch import build_model, input_shape  # noqa: E402
from benchmarks.netlab import control_bytes_per_second, loopback_bytes  # noqa: E402
from horovod_qsgd.torch import FP16, QSGD, NoCompression, RandomK, TopK  # noqa: E402


def make_compression(args):
    kinds = {
        "none": lambda: NoCompression,
        "fp16": lambda: FP16,
        "qsgd": lambda: QSGD(bits=args.bits, bucket_size=args.bucket_size, norm=args.norm,
                             encoding=args.encoding, min_numel=args.min_numel),
        "topk": lambda: TopK(ratio=args.ratio, selector=args.selector, min_numel=args.min_numel),
        "randomk": lambda: RandomK(ratio=args.ratio, error_feedback=True, min_numel=args.min_numel),
    }
    return kinds[args.compression]()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="mlp25m", help="mlp25m, mlp10m or cnn")
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
    parser.add_argument("--num-warmup-batches", type=int, default=2)
    parser.add_argument("--num-batches-per-iter", type=int, default=2)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--compression", default="none", choices=["none", "fp16", "qsgd", "topk", "randomk"])
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--bucket-size", type=int, default=512)
    parser.add_argument("--norm", default="max")
    parser.add_argument("--encoding", default="fixed")
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--selector", default="exact")
    parser.add_argument("--min-numel", type=int, default=10000)
    parser.add_argument("--json-out", help="write the measurements here (rank 0)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    torch.manual_seed(0)
    model = build_model(args.model)
    compression = make_compression(args)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.randn(args.batch_size, *input_shape(args.model))
    target = torch.randint(0, 1000 if args.model.startswith("mlp") else 10, (args.batch_size,))
    num_params = sum(p.numel() for p in model.parameters())

    def benchmark_step():
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    def log(msg):
        if hvd.rank() == 0:
            print(msg, flush=True)

    log(f"Model: {args.model} ({num_params / 1e6:.1f}M parameters)")
    log(f"Batch size: {args.batch_size}")
    log(f"Compression: {compression!r}" if args.compression in ("qsgd", "topk", "randomk")
        else f"Compression: {args.compression}")
    log(f"Number of CPU ranks: {hvd.size()}")
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    stats_of = getattr(compression, "compression_stats", None)
    if stats_of:
        stats_of(reset=True)

    def barrier():
        hvd.allreduce(torch.zeros(1), name="benchmark.barrier")

    control_rate = control_bytes_per_second(barrier)
    log("Running benchmark...")
    barrier()
    wire_start = loopback_bytes()
    img_secs, step_times = [], []
    for x in range(args.num_iters):
        elapsed = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / elapsed
        log(f"Iter #{x}: {img_sec:.1f} img/sec per CPU")
        img_secs.append(img_sec)
        step_times.append(elapsed / args.num_batches_per_iter)
    barrier()
    wire_bytes = loopback_bytes() - wire_start
    steps = args.num_iters * args.num_batches_per_iter

    img_sec_mean, img_sec_conf = np.mean(img_secs), 1.96 * np.std(img_secs)
    log(f"Img/sec per CPU: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    log(f"Total img/sec on {hvd.size()} CPU(s): {hvd.size() * img_sec_mean:.1f} "
        f"+-{hvd.size() * img_sec_conf:.1f}")

    stats = stats_of() if stats_of else {}
    summed = {k: hvd.allreduce(torch.tensor(float(v), dtype=torch.float64), op=hvd.Sum,
                               name=f"benchmark.stats.{k}").item()
              for k, v in sorted(stats.items()) if k != "compression_ratio"}
    if hvd.rank() == 0:
        result = {
            "framework": "pytorch", "model": args.model, "parameters": num_params,
            "compression": args.compression, "compressor": repr(compression), "ranks": hvd.size(),
            "batch_size": args.batch_size, "steps": steps,
            "img_sec_total": hvd.size() * img_sec_mean, "img_sec_total_conf": hvd.size() * img_sec_conf,
            "step_seconds": float(np.median(step_times)),
            "wire_bytes_per_step": wire_bytes / steps,
            "control_bytes_per_step": control_rate * float(np.median(step_times)),
            "payload_bytes_per_step": summed.get("bytes_sent", 0.0) / steps,
            "encode_seconds_per_step": summed.get("encode_seconds", 0.0) / hvd.size() / steps,
            "decode_seconds_per_step": summed.get("decode_seconds", 0.0) / hvd.size() / steps,
        }
        log(f"Wire bytes per step (loopback, all ranks): {result['wire_bytes_per_step'] / 1e6:.2f} MB, "
            f"of which Horovod's idle coordination about {result['control_bytes_per_step'] / 1e6:.2f} MB")
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
