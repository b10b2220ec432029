"""A Horovod PyTorch compressor's payload exchanges in flight on this rank, between compress and decompress.

``compress`` hands each tensor to :meth:`PayloadExchanges.start`, which asks the engine for its plan and
returns the tensor's part in flight; ``decompress`` asks :meth:`PayloadExchanges.receive` and
:meth:`PayloadExchanges.result`. The part knows its exchange, so the compressor never branches on it:

* **fused** (:class:`_Fused`, :class:`_Group`): tensors wait for their group
  (:class:`~horovod_qsgd.common.fusion.Fuser`, learned from the step before), which is encoded together (one
  launch sequence on a GPU, whatever its tensor count) and starts its first collective when its last member
  is compressed: the allgather of the members' payloads, or the two stages' alltoall, whose second stage
  starts at the round's first decompress, before anything is waited for. Allgather tensors are fused on a
  GPU only (``ALLGATHER_GROUP_NBYTES``), in groups apart from the two-stage ones;
* **alone** (:class:`_Alone`): an allgather tensor on the host (or anywhere with ``fusion_threshold=0``),
  started at compress;
* **node-aware** (:class:`_NodeAware`): a member of a flight of :mod:`horovod_qsgd.torch.node_aware`, alone
  or in a fused group, advanced at every compress and decompress.

The engine (:mod:`horovod_qsgd.common.engine`) conducts every exchange; this module only starts its
collectives, groups tensors and decides when to wait.
"""
import threading

import torch

from horovod_qsgd.common.collectives import RefusedEarlier, conclude
from horovod_qsgd.common.fusion import ALLGATHER_GROUP_NBYTES, Fuser, fused_exchange
from horovod_qsgd.common.node_aware import NODE_AWARE_GROUP_NBYTES
from horovod_qsgd.kernels import move_into_own_chunk
from horovod_qsgd.torch.node_aware import NodeAwareExchanges, NodeAwareMember
from horovod_qsgd.torch.transport import HorovodTransport
from horovod_qsgd.torch_shared.arrays import as_array, kernel_stream


