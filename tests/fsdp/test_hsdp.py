"""Custom HSDP under torchrun (Gloo): modules sharded on mesh["shard"], their replicas' all-reduce compressed
(``compress_reduce_scatter(..., replicate=mesh["replicate"])``). Every rank's sharded gradients and residuals
against the codecs alone, a non-finite step on one replica, the refusals (native HSDP, a wrong group, settings
that differ), and the bytes between two network-namespace nodes."""
import numpy as np
import pytest

from tests.reduce_scatter_reference import (fsdp_rows, fsdp_shards, reduce_scatter_reference, stage, staged,
                                           three_unit_model, unstage)
from tests.two_stage_reference import allgather_reference, bounds
from tests.two_stage_reference import reference as two_stage_reference

SHARED_LAUNCHES = "torch.distributed"

# "a": at one rank per shard, 73,006 staged elements: the two stages from 3 replicas; "small": all-reduced at full
# precision; the root holds the parameters of "b".
MODULES = {"fsdp.a": (70_000, 5, 3001), "fsdp.small": (50,), "fsdp.root": (12_345,)}
MIN_NUMEL = 1000


def _on(*shapes, launcher="torchrun"):
    return [pytest.param(r, s, marks=pytest.mark.ranks(r * s, timeout=300, launcher=launcher)) for r, s in shapes]


def _gradients(name, rank, step):
    rng = np.random.default_rng([rank, step, len(name), sum(MODULES[name]), 7])
    return [rng.standard_normal(n).astype(np.float32) for n in MODULES[name]]


def _mesh(dist, replicas, shards):
    from torch.distributed.device_mesh import init_device_mesh
    assert dist.get_world_size() == replicas * shards
    return init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))


def _model(torch, mesh):
    """loss = sum_i <w_i, g_i>: the gradient of w_i is g_i. ``mesh``: what each module is sharded on."""
    from torch.distributed.fsdp import fully_shard
    model = three_unit_model(MODULES)
    for module in (model.a, model.small, model):
        fully_shard(module, mesh=mesh)
    return model


def _step(torch, model, rank, step, poison=False):
    grads = {name: [torch.from_numpy(g) for g in _gradients(name, rank, step)] for name in MODULES}
    if poison:
        grads["fsdp.a"][0][3] = float("inf")
    model.zero_grad(set_to_none=True)
    model(grads).backward()
    params = {"fsdp.a": model.a.w, "fsdp.small": model.small.w, "fsdp.root": model.b.w}
    return {name: [p.grad.to_local().numpy().copy() for p in ps] for name, ps in params.items()}


def _compressor(kind, bits=4):
    from horovod_qsgd.fsdp import QSGD, TopK
    return QSGD(bits=bits, min_numel=MIN_NUMEL) if kind == "qsgd" else TopK(ratio=0.02, min_numel=MIN_NUMEL)


