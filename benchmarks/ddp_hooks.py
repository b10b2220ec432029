"""DDP communication hooks side by side: bytes on the wire per step, and step times on a shaped link (needs root).

    python benchmarks/ddp_hooks.py [--ranks 2,4,8] [--rate none] [--out benchmarks/results/ddp-hooks]
    python benchmarks/ddp_hooks.py --ranks 2,4 --rate 1gbit --out benchmarks/results/ddp-hooks/1gbit

For each rank count and hook, ``torchrun --nproc_per_node N`` trains the
synthetic ``mlp25m`` (25.2M parameters, batch 8 per rank, SGD) inside a
private network namespace whose ``/proc/net/dev`` counts every byte the
ranks exchange (``--rate``: its loopback shaped with ``tc``, shared by both
directions; ``none``: unshaped). Hooks: none (DDP's allreduce),
``fp16_compress_hook``, ``powerSGD_hook`` at rank 1 and 4, and
``horovod_qsgd.ddp``'s QSGD-4 and top-k 1%. Warm-up steps (DDP's bucket
rebuild, PowerSGD's ``start_powerSGD_iter=2``) are not measured. PowerSGD
runs with one bucket: with DDP's default 25 MB buckets it hangs on Gloo (its
callbacks wait for collectives on Gloo's worker threads). Ranks beyond
the 2 cores oversubscribe them: bytes do not depend on it, times do (say so).

Prints and writes (``results.json``, ``README.md`` in ``--out``) MB per step
of all ranks, the reduction against DDP's allreduce, the median step time,
and for our hooks the formula from DDP's bucket sizes and the codecs
(:func:`formula`, from :func:`benchmarks.scaling.tensor_traffic` without Horovod's placeholder).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOOKS = ["allreduce", "fp16", "powersgd-1", "powersgd-4", "qsgd-4bit", "topk-1%"]
NODE_HOOKS = ["allreduce", "qsgd-4bit", "qsgd-4bit-node-aware", "topk-1%", "topk-1%-node-aware"]
WARMUP, MEASURED = 3, 4


def _hook(name):
    """(hook, state) for register_comm_hook, or (None, None) for DDP's own allreduce."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from horovod_qsgd.ddp import QSGDState, TopKState, qsgd_hook, topk_hook
    if name == "fp16":
        return default_hooks.fp16_compress_hook, None
    if name.startswith("powersgd"):
        return powerSGD_hook.powerSGD_hook, powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=int(name.split("-")[1]), start_powerSGD_iter=2)
    if name == "qsgd-4bit":
        return qsgd_hook, QSGDState(bits=4)
    if name == "qsgd-4bit-node-aware":
        return qsgd_hook, QSGDState(bits=4, exchange="node_aware")
    if name == "topk-1%":
        return topk_hook, TopKState(ratio=0.01)
    if name == "topk-1%-node-aware":
        return topk_hook, TopKState(ratio=0.01, exchange="node_aware")
    return None, None


