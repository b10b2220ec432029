import pytest

pytest_plugins = ["tests.multirank"]


def _initialised(module_name):
    """The Horovod module ``module_name`` if this process imported and initialised it, else None."""
    import sys
    module = sys.modules.get(module_name)
    return module if module is not None and module.is_initialized() else None


def _init_after_the_other_framework(hvd, other_name, barrier):
    """``hvd.init()``, after a barrier of the other framework's Horovod where this process initialised it.

    Each framework's Horovod has its own Gloo contexts and meets in the same rendezvous scopes: a rank that
    started the second init while another was still finishing the first read that rank's first address and
    connected to it, and Gloo aborted the process in init (node-launcher CI runs). The barrier ends every
    rank's first rendezvous, whose keys the launcher's server then drops, before any rank starts the second.
    A broadcast: an allreduce asks the process set for its size, which importing the second framework
    re-binds to that framework's library, not yet initialised.
    """
    from tests.multirank import in_worker
    other = _initialised(other_name)
    if other is not None and in_worker() and not hvd.is_initialized():
        barrier(other)
    hvd.init()
    return hvd


@pytest.fixture
def hvd_torch():
    """horovod.torch, initialised (inside a ranks-marked test: on every rank)."""
    import horovod.torch as hvd

    def tensorflow_barrier(other):
        import tensorflow as tf
        other.broadcast(tf.constant(0.0), 0, name="tests.before_torch_init")
    return _init_after_the_other_framework(hvd, "horovod.tensorflow", tensorflow_barrier)


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

    def torch_barrier(other):
        import torch
        other.broadcast(torch.zeros(1), 0, name="tests.before_tensorflow_init")
    return _init_after_the_other_framework(hvd, "horovod.torch", torch_barrier)
