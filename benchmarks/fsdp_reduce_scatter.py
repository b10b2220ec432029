"""FSDP2's gradient reduce-scatter, compressed and not: bytes on the wire per step (needs root).

    python benchmarks/fsdp_reduce_scatter.py [--ranks 2,4,8] [--rate none] [--out benchmarks/results/fsdp]
    python benchmarks/fsdp_reduce_scatter.py --layouts 2x2,2x4 --out benchmarks/results/fsdp/nodes

For each rank count and variant, ``torchrun --nproc_per_node N`` trains the
synthetic ``mlp25m`` (25.2M parameters; each Linear and the model
``fully_shard``-ed with ``reshard_after_forward=False``, batch 8 per rank,
SGD) inside a private network namespace whose ``/proc/net/dev`` counts
every byte the ranks exchange. The backward pass then runs no all-gather:
the bytes between a barrier before it and one after it are its
reduce-scatters' (the barriers add a few hundred bytes). Variants: FSDP2's
own reduce-scatter (``fsdp-fp32``, ``fsdp-bf16``:
``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``; on Gloo with
``set_force_sum_reduction_for_comms``, Gloo having no AVG), an ideal fp32
reduce-scatter (``alltoall-fp32``: every row to its owner, one
``all_to_all_single``), and ``horovod_qsgd.fsdp``'s QSGD-4, QSGD-8 and
top-k 1% on fp32 and bf16 gradients.

``--layouts MxL``: on ``benchmarks/nodelab.py``'s network-namespace nodes,
counting the bytes between nodes (the NICs'); variants add the node-aware
exchange (``-node-aware``: full precision in the node, compressed between).

The formula: N ranks each send (N-1) rows per module, of the input's dtype
(ideal) or of the codec's payload of the staged row
(:meth:`~horovod_qsgd.common.reduce_scatter.ReduceScatterPlan.send_capacity`),
plus top-k's 4-byte verdict all-reduce per module. Ranks beyond the 2
cores oversubscribe them: bytes do not depend on it.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ["fsdp-fp32", "alltoall-fp32", "qsgd-4bit", "qsgd-8bit", "topk-1%",
            "fsdp-bf16", "qsgd-4bit-bf16", "topk-1%-bf16"]
NODE_VARIANTS = ["fsdp-fp32", "alltoall-fp32", "qsgd-4bit", "qsgd-4bit-node-aware", "topk-1%",
                 "topk-1%-node-aware"]
WARMUP, MEASURED = 2, 3


def _compressor(variant):
    from horovod_qsgd.fsdp import QSGD, TopK
    exchange = "node_aware" if variant.endswith("node-aware") else "reduce_scatter"
    if variant.startswith("qsgd"):
        return QSGD(bits=int(variant.split("-")[1][0]), exchange=exchange)
    if variant.startswith("topk"):
        return TopK(ratio=0.01, exchange=exchange)
    return None


def _alltoall():
    """FSDP2's reduce-scatter as every row sent to its owner in one ``all_to_all_single``: an ideal one's bytes."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    class AllToAll(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            rows = input_tensor.view(group.size(), -1)
            received = torch.empty_like(rows)
            dist.all_to_all_single(received, rows, group=group)
            output_tensor.copy_(received.sum(0))
            return None
    return AllToAll()


