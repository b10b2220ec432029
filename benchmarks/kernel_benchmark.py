"""Kernel throughput on this machine (not a test).

    python benchmarks/kernel_benchmark.py [--sizes 1000000,25000000] [--reps 7]

For each size: QSGD-4 (bucket 512, max norm, fp32 scales, stochastic)
encode and decode+accumulate throughput in GB/s of float32 input and as a
ratio to ``np.copyto`` of the same buffer timed in the same run (ratio > 1:
faster than the copy); top-k selection (codec encode: select + compact +
payload) for the exact, gaussian and sample selectors at ratio 0.001 and
0.01, as a speed ratio against ``torch.topk(x.abs(), k)`` in the same run
(> 1: faster than torch); rows with error feedback are also compared with
torch doing the same work (``acc = x + r``, topk of ``acc.abs()``,
``r = acc`` with the sent entries zeroed).  The residual carries over
between repetitions, as in training on a constant gradient, so the
Gaussian threshold needs all three refinements there.  JIT warm-up runs
first; times are medians of max(``--reps``, 2e8 / n) repetitions (200 at
1M, 8 at 25M; minimum in brackets): on this VM the time of a
sub-millisecond call wanders by tens of percent from call to call.
"""

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from horovod_qsgd.codecs import QSGDCodec, TopKCodec  # noqa: E402
from horovod_qsgd.kernels import threading_layer  # noqa: E402


def timeit(fn, reps, warmup=2):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)), float(np.min(ts))


def fmt(t):
    return f"{t[0] * 1e3:8.2f} ms [{t[1] * 1e3:7.2f}]"


def bench_size(n, reps, torch):
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    gb = x.nbytes / 1e9
    dst = np.empty_like(x)
    copy = timeit(lambda: np.copyto(dst, x), reps)
    print(f"\n== n = {n:,} float32 ({x.nbytes / 1e6:.0f} MB); memcpy (np.copyto) {fmt(copy)} "
          f"= {gb / copy[0]:.1f} GB/s")

    q = QSGDCodec(bits=4, bucket_size=512)
    out = np.zeros(q.max_payload_nbytes(n), np.uint8)
    step = iter(range(10 ** 9))
    enc = timeit(lambda: q.encode(x, out, step=next(step), key=1), reps)
    nbytes = q.encode(x, out, step=0, key=1)
    acc = np.zeros(n, np.float32)
    dec = timeit(lambda: q.decode_accumulate(out[:nbytes], acc), reps)
    for name, t in (("QSGD-4 encode", enc), ("QSGD-4 decode+acc", dec)):
        print(f"{name:22s} {fmt(t)} = {gb / t[0]:6.2f} GB/s   {copy[0] / t[0]:5.2f}x memcpy speed "
              f"(target >= 0.5x)")

    if torch is None:
        print("torch not installed: top-k comparison skipped")
        return
    xt = torch.from_numpy(x)
    rt = torch.zeros_like(xt)

    def torch_topk_ef(k):
        acc = xt + rt
        _, i = torch.topk(acc.abs(), k)
        rt.copy_(acc)
        rt[i] = 0

    for ratio in (0.001, 0.01):
        k = max(1, int(ratio * n))
        tt = timeit(lambda: torch.topk(xt.abs(), k), max(3, reps // 2), warmup=1)
        rt.zero_()
        tte = timeit(lambda: torch_topk_ef(k), max(3, reps // 2), warmup=1)
        print(f"-- top-k ratio {ratio}: k = {k:,}; torch.topk(x.abs(), k) {fmt(tt)}; "
              f"with error feedback (acc = x + r, topk, r = acc, r[idx] = 0) {fmt(tte)}")
        for selector in ("exact", "gaussian", "sample"):
            for ef in (False, True):
                c = TopKCodec(ratio=ratio, selector=selector, error_feedback=ef)
                buf = np.zeros(c.max_payload_nbytes(n), np.uint8)
                r = np.zeros(n, np.float32) if ef else None
                t = timeit(lambda: c.encode(x, buf, step=1, key=1, residual=r), reps)
                target = {"exact": 3, "gaussian": 20}.get(selector)
                note = f"(target >= {target}x at ratio 0.001, 25M)" if target and ratio == 0.001 else ""
                vs_ef = f", {tte[0] / t[0]:5.1f}x torch with error feedback" if ef else ""
                print(f"   {selector:8s} ef={str(ef):5s} {fmt(t)}  {tt[0] / t[0]:6.1f}x faster than torch.topk"
                      f"{vs_ef} {note}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000000,25000000")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        torch = None
    import numba
    print(f"numba {numba.__version__} threads={numba.get_num_threads()} layer={threading_layer()}; "
          f"torch {torch.__version__ if torch else '-'} threads={torch.get_num_threads() if torch else '-'}; "
          f"cpus={os.cpu_count()}")
    for n in (int(s) for s in args.sizes.split(",")):
        bench_size(n, max(args.reps, 200_000_000 // n), torch)


if __name__ == "__main__":
    main()
