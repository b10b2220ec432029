"""SwarmSGD next to synchronous SGD: accuracy on the digits task, and bytes on a shaped network.

Accuracy (run under horovodrun; rank 0 prints the table)::

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/swarm_convergence.py --seeds 0,1,2

The task, model, shards and hyperparameters are those of
``benchmarks/convergence.py`` (scikit-learn digits, MLP 64-256-256-10, SGD
lr 0.1 momentum 0.9, batch 32 per rank, 12 epochs). Synchronous SGD is
``hvd.DistributedOptimizer`` without compression; SwarmSGD wraps the same
local optimizer with :func:`horovod_qsgd.torch.swarm.SwarmOptimizer`, and
its accuracy is measured after ``average_models()``.

Wire (run it plainly, as root: it starts horovodrun itself inside a private
network namespace whose loopback is shaped with tc, see ``netlab.py``)::

    python benchmarks/swarm_convergence.py --wire --rate 1gbit --model mlp10m

prints, per configuration, the bytes the namespace's loopback carried per
training step (both ranks' traffic, counted by its /proc/net/dev), the step
time and the throughput, for allreduce SGD, QSGD-4 gradient compression and
SwarmSGD with exact and lattice-quantized model exchange.
"""
import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.convergence import digits_split, train_digits_torch  # noqa: E402

# name -> SwarmOptimizer arguments (None: synchronous SGD with hvd.DistributedOptimizer)
CONFIGS = {
    "sync-sgd": None,
    "swarm-H4-fp32": {"local_steps": 4, "quantization": None},
    "swarm-H4-lattice8": {"local_steps": 4, "quantization": "lattice8"},
    "swarm-H4-lattice8-nonblocking": {"local_steps": 4, "quantization": "lattice8", "averaging": "nonblocking"},
    "swarm-H1-lattice8": {"local_steps": 1, "quantization": "lattice8"},
}


class _SwarmHorovod:
    """``horovod.torch`` as ``train_digits_torch`` sees it, with SwarmOptimizer in place of DistributedOptimizer.

    So SwarmSGD trains on exactly the task, model, data order and
    hyperparameters of ``benchmarks/convergence.py``.
    """

    def __init__(self, hvd, swarm):
        self._hvd, self._swarm, self.optimizer, self.named_parameters = hvd, swarm, None, None

    def __getattr__(self, name):
        return getattr(self._hvd, name)

    def DistributedOptimizer(self, optimizer, named_parameters=None, compression=None):  # noqa: N802 (Horovod's name)
        from horovod_qsgd.torch.swarm import SwarmOptimizer
        self.named_parameters = list(named_parameters)
        self.optimizer = SwarmOptimizer(optimizer, self.named_parameters, **self._swarm)
        return self.optimizer


