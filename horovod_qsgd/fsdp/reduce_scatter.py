r"""QSGD and top-k as FSDP2's gradient reduce-scatter (``torch.distributed.fsdp.fully_shard``).

FSDP2 reduces each ``fully_shard`` module's gradients with one reduce-scatter
per backward pass: its input is N rows (row j: this rank's gradient of what
rank j owns, every parameter's shard, padded), its output this rank's row of
the sum, averaged. :func:`compress_reduce_scatter` installs on every such
module a :class:`ModuleReduceScatter` (FSDP2's ``set_custom_reduce_scatter``)
that runs :class:`~horovod_qsgd.common.reduce_scatter.ReduceScatterPlan`:

1. the rows are staged in float32, each parameter's piece at a multiple of
   QSGD's ``bucket_size`` (no scale spans two parameters);
2. every row but this rank's own is encoded and sent to its owner in one
   ``all_to_all_single``; the owner adds the N-1 decoded rows, in rank
   order, to its own row (kept at full precision);
3. the sum is scaled as FSDP2's ``op`` says (``AVG``: 1/N, ``SUM``: 1,
   ``PREMUL_SUM``: its factor) and written into FSDP2's output, in its
   dtype (bfloat16 under ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``).

Bytes: a rank sends N-1 compressed rows, where an ideal reduce-scatter sends
N-1 rows at full precision: QSGD-4 about 4 + 32/bucket_size bits per
coordinate against 32 (fp32) or 16 (bf16). Top-k's error feedback is the
sender's: what a row did not send stays in this rank's residual of that row.

Every rank checks every rank's settings and each module's row layout at the
module's first reduce-scatter and whenever the layout changes
(``CompressionMismatchError`` on every rank).
With error feedback, a step whose output holds inf or NaN on any rank (a loss
scaler's overflow, also one that only the cast to float16 makes) leaves every
rank's residual as it was: the owners' verdicts meet in a one-element
all-reduce on the device, chained through the step's modules, and decide the
step when the next one begins (:mod:`horovod_qsgd.fsdp.verdict`); nothing is
read on the host. QSGD keeps no state but the step counter of its RNG.

Modules whose input has fewer than ``min_numel`` elements go through an
uncompressed ``all_to_all_single`` of the rows, summed in rank order: an
ideal reduce-scatter's bytes.

``exchange="node_aware"`` (ZeRO++'s qgZ shape), on nodes of L ranks each
(torchrun's ``GROUP_RANK``, else the host name): each rank first sends the
node's other ranks, at full precision, the rows their counterparts on every
node own (one ``all_to_all_single`` in the node) and sums what arrives, in
local-rank order; then the plan above runs among the M ranks of its local
index (one per node) on those M node sums. Only compressed rows cross
between nodes: L (M-1) per node, where the flat exchange sends L·L (M-1)
(and an ideal fp32 reduce-scatter as many at full precision).
``exchange="auto"`` (default) takes it for CUDA gradients on several nodes
of equal size, else the flat exchange (``"reduce_scatter"``): on CPU nodes
the full-precision sum in the node costs about what it saves (as measured
for the DDP hooks).

A module whose trainable parameters do not all get a gradient in a step
(without ``set_reduce_scatter_unused_params(True)``) is compressed as one
piece that step, with a warning: FSDP2 does not tell its reduce-scatter which
parameters it left out, so their places in the row are unknown here. Frozen
parameters (``requires_grad=False``) are never in the rows, and do not count.

Costs and limits: the exchange runs synchronously in FSDP2's reduce-scatter
call, on its stream; one alltoall per module, not fused across modules.
Top-k's residual is the module's whole staged input, twice (the kept residual
and the one a step writes until its verdict): 8 bytes per parameter.
"""
import json
import warnings

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.tensor import DTensor, Shard

