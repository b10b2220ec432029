"""Uneven inputs: horovod_qsgd.tensorflow.Join against a run where the ranks without data step on zero gradients."""
import numpy as np
import pytest

SHARED_LAUNCHES = "horovod.tensorflow"  # a launch per rank count and env with the TF modules (tests/multirank.py)
CASES = [("qsgd", "allgather"), ("qsgd", "two_stage"), ("topk", "allgather"), ("topk", "two_stage")]


def _compressor(kind, exchange):
    from horovod_qsgd.tensorflow import QSGD, TopK
    return QSGD(bits=4, exchange=exchange) if kind == "qsgd" else TopK(ratio=0.01, exchange=exchange)


def _train(hvd, kind, exchange, joined):
    """(variables, momenta, compressor, join): rank r trains on 2 + 2r batches (``joined``: inside Join; else
    every rank runs the longest count, its gradients zeroed where it has no batch)."""
    import tensorflow as tf
    from horovod_qsgd.tensorflow import Join
    init = np.random.default_rng(0)
    shapes = [(100, 200), (200,), (200, 10), (10,)]  # the biases pass through (min_numel)
    variables = [tf.Variable(init.standard_normal(shape).astype(np.float32) * 0.1) for shape in shapes]
    momenta = [tf.Variable(tf.zeros(shape)) for shape in shapes]
    compressor = _compressor(kind, exchange)
    tag = f"{kind}.{exchange}"  # equal in both runs: the rounding streams are seeded by name

    @tf.function
    def train_step(x, y, active):
        with tf.GradientTape() as tape:
            hidden = tf.nn.relu(x @ variables[0] + variables[1])
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, hidden @ variables[2]
                                                                                  + variables[3]))
        for index, (var, momentum, grad) in enumerate(zip(variables, momenta, tape.gradient(loss, variables))):
            grad = tf.where(active, grad, tf.zeros_like(grad))
            grad = hvd.allreduce(grad, name=f"{tag}.{index}", op=hvd.Average, compression=compressor)
            momentum.assign(0.9 * momentum + grad)
            var.assign_sub(0.05 * momentum)

    join = Join(train_step, compressor) if joined else None
    rng = np.random.default_rng(10 + hvd.rank())
    mine, longest = 2 + 2 * hvd.rank(), 2 + 2 * (hvd.size() - 1)
    batches = [(tf.constant(rng.standard_normal((16, 100)).astype(np.float32)),
                tf.constant(rng.integers(0, 10, 16).astype(np.int32))) for _ in range(mine)]
    if joined:
        with join:
            for x, y in batches:
                join(x, y, tf.constant(True))
    else:
        for index in range(longest):
            x, y = batches[min(index, mine - 1)]
            train_step(x, y, tf.constant(index < mine))
    return variables, momenta, compressor, join


def _check_join(hvd):
    import tensorflow as tf
    for kind, exchange in CASES:
        variables, momenta, compressor, join = _train(hvd, kind, exchange, joined=True)
        reference, ref_momenta, ref_compressor, _ = _train(hvd, kind, exchange, joined=False)
        assert join.shadow_steps == 2 * (hvd.size() - 1 - hvd.rank())
        for index, (var, ref) in enumerate(zip(variables + momenta, reference + ref_momenta)):
            assert np.array_equal(var.numpy(), ref.numpy()), f"{kind}/{exchange}: variable {index} differs"
            rows = hvd.allgather(tf.reshape(var, (1, -1)), name=f"check.{kind}.{exchange}.{index}").numpy()
            assert all(np.array_equal(rows[0], row) for row in rows), f"{kind}/{exchange}: {index} differs by rank"
        tensors, ref_tensors = compressor.state_dict()["tensors"], ref_compressor.state_dict()["tensors"]
        assert [entry["step"] for entry in tensors.values()] == [entry["step"] for entry in ref_tensors.values()]
        for (name, entry), ref_entry in zip(tensors.items(), ref_tensors.values()):
            for key in ("residual", "owner_residual"):
                mine, ref = entry.get(key), ref_entry.get(key)
                assert (mine is None and ref is None) or np.array_equal(mine, ref), f"{kind}/{exchange}: {key}"


@pytest.mark.ranks(2, timeout=300)
def test_join_trains_uneven_inputs_like_zero_gradient_steps_on_two_ranks(hvd_tf):
    _check_join(hvd_tf)


# As in the PyTorch test: without fusion the passed-through biases' three terms are summed alike in both runs.
@pytest.mark.ranks(3, timeout=360, env={"HOROVOD_FUSION_THRESHOLD": "0"})
def test_join_trains_uneven_inputs_like_zero_gradient_steps_on_three_ranks(hvd_tf):
    _check_join(hvd_tf)


@pytest.mark.ranks(2, timeout=180)
def test_join_made_after_the_first_step_or_with_hvd_compression_is_refused(hvd_tf):
    import tensorflow as tf
    from horovod_qsgd.tensorflow import Join, QSGD
    hvd = hvd_tf
    compressor = QSGD(bits=4)
    hvd.allreduce(tf.ones(5000), name="late.join", compression=compressor)
    with pytest.raises(RuntimeError, match="make the Join before the compressor's first step"):
        Join(lambda: None, compressor)
    with pytest.raises(TypeError, match="use hvd.join"):
        Join(lambda: None, hvd.Compression.none)
