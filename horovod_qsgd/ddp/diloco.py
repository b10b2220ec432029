"""DiLoCo over ``torch.distributed`` (torchrun, Gloo or NCCL; no Horovod): the optimizer of
:mod:`horovod_qsgd.torch.diloco` with the DDP hooks' compressors carrying its outer exchange.

    from horovod_qsgd.ddp import DiLoCo, QSGDState
    optimizer = DiLoCo(torch.optim.AdamW(model.parameters(), lr=3e-3), model.named_parameters(),
                       sync_every=16, compression=QSGDState(bits=4))

Use it on the plain model, *not* on a ``DistributedDataParallel`` one: DDP would average every step's
gradient. The pseudo-gradients go as one flat tensor through the compressor's exchange (an allgather of the
payloads at 2 ranks, the two stages from 3 for 65,536 elements or more), with Top-k's error feedback on the
sender's and the owner's side; without ``compression`` one float32 ``all_reduce``. The algorithm, the
defaults and the costs: :func:`horovod_qsgd.torch.diloco.DiLoCo`.
"""
import torch
import torch.distributed as dist

from horovod_qsgd.common.chunks import chunk_unit, shard_numel
from horovod_qsgd.common.collectives import drive
from horovod_qsgd.common.errors import CompressionMismatchError
from horovod_qsgd.common.handshake import check_settings, settings_record
from horovod_qsgd.common.stats import merge_stats
from horovod_qsgd.ddp.hooks import _PayloadState
from horovod_qsgd.torch_shared.arrays import as_array
from horovod_qsgd.torch_shared import in_node, local_sgd
from horovod_qsgd.torch_shared.distributed import (DistributedNodes, DistributedTransport, all_gather_single,
                                                   node_names)
from horovod_qsgd.torch_shared.local_sgd import (DEFAULT_OUTER_MOMENTUM, DEFAULT_WARMUP_STEPS, START_ALIKE, DiLoCoMixin,
                                               OuterLoop, check_arguments, check_fragments,
                                               check_warmup_compression, named_parameters_of, wrap_optimizer)

__all__ = ["DiLoCo"]
START_ALIKE_HERE = START_ALIKE.format(broadcast="torch.distributed.broadcast(p.data, 0) of every parameter")


