"""The engine's exchanges conducted among N ranks in one process (:mod:`tests.common.loopback`): the
collectives each asks for, in order, and the sum every rank decodes, against the reference built from the
codecs alone. The adapters' multi-rank tests run the same conducts under horovodrun and torchrun."""
import numpy as np
import pytest

from horovod_qsgd.codecs import QSGDCodec, TopKCodec
from horovod_qsgd.common.chunks import chunk_unit
from horovod_qsgd.common.collectives import ALLGATHER, ALLTOALL, HostBuffers, RefusedEarlier, conclude, drive
from horovod_qsgd.common.engine import PayloadEngine
from horovod_qsgd.common.errors import CompressionMismatchError
from horovod_qsgd.common.exchange import refusal_notice
from horovod_qsgd.common.fusion import FusedTwoStage
from horovod_qsgd.common.naming import rank_key
from horovod_qsgd.common.stats import CompressionStats
from tests.common.loopback import conduct_all
from tests.two_stage_reference import gradient, reference


@pytest.mark.parametrize("exchange, codec", [
    ("allgather", QSGDCodec(bits=4, bucket_size=128)),
    ("two_stage", QSGDCodec(bits=4, bucket_size=128)),
    ("two_stage", TopKCodec(ratio=0.05)),
    ("allgather", TopKCodec(ratio=0.05)),
])
@pytest.mark.parametrize("num_ranks", [2, 3, 4])
def test_every_rank_decodes_the_reference_sum_from_the_collectives_it_named(exchange, codec, num_ranks):
    numel, step, name = 10_000, 2, "w"
    grads = [gradient(r, numel, step) for r in range(num_ranks)]
    feedback = isinstance(codec, TopKCodec)
    residuals = [np.random.default_rng(7 + r).standard_normal(numel).astype(np.float32) * 0.1 if feedback else None
                 for r in range(num_ranks)]
    ours = [None if r is None else r.copy() for r in residuals]
    engine = PayloadEngine(codec, codec, exchange, CompressionStats())
    plans = [engine.plan(name, numel, num_ranks, rank, 4 * numel, 0) for rank in range(num_ranks)]
    owner_residuals = [np.zeros(p.own_numel(), np.float32) if feedback and exchange == "two_stage" else None
                       for p in plans]
    ours_owner = [None if o is None else o.copy() for o in owner_residuals]
    conducts = [plan.conduct(HostBuffers, grads[r], step, ours[r], lambda r=r: ours_owner[r])
                for r, plan in enumerate(plans)]
    asked, returned = conduct_all(conducts)
    # what a graph builds in advance (tensorflow/conduct.py) is what the conduct asks for
    assert all([(kind, name) for kind, name, _ in asked] == plan.collectives() for plan in plans)

    if exchange == "allgather":
        assert asked == [(ALLGATHER, "horovod_qsgd.payload.w", True)]
        expected = np.zeros(numel, np.float32)
        for r in range(num_ranks):
            buf = np.zeros(codec.max_payload_nbytes(numel), np.uint8)
            used = codec.encode(grads[r], buf, step=step, key=rank_key(name, r),
                                residual=residuals[r])
            codec.decode_accumulate(buf[:used], expected)
    else:
        assert asked == [(ALLTOALL, "horovod_qsgd.payload.w", False),
                         (ALLGATHER, "horovod_qsgd.sum.w", True)]
        expected = reference(codec, codec, name, grads, step, chunk_unit(codec), residuals if feedback else None,
                             owner_residuals if feedback else None)
    for plan, (gathered, refusal) in zip(plans, returned):
        assert refusal is None
        total = np.zeros(numel, np.float32)
        plan.decode(gathered, total)
        np.testing.assert_array_equal(total, expected)
    if feedback:  # every rank's error-feedback state as the reference left it
        for r in range(num_ranks):
            np.testing.assert_array_equal(ours[r], residuals[r])
            if owner_residuals[r] is not None:
                np.testing.assert_array_equal(ours_owner[r], owner_residuals[r])


def test_a_mismatched_slice_is_refused_on_every_rank_after_the_last_collective():
    """Rank 2 encodes 4-bit, the others 8-bit: each owner that receives its slice refuses, sends the notice in
    place of its sum, and every rank gets the error with what the last collective received, none before."""
    numel, num_ranks = 10_000, 3
    plans = []
    for rank in range(num_ranks):
        codec = QSGDCodec(bits=4 if rank == 2 else 8, bucket_size=128)
        plans.append(PayloadEngine(codec, codec, "two_stage", CompressionStats()).plan("w", numel, num_ranks, rank,
                                                                                        4 * numel, 0))
    conducts = [p.conduct(HostBuffers, gradient(r, numel), 0) for r, p in enumerate(plans)]
    asked, returned = conduct_all(conducts, sized=False)  # the slices' sizes differ, as Horovod carries them
    assert [kind for kind, _, _ in asked] == [ALLTOALL, ALLGATHER]
    for rank, (gathered, refusal) in enumerate(returned):
        assert gathered is not None
        if rank == 2:  # its own slices matched nobody's codec, but what it received is 8-bit from both senders
            assert isinstance(refusal, CompressionMismatchError) and "rank 0" in str(refusal)
        else:
            assert isinstance(refusal, CompressionMismatchError) and "rank 2" in str(refusal)
        with pytest.raises(CompressionMismatchError):  # the bytes it received carry the others' notices
            plans[rank].decode(gathered, np.zeros(numel, np.float32))