from horovod_qsgd.codecs import TopKCodec
from horovod_qsgd.common.chunks import chunk_unit
from horovod_qsgd.common.collectives import drive
from horovod_qsgd.common.engine import PayloadEngine
from horovod_qsgd.common.handshake import check_settings, settings_record
from horovod_qsgd.common.node_aware import NODE_AWARE, looks_for_nodes
from horovod_qsgd.common.reduce_scatter import REDUCE_SCATTER, ReduceScatterPlan, RowLayout
from horovod_qsgd.common.settings import CodecSettings
from horovod_qsgd.common.state import check_loadable, state_header
from horovod_qsgd.common.stats import CompressionStats
from horovod_qsgd.common.two_stage import qsgd_codecs
from horovod_qsgd.fsdp.verdict import StepFlags
from horovod_qsgd.kernels import finish_sum
from horovod_qsgd.torch_shared.arrays import as_array, kernel_stream
from horovod_qsgd.torch_shared.distributed import DistributedNodes, DistributedTransport, check_payload_settings
from horovod_qsgd.torch_shared.feedback import TensorFeedback


EXCHANGES = ("auto", REDUCE_SCATTER, NODE_AWARE)
RESIDUAL_DTYPES = ("float32", "bfloat16")


def reduction_scale(op, num_ranks):
    """What FSDP2's ``op`` multiplies the sum by; ValueError for an op a reduce-scatter of gradients does not
    take."""
    kind = getattr(op, "op", op)
    if kind == ReduceOp.AVG:
        return 1.0 / num_ranks
    if kind == ReduceOp.SUM:
        return 1.0
    if kind == ReduceOp.PREMUL_SUM:
        return float(op.factor)
    raise ValueError(f"horovod_qsgd: FSDP2 asked for a {kind} reduce-scatter; the compressed reduce-scatter sums "
                     "gradients (AVG, SUM or PREMUL_SUM): leave FSDP2's reduce op at its default.")


