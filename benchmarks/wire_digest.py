"""A digest of every byte the compressors hand to a collective: shows a refactor left the wire as it was.

    python benchmarks/wire_digest.py [--steps 3] [--only ddp] [--out FILE]

Trains a small MLP (three weights above ``min_numel``, biases below it) for
``--steps`` steps on ``--ranks`` ranks of one machine, once per setting, under
the DDP hooks (``torchrun``, Gloo), under Horovod's PyTorch optimizer
(``horovodrun --gloo``) and under Horovod's TensorFlow ``DistributedGradientTape``
in a ``tf.function`` (its collectives' inputs noted by a host op in front of each). Every collective call the adapter makes is wrapped:
its name (Horovod), kind, splits and a SHA-256 of the bytes it sends are
appended to the rank's log, each name's calls in call order (Horovod's hooks
compress tensors in the order their gradients become ready, which varies
between runs); so is a digest of the trained weights. The record is one
digest per (adapter, setting, rank) over that log, plus the number of calls
and bytes sent: two revisions with equal digests put the same bytes on the
wire, in the same order per collective, and trained to the same bits.
Horovod's own fusion is off (``HOROVOD_FUSION_THRESHOLD=0``, see ``_launch``).

The node-aware settings run 4 ranks as two "nodes" of two (``3nodes``: 6 ranks, three nodes, where the
exchange between nodes takes two stages): the DDP hooks' set ``GROUP_RANK`` to ``rank // 2`` before the
first bucket, TensorFlow's have Horovod report that layout (``hvd.local_rank()`` and the like). The
``elastic`` settings take a Horovod Elastic job's TensorFlow path in a plain job (``HOROVOD_ELASTIC=1`` in
the worker, the compressor in an elastic state), on a world that does not change.
Prints the JSON record; ``--out`` writes it too. Run it at two revisions
(a ``git worktree`` of the older one) and compare the files.
"""
import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DDP_SETTINGS = {
    "qsgd4-allgather": ("QSGDState", dict(bits=4, bucket_size=128, exchange="allgather")),
    "qsgd4-two_stage": ("QSGDState", dict(bits=4, bucket_size=128, exchange="two_stage", second_stage_bits=8)),
    "topk-allgather": ("TopKState", dict(ratio=0.05, exchange="allgather")),
    "topk-two_stage": ("TopKState", dict(ratio=0.05, exchange="two_stage")),
    "qsgd4-node_aware": ("QSGDState", dict(bits=4, bucket_size=128, exchange="node_aware")),
    "topk-node_aware": ("TopKState", dict(ratio=0.05, exchange="node_aware")),
}
# (compressor, its arguments, DistributedGradientTape's num_groups: 1 = one grouped call, whose two-stage
# tensors are fused)
TENSORFLOW_SETTINGS = {
    "qsgd4-auto-grouped": ("QSGD", dict(bits=4, bucket_size=128, exchange="auto", min_numel=1000), 1),
    "qsgd4-two_stage-unfused": ("QSGD", dict(bits=4, bucket_size=128, exchange="two_stage", fusion_threshold=0,
                                            min_numel=1000), 0),
    "qsgd4-two_stage": ("QSGD", dict(bits=4, bucket_size=128, exchange="two_stage", min_numel=1000), 0),
    "topk-two_stage": ("TopK", dict(ratio=0.05, exchange="two_stage", min_numel=1000), 0),
    "topk-two_stage-grouped": ("TopK", dict(ratio=0.05, exchange="two_stage", min_numel=1000), 1),
    "topk-allgather": ("TopK", dict(ratio=0.05, exchange="allgather", min_numel=1000), 0),
    "qsgd4-node_aware-grouped": ("QSGD", dict(bits=4, bucket_size=128, exchange="node_aware", min_numel=1000), 1),
    "topk-node_aware-unfused": ("TopK", dict(ratio=0.05, exchange="node_aware", error_feedback=True,
                                             fusion_threshold=0, min_numel=1000), 0),
    "topk-node_aware-grouped-3nodes": ("TopK", dict(ratio=0.05, exchange="node_aware", error_feedback=True,
                                                    min_numel=1000), 1),
    # a Horovod Elastic job's path (its plans made as the ops run), taken in a plain job: the world never changes
    "qsgd4-auto-elastic": ("QSGD", dict(bits=4, bucket_size=128, exchange="auto", min_numel=1000), 0),
    "topk-two_stage-elastic": ("TopK", dict(ratio=0.05, exchange="two_stage", min_numel=1000), 0),
}
HOROVOD_SETTINGS = {
    "qsgd4-auto": ("QSGD", dict(bits=4, bucket_size=128, exchange="auto", min_numel=1000)),
    "qsgd4-two_stage-unfused": ("QSGD", dict(bits=4, bucket_size=128, exchange="two_stage", fusion_threshold=0,
                                            min_numel=1000)),
    "topk-two_stage": ("TopK", dict(ratio=0.05, exchange="two_stage", min_numel=1000)),
    "topk-allgather": ("TopK", dict(ratio=0.05, exchange="allgather", min_numel=1000)),
}


