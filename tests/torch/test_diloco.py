"""DiLoCo (horovod_qsgd.torch.DiLoCo) on 2, 3 and 4 Horovod ranks.

The inner optimizer is SGD with lr 1 and gradients set by the test, so every rank's local model after H
steps is known exactly (``x - g`` rounds once, in numpy as in torch). The outer step's reference is built
from the codecs alone (``tests/two_stage_reference.py``: the allgather's payloads decoded in rank order, or
the two stages) and numpy float32 operations; every rank's parameters must equal it bit for bit.
"""
import copy

import numpy as np
import pytest

from tests.diloco_reference import DEFAULT_OUTER_LRS, OUTER_LR, OUTER_MOMENTUM, SIZES, Reference, grads as _grads
from tests.diloco_reference import assert_every_rank_holds, check_streaming, local_steps as _local_steps
from tests.diloco_reference import model as _model, node_average

SHARED_LAUNCHES = "horovod.torch"  # a launch per rank count and env with the torch modules (tests/multirank.py)
RANKS_234 = [pytest.param(n, marks=pytest.mark.ranks(n, timeout=170)) for n in (2, 3, 4)]


def _flat(model):
    import torch
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _gathered(hvd, model, label):
    return hvd.allgather(_flat(model).reshape(1, -1), name=f"test.diloco.{label}")


def _diloco(model, compression, **kwargs):
    import torch
    kwargs.setdefault("warmup_steps", 0)  # local steps from the first
    from horovod_qsgd.torch import DiLoCo
    return DiLoCo(torch.optim.SGD(model.parameters(), lr=1.0), model.named_parameters(), compression=compression,
                  outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM, **kwargs)
def _compressor(kind):
    import horovod.torch as hvd
    from horovod_qsgd.torch import QSGD, TopK
    if kind == "none":
        return hvd.Compression.none
    exchange = "two_stage" if kind.endswith("two-stage") else "allgather"
    if kind.startswith("qsgd"):
        return QSGD(bits=4, min_numel=0, exchange=exchange)
    return TopK(ratio=0.05, min_numel=0, exchange=exchange)


@pytest.mark.parametrize("n", RANKS_234)
def test_outer_steps_are_bitwise_the_codecs_reference_on_every_rank(hvd_torch, n):
    hvd = hvd_torch
    assert hvd.size() == n
    kinds = ["none", "qsgd", "topk"] + (["qsgd-two-stage", "topk-two-stage"] if n > 2 else [])
    for kind in kinds:
        model = _model()
        compressor = _compressor(kind)
        opt = _diloco(model, compressor, sync_every=3)
        reference = Reference(kind, n, [(f"{opt._diloco_prefix}.outer.{i}", [name]) for i, name in enumerate(SIZES)])
        for outer, steps in enumerate(([0, 1, 2], [3, 4, 5], [6, 7, 8])):
            _local_steps(opt, model, hvd.rank(), steps)
            assert opt.outer_steps == outer + 1
            want = reference.outer_step(steps)
            everyone = _gathered(hvd, model, f"{kind}.{outer}")
            assert_every_rank_holds(everyone, want, kind, (kind, outer))
        stats = opt.compression_stats()
        assert stats["outer_steps"] == 3 and stats["inner_steps"] == 9 and stats["models_averaged"] == 0
        assert stats["values_exchanged"] == 3 * sum(SIZES.values())
        if kind == "none":
            assert stats["bytes_sent"] == 4 * 3 * sum(SIZES.values())
        else:  # the compressor's own count: payloads plus one placeholder per tensor
            assert stats["tensors_compressed"] == 3 * len(SIZES) and stats["bytes_sent"] < stats["bytes_uncompressed"]
            assert set(stats["exchanges"]) == {f"{opt._diloco_prefix}.outer.{i}" for i in range(len(SIZES))}


