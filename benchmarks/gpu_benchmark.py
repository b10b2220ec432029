"""The CUDA kernels on a real GPU, against the GPU's own yardsticks measured in the same run.

Run on a machine with an NVIDIA GPU and PyTorch's CUDA build (no Horovod needed)::

    python benchmarks/gpu_benchmark.py [--numel 25000000] [--reps 20] [--out FILE.json]

Prints, and writes to ``--out``:

* QSGD-4 (bucket 512) encode, and decode + accumulate, as a fraction of a
  device-to-device copy of the same float32 buffer (``copy time / codec
  time``; issue #14's target: at least 0.6);
* top-k selection at ratios 0.001 and 0.01 (exact, Gaussian-k, sample;
  error feedback on) against ``torch.topk`` of the absolute values on the
  same GPU (``topk time / ours``; targets: Gaussian-k >= 3, exact >= 1);
* the first call's time of each (JIT compilation, in this process);
* a stream race: a gradient written on a side stream behind a long GPU
  sleep must be encoded after the write (PyTorch's current stream is the
  side stream, as in a job that computes gradients on one). The payload is
  compared with one made after a full synchronisation.

Times are CUDA-event medians on the stream the kernels run on.
"""

import argparse
import json
import os
import platform
import re
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gpu_time(torch, fn, reps, warmup=3):
    """Median milliseconds of ``fn`` on the current stream, CUDA events around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def first_call(torch, fn):
    """Seconds of the first call, compilation included, until the GPU is done."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def kernel_name(name):
    """numba's mangled kernel name -> the Python function's name (``..._kernel``), else torch's name cut short."""
    found = re.findall(r"([A-Za-z_]\w*?_kernel)", name)
    return found[0] if found else name[:48]


def codec_calls(torch, qsgd, topk_codec, x, payload, total, device, selectors):
    """{operation: a call of it}: QSGD-4's encode and decode, and a top-k 1% encode per selector."""
    from horovod_qsgd.torch_shared.arrays import as_array
    residual = torch.zeros_like(x)
    calls = {"qsgd4_encode": lambda: qsgd.encode(as_array(x), as_array(payload), step=1, key=1),
             "qsgd4_decode": lambda: qsgd.decode_accumulate(as_array(payload), as_array(total))}
    for selector in selectors:
        codec = topk_codec(ratio=0.01, selector=selector)
        out = torch.zeros(codec.max_payload_nbytes(x.numel()), dtype=torch.uint8, device=device)
        calls[f"{selector}_0.01_encode"] = (
            lambda c=codec, o=out: c.encode(as_array(x), as_array(o), step=0, key=1, residual=as_array(residual)))
    return calls