def _model(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(96, 256), torch.nn.ReLU(), torch.nn.Linear(256, 192), torch.nn.ReLU(),
                               torch.nn.Linear(192, 80))


def _batch(torch, rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 96, generator=g), torch.randn(16, 80, generator=g)


class _Log:
    """The calls by collective name, each name's in call order: Horovod's hooks compress tensors in the order
    their gradients become ready, which differs between runs, while each name's calls are one per step."""

    def __init__(self):
        self.entries, self.calls, self.nbytes = {}, 0, 0

    def note(self, kind, data, name=None, **extra):
        """One call's ``data`` (bytes, or a torch tensor)."""
        if not isinstance(data, bytes):
            import torch
            data = data.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()
        self.entries.setdefault(name or "", []).append(
            json.dumps(dict(kind=kind, sha=hashlib.sha256(data).hexdigest(), **extra), sort_keys=True))
        self.calls += 1
        self.nbytes += len(data)

    def record(self, weights):
        """``weights``: the trained weights, as bytes."""
        lines = [f"{name} {entry}" for name in sorted(self.entries) for entry in self.entries[name]]
        lines.append("weights " + hashlib.sha256(b"".join(weights)).hexdigest())
        return dict(digest=hashlib.sha256("\n".join(lines).encode()).hexdigest(), calls=self.calls,
                    bytes_sent=self.nbytes)


