"""The DDP hooks' residual store where the verdicts are stamped as on a GPU, one process, the buckets' steps
interleaved as Gloo's threads and a GPU's streams interleave them: a bucket's result is finished (its stamps
written) while the hook call of a later bucket of the same iteration gathers residuals after DDP's rebuild."""
import numpy as np
import pytest
import torch

from horovod_qsgd.common.feedback import StepVerdict
from horovod_qsgd.ddp.feedback import BucketFeedback
from horovod_qsgd.kernels import finish_sum
from horovod_qsgd.kernels.select import ef_accumulate
from horovod_qsgd.kernels._arrays import split_residual
from horovod_qsgd.torch_shared.arrays import as_array
from horovod_qsgd.torch_shared.feedback import DEVICE_VERDICT_ENV, mark_step_on_device

NUMEL = 8
CPU = torch.device("cpu")


@pytest.fixture
def stamped(monkeypatch):
    monkeypatch.setenv(DEVICE_VERDICT_ENV, "1")


def _start(feedback, index, layout, gradient):
    """A bucket's first pass, by the error-feedback kernels' own accumulate: reads the residual where the
    stamps say, writes gradient + residual (all of it unsent) as the new one. Returns (stamps, stamp) for its
    finish."""
    carried, stamps, stamp = feedback.residual(index, layout, gradient.numel(), CPU)
    target, (source, how) = split_residual(as_array(carried))
    ef_accumulate(gradient.numpy(), target, source, how)
    return stamps, stamp


def _finish(verdict, index, stamps, stamp, finite):
    total = torch.full((NUMEL,), 1.0 if finite else np.inf)
    finish_sum(as_array(total), 1.0, stamps=as_array(stamps), stamp=stamp + 1, counter=np.zeros(1, np.int64))
    verdict.defer_on_device(index, (stamps, stamp + 1))


FIRST = [torch.arange(NUMEL, dtype=torch.float32) + 1, torch.arange(NUMEL, dtype=torch.float32) + 100]
SECOND = [torch.full((NUMEL,), 0.5), torch.full((NUMEL,), 0.25)]


def _first_iteration():
    """One bucket of parameters 0 and 1, its result finite: (the store, the verdict)."""
    feedback, verdict = BucketFeedback(), StepVerdict(mark_step_on_device)
    stamps, stamp = _start(feedback, 0, [(0, 0, NUMEL), (1, NUMEL, NUMEL)], torch.cat(FIRST))
    _finish(verdict, 0, stamps, stamp, finite=True)
    return feedback, verdict


def _rebuilt_iteration(feedback, verdict, last_finite=True):
    """Bucket 0 holds parameter 1 and finishes before bucket 1 (parameter 0) gathers its residual."""
    verdict.settle()  # as the iteration's first hook call does
    feedback.steps_over()
    stamps0, stamp0 = _start(feedback, 0, [(1, 0, NUMEL)], SECOND[1])
    _finish(verdict, 0, stamps0, stamp0, finite=True)
    stamps1, stamp1 = _start(feedback, 1, [(0, 0, NUMEL)], SECOND[0])
    _finish(verdict, 1, stamps1, stamp1, finite=last_finite)


def test_a_bucket_finished_before_a_later_bucket_gathers_still_waits_for_the_iterations_verdict(stamped):
    """Iteration 0: one bucket of parameters 0 and 1. Iteration 1 (DDP rebuilt the buckets): bucket 0 holds
    parameter 1 and finishes finite before bucket 1 (parameter 0) gathers its residual; bucket 1's result is
    inf, so the iteration does not count and no residual keeps anything of it. (A gather that settled every
    bucket on the host settled bucket 0 by its own finite stamp: parameter 1 kept iteration 1's residual.)"""
    feedback, verdict = _first_iteration()
    _rebuilt_iteration(feedback, verdict, last_finite=False)
    verdict.settle()
    residuals = feedback.state_dict()["residuals"]
    for key in (0, 1):
        assert torch.equal(residuals[key], FIRST[key]), f"parameter {key}: {residuals[key]} != {FIRST[key]}"


def test_a_counted_iteration_after_the_rebuild_keeps_every_buckets_new_residual(stamped):
    """The same interleaving, every result finite: each parameter's residual is the sum of its two gradients,
    and the next iteration's first pass reads it. (Bucket 0's stamps reset by bucket 1's gather made the whole
    iteration's verdict 'not counted': parameter 0 lost its second gradient.)"""
    feedback, verdict = _first_iteration()
    for _ in range(2):
        _rebuilt_iteration(feedback, verdict)
    verdict.settle()
    residuals = feedback.state_dict()["residuals"]
    for key in (0, 1):
        assert torch.equal(residuals[key], FIRST[key] + 2 * SECOND[key]), f"parameter {key}"