class PayloadExchanges:
    """Every payload exchange of one compressor in flight on this rank: the tensors' parts, the groups waiting
    for members or for their second stage, the node-aware flights.

    ``feedback``: the compressor's :class:`~horovod_qsgd.torch_shared.feedback.TensorFeedback` (owner residuals are
    taken when a group starts); ``namespace``: the prefix of this compressor's group names.
    """

    def __init__(self, engine, feedback, stats, fusion_threshold, namespace, error_feedback):
        self.engine, self.feedback, self.stats = engine, feedback, stats
        self.fusion_threshold, self.namespace, self.error_feedback = fusion_threshold, namespace, error_feedback
        self.node_exchanges = NodeAwareExchanges(stats)
        self._lock = threading.Lock()
        self.round = 0  # rounds ended so far: a part in flight knows its round by this number
        self.forget()

    def forget(self):
        """Drops what a failed step left in flight; fusion groups are learned anew."""
        self.fuser = Fuser(self.fusion_threshold, self.namespace)  # two-stage tensors
        self.allgather_fusers = {}  # by device type (ALLGATHER_GROUP_NBYTES)
        self.node_fuser = Fuser(min(self.fusion_threshold, NODE_AWARE_GROUP_NBYTES), self.namespace + "node_aware.")
        self._first_stages = []  # two-stage groups whose alltoall started and whose second stage did not
        self.node_exchanges.forget()

    # -- the compressor's calls ----------------------------------------------------------------
    def start(self, tensor, flat, site, step, residual, placeholder_nbytes, nodes):
        """Tensor ``tensor``'s part in flight (its exchange started, or waiting for its group). ``flat``: its
        flat fp32 gradient; ``residual``: the CarriedResidual this step reads and writes (None without error
        feedback); ``nodes``: the NodeLayout where the tensor goes node-aware, else None."""
        if nodes is not None:
            return self._start_node_aware(tensor, flat, site, step, residual, nodes)
        plan = self.engine.plan(site.name, flat.numel(), site.process_set.size(), site.process_set.rank(),
                                tensor.numel() * tensor.element_size(), placeholder_nbytes)
        residual = None if residual is None else as_array(residual)
        if plan.starts_with_alltoall:  # unfused (fusion_threshold=0), a two-stage tensor is a group of one
            return _Fused(plan, flat, residual, site.process_set, self.round, self.fuser)
        with self._lock:
            fuser = self.allgather_fuser(flat.device)
        if fuser.threshold:  # on a GPU; a tensor above the group's limit is a group of one
            return _Fused(plan, flat, residual, site.process_set, self.round, fuser)
        transport = HorovodTransport(site.process_set, flat.device)
        conduct = plan.conduct(transport, flat, step, residual)
        handle = transport.start(next(conduct))
        self.stats.add(collectives_started=1)
        return _Alone(plan, conduct, handle)

    def join(self, ctx, site):
        """Once ``ctx`` (the compress's :class:`~horovod_qsgd.torch.compression._InFlight`) exists: its part
        joins its group, and whatever is ready starts."""
        ctx.handle.join(self, ctx, site)

    def receive(self, ctx):
        """Waits for ctx's exchange (starting whatever the round still holds back first)."""
        return ctx.handle.receive(self, ctx)

    def result(self, ctx, received):
        """The flat fp32 sum of ctx's tensor over every rank, from what :meth:`receive` returned."""
        return ctx.handle.result(self, ctx, received)

    # -- the parts' calls ----------------------------------------------------------------------
    def _start_node_aware(self, tensor, flat, site, step, residual, nodes):
        """Step 1 of the node-aware exchange (horovod_qsgd.torch.node_aware), started.

        With error feedback, the whole residual joins the gradient here
        (``residual`` is zeroed): this rank's own shard of it is what the
        node's sum did not send last step, anything elsewhere was left by
        another layout. The node's sum of the shard is then compressed with a
        zero shard residual, which the result puts back at the shard.
        """
        plan = self.engine.plan_node_aware(site.name, flat.numel(), nodes, tensor.numel() * tensor.element_size())
        padded = torch.zeros(plan.padded_numel(), dtype=torch.float32, device=flat.device)
        shard_residual = owner_residual = None
        if residual is not None:  # padded = flat + the residual, and the step's new residual zero
            move_into_own_chunk(as_array(flat), as_array(residual), as_array(padded[:flat.numel()]))
            shard_residual = torch.zeros(plan.shard, dtype=torch.float32, device=flat.device)
            if plan.cross.owned is not None:  # this rank owns a chunk of its shard between nodes
                # one of another layout was spilled by TensorFeedback.state()
                owner_residual = self.feedback.owner_residual_for_step(site.name, plan, flat.device, step)
        else:
            padded[:flat.numel()] = flat
        return _NodeAware(NodeAwareMember(plan, step, padded, shard_residual, owner_residual), self.round)

    def _start_group(self, name, members):
        """Starts a fused group's exchange, which the engine conducts: its members encoded together, then its
        first collective (the allgather, or the two stages' alltoall)."""
        parts = [member.handle for member in members]
        fused = fused_exchange([part.plan for part in parts])
        device = parts[0].flat.device
        transport = HorovodTransport(parts[0].process_set, device)
        steps = [member.step for member in members]

        def owner_residuals():
            return [as_array(self._owner_residual(member, transport.device)) for member in members]
        conduct = fused.conduct_members(transport, name, [part.flat for part in parts], steps,
                                        [part.residual for part in parts], owner_residuals)
        with kernel_stream(device):
            collective = next(conduct)
        group = _Group(name, fused, members, transport, conduct, transport.start(collective))
        if collective.final:  # the allgather: its result is what the members wait for
            group.final, group.handle = group.handle, None
        else:
            with self._lock:
                self._first_stages.append(group)
        for index, part in enumerate(parts):
            part.flat = part.residual = None
            part.group, part.index = group, index
        self.stats.add(collectives_started=1)

    def allgather_fuser(self, device):
        """The :class:`Fuser` of the allgather tensors on ``device`` (a torch device), made at its first (under
        the lock); its threshold is 0 where they are not fused (the host, ``fusion_threshold=0``)."""
        kind = device.type if device.type in ALLGATHER_GROUP_NBYTES else "cuda"  # another accelerator: as a GPU
        fuser = self.allgather_fusers.get(kind)
        if fuser is None:
            threshold = min(self.fusion_threshold, ALLGATHER_GROUP_NBYTES[kind])
            fuser = self.allgather_fusers[kind] = Fuser(threshold, f"{self.namespace}allgather.{kind}.")
        return fuser

    def _owner_residual(self, ctx, device):
        """What this step reads and writes the owner-side residual of ctx's tensor through (error feedback
        only), reset if the ranks changed."""
        if not self.error_feedback:
            return None
        ctx.owner_residual = self.feedback.owner_residual_for_step(ctx.name, ctx.handle.plan, device, ctx.step)
        return ctx.owner_residual

    def _end_round(self, round_):
        """At the first decompress of round ``round_`` (what was compressed before it), whatever its exchange:
        starts every group still waiting (learned groups with a member missing, tensors never grouped), node-
        aware, two-stage and allgather, and every two-stage group's second stage, before waiting for anything.
        Every decompress calls it; later ones find their round ended. A group that started as its last member
        was compressed ends nothing: the round is told by its number, not by its groups."""
        with self._lock:
            if round_ != self.round:
                return
            self.round += 1
            node_aware = self.node_fuser.end_round()
            fused = self.fuser.end_round()
            for device in sorted(self.allgather_fusers):
                fused += self.allgather_fusers[device].end_round()
        for name, members in node_aware:
            self.node_exchanges.start(members, name)
        for name, members in fused:
            self._start_group(name, members)
        self._start_second_stages()

    def _start_second_stages(self):
        """Starts the second stage of every group whose first stage is under way.

        Called at the round's first ``decompress``, once the groups still
        waiting for a member started their alltoalls. Horovod's optimizer
        decompresses in hook order, which differs between ranks, and
        collectives are matched by name: a rank that waited for
        one group's allgather before starting the others' could wait for a
        peer that waits for it. Starting all of them here, before waiting on
        any, cannot deadlock in any order of calls. After a refusal, this
        group's and every later group's second stage carry a refusal notice,
        sent without waiting for their first stage (ranks that grouped
        otherwise may never start it): every peer raises instead of waiting.
        """
        with self._lock:
            groups = sorted(self._first_stages, key=lambda g: g.name)
            self._first_stages = []
        refused = None
        for group in groups:
            if refused is None:
                received, received_splits = self.node_exchanges.synchronize(group.handle)
                collective = group.conduct.send((received, received_splits.tolist()))
                refused = collective.refusal
            else:
                collective = group.conduct.throw(RefusedEarlier(refused))
            group.handle, group.final = None, group.transport.start(collective)
            sent = collective.send.numel()
            self.stats.add(bytes_sent_second_stage=sent, bytes_sent=sent, collectives_started=1)
        if refused is not None:
            raise refused


