"""DiLoCo over torch.distributed (horovod_qsgd.ddp.DiLoCo) under torchrun (Gloo) on 2, 3 and 4 ranks: the outer
steps bitwise the codecs' reference (tests/diloco_reference.py: the model as one flat tensor), a bitwise
resume, refusals on every rank."""
import copy

import numpy as np
import pytest

from tests.diloco_reference import OUTER_LR, OUTER_MOMENTUM, SIZES, Reference, local_steps, model

SHARED_LAUNCHES = "torch.distributed"  # one launch per rank count and env (tests/multirank.py)
RANKS_234 = [pytest.param(n, marks=pytest.mark.ranks(n, timeout=170, launcher="torchrun")) for n in (2, 3, 4)]


def _gathered(dist, module):
    import torch
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return torch.stack(out)


def _diloco(module, compression, inner=None, **kwargs):
    import torch
    kwargs.setdefault("warmup_steps", 0)  # local steps from the first
    from horovod_qsgd.ddp import DiLoCo
    inner = inner or torch.optim.SGD(module.parameters(), lr=1.0)
    return DiLoCo(inner, module.named_parameters(), compression=compression, outer_lr=OUTER_LR,
                  outer_momentum=OUTER_MOMENTUM, **kwargs)


@pytest.mark.parametrize("n", RANKS_234)
def test_outer_steps_are_bitwise_the_codecs_reference_on_every_rank(dist_gloo, n):
    import torch
    from horovod_qsgd.ddp import QSGDState, TopKState
    dist = dist_gloo
    two_stage = "-two-stage" if n > 2 else ""  # "auto": the allgather at 2 ranks, two stages from 3 (70,001 values)
    for kind, compression in (("none", None), ("qsgd" + two_stage, QSGDState(bits=4)),
                              ("topk" + two_stage, TopKState(ratio=0.05))):
        module = model()
        opt = _diloco(module, compression, sync_every=3)
        reference = Reference(kind, n, [("diloco.outer", list(SIZES))])
        for outer, steps in enumerate(([0, 1, 2], [3, 4, 5], [6, 7, 8])):
            local_steps(opt, module, dist.get_rank(), steps)
            want = reference.outer_step(steps)
            everyone = _gathered(dist, module)
            assert all(torch.equal(everyone[0], everyone[r]) for r in range(n)), kind
            if kind == "none":
                np.testing.assert_allclose(everyone[0].numpy(), want, rtol=0, atol=1e-5)
            else:
                assert np.array_equal(everyone[0].numpy(), want), (kind, outer)
        stats = opt.compression_stats()
        assert stats["outer_steps"] == 3 and stats["bytes_uncompressed"] == 3 * 4 * sum(SIZES.values())
        if compression is None:
            assert stats["bytes_sent"] == stats["bytes_uncompressed"]
        else:
            assert stats["exchanges"] == {"diloco.outer": "two_stage" if two_stage else "allgather"}
            assert stats["compression_ratio"] > (6 if kind.startswith("qsgd") else 1.5)


@pytest.mark.parametrize("n", RANKS_234)
def test_resume_from_each_ranks_checkpoint_is_bitwise_the_uninterrupted_run(dist_gloo, n):
    import torch
    from horovod_qsgd.ddp import TopKState
    dist = dist_gloo

    def build():
        module = model()
        return module, _diloco(module, TopKState(ratio=0.05), inner=torch.optim.AdamW(module.parameters(), lr=0.01),
                               sync_every=3)

    module, opt = build()
    local_steps(opt, module, dist.get_rank(), range(5))
    saved = copy.deepcopy({"model": module.state_dict(), "opt": opt.state_dict()})
    local_steps(opt, module, dist.get_rank(), range(5, 11))
    uninterrupted = _gathered(dist, module)
    module, opt = build()
    module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    local_steps(opt, module, dist.get_rank(), range(5, 11))
    assert torch.equal(uninterrupted, _gathered(dist, module))
    assert saved["opt"]["diloco"]["compression"]["residuals"]["outer"][0].abs().sum() > 0


@pytest.mark.parametrize("n", RANKS_234)
def test_settings_or_starting_models_that_differ_are_refused_on_every_rank(dist_gloo, n):
    from horovod_qsgd.ddp import CompressionMismatchError, QSGDState
    dist = dist_gloo
    module = model()
    opt = _diloco(module, QSGDState(bits=4 if dist.get_rank() else 2), sync_every=4)
    with pytest.raises(CompressionMismatchError, match=r"bits: rank 0=2, rank 1=4"):
        local_steps(opt, module, dist.get_rank(), [0])
    module = model(seed=dist.get_rank() % 2)
    opt = _diloco(module, None, sync_every=4)
    with pytest.raises(CompressionMismatchError, match=r"model_digest(.|\n)*torch.distributed.broadcast"):
        local_steps(opt, module, dist.get_rank(), [0])


def test_horovod_compressors_and_no_process_group_are_refused_with_the_fix():
    import torch
    from horovod_qsgd.ddp import DiLoCo
    module = model()
    inner = torch.optim.SGD(module.parameters(), lr=1.0)
    with pytest.raises(TypeError, match="takes compression=None, QSGDState.* not a QSGD; .*horovod_qsgd.torch.DiLoCo"):
        DiLoCo(inner, module.named_parameters(), compression=type("QSGD", (), {})())
    with pytest.raises(RuntimeError, match="needs torch.distributed.init_process_group"):
        DiLoCo(inner, module.named_parameters())
