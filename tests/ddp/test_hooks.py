"""The DDP hooks under torchrun (Gloo): results against the codecs alone, bucket rebuilds, checkpoints, refusals."""
import pickle
import zlib

import numpy as np
import pytest

from tests.two_stage_reference import allgather_reference, bounds
from tests.two_stage_reference import reference as two_stage_reference

SHARED_LAUNCHES = "torch.distributed"  # one launch per rank count and env with the group's modules (tests/multirank.py)

# DDP puts all three into one bucket in the first iteration and rebuilds them into one bucket each after it
# (bucket_cap_mb=0.5). The small one passes through (fewer than MIN_NUMEL elements): beside the others in the
# first bucket, alone after the rebuild. 300,000 is not a multiple of QSGD's 512: the next parameter is padded.
SIZES = (700, 300_000, 290_000)
MIN_NUMEL = 1000


def _gradients(rank, step, dtype=None):
    """Each parameter's gradient on ``rank`` at ``step``: float32, or rounded to the torch ``dtype`` and widened."""
    rng = np.random.default_rng(1000 * rank + step)
    grads = [rng.standard_normal(n).astype(np.float32) for n in SIZES]
    if dtype is None:
        return grads
    import torch
    return [torch.from_numpy(g).to(dtype).float().numpy() for g in grads]


def _recording(hook, parameters, calls):
    """``hook``, recording per call the bucket's index, its parameters' positions in SIZES and the state's step."""
    position = {id(p): i for i, p in enumerate(parameters)}

    def recording_hook(state, bucket):
        calls.append((bucket.index(), [position[id(p)] for p in bucket.parameters()], state.iteration))
        return hook(state, bucket)

    return recording_hook


def _model(torch, dtype):
    class Weights(torch.nn.Module):
        """loss = sum_i <w_i, g_i>: the gradient of w_i is exactly g_i."""

        def __init__(self):
            super().__init__()
            self.w = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in SIZES])

        def forward(self, grads):  # a gradient of None: that parameter is not used
            return sum((w * g).sum() for w, g in zip(self.w, grads) if g is not None)

    return Weights()


def _state_class_and_hook(class_name):
    """(QSGDState, qsgd_hook) or (TopKState, topk_hook)."""
    import horovod_qsgd.ddp as ddp_hooks
    hook = ddp_hooks.qsgd_hook if class_name == "QSGDState" else ddp_hooks.topk_hook
    return getattr(ddp_hooks, class_name), hook


def _ddp(torch, state, hook, dtype=None, **ddp_kwargs):
    model = _model(torch, dtype or torch.float32)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.5, **ddp_kwargs)
    calls = []
    ddp.register_comm_hook(state, _recording(hook, list(model.w), calls))
    return ddp, calls


def _step(torch, ddp, rank, step, dtype=None):
    """One backward pass; returns every parameter's averaged gradient (float32 numpy copies)."""
    for p in ddp.parameters():
        p.grad = None
    ddp([torch.from_numpy(g).to(dtype or torch.float32) for g in _gradients(rank, step)]).backward()
    return [p.grad.float().numpy().copy() for p in ddp.module.w]


def _bucket(arrays, positions):
    return np.concatenate([arrays[i] for i in positions])


def _compressed(positions):
    return [i for i in positions if SIZES[i] >= MIN_NUMEL]


def _staged(arrays, positions, alignment):
    """What the hook compresses of a bucket: its large parameters, each starting at a multiple of ``alignment``."""
    pieces, at = [], 0
    for i in _compressed(positions):
        pieces += [np.zeros(-at % alignment, np.float32), arrays[i]]
        at += -at % alignment + SIZES[i]
    return np.concatenate(pieces)


def _unstaged(staged, positions, alignment):
    """{position: its slice of ``staged``}."""
    out, at = {}, 0
    for i in _compressed(positions):
        at += -at % alignment
        out[i] = staged[at:at + SIZES[i]]
        at += SIZES[i]
    return out


def _unbucket(flat, positions, arrays):
    offset = 0
    for i in positions:
        arrays[i][:] = flat[offset:offset + SIZES[i]]
        offset += SIZES[i]


