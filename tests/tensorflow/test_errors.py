"""Rank mismatches and unsupported uses raise named errors on every rank, within the harness timeout."""
import numpy as np
import pytest

SHARED_LAUNCHES = "horovod.tensorflow"  # a launch per rank count and env with the TF modules (tests/multirank.py)


def _tape_gradients(hvd, tf, compressor, shape, function):
    var = tf.Variable(tf.ones(shape), name="layer_weight")

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(var * var)
        return hvd.DistributedGradientTape(tape, compression=compressor).gradient(loss, [var])

    return (tf.function(step) if function else step)()


@pytest.mark.ranks(2, timeout=150)
def test_mismatched_settings_and_shapes_fail_on_every_rank(hvd_tf):
    import tensorflow as tf
    from horovod_qsgd.common.errors import CompressionMismatchError
    from horovod_qsgd.tensorflow import QSGD
    hvd = hvd_tf
    rank = hvd.rank()

    # Different settings: the one-time handshake names the setting and both values, eagerly and in
    # tf.function (where it runs while the function is traced).
    for function in (False, True):
        with pytest.raises(CompressionMismatchError) as info:
            _tape_gradients(hvd, tf, QSGD(bits=4 if rank == 0 else 8), [200, 100], function)
        message = str(info.value)
        assert "settings.bits" in message and "rank 0=4" in message and "rank 1=8" in message, message

    # Same settings, different shapes: the payload headers disagree; decoding fails on both ranks
    # with the tensor's name (TensorFlow wraps the error raised inside the host op).
    with pytest.raises((CompressionMismatchError, tf.errors.OpError)) as info:
        _tape_gradients(hvd, tf, QSGD(bits=4), [200, 100] if rank == 0 else [240, 100], True)
    message = str(info.value)
    assert "CompressionMismatchError" in message or isinstance(info.value, CompressionMismatchError), message
    assert "'layer_weight'" in message and "elements" in message, message


@pytest.mark.ranks(2, timeout=150)
def test_unsupported_uses_are_refused(hvd_tf):
    import tensorflow as tf
    from horovod_qsgd.common.errors import UnsupportedCollectiveError
    from horovod_qsgd.tensorflow import QSGD, TopK
    hvd = hvd_tf
    compressor = QSGD()
    big = tf.ones([20000])

    with pytest.raises(UnsupportedCollectiveError, match="Adasum"):
        hvd.allreduce(big, name="g", op=hvd.Adasum, compression=compressor)
    with pytest.raises(UnsupportedCollectiveError, match="reduce-scatter"):
        hvd.reducescatter(big, compression=compressor, name="rs")
    # Eagerly, a compressed tensor needs a name; small tensors pass through without one.
    small = hvd.allreduce(tf.ones([10]), compression=compressor, op=hvd.Sum)
    np.testing.assert_array_equal(small.numpy(), np.full(10, 2.0, np.float32))
    with pytest.raises(ValueError, match="needs name="):
        hvd.allreduce(big, compression=compressor)
    # Invalid arguments name the argument.
    with pytest.raises(ValueError, match="bits"):
        QSGD(bits=9)
    with pytest.raises(ValueError, match="selector"):
        TopK(selector="fastest")
    with pytest.raises(ValueError, match="min_numel"):
        QSGD(min_numel=-1)


@pytest.mark.parametrize("num_ranks", [pytest.param(2, marks=pytest.mark.ranks(2, timeout=150)),
                                       pytest.param(3, marks=pytest.mark.ranks(3, timeout=150))])
def test_min_max_product_give_horovods_result_with_a_warning(hvd_tf, num_ranks):
    import math
    import warnings
    import tensorflow as tf
    from horovod_qsgd.tensorflow import QSGD, RandomK, TopK
    hvd = hvd_tf
    assert hvd.size() == num_ranks
    mine = tf.fill([20000], float(hvd.rank() + 1))
    expected = {"Max": float(num_ranks), "Min": 1.0, "Product": float(math.factorial(num_ranks))}
    for compressor in (QSGD(bits=4), TopK(ratio=0.01), RandomK(ratio=0.01)):
        kind = type(compressor).__name__
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for op, value in expected.items():
                result = hvd.allreduce(mine, name=f"{kind}.{op}", op=getattr(hvd, op), compression=compressor)
                np.testing.assert_array_equal(result.numpy(), np.full(20000, value, np.float32))

            @tf.function
            def traced():
                return hvd.allreduce(mine, name=f"{kind}.traced", op=hvd.Max, compression=compressor)
            np.testing.assert_array_equal(traced().numpy(), np.full(20000, num_ranks, np.float32))
        messages = [str(w.message) for w in caught if "compressed payloads cannot serve" in str(w.message)]
        assert len(messages) == 3, messages  # once per op and compressor
        assert all("uncompressed" in m and "Compression.none" in m for m in messages), messages
        hvd.allreduce(mine, name=f"{kind}.sum", op=hvd.Sum, compression=compressor)
        assert compressor.compression_stats()["tensors_compressed"] == 1


@pytest.mark.ranks(2, timeout=150)
def test_tf_distribute_strategies_are_refused_and_retraces_keep_one_counter(hvd_tf):
    import tensorflow as tf
    from horovod_qsgd.tensorflow import QSGD
    hvd = hvd_tf
    compressor = QSGD()
    with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
        with pytest.raises(ValueError, match="tf.distribute's MirroredStrategy"):
            hvd.allreduce(tf.ones([20000]), name="in.strategy", compression=compressor)

    # A pass-through tensor's counter is made once per named call site, not once per trace.
    @tf.function
    def small(x, variant):
        return hvd.allreduce(x * variant, name="small.bias", compression=compressor, op=hvd.Sum)

    for variant in (1, 2, 3):  # a Python number in the signature: a trace each
        small(tf.ones([10]), variant)
    assert small.experimental_get_tracing_count() == 3
    assert len(compressor._runtime.pass_through_counters) == 1
    stats = compressor.compression_stats()
    assert stats["tensors_passed_through"] == 3 and stats["bytes_sent"] == 3 * 40, stats


@pytest.mark.parametrize("num_ranks", [pytest.param(2, marks=pytest.mark.ranks(2, timeout=150)),
                                       pytest.param(3, marks=pytest.mark.ranks(3, timeout=150))])
def test_hvd_allreduce_under_a_variables_name_is_refused_on_every_rank(hvd_tf, num_ranks):
    """The compressor keeps error feedback by name: hvd.allreduce(name=...) under a variable's name would share
    its residual, and is refused; a variable meeting a name hvd.allreduce used takes a state of its own."""
    import tensorflow as tf
    from horovod_qsgd.tensorflow import TopK
    hvd = hvd_tf
    assert hvd.size() == num_ranks
    compressor = TopK(ratio=0.01)
    _tape_gradients(hvd, tf, compressor, [20000], function=False)
    with pytest.raises(ValueError, match="'layer_weight'.*share one residual"):
        hvd.allreduce(tf.zeros([20000]), name="layer_weight", compression=compressor)
    hvd.allreduce(tf.ones([20000]), name="direct", compression=compressor)
    var = tf.Variable(tf.ones([20001]), name="direct")  # another shape: Horovod's cached function traces again
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(var * var)
    hvd.DistributedGradientTape(tape, compression=compressor).gradient(loss, [var])
    assert sorted(compressor.state_dict()["tensors"]) == ["direct", "direct#2", "layer_weight"]
