"""Collectives per training step, fused and unfused, counted twice: by the compressor and by Horovod's timeline.

    python benchmarks/collectives.py --ranks 4,8 --out benchmarks/results/fusion
    python benchmarks/collectives.py --ranks 4,8 --framework tensorflow --out benchmarks/results/fusion

For each model (the 25M-parameter MLP of the synthetic benchmark, the byte-level
language model of ``benchmarks/lm_convergence.py``), compressor (QSGD 4-bit,
Top-k 1%, default ``exchange="auto"``) and fusion setting (the default, and
``fusion_threshold=0``: every two-stage tensor its own alltoall and allgather),
one ``horovodrun`` job on N ranks trains 4 steps of PyTorch's
``hvd.DistributedOptimizer`` (or, with ``--framework tensorflow``, of
TensorFlow's ``hvd.DistributedGradientTape(..., groups=1)`` in a
``tf.function``: TensorFlow fuses a grouped call's tensors) with
``HOROVOD_TIMELINE`` set. Which collectives a
step starts depends only on the parameters' names and shapes, so the gradient is
that of a linear loss on random coefficients, not of the model's forward pass.

Counted per step on rank 0: ``compression_stats()["collectives_started"]``,
and, independently, the allgather and alltoall operations on horovod_qsgd's
tensor names in Horovod's timeline (one row per submitted name and step).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STEPS = 4
MODELS = ("mlp25m", "lm")
COMPRESSORS = ("qsgd-4bit", "topk-1%")


def parameter_shapes(model):
    """Name -> shape of every parameter of ``model``, in the model's order."""
    if model == "lm":
        from benchmarks import byte_lm
        from benchmarks.lm_convergence import STUDY
        return byte_lm.parameter_shapes(STUDY["width"], STUDY["layers"], STUDY["context"])
    from benchmarks.models_torch import build_model
    return {name: tuple(p.shape) for name, p in build_model(model).named_parameters()}


def worker(args):
    import horovod.torch as hvd
    import torch

    import horovod_qsgd.torch as adapter
    from benchmarks.compressors import build
    hvd.init()
    compressor = build(args.compressor, adapter, **({} if args.fused else {"fusion_threshold": 0}))
    named = [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in parameter_shapes(args.model).items()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.01), named_parameters=named,
                                   compression=compressor)
    generator = torch.Generator().manual_seed(hvd.rank())
    per_step = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = sum((p * torch.randn(p.shape, generator=generator)).sum() for _, p in named)
        loss.backward()
        opt.step()
        per_step.append(compressor.compression_stats(reset=True))
    _write_worker_result(args, hvd.rank(), per_step)
    hvd.shutdown()


def _write_worker_result(args, rank, per_step):
    """Rank 0's counts of each step, for the launching process."""
    if rank == 0:
        with open(args.worker_out, "w") as f:
            json.dump({"collectives_started": [s["collectives_started"] for s in per_step],
                       "exchanges": per_step[-1]["exchanges"],
                       "tensors_compressed": per_step[-1]["tensors_compressed"]}, f)


def grouped_tape_step(hvd, compressor, variables):
    """A ``tf.function`` of one coefficient tensor per variable: the averaged gradients of the linear loss
    sum(v * c) through ``DistributedGradientTape(groups=1)``, a grouped call whose two-stage tensors fuse
    (also what tests/tensorflow/test_two_stage.py trains)."""
    import tensorflow as tf

    @tf.function
    def step(coefficients):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * c) for v, c in zip(variables, coefficients)])
        tape = hvd.DistributedGradientTape(tape, compression=compressor, groups=1)
        return tape.gradient(loss, variables)

    return step


def tensorflow_worker(args):
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    import horovod_qsgd.tensorflow as adapter
    from benchmarks.compressors import build
    hvd.init()
    compressor = build(args.compressor, adapter, **({} if args.fused else {"fusion_threshold": 0}))
    shapes = parameter_shapes(args.model)
    variables = [tf.Variable(tf.zeros(shape), name=name) for name, shape in shapes.items()]
    step = grouped_tape_step(hvd, compressor, variables)
    rng = np.random.default_rng(hvd.rank())
    per_step = []
    for _ in range(STEPS):
        step([tf.constant(rng.standard_normal(shape, dtype=np.float32)) for shape in shapes.values()])
        per_step.append(compressor.compression_stats(reset=True))
    _write_worker_result(args, hvd.rank(), per_step)
    hvd.shutdown()


