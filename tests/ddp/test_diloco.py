"""DiLoCo over torch.distributed (horovod_qsgd.ddp.DiLoCo) under torchrun (Gloo) on 2, 3 and 4 ranks: the outer
steps bitwise the codecs' reference (tests/diloco_reference.py: the model as one flat tensor), a bitwise
resume, refusals on every rank."""
import copy

import numpy as np
import pytest

from tests.diloco_reference import OUTER_LR, OUTER_MOMENTUM, SIZES, Reference, assert_every_rank_holds, local_steps
from tests.diloco_reference import DEFAULT_OUTER_LRS, check_streaming, model, node_average

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
            assert_every_rank_holds(everyone, want, kind, (kind, outer))
        stats = opt.compression_stats()
        assert stats["outer_steps"] == 3 and stats["bytes_uncompressed"] == 3 * 4 * sum(SIZES.values())
        if compression is None:
            assert stats["bytes_sent"] == stats["bytes_uncompressed"]
        else:
            assert stats["exchanges"] == {"diloco.outer": "two_stage" if two_stage else "allgather"}
            assert stats["compression_ratio"] > (6 if kind.startswith("qsgd") else 1.5)


@pytest.mark.parametrize("n", RANKS_234)
def test_the_default_outer_lr_falls_below_sync_every_16_more_slowly_with_more_ranks(dist_gloo, n):
    """outer_lr and outer_momentum at their defaults (0.8): at 2 ranks 0.2 at H=4 (not under 1 - 0.8), 0.35 at
    H=8, 0.7 at H=16; sqrt(ranks / 2) times more at 3 and 4 ranks below H=16; two outer steps each bitwise the
    reference at that lr (the allgather at 2 ranks, the two stages from 3)."""
    import torch
    from horovod_qsgd.ddp import DiLoCo, QSGDState
    for every, lr in zip((4, 8, 16), DEFAULT_OUTER_LRS[n]):
        module = model()
        opt = DiLoCo(torch.optim.SGD(module.parameters(), lr=1.0), module.named_parameters(), sync_every=every,
                     compression=QSGDState(bits=4), warmup_steps=0)
        assert opt._diloco.settings()["outer_lr"] == lr
        kind = "qsgd-two-stage" if n > 2 else "qsgd"
        reference = Reference(kind, n, [("diloco.outer", list(SIZES))], outer_lr=lr, outer_momentum=0.8)
        for outer in range(2):
            steps = list(range(outer * every, (outer + 1) * every))
            local_steps(opt, module, dist_gloo.get_rank(), steps)
            assert_every_rank_holds(_gathered(dist_gloo, module), reference.outer_step(steps), kind, (every, outer))


@pytest.mark.parametrize("n", RANKS_234)
def test_streaming_fragments_take_their_outer_steps_in_turn_bitwise_the_reference(dist_gloo, n):
    """fragments=2: each fragment its own exchange (its own codec steps and residuals) at its own step (each
    fragment below the two stages' threshold: the allgather at every rank count)."""
    import torch
    from horovod_qsgd.ddp import QSGDState, TopKState
    dist = dist_gloo
    groups = [("diloco.outer.fragment0", ["a"]), ("diloco.outer.fragment1", ["b"])]
    for kind, compression in (("qsgd", QSGDState(bits=4)), ("topk", TopKState(ratio=0.05))):
        module = model()
        opt = _diloco(module, compression, sync_every=4, fragments=2)
        stats = check_streaming(opt, module, dist.get_rank(), Reference(kind, n, groups), groups,
                                lambda label: _gathered(dist, module), kind)
        assert stats["exchanges"] == {name: "allgather" for name, _ in groups}
        assert stats["values_exchanged"] == 3 * sum(SIZES.values()) and stats["models_averaged"] == 0
        opt.average_models()  # never in sync: it sends, in float32
        assert opt.compression_stats()["models_averaged"] == 1
        everyone = _gathered(dist, module)
        assert all(torch.equal(everyone[0], row) for row in everyone)


