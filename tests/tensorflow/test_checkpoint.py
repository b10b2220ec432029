"""tf.train.Checkpoint saves a compressor's step counters and residuals and restores them exactly.

A run checkpointed at step k and resumed in fresh objects (new variables, new
compressor, a newly traced tf.function) must equal the uninterrupted run
bitwise; without the compressor in the checkpoint it must not.
"""
import numpy as np
import pytest

from tests.tensorflow.reference import make
from tests.tensorflow.test_gradient_tape import batch, loss_fn, make_variables

SHARED_LAUNCHES = "horovod.tensorflow"  # a launch per rank count and env with the TF modules (tests/multirank.py)

STEPS, SAVE_AT = 6, 3


def train(hvd, tf, kind, directory, first=0, restore=None, save_compressor=True):
    """Runs steps first..STEPS-1; saves before step SAVE_AT; returns the final weights and compressor state."""
    variables = make_variables(tf)
    compressor = make(kind, min_numel=1000)
    checkpoint = (tf.train.Checkpoint(variables=variables, compressor=compressor) if save_compressor
                  else tf.train.Checkpoint(variables=variables))
    if restore is not None:
        # Restored before the state variables exist: they are restored when the trace creates them.
        checkpoint.restore(restore)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(tf, variables, x, y)
        grads = hvd.DistributedGradientTape(tape, compression=compressor).gradient(loss, variables)
        for v, g in zip(variables, grads):
            v.assign_sub(0.5 * g)

    saved = None
    for s in range(first, STEPS):
        if s == SAVE_AT and restore is None:
            saved = checkpoint.write(f"{directory}/rank{hvd.rank()}")
        x, y = batch(hvd.rank(), s)
        step(tf.constant(x), tf.constant(y))
    weights = np.concatenate([v.numpy().reshape(-1) for v in variables])
    return weights, compressor.state_dict(), saved


@pytest.mark.ranks(2, timeout=240)
def test_resume_from_checkpoint_is_bit_exact(hvd_tf, tmp_path_factory):
    import tensorflow as tf
    hvd = hvd_tf
    directory = tmp_path_factory.mktemp(f"ckpt{hvd.rank()}")
    for kind in ("topk", "randomk-ef", "qsgd4"):
        uninterrupted, state, path = train(hvd, tf, kind, directory / kind)
        assert state["tensors"] and all(t["step"] == STEPS for t in state["tensors"].values()), state
        names = tf.train.list_variables(path)
        assert any("compressor/_steps" in n for n, _ in names), names
        if kind != "qsgd4":
            assert any("compressor/_residuals" in n for n, _ in names), names

        resumed, resumed_state, _ = train(hvd, tf, kind, directory / kind, first=SAVE_AT, restore=path)
        assert np.array_equal(uninterrupted, resumed), f"{kind}: resumed weights differ"
        for name, entry in state["tensors"].items():
            got = resumed_state["tensors"][name]
            assert got["step"] == entry["step"], (kind, name)
            if entry["residual"] is not None:
                assert np.array_equal(got["residual"].view(np.uint32), entry["residual"].view(np.uint32)), name

        # Without the compressor's state the same resume differs: the state matters.
        fresh, _, _ = train(hvd, tf, kind, directory / kind, first=SAVE_AT, restore=path, save_compressor=False)
        assert not np.array_equal(uninterrupted, fresh), f"{kind}: the compressor's state made no difference"


