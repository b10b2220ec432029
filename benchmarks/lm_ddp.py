"""The language-model study under PyTorch DDP: our hooks beside PowerSGD and DDP's allreduce.

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 torchrun --nproc_per_node 2 benchmarks/lm_ddp.py
    python benchmarks/lm_convergence.py --report benchmarks/results/lm-convergence/ddp_2ranks.json
    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python benchmarks/nodelab.py --nodes 2 --per-node 2 \
        --launcher torchrun -- python benchmarks/lm_ddp.py

The study of ``benchmarks/lm_convergence.py`` (same data, model, initial
weights, global batch, Adam schedule and seeds; ``STUDY`` there), trained by
``torch.nn.parallel.DistributedDataParallel`` on Gloo with a communication
hook instead of ``hvd.DistributedOptimizer``:

- ``none``: DDP's own allreduce;
- ``qsgd-4bit`` / ``qsgd-8bit``: ``horovod_qsgd.ddp.QSGDState(bits=...)`` with
  ``qsgd_hook`` (the whole bucket is one tensor, so the position embedding,
  biases and norms are quantized too: DDP fuses them into the bucket);
  ``-nodes`` (``qsgd-4bit-nodes``): with ``exchange="node_aware"``, on
  ``benchmarks/nodelab.py``'s nodes;
- ``powersgd-4`` / ``powersgd-16``: ``powerSGD_hook`` at
  ``matrix_approximation_rank`` 4 (the issue's anchor) and 16 (its docstring
  raises the rank for NLP tasks), with its documented warm-up,
  ``start_powerSGD_iter`` = 10% of the steps and no less than the
  learning-rate warm-up (40 of 400), error feedback and warm start on (its
  defaults); vectors (biases, norms) go uncompressed.

``bucket_cap_mb=25`` is given explicitly, so DDP's small first bucket does not
apply: the 0.48M parameters (1.9 MB) are one bucket for every hook.

Bytes per step are each rank's payload in one late step: DDP's allreduce
sends the bucket (4 bytes per parameter); PowerSGD the elements it allreduces
(its ``compression_stats()``, P and Q plus the uncompressed vectors, 4 bytes
each); ours ``compression_stats()['bytes_sent']``. At 2 ranks a ring
allreduce and an allgather each put about one payload per rank on the wire.

Rank 0 writes ``ddp_<N>ranks.json`` (on nodelab's nodes ``ddp_<M>x<L>nodes.json``; the record format of
``lm_convergence.py`` plus ``bytes_per_step``), a plot, and prints the table.
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
from benchmarks.lm_convergence import BETAS, EPS, STUDY, _train, _write, report  # noqa: E402

CONFIGS = ["none", "qsgd-8bit", "qsgd-4bit", "powersgd-4", "powersgd-16"]
NODE_CONFIGS = ["none", "qsgd-8bit-nodes", "qsgd-4bit-nodes"]  # the default on nodelab's nodes


def hook_and_state(name, seed, steps):
    """(hook, state) for ``register_comm_hook``; (None, None) for DDP's allreduce."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from horovod_qsgd.ddp import QSGDState, qsgd_hook
    if name.startswith("qsgd-"):
        bits, _, nodes = name[len("qsgd-"):].partition("bit")
        if nodes not in ("", "-nodes"):
            raise SystemExit(f"unknown configuration {name!r}; choose from {', '.join(CONFIGS + NODE_CONFIGS[1:])}")
        return qsgd_hook, QSGDState(bits=int(bits), seed=seed, exchange="node_aware" if nodes else "auto")
    if name.startswith("powersgd-"):
        start = max(STUDY["warmup_steps"], steps // 10)
        return powerSGD_hook.powerSGD_hook, powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=int(name.split("-")[1]), start_powerSGD_iter=start,
            random_seed=seed)
    if name == "none":
        return None, None
    raise SystemExit(f"unknown configuration {name!r}; choose from {', '.join(CONFIGS + NODE_CONFIGS[1:])}")


class _Ranks:
    """The two questions ``lm_convergence._train`` asks of Horovod, answered by torch.distributed."""

    def __init__(self, dist):
        self.rank, self.size = dist.get_rank, dist.get_world_size


def _payload_bytes(name, state, model):
    """This rank's payload bytes of the step just taken (see the module docstring)."""
    if name == "none":
        return 4 * sum(p.numel() for p in model.parameters())
    if name.startswith("powersgd-"):
        return 4 * state.total_numel_after_compression  # reset by the caller before the step
    return state.compression_stats()["bytes_sent"]


def byte_lm_module(seed, s):
    """The byte LM as a torch.nn.Module whose parameters are the study's initial weights for ``seed``."""
    import torch

    class ByteLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for key, value in byte_lm.initial_weights(seed, s["width"], s["layers"], s["context"]).items():
                self.register_parameter(key, torch.nn.Parameter(torch.from_numpy(value)))

        def forward(self, tokens):
            return byte_lm.forward(dict(self.named_parameters()), tokens, byte_lm.TorchOps(), s["heads"])

    return ByteLM()


