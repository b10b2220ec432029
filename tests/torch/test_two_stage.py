"""QSGD's two-stage exchange (alltoall of slices to their owners, allgather of re-encoded sums) on 2-4 ranks.

Every rank's result is compared bitwise with tests/two_stage_reference.py,
built from all ranks' gradients with the codecs alone.
"""
import numpy as np
import pytest

from tests.multirank import init_with_process_sets
from tests.two_stage_reference import bounds as _bounds
from tests.two_stage_reference import gradient as _gradient
from tests.two_stage_reference import reference as _reference

SHARED_LAUNCHES = "horovod.torch"  # a launch per rank count and env with the torch modules (tests/multirank.py)
RANKS_3_AND_4 = [pytest.param(3, marks=pytest.mark.ranks(3)), pytest.param(4, marks=pytest.mark.ranks(4))]


def _same_on_every_rank(hvd, tensor, name):
    import torch
    gathered = hvd.allgather(tensor.reshape(1, -1), name=name)
    return all(torch.equal(gathered[0], gathered[r]) for r in range(gathered.shape[0]))


# 100003 and 70001 are divisible neither by the ranks nor by the bucket; 1000 values are 2 buckets, fewer than
# the ranks, so some ranks own nothing. (Each case costs a horovodrun launch: not every case on every count.)
BITWISE_CASES = [pytest.param(3, 100_003, 512, None, marks=pytest.mark.ranks(3)),
                 pytest.param(4, 100_003, 512, None, marks=pytest.mark.ranks(4)),
                 pytest.param(4, 70_001, 1000, 8, marks=pytest.mark.ranks(4)),
                 pytest.param(3, 1_000, 512, None, marks=pytest.mark.ranks(3))]


@pytest.mark.parametrize("num_ranks, numel, bucket, second_bits", BITWISE_CASES)
def test_two_stage_result_is_bitwise_the_reference_on_every_rank(hvd_torch, num_ranks, numel, bucket, second_bits):
    import torch
    from horovod_qsgd.codecs import QSGDCodec
    from horovod_qsgd.torch import QSGD
    hvd = hvd_torch
    assert hvd.size() == num_ranks
    compressor = QSGD(bits=4, bucket_size=bucket, exchange="two_stage", second_stage_bits=second_bits,
                      min_numel=0)
    grads = [_gradient(r, numel) for r in range(num_ranks)]
    for op, divide in ((hvd.Average, num_ranks), (hvd.Sum, 1)):
        result = hvd.allreduce(torch.from_numpy(grads[hvd.rank()]), name="w", op=op, compression=compressor)
        step = 0 if op == hvd.Average else 1  # the second call is the tensor's next RNG step
        want = _reference(QSGDCodec(bits=4, bucket_size=bucket), QSGDCodec(bits=second_bits or 4, bucket_size=bucket),
                          "w", grads, step, bucket)
        if divide != 1:
            want = want * np.float32(1.0 / divide)
        assert np.array_equal(result.numpy(), want), (op, np.abs(result.numpy() - want).max())
        assert _same_on_every_rank(hvd, result, f"check.{op}")
    stats = compressor.compression_stats()
    assert stats["exchanges"] == {"w": "two_stage"} and stats["tensors_two_stage"] == 2
    assert stats["collectives_started"] == 4  # an alltoall and an allgather per call
    # Bytes by the formula: the rank's slices for the other owners, then its own re-encoded chunk, each part
    # behind its group's 16-byte manifest (a group of one tensor here).
    first, second = QSGDCodec(bits=4, bucket_size=bucket), QSGDCodec(bits=second_bits or 4, bucket_size=bucket)
    chunks = _bounds(numel, num_ranks, bucket)
    me = hvd.rank()
    first_bytes = sum(16 + first.max_payload_nbytes(e - b) for j, (b, e) in enumerate(chunks) if j != me)
    second_bytes = 16 + second.max_payload_nbytes(chunks[me][1] - chunks[me][0])
    assert stats["bytes_sent_first_stage"] == 2 * first_bytes
    assert stats["bytes_sent_second_stage"] == 2 * second_bytes
    assert stats["bytes_sent"] == 2 * (first_bytes + second_bytes + 4)  # + the fp32 placeholder