class _Reference:
    """Every rank's sharded gradients under custom HSDP from the codecs alone: rank r * S + s holds shard s of
    replica r; FSDP2's own reduce-scatter in the node (AVG: at 1 or 2 shards an exact sum, halved); the
    replicas' exchange of each staged shard (allgather, or the two stages from 3 replicas where the shard has
    65,536 elements or more), averaged; error feedback per rank, kept only where the step was finite
    everywhere."""

    def __init__(self, compressor, replicas, shards, in_node_compressed=False):
        self.codec, self.replicas, self.shards = compressor.codec, replicas, shards
        self.in_node_compressed = in_node_compressed  # QSGD only: our reduce-scatter in the node too
        self.unit = getattr(self.codec, "bucket_size", 1)
        self.feedback = compressor.error_feedback
        self.residuals, self.owners = {}, {}  # (name, rank) -> sender residual; (name, shard) -> owner residuals

    def _in_node(self, name, replica, step, poisoned):
        """Shard s's averaged gradients of ``replica``'s ranks: [shard] -> (row, pieces)."""
        rows = []
        for s in range(self.shards):
            grads = _gradients(name, replica * self.shards + s, step)
            if poisoned == (name, replica * self.shards + s):
                grads[0][3] = np.inf
            rows.append(fsdp_rows(grads, self.shards))
        pieces = rows[0][1]
        if self.in_node_compressed and sum(pieces) * self.shards >= MIN_NUMEL:
            xs = [stage(r, pieces, self.unit) for r, _ in rows]
            sums = reduce_scatter_reference(self.codec, name, xs, step)
            return [unstage(t, pieces, self.unit) * np.float32(1.0 / self.shards) for t in sums], pieces
        total = [sum(r[s] for r, _ in rows[1:]) + rows[0][0][s] if self.shards > 1 else rows[0][0][s]
                 for s in range(self.shards)]
        return [t * np.float32(0.5) if self.shards == 2 else t for t in total], pieces

    def step(self, step, rank, poisoned=None):
        out, saved, finite = {}, {}, True
        shard = rank % self.shards
        for name, sizes in MODULES.items():
            per_replica = [self._in_node(name, r, step, poisoned) for r in range(self.replicas)]
            pieces = per_replica[0][1]
            shards = [[rows[s] for rows, _ in per_replica] for s in range(self.shards)]  # [shard][replica]
            results = []
            for s, xs in enumerate(shards):
                if xs[0].size < MIN_NUMEL:
                    results.append(sum(xs[1:], xs[0].copy()) * np.float32(1.0 / self.replicas))
                    continue
                key = f"{name}.replicas"
                xs = [stage(x.reshape(1, -1), pieces, self.unit) for x in xs]
                numel = xs[0].size
                two_stage = self.replicas >= 3 and numel >= 65_536
                residuals = None
                if self.feedback:
                    residuals = [self.residuals.setdefault((name, r * self.shards + s), np.zeros(numel, np.float32))
                                 for r in range(self.replicas)]
                    for r in range(self.replicas):
                        saved[(name, r * self.shards + s)] = residuals[r].copy()
                if two_stage:
                    owners = None
                    if self.feedback:
                        owners = self.owners.setdefault((name, s), [np.zeros(e - b, np.float32) for b, e in
                                                                    bounds(numel, self.replicas, self.unit)])
                        saved[(name, s, "owners")] = [o.copy() for o in owners]
                    total = two_stage_reference(self.codec, self.codec, key, xs, step, self.unit, residuals, owners)
                else:
                    total = allgather_reference(self.codec, key, xs, step, residuals)
                results.append(unstage(total * np.float32(1.0 / self.replicas), pieces, self.unit))
            finite = finite and all(np.isfinite(r).all() for r in results)
            out[name] = fsdp_shards(results[shard], pieces, sizes, shard)
        if not finite:  # a loss scaler skips the step on every rank: no residual keeps anything of it
            for key, value in saved.items():
                if len(key) == 3:
                    for owner, before in zip(self.owners[key[:2]], value):
                        owner[:] = before
                else:
                    self.residuals[key][:] = value
        return out


def _assert_equal(ours, expected, replicas):
    for name in MODULES:
        for got, want in zip(ours[name], expected[name]):
            if name == "fsdp.small" and replicas > 2:  # Gloo's full-precision sum of 3 has its own order
                np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=name)
            else:
                np.testing.assert_array_equal(got, want, err_msg=name)


def _assert_residuals(compressor, reference, rank):
    if not reference.feedback:
        return
    for name in ("fsdp.a", "fsdp.root"):
        saved = compressor.state_dict()["modules"][f"{name}.replicas"]["residual"].numpy()
        np.testing.assert_array_equal(saved, reference.residuals[(name, rank)], err_msg=name)


def _check_hsdp(torch, dist, replicas, shards, kind, compress_in_node=None):
    from horovod_qsgd.fsdp import compress_reduce_scatter
    rank = dist.get_rank()
    mesh = _mesh(dist, replicas, shards)
    model = _model(torch, mesh["shard"])
    compressor = compress_reduce_scatter(model, _compressor(kind), replicate=mesh["replicate"],
                                         compress_in_node=compress_in_node)
    reference = _Reference(compressor, replicas, shards, bool(compress_in_node))
    for step in range(3):
        _assert_equal(_step(torch, model, rank, step), reference.step(step, rank), replicas)
        _assert_residuals(compressor, reference, rank)
    return model, compressor, reference


