"""A small model on a real data set (scikit-learn's digits) trains as well with compression as without."""
import pytest

SHARED_LAUNCHES = "horovod.torch"  # a launch per rank count and env with the torch modules (tests/multirank.py)


@pytest.mark.ranks(2, timeout=400)
def test_digits_accuracy_with_compression(hvd_torch):
    from benchmarks.convergence import train_digits_torch
    from horovod_qsgd.torch import QSGD, NoCompression, TopK
    _, baseline = train_digits_torch(hvd_torch, NoCompression)
    _, qsgd8 = train_digits_torch(hvd_torch, QSGD(bits=8))
    _, topk = train_digits_torch(hvd_torch, TopK(ratio=0.01))
    print(f"digits test accuracy: none {baseline[-1]:.2f}%, qsgd-8 {qsgd8[-1]:.2f}%, topk-1% {topk[-1]:.2f}%")
    assert baseline[-1] > 93.0, baseline
    assert abs(qsgd8[-1] - baseline[-1]) <= 1.0, (qsgd8, baseline)
    # Top-k 1% with error feedback converges, behind uncompressed in this short run.
    assert topk[-1] > 85.0 and topk[-1] > topk[0], (topk, baseline)