@pytest.mark.ranks(3)
def test_two_stage_error_is_within_the_quantization_bound(hvd_torch):
    # Independent of the codecs: every coordinate of the averaged result is within one first-stage level of
    # each slice plus one second-stage level of the owner's sum (max norm, 4 bits: s = 7).
    import torch
    from horovod_qsgd.torch import QSGD
    hvd = hvd_torch
    numel, bucket = 200_000, 512
    grads = [_gradient(r, numel) for r in range(3)]
    result = hvd.allreduce(torch.from_numpy(grads[hvd.rank()]), name="g", op=hvd.Sum,
                           compression=QSGD(bits=4, exchange="two_stage")).numpy()
    exact = np.sum(grads, axis=0, dtype=np.float64)
    by_bucket = lambda a: np.abs(np.pad(a, (0, -numel % bucket))).reshape(-1, bucket).max(axis=1)  # noqa: E731
    first = sum(by_bucket(g) for g in grads) / 7
    second = (by_bucket(exact) + first) / 7
    bound = np.repeat(first + second, bucket)[:numel] * 1.0001
    assert np.all(np.abs(result - exact) <= bound)
    rel = np.linalg.norm(result - exact) / np.linalg.norm(exact)
    assert 0.01 < rel < 0.5, rel  # quantized, not exact (0.25 here: 3 independent gradients, 4+4 bits)


@pytest.mark.ranks(2)
def test_auto_keeps_the_allgather_at_two_ranks(hvd_torch):
    import torch
    from horovod_qsgd.torch import QSGD
    hvd = hvd_torch
    compressor = QSGD(bits=4)
    hvd.allreduce(torch.ones(200_000), name="big", compression=compressor)
    stats = compressor.compression_stats()
    assert stats["exchanges"] == {"big": "allgather"} and stats["tensors_two_stage"] == 0
    assert stats["collectives_started"] == 1


@pytest.mark.ranks(3)
def test_auto_takes_two_stages_for_large_tensors_from_three_ranks(hvd_torch):
    import torch
    from horovod_qsgd.torch import QSGD
    hvd = hvd_torch
    compressor = QSGD(bits=4)
    big = hvd.allreduce(torch.full((200_000,), 0.5), name="big", compression=compressor, op=hvd.Sum)
    small = hvd.allreduce(torch.full((20_000,), 0.5), name="small", compression=compressor, op=hvd.Sum)
    # Constant tensors quantize exactly in both stages (every value is its bucket's maximum).
    assert torch.equal(big, torch.full((200_000,), 1.5)) and torch.equal(small, torch.full((20_000,), 1.5))
    assert compressor.compression_stats()["exchanges"] == {"big": "two_stage", "small": "allgather"}


@pytest.mark.ranks(3, timeout=120)
def test_optimizer_decompressing_in_a_different_order_on_each_rank_does_not_hang(hvd_torch):
    # Each rank builds its loss so that autograd's hooks fire in another order; Horovod's optimizer then
    # decompresses in that order. A rank that waited for one tensor's second stage before starting the
    # others' would wait for a peer doing the same with another tensor. fusion_threshold=0: every tensor is
    # a group of its own (fused, the three would share one pair of collectives and nothing could be
    # waited for out of order; tests/torch/test_fusion.py reorders the hooks with groups).
    import torch
    from horovod_qsgd.torch import QSGD
    hvd = hvd_torch
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(100_000)) for _ in range(3)]
    names = [(f"p{i}", p) for i, p in enumerate(params)]
    compressor = QSGD(bits=4, fusion_threshold=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), named_parameters=names,
                                   compression=compressor)
    order = [(i + hvd.rank()) % 3 for i in range(3)]
    for step in range(2):
        opt.zero_grad()
        loss = 0
        for i in order:
            loss = loss + (params[i] * torch.from_numpy(_gradient(hvd.rank(), 100_000, step + 10 * i))).sum()
        loss.backward()
        opt.step()
    for i, p in enumerate(params):
        assert _same_on_every_rank(hvd, p.detach(), f"check.p{i}")
    assert set(compressor.compression_stats()["exchanges"].values()) == {"two_stage"}