class _Exchange(in_node.AveragesInNode):
    """Averages a list of float32 tensors over ``group`` as one flat tensor: float32 ``all_reduce``, or the
    payloads of ``compression`` (a :class:`~horovod_qsgd.ddp.QSGDState` or :class:`~horovod_qsgd.ddp.TopKState`:
    its codecs, exchange setting and statistics) with residuals of its own, per purpose."""

    def __init__(self, compression, group, hierarchical=False, warmup_compression=None):
        super().__init__()   # nodes: DistributedNodes, found at the handshake where hierarchical
        self.compression, self.group, self.hierarchical = compression, group, hierarchical
        self.warmup_compression = warmup_compression
        self.steps = {}      # purpose -> exchanges so far (the codecs' random streams)
        self.residuals = {}  # purpose -> [sender residual, owner residual or None] (error feedback)
        self.full_precision_bytes = 0

    def __call__(self, tensors, purpose):
        if not tensors:
            return []
        if purpose == "node":
            return self.average_in_node(tensors)
        flat = torch.cat([t.reshape(-1) for t in tensors])
        warm = purpose == "gradients" and self.warmup_compression is not None
        state = self.warmup_compression if warm else self.compression
        if purpose == "models":
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.group.size())
            self.full_precision_bytes += 4 * flat.numel()
        elif self.hierarchical:
            flat = self._between_nodes(flat, purpose, state)
        elif state is None:
            flat = self._full_precision(flat, self.group)
        else:
            flat = self._compressed(flat, purpose, self.group, state)
        return [part.view_as(t) for part, t in zip(torch.split(flat, [t.numel() for t in tensors]), tensors)]

    def _full_precision(self, flat, group):
        dist.all_reduce(flat, group=group)
        self.full_precision_bytes += 4 * flat.numel()
        return flat.div_(group.size())

    def _in_node_alltoall(self, send, shard, step):
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.nodes.local)
        return received

    def _between_nodes(self, flat, purpose, state):
        """Hierarchical: the average over the nodes of the node's (exact) average, local rank j exchanging
        shard j among the nodes (compressed), then the shards gathered in the node in float32."""
        nodes = self.nodes
        if purpose == "gradients":  # a warm-up step: each rank's own gradient, averaged in the node first
            flat = self.average_in_node([flat])[0]
        numel = flat.numel()
        shard = shard_numel(numel, nodes.local_size, 1 if state is None else chunk_unit(state.codec))
        padded = torch.zeros(nodes.local_size * shard, dtype=torch.float32, device=flat.device)
        padded[:numel] = flat
        mine = padded[nodes.local_rank * shard:(nodes.local_rank + 1) * shard].clone()
        if state is None:
            mine = self._full_precision(mine, nodes.cross)
        else:
            mine = self._compressed(mine, f"{purpose}.shard{nodes.local_rank}", nodes.cross, state)
        all_gather_single(padded, mine, group=nodes.local)
        self.bytes_sent_in_node += 4 * shard * (nodes.local_size - 1)
        return padded[:numel]

    def _compressed(self, flat, purpose, group, state):
        num_ranks, rank = group.size(), group.rank()
        step = self.steps.get(purpose, 0)
        plan = state.engine.plan(f"diloco.{purpose}", flat.numel(), num_ranks, rank, 4 * flat.numel(), 0)
        kept = None
        if state.error_feedback:
            residual, owner = self.residuals.setdefault(purpose, [torch.zeros_like(flat), None])
            if owner is None and plan.own_numel():
                owner = self.residuals[purpose][1] = torch.zeros(plan.own_numel(), device=flat.device)
            kept = [residual.clone(), None if owner is None else owner.clone()]
        transport = DistributedTransport(group, rank, flat.device)
        conduct = plan.conduct(transport, flat, step, as_array(residual) if kept else None,
                               (lambda: as_array(owner)) if kept and owner is not None else None)
        gathered, refusal = drive(conduct, transport.run)
        if refusal is not None:
            raise refusal
        total = torch.zeros_like(flat)
        plan.decode(as_array(gathered), as_array(total))
        total.mul_(1.0 / num_ranks)
        self.steps[purpose] = step + 1
        if kept and not bool(torch.isfinite(total).all()):  # a skipped outer step keeps nothing of it
            self.residuals[purpose] = kept
        return total

    def state(self):
        return {"steps": dict(self.steps), "residuals": {k: [None if r is None else r.clone() for r in v]
                                                         for k, v in self.residuals.items()}}

    def load(self, state):
        self.steps = dict(state["steps"])
        self.residuals = {k: [None if r is None else r.clone() for r in v] for k, v in state["residuals"].items()}


class DistributedDiLoCoMixin(DiLoCoMixin):
    """DiLoCo whose exchange is :class:`_Exchange`."""

    def _diloco_exchange_stats(self, counts, reset):
        exchange = self._diloco_exchange
        states = [s for s in (exchange.compression, exchange.warmup_compression) if s is not None]
        stats = merge_stats([{"bytes_sent": exchange.full_precision_bytes}] +  # the states' plans counted payloads
                            [s.compression_stats(reset) for s in states])
        if exchange.hierarchical:
            stats["bytes_sent_in_node"] = exchange.bytes_sent_in_node
        if reset:
            exchange.full_precision_bytes = exchange.bytes_sent_in_node = 0
        return stats

    def _diloco_exchange_state(self):
        return self._diloco_exchange.state()

    def _diloco_load_exchange_state(self, state):
        self._diloco_exchange.load(state)


def _settings_of(compression):
    return {"compression": None} if compression is None else {"compression": type(compression).__name__,
                                                              **compression.settings()}