@pytest.mark.parametrize("n", RANKS_234)
def test_an_elias_coded_exchange_trains_bit_for_bit_as_the_fixed_one_in_fewer_bytes(hvd_torch, n):
    """docs/local-steps.md recommends QSGD(bits=2, encoding="elias") for the same bits as QSGD(bits=2): its
    payloads vary in size, through the warm-up's and the outer steps' exchanges (two stages from 3 ranks)."""
    import torch
    from horovod_qsgd.torch import QSGD
    hvd = hvd_torch
    exchange = "two_stage" if n > 2 else "allgather"
    models, stats = {}, {}
    for encoding in ("fixed", "elias"):
        model = _model()
        opt = _diloco(model, QSGD(bits=2, min_numel=0, encoding=encoding, exchange=exchange), sync_every=3,
                      warmup_steps=2)
        _local_steps(opt, model, hvd.rank(), range(11))  # 2 warm-up steps, then 3 outer steps
        assert opt.outer_steps == 3
        models[encoding], stats[encoding] = _gathered(hvd, model, f"elias.{encoding}"), opt.compression_stats()
    assert all(torch.equal(models["fixed"][r], models["elias"][r]) for r in range(n))
    assert not torch.equal(models["elias"][0], _flat(_model()))  # it trained
    for key in ("outer_steps", "values_exchanged", "tensors_compressed"):
        assert stats["elias"][key] == stats["fixed"][key], key
    assert stats["elias"]["bytes_sent"] < 0.85 * stats["fixed"]["bytes_sent"], (stats["elias"], stats["fixed"])
    assert (stats["elias"]["bytes_sent_second_stage"] > 0) == (n > 2)


@pytest.mark.parametrize("n", RANKS_234)
def test_the_default_outer_lr_falls_below_sync_every_16_more_slowly_with_more_ranks(hvd_torch, n):
    """outer_lr and outer_momentum left at their defaults (0.8): at 2 ranks 0.2 at H=4 (0.7 * 4/16 = 0.175 is
    below 1 - 0.8), 0.35 at H=8, 0.7 at H=16; sqrt(ranks / 2) times more at 3 and 4 ranks below H=16; two outer
    steps each (the second through the momentum) bitwise the reference at that lr."""
    import torch
    from horovod_qsgd.torch import DiLoCo, QSGD
    hvd = hvd_torch
    for every, lr in zip((4, 8, 16), DEFAULT_OUTER_LRS[n]):
        model = _model()
        opt = DiLoCo(torch.optim.SGD(model.parameters(), lr=1.0), model.named_parameters(), sync_every=every,
                     compression=QSGD(bits=4, min_numel=0, exchange="allgather"), warmup_steps=0)
        assert opt._diloco.settings()["outer_lr"] == lr
        reference = Reference("qsgd", n, [(f"{opt._diloco_prefix}.outer.{i}", [name]) for i, name in enumerate(SIZES)],
                              outer_lr=lr, outer_momentum=0.8)
        for outer in range(2):
            steps = list(range(outer * every, (outer + 1) * every))
            _local_steps(opt, model, hvd.rank(), steps)
            assert_every_rank_holds(_gathered(hvd, model, f"default-lr.{every}.{outer}"), reference.outer_step(steps),
                                    "qsgd", (every, outer))


@pytest.mark.parametrize("n", RANKS_234)
def test_streaming_fragments_take_their_outer_steps_in_turn_bitwise_the_reference(hvd_torch, n):
    """fragments=2: each fragment its own grouped allreduce (its own codec steps and residuals) at its own step;
    the allgather and, from 3 ranks, the two stages."""
    import torch
    hvd = hvd_torch
    for kind in ("qsgd", "topk") + (("qsgd-two-stage", "topk-two-stage") if n > 2 else ()):
        model = _model()
        opt = _diloco(model, _compressor(kind), sync_every=4, fragments=2)
        groups = [(f"{opt._diloco_prefix}.outer.fragment{f}.0", [name]) for f, name in enumerate(SIZES)]
        stats = check_streaming(opt, model, hvd.rank(), Reference(kind, n, groups), groups,
                                lambda label: _gathered(hvd, model, f"streaming.{n}.{label}"), kind)
        assert set(stats["exchanges"]) == {name for name, _ in groups}
        assert stats["tensors_compressed"] == 6 and stats["models_averaged"] == 0
        opt.average_models()  # never in sync: it sends, in float32
        assert opt.compression_stats()["models_averaged"] == 1
        everyone = _gathered(hvd, model, f"streaming.{kind}.{n}.averaged")
        assert all(torch.equal(everyone[0], row) for row in everyone)


