"""The language model under Horovod Elastic: a worker lost at step 200 and one added at step 250.

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python benchmarks/lm_elastic.py        # seeds 0,1,2; ~40 min here

Does a compressed run that loses a worker and gets one back end where the
same run without faults ends? For each seed, two elastic jobs of the byte
language model of ``lm_convergence.py`` (its ``STUDY``, but a global batch of
24 sequences, which 2 and 3 ranks both divide) with ``QSGD(bits=4)``:

* without faults: 3 ranks throughout;
* with faults: the worker on the second host kills itself (SIGKILL) at step
  ``--lose-at`` (and takes its host out of discovery), the two others restore
  the last commit and go on; at step ``--rejoin-at`` rank 0 puts the host
  back, and a new worker joins at the next commit.

Every job runs ``horovodrun --gloo --min-np 2 --max-np 3`` with a discovery
script reading a hosts file: two slots on ``localhost`` and one on this
machine's other address (Horovod starts both without ssh). The model,
optimizer and compressor are in one ``hvd.elastic.TorchState``, committed at
every step. The global batch is dealt to the ranks of the moment, so the
faults change only the compression error (2 ranks' instead of 3) and the
steps taken again after the loss. Writes
``results/lm-convergence/pytorch_elastic_3ranks.json`` and prints the final
validation nats per seed and their paired difference.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.lm_convergence import GOAL_NATS, STUDY, learning_rate, torch_model  # noqa: E402

SETTINGS = dict(STUDY, batch_size=24)
OUT = os.path.join(ROOT, "benchmarks", "results", "lm-convergence", "pytorch_elastic_3ranks.json")


def second_host():
    from horovod.runner.util import network
    others = sorted(a for a in network.get_local_host_addresses() if not a.startswith("127."))
    if not others:
        raise SystemExit("this machine has no address besides the loopback: no second host for the elastic job")
    return others[0]


def write_hosts(path, with_second):
    text = "localhost:2\n" + (f"{second_host()}:1\n" if with_second else "")
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def worker(args):
    import horovod.torch as hvd
    import torch

    from benchmarks.stdlib_text import Corpus
    from horovod_qsgd.torch import QSGD
    hvd.init()
    s, seed = dict(SETTINGS, steps=args.steps), args.seed
    corpus = Corpus()
    model, loss_of = torch_model(seed, s)
    local = torch.optim.Adam(model.parameters(), lr=s["lr"], betas=(0.9, 0.999), eps=1e-8)
    compression = QSGD(bits=4, seed=seed) if args.compressions == "qsgd-4bit" else hvd.Compression.none
    opt = hvd.DistributedOptimizer(local, named_parameters=model.named_parameters(), compression=compression)
    ours = {"compression": compression} if args.compressions == "qsgd-4bit" else {}
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0, steps=[], validation=[], worlds=[], **ours)
    hosts, lost_marker = os.path.join(args.dir, "hosts"), os.path.join(args.dir, "lost")

    @hvd.elastic.run
    def train(state):
        while state.step < s["steps"]:
            t, rank, size = state.step, hvd.rank(), hvd.size()
            if not state.worlds or state.worlds[-1][1] != size:
                state.worlds.append([t, size])
            if args.faults and t == args.lose_at and os.environ["HOROVOD_HOSTNAME"] != "localhost" \
                    and not os.path.exists(lost_marker):
                write_hosts(hosts, with_second=False)
                open(lost_marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            if args.faults and t == args.rejoin_at and rank == 0 and size == 2:
                write_hosts(hosts, with_second=True)
            # opt's own groups: restoring the elastic state loads a state dict into opt, which gives it new
            # group dicts, no longer the ones of the optimizer it wraps
            for group in opt.param_groups:
                group["lr"] = learning_rate(t, s)
            opt.zero_grad()
            loss_of(corpus.training_batch(seed, t, s["batch_size"], s["context"])[rank::size]).backward()
            opt.step()
            state.step += 1
            if state.step % s["eval_every"] == 0 or state.step == s["steps"]:  # as lm_convergence evaluates
                batch = corpus.validation_batch(s["validation_sequences"], s["context"])[rank::size]
                with torch.no_grad():
                    sums = torch.tensor([loss_of(batch, "sum").item(), batch[:, 1:].size], dtype=torch.float64)
                total, count = hvd.allreduce(sums, name=f"lm.validation.{t}", op=hvd.Sum).tolist()
                state.steps.append(state.step)
                state.validation.append(total / count)
            state.commit()

    start = time.perf_counter()
    train(state)
    if hvd.rank() == 0:
        with open(os.path.join(args.dir, "run.json"), "w") as f:
            json.dump({"seed": seed, "faults": args.faults, "steps": state.steps, "validation": state.validation,
                       "worlds": state.worlds, "seconds": time.perf_counter() - start}, f)


def run_job(compression, seed, faults, args):
    """One elastic job; returns rank 0's record of it."""
    with tempfile.TemporaryDirectory(prefix="lm-elastic-") as tmp:
        hosts = os.path.join(tmp, "hosts")
        write_hosts(hosts, with_second=True)
        discover = os.path.join(tmp, "discover.sh")
        with open(discover, "w") as f:
            f.write(f"#!/bin/sh\ncat {hosts}\n")
        os.chmod(discover, 0o755)
        cmd = [sys.executable, "-m", "horovod.runner.launch", "--gloo", "-np", "3", "--min-np", "2", "--max-np", "3",
               "--host-discovery-script", discover, "--blacklist-cooldown-range", "1", "2",
               sys.executable, os.path.abspath(__file__), "--worker", "--dir", tmp, "--seed", str(seed),
               "--lose-at", str(args.lose_at), "--rejoin-at", str(args.rejoin_at), "--steps", str(args.steps),
               "--compressions", compression] + (["--faults"] if faults else [])
        env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{compression} seed {seed} faults={faults}: the job failed\n"
                             f"{(proc.stdout + proc.stderr)[-4000:]}")
        with open(os.path.join(tmp, "run.json")) as f:
            return dict(json.load(f), compression=compression)


