"""The stock hvd.DistributedOptimizer with our compressors, on 2 and 3 real Horovod ranks.

Each test checks what a rank receives against a reference built independently
in the test: every rank encodes its own local gradient with a fresh codec,
the raw payloads are exchanged with a plain hvd.allgather, and the decoded sum
is scaled for Sum or Average. Equality is bitwise.
"""
import pytest

SHARED_LAUNCHES = "horovod.torch"  # a launch per rank count and env with the torch modules (tests/multirank.py)
RANKS_2_AND_3 = [pytest.param(2, marks=pytest.mark.ranks(2)), pytest.param(3, marks=pytest.mark.ranks(3))]


def _model(seed=0, unused=False):
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wide = torch.nn.Linear(64, 300)     # 19200 weights: compressed
            self.head = torch.nn.Linear(300, 40)     # 12000 weights: compressed
            self.spare = torch.nn.Linear(64, 200)    # 12800 weights: used on odd steps only
            self.use_spare = False

        def forward(self, x):
            h = torch.relu(self.wide(x))
            out = self.head(h)
            if self.use_spare or not unused:
                out = out + self.spare(x).sum(dim=1, keepdim=True) * 0.01
            return out

    torch.manual_seed(seed)
    return Net()


def _batch(rank, step):
    import torch
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(32, 64, generator=g), torch.randint(0, 40, (32,), generator=g)


def _loss(model, x, y):
    import torch
    return torch.nn.functional.cross_entropy(model(x), y)


def _reference(hvd, compressor, local_grads, residuals, steps, num_ranks, op):
    """What every rank should receive, computed with the codec and a plain allgather."""
    import torch
    from horovod_qsgd.codecs import HEADER_NBYTES, parse_header
    from horovod_qsgd.common.naming import rank_key
    codec = compressor.codec
    expected = {}
    for name, grad in local_grads.items():
        if grad.numel() < compressor.min_numel:
            continue
        flat = grad.reshape(-1).float().contiguous()
        out = torch.empty(codec.max_payload_nbytes(flat.numel()), dtype=torch.uint8)
        residual = residuals.setdefault(name, torch.zeros_like(flat)) if compressor.error_feedback else None
        nbytes = codec.encode(flat.numpy(), out.numpy(), step=steps[name],
                              key=rank_key(name, hvd.rank()),
                              residual=None if residual is None else residual.numpy())
        gathered = hvd.allgather(out[:nbytes], name="reference." + name)
        total = torch.zeros(flat.numel(), dtype=torch.float32)
        offset = 0
        for _ in range(num_ranks):
            header = parse_header(bytes(gathered[offset:offset + HEADER_NBYTES].numpy()))
            codec.decode_accumulate(gathered[offset:offset + header.nbytes].numpy(), total.numpy())
            offset += header.nbytes
        if op == "average":
            total = total * (1.0 / num_ranks)
        expected[name] = total.view(grad.shape)
    return expected


def _compressor(kind):
    from horovod_qsgd.torch import QSGD, TopK
    if kind == "qsgd4":
        return QSGD(bits=4)
    if kind == "qsgd2-l2":
        return QSGD(bits=2, norm="l2", bucket_size=1024)
    if kind == "topk-exact":
        return TopK(ratio=0.01)
    if kind == "topk-gaussian":
        return TopK(ratio=0.01, selector="gaussian")
    raise ValueError(kind)


def _run_and_compare(hvd, num_ranks, kind, op_name, steps=3, predivide=1.0, groups=None,
                     backward_passes=1, unused=False):
    import torch
    model = _model(unused=unused)
    compressor = _compressor(kind)
    ref_residuals = {}
    op = {"sum": hvd.Sum, "average": hvd.Average}[op_name]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=compressor,
                                   op=op, gradient_predivide_factor=predivide, groups=groups,
                                   backward_passes_per_step=backward_passes)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    ref_steps = {}
    for step in range(steps):
        model.use_spare = step % 2 == 1
        opt.zero_grad()  # torch's default set_to_none=True: every step gets new grad tensors
        assert all(p.grad is None for p in model.parameters())
        for micro in range(backward_passes):
            x, y = _batch(hvd.rank(), step * backward_passes + micro)
            _loss(model, x, y).backward()
        local = {}
        for name, p in model.named_parameters():
            # An unused parameter's gradient is None locally; the optimizer submits zeros for it.
            local[name] = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        opt.synchronize()
        expected = _reference(hvd, compressor, local, ref_residuals,
                              {n: ref_steps.get(n, 0) for n in local}, num_ranks, op_name)
        for name in expected:
            ref_steps[name] = ref_steps.get(name, 0) + 1
        received = dict(model.named_parameters())
        assert expected, "no tensor was large enough to be compressed"
        for name, want in expected.items():
            got = received[name].grad
            assert torch.equal(got, want), (
                f"step {step}, {name}: max diff {(got - want).abs().max().item()}")
        with opt.skip_synchronize():
            opt.step()
    stats = compressor.compression_stats()
    assert stats["tensors_compressed"] > 0 and stats["bytes_sent"] < stats["bytes_uncompressed"]
    return model


