"""Uneven inputs: horovod_qsgd.torch.Join against a run where the ranks without data step on zero gradients."""
import pytest

CASES = [("qsgd", "allgather"), ("qsgd", "two_stage"), ("topk", "allgather"), ("topk", "two_stage"),
         ("none", None)]


def _compressor(hvd, kind, exchange):
    from horovod_qsgd.torch import QSGD, TopK
    if kind == "qsgd":
        return QSGD(bits=4, exchange=exchange)
    if kind == "topk":
        return TopK(ratio=0.01, exchange=exchange)
    return hvd.Compression.none


def _train(hvd, kind, exchange, joined):
    """(model, optimizer, compressor, join): rank r trains on 2 + 2r batches (``joined``: inside Join; else
    every rank runs the longest count, stepping on zero gradients where it has no batch)."""
    import torch
    from horovod_qsgd.torch import Join
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(100, 200), torch.nn.ReLU(), torch.nn.Linear(200, 10))
    compressor = _compressor(hvd, kind, exchange)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                         named_parameters=model.named_parameters(), compression=compressor)
    generator = torch.Generator().manual_seed(10 + hvd.rank())
    mine, longest = 2 + 2 * hvd.rank(), 2 + 2 * (hvd.size() - 1)
    batches = [(torch.randn(16, 100, generator=generator), torch.randint(0, 10, (16,), generator=generator))
               for _ in range(mine)]

    def step(batch):
        optimizer.zero_grad()
        if batch is not None:
            torch.nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        optimizer.step()

    join = None
    if joined:
        with Join(optimizer) as join:
            for batch in batches:
                step(batch)
    else:
        for index in range(longest):
            step(batches[index] if index < mine else None)
    return model, optimizer, compressor, join


def _check_join(hvd):
    import torch
    for kind, exchange in CASES:
        model, optimizer, compressor, join = _train(hvd, kind, exchange, joined=True)
        reference, ref_optimizer, ref_compressor, _ = _train(hvd, kind, exchange, joined=False)
        assert join.shadow_steps == 2 * (hvd.size() - 1 - hvd.rank())
        for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(param, ref), f"{kind}/{exchange}: {name} differs from the zero-gradient run"
            rows = hvd.allgather(param.detach().reshape(1, -1), name=f"check.{kind}.{exchange}.{name}")
            assert all(torch.equal(rows[0], row) for row in rows), f"{kind}/{exchange}: {name} differs between ranks"
        for state, ref_state in zip(optimizer.state.values(), ref_optimizer.state.values()):
            assert torch.equal(state["momentum_buffer"], ref_state["momentum_buffer"])
        if kind != "none":
            tensors, ref_tensors = compressor.state_dict()["tensors"], ref_compressor.state_dict()["tensors"]
            assert tensors.keys() == ref_tensors.keys()
            for name, entry in tensors.items():
                assert entry["step"] == ref_tensors[name]["step"], name
                for key in ("residual", "owner_residual"):
                    mine, ref = entry.get(key), ref_tensors[name].get(key)
                    assert (mine is None and ref is None) or torch.equal(mine, ref), f"{kind}/{exchange}: {key}"


@pytest.mark.ranks(2, timeout=240)
def test_join_trains_uneven_inputs_like_zero_gradient_steps_on_two_ranks(hvd_torch):
    _check_join(hvd_torch)


# From 3 ranks, which allreduces Horovod fuses depends on timing, and the fusion buffer's ring order decides how
# a passed-through gradient's three terms are rounded: without fusion both runs sum alike.
@pytest.mark.ranks(3, timeout=300, env={"HOROVOD_FUSION_THRESHOLD": "0"})
def test_join_trains_uneven_inputs_like_zero_gradient_steps_on_three_ranks(hvd_torch):
    _check_join(hvd_torch)
