"""Error of the averaged gradient: allgather vs the two-stage exchange (not a test; one process, no Horovod).

    python benchmarks/two_stage_error.py [--ranks 2,4,8,16] [--numel 1000000] [--trials 5]

Simulates N ranks with the real codecs and the real two-stage code
(:class:`horovod_qsgd.common.two_stage.TwoStage`; the alltoall and the
allgather are done by slicing in this process) on gradients
``g_r = m + sigma * z_r`` (a shared mean m and per-rank noise, both standard
normal, sigma = 1), and prints the relative error of the decoded average,
``||avg_hat - avg|| / ||avg||``, as mean and standard deviation over
``--trials`` steps (independent rounding streams), for QSGD-4 with the
allgather, two stages with 4+4 bits, 4+8 bits and 8+8 bits, and the bytes a
rank sends per coordinate with each.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from horovod_qsgd.codecs import QSGDCodec  # noqa: E402
from horovod_qsgd.common.naming import rank_key  # noqa: E402
from horovod_qsgd.common.two_stage import TwoStage  # noqa: E402


def allgather_average(codec, grads, step):
    n = grads[0].size
    total = np.zeros(n, np.float32)
    sizes = []
    for r, g in enumerate(grads):
        out = np.zeros(codec.max_payload_nbytes(n), np.uint8)
        used = codec.encode(g, out, step=step, key=rank_key("t", r))
        codec.decode_accumulate(out[:used], total)
        sizes.append(used)
    return total / len(grads), sum(sizes) * (len(grads) - 1) / len(grads)  # each rank receives the others


def two_stage_average(first, second, grads, step):
    n, size = grads[0].size, len(grads)
    stages = [TwoStage(first, second, "t", n, size, r) for r in range(size)]
    slices = [[None] * size for _ in range(size)]  # slices[owner][sender]
    for r, (stage, g) in enumerate(zip(stages, grads)):
        out = np.zeros(stage.send_capacity(), np.uint8)
        splits = stage.encode_for_owners(g, out, step)
        offset = 0
        for owner, length in enumerate(splits):
            slices[owner][r] = out[offset:offset + length]
            offset += length
    received_total = 0
    sums = []
    for r, (stage, g) in enumerate(zip(stages, grads)):
        received = np.concatenate([slices[r][s] for s in range(size) if s != r] or [np.zeros(0, np.uint8)])
        received_total += received.size
        begin, end = stage.owned
        total = g[begin:end].copy()
        stage.accumulate_received(received, total)
        out = np.zeros(stage.owned_capacity(), np.uint8)
        used = stage.encode_owned(total, out, step)
        sums.append(out[:used])
    gathered = np.concatenate(sums)
    received_total += gathered.size * (size - 1)  # every rank receives the other owners' sums
    result = np.zeros(n, np.float32)
    stages[0].decode_gathered(gathered, result)
    return result / size, received_total / size


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="2,4,8,16")
    ap.add_argument("--numel", type=int, default=1_000_000)
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    q4, q8 = QSGDCodec(bits=4), QSGDCodec(bits=8)
    rows = [("allgather 4-bit", lambda g, s: allgather_average(q4, g, s)),
            ("two-stage 4+4", lambda g, s: two_stage_average(q4, q4, g, s)),
            ("two-stage 4+8", lambda g, s: two_stage_average(q4, q8, g, s)),
            ("two-stage 8+8", lambda g, s: two_stage_average(q8, q8, g, s)),
            ("allgather 8-bit", lambda g, s: allgather_average(q8, g, s))]
    print(f"relative error of the averaged gradient, n = {args.numel:,}, {args.trials} trials; "
          "payload bytes received per rank per coordinate")
    print(f"{'ranks':>5}  " + "  ".join(f"{name:>24s}" for name, _ in rows))
    rng = np.random.default_rng(0)
    for size in (int(x) for x in args.ranks.split(",")):
        errs = {name: [] for name, _ in rows}
        sent = {}
        for trial in range(args.trials):
            mean = rng.standard_normal(args.numel).astype(np.float32)
            grads = [mean + rng.standard_normal(args.numel).astype(np.float32) for _ in range(size)]
            exact = np.mean(np.stack(grads).astype(np.float64), axis=0)
            for name, fn in rows:
                avg, nbytes = fn(grads, trial)
                errs[name].append(np.linalg.norm(avg - exact) / np.linalg.norm(exact))
                sent[name] = nbytes / args.numel
        print(f"{size:>5}  " + "  ".join(
            f"{np.mean(errs[n]):.4f}±{np.std(errs[n]):.4f} {sent[n]:5.3f}B" for n, _ in rows))


if __name__ == "__main__":
    main()