def _ddp_worker(setting, steps, out):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    import horovod_qsgd.ddp as qddp
    from horovod_qsgd.torch_shared import distributed as torch_distributed
    from horovod_qsgd.ddp import hooks
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if setting.endswith("node_aware"):
        os.environ["GROUP_RANK"] = str(rank // 2)
    log = _Log()
    real_a2a, real_gather, real_allreduce = dist.all_to_all_single, torch_distributed.all_gather_single, dist.all_reduce

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
        log.note("alltoall", input, splits=list(input_split_sizes or []))
        return real_a2a(output, input, output_split_sizes, input_split_sizes, **kw)

    def all_gather_single(output, input, **kw):
        log.note("allgather", input)
        return real_gather(output, input, **kw)

    def all_reduce(tensor, *args, **kw):
        log.note("allreduce", tensor)
        return real_allreduce(tensor, *args, **kw)
    dist.all_to_all_single, dist.all_reduce = all_to_all_single, all_reduce
    # the transport (the engine's collectives) and the node-aware hook's in-node allgather, each by its own name
    torch_distributed.all_gather_single = hooks.all_gather_single = all_gather_single
    cls, kwargs = DDP_SETTINGS[setting]
    model = DistributedDataParallel(_model(torch), bucket_cap_mb=0.1)
    state = getattr(qddp, cls)(**kwargs)
    model.register_comm_hook(state, qddp.qsgd_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = _batch(torch, rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(log.record([w.detach().numpy().tobytes() for w in model.parameters()]), f)
    dist.barrier()
    os._exit(0)  # Gloo's threads at interpreter exit sometimes abort the process ("terminate called ...")


def _horovod_worker(setting, steps, out):
    import torch
    import horovod.torch as hvd
    import horovod_qsgd.torch as qtorch
    hvd.init()
    log = _Log()
    real_allgather, real_alltoall = hvd.allgather_async, hvd.alltoall_async

    def allgather_async(tensor, name=None, **kw):
        log.note("allgather", tensor, name=name)
        return real_allgather(tensor, name=name, **kw)

    def alltoall_async(tensor, splits=None, name=None, **kw):
        log.note("alltoall", tensor, name=name, splits=None if splits is None else splits.tolist())
        return real_alltoall(tensor, splits=splits, name=name, **kw)
    hvd.allgather_async, hvd.alltoall_async = allgather_async, alltoall_async
    cls, kwargs = HOROVOD_SETTINGS[setting]
    model = _model(torch)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=getattr(qtorch, cls)(**kwargs))
    for step in range(steps):
        x, y = _batch(torch, hvd.rank(), step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    with open(f"{out}.rank{hvd.rank()}", "w") as f:
        json.dump(log.record([w.detach().numpy().tobytes() for w in model.parameters()]), f)


def _tensorflow_worker(setting, steps, out):
    import numpy as np
    import tensorflow as tf
    import horovod.tensorflow as hvd
    import horovod_qsgd.tensorflow as qtf
    hvd.init()
    if setting.endswith("elastic"):  # what horovodrun sets in an elastic job's workers, read by the compressors
        os.environ["HOROVOD_ELASTIC"] = "1"
    if "node_aware" in setting:  # two ranks per "node", numbered node by node
        size, rank = hvd.size(), hvd.rank()
        hvd.local_rank, hvd.local_size = (lambda: rank % 2), (lambda: 2)
        hvd.cross_rank, hvd.cross_size = (lambda: rank // 2), (lambda: size // 2)
    log = _Log()
    real_allgather, real_alltoall = hvd.allgather, hvd.alltoall

    def noted(kind, tensor, name, splits=None):
        """``tensor``, its bytes noted when the graph runs (the adapter builds its collectives in a graph)."""
        def note(data, *split_values):
            extra = {"splits": split_values[0].tolist()} if split_values else {}
            log.note(kind, np.ascontiguousarray(data).tobytes(), name=name, **extra)
            return data
        passed = tf.numpy_function(note, [tensor] + ([] if splits is None else [splits]), tensor.dtype,
                                   stateful=False)
        passed.set_shape(tensor.shape)
        return passed

    def allgather(tensor, name=None, **kw):
        return real_allgather(noted("allgather", tensor, name), name=name, **kw)

    def alltoall(tensor, splits=None, name=None, **kw):
        return real_alltoall(noted("alltoall", tensor, name, splits), splits=splits, name=name, **kw)
    hvd.allgather, hvd.alltoall = allgather, alltoall
    cls, kwargs, num_groups = TENSORFLOW_SETTINGS[setting]
    rng = np.random.default_rng(0)
    width = 1400 if setting.endswith("3nodes") else 256  # 3nodes: shards large enough for two stages between nodes
    shapes = [(96, width), (width,), (width, 192), (192,), (192, 80), (80,)]
    weights = [tf.Variable(rng.standard_normal(shape).astype(np.float32) * 0.05, name=f"w{i}")
               for i, shape in enumerate(shapes)]
    compression = getattr(qtf, cls)(**kwargs)
    if setting.endswith("elastic"):
        from horovod_qsgd.tensorflow import elastic
        elastic.TensorFlowState(weights, compression=compression)  # the state an elastic job's compressor is in

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            h = x
            for i in range(0, len(weights), 2):
                h = tf.matmul(h, weights[i]) + weights[i + 1]
                h = tf.nn.relu(h) if i + 2 < len(weights) else h
            loss = tf.reduce_mean(tf.square(h - y))
        tape = hvd.DistributedGradientTape(tape, compression=compression, num_groups=num_groups)
        for weight, grad in zip(weights, tape.gradient(loss, weights)):
            weight.assign_sub(0.1 * grad)

    for step in range(steps):
        batch = np.random.default_rng(1000 * hvd.rank() + step)
        train_step(batch.standard_normal((16, 96)).astype(np.float32),
                   batch.standard_normal((16, 80)).astype(np.float32))
    with open(f"{out}.rank{hvd.rank()}", "w") as f:
        json.dump(log.record([w.numpy().tobytes() for w in weights]), f)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(adapter, setting, ranks, steps, tmp):
    out = os.path.join(tmp, f"{adapter}-{setting}")
    # Horovod's own fusion of the small tensors' allreduces packs them as their gradients arrive, which varies
    # between runs, and a ring allreduce's summation order depends on where a value lies in the fused buffer:
    # the weights, then every later payload, would differ by chance
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", PYTHONPATH=ROOT, HOROVOD_FUSION_THRESHOLD="0",
               TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
    me = [os.path.abspath(__file__), "--worker", adapter, setting, str(steps), out]
    if adapter == "ddp":
        job = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
               str(_free_port()), *me]
    else:
        job = ["horovodrun", "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo", sys.executable, *me]
    subprocess.run(job, env=env, check=True, stdout=subprocess.DEVNULL, timeout=600)
    ranks_seen = []
    for rank in range(ranks):
        with open(f"{out}.rank{rank}") as f:
            ranks_seen.append(json.load(f))
    return ranks_seen


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        adapter, setting, steps, out = sys.argv[2:6]
        sys.path.insert(0, ROOT)
        {"ddp": _ddp_worker, "horovod": _horovod_worker, "tensorflow": _tensorflow_worker}[adapter](
            setting, int(steps), out)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out")
    parser.add_argument("--only", help="run only the settings whose label contains this (e.g. ddp)")
    args = parser.parse_args()
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
    record = dict(revision=revision, steps=args.steps, runs={})
    with tempfile.TemporaryDirectory() as tmp:
        for adapter, settings in (("ddp", DDP_SETTINGS), ("horovod", HOROVOD_SETTINGS),
                                  ("tensorflow", TENSORFLOW_SETTINGS)):
            for setting in settings:
                ranks = 6 if setting.endswith("3nodes") else 4 if "node_aware" in setting else 3
                if args.only and args.only not in f"{adapter} {setting}":
                    continue
                record["runs"][f"{adapter} {setting} x{ranks}"] = _launch(adapter, setting, ranks, args.steps, tmp)
                print(f"{adapter} {setting} x{ranks}: {record['runs'][f'{adapter} {setting} x{ranks}']}",
                      flush=True)
    text = json.dumps(record, indent=1, sort_keys=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
