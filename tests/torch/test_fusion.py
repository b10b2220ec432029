"""Fused exchanges under horovodrun: the same bits as one tensor at a time, fewer collectives.

Each rank trains two copies of a model, one with a compressor that fuses its
tensors (the default) and one with ``fusion_threshold=0`` (every two-stage
tensor its own alltoall and allgather, every allgather tensor its own
allgather); both must give the reference built from every rank's gradients
with the codecs alone. Autograd's hooks fire in another order on each rank,
so the groups must not depend on the order of arrival.
"""
import gc
import inspect

import numpy as np
import pytest

from tests.two_stage_reference import allgathered_training, averaged_training
from tests.two_stage_reference import gradient as _gradient

SHARED_LAUNCHES = "horovod.torch"  # a launch per rank count and env with the torch modules (tests/multirank.py)

# 100_003 and 70_001: no multiple of the ranks or the bucket; 1_000: fewer buckets than 4 ranks (owners of nothing).
SIZES = (100_003, 70_001, 1_000, 512 * 40)
CASES = [pytest.param(n, kind, marks=pytest.mark.ranks(n, timeout=240)) for n, kind in
         ((3, "qsgd"), (4, "qsgd"), (3, "topk"), (4, "topk"))]


def _train(hvd, compressor, steps):
    """The averaged gradients and compressor state of each step (gradients fixed per rank, hooks reordered)."""
    import torch
    params = [torch.nn.Parameter(torch.zeros(n)) for n in SIZES]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.5), compression=compressor,
                                   named_parameters=[(f"layer{i}.weight", p) for i, p in enumerate(params)])
    order = [(i + hvd.rank()) % len(params) for i in range(len(params))]
    history = []
    for step in range(steps):
        opt.zero_grad()
        loss = 0
        for i in order:
            coefficients = torch.from_numpy(_gradient(hvd.rank(), SIZES[i], 10 * step + i))
            loss = loss + (params[i] * coefficients).sum()
        loss.backward()
        opt.step()
        stats = compressor.compression_stats(reset=True)
        history.append(([p.grad.clone() for p in params], compressor.state_dict(), stats))
    return history


def _compressor(kind, exchange="two_stage", **kwargs):
    from horovod_qsgd.torch import QSGD, TopK
    if kind == "qsgd":
        return QSGD(bits=4, exchange=exchange, min_numel=0, **kwargs)
    return TopK(ratio=0.02, exchange=exchange, min_numel=0, **kwargs)


def _assert_the_same_training(fused, alone, wanted, fields):
    """Asserts that two :func:`_train` histories have the same gradients, equal to ``wanted`` (the codecs
    alone), and the same state ``fields`` and step counters at every step; returns each step's (fused, alone)
    statistics."""
    import torch
    for step, ((g_fused, s_fused, _), (g_alone, s_alone, _)) in enumerate(zip(fused, alone)):
        for i, (a, b) in enumerate(zip(g_fused, g_alone)):
            assert torch.equal(a, b), (step, i)
            assert np.array_equal(a.numpy(), wanted[step][i]), (step, i)
        for name, state in s_alone["tensors"].items():
            for field in fields:
                if state[field] is None:
                    assert s_fused["tensors"][name][field] is None
                else:
                    assert torch.equal(s_fused["tensors"][name][field], state[field]), (step, name, field)
            assert s_fused["tensors"][name]["step"] == state["step"] == step + 1
    return [(st_fused, st_alone) for (_, _, st_fused), (_, _, st_alone) in zip(fused, alone)]


@pytest.mark.parametrize("num_ranks, kind", CASES)
def test_fused_training_is_bitwise_the_unfused_one_with_two_collectives_a_step(hvd_torch, num_ranks, kind):
    hvd = hvd_torch
    steps = 3
    fused = _train(hvd, _compressor(kind), steps)
    alone = _train(hvd, _compressor(kind, fusion_threshold=0), steps)
    stats = _assert_the_same_training(fused, alone, averaged_training(kind, SIZES, num_ranks, steps),
                                      ("residual", "owner_residual"))
    for step, ((_, s_fused, _), (st_fused, st_alone)) in enumerate(zip(fused, stats)):
        if kind == "topk":
            assert any(s["owner_residual"].abs().sum() > 0 for s in s_fused["tensors"].values())
        # One alltoall and one allgather a step for all four tensors, against two per tensor.
        assert st_fused["collectives_started"] == 2 and st_alone["collectives_started"] == 2 * len(SIZES), step
        assert st_fused["tensors_two_stage"] == st_alone["tensors_two_stage"] == len(SIZES)
        # The same payloads: only the manifests differ, 16 bytes per peer and group in the first stage and
        # 16 per group in the second.
        saved = (len(SIZES) - 1) * 16
        assert st_alone["bytes_sent_first_stage"] - st_fused["bytes_sent_first_stage"] == saved * (num_ranks - 1)
        assert st_alone["bytes_sent_second_stage"] - st_fused["bytes_sent_second_stage"] == saved


