"""The framework-free parts of the exchanges: chunk plan, exchange choice, payload walk, state checks."""
import numpy as np
import pytest

from horovod_qsgd.codecs import QSGDCodec, TopKCodec
from horovod_qsgd.common.errors import CompressionMismatchError
from horovod_qsgd.common.exchange import check_payloads, refusal_notice
from horovod_qsgd.common.state import check_loadable, state_header
from horovod_qsgd.common.chunks import chunk_bounds
from horovod_qsgd.common.two_stage import TwoStage, choose_exchange
from tests.two_stage_reference import first_stage_inboxes


@pytest.mark.parametrize("numel, ranks, unit", [(100_003, 3, 512), (1_000, 4, 512), (7, 8, 1), (0, 3, 512),
                                                (512 * 12, 4, 512), (90_000, 3, 1)])
def test_chunks_cover_the_tensor_once_on_bucket_edges(numel, ranks, unit):
    bounds = chunk_bounds(numel, ranks, unit)
    assert len(bounds) == ranks and bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert all(begin % unit == 0 for begin, _ in bounds)
    sizes = [e - b for b, e in bounds]
    whole_units = [-(-s // unit) for s in sizes]
    assert max(whole_units) - min(whole_units) <= 1  # as equal as whole buckets allow


def test_auto_takes_the_allgather_for_two_ranks_and_small_tensors():
    q4, k1 = QSGDCodec(bits=4), TopKCodec(ratio=0.01)
    for codec in (q4, k1):
        assert choose_exchange("auto", codec, codec, 10 ** 6, 2) == "allgather"
        assert choose_exchange("auto", codec, codec, 65_535, 8) == "allgather"
        assert choose_exchange("auto", codec, codec, 10 ** 6, 3) == "two_stage"
        assert choose_exchange("allgather", codec, codec, 10 ** 6, 8) == "allgather"
        assert choose_exchange("two_stage", codec, codec, 100, 2) == "two_stage"


def test_walk_names_the_sender_and_the_difference():
    codec = QSGDCodec(bits=4)
    payloads = []
    for numel in (1000, 1000, 1200):
        out = np.zeros(codec.max_payload_nbytes(numel), np.uint8)
        payloads.append(out[:codec.encode(np.ones(numel, np.float32), out, step=0, key=1)])
    buf = np.concatenate(payloads)

    with pytest.raises(CompressionMismatchError, match=r"tensor 'w': rank 2's payload .* 1200 elements \(here 1000\)"):
        check_payloads(buf, [0, 1, 2], [1000] * 3, codec, "w")
    refused = np.concatenate([payloads[0], np.frombuffer(refusal_notice(), np.uint8)])
    with pytest.raises(CompressionMismatchError, match="rank 5 found a mismatch"):
        check_payloads(refused, [0, 5], [1000, 0], codec, "w")
    with pytest.raises(CompressionMismatchError, match="unexpected bytes"):
        check_payloads(buf, [0, 1], [1000, 1000], codec, "w")


def test_two_stage_in_one_process_sums_every_rank():
    # Constant gradients quantize exactly in both stages, so the result is the exact sum.
    ranks, numel = 3, 5000
    codec = QSGDCodec(bits=4, bucket_size=256)
    stages = [TwoStage(codec, codec, "w", numel, ranks, r) for r in range(ranks)]
    grads = [np.full(numel, r + 1.0, np.float32) for r in range(ranks)]
    sums = []
    for r, (stage, received) in enumerate(zip(stages, first_stage_inboxes(stages, grads))):
        begin, end = stage.owned
        total = grads[r][begin:end].copy()
        stage.accumulate_received(received, total)
        out = np.zeros(stage.owned_capacity(), np.uint8)
        sums.append(out[:stage.encode_owned(total, out, step=0)])
    gathered = np.concatenate(sums)
    result = np.zeros(numel, np.float32)
    stages[1].decode_gathered(gathered, result)
    assert np.array_equal(result, np.full(numel, 6.0, np.float32))


def test_state_checks_name_the_difference_and_accept_states_from_before_the_exchange_setting():
    settings = {"bits": 4, "min_numel": 10000, "exchange": "auto", "second_stage_bits": 4}
    check_loadable(dict(state_header("QSGD", settings), tensors={}), "QSGD", settings)
    older = state_header("QSGD", {"bits": 4, "min_numel": 10000})  # written before exchange existed
    check_loadable(older, "QSGD", settings)
    with pytest.raises(ValueError, match="differ in bits"):
        check_loadable(state_header("QSGD", dict(settings, bits=8)), "QSGD", settings)
    with pytest.raises(ValueError, match="cannot load a 'TopK' state"):
        check_loadable(state_header("TopK", settings), "QSGD", settings)


@pytest.mark.parametrize("num_ranks, exchange", [(2, "allgather"), (3, "two_stage")])
def test_either_plan_answers_what_an_adapter_asks_without_naming_its_kind(num_ranks, exchange):
    """An adapter whose graph takes either plan (TensorFlow's elastic one) asks each plan alike: whether its
    first collective is an alltoall (Horovod does not fuse those), its owner layout, its own chunk, and its
    conduct."""
    from horovod_qsgd.common.collectives import ALLTOALL, HostBuffers
    from horovod_qsgd.common.engine import NO_OWNER, PayloadEngine
    from horovod_qsgd.common.stats import CompressionStats
    codec = TopKCodec(ratio=0.01)
    numel, rank = 100_000, 1
    x = np.random.default_rng(3).standard_normal(numel).astype(np.float32)
    plans = [PayloadEngine(codec, codec, exchange, CompressionStats()).plan("w", numel, num_ranks, rank, 4 * numel, 4)
             for _ in range(2)]
    assert type(plans[0]).__name__ == {"allgather": "AllgatherPlan", "two_stage": "TwoStagePlan"}[exchange]
    plan = plans[0]
    assert plan.starts_with_alltoall == (plan.collectives()[0][0] == ALLTOALL) == (exchange == "two_stage")
    assert plan.owner_layout() == ([num_ranks, rank] if exchange == "two_stage" else list(NO_OWNER))
    assert plan.own_numel() == (plan.owned[1] - plan.owned[0] if exchange == "two_stage" else 0)
    # its conduct asks first for what collectives() states
    conduct = plan.conduct(HostBuffers, x, 5, np.zeros(numel, np.float32))
    assert next(conduct).kind == plan.collectives()[0][0]
