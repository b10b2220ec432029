"""Bytes on the wire per training step as the number of ranks grows (needs root: a network namespace).

    python benchmarks/wire_bytes.py [--ranks 2,4,8] [--framework pytorch] [--out benchmarks/results/wire-bytes]

For each rank count, runs the synthetic benchmark (``mlp10m``, 9.9M
parameters) under ``horovodrun -np N`` inside an unshaped private network
namespace, whose ``/proc/net/dev`` counts every byte the ranks exchange,
for: uncompressed, ``QSGD(bits=4)`` with the default exchange (``auto``),
``QSGD(bits=4, exchange="allgather")`` and ``TopK(ratio=0.01)``. Ranks
beyond the cores oversubscribe them: byte counts do not depend on it, times
would (none are reported here).

Prints, per run, MB per step on the wire (all of it, Horovod's own
coordination included: it is not additive enough to subtract at 8 ranks),
the reduction against uncompressed, and the formula of :func:`formula`
from the model's tensor sizes and the codecs (which exchange each tensor
takes included).
Writes ``results.json`` and ``README.md`` (the table and this command) to
``--out``.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import netlab  # noqa: E402
from benchmarks.compressors import SPECS, benchmark_flags  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (configuration in benchmarks/compressors.py, label in the table)
CONFIGS = [("none", "uncompressed"), ("qsgd-4bit", "QSGD(bits=4)"),
           ("qsgd-4bit-allgather", "QSGD(bits=4, exchange='allgather')"), ("topk-1%", "TopK(ratio=0.01)")]


def run(framework, ranks, flags, model, tmp):
    out = os.path.join(tmp, f"r{ranks}-{abs(hash(tuple(flags)))}.json")
    job = [*netlab.HOROVODRUN, "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo", sys.executable,
           f"benchmarks/{framework}_synthetic_benchmark.py", "--model", model, "--batch-size", "8",
           "--num-warmup-batches", "2", "--num-iters", "2", "--num-batches-per-iter", "2", "--json-out", out,
           *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1",
               TF_NUM_INTEROP_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT)
    netlab.run_horovod_job(job, "none", shaped=True, env=env, timeout=1200, what=f"{ranks} ranks {flags}")
    with open(out) as f:
        return json.load(f)


def formula(model, ranks, name):
    """Bytes all ranks put on the wire per step, from the model's tensor sizes and the codecs alone.

    Ring allreduce (Gloo): ``2 (N-1)/N`` of the buffer per rank. Allgather: every
    payload forwarded N-1 times. Two stages: every first-stage slice sent once
    (alltoall), every owner's second-stage payload forwarded N-1 times. The
    per-rank terms are :func:`benchmarks.scaling.tensor_traffic`'s.
    """
    from benchmarks.models_torch import build_model
    from benchmarks.scaling import tensor_traffic
    exchange = SPECS[name][1].get("exchange", "auto") if SPECS[name][1] else "auto"
    return ranks * sum(tensor_traffic(name, exchange, p.numel(), ranks)[0] for p in build_model(model).parameters())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--framework", default="pytorch", choices=["pytorch", "tensorflow"])
    ap.add_argument("--model", default="mlp10m")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "wire-bytes"))
    args = ap.parse_args()
    reason = netlab.unavailable_reason()
    if reason:
        sys.exit(f"cannot count bytes here: {reason}")
    import tempfile
    tmp = tempfile.mkdtemp(prefix="hq-wire-")
    rows = []
    for ranks in (int(r) for r in args.ranks.split(",")):
        base = None
        for name, label in CONFIGS:
            result = run(args.framework, ranks, benchmark_flags(name), args.model, tmp)
            wire = result["wire_bytes_per_step"]
            base = base or wire
            row = dict(ranks=ranks, config=label, wire_mb=wire / 1e6, formula_mb=formula(args.model, ranks, name) / 1e6,
                       reduction=base / wire, control_mb=result["control_bytes_per_step"] / 1e6,
                       first_stage_mb=result["first_stage_bytes_per_step"] / 1e6,
                       second_stage_mb=result["second_stage_bytes_per_step"] / 1e6)
            rows.append(row)
            print(f"{ranks} ranks  {label:36s} {row['wire_mb']:8.2f} MB/step  {row['reduction']:6.1f}x fewer  "
                  f"formula {row['formula_mb']:8.2f} MB ({100 * (row['wire_mb'] / row['formula_mb'] - 1):+.1f}%)",
                  flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"framework": args.framework, "model": args.model, "rows": rows}, f, indent=1)
    lines = ["# Bytes on the wire per step as ranks grow", "",
             f"{args.framework}, `{args.model}` (9.9M parameters), batch 8 per rank, ranks in one unshaped network "
             "namespace (ranks beyond the 2 cores oversubscribe them; bytes do not depend on that). MB per step "
             "of all ranks' traffic (Horovod's coordination included); formula from the model's tensor sizes and "
             "the codecs (`formula` in `benchmarks/wire_bytes.py`). Machine: the project's 2-core VM.", "",
             "```bash", f"python benchmarks/wire_bytes.py --ranks {args.ranks} --framework {args.framework}", "```", "",
             "| ranks | compressor | MB/step on the wire | fewer than uncompressed | formula MB | measured/formula |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['ranks']} | `{r['config']}` | {r['wire_mb']:.2f} | {r['reduction']:.1f}x | "
                     f"{r['formula_mb']:.2f} | {r['wire_mb'] / r['formula_mb']:.3f} |")
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
