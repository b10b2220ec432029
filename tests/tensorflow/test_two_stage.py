"""QSGD's two-stage exchange in TensorFlow: the reference result, the torch adapter's bytes, refusals.

Results are compared bitwise with tests/two_stage_reference.py (the codecs
alone) and with horovod_qsgd.torch run on the same ranks in the same process.
"""
import numpy as np
import pytest

from tests.two_stage_reference import averaged_training, gradient, reference

SHARED_LAUNCHES = "horovod.tensorflow"  # a launch per rank count and env with the TF modules (tests/multirank.py)
RANKS_3_AND_4 = [pytest.param(3, marks=pytest.mark.ranks(3, timeout=240)),
                 pytest.param(4, marks=pytest.mark.ranks(4, timeout=300))]


@pytest.mark.parametrize("num_ranks", RANKS_3_AND_4)
def test_eager_and_traced_results_equal_the_reference_and_the_torch_adapter(hvd_tf, hvd_torch, num_ranks):
    import tensorflow as tf
    import torch
    from horovod_qsgd.codecs import QSGDCodec
    import horovod_qsgd.tensorflow as tf_adapter
    import horovod_qsgd.torch as torch_adapter
    hvd = hvd_tf
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
def test_top_k_two_stage_in_a_function_equals_the_reference_and_the_torch_adapter(hvd_tf, hvd_torch):
    import tensorflow as tf
    import torch
    from horovod_qsgd.codecs import TopKCodec
    import horovod_qsgd.tensorflow as tf_adapter
    import horovod_qsgd.torch as torch_adapter
    from tests.two_stage_reference import bounds
    hvd = hvd_tf
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


@pytest.mark.ranks(3, timeout=240)
def test_an_elastic_jobs_exchange_on_a_world_that_does_not_change_is_the_plain_one_bit_for_bit(hvd_tf):
    # A Horovod Elastic job's compressor makes its plans as the ops run (tensorflow/conduct.py AnyWorldConduct):
    # two stages with top-k's residuals and owner residuals, and QSGD's one allgather, which the graph's
    # alltoall skips. On 3 unchanging ranks every result and the state after 3 steps are the plain path's bits.
    import os
    import tensorflow as tf
    import horovod_qsgd.tensorflow as tf_adapter
    from horovod_qsgd.tensorflow import elastic
    hvd = hvd_tf
    numel, me = 100_003, hvd.rank()

    def compressors():
        return [tf_adapter.TopK(ratio=0.01, exchange="two_stage"), tf_adapter.QSGD(bits=4, exchange="allgather")]
    os.environ["HOROVOD_ELASTIC"] = "1"  # what horovodrun sets in an elastic job's workers
    try:
        in_elastic_job = compressors()
    finally:
        del os.environ["HOROVOD_ELASTIC"]
    for compressor in in_elastic_job:
        elastic.TensorFlowState([tf.Variable(tf.zeros([1]))], compression=compressor)
    for plain, any_world in zip(compressors(), in_elastic_job):
        steps = [tf.function(lambda x, c=c: hvd.allreduce(x, name="t", op=hvd.Sum, compression=c))
                 for c in (plain, any_world)]
        for step in range(3):
            x = tf.constant(gradient(me, numel, step))
            want, got = (run(x).numpy() for run in steps)
            assert np.array_equal(got, want), (type(plain).__name__, step)
        want, got = plain.state_dict()["tensors"]["t"], any_world.state_dict()["tensors"]["t"]
        assert got["step"] == want["step"] == 3
        for key in ("residual", "owner_residual"):
            assert (got[key] is None and want[key] is None) or np.array_equal(got[key], want[key]), key
        assert got["owner_layout"] == want["owner_layout"]
    assert in_elastic_job[0].state_dict()["tensors"]["t"]["owner_layout"] == [3, me]


