"""FSDP2 adapter: our compressors as the gradient reduce-scatter of ``fully_shard`` modules; no Horovod needed.

    from torch.distributed.fsdp import fully_shard
    from horovod_qsgd.fsdp import QSGD, compress_reduce_scatter
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    compressor = compress_reduce_scatter(model, QSGD(bits=4))
"""
from horovod_qsgd.common.errors import CompressionMismatchError
from horovod_qsgd.fsdp.reduce_scatter import QSGD, ModuleReduceScatter, TopK, compress_reduce_scatter

__all__ = ["QSGD", "TopK", "compress_reduce_scatter", "ModuleReduceScatter", "CompressionMismatchError"]
