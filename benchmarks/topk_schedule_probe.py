"""Would a density schedule close Top-k's gap on the language model? A one-process probe.

    OMP_NUM_THREADS=1 python benchmarks/topk_schedule_probe.py --ranks 2 --seeds 0 \\
        --schedules constant,dense40,dgc100,dgc200

One process plays N ranks of the language-model study (``lm_convergence.STUDY``:
the same text, initial weights, global batches, Adam and learning-rate
schedule). Each rank's share of the global batch gives its own gradient;
each rank keeps an error-feedback residual per tensor of at least
``MIN_NUMEL`` elements (as the compressors' ``min_numel``) and sends the k
largest entries of ``|gradient + residual|`` (``torch.topk``); the sent
entries are averaged over the ranks and Adam steps. Smaller tensors are
averaged exactly.

This is a reference of the algorithm, not horovod_qsgd's code: its
``constant`` schedule is what ``TopK(ratio=0.01)`` computes (on seed 0 it
should end near the 2-rank study's 2.848), and the others are schedules
``TopK`` does not offer, tried here to learn whether building one is worth it:

* ``constant``: density 1% at every step;
* ``denseN``: uncompressed for the first N steps (the residuals stay zero),
  then 1%;
* ``dgcN``: Deep Gradient Compression's warm-up (Lin et al., 2018), made
  continuous: the density falls exponentially from 25% to 1% over the first
  N steps, then stays at 1%.

A schedule's name may end in ``+mc``: DGC's momentum correction and
momentum factor masking, for ``--optimizer sgd`` only. Each rank keeps its
own momentum ``u = m u + g`` and accumulates ``v += u``; it sends the k
largest entries of ``|v|`` and zeroes ``v`` where it sent, and ``u`` too
unless it sent everything (at density 1 this is momentum SGD); the
averaged sent values step the weights with plain SGD (no second momentum
on the compressed tensors). Without ``+mc`` error feedback accumulates the
gradient and the optimizer's momentum runs on the averaged sparse sum, as
with ``TopK`` under ``torch.optim.SGD``.

Prints each run's final validation cross-entropy (nats per byte) and each
schedule's traffic (the compressed tensors' bytes over the run against
uncompressed: 4 bytes per entry dense, 8 per sent entry, value and index),
and writes every curve and those ratios to ``--out``.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import byte_lm  # noqa: E402
from benchmarks.lm_convergence import BETAS, EPS, SGD_LR, SGD_MOMENTUM, STUDY, learning_rate  # noqa: E402

MIN_NUMEL = 10_000
TARGET_DENSITY, DGC_START_DENSITY = 0.01, 0.25


def density(schedule, step):
    """The fraction of a tensor's entries each rank sends at ``step`` (1.0: uncompressed)."""
    schedule = schedule.removesuffix("+mc")
    if schedule == "constant":
        return TARGET_DENSITY
    if schedule.startswith("dense"):
        return 1.0 if step < int(schedule[len("dense"):]) else TARGET_DENSITY
    if schedule.startswith("dgc"):
        span = int(schedule[len("dgc"):])
        if step >= span:
            return TARGET_DENSITY
        return DGC_START_DENSITY * (TARGET_DENSITY / DGC_START_DENSITY) ** (step / span)
    raise SystemExit(f"unknown schedule {schedule!r}: constant, denseN or dgcN")


def traffic_ratio(schedule, steps):
    """Bytes the compressed tensors send over ``steps`` steps against sending them uncompressed."""
    return float(np.mean([1.0 if density(schedule, t) >= 1.0 else 2 * density(schedule, t) for t in range(steps)]))


def write(path, ranks, settings, corpus, runs):
    with open(path, "w") as f:
        json.dump({"ranks": ranks, "settings": settings, "min_numel": MIN_NUMEL, "target_density": TARGET_DENSITY,
                   "corpus": corpus.describe(), "runs": runs,
                   "bytes_vs_uncompressed": {name: traffic_ratio(name, STUDY["steps"]) for name in runs}},
                  f, indent=1)