@pytest.mark.parametrize("n", RANKS_234)
def test_average_models_makes_every_rank_equal_and_sends_nothing_at_a_synchronization(hvd_torch, n):
    import torch
    from horovod_qsgd.torch import QSGD
    hvd = hvd_torch
    model = _model()
    opt = _diloco(model, QSGD(bits=4, min_numel=0), sync_every=4)
    _local_steps(opt, model, hvd.rank(), range(6))  # an outer step at 4, then 2 local steps
    before = _gathered(hvd, model, "before")
    assert not torch.equal(before[0], before[1])
    anchor = [a.clone() for a in opt._diloco.anchor]
    opt.average_models()
    after = _gathered(hvd, model, "after")
    assert all(torch.equal(after[0], after[r]) for r in range(n))
    torch.testing.assert_close(after[0], before.double().mean(0).float(), rtol=0, atol=1e-6)
    stats = opt.compression_stats()
    assert stats["models_averaged"] == 1 and stats["values_exchanged_in_full"] == sum(SIZES.values())
    opt.average_models()  # no step since: in sync, nothing sent (a callback may call it twice in a row)
    assert opt.compression_stats()["models_averaged"] == 1
    assert all(torch.equal(a, b) for a, b in zip(anchor, opt._diloco.anchor))  # the outer loop goes on from it
    _local_steps(opt, model, hvd.rank(), range(6, 8))  # the next outer step, at 8
    assert opt.outer_steps == 2
    opt.average_models()  # in sync: nothing sent
    assert opt.compression_stats()["models_averaged"] == 1


@pytest.mark.parametrize("n", RANKS_234)
def test_resume_from_each_ranks_checkpoint_is_bitwise_the_uninterrupted_run(hvd_torch, n):
    """Whole-model DiLoCo and streaming (2 fragments: their outer steps after 1, 4, 7, 10 and 3, 6, 9)."""
    import torch
    from horovod_qsgd.torch import TopK
    hvd = hvd_torch

    def build(fragments):
        model = _model()
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        from horovod_qsgd.torch import DiLoCo
        return model, DiLoCo(inner, model.named_parameters(), sync_every=3, warmup_steps=0,
                             compression=TopK(ratio=0.05, min_numel=0), fragments=fragments)

    def train(model, opt, steps):
        for step in steps:
            for name, g in _grads(hvd.rank(), step).items():
                getattr(model, name).grad = torch.from_numpy(g.copy())
            opt.step()

    for fragments, outer_steps in ((1, 3), (2, 7)):
        model, opt = build(fragments)
        train(model, opt, range(5))  # an outer step at 3; a checkpoint between two
        saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
        train(model, opt, range(5, 11))
        uninterrupted = _gathered(hvd, model, f"uninterrupted.{fragments}")

        model, opt = build(fragments)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        train(model, opt, range(5, 11))
        resumed = _gathered(hvd, model, f"resumed.{fragments}")
        assert torch.equal(uninterrupted, resumed), fragments
        assert opt.outer_steps == outer_steps
        assert set(saved["opt"]["diloco"]) >= {"anchor", "momentum", "steps", "outer_steps", "compression"}
        assert saved["opt"]["diloco"]["compression"]["tensors"]  # Top-k's residuals travel with it