@pytest.mark.parametrize("n", RANKS_234)
def test_resume_from_each_ranks_checkpoint_is_bitwise_the_uninterrupted_run(dist_gloo, n):
    """Whole-model DiLoCo and streaming (2 fragments: their outer steps after 1, 4, 7, 10 and 3, 6, 9)."""
    import torch
    from horovod_qsgd.ddp import TopKState
    dist = dist_gloo

    def build(fragments):
        module = model()
        return module, _diloco(module, TopKState(ratio=0.05), inner=torch.optim.AdamW(module.parameters(), lr=0.01),
                               sync_every=3, fragments=fragments)

    for fragments, purpose in ((1, "outer"), (2, "outer.fragment1")):
        module, opt = build(fragments)
        local_steps(opt, module, dist.get_rank(), range(5))
        saved = copy.deepcopy({"model": module.state_dict(), "opt": opt.state_dict()})
        local_steps(opt, module, dist.get_rank(), range(5, 11))
        uninterrupted = _gathered(dist, module)
        module, opt = build(fragments)
        module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        local_steps(opt, module, dist.get_rank(), range(5, 11))
        assert torch.equal(uninterrupted, _gathered(dist, module)), fragments
        assert saved["opt"]["diloco"]["compression"]["residuals"][purpose][0].abs().sum() > 0


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
    module = model()  # hierarchical on rank 0 alone: every rank built it alike (the nodes gathered), then refused
    opt = _diloco(module, None, sync_every=4, hierarchical=dist.get_rank() == 0)
    with pytest.raises(CompressionMismatchError, match=r"hierarchical: rank 0=True, rank 1=False"):
        local_steps(opt, module, dist.get_rank(), [0])