def worker(args):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from benchmarks import netlab, nodelab
    from benchmarks.models_torch import build_model
    from horovod_qsgd.fsdp import compress_reduce_scatter
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = build_model(args.model)
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if args.variant.endswith("bf16") \
        else MixedPrecisionPolicy()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mp_policy=policy, reshard_after_forward=False)
    modules = [m for m in model.modules() if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_groups]
    compressor = _compressor(args.variant)
    if compressor is not None:
        compress_reduce_scatter(model, compressor)
    for module in modules:
        if args.variant == "alltoall-fp32":
            module.set_custom_reduce_scatter(_alltoall())
        module.set_force_sum_reduction_for_comms(True)  # Gloo's reduce-scatter takes no AVG
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, model[0].in_features)
    y = torch.randint(0, 1000, (8,))
    rows = [m._get_fsdp_state()._fsdp_param_groups[0] for m in modules]
    rows = [[p.padded_sharded_param_size.numel() for p in group.fsdp_params] for group in rows]
    counted = nodelab.link_bytes if nodelab.on_a_node() else netlab.loopback_bytes  # between nodes: the NICs
    reduce_scatters, times = [], []
    for step in range(WARMUP + MEASURED):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        dist.barrier()
        before = counted()
        loss.backward()
        dist.barrier()
        optimizer.step()
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
            reduce_scatters.append(_sent(counted, before))
    if dist.get_rank() == 0:
        with open(args.json_out, "w") as f:
            json.dump({"reduce_scatter_bytes_per_step": sum(reduce_scatters) / MEASURED,
                       "each_step": reduce_scatters, "step_seconds": sorted(times)[MEASURED // 2], "rows": rows,
                       "stats": None if compressor is None else compressor.compression_stats()}, f)
    dist.destroy_process_group()


def _sent(counted, before):
    """Bytes sent since ``before``: on nodelab's nodes the NICs', all nodes together (each rank adds its node's
    share), else the namespace's loopback."""
    import torch
    import torch.distributed as dist
    from benchmarks import nodelab
    now = counted()
    if not isinstance(now, tuple):
        return now - before
    share = torch.tensor([(now[0] - before[0]) / nodelab.ranks_on_this_node()], dtype=torch.float64)
    dist.all_reduce(share)
    return share.item()


def formula(variant, rows, ranks, per_node=None):
    """Reduce-scatter bytes all ranks send per step (see the module's docstring), or with ``per_node`` those
    between nodes; None for Gloo's own."""
    from horovod_qsgd.common.chunks import chunk_unit
    from horovod_qsgd.common.reduce_scatter import RowLayout
    if variant.startswith("fsdp"):
        return None
    # rows a rank sends past its node: every other node's L (flat), one per other node (node-aware)
    node_aware = variant.endswith("node-aware")
    remote = ranks - 1 if per_node is None else (ranks // per_node - 1) * (1 if node_aware else per_node)
    total = 0
    for pieces in rows:
        if variant == "alltoall-fp32":
            total += remote * sum(pieces) * 4
            continue
        codec = _compressor(variant).codec
        row = codec.max_payload_nbytes(RowLayout(pieces, chunk_unit(codec)).staged_numel)
        verdict = 4 * 2 * (ranks - 1) / ranks if per_node is None and variant.startswith("topk") else 0
        total += remote * row + verdict
    return ranks * total


def run_on_nodes(nodes, per_node, variant, model, rate, tmp):
    from benchmarks import nodelab
    out = os.path.join(tmp, f"n{nodes}x{per_node}-{variant}.json")
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--variant", variant, "--model", model,
            "--json-out", out]
    return nodelab.run_benchmark(nodes, per_node, argv, out, variant, launcher="torchrun",
                                 rate=None if rate == "none" else rate, timeout=1800)


def run(ranks, variant, model, rate, tmp):
    from benchmarks import netlab
    out = os.path.join(tmp, f"r{ranks}-{variant}.json")
    argv = [os.path.abspath(__file__), "--worker", "--variant", variant, "--model", model, "--json-out", out]
    return netlab.run_torchrun_benchmark(ranks, argv, out, f"{ranks} ranks {variant}", rate)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--rate", default="none")
    ap.add_argument("--model", default="mlp25m")
    ap.add_argument("--variants", default=None, help=f"default: {','.join(VARIANTS)}; with --layouts "
                    f"{','.join(NODE_VARIANTS)}".replace("%", "%%"))  # argparse formats help with %
    ap.add_argument("--layouts", help="nodes x ranks per node (e.g. 2x2,2x4): on benchmarks/nodelab.py's nodes, "
                    "counting the bytes between nodes")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "fsdp"))
    ap.add_argument("--record-only", action="store_true", help="rewrite --out's README.md from its results.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--json-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.record_only:
        return write_record(args.out)
    from benchmarks import netlab
    reason = netlab.unavailable_reason()
    if reason:
        sys.exit(f"cannot count bytes here: {reason}")
    import subprocess
    import tempfile
    tmp = tempfile.mkdtemp(prefix="hq-fsdp-")
    if args.layouts:
        jobs = [(layout, *(int(x) for x in layout.split("x"))) for layout in args.layouts.split(",")]
        variants = (args.variants or ",".join(NODE_VARIANTS)).split(",")
    else:
        jobs = [(r, None, None) for r in args.ranks.split(",")]
        variants = (args.variants or ",".join(VARIANTS)).split(",")
    results = []
    for label, nodes, per_node in jobs:
        by_variant = {}
        for variant in variants:
            if nodes:
                result = run_on_nodes(nodes, per_node, variant, args.model, args.rate, tmp)
                expected = formula(variant, result["rows"], nodes * per_node, per_node)
            else:
                result = run(int(label), variant, args.model, args.rate, tmp)
                expected = formula(variant, result["rows"], int(label))
            rs = by_variant[variant] = result["reduce_scatter_bytes_per_step"]
            row = dict(ranks=label, variant=variant, reduce_scatter_mb=rs / 1e6, step_seconds=result["step_seconds"],
                       formula_mb=None if expected is None else expected / 1e6)
            for base in ("fsdp-fp32", "alltoall-fp32", "fsdp-bf16"):
                if base in by_variant and variant != base:
                    row[f"fewer_than_{base}"] = by_variant[base] / rs
            results.append(row)
            vs = "" if expected is None else f"  formula {expected / 1e6:8.2f} MB ({100 * (rs / expected - 1):+.1f}%)"
            print(f"{label} ranks  {variant:20s} reduce-scatter {rs / 1e6:8.2f} MB/step{vs}  "
                  f"step {result['step_seconds']:.3f} s", flush=True)
    os.makedirs(args.out, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"model": args.model, "rate": args.rate, "ranks": args.ranks, "layouts": args.layouts,
                   "commit": commit, "rows": results}, f, indent=1)
    write_record(args.out)