@pytest.mark.parametrize("n", RANKS_234)
def test_an_overflow_on_one_rank_is_skipped_there_and_the_ranks_stay_in_step(hvd_torch, n):
    # torch.amp.GradScaler calls step() on every rank at every step: the overflowed rank skips its local
    # step, counts it, and meets the others at the outer step.
    import torch
    from horovod_qsgd.torch import DiLoCo, QSGD
    hvd = hvd_torch
    model = _model()
    opt = DiLoCo(torch.optim.AdamW(model.parameters(), lr=0.01), model.named_parameters(), sync_every=3,
                 warmup_steps=0, compression=QSGD(bits=4, min_numel=0))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(6):
        opt.zero_grad()
        loss = sum((p * torch.from_numpy(g)).sum() for p, g in zip(model.parameters(),
                                                                    _grads(hvd.rank(), step).values()))
        scaler.scale(loss).backward()
        if step == 1 and hvd.rank() == n - 1:
            model.a.grad[7] = float("inf")
        scaler.step(opt)
        scaler.update()
    stats = opt.compression_stats()
    assert stats["inner_steps_skipped"] == (1 if hvd.rank() == n - 1 else 0)
    assert stats["inner_steps"] + stats["inner_steps_skipped"] == 6 and stats["outer_steps"] == 2
    everyone = _gathered(hvd, model, "after_overflow")
    assert all(torch.equal(everyone[0], everyone[r]) for r in range(n)) and torch.isfinite(everyone).all()
    scales = hvd.allgather(torch.tensor([scaler.get_scale()]), name="test.diloco.scales")
    assert scales[n - 1] == 512.0 and all(scales[r] == 1024.0 for r in range(n - 1))


@pytest.mark.parametrize("n", RANKS_234)
def test_settings_or_starting_models_that_differ_are_refused_on_every_rank(hvd_torch, n):
    import torch
    from horovod_qsgd.common.errors import CompressionMismatchError
    from horovod_qsgd.torch import QSGD
    hvd = hvd_torch
    model = _model()
    opt = _diloco(model, QSGD(bits=4, min_numel=0), sync_every=4 if hvd.rank() else 8)
    with pytest.raises(CompressionMismatchError, match=r"sync_every: rank 0=8, rank 1=4"):
        _local_steps(opt, model, hvd.rank(), [0])
    model = _model(seed=hvd.rank() % 2)  # as if hvd.broadcast_parameters were forgotten
    opt = _diloco(model, QSGD(bits=4, min_numel=0), sync_every=4)
    with pytest.raises(CompressionMismatchError, match=r"model_digest(.|\n)*hvd.broadcast_parameters"):
        _local_steps(opt, model, hvd.rank(), [0])
    # hierarchical on rank 0 alone: refused before any rank looks for nodes. Uncompressed: hierarchical=True
    # builds a node-aware copy of a QSGD, and a compressor built on one rank alone shifts that rank's fused group
    # names (counted per process) in every later test of this launch, which then hang.
    model = _model()
    opt = _diloco(model, hvd.Compression.none, sync_every=4, hierarchical=hvd.rank() == 0)
    with pytest.raises(CompressionMismatchError, match=r"hierarchical: rank 0=True, rank 1=False"):
        _local_steps(opt, model, hvd.rank(), [0])
    # and a checkpoint of another step loaded on one rank
    model = _model()
    opt = _diloco(model, QSGD(bits=4, min_numel=0), sync_every=2)
    _local_steps(opt, model, hvd.rank(), range(2))
    state = opt.state_dict()
    if hvd.rank() == 0:
        state["diloco"]["steps"] += 2
    opt.load_state_dict(state)
    with pytest.raises(CompressionMismatchError, match=r"steps: rank 0=4, rank 1=2"):
        _local_steps(opt, model, hvd.rank(), [2])
    assert torch.isfinite(model.a).all()