class _Alone:
    """A tensor whose exchange the engine conducts alone: the allgather, started at compress."""
    __slots__ = ("plan", "conduct", "handle")

    def __init__(self, plan, conduct, handle):
        self.plan, self.conduct, self.handle = plan, conduct, handle

    def join(self, exchanges, ctx, site):
        """Nothing to group with."""

    def receive(self, exchanges, ctx):
        return exchanges.node_exchanges.synchronize(self.handle)

    def result(self, exchanges, ctx, received):
        gathered, _ = conclude(self.conduct, received)  # one collective: nothing to refuse
        self.conduct = None
        total = ctx.zeroed_output(gathered.device)
        self.plan.decode(as_array(gathered), as_array(total))
        return total


class _Fused:
    """A tensor waiting for the rest of its group (:class:`_Group`), whose exchange the engine conducts: its
    flat gradient and residual, encoded with the whole group's when the group starts (one launch sequence for
    all members on a GPU); ``group``, ``index``: its group once started, and its place there."""
    __slots__ = ("plan", "flat", "residual", "process_set", "round", "fuser", "group", "index")

    def __init__(self, plan, flat, residual, process_set, round_, fuser):
        self.plan, self.flat, self.residual, self.process_set, self.round = plan, flat, residual, process_set, round_
        self.fuser, self.group, self.index = fuser, None, None

    def join(self, exchanges, ctx, site):
        with exchanges._lock:
            ready = self.fuser.add((site.process_set.process_set_id, site.name), self.plan.fusion_nbytes(), ctx)
        for name, members in ready:
            exchanges._start_group(name, members)

    def receive(self, exchanges, ctx):
        exchanges._end_round(self.round)
        if self.group.results is None:
            return exchanges.node_exchanges.synchronize(self.group.final)
        return None  # decoded with an earlier member of its group

    def result(self, exchanges, ctx, received):
        """The first member of a group to be decompressed decodes them all, in one pass.

        The group lets go of its members once decoded, and each member of the group: a reference cycle
        would keep every step's residual copies and buffers alive until Python's cycle collector ran
        (measured: Top-k's step 2.5x slower, every large allocation page-faulting afresh).
        """
        group = self.group
        if group.results is None:
            # a refusal of this rank was raised as its second stage started; the notices in what arrived make
            # the decode raise for every member decompressed after that
            gathered, _ = conclude(group.conduct, received)
            group.conduct = group.transport = None
            outs = [member.zeroed_output(gathered.device) for member in group.members]
            group.fused.decode(as_array(gathered), [as_array(out) for out in outs])
            group.results, group.members = outs, None
        result, group.results[self.index] = group.results[self.index], None
        self.group = None
        return result


