import pytest

pytest_plugins = ["tests.multirank"]


@pytest.fixture
def hvd_torch():
    """horovod.torch, initialised (inside a ranks-marked test: on every rank)."""
    import horovod.torch as hvd
    hvd.init()
    return hvd


@pytest.fixture
def dist_gloo():
    """torch.distributed with the Gloo backend, initialised (inside a ranks(..., launcher="torchrun") test: on
    every rank). Once per worker: the tests of a shared launch use the same default group (initialised again
    after ``destroy_process_group``, the second test of a launch waited forever under torchrun)."""
    import torch.distributed as dist
    from tests.multirank import in_worker
    if not in_worker():  # the launching test: its body runs in the workers only
        return None
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist


@pytest.fixture
def hvd_tf():
    """horovod.tensorflow, initialised (inside a ranks-marked test: on every rank)."""
    import horovod.tensorflow as hvd
    hvd.init()
    return hvd
