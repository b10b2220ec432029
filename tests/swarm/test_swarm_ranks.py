"""SwarmOptimizer on 2, 3 and 4 real Horovod ranks.

Each test gathers every rank's model (flattened: parameters in
``named_parameters`` order, then floating-point buffers) before and after an
exchange with a plain ``hvd.allgather`` and checks each rank's result against
the matching recomputed independently in the test.
"""
import pytest

SHARED_LAUNCHES = "horovod.torch"  # a launch per rank count and env with the torch modules (tests/multirank.py)
RANKS_234 = [pytest.param(n, marks=pytest.mark.ranks(n, timeout=150)) for n in (2, 3, 4)]


def _model(rank, noise, base_seed=0):
    """The same base model on every rank plus rank-specific noise of scale ``noise`` (params and float buffers)."""
    import torch
    torch.manual_seed(base_seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 96), torch.nn.BatchNorm1d(96), torch.nn.ReLU(),
                                torch.nn.Linear(96, 40))
    _perturb(model, rank, noise, salt=1)
    with torch.no_grad():
        model[1].running_var.add_(1.0)
        model[1].num_batches_tracked.fill_(100 + rank)
    return model


def _perturb(model, rank, noise, salt):
    import torch
    g = torch.Generator().manual_seed(1000 * salt + rank)
    with torch.no_grad():
        for t in list(model.parameters()) + [b for b in model.buffers() if b.dtype.is_floating_point]:
            t.add_(torch.randn(t.shape, generator=g) * noise)


def _flat(model):
    import torch
    tensors = list(model.parameters()) + [b for b in model.buffers() if b.dtype.is_floating_point]
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _layout(model, min_numel=1024):
    """(name, start, end, quantized) of every slot in the flat model, as SwarmOptimizer names them."""
    out, offset = [], 0
    for kind, named in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            if t.dtype.is_floating_point:
                out.append((f"{kind}:{name}", offset, offset + t.numel(), kind == "param" and t.numel() >= min_numel))
                offset += t.numel()
    return out


def _gather(hvd, tensor, name):
    return hvd.allgather(tensor.reshape(1, -1), name=name)


def _bitwise(a, b):
    import torch
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.contiguous().view(torch.int32))


def _swarm(model, **kwargs):
    import torch
    from horovod_qsgd.torch.swarm import SwarmOptimizer
    return SwarmOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, **kwargs)


@pytest.mark.parametrize("n", RANKS_234)
def test_identical_perfect_matchings_and_exactly_the_average_in_full_precision(hvd_torch, n):
    import torch
    from horovod_qsgd.torch.swarm import random_matching
    hvd = hvd_torch
    assert hvd.size() == n
    # every rank computes the same matching, and it is a perfect matching of the topology
    for topology in ("complete", "ring"):
        opt = _swarm(_model(hvd.rank(), 0.0), seed=21, topology=topology)
        mine = torch.tensor([random_matching(n, r, 21, topology) for r in range(40)])
        partners = torch.tensor([opt.partner(r) for r in range(40)])
        assert torch.equal(partners, mine[:, hvd.rank()])
        everyone = hvd.allgather(mine.unsqueeze(0), name=f"test.matching.{topology}")
        assert all(torch.equal(everyone[r], mine) for r in range(n))
        for m in mine.tolist():
            assert sorted(m) == [-1] * (n % 2) + sorted(set(m) - {-1})  # each rank at most once, one out if odd
            assert len(set(m) - {-1}) == n - n % 2
            assert all(m[p] == r for r, p in enumerate(m) if p >= 0)
            if topology == "ring":
                assert all((p - r) % n in (1, n - 1) for r, p in enumerate(m) if p >= 0)
    # both partners end with exactly (X_i + X_j) / 2, the rank sitting out is untouched
    model = _model(hvd.rank(), noise=1.0)
    opt = _swarm(model, local_steps=1, seed=7)
    counted = model[1].num_batches_tracked.clone()
    for round_index in range(4):
        before = _gather(hvd, _flat(model), f"test.exact.before.{round_index}")
        opt.step()  # no gradients: the local SGD step changes nothing, then the exchange
        after = _gather(hvd, _flat(model), f"test.exact.after.{round_index}")
        matching = random_matching(n, round_index, 7)
        for r, p in enumerate(matching):
            expected = before[r] if p < 0 else (before[r] + before[p]) * 0.5
            assert _bitwise(after[r], expected), (round_index, r, p)
        assert torch.equal(model[1].num_batches_tracked, counted)  # integer buffers stay local
    stats = opt.compression_stats()
    assert stats["rounds"] == 4 and stats["rounds_sat_out"] == sum(
        random_matching(n, r, 7)[hvd.rank()] < 0 for r in range(4))