def profile(torch, calls, device, reps):
    """{operation: [(kernel, share of the GPU time, ms per call)]} from torch.profiler over ``reps`` calls."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    from horovod_qsgd.torch_shared.arrays import kernel_stream
    shares = {}
    for what, fn in calls.items():
        with kernel_stream(device):
            fn()
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(reps):
                    fn()
                torch.cuda.synchronize()
        per_kernel = {}
        for event in prof.events():
            if event.device_type.name == "CUDA":
                name = kernel_name(event.name)
                calls, us = per_kernel.get(name, (0, 0.0))
                per_kernel[name] = (calls + 1, us + event.time_range.elapsed_us())
        busy = sum(us for _, us in per_kernel.values()) or 1.0
        rows = sorted(per_kernel.items(), key=lambda item: -item[1][1])
        shares[what] = [(name, us / busy, us / reps / 1000, calls // reps) for name, (calls, us) in rows]
        print(f"{what}: {busy / reps / 1000:.3f} ms of kernels per call; " + ", ".join(
            f"{name} {share:.0%} ({calls}x)" for name, share, _, calls in shares[what][:6]))
    return shares


def empty_kernel():
    from numba import cuda

    @cuda.jit
    def empty(a, b, c, d):
        pass
    return empty


def launch_cost(torch, tensors, device, launches=500):
    """Host microseconds per launch of an empty kernel with 4 array arguments, launched the ways issue #51 asks to
    compare: ``launch_us_tensors`` (torch tensors converted per launch), ``launch_us_arrays`` (numba arrays made
    once: numba's dispatch), ``launch_us_configured`` (the grid configuration made once, as the kernels' callers
    could keep it) and ``launch_us_overload`` (the resolved overload's ``launch``: no per-call type dispatch). An
    option that fails on this numba-cuda gives ``<key>_error`` instead. CUDA graphs: :func:`graph_launch_cost`."""
    from numba import cuda
    from horovod_qsgd.torch_shared.arrays import as_array

    empty = empty_kernel()
    stream = cuda.external_stream(torch.cuda.current_stream(device).cuda_stream)
    arrays = [as_array(t) for t in tensors]
    empty[1, 32, stream](*arrays)
    torch.cuda.synchronize()
    configured = empty[1, 32, stream]

    def overload_launch():
        kernel = next(iter(empty.overloads.values()))
        return lambda: kernel.launch(arrays, (1, 1, 1), (32, 1, 1), stream, 0)

    options = {"tensors": lambda: (lambda: empty[1, 32, stream](*[as_array(t) for t in tensors])),
               "arrays": lambda: (lambda: empty[1, 32, stream](*arrays)),
               "configured": lambda: (lambda: configured(*arrays)),
               "overload": overload_launch}
    cost = {}
    for label, make in options.items():
        try:
            call = make()
            call()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(launches):
                call()
            cost[f"launch_us_{label}"] = (time.perf_counter() - start) / launches * 1e6
        except Exception as error:  # one option's failure must not hide the others
            cost[f"launch_us_{label}_error"] = repr(error)
        torch.cuda.synchronize()
    return cost


def graph_launch_cost(torch, tensors, device, captured=20, replays=50):
    """{'launch_us_graph': host microseconds per launch where ``captured`` launches of the empty kernel were
    captured once in a CUDA graph (numba launching on the capturing torch stream) and the graph is replayed}, or
    {'launch_us_graph_error': why not}. Run last: a failed capture can leave the device unusable."""
    from numba import cuda
    from horovod_qsgd.torch_shared.arrays import as_array
    try:
        empty = empty_kernel()
        arrays = [as_array(t) for t in tensors]
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
        with torch.cuda.stream(side):
            empty[1, 32, cuda.external_stream(side.cuda_stream)](*arrays)  # compiled and warmed outside the capture
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=side):
                on_capture = cuda.external_stream(torch.cuda.current_stream(device).cuda_stream)
                for _ in range(captured):
                    empty[1, 32, on_capture](*arrays)
        graph.replay()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(replays):
            graph.replay()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        return {"launch_us_graph": elapsed / (replays * captured) * 1e6}
    except Exception as error:
        return {"launch_us_graph_error": repr(error)}


def host_profile(torch, calls, device, reps=20):
    """Where the host's time goes in a call (cProfile): the kernels are a fraction of the time measured."""
    import cProfile
    import pstats
    from horovod_qsgd.torch_shared.arrays import kernel_stream
    for what, fn in calls.items():
        with kernel_stream(device):
            fn()
            torch.cuda.synchronize()
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
            profiler.disable()
        print(f"-- host profile of {reps} calls of {what}, by own time:")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", help="JSON file for the results")
    parser.add_argument("--profile", action="store_true",
                        help="also each kernel's share of the QSGD and top-k calls (torch.profiler)")
    parser.add_argument("--host-profile", action="store_true", help="also cProfile of the host's side of a call")
    args = parser.parse_args()

    import torch
    if not torch.cuda.is_available():
        sys.exit("gpu_benchmark: needs a CUDA GPU and PyTorch's CUDA build (torch.cuda.is_available() is False)")
    from horovod_qsgd.codecs import QSGDCodec, TopKCodec
    from horovod_qsgd.torch_shared.arrays import as_array, kernel_stream

    device = torch.device("cuda", torch.cuda.current_device())
    n, reps = args.numel, args.reps
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, device=device, generator=gen)
    results = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
               "python": platform.python_version(), "numel": n, "reps": reps}

    copy_dst = torch.empty_like(x)
    copy_ms = gpu_time(torch, lambda: copy_dst.copy_(x), reps)
    results["copy_ms"] = copy_ms
    print(f"{results['device']}: {n:,} float32 ({x.numel() * 4 / 1e6:.0f} MB); "
          f"device copy {copy_ms:.3f} ms = {x.numel() * 8 / copy_ms / 1e6:.0f} GB/s (read + write)")

    # -- QSGD-4 encode, decode + accumulate -------------------------------------------------------
    qsgd = QSGDCodec(bits=4, bucket_size=512)
    payload = torch.zeros(qsgd.max_payload_nbytes(n), dtype=torch.uint8, device=device)
    total = torch.zeros_like(x)
    with kernel_stream(device):
        steps = iter(range(10 ** 9))

        def encode():
            qsgd.encode(as_array(x), as_array(payload), step=next(steps), key=1)

        def decode():
            qsgd.decode_accumulate(as_array(payload), as_array(total))

        results["qsgd4_encode_first_s"] = first_call(torch, encode)
        results["qsgd4_decode_first_s"] = first_call(torch, decode)
        results["qsgd4_encode_ms"] = gpu_time(torch, encode, reps)
        results["qsgd4_decode_ms"] = gpu_time(torch, decode, reps)
    for what in ("encode", "decode"):
        ms = results[f"qsgd4_{what}_ms"]
        print(f"QSGD-4 {what:>6}: {ms:8.3f} ms = {copy_ms / ms:5.2f}x the device copy's speed "
              f"(first call {results[f'qsgd4_{what}_first_s']:.2f} s)")

    # -- selection against torch.topk ------------------------------------------------------------
    for ratio in (0.001, 0.01):
        k = max(1, int(n * ratio))
        topk_ms = gpu_time(torch, lambda: torch.topk(x.abs(), k, sorted=False), reps)
        results[f"torch_topk_{ratio}_ms"] = topk_ms
        print(f"ratio {ratio}: torch.topk(|x|) {topk_ms:.3f} ms")
        for selector in ("exact", "gaussian", "sample"):
            codec = TopKCodec(ratio=ratio, selector=selector)
            out = torch.zeros(codec.max_payload_nbytes(n), dtype=torch.uint8, device=device)
            residual = torch.zeros_like(x)
            with kernel_stream(device):
                def select():
                    codec.encode(as_array(x), as_array(out), step=0, key=1, residual=as_array(residual))
                first = first_call(torch, select)
                ms = gpu_time(torch, select, reps)
            results[f"{selector}_{ratio}_ms"], results[f"{selector}_{ratio}_first_s"] = ms, first
            print(f"  {selector:>8}: {ms:8.3f} ms = {topk_ms / ms:5.2f}x torch.topk's speed (first call {first:.2f} s)")

    # -- selection on inputs of many equal magnitudes ----------------------------------------------
    # The radix histogram's worst case: every thread of a block adds to one shared-memory bin.
    signs = torch.where(torch.randn(n, device=device, generator=gen) > 0, 1.0, -1.0)
    relu = torch.randn(n, device=device, generator=gen).clamp_(min=0) * (torch.rand(
        n, device=device, generator=gen) < 0.1)
    for label, data in (("relu-90%-zeros", relu), ("all-equal", signs)):
        k = max(1, int(n * 0.01))
        topk_ms = gpu_time(torch, lambda: torch.topk(data.abs(), k, sorted=False), reps)
        results[f"torch_topk_{label}_ms"] = topk_ms
        print(f"{label}, ratio 0.01: torch.topk(|x|) {topk_ms:.3f} ms")
        for selector in ("exact", "gaussian", "sample"):
            codec = TopKCodec(ratio=0.01, selector=selector, error_feedback=False)  # the same input every call
            out = torch.zeros(codec.max_payload_nbytes(n), dtype=torch.uint8, device=device)
            with kernel_stream(device):
                def select():
                    codec.encode(as_array(data), as_array(out), step=0, key=1)
                ms = gpu_time(torch, select, reps)
            results[f"{selector}_{label}_ms"] = ms
            print(f"  {selector:>8}: {ms:8.3f} ms = {topk_ms / ms:5.2f}x torch.topk's speed")

    # -- where the time goes: each kernel's share (CUPTI sees numba's launches too) ---------------
    if args.profile:
        try:
            calls = codec_calls(torch, qsgd, TopKCodec, x, payload, total, device, ("exact", "gaussian", "sample"))
            results["kernel_shares"] = profile(torch, calls, device, reps)
        except Exception as error:  # the profiler is a yardstick: its failure must not hide the race check
            results["kernel_shares_error"] = repr(error)
            print("profile failed:", repr(error))

    # -- what one launch costs the host: numba-cuda's dispatch of an empty kernel with 4 array arguments ----
    launches = launch_cost(torch, [x, payload, total, copy_dst], device)
    results.update(launches)
    print("one empty kernel launch, 4 array arguments, host time: " + ", ".join(
        f"{key[len('launch_us_'):]} {value:.1f} us" if isinstance(value, float) else f"{key}: {value}"
        for key, value in launches.items()))

    if args.host_profile:
        host_profile(torch, codec_calls(torch, qsgd, TopKCodec, x, payload, total, device, ("exact",)), device)

    # -- the stream race ---------------------------------------------------------------------------
    side = torch.cuda.Stream(device)
    source = torch.randn(n, device=device, generator=gen)

    def encode_behind_a_slow_write(on_torch_stream):
        grad, payload = torch.zeros_like(x), torch.zeros(qsgd.max_payload_nbytes(n), dtype=torch.uint8,
                                                          device=device)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # GPU cycles before the write lands
            grad.copy_(source)
            if on_torch_stream:
                with kernel_stream(device):
                    qsgd.encode(as_array(grad), as_array(payload), step=7, key=3)
            else:  # numba's own default stream, as before kernel_stream
                qsgd.encode(as_array(grad), as_array(payload), step=7, key=3)
        torch.cuda.synchronize()
        settled = torch.zeros_like(payload)
        with kernel_stream(device):
            qsgd.encode(as_array(grad), as_array(settled), step=7, key=3)
        torch.cuda.synchronize()
        return bool(torch.equal(payload, settled))

    results["stream_race_payload_equal"] = encode_behind_a_slow_write(True)
    results["stream_race_without_kernel_stream_equal"] = encode_behind_a_slow_write(False)
    print("stream race: the payload encoded on the side stream "
          f"{'equals' if results['stream_race_payload_equal'] else 'DIFFERS FROM'} the one encoded after a full "
          "synchronisation; on numba's default stream instead it "
          f"{'equals it too' if results['stream_race_without_kernel_stream_equal'] else 'differs (the race is real)'}")

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    save()  # before the capture, which may take the process down
    graph = graph_launch_cost(torch, [x, payload, total, copy_dst], device)
    results.update(graph)
    print("the same launches captured in a CUDA graph and replayed:", ", ".join(
        f"{value:.2f} us of host time per launch" if isinstance(value, float) else f"failed: {value}"
        for value in graph.values()))
    save()
    if not results["stream_race_payload_equal"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