@pytest.mark.parametrize("num_ranks", RANKS_2_AND_3)
@pytest.mark.parametrize("kind", ["qsgd4", "qsgd2-l2", "topk-exact", "topk-gaussian"])
def test_received_gradient_is_average_of_decoded_payloads(hvd_torch, num_ranks, kind):
    _run_and_compare(hvd_torch, num_ranks, kind, "average")


@pytest.mark.ranks(2)
@pytest.mark.parametrize("op_name,predivide", [("sum", 1.0), ("average", 1.0), ("average", 2.0)])
def test_sum_average_and_predivide(hvd_torch, op_name, predivide):
    _run_and_compare(hvd_torch, 2, "qsgd4", op_name, predivide=predivide)


@pytest.mark.ranks(2)
def test_groups_accumulation_and_unused_parameter(hvd_torch):
    _run_and_compare(hvd_torch, 2, "topk-exact", "average", steps=4, groups=2, backward_passes=2,
                     unused=True)


@pytest.mark.ranks(3)
def test_unused_parameter_three_ranks(hvd_torch):
    _run_and_compare(hvd_torch, 3, "qsgd4", "average", steps=4, unused=True)


@pytest.mark.ranks(2)
def test_ranks_end_with_identical_weights(hvd_torch):
    import torch
    model = _run_and_compare(hvd_torch, 2, "qsgd4", "average", steps=3)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd_torch.allgather(flat.unsqueeze(0), name="weights")
    assert torch.equal(gathered[0], gathered[1])


@pytest.mark.parametrize("num_ranks", RANKS_2_AND_3)
def test_a_frozen_layer_stays_where_it_was(hvd_torch, num_ranks):
    """Freezing a layer after the optimizer was built (fine-tuning a backbone): Horovod still submits a zero
    gradient for it, and its error-feedback residual must not move the frozen weights."""
    import torch
    from horovod_qsgd.torch import TopK
    hvd = hvd_torch
    assert hvd.size() == num_ranks
    model = _model()
    compressor = TopK(ratio=0.1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(), compression=compressor)
    for step in range(4):
        if step == 1:
            for p in model.wide.parameters():
                p.requires_grad_(False)
            frozen = model.wide.weight.detach().clone()
            head_before = model.head.weight.detach().clone()
        optimizer.zero_grad()
        _loss(model, *_batch(hvd.rank(), step)).backward()
        optimizer.step()
    assert torch.equal(model.wide.weight, frozen), float((model.wide.weight - frozen).abs().max())
    assert not torch.equal(model.head.weight, head_before)  # the rest still trains
    # the frozen layer's residual waits for it to be unfrozen, as it was after the first step
    residual = compressor.state_dict()["tensors"]["wide.weight"]["residual"]
    assert residual is not None and float(residual.abs().sum()) > 0


@pytest.mark.parametrize("num_ranks", RANKS_2_AND_3)
def test_a_second_user_of_a_tensor_name_is_refused_on_every_rank(hvd_torch, num_ranks):
    """The compressor keeps error feedback by tensor name: a second model's parameter of the same name, or a
    direct hvd.allreduce under a parameter's name, would share the first one's residual (an all-zero gradient
    came back as that residual). Refused on every rank, naming the tensor; a deleted model's names are free."""
    import gc
    import torch
    from horovod_qsgd.torch import TopK
    hvd = hvd_torch
    assert hvd.size() == num_ranks
    compressor = TopK(ratio=0.01)

    def train_one_step(model):
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=model.named_parameters(), compression=compressor)
        _loss(model, *_batch(hvd.rank(), 0)).backward()
        optimizer.step()
        return optimizer

    first = _model()
    kept = train_one_step(first)
    with pytest.raises(ValueError, match="'head.weight'.*share one residual"):
        hvd.allreduce(torch.zeros(12000), name="head.weight", compression=compressor)
    second = _model(seed=1)
    with pytest.raises(ValueError, match="share one residual") as refused:
        train_one_step(second)
    assert "another parameter" in str(refused.value)
    _loss(first, *_batch(hvd.rank(), 1)).backward()  # the first model goes on
    kept.step()
    del kept, first, second, refused
    gc.collect()
    train_one_step(_model(seed=2))  # its names are free once it is gone
