"""Ranks on one machine share its cores: the compressors size their kernels' thread pools."""
import pytest


@pytest.mark.ranks(2, env={"NUMBA_NUM_THREADS": None})
def test_ranks_on_one_machine_share_its_cores(hvd_torch):
    import torch
    from horovod_qsgd import kernels
    from horovod_qsgd.common.threads import available_cores
    from horovod_qsgd.torch import QSGD
    assert not kernels.cpu_threads_chosen()
    hvd_torch.allreduce(torch.ones(20000), name="t", compression=QSGD())
    assert hvd_torch.local_size() == 2
    assert kernels.cpu_threads() == max(1, available_cores() // 2)


@pytest.mark.ranks(2)
def test_a_users_numba_threads_setting_is_kept(hvd_torch):
    import torch
    from horovod_qsgd import kernels
    from horovod_qsgd.torch import QSGD
    kernels.set_cpu_threads(1)
    assert kernels.cpu_threads_chosen()
    hvd_torch.allreduce(torch.ones(20000), name="t", compression=QSGD())
    assert kernels.cpu_threads() == 1
    kernels.set_cpu_threads(None)
    assert not kernels.cpu_threads_chosen()