@pytest.mark.ranks(2, timeout=150)
def test_state_dict_round_trip_and_settings_check(hvd_tf, tmp_path_factory):
    import tensorflow as tf
    from horovod_qsgd.tensorflow import QSGD, TopK
    hvd = hvd_tf
    compressor = TopK(ratio=0.01)
    rng = np.random.default_rng(hvd.rank())
    for _ in range(2):
        hvd.allreduce(tf.constant(rng.standard_normal(20000).astype(np.float32)), name="w", compression=compressor)
    state = compressor.state_dict()
    assert state["tensors"]["w"]["step"] == 2 and np.any(state["tensors"]["w"]["residual"] != 0)
    copy = TopK(ratio=0.01)
    copy.load_state_dict(state)
    assert copy.state_dict()["tensors"]["w"]["step"] == 2
    assert np.array_equal(copy.state_dict()["tensors"]["w"]["residual"], state["tensors"]["w"]["residual"])
    # Loading replaces the state: a tensor the state lacks starts afresh, as in a new compressor.
    x = tf.constant(rng.standard_normal(20000).astype(np.float32))
    copy.load_state_dict(dict(state, tensors={}))
    fresh = TopK(ratio=0.01)
    for c in (copy, fresh):
        hvd.allreduce(x, name="w", compression=c)
    restarted, new = copy.state_dict()["tensors"]["w"], fresh.state_dict()["tensors"]["w"]
    assert restarted["step"] == new["step"] == 1 and np.array_equal(restarted["residual"], new["residual"])
    with pytest.raises(ValueError, match="settings"):
        TopK(ratio=0.02).load_state_dict(state)
    with pytest.raises(ValueError, match="TopK"):
        QSGD().load_state_dict(state)

    # A tf.train.Checkpoint written with other settings is refused before the first exchange.
    path = tf.train.Checkpoint(compressor=compressor).write(str(tmp_path_factory.mktemp("c") / "c"))
    other = TopK(ratio=0.02)
    tf.train.Checkpoint(compressor=other).restore(path).expect_partial()
    with pytest.raises(ValueError, match="checkpoint was written by"):
        hvd.allreduce(tf.ones([20000]), name="w", compression=other)
    # ... but another fusion_threshold packs the collectives otherwise and means the same state: it restores.
    unfused = TopK(ratio=0.01, fusion_threshold=0)
    tf.train.Checkpoint(compressor=unfused).restore(path).expect_partial()
    hvd.allreduce(tf.ones([20000]), name="w", compression=unfused)
    assert unfused.state_dict()["tensors"]["w"]["step"] == 3

    # A residual of another length (another model's) is refused, naming the tensor, on every rank.
    from horovod_qsgd.common.errors import CompressionMismatchError
    other_model = TopK(ratio=0.01)
    other_model.load_state_dict(dict(state, tensors={"w": dict(state["tensors"]["w"],
                                                               residual=np.zeros(19_999, np.float32))}))
    with pytest.raises(CompressionMismatchError,
                       match="tensor 'w' has 20000 elements but its error-feedback residual has 19999; a checkpoint"):
        hvd.allreduce(tf.ones([20000]), name="w", compression=other_model)


@pytest.mark.parametrize("num_ranks", [pytest.param(2, marks=pytest.mark.ranks(2, timeout=150)),
                                       pytest.param(3, marks=pytest.mark.ranks(3, timeout=150))])
def test_random_k_resumed_on_rank_0_alone_draws_the_same_coordinates_everywhere(hvd_tf, num_ranks):
    """Only rank 0 loads the compressor's state (the "load on rank 0, then broadcast" recipe): the first step
    aligns every rank's step counters to rank 0's, so every rank sums the same coordinates (eager and traced)."""
    import tensorflow as tf
    from horovod_qsgd.tensorflow import RandomK
    hvd = hvd_tf
    x = tf.range(1, 50001, dtype=tf.float32) * float(hvd.rank() + 1)
    total = num_ranks * (num_ranks + 1) / 2
    for traced in (False, True):
        name = f"rk.resume.{traced}"
        trained = RandomK(ratio=0.01)

        def step(compression):
            def run():
                return hvd.allreduce(x, name=name, op=hvd.Sum, compression=compression)
            return (tf.function(run) if traced else run)()

        for _ in range(3):
            step(trained)
        saved = trained.state_dict()
        resumed = RandomK(ratio=0.01)
        if hvd.rank() == 0:
            resumed.load_state_dict(saved)
        out = step(resumed).numpy()
        assert resumed.step_counters() == {name: 4}, resumed.step_counters()
        picked = np.nonzero(out)[0]
        assert picked.size == 500
        np.testing.assert_array_equal(out[picked], (picked + 1).astype(np.float32) * total)
        everyone = hvd.allgather(tf.constant(out[None]), name=f"{name}.results").numpy()
        assert all(np.array_equal(everyone[0], row) for row in everyone)
        np.testing.assert_array_equal(step(trained).numpy(), out)
