"""AdamW between nodes: per-step training against DiLoCo's local steps, on the byte-level language model.

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python benchmarks/nodelab.py --nodes 2 --per-node 1 -- \\
        python benchmarks/lm_diloco.py --configs adamw,diloco-h16-qsgd-4bit
    python benchmarks/lm_diloco.py --report benchmarks/results/diloco/2ranks.json

The model, data and evaluation are ``benchmarks/lm_convergence.py``'s (a 0.48M-parameter byte-level
transformer on the standard library's source; global batch 32 x 64 bytes dealt to the ranks; linear warm-up
and cosine decay of the learning rate), with AdamW (weight decay 0.01) and ``STEPS`` steps. A configuration
name says what runs:

- ``adamw`` / ``adamw-<compressor>``: ``hvd.DistributedOptimizer`` around AdamW, every step's gradient
  averaged (``<compressor>`` a name of ``benchmarks/compressors.py``, e.g. ``adamw-qsgd-4bit``);
- ``diloco-h<H>[-<compressor>][-lr<outer lr>][-m<outer momentum>][-w<warm-up steps>][-f<fragments>]
  [~<compressor>][-hier]``: :func:`horovod_qsgd.torch.DiLoCo` around AdamW, ``sync_every=H``, the outer
  exchange (and warm-up) through the compressor (none: float32), the other settings at DiLoCo's defaults
  unless named, except the outer momentum and lr: 0.5 and 0.7 unless named (``UNNAMED_OUTER_MOMENTUM``,
  ``UNNAMED_OUTER_LR``: the defaults when the recorded runs were made; ``-f``: streaming
  DiLoCo's ``fragments``; ``~<compressor>``: the warm-up's own, ``warmup_compression``; ``-hier``:
  ``hierarchical=True``, on nodes of several ranks);
- ``@<lr>`` after any name: the inner learning rate (default ``--lr``), for the baseline's sweep.

Every run ends with ``average_models()`` and a validation pass. Bytes: on nodelab's nodes each node's local
rank 0 reads its NIC's transmit counter before and after the run and the job sums them: every byte that
crossed between nodes, Horovod's coordination included (``in_node_bytes``, on nodes of several ranks: the
loopback's); ``payload_bytes`` sums what the compressors (or, for
float32, the tensors) contributed. Rank 0 writes ``<N>ranks.json`` under ``--out`` and prints the table:
final validation loss against the baseline (paired over seeds, ± standard error) and bytes against it.
"""
import argparse
import json
import os
import re
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import lm_convergence  # noqa: E402
from benchmarks.compressors import SPECS, build  # noqa: E402

STEPS = 800
# A name without -m ran at outer momentum 0.5, DiLoCo's default when the recorded runs were made (0.8 since):
# pinned, so that each recorded name keeps saying what ran.
UNNAMED_OUTER_MOMENTUM = 0.5
# Likewise the outer lr: 0.7 at every H when the recorded runs were made (below H=16 the default falls since).
UNNAMED_OUTER_LR = 0.7
WEIGHT_DECAY = 0.01
NAME = re.compile(r"^(?P<kind>adamw|diloco-h(?P<h>\d+))(?:-(?!(?:lr|m|w|f)[0-9])(?P<codec>[a-z0-9%.-]+?))?"
                  r"(?:-lr(?P<olr>[0-9.]+))?(?:-m(?P<mom>[0-9.]+))?(?:-w(?P<warm>\d+))?(?:-f(?P<frag>\d+))?"
                  r"(?:~(?P<wcodec>[a-z0-9%.-]+?))?(?P<hier>-hier)?(?:@(?P<lr>[0-9.e-]+))?$")


def parse(name):
    match = NAME.match(name)
    if not match or any(match[g] and match[g] not in SPECS for g in ("codec", "wcodec")):
        raise argparse.ArgumentTypeError(f"unknown configuration {name!r}; see this script's docstring")
    return match


def train(hvd, compressors, name, corpus, seed, s, base_lr):
    import torch
    from horovod_qsgd.torch import DiLoCo
    match = parse(name)
    lr = float(match["lr"]) if match["lr"] else base_lr
    settings = dict(s, lr=lr)
    model, loss_of = lm_convergence.torch_model(seed, settings)
    inner = torch.optim.AdamW(model.parameters(), lr=lr, betas=lm_convergence.BETAS, eps=lm_convergence.EPS,
                              weight_decay=WEIGHT_DECAY)
    codec = match["codec"] or "none"
    compression = build(codec, compressors, seed=seed)
    if match["kind"] == "adamw":
        opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), compression=compression)
    else:
        extra = {k: cast(match[g]) for k, g, cast in (("outer_lr", "olr", float), ("outer_momentum", "mom", float),
                                                       ("warmup_steps", "warm", int), ("fragments", "frag", int),
                                                       ("hierarchical", "hier", bool))
                 if match[g]}
        extra.setdefault("outer_momentum", UNNAMED_OUTER_MOMENTUM)
        extra.setdefault("outer_lr", UNNAMED_OUTER_LR)
        if match["wcodec"]:
            extra["warmup_compression"] = build(match["wcodec"], compressors, seed=seed)
        opt = DiLoCo(inner, model.named_parameters(), sync_every=int(match["h"]), compression=compression, **extra)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    numel = sum(p.numel() for p in model.parameters())

    step, validation_sums, sum_over_ranks = lm_convergence.torch_loop(hvd, opt, inner, loss_of)

    def finish(t, record):
        if t + 1 == settings["steps"] and hasattr(opt, "average_models"):
            opt.average_models()  # before the last evaluation, which _train runs after this

    nic_before = _node_bytes(hvd)
    record = lm_convergence._train(hvd, corpus, settings, seed, step, validation_sums, sum_over_ranks, finish)
    nic, in_node = np.subtract(_node_bytes(hvd), nic_before) if nic_before is not None else (float("nan"),) * 2
    if hasattr(opt, "compression_stats"):
        payload = opt.compression_stats()["bytes_sent"]
    elif hasattr(compression, "compression_stats"):
        payload = compression.compression_stats()["bytes_sent"]
    else:  # Horovod's float32 (or fp16) allreduce of every parameter, every step
        payload = settings["steps"] * numel * (2 if codec == "fp16" else 4)
    record["wire_bytes"], record["payload_bytes"], in_node = sum_over_ranks([nic, payload, in_node],
                                                                            f"lm.bytes.{name}.{seed}")
    if hvd.local_size() > 1:
        record["in_node_bytes"] = in_node
    record["lr"] = lr
    if hasattr(opt, "average_models"):
        record["diloco"] = opt._diloco.settings()
    return record


