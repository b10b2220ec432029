"""Gradients without a static shape: compressed with their variable's shape, or counted at their run-time size."""
import numpy as np
import pytest

SHARED_LAUNCHES = "horovod.tensorflow"  # a launch per rank count and env with the TF modules (tests/multirank.py)


@pytest.mark.ranks(2, timeout=240)
def test_sparse_as_dense_embedding_is_compressed_and_unknown_shapes_are_counted(hvd_tf):
    import tensorflow as tf
    from horovod_qsgd.tensorflow import QSGD, TopK
    hvd = hvd_tf
    embedding = tf.Variable(tf.random.stateless_normal([1000, 64], seed=[1, 2]), name="embedding")
    ids = tf.constant(np.random.default_rng(hvd.rank()).integers(0, 1000, 256), dtype=tf.int32)

    def gradient(compressor):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(tf.gather(embedding, ids)))
        tape = hvd.DistributedGradientTape(tape, compression=compressor, sparse_as_dense=True)
        return tape.gradient(loss, [embedding])[0]

    traced_topk, eager_topk = TopK(ratio=0.01), TopK(ratio=0.01)
    traced = tf.function(gradient)(traced_topk)
    eager = gradient(eager_topk)
    assert np.array_equal(traced.numpy(), eager.numpy())
    for compressor in (traced_topk, eager_topk):
        stats = compressor.compression_stats()
        assert stats["tensors_compressed"] == 1 and stats["tensors_passed_through"] == 0, stats
        assert stats["bytes_uncompressed"] == 64000 * 4 and stats["bytes_sent"] < 64000 * 4 / 40, stats
    rows = hvd.allgather(tf.reshape(traced, [1, -1])).numpy()
    assert np.array_equal(rows[0], rows[1])

    # No variable to take a shape from: passed through, and counted at the size it had when it ran.
    compressor = QSGD()

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def reduce(x):
        return hvd.allreduce(x, name="unknown", op=hvd.Sum, compression=compressor)

    assert np.array_equal(reduce(tf.ones(20000)).numpy(), np.full(20000, 2.0, np.float32))
    reduce(tf.ones(30000))
    stats = compressor.compression_stats()
    assert stats["tensors_passed_through"] == 2, stats
    assert stats["bytes_uncompressed"] == stats["bytes_sent"] == (20000 + 30000) * 4, stats
