"""The engine's collectives over Horovod's PyTorch collectives (see :mod:`horovod_qsgd.common.collectives`)."""
import horovod.torch as hvd
import torch

from horovod_qsgd.common.collectives import ALLTOALL
from horovod_qsgd.torch_shared.arrays import TorchBuffers


class HorovodTransport(TorchBuffers):
    """Allocates on ``device`` and starts each collective asynchronously in ``process_set``, under the name the
    exchange gives it (Horovod matches collectives by name); sizes travel with the data, so ``arriving`` is not
    needed."""

    def __init__(self, process_set, device):
        super().__init__(device)
        self.process_set = process_set

    def start(self, collective):
        """The Horovod handle of ``collective``, started."""
        if collective.kind == ALLTOALL:
            return hvd.alltoall_async(collective.send, splits=torch.tensor(collective.splits, dtype=torch.int32),
                                      name=collective.name, process_set=self.process_set)
        return hvd.allgather_async(collective.send, name=collective.name, process_set=self.process_set)