@pytest.mark.ranks(3, timeout=120)
def test_a_shape_seen_by_one_owner_only_is_reported_on_every_rank(hvd_torch):
    # Rank 2's tensor is one bucket longer: only the last owner's chunk differs, so only rank 2 sees a
    # mismatch in the first stage; its refusal in the second stage makes ranks 0 and 1 raise too.
    import torch
    from horovod_qsgd.common.errors import CompressionMismatchError
    from horovod_qsgd.torch import QSGD
    hvd = hvd_torch
    numel = 3 * 512 * 100 + (512 if hvd.rank() == 2 else 0)
    with pytest.raises(CompressionMismatchError) as info:
        hvd.allreduce(torch.ones(numel), name="layer.weight", compression=QSGD(bits=4, exchange="two_stage"))
    message = str(info.value)
    assert "'layer.weight'" in message, message
    if hvd.rank() == 2:
        assert "elements" in message, message
    else:
        assert "rank 2 found a mismatch" in message, message


def test_exchange_argument_is_checked():
    pytest.importorskip("horovod.torch")
    from horovod_qsgd.torch import QSGD
    with pytest.raises(ValueError, match="exchange='ring'.*'allgather', 'two_stage', 'auto'"):
        QSGD(exchange="ring")
    with pytest.raises(ValueError, match="bits"):
        QSGD(second_stage_bits=1)


@pytest.mark.ranks(2)
def test_sparse_embedding_gradients_pass_through(hvd_torch):
    # Horovod allreduces sparse gradients itself (sparse_as_dense=False) and then calls decompress(output, None).
    import torch
    from horovod_qsgd.torch import QSGD
    hvd = hvd_torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 16, sparse=True), torch.nn.Flatten(),
                                torch.nn.Linear(32, 1000))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=QSGD(bits=8))
    model(torch.tensor([[hvd.rank(), 7]])).sum().backward()
    opt.step()
    grad = model[0].weight.grad
    assert grad.is_sparse
    # Rows 0 and 1 were looked up on one rank each, row 7 on both: Horovod averaged the sparse gradient.
    dense = grad.to_dense()
    assert torch.count_nonzero(dense.abs().sum(dim=1)).item() == 3
    assert _same_on_every_rank(hvd, dense, "check.embedding")


@pytest.mark.parametrize("num_ranks", RANKS_3_AND_4)
def test_top_k_two_stage_matches_the_reference_and_loses_nothing(hvd_torch, num_ranks):
    # Three steps of Sum: every rank's result is bitwise the reference (which carries every rank's sender
    # and owner residuals), and the results plus all residuals add up to all gradients (error feedback).
    import torch
    from horovod_qsgd.codecs import TopKCodec
    from horovod_qsgd.torch import TopK
    hvd = hvd_torch
    numel = 100_003
    compressor = TopK(ratio=0.01, exchange="two_stage")
    codec = TopKCodec(ratio=0.01)
    chunks = _bounds(numel, num_ranks, 1)
    residuals = [np.zeros(numel, np.float32) for _ in range(num_ranks)]
    owner_residuals = [np.zeros(e - b, np.float32) for b, e in chunks]
    delivered = np.zeros(numel, np.float64)
    for step in range(3):
        grads = [_gradient(r, numel, step) for r in range(num_ranks)]
        result = hvd.allreduce(torch.from_numpy(grads[hvd.rank()]), name="t", op=hvd.Sum, compression=compressor)
        want = _reference(codec, codec, "t", grads, step, 1, residuals, owner_residuals)
        assert np.array_equal(result.numpy(), want), step
        delivered += result.numpy()
        # about k nonzeros (each owner sends its share of k), not up to N * k as the allgather would
        assert np.count_nonzero(want) == sum(codec.k(e - b) for b, e in chunks)
    everything = sum(_gradient(r, numel, s).astype(np.float64) for r in range(num_ranks) for s in range(3))
    kept = sum(r.astype(np.float64) for r in residuals) + np.concatenate(owner_residuals)
    np.testing.assert_allclose(delivered + kept, everything, rtol=0, atol=1e-4)
    state = compressor.state_dict()["tensors"]["t"]
    me = hvd.rank()
    assert np.array_equal(state["residual"].numpy(), residuals[me])
    assert np.array_equal(state["owner_residual"].numpy(), owner_residuals[me])
    assert state["owner_layout"] == [num_ranks, me]


