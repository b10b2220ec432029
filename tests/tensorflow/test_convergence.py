"""A small Keras model on a real data set (scikit-learn's digits) trains as well with compression as without."""
import pytest

from tests.tensorflow.reference import LEGACY_KERAS

SHARED_LAUNCHES = "horovod.tensorflow"  # a launch per rank count and env with the TF modules (tests/multirank.py)


@pytest.mark.ranks(2, timeout=400, env=LEGACY_KERAS)
def test_keras_digits_accuracy_with_compression(hvd_tf):
    from examples.tensorflow_keras_digits import train_digits
    from horovod_qsgd.tensorflow import QSGD, NoCompression, TopK
    hvd = hvd_tf
    baseline_loss, baseline = train_digits(hvd, NoCompression, epochs=12)
    qsgd_loss, qsgd8 = train_digits(hvd, QSGD(bits=8), epochs=12)
    topk_loss, topk = train_digits(hvd, TopK(ratio=0.01), epochs=12)
    print(f"keras digits test accuracy: none {baseline:.2f}%, qsgd-8 {qsgd8:.2f}%, topk-1% {topk:.2f}%")
    assert baseline > 93.0, baseline
    assert abs(qsgd8 - baseline) <= 1.0, (qsgd8, baseline)
    # Top-k 1% with error feedback converges, behind uncompressed in this short run.
    assert topk > 85.0 and topk_loss[-1] < topk_loss[0], (topk, topk_loss)
