"""A step whose gradient holds inf or NaN on any rank: non-finite everywhere, and no trace in the state."""
import pytest

from horovod_qsgd.torch_shared.feedback import DEVICE_VERDICT_ENV
from tests.nonfinite_cases import (assert_same_state, check_a_partial_overflow_keeps_nothing_of_the_step,
                                   check_discarded_steps, check_steps_right_after_a_discarded_one,
                                   check_training_through_overflows, make_compressor, residuals)

SHARED_LAUNCHES = "horovod.torch"  # a launch per rank count and env with the torch modules (tests/multirank.py)


def _compressor(kind, exchange):
    import horovod_qsgd.torch as adapter
    return make_compressor(adapter, kind, exchange)


def _assert_equal_on_all_ranks(hvd, tensor, what):
    import torch
    rows = hvd.allgather(tensor.reshape(1, -1), name=f"check.{what}")
    assert all(torch.equal(rows[0], row) for row in rows), f"{what} differs between ranks"


def _check_discarded_steps(hvd):
    import torch

    def reduce(compressor, name, grad):
        return hvd.allreduce(torch.from_numpy(grad), name=name, compression=compressor, op=hvd.Sum).numpy()

    check_discarded_steps(_compressor, hvd.rank(), hvd.size(), reduce,
                          lambda array, tag: hvd.allgather(torch.from_numpy(array[None]), name=tag).numpy())
    check_steps_right_after_a_discarded_one(_compressor, hvd.rank(), reduce)

    def reduce_pair(compressor, tag, grads):
        sums = hvd.grouped_allreduce([torch.from_numpy(g) for g in grads], name=tag, compression=compressor,
                                     op=hvd.Sum)
        return [t.numpy() for t in sums]

    check_a_partial_overflow_keeps_nothing_of_the_step(_compressor, hvd.rank(), reduce_pair)


@pytest.mark.ranks(2, timeout=240)
def test_nonfinite_steps_are_discarded_on_two_ranks(hvd_torch):
    _check_discarded_steps(hvd_torch)


@pytest.mark.ranks(3, timeout=300)
def test_nonfinite_steps_are_discarded_on_three_ranks(hvd_torch):
    _check_discarded_steps(hvd_torch)


@pytest.mark.ranks(3, timeout=300)
def test_nonfinite_steps_are_discarded_when_the_verdict_is_stamped_as_on_a_gpu(hvd_torch, monkeypatch):
    """The GPU's settling (the verdict stamped by the finishing pass, read by the next step's first pass, two
    buffers whose roles never swap on the host) run on CPU tensors through whole Horovod steps: allgather and
    two stages, every compressor, the same state and results as deciding on the host. (The variable is read
    where a tensor's stamps are made, so setting it here, in the shared 3-rank launch, is enough.)"""
    monkeypatch.setenv(DEVICE_VERDICT_ENV, "1")
    _check_discarded_steps(hvd_torch)


def _train_with_scaler(hvd, kind, exchange, steps=60, overflow_steps=(3, 4, 20), leave_out=False):
    """Trains a small MLP with a real GradScaler; at ``overflow_steps`` rank 1's loss overflows
    (``leave_out``: those steps are not run at all).

    Returns (final loss over every rank's data, the compressor or None).
    """
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    compressor = None if kind == "none" else _compressor(kind, exchange)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
        compression=compressor or hvd.Compression.none)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    generator = torch.Generator().manual_seed(100 + hvd.rank())
    inputs = torch.randn(256, 64, generator=generator)
    targets = torch.sin(inputs[:, :1] * 2) + inputs[:, 1:2] * 0.5
    name = "0.weight"
    for step in range(steps):
        batch = slice(32 * (step % 8), 32 * (step % 8 + 1))
        if leave_out and step in overflow_steps:
            continue
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs[batch]), targets[batch])
        overflow = step in overflow_steps
        if overflow and hvd.rank() == 1:
            loss = loss * float("inf")  # what an fp16 overflow leaves in the gradients of one rank
        scaler.scale(loss).backward()
        optimizer.synchronize()
        scaler.unscale_(optimizer)
        before = [p.detach().clone() for p in model.parameters()]
        state = residuals(compressor, name) if compressor is not None and step > 0 else None
        with optimizer.skip_synchronize():
            scaler.step(optimizer)
        scale = scaler.get_scale()
        scaler.update()
        if overflow:  # skipped alike on every rank: parameters and error feedback as before the step
            assert all(torch.equal(b, p) for b, p in zip(before, model.parameters())), f"{kind}: step {step} ran"
            assert scaler.get_scale() == scale / 2, f"{kind}: the scaler saw no overflow at step {step}"
            if state is not None:
                assert_same_state(residuals(compressor, name), state)
        if compressor is not None:
            compressor.rescale_residuals(scaler.get_scale() / scale)  # residuals follow the loss scale
    for index, param in enumerate(model.parameters()):
        assert torch.isfinite(param).all()
        _assert_equal_on_all_ranks(hvd, param.detach(), f"{kind}.{exchange}.param{index}")
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
    return float(hvd.allreduce(loss, name=f"loss.{kind}.{exchange}", op=hvd.Average)), compressor


@pytest.mark.ranks(2, timeout=300)
def test_grad_scaler_skips_overflow_steps_alike_and_trains_like_uncompressed(hvd_torch):
    check_training_through_overflows(lambda kind, exchange, **kw: _train_with_scaler(hvd_torch, kind, exchange, **kw))