def train_digits_swarm(hvd, swarm=None, epochs=12, seed=0, lr=0.1, batch_size=32):
    """``train_digits_torch`` of ``benchmarks/convergence.py`` with SwarmSGD (``swarm``: SwarmOptimizer arguments).

    ``swarm=None`` trains with synchronous SGD (hvd.DistributedOptimizer, no
    compression). Returns a dict: per-epoch mean training loss over ranks,
    per-epoch test accuracy (%) of this rank's own model, the final test
    accuracy (after ``average_models()`` for SwarmSGD), the optimizer's
    ``compression_stats()``, the number of local steps and of parameters.
    """
    import torch
    if swarm is None:
        loss, accuracy = train_digits_torch(hvd, hvd.Compression.none, epochs, seed, lr, batch_size)
        return {"loss": loss, "accuracy": accuracy, "final_accuracy": accuracy[-1], "stats": {}}
    proxy = _SwarmHorovod(hvd, dict(swarm, seed=seed))
    loss, accuracy = train_digits_torch(proxy, None, epochs, seed, lr, batch_size)
    proxy.optimizer.average_models()
    _, _, x_test, y_test = (torch.from_numpy(a) for a in digits_split())
    with torch.no_grad():  # the averaged parameters in the architecture of train_digits_torch
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                    torch.nn.ReLU(), torch.nn.Linear(256, 10))
        logits = torch.func.functional_call(model, dict(proxy.named_parameters), (x_test,))
        final = (logits.argmax(1) == y_test).float().mean().item() * 100.0
    shard = len(range(hvd.rank(), len(digits_split()[0]), hvd.size()))
    return {"loss": loss, "accuracy": accuracy, "final_accuracy": final,
            "stats": proxy.optimizer.compression_stats(), "steps": epochs * (shard // batch_size),
            "parameters": sum(p.numel() for _, p in proxy.named_parameters)}


def accuracy_main(args):
    import horovod.torch as hvd
    import numpy as np
    hvd.init()
    names = args.configs.split(",")
    results = {}
    for name in names:
        for seed in (int(s) for s in args.seeds.split(",")):
            start = time.perf_counter()
            r = train_digits_swarm(hvd, CONFIGS[name], args.epochs, seed)
            r["seconds"] = time.perf_counter() - start
            results.setdefault(name, []).append(r)
            if hvd.rank() == 0:
                s = r["stats"]
                extra = (f", {s['bytes_sent'] / max(s['rounds'], 1) / 1e3:.1f} kB/round sent, "
                         f"{s['decode_failures']} decode failures, {s['fallback_rounds']} fallback rounds"
                         if s else "")
                print(f"{name:>30} seed {seed}: accuracy {r['final_accuracy']:.2f}% "
                      f"({r['seconds']:.1f} s{extra})", flush=True)
    if hvd.rank() != 0:
        return
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    base = np.mean([r["final_accuracy"] for r in results["sync-sgd"]]) if "sync-sgd" in results else None
    print("\nfinal test accuracy (SwarmSGD: after average_models()), mean +- half range over seeds; bytes each rank "
          "sends per model coordinate per step")
    print(f"{'configuration':>30} {'accuracy %':>16} {'vs sync':>8} {'bytes/coord/step':>17}")
    for name, runs in results.items():
        final = np.array([r["final_accuracy"] for r in runs])
        delta = f"{final.mean() - base:+.2f}" if base is not None else "-"
        # synchronous SGD: what a ring allreduce sends per rank, 2 (n - 1) / n fp32 values per coordinate
        per_coord = 8.0 * (hvd.size() - 1) / hvd.size() if CONFIGS[name] is None else _bytes_per_coord_step(runs)
        spread = (final.max() - final.min()) / 2
        print(f"{name:>30} {final.mean():>8.2f} +-{spread:<5.2f} {delta:>8} {per_coord:>17.3f}")


def _bytes_per_coord_step(runs):
    """Bytes rank 0 sent per model coordinate per training step (from the SwarmSGD statistics)."""
    r = runs[0]
    return r["stats"]["bytes_sent"] / r["parameters"] / r["steps"]


# --------------------------------------------------------------------------- wire --

WIRE_CONFIGS = {
    "allreduce": {"optimizer": "allreduce"},
    "qsgd-4bit": {"optimizer": "qsgd4"},
    "swarm-H4-fp32": {"optimizer": "swarm", "local_steps": 4, "quantization": None},
    "swarm-H4-lattice8": {"optimizer": "swarm", "local_steps": 4, "quantization": "lattice8"},
    "swarm-H4-lattice8-nb": {"optimizer": "swarm", "local_steps": 4, "quantization": "lattice8",
                             "averaging": "nonblocking"},
    "swarm-H1-lattice8": {"optimizer": "swarm", "local_steps": 1, "quantization": "lattice8"},
}


def wire_worker(args):
    """One configuration under horovodrun: a few steps of a synthetic model, bytes and time per step."""
    import horovod.torch as hvd
    import torch
    from benchmarks.models_torch import build_model, input_shape
    from benchmarks.netlab import control_bytes_per_second, loopback_bytes
    from horovod_qsgd.torch import QSGD
    from horovod_qsgd.torch.swarm import SwarmOptimizer
    hvd.init()
    config = dict(WIRE_CONFIGS[args.config])
    kind = config.pop("optimizer")
    torch.manual_seed(0)
    model = build_model(args.model)
    local = torch.optim.SGD(model.parameters(), lr=0.001)
    if kind == "swarm":
        opt = SwarmOptimizer(local, model, **config)
    else:
        opt = hvd.DistributedOptimizer(local, named_parameters=model.named_parameters(),
                                       compression=QSGD(bits=4) if kind == "qsgd4" else hvd.Compression.none)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(hvd.rank())
    data = torch.randn(args.batch_size, *input_shape(args.model), generator=g)
    target = torch.randint(0, 1000, (args.batch_size,), generator=g)

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(data), target).backward()
        opt.step()

    # warm-up: at least the exact calibration round and one lattice round (loads the compiled kernels)
    for _ in range(max(args.warmup, 2 * config.get("local_steps", 0))):
        step()
    if kind == "swarm":
        opt.synchronize()
        opt.compression_stats(reset=True)

    def barrier():
        hvd.allreduce(torch.zeros(1), name="swarm_wire.barrier")

    control_rate = control_bytes_per_second(barrier)  # Horovod's own idle coordination traffic
    barrier()
    wire0, t0 = loopback_bytes(), time.perf_counter()
    for _ in range(args.steps):
        step()
    if kind == "swarm":
        opt.synchronize()
    barrier()
    seconds, wire = time.perf_counter() - t0, loopback_bytes() - wire0
    stats = opt.compression_stats() if kind == "swarm" else {}
    payload = hvd.allreduce(torch.tensor(float(stats.get("bytes_sent", 0))), op=hvd.Sum, name="swarm_wire.payload")
    if hvd.rank() == 0:
        result = {"config": args.config, "model": args.model, "parameters": sum(p.numel() for p in model.parameters()),
                  "steps": args.steps, "wire_bytes_per_step": wire / args.steps,
                  "step_seconds": seconds / args.steps,
                  "control_bytes_per_step": control_rate * seconds / args.steps,
                  "payload_bytes_per_step": payload.item() / args.steps,
                  "samples_per_second": hvd.size() * args.batch_size * args.steps / seconds,
                  "fallback_rounds": stats.get("fallback_rounds"), "decode_failures": stats.get("decode_failures"),
                  "codec_seconds_per_step": (stats.get("encode_seconds", 0)
                                             + stats.get("decode_seconds", 0)) / args.steps,
                  "wait_seconds_per_step": stats.get("wait_seconds", 0) / args.steps}
        with open(args.json_out, "w") as f:
            json.dump(result, f)


