"""PyTorch adapter: pass one of these as ``compression=`` to Horovod.

    import horovod.torch as hvd
    from horovod_qsgd.torch import QSGD
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=QSGD(bits=4))
"""
try:
    import horovod.torch as _hvd
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("horovod_qsgd.torch needs Horovod built with PyTorch support; run "
                      "scripts/setup.sh (it builds Horovod 0.28.1 for torch 2.13).") from exc

from horovod_qsgd.torch.compression import QSGD, RandomK, TopK  # noqa: E402
from horovod_qsgd.codecs.header import PayloadError  # noqa: E402
from horovod_qsgd.common.errors import (CompressionMismatchError, JoinUnsupportedError,  # noqa: E402
                                         UnsupportedCollectiveError)
from horovod_qsgd.kernels import cpu_threads, set_cpu_threads  # noqa: E402
from horovod_qsgd.torch.elastic import register_state_handler as _register_state_handler  # noqa: E402
from horovod_qsgd.torch.join import Join  # noqa: E402
from horovod_qsgd.torch.swarm import SwarmOptimizer  # noqa: E402
from horovod_qsgd.torch.diloco import DiLoCo  # noqa: E402

_register_state_handler()  # hvd.elastic.TorchState(..., compression=c) commits and restores c

#: Horovod's own compressors, re-exported so a comparison needs one import.
NoCompression = _hvd.Compression.none
FP16 = _hvd.Compression.fp16

__all__ = ["QSGD", "TopK", "RandomK", "FP16", "NoCompression", "Join", "SwarmOptimizer", "DiLoCo",
           "CompressionMismatchError", "UnsupportedCollectiveError", "JoinUnsupportedError", "PayloadError",
           "set_cpu_threads", "cpu_threads"]
