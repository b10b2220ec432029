"""The multi-rank harness itself: a failure on one rank and a hang are both reported as failures."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = os.path.join("tests", "harness_samples", "failing_on_ranks.py")


@pytest.fixture(scope="module")
def sample_run():
    env = dict(os.environ, HQ_SAMPLE_HANG_TIMEOUT="15")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", SAMPLES],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return proc


def test_sample_run_fails(sample_run):
    assert sample_run.returncode == 1, sample_run.stdout[-3000:]
    assert "2 failed" in sample_run.stdout, sample_run.stdout[-3000:]


def test_failure_on_rank_one_is_reported_with_its_message(sample_run):
    out = sample_run.stdout
    assert "--- rank 1 failed ---" in out, out[-3000:]
    assert "deliberate failure on rank 1" in out
    assert "--- rank 0 failed ---" not in out.split("test_hangs_in_a_collective")[0]


def test_hang_is_reported_as_timeout(sample_run):
    assert "timed out after 15 s on 2 ranks" in sample_run.stdout, sample_run.stdout[-3000:]


def test_tests_of_a_shared_launch_run_in_one_job_and_are_judged_apart(tmp_path):
    env = dict(os.environ, HQ_SAMPLE_PIDS=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA",
                           os.path.join("tests", "harness_samples", "shared_launch.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert "1 failed, 2 passed" in out, out[-3000:]
    assert "FAILED tests/harness_samples/shared_launch.py::test_fails_on_rank_one_in_a_shared_launch" in out
    assert "deliberate failure on rank 1, shared launch" in out and "--- rank 0 failed ---" not in out
    # three tests, two processes: one per rank, each ran all three
    notes = sorted(os.listdir(tmp_path))
    assert len(notes) == 2 and {n.split(".")[1] for n in notes} == {"rank0", "rank1"}, notes


def test_modules_naming_one_group_share_a_launch(tmp_path):
    """Two modules with SHARED_LAUNCHES = "<the same group>": their tests run in one job (two processes, each
    ran both modules' tests), not one job per module."""
    env = dict(os.environ, HQ_SAMPLE_PIDS=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.join("tests", "harness_samples", "shared_group_one.py"),
                           os.path.join("tests", "harness_samples", "shared_group_two.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert "2 passed" in proc.stdout, proc.stdout[-3000:]
    notes = sorted(os.listdir(tmp_path))
    assert len(notes) == 2 and {n.split(".")[1] for n in notes} == {"rank0", "rank1"}, notes
    for note in notes:
        with open(tmp_path / note) as f:
            assert f.read().split() == ["one", "two"], note