def train(corpus, seed, ranks, schedule, s=STUDY):
    import torch
    ops = byte_lm.TorchOps()
    params = {name: torch.nn.Parameter(torch.from_numpy(value))
              for name, value in byte_lm.initial_weights(seed, s["width"], s["layers"], s["context"]).items()}
    compressed = [name for name, p in params.items() if p.numel() >= MIN_NUMEL]
    corrected = schedule.endswith("+mc")
    if s["optimizer"] == "adam":
        optimizer = torch.optim.Adam(params.values(), lr=s["lr"], betas=BETAS, eps=EPS)
    else:  # with the correction the ranks' own momenta replace the optimizer's on the compressed tensors
        optimizer = torch.optim.SGD([
            {"params": [p for name, p in params.items() if name not in compressed], "momentum": SGD_MOMENTUM},
            {"params": [params[name] for name in compressed], "momentum": 0.0 if corrected else SGD_MOMENTUM}],
            lr=s["lr"])
    residuals = [{name: torch.zeros_like(params[name]) for name in compressed} for _ in range(ranks)]
    momenta = [{name: torch.zeros_like(params[name]) for name in compressed} for _ in range(ranks)]

    def loss_of(batch, reduction="mean"):
        tokens = torch.from_numpy(batch.astype(np.int64))
        logits = byte_lm.forward(params, tokens[:, :-1], ops, s["heads"])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, byte_lm.VOCABULARY), tokens[:, 1:].reshape(-1),
                                                 reduction=reduction)

    validation = corpus.validation_batch(s["validation_sequences"], s["context"])
    record = {"seed": seed, "steps": [], "validation": []}
    for t in range(s["steps"]):
        batch, fraction = corpus.training_batch(seed, t, s["batch_size"], s["context"]), density(schedule, t)
        sums = {name: torch.zeros_like(p) for name, p in params.items()}
        for rank in range(ranks):
            grads = torch.autograd.grad(loss_of(batch[rank::ranks]), list(params.values()))
            for (name, p), grad in zip(params.items(), grads):
                if name not in residuals[rank] or (fraction >= 1.0 and not corrected):
                    sums[name] += grad
                    continue
                if corrected:
                    momenta[rank][name].mul_(SGD_MOMENTUM).add_(grad)
                    acc = (momenta[rank][name] + residuals[rank][name]).reshape(-1)
                else:
                    acc = (grad + residuals[rank][name]).reshape(-1)
                chosen = torch.topk(acc.abs(), max(1, min(acc.numel(), int(acc.numel() * fraction))),
                                    sorted=False).indices
                sent = torch.zeros_like(acc)
                sent[chosen] = acc[chosen]
                residuals[rank][name] = (acc - sent).reshape(p.shape)
                if corrected and fraction < 1.0:  # momentum factor masking: a sent coordinate's momentum restarts
                    momenta[rank][name].view(-1)[chosen] = 0.0
                sums[name] += sent.reshape(p.shape)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(t, s)
        for name, p in params.items():
            p.grad = sums[name] / ranks
        optimizer.step()
        if (t + 1) % s["eval_every"] == 0 or t + 1 == s["steps"]:
            with torch.no_grad():
                total = loss_of(validation, "sum").item()
            record["steps"].append(t + 1)
            record["validation"].append(total / validation[:, 1:].size)
    return record


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--schedules", default="constant,dense40,dgc100,dgc200")
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                        help="sgd: the study's momentum SGD (lr %g, momentum %g)" % (SGD_LR, SGD_MOMENTUM))
    parser.add_argument("--out", help="default: benchmarks/results/lm-convergence/topk_schedules[_sgd].json")
    parser.add_argument("--resume", action="store_true", help="keep the runs already in --out")
    args = parser.parse_args()
    settings = dict(STUDY, optimizer=args.optimizer, lr=SGD_LR if args.optimizer == "sgd" else STUDY["lr"])
    if args.out is None:
        suffix = "" if args.optimizer == "adam" else "_" + args.optimizer
        args.out = os.path.join(ROOT, "benchmarks", "results", "lm-convergence", f"topk_schedules{suffix}.json")
    import torch
    torch.set_num_threads(1)
    from benchmarks.stdlib_text import Corpus
    corpus = Corpus()
    runs = {}
    if args.resume and os.path.exists(args.out):
        with open(args.out) as f:
            earlier = json.load(f)
        if (earlier["ranks"], earlier["settings"]) != (args.ranks, settings):
            raise SystemExit(f"--resume: {args.out} was made with other ranks or settings; use another --out")
        runs = earlier["runs"]
    for schedule in args.schedules.split(","):
        density(schedule, 0)  # an unknown schedule stops here, before any training
        if schedule.endswith("+mc") and args.optimizer != "sgd":
            raise SystemExit(f"{schedule}: momentum correction is for --optimizer sgd")
        for seed in (int(v) for v in args.seeds.split(",")):
            if any(run["seed"] == seed for run in runs.get(schedule, [])):
                continue
            start = time.perf_counter()
            run = train(corpus, seed, args.ranks, schedule, settings)
            runs.setdefault(schedule, []).append(run)
            print(f"{schedule:>10} seed {seed}: validation {run['validation'][-1]:.4f} nats/byte "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
            write(args.out, args.ranks, settings, corpus, runs)
    write(args.out, args.ranks, settings, corpus, runs)
    for name, rs in runs.items():
        print(f"{name:>10}: mean final validation {np.mean([r['validation'][-1] for r in rs]):.4f} nats/byte, "
              f"bytes 1/{1 / traffic_ratio(name, STUDY['steps']):.1f} of uncompressed")


if __name__ == "__main__":
    main()
