"""Torch tensors as the arrays the kernels take, without copying."""


def as_array(tensor):
    """A zero-copy numpy (CPU) or CUDA-array-interface (GPU) view of a contiguous tensor."""
    if tensor.is_cuda:
        from numba import cuda
        return cuda.as_cuda_array(tensor)
    return tensor.numpy()
