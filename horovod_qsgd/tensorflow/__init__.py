"""TensorFlow adapter: pass one of these as ``compression=`` to Horovod.

    import horovod.tensorflow as hvd
    from horovod_qsgd.tensorflow import QSGD
    compression = QSGD(bits=4)             # create once, outside tf.function
    tape = hvd.DistributedGradientTape(tape, compression=compression)

The same object works with ``hvd.DistributedOptimizer`` and, with tf-keras
(``TF_USE_LEGACY_KERAS=1``), ``horovod.tensorflow.keras.DistributedOptimizer``;
see :mod:`horovod_qsgd.tensorflow.keras3` for Keras 3. Checkpoint the
compressor's state with ``tf.train.Checkpoint(compressor=compression, ...)``.
"""
try:
    import horovod.tensorflow as _hvd
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("horovod_qsgd.tensorflow needs Horovod built with TensorFlow support; run "
                      "scripts/setup.sh (it builds Horovod 0.28.1 for TF 2.21).") from exc

from horovod_qsgd.tensorflow.compression import QSGD, RandomK, TopK  # noqa: E402
from horovod_qsgd.tensorflow.join import Join  # noqa: E402
from horovod_qsgd.codecs.header import PayloadError  # noqa: E402
from horovod_qsgd.common.errors import (CompressionMismatchError, JoinUnsupportedError,  # noqa: E402
                                         UnsupportedCollectiveError)
from horovod_qsgd.kernels import cpu_threads, set_cpu_threads  # noqa: E402

#: Horovod's own compressors, re-exported so a comparison needs one import.
NoCompression = _hvd.Compression.none
FP16 = _hvd.Compression.fp16

__all__ = ["QSGD", "TopK", "RandomK", "FP16", "NoCompression", "Join",
           "CompressionMismatchError", "UnsupportedCollectiveError", "JoinUnsupportedError", "PayloadError",
           "set_cpu_threads", "cpu_threads"]