def write_record(out):
    """``out``/README.md from ``out``/results.json."""
    with open(os.path.join(out, "results.json")) as f:
        record = json.load(f)
    ideal = {row["ranks"]: row["reduce_scatter_mb"] for row in record["rows"] if row["variant"] == "alltoall-fp32"}
    layouts = record.get("layouts")
    where = (f"`torchrun` ranks (Gloo) on `benchmarks/nodelab.py`'s network-namespace nodes, MB per step sent by "
             "all nodes' NICs (between nodes), NICs " if layouts else
             "`torchrun` ranks (Gloo) in one network namespace, loopback ")
    lines = ["# FSDP2's gradient reduce-scatter: bytes " + ("between nodes" if layouts else "on the wire")
             + " per step", "",
             f"`{record['model']}` (25.2M parameters; each Linear and the model `fully_shard`-ed), batch 8 per rank, "
             "SGD, " + where + ("unshaped" if record["rate"] == "none" else f"shaped to {record['rate']}")
             + f"; {MEASURED} steps measured after {WARMUP} of warm-up. Reduce-scatter MB per step of all ranks: "
             "the bytes of the backward pass, which runs no all-gather (`reshard_after_forward=False`), between "
             "two barriers. Formula: `formula` in `benchmarks/fsdp_reduce_scatter.py` (payload bytes only; the "
             "measured bytes add TCP/IP headers). "
             + ("Between nodes, `alltoall-fp32` sends every row to its owner (L (M-1) rows per rank cross); Gloo's "
                "own reduce-scatter crosses less as nodes grow (its exchange pattern, not a smaller payload); a "
                "ring over the ranks in node order (NCCL's) puts 2 (N-1) fp32 rows between two nodes per "
                "reduce-scatter (a formula, not measured here). "
                if layouts else
                "Gloo's own reduce-scatter (`fsdp-*`) sends twice an ideal one's bytes; NCCL's ring sends an ideal "
                "one's, so the columns against `alltoall-fp32` (measured) and an ideal bf16 reduce-scatter (half "
                "of it) are the fair ones. ")
             + "Library at commit "
             f"{record['commit']}; machine: the project's 2-core VM (ranks oversubscribe it; bytes do not depend "
             "on that).", "",
             "```bash", "sudo python benchmarks/fsdp_reduce_scatter.py "
             + (f"--layouts {layouts} --out benchmarks/results/fsdp/nodes" if layouts else f"--ranks {record['ranks']}")
             + ("" if record["rate"] == "none" else f" --rate {record['rate']}"), "```", "",
             "| " + ("nodes x ranks" if layouts else "ranks") + " | variant | reduce-scatter MB/step | formula MB | fewer than FSDP2 fp32 (Gloo) | fewer than an "
             "ideal fp32 reduce-scatter | fewer than FSDP2 bf16 (Gloo) | fewer than an ideal bf16 reduce-scatter |",
             "|---|---|---|---|---|---|---|---|"]

    shaped = record["rate"] != "none"
    if shaped:  # step times mean something on a shaped link only (unshaped, the 2 cores set them)
        lines[-2] += " step s (median) | step time against FSDP2 fp32 |"
        lines[-1] += "---|---|"
    steps = {(row["ranks"], row["variant"]): row.get("step_seconds") for row in record["rows"]}

    def ratio(row, key):
        return f"{row[key]:.2f}x" if key in row else ""
    for row in record["rows"]:
        formula_mb = "" if row["formula_mb"] is None else f"{row['formula_mb']:.2f}"
        bf16 = f"{ideal[row['ranks']] / 2 / row['reduce_scatter_mb']:.2f}x" \
            if row["variant"].endswith("bf16") and row["ranks"] in ideal else ""
        lines.append(f"| {row['ranks']} | {row['variant']} | {row['reduce_scatter_mb']:.2f} | {formula_mb} | "
                     f"{ratio(row, 'fewer_than_fsdp-fp32')} | {ratio(row, 'fewer_than_alltoall-fp32')} | "
                     f"{ratio(row, 'fewer_than_fsdp-bf16')} | {bf16} |")
        if shaped:
            base = steps.get((row["ranks"], "fsdp-fp32"))
            lines[-1] += f" {row['step_seconds']:.3f} | {base / row['step_seconds']:.2f}x faster |" if base else \
                f" {row['step_seconds']:.3f} | |"
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")

if __name__ == "__main__":
    main()