@pytest.mark.parametrize("n", RANKS_234)
def test_lattice_exchange_is_within_half_eps_of_the_average(hvd_torch, n):
    import torch
    from horovod_qsgd.torch.swarm import random_matching
    hvd = hvd_torch
    model = _model(hvd.rank(), noise=0.01)
    layout = _layout(model)
    opt = _swarm(model, local_steps=1, quantization="lattice8", seed=3)
    opt.step()  # round 0: no spread estimate yet, exact (calibration)
    assert opt.last_exchange()["eps_sent"] == {}
    me, checked = hvd.rank(), 0
    for round_index in (1, 2):
        _perturb(model, me, 0.005, salt=round_index + 1)
        before = _gather(hvd, _flat(model), f"test.lattice.before.{round_index}").double()
        opt.step()
        after = _gather(hvd, _flat(model), f"test.lattice.after.{round_index}")
        info = opt.last_exchange()
        p = random_matching(n, round_index, 3)[me]
        assert info["partner"] == p and info["failed"] == [] and info["fallback"] == []
        # the eps a rank decoded with is the one its partner chose
        names = [name for name, _, _, q in layout if q]
        sent = _gather(hvd, torch.tensor([info["eps_sent"].get(k, 0.0) for k in names], dtype=torch.float64),
                       f"test.lattice.eps.{round_index}")
        if p >= 0:
            assert [info["eps_received"].get(k, 0.0) for k in names] == sent[p].tolist()
        if p < 0:
            assert _bitwise(after[me], before[me].float())
            continue
        exact_average = (before[me] + before[p]) * 0.5
        quantized_names = {name for name, _, _, q in layout if q}
        # a rank that sat out every earlier round has no spread estimate yet and sends exactly
        assert set(info["eps_received"]) in (quantized_names, set())
        assert set(info["eps_sent"]) in (quantized_names, set())
        for name, lo, hi, quantized in layout:
            got, want = after[me, lo:hi].double(), exact_average[lo:hi]
            if name not in info["eps_received"]:
                assert _bitwise(after[me, lo:hi], ((before[me, lo:hi].float() + before[p, lo:hi].float()) * 0.5))
                continue
            eps = info["eps_received"][name]
            slack = torch.finfo(torch.float32).eps * got.abs()  # one float32 rounding of the result
            assert torch.all((got - want).abs() <= eps / 2 + slack), (name, eps)
            # it really was quantized: not the float32 exact average
            assert not _bitwise(after[me, lo:hi], (before[me, lo:hi].float() + before[p, lo:hi].float()) * 0.5)
            checked += 1
    assert checked or n == 3  # with 3 ranks this rank may sit out both rounds


@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.ranks(2, timeout=150)),
                               pytest.param(4, marks=pytest.mark.ranks(4, timeout=150))])
