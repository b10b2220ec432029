r"""HSDP's link between nodes, compressed: the all-reduce of each shard across its replicas.

HSDP shards a model inside a node and replicates it across nodes. FSDP2's native HSDP (``fully_shard`` on a
2-D mesh) all-reduces the replicas' shards itself, at full precision, before any hook runs. torch's custom
HSDP shards over the in-node mesh only and leaves the replicas' all-reduce to ``set_all_reduce_hook``:
:func:`~horovod_qsgd.fsdp.compress_reduce_scatter` with ``replicate=mesh["replicate"]`` installs a
:class:`ReplicaAllReduce` there on every module.

FSDP2 calls it with the module's reduce-scatter output (this rank's shard of every parameter, padded, in the
reduce dtype, averaged over the shard group). Its steps:

1. the shard is staged in float32, each parameter's piece at a multiple of the codec's unit (QSGD's
   ``bucket_size``): no scale spans two parameters;
2. the replicas exchange it through the engine (:mod:`horovod_qsgd.common.engine`): an allgather of the
   payloads at 2 replicas, two stages from 3 replicas for shards of at least 65,536 elements (each rank's
   bytes stay flat as replicas grow), with the sender's and the owner's error feedback for Top-k;
3. the decoded sum is divided by the R replicas (not where ``set_gradient_divide_factor`` set FSDP2's
   divisor, which then stands for the whole sum) and written back in the reduce dtype; FSDP2 goes on
   from there (its post-division, the cast to the parameters' dtype).

Bytes between nodes per step and rank: at 2 replicas one payload of the shard, QSGD-4 about
4 + 32/bucket_size bits a coordinate, where FSDP2's all-reduce sends 2 (R-1)/R shards at 32 (fp32) or 16
(bf16) bits. Shards below ``min_numel`` elements are all-reduced at full precision.

The verdict on a non-finite step (:mod:`horovod_qsgd.fsdp.verdict`) is all-reduced over the shard group and
then the replicas': every rank of the mesh skips together.
"""
import torch
import torch.distributed as dist

from horovod_qsgd.common.chunks import chunk_unit
from horovod_qsgd.common.collectives import drive
from horovod_qsgd.common.handshake import check_settings, settings_record
from horovod_qsgd.common.reduce_scatter import RowLayout
from horovod_qsgd.fsdp.reduce_scatter import (param_group, row_pieces, scale_sum, stage_rows, trainable_pieces,
                                              unstage_row)
from horovod_qsgd.torch_shared.arrays import as_array, kernel_stream
from horovod_qsgd.torch_shared.distributed import DistributedTransport

REPLICAS = "replicas"  # the exchange's name in the statistics


def replicate_group(replicate):
    """The process group of ``replicate`` (a 1-D DeviceMesh or a ProcessGroup); ValueError naming the fix."""
    if hasattr(replicate, "get_group"):
        if replicate.ndim != 1:
            raise ValueError(f"horovod_qsgd: replicate= takes the 1-D mesh of a shard's replicas, got a "
                             f"{replicate.ndim}-D mesh: pass mesh['replicate'].")
        return replicate.get_group()
    if isinstance(replicate, dist.ProcessGroup):
        return replicate
    raise TypeError(f"horovod_qsgd: replicate= takes a 1-D DeviceMesh (mesh['replicate']) or a ProcessGroup, got "
                    f"{type(replicate).__name__}.")


def check_replicas(replicas, shard_group):
    """ValueError on every rank of ``replicas`` unless each of its ranks holds the same shard (the same rank in a
    shard group of the same size) as this one: the group must be this shard's replicas, one per node."""
    mine = (shard_group.rank(), shard_group.size())
    shards = [None] * replicas.size()
    dist.all_gather_object(shards, mine, group=replicas)
    if len(set(shards)) != 1:
        held = ", ".join(f"replica {i}: shard {r} of {n}" for i, (r, n) in enumerate(shards))
        raise ValueError("horovod_qsgd: replicate= must group the ranks that hold the same shard, one per node; its "
                         f"ranks hold different shards ({held}). With init_device_mesh(device, (nodes, "
                         "ranks_per_node), mesh_dim_names=('replicate', 'shard')), shard each module on "
                         "mesh['shard'] and pass replicate=mesh['replicate'].")


