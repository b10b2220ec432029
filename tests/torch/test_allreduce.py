"""hvd.allreduce / grouped_allreduce with compression=, pass-through rules, dtypes and statistics."""
import pytest

from tests.multirank import init_with_process_sets

SHARED_LAUNCHES = "horovod.torch"  # a launch per rank count and env with the torch modules (tests/multirank.py)


@pytest.mark.ranks(2)
def test_integer_small_and_large_tensors(hvd_torch):
    import torch
    from horovod_qsgd.torch import QSGD
    hvd = hvd_torch
    compressor = QSGD(bits=8, min_numel=1000)
    ints = hvd.allreduce(torch.arange(5000) * (hvd.rank() + 1), name="ints", op=hvd.Sum,
                         compression=compressor)
    assert torch.equal(ints, torch.arange(5000) * 3)  # non-float: exact ordinary allreduce
    small = hvd.allreduce(torch.full((999,), 0.5 + hvd.rank()), name="small", op=hvd.Sum,
                          compression=compressor)
    assert torch.equal(small, torch.full((999,), 2.0))  # below min_numel: exact
    stats = compressor.compression_stats(reset=True)
    assert stats["tensors_passed_through"] == 2 and stats["tensors_compressed"] == 0

    # A constant tensor quantizes exactly at any level count (every value equals the bucket max).
    big = hvd.allreduce(torch.full((1000, 3), 0.25), name="big", op=hvd.Average, compression=compressor)
    assert big.shape == (1000, 3) and big.dtype == torch.float32
    assert torch.equal(big, torch.full((1000, 3), 0.25))
    stats = compressor.compression_stats()
    assert stats["tensors_compressed"] == 1
    # 3000 coordinates: 16-byte header + 6 fp32 scales + 3000 bytes of 8-bit codes, plus the placeholder.
    assert stats["bytes_sent"] == 16 + 6 * 4 + 3000 + 4
    assert stats["bytes_uncompressed"] == 12000


@pytest.mark.ranks(2)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_gradients(hvd_torch, dtype):
    import torch
    from horovod_qsgd.torch import QSGD
    dtype = getattr(torch, dtype)
    x = torch.full((4096,), 0.5, dtype=dtype)
    out = hvd_torch.allreduce(x, name="half", op=hvd_torch.Sum, compression=QSGD(bits=4, min_numel=0))
    assert out.dtype == dtype and torch.equal(out, torch.full((4096,), 1.0, dtype=dtype))


@pytest.mark.ranks(3)
def test_grouped_allreduce_names_each_member(hvd_torch):
    import torch
    from horovod_qsgd.torch import TopK
    hvd = hvd_torch
    tensors = [torch.zeros(20000), torch.zeros(30000)]
    tensors[0][7] = hvd.rank() + 1.0
    tensors[1][11] = 2.0
    out = hvd.grouped_allreduce(tensors, name="grp", op=hvd.Sum, compression=TopK(ratio=0.001))
    assert out[0][7].item() == 6.0 and out[0].count_nonzero().item() == 1
    assert out[1][11].item() == 6.0 and out[1].count_nonzero().item() == 1


@pytest.mark.ranks(2)
def test_random_k_sums_the_same_coordinates(hvd_torch):
    import torch
    from horovod_qsgd.torch import RandomK
    hvd = hvd_torch
    compressor = RandomK(ratio=0.01)
    x = torch.arange(50000, dtype=torch.float32) * (hvd.rank() + 1)
    out = hvd.allreduce(x, name="rk", op=hvd.Sum, compression=compressor)
    picked = out.nonzero().reshape(-1)
    assert picked.numel() == 500 or (picked.numel() == 499 and out[0] == 0)
    assert torch.equal(out[picked], picked.float() * 3)
    stats = compressor.compression_stats()
    assert stats["bytes_sent"] == 500 * 4 and stats["bytes_uncompressed"] == 200000


@pytest.mark.ranks(2)
def test_random_k_fp16_values_travel_as_fp16(hvd_torch):
    import torch
    from horovod_qsgd.torch import RandomK
    hvd = hvd_torch
    compressor = RandomK(ratio=0.01, value_dtype="float16")
    # multiples of 1/4 below 512: exact in fp16, and so are the two ranks' sums
    x = (torch.arange(50000) % 500).float() / 4 * (hvd.rank() + 1)
    out = hvd.allreduce(x, name="rk16", op=hvd.Sum, compression=compressor)
    assert out.dtype == torch.float32
    picked = out.nonzero().reshape(-1)
    assert 490 <= picked.numel() <= 500  # coordinates that are multiples of 500 are zero
    assert torch.equal(out[picked], (picked % 500).float() / 4 * 3)
    stats = compressor.compression_stats()
    assert stats["bytes_sent"] == 500 * 2 and stats["bytes_uncompressed"] == 200000


