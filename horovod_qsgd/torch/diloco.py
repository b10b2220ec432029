"""DiLoCo for Horovod: local steps of any torch optimizer (AdamW) and a compressed outer exchange.

    import horovod.torch as hvd
    from horovod_qsgd.torch import QSGD, DiLoCo

    optimizer = DiLoCo(torch.optim.AdamW(model.parameters(), lr=3e-3), model.named_parameters(),
                       sync_every=16, compression=QSGD(bits=4))
    ...                                   # the training loop is unchanged
    optimizer.average_models()            # before evaluating or saving the model

See :func:`DiLoCo` for the algorithm, the defaults and the costs.
"""
import horovod.torch as hvd
import torch

from horovod_qsgd.common.errors import CompressionMismatchError
from horovod_qsgd.common.naming import HANDSHAKE_NAME
from horovod_qsgd.common.node_aware import NODE_AWARE, NodeLayout
from horovod_qsgd.common.stats import merge_stats
from horovod_qsgd.torch.handshake import check_settings_across_ranks
from horovod_qsgd.torch_shared import in_node, local_sgd
from horovod_qsgd.torch_shared.local_sgd import (DEFAULT_OUTER_MOMENTUM, DEFAULT_WARMUP_STEPS, DiLoCoMixin, OuterLoop,
                                               check_arguments, check_fragments, check_warmup_compression,
                                               manifest_digest, named_parameters_of, wrap_optimizer)

__all__ = ["DiLoCo", "DiLoCoMixin"]  # isinstance(optimizer, DiLoCoMixin): either adapter's DiLoCo
NAME_PREFIX = "horovod_qsgd.diloco"
START_ALIKE = local_sgd.START_ALIKE.format(broadcast="hvd.broadcast_parameters(model.state_dict(), root_rank=0)")


class HorovodDiLoCoMixin(DiLoCoMixin):
    """DiLoCo whose exchange is Horovod's ``grouped_allreduce`` with the compressor."""

    def _diloco_exchange_stats(self, counts, reset):
        exchange = self._diloco_exchange
        compressed = counts["values_exchanged"] - counts["values_exchanged_in_full"]
        parts = [(exchange.compression, compressed)]
        if exchange.warmup_compression is not None:  # the warm-up's gradients went through its own compressor
            warm = exchange.warmup_values
            parts = [(exchange.warmup_compression, warm), (exchange.compression, compressed - warm)]
            if reset:
                exchange.warmup_values = 0
        stats = merge_stats([_sent(compressor, values, reset) for compressor, values in parts])
        stats["bytes_sent"] += 4 * counts["values_exchanged_in_full"]  # average_models(): float32
        if exchange.hierarchical:  # and the node-aware compressor's own full-precision step in the node
            stats["bytes_sent_in_node"] = stats.get("bytes_sent_in_node", 0) + exchange.bytes_sent_in_node
        if reset:
            exchange.bytes_sent_in_node = 0
        return stats

    def _diloco_exchange_state(self):
        exchange = self._diloco_exchange
        state = _state_of(exchange.compression)
        if exchange.warmup_compression is not None:  # (a checkpoint without it keeps the format it had)
            state = {"outer": state, "warmup": _state_of(exchange.warmup_compression)}
        return state

    def _diloco_load_exchange_state(self, state):
        exchange = self._diloco_exchange
        if exchange.warmup_compression is not None:
            _load_into(exchange.warmup_compression, state["warmup"])
            state = state["outer"]
        _load_into(exchange.compression, state)


