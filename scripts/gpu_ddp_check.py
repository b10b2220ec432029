"""The DDP hooks on CUDA gradients, bit for bit against the same hooks on CPU gradients.

Run on a machine with one NVIDIA GPU (every rank shares it, so Gloo carries
the collectives: NCCL refuses two ranks on one device)::

    torchrun --nproc_per_node 2 scripts/gpu_ddp_check.py
    # two "nodes" of 2 ranks for exchange="node_aware" (GROUP_RANK tells the nodes apart):
    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29511 \\
        scripts/gpu_ddp_check.py &
    torchrun --nnodes 2 --node_rank 1 --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29511 \\
        scripts/gpu_ddp_check.py

Each rank builds two DDP models of the same parameters, one on the CPU and
one on the GPU, registers the same hook settings on both and runs 4 backward
passes (DDP rebuilds its buckets after the first) with the same gradients.
The kernels give the same bytes on both devices, so every averaged gradient,
every residual in ``state_dict()`` and the statistics must be equal bit for
bit, and equal on every rank. On two nodes, ``exchange="auto"`` on the GPU is
compared with ``"node_aware"`` on the CPU (what "auto" takes for CUDA
gradients there). Prints one line per setting; exits 1 on any difference.
"""
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import horovod_qsgd.ddp as ddp_hooks  # noqa: E402

# below MIN_NUMEL: passed through (one allreduce beside the compressed part); 300,000 is no multiple of 512
SIZES = (700, 300_000, 150_000, 1_000_000, 290_000)
MIN_NUMEL = 200_000
ROUNDS = 2  # a race shows in some runs only
SETTINGS = [("QSGDState", {"bits": 4, "exchange": "allgather"}),
            ("QSGDState", {"bits": 4, "exchange": "two_stage"}),
            ("QSGDState", {"bits": 2, "exchange": "two_stage", "second_stage_bits": 8}),
            ("TopKState", {"ratio": 0.01, "exchange": "allgather"}),
            ("TopKState", {"ratio": 0.01, "selector": "gaussian", "exchange": "two_stage"}),
            ("TopKState", {"ratio": 0.001, "selector": "sample", "exchange": "two_stage"})]
NODE_SETTINGS = [("QSGDState", {"bits": 4, "exchange": "node_aware"}),
                 ("TopKState", {"ratio": 0.01, "exchange": "node_aware"}),
                 # "auto" takes the node-aware exchange for CUDA gradients on several nodes (CPU ones stay flat):
                 # the GPU's result under "auto" must be the CPU's under "node_aware"
                 ("QSGDState", {"bits": 4, "exchange": "auto"}),
                 ("TopKState", {"ratio": 0.01, "exchange": "auto"})]


class Weights(torch.nn.Module):
    """loss = sum_i <w_i, g_i>: the gradient of w_i is exactly g_i."""

    def __init__(self, device):
        super().__init__()
        self.w = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n, device=device)) for n in SIZES])

    def forward(self, grads):
        return sum((w * g).sum() for w, g in zip(self.w, grads))


def gradients(rank, step):
    rng = np.random.default_rng(1000 * rank + step)
    return [torch.from_numpy(rng.standard_normal(n).astype(np.float32)) for n in SIZES]


def run(class_name, kwargs, device, rank):
    state = getattr(ddp_hooks, class_name)(min_numel=MIN_NUMEL, **kwargs)
    model = torch.nn.parallel.DistributedDataParallel(
        Weights(device), device_ids=None, bucket_cap_mb=2)
    model.register_comm_hook(state, ddp_hooks.qsgd_hook)
    results = []
    for step in range(4):
        for p in model.parameters():
            p.grad = None
        model([g.to(device) for g in gradients(rank, step)]).backward()
        results.append(torch.cat([p.grad.reshape(-1) for p in model.module.w]).cpu())
    stats = {k: v for k, v in state.compression_stats().items() if isinstance(v, int)}  # not the seconds
    return results, tensors_of(state.state_dict()), stats


def tensors_of(tree, path=""):
    """Every tensor of a state_dict (residuals, owners' and shards' residuals) by its path, on the CPU."""
    if isinstance(tree, torch.Tensor):
        return {path: tree.detach().cpu()}
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in tensors_of(sub, f"{path}/{key}").items()}
    return {}


def main():
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    else:
        device = torch.device("cpu")
        print(f"rank {rank}: no GPU; comparing the CPU with itself (a dry run of this script)", flush=True)
    nodes = os.environ.get("GROUP_WORLD_SIZE", "1") != "1"
    failures = 0
    for class_name, kwargs in (NODE_SETTINGS if nodes else SETTINGS) * ROUNDS:
        if kwargs["exchange"] == "auto" and nodes and device.type == "cpu":
            continue  # the dry run has no CUDA gradients: "auto" is node-blind there
        cpu_kwargs = dict(kwargs, exchange="node_aware") if nodes and kwargs["exchange"] == "auto" else kwargs
        cpu = run(class_name, cpu_kwargs, torch.device("cpu"), rank)
        gpu = run(class_name, kwargs, device, rank)
        problems = []
        for step, (a, b) in enumerate(zip(cpu[0], gpu[0])):
            if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
                differ = int((a != b).sum())
                problems.append(f"step {step}: {differ} of {a.numel()} gradient values differ "
                                f"(largest |diff| {float((a - b).abs().max()):.3g})")
            if not torch.isfinite(b).all():
                problems.append(f"step {step}: not finite on the GPU")
        if cpu[1].keys() != gpu[1].keys():
            problems.append(f"state tensors {sorted(cpu[1])} (CPU) vs {sorted(gpu[1])} (GPU)")
        else:
            problems += [f"state tensor {k} differs" for k in cpu[1] if not torch.equal(cpu[1][k], gpu[1][k])]
        if cpu[2] != gpu[2]:
            problems.append(f"statistics differ: {cpu[2]} vs {gpu[2]}")
        last = gpu[0][-1]
        gathered = [torch.empty_like(last) for _ in range(size)]
        dist.all_gather(gathered, last)
        if not all(torch.equal(gathered[0], g) for g in gathered):
            problems.append("the GPU results differ between ranks")
        verdict = (f"bitwise equal to the CPU ({len(cpu[1])} state tensors too), equal on every rank"
                   if not problems else "; ".join(problems))
        print(f"rank {rank}/{size} {class_name}{kwargs}: {verdict}", flush=True)
        failures += bool(problems)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
