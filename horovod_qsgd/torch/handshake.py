"""The settings handshake over Horovod's torch collectives (see horovod_qsgd.common.handshake)."""
import horovod.torch as hvd
import torch

from horovod_qsgd.common.handshake import verify_settings
from horovod_qsgd.common.threads import share_cores, warn_if_oversubscribed


def check_settings_across_ranks(kind, settings, name, process_set):
    """Allgathers every rank's settings record under ``name`` and raises on all ranks if they differ.

    Also the first moment a compressor knows it runs under Horovod: it gives
    this rank's kernels its share of the machine's cores, and warns if
    PyTorch's own threads oversubscribe them.
    """
    share_cores(hvd.local_size())
    warn_if_oversubscribed("PyTorch", torch.get_num_threads(), hvd.local_size(),
                           "OMP_NUM_THREADS={share} in the environment (or torch.set_num_threads({share}))")

    def allgather(array, collective_name):
        return hvd.allgather(torch.from_numpy(array.copy()), name=collective_name,
                             process_set=process_set).numpy()

    verify_settings(kind, settings, allgather, name)
