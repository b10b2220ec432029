"""FSDP2 adapter: our compressors as the gradient reduce-scatter of ``fully_shard`` modules; no Horovod needed.

    from torch.distributed.fsdp import fully_shard
    from horovod_qsgd.fsdp import QSGD, compress_reduce_scatter
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    compressor = compress_reduce_scatter(model, QSGD(bits=4))

HSDP (sharded in a node, replicated across nodes): shard on ``mesh["shard"]`` and pass
``replicate=mesh["replicate"]``: the all-reduce between nodes is compressed.
"""
from horovod_qsgd.common.errors import CompressionMismatchError
from horovod_qsgd.fsdp.install import compress_reduce_scatter
from horovod_qsgd.fsdp.reduce_scatter import QSGD, ModuleReduceScatter, TopK
from horovod_qsgd.fsdp.replicas import ReplicaAllReduce

__all__ = ["QSGD", "TopK", "compress_reduce_scatter", "ModuleReduceScatter", "ReplicaAllReduce",
           "CompressionMismatchError"]
