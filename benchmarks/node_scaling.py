r"""Nodes of L GPUs behind one NIC: what each exchange sends between nodes, and a projected step time.

    python benchmarks/node_scaling.py [--per-node 8] [--out benchmarks/results/node-scaling]

The cost model of ``benchmarks/scaling.py`` (one link per rank) cannot see a
node: here N = nodes x L ranks, the ranks of a node share one full-duplex NIC
of ``B`` per direction, and each rank has an in-node link of ``B_in`` (NVLink
or PCIe). Per tensor of ``n`` fp32 elements (``S = 4 n`` bytes), ``b(m)`` /
``b2(m)`` the first / second-stage payload of ``m`` elements, per node and
direction on its NIC, and per rank inside the node:

=====================  ==========================================  ==============================
exchange                NIC bytes per node                           in-node bytes per rank
=====================  ==========================================  ==============================
ring allreduce (none)   ``2 (N-1)/N S`` (the ring crosses once)      ``2 (N-1)/N S``
allgather               ``(N-1) b(n)`` (every payload but one)       ``(N-1) b(n)``
two stages (flat)       ``L (N-L)/N b(n) + (N-1)/N b2(n)``           ``(L-1)/N b(n) + (N-1)/N b2(n)``
two stages, direct      ``L (N-L)/N (b(n) + b2(n))`` (DDP hooks)     ``(L-1)/N (b(n) + b2(n))``
node-aware              ``2 (M-1)/M L b(n/L)``, M = nodes            ``(L-1)/L S + (L-1) r(n/L)``
=====================  ==========================================  ==============================

The flat rows are the routes of Horovod over Gloo measured in
``benchmarks/results/node-bytes/`` (``benchmarks/node_bytes.py`` uses
:func:`tensor_bytes`): the first stage's alltoall sends each slice straight
to its owner, so a node's L ranks send their slices for the other nodes' ranks
across (about L C for a compressed tensor of C bytes), while the second
stage's ring allgather crosses each node boundary once (about C). The
node-aware exchange (issue #27; ``horovod_qsgd.common.node_aware``) reduces
inside the node first at full precision (a reduce-scatter), runs the two
stages on each rank's 1/L shard among the M ranks with the same local rank,
and gathers inside the node what those received, compressed (``r(n/L)``: the
M payloads of a shard, or the M owners' sums of its chunks; each rank then
decodes all L shards): about 2 (M-1)/M C per node. (DDP's hooks gather the
same compressed sums, in rows of one length.)

Step time: ``compute + m codec + NIC bytes / B + in-node bytes / B_in +
latency``, with the codec work per rank of ``scaling.codec_seconds`` (the
node-aware exchange's on a 1/L shard among M ranks) times the adapter's
fitted multiplier ``m`` (``benchmarks/results/scaling/``; node-aware: plus
the decode of the other L-1 shards), or 0 (a free
codec, the bound for a faster device; GPU codecs were never measured).
Latency: per fusion buffer, ``2 (N-1)`` messages for a ring allreduce and
``N-1`` per allgather or alltoall, at the inter-node latency; the node-aware
exchange's in-node steps at the in-node latency. Compute and communication
are added, not overlapped.
"""
import argparse
import csv
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import scaling  # noqa: E402

NODES = [2, 4, 8, 16, 32, 64, 128]
NIC_GBIT = [100, 200, 400]
IN_NODE_GBIT = 2400          # per rank and direction: NVLink-class (300 GB/s)
LATENCY_INTER, LATENCY_IN = 25e-6, 5e-6
EXCHANGES = [("none", "ring"), ("qsgd-4bit", "allgather"), ("qsgd-4bit", "two_stage"), ("qsgd-4bit", "node_aware"),
             ("topk-1%", "allgather"), ("topk-1%", "two_stage"), ("topk-1%", "node_aware")]


