"""The multi-rank harness itself (tests/multirank.py): a hang in a shared launch fails fast and says where.

Stop 81's CI: one test left rank 0's collectives named otherwise than its peers', the next test of the shared
launch hung, and every later test of that launch hung again for pytest.ini's 1200 s until CI's limit, with
no report of the cause. Here a generated module of two tests shares a launch on 2 ranks: the first hangs
(each rank waits in a collective its peer never starts); the second must fail at once, naming the first.
"""
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HANGING_MODULE = '''
import pytest

SHARED_LAUNCHES = True


@pytest.mark.timeout(15)
@pytest.mark.ranks(2, timeout=150)
def test_a_collective_no_peer_joins(hvd_torch):
    import torch
    hvd_torch.allreduce(torch.ones(1), name=f"harness.only_rank_{hvd_torch.rank()}")


@pytest.mark.ranks(2, timeout=150)
def test_after_the_hang():
    pass
'''


def test_a_hang_in_a_shared_launch_stops_it_and_fails_the_tests_after_it_naming_the_hung_one():
    package = tempfile.mkdtemp(prefix="generated_harness_", dir=os.path.join(ROOT, "tests"))
    try:
        open(os.path.join(package, "__init__.py"), "w").close()
        with open(os.path.join(package, "test_hang.py"), "w") as f:
            f.write(HANGING_MODULE)
        module = os.path.relpath(os.path.join(package, "test_hang.py"), ROOT)
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", module],
                             cwd=ROOT, capture_output=True, text=True, timeout=280)
    finally:
        shutil.rmtree(package)
    out = run.stdout + run.stderr
    hung, after = f"{module}::test_a_collective_no_peer_joins", f"{module}::test_after_the_hang"
    assert run.returncode == 1, out
    assert f"FAILED {hung}" in out and "Timeout (>15.0s) from pytest-timeout" in out, out
    assert f"FAILED {after}" in out and (
        f"not run on ranks [0, 1]: the launch (a launch shared by 2 tests) stopped after a test hung there "
        f"(rank 0: {hung}; rank 1: {hung})") in out, out
