"""The exchange protocol's pure parts, one process: reduction scale, payload walk and decode, settings check."""
import json

import numpy as np
import pytest

from horovod_qsgd.codecs import PayloadError, QSGDCodec, TopKCodec
from horovod_qsgd.codecs.header import HEADER_NBYTES
from horovod_qsgd.common.errors import CompressionMismatchError, RankInJoinError
from horovod_qsgd.common.exchange import check_payloads, decode_gathered, join_notice, reduction_scale
from horovod_qsgd.common.handshake import check_settings, settings_record, verify_settings


@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
def test_reduction_scale_gives_sum_or_average_exactly(ranks):
    assert reduction_scale(ranks, ranks) == 1.0  # Sum: the placeholders add up to N
    assert reduction_scale(1.0, ranks) == 1.0 / ranks  # Average (with or without a predivide factor)
    # an fp16 placeholder rounds N and 1 slightly; both snap back so the decoded sum is scaled exactly
    assert reduction_scale(float(np.float16(ranks * (1 + 4e-3))), ranks) == 1.0
    assert reduction_scale(float(np.float16(1 - 4e-3)), ranks) == 1.0 / ranks


def test_reduction_scale_keeps_other_values():
    # a postscale factor of 0.5 with Sum over 4 ranks: 2.0 is neither N nor 1 and is applied as given
    assert reduction_scale(2.0, 4) == 0.5
    assert reduction_scale(0.0, 4) == 0.0


def _payloads(codec, rows, **encode_args):
    parts = []
    for row in rows:
        out = np.zeros(codec.max_payload_nbytes(row.size), np.uint8)
        parts.append(out[:codec.encode(row, out, **encode_args)])
    return parts


def test_decode_gathered_adds_every_rank_in_rank_order():
    codec = QSGDCodec(bits=8, rounding="deterministic")
    rows = [np.full(300, value, np.float32) for value in (1.0, -2.0, 0.5)]  # constants quantize exactly
    gathered = np.concatenate(_payloads(codec, rows, step=0, key=7))
    total = np.zeros(300, np.float32)
    decode_gathered(codec, gathered, 3, 300, "w", total)
    assert np.array_equal(total, np.full(300, -0.5, np.float32))


def test_hvd_join_notices_are_counted_over_the_whole_buffer_and_raised_after_the_walk():
    codec = QSGDCodec(bits=4)
    notice = np.frombuffer(join_notice(), np.uint8)
    payload, = _payloads(codec, [np.ones(300, np.float32)], step=0, key=1)
    for parts, joined in [([notice, payload, notice], 2), ([payload, notice, payload], 1)]:
        total = np.zeros(300, np.float32)
        with pytest.raises(RankInJoinError) as info:
            decode_gathered(codec, np.concatenate(parts), 3, 300, "w", total)
        assert info.value.joined == joined
    # a mismatch elsewhere in the buffer is still named, not hidden behind the notice
    with pytest.raises(CompressionMismatchError, match="sent no horovod_qsgd payload") as info:
        decode_gathered(codec, np.concatenate([notice, np.full(payload.size, 7, np.uint8)]), 2, 300, "w", total)
    assert not isinstance(info.value, RankInJoinError)


def test_walk_reports_truncation_foreign_bytes_and_size():
    codec = TopKCodec(ratio=0.1)
    rows = [np.arange(100, dtype=np.float32)] * 2
    parts = _payloads(codec, rows, residual=np.zeros(100, np.float32), step=0, key=1)
    buf = np.concatenate(parts)

    def walk(buffer, senders, numels, what="payload"):
        return [span[:2] for span in check_payloads(buffer, senders, numels, codec, "w", what)]

    assert walk(buf, [0, 1], [100, 100]) == [(0, parts[0].size), (parts[0].size, buf.size)]
    with pytest.raises(CompressionMismatchError, match=r"end after \d+ bytes, before rank 1's"):
        walk(buf[:parts[0].size + 8], [0, 1], [100, 100])
    with pytest.raises(CompressionMismatchError, match=r"rank 1's payload says \d+ bytes, only \d+ arrived"):
        walk(buf[:-1], [0, 1], [100, 100])
    foreign = np.concatenate([parts[0], np.full(parts[1].size, 7, np.uint8)])
    with pytest.raises(CompressionMismatchError, match="rank 1 sent no horovod_qsgd owner sum"):
        walk(foreign, [0, 1], [100, 100], what="owner sum")
    other = np.concatenate([parts[0], _payloads(TopKCodec(ratio=0.2), [np.arange(100, dtype=np.float32)],
                                                 residual=np.zeros(100, np.float32), step=0, key=1)[0]])
    with pytest.raises(CompressionMismatchError, match=r"rank 1's payload .*settings digest"):
        walk(other, [0, 1], [100, 100])
    with pytest.raises(CompressionMismatchError, match=r"codec id 1 \(here 2, TopKCodec\)"):
        walk(np.concatenate(_payloads(QSGDCodec(), [np.ones(100, np.float32)], step=0, key=1)), [3], [100])


def test_settings_check_names_each_difference_and_every_rank():
    same = settings_record("QSGD", {"bits": 4, "bucket_size": 512})
    check_settings([same, same, same])
    other = settings_record("QSGD", {"bits": 8, "bucket_size": 512})
    missing = settings_record("QSGD", {"bits": 4})
    with pytest.raises(CompressionMismatchError) as info:
        check_settings([same, other, missing])
    message = str(info.value)
    assert "settings.bits: rank 0=4, rank 1=8, rank 2=4" in message
    assert "settings.bucket_size: rank 0=512, rank 1=512, rank 2='<missing>'" in message
    assert "compressor" not in message.split("\n", 1)[1].split("Every rank")[0]  # equal fields are not listed
    assert json.loads(same)["horovod_qsgd"]  # the version takes part: two versions on one job fail too