def tensor_bytes(name, exchange, n, nodes, per_node):
    """(NIC bytes per node, in-node bytes per rank, messages) of one tensor of ``n`` elements; ``messages``:
    [(message steps, latency, bytes this tensor adds to the fusion buffer)] per collective. A tensor below the
    compressor's ``min_numel`` goes by the ring allreduce; a compressed one adds Horovod's one-element
    placeholder (a ring allreduce too, fused with the others: its messages are the uncompressed ring's)."""
    ranks = nodes * per_node
    latency = LATENCY_INTER if nodes > 1 else LATENCY_IN

    def ring(nbytes):
        crossing = 2 * (ranks - 1) / ranks * nbytes
        return (crossing if nodes > 1 else 0.0), crossing, [(2 * (ranks - 1), latency, nbytes)]

    if name == "none":
        return ring(4 * n)
    compressor, first, second = scaling._codecs(name)
    if n < compressor.min_numel:
        return ring(4 * n)
    placeholder = ring(4)
    from horovod_qsgd.common.chunks import chunk_bounds, chunk_unit
    unit = chunk_unit(first)
    if exchange == "allgather":
        b = first.max_payload_nbytes(n)
        nic, inside = (ranks - 1) * b if nodes > 1 else 0.0, (ranks - 1) * b
        return nic + placeholder[0], inside + placeholder[1], placeholder[2] + [(ranks - 1, latency, ranks * b)]
    if exchange in ("two_stage", "two_stage_direct"):
        chunks = [e - s for s, e in chunk_bounds(n, ranks, unit)]
        b1, b2 = sum(first.max_payload_nbytes(c) for c in chunks), sum(second.max_payload_nbytes(c) for c in chunks)
        # the second stage by Horovod's ring allgather crosses each boundary once; "direct" (the DDP hooks'
        # all_to_all_single) sends each owner's payload straight to the N-L ranks off its node
        direct = exchange == "two_stage_direct"
        second_crossing = per_node * (ranks - per_node) / ranks * b2 if direct else (ranks - 1) / ranks * b2
        nic = per_node * (ranks - per_node) / ranks * b1 + second_crossing if nodes > 1 else 0.0
        inside = (per_node - 1) / ranks * (b1 + b2) if direct else (per_node - 1) / ranks * b1 + (ranks - 1) / ranks * b2
        return (nic + placeholder[0], inside + placeholder[1],
                placeholder[2] + [(ranks - 1, latency, b1), (ranks - 1, latency, b2)])
    if exchange == "node_aware":
        # horovod_qsgd.common.node_aware: L equal shards; between nodes each shard as a tensor among M ranks,
        # the allgather or the two stages as "auto" chooses (the engine's rule)
        from horovod_qsgd.common.chunks import shard_numel
        from horovod_qsgd.common.two_stage import choose_exchange
        shard = shard_numel(n, per_node, unit)
        if choose_exchange("auto", first, second, shard, nodes) == "two_stage":
            chunks = [e - s for s, e in chunk_bounds(shard, nodes, unit)]
            b1, b2 = sum(first.max_payload_nbytes(c) for c in chunks), sum(second.max_payload_nbytes(c) for c in chunks)
            nic, received = per_node * (nodes - 1) / nodes * (b1 + b2), b2
        else:
            b1, b2 = nodes * first.max_payload_nbytes(shard), 0.0
            nic, received = per_node * (nodes - 1) * first.max_payload_nbytes(shard), b1
        # the shards at full precision, then what step 2 received, compressed, to every rank of the node
        inside = (per_node - 1) / per_node * 4 * n + (per_node - 1) * received
        return nic, inside, [(per_node - 1, LATENCY_IN, 4 * n), (nodes - 1, LATENCY_INTER, b1),
                             (nodes - 1, LATENCY_INTER, b2), (per_node - 1, LATENCY_IN, per_node * received)]
    raise ValueError(f"exchange {exchange!r}")


def codec_seconds(costs, name, exchange, n, nodes, per_node):
    if name == "none":
        return 0.0
    if exchange == "node_aware":  # its shard's two stages, then the decode of the other shards of the node
        shard = n / per_node
        return (scaling.codec_seconds(costs, name, "two_stage", shard, nodes)
                + (per_node - 1) * scaling.decode_seconds(costs, name, shard))
    return scaling.codec_seconds(costs, name, exchange, n, nodes * per_node)