@pytest.mark.ranks(3, timeout=240)
def test_owner_residual_from_another_rank_count_is_sent_by_its_rank_or_reset_with_a_warning(hvd_tf):
    # As the PyTorch adapter's test of the same name: a checkpoint of a 4-rank job loaded into 3 ranks. Rank r's
    # owner-side residual of its chunk of 4 joins its own residual there (eagerly, and in a function traced
    # after the load), so with zero gradients results plus all residuals equal what was loaded; one that fits
    # no chunk of the tensor is reset with a warning.
    import tensorflow as tf
    import horovod_qsgd.tensorflow as tf_adapter
    from tests.two_stage_reference import bounds
    hvd = hvd_tf
    numel, me = 90_000, hvd.rank()
    compressor = tf_adapter.TopK(ratio=0.01, exchange="two_stage")
    hvd.allreduce(tf.zeros(numel), name="t", compression=compressor)
    state = compressor.state_dict()
    loaded = np.zeros(numel, np.float32)
    for rank, (b, e) in enumerate(bounds(numel, 4, 1)):
        loaded[b:e] += rank + 1  # ranks 0-2's owner-side residuals of a 4-rank job; rank 3's went with it
    loaded[bounds(numel, 4, 1)[3][0]:] = 0
    b, e = bounds(numel, 4, 1)[me]
    state["tensors"]["t"].update(owner_residual=np.full(e - b, me + 1.0, np.float32), owner_layout=[4, me])
    for traced in (False, True):
        resumed = tf_adapter.TopK(ratio=0.01, exchange="two_stage")
        resumed.load_state_dict(state)

        def step(x):
            return hvd.allreduce(x, name="t", op=hvd.Sum, compression=resumed)
        result = (tf.function(step) if traced else step)(tf.zeros(numel)).numpy()
        after = resumed.state_dict()["tensors"]["t"]
        assert after["owner_layout"] == [3, me], traced
        left = hvd.allreduce(tf.constant(after["residual"]), name=f"left{traced}", op=hvd.Sum).numpy()
        owned = hvd.allgather(tf.constant(after["owner_residual"]), name=f"owned{traced}").numpy()
        assert np.array_equal(result + left + owned, loaded), traced

    state["tensors"]["t"].update(owner_residual=np.ones(7, np.float32), owner_layout=[4, me])  # no chunk of 4 has 7
    resumed = tf_adapter.TopK(ratio=0.01, exchange="two_stage")
    resumed.load_state_dict(state)
    with pytest.warns(UserWarning, match="saved as rank .* of 4, this is rank .* of 3; it is reset"):
        hvd.allreduce(tf.zeros(numel), name="t", compression=resumed)
    assert resumed.state_dict()["tensors"]["t"]["owner_layout"] == [3, me]

    # A state without an owner residual, loaded, leaves none: the variable a traced function holds is zeroed.
    traced = tf.function(lambda x: hvd.allreduce(x, name="t", op=hvd.Sum, compression=resumed))
    traced(tf.constant(gradient(me, numel, 5)))
    held = resumed.state_dict()["tensors"]["t"]
    assert np.any(held["owner_residual"] != 0)
    resumed.load_state_dict(dict(state, tensors={"t": dict(held, owner_residual=None, owner_layout=None)}))
    assert not np.any(resumed.state_dict()["tensors"]["t"]["owner_residual"])
    traced(tf.constant(gradient(me, numel, 6)))


FUSED_SIZES = (100_003, 70_001, 1_000, 512 * 40)  # no multiple of the ranks or the bucket; fewer buckets than ranks
# Each case ~45 s: the rank counts and codecs in two (PyTorch's tests/torch/test_fusion.py runs all four)
FUSED_CASES = [pytest.param(n, kind, marks=pytest.mark.ranks(n, timeout=300)) for n, kind in
               ((3, "qsgd"), (4, "topk"))]


def _grouped_tape_training(hvd, compressor, steps):
    """Each step's averaged gradients, state and statistics, from DistributedGradientTape(groups=1) in a function."""
    import tensorflow as tf
    from benchmarks.collectives import grouped_tape_step
    variables = [tf.Variable(tf.zeros(n), name=f"layer{i}.weight") for i, n in enumerate(FUSED_SIZES)]
    step = grouped_tape_step(hvd, compressor, variables)

    history = []
    for s in range(steps):
        grads = step([tf.constant(gradient(hvd.rank(), n, 10 * s + i)) for i, n in enumerate(FUSED_SIZES)])
        history.append(([g.numpy() for g in grads], compressor.state_dict(), compressor.compression_stats(reset=True)))
    return history


@pytest.mark.parametrize("num_ranks, kind", FUSED_CASES)
def test_a_grouped_tape_fuses_its_two_stages_with_the_bits_of_one_tensor_at_a_time(hvd_tf, num_ranks, kind):
    from horovod_qsgd.tensorflow import QSGD, TopK
    hvd, steps = hvd_tf, 3

    def compressor(**kwargs):
        if kind == "qsgd":
            return QSGD(bits=4, exchange="two_stage", min_numel=0, **kwargs)
        return TopK(ratio=0.02, exchange="two_stage", min_numel=0, **kwargs)

    fused = _grouped_tape_training(hvd, compressor(), steps)
    alone = _grouped_tape_training(hvd, compressor(fusion_threshold=0), steps)
    wanted = averaged_training(kind, FUSED_SIZES, num_ranks, steps)
    for s, ((g_fused, s_fused, st_fused), (g_alone, s_alone, st_alone)) in enumerate(zip(fused, alone)):
        for i, (a, b) in enumerate(zip(g_fused, g_alone)):
            assert np.array_equal(a, b) and np.array_equal(a, wanted[s][i]), (s, i)
        for name, state in s_alone["tensors"].items():
            for field in ("residual", "owner_residual"):
                if state.get(field) is None:
                    assert s_fused["tensors"][name].get(field) is None
                else:
                    assert np.array_equal(s_fused["tensors"][name][field], state[field]), (s, name, field)
            assert s_fused["tensors"][name]["step"] == state["step"] == s + 1
        if kind == "topk":
            assert any(np.abs(t["owner_residual"]).sum() > 0 for t in s_fused["tensors"].values())
        # One alltoall and one allgather a step for the four tensors, against two per tensor; the same payloads
        # behind one 16-byte manifest per peer in the first stage and one per owner in the second.
        assert st_fused["collectives_started"] == 2 and st_alone["collectives_started"] == 2 * len(FUSED_SIZES), s
        assert st_fused["tensors_two_stage"] == st_alone["tensors_two_stage"] == len(FUSED_SIZES)
        assert st_fused["bytes_sent_first_stage"] - st_alone["bytes_sent_first_stage"] == 16 * (num_ranks - 1)
        assert st_fused["bytes_sent_second_stage"] - st_alone["bytes_sent_second_stage"] == 16


