"""The public codec surface: constructor validation, digest, header, errors."""

import json
import subprocess
import sys

import numpy as np
import pytest

from horovod_qsgd.codecs import (HEADER_NBYTES, PayloadError, QSGDCodec, RandomKCodec, TopKCodec,
                                 parse_header, split_payloads)
from horovod_qsgd.codecs.header import WIRE_VERSION

from tests.kernels.helpers import bits_equal, decode, encode

ALL = [QSGDCodec(), QSGDCodec(encoding="elias"), TopKCodec(), TopKCodec(selector="gaussian"), RandomKCodec()]


@pytest.mark.parametrize("factory,arg,bad,allowed", [
    (QSGDCodec, "bits", 1, "2..8"), (QSGDCodec, "bits", 9, "2..8"), (QSGDCodec, "bucket_size", 0, "1..4294967295"),
    (QSGDCodec, "norm", "l1", "'max', 'l2'"), (QSGDCodec, "encoding", "huffman", "'fixed', 'elias'"),
    (QSGDCodec, "scale_dtype", "bfloat16", "'float32', 'float16'"),
    (QSGDCodec, "rounding", "nearest", "'stochastic', 'deterministic'"),
    (TopKCodec, "ratio", 0.0, "(0, 1]"), (TopKCodec, "ratio", 1.5, "(0, 1]"),
    (TopKCodec, "selector", "random", "'exact', 'gaussian', 'sample'"),
    (TopKCodec, "value_dtype", "int8", "'float32', 'float16'"),
    (RandomKCodec, "ratio", -0.1, "(0, 1]"), (RandomKCodec, "value_dtype", "float64", "'float32', 'float16'"),
])
def test_constructor_errors_name_argument_value_and_allowed(factory, arg, bad, allowed):
    with pytest.raises(ValueError) as e:
        factory(**{arg: bad})
    msg = str(e.value)
    assert arg in msg and repr(bad) in msg and allowed in msg


def test_ids_configs_and_digests():
    assert len({QSGDCodec.codec_id, TopKCodec.codec_id, RandomKCodec.codec_id}) == 3
    for c in ALL:
        json.dumps(c.config())
        assert 0 <= c.digest < 2 ** 32
    assert QSGDCodec().digest != QSGDCodec(bits=3).digest
    assert QSGDCodec(seed=1).digest != QSGDCodec().digest
    assert TopKCodec().digest != TopKCodec(value_dtype="float16").digest
    assert len({c.digest for c in ALL}) == len(ALL)


def test_digest_is_stable_across_processes():
    code = ("from horovod_qsgd.codecs import QSGDCodec, TopKCodec, RandomKCodec;"
            "print(QSGDCodec().digest, TopKCodec().digest, RandomKCodec().digest)")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", **__import__("os").environ}).stdout.split()
    assert [int(v) for v in got] == [QSGDCodec().digest, TopKCodec().digest, RandomKCodec().digest]


def test_header_fields():
    codec = QSGDCodec(bits=4, bucket_size=64)
    x = np.ones(1000, np.float32)
    p = encode(codec, x)
    h = parse_header(p)
    assert (h.version, h.codec_id, h.numel, h.digest, h.nbytes) == (WIRE_VERSION, 1, 1000, codec.digest, p.size)
    assert bytes(p[:2]) == b"HQ" and HEADER_NBYTES == 16
    assert parse_header(bytes(p)) == h


def test_concatenated_payloads_are_walked_by_length():
    parts = []
    for i, c in enumerate(ALL):
        x = np.random.default_rng(i).standard_normal(100 + 37 * i).astype(np.float32)
        r = np.zeros_like(x)
        parts.append((c, x, encode(c, x, step=1, key=i, residual=r)))
    buf = np.concatenate([p for _, _, p in parts])
    found = split_payloads(buf)
    assert [h.nbytes for _, h in found] == [p.size for _, _, p in parts]
    for (off, h), (c, x, p) in zip(found, parts):
        assert np.array_equal(decode(c, buf[off:off + h.nbytes], x.size), decode(c, p, x.size))