@pytest.mark.parametrize("replicas, shards", _on((2, 1), (3, 1), (2, 2)))
def test_hsdp_replicas_exchange_is_the_codecs_alone_on_every_rank(replicas, shards, dist_gloo):
    """QSGD-4 and Top-k with error feedback, 3 steps: every rank's sharded gradients are FSDP2's in-node
    average then the codecs' exchange of each staged shard across the replicas (allgather at 2, the two stages
    at 3 for the 73,006-element shard, owner residuals included), bitwise; the residuals the reference's; the
    statistics count the compressed payloads, nothing of the in-node reduce-scatter (FSDP2's own)."""
    import torch
    for kind in ("qsgd", "topk"):
        _, compressor, _ = _check_hsdp(torch, dist_gloo, replicas, shards, kind)
        stats = compressor.compression_stats()
        assert stats["exchanges"] == {"fsdp.a": "replicas", "fsdp.root": "replicas"}, stats["exchanges"]
        assert (stats["tensors_compressed"], stats["tensors_passed_through"]) == (6, 3)


@pytest.mark.parametrize("replicas, shards", _on((3, 1), (2, 2)))
def test_an_inf_on_one_replica_leaves_every_ranks_residuals(replicas, shards, dist_gloo, monkeypatch):
    """Top-k: inf in the last rank's gradient at step 3: the sum of shard 0 is not finite on its holders only,
    yet every rank of the mesh skips the step (the verdict is all-reduced over the shard group, then the
    replicas'): every residual stays as step 2 left it, and step 4 is the reference's, which kept none of step
    3. Run twice: with the host's verdict, and with the GPU's (stamped on the device, nothing read on the
    host: no ``item``, ``bool`` or ``tolist`` of a tensor inside an exchange)."""
    import torch
    from horovod_qsgd.fsdp import ModuleReduceScatter, ReplicaAllReduce
    from horovod_qsgd.torch_shared.feedback import DEVICE_VERDICT_ENV
    rank, last = dist_gloo.get_rank(), dist_gloo.get_world_size() - 1
    for on_device in (False, True):
        if on_device:
            monkeypatch.setenv(DEVICE_VERDICT_ENV, "1")
            host_reads = _count_host_reads(monkeypatch, torch, [ModuleReduceScatter, ReplicaAllReduce])
        model, compressor, reference = _check_hsdp(torch, dist_gloo, replicas, shards, "topk")
        if on_device:  # from here on: the steps after the first (whose settings handshake reads objects)
            host_reads.clear()
        before = {name: entry["residual"].clone() for name, entry in compressor.state_dict()["modules"].items()
                  if entry["residual"] is not None}
        ours = _step(torch, model, rank, 3, poison=rank == last)
        expected = reference.step(3, rank, poisoned=("fsdp.a", last))
        _assert_equal(ours, expected, replicas)
        on_poisoned_shard = rank % shards == 0  # the shard of coordinate 3
        assert np.isfinite(ours["fsdp.a"][0]).all() != on_poisoned_shard
        after = compressor.state_dict()["modules"]
        for name, residual in before.items():
            assert torch.equal(after[name]["residual"], residual), name
        _assert_equal(_step(torch, model, rank, 4), reference.step(4, rank), replicas)
        _assert_residuals(compressor, reference, rank)
        assert compressor.compression_stats()["tensors_nonfinite"] == (1 if on_poisoned_shard else 0)
    assert host_reads == [], host_reads


def _count_host_reads(monkeypatch, torch, exchanges):
    """Records every host read of a tensor's value (``item``, ``bool``, ``int``, ``float``, ``tolist``,
    ``cpu``) made inside a call of ``exchanges``' instances, from now on."""
    import threading
    inside, reads = threading.local(), []

    def watched(call):
        def run(self, *args, **kwargs):
            inside.on = True
            try:
                return call(self, *args, **kwargs)
            finally:
                inside.on = False
        return run

    def counted(method_name, method):
        def read(self, *args, **kwargs):
            if getattr(inside, "on", False):
                import traceback
                reads.append((method_name, traceback.format_stack(limit=4)[-2].strip()))
            return method(self, *args, **kwargs)
        return read

    for cls in exchanges:
        monkeypatch.setattr(cls, "__call__", watched(cls.__call__))
    for method_name in ("item", "__bool__", "__int__", "__float__", "tolist", "cpu"):
        monkeypatch.setattr(torch.Tensor, method_name, counted(method_name, getattr(torch.Tensor, method_name)))
    return reads


