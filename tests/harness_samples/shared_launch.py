"""Tests that share one launch (SHARED_LAUNCHES); run by tests/test_harness.py only: one must FAIL."""
import os

import pytest

SHARED_LAUNCHES = True


def _note_process(hvd):
    with open(os.path.join(os.environ["HQ_SAMPLE_PIDS"], f"{os.getpid()}.rank{hvd.rank()}"), "w"):
        pass


@pytest.mark.ranks(2, timeout=60)
def test_passes_first(hvd_torch):
    _note_process(hvd_torch)


@pytest.mark.ranks(2, timeout=60)
def test_fails_on_rank_one_in_a_shared_launch(hvd_torch):
    _note_process(hvd_torch)
    if hvd_torch.rank() == 1:
        raise ValueError("deliberate failure on rank 1, shared launch")


@pytest.mark.ranks(2, timeout=60)
def test_passes_after_a_failure(hvd_torch):
    _note_process(hvd_torch)
