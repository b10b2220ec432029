"""Convergence on real text: a byte-level language model on the Python standard library's source.

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 TF_NUM_INTRAOP_THREADS=1 TF_NUM_INTEROP_THREADS=1 \\
    python -m horovod.runner.launch -np 2 -H localhost:2 --gloo \\
        python benchmarks/lm_convergence.py --framework pytorch      # or tensorflow; -np 4, 8
    python benchmarks/lm_convergence.py --report benchmarks/results/lm-convergence/pytorch_2ranks.json

Data: ``benchmarks/stdlib_text.py`` (the interpreter's own ``.py`` files
without test suites, a fixed split by file into training and validation).
Model: ``benchmarks/byte_lm.py``, a pre-norm transformer over bytes (width
128, 2 blocks, 4 heads, context 64: 0.48M parameters), the same function and
initial weights in both frameworks.

Training (``STUDY``): 400 steps of Adam (PyTorch's rule, betas 0.9/0.999,
eps 1e-8), learning rate 3e-3 (uncompressed, one process, seed 0: 2.01 / 2.21 /
2.55 nats per byte at 3e-3 / 6e-3 / 1.2e-2) with linear warm-up over the first 40
steps and a cosine decay to a tenth; a **global** batch of 32 sequences of 64
bytes drawn from (seed, step), each rank taking every N-th sequence, so that
uncompressed training is the same computation for any number of ranks and
only the compressors' error changes with N. The same hyperparameters for every
compressor; 3 seeds (initial weights, batches and the compressors' seeds).

Every ``eval_every`` steps the ranks evaluate validation cross-entropy (nats
per byte) on 256 fixed validation sequences, each rank a share, summed by
allreduce. The embedding (256 x 128 = 32,768 elements) is above the
compressors' ``min_numel`` (10,000) and is compressed like any dense
gradient; the position embedding (64 x 128 = 8,192) and all biases and norm
parameters are below it and go through the plain allreduce. In TensorFlow the
embedding's gradient is an ``IndexedSlices``; ``sparse_as_dense=True`` makes
it the dense gradient PyTorch has, so both frameworks compress the same
tensors. The uncompressed PyTorch runs also record how many rows of the
averaged embedding gradient are nonzero and how many rows its largest 1% and
0.1% of entries fall in: what Top-k can update per step.

Rank 0 writes ``<framework>_<N>ranks.json`` with every run's curves, a plot, and
prints a table of final validation cross-entropy over the seeds.
"""
import argparse
import importlib
import json
import math
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import byte_lm  # noqa: E402
from benchmarks.compressors import SPECS, STANDARD, build, names_argument  # noqa: E402
from benchmarks.convergence import format_table, summarize  # noqa: E402

STUDY = {"optimizer": "adam", "steps": 400, "lr": 3e-3, "warmup_steps": 40, "final_lr_fraction": 0.1,
         "batch_size": 32, "context": 64, "width": 128, "layers": 2, "heads": 4, "eval_every": 50,
         "validation_sequences": 256}
BETAS, EPS = (0.9, 0.999), 1e-8
# --optimizer sgd: PyTorch's SGD with momentum; uncompressed, one process, seed 0, 400 steps:
# 2.386 / 2.338 / 2.314 / 2.676 nats per byte at lr 0.03 / 0.05 / 0.1 / 0.3.
SGD_MOMENTUM, SGD_LR = 0.9, 0.1
# The goal: these end within GOAL_NATS of uncompressed validation cross-entropy.
GOAL_CONFIGS = ("qsgd-8bit", "qsgd-4bit", "topk-1%", "qsgd-8bit-node-aware", "qsgd-4bit-node-aware",
                "topk-1%-node-aware")
GOAL_NATS = 0.02