def step_seconds(name, exchange, model, nodes, per_node, nic_gbit, costs, multiplier, codec_scale):
    """(projected step seconds, NIC bytes per node) of one step of ``model`` (``scaling.MODELS``)."""
    tensors, compute = scaling.MODELS[model]
    n = 1 << 20
    nic, inside, messages = tensor_bytes(name, exchange, n, nodes, per_node)
    # every collective's tensors are fused: one round of its messages per 64 MiB of what it packs
    latency = sum(steps * seconds * max(1, math.ceil(tensors * packed / scaling.FUSION_BYTES))
                  for steps, seconds, packed in messages)
    codec = codec_scale * multiplier * tensors * codec_seconds(costs, name, exchange, n, nodes, per_node)
    link = tensors * (nic * 8 / (nic_gbit * 1e9) + inside * 8 / (IN_NODE_GBIT * 1e9))
    return compute + codec + link + latency, tensors * nic


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--scaling", default=os.path.join(ROOT, "benchmarks", "results", "scaling"),
                    help="scaling.py's directory: codec costs and the runs the multipliers are fitted to")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "node-scaling"))
    args = ap.parse_args()
    with open(os.path.join(args.scaling, "codecs.json")) as f:
        costs = json.load(f)
    params = scaling.fit(scaling.measured_runs(args.scaling), costs)
    rows = []
    for model in scaling.MODELS:
        for nodes in NODES:
            for gbit in NIC_GBIT:
                for codec_scale, codec in ((1.0, "this CPU"), (0.0, "free")):
                    base, base_nic = step_seconds("none", "ring", model, nodes, args.per_node, gbit, costs, 0.0, 0.0)
                    for name, exchange in EXCHANGES[1:]:
                        t, nic = step_seconds(name, exchange, model, nodes, args.per_node, gbit, costs,
                                              scaling.codec_multiplier(name, params), codec_scale)
                        rows.append(dict(model=model, nodes=nodes, per_node=args.per_node, nic_gbit=gbit, codec=codec,
                                         compressor=name, exchange=exchange, step_seconds=t, speedup=base / t,
                                         nic_mb=nic / 1e6, fewer_nic_bytes=base_nic / nic))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "projection.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = ["# Nodes of several GPUs behind one NIC: inter-node bytes and projected step time", "",
             f"L = {args.per_node} ranks per node, {IN_NODE_GBIT} Gbit/s in-node per rank, latency "
             f"{LATENCY_INTER * 1e6:.0f} us between and {LATENCY_IN * 1e6:.0f} us inside nodes; models of "
             "`benchmarks/scaling.py` (tensors of 2^20 elements; 25M: 100 ms compute, 100M: 400 ms). The model "
             "and its assumptions: `benchmarks/node_scaling.py`'s docstring. The node-aware rows project "
             "`exchange=\"node_aware\"` as Horovod's adapters run it (issue #27: the node's ranks share the "
             "compressed sums; its bytes between nodes measured in `../node-bytes/` and, for DDP's hooks, "
             "`../ddp-hooks/nodes/`); the flat rows' bytes are the routes measured in `../node-bytes/`.", "", "```bash", f"python benchmarks/node_scaling.py --per-node {args.per_node}",
             "```", ""]
    for codec in ("free", "this CPU"):
        lines += [f"## Speedup over the uncompressed ring, {codec} codec (x fewer NIC bytes per node)", ""]
        for model in scaling.MODELS:
            lines += [f"{model}:", "", "| nodes | NIC Gbit/s | " + " | ".join(f"{n} {x}" for n, x in EXCHANGES[1:]) + " |",
                      "|---|---|" + "---|" * (len(EXCHANGES) - 1)]
            for nodes in NODES:
                for gbit in NIC_GBIT:
                    cells = []
                    for name, exchange in EXCHANGES[1:]:
                        r = next(r for r in rows if (r["model"], r["nodes"], r["nic_gbit"], r["codec"], r["compressor"],
                                                     r["exchange"]) == (model, nodes, gbit, codec, name, exchange))
                        cells.append(f"{r['speedup']:.2f}x ({r['fewer_nic_bytes']:.1f}x)")
                    lines.append(f"| {nodes} | {gbit} | " + " | ".join(cells) + " |")
            lines.append("")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