class _Group:
    """Tensors that share their collectives (:mod:`horovod_qsgd.common.fusion`): one allgather, or one alltoall
    and one allgather; the engine's conduct of their exchange, the handles of the collective in flight:
    ``handle`` (the alltoall) until ``final`` (the allgather whose result is decoded) has started."""
    __slots__ = ("name", "fused", "members", "transport", "conduct", "handle", "final", "results")

    def __init__(self, name, fused, members, transport, conduct, handle):
        self.name, self.fused, self.members, self.transport, self.conduct = name, fused, members, transport, conduct
        self.handle, self.final, self.results = handle, None, None


class _NodeAware:
    """A tensor in the node-aware exchange (:mod:`horovod_qsgd.torch.node_aware`), alone or fused."""
    __slots__ = ("member", "round")

    def __init__(self, member, round_):
        self.member, self.round = member, round_

    def join(self, exchanges, ctx, site):
        ctx.owner_residual = self.member.owner_residual
        if exchanges.fusion_threshold == 0:  # alone, under its own collectives' names (TensorFlow's wire)
            exchanges.node_exchanges.start([self.member])
        else:
            plan = self.member.plan
            with exchanges._lock:
                ready = exchanges.node_fuser.add((plan.fusion_scope, site.name), 4 * plan.padded_numel(), self.member)
            for name, members in ready:
                exchanges.node_exchanges.start(members, name)
        exchanges.node_exchanges.progress()

    def receive(self, exchanges, ctx):
        exchanges._end_round(self.round)
        return exchanges.node_exchanges.wait(self.member)

    def result(self, exchanges, ctx, result):
        """``result`` in the gradient's memory where it may be, and the shard residual back in this step's
        residual."""
        member = self.member
        if member.shard_residual is not None:
            begin, end = member.plan.own_span()
            ctx.residual.target[begin:end] = member.shard_residual[:end - begin]
        ctx.handle = None
        return result if ctx.out is None else ctx.out.copy_(result)
