"""Bad input and rank mismatches raise named errors on every rank, within the harness timeout."""
import pytest

SHARED_LAUNCHES = "horovod.torch"  # a launch per rank count and env with the torch modules (tests/multirank.py)


@pytest.mark.ranks(2, timeout=120)
def test_different_bits_on_two_ranks_is_reported_on_every_rank(hvd_torch):
    import torch
    from horovod_qsgd.common.errors import CompressionMismatchError
    from horovod_qsgd.torch import QSGD
    hvd = hvd_torch
    compressor = QSGD(bits=4 if hvd.rank() == 0 else 8)
    with pytest.raises(CompressionMismatchError) as info:
        hvd.allreduce(torch.ones(20000), name="grad", compression=compressor)
    message = str(info.value)
    assert "codec.bits" in message or "settings.bits" in message, message
    assert "rank 0=4" in message and "rank 1=8" in message


@pytest.mark.ranks(2, timeout=120)
def test_different_shapes_name_the_tensor_on_every_rank(hvd_torch):
    import torch
    from horovod_qsgd.common.errors import CompressionMismatchError
    from horovod_qsgd.torch import QSGD
    hvd = hvd_torch
    numel = 20000 if hvd.rank() == 0 else 24000
    with pytest.raises(CompressionMismatchError) as info:
        hvd.allreduce(torch.ones(numel), name="layer.weight", compression=QSGD(bits=4))
    message = str(info.value)
    assert "'layer.weight'" in message and "elements" in message, message


@pytest.mark.ranks(2, timeout=120)
def test_adasum_is_refused(hvd_torch):
    import torch
    from horovod_qsgd.common.errors import UnsupportedCollectiveError
    from horovod_qsgd.torch import QSGD
    with pytest.raises(UnsupportedCollectiveError, match="Adasum"):
        hvd_torch.allreduce(torch.ones(20000), name="g", op=hvd_torch.Adasum, compression=QSGD())


@pytest.mark.ranks(2, timeout=120)
def test_adasum_optimizer_is_refused_on_every_rank(hvd_torch):
    import torch
    from horovod_qsgd.common.errors import UnsupportedCollectiveError
    from horovod_qsgd.torch import QSGD, TopK
    hvd = hvd_torch
    for compressor in (QSGD(), TopK()):
        model = torch.nn.Linear(200, 100)  # 20,000 weights to compress, 100 biases to pass through
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=model.named_parameters(), op=hvd.Adasum,
                                             compression=compressor)
        # Horovod's Adasum optimizer used to meet an AttributeError ('SGD' object has no attribute 'op')
        with pytest.raises(UnsupportedCollectiveError, match="Adasum"):
            model(torch.ones(4, 200)).sum().backward()
        del optimizer
    assert hvd.allreduce(torch.ones(3), name="after", op=hvd.Sum).tolist() == [2.0] * 3  # nothing left waiting


@pytest.mark.ranks(2, timeout=120)
def test_allreduce_without_name_is_refused_for_compressed_tensors(hvd_torch):
    import torch
    from horovod_qsgd.torch import QSGD
    compressor = QSGD()
    small = hvd_torch.allreduce(torch.ones(10), compression=compressor, op=hvd_torch.Sum)
    assert torch.equal(small, torch.full((10,), 2.0))  # below min_numel: passed through
    with pytest.raises(ValueError, match="needs name="):
        hvd_torch.allreduce(torch.ones(20000), compression=compressor)


def test_invalid_arguments_name_the_argument():
    pytest.importorskip("horovod.torch")
    from horovod_qsgd.torch import QSGD, TopK
    with pytest.raises(ValueError, match="bits"):
        QSGD(bits=9)
    with pytest.raises(ValueError, match="selector"):
        TopK(selector="fastest")
    with pytest.raises(ValueError, match="min_numel"):
        QSGD(min_numel=-1)