class _Reference:
    """Every rank's result and state, computed with the codecs alone, as the Horovod adapter's tests do.

    Error feedback: residuals per rank and parameter; owner residuals per bucket index, which, when DDP
    rebuilt the bucket, go into their owner's per-parameter residuals where they lay before the new bucket
    is encoded (the hook's documented spill).
    """

    def __init__(self, state, num_ranks, dtype=None):
        self.state, self.num_ranks, self.dtype = state, num_ranks, dtype
        self.residuals = [[np.zeros(n, np.float32) for n in SIZES] for _ in range(num_ranks)] \
            if state.error_feedback else None
        self.owners = {}

    def bucket(self, index, positions, step):
        """({position: the average every rank must get} of the bucket's compressed parameters, its exchange)."""
        from horovod_qsgd.common.two_stage import choose_exchange
        state, num_ranks = self.state, self.num_ranks
        alignment = getattr(state.codec, "bucket_size", 1)
        self.spill_stale(index, positions)
        positions = _compressed(positions)
        xs = [_staged(_gradients(r, step, self.dtype), positions, alignment) for r in range(num_ranks)]
        name, numel = f"ddp.bucket{index}", xs[0].size
        residuals = None if self.residuals is None else [_staged(r, positions, 1) for r in self.residuals]
        exchange = choose_exchange(state.exchange, state.codec, state.second_codec, numel, num_ranks)
        if exchange == "two_stage":
            owners = self._owner_residuals(index, positions, numel) if residuals is not None else None
            total = two_stage_reference(state.codec, state.second_codec, name, xs, step,
                                        getattr(state.codec, "bucket_size", 1), residuals, owners)
        else:
            total = allgather_reference(state.codec, name, xs, step, residuals)
        for rank in range(num_ranks if residuals is not None else 0):
            _unbucket(residuals[rank], positions, self.residuals[rank])
        return _unstaged(total * np.float32(1.0 / num_ranks), positions, alignment), exchange

    def rescale(self, factor):
        """A loss scaler halved or doubled its scale: every residual follows (``rescale_residuals``)."""
        for residuals in self.residuals:
            for residual in residuals:
                residual *= np.float32(factor)
        for _, owners in self.owners.values():
            for owner in owners:
                owner *= np.float32(factor)

    def spill_stale(self, index, positions):
        """Bucket ``index`` now holds ``positions``: an owner residual kept for other parameters is spilled."""
        positions = _compressed(positions)
        saved = self.owners.get(index)
        if saved is None or saved[0] == positions:
            return
        old_positions, old_owners = self.owners.pop(index)
        old_numel = sum(SIZES[i] for i in old_positions)
        for rank, (begin, end) in enumerate(bounds(old_numel, self.num_ranks, 1)):
            whole = _bucket(self.residuals[rank], old_positions)
            whole[begin:end] += old_owners[rank]
            _unbucket(whole, old_positions, self.residuals[rank])

    def _owner_residuals(self, index, positions, numel):
        if index not in self.owners:
            self.owners[index] = (positions, [np.zeros(e - b, np.float32) for b, e in bounds(numel, self.num_ranks, 1)])
        return self.owners[index][1]


def _on(*counts, timeout=300):
    return [pytest.param(n, marks=pytest.mark.ranks(n, timeout=timeout, launcher="torchrun")) for n in counts]


CASES = [("QSGDState", {"bits": 4, "exchange": "allgather"}),
         ("QSGDState", {"bits": 3, "exchange": "auto", "second_stage_bits": 8}),
         ("TopKState", {"ratio": 0.01, "exchange": "allgather"}),
         ("TopKState", {"ratio": 0.02, "exchange": "two_stage"})]


@pytest.mark.parametrize("num_ranks", _on(2, 3))
def test_bucket_results_are_the_codecs_alone_and_equal_on_every_rank(num_ranks, dist_gloo):
    """Every bucket, 3 steps (the first before DDP rebuilds its buckets), QSGD and top-k, allgather and two
    stages: bitwise what the codecs give alone (the reference the Horovod adapter's tests hold it to: the
    Horovod adapter's bits for a tensor of the bucket's name), residuals included, halved after step 1 as a
    loss scaler's rescale_residuals does; small parameters get DDP's average, in a bucket of their own and
    beside compressed ones. On 4 ranks: test_across_two_nodes."""
    assert dist_gloo.get_world_size() == num_ranks
    for class_name, kwargs in CASES:
        _check_against_reference(dist_gloo, class_name, kwargs)


@pytest.mark.parametrize("num_ranks", _on(3))
def test_static_graph_gradient_as_bucket_view_and_half_precision(num_ranks, dist_gloo):
    """DDP's static_graph=True and gradient_as_bucket_view=True (the hook decodes into the gradients'
    memory) change nothing of the results; bfloat16 and float16 gradients are the codec's bits on the
    widened gradients, rounded back."""
    import torch
    for class_name, kwargs in [CASES[1], CASES[3]]:
        _check_against_reference(dist_gloo, class_name, kwargs, static_graph=True, gradient_as_bucket_view=True)
    for dtype in (torch.bfloat16, torch.float16):
        for class_name, kwargs in [CASES[0], CASES[3]]:
            _check_against_reference(dist_gloo, class_name, kwargs, dtype, gradient_as_bucket_view=True)