ALLGATHER_CASES = [pytest.param(n, kind, marks=pytest.mark.ranks(n, timeout=240)) for n, kind in
                   ((2, "qsgd"), (2, "topk"), (3, "qsgd"), (4, "topk"))]


def _gpu_allgather_groups_on_the_host(monkeypatch):
    """The host's allgather tensors fused as a GPU's are (ALLGATHER_GROUP_NBYTES): the same code path."""
    from horovod_qsgd.common.fusion import ALLGATHER_GROUP_NBYTES
    monkeypatch.setitem(ALLGATHER_GROUP_NBYTES, "cpu", ALLGATHER_GROUP_NBYTES["cuda"])


@pytest.mark.parametrize("num_ranks, kind", ALLGATHER_CASES)
def test_fused_allgathers_are_bitwise_the_unfused_ones_in_one_collective_a_step(hvd_torch, num_ranks, kind,
                                                                                monkeypatch):
    # Issue #51: a group's payloads are encoded together and decoded together (one launch sequence each on a
    # GPU, whatever the tensor count) and travel in one allgather; each payload is byte for byte the same.
    hvd = hvd_torch
    _gpu_allgather_groups_on_the_host(monkeypatch)
    steps = 3
    fused = _train(hvd, _compressor(kind, exchange="allgather"), steps)
    alone = _train(hvd, _compressor(kind, exchange="allgather", fusion_threshold=0), steps)
    stats = _assert_the_same_training(fused, alone, allgathered_training(kind, SIZES, num_ranks, steps),
                                      ("residual",))
    for step, ((_, s_fused, _), (st_fused, st_alone)) in enumerate(zip(fused, stats)):
        assert all((state["residual"] is None) == (kind == "qsgd") for state in s_fused["tensors"].values())
        assert st_fused["collectives_started"] == 1 and st_alone["collectives_started"] == len(SIZES), step
        assert st_fused["tensors_compressed"] == st_alone["tensors_compressed"] == len(SIZES)
        assert st_fused["exchanges"] == st_alone["exchanges"] == {f"layer{i}.weight": "allgather"
                                                                 for i in range(len(SIZES))}
        assert st_fused["bytes_sent"] - st_alone["bytes_sent"] == 16, step  # this rank's manifest


@pytest.mark.ranks(3, timeout=120)
@pytest.mark.parametrize("exchange, threshold", [("two_stage", 25_000), ("allgather", 200_000)])
def test_a_small_threshold_splits_the_step_into_groups_with_the_same_bits(hvd_torch, exchange, threshold,
                                                                          monkeypatch):
    # 20_000 fp32 values at 4 bits are 10_208 bytes of first-stage payload (3 chunks), which a two-stage group
    # counts: two fit under 25_000; an allgather group counts their 80_000 bytes of float32: two fit under 200_000.
    import torch
    from horovod_qsgd.torch import QSGD
    hvd = hvd_torch
    _gpu_allgather_groups_on_the_host(monkeypatch)
    compressor = QSGD(bits=4, exchange=exchange, min_numel=0, fusion_threshold=threshold)
    assert compressor.settings()["fusion_threshold"] == threshold
    tensors = {f"t{i}": torch.from_numpy(_gradient(hvd.rank(), 20_000, i)) for i in range(5)}
    gc.collect()
    gc.disable()  # what a step leaves behind must go by reference counting: a cycle kept every step's buffers
    try:
        results = hvd.grouped_allreduce(list(tensors.values()), name="five", compression=compressor)
        left = [o for o in gc.get_objects() if type(o).__name__ in ("_Fused", "_Group")
                or (inspect.isgenerator(o) and o.gi_code.co_name in ("conduct", "conduct_members", "_gather"))]
    finally:
        gc.enable()
    assert not left, left
    stats = compressor.compression_stats()
    collectives = 2 if exchange == "two_stage" else 1
    assert stats["tensors_two_stage"] == (5 if exchange == "two_stage" else 0)
    assert stats["collectives_started"] == collectives * 3  # groups of 2, 2 and 1
    alone = QSGD(bits=4, exchange=exchange, min_numel=0, fusion_threshold=0)
    expected = hvd.grouped_allreduce(list(tensors.values()), name="five", compression=alone)
    assert all(torch.equal(a, b) for a, b in zip(results, expected))


