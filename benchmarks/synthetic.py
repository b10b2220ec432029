"""What the PyTorch and TensorFlow synthetic benchmarks share: flags, the timing loop, the report.

Each framework script builds its model and one training step, then hands
``run`` a :class:`Job` with the few framework-specific operations.
"""
import argparse
import collections
import json
import timeit
from dataclasses import dataclass
from typing import Callable

import numpy as np

from benchmarks import nodelab
from benchmarks.netlab import control_bytes_per_second, loopback_bytes


def parse_args(description, argv=None):
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="mlp25m", help="mlp25m, mlp10m, deep5m or cnn")
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
    parser.add_argument("--exchange", default="auto", choices=["auto", "allgather", "two_stage", "node_aware"],
                        help="QSGD's and TopK's exchange")
    parser.add_argument("--second-stage-bits", type=int, default=None, help="QSGD's second-stage bits")
    parser.add_argument("--fusion-threshold", type=int, default=None,
                        help="QSGD's and TopK's fusion_threshold (0: every two-stage tensor alone)")
    parser.add_argument("--groups", type=int, default=None,
                        help="TensorFlow: DistributedGradientTape's groups= (a grouped call's two-stage tensors fuse)")
    parser.add_argument("--local-only", action="store_true",
                        help="train without exchanging gradients: each rank's compute while N ranks share the machine")
    parser.add_argument("--json-out", help="write the measurements here (rank 0)")
    return parser.parse_args(argv)


def make_compression(args, adapter):
    """The compressor the flags ask for, from ``horovod_qsgd.torch`` or ``horovod_qsgd.tensorflow``."""
    fusion = {} if args.fusion_threshold is None else {"fusion_threshold": args.fusion_threshold}
    kinds = {
        "none": lambda: adapter.NoCompression,
        "fp16": lambda: adapter.FP16,
        "qsgd": lambda: adapter.QSGD(bits=args.bits, bucket_size=args.bucket_size, norm=args.norm,
                                     encoding=args.encoding, min_numel=args.min_numel, exchange=args.exchange,
                                     second_stage_bits=args.second_stage_bits, **fusion),
        "topk": lambda: adapter.TopK(ratio=args.ratio, selector=args.selector, min_numel=args.min_numel,
                                     exchange=args.exchange, **fusion),
        "randomk": lambda: adapter.RandomK(ratio=args.ratio, error_feedback=True, min_numel=args.min_numel),
    }
    return kinds[args.compression]()


@dataclass
class Job:
    framework: str
    rank: int
    size: int
    num_params: int
    compression: object
    step: Callable[[], None]            # one training step
    barrier: Callable[[], None]         # an allreduce all ranks wait for
    sum_over_ranks: Callable[[str, float], float]


