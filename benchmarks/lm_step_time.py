"""Step times of the language model at 1 Gbit/s: fused and unfused two stages against uncompressed.

    python benchmarks/lm_step_time.py --ranks 4,8 --repeats 3 --out benchmarks/results/fusion

The byte-level language model of ``benchmarks/lm_convergence.py`` (0.48M
parameters, Adam, a global batch of 32 sequences of 64 bytes dealt to the
ranks) trains under ``horovodrun`` in a network namespace whose loopback is
shaped to ``--rate``, one job per compressor: uncompressed, QSGD 4-bit and
Top-k 1% with the default ``exchange="auto"`` (two stages from 3 ranks for
the tensors of 65,536 elements or more, the allgather for the others), fused
(the default) and unfused (``fusion_threshold=0``). A job times 20 steps
after 3 of warm-up (random bytes: the time does not depend on the text) and
reports the median step and the collectives a step started. The jobs run in
turn, ``--repeats`` times, and only ratios of the same round are read (the
VM's speed drifts between hours). Ranks beyond the 2 cores oversubscribe
them: the times are this machine's, the ratios the point.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIGS = ("none", "qsgd-4bit", "qsgd-4bit-unfused", "topk-1%", "topk-1%-unfused")
WARMUP, TIMED = 3, 20


def worker(args):
    import horovod.torch as hvd
    import torch

    import horovod_qsgd.torch as adapter
    from benchmarks.compressors import build
    from benchmarks.lm_convergence import BETAS, EPS, STUDY, torch_model
    hvd.init()
    torch.manual_seed(0)
    compressor = build(args.config, adapter)
    model, loss_of = torch_model(0, STUDY)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=STUDY["lr"], betas=BETAS, eps=EPS),
                                   named_parameters=model.named_parameters(), compression=compressor)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    per_rank = STUDY["batch_size"] // hvd.size()
    seconds, collectives = [], []
    for step in range(WARMUP + TIMED):
        batch = np.random.default_rng([step, hvd.rank()]).integers(0, 256, (per_rank, STUDY["context"] + 1))
        start = time.perf_counter()
        opt.zero_grad()
        loss_of(batch).backward()
        opt.step()
        seconds.append(time.perf_counter() - start)
        if hasattr(compressor, "compression_stats"):
            collectives.append(compressor.compression_stats(reset=True)["collectives_started"])
    if hvd.rank() == 0:
        with open(args.worker_out, "w") as f:
            json.dump({"step_seconds": statistics.median(seconds[WARMUP:]),
                       "collectives_per_step": collectives[-1] if collectives else 0}, f)
    hvd.shutdown()


def run_job(ranks, config, rate, timeout):
    from benchmarks import netlab
    from benchmarks.compare import ONE_THREAD_ENV
    with tempfile.TemporaryDirectory(prefix="hq-lm-step-") as tmp:
        out = os.path.join(tmp, "result.json")
        job = [*netlab.HOROVODRUN, "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo", sys.executable,
               os.path.abspath(__file__), "--worker", "--config", config, "--worker-out", out]
        env = dict(ONE_THREAD_ENV, NUMBA_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in [ROOT, os.environ.get("PYTHONPATH")] if p))
        netlab.run_horovod_job(job, rate, shaped=True, env=env, timeout=timeout, what=f"{config} at {ranks} ranks")
        with open(out) as f:
            return json.load(f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="4,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--out", default=None, help="directory for lm_step_time.json (printed either way)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--config", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from benchmarks import netlab
    reason = netlab.unavailable_reason()
    if reason:
        parser.error(f"needs network namespaces: {reason}")
    record = {"command": "python benchmarks/lm_step_time.py " + " ".join(sys.argv[1:]), "rate": args.rate,
              "rounds": []}
    for ranks in [int(n) for n in args.ranks.split(",")]:
        for repeat in range(args.repeats):
            row = {"ranks": ranks, "repeat": repeat}
            for config in CONFIGS:
                row[config] = run_job(ranks, config, args.rate, args.timeout)
            record["rounds"].append(row)
            print(f"{ranks} ranks, round {repeat}: " + ", ".join(
                f"{c} {row[c]['step_seconds'] * 1000:.0f} ms ({row[c]['collectives_per_step']})" for c in CONFIGS),
                flush=True)
    lines = [f"{'ranks':>5} {'compressor':<10} {'fused/none':>10} {'unfused/none':>12} {'unfused/fused':>13} "
             f"{'collectives fused/unfused':>25}"]
    for ranks in sorted({r["ranks"] for r in record["rounds"]}):
        rounds = [r for r in record["rounds"] if r["ranks"] == ranks]
        for compressor in ("qsgd-4bit", "topk-1%"):
            def median(a, b):
                return statistics.median(r[a]["step_seconds"] / r[b]["step_seconds"] for r in rounds)
            lines.append(f"{ranks:>5} {compressor:<10} {median(compressor, 'none'):>10.2f} "
                         f"{median(compressor + '-unfused', 'none'):>12.2f} "
                         f"{median(compressor + '-unfused', compressor):>13.2f} "
                         f"{rounds[0][compressor]['collectives_per_step']:>12}/"
                         f"{rounds[0][compressor + '-unfused']['collectives_per_step']}")
    table = "\n".join(lines)
    print("\nmedian over rounds of step-time ratios within a round (below 1: faster than the denominator)\n" + table)
    record["table"] = table
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "lm_step_time.json"), "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
