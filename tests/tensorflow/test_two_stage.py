"""QSGD's two-stage exchange in TensorFlow: the reference result, the torch adapter's bytes, refusals.

Results are compared bitwise with tests/two_stage_reference.py (the codecs
alone) and with horovod_qsgd.torch run on the same ranks in the same process.
"""
import numpy as np
import pytest

from tests.two_stage_reference import gradient, reference

SHARED_LAUNCHES = True  # tests with the same rank count and env run in one launch (tests/multirank.py)
RANKS_3_AND_4 = [pytest.param(3, marks=pytest.mark.ranks(3, timeout=240)),
                 pytest.param(4, marks=pytest.mark.ranks(4, timeout=300))]


@pytest.mark.parametrize("num_ranks", RANKS_3_AND_4)
def test_eager_and_traced_results_equal_the_reference_and_the_torch_adapter(hvd_tf, num_ranks):
    import tensorflow as tf
    import torch
    import horovod.torch as hvd_torch
    from horovod_qsgd.codecs import QSGDCodec
    import horovod_qsgd.tensorflow as tf_adapter
    import horovod_qsgd.torch as torch_adapter
    hvd = hvd_tf
    hvd_torch.init()
    numel, bucket = 100_003, 512  # divisible neither by the ranks nor by the bucket
    grads = [gradient(r, numel) for r in range(num_ranks)]
    mine = grads[hvd.rank()]
    compressor = tf_adapter.QSGD(bits=4, second_stage_bits=8)
    twin = torch_adapter.QSGD(bits=4, second_stage_bits=8)

    @tf.function
    def traced(x):
        return hvd.allreduce(x, name="w", op=hvd.Average, compression=compressor)

    eager = hvd.allreduce(tf.constant(mine), name="w", op=hvd.Sum, compression=compressor).numpy()
    in_graph = traced(tf.constant(mine)).numpy()
    first, second = QSGDCodec(bits=4, bucket_size=bucket), QSGDCodec(bits=8, bucket_size=bucket)
    assert np.array_equal(eager, reference(first, second, "w", grads, 0, bucket))
    assert np.array_equal(in_graph, reference(first, second, "w", grads, 1, bucket) * np.float32(1 / num_ranks))
    torch_sum = hvd_torch.allreduce(torch.from_numpy(mine), name="w", op=hvd_torch.Sum, compression=twin)
    assert np.array_equal(torch_sum.numpy(), eager)
    stats = compressor.compression_stats()
    assert stats["exchanges"] == {"w": "two_stage"} and stats["tensors_two_stage"] == 2
    twin_stats = twin.compression_stats()
    assert stats["collectives_started"] == 2 * twin_stats["collectives_started"] == 4
    # The same payloads; PyTorch's fused exchange puts its group's 16-byte manifest in front, per peer and stage.
    assert stats["bytes_sent_first_stage"] == 2 * (twin_stats["bytes_sent_first_stage"] - 16 * (num_ranks - 1))
    assert stats["bytes_sent_second_stage"] == 2 * (twin_stats["bytes_sent_second_stage"] - 16)


@pytest.mark.ranks(3, timeout=180)
def test_a_shape_seen_by_one_owner_only_is_reported_on_every_rank(hvd_tf):
    import tensorflow as tf
    from horovod_qsgd.tensorflow import QSGD
    hvd = hvd_tf
    numel = 3 * 512 * 100 + (512 if hvd.rank() == 2 else 0)  # only rank 2's owned chunk differs
    with pytest.raises((tf.errors.OpError, Exception)) as info:
        hvd.allreduce(tf.ones(numel), name="layer.weight", compression=QSGD(bits=4, exchange="two_stage"))
    message = str(info.value)
    assert "'layer.weight'" in message, message
    assert ("elements" in message) if hvd.rank() == 2 else ("rank 2 found a mismatch" in message), message


@pytest.mark.ranks(2, timeout=180)
def test_sparse_embedding_gradients_pass_through(hvd_tf):
    # Horovod allgathers tf.IndexedSlices itself (sparse_as_dense=False); the dense gradient is compressed.
    import tensorflow as tf
    from horovod_qsgd.tensorflow import QSGD
    hvd = hvd_tf
    table = tf.Variable(np.ones((1000, 16), np.float32))
    dense = tf.Variable(np.ones((16, 1000), np.float32))
    ids = tf.constant([hvd.rank(), 7])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.nn.embedding_lookup(table, ids) @ dense)
    tape = hvd.DistributedGradientTape(tape, compression=QSGD(bits=8), op=hvd.Sum)
    sparse, full = tape.gradient(loss, [table, dense])
    assert isinstance(sparse, tf.IndexedSlices)
    assert sorted(sparse.indices.numpy().tolist()) == [0, 1, 7, 7]
    assert np.array_equal(full.numpy(), np.full((16, 1000), 4.0, np.float32))  # constant: quantized exactly


@pytest.mark.ranks(3, timeout=240)
def test_top_k_two_stage_in_a_function_equals_the_reference_and_the_torch_adapter(hvd_tf):
    import tensorflow as tf
    import torch
    import horovod.torch as hvd_torch
    from horovod_qsgd.codecs import TopKCodec
    import horovod_qsgd.tensorflow as tf_adapter
    import horovod_qsgd.torch as torch_adapter
    from tests.two_stage_reference import bounds
    hvd = hvd_tf
    hvd_torch.init()
    numel, me = 100_003, hvd.rank()
    compressor = tf_adapter.TopK(ratio=0.01)  # auto: two stages at 3 ranks
    twin = torch_adapter.TopK(ratio=0.01)
    codec = TopKCodec(ratio=0.01)
    residuals = [np.zeros(numel, np.float32) for _ in range(3)]
    owner_residuals = [np.zeros(e - b, np.float32) for b, e in bounds(numel, 3, 1)]

    @tf.function
    def traced(x):
        return hvd.allreduce(x, name="t", op=hvd.Sum, compression=compressor)

    for step in range(3):
        grads = [gradient(r, numel, step) for r in range(3)]
        got = traced(tf.constant(grads[me])).numpy()
        assert np.array_equal(got, reference(codec, codec, "t", grads, step, 1, residuals, owner_residuals)), step
        from_torch = hvd_torch.allreduce(torch.from_numpy(grads[me]), name="t", op=hvd_torch.Sum, compression=twin)
        assert np.array_equal(from_torch.numpy(), got), step
    state = compressor.state_dict()["tensors"]["t"]
    assert np.array_equal(state["residual"], residuals[me])
    assert np.array_equal(state["owner_residual"], owner_residuals[me]) and state["owner_layout"] == [3, me]
    assert compressor.compression_stats()["exchanges"] == {"t": "two_stage"}