@pytest.mark.parametrize("num_ranks", _on(3))
def test_the_verdict_stamped_as_on_a_gpu(num_ranks, dist_gloo, monkeypatch):
    """The GPU's settling (each bucket's verdict stamped by the pass that scales its result, read by its next
    step's first pass; nothing read on the host) on CPU buckets: top-k allgather and two stages, 3 steps through
    DDP's rebuild, bitwise the codecs alone, residuals included; then inf in one rank's gradient: that bucket's
    residuals stay as they were on every rank, the others' go on, and the statistics count it. (The variable is
    read where a bucket's stamps are made, so setting it here, in the shared 3-rank launch, is enough.)"""
    import torch
    from horovod_qsgd.torch_shared.feedback import DEVICE_VERDICT_ENV
    monkeypatch.setenv(DEVICE_VERDICT_ENV, "1")
    rank = dist_gloo.get_rank()
    for class_name, kwargs in [CASES[2], CASES[3]]:
        ddp, calls, state, reference = _check_against_reference(dist_gloo, class_name, kwargs)
        _skip_a_partial_overflow(torch, dist_gloo, ddp, calls, state, reference)


@pytest.mark.parametrize("num_ranks", _on(2, 3))
def test_a_partial_overflow_leaves_every_buckets_residuals_as_they_were(num_ranks, dist_gloo):
    """inf in one parameter's gradient on one rank, the other buckets finite: the loss scaler skips the whole
    iteration, so no bucket keeps what it sent (the host's verdict, on the CPU)."""
    import torch
    for class_name, kwargs in [CASES[2], CASES[3]]:
        ddp, calls, state, reference = _check_against_reference(dist_gloo, class_name, kwargs)
        _skip_a_partial_overflow(torch, dist_gloo, ddp, calls, state, reference)


def _skip_a_partial_overflow(torch, dist, ddp, calls, state, reference):
    """An iteration with inf in one rank's gradient of SIZES[1] (alone in its bucket after DDP's rebuild): its
    bucket's result is not finite on every rank, the others' are; a loss scaler skips the iteration, and no
    bucket's residuals keep anything of it. The next iteration is then bitwise the reference's, which never saw
    the skipped one; the statistics count the non-finite bucket."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    before = {key: r.clone() for key, r in state.state_dict()["residuals"].items()}
    counted = state.compression_stats()["tensors_nonfinite"]
    grads = _gradients(rank, 9)
    if rank == num_ranks - 1:
        grads[1][5] = np.inf
    for p in ddp.parameters():
        p.grad = None
    ddp([torch.from_numpy(g) for g in grads]).backward()
    assert not torch.isfinite(ddp.module.w[1].grad).all() and torch.isfinite(ddp.module.w[2].grad).all()
    after = state.state_dict()["residuals"]
    assert after.keys() == before.keys()
    for key in before:
        assert torch.equal(after[key], before[key]), (type(state).__name__, key)
    assert state.compression_stats()["tensors_nonfinite"] == counted + 1
    # the skipped iteration took a step of the codecs' RNG: the next one is the reference's at the same step
    _step_as_the_reference(torch, ddp, calls, reference, rank, state.iteration,
                           f"{type(state).__name__} after the skipped iteration:")


def _check_against_reference(dist, class_name, kwargs, dtype=None, **ddp_kwargs):
    """``dtype`` (bfloat16, float16): the gradients are, the hook widens them to float32 for the codec and the
    result is the codec's average rounded back. Returns (the DDP model, the hook's calls, the state, the
    reference)."""
    import torch
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    make, hook = _state_class_and_hook(class_name)
    state = make(min_numel=MIN_NUMEL, **kwargs)
    ddp, calls = _ddp(torch, state, hook, dtype, **ddp_kwargs)
    reference = _Reference(state, num_ranks, dtype)

    def rounded(values):
        return values if dtype is None else torch.from_numpy(values).to(dtype).float().numpy()

    for step in range(3):
        if step == 2 and state.error_feedback:  # a loss scaler halved its scale after step 1's overflow
            state.rescale_residuals(0.5)
            reference.rescale(0.5)
        start = len(calls)
        got = _step(torch, ddp, rank, step, dtype)
        compressed = passed = 0
        for index, positions, iteration in calls[start:]:
            what = f"{class_name}{kwargs}{ddp_kwargs} step {step} bucket {index} (parameters {positions})"
            assert iteration == step, what
            for i in set(positions) - set(_compressed(positions)):  # passed through: DDP's own average
                mean = np.mean([_gradients(r, step, dtype)[i] for r in range(num_ranks)], axis=0)
                assert np.allclose(got[i], mean, atol=1e-6 if dtype is None else 2e-2), f"{what}: parameter {i}"
                passed += 1
            if not _compressed(positions):
                reference.spill_stale(index, positions)
                continue
            compressed += 1
            expected, exchange = reference.bucket(index, positions, step)
            for i, values in expected.items():
                assert np.array_equal(got[i].view(np.uint32), rounded(values).view(np.uint32)), \
                    f"{what} ({exchange}): parameter {i}"
        stats = state.compression_stats(reset=True)
        assert stats["tensors_compressed"] == compressed, stats
        assert stats["tensors_passed_through"] == passed, stats
    assert len({tuple(positions) for _, positions, _ in calls}) > 2, f"DDP did not rebuild: {calls}"
    if state.error_feedback:  # this rank's residuals are the reference's, parameter by parameter
        kept = state.state_dict()["residuals"]
        for key, position in _keys(calls).items():
            if SIZES[position] < MIN_NUMEL:
                assert key not in kept, "a parameter passed through has a residual"
                continue
            assert np.array_equal(kept[key].numpy(), reference.residuals[rank][position]), (class_name, key)
    _same_on_every_rank(dist, torch, [p.grad for p in ddp.module.w])
    return ddp, calls, state, reference


def _keys(calls):
    """The hook's parameter keys (the order it first met them) -> their positions in SIZES."""
    order = []
    for _, positions, _ in calls:
        for p in positions:
            if p not in order:
                order.append(p)
    return {key: position for key, position in enumerate(order)}


