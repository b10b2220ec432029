"""Ranks on one machine share its cores: the compressors size their kernels' thread pools."""
import pytest


@pytest.mark.ranks(2, env={"NUMBA_NUM_THREADS": None})
def test_ranks_on_one_machine_share_its_cores(hvd_tf):
    import tensorflow as tf
    from horovod_qsgd import kernels
    from horovod_qsgd.common.threads import available_cores
    from horovod_qsgd.tensorflow import QSGD
    assert not kernels.cpu_threads_chosen()
    hvd_tf.allreduce(tf.ones([20000]), name="t", compression=QSGD())
    assert hvd_tf.local_size() == 2
    assert kernels.cpu_threads() == max(1, available_cores() // 2)