def test_drive_runs_a_conduct_to_its_end_through_one_function():
    codec = QSGDCodec(bits=8, bucket_size=128)
    plan = PayloadEngine(codec, codec, "allgather", CompressionStats()).plan("w", 1000, 1, 0, 4000, 0)
    seen = []

    def run(collective):
        seen.append(collective.kind)
        return np.asarray(collective.send)
    gathered, refusal = drive(plan.conduct(HostBuffers, gradient(0, 1000), 0), run)
    total = np.zeros(1000, np.float32)
    plan.decode(gathered, total)
    assert seen == [ALLGATHER] and refusal is None
    np.testing.assert_allclose(total, gradient(0, 1000), atol=np.abs(gradient(0, 1000)).max() / 127)


def _fused_conducts(codec, sizes, num_ranks, step):
    """Every rank's conduct of one fused group of tensors of ``sizes``, each member encoded as alone."""
    conducts, plans = [], []
    for rank in range(num_ranks):
        engine = PayloadEngine(codec, codec, "two_stage", CompressionStats())
        members = [engine.plan(f"t{m}", numel, num_ranks, rank, 4 * numel, 0) for m, numel in enumerate(sizes)]
        slices, splits, owns = [], [], []
        for m, plan in enumerate(members):
            out, own = np.zeros(plan.capacity(), np.uint8), np.empty(plan.own_numel(), np.float32)
            member_splits = plan.encode(gradient(rank, sizes[m], step + m), out, own, step)
            slices.append(out[:sum(member_splits)])
            splits.append(member_splits)
            owns.append(own)
        fused = FusedTwoStage(members)
        conducts.append(fused.conduct(HostBuffers, "group1", slices, splits, owns, [step] * len(sizes),
                                      lambda n=len(sizes): [None] * n))
        plans.append(fused)
    return conducts, plans


@pytest.mark.parametrize("num_ranks", [3, 4])
def test_a_fused_group_is_conducted_to_the_sums_of_its_members_alone(num_ranks):
    codec, sizes, step = QSGDCodec(bits=4, bucket_size=128), [5_000, 700, 12_345], 1
    conducts, groups = _fused_conducts(codec, sizes, num_ranks, step)
    asked, returned = conduct_all(conducts, sized=False)
    assert asked == [(ALLTOALL, "horovod_qsgd.payload.group1", False),
                     (ALLGATHER, "horovod_qsgd.sum.group1", True)]
    assert [(kind, name) for kind, name, _ in asked] == FusedTwoStage.collectives("group1")
    for group, (gathered, refusal) in zip(groups, returned):
        assert refusal is None
        outs = [np.zeros(n, np.float32) for n in sizes]
        group.decode(gathered, outs)
        for m, (numel, out) in enumerate(zip(sizes, outs)):
            expected = reference(codec, codec, f"t{m}", [gradient(r, numel, step + m) for r in range(num_ranks)],
                                 step, chunk_unit(codec))
            np.testing.assert_array_equal(out, expected)


def test_a_group_after_a_refusal_sends_the_notice_without_waiting_for_its_first_collective():
    codec = QSGDCodec(bits=4, bucket_size=128)
    conducts, groups = _fused_conducts(codec, [5_000, 700], 3, 0)
    earlier = CompressionMismatchError("rank 1's payload does not match")
    for conduct, group in zip(conducts, groups):
        assert next(conduct).kind == ALLTOALL
        collective = conduct.throw(RefusedEarlier(earlier))
        assert (collective.kind, collective.final, collective.refusal) == (ALLGATHER, True, earlier)
        assert bytes(np.asarray(collective.send)) == refusal_notice()
    gathered = np.concatenate([np.frombuffer(refusal_notice(), np.uint8)] * 3)
    gathered_back, refusal = conclude(conducts[0], gathered)
    assert refusal is earlier and gathered_back is gathered
    with pytest.raises(CompressionMismatchError, match="found a mismatch"):
        groups[0].decode(gathered, [np.zeros(5_000, np.float32), np.zeros(700, np.float32)])