def _same_on_every_rank(dist, torch, tensors):
    flat = torch.cat([t.reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], g) for g in gathered), "the results differ between ranks"


def _step_as_the_reference(torch, ddp, calls, reference, rank, step, what):
    """One backward pass at ``step``: every compressed parameter's average is the reference's, bit for bit."""
    start = len(calls)
    got = _step(torch, ddp, rank, step)
    for index, positions, iteration in calls[start:]:
        assert iteration == step
        if not _compressed(positions):
            reference.spill_stale(index, positions)
            continue
        expected, _ = reference.bucket(index, positions, step)
        for i, values in expected.items():
            assert np.array_equal(got[i].view(np.uint32), values.view(np.uint32)), \
                f"{what} step {step} bucket {index} (parameters {positions}): parameter {i}"


@pytest.mark.parametrize("num_ranks", _on(3))
def test_a_resumed_job_continues_bitwise_through_the_bucket_rebuild(num_ranks, dist_gloo):
    """state_dict() after 2 steps, loaded into a new state behind a new DDP (whose first iteration has DDP's
    initial bucket again): the next 2 steps are the uninterrupted reference's, residuals moved by parameter."""
    import io

    import torch
    rank = dist_gloo.get_rank()
    for class_name, kwargs in [CASES[1], CASES[3]]:
        make, hook = _state_class_and_hook(class_name)
        state = make(min_numel=MIN_NUMEL, **kwargs)
        ddp, calls = _ddp(torch, state, hook)
        reference = _Reference(state, num_ranks)
        for step in range(4):
            if step == 2:
                saved = io.BytesIO()
                torch.save(state.state_dict(), saved)
                saved.seek(0)
                state = make(min_numel=MIN_NUMEL, **kwargs)
                state.load_state_dict(torch.load(saved, weights_only=False))
                ddp, calls = _ddp(torch, state, hook)
            _step_as_the_reference(torch, ddp, calls, reference, rank, step, class_name)
        assert len(calls[0][1]) == len(SIZES), "the resumed DDP's first iteration did not have one bucket"


@pytest.mark.parametrize("num_ranks", _on(2, 3))
def test_a_state_reloaded_after_the_bucket_rebuild_keeps_each_residual_with_its_parameter(num_ranks, dist_gloo):
    """load_state_dict(state_dict()) in the same process (a roll-back after a loss spike) after DDP rebuilt its
    buckets in another order than its initial one: the next steps are the uninterrupted reference's."""
    import torch
    rank = dist_gloo.get_rank()
    for class_name, kwargs in [CASES[2], CASES[3]]:
        make, hook = _state_class_and_hook(class_name)
        state = make(min_numel=MIN_NUMEL, **kwargs)
        ddp, calls = _ddp(torch, state, hook)
        reference = _Reference(state, num_ranks)
        for step in range(5):
            if step in (2, 3):
                state.load_state_dict(state.state_dict())
            _step_as_the_reference(torch, ddp, calls, reference, rank, step, class_name)
        first_seen = [p for _, positions, _ in calls[:1] for p in positions]
        rebuilt = [p for _, positions, iteration in calls if iteration == 4 for p in positions]
        assert rebuilt != first_seen, (first_seen, rebuilt)  # the case this is about: the last gradient is ready first
        # pickled as PowerSGD's states are: the settings and the state dict travel
        copied = pickle.loads(pickle.dumps(state))
        assert type(copied) is type(state) and copied.settings() == state.settings()
        saved, restored = state.state_dict(), copied.state_dict()
        assert restored["iteration"] == saved["iteration"] == 5
        assert saved["residuals"] and all(torch.equal(restored["residuals"][key], residual)
                                          for key, residual in saved["residuals"].items())


@pytest.mark.parametrize("num_ranks", _on(2, timeout=120))
def test_other_settings_on_one_rank_are_refused_on_every_rank(num_ranks, dist_gloo):
    import torch
    from horovod_qsgd.ddp import CompressionMismatchError, QSGDState, qsgd_hook
    rank = dist_gloo.get_rank()
    ddp, _ = _ddp(torch, QSGDState(bits=2 if rank == 1 else 4, min_numel=MIN_NUMEL), qsgd_hook)
    with pytest.raises(Exception) as raised:
        _step(torch, ddp, rank, 0)
    assert isinstance(raised.value, CompressionMismatchError) or "CompressionMismatchError" in str(raised.value)
    assert "bits: rank 0=4, rank 1=2" in str(raised.value)