@pytest.mark.ranks(3, timeout=240)
def test_an_eager_grouped_allreduce_fuses_and_a_rank_of_other_shapes_is_refused_on_every_rank(hvd_tf):
    import tensorflow as tf
    from horovod_qsgd.tensorflow import QSGD
    hvd = hvd_tf
    tensors = [tf.constant(gradient(hvd.rank(), 20_000, i)) for i in range(3)]
    fused = QSGD(bits=4, exchange="two_stage", min_numel=0)
    results = hvd.grouped_allreduce(tensors, name="three", op=hvd.Sum, compression=fused)
    alone = QSGD(bits=4, exchange="two_stage", min_numel=0, fusion_threshold=0)
    expected = hvd.grouped_allreduce(tensors, name="three", op=hvd.Sum, compression=alone)
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(results, expected))
    assert fused.compression_stats()["collectives_started"] == 2
    assert alone.compression_stats()["collectives_started"] == 2 * 3
    # Rank 2's second tensor is longer: its chunks differ, the group's collectives still meet (they are named
    # after the members' names) and every rank raises instead of waiting.
    sizes = [20_000, 20_000 + (512 if hvd.rank() == 2 else 0), 20_000]
    tensors = [tf.constant(gradient(hvd.rank(), n, i)) for i, n in enumerate(sizes)]
    with pytest.raises((tf.errors.OpError, Exception)) as info:
        hvd.grouped_allreduce(tensors, name="three", op=hvd.Sum, compression=fused)
    message = str(info.value)
    # The owners that received rank 2's slices name it and the difference; the others meet their notices.
    if "found a mismatch in what it received" in message:
        assert "'three.0, three.1, three.2'" in message, message
    else:
        assert "'three.1'" in message and "first-stage slice does not match this rank's" in message, message
        assert "elements (here" in message, message


@pytest.mark.ranks(3, timeout=240)
def test_keras3_optimizer_groups_fuse_with_the_bits_of_one_tensor_at_a_time(hvd_tf):
    import keras
    from horovod_qsgd.tensorflow import QSGD, keras3
    hvd = hvd_tf
    rng = np.random.default_rng(hvd.rank())
    x, y = rng.standard_normal((96, 64)).astype(np.float32), rng.integers(0, 40, 96)

    def fit(**kwargs):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(300, activation="relu", name="hidden"),
                                  keras.layers.Dense(40, name="out")], name="mlp")  # names: the RNG keys
        # every tensor compressed: Horovod's own sums of passed-through ones may differ in their last bit
        # between runs, as its fusion buffer's layout follows the timing
        compression = QSGD(bits=4, exchange="two_stage", min_numel=0, **kwargs)
        model.compile(optimizer=keras3.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=compression,
                                                            groups=1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        return [w.numpy() for w in model.weights], compression

    fused_weights, fused = fit()
    alone_weights, alone = fit(fusion_threshold=0)
    assert all(np.array_equal(a, b) for a, b in zip(fused_weights, alone_weights))
    everyone = hvd.allgather(np.concatenate([w.ravel() for w in fused_weights])[None], name="keras3.fused.weights")
    assert all(np.array_equal(everyone[0], row) for row in everyone.numpy())
    # State is named by the variables' paths, as without groups; 3 steps of 4 two-stage tensors.
    assert sorted(fused._steps) == sorted(alone._steps) == ["mlp/hidden/bias", "mlp/hidden/kernel", "mlp/out/bias",
                                                           "mlp/out/kernel"]
    stats, alone_stats = fused.compression_stats(), alone.compression_stats()
    assert stats["tensors_two_stage"] == alone_stats["tensors_two_stage"] == 4 * 3
    assert stats["collectives_started"] == 2 * 3 and alone_stats["collectives_started"] == 8 * 3