def test_verify_settings_splits_the_gathered_records_by_their_lengths():
    records = [settings_record("TopK", {"ratio": r}) for r in (0.01, 0.01, 0.001)]
    calls = []

    def allgather(array, name):  # what the adapter's allgather returns: every rank's array, concatenated
        calls.append((name, array.dtype))
        if name.endswith(".lengths"):
            return np.array([len(r) for r in records], np.int64)
        return np.concatenate([np.frombuffer(r, np.uint8) for r in records])

    with pytest.raises(CompressionMismatchError, match="settings.ratio: rank 0=0.01, rank 1=0.01, rank 2=0.001"):
        verify_settings("TopK", {"ratio": 0.01}, allgather, "hs")
    assert calls == [("hs.lengths", np.int64), ("hs.records", np.uint8)]
    records[2] = records[0]
    verify_settings("TopK", {"ratio": 0.01}, allgather, "hs")


def test_walk_reports_a_fixed_size_payload_of_another_length():
    # Same codec, settings and numel, but the header claims 4 more bytes (and 4 bytes follow): damaged.
    codec = QSGDCodec(bits=4)
    parts = _payloads(codec, [np.ones(1000, np.float32)] * 2, step=0, key=1)
    second = np.concatenate([parts[1], np.zeros(4, np.uint8)])
    second[12:16] = np.frombuffer(np.uint32(parts[1].size + 4).tobytes(), np.uint8)
    with pytest.raises(CompressionMismatchError, match=r"rank 1's payload does not match this rank's: \d+ bytes, where "
                                                       r"a QSGDCodec payload of 1000 elements has \d+: it is damaged"):
        check_payloads(np.concatenate([parts[0], second]), [0, 1], [1000, 1000], codec, "w")


def test_a_top_k_index_out_of_range_is_reported_with_its_payload():
    codec = TopKCodec(ratio=0.1)
    rows = [np.arange(100, dtype=np.float32) * (1 + r) for r in range(3)]
    parts = _payloads(codec, rows, residual=np.zeros(100, np.float32), step=0, key=1)
    parts[1] = parts[1].copy()
    parts[1][16:20] = np.frombuffer(np.int32(105).tobytes(), np.uint8)  # the first index, past the tensor's end
    with pytest.raises(PayloadError, match=r"corrupt top-k payload: 1 entries have an index outside \[0, 100\)"):
        codec.decode_accumulate(parts[1], np.zeros(100, np.float32))
    with pytest.raises(PayloadError, match=r"corrupt top-k payload: 1 entries have an index outside \[0, 100\) "
                                           r"that is not the padding value -1 \(payload number 1 of 3\)"):
        decode_gathered(codec, np.concatenate(parts), 3, 100, "w", np.zeros(100, np.float32))


def test_corrupt_elias_payloads_are_reported_with_their_number():
    codec = QSGDCodec(bits=4, bucket_size=64, encoding="elias")
    rows = [np.linspace(-1, 1, 640, dtype=np.float32) * (1 + r) for r in range(3)]
    parts = [p.copy() for p in _payloads(codec, rows, step=0, key=1)]
    ends = HEADER_NBYTES + 4 * 10  # the bucket ends follow the 10 float32 scales
    streams = ends + 4 * 10
    parts[1][streams:] = 0xFF  # every bucket's stream runs on past its 64 elements
    with pytest.raises(PayloadError,
                       match=r"corrupt Elias stream in bucket 0 \(and 9 more\) \(payload number 1 of 3\)"):
        decode_gathered(codec, np.concatenate(parts), 3, 640, "w", np.zeros(640, np.float32))
    parts[2][ends + 8:ends + 12] = 0xFF  # the third bucket ends past the stream
    with pytest.raises(PayloadError, match=r"offsets are not increasing or run past the stream \(payload number 2 "):
        decode_gathered(codec, np.concatenate([parts[0], parts[0], parts[2]]), 3, 640, "w", np.zeros(640, np.float32))
    with pytest.raises(PayloadError, match=r"^Elias bucket offsets are not increasing or run past the stream$"):
        codec.decode_accumulate(parts[2], np.zeros(640, np.float32))


def test_payloads_decoded_before_their_headers_are_read_still_raise_on_a_mismatch():
    # Same sizes, so decode_gathered decodes first and checks the headers after (one device read): the
    # mismatch must be reported exactly as the walk reports it.
    rows = [np.ones(1000, np.float32)] * 2
    ours, other = QSGDCodec(bits=4), QSGDCodec(bits=4, seed=5)
    parts = _payloads(ours, rows[:1], step=0, key=1) + _payloads(other, rows[1:], step=0, key=2)
    gathered = np.concatenate(parts)
    assert gathered.size == 2 * ours.max_payload_nbytes(1000)
    with pytest.raises(CompressionMismatchError, match=r"rank 1's payload does not match this rank's: settings digest"):
        decode_gathered(ours, gathered, 2, 1000, "w", np.zeros(1000, np.float32))
    newer = np.concatenate(_payloads(ours, rows, step=0, key=1))
    newer[ours.max_payload_nbytes(1000) + 2] = 9  # rank 1's wire format version
    with pytest.raises(CompressionMismatchError, match=r"rank 1's payload does not match this rank's: wire format "
                                                       r"version 9 \(here 1\)"):
        decode_gathered(ours, newer, 2, 1000, "w", np.zeros(1000, np.float32))
    with pytest.raises(CompressionMismatchError, match=r"wire format version 9 \(here 1\)"):
        check_payloads(newer, [0, 1], [1000, 1000], ours, "w")
