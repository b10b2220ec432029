"""hvd.join() with TensorFlow payload compressors: refused on every rank, never a killed job; even inputs work.

In a file of its own: an eager compressed allreduce changes how every later hvd.join() of the process starts.
"""
import numpy as np
import pytest

SHARED_LAUNCHES = True


def _model(hvd, kind, exchange):
    """(variables, compressor, train_step): a two-layer model whose tape compresses with names of the case."""
    import tensorflow as tf
    from horovod_qsgd.tensorflow import QSGD, TopK
    init = np.random.default_rng(0)
    variables = [tf.Variable(init.standard_normal(shape).astype(np.float32) * 0.1, name=f"{kind}.{exchange}.{i}")
                 for i, shape in enumerate([(100, 200), (200,), (200, 10), (10,)])]  # biases pass through
    compressor = QSGD(bits=4, exchange=exchange) if kind == "qsgd" else TopK(ratio=0.01, exchange=exchange)
    rng = np.random.default_rng(10 + hvd.rank())

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            hidden = tf.nn.relu(x @ variables[0] + variables[1])
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, hidden @ variables[2]
                                                                                  + variables[3]))
        tape = hvd.DistributedGradientTape(tape, compression=compressor)
        grads = tape.gradient(loss, variables)
        for var, grad in zip(variables, grads):
            var.assign_sub(0.05 * grad)
        return tf.reduce_all([tf.reduce_all(tf.math.is_finite(grad)) for grad in grads])

    def step():
        return bool(train_step(tf.constant(rng.standard_normal((16, 100)).astype(np.float32)),
                               tf.constant(rng.integers(0, 10, 16).astype(np.int32))))

    return variables, compressor, step


def _residuals(compressor):
    return {name: {key: entry[key].copy() for key in ("residual", "owner_residual") if entry.get(key) is not None}
            for name, entry in compressor.state_dict()["tensors"].items()}


def _check_hvd_join(hvd, earlies):
    """In each case of ``earlies``, that many ranks run out of data while the others are in their third step."""
    import tensorflow as tf
    from horovod_qsgd.tensorflow import JoinUnsupportedError, QSGD
    size, rank = hvd.size(), hvd.rank()
    # Even inputs: every rank calls hvd.join() after the same steps and gets Horovod's answer.
    variables, _, step = _model(hvd, "qsgd", "auto")
    assert all(step() for _ in range(3))
    assert 0 <= int(hvd.join()) < size
    for index, var in enumerate(variables):
        rows = hvd.allgather(tf.reshape(var, (1, -1)), name=f"even.check.{index}").numpy()
        assert all(np.array_equal(rows[0], row) for row in rows), f"variable {index} differs by rank"
    # Uneven inputs: the first ``early`` ranks run out of data after 2 steps; the others are in their third.
    for early, (kind, exchange) in [(early, case) for early in earlies
                                    for case in [("qsgd", "allgather"), ("topk", "two_stage")]]:
        expected = f"hvd.join() was called on {early} of {size} ranks"
        variables, compressor, step = _model(hvd, kind, exchange)
        if rank < early:
            assert step() and step()
            with pytest.raises(JoinUnsupportedError) as info:
                hvd.join()
            assert expected in str(info.value), str(info.value)
            assert "horovod_qsgd.tensorflow.Join(train_step, compression)" in str(info.value)
        else:
            assert step() and step()
            before = _residuals(compressor)
            # The third step ends, its compressed gradients NaN and the residuals as they were...
            assert not step()
            after = _residuals(compressor)
            assert before.keys() == after.keys() and before, kind
            for name in before:
                for key in before[name]:
                    assert np.array_equal(before[name][key], after[name][key]), f"{kind}: {name} {key}"
            # ... the next one raises before its payloads leave, and so does this rank's hvd.join().
            with pytest.raises(tf.errors.OpError, match=expected.replace("(", r"\(").replace(")", r"\)")):
                step()
            with pytest.raises(JoinUnsupportedError) as info:
                hvd.join()
            assert expected in str(info.value), str(info.value)
        # Horovod's background loop lives on: the job can still end in order.
        alive = hvd.allreduce(tf.ones(1), name=f"alive.{early}.{kind}.{exchange}", op=hvd.Sum)
        assert int(alive.numpy()[0]) == size
    # Eager payloads cannot be answered by name: hvd.join() first checks that every rank is in it.
    total = hvd.allreduce(tf.ones(20000), name="eager.join", op=hvd.Sum, compression=QSGD(bits=8))
    assert float(total.numpy()[0]) == size
    assert 0 <= int(hvd.join()) < size


@pytest.mark.ranks(2, timeout=300)
def test_hvd_join_with_payloads_is_refused_on_every_rank_and_works_with_even_inputs_on_two_ranks(hvd_tf):
    _check_hvd_join(hvd_tf, earlies=[1])


# One rank joins and two are refused (each finds the notice in what it received, before the other's refusal);
# then two join and one is refused.
@pytest.mark.ranks(3, timeout=360)
def test_hvd_join_with_payloads_is_refused_on_every_rank_and_works_with_even_inputs_on_three_ranks(hvd_tf):
    _check_hvd_join(hvd_tf, earlies=[1, 2])
