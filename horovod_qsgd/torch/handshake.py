"""The settings handshake over Horovod's torch collectives (see horovod_qsgd.common.handshake)."""
import horovod.torch as hvd
import torch

from horovod_qsgd.common.handshake import check_settings, settings_record
from horovod_qsgd.common.threads import share_cores


def check_settings_across_ranks(kind, settings, name, process_set):
    """Allgathers every rank's settings record under ``name`` and raises on all ranks if they differ.

    Also the first moment a compressor knows it runs under Horovod: it gives
    this rank's kernels its share of the machine's cores.
    """
    share_cores(hvd.local_size())
    record = torch.frombuffer(bytearray(settings_record(kind, settings)), dtype=torch.uint8)
    lengths = hvd.allgather(torch.tensor([record.numel()], dtype=torch.int64),
                            name=f"{name}.lengths", process_set=process_set)
    records = hvd.allgather(record, name=f"{name}.records", process_set=process_set)
    check_settings([bytes(c.numpy()) for c in torch.split(records, lengths.tolist())])
