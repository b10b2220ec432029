"""Ranks on one machine share its cores: the compressors size their kernels' thread pools and warn
when TensorFlow's default pools (a thread per core) oversubscribe the cores."""
import warnings

import pytest

SHARED_LAUNCHES = "horovod.tensorflow"  # a launch per rank count and env with the TF modules (tests/multirank.py)


@pytest.mark.ranks(2, env={"NUMBA_NUM_THREADS": None, "TF_NUM_INTRAOP_THREADS": None})
def test_ranks_on_one_machine_share_its_cores_and_default_tf_threads_warn(hvd_tf):
    import tensorflow as tf
    from horovod_qsgd import kernels
    from horovod_qsgd.common.threads import available_cores
    from horovod_qsgd.tensorflow import QSGD
    assert not kernels.cpu_threads_chosen()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hvd_tf.allreduce(tf.ones([20000]), name="t", compression=QSGD())
    assert hvd_tf.local_size() == 2
    assert kernels.cpu_threads() == max(1, available_cores() // 2)
    cores = available_cores()
    found = [str(w.message) for w in caught if "intra-op threads" in str(w.message)]
    assert len(found) == 1 and found[0].startswith(
        f"horovod_qsgd: 2 ranks on this machine each run TensorFlow with {cores} intra-op threads: "
        f"{2 * cores} threads for {cores} cores."), found
    assert found[0].endswith(f"Fix: TF_NUM_INTRAOP_THREADS={max(1, cores // 2)} and TF_NUM_INTEROP_THREADS=1 in "
                             "the environment (or tf.config.threading.set_intra_op_parallelism_threads("
                             f"{max(1, cores // 2)})) in each rank."), found