class ModuleReduceScatter(ReduceScatter):
    """One ``fully_shard`` module's compressed gradient reduce-scatter. Its state, kept under its name in the
    compressor's store: the step counter of the codec's RNG and, with error feedback, this rank's residual of
    every row it sends (the staged input, N rows).

    :func:`~horovod_qsgd.fsdp.compress_reduce_scatter` builds one per module; build one yourself only to hand
    FSDP2's ``set_custom_reduce_scatter`` a module of your choosing.

    Args:
        compressor (QSGD or TopK): the compressor whose codec, statistics and state it uses.
        name (str): the module's key in the compressor's state (``fsdp.<module path>``), the same on every rank.
        module (FSDPModule): the ``fully_shard`` module whose reduce-scatter it replaces.

    Costs: those of its compressor, per call (one per backward pass of the module).
    """

    def __init__(self, compressor, name, module):
        self.compressor, self.name, self.module = compressor, name, module
        compressor._feedback.entry(name)  # every module is in the state from the start
        self._verified = None  # the row layout every rank agreed on at the first call

    @property
    def state(self):
        """The module's :class:`~horovod_qsgd.torch_shared.feedback.TensorState` in the compressor's store."""
        return self.compressor._feedback.entry(self.name)

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        compressor, stats = self.compressor, self.compressor._stats
        num_ranks = group.size()
        scale = reduction_scale(op, num_ranks)
        if compressor._flags.pending(self.name):  # the module's last step is over: so is every module's
            compressor._settle()
        rows = input_tensor.view(num_ranks, -1)
        pieces = self._pieces(rows.shape[1])
        self._handshake(group, input_tensor, pieces)
        if input_tensor.numel() < compressor.min_numel:
            self._pass_through(output_tensor, rows, group, scale)
            return None
        nodes = compressor._nodes_of(group, input_tensor.device)
        if nodes is None:
            name, cross, exchange = self.name, group, REDUCE_SCATTER
        else:  # the node's sum of the rows this rank's counterparts on every node own, at full precision
            rows = _sum_in_node(rows, nodes, stats, compressor._owner_index(nodes, rows.device))
            name, cross, exchange = f"{self.name}.shard{nodes.local_rank}", nodes.cross, NODE_AWARE
        layout = RowLayout(pieces, chunk_unit(compressor.codec))
        staged = stage_rows(rows, layout)
        plan = ReduceScatterPlan(compressor.codec, name, layout.staged_numel, cross.size(), cross.rank(), stats,
                                 (num_ranks - 1) * rows.shape[1] * input_tensor.element_size())
        stats.note_exchange(self.name, exchange)
        state, kept, written, stamps, lean = self.state, None, None, None, None
        if compressor.error_feedback:  # the staged rows change size where parameters got no gradient
            kept = compressor._feedback.checked_residual(self.name, staged.numel(), staged.device,
                                                         resized="the module's staged rows").to(staged.device)
            if compressor.residual_dtype == "bfloat16":  # one buffer, widened for the step, narrowed after it
                lean = kept.single_buffer(torch.bfloat16)
                written = lean.float()
            else:
                stamps = state.stamps_on(staged.device)
                written = kept.for_step(stamps, state.step)
        transport = DistributedTransport(cross, cross.rank(), staged.device)
        with kernel_stream(staged.device):
            total, refusal = drive(plan.conduct(transport, staged, state.step, as_array(written)), transport.run)
            stats.add(collectives_started=transport.started)
            if refusal is not None:
                raise refusal
            scale_sum(total, scale)
        unstage_row(total, layout, output_tensor)
        if lean is not None:
            lean.copy_(written)
        compressor._flags.note(self.name, output_tensor, [group],
                               None if kept is None else [] if lean is not None else [(kept, written)], stamps,
                               state.step + 1, zeroed=lean)
        state.step += 1
        return None

    # -- the parts of a call ----------------------------------------------------------------
    def _pieces(self, row_numel):
        return row_pieces(self.module, self.name, row_numel, "reduce-scatter's rows")

    def _handshake(self, group, input_tensor, pieces):
        """At the module's first call, and again where its row layout changed (parameters without a gradient in
        a step: FSDP2 itself needs every rank to leave out the same ones), every rank checks every rank's
        settings and row layout (raises on all)."""
        if self._verified == pieces:
            return
        records = [None] * group.size()
        mine = settings_record(type(self.compressor).__name__, dict(
            self.compressor.settings(), module=self.name, pieces=pieces, dtype=str(input_tensor.dtype),
            device=input_tensor.device.type))
        dist.all_gather_object(records, mine, group=group)
        check_settings(records)
        self._verified = list(pieces)

    def _pass_through(self, output_tensor, rows, group, scale):
        """A small module's reduce-scatter at full precision: every row to its owner, summed in rank order."""
        received = torch.empty_like(rows)
        dist.all_to_all_single(received, rows.contiguous(), group=group)
        total = received[0].float().clone()
        for row in received[1:]:
            total += row.float()
        output_tensor.copy_(total.mul_(scale).reshape(output_tensor.shape))
        nbytes = (rows.shape[0] - 1) * rows.shape[1] * rows.element_size()
        self.compressor._stats.add(tensors_passed_through=1, bytes_uncompressed=nbytes, bytes_sent=nbytes)

    def residual_to_save(self):
        """This rank's residual for a distributed checkpoint: the one kept, or zeros of the size its steps will
        keep (a module not run yet, as in a job about to load one); None for a module that passes through."""
        self.compressor._settle()
        self.state.settle_on_host()
        if self.state.residual is not None:
            return self.state.residual.kept if self.compressor.residual_dtype != "bfloat16" else \
                self.state.residual.single_buffer(torch.bfloat16)
        group = param_group(self.module)
        pieces = trainable_pieces(self.module)
        if group.mesh_info.shard_mesh_size * sum(pieces) < self.compressor.min_numel:
            return None
        nodes = self.compressor._nodes_of(group.mesh_info.shard_process_group, group.device)
        rows = group.mesh_info.shard_mesh_size if nodes is None else nodes.num_nodes
        staged = RowLayout(pieces, chunk_unit(self.compressor.codec)).staged_numel
        return torch.zeros(rows * staged, dtype=getattr(torch, self.compressor.residual_dtype), device=group.device)