def DiLoCo(optimizer, named_parameters=None, sync_every=16, compression=None, outer_lr=None,
           outer_momentum=DEFAULT_OUTER_MOMENTUM, nesterov=True, warmup_steps=DEFAULT_WARMUP_STEPS, hierarchical=False,
           process_group=None, warmup_compression=None, fragments=1):
    r"""DiLoCo over ``torch.distributed``: :func:`horovod_qsgd.torch.diloco.DiLoCo`'s algorithm, defaults and
    methods (``average_models()``, ``compression_stats()``, ``state_dict()``), without Horovod.

    Args:
        optimizer (torch.optim.Optimizer): the inner optimizer (AdamW), on the plain model (not DDP's).
        named_parameters: ``model.named_parameters()`` or the model (default: ``param.<i>``).
        sync_every (int): ``H``, steps between outer steps (default 16).
        compression: None (default; float32 ``all_reduce``), or a :class:`~horovod_qsgd.ddp.QSGDState` /
            :class:`~horovod_qsgd.ddp.TopKState` built for this optimizer alone (its codec and exchange
            settings; its ``min_numel`` does not apply: the model goes as one flat tensor).
        outer_lr (float): default None: 0.7 from ``sync_every * sqrt(N / 2)`` = 16 on (``N``: the ranks, the
            nodes where hierarchical), in proportion below it, at least ``1 - outer_momentum``. The nodes are
            torchrun's ``GROUP_RANK`` (else the host names), gathered when the optimizer is built, on every rank.
            outer_momentum (float): default 0.8. Why and when to change them:
            :func:`horovod_qsgd.torch.diloco.DiLoCo`. nesterov (bool): default True.
        warmup_steps (int): synchronous steps first, their gradients averaged through the same exchange
            (default 80; why: :func:`horovod_qsgd.torch.diloco.DiLoCo`).
        hierarchical (bool): on several nodes of equal size (torchrun's ``GROUP_RANK``, else the host name),
            more than one rank each: every local step averages the gradients in the node, exactly (the same
            bits on each of its ranks), and the warm-up's and outer exchanges cross between nodes only, local
            rank j sending shard j of the node's average among the nodes (compressed) and the node gathering
            the shards in float32: each node sends one compressed model per outer step. Default False. What
            it costs and when to use it: :func:`horovod_qsgd.torch.diloco.DiLoCo`.
        process_group: the group whose ranks train together (default: the default group; hierarchical: the
            default group only).
        warmup_compression: a :class:`~horovod_qsgd.ddp.QSGDState` / :class:`~horovod_qsgd.ddp.TopKState` for
            the warm-up's gradients (default None: ``compression``'s); why and when:
            :func:`horovod_qsgd.torch.diloco.DiLoCo`.
        fragments (int): streaming DiLoCo: this many runs of consecutive parameters, each taking its outer
            step at a step of its own once every ``sync_every`` steps, with its own exchange and residuals
            (default 1: the whole model at once). What it costs and when to use it:
            :func:`horovod_qsgd.torch.diloco.DiLoCo`.
    """
    check_arguments(sync_every, outer_lr, outer_momentum, warmup_steps, fragments)
    if isinstance(named_parameters, torch.nn.Module):
        named_parameters = named_parameters.named_parameters()
    named = named_parameters_of(optimizer, named_parameters, "DiLoCo")
    check_fragments(named, fragments)
    for name, given in (("compression", compression), ("warmup_compression", warmup_compression)):
        if given is not None and not isinstance(given, _PayloadState):
            raise TypeError(f"horovod_qsgd: DiLoCo (torch.distributed) takes {name}=None, QSGDState(...) or "
                            f"TopKState(...) from horovod_qsgd.ddp, not a {type(given).__name__}; "
                            "horovod_qsgd.torch's compressors are Horovod's (use horovod_qsgd.torch.DiLoCo there)")
    check_warmup_compression(compression, warmup_compression)
    if not dist.is_initialized():
        raise RuntimeError("horovod_qsgd: DiLoCo (torch.distributed) needs torch.distributed.init_process_group() "
                           "first (torchrun sets its environment)")
    if hierarchical and process_group is not None:
        raise ValueError("horovod_qsgd: DiLoCo(hierarchical=True) takes the job's nodes: leave process_group=None")
    group = process_group if process_group is not None else dist.group.WORLD
    exchange = _Exchange(compression, group, hierarchical, warmup_compression)

    def check(record, name):
        records = [None] * group.size()
        dist.all_gather_object(records, settings_record("DiLoCo", record), group=group)
        try:
            check_settings(records)
        except CompressionMismatchError as exc:
            raise CompressionMismatchError(f"{exc}\n{START_ALIKE_HERE}") from None
        if hierarchical and exchange.nodes is None:
            exchange.nodes = DistributedNodes.of_this_job(group, None, refuse=local_sgd.needs_nodes)

    settings = _settings_of(compression)
    if warmup_compression is not None:  # (absent where not given: checkpoints from before it load)
        settings["warmup_compression"] = _settings_of(warmup_compression)
    # the models in the outer average, for outer_lr's default; the nodes gathered on every rank whatever its
    # settings, so that a rank whose hierarchical differs reaches the handshake that refuses it
    nodes = len(set(node_names(group)))
    workers = nodes if hierarchical else group.size()
    loop = OuterLoop(named, sync_every, outer_lr, outer_momentum, nesterov, warmup_steps, exchange, check, settings,
                     hierarchical, fragments, workers)
    return wrap_optimizer(optimizer, DistributedDiLoCoMixin, _diloco=loop, _diloco_exchange=exchange)
