"""The checked-in test vectors still encode to the same bytes."""

import numpy as np

from horovod_qsgd.testdata import check_vectors, load_vectors, make_codec


def test_vectors_reencode_byte_for_byte():
    assert check_vectors() == len(load_vectors()) >= 18


def test_vectors_cover_the_configurations():
    names = {c["name"] for c in load_vectors()}
    for needle in ("max_2bit", "max_4bit", "max_8bit", "l2_2bit", "l2_4bit", "l2_8bit", "fp16_scale", "elias",
                   "topk_exact", "topk_gaussian", "topk_sample", "randomk"):
        assert any(needle in n for n in names), needle


def test_vectors_digest_recorded_matches_codec():
    for c in load_vectors():
        assert make_codec(c["codec"], c["config"]).digest == c["digest"]


def test_check_vectors_catches_a_wrong_encoder():
    def broken(codec, x, *, step, key, residual):
        out = np.zeros(codec.max_payload_nbytes(x.size), np.uint8)
        n = codec.encode(x, out, step=step + 1, key=key, residual=residual)
        return out[:n]
    try:
        check_vectors(broken)
    except AssertionError as e:
        assert "differ" in str(e)
    else:
        raise AssertionError("check_vectors accepted a wrong encoder")