class ReplicaAllReduce:
    """One ``fully_shard`` module's compressed all-reduce across its replicas (FSDP2's ``set_all_reduce_hook``).
    Its state, under ``<module name>.replicas`` in the compressor's store: the step counter of the codec's RNG
    and, with error feedback, this rank's sender residual of the shard and its owner residual (two stages).

    :func:`~horovod_qsgd.fsdp.compress_reduce_scatter` with ``replicate=`` builds one per module.

    Args:
        compressor (QSGD or TopK): the compressor whose codec, statistics and state it uses.
        name (str): the module's key in the compressor's state, the same on every rank.
        module (FSDPModule): the ``fully_shard`` module whose replicas' all-reduce it replaces.
        replicas (ProcessGroup): the ranks holding the same shard, one per node.

    Costs: per step, the shard's exchange among the replicas (an allgather of payloads at 2 replicas, two
    stages from 3 for shards of 65,536 elements or more), its encode and decodes; Top-k's residuals of the shard.
    """

    def __init__(self, compressor, name, module, replicas):
        self.compressor, self.name, self.module, self.replicas = compressor, name, module, replicas
        self.key = f"{name}.{REPLICAS}"
        compressor._feedback.entry(self.key)
        self._verified = None

    def __call__(self, reduce_output):
        compressor, stats, replicas = self.compressor, self.compressor._stats, self.replicas
        shard_group = param_group(self.module).mesh_info.shard_process_group
        if compressor._flags.pending(self.key):
            compressor._settle()
        pieces = row_pieces(self.module, self.name, reduce_output.numel(), "reduce-scatter output's shards")
        self._handshake(reduce_output, pieces, shard_group)
        num_replicas, rank = replicas.size(), replicas.rank()
        if num_replicas == 1:
            return
        divide = param_group(self.module).gradient_divide_factor is None
        scale = 1.0 / num_replicas if divide else 1.0
        uncompressed = 2 * (num_replicas - 1) * reduce_output.numel() * reduce_output.element_size() // num_replicas
        if reduce_output.numel() < compressor.min_numel:
            dist.all_reduce(reduce_output, group=replicas)
            reduce_output.mul_(scale)
            stats.add(tensors_passed_through=1, bytes_uncompressed=uncompressed, bytes_sent=uncompressed)
            return
        layout = RowLayout(pieces, chunk_unit(compressor.codec))
        staged = stage_rows(reduce_output.view(1, -1), layout)
        plan = compressor.engine.plan(self.key, staged.numel(), num_replicas, rank, uncompressed, 0,
                                      note_as=self.name)
        stats.note_exchange(self.name, REPLICAS)
        feedback, state = compressor._feedback, compressor._feedback.entry(self.key)
        stamps, writes, residual, owner = None, None, None, None
        if compressor.error_feedback:  # the staged shard changes size where parameters got no gradient
            stamps = state.stamps_on(staged.device)
            kept = feedback.checked_residual(self.key, staged.numel(), staged.device,
                                             resized="the module's staged shard").to(staged.device)
            feedback.spill_moved_owner_residual(self.key, [num_replicas, rank], compressor.codec)
            residual, writes = kept.for_step(stamps, state.step), []
            writes.append((kept, residual))
            if plan.owned is not None:
                def owner():
                    kept_owner = feedback.owner_residual_for(self.key, plan, staged.device)
                    written = kept_owner.for_step(stamps, state.step)
                    writes.append((kept_owner, written))
                    return as_array(written)
        transport = DistributedTransport(replicas, rank, staged.device)
        with kernel_stream(staged.device):
            gathered, refusal = drive(plan.conduct(transport, staged, state.step, as_array(residual), owner),
                                      transport.run)
            stats.add(collectives_started=transport.started)
            if refusal is not None:
                raise refusal
            total = torch.zeros_like(staged)
            plan.decode(as_array(gathered), as_array(total))
            scale_sum(total, scale)
        unstage_row(total, layout, reduce_output)
        compressor._flags.note(self.key, reduce_output, [shard_group, replicas], writes, stamps, state.step + 1)
        state.step += 1

    @property
    def state(self):
        return self.compressor._feedback.entry(self.key)

    def residual_to_save(self):
        """This rank's sender residual for a distributed checkpoint: the one kept, or zeros of the size its steps
        will keep (a job about to load one); None for a shard all-reduced at full precision. An owner residual
        (Top-k's two stages, from 3 replicas) differs in size between ranks: ValueError naming the per-rank
        ``state_dict()``."""
        self.compressor._settle()
        state = self.state
        state.settle_on_host()
        if state.owner_residual is not None and state.owner_residual.numel():
            raise ValueError("horovod_qsgd: Top-k's owner residuals of the replicas' two-stage exchange differ in "
                             "size between ranks, which compressor.checkpointable() cannot save yet: save "
                             "compressor.state_dict() on every rank instead (torch.save, one file per rank).")
        if state.residual is not None:
            return state.residual.kept
        group = param_group(self.module)
        if self.replicas.size() == 1:
            return None
        pieces = trainable_pieces(self.module)
        if sum(pieces) < self.compressor.min_numel:
            return None
        staged = RowLayout(pieces, chunk_unit(self.compressor.codec)).staged_numel
        return torch.zeros(staged, dtype=torch.float32, device=group.device)

    def _handshake(self, reduce_output, pieces, shard_group):
        """At the module's first call and where its layout changed, every rank of the mesh checks every rank's
        settings and shard layout (raises on all): gathered in the shard group, then across the replicas."""
        if self._verified == pieces:
            return
        mine = settings_record(type(self.compressor).__name__, dict(
            self.compressor.settings(), module=self.key, pieces=pieces, dtype=str(reduce_output.dtype),
            device=reduce_output.device.type))
        in_node = [None] * shard_group.size()
        dist.all_gather_object(in_node, mine, group=shard_group)
        everywhere = [None] * self.replicas.size()
        dist.all_gather_object(everywhere, in_node, group=self.replicas)
        check_settings([record for node in everywhere for record in node])
        self._verified = list(pieces)
