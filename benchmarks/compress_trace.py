"""The package modules one PyTorch ``compress`` call passes through, in order, and how often it re-enters each.

    python benchmarks/compress_trace.py [--exchange allgather]

Runs ``QSGD(bits=4)`` on one Horovod rank (``hvd.init()`` without
horovodrun: the collectives are a rank's own), compresses a 100,000-element
tensor once through ``hvd.allreduce`` to warm up, then traces the second ``compress`` with
``sys.setprofile``: every call into a ``horovod_qsgd`` function is noted by
module, consecutive calls in one module are one visit. Prints the visits in
order, the modules, and each module's visits (a module entered more than
once is re-entered). numba-compiled kernels are not Python calls and do not
show; their Python launchers do.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exchange", default="allgather")
    args = parser.parse_args()
    import horovod.torch as hvd
    import torch

    import horovod_qsgd.torch as qtorch
    hvd.init()
    compression = qtorch.QSGD(bits=4, exchange=args.exchange, min_numel=0)
    grad = torch.randn(100_000)
    visits, traced = [], [False]

    def profile(frame, event, arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if module.startswith("horovod_qsgd") and (not visits or visits[-1] != module):
            visits.append(module)
    compress = compression.compress

    def traced_compress(tensor):
        if traced[0]:
            sys.setprofile(profile)
        try:
            return compress(tensor)
        finally:
            sys.setprofile(None)
    compression.compress = traced_compress
    for traced[0] in (False, True):
        visits.clear()
        hvd.allreduce(grad, name="w", op=hvd.Sum, compression=compression)
    counts = {}
    for module in visits:
        counts[module] = counts.get(module, 0) + 1
    print(f"compress, exchange={args.exchange}: {len(visits)} visits to {len(counts)} modules")
    print("  " + " -> ".join(m.replace("horovod_qsgd.", "") for m in visits))
    for module, count in sorted(counts.items(), key=lambda item: -item[1]):
        print(f"  {count:3d}  {module}")


if __name__ == "__main__":
    main()
