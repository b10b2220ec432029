"""Convergence study: does a model reach the same accuracy with compressed gradients?

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 TF_NUM_INTRAOP_THREADS=1 TF_NUM_INTEROP_THREADS=1 \\
    python -m horovod.runner.launch -np 2 -H localhost:2 --gloo \\
        python benchmarks/convergence.py --framework pytorch      # or tensorflow
    python benchmarks/convergence.py --report benchmarks/results/convergence/convergence_pytorch.json

Data: scikit-learn's handwritten digits (1797 real 8x8 images shipped with
the package, no download), split 1437 train / 360 test with a fixed seed; each
rank trains on its own shard (every other training image). Model: an MLP
64-256-256-10 whose two large weight matrices are compressed (the last layer
and the biases are below ``min_numel`` and go through plain allreduce).

Both frameworks train the same thing: the same initial weights (PyTorch's
``nn.Linear`` init, drawn with numpy from the seed), the same batches in the
same order, SGD with PyTorch's momentum rule, the same learning-rate schedule,
and the same hyperparameters for every compressor (``STUDY``: 30 epochs, lr
0.1 dropping to 0.01 after 20, batch 32 per rank, 5 seeds; 12 epochs left
Top-k 1% short of uncompressed). Only the compressors come
from the framework's adapter (``horovod_qsgd.torch`` or
``horovod_qsgd.tensorflow``). Rank 0 writes per-epoch training loss and test
accuracy of every run to ``convergence_<framework>.json``, plots the curves
(``.png``) and prints a table of final test accuracy over the seeds.
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

from benchmarks.compressors import STANDARD, build, names_argument  # noqa: E402

TRAIN_SIZE = 1437
LAYER_SIZES = (64, 256, 256, 10)
MOMENTUM = 0.9
# The study's schedule (the training functions' own defaults are the short 12-epoch run the tests use).
STUDY = {"epochs": 30, "lr": 0.1, "batch_size": 32, "decay_epochs": (20,), "decay": 0.1}
# The goal from the papers: these configurations end within GOAL_POINTS of uncompressed.
GOAL_CONFIGS, GOAL_POINTS = ("qsgd-8bit", "qsgd-4bit", "topk-1%"), 0.3


def digits_split():
    from sklearn.datasets import load_digits
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    order = np.random.RandomState(1234).permutation(len(x))
    train, test = order[:TRAIN_SIZE], order[TRAIN_SIZE:]
    return x[train], digits.target[train], x[test], digits.target[test]


def initial_weights(seed):
    """[(weight (fan_in, fan_out), bias)] per layer, as PyTorch's nn.Linear draws them: U(+-1/sqrt(fan_in))."""
    rng = np.random.default_rng(seed)
    layers = []
    for fan_in, fan_out in zip(LAYER_SIZES[:-1], LAYER_SIZES[1:]):
        bound = 1.0 / np.sqrt(fan_in)
        layers.append((rng.uniform(-bound, bound, (fan_in, fan_out)).astype(np.float32),
                       rng.uniform(-bound, bound, fan_out).astype(np.float32)))
    return layers


def learning_rate(epoch, lr, decay_epochs=(), decay=0.1):
    """Step decay: ``lr`` times ``decay`` for every milestone in ``decay_epochs`` already reached."""
    return lr * decay ** sum(epoch >= milestone for milestone in decay_epochs)


def _train(hvd, step, test_accuracy, mean_over_ranks, epochs, seed, lr, batch_size, decay_epochs, decay):
    """The loop both frameworks share; returns (per-epoch mean loss over ranks, per-epoch test accuracy %).

    ``step(indices, lr)`` trains on those training images and returns the
    loss; each rank shuffles its own shard every epoch and drops the last
    incomplete batch.
    """
    shard = np.arange(hvd.rank(), TRAIN_SIZE, hvd.size())
    order = np.random.default_rng([seed, hvd.rank()])
    losses, accuracies = [], []
    for epoch in range(epochs):
        rate = learning_rate(epoch, lr, decay_epochs, decay)
        perm = shard[order.permutation(len(shard))]
        batch_losses = [step(perm[i:i + batch_size], rate) for i in range(0, len(perm) - batch_size + 1, batch_size)]
        losses.append(mean_over_ranks(float(np.mean(batch_losses)), f"convergence.loss.{epoch}"))
        accuracies.append(test_accuracy())
    return losses, accuracies


