"""HSDP's link between nodes: FSDP2's own all-reduce across replicas against ours, bytes per step (needs root).

    sudo python benchmarks/fsdp_hsdp.py --layouts 2x2,2x4 --out benchmarks/results/fsdp/hsdp
    sudo python benchmarks/fsdp_hsdp.py --layouts 2x2 --rate 1gbit --out benchmarks/results/fsdp/hsdp-1gbit

On ``benchmarks/nodelab.py``'s network-namespace nodes (M nodes of L ranks, ``torchrun``, Gloo), the
synthetic ``mlp25m`` (25.2M parameters; each Linear and the model ``fully_shard``-ed,
``reshard_after_forward=False``, batch 8 per rank, SGD) is sharded inside each node and replicated across the
nodes, with the mesh ``init_device_mesh("cpu", (M, L), mesh_dim_names=("replicate", "shard"))``. Variants:

- ``hsdp-fp32``, ``hsdp-bf16``: FSDP2's native HSDP (``fully_shard(mesh=mesh)``, a 2-D mesh), its replicas'
  all-reduce at full precision (bf16: ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``);
- ``qsgd-4bit``, ``qsgd-4bit-bf16``, ``topk-1%``: custom HSDP (``fully_shard(mesh=mesh["shard"])``) with
  ``compress_reduce_scatter(model, ..., replicate=mesh["replicate"])``: FSDP2's own reduce-scatter inside
  the node, our exchange across the replicas;
- ``topk-1%-1d``: for the memory, 1-D FSDP2 over every rank with the compressed reduce-scatter (Top-k's residual
  is then the module's whole staged input; under HSDP only this rank's staged shard); ``topk-1%-1d-lean``
  the same with ``residual_dtype="bfloat16"``.

Each run reports the bytes this rank's error-feedback residuals hold (both buffers; Top-k only).

The bytes between nodes are the NICs' (every node's, summed) between a barrier before the backward pass and
one after it: no all-gather runs there. The formula: every rank sends (M-1) payloads of its staged shard per
module at 2 replicas (the allgather), a ring all-reduce 2 (M-1)/M shards at full precision; Top-k adds its
4-byte verdict all-reduce per module. With ``--rate``, every NIC is shaped (both directions) and the step
time (median of the measured steps, forward and all-gathers included) is reported; unshaped, the 2 cores
set it and it means nothing.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VARIANTS = ["hsdp-fp32", "hsdp-bf16", "qsgd-4bit", "qsgd-4bit-bf16", "topk-1%", "topk-1%-1d", "topk-1%-1d-lean"]
WARMUP, MEASURED = 2, 3


def _compressor(variant):
    from horovod_qsgd.fsdp import QSGD, TopK
    if variant.startswith("qsgd"):
        return QSGD(bits=int(variant.split("-")[1][0]))
    if variant.startswith("topk"):
        return TopK(ratio=0.01, residual_dtype="bfloat16" if variant.endswith("-lean") else "float32")
    return None


def worker(args):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from benchmarks import nodelab
    from benchmarks.fsdp_reduce_scatter import _sent
    from benchmarks.models_torch import build_model
    from horovod_qsgd.fsdp import compress_reduce_scatter
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (args.nodes, args.per_node), mesh_dim_names=("replicate", "shard"))
    model = build_model(args.model)
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if args.variant.endswith("bf16") \
        else MixedPrecisionPolicy()
    compressor = _compressor(args.variant)
    flat = "-1d" in args.variant
    on = None if flat else mesh if compressor is None else mesh["shard"]
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=on, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=on, mp_policy=policy, reshard_after_forward=False)
    modules = [m for m in model.modules() if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_groups]
    for module in modules:
        module.set_force_sum_reduction_for_comms(True)  # Gloo's collectives take no AVG
    if compressor is not None:
        compress_reduce_scatter(model, compressor, replicate=None if flat else mesh["replicate"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, model[0].in_features)
    y = torch.randint(0, 1000, (8,))
    shards = [[p.padded_sharded_param_size.numel() for p in m._get_fsdp_state()._fsdp_param_groups[0].fsdp_params]
              for m in modules]
    between, times = [], []
    for step in range(WARMUP + MEASURED):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        dist.barrier()
        before = nodelab.link_bytes()
        loss.backward()
        dist.barrier()
        optimizer.step()
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
            between.append(_sent(nodelab.link_bytes, before))
    residual_bytes = 0
    if compressor is not None:
        compressor.state_dict()  # settles the last step
        for state in compressor._feedback._states.values():
            residual_bytes += sum(residual.nbytes() for residual in state.residuals())
    if dist.get_rank() == 0:
        with open(args.json_out, "w") as f:
            json.dump({"between_nodes_bytes_per_step": sum(between) / MEASURED, "each_step": between,
                       "residual_bytes": residual_bytes, "parameters": sum(p.numel() for p in model.parameters()),
                       "step_seconds": sorted(times)[MEASURED // 2], "shards": shards,
                       "stats": None if compressor is None else compressor.compression_stats()}, f)
    dist.destroy_process_group()


def formula(variant, shards, nodes, per_node):
    """Bytes all nodes send each other per step (see the module's docstring)."""
    from horovod_qsgd.common.chunks import chunk_unit
    from horovod_qsgd.common.reduce_scatter import RowLayout
    ranks, total = nodes * per_node, 0
    ring = 2 * (nodes - 1) / nodes
    for pieces in shards:
        numel = sum(pieces)
        if "-1d" in variant:
            return None
        if variant.startswith("hsdp"):
            total += ring * numel * (2 if variant.endswith("bf16") else 4)
            continue
        compressor = _compressor(variant)
        if numel < compressor.min_numel:
            total += ring * numel * (2 if variant.endswith("bf16") else 4)
            continue
        codec = compressor.codec
        total += (nodes - 1) * codec.max_payload_nbytes(RowLayout(pieces, chunk_unit(codec)).staged_numel)
        if variant.startswith("topk"):
            total += ring * 4
    return ranks * total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default="2x2,2x4")
    ap.add_argument("--variants", default=",".join(VARIANTS).replace("%", "%%"))
    ap.add_argument("--rate", default=None, help="shape every NIC (tc rate, e.g. 1gbit)")
    ap.add_argument("--model", default="mlp25m")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "fsdp", "hsdp"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--nodes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--per-node", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--json-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    from benchmarks import netlab, nodelab
    reason = netlab.unavailable_reason()
    if reason:
        sys.exit(f"cannot count bytes here: {reason}")
    tmp = tempfile.mkdtemp(prefix="hq-hsdp-")
    rows = []
    for layout in args.layouts.split(","):
        nodes, per_node = (int(x) for x in layout.split("x"))
        measured = {}
        for variant in args.variants.replace("%%", "%").split(","):
            out = os.path.join(tmp, f"{layout}-{variant}.json")
            argv = [sys.executable, os.path.abspath(__file__), "--worker", "--variant", variant, "--model",
                    args.model, "--nodes", str(nodes), "--per-node", str(per_node), "--json-out", out]
            result = nodelab.run_benchmark(nodes, per_node, argv, out, f"{layout} {variant}", launcher="torchrun",
                                           rate=args.rate, timeout=1800)
            sent = measured[variant] = result["between_nodes_bytes_per_step"]
            expected = formula(variant, result["shards"], nodes, per_node)
            row = dict(layout=layout, variant=variant, between_mb=sent / 1e6,
                       formula_mb=None if expected is None else expected / 1e6, step_seconds=result["step_seconds"],
                       residual_mb=result["residual_bytes"] / 1e6,
                       residual_bytes_per_parameter=result["residual_bytes"] / result["parameters"])
            for base in ("hsdp-fp32", "hsdp-bf16"):
                if base in measured and variant != base:
                    row[f"fewer_than_{base}"] = measured[base] / sent
            rows.append(row)
            vs = "" if expected is None else \
                f"  formula {expected / 1e6:8.2f} MB ({100 * (sent / expected - 1):+.1f}%)"
            print(f"{layout} {variant:16s} between nodes {sent / 1e6:8.2f} MB/step{vs}  step "
                  f"{result['step_seconds']:.3f} s  residuals {row['residual_mb']:.1f} MB/rank", flush=True)
    os.makedirs(args.out, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    record = {"model": args.model, "rate": args.rate, "layouts": args.layouts, "commit": commit, "rows": rows}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(record, f, indent=1)
    write_record(args.out, record)


def write_record(out, record):
    rate = record["rate"]
    command = f"sudo python benchmarks/fsdp_hsdp.py --layouts {record['layouts']}" + \
        (f" --rate {rate}" if rate else "") + f" --out {os.path.relpath(out, ROOT)}"
    lines = ["# HSDP's link between nodes: bytes per step" + (f" and step time at {rate}" if rate else ""), "",
             f"`{record['model']}` sharded inside each node and replicated across nodes (`benchmarks/fsdp_hsdp.py`'s "
             "docstring), `torchrun` ranks (Gloo) on `benchmarks/nodelab.py`'s network-namespace nodes, "
             + (f"every NIC shaped to {rate}" if rate else "NICs unshaped")
             + f"; {MEASURED} steps measured after {WARMUP} of warm-up. MB per step that all nodes' NICs sent during "
             "the backward pass (no all-gather runs there); formula: payload bytes only (the NICs add TCP/IP "
             f"headers). Library at commit {record['commit']}; machine: the project's 2-core VM (ranks "
             "oversubscribe it; bytes do not depend on that" + (", step times do: compare within a layout" if rate
             else "") + ").", "", "```bash", command, "```", "",
             "| nodes x ranks | variant | between nodes MB/step | formula MB | fewer than HSDP fp32 | fewer than "
             "HSDP bf16 | residuals MB per rank (bytes per parameter) |" + (" step s (median) |" if rate else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if rate else "")]
    for row in record["rows"]:
        def ratio(key):
            return f"{row[key]:.2f}x" if key in row else ""
        formula_mb = "" if row["formula_mb"] is None else f"{row['formula_mb']:.2f}"
        held = f"{row['residual_mb']:.1f} ({row['residual_bytes_per_parameter']:.2f})" if row["residual_mb"] else ""
        lines.append(f"| {row['layout']} | {row['variant']} | {row['between_mb']:.2f} | {formula_mb} | "
                     f"{ratio('fewer_than_hsdp-fp32')} | {ratio('fewer_than_hsdp-bf16')} | {held} |"
                     + (f" {row['step_seconds']:.3f} |" if rate else ""))
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