def param_group(module):
    return module._get_fsdp_state()._fsdp_param_groups[0]


def trainable_pieces(module):
    """Each trainable parameter's padded shard size, in FSDP2's order (FSDP2 never reduces a frozen one's)."""
    return [fsdp_param.padded_sharded_param_size.numel() for fsdp_param in param_group(module).fsdp_params
            if fsdp_param.sharded_param.requires_grad]


def row_pieces(module, name, row_numel, what):
    """Each parameter's piece of a row (its padded shard), in FSDP2's order, for the parameters that take
    gradients (FSDP2 leaves frozen ones out of its reduce-scatter); one piece, with a warning, where they do not
    add up to the row (some parameters got no gradient this step). ``what``: the row, as the warning names it."""
    pieces = trainable_pieces(module)
    if sum(pieces) == row_numel:
        return pieces
    warnings.warn(f"horovod_qsgd: FSDP2 module {name!r}: the {what} ({row_numel} elements) are not the shards of "
                  f"all its trainable parameters ({sum(pieces)}): some got no gradient this step. They are "
                  "compressed as one piece (a QSGD scale may span two parameters); call "
                  "set_reduce_scatter_unused_params(True) on the model to keep every parameter's place.")
    return [row_numel]


def scale_sum(total, scale):
    """Multiplies a decoded float32 sum by ``scale`` (FSDP2's op), as the Horovod adapter scales: the same bits."""
    if total.is_cuda:
        total.mul_(scale)
    else:
        finish_sum(as_array(total), scale)


def _sum_in_node(rows, nodes, stats, owners):
    """Step 1 of the node-aware reduce-scatter: each of the node's L ranks sends every other the rows that rank's
    counterparts on every node own (M rows, full precision, one ``all_to_all_single`` in the node) and adds what
    arrives in local-rank order (``owners``: the rows to send, in order, an index made once per layout): returns
    this node's sum of the M rows this rank's counterparts own, float32, in the order of its ``cross`` group's
    ranks."""
    send = rows[owners]
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=nodes.local)
    received = received.view(nodes.local_size, nodes.num_nodes, -1)
    total = received[0].float()  # float32 rows: summed in place, in this call's own buffer
    for part in received[1:]:
        total += part.float()
    stats.add(bytes_sent_in_node=(nodes.local_size - 1) * nodes.num_nodes * rows.shape[1] * rows.element_size())
    return total


def stage_rows(rows, layout):
    """The N rows as one flat float32 tensor, each parameter's piece where ``layout`` places it: ``rows``
    themselves where they are float32 already and nothing moves."""
    if layout.in_place and rows.dtype == torch.float32:
        return rows.reshape(-1)
    staged = torch.zeros(rows.shape[0], layout.staged_numel, dtype=torch.float32, device=rows.device)
    for at, offset, numel in layout.runs():
        staged[:, offset:offset + numel] = rows[:, at:at + numel]
    return staged.reshape(-1)


def unstage_row(total, layout, output_tensor):
    """This rank's staged row of the sum into FSDP2's output (in its dtype)."""
    out = output_tensor.reshape(-1)
    for at, offset, numel in layout.runs():
        out[at:at + numel] = total[offset:offset + numel]




