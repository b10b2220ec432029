"""Tests that must FAIL under the multi-rank harness; run by tests/test_harness.py only."""
import os

import pytest


@pytest.mark.ranks(2, timeout=60)
def test_fails_on_rank_one_only(hvd_torch):
    if hvd_torch.rank() == 1:
        raise ValueError("deliberate failure on rank 1")


@pytest.mark.ranks(2, timeout=int(os.environ.get("HQ_SAMPLE_HANG_TIMEOUT", "30")))
def test_hangs_in_a_collective(hvd_torch):
    import torch
    # Each rank waits for a collective the other never starts: a stall Horovod only warns about.
    hvd_torch.allreduce(torch.ones(3), name=f"only_on_rank_{hvd_torch.rank()}")
