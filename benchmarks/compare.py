"""Compare compressors under ``horovodrun`` on a real, shaped network, at one or several rank counts.

    python benchmarks/compare.py --quick            # the README's main job, a few minutes
    python benchmarks/compare.py --rates 100mbit,1gbit,10gbit,none --out benchmarks/results/full
    python benchmarks/compare.py --ranks 2,4,8 --exchanges allgather,two_stage,auto --model mlp10m \
        --compressors none,qsgd-4bit,topk-1% --out benchmarks/results/scaling

Each configuration runs the synthetic benchmark in a fresh private network
namespace whose loopback is shaped with ``tc`` to the given rate (``none``:
unshaped), and reports throughput, step time, bytes on the wire per step
(counted by the namespace's /proc/net/dev) and the time spent encoding and
decoding. Without root (no namespaces) it runs on the host's loopback,
unshaped, and says so.

``--ranks``: all N ranks of a run share one namespace, so its shaped rate is
shared by every rank's traffic (a switch would give each rank its own link;
``benchmarks/scaling.py`` models both). Ranks beyond the cores oversubscribe
them, which stretches every rank's compute by more than N / cores (their
caches and Horovod's threads compete too). So the comparison also times the
compute alone: one rank (``compute_alone_seconds``) and N ranks training
without exchanging anything (``--local-only``, ``compute_shared_seconds``),
recorded beside every run.

``--exchanges``: QSGD and Top-k run once per exchange (``auto`` keeps the
configuration's name, the others are appended to it); compressors without an
exchange run once.
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
from benchmarks.compressors import SPECS, STANDARD, benchmark_flags  # noqa: E402

QUICK = ["none", "fp16", "qsgd-4bit", "topk-1%", "gaussiank-0.1%", "randomk-1%"]


EXCHANGING = {"QSGD", "TopK"}  # the classes that take exchange=


def configurations(names, exchanges):
    """[(label, configuration name, exchange or None)]: one per exchange for QSGD and Top-k."""
    rows = []
    for name in names:
        if SPECS[name][0] not in EXCHANGING or "exchange" in (SPECS[name][1] or {}):
            rows.append((name, name, None))
            continue
        for exchange in exchanges:
            rows.append((name if exchange == "auto" else f"{name}-{exchange}", name, exchange))
    return rows


# One framework thread per rank, as the README advises for ranks sharing a machine: TensorFlow's
# default pools (a thread per core each) held up the host ops (Top-k 0.1% at 1 Gbit/s: 5.38x -> 6.82x).
ONE_THREAD_ENV = dict(os.environ, OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1",
                      TF_CPP_MIN_LOG_LEVEL="3")


def measure(framework, ranks, rate, args, result_path, flags, what):
    """The result of the synthetic benchmark on ``ranks`` ranks at ``rate``; taken from ``result_path`` with
    ``--reuse`` when it is there."""
    if not (args.reuse and os.path.exists(result_path)):
        script = os.path.join(ROOT, "benchmarks", f"{framework}_synthetic_benchmark.py")
        job = [*netlab.HOROVODRUN, "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo", sys.executable,
               script, "--model", args.model, "--batch-size", str(args.batch_size), "--num-iters",
               str(args.num_iters), "--num-batches-per-iter", str(args.num_batches_per_iter),
               "--json-out", result_path, *flags]
        netlab.run_horovod_job(job, rate, shaped=args.namespaces, timeout=args.timeout, env=ONE_THREAD_ENV,
                               what=what)
    with open(result_path) as f:
        return json.load(f)


def run_one(framework, label, name, exchange, ranks, rate, args, out_dir):
    suffix = "" if ranks == 2 and len(args.ranks) == 1 else f"-{ranks}ranks"
    result_path = os.path.join(out_dir, f"{framework}-{args.model}-{label}-{rate}{suffix}.json")
    flags = benchmark_flags(name) + (["--exchange", exchange] if exchange else [])
    result = measure(framework, ranks, rate, args, result_path, flags, f"{framework} {label} at {rate}, {ranks} ranks")
    return dict(result, name=label, configuration=name, exchange=exchange or "-", rate=rate, ranks=ranks,
                cores=os.cpu_count())


def compute_shared(framework, ranks, args, out_dir):
    """Step time of each of ``ranks`` ranks training locally (no gradient exchange, one thread each): the
    compute a rank takes while that many ranks share this machine's cores."""
    path = os.path.join(out_dir, f"{framework}-{args.model}-compute-{ranks}ranks.json")
    return measure(framework, ranks, "none", args, path, ["--local-only"],
                   f"{framework} compute of {ranks} ranks")["step_seconds"]


