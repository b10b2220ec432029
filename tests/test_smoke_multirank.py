"""Exact results of Horovod's own collectives on 2 and 3 ranks, for torch and TensorFlow.

These check the installed Horovod build before anything of ours is trusted on top of it.
"""
import pytest

SHARED_LAUNCHES = True  # tests with the same rank count, env and launcher run in one launch (tests/multirank.py)

RANK_COUNTS = [pytest.param(2, marks=pytest.mark.ranks(2)), pytest.param(3, marks=pytest.mark.ranks(3))]


@pytest.mark.parametrize("num_ranks", RANK_COUNTS)
def test_torch_allreduce_and_uneven_allgather(hvd_torch, num_ranks):
    import torch
    hvd = hvd_torch
    assert hvd.size() == num_ranks
    rank = hvd.rank()
    x = torch.arange(10, dtype=torch.float32) * (rank + 1)
    total = hvd.allreduce(x, op=hvd.Sum, name="smoke.sum")
    expected = torch.arange(10, dtype=torch.float32) * sum(r + 1 for r in range(num_ranks))
    assert torch.equal(total, expected)
    avg = hvd.allreduce(x, op=hvd.Average, name="smoke.avg")
    assert torch.allclose(avg, expected / num_ranks, rtol=0, atol=1e-6)

    # Rank r contributes r + 1 rows: first dimensions differ across ranks.
    rows = torch.full((rank + 1, 3), float(rank), dtype=torch.float32)
    gathered = hvd.allgather(rows, name="smoke.gather")
    expected_rows = torch.cat([torch.full((r + 1, 3), float(r)) for r in range(num_ranks)])
    assert torch.equal(gathered, expected_rows)

    payload = torch.arange(rank + 5, dtype=torch.uint8)
    gathered_bytes = hvd.allgather(payload, name="smoke.gather_u8")
    assert torch.equal(gathered_bytes, torch.cat([torch.arange(r + 5, dtype=torch.uint8)
                                                  for r in range(num_ranks)]))


@pytest.mark.parametrize("num_ranks", RANK_COUNTS)
def test_tensorflow_allreduce_and_uneven_allgather(hvd_tf, num_ranks):
    import numpy as np
    import tensorflow as tf
    hvd = hvd_tf
    assert hvd.size() == num_ranks
    rank = hvd.rank()
    x = tf.range(10, dtype=tf.float32) * (rank + 1)
    total = hvd.allreduce(x, op=hvd.Sum, name="smoke.sum")
    expected = np.arange(10, dtype=np.float32) * sum(r + 1 for r in range(num_ranks))
    np.testing.assert_array_equal(total.numpy(), expected)

    small = tf.constant([rank + 1] * 4, dtype=tf.int8)
    np.testing.assert_array_equal(hvd.allreduce(small, op=hvd.Sum, name="smoke.int8").numpy(),
                                  [sum(r + 1 for r in range(num_ranks))] * 4)

    rows = tf.fill([rank + 1, 3], float(rank))
    gathered = hvd.allgather(rows, name="smoke.gather")
    expected_rows = np.concatenate([np.full((r + 1, 3), float(r), np.float32) for r in range(num_ranks)])
    np.testing.assert_array_equal(gathered.numpy(), expected_rows)


@pytest.mark.ranks(2)
def test_a_torch_rank_waiting_for_a_late_peer_leaves_the_cores_to_it(hvd_torch):
    """The harness's ``wait_politely`` (tests/multirank.py): Horovod 0.28.1's PyTorch ``synchronize`` spins on a
    core while it waits; in the workers it sleeps between polls. Red means every waiting rank spins again and the
    suite runs slower on the 2-core machine (spinning, the waiting thread: 1.99 s of CPU in 2.01 s)."""
    import resource
    import time

    import torch
    hvd = hvd_torch
    hvd.allreduce(torch.zeros(1), name="smoke.before_the_wait")
    if hvd.rank() == 0:
        time.sleep(2.0)
    started, cpu_before = time.monotonic(), resource.getrusage(resource.RUSAGE_THREAD)
    total = hvd.allreduce(torch.ones(3), op=hvd.Sum, name="smoke.after_the_wait")
    waited, cpu = time.monotonic() - started, resource.getrusage(resource.RUSAGE_THREAD)
    assert torch.equal(total, torch.full((3,), 2.0))
    if hvd.rank() == 1:
        assert waited > 1.5, waited  # (it did wait for rank 0)
        spent = cpu.ru_utime + cpu.ru_stime - cpu_before.ru_utime - cpu_before.ru_stime
        assert spent < 0.25 * waited, f"{spent:.2f} s of CPU in {waited:.2f} s waited"