@pytest.mark.ranks(2, timeout=120)
def test_allgather_tensors_go_alone_on_the_host_and_in_groups_of_25_mib_on_a_gpu(hvd_torch, monkeypatch):
    # On the host each allgather tensor has its own collective, as before fusion; a GPU's groups hold up to
    # 25 MiB of float32 gradient, and a larger tensor is a group of its own.
    import torch
    from horovod_qsgd.torch import QSGD
    hvd = hvd_torch
    sizes = (7_000_000, 1000, 2000)  # 28 MB of gradient: alone; then two that fit together
    tensors = [torch.from_numpy(_gradient(hvd.rank(), n, i)) for i, n in enumerate(sizes)]
    host = QSGD(bits=4, exchange="allgather", min_numel=0)
    alone = QSGD(bits=4, exchange="allgather", min_numel=0, fusion_threshold=0)
    expected = [hvd.grouped_allreduce(tensors, name="sized", compression=alone) for step in range(2)]
    got = [hvd.grouped_allreduce(tensors, name="sized", compression=host) for step in range(2)]
    assert all(torch.equal(a, b) for step in range(2) for a, b in zip(got[step], expected[step]))
    assert host.compression_stats()["collectives_started"] == alone.compression_stats()["collectives_started"] == 6
    _gpu_allgather_groups_on_the_host(monkeypatch)
    gpu = QSGD(bits=4, exchange="allgather", min_numel=0)
    for step in range(2):  # the first round's groups, then the learned ones
        results = hvd.grouped_allreduce(tensors, name="sized", compression=gpu)
        assert gpu.compression_stats(reset=True)["collectives_started"] == 2, step
        assert all(torch.equal(a, b) for a, b in zip(results, expected[step])), step


@pytest.mark.ranks(3, timeout=120)
def test_two_compressors_fuse_in_the_same_step_without_sharing_collectives(hvd_torch):
    # Two optimizers (a GAN's, or two parts of a model), each with its own compressor, in one backward pass:
    # both have a group in flight at once and each counts its groups from 1. Under the same collective names
    # Horovod refused the second alltoall ("a tensor with the same name ... is currently being processed").
    import torch
    from horovod_qsgd.torch import QSGD
    hvd = hvd_torch
    params = [torch.nn.Parameter(torch.zeros(20_000)) for _ in range(2)]
    compressors = [QSGD(bits=4, exchange="two_stage", min_numel=0) for _ in params]
    optimizers = [hvd.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), named_parameters=[(f"model{i}.w", p)],
                                           compression=c) for i, (p, c) in enumerate(zip(params, compressors))]
    for step in range(2):
        for optimizer in optimizers:
            optimizer.zero_grad()
        sum((p * torch.from_numpy(_gradient(hvd.rank(), 20_000, 10 * step + i))).sum()
            for i, p in enumerate(params)).backward()
        for optimizer in optimizers:
            optimizer.step()
    for p in params:
        everyone = hvd.allgather(p.detach().reshape(1, -1))
        assert all(torch.equal(everyone[0], row) for row in everyone)
    assert [c.compression_stats()["collectives_started"] for c in compressors] == [4, 4]


@pytest.mark.ranks(3, timeout=120)
@pytest.mark.parametrize("exchange, what", [("two_stage", "first-stage slices"), ("allgather", "payloads")])
def test_a_rank_that_groups_otherwise_raises_on_every_rank_instead_of_hanging(hvd_torch, exchange, what,
                                                                               monkeypatch):
    # Rank 2's plan is forced apart from the others' (one tensor per group, a 1-byte limit): the groups' names
    # still meet, the manifests differ, and every rank raises.
    import torch
    from horovod_qsgd.common.errors import CompressionMismatchError
    from horovod_qsgd.common.fusion import Fuser
    hvd = hvd_torch
    _gpu_allgather_groups_on_the_host(monkeypatch)
    compressor = _compressor("qsgd", exchange=exchange)
    exchanges = compressor._exchanges
    tensors = [torch.from_numpy(_gradient(hvd.rank(), 20_000, i)) for i in range(3)]
    if hvd.rank() == 2:
        exchanges.fuser = Fuser(1, exchanges.fuser.namespace)
        exchanges.allgather_fusers["cpu"] = Fuser(1, exchanges.allgather_fuser(tensors[0].device).namespace)
    with pytest.raises(CompressionMismatchError) as info:
        hvd.grouped_allreduce(tensors, name=f"three.{exchange}", compression=compressor)
    message = str(info.value)
    assert f"group of {what} does not match this rank's" in message, message
    assert "the ranks grouped other tensors" in message, message