def test_too_far_apart_is_detected_and_resent_in_full_precision(hvd_torch, n):
    import torch
    from horovod_qsgd.torch.swarm import random_matching
    hvd = hvd_torch
    seed = next(s for s in range(100) if random_matching(n, 1, s)[0] >= 0)
    model = _model(hvd.rank(), noise=0.01)
    layout = {name: (lo, hi) for name, lo, hi, _ in _layout(model)}
    opt = _swarm(model, local_steps=1, quantization="lattice8", seed=seed)
    opt.step()  # exact calibration round
    _perturb(model, hvd.rank(), 0.005, salt=5)
    if hvd.rank() == 0:
        with torch.no_grad():
            model[0].weight[3, 4] += 1.0  # about 10x the radius (2x the spread of about 0.05 seen in round 0)
    before = _gather(hvd, _flat(model), "test.far.before")
    opt.step()
    after = _gather(hvd, _flat(model), "test.far.after")
    info, stats = opt.last_exchange(), opt.compression_stats()
    me, p = hvd.rank(), random_matching(n, 1, seed)[hvd.rank()]
    in_far_pair = 0 in (me, p)
    lo, hi = layout["param:0.weight"]
    if in_far_pair:
        # the distance is symmetric: each partner fails to decode the other's tensor, and both flag it
        assert info["failed"] == info["fallback"] == ["param:0.weight"]
        assert stats["decode_failures"] == 1 and stats["fallback_rounds"] == 1 and stats["fallback_tensors"] == 1
        assert _bitwise(after[me, lo:hi], (before[me, lo:hi] + before[p, lo:hi]) * 0.5)
        assert _bitwise(after[me, lo:hi], after[p, lo:hi])
    else:  # the other pair (4 ranks) decoded normally
        assert info["fallback"] == [] and info["failed"] == [] and stats["fallback_rounds"] == 0
    lo, hi = layout["param:3.weight"]  # decoded fine everywhere: quantized, within eps/2
    eps = info["eps_received"]["param:3.weight"]
    diff = (after[me, lo:hi].double() - (before[me, lo:hi].double() + before[p, lo:hi].double()) * 0.5).abs()
    assert diff.max() <= eps / 2 + 1e-7 and diff.max() > 0


@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.ranks(2, timeout=150)),
                               pytest.param(3, marks=pytest.mark.ranks(3, timeout=150))])
def test_nonblocking_applies_the_snapshot_average_plus_local_progress(hvd_torch, n):
    import torch
    from horovod_qsgd.torch.swarm import random_matching
    hvd = hvd_torch
    me = hvd.rank()
    model = _model(me, noise=1.0)
    opt = _swarm(model, local_steps=1, averaging="nonblocking", seed=13)
    snapshot = _gather(hvd, _flat(model), "test.nb.s0")
    opt.step()  # starts round 0 and returns: nothing applied yet
    assert _bitwise(_flat(model), snapshot[me])
    _perturb(model, me, 0.1, salt=9)  # "local progress" while the exchange is in flight
    current = _flat(model)
    opt.step()  # applies round 0, starts round 1
    p = random_matching(n, 0, 13)[me]
    expected = current if p < 0 else (snapshot[me] + snapshot[p]) * 0.5 + (current - snapshot[me])
    assert _bitwise(_flat(model), expected)
    snapshot = _gather(hvd, _flat(model), "test.nb.s1")
    opt.synchronize()  # applies round 1 with no progress since its snapshot: the exact average
    p = random_matching(n, 1, 13)[me]
    expected = snapshot[me] if p < 0 else (snapshot[me] + snapshot[p]) * 0.5
    assert _bitwise(_flat(model) + 0.0, expected + 0.0)  # avg + (x - x) == avg, up to the sign of zeros
    opt.synchronize()  # nothing in flight: no-op
    assert opt.swarm_round == 2
    # average_models: a few training steps (an exchange left in flight), then one global average
    for step in range(5):
        g = torch.Generator().manual_seed(10 * me + step)
        opt.zero_grad()
        model(torch.randn(8, 16, generator=g)).square().mean().backward()
        opt.step()
    assert opt._swarm.pending is not None
    before = _gather(hvd, _flat(model), "test.avg.before")
    opt.average_models()
    after = _gather(hvd, _flat(model), "test.avg.after")
    assert all(_bitwise(after[r], after[0]) for r in range(n))
    # the exchange in flight is applied first; pairwise averaging keeps the sum of the models
    assert torch.allclose(after[0], before.double().mean(0).float(), rtol=0, atol=1e-5)
    assert not torch.equal(after[0], before[0])


