"""Fused against unfused two stages, interleaved: step-time ratios measured in the same run.

    python benchmarks/fusion_ab.py --ranks 4,8 --repeats 3 --out benchmarks/results/fusion
    python benchmarks/fusion_ab.py --ranks 4 --repeats 3 --framework tensorflow --out benchmarks/results/fusion

For each rank count and compressor (QSGD 4-bit, Top-k 1%, ``exchange="two_stage"``), the synthetic
benchmark (PyTorch, or TensorFlow with ``DistributedGradientTape(groups=1)``; ``--model mlp10m``, batch
32) runs in a network namespace shaped to 1 Gbit/s,
alternating ``fusion_threshold`` default and 0, ``--repeats`` times; the VM's speed drifts between
hours, so only the ratio of neighbouring runs is read. Prints each pair's ratio and the median.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks import netlab  # noqa: E402
from benchmarks.compare import ONE_THREAD_ENV  # noqa: E402

SCRIPTS = {"torch": "pytorch_synthetic_benchmark.py", "tensorflow": "tensorflow_synthetic_benchmark.py"}
# TensorFlow fuses a grouped call's tensors only: both of its runs group the step's gradients
GROUPED = {"torch": [], "tensorflow": ["--groups", "1"]}
COMPRESSORS = {"qsgd-4bit": ["--compression", "qsgd", "--bits", "4"],
               "topk-1%": ["--compression", "topk", "--ratio", "0.01"]}


def step_seconds(ranks, flags, rate, timeout, framework="torch"):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        job = [*netlab.HOROVODRUN, "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo", sys.executable,
               os.path.join(ROOT, "benchmarks", SCRIPTS[framework]), "--model", "mlp10m",
               "--batch-size", "32", "--num-iters", "5", "--num-batches-per-iter", "2", "--json-out", out,
               "--exchange", "two_stage", *flags]
        netlab.run_horovod_job(job, rate, shaped=True, env=ONE_THREAD_ENV, timeout=timeout, what=" ".join(flags))
        with open(out) as f:
            result = json.load(f)
    return result["step_seconds"], result["collectives_per_step"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="4,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--out", default=None, help="directory for fusion_ab.json")
    parser.add_argument("--framework", choices=tuple(SCRIPTS), default="torch")
    args = parser.parse_args()
    reason = netlab.unavailable_reason()
    if reason:
        parser.error(f"needs network namespaces: {reason}")
    rows = []
    for ranks in [int(n) for n in args.ranks.split(",")]:
        for name, flags in COMPRESSORS.items():
            pairs, flags = [], flags + GROUPED[args.framework]
            for _ in range(args.repeats):
                fused, fused_coll = step_seconds(ranks, flags, args.rate, args.timeout, args.framework)
                alone, alone_coll = step_seconds(ranks, flags + ["--fusion-threshold", "0"], args.rate, args.timeout,
                                                 args.framework)
                pairs.append((fused, alone))
                print(f"{ranks} ranks {name:<10} fused {fused:.3f} s ({fused_coll:.0f} collectives/step), unfused "
                      f"{alone:.3f} s ({alone_coll:.0f}): unfused/fused {alone / fused:.2f}", flush=True)
            ratio = statistics.median(a / f for f, a in pairs)
            print(f"{ranks} ranks {name:<10} median unfused/fused step time {ratio:.2f} over {len(pairs)} pairs "
                  f"(range {min(a / f for f, a in pairs):.2f}-{max(a / f for f, a in pairs):.2f})", flush=True)
            rows.append(dict(framework=args.framework, ranks=ranks, compressor=name, rate=args.rate,
                             fused_seconds=[f for f, _ in pairs],
                             unfused_seconds=[a for _, a in pairs], median_unfused_over_fused=ratio))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = "fusion_ab.json" if args.framework == "torch" else f"fusion_ab-{args.framework}.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