class _ReduceScatterCompressor(CodecSettings):
    """What the modules of one model share: settings, statistics, checkpoints."""

    def __init__(self, codec, min_numel, exchange, residual_dtype="float32"):
        check_payload_settings(codec, min_numel, "the FSDP2 reduce-scatter")
        if residual_dtype not in RESIDUAL_DTYPES:
            raise ValueError(f"horovod_qsgd: residual_dtype={residual_dtype!r}; allowed values: "
                             + ", ".join(repr(d) for d in RESIDUAL_DTYPES))
        self.residual_dtype = residual_dtype
        if exchange not in EXCHANGES:
            raise ValueError(f"horovod_qsgd: exchange={exchange!r} is not an FSDP2 reduce-scatter's; allowed "
                             "values: " + ", ".join(repr(e) for e in EXCHANGES))
        self.codec, self.min_numel, self.exchange = codec, int(min_numel), exchange
        self._stats = CompressionStats()
        self._feedback = TensorFeedback()  # by module name: its step and residual
        self._modules = {}  # name -> ModuleReduceScatter
        self._replicas = {}  # name -> ReplicaAllReduce (custom HSDP)
        self._nodes = {}    # the ranks of a group -> None (flat) or DistributedNodes
        self._owner_indices = {}  # (nodes, device) -> the row index _sum_in_node sends
        self._flags = StepFlags()
        self.engine = PayloadEngine(codec, codec, "auto", self._stats)  # the replicas' all-reduce (HSDP)

    def settings(self):
        settings = dict(self.codec.config(), min_numel=self.min_numel, exchange=self.exchange)
        if self.residual_dtype != "float32":  # checkpoints of the default form keep their header
            settings["residual_dtype"] = self.residual_dtype
        return settings

    def _nodes_of(self, group, device):
        """The job's nodes where ``group``'s exchange is node-aware, else None: found at the group's first
        compressed reduce-scatter, on every rank of it alike, and kept per group (a module on a smaller mesh, as
        torchtitan shards MoE experts, has a layout of its own). Only a group of every rank looks for nodes
        (their groups are made by every rank): a smaller one, as HSDP's shard groups, is flat."""
        key = tuple(dist.get_process_group_ranks(group))
        if key not in self._nodes:
            nodes, whole = None, group.size() == dist.get_world_size()
            if looks_for_nodes(self.exchange, device.type == "cuda", whole):
                nodes = DistributedNodes.of_this_job(group, None, quiet=self.exchange != NODE_AWARE)
            elif self.exchange == NODE_AWARE:
                warnings.warn("horovod_qsgd: exchange='node_aware' needs FSDP2's reduce-scatter over every rank "
                              f"(its group has {group.size()} of {dist.get_world_size()}): it is flat instead.")
            self._nodes[key] = nodes
        return self._nodes[key]

    def _owner_index(self, nodes, device):
        """The rows a rank sends its node's other ranks in the node-aware exchange, in order (the rows their
        counterparts on every node own), as an index on ``device``: made once, not copied to the device at every
        call."""
        index = self._owner_indices.get((id(nodes), device))
        if index is None:
            owners = [sorted(ranks[j] for ranks in nodes.members) for j in range(nodes.local_size)]
            index = self._owner_indices[(id(nodes), device)] = torch.tensor(
                [owner for counterparts in owners for owner in counterparts], device=device)
        return index

    def compression_stats(self, reset=False):
        """Counters since the last reset: modules' reduce-scatters compressed (``tensors_compressed``) and passed
        through, bytes an ideal reduce-scatter would have sent (``bytes_uncompressed``) and sent
        (``bytes_sent``), collectives, non-finite sums (see ``horovod_qsgd.torch.QSGD.compression_stats``)."""
        self._flags.nonfinite.drain_into(self._stats)
        return self._stats.snapshot(reset)

    def rescale_residuals(self, factor):
        """Multiplies every module's error-feedback residual by ``factor`` (a float or a 0-d tensor).

        FSDP2 reduce-scatters the *scaled* gradients of a loss scaler (``torch.amp.GradScaler``, or FSDP2's
        own ``ShardedGradScaler``), so residuals are kept in the scale of their step: call this with new / old
        scale after the scaler's ``update()`` changed it, or the unsent mass counts once at the wrong scale.
        """
        self._settle()
        self._feedback.rescale_feedback(factor)

    def state_dict(self):
        """Every module's step and residual, plus the settings they belong to; every rank saves its own (or use
        :meth:`checkpointable` with ``torch.distributed.checkpoint``)."""
        self._settle()
        return self._feedback.checkpoint(type(self).__name__, self.settings(), key="modules")

    def checkpointable(self):
        """The state for ``torch.distributed.checkpoint``, on every rank: ``dcp.save({"model": ..., "compressor":
        compressor.checkpointable()}, checkpoint_id=...)`` and ``dcp.load`` of the same dict after
        :func:`compress_reduce_scatter` on the rebuilt model. Each module's residuals are one DTensor sharded
        over the ranks (row r: rank r's), so the checkpoint holds every rank's once; steps and settings are
        the same on every rank."""
        return _Checkpointable(self)

    def load_state_dict(self, state):
        check_loadable(state, type(self).__name__, self.settings())
        known = set(self._modules) | {hook.key for hook in self._replicas.values()}
        unknown = sorted(set(state["modules"]) - known)
        if unknown:
            raise ValueError(f"horovod_qsgd: the state holds FSDP2 exchanges {unknown} that this model has not; "
                             f"it has {sorted(known)}. Call compress_reduce_scatter(model, compressor) with the "
                             "same arguments on the same model before loading.")
        self._load_modules(state["modules"])

    def _settle(self):
        """Decides the last step for every exchange at once (:mod:`horovod_qsgd.fsdp.verdict`): a loss scaler
        skips the whole step where any rank's gradient was not finite, so each new residual is kept only where
        every exchange's output was finite on every rank."""
        self._flags.settle(self._feedback.verdict)

    def _load_modules(self, entries):
        """Every module's state from ``entries`` (by module name); a step's verdict still out is dropped."""
        self._flags.drop()
        self._feedback.load_feedback_entries(entries)