def print_table(results):
    baseline = {(r["framework"], r["rate"], r["ranks"]): r for r in results if r["name"] == "none"}
    several = results[0].get("compute_alone_seconds") is not None
    header = (f"{'ranks':>5} {'rate':>8} {'compressor':<24} {'img/s':>8} {'step s':>8} {'wire MB/step':>13} "
              f"{'bytes vs none':>13} {'speedup':>8} {'enc+dec':>8} {'wait':>6} {'coll/step':>9}")
    print(header)
    print("-" * len(header))
    for r in results:
        base = baseline.get((r["framework"], r["rate"], r["ranks"]))
        fewer = f"{base['wire_bytes_per_step'] / r['wire_bytes_per_step']:.1f}x" if base else "-"
        speedup = f"{r['img_sec_total'] / base['img_sec_total']:.2f}x" if base else "-"
        codec_share = (r["encode_seconds_per_step"] + r["decode_seconds_per_step"]) / r["step_seconds"]
        wait_share = r["wait_seconds_per_step"] / r["step_seconds"]
        print(f"{r['ranks']:>5} {r['rate']:>8} {r['name']:<24} {r['img_sec_total']:>8.1f} {r['step_seconds']:>8.3f} "
              f"{r['wire_bytes_per_step'] / 1e6:>13.2f} {fewer:>13} {speedup:>8} {codec_share:>7.0%} "
              f"{wait_share:>5.0%} {r.get('collectives_per_step', float('nan')):>9.1f}")
    if several:
        alone = results[0]["compute_alone_seconds"]
        shared = {r["ranks"]: r["compute_shared_seconds"] for r in results}
        print(f"a rank's compute (forward, backward, SGD update; one thread, no exchange): alone {alone:.3f} s; "
              + ", ".join(f"with {n} ranks on {os.cpu_count()} cores {t:.3f} s ({t / alone:.1f}x)"
                          for n, t in shared.items()))
    sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the short main job: 1gbit, 6 compressors")
    parser.add_argument("--frameworks", default="pytorch", help="pytorch, tensorflow or both, comma-separated")
    parser.add_argument("--model", default="mlp25m")
    parser.add_argument("--compressors", default=",".join(STANDARD))
    parser.add_argument("--rates", default="1gbit", help="comma-separated tc rates, 'none' for unshaped")
    parser.add_argument("--ranks", "--np", default="2", help="comma-separated rank counts, e.g. 2,4,8")
    parser.add_argument("--exchanges", default="auto",
                        help="QSGD's and Top-k's exchanges to run, comma-separated: allgather, two_stage, auto")
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
    unknown = set(names) - set(SPECS)
    if unknown:
        parser.error(f"unknown compressor(s) {sorted(unknown)}; choose from {', '.join(SPECS)}")
    exchanges = args.exchanges.split(",")
    if set(exchanges) - {"allgather", "two_stage", "auto"}:
        parser.error(f"unknown exchange(s) in {args.exchanges!r}; use allgather, two_stage and/or auto")
    try:
        args.ranks = [int(n) for n in str(args.ranks).split(",")]
    except ValueError:
        parser.error(f"--ranks takes comma-separated integers, not {args.ranks!r}")
    os.makedirs(args.out, exist_ok=True)
    results, started = [], time.time()
    configs = configurations(names, exchanges)
    total = len(frameworks) * len(args.ranks) * len(rates) * len(configs)
    for framework in frameworks:
        several = len(args.ranks) > 1 or args.ranks[0] > 2
        alone = compute_shared(framework, 1, args, args.out) if several else None
        for ranks in args.ranks:
            shared = compute_shared(framework, ranks, args, args.out) if several else None
            for rate in rates:
                for label, name, exchange in configs:
                    print(f"[{len(results) + 1}/{total}] {framework} {label} at {rate}, {ranks} ranks "
                          f"({time.time() - started:.0f} s so far)", flush=True)
                    results.append(dict(run_one(framework, label, name, exchange, ranks, rate, args, args.out),
                                        compute_alone_seconds=alone, compute_shared_seconds=shared))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted(set().union(*results)))
        writer.writeheader()
        writer.writerows(results)
    ranks_text = ", ".join(map(str, args.ranks))
    print(f"\n{args.frameworks}, model {args.model}, {ranks_text} ranks; wire bytes are all ranks' traffic on "
          "the namespace's loopback, whose shaped rate every direction shares.")
    for framework in frameworks:
        print(f"\n{framework}")
        print_table([r for r in results if r["framework"] == framework])
    if len(args.ranks) == 1:
        report.write(results, args.out)


if __name__ == "__main__":
    main()
