"""PyTorch DDP adapter: our compressors as DDP communication hooks, beside ``powerSGD_hook``; no Horovod needed.

    from horovod_qsgd.ddp import QSGDState, qsgd_hook
    model = torch.nn.parallel.DistributedDataParallel(model)
    state = QSGDState(process_group=None, bits=4)
    model.register_comm_hook(state, qsgd_hook)

Local steps instead (no DDP wrapper; the outer exchange compressed)::

    from horovod_qsgd.ddp import DiLoCo, QSGDState
    optimizer = DiLoCo(torch.optim.AdamW(model.parameters()), model.named_parameters(), compression=QSGDState(bits=4))
"""
from horovod_qsgd.common.errors import CompressionMismatchError
from horovod_qsgd.ddp.diloco import DiLoCo
from horovod_qsgd.ddp.hooks import QSGDState, TopKState, qsgd_hook, topk_hook

__all__ = ["QSGDState", "TopKState", "qsgd_hook", "topk_hook", "DiLoCo", "CompressionMismatchError"]