@pytest.mark.ranks(2)
def test_warmup_steps_average_the_gradients_and_count_their_bytes(hvd_torch):
    import torch
    from horovod_qsgd.torch import DiLoCo
    hvd = hvd_torch
    model = _model()
    opt = DiLoCo(torch.optim.SGD(model.parameters(), lr=1.0), model.named_parameters(), sync_every=2,
                 warmup_steps=3)
    start = np.concatenate([p.detach().numpy() for p in model.parameters()])
    _local_steps(opt, model, hvd.rank(), range(3))
    everyone = _gathered(hvd, model, "warm")
    assert torch.equal(everyone[0], everyone[1])
    mean_grads = sum(np.concatenate(list(_grads(r, s).values())).astype(np.float64) for r in range(2)
                     for s in range(3)) / 2
    np.testing.assert_allclose(everyone[0].numpy(), start - mean_grads, rtol=0, atol=1e-5)
    assert opt._diloco.anchor is None and opt.outer_steps == 0
    _local_steps(opt, model, hvd.rank(), range(3, 5))  # the anchor at step 3, the outer step after step 4
    stats = opt.compression_stats()
    assert stats["warmup_steps"] == 3 and stats["outer_steps"] == 1
    assert stats["bytes_sent"] == 4 * 4 * sum(SIZES.values())  # 3 gradients and 1 pseudo-gradient, float32