def learning_rate(step, s):
    """Linear warm-up to ``lr`` over ``warmup_steps``, then a cosine down to ``final_lr_fraction`` of it."""
    if step < s["warmup_steps"]:
        return s["lr"] * (step + 1) / s["warmup_steps"]
    progress = (step - s["warmup_steps"]) / max(1, s["steps"] - s["warmup_steps"])
    floor = s["final_lr_fraction"]
    return s["lr"] * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def _train(hvd, corpus, s, seed, step, validation_sums, sum_over_ranks, after_step=None):
    """The loop both frameworks share: returns the run's record (curves at every evaluation)."""
    rank, size = hvd.rank(), hvd.size()
    if s["batch_size"] % size:
        raise SystemExit(f"the global batch of {s['batch_size']} sequences must divide among {size} ranks")
    validation = corpus.validation_batch(s["validation_sequences"], s["context"])[rank::size]
    record = {"seed": seed, "steps": [], "validation": [], "train_loss": []}
    losses = []
    for t in range(s["steps"]):
        batch = corpus.training_batch(seed, t, s["batch_size"], s["context"])[rank::size]
        losses.append(step(batch, learning_rate(t, s)))
        if after_step is not None:
            after_step(t, record)
        if (t + 1) % s["eval_every"] == 0 or t + 1 == s["steps"]:
            total, count = validation_sums(validation)
            total, count = sum_over_ranks([total, count], f"lm.validation.{t}")
            record["steps"].append(t + 1)
            record["validation"].append(total / count)
            record["train_loss"].append(sum_over_ranks([float(np.mean(losses))], f"lm.loss.{t}")[0] / size)
            losses = []
    return record


def torch_model(seed, s):
    """(the model as a torch.nn.Module, loss_of(batch, reduction="mean")): cross-entropy of next bytes."""
    import torch
    ops = byte_lm.TorchOps()
    model = torch.nn.Module()
    for name, value in byte_lm.initial_weights(seed, s["width"], s["layers"], s["context"]).items():
        model.register_parameter(name, torch.nn.Parameter(torch.from_numpy(value)))
    params = dict(model.named_parameters())

    def loss_of(batch, reduction="mean"):
        tokens = torch.from_numpy(batch.astype(np.int64))
        logits = byte_lm.forward(params, tokens[:, :-1], ops, s["heads"])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, byte_lm.VOCABULARY), tokens[:, 1:].reshape(-1),
                                                 reduction=reduction)
    return model, loss_of


def torch_loop(hvd, opt, local, loss_of):
    """(step, validation_sums, sum_over_ranks) for :func:`_train`: ``opt`` steps (``local``'s learning rate set
    to the schedule's), ``loss_of`` evaluates, a float64 allreduce sums."""
    import torch

    def step(batch, rate):
        for group in local.param_groups:
            group["lr"] = rate
        opt.zero_grad()
        loss = loss_of(batch)
        loss.backward()
        opt.step()
        return loss.item()

    def validation_sums(batch):
        with torch.no_grad():
            return loss_of(batch, "sum").item(), batch[:, 1:].size

    def sum_over_ranks(values, name):
        return hvd.allreduce(torch.tensor(values, dtype=torch.float64), name=name, op=hvd.Sum).tolist()
    return step, validation_sums, sum_over_ranks