def worker(args):
    import torch
    import torch.distributed as dist
    from benchmarks import netlab, nodelab
    from benchmarks.models_torch import build_model
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    # PowerSGD's hook waits for collectives inside future callbacks, which run on Gloo's worker threads: with
    # several buckets in flight they all block and the job hangs (seen here at 2 ranks). One bucket leaves a
    # free worker thread.
    bucket_cap_mb = 4096 if args.hook.startswith("powersgd") else 25
    model = torch.nn.parallel.DistributedDataParallel(build_model(args.model), bucket_cap_mb=bucket_cap_mb)
    hook, state = _hook(args.hook)
    buckets = []
    if hook is not None:
        def recording(state, bucket):
            if len(buckets) < 64:
                buckets.append([p.numel() for p in bucket.parameters()])
            return hook(state, bucket)
        model.register_comm_hook(state, recording)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, model.module[0].in_features)
    y = torch.randint(0, 1000, (8,))
    times = []
    for step in range(WARMUP + MEASURED):
        if step == WARMUP:
            dist.barrier()
            start_bytes, buckets[:] = netlab.loopback_bytes(), []
            start_links = nodelab.link_bytes() if nodelab.on_a_node() else None
        start = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    dist.barrier()
    wire = (netlab.loopback_bytes() - start_bytes) / MEASURED
    if start_links is not None:  # on nodelab's nodes: the NICs' bytes, each rank adding its node's share
        share = torch.tensor([now - then for now, then in zip(nodelab.link_bytes(), start_links)],
                             dtype=torch.float64) / nodelab.ranks_on_this_node()
        dist.all_reduce(share)
        wire = share[0].item() / MEASURED
    if dist.get_rank() == 0:
        with open(args.json_out, "w") as f:
            json.dump({"wire_bytes_per_step": wire, "step_seconds": sorted(times[WARMUP:])[MEASURED // 2],
                       "buckets": buckets[:len(buckets) // MEASURED]}, f)
    dist.destroy_process_group()


def _split(name, sizes):
    """(elements the hook compresses, elements it passes through) of a bucket of parameters of ``sizes``: those of
    at least ``min_numel`` (10,000) elements each at a multiple of QSGD's 512, the others uncompressed."""
    if name == "none":
        return sum(sizes), 0
    alignment, staged, small = 512 if name.startswith("qsgd") else 1, 0, 0
    for n in sizes:
        if n >= 10000:
            staged = -(-staged // alignment) * alignment + n
        else:
            small += n
    return staged, small


def node_formula(hook, buckets, nodes, per_node):
    """Bytes all nodes send to other nodes per step (:func:`benchmarks.node_scaling.tensor_bytes` per bucket's
    staged tensor, its small parameters by a ring allreduce)."""
    from benchmarks.node_scaling import tensor_bytes
    name, exchange = {"allreduce": ("none", "ring"), "qsgd-4bit": ("qsgd-4bit", "allgather"),
                      "qsgd-4bit-node-aware": ("qsgd-4bit", "node_aware"), "topk-1%": ("topk-1%", "allgather"),
                      "topk-1%-node-aware": ("topk-1%", "node_aware")}[hook]
    ranks = nodes * per_node
    if ranks > 2 and exchange == "allgather":
        exchange = "two_stage_direct"  # "auto" from 3 ranks, for buckets this large; both stages all_to_all
    total = 0.0
    for sizes in buckets:
        staged, small = _split(name, sizes)
        if staged:
            nic, _, _ = tensor_bytes(name, exchange, staged, nodes, per_node)
            placeholder = 0 if name == "none" or exchange == "node_aware" else 2 * (ranks - 1) / ranks * 4
            total += nic - placeholder  # Horovod's protocol only: DDP's hooks send no placeholder
        total += 2 * (ranks - 1) / ranks * 4 * small
    return nodes * total


def formula(hook, buckets, ranks):
    """Bytes all ranks put on the wire per step for our hooks, from the parameter sizes of DDP's buckets and the
    codecs: per bucket, its parameters of at least ``min_numel`` elements as one tensor (each at a multiple of
    QSGD's 512), the others in a ring allreduce."""
    from benchmarks.scaling import tensor_traffic
    if hook not in ("qsgd-4bit", "topk-1%"):
        return None
    placeholder = 2 * (ranks - 1) / ranks * 4  # Horovod's protocol only: DDP's hooks send none
    total = 0.0
    for sizes in buckets:
        staged, small = _split(hook, sizes)
        if staged:
            received, _, chosen = tensor_traffic(hook, "auto", staged, ranks)
            total += received - (placeholder if chosen else 0)
        total += 2 * (ranks - 1) / ranks * 4 * small
    return ranks * total


def run_on_nodes(nodes, per_node, hook, rate, model, tmp):
    from benchmarks import nodelab
    out = os.path.join(tmp, f"n{nodes}x{per_node}-{hook}.json")
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--hook", hook, "--model", model, "--json-out", out]
    return nodelab.run_benchmark(nodes, per_node, argv, out, hook, launcher="torchrun",
                                 rate=None if rate == "none" else rate, timeout=1800)


def run(ranks, hook, rate, model, tmp):
    from benchmarks import netlab
    out = os.path.join(tmp, f"r{ranks}-{hook}.json")
    argv = [os.path.abspath(__file__), "--worker", "--hook", hook, "--model", model, "--json-out", out]
    return netlab.run_torchrun_benchmark(ranks, argv, out, f"{ranks} ranks {hook}", rate)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--rate", default="none")
    ap.add_argument("--model", default="mlp25m")
    ap.add_argument("--hooks", default=None, help=f"default: {','.join(HOOKS)}; with --layouts "
                    f"{','.join(NODE_HOOKS)}".replace("%", "%%"))  # argparse formats help with %
    ap.add_argument("--layouts", help="nodes x ranks per node (e.g. 2x2,2x4): on benchmarks/nodelab.py's nodes, "
                    "counting the bytes between nodes")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "ddp-hooks"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hook", help=argparse.SUPPRESS)
    ap.add_argument("--json-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    from benchmarks import netlab
    reason = netlab.unavailable_reason()
    if reason:
        sys.exit(f"cannot count bytes here: {reason}")
    import tempfile
    from benchmarks.models_torch import build_model
    tmp = tempfile.mkdtemp(prefix="hq-ddp-")
    rows = []
    if args.layouts:
        jobs = [(layout, *(int(x) for x in layout.split("x"))) for layout in args.layouts.split(",")]
        hooks = (args.hooks or ",".join(NODE_HOOKS)).split(",")
    else:
        jobs = [(int(r), None, None) for r in args.ranks.split(",")]
        hooks = (args.hooks or ",".join(HOOKS)).split(",")
    for ranks, nodes, per_node in jobs:
        base = None
        for hook in hooks:
            if nodes:
                result = run_on_nodes(nodes, per_node, hook, args.rate, args.model, tmp)
                # DDP's own allreduce runs no hook to record its buckets: a ring's bytes add up over buckets
                buckets = result["buckets"] or [[p.numel() for p in build_model(args.model).parameters()]]
                expected = node_formula(hook, buckets, nodes, per_node)
            else:
                result = run(ranks, hook, args.rate, args.model, tmp)
                expected = formula(hook, result["buckets"], ranks)
            wire = result["wire_bytes_per_step"]
            base = base or wire
            row = dict(ranks=ranks, hook=hook, wire_mb=wire / 1e6, reduction=base / wire,
                       step_seconds=result["step_seconds"], buckets=result["buckets"],
                       formula_mb=None if expected is None else expected / 1e6)
            rows.append(row)
            vs = "" if expected is None else f"  formula {expected / 1e6:8.2f} MB ({100 * (wire / expected - 1):+.1f}%)"
            print(f"{ranks} ranks  {hook:12s} {row['wire_mb']:8.2f} MB/step  {row['reduction']:6.1f}x fewer  "
                  f"step {row['step_seconds']:.3f} s{vs}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"model": args.model, "rate": args.rate, "rows": rows}, f, indent=1)
    link = "unshaped" if args.rate == "none" else f"shaped to {args.rate} (shared by both directions)"
    command = (f"python benchmarks/ddp_hooks.py --layouts {args.layouts}"
               + ("" if args.rate == "none" else f" --rate {args.rate}") if args.layouts else
               f"python benchmarks/ddp_hooks.py --ranks {args.ranks} --rate {args.rate}")
    if args.layouts:
        link = "unshaped" if args.rate == "none" else f"shaped to {args.rate} each way"
        lines = [f"# DDP communication hooks between nodes: bytes per step on the NICs ({link})", "",
                 f"`{args.model}` (25.2M parameters), batch 8 per rank, SGD, `torchrun` on `benchmarks/nodelab.py`'s "
                 f"network-namespace nodes (NICs {link}); {MEASURED} steps measured after {WARMUP} of warm-up. MB per "
                 "step sent by all nodes' NICs (between nodes); formula: `node_formula` in `benchmarks/ddp_hooks.py` "
                 "(the node model's routes). `qsgd-4bit` and `topk-1%` take the flat exchange (`auto`), the "
                 "`-node-aware` rows `exchange='node_aware'`. Machine: the project's 2-core VM (ranks oversubscribe it; bytes do not "
                 "depend on that; step times here only compare hooks).", ""]
        header = "| nodes x ranks | hook | MB/step between nodes | fewer than allreduce | step s | formula MB | measured/formula |"
    else:
        lines = [f"# DDP communication hooks: bytes and step time per step ({link})", "",
                 f"`{args.model}` (25.2M parameters), batch 8 per rank, SGD, `torchrun` ranks in one network namespace, "
                 f"loopback {link}; {MEASURED} steps measured after {WARMUP} of warm-up (DDP's bucket rebuild, "
                 "PowerSGD's `start_powerSGD_iter=2`). MB per step of all ranks' traffic; step time the median on "
                 "rank 0. Machine: the project's 2-core VM (more than 2 ranks oversubscribe it: times then compare "
                 "hooks with each other only).", ""]
        header = "| ranks | hook | MB/step on the wire | fewer than allreduce | step s | formula MB | measured/formula |"
    lines += ["```bash", command + ("" if args.out.endswith("ddp-hooks") else f" --out {os.path.relpath(args.out, ROOT)}"),
              "```", "", header, "|---|---|---|---|---|---|---|"]
    for r in rows:
        f_mb = "" if r["formula_mb"] is None else f"{r['formula_mb']:.2f}"
        ratio = "" if r["formula_mb"] is None else f"{r['wire_mb'] / r['formula_mb']:.3f}"
        lines.append(f"| {r['ranks']} | `{r['hook']}` | {r['wire_mb']:.2f} | {r['reduction']:.1f}x | "
                     f"{r['step_seconds']:.3f} | {f_mb} | {ratio} |")
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
