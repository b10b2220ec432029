"""The language-model study under FSDP2: our compressed reduce-scatter beside FSDP2's own.

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 torchrun --nproc_per_node 2 benchmarks/lm_fsdp.py
    python benchmarks/lm_convergence.py --report benchmarks/results/lm-convergence/fsdp_2ranks.json

The study of ``benchmarks/lm_convergence.py`` (same data, model, initial
weights, global batch, Adam schedule and seeds; ``STUDY`` there), the model
``fully_shard``-ed whole (one module: one reduce-scatter per step, each
parameter's shard on its own QSGD scales) on Gloo:

- ``none``: FSDP2's own reduce-scatter (``set_force_sum_reduction_for_comms``:
  Gloo takes no AVG; FSDP2 then divides the sum itself);
- ``qsgd-8bit`` / ``qsgd-4bit`` / ``topk-1%``: ``horovod_qsgd.fsdp`` with
  ``compress_reduce_scatter`` (``min_numel`` 10,000: the module's 0.48M
  elements are compressed, biases and norms too, each in its own buckets);
  ``topk-1%-lean``: Top-k's residual kept in one bfloat16 buffer (``residual_dtype="bfloat16"``).

``--hsdp MxL`` (M nodes of L ranks, on ``benchmarks/nodelab.py``'s nodes): HSDP, the model sharded inside a
node and replicated across nodes (mesh ``(M, L)``, dimensions ``("replicate", "shard")``): ``none`` is
FSDP2's native HSDP (a 2-D mesh: its replicas' all-reduce at fp32), the others custom HSDP with
``compress_reduce_scatter(model, ..., replicate=mesh["replicate"])`` (FSDP2's own reduce-scatter in the node,
ours across the replicas); bytes per step are then each rank's between nodes (an ideal ring all-reduce's
2 (M-1)/M shards for ``none``), the output ``fsdp_hsdp_<M>x<L>.json``:

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python benchmarks/nodelab.py --nodes 2 --per-node 2 \
        --launcher torchrun --timeout 7200 -- python benchmarks/lm_fsdp.py --hsdp 2x2 --configs none,qsgd-4bit

Bytes per step are each rank's reduce-scatter payload in the last step: an ideal fp32 reduce-scatter's (N-1)
rows for ``none`` (Gloo's own sends about twice that: ``benchmarks/results/fsdp/``), ours
``compression_stats()['bytes_sent']``. Rank 0 writes ``fsdp_<N>ranks.json`` (the record format of
``lm_convergence.py`` plus ``bytes_per_step``), a plot, and prints the table.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.lm_convergence import STUDY  # noqa: E402
from benchmarks.lm_ddp import byte_lm_module, run_study, train_module  # noqa: E402

CONFIGS = ["none", "qsgd-8bit", "qsgd-4bit", "topk-1%", "topk-1%-lean"]


def compressor_of(name, seed):
    """Our compressor for configuration ``name``; None for FSDP2's own reduce-scatter."""
    from horovod_qsgd.fsdp import QSGD, TopK
    if name.startswith("qsgd-") and name.endswith("bit"):
        return QSGD(bits=int(name[len("qsgd-"):-len("bit")]), seed=seed)
    if name in ("topk-1%", "topk-1%-lean"):
        return TopK(ratio=0.01, seed=seed, residual_dtype="bfloat16" if name.endswith("lean") else "float32")
    if name == "none":
        return None
    raise SystemExit(f"unknown configuration {name!r}; choose from {', '.join(CONFIGS)}")


def train_fsdp(dist, name, corpus, seed, s, hsdp=None):
    """One run: the byte LM under ``fully_shard`` with configuration ``name`` (``hsdp``: (M, L), HSDP); the record
    and bytes per step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from horovod_qsgd.fsdp import compress_reduce_scatter
    model = byte_lm_module(seed, s)
    numel = sum(p.numel() for p in model.parameters())
    compressor = compressor_of(name, seed)
    mesh = None if hsdp is None else init_device_mesh("cpu", hsdp, mesh_dim_names=("replicate", "shard"))
    if mesh is None:
        fully_shard(model)
    else:
        fully_shard(model, mesh=mesh if compressor is None else mesh["shard"])
    if compressor is None or mesh is not None:
        model.set_force_sum_reduction_for_comms(True)  # Gloo takes no AVG
    if compressor is not None:
        compress_reduce_scatter(model, compressor, replicate=None if mesh is None else mesh["replicate"])
    ranks = dist.get_world_size()

    def before_last_step():
        if compressor is not None:
            compressor.compression_stats(reset=True)

    def bytes_of_last_step():
        if compressor is None and hsdp is not None:
            return 4 * 2 * (hsdp[0] - 1) * -(-numel // hsdp[1]) / hsdp[0]
        if compressor is None:
            return 4 * (ranks - 1) * -(-numel // ranks)
        return compressor.compression_stats()["bytes_sent"]

    return train_module(dist, model, model, corpus, seed, s, before_last_step, bytes_of_last_step)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=STUDY["steps"])
    parser.add_argument("--hsdp", help="MxL: HSDP on M nodes of L ranks (see the module's docstring)")
    parser.add_argument("--resume", action="store_true", help="keep the runs already in the output file")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "lm-convergence"))
    args = parser.parse_args()
    for name in args.configs.split(","):
        compressor_of(name, 0)  # unknown names fail before any rank trains

    import torch.distributed as dist
    from benchmarks.stdlib_text import Corpus
    dist.init_process_group("gloo")
    settings = dict(STUDY, steps=args.steps, optimizer="adam", trainer="fsdp2")
    corpus = Corpus()
    os.makedirs(args.out, exist_ok=True)
    hsdp = None if args.hsdp is None else tuple(int(x) for x in args.hsdp.split("x"))
    path = os.path.join(args.out, f"fsdp_{dist.get_world_size()}ranks.json" if hsdp is None else
                        f"fsdp_hsdp_{args.hsdp}.json")
    run_study(dist, path, "pytorch-fsdp2" + ("" if hsdp is None else f"-hsdp-{args.hsdp}"), settings, corpus,
              args.configs.split(","), args.seeds, args.resume,
              lambda name, seed: train_fsdp(dist, name, corpus, seed, settings, hsdp))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
