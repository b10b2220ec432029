"""A test sharing its launch with tests/harness_samples/shared_group_*.py (SHARED_LAUNCHES names their group); run
by tests/test_harness.py only."""
import os

import pytest

SHARED_LAUNCHES = "harness sample group"


@pytest.mark.ranks(2, timeout=60)
def test_notes_its_process_in_module_two(hvd_torch):
    with open(os.path.join(os.environ["HQ_SAMPLE_PIDS"], f"{os.getpid()}.rank{hvd_torch.rank()}"), "a") as f:
        f.write("two\n")
