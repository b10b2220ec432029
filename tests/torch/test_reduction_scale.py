"""The GPU's reduction scale (no .item()) equals the host's, computed here on CPU tensors."""
import numpy as np
import pytest
import torch

from horovod_qsgd.common.exchange import reduction_scale
from horovod_qsgd.torch.compression import device_reduction_scale


@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_device_scale_equals_host_scale(ranks, dtype):
    values = [ranks, 1.0, ranks * (1 + 4e-3), 1 - 4e-3, ranks * 1.02, 2.0, 0.0, 0.5, 3.0]
    total = torch.from_numpy(np.random.default_rng(ranks).standard_normal(1000).astype(np.float32))
    for value in values:
        placeholder = torch.tensor([value], dtype=dtype)
        host = reduction_scale(placeholder.item(), ranks)
        device = device_reduction_scale(placeholder, ranks)
        assert device.dtype == torch.float32 and device.dim() == 0
        assert device.item() == np.float32(host), (value, dtype)
        # the product a GPU computes with the 0-d tensor is the host path's product with the Python float
        assert torch.equal(total.clone().mul_(device), total.clone().mul_(host)), (value, dtype)
