"""Uneven inputs: horovod_qsgd.torch.Join against a run where the ranks without data step on zero gradients."""
import pytest

SHARED_LAUNCHES = True  # tests with the same rank count, env and launcher run in one launch (tests/multirank.py)

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


def _hvd_join_after(hvd, kind, exchange, steps):
    """Trains ``steps`` steps with names of the case's own, then calls hvd.join()."""
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(100, 200), torch.nn.ReLU(), torch.nn.Linear(200, 10))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        named_parameters=[(f"{kind}.{exchange}.{name}", p) for name, p in model.named_parameters()],
        compression=_compressor(hvd, kind, exchange))
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(16, 100)).sum().backward()
        optimizer.step()
    return model, hvd.join()


def _check_hvd_join(hvd):
    import torch
    from horovod_qsgd.torch import JoinUnsupportedError
    size, rank = hvd.size(), hvd.rank()
    # Even inputs: every rank calls hvd.join() after the same steps, as before, and gets Horovod's answer.
    model, last_joined = _hvd_join_after(hvd, "qsgd", "auto", 3)
    assert 0 <= last_joined < size
    rows = hvd.allgather(torch.cat([p.detach().reshape(-1) for p in model.parameters()])[None], name="even.check")
    assert all(torch.equal(rows[0], row) for row in rows)
    # Uneven inputs. The ranks still training are left with payloads no one will answer: Horovod's own join
    # would meet them, so these cases come last.
    for kind, exchange in [("qsgd", "allgather"), ("topk", "two_stage")]:
        # Every rank but the last runs out of data after 2 steps; the last is in its third step.
        with pytest.raises(JoinUnsupportedError) as info:
            _hvd_join_after(hvd, kind, exchange, 2 if rank < size - 1 else 3)
        message = str(info.value)
        assert f"hvd.join() was called on {size - 1} of {size} ranks" in message, message
        assert "horovod_qsgd.torch.Join(optimizer)" in message, message
        # Horovod's background loop lives on: the job can still end in order.
        alive = hvd.allreduce(torch.ones(1), name=f"alive.{kind}.{exchange}", op=hvd.Sum)
        assert int(alive[0]) == size


@pytest.mark.ranks(2, timeout=240)
def test_hvd_join_with_payloads_is_refused_on_every_rank_and_works_with_even_inputs_on_two_ranks(hvd_torch):
    _check_hvd_join(hvd_torch)


@pytest.mark.ranks(3, timeout=300)
def test_hvd_join_with_payloads_is_refused_on_every_rank_and_works_with_even_inputs_on_three_ranks(hvd_torch):
    _check_hvd_join(hvd_torch)