def train_digits_torch(hvd, compression, epochs=12, seed=0, lr=0.1, batch_size=32, decay_epochs=(), decay=0.1):
    """Trains on this rank's shard with ``hvd.DistributedOptimizer``; returns (per-epoch loss, per-epoch accuracy)."""
    import torch
    x_train, y_train, x_test, y_test = (torch.from_numpy(a) for a in digits_split())
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    with torch.no_grad():
        for layer, (weight, bias) in zip(model[::2], initial_weights(seed)):
            layer.weight.copy_(torch.from_numpy(weight.T))
            layer.bias.copy_(torch.from_numpy(bias))
    sgd = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def step(indices, rate):
        for group in sgd.param_groups:  # shared with the distributed optimizer wrapping it
            group["lr"] = rate
        batch = torch.from_numpy(indices)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x_train[batch]), y_train[batch].long())
        loss.backward()
        opt.step()
        return loss.item()

    def test_accuracy():
        with torch.no_grad():
            return (model(x_test).argmax(1) == y_test).float().mean().item() * 100.0

    return _train(hvd, step, test_accuracy, lambda value, name: hvd.allreduce(torch.tensor(value), name=name).item(),
                  epochs, seed, lr, batch_size, decay_epochs, decay)


def train_digits_tf(hvd, compression, epochs=12, seed=0, lr=0.1, batch_size=32, decay_epochs=(), decay=0.1):
    """``train_digits_torch`` with ``hvd.DistributedGradientTape`` in a tf.function, on plain tf.Variables."""
    import tensorflow as tf
    x_train, y_train, x_test, y_test = digits_split()
    layers = [(tf.Variable(weight, name=f"dense{i}/kernel"), tf.Variable(bias, name=f"dense{i}/bias"))
              for i, (weight, bias) in enumerate(initial_weights(seed))]
    variables = [v for layer in layers for v in layer]
    momenta = [tf.Variable(tf.zeros_like(v), trainable=False) for v in variables]
    hvd.broadcast_variables(variables, root_rank=0)

    def logits(x):
        for weight, bias in layers[:-1]:
            x = tf.nn.relu(x @ weight + bias)
        weight, bias = layers[-1]
        return x @ weight + bias

    @tf.function
    def train_step(x, y, rate):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits(x)))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        for v, m, g in zip(variables, momenta, tape.gradient(loss, variables)):
            m.assign(MOMENTUM * m + g)  # torch.optim.SGD's rule: buf = momentum * buf + grad; p -= lr * buf
            v.assign_sub(rate * m)
        return loss

    def step(indices, rate):
        return float(train_step(tf.constant(x_train[indices]), tf.constant(y_train[indices]),
                                tf.constant(rate, tf.float32)))

    def test_accuracy():
        return float(np.mean(np.argmax(logits(tf.constant(x_test)).numpy(), 1) == y_test) * 100.0)

    return _train(hvd, step, test_accuracy, lambda value, name: float(hvd.allreduce(tf.constant(value), name=name)),
                  epochs, seed, lr, batch_size, decay_epochs, decay)


# framework -> (Horovod module, horovod_qsgd adapter module, training function)
FRAMEWORKS = {"pytorch": ("horovod.torch", "horovod_qsgd.torch", train_digits_torch),
              "tensorflow": ("horovod.tensorflow", "horovod_qsgd.tensorflow", train_digits_tf)}


def summarize(results, epoch=None, metric="accuracy", goal_configs=GOAL_CONFIGS, tolerance=GOAL_POINTS,
              higher_is_better=True):
    """Per configuration: ``metric`` over seeds (mean, std error, min, max) and the paired delta vs none.

    At the end of training, or at record ``epoch`` (1-based). ``goal`` says
    whether a configuration of ``goal_configs`` ends within ``tolerance`` of
    uncompressed (only falling behind counts).
    """
    at = -1 if epoch is None else epoch - 1
    finals = {name: {r["seed"]: r[metric][at] for r in runs} for name, runs in results.items()}
    base = finals.get("none")
    rows = []
    for name, by_seed in finals.items():
        final = np.array(list(by_seed.values()))
        row = {"name": name, "mean": float(final.mean()), "se": _std_error(final), "min": float(final.min()),
               "max": float(final.max()),
               "delta": None, "delta_se": None, "goal": None}
        if base is not None and name != "none":
            # over the seeds both have: a configuration with fewer seeds is compared on those alone
            paired = np.array([value - base[seed] for seed, value in by_seed.items() if seed in base])
            row["delta"] = float(paired.mean())
            row["delta_se"] = _std_error(paired)
            if name in goal_configs:
                row["goal"] = row["delta"] >= -tolerance if higher_is_better else row["delta"] <= tolerance
        rows.append(row)
    return rows


def _std_error(values):
    return float(np.std(values, ddof=1) / np.sqrt(len(values))) if len(values) > 1 else float("nan")


