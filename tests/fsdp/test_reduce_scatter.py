"""The FSDP2 compressed reduce-scatter under torchrun (Gloo): every rank's sharded gradient against the codecs
alone, FSDP2's ops and bfloat16, residuals, a resumed job, a non-finite step, settings refused on every rank."""
import io

import numpy as np
import pytest

from tests.reduce_scatter_reference import (fsdp_rows, fsdp_shards, reduce_scatter_reference, stage, staged,
                                           three_unit_model, unstage, weights_module)

SHARED_LAUNCHES = "torch.distributed"  # one launch per rank count and env with the group's modules (tests/multirank.py)

# fully_shard modules: "a" (three parameters, none a multiple of 512 or of the rank count: padded shards),
# "small" (fewer than MIN_NUMEL elements: passed through uncompressed) and the root (the parameters of "b").
MODULES = {"fsdp.a": (20_000, 5, 3001), "fsdp.small": (50,), "fsdp.root": (12_345,)}
MIN_NUMEL = 1000


def _on(*counts, timeout=300):
    return [pytest.param(n, marks=pytest.mark.ranks(n, timeout=timeout, launcher="torchrun")) for n in counts]


def _gradients(name, rank, step):
    rng = np.random.default_rng([rank, step, len(name), sum(MODULES[name])])
    return [rng.standard_normal(n).astype(np.float32) for n in MODULES[name]]