@pytest.mark.ranks(4, timeout=300, launcher="nodes:2x2")
def test_hierarchical_averages_every_step_in_the_node_and_the_outer_step_between_nodes(hvd_torch):
    """hierarchical=True on two namespace nodes of two ranks: after a local step both ranks of a node hold the
    bits of the node's average step (and the nodes differ); each outer step is bitwise the node-aware exchange
    of the nodes' pseudo-gradients from the codecs alone (QSGD-4 and Top-k 5% given with exchange='auto', its
    residuals kept across outer steps; float32 within its rounding); the in-node bytes as the formula; an
    overflow on one rank skips the step on both ranks of its node, which still reach the outer step."""
    import torch
    from horovod_qsgd.torch import QSGD, DiLoCo, TopK
    from horovod_qsgd.torch_shared import in_node
    hvd, n, per_node = hvd_torch, 4, 2
    assert (hvd.local_size(), hvd.cross_size()) == (per_node, 2)
    total = sum(SIZES.values())
    model = _model()  # outer_lr's default counts the nodes: two (0.7 * 8/16), not four ranks (0.494975)
    opt = DiLoCo(torch.optim.SGD(model.parameters(), lr=1.0), model.named_parameters(), sync_every=8,
                 hierarchical=True)
    assert opt._diloco.settings()["outer_lr"] == 0.35
    for kind, compressor in (("none", hvd.Compression.none), ("qsgd", QSGD(bits=4, min_numel=0)),
                             ("topk", TopK(ratio=0.05, min_numel=0))):
        model = _model()
        opt = _diloco(model, compressor, sync_every=3, hierarchical=True)
        groups = [(f"{opt._diloco_prefix}.outer.{i}", [name]) for i, name in enumerate(SIZES)]
        reference = Reference(kind, n, groups, per_node=per_node)
        for outer, steps in enumerate(([0, 1, 2], [3, 4, 5])):
            anchor = np.concatenate([getattr(model, name).detach().numpy().copy() for name in SIZES])
            _local_steps(opt, model, hvd.rank(), steps[:1])
            everyone = _gathered(hvd, model, f"h.{kind}.{outer}.local")
            for node in range(2):
                first = node * per_node
                step = node_average(first, steps[0], per_node)
                want = anchor - np.concatenate([step[name] for name in SIZES])
                assert all(np.array_equal(everyone[r].numpy(), want) for r in (first, first + 1)), (kind, node)
            assert not torch.equal(everyone[0], everyone[per_node])
            _local_steps(opt, model, hvd.rank(), steps[1:])
            want = reference.outer_step(steps)
            everyone = _gathered(hvd, model, f"h.{kind}.{outer}")
            assert_every_rank_holds(everyone, want, kind, (kind, outer))
        stats = opt.compression_stats()
        assert stats["values_averaged_in_node"] == 6 * total and stats["outer_steps"] == 2
        ours = 6 * in_node.bytes_sent(total, per_node)
        assert ours == 6 * 2 * 4 * -(-total // 2)
        if kind == "none":
            assert stats["bytes_sent_in_node"] == ours
        else:  # and the node-aware exchange's own full-precision step inside the node
            assert stats["bytes_sent_in_node"] > ours and opt._diloco_compression.exchange == "node_aware"
            assert compressor.exchange == "auto"  # the caller's instance is left as given

    # an overflow on the last rank: its node's average is not finite, so both its ranks skip the step together
    model = _model()
    opt = _diloco(model, hvd.Compression.none, sync_every=2, hierarchical=True)
    start = np.concatenate([getattr(model, name).detach().numpy().copy() for name in SIZES])
    for name, g in _grads(hvd.rank(), 0).items():
        if hvd.rank() == n - 1:
            g[7] = np.inf
        getattr(model, name).grad = torch.from_numpy(g.copy())
    opt.step()
    everyone = _gathered(hvd, model, "h.overflow")
    assert all(np.array_equal(everyone[r].numpy(), start) for r in (2, 3))
    assert torch.equal(everyone[0], everyone[1]) and not np.array_equal(everyone[0].numpy(), start)
    assert opt.compression_stats()["inner_steps_skipped"] == (1 if hvd.rank() >= per_node else 0)
    _local_steps(opt, model, hvd.rank(), [1])  # the outer step: every rank reaches it at its second step
    everyone = _gathered(hvd, model, "h.overflow.outer")
    assert opt.outer_steps == 1 and all(torch.equal(everyone[0], everyone[r]) for r in range(n))


@pytest.mark.ranks(2)
def test_hierarchical_on_one_node_is_refused_on_every_rank(hvd_torch):
    import torch
    from horovod_qsgd.torch import QSGD
    hvd = hvd_torch
    model = _model()
    start = model.a.detach().clone()
    opt = _diloco(model, QSGD(bits=4, min_numel=0), sync_every=2, hierarchical=True)
    with pytest.raises(ValueError, match=r"several nodes of equal size(.|\n)*it has 1 node\(s\) of 2 rank\(s\); "
                                         r"use hierarchical=False"):
        _local_steps(opt, model, hvd.rank(), [0])
    assert torch.equal(model.a, start)


def test_bad_arguments_name_the_fix():
    import torch
    from horovod_qsgd.torch import DiLoCo
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    for kwargs, message in (({"sync_every": 0}, "sync_every=0 must be an integer >= 1"),
                            ({"outer_lr": 0.0}, r"outer_lr=0.0 must be a number in \(0, 2\]"),
                            ({"outer_momentum": 1.0}, r"outer_momentum=1.0 must be a number in \[0, 1\)"),
                            ({"warmup_steps": -1}, "warmup_steps=-1 must be an integer >= 0"),
                            ({"fragments": 5, "sync_every": 4}, r"fragments=5 must be an integer from 1 to sync_every "
                                                                r"\(4\)"),
                            ({"fragments": 3}, r"fragments=3, but the model has 2 parameter tensor\(s\)(.|\n)*use "
                                               "fragments <= 2")):
        with pytest.raises(ValueError, match=message):
            DiLoCo(inner, model.named_parameters(), **kwargs)
    with pytest.raises(ValueError, match="1 of the optimizer's parameters are not in named_parameters"):
        DiLoCo(inner, [("a", model.a)])
    from horovod_qsgd.torch import QSGD
    with pytest.raises(ValueError, match=r"hierarchical=True(.|\n)*exchange='allgather'; pass QSGD\(...\) or TopK"):
        DiLoCo(inner, model.named_parameters(), compression=QSGD(bits=4, exchange="allgather"), hierarchical=True)


def test_a_checkpoint_of_the_version_before_hierarchical_loads_and_another_setting_is_refused():
    from horovod_qsgd.torch_shared.local_sgd import OuterLoop
    model = _model()

    def loop(hierarchical):
        return OuterLoop(list(model.named_parameters()), 4, 0.7, 0.5, True, 0, None, None, {"compression": None},
                         hierarchical)

    state = loop(False).state()
    del state["settings"]["hierarchical"]  # as that version saved it
    loop(False).check_state(state)
    with pytest.raises(ValueError, match="hierarchical=False there, True here"):
        loop(True).check_state(state)


@pytest.mark.ranks(2)
def test_warmup_compression_carries_the_warmup_and_compression_the_outer_steps(hvd_torch):
    """Top-k outside, QSGD-4 for the warm-up: the warm-up step bitwise QSGD's average, the outer step bitwise
    Top-k's, both compressors' bytes counted, both states in the checkpoint (and its settings checked)."""
    import torch
    from horovod_qsgd.codecs import QSGDCodec
    from horovod_qsgd.torch import QSGD, DiLoCo, TopK
    from tests.two_stage_reference import allgather_reference
    hvd = hvd_torch
    model = _model()
    start = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}

    def build(module, **kwargs):
        return DiLoCo(torch.optim.SGD(module.parameters(), lr=1.0), module.named_parameters(), sync_every=3,
                      warmup_steps=1, compression=TopK(ratio=0.05, min_numel=0), outer_lr=OUTER_LR,
                      outer_momentum=OUTER_MOMENTUM, **kwargs)

    opt = build(model, warmup_compression=QSGD(bits=4, min_numel=0))
    _local_steps(opt, model, hvd.rank(), [0])
    warm = {}
    for i, name in enumerate(SIZES):
        total = allgather_reference(QSGDCodec(bits=4), f"{opt._diloco_prefix}.gradients.{i}",
                                    [_grads(r, 0)[name] for r in range(2)], 0)
        warm[name] = start[name] - total * np.float32(0.5)
    assert_every_rank_holds(_gathered(hvd, model, "warm"), np.concatenate([warm[n] for n in SIZES]), "qsgd",
                            "warm-up")
    reference = Reference("topk", 2, [(f"{opt._diloco_prefix}.outer.{i}", [name]) for i, name in enumerate(SIZES)])
    reference.anchor = {n: w.copy() for n, w in warm.items()}
    _local_steps(opt, model, hvd.rank(), [1, 2, 3])
    assert_every_rank_holds(_gathered(hvd, model, "outer"), reference.outer_step([1, 2, 3]), "topk", "outer")
    stats = opt.compression_stats()
    assert stats["tensors_compressed"] == 2 * len(SIZES) and stats["warmup_steps"] == 1, stats
    assert set(stats["exchanges"]) == {f"{opt._diloco_prefix}.{p}.{i}" for p in ("gradients", "outer")
                                       for i in range(len(SIZES))}
    qsgd_bytes = sum(QSGDCodec(bits=4).max_payload_nbytes(n) for n in SIZES.values())
    assert stats["bytes_sent"] > qsgd_bytes and stats["bytes_uncompressed"] == 4 * 2 * sum(SIZES.values())

    saved = opt.state_dict()
    assert set(saved["diloco"]["compression"]) == {"outer", "warmup"}
    again = build(_model(), warmup_compression=QSGD(bits=4, min_numel=0))
    again.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(again._diloco.anchor, opt._diloco.anchor))
    with pytest.raises(ValueError, match="warmup_compression"):
        build(_model()).load_state_dict(saved)  # saved with a warm-up compressor, loaded without one
    with pytest.raises(ValueError, match="warmup_compression is the outer compressor itself"):
        same = QSGD(bits=4)
        DiLoCo(torch.optim.SGD(model.parameters(), lr=1.0), model.named_parameters(), compression=same,
               warmup_compression=same)