def format_table(rows, label="accuracy %", tolerance=GOAL_POINTS, digits=2):
    """A markdown table of :func:`summarize`'s rows."""
    lines = [f"| compressor | {label} | ± s.e. | spread (min–max) | vs none (± s.e. paired) "
             f"| within {tolerance} |", "|---|---|---|---|---|---|"]

    def error(value):  # one seed has no standard error
        return "–" if math.isnan(value) else f"{value:.{digits}f}"

    for r in rows:
        delta = "" if r["delta"] is None else f"{r['delta']:+.{digits}f} ± {error(r['delta_se'])}"
        goal = "" if r["goal"] is None else ("yes" if r["goal"] else "**no**")
        lines.append(f"| {r['name']} | {r['mean']:.{digits}f} | {error(r['se'])} "
                     f"| {r['min']:.{digits}f}–{r['max']:.{digits}f} | {delta} | {goal} |")
    return "\n".join(lines)


def plot(results, title, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(12, 4.8))
    # color per configuration, line style per family; uncompressed and fp16 in black
    styles = {"none": "-", "fp16": "--", "qsgd": "-", "topk": "--", "gaussiank": ":", "randomk": "-."}
    for i, (name, runs) in enumerate(results.items()):
        style = styles.get(name, styles.get(name.split("-")[0], "-"))
        color = "k" if name in ("none", "fp16") else f"C{i}"
        epochs = np.arange(1, len(runs[0]["loss"]) + 1)
        for ax, key in ((loss_ax, "loss"), (acc_ax, "accuracy")):
            ax.plot(epochs, np.mean([r[key] for r in runs], 0), style, color=color, label=name, linewidth=1.4)
    loss_ax.set_yscale("log")
    loss_ax.set_ylabel("training loss (mean over ranks and seeds)")
    acc_ax.set_ylim(90, 100)
    acc_ax.set_ylabel("test accuracy % (mean over seeds)")
    for ax in (loss_ax, acc_ax):
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    acc_ax.legend(fontsize=8, ncol=2, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_study(args):
    hvd_module, adapter_module, train = FRAMEWORKS[args.framework]
    hvd = importlib.import_module(hvd_module)
    compressors = importlib.import_module(adapter_module)
    hvd.init()
    settings = {"epochs": args.epochs, "lr": args.lr, "batch_size": STUDY["batch_size"],
                "decay_epochs": tuple(args.decay_epochs), "decay": STUDY["decay"]}
    results, start = {}, time.perf_counter()
    for name in args.compressors:
        for seed in (int(s) for s in args.seeds.split(",")):
            run_start = time.perf_counter()
            loss, accuracy = train(hvd, build(name, compressors), seed=seed, **settings)
            seconds = time.perf_counter() - run_start
            results.setdefault(name, []).append({"seed": seed, "loss": loss, "accuracy": accuracy,
                                                 "seconds": seconds})
            if hvd.rank() == 0:
                print(f"{name:>15} seed {seed}: final loss {loss[-1]:.4f}, test accuracy {accuracy[-1]:.2f}% "
                      f"({seconds:.1f} s)", flush=True)
    if hvd.rank() != 0:
        return
    record = {"framework": args.framework, "ranks": hvd.size(), "momentum": MOMENTUM, "settings": settings,
              "wall_seconds": time.perf_counter() - start, "results": results}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"convergence_{args.framework}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    report(record, path[:-len(".json")] + ".png")


def describe(record):
    s = record["settings"]
    decay = f", x{s['decay']} at epochs {list(s['decay_epochs'])}" if s["decay_epochs"] else ""
    return (f"digits MLP, {record['framework']}, {record['ranks']} ranks, {s['epochs']} epochs, SGD lr {s['lr']}"
            f"{decay}, momentum {record['momentum']}, batch {s['batch_size']}/rank")


def report(record, png_path=None, epoch=None):
    """Prints the table (and writes the plot) of a study's record; ``epoch``: accuracy after that many epochs."""
    if png_path:
        plot(record["results"], describe(record), png_path)
    seeds = len(next(iter(record["results"].values())))
    when = "" if epoch is None else f"; accuracy after epoch {epoch}"
    print(f"\n{describe(record)}; {seeds} seeds; study wall time {record['wall_seconds'] / 60:.1f} min{when}\n")
    print(format_table(summarize(record["results"], epoch)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=sorted(FRAMEWORKS), default="pytorch")
    parser.add_argument("--compressors", type=names_argument, default=",".join(STANDARD),
                        help="comma-separated names of benchmarks/compressors.py")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--epochs", type=int, default=STUDY["epochs"])
    parser.add_argument("--lr", type=float, default=STUDY["lr"])
    parser.add_argument("--decay-epochs", type=lambda s: [int(e) for e in s.split(",") if e],
                        default=list(STUDY["decay_epochs"]), help="epochs where lr drops 10x ('' for none)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "convergence"))
    parser.add_argument("--report", metavar="JSON", help="print the table of a saved study instead of training")
    parser.add_argument("--epoch", type=int, help="with --report: the accuracy after this epoch, not the last")
    args = parser.parse_args()
    if args.report:
        with open(args.report) as f:
            report(json.load(f), epoch=args.epoch)
        return
    run_study(args)


if __name__ == "__main__":
    main()