@pytest.mark.ranks(3)
def test_top_k_chunk_with_all_the_mass_receives_only_its_share(hvd_torch):
    # Every rank's largest values lie in rank 0's chunk: the alltoall still carries exactly each owner's
    # capacity (the bytes do not depend on the data), and the rest waits in the senders' residuals.
    import torch
    from horovod_qsgd.codecs import TopKCodec
    from horovod_qsgd.torch import TopK
    hvd = hvd_torch
    numel = 90_000
    grad = _gradient(hvd.rank(), numel) * np.float32(1e-3)
    grad[:30_000] *= np.float32(1e6)
    compressor = TopK(ratio=0.01, exchange="two_stage")
    result = hvd.allreduce(torch.from_numpy(grad), name="t", op=hvd.Sum, compression=compressor).numpy()
    codec, chunks, me = TopKCodec(ratio=0.01), _bounds(numel, 3, 1), hvd.rank()
    stats = compressor.compression_stats()
    assert stats["bytes_sent_first_stage"] == sum(16 + codec.max_payload_nbytes(e - b)  # 16: the group's manifest
                                                  for j, (b, e) in enumerate(chunks) if j != me)
    for b, e in chunks:
        assert np.count_nonzero(result[b:e]) == codec.k(e - b)  # 300 per chunk, whatever the mass
    residual = compressor.state_dict()["tensors"]["t"]["residual"].numpy()
    assert np.count_nonzero(residual[:30_000]) == (0 if me == 0 else 30_000 - codec.k(30_000))


@pytest.mark.ranks(3)
def test_owner_residual_from_another_rank_count_is_sent_by_its_rank_or_reset_with_a_warning(hvd_torch):
    # A checkpoint of a 4-rank job (or an elastic reset from 4 to 3 ranks): rank r's owner-side residual
    # belongs to its chunk of 4. It joins rank r's own residual there, so with zero gradients results plus all
    # residuals equal what was loaded. One that fits no chunk of this tensor is reset with a warning.
    import torch
    from horovod_qsgd.torch import TopK
    hvd = hvd_torch
    numel, me = 90_000, hvd.rank()
    compressor = TopK(ratio=0.01, exchange="two_stage")
    hvd.allreduce(torch.zeros(numel), name="t", compression=compressor)
    state = compressor.state_dict()
    loaded = torch.zeros(numel)
    for rank, (b, e) in enumerate(_bounds(numel, 4, 1)):
        loaded[b:e] += rank + 1  # ranks 0-2's owner-side residuals of a 4-rank job; rank 3's went with it
    b, e = _bounds(numel, 4, 1)[me]
    state["tensors"]["t"].update(owner_residual=torch.full((e - b,), me + 1.0), owner_layout=[4, me])
    loaded[_bounds(numel, 4, 1)[3][0]:] = 0
    resumed = TopK(ratio=0.01, exchange="two_stage")
    resumed.load_state_dict(state)
    result = hvd.allreduce(torch.zeros(numel), name="t", op=hvd.Sum, compression=resumed)
    after = resumed.state_dict()["tensors"]["t"]
    assert after["owner_layout"] == [3, me]
    left = hvd.allreduce(after["residual"], name="left", op=hvd.Sum)
    owned = hvd.allgather(after["owner_residual"], name="owned")
    assert torch.equal(result + left + owned, loaded)

    state["tensors"]["t"].update(owner_residual=torch.ones(7), owner_layout=[4, me])  # no chunk of 4 has 7
    resumed = TopK(ratio=0.01, exchange="two_stage")
    resumed.load_state_dict(state)
    with pytest.warns(UserWarning, match="saved as rank .* of 4, this is rank .* of 3; it is reset"):
        hvd.allreduce(torch.zeros(numel), name="t", compression=resumed)
    assert resumed.state_dict()["tensors"]["t"]["owner_layout"] == [3, me]


@pytest.mark.ranks(3)
def test_residual_from_an_allgather_run_is_delivered_once(hvd_torch):
    # A residual saved by a job that used the allgather (here: ones everywhere, as a 2-rank job leaves it)
    # also covers this rank's own chunk, which the two-stage sender never encodes: it must join the owner's
    # sum exactly once. With zero gradients, results plus all residuals must equal the loaded residuals.
    import torch
    from horovod_qsgd.torch import TopK
    hvd = hvd_torch
    numel = 90_000
    compressor = TopK(ratio=0.01, exchange="two_stage")
    hvd.allreduce(torch.zeros(numel), name="t", compression=compressor)
    state = compressor.state_dict()
    state["tensors"]["t"]["residual"] = torch.ones(numel)
    state["tensors"]["t"]["owner_residual"] = None
    compressor.load_state_dict(state)
    result = hvd.allreduce(torch.zeros(numel), name="t", op=hvd.Sum, compression=compressor)
    after = compressor.state_dict()["tensors"]["t"]
    left = hvd.allreduce(after["residual"], name="left", op=hvd.Sum)
    owned = hvd.allgather(after["owner_residual"], name="owned")
    assert torch.equal(result + left + owned, torch.full((numel,), 3.0))