def run(args, job):
    """Warm up, measure Horovod's idle traffic, time the steps, print Horovod-style lines, write JSON."""
    def log(msg):
        if job.rank == 0:
            print(msg, flush=True)

    log(f"Model: {args.model} ({job.num_params / 1e6:.1f}M parameters)")
    log(f"Batch size: {args.batch_size}")
    log(f"Compression: {job.compression!r}" if args.compression in ("qsgd", "topk", "randomk")
        else f"Compression: {args.compression}")
    log(f"Number of CPU ranks: {job.size}")
    log("Running warmup...")
    timeit.timeit(job.step, number=args.num_warmup_batches)
    stats_of = getattr(job.compression, "compression_stats", None)
    if stats_of:
        stats_of(reset=True)

    on_node = nodelab.on_a_node()
    control_rate = control_bytes_per_second(job.barrier, counters=nodelab.link_bytes if on_node else None)
    if on_node:  # under nodelab: Horovod's idle coordination on this node's NIC and loopback too
        control_rate, idle_links = control_rate
    log("Running benchmark...")
    job.barrier()
    wire_start = loopback_bytes()
    links_start = nodelab.link_bytes() if on_node else None
    img_secs, step_times = [], []
    for x in range(args.num_iters):
        elapsed = timeit.timeit(job.step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / elapsed
        log(f"Iter #{x}: {img_sec:.1f} img/sec per CPU")
        img_secs.append(img_sec)
        step_times.append(elapsed / args.num_batches_per_iter)
    job.barrier()
    wire_bytes = loopback_bytes() - wire_start
    steps = args.num_iters * args.num_batches_per_iter
    links = None
    if links_start is not None:  # under nodelab: every rank sees its node's counters; each adds its share
        share = 1.0 / nodelab.ranks_on_this_node()
        links = [job.sum_over_ranks(f"benchmark.links.{i}", share * (now - then))
                 for i, (now, then) in enumerate(zip(nodelab.link_bytes(), links_start))]
        idle_links = [job.sum_over_ranks(f"benchmark.idle_links.{i}", share * rate)
                      for i, rate in enumerate(idle_links)]

    img_sec_mean, img_sec_conf = np.mean(img_secs), 1.96 * np.std(img_secs)
    log(f"Img/sec per CPU: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    log(f"Total img/sec on {job.size} CPU(s): {job.size * img_sec_mean:.1f} +-{job.size * img_sec_conf:.1f}")

    stats = stats_of() if stats_of else {}
    summed = {k: job.sum_over_ranks(f"benchmark.stats.{k}", float(v))
              for k, v in sorted(stats.items()) if k not in ("compression_ratio", "exchanges")}
    if job.rank != 0:
        return
    step_seconds = float(np.median(step_times))
    result = {
        "framework": job.framework, "model": args.model, "parameters": job.num_params,
        "compression": args.compression, "compressor": repr(job.compression), "ranks": job.size,
        "batch_size": args.batch_size, "steps": steps,
        "img_sec_total": job.size * img_sec_mean, "img_sec_total_conf": job.size * img_sec_conf,
        "step_seconds": step_seconds,
        "wire_bytes_per_step": wire_bytes / steps,
        "control_bytes_per_step": control_rate * step_seconds,
        "payload_bytes_per_step": summed.get("bytes_sent", 0.0) / steps,
        "first_stage_bytes_per_step": summed.get("bytes_sent_first_stage", 0.0) / steps,
        "second_stage_bytes_per_step": summed.get("bytes_sent_second_stage", 0.0) / steps,
        "encode_seconds_per_step": summed.get("encode_seconds", 0.0) / job.size / steps,
        "decode_seconds_per_step": summed.get("decode_seconds", 0.0) / job.size / steps,
        "wait_seconds_per_step": summed.get("wait_seconds", 0.0) / job.size / steps,
        # the allgathers and alltoalls a rank started for compressed tensors (not the placeholders' allreduce)
        "collectives_per_step": summed.get("collectives_started", 0.0) / job.size / steps,
        # how many compressed tensors took each exchange (rank 0; "auto" decides per tensor)
        "exchanges_used": dict(collections.Counter(stats.get("exchanges", {}).values())),
    }
    log(f"Wire bytes per step (loopback, all ranks): {result['wire_bytes_per_step'] / 1e6:.2f} MB, "
        f"of which Horovod's idle coordination about {result['control_bytes_per_step'] / 1e6:.2f} MB")
    if links is not None:
        result["inter_node_bytes_per_step"], result["in_node_bytes_per_step"] = links[0] / steps, links[1] / steps
        # Horovod's coordination between nodes when idle, at this step's length: more than it sends during a
        # step, when its background thread runs the collectives instead of cycling
        result["inter_node_idle_bytes_per_step"] = idle_links[0] * step_seconds
        log(f"Bytes per step between nodes (all NICs): {links[0] / steps / 1e6:.2f} MB, inside nodes (all "
            f"loopbacks): {links[1] / steps / 1e6:.2f} MB")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