def timeline_counts(path):
    """{operation: number} of the ALLGATHER / ALLTOALL operations on horovod_qsgd's names in a timeline."""
    from horovod_qsgd.common.naming import PAYLOAD_PREFIX, SECOND_STAGE_PREFIX
    with open(path) as f:
        text = f.read().strip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    # A row per submitted name: PyTorch's "<operation>.<name>", e.g. "alltoall.horovod_qsgd.payload.0.group2";
    # TensorFlow's the op's name alone, e.g. "horovod_qsgd.payload.tf_compressor0.0.group3.15a20ffc"
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            name = e["args"].get("name", "")
            names[e["pid"]] = name.partition(".")[2] if name.startswith(("allgather.", "alltoall.")) else name
    counts = {}
    for e in events:
        name = names.get(e.get("pid"), "")
        if e.get("ph") == "B" and e.get("name") in ("ALLGATHER", "ALLTOALL") and \
                name.startswith((PAYLOAD_PREFIX, SECOND_STAGE_PREFIX)):
            counts[e["name"]] = counts.get(e["name"], 0) + 1
    return counts


def run_job(ranks, model, compressor, fused, timeout, framework="torch"):
    with tempfile.TemporaryDirectory(prefix="hq-collectives-") as tmp:
        out, timeline = os.path.join(tmp, "result.json"), os.path.join(tmp, "timeline.json")
        env = dict(os.environ, HOROVOD_TIMELINE=timeline, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
                   TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in [ROOT, os.environ.get("PYTHONPATH")] if p))
        cmd = [sys.executable, "-m", "horovod.runner.launch", "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo",
               sys.executable, os.path.abspath(__file__), "--worker", "--model", model, "--compressor", compressor,
               "--worker-out", out, "--framework", framework] + ([] if fused else ["--unfused"])
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        with open(out) as f:
            result = json.load(f)
        result["timeline"] = timeline_counts(timeline)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="4,8")
    parser.add_argument("--out", default=None, help="directory for collectives.json (printed either way)")
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--framework", choices=("torch", "tensorflow"), default="torch")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--compressor", help=argparse.SUPPRESS)
    parser.add_argument("--unfused", dest="fused", action="store_false", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        (worker if args.framework == "torch" else tensorflow_worker)(args)
        return
    rows = []
    header = (f"{'model':<7} {'ranks':>5} {'compressor':<10} {'fusion':<8} {'compressed':>10} {'two-stage':>9} "
              f"{'per step (stats)':>17} {'per step (timeline)':>20}")
    print(header + "\n" + "-" * len(header), flush=True)
    for model in MODELS:
        for ranks in [int(n) for n in args.ranks.split(",")]:
            for compressor in COMPRESSORS:
                for fused in (False, True):
                    r = run_job(ranks, model, compressor, fused, args.timeout, args.framework)
                    timeline = sum(r["timeline"].values()) / STEPS
                    two_stage = sum(1 for e in r["exchanges"].values() if e == "two_stage")
                    row = dict(framework=args.framework, model=model, ranks=ranks, compressor=compressor,
                               fused=fused, steps=STEPS,
                               tensors_compressed=r["tensors_compressed"], tensors_two_stage=two_stage,
                               collectives_per_step=r["collectives_started"], timeline_per_step=timeline,
                               timeline_operations=r["timeline"])
                    rows.append(row)
                    print(f"{model:<7} {ranks:>5} {compressor:<10} {'fused' if fused else 'unfused':<8} "
                          f"{row['tensors_compressed']:>10} {two_stage:>9} "
                          f"{'/'.join(map(str, r['collectives_started'])):>17} {timeline:>20.1f}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = "collectives.json" if args.framework == "torch" else f"collectives-{args.framework}.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