@pytest.mark.ranks(4, timeout=150, alone=True)  # hvd.init with a process set
def test_two_stages_in_a_process_set_of_three_with_groups_and_predivide():
    # Ranks 0-2 form the process set; rank 3 waits outside (Horovod's optimizer broadcasts the groups from
    # global rank 0, which must be in the set). The optimizer groups the two weights and pre-divides: the
    # result must still be the reference average over the three.
    import horovod.torch as hvd
    import torch
    from horovod_qsgd.codecs import QSGDCodec
    from horovod_qsgd.torch import QSGD
    trio = hvd.ProcessSet([0, 1, 2])
    init_with_process_sets(hvd, trio)
    if hvd.rank() == 3:
        hvd.barrier()
        return
    try:
        numel = 70_001
        me = trio.rank()
        params = [torch.nn.Parameter(torch.zeros(numel)) for _ in range(2)]
        compressor = QSGD(bits=4)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=1.0), named_parameters=[("a", params[0]),
                                       ("b", params[1])], compression=compressor, process_set=trio,
                                       groups=[params], gradient_predivide_factor=2.0)
        grads = {name: [_gradient(r + 7 * i, numel) for r in range(3)] for i, name in enumerate("ab")}
        for p, name in zip(params, "ab"):
            p.grad = torch.from_numpy(grads[name][me].copy())
        opt.synchronize()
        codec = QSGDCodec(bits=4)
        for p, name in zip(params, "ab"):
            want = _reference(codec, codec, name, grads[name], 0, 512) * np.float32(1 / 3)
            assert np.array_equal(p.grad.numpy(), want), name
        assert compressor.compression_stats()["exchanges"] == {"a": "two_stage", "b": "two_stage"}
    finally:
        hvd.barrier()


@pytest.mark.ranks(3)
def test_resume_from_state_dict_is_bit_exact_with_the_owner_residual(hvd_torch):
    import torch
    from horovod_qsgd.torch import TopK
    hvd = hvd_torch
    numel, me = 90_000, hvd.rank()

    def step(compressor, s):
        return hvd.allreduce(torch.from_numpy(_gradient(me, numel, s)), name="t", compression=compressor)

    running = TopK(ratio=0.01, exchange="two_stage")
    for s in range(2):
        step(running, s)
    saved = running.state_dict()
    assert saved["tensors"]["t"]["owner_residual"].abs().sum() > 0  # the owner kept something back
    uninterrupted = [step(running, s) for s in (2, 3)]
    resumed = TopK(ratio=0.01, exchange="two_stage")
    resumed.load_state_dict(saved)
    after_resume = [step(resumed, s) for s in (2, 3)]
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, after_resume))
    fresh = TopK(ratio=0.01, exchange="two_stage")
    fresh.load_state_dict(dict(saved, tensors={"t": dict(saved["tensors"]["t"], owner_residual=None)}))
    assert not torch.equal(step(fresh, 2), uninterrupted[0])  # so the owner residual is what made it exact


@pytest.mark.ranks(3)
def test_backward_passes_per_step_sends_the_accumulated_gradient_once(hvd_torch):
    import torch
    from horovod_qsgd.codecs import QSGDCodec
    from horovod_qsgd.torch import QSGD
    hvd = hvd_torch
    numel, me = 70_001, hvd.rank()
    param = torch.nn.Parameter(torch.zeros(numel))
    compressor = QSGD(bits=4)
    opt = hvd.DistributedOptimizer(torch.optim.SGD([param], lr=1.0), named_parameters=[("w", param)],
                                   compression=compressor, backward_passes_per_step=2, op=hvd.Sum)
    parts = [[_gradient(r, numel, s) for s in range(2)] for r in range(3)]
    for s in range(2):
        (param * torch.from_numpy(parts[me][s])).sum().backward()
    opt.synchronize()
    accumulated = [p[0] + p[1] for p in parts]  # float32, as autograd accumulates them
    codec = QSGDCodec(bits=4)
    assert np.array_equal(param.grad.numpy(), _reference(codec, codec, "w", accumulated, 0, 512))
    assert compressor.compression_stats()["tensors_two_stage"] == 1
