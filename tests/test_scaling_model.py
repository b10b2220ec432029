"""benchmarks/scaling.py's count of message steps: fused two-stage tensors share their collectives."""
import pytest

COSTS = {"qsgd_encode": 1e-9, "qsgd_decode_accumulate": 1e-9, "topk_select": 1e-9, "sparse_accumulate": 1e-9}


@pytest.mark.parametrize("name", ["qsgd-4bit", "topk-1%"])
def test_fused_two_stages_negotiate_one_alltoall_per_fusion_buffer(name):
    pytest.importorskip("horovod.torch")
    from benchmarks.scaling import FUSION_BYTES, step_terms
    ranks, sizes = 64, [1 << 20] * 24  # the projected 25M model: 24 tensors, about 13 MB of QSGD-4 payload
    codec_f, received_f, steps_f, rounds_f = step_terms(name, "two_stage", sizes, ranks, COSTS)
    codec_u, received_u, steps_u, rounds_u = step_terms(name, "two_stage_unfused", sizes, ranks, COSTS)
    assert (codec_f, received_f) == (codec_u, received_u)  # fusion changes the packing, not the bytes
    assert rounds_u - rounds_f == 23 and steps_u - steps_f == 23 * (ranks - 1)
    # Past the fusion threshold a step needs more alltoalls: 400 tensors, one per 64 MiB of first-stage payload.
    from benchmarks.scaling import _codecs
    from horovod_qsgd.common.two_stage import TwoStage
    _, first, second = _codecs(name)
    payload = 400 * TwoStage(first, second, "", 1 << 20, ranks, 0).payload_capacity()
    groups = -(-payload // FUSION_BYTES)
    assert groups == (4 if name == "qsgd-4bit" else 1), payload
    _, _, _, rounds_f = step_terms(name, "two_stage", [1 << 20] * 400, ranks, COSTS)
    _, _, _, rounds_u = step_terms(name, "two_stage_unfused", [1 << 20] * 400, ranks, COSTS)
    assert rounds_u - rounds_f == 400 - groups