class _Checkpointable(Stateful):
    """A compressor's state as ``torch.distributed.checkpoint`` saves and loads it (see
    :meth:`_ReduceScatterCompressor.checkpointable`)."""

    def __init__(self, compressor):
        self.compressor = compressor

    def state_dict(self):
        compressor, modules, meshes = self.compressor, {}, {}
        exchanges = [(name, module) for name, module in compressor._modules.items()]
        exchanges += [(hook.key, hook) for hook in compressor._replicas.values()]
        for name, exchange in exchanges:
            modules[name] = {"step": torch.tensor(exchange.state.step, dtype=torch.int64)}
            local = exchange.residual_to_save() if compressor.error_feedback else None
            if local is not None:
                kind = local.device.type
                mesh = meshes.get(kind) or meshes.setdefault(kind, init_device_mesh(kind, (dist.get_world_size(),)))
                modules[name]["residual"] = DTensor.from_local(local.reshape(1, -1), mesh, [Shard(0)])
        return {"header": json.dumps(state_header(type(compressor).__name__, compressor.settings())),
                "modules": modules}

    def load_state_dict(self, state):
        compressor = self.compressor
        check_loadable(json.loads(state["header"]), type(compressor).__name__, compressor.settings())
        entries = {}
        for name, saved in state["modules"].items():
            residual = saved.get("residual")
            entries[name] = {"step": int(saved["step"]),
                             "residual": None if residual is None else residual.to_local()[0]}
        compressor._load_modules(entries)