@pytest.mark.parametrize("num_ranks", _on(2, timeout=120))
def test_a_state_of_another_model_is_refused_naming_the_parameter(num_ranks, dist_gloo):
    """Residuals of other lengths (another model's state) are refused on every rank at the first bucket that
    meets them, naming the parameter, instead of being added into its gradient."""
    import torch
    from horovod_qsgd.common.errors import CompressionMismatchError
    from horovod_qsgd.ddp import TopKState, topk_hook
    rank = dist_gloo.get_rank()
    state = TopKState(ratio=0.02, min_numel=MIN_NUMEL)
    ddp, _ = _ddp(torch, state, topk_hook)
    _step(torch, ddp, rank, 0)
    saved = state.state_dict()
    saved["residuals"] = {key: torch.zeros(r.numel() + 1) for key, r in saved["residuals"].items()}
    other = TopKState(ratio=0.02, min_numel=MIN_NUMEL)
    other.load_state_dict(saved)
    ddp, _ = _ddp(torch, other, topk_hook)
    with pytest.raises(Exception) as raised:
        _step(torch, ddp, rank, 1)
    message = str(raised.value)
    assert isinstance(raised.value, CompressionMismatchError) or "CompressionMismatchError" in message
    assert "(in the order DDP's buckets first held them) has" in message, message
    assert any(f"has {n} elements but its error-feedback residual has {n + 1}" in message for n in SIZES), message


@pytest.mark.parametrize("num_ranks", _on(2, timeout=120))
def test_node_aware_on_one_host_warns_on_every_rank_and_trains_node_blind(num_ranks, dist_gloo):
    """exchange='node_aware' where torchrun's ranks share one node: every rank warns why, and the step's
    results are those of exchange='auto' (node-blind), bit for bit."""
    import torch
    from horovod_qsgd.ddp import TopKState, topk_hook
    rank = dist_gloo.get_rank()
    asked = TopKState(ratio=0.02, exchange="node_aware", min_numel=MIN_NUMEL)
    ddp, _ = _ddp(torch, asked, topk_hook)
    with pytest.warns(UserWarning, match=r"needs several nodes.*but it has 1 node\(s\) of 2 rank\(s\).*node-blind"):
        got = _step(torch, ddp, rank, 0)
    assert asked.nodes is None
    blind, _ = _ddp(torch, TopKState(ratio=0.02, exchange="auto", min_numel=MIN_NUMEL), topk_hook)
    for mine, theirs in zip(got, _step(torch, blind, rank, 0)):
        assert np.array_equal(mine.view(np.uint32), theirs.view(np.uint32))


@pytest.mark.parametrize("num_ranks", [pytest.param(4, marks=pytest.mark.ranks(4, timeout=300,
                                                                            launcher="torchrun-nodes:2x2"))])
