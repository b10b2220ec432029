"""Step time on two nodes with a shaped link between them: node-aware against the flat two stages and uncompressed.

    python benchmarks/node_step_time.py [--layout 2x2] [--rates 1gbit,200mbit] [--rounds 3]
                                        [--framework pytorch] [--out benchmarks/results/node-step-time]

For each rate of the NICs between the nodes, every configuration of
``--configs`` runs ``--rounds`` times, the configurations interleaved (A B C
A B C ...), so that the machine's drift within the hour falls on all of them
alike; each run is ``benchmarks/node_bytes.py``'s job (PyTorch's synthetic
``mlp10m``, batch 8 per rank, on ``benchmarks/nodelab.py``'s namespaces; or
TensorFlow's, its gradients in one grouped call: ``groups=1``) with
``--iters`` timed iterations of 2 steps. Reported per rate: each
configuration's median s/step over its runs, and its ratio to the flat two
stages and to uncompressed, of the same rate and run. Bytes between nodes are
``node_bytes.py``'s subject; they are printed here only to show each run
exchanged what it should.

``--base REV``: every configuration also runs at that commit (exported with ``git archive``), each run
beside this checkout's, in alternating order, and each row gets its ratio to the base's median: a change's
step time measured against its base revision.

Writes ``results.json`` and ``README.md`` to ``--out`` (needs root).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.node_bytes import CONFIGS, split_name, run  # noqa: E402
from benchmarks.paired import check_imports_from, export, working_tree_commit  # noqa: E402

DEFAULT_CONFIGS = "none,qsgd-4bit-two-stage,qsgd-4bit-node-aware,topk-1%-two-stage,topk-1%-node-aware"


def _ratio(rows, name, base_name):
    base = rows.get(base_name)
    return None if base is None else rows[name]["median"] / base["median"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layout", default="2x2")
    ap.add_argument("--model", default="mlp10m")
    ap.add_argument("--framework", default="pytorch", choices=["pytorch", "tensorflow"])
    ap.add_argument("--configs", default=DEFAULT_CONFIGS)
    ap.add_argument("--rates", default="1gbit,200mbit", help="tc rates of the NICs, one set of runs each")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5, help="timed iterations (of 2 steps) per run")
    ap.add_argument("--base", help="a commit that every configuration also runs at, interleaved")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "node-step-time"))
    args = ap.parse_args()
    labels = dict(CONFIGS)
    names = args.configs.split(",")
    unknown = [n for n in names if n not in labels]
    if unknown:
        ap.error(f"unknown configurations {unknown}; known: {', '.join(labels)}")
    nodes, per_node = (int(x) for x in args.layout.split("x"))
    tmp = tempfile.mkdtemp(prefix="hq-node-time-")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    trees = [("work", ROOT)]
    if args.base:
        base_tree, base_commit = export(args.base, tmp)
        check_imports_from(base_tree)
        trees.append(("base", base_tree))
    table = {}
    for rate in args.rates.split(","):
        runs = {(name, label): [] for name in names for label, _ in trees}
        for round_ in range(args.rounds):
            for name in names:
                for label, tree in trees if round_ % 2 == 0 else trees[::-1]:
                    result = run(name, nodes, per_node, args.model, tmp, rate, iters=args.iters,
                                 framework=args.framework, tree=tree)
                    runs[name, label].append(result["step_seconds"])
                    print(f"{rate:>8} round {round_} {labels[name]:24s} {label:4s} {result['step_seconds']:.3f} "
                          f"s/step, {result['inter_node_bytes_per_step'] / 1e6:.2f} MB/step between nodes", flush=True)
        rows = {name: dict(config=labels[name], exchange=split_name(name)[1], runs=runs[name, "work"],
                           median=statistics.median(runs[name, "work"])) for name in names}
        for name, row in rows.items():
            row["vs_two_stages"] = _ratio(rows, name, f"{split_name(name)[0]}-two-stage")
            row["vs_uncompressed"] = _ratio(rows, name, "none")
            if args.base:
                row["base_runs"] = runs[name, "base"]
                row["vs_base"] = row["median"] / statistics.median(runs[name, "base"])
        table[rate] = rows
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"framework": args.framework, "model": args.model, "layout": args.layout, "rounds": args.rounds,
                   "iters": args.iters, "taken": started, "commit": working_tree_commit(),
                   "base": base_commit if args.base else None, "rates": table}, f, indent=1)
    command = " ".join(["python", "benchmarks/node_step_time.py"] + sys.argv[1:])
    framework = "PyTorch" if args.framework == "pytorch" else "TensorFlow (`DistributedGradientTape(groups=1)`)"
    lines = ["# Step time between two shaped nodes: node-aware, flat two stages, uncompressed", "",
             f"{framework}, `{args.model}`, batch 8 per rank, {args.layout} (nodes x ranks) on "
             "`benchmarks/nodelab.py`'s namespaces, every NIC shaped to the rate (both directions share it), "
             "loopbacks unshaped. Median s/step "
             f"of {args.rounds} interleaved runs of {args.iters} x 2 timed steps each; ratios of medians of the same "
             f"rate (below 1: faster). Taken {started} on the project's 2-core VM ({nodes * per_node} ranks "
             "oversubscribe it: in-node steps compete with the codecs for 2 cores), at "
             f"{working_tree_commit()[:12]}" + (f" against {base_commit[:12]}" if args.base else "") + ".", "",
             "```bash", command, "```", ""]
    for rate, rows in table.items():
        base_columns = (" base runs | / base |", "---|---|") if args.base else ("", "")
        lines += [f"## NICs at {rate}", "",
                  "| exchange | s/step (median) | runs | / flat two stages | / uncompressed |" + base_columns[0],
                  "|---|---|---|---|---|" + base_columns[1]]
        for name, row in rows.items():
            flat, none = row["vs_two_stages"], row["vs_uncompressed"]
            vs_two = "" if flat is None or row["exchange"] == "two_stage" else f"{flat:.2f}"
            vs_none = "" if none is None or name == "none" else f"{none:.2f}"
            vs_base = f" {', '.join(f'{s:.2f}' for s in row['base_runs'])} | {row['vs_base']:.3f} |" \
                if args.base else ""
            lines.append(f"| {row['config']} | {row['median']:.3f} | "
                         f"{', '.join(f'{s:.2f}' for s in row['runs'])} | {vs_two} | {vs_none} |{vs_base}")
        lines.append("")
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