@pytest.mark.ranks(3, alone=True)  # hvd.init with a process set
def test_process_set_excludes_the_third_rank():
    import horovod.torch as hvd
    import torch
    from horovod_qsgd.torch import QSGD
    pair = hvd.ProcessSet([0, 1])
    init_with_process_sets(hvd, pair)
    torch.manual_seed(0)
    model = torch.nn.Linear(200, 100)  # 20000 weights: compressed
    compressor = QSGD(bits=8)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=compressor,
                                   op=hvd.Sum, process_set=pair)
    model.weight.grad = torch.full((100, 200), 0.5)
    model.bias.grad = torch.full((100,), 0.5)
    if hvd.rank() == 2:
        # Not in the process set: the pair must not wait for it. It stays in a global barrier meanwhile, since a
        # rank that exits shuts Horovod down for the others (their synchronize then failed now and then).
        hvd.barrier()
        return
    try:
        opt.synchronize()
        assert torch.equal(model.weight.grad, torch.full((100, 200), 1.0))  # summed over 2 ranks, not 3
        assert torch.equal(model.bias.grad, torch.full((100,), 1.0))
        assert compressor.compression_stats()["tensors_compressed"] == 1
    finally:
        hvd.barrier()


@pytest.mark.parametrize("num_ranks", [pytest.param(2, marks=pytest.mark.ranks(2)),
                                       pytest.param(3, marks=pytest.mark.ranks(3))])
def test_min_max_product_give_horovods_result_with_a_warning(hvd_torch, num_ranks):
    import warnings
    import torch
    from horovod_qsgd.torch import QSGD, RandomK, TopK
    hvd = hvd_torch
    assert hvd.size() == num_ranks
    mine = torch.full((20000,), float(hvd.rank() + 1))  # compressed size: the payload would sum these
    factorial = float(torch.arange(1, num_ranks + 1).prod())
    for compressor in (QSGD(bits=4), TopK(ratio=0.01), RandomK(ratio=0.01)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = {op: hvd.allreduce(mine, name=f"{type(compressor).__name__}.{op}", op=getattr(hvd, op),
                                         compression=compressor) for op in ("Max", "Min", "Product")}
            again = hvd.allreduce(mine, name="max.again", op=hvd.Max, compression=compressor)
        assert torch.equal(results["Max"], torch.full((20000,), float(num_ranks)))
        assert torch.equal(results["Min"], torch.ones(20000))
        assert torch.equal(results["Product"], torch.full((20000,), factorial))
        assert torch.equal(again, results["Max"])
        messages = [str(w.message) for w in caught if "compressed payloads cannot serve" in str(w.message)]
        assert len(messages) == 3, messages  # once per op and compressor
        assert all("uncompressed" in m and "Compression.none" in m for m in messages), messages
        # the summing ops still compress
        total = hvd.allreduce(mine, name=f"{type(compressor).__name__}.sum", op=hvd.Sum, compression=compressor)
        assert compressor.compression_stats()["tensors_compressed"] == 1
        if isinstance(compressor, QSGD):  # a constant gradient: 4-bit levels give it exactly
            assert torch.equal(total, torch.full((20000,), num_ranks * (num_ranks + 1) / 2))


@pytest.mark.parametrize("num_ranks", [pytest.param(2, marks=pytest.mark.ranks(2)),
                                       pytest.param(3, marks=pytest.mark.ranks(3))])
def test_random_k_resumed_on_rank_0_alone_draws_the_same_coordinates_everywhere(hvd_torch, num_ranks):
    """The "load on rank 0, then broadcast" recipe: only rank 0 loads the compressor's state (its step counters);
    the first step aligns every rank's counters to rank 0's, so every rank sums the same coordinates."""
    import torch
    from horovod_qsgd.torch import RandomK
    hvd = hvd_torch
    x = torch.arange(1, 50001, dtype=torch.float32) * (hvd.rank() + 1)
    trained = RandomK(ratio=0.01)
    for _ in range(3):
        hvd.allreduce(x, name="rk.resume", op=hvd.Sum, compression=trained)
    saved = trained.state_dict()
    resumed = RandomK(ratio=0.01)
    if hvd.rank() == 0:
        resumed.load_state_dict(saved)
    out = hvd.allreduce(x, name="rk.resume", op=hvd.Sum, compression=resumed)
    assert resumed.step_counters() == {"rk.resume": 4}
    picked = out.nonzero().reshape(-1)
    assert picked.numel() == 500
    total = num_ranks * (num_ranks + 1) / 2  # every rank's values at the same coordinates, summed
    assert torch.equal(out[picked], (picked + 1).float() * total)
    everyone = hvd.allgather(out.reshape(1, -1), name="rk.resume.results")
    assert all(torch.equal(everyone[0], row) for row in everyone)
    # the coordinates are those the uninterrupted compressor draws at its fourth step
    assert torch.equal(hvd.allreduce(x, name="rk.resume", op=hvd.Sum, compression=trained), out)
