"""The exchanges across two "nodes" (network namespaces, ``benchmarks/nodelab.py``), as on a cluster.

Horovod sees two hosts of two ranks (``local_size`` 2, ``cross_size`` 2); the
two-stage exchange of QSGD and Top-k, whose collectives now cross a NIC,
must give every rank the reference's bits, as on one host.
"""
import numpy as np
import pytest

from tests.two_stage_reference import bounds, gradient, node_aware_reference, reference


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


@pytest.mark.parametrize("nodes, per_node", [
    pytest.param(2, 2, marks=pytest.mark.ranks(4, timeout=300, launcher="nodes:2x2")),
    pytest.param(3, 2, marks=pytest.mark.ranks(6, timeout=400, launcher="nodes:3x2"))])
def test_node_aware_is_the_node_sums_exchanged_between_nodes(nodes, per_node, hvd_torch):
    """exchange='node_aware': QSGD, and top-k over 3 steps with its residuals through a checkpoint, bitwise the
    codecs-alone reference on every rank (2 nodes: the nodes' allgather; 3 nodes: their two stages); the bytes
    kept in the node as the formula says; a tensor whose length differs on one rank refused on every rank."""
    import io

    import torch
    from horovod_qsgd.codecs import QSGDCodec, TopKCodec
    from horovod_qsgd.common.errors import CompressionMismatchError
    from horovod_qsgd.torch import QSGD, TopK
    hvd, ranks = hvd_torch, nodes * per_node
    rank = hvd.rank()
    numel = 200_003  # shards above the two stages' threshold: 3 nodes take them
    grads = [gradient(r, numel) for r in range(ranks)]
    qsgd = QSGD(bits=4, exchange="node_aware", min_numel=0)
    # three in flight at once (one grouped call compresses all before it waits): their steps interleave
    got = hvd.grouped_allreduce([torch.from_numpy(grads[rank] * (i + 1)) for i in range(3)], name="w", op=hvd.Sum,
                                compression=qsgd)
    for i in range(3):
        want = node_aware_reference(QSGDCodec(bits=4), QSGDCodec(bits=4), f"w.{i}", [g * (i + 1) for g in grads], 0,
                                    512, per_node)
        assert np.array_equal(got[i].numpy(), want), i
    stats = qsgd.compression_stats()
    shard = -(-numel // (per_node * 512)) * 512
    assert stats["exchanges"] == {f"w.{i}": "node_aware" for i in range(3)}
    assert stats["bytes_sent_in_node"] == 3 * 4 * (2 * shard + 1) * (per_node - 1)
    assert stats["collectives_started"] == 3 * (3 if nodes == 2 else 4)  # in the node, between nodes (1 or 2), back

    codec, saved = TopKCodec(ratio=0.01), None
    residuals = [np.zeros(numel, np.float32) for _ in range(ranks)]
    owners = [np.zeros(np.subtract(*bounds(-(-numel // per_node), nodes, 1)[r // per_node][::-1]), np.float32)
              for r in range(ranks)]
    topk = TopK(ratio=0.01, exchange="node_aware")
    for step in range(4):
        if step == 2:  # resumed from a checkpoint: the same bits go on
            saved = io.BytesIO()
            torch.save(topk.state_dict(), saved)
            saved.seek(0)
            topk = TopK(ratio=0.01, exchange="node_aware")
            topk.load_state_dict(torch.load(saved, weights_only=False))
        grads = [gradient(r, numel, step) for r in range(ranks)]
        result = hvd.allreduce(torch.from_numpy(grads[rank]), name="t", op=hvd.Sum, compression=topk)
        want = node_aware_reference(codec, codec, "t", grads, step, 1, per_node, residuals,
                                    owners if nodes > 2 else None)
        assert np.array_equal(result.numpy(), want), step
    kept = topk.state_dict()["tensors"]["t"]
    assert np.array_equal(kept["residual"].numpy(), residuals[rank])
    assert np.abs(residuals[rank]).sum() > 0
    if nodes > 2:
        assert kept["owner_layout"] == [nodes, per_node, rank // per_node, rank % per_node]
        assert np.array_equal(kept["owner_residual"].numpy(), owners[rank])
    gathered = hvd.allgather(result.reshape(1, -1), name="check")
    assert all(torch.equal(gathered[0], gathered[r]) for r in range(ranks))

    auto = QSGD(bits=4, min_numel=0)  # "auto" keeps CPU tensors node-blind (measured slower node-aware here)
    hvd.allreduce(torch.from_numpy(grads[rank]), name="a", op=hvd.Sum, compression=auto)
    assert auto.compression_stats()["exchanges"] == {"a": "two_stage"}

    length = numel + (4096 if rank == ranks - 1 else 0)  # the last rank's tensor is longer
    with pytest.raises((CompressionMismatchError, RuntimeError), match="horovod_qsgd: tensor 'odd"):
        hvd.allreduce(torch.ones(length), name="odd", op=hvd.Sum, compression=QSGD(exchange="node_aware"))