def train_torch(hvd, compression, corpus, seed, s, embedding_rows=False):
    """Trains with ``hvd.DistributedOptimizer`` around ``torch.optim.Adam``; returns the run's record."""
    import torch
    model, loss_of = torch_model(seed, s)
    params = dict(model.named_parameters())
    if s["optimizer"] == "adam":
        local = torch.optim.Adam(model.parameters(), lr=s["lr"], betas=BETAS, eps=EPS)
    else:
        local = torch.optim.SGD(model.parameters(), lr=s["lr"], momentum=SGD_MOMENTUM)
    opt = hvd.DistributedOptimizer(local, named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    step, validation_sums, sum_over_ranks = torch_loop(hvd, opt, local, loss_of)

    def count_embedding_rows(t, record):
        if (t + 1) % s["eval_every"] and t + 1 != s["steps"]:
            return
        grad = params["embedding"].grad.abs()  # after step(): the average over ranks
        counts = {"nonzero": int((grad.sum(1) > 0).sum())}
        for label, ratio in (("top1%", 0.01), ("top0.1%", 0.001)):
            k = max(1, int(grad.numel() * ratio))
            counts[label] = int(torch.unique(grad.reshape(-1).topk(k).indices // grad.shape[1]).numel())
        record.setdefault("embedding_rows", []).append(counts)

    return _train(hvd, corpus, s, seed, step, validation_sums, sum_over_ranks,
                  count_embedding_rows if embedding_rows else None)


def train_tf(hvd, compression, corpus, seed, s, embedding_rows=False):
    """``train_torch`` with ``hvd.DistributedGradientTape`` in a tf.function; the optimizers follow torch's rules."""
    import tensorflow as tf
    ops = byte_lm.TensorFlowOps()
    params = {name: tf.Variable(value, name=name)
              for name, value in byte_lm.initial_weights(seed, s["width"], s["layers"], s["context"]).items()}
    variables = list(params.values())
    first = [tf.Variable(tf.zeros_like(v), trainable=False) for v in variables]
    second = [tf.Variable(tf.zeros_like(v), trainable=False) for v in variables]
    count = tf.Variable(0.0, trainable=False)
    hvd.broadcast_variables(variables, root_rank=0)

    def loss_of(tokens, reduce):
        logits = byte_lm.forward(params, tokens[:, :-1], ops, s["heads"])
        per_byte = tf.nn.sparse_softmax_cross_entropy_with_logits(tokens[:, 1:], logits)
        return reduce(per_byte)

    @tf.function
    def train_step(tokens, rate):
        with tf.GradientTape() as tape:
            loss = loss_of(tokens, tf.reduce_mean)
        tape = hvd.DistributedGradientTape(tape, compression=compression, sparse_as_dense=True)
        count.assign_add(1.0)
        correction1 = 1.0 - BETAS[0] ** count
        correction2 = 1.0 - BETAS[1] ** count
        for v, m, u, g in zip(variables, first, second, tape.gradient(loss, variables)):
            if s["optimizer"] == "sgd":
                m.assign(SGD_MOMENTUM * m + g)
                v.assign_sub(rate * m)
                continue
            m.assign(m + (g - m) * (1.0 - BETAS[0]))
            u.assign(u * BETAS[1] + g * g * (1.0 - BETAS[1]))
            v.assign_sub((rate / correction1) * m / (tf.sqrt(u) / tf.sqrt(correction2) + EPS))
        return loss

    @tf.function
    def validation_sum(tokens):
        return loss_of(tokens, tf.reduce_sum)

    def step(batch, rate):
        return float(train_step(tf.constant(batch.astype(np.int64)), tf.constant(rate, tf.float32)))

    def validation_sums(batch):
        return float(validation_sum(tf.constant(batch.astype(np.int64)))), batch[:, 1:].size

    def sum_over_ranks(values, name):
        return hvd.allreduce(tf.constant(values, tf.float64), name=name, op=hvd.Sum).numpy().tolist()

    return _train(hvd, corpus, s, seed, step, validation_sums, sum_over_ranks)


# framework -> (Horovod module, horovod_qsgd adapter module, training function)
FRAMEWORKS = {"pytorch": ("horovod.torch", "horovod_qsgd.torch", train_torch),
              "tensorflow": ("horovod.tensorflow", "horovod_qsgd.tensorflow", train_tf)}


def run_study(args):
    hvd_module, adapter_module, train = FRAMEWORKS[args.framework]
    hvd = importlib.import_module(hvd_module)
    compressors = importlib.import_module(adapter_module)
    from benchmarks.stdlib_text import Corpus
    hvd.init()
    settings = dict(STUDY, steps=args.steps, optimizer=args.optimizer)
    if args.optimizer == "sgd":
        settings["lr"] = SGD_LR
    if args.lr is not None:
        settings["lr"] = args.lr
    corpus = Corpus()
    os.makedirs(args.out, exist_ok=True)
    suffix = "" if args.optimizer == "adam" else f"_{args.optimizer}"
    ranks = f"{hvd.cross_size()}x{hvd.local_size()}nodes" if 1 < hvd.cross_size() < hvd.size() else f"{hvd.size()}ranks"
    path = os.path.join(args.out, f"{args.framework}_{ranks}{suffix}.json")
    results, earlier_seconds = {}, 0.0
    if args.resume and os.path.exists(path):
        with open(path) as f:
            earlier = json.load(f)
        if earlier["settings"] != settings:
            raise SystemExit(f"--resume: {path} was made with other settings ({earlier['settings']}); "
                             "use another --out or the same settings")
        results, earlier_seconds = earlier["results"], earlier["wall_seconds"]
    start = time.perf_counter() - earlier_seconds
    for name in args.compressors:
        for seed in (int(s) for s in args.seeds.split(",")):
            if any(r["seed"] == seed for r in results.get(name, [])):
                continue
            run_start = time.perf_counter()
            compression = build(name, compressors, seed=seed)
            extra = {"embedding_rows": True} if name == "none" and args.framework == "pytorch" else {}
            run = train(hvd, compression, corpus, seed, settings, **extra)
            run["seconds"] = time.perf_counter() - run_start
            results.setdefault(name, []).append(run)
            if hvd.rank() == 0:
                print(f"{name:>15} seed {seed}: validation {run['validation'][-1]:.4f} nats/byte, training "
                      f"{run['train_loss'][-1]:.4f} ({run['seconds']:.1f} s)", flush=True)
                _write(path, args.framework, hvd.size(), settings, corpus, results,
                       time.perf_counter() - start)
    if hvd.rank() == 0:
        with open(path) as f:
            report(json.load(f), path[:-len(".json")] + ".png")


def _write(path, framework, ranks, settings, corpus, results, seconds, **extra):
    record = {"framework": framework, "ranks": ranks, "settings": settings, "betas": BETAS, "eps": EPS,
              "corpus": corpus.describe(), "wall_seconds": seconds, "results": results, **extra}
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


def describe(record):
    s = record["settings"]
    return (f"byte LM on stdlib source, {record['framework']}, {record['ranks']} ranks, {s['steps']} steps, "
            f"{s.get('optimizer', 'adam')} lr {s['lr']}, global batch {s['batch_size']}x{s['context']} bytes")


def plot(record, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    styles = {"qsgd": "-", "topk": "--", "gaussiank": ":", "randomk": "-."}
    for i, (name, runs) in enumerate(record["results"].items()):
        color = "k" if name in ("none", "fp16") else f"C{i}"
        style = "--" if name == "fp16" else styles.get(name.split("-")[0], "-")
        ax.plot(runs[0]["steps"], np.mean([r["validation"] for r in runs], 0), style, color=color, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("validation cross-entropy, nats/byte (mean over seeds)")
    ax.set_ylim(top=min(3.5, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    ax.set_title(describe(record), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(record, png_path=None):
    """Prints the table (and writes the plot) of a study's record, compressors in the order of SPECS."""
    order = list(SPECS)
    record = dict(record, results=dict(sorted(record["results"].items(),
                                              key=lambda item: order.index(item[0]) if item[0] in order else len(order))))
    if png_path:
        plot(record, png_path)
    counts = sorted({len(runs) for runs in record["results"].values()})
    seeds = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    print(f"\n{describe(record)}; {seeds} seeds; study wall time {record['wall_seconds'] / 60:.1f} min\n")
    rows = summarize(record["results"], metric="validation", goal_configs=GOAL_CONFIGS, tolerance=GOAL_NATS,
                     higher_is_better=False)
    print(format_table(rows, label="validation nats/byte", tolerance=GOAL_NATS, digits=4))
    print("\nFinal training loss (mean over ranks and seeds, last evaluation interval): " + ", ".join(
        f"{name} {np.mean([r['train_loss'][-1] for r in runs]):.4f}" for name, runs in record["results"].items()))
    rows = [counts for r in record["results"].get("none", []) for counts in r.get("embedding_rows", [])]
    if rows:
        print(f"Embedding gradient (256 rows, uncompressed runs, {len(rows)} evaluation steps): "
              + ", ".join(f"{key} in {np.mean([c[key] for c in rows]):.1f} rows (min {min(c[key] for c in rows)}, "
                          f"max {max(c[key] for c in rows)})" for key in rows[0]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=sorted(FRAMEWORKS), default="pytorch")
    parser.add_argument("--compressors", type=names_argument, default=",".join(STANDARD),
                        help="comma-separated names of benchmarks/compressors.py")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=STUDY["steps"])
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                        help="sgd: momentum SGD, the optimizer error feedback was designed for")
    parser.add_argument("--lr", type=float, help="peak learning rate (default: the study's for the optimizer)")
    parser.add_argument("--resume", action="store_true", help="keep the runs already in the output file")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "lm-convergence"))
    parser.add_argument("--report", metavar="JSON", help="print the table of a saved study instead of training")
    args = parser.parse_args()
    if args.report:
        with open(args.report) as f:
            report(json.load(f))
        return
    run_study(args)


if __name__ == "__main__":
    main()
