import pytest

pytest_plugins = ["tests.multirank"]


@pytest.fixture
def hvd_torch():
    """horovod.torch, initialised (inside a ranks-marked test: on every rank)."""
    import horovod.torch as hvd
    hvd.init()
    return hvd


@pytest.fixture
def hvd_tf():
    """horovod.tensorflow, initialised (inside a ranks-marked test: on every rank)."""
    import horovod.tensorflow as hvd
    hvd.init()
    return hvd
