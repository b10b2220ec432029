"""A run checkpointed at step k and resumed equals the uninterrupted run, bitwise."""
import copy

import pytest

SHARED_LAUNCHES = "horovod.torch"  # a launch per rank count and env with the torch modules (tests/multirank.py)


def _train(hvd, compressor_factory, steps, start_state=None, capture_at=None):
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    compressor = compressor_factory()
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=compressor)
    first = 0
    if start_state is not None:
        model.load_state_dict(start_state["model"])
        opt.load_state_dict(start_state["optimizer"])
        compressor.load_state_dict(start_state["compressor"])
        first = start_state["step"]
    captured = None
    for step in range(first, steps):
        if step == capture_at:
            captured = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                      "compressor": compressor.state_dict(), "step": step})
        g = torch.Generator().manual_seed(100 * hvd.rank() + step)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), captured


@pytest.mark.ranks(2)
@pytest.mark.parametrize("kind", ["qsgd", "topk", "randomk-ef"])
def test_resume_is_bit_exact(hvd_torch, kind):
    import torch
    from horovod_qsgd.torch import QSGD, RandomK, TopK
    factory = {"qsgd": lambda: QSGD(bits=4, min_numel=1000),
               "topk": lambda: TopK(ratio=0.01, min_numel=1000),
               "randomk-ef": lambda: RandomK(ratio=0.05, error_feedback=True, min_numel=1000)}[kind]
    uninterrupted, state = _train(hvd_torch, factory, steps=8, capture_at=4)
    assert state["compressor"]["tensors"], "nothing was compressed"
    resumed, _ = _train(hvd_torch, factory, steps=8, start_state=state)
    assert torch.equal(uninterrupted, resumed)
    # Without the compressor's state the same resume differs: the state matters.
    state["compressor"]["tensors"] = {}
    fresh, _ = _train(hvd_torch, factory, steps=8, start_state=state)
    assert not torch.equal(uninterrupted, fresh)


def test_state_from_other_settings_is_refused():
    pytest.importorskip("horovod.torch")
    from horovod_qsgd.torch import QSGD
    state = QSGD(bits=4).state_dict()
    with pytest.raises(ValueError, match="settings"):
        QSGD(bits=8).load_state_dict(state)


@pytest.mark.ranks(2)
def test_loading_replaces_the_state_and_a_residual_of_another_length_is_refused_on_every_rank(hvd_torch):
    import torch
    from horovod_qsgd.common.errors import CompressionMismatchError
    from horovod_qsgd.torch import TopK
    hvd = hvd_torch
    compressor = TopK(ratio=0.01, min_numel=0)
    hvd.allreduce(torch.ones(1000), name="w", compression=compressor)
    state = compressor.state_dict()
    # Loading replaces the state: a tensor the state lacks starts afresh, as in a new compressor.
    compressor.load_state_dict(dict(state, tensors={}))
    fresh = TopK(ratio=0.01, min_numel=0)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(hvd.rank()))
    for c in (compressor, fresh):
        hvd.allreduce(x, name="w", compression=c)
    restarted, new = compressor.state_dict()["tensors"]["w"], fresh.state_dict()["tensors"]["w"]
    assert restarted["step"] == new["step"] == 1 and torch.equal(restarted["residual"], new["residual"])
    state["tensors"]["w"]["residual"] = torch.zeros(999)  # another model's
    compressor.load_state_dict(state)
    with pytest.raises(CompressionMismatchError,
                       match="tensor 'w' has 1000 elements but its error-feedback residual has 999; a checkpoint"):
        hvd.allreduce(torch.ones(1000), name="w", compression=compressor)