def report(record):
    print(f"byte LM, 3 ranks under Horovod Elastic, global batch {record['settings']['batch_size']}, "
          f"{record['settings']['steps']} steps; a worker lost at step {record['lose_at']}, its host back at step "
          f"{record['rejoin_at']} (a new worker joins at the next commit after it starts)\n")
    print("| compression | seed | without faults | with faults | difference | ranks over the steps (with faults) |")
    print("|---|---|---|---|---|---|")
    runs = {(r["compression"], r["seed"], r["faults"]): r for r in record["runs"]}
    summary = []
    for compression in dict.fromkeys(r["compression"] for r in record["runs"]):
        diffs = []
        for seed in sorted({seed for c, seed, _ in runs if c == compression}):
            clean, faulty = runs[(compression, seed, False)], runs[(compression, seed, True)]
            diffs.append(faulty["validation"][-1] - clean["validation"][-1])
            worlds = ", ".join(f"{size} from step {step}" for step, size in faulty["worlds"])
            print(f"| {compression} | {seed} | {clean['validation'][-1]:.4f} | {faulty['validation'][-1]:.4f} | "
                  f"{diffs[-1]:+.4f} | {worlds} |")
        se = np.std(diffs, ddof=1) / np.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
        worst = max(abs(d) for d in diffs)
        summary.append(f"{compression}: with faults - without {np.mean(diffs):+.4f} +- {se:.4f} nats (mean +- "
                       f"standard error), largest |difference| {worst:.4f} "
                       f"({'within' if worst <= GOAL_NATS else 'NOT within'} {GOAL_NATS} on every seed)")
    print("\n" + "\n".join(summary))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--compressions", default="qsgd-4bit,none",
                        help="qsgd-4bit (QSGD(bits=4) in the elastic state) and/or none (Horovod's own allreduce: "
                             "how far the faults alone move the result)")
    parser.add_argument("--steps", type=int, default=SETTINGS["steps"])
    parser.add_argument("--lose-at", type=int, default=200)
    parser.add_argument("--rejoin-at", type=int, default=250)
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--report", action="store_true", help="print the table of --out instead of training")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--faults", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if not args.report:
        from benchmarks.stdlib_text import Corpus
        record = {"settings": dict(SETTINGS, steps=args.steps), "lose_at": args.lose_at,
                  "rejoin_at": args.rejoin_at, "corpus": Corpus().describe(), "runs": [],
                  "command": "OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python benchmarks/lm_elastic.py"}
        for compression in args.compressions.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                for faults in (False, True):
                    run = run_job(compression, seed, faults, args)
                    print(f"{compression} seed {seed} faults={faults}: {run['validation'][-1]:.4f} nats/byte, "
                          f"worlds {run['worlds']}, {run['seconds']:.0f} s", flush=True)
                    record["runs"].append(run)
                    with open(args.out, "w") as f:
                        json.dump(record, f, indent=1)
    with open(args.out) as f:
        report(json.load(f))


if __name__ == "__main__":
    main()
