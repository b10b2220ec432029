"""Bytes between nodes per training step: what each exchange puts on the slow inter-node link (needs root).

    python benchmarks/node_bytes.py [--layouts 2x2,2x4] [--out benchmarks/results/node-bytes]

For each layout (nodes x ranks per node), ``benchmarks/nodelab.py`` starts
the PyTorch synthetic benchmark (``mlp10m``, 9.9M parameters, batch 8 per
rank) on that many network namespaces joined by veth NICs, so every byte
between nodes is counted on a NIC and every byte inside a node on its
loopback. Configurations: uncompressed, QSGD-4 and Top-k 1% with the
allgather and with the two stages (the flat, node-blind exchanges), and
node-aware (``exchange="node_aware"``: only the node's sums cross), fused (the
default) and unfused (``fusion_threshold=0``: every tensor its own collectives).

The formula (:func:`formula`) is the node model's
(``benchmarks/node_scaling.py``): each collective's route on the ring of
ranks (nodes hold consecutive ranks): a ring allreduce crosses each of the
``nodes`` node boundaries with ``2 (N-1)/N`` of the buffer; a ring allgather
sends, on each boundary link, every payload but one; an alltoall sends each
slice straight to its owner, so a node's ranks send their slices for the
N-L ranks off the node across. Measured bytes include Horovod's own
coordination: every cycle (``HOROVOD_CYCLE_TIME``, 1 ms by default;
``--cycle-time-ms`` sets it) its background loop exchanges the ranks' state,
whether or not a tensor is pending. Each run also measures that traffic on
the NICs while the job idles for a second and reports it at the step's
length: an upper bound on what the step's own coordination added (during a
step the loop runs collectives instead of cycling), so measured minus it is
a lower bound on the payloads.

Writes ``results.json`` and ``README.md`` to ``--out``.
"""
import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import nodelab  # noqa: E402
from benchmarks.compressors import SPECS, benchmark_flags  # noqa: E402

CONFIGS = [("none", "uncompressed"), ("qsgd-4bit-allgather", "QSGD-4, allgather"),
           ("qsgd-4bit-two-stage", "QSGD-4, two stages"), ("topk-1%-allgather", "Top-k 1%, allgather"),
           ("topk-1%-two-stage", "Top-k 1%, two stages"), ("qsgd-4bit-node-aware", "QSGD-4, node-aware"),
           ("topk-1%-node-aware", "Top-k 1%, node-aware"),
           ("qsgd-4bit-node-aware-unfused", "QSGD-4, node-aware unfused"),
           ("topk-1%-node-aware-unfused", "Top-k 1%, node-aware unfused")]
_EXCHANGES = {"-two-stage": "two_stage", "-node-aware": "node_aware", "-node-aware-unfused": "node_aware"}


def split_name(name):
    """(compressor, exchange) of a configuration's name."""
    for suffix, exchange in _EXCHANGES.items():
        if name.endswith(suffix):
            return name[:-len(suffix)], exchange
    return name, "allgather"


def _flags(name):
    compressor, exchange = split_name(name)
    if exchange == "allgather" or name in SPECS:
        return benchmark_flags(name)
    return benchmark_flags(compressor) + ["--exchange", exchange]


def formula(model, name, nodes, per_node):
    """Bytes all nodes send to other nodes per step: :func:`benchmarks.node_scaling.tensor_bytes` per tensor
    (node-aware: plus the placeholder's ring allreduce, which Horovod's protocol adds to each tensor)."""
    from benchmarks.models_torch import build_model
    from benchmarks import scaling
    from benchmarks.node_scaling import tensor_bytes
    compressor, exchange = split_name(name)
    min_numel = scaling._codecs(compressor)[0].min_numel if compressor != "none" else None
    ranks = nodes * per_node
    placeholder = 2 * (ranks - 1) / ranks * 4 if exchange == "node_aware" else 0.0
    total = 0.0
    for p in build_model(model).parameters():
        nic = tensor_bytes(compressor, exchange, p.numel(), nodes, per_node)[0]
        compressed = min_numel is not None and p.numel() >= min_numel
        total += nic + (placeholder if compressed else 0.0)
    return nodes * total


