"""Ranks on one machine share its cores: the compressors size their kernels' thread pools and warn
when the framework's own threads oversubscribe the cores."""
import warnings

import pytest

SHARED_LAUNCHES = True  # tests with the same rank count, env and launcher run in one launch (tests/multirank.py)


@pytest.mark.ranks(2, env={"NUMBA_NUM_THREADS": None})
def test_ranks_on_one_machine_share_its_cores(hvd_torch):
    import torch
    from horovod_qsgd import kernels
    from horovod_qsgd.common.threads import available_cores
    from horovod_qsgd.torch import QSGD
    assert not kernels.cpu_threads_chosen()
    assert torch.get_num_threads() * hvd_torch.local_size() <= available_cores()  # the harness's OMP_NUM_THREADS=1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hvd_torch.allreduce(torch.ones(20000), name="t", compression=QSGD())
    assert not [w for w in caught if "intra-op threads" in str(w.message)]
    assert hvd_torch.local_size() == 2
    assert kernels.cpu_threads() == max(1, available_cores() // 2)


@pytest.mark.ranks(2)
def test_a_users_numba_threads_setting_is_kept_and_oversubscribed_torch_threads_warn_once(hvd_torch):
    import torch
    from horovod_qsgd import kernels
    from horovod_qsgd.common.threads import available_cores
    from horovod_qsgd.torch import QSGD
    kernels.set_cpu_threads(1)
    assert kernels.cpu_threads_chosen()
    torch.set_num_threads(available_cores())  # as a script without OMP_NUM_THREADS gets: 2 ranks x all cores
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hvd_torch.allreduce(torch.ones(20000), name="t", compression=QSGD())
        hvd_torch.allreduce(torch.ones(20000), name="u", compression=QSGD())
    torch.set_num_threads(1)
    found = [str(w.message) for w in caught if "intra-op threads" in str(w.message)]
    cores = available_cores()
    assert found == [
        f"horovod_qsgd: 2 ranks on this machine each run PyTorch with {cores} intra-op threads: {2 * cores} "
        f"threads for {cores} cores. Oversubscribed threads slow every rank's compute and the compressors' kernels "
        "(measured with PyTorch, 2 ranks on 2 cores, 12.6M parameters, 1 Gbit/s: QSGD-4 3.05x and Gaussian-k 0.1% "
        "3.6x faster than uncompressed, against 4.4x and 7.2x with one thread per rank). Fix: "
        f"OMP_NUM_THREADS={max(1, cores // 2)} in the environment (or torch.set_num_threads({max(1, cores // 2)})) "
        "in each rank."]
    assert torch.get_num_threads() == 1  # the user's setting is theirs: only the test changed it
    assert kernels.cpu_threads() == 1
    kernels.set_cpu_threads(None)
    assert not kernels.cpu_threads_chosen()



@pytest.mark.ranks(2)
def test_optimizer_decodes_into_the_gradients_memory_and_allreduce_keeps_its_input(hvd_torch):
    import torch
    from horovod_qsgd.torch import RandomK, TopK
    for compressor in (TopK(ratio=0.01), RandomK(ratio=0.01)):
        torch.manual_seed(0)
        model = torch.nn.Linear(200, 100, bias=False)  # 20000 weights: compressed
        opt = hvd_torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=model.named_parameters(), compression=compressor)
        model(torch.full((4, 200), 1.0 + hvd_torch.rank())).sum().backward()
        memory = model.weight.grad.data_ptr()
        opt.synchronize()
        assert model.weight.grad.data_ptr() == memory

        grad = torch.randn(20000)
        kept = grad.clone()
        out = hvd_torch.allreduce(grad, name=f"input.{type(compressor).__name__}", compression=compressor)
        assert torch.equal(grad, kept) and out.data_ptr() != grad.data_ptr()