class QSGD(_ReduceScatterCompressor):
    """QSGD as FSDP2's gradient reduce-scatter (see :mod:`horovod_qsgd.fsdp`).

    Each coordinate x of a bucket of ``bucket_size`` with scale s = max|x| (``norm="max"``; ``"l2"``: the
    bucket's 2-norm) is sent as sign(x) * s * l / L, l in 0..L with L = 2^(bits-1) - 1 levels, rounded up with
    probability L|x|/s - l: bits per coordinate plus one scale per bucket, E[Q(x)] = x.

    Args:
        bits (int): bits per coordinate, sign included (default 4: about 7.5x fewer bytes than fp32 at
            ``bucket_size=512``). Raise to 8 (3.9x) where a model does not converge at 4; 2 (about 15x) where
            the link dominates the step, for more variance.
        bucket_size (int): coordinates per scale (default 512). Lower it for gradients of very unequal
            coordinates (more scales, more bytes).
        norm (str): ``"max"`` (default; the paper's experiments) or ``"l2"`` (its theory; more zeros).
        scale_dtype (str): ``"float32"`` (default) or ``"float16"`` (2 bytes fewer per bucket).
        rounding (str): ``"stochastic"`` (default: unbiased) or ``"nearest"`` (biased, less variance).
        min_numel (int): modules whose reduce-scatter input is smaller go through an uncompressed alltoall of
            the rows (default 10000).
        seed (int): the rounding's seed, the same on every rank (checked; default 0).
        exchange (str): ``"auto"`` (default), ``"reduce_scatter"`` (flat) or ``"node_aware"`` (full precision
            inside a node, compressed between nodes; see :mod:`horovod_qsgd.fsdp`).

    Costs: one encode and N-1 decodes of a module's shard per step on each rank, one ``all_to_all_single`` per
    module (not fused across modules); no state but the RNG's step counter (``state_dict()`` all the same, to
    resume bit-identically).
    """

    def __init__(self, bits=4, bucket_size=512, norm="max", scale_dtype="float32", rounding="stochastic",
                 min_numel=10000, seed=0, exchange="auto"):
        codec, _, _ = qsgd_codecs(bits, bucket_size, norm, "fixed", scale_dtype, rounding, seed, "allgather", None)
        super().__init__(codec, min_numel, exchange)


class TopK(_ReduceScatterCompressor):
    """Top-k sparsification with error feedback as FSDP2's gradient reduce-scatter (see :mod:`horovod_qsgd.fsdp`).

    Each row a rank sends its owner carries the ``ratio`` of that row's coordinates largest in magnitude, of
    the gradient plus the residual (indices and values); what is not sent stays in the residual and joins the
    next step's row. The residuals (one per module, this rank's rows) are ``state_dict()`` on every rank; a step
    whose sum is not finite on any rank leaves them as they were.

    Args:
        ratio (float): fraction of each row sent (default 0.01: about 8% of fp32's bytes, a 4-byte index and a
            4-byte value per kept coordinate); raise it if the loss stalls.
        selector (str): ``"exact"`` (default), ``"gaussian"`` or ``"sample"`` (the threshold estimated from a
            normal fit or from a ``sample_ratio`` sample: cheaper on large rows, k approximate).
        error_feedback (bool): keep what is not sent (default True; without it top-k biases the update).
        value_dtype (str): ``"float32"`` (default) or ``"float16"`` values (6 bytes per kept coordinate).
        sample_ratio (float): the ``"sample"`` selector's sample (default 0.01).
        min_numel (int): modules whose reduce-scatter input is smaller go uncompressed (default 10000).
        seed (int): the selectors' seed, the same on every rank (default 0).
        exchange (str): as :class:`QSGD`'s.
        residual_dtype (str): ``"float32"`` (default) or ``"bfloat16"`` (below).

    Costs, memory: the residual of a module's reduce-scatter is its whole staged input (N rows), kept twice
    (the residual and the one a step writes until the step is known to be finite on every rank): 8 bytes per
    parameter, on every rank. ``residual_dtype="bfloat16"`` keeps one bfloat16 buffer instead (2 bytes per parameter; a float32 copy
    lives only during the module's own reduce-scatter): each step's residual is rounded to bfloat16, and a
    skipped step (inf or NaN on any rank) zeroes it, its unsent mass lost once, where the default restores it.
    Under HSDP the residual across replicas is this rank's shard only (1/L of it) and stays float32. Time: a
    selection over each row and N-1 scatters per module and step; one ``all_to_all_single`` per module.
    """

    def __init__(self, ratio=0.01, selector="exact", error_feedback=True, value_dtype="float32",
                 sample_ratio=0.01, min_numel=10000, seed=0, exchange="auto", residual_dtype="float32"):
        super().__init__(TopKCodec(ratio=ratio, selector=selector, value_dtype=value_dtype,
                                   error_feedback=error_feedback, seed=seed, sample_ratio=sample_ratio), min_numel,
                         exchange, residual_dtype)