@pytest.mark.ranks(4, timeout=300, launcher="torchrun-nodes:2x2")
def test_hierarchical_averages_every_step_in_the_node_and_each_shard_between_nodes(dist_gloo):
    """hierarchical=True on two namespace nodes of two ranks: after a local step both ranks of a node hold the
    bits of the node's average step (the nodes differ); each outer step is bitwise the reference where local
    rank j exchanges shard j of its node's pseudo-gradient among the nodes (QSGD-4, Top-k 5% with its
    residuals; float32 within its rounding); the bytes inside the node as the formula; a warm-up step gives
    every rank the same model."""
    import torch
    from horovod_qsgd.ddp import DiLoCo, QSGDState, TopKState
    dist, n, per_node = dist_gloo, 4, 2
    rank, total = dist.get_rank(), sum(SIZES.values())
    module = model()  # outer_lr's default counts the nodes: two (0.7 * 8/16), not four ranks (0.494975)
    opt = DiLoCo(torch.optim.SGD(module.parameters(), lr=1.0), module.named_parameters(), sync_every=8,
                 hierarchical=True)
    assert opt._diloco.settings()["outer_lr"] == 0.35
    for kind, compression in (("none", None), ("qsgd", QSGDState(bits=4)), ("topk", TopKState(ratio=0.05))):
        module = model()
        opt = _diloco(module, compression, sync_every=3, hierarchical=True)
        reference = Reference(kind, n, [("diloco.outer", list(SIZES))], per_node=per_node, node_shards=True)
        for outer, steps in enumerate(([0, 1, 2], [3, 4, 5])):
            anchor = np.concatenate([getattr(module, name).detach().numpy().copy() for name in SIZES])
            local_steps(opt, module, rank, steps[:1])
            everyone = _gathered(dist, module)
            for first in (0, per_node):
                step = node_average(first, steps[0], per_node)
                want = anchor - np.concatenate([step[name] for name in SIZES])
                assert all(np.array_equal(everyone[r].numpy(), want) for r in (first, first + 1)), (kind, first)
            assert not torch.equal(everyone[0], everyone[per_node])
            local_steps(opt, module, rank, steps[1:])
            want = reference.outer_step(steps)
            everyone = _gathered(dist, module)
            assert_every_rank_holds(everyone, want, kind, (kind, outer))
        stats = opt.compression_stats()
        shard = -(-total // (per_node * (512 if kind == "qsgd" else 1))) * (512 if kind == "qsgd" else 1)
        # six local steps' two alltoalls, and two outer steps' gather of the node's shards
        assert stats["bytes_sent_in_node"] == 6 * 2 * 4 * -(-total // 2) + 2 * 4 * shard
        assert stats["values_averaged_in_node"] == 6 * total
        if compression is not None:
            assert set(stats["exchanges"]) == {f"diloco.outer.shard{rank % per_node}"}
    module = model()  # a warm-up step: every rank's gradient in the average, every rank the same model
    start = np.concatenate([getattr(module, name).detach().numpy().copy() for name in SIZES])
    opt = _diloco(module, None, sync_every=2, warmup_steps=1, hierarchical=True)
    local_steps(opt, module, rank, [0])
    everyone = _gathered(dist, module)
    assert all(torch.equal(everyone[0], everyone[r]) for r in range(n))
    mean = sum(np.concatenate(list(node_average(first, 0, per_node).values())) for first in (0, per_node)) / 2
    np.testing.assert_allclose(everyone[0].numpy(), start - mean, rtol=0, atol=1e-6)
    # the in-node average's two alltoalls, then the gather of the node's shards
    assert opt.compression_stats()["bytes_sent_in_node"] == 3 * 4 * -(-total // 2)


@pytest.mark.ranks(2, launcher="torchrun")
def test_hierarchical_on_one_node_is_refused_on_every_rank(dist_gloo):
    from horovod_qsgd.ddp import QSGDState
    module = model()
    opt = _diloco(module, QSGDState(bits=4), sync_every=2, hierarchical=True)
    with pytest.raises(ValueError, match=r"several nodes of equal size(.|\n)*it has 1 node\(s\) of 2 rank\(s\); "
                                         r"use hierarchical=False"):
        local_steps(opt, module, dist_gloo.get_rank(), [0])


def test_horovod_compressors_and_no_process_group_are_refused_with_the_fix():
    import torch
    from horovod_qsgd.ddp import DiLoCo
    module = model()
    inner = torch.optim.SGD(module.parameters(), lr=1.0)
    with pytest.raises(TypeError, match="takes compression=None, QSGDState.* not a QSGD; .*horovod_qsgd.torch.DiLoCo"):
        DiLoCo(inner, module.named_parameters(), compression=type("QSGD", (), {})())
    with pytest.raises(RuntimeError, match="needs torch.distributed.init_process_group"):
        DiLoCo(inner, module.named_parameters())


@pytest.mark.ranks(2, timeout=170, launcher="torchrun")
def test_warmup_compression_carries_the_warmup_and_compression_the_outer_steps(dist_gloo):
    """Top-k outside, QSGD-4 for the warm-up (the model as one flat tensor): both bitwise their codecs', both
    compressors' bytes counted."""
    import torch

    from horovod_qsgd.codecs import QSGDCodec
    from horovod_qsgd.ddp import QSGDState, TopKState
    from tests.diloco_reference import grads
    from tests.two_stage_reference import allgather_reference
    dist = dist_gloo
    module = model()
    start = np.concatenate([p.detach().numpy() for p in module.parameters()])
    opt = _diloco(module, TopKState(ratio=0.05), sync_every=3, warmup_steps=1,
                  warmup_compression=QSGDState(bits=4))
    local_steps(opt, module, dist.get_rank(), [0])
    flat = [np.concatenate(list(grads(r, 0).values())) for r in range(2)]
    warm = start - allgather_reference(QSGDCodec(bits=4), "diloco.gradients", flat, 0) * np.float32(0.5)
    assert_every_rank_holds(_gathered(dist, module), warm, "qsgd", "warm-up")
    reference = Reference("topk", 2, [("diloco.outer", list(SIZES))])
    offsets = np.cumsum([0] + list(SIZES.values()))
    reference.anchor = {n: warm[offsets[i]:offsets[i + 1]].copy() for i, n in enumerate(SIZES)}
    local_steps(opt, module, dist.get_rank(), [1, 2, 3])
    assert_every_rank_holds(_gathered(dist, module), reference.outer_step([1, 2, 3]), "topk", "outer")
    stats = opt.compression_stats()
    assert stats["exchanges"] == {"diloco.gradients": "allgather", "diloco.outer": "allgather"}
    assert stats["tensors_compressed"] == 2 and stats["bytes_sent"] > QSGDCodec(bits=4).max_payload_nbytes(
        sum(SIZES.values())), stats
    with pytest.raises(ValueError, match="warmup_compression is the outer compressor itself"):
        same = QSGDState(bits=4)
        _diloco(module, same, warmup_compression=same)
    assert torch.isfinite(module.a).all()
