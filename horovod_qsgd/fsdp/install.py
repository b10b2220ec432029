"""Installs a compressor on a model's ``fully_shard`` modules: 1-D FSDP2, or custom HSDP's two links."""
from torch.distributed.fsdp import FSDPModule

from horovod_qsgd.fsdp.reduce_scatter import ModuleReduceScatter, _ReduceScatterCompressor, param_group
from horovod_qsgd.fsdp.replicas import ReplicaAllReduce, check_replicas, replicate_group

CUSTOM_HSDP = ("mesh = init_device_mesh(device, (nodes, ranks_per_node), mesh_dim_names=('replicate', 'shard')); "
               "fully_shard(module, mesh=mesh['shard']) on every module; then compress_reduce_scatter(model, "
               "compressor, replicate=mesh['replicate'])")


def compress_reduce_scatter(model, compressor, replicate=None, compress_in_node=None):
    """Installs ``compressor`` (:class:`~horovod_qsgd.fsdp.QSGD` or :class:`~horovod_qsgd.fsdp.TopK`) on every
    ``fully_shard`` module of ``model`` with parameters of its own, each module with its own state (named
    ``fsdp.<module path>``, ``fsdp.root`` for ``model``); returns ``compressor``. Call it on every rank, after
    ``fully_shard`` and before the first backward pass.

    Args:
        model (torch.nn.Module): sharded with ``fully_shard`` on a 1-D mesh.
        compressor (QSGD or TopK): the codec, its settings, its state and statistics.
        replicate (DeviceMesh or ProcessGroup, optional): custom HSDP. The ranks that hold the same shard, one
            per node (``mesh["replicate"]`` of a ``(nodes, ranks_per_node)`` mesh whose ``"shard"`` dimension
            each module was sharded on): their all-reduce, the link between nodes, is compressed
            (:mod:`horovod_qsgd.fsdp.replicas`, FSDP2's ``set_all_reduce_hook``). Default None: FSDP2's whole
            gradient reduction is its reduce-scatter, compressed.
        compress_in_node (bool, optional): whether the reduce-scatter is compressed. Default: yes without
            ``replicate``; with it no (FSDP2's own, at full precision, on the fast link inside the node), set
            True to compress it too (fewer bytes inside the node, a second quantization's error).

    Costs: the compressor's (its docstring), per module and step; the first step also gathers every rank's
    settings and row layout (refused on every rank where they differ). Measured bytes between two nodes and
    against FSDP2's own: ``docs/fsdp.md``.

    Native HSDP (``fully_shard`` on a 2-D mesh) is refused on every rank: FSDP2 all-reduces its replicas itself,
    at full precision, before any hook runs, and offers no public way to replace that all-reduce.
    """
    if not isinstance(compressor, _ReduceScatterCompressor):
        raise TypeError(f"horovod_qsgd: compress_reduce_scatter takes horovod_qsgd.fsdp.QSGD or TopK, got "
                        f"{type(compressor).__name__}.")
    modules = [(path, module) for path, module in model.named_modules()
               if isinstance(module, FSDPModule) and module._get_fsdp_state()._fsdp_param_groups]
    if not modules:
        raise ValueError("horovod_qsgd: compress_reduce_scatter found no fully_shard module with parameters in "
                         "the model; call fully_shard(module) on its layers and the model first.")
    for path, module in modules:
        if getattr(param_group(module), "_is_hsdp", False) or param_group(module).mesh_info.mesh.ndim > 1:
            raise ValueError(f"horovod_qsgd: module {path or 'root'!r} is sharded on a 2-D mesh (FSDP2's native "
                             "HSDP), whose all-reduce across nodes FSDP2 runs itself at full precision: it cannot "
                             "be compressed from outside, and compressing only the reduce-scatter inside the node "
                             f"would save little. Use custom HSDP instead: {CUSTOM_HSDP}.")
    replicas = None if replicate is None else replicate_group(replicate)
    if replicas is not None:
        check_replicas(replicas, param_group(modules[0][1]).mesh_info.shard_process_group)
    in_node = replicas is None if compress_in_node is None else bool(compress_in_node)
    for path, module in modules:
        name = f"fsdp.{path or 'root'}"
        if in_node:
            reduce_scatter = compressor._modules[name] = ModuleReduceScatter(compressor, name, module)
            module.set_custom_reduce_scatter(reduce_scatter)
        if replicas is not None:
            hook = compressor._replicas[name] = ReplicaAllReduce(compressor, name, module, replicas)
            module.set_all_reduce_hook(hook)
    return compressor
