"""Torch tensors as the arrays the kernels take, without copying, and the stream the kernels run on.

Shared by the Horovod PyTorch adapter and the DDP hooks; imports no Horovod.
"""
import contextlib

import torch

from horovod_qsgd.kernels import CarriedResidual, launch_stream


def as_array(tensor):
    """A zero-copy numpy (CPU) or CUDA-array-interface (GPU) view of a contiguous tensor, or the same of each
    tensor of a :class:`~horovod_qsgd.kernels.CarriedResidual`; None stays None."""
    if tensor is None:
        return None
    if isinstance(tensor, CarriedResidual):
        return CarriedResidual(as_array(tensor.target), as_array(tensor.previous), as_array(tensor.commit),
                               tensor.stamp)
    if tensor.is_cuda:
        from numba import cuda
        return cuda.as_cuda_array(tensor)
    return tensor.numpy()


@contextlib.contextmanager
def kernel_stream(device):
    """The kernels launched inside run on ``device`` and on PyTorch's current stream there.

    numba would launch on its own default stream, in the calling thread's
    current context: a gradient written on a side stream could be read before
    it is ready, and on a node with several GPUs every kernel would run on
    GPU 0 unless the job called ``torch.cuda.set_device``. Horovod's ready
    event is recorded on the current stream after ``compress``, so it covers
    the kernels too. Scratch memory comes from PyTorch's caching allocator on
    that stream. CPU devices: nothing changes.
    """
    if device.type != "cuda":
        yield
        return
    from numba import cuda
    index = device.index if device.index is not None else torch.cuda.current_device()
    handle = torch.cuda.current_stream(index).cuda_stream
    stream = cuda.external_stream(handle) if handle else cuda.default_stream()

    def allocate(nbytes):
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    with cuda.gpus[index]:
        with launch_stream(stream, allocate):
            yield


def concatenate_pieces(pieces, buffers):
    """One uint8 tensor of a fused buffer's pieces (:mod:`horovod_qsgd.common.fusion`): host bytes (copied to
    the device in one copy) and (member, start, end) ranges of ``buffers``."""
    device = buffers[0].device
    host = b"".join(piece for piece in pieces if isinstance(piece, bytes))
    staged = torch.frombuffer(bytearray(host), dtype=torch.uint8).to(device) if host else None
    parts, offset = [], 0
    for piece in pieces:
        if isinstance(piece, bytes):
            parts.append(staged[offset:offset + len(piece)])
            offset += len(piece)
        else:
            member, start, end = piece
            parts.append(buffers[member][start:end])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class TorchBuffers:
    """What an exchange's conduct allocates and reads through (see :mod:`horovod_qsgd.common.collectives`):
    PyTorch tensors on ``device``, and their codec arrays. The transports of the Horovod and DDP adapters add
    the collectives."""

    def __init__(self, device):
        self.device = device

    def zeros(self, n, dtype):
        return torch.zeros(n, dtype=getattr(torch, dtype), device=self.device)

    def empty(self, n, dtype):
        return torch.empty(n, dtype=getattr(torch, dtype), device=self.device)

    array = staticmethod(as_array)

    def concatenate(self, pieces, buffers):
        return concatenate_pieces(pieces, buffers or [self.zeros(0, "uint8")])