def _commit():
    import subprocess
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "horovod_qsgd", "benchmarks/lm_diloco.py"],
                           cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + ("+changes" if dirty else "")


def _node_bytes(hvd):
    """(NIC, loopback) bytes this rank's node sent so far, counted on its local rank 0 (the others: 0), or None
    off nodelab's nodes."""
    from benchmarks import nodelab
    if not nodelab.on_a_node():
        return None
    return nodelab.link_bytes() if hvd.local_rank() == 0 else (0, 0)


def run_study(args):
    import horovod.torch as hvd
    import horovod_qsgd.torch as compressors
    from benchmarks.stdlib_text import Corpus
    hvd.init()
    settings = dict(lm_convergence.STUDY, steps=args.steps, optimizer="adamw", weight_decay=WEIGHT_DECAY,
                    lr=args.lr, batch_size=args.batch)
    corpus = Corpus()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{hvd.size()}ranks.json")
    results = {}
    if os.path.exists(path):
        with open(path) as f:
            earlier = json.load(f)
        if earlier["settings"] != settings:
            raise SystemExit(f"{path} was made with other settings ({earlier['settings']}); use another --out")
        results = earlier["results"]
    for name in args.configs:
        for seed in (int(x) for x in args.seeds.split(",")):
            if any(r["seed"] == seed for r in results.get(name, [])):
                continue
            start = time.perf_counter()
            run = train(hvd, compressors, name, corpus, seed, settings, args.lr)
            run["seconds"] = time.perf_counter() - start
            run["commit"] = _commit()
            results.setdefault(name, []).append(run)
            if hvd.rank() == 0:
                print(f"{name:>28} seed {seed}: validation {run['validation'][-1]:.4f}, wire "
                      f"{run['wire_bytes'] / 1e6:.1f} MB, payload {run['payload_bytes'] / 1e6:.1f} MB "
                      f"({run['seconds']:.0f} s)", flush=True)
                with open(path, "w") as f:
                    json.dump({"ranks": hvd.size(), "settings": settings, "corpus": corpus.describe(),
                               "commit": _commit(), "results": results}, f, indent=1)
    if hvd.rank() == 0:
        with open(path) as f:
            report(json.load(f), args.baseline)


def report(record, baseline="adamw"):
    """The table: per configuration, final validation loss, the paired difference against ``baseline`` over
    the seeds both ran (mean ± standard error), and bytes against it (wire and payload)."""
    results = record["results"]
    base = {r["seed"]: r for r in results.get(baseline, [])}
    s = record["settings"]
    print(f"\nbyte LM, AdamW, {record['ranks']} ranks, {s['steps']} steps, inner lr {s['lr']} unless named; "
          f"baseline {baseline}\n")
    print(f"{'configuration':>30} {'seeds':>5} {'validation':>10} {'vs baseline':>16} {'fewer wire bytes':>17} "
          f"{'fewer payload bytes':>20}")
    for name, runs in results.items():
        paired = [r for r in runs if r["seed"] in base]
        diffs = [r["validation"][-1] - base[r["seed"]]["validation"][-1] for r in paired]
        diff = (f"{np.mean(diffs):+.3f} ± {np.std(diffs, ddof=1) / np.sqrt(len(diffs)):.3f}" if len(diffs) > 1
                else f"{diffs[0]:+.3f}" if diffs else "")
        wire = (np.mean([base[r["seed"]]["wire_bytes"] / r["wire_bytes"] for r in paired]) if paired else
                float("nan"))
        payload = (np.mean([base[r["seed"]]["payload_bytes"] / r["payload_bytes"] for r in paired]) if paired else
                   float("nan"))
        print(f"{name:>30} {len(runs):>5} {np.mean([r['validation'][-1] for r in runs]):>10.4f} {diff:>16} "
              f"{wire:>16.1f}x {payload:>19.1f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", type=lambda text: [parse(n).string for n in text.split(",")],
                        default=["adamw", "diloco-h16-qsgd-4bit"])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--lr", type=float, default=lm_convergence.STUDY["lr"], help="inner (and baseline) lr")
    parser.add_argument("--batch", type=int, default=lm_convergence.STUDY["batch_size"],
                        help="global batch in sequences, dealt to the ranks (default 32; Horovod's convention of a "
                             "fixed batch per rank: 16 x the ranks)")
    parser.add_argument("--baseline", default="adamw")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "diloco"))
    parser.add_argument("--report", metavar="JSON")
    args = parser.parse_args()
    if args.report:
        with open(args.report) as f:
            report(json.load(f), args.baseline)
        return
    run_study(args)


if __name__ == "__main__":
    main()
