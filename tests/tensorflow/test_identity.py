"""The TF adapter sends the bytes the PyTorch adapter sends, and reproduces the checked-in test vectors."""
import numpy as np
import pytest

SHARED_LAUNCHES = "horovod.tensorflow"  # a launch per rank count and env with the TF modules (tests/multirank.py)


class RecordingCodec:
    """Forwards to a codec and keeps a copy of every payload (or RandomK value array) it produces."""

    def __init__(self, codec):
        self._codec = codec
        self.sent = []

    def __getattr__(self, name):
        return getattr(self._codec, name)

    def encode(self, x, out, **kwargs):
        nbytes = self._codec.encode(x, out, **kwargs)
        self.sent.append(np.array(out[:nbytes], copy=True))
        return nbytes

    def encode_many(self, xs, outs, **kwargs):
        used = self._codec.encode_many(xs, outs, **kwargs)
        self.sent.extend(np.array(out[:nbytes], copy=True) for out, nbytes in zip(outs, used))
        return used

    def gather(self, x, **kwargs):
        values = self._codec.gather(x, **kwargs)
        self.sent.append(np.array(values, copy=True))
        return values


CONFIGS = [("QSGD", {"bits": 4}), ("QSGD", {"bits": 3, "norm": "l2", "bucket_size": 300}),
           ("QSGD", {"bits": 2, "encoding": "elias", "norm": "l2", "bucket_size": 2048}),
           ("QSGD", {"bits": 8, "scale_dtype": "float16"}), ("TopK", {"ratio": 0.01}),
           ("TopK", {"ratio": 0.02, "selector": "gaussian", "value_dtype": "float16"}),
           ("RandomK", {"ratio": 0.05, "error_feedback": True})]


@pytest.mark.ranks(2, timeout=180)
def test_same_payload_bytes_and_result_as_the_torch_adapter(hvd_tf, hvd_torch):
    import tensorflow as tf
    import torch
    import horovod_qsgd.tensorflow as tf_adapter
    import horovod_qsgd.torch as torch_adapter
    rank = hvd_tf.rank()
    for class_name, kwargs in CONFIGS:
        tf_compressor = getattr(tf_adapter, class_name)(**kwargs)
        torch_compressor = getattr(torch_adapter, class_name)(**kwargs)
        for compressor in (tf_compressor, torch_compressor):
            compressor.codec = RecordingCodec(compressor.codec)
            if hasattr(compressor, "_engine"):  # TensorFlow's exchange engine encodes with the compressor's codec
                compressor._engine.codec = compressor.codec
            if hasattr(compressor, "_exchanges"):  # PyTorch's, in its exchanges
                compressor._exchanges.engine.codec = compressor.codec
        for step in range(3):
            rng = np.random.default_rng(10 * rank + step)
            for dtype in (np.float32, np.float16):
                x = (rng.standard_normal((150, 101)) * 0.01).astype(dtype)
                name = f"layer.{np.dtype(dtype).name}"
                got_tf = hvd_tf.allreduce(tf.constant(x), name=name, compression=tf_compressor)
                got_torch = hvd_torch.allreduce(torch.from_numpy(x), name=name, compression=torch_compressor)
                what = f"{class_name}{kwargs} step {step} {np.dtype(dtype).name}"
                assert np.array_equal(tf_compressor.codec.sent[-1], torch_compressor.codec.sent[-1]), what
                assert got_tf.numpy().dtype == got_torch.numpy().dtype == dtype, what
                assert np.array_equal(got_tf.numpy(), got_torch.numpy()), what
        assert len(tf_compressor.codec.sent) == 6
        # The payloads really depend on the step (rounding / selection changes).
        assert not np.array_equal(tf_compressor.codec.sent[0], tf_compressor.codec.sent[2]) or class_name == "TopK"


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_checked_in_vectors_through_the_tf_host_op(mode):
    """Every test vector, encoded through the adapter's host op (QSGD/TopK payloads, RandomK values)."""
    pytest.importorskip("tensorflow")
    import tensorflow as tf
    from horovod_qsgd.codecs import HEADER_NBYTES, RandomKCodec
    from horovod_qsgd.tensorflow.host_ops import host_op, values_gatherer
    from horovod_qsgd.testdata import check_vectors, load_vectors, make_codec

    def run(fn, x, step, residual, dtype):
        def op(x, step, residual):
            return host_op(fn, x, step, residual, dtype, "vector")

        if mode == "function":
            op = tf.function(op)
        out, new_residual = op(tf.constant(x), tf.constant(step, tf.int64),
                               None if residual is None else tf.constant(residual))
        if residual is not None:
            residual[:] = new_residual.numpy()
        return out.numpy()

    def tf_encode(codec, x, *, step, key, residual):
        def encode(x, step, residual):
            out = np.zeros(codec.max_payload_nbytes(x.size), np.uint8)
            return out[:codec.encode(x, out, step=step, key=key, residual=residual)]

        return run(encode, x, step, residual, tf.uint8)

    assert check_vectors(tf_encode) >= 10

    checked = 0
    for case in load_vectors():
        codec = make_codec(case["codec"], case["config"])
        if not isinstance(codec, RandomKCodec):
            continue
        residual = None if case["residual"] is None else case["residual"].copy()
        values = run(values_gatherer(codec, case["key"]), case["x"], case["step"], residual, tf.float32)
        k = codec.k(case["x"].size)
        wire = np.float16 if codec.value_dtype == "float16" else np.float32
        sent = case["payload"][HEADER_NBYTES + 16:].view(wire)[:k].astype(np.float32)
        assert np.array_equal(values.view(np.uint32), sent.view(np.uint32)), case["name"]
        if residual is not None:
            assert np.array_equal(residual.view(np.uint32), case["residual_out"].view(np.uint32)), case["name"]
        checked += 1
    assert checked >= 2