def train_ddp(dist, name, corpus, seed, s, bucket_cap_mb=25):
    """One run: DDP around the byte LM with hook ``name``; returns the record and this rank's bytes per step."""
    import torch
    model = torch.nn.parallel.DistributedDataParallel(byte_lm_module(seed, s), bucket_cap_mb=bucket_cap_mb)
    hook, state = hook_and_state(name, seed, s["steps"])
    if hook is not None:
        model.register_comm_hook(state, hook)

    def before_last_step():
        if name.startswith("powersgd-"):
            state.total_numel_after_compression = 0
        elif hook is not None:
            state.compression_stats(reset=True)

    # evaluation through the plain module: it must not touch DDP's reducer
    return train_module(dist, model, model.module, corpus, seed, s, before_last_step,
                        lambda: _payload_bytes(name, state, model))


def train_module(dist, model, evaluated, corpus, seed, s, before_last_step, bytes_of_last_step):
    """The study's Adam loop around a distributed ``model`` (validation through ``evaluated``), on every rank;
    ``before_last_step()`` resets the counters that ``bytes_of_last_step()`` reads after it. Returns the
    record and this rank's bytes per step."""
    import torch
    optimizer = torch.optim.Adam(model.parameters(), lr=s["lr"], betas=BETAS, eps=EPS)
    measured = {}

    def loss_of(module, batch, reduction="mean"):
        tokens = torch.from_numpy(batch.astype(np.int64))
        logits = module(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, byte_lm.VOCABULARY), tokens[:, 1:].reshape(-1),
                                                 reduction=reduction)

    def step(batch, rate):
        for group in optimizer.param_groups:
            group["lr"] = rate
        last = measured.setdefault("steps", 0) == s["steps"] - 1
        if last:
            before_last_step()
        optimizer.zero_grad()
        loss = loss_of(model, batch)
        loss.backward()
        optimizer.step()
        measured["steps"] += 1
        if last:
            measured["bytes"] = bytes_of_last_step()
        return loss.item()

    def validation_sums(batch):
        with torch.no_grad():
            return loss_of(evaluated, batch, "sum").item(), batch[:, 1:].size

    def sum_over_ranks(values, _name):
        total = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(total)
        return total.tolist()

    record = _train(_Ranks(dist), corpus, s, seed, step, validation_sums, sum_over_ranks)
    return record, measured["bytes"]


def run_study(dist, path, framework, settings, corpus, configs, seeds, resume, train):
    """Trains every configuration and seed not yet in ``path`` (``resume``) with ``train(name, seed)`` (on every
    rank: the record and this rank's bytes per step); rank 0 writes the record after each run, then its plot
    and table."""
    results, payload, earlier_seconds = {}, {}, 0.0
    if resume and os.path.exists(path):
        with open(path) as f:
            earlier = json.load(f)
        if earlier["settings"] != settings:
            raise SystemExit(f"--resume: {path} was made with other settings; use another --out")
        results, payload, earlier_seconds = earlier["results"], earlier["bytes_per_step"], earlier["wall_seconds"]
    start = time.perf_counter() - earlier_seconds
    for name in configs:
        for seed in (int(x) for x in seeds.split(",")):
            if any(r["seed"] == seed for r in results.get(name, [])):
                continue
            run_start = time.perf_counter()
            run, sent = train(name, seed)
            run["seconds"] = time.perf_counter() - run_start
            results.setdefault(name, []).append(run)
            payload[name] = sent
            if dist.get_rank() == 0:
                print(f"{name:>12} seed {seed}: validation {run['validation'][-1]:.4f} nats/byte, "
                      f"{sent / 1e3:.1f} kB per rank per step ({run['seconds']:.1f} s)", flush=True)
                _write(path, framework, dist.get_world_size(), settings, corpus, results,
                       time.perf_counter() - start, bytes_per_step=payload)
    if dist.get_rank() == 0:
        with open(path) as f:
            record = json.load(f)
        report(record, path[:-len(".json")] + ".png")
        base = record["bytes_per_step"].get("none")
        print("\nPayload per rank per step: " + ", ".join(
            f"{name} {sent / 1e3:.1f} kB" + (f" ({base / sent:.1f}x fewer)" if base and name != "none" else "")
            for name, sent in record["bytes_per_step"].items()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=None, help=f"default: {','.join(CONFIGS)}; on nodelab's nodes "
                        f"{','.join(NODE_CONFIGS)}")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=STUDY["steps"])
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0,
                        help="DDP's bucket_cap_mb (tiny: one bucket per parameter)")
    parser.add_argument("--resume", action="store_true", help="keep the runs already in the output file")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "lm-convergence"))
    args = parser.parse_args()
    from benchmarks import nodelab
    args.configs = args.configs or ",".join(NODE_CONFIGS if nodelab.on_a_node() else CONFIGS)
    for name in args.configs.split(","):
        hook_and_state(name, 0, args.steps)  # unknown names fail before any rank trains

    import torch.distributed as dist
    from benchmarks.stdlib_text import Corpus
    dist.init_process_group("gloo")
    settings = dict(STUDY, steps=args.steps, optimizer="adam", trainer="ddp", bucket_cap_mb=args.bucket_cap_mb)
    corpus = Corpus()
    os.makedirs(args.out, exist_ok=True)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    path = os.path.join(args.out, f"ddp_{dist.get_world_size() // per_node}x{per_node}nodes.json"
                        if nodelab.on_a_node() else f"ddp_{dist.get_world_size()}ranks.json")
    run_study(dist, path, "pytorch-ddp", settings, corpus, args.configs.split(","), args.seeds, args.resume,
              lambda name, seed: train_ddp(dist, name, corpus, seed, settings, args.bucket_cap_mb))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