def run(name, nodes, per_node, model, tmp, rate=None, iters=2, framework="pytorch", tree=ROOT):
    """One job of configuration ``name`` (``iters`` timed iterations of 2 steps); the nodelab's result.
    ``framework="tensorflow"``: TensorFlow's benchmark, its gradients in one grouped call (``groups=1``: what
    TensorFlow fuses). ``tree``: the checkout whose benchmark script (and so library) runs."""
    out = os.path.join(tmp, f"{nodes}x{per_node}-{name}.json")
    script, extra = ("pytorch_synthetic_benchmark.py", []) if framework == "pytorch" else \
        ("tensorflow_synthetic_benchmark.py", ["--groups", "1"])
    argv = [sys.executable, os.path.join(tree, "benchmarks", script), "--model", model,
            "--batch-size", "8", "--num-warmup-batches", "2", "--num-iters", str(iters), "--num-batches-per-iter", "2",
            "--json-out", out, *_flags(name), *extra]
    return nodelab.run_benchmark(nodes, per_node, argv, out, name, rate=rate, timeout=1200)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default="2x2,2x4")
    ap.add_argument("--model", default="mlp10m")
    ap.add_argument("--configs", default=",".join(name for name, _ in CONFIGS),
                    help="comma-separated configurations, the first one the baseline")
    ap.add_argument("--rate", default=None, help="shape every NIC (tc rate, e.g. 1gbit): step times on that link")
    ap.add_argument("--cycle-time-ms", type=float, default=None,
                    help="HOROVOD_CYCLE_TIME of every job (Horovod's default: 1 ms)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "node-bytes"))
    args = ap.parse_args()
    if args.cycle_time_ms is not None:
        os.environ["HOROVOD_CYCLE_TIME"] = str(args.cycle_time_ms)  # the jobs inherit this environment
    tmp = tempfile.mkdtemp(prefix="hq-nodes-")
    rows = []
    for layout in args.layouts.split(","):
        nodes, per_node = (int(x) for x in layout.split("x"))
        base = None
        for name, label in [(n, l) for n, l in CONFIGS if n in args.configs.split(",")]:
            result = run(name, nodes, per_node, args.model, tmp, args.rate)
            inter = result["inter_node_bytes_per_step"]
            base = base or inter
            expected = formula(args.model, name, nodes, per_node)
            row = dict(layout=layout, config=label, inter_mb=inter / 1e6, per_node_mb=inter / nodes / 1e6,
                       in_node_mb=result["in_node_bytes_per_step"] / 1e6, reduction=base / inter,
                       formula_mb=expected / 1e6, step_seconds=result["step_seconds"],
                       idle_mb=result["inter_node_idle_bytes_per_step"] / 1e6)
            rows.append(row)
            print(f"{layout}  {label:22s} between nodes {row['inter_mb']:8.2f} MB/step ({row['per_node_mb']:.2f} "
                  f"per node, {row['reduction']:5.1f}x fewer)  formula {row['formula_mb']:8.2f} MB "
                  f"({100 * (inter / expected - 1):+.1f}%)  idle coordination {row['idle_mb']:.3f} MB  "
                  f"inside nodes {row['in_node_mb']:.2f} MB  "
                  f"{row['step_seconds']:.3f} s/step", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"model": args.model, "rate": args.rate, "cycle_time_ms": args.cycle_time_ms, "rows": rows}, f,
                  indent=1)
    lines = ["# Bytes between nodes per step: node-blind and node-aware exchanges", "",
             f"PyTorch, `{args.model}` (9.9M parameters, 39.6 MB of fp32 gradient), batch 8 per rank, Horovod over "
             "Gloo on `benchmarks/nodelab.py`'s namespaces (one per node; NICs unshaped here). MB per step sent by "
             "all nodes' NICs (between nodes) and loopbacks (inside nodes); formula from the model's tensor sizes, "
             "the codecs and each collective's route (`formula` in `benchmarks/node_bytes.py`). Machine: the "
             "project's 2-core VM (more than 2 ranks oversubscribe it; bytes do not depend on that, step times "
             "do). NICs: " + (f"every NIC shaped to {args.rate} (both directions share it)." if args.rate else
                              "unshaped (step times not meaningful).") + " Horovod's cycle time: "
             + (f"{args.cycle_time_ms:g} ms." if args.cycle_time_ms is not None else "its default, 1 ms."), "",
             "```bash", f"python benchmarks/node_bytes.py --layouts {args.layouts}"
             + (f" --configs {args.configs}" if args.configs != ",".join(n for n, _ in CONFIGS) else "")
             + (f" --rate {args.rate}" if args.rate else "")
             + (f" --cycle-time-ms {args.cycle_time_ms:g}" if args.cycle_time_ms is not None else "")
             + (f" --out {os.path.relpath(args.out, ROOT)}" if args.rate or args.cycle_time_ms is not None else ""),
             "```", "",
             "| nodes x ranks | exchange | MB/step between nodes | per node | fewer than uncompressed | formula MB "
             "| measured/formula | idle coordination MB | (measured - idle)/formula | MB/step inside nodes | s/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['config']} | {r['inter_mb']:.2f} | {r['per_node_mb']:.2f} | "
                     f"{r['reduction']:.1f}x | {r['formula_mb']:.2f} | {r['inter_mb'] / r['formula_mb']:.3f} | "
                     f"{r['idle_mb']:.3f} | {(r['inter_mb'] - r['idle_mb']) / r['formula_mb']:.3f} | "
                     f"{r['in_node_mb']:.2f} | {r['step_seconds']:.3f} |")
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
