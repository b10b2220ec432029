"""The exchanges across two "nodes" (network namespaces, ``benchmarks/nodelab.py``), as on a cluster.

Horovod sees two hosts of two ranks (``local_size`` 2, ``cross_size`` 2); the
two-stage exchange of QSGD and Top-k, whose collectives now cross a NIC,
must give every rank the reference's bits, as on one host. The node-aware
exchange is tested in both frameworks at once in ``tests/test_node_aware.py``.
"""
import numpy as np
import pytest

from tests.two_stage_reference import bounds, gradient, reference


@pytest.mark.ranks(4, timeout=240, launcher="nodes:2x2")
def test_two_stages_across_two_nodes_are_the_reference_on_every_rank(hvd_torch):
    import torch
    from horovod_qsgd.codecs import QSGDCodec, TopKCodec
    from horovod_qsgd.torch import QSGD, TopK
    hvd = hvd_torch
    rank = hvd.rank()
    assert (hvd.size(), hvd.local_size(), hvd.cross_size()) == (4, 2, 2)
    assert (hvd.local_rank(), hvd.cross_rank()) == (rank % 2, rank // 2)
    numel = 100_003
    grads = [gradient(r, numel) for r in range(4)]
    qsgd = QSGD(bits=4, exchange="two_stage", min_numel=0)
    result = hvd.allreduce(torch.from_numpy(grads[rank]), name="w", op=hvd.Sum, compression=qsgd)
    want = reference(QSGDCodec(bits=4), QSGDCodec(bits=4), "w", grads, 0, 512)
    assert np.array_equal(result.numpy(), want)

    topk, codec = TopK(ratio=0.01, exchange="two_stage"), TopKCodec(ratio=0.01)
    residuals = [np.zeros(numel, np.float32) for _ in range(4)]
    owners = [np.zeros(e - b, np.float32) for b, e in bounds(numel, 4, 1)]
    for step in range(3):
        grads = [gradient(r, numel, step) for r in range(4)]
        result = hvd.allreduce(torch.from_numpy(grads[rank]), name="t", op=hvd.Sum, compression=topk)
        want = reference(codec, codec, "t", grads, step, 1, residuals, owners)
        assert np.array_equal(result.numpy(), want), step
    gathered = hvd.allgather(result.reshape(1, -1), name="check")
    assert all(torch.equal(gathered[0], gathered[r]) for r in range(4))