def _train(hvd, steps, averaging, start=None, capture_at=None):
    import io

    import torch
    from horovod_qsgd.torch.swarm import SwarmOptimizer
    model = _model(0, noise=0.0)
    opt = SwarmOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, local_steps=2,
                         quantization="lattice8", averaging=averaging, seed=5)
    first, captured = 0, None
    if start is not None:
        model.load_state_dict(start["model"])
        opt.load_state_dict(start["optimizer"])
        first = start["step"]
    for step in range(first, steps):
        if step == capture_at:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, buf)
            captured = buf.getvalue()
        g = torch.Generator().manual_seed(100 * hvd.rank() + step)
        x, y = torch.randn(16, 16, generator=g), torch.randint(0, 40, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    opt.synchronize()
    return _flat(model), captured, opt.compression_stats()


@pytest.mark.ranks(2, timeout=150)
def test_resume_from_a_checkpoint_is_bit_exact(hvd_torch):
    for averaging in ("blocking", "nonblocking"):
        _check_resume(hvd_torch, averaging)


def _check_resume(hvd, averaging):
    import io

    import torch
    uninterrupted, blob, stats = _train(hvd, 12, averaging, capture_at=7)  # mid-round; nonblocking: in flight
    assert stats["tensors_compressed"] > 0, stats
    state = torch.load(io.BytesIO(blob), weights_only=False)
    assert state["optimizer"]["swarm"]["round"] == 3 and state["optimizer"]["swarm"]["steps"] == 7
    assert (state["optimizer"]["swarm"]["pending"] is not None) == (averaging == "nonblocking")
    resumed, _, _ = _train(hvd, 12, averaging, start=state)
    assert _bitwise(resumed, uninterrupted)
    # without the swarm state (round counter, spread estimates, exchange in flight) the run differs
    del state["optimizer"]["swarm"]
    fresh, _, _ = _train(hvd, 12, averaging, start=state)
    assert not _bitwise(fresh, uninterrupted)
    # hvd.broadcast_optimizer_state steps a fresh optimizer once (here: a round starts) and loads the state back
    from horovod_qsgd.torch.swarm import SwarmOptimizer
    model = _model(0, noise=0.0)
    opt = SwarmOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, local_steps=1,
                         averaging=averaging)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.swarm_round == 1 and opt.state_dict()["swarm"]["steps"] == 1
    opt.synchronize()


@pytest.mark.ranks(2, timeout=120, alone=True)  # ends in an error on every rank
def test_different_settings_are_reported_on_every_rank(hvd_torch):
    from horovod_qsgd.common.errors import CompressionMismatchError
    hvd = hvd_torch
    opt = _swarm(_model(hvd.rank(), 0.0), local_steps=1 + hvd.rank())
    with pytest.raises(CompressionMismatchError, match=r"local_steps: rank 0=1, rank 1=2"):
        for _ in range(2):
            opt.step()


def test_single_process_and_argument_errors():
    hvd = pytest.importorskip("horovod.torch")
    import torch
    from horovod_qsgd.torch.swarm import SwarmMixin, SwarmOptimizer
    hvd.init()
    if hvd.size() != 1:
        pytest.skip("runs in a single process")
    model = _model(0, 0.0)
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for kwargs, message in [({"local_steps": 0}, "local_steps=0"), ({"averaging": "async"}, "averaging='async'"),
                            ({"quantization": "qsgd4"}, "quantization='qsgd4'"),
                            ({"quantization": "lattice9"}, "quantization='lattice9'"),
                            ({"quantization": {"bits": 2}}, "bits=2"), ({"topology": "star"}, "topology='star'"),
                            ({"topology": [(0, 1)]}, "must join two different ranks"), ({"seed": -1}, "seed=-1"),
                            ({"min_numel": -5}, "min_numel=-5")]:
        with pytest.raises(ValueError, match=message):
            SwarmOptimizer(base, model, **kwargs)
    with pytest.raises(ValueError, match="not in named_parameters"):
        SwarmOptimizer(base, list(model.named_parameters())[:2])
    opt = SwarmOptimizer(base, model, local_steps=1, quantization="lattice8")
    assert isinstance(opt, torch.optim.SGD) and isinstance(opt, SwarmMixin)
    assert opt.param_groups is base.param_groups and opt.state is base.state
    before = _flat(model)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 16)).sum().backward()
        opt.step()  # one rank: it sits out every round and trains locally
    assert opt.swarm_round == 3 and opt.compression_stats()["rounds_sat_out"] == 3
    assert not torch.equal(_flat(model), before)
    state = opt.state_dict()
    other = SwarmOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, local_steps=2)
    with pytest.raises(ValueError, match="settings"):
        other.load_state_dict(state)