@pytest.mark.parametrize("replicas, shards", _on((2, 2)))
def test_hsdp_refusals_on_every_rank(replicas, shards, dist_gloo):
    """Native HSDP (a 2-D mesh) is refused, naming the custom form; replicate= with ranks of different shards is
    refused; settings that differ on one rank are refused on every rank of the mesh, also on the ranks of the
    other shard, whose replicas agree among themselves."""
    import torch
    from horovod_qsgd.fsdp import CompressionMismatchError, QSGD, compress_reduce_scatter
    rank = dist_gloo.get_rank()
    mesh = _mesh(dist_gloo, replicas, shards)
    with pytest.raises(ValueError, match=r"native HSDP.*replicate=mesh\['replicate'\]"):
        compress_reduce_scatter(_model(torch, mesh), QSGD())
    with pytest.raises(ValueError, match=r"must group the ranks that hold the same shard.*replica 0: shard 0 of 2, "
                                         r"replica 1: shard 1 of 2"):
        compress_reduce_scatter(_model(torch, mesh["shard"]), QSGD(), replicate=mesh["shard"])
    model = _model(torch, mesh["shard"])
    compress_reduce_scatter(model, _compressor("qsgd", bits=8 if rank == 1 else 4), replicate=mesh["replicate"])
    with pytest.raises(CompressionMismatchError, match=r"settings.bits: rank 0=4, rank 1=8, rank 2=4, rank 3=4"):
        _step(torch, model, rank, 0)


@pytest.mark.parametrize("replicas, shards", _on((2, 2), launcher="torchrun-nodes:2x2"))
def test_hsdp_between_two_nodes_sends_only_compressed_shards(replicas, shards, dist_gloo):
    """Two network-namespace nodes of two ranks, mesh (replicate, shard) = (nodes, ranks per node): bitwise the
    reference, and the bytes between the nodes as the payload formula says (the statistics; the NIC's count is
    the benchmark's)."""
    import os

    import torch
    rank = dist_gloo.get_rank()
    assert os.environ["GROUP_RANK"] == str(rank // 2)
    for kind in ("qsgd", "topk"):
        _, compressor, _ = _check_hsdp(torch, dist_gloo, replicas, shards, kind)
        unit = getattr(compressor.codec, "bucket_size", 1)
        payloads = sum(compressor.codec.max_payload_nbytes(staged(fsdp_rows(_gradients(n, 0, 0), shards)[1],
                                                                  unit)[1]) for n in ("fsdp.a", "fsdp.root"))
        small = 2 * (replicas - 1) * -(-50 // shards) * 4 // replicas
        assert compressor.compression_stats()["bytes_sent"] == 3 * (payloads + small)


@pytest.mark.parametrize("replicas, shards", _on((2, 2)))
def test_hsdp_compressing_the_reduce_scatter_in_the_node_too(replicas, shards, dist_gloo):
    """compress_in_node=True: QSGD-4's reduce-scatter inside the node (each shard's sum from the codec's rows,
    averaged over the node's 2 ranks), then QSGD-4 across the replicas on that: bitwise the codecs alone, 3
    steps; both exchanges counted."""
    import torch
    _, compressor, _ = _check_hsdp(torch, dist_gloo, replicas, shards, "qsgd", compress_in_node=True)
    stats = compressor.compression_stats()
    assert (stats["tensors_compressed"], stats["tensors_passed_through"]) == (12, 6)


@pytest.mark.parametrize("replicas, shards", _on((3, 1)))
def test_a_distributed_checkpoint_of_owner_residuals_is_refused_naming_the_fix(replicas, shards, dist_gloo):
    """Top-k across 3 replicas keeps owner residuals of different sizes on different ranks: checkpointable()
    refuses them on every rank, naming the per-rank state_dict(), which holds them (and loads them back)."""
    import torch
    from horovod_qsgd.fsdp import compress_reduce_scatter
    model, compressor, _ = _check_hsdp(torch, dist_gloo, replicas, shards, "topk")
    with pytest.raises(ValueError, match=r"cannot save yet: save compressor.state_dict\(\) on every rank"):
        compressor.checkpointable().state_dict()
    state = compressor.state_dict()
    assert state["modules"]["fsdp.a.replicas"]["owner_residual"] is not None
    mesh = _mesh(dist_gloo, replicas, shards)
    rebuilt = compress_reduce_scatter(_model(torch, mesh["shard"]), _compressor("topk"), replicate=mesh["replicate"])
    rebuilt.load_state_dict(state)
    again = rebuilt.state_dict()["modules"]["fsdp.a.replicas"]
    assert torch.equal(again["owner_residual"], state["modules"]["fsdp.a.replicas"]["owner_residual"])