@pytest.mark.parametrize("codec", ALL, ids=repr)
def test_decode_sum_is_each_payload_decoded_in_order_and_counts_its_faults_where_asked(codec):
    xs = [np.random.default_rng(i).standard_normal(640).astype(np.float32) for i in range(3)]
    parts = [encode(codec, x, step=1, key=i, residual=np.zeros_like(x)) for i, x in enumerate(xs)]
    buf = np.concatenate(parts)
    starts = np.cumsum([0] + [p.size for p in parts])
    spans = [(int(b), int(e), None) for b, e in zip(starts[:-1], starts[1:])]
    total, apart = np.zeros(640, np.float32), [np.zeros(640, np.float32) for _ in parts]
    codec.decode_sum(buf, spans, [total] * 3)  # one output given three times: the sum, in payload order
    codec.decode_sum(buf, spans, apart)
    expected = np.zeros(640, np.float32)
    for p in parts:
        expected += decode(codec, p, 640)
    assert bits_equal(total, expected)
    assert all(bits_equal(a, decode(codec, p, 640)) for a, p in zip(apart, parts))
    with pytest.raises(ValueError, match="device records need decodes_chained and fault counters"):
        codec.decode_sum(buf, np.zeros((3, 2), np.int64), apart)
    if not codec.fault_width:
        return
    damaged = buf.copy()  # payload 1's first index (top-k) or first bucket's end (Elias, after the scales) past the end
    at = int(starts[1]) + HEADER_NBYTES + (0 if isinstance(codec, TopKCodec) else 4 * -(-640 // codec.bucket_size))
    damaged[at:at + 4] = np.frombuffer(np.int32(1 << 30).tobytes(), np.uint8)
    faults = np.zeros(3 * codec.fault_width, np.int64)
    codec.decode_sum(damaged, spans, [np.zeros(640, np.float32) for _ in parts], faults)  # counted, not raised
    assert faults.reshape(3, -1)[[0, 2]].sum() == 0 and faults.reshape(3, -1)[1].any()
    headers = [parse_header(bytes(p[:HEADER_NBYTES])) for p in parts]
    with pytest.raises(PayloadError, match=r"\(payload number 1 of 3\)$"):
        codec.raise_for_faults(faults.view(np.uint8), headers)
    with pytest.raises(PayloadError, match=r"\(payload number 1 of 3\)$"):
        codec.decode_sum(damaged, spans, [np.zeros(640, np.float32) for _ in parts])


def test_decode_mismatches_raise_payload_error():
    codec = QSGDCodec(bits=4, bucket_size=64)
    x = np.random.default_rng(0).standard_normal(300).astype(np.float32)
    p = encode(codec, x)
    with pytest.raises(PayloadError, match=r"300 elements \(here 301\): the tensor's shape differs"):
        decode(codec, p, 301)
    with pytest.raises(PayloadError, match="digest"):
        decode(QSGDCodec(bits=4, bucket_size=32), p, 300)
    with pytest.raises(PayloadError, match="codec id"):
        decode(TopKCodec(), p, 300)
    with pytest.raises(PayloadError, match="truncated"):
        decode(codec, p[:-8], 300)
    with pytest.raises(PayloadError, match="truncated"):
        decode(codec, p[:10], 300)
    with pytest.raises(PayloadError, match="exactly one payload"):
        decode(codec, np.concatenate([p, p]), 300)
    bad = p.copy()
    bad[2] = WIRE_VERSION + 1
    with pytest.raises(PayloadError, match="version"):
        decode(codec, bad, 300)
    bad = p.copy()
    bad[0] = ord("X")
    with pytest.raises(PayloadError, match="magic"):
        decode(codec, bad, 300)


def test_encode_argument_validation():
    codec = TopKCodec(ratio=0.1)
    x = np.ones(100, np.float32)
    out = np.zeros(codec.max_payload_nbytes(100), np.uint8)
    with pytest.raises(ValueError, match="residual"):
        codec.encode(x, out, step=0, key=0)
    with pytest.raises(TypeError, match="out must be a 1-D uint8"):
        codec.encode(x, out.view(np.int8), step=0, key=0, residual=np.zeros(100, np.float32))
    with pytest.raises(ValueError, match="payload needs"):
        codec.encode(x, out[:-1], step=0, key=0, residual=np.zeros(100, np.float32))
    with pytest.raises(ValueError, match="1-D"):
        codec.encode(x.reshape(10, 10), out, step=0, key=0, residual=np.zeros(100, np.float32))
    with pytest.raises(ValueError, match="residual has 99"):
        codec.encode(x, out, step=0, key=0, residual=np.zeros(99, np.float32))
    with pytest.raises(TypeError, match="residual must be a 1-D float32"):
        codec.encode(x, out, step=0, key=0, residual=np.zeros(100, np.float64))
    with pytest.raises(ValueError, match="key"):
        codec.encode(x, out, step=0, key=-1, residual=np.zeros(100, np.float32))
    with pytest.raises(TypeError, match="numpy array"):
        codec.encode([1.0, 2.0], out, step=0, key=0)


def test_fixed_sizes_are_exact_and_elias_is_bounded():
    for c in ALL:
        for n in (1, 100, 4097):
            x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
            p = encode(c, x, residual=np.zeros(n, np.float32))
            assert p.size % 4 == 0
            if c.payload_nbytes_is_fixed:
                assert p.size == c.max_payload_nbytes(n)
            else:
                assert p.size <= c.max_payload_nbytes(n)
