"""Compare compressors under ``horovodrun -np 2`` on a real, shaped network.

    python benchmarks/compare.py --quick            # the README's main job, a few minutes
    python benchmarks/compare.py --rates 100mbit,1gbit,10gbit,none --out benchmarks/results/full

Each configuration runs the synthetic benchmark in a fresh private network
namespace whose loopback is shaped with ``tc`` to the given rate (``none``:
unshaped), and reports throughput, step time, bytes on the wire per step
(counted by the namespace's /proc/net/dev) and the time spent encoding and
decoding. Without root (no namespaces) it runs on the host's loopback,
unshaped, and says so.
"""
import argparse
import csv
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks import netlab, report  # noqa: E402
from benchmarks.compressors import STANDARD, benchmark_flags  # noqa: E402

QUICK = ["none", "fp16", "qsgd-4bit", "topk-1%", "gaussiank-0.1%", "randomk-1%"]


def run_one(framework, name, rate, args, out_dir):
    result_path = os.path.join(out_dir, f"{framework}-{args.model}-{name}-{rate}.json")
    if not (args.reuse and os.path.exists(result_path)):
        script = os.path.join(ROOT, "benchmarks", f"{framework}_synthetic_benchmark.py")
        job = [*netlab.HOROVODRUN, "-np", str(args.np), "-H", f"localhost:{args.np}", "--gloo", sys.executable,
               script, "--model", args.model, "--batch-size", str(args.batch_size), "--num-iters",
               str(args.num_iters), "--num-batches-per-iter", str(args.num_batches_per_iter),
               "--json-out", result_path, *benchmark_flags(name)]
        # One framework thread per rank, as the README advises for ranks sharing a machine: TensorFlow's
        # default pools (a thread per core each) held up the host ops (Top-k 0.1% at 1 Gbit/s: 5.38x -> 6.82x).
        netlab.run_horovod_job(job, rate, shaped=args.namespaces, timeout=args.timeout,
                               env=dict(os.environ, OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1",
                                        TF_NUM_INTEROP_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3"),
                               what=f"{framework} {name} at {rate}")
    with open(result_path) as f:
        return dict(json.load(f), name=name, rate=rate)


def print_table(results):
    baseline = {(r["framework"], r["rate"]): r for r in results if r["name"] == "none"}
    header = (f"{'rate':>8} {'compressor':<15} {'img/s':>8} {'step s':>8} {'wire MB/step':>13} "
              f"{'bytes vs none':>13} {'speedup':>8} {'enc+dec':>8}")
    print(header)
    print("-" * len(header))
    for r in results:
        base = baseline.get((r["framework"], r["rate"]))
        fewer = f"{base['wire_bytes_per_step'] / r['wire_bytes_per_step']:.1f}x" if base else "-"
        speedup = f"{r['img_sec_total'] / base['img_sec_total']:.2f}x" if base else "-"
        codec_share = (r["encode_seconds_per_step"] + r["decode_seconds_per_step"]) / r["step_seconds"]
        print(f"{r['rate']:>8} {r['name']:<15} {r['img_sec_total']:>8.1f} {r['step_seconds']:>8.3f} "
              f"{r['wire_bytes_per_step'] / 1e6:>13.2f} {fewer:>13} {speedup:>8} {codec_share:>7.0%}")
    sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the short main job: 1gbit, 6 compressors")
    parser.add_argument("--frameworks", default="pytorch", help="pytorch, tensorflow or both, comma-separated")
    parser.add_argument("--model", default="mlp25m")
    parser.add_argument("--compressors", default=",".join(STANDARD))
    parser.add_argument("--rates", default="1gbit", help="comma-separated tc rates, 'none' for unshaped")
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "latest"))
    parser.add_argument("--reuse", action="store_true",
                        help="take configurations already measured in --out from their JSON files "
                             "(to finish an interrupted sweep)")
    args = parser.parse_args()
    if args.quick:
        args.compressors, args.rates, args.num_iters = ",".join(QUICK), "1gbit", 3

    reason = netlab.unavailable_reason()
    args.namespaces = reason is None
    rates = args.rates.split(",")
    if not args.namespaces:
        print(f"note: {reason}; running unshaped on the host loopback (byte counts include other traffic)")
        rates = ["none"]
    names = args.compressors.split(",")
    frameworks = args.frameworks.split(",")
    unknown = set(frameworks) - {"pytorch", "tensorflow"}
    if unknown:
        parser.error(f"unknown framework(s) {sorted(unknown)}; use pytorch and/or tensorflow")
    os.makedirs(args.out, exist_ok=True)
    results, started = [], time.time()
    total = len(frameworks) * len(rates) * len(names)
    for framework in frameworks:
        for rate in rates:
            for name in names:
                print(f"[{len(results) + 1}/{total}] {framework} {name} at {rate} "
                      f"({time.time() - started:.0f} s so far)", flush=True)
                results.append(run_one(framework, name, rate, args, args.out))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted(set().union(*results)))
        writer.writeheader()
        writer.writerows(results)
    print(f"\n{args.frameworks}, model {args.model}, {args.np} ranks; wire bytes are both ranks' traffic on "
          "the namespace's loopback, whose shaped rate both directions share.")
    for framework in frameworks:
        print(f"\n{framework}")
        print_table([r for r in results if r["framework"] == framework])
    report.write(results, args.out)


if __name__ == "__main__":
    main()
