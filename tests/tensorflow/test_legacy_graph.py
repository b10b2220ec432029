"""tf.compat.v1 graphs run by a Session (Horovod's legacy DistributedOptimizer) with our compressors."""
import numpy as np
import pytest

STEPS = 4


def _weights():
    rng = np.random.default_rng(7)
    return {"w": (rng.standard_normal((64, 256)) * 0.1).astype(np.float32),
            "v": (rng.standard_normal((256, 1)) * 0.1).astype(np.float32),  # v and b: below min_numel,
            "b": np.zeros(256, np.float32)}                                  # passed through


def _batches(rank):
    rng = np.random.default_rng(100 + rank)
    xs = [rng.standard_normal((32, 64)).astype(np.float32) for _ in range(STEPS)]
    return [(x, np.sin(x[:, :1])) for x in xs]


def _loss(tf, variables, x, y):
    hidden = tf.tanh(tf.matmul(x, variables["w"]) + variables["b"])
    return tf.reduce_mean(tf.square(tf.matmul(hidden, variables["v"]) - y))


def _train_in_session(hvd, compressor):
    import tensorflow as tf
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 64])
        y = tf.compat.v1.placeholder(tf.float32, [None, 1])
        variables = {name: tf.compat.v1.get_variable(name, initializer=value) for name, value in _weights().items()}
        optimizer = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), compression=compressor)
        train = optimizer.minimize(_loss(tf, variables, x, y))
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            for xb, yb in _batches(hvd.rank()):
                session.run(train, {x: xb, y: yb})
            state = session.run({name: {"step": compressor._steps[name],
                                        "residual": compressor._residuals.get(name, compressor._steps[name])}
                                 for name in compressor._steps})
            return session.run(variables), state


def _train_with_tape(hvd, compressor):
    import tensorflow as tf
    variables = {name: tf.Variable(value, name=name) for name, value in _weights().items()}
    optimizer = tf.keras.optimizers.SGD(0.1)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = _loss(tf, variables, xb, yb)
        tape = hvd.DistributedGradientTape(tape, compression=compressor)
        names = sorted(variables)
        grads = tape.gradient(loss, [variables[n] for n in names])
        optimizer.apply_gradients(zip(grads, [variables[n] for n in names]))

    for xb, yb in _batches(hvd.rank()):
        step(tf.constant(xb), tf.constant(yb))
    return {name: v.numpy() for name, v in variables.items()}


# At 3 ranks Horovod's timing-dependent fusion decides how the passed-through gradients' terms are rounded:
# without fusion both runs sum alike.
@pytest.mark.parametrize("num_ranks", [
    pytest.param(2, marks=pytest.mark.ranks(2, timeout=300)),
    pytest.param(3, marks=pytest.mark.ranks(3, timeout=300, env={"HOROVOD_FUSION_THRESHOLD": "0"}))])
def test_a_session_trains_like_a_tf_function(hvd_tf, num_ranks):
    """The same steps in a tf.compat.v1 Session and in a tf.function give the same weights bit for bit:
    the step counters and residuals advance in the Session although it fetches only the train op."""
    import tensorflow as tf
    from horovod_qsgd.tensorflow import QSGD, TopK
    hvd = hvd_tf
    for make in (lambda: QSGD(bits=4), lambda: TopK(ratio=0.01, exchange="two_stage")):
        compressor = make()
        weights, state = _train_in_session(hvd, compressor)
        expected = _train_with_tape(hvd, make())
        for name, value in weights.items():
            assert np.array_equal(value, expected[name]), f"{compressor!r}: {name} differs from the tf.function run"
            rows = hvd.allgather(tf.constant(value.reshape(1, -1)), name=f"check.{name}").numpy()
            assert all(np.array_equal(rows[0], row) for row in rows), f"{name} differs between ranks"
        assert {name: int(entry["step"]) for name, entry in state.items()} == {"w": STEPS}
        if compressor.error_feedback:
            assert np.abs(state["w"]["residual"]).sum() > 0, "the residual never left zero in the Session"
        stats = compressor.compression_stats()
        assert stats["tensors_compressed"] == STEPS and stats["tensors_passed_through"] == 2 * STEPS, stats
        assert stats["bytes_uncompressed"] == STEPS * 4 * (64 * 256 + 256 + 256), stats
        with pytest.raises(RuntimeError, match="Saver"):
            compressor.state_dict()