def _sent(compressor, values, reset):
    """What ``compressor`` sent for ``values`` float32 values: its own counters, or Horovod's own allreduce's
    bytes (``Compression.none``: 4 per value; ``fp16``: 2)."""
    if hasattr(compressor, "compression_stats"):
        return compressor.compression_stats(reset)
    return {"bytes_sent": 4 * values // (2 if compressor is hvd.Compression.fp16 else 1)}


def _state_of(compressor):
    return compressor.state_dict() if hasattr(compressor, "state_dict") else None


def _load_into(compressor, state):
    if hasattr(compressor, "load_state_dict"):
        compressor.load_state_dict(state)


def _exchange_settings(compression, warmup_compression=None):
    if isinstance(compression, type):  # Horovod's own Compression.none / fp16 are classes
        settings = {"compression": compression.__name__}
    else:
        settings = {"compression": type(compression).__name__, **compression.settings()}
    if warmup_compression is not None:  # (absent where not given: checkpoints from before it load)
        settings["warmup_compression"] = _exchange_settings(warmup_compression)
    return settings


class _Exchange(in_node.AveragesInNode):
    """:class:`OuterLoop`'s exchange over Horovod: ``hvd.grouped_allreduce`` through the compressor, named
    ``<prefix>.<purpose>``; hierarchical, the in-node averages (:mod:`horovod_qsgd.torch_shared.in_node`) by
    global alltoalls whose splits are zero outside the node (no process set to declare in ``hvd.init()``)."""

    def __init__(self, compression, prefix, process_set, hierarchical, warmup_compression=None):
        super().__init__()
        self.compression, self.prefix, self.process_set = compression, prefix, process_set
        self.hierarchical, self.warmup_compression = hierarchical, warmup_compression
        self.warmup_values = 0  # values the warmup compressor averaged (its stats may not count them)

    def __call__(self, tensors, purpose):
        if not tensors:
            return []
        if purpose == "node":
            return self.average_in_node(tensors)
        compression = self.compression
        if purpose == "models":
            compression = hvd.Compression.none
        elif purpose == "gradients" and self.warmup_compression is not None:
            compression = self.warmup_compression
            self.warmup_values += sum(t.numel() for t in tensors)
        return hvd.grouped_allreduce(tensors, name=f"{self.prefix}.{purpose}", op=hvd.Average,
                                     process_set=self.process_set, compression=compression)

    def _in_node_alltoall(self, send, shard, step):
        splits = self.nodes.in_node_splits(shard)
        received, received_splits = hvd.alltoall(send, splits=torch.tensor(splits, dtype=torch.int32),
                                                 name=f"{self.prefix}.node.{step}")
        in_node.check_received(self.nodes, received_splits.tolist(), shard, "DiLoCo(hierarchical=True)")
        return received

    def check(self, record, name):
        """Refuses on every rank a record that differs between ranks; hierarchical, then finds the nodes."""
        try:
            check_settings_across_ranks("DiLoCo", record, f"{self.prefix}.{name}", self.process_set)
        except CompressionMismatchError as exc:
            raise CompressionMismatchError(f"{exc}\n{START_ALIKE}") from None
        if self.hierarchical and self.nodes is None:
            self.nodes = _find_nodes(self.prefix, self.process_set)


def _node_aware(compression):
    """The compressor whose exchange a hierarchical DiLoCo takes between nodes: ``compression`` with
    ``exchange='node_aware'`` where it had ``'auto'`` (a new instance: the optimizer owns its state)."""
    if isinstance(compression, type):  # Horovod's none / fp16: its own allreduce, over every rank
        return compression
    exchange = getattr(compression, "exchange", None)
    if exchange == NODE_AWARE:
        return compression
    if exchange != "auto":
        raise ValueError(f"horovod_qsgd: DiLoCo(hierarchical=True) sends the outer exchange between nodes through "
                         f"the node-aware exchange, but the compressor is {type(compression).__name__} with "
                         f"exchange={exchange!r}; pass QSGD(...) or TopK(...) with exchange='auto' (the default) or "
                         "'node_aware', or Horovod's Compression.none / fp16")
    return type(compression)(**dict(compression.settings(), exchange=NODE_AWARE))


def _find_nodes(prefix, process_set):
    """The job's NodeLayout, alike on every rank, or ValueError on every rank naming why it has none."""
    mine = torch.tensor([[hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()]])
    records = hvd.allgather(mine, name=f"{HANDSHAKE_NAME}.{prefix}.nodes", process_set=process_set).tolist()
    layout, why_not = NodeLayout.from_records(records, hvd.rank())
    if layout is None:
        raise local_sgd.needs_nodes(why_not)
    return layout


def DiLoCo(optimizer, named_parameters=None, sync_every=16, compression=hvd.Compression.none, outer_lr=None,
           outer_momentum=DEFAULT_OUTER_MOMENTUM, nesterov=True, warmup_steps=DEFAULT_WARMUP_STEPS, hierarchical=False,
           process_set=hvd.global_process_set, warmup_compression=None, fragments=1):
    r"""DiLoCo: local steps of ``optimizer`` and, every ``sync_every`` steps, an outer step on the averaged change.

    Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models" (arXiv 2311.08105).
    Use it *instead of* ``hvd.DistributedOptimizer``: it wraps the local (inner) optimizer, typically AdamW.

    Algorithm. The first ``warmup_steps`` steps are synchronous: each averages the gradients through
    ``compression``'s exchange before the inner step, as ``hvd.DistributedOptimizer`` would. Then every rank
    keeps the anchor :math:`\theta` (the model at the last synchronization, the same on every rank) and trains
    its own copy :math:`x_i` on its own data with the inner optimizer, without communicating. Every
    ``H = sync_every`` steps the ranks average the pseudo-gradients :math:`\Delta_i = \theta - x_i` through the
    same exchange and take one step of Nesterov SGD on the anchor:

    .. math::
        \Delta = \tfrac{1}{N}\textstyle\sum_i \Delta_i, \quad m \leftarrow \mu m + \Delta, \quad
        \theta \leftarrow \theta - \eta\,(\Delta + \mu m), \quad x_i \leftarrow \theta.

    The inner optimizers' states (AdamW's moments) stay local.

    The exchange is ``compression``'s, as ``hvd.DistributedOptimizer`` runs it: :class:`QSGD` and
    :class:`TopK` send payloads (two stages from 3 ranks, fused, node-aware where the compressor is), with the
    error feedback they keep (Top-k: the sender's residual, and the owner's in two stages), here on the
    pseudo-gradient; ``hvd.Compression.none`` (default) averages in float32, ``hvd.Compression.fp16`` in
    float16. The collectives are ``hvd.grouped_allreduce`` calls named ``horovod_qsgd.diloco.<digest>.outer``
    (``.gradients`` in the warm-up, ``.models`` for ``average_models()``).

    Args:
        optimizer (torch.optim.Optimizer): the inner optimizer; its hyperparameters, schedule and state stay
            in use.
        named_parameters: ``model.named_parameters()`` (stable names for the exchange and the checkpoint) or
            the model. Default: the optimizer's parameters as ``param.<i>``.
        sync_every (int): ``H``, steps between outer steps (default 16). The outer exchanges' bytes fall as
            ``1/H``; quality falls with ``H`` and with the number of ranks (each inner optimizer sees ``1/N``
            of the batch): on ``benchmarks/results/diloco/``'s language model (2 ranks, 1600 steps, 3 seeds)
            H = 16 and H = 32 with QSGD-2 ended within 0.02 nats of per-step AdamW at 103x and 131x fewer
            bytes, H = 16 with QSGD-4 +0.009; at 4 ranks H = 16 with QSGD-2 +0.018 at 103x (0.04-0.05 behind
            with outer momentum 0.5, whatever the batch or outer lr).
        compression: a horovod_qsgd compressor (``QSGD(bits=4)``, ``QSGD(bits=2)``, ``TopK(...)``) or
            Horovod's ``hvd.Compression.none`` (default) / ``fp16``: its own instance, whose state (Top-k's
            residuals) is this optimizer's. QSGD's error is small against a pseudo-gradient: there 2 bits
            ended 0.025-0.045 nats better than 4 (3 seeds, 800 and 1600 steps) at 1.7 times fewer bytes, and
            float32 worse (one seed). ``TopK`` alone ended 0.76 behind: the warm-up's steps are per-step Top-k
            on AdamW's gradients, which fails; with ``warmup_compression=QSGD(bits=2)``, Top-k 10% ended
            +0.014 at 57x and Top-k 1% +0.185 at 141x (one seed).
        outer_lr (float): :math:`\eta` (default None: DiLoCo's 0.7 from ``sync_every * sqrt(N / 2)`` = 16 on,
            ``N`` the ranks (the nodes where hierarchical), in proportion below it, at least ``1 -
            outer_momentum``: at 2 ranks 0.35 at H = 8 and 0.2 at H = 4, at 4 ranks 0.495 and 0.247, from 8
            ranks 0.7 and 0.35). At small ``H`` the pseudo-gradients of successive outer steps point alike and
            the momentum multiplies each up to :math:`\eta / (1 - \mu)` times: on the language model (2 ranks,
            1600 steps, QSGD-4, momentum 0.8, one seed) 0.7 ended +0.062 nats at H = 8 and +0.244 at H = 4;
            0.35 and 0.2 ended +0.000 and +0.025; at H = 16 0.35 did worse than 0.7 (+0.034 against +0.023).
            More ranks want more (QSGD-2, 1600 steps, H = 8): at 4 ranks 0.495 ended 0.005 ± 0.002 nats
            better than 0.35 (3 seeds), 0.7 0.018 worse (one seed); at 8 ranks 0.7 0.012 ± 0.006 better than
            0.35, at H = 4 0.35 0.041 ± 0.001 better than 0.2 (2 seeds each).
        outer_momentum (float): :math:`\mu` (default 0.8). On the language model (1600 steps, warm-up 80,
            H = 16): at 2 ranks 0.8 ended as 0.5 did (QSGD-4, 3 seeds: +0.009 ± 0.007 and +0.008 ± 0.007
            nats); at 4 ranks it closed most of the gap 0.5 left (QSGD-2: +0.018 ± 0.003 against +0.053,
            QSGD-4: +0.048 ± 0.007 against +0.078 ± 0.001, two seeds). DiLoCo's paper uses 0.9 with 8
            workers and ``H`` = 500 from a pretrained model; without a warm-up, from scratch on 2 ranks, 0.9
            diverged (+0.8 nats) and 0.3 did worse than 0.5; at 8 ranks (800 steps, one seed) 0.9 did worse
            than 0.8 (+0.108 against +0.055). Lower it (0.5) without a warm-up.
        nesterov (bool): Nesterov momentum (default True); False: heavy ball, :math:`\theta \leftarrow
            \theta - \eta m`.
        warmup_steps (int): synchronous steps first (default 80). Each sends a gradient, compressed, so it
            costs as much as an outer step. Without them the language model's early local models drifted
            apart and ended 0.07-0.45 nats behind (whatever H, outer lr and momentum); 40 left +0.03, 80 none.
            Longer trainings of larger models warm up longer: set about the learning rate's warm-up or more.
        hierarchical (bool): where several nodes of equal size hold more than one rank each: every local step
            averages the gradients inside the node, exactly (float32, the same bits on each rank of the node,
            over the fast link), so each node trains one model; only the warm-up's and the outer exchanges
            cross between nodes, through the compressor's node-aware exchange (``exchange='auto'`` becomes
            ``'node_aware'``): each node sends about one compressed model per outer step, whatever its number
            of ranks. Default False: every rank trains its own copy. Each inner optimizer then sees the node's
            batch, not a rank's: quality as DiLoCo with as many workers as nodes. Costs per local step: two
            in-node alltoalls of the model's size in float32.
        process_set: the Horovod process set whose ranks train together (default global).
        warmup_compression: the compressor of the warm-up's gradients (default None: ``compression``'s
            exchange), its own instance, as ``compression`` takes. Give one where the outer codec does not suit
            per-step gradients: ``compression=TopK(...)`` (error feedback suits a pseudo-gradient, but per-step
            Top-k on AdamW's gradients fails) with ``warmup_compression=QSGD(bits=4)``. Its bytes count in
            ``compression_stats()`` and its state (residuals, step counters) in ``state_dict()``.
        fragments (int): streaming DiLoCo (Douillard et al., "Streaming DiLoCo", arXiv 2501.18512): the
            parameters split into this many runs of consecutive tensors of near equal size, each taking its
            outer step once every ``sync_every`` steps at a step of its own (fragment f when the local steps
            since the warm-up are ``(f + 1) * sync_every // fragments`` modulo ``sync_every``), with its own
            exchange and error feedback. Default 1: the whole model at once. The bytes are the same; each
            synchronization sends ``1/fragments`` of them, so the burst on the link, the pause and the staging
            memory of one synchronization shrink by as much (the exchange is not overlapped with the next
            steps, as the paper's is: the pauses add up to the same). The ranks never hold the same model all
            at once, so ``average_models()`` always sends the model in float32.

    Costs: two float32 copies of the model (anchor and outer momentum) beside the inner optimizer's state; per
    outer step one exchange of the model's size and a few passes over it; a host read of the averages'
    finiteness. Bytes: ``warmup_steps + (steps - warmup_steps) / H`` exchanges against one per step, each
    compressed as the compressor compresses a gradient. The price: the models differ between outer steps
    (call ``average_models()`` before evaluating or saving) and quality at large ``H`` or many ranks.

    Mixed precision: with ``torch.amp.GradScaler`` its ``step(optimizer)`` calls ``step()`` on every step;
    gradients are unscaled here, an overflowed local step is skipped on its rank alone, and every rank still
    counts it, so the ranks reach each outer step together. A non-finite outer average (a rank's model
    diverged) skips the outer step on every rank and sets the models back to the anchor.

    Returns an instance of a subclass of the optimizer's class (like ``hvd.DistributedOptimizer``) sharing its
    parameter groups and state, with ``average_models()``, ``outer_steps``, ``compression_stats()`` and a
    ``state_dict()`` that holds the anchor, the outer momentum, the counters and the compressor's state
    (:class:`~horovod_qsgd.torch_shared.local_sgd.DiLoCoMixin`). Settings, counters and the starting model
    are compared across the ranks at the first step (a rank that did not ``hvd.broadcast_parameters`` is
    refused, on every rank).
    """
    check_arguments(sync_every, outer_lr, outer_momentum, warmup_steps, fragments)
    if hierarchical and process_set is not hvd.global_process_set:
        raise ValueError("horovod_qsgd: DiLoCo(hierarchical=True) takes the job's nodes: use the global process set")
    if isinstance(named_parameters, torch.nn.Module):
        named_parameters = named_parameters.named_parameters()
    named = named_parameters_of(optimizer, named_parameters, "DiLoCo")
    check_fragments(named, fragments)
    if compression is None:
        compression = hvd.Compression.none
    check_warmup_compression(compression, warmup_compression)
    if hierarchical:
        compression = _node_aware(compression)
        if warmup_compression is not None:
            warmup_compression = _node_aware(warmup_compression)
    if not process_set.included():  # (the first call that needs hvd.init(): bad arguments are refused before)
        raise ValueError("horovod_qsgd: DiLoCo: this rank is not in process_set")
    prefix = f"{NAME_PREFIX}.{process_set.process_set_id}.{manifest_digest(named):08x}"
    exchange = _Exchange(compression, prefix, process_set, hierarchical, warmup_compression)
    workers = hvd.cross_size() if hierarchical else process_set.size()  # the models in the outer average
    loop = OuterLoop(named, sync_every, outer_lr, outer_momentum, nesterov, warmup_steps, exchange, exchange.check,
                     _exchange_settings(compression, warmup_compression), hierarchical, fragments, workers)
    # _diloco_prefix: the exchange's collectives are named f"{prefix}.{purpose}.{index}"
    return wrap_optimizer(optimizer, HorovodDiLoCoMixin, _diloco=loop, _diloco_compression=compression,
                          _diloco_exchange=exchange, _diloco_prefix=prefix)