def test_across_two_nodes(num_ranks, dist_gloo):
    """4 ranks, as torchrun starts them on two network-namespace nodes of two (``benchmarks/nodelab.py``): every
    case of test_bucket_results_are_the_codecs_alone_and_equal_on_every_rank, the same bits (on CPU tensors
    'auto' takes no node-aware exchange)."""
    import os
    assert (os.environ["LOCAL_WORLD_SIZE"], os.environ["GROUP_RANK"]) == ("2", str(dist_gloo.get_rank() // 2))
    for class_name, kwargs in CASES:
        _check_against_reference(dist_gloo, class_name, kwargs)


class _NodeAwareReference:
    """The buckets under exchange='node_aware', from the codecs alone: the node sums of each shard in local-rank
    order, exchanged among the nodes as a tensor ``ddp.bucket<i>.shard<j>`` among ``nodes`` ranks, divided by N.

    Error feedback (top-k) lives where the compression happens: rank (node k, local j) keeps the residual of
    node k's sum of shard j and, from 3 nodes, the owner residual of its chunk of that shard. When DDP rebuilt
    a bucket, both go into that rank's per-parameter residuals where they lay, and those join its gradient
    before the node sum, once, the next time the parameter is reduced.
    """

    def __init__(self, state, nodes, per_node):
        self.state, self.nodes, self.per_node = state, nodes, per_node
        self.ranks = nodes * per_node
        self.carried = [[np.zeros(n, np.float32) for n in SIZES] for _ in range(self.ranks)] \
            if state.error_feedback else None
        self.kept = {}  # bucket index -> (compressed positions, shard, residuals by rank, owner residuals or None)

    def bucket(self, index, positions, step):
        """{position: the result every rank must get} of the bucket's compressed parameters."""
        from horovod_qsgd.common.two_stage import choose_exchange
        codec, second, nodes, per_node = self.state.codec, self.state.second_codec, self.nodes, self.per_node
        alignment = getattr(codec, "bucket_size", 1)
        positions = _compressed(positions)
        xs = [_staged(_gradients(r, step), positions, alignment) for r in range(self.ranks)]
        n = xs[0].size
        shard = -(-n // (per_node * alignment)) * alignment
        two_stage = choose_exchange("auto", codec, second, shard, nodes) == "two_stage"
        if self.carried is not None:
            self._spill_stale(index, positions, shard, two_stage)
            for r in range(self.ranks):
                xs[r] = xs[r] + _staged(self.carried[r], positions, alignment)
                for i in positions:
                    self.carried[r][i][:] = 0
            if index not in self.kept:
                chunks = bounds(shard, nodes, alignment)  # rank r owns chunk r // per_node of its shard
                self.kept[index] = (positions, shard, [np.zeros(shard, np.float32) for _ in range(self.ranks)],
                                    [np.zeros(np.subtract(*chunks[r // per_node][::-1]), np.float32)
                                     for r in range(self.ranks)] if two_stage else None)
            kept = self.kept[index]
        xs = [np.concatenate([x, np.zeros(per_node * shard - n, np.float32)]) for x in xs]
        result = np.zeros(per_node * shard, np.float32)
        for j in range(per_node):
            part = slice(j * shard, (j + 1) * shard)
            holders = [node * per_node + j for node in range(nodes)]  # the ranks that hold shard j
            sums = []
            for node in range(nodes):
                total = xs[node * per_node][part].copy()
                for i in range(1, per_node):
                    total += xs[node * per_node + i][part]
                sums.append(total)
            residuals = None if self.carried is None else [kept[2][r] for r in holders]
            name = f"ddp.bucket{index}.shard{j}"
            if two_stage:
                owners = None if self.carried is None else [kept[3][r] for r in holders]
                total = two_stage_reference(codec, second, name, sums, step, alignment, residuals, owners)
            else:
                total = np.zeros(shard, np.float32)
                for node, x in enumerate(sums):
                    out = np.zeros(codec.max_payload_nbytes(shard), np.uint8)
                    used = codec.encode(x, out, step=step, key=zlib.crc32(f"{name}@rank{node}".encode()),
                                        residual=None if residuals is None else residuals[node])
                    codec.decode_accumulate(out[:used], total)
            result[part] = total * np.float32(1.0 / self.ranks)
        return _unstaged(result[:n], positions, alignment)

    def passes_through(self, index):
        """Bucket ``index`` now holds small parameters only: what was kept for it is spilled."""
        if self.carried is not None:
            self._spill_stale(index, [], None, False)

    def _spill_stale(self, index, positions, shard, two_stage):
        """Bucket ``index`` now holds ``positions``: what was kept for other parameters is spilled."""
        alignment = getattr(self.state.codec, "bucket_size", 1)
        saved = self.kept.get(index)
        if saved is None or (saved[0], saved[1], saved[3] is not None) == (positions, shard, two_stage):
            return
        old_positions, old_shard, residuals, owners = self.kept.pop(index)
        old_numel = _staged([np.zeros(n, np.float32) for n in SIZES], old_positions, alignment).size
        for r in range(self.ranks):
            node, j = divmod(r, self.per_node)
            whole = np.zeros(self.per_node * old_shard, np.float32)
            whole[j * old_shard:(j + 1) * old_shard] += residuals[r]
            if owners is not None:
                begin, end = bounds(old_shard, self.nodes, alignment)[node]
                whole[j * old_shard + begin:j * old_shard + end] += owners[r]
            for i, values in _unstaged(whole[:old_numel], old_positions, alignment).items():
                self.carried[r][i] += values


@pytest.mark.parametrize("nodes, per_node", [
    pytest.param(2, 2, marks=pytest.mark.ranks(4, timeout=300, launcher="torchrun-nodes:2x2")),
    pytest.param(3, 2, marks=pytest.mark.ranks(6, timeout=400, launcher="torchrun-nodes:3x2"))])
def test_node_aware_is_the_node_sums_exchanged_between_nodes(nodes, per_node, dist_gloo):
    """exchange='node_aware', QSGD and top-k with its residuals: every bucket, 4 steps through DDP's rebuild,
    bitwise the reference on every rank (2 nodes: the nodes' allgather; 3 nodes: their two stages); small
    parameters get DDP's average; top-k resumed from state_dict() after 2 steps, its shard residuals at the
    end those of the reference."""
    import io

    import torch
    from horovod_qsgd.ddp import QSGDState, TopKState, qsgd_hook, topk_hook
    rank, ranks = dist_gloo.get_rank(), nodes * per_node
    for make, kwargs, hook in [(QSGDState, {"bits": 4}, qsgd_hook), (TopKState, {"ratio": 0.01}, topk_hook)]:
        state = make(exchange="node_aware", min_numel=MIN_NUMEL, **kwargs)
        reference = _NodeAwareReference(state, nodes, per_node)
        ddp, calls = _ddp(torch, state, hook)
        for step in range(4):
            if step == 2 and state.error_feedback:  # resumed from a checkpoint: the same bits go on
                saved = io.BytesIO()
                torch.save(state.state_dict(), saved)
                saved.seek(0)
                state = make(exchange="node_aware", min_numel=MIN_NUMEL, **kwargs)
                state.load_state_dict(torch.load(saved, weights_only=False))
                ddp, calls = _ddp(torch, state, hook)
            start = len(calls)
            got = _step(torch, ddp, rank, step)
            for index, positions, _ in calls[start:]:
                for i in set(positions) - set(_compressed(positions)):
                    mean = np.mean([_gradients(r, step)[i] for r in range(ranks)], axis=0)
                    assert np.allclose(got[i], mean, atol=1e-6), (step, index, i)
                if not _compressed(positions):
                    reference.passes_through(index)
                else:
                    for i, values in reference.bucket(index, positions, step).items():
                        assert np.array_equal(got[i].view(np.uint32), values.view(np.uint32)), \
                            (type(state).__name__, step, index, i)
        assert len({tuple(positions) for _, positions, _ in calls}) > 2, f"DDP did not rebuild: {calls}"
        _same_on_every_rank(dist_gloo, torch, [p.grad for p in ddp.module.w])
        if state.error_feedback:
            saved = state.state_dict()["shard_residuals"]
            assert saved.keys() == reference.kept.keys()
            for index, kept in saved.items():
                assert np.array_equal(kept["residual"].numpy(), reference.kept[index][2][rank]), index
                assert np.abs(kept["residual"].numpy()).sum() > 0, index
        _check_nonfinite_step_is_discarded(torch, dist_gloo, ddp, calls, state, rank, ranks)


@pytest.mark.parametrize("num_ranks", _on(2, 3))
def test_a_parameter_no_rank_used_keeps_its_residual(num_ranks, dist_gloo):
    """find_unused_parameters=True: in an iteration where no rank uses SIZES[1], DDP gives it no result, so its
    residual must sit the step out (what the step sent of it would be lost); where rank 0 alone does not use
    it, rank 0's waits and the others' go on; once rank 0 uses it again, its held residual is sent."""
    import torch
    from horovod_qsgd.ddp import TopKState, topk_hook
    rank = dist_gloo.get_rank()
    state = TopKState(min_numel=MIN_NUMEL, ratio=0.01, exchange="allgather")
    ddp, calls = _ddp(torch, state, topk_hook, find_unused_parameters=True)

    def step(step_index, unused):
        grads = [torch.from_numpy(g) for g in _gradients(rank, step_index)]
        for p in ddp.parameters():
            p.grad = None
        ddp([None if i in unused else g for i, g in enumerate(grads)]).backward()
        _same_on_every_rank(dist_gloo, torch, [ddp.module.w[0].grad, ddp.module.w[2].grad])
        keys = {position: key for key, position in _keys(calls).items()}
        return {position: state.state_dict()["residuals"][keys[position]].clone() for position in (1, 2)}

    step(0, ())
    before = step(1, ())
    after = step(2, {1})  # no rank uses it
    assert ddp.module.w[1].grad is None
    assert torch.equal(after[1], before[1]), "the unused parameter's residual changed"
    assert not torch.equal(after[2], before[2])
    alone = step(3, {1} if rank == 0 else ())
    assert torch.equal(alone[1], after[1]) == (rank == 0), rank
    back = step(4, ())
    assert not torch.equal(back[1], alone[1])


def test_hooks_are_named_apart_and_other_buckets_and_failed_collectives_are_reported():
    """qsgd_hook and topk_hook are two functions (DDP's logging names the hook); DDP's python reducer's tuple
    is refused with the fix; a bucket whose collective failed fails with that collective's error."""
    import types

    import torch
    from horovod_qsgd.ddp import TopKState, hooks, qsgd_hook, topk_hook
    assert qsgd_hook is not topk_hook and qsgd_hook.__name__ == "qsgd_hook" and topk_hook.__name__ == "topk_hook"
    with pytest.raises(TypeError, match="python_reducer"):
        topk_hook(TopKState(), (torch.zeros(4),))
    lost = torch.futures.Future()
    lost.set_exception(RuntimeError("Connection closed by peer"))
    exchange = types.SimpleNamespace(state=TopKState(), plan=None, conduct=None, transport=None,
                                     future=torch.futures.Future())
    hooks._finish(exchange, None, lost)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        exchange.future.wait()


def test_residuals_spilled_by_a_rebuild_and_not_yet_sent_are_saved():
    """A bucket rebuild spills a node-aware bucket's shard residual into its parameters' keys, sent by their
    next bucket: a checkpoint taken before then saves them (per-parameter residuals are otherwise empty there)."""
    import torch
    from horovod_qsgd.ddp import TopKState
    state = TopKState(exchange="node_aware")
    state.feedback._spilled[3] = torch.ones(5)
    state.feedback._residuals[4], state.feedback._spilled[4] = torch.ones(2), torch.full((2,), 2.0)
    saved = state.state_dict()["residuals"]
    assert torch.equal(saved[3], torch.ones(5)) and torch.equal(saved[4], torch.full((2,), 3.0))
    restored = TopKState(exchange="node_aware")
    restored.load_state_dict(state.state_dict())
    assert torch.equal(restored.state_dict()["residuals"][3], torch.ones(5))


def _residual_tensors(state):
    """Every error-feedback tensor of a DDP state (not its step counter), flattened, by where it is kept."""
    saved = state.state_dict()
    found = {f"residuals/{key}": r for key, r in saved["residuals"].items()}
    for kind in ("owner_residuals", "shard_residuals"):
        found.update({f"{kind}/{index}": entry["residual"] for index, entry in saved[kind].items()})
    return {name: tensor.clone() for name, tensor in found.items()}


def _check_nonfinite_step_is_discarded(torch, dist, ddp, calls, state, rank, ranks):
    """inf in one rank's gradient of SIZES[1], alone in its bucket after DDP's rebuild: that bucket's result is
    not finite on every rank, the others' are; a loss scaler skips the whole iteration, so every bucket's
    error-feedback state stays as it was; the statistics count the non-finite bucket."""
    before, counted = _residual_tensors(state), state.compression_stats()["tensors_nonfinite"]
    start = len(calls)
    for p in ddp.parameters():
        p.grad = None
    grads = _gradients(rank, 9)
    if rank == ranks - 1:
        grads[1][5] = np.inf
    ddp([torch.from_numpy(g) for g in grads]).backward()
    finite = torch.tensor([bool(torch.isfinite(p.grad).all()) for p in ddp.module.w], dtype=torch.int32)
    everywhere = [torch.empty_like(finite) for _ in range(ranks)]
    dist.all_gather(everywhere, finite)
    assert all(f.tolist() == [1, 0, 1] for f in everywhere), [f.tolist() for f in everywhere]
    after = _residual_tensors(state)
    assert after.keys() == before.keys(), (after.keys(), calls[start:])
    changed = {name for name in before if not torch.equal(after[name], before[name])}
    assert not changed, (type(state).__name__, changed)  # the loss scaler skips the whole iteration
    assert state.compression_stats()["tensors_nonfinite"] == counted + 1


# alone: it breaks rank 0's payloads, and a rank's decode on its own
@pytest.mark.parametrize("num_ranks", [pytest.param(4, marks=pytest.mark.ranks(4, timeout=240, alone=True,
                                                                            launcher="torchrun-nodes:2x2"))])
def test_node_aware_failures_are_raised_where_their_bytes_go_without_a_hang(num_ranks, dist_gloo):
    """Rank 0's payload of its shard replaced by a refusal notice: the nodes' local ranks 0 receive it and
    forward it inside their nodes, so every rank of both nodes raises on it, naming rank 0 between nodes.
    Then a decode that fails on rank 1 alone (not in the bytes): rank 1 raises, the others, who decoded
    those bytes themselves, go on with the step."""
    import torch
    from horovod_qsgd.common import engine
    from horovod_qsgd.common.exchange import refusal_notice
    from horovod_qsgd.ddp import QSGDState, qsgd_hook
    rank = dist_gloo.get_rank()
    encode, decode = engine.AllgatherPlan.encode, engine.AllgatherPlan.decode
    if rank == 0:
        def refusing(self, x, out, step, residual=None):
            used = encode(self, x, out, step, residual)
            out[:len(refusal_notice())] = np.frombuffer(refusal_notice(), np.uint8)
            return used
        engine.AllgatherPlan.encode = refusing
    ddp, _ = _ddp(torch, QSGDState(bits=4, exchange="node_aware", min_numel=MIN_NUMEL), qsgd_hook)
    with pytest.raises(Exception) as raised:
        _step(torch, ddp, rank, 0)
    assert "rank 0 found a mismatch" in str(raised.value), raised.value
    assert "(between nodes: its rank k is local rank 0 of node k)" in str(raised.value), raised.value

    engine.AllgatherPlan.encode = encode
    if rank == 1:
        def failing(self, gathered, out):
            raise ValueError("injected decode failure")
        engine.AllgatherPlan.decode = failing
    ddp, _ = _ddp(torch, QSGDState(bits=4, exchange="node_aware", min_numel=MIN_NUMEL), qsgd_hook)
    if rank != 1:
        _step(torch, ddp, rank, 0)
        return
    with pytest.raises(Exception, match="injected decode failure"):
        _step(torch, ddp, rank, 0)
    engine.AllgatherPlan.decode = decode