def wire_main(args):
    from benchmarks import netlab
    reason = netlab.unavailable_reason()
    if reason:
        print(f"running on the host loopback, unshaped: {reason}")
    rows = []
    for name in args.wire_configs.split(","):
        out = os.path.join(tempfile.mkdtemp(prefix="swarm-wire-"), "result.json")
        job = [*netlab.HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, os.path.abspath(__file__),
               "--wire-worker", "--config", name, "--model", args.model, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--batch-size", str(args.batch_size), "--json-out", out]
        env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3")
        netlab.run_horovod_job(job, args.rate, shaped=reason is None, env=env, timeout=args.timeout, what=name)
        with open(out) as f:
            rows.append(json.load(f))
        r = rows[-1]
        swarm = (f" (rank 0: {r['codec_seconds_per_step']:.3f} s encoding/decoding, "
                 f"{r['wait_seconds_per_step']:.3f} s waiting for exchanges)" if r["payload_bytes_per_step"] else "")
        print(f"{name:>22}: {r['wire_bytes_per_step'] / 1e6:8.2f} MB/step on the wire, "
              f"{r['step_seconds']:.3f} s/step{swarm}, {r['samples_per_second']:.1f} samples/s", flush=True)
    base = next((r for r in rows if r["config"] == "allreduce"), None)
    print(f"\nmodel {rows[0]['model']} ({rows[0]['parameters'] / 1e6:.1f}M parameters), 2 ranks, rate {args.rate}")
    print("wire: loopback bytes per training step, both ranks (idle: Horovod's own coordination in that time; "
          "payload: SwarmSGD's model payloads)")
    print(f"{'configuration':>22} {'wire MB/step':>13} {'idle MB':>8} {'payload MB':>11} {'wire/param':>11} "
          f"{'vs allreduce':>13} {'s/step':>8} {'samples/s':>10} {'speedup':>8}")
    for r in rows:
        fewer = f"{base['wire_bytes_per_step'] / r['wire_bytes_per_step']:.1f}x" if base else "-"
        speedup = f"{r['samples_per_second'] / base['samples_per_second']:.2f}x" if base else "-"
        payload = f"{r['payload_bytes_per_step'] / 1e6:.2f}" if r["payload_bytes_per_step"] else "-"
        print(f"{r['config']:>22} {r['wire_bytes_per_step'] / 1e6:>13.2f} {r['control_bytes_per_step'] / 1e6:>8.2f} "
              f"{payload:>11} {r['wire_bytes_per_step'] / r['parameters']:>11.3f} {fewer:>13} "
              f"{r['step_seconds']:>8.3f} {r['samples_per_second']:>10.1f} {speedup:>8}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--wire", action="store_true", help="measure bytes on a shaped namespace instead")
    parser.add_argument("--wire-configs", default=",".join(WIRE_CONFIGS))
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--model", default="mlp10m")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--wire-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--json-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.wire_worker:
        wire_worker(args)
    elif args.wire:
        wire_main(args)
    else:
        accuracy_main(args)


if __name__ == "__main__":
    main()
