"""The compressed reduce-scatter's conduct among N ranks in one process (:mod:`tests.common.loopback`): its one
alltoall, the owners' sums against the codecs alone, the staged rows, a mismatched sender refused."""
import numpy as np
import pytest

from horovod_qsgd.codecs import QSGDCodec, TopKCodec
from horovod_qsgd.common.chunks import chunk_bounds, chunk_unit
from horovod_qsgd.common.collectives import ALLTOALL, HostBuffers
from horovod_qsgd.common.errors import CompressionMismatchError
from horovod_qsgd.common.reduce_scatter import ReduceScatterPlan, RowLayout
from horovod_qsgd.common.stats import CompressionStats
from tests.common.loopback import conduct_all
from tests.reduce_scatter_reference import reduce_scatter_reference, stage, staged

PIECES = [1000, 7, 300]  # a weight's shard, a bias's, another weight's: none a multiple of 128


def test_row_layout_starts_each_piece_at_a_unit_and_pads_the_row_to_one():
    layout = RowLayout(PIECES, 128)
    assert (layout.offsets, layout.staged_numel) == staged(PIECES, 128) == ([0, 1024, 1152], 1536)
    assert layout.runs() == [(0, 0, 1000), (1000, 1024, 7), (1007, 1152, 300)]
    assert not layout.in_place and RowLayout(PIECES, 1).in_place
    # N staged rows are the chunks the two stages own: one rule for the owner of a coordinate
    assert chunk_bounds(3 * layout.staged_numel, 3, 128) == [(0, 1536), (1536, 3072), (3072, 4608)]


@pytest.mark.parametrize("codec", [QSGDCodec(bits=4, bucket_size=128), TopKCodec(ratio=0.05)],
                         ids=["qsgd4", "topk"])
@pytest.mark.parametrize("num_ranks", [2, 3, 4])
def test_every_owner_gets_the_codecs_alone_sum_of_its_row(codec, num_ranks):
    name, unit, feedback = "fsdp.layer0", chunk_unit(codec), isinstance(codec, TopKCodec)
    row_numel = staged(PIECES, unit)[1]
    stats = CompressionStats()
    plans = [ReduceScatterPlan(codec, name, row_numel, num_ranks, rank, stats, 4 * (num_ranks - 1) * sum(PIECES))
             for rank in range(num_ranks)]
    residuals = [np.random.default_rng(9 + r).standard_normal(num_ranks * row_numel).astype(np.float32) * 0.1
                 if feedback else None for r in range(num_ranks)]
    for step in (0, 1):
        xs = [stage(np.random.default_rng(100 * r + step).standard_normal((num_ranks, sum(PIECES)))
                    .astype(np.float32), PIECES, unit) for r in range(num_ranks)]
        ours = [None if r is None else r.copy() for r in residuals]
        asked, returned = conduct_all([plan.conduct(HostBuffers, xs[r], step, ours[r]) for r, plan in enumerate(plans)])
        assert asked == [(ALLTOALL, "horovod_qsgd.payload.fsdp.layer0", True)]
        expected = reduce_scatter_reference(codec, name, xs, step, residuals if feedback else None)
        for rank, (total, refusal) in enumerate(returned):
            assert refusal is None
            np.testing.assert_array_equal(total, expected[rank])
            if feedback:
                np.testing.assert_array_equal(ours[rank], residuals[rank])
                own = slice(rank * row_numel, (rank + 1) * row_numel)
                assert not ours[rank][own].any()  # its mass went into the owner's own sum
    sent = stats.snapshot()
    assert sent["tensors_compressed"] == 2 * num_ranks
    assert sent["bytes_sent"] == 2 * num_ranks * (num_ranks - 1) * codec.max_payload_nbytes(row_numel)


def test_a_sender_with_other_settings_is_refused_by_every_rank():
    """Rank 1 quantizes to 8 bits: each owner it sends to finds a payload of another codec, and rank 1 finds
    the others' payloads foreign; every rank returns the error, none decodes garbage into its sum."""
    codecs = [QSGDCodec(bits=4, bucket_size=128), QSGDCodec(bits=8, bucket_size=128), QSGDCodec(bits=4, bucket_size=128)]
    row_numel = staged(PIECES, 128)[1]
    plans = [ReduceScatterPlan(c, "w", row_numel, 3, r, CompressionStats(), 0) for r, c in enumerate(codecs)]
    xs = [np.ones(3 * row_numel, np.float32)] * 3
    _, returned = conduct_all([p.conduct(HostBuffers, xs[r], 0) for r, p in enumerate(plans)], sized=False)
    for rank, (_, refusal) in enumerate(returned):
        assert isinstance(refusal, CompressionMismatchError), rank
        assert "'w'" in str(refusal)