def _model(torch, mp_policy=None, frozen=None):
    """loss = sum_i <w_i, g_i> over every module: the gradient of w_i is exactly g_i (rounded to the param dtype)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = three_unit_model(MODULES)
    if frozen is not None:  # (module attribute, parameter index): trained by no one
        getattr(model, frozen[0]).w[frozen[1]].requires_grad_(False)
    policy = mp_policy or MixedPrecisionPolicy()
    fully_shard(model.a, mp_policy=policy)
    fully_shard(model.small, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _fsdp_modules(model):
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]  # FSDP2's setters act on one module each


def _step(torch, model, rank, step, poison=None, unused=None):
    """One backward pass; {module name: [this rank's sharded gradient of each parameter, or None]} (float32
    numpy). ``unused``: (module, parameter index) left out of the loss."""
    grads = {name: [torch.from_numpy(g) for g in _gradients(name, rank, step)] for name in MODULES}
    if poison is not None:
        grads[poison][0][3] = float("inf")
    if unused is not None:
        grads[unused[0]][unused[1]] = None
    model.zero_grad(set_to_none=True)
    model(grads).backward()
    params = {"fsdp.a": model.a.w, "fsdp.small": model.small.w, "fsdp.root": model.b.w}
    return {name: [None if p.grad is None else p.grad.to_local().float().numpy().copy() for p in ps]
            for name, ps in params.items()}


class _Reference:
    """Every rank's sharded gradients and residuals, from the codecs alone; ``per_node``: the node-aware exchange
    on nodes of that many ranks (rank = node * per_node + local rank, as torchrun numbers them)."""

    def __init__(self, compressor, num_ranks, per_node=None):
        self.compressor, self.num_ranks, self.per_node, self.steps = compressor, num_ranks, per_node, {}
        self.residuals = {} if compressor.error_feedback else None  # name -> {rank: staged residual}
        self.lean = compressor.residual_dtype == "bfloat16"  # residuals rounded to bfloat16, zeroed when skipped

    def _crossing(self, rows, rank):
        """(the ranks whose exchange ``rank`` is in, their rows as it compresses them, its name's suffix): every
        rank and its own rows, or node-aware the ranks of its local index, one per node, each with its node's
        sum (in local-rank order) of the rows they own."""
        if self.per_node is None:
            return list(range(self.num_ranks)), rows, ""
        per_node, local = self.per_node, rank % self.per_node
        holders = list(range(local, self.num_ranks, per_node))
        sums = []
        for node in range(self.num_ranks // per_node):
            total = rows[node * per_node][holders].copy()
            for i in range(1, per_node):
                total += rows[node * per_node + i][holders]
            sums.append(total)
        return holders, sums, f".shard{local}"

    def rescale(self, factor):
        """A loss scaler halved or doubled its scale: every residual follows (``rescale_residuals``)."""
        for kept in self.residuals.values():
            for residual in kept.values():
                residual *= np.float32(factor)

    def step(self, step, rank, finish, rounding=None, poisoned=None, unused=None, zero_unused=False, frozen=None):
        """{name: this rank's shards}; ``finish(total)``: the scaling FSDP2's op and divide factor give;
        ``rounding``: the reduce dtype's rounding of the gradients; ``poisoned``: (module, rank) with an inf;
        ``unused``: (module, parameter index) without a gradient, left out of the rows, which are then
        compressed as one piece (or, ``zero_unused``, a zero gradient in its place); ``frozen``: (module,
        parameter index) that takes no gradient, left out of the rows, every other parameter its own piece."""
        rounding = rounding or (lambda a: a)
        codec, unit, out = self.compressor.codec, getattr(self.compressor.codec, "bucket_size", 1), {}
        saved, finite = {}, True  # every module's residuals before the step; whether every module's sums are finite
        for name, sizes in MODULES.items():
            grads = [[rounding(g) for g in _gradients(name, r, step)] for r in range(self.num_ranks)]
            if poisoned is not None and poisoned[0] == name:
                grads[poisoned[1]][0][3] = np.inf
            left_out = unused is not None and unused[0] == name
            if left_out:
                for g in grads:
                    g[unused[1]] = np.zeros_like(g[unused[1]]) if zero_unused else None
                left_out = not zero_unused
            missing = {unused[1]} if left_out else set()
            if frozen is not None and frozen[0] == name:
                missing.add(frozen[1])
                for g in grads:
                    g[frozen[1]] = None
            kept_sizes = [n for i, n in enumerate(sizes) if i not in missing]
            rows = [fsdp_rows([g for g in gs if g is not None], self.num_ranks) for gs in grads]
            pieces = rows[0][1]
            stage_pieces = [sum(pieces)] if left_out else pieces
            if sum(pieces) * self.num_ranks < MIN_NUMEL:
                total = sum((r[rank] for r, _ in rows[1:]), rows[0][0][rank].copy())
                out[name] = fsdp_shards(rounding(finish(total)), pieces, sizes, rank)
                continue
            holders, inputs, suffix = self._crossing([r for r, _ in rows], rank)
            xs = [stage(x, stage_pieces, unit) for x in inputs]
            residuals = None
            if self.residuals is not None:  # one of another size (the rows changed) starts again from zeros
                kept = self.residuals.setdefault(name, {})
                for r in holders:
                    if kept.get(r) is None or kept[r].size != xs[0].size:
                        kept[r] = np.zeros(xs[0].size, np.float32)
                residuals = [kept[r] for r in holders]
                saved[name] = {r: kept[r].copy() for r in holders}
            sums = reduce_scatter_reference(codec, name + suffix, xs, self.steps.get(name, 0), residuals)
            if self.lean:
                for residual in residuals:
                    residual[:] = _bf16(residual)
            self.steps[name] = self.steps.get(name, 0) + 1
            finite = finite and all(np.isfinite(s).all() for s in sums)
            own = fsdp_shards(rounding(finish(unstage(sums[holders.index(rank)], stage_pieces, unit))), pieces,
                          kept_sizes, rank)
            out[name] = [None if i in missing else own.pop(0) for i in range(len(sizes))]
        if not finite:  # a non-finite sum of any module, on any rank: the step is skipped, every residual stays
            for name, before in saved.items():
                for r, residual in before.items():
                    self.residuals[name][r][:] = 0 if self.lean else residual
        return out


def _compressor(kind, exchange="auto"):
    from horovod_qsgd.fsdp import QSGD, TopK
    return QSGD(bits=4, min_numel=MIN_NUMEL, exchange=exchange) if kind == "qsgd" else \
        TopK(ratio=0.02, min_numel=MIN_NUMEL, exchange=exchange,
             residual_dtype="bfloat16" if kind == "topk-lean" else "float32")


def _bf16(a):
    import torch
    return torch.from_numpy(np.ascontiguousarray(a)).to(torch.bfloat16).float().numpy()


def _assert_equal(ours, expected):
    for name in MODULES:
        assert len(ours[name]) == len(expected[name]), name
        for got, want in zip(ours[name], expected[name]):
            assert (got is None) == (want is None), name
            if want is not None:
                np.testing.assert_array_equal(got, want, err_msg=name)


def _assert_residuals(compressor, reference, rank):
    if reference.residuals is None:
        return
    for name in ("fsdp.a", "fsdp.root"):
        saved = compressor.state_dict()["modules"][name]["residual"].float().numpy()
        np.testing.assert_array_equal(saved, reference.residuals[name][rank], err_msg=name)


def _check_against_reference(torch, rank, num_ranks, kind, exchange="auto", per_node=None):
    """3 steps of FSDP2's default AVG: every sharded gradient and residual the reference's, the residuals halved
    after step 1 as a loss scaler's rescale_residuals does; the statistics."""
    from horovod_qsgd.fsdp import compress_reduce_scatter
    model = _model(torch)
    compressor = compress_reduce_scatter(model, _compressor(kind, exchange))
    reference = _Reference(compressor, num_ranks, per_node)
    for step in range(3):
        if step == 2 and compressor.error_feedback:
            compressor.rescale_residuals(0.5)
            reference.rescale(0.5)
        _assert_equal(_step(torch, model, rank, step), reference.step(step, rank, lambda t: t * (1.0 / num_ranks)))
        _assert_residuals(compressor, reference, rank)
    return compressor


@pytest.mark.parametrize("num_ranks", _on(2, 3, 4))
def test_sharded_gradients_are_the_codecs_alone_on_every_rank(num_ranks, dist_gloo):
    """QSGD-4 and top-k with error feedback, 3 steps, FSDP2's default AVG: each rank's sharded gradients are
    bitwise the codecs' result for its row (padded shards, each parameter's piece on its own QSGD buckets),
    the small module's an exact sum, the residuals the reference's; the statistics count what was sent."""
    import torch
    rank = dist_gloo.get_rank()
    assert dist_gloo.get_world_size() == num_ranks
    for kind in ("qsgd", "topk"):
        compressor = _check_against_reference(torch, rank, num_ranks, kind)
        stats = compressor.compression_stats()
        assert (stats["tensors_compressed"], stats["tensors_passed_through"]) == (6, 3)
        assert stats["exchanges"] == {"fsdp.a": "reduce_scatter", "fsdp.root": "reduce_scatter"}
        unit = getattr(compressor.codec, "bucket_size", 1)
        rows = {n: staged(fsdp_rows(_gradients(n, 0, 0), num_ranks)[1], unit)[1] for n in ("fsdp.a", "fsdp.root")}
        payloads = sum(compressor.codec.max_payload_nbytes(rows[n]) for n in rows)
        small = (num_ranks - 1) * -(-50 // num_ranks) * 4
        assert stats["bytes_sent"] == 3 * ((num_ranks - 1) * payloads + small)


@pytest.mark.parametrize("num_ranks", [pytest.param(4, marks=pytest.mark.ranks(4, timeout=300,
                                                                            launcher="torchrun-nodes:2x2"))])
def test_node_aware_across_two_nodes(num_ranks, dist_gloo):
    """torchrun on two network-namespace nodes of two ranks (``benchmarks/nodelab.py``), exchange="node_aware":
    each rank's sharded gradients are the codecs' result for its node sums (in local-rank order) exchanged
    among the ranks of its local index; only compressed rows crossed; "auto" stays flat on CPU gradients."""
    import os

    import torch
    rank = dist_gloo.get_rank()
    assert (os.environ["LOCAL_WORLD_SIZE"], os.environ["GROUP_RANK"]) == ("2", str(rank // 2))
    for kind in ("qsgd", "topk"):
        compressor = _check_against_reference(torch, rank, num_ranks, kind, "node_aware", per_node=2)
        stats = compressor.compression_stats()
        assert stats["exchanges"] == {"fsdp.a": "node_aware", "fsdp.root": "node_aware"}
        unit = getattr(compressor.codec, "bucket_size", 1)
        pieces = {n: fsdp_rows(_gradients(n, 0, 0), num_ranks)[1] for n in ("fsdp.a", "fsdp.root")}
        between = sum(compressor.codec.max_payload_nbytes(staged(p, unit)[1]) for p in pieces.values())
        in_node = sum(2 * sum(p) * 4 for p in pieces.values())  # 2 nodes' rows to the node's other rank
        small = 3 * -(-50 // num_ranks) * 4
        assert (stats["bytes_sent"], stats["bytes_sent_in_node"]) == (3 * (between + small), 3 * in_node)
    assert _check_against_reference(torch, rank, num_ranks, "qsgd").compression_stats()["exchanges"] == \
        {"fsdp.a": "reduce_scatter", "fsdp.root": "reduce_scatter"}


@pytest.mark.parametrize("num_ranks", _on(3))
def test_fsdp_ops_and_bfloat16(num_ranks, dist_gloo):
    """PREMUL_SUM (a gradient divide factor), SUM then FSDP2's own division (force_sum_reduction_for_comms) and
    bfloat16 reduce dtype: the codecs' bits scaled as FSDP2 asks, rounded to bfloat16 where it reduces in it."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from horovod_qsgd.fsdp import compress_reduce_scatter
    rank = dist_gloo.get_rank()

    for kind in ("qsgd", "topk"):
        model = _model(torch)
        for module in _fsdp_modules(model):
            module.set_gradient_divide_factor(2.0)  # fp32: PREMUL_SUM(1/2)
        reference = _Reference(compress_reduce_scatter(model, _compressor(kind)), num_ranks)
        _assert_equal(_step(torch, model, rank, 0), reference.step(0, rank, lambda t: t * np.float32(0.5)))

        model = _model(torch)
        for module in _fsdp_modules(model):
            module.set_force_sum_reduction_for_comms(True)  # SUM, then FSDP2 divides by N itself
        reference = _Reference(compress_reduce_scatter(model, _compressor(kind)), num_ranks)
        _assert_equal(_step(torch, model, rank, 0), reference.step(0, rank, lambda t: t / np.float32(num_ranks)))

        model = _model(torch, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16))
        compressor = compress_reduce_scatter(model, _compressor(kind))
        reference = _Reference(compressor, num_ranks)
        for step in range(2):
            _assert_equal(_step(torch, model, rank, step),
                          reference.step(step, rank, lambda t: t * (1.0 / num_ranks), rounding=_bf16))
        _assert_residuals(compressor, reference, rank)


@pytest.mark.parametrize("num_ranks", _on(3))
def test_a_non_finite_step_leaves_every_ranks_residuals_and_a_resumed_job_continues_bitwise(num_ranks, dist_gloo):
    """Top-k: inf in rank 1's gradient of module "a" at step 1: every rank's residual of "a", and of the module
    whose sums stayed finite, is what step 0 left (also on ranks whose rows were finite: a loss scaler skips the
    whole step), the sums it reached are not finite, step 2 goes on from there.
    A job resumed from the state after step 1 (its model rebuilt) gives step 2's bits again."""
    import torch
    from horovod_qsgd.fsdp import compress_reduce_scatter
    rank = dist_gloo.get_rank()
    model = _model(torch)
    compressor = compress_reduce_scatter(model, _compressor("topk"))
    reference = _Reference(compressor, num_ranks)

    def average(t):
        return t * (1.0 / num_ranks)

    _step(torch, model, rank, 0)
    reference.step(0, rank, average)
    left = {name: entry["residual"].clone() for name, entry in compressor.state_dict()["modules"].items()
            if entry["residual"] is not None}  # fsdp.small passes through
    assert set(left) == {"fsdp.a", "fsdp.root"}, set(left)
    ours = _step(torch, model, rank, 1, poison="fsdp.a" if rank == 1 else None)
    expected = reference.step(1, rank, average, poisoned=("fsdp.a", 1))
    _assert_equal(ours, expected)
    assert all(np.isfinite(s).all() for s in ours["fsdp.root"] if s is not None)  # the other module's sums
    for name, residual in left.items():
        assert torch.equal(compressor.state_dict()["modules"][name]["residual"], residual), name
    _assert_residuals(compressor, reference, rank)
    finite = all(np.isfinite(s).all() for s in ours["fsdp.a"])
    assert compressor.compression_stats()["tensors_nonfinite"] == (0 if finite else 1)
    saved = io.BytesIO()
    torch.save(compressor.state_dict(), saved)
    after = _step(torch, model, rank, 2)
    _assert_equal(after, reference.step(2, rank, average))

    _assert_equal(_resumed(torch, "topk", saved, rank, 2), after)

    model = _model(torch)  # QSGD: the RNG's step counters resume too
    compressor = compress_reduce_scatter(model, _compressor("qsgd"))
    _step(torch, model, rank, 0)
    saved = io.BytesIO()
    torch.save(compressor.state_dict(), saved)
    _assert_equal(_resumed(torch, "qsgd", saved, rank, 1), _step(torch, model, rank, 1))


def _resumed(torch, kind, saved, rank, step):
    """Step ``step`` of a model rebuilt with a compressor loaded from ``saved``."""
    from horovod_qsgd.fsdp import compress_reduce_scatter
    model = _model(torch)
    resumed = compress_reduce_scatter(model, _compressor(kind))
    saved.seek(0)
    resumed.load_state_dict(torch.load(saved))
    return _step(torch, model, rank, step)


@pytest.mark.parametrize("num_ranks", _on(3))
def test_a_parameter_without_a_gradient(num_ranks, dist_gloo):
    """Module "a"'s last parameter left out of step 1 on every rank: FSDP2 leaves it out of the rows, which are
    compressed as one piece with a warning (top-k's residual of the other layout restarts from zeros, warned
    too), and its gradient is None; step 2 has it back. With set_reduce_scatter_unused_params(True) its zero
    gradient keeps every parameter's place, and nothing warns."""
    import warnings

    import torch
    from horovod_qsgd.fsdp import compress_reduce_scatter
    rank = dist_gloo.get_rank()

    def average(t):
        return t * (1.0 / num_ranks)

    for kind in ("qsgd", "topk"):
        for zero_unused in (False, True):
            model = _model(torch)
            if zero_unused:
                model.set_reduce_scatter_unused_params(True)
            compressor = compress_reduce_scatter(model, _compressor(kind))
            reference = _Reference(compressor, num_ranks)
            for step in range(3):
                unused = ("fsdp.a", 2) if step == 1 else None
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    ours = _step(torch, model, rank, step, unused=unused)
                said = " ".join(str(w.message) for w in caught if "horovod_qsgd" in str(w.message))
                warned = "are not the shards of all its trainable parameters" in said
                assert warned == (step == 1 and not zero_unused), said
                # top-k's residual changes length with the rows, into step 1 and back in step 2
                resized = kind == "topk" and not zero_unused and step > 0
                assert ("'fsdp.a': the residual has" in said and "reset to zeros" in said) == resized, said
                _assert_equal(ours, reference.step(step, rank, average, unused=unused, zero_unused=zero_unused))
                _assert_residuals(compressor, reference, rank)


@pytest.mark.parametrize("num_ranks", _on(3))
def test_a_distributed_checkpoint_holds_every_ranks_residuals_and_resumes_bitwise(num_ranks, dist_gloo):
    """torch.distributed.checkpoint with compressor.checkpointable(): the checkpoint holds each module's
    residuals as one [ranks, n] tensor (every rank's row once); a rebuilt model loads it before its first step
    and continues bitwise (Top-k: the residuals; QSGD: the RNG's step counters)."""
    import tempfile

    import torch
    import torch.distributed.checkpoint as dcp
    from horovod_qsgd.fsdp import compress_reduce_scatter
    rank = dist_gloo.get_rank()
    for kind in ("topk", "qsgd"):
        model = _model(torch)
        compressor = compress_reduce_scatter(model, _compressor(kind))
        for step in range(2):
            _step(torch, model, rank, step)
        where = [tempfile.mkdtemp(prefix="hq-dcp-") if rank == 0 else None]
        dist_gloo.broadcast_object_list(where, 0)
        dcp.save({"compressor": compressor.checkpointable()}, checkpoint_id=where[0])
        saved = compressor.state_dict()["modules"]
        after = _step(torch, model, rank, 2)

        rebuilt = _model(torch)
        resumed = compress_reduce_scatter(rebuilt, _compressor(kind))
        dcp.load({"compressor": resumed.checkpointable()}, checkpoint_id=where[0])
        assert saved["fsdp.a"]["step"] == 2  # the small module passes through: no step of its own
        for name, state in resumed.state_dict()["modules"].items():
            assert state["step"] == saved[name]["step"], name
            if name == "fsdp.small":  # passes through: keeps no residual
                assert state["residual"] is None and saved[name]["residual"] is None
            elif kind == "topk":
                assert torch.equal(state["residual"], saved[name]["residual"]), name
        _assert_equal(_step(torch, rebuilt, rank, 2), after)
        if kind == "topk":
            stored = dcp.FileSystemReader(where[0]).read_metadata().state_dict_metadata
            assert tuple(stored["compressor.modules.fsdp.a.residual"].size) == (num_ranks, saved["fsdp.a"][
                "residual"].numel())


@pytest.mark.parametrize("num_ranks", _on(3))
def test_other_settings_on_one_rank_are_refused_on_every_rank(num_ranks, dist_gloo):
    import torch
    from horovod_qsgd.fsdp import QSGD, CompressionMismatchError, compress_reduce_scatter
    rank = dist_gloo.get_rank()
    model = _model(torch)
    compress_reduce_scatter(model, QSGD(bits=8 if rank == 1 else 4, min_numel=MIN_NUMEL))
    with pytest.raises(CompressionMismatchError, match=r"settings.bits: rank 0=4, rank 1=8, rank 2=4"):
        _step(torch, model, rank, 0)


@pytest.mark.parametrize("num_ranks", [pytest.param(4, marks=pytest.mark.ranks(4, timeout=300,
                                                                            launcher="torchrun-nodes:2x2"))])
def test_a_unit_on_a_smaller_mesh_has_a_node_layout_of_its_own(num_ranks, dist_gloo):
    """exchange="node_aware" on two nodes of two ranks, a unit "e" sharded on its node's two ranks (as torchtitan
    shards MoE experts) beside whole-world units, its reduce-scatter first and last in the backward pass: the
    whole-world units are node-aware, "e" is flat among its two ranks and bitwise the codec's reduce-scatter of
    their rows (a layout cached for the first group had indexed "e"'s 2 rows with world ranks, or turned
    node-aware off everywhere)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from horovod_qsgd.fsdp import compress_reduce_scatter
    rank = dist_gloo.get_rank()
    node_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))["local"]
    sizes = {"fsdp.a": (20_000, 3001), "fsdp.e": (9_000, 7), "fsdp.root": (12_345,)}

    def grads(name, r, step):
        rng = np.random.default_rng([r, step, len(name), sum(sizes[name])])
        return [rng.standard_normal(n).astype(np.float32) for n in sizes[name]]

    class Model(torch.nn.Module):
        def __init__(self, order):
            super().__init__()
            self.a, self.e, self.b = (weights_module(sizes[n]) for n in ("fsdp.a", "fsdp.e", "fsdp.root"))
            self.order = order

        def forward(self, grads):  # the backward pass runs the units in the reverse order
            return sum(getattr(self, unit)(grads[unit]) for unit in self.order)

    for e_first_in_backward in (True, False):
        model = Model(["a", "b", "e"] if e_first_in_backward else ["e", "a", "b"])
        fully_shard(model.a)
        fully_shard(model.e, mesh=node_mesh)
        fully_shard(model)
        compressor = compress_reduce_scatter(model, _compressor("qsgd", "node_aware"))
        for step in range(2):
            given = {unit: [torch.from_numpy(g) for g in grads(name, rank, step)]
                     for unit, name in (("a", "fsdp.a"), ("e", "fsdp.e"), ("b", "fsdp.root"))}
            model.zero_grad(set_to_none=True)
            model(given).backward()
            group = [2 * (rank // 2), 2 * (rank // 2) + 1]
            rows = [fsdp_rows(grads("fsdp.e", r, step), 2) for r in group]
            pieces = rows[0][1]
            xs = [stage(r, pieces, 512) for r, _ in rows]
            sums = reduce_scatter_reference(compressor.codec, "fsdp.e", xs, step)
            own = fsdp_shards(unstage(sums[rank % 2], pieces, 512) * np.float32(0.5), pieces, sizes["fsdp.e"], rank % 2)
            for p, want in zip(model.e.w, own):
                np.testing.assert_array_equal(p.grad.to_local().numpy(), want)
        assert compressor.compression_stats()["exchanges"] == {
            "fsdp.a": "node_aware", "fsdp.e": "reduce_scatter", "fsdp.root": "node_aware"}, e_first_in_backward


@pytest.mark.parametrize("num_ranks", _on(3))
def test_a_frozen_parameter_keeps_every_other_parameter_on_its_own_scales(num_ranks, dist_gloo):
    """Module "a"'s middle parameter frozen (requires_grad=False, as LoRA or a frozen embedding): FSDP2 leaves it
    out of the reduce-scatter, and the other two keep their own pieces of the row (their own QSGD scales),
    bitwise the codecs', with no warning, for 2 steps."""
    import warnings

    import torch
    from horovod_qsgd.fsdp import compress_reduce_scatter
    rank = dist_gloo.get_rank()
    for kind in ("qsgd", "topk"):
        model = _model(torch, frozen=("a", 1))
        compressor = compress_reduce_scatter(model, _compressor(kind))
        reference = _Reference(compressor, num_ranks)
        for step in range(2):
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message="horovod_qsgd")
                ours = _step(torch, model, rank, step)
            _assert_equal(ours, reference.step(step, rank, lambda t: t * (1.0 / num_ranks), frozen=("fsdp.a", 1)))
            _assert_residuals(compressor, reference, rank)


@pytest.mark.parametrize("num_ranks", _on(3))
def test_an_overflow_of_the_cast_to_float16_skips_the_step(num_ranks, dist_gloo):
    """float16 reduce dtype (FSDP2: pre-divide by 2, sum, post-divide by 1.5 at 3 ranks), Top-k: 50,000 at one
    coordinate on every rank sums to 75,000 in float32, finite, which the cast to float16 makes inf on its
    owner only: every rank's residuals stay as the step before left them, and the owner counts it."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from horovod_qsgd.fsdp import compress_reduce_scatter
    rank = dist_gloo.get_rank()
    model = _model(torch, MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16))
    compressor = compress_reduce_scatter(model, _compressor("topk"))
    _step(torch, model, rank, 0)
    before = {name: entry["residual"].clone() for name, entry in compressor.state_dict()["modules"].items()
              if entry["residual"] is not None}
    grads = {name: [torch.from_numpy(g) for g in _gradients(name, rank, 1)] for name in MODULES}
    grads["fsdp.a"][0][3] = 50_000.0
    model.zero_grad(set_to_none=True)
    model(grads).backward()
    assert torch.isfinite(model.a.w[0].grad.to_local()).all() == (rank != 0)
    after = compressor.state_dict()["modules"]
    for name, residual in before.items():
        assert torch.equal(after[name]["residual"], residual), name
    assert compressor.compression_stats()["tensors_nonfinite"] == (1 if rank == 0 else 0)


@pytest.mark.parametrize("num_ranks", _on(3))
def test_the_lean_top_k_residual(num_ranks, dist_gloo):
    """TopK(residual_dtype="bfloat16"): one bfloat16 buffer per module (2 bytes per staged element, no spare), each
    step's residual rounded to it: 3 steps bitwise the reference that rounds alike; a job resumed from step 1's
    state gives step 2's bits again; then an inf on one rank: every rank's residuals are zeros (the step's
    unsent mass is lost), the next step goes on from zeros as the reference does."""
    import torch
    from horovod_qsgd.fsdp import compress_reduce_scatter
    rank = dist_gloo.get_rank()

    def average(t):
        return t * (1.0 / num_ranks)

    model = _model(torch)
    compressor = compress_reduce_scatter(model, _compressor("topk-lean"))
    reference = _Reference(compressor, num_ranks)
    saved = io.BytesIO()
    for step in range(3):
        _assert_equal(_step(torch, model, rank, step), reference.step(step, rank, average))
        _assert_residuals(compressor, reference, rank)
        if step == 1:
            torch.save(compressor.state_dict(), saved)
    for name in ("fsdp.a", "fsdp.root"):
        residual = compressor._feedback.entry(name).residual
        assert (residual.kept.dtype, residual._spare) == (torch.bfloat16, None), name
    ours = _step(torch, model, rank, 3, poison="fsdp.a" if rank == 1 else None)
    _assert_equal(ours, reference.step(3, rank, average, poisoned=("fsdp.a", 1)))
    for name in ("fsdp.a", "fsdp.root"):
        assert not compressor.state_dict()["modules"][name]["residual"].any(), name
    _assert_equal(_step(torch, model, rank, 4), reference.step(4, rank, average))
    _assert_residuals(compressor, reference, rank)

    resumed_reference = _Reference(compressor, num_ranks)  # never skipped: step 2's bits as the first job had them
    for step in range(3):
        expected = resumed_reference.step(step, rank, average)
    _assert_equal(_resumed(torch, "topk-lean", saved, rank, 2), expected)
